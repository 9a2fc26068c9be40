//! Listeners, connections and the life of the process: start, reload, graceful stop.
//!
//! - Every listener is bound before anything is served, and its real address is logged (port 0
//!   works), so a bad address fails the start rather than half of it.
//! - Connections are served by `server.workers` worker threads, each with its own
//!   single-threaded runtime (see [`start_workers`]); worker 0 is the caller's runtime, which
//!   also runs the store, the admin listener and the sweep. A reload's file reads and parsing
//!   run on tokio's blocking pool. What a request needs of its worker (its index, its cache of
//!   `ip` buckets: [`Worker`]) and of its server (the activity clock) is passed down with the
//!   connection, never kept in a static or a thread-local.
//! - The accept loop survives errors (EMFILE and friends): it backs off, and the failures are
//!   logged at most once a second across all workers, with a count of those not logged
//!   ([`open_files`], which also raises the open-file limit at start). It holds one permit of a
//!   `max_connections` semaphore per open connection: beyond the limit, accept simply waits.
//! - Each connection runs in its own task: on TLS listeners the handshake first, under
//!   `header_read_timeout`, so a stalled handshake blocks nobody; then hyper-util's auto builder
//!   (HTTP/1.1, or HTTP/2 by ALPN or prior knowledge), and a watchdog that closes a connection
//!   when no byte has moved or no request has been in progress for `idle_timeout`, or when an
//!   HTTP/1.1 connection has waited `header_read_timeout` for a request's head.
//! - A WebSocket session is the rest of its connection's life, in the same task: after hyper
//!   hands over a checked `101` (see `forward::Splice`), the task splices the two sides under
//!   the same watchdog (bytes rule only) and the same shutdown, still holding its
//!   `max_connections` permit and its place in the open-connections gauge. Until it closes it
//!   counts as in flight, so a drain waits for it up to `shutdown_timeout`.
//! - HTTP/2: at most [`H2_MAX_STREAMS`] streams in flight per connection, and a stream whose
//!   response the client does not take (its flow-control window kept closed) is reset after
//!   `idle_timeout`, which also drops its upstream request ([`streams`] has the rule). Pings
//!   answered on such a connection do not keep it open: once its streams are reset, no request
//!   is in progress and the watchdog closes it.
//! - The counter store is started by [`crate::store::start`] (store selection, start-up
//!   retry, sweeps, the coalescing queue), without waiting for a database that is down: the
//!   server serves with the [`crate::store::StoreHandle`] it gets back and aborts its tasks on
//!   stop. [`Server::builder`] can hand it a store or a clock of the caller's instead.
//! - Stop: listeners close, connections are asked to finish (HTTP/1.1 after the current
//!   response, HTTP/2 with GOAWAY), and after `shutdown_timeout` whatever is left is dropped.

mod coarse_clock;
mod open_files;
pub mod proxy_protocol;
mod streams;
mod worker;

pub use open_files::{raise_open_file_limit, OpenFileLimit};
pub use worker::Worker;

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;

use crate::admin;
use crate::body::ProxyBody;
use crate::config::{self, Config};
use crate::error::StartupError;
use crate::fallback::{self, Instances, LocalFallback};
use crate::forward::Splice;
use crate::framing::FramingGuard;
use crate::key::BucketHasher;
use crate::limit::Limiter;
use crate::metrics::Metrics;
use crate::proxy::{ConnInfo, Proxy, Runtime};
use crate::store::{self, Clock, Store, StoreHandle, StoreOptions};
use coarse_clock::CoarseClock;
use open_files::AcceptErrors;
use streams::{NewStreams, StreamExecutor, StreamProgress};

/// HTTP/2 keep-alive pings: a peer that stops answering is dropped.
const H2_KEEPALIVE: Duration = Duration::from_secs(20);
/// HTTP/2 streams in flight per connection (SPEC 5): with a stalled stream reset after
/// `idle_timeout`, what one client connection can hold upstream at once.
const H2_MAX_STREAMS: u32 = 100;
/// Back-off after a failed accept (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    /// Stop accepting; connections finish what they are doing.
    Draining,
    /// Shutdown timeout passed: drop whatever is left.
    Forced,
    /// Shutdown is over: the workers end their runtimes and threads.
    Stopped,
}

