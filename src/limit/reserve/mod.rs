//! Reserved shares (contract §3c; docs/architecture.md, "Reserved shares"): the units of a
//! `reserve = true` limit that this instance took from the store and has not used yet, and
//! what gives them back.
//!
//! - Each connection worker keeps its own shares ([`WorkerShares`], behind a mutex only that
//!   worker takes on the request path), so admitting from a share of a hot bucket takes no
//!   lock that workers contend on. A worker whose share runs out takes half of another
//!   worker's unused units of the bucket before it asks the store, so that one instance never
//!   denies while it holds units itself (contract §3c: exact on one instance).
//! - At most one grant per worker and bucket is in flight: requests that find a grant under
//!   way wait for it (within the decision's budget) instead of sending their own, and the
//!   grant asks for them too.
//! - A share is used only before its window ends by this process's monotonic clock, measured
//!   from when the grant was *sent*: the store's clock read inside the statement is no earlier,
//!   so the local end is never after the window's real end.
//! - [`Shares::tick`] (every [`TICK`]) gives units back: of buckets another instance asked
//!   for (`NOTIFY`), of every bucket while this instance cannot hear such requests and the
//!   share has not been used for [`IDLE_GIVE_BACK`], of limits a reload changed or removed, and
//!   of sliding shares whose window ended (their row still weighs as the previous window).
//!   [`Shares::give_back_all`] gives back everything at shutdown.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use super::fallback::Instances;
use super::{PlannedLimit, RandomState};
mod decide;

use crate::store::{GiveBack, ResetEvent, ShareGrant, ShareWant, Store};

/// How often [`Shares::tick`] runs: well within the second that contract §3c allows for a
/// give-back.
pub const TICK: Duration = Duration::from_millis(250);
/// Without notifications (a pooler in transaction mode), a share unused this long goes back
/// (contract §3c).
pub const IDLE_GIVE_BACK: Duration = Duration::from_secs(1);
/// Buckets one worker keeps shares of at most: buckets are keyed by what clients send. Past
/// it, the least recently used share goes back to make room.
pub const SHARES_PER_WORKER: usize = 16 * 1024;
/// Rows in one give-back statement at most.
const GIVE_BACK_BATCH: usize = 1000;

/// What identifies a limit's shares across a reload: a share outlives a reload only while a
/// limit of the same policy, `requests`, window and algorithm still reserves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    pub policy: Arc<str>,
    pub requests: u32,
    pub window_secs: u32,
    pub sliding: bool,
}

impl Shape {
    pub fn of(plan: &PlannedLimit) -> Shape {
        Shape {
            policy: plan.policy.clone(),
            requests: plan.requests,
            window_secs: plan.window_secs,
            sliding: plan.sliding,
        }
    }
}

/// One worker's share of one bucket.
#[derive(Debug)]
struct Share {
    shape: Shape,
    /// The window the units belong to (unix seconds, the store's clock).
    window_start_secs: i64,
    /// When that window ends, by this process's monotonic clock (never later than it does).
    ends: Instant,
    /// Units granted and not used.
    unused: u32,
    /// What the row left after the last grant (`requests - count`): with `unused`, the `r` of
    /// the rate-limit fields.
    row_left: u32,
    /// Units used in this window, and since when: the rate a grant is sized by.
    used: u64,
    since: Instant,
    last_used: Instant,
    /// The last grant's size: the next one asks for at least twice as much.
    last_granted: u32,
    /// A grant under way; requests that find one wait on it.
    granting: Option<watch::Sender<()>>,
    /// Requests waiting for that grant.
    waiting: u32,
}

impl Share {
    fn new(shape: Shape, now: Instant) -> Share {
        Share {
            shape,
            window_start_secs: i64::MIN,
            ends: now,
            unused: 0,
            row_left: 0,
            used: 0,
            since: now,
            last_used: now,
            last_granted: 0,
            granting: None,
            waiting: 0,
        }
    }

    fn live(&self, now: Instant) -> bool {
        now < self.ends
    }

    /// Whether the share can admit a request of `cost` units now.
    fn holds(&self, cost: u32, now: Instant) -> bool {
        self.live(now) && self.unused >= cost.max(1)
    }

