//! Request normalisation (contract §4a): one spelling per path and exactly one host, so that
//! a client cannot reach a limited route under another spelling and the upstream sees what the
//! router saw.
//!
//! Path rules, in order: percent-encoded unreserved characters are decoded (RFC 3986 6.2.2.2)
//! and the remaining escapes upper-cased (6.2.2.1); an encoded `/` or NUL is refused (it would
//! let a client smuggle a segment boundary past the router); runs of `/` are merged (as nginx's
//! `merge_slashes`, since most backends treat `//` as `/`); dot segments are removed
//! (5.2.4), and a path that would climb above the root is refused.
//!
//! Path parameters (`;` and what follows it in a segment, as Tomcat, Jetty and Spring read
//! them) stay in the path sent upstream but not in the path routes match: [`routing_path`]
//! removes them, so `/login;jsessionid=1` is `/login` to the router, as it is to those
//! backends. A dot segment with parameters (`..;`) is refused: Tomcat climbs a level for it and
//! most other backends take it as a name, so no single reading is safe.
//!
//! Host rules (RFC 3986 3.2.2, RFC 9110 7.2): the authority is `host[:port]` with `host` a
//! bracketed IPv6 literal or dot-separated labels of letters, digits, `-` and `_` (what a
//! route's `host` may name), and the port digits only; anything else (a list, a bracketed name,
//! empty labels) is refused. It is lower-cased, an IPv6 literal written in RFC 5952 form, and
//! one trailing dot removed (`api.example.com.` is the same fully qualified name, and nginx
//! treats it so): the router and the upstream see one spelling.

use std::borrow::Cow;
use std::net::Ipv6Addr;

use http::{HeaderMap, HeaderValue, Uri, Version};

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NormaliseError {
    #[error("path does not start with /")]
    NotOriginForm,
    #[error("malformed percent-encoding in path")]
    BadEscape,
    #[error("encoded / or NUL in path")]
    EncodedSeparator,
    #[error("path escapes the root")]
    EscapesRoot,
    #[error("dot segment with parameters in path")]
    DotSegmentWithParameters,
    #[error("missing Host")]
    MissingHost,
    #[error("several Host headers")]
    DuplicateHost,
    #[error("Host disagrees with the request target's authority")]
    HostMismatch,
    #[error("malformed Host")]
    BadHost,
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The normalised form of a request path (without its query).
pub fn normalise_path(raw: &str) -> Result<String, NormaliseError> {
    let bytes = raw.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err(NormaliseError::NotOriginForm);
    }
    // Most paths are already in normal form: copy them once and skip the rewriting below.
    if is_already_normal(raw) {
        return Ok(raw.to_owned());
    }
    // Step 1: escapes.
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hi = bytes.get(i + 1).copied().and_then(hex_value);
            let lo = bytes.get(i + 2).copied().and_then(hex_value);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(NormaliseError::BadEscape);
            };
            let value = hi * 16 + lo;
            if value == b'/' || value == 0 {
                return Err(NormaliseError::EncodedSeparator);
            }
            if is_unreserved(value) {
                decoded.push(value);
            } else {
                decoded.push(b'%');
                decoded.extend_from_slice(format!("{value:02X}").as_bytes());
            }
            i += 3;
        } else {
            decoded.push(b);
            i += 1;
        }
    }
    // Step 2: segments. Splitting on '/' and dropping empty segments merges slashes; a trailing
    // slash is significant to many backends and is kept.
    let text = String::from_utf8(decoded).map_err(|_| NormaliseError::BadEscape)?;
    let trailing_slash = text.ends_with('/') || text.ends_with("/.") || text.ends_with("/..");
    let mut segments: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                if segments.pop().is_none() {
                    return Err(NormaliseError::EscapesRoot);
                }
            }
            s if is_dot_segment(segment_name(s)) => {
                return Err(NormaliseError::DotSegmentWithParameters)
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(text.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(out)
}

/// No escapes, no empty segment but a trailing one, no dot segments (with parameters or
/// without): what the rewriting in [`normalise_path`] would return unchanged (or refuse).
fn is_already_normal(path: &str) -> bool {
    if path.contains('%') {
        return false;
    }
    let mut segments = path[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        if (segment.is_empty() && !last) || is_dot_segment(segment_name(segment)) {
            return false;
        }
    }
    true
}

fn is_dot_segment(name: &str) -> bool {
    name == "." || name == ".."
}

/// A path segment without its parameters: what comes before its first `;`, encoded (`%3B`) or
/// not. The encoded form counts too because some backends decode before they cut parameters;
/// matching `/login%3Bx` as `/login` can only put a request under more limits, never fewer.
pub fn segment_name(segment: &str) -> &str {
    let bytes = segment.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        let encoded_semicolon = b == b'%'
            && bytes.get(i + 1) == Some(&b'3')
            && matches!(bytes.get(i + 2), Some(b'b' | b'B'));
        if b == b';' || encoded_semicolon {
            return &segment[..i];
        }
    }
    segment
}

