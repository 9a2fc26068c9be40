//! `tollgate reset` (contract §3b; docs/operations.md, "`tollgate reset`"): the delete of buckets'
//! current and previous windows, with a `NOTIFY` to every instance in the same transaction,
//! and the one `LISTEN` session per instance that hears it and tells the limiter's cache of
//! denials ([`ResetEvent`]); the same session hears reserved shares' requests (contract §3c)
//! and changes of overrides (contract §3e). The session is a connection of its own outside the pool; it
//! reconnects by itself, checks that notifications really arrive, and sends `LISTEN` only on
//! a session that is its backend's own ([`session::settle`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::errors::{describe, query_error};
use super::overrides::OVERRIDES_CHANNEL;
use super::pool::connect_deadline;
use super::statements::{columns, count_from};
use super::{session, PostgresStore};
use crate::store::{Increment, ResetEvent, StoreError};

/// The `NOTIFY` channel of `tollgate reset` (contract §3b). Payload: one bucket name, which is
/// `<scope>:<label>:<digest>` or `<scope>:global`, never a raw subject.
pub const RESET_CHANNEL: &str = "tollgate_reset";
/// The `NOTIFY` channel of reserved shares (contract §3c), sent by the functions of
/// `migrations/0006_reserved_shares.sql`. Payload: `reclaim <bucket>` (an instance found the
/// bucket exhausted: give its unused units back) or `returned <bucket>` (units went back).
pub const SHARES_CHANNEL: &str = "tollgate_shares";
/// The listen session's own statements (`LISTEN`, the liveness check) get this long.
const LISTEN_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the listen session checks that a notification sent through the pool reaches
/// it, how long it waits for it, and how many checks in a row must go unanswered before it
/// counts as deaf (one slow delivery on a loaded machine must not switch the cache off).
const LISTEN_CHECK_EVERY: Duration = Duration::from_secs(5);
const LISTEN_CHECK_WAIT: Duration = Duration::from_secs(3);
const LISTEN_CHECKS_MISSED: u32 = 2;
/// How often an instance whose `store.url` is a pooler looks again whether it now reaches a
/// session of its own (the URL's host now the database itself, say).
const LISTEN_RECHECK: Duration = Duration::from_secs(30);
/// Reconnect back-off of the listen session: from the first to the last, doubling.
const LISTEN_RETRY_FIRST: Duration = Duration::from_millis(250);
const LISTEN_RETRY_LAST: Duration = Duration::from_secs(5);
/// Notifications waiting to be applied at most; past it they are dropped and the whole cache
/// is forgotten instead (as after a reconnect), so a flood of resets cannot grow memory.
const LISTEN_QUEUE: usize = 1024;
/// The payload prefix of the listen session's own check. A space cannot occur in a bucket
/// name (scopes and labels are validated), so no reset can be mistaken for it.
const LISTEN_CHECK_PREFIX: &str = "tollgate listen check ";

/// `tollgate reset` (contract §3b): deletes the current window's row and the previous one's of
/// each bucket (`$1` buckets, `$2` window lengths), on the database clock like the increment.
/// The previous window matters to sliding limits, whose estimate reads it; for fixed ones it
/// is an ended row waiting for the sweep, and deleting it changes nothing.
const RESET_SQL: &str = "\
WITH input AS (
    SELECT b.bucket,
           b.win,
           (floor(extract(epoch FROM now()))::int8 / b.win) * b.win AS start_secs
    FROM unnest($1::text[], $2::int8[]) AS b(bucket, win)
)
DELETE FROM public.rate_limits AS r
USING input AS i
WHERE r.bucket = i.bucket
  AND r.window_start IN (to_timestamp(i.start_secs), to_timestamp(i.start_secs - i.win))
RETURNING r.bucket, r.window_start = to_timestamp(i.start_secs), r.count";

/// What one bucket held when `tollgate reset` deleted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetBucket {
    pub bucket: Arc<str>,
    /// The count of the current window (0 if it had no row).
    pub count: u32,
    /// The count of the previous window, if it still had a row.
    pub previous: Option<u32>,
}

/// How one listen session ended.
enum ListenEnd {
    /// It failed, or its connection did; why.
    Lost(String),
    /// It reaches the database through a pooler ([`session::Settled::own`] false): it sent no
    /// `LISTEN`, which would stay on a server connection other clients get.
    Pooled,
}

