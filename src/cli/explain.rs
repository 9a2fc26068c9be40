//! `tollgate explain`: what the proxy would do with one request, read from the configuration
//! and the store's current counts (docs/operations.md, "Explain").

use std::process::ExitCode;
use std::sync::Arc;

use crate::config::Config;
use crate::key::BucketHasher;
use crate::limit::PlannedLimit;
use crate::store::{Increment, Peeked, Store};

use super::output::{say, units_text, Out};
use super::request::{
    command_store, plan_and_say_route, request_of, say_not_applying, StoreProblem,
};
use super::RequestArgs;

/// `tollgate explain`: the route, limits and buckets of a request, their counts in the store,
/// and whether it would be allowed now; reads, never increments.
pub async fn explain(out: &mut Out<'_>, config: Config, args: &RequestArgs) -> ExitCode {
    let request = match request_of(args, "explain") {
        Ok(r) => r,
        Err(code) => return code,
    };
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let plan = match plan_and_say_route(&config, &hasher, args.ip, &request, "explain", out) {
        Ok(plan) => plan,
        Err(code) => return code,
    };
    // What the store says, or why it says nothing: either way every limit and its bucket is
    // shown, since those come from the configuration alone (issue 19).
    let planned: Vec<&PlannedLimit> = plan.planned().collect();
    let counts = if planned.is_empty() {
        Ok(Vec::new())
    } else {
        explain_counts(&config, &hasher, &planned, out).await
    };
    let (mut counts, problem) = match counts {
        Ok(counts) => (counts.into_iter(), None),
        Err(problem) => {
            let kind = if config.store.url.is_some() {
                "postgres"
            } else {
                "memory"
            };
            say!(out, "store       {kind}: {}", problem.line);
            (Vec::new().into_iter(), Some(problem))
        }
    };
    let mut would_allow = true;
    for (limit, planned) in plan.limits() {
        let Some(planned) = planned else {
            say_not_applying(limit, &request.headers, out);
            continue;
        };
        let head = format!(
            "limit       {}{}: {} per {}s{}{}, bucket {}",
            planned.policy,
            if planned.shadow { " (shadow)" } else { "" },
            planned.requests,
            planned.window_secs,
            if planned.sliding { " sliding" } else { "" },
            units_text(limit),
            planned.bucket,
        );
        let Some(peeked) = counts.next() else {
            say!(out, "{head}, count unknown");
            continue;
        };
        let (standing, fits) = standing(planned, &peeked);
        if !fits && !planned.shadow {
            would_allow = false;
        }
        say!(
            out,
            "{head}, {standing}, window resets in {}s -> {}",
            crate::limit::seconds_until(peeked.now_ms, peeked.window_end_ms),
            if fits { "within" } else { "exceeded" }
        );
    }
    if let Some(problem) = problem {
        say!(out, "decision    unknown: the counters could not be read");
        eprintln!(
            "tollgate explain: cannot read the counters: {}",
            problem.cause
        );
        return ExitCode::from(1);
    }
    say!(
        out,
        "decision    {}",
        if would_allow {
            "allowed"
        } else {
            "limited (429)"
        }
    );
    ExitCode::SUCCESS
}

/// `explain`'s one read of the counters of `planned` (one round trip), in that order, and
/// the `store` line that says where they come from. The memory store's counts live in the
/// running process: a fresh one here reads 0.
async fn explain_counts(
    config: &Config,
    hasher: &BucketHasher,
    planned: &[&PlannedLimit],
    out: &mut Out<'_>,
) -> Result<Vec<Peeked>, StoreProblem> {
    let (store, line): (Arc<dyn Store>, &str) = match &config.store.url {
        Some(_) => (
            command_store(config, hasher).await?,
            "store       postgres: counts as the database has them now",
        ),
        None => (
            Arc::new(crate::store::memory::MemoryStore::new()),
            "store       memory: counts live inside the running process; shown as 0 here",
        ),
    };
    let probe: Vec<Increment> = planned
        .iter()
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
        Ok(peeked) if peeked.len() == probe.len() => {
            say!(out, "{line}");
            Ok(peeked)
        }
        Ok(_) => Err(StoreProblem::failed("the store answered oddly")),
        Err(err) => Err(StoreProblem::failed(err)),
    }
}

/// Where one limit stands for `explain`, in units (contract §3d), and whether this request's
/// `cost` units would fit: a fixed window by its count (`count + cost <= requests`); a sliding
/// one by contract §3a's estimate `previous * (window - elapsed) / window + count + cost`, with
/// the rule the stores admit by.
fn standing(planned: &PlannedLimit, peeked: &Peeked) -> (String, bool) {
    let cost = planned.cost.max(1);
    if !planned.sliding {
        let fits = u64::from(peeked.count) + u64::from(cost) <= u64::from(planned.requests);
        let left = planned.requests.saturating_sub(peeked.count);
        return (format!("count {}, {left} left", peeked.count), fits);
    }
    let len_ms = i64::from(planned.window_secs) * 1000;
    let left_ms = (peeked.window_end_ms - peeked.now_ms).clamp(0, len_ms);
    let weighs = crate::limit::weighted_previous(peeked.previous, left_ms, len_ms);
    let estimate = weighs + f64::from(peeked.count) + f64::from(cost);
    let fits = crate::store::memory::sliding_admits(
        planned.requests,
        peeked.previous,
        peeked.count,
        cost,
        left_ms,
        len_ms,
    ) == cost;
    (
        format!(
            "count {}, previous window {} (weighs {weighs:.2}), estimate {estimate:.2} with this request",
            peeked.count, peeked.previous
        ),
        fits,
    )
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
        assert_eq!(
            standing(&planned(5, false), &peeked(4, 0, 0, 60_000)),
            ("count 4, 1 left".to_owned(), true)
        );
        assert_eq!(
            standing(&planned(5, false), &peeked(5, 0, 0, 60_000)),
            ("count 5, 0 left".to_owned(), false)
        );
    }

    #[test]
    fn a_sliding_window_weighs_the_previous_one() {
        // Half-way through the window, 4 from the previous window weigh 2: 2 + 2 + 1 = 5 fits 5.
        let (text, fits) = standing(&planned(5, true), &peeked(2, 4, 30_000, 60_000));
        assert!(fits, "{text}");
        assert!(text.contains("weighs 2.00"), "{text}");
        assert!(text.contains("estimate 5.00"), "{text}");
        // One more in the current window passes 5.
        let (text, fits) = standing(&planned(5, true), &peeked(3, 4, 30_000, 60_000));
        assert!(!fits, "{text}");
    }
}
