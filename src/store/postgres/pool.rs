//! The connection pool (bb8) and how its connections are made: the URL with tollgate's
//! session defaults and the TLS connector for its `sslmode` ([`connection_config`]), a
//! deadline on a whole connection attempt ([`Manager`]), the session settled as it is made
//! ([`session::settle`]: whether it is its backend's own, and the timeouts of tollgate's own
//! statements), and a pooled client that knows when it must not go back to the pool
//! ([`PooledClient`]). bb8 keeps connection errors to itself; [`LastConnectError`] is how
//! they come out, so a pool timeout can say why.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bb8::ErrorSink;
use tokio_postgres::Client;

use super::direct::Directness;
use super::errors::{cause, describe, Cause};
use super::session;
use super::tls::{self, MakeRustls};
use crate::error::Detail;
use crate::store::settings::StoreConfig;
use crate::store::StoreError;

/// Connecting gets longer than one decision's budget: a TLS and SCRAM handshake to a remote
/// primary can take longer than `store.timeout`, and a pool connection is made in the
/// background (a request that finds none fails under its policy while it is being made).
/// Bounding it still matters: without it a blackholed host holds a connect attempt for minutes.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How far past `store.timeout` the server lets tollgate's own statements run before it
/// cancels them ([`statement_bound`]).
const STATEMENT_BOUND_MARGIN: Duration = Duration::from_secs(1);
/// How long a background connection error explains a timeout (see [`PostgresStore::pool_error`](super::PostgresStore::pool_error)).
const CONNECT_ERROR_RELEVANCE: Duration = Duration::from_secs(10);

/// Why the pool could not make a connection.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    /// The whole attempt (TCP connect, TLS, start-up and authentication) took longer than its
    /// deadline: the server (or something in between) accepted the connection and went quiet.
    #[error("no connection within {0:?}: the server accepted but did not complete the start-up exchange")]
    Deadline(Duration),
}

/// Remembers the last background connection error, so that a pool timeout can say why.
/// bb8 keeps connection errors to itself (a `get` only ever times out); this sink is how they
/// come out. Only tokio-postgres' message is kept, which never contains the URL.
#[derive(Clone, Default)]
pub(super) struct LastConnectError(Arc<Mutex<Option<(Instant, Cause, String)>>>);

impl fmt::Debug for LastConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LastConnectError")
    }
}

impl ErrorSink<PoolError> for LastConnectError {
    fn sink(&self, error: PoolError) {
        tracing::debug!(error = %error, "store connection attempt failed");
        if let Ok(mut last) = self.0.lock() {
            *last = Some((Instant::now(), pool_cause(&error), describe_pool(&error)));
        }
    }

    fn boxed_clone(&self) -> Box<dyn ErrorSink<PoolError>> {
        Box::new(self.clone())
    }
}

impl LastConnectError {
    pub(super) fn recent(&self) -> Option<(Cause, String)> {
        let last = self.0.lock().ok()?;
        match &*last {
            Some((at, cause, msg)) if at.elapsed() < CONNECT_ERROR_RELEVANCE => {
                Some((*cause, msg.clone()))
            }
            _ => None,
        }
    }
}

/// A pooled client that knows when it must not be reused.
///
/// bb8 returns a connection to the pool whenever its guard is dropped, and by default only
/// checks whether the socket closed. Two more cases must not go back: a statement that was
/// cut off (timeout, or the request that waited for it went away) may sit behind a stalled
/// server that will answer nobody; and a server that answered "read-only transaction"
/// (SQLSTATE 25006) is a demoted primary after a failover — a fresh connection, through
/// `target_session_attrs=read-write`, finds the new one.
pub struct PooledClient {
    pub(super) client: Client,
    pub(super) in_flight: AtomicBool,
    read_only: AtomicBool,
    /// Whether this connection reaches its backend directly ([`direct`](super::direct)): only then is
    /// the increment prepared on it. Answered in the background after the connect.
    pub(super) direct: Arc<Directness>,
    /// `Some` on a session that is not its backend's own (a pooler) when the role's own
    /// timeouts are shorter than tollgate's: every statement then runs in a transaction of
    /// its own that sets them first ([`PooledClient::run`]). `None`: the session's timeouts
    /// are tollgate's already (set on it at connect, [`session::settle`]), or long enough.
    local_timeouts: Option<LocalTimeouts>,
    /// The increment statements prepared on this connection (direct connections only), by
    /// [`IncrementStatement::slot`](super::statements::IncrementStatement::slot).
    pub(super) prepared: [std::sync::OnceLock<tokio_postgres::Statement>; 5],
    /// The prepared increment stopped working (its plan no longer fits the function, or the
    /// statement is gone): the connection is replaced rather than reused.
    pub(super) stale: AtomicBool,
}