    /// Takes a request's `cost` units (it [`holds`](Share::holds) them): what the request is
    /// admitted from.
    fn take(&mut self, cost: u32, now: Instant) -> Held {
        let cost = cost.max(1);
        self.unused -= cost;
        self.used += u64::from(cost);
        self.last_used = now;
        self.held()
    }

    /// Waits for the grant under way, if there is one.
    fn wait(&mut self) -> Option<Take> {
        let waiting = self.granting.as_ref().map(watch::Sender::subscribe)?;
        self.waiting = self.waiting.saturating_add(1);
        Some(Take::Wait(waiting))
    }

    fn held(&self) -> Held {
        Held {
            left: self.row_left.saturating_add(self.unused),
            unused: self.unused,
            ends: self.ends,
            window_start_secs: self.window_start_secs,
        }
    }

    /// What this worker is expected to use of the bucket before the window ends, at the rate
    /// it has used this share; `None` before it used any.
    fn by_rate(&self, now: Instant, window_left: Duration) -> Option<u32> {
        if self.used == 0 {
            return None;
        }
        let elapsed = now
            .saturating_duration_since(self.since)
            .as_secs_f64()
            .max(0.05);
        let expected = self.used as f64 / elapsed * window_left.as_secs_f64();
        Some(expected.ceil().min(f64::from(u32::MAX)) as u32)
    }

    /// What the next grant asks for: `expected` (see [`Share::by_rate`]), at least twice the
    /// last grant and at least one unit for each request waiting, at most the limit (the
    /// store caps it further, contract §3c).
    fn want(&self, expected: u32) -> u32 {
        expected
            .max(self.last_granted.saturating_mul(2))
            .max(self.waiting.saturating_add(1))
            .min(self.shape.requests)
            .max(1)
    }
}

/// A unit taken from a share: what the request's rate-limit fields say of the limit.
#[derive(Debug, Clone, Copy)]
pub struct Held {
    /// What the row leaves plus this worker's unused units ([`Shares::instance_left`] makes
    /// it the instance's, `r` of contract §3c).
    pub left: u32,
    /// This worker's unused units of the share, after the request took its own.
    pub unused: u32,
    /// When the share's window ends.
    pub ends: Instant,
    /// The share's window (unix seconds, the store's clock).
    pub window_start_secs: i64,
}

/// What [`Shares::take`] found.
pub enum Take {
    /// A unit, taken.
    Taken(Held),
    /// A grant of this bucket is under way on this worker: wait for it, then take again.
    Wait(watch::Receiver<()>),
    /// Ask the store for a grant of `want` units; this request is now the one granting.
    Grant(ShareWant),
}

/// One worker's shares, and what it learned of each reserve limit's buckets.
#[derive(Default)]
struct WorkerShares {
    shares: HashMap<Arc<str>, Share, RandomState>,
    /// By policy: the last grant this worker sized by a bucket's rate. A bucket seen for the
    /// first time asks for this much, so that a limit with many buckets (an API key each)
    /// costs one grant per bucket and window rather than two (the first, of one unit, is
    /// what teaches a bucket's rate otherwise). Policies come from the configuration: bounded.
    learned: HashMap<Arc<str>, u32, RandomState>,
}

/// Every worker's shares, and what gives them back.
pub struct Shares {
    workers: Box<[Mutex<WorkerShares>]>,
    instances: Arc<Instances>,
    /// Whether this instance hears other instances' reclaim requests (`LISTEN` works). Until
    /// the listener says so, shares go back when idle, as without it.
    hearing: AtomicBool,
    /// Whether the listener has said anything yet (started listening, or found it cannot).
    /// Until then no share is taken: its start sets aside every share held (a reset may have
    /// been missed), and units set aside are neither usable nor back in the row until the
    /// next tick, which would deny early with budget left (one instance must be exact).
    settled: watch::Sender<bool>,
    asked: Mutex<Asked>,
    reserved_units: Gauge,
}

/// What happened between two ticks that gives shares back.
#[derive(Default)]
struct Asked {
    /// After a reload: the shapes that still reserve.
    reloaded: Option<HashSet<Shape>>,
    /// Units taken out of shares (window turned, room made), to go back at the next tick.
    back: Vec<GiveBack>,
}

