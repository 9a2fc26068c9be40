//! Reserved shares (contract §3c; issue 49), end to end on a real PostgreSQL: exactness on one
//! instance and across three, the units given back at shutdown, on a reload, on a reset and to
//! an instance that finds the bucket exhausted, what an instance killed while holding a share
//! costs, a pooler that cannot `LISTEN`, an outage under `on_error = "local"`, and the rule
//! that sizes a share, held against the function itself.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http::StatusCode;

use super::limits::{flood, metric_value};
use crate::common::db::TestDb;
use crate::common::faulty::FaultyTcp;
use crate::common::pgbouncer::{PgBouncer, PoolMode};
use crate::common::*;

/// A route `/limited` whose one limit (`key`) reserves.
fn reserved(store: &str, key: &str, requests: u32, algorithm: &str, server_extra: &str) -> String {
    let route = format!(
        r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"

  [[routes.limits]]
  key = {key}
  requests = {requests}
  window = "366d"
  algorithm = "{algorithm}"
  reserve = true
"#
    );
    limits_config(store, server_extra, &route)
}

/// The `[store]` body: this test's database (or `url`), a generous budget.
fn store_at(url: &str, extra: &str) -> String {
    format!("url = \"{url}\"\ntimeout = \"15s\"\npool_size = 4\n{extra}")
}

async fn started(text: &str, upstream: &Upstream) -> Proxy {
    let proxy = Proxy::start(config_from(text, upstream.addr, &[])).await;
    proxy.until_store_ready(Duration::from_secs(30)).await;
    proxy
}

/// The current window's count of the bucket of `limited:` rows (the sum: one bucket).
async fn stored(db: &TestDb) -> i64 {
    let pg = db.client().await;
    let row = pg
        .query_one(
            "SELECT COALESCE(sum(count), 0)::int8 FROM rate_limits \
             WHERE bucket LIKE 'limited:%' AND expires_at > now() AND window_start <= now()",
            &[],
        )
        .await
        .expect("count");
    row.get(0)
}

fn reserved_units(proxy: &Proxy) -> f64 {
    metric_value(
        &proxy.server().metrics().render(),
        "tollgate_reserved_units",
    )
}

fn round_trips(proxy: &Proxy) -> f64 {
    metric_value(
        &proxy.server().metrics().render(),
        "tollgate_store_round_trips_total",
    )
}

/// Sends `n` requests one after another to `proxy`; answers how many were admitted.
async fn one_by_one(proxy: &Proxy, n: usize) -> usize {
    let client = h1_client();
    let mut ok = 0;
    for _ in 0..n {
        match get(&client, &proxy.url("/limited")).await.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected status {other}"),
        }
    }
    ok
}

/// Sends requests one after another to `proxy` until one is denied (at most `n`); answers how
/// many were admitted.
async fn admitted_until_denied(proxy: &Proxy, n: usize) -> usize {
    let client = h1_client();
    for ok in 0..n {
        match get(&client, &proxy.url("/limited")).await.status {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS => return ok,
            other => panic!("unexpected status {other}"),
        }
    }
    n
}

