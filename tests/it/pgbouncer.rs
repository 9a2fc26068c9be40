//! tollgate through a real PgBouncer (contract §6, "Connection poolers"; issue 15), in session and
//! in transaction pooling mode, in front of the test's own database.
//!
//! Issue 15 reproductions: tollgate sent the startup parameter `options=-c
//! synchronous_commit=off`, which PgBouncer 1.18 refuses ("unsupported startup parameter:
//! options"): `migrate` exited 1 and `run` let every request through. With that worked around,
//! transaction pooling broke named prepared statements (`prepared statement "s10" already
//! exists`, `"s13" does not exist`): 2 instances, a limit of 50, 300 concurrent requests
//! allowed 50, 52, 300, 50, 300, 182; the sweep failed and `/readyz` said ready throughout.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use crate::common::db::TestDb;
use crate::common::pgbouncer::{PgBouncer, PoolMode};
use crate::common::*;

const LIMIT: usize = 50;
const REQUESTS: usize = 300;
const WINDOW_SECS: u64 = 1;
const ROUNDS: usize = 3;

/// PgBouncer's server connections for one test: in session mode every tollgate connection
/// holds one for good (2 instances × pool_size 4, plus start-up's own), so the pool must be
/// larger; in transaction mode a few shared by all make statements of different clients
/// meet on the same server connection, which is what broke named prepared statements.
fn bouncer_pool(mode: PoolMode) -> u32 {
    match mode {
        PoolMode::Session => 12,
        PoolMode::Transaction => 3,
    }
}

fn config_text(url: &str) -> String {
    let store =
        format!("url = \"{url}\"\ntimeout = \"2s\"\npool_size = 4\nsweep_interval = \"300ms\"");
    let route = format!(
        r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = {LIMIT}
  window = "{WINDOW_SECS}s"
"#
    );
    limits_config(&store, "\n[admin]\nlisten = \"127.0.0.1:0\"", &route)
}

/// Fires `total` concurrent requests at `/limited`; how many were 200.
async fn flood(proxies: &[SocketAddr], total: usize) -> usize {
    flood_path(proxies, total, "/limited").await
}

/// Fires `total` concurrent requests at `path`, spread over the proxies; how many were 200.
async fn flood_path(proxies: &[SocketAddr], total: usize, path: &str) -> usize {
    let client = h1_client();
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let addr = proxies[i % proxies.len()];
        let client = client.clone();
        let path = path.to_owned();
        tasks.push(tokio::spawn(async move {
            let req = Request::get(format!("http://{addr}{path}"))
                .header("host", "t")
                .body(Full::new(Bytes::new()))
                .expect("request");
            client.request(req).await.map(|r| r.status())
        }));
    }
    let mut ok = 0;
    for task in tasks {
        match task.await.expect("task") {
            Ok(StatusCode::OK) => ok += 1,
            Ok(StatusCode::TOO_MANY_REQUESTS) => {}
            Ok(other) => panic!("unexpected status {other}"),
            Err(err) => panic!("request failed: {err}"),
        }
    }
    ok
}

fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
}

/// Sleeps until just after the next window boundary (the database runs on this machine, so
/// its clock is this one) and returns when that window ends. This is alignment to a clock,
/// not waiting for readiness.
async fn next_window() -> Duration {
    let now = unix_now();
    let start = Duration::from_secs((now.as_secs() / WINDOW_SECS + 1) * WINDOW_SECS);
    tokio::time::sleep(start - now + Duration::from_millis(20)).await;
    start + Duration::from_secs(WINDOW_SECS)
}

/// The sum of every sample of `name` whose labels contain `labels` (all samples if empty).
fn metric_sum(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter(|l| labels.is_empty() || l.contains(labels))
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("bad metric line: {l}"))
        })
        .sum()
}

/// `SHOW name` on a plain connection (simple query protocol: no statement state).
async fn show(client: &tokio_postgres::Client, name: &str) -> String {
    client
        .simple_query(&format!("SHOW {name}"))
        .await
        .expect("SHOW")
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .expect("a row")
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect through pgbouncer: {e}"));
    tokio::spawn(conn);
    client
}

/// Every server connection of the pool, seen by fresh clients: `pool_size` clients each in an
/// open transaction, so that in transaction mode each holds a server connection of its own,
/// report `search_path` and `synchronous_commit`.
async fn settings_of_every_server_connection(
    bouncer: &PgBouncer,
    db: &TestDb,
) -> Vec<(String, String)> {
    let mut clients = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..bouncer.pool_size {
        let client = connect(&bouncer.url(db)).await;
        client.batch_execute("BEGIN").await.expect("BEGIN");
        seen.push((
            show(&client, "search_path").await,
            show(&client, "synchronous_commit").await,
        ));
        clients.push(client);
    }
    for client in &clients {
        client.batch_execute("ROLLBACK").await.expect("ROLLBACK");
    }
    seen
}

/// The first `n` lines of a log, enough to see why without flooding the output.
fn first_lines(log: &str, n: usize) -> String {
    log.lines().take(n).collect::<Vec<_>>().join("\n")
}

