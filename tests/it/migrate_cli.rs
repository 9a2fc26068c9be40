//! `tollgate migrate` against a real database (contract §1 and §3): migrations once, a
//! no-op the second time, key rotation with `--accept-new-key`, and the refusal of the old key
//! afterwards.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use crate::common::db::TestDb;
use crate::common::*;

fn write_config(db: &TestDb, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-migrate-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[store]\nurl = \"{}\"\n\n\
             [keys]\nsecret = \"${{TOLLGATE_KEY_SECRET}}\"\n\n\
             [upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n",
            db.url
        ),
    )
    .expect("write config");
    path
}

fn migrate(path: &PathBuf, secret: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("migrate")
        .arg("--config")
        .arg(path)
        .args(extra)
        .env("TOLLGATE_KEY_SECRET", secret)
        .env_remove("TOLLGATE_DATABASE_URL")
        .output()
        .expect("run tollgate migrate")
}

fn config_with_secret(db: &TestDb, secret: &str) -> tollgate::Config {
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[store]\nurl = \"{}\"\n[keys]\nsecret = \"{secret}\"\n\
         [upstreams.a]\nurl = \"http://@UPSTREAM@\"\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n",
        db.url
    );
    config_from(&text, "127.0.0.1:9".parse().expect("addr"), &[])
}

async fn starts(db: &TestDb, secret: &str) -> Result<(), String> {
    match tollgate::Server::start(config_with_secret(db, secret)).await {
        Ok(server) => {
            server.shutdown().await;
            Ok(())
        }
        Err(err) => Err(err.to_string()),
    }
}

#[tokio::test]
async fn migrate_applies_once_then_is_a_no_op() {
    let db = TestDb::new().await;
    let path = write_config(&db, "once");
    let first = migrate(&path, "alpha", &[]);
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(stdout.contains("applied 9 migration(s)"), "{stdout}");
    assert!(stdout.contains("key fingerprint stored"), "{stdout}");

    let second = migrate(&path, "alpha", &[]);
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert!(second.status.success());
    assert!(stdout.contains("no migration applied"), "{stdout}");
    assert!(stdout.contains("unchanged"), "{stdout}");

    let pg = db.client().await;
    let n: i64 = pg
        .query_one("SELECT count(*) FROM tollgate_migrations", &[])
        .await
        .expect("query")
        .get(0);
    assert_eq!(n, 9);
    // The fingerprint is not the secret.
    let stored: String = pg
        .query_one(
            "SELECT value FROM tollgate_settings WHERE name = 'key_fingerprint'",
            &[],
        )
        .await
        .expect("fingerprint row")
        .get(0);
    assert!(!stored.contains("alpha"));
}

// Multi-threaded: the CLI runs as a blocking child process while in-process servers' database
// connections must keep being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_new_key_rotates_and_the_old_key_is_then_refused() {
    let db = TestDb::new().await;
    let path = write_config(&db, "rotate");
    assert!(migrate(&path, "old-secret", &[]).status.success());
    assert!(starts(&db, "old-secret").await.is_ok());
    let refused = starts(&db, "new-secret")
        .await
        .expect_err("new key before rotation");
    assert!(refused.contains("fingerprint"), "{refused}");

    // Without --accept-new-key, migrate refuses to change the key.
    let plain = migrate(&path, "new-secret", &[]);
    assert_eq!(plain.status.code(), Some(1));

    let rotated = migrate(&path, "new-secret", &["--accept-new-key"]);
    let stdout = String::from_utf8_lossy(&rotated.stdout);
    assert!(
        rotated.status.success(),
        "{}",
        String::from_utf8_lossy(&rotated.stderr)
    );
    assert!(stdout.contains("key fingerprint replaced"), "{stdout}");

    assert!(starts(&db, "new-secret").await.is_ok());
    let refused = starts(&db, "old-secret")
        .await
        .expect_err("old key after rotation");
    assert!(refused.contains("fingerprint"), "{refused}");
}

#[test]
fn migrate_without_a_database_exits_1() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let dir = std::env::temp_dir().join(format!("tollgate-migrate-{}-down", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nurl = \"postgres://postgres@{closed}/x\"\n\
             [upstreams.a]\nurl = \"http://127.0.0.1:9\"\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n"
        ),
    )
    .expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["migrate", "--config"])
        .arg(&path)
        .env_remove("TOLLGATE_DATABASE_URL")
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("tollgate: migrate failed"), "{stderr}");
}

