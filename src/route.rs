//! Routing: host + normalised path + method -> the first matching route, in file order
//! (contract §2). Host patterns are exact or `*.suffix` (any depth of subdomain, never the
//! bare domain), case-insensitive, port ignored; path prefixes match on segment boundaries
//! (`/a` matches `/a`, `/a/`, `/a/b`, never `/ab`).
//!
//! The path matched is [`normalise::routing_path`]: path parameters do not move a request to
//! another route (contract §4a). A request without a host (HTTP/1.0 may send none) matches only
//! routes without `host`.

use http::Method;

use crate::config::{HostPattern, RouteConfig};
use crate::normalise;

/// Whether `path` (normalised) lies under `prefix` (normalised, no trailing `/` unless root).
pub fn path_matches(prefix: &str, path: &str) -> bool {
    if prefix == "/" {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// `host` is lowercased and has no port nor trailing dot ([`normalise::host_without_port`]).
pub fn host_matches(pattern: &HostPattern, host: &str) -> bool {
    match pattern {
        HostPattern::Exact(exact) => exact == host,
        // The stored suffix starts with '.', so the bare domain never matches.
        HostPattern::Suffix(suffix) => host.len() > suffix.len() && host.ends_with(suffix.as_str()),
    }
}

/// Index of the first route matching the request, if any. `path` is the routing path
/// ([`normalise::routing_path`]); `host` is `None` for a request that named none.
pub fn find(
    routes: &[RouteConfig],
    host: Option<&str>,
    path: &str,
    method: &Method,
) -> Option<usize> {
    routes.iter().position(|route| {
        route
            .host
            .as_ref()
            .is_none_or(|pattern| host.is_some_and(|host| host_matches(pattern, host)))
            && path_matches(&route.path_prefix, path)
            && route
                .methods
                .as_ref()
                .is_none_or(|methods| method_listed(methods, method))
    })
}

/// Whether `methods` covers `method`. `GET` covers `HEAD`: backends answer HEAD with their GET
/// handler (Express, Flask, Django, Rails, Spring, Go), so a GET limit that HEAD escaped would
/// leave the same work unlimited (nginx's `limit_except GET` covers HEAD for this reason).
fn method_listed(methods: &[Method], method: &Method) -> bool {
    methods.contains(method) || (method == Method::HEAD && methods.contains(&Method::GET))
}

/// The path sent upstream when the route strips its prefix (`/api` itself becomes `/`).
///
/// `path` is the normalised path (parameters kept) of a request whose routing path matched
/// `prefix`: the prefix's segments are removed with their parameters (`/api;v=1/x` becomes
/// `/x`), and so are segments of parameters only before them, which routing skipped too.
pub fn strip(prefix: &str, path: &str) -> String {
    if prefix == "/" {
        return path.to_string();
    }
    let mut wanted = prefix.split('/').filter(|s| !s.is_empty()).count();
    let mut rest = path;
    while wanted > 0 {
        let Some(after_slash) = rest.strip_prefix('/') else {
            break;
        };
        let end = after_slash.find('/').unwrap_or(after_slash.len());
        if !normalise::segment_name(&after_slash[..end]).is_empty() {
            wanted -= 1;
        }
        rest = &after_slash[end..];
    }
    if rest.is_empty() {
        "/".to_string()
    } else {
        rest.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_boundaries() {
        assert!(path_matches("/a", "/a"));
        assert!(path_matches("/a", "/a/"));
        assert!(path_matches("/a", "/a/b"));
        assert!(!path_matches("/a", "/ab"));
        assert!(path_matches("/", "/anything"));
    }

    #[test]
    fn host_patterns() {
        let wild = HostPattern::Suffix(".example.com".into());
        assert!(host_matches(&wild, "a.example.com"));
        assert!(host_matches(&wild, "a.b.example.com"));
        assert!(!host_matches(&wild, "example.com"));
        assert!(!host_matches(&wild, "badexample.com"));
        assert!(host_matches(&HostPattern::Exact("x.io".into()), "x.io"));
    }

    #[test]
    fn stripping() {
        assert_eq!(strip("/api", "/api"), "/");
        assert_eq!(strip("/api", "/api/"), "/");
        assert_eq!(strip("/api", "/api/v1"), "/v1");
        assert_eq!(strip("/", "/v1"), "/v1");
        assert_eq!(strip("/a/b", "/a/b/c/d"), "/c/d");
    }

    #[test]
    fn stripping_takes_the_parameters_of_the_matched_segments() {
        assert_eq!(strip("/api", "/api;v=1"), "/");
        assert_eq!(strip("/api", "/api;v=1/x;y"), "/x;y");
        assert_eq!(strip("/api", "/;s=1/api/x"), "/x");
        assert_eq!(strip("/a/b", "/a;1/;2/b;3/c"), "/c");
        assert_eq!(strip("/api", "/api%3Bv/x"), "/x");
        assert_eq!(strip("/api", "/api/;p/x"), "/;p/x");
    }

    #[test]
    fn no_host_matches_only_routes_without_one() {
        // Built by the loader, so the test needs no update when routes gain a field.
        let text = "[upstreams.u]\nurl = \"http://127.0.0.1:9\"\n\
            [[routes]]\nname = \"hosted\"\nhost = \"a.example\"\nupstream = \"u\"\n\
            [[routes]]\nname = \"wild\"\nhost = \"*.example\"\nupstream = \"u\"\n\
            [[routes]]\nname = \"any\"\npath_prefix = \"/x\"\nupstream = \"u\"\n";
        let config = crate::config::load_str(std::path::Path::new("t.toml"), text, &|_| None)
            .expect("test configuration");
        let routes = config.routes;
        let get = Method::GET;
        assert_eq!(find(&routes, Some("a.example"), "/x", &get), Some(0));
        assert_eq!(find(&routes, Some("b.example"), "/x", &get), Some(1));
        assert_eq!(find(&routes, None, "/x", &get), Some(2));
        assert_eq!(find(&routes, None, "/y", &get), None);
    }
}
