//! `tollgate usage` (contract §1, §3e): the real binary prints one JSON object with each
//! applicable limit's bucket, requests, window, algorithm, units used and left, and seconds to
//! reset, as a real tollgate on a real PostgreSQL counted them; it says what `explain` says
//! about the same request; with the memory store it reads 0 as `explain` does; bad arguments
//! exit 2 and an unreadable store exits 1, with one line on stderr and nothing on stdout.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use serde_json::Value;

use crate::common::db::TestDb;
use crate::common::*;

/// Route `fixed` (`/fixed`): 5 per 366 days per address, and a keyed limit the tests'
/// requests do not carry the header of; route `sliding` (`/sliding`): 5 per 366 days,
/// sliding. Windows that long do not roll over while a test runs.
const ROUTES: &str = r#"
[[routes]]
name = "fixed"
path_prefix = "/fixed"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 5
  window = "366d"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 2
  window = "1m"

[[routes]]
name = "sliding"
path_prefix = "/sliding"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 5
  window = "366d"
  algorithm = "sliding"
"#;

const YEAR: u64 = 366 * 86_400;

/// Writes `text` (with `@UPSTREAM@` filled in) to a file of this test's own.
fn config_file(tag: &str, text: &str, upstream: &str) -> PathBuf {
    write_config_file("usage", tag, &text.replace("@UPSTREAM@", upstream))
}

/// `tollgate COMMAND --config PATH ARGS...` on a blocking thread: exit code, stdout, stderr.
async fn tollgate(command: &str, path: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let (command, path) = (command.to_owned(), path.to_path_buf());
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([command.as_str(), "--config"])
            .arg(&path)
            .args(&args)
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("TOLLGATE_CONFIG")
            .env_remove("RUST_LOG")
            .output()
            .expect("run tollgate")
    })
    .await
    .expect("command task");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `tollgate usage` for `GET http://t{path}` from 127.0.0.1: its one JSON object.
async fn usage(path: &Path, url_path: &str) -> Value {
    let url = format!("http://t{url_path}");
    let (code, stdout, stderr) = tollgate("usage", path, &["--ip", "127.0.0.1", "GET", &url]).await;
    assert_eq!(code, Some(0), "usage {url_path}: {stdout}{stderr}");
    assert_eq!(stdout.lines().count(), 1, "one line: {stdout}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// `tollgate explain` for the same request as [`usage`]: its stdout.
async fn explain(path: &Path, url_path: &str) -> String {
    let url = format!("http://t{url_path}");
    let (code, stdout, stderr) =
        tollgate("explain", path, &["--ip", "127.0.0.1", "GET", &url]).await;
    assert_eq!(code, Some(0), "explain {url_path}: {stdout}{stderr}");
    stdout
}

/// Seconds until the current window of `window` seconds ends, by this machine's clock, and
/// the fraction of it still to come.
fn window_left(window: u64) -> (u64, f64) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let left = window as f64 - now % window as f64;
    (left.ceil() as u64, left / window as f64)
}

/// The one limit of a usage object, checked for the fields every limit has.
fn only_limit<'v>(usage: &'v Value, route: &str, window: u64, algorithm: &str) -> &'v Value {
    assert_eq!(usage["route"], route, "{usage}");
    let limits = usage["limits"].as_array().expect("limits");
    assert_eq!(limits.len(), 1, "only the limit that applies: {usage}");
    let limit = &limits[0];
    let policy = format!("{route}:ip");
    assert_eq!(limit["policy"], policy.as_str(), "{usage}");
    let bucket = limit["bucket"].as_str().expect("bucket");
    let digest = bucket
        .strip_prefix(&format!("{policy}:"))
        .expect("the policy's bucket");
    assert!(
        digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
        "a digest, never the address: {bucket}"
    );
    assert_eq!(limit["requests"], 5, "{usage}");
    assert_eq!(limit["window"], window, "{usage}");
    assert_eq!(limit["algorithm"], algorithm, "{usage}");
    assert_eq!(limit["override"], false, "{usage}");
    let reset = limit["reset"].as_u64().expect("reset");
    let (expected, _) = window_left(window);
    assert!(
        reset.abs_diff(expected) <= 2,
        "reset {reset}, expected {expected}"
    );
    limit
}

/// `n` requests to `path` through `proxy`, each with the expected status.
async fn send(client: &H1Client, proxy: &Proxy, path: &str, n: usize, status: StatusCode) {
    for _ in 0..n {
        assert_eq!(get(client, &proxy.url(path)).await.status, status, "{path}");
    }
}

