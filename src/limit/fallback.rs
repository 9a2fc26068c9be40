//! The local fallback of `on_error = "local"` (contract §5b): while the store fails, each instance
//! counts in memory, with the store's windows and buckets, against `ceil(requests / instances)`,
//! `instances` being how many tollgate instances were live on the database when it last
//! answered.
//!
//! - [`Instances`] is that count, and the `tollgate_instances` gauge. [`Registration`]
//!   refreshes this instance's row in `tollgate_instances` every [`REFRESH_EVERY`] and
//!   updates the count from the same statement (the database's clock decides who is live:
//!   a row refreshed within 30 s). While the database does not answer, the last count stays.
//!   A clean stop deletes the row ([`Registration::end`]), so the others count one fewer at
//!   their next refresh; a crashed instance stays counted until its row is 30 s old.
//! - [`LocalFallback`] decides: a [`MemoryStore`] (the same fixed windows, bounded by
//!   `store.memory_buckets` like the memory store, least recently used forgotten first) and
//!   the quota per instance. It announces the switch once in the log when the first request
//!   is decided locally, and the way back once when the store decides again (the limiter
//!   tells it: the breaker's recovery is the one that already exists in `limit.rs`).
//!
//! What was counted locally is not written back: when the database answers, its counts are
//! the truth again (contract §5b). Across `n` live instances that each admit
//! `ceil(requests / n)`, at most `requests + n - 1` requests per bucket and window get through
//! during an outage, whatever the load balancer does, plus what the database had already
//! admitted in that window before it failed.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::limit::{increments, judge, LimitOutcome, Outcomes, PlannedLimit, Plans, Verdict};
use crate::metrics::MemoryStoreMetrics;
use crate::store::memory::MemoryStore;
use crate::store::Store;
use crate::store::{Charge, InstanceRegistry};

/// How often an instance refreshes its registry row. Well inside the 30 s liveness bound, so
/// a few failed refreshes in a row do not make a live instance look dead.
pub const REFRESH_EVERY: Duration = Duration::from_secs(3);

/// How many instances are live on the database, as last seen (at least 1).
#[derive(Debug)]
pub struct Instances {
    live: AtomicU32,
    gauge: Gauge,
}

impl Instances {
    /// One instance (this one) until the database says otherwise; `gauge` shows the count.
    pub fn new(gauge: Gauge) -> Self {
        gauge.set(1);
        Instances {
            live: AtomicU32::new(1),
            gauge,
        }
    }

    pub fn live(&self) -> u32 {
        self.live.load(Ordering::Acquire).max(1)
    }

    pub fn set(&self, live: u32) {
        let live = live.max(1);
        self.live.store(live, Ordering::Release);
        self.gauge.set(i64::from(live));
    }
}

/// How long a clean stop spends deregistering at most: the refresh under way finishing, then
/// the delete. Short, because a dead database must not hold up the shutdown; past it, the row
/// is simply left to age out like a crashed instance's.
pub const DEREGISTER_WITHIN: Duration = Duration::from_secs(1);

