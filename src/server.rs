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
//! - HTTP/2: at most `H2_MAX_STREAMS` (100) streams in flight per connection, and a stream whose
//!   response the client does not take (its flow-control window kept closed) is reset after
//!   `idle_timeout`, which also drops its upstream request ([`streams`] has the rule). Pings
//!   answered on such a connection do not keep it open: once its streams are reset, no request
//!   is in progress and the watchdog closes it.
//! - The counter store is started by [`store_start::start`] (store selection, start-up
//!   retry, sweeps, the coalescing queue), without waiting for a database that is down: the
//!   server serves with the [`StoreHandle`] it gets back and aborts its tasks on
//!   stop. [`Server::builder`] can hand it a store or a clock of the caller's instead.
//! - Stop: listeners close, connections are asked to finish (HTTP/1.1 after the current
//!   response, HTTP/2 with GOAWAY), and after `shutdown_timeout` whatever is left is dropped.
//!
//! Here: binding, the workers and their accept loops, the start and the stop. One
//! connection's life is in [`connection`], reloads in [`reload`], the store's start in
//! [`store_start::start`].

mod coarse_clock;
mod connection;
mod open_files;
mod overrides;
pub mod proxy_protocol;
mod reload;
mod store_start;
mod streams;

pub use crate::pipeline::Worker;
pub use open_files::raise_open_file_limit;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;

use crate::access_log::AccessLog;
use crate::admin;
use crate::config::Config;
use crate::error::StartupError;
use crate::key::BucketHasher;
use crate::limit::fallback::{self, Instances, LocalFallback};
use crate::limit::overrides::Overrides;
use crate::limit::reserve::{self, Shares};
use crate::limit::Limiter;
use crate::metrics::Metrics;
use crate::pipeline::{ConnInfo, Proxy, Runtime};
use crate::store::{Clock, ResetEvent, Store};
use coarse_clock::CoarseClock;
use connection::{serve_connection, ConnSettings};
use open_files::AcceptErrors;
use overrides::OverrideReader;
use store_start::{StoreHandle, StoreOptions};

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
    access_log: Option<AccessLog>,
    paths: Http1Paths,
}

/// Which of tollgate's own HTTP/1.1 implementations may carry requests; each has hyper's
/// beside it, which can carry every request (docs/architecture.md, `server` and `forward.rs`
/// in "Modules"). Both are on by default: the switches exist so that a test can send the
/// same request through every pairing of server and client and hold them to one contract,
/// and so that `tollgate run --http1 hyper` can turn both off.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http1Paths {
    /// tollgate's own server path for simple requests (`http1::server`).
    pub(crate) fast_server: bool,
    /// tollgate's own client for bodyless plain-HTTP requests (`http1::client`).
    pub(crate) direct_client: bool,
}

impl Http1Paths {
    /// `fast` with both of tollgate's own on (`run --http1`'s default), `hyper` with neither,
    /// else `mixed` (tests only): the start line's `http1` field.
    fn name(self) -> &'static str {
        match (self.fast_server, self.direct_client) {
            (true, true) => "fast",
            (false, false) => "hyper",
            _ => "mixed",
        }
    }
}

impl ServerBuilder {
    /// The clock the memory store counts windows by (default: the system's), so that tests
    /// can cross a window boundary without waiting for it. The limiter's cache of exhausted
    /// buckets keeps its deadlines on it too, whatever the store: with PostgreSQL (which
    /// counts on the database's clock) a stopped clock keeps cached denials until it moves.
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

    /// The access log its connection workers write into, each in blocks of its own
    /// (`crate::access_log`). Without one, access-log lines are `tracing` events, for the
    /// subscriber the program installed.
    pub fn access_log(mut self, log: AccessLog) -> Self {
        self.access_log = Some(log);
        self
    }

    /// Whether HTTP/1.1 connections begin on tollgate's own server path for simple requests
    /// (default: true). False: every HTTP/1.1 request goes through the framing guard and
    /// hyper's server, as one the simple path hands over does. For tests that hold both
    /// servers to one contract, and `run --http1 hyper`.
    pub fn http1_fast_path(mut self, on: bool) -> Self {
        self.paths.fast_server = on;
        self
    }

    /// Whether a request without a body to a plain-HTTP, HTTP/1.1 upstream goes on tollgate's
    /// own client (`http1::client`; default: true). False: hyper's client carries every
    /// request, as it does those with a body. For tests that hold both clients to one
    /// contract, and `run --http1 hyper`; kept across reloads.
    pub fn http1_direct_client(mut self, on: bool) -> Self {
        self.paths.direct_client = on;
        self
    }