impl std::ops::Deref for PooledClient {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl std::ops::DerefMut for PooledClient {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl PooledClient {
    /// Awaits one statement on this client (the future `statement` makes), remembering if it
    /// never finished. A maker rather than a future, here and in [`PooledClient::tracked`]
    /// and `PostgresStore::bounded`: an `async fn` that takes a future by value and awaits
    /// it holds it twice, and the increment's future is copied into a box per statement
    /// (`the_increment_future_stays_small`).
    ///
    /// With [`PooledClient::local_timeouts`] the statement goes between `BEGIN` with `SET
    /// LOCAL` and `COMMIT`, pipelined: still one round trip, and one server connection of a
    /// transaction pooler for all three (boxed: only that configuration pays for the larger
    /// future).
    pub(super) async fn run<
        T,
        F: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    >(
        &self,
        statement: impl FnOnce() -> F,
    ) -> Result<T, tokio_postgres::Error> {
        let result = match &self.local_timeouts {
            None => self.tracked(statement).await,
            Some(local) => Box::pin(self.tracked(|| local.around(&self.client, statement()))).await,
        };
        if let Err(err) = &result {
            self.note_read_only(err);
        }
        result
    }

    /// Opens a transaction under tollgate's timeouts: with [`PooledClient::local_timeouts`]
    /// it sets them first (the session's are tollgate's already otherwise).
    pub(super) async fn begin(
        &mut self,
    ) -> Result<tokio_postgres::Transaction<'_>, tokio_postgres::Error> {
        let tx = self.client.transaction().await?;
        if let Some(local) = &self.local_timeouts {
            tx.batch_execute(&local.set).await?;
        }
        Ok(tx)
    }

    /// Awaits the future `work` makes, on this client marked in flight: cut off midway, the
    /// connection is not reused.
    pub(super) async fn tracked<F: std::future::Future>(
        &self,
        work: impl FnOnce() -> F,
    ) -> F::Output {
        self.in_flight.store(true, Ordering::Release);
        let output = work().await;
        self.in_flight.store(false, Ordering::Release);
        output
    }

    /// A server that answered "read-only transaction" is not used again (logged by the
    /// store's failure log, cause `read-only`).
    pub(super) fn note_read_only(&self, err: &tokio_postgres::Error) {
        if err.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION) {
            tracing::debug!(
                "the database answered read-only (a failover?): dropping this connection"
            );
            self.read_only.store(true, Ordering::Release);
        }
    }

    fn unusable(&self) -> bool {
        self.client.is_closed()
            || self.in_flight.load(Ordering::Acquire)
            || self.read_only.load(Ordering::Acquire)
            || self.stale.load(Ordering::Acquire)
    }
}

/// The `statement_timeout` and `lock_timeout` of tollgate's own statements on pool
/// connections, whatever the role's (set by [`session::settle`] or [`LocalTimeouts`];
/// docs/operations.md, "Timeouts of its own"): a second past the longest tollgate waits for
/// one (`store.timeout`), so the server never cancels what tollgate still waits for, and
/// stops soon after what it gave up on. Statements that may take longer set their own for
/// their transaction (the sweep, the migrations).
pub(super) fn statement_bound(timeout: Duration) -> Duration {
    timeout + STATEMENT_BOUND_MARGIN
}

/// tollgate's timeouts for one transaction at a time, on a session that is not its backend's
/// own (a transaction pooler may hand every transaction to another server connection, and a
/// session `SET` would stay on one that other clients get).
pub(super) struct LocalTimeouts {
    /// `BEGIN; SET LOCAL statement_timeout = ...; SET LOCAL lock_timeout = ...`.
    begin: String,
    /// The same without the `BEGIN`, for a transaction already open.
    set: String,
}

impl LocalTimeouts {
    fn new(bound: Duration) -> LocalTimeouts {
        let set = session::set_local_timeouts(bound);
        LocalTimeouts {
            begin: format!("BEGIN; {set}"),
            set,
        }
    }

    /// `statement` between [`LocalTimeouts::begin`] and `COMMIT`, pipelined: sent in the
    /// order they are first polled, answered in that order, one round trip. A failed
    /// `COMMIT` fails the statement (what it wrote is not there); a failed `BEGIN` matters
    /// only if the statement failed too (else it ran, and committed, on its own).
    async fn around<T>(
        &self,
        client: &Client,
        statement: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, tokio_postgres::Error> {
        let (begun, result, ended) = tokio::join!(
            client.batch_execute(&self.begin),
            statement,
            client.batch_execute("COMMIT")
        );
        let result = match (begun, result) {
            (Err(why), Err(_)) => return Err(why),
            (_, result) => result?,
        };
        ended?;
        Ok(result)
    }
}

/// The pool's connection manager: [`PooledClient`]'s idea of a broken connection, a deadline
/// on the whole connection attempt, and a connection driver of its own.
///
/// bb8-postgres' manager spawned `Connection` as a future, and tokio-postgres logs every
/// NOTICE it gets that way at INFO: the migrations' `CREATE ... IF NOT EXISTS` put
/// "relation already exists, skipping" into every operator's log at each start (issue 19).
/// [`drive`] logs them at DEBUG instead.
///
/// tokio-postgres' `connect_timeout` bounds only the TCP connect of each host. A server that
/// accepts and then goes quiet (hung, or a network black hole after the SYN) held the start-up
/// exchange for good; bb8 counts a connection being made against `pool_size` and starts
/// another only when more callers wait than connections are being made, so a few such
/// attempts starved the pool long after the database came back (issue 14, item 7).
pub struct Manager {
    pub(super) pg: tokio_postgres::Config,
    pub(super) tls: MakeRustls,
    /// Bound on one whole attempt: the connect timeout for every host it may try.
    pub(super) deadline: Duration,
    /// The timeouts of tollgate's own statements on these connections ([`statement_bound`]).
    pub(super) bound: Duration,
}

#[async_trait::async_trait]
impl bb8::ManageConnection for Manager {
    type Connection = PooledClient;
    type Error = PoolError;

