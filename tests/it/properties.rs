//! Property tests for the parts of tollgate that take hostile input: the configuration loader,
//! the `X-Forwarded-For` walk (contract §4), path and host normalisation and path parameters
//! (contract §4a) and key derivation (contract §3). Nothing here may panic (contract §9), whatever the input.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;
use proptest::prelude::*;

use tollgate::testing::config::{load_str, KeyPart, KeySpec};
use tollgate::testing::key::{bucket_for, client_addr, ip_subject, BucketHasher, RequestIdentity};
use tollgate::testing::normalise::{
    host_without_port, normalise_path, request_authority, routing_path,
};
use tollgate::testing::route;

const CASES: u32 = 256;

/// Modest case counts (`PROPTEST_CASES` raises them for a longer hunt), and no regression
/// files written next to the tests.
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(cases)
    }
}

fn no_env(_: &str) -> Option<String> {
    None
}

// ---------------------------------------------------------------------------------------------
// Configuration loader

/// A valid file touching every table (no `${NAME}` and no files, so it loads on its own).
const VALID: &str = r#"# a comment
[server]
listen = ["127.0.0.1:0", "[::1]:0"]
trusted_proxies = ["10.0.0.0/8", "192.0.2.1"]
ipv6_prefix = 56
header_read_timeout = "5s"
idle_timeout = "1m"
max_connections = 100
shutdown_timeout = "2s"
rate_limit_headers = "both"

[admin]
listen = "127.0.0.1:0"

[store]
pool_size = 4
timeout = "250ms"
on_error = "deny"
migrate = false
sweep_interval = "30s"
synchronous_commit = "on"

[keys]
secret = "s3cr3t-$${literal}"

[upstreams.app]
url = "http://127.0.0.1:9000"
connect_timeout = "1s"
response_timeout = "10s"
preserve_host = false

[upstreams.pool]
urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
http2 = true

[[routes]]
name = "oauth.register"
host = "*.example.com"
path_prefix = "/oauth/register"
methods = ["POST", "GET"]
upstream = "app"
strip_prefix = true
on_store_error = "allow"

  [[routes.limits]]
  key = "ip"
  requests = 5
  window = "1h"

  [[routes.limits]]
  key = ["header:x-tenant", "ip"]
  requests = 100
  window = "366d"
  scope = "shared"
  shadow = true

  [routes.reject]
  status = 503
  content_type = "text/plain"
  body = "slow down"

[[routes]]
name = "rest"
upstream = "pool"
shadow = true

  [[routes.limits]]
  key = "global"
  requests = 2147483647
  window = "1s"
"#;

/// Loads `text` as `p.toml` and checks the error report's shape.
fn check_load(text: &str) -> Result<(), TestCaseError> {
    let result = load_str(Path::new("p.toml"), text, &no_env);
    let Err(errors) = result else {
        return Ok(());
    };
    prop_assert!(!errors.0.is_empty(), "an empty error list");
    let line_count = text.split('\n').count();
    for e in &errors.0 {
        if e.line > 0 {
            prop_assert!(e.col >= 1, "line {} but col 0: {e}", e.line);
            prop_assert!(
                e.line <= line_count,
                "line {} beyond the {line_count} lines of the text: {e}",
                e.line
            );
            let prefix = format!("p.toml:{}:{}: ", e.line, e.col);
            prop_assert!(e.to_string().starts_with(&prefix), "{e}");
        } else {
            prop_assert_eq!(e.col, 0, "col without a line: {}", e);
        }
    }
    let report = errors.to_string();
    prop_assert_eq!(
        report.lines().count(),
        errors.0.len(),
        "one line per error: {:?}",
        report
    );
    for line in report.lines() {
        prop_assert!(line.starts_with("p.toml:"), "{line:?} in {report:?}");
    }
    Ok(())
}

#[test]
fn the_base_file_is_valid() {
    if let Err(errors) = load_str(Path::new("p.toml"), VALID, &no_env) {
        panic!("{errors}");
    }
}

