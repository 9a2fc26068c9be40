//! Limit policies end to end (contract §2, §3 and §5): the rate-limit header modes, shadow
//! limits and shadow routes, custom rejections, header, composite and global keys, shared
//! scopes, several limits on one route, decision metrics and method-restricted routes. Where a
//! behaviour depends on the store, it is proved on the memory store and on a real PostgreSQL
//! (a fresh database per test).
//!
//! Every limit uses a window of "366d" (or "1d" where two window lengths must differ), so a
//! window boundary cannot fall inside a test.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;

use crate::common::db::TestDb;
use crate::common::ratelimit::members;
use crate::common::*;
use tollgate::testing::key::BucketHasher;
use tollgate::testing::store::Increment;

/// 366 days in seconds: the `w` of every "366d" limit.
const YEAR: u64 = 31_622_400;
/// One day in seconds.
const DAY: u64 = 86_400;

/// The `[store]` body: memory without a database, else this test's database.
fn store_body(db: Option<&TestDb>) -> String {
    match db {
        Some(db) => pg_store(db),
        None => String::new(),
    }
}

async fn start(upstream: &Upstream, text: &str) -> Proxy {
    Proxy::start(config_from(text, upstream.addr, &[])).await
}

/// A request with the given method and headers.
fn request(method: Method, url: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut builder = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Full::new(Bytes::new())).expect("request")
}

async fn get_with(client: &H1Client, url: &str, headers: &[(&str, &str)]) -> Answer {
    send(client, request(Method::GET, url, headers)).await
}

/// Seconds until the current epoch-aligned window of `window` seconds ends, by this clock.
fn seconds_left(window: u64) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs();
    window - now % window
}

/// The `RateLimit` members as (name, r, t), checking that each `t` is the time left in a
/// window of `windows[i]` seconds.
fn ratelimit_state(answer: &Answer, windows: &[u64]) -> Vec<(String, u64)> {
    let field = answer.header("ratelimit").expect("RateLimit header");
    let parsed = members(field);
    assert_eq!(parsed.len(), windows.len(), "RateLimit: {field}");
    parsed
        .iter()
        .zip(windows)
        .map(|(m, window)| {
            let t = m.param("t");
            assert!(
                t >= 1 && t.abs_diff(seconds_left(*window)) <= 2,
                "t={t} is not the time left in a {window}s window: {field}"
            );
            (m.name.clone(), m.param("r"))
        })
        .collect()
}

/// The `RateLimit-Policy` field built from (name, q, w).
fn policy_field(limits: &[(&str, u32, u64)]) -> String {
    limits
        .iter()
        .map(|(name, q, w)| format!("\"{name}\";q={q};w={w}"))
        .collect::<Vec<_>>()
        .join(", ")
}

const RATE_LIMIT_HEADERS: [&str; 5] = [
    "ratelimit",
    "ratelimit-policy",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

fn assert_no_rate_limit_headers(answer: &Answer, context: &str) {
    for name in RATE_LIMIT_HEADERS {
        assert!(
            answer.header(name).is_none(),
            "{context}: unexpected {name}: {:?}",
            answer.header(name)
        );
    }
}

fn retry_after(answer: &Answer) -> u64 {
    answer
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("Retry-After in whole seconds")
}

/// The `violated-policies` of a problem+json body, as a set.
fn violated(answer: &Answer) -> BTreeSet<String> {
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json")
    );
    let text = answer.text();
    assert!(
        text.contains("\"status\":429"),
        "problem body without status 429: {text}"
    );
    let key = "\"violated-policies\":[";
    let start = text
        .find(key)
        .unwrap_or_else(|| panic!("no violated-policies: {text}"))
        + key.len();
    let end = start
        + text[start..]
            .find(']')
            .unwrap_or_else(|| panic!("unterminated violated-policies: {text}"));
    let list: Vec<String> = text[start..end]
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let s = s.trim();
            assert!(
                s.len() >= 2 && s.starts_with('"') && s.ends_with('"'),
                "not a JSON string: {s} in {text}"
            );
            s[1..s.len() - 1].to_string()
        })
        .collect();
    let set: BTreeSet<String> = list.iter().cloned().collect();
    assert_eq!(set.len(), list.len(), "duplicates in {text}");
    set
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

