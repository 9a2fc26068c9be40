//! A request with `reserve` limits (contract §3c; docs/architecture.md, "Reserved shares").
//!
//! 1. Each `reserve` limit takes the request's units (its `cost`) of this worker's share of its
//!    bucket; the limits whose share holds too few ask the store for shares, all in one
//!    statement.
//! 2. When no `reserve` limit denies, the request's other limits are decided as without
//!    `reserve` (one more statement, the usual joint decision of those limits).
//! 3. The outcomes are judged together. A denied request gives the units it took back to the
//!    shares: it takes nothing from the others' budgets, and is counted nowhere with `reserve`.
//!
//! So a request whose shares hold units costs one statement (its other limits) or none, and a
//! share running out costs one more.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;
use tokio::sync::oneshot;

use super::{Held, Shares, Take};
use crate::limit::exhausted::Denial;
use crate::limit::{
    judge, seconds_until, LimitOutcome, Limiter, Outcomes, PlannedLimit, Verdict, INLINE_LIMITS,
};
use crate::store::{Counted, ShareGrant, ShareWant, StoreError};

/// Where one of the request's limits stands after step 1.
#[derive(Clone, Copy)]
enum Slot {
    /// Not a `reserve` limit: decided in step 2.
    Other,
    /// The request's units, taken from a share.
    Held(Held),
    /// Nothing left in the row: the store granted nothing.
    Exhausted(ShareGrant),
}

type Slots = SmallVec<[Slot; INLINE_LIMITS]>;

impl Limiter {
    /// [`Limiter::decide`] for a request with at least one `reserve` limit.
    pub(in crate::limit) async fn decide_reserved(
        &self,
        shares: &Arc<Shares>,
        worker: usize,
        plans: &[PlannedLimit],
        outcomes: &mut Outcomes,
    ) -> Verdict {
        if let Some(denied) = self.exhausted.deny(plans, self.clock.now_ms(), outcomes) {
            return denied;
        }
        let mut slots: Slots = plans.iter().map(|_| Slot::Other).collect();
        let mut wants: SmallVec<[(usize, ShareWant); INLINE_LIMITS]> = SmallVec::new();
        let started = Instant::now();
        for (i, plan) in plans.iter().enumerate().filter(|(_, p)| p.reserve) {
            loop {
                match shares.take(worker, plan) {
                    Take::Taken(held) => slots[i] = Slot::Held(held),
                    Take::Grant(want) => wants.push((i, want)),
                    Take::Wait(mut granted) => {
                        // Another request of this worker is asking for this bucket: its
                        // answer is this one's too, within the decision's budget.
                        let left = self.timeout.saturating_sub(started.elapsed());
                        let waited = self
                            .deadlines
                            .timeout(worker, left, granted.changed())
                            .await;
                        if waited.is_err() {
                            self.put_back(shares, worker, plans, &slots);
                            self.store.decision_outcome(false);
                            return Verdict::StoreFailed;
                        }
                        let now_ms = self.clock.now_ms();
                        if let Some(denied) = self.exhausted.deny(plans, now_ms, outcomes) {
                            self.put_back(shares, worker, plans, &slots);
                            return denied;
                        }
                        continue;
                    }
                }
                break;
            }
        }
        if !wants.is_empty() && !self.grant(shares, worker, plans, &wants, &mut slots).await {
            self.put_back(shares, worker, plans, &slots);
            return Verdict::StoreFailed;
        }
        // `r` is the instance's, not this worker's (contract §3c).
        for (plan, slot) in plans.iter().zip(slots.iter_mut()) {
            if let Slot::Held(held) = slot {
                held.left = shares.instance_left(worker, plan, held);
            }
        }
        let verdict = self.decide_the_rest(worker, plans, &slots, outcomes).await;
        if !matches!(verdict, Verdict::Allow { .. }) {
            self.put_back(shares, worker, plans, &slots);
        }
        verdict
    }