    /// Binds every listener, starts the store and begins serving.
    pub async fn start(self) -> Result<RunningServer, StartupError> {
        let metrics = Arc::new(Metrics::with_log_drops(self.log_drops.unwrap_or_default()));
        let (config, store, paths) = (self.config, self.store, self.paths);
        Server::start_with(config, store, metrics, paths, self.access_log).await
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
    /// The digest of what the configuration that serves was built from, to tell a reload
    /// that changes nothing (`reload::serving_digest`).
    serving: std::sync::Mutex<[u8; 32]>,
    fatal: mpsc::Receiver<String>,
    background: Vec<JoinHandle<()>>,
    /// This instance's row in the registry of live instances (contract §5b), deleted on shutdown.
    registration: Option<fallback::Registration>,
    /// Reserved shares and their store, given back on shutdown (contract §3c).
    give_back: Option<(Arc<Shares>, Arc<dyn Store>)>,
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
            access_log: None,
            paths: Http1Paths {
                fast_server: true,
                direct_client: true,
            },
        }
    }

    async fn start_with(
        mut config: Config,
        store_options: StoreOptions,
        metrics: Arc<Metrics>,
        paths: Http1Paths,
        access_log: Option<AccessLog>,
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
            let server_config =
                crate::tls::server_config(&config.server.certs).map_err(StartupError::from)?;
            Some(Arc::new(ArcSwap::new(server_config)))
        };

        // Bind everything first: a bad address fails the start before anything serves.
        let (listeners, admin_listener) = bind_listeners(&config, &tls).await?;

        let clock = Arc::new(CoarseClock::new());
        let mut background = vec![tokio::spawn(clock.clone().run())];
        // The limiter's cache of exhausted buckets keeps its deadlines on the memory store's
        // clock, so that both let go of a window at the same moment (a test's clock too).
        let store_clock = store_options.clock.clone();
        let StoreHandle {
            store,
            postgres: pg,
            fatal,
            tasks,
        } = store_start::start(&config, &hasher, &metrics, store_options).await?;
        background.extend(tasks);
        let instances = Arc::new(Instances::new(metrics.instances.clone()));
        let limiter = Limiter::new(
            store.clone(),
            config.store.timeout,
            config.server.worker_count(),
            metrics.clone(),
            store_clock,
        )
        .with_local_fallback(LocalFallback::new(
            config.store.memory_buckets,
            instances.clone(),
        ))
        .with_shares(Arc::new(Shares::new(
            config.server.worker_count(),
            instances.clone(),
            metrics.reserved_units.clone(),
        )));
        let shares = limiter.shares();
        if let Some(shares) = &shares {
            background.push(tokio::spawn(reserve::give_back_when_due(
                shares.clone(),
                limiter.store().clone(),
            )));
        }
        let mut registration = None;
        let overrides = Arc::new(Overrides::default());
        if let Some(pg) = pg {
            // The registry of live instances (contract §5b), the overrides (contract §3e,
            // read once before serving when the database answers) and the reset listener
            // (contract §3b), which also tells the overrides' reader of changes.
            registration = Some(fallback::Registration::start(pg.clone(), instances));
            let mut reader =
                OverrideReader::new(pg.clone(), overrides.clone(), metrics.overrides.clone());
            reader.read().await;
            let reader_hears = reader.hears();
            background.push(tokio::spawn(reader.run()));
            let denials = limiter.denials();
            let listener_up = metrics.reset_listener_up.clone();
            let shares = shares.clone();
            background.push(tokio::spawn(pg.listen_for_resets(move |event| {
                if let ResetEvent::Hearing(hearing) = event {
                    listener_up.set(i64::from(hearing));
                }
                denials.on_reset(event);
                if let Some(shares) = &shares {
                    shares.on_event(event);
                }
                reader_hears(event);
            })));
        }
        let give_back = shares.map(|shares| (shares, limiter.store().clone()));
        let proxy = Proxy::new(runtime, limiter, hasher, metrics.clone()).with_overrides(overrides);
        let proxy = Arc::new(proxy.with_direct_client(paths.direct_client));

        let (phase, phase_rx) = watch::channel(Phase::Running);
        let max_connections = u32::try_from(config.server.max_connections).unwrap_or(u32::MAX);
        let permits = Arc::new(Semaphore::new(max_connections as usize));
        let settings = ConnSettings {
            header_read_timeout: config.server.header_read_timeout,
            idle_timeout: config.server.idle_timeout,
            fast_path: paths.fast_server,
        };
        let SharedListeners {
            sockets: shared,
            plain: listen_addrs,
            tls: tls_addrs,
        } = to_shared_listeners(listeners)?;
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
            .map(|index| Arc::new(Worker::new(index, access_log.as_ref())))
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
            http1 = paths.name(),
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
            serving: std::sync::Mutex::new(reload::serving_digest(&config)),
            started_with: config,
            fatal,
            background,
            registration,
            give_back,
            workers,
            worker_state,
            clock,
        })
    }
}

