//! Counter stores: where the fixed-window counts live (contract §3 and §6).
//!
//! A store takes a batch of increments, one per distinct bucket, and answers with each bucket's
//! count after the increment, the end of its window and the store's own clock. Both the window
//! and "now" come from the same clock (the database's, for Postgres) so that instances whose
//! clocks disagree still share one window, and `Retry-After` agrees with it.

mod bucket_name;
mod clock;
pub mod coalesce;
pub mod memory;
pub mod postgres;
pub mod settings;

pub use clock::{Clock, ManualClock};

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::Detail;

/// One bucket to increment. Buckets in one batch are distinct.
///
/// A batch passed to [`Store::increment`] is ONE request's limits, decided together: the
/// request is allowed only when every increment with `enforce` admits all of its units
/// (contract §3d: a request's units fit all together or not at all). Sliding windows count only
/// allowed units (contract §3a); fixed windows count a one-unit increment allowed or not
/// (contract §3), one of several units only when the request is allowed (§3d).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Increment {
    /// `<scope>:<label>:<digest>` or `<scope>:global`; never a raw subject.
    pub bucket: Arc<str>,
    /// Window length in whole seconds.
    pub window_secs: u32,
    /// The units of this increment: one request's `cost` (contract §3d); 0 for reads. A store
    /// that folds several requests into one row sums them there.
    pub by: u32,
    /// `Some(requests)` for a sliding-window limit (contract §3a): the store counts only the units
    /// that the estimate admits against `requests`. `None`: a fixed window.
    pub sliding: Option<u32>,
    /// `Some(requests)`: an enforced limit, which denies a request whose units do not fit in
    /// `requests` (a fixed window: by the units' positions; a sliding one: by its estimate,
    /// against the same `requests`). `None`: a shadow limit, or a count that decides nothing
    /// (reads, resets, probes). A shadow sliding limit counts the allowed units that its own
    /// estimate admits.
    pub enforce: Option<u32>,
    /// Only whether the `by` units fit is decided; none is added (a limit charged after the
    /// response, contract §3d: admitted by a read of what is left, charged later).
    pub check: bool,
}

/// One override of a bucket's `requests` (contract §3e), as the database keeps it: the
/// `requests` that replaces the limit's, and until when (unix milliseconds, `None`: no end).
/// Here, with the store that reads them, so that the limiter above uses the store's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub requests: u32,
    pub until_ms: Option<i64>,
}

impl Override {
    /// Whether it applies at `now_ms`.
    pub fn in_force(&self, now_ms: i64) -> bool {
        self.until_ms.is_none_or(|until| now_ms < until)
    }
}

/// Bucket (`<scope>:<label>:<digest>`, or `<scope>:global`) -> its override.
pub type OverrideMap = std::collections::HashMap<Box<str>, Override, foldhash::fast::RandomState>;

/// The state of one bucket right after an increment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// The count after this increment (saturating at `i32::MAX`).
    pub count: u32,
    /// Unix time, in milliseconds, at which this window ends.
    pub window_end_ms: i64,
    /// The store's clock when it counted, in unix milliseconds.
    pub now_ms: i64,
    /// How many of the increment's units were counted: all of `by` for a fixed window; for a
    /// sliding one the first `added` units were admitted and the rest denied (not counted).
    pub added: u32,
    /// Sliding windows: the count of the previous window's row (0 if none; 0 for fixed).
    pub previous: u32,
    /// Sliding windows: how many of the increment's units this limit's own estimate admits
    /// (a prefix of them). They are counted (`added`) only when every enforced limit of the
    /// request admits them too. Fixed windows: `by` (the count itself says where they stand).
    pub fits: u32,
}

/// The state of one bucket as read, without incrementing (`tollgate explain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peeked {
    pub count: u32,
    pub window_end_ms: i64,
    pub now_ms: i64,
    /// The count of the previous window's row (0 if none): what a sliding limit weighs
    /// (contract §3a).
    pub previous: u32,
}

/// A reserved share this instance would like of one bucket (contract §3c). Buckets in one call
/// are distinct.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareWant {
    pub bucket: Arc<str>,
    pub window_secs: u32,
    /// The limit's `requests`: the share never takes the row past it.
    pub requests: u32,
    /// `algorithm = "sliding"`: what is left is `requests` minus the estimate of contract §3a.
    pub sliding: bool,
    /// Units asked for (at least 1); the store grants at most what is left divided among
    /// twice the live instances, and at least `need` while that much is left.
    pub want: u32,
    /// Units needed at least (at least 1): what the request that asks takes (its `cost`,
    /// contract §3d) beyond what this instance holds. Fewer left: nothing is granted.
    pub need: u32,
}

/// What the store granted of one [`ShareWant`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareGrant {
    /// Units granted, already counted in the row; 0 when fewer than the units needed are
    /// left.
    pub granted: u32,
    /// The row's count after the grant.
    pub count: u32,
    /// Sliding: the previous window's count (0 without a row; 0 for fixed).
    pub previous: u32,
    /// Unix milliseconds at which the share's window ends (the store's clock).
    pub window_end_ms: i64,
    /// The store's clock when it granted, unix milliseconds.
    pub now_ms: i64,
}

/// Units a request is charged after its response (contract §3d): added to the current window
/// of its bucket, the count saturating at the limit's `requests`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    pub bucket: Arc<str>,
    pub window_secs: u32,
    /// `algorithm = "sliding"`: the row lives a window more (contract §3a).
    pub sliding: bool,
    pub units: u32,
    /// The limit's `requests`: a charge never takes the count past it (nor lowers a count
    /// already above it).
    pub requests: u32,
}