/// The path routes match: the normalised `path` with every segment's parameters removed, and
/// the segments that were parameters only (`/;jsessionid=1/login`) dropped, as the slashes
/// they leave are merged. Borrowed when the path has no parameters, as nearly every one.
pub fn routing_path(path: &str) -> Cow<'_, str> {
    if !path.bytes().any(|b| b == b';' || b == b'%') {
        return Cow::Borrowed(path);
    }
    let rest = path.strip_prefix('/').unwrap_or(path);
    let mut out = String::with_capacity(path.len());
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        let name = segment_name(segment);
        let last = segments.peek().is_none();
        if !name.is_empty() {
            out.push('/');
            out.push_str(name);
        } else if last && !out.is_empty() {
            // `/a/` and `/a/;x` keep their trailing slash.
            out.push('/');
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    if out == path {
        return Cow::Borrowed(path);
    }
    Cow::Owned(out)
}

/// The request's one authority (`host[:port]`, normalised as the module docs say), from `Host`
/// or the request target.
///
/// HTTP/1.1 requires exactly one `Host`; a request whose absolute-form target or HTTP/2
/// `:authority` names another host than its `Host` header is ambiguous and refused, because the
/// router and the upstream could each believe a different one. Both are compared after
/// normalisation, so `http://a.example./` with `Host: a.example` is one host.
pub fn request_authority(uri: &Uri, headers: &HeaderMap) -> Result<Authority, NormaliseError> {
    let mut hosts = headers.get_all(http::header::HOST).iter();
    let host_header = hosts.next();
    if hosts.next().is_some() {
        return Err(NormaliseError::DuplicateHost);
    }
    // Nearly every request names its host in normal form already: then it is only checked,
    // in one pass, and the field itself is kept (its bytes shared, not copied).
    let header_value = match host_header {
        Some(v) if is_normal_name_authority(v.as_bytes()) => Some(Authority(v.clone())),
        Some(v) => Some(Authority::owned(normalise_authority(v.as_bytes())?)?),
        None => None,
    };
    // The target's authority is only compared with `Host` when both are given; it becomes a
    // field value (a copy) only when it is the one sent.
    let target = match uri.authority() {
        Some(a) if is_normal_name_authority(a.as_str().as_bytes()) => {
            Some(Cow::Borrowed(a.as_str()))
        }
        Some(a) => Some(Cow::Owned(normalise_authority(a.as_str().as_bytes())?)),
        None => None,
    };
    match (target, header_value) {
        (Some(t), Some(h)) if t != h.as_str() => Err(NormaliseError::HostMismatch),
        (_, Some(h)) => Ok(h),
        (Some(t), None) => Authority::owned(t.into_owned()),
        (None, None) => Err(NormaliseError::MissingHost),
    }
}

/// A request's authority (`host[:port]`) in normal form, kept as the field value it goes
/// upstream as (`X-Forwarded-Host`, and `Host` with `preserve_host`). When the client's `Host`
/// already spells it, as nearly every one does, this is that field: nothing is copied, parsed
/// again or allocated for it. Its text is ASCII: normal form allows nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authority(HeaderValue);

impl Authority {
    /// From text in normal form, which is always a valid field value.
    fn owned(normal: String) -> Result<Self, NormaliseError> {
        HeaderValue::from_maybe_shared(bytes::Bytes::from(normal))
            .map(Authority)
            .map_err(|_| NormaliseError::BadHost)
    }