impl Shares {
    pub fn new(workers: usize, instances: Arc<Instances>, reserved_units: Gauge) -> Shares {
        Shares {
            workers: (0..workers.max(1))
                .map(|_| Mutex::new(WorkerShares::default()))
                .collect(),
            instances,
            hearing: AtomicBool::new(false),
            settled: watch::Sender::new(false),
            asked: Mutex::new(Asked::default()),
            reserved_units,
        }
    }

    fn worker(&self, worker: usize) -> MutexGuard<'_, WorkerShares> {
        let slot = &self.workers[worker % self.workers.len()];
        // A panic while the lock was held left counts that are still units the row holds.
        slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn asked(&self) -> MutexGuard<'_, Asked> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `r` of `held` (taken on `worker`) for the whole instance, as contract §3c has it: what
    /// the row leaves plus the unused units of every worker's share of the bucket in the same
    /// window. The row's figure is the least any of those shares last heard from the store
    /// (the row only fills within a window, so the least is the freshest).
    pub fn instance_left(&self, worker: usize, plan: &PlannedLimit, held: &Held) -> u32 {
        let count = self.workers.len();
        let mut row_left = u64::from(held.left.saturating_sub(held.unused));
        let mut unused = u64::from(held.unused);
        for other in (1..count).map(|k| (worker + k) % count) {
            let theirs = self.worker(other);
            let Some(share) = theirs.shares.get(&*plan.bucket) else {
                continue;
            };
            if share.window_start_secs == held.window_start_secs {
                unused += u64::from(share.unused);
                row_left = row_left.min(u64::from(share.row_left));
            }
        }
        let left = row_left.saturating_add(unused);
        u32::try_from(left).unwrap_or(u32::MAX).min(plan.requests)
    }

    /// Whether shares may be taken: the listener has started (see [`Shares::on_event`]).
    pub fn settled(&self) -> bool {
        *self.settled.borrow()
    }

    /// Waits until shares may be taken (at start: until the listener's first word).
    pub async fn until_settled(&self) {
        let mut settled = self.settled.subscribe();
        // The sender lives as long as `self`: `wait_for` fails only once it is gone.
        let _ = settled.wait_for(|settled| *settled).await;
    }

    /// Live instances, as the registry last said: what share sizes divide by.
    pub fn instances(&self) -> u32 {
        self.instances.live()
    }

    /// The request's units (its `cost`) of `plan`'s bucket for a request on `worker`: from
    /// its own share, else with units of other workers' shares, else the request waits for a
    /// grant under way or sends one.
    pub fn take(&self, worker: usize, plan: &PlannedLimit) -> Take {
        let now = Instant::now();
        let stale = {
            let mine = self.worker(worker);
            let share = mine.shares.get(&*plan.bucket);
            share.is_some_and(|share| share.shape.requests != plan.requests)
        };
        if stale {
            // An override of the bucket was set, removed or ended (contract §3e): units
            // granted under the old `requests` must not admit under the new one.
            self.set_aside_where(|b, share| {
                **b == *plan.bucket && share.shape.requests != plan.requests
            });
        }
        {
            let mut mine = self.worker(worker);
            if let Some(share) = mine.shares.get_mut(&*plan.bucket) {
                if share.holds(plan.cost, now) {
                    return Take::Taken(share.take(plan.cost, now));
                }
                if let Some(wait) = share.wait() {
                    return wait;
                }
            }
        }
        if let Some(held) = self.steal(worker, plan, now) {
            return Take::Taken(held);
        }
        let mut mine = self.worker(worker);
        if !mine.shares.contains_key(&*plan.bucket) && mine.shares.len() >= SHARES_PER_WORKER {
            self.make_room(&mut mine, now);
        }
        let WorkerShares { shares, learned } = &mut *mine;
        let share = shares
            .entry(plan.bucket.clone())
            .or_insert_with(|| Share::new(Shape::of(plan), now));
        // Another request of this worker may have started one since the first look.
        if let Some(wait) = share.wait() {
            return wait;
        }
        let window_left = window_left(now, share, plan.window_secs);
        let expected = match share.by_rate(now, window_left) {
            Some(expected) => {
                learned.insert(plan.policy.clone(), expected);
                expected
            }
            None => learned.get(&*plan.policy).copied().unwrap_or(1),
        };
        // What this request still needs beside the units the share holds (of a window that
        // has not ended: those of an ended one do not count).
        let held = if share.live(now) { share.unused } else { 0 };
        let need = plan.cost.max(1).saturating_sub(held).max(1);
        let want = share.want(expected).max(need);
        share.granting = Some(watch::Sender::new(()));
        Take::Grant(ShareWant {
            bucket: plan.bucket.clone(),
            window_secs: plan.window_secs,
            requests: plan.requests,
            sliding: plan.sliding,
            want,
            need,
        })
    }