/// Unused units of a share, going back to their row (contract §3c).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiveBack {
    pub bucket: Arc<str>,
    /// The share's window start, unix seconds: a share goes back to the row it came from.
    pub window_start_secs: i64,
    pub unused: u32,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store timed out")]
    Timeout,
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Detail),
    #[error("store error: {0}")]
    Query(#[source] Detail),
}

/// What the PostgreSQL store's reset listener reports to its owner, the limiter's cache of
/// denials (docs/operations.md, "`tollgate reset`"): the one message from a store to the
/// limiter that is not an answer to a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetEvent<'a> {
    /// `tollgate reset` deleted this bucket's rows: forget what is cached about it.
    Bucket(&'a str),
    /// The session (re)started listening, or dropped notifications: any reset since the last
    /// one may have been missed, so forget everything cached.
    Missed,
    /// Another instance found this bucket exhausted and asks for its unused reserved units
    /// (contract §3c).
    Reclaim(&'a str),
    /// Reserved units of this bucket went back to its row: a denial cached from the exhausted
    /// row no longer holds.
    Returned(&'a str),
    /// `tollgate override` changed the overrides (contract §3e): read them again.
    Overrides,
    /// Whether notifications reach this session. `false`: they are not delivered (a pooler in
    /// transaction mode hands the `LISTEN` to a server connection this session does not
    /// keep), so nothing cached can be trusted to be forgotten by a reset.
    Hearing(bool),
}

/// This process's clock as Unix milliseconds (negative before 1970, saturating): the memory
/// store's windows and the limiter's estimate of a window's end when it did not ask the store.
pub fn unix_now_ms() -> i64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
    }
}

pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// The registry of live instances (contract §5b), as the local fallback uses it: a store
/// shared by several instances keeps one, the PostgreSQL store in `tollgate_instances`.
pub trait InstanceRegistry: Send + Sync {
    /// Whether the store can be asked yet (migrated, fingerprint checked).
    fn registry_ready(&self) -> bool;

    /// Refreshes this instance's entry and answers how many instances are live (this one
    /// included).
    fn refresh_instance(&self) -> StoreFuture<'_, u32>;

    /// Removes this instance's entry (a clean stop); answers whether there was one.
    fn deregister_instance(&self) -> StoreFuture<'_, bool>;
}

/// A place that counts. Implementations must be exact under concurrency: two increments of
/// one bucket never both see the same count.
pub trait Store: Send + Sync + 'static {
    /// Increment every bucket of one request's batch (all in one round trip), deciding the
    /// request against all of its enforced limits at once (see [`Increment`]), answering in
    /// batch order.
    fn increment<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Counted>>;

    /// Several requests, decided one after another in this order, exactly as if each had been
    /// sent alone with [`Store::increment`] in that order (for PostgreSQL: in one statement).
    /// A bucket that appears in several requests must have the same window and algorithm in
    /// all of them. The default sends them one by one.
    fn increment_each<'a>(
        &'a self,
        requests: &'a [&'a [Increment]],
    ) -> StoreFuture<'a, Vec<Vec<Counted>>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(requests.len());
            for batch in requests {
                out.push(self.increment(batch).await?);
            }
            Ok(out)
        })
    }

    /// Read buckets' current windows without changing them, in batch order (`by` is ignored).
    fn peek<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Peeked>>;

    /// Whether the last call to the store succeeded (cheap; no round trip).
    fn ready(&self) -> bool;

    /// Whether decisions succeed now (for `/readyz`, contract §7): the outcome of recent decisions
    /// when there are some, else a round trip that exercises what a decision needs (for
    /// Postgres: the real increment, rolled back).
    fn probe(&self) -> StoreFuture<'_, ()>;

    /// How a decision that used this store ended, as the limiter saw it (its own timeout and
    /// the breaker included), so that [`Store::probe`] can follow real decisions.
    fn decision_outcome(&self, _succeeded: bool) {}

    /// Whether this store grants reserved shares (contract §3c): a store shared by several
    /// instances. The memory store decides `reserve` limits in memory, as any other.
    fn reserves(&self) -> bool {
        false
    }

    /// Grants shares of several buckets in one round trip, in `wants` order; `instances` is
    /// the count of live instances the share size divides by.
    fn reserve<'a>(
        &'a self,
        _wants: &'a [ShareWant],
        _instances: u32,
    ) -> StoreFuture<'a, Vec<ShareGrant>> {
        Box::pin(async { Err(StoreError::Query("this store keeps no shares".into())) })
    }

    /// Gives unused units back in one round trip; answers, in `back` order, how many each
    /// row took back (0 when the row or this instance's share of it is gone, after a reset).
    fn give_back<'a>(&'a self, back: &'a [GiveBack]) -> StoreFuture<'a, Vec<u32>> {
        Box::pin(async move { Ok(vec![0; back.len()]) })
    }

    /// Adds charges (contract §3d) in one round trip; buckets in one call are distinct.
    fn charge<'a>(&'a self, _charges: &'a [Charge]) -> StoreFuture<'a, ()> {
        Box::pin(async { Err(StoreError::Query("this store takes no charges".into())) })
    }

    /// A short name for logs: `memory` or `postgres`.
    fn kind(&self) -> &'static str;

    /// [`Store::increment`]'s answer, right away, from a store that never waits (no I/O, no
    /// await); `None` from one that may. A decision then needs no timer for its budget, and
    /// no boxed future: arming and dropping a timer costs more than the memory store's whole
    /// increment, and the box about a fifth of it.
    fn increment_now(&self, _batch: &[Increment]) -> Option<Result<Vec<Counted>, StoreError>> {
        None
    }
}
