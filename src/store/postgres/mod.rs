//! The PostgreSQL counter store: counters shared by every tollgate instance (contract §3
//! and 6, `seeds/rate_limits.sql`).
//!
//! What this module owns, one concern per file (this one: the store itself, its readiness, the
//! sweep and the [`Store`] implementation):
//!
//! - **The increment** ([`statements`]). One statement per batch: the seed's atomic
//!   `INSERT … ON CONFLICT (bucket, window_start) DO UPDATE … RETURNING count`, generalised to
//!   several rows with `unnest`. No read-then-write, no explicit transaction, no lock taken here.
//!   The window is computed from the database's `now()` inside the statement (contract §3), so
//!   instances whose clocks disagree still share one window.
//! - **Nothing kept on a connection that a pooler could share** (contract §6, poolers): statements are
//!   the unnamed one (`query_typed`: one round trip, no name that a transaction-mode PgBouncer
//!   could send to another server connection), no startup `options`, no session `SET`, no session
//!   advisory lock. `synchronous_commit = off` is set by the increment for its own transaction. The
//!   one exception: on a connection that provably reaches its backend with nothing in between
//!   ([`direct`]), the increment is prepared once and then only bound and executed, which spares
//!   the server its parse and plan on every call; there a batch of fixed windows is the plain
//!   upsert ([`statements::FIXED_UPSERT_SQL`]), cheaper to run than the function's call, and the
//!   session itself carries `synchronous_commit = off` ([`statements::SESSION_ASYNC_COMMIT_SQL`]):
//!   nobody else's session it could leak into.
//! - **Migrations** ([`migrate`]). The files of `migrations/` are embedded in the binary and
//!   recorded in `public.tollgate_migrations`; each runs in its own transaction under a
//!   transaction-level advisory lock, so N instances starting at once apply each exactly once
//!   (contract §6).
//! - **The key fingerprint** (contract §3, [`migrate`]): stored in `public.tollgate_settings`; an
//!   instance with a different one refuses to start, `tollgate migrate --accept-new-key`
//!   replaces it.
//! - **The sweep** (contract §6): expired rows deleted in bounded batches through
//!   `rate_limits_expires_idx`, by one instance at a time.
//! - **The instance registry** (contract §5b, [`registry`], the store's
//!   [`crate::store::InstanceRegistry`]): `refresh_instance` keeps this instance's row in
//!   `public.tollgate_instances` fresh and counts the live ones, in one statement on the
//!   database clock (pooler-safe: no session state); `deregister_instance` deletes it on a
//!   clean stop.
//! - **Reset** (contract §3b, [`reset`]): [`PostgresStore::reset`] deletes buckets' current and previous
//!   windows and `NOTIFY`s every instance; [`PostgresStore::listen_for_resets`] is the one
//!   `LISTEN` session per instance, on a connection of its own outside the pool, that
//!   reconnects by itself and checks that notifications really arrive. It sends `LISTEN` only
//!   on a session that is its backend's own ([`session`]): through a pooler the
//!   statement would stay on a server connection that other clients get.
//! - **Overrides** (contract §3e, [`overrides`]): `tollgate override` writes
//!   `public.tollgate_overrides` and notifies on the same `LISTEN` session as reset; every
//!   instance reads the table into memory ([`PostgresStore::load_overrides`]).
//! - **Readiness** (contract §7): [`PostgresStore::ping`] answers from the outcome of recent
//!   decisions, and with no recent traffic runs the real increment inside a transaction that
//!   is rolled back, so a missing table, a revoked privilege or a read-only database is "not
//!   ready" (a `SELECT 1` would answer).
//! - **Failure log** (contract §5, [`errors`]): every failed call, and every failed start-up connection,
//!   is classified (refused, timeout, read-only, authentication, missing table, permission, tls,
//!   ...; by SQLSTATE, I/O error kind or TLS error) and logged with the database's host, port and
//!   name, at most one line per cause a second, with a count of the lines left out.
//! - **TLS** (contract §6): connections go through [`tls`]'s rustls connector, which
//!   also reads `sslmode` and `sslrootcert` out of the URL before tokio-postgres parses it.
//! - **Bounds on waiting** ([`pool`]): a call waits at most `store.timeout` (pool wait included); a
//!   connection attempt, start-up exchange included, at most its connect timeout per host.
//! - **Timeouts of its own statements**, whatever the role's (`ALTER ROLE ... SET
//!   statement_timeout = '1ms'`; docs/operations.md, "Connection poolers", "Timeouts of its
//!   own"): on a session that is its backend's own, set for the session as it is made
//!   ([`statement_bound`], [`session::settle`]); through a pooler, only when the role's
//!   are shorter, `SET LOCAL` in a transaction around each statement ([`pool::LocalTimeouts`]),
//!   pipelined in the same round trip. Start-up, the sweep and the other transactions set
//!   theirs with `SET LOCAL` first.
//!
//! Construction never touches the database: contract §1 says a database that is down at start must
//! not stop tollgate. Until [`PostgresStore::initialize`] has succeeded the store answers
//! [`StoreError::Unavailable`] and reports not ready, and the proxy applies its failure policy.
//!
//! The connection URL can carry a password, so it is never logged or put in an error.
//! tokio-postgres' own error messages do not contain it.