    /// Step 1's statement: shares of every bucket in `wants`, one unit of each for this
    /// request. False when the store failed. The grant runs as a task of its own
    /// ([`apply_grant`]), so that what the store grants reaches the shares even when this
    /// request is cancelled or gives up waiting.
    async fn grant(
        &self,
        shares: &Arc<Shares>,
        worker: usize,
        plans: &[PlannedLimit],
        wants: &[(usize, ShareWant)],
        slots: &mut Slots,
    ) -> bool {
        let asked = Granting {
            shares: shares.clone(),
            worker,
            plans: wants.iter().map(|(i, _)| plans[*i].clone()).collect(),
            answered: false,
        };
        let Some(attempt) = self.breaker.attempt() else {
            self.store.decision_outcome(false);
            return false;
        };
        let (reply, answer) = oneshot::channel();
        let wanted = wants.iter().map(|(_, want)| want.clone()).collect();
        tokio::spawn(apply_grant(asked, self.store.clone(), wanted, reply));
        let sent_at = Instant::now();
        let answer = Box::pin(async move {
            answer.await.unwrap_or_else(|_| {
                Err(StoreError::Query(
                    "the grant ended without an answer".into(),
                ))
            })
        });
        let answer = self.within_budget(worker, answer).await;
        let Some(granted) = self.settle(attempt, sent_at.elapsed(), answer) else {
            return false;
        };
        for ((i, _), slot) in wants.iter().zip(granted) {
            slots[*i] = slot;
        }
        true
    }

    /// Steps 2 and 3: the other limits decided (unless a `reserve` limit already denies), and
    /// every outcome in plan order, judged together.
    async fn decide_the_rest(
        &self,
        worker: usize,
        plans: &[PlannedLimit],
        slots: &Slots,
        outcomes: &mut Outcomes,
    ) -> Verdict {
        let now_ms = self.clock.now_ms();
        let denied = plans
            .iter()
            .zip(slots)
            .any(|(plan, slot)| !plan.shadow && matches!(slot, Slot::Exhausted(_)));
        let others: SmallVec<[PlannedLimit; INLINE_LIMITS]> =
            plans.iter().filter(|p| !p.reserve).cloned().collect();
        let mut decided = Outcomes::new();
        if !others.is_empty() && !denied {
            if let Verdict::StoreFailed = self.decide(worker, &others, &mut decided).await {
                return Verdict::StoreFailed;
            }
        }
        outcomes.clear();
        for (plan, slot) in plans.iter().zip(slots) {
            let outcome = match slot {
                Slot::Held(held) => Some(held_outcome(plan, held)),
                Slot::Exhausted(grant) => Some(self.exhausted_outcome(plan, grant, now_ms)),
                // A cached denial of the other limits reports only the enforced ones.
                Slot::Other if denied => {
                    (!plan.shadow).then(|| self.exhausted.remembered(plan, now_ms))
                }
                Slot::Other => decided.iter().find(|o| o.policy == plan.policy).cloned(),
            };
            outcomes.extend(outcome);
        }
        judge(outcomes)
    }

    /// A `reserve` limit whose row had nothing left: denied (a shadow one would have been),
    /// and remembered as exhausted until units come back or the window ends.
    fn exhausted_outcome(
        &self,
        plan: &PlannedLimit,
        grant: &ShareGrant,
        now_ms: i64,
    ) -> LimitOutcome {
        let counted = Counted {
            // A fixed row: its count, with too little room for this request's units (the
            // grant needed at most them; a window that turned since the ask can have left
            // fewer in the share: still denied, so at least that full); a sliding one: its
            // count, which the estimate of contract §3a says is full.
            count: if plan.sliding {
                grant.count
            } else {
                let full = plan.requests.saturating_sub(plan.cost.max(1)) + 1;
                grant.count.max(full)
            },
            window_end_ms: grant.window_end_ms,
            now_ms: grant.now_ms,
            added: 0,
            previous: grant.previous,
            fits: 0,
        };
        if !plan.shadow {
            let denial = Denial::answered(plan, &counted, true, now_ms);
            self.exhausted.insert(&plan.bucket, denial);
        }
        LimitOutcome::counted(plan, &counted)
    }

    /// The units a request took go back to the shares (it was denied, or failed).
    fn put_back(&self, shares: &Shares, worker: usize, plans: &[PlannedLimit], slots: &Slots) {
        for (plan, slot) in plans.iter().zip(slots) {
            if let Slot::Held(held) = slot {
                shares.put_back(worker, plan, held);
            }
        }
    }
}

