//! `tollgate explain`: what the proxy would do with one request, read from the configuration
//! and the store's current counts (docs/operations.md, "Explain").

use std::process::ExitCode;

use crate::config::Config;
use crate::limit::PlannedLimit;

use super::output::{say, units_text, Out};
use super::reading::{read, Counts, LimitReading};
use super::request::{say_not_applying, say_planned, CommandPlan, Planned, StoreProblem};
use super::RequestArgs;

/// `tollgate explain`: the route, limits and buckets of a request, their counts in the store,
/// and whether it would be allowed now; reads, never increments. What it reads is `usage`'s
/// reading too ([`read`]).
pub async fn explain(out: &mut Out<'_>, config: Config, args: &RequestArgs) -> ExitCode {
    let reading = match read(&config, args, "explain").await {
        Ok(reading) => reading,
        Err(code) => return code,
    };
    if let Err(code) = say_planned(&config, &reading.planned, out) {
        return code;
    }
    let Planned::Route(plan) = &reading.planned.planned else {
        return ExitCode::SUCCESS;
    };
    // What the store says, or why it says nothing: either way every limit and its bucket is
    // shown, since those come from the configuration alone (issue 19).
    let (readings, problem) = say_store(&config, &reading.counts, out);
    let would_allow = say_limits(plan, &reading.request.headers, readings, out);
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

/// The `store` line: where the counts come from, or why there are none. Returns the
/// readings, and the problem that kept them from being read.
fn say_store<'r>(
    config: &Config,
    counts: &'r Counts,
    out: &mut Out<'_>,
) -> (&'r [LimitReading], Option<&'r StoreProblem>) {
    // The memory store's counts live in the running process: a fresh one here reads 0.
    let (kind, read_line) = match config.store.url {
        Some(_) => ("postgres", "counts as the database has them now"),
        None => (
            "memory",
            "counts live inside the running process; shown as 0 here",
        ),
    };
    match counts {
        Counts::Unread => (&[], None),
        Counts::Read(readings) => {
            say!(out, "store       {kind}: {read_line}");
            (readings, None)
        }
        Counts::Failed(problem) => {
            say!(out, "store       {kind}: {}", problem.line);
            (&[], Some(problem))
        }
    }
}

/// One `limit` line per limit of the route, in the file's order, with its reading (in plan
/// order) where it applies. Returns whether every enforced limit would let the request in.
fn say_limits(
    plan: &CommandPlan,
    headers: &http::HeaderMap,
    readings: &[LimitReading],
    out: &mut Out<'_>,
) -> bool {
    let mut readings = readings.iter();
    let mut would_allow = true;
    for (limit, planned) in plan.limits() {
        let Some(planned) = planned else {
            say_not_applying(limit, headers, out);
            continue;
        };
        let units = units_text(limit);
        let Some(r) = readings.next() else {
            say!(out, "{}, count unknown", head(planned, false, &units));
            continue;
        };
        if !r.fits && !r.limit.shadow {
            would_allow = false;
        }
        say!(
            out,
            "{}, {}, window resets in {}s -> {}",
            head(&r.limit, r.overridden, &units),
            standing(r),
            r.reset_secs,
            if r.fits { "within" } else { "exceeded" }
        );
    }
    would_allow
}

/// `limit       POLICY: N per Ws sliding cost 3, bucket B`: the limit as it applies, `N`
/// marked when an override set it (contract §3e).
fn head(l: &PlannedLimit, overridden: bool, units: &str) -> String {
    format!(
        "limit       {}{}: {}{} per {}s{}{}, bucket {}",
        l.policy,
        if l.shadow { " (shadow)" } else { "" },
        l.requests,
        if overridden { " (override)" } else { "" },
        l.window_secs,
        if l.sliding { " sliding" } else { "" },
        units,
        l.bucket,
    )
}

/// Where a limit stands, in units (contract §3d): a fixed window's count and units left; a
/// sliding one's counts and contract §3a's estimate with this request's `cost` units.
fn standing(r: &LimitReading) -> String {
    if !r.limit.sliding {
        return format!("count {}, {} left", r.count, r.left);
    }
    let estimate = r.used + f64::from(r.limit.cost.max(1));
    format!(
        "count {}, previous window {} (weighs {:.2}), estimate {estimate:.2} with this request",
        r.count, r.previous, r.weighs
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn reading(sliding: bool, count: u32, previous: u32, weighs: f64) -> LimitReading {
        LimitReading {
            limit: PlannedLimit {
                policy: Arc::from("login:ip"),
                bucket: Arc::from("login:ip:00"),
                requests: 5,
                window_secs: 60,
                shadow: false,
                sliding,
                reserve: false,
                cost: 1,
                charged_after: false,
            },
            overridden: false,
            count,
            previous,
            weighs,
            used: weighs + f64::from(count),
            left: 1,
            fits: true,
            reset_secs: 30,
        }
    }

    #[test]
    fn a_fixed_window_shows_its_count_and_what_is_left() {
        assert_eq!(standing(&reading(false, 4, 0, 0.0)), "count 4, 1 left");
    }

    #[test]
    fn a_sliding_window_shows_the_estimate_with_this_request() {
        assert_eq!(
            standing(&reading(true, 2, 4, 2.0)),
            "count 2, previous window 4 (weighs 2.00), estimate 5.00 with this request"
        );
    }

    #[test]
    fn the_head_says_when_an_override_set_requests() {
        let r = reading(true, 0, 0, 0.0);
        assert_eq!(
            head(&r.limit, true, " cost 3"),
            "limit       login:ip: 5 (override) per 60s sliding cost 3, bucket login:ip:00"
        );
    }
}