mod charge;
mod direct;
mod errors;
mod migrate;
mod overrides;
mod pool;
mod registry;
mod reset;
mod session;
mod shares;
mod statements;
#[cfg(test)]
mod tests;
pub mod tls;

pub use errors::InitError;
pub use migrate::FingerprintChange;
pub use overrides::{ListedOverride, OverrideKey, OverrideSet};
pub use pool::{connect_deadline_for, Manager, PoolError};
pub use statements::{
    decide_sql, fixed_upsert_sql, increment_sql, sliding_one_sql, sliding_upsert_sql,
};

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bb8::{Pool, RunError};
use tokio_postgres::types::{ToSql, Type};

use self::errors::{cause, describe, is_transient, query_error, Cause, FailureLog};
use self::migrate::MIGRATION_LOCK;
use self::pool::{connect_deadline, connection_config, statement_bound, LastConnectError};
use self::statements::{columns, count_from, decided, fixed_cap, FastMap, IncrementArgs, PEEK_SQL};
use self::tls::MakeRustls;
use super::coalesce::Folded;
use super::settings::StoreConfig;
use super::{
    Charge, Counted, GiveBack, Increment, Peeked, ShareGrant, ShareWant, Store, StoreError,
    StoreFuture,
};
use crate::error::Detail;

/// Advisory lock electing the one instance that sweeps.
const SWEEP_LOCK: i64 = MIGRATION_LOCK + 1;

/// Server-side bound on one sweep batch, so a batch abandoned by the client does not go on
/// deleting on the server.
const SWEEP_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the outcome of recent decisions answers `/readyz` without a round trip; past it
/// (no traffic) the readiness probe runs the real statement.
const READINESS_FRESH: Duration = Duration::from_secs(1);

/// One sweep batch. `FOR UPDATE SKIP LOCKED` leaves rows another session holds (a late
/// increment of a just-expired window) for the next sweep instead of waiting on them; the
/// `ORDER BY expires_at LIMIT` makes it a range scan of `rate_limits_expires_idx`.
/// `expires_at <= now()` means the window has ended: a live window is never deleted.
const SWEEP_SQL: &str = "\
DELETE FROM public.rate_limits
WHERE (bucket, window_start) IN (
    SELECT bucket, window_start
    FROM public.rate_limits
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)";

/// What [`PostgresStore::inspect_a_connection`] found on one pool connection.
#[doc(hidden)]
#[derive(Debug)]
pub struct ConnectionInspection {
    /// Whether it reaches its backend directly; `None`: the look-up has not answered yet
    /// ([`direct`]).
    pub direct: Option<bool>,
    /// The statements its server session holds prepared (`pg_prepared_statements`), sorted.
    pub prepared: Vec<String>,
    /// Its backend's process id.
    pub pid: i32,
    /// The session's `synchronous_commit`.
    pub synchronous_commit: String,
}