/// The buckets of one grant under way, on one worker: dropped before the answer was applied
/// (the store failed, the task ended), it ends their grants so that requests waiting on them
/// look again.
struct Granting {
    shares: Arc<Shares>,
    worker: usize,
    plans: Vec<PlannedLimit>,
    answered: bool,
}

impl Drop for Granting {
    fn drop(&mut self) {
        if !self.answered {
            for plan in &self.plans {
                self.shares.grant_failed(self.worker, plan);
            }
        }
    }
}

/// Asks the store for `wanted` and applies the answer to the shares, each granting request's
/// unit taken; hands the slots to the request, or, when it no longer waits, puts its units
/// back: a cancelled request loses nothing the store counted.
async fn apply_grant(
    mut asked: Granting,
    store: Arc<dyn crate::store::Store>,
    wanted: Vec<ShareWant>,
    reply: oneshot::Sender<Result<Vec<Slot>, StoreError>>,
) {
    let sent_at = Instant::now();
    let answer = store
        .reserve(&wanted, asked.shares.instances())
        .await
        .and_then(|grants| {
            if grants.len() == wanted.len() {
                Ok(grants)
            } else {
                Err(StoreError::Query("store answered a short grant".into()))
            }
        });
    let grants = match answer {
        Ok(grants) => grants,
        Err(err) => {
            drop(asked);
            let _ = reply.send(Err(err));
            return;
        }
    };
    let (shares, worker) = (asked.shares.clone(), asked.worker);
    let slots: Vec<Slot> = asked
        .plans
        .iter()
        .zip(&grants)
        .map(
            |(plan, grant)| match shares.granted(worker, plan, grant, sent_at) {
                Some(held) => Slot::Held(held),
                None => Slot::Exhausted(*grant),
            },
        )
        .collect();
    asked.answered = true;
    if let Err(Ok(slots)) = reply.send(Ok(slots)) {
        for (plan, slot) in asked.plans.iter().zip(slots) {
            if let Slot::Held(held) = slot {
                shares.put_back(worker, plan, &held);
            }
        }
    }
}