/// This instance's place in the registry (contract §5b), from [`Registration::start`] until
/// [`Registration::end`]. Dropped without `end`, it stops refreshing and leaves the row to
/// age out, as a crashed instance's does.
pub struct Registration {
    pg: Arc<dyn InstanceRegistry>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Registration {
    /// Starts [`keep_registered`] on the current runtime.
    pub fn start(pg: Arc<dyn InstanceRegistry>, instances: Arc<Instances>) -> Self {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(keep_registered(pg.clone(), instances, stopped));
        Registration { pg, stop, task }
    }

    /// A clean stop: no more refreshes, and this instance's row deleted, so the other
    /// instances' count (and their local quota) reflects it at their next refresh rather than
    /// when the row ages out 30 s later. Takes at most [`DEREGISTER_WITHIN`]; a database that
    /// does not answer by then keeps the row, which then ages out as a crashed instance's does.
    pub async fn end(mut self) {
        let deadline = tokio::time::Instant::now() + DEREGISTER_WITHIN;
        let _ = self.stop.send(true);
        // A refresh under way finishes first: sent after the delete, its upsert would put the
        // row back.
        if tokio::time::timeout_at(deadline, &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
        if !self.pg.registry_ready() {
            // Never initialized, so never registered: nothing to delete.
            return;
        }
        match tokio::time::timeout_at(deadline, self.pg.deregister_instance()).await {
            Ok(Ok(_)) => tracing::info!("deregistered from tollgate_instances"),
            Ok(Err(err)) => tracing::warn!(
                error = %err,
                "cannot delete this instance's row in tollgate_instances; the other instances \
                 count it as live until it is 30 s old"
            ),
            Err(_) => tracing::warn!(
                "no answer deleting this instance's row in tollgate_instances within {:?}; the \
                 other instances count it as live until it is 30 s old",
                DEREGISTER_WITHIN
            ),
        }
    }
}

/// Keeps this instance registered (contract §5b) until `stop` turns true: a refresh every
/// [`REFRESH_EVERY`] once the store is initialized, the live count into `instances`. A failed
/// refresh keeps the last count; the first failure after a success is logged as a warning.
/// A refresh under way when `stop` turns is finished, never cut (see [`Registration::end`]).
pub async fn keep_registered(
    pg: Arc<dyn InstanceRegistry>,
    instances: Arc<Instances>,
    mut stop: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(REFRESH_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            // Stopped, or the sender is gone: either way, no more refreshes.
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        if !pg.registry_ready() {
            continue;
        }
        match pg.refresh_instance().await {
            Ok(live) => {
                if live != instances.live() {
                    tracing::info!(instances = live, "live tollgate instances on the database");
                }
                instances.set(live);
                if failing {
                    tracing::info!(instances = live, "instance registry refreshed again");
                }
                failing = false;
            }
            Err(err) => {
                if !failing {
                    tracing::warn!(
                        error = %err,
                        instances = instances.live(),
                        "cannot refresh this instance's row in tollgate_instances; the local \
                         fallback keeps dividing by the last count"
                    );
                }
                failing = true;
            }
        }
    }
}

/// `ceil(requests / instances)`, at least 1: every live instance may admit that many alone.
/// A limit of 0 (an override that blocks a subject, contract §3e) stays 0.
pub fn local_quota(requests: u32, instances: u32) -> u32 {
    if requests == 0 {
        return 0;
    }
    requests.div_ceil(instances.max(1)).max(1)
}

/// The in-memory limiter used while the store fails, for routes whose policy is `local`.
pub struct LocalFallback {
    counts: MemoryStore,
    instances: Arc<Instances>,
    /// Whether requests are being decided here now (for the transition log lines).
    active: AtomicBool,
}

impl LocalFallback {
    /// Counts in at most `buckets` buckets (`store.memory_buckets`).
    pub fn new(buckets: NonZeroUsize, instances: Arc<Instances>) -> Self {
        LocalFallback {
            // Its own series: the memory store's gauges stay about the memory store.
            counts: MemoryStore::bounded(buckets, MemoryStoreMetrics::default()),
            instances,
            active: AtomicBool::new(false),
        }
    }

    pub fn instances(&self) -> &Arc<Instances> {
        &self.instances
    }

    /// Counts `plans` here and judges them against the local quotas. The outcomes carry the
    /// local quota as `requests`, so the rate-limit fields a client sees are those of the
    /// limit it is held to now; a sliding limit's estimate is judged against it too.
    /// `outcomes` as for [`crate::limit::Limiter::decide`].
    pub async fn decide(&self, plans: &[PlannedLimit], outcomes: &mut Outcomes) -> Verdict {
        outcomes.clear();
        let instances = self.instances.live();
        if !self.active.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                instances,
                "rate-limit store failing: routes with on_store_error = \"local\" are limited by \
                 each instance alone, at ceil(requests / {instances}), until it answers again"
            );
        }
        // The plans as this instance alone holds them: each limit at its local quota.
        let local: Plans = plans
            .iter()
            .map(|plan| PlannedLimit {
                requests: local_quota(plan.requests, instances),
                ..plan.clone()
            })
            .collect();
        let counted = match self.counts.increment(&increments(&local)).await {
            Ok(counted) if counted.len() == local.len() => counted,
            // Only a zero-second window fails here, which validation rules out.
            _ => return Verdict::StoreFailed,
        };
        outcomes.extend(
            local
                .iter()
                .zip(&counted)
                .map(|(plan, c)| LimitOutcome::counted(plan, c)),
        );
        judge(outcomes)
    }