/// The `ip` bucket of 127.0.0.1 in `scope` (the tests' key secret).
fn ip_bucket(scope: &str) -> String {
    let digest = BucketHasher::new(Some(b"test-secret")).digest(b"127.0.0.1");
    format!("{scope}:ip:{digest}")
}

/// The count of `bucket` in its current window: `rate_limits.count` on Postgres (0 without a
/// row), the store's own view on memory.
async fn stored_count(proxy: &Proxy, db: Option<&TestDb>, bucket: &str, window_secs: u32) -> u32 {
    match db {
        Some(db) => {
            let rows = db
                .client()
                .await
                .query(
                    "SELECT count FROM rate_limits WHERE bucket = $1",
                    &[&bucket],
                )
                .await
                .expect("query rate_limits");
            assert!(rows.len() <= 1, "several windows for {bucket}");
            rows.first()
                .map(|r| u32::try_from(r.get::<_, i32>(0)).expect("non-negative count"))
                .unwrap_or(0)
        }
        None => {
            let peeked = proxy
                .server()
                .store()
                .peek(&[Increment {
                    bucket: Arc::from(bucket),
                    window_secs,
                    by: 1,
                    sliding: None,
                    enforce: None,
                    check: false,
                }])
                .await
                .expect("peek the memory store");
            peeked[0].count
        }
    }
}

