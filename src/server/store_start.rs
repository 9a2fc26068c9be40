//! Starting the counter store: which store the configuration names, the first contact with
//! the database and the retries after it, the sweep of ended windows, and the coalescing
//! queue decisions go through. [`start`] does all of it and hands back a [`StoreHandle`];
//! the server only serves with it.
//!
//! - A database that is down at start must not take the edge down with it (contract §1): `start`
//!   waits [`STORE_START_WAIT`] at most, then serves under the store failure policy while a
//!   background task keeps trying, and migrates and checks the key fingerprint once the
//!   database answers. An error that waiting cannot fix (another key's fingerprint, bad
//!   credentials, a failed migration) arrives on [`StoreHandle::fatal`].
//! - The PostgreSQL sweep begins only once the database has answered: before that there is
//!   nothing of this start's to sweep, and its failure would be one more warning about a
//!   database the start-up retry already reports.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::{self, Config};
use crate::error::{Detail, StartupError};
use crate::key::BucketHasher;
use crate::metrics::Metrics;
use crate::store::coalesce::CoalescingStore;
use crate::store::memory::MemoryStore;
use crate::store::postgres::PostgresStore;
use crate::store::{Clock, Store};

// The store's failures at start, as the one line `tollgate run` prints. Here rather than in
// error.rs, so that the store depends on the error types and not the other way round.
impl From<crate::store::StoreError> for StartupError {
    fn from(e: crate::store::StoreError) -> Self {
        StartupError::Store(Detail::of(e))
    }
}

impl From<crate::store::postgres::InitError> for StartupError {
    fn from(e: crate::store::postgres::InitError) -> Self {
        StartupError::Store(Detail::of(e))
    }
}

/// How long `start` waits for the database before serving without it: long enough for
/// migrations on a healthy database, short enough that a database that hangs does not keep
/// the edge from serving.
pub const STORE_START_WAIT: Duration = Duration::from_secs(2);
/// Decision statements in flight at once, whatever the pool size. Fewer, larger multi-row
/// statements cost the database (and tollgate) less per increment than many small ones:
/// measured on 10,000 distinct keys, 4 in flight carried 3-8 rows each and doubled the
/// throughput of 16 in flight; 2 sent 10-20% fewer statements than 4 for the same or more
/// requests per second (docs/performance.md). The rest of the pool serves the sweep, probes
/// and the statement of a bucket that is waiting.
const MAX_STATEMENTS_IN_FLIGHT: usize = 2;
/// Rows deleted per sweep statement.
const SWEEP_BATCH: i64 = 1000;
/// The start-up retry's first and longest waits between attempts.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_LONGEST: Duration = Duration::from_secs(5);

/// What a server needs of the store besides its configuration.
#[derive(Clone, Default)]
pub struct StoreOptions {
    /// The memory store's clock (its windows and sweep), and the one the limiter's cache of
    /// exhausted buckets keeps its deadlines on. A PostgreSQL store counts on the database's
    /// clock.
    pub clock: Clock,
    /// Count in this store instead of the configured one (tests): no sweep, no database.
    pub store: Option<Arc<dyn Store>>,
}

/// A started store.
pub struct StoreHandle {
    /// What decisions count in: for PostgreSQL, the coalescing queue in front of it.
    pub store: Arc<dyn Store>,
    /// The database itself, for what talks to it directly (the instance registry, the reset
    /// listener); `None` for the memory store.
    pub postgres: Option<Arc<PostgresStore>>,
    /// A message when the store cannot go on (see the module notes).
    pub fatal: mpsc::Receiver<String>,
    /// The start-up retry and the sweep; the owner aborts them when it stops.
    pub tasks: Vec<JoinHandle<()>>,
}

