//! The rate-limit fields of denials (docs/configuration.md, `rate_limit_headers`) on a route
//! with two limits, on the memory store and on a real PostgreSQL (a fresh database per test):
//! every 429, the store's and those the limiter answers from its cache of exhausted buckets,
//! lists one member per applicable limit, in the order the allowed responses do, and what it
//! says of the limit that did not deny is consistent with what was counted (issue 47, item 3:
//! cached denials reported that limit's whole quota, as if it had never counted).

use http::StatusCode;

use crate::common::db::TestDb;
use crate::common::ratelimit::members;
use crate::common::*;

/// The route's limits: `ip` 2 and `global` 100, in this order.
const IP: u64 = 2;
const GLOBAL: u64 = 100;
/// Requests sent: 2 allowed, the third denied by the store, the rest by the cache.
const SENT: u64 = 9;

/// Which limit the route lists first: the cache looks its limits up in that order, and stops
/// at the first exhausted one.
#[derive(Clone, Copy, PartialEq)]
enum First {
    Ip,
    Global,
}

fn config_text(store: &str, algorithm: &str, headers: &str, first: First) -> String {
    // Windows of 366 and 365 days: no boundary falls inside the test, and the two limits'
    // windows differ, so a member's `t` is its own.
    let ip = format!(
        r#"
  [[routes.limits]]
  key = "ip"
  requests = {IP}
  window = "366d"
  algorithm = "{algorithm}"
"#
    );
    let global = format!(
        r#"
  [[routes.limits]]
  key = "global"
  requests = {GLOBAL}
  window = "365d"
  algorithm = "{algorithm}"
"#
    );
    let limits = match first {
        First::Ip => ip + &global,
        First::Global => global + &ip,
    };
    let routes = format!(
        r#"
[[routes]]
name = "two"
path_prefix = "/two"
upstream = "app"
{limits}"#
    );
    limits_config(
        store,
        &format!("rate_limit_headers = \"{headers}\""),
        &routes,
    )
}

/// Decisions that reached the store (`tollgate_store_seconds` observes each one, on either
/// store); a cached denial does not.
fn store_decisions(proxy: &Proxy) -> u64 {
    let text = proxy.server().metrics().render();
    text.lines()
        .find_map(|line| line.strip_prefix("tollgate_store_seconds_count "))
        .unwrap_or_else(|| panic!("no tollgate_store_seconds_count in\n{text}"))
        .trim()
        .parse()
        .expect("a count")
}

/// The legacy field `name` as a number.
fn legacy(answer: &Answer, name: &str, context: &str) -> u64 {
    answer
        .header(name)
        .unwrap_or_else(|| panic!("{context}: no {name}"))
        .parse()
        .unwrap_or_else(|_| panic!("{context}: {name} is not an integer"))
}

