//! The per-request pipeline: normalise -> route -> key -> limit -> forward -> charge, as named
//! steps.
//!
//! [`Proxy::handle`] is the one place a request ends: every path through the pipeline returns
//! a [`Handled`] that says what happened, and the access-log line and response metrics are
//! written there and only there. The configuration-derived parts (routes, their policy names,
//! upstream pools) live in a [`Runtime`] behind an `ArcSwap`: a request loads it once and keeps
//! it to the end, so a reload never changes the rules under a request in flight.
//!
//! tollgate's own answers (`local_error`, `rejection`) to a gRPC call are trailers-only
//! gRPC responses (contract §5c); whether a request is one is asked only when tollgate answers it,
//! or once before it is forwarded (for an upstream failure's answer).

mod charge;
pub mod plan;
mod worker;

pub use worker::Worker;

use plan::{Asker, Plan, RouteRules, Rules};

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Version};
use http_body::Body as _;

use crate::body::{ClientBody, ProxyBody, UpstreamBody};
use crate::config::{Config, StoreErrorPolicy};
use crate::decision::Decision;
use crate::error::{GrpcCode, RequestError, StartupError};
use crate::forward::{ForwardRequest, UpstreamPool};
use crate::headers::{self, ResponseFields};
use crate::key::{self, BucketHasher};
use crate::limit::overrides::Overrides;
use crate::limit::{LimitOutcome, Limiter, Outcomes, PlannedLimit, Plans, Verdict};
use crate::log_format::AccessLine;
use crate::metrics::{Metrics, RouteMetrics, NO_ROUTE};
use crate::normalise;
use crate::route;

/// A route ready to serve: what serving needs beside its [`RouteRules`], derived once.
pub struct CompiledRoute {
    /// The route's name, shared with metric labels and logs.
    pub name: Arc<str>,
    /// The `RateLimit-Policy` value when every limit applies (it names only configuration),
    /// made once rather than per response.
    pub rate_limit_policy: Option<HeaderValue>,
    pub upstream: Arc<UpstreamPool>,
    pub on_store_error: StoreErrorPolicy,
    pub metrics: RouteMetrics,
}

impl CompiledRoute {
    /// The route's ready `RateLimit-Policy` value, when `outcomes` are those of all its limits
    /// (`rules`) in order (a limit whose key is absent from the request has no outcome).
    /// Outcomes of the local fallback carry the local quota, not the configured one: the
    /// ready value does not describe them.
    fn ready_policy(&self, rules: &RouteRules, outcomes: &[LimitOutcome]) -> Option<&HeaderValue> {
        let all = outcomes.len() == rules.policies.len()
            && outcomes
                .iter()
                .zip(&rules.policies)
                .zip(&rules.config.limits)
                .all(|((o, p), l)| Arc::ptr_eq(&o.policy, p) && o.requests == l.requests);
        if all {
            self.rate_limit_policy.as_ref()
        } else {
            None
        }
    }
}

/// Everything a reload replaces at once.
pub struct Runtime {
    /// The configuration, and what [`plan::plan`] reads of each route.
    pub rules: Rules,
    /// What serving needs, per route, in the same order.
    pub routes: Vec<CompiledRoute>,
}