/// Every `rate_limits` row as (bucket, count), ordered by bucket.
async fn all_rows(db: &TestDb) -> Vec<(String, i32)> {
    db.client()
        .await
        .query("SELECT bucket, count FROM rate_limits ORDER BY bucket", &[])
        .await
        .expect("query rate_limits")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 1. rate_limit_headers modes

/// Route `r`: `ip` 3 per 366d, then `header:authorization` 2 per 366d.
const TWO_LIMITS: &str = r#"
[[routes]]
name = "r"
path_prefix = "/r"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 3
  window = "366d"

  [[routes.limits]]
  key = "header:authorization"
  requests = 2
  window = "366d"
"#;

/// Runs the same sequence under `mode` and checks the draft and legacy fields as the mode says.
async fn header_mode(mode: &str, draft: bool, legacy: bool) {
    let upstream = Upstream::start().await;
    let text = limits_config("", &format!("rate_limit_headers = \"{mode}\""), TWO_LIMITS);
    let proxy = start(&upstream, &text).await;
    let client = h1_client();
    let url = proxy.url("/r");
    let policy = policy_field(&[("r:ip", 3, YEAR), ("r:authorization", 2, YEAR)]);

    // (authorization, status, ip r, authorization r, legacy (limit, remaining) if unambiguous)
    type Step = (&'static str, StatusCode, u64, u64, Option<(u64, u64)>);
    let steps: [Step; 4] = [
        // authorization is the most restrictive: 1 left against ip's 2.
        ("Bearer a", StatusCode::OK, 2, 1, Some((2, 1))),
        // A tie: 1 left each.
        ("Bearer b", StatusCode::OK, 1, 1, None),
        // Now ip is the most restrictive: 0 left against authorization's 1.
        ("Bearer c", StatusCode::OK, 0, 1, Some((3, 0))),
        // ip exceeded: denied, and "Bearer a" keeps its 1 (a request one limit denies takes
        // nothing from the others, contract §3d).
        ("Bearer a", StatusCode::TOO_MANY_REQUESTS, 0, 1, None),
    ];
    for (i, (token, status, ip_left, auth_left, most)) in steps.into_iter().enumerate() {
        let answer = get_with(&client, &url, &[("authorization", token)]).await;
        let context = format!("{mode}, request {}", i + 1);
        assert_eq!(answer.status, status, "{context}");
        if draft {
            assert_eq!(
                answer.header("ratelimit-policy"),
                Some(policy.as_str()),
                "{context}"
            );
            assert_eq!(
                ratelimit_state(&answer, &[YEAR, YEAR]),
                [
                    ("r:ip".to_string(), ip_left),
                    ("r:authorization".to_string(), auth_left)
                ],
                "{context}"
            );
        } else {
            assert!(answer.header("ratelimit").is_none(), "{context}");
            assert!(answer.header("ratelimit-policy").is_none(), "{context}");
        }
        if legacy {
            let num = |name: &str| -> u64 {
                answer
                    .header(name)
                    .unwrap_or_else(|| panic!("{context}: no {name}"))
                    .parse()
                    .unwrap_or_else(|_| panic!("{context}: {name} is not an integer"))
            };
            let limit = num("x-ratelimit-limit");
            let remaining = num("x-ratelimit-remaining");
            let reset = num("x-ratelimit-reset");
            assert_eq!(remaining, ip_left.min(auth_left), "{context}");
            match most {
                Some(expected) => assert_eq!((limit, remaining), expected, "{context}"),
                None => assert!(limit == 2 || limit == 3, "{context}: limit {limit}"),
            }
            assert!(
                reset >= 1 && reset.abs_diff(seconds_left(YEAR)) <= 2,
                "{context}: X-RateLimit-Reset {reset} is not the seconds left in the window"
            );
        } else {
            assert!(answer.header("x-ratelimit-limit").is_none(), "{context}");
            assert!(
                answer.header("x-ratelimit-remaining").is_none(),
                "{context}"
            );
            assert!(answer.header("x-ratelimit-reset").is_none(), "{context}");
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            let retry = retry_after(&answer);
            assert!(
                retry.abs_diff(seconds_left(YEAR)) <= 2,
                "{context}: Retry-After {retry}"
            );
            assert_eq!(violated(&answer), set(&["r:ip"]), "{context}");
        }
    }
    assert_eq!(upstream.count(), 3, "a denied request reached the upstream");

    // Without an authorization header only the ip limit applies: one member (denied: ip is
    // used up).
    let answer = get(&client, &url).await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    if draft {
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(policy_field(&[("r:ip", 3, YEAR)]).as_str())
        );
        assert_eq!(ratelimit_state(&answer, &[YEAR]), [("r:ip".to_string(), 0)]);
    }
    if legacy {
        assert_eq!(answer.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(answer.header("x-ratelimit-remaining"), Some("0"));
    }
    if !draft && !legacy {
        assert_no_rate_limit_headers(&answer, "none");
    }
    // A route without limits never carries them.
    let open = get(&client, &proxy.url("/elsewhere")).await;
    assert_eq!(open.status, StatusCode::OK);
    assert_no_rate_limit_headers(&open, "route without limits");
}

#[tokio::test]
async fn headers_draft_lists_every_limit_in_order() {
    header_mode("draft", true, false).await;
}

#[tokio::test]
async fn headers_legacy_show_the_most_restrictive_limit() {
    header_mode("legacy", false, true).await;
}

#[tokio::test]
async fn headers_both_send_draft_and_legacy() {
    header_mode("both", true, true).await;
}

#[tokio::test]
async fn headers_none_send_neither() {
    header_mode("none", false, false).await;
}

/// The default mode is "draft".
#[tokio::test]
async fn headers_default_to_draft() {
    let upstream = Upstream::start().await;
    let proxy = start(&upstream, &limits_config("", "", TWO_LIMITS)).await;
    let answer = get_with(&h1_client(), &proxy.url("/r"), &[("authorization", "x")]).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(answer.header("ratelimit").is_some());
    assert!(answer.header("ratelimit-policy").is_some());
    assert!(answer.header("x-ratelimit-limit").is_none());
}

// ---------------------------------------------------------------------------------------------
// 2. Shadow limits and shadow routes

const SHADOW_ROUTES: &str = r#"
[[routes]]
name = "shadowed"
path_prefix = "/shadowed"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "366d"
  shadow = true

[[routes]]
name = "shadowroute"
path_prefix = "/shadowroute"
upstream = "app"
shadow = true

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "366d"

  [[routes.limits]]
  key = "global"
  requests = 1
  window = "366d"

[[routes]]
name = "mixed"
path_prefix = "/mixed"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "366d"
  shadow = true

  [[routes.limits]]
  key = "global"
  requests = 3
  window = "366d"
"#;

async fn shadow_limits(db: Option<&TestDb>) {
    let upstream = Upstream::start().await;
    let text = limits_config(
        &store_body(db),
        "rate_limit_headers = \"both\"",
        SHADOW_ROUTES,
    );
    let proxy = start(&upstream, &text).await;
    let client = h1_client();

    // A shadow limit: counted, never enforced, never in the headers.
    for i in 1..=5 {
        let answer = get(&client, &proxy.url("/shadowed")).await;
        assert_eq!(answer.status, StatusCode::OK, "shadowed request {i}");
        assert_no_rate_limit_headers(&answer, "shadow limit");
        assert!(answer.header("retry-after").is_none());
    }
    assert_eq!(upstream.count(), 5, "shadow-limited requests not forwarded");
    assert_eq!(
        stored_count(&proxy, db, &ip_bucket("shadowed"), YEAR as u32).await,
        5,
        "a shadow limit must still count"
    );

    // A shadow route: all its limits are shadow.
    for i in 1..=4 {
        let answer = get(&client, &proxy.url("/shadowroute")).await;
        assert_eq!(answer.status, StatusCode::OK, "shadow route request {i}");
        assert_no_rate_limit_headers(&answer, "shadow route");
    }
    assert_eq!(upstream.count(), 9);
    assert_eq!(
        stored_count(&proxy, db, &ip_bucket("shadowroute"), YEAR as u32).await,
        4
    );
    assert_eq!(
        stored_count(&proxy, db, "shadowroute:global", YEAR as u32).await,
        4
    );

    // One shadow (ip, 1) and one enforced (global, 3) limit: only global denies or shows.
    let policy = policy_field(&[("mixed:global", 3, YEAR)]);
    for left in [2u64, 1, 0] {
        let answer = get(&client, &proxy.url("/mixed")).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "mixed: the shadow limit denied (global left {left})"
        );
        assert_eq!(answer.header("ratelimit-policy"), Some(policy.as_str()));
        assert_eq!(
            ratelimit_state(&answer, &[YEAR]),
            [("mixed:global".to_string(), left)]
        );
        // Legacy follows the enforced limit even though the shadow one has fewer left.
        assert_eq!(answer.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(
            answer.header("x-ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
    }
    assert_eq!(upstream.count(), 12);
    let denied = get(&client, &proxy.url("/mixed")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.count(), 12);
    assert_eq!(violated(&denied), set(&["mixed:global"]));
    assert_eq!(denied.header("ratelimit-policy"), Some(policy.as_str()));
    assert_eq!(
        ratelimit_state(&denied, &[YEAR]),
        [("mixed:global".to_string(), 0)]
    );
    assert_eq!(denied.header("x-ratelimit-limit"), Some("3"));
    assert!(stored_count(&proxy, db, &ip_bucket("mixed"), YEAR as u32).await >= 3);
}

#[tokio::test]
async fn memory_shadow_limits_count_but_never_deny() {
    shadow_limits(None).await;
}

#[tokio::test]
async fn postgres_shadow_limits_count_but_never_deny() {
    let db = TestDb::new().await;
    shadow_limits(Some(&db)).await;
}

// ---------------------------------------------------------------------------------------------
// 3. [routes.reject]

#[tokio::test]
async fn custom_reject_replaces_the_429() {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "guarded"
path_prefix = "/guarded"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "366d"

  [routes.reject]
  status = 403
  content_type = "application/json"
  body = '{"error":"slow down"}'
"#;
    let proxy = start(&upstream, &limits_config("", "", routes)).await;
    let client = h1_client();
    assert_eq!(
        get(&client, &proxy.url("/guarded")).await.status,
        StatusCode::OK
    );
    for _ in 0..2 {
        let denied = get(&client, &proxy.url("/guarded")).await;
        assert_eq!(denied.status, StatusCode::FORBIDDEN);
        assert_eq!(denied.header("content-type"), Some("application/json"));
        assert_eq!(denied.text(), r#"{"error":"slow down"}"#);
        let retry = retry_after(&denied);
        assert!(
            retry.abs_diff(seconds_left(YEAR)) <= 2,
            "Retry-After {retry}"
        );
        // The rate-limit headers still say why.
        assert_eq!(
            ratelimit_state(&denied, &[YEAR]),
            [("guarded:ip".to_string(), 0)]
        );
    }
    assert_eq!(upstream.count(), 1);
}

// ---------------------------------------------------------------------------------------------
// 4. header:<name> keys

#[tokio::test]
async fn header_key_counts_only_requests_with_the_header() {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 2
  window = "366d"
"#;
    let proxy = start(&upstream, &limits_config("", "", routes)).await;
    let client = h1_client();
    let url = proxy.url("/api");
    for i in 0..10 {
        let answer = get(&client, &url).await;
        assert_eq!(answer.status, StatusCode::OK, "request {i} without a key");
        assert!(
            answer.header("ratelimit").is_none(),
            "a limit that does not apply shows in RateLimit"
        );
    }
    assert_eq!(upstream.count(), 10);

    for key in ["key-one", "key-two"] {
        for left in [1u64, 0] {
            let answer = get_with(&client, &url, &[("x-api-key", key)]).await;
            assert_eq!(answer.status, StatusCode::OK, "{key}, {left} left");
            assert_eq!(
                answer.header("ratelimit-policy"),
                Some(policy_field(&[("api:x-api-key", 2, YEAR)]).as_str())
            );
            assert_eq!(
                ratelimit_state(&answer, &[YEAR]),
                [("api:x-api-key".to_string(), left)]
            );
        }
        let denied = get_with(&client, &url, &[("x-api-key", key)]).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS, "{key}");
        assert_eq!(violated(&denied), set(&["api:x-api-key"]));
    }
    assert_eq!(upstream.count(), 14);
    // Still no budget for requests without the header.
    for _ in 0..3 {
        assert_eq!(get(&client, &url).await.status, StatusCode::OK);
    }
    assert_eq!(upstream.count(), 17);
    // The memory store holds nothing for them: no bucket of an empty subject.
    let hasher = BucketHasher::new(Some(b"test-secret"));
    let empty = format!("api:x-api-key:{}", hasher.digest(b""));
    assert_eq!(stored_count(&proxy, None, &empty, YEAR as u32).await, 0);
}

// ---------------------------------------------------------------------------------------------
// 5. Composite keys

async fn composite_key(db: Option<&TestDb>) {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "tenants"
path_prefix = "/t"
upstream = "app"

  [[routes.limits]]
  key = ["header:x-tenant", "ip"]
  requests = 2
  window = "366d"
"#;
    let proxy = start(&upstream, &limits_config(&store_body(db), "", routes)).await;
    let client = h1_client();
    let url = proxy.url("/t");
    for i in 0..6 {
        let answer = get(&client, &url).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "request {i} without a tenant"
        );
        assert!(answer.header("ratelimit").is_none());
    }
    assert_eq!(upstream.count(), 6);
    if let Some(db) = db {
        assert_eq!(
            all_rows(db).await,
            [],
            "requests without x-tenant were counted"
        );
    }

    let policy = policy_field(&[("tenants:x-tenant+ip", 2, YEAR)]);
    for tenant in ["acme", "globex"] {
        for left in [1u64, 0] {
            let answer = get_with(&client, &url, &[("x-tenant", tenant)]).await;
            assert_eq!(answer.status, StatusCode::OK, "{tenant}, {left} left");
            assert_eq!(answer.header("ratelimit-policy"), Some(policy.as_str()));
            assert_eq!(
                ratelimit_state(&answer, &[YEAR]),
                [("tenants:x-tenant+ip".to_string(), left)]
            );
        }
        let denied = get_with(&client, &url, &[("x-tenant", tenant)]).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS, "{tenant}");
        assert_eq!(violated(&denied), set(&["tenants:x-tenant+ip"]));
    }
    assert_eq!(upstream.count(), 10);
    assert_eq!(get(&client, &url).await.status, StatusCode::OK);

    if let Some(db) = db {
        let rows = all_rows(db).await;
        assert_eq!(rows.len(), 2, "one row per tenant: {rows:?}");
        for (bucket, count) in &rows {
            let digest = bucket
                .strip_prefix("tenants:x-tenant+ip:")
                .unwrap_or_else(|| panic!("bucket {bucket}"));
            assert_eq!(digest.len(), 64, "{bucket}");
            assert!(digest
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
            assert!(!bucket.contains("acme") && !bucket.contains("globex"));
            assert!(*count >= 2, "{bucket}: count {count}");
        }
    }
}

#[tokio::test]
async fn memory_composite_key_needs_every_part() {
    composite_key(None).await;
}

#[tokio::test]
async fn postgres_composite_key_needs_every_part() {
    let db = TestDb::new().await;
    composite_key(Some(&db)).await;
}

// ---------------------------------------------------------------------------------------------
// 6. The global key

async fn global_key(db: Option<&TestDb>) {
    let upstream = Upstream::start().await;
    // `perip` shows that the X-Forwarded-For values really are distinct clients.
    let routes = r#"
[[routes]]
name = "g"
path_prefix = "/g"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = 3
  window = "366d"
  scope = "everyone"

[[routes]]
name = "perip"
path_prefix = "/perip"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "366d"
"#;
    let text = limits_config(
        &store_body(db),
        "trusted_proxies = [\"127.0.0.0/8\"]",
        routes,
    );
    let proxy = start(&upstream, &text).await;
    let client = h1_client();
    let clients: Vec<String> = (1..=6).map(|i| format!("203.0.113.{i}")).collect();
    for xff in &clients {
        let answer = get_with(&client, &proxy.url("/perip"), &[("x-forwarded-for", xff)]).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "{xff} is not a client of its own"
        );
    }
    let policy = policy_field(&[("everyone:global", 3, YEAR)]);
    for (i, xff) in clients.iter().enumerate() {
        let answer = get_with(&client, &proxy.url("/g"), &[("x-forwarded-for", xff)]).await;
        if i < 3 {
            assert_eq!(answer.status, StatusCode::OK, "client {xff}");
            assert_eq!(answer.header("ratelimit-policy"), Some(policy.as_str()));
            assert_eq!(
                ratelimit_state(&answer, &[YEAR]),
                [("everyone:global".to_string(), 2 - i as u64)]
            );
        } else {
            assert_eq!(
                answer.status,
                StatusCode::TOO_MANY_REQUESTS,
                "client {xff} has a budget of its own"
            );
            assert_eq!(violated(&answer), set(&["everyone:global"]));
        }
    }
    assert_eq!(upstream.count(), 6 + 3);
    assert!(stored_count(&proxy, db, "everyone:global", YEAR as u32).await >= 3);
    if let Some(db) = db {
        let global: Vec<(String, i32)> = all_rows(db)
            .await
            .into_iter()
            .filter(|(bucket, _)| !bucket.starts_with("perip:"))
            .collect();
        assert_eq!(global.len(), 1, "{global:?}");
        assert_eq!(global[0].0, "everyone:global");
        assert!(global[0].1 >= 3);
    }
}

#[tokio::test]
async fn memory_global_key_is_one_budget_for_all() {
    global_key(None).await;
}

#[tokio::test]
async fn postgres_global_key_is_one_budget_for_all() {
    let db = TestDb::new().await;
    global_key(Some(&db)).await;
}

// ---------------------------------------------------------------------------------------------
// 7. Shared scopes

async fn shared_scope(db: Option<&TestDb>) {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "a"
path_prefix = "/a"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 3
  window = "366d"
  scope = "shared"

[[routes]]
name = "b"
path_prefix = "/b"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 3
  window = "366d"
  scope = "shared"

[[routes]]
name = "c"
path_prefix = "/c"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 3
  window = "366d"
"#;
    let proxy = start(&upstream, &limits_config(&store_body(db), "", routes)).await;
    let client = h1_client();
    for (path, left) in [("/a", 2u64), ("/b", 1), ("/a/x", 0)] {
        let answer = get(&client, &proxy.url(path)).await;
        assert_eq!(answer.status, StatusCode::OK, "{path}");
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(policy_field(&[("shared:ip", 3, YEAR)]).as_str())
        );
        assert_eq!(
            ratelimit_state(&answer, &[YEAR]),
            [("shared:ip".to_string(), left)],
            "{path}"
        );
    }
    for path in ["/b", "/a"] {
        let denied = get(&client, &proxy.url(path)).await;
        assert_eq!(
            denied.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{path}: routes with one scope do not share a budget"
        );
        assert_eq!(violated(&denied), set(&["shared:ip"]));
    }
    assert_eq!(upstream.count(), 3);
    // A route with its own scope has its own budget.
    let own = get(&client, &proxy.url("/c")).await;
    assert_eq!(own.status, StatusCode::OK);
    assert_eq!(ratelimit_state(&own, &[YEAR]), [("c:ip".to_string(), 2)]);
    assert!(stored_count(&proxy, db, &ip_bucket("shared"), YEAR as u32).await >= 3);
    assert_eq!(
        stored_count(&proxy, db, &ip_bucket("c"), YEAR as u32).await,
        1
    );
    if let Some(db) = db {
        let buckets: Vec<String> = all_rows(db).await.into_iter().map(|(b, _)| b).collect();
        assert_eq!(buckets, [ip_bucket("c"), ip_bucket("shared")]);
    }
}

#[tokio::test]
async fn memory_shared_scope_is_one_budget_across_routes() {
    shared_scope(None).await;
}

#[tokio::test]
async fn postgres_shared_scope_is_one_budget_across_routes() {
    let db = TestDb::new().await;
    shared_scope(Some(&db)).await;
}

// ---------------------------------------------------------------------------------------------
// 8. Several limits on one route

#[tokio::test]
async fn any_violated_limit_denies_and_retry_after_is_the_longest_wait() {
    let upstream = Upstream::start().await;
    // x-user: 1 per day; x-org: 2 per 366 days; ip: 100 per 366 days (never violated).
    let routes = r#"
[[routes]]
name = "multi"
path_prefix = "/multi"
upstream = "app"

  [[routes.limits]]
  key = "header:x-user"
  requests = 1
  window = "1d"

  [[routes.limits]]
  key = "header:x-org"
  requests = 2
  window = "366d"

  [[routes.limits]]
  key = "ip"
  requests = 100
  window = "366d"
"#;
    let proxy = start(&upstream, &limits_config("", "", routes)).await;
    let client = h1_client();
    let url = proxy.url("/multi");
    let call = |user: &'static str, org: &'static str| {
        let client = client.clone();
        let url = url.clone();
        async move { get_with(&client, &url, &[("x-user", user), ("x-org", org)]).await }
    };
    let windows = [DAY, YEAR, YEAR];
    let policy = policy_field(&[
        ("multi:x-user", 1, DAY),
        ("multi:x-org", 2, YEAR),
        ("multi:ip", 100, YEAR),
    ]);

    // Only the daily limit violated: Retry-After is the day's remaining time.
    assert_eq!(call("u1", "o1").await.status, StatusCode::OK);
    let denied = call("u1", "o2").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&denied), set(&["multi:x-user"]));
    assert_eq!(denied.header("ratelimit-policy"), Some(policy.as_str()));
    let state = ratelimit_state(&denied, &windows);
    assert_eq!(state[0], ("multi:x-user".to_string(), 0));
    let retry = retry_after(&denied);
    assert!(
        retry.abs_diff(seconds_left(DAY)) <= 2,
        "Retry-After {retry}, day ends in {}",
        seconds_left(DAY)
    );

    // Both violated: Retry-After is the longer wait.
    assert_eq!(call("u2", "o3").await.status, StatusCode::OK);
    assert_eq!(call("u3", "o3").await.status, StatusCode::OK);
    let denied = call("u2", "o3").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&denied), set(&["multi:x-user", "multi:x-org"]));
    let longest = seconds_left(DAY).max(seconds_left(YEAR));
    let retry = retry_after(&denied);
    assert!(
        retry.abs_diff(longest) <= 2,
        "Retry-After {retry}, expected the longest wait {longest} (day {}, year {})",
        seconds_left(DAY),
        seconds_left(YEAR)
    );
    let state = ratelimit_state(&denied, &windows);
    assert_eq!(state[0], ("multi:x-user".to_string(), 0));
    assert_eq!(state[1], ("multi:x-org".to_string(), 0));

    // Only the 366-day limit violated (a fresh user of the used-up org).
    let denied = call("u4", "o3").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&denied), set(&["multi:x-org"]));
    let retry = retry_after(&denied);
    assert!(
        retry.abs_diff(seconds_left(YEAR)) <= 2,
        "Retry-After {retry}, the 366d window ends in {}",
        seconds_left(YEAR)
    );

    // Nothing violated for a fresh user of a fresh org.
    let ok = call("u5", "o4").await;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(upstream.count(), 4);
}