/// PostgreSQL's NOTICEs (`relation "tollgate_migrations" already exists, skipping` from the
/// migrations' `IF NOT EXISTS`) are routine: at DEBUG, not in an operator's INFO log.
#[tokio::test]
async fn postgres_notices_are_logged_at_debug_not_info() {
    for (level, tag) in [("info", "notice-info"), ("debug", "notice-debug")] {
        let db = TestDb::new().await;
        let path = write_config(&db, tag);
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["migrate", "--config"])
            .arg(&path)
            .env("TOLLGATE_KEY_SECRET", "alpha")
            .env("RUST_LOG", level)
            .env_remove("TOLLGATE_LOG")
            .env_remove("TOLLGATE_DATABASE_URL")
            .output()
            .expect("run tollgate migrate");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let notices: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("already exists, skipping"))
            .collect();
        if level == "info" {
            assert!(notices.is_empty(), "a NOTICE at INFO:\n{stderr}");
        } else {
            assert!(
                !notices.is_empty(),
                "the NOTICE is gone altogether:\n{stderr}"
            );
            assert!(notices.iter().all(|l| l.contains("DEBUG")), "{stderr}");
        }
    }
}

/// `explain` reads the counters in PostgreSQL and never increments them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_reads_postgres_counts_without_incrementing() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[store]\nurl = \"{}\"\n[keys]\nsecret = \"s3cret\"\n\
         [upstreams.a]\nurl = \"http://@UPSTREAM@\"\n\
         [[routes]]\nname = \"r\"\nupstream = \"a\"\n\
         [[routes.limits]]\nkey = \"ip\"\nrequests = 2\nwindow = \"366d\"\n",
        db.url
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    // The counts below are exact only once the store decides: a request before that is the
    // failure policy's (allowed, uncounted).
    proxy.until_store_ready(Duration::from_secs(30)).await;
    let client = h1_client();
    for _ in 0..3 {
        get(&client, &proxy.url("/x")).await;
    }
    let dir = std::env::temp_dir().join(format!("tollgate-explain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        text.replace("@UPSTREAM@", &upstream.addr.to_string()),
    )
    .expect("write config");
    let explain = move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "--config"])
            .arg(&path)
            .args(["--ip", "127.0.0.1", "GET", "http://any.host/x"])
            .env_remove("TOLLGATE_DATABASE_URL")
            .output()
            .expect("run explain")
    };
    for _ in 0..2 {
        let out = tokio::task::spawn_blocking(explain.clone())
            .await
            .expect("task");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Two allowed; the third, denied, added nothing (contract §3d).
        assert!(stdout.contains("count 2,"), "{stdout}");
        assert!(stdout.contains("decision    limited (429)"), "{stdout}");
        assert!(!stdout.contains("127.0.0.1:"), "{stdout}");
    }
    let pg = db.client().await;
    let count: i32 = pg
        .query_one("SELECT count FROM rate_limits", &[])
        .await
        .expect("one row")
        .get(0);
    assert_eq!(count, 2, "explain changed the count");
}

/// A configuration for `explain` against `url`: one `ip` limit of 5 per 366 days with
/// `algorithm`, the decision budget at its default 100 ms.
fn explain_config(url: &str, secret: &str, algorithm: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-explain-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n[store]\nurl = \"{url}\"\ntimeout = \"100ms\"\n\
             [keys]\nsecret = \"{secret}\"\n[upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\
             [[routes]]\nname = \"r\"\nupstream = \"a\"\n\
             [[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"366d\"\nalgorithm = \"{algorithm}\"\n"
        ),
    )
    .expect("write config");
    path
}

/// Runs `tollgate explain` on a blocking thread (the test's relay or database keeps running).
async fn explain_out(path: &std::path::Path) -> (Option<i32>, String, String) {
    let path = path.to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "--config"])
            .arg(&path)
            .args(["--ip", "192.0.2.7", "GET", "http://any.host/x"])
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("RUST_LOG")
            .output()
            .expect("run explain")
    })
    .await
    .expect("task");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// With the database down, `explain` still says what it knows without it (request, route,
