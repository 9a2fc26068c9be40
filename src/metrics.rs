//! Prometheus metrics (contract §7). Labels are route names, decisions, status codes and
//! reload results: values from the configuration or a fixed set, never anything a client sent,
//! so no subject can reach a label and cardinality stays bounded.
//!
//! `/metrics` speaks two formats (contract §7): the Prometheus text format 0.0.4 by default, and
//! OpenMetrics 1.0.0 when the scraper's `Accept` asks for it ([`Format::negotiate`]).
//! prometheus_client writes only OpenMetrics; [`prometheus_text`] turns that into 0.0.4.
//!
//! Adding a family: a field on [`Metrics`], created and registered in [`Metrics::new`] (name
//! without the `tollgate_` prefix and, for a counter, without `_total`; a one-line help text),
//! with labels from a `derive(EncodeLabelSet)` struct whose values come from the configuration
//! or a fixed set. Counters, gauges, histograms and info metrics come out right in both
//! formats; tests/it/prometheus.rs runs both through promtool.

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A route name as a label value: shared, so recording a metric allocates nothing.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct RouteName(pub Arc<str>);

impl EncodeLabelValue for RouteName {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        write_escaped(encoder, &self.0)
    }
}

/// A label value with `\`, `"` and newlines escaped, as both text formats want.
/// prometheus_client writes values as they are; configuration names cannot hold these
/// characters today (validation), so this only keeps a future name from breaking the page.
fn write_escaped(out: &mut impl std::fmt::Write, value: &str) -> std::fmt::Result {
    if !value.contains(['\\', '"', '\n']) {
        return out.write_str(value);
    }
    for c in value.chars() {
        match c {
            '\\' => out.write_str("\\\\")?,
            '"' => out.write_str("\\\"")?,
            '\n' => out.write_str("\\n")?,
            c => out.write_char(c)?,
        }
    }
    Ok(())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub route: RouteName,
    pub decision: &'static str,
}

/// `tollgate_policy_decisions_total`: one limit's part in a decision (contract §7). `policy` is
/// `<scope>:<label>`, a configuration name like `route`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyDecisionLabels {
    pub route: RouteName,
    pub policy: RouteName,
    pub decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    pub route: RouteName,
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: RouteName,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    /// The upstream's name in the configuration, never an address.
    pub upstream: RouteName,
}

/// Route label for requests that matched no route.
pub const NO_ROUTE: &str = "";

fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ]
    .into_iter()
}

/// The memory store's own series (contract §7 and §9). Handles share their values with the
/// registry, so the store counts directly into what `/metrics` shows; a store built without
/// a registry (tests, `tollgate explain`) gets handles of its own.
#[derive(Clone, Debug, Default)]
pub struct MemoryStoreMetrics {
    /// Live buckets forgotten to stay within `store.memory_buckets`.
    pub evictions: Counter,
    /// Buckets held now.
    pub buckets: Gauge,
}