// ---------------------------------------------------------------------------------------------
// 9. Metrics

/// The value of the exact metric line `series` (name and labels) in `text`.
fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(series)?;
        let value = rest.strip_prefix(' ')?;
        Some(
            value
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("bad metric line: {line}")),
        )
    })
}

#[tokio::test]
async fn decision_metrics_count_each_outcome() {
    let upstream = Upstream::start().await;
    // ip: 3 enforced; global: 1 in shadow.
    let routes = r#"
[[routes]]
name = "m"
path_prefix = "/m"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 3
  window = "366d"

  [[routes.limits]]
  key = "global"
  requests = 1
  window = "366d"
  shadow = true
"#;
    let proxy = start(&upstream, &limits_config("", "", routes)).await;
    let client = h1_client();
    let expected = [
        StatusCode::OK,                // allowed
        StatusCode::OK,                // shadow_limited
        StatusCode::OK,                // shadow_limited
        StatusCode::TOO_MANY_REQUESTS, // limited
        StatusCode::TOO_MANY_REQUESTS, // limited
    ];
    for (i, status) in expected.into_iter().enumerate() {
        assert_eq!(
            get(&client, &proxy.url("/m")).await.status,
            status,
            "request {}",
            i + 1
        );
    }
    let text = proxy.server().metrics().render();
    let value = |series: &str| {
        metric_value(&text, series).unwrap_or_else(|| panic!("no line {series} in:\n{text}"))
    };
    assert_eq!(
        value(r#"tollgate_decisions_total{route="m",decision="allowed"}"#),
        1.0
    );
    assert_eq!(
        value(r#"tollgate_decisions_total{route="m",decision="shadow_limited"}"#),
        2.0
    );
    assert_eq!(
        value(r#"tollgate_decisions_total{route="m",decision="limited"}"#),
        2.0
    );
    assert_eq!(
        metric_value(
            &text,
            r#"tollgate_decisions_total{route="m",decision="failed_open"}"#
        )
        .unwrap_or(0.0),
        0.0
    );
    assert_eq!(
        value(r#"tollgate_responses_total{route="m",code="200"}"#),
        3.0
    );
    assert_eq!(
        value(r#"tollgate_responses_total{route="m",code="429"}"#),
        2.0
    );
}

// ---------------------------------------------------------------------------------------------
// 10. Method-restricted routes

#[tokio::test]
async fn method_restricted_route_lets_other_methods_fall_through() {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "posts"
path_prefix = "/api"
methods = ["POST"]
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "366d"
"#;
    let proxy = start(&upstream, &limits_config("", "", routes)).await;
    let client = h1_client();
    let url = proxy.url("/api");
    for i in 0..5 {
        let answer = get(&client, &url).await;
        assert_eq!(answer.status, StatusCode::OK, "GET {i}");
        assert_no_rate_limit_headers(&answer, "GET on the open route");
    }
    assert_eq!(
        stored_count(&proxy, None, &ip_bucket("posts"), YEAR as u32).await,
        0,
        "GETs counted against the POST route"
    );
    let post = send(&client, request(Method::POST, &url, &[])).await;
    assert_eq!(post.status, StatusCode::OK, "the GETs used the POST budget");
    assert_eq!(
        ratelimit_state(&post, &[YEAR]),
        [("posts:ip".to_string(), 0)]
    );
    let denied = send(&client, request(Method::POST, &url, &[])).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&denied), set(&["posts:ip"]));
    assert_eq!(get(&client, &url).await.status, StatusCode::OK);
    assert_eq!(upstream.count(), 7);
    let methods: Vec<Method> = upstream
        .requests()
        .iter()
        .map(|r| r.method.clone())
        .collect();
    assert_eq!(
        methods.iter().filter(|m| **m == Method::POST).count(),
        1,
        "{methods:?}"
    );
    let text = proxy.server().metrics().render();
    assert_eq!(
        metric_value(
            &text,
            r#"tollgate_decisions_total{route="posts",decision="allowed"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric_value(
            &text,
            r#"tollgate_decisions_total{route="posts",decision="limited"}"#
        ),
        Some(1.0),
        "{text}"
    );
}