pub struct Server;

/// A server to start, with what it may be given instead of what its configuration names.
pub struct ServerBuilder {
    config: Config,
    store: StoreOptions,
    log_drops: Option<Counter>,
}

impl ServerBuilder {
    /// The clock the memory store counts windows by (default: the system's), so that tests
    /// can cross a window boundary without waiting for it.
    pub fn clock(mut self, clock: Clock) -> Self {
        self.store.clock = clock;
        self
    }

    /// Counts in `store` instead of the configured store (no sweep, no database tasks).
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store.store = Some(store);
        self
    }

    /// `tollgate_log_lines_dropped_total` reads this count: the process's log writer's
    /// (`log_writer::LogWriter::dropped`). Without it the metric stays 0.
    pub fn log_drops(mut self, dropped: Counter) -> Self {
        self.log_drops = Some(dropped);
        self
    }

    /// Binds every listener, starts the store and begins serving.
    pub async fn start(self) -> Result<RunningServer, StartupError> {
        let metrics = Metrics::with_log_drops(self.log_drops.unwrap_or_default());
        Server::start_with(self.config, self.store, Arc::new(metrics)).await
    }
}

/// A started tollgate: its bound addresses and the handles to reload or stop it.
pub struct RunningServer {
    /// Plain listeners' bound addresses, in configuration order.
    pub listen_addrs: Vec<SocketAddr>,
    /// TLS listeners' bound addresses, in configuration order.
    pub tls_addrs: Vec<SocketAddr>,
    pub admin_addr: Option<SocketAddr>,
    /// The certificates TLS listeners hand out; replaced on reload.
    tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    proxy: Arc<Proxy>,
    metrics: Arc<Metrics>,
    store: Arc<dyn Store>,
    phase: watch::Sender<Phase>,
    permits: Arc<Semaphore>,
    max_connections: u32,
    shutdown_timeout: Duration,
    /// Settings a reload cannot change, to warn about.
    started_with: Arc<Config>,
    fatal: mpsc::Receiver<String>,
    background: Vec<JoinHandle<()>>,
    /// The threads of connection workers 1..; they end once the phase is `Stopped`.
    workers: Vec<std::thread::JoinHandle<()>>,
    /// What each worker keeps for its requests, by worker index.
    worker_state: Vec<Arc<Worker>>,
    /// This server's clock of connection activity.
    clock: Arc<CoarseClock>,
}

impl Server {
    /// Binds every listener, starts the store and begins serving.
    pub async fn start(config: Config) -> Result<RunningServer, StartupError> {
        Server::builder(config).start().await
    }

    pub fn builder(config: Config) -> ServerBuilder {
        ServerBuilder {
            config,
            store: StoreOptions::default(),
            log_drops: None,
        }
    }

    async fn start_with(
        mut config: Config,
        store_options: StoreOptions,
        metrics: Arc<Metrics>,
    ) -> Result<RunningServer, StartupError> {
        // Decided once: the worker count sizes per-worker state (upstream clients), and a
        // reload keeps it.
        config.server.workers = Some(config.server.worker_count());
        let config = Arc::new(config);
        let hasher = BucketHasher::new(config.keys.secret.as_deref());
        if !hasher.is_keyed() {
            tracing::warn!(
                "keys.secret is not set: bucket digests are plain SHA-256 of the subject, which \
                 anyone can recompute for a guessed address or token; set a secret"
            );
        }
        let runtime = Runtime::build(config.clone())?;
        let tls = if config.server.tls_listen.is_empty() {
            None
        } else {
            let server_config = crate::tls::server_config(&config.server.certs)
                .map_err(|e| StartupError::Tls(e.to_string()))?;
            Some(Arc::new(ArcSwap::new(server_config)))
        };

        // Bind everything first: a bad address fails the start before anything serves.
        let mut listeners = Vec::new();
        let plain = config.server.listen.iter().map(|a| (a, None));
        let secure = config.server.tls_listen.iter().map(|a| (a, tls.clone()));
        for (addr, tls) in plain.chain(secure) {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| StartupError::Bind {
                    addr: *addr,
                    source,
                })?;
            listeners.push((listener, tls));
        }
        let admin_listener = match &config.admin {
            Some(admin) => Some(TcpListener::bind(admin.listen).await.map_err(|source| {
                StartupError::Bind {
                    addr: admin.listen,
                    source,
                }
            })?),
            None => None,
        };