    async fn connect(&self) -> Result<PooledClient, PoolError> {
        let (client, connection) =
            tokio::time::timeout(self.deadline, self.pg.connect(self.tls.clone()))
                .await
                .map_err(|_| PoolError::Deadline(self.deadline))??;
        tokio::spawn(drive(connection));
        let settled = tokio::time::timeout(self.deadline, session::settle(&client, self.bound))
            .await
            .map_err(|_| PoolError::Deadline(self.deadline))??;
        // A session that is not its backend's own is not direct, whatever the socket table
        // says: nothing may be prepared or `SET` on it.
        let backend = settled.backend.filter(|_| settled.own);
        let local_timeouts =
            (!settled.own && settled.short_defaults).then(|| LocalTimeouts::new(self.bound));
        Ok(PooledClient {
            client,
            in_flight: AtomicBool::new(false),
            read_only: AtomicBool::new(false),
            direct: Directness::look_up(backend),
            local_timeouts,
            prepared: Default::default(),
            stale: AtomicBool::new(false),
        })
    }

    async fn is_valid(&self, conn: &mut PooledClient) -> Result<(), PoolError> {
        conn.client.simple_query("").await?;
        Ok(())
    }

    fn has_broken(&self, conn: &mut PooledClient) -> bool {
        conn.unusable()
    }
}

/// Runs one pooled connection until it closes. NOTICEs (routine: "already exists,
/// skipping") go to DEBUG; a connection error is seen by the next statement on the client,
/// which classifies and logs it, so it is only traced here.
async fn drive<S, T>(mut connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            Some(Ok(tokio_postgres::AsyncMessage::Notice(notice))) => {
                tracing::debug!(
                    severity = notice.severity(),
                    "database notice: {}",
                    notice.message()
                );
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::trace!(error = %e, "store connection ended");
                return;
            }
            None => return,
        }
    }
}

fn pool_cause(e: &PoolError) -> Cause {
    match e {
        PoolError::Postgres(e) => cause(e),
        PoolError::Deadline(_) => Cause::Timeout,
    }
}

fn describe_pool(e: &PoolError) -> String {
    match e {
        PoolError::Postgres(e) => describe(e),
        deadline => deadline.to_string(),
    }
}

/// How long making one connection for `cfg` may take (every host's connect timeout): what
/// the one-off commands (`explain`, `reset`) allow on top of their own budget.
pub fn connect_deadline_for(cfg: &StoreConfig) -> Result<Duration, StoreError> {
    connection_config(cfg).map(|(pg, _)| connect_deadline(&pg))
}

/// A whole connection attempt may try every host of the URL, each within its connect
/// timeout.
pub(super) fn connect_deadline(pg: &tokio_postgres::Config) -> Duration {
    let per_host = pg.get_connect_timeout().copied().unwrap_or(CONNECT_TIMEOUT);
    let hosts = pg.get_hosts().len().max(pg.get_hostaddrs().len()).max(1);
    per_host.saturating_mul(u32::try_from(hosts).unwrap_or(u32::MAX))
}

/// The tokio-postgres configuration for `cfg` (its URL plus tollgate's session defaults) and
/// the TLS connector for its `sslmode` and trust root ([`tls`]).
pub(super) fn connection_config(
    cfg: &StoreConfig,
) -> Result<(tokio_postgres::Config, MakeRustls), StoreError> {
    let url = cfg
        .url
        .as_deref()
        .ok_or_else(|| StoreError::Unavailable("store.url is not set".into()))?;
    // tokio-postgres' parser accepts both URL and key=value forms, several hosts and
    // target_session_attrs=read-write (contract §6); `tls` takes the TLS options out first.
    // Its messages name the bad option, never the URL, so they are safe to return.
    let (mut pg, tls) = tls::parse(url, cfg.ca_file.as_deref())
        .map_err(|e| StoreError::Unavailable(format!("invalid store.url: {e}").into()))?;
    let tls = tls.connector().map_err(|e| {
        StoreError::Unavailable(Detail::caused_by(format!("TLS to the database: {e}"), e))
    })?;
    // No startup `options` of tollgate's own: PgBouncer refuses the parameter ("unsupported
    // startup parameter: options"). `synchronous_commit` is set by the increment itself, for
    // its own transaction (see INCREMENT_SQL). Options the URL carries are the operator's.
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(CONNECT_TIMEOUT);
    }
    if pg.get_application_name().is_none() {
        // Lets an operator find tollgate's sessions in pg_stat_activity.
        pg.application_name("tollgate");
    }

    Ok((pg, tls))
}
