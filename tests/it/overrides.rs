//! Per-subject overrides (contract §1 and §3e; issue 51): the real `tollgate override` binary
//! against a real PostgreSQL, two tollgate instances in this process and the recording
//! upstream. An override raises one token's limit while another token keeps the file's, on
//! every instance within a second and without a reload; `--requests 0` blocks; an `--until`
//! in the past does not apply and one that passes stops applying; `remove` restores; `list`
//! shows digests and notes and the raw token appears nowhere; a cut `LISTEN` session and a
//! transaction-mode PgBouncer (where `LISTEN` cannot work) still converge by the re-read; a
//! reload keeps overrides, in process and through SIGHUP to a real `tollgate run`; the memory
//! store and bad arguments are refused in one line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use http::{Request, StatusCode};
use http_body_util::Full;

use crate::common::db::TestDb;
use crate::common::log::CapturedLog;
use crate::common::pgbouncer::{PgBouncer, PoolMode};
use crate::common::ratelimit::members;
use crate::common::*;

/// Route `api` (`/api`): 3 requests per hour per `Authorization` value; route `bulk`
/// (`/bulk`): 100 per hour per `Authorization` value, taken in reserved shares.
const API_ROUTE: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "header:authorization"
  requests = 3
  window = "1h"

[[routes]]
name = "bulk"
path_prefix = "/bulk"
upstream = "app"

  [[routes.limits]]
  key = "header:authorization"
  requests = 100
  window = "1h"
  reserve = true
"#;

/// The limit's `requests` in the file.
const FILE_REQUESTS: u64 = 3;

/// The configuration for a store URL (one connection worker, so that logs are on the test's
/// thread).
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
    write_config_file("overrides", name, &text)
}

/// Runs `tollgate override ARGS --config PATH` (with `RUST_LOG` set to `log`).
async fn tollgate_override(path: &Path, args: &[&str], log: &str) -> Output {
    let path = path.to_path_buf();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let log = log.to_owned();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("override")
            .args(&args)
            .arg("--config")
            .arg(&path)
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("TOLLGATE_CONFIG")
            .env("RUST_LOG", log)
            .output()
            .expect("run tollgate override")
    })
    .await
    .expect("override task")
}