impl Runtime {
    pub fn build(config: Arc<Config>) -> Result<Self, StartupError> {
        let pools: Vec<Arc<UpstreamPool>> = config
            .upstreams
            .iter()
            .map(|u| UpstreamPool::new(u.clone(), config.server.worker_count()).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let rules = Rules::compile(config);
        let routes = rules
            .routes
            .iter()
            .map(|r| {
                // What the rate-limit fields say of every limit, counts aside.
                let all_limits: Vec<LimitOutcome> = r
                    .config
                    .limits
                    .iter()
                    .zip(&r.policies)
                    .map(|(limit, policy)| LimitOutcome {
                        policy: policy.clone(),
                        requests: limit.requests,
                        window_secs: limit.window_secs,
                        count: 0,
                        cost: limit.cost,
                        added: false,
                        reset_secs: 0,
                        shadow: limit.shadow || r.config.shadow,
                        sliding: None,
                    })
                    .collect();
                let name: Arc<str> = Arc::from(r.config.name.as_str());
                CompiledRoute {
                    metrics: RouteMetrics::with_policies(name.clone(), &r.policies),
                    name,
                    rate_limit_policy: headers::rate_limit_policy_value(&all_limits),
                    upstream: pools[r.config.upstream].clone(),
                    on_store_error: r
                        .config
                        .on_store_error
                        .unwrap_or(rules.config.store.on_error),
                }
            })
            .collect();
        Ok(Runtime { rules, routes })
    }
}

/// What tollgate knows about the connection a request came on.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    pub tls: bool,
    /// The peer's address as an `X-Forwarded-For` entry, made once for the connection.
    pub peer_value: HeaderValue,
    /// The connection worker serving it, and what that worker keeps for its requests.
    pub worker: Arc<Worker>,
}

impl ConnInfo {
    pub fn new(peer: SocketAddr, tls: bool, worker: Arc<Worker>) -> Self {
        ConnInfo {
            peer,
            tls,
            peer_value: headers::peer_value(peer.ip()),
            worker,
        }
    }
}

pub struct Proxy {
    runtime: ArcSwap<Runtime>,
    limiter: Limiter,
    hasher: BucketHasher,
    metrics: Arc<Metrics>,
    /// Whether tollgate's own HTTP/1.1 client may carry requests (`http1::client`;
    /// `ServerBuilder::http1_direct_client`). Here, not in the runtime: a reload keeps it.
    direct_client: bool,
    /// Warnings about the upstream's unusable cost fields ([`charge`]), one a second at most.
    cost_warnings: crate::log_gate::LogGate,
    /// The overrides in force (contract §3e). Here, not in the runtime: a reload keeps them.
    overrides: Arc<Overrides>,
}

/// How a request ended, for the log and metrics.
struct Handled {
    response: Response<ProxyBody>,
    /// Index into the runtime's routes.
    route: Option<usize>,
    decision: Decision,
    /// The policies that denied it, if any.
    violated: Vec<Arc<str>>,
    upstream: Option<Arc<str>>,
    /// The `grpc-status` of tollgate's own answer to a gRPC call (its HTTP status is 200).
    grpc_status: Option<GrpcCode>,
}

impl Proxy {
    pub fn new(
        runtime: Runtime,
        limiter: Limiter,
        hasher: BucketHasher,
        metrics: Arc<Metrics>,
    ) -> Self {
        Proxy {
            runtime: ArcSwap::from_pointee(runtime),
            limiter,
            hasher,
            metrics,
            direct_client: true,
            cost_warnings: crate::log_gate::LogGate::default(),
            overrides: Arc::default(),
        }
    }

    /// Plans requests with `overrides` (contract §3e), which whoever made them keeps current.
    pub fn with_overrides(mut self, overrides: Arc<Overrides>) -> Self {
        self.overrides = overrides;
        self
    }

    /// `on`: whether tollgate's own HTTP/1.1 client may carry requests (default: it may).
    pub fn with_direct_client(mut self, on: bool) -> Self {
        self.direct_client = on;
        self
    }

    /// Swaps in new rules for requests that start from now on.
    pub fn replace_runtime(&self, runtime: Runtime) {
        if let Some(shares) = self.limiter.shares() {
            shares.reloaded(crate::limit::reserve::shapes_in(&runtime.rules.config));
        }
        self.runtime.store(Arc::new(runtime));
    }

