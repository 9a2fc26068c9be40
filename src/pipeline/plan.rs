//! Which route a request matches, which of its limits apply, and which bucket each would
//! increment (contract §2 and §3): the one answer that the proxy, `tollgate explain` and
//! `tollgate reset` share, so what an operator is shown or resets is what the proxy counts.
//!
//! The proxy runs the steps one by one (it answers each failure differently and keeps what
//! it computed for forwarding) and calls [`planned_limit`] for the buckets; the commands call
//! [`plan_request`], which runs the same steps in the same order: normalise the authority and
//! path, route on the host and the path without parameters, refuse keyed headers the upstream
//! could read differently, attribute the client address, then [`planned_limit`].

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, Method, Uri};

use crate::config::{Config, LimitConfig, RouteConfig};
use crate::key::{self, BucketHasher, RequestIdentity};
use crate::limit::PlannedLimit;
use crate::normalise::{self, NormaliseError};
use crate::route;

/// What this request would count in `limit` (one of `route`'s, named `policy`, its
/// `<scope>:<label>`): its bucket and quota, or `None` when the limit does not apply (a keyed
/// header is missing).
pub fn planned_limit(
    route: &RouteConfig,
    limit: &LimitConfig,
    policy: &Arc<str>,
    who: &RequestIdentity<'_>,
    hasher: &BucketHasher,
) -> Option<PlannedLimit> {
    key::bucket_in(policy, &limit.key, who, hasher).map(|bucket| PlannedLimit {
        policy: policy.clone(),
        bucket,
        requests: limit.requests,
        window_secs: limit.window_secs,
        shadow: limit.shadow || route.shadow,
        sliding: limit.algorithm == crate::config::Algorithm::Sliding,
    })
}

/// A request as the proxy would see it, for the commands.
#[derive(Debug)]
pub struct RequestPlan<'c> {
    /// The normalised authority (`host[:port]`).
    pub authority: String,
    /// The normalised path.
    pub path: String,
    /// The address the request counts as (after `trusted_proxies`).
    pub client: IpAddr,
    /// The route it matches, if any, with its index in the configuration.
    pub route: Option<(usize, &'c RouteConfig)>,
    /// Each limit of that route, with what the request would count in it.
    pub limits: Vec<(&'c LimitConfig, Option<PlannedLimit>)>,
}

impl RequestPlan<'_> {
    /// The limits that apply, with their buckets.
    pub fn planned(&self) -> impl Iterator<Item = &PlannedLimit> {
        self.limits
            .iter()
            .filter_map(|(_, planned)| planned.as_ref())
    }
}

/// Why a request would not get as far as the limiter (the proxy answers 400).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Normalise(NormaliseError),
    #[error("{0}")]
    KeyedHeader(&'static str),
}

/// What the proxy would do with `method uri` from `peer` carrying `headers`, up to the
/// limiter: see the module docs.
pub fn plan_request<'c>(
    config: &'c Config,
    hasher: &BucketHasher,
    peer: IpAddr,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<RequestPlan<'c>, PlanError> {
    let authority = normalise::request_authority(uri, headers).map_err(PlanError::Normalise)?;
    let path = normalise::normalise_path(uri.path()).map_err(PlanError::Normalise)?;
    let host = normalise::host_without_port(authority.as_str());
    let routing_path = normalise::routing_path(&path);
    let client = key::client_addr(peer, headers, &config.server.trusted_proxies);
    let mut plan = RequestPlan {
        authority: authority.as_str().to_owned(),
        path: path.clone(),
        client,
        route: None,
        limits: Vec::new(),
    };
    let Some(index) = route::find(&config.routes, Some(host), &routing_path, method) else {
        return Ok(plan);
    };
    let route = &config.routes[index];
    plan.route = Some((index, route));
    let keyed = key::keyed_headers(&route.limits);
    if let Some(why) =
        key::keyed_header_problem(headers, &keyed, config.server.underscores_in_headers)
    {
        return Err(PlanError::KeyedHeader(why));
    }
    let who = RequestIdentity {
        client,
        ipv6_prefix: config.server.ipv6_prefix,
        headers,
        ip_buckets: None,
    };
    let policies: Vec<Arc<str>> = route
        .limits
        .iter()
        .map(|l| Arc::from(l.policy_name()))
        .collect();
    plan.limits = route
        .limits
        .iter()
        .zip(&policies)
        .map(|(limit, policy)| (limit, planned_limit(route, limit, policy, &who, hasher)))
        .collect();
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_commands_and_the_proxy_see_the_same_buckets() {
        let text = "[keys]\nsecret = \"s\"\n[upstreams.a]\nurl = \"http://127.0.0.1:9\"\n\
                    [[routes]]\nname = \"login\"\npath_prefix = \"/login\"\nupstream = \"a\"\n\
                    [[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"\n\
                    [[routes.limits]]\nkey = \"header:x-api-key\"\nrequests = 2\nwindow = \"1m\"\n";
        let config = crate::config::load_str(Path::new("t.toml"), text, &|_| None).expect("ok");
        let hasher = BucketHasher::new(config.keys.secret.as_deref());
        let uri: Uri = "http://api.test/login;x=1/a".parse().expect("uri");
        let ip: IpAddr = "192.0.2.7".parse().expect("ip");
        let plan = plan_request(&config, &hasher, ip, &Method::GET, &uri, &HeaderMap::new())
            .expect("plans");
        assert_eq!(plan.route.map(|(i, _)| i), Some(0));
        let buckets: Vec<&str> = plan.planned().map(|p| &*p.bucket).collect();
        assert_eq!(buckets.len(), 1, "the header limit does not apply");
        assert!(buckets[0].starts_with("login:ip:"), "{buckets:?}");
        assert!(!buckets[0].contains("192.0.2.7"));
        assert_eq!(
            Some(buckets[0]),
            key::bucket_for(
                "login",
                &config.routes[0].limits[0].key,
                &RequestIdentity {
                    client: ip,
                    ipv6_prefix: 64,
                    headers: &HeaderMap::new(),
                    ip_buckets: None,
                },
                &hasher
            )
            .as_deref()
        );
        let mut twice = HeaderMap::new();
        twice.append("x-api-key", "a".parse().expect("v"));
        twice.append("x-api-key", "b".parse().expect("v"));
        assert!(matches!(
            plan_request(&config, &hasher, ip, &Method::GET, &uri, &twice),
            Err(PlanError::KeyedHeader(_))
        ));
        let elsewhere: Uri = "http://api.test/other".parse().expect("uri");
        let plan = plan_request(
            &config,
            &hasher,
            ip,
            &Method::GET,
            &elsewhere,
            &HeaderMap::new(),
        )
        .expect("plans");
        assert!(plan.route.is_none());
    }
}