    /// Half of other workers' unused units of the bucket (at least what the request still
    /// needs), moved to this worker's share, which then gives the request its units; `None`
    /// when the workers together do not hold enough.
    fn steal(&self, worker: usize, plan: &PlannedLimit, now: Instant) -> Option<Held> {
        let count = self.workers.len();
        for other in (1..count).map(|k| (worker + k) % count) {
            let needed = {
                let mine = self.worker(worker);
                let held = mine
                    .shares
                    .get(&*plan.bucket)
                    .filter(|share| share.live(now))
                    .map_or(0, |share| share.unused);
                plan.cost.max(1).saturating_sub(held)
            };
            let (units, from) = {
                let mut theirs = self.worker(other);
                let Some(share) = theirs.shares.get_mut(&*plan.bucket) else {
                    continue;
                };
                if !share.live(now) || share.unused == 0 || share.shape.requests != plan.requests {
                    continue;
                }
                let units = share.unused.div_ceil(2).max(needed).min(share.unused);
                share.unused -= units;
                (units, (share.window_start_secs, share.ends, share.row_left))
            };
            let mut mine = self.worker(worker);
            let share = mine
                .shares
                .entry(plan.bucket.clone())
                .or_insert_with(|| Share::new(Shape::of(plan), now));
            let mut aside = None;
            if share.window_start_secs != from.0 {
                // Units of another window are not this one's: they go back (if their row
                // still weighs), never admit here.
                aside = share_of_ended(&plan.bucket, share);
                share.window_start_secs = from.0;
                share.unused = 0;
                share.used = 0;
                share.since = now;
            }
            share.ends = from.1;
            share.row_left = from.2;
            share.unused += units;
            let held = share
                .holds(plan.cost, now)
                .then(|| share.take(plan.cost, now));
            drop(mine);
            if let Some(aside) = aside {
                self.asked().back.push(aside);
            }
            if held.is_some() {
                return held;
            }
        }
        None
    }

    /// The least recently used share of a full worker goes (its units back at the next tick).
    fn make_room(&self, mine: &mut WorkerShares, now: Instant) {
        let oldest = mine
            .shares
            .iter()
            .filter(|(_, share)| share.granting.is_none())
            .min_by_key(|(_, share)| share.last_used)
            .map(|(bucket, _)| bucket.clone());
        if let Some(bucket) = oldest {
            if let Some(share) = mine.shares.remove(&bucket) {
                self.set_aside(&bucket, &share, now);
            }
        }
    }

    /// Queues a share's unused units for the next tick's give-back, when they still count in
    /// a row that matters: a fixed window's units are worth nothing once it ended.
    fn set_aside(&self, bucket: &Arc<str>, share: &Share, now: Instant) {
        if share.unused == 0 || (!share.live(now) && !share.shape.sliding) {
            return;
        }
        self.asked().back.push(GiveBack {
            bucket: bucket.clone(),
            window_start_secs: share.window_start_secs,
            unused: share.unused,
        });
    }