/// `tollgate override ARGS` that must succeed; its stdout.
async fn succeeds(path: &Path, args: &[&str]) -> String {
    let out = tollgate_override(path, args, "error").await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tollgate override {args:?} failed: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn bearer(token: &str) -> String {
    format!("Authorization: Bearer {token}")
}

/// `override set` of `token`'s bucket to `requests`, with `extra` arguments.
async fn set(path: &Path, token: &str, requests: &str, extra: &[&str]) -> String {
    let header = bearer(token);
    let mut args = vec![
        "set",
        "--limit",
        "api:authorization",
        "--header",
        &header,
        "--requests",
        requests,
    ];
    args.extend_from_slice(extra);
    succeeds(path, &args).await
}

/// `override remove` of `token`'s bucket.
async fn remove(path: &Path, token: &str) -> String {
    let header = bearer(token);
    let args = [
        "remove",
        "--limit",
        "api:authorization",
        "--header",
        &header,
    ];
    succeeds(path, &args).await
}

/// One request of `token` to `proxy`: its status and the `q` its `RateLimit-Policy` names.
async fn ask(client: &H1Client, proxy: &Proxy, token: &str) -> (StatusCode, Option<u64>) {
    ask_at(client, proxy, "/api", token).await
}

/// [`ask`] on `path`.
async fn ask_at(
    client: &H1Client,
    proxy: &Proxy,
    path: &str,
    token: &str,
) -> (StatusCode, Option<u64>) {
    let req = Request::get(proxy.url(path))
        .header("authorization", format!("Bearer {token}"))
        .body(Full::default())
        .expect("request");
    let answer = send(client, req).await;
    let q = answer
        .header("ratelimit-policy")
        .map(|field| members(field)[0].param("q"));
    (answer.status, q)
}

/// `tollgate_overrides` on `proxy`'s metrics page.
fn in_force(proxy: &Proxy) -> Option<i64> {
    proxy
        .server()
        .metrics()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_overrides "))
        .and_then(|v| v.parse().ok())
}

/// Waits until every proxy has `n` overrides in force; answers how long it took.
async fn until_in_force(proxies: &[&Proxy], n: i64, within: Duration) -> Duration {
    let started = Instant::now();
    while proxies.iter().any(|p| in_force(p) != Some(n)) {
        let seen: Vec<Option<i64>> = proxies.iter().map(|p| in_force(p)).collect();
        assert!(
            started.elapsed() < within,
            "not {n} overrides in force everywhere within {within:?}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// Admitted requests of `token`, alternating between `a` and `b`, until the first 429 (at
/// most `most`); every answer's `q` must be `q`.
async fn admitted(client: &H1Client, a: &Proxy, b: &Proxy, token: &str, q: u64) -> u64 {
    for n in 0..50u64 {
        let proxy = if n % 2 == 0 { a } else { b };
        let (status, seen) = ask(client, proxy, token).await;
        assert_eq!(seen, Some(q), "q of {token} after {n} admitted");
        if status == StatusCode::TOO_MANY_REQUESTS {
            return n;
        }
        assert_eq!(status, StatusCode::OK);
    }
    panic!("{token} was never limited");
}

/// Two instances on one database, both hearing notifications.
struct Two {
    db: TestDb,
    _upstream: Upstream,
    a: Proxy,
    b: Proxy,
    path: PathBuf,
}

impl Two {
    async fn start(name: &str) -> Two {
        let db = TestDb::new().await;
        let upstream = Upstream::start().await;
        let text = config_text(&db.url);
        let a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
        let b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
        let path = config_file(name, &text, &upstream);
        for proxy in [&a, &b] {
            proxy.until_store_ready(Duration::from_secs(10)).await;
            proxy.until_hearing_resets(Duration::from_secs(10)).await;
        }
        Two {
            db,
            _upstream: upstream,
            a,
            b,
            path,
        }
    }
}

impl Drop for Two {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.path.parent().expect("dir"));
    }
}

/// `set` raises one token's limit on both instances within a second, without a reload, while
/// another token keeps the file's; a token whose denial both instances cached is admitted
/// again once its limit is raised; `remove` restores the file's limit.
#[tokio::test]
async fn set_raises_one_tokens_limit_everywhere_within_a_second_and_remove_restores() {
    let two = Two::start("raise").await;
    let (a, b, path) = (&two.a, &two.b, &two.path);
    let client = h1_client();
    assert_eq!(admitted(&client, a, b, "capped", FILE_REQUESTS).await, 3);
    // Both instances have denied `capped` now; a denial cached from the store is held
    // against the plan's `requests`, so raising the limit admits it again at once.
    assert_eq!(
        ask(&client, a, "capped").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    let out = set(path, "acme", "10", &["--note", "ACME trial"]).await;
    assert!(
        out.contains("override    bucket api:authorization:"),
        "{out}"
    );
    assert!(out.contains("requests 3 (the file's) -> 10"), "{out}");
    let took = until_in_force(&[a, b], 1, Duration::from_secs(5)).await;
    assert!(took <= Duration::from_secs(1), "applied after {took:?}");
    assert_eq!(admitted(&client, a, b, "acme", 10).await, 10);
    assert_eq!(admitted(&client, a, b, "other", FILE_REQUESTS).await, 3);

    set(path, "capped", "10", &[]).await;
    let took = until_in_force(&[a, b], 2, Duration::from_secs(5)).await;
    assert!(took <= Duration::from_secs(1), "applied after {took:?}");
    for proxy in [a, b] {
        assert_eq!(
            ask(&client, proxy, "capped").await,
            (StatusCode::OK, Some(10))
        );
    }

    let out = remove(path, "acme").await;
    assert!(out.contains("requests 10 -> 3 (the file's)"), "{out}");
    let took = until_in_force(&[a, b], 1, Duration::from_secs(5)).await;
    assert!(took <= Duration::from_secs(1), "removed after {took:?}");
    for proxy in [a, b] {
        let answer = ask(&client, proxy, "acme").await;
        assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, Some(FILE_REQUESTS)));
    }
    // Removing again removes nothing, and says so.
    let out = remove(path, "acme").await;
    assert!(out.contains("removed     nothing"), "{out}");
}

/// Units of a reserved share taken under the file's 100 never admit a request once an
/// override lowered the token's limit to 3; raised again, it is admitted on both instances.
#[tokio::test]
async fn a_reserved_share_never_admits_past_a_lowered_override() {
    let two = Two::start("reserve").await;
    let (a, b, path) = (&two.a, &two.b, &two.path);
    let client = h1_client();
    for _ in 0..5 {
        let answer = ask_at(&client, a, "/bulk", "heavy").await;
        assert_eq!(answer, (StatusCode::OK, Some(100)));
    }
    let header = bearer("heavy");
    let lower = [
        "set",
        "--limit",
        "bulk:authorization",
        "--header",
        &header,
        "--requests",
        "3",
    ];
    succeeds(path, &lower).await;
    until_in_force(&[a, b], 1, Duration::from_secs(5)).await;
    for proxy in [a, a, b] {
        let answer = ask_at(&client, proxy, "/bulk", "heavy").await;
        assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, Some(3)));
    }
    let raise = [
        "set",
        "--limit",
        "bulk:authorization",
        "--header",
        &header,
        "--requests",
        "1000",
    ];
    succeeds(path, &raise).await;
    until_in_force(&[a, b], 1, Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    for proxy in [a, b] {
        // The raised limit is read within a second; the one before may still answer meanwhile.
        loop {
            let answer = ask_at(&client, proxy, "/bulk", "heavy").await;
            if answer == (StatusCode::OK, Some(1000)) {
                break;
            }
            assert!(Instant::now() < deadline, "not admitted again: {answer:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `tollgate explain` or `tollgate usage` (`command`) of `GET /api` with `token`: its stdout.
async fn reading_of(path: &Path, command: &str, token: &str) -> String {
    let path = path.to_path_buf();
    let (command, header) = (command.to_owned(), bearer(token));
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([command.as_str(), "--config"])
            .arg(&path)
            .args(["--header", &header, "GET", "http://any.host/api"])
            .env_remove("TOLLGATE_DATABASE_URL")
            .env_remove("TOLLGATE_CONFIG")
            .output()
            .expect("run tollgate")
    })
    .await
    .expect("command task");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `usage` and `explain` read the override the instances apply: `requests` is the
/// override's and says so, for that token only.
#[tokio::test]
async fn usage_and_explain_show_the_override() {
    let two = Two::start("usage").await;
    let (a, path) = (&two.a, &two.path);
    set(path, "acme", "10", &[]).await;
    until_in_force(&[a], 1, Duration::from_secs(5)).await;
    let client = h1_client();
    for _ in 0..2 {
        assert_eq!(ask(&client, a, "acme").await, (StatusCode::OK, Some(10)));
    }
    let usage: serde_json::Value =
        serde_json::from_str(&reading_of(path, "usage", "acme").await).expect("JSON");
    let limit = &usage["limits"][0];
    assert_eq!(
        (
            &limit["requests"],
            &limit["override"],
            &limit["used"],
            &limit["left"]
        ),
        (&10.into(), &true.into(), &2.into(), &8.into()),
        "{usage}"
    );
    let other: serde_json::Value =
        serde_json::from_str(&reading_of(path, "usage", "other").await).expect("JSON");
    let limit = &other["limits"][0];
    assert_eq!(
        (&limit["requests"], &limit["override"]),
        (&FILE_REQUESTS.into(), &false.into()),
        "{other}"
    );
    let explained = reading_of(path, "explain", "acme").await;
    assert!(
        explained.contains("api:authorization: 10 (override) per 3600s"),
        "{explained}"
    );
    assert!(explained.contains("count 2, 8 left"), "{explained}");
}

/// `--requests 0` blocks a token from its first request; an `--until` in the past is stored
/// but does not apply; one that passes while the instances run stops applying, without a
/// notification.
#[tokio::test]
async fn zero_blocks_and_an_until_that_passed_does_not_apply() {
    let two = Two::start("until").await;
    let (a, b, path) = (&two.a, &two.b, &two.path);
    let client = h1_client();
    let out = set(path, "abuser", "0", &["--note", "abuse ticket 7"]).await;
    assert!(out.contains("-> 0"), "{out}");
    until_in_force(&[a, b], 1, Duration::from_secs(5)).await;
    for proxy in [a, b] {
        assert_eq!(
            ask(&client, proxy, "abuser").await,
            (StatusCode::TOO_MANY_REQUESTS, Some(0))
        );
    }

    // An --until that has passed is refused (contract §3e: a usage error), so nothing of it
    // applies.
    let refused = tollgate_override(
        path,
        &[
            "set",
            "--limit",
            "api:authorization",
            "--header",
            &bearer("expired"),
            "--requests",
            "10",
            "--until",
            "2001-01-01T00:00:00Z",
        ],
        "error",
    )
    .await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("has passed"), "{stderr}");
    let soon = time::OffsetDateTime::now_utc() + time::Duration::seconds(3);
    let soon = soon
        .format(&time::format_description::well_known::Rfc3339)
        .expect("format");
    set(path, "trial", "10", &["--until", &soon]).await;
    until_in_force(&[a, b], 2, Duration::from_secs(5)).await;
    assert_eq!(
        ask(&client, a, "expired").await,
        (StatusCode::OK, Some(FILE_REQUESTS))
    );
    assert_eq!(ask(&client, b, "trial").await, (StatusCode::OK, Some(10)));
    // The trial ends while both run: the decision path stops applying it at once, and the
    // gauge follows at the next re-read.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ask(&client, a, "trial").await.1 != Some(FILE_REQUESTS) {
        assert!(Instant::now() < deadline, "the trial never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(ask(&client, b, "trial").await.1, Some(FILE_REQUESTS));
    until_in_force(&[a, b], 1, Duration::from_secs(15)).await;
}

/// `list` prints one line per override with its bucket's digest, `requests`, `until`, when
/// it was set and its note; the raw token appears nowhere: not on the command's stdout or
/// stderr (logging at trace level), not in the table, not in the instances' own logs at
/// trace level.
#[tokio::test]
async fn list_shows_digests_and_notes_and_the_raw_token_nowhere() {
    let captured = CapturedLog::new();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let two = Two::start("list").await;
    let (a, b, path) = (&two.a, &two.b, &two.path);
    const TOKEN: &str = "sk-live-7f3a9c1d2e";
    let header = bearer(TOKEN);
    let mut said = String::new();
    for args in [
        vec![
            "set",
            "--limit",
            "api:authorization",
            "--header",
            &header,
            "--requests",
            "500",
            "--until",
            "2999-01-31T00:00:00Z",
            "--note",
            "ACME \"trial\"",
        ],
        vec!["list"],
        vec!["list", "--limit", "api:authorization"],
    ] {
        let out = tollgate_override(path, &args, "trace").await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        said.push_str(&String::from_utf8_lossy(&out.stdout));
        said.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    set(path, "second", "0", &["--note", "blocked"]).await;
    until_in_force(&[a, b], 2, Duration::from_secs(5)).await;
    let client = h1_client();
    assert_eq!(ask(&client, a, TOKEN).await, (StatusCode::OK, Some(500)));

    let listed = succeeds(path, &["list"]).await;
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed}");
    let acme = lines
        .iter()
        .find(|l| l.contains("requests=500"))
        .expect("the raised token's line");
    let digest = acme
        .strip_prefix("api:authorization:")
        .and_then(|rest| rest.split_whitespace().next())
        .expect("a bucket first");
    assert_eq!(digest.len(), 64, "{acme}");
    assert!(digest.bytes().all(|c| c.is_ascii_hexdigit()), "{acme}");
    assert!(acme.contains("until=2999-01-31T00:00:00Z"), "{acme}");
    assert!(acme.contains("set_at=20"), "{acme}");
    assert!(acme.contains(r#"note="ACME \"trial\"""#), "{acme}");
    assert!(listed.contains("requests=0") && listed.contains("note=\"blocked\""));

    let pg = two.db.client().await;
    let rows: Vec<String> = pg
        .query(
            "SELECT row_to_json(o)::text FROM tollgate_overrides o \
             UNION ALL SELECT row_to_json(r)::text FROM rate_limits r",
            &[],
        )
        .await
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(rows.iter().any(|r| r.contains(digest)), "{rows:?}");
    let logged = captured.text();
    assert!(
        logged.contains("overrides"),
        "the trace capture saw nothing"
    );
    for (place, text) in [
        ("the command's output", said.as_str()),
        ("the list", listed.as_str()),
        ("the tables", &rows.join("\n")),
        ("the instances' trace log", logged.as_str()),
    ] {
        assert!(!text.contains(TOKEN), "the raw token in {place}:\n{text}");
    }
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

/// The listen sessions' backends are killed and the override set while they are away: its
/// notification reaches nobody, and both instances still apply it (the session's restart
/// and the periodic re-read both read the table again).
#[tokio::test]
async fn a_missed_notification_still_converges() {
    let two = Two::start("missed").await;
    let (a, b, path) = (&two.a, &two.b, &two.path);
    let pg = two.db.client().await;
    let sessions = listen_sessions(&pg, &two.db).await;
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    let terminate = "SELECT pg_terminate_backend(pid) FROM unnest($1::int4[]) AS pid";
    let setting = set(path, "acme", "10", &[]);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&sessions];
    let (killed, _) = tokio::join!(pg.execute(terminate, &params), setting);
    killed.expect("terminate");
    until_in_force(&[a, b], 1, Duration::from_secs(30)).await;
    let client = h1_client();
    assert_eq!(ask(&client, b, "acme").await, (StatusCode::OK, Some(10)));
}

/// Through PgBouncer in transaction mode no instance can `LISTEN`: the periodic re-read
/// applies a change within 30 s, and no server connection of the pool is left listening.
#[tokio::test]
async fn through_a_transaction_mode_pooler_overrides_converge_by_the_re_read() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, PoolMode::Transaction, 3);
    let upstream = Upstream::start().await;
    let url = bouncer.url(&db);
    let text = config_text(&url);
    let mut a = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let mut b = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let path = config_file("bouncer", &text, &upstream);
    a.until_store_ready(Duration::from_secs(10)).await;
    b.until_store_ready(Duration::from_secs(10)).await;
    set(&path, "acme", "10", &[]).await;
    let took = until_in_force(&[&a, &b], 1, Duration::from_secs(30)).await;
    let client = h1_client();
    assert_eq!(
        ask(&client, &a, "acme").await,
        (StatusCode::OK, Some(10)),
        "after {took:?}"
    );
    assert_eq!(
        ask(&client, &b, "other").await,
        (StatusCode::OK, Some(FILE_REQUESTS))
    );
    a.shutdown().await;
    b.shutdown().await;

    let pg = db.client().await;
    let user: String = pg
        .query_one("SELECT current_user::text", &[])
        .await
        .expect("user")
        .get(0);
    let seen = super::pgbouncer::ask_every_server_connection(
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
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// A reload (what SIGHUP runs) swaps the file's limits and keeps the overrides.
#[tokio::test]
async fn a_reload_keeps_overrides() {
    let two = Two::start("reload").await;
    let (a, b, path) = (&two.a, &two.b, &two.path);
    set(path, "acme", "10", &[]).await;
    until_in_force(&[a, b], 1, Duration::from_secs(5)).await;
    let changed = std::fs::read_to_string(path)
        .expect("config")
        .replace("requests = 3", "requests = 4");
    std::fs::write(path, changed).expect("write config");
    assert!(a.server().reload_from(path, |_| None).await, "reloaded");
    let client = h1_client();
    assert_eq!(ask(&client, a, "acme").await, (StatusCode::OK, Some(10)));
    assert_eq!(ask(&client, a, "other").await, (StatusCode::OK, Some(4)));
    assert_eq!(in_force(a), Some(1));
}

/// Ten thousand overrides load at start and are applied as one: the instance counts them,
/// and the one of a real token among them decides its requests, beside a token without one.
#[tokio::test]
async fn ten_thousand_overrides_load_and_apply() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = config_text(&db.url);
    let path = config_file("many", &text, &upstream);
    // Migrated (and the fingerprint stored) by a first instance, then filled behind its back.
    let first = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    first.until_store_ready(Duration::from_secs(10)).await;
    db.client()
        .await
        .batch_execute(
            "INSERT INTO tollgate_overrides (scope, label, digest, requests, note) \
             SELECT 'api', 'authorization', encode(sha256(n::text::bytea), 'hex'), n % 100, 'bulk' \
             FROM generate_series(1, 10000) AS n",
        )
        .await
        .expect("10,000 overrides");
    set(&path, "acme", "10", &[]).await;
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    assert_eq!(in_force(&proxy), Some(10_001), "read before serving");
    let client = h1_client();
    assert_eq!(
        ask(&client, &proxy, "acme").await,
        (StatusCode::OK, Some(10))
    );
    assert_eq!(
        ask(&client, &proxy, "other").await,
        (StatusCode::OK, Some(FILE_REQUESTS))
    );
    drop(first);
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// SIGHUP to a real `tollgate run` process swaps the file's limits and keeps the overrides.
#[tokio::test]
async fn sighup_keeps_overrides() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let text = config_text(&db.url);
    let path = config_file("sighup", &text, &upstream);
    let process = super::operations::Process::start(&path);
    let addr = process.address("listening").await;
    process
        .wait_for("overrides loaded", |v| {
            (v["message"] == "overrides: loaded from the database").then_some(())
        })
        .await;
    set(&path, "acme", "10", &[]).await;
    process
        .wait_for("overrides read again", |v| {
            (v["message"] == "overrides: read again" && v["count"] == 1).then_some(())
        })
        .await;
    let changed = std::fs::read_to_string(&path)
        .expect("config")
        .replace("requests = 3", "requests = 4");
    std::fs::write(&path, changed).expect("write config");
    process.signal("HUP");
    process
        .wait_for("reload applied", |v| {
            (v["message"] == "reload: configuration applied").then_some(())
        })
        .await;
    let client = h1_client();
    let q = |token: &str| {
        let req = Request::get(format!("http://{addr}/api"))
            .header("authorization", format!("Bearer {token}"))
            .body(Full::default())
            .expect("request");
        let client = client.clone();
        async move {
            let answer = send(&client, req).await;
            let field = answer.header("ratelimit-policy").expect("RateLimit-Policy");
            (answer.status, members(field)[0].param("q"))
        }
    };
    assert_eq!(q("acme").await, (StatusCode::OK, 10), "the override kept");
    assert_eq!(
        q("other").await,
        (StatusCode::OK, 4),
        "the file's new limit"
    );
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// With the memory store, `override` exits 1 and says that overrides need the database.
#[test]
fn the_memory_store_refuses_overrides() {
    let dir =
        std::env::temp_dir().join(format!("tollgate-overrides-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!("[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n{API_ROUTE}"),
    )
    .expect("config");
    for args in [
        &[
            "set",
            "--limit",
            "api:authorization",
            "--header",
            "Authorization: x",
            "--requests",
            "5",
        ][..],
        &["list"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("override")
            .args(args)
            .arg("--config")
            .arg(&path)
            .env_remove("TOLLGATE_DATABASE_URL")
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one clear line: {stderr}");
        assert!(stderr.contains("overrides need the database"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Arguments the limit cannot take are usage errors: exit 2 and one line saying what is
/// wrong, before the database is asked anything (this file's store does not exist).
#[test]
fn bad_arguments_exit_2_with_one_clear_line() {
    let dir = std::env::temp_dir().join(format!("tollgate-overrides-usage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nurl = \"postgres://tollgate@127.0.0.1:1/none\"\n\
             [upstreams.app]\nurl = \"http://127.0.0.1:9\"\n{API_ROUTE}"
        ),
    )
    .expect("config");
    let token = "Authorization: Bearer abc";
    let cases: [(&[&str], &str); 7] = [
        (
            &[
                "set",
                "--limit",
                "api:nope",
                "--header",
                token,
                "--requests",
                "5",
            ],
            "no such limit",
        ),
        (
            &[
                "set",
                "--limit",
                "api:authorization",
                "--header",
                "X-Tenant: a",
                "--requests",
                "5",
            ],
            "does not key on header x-tenant",
        ),
        (
            &[
                "set",
                "--limit",
                "api:authorization",
                "--header",
                token,
                "--requests",
                "-1",
            ],
            "--requests -1",
        ),
        (
            &[
                "set",
                "--limit",
                "api:authorization",
                "--header",
                token,
                "--requests",
                "5",
                "--until",
                "next week",
            ],
            "RFC 3339",
        ),
        (
            &[
                "set",
                "--limit",
                "api:authorization",
                "--header",
                token,
                "--requests",
                "5",
                "--until",
                "2001-01-01T00:00:00Z",
            ],
            "has passed",
        ),
        (
            &[
                "remove",
                "--limit",
                "api:authorization",
                "--ip",
                "192.0.2.7",
                "--header",
                token,
            ],
            "does not key on the client address",
        ),
        (&["list", "--limit", "nope:ip"], "no such limit"),
    ];
    for (args, says) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("override")
            .args(args)
            .arg("--config")
            .arg(&path)
            .env_remove("TOLLGATE_DATABASE_URL")
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("abc"),
            "{args:?}: the token echoed: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