        let clock = Arc::new(CoarseClock::new());
        let mut background = vec![tokio::spawn(clock.clone().run())];
        let StoreHandle {
            store,
            postgres: pg,
            fatal,
            tasks,
        } = store::start(&config, &hasher, &metrics, store_options).await?;
        background.extend(tasks);
        let instances = Arc::new(Instances::new(metrics.instances.clone()));
        let limiter =
            Limiter::new(store.clone(), config.store.timeout, metrics.clone()).with_local_fallback(
                LocalFallback::new(config.store.memory_buckets, instances.clone()),
            );
        if let Some(pg) = pg {
            // The registry of live instances (SPEC 5b) and the reset listener (SPEC 3b).
            background.push(tokio::spawn(fallback::keep_registered(
                pg.clone(),
                instances,
            )));
            let denials = limiter.denials();
            background.push(tokio::spawn(
                pg.listen_for_resets(move |event| denials.on_reset(event)),
            ));
        }
        let proxy = Arc::new(Proxy::new(runtime, limiter, hasher, metrics.clone()));

        let (phase, phase_rx) = watch::channel(Phase::Running);
        let max_connections = u32::try_from(config.server.max_connections).unwrap_or(u32::MAX);
        let permits = Arc::new(Semaphore::new(max_connections as usize));
        let settings = ConnSettings {
            header_read_timeout: config.server.header_read_timeout,
            idle_timeout: config.server.idle_timeout,
        };
        let mut listen_addrs = Vec::new();
        let mut tls_addrs = Vec::new();
        let mut shared = Vec::new();
        for (listener, tls) in listeners {
            let addr = listener.local_addr().map_err(|source| StartupError::Bind {
                addr: SocketAddr::from(([0, 0, 0, 0], 0)),
                source,
            })?;
            tracing::info!(address = %addr, tls = tls.is_some(), "listening");
            if tls.is_some() {
                tls_addrs.push(addr);
            } else {
                listen_addrs.push(addr);
            }
            let listener = listener
                .into_std()
                .map_err(|source| StartupError::Bind { addr, source })?;
            shared.push((listener, addr, tls));
        }
        let shared_with_workers = SharedWithWorkers {
            proxy: proxy.clone(),
            settings,
            permits: permits.clone(),
            phase: phase_rx.clone(),
            metrics: metrics.clone(),
            clock: clock.clone(),
            accept_errors: Arc::new(AcceptErrors::default()),
            proxy_protocol: config.server.proxy_protocol.as_ref().map(|p| {
                Arc::new(HeaderGate {
                    from: p.from.clone(),
                    refusals: AcceptErrors::default(),
                })
            }),
        };
        let worker_state: Vec<Arc<Worker>> = (0..config.server.worker_count())
            .map(|index| Arc::new(Worker::new(index)))
            .collect();
        let workers = start_workers(&worker_state, &shared, &shared_with_workers)?;
        // Every worker holds its own duplicate of each listening socket; the originals close
        // here, so a listener closes as soon as the last worker stops accepting on it.
        drop(shared);
        let admin_addr = match admin_listener {
            Some(listener) => {
                let addr = listener.local_addr().ok();
                if let Some(addr) = addr {
                    tracing::info!(address = %addr, "admin listening");
                }
                background.push(tokio::spawn(admin::serve(
                    listener,
                    metrics.clone(),
                    store.clone(),
                    stopped(phase_rx.clone()),
                )));
                addr
            }
            None => None,
        };
        tracing::info!(
            store = store.kind(),
            workers = config.server.worker_count(),
            "tollgate started"
        );
        Ok(RunningServer {
            listen_addrs,
            tls_addrs,
            admin_addr,
            tls,
            proxy,
            metrics,
            store,
            phase,
            permits,
            max_connections,
            shutdown_timeout: config.server.shutdown_timeout,
            started_with: config,
            fatal,
            background,
            workers,
            worker_state,
            clock,
        })
    }
}