/// A `reserve` limit that admitted the request from a share: `r` is what the row leaves plus
/// this worker's unused units (contract §3c).
fn held_outcome(plan: &PlannedLimit, held: &Held) -> LimitOutcome {
    let left_ms = held
        .ends
        .saturating_duration_since(Instant::now())
        .as_millis();
    LimitOutcome {
        policy: plan.policy.clone(),
        requests: plan.requests,
        window_secs: plan.window_secs,
        count: plan.requests - held.left.min(plan.requests),
        cost: plan.cost,
        added: true,
        reset_secs: seconds_until(0, i64::try_from(left_ms).unwrap_or(i64::MAX)),
        shadow: plan.shadow,
        sliding: None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::limit::fallback::Instances;
    use crate::limit::tests::plan;
    use crate::metrics::Metrics;
    use crate::store::{Clock, Increment, Peeked, Store, StoreFuture};

    /// A store that grants `units` of every bucket after `delay`, and counts its grants; an
    /// increment answers a count of 1.
    struct SlowGrants {
        delay: Duration,
        units: u32,
        calls: AtomicUsize,
    }

    impl Store for SlowGrants {
        fn increment<'a>(&'a self, batch: &'a [Increment]) -> StoreFuture<'a, Vec<Counted>> {
            let now_ms = crate::store::unix_now_ms();
            let counted = Counted {
                count: 1,
                window_end_ms: (now_ms / 3_600_000 + 1) * 3_600_000,
                now_ms,
                added: 1,
                previous: 0,
                fits: 1,
            };
            Box::pin(async move { Ok(vec![counted; batch.len()]) })
        }
        fn peek<'a>(&'a self, _: &'a [Increment]) -> StoreFuture<'a, Vec<Peeked>> {
            Box::pin(async { Err(StoreError::Query("not used".into())) })
        }
        fn ready(&self) -> bool {
            true
        }
        fn probe(&self) -> StoreFuture<'_, ()> {
            Box::pin(async { Ok(()) })
        }
        fn kind(&self) -> &'static str {
            "slow-grants"
        }
        fn reserves(&self) -> bool {
            true
        }
        fn reserve<'a>(
            &'a self,
            wants: &'a [ShareWant],
            _instances: u32,
        ) -> StoreFuture<'a, Vec<ShareGrant>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                tokio::time::sleep(self.delay).await;
                let now_ms = crate::store::unix_now_ms();
                Ok(wants
                    .iter()
                    .map(|_| ShareGrant {
                        granted: self.units,
                        count: self.units,
                        previous: 0,
                        window_end_ms: (now_ms / 3_600_000 + 1) * 3_600_000,
                        now_ms,
                    })
                    .collect())
            })
        }
    }

    fn limiter(store: Arc<SlowGrants>) -> Limiter {
        let limiter = unsettled(store, Duration::from_secs(5));
        // The listener has started: shares are taken.
        if let Some(shares) = limiter.shares() {
            shares.on_event(crate::store::ResetEvent::Hearing(true));
        }
        limiter
    }

    /// A limiter whose listener has not said anything yet, deciding within `timeout`.
    fn unsettled(store: Arc<SlowGrants>, timeout: Duration) -> Limiter {
        let metrics = Arc::new(Metrics::new());
        let shares = Arc::new(Shares::new(
            1,
            Arc::new(Instances::new(Default::default())),
            metrics.reserved_units.clone(),
        ));
        Limiter::new(store, timeout, 1, metrics, Clock::system()).with_shares(shares)
    }

    /// No share is taken before the listener has started: its start sets aside every share
    /// held, and units set aside wait for the next tick, neither usable nor back in the row (a
    /// flood right after start was denied early on one instance with budget left). A request
    /// waits for the listener within its budget, then takes a share; past the budget it is
    /// counted per request.
    #[tokio::test]
    async fn no_share_is_taken_before_the_listener_has_started() {
        let store = Arc::new(SlowGrants {
            delay: Duration::ZERO,
            units: 10,
            calls: AtomicUsize::new(0),
        });
        let plans = [PlannedLimit {
            reserve: true,
            ..plan("k:ip", 1000, 3600, false)
        }];
        let mut outcomes = Outcomes::new();
        let waiting = unsettled(store.clone(), Duration::from_secs(5));
        let shares = waiting.shares().expect("shares");
        let listener = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(
                store.calls.load(Ordering::SeqCst),
                0,
                "a share before the listener"
            );
            shares.on_event(crate::store::ResetEvent::Missed);
        };
        let (verdict, ()) = tokio::join!(waiting.decide(0, &plans, &mut outcomes), listener);
        assert!(matches!(verdict, Verdict::Allow { .. }), "{verdict:?}");
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            1,
            "a share once it listens"
        );
        let silent = unsettled(store.clone(), Duration::from_millis(50));
        let verdict = silent.decide(0, &plans, &mut outcomes).await;
        assert!(
            matches!(verdict, Verdict::Allow { .. }),
            "counted per request: {verdict:?}"
        );
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            1,
            "no share from a silent listener"
        );
    }

    /// A request cancelled while its grant is under way (its client went away) leaves neither
    /// the bucket stuck behind a grant that never ends, nor the units it asked for lost: the
    /// next request is admitted from them at once, without another grant.
    #[tokio::test]
    async fn a_grant_outlives_the_request_that_asked_for_it() {
        let store = Arc::new(SlowGrants {
            delay: Duration::from_millis(100),
            units: 10,
            calls: AtomicUsize::new(0),
        });
        let limiter = limiter(store.clone());
        let plans = [PlannedLimit {
            reserve: true,
            ..plan("k:ip", 1000, 3600, false)
        }];
        let mut outcomes = Outcomes::new();
        let first = limiter.decide(0, &plans, &mut outcomes);
        // Started (the grant is sent), then dropped.
        assert!(tokio::time::timeout(Duration::from_millis(20), first)
            .await
            .is_err());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let second = limiter.decide(0, &plans, &mut outcomes);
        let verdict = tokio::time::timeout(Duration::from_secs(1), second)
            .await
            .expect("the bucket is stuck behind the cancelled request's grant");
        assert!(matches!(verdict, Verdict::Allow { .. }), "{verdict:?}");
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            1,
            "the granted units were kept"
        );
        assert_eq!(
            outcomes[0].remaining(),
            1000 - 10 + 9,
            "r: the row's rest and 9 unused"
        );
    }
}
