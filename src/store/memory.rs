//! The in-process counter store (contract §2, `store.url` absent; section 3 for windows;
//! section 9 for its bound).
//!
//! Same semantics as the Postgres store, with the process clock instead of the database's:
//! fixed windows aligned on the Unix epoch (`window_start = floor(now / window) * window`),
//! counts that saturate at `i32::MAX` (the Postgres column's range, so both stores answer
//! alike), exact under concurrency. Counters are not shared between processes: this is the
//! store for a single instance.
//!
//! A bucket keeps only its current window (an ended window is never read again; in the seed's
//! terms its row would only be waiting for the sweep). Ended windows are dropped by
//! [`MemoryStore::sweep`] and, without anyone calling it, by an amortised cleanup each shard
//! runs once it has taken in as many new buckets as it held live after the last one.
//!
//! Bounded, whatever clients send (contract §9): the store holds at most `store.memory_buckets`
//! buckets. Like an nginx `limit_req` zone, a full store forgets the bucket used least
//! recently to make room, and counts it in `tollgate_memory_evictions_total`; that client's
//! next request starts a new count, which can let it through early. A bucket in use keeps its
//! place: each increment makes it the most recently used. (A client already over its limit
//! stays denied in any case while the exhausted-bucket cache (`limit::Exhausted`) remembers it.)
//!
//! Sharding and the bound: the buckets are split over up to [`MAX_SHARDS`] shards, each with
//! its own lock, least-recently-used list and an equal part of the bound (the parts add up to
//! exactly `memory_buckets`). A shard is made only per [`MIN_SHARD_BUCKETS`] of the bound, so
//! a small bound is one shard and exactly least-recently-used across the store; a large one
//! (the default 1,000,000 is 16 shards of 62,500) evicts the least recently used bucket *of
//! the full shard*, which may happen while another shard still has a little room (random
//! hashing spreads buckets within a few percent of evenly).
//!
//! Memory: a live bucket is one 64-byte slot (its name as a 32-byte digest and the id of its
//! `<scope>:<label>` text, its window packed, two list links) and a 4-byte index entry, with
//! no allocation of its own (`bucket_name.rs`). `bench/memory_bucket_bytes.sh` measures about
//! 75 bytes of resident memory per live bucket, flat however many keys churn through: the
//! default bound is about 75 MB at most (docs/performance.md, "Memory per bucket").

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hashbrown::HashTable;

use super::bucket_name::{key_hash, BucketName, Names, RandomState, DIGEST_LEN};
use super::settings::DEFAULT_MEMORY_BUCKETS;
use super::{Charge, Counted, Increment, Peeked, Store, StoreError, StoreFuture};
use crate::metrics::MemoryStoreMetrics;

/// Counts saturate here, like the Postgres `integer` column.
const COUNT_MAX: u32 = i32::MAX as u32;

/// In a slot's count: the bucket is a sliding limit's (see [`Slot`]). A count never reaches
/// it, since counts saturate at [`COUNT_MAX`].
const SLIDING: u32 = 1 << 31;
const _: () = assert!(COUNT_MAX & SLIDING == 0);

/// Shards at most, so that requests on different buckets rarely wait on one lock.
pub const MAX_SHARDS: usize = 16;

/// One shard per this many buckets of the bound (and at least one): below it, a shard's part
/// of the bound would be small enough for the split to distort which bucket is evicted.
pub const MIN_SHARD_BUCKETS: usize = 4096;

/// A shard is not cleaned more often than once per this many new buckets (cleanup would cost
/// more than it frees).
const MIN_CLEANUP_LEN: usize = 1024;

/// "No slot": the end of a least-recently-used list.
const NIL: u32 = u32::MAX;

/// The clock: Unix time in milliseconds.
type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// One bucket's current window, as the counting reads and writes it (a [`Slot`] keeps it
/// packed).
#[derive(Debug, Clone, Copy)]
struct Window {
    start_ms: i64,
    end_ms: i64,
    count: u32,
    /// Sliding windows: the count of the window just before this one (0 if it was not kept).
    previous: u32,
    /// When the bucket may be forgotten: the window's end, or one window later for a sliding
    /// limit, whose count is still read as "previous" then (like `expires_at` in Postgres).
    keep_ms: i64,
}

/// A bucket in its shard's least-recently-used list: 64 bytes, the whole of a bucket but for
/// its index entry (a test holds it to that). The window is packed: its length is whole
/// seconds, which with its start give its end, and whether it is kept one window longer (a
/// sliding limit's) is the count's top bit.
struct Slot {
    /// The name's digest (zeros for a name held whole), with `name`: the bucket's key.
    digest: [u8; DIGEST_LEN],
    start_ms: i64,
    /// The shard's [`Names`] id of the name's `<scope>:<label>` text (or of the whole name).
    name: u32,
    len_secs: u32,
    /// The count, and [`SLIDING`].
    count: u32,
    previous: u32,
    /// Towards the most recently used end.
    newer: u32,
    /// Towards the least recently used end.
    older: u32,
}

impl Slot {
    fn window(&self) -> Window {
        let start_ms = self.start_ms;
        let len_ms = i64::from(self.len_secs) * 1000;
        let end_ms = start_ms + len_ms;
        let sliding = self.count & SLIDING != 0;
        Window {
            start_ms,
            end_ms,
            count: self.count & !SLIDING,
            previous: self.previous,
            keep_ms: if sliding { end_ms + len_ms } else { end_ms },
        }
    }

