//! The local store-failure policy (contract §5b; issue 18): instances register on the database,
//! `tollgate_instances` shows how many are live, and while the database is cut or hung each
//! instance admits exactly `ceil(requests / instances)` alone, says so once, and counts in
//! the database again once it answers.
//!
//! Each test has a fresh database (tests/common/db.rs), two real tollgate servers on port 0
//! whose store goes through the fault relay of tests/common/faulty.rs, and a recording
//! upstream.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use crate::common::db::TestDb;
use crate::common::faulty::FaultyTcp;
use crate::common::log::CapturedLog;
use crate::common::*;
use tollgate::testing::store::postgres::PostgresStore;
use tollgate::testing::store::InstanceRegistry;

/// Route `api` (`/api`): 5 requests per hour per `X-Api-Key`, `local` when the store fails.
const API_ROUTE: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"
on_store_error = "local"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 5
  window = "1h"
"#;

const WARN_LOCAL: &str = "limited by each instance alone";
const WARN_BACK: &str = "answers again: local limiting ended";

fn keyed(proxy: &Proxy, key: &str) -> Request<Full<Bytes>> {
    Request::get(proxy.url("/api"))
        .header("x-api-key", key)
        .body(Full::new(Bytes::new()))
        .expect("request")
}

/// Two instances on one database, both through `relay`. One connection worker each, so that
/// everything they log is on this test's thread (CapturedLog).
async fn two_instances(db: &TestDb, relay: &FaultyTcp, upstream: &Upstream) -> (Proxy, Proxy) {
    let store = format!(
        "url = \"{}\"\ntimeout = \"300ms\"\npool_size = 2",
        db.url_through(relay.addr)
    );
    let text = limits_config(&store, "workers = 1", API_ROUTE);
    let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    (a, b)
}