/// Counters in PostgreSQL, shared by every instance using the same database.
pub struct PostgresStore {
    pool: Pool<Manager>,
    /// Budget for one call, pool wait included (`store.timeout`).
    timeout: Duration,
    /// Set once migrations and the fingerprint check have passed.
    initialized: AtomicBool,
    /// Whether the last increment, peek, probe or decision succeeded, and when.
    health: Health,
    last_connect_error: LastConnectError,
    failures: FailureLog,
    /// Held by the one readiness probe in flight.
    probe_gate: tokio::sync::Mutex<()>,
    /// `!store.synchronous_commit`: the increment commits with `synchronous_commit = off`.
    async_commit: bool,
    /// How to open the `LISTEN` session, which lives outside the pool (see
    /// [`PostgresStore::listen_for_resets`]).
    session: (tokio_postgres::Config, MakeRustls),
    /// The listen session's `application_name` once it knows the session is its backend's
    /// own (`tollgate-listen`, when the URL names none); `None`: it keeps the pool's.
    listen_name: Option<&'static str>,
    /// This process's row in `tollgate_instances`: random, nothing about the host.
    instance_id: String,
}

impl fmt::Debug for PostgresStore {
    // No URL, no pool internals: only what is safe to log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("timeout", &self.timeout)
            .field("initialized", &self.initialized.load(Ordering::Relaxed))
            .field("healthy", &self.health.ok.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Builds the store and its connection pool without connecting: the first connection is
    /// made when first needed. Must be called inside a tokio runtime (the pool spawns its
    /// maintenance task).
    ///
    /// Unless `cfg.synchronous_commit`, every increment commits with `synchronous_commit = off`,
    /// set by the increment for its own transaction ([`INCREMENT_SQL`](statements::INCREMENT_SQL)).
    pub fn new(cfg: &StoreConfig) -> Result<Arc<Self>, StoreError> {
        let (pg, tls) = connection_config(cfg)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::Unavailable(
                "the Postgres store must be created inside a tokio runtime".into(),
            ));
        }

        // bb8's defaults suit web apps, not a per-request decision (DESIGN): its 30 s wait
        // becomes store.timeout, and the health query on every checkout goes (it would double
        // the round trips; a broken connection shows up as a failed statement instead).
        // bb8 asserts both sizes are non-zero, so guard against a config that slipped through.
        let last_connect_error = LastConnectError::default();
        let failures = FailureLog::new(&pg);
        let timeout = cfg.timeout.max(Duration::from_millis(1));
        // Told apart from the pool's sessions in pg_stat_activity (one per instance), but only
        // by a `SET` on a session of its own: it connects with the pool's name, so through a
        // pooler tollgate's clients all carry one name, and the pooler never has to `SET` it
        // on a server connection for them (a statement under the role's timeouts, which a
        // role's 1 ms cancels; PgBouncer then drops the server connection and fails the
        // client with "invalid server parameter").
        let listen_name =
            (pg.get_application_name() == Some("tollgate")).then_some("tollgate-listen");
        let session = (pg.clone(), tls.clone());
        let pool = Pool::builder()
            .max_size(cfg.pool_size.max(1))
            .connection_timeout(timeout)
            .test_on_check_out(false)
            .error_sink(Box::new(last_connect_error.clone()))
            .build_unchecked(Manager {
                deadline: connect_deadline(&pg),
                bound: statement_bound(timeout),
                pg,
                tls,
            });