/// `tollgate_decisions_total` of route `limited` with this decision.
fn decisions(proxy: &Proxy, decision: &str) -> f64 {
    let text = proxy.server().metrics().render();
    let label = format!("decision=\"{decision}\"");
    text.lines()
        .filter(|l| l.starts_with("tollgate_decisions_total{"))
        .filter(|l| l.contains("route=\"limited\"") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends rounds of requests to every proxy until one round admits nothing on any of them
/// after a pause of more than a second (units given back come back within one); answers the
/// total admitted.
async fn until_nothing_is_left(proxies: &[&Proxy]) -> usize {
    let mut total = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut round = 0;
        for proxy in proxies {
            round += one_by_one(proxy, 20).await;
        }
        total += round;
        if round == 0 {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let mut again = 0;
            for proxy in proxies {
                again += one_by_one(proxy, 5).await;
            }
            total += again;
            if again == 0 {
                return total;
            }
        }
        assert!(
            Instant::now() < deadline,
            "still admitting after 30 s: {total}"
        );
    }
}

/// One instance, two workers: of N requests exactly min(N, requests) are admitted, and once
/// it stops the row holds exactly what was admitted (every unused unit went back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_admits_exactly_min_n_requests() {
    for (n, requests) in [(100usize, 150u32), (600, 150)] {
        let db = TestDb::new().await;
        let upstream = Upstream::start().await;
        let text = reserved(
            &store_at(&db.url, ""),
            "\"global\"",
            requests,
            "fixed",
            "workers = 2",
        );
        let mut proxy = started(&text, &upstream).await;
        let ok = flood(&[proxy.addr], n, None).await;
        assert_eq!(
            ok,
            n.min(requests as usize),
            "{n} requests, limit {requests}"
        );
        assert_eq!(upstream.count(), ok);
        proxy.shutdown().await;
        assert_eq!(stored(&db).await, ok as i64, "the row after the give-back");
    }
}

/// The headline guarantee with shares: three instances on one bucket under concurrent load
/// never admit more than `requests`; units held by one instance come back to the others
/// within a second of their asking, so the total reaches exactly `requests`; and the share
/// statements are far fewer than the requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_never_exceed_and_reach_the_limit() {
    for algorithm in ["fixed", "sliding"] {
        let db = TestDb::new().await;
        let upstream = Upstream::start().await;
        let text = reserved(&store_at(&db.url, ""), "\"global\"", 300, algorithm, "");
        let mut proxies = Vec::new();
        for _ in 0..3 {
            proxies.push(started(&text, &upstream).await);
        }
        for proxy in &proxies {
            proxy.until_hearing_resets(Duration::from_secs(30)).await;
        }
        let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
        let first = flood(&addrs, 240, None).await;
        assert!(
            first >= 150,
            "{algorithm}: far from the limit, {first} of 240 admitted"
        );
        let second = flood(&addrs, 600, None).await;
        assert!(
            first + second <= 300,
            "{algorithm}: {first} + {second} admitted"
        );
        let refs: Vec<&Proxy> = proxies.iter().collect();
        let rest = until_nothing_is_left(&refs).await;
        assert_eq!(
            first + second + rest,
            300,
            "{algorithm}: the total reaches the limit once shares come back"
        );
        assert_eq!(upstream.count(), 300);
        let statements: f64 = proxies.iter().map(round_trips).sum();
        assert!(statements < 240.0, "{algorithm}: {statements} statements");
        for proxy in &mut proxies {
            proxy.shutdown().await;
        }
        assert_eq!(
            stored(&db).await,
            300,
            "{algorithm}: the row counts what was admitted"
        );
    }
}

/// `tollgate_reserved_units` rises while an instance holds a share and is 0 after SIGTERM's
/// give-back; the row then counts exactly the admitted requests.
#[tokio::test]
async fn sigterm_gives_every_unused_unit_back() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = reserved(
        &store_at(&db.url, ""),
        "\"ip\"",
        1000,
        "fixed",
        "workers = 1",
    );
    let mut proxy = started(&text, &upstream).await;
    // The listener's start gives back what was taken before it (a reset may have been missed).
    proxy.until_hearing_resets(Duration::from_secs(30)).await;
    assert_eq!(one_by_one(&proxy, 20).await, 20);
    // The gauge is brought up to date by the give-back task (every 250 ms).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let held = reserved_units(&proxy);
    assert!(
        held >= 1.0,
        "tollgate_reserved_units {held} while holding a share"
    );
    assert!(stored(&db).await > 20, "the row counts the share");
    let metrics = proxy.server().metrics().clone();
    proxy.shutdown().await;
    let after = metric_value(&metrics.render(), "tollgate_reserved_units");
    assert_eq!(after, 0.0, "tollgate_reserved_units after the give-back");
    assert_eq!(stored(&db).await, 20);
}