    /// Packs `w`, which [`window_at`] made (whole seconds; `keep_ms` is its end, or one
    /// window later).
    fn set_window(&mut self, w: Window) {
        self.start_ms = w.start_ms;
        // A `window_secs` (u32) in milliseconds, back in seconds.
        self.len_secs = ((w.end_ms - w.start_ms) / 1000) as u32;
        let sliding = if w.keep_ms > w.end_ms { SLIDING } else { 0 };
        self.count = w.count.min(COUNT_MAX) | sliding;
        self.previous = w.previous;
    }
}

/// What making room for a new bucket cost.
enum Made {
    /// The shard had room.
    Room,
    /// A live bucket was forgotten.
    Evicted,
    /// A bucket whose window had ended was dropped (no loss).
    Dropped,
}

/// A bounded map from bucket to window, in least-recently-used order. Slots live in one
/// vector (dense: a removed slot is filled by the last one), linked by index; the index holds
/// slot numbers only, found by the hash of the slot's key.
struct Shard {
    index: HashTable<u32>,
    names: Names,
    slots: Vec<Slot>,
    /// Most recently used slot, or [`NIL`].
    newest: u32,
    /// Least recently used slot, or [`NIL`]: the one evicted next.
    oldest: u32,
    /// This shard's part of `memory_buckets`; at least 1, at most `u32::MAX`.
    capacity: usize,
    /// New buckets taken in since the last cleanup of ended windows.
    new_since_cleanup: usize,
    /// New buckets after which the next cleanup runs: as many as were live after the last
    /// one, so cleanup is amortised O(1) per new bucket and a shard below its bound holds at
    /// most about twice its live buckets (plus [`MIN_CLEANUP_LEN`]).
    cleanup_every: usize,
    /// The store's hasher: a slot's key hashes as its name did ([`BucketName::hash`]).
    hasher: RandomState,
}

/// The hash of slot `slot`'s key, as its name hashed when it was counted.
fn slot_hash(hasher: &RandomState, names: &Names, slot: &Slot) -> u64 {
    let text = names.text(slot.name);
    let digest = (!names.is_whole(slot.name)).then_some(&slot.digest);
    key_hash(hasher, text, digest)
}

impl Shard {
    fn new(capacity: usize, hasher: RandomState) -> Self {
        Shard {
            index: HashTable::new(),
            names: Names::new(hasher.clone()),
            slots: Vec::new(),
            newest: NIL,
            oldest: NIL,
            capacity,
            new_since_cleanup: 0,
            cleanup_every: MIN_CLEANUP_LEN,
            hasher,
        }
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    /// The slot of the bucket `name`, if the shard holds it.
    fn find(&self, name: &BucketName<'_>) -> Option<u32> {
        self.index
            .find(name.hash, |&i| {
                let slot = &self.slots[i as usize];
                slot.digest == name.digest && self.names.is(slot.name, name)
            })
            .copied()
    }

    /// Takes slot `i` out of the index and gives up its name (it stays in `slots`).
    fn unindex(&mut self, i: u32) {
        let slot = &self.slots[i as usize];
        let hash = slot_hash(&self.hasher, &self.names, slot);
        if let Ok(entry) = self.index.find_entry(hash, |&j| j == i) {
            entry.remove();
        }
        self.names.release(slot.name);
    }

    /// Puts slot `i`, whose key hashes to `hash`, in the index.
    fn reindex(&mut self, i: u32, hash: u64) {
        let Shard {
            index,
            names,
            slots,
            hasher,
            ..
        } = self;
        index.insert_unique(hash, i, |&j| slot_hash(hasher, names, &slots[j as usize]));
    }

    /// Takes slot `i` out of the list (it stays in `slots`).
    fn unlink(&mut self, i: u32) {
        let (newer, older) = {
            let slot = &self.slots[i as usize];
            (slot.newer, slot.older)
        };
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
    }

    /// Puts slot `i` (not in the list) at the most recently used end.
    fn link_newest(&mut self, i: u32) {
        let previous = self.newest;
        {
            let slot = &mut self.slots[i as usize];
            slot.newer = NIL;
            slot.older = previous;
        }
        match previous {
            NIL => self.oldest = i,
            p => self.slots[p as usize].newer = i,
        }
        self.newest = i;
    }

    /// Marks slot `i` as just used.
    fn touch(&mut self, i: u32) {
        if self.newest != i {
            self.unlink(i);
            self.link_newest(i);
        }
    }

    /// Removes slot `i` entirely; the last slot moves into its place.
    fn remove(&mut self, i: u32) {
        self.unlink(i);
        self.unindex(i);
        let last = (self.slots.len() - 1) as u32;
        self.slots.swap_remove(i as usize);
        if i < last {
            // The former last slot is now at `i`: repoint its neighbours and its index entry.
            let (newer, older) = {
                let moved = &self.slots[i as usize];
                (moved.newer, moved.older)
            };
            match newer {
                NIL => self.newest = i,
                n => self.slots[n as usize].older = i,
            }
            match older {
                NIL => self.oldest = i,
                o => self.slots[o as usize].newer = i,
            }
            let hash = slot_hash(&self.hasher, &self.names, &self.slots[i as usize]);
            if let Some(entry) = self.index.find_mut(hash, |&j| j == last) {
                *entry = i;
            }
        }
    }

    /// Drops ended windows; returns how many.
    fn remove_ended(&mut self, now_ms: i64) -> u64 {
        let before = self.len();
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i].window().keep_ms <= now_ms {
                // `i` now holds the slot that was last: look at it again.
                self.remove(i as u32);
            } else {
                i += 1;
            }
        }
        self.new_since_cleanup = 0;
        self.cleanup_every = self.len().max(MIN_CLEANUP_LEN);
        (before - self.len()) as u64
    }

    /// Adds the bucket `name` at the most recently used end, making room first if the shard
    /// is full; returns its slot and what making room cost.
    fn insert(&mut self, name: &BucketName<'_>, window: Window, now_ms: i64) -> (u32, Made) {
        // Before a forgotten bucket gives up its name: one limit's buckets keep theirs.
        let id = self.names.acquire(name);
        let (i, made) = if self.len() < self.capacity {
            self.slots.push(Slot {
                digest: [0; DIGEST_LEN],
                start_ms: 0,
                name: id,
                len_secs: 0,
                count: 0,
                previous: 0,
                newer: NIL,
                older: NIL,
            });
            ((self.slots.len() - 1) as u32, Made::Room)
        } else {
            // Full: forget the least recently used bucket and reuse its slot.
            let i = self.oldest;
            let ended = self.slots[i as usize].window().keep_ms <= now_ms;
            self.unlink(i);
            self.unindex(i);
            (i, if ended { Made::Dropped } else { Made::Evicted })
        };
        let slot = &mut self.slots[i as usize];
        slot.digest = name.digest;
        slot.name = id;
        slot.set_window(window);
        self.reindex(i, name.hash);
        self.link_newest(i);
        (i, made)
    }
}

