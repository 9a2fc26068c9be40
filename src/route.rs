//! Routing: host + normalised path + method -> the first matching route, in file order
//! (SPEC section 2). Host patterns are exact or `*.suffix` (any depth of subdomain, never the
//! bare domain), case-insensitive, port ignored; path prefixes match on segment boundaries
//! (`/a` matches `/a`, `/a/`, `/a/b`, never `/ab`).

use http::Method;

use crate::config::{HostPattern, RouteConfig};

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

/// `host` is lowercased and has no port.
pub fn host_matches(pattern: &HostPattern, host: &str) -> bool {
    match pattern {
        HostPattern::Exact(exact) => exact == host,
        // The stored suffix starts with '.', so the bare domain never matches.
        HostPattern::Suffix(suffix) => host.len() > suffix.len() && host.ends_with(suffix.as_str()),
    }
}

/// Index of the first route matching the request, if any.
pub fn find(routes: &[RouteConfig], host: &str, path: &str, method: &Method) -> Option<usize> {
    routes.iter().position(|route| {
        route
            .host
            .as_ref()
            .is_none_or(|pattern| host_matches(pattern, host))
            && path_matches(&route.path_prefix, path)
            && route
                .methods
                .as_ref()
                .is_none_or(|methods| methods.contains(method))
    })
}

/// The path sent upstream when the route strips its prefix (`/api` itself becomes `/`).
pub fn strip(prefix: &str, path: &str) -> String {
    if prefix == "/" {
        return path.to_string();
    }
    match path.strip_prefix(prefix) {
        Some("") => "/".to_string(),
        Some(rest) => rest.to_string(),
        None => path.to_string(),
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
        assert_eq!(strip("/api", "/api/v1"), "/v1");
        assert_eq!(strip("/", "/v1"), "/v1");
    }
}