/// A real tollgate counts on a real PostgreSQL; `usage` reads what it counted, in units, for a
/// fixed and a sliding limit, and never increments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reads_what_the_proxy_counted() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = limits_config(&pg_store(&db), "workers = 1", ROUTES);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    // Exact counts need the store deciding: before that, the failure policy's (uncounted).
    proxy.until_store_ready(Duration::from_secs(30)).await;
    let path = config_file("counted", &text, &upstream.addr.to_string());
    let client = h1_client();
    send(&client, &proxy, "/fixed", 3, StatusCode::OK).await;
    let value = usage(&path, "/fixed").await;
    let fixed = only_limit(&value, "fixed", YEAR, "fixed");
    assert_eq!(fixed["used"], 3, "{value}");
    assert_eq!(fixed["left"], 2, "{value}");
    // Past the limit: none left, and `used` is the row's count, the allowed requests only (a
    // denied request adds nothing, contract §3d).
    send(&client, &proxy, "/fixed", 2, StatusCode::OK).await;
    send(&client, &proxy, "/fixed", 2, StatusCode::TOO_MANY_REQUESTS).await;
    let pg = db.client().await;
    let stored: i32 = pg
        .query_one("SELECT count FROM rate_limits", &[])
        .await
        .expect("the fixed bucket's row")
        .get(0);
    assert_eq!(stored, 5, "the five allowed requests");
    let value = usage(&path, "/fixed").await;
    let fixed = only_limit(&value, "fixed", YEAR, "fixed");
    assert_eq!(fixed["used"], stored, "{value}");
    assert_eq!(fixed["left"], 0, "{value}");

    send(&client, &proxy, "/sliding", 2, StatusCode::OK).await;
    let value = usage(&path, "/sliding").await;
    let sliding = only_limit(&value, "sliding", YEAR, "sliding");
    assert_eq!(sliding["used"], 2.0, "{value}");
    assert_eq!(sliding["left"], 3, "{value}");
    // The previous window's 2 weigh by what is left of this one: the estimate is used.
    let bucket = sliding["bucket"].as_str().expect("bucket").to_owned();
    pg.execute(
        "INSERT INTO rate_limits (bucket, window_start, count, expires_at) \
         SELECT bucket, window_start - make_interval(secs => $2), 2, expires_at \
         FROM rate_limits WHERE bucket = $1",
        &[&bucket, &(YEAR as f64)],
    )
    .await
    .expect("the previous window's row");
    let value = usage(&path, "/sliding").await;
    let sliding = only_limit(&value, "sliding", YEAR, "sliding");
    let (_, fraction) = window_left(YEAR);
    let estimate = 2.0 * fraction + 2.0;
    let used = sliding["used"].as_f64().expect("used");
    assert!(
        (used - estimate).abs() <= 0.011,
        "used {used}, estimate {estimate}"
    );
    assert_eq!(sliding["left"], (5.0 - used).floor() as u64, "{value}");
    // Read, never incremented: the proxy's counts are as they were.
    let counts: Vec<i32> = pg
        .query("SELECT count FROM rate_limits ORDER BY count DESC", &[])
        .await
        .expect("counts")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(counts, [stored, 2, 2]);
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// The `limit` line of `explain`'s output for `policy`.
fn explain_line<'o>(stdout: &'o str, policy: &str) -> &'o str {
    let head = format!("limit       {policy}: ");
    stdout
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no {policy} line: {stdout}"))
}

/// The text between `before` and `after` in `line`.
fn between<'l>(line: &'l str, before: &str, after: &str) -> &'l str {
    let rest = &line[line
        .find(before)
        .unwrap_or_else(|| panic!("{before}: {line}"))
        + before.len()..];
    &rest[..rest
        .find(after)
        .unwrap_or_else(|| panic!("{after}: {line}"))]
}

