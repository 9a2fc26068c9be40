//! The in-process counter store (SPEC section 2, `store.url` absent; section 3 for windows).
//!
//! Same semantics as the Postgres store, with the process clock instead of the database's:
//! fixed windows aligned on the Unix epoch (`window_start = floor(now / window) * window`),
//! counts that saturate at `i32::MAX` (the Postgres column's range, so both stores answer
//! alike), exact under concurrency. Counters are not shared between processes: this is the
//! store for a single instance.
//!
//! A bucket keeps only its current window (an ended window is never read again; in the seed's
//! terms its row would only be waiting for the sweep), so memory is bounded by the buckets that
//! are live. Ended windows are dropped by [`MemoryStore::sweep`] and, without anyone calling
//! it, by an amortised cleanup each shard runs when it has doubled in size.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{Counted, Increment, Peeked, Store, StoreError, StoreFuture};

/// Buckets are hashed on every request, twice (shard, then map), and SipHash over an
/// 80-byte bucket name cost more than the rest of the lookup. foldhash is seeded per
/// process like std's hasher, and a bucket's name ends in a SHA-256 or HMAC digest, so a
/// client cannot line up colliding names.
type RandomState = foldhash::fast::RandomState;

/// Counts saturate here, like the Postgres `integer` column.
const COUNT_MAX: u32 = i32::MAX as u32;

/// Shards, so that requests on different buckets rarely wait on one lock.
const SHARDS: usize = 16;

/// A shard is not cleaned below this many entries (cleanup would cost more than it frees).
const MIN_CLEANUP_LEN: usize = 1024;

/// The clock: Unix time in milliseconds.
type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// One bucket's current window.
#[derive(Debug, Clone, Copy)]
struct Window {
    start_ms: i64,
    end_ms: i64,
    count: u32,
}

struct Shard {
    windows: HashMap<Arc<str>, Window, RandomState>,
    /// Size at which the next opportunistic cleanup runs: twice the live size after the last
    /// one, so cleanup is amortised O(1) per insert and the map never exceeds twice its live
    /// buckets (plus [`MIN_CLEANUP_LEN`]).
    cleanup_at: usize,
}

impl Shard {
    fn new() -> Self {
        Shard {
            windows: HashMap::default(),
            cleanup_at: MIN_CLEANUP_LEN,
        }
    }

    /// Drops ended windows; returns how many.
    fn remove_ended(&mut self, now_ms: i64) -> u64 {
        let before = self.windows.len();
        self.windows.retain(|_, w| w.end_ms > now_ms);
        self.cleanup_at = (self.windows.len() * 2).max(MIN_CLEANUP_LEN);
        (before - self.windows.len()) as u64
    }
}

/// Fixed-window counters in this process.
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    /// Picks a bucket's shard. A per-process random hasher is fine here: nothing it produces
    /// leaves the process.
    hasher: RandomState,
    clock: Clock,
    /// Windows dropped so far, by sweeps and cleanups (for metrics).
    removed: AtomicU64,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("buckets", &self.len())
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(system_now_ms)
    }

    /// A store on a clock of the caller's (Unix milliseconds), so tests can cross window
    /// boundaries without sleeping.
    pub fn with_clock(clock: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::new())).collect(),
            hasher: RandomState::default(),
            clock: Arc::new(clock),
            removed: AtomicU64::new(0),
        }
    }

    /// Drops every window that has ended; returns how many. Run it on `store.sweep_interval`.
    pub fn sweep(&self) -> u64 {
        let now_ms = (self.clock)();
        let removed: u64 = (0..SHARDS).map(|i| self.lock(i).remove_ended(now_ms)).sum();
        self.removed.fetch_add(removed, Ordering::Relaxed);
        removed
    }

    /// Buckets held, live or not yet cleaned up.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|i| self.lock(i).windows.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Windows dropped so far by sweeps and cleanups.
    pub fn removed_total(&self) -> u64 {
        self.removed.load(Ordering::Relaxed)
    }

    fn shard_of(&self, bucket: &str) -> usize {
        (self.hasher.hash_one(bucket) % SHARDS as u64) as usize
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Shard> {
        // A panic while holding a shard cannot leave a window half-written (every update is
        // a single assignment), so a poisoned lock is still safe to use.
        self.shards[shard]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn count(&self, batch: &[Increment]) -> Result<Vec<Counted>, StoreError> {
        let now_ms = (self.clock)();
        batch
            .iter()
            .map(|inc| {
                let current = window_at(now_ms, inc.window_secs)?;
                let mut shard = self.lock(self.shard_of(&inc.bucket));
                if shard.windows.len() >= shard.cleanup_at {
                    let removed = shard.remove_ended(now_ms);
                    self.removed.fetch_add(removed, Ordering::Relaxed);
                }
                let window = shard
                    .windows
                    .entry(Arc::clone(&inc.bucket))
                    .or_insert(current);
                // A newer window starts from zero, like a new row in Postgres. An entry whose
                // window is *later* than ours (the clock stepped back) keeps counting: resetting
                // it would forget requests already allowed.
                if window.end_ms <= now_ms || window.start_ms < current.start_ms {
                    *window = current;
                }
                window.count = window.count.saturating_add(inc.by).min(COUNT_MAX);
                Ok(Counted {
                    count: window.count,
                    window_end_ms: window.end_ms,
                    now_ms,
                })
            })
            .collect()
    }

    fn read(&self, batch: &[Increment]) -> Result<Vec<Peeked>, StoreError> {
        let now_ms = (self.clock)();
        batch
            .iter()
            .map(|inc| {
                let current = window_at(now_ms, inc.window_secs)?;
                let shard = self.lock(self.shard_of(&inc.bucket));
                let peeked = match shard.windows.get(&inc.bucket) {
                    Some(w) if w.end_ms > now_ms && w.start_ms >= current.start_ms => Peeked {
                        count: w.count,
                        window_end_ms: w.end_ms,
                        now_ms,
                    },
                    _ => Peeked {
                        count: 0,
                        window_end_ms: current.end_ms,
                        now_ms,
                    },
                };
                Ok(peeked)
            })
            .collect()
    }
}

impl Store for MemoryStore {
    fn increment<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Counted>> {
        let result = self.count(batch);
        Box::pin(async move { result })
    }

    fn peek<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Peeked>> {
        let result = self.read(batch);
        Box::pin(async move { result })
    }

    fn ready(&self) -> bool {
        true
    }

    fn probe(&self) -> StoreFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

/// The epoch-aligned window of `window_secs` containing `now_ms`, with a zero count.
/// `div_euclid` is the floor even for a clock before 1970.
fn window_at(now_ms: i64, window_secs: u32) -> Result<Window, StoreError> {
    if window_secs == 0 {
        return Err(StoreError::Query("a window of 0 seconds".to_owned()));
    }
    let len_ms = i64::from(window_secs) * 1000;
    let start_ms = now_ms.div_euclid(len_ms) * len_ms;
    Ok(Window {
        start_ms,
        end_ms: start_ms + len_ms,
        count: 0,
    })
}

/// The system clock in Unix milliseconds; negative before 1970 rather than an error.
fn system_now_ms() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
    }
}
