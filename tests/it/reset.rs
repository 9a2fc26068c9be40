//! `tollgate reset` (contract §3b; issue 18): the real binary deletes a request's buckets and every
//! running instance forgets its cached denial within a second, through `LISTEN`/`NOTIFY`;
//! the listen session survives its backend being killed; with the memory store the command
//! exits 1; through a transaction-mode PgBouncer, where `LISTEN` cannot work, tollgate notices
//! and stops caching denials, so a reset still takes effect at once (docs/operations.md).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::common::db::TestDb;
use crate::common::log::CapturedLog;
use crate::common::pgbouncer::{PgBouncer, PoolMode};
use crate::common::*;

/// Route `api` (`/api`): 2 requests per hour per client address.
const API_ROUTE: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
"#;

/// The configuration text for a store URL (one connection worker, so that logs are on the
/// test's thread).
fn config_text(url: &str) -> String {
    limits_config(
        &format!("url = \"{url}\"\ntimeout = \"2s\"\npool_size = 4"),
        "workers = 1",
        API_ROUTE,
    )
}

/// Writes `text` (with `@UPSTREAM@` filled in) to a file of this test's own.
fn config_file(name: &str, text: &str, upstream: &Upstream) -> PathBuf {
    let text = text.replace("@UPSTREAM@", &upstream.addr.to_string());
    write_config_file("reset", name, &text)
}

/// Runs `tollgate reset` on `path` for `GET /api` from 127.0.0.1 (the tests' client).
async fn run_reset(path: &Path) -> Output {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["reset", "--config"])
            .arg(&path)
            .args(["--ip", "127.0.0.1", "GET", "http://any.host/api"])
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("TOLLGATE_CONFIG")
            .output()
            .expect("run tollgate reset")
    })
    .await
    .expect("reset task")
}

/// Exhausts the limit across both instances so that each has answered 429 from the store (and
/// so cached the denial): 2 allowed on `a`, then a denial on each. Returns the store round
/// trips each had made by then.
async fn exhaust(client: &H1Client, a: &Proxy, b: &Proxy) {
    assert_eq!(get(client, &a.url("/api")).await.status, StatusCode::OK);
    assert_eq!(get(client, &a.url("/api")).await.status, StatusCode::OK);
    for proxy in [a, b] {
        let answer = get(client, &proxy.url("/api")).await;
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    }
}

/// Statements this instance has sent for decisions.
fn round_trips(proxy: &Proxy) -> u64 {
    proxy.server().metrics().store_round_trips.get()
}

/// Whether `proxy` answers a denied client's next request from its cache of denials (no
/// statement sent for it).
async fn denies_from_cache(client: &H1Client, proxy: &Proxy) -> bool {
    let before = round_trips(proxy);
    let answer = get(client, &proxy.url("/api")).await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    round_trips(proxy) == before
}

/// Whether `proxy` answers the denied client from its cache of denials within 5 s. The session
/// shows in `pg_stat_activity` once its `LISTEN` ran, a moment before it reports its start,
/// which forgets whatever was cached; each denial the store gives meanwhile is cached again.
async fn caches_the_denial(client: &H1Client, proxy: &Proxy) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if denies_from_cache(client, proxy).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The count of the one row the tests' client has (its bucket's current window).
async fn stored_count(pg: &tokio_postgres::Client) -> u32 {
    let count: i32 = pg
        .query_one("SELECT count FROM rate_limits", &[])
        .await
        .expect("one row")
        .get(0);
    u32::try_from(count).expect("a count is not negative")
}