/// One error is one line (README: `FILE:LINE:COL: field.path: what is wrong`), even when a
/// value the message quotes holds a line break.
#[test]
fn errors_quoting_a_line_break_stay_on_one_line() {
    let cases = [
        "[upstreams.app]\nurl = \"http://127.0.0.1:1\"\nca_file = \"a\\nb.pem\"\n",
        "[keys]\nsecret = \"${A\\nB}\"\n",
        "[upstreams.app]\nurl = \"http://127.0.0.1:1\\n\"\n",
        "[[routes]]\nname = \"a\\nb\"\nupstream = \"x\\ny\"\n",
        "[server]\nlisten = [\"a\\nb\"]\n",
        "[\"a\\nb\"]\n",
    ];
    let mut broken = Vec::new();
    for text in cases {
        if let Err(errors) = load_str(Path::new("p.toml"), text, &no_env) {
            let report = errors.to_string();
            if report.lines().any(|l| !l.starts_with("p.toml:")) {
                broken.push(report);
            }
        }
    }
    assert!(broken.is_empty(), "multi-line errors: {broken:#?}");
}

#[derive(Debug, Clone)]
enum Edit {
    Insert(usize, char),
    Delete(usize),
    Replace(usize, char),
}

/// Characters that matter to TOML and to the loader's own syntax, plus some that never should.
fn interesting_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => prop::sample::select(vec![
            '"', '\'', '[', ']', '{', '}', '=', ',', '.', '#', '\n', '\r', '\t', ' ', '$', ':',
            '/', '\\', '-', '+', '0', '9', 'e', 'x', '_', '*', '%', '\0', '\u{7f}', 'é', '\u{feff}',
            '\u{2028}', '𝄞',
        ]),
        1 => any::<char>(),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), interesting_char()).prop_map(|(i, c)| Edit::Insert(i, c)),
        any::<usize>().prop_map(Edit::Delete),
        (any::<usize>(), interesting_char()).prop_map(|(i, c)| Edit::Replace(i, c)),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for e in edits {
        match *e {
            Edit::Insert(i, c) => {
                let at = i % (chars.len() + 1);
                chars.insert(at, c);
            }
            Edit::Delete(i) if !chars.is_empty() => {
                let at = i % chars.len();
                chars.remove(at);
            }
            Edit::Replace(i, c) if !chars.is_empty() => {
                let at = i % chars.len();
                chars[at] = c;
            }
            _ => {}
        }
    }
    chars.into_iter().collect()
}

