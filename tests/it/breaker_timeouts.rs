//! What a failing store costs the requests (contract §5; issue 47, item 5): while the store keeps
//! failing, only the first one or two requests per instance wait out `store.timeout`; the
//! breaker then answers the rest at once with the failure policy (`local`, `deny` or `allow`,
//! one mechanism for all three), and counting returns to the database by itself once it
//! answers again.
//!
//! Each test has a fresh database (tests/common/db.rs), two real tollgate servers on port 0
//! whose store goes through the fault relay of tests/common/faulty.rs (refusing every
//! connection, or hanging them all), and a recording upstream. `store.timeout` is 1 s, so a
//! request that paid it is easy to tell from one that did not.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use crate::common::db::TestDb;
use crate::common::faulty::FaultyTcp;
use crate::common::*;

/// `store.timeout` of these tests.
const TIMEOUT: Duration = Duration::from_secs(1);

/// A request that took this long paid (most of) the store's timeout.
const SLOW: Duration = Duration::from_millis(500);

/// How many requests per instance may pay it once the store fails: the breaker needs one or
/// two failures to tell a failing store from a straggler.
const SLOW_AT_MOST: usize = 2;

/// Sequential requests per instance while the store fails.
const REQUESTS: usize = 8;

/// How the relay in front of the database fails.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// New connections reset at once, open ones cut.
    Refuse,
    /// Every connection open, no byte moving.
    Hang,
}

/// Route `api` (`/api`): 5 requests a day per `X-Api-Key` (a day: no window boundary falls
/// inside a test), under the store's `on_error`.
const API_ROUTE: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 5
  window = "1d"
"#;

fn keyed(proxy: &Proxy, key: &str) -> Request<Full<Bytes>> {
    Request::get(proxy.url("/api"))
        .header("x-api-key", key)
        .body(Full::new(Bytes::new()))
        .expect("request")
}

/// Two instances on `db` through `relay`, failure policy `policy`, one connection worker each.
async fn two_instances(
    db: &TestDb,
    relay: &FaultyTcp,
    upstream: &Upstream,
    policy: &str,
) -> [Proxy; 2] {
    let store = format!(
        "url = \"{}\"\ntimeout = \"{}ms\"\non_error = \"{policy}\"\npool_size = 2",
        db.url_through(relay.addr),
        TIMEOUT.as_millis()
    );
    let text = limits_config(&store, "workers = 1", API_ROUTE);
    let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    [a, b]
}

/// How many of route `api`'s decisions on `proxy` were `decision`.
fn decisions(proxy: &Proxy, decision: &str) -> u64 {
    let series = format!("tollgate_decisions_total{{route=\"api\",decision=\"{decision}\"}} ");
    let text = proxy.server().metrics().render();
    text.lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Decided by the database: `allowed` or `limited`.
fn by_database(proxy: &Proxy) -> u64 {
    decisions(proxy, "allowed") + decisions(proxy, "limited")
}

/// Checks that `answer` is what `policy` answers while the store fails.
fn check_fallback(policy: &str, answer: &Answer, i: usize) {
    match policy {
        "deny" => assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "request {i}"
        ),
        "allow" => {
            assert_eq!(answer.status, StatusCode::OK, "request {i}");
            assert!(
                answer.header("ratelimit").is_none(),
                "request {i}: nothing counted it, yet it has rate-limit fields"
            );
        }
        "local" => {
            assert!(
                [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS].contains(&answer.status),
                "request {i}: {}",
                answer.status
            );
            assert!(
                answer.header("ratelimit-policy").is_some(),
                "request {i}: a local decision has the fields of the local quota"
            );
        }
        other => panic!("no such policy {other}"),
    }
}