/// An instance that finds the bucket exhausted while another holds units asks for them
/// (`NOTIFY`); they come back within a second and are then admitted there. The holder's
/// gauge falls back to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_held_elsewhere_come_back_within_a_second() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = reserved(
        &store_at(&db.url, ""),
        "\"global\"",
        20,
        "fixed",
        "workers = 1",
    );
    let a = started(&text, &upstream).await;
    let b = started(&text, &upstream).await;
    a.until_hearing_resets(Duration::from_secs(30)).await;
    b.until_hearing_resets(Duration::from_secs(30)).await;
    // Two requests on `a`: the second grant takes a share (half of what is left at most).
    assert_eq!(one_by_one(&a, 2).await, 2);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let held = reserved_units(&a);
    assert!(held >= 1.0, "a holds {held}");
    // `b` takes what the row leaves, then is denied while `a` holds units.
    let on_b = admitted_until_denied(&b, 30).await;
    assert!(on_b < 18, "b admitted {on_b} while a holds {held}");
    let denied_at = Instant::now();
    let mut total_b = on_b;
    while total_b < 18 {
        assert!(
            denied_at.elapsed() < Duration::from_secs(3),
            "a's units did not come back: b admitted {total_b} of 18"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        total_b += one_by_one(&b, 1).await;
    }
    assert_eq!(total_b, 18, "b admits exactly what a gave back");
    assert_eq!(one_by_one(&b, 5).await, 0);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(reserved_units(&a), 0.0, "a's gauge after the reclaim");
    assert_eq!(upstream.count(), 20);
}

/// `tollgate reset` with shares held: the shares are dropped on every instance (they counted in
/// the deleted row), so the client gets exactly a fresh budget afterwards, not the fresh budget
/// plus the old share.
#[tokio::test]
async fn reset_drops_shares_everywhere() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = reserved(
        &store_at(&db.url, ""),
        "\"ip\"",
        100,
        "fixed",
        "workers = 1",
    );
    let proxy = started(&text, &upstream).await;
    proxy.until_hearing_resets(Duration::from_secs(30)).await;
    assert_eq!(one_by_one(&proxy, 10).await, 10);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(reserved_units(&proxy) >= 1.0, "a share is held");
    let path = config_file("reset", &text, &upstream);
    let out = run_cli(&path, "reset").await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        one_by_one(&proxy, 150).await,
        100,
        "exactly the fresh budget"
    );
}

/// A reload that lowers `requests` below what is reserved: the old shares go back within a
/// second, and the new limit holds exactly.
#[tokio::test]
async fn a_reload_that_lowers_the_limit_gives_shares_back() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = reserved(
        &store_at(&db.url, ""),
        "\"ip\"",
        100,
        "fixed",
        "workers = 1",
    );
    let proxy = started(&text, &upstream).await;
    assert_eq!(one_by_one(&proxy, 4).await, 4);
    assert!(
        stored(&db).await > 10,
        "a share of the old limit is counted"
    );
    let lower = text.replace("requests = 100", "requests = 10");
    assert!(
        proxy
            .server()
            .reload(config_from(&lower, upstream.addr, &[]))
            .await
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(stored(&db).await, 4, "the old share went back");
    assert_eq!(
        one_by_one(&proxy, 30).await,
        6,
        "10 - 4 under the new limit"
    );
}

