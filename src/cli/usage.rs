//! `tollgate usage`: `explain`'s reading of one request as one JSON object on stdout, for
//! scripts, dashboards and support tools (contract §3e; docs/operations.md, "Read a bucket's
//! usage from a script").

use std::process::ExitCode;

use crate::config::Config;

use super::output::{say, Out};
use super::reading::{read, Counts, LimitReading};
use super::request::Planned;
use super::RequestArgs;

/// `tollgate usage`: `{"route": NAME, "limits": [...]}`, one object per limit that applies.
/// A request that matches no route, or that the proxy answers itself, is `"route": null`
/// with no limits (exit 0, as `explain`); counts that cannot be read print nothing on stdout
/// and exit 1 with one line on stderr.
pub async fn usage(out: &mut Out<'_>, config: Config, args: &RequestArgs) -> ExitCode {
    let reading = match read(&config, args, "usage").await {
        Ok(reading) => reading,
        Err(code) => return code,
    };
    let route = match &reading.planned.planned {
        Planned::Route(plan) => Some(config.routes[plan.route].name.as_str()),
        Planned::Refused(_) | Planned::NoRoute => None,
    };
    let readings = match &reading.counts {
        Counts::Unread => &[][..],
        Counts::Read(readings) => &readings[..],
        Counts::Failed(problem) => {
            eprintln!(
                "tollgate usage: cannot read the counters: {}",
                problem.cause
            );
            return ExitCode::from(1);
        }
    };
    say!(out, "{}", usage_json(route, readings));
    ExitCode::SUCCESS
}

/// The one JSON object, its fields in the contract's order (serde_json's own maps would sort
/// them), strings escaped by serde_json.
fn usage_json(route: Option<&str>, readings: &[LimitReading]) -> String {
    let route = route.map_or(serde_json::Value::Null, serde_json::Value::from);
    let limits: Vec<String> = readings.iter().map(limit_json).collect();
    format!(r#"{{"route":{route},"limits":[{}]}}"#, limits.join(","))
}

/// One limit's object: `used` is a whole count for a fixed window, and for a sliding one the
/// estimate to two decimals.
fn limit_json(r: &LimitReading) -> String {
    let l = &r.limit;
    let (algorithm, used) = if l.sliding {
        (
            "sliding",
            serde_json::Value::from((r.used * 100.0).round() / 100.0),
        )
    } else {
        ("fixed", serde_json::Value::from(r.count))
    };
    format!(
        r#"{{"policy":{},"bucket":{},"requests":{},"window":{},"algorithm":"{algorithm}","used":{used},"left":{},"reset":{},"override":{}}}"#,
        serde_json::Value::from(&*l.policy),
        serde_json::Value::from(&*l.bucket),
        l.requests,
        l.window_secs,
        r.left,
        r.reset_secs,
        r.overridden,
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::{json, Value};

    use super::*;
    use crate::limit::PlannedLimit;

    fn reading(policy: &str, sliding: bool, used: f64) -> LimitReading {
        LimitReading {
            limit: PlannedLimit {
                policy: Arc::from(policy),
                bucket: Arc::from(format!("{policy}:ab12")),
                requests: 5,
                window_secs: 60,
                shadow: false,
                sliding,
                reserve: false,
                cost: 1,
                charged_after: false,
            },
            overridden: false,
            count: 2,
            previous: 3,
            weighs: used - 2.0,
            used,
            left: 1,
            fits: true,
            reset_secs: 17,
        }
    }

    fn parsed(route: Option<&str>, readings: &[LimitReading]) -> Value {
        let text = usage_json(route, readings);
        assert!(!text.contains('\n'), "one line: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    #[test]
    fn every_limit_is_an_object_of_the_contracts_fields() {
        let value = parsed(
            Some("api"),
            &[
                reading("api:ip", false, 2.0),
                reading("api:ip", true, 3.333),
            ],
        );
        assert_eq!(
            value,
            json!({"route": "api", "limits": [
                {"policy": "api:ip", "bucket": "api:ip:ab12", "requests": 5, "window": 60,
                 "algorithm": "fixed", "used": 2, "left": 1, "reset": 17, "override": false},
                {"policy": "api:ip", "bucket": "api:ip:ab12", "requests": 5, "window": 60,
                 "algorithm": "sliding", "used": 3.33, "left": 1, "reset": 17, "override": false},
            ]})
        );
        // A fixed window's count is a whole number.
        assert!(value["limits"][0]["used"].is_u64());
    }

    #[test]
    fn no_route_is_null_and_names_are_escaped() {
        assert_eq!(parsed(None, &[]), json!({"route": null, "limits": []}));
        let odd = "a\"b\\c\u{1}";
        let value = parsed(Some(odd), &[reading(odd, false, 2.0)]);
        assert_eq!(value["route"], odd);
        assert_eq!(value["limits"][0]["policy"], odd);
    }
}
