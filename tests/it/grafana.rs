//! The Grafana dashboard `deploy/grafana/tollgate.json` (issue 51), tested offline: no Grafana
//! can be installed on the build machine, so nothing here renders it. What can go wrong with a
//! shipped dashboard without rendering it is checked against the real tools instead:
//!
//! - the JSON model loads, with the `datasource` variable every panel queries through, unique
//!   panel ids and reference ids, and panels that do not overlap;
//! - every PromQL expression (panel targets and the selectors of the query variables), with
//!   Grafana's variables replaced as Grafana would, is written as a recording rule, and
//!   `promtool check rules` (the Prometheus parser) accepts the file;
//! - every metric and label name those expressions use is in a real scrape of `/metrics`,
//!   after a short run of tollgate on a real PostgreSQL, and every `decision` they select is
//!   one tollgate counts. No name is exempt. The database's series (`tollgate_instances`,
//!   `tollgate_reserved_units`, `tollgate_overrides`, `tollgate_store_round_trips_total`) are
//!   on the memory store's page too, as constants; on PostgreSQL the test also sees them
//!   move, as their panels need.
//!
//! promtool is Debian's `prometheus` package, found as in `prometheus.rs`: without it these
//! tests fail, they never skip.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use http::StatusCode;
use serde_json::Value;

use super::prometheus::{run_promtool, scrape, temp_dir};
use crate::common::db::TestDb;
use crate::common::wait::until;
use crate::common::*;

/// The decisions of `tollgate_decisions_total` and `tollgate_policy_decisions_total`
/// (src/decision.rs, docs/operations.md "Metrics"): what a `decision` matcher may name.
const DECISIONS: [&str; 8] = [
    "allowed",
    "shadow_limited",
    "limited",
    "failed_open",
    "failed_closed",
    "local_allowed",
    "local_limited",
    "counted_after",
];

/// The families the dashboard is for (issue 51); a panel that lost one fails here.
const REQUIRED: [&str; 10] = [
    "tollgate_decisions_total",
    "tollgate_policy_decisions_total",
    "tollgate_store_seconds_bucket",
    "tollgate_store_round_trips_total",
    "tollgate_reserved_units",
    "tollgate_overrides",
    "tollgate_instances",
    "tollgate_upstream_seconds_bucket",
    "tollgate_responses_total",
    "tollgate_config_reloads_total",
];

/// Labels Prometheus adds to every scraped series: never in `/metrics` itself.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

/// Grafana's built-in variables, as a query would get them over a one-hour view.
const BUILT_INS: [(&str, &str); 3] = [
    ("__rate_interval", "1m"),
    ("__interval", "15s"),
    ("__range", "1h"),
];

fn dashboard() -> Value {
    let path = repo("deploy/grafana/tollgate.json");
    let text = std::fs::read_to_string(&path).expect("read deploy/grafana/tollgate.json");
    serde_json::from_str(&text).expect("deploy/grafana/tollgate.json is JSON")
}

/// Every panel, the ones inside (collapsed) rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        if let Some(inner) = panel["panels"].as_array() {
            all.extend(inner);
        }
    }
    all
}

fn variables(dashboard: &Value) -> &Vec<Value> {
    dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list")
}

/// One PromQL expression of the dashboard: where it is, the expression as written, and the
/// labels it shows: its legend's `{{label}}`s, or the label a variable lists.
struct Expr {
    place: String,
    text: String,
    shown: Vec<String>,
    /// A variable's selector: what it shows is any label of the series, not one it groups by.
    variable: bool,
}

/// Every target's expression, and the series selector of every `label_values` variable.
fn expressions(dashboard: &Value) -> Vec<Expr> {
    let mut out = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(Expr {
                place: format!("panel {} ({})", panel["id"], panel["title"]),
                text: target["expr"].as_str().expect("target expr").to_string(),
                shown: legend_labels(target["legendFormat"].as_str().unwrap_or("")),
                variable: false,
            });
        }
    }
    for var in variables(dashboard).iter().filter(|v| v["type"] == "query") {
        let query = var["query"]["query"]
            .as_str()
            .or(var["query"].as_str())
            .expect("query variable's query");
        // What the variable editor shows is what runs.
        assert_eq!(
            var["definition"].as_str(),
            Some(query),
            "variable {}",
            var["name"]
        );
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: not label_values(...): {query}", var["name"]));
        let (selector, label) = inner
            .rsplit_once(',')
            .expect("label_values(selector, label)");
        out.push(Expr {
            place: format!("variable {}", var["name"]),
            text: selector.trim().to_string(),
            shown: vec![label.trim().to_string()],
            variable: true,
        });
    }
    out
}

