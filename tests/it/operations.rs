//! Operating tollgate as a process (contract §1, §7 and §8): SIGHUP reload (applied to new
//! requests while an in-flight one finishes; an invalid file changes nothing), JSON logs
//! without credentials, admin endpoints, `explain`, SIGTERM.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use crate::common::*;

/// tollgate as a child process, with JSON logs unless started with `start_text`; stderr lines
/// are collected as they come.
pub(super) struct Process {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Process {
    pub(super) fn start(config: &Path) -> Process {
        Process::spawn(config, "json")
    }

    /// JSON logs, `run` given `args`.
    fn start_with(config: &Path, args: &[&str]) -> Process {
        Process::spawn_with(config, "json", args)
    }

    /// With the default text logs.
    fn start_text(config: &Path) -> Process {
        Process::spawn(config, "")
    }

    fn spawn(config: &Path, log_format: &str) -> Process {
        Process::spawn_with(config, log_format, &[])
    }

    fn spawn_with(config: &Path, log_format: &str, args: &[&str]) -> Process {
        Process::spawn_at(config, log_format, "info", args)
    }

    /// With `RUST_LOG=rust_log`.
    fn spawn_at(config: &Path, log_format: &str, rust_log: &str, args: &[&str]) -> Process {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["run", "--config"])
            .arg(config)
            .args(args)
            .env("TOLLGATE_LOG", log_format)
            .env("RUST_LOG", rust_log)
            .env_remove("TOLLGATE_DATABASE_URL")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn tollgate");
        let stderr = child.stderr.take().expect("stderr");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(line);
            }
        });
        Process { child, lines }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("lock").clone()
    }

    /// Waits for a log line for which `pick` returns something.
    async fn wait_for_line<T>(&self, what: &str, pick: impl Fn(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(found) = self.lines().iter().find_map(|line| pick(line)) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no log line for {what}; got:\n{}",
                self.lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for a JSON log line for which `pick` returns something.
    pub(super) async fn wait_for<T>(
        &self,
        what: &str,
        pick: impl Fn(&serde_json::Value) -> Option<T>,
    ) -> T {
        self.wait_for_line(what, |line| pick(&serde_json::from_str(line).ok()?))
            .await
    }

    pub(super) async fn address(&self, message: &str) -> String {
        self.wait_for(message, |v| {
            (v["message"] == message).then(|| v["address"].as_str().map(str::to_string))?
        })
        .await
    }

    /// The proxy's address from the text log's `listening` line.
    async fn text_address(&self) -> String {
        self.wait_for_line("listening", |line| {
            let (_, rest) = line.split_once(" tollgate::server: listening address=")?;
            Some(rest.split(' ').next()?.to_string())
        })
        .await
    }

    pub(super) fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// SIGTERM, then the exit code.
    async fn stop(mut self) -> (Option<i32>, Vec<String>) {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                // Let the reader thread drain the last lines.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return (status.code(), self.lines());
            }
            assert!(
                Instant::now() < deadline,
                "tollgate did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn temp_config(tag: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-ops-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

fn config_text(upstream: &Upstream, requests: u32) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"

[admin]
listen = "127.0.0.1:0"

[upstreams.app]
url = "http://{}"

[[routes]]
name = "api"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = {requests}
  window = "366d"
"#,
        upstream.addr
    )
}

fn metric(text: &str, line_prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_new_limits_and_keeps_in_flight_requests() {
    let upstream = Upstream::start().await;
    let path = temp_config("reload", &config_text(&upstream, 100));
    let process = Process::start(&path);
    let addr = process.address("listening").await;
    let admin = process.address("admin listening").await;
    let client = h1_client();

    // A slow request is in flight across the reload.
    let slow = tokio::spawn({
        let client = client.clone();
        let url = format!("http://{addr}/slow/1500");
        async move { get(&client, &url).await }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.count() == 0 {
        assert!(Instant::now() < deadline, "slow request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Reload with a limit of 2 (the slow request already used one of the new budget's
    // bucket count: the bucket is the same, its count is 1).
    std::fs::write(&path, config_text(&upstream, 2)).expect("rewrite");
    process.signal("HUP");
    process
        .wait_for("reload applied", |v| {
            (v["message"] == "reload: configuration applied").then_some(())
        })
        .await;
    let statuses = [
        get(&client, &format!("http://{addr}/x")).await.status,
        get(&client, &format!("http://{addr}/x")).await.status,
    ];
    assert_eq!(statuses, [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    let answer = get(&client, &format!("http://{addr}/x")).await;
    assert_eq!(
        answer.header("ratelimit-policy"),
        Some("\"api:ip\";q=2;w=31622400")
    );
    let finished = slow.await.expect("task");
    assert_eq!(
        finished.status,
        StatusCode::OK,
        "in-flight request broken by reload"
    );
    assert_eq!(finished.text(), "slow ok");

    // An invalid file changes nothing.
    std::fs::write(&path, "[server]\nlisten = [\"127.0.0.1:0\"]\nbogus = 1\n").expect("rewrite");
    process.signal("HUP");
    process
        .wait_for("reload rejected", |v| {
            v["message"]
                .as_str()
                .filter(|m| m.contains("configuration rejected"))
                .map(|_| ())
        })
        .await;
    let answer = get(&client, &format!("http://{addr}/x")).await;
    assert_eq!(
        answer.status,
        StatusCode::TOO_MANY_REQUESTS,
        "old rules still serve"
    );
    assert!(process
        .lines()
        .iter()
        .any(|l| l.contains("bogus") && l.contains("unknown")));

    let metrics = get(&client, &format!("http://{admin}/metrics"))
        .await
        .text();
    assert_eq!(
        metric(
            &metrics,
            "tollgate_config_reloads_total{result=\"success\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "tollgate_config_reloads_total{result=\"failure\"}"
        ),
        1.0
    );
    let (code, _) = process.stop().await;
    assert_eq!(code, Some(0));
}

/// Two requests to `/private/path` carrying credentials in the query, `Authorization` and a
/// cookie (with a limit of 1, the second is limited): none of them may reach a log line.
async fn send_two_with_credentials(addr: &str) {
    let client = h1_client();
    for _ in 0..2 {
        let request = Request::get(format!("http://{addr}/private/path?token=QUERYSECRET"))
            .header("authorization", "Bearer AUTHSECRET")
            .header("cookie", "session=COOKIESECRET")
            .body(Full::new(Bytes::new()))
            .expect("request");
        send(&client, request).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_parse_and_carry_no_credentials() {
    let upstream = Upstream::start().await;
    let path = temp_config("logs", &config_text(&upstream, 1));
    let process = Process::start(&path);
    let addr = process.address("listening").await;
    send_two_with_credentials(&addr).await;
    let (code, lines) = process.stop().await;
    assert_eq!(code, Some(0));
    let mut access = Vec::new();
    for line in &lines {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        for secret in ["AUTHSECRET", "COOKIESECRET", "QUERYSECRET", "127.0.0.1:"] {
            if secret == "127.0.0.1:" {
                continue;
            }
            assert!(!line.contains(secret), "{secret} leaked: {line}");
        }
        if value["target"] == "tollgate::access" {
            access.push(value);
        }
    }
    assert_eq!(access.len(), 2, "one access line per request");
    // Two workers' lines are in time order only within a block (docs/operations.md, "Logs").
    access.sort_by_key(|value| value["timestamp"].as_str().map(str::to_owned));
    assert_eq!(access[0]["path"], "/private/path");
    assert_eq!(access[0]["route"], "api");
    assert_eq!(access[0]["decision"], "allowed");
    assert_eq!(access[0]["status"], 200);
    assert_eq!(access[1]["decision"], "limited");
    assert_eq!(access[1]["policy"], "api:ip");
    assert_eq!(access[1]["status"], 429);
    assert!(access[0]["duration_ms"].as_f64().is_some());
    // Milliseconds to the microsecond, not an f64's 17 digits (`58.901799999999994`).
    for line in lines.iter().filter(|l| l.contains("\"duration_ms\":")) {
        let value = line
            .split("\"duration_ms\":")
            .nth(1)
            .and_then(|rest| rest.split([',', '}']).next())
            .expect("a duration_ms value");
        let decimals = value.split_once('.').map_or(0, |(_, d)| d.len());
        assert!(decimals <= 3, "duration_ms={value}: {line}");
    }
}

/// The default text log: one access-log line per request in tracing's usual layout (written by
/// the connection worker, `log_format::LineWriter`), and no credential in any line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_access_lines_have_the_documented_layout() {
    let upstream = Upstream::start().await;
    let path = temp_config("text-logs", &config_text(&upstream, 1));
    let process = Process::start_text(&path);
    let addr = process.text_address().await;
    send_two_with_credentials(&addr).await;
    let (code, lines) = process.stop().await;
    assert_eq!(code, Some(0));
    for line in &lines {
        for secret in ["AUTHSECRET", "COOKIESECRET", "QUERYSECRET"] {
            assert!(!line.contains(secret), "{secret} leaked: {line}");
        }
    }
    let mut access: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains(" tollgate::access: "))
        .collect();
    // In time order (the line starts with its timestamp): two workers' lines are in order
    // only within a block (docs/operations.md, "Logs").
    access.sort();
    assert_eq!(access.len(), 2, "one access line per request: {lines:#?}");
    let expected = [
        r#"method=GET path="/private/path" route="api" decision="allowed" policy= status=200 duration_ms="#,
        r#"method=GET path="/private/path" route="api" decision="limited" policy=api:ip status=429 duration_ms="#,
    ];
    for (line, expected) in access.iter().zip(expected) {
        // `2026-12-04T15:35:05.201634Z  INFO tollgate::access: method=...`
        let (time, rest) = line.split_once("  INFO tollgate::access: ").expect(line);
        assert_eq!(time.len(), 27, "{line}");
        assert!(time.ends_with('Z') && time.as_bytes()[10] == b'T', "{line}");
        let rest = rest.strip_prefix(expected).expect(line);
        // A duration to the microsecond at most, then the upstream and the request id.
        let (duration, rest) = rest.split_once(' ').expect(line);
        let decimals = duration.split_once('.').map_or(0, |(_, d)| d.len());
        assert!(duration.parse::<f64>().is_ok() && decimals <= 3, "{line}");
        let id = rest
            .strip_prefix(if expected.contains("allowed") {
                r#"upstream="app" request_id=""#
            } else {
                r#"upstream="" request_id=""#
            })
            .and_then(|id| id.strip_suffix('"'))
            .expect(line);
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{line}"
        );
    }
}

#[tokio::test]
async fn admin_endpoints_answer_and_metrics_move() {
    let upstream = Upstream::start().await;
    let text = config_text(&upstream, 1).replace(
        "[[routes]]\nname = \"api\"",
        "[[routes]]\nname = \"shadowed\"\npath_prefix = \"/shadow\"\nshadow = true\nupstream = \"app\"\n\n  [[routes.limits]]\n  key = \"ip\"\n  requests = 1\n  window = \"366d\"\n\n[[routes]]\nname = \"api\"",
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin");
    let client = h1_client();
    let health = get(&client, &format!("http://{admin}/healthz")).await;
    assert_eq!(health.status, StatusCode::OK);
    let ready = get(&client, &format!("http://{admin}/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK, "memory store is always ready");
    assert_eq!(
        get(&client, &format!("http://{admin}/nope")).await.status,
        StatusCode::NOT_FOUND
    );

    get(&client, &proxy.url("/a")).await;
    get(&client, &proxy.url("/a")).await;
    get(&client, &proxy.url("/shadow")).await;
    get(&client, &proxy.url("/shadow")).await;
    let metrics = get(&client, &format!("http://{admin}/metrics"))
        .await
        .text();
    let decisions = |route: &str, decision: &str| {
        metric(
            &metrics,
            &format!("tollgate_decisions_total{{route=\"{route}\",decision=\"{decision}\"}}"),
        )
    };
    assert_eq!(decisions("api", "allowed"), 1.0);
    assert_eq!(decisions("api", "limited"), 1.0);
    assert_eq!(decisions("shadowed", "allowed"), 1.0);
    assert_eq!(decisions("shadowed", "shadow_limited"), 1.0);
    assert_eq!(
        metric(
            &metrics,
            "tollgate_responses_total{route=\"api\",code=\"429\"}"
        ),
        1.0
    );
    assert!(
        metrics.contains("tollgate_upstream_seconds_bucket"),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_store_seconds_bucket"));
    // The memory store sends no statements.
    assert_eq!(metric(&metrics, "tollgate_store_round_trips_total"), 0.0);
    assert_eq!(metric(&metrics, "tollgate_store_errors_total"), 0.0);
    // Every sample line is `name{labels} value`; no line carries a client address.
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            line.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some(),
            "{line}"
        );
        assert!(!line.contains("127.0.0.1"), "{line}");
    }
}

#[test]
fn explain_names_route_limits_and_decision() {
    let path = temp_config(
        "explain",
        "[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nname = \"login\"\n\
         path_prefix = \"/login\"\nmethods = [\"POST\"]\nupstream = \"app\"\n\n\
         [[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"\n\n\
         [[routes.limits]]\nkey = \"header:authorization\"\nrequests = 2\nwindow = \"1m\"\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["explain", "--config"])
        .arg(&path)
        .args(["--ip", "192.0.2.7", "POST", "http://api.test/login/x"])
        .output()
        .expect("run explain");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("route       login -> upstream app"),
        "{stdout}"
    );
    assert!(
        stdout.contains("login:ip (") || stdout.contains("login:ip: 5 per 3600s"),
        "{stdout}"
    );
    assert!(
        stdout.contains("login:authorization: does not apply"),
        "{stdout}"
    );
    assert!(stdout.contains("decision    allowed"), "{stdout}");
    // Buckets are shown as digests, never with the address in them.
    assert!(stdout.contains("bucket login:ip:"), "{stdout}");
    assert!(!stdout.contains("login:ip:192.0.2.7"), "{stdout}");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["explain", "--config"])
        .arg(&path)
        .args(["GET", "http://api.test/elsewhere"])
        .output()
        .expect("run explain");
    assert!(String::from_utf8_lossy(&out.stdout).contains("route       none"));
}

/// `explain` plans with the proxy's own function: what the proxy refuses before counting,
/// `explain` reports as refused, with the proxy's status.
#[test]
fn explain_reports_what_the_proxy_refuses() {
    let path = temp_config(
        "explain-refused",
        "[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nname = \"api\"\n\
         upstream = \"app\"\n\n[[routes.limits]]\nkey = \"header:x-api-key\"\nrequests = 5\n\
         window = \"1h\"\n",
    );
    let explain = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "--config"])
            .arg(&path)
            .args(args)
            .output()
            .expect("run explain");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, stdout) = explain(&["TRACE", "http://api.test/x"]);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("refused     405 (method not allowed)"),
        "{stdout}"
    );
    let (code, stdout) = explain(&[
        "--header",
        "X-Api-Key: a",
        "--header",
        "X-Api-Key: b",
        "GET",
        "http://api.test/x",
    ]);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("refused     400 (bad request: "),
        "{stdout}"
    );
    let (code, stdout) = explain(&["GET", "/x"]);
    assert_eq!(code, Some(2), "no host is a usage error: {stdout}");
}

/// `run --http1`: `fast` (the default) and `hyper` both serve and limit; the start line says
/// which HTTP/1.1 code carries requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_http1_chooses_the_stack_and_the_start_line_says_which() {
    for (args, expected) in [
        (&[][..], "fast"),
        (&["--http1", "fast"][..], "fast"),
        (&["--http1", "hyper"][..], "hyper"),
    ] {
        let upstream = Upstream::start().await;
        let config = temp_config("http1-stack", &config_text(&upstream, 2));
        let process = Process::start_with(&config, args);
        let addr: std::net::SocketAddr =
            process.address("listening").await.parse().expect("address");
        let stack = process
            .wait_for("the start line", |v| {
                (v["message"] == "tollgate started")
                    .then(|| v["http1"].as_str().map(str::to_owned))?
            })
            .await;
        assert_eq!(stack, expected, "{args:?}");
        let mut answers = Vec::new();
        for _ in 0..3 {
            let answer = raw_exchange(
                addr,
                b"GET /x HTTP/1.1\r\nHost: a.example.test\r\nConnection: close\r\n\r\n",
                Duration::from_secs(5),
            )
            .await;
            answers.push(answer.lines().next().unwrap_or("").to_owned());
        }
        assert_eq!(
            answers,
            [
                "HTTP/1.1 200 OK",
                "HTTP/1.1 200 OK",
                "HTTP/1.1 429 Too Many Requests"
            ],
            "{args:?}"
        );
        assert_eq!(upstream.count(), 2, "{args:?}");
        let (code, lines) = process.stop().await;
        assert_eq!(code, Some(0), "{}", lines.join("\n"));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--http1", "nginx"])
        .output()
        .expect("run tollgate");
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown stack is a usage error"
    );
}

/// `server.workers`: that many connection workers (named threads) serve, one memory store
/// counts for all of them, and SIGTERM still ends the process cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_serve_together_and_share_one_limit() {
    let upstream = Upstream::start().await;
    let text = config_text(&upstream, 25).replace(
        "shutdown_timeout = \"5s\"",
        "shutdown_timeout = \"5s\"\nworkers = 3",
    );
    let process = Process::start(&temp_config("workers", &text));
    let addr: std::net::SocketAddr = process.address("listening").await.parse().expect("address");
    let workers = process
        .wait_for("the start line", |v| {
            (v["message"] == "tollgate started").then(|| v["workers"].as_u64())?
        })
        .await;
    assert_eq!(workers, 3);
    // Thread names are cut to 15 bytes by the kernel: "tollgate-worker". A new thread sets
    // its own name once it runs, which can be after the start line: poll for a short while
    // instead of reading once.
    let count_worker_threads = || {
        std::fs::read_dir(format!("/proc/{}/task", process.child.id()))
            .expect("tasks")
            .filter_map(Result::ok)
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .filter(|name| name.trim_end() == "tollgate-worker")
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut worker_threads = count_worker_threads();
    while worker_threads < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        worker_threads = count_worker_threads();
    }
    // Worker 0 is the main thread; workers 1 and 2 have threads of their own.
    assert_eq!(worker_threads, 2);

    // 60 requests, each on its own connection, all at once: whichever worker accepts a
    // connection, exactly the limit's 25 are allowed.
    let requests = (0..60).map(|_| {
        tokio::spawn(raw_exchange(
            addr,
            b"GET /x HTTP/1.1\r\nHost: a.example.test\r\nConnection: close\r\n\r\n",
            Duration::from_secs(5),
        ))
    });
    let mut allowed = 0;
    let mut limited = 0;
    for answer in futures_util::future::join_all(requests).await {
        let answer = answer.expect("task");
        if answer.starts_with("HTTP/1.1 200") {
            allowed += 1;
        } else if answer.starts_with("HTTP/1.1 429") {
            limited += 1;
        } else {
            panic!("unexpected answer: {answer}");
        }
    }
    assert_eq!((allowed, limited), (25, 35));
    assert_eq!(upstream.count(), 25);

    let (code, lines) = process.stop().await;
    assert_eq!(code, Some(0), "{}", lines.join("\n"));
}

/// The access lines in `lines` (JSON), checked whole.
fn access_lines(lines: &[String]) -> Vec<serde_json::Value> {
    lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .filter(|value: &serde_json::Value| value["target"] == "tollgate::access")
        .collect()
}

/// Access lines wait in their worker's block (docs/operations.md, "Logs"): a line reaches the
/// log by the block's timer while the server runs, and on SIGTERM every worker's block is
/// written before the process exits, so each of `SENT` requests has its line, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_access_line_is_written_by_the_timer_or_at_sigterm() {
    const SENT: usize = 3000;
    let upstream = Upstream::start().await;
    let text = config_text(&upstream, 1_000_000).replace(
        "shutdown_timeout = \"5s\"",
        "shutdown_timeout = \"5s\"\nworkers = 2",
    );
    let process = Process::start(&temp_config("access-blocks", &text));
    let addr = process.address("listening").await;
    let client = h1_client();
    let first = get(&client, &format!("http://{addr}/first")).await;
    assert_eq!(first.status, StatusCode::OK);
    process
        .wait_for("the first request's access line", |v| {
            (v["target"] == "tollgate::access" && v["path"] == "/first").then_some(())
        })
        .await;
    // The rest on 16 connections at once, both workers' blocks filling and handed over.
    let senders = (0..16).map(|sender| {
        let client = client.clone();
        let addr = addr.clone();
        tokio::spawn(async move {
            for i in (1 + sender..SENT).step_by(16) {
                let answer = get(&client, &format!("http://{addr}/r/{i}")).await;
                assert_eq!(answer.status, StatusCode::OK);
            }
        })
    });
    for sender in futures_util::future::join_all(senders).await {
        sender.expect("sender");
    }
    let (code, lines) = process.stop().await;
    assert_eq!(code, Some(0));
    let access = access_lines(&lines);
    let mut paths: Vec<&str> = access.iter().filter_map(|v| v["path"].as_str()).collect();
    assert_eq!(paths.len(), SENT, "one access line per request");
    paths.sort_unstable();
    paths.dedup();
    assert_eq!(paths.len(), SENT, "each request once");
}

/// `RUST_LOG` still decides whether access lines are written: asked once at start about
/// target `tollgate::access` at INFO, which this filter turns off while other lines stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_turns_the_access_log_off() {
    let upstream = Upstream::start().await;
    let path = temp_config("access-off", &config_text(&upstream, 100));
    let process = Process::spawn_at(&path, "json", "info,tollgate::access=warn", &[]);
    let addr = process.address("listening").await;
    send_two_with_credentials(&addr).await;
    let (code, lines) = process.stop().await;
    assert_eq!(code, Some(0));
    assert!(access_lines(&lines).is_empty(), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("tollgate stopped")),
        "{lines:#?}"
    );
}
