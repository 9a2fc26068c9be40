//! The exhausted-bucket cache: buckets known to be over their limit, denied without the store
//! until their window ends, and the counts a cached denial reports for a request's other
//! limits (see [`Exhausted`] and the module docs of [`crate::limit`]).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::{
    judge, seconds_until, sliding_wait_ms, weighted_previous, window_left_secs, LimitOutcome,
    Outcomes, PlannedLimit, RandomState, SlidingOutcome, Verdict, INLINE_LIMITS,
};
use crate::store::ResetEvent;

/// Bucket -> its [`Denial`].
type ExhaustedShard = HashMap<Arc<str>, Denial, RandomState>;

/// What one store answer said of a bucket: that it is exhausted (it denies some limits), or,
/// for a request that another limit denied, its count. Times are unix milliseconds on the
/// limiter's [`Clock`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Denial {
    /// When the store said so. A clock that has gone back before it (the system clock
    /// stepped back, a test set its clock back) drops the entry rather than let it deny for
    /// longer than the store's answer said.
    since_ms: i64,
    /// Until when the entry holds: while it denies, or the end of the window it counts.
    until_ms: i64,
    /// The end of the window whose counts these are. The store's remaining time measured
    /// from `since_ms`, which is no later than the store's own "now", so never after the
    /// window really ends: the counts are never carried into the next window.
    window_end_ms: i64,
    /// The count seen (this window's).
    count: u32,
    /// Sliding windows: the previous window's count, weighed when a cached denial reports it.
    previous: u32,
    /// Which requests it denies.
    denies: Denies,
}

/// Which requests a [`Denial`] denies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Denies {
    /// Every request whose units no longer fit beside the count: the count only grows until
    /// the window ends (a fixed window's is the whole measure; a sliding one's estimate is at
    /// least its count).
    BeyondCount,
    /// A sliding limit's denial, known only for what it was decided against: limits of at
    /// most `requests`, requests of at least `cost` units.
    Sliding { requests: u32, cost: u32 },
}

impl Denial {
    /// What the store's answer `c` for `plan`, asked at `now_ms`, says of its bucket:
    /// `exceeded` when this limit denied the request.
    pub(super) fn answered(
        plan: &PlannedLimit,
        c: &crate::store::Counted,
        exceeded: bool,
        now_ms: i64,
    ) -> Self {
        // The store's "now" is no earlier than `now_ms` (read before the call; on the memory
        // store by the same clock), so deadlines measured from `now_ms` are no later than the
        // moments they stand for: the entry never outlives the window or the denial.
        let window_left_ms = c.window_end_ms.saturating_sub(c.now_ms).max(0);
        let window_end_ms = now_ms.saturating_add(window_left_ms);
        // A fixed window's count only grows until the window ends, so it denies every limit
        // below it until then; so does a sliding one's (its estimate is at least the
        // current count). A sliding denial is known only for the limit it was decided
        // against, until the moment its estimate would admit one request if nothing else
        // were admitted meanwhile (anything admitted meanwhile, by another instance, only
        // pushes that moment later, so the denial stays exact); a reload that raised the
        // limit must ask the store again.
        let (until_ms, denies) = if exceeded && plan.sliding {
            let len_ms = i64::from(plan.window_secs) * 1000;
            let elapsed = len_ms - window_left_ms;
            let (requests, cost) = (plan.requests, plan.cost);
            let wait = sliding_wait_ms(requests, cost, c.previous, c.count, elapsed, len_ms);
            let denies = Denies::Sliding { requests, cost };
            (now_ms.saturating_add(wait.max(0)), denies)
        } else {
            (window_end_ms, Denies::BeyondCount)
        };
        Denial {
            since_ms: now_ms,
            until_ms,
            window_end_ms,
            count: c.count,
            previous: c.previous,
            denies,
        }
    }