    /// Charges after a response (contract §3d) of a request decided here, each saturating at
    /// its limit's local quota.
    pub async fn charge(&self, charges: &[Charge]) {
        let instances = self.instances.live();
        let local: Vec<Charge> = charges
            .iter()
            .map(|c| Charge {
                requests: local_quota(c.requests, instances),
                ..c.clone()
            })
            .collect();
        // Only a zero-second window fails here, which validation rules out.
        let _ = self.counts.charge(&local).await;
    }

    /// The store decided a request again: if requests were being decided here, say once that
    /// counting is back in the database.
    pub fn store_answered(&self) {
        if self.active.load(Ordering::Acquire) && self.active.swap(false, Ordering::AcqRel) {
            tracing::warn!(
                "rate-limit store answers again: local limiting ended, counting in the database"
            );
        }
    }

    /// Whether requests are being decided here now.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quota_is_shared_out_rounding_up() {
        assert_eq!(local_quota(5, 2), 3);
        assert_eq!(local_quota(6, 2), 3);
        assert_eq!(local_quota(1, 3), 1);
        assert_eq!(local_quota(10, 1), 10);
        assert_eq!(local_quota(10, 0), 10, "never divides by zero");
        assert_eq!(local_quota(0, 3), 0, "a blocked subject stays blocked");
    }

    fn plan(requests: u32, sliding: bool) -> Vec<PlannedLimit> {
        vec![PlannedLimit {
            policy: Arc::from("api:ip"),
            bucket: Arc::from("api:ip:abc"),
            requests,
            window_secs: 3600,
            shadow: false,
            sliding,
            reserve: false,
            cost: 1,
            charged_after: false,
        }]
    }

    /// A sliding limit's estimate is judged against the local quota, not the limit: with
    /// no previous window, exactly ceil(5 / 2) of ten are admitted.
    #[tokio::test]
    async fn a_sliding_limit_admits_its_local_share() {
        let instances = Arc::new(Instances::new(Gauge::default()));
        instances.set(2);
        let local = LocalFallback::new(NonZeroUsize::MIN.saturating_add(99), instances);
        let plans = plan(5, true);
        let mut allowed = 0;
        let mut outcomes = Outcomes::new();
        for _ in 0..10 {
            if let Verdict::Allow { .. } = local.decide(&plans, &mut outcomes).await {
                allowed += 1;
                assert_eq!(outcomes[0].requests, 3, "the local quota");
            }
        }
        assert_eq!(allowed, 3);
    }

    #[tokio::test]
    async fn each_instance_admits_its_share_and_says_so_in_the_fields() {
        let instances = Arc::new(Instances::new(Gauge::default()));
        instances.set(2);
        let local = LocalFallback::new(NonZeroUsize::MIN.saturating_add(99), instances);
        let plans = plan(5, false);
        let mut allowed = 0;
        let mut outcomes = Outcomes::new();
        for _ in 0..10 {
            match local.decide(&plans, &mut outcomes).await {
                Verdict::Allow { .. } => {
                    allowed += 1;
                    assert_eq!(outcomes[0].requests, 3, "the local quota");
                }
                Verdict::Deny { retry_after, .. } => {
                    assert!(retry_after >= 1);
                    assert_eq!(outcomes[0].requests, 3, "a denial's fields too");
                }
                Verdict::StoreFailed => panic!("memory cannot fail"),
            }
        }
        assert_eq!(allowed, 3);
        assert!(local.is_active());
        local.store_answered();
        assert!(!local.is_active());
    }
}
