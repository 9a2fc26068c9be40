//! Reloads (SIGHUP): routes, limits, upstreams and certificates swap for new requests;
//! listeners, connection settings, the store and the key secret stay as started, with a
//! warning. The file read, the certificate parsing and the upstream pools' TLS set-up (CA
//! files) run on tokio's blocking pool, so the worker that serves connections and the store
//! does not wait for the disk; the warnings and the swap happen on the caller's runtime.

use std::path::Path;
use std::sync::{Arc, PoisonError};

use sha2::{Digest, Sha256};

use super::RunningServer;
use crate::config::{self, Config};
use crate::pipeline::Runtime;

impl RunningServer {
    /// Re-reads the configuration file (SIGHUP). On any error the old configuration keeps
    /// serving and the error is logged; returns whether the new one was applied. The file is
    /// read and parsed on tokio's blocking pool, not on the worker that calls this.
    pub async fn reload_from(
        &self,
        path: &Path,
        env: impl Fn(&str) -> Option<String> + Send + 'static,
    ) -> bool {
        let path = path.to_owned();
        let loaded = tokio::task::spawn_blocking(move || config::load_file(&path, &env)).await;
        match loaded {
            Ok(Ok(config)) => self.reload(config).await,
            Ok(Err(errors)) => {
                for line in errors.to_string().lines() {
                    tracing::error!("reload: {line}");
                }
                tracing::error!("reload: configuration rejected; the previous one keeps serving");
                self.metrics.reload("failure");
                false
            }
            Err(err) => {
                tracing::error!(error = %err, "reload: reading the configuration failed; the previous one keeps serving");
                self.metrics.reload("failure");
                false
            }
        }
    }

    /// Swaps routes, limits and upstreams for new requests. Listeners, store settings and
    /// the key secret stay as started (changing them needs a restart), with a warning.
    /// Certificates and upstream TLS settings are read and parsed on tokio's blocking pool.
    pub async fn reload(&self, mut config: Config) -> bool {
        let old = &self.started_with;
        if config.server.listen != old.server.listen
            || config.server.tls_listen != old.server.tls_listen
            || config.server.proxy_protocol != old.server.proxy_protocol
            || config.admin.as_ref().map(|a| a.listen) != old.admin.as_ref().map(|a| a.listen)
        {
            tracing::warn!("reload: listener addresses or server.proxy_protocol changed; they apply only after a restart");
        }
        let (new_server, old_server) = (&config.server, &old.server);
        if new_server.header_read_timeout != old_server.header_read_timeout
            || new_server.idle_timeout != old_server.idle_timeout
            || new_server.max_connections != old_server.max_connections
            || new_server.shutdown_timeout != old_server.shutdown_timeout
        {
            tracing::warn!("reload: connection settings (timeouts, max_connections) changed; they apply only after a restart");
        }
        if config.server.workers.is_some() && config.server.workers != old.server.workers {
            tracing::warn!("reload: server.workers changed; it applies only after a restart");
        }
        config.server.workers = old.server.workers;
        if config.store != old.store {
            tracing::warn!("reload: store settings changed; they apply only after a restart");
        }
        if config.keys.secret != old.keys.secret {
            tracing::warn!("reload: keys.secret changed; it applies only after a restart of every instance (see tollgate migrate --accept-new-key)");
        }
        // What a reload cannot change stays as started, so the running rules never mix the
        // new file's store policy with the old store (contract §8).
        config.store = old.store.clone();
        config.keys = old.keys.clone();
        let tls = self.tls.is_some();
        let prepared = tokio::task::spawn_blocking(move || prepare_reload(config, tls)).await;
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(err) => Err(ReloadRejected::Runtime(err.to_string())),
        };
        match prepared {
            Ok((runtime, certs, digest)) => {
                if let (Some(current), Some(certs)) = (&self.tls, certs) {
                    current.store(certs);
                }
                self.proxy.replace_runtime(runtime);
                self.applied(digest);
                true
            }
            Err(ReloadRejected::Certs(err)) => {
                tracing::error!(error = %err, "reload: certificates rejected; the previous configuration keeps serving");
                self.metrics.reload("failure");
                false
            }
            Err(ReloadRejected::Runtime(err)) => {
                tracing::error!(error = %err, "reload: configuration rejected; the previous one keeps serving");
                self.metrics.reload("failure");
                false
            }
        }
    }
}

impl RunningServer {
    /// Counts and logs an applied reload: `unchanged` when what it was built from is what
    /// already served (an operator who edited another file, or signalled before saving, is
    /// told so instead of "applied"), else `success`. Either way the new rules were swapped
    /// in: a reload that changes nothing costs what any reload costs, and a wrong guess here
    /// could only mislabel one, never keep a change from applying.
    fn applied(&self, digest: [u8; 32]) {
        let unchanged = {
            let mut serving = self.serving.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::replace(&mut *serving, digest) == digest
        };
        if unchanged {
            self.metrics.reload("unchanged");
            tracing::info!("reload: configuration unchanged: the file, and the certificates and CA files it names, say what already serves");
        } else {
            self.metrics.reload("success");
            tracing::info!("reload: configuration applied");
        }
    }
}

/// What a configuration serves from, as a digest, to tell a reload that changes nothing: the
/// configuration in its `Debug` form (every value the file and the environment gave, after
/// the reload kept what it cannot change, but not the file's path; comments and layout leave
/// no trace), then the path and bytes of each file it names that a reload reads again
/// (certificates, their keys, upstream CA files): a certificate renewed under the same path
/// is a change. Each part is length-prefixed. Reads files: call it on tokio's blocking pool,
/// or at start.
pub(super) fn serving_digest(config: &Config) -> [u8; 32] {
    let mut hash = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    let values = Config {
        source: Default::default(),
        ..config.clone()
    };
    part(format!("{values:?}").as_bytes());
    let certs = config.server.certs.iter().flat_map(|c| [&c.cert, &c.key]);
    let ca_files = config.upstreams.iter().filter_map(|u| u.ca_file.as_ref());
    for path in certs.chain(ca_files) {
        part(path.as_os_str().as_encoded_bytes());
        // An unreadable file fails the reload anyway; its digest only has to differ from
        // any contents.
        match std::fs::read(path) {
            Ok(bytes) => part(&bytes),
            Err(err) => part(format!("unreadable: {err}").as_bytes()),
        }
    }
    hash.finalize().into()
}

/// Why a reload's preparation failed.
enum ReloadRejected {
    Certs(String),
    Runtime(String),
}

/// The blocking part of a reload: the listeners' certificates (when there are TLS
/// listeners), then the routes and upstream pools (which read CA files), and the
/// [`serving_digest`] of it all. Certificates load first: a bad one fails the whole reload
/// and nothing changes.
fn prepare_reload(config: Config, tls: bool) -> Result<Prepared, ReloadRejected> {
    let certs = if tls {
        let certs = crate::tls::server_config(&config.server.certs)
            .map_err(|err| ReloadRejected::Certs(err.to_string()))?;
        Some(certs)
    } else {
        None
    };
    let digest = serving_digest(&config);
    let runtime =
        Runtime::build(Arc::new(config)).map_err(|err| ReloadRejected::Runtime(err.to_string()))?;
    Ok((runtime, certs, digest))
}

/// A reload ready to swap in: the rules, the listeners' certificates, the [`serving_digest`].
type Prepared = (Runtime, Option<Arc<rustls::ServerConfig>>, [u8; 32]);
