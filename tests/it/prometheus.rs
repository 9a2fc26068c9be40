//! `/metrics` against a real Prometheus toolchain (contract §7, issue 17): the Prometheus text
//! format 0.0.4 by default, which `promtool check metrics` accepts without a word, and
//! OpenMetrics when `Accept` asks for it (promtool's OpenMetrics parser reads it); per-limit
//! decisions in `tollgate_policy_decisions_total`; the series the shipped alerts need
//! (readiness, last sweep, reload result); and the alert rules in deploy/prometheus/, checked
//! and unit-tested by `promtool`.
//!
//! promtool is Debian's `prometheus` package (.ci/run installs it). Without it these tests
//! fail: they never skip.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use std::io::Write as _;

use crate::common::db::TestDb;
use crate::common::faulty::FaultyTcp;
use crate::common::*;

/// The `Accept` header Prometheus 2.x sends on every scrape.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

fn promtool() -> String {
    crate::common::db::find_tool("promtool").unwrap_or_else(|_| {
        panic!(
            "promtool is missing: these tests need Debian's prometheus package \
             (apt-get install -y prometheus; .ci/run installs it)"
        )
    })
}

/// promtool's exit status, stdout and stderr, with `stdin` fed to it.
pub(crate) fn run_promtool(args: &[&str], stdin: &str) -> (bool, String, String) {
    let mut child = Command::new(promtool())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run promtool: {e}"));
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(stdin.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool finishes");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub(crate) async fn scrape(admin: SocketAddr, accept: Option<&str>) -> Answer {
    let mut req = Request::get(format!("http://{admin}/metrics"));
    if let Some(accept) = accept {
        req = req.header("accept", accept);
    }
    send(
        &h1_client(),
        req.body(Full::new(Bytes::new())).expect("request"),
    )
    .await
}

/// The value of the sample line `series` (name and labels exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

pub(crate) fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("tollgate-prometheus-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Route `api` (`/api`): 2 per hour per client address, 3 per hour per `X-Tenant` (scope
/// `tenants`), and a shadow `global` limit of 1; route `quiet` (`/quiet`) without limits.
const ROUTES: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"

  [[routes.limits]]
  key = "header:x-tenant"
  scope = "tenants"
  requests = 3
  window = "1h"

  [[routes.limits]]
  key = "global"
  requests = 1
  window = "1h"
  shadow = true

[[routes]]
name = "quiet"
path_prefix = "/quiet"
upstream = "app"
"#;

fn config_text(store: &str) -> String {
    format!(
        "{BASE}\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[store]\n{store}\n\n[keys]\nsecret = \"test-secret\"\n{ROUTES}"
    )
}

fn tenant_request(proxy: &Proxy, tenant: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::get(proxy.url("/api"));
    if let Some(tenant) = tenant {
        req = req.header("x-tenant", tenant);
    }
    req.body(Full::new(Bytes::new())).expect("request")
}

/// Every family the traffic of [`drive`] gives a sample to (with the memory store).
const DRIVEN: &[&str] = &[
    "tollgate_decisions_total",
    "tollgate_policy_decisions_total",
    "tollgate_responses_total",
    "tollgate_upstream_seconds",
    "tollgate_store_seconds",
    "tollgate_store_errors_total",
    "tollgate_store_round_trips_total",
    "tollgate_sweep_deleted_rows_total",
    "tollgate_sweep_last_success_timestamp_seconds",
    "tollgate_config_reloads_total",
    "tollgate_config_last_reload_successful",
    "tollgate_open_connections",
    "tollgate_memory_evictions_total",
    "tollgate_memory_buckets",
    "tollgate_ready",
    "tollgate_log_lines_dropped_total",
];

/// Allowed, shadow-limited, limited (by the store, then from the cache of exhausted
/// buckets), a route without limits, a request no route takes, and an upstream failure.
async fn drive(proxy: &Proxy) {
    let client = h1_client();
    let statuses = [
        send(&client, tenant_request(proxy, Some("t-secret")))
            .await
            .status,
        send(&client, tenant_request(proxy, Some("t-secret")))
            .await
            .status,
        send(&client, tenant_request(proxy, Some("t-secret")))
            .await
            .status,
        send(&client, tenant_request(proxy, None)).await.status,
    ];
    use StatusCode as S;
    let expected = [S::OK, S::OK, S::TOO_MANY_REQUESTS, S::TOO_MANY_REQUESTS];
    assert_eq!(statuses, expected);
    assert_eq!(get(&client, &proxy.url("/quiet")).await.status, S::OK);
}

/// The OpenMetrics rules a text parser may let pass: one `# EOF` at the very end; a family
/// is HELP then TYPE; a counter's family name has no `_total` and its samples do; every
/// sample belongs to the family above it.
fn assert_openmetrics_shape(text: &str) {
    assert!(text.ends_with("# EOF\n"), "no final # EOF:\n{text}");
    assert_eq!(text.matches("# EOF").count(), 1);
    let mut family: Option<(String, String)> = None;
    let mut help_for: Option<String> = None;
    for line in text.lines().filter(|l| *l != "# EOF") {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help_for = rest.split(' ').next().map(str::to_string);
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
            assert_eq!(help_for.as_deref(), Some(name), "HELP before TYPE: {line}");
            if kind == "counter" {
                assert!(
                    !name.ends_with("_total"),
                    "counter family named with _total: {line}"
                );
            }
            family = Some((name.to_string(), kind.to_string()));
        } else {
            assert!(!line.starts_with('#'), "unexpected comment {line}");
            let (name, kind) = family.as_ref().expect("a sample before any TYPE");
            let sample = line.split(['{', ' ']).next().unwrap_or("");
            let suffixes: &[&str] = match kind.as_str() {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count", "_created"],
                _ => &[""],
            };
            assert!(
                suffixes.iter().any(|s| sample == format!("{name}{s}")),
                "sample {sample} is not of {kind} family {name}"
            );
        }
    }
}

#[tokio::test]
async fn promtool_accepts_both_formats_after_real_traffic() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&config_text(""), upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    drive(&proxy).await;
    // The first sweep runs at start; wait for it rather than for a fixed time.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(admin, None).await.text();
        if sample(&text, "tollgate_sweep_last_success_timestamp_seconds").is_some_and(|v| v > 0.0) {
            break;
        }
        assert!(Instant::now() < deadline, "no sweep recorded:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Default: the Prometheus text format 0.0.4.
    let plain = scrape(admin, None).await;
    assert_eq!(plain.status, StatusCode::OK);
    assert_eq!(
        plain.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert_eq!(plain.header("vary"), Some("accept"));
    let text = plain.text();
    for family in DRIVEN {
        assert!(
            text.contains(&format!("# HELP {family} "))
                && text.contains(&format!("# TYPE {family} ")),
            "{family} has no HELP/TYPE:\n{text}"
        );
        assert!(
            text.lines()
                .any(|l| !l.starts_with('#') && l.starts_with(family)),
            "{family} has no sample:\n{text}"
        );
    }
    assert!(text.contains("tollgate_upstream_seconds_bucket{le=\"+Inf\",route=\"api\"} 2"));
    assert!(!text.contains("# EOF"), "0.0.4 has no EOF marker");
    let (ok, stdout, stderr) = run_promtool(&["check", "metrics"], &text);
    assert!(
        ok && stdout.is_empty() && stderr.is_empty(),
        "promtool check metrics complained:\n{stdout}{stderr}\non:\n{text}"
    );
    // So does an explicit request for it, and an Accept that names nothing tollgate speaks.
    for accept in [
        "text/plain;version=0.0.4",
        "application/json",
        "application/openmetrics-text;version=2.0.0",
    ] {
        assert_eq!(
            scrape(admin, Some(accept)).await.header("content-type"),
            Some("text/plain; version=0.0.4; charset=utf-8"),
            "Accept: {accept}"
        );
    }

    // What Prometheus asks for: OpenMetrics.
    let om = scrape(admin, Some(PROMETHEUS_ACCEPT)).await;
    assert_eq!(
        om.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let om_text = om.text();
    assert_openmetrics_shape(&om_text);
    assert!(om_text.contains("# TYPE tollgate_policy_decisions counter\n"));
    // The 0.0.4 page names the same samples.
    for line in om_text.lines().filter(|l| !l.starts_with('#')) {
        let series = line.rsplit_once(' ').map_or(line, |(s, _)| s);
        assert!(text.contains(series), "{series} only in OpenMetrics");
    }
    // promtool's OpenMetrics parser (the backfill reader, which wants a timestamp on each
    // sample) reads every line.
    let stamped: String = om_text
        .lines()
        .map(|l| {
            if l.starts_with('#') {
                format!("{l}\n")
            } else {
                format!("{l} 1700000000\n")
            }
        })
        .collect();
    let dir = temp_dir("openmetrics");
    let file = dir.join("scrape.om");
    std::fs::write(&file, stamped).expect("write scrape");
    let blocks = dir.join("blocks");
    let args = ["tsdb", "create-blocks-from", "openmetrics"];
    let (ok, stdout, stderr) = run_promtool(
        &[
            args[0],
            args[1],
            args[2],
            file.to_str().expect("path"),
            blocks.to_str().expect("path"),
        ],
        "",
    );
    assert!(
        ok,
        "promtool rejected the OpenMetrics page:\n{stdout}{stderr}\n{om_text}"
    );
    // A lower q for OpenMetrics than for the text format gets the text format.
    let low = scrape(
        admin,
        Some("application/openmetrics-text;q=0.2,text/plain;q=0.5"),
    )
    .await;
    assert_eq!(
        low.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn policy_decisions_say_which_limit_denied() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&config_text(""), upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    drive(&proxy).await;
    let text = scrape(admin, None).await.text();
    let policy = |policy: &str, decision: &str| {
        sample(
            &text,
            &format!("tollgate_policy_decisions_total{{route=\"api\",policy=\"{policy}\",decision=\"{decision}\"}}"),
        )
    };
    // The third request went over the `ip` limit only; the fourth (no X-Tenant) was denied
    // from the cache of exhausted buckets, by `ip` again.
    assert_eq!(policy("api:ip", "allowed"), Some(2.0));
    assert_eq!(policy("api:ip", "limited"), Some(2.0));
    assert_eq!(policy("tenants:x-tenant", "allowed"), Some(3.0), "{text}");
    assert_eq!(policy("tenants:x-tenant", "limited"), None);
    // The shadow limit of 1 would have denied the second and third.
    assert_eq!(policy("api:global", "allowed"), Some(1.0));
    assert_eq!(policy("api:global", "shadow_limited"), Some(2.0));
    let route = |decision: &str| {
        sample(
            &text,
            &format!("tollgate_decisions_total{{route=\"api\",decision=\"{decision}\"}}"),
        )
    };
    assert_eq!(route("allowed"), Some(1.0));
    assert_eq!(route("shadow_limited"), Some(1.0));
    assert_eq!(route("limited"), Some(2.0));
    // No policy series for a route without limits; nothing a client sent in a label.
    assert!(!text.contains("route=\"quiet\",policy"));
    for leak in ["t-secret", "127.0.0.1"] {
        assert!(!text.contains(leak), "{leak} in a label:\n{text}");
    }
}

/// A gRPC call tollgate answers itself goes out as HTTP 200 (with `grpc-status` 8): that is
/// the code counted, as for any other response, never a 429 nobody received.
#[tokio::test]
async fn grpc_answers_count_the_status_that_was_sent() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&config_text(""), upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let client = h2c_client();
    let mut grpc_status = Vec::new();
    for _ in 0..3 {
        let req = Request::post(proxy.url("/api"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let answer = send(&client, req).await;
        assert_eq!(answer.status, StatusCode::OK);
        grpc_status.push(answer.header("grpc-status").map(str::to_string));
    }
    assert_eq!(
        grpc_status[2].as_deref(),
        Some("8"),
        "the third call is over the limit"
    );
    let text = scrape(admin, None).await.text();
    assert_eq!(
        sample(
            &text,
            "tollgate_responses_total{route=\"api\",code=\"200\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_responses_total{route=\"api\",code=\"429\"}"
        ),
        None
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_decisions_total{route=\"api\",decision=\"limited\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_rejected_reload_shows_until_one_is_applied() {
    let upstream = Upstream::start().await;
    let good = config_text("").replace("@UPSTREAM@", &upstream.addr.to_string());
    let proxy = Proxy::start(config_from(&good, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let before = scrape(admin, None).await.text();
    assert_eq!(
        sample(&before, "tollgate_config_last_reload_successful"),
        Some(1.0)
    );
    // Both results exist from the start, so the first failure is an increase to alert on.
    assert_eq!(
        sample(&before, "tollgate_config_reloads_total{result=\"failure\"}"),
        Some(0.0)
    );

    let dir = temp_dir("reload");
    let path = dir.join("proxy.toml");
    std::fs::write(&path, format!("{good}\nbogus = 1\n")).expect("write");
    assert!(!proxy.server().reload_from(&path, |_| None).await);
    let rejected = scrape(admin, None).await.text();
    assert_eq!(
        sample(&rejected, "tollgate_config_last_reload_successful"),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &rejected,
            "tollgate_config_reloads_total{result=\"failure\"}"
        ),
        Some(1.0)
    );

    std::fs::write(&path, &good).expect("write");
    assert!(proxy.server().reload_from(&path, |_| None).await);
    let applied = scrape(admin, None).await.text();
    assert_eq!(
        sample(&applied, "tollgate_config_last_reload_successful"),
        Some(1.0)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reload whose file says what already serves is counted as `unchanged` and logged as such
/// (a comment changes nothing); one that changes a limit is a `success`; after a rejected
/// reload, the serving file again is `unchanged` and clears the failure gauge.
#[tokio::test]
async fn a_reload_that_changes_nothing_is_counted_as_unchanged() {
    let captured = crate::common::log::CapturedLog::new();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let upstream = Upstream::start().await;
    let good = config_text("").replace("@UPSTREAM@", &upstream.addr.to_string());
    let proxy = Proxy::start(config_from(&good, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let before = scrape(admin, None).await.text();
    let reloads = |text: &str| {
        ["success", "unchanged", "failure"].map(|result| {
            let series = format!("tollgate_config_reloads_total{{result=\"{result}\"}}");
            sample(text, &series).unwrap_or_else(|| panic!("no {series}: {text}"))
        })
    };
    assert_eq!(reloads(&before), [0.0, 0.0, 0.0]);
    let dir = temp_dir("unchanged");
    let path = dir.join("proxy.toml");
    let reload = |text: String| {
        std::fs::write(&path, text).expect("write");
        proxy.server().reload_from(&path, |_| None)
    };
    assert!(reload(good.clone()).await);
    assert!(reload(format!("# edited by hand\n{good}")).await);
    let text = scrape(admin, None).await.text();
    assert_eq!(reloads(&text), [0.0, 2.0, 0.0]);
    let unchanged = captured
        .lines()
        .into_iter()
        .filter(|l| l.contains("reload: configuration unchanged"))
        .count();
    assert_eq!(unchanged, 2, "{}", captured.text());
    assert!(!captured.text().contains("configuration applied"));

    let raised = good.replace("requests = 2\n", "requests = 20\n");
    assert_ne!(raised, good);
    assert!(reload(raised.clone()).await);
    assert!(!reload(format!("{raised}\nbogus = 1\n")).await);
    let text = scrape(admin, None).await.text();
    assert_eq!(reloads(&text), [1.0, 2.0, 1.0]);
    assert_eq!(
        sample(&text, "tollgate_config_last_reload_successful"),
        Some(0.0)
    );
    assert!(reload(raised).await);
    let text = scrape(admin, None).await.text();
    assert_eq!(reloads(&text), [1.0, 3.0, 1.0]);
    assert_eq!(
        sample(&text, "tollgate_config_last_reload_successful"),
        Some(1.0)
    );
    assert!(captured.text().contains("reload: configuration applied"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Polls `/metrics` until `series` has `value`, for at most 10 s; the last page.
async fn until_sample(admin: SocketAddr, series: &str, value: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(admin, None).await.text();
        if sample(&text, series) == Some(value) || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With the database gone: every limit that applied counts the route's failure decision,
/// store errors count, `tollgate_ready` is 0 (what `/readyz` says); all back once it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_store_shows_in_policy_decisions_and_readiness() {
    let db = TestDb::new().await;
    let relay = FaultyTcp::start(db.server_addr(), true).await;
    let upstream = Upstream::start().await;
    let store = format!(
        "url = \"{}\"\ntimeout = \"500ms\"\non_error = \"allow\"\npool_size = 2",
        db.url_through(relay.addr)
    );
    let text = config_text(&store).replace(
        "[[routes]]\nname = \"quiet\"",
        "[[routes]]\nname = \"strict\"\npath_prefix = \"/strict\"\nupstream = \"app\"\non_store_error = \"deny\"\n\n  [[routes.limits]]\n  key = \"ip\"\n  requests = 100\n  window = \"1h\"\n\n[[routes]]\nname = \"quiet\"",
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let client = h1_client();
    assert_eq!(
        send(&client, tenant_request(&proxy, Some("t")))
            .await
            .status,
        StatusCode::OK
    );
    let healthy = until_sample(admin, "tollgate_ready", 1.0).await;
    assert_eq!(sample(&healthy, "tollgate_ready"), Some(1.0), "{healthy}");

    relay.down();
    for _ in 0..3 {
        assert_eq!(
            send(&client, tenant_request(&proxy, Some("t")))
                .await
                .status,
            StatusCode::OK
        );
        let strict = get(&client, &proxy.url("/strict")).await;
        assert_eq!(strict.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let failing = until_sample(admin, "tollgate_ready", 0.0).await;
    assert_eq!(sample(&failing, "tollgate_ready"), Some(0.0), "{failing}");
    let policy = |route: &str, policy: &str, decision: &str| {
        sample(
            &failing,
            &format!("tollgate_policy_decisions_total{{route=\"{route}\",policy=\"{policy}\",decision=\"{decision}\"}}"),
        )
    };
    for name in ["api:ip", "tenants:x-tenant", "api:global"] {
        assert_eq!(
            policy("api", name, "failed_open"),
            Some(3.0),
            "{name}:\n{failing}"
        );
    }
    assert_eq!(policy("strict", "strict:ip", "failed_closed"), Some(3.0));
    assert!(sample(&failing, "tollgate_store_errors_total").is_some_and(|v| v > 0.0));

    relay.up();
    let back = until_sample(admin, "tollgate_ready", 1.0).await;
    assert_eq!(sample(&back, "tollgate_ready"), Some(1.0), "{back}");
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus")
}

#[test]
fn the_shipped_alert_rules_check_and_pass_their_unit_tests() {
    let dir = deploy_dir();
    let rules = dir.join("alerts.yml");
    let tests = dir.join("alerts_test.yml");
    let (ok, stdout, stderr) = run_promtool(&["check", "rules", rules.to_str().expect("path")], "");
    assert!(ok, "promtool check rules:\n{stdout}{stderr}");
    let (ok, stdout, stderr) = run_promtool(&["test", "rules", tests.to_str().expect("path")], "");
    assert!(ok, "promtool test rules:\n{stdout}{stderr}");

    // Every alert has a test in which it fires; each firing test also has a series that
    // must not fire (exp_alerts lists exactly what fires).
    let read = |p: &Path| -> serde_yaml::Value {
        serde_yaml::from_str(&std::fs::read_to_string(p).expect("read")).expect("YAML")
    };
    let rules = read(&rules);
    let tests = read(&tests);
    let alerts: Vec<&str> = rules["groups"]
        .as_sequence()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("rules"))
        .filter_map(|r| r["alert"].as_str())
        .collect();
    let required = [
        "TollgateStoreFailing",
        "TollgateFailingOpen",
        "TollgatePolicyDenyingMoreThanUsual",
        "TollgateReadinessFlapping",
        "TollgateSweepStuck",
        "TollgateConfigReloadFailed",
    ];
    for alert in required {
        assert!(alerts.contains(&alert), "{alert} is not shipped");
    }
    for alert in &alerts {
        let firing = tests["tests"]
            .as_sequence()
            .expect("tests")
            .iter()
            .filter(|t| {
                t["alert_rule_test"].as_sequence().is_some_and(|cases| {
                    cases.iter().any(|c| {
                        c["alertname"].as_str() == Some(alert)
                            && c["exp_alerts"].as_sequence().is_some_and(|e| !e.is_empty())
                    })
                })
            })
            .collect::<Vec<_>>();
        assert!(!firing.is_empty(), "no test in which {alert} fires");
        for test in firing {
            let series = test["input_series"].as_sequence().expect("input_series");
            let fired = test["alert_rule_test"]
                .as_sequence()
                .expect("cases")
                .iter()
                .filter(|c| c["alertname"].as_str() == Some(alert))
                .map(|c| c["exp_alerts"].as_sequence().map_or(0, Vec::len))
                .max()
                .unwrap_or(0);
            let healthy = series.iter().any(|s| {
                s["series"]
                    .as_str()
                    .is_some_and(|s| s.contains("instance=\"good\"") || s.contains("api:tenant"))
            });
            assert!(
                healthy && fired < series.len(),
                "{alert}: no healthy series that stays quiet"
            );
        }
    }
}