        Ok(Arc::new(PostgresStore {
            pool,
            timeout,
            initialized: AtomicBool::new(false),
            health: Health::new(),
            last_connect_error,
            failures,
            probe_gate: tokio::sync::Mutex::new(()),
            async_commit: !cfg.synchronous_commit,
            session,
            listen_name,
            instance_id: format!("{:032x}", rand::random::<u128>()),
        }))
    }

    /// Whether [`PostgresStore::initialize`] (or [`PostgresStore::migrate`]) has succeeded.
    pub fn is_initialized(&self) -> bool {
        self.initialized.load(Ordering::Acquire)
    }

    /// For tests and diagnosis: on a pool connection, runs `first` (simple query protocol;
    /// empty for nothing), then tells what the connection and its server session hold. With
    /// `pool_size = 1` it is the connection the increments ran on.
    #[doc(hidden)]
    pub async fn inspect_a_connection(
        &self,
        first: &str,
    ) -> Result<ConnectionInspection, StoreError> {
        let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
        if !first.is_empty() {
            conn.run(|| conn.simple_query(first))
                .await
                .map_err(|e| self.fail(e))?;
        }
        let row = conn
            .run(|| {
                conn.query_typed_one(
                "SELECT coalesce(array_agg(statement ORDER BY statement), '{}'), pg_backend_pid(), \
                        current_setting('synchronous_commit') \
                 FROM pg_prepared_statements",
                &[],
            )
            })
            .await
            .map_err(|e| self.fail(e))?;
        Ok(ConnectionInspection {
            direct: conn.direct.known().then(|| conn.direct.is_direct()),
            prepared: row.try_get(0).map_err(query_error)?,
            pid: row.try_get(1).map_err(query_error)?,
            synchronous_commit: row.try_get(2).map_err(query_error)?,
        })
    }

    /// Whether decisions succeed now (contract §7, `/readyz`): the outcome of the decisions of the
    /// last [`READINESS_FRESH`] if there were any, else [`PostgresStore::probe_increment`].
    /// A `SELECT 1` would answer while the table is gone, INSERT is revoked or the database
    /// is read-only; the real statement does not.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.require_initialized()?;
        match self.health.recent(READINESS_FRESH) {
            Some(true) => Ok(()),
            Some(false) => Err(StoreError::Unavailable("recent decisions failed".into())),
            None => {
                // One readiness probe at a time: a burst of /readyz calls must not take the
                // pool's connections from decisions. The others get the last outcome.
                let Ok(_probing) = self.probe_gate.try_lock() else {
                    return if self.health.ok.load(Ordering::Acquire) {
                        Ok(())
                    } else {
                        Err(StoreError::Unavailable("the last probe failed".into()))
                    };
                };
                self.probe_increment().await
            }
        }
    }

    /// The real increment on a bucket no client can have, inside a transaction that is rolled
    /// back, under `store.timeout`: it checks the table, the INSERT and UPDATE privileges and
    /// that the database is writable, and leaves no row. One transaction, so it works through
    /// a pooler in transaction mode. Updates [`Store::ready`].
    pub async fn probe_increment(&self) -> Result<(), StoreError> {
        self.require_initialized()?;
        let result = self
            .bounded(|| async {
                let mut conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.probe_increment(self.async_commit)
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await;
        self.record(&result);
        result
    }

    /// Deletes expired rows (contract §6), `batch_size` rows per statement, until a batch comes back
    /// short. Returns how many rows were deleted (0 when another instance holds the sweep).
    ///
    /// Each batch is a transaction that first tries `pg_try_advisory_xact_lock`: only one
    /// instance deletes at a time, and the lock is released by the commit (or by the rollback
    /// when this future is dropped), so it can never stay behind on a pooled connection, as a
    /// session lock abandoned by a timed-out call would.
    pub async fn sweep_once(&self, batch_size: i64) -> Result<u64, StoreError> {
        self.require_initialized()?;
        let batch_size = batch_size.max(1);
        let mut deleted = 0u64;
        loop {
            // A batch may take longer than one decision's budget; the server-side
            // statement_timeout is the real bound, the client one only covers a dead server.
            let budget = SWEEP_STATEMENT_TIMEOUT + self.timeout;
            let batch = tokio::time::timeout(budget, self.sweep_batch(batch_size))
                .await
                .map_err(|_| StoreError::Timeout)??;
            match batch {
                None => return Ok(deleted),
                Some(n) => {
                    deleted += n;
                    if n < batch_size as u64 {
                        return Ok(deleted);
                    }
                }
            }
        }
    }

    /// One sweep batch; `None` when another instance holds the sweep lock.
    async fn sweep_batch(&self, batch_size: i64) -> Result<Option<u64>, StoreError> {
        let mut conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
        let tx = conn.transaction().await.map_err(query_error)?;
        // Its own timeouts before anything else, whatever the session's (a role's 1 ms).
        tx.batch_execute(&session::set_local_timeouts(SWEEP_STATEMENT_TIMEOUT))
            .await
            .map_err(query_error)?;
        let won: bool = tx
            .query_typed_one(
                "SELECT pg_try_advisory_xact_lock($1)",
                &[(&SWEEP_LOCK, Type::INT8)],
            )
            .await
            .map_err(query_error)?
            .try_get(0)
            .map_err(query_error)?;
        if !won {
            tx.rollback().await.map_err(query_error)?;
            return Ok(None);
        }
        let n = tx
            .execute_typed(SWEEP_SQL, &[(&batch_size, Type::INT8)])
            .await
            .map_err(query_error)?;
        tx.commit().await.map_err(query_error)?;
        Ok(Some(n))
    }

    fn require_initialized(&self) -> Result<(), StoreError> {
        if self.is_initialized() {
            Ok(())
        } else {
            Err(StoreError::Unavailable(
                "the database has not been initialized yet".into(),
            ))
        }
    }

    /// Runs the future `make` makes under `store.timeout` (a maker: see
    /// [`PooledClient::run`]). tokio-postgres has no timeout of its own (DESIGN), and the
    /// budget covers the pool wait as well as the statement.
    async fn bounded<T, F: std::future::Future<Output = Result<T, StoreError>>>(
        &self,
        make: impl FnOnce() -> F,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, make()).await {
            Ok(result) => result,
            Err(_) => Err(self.timeout_error()),
        }
    }

    /// A timeout while connections are failing in the background is really "unavailable":
    /// say so, with the reason, instead of a bare timeout. Logged like every failure.
    fn timeout_error(&self) -> StoreError {
        match self.last_connect_error.recent() {
            Some((cause, msg)) => {
                self.failures.note(cause, &msg);
                StoreError::Unavailable(msg.into())
            }
            None => {
                self.failures
                    .note(Cause::Timeout, "no answer within store.timeout");
                StoreError::Timeout
            }
        }
    }

    fn pool_error(&self, e: RunError<PoolError>) -> StoreError {
        match e {
            RunError::User(PoolError::Postgres(e)) => self.fail(e),
            RunError::User(e @ PoolError::Deadline(_)) => {
                let msg = e.to_string();
                self.failures.note(Cause::Timeout, &msg);
                StoreError::Unavailable(Detail::caused_by(msg, e))
            }
            RunError::TimedOut => self.timeout_error(),
        }
    }

    /// A failed statement: logged with its cause (at most once a second per cause) and
    /// mapped to a [`StoreError`].
    fn fail(&self, e: tokio_postgres::Error) -> StoreError {
        let message = describe(&e);
        self.failures.note(cause(&e), &message);
        if is_transient(&e) {
            StoreError::Unavailable(Detail::caused_by(message, e))
        } else {
            StoreError::Query(Detail::caused_by(message, e))
        }
    }

    fn record<T>(&self, result: &Result<T, StoreError>) {
        self.health.set(result.is_ok());
    }

    /// Requests decided in this order in ONE statement (see [`Store::increment_each`]). When
    /// every row can be counted on its own (no request has an enforced limit next to another
    /// limit, takes several units of a limit, or checks one, see [`Folded::joint`]),
    /// the rows go to `tollgate_increment` and each request gets its share of them in arrival
    /// order. Otherwise `tollgate_decide` walks the requests one by one ([`DECIDE_SQL`](statements::DECIDE_SQL)).
    async fn run_requests(
        &self,
        requests: &[&[Increment]],
    ) -> Result<Vec<Vec<Counted>>, StoreError> {
        let folded = Folded::new(requests)?;
        if !folded.joint {
            let counted = self.run_increment(&folded.rows).await?;
            return Ok(folded.share(requests, &counted));
        }
        // Boxed: the rarer path (several limits of a request) need not widen the common
        // one's future.
        Box::pin(self.run_decide(requests, &folded)).await
    }

    /// The joint decision of [`DECIDE_SQL`](statements::DECIDE_SQL): one row back per bucket; a sliding row carries
    /// what each of its requests' increments added and what its estimate admitted, in arrival
    /// order, from which every request's count is its own position.
    async fn run_decide(
        &self,
        requests: &[&[Increment]],
        folded: &Folded,
    ) -> Result<Vec<Vec<Counted>>, StoreError> {
        self.require_initialized()?;
        let (buckets, windows) = columns(&folded.rows)?;
        let amounts: Vec<i64> = folded.rows.iter().map(|r| i64::from(r.by)).collect();
        let limits: Vec<Option<i64>> = folded
            .rows
            .iter()
            .map(|r| r.sliding.map(i64::from))
            .collect();
        let entries = folded.places.iter().map(Vec::len).sum::<usize>();
        let mut e_row = Vec::with_capacity(entries);
        let mut e_req = Vec::with_capacity(entries);
        let mut e_by = Vec::with_capacity(entries);
        let mut e_limit = Vec::with_capacity(entries);
        let mut e_check = Vec::with_capacity(entries);
        for (req, (request, place)) in requests.iter().zip(&folded.places).enumerate() {
            for (inc, &(row, _)) in request.iter().zip(place) {
                e_row.push(i32::try_from(row + 1).unwrap_or(i32::MAX));
                e_req.push(i32::try_from(req + 1).unwrap_or(i32::MAX));
                e_by.push(i64::from(inc.by));
                e_limit.push(inc.enforce.map(i64::from));
                e_check.push(inc.check);
            }
        }
        let params: [(&(dyn ToSql + Sync), Type); 10] = [
            (&buckets, Type::TEXT_ARRAY),
            (&windows, Type::INT8_ARRAY),
            (&amounts, Type::INT8_ARRAY),
            (&limits, Type::INT8_ARRAY),
            (&e_row, Type::INT4_ARRAY),
            (&e_req, Type::INT4_ARRAY),
            (&e_by, Type::INT8_ARRAY),
            (&e_limit, Type::INT8_ARRAY),
            (&e_check, Type::BOOL_ARRAY),
            (&self.async_commit, Type::BOOL),
        ];
        let result = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.decide(&params).await.map_err(|e| self.fail(e))
            })
            .await
            .and_then(|rows| decided(requests, folded, &rows));
        self.record(&result);
        result
    }

    async fn run_increment(&self, batch: &[Increment]) -> Result<Vec<Counted>, StoreError> {
        self.require_initialized()?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let (buckets, windows) = columns(batch)?;
        // NULL unless a limit of the batch is sliding: the function then runs only the
        // fixed-window upsert, and on a direct connection the plain upsert can stand in.
        let limits: Option<Vec<Option<i64>>> = batch
            .iter()
            .any(|inc| inc.sliding.is_some())
            .then(|| batch.iter().map(|inc| inc.sliding.map(i64::from)).collect());
        let args = IncrementArgs {
            buckets,
            windows,
            amounts: batch.iter().map(|inc| i64::from(inc.by)).collect(),
            limits,
            caps: batch.iter().map(fixed_cap).collect(),
            async_commit: self.async_commit,
        };
        let result = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.increment(&args).await.map_err(|e| self.fail(e))
            })
            .await
            .and_then(|rows| {
                // Rows come back in no particular order; they are matched to the batch by
                // bucket, borrowed from the rows (no copy), with a fast non-cryptographic hash
                // (the names are digests, not attacker-chosen text).
                let mut by_bucket =
                    FastMap::with_capacity_and_hasher(rows.len(), Default::default());
                for row in &rows {
                    let bucket: &str = row.try_get(0).map_err(query_error)?;
                    // The plain upsert answers `bucket, count, window_end_ms, now_ms` (a fixed
                    // row's first LEAST(amount, cap) units counted); the plain sliding
                    // statement has `previous` after `count` (the rows it answers for are
                    // counted whole); the function has `added` (NULL: as the plain upsert)
                    // and `previous` in between.
                    let (added, previous, end) = match row.len() {
                        4 => (None, 0, 2),
                        5 => (None, count_from(row.try_get(2).map_err(query_error)?)?, 3),
                        _ => {
                            let added: Option<i64> = row.try_get(2).map_err(query_error)?;
                            (added, count_from(row.try_get(3).map_err(query_error)?)?, 4)
                        }
                    };
                    let counted = (
                        count_from(row.try_get(1).map_err(query_error)?)?,
                        added,
                        previous,
                        row.try_get::<_, i64>(end).map_err(query_error)?,
                        row.try_get::<_, i64>(end + 1).map_err(query_error)?,
                    );
                    by_bucket.insert(bucket, counted);
                }
                batch
                    .iter()
                    .map(|inc| {
                        let &(count, added, previous, window_end_ms, now_ms) =
                            by_bucket.get(&*inc.bucket).ok_or_else(|| {
                                StoreError::Query(
                                    "the increment returned no row for a bucket".into(),
                                )
                            })?;
                        // NULL: the upsert counted the row's first LEAST(amount, cap) units.
                        let whole = fixed_cap(inc).map_or(inc.by, |cap| {
                            u32::try_from(cap.clamp(0, i64::from(inc.by))).unwrap_or(0)
                        });
                        let added = added.map_or(whole, |a| {
                            u32::try_from(a.clamp(0, i64::from(inc.by))).unwrap_or(0)
                        });
                        Ok(Counted {
                            count,
                            window_end_ms,
                            now_ms,
                            added,
                            previous,
                            fits: added,
                        })
                    })
                    .collect()
            });
        self.record(&result);
        result
    }

    async fn run_peek(&self, batch: &[Increment]) -> Result<Vec<Peeked>, StoreError> {
        self.require_initialized()?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let (buckets, windows) = columns(batch)?;
        let params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&buckets, Type::TEXT_ARRAY), (&windows, Type::INT8_ARRAY)];
        let result = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                conn.run(|| conn.query_typed(PEEK_SQL, &params))
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await
            .and_then(|rows| {
                if rows.len() != batch.len() {
                    return Err(StoreError::Query(
                        format!(
                            "the peek returned {} rows for {} buckets",
                            rows.len(),
                            batch.len()
                        )
                        .into(),
                    ));
                }
                rows.iter()
                    .map(|row| {
                        Ok(Peeked {
                            count: count_from(row.try_get(0).map_err(query_error)?)?,
                            window_end_ms: row.try_get(1).map_err(query_error)?,
                            now_ms: row.try_get(2).map_err(query_error)?,
                            previous: count_from(row.try_get(3).map_err(query_error)?)?,
                        })
                    })
                    .collect()
            });
        self.record(&result);
        result
    }
}