    /// Whether a later answer about the same bucket, `newer`, should replace this entry: not
    /// while this one holds and denies more (an answer about another limit of the bucket, a
    /// route sharing it with a higher `requests`, must not make it forget a denial).
    fn yields_to(&self, newer: &Denial) -> bool {
        if !self.holds_at(newer.since_ms) {
            return true;
        }
        match (self.denies, newer.denies) {
            (Denies::BeyondCount, Denies::BeyondCount) => newer.count >= self.count,
            (Denies::Sliding { requests: a, .. }, Denies::Sliding { requests: b, .. }) => b >= a,
            _ => true,
        }
    }

    fn holds_at(&self, now_ms: i64) -> bool {
        self.since_ms <= now_ms && now_ms < self.until_ms
    }

    /// Whether it denies `plan`: a reload may have raised the limit above what it is known
    /// to deny, and a cheaper request may fit where a dearer one did not (contract §3d).
    fn denies(&self, plan: &PlannedLimit) -> bool {
        match self.denies {
            Denies::BeyondCount => {
                u64::from(self.count) + u64::from(plan.cost) > u64::from(plan.requests)
            }
            Denies::Sliding { requests, cost } => plan.requests <= requests && plan.cost >= cost,
        }
    }

    /// Where `plan` stands in a cached denial at `now_ms`, from what is `known` of its bucket
    /// (an entry that holds at `now_ms`). See [`Exhausted::deny`].
    fn outcome(known: Option<Denial>, plan: &PlannedLimit, now_ms: i64) -> LimitOutcome {
        // Counts of a window that has ended say nothing of the current one.
        let current = known.filter(|k| now_ms < k.window_end_ms);
        let reset_secs = current.map_or_else(
            || window_left_secs(now_ms, plan.window_secs),
            |k| seconds_until(now_ms, k.window_end_ms),
        );
        let (count, sliding) = match known.filter(|k| k.denies(plan)) {
            // A cached sliding denial: `t` is still the end of the window; `Retry-After`
            // is the moment the entry ends.
            Some(k) => {
                let len_ms = i64::from(plan.window_secs) * 1000;
                let sliding = plan.sliding.then(|| SlidingOutcome {
                    admitted: false,
                    weighted_previous: weighted_previous(
                        k.previous,
                        k.window_end_ms - now_ms,
                        len_ms,
                    ),
                    retry_secs: seconds_until(now_ms, k.until_ms),
                });
                (k.count, sliding)
            }
            None => {
                let (count, previous) = current.map_or((0, 0), |k| (k.count, k.previous));
                let len_ms = i64::from(plan.window_secs) * 1000;
                let left_ms = current.map_or(len_ms, |k| k.window_end_ms - now_ms);
                let sliding = plan.sliding.then(|| SlidingOutcome {
                    admitted: true,
                    weighted_previous: weighted_previous(previous, left_ms, len_ms),
                    retry_secs: reset_secs,
                });
                (count, sliding)
            }
        };
        LimitOutcome {
            policy: plan.policy.clone(),
            requests: plan.requests,
            window_secs: plan.window_secs,
            count,
            cost: plan.cost,
            // This request is not counted: it never reaches the store.
            added: false,
            reset_secs,
            shadow: false,
            sliding,
        }
    }
}

/// Buckets over their limit, with the moment their window ends, and, next to them, the counts
/// the store gave the other limits of the requests it denied (what a cached denial reports for
/// them, [`Exhausted::deny`]). Sharded so that concurrent requests rarely meet on one lock;
/// bounded so that a flood of distinct keys cannot grow it without limit: at most
/// [`Exhausted::PER_SHARD`] entries in each of [`Exhausted::SHARDS`] shards. A full shard
/// first drops the entries whose window has ended; if it is still full, the new entry is
/// simply not cached and that bucket's requests keep going to the store, which decides them
/// exactly (it only costs the round trip the cache would have saved).
pub struct Exhausted {
    shards: Vec<Mutex<ExhaustedShard>>,
    hasher: RandomState,
    /// False while resets cannot reach this instance (its `LISTEN` session is deaf): then
    /// nothing is cached, so every request goes to the store and a reset holds at once.
    enabled: AtomicBool,
}