/// Sends [`REQUESTS`] requests with `key` to `proxy`, one after another; answers how long each
/// took, in seconds, after checking that each is `policy`'s answer and that none was decided
/// by the database.
async fn while_failing(client: &H1Client, proxy: &Proxy, key: &str, policy: &str) -> Vec<f64> {
    let before = by_database(proxy);
    let mut took = Vec::new();
    for i in 0..REQUESTS {
        let started = Instant::now();
        let answer = send(client, keyed(proxy, key)).await;
        took.push(started.elapsed().as_secs_f64());
        check_fallback(policy, &answer, i);
    }
    assert_eq!(
        by_database(proxy),
        before,
        "the database decided while it was failing"
    );
    took
}

/// Sends requests with fresh keys to `proxy` until one is decided by the database, for at
/// most `within`.
async fn until_database_decides(client: &H1Client, proxy: &Proxy, within: Duration) {
    let before = by_database(proxy);
    let deadline = Instant::now() + within;
    for i in 0.. {
        send(client, keyed(proxy, &format!("probe-{i}"))).await;
        if by_database(proxy) > before {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: decisions never returned to the database within {within:?}",
            proxy.addr
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The whole scenario for `policy` and `fault`: both instances decide on the database; the
/// relay fails; of [`REQUESTS`] sequential requests per instance at most [`SLOW_AT_MOST`] take
/// [`SLOW`] or more; the relay forwards again, and both instances count in the one database
/// again (a limit of 5 over both: five 200, then 429).
async fn only_the_first_requests_pay_the_timeout(policy: &str, fault: Fault) {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let proxies = two_instances(&db, &relay, &upstream, policy).await;
    let client = h1_client();
    for proxy in &proxies {
        proxy.until_store_ready(Duration::from_secs(15)).await;
        until_database_decides(&client, proxy, Duration::from_secs(5)).await;
    }

    match fault {
        Fault::Refuse => relay.down(),
        Fault::Hang => relay.stall(),
    }
    for (which, proxy) in proxies.iter().enumerate() {
        let took = while_failing(&client, proxy, "k", policy).await;
        let slow = took.iter().filter(|&&t| t >= SLOW.as_secs_f64()).count();
        let rounded: Vec<f64> = took.iter().map(|t| (t * 100.0).round() / 100.0).collect();
        eprintln!("{policy}, {fault:?}, instance {which}: seconds {rounded:?}");
        assert!(
            slow <= SLOW_AT_MOST,
            "{policy}, {fault:?}, instance {which}: {slow} of {REQUESTS} requests took {SLOW:?} \
             or more (store.timeout {TIMEOUT:?}); seconds: {rounded:?}"
        );
    }

    relay.up();
    for proxy in &proxies {
        until_database_decides(&client, proxy, Duration::from_secs(10)).await;
    }
    let mut statuses = Vec::new();
    for i in 0..6 {
        let proxy = &proxies[i % 2];
        statuses.push(send(&client, keyed(proxy, "after")).await.status.as_u16());
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 429],
        "{policy}, {fault:?}: both instances count in the one database again"
    );
}

#[tokio::test]
async fn local_refused_only_the_first_requests_pay_the_timeout() {
    only_the_first_requests_pay_the_timeout("local", Fault::Refuse).await;
}

#[tokio::test]
async fn local_hung_only_the_first_requests_pay_the_timeout() {
    only_the_first_requests_pay_the_timeout("local", Fault::Hang).await;
}

#[tokio::test]
async fn deny_refused_only_the_first_requests_pay_the_timeout() {
    only_the_first_requests_pay_the_timeout("deny", Fault::Refuse).await;
}

#[tokio::test]
async fn deny_hung_only_the_first_requests_pay_the_timeout() {
    only_the_first_requests_pay_the_timeout("deny", Fault::Hang).await;
}

#[tokio::test]
async fn allow_refused_only_the_first_requests_pay_the_timeout() {
    only_the_first_requests_pay_the_timeout("allow", Fault::Refuse).await;
}

#[tokio::test]
async fn allow_hung_only_the_first_requests_pay_the_timeout() {
    only_the_first_requests_pay_the_timeout("allow", Fault::Hang).await;
}
