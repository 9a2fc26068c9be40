//! The syntax of the values inside `proxy.toml` (contract §2): durations, sizes, windows,
//! names, CIDRs, hosts, path prefixes, upstream origins, key parts and `${NAME}` expansion.
//!
//! Pure functions from a string to a value or a message, with no knowledge of TOML or of
//! positions: the loader (`load.rs`) puts each message at the value it came from. Messages
//! never repeat a URL or a secret, which may carry a password.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use http::uri::Scheme;
use http::{HeaderName, Uri};
use ipnet::IpNet;

use super::{Algorithm, HostPattern, KeyPart};

/// Upper bound for every duration in the file. Limit windows are capped at 366 days by the
/// spec; other durations share the cap so that no value can overflow `Instant + Duration`
/// further down (that addition panics on overflow).
pub const MAX_DURATION_SECS: u64 = 366 * 86_400;

/// Expands `${NAME}`, `${NAME:-default}` and `$$` in one string. Expanded values are not
/// scanned again, so a variable's value cannot inject further references. Errors name the
/// variable, never a value.
pub fn expand(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, Vec<String>> {
    let mut out = String::with_capacity(s.len());
    let mut errors = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(a) = after.strip_prefix('{') {
            let Some(end) = a.find('}') else {
                errors.push(
                    "unterminated \"${\": expected \"}\" (write \"$$\" for a literal \"$\")"
                        .to_string(),
                );
                rest = "";
                break;
            };
            let inner = &a[..end];
            rest = &a[end + 1..];
            let (name, default) = match inner.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (inner, None),
            };
            if !is_var_name(name) {
                errors.push(format!(
                    "invalid variable reference \"${{{inner}}}\": expected ${{NAME}} or ${{NAME:-default}} with NAME made of letters, digits and _"
                ));
                continue;
            }
            // Like the shell's ${NAME:-default}: the default also replaces an empty value.
            match (env(name), default) {
                (Some(v), Some(d)) if v.is_empty() => out.push_str(d),
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    errors.push(format!("environment variable {name} is not set"));
                }
            }
        } else {
            // A lone `$` (as in a regex or a price) is kept as written.
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

fn is_var_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// `<integer><unit>`, unit one of ms, s, m, h, d.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || {
        format!("invalid duration {s:?}: expected an integer and a unit (ms, s, m, h or d), e.g. \"250ms\", \"10s\", \"5m\"")
    };
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad());
    }
    let (number, unit) = s.split_at(digits);
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    let too_large = || format!("duration {s:?} is too large");
    let n: u64 = number.parse().map_err(|_| too_large())?;
    let ms = n.checked_mul(ms_per_unit).ok_or_else(too_large)?;
    Ok(Duration::from_millis(ms))
}

/// A size: an integer and a unit, `B`, `KiB`, `MiB` or `GiB` (powers of 1024), e.g.
/// `"10MiB"`. Decimal units (`KB`, `MB`) are refused rather than guessed at.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = || {
        format!("invalid size {s:?}: expected an integer and a unit (B, KiB, MiB or GiB), e.g. \"512KiB\", \"10MiB\"")
    };
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad());
    }
    let (number, unit) = s.split_at(digits);
    let bytes_per_unit: u64 = match unit {
        "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    let too_large = || format!("size {s:?} is too large");
    let n: u64 = number.parse().map_err(|_| too_large())?;
    n.checked_mul(bytes_per_unit).ok_or_else(too_large)
}

/// A limit window: whole seconds, 1s..=366d.
pub fn parse_window(s: &str) -> Result<u32, String> {
    let d = parse_duration(s)?;
    if d.subsec_nanos() != 0 {
        return Err("window must be a whole number of seconds".to_string());
    }
    let secs = d.as_secs();
    if !(1..=MAX_DURATION_SECS).contains(&secs) {
        return Err(format!("window must be between 1s and 366d, got {s:?}"));
    }
    u32::try_from(secs).map_err(|_| format!("window must be between 1s and 366d, got {s:?}"))
}

