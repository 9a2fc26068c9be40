//! Request smuggling and limit bypass on the wire (contract §4a, §5 and §9).
//!
//! Every case here writes raw bytes on one TCP connection to a tollgate in front of the
//! recording upstream, once on each pairing of tollgate's HTTP/1.1 servers and clients
//! (`crate::common::paths`): whichever reads the bytes, the verdict must be the same. The
//! smuggling payloads try to make a second request (always to `/smuggled`) appear behind the
//! first one; tollgate must answer `400` or close the connection, and the upstream must never
//! see `/smuggled` (nor, unless a case says so, the first request).
//! The positive controls show that legitimate framing (pipelining, chunked bodies with trailers,
//! one clean `Content-Length`, `CHUNKED` in capitals, a tab before `chunked`) still works, so
//! the refusals are not a guard that refuses everything.
//!
//! The second half checks contract §4a on a route limited to one request per 366 days: once the
//! budget is spent, every other spelling of the limited path is limited too, the dangerous
//! spellings get 400, and a path that is merely different (case) is a different path.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::paths::*;
use crate::common::*;

/// How long a refused connection may take to close (a hung connection fails the case).
const CLOSE_WITHIN: Duration = Duration::from_secs(3);
/// Time given to a forwarded request to reach the upstream before its log is read.
const SETTLE: Duration = Duration::from_millis(200);

/// The request every smuggling payload tries to hide behind the first one.
const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n";

/// Routes after the shared preamble ([`BASE`]).
const ROUTES: &str = r#"
[[routes]]
name = "oauth.register"
path_prefix = "/oauth/register"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "366d"

[[routes]]
name = "open"
upstream = "app"
"#;

/// The recording upstream, and tollgate with [`BASE`] and [`ROUTES`] in front of it on `paths`.
async fn setup(paths: Paths) -> (Upstream, Proxy) {
    let upstream = Upstream::start().await;
    let config = config_from(&format!("{BASE}{ROUTES}"), upstream.addr, &[]);
    let proxy = paths.start(config).await;
    (upstream, proxy)
}

/// What came back on one connection.
struct Wire {
    bytes: Vec<u8>,
    /// The server closed (EOF or reset) within [`CLOSE_WITHIN`].
    closed: bool,
}

impl Wire {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).to_string()
    }

    /// Status codes of the responses, in order, walking them by their framing
    /// (`Content-Length`, chunked, or until the close).
    fn statuses(&self) -> Vec<u16> {
        let mut out = Vec::new();
        let mut rest = &self.bytes[..];
        while !rest.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut response = httparse::Response::new(&mut headers);
            let Ok(httparse::Status::Complete(head)) = response.parse(rest) else {
                break;
            };
            let Some(code) = response.code else { break };
            out.push(code);
            let field = |name: &str| {
                response
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).trim().to_ascii_lowercase())
            };
            rest = &rest[head..];
            if (100..200).contains(&code) {
                continue;
            }
            if field("transfer-encoding").as_deref() == Some("chunked") {
                rest = skip_chunked(rest);
            } else if let Some(length) = field("content-length").and_then(|v| v.parse().ok()) {
                rest = &rest[rest.len().min(length)..];
            } else {
                break;
            }
        }
        out
    }
}

/// What follows a chunked body (or nothing, if it is incomplete).
fn skip_chunked(mut rest: &[u8]) -> &[u8] {
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return &[];
        };
        let line = String::from_utf8_lossy(&rest[..eol]).to_string();
        let size_text = line.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_text, 16) else {
            return &[];
        };
        rest = &rest[eol + 2..];
        if size == 0 {
            // Trailer lines until an empty one.
            loop {
                let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                    return &[];
                };
                rest = &rest[eol + 2..];
                if eol == 0 {
                    return rest;
                }
            }
        }
        if rest.len() < size + 2 {
            return &[];
        }
        rest = &rest[size + 2..];
    }
}