    /// Answers one request: the decision, then tollgate's own answer or the upstream's.
    ///
    /// Whatever server took the request, the response is built the same way; the fields
    /// tollgate sets on it go where its body says ([`crate::body::UpstreamBody::fields_to`]): as field
    /// lines when tollgate's own HTTP/1.1 client read it for tollgate's own HTTP/1.1 server,
    /// else into its map.
    // Not an `async fn`, for the reason given on `pipeline`.
    #[allow(clippy::manual_async_fn)]
    pub fn handle(
        &self,
        mut req: Request<ClientBody>,
        conn: ConnInfo,
    ) -> impl Future<Output = Response<ProxyBody>> + '_ {
        async move {
            let started = Instant::now();
            let runtime = self.runtime.load_full();
            // Decided first, so that every answer (tollgate's own included) and the log carry it.
            let trusted_proxies = &runtime.rules.config.server.trusted_proxies;
            let (request_id, id_to_add) = headers::request_id(req.headers_mut(), || {
                key::is_trusted(key::canonical(conn.peer.ip()), trusted_proxies)
            });
            let method = req.method().clone();
            // Logged without its query: queries can carry credentials. (A Uri clone shares its
            // bytes; nothing is copied.)
            let uri = req.uri().clone();
            let worker = conn.worker.clone();
            let pipeline = self.pipeline(&runtime, req, conn, id_to_add, &request_id);
            let mut handled = pipeline.await;
            // A forwarded response has it already, behind the rate-limit fields.
            if let ProxyBody::Local(_) = handled.response.body() {
                handled.response.headers_mut().request_id(&request_id);
            }
            let status = handled.response.status().as_u16();
            let route = handled.route.map(|i| &runtime.routes[i]);
            let route_name = match route {
                Some(route) => {
                    route.metrics.response(&self.metrics, status);
                    &*route.name
                }
                None => {
                    self.metrics.response(&Arc::from(NO_ROUTE), status);
                    NO_ROUTE
                }
            };
            worker.log_access(&AccessLine {
                method: &method,
                path: uri.path(),
                route: route_name,
                decision: handled.decision.as_str(),
                violated: &handled.violated,
                status,
                elapsed: &|| started.elapsed(),
                upstream: handled.upstream.as_deref().unwrap_or(""),
                grpc_status: handled.grpc_status.map(GrpcCode::as_str),
                request_id: request_id.as_str(),
            });
            handled.response
        }
    }

    // Not an `async fn`: that would keep `req` and `conn` twice, as arguments and as locals of
    // its body (rust-lang/rust#62958); the block below uses them in place.
    #[allow(clippy::manual_async_fn)]
    fn pipeline<'a>(
        &'a self,
        rt: &'a Runtime,
        mut req: Request<ClientBody>,
        conn: ConnInfo,
        // The id [`headers::request_id`] made for a request that sent none: added upstream.
        request_id: Option<headers::RequestId>,
        // The request's id, set on a forwarded response.
        id: &'a headers::RequestId,
    ) -> impl Future<Output = Handled> + 'a {
        async move {
            // Steps 1-3: route and buckets, the same [`plan`] as `tollgate explain`'s.
            let asker = Asker {
                peer: conn.peer.ip(),
                ip_buckets: Some(conn.worker.ip_buckets()),
                overrides: &self.overrides,
            };
            let mut plans = Plans::new();
            let mut plan = match plan::plan(&rt.rules, &self.hasher, &mut req, asker, &mut plans) {
                Ok(plan) => plan,
                Err(refusal) => {
                    let mut handled = local_error(refusal.route, refusal.error, &req);
                    close_if_body_unread(&req, &mut handled.response);
                    return handled;
                }
            };
            let Some(index) = plan.route else {
                return local_error(None, RequestError::NoRoute, &req);
            };
            // Step 4: the decision, before a byte of the body is read.
            let mut outcomes = Outcomes::new();
            let worker = conn.worker.index();
            let decided = self.decide(rt, index, &plans, &mut outcomes, worker);
            let decision = match decided.await {
                Decided::Forward(decision) => decision,
                Decided::Deny {
                    decision,
                    retry_after,
                    violated,
                } => {
                    let (response, grpc_status) =
                        rejection(rt, index, &req, &outcomes, retry_after, &violated);
                    return Handled {
                        response,
                        route: Some(index),
                        decision,
                        violated,
                        upstream: None,
                        grpc_status,
                    };
                }
                Decided::FailedClosed => {
                    let mut handled =
                        local_error(Some(index), RequestError::StoreFailedClosed, &req);
                    let grpc = handled.grpc_status.is_some();
                    headers::set_retry_after(handled.response.headers_mut(), 1, grpc);
                    close_if_body_unread(&req, &mut handled.response);
                    return handled;
                }
            };
            // Step 5: forward, and the fields tollgate adds to the upstream's answer. Not an
            // `async fn` of its own: that would copy the request into one more future.
            let route = &rt.routes[index];
            let client_value = client_value(plan.client, &conn);
            let mut fwd =
                self.forward_request(rt, index, &mut plan, &client_value, &mut req, &conn);
            fwd.request_id = request_id;
            let sent = Sent {
                index,
                decision,
                // The answer goes back in the client's HTTP version, whatever the upstream
                // spoke: an HTTP/1.0 upstream must not turn a keep-alive HTTP/1.1 connection
                // into HTTP/1.0.
                client_version: req.version(),
                // The request is gone once forwarded: whether an upstream failure is answered
                // in gRPC is asked now (the one content-type look-up a forwarded request costs).
                grpc: headers::is_grpc(req.headers()),
                started: Instant::now(),
            };
            let mut result = route.upstream.forward(req, fwd).await;
            if let (Ok((response, _)), true) = (&mut result, rt.rules.routes[index].charged_after) {
                // Boxed: only routes charged after the response pay for its future.
                Box::pin(self.charge(rt, index, &plans, response, worker, decision)).await;
            }
            self.answer(rt, result, &sent, &outcomes, id)
        }
    }

    /// Step 4: the decision on `plans`, the limits of route `index` that apply (contract §3),
    /// with each limit's standing written to `outcomes`; counted in the decision metrics. With
    /// `local`, a failing store hands the decision to this instance alone (contract §5b).
    async fn decide(
        &self,
        rt: &Runtime,
        index: usize,
        plans: &[PlannedLimit],
        outcomes: &mut Outcomes,
        worker: usize,
    ) -> Decided {
        let route = &rt.routes[index];
        // Whether a limit of the route is charged after the response: read once, and plans
        // looked at only then (most routes have none).
        let checks = rt.rules.routes[index].charged_after;
        let mut verdict = self.limiter.decide(worker, plans, outcomes).await;
        let local = matches!(verdict, Verdict::StoreFailed)
            && route.on_store_error == StoreErrorPolicy::Local;
        if local {
            verdict = self.limiter.decide_locally(plans, outcomes).await;
        }
        self.count_policies(route, plans, outcomes, &verdict, (local, checks));
        let decided = match verdict {
            Verdict::Allow { .. } if local => Decided::Forward(Decision::LocalAllowed),
            Verdict::Allow { shadow_limited } if shadow_limited => {
                Decided::Forward(Decision::ShadowLimited)
            }
            // Admitted by a check: counted (or not) once the response says (contract §3d).
            Verdict::Allow { .. } if checks && plans.iter().any(|p| p.charged_after) => {
                Decided::Forward(Decision::CountedAfter)
            }
            Verdict::Allow { .. } => Decided::Forward(Decision::Allowed),
            Verdict::Deny {
                retry_after,
                violated,
            } => Decided::Deny {
                decision: if local {
                    Decision::LocalLimited
                } else {
                    Decision::Limited
                },
                retry_after,
                violated,
            },
            // No outcomes: the store gave no counts.
            Verdict::StoreFailed => match route.on_store_error {
                StoreErrorPolicy::Allow => Decided::Forward(Decision::FailedOpen),
                // `Local` only when the in-memory count itself failed, which validation rules
                // out (a zero-second window); closed rather than open, like `deny`.
                StoreErrorPolicy::Deny | StoreErrorPolicy::Local => Decided::FailedClosed,
            },
        };
        let decision = match &decided {
            Decided::Forward(d) | Decided::Deny { decision: d, .. } => *d,
            Decided::FailedClosed => Decision::FailedClosed,
        };
        route.metrics.decision(&self.metrics, decision);
        decided
    }

    /// Step 6 (contract §3d, [`charge`]): what the upstream's response head charges the
    /// request's limits counted after the response, sent before the head goes on (within the
    /// store's budget; a failure is counted and logged, never holds the response back). A
    /// request decided by the local fallback is charged there.
    async fn charge(
        &self,
        rt: &Runtime,
        index: usize,
        plans: &[PlannedLimit],
        response: &mut Response<UpstreamBody>,
        worker: usize,
        decision: Decision,
    ) {
        let rules = &rt.rules.routes[index];
        let status = response.status();
        let charges = charge::charges_of(
            rules,
            plans,
            status,
            response.headers_mut(),
            &self.cost_warnings,
        );
        let local = decision == Decision::LocalAllowed;
        self.limiter.charge(worker, &charges, local).await;
    }

    /// Step 5, before the request goes: what the forwarder needs of it (where it goes, the
    /// `X-Forwarded-*` facts, its field names), underscored names dropped unless allowed.
    /// `client_value`: the client address as text ([`client_value`]). The `X-Request-Id` to
    /// add is left for the caller.
    fn forward_request<'r>(
        &'r self,
        rt: &Runtime,
        index: usize,
        plan: &'r mut Plan,
        client_value: &'r HeaderValue,
        req: &mut Request<ClientBody>,
        conn: &'r ConnInfo,
    ) -> ForwardRequest<'r> {
        let rules = &rt.rules.routes[index];
        let server = &rt.rules.config.server;
        let peer = key::canonical(conn.peer.ip());
        let peer_trusted = key::is_trusted(peer, &server.trusted_proxies);
        let path = std::mem::take(&mut plan.path);
        let plan: &'r Plan = plan;
        // One pass over the names for the underscore rule here and the forwarder's questions.
        let names = headers::FieldNames::of(req.headers(), !server.underscores_in_headers);
        if !server.underscores_in_headers {
            headers::drop_underscored(req.headers_mut(), &names);
        }
        let mut target = if rules.config.strip_prefix {
            route::strip(&rules.config.path_prefix, &path)
        } else {
            path
        };
        if let Some(query) = req.uri().query() {
            target.push('?');
            target.push_str(query);
        }
        ForwardRequest {
            target,
            forwarded: headers::ForwardedFor {
                peer: &conn.peer_value,
                peer_trusted,
                client: client_value,
                proto: if conn.tls { "https" } else { "http" },
                host: plan.authority.as_ref().map(normalise::Authority::value),
            },
            names,
            request_id: None,
            max_body_size: rules.max_body_size,
            metrics: &self.metrics,
            worker: conn.worker.index(),
            direct_client: self.direct_client,
            fields_as_lines: !rules.charged_after,
        }
    }

    /// Step 5, once the upstream answered: its answer with tollgate's fields (the rate-limit
    /// fields of `outcomes`, `X-Request-Id` `id`), in the client's HTTP version; or tollgate's
    /// own answer when the upstream failed.
    fn answer(
        &self,
        rt: &Runtime,
        result: Result<(Response<UpstreamBody>, headers::FieldNames), RequestError>,
        sent: &Sent,
        outcomes: &[LimitOutcome],
        id: &headers::RequestId,
    ) -> Handled {
        let (route, rules) = (&rt.routes[sent.index], &rt.rules.routes[sent.index]);
        route
            .metrics
            .upstream_time(&self.metrics, sent.started.elapsed().as_secs_f64());
        let upstream_name = Some(route.upstream.name.clone());
        let (response, names) = match result {
            Ok(answer) => answer,
            Err(err) => {
                tracing::warn!(route = %route.name, error = %err, "upstream request failed");
                let mut handled = answer_error(Some(sent.index), err, sent.grpc);
                handled.decision = sent.decision;
                handled.upstream = upstream_name;
                return handled;
            }
        };
        let (mut parts, mut body) = response.into_parts();
        parts.version = sent.client_version;
        let mode = rt.rules.config.server.rate_limit_headers;
        headers::remove_replaced(&mut parts.headers, &names, mode, outcomes);
        {
            let mut to = body.fields_to(&mut parts.headers);
            let policy = route.ready_policy(rules, outcomes);
            headers::add_rate_limit_headers(&mut to, mode, outcomes, policy);
            to.request_id(id);
        }
        Handled {
            response: Response::from_parts(parts, ProxyBody::Upstream(body)),
            route: Some(sent.index),
            decision: sent.decision,
            violated: Vec::new(),
            upstream: upstream_name,
            grpc_status: None,
        }
    }
}

