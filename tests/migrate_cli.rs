//! `tollgate migrate` against a real database (SPEC sections 1 and 3): migrations once, a
//! no-op the second time, key rotation with `--accept-new-key`, and the refusal of the old key
//! afterwards.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::db::TestDb;
use common::*;

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
    assert!(stdout.contains("applied 5 migration(s)"), "{stdout}");
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
    assert_eq!(n, 5);
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
        assert!(stdout.contains("count 3,"), "{stdout}");
        assert!(stdout.contains("decision    limited (429)"), "{stdout}");
        assert!(!stdout.contains("127.0.0.1:"), "{stdout}");
    }
    let pg = db.client().await;
    let count: i32 = pg
        .query_one("SELECT count FROM rate_limits", &[])
        .await
        .expect("one row")
        .get(0);
    assert_eq!(count, 3, "explain changed the count");
}