impl RunningServer {
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Its connection workers' own state, by worker index.
    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.worker_state
    }

    /// Milliseconds since this server started, on the coarse clock its connections' idle
    /// and header-read timeouts are measured by.
    pub fn coarse_clock_ms(&self) -> u64 {
        self.clock.now_ms()
    }

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
        // new file's store policy with the old store (SPEC 8).
        config.store = old.store.clone();
        config.keys = old.keys.clone();
        let tls = self.tls.is_some();
        let prepared = tokio::task::spawn_blocking(move || prepare_reload(config, tls)).await;
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(err) => Err(ReloadRejected::Runtime(err.to_string())),
        };
        match prepared {
            Ok((runtime, certs)) => {
                if let (Some(current), Some(certs)) = (&self.tls, certs) {
                    current.store(certs);
                }
                self.proxy.replace_runtime(runtime);
                self.metrics.reload("success");
                tracing::info!("reload: configuration applied");
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

    /// Resolves when the server cannot go on (e.g. the database holds another key
    /// fingerprint); the message says why.
    pub async fn fatal(&mut self) -> String {
        match self.fatal.recv().await {
            Some(message) => message,
            None => std::future::pending().await,
        }
    }

    /// Graceful stop: no new connections, in-flight requests get up to `shutdown_timeout`.
    pub async fn shutdown(self) {
        let _ = self.phase.send(Phase::Draining);
        let drained = tokio::time::timeout(
            self.shutdown_timeout,
            self.permits.acquire_many(self.max_connections),
        )
        .await;
        if drained.is_err() {
            tracing::warn!("shutdown timeout reached; closing the remaining connections");
            let _ = self.phase.send(Phase::Forced);
            // Give the connection tasks a moment to drop their sockets.
            let _ = tokio::time::timeout(
                Duration::from_millis(200),
                self.permits.acquire_many(self.max_connections),
            )
            .await;
        }
        for task in &self.background {
            task.abort();
        }
        let _ = self.phase.send(Phase::Stopped);
        let workers = self.workers;
        let _ = tokio::task::spawn_blocking(move || {
            for worker in workers {
                let _ = worker.join();
            }
        })
        .await;
        tracing::info!("tollgate stopped");
    }
}

/// Why a reload's preparation failed.
enum ReloadRejected {
    Certs(String),
    Runtime(String),
}

/// The blocking part of a reload: the listeners' certificates (when there are TLS
/// listeners), then the routes and upstream pools (which read CA files). Certificates load
/// first: a bad one fails the whole reload and nothing changes.
fn prepare_reload(
    config: Config,
    tls: bool,
) -> Result<(Runtime, Option<Arc<rustls::ServerConfig>>), ReloadRejected> {
    let certs = if tls {
        let certs = crate::tls::server_config(&config.server.certs)
            .map_err(|err| ReloadRejected::Certs(err.to_string()))?;
        Some(certs)
    } else {
        None
    };
    let runtime =
        Runtime::build(Arc::new(config)).map_err(|err| ReloadRejected::Runtime(err.to_string()))?;
    Ok((runtime, certs))
}

/// What every connection worker serves with.
#[derive(Clone)]
struct SharedWithWorkers {
    proxy: Arc<Proxy>,
    settings: ConnSettings,
    permits: Arc<Semaphore>,
    phase: watch::Receiver<Phase>,
    metrics: Arc<Metrics>,
    /// The server's clock of connection activity.
    clock: Arc<CoarseClock>,
    /// One rate limit for the accept-failure log line of every worker and listener.
    accept_errors: Arc<AcceptErrors>,
    /// `[server.proxy_protocol]`; `None` (nothing to clone per connection) = no connection
    /// starts with a PROXY header.
    proxy_protocol: Option<Arc<HeaderGate>>,
}

/// Who must open with a PROXY header (SPEC 4), and the rate limit of the line about those
/// refused.
struct HeaderGate {
    from: Vec<ipnet::IpNet>,
    refusals: AcceptErrors,
}

type SharedListener = (
    std::net::TcpListener,
    SocketAddr,
    Option<Arc<ArcSwap<rustls::ServerConfig>>>,
);

/// Starts `count` connection workers, nginx-style: each accepts on every listener (a
/// duplicate of the listening socket, so the kernel hands each new connection to whichever
/// worker accepts it first) and serves its connections to the end on its own thread, with a
/// single-threaded tokio runtime. Worker 0 is the caller's runtime (under `tollgate run`, the
/// main thread, which also runs the store, the admin listener and the sweep); workers 1.. get
/// threads of their own.
///
/// Why not one multi-threaded runtime: measured on this project's benchmark
/// (docs/performance.md), a connection's tasks, its upstream connection and their timers on
/// one thread cost about a quarter less CPU per request than tokio's work-stealing
/// scheduler, and HTTP/2 streams no longer see the long tail latency that the shared
/// scheduler gave them. With one worker, a decision that goes to PostgreSQL never leaves
/// the thread either.
fn start_workers(
    workers: &[Arc<Worker>],
    listeners: &[SharedListener],
    shared: &SharedWithWorkers,
) -> Result<Vec<std::thread::JoinHandle<()>>, StartupError> {
    let Some((first, others)) = workers.split_first() else {
        return Ok(Vec::new());
    };
    for (listener, addr, tls) in listeners {
        let listener = duplicate(listener, *addr)?;
        let worker = first.clone();
        tokio::spawn(accept_loop(listener, tls.clone(), shared.clone(), worker));
    }
    let mut threads = Vec::with_capacity(others.len());
    for worker in others {
        let index = worker.index();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(StartupError::Runtime)?;
        // Register this worker's duplicates of the listeners with its own runtime, here, so
        // that a failure stops the start instead of leaving a worker that serves nothing.
        let mut accepting = Vec::with_capacity(listeners.len());
        {
            let _in_runtime = runtime.enter();
            for (listener, addr, tls) in listeners {
                accepting.push((duplicate(listener, *addr)?, tls.clone()));
            }
        }
        let shared = shared.clone();
        let worker = worker.clone();
        let thread = std::thread::Builder::new()
            .name(format!("tollgate-worker-{index}"))
            .spawn(move || runtime.block_on(run_worker(accepting, shared, worker)))
            .map_err(StartupError::Runtime)?;
        threads.push(thread);
    }
    Ok(threads)
}

/// A duplicate of a listening socket, registered with the current runtime.
fn duplicate(
    listener: &std::net::TcpListener,
    addr: SocketAddr,
) -> Result<TcpListener, StartupError> {
    listener
        .try_clone()
        .and_then(|dup| {
            dup.set_nonblocking(true)?;
            TcpListener::from_std(dup)
        })
        .map_err(|source| StartupError::Bind { addr, source })
}

/// One worker's life: accept until the stop begins, keep serving the connections it has
/// until the stop is over (or the server is dropped), then return, which drops its runtime
/// and whatever that runtime still holds.
async fn run_worker(
    listeners: Vec<(TcpListener, Option<Arc<ArcSwap<rustls::ServerConfig>>>)>,
    shared: SharedWithWorkers,
    worker: Arc<Worker>,
) {
    for (listener, tls) in listeners {
        tokio::spawn(accept_loop(listener, tls, shared.clone(), worker.clone()));
    }
    let mut phase = shared.phase;
    let _ = phase.wait_for(|p| *p == Phase::Stopped).await;
}

#[derive(Debug, Clone, Copy)]
struct ConnSettings {
    header_read_timeout: Duration,
    idle_timeout: Duration,
}

impl ConnSettings {
    /// The watchdog's longest sleep: a deadline of either rule can start at any moment (a
    /// response finishing starts the wait for the next head), so it looks again at least this
    /// often and never wakes late.
    fn next_check(&self) -> Duration {
        self.idle_timeout.min(self.header_read_timeout)
    }
}

/// A future that resolves once the phase leaves Running.
fn stopped(
    mut phase: watch::Receiver<Phase>,
) -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = phase.wait_for(|p| *p != Phase::Running).await;
    })
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<Arc<ArcSwap<rustls::ServerConfig>>>,
    shared: SharedWithWorkers,
    worker: Arc<Worker>,
) {
    let SharedWithWorkers {
        proxy,
        settings,
        permits,
        phase,
        metrics,
        clock,
        accept_errors,
        proxy_protocol: header_gate,
    } = shared;
    let mut stop = stopped(phase.clone());
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            _ = &mut stop => return,
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stop => return,
        };
        let (mut stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(err) => {
                // EMFILE, ENFILE, ECONNABORTED...: the listener is fine, try again shortly.
                accept_errors.note(&err);
                drop(permit);
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let proxy = proxy.clone();
        let phase = phase.clone();
        let metrics = metrics.clone();
        let tls = tls.as_ref().map(|current| current.load_full());
        let header_gate = header_gate.clone();
        let worker = worker.clone();
        let clock = clock.clone();
        tokio::spawn(async move {
            metrics.open_connections.inc();
            // A listed balancer's PROXY header names the client, before TLS and HTTP (SPEC 4).
            let peer = match &header_gate {
                None => peer,
                Some(gate) => {
                    let timeout = settings.header_read_timeout;
                    let header =
                        proxy_protocol::peer_after_header(&mut stream, peer, &gate.from, timeout);
                    match header.await {
                        Ok(peer) => peer,
                        Err(refused) => {
                            gate.refusals.note_refused_header(&refused);
                            metrics.open_connections.dec();
                            drop(permit);
                            return;
                        }
                    }
                }
            };
            match tls {
                None => {
                    let info = ConnInfo::new(peer, false, worker);
                    let guarded = FramingGuard::new(stream);
                    serve_connection(guarded, info, proxy, settings, phase, clock).await;
                }
                Some(server_config) => {
                    // The handshake runs in the connection's own task under a deadline, so
                    // a stalled or half-open handshake holds up nobody else.
                    let acceptor = tokio_rustls::TlsAcceptor::from(server_config);
                    let handshake =
                        tokio::time::timeout(settings.header_read_timeout, acceptor.accept(stream));
                    match handshake.await {
                        Ok(Ok(tls_stream)) => {
                            let info = ConnInfo::new(peer, true, worker);
                            let guarded = FramingGuard::new(tls_stream);
                            serve_connection(guarded, info, proxy, settings, phase, clock).await;
                        }
                        Ok(Err(err)) => tracing::debug!(error = %err, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
            metrics.open_connections.dec();
            drop(permit);
        });
    }
}

async fn serve_connection<S>(
    stream: FramingGuard<S>,
    info: ConnInfo,
    proxy: Arc<Proxy>,
    settings: ConnSettings,
    mut phase: watch::Receiver<Phase>,
    clock: Arc<CoarseClock>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new(clock));
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let requests = activity.clone();
    let peer_port = info.peer.port();
    let new_streams = Arc::new(NewStreams::default());
    let streams = new_streams.clone();
    let service = service_fn(move |req| {
        let proxy = proxy.clone();
        let info = info.clone();
        let in_flight = InFlight::start(requests.clone());
        let progress = (req.version() == http::Version::HTTP_2).then(|| streams.start());
        async move {
            let mut response = proxy.handle(req, info).await;
            if response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                // Only the forwarder's checked 101 carries a splice. The switch is armed now,
                // before hyper has the response, so the framing guard steps aside exactly for
                // the bytes after it.
                if let Some(splice) = response.extensions_mut().remove::<Splice>() {
                    in_flight.connection().switch_to(splice);
                }
            }
            // The request stays in progress until its body has been sent (or dropped).
            Ok::<_, Infallible>(response.map(|body| CountedBody {
                body,
                _in_flight: in_flight,
                progress,
            }))
        }
    });
    // HTTP/2 peers are pinged often enough that a dead one is dropped within about the idle
    // timeout even while a request is in flight (when no idle rule applies).
    let h2_ping = H2_KEEPALIVE
        .min(settings.idle_timeout / 2)
        .max(Duration::from_millis(100));
    // Each HTTP/2 stream's task runs under a watch that resets it once the client has not
    // taken its response for `idle_timeout` (see `streams`).
    let executor = StreamExecutor::new(new_streams, settings.idle_timeout);
    let mut builder = auto::Builder::new(executor);
    // hyper's own header-read timer is off: it arms a boxed timer and reads the clock for
    // every request (about 1,300 instructions each), where the watchdog below enforces
    // `header_read_timeout` from the activity it already keeps.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None::<Duration>)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(h2_ping))
        .keep_alive_timeout(h2_ping)
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_header_list_size(crate::framing::MAX_HEAD as u32);
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let served = supervise(conn, &activity, settings, &mut phase, |conn| {
        conn.graceful_shutdown()
    });
    match served.await {
        Some(Ok(())) => {}
        Some(Err(err)) => {
            tracing::debug!(peer = %peer_port, error = %err, "connection ended with an error");
        }
        None => return,
    }

    // After a real 101 the connection goes on as a WebSocket session, here: it keeps this
    // task's permit and gauge place, and counts as in flight until it closes (so only bytes
    // keep it open, and a drain waits for it). A drain that begins meanwhile changes nothing
    // for it; the end of `shutdown_timeout` closes it.
    let Some(splice) = activity.take_splice() else {
        return;
    };
    let _session = InFlight::start(activity.clone());
    let session = splice.run();
    tokio::pin!(session);
    if supervise(session, &activity, settings, &mut phase, |_| {})
        .await
        .is_none()
    {
        tracing::debug!(peer = %peer_port, "WebSocket session closed by tollgate");
    }
}

/// Drives `work` (one connection's part) to its end, or until the watchdog closes the
/// connection (`None`): idle (see [`Activity::time_left`]), or the shutdown timeout has
/// passed. `drain` is called once, when the drain begins.
async fn supervise<F: std::future::Future>(
    mut work: Pin<&mut F>,
    activity: &Activity,
    settings: ConnSettings,
    phase: &mut watch::Receiver<Phase>,
    mut drain: impl FnMut(Pin<&mut F>),
) -> Option<F::Output> {
    let idle = tokio::time::sleep(settings.next_check());
    tokio::pin!(idle);
    let mut draining = false;
    loop {
        tokio::select! {
            output = work.as_mut() => return Some(output),
            changed = phase.changed() => {
                let now = if changed.is_err() { Phase::Forced } else { *phase.borrow() };
                match now {
                    Phase::Running => {}
                    Phase::Draining if !draining => {
                        draining = true;
                        drain(work.as_mut());
                    }
                    Phase::Draining => {}
                    Phase::Forced | Phase::Stopped => return None,
                }
            }
            _ = idle.as_mut() => {
                match activity.time_left(&settings) {
                    Ok(left) => idle.as_mut().reset(tokio::time::Instant::now() + left),
                    Err(rule) => {
                        tracing::debug!(rule, "closing connection");
                        return None;
                    }
                }
            }
        }
    }
}

/// When bytes last moved on a connection (on the coarse clock).
///
/// A connection is idle when no byte has moved for the idle timeout (a stalled upload, a
/// client that stopped reading, a dead peer), or when no request has been in progress for it.
/// The second rule is what closes an idle HTTP/2 connection whose peer keeps answering pings:
/// the pings themselves move bytes.
///
/// On HTTP/1.1 the same record enforces `header_read_timeout`: while no request is in progress
/// the connection is waiting for a head, and that wait may last no longer than the timeout
/// (from the connection's start, or from the end of its previous response, as hyper counts
/// it). An HTTP/2 or upgraded connection has no such wait.
///
/// It also carries the connection's switch to WebSocket, from the service that hands hyper
/// the checked `101` to the framing guard (which steps aside) and to the connection's task
/// (which runs the splice).
struct Activity {
    /// The server's clock these times are on.
    clock: Arc<CoarseClock>,
    last_byte_ms: AtomicU64,
    last_request_ms: AtomicU64,
    in_flight: AtomicU32,
    http1_heads: AtomicBool,
    /// A real `101` is being, or has been, handed to hyper.
    switched: AtomicBool,
    /// Its splice, until the connection's task takes it.
    splice: std::sync::Mutex<Option<Splice>>,
}

impl Activity {
    fn new(clock: Arc<CoarseClock>) -> Self {
        let now = clock.now_ms();
        Activity {
            clock,
            last_byte_ms: AtomicU64::new(now),
            last_request_ms: AtomicU64::new(now),
            in_flight: AtomicU32::new(0),
            http1_heads: AtomicBool::new(true),
            switched: AtomicBool::new(false),
            splice: std::sync::Mutex::new(None),
        }
    }

    /// Arms the switch: from the next read on, the framing guard lets the bytes through, and
    /// once hyper is done the connection's task runs `splice`.
    fn switch_to(&self, splice: Splice) {
        *self.splice.lock().unwrap_or_else(PoisonError::into_inner) = Some(splice);
        self.switched.store(true, Ordering::Release);
    }

    fn take_splice(&self) -> Option<Splice> {
        self.splice
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn touch(&self) {
        self.last_byte_ms
            .store(self.clock.now_ms(), Ordering::Relaxed);
    }

    /// How long the connection may stay open before the watchdog looks again, or the rule that
    /// closes it now: `idle_timeout` (no byte moved, or no request in progress) or, on
    /// HTTP/1.1, `header_read_timeout` (waiting that long for a request's head).
    fn time_left(&self, settings: &ConnSettings) -> Result<Duration, &'static str> {
        let now = self.clock.now_ms();
        let bytes = now.saturating_sub(self.last_byte_ms.load(Ordering::Relaxed));
        let waiting = if self.in_flight.load(Ordering::Acquire) > 0 {
            None
        } else {
            Some(now.saturating_sub(self.last_request_ms.load(Ordering::Relaxed)))
        };
        let quiet = Duration::from_millis(bytes.max(waiting.unwrap_or(0)));
        let Some(mut left) = settings
            .idle_timeout
            .checked_sub(quiet)
            .filter(|d| !d.is_zero())
        else {
            return Err("idle_timeout");
        };
        let head_wait = waiting.filter(|_| self.http1_heads.load(Ordering::Relaxed));
        if let Some(waiting) = head_wait {
            match settings
                .header_read_timeout
                .checked_sub(Duration::from_millis(waiting))
            {
                Some(head_left) if !head_left.is_zero() => left = left.min(head_left),
                _ => return Err("header_read_timeout"),
            }
        }
        Ok(left.min(settings.next_check()))
    }
}

/// One request in progress on a connection, from its headers until its response body is done.
struct InFlight(Arc<Activity>);

/// A response body that keeps its request counted as in progress until hyper drops it; on
/// HTTP/2 it also reports to its stream's watch.
struct CountedBody {
    body: ProxyBody,
    _in_flight: InFlight,
    progress: Option<StreamProgress>,
}

impl http_body::Body for CountedBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        match &mut this.progress {
            Some(progress) => progress.poll_frame(Pin::new(&mut this.body), cx),
            None => Pin::new(&mut this.body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream() && self.progress.as_ref().is_none_or(|p| p.is_drained())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.progress {
            Some(progress) => progress.size_hint(self.body.size_hint()),
            None => self.body.size_hint(),
        }
    }
}

impl InFlight {
    fn start(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        let now = activity.clock.now_ms();
        activity.last_request_ms.store(now, Ordering::Relaxed);
        InFlight(activity)
    }
}

impl InFlight {
    /// The connection this request came on.
    fn connection(&self) -> &Activity {
        &self.0
    }
}

impl Drop for InFlight {
    // Also on cancellation: a request whose client went away no longer counts.
    fn drop(&mut self) {
        let now = self.0.clock.now_ms();
        self.0.last_request_ms.store(now, Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A socket that records its activity for the idle watchdog, including whether its framing
/// guard still expects HTTP/1 heads, and that tells the guard when the connection has
/// switched to WebSocket (the only way the guard learns it).
struct Tracked<S> {
    inner: FramingGuard<S>,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.activity.switched.load(Ordering::Acquire) {
            self.inner.step_aside();
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
            if !self.inner.reads_http1_heads() {
                self.activity.http1_heads.store(false, Ordering::Relaxed);
            }
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
