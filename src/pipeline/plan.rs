//! Which route a request matches, which of its limits apply, and which bucket each would
//! increment (contract §2 and §3): [`plan`], the one answer that the proxy, `tollgate explain`
//! and `tollgate reset` share, so what an operator is shown or resets is what the proxy counts.
//!
//! The steps, in order: refuse the methods tollgate never forwards and over-long targets, one
//! spelling of authority and path (contract §4a), route on the host and the path without
//! parameters, refuse a body announced larger than the route takes, refuse keyed headers the
//! upstream could read differently, attribute the client address, then derive each limit's
//! bucket ([`planned_limit`]).

use std::net::IpAddr;
use std::sync::Arc;

use http::header::{self, HeaderName};
use http::{Method, Request, Version};
use http_body::Body;

use crate::config::{Config, LimitConfig, RouteConfig};
use crate::error::RequestError;
use crate::headers;
use crate::http1::rules::MAX_TARGET;
use crate::key::{self, BucketHasher, IpBucketCache, RequestIdentity};
use crate::limit::overrides::Overrides;
use crate::limit::{PlannedLimit, Plans};
use crate::normalise::{self, Authority, NormaliseError};
use crate::route;

/// What planning needs of a route, derived once from its configuration.
pub struct RouteRules {
    pub config: RouteConfig,
    /// `<scope>:<label>` per limit, in limit order.
    pub policies: Vec<Arc<str>>,
    /// The headers its limits key on: a request carrying one of them twice gets 400.
    pub keyed_headers: Vec<HeaderName>,
    /// The route's `max_body_size`, else the server's; `None` = no limit.
    pub max_body_size: Option<u64>,
    /// Some limit is charged after the response (contract §3d): the answer's head is read.
    pub charged_after: bool,
}

/// Every route's [`RouteRules`], in configuration order.
pub struct Rules {
    pub config: Arc<Config>,
    pub routes: Vec<RouteRules>,
}

impl Rules {
    pub fn compile(config: Arc<Config>) -> Rules {
        let routes = config
            .routes
            .iter()
            .map(|r| RouteRules {
                config: r.clone(),
                policies: r
                    .limits
                    .iter()
                    .map(|l| Arc::from(l.policy_name()))
                    .collect(),
                keyed_headers: key::keyed_headers(&r.limits),
                max_body_size: r.max_body_size.or(config.server.max_body_size),
                charged_after: r.limits.iter().any(LimitConfig::charged_after),
            })
            .collect();
        Rules { config, routes }
    }
}

/// Where a request goes; what it counts goes to the caller's [`Plans`] (see [`plan`]).
#[derive(Debug)]
pub struct Plan {
    /// The normalised authority (`host[:port]`); `None` for an HTTP/1.0 request without one.
    pub authority: Option<Authority>,
    /// The normalised path.
    pub path: String,
    /// The index of the route it matches; `None`: no route does, the proxy answers 404.
    pub route: Option<usize>,
    /// The address the request counts as (after `trusted_proxies`).
    pub client: IpAddr,
}

/// What the request counts in limit `index` of `route`, among `limits` (the [`Plans`] that
/// [`plan`] filled on the [`Rules`] holding `route`: limits are told apart by their policy
/// name's allocation), or `None` when that limit does not apply (a keyed header is missing).
pub fn limit_in<'p>(
    limits: &'p [PlannedLimit],
    route: &RouteRules,
    index: usize,
) -> Option<&'p PlannedLimit> {
    let policy = route.policies.get(index)?;
    limits.iter().find(|p| Arc::ptr_eq(&p.policy, policy))
}

/// Why the proxy answers a request itself before counting it.
#[derive(Debug)]
pub struct Refusal {
    /// The route it matched, if routing got that far.
    pub route: Option<usize>,
    pub error: RequestError,
}

impl Refusal {
    fn before_routing(error: RequestError) -> Self {
        Refusal { route: None, error }
    }
}