/// Whole lines of the valid file dropped, duplicated or swapped.
fn line_shuffle() -> impl Strategy<Value = String> {
    let lines: Vec<String> = VALID.lines().map(str::to_string).collect();
    let n = lines.len();
    prop::collection::vec((0..n, 0..3u8, 0..n), 1..6).prop_map(move |ops| {
        let mut l = lines.clone();
        for (i, op, j) in ops {
            let (i, j) = (i % l.len().max(1), j % l.len().max(1));
            if l.is_empty() {
                break;
            }
            match op {
                0 => {
                    l.remove(i);
                }
                1 => {
                    let copy = l[i].clone();
                    l.insert(j, copy);
                }
                _ => l.swap(i, j),
            }
        }
        l.join("\n")
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn loader_survives_arbitrary_text(text in any::<String>()) {
        check_load(&text)?;
    }

    #[test]
    fn loader_survives_toml_shaped_text(
        text in r#"(\[{1,2}[a-z.]{0,12}\]{1,2}\n|[a-z_.]{1,12} = ("[^"\n]{0,20}"|[0-9-]{1,12}|true|\[[^\n]{0,20}\]|\{[^\n]{0,20}\})\n|#[^\n]{0,10}\n){0,12}"#
    ) {
        check_load(&text)?;
    }

    #[test]
    fn loader_survives_edits_of_a_valid_file(edits in prop::collection::vec(edit(), 1..8)) {
        check_load(&apply(VALID, &edits))?;
    }

    #[test]
    fn loader_survives_line_shuffles_of_a_valid_file(text in line_shuffle()) {
        check_load(&text)?;
    }

    #[test]
    fn loader_survives_hostile_values(
        field in prop::sample::select(vec![
            ("server", "listen"), ("server", "ipv6_prefix"), ("server", "max_connections"),
            ("server", "header_read_timeout"), ("server", "trusted_proxies"),
            ("store", "pool_size"), ("store", "timeout"), ("keys", "secret"),
            ("upstreams.app", "url"), ("upstreams.app", "connect_timeout"),
            ("upstreams.app", "ca_file"), ("routes", "name"),
        ]),
        value in prop_oneof![
            "\"[0-9]{1,25}(ms|s|m|h|d|w)?\"",
            "-?[0-9]{1,25}",
            "\"\\$\\{[A-Z_:-]{0,10}\\}?\"",
            "\"[^\"\\\\]{0,30}\"",
            "\\[\"[^\"\\\\]{0,20}\"\\]",
            "[0-9]\\.[0-9]e[0-9]{1,4}",
            // TOML escapes that put a line break into the value.
            r#""[a-z/.$]{0,6}(\$\{[a-z]{0,3})?\\[nr][a-z}]{0,5}""#,
            Just("inf".to_string()),
            Just("nan".to_string()),
        ],
    ) {
        let text = format!(
            "[{}]\n{} = {}\n\n[upstreams.x]\nurl = \"http://127.0.0.1:1\"\n[[routes]]\nname = \"r\"\nupstream = \"x\"\n",
            field.0, field.1, value
        );
        check_load(&text)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Client address (contract §4)

fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

fn trusted_nets() -> impl Strategy<Value = Vec<IpNet>> {
    prop::sample::subsequence(
        vec![
            "10.0.0.0/8",
            "192.0.2.0/24",
            "127.0.0.1/32",
            "::1/128",
            "2001:db8::/32",
            "fd00::/8",
            "0.0.0.0/0",
        ],
        0..4,
    )
    .prop_map(|v| v.into_iter().map(|s| s.parse().expect("net")).collect())
}

fn address() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        // Inside or near the trusted nets, so that walks go somewhere.
        (0u8..3, any::<u8>()).prop_map(|(net, last)| match net {
            0 => IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)),
            1 => IpAddr::V4(Ipv4Addr::new(192, 0, 2, last)),
            _ => IpAddr::V4(Ipv4Addr::new(198, 51, 100, last)),
        }),
        (0u8..3, any::<u16>()).prop_map(|(net, last)| match net {
            0 => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, last)),
            1 => IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, last)),
            _ => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb9, 0, 0, 0, 0, 0, last)),
        }),
        // IPv4-mapped IPv6.
        any::<u8>().prop_map(|last| IpAddr::V6(Ipv4Addr::new(10, 0, 0, last).to_ipv6_mapped())),
        any::<u8>().prop_map(|last| IpAddr::V6(Ipv4Addr::new(203, 0, 113, last).to_ipv6_mapped())),
        Just(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        any::<IpAddr>(),
    ]
}

/// One `X-Forwarded-For` entry as proxies (and attackers) write them.
fn entry() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => address().prop_map(|a| a.to_string()),
        1 => (address(), any::<u16>()).prop_map(|(a, p)| match a {
            IpAddr::V4(v4) => format!("{v4}:{p}"),
            IpAddr::V6(v6) => format!("[{v6}]:{p}"),
        }),
        1 => address().prop_map(|a| format!("[{a}]")),
        1 => address().prop_map(|a| a.to_string().to_uppercase()),
        1 => "[ -~]{0,12}",
        1 => Just(String::new()),
        1 => Just("unknown".to_string()),
    ]
}