/// An instance killed (SIGKILL) while it holds a share: the others never admit more than the
/// limit; its unused units stay counted (they can deny early, never admit more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_never_lets_the_others_exceed() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = reserved(
        &store_at(&db.url, ""),
        "\"global\"",
        100,
        "fixed",
        "workers = 1",
    )
    .replace("127.0.0.1:0", "127.0.0.1:@PORT@");
    let port = free_port();
    let path = config_file(
        "killed",
        &text.replace("@PORT@", &port.to_string()),
        &upstream,
    );
    let mut child = spawn_tollgate(&path);
    let killed_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let admitted_by_killed = admitted_by_child(killed_addr, 10).await;
    assert_eq!(admitted_by_killed, 10);
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let held = stored(&db).await;
    assert!(held > 10, "the killed instance held a share: row {held}");
    let other = started(&text.replace("@PORT@", "0"), &upstream).await;
    let on_other = until_nothing_is_left(&[&other]).await;
    assert!(
        admitted_by_killed + on_other <= 100,
        "{admitted_by_killed} + {on_other} admitted"
    );
    assert_eq!(
        on_other as i64,
        100 - held,
        "the other admits what the row leaves; the dead share is lost until the window ends"
    );
}

/// Through PgBouncer in transaction mode no `LISTEN` is possible: an instance there gives
/// units back within a second of last using them, so another instance still gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_transaction_pooler_idle_units_go_back_by_themselves() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, PoolMode::Transaction, 4);
    let upstream = Upstream::start().await;
    let pooled = store_at(&db.url_through(bouncer.addr), "");
    let text = reserved(&pooled, "\"global\"", 20, "fixed", "workers = 1");
    let a = started(&text, &upstream).await;
    let b = started(&text, &upstream).await;
    assert_eq!(one_by_one(&a, 2).await, 2);
    let on_b = one_by_one(&b, 30).await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let later = one_by_one(&b, 30).await;
    assert_eq!(
        2 + on_b + later,
        20,
        "b got a's idle units: {on_b} then {later}"
    );
    assert_eq!(upstream.count(), 20);
}

/// A store outage under `on_error = "local"` while a share is held: the instance goes on
/// admitting from the units it holds (decided `allowed`), then counts locally.
#[tokio::test]
async fn an_outage_admits_from_units_held_then_counts_locally() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let store = store_at(&db.url_through(relay.addr), "on_error = \"local\"")
        .replace("timeout = \"15s\"", "timeout = \"500ms\"");
    let text = reserved(&store, "\"ip\"", 1000, "fixed", "workers = 1");
    let proxy = started(&text, &upstream).await;
    proxy.until_hearing_resets(Duration::from_secs(30)).await;
    assert_eq!(one_by_one(&proxy, 3).await, 3);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = reserved_units(&proxy) as usize;
    assert!(held >= 5, "a share is held: {held}");
    relay.down();
    let allowed = decisions(&proxy, "allowed");
    assert_eq!(one_by_one(&proxy, held).await, held);
    assert_eq!(
        decisions(&proxy, "allowed") - allowed,
        held as f64,
        "decided from the share while the store is down"
    );
    assert_eq!(decisions(&proxy, "local_allowed"), 0.0);
    assert_eq!(one_by_one(&proxy, 3).await, 3);
    assert_eq!(
        decisions(&proxy, "local_allowed"),
        3.0,
        "then counted locally"
    );
}