/// Who is asking: the connection's peer and the serving worker's cache of `ip` buckets
/// (`None`, for the commands, derives every bucket afresh); and the overrides in force
/// (contract §3e), which replace a limit's `requests` for their buckets.
pub struct Asker<'a> {
    pub peer: IpAddr,
    pub ip_buckets: Option<&'a IpBucketCache>,
    pub overrides: &'a Overrides,
}

/// What the proxy does with `req` up to the limiter: see the module docs. The route's limits
/// that apply, in limit order with their buckets, go to `limits` (cleared first; the caller
/// owns it, as it owns the outcomes of [`crate::limit::Limiter::decide`], so that it is not
/// copied on the way out). A request whose limits key on `cookie` has its HTTP/2 cookie
/// fields joined into one, in place.
pub fn plan<B: Body>(
    rules: &Rules,
    hasher: &BucketHasher,
    req: &mut Request<B>,
    asker: Asker<'_>,
    limits: &mut Plans,
) -> Result<Plan, Refusal> {
    limits.clear();
    if req.method() == Method::TRACE || req.method() == Method::CONNECT {
        return Err(Refusal::before_routing(RequestError::MethodNotAllowed));
    }
    // HTTP/1.1's framing guard has refused longer targets already; HTTP/2's `:path` comes here.
    if req.uri().path_and_query().map_or(0, |pq| pq.as_str().len()) > MAX_TARGET {
        return Err(Refusal::before_routing(RequestError::UriTooLong));
    }
    let bad = |e| Refusal::before_routing(RequestError::BadRequest(bad_request_reason(e)));
    let authority =
        normalise::request_authority_of(req.version(), req.uri(), req.headers()).map_err(bad)?;
    let path = normalise::normalise_path(req.uri().path()).map_err(bad)?;
    let host = authority
        .as_ref()
        .map(|a| normalise::host_without_port(a.as_str()));
    let routing_path = normalise::routing_path(&path);
    let config = &rules.config;
    let server = &config.server;
    let found = route::find(&config.routes, host, &routing_path, req.method());
    let Some(index) = found else {
        let client = key::canonical(asker.peer);
        return Ok(Plan {
            authority,
            path,
            route: None,
            client,
        });
    };
    let route = &rules.routes[index];
    let refused = |error| Refusal {
        route: Some(index),
        error,
    };
    // A body announced larger than the route takes is refused before anything is counted or
    // sent. The size hint is the parsed `Content-Length` (HTTP/1.1 and HTTP/2).
    if let (Some(max), Some(announced)) = (route.max_body_size, req.body().size_hint().exact()) {
        if announced > max {
            return Err(refused(RequestError::PayloadTooLarge));
        }
    }
    // A keyed header that the limiter and the upstream could read differently (sent twice,
    // padded, or with an underscore twin) would let the client choose its own bucket. HTTP/2
    // may split `cookie` into several fields, which are one header (RFC 9113 8.2.3): they are
    // joined first when a limit keys on it, so the whole value is counted.
    if req.version() == Version::HTTP_2 && route.keyed_headers.contains(&header::COOKIE) {
        headers::join_cookies(req.headers_mut());
    }
    let underscores_forwarded = server.underscores_in_headers;
    if let Some(why) =
        key::keyed_header_problem(req.headers(), &route.keyed_headers, underscores_forwarded)
    {
        return Err(refused(RequestError::BadRequest(why)));
    }
    let client = key::client_addr(asker.peer, req.headers(), &server.trusted_proxies);
    let who = RequestIdentity {
        client,
        ipv6_prefix: server.ipv6_prefix,
        headers: req.headers(),
        ip_buckets: asker.ip_buckets,
    };
    limits.extend(
        route
            .config
            .limits
            .iter()
            .zip(&route.policies)
            .filter_map(|(limit, policy)| {
                planned_limit(&route.config, limit, policy, &who, hasher, asker.overrides)
            }),
    );
    Ok(Plan {
        authority,
        path,
        route: Some(index),
        client,
    })
}