/// Polls `proxy` until it admits the client again, for at most `within`.
async fn admits_within(client: &H1Client, proxy: &Proxy, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        if get(client, &proxy.url("/api")).await.status == StatusCode::OK {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Resets through the binary and checks that both instances admit again within a second.
async fn reset_reaches_both(client: &H1Client, a: &Proxy, b: &Proxy, path: &Path, old: u32) {
    let out = run_reset(path).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "reset failed: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("reset       bucket api:ip:"), "{stdout}");
    assert!(stdout.contains(&format!("count was {old}")), "{stdout}");
    assert!(!stdout.contains("127.0.0.1:"), "digests only: {stdout}");
    for (name, proxy) in [("a", a), ("b", b)] {
        assert!(
            admits_within(client, proxy, Duration::from_secs(1))
                .await
                .is_some(),
            "instance {name} still denies a second after the reset"
        );
    }
}

/// Two instances with the denial cached; `tollgate reset`; both admit again within a second.
#[tokio::test]
async fn reset_unblocks_a_client_on_every_instance_within_a_second() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = config_text(&db.url);
    let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let path = config_file("direct", &text, &upstream);
    // Both instances listen for resets before the denial is cached: a session that starts
    // later begins by forgetting every cached denial (it may have missed a reset).
    let pg = db.client().await;
    two_listen_sessions(&pg, &db, &[], Duration::from_secs(10)).await;
    let client = h1_client();
    exhaust(&client, &a, &b).await;
    assert!(caches_the_denial(&client, &a).await, "a caches the denial");
    assert!(caches_the_denial(&client, &b).await, "b caches the denial");
    // The two allowed; a denial adds nothing (contract §3d).
    let counted = stored_count(&pg).await;
    assert_eq!(counted, 2, "{counted} counted");
    reset_reaches_both(&client, &a, &b, &path, counted).await;
    assert_eq!(
        stored_count(&pg).await,
        2,
        "counting starts afresh after the reset"
    );
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// A sliding limit's estimate reads the previous window: reset deletes that row too.
#[tokio::test]
async fn reset_deletes_the_previous_window_too() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = config_text(&db.url);
    let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let path = config_file("previous", &text, &upstream);
    let client = h1_client();
    assert_eq!(get(&client, &a.url("/api")).await.status, StatusCode::OK);
    let pg = db.client().await;
    // The previous hour's row of the same bucket, as a sliding limit would have left it; and
    // another bucket's, which must stay.
    pg.batch_execute(
        "INSERT INTO rate_limits (bucket, window_start, count, expires_at) \
         SELECT bucket, window_start - interval '1 hour', 7, window_start + interval '1 hour' \
         FROM rate_limits; \
         INSERT INTO rate_limits (bucket, window_start, count, expires_at) \
         VALUES ('other:ip:00', date_trunc('hour', now()), 1, date_trunc('hour', now()) + interval '1 hour')",
    )
    .await
    .expect("rows");
    let out = run_reset(&path).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("count was 1, previous window 7"),
        "{stdout}"
    );
    let left: Vec<String> = pg
        .query("SELECT bucket FROM rate_limits", &[])
        .await
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["other:ip:00"]);
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// The memory store's counters live in the running process: reset exits 1 and says so.
#[test]
fn reset_with_the_memory_store_exits_1() {
    let dir = std::env::temp_dir().join(format!("tollgate-reset-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!("[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n{API_ROUTE}"),
    )
    .expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["reset", "--config"])
        .arg(&path)
        .args(["GET", "http://any.host/api"])
        .env_remove("TOLLGATE_DATABASE_URL")
        .output()
        .expect("run");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one clear line: {stderr}");
    assert!(
        stderr.contains("live inside the running tollgate process"),
        "{stderr}"
    );
}

/// The `LISTEN` sessions of the instances on this database (backend pids).
async fn listen_sessions(pg: &tokio_postgres::Client, db: &TestDb) -> Vec<i32> {
    pg.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND query = 'LISTEN tollgate_reset'",
        &[&db.name],
    )
    .await
    .expect("pg_stat_activity")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Waits (at most `within`) until two LISTEN sessions other than `old` are up, and returns
/// their backends.
async fn two_listen_sessions(
    pg: &tokio_postgres::Client,
    db: &TestDb,
    old: &[i32],
    within: Duration,
) -> Vec<i32> {
    let deadline = Instant::now() + within;
    loop {
        let pids = listen_sessions(pg, db).await;
        if pids.len() == 2 && pids.iter().all(|p| !old.contains(p)) {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "two new LISTEN sessions never showed: {pids:?} (old ones: {old:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The listen session's backend is killed (as a restart or failover would end it): it comes
/// back by itself, and a reset made afterwards still reaches both instances.
#[tokio::test]
async fn the_listen_session_survives_its_backend_being_killed() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = config_text(&db.url);
    let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let path = config_file("killed", &text, &upstream);
    let pg = db.client().await;
    let old = two_listen_sessions(&pg, &db, &[], Duration::from_secs(5)).await;
    for pid in &old {
        pg.execute("SELECT pg_terminate_backend($1)", &[pid])
            .await
            .expect("terminate");
    }
    two_listen_sessions(&pg, &db, &old, Duration::from_secs(10)).await;
    let client = h1_client();
    exhaust(&client, &a, &b).await;
    assert!(caches_the_denial(&client, &a).await, "a caches the denial");
    assert!(caches_the_denial(&client, &b).await, "b caches the denial");
    // The two allowed; a denial adds nothing (contract §3d).
    let counted = stored_count(&pg).await;
    assert_eq!(counted, 2, "{counted} counted");
    reset_reaches_both(&client, &a, &b, &path, counted).await;
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// Through PgBouncer in transaction mode a `LISTEN` lands on a server connection the session
/// does not keep, and notifications never arrive. As docs/operations.md says: tollgate notices
/// (its own check notification does not come back), logs it once as an error, and stops
/// caching denials, so every denied request is decided by the database and a reset takes
/// effect on that instance at once.
#[tokio::test]
async fn through_a_transaction_mode_pooler_denials_are_not_cached_and_reset_still_holds() {
    let (log, _guard) = CapturedLog::warnings();
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, PoolMode::Transaction, 4);
    let upstream = Upstream::start().await;
    let text = config_text(&bouncer.url(&db));
    let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let path = config_file("bouncer", &text, &upstream);
    let deadline = Instant::now() + Duration::from_secs(15);
    while log
        .lines()
        .iter()
        .filter(|l| l.contains("notifications do not reach"))
        .count()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "tollgate did not notice that LISTEN cannot work through the pooler:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = h1_client();
    exhaust(&client, &a, &b).await;
    assert!(
        !denies_from_cache(&client, &a).await,
        "a must not cache denials"
    );
    assert!(
        !denies_from_cache(&client, &b).await,
        "b must not cache denials"
    );
    // 2 allowed; the 4 denials went to the database (round trips, above) and added nothing.
    reset_reaches_both(&client, &a, &b, &path, 2).await;
    let errors = log
        .lines()
        .iter()
        .filter(|l| l.contains("notifications do not reach"))
        .count();
    assert_eq!(errors, 2, "said once per instance:\n{}", log.text());
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}