pub struct Metrics {
    registry: Registry,
    pub decisions: Family<DecisionLabels, Counter>,
    pub responses: Family<ResponseLabels, Counter>,
    pub upstream_seconds: Family<RouteLabels, Histogram>,
    pub store_seconds: Histogram,
    pub store_errors: Counter,
    pub store_round_trips: Counter,
    pub sweep_deleted_rows: Counter,
    pub config_reloads: Family<ResultLabels, Counter>,
    pub open_connections: Gauge,
    pub memory: MemoryStoreMetrics,
    /// Live tollgate instances on the database, as last seen (contract §5b).
    pub instances: Gauge,
    /// 1 while this instance hears the database's reset notifications (contract §3b).
    pub reset_listener_up: Gauge,
    /// Units of reserved shares this instance holds and has not used (contract §3c).
    pub reserved_units: Gauge,
    /// Overrides in force on this instance (contract §3e).
    pub overrides: Gauge,
    pub upstream_connect_failures: Family<UpstreamLabels, Counter>,
    pub policy_decisions: Family<PolicyDecisionLabels, Counter>,
    /// 1 while decisions succeed (what `/readyz` answers), else 0; set on each scrape.
    pub ready: Gauge,
    /// Unix time of this instance's last sweep round that ended without an error.
    pub sweep_last_success: Gauge<f64, AtomicU64>,
    /// 1 when the last reload was applied (or none was tried), 0 after a rejected one.
    pub config_last_reload_successful: Gauge,
    /// Log lines the log writer dropped because its batch was full (`log_writer`).
    pub log_lines_dropped: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::with_log_drops(Counter::default())
    }

    /// Metrics whose `tollgate_log_lines_dropped_total` reads `log_lines_dropped`, the count
    /// of the process's log writer (`log_writer::LogWriter::dropped`).
    pub fn with_log_drops(log_lines_dropped: Counter) -> Self {
        let mut registry = Registry::with_prefix("tollgate");
        let decisions = Family::<DecisionLabels, Counter>::default();
        let responses = Family::<ResponseLabels, Counter>::default();
        let upstream_seconds = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        let store_seconds = Histogram::new(latency_buckets());
        let store_errors = Counter::default();
        let store_round_trips = Counter::default();
        let sweep_deleted_rows = Counter::default();
        let config_reloads = Family::<ResultLabels, Counter>::default();
        let open_connections = Gauge::default();
        let memory = MemoryStoreMetrics::default();
        let upstream_connect_failures = Family::<UpstreamLabels, Counter>::default();
        let policy_decisions = Family::<PolicyDecisionLabels, Counter>::default();
        let ready = Gauge::default();
        let reset_listener_up = Gauge::default();
        let reserved_units = Gauge::default();
        let overrides = Gauge::default();
        let sweep_last_success = Gauge::<f64, AtomicU64>::default();
        let config_last_reload_successful = Gauge::default();
        config_last_reload_successful.set(1);
        // Every result exists from the start, so the first failure is an increase.
        for result in ["success", "unchanged", "failure"] {
            let _ = config_reloads.get_or_create(&ResultLabels { result });
        }
        registry.register(
            "decisions",
            "Rate-limit decisions by route and outcome",
            decisions.clone(),
        );
        registry.register(
            "responses",
            "Responses sent, by route and status code",
            responses.clone(),
        );
        registry.register(
            "upstream_seconds",
            "Time until the upstream's response headers, by route",
            upstream_seconds.clone(),
        );
        registry.register(
            "store_seconds",
            "Time of one counter-store round trip",
            store_seconds.clone(),
        );
        registry.register(
            "store_errors",
            "Counter-store calls that failed or timed out",
            store_errors.clone(),
        );
        registry.register(
            "store_round_trips",
            "Statements sent to the database for decisions (several requests share one when they coalesce; 0 on the memory store)",
            store_round_trips.clone(),
        );
        registry.register(
            "sweep_deleted_rows",
            "Expired counter rows deleted by the sweep",
            sweep_deleted_rows.clone(),
        );
        registry.register(
            "config_reloads",
            "Configuration reloads by result: success (applied), unchanged (applied, the same as what served), failure (rejected)",
            config_reloads.clone(),
        );
        registry.register(
            "open_connections",
            "Client connections currently open",
            open_connections.clone(),
        );
        registry.register(
            "memory_evictions",
            "Live buckets the memory store forgot, least recently used first, to stay within store.memory_buckets (0 on the Postgres store)",
            memory.evictions.clone(),
        );
        registry.register(
            "memory_buckets",
            "Buckets the memory store holds now, at most store.memory_buckets (0 on the Postgres store)",
            memory.buckets.clone(),
        );
        let instances = Gauge::default();
        registry.register(
            "instances",
            "Live tollgate instances on the database when it last answered (the local store-failure policy divides limits by it; 1 on the memory store)",
            instances.clone(),
        );
        registry.register(
            "upstream_connect_failures",
            "Connections to an upstream's origins that were refused, timed out or failed before anything was sent, by upstream",
            upstream_connect_failures.clone(),
        );
        registry.register(
            "policy_decisions",
            "Each applicable limit's part in a decision, by route, policy (scope:label) and outcome",
            policy_decisions.clone(),
        );
        registry.register(
            "ready",
            "1 while decisions succeed (GET /readyz answers 200), else 0",
            ready.clone(),
        );
        registry.register(
            "reset_listener_up",
            "1 while this instance hears the database's reset notifications (LISTEN works), else 0 (always 0 on the memory store)",
            reset_listener_up.clone(),
        );
        registry.register(
            "reserved_units",
            "Units of reserved shares (reserve = true) this instance holds and has not used (always 0 on the memory store)",
            reserved_units.clone(),
        );
        registry.register(
            "overrides",
            "Per-subject overrides (tollgate override) this instance applies now: in force, not ended (always 0 on the memory store)",
            overrides.clone(),
        );
        registry.register(
            "sweep_last_success_timestamp_seconds",
            "Unix time of the last sweep round that ended without an error (0 = none yet)",
            sweep_last_success.clone(),
        );
        registry.register(
            "config_last_reload_successful",
            "1 if the last configuration reload was applied (or none was tried), 0 if it was rejected",
            config_last_reload_successful.clone(),
        );
        registry.register(
            "log_lines_dropped",
            "Log lines dropped because the log writer's batch was full (the log's reader fell behind)",
            log_lines_dropped.clone(),
        );
        Metrics {
            log_lines_dropped,
            instances,
            registry,
            decisions,
            responses,
            upstream_seconds,
            store_seconds,
            store_errors,
            store_round_trips,
            sweep_deleted_rows,
            config_reloads,
            open_connections,
            memory,
            upstream_connect_failures,
            policy_decisions,
            ready,
            reset_listener_up,
            reserved_units,
            overrides,
            sweep_last_success,
            config_last_reload_successful,
        }
    }

    /// One origin of `upstream` failed to connect (contract §5: the request goes on to the next).
    pub fn upstream_connect_failure(&self, upstream: &Arc<str>) {
        self.upstream_connect_failures
            .get_or_create(&UpstreamLabels {
                upstream: RouteName(upstream.clone()),
            })
            .inc();
    }

    pub fn decision(&self, route: &Arc<str>, decision: Decision) {
        self.decisions
            .get_or_create(&DecisionLabels {
                route: RouteName(route.clone()),
                decision: decision.as_str(),
            })
            .inc();
    }

    pub fn response(&self, route: &Arc<str>, code: u16) {
        self.responses
            .get_or_create(&ResponseLabels {
                route: RouteName(route.clone()),
                code,
            })
            .inc();
    }

    pub fn upstream_time(&self, route: &Arc<str>, seconds: f64) {
        self.upstream_seconds
            .get_or_create(&RouteLabels {
                route: RouteName(route.clone()),
            })
            .observe(seconds);
    }

    /// A reload's `result`: `success` (applied), `unchanged` (applied, and the same as what
    /// served) or `failure` (rejected; the previous configuration keeps serving).
    pub fn reload(&self, result: &'static str) {
        self.config_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
        // An unchanged file is what serves: as good as an applied one.
        self.config_last_reload_successful
            .set(i64::from(result != "failure"));
    }

    /// A sweep round ended without an error at `now_ms` (unix milliseconds); it may have
    /// found nothing to delete, or another instance holding the sweep lock.
    pub fn sweep_succeeded(&self, now_ms: i64) {
        self.sweep_last_success.set(now_ms as f64 / 1000.0);
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The exposition in `format`.
    pub fn render_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.render(),
            Format::Prometheus => prometheus_text(&self.render()),
        }
    }
}