impl Default for Exhausted {
    fn default() -> Self {
        Self::new()
    }
}

impl Exhausted {
    pub(super) const SHARDS: usize = 16;
    pub(super) const PER_SHARD: usize = 8192;

    pub fn new() -> Self {
        Exhausted {
            shards: (0..Self::SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::default(),
            enabled: AtomicBool::new(true),
        }
    }

    /// Forgets `bucket` (a `tollgate reset` of it).
    pub fn forget(&self, bucket: &str) {
        if let Ok(mut shard) = self.shard(bucket).lock() {
            shard.remove(bucket);
        }
    }

    /// Forgets every bucket.
    pub fn clear(&self) {
        for shard in &self.shards {
            if let Ok(mut shard) = shard.lock() {
                shard.clear();
            }
        }
    }

    /// What the store's `LISTEN` session heard (contract §3b): a reset bucket is forgotten, and so
    /// is one whose row got reserved units back (contract §3c); after a (re)connect, or while
    /// notifications do not arrive, nothing cached can be trusted.
    pub fn on_reset(&self, event: ResetEvent<'_>) {
        match event {
            ResetEvent::Bucket(bucket) | ResetEvent::Returned(bucket) => self.forget(bucket),
            // A cached denial is held against the plan's `requests`, overrides included.
            ResetEvent::Reclaim(_) | ResetEvent::Overrides => {}
            ResetEvent::Missed => self.clear(),
            ResetEvent::Hearing(hearing) => {
                self.enabled.store(hearing, Ordering::Release);
                if !hearing {
                    self.clear();
                }
            }
        }
    }

    /// Entries held, in every shard.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map_or(0, |shard| shard.len()))
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, bucket: &str) -> &Mutex<ExhaustedShard> {
        let index = self.hasher.hash_one(bucket) as usize % Self::SHARDS;
        &self.shards[index]
    }

    /// Remembers what a store answer said of `bucket` (see [`Denial::answered`]). An entry
    /// that still holds and denies more is kept: an answer about another limit of the bucket
    /// (a route sharing it with a higher `requests`) must not make it forget a denial.
    pub(super) fn insert(&self, bucket: &Arc<str>, denial: Denial) {
        if !self.enabled.load(Ordering::Relaxed) {
            return;
        }
        let Ok(mut shard) = self.shard(bucket).lock() else {
            return;
        };
        if let Some(held) = shard.get_mut(&**bucket) {
            if held.yields_to(&denial) {
                *held = denial;
            }
            return;
        }
        if shard.len() >= Self::PER_SHARD {
            shard.retain(|_, held| held.holds_at(denial.since_ms));
            if shard.len() >= Self::PER_SHARD {
                return;
            }
        }
        shard.insert(bucket.clone(), denial);
    }