/// Seconds in the largest unit that divides them, for messages.
pub fn format_secs(secs: u32) -> String {
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if secs >= size && secs.is_multiple_of(size) {
            return format!("{}{unit}", secs / size);
        }
    }
    format!("{secs}s")
}

/// Route names, upstream names and scopes: they go into metric labels and bucket strings,
/// where `:` separates fields and anything else would need escaping.
pub fn check_name(s: &str, what: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(format!(
            "{what} {s:?} may contain only letters, digits, '_', '.' and '-'"
        ));
    }
    Ok(())
}

/// A CIDR, or a bare address meaning just that address. Host bits are cleared, so
/// "10.1.2.3/8" means 10.0.0.0/8 as in other proxies' trusted-proxy lists.
pub fn parse_cidr(s: &str) -> Result<IpNet, String> {
    if let Ok(net) = IpNet::from_str(s) {
        return Ok(net.trunc());
    }
    if let Ok(ip) = IpAddr::from_str(s) {
        return Ok(IpNet::from(ip));
    }
    Err(format!(
        "{s:?} is not a CIDR or IP address; expected e.g. \"10.0.0.0/8\", \"192.0.2.1\" or \"2001:db8::/32\""
    ))
}

/// A route's host: an exact name or `*.suffix`, lowercased.
pub fn parse_host(s: &str) -> Result<HostPattern, String> {
    if s.contains("://") {
        return Err(format!("{s:?} must be a host name, not a URL"));
    }
    let lower = s.to_ascii_lowercase();
    if let Some(inner) = lower.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        // In RFC 5952 form, as requests' hosts are compared (`[0::1]` is `[::1]`).
        return match Ipv6Addr::from_str(inner) {
            Ok(addr) => Ok(HostPattern::Exact(format!("[{addr}]"))),
            Err(_) => Err(format!("{s:?} is not a valid IPv6 address literal")),
        };
    }
    if lower.contains(':') {
        return Err(format!(
            "{s:?} must not contain a port: routes match the host whatever the port"
        ));
    }
    let (suffix, name) = match lower.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, lower.as_str()),
    };
    check_host_name(name).map_err(|why| format!("{s:?} is not a valid host name: {why}"))?;
    Ok(if suffix {
        HostPattern::Suffix(format!(".{name}"))
    } else {
        HostPattern::Exact(name.to_string())
    })
}

/// DNS-style name: dot-separated labels of letters, digits, '-' and '_' (the latter appears in
/// internal names), 1..=63 characters each, 253 in all.
fn check_host_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.len() > 253 {
        return Err("it is longer than 253 characters");
    }
    if name.contains('*') {
        return Err("a wildcard is only allowed as a leading \"*.\"");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("it has an empty label");
        }
        if label.len() > 63 {
            return Err("a label is longer than 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("it may contain only letters, digits, '-', '_' and '.'");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a label starts or ends with '-'");
        }
    }
    Ok(())
}

/// A route's path prefix, in the normalised form requests are matched in (contract §4a), so a
/// prefix that no normalised path could ever carry is rejected instead of never matching.
pub fn parse_path_prefix(s: &str) -> Result<String, String> {
    if !s.starts_with('/') {
        return Err(format!("{s:?} must start with '/'"));
    }
    if s.contains(['?', '#']) {
        return Err(format!("{s:?} must be a path only, without '?' or '#'"));
    }
    if s.contains('%') {
        return Err(format!(
            "{s:?} must not contain '%': requests are matched after percent-decoding, write the character itself"
        ));
    }
    if s.contains("//") {
        return Err(format!("{s:?} must not contain an empty segment (\"//\")"));
    }
    if s.contains(';') {
        return Err(format!(
            "{s:?} must not contain ';': requests are matched without their path parameters (\";...\")"
        ));
    }
    if s.split('/').any(|seg| seg == "." || seg == "..") {
        return Err(format!(
            "{s:?} must not contain \".\" or \"..\" segments: requests are matched after they are removed"
        ));
    }
    // RFC 3986 pchar minus percent-encoding: anything else never appears in a request path.
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "/-._~!$&'()*+,;=:@".contains(*c)))
    {
        return Err(format!(
            "{s:?} contains {c:?}, which cannot appear in a request path"
        ));
    }
    let trimmed = if s.len() > 1 {
        s.strip_suffix('/').unwrap_or(s)
    } else {
        s
    };
    Ok(trimmed.to_string())
}