    /// The store granted `grant` for `plan` (the grant this worker's [`Take::Grant`] asked
    /// for, sent at `sent_at`): the units join the share and the granting request takes one.
    /// `None`: nothing was granted (the bucket is exhausted), or the share's window had
    /// already ended.
    pub fn granted(
        &self,
        worker: usize,
        plan: &PlannedLimit,
        grant: &ShareGrant,
        sent_at: Instant,
    ) -> Option<Held> {
        let now = Instant::now();
        let left_ms = u64::try_from(grant.window_end_ms.saturating_sub(grant.now_ms)).unwrap_or(0);
        let ends = sent_at + Duration::from_millis(left_ms);
        let window_start_secs = grant.window_end_ms.div_euclid(1000) - i64::from(plan.window_secs);
        let mut mine = self.worker(worker);
        let share = mine
            .shares
            .entry(plan.bucket.clone())
            .or_insert_with(|| Share::new(Shape::of(plan), now));
        let mut aside = None;
        if share.window_start_secs != window_start_secs {
            // A new window: the old one's units go back if its row still weighs (sliding).
            aside = share_of_ended(&plan.bucket, share);
            share.unused = 0;
            share.window_start_secs = window_start_secs;
            share.used = 0;
            share.since = now;
        }
        share.shape = Shape::of(plan);
        share.ends = ends;
        share.unused = share.unused.saturating_add(grant.granted);
        share.row_left = plan.requests.saturating_sub(grant.count);
        share.last_granted = grant.granted;
        end_grant(share);
        let held = share
            .holds(plan.cost, now)
            .then(|| share.take(plan.cost, now));
        drop(mine);
        if let Some(aside) = aside {
            self.asked().back.push(aside);
        }
        held
    }

    /// The grant this worker asked for failed: whoever waits on it tries again.
    pub fn grant_failed(&self, worker: usize, plan: &PlannedLimit) {
        if let Some(share) = self.worker(worker).shares.get_mut(&*plan.bucket) {
            end_grant(share);
        }
    }

    /// The units taken for a request that another limit then denied go back to this worker's
    /// share (contract §3c: a denied request takes nothing from the others' shares).
    pub fn put_back(&self, worker: usize, plan: &PlannedLimit, held: &Held) {
        let mut mine = self.worker(worker);
        if let Some(share) = mine.shares.get_mut(&*plan.bucket) {
            if share.ends == held.ends {
                let cost = plan.cost.max(1);
                share.unused = share.unused.saturating_add(cost);
                share.used = share.used.saturating_sub(u64::from(cost));
                return;
            }
        }
        drop(mine);
        tracing::debug!(policy = %plan.policy, "a reserved unit outlived its share; it stays counted");
    }

    /// What the store's `LISTEN` session heard (contract §3b, §3c).
    pub fn on_event(&self, event: ResetEvent<'_>) {
        match event {
            // The rows are gone, and with them what they counted of this instance's shares:
            // the units are dropped, not given back.
            ResetEvent::Bucket(bucket) => {
                for worker in 0..self.workers.len() {
                    self.worker(worker).shares.remove(bucket);
                }
            }
            // What this instance holds of the bucket now goes back at the next tick; units
            // granted after the ask are not what it asked for.
            ResetEvent::Reclaim(bucket) => self.set_aside_where(|b, _| &**b == bucket),
            // A share taken under other `requests` goes back at its next use (`take`).
            ResetEvent::Returned(_) | ResetEvent::Overrides => {}
            // A reset or a reclaim may have been missed: nothing held is sure to be wanted.
            ResetEvent::Missed => {
                self.set_aside_where(|_, _| true);
                self.settled.send_replace(true);
            }
            ResetEvent::Hearing(hearing) => {
                self.hearing.store(hearing, Ordering::Release);
                self.settled.send_replace(true);
            }
        }
    }

    /// Takes the unused units of every share `which` picks out of it, to go back at the next
    /// tick.
    fn set_aside_where(&self, which: impl Fn(&Arc<str>, &Share) -> bool) {
        let now = Instant::now();
        for worker in 0..self.workers.len() {
            let mut mine = self.worker(worker);
            for (bucket, share) in mine
                .shares
                .iter_mut()
                .filter(|(b, s)| s.unused > 0 && which(b, s))
            {
                self.set_aside(bucket, share, now);
                share.unused = 0;
            }
        }
    }

    /// After a reload: shares of limits that no longer reserve with the same `requests`,
    /// window and algorithm go back at the next tick (contract §3c).
    pub fn reloaded(&self, in_force: HashSet<Shape>) {
        self.asked().reloaded = Some(in_force);
    }