impl Store for PostgresStore {
    fn increment<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Counted>> {
        Box::pin(async move {
            let mut answers = self.run_requests(&[batch]).await?;
            answers
                .pop()
                .ok_or_else(|| StoreError::Query("no answer for the request".into()))
        })
    }

    fn increment_each<'a>(
        &'a self,
        requests: &'a [&'a [Increment]],
    ) -> StoreFuture<'a, Vec<Vec<Counted>>> {
        Box::pin(self.run_requests(requests))
    }

    fn reserves(&self) -> bool {
        true
    }

    fn reserve<'a>(
        &'a self,
        wants: &'a [ShareWant],
        instances: u32,
    ) -> StoreFuture<'a, Vec<ShareGrant>> {
        Box::pin(self.run_reserve(wants, instances))
    }

    fn give_back<'a>(&'a self, back: &'a [GiveBack]) -> StoreFuture<'a, Vec<u32>> {
        Box::pin(self.run_give_back(back))
    }

    fn charge<'a>(&'a self, charges: &'a [Charge]) -> StoreFuture<'a, ()> {
        Box::pin(self.run_charge(charges))
    }

    fn peek<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Peeked>> {
        Box::pin(self.run_peek(batch))
    }

    fn probe(&self) -> StoreFuture<'_, ()> {
        Box::pin(self.ping())
    }

    fn ready(&self) -> bool {
        self.is_initialized() && self.health.ok.load(Ordering::Acquire)
    }

    fn decision_outcome(&self, succeeded: bool) {
        if self.is_initialized() {
            self.health.set(succeeded);
        }
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}

/// The outcome of the last call that used the store, and when it came.
struct Health {
    ok: AtomicBool,
    base: Instant,
    /// Milliseconds after `base` of the last outcome; 0 = none yet.
    at_ms: AtomicU64,
}

impl Health {
    fn new() -> Health {
        Health {
            ok: AtomicBool::new(false),
            base: Instant::now(),
            at_ms: AtomicU64::new(0),
        }
    }

    fn set(&self, ok: bool) {
        self.ok.store(ok, Ordering::Release);
        let now = self.base.elapsed().as_millis() as u64;
        self.at_ms.store(now.max(1), Ordering::Release);
    }

    /// The last outcome if it is younger than `fresh`.
    fn recent(&self, fresh: Duration) -> Option<bool> {
        let at = self.at_ms.load(Ordering::Acquire);
        let now = self.base.elapsed().as_millis() as u64;
        (at != 0 && now.saturating_sub(at) < fresh.as_millis() as u64)
            .then(|| self.ok.load(Ordering::Acquire))
    }
}