/// Fixed-window counters in this process, at most `memory_buckets` of them.
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    /// Hashes bucket names, for their shard and their place in its index. A per-process random
    /// hasher is fine here: nothing it produces leaves the process.
    hasher: RandomState,
    clock: Clock,
    /// Windows dropped so far, by sweeps and cleanups (for metrics).
    removed: AtomicU64,
    metrics: MemoryStoreMetrics,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("buckets", &self.len())
            .field("capacity", &self.capacity())
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the system clock, of the default bound, counting into metrics of its own.
    pub fn new() -> Self {
        Self::with_clock(super::unix_now_ms)
    }

    /// A store on a clock of the caller's (Unix milliseconds), so tests can cross window
    /// boundaries without sleeping.
    pub fn with_clock(clock: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        let default = NonZeroUsize::new(DEFAULT_MEMORY_BUCKETS).unwrap_or(NonZeroUsize::MIN);
        Self::bounded_with_clock(default, MemoryStoreMetrics::default(), clock)
    }

    /// A store on the system clock holding at most `buckets` buckets (`store.memory_buckets`),
    /// reporting evictions and its size into `metrics`.
    pub fn bounded(buckets: NonZeroUsize, metrics: MemoryStoreMetrics) -> Self {
        Self::bounded_with_clock(buckets, metrics, super::unix_now_ms)
    }

    /// [`MemoryStore::bounded`] on a clock of the caller's.
    pub fn bounded_with_clock(
        buckets: NonZeroUsize,
        metrics: MemoryStoreMetrics,
        clock: impl Fn() -> i64 + Send + Sync + 'static,
    ) -> Self {
        let buckets = buckets.get();
        let count = (buckets / MIN_SHARD_BUCKETS).clamp(1, MAX_SHARDS);
        let hasher = RandomState::default();
        let shards = (0..count)
            .map(|i| {
                // The first `buckets % count` shards take one more, so the parts add up.
                let part = buckets / count + usize::from(i < buckets % count);
                let part = part.min(u32::MAX as usize - 1);
                Mutex::new(Shard::new(part, hasher.clone()))
            })
            .collect();
        MemoryStore {
            shards,
            hasher,
            clock: Arc::new(clock),
            removed: AtomicU64::new(0),
            metrics,
        }
    }

    /// Drops every window that has ended; returns how many. Run it on `store.sweep_interval`.
    pub fn sweep(&self) -> u64 {
        let now_ms = (self.clock)();
        let removed: u64 = (0..self.shards.len())
            .map(|i| self.lock(i).remove_ended(now_ms))
            .sum();
        self.forgot(removed);
        removed
    }

    /// Buckets held, live or not yet cleaned up.
    pub fn len(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Buckets held at most: `memory_buckets`.
    pub fn capacity(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).capacity).sum()
    }

    /// Windows dropped so far by sweeps and cleanups (ended windows; evictions not included).
    pub fn removed_total(&self) -> u64 {
        self.removed.load(Ordering::Relaxed)
    }

    /// Live buckets forgotten so far to stay within the bound.
    pub fn evictions_total(&self) -> u64 {
        self.metrics.evictions.get()
    }

    /// Counts `n` ended windows dropped.
    fn forgot(&self, n: u64) {
        if n > 0 {
            self.removed.fetch_add(n, Ordering::Relaxed);
            self.metrics
                .buckets
                .dec_by(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The shard of the bucket `name`: from bits of its hash that the shard's index does not
    /// lean on (hashbrown places an entry by the low bits and tags it with the top seven), so
    /// that the buckets of one shard still spread over its whole index.
    fn shard_of(&self, name: &BucketName<'_>) -> usize {
        match self.shards.len() {
            1 => 0,
            n => ((((name.hash >> 20) & 0xffff_ffff) * n as u64) >> 32) as usize,
        }
    }

    /// `bucket`'s name, split and hashed with this store's hasher.
    #[inline(always)]
    fn name<'a>(&self, bucket: &'a str) -> BucketName<'a> {
        BucketName::parse(bucket, &self.hasher)
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Shard> {
        // A panic while holding a shard cannot leave it half-written in a way that breaks
        // counting: every window update is a single assignment, and the list and index are
        // only changed by the short functions above, which do not panic on valid slots.
        self.shards[shard]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One request's increments, decided together (see [`Increment`]). The shards of all its
    /// buckets are held, in ascending order (so two requests cannot deadlock), from the first
    /// read to the last write: a request with two sliding limits cannot see room on both that
    /// a concurrent request takes on one of them in between.
    fn count(&self, batch: &[Increment]) -> Result<Vec<Counted>, StoreError> {
        // Most requests meet one limit: one lock, one lookup, nothing to order.
        if let [inc] = batch {
            return self.count_one(inc).map(|counted| vec![counted]);
        }
        let now_ms = (self.clock)();
        let windows: Vec<Window> = batch
            .iter()
            .map(|inc| window_at(now_ms, inc.window_secs))
            .collect::<Result<_, _>>()?;
        let names: Vec<BucketName<'_>> = batch.iter().map(|inc| self.name(&inc.bucket)).collect();
        let shard_of: Vec<usize> = names.iter().map(|name| self.shard_of(name)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> = order.iter().map(|&i| self.lock(i)).collect();
        // Each increment's guard: its shard's place in `order`.
        let places: Vec<usize> = shard_of
            .iter()
            .map(|i| order.binary_search(i).unwrap_or_default())
            .collect();

        // 1. Where each limit stands before this request, and how many units it admits.
        let standing: Vec<(Window, u32)> = batch
            .iter()
            .zip(&names)
            .zip(&windows)
            .zip(&places)
            .map(|(((inc, name), current), &g)| {
                let shard = &guards[g];
                let held = shard.find(name).map(|i| shard.slots[i as usize].window());
                let window = rolled(held, *current, now_ms);
                let fits = own_fits(inc, &window, now_ms);
                (window, fits)
            })
            .collect();
        // 2. Whether the request is allowed: every enforced limit admits all of its units.
        let allowed = batch
            .iter()
            .zip(&standing)
            .all(|(inc, (window, fits))| enforced_admits(inc, window, *fits));
        // 3. Count what is counted (see [`count_into`]).
        let mut counted = Vec::with_capacity(batch.len());
        for (((inc, name), (window, fits)), &g) in
            batch.iter().zip(&names).zip(standing).zip(&places)
        {
            let shard = &mut guards[g];
            let slot = self.slot(shard, name, window, now_ms);
            let (held, answer) = count_into(window, inc, fits, allowed, now_ms);
            shard.slots[slot as usize].set_window(held);
            counted.push(answer);
        }
        drop(guards);
        Ok(counted)
    }

    /// [`MemoryStore::count`] for a request with one limit: the same three steps under the
    /// one shard's lock. The slot is found (or made at the current window, which rolls to
    /// itself) once, instead of looked up for the standing and again for the count.
    fn count_one(&self, inc: &Increment) -> Result<Counted, StoreError> {
        let now_ms = (self.clock)();
        let current = window_at(now_ms, inc.window_secs)?;
        let name = self.name(&inc.bucket);
        let mut shard = self.lock(self.shard_of(&name));
        let i = self.slot(&mut shard, &name, current, now_ms);
        let slot = &mut shard.slots[i as usize];
        let window = rolled(Some(slot.window()), current, now_ms);
        let fits = own_fits(inc, &window, now_ms);
        let allowed = enforced_admits(inc, &window, fits);
        let (held, counted) = count_into(window, inc, fits, allowed, now_ms);
        slot.set_window(held);
        Ok(counted)
    }

    /// The slot of the bucket `name` in `shard`, made (at `window`) if the shard does not
    /// hold it, and marked as just used.
    fn slot(&self, shard: &mut Shard, name: &BucketName<'_>, window: Window, now_ms: i64) -> u32 {
        if let Some(i) = shard.find(name) {
            shard.touch(i);
            return i;
        }
        if shard.new_since_cleanup >= shard.cleanup_every {
            let removed = shard.remove_ended(now_ms);
            self.forgot(removed);
        }
        shard.new_since_cleanup += 1;
        let (i, made) = shard.insert(name, window, now_ms);
        match made {
            Made::Room => {
                self.metrics.buckets.inc();
            }
            Made::Evicted => {
                self.metrics.evictions.inc();
            }
            Made::Dropped => {
                self.removed.fetch_add(1, Ordering::Relaxed);
            }
        }
        i
    }

    /// Charges (contract §3d): each added to its bucket's current window, the count saturating
    /// at the limit's `requests`.
    fn add_charges(&self, charges: &[Charge]) -> Result<(), StoreError> {
        let now_ms = (self.clock)();
        for charge in charges {
            let current = window_at(now_ms, charge.window_secs)?;
            let name = self.name(&charge.bucket);
            let mut shard = self.lock(self.shard_of(&name));
            let i = self.slot(&mut shard, &name, current, now_ms);
            let slot = &mut shard.slots[i as usize];
            let mut held = rolled(Some(slot.window()), current, now_ms);
            if charge.sliding {
                held.keep_ms = held.end_ms + (held.end_ms - held.start_ms);
            }
            let cap = charge.requests.min(COUNT_MAX);
            if held.count < cap {
                held.count = held.count.saturating_add(charge.units).min(cap);
            }
            slot.set_window(held);
        }
        Ok(())
    }

    /// Reads without touching: a read (`tollgate explain`) is not a use, so it does not keep a
    /// bucket from being evicted.
    fn read(&self, batch: &[Increment]) -> Result<Vec<Peeked>, StoreError> {
        let now_ms = (self.clock)();
        batch
            .iter()
            .map(|inc| {
                let current = window_at(now_ms, inc.window_secs)?;
                let name = self.name(&inc.bucket);
                let shard = self.lock(self.shard_of(&name));
                let held = shard.find(&name).map(|i| shard.slots[i as usize].window());
                let peeked = match held {
                    Some(w) if w.end_ms > now_ms && w.start_ms >= current.start_ms => Peeked {
                        count: w.count,
                        window_end_ms: w.end_ms,
                        now_ms,
                        previous: w.previous,
                    },
                    // The window that just ended is the current one's "previous", as in
                    // `count`; one that ended longer ago weighs nothing.
                    held => Peeked {
                        count: 0,
                        window_end_ms: current.end_ms,
                        now_ms,
                        previous: held
                            .filter(|w| w.end_ms == current.start_ms)
                            .map_or(0, |w| w.count),
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

    fn increment_now(&self, batch: &[Increment]) -> Option<Result<Vec<Counted>, StoreError>> {
        Some(self.count(batch))
    }

    fn charge<'a>(&'a self, charges: &'a [Charge]) -> StoreFuture<'a, ()> {
        let result = self.add_charges(charges);
        Box::pin(async move { result })
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

/// How many of `inc.by` units `inc`'s own limit admits, standing at `window`: all of them or
/// none (a request's units fit together, contract §3d). A fixed window: all (its count says
/// where they stand, [`enforced_admits`] judges them); a sliding one: what its estimate admits.
fn own_fits(inc: &Increment, window: &Window, now_ms: i64) -> u32 {
    match inc.sliding {
        None => inc.by,
        Some(limit) => {
            let room = sliding_admits(
                limit,
                window.previous,
                window.count,
                inc.by,
                window.end_ms - now_ms,
                window.end_ms - window.start_ms,
            );
            if room >= inc.by {
                inc.by
            } else {
                0
            }
        }
    }
}

/// Whether `inc`'s limit lets the request through: a limit that does not enforce (shadow,
/// reads) always does; a sliding one when its estimate admits the units (`fits`); a fixed one
/// when they fit in what is left of its quota.
fn enforced_admits(inc: &Increment, window: &Window, fits: u32) -> bool {
    let Some(limit) = inc.enforce else {
        return true;
    };
    match inc.sliding {
        Some(_) => fits >= inc.by,
        None => u64::from(window.count) + u64::from(inc.by) <= u64::from(limit),
    }
}

/// Counts `inc` into its bucket's `window` for a request that is `allowed` or not. A check
/// (`inc.check`) counts nothing, nor does a denied request (its units are not added, on either
/// algorithm, contract §3d). A fixed window counts an allowed request's units; a sliding one
/// those of them that its own estimate admits (`fits`). Returns the window to keep, and the
/// answer.
fn count_into(
    window: Window,
    inc: &Increment,
    fits: u32,
    allowed: bool,
    now_ms: i64,
) -> (Window, Counted) {
    let mut held = window;
    let added = match inc.sliding {
        _ if inc.check => 0,
        None if allowed => inc.by,
        None => 0,
        Some(_) => {
            held.keep_ms = held.end_ms + (held.end_ms - held.start_ms);
            if allowed {
                fits
            } else {
                0
            }
        }
    };
    held.count = held.count.saturating_add(added).min(COUNT_MAX);
    let counted = Counted {
        count: held.count,
        window_end_ms: held.end_ms,
        now_ms,
        added,
        previous: if inc.sliding.is_some() {
            held.previous
        } else {
            0
        },
        fits,
    };
    (held, counted)
}

/// A bucket's window as an increment at `now_ms` finds it: the one held while it is still
/// current; else `current`, empty, with the held count as "previous" when the held window is
/// the one just before (a sliding limit reads it; one that ended longer ago weighs nothing,
/// like a missing row). A held window *later* than `current` (the clock stepped back) keeps
/// counting: starting over would forget requests already allowed.
fn rolled(held: Option<Window>, current: Window, now_ms: i64) -> Window {
    match held {
        Some(w) if !(w.end_ms <= now_ms || w.start_ms < current.start_ms) => w,
        Some(w) if w.end_ms == current.start_ms => Window {
            previous: w.count,
            ..current
        },
        _ => current,
    }
}

/// The epoch-aligned window of `window_secs` containing `now_ms`, with a zero count.
/// `div_euclid` is the floor even for a clock before 1970.
fn window_at(now_ms: i64, window_secs: u32) -> Result<Window, StoreError> {
    if window_secs == 0 {
        return Err(StoreError::Query("a window of 0 seconds".into()));
    }
    let len_ms = i64::from(window_secs) * 1000;
    let start_ms = now_ms.div_euclid(len_ms) * len_ms;
    Ok(Window {
        start_ms,
        end_ms: start_ms + len_ms,
        count: 0,
        previous: 0,
        keep_ms: start_ms + len_ms,
    })
}

/// How many of `by` new units a sliding window admits (contract §3a), the same rule as the
/// Postgres function: unit `k` is admitted when
/// `previous * left / len + current + k <= limit`, `left` being the milliseconds left in the
/// current window (`window - elapsed`). The estimate grows with `k`, so the admitted units are
/// a prefix: `clamp(floor(limit - previous * left / len) - current, 0, by)`.
pub fn sliding_admits(
    limit: u32,
    previous: u32,
    current: u32,
    by: u32,
    left_ms: i64,
    len_ms: i64,
) -> u32 {
    let weighted = f64::from(previous) * left_ms.max(0) as f64 / len_ms.max(1) as f64;
    let room = (f64::from(limit) - weighted).floor() - f64::from(current);
    if room <= 0.0 {
        0
    } else {
        room.min(f64::from(by)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicI64;

    fn inc(bucket: &str, window_secs: u32) -> Increment {
        Increment {
            bucket: Arc::from(bucket),
            window_secs,
            by: 1,
            sliding: None,
            enforce: None,
            check: false,
        }
    }

    fn sliding(bucket: &str, window_secs: u32, requests: u32, by: u32) -> Increment {
        Increment {
            bucket: Arc::from(bucket),
            window_secs,
            by,
            sliding: Some(requests),
            enforce: Some(requests),
            check: false,
        }
    }

    #[test]
    fn a_sliding_window_weighs_the_previous_one_and_does_not_count_denials() {
        let now = Arc::new(AtomicI64::new(3_600_000 * 10));
        let store = bounded(100, &now);
        // No previous window: a request's units fit all together or not at all.
        let c = store.count(&[sliding("s", 100, 10, 11)]).expect("count")[0];
        assert_eq!(
            (c.added, c.count, c.fits),
            (0, 0, 0),
            "11 units never fit 10"
        );
        let c = store.count(&[sliding("s", 100, 10, 10)]).expect("count")[0];
        assert_eq!((c.added, c.count, c.previous), (10, 10, 0));
        let c = store.count(&[sliding("s", 100, 10, 1)]).expect("count")[0];
        assert_eq!((c.added, c.count), (0, 10), "denied, not counted");
        // A quarter into the next window: 10 * 0.75 = 7.5 weighs, floor(10 - 7.5) = 2 fit:
        // not a request of 5 units, then one of 2.
        now.fetch_add(125_000, Ordering::SeqCst);
        let c = store.count(&[sliding("s", 100, 10, 5)]).expect("count")[0];
        assert_eq!((c.added, c.count, c.previous), (0, 0, 10));
        let c = store.count(&[sliding("s", 100, 10, 2)]).expect("count")[0];
        assert_eq!((c.added, c.count, c.previous), (2, 2, 10));
        // A fixed-window control admits the whole burst after the boundary.
        now.store(3_600_000 * 10 + 99_999, Ordering::SeqCst);
        let f = store
            .count(&[Increment {
                by: 10,
                ..inc("f", 100)
            }])
            .expect("f")[0];
        assert_eq!(f.count, 10);
        now.store(3_600_000 * 10 + 100_001, Ordering::SeqCst);
        let f = store
            .count(&[Increment {
                by: 10,
                ..inc("f", 100)
            }])
            .expect("f")[0];
        assert_eq!((f.count, f.added), (10, 10));
        // Two windows later the old count weighs nothing, and the bucket is forgotten by a
        // sweep only once it cannot be "previous" any more.
        now.store(3_600_000 * 10 + 200_000, Ordering::SeqCst);
        assert_eq!(store.sweep(), 1, "f ended");
        now.store(3_600_000 * 10 + 300_000, Ordering::SeqCst);
        assert_eq!(store.sweep(), 1, "s kept for one more window");
        let c = store.count(&[sliding("s", 100, 10, 10)]).expect("count")[0];
        assert_eq!((c.added, c.previous), (10, 0));
    }

    /// Contract §3d: a fixed window counts a request only when it is allowed, so a denied dear
    /// request leaves the units for a cheaper one, and a denied request of one unit adds
    /// nothing either; a request that another limit denies is counted in none of its rows.
    #[test]
    fn a_fixed_window_counts_a_request_only_when_it_fits() {
        let now = Arc::new(AtomicI64::new(3_600_000 * 10));
        let store = bounded(100, &now);
        let of = |by| Increment {
            by,
            enforce: Some(10),
            ..inc("f", 100)
        };
        for n in 1..=3 {
            let c = store.count(&[of(3)]).expect("count")[0];
            assert_eq!((c.added, c.count), (3, 3 * n), "request {n}");
        }
        let c = store.count(&[of(3)]).expect("count")[0];
        assert_eq!((c.added, c.count), (0, 9), "3 units do not fit 1");
        let c = store.count(&[of(1)]).expect("count")[0];
        assert_eq!((c.added, c.count), (1, 10), "1 unit does");
        let c = store.count(&[of(1)]).expect("count")[0];
        assert_eq!(
            (c.added, c.count),
            (0, 10),
            "a denied unit request is not counted either"
        );
        // Two limits: one denying keeps the other's dear units out too.
        let pair = [
            Increment {
                by: 4,
                enforce: Some(100),
                ..inc("g", 100)
            },
            of(2),
        ];
        let c = store.count(&pair).expect("pair");
        assert_eq!((c[0].added, c[0].count), (0, 0), "denied by f");
        assert_eq!((c[1].added, c[1].count), (0, 10));
        let pair = [
            Increment {
                enforce: Some(100),
                ..inc("g", 100)
            },
            of(1),
        ];
        let c = store.count(&pair).expect("pair of units");
        assert_eq!((c[0].added, c[0].count), (0, 0), "a unit denied by f");
    }

    fn bounded(n: usize, now: &Arc<AtomicI64>) -> MemoryStore {
        let clock = Arc::clone(now);
        MemoryStore::bounded_with_clock(
            NonZeroUsize::new(n).expect("non-zero"),
            MemoryStoreMetrics::default(),
            move || clock.load(Ordering::SeqCst),
        )
    }

    /// Walks a shard's list both ways and checks it against the index: every slot is found
    /// by its own name, spelt out again from its key.
    fn check_links(shard: &Shard) {
        let mut seen = 0;
        let mut i = shard.newest;
        let mut newer = NIL;
        while i != NIL {
            let slot = &shard.slots[i as usize];
            assert_eq!(slot.newer, newer);
            let text = shard.names.text(slot.name);
            let name = match shard.names.is_whole(slot.name) {
                true => text.to_string(),
                false => format!("{text}:{}", hex::encode(slot.digest)),
            };
            assert_eq!(
                shard.find(&BucketName::parse(&name, &shard.hasher)),
                Some(i)
            );
            newer = i;
            i = slot.older;
            seen += 1;
        }
        assert_eq!(shard.oldest, newer);
        assert_eq!(seen, shard.slots.len());
        assert_eq!(shard.index.len(), shard.slots.len());
        assert!(shard.names.len() <= shard.slots.len());
    }

    /// A proxy-made bucket name: `<policy>:<64 hex digits>`.
    fn digest_name(policy: &str, n: u64) -> String {
        format!("{policy}:{:064x}", u128::from(n) * 0x9e37_79b9_7f4a_7c15)
    }

    /// What docs/performance.md's "Memory per bucket" figure rests on: a live bucket is one
    /// 64-byte slot and one 4-byte index entry (and hashbrown's control byte), with nothing of
    /// its own on the heap. One limit's buckets share one copy of its `<scope>:<label>`.
    #[test]
    fn a_bucket_is_a_64_byte_slot_and_a_4_byte_index_entry() {
        fn entry_size<T>(_: &HashTable<T>) -> usize {
            std::mem::size_of::<T>()
        }
        assert_eq!(std::mem::size_of::<Slot>(), 64);
        let now = Arc::new(AtomicI64::new(1_000));
        let store = bounded(3 * MIN_SHARD_BUCKETS, &now);
        let batch: Vec<Increment> = (0..5000)
            .map(|n| inc(&digest_name("api:x-api-key", n), 60))
            .collect();
        for chunk in batch.chunks(1) {
            store.count(chunk).expect("count");
        }
        assert_eq!(store.len(), 5000);
        for i in 0..store.shards.len() {
            let shard = store.lock(i);
            assert_eq!(entry_size(&shard.index), 4);
            assert_eq!(shard.names.len(), 1, "one text for one limit's buckets");
            check_links(&shard);
        }
    }

    /// A window survives packing into a slot: fixed and sliding (kept one window longer),
    /// before 1970 too, and a count at its saturation does not read as the sliding mark.
    #[test]
    fn a_window_packs_into_a_slot_and_back() {
        let mut slot = Slot {
            digest: [0; DIGEST_LEN],
            start_ms: 0,
            name: 0,
            len_secs: 0,
            count: 0,
            previous: 0,
            newer: NIL,
            older: NIL,
        };
        for (now_ms, secs) in [(1_750_000_123_456, 60), (-90_500, 7), (0, 31_622_400)] {
            let fixed = window_at(now_ms, secs).expect("window");
            for (window, count, previous) in [
                (fixed, 3, 9),
                (
                    Window {
                        keep_ms: fixed.end_ms + i64::from(secs) * 1000,
                        ..fixed
                    },
                    COUNT_MAX,
                    COUNT_MAX,
                ),
            ] {
                slot.set_window(Window {
                    count,
                    previous,
                    ..window
                });
                let back = slot.window();
                assert_eq!(
                    (
                        back.start_ms,
                        back.end_ms,
                        back.keep_ms,
                        back.count,
                        back.previous
                    ),
                    (
                        window.start_ms,
                        window.end_ms,
                        window.keep_ms,
                        count,
                        previous
                    )
                );
            }
        }
    }

    /// Names of every form share a store and never one bucket: a name held whole, a digest
    /// name, and the same digest under another prefix count apart, and removing some of them
    /// leaves the others found.
    #[test]
    fn names_of_every_form_count_apart() {
        let now = Arc::new(AtomicI64::new(1_000));
        let store = bounded(100, &now);
        let digest = digest_name("p", 7);
        let other = digest_name("q", 7);
        let names = ["p", "p:global", digest.as_str(), other.as_str(), "p:"];
        for (n, name) in names.iter().enumerate() {
            for _ in 0..=n {
                store
                    .count(&[inc(name, if n % 2 == 0 { 1 } else { 3600 })])
                    .expect("count");
            }
        }
        let counts = |store: &MemoryStore| -> Vec<u32> {
            let batch: Vec<Increment> = names.iter().map(|n| inc(n, 3600)).collect();
            store
                .read(&batch)
                .expect("read")
                .iter()
                .map(|p| p.count)
                .collect()
        };
        assert_eq!(counts(&store), [1, 2, 3, 4, 5]);
        now.fetch_add(2_000, Ordering::SeqCst);
        assert_eq!(store.sweep(), 3, "the three 1 s windows");
        assert_eq!(counts(&store), [0, 2, 0, 4, 0]);
        check_links(&store.lock(0));
    }

    #[test]
    fn the_parts_of_the_bound_add_up_and_small_bounds_are_one_shard() {
        let now = Arc::new(AtomicI64::new(0));
        for n in [1, 7, 100, 4095, 4096, 8191, 65_537, 1_000_000, 1_000_003] {
            let store = bounded(n, &now);
            assert_eq!(store.capacity(), n, "{n}");
            let expect = (n / MIN_SHARD_BUCKETS).clamp(1, MAX_SHARDS);
            assert_eq!(store.shards.len(), expect, "{n}");
        }
    }

    #[test]
    fn a_sharded_store_never_holds_more_than_its_bound() {
        let now = Arc::new(AtomicI64::new(1_000));
        let store = bounded(40_000, &now);
        assert_eq!(store.shards.len(), 9);
        let batch: Vec<Increment> = (0..60_000).map(|i| inc(&format!("b{i}"), 60)).collect();
        store.count(&batch).expect("count");
        assert_eq!(store.len(), 40_000);
        assert_eq!(store.evictions_total(), 20_000);
        assert_eq!(store.metrics.buckets.get(), 40_000);
        for i in 0..store.shards.len() {
            check_links(&store.lock(i));
        }
    }

    #[test]
    fn the_least_recently_used_bucket_goes_first_and_ended_windows_are_not_evictions() {
        let now = Arc::new(AtomicI64::new(1_000));
        let store = bounded(3, &now);
        for b in ["a", "b", "c"] {
            store.count(&[inc(b, 3600)]).expect("count");
        }
        // "a" used again: "b" is now the least recently used.
        assert_eq!(store.count(&[inc("a", 3600)]).expect("a")[0].count, 2);
        store.count(&[inc("d", 3600)]).expect("d");
        assert_eq!(store.evictions_total(), 1);
        let counts: Vec<u32> = store
            .read(&[
                inc("a", 3600),
                inc("b", 3600),
                inc("c", 3600),
                inc("d", 3600),
            ])
            .expect("read")
            .iter()
            .map(|p| p.count)
            .collect();
        assert_eq!(counts, [2, 0, 1, 1]);
        // A read is not a use: "c" stays the oldest and goes next.
        store.count(&[inc("e", 1)]).expect("e");
        assert_eq!(store.evictions_total(), 2);
        check_links(&store.lock(0));

        // "e" (a 1 s window) ends; after "a" and "d" are used it is the oldest, and making
        // room by dropping it loses nothing: no eviction.
        now.fetch_add(2_000, Ordering::SeqCst);
        store
            .count(&[inc("a", 3600), inc("d", 3600)])
            .expect("a, d");
        store.count(&[inc("f", 3600)]).expect("f");
        assert_eq!(store.evictions_total(), 2);
        assert_eq!(store.removed_total(), 1);
        assert_eq!(store.len(), 3);
        check_links(&store.lock(0));
    }

    #[test]
    fn sweeping_keeps_the_list_whole() {
        let now = Arc::new(AtomicI64::new(1_000));
        let store = bounded(1000, &now);
        // Interleave short and long windows so removals happen all over the list.
        let batch: Vec<Increment> = (0..600)
            .map(|i| inc(&format!("b{i}"), if i % 3 == 0 { 3600 } else { 1 }))
            .collect();
        store.count(&batch).expect("count");
        now.fetch_add(5_000, Ordering::SeqCst);
        assert_eq!(store.sweep(), 400);
        assert_eq!(store.len(), 200);
        assert_eq!(store.metrics.buckets.get(), 200);
        check_links(&store.lock(0));
        // The survivors still count on.
        assert_eq!(store.count(&[inc("b3", 3600)]).expect("b3")[0].count, 2);
        check_links(&store.lock(0));
    }
}