/// A listener and the TLS configuration of its connections (`None`: plain).
type BoundListener = (TcpListener, Option<Arc<ArcSwap<rustls::ServerConfig>>>);

/// Binds every listener of the configuration, plain then TLS, and the admin listener.
async fn bind_listeners(
    config: &Config,
    tls: &Option<Arc<ArcSwap<rustls::ServerConfig>>>,
) -> Result<(Vec<BoundListener>, Option<TcpListener>), StartupError> {
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|source| StartupError::Bind { addr, source })
    };
    let mut listeners = Vec::new();
    let plain = config.server.listen.iter().map(|a| (a, None));
    let secure = config.server.tls_listen.iter().map(|a| (a, tls.clone()));
    for (addr, tls) in plain.chain(secure) {
        listeners.push((bind(*addr).await?, tls));
    }
    let admin = match &config.admin {
        Some(admin) => Some(bind(admin.listen).await?),
        None => None,
    };
    Ok((listeners, admin))
}

/// The bound listeners as std sockets for the workers to duplicate, and the addresses they got.
struct SharedListeners {
    sockets: Vec<SharedListener>,
    plain: Vec<SocketAddr>,
    tls: Vec<SocketAddr>,
}

/// The bound listeners as [`SharedListeners`], each address logged.
fn to_shared_listeners(listeners: Vec<BoundListener>) -> Result<SharedListeners, StartupError> {
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
    Ok(SharedListeners {
        sockets: shared,
        plain: listen_addrs,
        tls: tls_addrs,
    })
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

    /// Resolves when the server cannot go on (e.g. the database holds another key
    /// fingerprint); the message says why.
    pub async fn fatal(&mut self) -> String {
        match self.fatal.recv().await {
            Some(message) => message,
            None => std::future::pending().await,
        }
    }

    /// Graceful stop: no new connections, in-flight requests get up to `shutdown_timeout`.
    pub async fn shutdown(mut self) {
        let _ = self.phase.send(Phase::Draining);
        // Out of the registry while the connections drain: the other instances' local quota
        // grows at their next refresh, and this takes at most a second (contract §5b).
        let registration = self.registration.take();
        let deregistering = tokio::spawn(async move {
            if let Some(registration) = registration {
                registration.end().await;
            }
        });
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
        let _ = deregistering.await;
        // Every request has finished: what this instance holds of shares goes back, so that
        // the other instances can use it (contract §3c). Bounded like the deregistration.
        if let Some((shares, store)) = self.give_back.take() {
            let given = tokio::time::timeout(
                fallback::DEREGISTER_WITHIN * 2,
                shares.give_back_all(&*store),
            );
            if given.await.is_err() {
                tracing::warn!("shutdown: reserved units not given back in time; they stay counted until their window ends");
            }
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
        // The connections are done (or cut): what the workers' access-log blocks hold goes
        // out now. (A line logged later still goes when its worker is dropped.)
        for worker in &self.worker_state {
            if let Some(log) = worker.access_log() {
                log.flush();
            }
        }
        tracing::info!("tollgate stopped");
    }
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

/// Who must open with a PROXY header (contract §4), and the rate limit of the line about those
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
    tokio::spawn(flush_access_log(first.clone(), shared.phase.clone()));
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
async fn run_worker(listeners: Vec<BoundListener>, shared: SharedWithWorkers, worker: Arc<Worker>) {
    for (listener, tls) in listeners {
        tokio::spawn(accept_loop(listener, tls, shared.clone(), worker.clone()));
    }
    tokio::spawn(flush_access_log(worker, shared.phase.clone()));
    let mut phase = shared.phase;
    let _ = phase.wait_for(|p| *p == Phase::Stopped).await;
}

/// The worker's access-log timer (`access_log::WorkerLog::flush_on_timer`), on the worker's
/// own runtime, until the server has stopped (`RunningServer::shutdown` then hands over what
/// is left) or is gone.
async fn flush_access_log(worker: Arc<Worker>, mut phase: watch::Receiver<Phase>) {
    let Some(log) = worker.access_log() else {
        return;
    };
    tokio::select! {
        () = log.flush_on_timer() => {}
        _ = phase.wait_for(|p| *p == Phase::Stopped) => {}
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
            // A listed balancer's PROXY header names the client, before TLS and HTTP (contract §4).
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
                    serve_connection(stream, info, proxy, settings, phase, clock).await;
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
                            serve_connection(tls_stream, info, proxy, settings, phase, clock).await;
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
