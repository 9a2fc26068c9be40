//! What `explain` and `usage` both tell about one request: the route and limits the proxy
//! would give it ([`plan_request`], the proxy's own `plan()`) and where each limit that applies
//! stands in the store now. One reading, two renderings (text and JSON), so that the two
//! commands cannot disagree.

use std::process::ExitCode;
use std::sync::Arc;

use crate::config::Config;
use crate::key::BucketHasher;
use crate::limit::overrides::Overrides;
use crate::limit::PlannedLimit;
use crate::store::{Increment, Peeked, Store};

use super::request::{
    command_store, plan_request, request_of, CommandPlan, CommandRequest, Planned, PlannedRequest,
    StoreProblem,
};
use super::RequestArgs;

/// One request as `explain` and `usage` read it.
pub struct Reading {
    pub request: CommandRequest,
    pub planned: PlannedRequest,
    pub counts: Counts,
}

/// What the store said about the limits that apply.
pub enum Counts {
    /// Nothing to read: no route, a request the proxy refuses, or no limit that applies.
    Unread,
    /// One reading per limit that applies, in plan order.
    Read(Vec<LimitReading>),
    /// The store could not be read.
    Failed(StoreProblem),
}

/// Where one limit that applies stands now, in units (contract §3d), before this request.
#[derive(Debug, Clone)]
pub struct LimitReading {
    /// The limit as planned; `requests` is the override's when one applies (contract §3e).
    pub limit: PlannedLimit,
    /// Whether an override set `requests`.
    pub overridden: bool,
    /// The current window's count.
    pub count: u32,
    /// The previous window's count (0 for a fixed window, which does not read it).
    pub previous: u32,
    /// `previous * (window - elapsed) / window` (contract §3a); 0 for a fixed window.
    pub weighs: f64,
    /// Units used: the count, or for a sliding limit the estimate `weighs + count`.
    pub used: f64,
    /// Units left: the rate-limit headers' `r` (at least 0).
    pub left: u32,
    /// Whether this request's `cost` units would fit now.
    pub fits: bool,
    /// Whole seconds until the current window ends.
    pub reset_secs: u64,
}

/// Reads `args`' request: plans it, then reads the counts of the limits that apply in one
/// round trip (the memory store's counts live in the running process: a fresh one here reads
/// 0). Reads, never increments. `Err` is the exit code of a usage error of `command`, its
/// line on stderr already written.
pub async fn read(config: &Config, args: &RequestArgs, command: &str) -> Result<Reading, ExitCode> {
    let request = request_of(args, command)?;
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let file = Overrides::default();
    let mut planned = plan_request(config, &hasher, args.ip, &request, command, &file)?;
    let limits_apply = matches!(
        &planned.planned,
        Planned::Route(plan) if plan.planned().next().is_some()
    );
    if !limits_apply {
        return Ok(Reading {
            request,
            planned,
            counts: Counts::Unread,
        });
    }
    let counts = match reading_store(config, &hasher).await {
        Err(problem) => Counts::Failed(problem),
        Ok((store, overrides)) => {
            // Planned again with the overrides the running instances apply: the same plan()
            // puts them in, so `requests` here is what the proxy enforces.
            planned = plan_request(config, &hasher, args.ip, &request, command, &overrides)?;
            match &planned.planned {
                Planned::Route(plan) => read_counts(&*store, plan, &overrides).await,
                _ => Counts::Unread,
            }
        }
    };
    Ok(Reading {
        request,
        planned,
        counts,
    })
}

/// The store to read the counts from, and the overrides in force in it (contract §3e; the
/// memory store has none: they need the database).
async fn reading_store(
    config: &Config,
    hasher: &BucketHasher,
) -> Result<(Arc<dyn Store>, Overrides), StoreProblem> {
    if config.store.url.is_none() {
        let memory = Arc::new(crate::store::memory::MemoryStore::new());
        return Ok((memory, Overrides::default()));
    }
    let pg = command_store(config, hasher).await?;
    let overrides = Overrides::default();
    overrides.replace(pg.load_overrides().await.map_err(StoreProblem::failed)?);
    Ok((pg, overrides))
}