impl PostgresStore {
    /// Deletes the current and previous windows of `buckets` (bucket, window seconds) and
    /// notifies every listening instance, in one transaction: the notifications go out when
    /// the rows are gone (at commit), never before. Answers each bucket's old counts, in
    /// batch order. NOTIFY is transactional, so this works through any pooler.
    pub async fn reset(&self, buckets: &[(Arc<str>, u32)]) -> Result<Vec<ResetBucket>, StoreError> {
        self.require_initialized()?;
        let batch: Vec<Increment> = buckets
            .iter()
            .map(|(bucket, window_secs)| Increment {
                bucket: bucket.clone(),
                window_secs: *window_secs,
                by: 0,
                sliding: None,
                enforce: None,
                check: false,
            })
            .collect();
        let (names, windows) = columns(&batch)?;
        let mut conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
        let rows = async {
            let tx = conn.begin().await?;
            let delete: [(&(dyn ToSql + Sync), Type); 2] =
                [(&names, Type::TEXT_ARRAY), (&windows, Type::INT8_ARRAY)];
            let rows = tx.query_typed(RESET_SQL, &delete).await?;
            let notify: [(&(dyn ToSql + Sync), Type); 2] =
                [(&RESET_CHANNEL, Type::TEXT), (&names, Type::TEXT_ARRAY)];
            tx.execute_typed(
                "SELECT pg_notify($1, b) FROM unnest($2::text[]) AS b",
                &notify,
            )
            .await?;
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>(rows)
        }
        .await
        .map_err(|e| self.fail(e))?;
        let mut out: Vec<ResetBucket> = buckets
            .iter()
            .map(|(bucket, _)| ResetBucket {
                bucket: bucket.clone(),
                count: 0,
                previous: None,
            })
            .collect();
        for row in &rows {
            let bucket: &str = row.try_get(0).map_err(query_error)?;
            let current: bool = row.try_get(1).map_err(query_error)?;
            let count = count_from(row.try_get(2).map_err(query_error)?)?;
            if let Some(entry) = out.iter_mut().find(|b| &*b.bucket == bucket) {
                if current {
                    entry.count = count;
                } else {
                    entry.previous = Some(count);
                }
            }
        }
        Ok(out)
    }