/// Writes `payload` on a fresh connection and reads until the server closes it or
/// [`CLOSE_WITHIN`] passes. Write errors are ignored: a server may close while we write.
async fn exchange(addr: std::net::SocketAddr, payload: &[u8]) -> Wire {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let _ = stream.write_all(payload).await;
    let mut bytes = Vec::new();
    let deadline = tokio::time::Instant::now() + CLOSE_WITHIN;
    let mut buf = [0u8; 4096];
    let closed = loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => break false,
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => bytes.extend_from_slice(&buf[..n]),
        }
    };
    Wire { bytes, closed }
}

/// Paths (with query) the upstream received, after letting in-flight requests land.
async fn upstream_paths(upstream: &Upstream) -> Vec<String> {
    tokio::time::sleep(SETTLE).await;
    upstream.requests().into_iter().map(|r| r.uri).collect()
}

/// How a refused payload must be answered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The first request itself is malformed: exactly one `400`, then the connection closes.
    BadRequest,
    /// A later part is malformed: at most a `400`, and the connection closes.
    BadRequestOrClose,
}

/// Sends `payload` on every pairing of the HTTP/1.1 paths and checks the smuggling verdict
/// there: `400` (or a close), never `/smuggled` upstream, and nothing upstream but the paths in
/// `may_reach`.
async fn assert_refused(payload: &[u8], expect: Expect, may_reach: &[&str]) {
    on_every_path(|paths| refused_on(paths, payload, expect, may_reach)).await;
}

/// [`assert_refused`] on `paths`.
async fn refused_on(paths: Paths, payload: &[u8], expect: Expect, may_reach: &[&str]) {
    let (upstream, proxy) = setup(paths).await;
    let wire = exchange(proxy.addr, payload).await;
    let shown = String::from_utf8_lossy(payload).escape_debug().to_string();
    let statuses = wire.statuses();
    let seen = upstream_paths(&upstream).await;
    assert!(
        !seen.iter().any(|p| p.contains("smuggled")),
        "a smuggled request reached the upstream: sent {shown:?}; upstream saw {seen:?}; \
         client got {:?}",
        wire.text()
    );
    assert!(
        seen.iter().all(|p| may_reach.contains(&p.as_str())),
        "sent {shown:?}; upstream saw {seen:?}, expected at most {may_reach:?}; client got {:?}",
        wire.text()
    );
    match expect {
        Expect::BadRequest => assert_eq!(
            statuses,
            vec![400],
            "sent {shown:?}; got {:?}; upstream saw {seen:?}",
            wire.text()
        ),
        Expect::BadRequestOrClose => assert!(
            statuses.is_empty() || statuses == vec![400],
            "sent {shown:?}; got {:?}; upstream saw {seen:?}",
            wire.text()
        ),
    }
    assert!(
        wire.closed,
        "connection left open after {shown:?}; got {:?}",
        wire.text()
    );
}

/// `POST /first` with the given framing header lines and body, then [`SMUGGLED`].
fn post_with(header_lines: &str, body: &str) -> Vec<u8> {
    format!("POST /first HTTP/1.1\r\nHost: t\r\n{header_lines}\r\n{body}{SMUGGLED}").into_bytes()
}

/// The CL.TE / TE.TE shape: `Content-Length` covers the terminating chunk *and* the smuggled
/// request (one request to a length-reader), while a chunked reader stops after `0`.
fn length_covers_smuggled(te_line: &str) -> Vec<u8> {
    let body = "0\r\n\r\n";
    let length = body.len() + SMUGGLED.len();
    format!(
        "POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n{te_line}\r\n\r\n{body}{SMUGGLED}"
    )
    .into_bytes()
}

// ---------------------------------------------------------------------------------------------
// Content-Length and Transfer-Encoding together

