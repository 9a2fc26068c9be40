//! The step after the upstream's response head (contract §3d): the charges of the limits
//! counted after the response (`count`, `cost_header`), and the removal of the upstream's cost
//! fields before the response goes on.
//!
//! Its contract, whatever carried the request (either HTTP/1.1 server, HTTP/2, TLS, gRPC): it
//! runs once the upstream's response head has arrived and before that head goes to the
//! client, streaming bodies included (the body is not waited for); only upstream responses
//! are charged (tollgate's own answers never reach it); a limit's charge is its `cost`, or the
//! value of its `cost_header` field (0 to `requests`, more charges `requests`; missing or
//! malformed: `cost`, with a warning at most once a second), when its `count` takes the
//! response's status. The cost fields of every limit of the route are removed, charged or not.
//! The charges of one response go to the store together ([`crate::limit::Limiter::charge`]).

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, StatusCode};
use smallvec::SmallVec;

use super::plan::RouteRules;
use crate::config::{Counting, LimitConfig};
use crate::limit::{PlannedLimit, INLINE_LIMITS};
use crate::log_gate::LogGate;
use crate::store::Charge;

/// One response's charges.
pub type Charges = SmallVec<[Charge; INLINE_LIMITS]>;

/// What a limit's `cost_header` field said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reported {
    /// A whole number of units (saturated at `u32::MAX`).
    Units(u32),
    /// Absent, repeated, or not a whole number.
    Unusable,
}

/// The charges that a response of `status` with fields `headers` makes for `plans` (the
/// request's limits of the route `rules`), its cost fields taken out of `headers`. `gate`: the
/// warnings about unusable cost fields, at most one a second.
pub fn charges_of(
    rules: &RouteRules,
    plans: &[PlannedLimit],
    status: StatusCode,
    headers: &mut HeaderMap,
    gate: &LogGate,
) -> Charges {
    let mut charges = Charges::new();
    let reported: SmallVec<[Option<Reported>; INLINE_LIMITS]> = rules
        .config
        .limits
        .iter()
        .map(|limit| {
            limit
                .cost_header
                .as_ref()
                .map(|name| take_field(headers, name))
        })
        .collect();
    for plan in plans.iter().filter(|p| p.charged_after) {
        let Some(i) = rules
            .policies
            .iter()
            .position(|p| Arc::ptr_eq(p, &plan.policy))
        else {
            continue;
        };
        let limit = &rules.config.limits[i];
        if !counts(limit, status) {
            continue;
        }
        let units = match reported[i] {
            None => plan.cost,
            Some(Reported::Units(units)) => units.min(plan.requests),
            Some(Reported::Unusable) => {
                warn_unusable(gate, &rules.config.name, &plan.policy);
                plan.cost
            }
        };
        if units > 0 {
            charges.push(Charge {
                bucket: plan.bucket.clone(),
                window_secs: plan.window_secs,
                sliding: plan.sliding,
                units,
                requests: plan.requests,
            });
        }
    }
    charges
}

/// Whether `limit` counts a response of `status`.
fn counts(limit: &LimitConfig, status: StatusCode) -> bool {
    match &limit.count {
        Counting::All => true,
        Counting::Statuses(set) => set.contains(status.as_u16()),
    }
}

/// The field `name`, removed from `headers`, read as a cost: exactly one value of ASCII
/// digits (a number past `u32::MAX` saturates: it is above any limit's `requests`).
fn take_field(headers: &mut HeaderMap, name: &http::HeaderName) -> Reported {
    let mut values = match headers.entry(name) {
        http::header::Entry::Occupied(entry) => entry.remove_entry_mult().1,
        http::header::Entry::Vacant(_) => return Reported::Unusable,
    };
    match (values.next(), values.next()) {
        (Some(value), None) => parse_units(&value),
        _ => Reported::Unusable,
    }
}

fn parse_units(value: &HeaderValue) -> Reported {
    let bytes = value.as_bytes();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return Reported::Unusable;
    }
    let units = bytes.iter().fold(0u32, |n, d| {
        n.saturating_mul(10).saturating_add(u32::from(d - b'0'))
    });
    Reported::Units(units)
}

/// The warning about a missing or malformed cost field: names the route and the limit, never
/// the value (contract §7: no header value reaches a log line).
fn warn_unusable(gate: &LogGate, route: &str, policy: &str) {
    if let Some(not_logged) = gate.due(std::time::Instant::now()) {
        tracing::warn!(
            route,
            policy,
            not_logged,
            "the upstream's cost field is missing or not a whole number: the limit's cost was charged"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cost_field_is_one_whole_number() {
        let mut headers = HeaderMap::new();
        let name = http::HeaderName::from_static("x-ratelimit-cost");
        let read = |headers: &mut HeaderMap, values: &[&'static str]| {
            for v in values {
                headers.append(&name, HeaderValue::from_static(v));
            }
            let got = take_field(headers, &name);
            assert!(!headers.contains_key(&name), "removed: {values:?}");
            got
        };
        assert_eq!(read(&mut headers, &["42"]), Reported::Units(42));
        assert_eq!(read(&mut headers, &["0"]), Reported::Units(0));
        assert_eq!(read(&mut headers, &["007"]), Reported::Units(7));
        assert_eq!(
            read(&mut headers, &["99999999999999999999"]),
            Reported::Units(u32::MAX),
            "past any limit: charged `requests`"
        );
        for bad in [
            &["-1"][..],
            &["1.5"],
            &["1e3"],
            &[""],
            &[" 3"],
            &["3", "4"],
            &[],
        ] {
            assert_eq!(read(&mut headers, bad), Reported::Unusable, "{bad:?}");
        }
    }
}
