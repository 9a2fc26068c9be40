//! Attacks on tollgate's own HTTP/1.1 path for simple requests (`http1::server`)
//! and its hand-over to the framing guard and hyper.
//!
//! The main tool is a differential one: the same bytes are sent on fresh connections to
//! tollgates that differ only in the HTTP/1.1 paths they serve them on
//! (`ServerBuilder::http1_fast_path`, `ServerBuilder::http1_direct_client`, [`Paths`]): hyper's
//! server and client, tollgate's own server and client, and tollgate's own server with hyper's
//! client. Whatever the upstream answers, the client must read the same thing on all of them.
//! Other tests attack the request side (smuggling around the hand-over), liveness and
//! cancellation.
//!
//! Every wait is bounded: a hang fails the test.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::wire::*;
use crate::common::*;

// ---------------------------------------------------------------------------------------------
// Raw client helpers.

/// What came back on one connection: the bytes, and whether tollgate closed it.
struct Transcript {
    bytes: Vec<u8>,
    closed: bool,
}

/// Connects, writes each of `writes` (pausing `pause` between them), then reads until tollgate
/// closes the connection or nothing arrives for `quiet`.
async fn transcript(
    addr: SocketAddr,
    writes: &[&[u8]],
    pause: Duration,
    quiet: Duration,
) -> Transcript {
    let mut stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
        .await
        .expect("connect within 5 s")
        .expect("connect");
    let mut out = Vec::new();
    for (i, bytes) in writes.iter().enumerate() {
        if i > 0 {
            // Whatever arrives meanwhile is kept.
            let deadline = Instant::now() + pause;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let mut chunk = [0u8; 16384];
                match tokio::time::timeout(left, stream.read(&mut chunk)).await {
                    Err(_) => break,
                    Ok(Ok(0) | Err(_)) => {
                        return Transcript {
                            bytes: out,
                            closed: true,
                        }
                    }
                    Ok(Ok(n)) => out.extend_from_slice(&chunk[..n]),
                }
            }
        }
        if stream.write_all(bytes).await.is_err() {
            break;
        }
    }
    let closed = loop {
        let mut chunk = [0u8; 16384];
        match tokio::time::timeout(quiet, stream.read(&mut chunk)).await {
            Err(_) => break false,
            Ok(Ok(0) | Err(_)) => break true,
            Ok(Ok(n)) => out.extend_from_slice(&chunk[..n]),
        }
    };
    Transcript { bytes: out, closed }
}

/// A chunked body from the start of `buf`: its data, its trailer section and the bytes it
/// took; `None` when it is incomplete or malformed.
fn dechunk(buf: &[u8]) -> Option<(Vec<u8>, String, usize)> {
    let mut at = 0;
    let mut body = Vec::new();
    loop {
        let line_end = at + find(&buf[at..], b"\r\n")?;
        let line = std::str::from_utf8(&buf[at..line_end]).ok()?;
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            let end = at + find(&buf[at..], b"\r\n")?;
            if end == at {
                return Some((body, String::new(), at + 2));
            }
            let section_end = at + find(&buf[at..], b"\r\n\r\n")? + 4;
            return Some((body, lossy(&buf[at..section_end]), section_end));
        }
        if buf.len() < at + size + 2 || &buf[at + size..at + size + 2] != b"\r\n" {
            return None;
        }
        body.extend_from_slice(&buf[at..at + size]);
        at += size + 2;
    }
}

/// The responses in a transcript, one line each: the head (with `date` and `x-request-id`
/// masked), then the body as the client reads it (chunk boundaries are the upstream's timing,
/// not framing, and are left out); `heads_only`: the first response answers a HEAD.
fn responses(t: &Transcript, heads_only: bool) -> String {
    let mut out = String::new();
    let mut rest: &[u8] = &t.bytes;
    let mut first = true;
    while !rest.is_empty() {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut response = httparse::Response::new(&mut fields);
        let Ok(httparse::Status::Complete(head_len)) = response.parse(rest) else {
            out.push_str(&format!(
                "[unparsed: {:?}]",
                lossy(&rest[..rest.len().min(200)])
            ));
            break;
        };
        let status = response.code.unwrap_or(0);
        let header = |name: &str| {
            response
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| lossy(h.value))
        };
        let chunked = header("transfer-encoding").is_some_and(|v| v.ends_with("chunked"));
        let length = header("content-length").and_then(|v| v.parse::<usize>().ok());
        out.push_str(&in_name_order(&masked(&lossy(&rest[..head_len]))));
        let body = &rest[head_len..];
        let no_body = (first && heads_only) || matches!(status, 100..=199 | 204 | 304);
        first = false;
        let used = if no_body {
            0
        } else if chunked {
            match dechunk(body) {
                Some((data, trailers, used)) => {
                    out.push_str(&format!(
                        "<chunked {:?} trailers {trailers:?}>",
                        lossy(&data)
                    ));
                    used
                }
                None => {
                    out.push_str(&format!(
                        "<bad chunked: {:?}>",
                        lossy(&body[..body.len().min(200)])
                    ));
                    body.len()
                }
            }
        } else if let Some(length) = length {
            let used = length.min(body.len());
            out.push_str(&format!(
                "<{} of {length} bytes: {:?}>",
                used,
                lossy(&body[..used.min(40)])
            ));
            used
        } else {
            out.push_str(&format!(
                "<until close: {:?}>",
                lossy(&body[..body.len().min(40)])
            ));
            body.len()
        };
        out.push('\n');
        rest = &body[used..];
    }
    out.push_str(if t.closed { "[closed]" } else { "[open]" });
    out
}

// ---------------------------------------------------------------------------------------------
// 1. Differential: the simple path answers as hyper does, for every upstream answer shape.