#[tokio::test]
async fn cl_te_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding: chunked"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_cl_is_refused() {
    // A chunked reader sees one chunk holding the smuggled request; a length reader stops
    // after the chunk-size line and then finds the smuggled request.
    let chunk = SMUGGLED;
    let size_line = format!("{:x}\r\n", chunk.len());
    let payload = format!(
        "POST /first HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: {}\r\n\r\n{size_line}{chunk}\r\n0\r\n\r\n",
        size_line.len()
    );
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn cl_te_with_lowercase_and_uppercase_names_is_refused() {
    let body = "0\r\n\r\n";
    let payload = format!(
        "POST /first HTTP/1.1\r\nHost: t\r\ncontent-length: {}\r\nTRANSFER-ENCODING: chunked\r\n\r\n{body}{SMUGGLED}",
        body.len() + SMUGGLED.len()
    );
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn cl_te_with_zero_length_is_refused() {
    assert_refused(
        &post_with(
            "Content-Length: 0\r\nTransfer-Encoding: chunked\r\n",
            "0\r\n\r\n",
        ),
        Expect::BadRequest,
        &[],
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// TE.TE: obfuscated Transfer-Encoding, with a Content-Length for the other reader...

#[tokio::test]
async fn te_te_xchunked_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding: xchunked"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_chunked_identity_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding: chunked, identity"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_space_before_colon_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding : chunked"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_tab_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding:\tchunked"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_second_te_line_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding: chunked\r\nTransfer-Encoding: identity"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_trailing_cr_junk_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding: chunked\rX-Junk: 1"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_uppercase_with_length_is_refused() {
    assert_refused(
        &length_covers_smuggled("Transfer-Encoding: CHUNKED"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_te_vertical_tab_and_quotes_with_length_are_refused() {
    for te in [
        "Transfer-Encoding:\x0bchunked",
        "Transfer-Encoding: \"chunked\"",
    ] {
        assert_refused(&length_covers_smuggled(te), Expect::BadRequest, &[]).await;
    }
}

// ...and alone: a Transfer-Encoding whose final coding is not exactly `chunked` (RFC 9112 6.3:
// 400 and close), or a malformed field line.

#[tokio::test]
async fn te_xchunked_alone_is_refused() {
    assert_refused(
        &post_with("Transfer-Encoding: xchunked\r\n", "0\r\n\r\n"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_chunked_identity_alone_is_refused() {
    assert_refused(
        &post_with("Transfer-Encoding: chunked, identity\r\n", "0\r\n\r\n"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_space_before_colon_alone_is_refused() {
    // RFC 9112 5.1: whitespace between field name and colon must be answered with 400.
    assert_refused(
        &post_with("Transfer-Encoding : chunked\r\n", "0\r\n\r\n"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn te_second_line_alone_is_refused() {
    for lines in [
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        "Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    ] {
        assert_refused(&post_with(lines, "0\r\n\r\n"), Expect::BadRequest, &[]).await;
    }
}

#[tokio::test]
async fn te_trailing_cr_junk_alone_is_refused() {
    for line in [
        "Transfer-Encoding: chunked\r\r\n",
        "Transfer-Encoding: chunked\rX-Junk: 1\r\n",
    ] {
        assert_refused(&post_with(line, "0\r\n\r\n"), Expect::BadRequest, &[]).await;
    }
}

#[tokio::test]
async fn http10_with_transfer_encoding_is_refused() {
    let payload = format!(
        "POST /first HTTP/1.0\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{SMUGGLED}"
    );
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

// ---------------------------------------------------------------------------------------------
// Content-Length alone, but not canonical

#[tokio::test]
async fn duplicate_identical_content_length_is_refused() {
    let body = "hello";
    assert_refused(
        &post_with("Content-Length: 5\r\nContent-Length: 5\r\n", body),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn duplicate_differing_content_length_is_refused() {
    // One reader takes 5 bytes and then the smuggled request, the other swallows it.
    let body = "hello";
    let long = body.len() + SMUGGLED.len();
    assert_refused(
        &post_with(
            &format!("Content-Length: 5\r\nContent-Length: {long}\r\n"),
            body,
        ),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn content_length_list_is_refused() {
    assert_refused(
        &post_with("Content-Length: 5, 5\r\n", "hello"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn content_length_with_leading_zero_is_refused() {
    // Decimal 10 to most parsers, octal 8 to some.
    assert_refused(
        &post_with("Content-Length: 010\r\n", "01234567"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn content_length_with_plus_sign_is_refused() {
    assert_refused(
        &post_with("Content-Length: +5\r\n", "hello"),
        Expect::BadRequest,
        &[],
    )
    .await;
}

#[tokio::test]
async fn content_length_negative_or_hex_is_refused() {
    for line in ["Content-Length: -1\r\n", "Content-Length: 0x5\r\n"] {
        assert_refused(&post_with(line, "hello"), Expect::BadRequest, &[]).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Chunked bodies

#[tokio::test]
async fn chunk_size_overflow_is_refused() {
    // 2^72 - 1: a parser that wraps reads a small size and takes the rest as a new request.
    assert_refused(
        &post_with(
            "Transfer-Encoding: chunked\r\n",
            "ffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
        ),
        Expect::BadRequestOrClose,
        &["/first"],
    )
    .await;
}

#[tokio::test]
async fn chunk_data_longer_than_its_size_is_refused() {
    // The size says 3, the data runs on into the smuggled request.
    let payload = format!(
        "POST /first HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc{SMUGGLED}\r\n0\r\n\r\n"
    );
    assert_refused(payload.as_bytes(), Expect::BadRequestOrClose, &["/first"]).await;
}

#[tokio::test]
async fn chunk_size_line_with_bare_lf_is_refused() {
    assert_refused(
        &post_with("Transfer-Encoding: chunked\r\n", "5\nhello\r\n0\r\n\r\n"),
        Expect::BadRequestOrClose,
        &["/first"],
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Line endings and field syntax

#[tokio::test]
async fn bare_lf_request_line_is_refused() {
    let payload = format!("GET /first HTTP/1.1\nHost: t\r\n\r\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn bare_lf_header_line_is_refused() {
    let payload = format!("GET /first HTTP/1.1\r\nHost: t\nX-A: 1\r\n\r\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn bare_lf_throughout_is_refused() {
    // No CRLF anywhere: two requests that end with LF only. README: "bare-LF line endings ...
    // get 400 and the connection closes, so no request can be smuggled behind another".
    let payload = "GET /first HTTP/1.1\nHost: t\n\nGET /smuggled HTTP/1.1\nHost: t\n\n";
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

async fn bare_lf_head_in_its_own_segment_is_refused(paths: Paths) {
    // The same bytes as `head_ending_in_crlf_lf_is_refused`, but the first head arrives on its
    // own and the next request a moment later: the verdict must not depend on segmentation.
    let (upstream, proxy) = setup(paths).await;
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let _ = stream
        .write_all(b"GET /first HTTP/1.1\r\nHost: t\r\n\n")
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stream.write_all(SMUGGLED.as_bytes()).await;
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(CLOSE_WITHIN, stream.read_to_end(&mut bytes)).await;
    let wire = Wire {
        bytes,
        closed: true,
    };
    let seen = upstream_paths(&upstream).await;
    assert!(
        seen.is_empty(),
        "a head ending in CRLF LF was forwarded: upstream saw {seen:?}; client got {:?}",
        wire.text()
    );
    assert_eq!(wire.statuses(), vec![400], "{}", wire.text());
}

#[tokio::test]
async fn head_ending_in_crlf_lf_is_refused() {
    let payload = format!("GET /first HTTP/1.1\r\nHost: t\r\n\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn obs_fold_is_refused() {
    // A folding reader joins the TE line into X-A; a non-folding one sees Transfer-Encoding.
    let body = "0\r\n\r\n";
    let payload = format!(
        "POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nX-A: 1\r\n Transfer-Encoding: chunked\r\n\r\n{body}{SMUGGLED}",
        body.len() + SMUGGLED.len()
    );
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
    let tab = format!("GET /first HTTP/1.1\r\nHost: t\r\nX-A: 1\r\n\tcontinued\r\n\r\n{SMUGGLED}");
    assert_refused(tab.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn nul_in_header_value_is_refused() {
    let payload = format!("GET /first HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\n\r\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

// ---------------------------------------------------------------------------------------------
// Host

#[tokio::test]
async fn two_host_headers_are_refused() {
    let payload = format!("GET /first HTTP/1.1\r\nHost: t\r\nHost: u\r\n\r\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn absolute_form_disagreeing_with_host_is_refused() {
    let payload = format!("GET http://other.test/first HTTP/1.1\r\nHost: t\r\n\r\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

#[tokio::test]
async fn missing_host_is_refused() {
    let payload = format!("GET /first HTTP/1.1\r\nX-A: 1\r\n\r\n{SMUGGLED}");
    assert_refused(payload.as_bytes(), Expect::BadRequest, &[]).await;
}

// ---------------------------------------------------------------------------------------------
// The guard must stay on after an upgrade request that was not upgraded

async fn guard_stays_on_after_an_upgrade_the_upstream_declined(paths: Paths) {
    // The upstream answers `/first` with 200, not 101, so the connection remains HTTP/1.1 and
    // what follows is an ordinary (ambiguous) request: CL.TE must still get a 400 or a close,
    // and the second request must not be forwarded.
    let body = "0\r\n\r\n";
    let payload = format!(
        "GET /first HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n\
         POST /second HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{body}{SMUGGLED}",
        body.len() + SMUGGLED.len()
    );
    let (upstream, proxy) = setup(paths).await;
    let wire = exchange(proxy.addr, payload.as_bytes()).await;
    let seen = upstream_paths(&upstream).await;
    assert!(wire.closed, "connection left open: {:?}", wire.text());
    assert!(
        !seen.iter().any(|p| p.contains("smuggled")),
        "upstream saw {seen:?}"
    );
    assert!(
        seen.iter().all(|p| p == "/first"),
        "the CL.TE request behind a declined upgrade was forwarded: upstream saw {seen:?}; \
         client got {:?}",
        wire.text()
    );
}

async fn guard_stays_on_after_an_upgrade_the_upstream_declined_bare_lf(paths: Paths) {
    let payload = format!(
        "GET /first HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n\
         GET /second HTTP/1.1\nHost: t\n\n{SMUGGLED}"
    );
    let (upstream, proxy) = setup(paths).await;
    let wire = exchange(proxy.addr, payload.as_bytes()).await;
    let seen = upstream_paths(&upstream).await;
    assert!(
        seen.iter().all(|p| p == "/first"),
        "requests behind a declined upgrade bypassed the framing guard: upstream saw {seen:?}; \
         client got {:?}",
        wire.text()
    );
    assert!(wire.closed, "connection left open: {:?}", wire.text());
}

// ---------------------------------------------------------------------------------------------
// A denied request's unread body is never taken for a request

async fn body_of_a_denied_request_is_not_read_as_a_request(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    let first = exchange(
        proxy.addr,
        b"GET /oauth/register HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(first.statuses(), vec![200], "{}", first.text());
    let payload = format!(
        "POST /oauth/register HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{SMUGGLED}",
        SMUGGLED.len()
    );
    let wire = exchange(proxy.addr, payload.as_bytes()).await;
    let seen = upstream_paths(&upstream).await;
    assert_eq!(wire.statuses(), vec![429], "{}", wire.text());
    assert!(wire.closed, "connection left open: {:?}", wire.text());
    assert_eq!(seen, vec!["/oauth/register".to_string()]);
}

// ---------------------------------------------------------------------------------------------
// Positive controls: legitimate framing works

async fn pipelined_pair_both_reach_the_upstream(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    let wire = exchange(
        proxy.addr,
        b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(wire.closed, "{}", wire.text());
    assert_eq!(wire.statuses(), vec![200, 200], "{}", wire.text());
    assert_eq!(upstream_paths(&upstream).await, vec!["/a", "/b"]);
}

async fn pipelined_after_a_length_body_reaches_the_upstream(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    let wire = exchange(
        proxy.addr,
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhelloGET /b HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(wire.statuses(), vec![200, 200], "{}", wire.text());
    assert_eq!(upstream_paths(&upstream).await, vec!["/echo", "/b"]);
    assert_eq!(&upstream.requests()[0].body[..], b"hello");
}

/// A chunked body whose data looks like a request, then a pipelined request, on `paths`; `te`
/// is the Transfer-Encoding field line.
async fn chunked_body_is_one_body(paths: Paths, te: &str) {
    let (upstream, proxy) = setup(paths).await;
    let data = SMUGGLED;
    let payload = format!(
        "POST /echo HTTP/1.1\r\nHost: t\r\n{te}\r\nTrailer: x-check\r\n\r\n\
         {:x};ext=1\r\n{data}\r\n3\r\nend\r\n0\r\nx-check: 1\r\n\r\n\
         GET /after HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        data.len()
    );
    let wire = exchange(proxy.addr, payload.as_bytes()).await;
    assert!(wire.closed, "{}", wire.text());
    assert_eq!(wire.statuses(), vec![200, 200], "{te:?}: {}", wire.text());
    assert_eq!(upstream_paths(&upstream).await, vec!["/echo", "/after"]);
    let expected = format!("{data}end");
    assert_eq!(
        String::from_utf8_lossy(&upstream.requests()[0].body),
        expected
    );
    assert!(wire.text().contains(&expected), "{}", wire.text());
}

#[tokio::test]
async fn chunked_with_trailers_reaches_the_upstream_intact() {
    on_every_path(|paths| chunked_body_is_one_body(paths, "Transfer-Encoding: chunked")).await;
}

#[tokio::test]
async fn uppercase_chunked_alone_is_legal() {
    // RFC 9112 7: transfer coding names are case-insensitive.
    on_every_path(|paths| chunked_body_is_one_body(paths, "Transfer-Encoding: CHUNKED")).await;
}

#[tokio::test]
async fn tab_before_chunked_alone_is_legal() {
    // RFC 9110 5.6.3: OWS after the colon is spaces or tabs.
    on_every_path(|paths| chunked_body_is_one_body(paths, "Transfer-Encoding:\tchunked")).await;
}

async fn one_clean_content_length_is_one_body(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    let payload = format!(
        "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{SMUGGLED}",
        SMUGGLED.len()
    );
    let wire = exchange(proxy.addr, payload.as_bytes()).await;
    assert!(wire.closed, "{}", wire.text());
    assert_eq!(wire.statuses(), vec![200], "{}", wire.text());
    assert_eq!(upstream_paths(&upstream).await, vec!["/echo"]);
    assert_eq!(&upstream.requests()[0].body[..], SMUGGLED.as_bytes());
}

// ---------------------------------------------------------------------------------------------
// contract §4a: a limited path cannot be reached under another spelling

/// One request on its own connection; the status (0 when there was no response).
async fn status_of(addr: std::net::SocketAddr, target: &str) -> u16 {
    let request = format!("GET {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    let wire = exchange(addr, request.as_bytes()).await;
    wire.statuses().first().copied().unwrap_or(0)
}

/// Spends the one request of `/oauth/register`'s budget.
async fn spend_budget(upstream: &Upstream, proxy: &Proxy) {
    assert_eq!(status_of(proxy.addr, "/oauth/register").await, 200);
    assert_eq!(upstream_paths(upstream).await, vec!["/oauth/register"]);
}

async fn other_spellings_of_a_limited_path_are_limited(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    spend_budget(&upstream, &proxy).await;
    let spellings = [
        "/oauth/%72egister",
        "/oauth/%72%65gister",
        "/%6Fauth/register",
        "/%6fauth/register",
        "/x/../oauth/register",
        "/OAUTH/../oauth/register",
        "//oauth//register",
        "/oauth///register",
        "/oauth/./register",
        "/oauth/%2e/register",
        "/oauth/register/",
        "/oauth/register/.",
        "/oauth/register/x/..",
        "/oauth/register?x=1",
        "/oauth/register/anything",
        "http://t/oauth/%72egister",
    ];
    let mut wrong = Vec::new();
    for spelling in spellings {
        let status = status_of(proxy.addr, spelling).await;
        if status != 429 {
            wrong.push(format!("{spelling} -> {status}"));
        }
    }
    let seen = upstream_paths(&upstream).await;
    assert!(
        wrong.is_empty(),
        "not limited: {wrong:?}; upstream saw {seen:?}"
    );
    assert_eq!(seen, vec!["/oauth/register"]);
}

async fn a_different_case_is_a_different_path(paths: Paths) {
    // RFC 3986 6.2.2.1: only the scheme and host are case-insensitive. contract §4a normalises
    // escapes and dot segments, not case, so `/OAUTH/register` is another path: it falls to
    // the unlimited route and goes upstream as spelled.
    let (upstream, proxy) = setup(paths).await;
    spend_budget(&upstream, &proxy).await;
    assert_eq!(status_of(proxy.addr, "/OAUTH/register").await, 200);
    assert_eq!(
        upstream_paths(&upstream).await,
        vec!["/oauth/register", "/OAUTH/register"]
    );
}

async fn dangerous_spellings_get_400_and_never_reach_the_upstream(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    spend_budget(&upstream, &proxy).await;
    let dangerous = [
        "/oauth/register%2F",
        "/oauth/register%2f",
        "/oauth%2Fregister",
        "/..%2Foauth/register",
        "/%2e%2e/oauth/register",
        "/%2E%2E/oauth/register",
        "/../oauth/register",
        "/oauth/../../oauth/register",
        "/oauth/register%00",
        "/oauth/%00/register",
        "/oauth/register%zz",
        "/oauth/register%4",
    ];
    let mut wrong = Vec::new();
    for spelling in dangerous {
        let status = status_of(proxy.addr, spelling).await;
        if status != 400 {
            wrong.push(format!("{spelling} -> {status}"));
        }
    }
    let seen = upstream_paths(&upstream).await;
    assert!(
        wrong.is_empty(),
        "not refused: {wrong:?}; upstream saw {seen:?}"
    );
    assert_eq!(seen, vec!["/oauth/register"]);
}

async fn the_normalised_path_is_what_goes_upstream(paths: Paths) {
    let (upstream, proxy) = setup(paths).await;
    assert_eq!(
        status_of(proxy.addr, "/other/%61b/./c/..//d%3f?q=%72&x=../y").await,
        200
    );
    assert_eq!(
        upstream_paths(&upstream).await,
        vec!["/other/ab/d%3F?q=%72&x=../y"]
    );
}

every_path_tests!(
    bare_lf_head_in_its_own_segment_is_refused,
    guard_stays_on_after_an_upgrade_the_upstream_declined,
    guard_stays_on_after_an_upgrade_the_upstream_declined_bare_lf,
    body_of_a_denied_request_is_not_read_as_a_request,
    pipelined_pair_both_reach_the_upstream,
    pipelined_after_a_length_body_reaches_the_upstream,
    one_clean_content_length_is_one_body,
    other_spellings_of_a_limited_path_are_limited,
    a_different_case_is_a_different_path,
    dangerous_spellings_get_400_and_never_reach_the_upstream,
    the_normalised_path_is_what_goes_upstream,
);