/// What step 4 decided.
enum Decided {
    /// Forward the request; the decision is its log word.
    Forward(Decision),
    /// Answer with the route's rejection.
    Deny {
        decision: Decision,
        retry_after: u64,
        violated: Vec<Arc<str>>,
    },
    /// The store failed and the route's policy closes.
    FailedClosed,
}

/// The client address as an `X-Real-IP` value: the connection's ready text when the client is
/// the peer, as nearly always.
fn client_value(client: IpAddr, conn: &ConnInfo) -> HeaderValue {
    if client == key::canonical(conn.peer.ip()) {
        conn.peer_value.clone()
    } else {
        headers::peer_value(client)
    }
}

/// What the answer to a forwarded request needs to know of it.
struct Sent {
    /// The route's index in the runtime.
    index: usize,
    decision: Decision,
    client_version: Version,
    /// Whether the request is a gRPC call (an upstream failure is answered in gRPC).
    grpc: bool,
    /// When it was sent upstream.
    started: Instant,
}

impl Proxy {
    /// `tollgate_policy_decisions_total` (contract §7): which of a route's limits denied. Each
    /// limit with an outcome counts `limited` if it was exceeded, `shadow_limited` if it
    /// was exceeded but is shadow, else `allowed` (it did not deny, whatever the others
    /// did), or `counted_after` for a limit charged after the response (contract §3d); when
    /// the store failed, every limit that applied counts the route's decision.
    /// `local`: the verdict is the local fallback's (contract §5b), so its parts are counted as
    /// `local_allowed` / `local_limited`. `checks`: the route has limits charged after the
    /// response.
    fn count_policies(
        &self,
        route: &CompiledRoute,
        plans: &[PlannedLimit],
        outcomes: &[LimitOutcome],
        verdict: &Verdict,
        (local, checks): (bool, bool),
    ) {
        if let Verdict::StoreFailed = verdict {
            let decision = match route.on_store_error {
                StoreErrorPolicy::Allow => Decision::FailedOpen,
                // `Local` fails here only if the in-memory count failed: closed, as the
                // request is answered.
                StoreErrorPolicy::Deny | StoreErrorPolicy::Local => Decision::FailedClosed,
            };
            for plan in plans {
                route
                    .metrics
                    .policy_decision(&self.metrics, &plan.policy, decision);
            }
            return;
        }
        for outcome in outcomes {
            let checked = || {
                checks
                    && plans
                        .iter()
                        .any(|p| p.charged_after && Arc::ptr_eq(&p.policy, &outcome.policy))
            };
            let decision = match (outcome.exceeded(), outcome.shadow, local) {
                (false, _, false) if checked() => Decision::CountedAfter,
                (false, _, false) => Decision::Allowed,
                (false, _, true) => Decision::LocalAllowed,
                (true, true, _) => Decision::ShadowLimited,
                (true, false, false) => Decision::Limited,
                (true, false, true) => Decision::LocalLimited,
            };
            route
                .metrics
                .policy_decision(&self.metrics, &outcome.policy, decision);
        }
    }
}