/// The two text formats `/metrics` speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format 0.0.4: what `promtool check metrics` reads, the default.
    Prometheus,
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for (RFC 9110 12.5.1): each format's quality is
    /// that of the most specific media range that matches it (`application/openmetrics-text`
    /// with `version` absent, 1.0.0 or 0.0.1; `text/plain` with `version` absent, 0.0.4 or
    /// 1.0.0; `text/*`, `application/*`, `*/*`); q=0 refuses. The higher quality wins, a tie
    /// goes to the range listed first (as client_golang does). No header, or nothing
    /// acceptable: the Prometheus text, as client_golang answers rather than 406.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        // Per format: (specificity, q, position) of the most specific range matching it.
        let mut best: [Option<(u8, u16, usize)>; 2] = [None, None];
        for (position, range) in accept.split(',').enumerate() {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim();
            let Some((kind, sub)) = media.split_once('/') else {
                continue;
            };
            let (mut version, mut q) = (None, 1000u16);
            for param in parts {
                let Some((name, value)) = param.split_once('=') else {
                    continue;
                };
                let value = value.trim().trim_matches('"');
                match name.trim().to_ascii_lowercase().as_str() {
                    "q" => q = parse_q(value),
                    "version" => version = Some(value),
                    _ => {}
                }
            }
            for (slot, format) in [Format::Prometheus, Format::OpenMetrics]
                .into_iter()
                .enumerate()
            {
                let Some(specificity) = format.matches(kind.trim(), sub.trim(), version) else {
                    continue;
                };
                if best[slot].is_none_or(|(s, _, _)| specificity > s) {
                    best[slot] = Some((specificity, q, position));
                }
            }
        }
        let quality = |slot: usize| best[slot].filter(|&(_, q, _)| q > 0);
        match (quality(0), quality(1)) {
            (_, None) => Format::Prometheus,
            (None, Some(_)) => Format::OpenMetrics,
            (Some((_, qp, pp)), Some((_, qo, po))) => {
                if qo > qp || (qo == qp && po < pp) {
                    Format::OpenMetrics
                } else {
                    Format::Prometheus
                }
            }
        }
    }

    /// How specifically `kind/sub` (with its `version` parameter) names this format: 3 =
    /// type, subtype and version; 2 = type and subtype; 1 = `type/*`; 0 = `*/*`.
    fn matches(self, kind: &str, sub: &str, version: Option<&str>) -> Option<u8> {
        let (own_kind, own_sub, versions): (&str, &str, &[&str]) = match self {
            Format::Prometheus => ("text", "plain", &["0.0.4", "1.0.0"]),
            Format::OpenMetrics => ("application", "openmetrics-text", &["1.0.0", "0.0.1"]),
        };
        if kind == "*" && sub == "*" {
            return Some(0);
        }
        if !kind.eq_ignore_ascii_case(own_kind) {
            return None;
        }
        if sub == "*" {
            return Some(1);
        }
        if !sub.eq_ignore_ascii_case(own_sub) {
            return None;
        }
        match version {
            None => Some(2),
            Some(v) if versions.contains(&v) => Some(3),
            Some(_) => None,
        }
    }
}

