//! Fuzzing of request normalisation (src/normalise.rs): the path and the `Host` a route is
//! chosen by, and that go upstream.
//!
//! For any input: no panic; a normalised path starts with `/`, has no empty, `.` or `..`
//! segment but a trailing one, no encoded `/` or NUL, and normalising it again changes
//! nothing (one spelling: a second pass that changed it would mean the router and the
//! upstream could see different paths). The routing form (path parameters cut off) starts
//! with `/`, has no `;`, is its own routing form, and whatever prefix it matches, stripping
//! that prefix from the upstream path leaves a path. An accepted authority is lower case, has
//! no trailing dot and a numeric port if any, its host part is a prefix of it, and it is
//! accepted again as it is.
#![no_main]

use http::header::{HeaderMap, HeaderValue, HOST};
use http::Uri;
use libfuzzer_sys::fuzz_target;
use tollgate::testing::normalise::{host_without_port, normalise_path, request_authority, routing_path};
use tollgate::testing::route;

fn check_path(raw: &str) {
    let Ok(path) = normalise_path(raw) else {
        return;
    };
    assert!(path.starts_with('/'), "{raw:?} -> {path:?}");
    let inner = path.strip_suffix('/').unwrap_or(&path);
    for segment in inner.split('/').skip(1) {
        assert!(
            !segment.is_empty() && segment != "." && segment != "..",
            "{raw:?} -> {path:?}"
        );
    }
    let upper = path.to_ascii_uppercase();
    assert!(
        !upper.contains("%2F") && !upper.contains("%00"),
        "{raw:?} -> {path:?}"
    );
    assert_eq!(
        normalise_path(&path).as_deref(),
        Ok(path.as_str()),
        "not idempotent: {raw:?}"
    );
    check_routing(&path);
}

fn check_routing(path: &str) {
    let routed = routing_path(path);
    assert!(routed.starts_with('/'), "{path:?} routes as {routed:?}");
    assert!(!routed.contains(';'), "{path:?} routes as {routed:?}");
    assert_eq!(routing_path(&routed), routed, "routing form of {path:?}");
    // Every prefix of the routing form that a route could have, stripped from the path that
    // goes upstream, leaves a path.
    let mut ends: Vec<usize> = routed.match_indices('/').map(|(i, _)| i).collect();
    ends.push(routed.len());
    for end in ends.into_iter().filter(|&e| e > 0) {
        let prefix = routed[..end].trim_end_matches('/');
        let prefix = if prefix.is_empty() { "/" } else { prefix };
        if route::path_matches(prefix, &routed) {
            let stripped = route::strip(prefix, path);
            assert!(
                stripped.starts_with('/'),
                "strip {prefix:?} from {path:?}: {stripped:?}"
            );
            // The upstream path, stripped, routes as the routing form stripped: the upstream
            // is sent exactly the rest of what was matched.
            assert_eq!(
                routing_path(&stripped),
                route::strip(prefix, &routed),
                "strip {prefix:?} from {path:?}"
            );
        }
    }
}

fn authority_of(host: HeaderValue) -> Option<String> {
    let mut headers = HeaderMap::new();
    headers.insert(HOST, host);
    request_authority(&Uri::from_static("/"), &headers)
        .ok()
        .map(|a| a.as_str().to_owned())
}

fn check_host(raw: &[u8]) {
    let Ok(value) = HeaderValue::from_bytes(raw) else {
        return;
    };
    let Some(authority) = authority_of(value) else {
        return;
    };
    assert_eq!(authority, authority.to_ascii_lowercase());
    let host = host_without_port(&authority);
    assert!(authority.starts_with(host));
    assert!(!host.ends_with('.'), "{authority:?} keeps a trailing dot");
    if let Some(port) = authority[host.len()..].strip_prefix(':') {
        assert!(port.parse::<u16>().is_ok(), "{authority:?} has a bad port");
    }
    let again = HeaderValue::from_str(&authority).expect("an authority is a valid field value");
    assert_eq!(
        authority_of(again).as_deref(),
        Some(authority.as_str()),
        "an accepted authority is not accepted again"
    );
}

fuzz_target!(|data: &[u8]| {
    // Layout: [split][path bytes...][host bytes...]
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let (path, host) = rest.split_at(usize::from(split).min(rest.len()));
    if let Ok(path) = std::str::from_utf8(path) {
        check_path(path);
    }
    check_host(host);
});
