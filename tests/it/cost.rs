//! Request cost (contract §3d, first bullet: `cost = N` on a limit), end to end on the memory
//! store and on a real PostgreSQL. Every request takes N units of its limit; it is admitted
//! only when its N units fit, and a denied request's units are not added (on either
//! algorithm), so what it could not use stays for a cheaper request of the same bucket. A
//! route's limits each take their own cost, and a request one limit denies takes nothing from
//! the others. The rate-limit fields, the row's `count` and `explain` are in units;
//! `reserve = true` takes N units of a share; a cost outside 1 to `requests` is a
//! configuration error naming its place in the file.
//!
//! Windows are 366 days, so that no window boundary passes during a test on the real clock.
//! Counts are asserted on PostgreSQL rows only after the store is ready (a decision before
//! that fails open, uncounted).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use serde_json::json;

use super::limits::flood;
use crate::common::db::TestDb;
use crate::common::ratelimit::members;
use crate::common::*;

/// The `[store]` body of the memory store.
const MEMORY: &str = "";

const WINDOW: &str = "366d";

const OK: StatusCode = StatusCode::OK;
const DENIED: StatusCode = StatusCode::TOO_MANY_REQUESTS;

/// The `[store]` body of a PostgreSQL test: its own database, and a decision budget generous
/// enough that no decision fails open on a loaded machine (it would read as a miscount).
fn pg(db: &TestDb) -> String {
    format!("url = \"{}\"\ntimeout = \"15s\"", db.url)
}

/// One `[[routes.limits]]` table; `extra` holds more of its keys (`algorithm`, `reserve`).
fn limit(scope: &str, key: &str, requests: u32, cost: u32, extra: &str) -> String {
    format!(
        "\n  [[routes.limits]]\n  key = \"{key}\"\n  scope = \"{scope}\"\n  requests = {requests}\n  \
         window = \"{WINDOW}\"\n  cost = {cost}\n{extra}\n"
    )
}

/// A route `/<name>` with these limits.
fn route(name: &str, limits: &[String]) -> String {
    format!(
        "\n[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"app\"\n{}",
        limits.concat()
    )
}

fn algorithm(name: &str) -> String {
    format!("  algorithm = \"{name}\"")
}

/// Starts tollgate on `text` and waits until its store decides.
async fn start(text: &str, upstream: &Upstream) -> Proxy {
    let proxy = Proxy::start(config_from(text, upstream.addr, &[])).await;
    proxy.until_store_ready(Duration::from_secs(30)).await;
    proxy
}

/// `param` of the `policy` member of the answer's structured field `field`.
fn param_of(answer: &Answer, field: &str, policy: &str, param: &str) -> u64 {
    let value = answer
        .header(field)
        .unwrap_or_else(|| panic!("no {field} field on a {} answer", answer.status));
    members(value)
        .iter()
        .find(|m| m.name == policy)
        .unwrap_or_else(|| panic!("no member {policy} in {field}: {value}"))
        .param(param)
}

/// The `violated-policies` of a 429's problem body.
fn violated(answer: &Answer) -> serde_json::Value {
    let problem: serde_json::Value =
        serde_json::from_slice(&answer.body).expect("a problem+json body on the 429");
    problem["violated-policies"].clone()
}

/// The counts of the rows whose bucket starts with `prefix`, smallest first.
async fn row_counts(db: &TestDb, prefix: &str) -> Vec<i32> {
    db.client()
        .await
        .query(
            "SELECT count FROM rate_limits WHERE starts_with(bucket, $1) ORDER BY count",
            &[&prefix],
        )
        .await
        .expect("the rows")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// A client of one running tollgate.
struct Client<'a> {
    http: H1Client,
    proxy: &'a Proxy,
}

impl<'a> Client<'a> {
    fn of(proxy: &'a Proxy) -> Self {
        Client {
            http: h1_client(),
            proxy,
        }
    }

    /// GET `path`, with an `x-user` field when `user` is given.
    async fn get(&self, path: &str, user: Option<&str>) -> Answer {
        let mut request = http::Request::get(self.proxy.url(path));
        if let Some(user) = user {
            request = request.header("x-user", user);
        }
        send(
            &self.http,
            request.body(Full::new(Bytes::new())).expect("request"),
        )
        .await
    }