/// A response tollgate writes itself for a failure of this request: a gRPC one when the
/// request is a gRPC call.
fn local_error<B>(route: Option<usize>, err: RequestError, req: &Request<B>) -> Handled {
    let grpc = headers::is_grpc(req.headers());
    answer_error(route, err, grpc)
}

/// The answer to a failure: a short text with the error's HTTP status, or for a gRPC call
/// (`grpc`) a trailers-only gRPC response with the error's gRPC status.
fn answer_error(route: Option<usize>, err: RequestError, grpc: bool) -> Handled {
    let status = err.status();
    let (mut response, grpc_status) = if grpc {
        let code = err.grpc_code();
        (grpc_answer(code, err.grpc_message()), Some(code))
    } else {
        let mut response = Response::new(ProxyBody::text(format!(
            "{}\n",
            status.canonical_reason().unwrap_or("error")
        )));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        (response, None)
    };
    if status == StatusCode::BAD_REQUEST {
        // After a malformed request nothing else on this connection can be trusted.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    Handled {
        decision: err.decision(),
        response,
        route,
        violated: Vec::new(),
        upstream: None,
        grpc_status,
    }
}

/// A trailers-only gRPC response: HTTP 200, no body, the status in the header block.
fn grpc_answer(code: GrpcCode, message: &str) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::empty());
    headers::grpc_trailers_only(response.headers_mut(), code.as_str(), message);
    response
}