    /// A denial for `plans` if an enforced limit among them is known to be exhausted, without
    /// a store round trip.
    ///
    /// Like a denial decided by the store, it has an outcome for every enforced limit that
    /// applies, in plan order, so the rate-limit fields list them all (docs/operations.md,
    /// "Exhausted buckets"). For an exhausted limit the cache knows the count it last saw and
    /// when the entry ends. A limit that is not exhausted is not counted (this request never
    /// reaches the store): its outcome has the count the cache remembered from the last
    /// denial the store decided for one of its requests (counts only grow within a window, so
    /// its `r` is at most what that answer left, never an amount the limit already spent), or
    /// count 0 when nothing of its current window is remembered, so that `r` says the most it
    /// can honestly promise, the limit's quota. Its `t` is the end of the window that answer
    /// gave, else of its current epoch-aligned window by this process's clock (exact on the
    /// memory store, off by the clock skew to the database on Postgres). Shadow limits are
    /// left out: they are not counted here either, and never appear in the fields. `now_ms`:
    /// unix milliseconds on the limiter's clock. `outcomes` is cleared, then holds the
    /// denial's outcomes.
    pub fn deny(
        &self,
        plans: &[PlannedLimit],
        now_ms: i64,
        outcomes: &mut Outcomes,
    ) -> Option<Verdict> {
        outcomes.clear();
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        // Most requests are not denied: find the first exhausted limit before building
        // anything, keeping what was found of the limits up to it, so that no bucket is
        // looked up twice.
        let mut seen: SmallVec<[Option<Denial>; INLINE_LIMITS]> = SmallVec::new();
        let denied = plans.iter().any(|plan| {
            let known = if plan.shadow {
                None
            } else {
                self.known(plan, now_ms)
            };
            seen.push(known);
            known.is_some_and(|k| k.denies(plan))
        });
        if !denied {
            return None;
        }
        let cached = plans
            .iter()
            .enumerate()
            .filter(|(_, plan)| !plan.shadow)
            .map(|(i, plan)| {
                let known = match seen.get(i) {
                    Some(known) => *known,
                    None => self.known(plan, now_ms),
                };
                Denial::outcome(known, plan, now_ms)
            });
        outcomes.extend(cached);
        Some(judge(outcomes))
    }

    /// Where `plan` stands at `now_ms` by what is remembered of its bucket, as a cached denial
    /// reports a limit it did not count: for a request that another limit denied without
    /// asking the store about this one.
    pub(super) fn remembered(&self, plan: &PlannedLimit, now_ms: i64) -> LimitOutcome {
        Denial::outcome(self.known(plan, now_ms), plan, now_ms)
    }