/// Two instances through one PgBouncer, a `global` limit of 50, 300 concurrent requests in each
/// of several 1-second windows: exactly 50 allowed every time, no decision failed open, no
/// store error or prepared-statement error logged, the sweep deletes the expired windows,
/// `/readyz` (the rolled-back real upsert, once decisions are older than a second) is 200, and
/// afterwards every server connection of the pool has the server's default settings.
async fn two_instances_hold_the_limit(mode: PoolMode) {
    let (captured, _guard) = crate::common::log::CapturedLog::warnings();

    let db = TestDb::new().await;
    let direct = db.client().await;
    let defaults = (
        show(&direct, "search_path").await,
        show(&direct, "synchronous_commit").await,
    );
    let bouncer = PgBouncer::start(&db, mode, bouncer_pool(mode));
    let upstream = Upstream::start().await;
    let text = config_text(&bouncer.url(&db));
    // Both start at once: their migrations and fingerprint checks meet on the migration lock,
    // taken inside each migration's transaction, through the pooler.
    let (a, b) = tokio::join!(
        Proxy::start(config_from(&text, upstream.addr, &[])),
        Proxy::start(config_from(&text, upstream.addr, &[]))
    );
    let mut proxies = vec![a, b];
    let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();

    // The HTTP client's and the proxies' connections first, on the unlimited route, so that a
    // round is about the store, not about 300 TCP handshakes on a loaded machine.
    flood_path(&addrs, REQUESTS, "/open").await;
    let mut counted = Vec::new();
    let mut attempts = 0;
    let mut last_round_end = Instant::now();
    while counted.len() < ROUNDS {
        attempts += 1;
        assert!(
            attempts <= ROUNDS * 2,
            "rounds keep overrunning their {WINDOW_SECS} s window: {counted:?}"
        );
        let window_end = next_window().await;
        let ok = flood(&addrs, REQUESTS).await;
        last_round_end = Instant::now();
        if unix_now() >= window_end {
            // The round spilled into the next window, where the limit starts again: it can
            // only show that two windows together allowed no more than twice the limit.
            assert!(ok <= 2 * LIMIT, "{ok} allowed across two windows");
            continue;
        }
        counted.push(ok);
    }
    assert_eq!(
        counted,
        vec![LIMIT; ROUNDS],
        "allowed per window ({mode:?}); warnings:\n{}",
        first_lines(&captured.text(), 5)
    );

    // The sweep deletes the windows that ended (every instance tries every 300 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let deleted: f64 = proxies
            .iter()
            .map(|p| {
                metric_sum(
                    &p.server().metrics().render(),
                    "tollgate_sweep_deleted_rows_total",
                    "",
                )
            })
            .sum();
        if deleted >= (ROUNDS - 1) as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sweep deleted {deleted} rows ({mode:?}); logs:\n{}",
            captured.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expired: i64 = direct
        .query_one(
            "SELECT count(*) FROM rate_limits WHERE expires_at <= now() - interval '1 second'",
            &[],
        )
        .await
        .expect("count expired")
        .get(0);
    assert_eq!(expired, 0, "expired rows left behind ({mode:?})");

    // /readyz with no decision in the last second: the probe runs the real upsert.
    tokio::time::sleep(
        (last_round_end + Duration::from_millis(1200)).saturating_duration_since(Instant::now()),
    )
    .await;
    let client = h1_client();
    for proxy in &proxies {
        let admin = proxy.server().admin_addr.expect("admin listener");
        let ready = get(&client, &format!("http://{admin}/readyz")).await;
        assert_eq!(
            ready.status,
            StatusCode::OK,
            "/readyz ({mode:?}): {}",
            ready.text()
        );
    }

    let mut allowed = 0.0;
    let mut round_trips = 0.0;
    for proxy in &proxies {
        let metrics = proxy.server().metrics().render();
        for decision in [
            "failed_open",
            "failed_closed",
            "local_allowed",
            "local_limited",
        ] {
            let n = metric_sum(
                &metrics,
                "tollgate_decisions_total",
                &format!("decision=\"{decision}\""),
            );
            assert_eq!(n, 0.0, "{n} decisions {decision} ({mode:?}):\n{metrics}");
        }
        let errors = metric_sum(&metrics, "tollgate_store_errors_total", "");
        assert_eq!(errors, 0.0, "store errors ({mode:?}):\n{metrics}");
        allowed += metric_sum(&metrics, "tollgate_decisions_total", "decision=\"allowed\"");
        round_trips += metric_sum(&metrics, "tollgate_store_round_trips_total", "");
    }
    assert!(allowed >= (ROUNDS * LIMIT) as f64, "{allowed} allowed");
    eprintln!(
        "{mode:?}: {round_trips} store round trips for {} requests ({attempts} rounds)",
        attempts * REQUESTS
    );
    let logs = captured.text();
    assert!(!logs.contains("prepared statement"), "{logs}");
    assert!(!logs.contains("store call failed"), "{logs}");
    assert!(!logs.contains("sweep failed"), "{logs}");

    for proxy in &mut proxies {
        proxy.shutdown().await;
    }
    // Nothing tollgate set stays on a server connection another client of the pool gets.
    let seen = settings_of_every_server_connection(&bouncer, &db).await;
    for settings in seen {
        assert_eq!(
            settings, defaults,
            "a server connection kept tollgate's settings ({mode:?})"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn session_mode_two_instances_allow_exactly_50_of_300_window_after_window() {
    two_instances_hold_the_limit(PoolMode::Session).await;
}

#[tokio::test(flavor = "current_thread")]
async fn transaction_mode_two_instances_allow_exactly_50_of_300_window_after_window() {
    two_instances_hold_the_limit(PoolMode::Transaction).await;
}

/// A directory removed when the test ends, however it ends.
struct RemovedOnDrop(std::path::PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `tollgate migrate` through PgBouncer exits 0 and applies the migrations; a second run is a
/// no-op; an instance then starts with `migrate = false` (the schema and fingerprint checks go
/// through the pooler too) and counts.
async fn migrate_through(mode: PoolMode) {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, mode, bouncer_pool(mode));
    let url = bouncer.url(&db);
    let dir = RemovedOnDrop(std::env::temp_dir().join(format!(
        "tollgate-pgbouncer-migrate-{}-{mode:?}",
        std::process::id()
    )));
    std::fs::create_dir_all(&dir.0).expect("tmp dir");
    let path = dir.0.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[store]\nurl = \"{url}\"\n\n\
             [keys]\nsecret = \"s3cret\"\n\n\
             [upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n"
        ),
    )
    .expect("write config");
    let migrate = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("migrate")
            .arg("--config")
            .arg(&path)
            .env_remove("TOLLGATE_DATABASE_URL")
            .output()
            .expect("run tollgate migrate")
    };
    let first = migrate();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&first.stdout),
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(
        first.status.success(),
        "migrate through {mode:?} pgbouncer: {out}"
    );
    assert!(out.contains("applied 9 migration(s)"), "{out}");
    let second = migrate();
    let out = String::from_utf8_lossy(&second.stdout).into_owned();
    assert!(second.status.success(), "{out}");
    assert!(out.contains("no migration applied"), "{out}");

    let upstream = Upstream::start().await;
    let text = config_text(&url)
        .replace("sweep_interval", "migrate = false\nsweep_interval")
        .replace("test-secret", "s3cret");
    let mut proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let ok = flood(&[proxy.addr], 60).await;
    // 60 requests in at most two windows.
    assert!((LIMIT..=60).contains(&ok), "{ok} allowed");
    let metrics = proxy.server().metrics().render();
    assert_eq!(
        metric_sum(
            &metrics,
            "tollgate_decisions_total",
            "decision=\"failed_open\""
        ),
        0.0,
        "{metrics}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn session_mode_migrate_exits_0() {
    migrate_through(PoolMode::Session).await;
}

