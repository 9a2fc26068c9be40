//! The store's settings (`[store]` in the configuration file; docs/configuration.md). The
//! store owns them and the configuration loader fills them in, so the store needs nothing
//! else from the configuration.

use std::fmt;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// `None` = the in-process memory store.
    pub url: Option<String>,
    pub pool_size: u32,
    /// Budget for one decision, pool wait included.
    pub timeout: Duration,
    pub on_error: StoreErrorPolicy,
    pub migrate: bool,
    pub sweep_interval: Duration,
    pub synchronous_commit: bool,
    /// Memory store only: live buckets kept at most (docs/configuration.md, `memory_buckets`); past it, the least recently
    /// used one is forgotten. [`DEFAULT_MEMORY_BUCKETS`] unless the file says otherwise.
    pub memory_buckets: NonZeroUsize,
    /// Trust root for TLS to the database (`store.ca_file`, resolved against the config
    /// file's directory); `sslrootcert` in the URL is the other way to give one.
    pub ca_file: Option<PathBuf>,
}

/// `store.memory_buckets` when the file does not set it (docs/configuration.md, `[store]`).
pub const DEFAULT_MEMORY_BUCKETS: usize = 1_000_000;

/// The largest `store.memory_buckets` accepted: the store numbers its slots with 32 bits.
pub const MAX_MEMORY_BUCKETS: usize = u32::MAX as usize;

impl fmt::Debug for StoreConfig {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("url", &self.url.as_ref().map(|_| "<redacted>"))
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("on_error", &self.on_error)
            .field("migrate", &self.migrate)
            .field("sweep_interval", &self.sweep_interval)
            .field("synchronous_commit", &self.synchronous_commit)
            .field("memory_buckets", &self.memory_buckets)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorPolicy {
    /// Fail open: forward the request.
    Allow,
    /// Fail closed: 503 with `Retry-After: 1`.
    Deny,
    /// Each instance limits alone, in memory, at `ceil(requests / live instances)` (docs/configuration.md, `on_error = "local"`).
    Local,
}

impl StoreErrorPolicy {
    /// The value as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorPolicy::Allow => "allow",
            StoreErrorPolicy::Deny => "deny",
            StoreErrorPolicy::Local => "local",
        }
    }
}