/// The store's counts of `plan`'s limits, each read against its `requests`.
async fn read_counts(store: &dyn Store, plan: &CommandPlan, overrides: &Overrides) -> Counts {
    let probe: Vec<Increment> = plan
        .planned()
        .map(|p| Increment {
            bucket: p.bucket.clone(),
            window_secs: p.window_secs,
            by: 0,
            sliding: None,
            enforce: None,
            check: false,
        })
        .collect();
    match store.peek(&probe).await {
        Ok(peeked) if peeked.len() == probe.len() => Counts::Read(
            plan.planned()
                .zip(&peeked)
                .map(|(planned, peeked)| {
                    let overridden = overrides.requests(&planned.bucket).is_some();
                    limit_reading(planned, peeked, overridden)
                })
                .collect(),
        ),
        Ok(_) => Counts::Failed(StoreProblem::failed("the store answered oddly")),
        Err(err) => Counts::Failed(StoreProblem::failed(err)),
    }
}

/// Where `planned` stands on `peeked`, and whether this request's `cost` units would fit: a
/// fixed window by its count (`count + cost <= requests`); a sliding one by contract §3a's
/// estimate, with the rule the stores admit by.
fn limit_reading(planned: &PlannedLimit, peeked: &Peeked, overridden: bool) -> LimitReading {
    let limit = planned.clone();
    let cost = limit.cost.max(1);
    let reset_secs = crate::limit::seconds_until(peeked.now_ms, peeked.window_end_ms);
    let mut reading = LimitReading {
        overridden,
        count: peeked.count,
        previous: 0,
        weighs: 0.0,
        used: f64::from(peeked.count),
        left: limit.requests.saturating_sub(peeked.count),
        fits: u64::from(peeked.count) + u64::from(cost) <= u64::from(limit.requests),
        reset_secs,
        limit,
    };
    if !reading.limit.sliding {
        return reading;
    }
    let requests = reading.limit.requests;
    let len_ms = i64::from(reading.limit.window_secs) * 1000;
    let left_ms = (peeked.window_end_ms - peeked.now_ms).clamp(0, len_ms);
    let weighs = crate::limit::weighted_previous(peeked.previous, left_ms, len_ms);
    reading.previous = peeked.previous;
    reading.weighs = weighs;
    reading.used = weighs + f64::from(peeked.count);
    reading.left = crate::limit::sliding_left(requests, weighs, peeked.count);
    reading.fits = crate::store::memory::sliding_admits(
        requests,
        peeked.previous,
        peeked.count,
        cost,
        left_ms,
        len_ms,
    ) == cost;
    reading
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(requests: u32, sliding: bool) -> PlannedLimit {
        PlannedLimit {
            policy: Arc::from("login:ip"),
            bucket: Arc::from("login:ip:00"),
            requests,
            window_secs: 60,
            shadow: false,
            sliding,
            reserve: false,
            cost: 1,
            charged_after: false,
        }
    }

    fn peeked(count: u32, previous: u32, now_ms: i64, window_end_ms: i64) -> Peeked {
        Peeked {
            count,
            previous,
            now_ms,
            window_end_ms,
        }
    }

    #[test]
    fn a_fixed_window_fits_while_one_more_stays_within() {
        let r = limit_reading(&planned(5, false), &peeked(4, 9, 0, 60_000), false);
        assert_eq!((r.count, r.used, r.left, r.fits), (4, 4.0, 1, true));
        assert_eq!((r.previous, r.reset_secs, r.overridden), (0, 60, false));
        let r = limit_reading(&planned(5, false), &peeked(5, 0, 0, 60_000), false);
        assert_eq!((r.used, r.left, r.fits), (5.0, 0, false));
        // A fixed window's count may include denied requests: more used than allowed.
        let r = limit_reading(&planned(5, false), &peeked(7, 0, 59_500, 60_000), false);
        assert_eq!((r.used, r.left, r.fits, r.reset_secs), (7.0, 0, false, 1));
    }

    #[test]
    fn a_sliding_window_weighs_the_previous_one() {
        // Half-way through the window, 4 from the previous window weigh 2: 2 + 2 used, and
        // one more fits 5.
        let r = limit_reading(&planned(5, true), &peeked(2, 4, 30_000, 60_000), false);
        assert_eq!((r.weighs, r.used, r.left, r.fits), (2.0, 4.0, 1, true));
        assert_eq!((r.previous, r.reset_secs), (4, 30));
        // One more in the current window passes 5.
        let r = limit_reading(&planned(5, true), &peeked(3, 4, 30_000, 60_000), false);
        assert_eq!((r.used, r.left, r.fits), (5.0, 0, false));
        // 3 of the previous window weigh 1.5: 3.5 used, floor(1.5) left.
        let r = limit_reading(&planned(5, true), &peeked(2, 3, 30_000, 60_000), false);
        assert_eq!((r.used, r.left, r.fits), (3.5, 1, true));
    }
}