/// Upstream answers of every shape, by target; HEAD gets the head alone.
fn shapes(method: &str, target: &str) -> Reply {
    let head = method == "HEAD";
    let with = |head_part: &str, body: &str| {
        if head {
            Reply::new(head_part.to_string())
        } else {
            Reply::new(format!("{head_part}{body}"))
        }
    };
    match target {
        "/cl" => with("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\n", "hello"),
        "/chunked" => with(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        ),
        "/chunk-ext" => with(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "5;a=b\r\nhello\r\n0\r\n\r\n",
        ),
        "/empty-chunked" => with(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "0\r\n\r\n",
        ),
        "/trailers" => with(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: grpc-status, content-type, x-t\r\n\r\n",
            "5\r\nhello\r\n0\r\ngrpc-status: 0\r\ncontent-type: x\r\nx-t: 1\r\nx-unannounced: 2\r\n\r\n",
        ),
        "/close-delimited" => with("HTTP/1.1 200 OK\r\nX-B: 2\r\n\r\n", "until the close").closing(),
        "/no-content" => Reply::new("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-C: 3\r\n\r\n"),
        "/not-modified" => Reply::new("HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\nETag: \"e\"\r\n\r\n"),
        "/reason" => with("HTTP/1.1 200 Fine Thanks\r\nContent-Length: 2\r\n\r\n", "ok"),
        "/odd-status" => with("HTTP/1.1 599 Whatever\r\nContent-Length: 2\r\n\r\n", "ok"),
        "/empty-reason" => with("HTTP/1.1 299 \r\nContent-Length: 2\r\n\r\n", "ok"),
        "/date" => with(
            "HTTP/1.1 200 OK\r\nDate: Mon, 01 Jan 2001 00:00:00 GMT\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/cookies" => with(
            "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-D: 4\r\nSet-Cookie: b=2\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/cl-list" => with("HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n", "hello"),
        "/te-and-cl" => with(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            "5\r\nhello\r\n0\r\n\r\n",
        ),
        "/te-gzip" => with(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "5\r\nhello\r\n0\r\n\r\n",
        ),
        "/continue" => with(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/switch" => Reply::new(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        ),
        "/short" => with("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", "abc").closing(),
        "/short-chunked" => with(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "5\r\nhello\r\n",
        )
        .closing(),
        "/upstream-close" => with(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n",
            "ok",
        )
        .closing(),
        "/upstream-keep-alive" => with(
            "HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/hop" => with(
            "HTTP/1.1 200 OK\r\nConnection: x-hop, keep-alive\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/big" => {
            let body = "x".repeat(100_000);
            with(&format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()), &body)
        }
        "/big-chunked" => {
            let chunk = "y".repeat(20_000);
            let body = format!("{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n", chunk.len(), chunk.len());
            with("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", &body)
        }
        "/dup-cl" => with(
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-E: 5\r\ncontent-length: 2\r\n\r\n",
            "ok",
        ),
        "/list-cl" => with("HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nX-E: 5\r\n\r\n", "ok"),
        "/padded-cl" => with("HTTP/1.1 200 OK\r\nX-E: 5\r\nContent-Length: 002\r\n\r\n", "ok"),
        "/hop-fields" => with(
            "HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nX-F: 6\r\nUpgrade: h2c\r\n\
             Proxy-Authenticate: Basic\r\nProxy-Connection: keep-alive\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/response-te" => with(
            "HTTP/1.1 200 OK\r\nTE: trailers\r\nX-G: 7\r\nContent-Length: 2\r\n\r\n",
            "ok",
        ),
        "/upper" => with(
            "HTTP/1.1 200 OK\r\nX-UP: Value\r\nDATE: Mon, 01 Jan 2001 00:00:00 GMT\r\n\
             CONTENT-LENGTH: 2\r\nCONNECTION: keep-alive\r\n\r\n",
            "ok",
        ),
        "/no-length-head" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n"),
        _ => Reply::ok(target),
    }
}

const SHAPES: &[&str] = &[
    "/cl",
    "/chunked",
    "/chunk-ext",
    "/empty-chunked",
    "/trailers",
    "/close-delimited",
    "/no-content",
    "/not-modified",
    "/reason",
    "/odd-status",
    "/empty-reason",
    "/date",
    "/cookies",
    "/cl-list",
    "/te-gzip",
    "/continue",
    "/switch",
    "/short",
    "/short-chunked",
    "/upstream-close",
    "/upstream-keep-alive",
    "/hop",
    "/big",
    "/big-chunked",
    "/dup-cl",
    "/list-cl",
    "/padded-cl",
    "/hop-fields",
    "/response-te",
    "/upper",
];

/// Asserts that tollgate's own server takes `request` (on a tollgate where it serves): the
/// differentials below compare the paths only if each request really takes the path its
/// tollgate is set up for.
fn assert_simple(request: &[u8]) {
    let taken = tollgate::testing::http1::server::simple_request(request).is_some();
    assert!(taken, "not taken by the simple path: {:?}", lossy(request));
}

/// tollgate with `config`, on one pairing of the HTTP/1.1 paths: tollgate's own server for simple
/// requests (`own_server`, else hyper's serves them all), and tollgate's own client for
/// requests without a body (`own_client`, else hyper's sends them all).
async fn proxy_on(
    config: tollgate::testing::config::Config,
    own_server: bool,
    own_client: bool,
) -> Proxy {
    let builder = tollgate::Server::builder(config)
        .http1_fast_path(own_server)
        .http1_direct_client(own_client);
    Proxy::start_built(builder).await
}

/// The pairings a differential compares, each a tollgate of its own with the same
/// configuration: hyper's server and client (what the others must match), tollgate's own
/// server and client, and tollgate's own server with hyper's client. (tollgate's own client
/// takes only the requests its own server read, and HTTP/2 ones: hyper's server with it is
/// hyper's pairing again.)
struct Paths {
    hyper: Proxy,
    own: Proxy,
    own_server: Proxy,
}

impl Paths {
    /// Each pairing with [`BASE`] and [`ROUTES`] in front of `upstream`.
    async fn start(upstream: SocketAddr) -> Paths {
        let text = format!("{BASE}{ROUTES}");
        Paths::start_with(&text, upstream).await
    }

    /// Each pairing with the configuration `text` in front of `upstream`.
    async fn start_with(text: &str, upstream: SocketAddr) -> Paths {
        let config = || config_from(text, upstream, &[]);
        Paths {
            hyper: proxy_on(config(), false, false).await,
            own: proxy_on(config(), true, true).await,
            own_server: proxy_on(config(), true, false).await,
        }
    }

    /// Each pairing, named, hyper's first.
    fn all(&self) -> [(&'static str, SocketAddr); 3] {
        [
            ("hyper's server and client", self.hyper.addr),
            ("the own server and client", self.own.addr),
            ("the own server with hyper's client", self.own_server.addr),
        ]
    }
}

/// Sends `request` (then, after a pause, a closing GET) on each pairing of `paths`, and
/// returns where one read differs from hyper's.
async fn differences(paths: &Paths, requests: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for request in requests {
        assert_simple(request.as_bytes());
        let follow = b"GET /end HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n";
        let pause = Duration::from_millis(150);
        let quiet = Duration::from_secs(2);
        let head = request.starts_with("HEAD");
        let mut read = Vec::new();
        for (label, addr) in paths.all() {
            let t = transcript(addr, &[request.as_bytes(), follow], pause, quiet).await;
            read.push((label, responses(&t, head)));
        }
        let (hyper_label, hyper) = &read[0];
        for (label, got) in &read[1..] {
            if got != hyper {
                found.push(format!(
                    "request {request:?}\n--- {label}:\n{got}\n--- {hyper_label}:\n{hyper}"
                ));
            }
        }
    }
    found
}

#[tokio::test]
async fn every_upstream_answer_shape_reaches_a_get_as_hyper_sends_it() {
    let upstream = RawUpstream::answering(shapes).await;
    let paths = Paths::start(upstream.addr).await;
    let requests: Vec<String> = SHAPES
        .iter()
        .map(|t| format!("GET {t} HTTP/1.1\r\nHost: wire.test\r\nTE: trailers\r\n\r\n"))
        .collect();
    let found = differences(&paths, &requests).await;
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[tokio::test]
async fn every_upstream_answer_shape_reaches_a_head_as_hyper_sends_it() {
    let upstream = RawUpstream::answering(shapes).await;
    let paths = Paths::start(upstream.addr).await;
    let mut targets: Vec<&str> = SHAPES.to_vec();
    targets.push("/no-length-head");
    let requests: Vec<String> = targets
        .iter()
        .map(|t| format!("HEAD {t} HTTP/1.1\r\nHost: wire.test\r\n\r\n"))
        .collect();
    let found = differences(&paths, &requests).await;
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// An upstream that repeats an equal `Content-Length`, lists it (`2, 2`) or pads it with zeros
/// (RFC 9110 8.6 lets a recipient take equal values as one) is answered on both paths with one
/// plain length, to a GET and to a HEAD alike: the client must not see two lengths or a list,
/// and a HEAD must not go unanswered.
#[tokio::test]
async fn a_length_the_upstream_repeats_reaches_the_client_once_on_both_paths() {
    let upstream = RawUpstream::answering(shapes).await;
    let paths = Paths::start(upstream.addr).await;
    for (method, target) in [
        ("GET", "/dup-cl"),
        ("HEAD", "/dup-cl"),
        ("GET", "/list-cl"),
        ("HEAD", "/list-cl"),
        ("GET", "/padded-cl"),
        ("HEAD", "/padded-cl"),
    ] {
        let request =
            format!("{method} {target} HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n");
        assert_simple(request.as_bytes());
        for (path, addr) in paths.all() {
            let got = transcript(addr, &[request.as_bytes()], Duration::ZERO, WAIT).await;
            let text = lossy(&got.bytes);
            let head = text.split("\r\n\r\n").next().unwrap_or("");
            assert!(
                head.starts_with("HTTP/1.1 200"),
                "{method} {target} on {path}: {text:?}"
            );
            let lengths: Vec<&str> = head
                .split("\r\n")
                .filter(|l| l.to_ascii_lowercase().starts_with("content-length:"))
                .collect();
            assert_eq!(
                lengths,
                ["content-length: 2"],
                "{method} {target} on {path}: {text:?}"
            );
        }
    }
}

#[tokio::test]
async fn every_upstream_answer_shape_reaches_a_closing_get_without_trailers_as_hyper_sends_it() {
    let upstream = RawUpstream::answering(shapes).await;
    let paths = Paths::start(upstream.addr).await;
    let requests: Vec<String> = SHAPES
        .iter()
        .map(|t| format!("GET {t} HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n"))
        .collect();
    let found = differences(&paths, &requests).await;
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[tokio::test]
async fn tollgate_own_answers_reach_the_client_as_hyper_sends_them() {
    let upstream = RawUpstream::answering(shapes).await;
    let paths = Paths::start(upstream.addr).await;
    let requests: Vec<String> = [
        // No route (404), for GET and HEAD.
        "GET /x HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n",
        "HEAD /x HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n",
        // Never forwarded (405).
        "TRACE / HTTP/1.1\r\nHost: wire.test\r\n\r\n",
        // No Host (400).
        "GET / HTTP/1.1\r\n\r\n",
        // Two Hosts.
        "GET / HTTP/1.1\r\nHost: wire.test\r\nHost: other.test\r\n\r\n",
        // Asterisk and absolute forms.
        "OPTIONS * HTTP/1.1\r\nHost: wire.test\r\n\r\n",
        "GET http://wire.test/abs HTTP/1.1\r\nHost: other.test\r\n\r\n",
        "GET http://other.test/abs HTTP/1.1\r\nHost: wire.test\r\n\r\n",
        // A path that normalises badly.
        "GET /a/../../b HTTP/1.1\r\nHost: wire.test\r\n\r\n",
        "GET /%2e%2e/x HTTP/1.1\r\nHost: wire.test\r\n\r\n",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let found = differences(&paths, &requests).await;
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The fields tollgate sets on a response (`X-Request-Id`, and with `rate_limit_headers =
/// "both"` the draft pair and the legacy trio) are written by the simple path as lines behind
/// the map's fields, not inserted (`headers::AddTo`). An upstream that sends its own copies:
/// on both paths the client gets tollgate's alone, in the same place; on a route without
/// limits only `X-Request-Id` is tollgate's, and the upstream's rate-limit fields pass.
#[tokio::test]
async fn fields_tollgate_sets_replace_the_upstreams_on_both_paths_alike() {
    let upstream = RawUpstream::answering(|_, _| {
        Reply::new(
            "HTTP/1.1 200 OK\r\nX-Request-Id: upstream\r\nRateLimit: upstream\r\n\
             X-A: 1\r\nRateLimit-Policy: upstream\r\nX-RateLimit-Limit: upstream\r\n\
             X-RateLimit-Remaining: upstream\r\nX-RateLimit-Reset: upstream\r\n\
             Content-Length: 2\r\n\r\nok"
                .to_string(),
        )
    })
    .await;
    let config = BASE.replace("[server]\n", "[server]\nrate_limit_headers = \"both\"\n");
    let config = format!(
        "{config}
[[routes]]
name = \"counted\"
path_prefix = \"/counted\"
upstream = \"app\"

  [[routes.limits]]
  key = \"ip\"
  requests = 100
  window = \"1m\"

[[routes]]
name = \"free\"
upstream = \"app\"
"
    );
    let paths = Paths::start_with(&config, upstream.addr).await;
    let own = [
        "x-request-id",
        "ratelimit",
        "ratelimit-policy",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ];
    for (target, counted) in [("/counted/a", true), ("/free", false)] {
        let request = format!("GET {target} HTTP/1.1\r\nHost: wire.test\r\n\r\n");
        assert_simple(request.as_bytes());
        let mut heads = Vec::new();
        for (path, addr) in paths.all() {
            let mut wire = Wire::connect(addr).await;
            let resp = wire.exchange(&request).await;
            assert_eq!(resp.status, 200, "{target}: {}", resp.head);
            for name in own {
                let values = resp.all(name);
                assert_eq!(values.len(), 1, "{target}: {name} in {}", resp.head);
                let upstreams = name != "x-request-id" && !counted;
                assert_eq!(
                    values[0] == "upstream",
                    upstreams,
                    "{target}: {}",
                    resp.head
                );
            }
            // A second may tick between the pairings.
            heads.push((path, in_name_order(&numbers_masked(&resp.masked_head()))));
        }
        let (hyper_path, hyper) = &heads[0];
        for (path, head) in &heads[1..] {
            assert_eq!(head, hyper, "{target}: {path}, then {hyper_path}");
        }
    }
}

/// `head` with its fields sorted by name, fields of one name kept in their order: the order of
/// fields with different names carries no meaning (RFC 9110 5.3), and the two paths differ in
/// it. The simple path passes an upstream's fields on in the order they came, as nginx does;
/// hyper's client puts them into a map, which groups the fields of one name at the first one's
/// place and moves its last field into the place of one it removes.
fn in_name_order(head: &str) -> String {
    let mut lines: Vec<&str> = head.split_inclusive("\r\n").collect();
    let last = lines.len().saturating_sub(1);
    if last > 1 {
        let name = |line: &&str| line.split(':').next().unwrap_or("").to_ascii_lowercase();
        lines[1..last].sort_by_key(name);
    }
    lines.concat()
}

/// `head` with the digits that follow `;r=`, `;t=`, `remaining: ` and `reset: ` replaced by `<n>`.
fn numbers_masked(head: &str) -> String {
    let mut out = head.to_string();
    for mark in [";r=", ";t=", "remaining: ", "reset: "] {
        let mut masked = String::new();
        let mut rest = out.as_str();
        while let Some(at) = rest.find(mark) {
            let (before, after) = rest.split_at(at + mark.len());
            masked.push_str(before);
            masked.push_str("<n>");
            rest = after.trim_start_matches(|c: char| c.is_ascii_digit());
        }
        masked.push_str(rest);
        out = masked;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// 2. Divergences from hyper on the response side (defects: these fail today).

/// The upstream sends `Content-Length: 3` and a chunked body of 5 bytes (RFC 9112 forbids
/// both; hyper's client keeps the length field and decodes the chunked body). hyper's server
/// sends the head and 3 bytes, framed as announced, and goes on; the simple path
/// (`send_data`: more data than the length, `return false`) drops the head it had buffered
/// and closes: the client gets no answer at all, not even a 502.
#[tokio::test]
async fn an_upstream_body_longer_than_its_length_field_still_gets_the_client_an_answer() {
    let upstream = RawUpstream::answering(shapes).await;
    let paths = Paths::start(upstream.addr).await;
    let request = "GET /te-and-cl HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_string();
    let found = differences(&paths, &[request]).await;
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// hyper writes chunk sizes in upper-case hex (`{len:X}`, proto/h1/encode.rs `ChunkSize`); the
/// simple path in lower case (`hex`). Equivalent on the wire (hex digits are case-insensitive),
/// but not the byte-for-byte copy the module promises.
#[tokio::test]
async fn chunk_sizes_are_written_as_hyper_writes_them() {
    let upstream = RawUpstream::answering(shapes).await;
    let proxy = proxy_for(upstream.addr).await;
    let request = b"GET /close-delimited HTTP/1.1\r\nHost: wire.test\r\n\r\n";
    let quiet = Duration::from_secs(1);
    let simple = transcript(proxy.addr, &[request], Duration::ZERO, quiet).await;
    let text = lossy(&simple.bytes);
    // "until the close" is 15 bytes: hyper's chunk size line is `F`.
    assert!(
        text.contains("\r\n\r\nF\r\nuntil the close\r\n"),
        "{text:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. The request side: the same bytes behind a simple request, on the simple path and on
// hyper's, must reach the upstream (and the client) the same way.

/// What the upstream received, comparable across connections.
fn seen(upstream: &Upstream, from: usize) -> Vec<String> {
    upstream.requests()[from..]
        .iter()
        .map(|r| {
            let mut fields: Vec<String> = r
                .headers
                .iter()
                .filter(|(n, _)| n.as_str() != "x-request-id")
                .map(|(n, v)| format!("{n}: {}", lossy(v.as_bytes())))
                .collect();
            fields.sort();
            format!(
                "{} {} {:?} [{}] body {:?}",
                r.method,
                r.uri,
                r.version,
                fields.join(", "),
                lossy(&r.body)
            )
        })
        .collect()
}

/// Odd requests, each sent behind a simple GET on the simple path (in the same write, and in a
/// later one) and on hyper's (in a later write: the guard refuses a whole read, so a bad head
/// in the same read as a good one would refuse both there); the differences in what the
/// upstream received and in what the client read.
async fn request_differences(paths: &Paths, upstream: &Upstream, cases: &[Vec<u8>]) -> Vec<String> {
    let first = b"GET /first HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_vec();
    let end = b"GET /end HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n";
    let quiet = Duration::from_secs(2);
    let pause = Duration::from_millis(60);
    assert_simple(&first);
    let mut found = Vec::new();
    for case in cases {
        // A last request that closes the connection, when it gets that far.
        let case = &[&case[..], end].concat();
        let mut outcomes = Vec::new();
        for variant in ["hyper", "simple, two writes", "simple, one write"] {
            let before = upstream.count();
            let (hyper, own) = (paths.hyper.addr, paths.own.addr);
            let t = match variant {
                "hyper" => transcript(hyper, &[&first, case], pause, quiet).await,
                "simple, two writes" => transcript(own, &[&first, case], pause, quiet).await,
                _ => {
                    let both = [&first[..], case].concat();
                    transcript(own, &[&both], pause, quiet).await
                }
            };
            // The upstream may still be collecting a body it was sent.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut text = responses(&t, false);
            // After a request, a head the guard refuses closes the connection. On the simple
            // path's hand-over hyper reads its first 24 bytes (hyper-util's version probe)
            // before the guard has judged the whole head, and answers the parse error it finds
            // in them itself: the same close, with hyper's 400 before it. Not a difference.
            let hyper_400 =
                "HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\
                             date: <date>\r\n\r\n<0 of 0 bytes: \"\">\n[closed]";
            if text.ends_with(hyper_400) {
                text = text.replace(hyper_400, "[closed]");
            }
            outcomes.push((variant, text, seen(upstream, before)));
        }
        let (_, hyper_text, hyper_seen) = &outcomes[0];
        for (variant, text, got) in &outcomes[1..] {
            if text != hyper_text || got != hyper_seen {
                found.push(format!(
                    "case {:?}\n--- {variant}:\n{text}\n{got:#?}\n--- hyper:\n{hyper_text}\n{hyper_seen:#?}",
                    lossy(&case[..case.len().min(300)]),
                ));
            }
        }
    }
    found
}

fn odd_requests() -> Vec<Vec<u8>> {
    let h = "Host: wire.test\r\n";
    let mut cases: Vec<Vec<u8>> = [
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: 0\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: 00\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: +0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: -0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length:  0 \r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length:\t0\t\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: 0\r\nContent-Length: 0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: 0, 0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Content-Length: 5\r\n\r\nGET /x"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding: chunked\r\n\r\n1e\r\nGET /smuggled HTTP/1.1\r\nX: y\r\n\r\n0\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding: Chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding: chunked \r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding: xchunked\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding:\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Transfer_Encoding: chunked\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h} Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: a\r\n\tTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: a\r\n \r\n\r\n"),
        "GET /b HTTP/1.1\nHost: wire.test\n\n".to_string(),
        format!("GET /b HTTP/1.1\r\n{h}X: y\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}\n"),
        format!("GET /b HTTP/1.1\r\n{h}\r\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: a\rb\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: a\0b\r\n\r\n"),
        format!("GET /b\0 HTTP/1.1\r\n{h}\r\n"),
        format!("GET\0/b HTTP/1.1\r\n{h}\r\n"),
        format!("GET  /b HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b  HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1 \r\n{h}\r\n"),
        format!("GET\t/b HTTP/1.1\r\n{h}\r\n"),
        format!(" GET /b HTTP/1.1\r\n{h}\r\n"),
        "GET /b HTTP/1.1\r\nHost : wire.test\r\n\r\n".to_string(),
        format!("GET /b HTTP/1.1\r\n{h}: empty-name\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X-Empty:\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Host: evil.test\r\n\r\n"),
        "GET /b HTTP/1.1\r\nHost: evil.test\r\nHost: wire.test\r\n\r\n".to_string(),
        "GET /b HTTP/1.1\r\nHost: wire.test, evil.test\r\n\r\n".to_string(),
        "GET /b HTTP/1.1\r\nHost: wire.test:80\r\n\r\n".to_string(),
        "GET /b HTTP/1.1\r\nHost: WIRE.TEST.\r\n\r\n".to_string(),
        "GET /b HTTP/1.1\r\nHost: user@wire.test\r\n\r\n".to_string(),
        "GET http://wire.test/b HTTP/1.1\r\nHost: evil.test\r\n\r\n".to_string(),
        "GET http://evil.test/b HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_string(),
        "GET http://user@wire.test/b HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_string(),
        "GET //evil.test/b HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_string(),
        format!("GET * HTTP/1.1\r\n{h}\r\n"),
        format!("OPTIONS * HTTP/1.1\r\n{h}\r\n"),
        format!("GET b HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b#frag HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b?x=%00 HTTP/1.1\r\n{h}\r\n"),
        format!("GET /a/../b HTTP/1.1\r\n{h}\r\n"),
        format!("get /b HTTP/1.1\r\n{h}\r\n"),
        format!("G@T /b HTTP/1.1\r\n{h}\r\n"),
        format!("DELETE /b HTTP/1.1\r\n{h}\r\n"),
        format!("TRACE /b HTTP/1.1\r\n{h}\r\n"),
        format!("CONNECT wire.test:80 HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.0\r\n{h}\r\n"),
        format!("GET /b HTTP/1.0\r\n{h}Connection: keep-alive\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.0\r\n{h}Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("GET /b HTTP/2.0\r\n{h}\r\n"),
        format!("GET /b HTTP/1.2\r\n{h}\r\n"),
        format!("GET /b http/1.1\r\n{h}\r\n"),
        format!("GET /b\r\n{h}\r\n"),
        format!("\r\n\r\nGET /b HTTP/1.1\r\n{h}\r\n"),
        format!("\nGET /b HTTP/1.1\r\n{h}\r\n"),
        format!("\rGET /b HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Upgrade: websocket\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Expect: 100-continue\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Expect: 100-continue\r\nContent-Length: 3\r\n\r\nabc"),
        format!("GET /b HTTP/1.1\r\n{h}Connection: x-secret\r\nX-Secret: 1\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Connection: close\r\nConnection: keep-alive\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Connection: keep-alive, close\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Connection: ,,close,,\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Connection: \"close\"\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Connection: clo se\r\n\r\nGET /c HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}Proxy-Connection: close\r\nKeep-Alive: 1\r\nTE: trailers\r\nTrailer: x\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X-Forwarded-For: 1.2.3.4\r\nForwarded: for=1.2.3.4\r\nX-Real-IP: 1.2.3.4\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X-Request-Id: chosen\r\n\r\n"),
        "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00".to_string(),
        format!("PRI * HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: \u{e9}\r\n\r\n"),
        format!("GET /\u{e9} HTTP/1.1\r\n{h}\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X\u{e9}: 1\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: \x7f\r\n\r\n"),
        format!("GET /b HTTP/1.1\r\n{h}X: \x01\r\n\r\n"),
        format!("GET /{} HTTP/1.1\r\n{h}\r\n", "t".repeat(8200)),
        format!("GET /{} HTTP/1.1\r\n{h}\r\n", "t".repeat(8100)),
        format!("GET /b HTTP/1.1\r\n{h}X-Long: {}\r\n\r\n", "v".repeat(20_000)),
        format!("GET /b HTTP/1.1\r\n{h}X-Long: {}\r\n\r\n", "v".repeat(70_000)),
        format!("GET /b HTTP/1.1\r\n{h}{}\r\n", "X: v\r\n".repeat(99)),
        format!("GET /b HTTP/1.1\r\n{h}{}\r\n", "X: v\r\n".repeat(100)),
        format!("GET /b HTTP/1.1\r\n{h}{}\r\n", "X: v\r\n".repeat(130)),
    ]
    .into_iter()
    .map(String::into_bytes)
    .collect();
    // Raw bytes that are not UTF-8.
    let mut obs = b"GET /b HTTP/1.1\r\nHost: wire.test\r\nX: \xff\xfe\r\n\r\n".to_vec();
    cases.push(std::mem::take(&mut obs));
    cases.push(b"GET /\xff HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_vec());
    cases.push(b"G\xffT /b HTTP/1.1\r\nHost: wire.test\r\n\r\n".to_vec());
    cases.push(b"GET /b HTTP/1.1\r\nHost: wire.test\xff\r\n\r\n".to_vec());
    cases
}

#[tokio::test]
async fn odd_requests_behind_a_simple_one_are_treated_as_hyper_and_the_guard_treat_them() {
    let upstream = Upstream::start().await;
    let paths = Paths::start(upstream.addr).await;
    let found = request_differences(&paths, &upstream, &odd_requests()).await;
    assert!(
        found.is_empty(),
        "{} differences:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// Simple requests around a POST whose body looks like a request, split in two writes at every
/// byte: wherever TCP cuts the bytes, the upstream receives these four requests and no other,
/// and the client their four answers in order.
#[tokio::test]
async fn a_mixed_pipeline_split_at_every_byte_reaches_the_upstream_unchanged() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let smuggled = "GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n";
    let pipeline = format!(
        "GET /s1 HTTP/1.1\r\nHost: wire.test\r\n\r\n\
         GET /s2 HTTP/1.1\r\nHost: wire.test\r\nContent-Length: 0\r\n\r\n\
         POST /echo HTTP/1.1\r\nHost: wire.test\r\nContent-Length: {}\r\n\r\n{smuggled}\
         GET /s3 HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n",
        smuggled.len()
    );
    let bytes = pipeline.as_bytes();
    let mut failures = Vec::new();
    for cut in 1..bytes.len() {
        let before = upstream.count();
        let t = transcript(
            proxy.addr,
            &[&bytes[..cut], &bytes[cut..]],
            Duration::from_millis(5),
            WAIT,
        )
        .await;
        let got: Vec<String> = upstream.requests()[before..]
            .iter()
            .map(|r| format!("{} {} {:?}", r.method, r.uri, lossy(&r.body)))
            .collect();
        let expected = [
            "GET /s1 \"\"".to_string(),
            "GET /s2 \"\"".to_string(),
            format!("POST /echo {smuggled:?}"),
            "GET /s3 \"\"".to_string(),
        ];
        let text = responses(&t, false);
        let bodies: Vec<&str> = text.lines().filter(|l| l.starts_with('<')).collect();
        let expected_bodies = [
            "<11 of 11 bytes: \"upstream ok\">",
            "<11 of 11 bytes: \"upstream ok\">",
            "<32 of 32 bytes: \"GET /smuggled HTTP/1.1\\r\\nX: y\\r\\n\\r\\n\">",
            "<11 of 11 bytes: \"upstream ok\">",
        ];
        if got != expected || bodies != expected_bodies || !t.closed {
            failures.push(format!("cut at {cut}: upstream {got:?}\n{text}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The rate limit counts requests on both paths of one connection: two simple requests use up
/// `/limited`, and the third, a POST that hyper reads after the hand-over, is refused (and, its
/// body unread, closes the connection).
#[tokio::test]
async fn requests_on_both_sides_of_the_hand_over_share_the_limit() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let pipeline = b"GET /limited/1 HTTP/1.1\r\nHost: wire.test\r\n\r\n\
        GET /limited/2 HTTP/1.1\r\nHost: wire.test\r\n\r\n\
        POST /limited/3 HTTP/1.1\r\nHost: wire.test\r\nContent-Length: 2\r\n\r\nhi\
        GET /limited/4 HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n";
    let t = transcript(proxy.addr, &[pipeline], Duration::ZERO, WAIT).await;
    let text = responses(&t, false);
    let statuses: Vec<&str> = text.lines().filter(|l| l.starts_with("HTTP/1.1")).collect();
    assert_eq!(
        statuses,
        [
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            // Refused with its body unread: the connection closes (and `/limited/4` with it).
            "HTTP/1.1 429 Too Many Requests",
        ],
        "{text}"
    );
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(uris, ["/limited/1", "/limited/2"]);
}

// ---------------------------------------------------------------------------------------------
// 4. Liveness: cancellation, timeouts, the drain.

/// Answers `/slow` after 5 s (watching for the proxy to drop the exchange meanwhile), `/big`
/// with 64 MiB, anything else at once.
fn slow_or_big(_method: &str, target: &str) -> Reply {
    match target {
        "/slow" => Reply::ok("late").delayed(Duration::from_secs(5)),
        "/big" => {
            let n = 64 << 20;
            let mut bytes = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n").into_bytes();
            bytes.resize(bytes.len() + n, b'z');
            Reply::new(bytes)
        }
        _ => Reply::ok(target),
    }
}

/// Whether the upstream connection tollgate opened is closed within `within`.
async fn upstream_released(upstream: &RawUpstream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while upstream.open() > 0 {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// tollgate in front of `upstream` with [`ROUTES`], on tollgate's own server and client
/// (`own`) or on hyper's.
async fn proxy_on_own(upstream: SocketAddr, own: bool) -> Proxy {
    let config = config_from(&format!("{BASE}{ROUTES}"), upstream, &[]);
    proxy_on(config, own, own).await
}

async fn client_leaves_while_upstream_is_slow(own: bool) -> bool {
    let upstream = RawUpstream::answering(slow_or_big).await;
    let proxy = proxy_on_own(upstream.addr, own).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    let request = b"GET /slow HTTP/1.1\r\nHost: wire.test\r\n\r\n";
    client.write_all(request).await.expect("write");
    until("the request at the upstream", 1, || upstream.heads().len()).await;
    drop(client);
    upstream_released(&upstream, Duration::from_secs(2)).await
}

#[tokio::test]
async fn a_client_that_leaves_cancels_its_upstream_request() {
    // hyper's path first: what the simple path must match.
    assert!(
        client_leaves_while_upstream_is_slow(false).await,
        "hyper's path kept the upstream request"
    );
    assert!(
        client_leaves_while_upstream_is_slow(true).await,
        "the simple path kept the upstream request after the client left"
    );
}

async fn client_leaves_without_reading(own: bool) -> bool {
    let upstream = RawUpstream::answering(slow_or_big).await;
    let proxy = proxy_on_own(upstream.addr, own).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    let request = b"GET /big HTTP/1.1\r\nHost: wire.test\r\n\r\n";
    client.write_all(request).await.expect("write");
    until("the request at the upstream", 1, || upstream.heads().len()).await;
    // Long enough for the socket buffers to fill and tollgate's write to wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(client);
    upstream_released(&upstream, Duration::from_secs(3)).await
}

#[tokio::test]
async fn a_client_that_stops_reading_and_leaves_releases_the_upstream() {
    assert!(
        client_leaves_without_reading(false).await,
        "hyper's path kept the upstream exchange"
    );
    assert!(
        client_leaves_without_reading(true).await,
        "the simple path kept the upstream exchange after the client left"
    );
}

fn timeouts_config(upstream: SocketAddr) -> tollgate::testing::config::Config {
    let server = "idle_timeout = \"30s\"\nheader_read_timeout = \"500ms\"\n";
    let text = format!("{BASE}{ROUTES}").replacen(
        "shutdown_timeout = \"5s\"\n",
        &format!("shutdown_timeout = \"5s\"\n{server}"),
        1,
    );
    config_from(&text, upstream, &[])
}

/// A head trickled a byte at a time is cut off at `header_read_timeout`, before and after a
/// simple request on the connection, and also past the size where the simple path hands over.
#[tokio::test]
async fn a_trickled_head_is_cut_off_at_the_header_read_timeout() {
    let upstream = RawUpstream::answering(slow_or_big).await;
    let proxy = Proxy::start(timeouts_config(upstream.addr)).await;
    for (before, piece) in [
        (&b""[..], 1),
        (&b"GET /a HTTP/1.1\r\nHost: wire.test\r\n\r\n"[..], 1),
        (&b""[..], 1024),
    ] {
        let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
        client.write_all(before).await.expect("write");
        if !before.is_empty() {
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(WAIT, client.read(&mut buf))
                .await
                .expect("an answer")
                .expect("read");
            assert!(
                buf[..n].starts_with(b"HTTP/1.1 200 "),
                "the first answer: {:?}",
                lossy(&buf[..n])
            );
        }
        let started = Instant::now();
        client
            .write_all(b"GET /b HTTP/1.1\r\nHost: wire.test\r\nX-Pad: ")
            .await
            .expect("write");
        let closed = loop {
            if started.elapsed() > Duration::from_secs(4) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            if client.write_all(&vec![b'p'; piece]).await.is_err() {
                break true;
            }
            let mut buf = [0u8; 4096];
            let read = tokio::time::timeout(Duration::from_millis(1), client.read(&mut buf)).await;
            if let Ok(Ok(0) | Err(_)) = read {
                break true;
            }
        };
        assert!(
            closed,
            "a head trickled for 4 s ({piece} bytes a time, after {before:?})"
        );
        assert!(
            started.elapsed() < Duration::from_millis(2000),
            "closed only after {:?}",
            started.elapsed()
        );
    }
}

/// An idle keep-alive connection after a simple request is closed at `header_read_timeout`.
#[tokio::test]
async fn an_idle_connection_after_a_simple_request_is_closed_at_the_header_read_timeout() {
    let upstream = RawUpstream::answering(slow_or_big).await;
    let proxy = Proxy::start(timeouts_config(upstream.addr)).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(b"GET /a HTTP/1.1\r\nHost: wire.test\r\n\r\n")
        .await
        .expect("write");
    let started = Instant::now();
    let mut out = Vec::new();
    let read = tokio::time::timeout(WAIT, client.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "still open after 5 s: {:?}", lossy(&out));
    assert!(
        lossy(&out).starts_with("HTTP/1.1 200 OK"),
        "{}",
        lossy(&out)
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(400),
        "closed after {waited:?}"
    );
}

/// In a drain, a request in flight on the simple path is answered with `connection: close`, and
/// a request pipelined behind it is neither answered nor forwarded.
#[tokio::test]
async fn a_drain_answers_the_request_in_flight_and_forwards_nothing_pipelined_behind_it() {
    let upstream = Upstream::start().await;
    let mut proxy = proxy_for(upstream.addr).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(
            b"GET /slow/400 HTTP/1.1\r\nHost: wire.test\r\n\r\n\
              GET /after HTTP/1.1\r\nHost: wire.test\r\n\r\n",
        )
        .await
        .expect("write");
    until("the slow request at the upstream", 1, || upstream.count()).await;
    let server = proxy.server.take().expect("running");
    let stopping = tokio::spawn(server.shutdown());
    let mut out = Vec::new();
    let read = tokio::time::timeout(WAIT, client.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "still open: {:?}", lossy(&out));
    let text = masked(&lossy(&out));
    assert_eq!(
        text,
        "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ndate: <date>\r\nx-request-id: <id>\r\n\
         connection: close\r\n\r\nslow ok"
    );
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(uris, ["/slow/400"]);
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("stopped")
        .expect("stop task");
}

/// A head that had begun to arrive when the drain began is read whole and answered on the
/// simple path (`next_head` reads on while its buffer holds bytes). A request that is not simple,
/// in the same position, is handed over with `graceful_shutdown` called before hyper-util's
/// connection has read anything: that cancels its version probe (`ReadVersion::cancel`), and the
/// connection closes without a word, though tollgate read the whole request
/// (`serve_connection`: "hyper finishes what it was handed, and closes").
#[tokio::test]
async fn a_request_read_whole_during_the_drain_is_answered_whatever_its_kind() {
    let upstream = Upstream::start().await;
    let mut proxy = proxy_for(upstream.addr).await;
    let mut simple = TcpStream::connect(proxy.addr).await.expect("connect");
    let mut post = TcpStream::connect(proxy.addr).await.expect("connect");
    simple
        .write_all(b"GET /a HTTP/1.1\r\nHost: wire.test\r\n")
        .await
        .expect("write");
    post.write_all(b"POST /echo HTTP/1.1\r\nHost: wire.test\r\n")
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let server = proxy.server.take().expect("running");
    let stopping = tokio::spawn(server.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = simple.write_all(b"\r\n").await;
    let _ = post.write_all(b"Content-Length: 2\r\n\r\nhi").await;
    let mut answers = Vec::new();
    for client in [&mut simple, &mut post] {
        let mut out = Vec::new();
        let read = tokio::time::timeout(WAIT, client.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "still open: {:?}", lossy(&out));
        answers.push(lossy(&out));
    }
    let stopped = tokio::time::timeout(WAIT, stopping).await;
    assert!(
        matches!(stopped, Ok(Ok(()))),
        "the server did not stop within 5 s: {stopped:?}"
    );
    assert!(
        answers[0].starts_with("HTTP/1.1 200 OK"),
        "the simple request: {:?}",
        answers[0]
    );
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert!(
        answers[1].starts_with("HTTP/1.1 "),
        "the POST got no answer at all: {:?}; the upstream saw {uris:?}",
        answers[1]
    );
}