    pub fn as_str(&self) -> &str {
        // ASCII, see above: never the empty fallback.
        std::str::from_utf8(self.0.as_bytes()).unwrap_or_default()
    }

    /// The field value to send.
    pub fn value(&self) -> &HeaderValue {
        &self.0
    }
}

/// Whether `raw` is a `name[:port]` already in the form [`normalise_authority`] gives: labels
/// of lower-case letters, digits, `-` and `_`, none empty, no trailing dot, no padding, and a
/// port of 1 to 5 digits up to 65535. (IPv6 literals always take the long way.)
fn is_normal_name_authority(raw: &[u8]) -> bool {
    let mut label_len = 0usize;
    for (i, &b) in raw.iter().enumerate() {
        match AUTHORITY_BYTES[usize::from(b)] {
            LABEL => label_len += 1,
            DOT if label_len > 0 => label_len = 0,
            // Only after a label: not an empty host, nor one ending in a dot.
            COLON if label_len > 0 => return is_port(&raw[i + 1..]),
            _ => return false,
        }
    }
    label_len > 0
}

/// 1 to 5 digits, up to 65535 (equal-length digit strings compare as their numbers do).
fn is_port(digits: &[u8]) -> bool {
    !digits.is_empty()
        && digits.len() <= 5
        && digits.iter().all(u8::is_ascii_digit)
        && (digits.len() < 5 || digits <= b"65535".as_slice())
}

/// What each byte is to [`is_normal_name_authority`], one look-up per byte in one pass: part
/// of a label (lower-case letter, digit, `-`, `_`), a dot, the port's colon, or anything else.
const LABEL: u8 = 1;
const DOT: u8 = 2;
const COLON: u8 = 3;
static AUTHORITY_BYTES: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < table.len() {
        table[b] = match b as u8 {
            b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' => LABEL,
            b'.' => DOT,
            b':' => COLON,
            _ => 0,
        };
        b += 1;
    }
    table
};