    /// GET `path` and assert the status and, for each `(policy, r)`, the `r` of that policy's
    /// `RateLimit` member (`what` names the step in a failure).
    async fn expect(
        &self,
        path: &str,
        user: Option<&str>,
        status: StatusCode,
        left: &[(&str, u64)],
        what: &str,
    ) -> Answer {
        let answer = self.get(path, user).await;
        assert_eq!(answer.status, status, "{what}: {}", answer.text());
        for (policy, r) in left {
            assert_eq!(
                param_of(&answer, "ratelimit", policy, "r"),
                *r,
                "{what}: r of {policy} (the units left) in RateLimit: {:?}",
                answer.header("ratelimit")
            );
        }
        answer
    }
}

/// Route `/heavy` (cost 3) and route `/light` (cost 1) share the bucket `shared:ip` of
/// `requests` units (same scope, key, `requests` and `window`); both sets of rate-limit fields.
fn shared_bucket(store: &str, algorithm_name: &str, requests: u32) -> String {
    let algo = algorithm(algorithm_name);
    let routes = route("heavy", &[limit("shared", "ip", requests, 3, &algo)])
        + &route("light", &[limit("shared", "ip", requests, 1, &algo)]);
    limits_config(store, "rate_limit_headers = \"both\"", &routes)
}

/// `X-RateLimit-Remaining` of an answer whose route has one limit.
fn legacy_left(answer: &Answer) -> u64 {
    answer
        .header("x-ratelimit-remaining")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no X-RateLimit-Remaining on a {} answer", answer.status))
}

