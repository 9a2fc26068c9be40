//! Header rewriting, as pure functions over `HeaderMap`s (SPEC section 5).
//!
//! - Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection and are removed in both
//!   directions: `Connection` and every header it names, plus the fixed list below. `TE:
//!   trailers` survives because gRPC needs it end to end.
//! - `X-Forwarded-For/Proto/Host` tell the upstream who the client was.
//! - `RateLimit-Policy`/`RateLimit` (draft-ietf-httpapi-ratelimit-headers, structured-field
//!   lists) and the legacy `X-RateLimit-*` trio tell the client where it stands.

use std::net::IpAddr;

use http::header::{self, HeaderName, HeaderValue};
use http::HeaderMap;

use crate::config::RateLimitHeaders;
use crate::limit::LimitOutcome;

/// As `HeaderName`s, so removing them needs no parsing of a string per request.
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Splits a comma-separated header into trimmed, lowercased tokens.
fn tokens(headers: &HeaderMap, name: &HeaderName) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Whether this is an HTTP/1.1 upgrade request (`Connection: upgrade` plus `Upgrade`).
pub fn is_upgrade_request(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && tokens(headers, &header::CONNECTION)
            .iter()
            .any(|t| t == "upgrade")
}

/// Whether the request says it accepts trailers (`TE: trailers`).
pub fn accepts_trailers(headers: &HeaderMap) -> bool {
    tokens(headers, &header::TE)
        .iter()
        .any(|t| t.split(';').next().map(str::trim) == Some("trailers"))
}

/// Removes every hop-by-hop header. Keeps `TE: trailers` when the sender offered it.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let wants_trailers = accepts_trailers(headers);
    for named in tokens(headers, &header::CONNECTION) {
        if let Ok(name) = HeaderName::from_bytes(named.as_bytes()) {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    if wants_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// What the upstream learns about the client.
pub struct ForwardedFor<'a> {
    /// The TCP peer.
    pub peer: IpAddr,
    /// Whether the peer is a trusted proxy whose own `X-Forwarded-*` are believed.
    pub peer_trusted: bool,
    /// `http` or `https`: how the client reached tollgate.
    pub proto: &'static str,
    /// The authority the client asked for.
    pub host: &'a str,
}

/// Appends the peer to `X-Forwarded-For`; sets `X-Forwarded-Proto` and `X-Forwarded-Host`,
/// keeping the client's own values only when the peer is trusted.
pub fn add_forwarded(headers: &mut HeaderMap, fwd: &ForwardedFor<'_>) {
    let peer = crate::key::canonical(fwd.peer).to_string();
    let xff = HeaderName::from_static("x-forwarded-for");
    let previous: Vec<String> = headers
        .get_all(&xff)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    let value = if previous.is_empty() {
        peer
    } else {
        format!("{}, {}", previous.join(", "), peer)
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(xff, value);
    }
    let proto = HeaderName::from_static("x-forwarded-proto");
    if !(fwd.peer_trusted && headers.contains_key(&proto)) {
        headers.insert(proto, HeaderValue::from_static(fwd.proto));
    }
    let host = HeaderName::from_static("x-forwarded-host");
    if !(fwd.peer_trusted && headers.contains_key(&host)) {
        if let Ok(value) = HeaderValue::from_str(fwd.host) {
            headers.insert(host, value);
        }
    }
}

/// HTTP/2 may split `cookie` into several fields; HTTP/1.1 wants one, joined by `; `
/// (RFC 9113 8.2.3).
pub fn join_cookies(headers: &mut HeaderMap) {
    let values: Vec<HeaderValue> = headers.get_all(header::COOKIE).iter().cloned().collect();
    if values.len() < 2 {
        return;
    }
    let mut joined = Vec::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// Adds the rate-limit fields for the applicable non-shadow limits.
pub fn add_rate_limit_headers(
    headers: &mut HeaderMap,
    mode: RateLimitHeaders,
    outcomes: &[LimitOutcome],
) {
    let visible: Vec<&LimitOutcome> = outcomes.iter().filter(|o| !o.shadow).collect();
    if visible.is_empty() {
        return;
    }
    if matches!(mode, RateLimitHeaders::Draft | RateLimitHeaders::Both) {
        let policy = join(
            visible
                .iter()
                .map(|o| format!("\"{}\";q={};w={}", o.policy, o.requests, o.window_secs)),
        );
        let state = join(
            visible
                .iter()
                .map(|o| format!("\"{}\";r={};t={}", o.policy, o.remaining(), o.reset_secs)),
        );
        insert(headers, "ratelimit-policy", &policy);
        insert(headers, "ratelimit", &state);
    }
    if matches!(mode, RateLimitHeaders::Legacy | RateLimitHeaders::Both) {
        // The most restrictive: fewest requests left, then the longest wait.
        if let Some(o) = visible
            .iter()
            .min_by_key(|o| (o.remaining(), std::cmp::Reverse(o.reset_secs)))
        {
            insert(headers, "x-ratelimit-limit", &o.requests.to_string());
            insert(headers, "x-ratelimit-remaining", &o.remaining().to_string());
            insert(headers, "x-ratelimit-reset", &o.reset_secs.to_string());
        }
    }
}

fn join(items: impl Iterator<Item = String>) -> String {
    items.collect::<Vec<_>>().join(", ")
}

fn insert(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        headers.insert(HeaderName::from_static(name), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, x-secret-hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers, deflate".parse().unwrap());
        h.insert("transfer-encoding", "chunked".parse().unwrap());
        h.insert("x-end-to-end", "yes".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert!(h.get("x-secret-hop").is_none());
        assert!(h.get("keep-alive").is_none());
        assert!(h.get("transfer-encoding").is_none());
        assert_eq!(h.get("te").unwrap(), "trailers");
        assert_eq!(h.get("x-end-to-end").unwrap(), "yes");
    }

    #[test]
    fn forwarded_for_appends() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "198.51.100.1".parse().unwrap());
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        add_forwarded(
            &mut h,
            &ForwardedFor {
                peer: "192.0.2.9".parse().unwrap(),
                peer_trusted: false,
                proto: "http",
                host: "api.example",
            },
        );
        assert_eq!(h.get("x-forwarded-for").unwrap(), "198.51.100.1, 192.0.2.9");
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "http");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "api.example");
    }
}