/// `expr` as Grafana sends it: each dashboard variable (all of them multi-value regexes) as
/// `.*`, the built-ins as durations. A `$name` that is neither fails: Grafana would send it
/// as it is and Prometheus would reject the query.
fn substituted(expr: &str, defined: &BTreeSet<String>) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        let name = &after[..len];
        let value = BUILT_INS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .or_else(|| defined.contains(name).then_some(".*"))
            .unwrap_or_else(|| panic!("${name} is no variable of the dashboard, in {expr}"));
        out.push_str(value);
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// A PromQL token, as far as names go: strings, durations and numbers are dropped.
#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    /// A `{...}` selector's matchers: label name and value (the value unescaped enough to
    /// compare words).
    Matchers(Vec<(String, String)>),
    Open,
    Close,
    Other,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The string literal at the start of `chars` (its quote first): its value, and its length.
fn string_at(chars: &[char]) -> (String, usize) {
    let quote = chars[0];
    let mut value = String::new();
    let mut i = 1;
    while i < chars.len() && chars[i] != quote {
        if chars[i] == '\\' && quote != '`' {
            i += 1;
        }
        if let Some(&c) = chars.get(i) {
            value.push(c);
        }
        i += 1;
    }
    (value, i + 1)
}

fn tokens(expr: &str) -> Vec<Token> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            i += string_at(&chars[i..]).1;
            out.push(Token::Other);
        } else if c == '{' {
            let (matchers, len) = matchers_at(&chars[i..]);
            out.push(Token::Matchers(matchers));
            i += len;
        } else if c == '[' {
            // A range or subquery: durations only.
            i += chars[i..]
                .iter()
                .position(|&c| c == ']')
                .map_or(chars.len(), |p| p + 1);
        } else if is_ident_start(c) {
            let len = chars[i..].iter().take_while(|&&c| is_ident(c)).count();
            out.push(Token::Ident(chars[i..i + len].iter().collect()));
            i += len;
        } else if c.is_ascii_digit() || c == '.' {
            // A number or duration (`0.99`, `5m`, `1e3`).
            i += chars[i..]
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric() || **c == '.')
                .count();
        } else {
            out.push(match c {
                '(' => Token::Open,
                ')' => Token::Close,
                c if c.is_whitespace() => {
                    i += 1;
                    continue;
                }
                _ => Token::Other,
            });
            i += 1;
        }
    }
    out
}

/// The matchers of the `{...}` at the start of `chars`, and its length.
fn matchers_at(chars: &[char]) -> (Vec<(String, String)>, usize) {
    let mut matchers = Vec::new();
    let mut name = String::new();
    let mut i = 1;
    while i < chars.len() && chars[i] != '}' {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            let (value, len) = string_at(&chars[i..]);
            matchers.push((std::mem::take(&mut name), value));
            i += len;
        } else {
            if is_ident(c) {
                name.push(c);
            }
            i += 1;
        }
    }
    (matchers, i + 1)
}

/// Words that are PromQL's own (operators, modifiers, literals) where a metric name could be.
const KEYWORDS: [&str; 25] = [
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
];

/// The metric names and label names an expression uses (grouping labels included), and the
/// values its `decision` matchers name.
#[derive(Default)]
struct Names {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
    decisions: BTreeSet<String>,
}