/// Sends [`SENT`] requests from one client: the first two are allowed, the rest denied by
/// `ip`. Every answer lists `two:ip` and `two:global` in `RateLimit`, in the route's order,
/// with the same `RateLimit-Policy`; after `i` requests `global`'s `r` is `100 - i` while
/// allowed, and on a denial between `100 - i` (every request counted) and 98 (the two allowed
/// ones counted); `ip`'s is 0 on a denial. With `both`, the legacy fields name `ip`, the most
/// restrictive.
async fn denials_report_every_limit(
    db: Option<&TestDb>,
    algorithm: &str,
    headers: &str,
    first: First,
) {
    let upstream = Upstream::start().await;
    let store = db.map(pg_store).unwrap_or_default();
    let text = config_text(&store, algorithm, headers, first);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    if db.is_some() {
        proxy
            .until_store_ready(std::time::Duration::from_secs(10))
            .await;
        // Denials cached before the reset listener's first notification are dropped by it.
        proxy
            .until_hearing_resets(std::time::Duration::from_secs(10))
            .await;
    }
    let client = h1_client();
    let url = proxy.url("/two");
    let decided_before = store_decisions(&proxy);
    let ip_policy = format!("\"two:ip\";q={IP};w=31622400");
    let global_policy = format!("\"two:global\";q={GLOBAL};w=31536000");
    let (policy, names, at) = match first {
        First::Ip => (
            format!("{ip_policy}, {global_policy}"),
            ["two:ip", "two:global"],
            (0, 1),
        ),
        First::Global => (
            format!("{global_policy}, {ip_policy}"),
            ["two:global", "two:ip"],
            (1, 0),
        ),
    };
    for i in 1..=SENT {
        let context = format!("{algorithm}, {headers}, request {i}");
        let answer = get(&client, &url).await;
        let field = answer
            .header("ratelimit")
            .unwrap_or_else(|| panic!("{context}: no RateLimit"));
        let state = members(field);
        let got: Vec<&str> = state.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(got, names, "{context}: {field}");
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(policy.as_str()),
            "{context}"
        );
        let (ip_r, global_r) = (state[at.0].param("r"), state[at.1].param("r"));
        if i <= IP {
            assert_eq!(answer.status, StatusCode::OK, "{context}");
            assert_eq!((ip_r, global_r), (IP - i, GLOBAL - i), "{context}: {field}");
        } else {
            assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS, "{context}");
            assert_eq!(ip_r, 0, "{context}: {field}");
            assert!(
                (GLOBAL - i..=GLOBAL - IP).contains(&global_r),
                "{context}: global r={global_r}, not within {}..={}: {field}",
                GLOBAL - i,
                GLOBAL - IP
            );
        }
        if headers == "both" {
            // `ip` is the most restrictive on every answer: fewer left of a smaller quota.
            assert_eq!(legacy(&answer, "x-ratelimit-limit", &context), IP);
            assert_eq!(
                legacy(&answer, "x-ratelimit-remaining", &context),
                ip_r,
                "{context}"
            );
        }
    }
    assert_eq!(upstream.count(), IP as usize);
    // The third request was decided by the store; the later ones were the cache's.
    assert_eq!(
        store_decisions(&proxy) - decided_before,
        IP + 1,
        "{algorithm}: only the first denial reached the store"
    );
}

#[tokio::test]
async fn memory_fixed_denials_report_every_limit() {
    denials_report_every_limit(None, "fixed", "draft", First::Ip).await;
}

#[tokio::test]
async fn memory_sliding_denials_report_every_limit() {
    denials_report_every_limit(None, "sliding", "draft", First::Ip).await;
}

#[tokio::test]
async fn memory_denials_report_every_limit_in_both_header_sets() {
    denials_report_every_limit(None, "fixed", "both", First::Ip).await;
    denials_report_every_limit(None, "sliding", "both", First::Global).await;
}

#[tokio::test]
async fn postgres_fixed_denials_report_every_limit() {
    let db = TestDb::new().await;
    denials_report_every_limit(Some(&db), "fixed", "draft", First::Ip).await;
}

#[tokio::test]
async fn postgres_sliding_denials_report_every_limit() {
    let db = TestDb::new().await;
    denials_report_every_limit(Some(&db), "sliding", "draft", First::Ip).await;
}

#[tokio::test]
async fn postgres_denials_report_every_limit_in_both_header_sets() {
    let db = TestDb::new().await;
    denials_report_every_limit(Some(&db), "fixed", "both", First::Ip).await;
    // A fresh database: the fixed run's counts would deny at once.
    let db = TestDb::new().await;
    denials_report_every_limit(Some(&db), "sliding", "both", First::Global).await;
}

/// The exhausted limit listed second: the cache found the first one not exhausted on its way
/// to it, and its member still reports what was counted.
#[tokio::test]
async fn memory_fixed_denials_report_a_limit_listed_before_the_exhausted_one() {
    denials_report_every_limit(None, "fixed", "draft", First::Global).await;
}

#[tokio::test]
async fn postgres_fixed_denials_report_a_limit_listed_before_the_exhausted_one() {
    let db = TestDb::new().await;
    denials_report_every_limit(Some(&db), "fixed", "draft", First::Global).await;
}