    /// Gives back what is due (see the module docs) and updates `tollgate_reserved_units`.
    pub async fn tick(&self, store: &dyn Store) {
        let now = Instant::now();
        let (mut back, reloaded) = {
            let mut asked = self.asked();
            (std::mem::take(&mut asked.back), asked.reloaded.take())
        };
        let hearing = self.hearing.load(Ordering::Acquire);
        let mut held = 0u64;
        for worker in 0..self.workers.len() {
            let mut mine = self.worker(worker);
            mine.shares.retain(|bucket, share| {
                let live = share.live(now);
                let idle =
                    !hearing && now.saturating_duration_since(share.last_used) >= IDLE_GIVE_BACK;
                let changed = reloaded
                    .as_ref()
                    .is_some_and(|set| !set.contains(&share.shape));
                let due = changed || idle || !live;
                if due && share.unused > 0 && (live || share.shape.sliding) {
                    back.push(GiveBack {
                        bucket: bucket.clone(),
                        window_start_secs: share.window_start_secs,
                        unused: share.unused,
                    });
                    share.unused = 0;
                }
                if !live {
                    share.unused = 0;
                }
                held += u64::from(share.unused);
                // An ended window's share is kept while a grant is under way (its requests
                // wait on it) and dropped otherwise; a reload's change drops it too.
                (live || share.granting.is_some()) && !changed
            });
        }
        self.reserved_units
            .set(i64::try_from(held).unwrap_or(i64::MAX));
        send_back(store, merge(back)).await;
    }

    /// Gives back every unused unit (a clean stop, contract §3c).
    pub async fn give_back_all(&self, store: &dyn Store) {
        self.set_aside_where(|_, _| true);
        self.tick(store).await;
        self.reserved_units.set(0);
    }
}

/// Runs [`Shares::tick`] every [`TICK`], for as long as the server runs.
pub async fn give_back_when_due(shares: Arc<Shares>, store: Arc<dyn Store>) {
    let mut every = tokio::time::interval(TICK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        shares.tick(&*store).await;
    }
}

/// The limits of `config` that reserve, as [`Shares::reloaded`] takes them.
pub fn shapes_in(config: &crate::config::Config) -> HashSet<Shape> {
    config
        .routes
        .iter()
        .flat_map(|route| &route.limits)
        .filter(|limit| limit.reserve)
        .map(|limit| Shape {
            policy: Arc::from(limit.policy_name()),
            requests: limit.requests,
            window_secs: limit.window_secs,
            sliding: limit.algorithm == crate::config::Algorithm::Sliding,
        })
        .collect()
}

/// The grant is over: whoever waited on it looks again.
/// What goes back of `share`'s units when it moves to another window: a sliding row still
/// weighs as the previous window; a fixed one's units are worth nothing once it ended.
fn share_of_ended(bucket: &Arc<str>, share: &Share) -> Option<GiveBack> {
    (share.unused > 0 && share.shape.sliding).then(|| GiveBack {
        bucket: bucket.clone(),
        window_start_secs: share.window_start_secs,
        unused: share.unused,
    })
}

fn end_grant(share: &mut Share) {
    if let Some(granting) = share.granting.take() {
        granting.send_replace(());
    }
    share.waiting = 0;
}

/// How long until the share's window ends: from the share when it is current, else a whole
/// window (a new window is about to be granted).
fn window_left(now: Instant, share: &Share, window_secs: u32) -> Duration {
    if share.live(now) {
        share.ends.saturating_duration_since(now)
    } else {
        Duration::from_secs(u64::from(window_secs))
    }
}

/// One give-back per (bucket, window), the workers' units summed.
fn merge(back: Vec<GiveBack>) -> Vec<GiveBack> {
    let mut merged: HashMap<(Arc<str>, i64), u32, RandomState> = HashMap::default();
    for b in back {
        let units = merged.entry((b.bucket, b.window_start_secs)).or_default();
        *units = units.saturating_add(b.unused);
    }
    merged
        .into_iter()
        .map(|((bucket, window_start_secs), unused)| GiveBack {
            bucket,
            window_start_secs,
            unused,
        })
        .collect()
}