#[tokio::test(flavor = "current_thread")]
async fn transaction_mode_migrate_exits_0() {
    migrate_through(PoolMode::Transaction).await;
}

/// `synchronous_commit = off` still applies without a startup parameter or a session `SET`:
/// the function sets it for its own transaction. Read back in the same statement through a
/// transaction-mode PgBouncer, and gone for the next statement on the same connection. The
/// plain upsert leaves the setting alone: on a direct connection the session carries it
/// (`the_increment_is_prepared_only_on_a_connection_that_reaches_its_backend_directly`).
#[tokio::test(flavor = "current_thread")]
async fn increment_turns_synchronous_commit_off_for_its_own_transaction_only() {
    let db = TestDb::new().await;
    let store =
        tollgate::testing::store::postgres::PostgresStore::new(&db.store_config()).expect("store");
    store.initialize("fp", true).await.expect("initialize");
    let bouncer = PgBouncer::start(&db, PoolMode::Transaction, 1);
    let client = connect(&bouncer.url(&db)).await;
    let default = show(&client, "synchronous_commit").await;
    assert_eq!(default, "on", "the test server's default");
    let buckets = ["t:global"];
    let windows = [60i64];
    let amounts = [1i64];
    let limits: Option<Vec<i64>> = None;
    let caps = [Some(10i64)];
    let wrapped = |sql: &str| {
        format!(
            "WITH inc AS ({sql}) SELECT current_setting('synchronous_commit'), count(*) FROM inc"
        )
    };
    for (synchronous_commit, expected) in [(false, "off"), (true, "on")] {
        let async_commit = !synchronous_commit;
        let row = client
            .query_typed_one(
                &wrapped(tollgate::testing::store::postgres::increment_sql()),
                &[
                    (&&buckets[..], Type::TEXT_ARRAY),
                    (&&windows[..], Type::INT8_ARRAY),
                    (&&amounts[..], Type::INT8_ARRAY),
                    (&limits, Type::INT8_ARRAY),
                    (&&caps[..], Type::INT8_ARRAY),
                    (&async_commit, Type::BOOL),
                ],
            )
            .await
            .expect("the increment, wrapped");
        let setting: String = row.get(0);
        let rows: i64 = row.get(1);
        assert_eq!(
            (setting.as_str(), rows),
            (expected, 1),
            "store.synchronous_commit = {synchronous_commit}"
        );
        assert_eq!(
            show(&client, "synchronous_commit").await,
            default,
            "the setting outlived its transaction"
        );
    }
    let row = client
        .query_typed_one(
            &wrapped(tollgate::testing::store::postgres::fixed_upsert_sql()),
            &[
                (&&buckets[..], Type::TEXT_ARRAY),
                (&&windows[..], Type::INT8_ARRAY),
                (&&amounts[..], Type::INT8_ARRAY),
                (&&caps[..], Type::INT8_ARRAY),
            ],
        )
        .await
        .expect("the plain upsert, wrapped");
    let setting: String = row.get(0);
    assert_eq!(
        setting, default,
        "the plain upsert leaves the setting alone"
    );
    // Summed: the three may straddle a window boundary.
    let count: i64 = client
        .query_typed_one(
            "SELECT sum(count)::int8 FROM rate_limits WHERE bucket = 't:global'",
            &[],
        )
        .await
        .expect("the bucket's row")
        .get(0);
    assert_eq!(count, 3, "three increments counted");
}

/// A store on `url` with one connection (so every call and every inspection meet the same
/// server session) and a decision budget of `timeout`.
async fn one_connection_store(
    url: String,
    timeout: Duration,
) -> std::sync::Arc<tollgate::testing::store::postgres::PostgresStore> {
    let mut cfg = TestDb::store_config_for(url);
    cfg.pool_size = 1;
    cfg.timeout = timeout;
    let store = tollgate::testing::store::postgres::PostgresStore::new(&cfg).expect("store");
    store.initialize("fp", true).await.expect("initialize");
    store
}

/// What one statement's requests said of the row that each names first: its count after the
/// last of them, and the units counted in all.
fn row_answer(counted: &[Vec<tollgate::testing::store::Counted>], at: usize) -> (u32, u32) {
    let count = counted.last().map_or(0, |c| c[at].count);
    (count, counted.iter().map(|c| c[at].added).sum())
}

/// What [`capped_increments`] answers: three requests one after another on a limit of 2, then
/// three folded into one row of a fresh bucket (more units than fit), as (count, added).
const CAPPED: [(u32, u32); 6] = [(1, 1), (2, 1), (2, 0), (1, 1), (2, 1), (2, 0)];

/// A fixed limit of 2 (contract §3d: a denied unit is not added), on whichever statement the
/// connection sends: the plain upsert with caps and the function for the rows it leaves on a
/// direct connection, the function alone behind a pooler.
async fn capped_increments(
    store: &tollgate::testing::store::postgres::PostgresStore,
    bucket: &str,
) -> Vec<(u32, u32)> {
    use tollgate::testing::store::Store;
    let capped = |name: &str| tollgate::testing::store::Increment {
        enforce: Some(2),
        ..one(&format!("{bucket}-{name}"))
    };
    let alone = capped("capped");
    let mut answers = Vec::new();
    for _ in 0..3 {
        let counted = store
            .increment_each(&[std::slice::from_ref(&alone)])
            .await
            .expect("capped increment");
        answers.push((counted[0][0].count, counted[0][0].added));
    }
    let folded = capped("folded");
    let requests = vec![std::slice::from_ref(&folded); 3];
    let counted = store
        .increment_each(&requests)
        .await
        .expect("folded capped increment");
    answers.extend(counted.iter().map(|c| (c[0].count, c[0].added)));
    answers
}

