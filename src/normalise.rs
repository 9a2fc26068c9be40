//! Request normalisation (SPEC section 4a): one spelling per path and exactly one host, so that
//! a client cannot reach a limited route under another spelling and the upstream sees what the
//! router saw.
//!
//! Path rules, in order: percent-encoded unreserved characters are decoded (RFC 3986 6.2.2.2)
//! and the remaining escapes upper-cased (6.2.2.1); an encoded `/` or NUL is refused (it would
//! let a client smuggle a segment boundary past the router); runs of `/` are merged (as nginx's
//! `merge_slashes`, since most backends treat `//` as `/`); dot segments are removed
//! (5.2.4), and a path that would climb above the root is refused.

use http::{HeaderMap, Uri};

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

/// No escapes, no empty segment but a trailing one, no dot segments: what the rewriting in
/// [`normalise_path`] would return unchanged.
fn is_already_normal(path: &str) -> bool {
    if path.contains('%') {
        return false;
    }
    let mut segments = path[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        if (segment.is_empty() && !last) || segment == "." || segment == ".." {
            return false;
        }
    }
    true
}

/// The request's one authority (`host[:port]`, lowercased), from `Host` or the request target.
///
/// HTTP/1.1 requires exactly one `Host`; a request whose absolute-form target or HTTP/2
/// `:authority` names another host than its `Host` header is ambiguous and refused, because the
/// router and the upstream could each believe a different one.
pub fn request_authority(
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<http::uri::Authority, NormaliseError> {
    let mut hosts = headers.get_all(http::header::HOST).iter();
    let host_header = hosts.next();
    if hosts.next().is_some() {
        return Err(NormaliseError::DuplicateHost);
    }
    let header_value = match host_header {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| NormaliseError::BadHost)?
                .trim()
                .to_ascii_lowercase(),
        ),
        None => None,
    };
    let target = uri.authority().map(|a| a.as_str().to_ascii_lowercase());
    let authority = match (target, header_value) {
        (Some(t), Some(h)) if t != h => return Err(NormaliseError::HostMismatch),
        (Some(t), _) => t,
        (None, Some(h)) => h,
        (None, None) => return Err(NormaliseError::MissingHost),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(NormaliseError::BadHost);
    }
    // Validated by http's own authority grammar, which keeps the text it checked: handed
    // over as `Bytes`, it is neither copied nor allocated again.
    http::uri::Authority::from_maybe_shared(bytes::Bytes::from(authority))
        .map_err(|_| NormaliseError::BadHost)
}

/// The host part of an authority, without port or IPv6 brackets' port: what routes match.
pub fn host_without_port(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        // "[::1]:8080" -> "[::1]"
        return match rest.find(']') {
            Some(end) => &authority[..end + 2],
            None => authority,
        };
    }
    match authority.rfind(':') {
        Some(idx) => &authority[..idx],
        None => authority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