/// Sends give-backs in batches; a failure is logged and the units stay counted in their rows
/// until the window ends (they can deny early, never admit more).
async fn send_back(store: &dyn Store, back: Vec<GiveBack>) {
    for batch in back.chunks(GIVE_BACK_BATCH) {
        // One statement takes one window per bucket: a bucket twice (two windows) goes in
        // the next statement.
        let mut seen = HashSet::<Arc<str>, RandomState>::default();
        let (first, again): (Vec<_>, Vec<_>) = batch
            .iter()
            .cloned()
            .partition(|b| seen.insert(b.bucket.clone()));
        for part in [first, again] {
            if part.is_empty() {
                continue;
            }
            if let Err(err) = store.give_back(&part).await {
                let units: u64 = part.iter().map(|b| u64::from(b.unused)).sum();
                tracing::warn!(error = %err, units, "reserved units could not be given back; they stay counted until their window ends");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::tests::plan;

    fn shares(workers: usize) -> Shares {
        let instances = Arc::new(Instances::new(Gauge::default()));
        Shares::new(workers, instances, Gauge::default())
    }

    /// What the store would answer: `granted` units of a row now at `count`, in a window that
    /// ends a minute from now.
    fn grant(granted: u32, count: u32) -> ShareGrant {
        let now_ms = crate::store::unix_now_ms();
        let window_end_ms = (now_ms / 60_000 + 1) * 60_000;
        ShareGrant {
            granted,
            count,
            previous: 0,
            window_end_ms,
            now_ms,
        }
    }

    fn limit(bucket: usize) -> PlannedLimit {
        PlannedLimit {
            bucket: Arc::from(format!("p:ip:{bucket:064x}")),
            ..plan("p:ip", 1000, 60, false)
        }
    }

    /// Takes a unit of `plan` on `worker`, asking the "store" for `granted` when needed.
    fn take_granting(shares: &Shares, worker: usize, plan: &PlannedLimit, granted: u32) -> Held {
        match shares.take(worker, plan) {
            Take::Taken(held) => held,
            Take::Grant(_) => shares
                .granted(worker, plan, &grant(granted, granted), Instant::now())
                .expect("a unit of the grant"),
            Take::Wait(_) => panic!("no other request is granting"),
        }
    }

    /// contract §9: a worker keeps shares of at most `SHARES_PER_WORKER` buckets (buckets are
    /// what clients send); past it the least recently used one goes, its units set aside for
    /// the next give-back.
    #[test]
    fn a_full_worker_gives_back_its_least_recently_used_share() {
        let shares = shares(1);
        for bucket in 0..=SHARES_PER_WORKER {
            take_granting(&shares, 0, &limit(bucket), 3);
        }
        assert_eq!(shares.worker(0).shares.len(), SHARES_PER_WORKER);
        let back = std::mem::take(&mut shares.asked().back);
        assert_eq!(back.len(), 1, "{back:?}");
        assert_eq!(back[0].bucket, limit(0).bucket, "the least recently used");
        assert_eq!(back[0].unused, 2);
    }

    /// One instance never denies while it holds units: a worker whose share is empty takes
    /// half of another worker's unused units before it asks the store.
    #[test]
    fn an_empty_worker_takes_half_of_another_workers_units_first() {
        let shares = shares(2);
        let plan = limit(7);
        take_granting(&shares, 0, &plan, 9);
        // Worker 0 holds 8; worker 1 takes 4 of them (one for its request).
        let Take::Taken(held) = shares.take(1, &plan) else {
            panic!("worker 1 asked the store while worker 0 held units");
        };
        assert_eq!(shares.worker(0).shares[&plan.bucket].unused, 4);
        assert_eq!(shares.worker(1).shares[&plan.bucket].unused, 3);
        // `r`: what the row leaves (1000 - 9) plus this worker's unused units.
        assert_eq!(held.left, 991 + 3);
        // A unit put back (another limit denied the request) is there again.
        shares.put_back(1, &plan, &held);
        assert_eq!(shares.worker(1).shares[&plan.bucket].unused, 4);
    }

    /// Contract §3e: units granted under one `requests` never admit a request planned with
    /// another (an override set, removed or ended): every worker's share of the bucket is set
    /// aside for the next give-back and the request asks the store under the new limit.
    #[test]
    fn a_share_granted_under_other_requests_is_given_back_not_used() {
        let shares = shares(2);
        let plan = limit(5);
        take_granting(&shares, 0, &plan, 9);
        let Take::Taken(_) = shares.take(1, &plan) else {
            panic!("worker 1 takes from worker 0's units");
        };
        let lowered = PlannedLimit {
            requests: 3,
            ..plan.clone()
        };
        let Take::Grant(want) = shares.take(0, &lowered) else {
            panic!("units of the old limit were used");
        };
        assert_eq!(want.requests, 3);
        let back: u32 = shares.asked().back.iter().map(|b| b.unused).sum();
        assert_eq!(back, 7, "both workers' unused units go back");
        for worker in 0..2 {
            assert_eq!(shares.worker(worker).shares[&plan.bucket].unused, 0);
        }
    }

    /// Requests that find a grant under way wait for it, and the grant asks for them too.
    #[test]
    fn one_grant_per_worker_and_bucket_is_in_flight() {
        let shares = shares(1);
        let plan = limit(3);
        let Take::Grant(first) = shares.take(0, &plan) else {
            panic!("the first request asks the store");
        };
        assert_eq!(
            first.want, 1,
            "nothing is known of the bucket or its limit yet"
        );
        let mut waiting = Vec::new();
        for _ in 0..5 {
            match shares.take(0, &plan) {
                Take::Wait(rx) => waiting.push(rx),
                _ => panic!("a second grant of one bucket on one worker"),
            }
        }
        shares.granted(0, &plan, &grant(6, 6), Instant::now());
        // The grant's sender is gone once it answered: a waiter's `changed()` returns at once
        // (with the new value, or because the channel closed), and it takes again.
        for rx in &waiting {
            assert!(
                !matches!(rx.has_changed(), Ok(false)),
                "a waiter was not woken"
            );
        }
        for _ in 0..5 {
            assert!(matches!(shares.take(0, &plan), Take::Taken(_)));
        }
        let Take::Grant(next) = shares.take(0, &plan) else {
            panic!("the share is used up");
        };
        assert!(
            next.want >= 12,
            "at least twice the last grant: {}",
            next.want
        );
    }

    /// Contract §3d with §3c: a request of `cost` units takes them all from a share or none;
    /// a share holding fewer asks the store for what it still needs (and other workers'
    /// units count first), and a request denied by another limit puts all of them back.
    #[test]
    fn a_dear_request_takes_all_of_its_units_or_asks_for_what_it_still_needs() {
        let shares = shares(2);
        let dear = PlannedLimit {
            cost: 4,
            ..limit(9)
        };
        let Take::Grant(first) = shares.take(0, &dear) else {
            panic!("nothing held yet");
        };
        assert_eq!((first.need, first.want), (4, 4), "the whole cost, at least");
        let held = shares
            .granted(0, &dear, &grant(6, 6), Instant::now())
            .expect("4 of the 6 units");
        assert_eq!(shares.worker(0).shares[&dear.bucket].unused, 2);
        shares.put_back(0, &dear, &held);
        assert_eq!(
            shares.worker(0).shares[&dear.bucket].unused,
            6,
            "all 4 back"
        );
        let Take::Taken(_) = shares.take(0, &dear) else {
            panic!("6 units hold a request of 4");
        };
        // Worker 1 has nothing; worker 0's 2 are not enough to steal a request of 4 from.
        let Take::Grant(want) = shares.take(1, &dear) else {
            panic!("2 units do not hold a request of 4");
        };
        assert_eq!(want.need, 2, "the stolen 2 count: {want:?}");
        assert!(shares.worker(0).shares[&dear.bucket].unused < 2);
        assert!(shares
            .granted(1, &dear, &grant(0, 1000), Instant::now())
            .is_none());
        let cheap = limit(9);
        assert!(
            matches!(shares.take(1, &cheap), Take::Taken(_)),
            "the units a dear request could not use serve a cheap one"
        );
    }
}