/// Three requests, each with the limits `<bucket>-a` (10) and `<bucket>-b` (1), decided one
/// statement each: the units each added to its two rows.
async fn joint_decisions(
    store: &tollgate::testing::store::postgres::PostgresStore,
    bucket: &str,
) -> Vec<(u32, u32)> {
    use tollgate::testing::store::Store;
    let pair = [
        tollgate::testing::store::Increment {
            enforce: Some(10),
            ..one(&format!("{bucket}-a"))
        },
        tollgate::testing::store::Increment {
            enforce: Some(1),
            ..one(&format!("{bucket}-b"))
        },
    ];
    let mut added = Vec::new();
    for _ in 0..3 {
        let counted = store
            .increment_each(&[&pair[..]])
            .await
            .expect("joint decision");
        added.push((counted[0][0].added, counted[0][1].added));
    }
    added
}

fn one(bucket: &str) -> tollgate::testing::store::Increment {
    tollgate::testing::store::Increment {
        bucket: std::sync::Arc::from(bucket),
        window_secs: 3600,
        by: 1,
        sliding: None,
        enforce: None,
        check: false,
    }
}

/// Inspects the store's connection until its direct look-up (run in the background after
/// the connect) has answered: the answer, what its session holds, its backend pid.
async fn settled(
    store: &tollgate::testing::store::postgres::PostgresStore,
) -> (
    bool,
    tollgate::testing::store::postgres::ConnectionInspection,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = store.inspect_a_connection("").await.expect("inspect");
        if let Some(direct) = seen.direct {
            return (direct, seen);
        }
        assert!(
            Instant::now() < deadline,
            "the direct look-up never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The plain sliding statements in a race: three stores of four direct connections each,
/// their statements prepared, and 600 concurrent increments of 1 to 3 units on one sliding
/// limit of 200 (no previous window, so its cap stays 200), half of them alone (the single-row
/// statement), half in a batch with a second, roomy row (the batch statement). Whatever the interleaving, the
/// units added come to exactly 200 and the row counts 200: `ON CONFLICT`'s update sees the
/// latest count, and a row that does not fit whole goes to the function, which admits a
/// prefix. Every answer is consistent with the row: nothing beyond the limit, no more added
/// than asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_sliding_statement_is_exact_under_concurrent_increments() {
    use std::sync::Arc;
    use tollgate::testing::store::Store;
    let db = TestDb::new().await;
    let mut stores = Vec::new();
    for _ in 0..3 {
        let mut cfg = db.store_config();
        cfg.pool_size = 4;
        cfg.timeout = Duration::from_secs(30);
        let store = tollgate::testing::store::postgres::PostgresStore::new(&cfg).expect("store");
        store.initialize("fp", true).await.expect("initialize");
        assert!(settled(&store).await.0, "a loopback connection is direct");
        stores.push(Arc::new(store));
    }
    let sliding = |bucket: &str, limit: u32, by: u32| {
        let mut inc = one(bucket);
        inc.sliding = Some(limit);
        inc.by = by;
        inc
    };
    // A connection's first sliding batch of each shape (once its direct look-up has answered)
    // prepares its plain statement: warm the pools until the connection inspected has both.
    let batch = |i: u32, bucket: &str, limit: u32, by: u32| {
        let mut incs = vec![sliding(bucket, limit, by)];
        if i % 2 == 1 {
            incs.push(sliding(&format!("{bucket}-roomy"), 1_000_000, 1));
        }
        incs
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let warm = stores.iter().flat_map(|store| {
            (0..8).map(move |i| {
                let incs = batch(i, "t:warm", 1_000_000, 1);
                let store = store.clone();
                async move { store.increment(&incs).await.expect("warm-up") }
            })
        });
        futures_util::future::join_all(warm).await;
        let (_, seen) = settled(&stores[0]).await;
        let plain = [
            tollgate::testing::store::postgres::sliding_one_sql(),
            tollgate::testing::store::postgres::sliding_upsert_sql(),
        ];
        if plain.iter().all(|p| seen.prepared.iter().any(|s| s == p)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the plain sliding statements were never both prepared: {:?}",
            seen.prepared
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let tasks: Vec<_> = (0..600u32)
        .map(|i| {
            let store = stores[(i % 3) as usize].clone();
            let incs = batch(i, "t:raced", 200, i % 3 + 1);
            tokio::spawn(async move {
                let counted = store.increment(&incs).await.expect("increment")[0];
                (i % 3 + 1, counted)
            })
        })
        .collect();
    let mut added = 0;
    for task in tasks {
        let (by, counted) = task.await.expect("task");
        assert!(counted.added <= by && counted.count <= 200, "{counted:?}");
        added += counted.added;
    }
    assert_eq!(added, 200, "units added across all increments");
    let row: i32 = db
        .client()
        .await
        .query_one(
            "SELECT count FROM rate_limits WHERE bucket = 't:raced'",
            &[],
        )
        .await
        .expect("the row")
        .get(0);
    assert_eq!(row, 200);
}

/// The increment is prepared once on a connection that reaches its backend directly (the
/// server's parse and plan of every call spared: docs/performance.md, row "Prepared on
/// direct connections"): the plain upsert for fixed windows, the plain sliding statement for a batch
/// with a sliding limit, and the function's call for its rows at their limit; the session
/// carries `synchronous_commit = off` for the plain statements, and stays at the server's
/// default with `store.synchronous_commit = "on"`. Never through
/// PgBouncer, in either mode: there tollgate cannot tell whether the next transaction runs on
/// the same server session, so nothing may stay on it (contract §6): nothing prepared, nothing
/// `SET`. A prepared statement that disappears from the session (`DEALLOCATE ALL`, SQLSTATE
/// 26000) costs no count: the batch runs once more unnamed, and the connection is replaced.
/// Counting is exact every way.
#[tokio::test(flavor = "current_thread")]
async fn the_increment_is_prepared_only_on_a_connection_that_reaches_its_backend_directly() {
    use tollgate::testing::store::Store;
    let db = TestDb::new().await;
    let bouncers = [
        PgBouncer::start(&db, PoolMode::Session, 4),
        PgBouncer::start(&db, PoolMode::Transaction, 1),
    ];
    let direct_url = db.store_config().url.expect("url");
    let urls = [
        ("direct", direct_url.clone()),
        ("direct, synchronous_commit on", direct_url),
        ("session mode", bouncers[0].url(&db)),
        ("transaction mode", bouncers[1].url(&db)),
    ];
    let fixed = tollgate::testing::store::postgres::fixed_upsert_sql();
    for (i, (path, url)) in urls.into_iter().enumerate() {
        let mut cfg = TestDb::store_config_for(url);
        cfg.pool_size = 1;
        cfg.timeout = Duration::from_secs(10);
        cfg.synchronous_commit = path.ends_with("synchronous_commit on");
        let store = tollgate::testing::store::postgres::PostgresStore::new(&cfg).expect("store");
        store.initialize("fp", true).await.expect("initialize");
        let (direct, _) = settled(&store).await;
        let bucket = format!("t:prepared-{i}");
        let count = || {
            let store = &store;
            let bucket = bucket.clone();
            async move { store.increment(&[one(&bucket)]).await.expect("increment")[0].count }
        };
        if path == "direct" {
            assert!(direct, "a loopback connection to the server is direct");
            let counts = [count().await, count().await];
            let (_, seen) = settled(&store).await;
            assert_eq!(
                (seen.prepared.clone(), seen.synchronous_commit.as_str()),
                (vec![fixed.to_string()], "off"),
                "direct: the plain upsert is prepared on the session, which commits asynchronously"
            );
            // A batch of one sliding row is the single-row plain statement's, prepared next to
            // the upsert (its first batch runs as the function's call, with the prepare
            // pipelined).
            let mut sliding = one(&format!("{bucket}-sliding"));
            sliding.sliding = Some(100);
            for expected in [1, 2, 3] {
                let counted = store
                    .increment(std::slice::from_ref(&sliding))
                    .await
                    .expect("sliding increment");
                assert_eq!(
                    (counted[0].count, counted[0].added),
                    (expected, 1),
                    "direct: sliding counting is exact"
                );
            }
            let (_, after_sliding) = settled(&store).await;
            let mut both = vec![fixed, tollgate::testing::store::postgres::sliding_one_sql()];
            both.sort_unstable();
            assert_eq!(
                after_sliding.prepared, both,
                "direct: both plain statements prepared"
            );
            // At its limit a row is not counted whole, and the function counts the prefix
            // that the estimate admits: 2 of 3, then 1 of 2 (the second statement), then 0.
            // Alone, and in a batch of two, where the other row is counted by the plain
            // batch statement alone. A row of several units is several requests of one
            // unit each, folded into one statement (a request of several units is decided
            // whole, by the function: contract §3d).
            let mut alone = one(&format!("{bucket}-alone"));
            alone.sliding = Some(3);
            let mut answers = Vec::new();
            for n in [2, 2, 1] {
                let requests = vec![std::slice::from_ref(&alone); n];
                let counted = store
                    .increment_each(&requests)
                    .await
                    .expect("sliding increment at the limit");
                answers.push(row_answer(&counted, 0));
            }
            assert_eq!(
                answers,
                [(2, 2), (3, 1), (3, 0)],
                "direct: a lone row at its limit counts exactly the admitted units"
            );
            let mut near = one(&format!("{bucket}-near"));
            near.sliding = Some(3);
            let mut roomy = one(&format!("{bucket}-roomy"));
            roomy.sliding = Some(100);
            answers.clear();
            let mut pairs = Vec::new();
            let first = [near.clone(), roomy.clone()];
            for n in [2, 2, 1] {
                let mut requests = vec![&first[..]];
                requests.extend(vec![std::slice::from_ref(&near); n - 1]);
                let counted = store
                    .increment_each(&requests)
                    .await
                    .expect("sliding increment at the limit");
                pairs.push((
                    row_answer(&counted, 0),
                    (counted[0][1].count, counted[0][1].added),
                ));
            }
            assert_eq!(
                pairs,
                [((2, 2), (1, 1)), ((3, 1), (2, 1)), ((3, 0), (3, 1))],
                "direct: a row at its limit counts exactly the admitted units"
            );
            // A request with two enforced limits takes the joint decision, prepared too; the
            // second limit's denial takes nothing from the first (contract §3d).
            assert_eq!(
                joint_decisions(&store, &bucket).await,
                [(1, 1), (0, 0), (0, 0)],
                "direct: units added to each row by three requests of two limits"
            );
            assert_eq!(
                capped_increments(&store, &bucket).await,
                CAPPED,
                "direct: a fixed row never counts a denied unit"
            );
            let (_, at_limit) = settled(&store).await;
            let mut all = vec![
                fixed,
                tollgate::testing::store::postgres::decide_sql(),
                tollgate::testing::store::postgres::increment_sql(),
                tollgate::testing::store::postgres::sliding_one_sql(),
                tollgate::testing::store::postgres::sliding_upsert_sql(),
            ];
            all.sort_unstable();
            assert_eq!(
                at_limit.prepared, all,
                "direct: the function, for rows at their limit, prepared too"
            );
            // The statement vanishes from the session: the next batch is counted once, and
            // the connection is not used again.
            let gone = store
                .inspect_a_connection("DEALLOCATE ALL")
                .await
                .expect("deallocate");
            assert_eq!(
                (gone.prepared.len(), gone.pid),
                (0, seen.pid),
                "the statements are gone"
            );
            let counts = [
                counts[0],
                counts[1],
                count().await,
                count().await,
                count().await,
            ];
            assert_eq!(counts, [1, 2, 3, 4, 5], "direct: counting is exact");
            let (_, replaced) = settled(&store).await;
            assert_ne!(
                replaced.pid, seen.pid,
                "the connection whose statement vanished was replaced"
            );
        } else {
            assert_eq!(direct, path.starts_with("direct"), "{path}");
            let counts = [count().await, count().await, count().await];
            assert_eq!(counts, [1, 2, 3], "{path}: counting is exact");
            assert_eq!(
                joint_decisions(&store, &bucket).await,
                [(1, 1), (0, 0), (0, 0)],
                "{path}: units added to each row by three requests of two limits"
            );
            assert_eq!(
                capped_increments(&store, &bucket).await,
                CAPPED,
                "{path}: a fixed row never counts a denied unit"
            );
            let (_, seen) = settled(&store).await;
            let mut prepared: Vec<String> = if direct {
                // The function too: for the capped rows at their limit.
                let decide = tollgate::testing::store::postgres::decide_sql();
                let function = tollgate::testing::store::postgres::increment_sql();
                vec![fixed.to_string(), decide.to_string(), function.to_string()]
            } else {
                Vec::new()
            };
            prepared.sort_unstable();
            assert_eq!(
                (seen.prepared, seen.synchronous_commit.as_str()),
                (prepared, "on"),
                "{path}: what the server session holds"
            );
        }
    }
}

/// Leaves `n` loopback TCP sockets in TIME_WAIT (the client closes first), the way a host's
/// socket table looks after a burst of short connections; returns how many lines the
/// kernel's IPv4 table then has. The connections are spread over several listeners, so the
/// ephemeral port range does not run out.
fn crowd_the_socket_table(n: usize) -> usize {
    let listeners: Vec<std::net::TcpListener> = (0..4)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    for i in 0..n {
        let listener = &listeners[i % listeners.len()];
        let client = std::net::TcpStream::connect(listener.local_addr().expect("addr"))
            .unwrap_or_else(|e| panic!("connection {i} of {n}: {e}"));
        let (server, _) = listener.accept().expect("accept");
        drop(client);
        drop(server);
    }
    std::fs::read_to_string("/proc/self/net/tcp")
        .expect("/proc/self/net/tcp")
        .lines()
        .count()
}

/// The direct look-up reads the kernel's socket tables, which list every socket of the host's
/// network namespace. With tens of thousands in TIME_WAIT (after a CI run, or on a busy
/// proxy host) that took 30-60 ms; inside the pool's connect it made the first decisions
/// after start-up miss a 100 ms budget and fall to the failure policy: allowed and not
/// counted. The look-up must never be on a decision's path.
#[tokio::test(flavor = "current_thread")]
async fn a_crowded_socket_table_never_delays_a_decision() {
    use tollgate::testing::store::Store;
    let lines = tokio::task::spawn_blocking(|| crowd_the_socket_table(30_000))
        .await
        .expect("crowd");
    assert!(lines > 10_000, "only {lines} lines in the socket table");
    let db = TestDb::new().await;
    let store = one_connection_store(
        db.store_config().url.expect("url"),
        Duration::from_millis(100),
    )
    .await;
    let mut counts = Vec::new();
    for _ in 0..3 {
        let counted = store
            .increment(&[one("t:crowded")])
            .await
            .expect("a decision within its 100 ms budget");
        counts.push(counted[0].count);
    }
    assert_eq!(counts, [1, 2, 3]);
}

/// What every server connection of PgBouncer's pool for `url`'s user answers to `what` (an
/// expression, or an expression and a `FROM`, giving one text value): as many clients as the
/// pool may have server connections, each in an open transaction, so each holds a server
/// connection of its own and together they hold all of them (PgBouncer opens at most
/// `pool_size` per user and database, and a client in a transaction keeps its server). The
/// direct connection `pg` then confirms that every backend of that user on the database was
/// among them. Answers `(backend pid, value)`, one per server connection. A question the
/// role's own `statement_timeout` cancels (a fresh backend's first statement loads its
/// catalog caches) is asked again in a new transaction.
pub(super) async fn ask_every_server_connection(
    bouncer: &PgBouncer,
    url: &str,
    user: &str,
    pg: &tokio_postgres::Client,
    db: &TestDb,
    what: &str,
) -> Vec<(i32, String)> {
    let mut clients = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..bouncer.pool_size {
        let client = connect(url).await;
        let mut attempts = 0;
        let answer = loop {
            client.batch_execute("BEGIN").await.expect("BEGIN");
            let asked = client
                .simple_query(&format!("SELECT pg_backend_pid()::text, {what}"))
                .await;
            match asked {
                Err(e) if e.code() == Some(&SqlState::QUERY_CANCELED) && attempts < 20 => {
                    attempts += 1;
                    client.batch_execute("ROLLBACK").await.expect("ROLLBACK");
                }
                asked => break asked.expect("ask a server connection"),
            }
        };
        let row = answer
            .into_iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => Some((
                    row.get(0).expect("pid").parse::<i32>().expect("a pid"),
                    row.get(1).unwrap_or_default().to_owned(),
                )),
                _ => None,
            })
            .expect("a row");
        seen.push(row);
        clients.push(client);
    }
    let backends: Vec<i32> = pg
        .query(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = $1 AND usename = $2 AND backend_type = 'client backend' \
               AND pid <> pg_backend_pid()",
            &[&db.name, &user],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for client in &clients {
        client.batch_execute("ROLLBACK").await.expect("ROLLBACK");
    }
    for pid in &backends {
        assert!(
            seen.iter().any(|(p, _)| p == pid),
            "backend {pid} of {user} was not among the server connections asked: {seen:?}"
        );
    }
    seen
}

/// Waits until a captured log line contains `text`, for at most `within`.
async fn until_logged(log: &crate::common::log::CapturedLog, text: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while !log.text().contains(text) {
        assert!(
            Instant::now() < deadline,
            "no log line with {text:?} within {within:?}:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 47, item 4: through PgBouncer in transaction mode, the reset listener's `LISTEN` went
/// through the pooler, landed on whichever server connection that statement got, and stayed
/// there: a server connection other clients of the pool are handed reported a listening
/// channel (`pg_listening_channels()`), where a fresh one reports none. After tollgate ran
/// through the pooler (start-up, the listener's start and its liveness checks up to the
/// moment it reports that notifications do not reach it, decisions, shutdown), no server
/// connection of the pool listens on anything (docs/operations.md, "Connection poolers").
#[tokio::test(flavor = "current_thread")]
async fn transaction_mode_leaves_no_listen_on_any_server_connection_of_the_pool() {
    let (log, _guard) = crate::common::log::CapturedLog::warnings();
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, PoolMode::Transaction, 3);
    let upstream = Upstream::start().await;
    let url = bouncer.url(&db);
    let mut proxy = Proxy::start(config_from(&config_text(&url), upstream.addr, &[])).await;
    // The listener has made up its mind once it says so; before that it has connected and
    // (where it sends LISTEN) listened and sent its checks.
    until_logged(&log, "notifications do not reach", Duration::from_secs(30)).await;
    let ok = flood(&[proxy.addr], 60).await;
    assert!((LIMIT..=60).contains(&ok), "{ok} allowed");
    proxy.shutdown().await;

    let pg = db.client().await;
    let user: String = pg
        .query_one("SELECT current_user::text", &[])
        .await
        .expect("user")
        .get(0);
    let seen = ask_every_server_connection(
        &bouncer,
        &url,
        &user,
        &pg,
        &db,
        "coalesce(string_agg(c, ','), '') FROM pg_listening_channels() AS c",
    )
    .await;
    assert!(
        seen.iter().all(|(_, channels)| channels.is_empty()),
        "server connections of the pool listening (pid, channels): {seen:?}"
    );
    // The other symptom: a notification reaching an idle server connection, which PgBouncer
    // keeps (and logs) rather than closes.
    let log = bouncer.log();
    assert!(!log.contains("when not linked"), "{log}");
}

/// Through PgBouncer in session mode too the reset listener sends no `LISTEN`: PgBouncer
/// announces a cancel key of its own there as well, and a `LISTEN` would outlive tollgate's
/// session on the server connection unless `server_reset_query` cleans it up. It says at
/// once that notifications do not reach it (docs/operations.md, "Connection poolers").
#[tokio::test(flavor = "current_thread")]
async fn session_mode_the_reset_listener_sends_no_listen_either() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, PoolMode::Session, 4);
    let started = Instant::now();
    let hears = listener_hears(&bouncer.url(&db), Duration::from_secs(15)).await;
    assert_eq!(hears, Some(false));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it knew only after {:?}, as if it had waited for its checks",
        started.elapsed()
    );
}

/// An L4 relay (a TCP proxy: HAProxy in TCP mode, a cloud SQL proxy) changes nothing: the
/// session is still its backend's own (the backend's key comes through), so the reset
/// listener listens and hears its checks.
#[tokio::test(flavor = "current_thread")]
async fn through_an_l4_relay_the_reset_listener_still_listens() {
    let db = TestDb::new().await;
    let relay = crate::common::faulty::FaultyTcp::start(db.server_addr(), true).await;
    let hears = listener_hears(&db.url_through(relay.addr), Duration::from_secs(15)).await;
    assert_eq!(hears, Some(true));
}

/// A login role of the test's own whose `statement_timeout` and `lock_timeout` are 1 ms
/// (`ALTER ROLE ... SET`), owner of the test's database so it can migrate it. Dropped with
/// that database when the guard goes.
struct ShortTimeoutRole {
    name: String,
    database: String,
    admin: tokio_postgres::Config,
}

impl ShortTimeoutRole {
    async fn create(db: &TestDb) -> ShortTimeoutRole {
        let name = format!("{}_short", db.name);
        let pg = db.client().await;
        pg.batch_execute(&format!(
            "CREATE ROLE \"{name}\" LOGIN; \
             ALTER DATABASE \"{database}\" OWNER TO \"{name}\"; \
             ALTER ROLE \"{name}\" SET statement_timeout = '1ms'; \
             ALTER ROLE \"{name}\" SET lock_timeout = '1ms'",
            database = db.name
        ))
        .await
        .expect("create the role");
        let mut admin: tokio_postgres::Config = db.url.parse().expect("the test URL parses");
        admin.dbname("postgres");
        ShortTimeoutRole {
            name,
            database: db.name.clone(),
            admin,
        }
    }

    /// A connection string for the role on the test's database at `addr`, with tollgate's
    /// own `application_name`: the test's clients then never make PgBouncer `SET` it on a
    /// server connection, a statement of PgBouncer's under the role's 1 ms that this test is
    /// not about (docs/operations.md, "Connection poolers").
    fn url(&self, addr: SocketAddr) -> String {
        format!(
            "host={} port={} dbname={} user={} application_name=tollgate",
            addr.ip(),
            addr.port(),
            self.database,
            self.name
        )
    }
}

impl Drop for ShortTimeoutRole {
    fn drop(&mut self) {
        // As TestDb's drop: a thread with a runtime of its own. The database goes first (the
        // role owns it); TestDb's own drop then finds it gone.
        let admin = self.admin.clone();
        // Two statements: DROP DATABASE cannot run in a multi-statement string's implicit
        // transaction.
        let sql = [
            format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.database),
            format!("DROP ROLE IF EXISTS \"{}\"", self.name),
        ];
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let (client, conn) = admin
                    .connect(tokio_postgres::NoTls)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                for statement in &sql {
                    client
                        .batch_execute(statement)
                        .await
                        .map_err(|e| format!("{statement}: {e:?}"))?;
                }
                Ok::<(), String>(())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: could not drop the role {}: {e}", self.name),
            Err(_) => eprintln!("warning: dropping the role {} panicked", self.name),
        }
    }
}