fn names(expr: &str) -> Names {
    let tokens = tokens(expr);
    let mut names = Names::default();
    let grouping = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            // `by (a, b)` and the like: label names. Without a list (`group_left x`) the
            // word is a keyword, below.
            Token::Ident(word)
                if grouping.contains(&word.as_str()) && tokens.get(i + 1) == Some(&Token::Open) =>
            {
                i += 2;
                while let Some(Token::Ident(label)) = tokens.get(i) {
                    names.labels.insert(label.clone());
                    i += 1;
                    if tokens.get(i) == Some(&Token::Other) {
                        i += 1; // the comma
                    }
                }
            }
            Token::Ident(word) => {
                let call = tokens.get(i + 1) == Some(&Token::Open);
                let literal = ["inf", "nan"].contains(&word.to_ascii_lowercase().as_str());
                if !call && !literal && !KEYWORDS.contains(&word.as_str()) {
                    names.metrics.insert(word.clone());
                }
            }
            Token::Matchers(matchers) => {
                for (label, value) in matchers {
                    names.labels.insert(label.clone());
                    if label == "decision" {
                        names.decisions.extend(value.split('|').map(str::to_string));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    names
}

/// The `{{label}}` names of a legend format.
fn legend_labels(legend: &str) -> Vec<String> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|part| part.split_once("}}"))
        .map(|(label, _)| label.trim().to_string())
        .collect()
}

fn defined_variables(dashboard: &Value) -> BTreeSet<String> {
    variables(dashboard)
        .iter()
        .map(|v| v["name"].as_str().expect("variable name").to_string())
        .collect()
}

#[test]
fn the_dashboard_is_a_grafana_model_that_queries_through_its_datasource_variable() {
    let dashboard = dashboard();
    assert!(dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36));
    assert_eq!(dashboard["uid"], "tollgate");
    assert!(dashboard["id"].is_null(), "an id would clash on import");
    let datasource = variables(&dashboard)
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(datasource["type"], "datasource");
    assert_eq!(datasource["query"], "prometheus");
    let through_variable = |value: &Value| value["uid"] == "${datasource}";

    // Import names what the dashboard needs: every panel type in `__requires`.
    let required: BTreeSet<&str> = dashboard["__requires"]
        .as_array()
        .expect("__requires")
        .iter()
        .filter(|r| r["type"] == "panel")
        .filter_map(|r| r["id"].as_str())
        .collect();
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(i64, i64, i64, i64, String)> = Vec::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().expect("title").to_string();
        assert!(
            ids.insert(panel["id"].as_u64().expect("id")),
            "id twice: {title}"
        );
        let at = |k: &str| panel["gridPos"][k].as_i64().expect("gridPos");
        let (x, y, w, h) = (at("x"), at("y"), at("w"), at("h"));
        assert!(
            x >= 0 && w > 0 && h > 0 && x + w <= 24,
            "{title}: {x},{y} {w}x{h}"
        );
        for (ox, oy, ow, oh, other) in &boxes {
            let apart = x + w <= *ox || *ox + ow <= x || y + h <= *oy || *oy + oh <= y;
            assert!(apart, "{title} overlaps {other}");
        }
        boxes.push((x, y, w, h, title.clone()));
        if panel["type"] == "row" {
            assert!(panel["targets"].is_null(), "a row has no queries: {title}");
            continue;
        }
        let kind = panel["type"].as_str().expect("panel type");
        assert!(
            required.contains(kind),
            "{title}: {kind} is not in __requires"
        );
        assert!(
            through_variable(&panel["datasource"]),
            "{title}: datasource"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        let mut refs = BTreeSet::new();
        for target in targets {
            assert!(
                through_variable(&target["datasource"]),
                "{title}: target datasource"
            );
            assert!(target["expr"]
                .as_str()
                .is_some_and(|e| !e.trim().is_empty()));
            assert!(
                refs.insert(target["refId"].as_str().expect("refId")),
                "{title}: refId twice"
            );
        }
    }
    let queries = variables(&dashboard)
        .iter()
        .filter(|v| v["type"] == "query");
    for var in queries {
        assert!(
            through_variable(&var["datasource"]),
            "variable {}",
            var["name"]
        );
    }
    assert!(ids.len() >= 20, "only {} panels", ids.len());
}