/// What this request would count in `limit` (one of `route`'s, named `policy`, its
/// `<scope>:<label>`): its bucket and quota, or `None` when the limit does not apply (a keyed
/// header is missing). An override of the bucket (contract §3e) replaces `requests` only:
/// window, algorithm, cost and key stay the file's.
fn planned_limit(
    route: &RouteConfig,
    limit: &LimitConfig,
    policy: &Arc<str>,
    who: &RequestIdentity<'_>,
    hasher: &BucketHasher,
    overrides: &Overrides,
) -> Option<PlannedLimit> {
    key::bucket_in(policy, &limit.key, who, hasher).map(|bucket| PlannedLimit {
        policy: policy.clone(),
        requests: overrides.requests(&bucket).unwrap_or(limit.requests),
        bucket,
        window_secs: limit.window_secs,
        shadow: limit.shadow || route.shadow,
        sliding: limit.algorithm == crate::config::Algorithm::Sliding,
        reserve: limit.reserve,
        cost: limit.cost,
        charged_after: limit.charged_after(),
    })
}

/// The reason a 400 gives for a request that cannot be normalised.
fn bad_request_reason(err: NormaliseError) -> &'static str {
    use NormaliseError::*;
    match err {
        NotOriginForm => "request target must be a path",
        BadEscape => "malformed percent-encoding",
        EncodedSeparator => "encoded / or NUL in path",
        EscapesRoot => "path escapes the root",
        DotSegmentWithParameters => "dot segment with parameters in path",
        MissingHost => "missing Host",
        DuplicateHost => "several Host headers",
        HostMismatch => "Host disagrees with the request target",
        BadHost => "malformed Host",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use std::path::Path;

    const CONFIG: &str = "[keys]\nsecret = \"s\"\n[upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\
                          [[routes]]\nname = \"login\"\npath_prefix = \"/login\"\nupstream = \"a\"\n\
                          max_body_size = \"1KiB\"\n\
                          [[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"\n\
                          [[routes.limits]]\nkey = \"header:x-api-key\"\nrequests = 2\nwindow = \"1m\"\n";

    fn rules() -> (Rules, BucketHasher) {
        let config = crate::config::load_str(Path::new("t.toml"), CONFIG, &|_| None).expect("ok");
        let hasher = BucketHasher::new(config.keys.secret.as_deref());
        (Rules::compile(Arc::new(config)), hasher)
    }

    fn request(method: Method, uri: &str, headers: HeaderMap) -> Request<String> {
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .body(String::new())
            .expect("request");
        *req.headers_mut() = headers;
        req
    }

    fn plan_of(req: &mut Request<String>) -> Result<(Plan, Plans), Refusal> {
        let (rules, hasher) = rules();
        plan_on(&rules, &hasher, req)
    }

    fn plan_on(
        rules: &Rules,
        hasher: &BucketHasher,
        req: &mut Request<String>,
    ) -> Result<(Plan, Plans), Refusal> {
        let none = Overrides::default();
        let asker = Asker {
            peer: "192.0.2.7".parse().expect("ip"),
            ip_buckets: None,
            overrides: &none,
        };
        let mut limits = Plans::new();
        plan(rules, hasher, req, asker, &mut limits).map(|plan| (plan, limits))
    }

    #[test]
    fn a_request_gets_its_route_and_the_buckets_of_the_limits_that_apply() {
        let (rules, hasher) = rules();
        let mut req = request(Method::GET, "http://api.test/login;x=1/a", HeaderMap::new());
        let (plan, limits) = plan_on(&rules, &hasher, &mut req).expect("plans");
        assert_eq!(plan.route, Some(0));
        assert_eq!(plan.path, "/login;x=1/a");
        let buckets: Vec<&str> = limits.iter().map(|p| &*p.bucket).collect();
        assert_eq!(buckets.len(), 1, "the header limit does not apply");
        assert!(buckets[0].starts_with("login:ip:"), "{buckets:?}");
        assert!(!buckets[0].contains("192.0.2.7"));
        let who = RequestIdentity {
            client: plan.client,
            ipv6_prefix: 64,
            headers: &HeaderMap::new(),
            ip_buckets: None,
        };
        let key = &rules.routes[0].config.limits[0].key;
        assert_eq!(
            Some(buckets[0]),
            key::bucket_for("login", key, &who, &hasher).as_deref()
        );
        assert!(limit_in(&limits, &rules.routes[0], 0).is_some());
        assert!(limit_in(&limits, &rules.routes[0], 1).is_none());
    }

    /// Contract §3e: an override replaces `requests` for its bucket only; everything else
    /// of the limit stays the file's.
    #[test]
    fn an_override_changes_the_requests_of_its_bucket_only() {
        let (rules, hasher) = rules();
        let keyed = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-api-key", value.parse().expect("value"));
            request(Method::GET, "http://api.test/login", headers)
        };
        let (_, limits) = plan_on(&rules, &hasher, &mut keyed("a")).expect("plans");
        let bucket_a = limits[1].bucket.clone();
        let mut map = crate::limit::overrides::OverrideMap::default();
        let raised = crate::store::Override {
            requests: 50,
            until_ms: None,
        };
        map.insert(Box::from(&*bucket_a), raised);
        let overrides = Overrides::of(map);
        let asker = || Asker {
            peer: "192.0.2.7".parse().expect("ip"),
            ip_buckets: None,
            overrides: &overrides,
        };
        let mut planned = Plans::new();
        plan(&rules, &hasher, &mut keyed("a"), asker(), &mut planned).expect("plans");
        assert_eq!((planned[1].requests, planned[1].window_secs), (50, 60));
        assert_eq!(planned[0].requests, 5, "the ip limit keeps the file's");
        plan(&rules, &hasher, &mut keyed("b"), asker(), &mut planned).expect("plans");
        assert_eq!(planned[1].requests, 2, "another key keeps the file's");
    }

    #[test]
    fn no_route_is_a_plan_without_one() {
        let mut req = request(Method::GET, "http://api.test/other", HeaderMap::new());
        let (plan, limits) = plan_of(&mut req).expect("plans");
        assert_eq!(plan.route, None);
        assert!(limits.is_empty());
    }

    #[test]
    fn what_the_proxy_answers_itself_is_refused_with_its_error() {
        let refused = |mut req: Request<String>| match plan_of(&mut req) {
            Err(refusal) => (refusal.route, refusal.error.status().as_u16()),
            Ok((plan, _)) => panic!("planned: {plan:?}"),
        };
        let none = HeaderMap::new;
        assert_eq!(
            refused(request(Method::TRACE, "http://api.test/login", none())),
            (None, 405)
        );
        assert_eq!(
            refused(request(Method::CONNECT, "http://api.test/login", none())),
            (None, 405)
        );
        let long = format!("http://api.test/login/{}", "a".repeat(MAX_TARGET));
        assert_eq!(refused(request(Method::GET, &long, none())), (None, 414));
        assert_eq!(
            refused(request(Method::GET, "/login", none())),
            (None, 400),
            "HTTP/1.1 without a host"
        );
        let mut twice = HeaderMap::new();
        twice.append("x-api-key", "a".parse().expect("v"));
        twice.append("x-api-key", "b".parse().expect("v"));
        assert_eq!(
            refused(request(Method::GET, "http://api.test/login", twice)),
            (Some(0), 400)
        );
        let mut big = request(Method::POST, "http://api.test/login", none());
        *big.body_mut() = "x".repeat(2048);
        assert_eq!(refused(big), (Some(0), 413));
    }

    #[test]
    fn an_http10_request_without_a_host_is_routed_on_the_path_alone() {
        let mut req = request(Method::GET, "/login", HeaderMap::new());
        *req.version_mut() = Version::HTTP_10;
        let (plan, _) = plan_of(&mut req).expect("plans");
        assert!(plan.authority.is_none());
        assert_eq!(plan.route, Some(0));
    }
}