/// [`request_authority`] for a request of `version`: an HTTP/1.0 request may carry no host at
/// all (HTTP/1.0 has no `Host`; load balancers' health checks send none), and then has `None`,
/// which only routes without a `host` match. From HTTP/1.1 on a missing host stays an error.
pub fn request_authority_of(
    version: Version,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Option<Authority>, NormaliseError> {
    match request_authority(uri, headers) {
        Ok(authority) => Ok(Some(authority)),
        Err(NormaliseError::MissingHost) if version < Version::HTTP_11 => Ok(None),
        Err(e) => Err(e),
    }
}

/// One `host[:port]` in normal form (see the module docs), or `BadHost`.
fn normalise_authority(raw: &[u8]) -> Result<String, NormaliseError> {
    let raw = raw.trim_ascii();
    let (host, port) = if let Some(literal) = raw.strip_prefix(b"[") {
        let end = literal
            .iter()
            .position(|&b| b == b']')
            .ok_or(NormaliseError::BadHost)?;
        (&raw[..end + 2], &literal[end + 1..])
    } else {
        match raw.iter().position(|&b| b == b':') {
            Some(colon) => (&raw[..colon], &raw[colon..]),
            None => (raw, &raw[raw.len()..]),
        }
    };
    let mut out = String::with_capacity(raw.len());
    if let Some(literal) = host.strip_prefix(b"[") {
        let inner = &literal[..literal.len() - 1];
        // Only IPv6 literals go in brackets (RFC 3986 3.2.2; IPvFuture has no use here).
        let addr = std::str::from_utf8(inner)
            .ok()
            .and_then(|text| text.parse::<Ipv6Addr>().ok())
            .ok_or(NormaliseError::BadHost)?;
        out.push('[');
        out.push_str(&addr.to_string());
        out.push(']');
    } else {
        let name = host.strip_suffix(b".").unwrap_or(host);
        if name.is_empty() {
            return Err(NormaliseError::BadHost);
        }
        for label in name.split(|&b| b == b'.') {
            let label_ok = !label.is_empty()
                && label
                    .iter()
                    .all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !label_ok {
                return Err(NormaliseError::BadHost);
            }
        }
        out.extend(name.iter().map(|&b| char::from(b.to_ascii_lowercase())));
    }
    if let Some(digits) = port.strip_prefix(b":") {
        let valid = !digits.is_empty()
            && digits.len() <= 5
            && digits.iter().all(u8::is_ascii_digit)
            && std::str::from_utf8(digits)
                .ok()
                .and_then(|d| d.parse::<u16>().ok())
                .is_some();
        if !valid {
            return Err(NormaliseError::BadHost);
        }
        out.push(':');
        out.extend(digits.iter().map(|&b| char::from(b)));
    } else if !port.is_empty() {
        // Something after `]` that is no port.
        return Err(NormaliseError::BadHost);
    }
    Ok(out)
}

/// The host part of an authority, without its port and without one trailing dot: what routes
/// match. (An authority from [`request_authority`] has no trailing dot already; one from
/// elsewhere gets the same spelling here.)
pub fn host_without_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        // "[::1]:8080" -> "[::1]"
        return match authority.find(']') {
            Some(end) => &authority[..end + 1],
            None => authority,
        };
    }
    let host = match authority.rfind(':') {
        Some(idx) => &authority[..idx],
        None => authority,
    };
    host.strip_suffix('.').unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_host_check_accepts_only_what_the_long_way_leaves_unchanged() {
        let cases: &[&[u8]] = &[
            b"api.example.com",
            b"api.example.com:8080",
            b"a_b.c-d.e",
            b"x:65535",
            b"x:65536",
            b"x:99999",
            b"x:0",
            b"x:",
            b"API.example.com",
            b"api.example.com.",
            b"a..b",
            b".a",
            b"",
            b" a",
            b"a:1:2",
            b"[::1]:80",
            b"127.0.0.1:8080",
        ];
        for raw in cases {
            let long_way = normalise_authority(raw);
            if is_normal_name_authority(raw) {
                assert_eq!(
                    long_way.as_deref().map(str::as_bytes),
                    Ok(*raw),
                    "{}",
                    String::from_utf8_lossy(raw)
                );
            }
        }
        // Every string of up to 5 bytes over an alphabet that reaches each rule.
        let alphabet = b"a.Z:9-_[ ";
        let mut raw = Vec::new();
        let mut counters = [0usize; 5];
        for len in 0..=5usize {
            counters.iter_mut().for_each(|c| *c = 0);
            loop {
                raw.clear();
                raw.extend(counters[..len].iter().map(|&i| alphabet[i]));
                if is_normal_name_authority(&raw) {
                    assert_eq!(
                        normalise_authority(&raw).as_deref().map(str::as_bytes),
                        Ok(raw.as_slice()),
                        "{}",
                        String::from_utf8_lossy(&raw)
                    );
                }
                let Some(at) = (0..len).find(|&i| counters[i] + 1 < alphabet.len()) else {
                    break;
                };
                counters[at] += 1;
                counters[..at].iter_mut().for_each(|c| *c = 0);
            }
        }
        assert!(is_normal_name_authority(b"api.example.com:8080"));
        assert!(!is_normal_name_authority(b"x:65536"));
        assert!(!is_normal_name_authority(b"api.example.com."));
    }

    #[test]
    fn paths_have_one_spelling() {
        assert_eq!(
            normalise_path("/oauth/%72egister").unwrap(),
            "/oauth/register"
        );
        assert_eq!(
            normalise_path("/x/../oauth/register").unwrap(),
            "/oauth/register"
        );
        assert_eq!(
            normalise_path("//oauth///register").unwrap(),
            "/oauth/register"
        );
        assert_eq!(normalise_path("/a/./b/").unwrap(), "/a/b/");
        assert_eq!(normalise_path("/a/%2e%2E/b").unwrap(), "/b");
        assert_eq!(normalise_path("/a%20b").unwrap(), "/a%20b");
        assert_eq!(normalise_path("/a%3f").unwrap(), "/a%3F");
        assert_eq!(normalise_path("/").unwrap(), "/");
        assert_eq!(normalise_path("/a/..").unwrap(), "/");
    }

    #[test]
    fn the_shortcut_agrees_with_the_rewrite() {
        for path in [
            "/",
            "/a",
            "/a/",
            "/a/b",
            "/a/b/",
            "/a.b/c..d",
            "/.well-known/x",
        ] {
            assert!(is_already_normal(path), "{path}");
            assert_eq!(normalise_path(path).unwrap(), path);
        }
        for path in ["//", "/a//b", "/a/./b", "/a/..", "/%41", "/a/."] {
            assert!(!is_already_normal(path), "{path}");
        }
    }

    #[test]
    fn dangerous_paths_are_refused() {
        assert_eq!(normalise_path("/../etc"), Err(NormaliseError::EscapesRoot));
        assert_eq!(
            normalise_path("/a/%2F/b"),
            Err(NormaliseError::EncodedSeparator)
        );
        assert_eq!(
            normalise_path("/a%00"),
            Err(NormaliseError::EncodedSeparator)
        );
        assert_eq!(normalise_path("/a%zz"), Err(NormaliseError::BadEscape));
        assert_eq!(normalise_path("/a%4"), Err(NormaliseError::BadEscape));
        assert_eq!(normalise_path("*"), Err(NormaliseError::NotOriginForm));
        assert_eq!(normalise_path("/%c3%28").unwrap(), "/%C3%28");
    }

    #[test]
    fn hosts() {
        assert_eq!(host_without_port("api.example.com:8080"), "api.example.com");
        assert_eq!(host_without_port("[::1]:8080"), "[::1]");
        assert_eq!(host_without_port("[::1]"), "[::1]");
        let mut h = HeaderMap::new();
        h.append("host", "A.example:80".parse().unwrap());
        let uri: Uri = "/x".parse().unwrap();
        assert_eq!(
            request_authority(&uri, &h).unwrap().as_str(),
            "a.example:80"
        );
        h.append("host", "b.example".parse().unwrap());
        assert_eq!(
            request_authority(&uri, &h),
            Err(NormaliseError::DuplicateHost)
        );
        let abs: Uri = "http://c.example/x".parse().unwrap();
        let mut one = HeaderMap::new();
        one.insert("host", "d.example".parse().unwrap());
        assert_eq!(
            request_authority(&abs, &one),
            Err(NormaliseError::HostMismatch)
        );
        assert_eq!(
            request_authority(&uri, &HeaderMap::new()),
            Err(NormaliseError::MissingHost)
        );
    }

    fn authority_of(host: &str) -> Result<String, NormaliseError> {
        let mut h = HeaderMap::new();
        h.insert("host", host.parse().unwrap());
        request_authority(&"/x".parse().unwrap(), &h).map(|a| a.as_str().to_string())
    }

    /// The authority goes upstream as `X-Forwarded-Host` (and `Host`): a client's `Host` in
    /// normal form is that value itself, its bytes shared; any other spelling is replaced by
    /// the normal one.
    #[test]
    fn a_normal_host_field_is_kept_and_any_other_is_rewritten() {
        let uri: Uri = "/x".parse().unwrap();
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("a.example:8080"));
        let authority = request_authority(&uri, &h).unwrap();
        let sent = h.get("host").unwrap();
        assert_eq!(authority.value(), sent);
        assert_eq!(
            authority.value().as_bytes().as_ptr(),
            sent.as_bytes().as_ptr(),
            "the client's field is shared, not copied"
        );
        for spelled in ["A.Example:8080", " a.example:8080", "a.example.:8080"] {
            h.insert("host", HeaderValue::from_static(spelled));
            let authority = request_authority(&uri, &h).unwrap();
            assert_eq!(authority.value(), "a.example:8080", "{spelled:?}");
            assert_eq!(authority.as_str(), "a.example:8080", "{spelled:?}");
        }
        // An HTTP/2 `:authority` (or absolute-form target) without `Host` is its own value.
        let abs: Uri = "http://B.example/x".parse().unwrap();
        let authority = request_authority(&abs, &HeaderMap::new()).unwrap();
        assert_eq!(authority.value(), "b.example");
    }

    #[test]
    fn one_trailing_dot_is_the_same_host() {
        for (sent, normal) in [
            ("api.example.com.", "api.example.com"),
            ("API.Example.COM.", "api.example.com"),
            ("api.example.com.:8080", "api.example.com:8080"),
            (" a.example ", "a.example"),
            ("[::1]:80", "[::1]:80"),
            ("[0:0:0:0:0:0:0:1]", "[::1]"),
            ("[2001:DB8::1]", "[2001:db8::1]"),
            ("192.0.2.1:443", "192.0.2.1:443"),
            ("internal_name", "internal_name"),
        ] {
            assert_eq!(authority_of(sent).as_deref(), Ok(normal), "{sent:?}");
        }
        // The target and `Host` agree once both are normalised.
        let abs: Uri = "http://api.example.com./x".parse().unwrap();
        let mut h = HeaderMap::new();
        h.insert("host", "API.example.com".parse().unwrap());
        assert_eq!(
            request_authority(&abs, &h).unwrap().as_str(),
            "api.example.com"
        );
        assert_eq!(
            host_without_port("api.example.com.:8080"),
            "api.example.com"
        );
        assert_eq!(host_without_port("api.example.com."), "api.example.com");
    }

    #[test]
    fn malformed_hosts_are_refused() {
        for host in [
            "",
            ".",
            "..",
            "a..b",
            ".a",
            "a.b..",
            "a:b",
            "a:",
            "a:65536",
            "a:123456",
            "a:-1",
            "a:1:2",
            "[a.example]",
            "[a.example]:80",
            "[::1",
            "[::1]x",
            "[::1]:",
            "[::1]:x",
            "::1",
            "a.com, b.com",
            "a.com,b.com",
            "a b",
            "user@a.example",
            "a/b",
            "a%41",
            "*.example",
        ] {
            assert_eq!(authority_of(host), Err(NormaliseError::BadHost), "{host:?}");
        }
    }

    #[test]
    fn http10_may_omit_the_host() {
        let uri: Uri = "/x".parse().unwrap();
        let none = HeaderMap::new();
        assert_eq!(
            request_authority_of(Version::HTTP_10, &uri, &none),
            Ok(None)
        );
        assert_eq!(
            request_authority_of(Version::HTTP_11, &uri, &none),
            Err(NormaliseError::MissingHost)
        );
        assert_eq!(
            request_authority_of(Version::HTTP_2, &uri, &none),
            Err(NormaliseError::MissingHost)
        );
        let mut bad = HeaderMap::new();
        bad.insert("host", "a..b".parse().unwrap());
        assert_eq!(
            request_authority_of(Version::HTTP_10, &uri, &bad),
            Err(NormaliseError::BadHost)
        );
    }

    #[test]
    fn parameters_are_kept_in_the_path_and_ignored_for_routing() {
        for (raw, normal, routing) in [
            ("/login;jsessionid=1", "/login;jsessionid=1", "/login"),
            ("/login;", "/login;", "/login"),
            ("/a;x/b;y=1;z/", "/a;x/b;y=1;z/", "/a/b/"),
            ("/;jsessionid=1", "/;jsessionid=1", "/"),
            ("/;s=1/login", "/;s=1/login", "/login"),
            ("/a/;x", "/a/;x", "/a/"),
            ("/login%3bx", "/login%3Bx", "/login"),
            ("/login%3Bx/y", "/login%3Bx/y", "/login/y"),
            ("/login;x/../admin", "/admin", "/admin"),
            ("/a;x/./b", "/a;x/b", "/a/b"),
            ("/plain/path", "/plain/path", "/plain/path"),
            ("/a%20b", "/a%20b", "/a%20b"),
        ] {
            let path = normalise_path(raw).unwrap();
            assert_eq!(path, normal, "{raw}");
            assert_eq!(routing_path(&path), routing, "{raw}");
        }
        assert!(matches!(routing_path("/a/b"), Cow::Borrowed(_)));
    }

    #[test]
    fn dot_segments_with_parameters_are_refused() {
        for raw in [
            "/a/..;/b",
            "/a/..;x=1/b",
            "/a/.;/b",
            "/a/%2e%2e;/b",
            "/a/..%3B/b",
            "/a/..%3bx",
            "/..;",
        ] {
            assert_eq!(
                normalise_path(raw),
                Err(NormaliseError::DotSegmentWithParameters),
                "{raw}"
            );
        }
        // A name that merely starts with dots is a name.
        assert_eq!(normalise_path("/a/...;x").unwrap(), "/a/...;x");
        assert_eq!(normalise_path("/a/..x;y").unwrap(), "/a/..x;y");
    }
}