    /// What is remembered of `plan`'s bucket at `now_ms`. An entry that no longer holds (its
    /// window or denial has ended, or the clock went back before it) is dropped.
    fn known(&self, plan: &PlannedLimit, now_ms: i64) -> Option<Denial> {
        let Ok(mut shard) = self.shard(&plan.bucket).lock() else {
            return None;
        };
        let denial = *shard.get(&*plan.bucket)?;
        if !denial.holds_at(now_ms) {
            shard.remove(&*plan.bucket);
            return None;
        }
        Some(denial)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::tests::plan;

    /// An entry said at `since` of a window ending at `until`, with `count` (previous 0),
    /// denying the requests whose units no longer fit beside it.
    fn denial(since: i64, until: i64, count: u32) -> Denial {
        Denial {
            since_ms: since,
            until_ms: until,
            window_end_ms: until,
            count,
            previous: 0,
            denies: Denies::BeyondCount,
        }
    }

    #[test]
    fn a_cached_denial_has_an_outcome_for_every_enforced_limit() {
        let cache = Exhausted::new();
        let now = crate::store::unix_now_ms();
        let plans = [
            plan("a:ip", 5, 60, false),
            plan("s:ip", 1, 60, true),
            plan("b:ip", 100, 86_400, false),
        ];
        let mut outcomes = Outcomes::new();
        assert!(
            cache.deny(&plans, now, &mut outcomes).is_none(),
            "nothing exhausted yet"
        );
        assert!(outcomes.is_empty());
        cache.insert(&plans[2].bucket, denial(now, now + 30_000, 101));
        let Some(Verdict::Deny {
            retry_after,
            violated,
        }) = cache.deny(&plans, now, &mut outcomes)
        else {
            panic!("expected a cached denial");
        };
        let names: Vec<&str> = outcomes.iter().map(|o| &*o.policy).collect();
        assert_eq!(names, ["a:ip", "b:ip"], "plan order, shadow left out");
        // Not counted: its quota, and its own window's end.
        assert_eq!(outcomes[0].remaining(), 5);
        assert!((1..=60).contains(&outcomes[0].reset_secs));
        assert_eq!((outcomes[1].count, outcomes[1].remaining()), (101, 0));
        assert_eq!(retry_after, 30);
        assert_eq!(violated, [Arc::<str>::from("b:ip")]);
        // A reload that raised the limit above the remembered count: no cached denial.
        let raised = [plan("b:ip", 200, 86_400, false)];
        assert!(cache.deny(&raised, now, &mut outcomes).is_none());
        assert!(outcomes.is_empty(), "no stale outcomes: {outcomes:?}");
    }

    /// The cache's deadlines are on the clock it is handed, not on real time: it denies until
    /// the deadline, not at it, and lets go of an entry when that clock goes back before it.
    #[test]
    fn a_cached_denial_holds_from_its_answer_until_its_deadline_on_the_given_clock() {
        let cache = Exhausted::new();
        let plans = [plan("a:ip", 5, 60, false)];
        let t = 1_800_000_000_000;
        cache.insert(&plans[0].bucket, denial(t, t + 2_500, 6));
        let retry = |now| match cache.deny(&plans, now, &mut Outcomes::new()) {
            Some(Verdict::Deny { retry_after, .. }) => Some(retry_after),
            Some(other) => panic!("{other:?}"),
            None => None,
        };
        assert_eq!(retry(t), Some(3), "2.5 s left, rounded up");
        assert_eq!(retry(t + 2_499), Some(1));
        // Back before the answer: not trusted, dropped.
        assert_eq!(retry(t - 1), None);
        assert!(cache.is_empty());
        cache.insert(&plans[0].bucket, denial(t, t + 2_500, 6));
        assert_eq!(retry(t + 2_500), None, "the deadline itself admits");
        assert!(cache.is_empty(), "an ended entry is dropped when it is met");
    }

    /// Issue 47: a cached denial reports the limits it was not denied by with the counts the
    /// store's last denial of their bucket gave, before and after the exhausted limit, as long
    /// as their window lasts; a sliding one's previous window weighed as the time has come.
    #[test]
    fn a_cached_denial_reports_the_other_limits_remembered_counts() {
        let cache = Exhausted::new();
        let t = 1_800_000_000_000;
        let sliding = PlannedLimit {
            sliding: true,
            ..plan("s:global", 100, 100, false)
        };
        let plans = [
            plan("a:global", 50, 60, false),
            plan("b:ip", 2, 60, false),
            sliding,
        ];
        cache.insert(&plans[0].bucket, denial(t, t + 20_000, 7));
        cache.insert(&plans[1].bucket, denial(t, t + 20_000, 3));
        let mut s = denial(t, t + 50_000, 10);
        s.previous = 40;
        cache.insert(&plans[2].bucket, s);
        let mut outcomes = Outcomes::new();
        let at = |now| {
            let mut outcomes = Outcomes::new();
            let verdict = cache.deny(&plans, now, &mut outcomes);
            (verdict.map(|v| matches!(v, Verdict::Deny { .. })), outcomes)
        };
        let (denied, got) = at(t + 10_000);
        assert_eq!(denied, Some(true));
        let left: Vec<u32> = got.iter().map(LimitOutcome::remaining).collect();
        // 40 * 40 / 100 = 16 of the previous window, 10 of this one.
        assert_eq!(left, [43, 0, 74], "{got:?}");
        let resets: Vec<u64> = got.iter().map(|o| o.reset_secs).collect();
        assert_eq!(resets, [10, 10, 40]);
        // A known count denies no limit above it, here or anywhere else.
        assert!(cache.deny(&plans[..1], t, &mut outcomes).is_none());
        assert!(cache.deny(&plans[2..], t, &mut outcomes).is_none());
        // A fixed window's count past its window: dropped with the window.
        let (denied, _) = at(t + 20_000);
        assert_eq!(denied, None, "the exhausted bucket's window has ended");
        assert_eq!(cache.len(), 1, "only the sliding bucket's window lasts");
        // An answer about another limit of a bucket does not undo its denial.
        cache.insert(&plans[1].bucket, denial(t, t + 20_000, 3));
        cache.insert(&plans[1].bucket, denial(t + 1, t + 20_000, 1));
        assert_eq!(at(t + 2).0, Some(true));
    }
}