/// limits and their buckets), says the store is unreachable, and exits 1 with one line on
/// stderr (contract §1: "any other failure").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_with_the_database_down_says_what_it_can_and_exits_1() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let url = format!("postgres://postgres@127.0.0.1:{port}/none");
    let path = explain_config(&url, "alpha", "fixed", "down");
    let (code, stdout, stderr) = explain_out(&path).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("route       r -> upstream a"), "{stdout}");
    assert!(
        stdout.contains("store       postgres: unreachable"),
        "{stdout}"
    );
    assert!(
        stdout.contains("limit       r:ip: 5 per 31622400s, bucket r:ip:"),
        "{stdout}"
    );
    assert!(stdout.contains("count unknown"), "{stdout}");
    assert!(stdout.contains("decision    unknown"), "{stdout}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("tollgate explain: "), "{stderr}");
    assert!(stderr.contains("unreachable"), "{stderr}");
}

/// With another key secret than the database's, `explain` does not give `run`'s rotation
/// advice: it shows this configuration's buckets, says they are not the ones the running
/// instances count in, and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_with_another_secret_says_the_buckets_differ() {
    let db = TestDb::new().await;
    let migrated = migrate(&write_config(&db, "explain-secret"), "alpha", &[]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let path = explain_config(&db.url, "beta", "fixed", "secret");
    let (code, stdout, stderr) = explain_out(&path).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("route       r -> upstream a"), "{stdout}");
    assert!(
        stdout.contains("store       postgres: key fingerprint mismatch"),
        "{stdout}"
    );
    assert!(stdout.contains("bucket r:ip:"), "{stdout}");
    assert!(stdout.contains("count unknown"), "{stdout}");
    assert!(stdout.contains("decision    unknown"), "{stdout}");
    assert!(!stdout.contains("accept-new-key"), "{stdout}");
    assert!(!stderr.contains("accept-new-key"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("keys.secret"), "{stderr}");
}

/// A slow database (every packet held 60 ms each way, far past the 100 ms decision budget
/// once a connection is to be made): `explain`'s one-off read has a budget of its own and
/// still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_answers_from_a_slow_database() {
    let db = TestDb::new().await;
    let migrated = migrate(&write_config(&db, "explain-slow"), "alpha", &[]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let relay = crate::common::faulty::FaultyTcp::start(db.server_addr(), true).await;
    relay.delay(Duration::from_millis(60));
    let path = explain_config(&db.url_through(relay.addr), "alpha", "fixed", "slow");
    let (code, stdout, stderr) = explain_out(&path).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("store       postgres"), "{stdout}");
    assert!(stdout.contains("count 0,"), "{stdout}");
    assert!(stdout.contains("decision    allowed"), "{stdout}");
}

/// A sliding limit (contract §3a): `explain` shows the previous window's count and the estimate
/// `previous * (window - elapsed) / window + current + 1`, and decides by it. Here the
/// current count alone (2 + 1 of 5) would fit; the previous window's weight does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_weighs_the_previous_window_of_a_sliding_limit() {
    let db = TestDb::new().await;
    let migrated = migrate(&write_config(&db, "explain-sliding"), "alpha", &[]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let path = explain_config(&db.url, "alpha", "sliding", "sliding");
    let (code, stdout, stderr) = explain_out(&path).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("5 per 31622400s sliding"), "{stdout}");
    assert!(
        stdout.contains("count 0, previous window 0 (weighs 0.00), estimate 1.00"),
        "{stdout}"
    );
    let bucket = stdout
        .split("bucket ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .expect("a bucket in the output")
        .to_owned();
    let pg = db.client().await;
    const WINDOW: i64 = 366 * 86_400;
    pg.execute(
        "INSERT INTO rate_limits (bucket, window_start, count, expires_at) \
         SELECT $1, to_timestamp(s + d * $2), c, to_timestamp(s + (d + 2) * $2) \
         FROM (SELECT (floor(extract(epoch FROM now()))::int8 / $2) * $2 AS s) AS w, \
              (VALUES (0::int8, 2), (-1::int8, 1000000)) AS v(d, c)",
        &[&bucket, &WINDOW],
    )
    .await
    .expect("insert the current and the previous window");
    let (code, stdout, stderr) = explain_out(&path).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("count 2, previous window 1000000 (weighs "),
        "{stdout}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let window = WINDOW as f64;
    let left = window - now.rem_euclid(window);
    let expected = 1_000_000.0 * left / window + 3.0;
    let shown: f64 = stdout
        .split("estimate ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("an estimate in the output");
    assert!(
        (shown - expected).abs() < 1.0,
        "estimate {shown}, expected {expected}: {stdout}"
    );
    assert!(stdout.contains("-> exceeded"), "{stdout}");
    assert!(stdout.contains("decision    limited (429)"), "{stdout}");
}