/// A quality value in thousandths; malformed means 0 (not acceptable), as a value above 1.
fn parse_q(value: &str) -> u16 {
    match value.parse::<f64>() {
        Ok(q) if (0.0..=1.0).contains(&q) => (q * 1000.0).round() as u16,
        _ => 0,
    }
}

/// The Prometheus text format 0.0.4 of an OpenMetrics exposition written by
/// prometheus_client. The two differ, for what that crate writes, in: a counter family is
/// named with its `_total` suffix (`# TYPE x_total counter`), an info family `x_info` is a
/// gauge, `unknown` is `untyped`; there is no `# UNIT`, no `# EOF`, no `_created` sample and
/// no exemplar. Sample lines are otherwise the same (names, label escaping, `+Inf`).
pub fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // HELP comes before TYPE, and a counter's name in it depends on the type.
    let mut help: Option<(&str, &str)> = None;
    let mut family = "";
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (suffix, kind) = match kind {
                "counter" => ("_total", "counter"),
                "info" => ("_info", "gauge"),
                "gauge" | "histogram" | "summary" => ("", kind),
                _ => ("", "untyped"),
            };
            family = name;
            if let Some((help_name, text)) = help.take() {
                let _ = writeln!(out, "# HELP {help_name}{suffix} {text}");
            }
            let _ = writeln!(out, "# TYPE {name}{suffix} {kind}");
            continue;
        }
        if line.starts_with('#') {
            // `# UNIT`, `# EOF`.
            continue;
        }
        let sample_name = line.split(['{', ' ']).next().unwrap_or("");
        if sample_name
            .strip_prefix(family)
            .is_some_and(|rest| rest == "_created")
        {
            continue;
        }
        // An exemplar follows the value (and timestamp) after " # ", past the labels.
        let labels_end = labels_end(line);
        let sample = match line[labels_end..].find(" # ") {
            Some(at) => &line[..labels_end + at],
            None => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// Where a sample line's label set ends (just past its `}`), or 0 without labels; quoted
/// values may hold any character.
fn labels_end(line: &str) -> usize {
    let Some(open) = line.find('{') else {
        return 0;
    };
    let (mut quoted, mut escaped) = (false, false);
    for (i, b) in line.bytes().enumerate().skip(open) {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'}' if !quoted => return i + 1,
            _ => {}
        }
    }
    line.len()
}