/// `usage` and `explain` say the same of one request: bucket, requests, window, counts, units
/// left and seconds to reset, for a fixed and a sliding limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_and_explain_agree() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = limits_config(&pg_store(&db), "workers = 1", ROUTES);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    proxy.until_store_ready(Duration::from_secs(30)).await;
    let path = config_file("agree", &text, &upstream.addr.to_string());
    let client = h1_client();
    send(&client, &proxy, "/fixed", 4, StatusCode::OK).await;
    send(&client, &proxy, "/sliding", 3, StatusCode::OK).await;
    for (route, window, algorithm) in [("fixed", YEAR, "fixed"), ("sliding", YEAR, "sliding")] {
        let url_path = format!("/{route}");
        let value = usage(&path, &url_path).await;
        let stdout = explain(&path, &url_path).await;
        let limit = only_limit(&value, route, window, algorithm);
        let line = explain_line(&stdout, &format!("{route}:ip"));
        assert_eq!(between(line, "bucket ", ","), limit["bucket"], "{line}");
        let requests = between(line, ": ", " per ");
        assert_eq!(requests, limit["requests"].to_string(), "{line}");
        assert_eq!(between(line, " per ", "s"), window.to_string(), "{line}");
        let count: u64 = between(line, "count ", ",").parse().expect("count");
        let reset: u64 = between(line, "resets in ", "s").parse().expect("reset");
        let usage_reset = limit["reset"].as_u64().expect("reset");
        assert!(reset.abs_diff(usage_reset) <= 1, "{line} / {value}");
        if algorithm == "fixed" {
            assert_eq!(limit["used"], count, "{line}");
            let left = between(line, &format!("count {count}, "), " left");
            assert_eq!(left, limit["left"].to_string(), "{line}");
        } else {
            // No previous window: the estimate is the count, 3 of 5 with 2 left.
            assert_eq!(limit["used"].as_f64(), Some(count as f64), "{line}");
            assert!(line.contains("previous window 0 (weighs 0.00)"), "{line}");
            assert_eq!(limit["left"], 5 - count, "{line}");
        }
        assert!(line.ends_with("-> within"), "{line}");
        assert!(stdout.contains("decision    allowed"), "{stdout}");
    }
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// With the memory store the counts live in the running process: `usage` reads 0, as
/// `explain` does ("shown as 0 here"), and exits 0; a route without limits has none; a
/// request that matches no route, or that the proxy refuses, has no route.
#[tokio::test]
async fn usage_with_the_memory_store_reads_0_as_explain_does() {
    let text = limits_config("", "", ROUTES);
    let path = config_file("memory", &text, "127.0.0.1:9");
    let value = usage(&path, "/fixed").await;
    let fixed = only_limit(&value, "fixed", YEAR, "fixed");
    assert_eq!(fixed["used"], 0, "{value}");
    assert_eq!(fixed["left"], 5, "{value}");
    let stdout = explain(&path, "/fixed").await;
    assert!(stdout.contains("store       memory: "), "{stdout}");
    assert!(
        explain_line(&stdout, "fixed:ip").contains("count 0, 5 left"),
        "{stdout}"
    );
    // The catch-all route `open` has no limits.
    let value = usage(&path, "/elsewhere").await;
    assert_eq!(value, serde_json::json!({"route": "open", "limits": []}));
    let (code, stdout, stderr) = tollgate("usage", &path, &["TRACE", "http://t/fixed"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let value: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(value, serde_json::json!({"route": null, "limits": []}));
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// Bad arguments are usage errors: exit 2, one line on stderr, nothing on stdout.
#[tokio::test]
async fn usage_with_bad_arguments_exits_2() {
    let path = config_file("bad", &limits_config("", "", ROUTES), "127.0.0.1:9");
    for args in [
        &["G(T", "http://t/fixed"][..],
        &["--header", "no colon", "GET", "http://t/fixed"],
        &["GET", "/fixed"],
        &["--ip", "not-an-address", "GET", "http://t/fixed"],
        &["GET"],
    ] {
        let (code, stdout, stderr) = tollgate("usage", &path, args).await;
        assert_eq!(code, Some(2), "{args:?}: {stdout}{stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert!(!stderr.trim().is_empty(), "{args:?}: says why");
        if !args.contains(&"--ip") && args.len() > 1 {
            assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
            assert!(stderr.starts_with("tollgate usage: "), "{args:?}: {stderr}");
        }
    }
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// A database that cannot be reached: exit 1, one line on stderr, nothing on stdout (a script
/// gets no object rather than one with made-up counts).
#[tokio::test]
async fn usage_with_the_database_down_exits_1() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let store = format!("url = \"postgres://postgres@127.0.0.1:{port}/none\"");
    let path = config_file("down", &limits_config(&store, "", ROUTES), "127.0.0.1:9");
    let (code, stdout, stderr) = tollgate(
        "usage",
        &path,
        &["--ip", "127.0.0.1", "GET", "http://t/fixed"],
    )
    .await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("tollgate usage: cannot read the counters: "),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}