    /// The `LISTEN` session of contract §3b, for as long as the returned future runs: a connection
    /// of its own (a pooled one would be handed back after each statement, and bb8's
    /// connection task throws notifications away), listening on [`RESET_CHANNEL`], and `on`
    /// told of each reset bucket.
    ///
    /// It sends `LISTEN` only on a session that is its backend's own ([`session::settle`]):
    /// through a pooler (PgBouncer in either mode) the statement would land on a server
    /// connection that stays in the pool, listening, for other clients, and in transaction
    /// mode notifications would not come back anyway. There it reports
    /// [`ResetEvent::Hearing`] `false` at once, logs it once, and looks again every
    /// [`LISTEN_RECHECK`] (docs/operations.md, "Connection poolers").
    ///
    /// It survives database restarts and failover: a lost session is reopened with back-off
    /// ([`LISTEN_RETRY_FIRST`] to [`LISTEN_RETRY_LAST`]), and every (re)start reports
    /// [`ResetEvent::Missed`], since resets made while it was away were not heard. Every
    /// [`LISTEN_CHECK_EVERY`] it sends itself a notification through the pool:
    /// [`LISTEN_CHECKS_MISSED`] in a row that do not arrive within [`LISTEN_CHECK_WAIT`] while
    /// the session still answers mean notifications are not delivered to it
    /// ([`ResetEvent::Hearing`] `false`); a session that no longer answers is reopened.
    pub async fn listen_for_resets(self: Arc<Self>, mut on: impl FnMut(ResetEvent<'_>) + Send) {
        let mut delay = LISTEN_RETRY_FIRST;
        let mut hearing: Option<bool> = None;
        let mut was_up = false;
        loop {
            let started = Instant::now();
            let err = match self.listen_session(&mut on, &mut hearing, was_up).await {
                ListenEnd::Lost(why) => why,
                ListenEnd::Pooled => {
                    if hearing != Some(false) {
                        tracing::error!(
                            "reset listener: store.url reaches the database through a connection \
                             pooler, so this instance sends no LISTEN (it would stay behind on a \
                             server connection that other clients get) and notifications do not \
                             reach this instance; it stops caching denials so that tollgate reset \
                             still takes effect here at once (every denied request then costs a \
                             statement); see docs/operations.md"
                        );
                        hearing = Some(false);
                        on(ResetEvent::Hearing(false));
                    }
                    delay = LISTEN_RETRY_FIRST;
                    tokio::time::sleep(LISTEN_RECHECK).await;
                    continue;
                }
            };
            if started.elapsed() > LISTEN_RETRY_LAST * 2 {
                delay = LISTEN_RETRY_FIRST;
            }
            if was_up || hearing.is_some() {
                tracing::warn!(error = %err, "reset listener: lost its database session; reconnecting");
            } else {
                tracing::debug!(error = %err, "reset listener: cannot listen yet");
            }
            was_up = was_up || hearing.is_some();
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(LISTEN_RETRY_LAST);
        }
    }

    /// One listen session, until it fails; returns why.
    async fn listen_session(
        &self,
        on: &mut (impl FnMut(ResetEvent<'_>) + Send),
        hearing: &mut Option<bool>,
        reconnect: bool,
    ) -> ListenEnd {
        let (pg, tls) = &self.session;
        let deadline = connect_deadline(pg);
        let (client, mut connection) =
            match tokio::time::timeout(deadline, pg.connect(tls.clone())).await {
                Ok(Ok(pair)) => pair,
                Ok(Err(e)) => return ListenEnd::Lost(describe(&e)),
                Err(_) => return ListenEnd::Lost(format!("no connection within {deadline:?}")),
            };
        // The connection is driven here rather than by a spawned task of tokio-postgres', so
        // that its notifications come out. Bounded: past LISTEN_QUEUE waiting, the rest are
        // dropped and the owner forgets everything instead.
        let (tx, mut notified) = tokio::sync::mpsc::channel::<Heard>(LISTEN_QUEUE);
        let overflowed = Arc::new(AtomicBool::new(false));
        let dropped = overflowed.clone();
        let driver = tokio::spawn(async move {
            loop {
                match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                        let heard = Heard {
                            channel: Channel::of(n.channel()),
                            payload: n.payload().to_owned(),
                        };
                        if tx.try_send(heard).is_err() {
                            dropped.store(true, Ordering::Release);
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return describe(&e),
                    None => return "the session ended".to_owned(),
                }
            }
        });
        let _driver = AbortOnDrop(driver.abort_handle());
        // Whose session this is, and its timeouts (the liveness check's `SELECT 1` included)
        // set to the listen session's own bound, whatever the role's.
        let settle = session::settle(&client, LISTEN_STATEMENT_TIMEOUT);
        match tokio::time::timeout(LISTEN_STATEMENT_TIMEOUT, settle).await {
            Ok(Ok(settled)) if settled.own => {}
            Ok(Ok(_)) => return ListenEnd::Pooled,
            Ok(Err(e)) => return ListenEnd::Lost(describe(&e)),
            Err(_) => return ListenEnd::Lost("the session did not answer".to_owned()),
        }
        // A statement of its own, after the check: the session is its backend's for good, and
        // `pg_stat_activity.query` shows `LISTEN tollgate_reset` (docs/operations.md).
        let listen_shares = format!("LISTEN {SHARES_CHANNEL}; LISTEN {OVERRIDES_CHANNEL}");
        let listen = format!("LISTEN {RESET_CHANNEL}");
        let name = self
            .listen_name
            .map(|name| format!("SET application_name = '{name}'"))
            .unwrap_or_default();
        // Pipelined, the reset channel's `LISTEN` last: one round trip.
        let named_and_listening = async {
            let named = async {
                if name.is_empty() {
                    Ok(())
                } else {
                    client.batch_execute(&name).await
                }
            };
            let (named, shares, listened) = tokio::join!(
                named,
                client.batch_execute(&listen_shares),
                client.batch_execute(&listen)
            );
            named.and(shares).and(listened)
        };
        match tokio::time::timeout(LISTEN_STATEMENT_TIMEOUT, named_and_listening).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return ListenEnd::Lost(describe(&e)),
            Err(_) => return ListenEnd::Lost("LISTEN did not answer".to_owned()),
        }
        if reconnect {
            tracing::info!("reset listener: listening again; cached denials forgotten, since resets may have been missed");
        } else {
            tracing::debug!(channel = RESET_CHANNEL, "reset listener: listening");
        }
        on(ResetEvent::Missed);

        let token = format!("{LISTEN_CHECK_PREFIX}{:032x}", rand::random::<u128>());
        let mut check = tokio::time::interval(LISTEN_CHECK_EVERY);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // When the check sent last must have come back.
        let mut awaiting: Option<tokio::time::Instant> = None;
        let mut missed = 0u32;
        loop {
            let wait_until =
                awaiting.unwrap_or_else(|| tokio::time::Instant::now() + LISTEN_CHECK_EVERY * 4);
            tokio::select! {
                heard = notified.recv() => match heard {
                    Some(Heard { channel: Channel::Shares, payload }) => {
                        if let Some(event) = share_event(&payload) {
                            on(event);
                        }
                    }
                    Some(Heard { channel: Channel::Overrides, .. }) => on(ResetEvent::Overrides),
                    Some(Heard { payload, .. }) if payload == token => {
                        awaiting = None;
                        missed = 0;
                        if *hearing != Some(true) {
                            if *hearing == Some(false) {
                                tracing::info!("reset listener: notifications arrive again; resets reach this instance within a second");
                            }
                            *hearing = Some(true);
                            on(ResetEvent::Hearing(true));
                            // Whatever was cached meanwhile was cached without a listener.
                            on(ResetEvent::Missed);
                        }
                    }
                    Some(Heard { payload, .. }) if payload.starts_with(LISTEN_CHECK_PREFIX) => {}
                    Some(Heard { payload: bucket, .. }) => on(ResetEvent::Bucket(&bucket)),
                    None => {
                        return ListenEnd::Lost(match driver_result(&client) {
                            Some(why) => why,
                            None => "the session ended".to_owned(),
                        });
                    }
                },
                _ = check.tick(), if awaiting.is_none() => {
                    if self.send_check(&token).await {
                        awaiting = Some(tokio::time::Instant::now() + LISTEN_CHECK_WAIT);
                    }
                }
                _ = tokio::time::sleep_until(wait_until), if awaiting.is_some() => {
                    awaiting = None;
                    // The check did not come back. A session that still answers is deaf;
                    // one that does not is gone.
                    let alive = tokio::time::timeout(LISTEN_STATEMENT_TIMEOUT, client.simple_query("SELECT 1")).await;
                    match alive {
                        Ok(Ok(_)) => {
                            missed += 1;
                            if missed >= LISTEN_CHECKS_MISSED && *hearing != Some(false) {
                                tracing::error!(
                                    "reset listener: notifications do not reach this instance's LISTEN session \
                                     (something between tollgate and the database that passes the \
                                     backend's key on but not its notifications?); this instance stops caching \
                                     denials so that tollgate reset still takes effect here at once \
                                     (every denied request then costs a statement); see docs/operations.md"
                                );
                                *hearing = Some(false);
                                on(ResetEvent::Hearing(false));
                            }
                        }
                        Ok(Err(e)) => return ListenEnd::Lost(describe(&e)),
                        Err(_) => return ListenEnd::Lost("the session stopped answering".to_owned()),
                    }
                }
            }
            if overflowed.swap(false, Ordering::AcqRel) {
                tracing::warn!("reset listener: more resets than it could queue; every cached denial forgotten");
                on(ResetEvent::Missed);
            }
        }
    }

    /// Sends the listen session's check through the pool (as `tollgate reset` would reach
    /// it); false when the database did not take it (then there is nothing to wait for).
    async fn send_check(&self, token: &str) -> bool {
        let sent = self
            .bounded(|| async {
                let conn = self.pool.get().await.map_err(|e| self.pool_error(e))?;
                let params: [(&(dyn ToSql + Sync), Type); 2] =
                    [(&RESET_CHANNEL, Type::TEXT), (&token, Type::TEXT)];
                conn.run(|| conn.execute_typed("SELECT pg_notify($1, $2)", &params))
                    .await
                    .map_err(query_error)
            })
            .await;
        sent.is_ok()
    }
}

/// One notification as the listen session's driver hands it on.
struct Heard {
    channel: Channel,
    payload: String,
}

/// The channel a notification came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    /// [`RESET_CHANNEL`] (resets, and the session's own check).
    Reset,
    /// [`SHARES_CHANNEL`].
    Shares,
    /// [`OVERRIDES_CHANNEL`].
    Overrides,
}

impl Channel {
    fn of(name: &str) -> Channel {
        match name {
            SHARES_CHANNEL => Channel::Shares,
            OVERRIDES_CHANNEL => Channel::Overrides,
            _ => Channel::Reset,
        }
    }
}

/// What a notification on [`SHARES_CHANNEL`] asks; `None` for a payload no release sends.
fn share_event(payload: &str) -> Option<ResetEvent<'_>> {
    if let Some(bucket) = payload.strip_prefix("reclaim ") {
        Some(ResetEvent::Reclaim(bucket))
    } else {
        payload.strip_prefix("returned ").map(ResetEvent::Returned)
    }
}

/// Why the listen session's client stopped, if it says.
fn driver_result(client: &Client) -> Option<String> {
    client
        .is_closed()
        .then(|| "the connection closed".to_owned())
}

/// Aborts a spawned task when dropped (the listen session's connection driver).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