use crate::decision::Decision;

const FIRST_STATUS: u16 = 100;
const STATUSES: usize = 500;

/// One series per decision of the limiter ([`Decision::counted_index`]), resolved on first use.
type DecisionSlots = [OnceLock<Counter>; Decision::COUNTED];

/// One route's series, each looked up in its family once and then kept: a request touches
/// three of them, and a family lookup (hashing the labels under a lock) cost as much as the
/// counting. Each handle shares its counter with the family, so `/metrics` shows the same
/// series, created on first use as before. Rebuilt (empty) by a reload.
pub struct RouteMetrics {
    route: Arc<str>,
    decisions: DecisionSlots,
    /// By status code, from 100.
    responses: Box<[OnceLock<Counter>]>,
    upstream_seconds: OnceLock<Histogram>,
    /// Per limit, in the route's limit order: its policy name (the very `Arc` the route's
    /// plans carry, so a request finds its slot by pointer, without hashing a string) and
    /// its `tollgate_policy_decisions_total` series by decision.
    policies: Box<[(Arc<str>, DecisionSlots)]>,
}

impl RouteMetrics {
    #[cfg(test)]
    pub fn new(route: Arc<str>) -> Self {
        Self::with_policies(route, &[])
    }

    /// A route whose limits are named `policies` (`<scope>:<label>`, in limit order).
    pub fn with_policies(route: Arc<str>, policies: &[Arc<str>]) -> Self {
        RouteMetrics {
            route,
            decisions: Default::default(),
            responses: (0..STATUSES).map(|_| OnceLock::new()).collect(),
            upstream_seconds: OnceLock::new(),
            policies: policies
                .iter()
                .map(|p| (p.clone(), Default::default()))
                .collect(),
        }
    }

    /// One limit's part in a decision: `policy` is one of the route's policy `Arc`s (from its
    /// plans or outcomes); another `Arc` with the same name still counts, through the family.
    #[inline]
    pub fn policy_decision(&self, metrics: &Metrics, policy: &Arc<str>, decision: Decision) {
        let slots = self
            .policies
            .iter()
            .find(|(p, _)| Arc::ptr_eq(p, policy))
            .map(|(_, slots)| slots);
        let labels = || PolicyDecisionLabels {
            route: RouteName(self.route.clone()),
            policy: RouteName(policy.clone()),
            decision: decision.as_str(),
        };
        let slot = slots.zip(decision.counted_index()).map(|(s, i)| &s[i]);
        match slot {
            Some(slot) => resolved(slot, &metrics.policy_decisions, labels).inc(),
            None => metrics.policy_decisions.get_or_create(&labels()).inc(),
        };
    }

    pub fn decision(&self, metrics: &Metrics, decision: Decision) {
        let Some(i) = decision.counted_index() else {
            return metrics.decision(&self.route, decision);
        };
        resolved(&self.decisions[i], &metrics.decisions, || DecisionLabels {
            route: RouteName(self.route.clone()),
            decision: decision.as_str(),
        })
        .inc();
    }

    pub fn response(&self, metrics: &Metrics, code: u16) {
        let Some(slot) = self
            .responses
            .get(usize::from(code.wrapping_sub(FIRST_STATUS)))
        else {
            return metrics.response(&self.route, code);
        };
        resolved(slot, &metrics.responses, || ResponseLabels {
            route: RouteName(self.route.clone()),
            code,
        })
        .inc();
    }

    pub fn upstream_time(&self, metrics: &Metrics, seconds: f64) {
        resolved(&self.upstream_seconds, &metrics.upstream_seconds, || {
            RouteLabels {
                route: RouteName(self.route.clone()),
            }
        })
        .observe(seconds);
    }
}