/// A request whose body was not read must not leave that body on an HTTP/1.1 connection:
/// the next "request" would be whatever the client uploaded.
fn close_if_body_unread<B>(req: &Request<ClientBody>, response: &mut Response<B>) {
    if req.version() != Version::HTTP_2 && !req.body().is_end_stream() {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// The 429 (or the route's `reject`) for a denied request; for a gRPC call, whatever the
/// route's `reject` says, `RESOURCE_EXHAUSTED` (with its `grpc-status`, returned too).
fn rejection(
    rt: &Runtime,
    index: usize,
    req: &Request<ClientBody>,
    outcomes: &[LimitOutcome],
    retry_after: u64,
    violated: &[Arc<str>],
) -> (Response<ProxyBody>, Option<GrpcCode>) {
    let grpc = headers::is_grpc(req.headers());
    if grpc {
        let message = format!("rate limited: {}", violated.join(","));
        let mut response = grpc_answer(GrpcCode::ResourceExhausted, &message);
        finish_rejection(rt, index, req, outcomes, retry_after, true, &mut response);
        return (response, Some(GrpcCode::ResourceExhausted));
    }
    let (status, content_type, body) = match &rt.rules.routes[index].config.reject {
        Some(reject) => (
            reject.status,
            reject.content_type.clone(),
            reject.body.clone(),
        ),
        None => (
            StatusCode::TOO_MANY_REQUESTS,
            Some("application/problem+json".to_string()),
            problem_body(violated),
        ),
    };
    let mut response = Response::new(ProxyBody::text(body));
    *response.status_mut() = status;
    if let Some(ct) = content_type.and_then(|ct| HeaderValue::from_str(&ct).ok()) {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    finish_rejection(rt, index, req, outcomes, retry_after, false, &mut response);
    (response, None)
}

/// What every rejection carries, gRPC or not: the wait, the rate-limit fields, and the end of
/// an HTTP/1.1 connection whose body was not read.
fn finish_rejection(
    rt: &Runtime,
    index: usize,
    req: &Request<ClientBody>,
    outcomes: &[LimitOutcome],
    retry_after: u64,
    grpc: bool,
    response: &mut Response<ProxyBody>,
) {
    let headers = response.headers_mut();
    headers::set_retry_after(headers, retry_after, grpc);
    headers::add_rate_limit_headers(
        headers,
        rt.rules.config.server.rate_limit_headers,
        outcomes,
        rt.routes[index].ready_policy(&rt.rules.routes[index], outcomes),
    );
    close_if_body_unread(req, response);
}

/// RFC 9457 problem details with the quota-exceeded type of the rate-limit headers draft.
fn problem_body(violated: &[Arc<str>]) -> Bytes {
    let policies: Vec<String> = violated.iter().map(|p| json_string(p)).collect();
    Bytes::from(format!(
        "{{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
         \"title\":\"Too Many Requests\",\"status\":429,\"violated-policies\":[{}]}}",
        policies.join(",")
    ))
}

/// Policy names are limited to `[A-Za-z0-9._:+-]` by validation; escape anyway.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