#[test]
fn the_name_reader_finds_metrics_labels_and_decisions() {
    let n = names(
        r#"sum by (route, le) (rate(tollgate_a_bucket{decision=~"limited|allowed", x="}"}[5m])) / on (job) group_left tollgate_b or vector(0) > bool Inf"#,
    );
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(n.metrics, set(&["tollgate_a_bucket", "tollgate_b"]));
    assert_eq!(n.labels, set(&["route", "le", "decision", "x", "job"]));
    assert_eq!(n.decisions, set(&["limited", "allowed"]));
    let defined = set(&["job"]);
    assert_eq!(
        substituted(r#"rate(x{job=~"$job"}[$__rate_interval])"#, &defined),
        r#"rate(x{job=~".*"}[1m])"#
    );
    let unknown = std::panic::catch_unwind(|| substituted("x{a=~\"$nope\"}", &defined));
    assert!(unknown.is_err(), "an undefined variable must fail");
    assert_eq!(
        legend_labels("{{route}} p99 {{ policy }}"),
        ["route", "policy"]
    );
}

#[test]
fn every_expression_parses_in_promtool_as_a_recording_rule() {
    let dashboard = dashboard();
    let defined = defined_variables(&dashboard);
    let rules: Vec<Value> = expressions(&dashboard)
        .iter()
        .enumerate()
        .map(|(i, e)| {
            serde_json::json!({
                "record": format!("tollgate_dashboard:expr_{i}"),
                "expr": substituted(&e.text, &defined),
            })
        })
        .collect();
    let count = rules.len();
    let check = |rules: Vec<Value>, name: &str| {
        let file = serde_json::json!({"groups": [{"name": "tollgate-dashboard", "rules": rules}]});
        let dir = temp_dir(name);
        let path = dir.join("dashboard_rules.yml");
        let yaml = serde_yaml::to_string(&file).expect("rules as YAML");
        std::fs::write(&path, &yaml).expect("write rules");
        let args = ["check", "rules", path.to_str().expect("path")];
        let (ok, stdout, stderr) = run_promtool(&args, "");
        let _ = std::fs::remove_dir_all(&dir);
        (ok, format!("{stdout}{stderr}"), yaml)
    };
    let (ok, output, yaml) = check(rules, "grafana-rules");
    assert!(ok, "promtool check rules:\n{output}\non:\n{yaml}");
    assert!(
        output.contains(&format!("SUCCESS: {count} rules found")),
        "{output}"
    );

    // The check is real: one parenthesis missing and promtool refuses.
    let broken = vec![serde_json::json!({"record": "tollgate_dashboard:broken",
        "expr": "sum(rate(tollgate_decisions_total[1m])"})];
    let (ok, output, _) = check(broken, "grafana-broken");
    assert!(!ok, "promtool accepted a broken expression:\n{output}");
}

/// A route `api` (`/api`) with a limit of 2 per client address; a route `reserved`
/// (`/reserved`) whose limit takes reserved shares (so `tollgate_reserved_units` has units);
/// a route `failover` whose upstream's first origin refuses connections (so
/// `tollgate_upstream_connect_failures_total` has a series); the admin listener.
fn config_text(db: &TestDb, refused: &RefusedPort) -> String {
    let routes = format!(
        r#"
[upstreams.failover]
urls = ["http://{refused}", "http://@UPSTREAM@"]
connect_timeout = "1s"

[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"

[[routes]]
name = "reserved"
path_prefix = "/reserved"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = 1000
  window = "1h"
  reserve = true

[[routes]]
name = "failover"
path_prefix = "/failover"
upstream = "failover"
"#
    );
    limits_config(
        &pg_store(db),
        "\n[admin]\nlisten = \"127.0.0.1:0\"",
        &routes,
    )
}

/// One override row and its notification, as `tollgate override set` writes them (a
/// `global` bucket: no subject to hash).
async fn override_in_the_table(db: &TestDb) {
    db.client()
        .await
        .batch_execute(
            "INSERT INTO tollgate_overrides (scope, label, digest, requests, note) \
             VALUES ('reserved', 'global', '', 2000, 'dashboard test'); \
             SELECT pg_notify('tollgate_overrides', 'reserved:global')",
        )
        .await
        .expect("an override row");
}

/// Every sample's name in a 0.0.4 page, with its label names.
fn scraped(page: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let labels = out.entry(name.to_string()).or_default();
        if let Some(at) = line.find('{') {
            let chars: Vec<char> = line[at..].chars().collect();
            labels.extend(matchers_at(&chars).0.into_iter().map(|(label, _)| label));
        }
    }
    out
}

fn value(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in\n{page}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_name_the_dashboard_uses_is_in_a_real_scrape_on_postgres() {
    let db = TestDb::new().await;
    let upstream = Upstream::start().await;
    let refused = RefusedPort::new();
    let config = config_from(&config_text(&db, &refused), upstream.addr, &[]);
    let proxy = Proxy::start(config).await;
    proxy.until_store_ready(Duration::from_secs(30)).await;
    // The listener's start gives back any share taken before it.
    proxy.until_hearing_resets(Duration::from_secs(30)).await;
    // One override in force (contract §3e): `tollgate_overrides` shows it.
    override_in_the_table(&db).await;
    let metrics = proxy.server().metrics();
    until(
        "tollgate_overrides never showed the override",
        Duration::from_secs(15),
        || {
            metrics
                .render()
                .lines()
                .any(|l| l == "tollgate_overrides 1")
        },
    )
    .await;
    let admin = proxy.server().admin_addr.expect("admin listener");
    let client = h1_client();
    let statuses = [
        get(&client, &proxy.url("/api")).await.status,
        get(&client, &proxy.url("/api")).await.status,
        get(&client, &proxy.url("/api")).await.status,
        get(&client, &proxy.url("/failover")).await.status,
    ];
    use StatusCode as S;
    assert_eq!(statuses, [S::OK, S::OK, S::TOO_MANY_REQUESTS, S::OK]);
    // A share is sized by the rate seen: a few requests make it larger than what they used.
    for _ in 0..10 {
        assert_eq!(get(&client, &proxy.url("/reserved")).await.status, S::OK);
    }
    // The reserved-units gauge is brought up to date every 250 ms.
    until(
        "tollgate_reserved_units never rose",
        Duration::from_secs(10),
        || {
            metrics.render().lines().any(|l| {
                l.strip_prefix("tollgate_reserved_units ")
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v > 0.0)
            })
        },
    )
    .await;

    let page = scrape(admin, None).await.text();
    // The database's own gauges carry what their panels show, not a memory store's constant.
    assert!(value(&page, "tollgate_instances") >= 1.0);
    assert_eq!(value(&page, "tollgate_overrides"), 1.0);
    assert!(value(&page, "tollgate_store_round_trips_total") >= 1.0);
    assert!(
        value(
            &page,
            "tollgate_upstream_connect_failures_total{upstream=\"failover\"}"
        ) >= 1.0
    );
    let exposed = scraped(&page);
    let mut labels: BTreeSet<String> = exposed.values().flatten().cloned().collect();
    labels.extend(TARGET_LABELS.map(str::to_string));

    let dashboard = dashboard();
    let defined = defined_variables(&dashboard);
    let mut used = BTreeSet::new();
    for expr in expressions(&dashboard) {
        let place = &expr.place;
        let n = names(&substituted(&expr.text, &defined));
        for metric in &n.metrics {
            assert!(
                exposed.contains_key(metric),
                "{place}: {metric} is not in /metrics:\n{page}"
            );
        }
        for label in &n.labels {
            assert!(
                labels.contains(label),
                "{place}: no series has a label {label}"
            );
        }
        for decision in &n.decisions {
            assert!(
                DECISIONS.contains(&decision.as_str()),
                "{place}: decision {decision}"
            );
        }
        // A legend can only show a label the expression keeps, which (short of parsing
        // aggregations) is one it names; a variable lists any label of its series.
        let keeps = if expr.variable { &labels } else { &n.labels };
        for label in &expr.shown {
            assert!(
                keeps.contains(label),
                "{place}: shows {label}, not in {}",
                expr.text
            );
        }
        used.extend(n.metrics);
    }
    for family in REQUIRED {
        assert!(used.contains(family), "no panel shows {family}");
    }
}