/// The handle in `slot`, looked up in `family` (and kept) on first use. The clone shares the
/// family's metric.
fn resolved<'s, L, M, C>(
    slot: &'s OnceLock<M>,
    family: &Family<L, M, C>,
    labels: impl FnOnce() -> L,
) -> &'s M
where
    L: Clone + std::hash::Hash + Eq,
    M: Clone,
    C: MetricConstructor<M>,
{
    slot.get_or_init(|| family.get_or_create(&labels()).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    #[test]
    fn route_handles_count_into_the_families_series() {
        let metrics = Metrics::new();
        let route = RouteMetrics::new(Arc::from("api"));
        // Nothing shows before first use, as with the families alone.
        assert!(line(&metrics.render(), "tollgate_decisions_total{").is_none());
        route.decision(&metrics, Decision::Allowed);
        route.decision(&metrics, Decision::Allowed);
        route.decision(&metrics, Decision::Limited);
        // An ending that is not a decision has no slot: it goes to the family directly.
        route.decision(&metrics, Decision::NoRoute);
        route.response(&metrics, 200);
        route.response(&metrics, 429);
        route.response(&metrics, 429);
        // Status codes outside 100..=599 have no slot.
        route.response(&metrics, 999);
        route.response(&metrics, 42);
        route.upstream_time(&metrics, 0.002);
        // A second handle for the same route (after a reload) shares the series.
        RouteMetrics::new(Arc::from("api")).decision(&metrics, Decision::Allowed);

        let text = metrics.render();
        let expect = [
            r#"tollgate_decisions_total{route="api",decision="allowed"} 3"#,
            r#"tollgate_decisions_total{route="api",decision="limited"} 1"#,
            r#"tollgate_decisions_total{route="api",decision="no_route"} 1"#,
            r#"tollgate_responses_total{route="api",code="200"} 1"#,
            r#"tollgate_responses_total{route="api",code="429"} 2"#,
            r#"tollgate_responses_total{route="api",code="999"} 1"#,
            r#"tollgate_responses_total{route="api",code="42"} 1"#,
            r#"tollgate_upstream_seconds_count{route="api"} 1"#,
        ];
        for series in expect {
            assert!(
                text.lines().any(|l| l == series),
                "missing {series} in\n{text}"
            );
        }
    }

    #[test]
    fn policy_handles_count_into_the_family_by_route_policy_and_decision() {
        let metrics = Metrics::new();
        let ip: Arc<str> = Arc::from("api:ip");
        let tenant: Arc<str> = Arc::from("tenants:x-tenant");
        let route = RouteMetrics::with_policies(Arc::from("api"), &[ip.clone(), tenant.clone()]);
        route.policy_decision(&metrics, &ip, Decision::Allowed);
        route.policy_decision(&metrics, &ip, Decision::Limited);
        route.policy_decision(&metrics, &ip, Decision::Limited);
        route.policy_decision(&metrics, &tenant, Decision::FailedOpen);
        // Another Arc with the same name (not pre-resolved) still lands in the same series.
        route.policy_decision(&metrics, &Arc::from("api:ip"), Decision::Limited);
        let text = metrics.render_as(Format::Prometheus);
        for series in [
            r#"tollgate_policy_decisions_total{route="api",policy="api:ip",decision="allowed"} 1"#,
            r#"tollgate_policy_decisions_total{route="api",policy="api:ip",decision="limited"} 3"#,
            r#"tollgate_policy_decisions_total{route="api",policy="tenants:x-tenant",decision="failed_open"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == series),
                "missing {series} in\n{text}"
            );
        }
    }

    #[test]
    fn accept_negotiation_follows_quality_then_order() {
        use Format::{OpenMetrics as Om, Prometheus as P};
        let prometheus_2 = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let cases = [
            (None, P),
            (Some(prometheus_2), Om),
            (Some("application/openmetrics-text"), Om),
            (Some("Application/OpenMetrics-Text; Version=1.0.0"), Om),
            (Some("application/openmetrics-text; version=\"0.0.1\""), Om),
            (Some("application/openmetrics-text;version=2.0.0"), P),
            (Some("text/plain;version=0.0.4"), P),
            (Some("text/plain;version=1.0.0;escaping=allow-utf-8"), P),
            (Some("*/*"), P),
            (Some("application/*"), Om),
            (Some("application/json"), P),
            (Some(""), P),
            (
                Some("application/openmetrics-text;q=0.3, text/plain;q=0.5"),
                P,
            ),
            (
                Some("text/plain;q=0.3, application/openmetrics-text;q=0.5"),
                Om,
            ),
            // Equal quality: the first listed.
            (Some("application/openmetrics-text, text/plain"), Om),
            (Some("text/plain, application/openmetrics-text"), P),
            // q=0 refuses, even when a wildcard would take it.
            (Some("text/plain;q=0, */*"), Om),
            (Some("application/openmetrics-text;q=0, */*"), P),
            // The most specific range decides a format's quality.
            (Some("*/*;q=0.1, application/openmetrics-text;q=0.2"), Om),
            (
                Some("application/openmetrics-text;q=0.9, application/*;q=0.1, text/plain;q=0.5"),
                Om,
            ),
            // Malformed or out-of-range q is 0.
            (
                Some("application/openmetrics-text;q=abc, text/plain;q=0.1"),
                P,
            ),
            (Some("application/openmetrics-text;q=1.5"), P),
            (Some("garbage, ;;, /"), P),
        ];
        for (accept, expected) in cases {
            assert_eq!(Format::negotiate(accept), expected, "Accept: {accept:?}");
        }
    }

    #[test]
    fn prometheus_text_renames_counters_and_drops_what_0_0_4_lacks() {
        let openmetrics = "\
# HELP tollgate_hits Hits.
# TYPE tollgate_hits counter
tollgate_hits_total{route=\"a\"} 3 # {trace=\"x\"} 1.0
tollgate_hits_created{route=\"a\"} 1700000000.0
# HELP tollgate_build Build.
# TYPE tollgate_build info
tollgate_build_info{version=\"1 # 2\"} 1
# HELP tollgate_odd Odd.
# TYPE tollgate_odd unknown
tollgate_odd 2
# HELP tollgate_size_bytes Size.
# TYPE tollgate_size_bytes gauge
# UNIT tollgate_size_bytes bytes
tollgate_size_bytes 7
# HELP tollgate_wait_seconds Wait.
# TYPE tollgate_wait_seconds histogram
tollgate_wait_seconds_sum 0.5
tollgate_wait_seconds_count 1
tollgate_wait_seconds_bucket{le=\"+Inf\"} 1
# EOF
";
        let expected = "\
# HELP tollgate_hits_total Hits.
# TYPE tollgate_hits_total counter
tollgate_hits_total{route=\"a\"} 3
# HELP tollgate_build_info Build.
# TYPE tollgate_build_info gauge
tollgate_build_info{version=\"1 # 2\"} 1
# HELP tollgate_odd Odd.
# TYPE tollgate_odd untyped
tollgate_odd 2
# HELP tollgate_size_bytes Size.
# TYPE tollgate_size_bytes gauge
tollgate_size_bytes 7
# HELP tollgate_wait_seconds Wait.
# TYPE tollgate_wait_seconds histogram
tollgate_wait_seconds_sum 0.5
tollgate_wait_seconds_count 1
tollgate_wait_seconds_bucket{le=\"+Inf\"} 1
";
        assert_eq!(prometheus_text(openmetrics), expected);
    }

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        write_escaped(&mut out, "a\"b\\c\nd").expect("write");
        assert_eq!(out, "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn reload_results_and_their_gauge() {
        let metrics = Metrics::new();
        let text = metrics.render_as(Format::Prometheus);
        assert!(text.contains("tollgate_config_reloads_total{result=\"failure\"} 0\n"));
        assert!(text.contains("tollgate_config_last_reload_successful 1\n"));
        metrics.reload("failure");
        assert_eq!(metrics.config_last_reload_successful.get(), 0);
        metrics.reload("success");
        assert_eq!(metrics.config_last_reload_successful.get(), 1);
        metrics.reload("failure");
        metrics.reload("unchanged");
        assert_eq!(metrics.config_last_reload_successful.get(), 1);
        let text = metrics.render_as(Format::Prometheus);
        assert!(text.contains("tollgate_config_reloads_total{result=\"unchanged\"} 1\n"));
    }
}