/// A limit of 5 per hour on `/limited`, under `on_error = "deny"`.
fn deny_config(url: &str) -> String {
    let store = format!(
        "url = \"{url}\"\ntimeout = \"2s\"\npool_size = 4\non_error = \"deny\"\n\
         sweep_interval = \"300ms\""
    );
    let route = r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = 5
  window = "1h"
"#;
    limits_config(&store, "", route)
}

/// The reset listener of a store on `url`: whether it reports that notifications reach it,
/// within `within` (`None`: it said neither).
async fn listener_hears(url: &str, within: Duration) -> Option<bool> {
    let store = tollgate::testing::store::postgres::PostgresStore::new(&TestDb::store_config_for(
        url.to_owned(),
    ))
    .expect("store");
    store.initialize("fp", true).await.expect("initialize");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let listener = tokio::spawn(store.listen_for_resets(move |event| {
        if let tollgate::testing::store::ResetEvent::Hearing(hearing) = event {
            let _ = tx.send(hearing);
        }
    }));
    let heard = tokio::time::timeout(within, rx.recv()).await.ok().flatten();
    listener.abort();
    heard
}

/// Issue 47, item 6: a login role with `statement_timeout` and `lock_timeout` of 1 ms. tollgate
/// started and migrated, then its first decisions failed with `canceling statement due to
/// statement timeout (57014)` (503 under `on_error = "deny"`), and were not counted. tollgate
/// sets the timeouts of its own statements on every session it opens: decisions succeed and
/// count, and so do the migrations, the sweep, the instance registry, the reset listener and
/// (directly) the prepared increment; through a transaction pooler without a `SET` left on a
/// server connection that the pool's other clients get (they see the role's 1 ms).
async fn a_roles_1ms_timeouts_fail_nothing(through: Option<PoolMode>) {
    let (log, _guard) = crate::common::log::CapturedLog::warnings();
    let db = TestDb::new().await;
    let role = ShortTimeoutRole::create(&db).await;
    let bouncer =
        through.map(|mode| PgBouncer::start_with_users(&db, mode, 3, &[role.name.as_str()]));
    let url = role.url(
        bouncer
            .as_ref()
            .map_or_else(|| db.server_addr(), |b| b.addr),
    );
    let path = format!("{through:?}");
    assert_eq!(
        show(&connect(&url).await, "statement_timeout").await,
        "1ms",
        "the role's own setting"
    );

    let upstream = Upstream::start().await;
    let mut proxy = Proxy::start(config_from(&deny_config(&url), upstream.addr, &[])).await;
    let client = h1_client();
    let mut statuses = Vec::new();
    for _ in 0..8 {
        statuses.push(get(&client, &proxy.url("/limited")).await.status.as_u16());
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "{path}: decisions under the role's 1 ms timeouts; log:\n{}",
        log.text()
    );
    let pg = db.client().await;
    let counted: i64 = pg
        .query_one("SELECT coalesce(sum(count), 0)::int8 FROM rate_limits", &[])
        .await
        .expect("count")
        .get(0);
    // The five allowed; a denial adds nothing (contract §3d).
    assert_eq!(counted, 5, "{path}: {counted} counted");

    // The sweep (every 300 ms) and the registry (at start) ran under the role as well.
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.server().metrics().sweep_last_success.get() == 0.0 {
        assert!(
            Instant::now() < deadline,
            "{path}: no sweep succeeded; log:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Registered at start, or at a refresh after it: even `BEGIN` runs under the role's 1 ms
    // (only tollgate's own statements get its timeouts), which a busy machine can overrun.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let registered: i64 = pg
            .query_one("SELECT count(*) FROM tollgate_instances", &[])
            .await
            .expect("registry")
            .get(0);
        if registered == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{path}: {registered} rows, not this instance's row; log:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.shutdown().await;

    // `tollgate migrate --accept-new-key` under the role, for the stores below (key "fp").
    let store = tollgate::testing::store::postgres::PostgresStore::new(&TestDb::store_config_for(
        url.clone(),
    ))
    .expect("store");
    let report = store.migrate("fp", true).await.expect("migrate");
    assert_eq!(
        report.fingerprint,
        tollgate::testing::store::postgres::FingerprintChange::Replaced
    );
    drop(store);

    // The reset listener: it hears its own checks on a session of its own; through the
    // transaction pooler it knows at once that it cannot.
    let hears = listener_hears(&url, Duration::from_secs(15)).await;
    assert_eq!(hears, Some(through.is_none()), "{path}: the reset listener");
    if through.is_none() {
        // A direct pool connection prepares its increment (src/store/postgres/direct.rs), and
        // counts.
        let store = one_connection_store(url.clone(), Duration::from_secs(2)).await;
        // Once the background look-up has answered: until then nothing is prepared.
        assert!(settled(&store).await.0, "a loopback connection is direct");
        let mut counts = Vec::new();
        for _ in 0..3 {
            use tollgate::testing::store::Store;
            counts.push(
                store
                    .increment(&[one("t:direct")])
                    .await
                    .expect("increment")[0]
                    .count,
            );
        }
        let (_, seen) = settled(&store).await;
        assert_eq!(counts, [1, 2, 3]);
        assert_eq!(
            seen.prepared,
            [tollgate::testing::store::postgres::fixed_upsert_sql()],
            "the increment prepared under the role's timeouts"
        );
    }
    let logs = log.text();
    for cancelled in ["57014", "55P03", "sweep failed", "cannot refresh"] {
        assert!(!logs.contains(cancelled), "{path}: {cancelled}:\n{logs}");
    }

    if let Some(bouncer) = &bouncer {
        // Nothing tollgate set stays on a server connection: every one still has the role's.
        let seen = ask_every_server_connection(
            bouncer,
            &url,
            &role.name,
            &pg,
            &db,
            "current_setting('statement_timeout') || ' ' || current_setting('lock_timeout')",
        )
        .await;
        for (pid, settings) in &seen {
            assert_eq!(settings, "1ms 1ms", "{path}: server connection {pid}");
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_roles_1ms_timeouts_fail_no_decision_on_a_direct_connection() {
    a_roles_1ms_timeouts_fail_nothing(None).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_roles_1ms_timeouts_fail_no_decision_through_a_transaction_pooler() {
    a_roles_1ms_timeouts_fail_nothing(Some(PoolMode::Transaction)).await;
}