fn xff_field() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec((entry(), "[ \t]{0,2}"), 0..6).prop_map(|entries| {
            entries
                .into_iter()
                .map(|(e, ws)| format!("{ws}{e}{ws}"))
                .collect::<Vec<_>>()
                .join(",")
                .into_bytes()
        }),
        // Arbitrary bytes a header value may carry (visible ASCII, space, tab, obs-text).
        1 => prop::collection::vec(
            prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff],
            0..60,
        ),
    ]
}

fn xff_headers() -> impl Strategy<Value = (HeaderMap, Vec<Vec<u8>>)> {
    (
        prop::collection::vec(xff_field(), 0..4),
        prop::collection::vec(("[a-z-]{1,10}", "[ -~]{0,10}"), 0..3),
    )
        .prop_map(|(fields, others)| {
            let mut headers = HeaderMap::new();
            for (name, value) in others {
                if let (Ok(n), Ok(v)) = (
                    HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_str(&value),
                ) {
                    headers.append(n, v);
                }
            }
            let mut kept = Vec::new();
            for f in fields {
                if let Ok(v) = HeaderValue::from_bytes(&f) {
                    headers.append("x-forwarded-for", v);
                    kept.push(f);
                }
            }
            (headers, kept)
        })
}

/// Every address that could be read out of the fields' entries (leniently: bare, bracketed,
/// with a port), canonicalised.
fn addresses_in(fields: &[Vec<u8>]) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for f in fields {
        for entry in f.split(|b| *b == b',') {
            let Ok(text) = std::str::from_utf8(entry) else {
                continue;
            };
            let text = text.trim_matches(|c: char| c.is_ascii_whitespace());
            let parsed = text
                .parse::<IpAddr>()
                .ok()
                .or_else(|| text.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
                .or_else(|| {
                    text.strip_prefix('[')
                        .and_then(|r| r.split(']').next())
                        .and_then(|r| r.parse::<Ipv6Addr>().ok())
                        .map(IpAddr::V6)
                });
            if let Some(a) = parsed {
                out.push(canonical(a));
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn untrusted_peer_is_the_client(
        peer in address(),
        trusted in trusted_nets(),
        (headers, _) in xff_headers(),
    ) {
        // Only nets that do not hold the peer: it is untrusted by construction.
        let trusted: Vec<IpNet> = trusted
            .into_iter()
            .filter(|n| !n.contains(&canonical(peer)))
            .collect();
        prop_assert_eq!(client_addr(peer, &headers, &trusted), canonical(peer));
    }

    #[test]
    fn trusted_peer_yields_itself_or_a_forwarded_address(
        peer in address(),
        trusted in trusted_nets(),
        (headers, fields) in xff_headers(),
    ) {
        let got = client_addr(peer, &headers, &trusted);
        prop_assert!(!matches!(got, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some()),
            "IPv4-mapped result {got}");
        if got != canonical(peer) {
            prop_assert!(
                trusted.iter().any(|n| n.contains(&canonical(peer))),
                "untrusted peer {peer} but client {got}"
            );
            let candidates = addresses_in(&fields);
            prop_assert!(candidates.contains(&got), "{got} not among {candidates:?}");
        }
    }

    #[test]
    fn forwarded_for_never_panics(
        peer in any::<IpAddr>(),
        trusted in trusted_nets(),
        raw in prop::collection::vec(any::<u8>(), 0..80),
    ) {
        let mut headers = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_bytes(&raw) {
            headers.append("x-forwarded-for", v);
        }
        let _ = client_addr(peer, &headers, &trusted);
    }
}

// ---------------------------------------------------------------------------------------------
// Path normalisation (contract §4a)

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// A piece of a path: an unreserved character (literal, or percent-encoded in the encoded
/// spelling), a `/`, an escape that stays an escape, or a reserved character kept literal.
#[derive(Debug, Clone)]
enum Piece {
    Unreserved { c: u8, encode: bool, lower: bool },
    Slash,
    Escape(u8),
    Literal(char),
}

fn piece() -> impl Strategy<Value = Piece> {
    let unreserved: Vec<u8> = (0u8..128).filter(|b| is_unreserved(*b)).collect();
    prop_oneof![
        4 => (prop::sample::select(unreserved), any::<bool>(), any::<bool>())
            .prop_map(|(c, encode, lower)| Piece::Unreserved { c, encode, lower }),
        3 => (any::<bool>(), any::<bool>()).prop_map(|(encode, lower)| Piece::Unreserved {
            c: b'.',
            encode,
            lower,
        }),
        3 => Just(Piece::Slash),
        1 => any::<u8>()
            .prop_filter("stays escaped", |b| !is_unreserved(*b) && *b != b'/' && *b != 0)
            .prop_map(Piece::Escape),
        1 => prop::sample::select(vec!['!', '$', '&', '\'', '(', ')', '*', '+', ',', ';', '=', ':', '@', 'é'])
            .prop_map(Piece::Literal),
    ]
}

fn render(pieces: &[Piece], encoded: bool) -> String {
    let mut out = String::from("/");
    for p in pieces {
        match p {
            Piece::Unreserved { c, encode, lower } => {
                if encoded && *encode {
                    if *lower {
                        out.push_str(&format!("%{c:02x}"));
                    } else {
                        out.push_str(&format!("%{c:02X}"));
                    }
                } else {
                    out.push(*c as char);
                }
            }
            Piece::Slash => out.push('/'),
            Piece::Escape(b) => out.push_str(&format!("%{b:02X}")),
            Piece::Literal(c) => out.push(*c),
        }
    }
    out
}

/// What every successful normalisation must look like.
fn check_normal_form(input: &str, out: &str) -> Result<(), TestCaseError> {
    prop_assert!(out.starts_with('/'), "{input:?} -> {out:?}");
    prop_assert!(!out.contains("//"), "{input:?} -> {out:?}");
    prop_assert!(
        out.split('/').all(|s| s != "." && s != ".."),
        "dot segment left: {input:?} -> {out:?}"
    );
    let upper = out.to_ascii_uppercase();
    prop_assert!(
        !upper.contains("%2F") && !upper.contains("%00"),
        "{input:?} -> {out:?}"
    );
    // Every escape left is upper-case and encodes a byte that is not unreserved.
    let bytes = out.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'%' {
            let hex = out.get(i + 1..i + 3).unwrap_or("");
            prop_assert!(
                hex.len() == 2
                    && hex
                        .bytes()
                        .all(|h| h.is_ascii_digit() || h.is_ascii_uppercase()),
                "escape not upper-case hex: {input:?} -> {out:?}"
            );
            let value = u8::from_str_radix(hex, 16).unwrap_or(0);
            prop_assert!(
                !is_unreserved(value),
                "unreserved left encoded: {input:?} -> {out:?}"
            );
        }
    }
    prop_assert_eq!(
        normalise_path(out),
        Ok(out.to_string()),
        "not idempotent on {:?}",
        input
    );
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn normalise_never_panics(raw in any::<String>()) {
        if let Ok(out) = normalise_path(&raw) {
            check_normal_form(&raw, &out)?;
        }
    }

    #[test]
    fn normalised_paths_are_in_normal_form(raw in "/[a-zA-Z0-9%./~_;:@!$&'()*+,=-]{0,40}") {
        if let Ok(out) = normalise_path(&raw) {
            check_normal_form(&raw, &out)?;
        }
    }

    #[test]
    fn normalised_paths_from_pieces_are_in_normal_form(pieces in prop::collection::vec(piece(), 0..30)) {
        for encoded in [false, true] {
            let raw = render(&pieces, encoded);
            if let Ok(out) = normalise_path(&raw) {
                check_normal_form(&raw, &out)?;
            }
        }
    }

    #[test]
    fn encoding_unreserved_characters_changes_nothing(pieces in prop::collection::vec(piece(), 0..30)) {
        let plain = render(&pieces, false);
        let encoded = render(&pieces, true);
        prop_assert_eq!(
            normalise_path(&plain),
            normalise_path(&encoded),
            "{:?} vs {:?}",
            plain,
            encoded
        );
    }

    #[test]
    fn a_prefix_matches_whatever_the_spelling(
        pieces in prop::collection::vec(piece(), 0..20),
        prefix in prop::sample::select(vec!["/", "/a", "/oauth/register", "/a.b", "/~x"]),
    ) {
        let plain = render(&pieces, false);
        let encoded = render(&pieces, true);
        if let (Ok(p), Ok(e)) = (normalise_path(&plain), normalise_path(&encoded)) {
            prop_assert_eq!(
                tollgate::testing::route::path_matches(prefix, &p),
                tollgate::testing::route::path_matches(prefix, &e)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Path parameters and hosts (contract §4a)

/// A path segment's name and, maybe, its parameters (`name;params`). Names are never empty:
/// a segment of parameters only (`/;x`) is a segment to dot removal and none to routing, so
/// `/a/;x/..` is `/a` where `/a//..` is `/`; either goes upstream as it was routed.
fn param_segment() -> impl Strategy<Value = (String, Option<String>)> {
    ("[a-z0-9.]{1,4}", prop::option::of("[a-z0-9=;]{0,4}"))
}

/// The same path twice: without parameters, and with each segment's parameters.
fn spell(segments: &[(String, Option<String>)]) -> (String, String) {
    let mut plain = String::new();
    let mut with = String::new();
    for (name, params) in segments {
        plain.push('/');
        plain.push_str(name);
        with.push('/');
        with.push_str(name);
        if let Some(params) = params {
            with.push(';');
            with.push_str(params);
        }
    }
    if plain.is_empty() {
        plain.push('/');
        with.push('/');
    }
    (plain, with)
}

fn authority_of(host: &[u8]) -> Option<String> {
    let value = HeaderValue::from_bytes(host).ok()?;
    let mut headers = HeaderMap::new();
    headers.insert("host", value);
    let uri: http::Uri = "/".parse().ok()?;
    request_authority(&uri, &headers)
        .ok()
        .map(|a| a.as_str().to_string())
}

proptest! {
    #![proptest_config(config())]

    /// What routes match is itself a normal path, free of parameters, and stable.
    #[test]
    fn routing_paths_are_normal_and_parameter_free(raw in "/[a-zA-Z0-9%./;=_-]{0,40}") {
        if let Ok(path) = normalise_path(&raw) {
            let routing = routing_path(&path);
            prop_assert!(routing.starts_with('/'), "{raw:?} -> {routing:?}");
            prop_assert!(!routing.contains(';') && !routing.contains("%3B"), "{raw:?} -> {routing:?}");
            prop_assert_eq!(normalise_path(&routing), Ok(routing.to_string()), "{:?}", raw);
            prop_assert_eq!(&*routing_path(&routing), &*routing, "{:?}", raw);
        }
    }

    /// Adding parameters to segments never moves a request to another route: the path with
    /// them routes exactly as the path without (or is refused, for `..;`).
    #[test]
    fn parameters_never_change_the_routing_path(segments in prop::collection::vec(param_segment(), 0..8)) {
        let (plain, with) = spell(&segments);
        match (normalise_path(&plain), normalise_path(&with)) {
            (Ok(p), Ok(w)) => prop_assert_eq!(routing_path(&p), routing_path(&w), "{:?} vs {:?}", plain, with),
            (Err(e), Ok(w)) => prop_assert!(false, "{plain:?} refused ({e}) but {with:?} -> {w:?}"),
            _ => {}
        }
    }

    /// `strip_prefix` removes the matched segments with their parameters: stripping the path
    /// with parameters routes as stripping its routing path.
    #[test]
    fn stripping_agrees_with_routing(
        segments in prop::collection::vec(param_segment(), 0..8),
        prefix in prop::sample::select(vec!["/", "/a", "/a/b", "/0", "/a.b"]),
    ) {
        let (_, with) = spell(&segments);
        if let Ok(path) = normalise_path(&with) {
            let routing = routing_path(&path);
            if route::path_matches(prefix, &routing) {
                let stripped = route::strip(prefix, &path);
                prop_assert_eq!(
                    &*routing_path(&stripped),
                    route::strip(prefix, &routing),
                    "{:?} under {:?}",
                    path,
                    prefix
                );
            }
        }
    }

    /// Any Host value: no panic; what is accepted is lower case, has no trailing dot, and is
    /// its own normal form.
    #[test]
    fn hosts_normalise_once(raw in prop::collection::vec(any::<u8>(), 0..40)) {
        if let Some(a) = authority_of(&raw) {
            prop_assert_eq!(a.to_ascii_lowercase(), a.clone());
            prop_assert!(!host_without_port(&a).ends_with('.'), "{a:?}");
            prop_assert_eq!(authority_of(a.as_bytes()), Some(a.clone()));
        }
    }

    #[test]
    fn host_like_values_normalise_once(raw in "[a-zA-Z0-9._:\\[\\], -]{0,24}") {
        if let Some(a) = authority_of(raw.as_bytes()) {
            prop_assert!(!host_without_port(&a).ends_with('.'), "{raw:?} -> {a:?}");
            prop_assert_eq!(authority_of(a.as_bytes()), Some(a.clone()));
        }
    }

    /// One trailing dot is the same host, with or without a port; two are refused.
    #[test]
    fn one_trailing_dot_is_the_same_host(
        labels in prop::collection::vec("[a-zA-Z0-9_-]{1,6}", 1..5),
        port in prop::option::of(0u16..),
    ) {
        let name = labels.join(".");
        let with_port = |host: String| match port {
            Some(p) => format!("{host}:{p}"),
            None => host,
        };
        let bare = authority_of(with_port(name.clone()).as_bytes());
        prop_assert!(bare.is_some(), "{name:?} refused");
        prop_assert_eq!(authority_of(with_port(format!("{name}.")).as_bytes()), bare);
        prop_assert_eq!(authority_of(with_port(format!("{name}..")).as_bytes()), None);
    }
}

// ---------------------------------------------------------------------------------------------
// Key derivation (contract §3)

fn is_bucket(bucket: &str, scope: &str, label: &str) -> bool {
    let Some(digest) = bucket
        .strip_prefix(scope)
        .and_then(|r| r.strip_prefix(':'))
        .and_then(|r| r.strip_prefix(label))
        .and_then(|r| r.strip_prefix(':'))
    else {
        return false;
    };
    digest.len() == 64
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn key_spec() -> impl Strategy<Value = KeySpec> {
    let part = prop_oneof![
        Just(KeyPart::Ip),
        "x-[a-z]{1,8}"
            .prop_map(|n| KeyPart::Header(HeaderName::from_bytes(n.as_bytes()).expect("name"))),
        Just(KeyPart::Header(HeaderName::from_static("authorization"))),
    ];
    prop_oneof![
        Just(KeySpec {
            parts: vec![KeyPart::Global]
        }),
        prop::collection::vec(part, 1..4).prop_map(|parts| KeySpec { parts }),
    ]
}

fn secret() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop::option::of(prop::collection::vec(any::<u8>(), 0..80))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn buckets_have_their_shape_and_hide_the_subject(
        scope in "[a-z][a-z0-9_-]{0,15}",
        spec in key_spec(),
        client in any::<IpAddr>(),
        ipv6_prefix in 0u8..=128,
        value in "[ -~]{0,20}[A-Z!#%&*@][ -~]{0,20}",
        secret in secret(),
    ) {
        let mut headers = HeaderMap::new();
        for part in &spec.parts {
            if let KeyPart::Header(name) = part {
                headers.insert(name.clone(), HeaderValue::from_str(&value).expect("value"));
            }
        }
        let hasher = BucketHasher::new(secret.as_deref());
        // Through a worker's cache of `ip` buckets, as the proxy derives them.
        let cache = tollgate::testing::key::IpBucketCache::default();
        let who = RequestIdentity { client, ipv6_prefix, headers: &headers, ip_buckets: Some(&cache) };
        let bucket = bucket_for(&scope, &spec, &who, &hasher).expect("every part present");
        if spec.is_global() {
            prop_assert_eq!(bucket.to_string(), format!("{scope}:global"));
        } else {
            prop_assert!(is_bucket(&bucket, &scope, &spec.label()), "{bucket} for {}", spec.label());
            let subject = ip_subject(client, ipv6_prefix);
            prop_assert!(!bucket.contains(&subject), "{bucket} shows {subject}");
            prop_assert!(!bucket.contains(&value), "{bucket} shows {value:?}");
        }
        // Every instance derives the same bucket from the same subject.
        let again = bucket_for(&scope, &spec, &who, &BucketHasher::new(secret.as_deref()));
        prop_assert_eq!(Some(bucket), again);
    }

    #[test]
    fn missing_headers_mean_no_bucket(spec in key_spec(), client in any::<IpAddr>()) {
        let headers = HeaderMap::new();
        let who = RequestIdentity { client, ipv6_prefix: 64, headers: &headers, ip_buckets: None };
        let bucket = bucket_for("s", &spec, &who, &BucketHasher::new(None));
        let needs_header = spec.parts.iter().any(|p| matches!(p, KeyPart::Header(_)));
        prop_assert_eq!(bucket.is_none(), needs_header);
    }

    #[test]
    fn one_ipv6_64_is_one_bucket_at_64_and_many_at_128(
        network in any::<u64>().prop_filter("not the IPv4-mapped range", |n| *n != 0),
        a in any::<u64>(),
        b in any::<u64>(),
        secret in secret(),
    ) {
        prop_assume!(a != b);
        let addr = |host: u64| IpAddr::V6(Ipv6Addr::from((u128::from(network) << 64) | u128::from(host)));
        let spec = KeySpec { parts: vec![KeyPart::Ip] };
        let hasher = BucketHasher::new(secret.as_deref());
        let headers = HeaderMap::new();
        let bucket = |host: u64, prefix: u8| {
            let who = RequestIdentity { client: addr(host), ipv6_prefix: prefix, headers: &headers, ip_buckets: None };
            bucket_for("s", &spec, &who, &hasher).expect("ip bucket")
        };
        prop_assert_eq!(bucket(a, 64), bucket(b, 64));
        prop_assert_ne!(bucket(a, 128), bucket(b, 128));
        prop_assert_eq!(ip_subject(addr(a), 64), ip_subject(addr(b), 64));
    }

    #[test]
    fn different_secrets_give_different_digests(
        one in prop::collection::vec(any::<u8>(), 0..64),
        two in prop::collection::vec(any::<u8>(), 0..64),
        subject in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let a = BucketHasher::new(Some(&one));
        let b = BucketHasher::new(Some(&two));
        let plain = BucketHasher::new(None);
        prop_assert_eq!(a.digest(&subject), BucketHasher::new(Some(&one)).digest(&subject));
        prop_assert_ne!(a.digest(&subject), plain.digest(&subject));
        // HMAC pads keys shorter than the block with zeros, so `k` and `k\0` are one key: only
        // keys that differ after trailing zeros are removed must give different digests.
        let trimmed = |k: &[u8]| k.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        if one[..trimmed(&one)] != two[..trimmed(&two)] {
            prop_assert_ne!(a.digest(&subject), b.digest(&subject));
            prop_assert_ne!(a.fingerprint(), b.fingerprint());
        }
    }
}