/// Waits until both instances count 2 live instances (each refreshes every few seconds).
async fn until_both_see_two(a: &Proxy, b: &Proxy) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let seen = [
            a.server().metrics().instances.get(),
            b.server().metrics().instances.get(),
        ];
        if seen == [2, 2] {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the instances never saw each other: tollgate_instances = {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value of the exact metric line `series` in `text`.
fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Sends `n` requests with `key` to `proxy`; answers how many were allowed, and checks that
/// every answer is a local one: the rate-limit fields of the local quota (3 of 5 for two
/// instances), a 429 with `Retry-After` for the others.
async fn locally(client: &H1Client, proxy: &Proxy, key: &str, n: usize) -> usize {
    let mut allowed = 0;
    for i in 0..n {
        let answer = send(client, keyed(proxy, key)).await;
        let policy = answer.header("ratelimit-policy").unwrap_or("").to_owned();
        assert!(
            policy.contains("q=3"),
            "request {i}: the fields must show the local quota ceil(5 / 2) = 3: {policy:?} ({})",
            answer.status
        );
        match answer.status {
            StatusCode::OK => allowed += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert!(answer.header("retry-after").is_some(), "request {i}");
            }
            other => panic!("request {i}: unexpected {other}"),
        }
    }
    allowed
}

/// Sends requests with fresh keys until one is counted by the database again (its fields show
/// the configured quota of 5), for at most `within`.
async fn until_database_counts(client: &H1Client, proxy: &Proxy, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut i = 0;
    while Instant::now() < deadline {
        i += 1;
        let answer = send(client, keyed(proxy, &format!("probe-{i}"))).await;
        if answer
            .header("ratelimit-policy")
            .is_some_and(|p| p.contains("q=5"))
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The whole life of an outage: both instances registered (`tollgate_instances` 2), the
/// database cut, each instance admits exactly ceil(5 / 2) = 3 of 10, the switch is announced
/// once per instance, the decisions are `local_allowed` / `local_limited`; then the database
/// comes back and counting returns to it (what was counted locally is not written back).
#[tokio::test]
async fn database_cut_each_of_two_instances_admits_its_share_then_counting_returns() {
    let (log, _guard) = CapturedLog::warnings();
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let (a, b) = two_instances(&db, &relay, &upstream).await;
    until_both_see_two(&a, &b).await;
    let text = a.server().metrics().render();
    assert!(
        text.lines().any(|l| l == "tollgate_instances 2"),
        "tollgate_instances on /metrics:\n{text}"
    );
    let client = h1_client();
    // Counted by the database while it answers.
    let answer = send(&client, keyed(&a, "warm")).await;
    assert!(answer
        .header("ratelimit-policy")
        .is_some_and(|p| p.contains("q=5")));

    relay.down();
    assert_eq!(locally(&client, &a, "k", 10).await, 3, "instance a");
    assert_eq!(locally(&client, &b, "k", 10).await, 3, "instance b");
    for proxy in [&a, &b] {
        let text = proxy.server().metrics().render();
        let series =
            |d: &str| format!("tollgate_decisions_total{{route=\"api\",decision=\"{d}\"}}");
        assert_eq!(
            metric_value(&text, &series("local_allowed")),
            Some(3.0),
            "{text}"
        );
        assert_eq!(
            metric_value(&text, &series("local_limited")),
            Some(7.0),
            "{text}"
        );
        assert_eq!(metric_value(&text, &series("failed_open")), None, "{text}");
        // The route's one limit counts the same, per policy.
        let policy = |d: &str| -> f64 {
            text.lines()
                .filter(|l| {
                    l.starts_with("tollgate_policy_decisions_total{route=\"api\",")
                        && l.contains(&format!("decision=\"{d}\""))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        assert_eq!(
            (policy("local_allowed"), policy("local_limited")),
            (3.0, 7.0),
            "{text}"
        );
        assert_eq!(
            policy("failed_open") + policy("failed_closed"),
            0.0,
            "{text}"
        );
    }
    assert_eq!(
        log.lines()
            .iter()
            .filter(|l| l.contains(WARN_LOCAL))
            .count(),
        2,
        "announced once per instance:\n{}",
        log.text()
    );

    relay.up();
    for proxy in [&a, &b] {
        assert!(
            until_database_counts(&client, proxy, Duration::from_secs(5)).await,
            "counting never returned to the database"
        );
    }
    assert_eq!(
        log.lines().iter().filter(|l| l.contains(WARN_BACK)).count(),
        2,
        "the way back announced once per instance:\n{}",
        log.text()
    );
    // The database never saw the local counts of "k": it starts from zero, and counts for
    // both instances together again: 5 in all, then 429.
    let mut statuses = Vec::new();
    for i in 0..6 {
        let proxy = if i % 2 == 0 { &a } else { &b };
        statuses.push(send(&client, keyed(proxy, "k")).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
    assert_eq!(
        log.lines()
            .iter()
            .filter(|l| l.contains(WARN_LOCAL))
            .count(),
        2,
        "no new announcement without a new outage:\n{}",
        log.text()
    );
}

/// The database hung instead of cut (connections open, no byte moving): the requests that
/// wait for the store's timeout and those the breaker then skips are all decided locally,
/// 3 of 10 per instance.
#[tokio::test]
async fn database_hung_each_of_two_instances_admits_its_share() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let (a, b) = two_instances(&db, &relay, &upstream).await;
    until_both_see_two(&a, &b).await;
    let client = h1_client();
    relay.stall();
    assert_eq!(locally(&client, &a, "k", 10).await, 3, "instance a");
    assert_eq!(locally(&client, &b, "k", 10).await, 3, "instance b");
    assert_eq!(
        upstream.count(),
        6,
        "only the admitted requests reached the upstream"
    );
    relay.up();
    // The stalled connections must time out and be replaced first: generous on a loaded
    // machine (the answer comes as soon as counting is back).
    assert!(
        until_database_counts(&client, &a, Duration::from_secs(15)).await,
        "counting never returned to the database"
    );
}

/// The registry statement on its own: it counts the rows refreshed within 30 s (this one
/// included), not older ones, and deletes the rows of instances long dead.
#[tokio::test]
async fn the_registry_counts_live_rows_and_deletes_dead_ones() {
    let db = TestDb::new().await;
    let store = PostgresStore::new(&db.store_config()).expect("store");
    store.initialize("fp", true).await.expect("initialize");
    let pg = db.client().await;
    pg.batch_execute(
        "INSERT INTO tollgate_instances (id, seen_at) VALUES \
         ('other-live', now() - interval '5 seconds'), \
         ('just-dead', now() - interval '40 seconds'), \
         ('long-dead', now() - interval '1 hour')",
    )
    .await
    .expect("rows of other instances");
    assert_eq!(store.refresh_instance().await.expect("refresh"), 2);
    let ids: Vec<String> = pg
        .query("SELECT id FROM tollgate_instances ORDER BY id", &[])
        .await
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut expected = vec![
        "just-dead".to_owned(),
        "other-live".to_owned(),
        store.instance_id().to_owned(),
    ];
    expected.sort();
    assert_eq!(ids, expected, "the long-dead row is gone, the others stay");
    assert!(
        store.instance_id().len() == 32 && !store.instance_id().contains('.'),
        "the id is random hex, nothing about the host"
    );
    // Refreshing again is an update of the same row, not a new one.
    assert_eq!(store.refresh_instance().await.expect("refresh"), 2);
}

/// `tollgate check` accepts `local` in both places and prints it.
#[test]
fn check_accepts_and_prints_the_local_policy() {
    let dir = std::env::temp_dir().join(format!("tollgate-local-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nurl = \"postgres://tollgate@db.invalid/tollgate\"\non_error = \"local\"\n\
             [upstreams.app]\nurl = \"http://127.0.0.1:9\"\n{API_ROUTE}"
        ),
    )
    .expect("config");
    let out = tollgate_check(&path);
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("store       postgres (on_error = local)"),
        "{stdout}"
    );
    assert!(stdout.contains("(on_store_error = local)"), "{stdout}");
}

/// Route `api` (`/api`): `requests` per day per `X-Api-Key`, `local` when the store fails. A
/// day, so that a window boundary is unlikely to fall inside a test's few seconds.
fn api_route(requests: u32) -> String {
    format!(
        r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"
on_store_error = "local"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = {requests}
  window = "1d"
"#
    )
}

/// `n` instances on one database, all through `relay`, with the route of [`api_route`] and
/// `workers` connection workers each (more than one: requests are decided on several threads
/// at once). `store.timeout` is 2 s, generous for the database's decisions on a busy machine;
/// in a hang, only the first requests wait it out (then the breaker skips the store).
async fn instances_through(
    db: &TestDb,
    relay: &FaultyTcp,
    upstream: &Upstream,
    n: usize,
    requests: u32,
    workers: usize,
) -> Vec<Proxy> {
    let store = format!(
        "url = \"{}\"\ntimeout = \"2s\"\npool_size = 2",
        db.url_through(relay.addr)
    );
    let text = limits_config(
        &store,
        &format!("workers = {workers}"),
        &api_route(requests),
    );
    let mut proxies = Vec::new();
    for _ in 0..n {
        proxies.push(Proxy::start(config_from(&text, upstream.addr, &[])).await);
    }
    proxies
}

/// Waits until every one of `proxies` counts `live` instances, for at most `within`.
async fn until_all_see(proxies: &[&Proxy], live: i64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let seen: Vec<i64> = proxies
            .iter()
            .map(|p| p.server().metrics().instances.get())
            .collect();
        if seen.iter().all(|&s| s == live) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not every instance counted {live} live within {within:?}: tollgate_instances = {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `n` requests with `key` to each of `proxies`, all at once (`n * proxies` in flight
/// together); answers how many each one allowed. Every answer must show the limit `quota` in
/// its `RateLimit-Policy`, and be a 200 or a 429 with `Retry-After`.
async fn concurrently(
    client: &H1Client,
    proxies: &[&Proxy],
    key: &str,
    n: usize,
    quota: u32,
) -> Vec<usize> {
    let requests = proxies.iter().enumerate().flat_map(|(which, proxy)| {
        (0..n).map(move |_| async move { (which, send(client, keyed(proxy, key)).await) })
    });
    let mut allowed = vec![0; proxies.len()];
    let expected = format!(";q={quota};");
    for (which, answer) in futures_util::future::join_all(requests).await {
        let policy = answer.header("ratelimit-policy").unwrap_or("");
        assert!(
            policy.contains(&expected),
            "instance {which}: the fields must show the quota {quota}: {policy:?} ({})",
            answer.status
        );
        match answer.status {
            StatusCode::OK => allowed[which] += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert!(answer.header("retry-after").is_some(), "instance {which}");
            }
            other => panic!("instance {which}: unexpected {other}"),
        }
    }
    allowed
}

/// Sends requests with fresh keys until one is counted by the database again (its fields show
/// the configured `quota`), for at most `within`.
async fn until_counted_with(client: &H1Client, proxy: &Proxy, quota: u32, within: Duration) {
    let deadline = Instant::now() + within;
    let expected = format!(";q={quota};");
    for i in 0.. {
        let answer = send(client, keyed(proxy, &format!("probe-{i}"))).await;
        if answer
            .header("ratelimit-policy")
            .is_some_and(|p| p.contains(&expected))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "counting never returned to the database within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `local_allowed` and `local_limited` decisions of route `api` on `proxy`'s metrics.
fn local_decisions(proxy: &Proxy) -> (Option<f64>, Option<f64>) {
    let text = proxy.server().metrics().render();
    let series = |d: &str| format!("tollgate_decisions_total{{route=\"api\",decision=\"{d}\"}}");
    (
        metric_value(&text, &series("local_allowed")),
        metric_value(&text, &series("local_limited")),
    )
}

/// What the database counted in all, over every bucket and window.
async fn counted_in_database(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one("SELECT coalesce(sum(count), 0)::int8 FROM rate_limits", &[])
        .await
        .expect("sum of counts")
        .get(0)
}

/// After an outage both instances count in the database again: a fresh key, 20 requests
/// to each at once, all allowed with the configured quota's fields and all 40 counted there.
async fn both_count_in_database_again(
    db: &TestDb,
    client: &H1Client,
    a: &Proxy,
    b: &Proxy,
    quota: u32,
) {
    for proxy in [a, b] {
        until_counted_with(client, proxy, quota, Duration::from_secs(10)).await;
    }
    let before = counted_in_database(db).await;
    let allowed = concurrently(client, &[a, b], "after", 20, quota).await;
    assert_eq!(allowed, [20, 20], "decided by the database, nothing denied");
    assert_eq!(
        counted_in_database(db).await - before,
        40,
        "every request of the flood counted in the database"
    );
}

/// The database cut under concurrency: 200 requests to each of two instances at once, all
/// for one key, decided on several threads per instance. Each admits exactly ceil(101 / 2) =
/// 51, never one more, and exactly 102 reach the upstream; then counting returns to the
/// database on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_cut_two_instances_each_admit_exactly_their_share_of_concurrent_requests() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let proxies = instances_through(&db, &relay, &upstream, 2, 101, 3).await;
    let (a, b) = (&proxies[0], &proxies[1]);
    until_all_see(&[a, b], 2, Duration::from_secs(15)).await;
    let client = h1_client();

    relay.down();
    let allowed = concurrently(&client, &[a, b], "k", 200, 51).await;
    assert_eq!(allowed, [51, 51], "ceil(101 / 2) per instance");
    assert_eq!(
        upstream.count(),
        102,
        "only the admitted requests went upstream"
    );
    for proxy in [a, b] {
        assert_eq!(local_decisions(proxy), (Some(51.0), Some(149.0)));
    }

    relay.up();
    both_count_in_database_again(&db, &client, a, b, 101).await;
}

/// The same with the database hung instead of cut (connections open, no byte moving): the
/// requests that wait out `store.timeout` and those the breaker then skips are all decided
/// locally, exactly 51 of 200 admitted per instance; then the database answers again and
/// counting returns to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_hung_two_instances_each_admit_exactly_their_share_of_concurrent_requests() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let proxies = instances_through(&db, &relay, &upstream, 2, 101, 3).await;
    let (a, b) = (&proxies[0], &proxies[1]);
    until_all_see(&[a, b], 2, Duration::from_secs(15)).await;
    let client = h1_client();

    relay.stall();
    let allowed = concurrently(&client, &[a, b], "k", 200, 51).await;
    assert_eq!(allowed, [51, 51], "ceil(101 / 2) per instance");
    assert_eq!(
        upstream.count(),
        102,
        "only the admitted requests went upstream"
    );
    for proxy in [a, b] {
        assert_eq!(local_decisions(proxy), (Some(51.0), Some(149.0)));
    }

    relay.up();
    both_count_in_database_again(&db, &client, a, b, 101).await;
}

/// The rows in `tollgate_instances`, read past the relay.
async fn registered(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one("SELECT count(*) FROM tollgate_instances", &[])
        .await
        .expect("count of instances")
        .get(0)
}

/// A clean stop deregisters (contract §5b): of three instances, one is shut down; its row is gone
/// when the shutdown returns, the two others count 2 live instances within one refresh (not
/// 30 s later, when the row would have aged out), and in an outage right after, each admits
/// ceil(6 / 2) = 3 rather than ceil(6 / 3) = 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cleanly_stopped_instance_is_deregistered_and_the_survivors_share_grows() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let mut proxies = instances_through(&db, &relay, &upstream, 3, 6, 1).await;
    until_all_see(
        &[&proxies[0], &proxies[1], &proxies[2]],
        3,
        Duration::from_secs(15),
    )
    .await;
    assert_eq!(registered(&db).await, 3);

    let mut stopped = proxies.pop().expect("a third instance");
    let started = Instant::now();
    stopped.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "a clean stop took {:?}",
        started.elapsed()
    );
    assert_eq!(
        registered(&db).await,
        2,
        "the stopped instance's row is deleted"
    );
    let (a, b) = (&proxies[0], &proxies[1]);
    // One refresh interval (3 s) and some slack; the row would otherwise count for 30 s.
    until_all_see(&[a, b], 2, Duration::from_secs(5)).await;

    let client = h1_client();
    relay.down();
    let allowed = concurrently(&client, &[a, b], "k", 10, 3).await;
    assert_eq!(allowed, [3, 3], "ceil(6 / 2) per surviving instance");
}

/// Deregistration never holds up a shutdown: with the database hung, a clean stop takes about
/// a second more at most (the store's own timeout here is 10 s), and the row stays, to age
/// out after 30 s like a crashed instance's.
#[tokio::test]
async fn a_hung_database_does_not_hold_up_the_shutdown() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let store = format!(
        "url = \"{}\"\ntimeout = \"10s\"\npool_size = 2",
        db.url_through(relay.addr)
    );
    let text = limits_config(&store, "workers = 1", &api_route(6));
    let mut proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while registered(&db).await < 1 {
        assert!(Instant::now() < deadline, "the instance never registered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    relay.stall();
    let started = Instant::now();
    proxy.shutdown().await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "shutdown took {took:?} with the database hung"
    );
    assert!(
        took >= Duration::from_millis(900),
        "shutdown took {took:?}: it did not even try to deregister"
    );
    assert_eq!(registered(&db).await, 1, "the row is left to age out");
}
