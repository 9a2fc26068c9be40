//! Prometheus metrics (SPEC section 7). Labels are route names, decisions, status codes and
//! reload results: values from the configuration or a fixed set, never anything a client sent,
//! so no subject can reach a label and cardinality stays bounded.

use std::fmt::Write as _;
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
        encoder.write_str(&self.0)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub route: RouteName,
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

/// The memory store's own series (SPEC 7 and 9). Handles share their values with the
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
    /// Live tollgate instances on the database, as last seen (SPEC 5b).
    pub instances: Gauge,
    pub upstream_connect_failures: Family<UpstreamLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
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
            "Configuration reloads by result",
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
        Metrics {
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
        }
    }

    /// One origin of `upstream` failed to connect (SPEC 5: the request goes on to the next).
    pub fn upstream_connect_failure(&self, upstream: &Arc<str>) {
        self.upstream_connect_failures
            .get_or_create(&UpstreamLabels {
                upstream: RouteName(upstream.clone()),
            })
            .inc();
    }

    pub fn decision(&self, route: &Arc<str>, decision: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                route: RouteName(route.clone()),
                decision,
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

    pub fn reload(&self, result: &'static str) {
        self.config_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Decisions a route counts, in [`RouteMetrics`]' order.
const DECISIONS: [&str; 5] = [
    "allowed",
    "shadow_limited",
    "limited",
    "failed_open",
    "failed_closed",
];
const FIRST_STATUS: u16 = 100;
const STATUSES: usize = 500;

/// One route's series, each looked up in its family once and then kept: a request touches
/// three of them, and a family lookup (hashing the labels under a lock) cost as much as the
/// counting. Each handle shares its counter with the family, so `/metrics` shows the same
/// series, created on first use as before. Rebuilt (empty) by a reload.
pub struct RouteMetrics {
    route: Arc<str>,
    decisions: [OnceLock<Counter>; DECISIONS.len()],
    /// By status code, from 100.
    responses: Box<[OnceLock<Counter>]>,
    upstream_seconds: OnceLock<Histogram>,
}

impl RouteMetrics {
    pub fn new(route: Arc<str>) -> Self {
        RouteMetrics {
            route,
            decisions: Default::default(),
            responses: (0..STATUSES).map(|_| OnceLock::new()).collect(),
            upstream_seconds: OnceLock::new(),
        }
    }

    pub fn decision(&self, metrics: &Metrics, decision: &'static str) {
        let Some(i) = DECISIONS.iter().position(|known| *known == decision) else {
            return metrics.decision(&self.route, decision);
        };
        resolved(&self.decisions[i], &metrics.decisions, || DecisionLabels {
            route: RouteName(self.route.clone()),
            decision,
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
        route.decision(&metrics, "allowed");
        route.decision(&metrics, "allowed");
        route.decision(&metrics, "limited");
        // A decision without a cached slot goes to the family directly.
        route.decision(&metrics, "something_new");
        route.response(&metrics, 200);
        route.response(&metrics, 429);
        route.response(&metrics, 429);
        // Status codes outside 100..=599 have no slot.
        route.response(&metrics, 999);
        route.response(&metrics, 42);
        route.upstream_time(&metrics, 0.002);
        // A second handle for the same route (after a reload) shares the series.
        RouteMetrics::new(Arc::from("api")).decision(&metrics, "allowed");

        let text = metrics.render();
        let expect = [
            r#"tollgate_decisions_total{route="api",decision="allowed"} 3"#,
            r#"tollgate_decisions_total{route="api",decision="limited"} 1"#,
            r#"tollgate_decisions_total{route="api",decision="something_new"} 1"#,
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
}