/// Three requests of cost 3 leave 7, 4, then 1 unit; the fourth does not fit in 1 and is
/// denied without taking it, so a request of cost 1 on the other route gets that unit.
async fn leftover_units_serve_a_cheaper_request(store: &str, algorithm_name: &str) {
    let upstream = Upstream::start().await;
    let mut proxy = start(&shared_bucket(store, algorithm_name, 10), &upstream).await;
    let client = Client::of(&proxy);
    for left in [7, 4, 1] {
        let what = format!("{algorithm_name}: cost 3 with {} units left", left + 3);
        let answer = client
            .expect("/heavy", None, OK, &[("shared:ip", left)], &what)
            .await;
        assert_eq!(
            param_of(&answer, "ratelimit-policy", "shared:ip", "q"),
            10,
            "{what}: q is `requests`, not requests / cost"
        );
        assert_eq!(legacy_left(&answer), left, "{what}: X-RateLimit-Remaining");
    }
    let what = format!("{algorithm_name}: cost 3 with 1 unit left (r stays 1: nothing taken)");
    let denied = client
        .expect("/heavy", None, DENIED, &[("shared:ip", 1)], &what)
        .await;
    assert_eq!(violated(&denied), json!(["shared:ip"]), "{what}");
    assert_eq!(legacy_left(&denied), 1, "{what}: X-RateLimit-Remaining");
    assert!(
        denied.header("retry-after").is_some(),
        "{what}: Retry-After"
    );
    let what = format!("{algorithm_name}: cost 1 on /light, the unit the denied request left");
    client
        .expect("/light", None, OK, &[("shared:ip", 0)], &what)
        .await;
    assert_eq!(
        upstream.count(),
        4,
        "{algorithm_name}: forwarded (never a 429)"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_fixed_leftover_units_serve_a_cheaper_request() {
    leftover_units_serve_a_cheaper_request(MEMORY, "fixed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_fixed_leftover_units_serve_a_cheaper_request() {
    let db = TestDb::new().await;
    leftover_units_serve_a_cheaper_request(&pg(&db), "fixed").await;
    assert_eq!(
        row_counts(&db, "shared:ip:").await,
        [10],
        "3 + 3 + 3 + 1 units (the denied request's 3 must not be added)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_sliding_leftover_units_serve_a_cheaper_request() {
    leftover_units_serve_a_cheaper_request(MEMORY, "sliding").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_sliding_leftover_units_serve_a_cheaper_request() {
    let db = TestDb::new().await;
    leftover_units_serve_a_cheaper_request(&pg(&db), "sliding").await;
    assert_eq!(
        row_counts(&db, "shared:ip:").await,
        [10],
        "one row (no previous window), counting 3 + 3 + 3 + 1 units"
    );
}

/// Route `/pair`: `user:x-user` (per `x-user` field) takes 2 of 10 units, `pool:global`
/// takes 5 of 40. Route `/user` has only `user:x-user`, at cost 1.
fn two_limits(store: &str) -> String {
    let routes = route(
        "pair",
        &[
            limit("user", "header:x-user", 10, 2, ""),
            limit("pool", "global", 40, 5, ""),
        ],
    ) + &route("user", &[limit("user", "header:x-user", 10, 1, "")]);
    limits_config(store, "", &routes)
}

/// Each limit of `/pair` moves by its own cost. When one denies, the other's units are not
/// taken, whichever of the two denies: after `u1`'s own limit denies, the pool still has the
/// 15 units that `u2` then spends; after the pool denies `u2`, `u2` still has 4 units, one of
/// which `/user` takes.
async fn each_limit_takes_its_own_cost(store: &str) {
    let upstream = Upstream::start().await;
    let mut proxy = start(&two_limits(store), &upstream).await;
    let client = Client::of(&proxy);
    for n in 1..=5 {
        let left = [("user:x-user", 10 - 2 * n), ("pool:global", 40 - 5 * n)];
        let what = format!("u1's request {n}");
        client.expect("/pair", Some("u1"), OK, &left, &what).await;
    }
    let left = [("user:x-user", 0), ("pool:global", 15)];
    let what = "u1's sixth: its own limit denies; the pool's 5 units are not taken";
    let denied = client
        .expect("/pair", Some("u1"), DENIED, &left, what)
        .await;
    assert_eq!(violated(&denied), json!(["user:x-user"]), "{what}");
    for n in 1..=3 {
        let left = [("user:x-user", 10 - 2 * n), ("pool:global", 15 - 5 * n)];
        let what = format!("u2's request {n}, on the 15 units u1's denial left in the pool");
        client.expect("/pair", Some("u2"), OK, &left, &what).await;
    }
    let left = [("user:x-user", 4), ("pool:global", 0)];
    let what = "u2's fourth: the pool denies; u2's 2 units are not taken";
    let denied = client
        .expect("/pair", Some("u2"), DENIED, &left, what)
        .await;
    assert_eq!(violated(&denied), json!(["pool:global"]), "{what}");
    let what = "u2 on /user (cost 1): 4 units were left";
    client
        .expect("/user", Some("u2"), OK, &[("user:x-user", 3)], what)
        .await;
    assert_eq!(upstream.count(), 9, "5 + 3 + 1 requests admitted");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_each_limit_takes_its_own_cost() {
    each_limit_takes_its_own_cost(MEMORY).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_each_limit_takes_its_own_cost() {
    let db = TestDb::new().await;
    each_limit_takes_its_own_cost(&pg(&db)).await;
    assert_eq!(
        row_counts(&db, "user:x-user:").await,
        [7, 10],
        "u2: 3 * 2 + 1 units, u1: 5 * 2 (a denied request's units are not added)"
    );
    assert_eq!(
        row_counts(&db, "pool:global").await,
        [40],
        "8 * 5 units (a denied request's units are not added)"
    );
}

/// Route `/one`: `user:x-user` 10 and `pool:global` 3, both at cost 1; route `/solo`: only
/// `user:x-user`.
fn unit_limits(store: &str, algorithm_name: &str) -> String {
    let algo = algorithm(algorithm_name);
    let routes = route(
        "one",
        &[
            limit("user", "header:x-user", 10, 1, &algo),
            limit("pool", "global", 3, 1, &algo),
        ],
    ) + &route("solo", &[limit("user", "header:x-user", 10, 1, &algo)]);
    limits_config(store, "", &routes)
}

/// Contract §3d, "a denied request's units are not added, on either algorithm", with the
/// default cost of 1: a request the pool denies takes nothing from its user's limit, and a
/// request its own full limit denies adds nothing to it either.
async fn unit_denials_take_nothing(store: &str, algorithm_name: &str) {
    let upstream = Upstream::start().await;
    let mut proxy = start(&unit_limits(store, algorithm_name), &upstream).await;
    let client = Client::of(&proxy);
    for n in 1..=3 {
        let left = [("user:x-user", 10 - n), ("pool:global", 3 - n)];
        let what = format!("{algorithm_name}: request {n} on /one");
        client.expect("/one", Some("u1"), OK, &left, &what).await;
    }
    for n in 1..=4 {
        let left = [("user:x-user", 7), ("pool:global", 0)];
        let what = format!("{algorithm_name}: denial {n} by the pool; u1 keeps 7");
        client
            .expect("/one", Some("u1"), DENIED, &left, &what)
            .await;
    }
    for n in 1..=7 {
        let what = format!("{algorithm_name}: /solo request {n} on the 7 units left");
        let left = [("user:x-user", 7 - n)];
        client.expect("/solo", Some("u1"), OK, &left, &what).await;
    }
    for n in 1..=3 {
        let what = format!("{algorithm_name}: /solo denial {n} on the full limit");
        let left = [("user:x-user", 0)];
        client
            .expect("/solo", Some("u1"), DENIED, &left, &what)
            .await;
    }
    assert_eq!(upstream.count(), 10, "{algorithm_name}: 3 + 7 admitted");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_unit_denials_take_nothing() {
    for algorithm_name in ["fixed", "sliding"] {
        unit_denials_take_nothing(MEMORY, algorithm_name).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_unit_denials_take_nothing() {
    for algorithm_name in ["fixed", "sliding"] {
        let db = TestDb::new().await;
        unit_denials_take_nothing(&pg(&db), algorithm_name).await;
        assert_eq!(
            row_counts(&db, "user:x-user:").await,
            [10],
            "{algorithm_name}: 3 + 7 admitted; 4 + 3 denials added nothing"
        );
        assert_eq!(
            row_counts(&db, "pool:global").await,
            [3],
            "{algorithm_name}: the pool's 4 denials added nothing"
        );
    }
}

/// Route `/limited`: one `global` limit of 10 units at cost 1.
fn unit_global(store: &str, algorithm_name: &str) -> String {
    let algo = algorithm(algorithm_name);
    let limits = [limit("limited", "global", 10, 1, &algo)];
    limits_config(store, "", &route("limited", &limits))
}

/// 60 concurrent requests of cost 1 on 10 units over two instances on one database: exactly
/// 10 are admitted and the row counts exactly those (the requests that arrive together are
/// folded into one row of more units than fit, which the store must split, not add).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_concurrent_unit_denials_add_nothing_across_instances() {
    for algorithm_name in ["fixed", "sliding"] {
        let db = TestDb::new().await;
        let upstream = Upstream::start().await;
        let text = unit_global(&pg(&db), algorithm_name);
        let mut a = start(&text, &upstream).await;
        let mut b = start(&text, &upstream).await;
        let ok = flood(&[a.addr, b.addr], 60, None).await;
        assert_eq!(ok, 10, "{algorithm_name}: admitted of 60 on 10");
        assert_eq!(
            row_counts(&db, "limited:global").await,
            [10],
            "{algorithm_name}: the row counts the admitted requests only"
        );
        a.shutdown().await;
        b.shutdown().await;
    }
}

/// Route `/limited`: one `global` limit of 100 units at cost 3.
fn costly_global(store: &str, algorithm_name: &str) -> String {
    let algo = algorithm(algorithm_name);
    let limits = [limit("limited", "global", 100, 3, &algo)];
    limits_config(store, "", &route("limited", &limits))
}

/// 60 concurrent requests of cost 3 on 100 units, over as many connections as the client
/// opens: exactly 33 fit (99 units); the last unit fits none of them.
async fn concurrent_requests_take_exactly_what_fits(store: &str, algorithm_name: &str) {
    let upstream = Upstream::start().await;
    let mut proxy = start(&costly_global(store, algorithm_name), &upstream).await;
    let ok = flood(&[proxy.addr], 60, None).await;
    assert_eq!(ok, 33, "{algorithm_name}: admitted of 60 at cost 3 on 100");
    assert_eq!(upstream.count(), 33, "{algorithm_name}: forwarded");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_concurrent_requests_take_exactly_what_fits() {
    for algorithm_name in ["fixed", "sliding"] {
        concurrent_requests_take_exactly_what_fits(MEMORY, algorithm_name).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_concurrent_requests_take_exactly_what_fits() {
    for algorithm_name in ["fixed", "sliding"] {
        let db = TestDb::new().await;
        concurrent_requests_take_exactly_what_fits(&pg(&db), algorithm_name).await;
        assert_eq!(
            row_counts(&db, "limited:global").await,
            [99],
            "{algorithm_name}: 33 * 3 units (denied requests' units must not be added)"
        );
    }
}

/// 40 requests of cost 3 and 40 of cost 1, all at once on one bucket of 100 units, spread over
/// `proxies`: the admitted units never pass 100; a cost-1 request is denied only once all 100
/// are taken, and otherwise at most 2 are left (too few for cost 3). Answers the admitted
/// units and the cost-1 requests denied.
async fn mixed_costs_fill_the_bucket(proxies: &[&Proxy], upstream: &Upstream) -> (usize, usize) {
    let client = h1_client();
    let mut tasks = Vec::new();
    for i in 0..80 {
        let path = if i % 2 == 0 { "/heavy" } else { "/light" };
        let url = proxies[i % proxies.len()].url(path);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            (path, get(&client, &url).await.status)
        }));
    }
    let (mut units, mut light_denied) = (0, 0);
    for task in tasks {
        match task.await.expect("request task") {
            (path, OK) => units += if path == "/heavy" { 3 } else { 1 },
            (path, DENIED) => light_denied += usize::from(path == "/light"),
            (path, other) => panic!("{path}: unexpected {other}"),
        }
    }
    let forwarded: usize = upstream
        .requests()
        .iter()
        .map(|r| if r.uri.starts_with("/heavy") { 3 } else { 1 })
        .sum();
    assert_eq!(forwarded, units, "units of the forwarded requests");
    assert!(units <= 100, "{units} units admitted of 100");
    if light_denied > 0 {
        assert_eq!(units, 100, "a cost-1 request was denied with units left");
    } else {
        assert!(
            units >= 98,
            "{units} units admitted: a cost-3 request denied with 3 left"
        );
    }
    (units, light_denied)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_mixed_costs_fill_the_bucket() {
    for algorithm_name in ["fixed", "sliding"] {
        let upstream = Upstream::start().await;
        let mut proxy = start(&shared_bucket(MEMORY, algorithm_name, 100), &upstream).await;
        let _ = mixed_costs_fill_the_bucket(&[&proxy], &upstream).await;
        proxy.shutdown().await;
    }
}

/// The same over two instances on one database: the row counts exactly the admitted units.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_mixed_costs_fill_the_bucket_across_instances() {
    for algorithm_name in ["fixed", "sliding"] {
        let db = TestDb::new().await;
        let upstream = Upstream::start().await;
        let text = shared_bucket(&pg(&db), algorithm_name, 100);
        let mut a = start(&text, &upstream).await;
        let mut b = start(&text, &upstream).await;
        let (units, light_denied) = mixed_costs_fill_the_bucket(&[&a, &b], &upstream).await;
        // No denied request's units are in the row, of either cost.
        let row = row_counts(&db, "shared:ip:").await;
        assert_eq!(
            row,
            [units as i32],
            "{algorithm_name}: {units} units admitted, {light_denied} cost-1 denials"
        );
        a.shutdown().await;
        b.shutdown().await;
    }
}

/// Route `/four` takes 4 of `four:ip`'s 20 units per request and `/three` 3 of `three:ip`'s
/// 20; both limits reserve shares (contract §3c).
fn reserving(store: &str) -> String {
    let reserve = "  reserve = true";
    let routes = route("four", &[limit("four", "ip", 20, 4, reserve)])
        + &route("three", &[limit("three", "ip", 20, 3, reserve)]);
    // One worker: shares are per worker, and `r` across workers is the next test's matter.
    limits_config(store, "workers = 1", &routes)
}

/// With shares, a request of cost N takes N units: requests one after another on one
/// instance admit exactly floor(20 / N), and `r` (the row's units left plus the instance's
/// unused ones) falls by N. On PostgreSQL the test first waits for the instance to hear
/// reclaims (`LISTEN`): until then it gives idle shares back, and `r` can miss units that are
/// on their way back to the row when a slow machine makes a share idle between two requests.
async fn shares_hand_out_units(store: &str, listens: bool) {
    let upstream = Upstream::start().await;
    let mut proxy = start(&reserving(store), &upstream).await;
    if listens {
        proxy.until_hearing_resets(Duration::from_secs(30)).await;
    }
    let client = Client::of(&proxy);
    for (name, cost, fits) in [("four", 4, 5), ("three", 3, 6)] {
        let path = format!("/{name}");
        let policy = format!("{name}:ip");
        for n in 1..=fits {
            let left = [(policy.as_str(), 20 - cost * n)];
            let what = format!("{name}: request {n} of cost {cost}");
            client.expect(&path, None, OK, &left, &what).await;
        }
        let left = [(policy.as_str(), 20 - cost * fits)];
        let what = format!("{name}: request {} of cost {cost}", fits + 1);
        client.expect(&path, None, DENIED, &left, &what).await;
    }
    assert_eq!(upstream.count(), 11, "5 + 6 admitted");
    proxy.shutdown().await;
}

/// The memory store decides `reserve` limits in memory (contract §3c): same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_reserve_takes_cost_units() {
    shares_hand_out_units(MEMORY, false).await;
}

/// On PostgreSQL, once the instance has stopped (its unused units given back), each row
/// counts exactly the units of the requests admitted: 5 * 4 = 20, and 6 * 3 = 18 (the 2
/// units too few for a seventh request are not kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_reserve_takes_cost_units_and_gives_the_rest_back() {
    let db = TestDb::new().await;
    shares_hand_out_units(&pg(&db), true).await;
    assert_eq!(row_counts(&db, "four:ip:").await, [20], "5 * 4 units");
    assert_eq!(
        row_counts(&db, "three:ip:").await,
        [18],
        "6 * 3 units, after the give-back at shutdown"
    );
}

/// Contract §3c: `r` is what the row leaves plus the unused units of this *instance*, however
/// its workers share them out. One instance with two workers, a reserving limit of 60 units
/// at cost 2, requests one after another over 8 connections in turn (each connection stays
/// on the worker that accepted it, so both workers serve some): every answer's `r` is exactly
/// 60 minus the units admitted so far. (A correct instance gives these figures whatever the
/// workers' shares; one that reports a worker's own share can only be caught when the
/// connections land on both workers, which 8 connections make all but certain.)
async fn r_counts_every_workers_units(store: &str, listens: bool) {
    let upstream = Upstream::start().await;
    let limits = [limit("spread", "ip", 60, 2, "  reserve = true")];
    let text = limits_config(store, "workers = 2", &route("spread", &limits));
    let mut proxy = start(&text, &upstream).await;
    if listens {
        proxy.until_hearing_resets(Duration::from_secs(30)).await;
    }
    let clients: Vec<Client> = (0..8).map(|_| Client::of(&proxy)).collect();
    let mut seen = Vec::new();
    for n in 1..=31u64 {
        let answer = clients[n as usize % clients.len()]
            .get("/spread", None)
            .await;
        let r = param_of(&answer, "ratelimit", "spread:ip", "r");
        seen.push((n, answer.status.as_u16(), r));
    }
    let want: Vec<(u64, u16, u64)> = (1..=31u64)
        .map(|n| (n, if n <= 30 { 200 } else { 429 }, 60 - 2 * n.min(30)))
        .collect();
    assert_eq!(
        seen, want,
        "(request, status, r) of 31 requests of cost 2 on 60 units"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_reserve_r_counts_every_workers_units() {
    r_counts_every_workers_units(MEMORY, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_reserve_r_counts_every_workers_units() {
    let db = TestDb::new().await;
    r_counts_every_workers_units(&pg(&db), true).await;
    assert_eq!(row_counts(&db, "spread:ip:").await, [60], "30 * 2 units");
}

/// Writes `text` to a configuration file of this test's own.
fn write_config(tag: &str, text: &str) -> PathBuf {
    write_config_file("cost", tag, text)
}

/// A file whose one limit has `cost = {cost}` and `requests = 10`; answers the file's text
/// and the line and column (1-based) of the cost's value.
fn cost_file(cost: &str) -> (String, usize, usize) {
    let text = format!(
        "[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nname = \"r\"\n\
         upstream = \"app\"\n\n  [[routes.limits]]\n  key = \"ip\"\n  requests = 10\n  \
         window = \"1m\"\n  cost = {cost}\n"
    );
    let (line, column) = text
        .lines()
        .enumerate()
        .find_map(|(i, l)| {
            let value = l.trim_start().strip_prefix("cost = ")?;
            Some((i + 1, l.len() - value.len() + 1))
        })
        .expect("the cost line");
    (text, line, column)
}

/// `cost = 0` and `cost = 11` (of 10) make `check` exit 2 with a line
/// `FILE:LINE:COL: routes[0].limits[0].cost: ...` at the cost's value; 1 and 10 pass.
#[test]
fn a_cost_outside_one_to_requests_is_a_configuration_error() {
    for cost in ["0", "11"] {
        let (text, line, column) = cost_file(cost);
        let path = write_config(&format!("bad-{cost}"), &text);
        let out = tollgate_check(&path);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "cost = {cost}: {stderr}");
        let want = format!(
            "{}:{line}:{column}: routes[0].limits[0].cost",
            path.display()
        );
        assert!(
            stderr.lines().any(|l| l.starts_with(&want)),
            "cost = {cost}: expected a line starting with\n  {want}\ngot:\n{stderr}"
        );
    }
    for cost in ["1", "10"] {
        let (text, _, _) = cost_file(cost);
        let out = tollgate_check(&write_config(&format!("good-{cost}"), &text));
        assert!(
            out.status.success(),
            "cost = {cost} of 10: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `tollgate explain --ip 127.0.0.1 GET http://t{path}` on `config`: its stdout.
async fn explain(config: &Path, path: &str) -> String {
    let config = config.to_path_buf();
    let url = format!("http://t{path}");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "--config"])
            .arg(&config)
            .args(["--ip", "127.0.0.1", "GET", &url])
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("RUST_LOG")
            .output()
            .expect("run explain")
    })
    .await
    .expect("explain task");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "explain {path}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The first line of `output` that starts with `start` and contains `having`.
fn line_of<'a>(output: &'a str, start: &str, having: &str) -> &'a str {
    output
        .lines()
        .find(|l| l.starts_with(start) && l.contains(having))
        .unwrap_or_else(|| panic!("no {start} line with {having} in:\n{output}"))
}

/// Whether `line` says `n` units are left, in any of the usual spellings ("1 left",
/// "1 units left", "left 1", "left: 1", "left=1").
fn says_left(line: &str, n: u32) -> bool {
    let n = n.to_string();
    let words: Vec<&str> = line
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    words.iter().enumerate().any(|(i, word)| {
        let before = |k: usize| i.checked_sub(k).map(|j| words[j]);
        *word == "left"
            && (words.get(i + 1) == Some(&n.as_str())
                || before(1) == Some(n.as_str())
                || (before(1) == Some("units") && before(2) == Some(n.as_str())))
    })
}

/// `explain` reads units: after three requests of cost 3 on 10, the bucket counts 9 with 1
/// unit left; a request of cost 3 would be limited, one of cost 1 (`/light`, same bucket)
/// allowed. (PostgreSQL only: with the memory store the counts live in the running process
/// and `explain` shows 0.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_explain_shows_units() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = shared_bucket(&pg(&db), "fixed", 10);
    let mut proxy = start(&text, &upstream).await;
    let client = Client::of(&proxy);
    for left in [7, 4, 1] {
        let what = format!("cost 3 with {} units left", left + 3);
        client
            .expect("/heavy", None, OK, &[("shared:ip", left)], &what)
            .await;
    }
    let config = write_config(
        "explain",
        &text.replace("@UPSTREAM@", &upstream.addr.to_string()),
    );
    for (path, decision) in [("/heavy", "limited"), ("/light", "allowed")] {
        let output = explain(&config, path).await;
        let limit_line = line_of(&output, "limit", "shared:ip");
        assert!(
            limit_line.contains("count 9"),
            "{path}: 3 requests of cost 3 count 9 units:\n{output}"
        );
        assert!(says_left(limit_line, 1), "{path}: 1 unit left:\n{output}");
        let decision_line = line_of(&output, "decision", "");
        assert!(
            decision_line.contains(decision),
            "{path}: expected {decision}:\n{output}"
        );
    }
    assert_eq!(
        row_counts(&db, "shared:ip:").await,
        [9],
        "explain reads, never increments"
    );
    proxy.shutdown().await;
}