/// The share-size rule of contract §3c (with §3d's units a request needs), held against
/// `tollgate_reserve` itself on random rows: never more than `floor(left / (2 * instances))`
/// unless that is below what is needed, at least what is needed while that much is left and
/// nothing otherwise, never more than asked (or needed), never past the limit.
#[tokio::test]
async fn the_share_size_rule_holds_for_random_rows() {
    use proptest::strategy::{Strategy, ValueTree};
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    // The migrations are the server's: start one to apply them.
    let text = reserved(&store_at(&db.url, ""), "\"ip\"", 10, "fixed", "");
    let mut proxy = started(&text, &upstream).await;
    proxy.shutdown().await;
    let pg = db.client().await;
    let cases = (1i64..5000, 0u32..=100, 1i32..20, 1i64..10_000, 1i64..8);
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for case in 0..300 {
        let (requests, used_pct, instances, want, need) =
            cases.new_tree(&mut runner).expect("case").current();
        let count = requests * i64::from(used_pct) / 100;
        let bucket = format!("prop:ip:{case}");
        pg.execute(
            "INSERT INTO rate_limits (bucket, window_start, count, expires_at) \
             VALUES ($1, to_timestamp(floor(extract(epoch FROM now()) / 60) * 60), $2, \
                     to_timestamp(floor(extract(epoch FROM now()) / 60) * 60 + 60))",
            &[&bucket, &(count as i32)],
        )
        .await
        .expect("row");
        let row = pg
            .query_one(
                "SELECT granted, count FROM tollgate_reserve(ARRAY[$1], ARRAY[60::int8], \
                 ARRAY[$2::int8], ARRAY[false], ARRAY[$3::int8], ARRAY[$5::int8], $4, 'prop', \
                 false)",
                &[&bucket, &requests, &want, &instances, &need],
            )
            .await
            .expect("grant");
        let (granted, after): (i64, i32) = (row.get(0), row.get(1));
        let left = requests - count;
        let cap = (left / (2 * i64::from(instances))).max(need);
        let seen = format!(
            "requests {requests} count {count} instances {instances} want {want} need {need}: granted {granted}"
        );
        assert!(granted <= want.max(need), "{seen}");
        if left >= need {
            assert!(granted >= need, "{seen}");
            assert!(granted <= cap, "{seen}");
        } else {
            assert_eq!(granted, 0, "{seen}");
        }
        assert!(i64::from(after) <= requests.max(count), "{seen}");
        assert_eq!(i64::from(after), count + granted, "{seen}");
    }
}

/// A free TCP port on 127.0.0.1 (for a child process, which cannot report the port it chose).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// Writes `text` (with `@UPSTREAM@` filled in) to a file of this test's own.
fn config_file(name: &str, text: &str, upstream: &Upstream) -> PathBuf {
    let text = text.replace("@UPSTREAM@", &upstream.addr.to_string());
    write_config_file("reserve", name, &text)
}

/// Runs `tollgate COMMAND --config PATH --ip 127.0.0.1 GET http://t/limited`.
async fn run_cli(path: &Path, command: &'static str) -> std::process::Output {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([command, "--config"])
            .arg(&path)
            .args(["--ip", "127.0.0.1", "GET", "http://t/limited"])
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("TOLLGATE_CONFIG")
            .output()
            .expect("run tollgate")
    })
    .await
    .expect("cli task")
}

fn spawn_tollgate(path: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--config"])
        .arg(path)
        .env("RUST_LOG", "warn")
        .env_remove("TOLLGATE_DATABASE_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tollgate")
}

/// Sends `n` requests one by one to a child tollgate at `addr` (waiting for it to listen and
/// to count); answers how many were admitted.
async fn admitted_by_child(addr: SocketAddr, n: usize) -> usize {
    let client = h1_client();
    let url = format!("http://{addr}/limited");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ok = 0;
    while ok < n {
        assert!(
            Instant::now() < deadline,
            "the child admitted {ok} of {n} within 30 s"
        );
        let req = http::Request::get(&url)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .expect("request");
        match client.request(req).await {
            Ok(r) if r.status() == StatusCode::OK => {
                // Before the store is ready a decision may fail open: only a counted one
                // carries the rate-limit fields.
                if r.headers().contains_key("ratelimit") {
                    ok += 1;
                }
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    ok
}

/// `tollgate check` says which limits reserve.
#[tokio::test]
async fn check_names_the_limits_that_reserve() {
    let upstream = Upstream::start().await;
    let text = reserved(
        "url = \"postgres://tollgate@db.invalid/t\"",
        "\"ip\"",
        100,
        "sliding",
        "",
    );
    let path = config_file("check", &text, &upstream);
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(&path)
        .env_remove("TOLLGATE_DATABASE_URL")
        .output()
        .expect("run tollgate check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("limit     limited:ip 100 per 31622400s sliding reserve"),
        "{stdout}"
    );
}