/// A duration for a timeout or an interval: greater than zero and at most 366 days.
pub fn positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("must be greater than zero".to_string()),
        d if d > Duration::from_secs(MAX_DURATION_SECS) => Err("must be at most 366d".to_string()),
        d => Ok(d),
    }
}

/// A size limit: greater than zero.
pub fn positive_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err("must be greater than zero".to_string()),
        n => Ok(n),
    }
}

pub fn parse_socket_addr(s: &str) -> Result<SocketAddr, String> {
    SocketAddr::from_str(s).map_err(|_| {
        format!("{s:?} is not a socket address; expected IP:PORT, e.g. \"0.0.0.0:8080\" or \"[::1]:8443\"")
    })
}

/// Messages do not repeat the URL: the position points at it, and a URL may carry a
/// `user:password@` part.
pub fn parse_origin(s: &str) -> Result<Uri, String> {
    let uri = Uri::from_str(s).map_err(|e| format!("not a valid URL: {e}"))?;
    let scheme = match uri.scheme() {
        Some(sc) if *sc == Scheme::HTTP || *sc == Scheme::HTTPS => sc.clone(),
        _ => return Err("an upstream URL must start with http:// or https://".to_string()),
    };
    let Some(authority) = uri.authority() else {
        return Err("the URL has no host".to_string());
    };
    if authority.as_str().contains('@') {
        return Err("user info (user:password@) in upstream URLs is not supported".to_string());
    }
    if authority.host().is_empty() {
        return Err("the URL has no host".to_string());
    }
    if !matches!(uri.path(), "" | "/") {
        return Err(
            "the URL has a path; an upstream is an origin (scheme and authority) only, the request path is forwarded as is"
                .to_string(),
        );
    }
    if uri.query().is_some() {
        return Err("the URL has a query; an upstream is an origin only".to_string());
    }
    Uri::builder()
        .scheme(scheme)
        .authority(authority.clone())
        .path_and_query("/")
        .build()
        .map_err(|e| format!("not a valid URL: {e}"))
}

pub fn parse_key_part(s: &str) -> Result<KeyPart, String> {
    match s {
        "ip" => Ok(KeyPart::Ip),
        "global" => Ok(KeyPart::Global),
        _ => match s.strip_prefix("header:") {
            Some(h) => HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes())
                .map(KeyPart::Header)
                .map_err(|_| format!("{h:?} is not a valid header name")),
            None => Err(format!(
                "unknown key {s:?}; expected \"ip\", \"global\" or \"header:<name>\""
            )),
        },
    }
}

pub fn parse_algorithm(s: &str) -> Result<Algorithm, String> {
    match s {
        "fixed" => Ok(Algorithm::Fixed),
        "sliding" => Ok(Algorithm::Sliding),
        other => Err(format!(
            "algorithm must be \"fixed\" or \"sliding\", got {other:?}"
        )),
    }
}

/// `cost_header` (contract §3d): the response field the upstream reports a request's cost in,
/// lowercased. Not a field that frames the response body: tollgate removes the cost field
/// before the response goes on, and a response without its framing could not be read.
pub fn parse_cost_header(s: &str) -> Result<HeaderName, String> {
    let name = HeaderName::from_bytes(s.to_ascii_lowercase().as_bytes())
        .map_err(|_| format!("{s:?} is not a valid header name"))?;
    if name == http::header::CONTENT_LENGTH || name == http::header::TRANSFER_ENCODING {
        return Err(format!(
            "{s:?} frames the response body; the cost field is removed before the response goes on, so it must be a field of its own such as \"x-ratelimit-cost\""
        ));
    }
    Ok(name)
}