/// Starts the configured store (on the caller's runtime, which runs its tasks); for
/// PostgreSQL, tries to initialise it briefly and keeps trying in the background if the
/// database does not answer yet.
pub async fn start(
    config: &Config,
    hasher: &BucketHasher,
    metrics: &Arc<Metrics>,
    options: StoreOptions,
) -> Result<StoreHandle, StartupError> {
    let (fatal_tx, fatal) = mpsc::channel(1);
    let mut tasks = Vec::new();
    if let Some(store) = options.store {
        return Ok(StoreHandle {
            store,
            postgres: None,
            fatal,
            tasks,
        });
    }
    let Some(_) = &config.store.url else {
        tracing::warn!(
            "store: in-process memory; counters are not shared, so each instance enforces \
             its limits separately (run one instance, or set store.url)"
        );
        let clock = options.clock;
        let memory = Arc::new(MemoryStore::bounded_with_clock(
            config.store.memory_buckets,
            metrics.memory.clone(),
            move || clock.now_ms(),
        ));
        tasks.push(tokio::spawn(sweep_memory(
            memory.clone(),
            config.store.sweep_interval,
            metrics.clone(),
        )));
        return Ok(StoreHandle {
            store: memory,
            postgres: None,
            fatal,
            tasks,
        });
    };
    // With a database, store.memory_buckets bounds the local fallback's counters (contract §5b).
    let local = config.store.on_error == config::StoreErrorPolicy::Local
        || config
            .routes
            .iter()
            .any(|r| r.on_store_error == Some(config::StoreErrorPolicy::Local));
    if config.store.memory_buckets.get() != config::DEFAULT_MEMORY_BUCKETS && !local {
        tracing::warn!(
            "store.memory_buckets applies only to the memory store and to on_error = \"local\"; ignored here"
        );
    }
    let pg = PostgresStore::new(&config.store).map_err(StartupError::from)?;
    let fingerprint = hasher.fingerprint();
    let migrate = config.store.migrate;
    let (ready_tx, ready) = watch::channel(false);
    match tokio::time::timeout(STORE_START_WAIT, pg.initialize(&fingerprint, migrate)).await {
        Ok(Ok(())) => {
            tracing::info!("store: postgres, ready");
            let _ = ready_tx.send(true);
        }
        Ok(Err(err)) if !err.is_retryable() => return Err(StartupError::from(err)),
        not_yet => {
            let why = match not_yet {
                Ok(Err(err)) => err.to_string(),
                _ => format!("no answer within {STORE_START_WAIT:?}"),
            };
            tracing::warn!(error = %why, "store: postgres not ready; serving under the store failure policy until it is");
            tasks.push(tokio::spawn(initialize_in_background(
                pg.clone(),
                fingerprint,
                migrate,
                fatal_tx,
                ready_tx,
            )));
        }
    }
    tasks.push(tokio::spawn(sweep_postgres(
        pg.clone(),
        config.store.sweep_interval,
        metrics.clone(),
        ready,
    )));
    // Decisions go through the coalescing queue: concurrent increments share statements.
    let counter = metrics.clone();
    let coalesced = Arc::new(CoalescingStore::new(
        pg.clone(),
        (config.store.pool_size as usize).min(MAX_STATEMENTS_IN_FLIGHT),
        Arc::new(move || {
            counter.store_round_trips.inc();
        }),
    ));
    Ok(StoreHandle {
        store: coalesced,
        postgres: Some(pg),
        fatal,
        tasks,
    })
}

/// Tries the database until it answers (then says so on `ready`), or until it answers with
/// an error that waiting will not fix (then on `fatal`).
async fn initialize_in_background(
    pg: Arc<PostgresStore>,
    fingerprint: String,
    migrate: bool,
    fatal: mpsc::Sender<String>,
    ready: watch::Sender<bool>,
) {
    let mut delay = RETRY_FIRST;
    loop {
        tokio::time::sleep(delay).await;
        match pg.initialize(&fingerprint, migrate).await {
            Ok(()) => {
                tracing::info!("store: postgres answered; migrations applied and key fingerprint checked; counting");
                let _ = ready.send(true);
                return;
            }
            Err(err) if err.is_retryable() => {
                tracing::debug!(error = %err, "store: postgres still not ready");
                delay = (delay * 2).min(RETRY_LONGEST);
            }
            Err(err) => {
                // A different key secret, bad credentials, a failed migration: waiting will
                // not fix it, and serving on would silently break the guarantees.
                let message = err.to_string();
                tracing::error!("{message}");
                let _ = fatal.send(message).await;
                return;
            }
        }
    }
}

/// Deletes ended windows every `every`, from the moment the database has first answered.
async fn sweep_postgres(
    pg: Arc<PostgresStore>,
    every: Duration,
    metrics: Arc<Metrics>,
    mut ready: watch::Receiver<bool>,
) {
    // The sender is dropped without a `true` only when the start-up gave up (fatal): then
    // there is nothing to sweep.
    if ready.wait_for(|up| *up).await.is_err() {
        return;
    }
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match pg.sweep_once(SWEEP_BATCH).await {
            Ok(deleted) => {
                metrics.sweep_deleted_rows.inc_by(deleted);
                metrics.sweep_succeeded(crate::store::unix_now_ms());
                if deleted > 0 {
                    tracing::debug!(deleted, "sweep deleted expired counters");
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "sweep failed; expired rows stay until the next one")
            }
        }
    }
}

async fn sweep_memory(memory: Arc<MemoryStore>, every: Duration, metrics: Arc<Metrics>) {
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        metrics.sweep_deleted_rows.inc_by(memory.sweep());
        metrics.sweep_succeeded(crate::store::unix_now_ms());
    }
}
