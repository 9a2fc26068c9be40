//! HTTP/1.1 on the wire for simple requests (no body: no `Content-Length` nor
//! `Transfer-Encoding`, no `Upgrade`, no `Expect`), byte for byte as tollgate answers them
//! today.
//!
//! These tests pin the behaviour of hyper's HTTP/1.1 server as tollgate drives it, so that a
//! server path of tollgate's own for such requests can be checked against it: status lines,
//! header names and order, framing (`content-length`, chunked, close-delimited, none for HEAD,
//! 204 and 304), keep-alive and pipelining, `Connection: close`, HTTP/1.0 clients, tollgate's
//! own answers (404, 429) and the graceful stop.
//!
//! Clients are raw TCP sockets that write exact bytes and parse exactly what comes back.
//! Upstreams are either the recording `common::Upstream` or a raw-TCP one in this file
//! ([`RawUpstream`]) that writes fixed bytes, for response shapes a hyper server would not
//! produce on request (trailers, close-delimited bodies, 204 and 304, paced bodies).
//! Every read is bounded by a timeout: a hang fails the test.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::*;

/// The longest any single read waits for tollgate.
const WAIT: Duration = Duration::from_secs(5);

/// Routes after the shared preamble ([`BASE`], memory store): `/limited` allows two requests
/// a minute per client address, whatever the host; everything else is served only for the
/// host `wire.test` (any other host gets tollgate's 404).
const ROUTES: &str = r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1m"

[[routes]]
name = "wire"
host = "wire.test"
upstream = "app"
"#;

async fn proxy_for(upstream: SocketAddr) -> Proxy {
    Proxy::start(config_from(&format!("{BASE}{ROUTES}"), upstream, &[])).await
}

/// A plain HTTP/1.1 GET for `path` on `wire.test`.
fn get_req(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: wire.test\r\n\r\n")
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

// ---------------------------------------------------------------------------------------------
// The client side: a raw socket and a strict response parser.

/// Header or trailer fields in wire order: (name as received, value).
type Fields = Vec<(String, String)>;

/// One response as it came off the wire.
#[derive(Debug)]
struct Resp {
    /// The status line and header lines exactly as received, the blank line included.
    head: String,
    status: u16,
    /// Header fields in wire order, names spelled as received.
    headers: Vec<(String, String)>,
    /// Framed with `transfer-encoding: chunked`.
    chunked: bool,
    /// The body, de-chunked.
    body: Vec<u8>,
    /// Trailer fields after the last chunk.
    trailers: Vec<(String, String)>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    fn text(&self) -> String {
        lossy(&self.body)
    }

    /// The head with the values that change from run to run (`date`, `x-request-id`)
    /// replaced by placeholders.
    fn masked_head(&self) -> String {
        self.head
            .split_inclusive("\r\n")
            .map(|line| match line.split_once(':') {
                Some((name, _)) if name.eq_ignore_ascii_case("date") => {
                    format!("{name}: <date>\r\n")
                }
                Some((name, _)) if name.eq_ignore_ascii_case("x-request-id") => {
                    format!("{name}: <id>\r\n")
                }
                _ => line.to_string(),
            })
            .collect()
    }

    /// The `content-length` the response announced, checked against the body received.
    fn checked_length(&self) -> usize {
        let length: usize = self
            .header("content-length")
            .expect("a content-length")
            .parse()
            .expect("a numeric content-length");
        assert_eq!(length, self.body.len(), "content-length against the body");
        length
    }
}

/// Parses one response from the start of `buf`; `None` while it is incomplete. `no_body`: the
/// response answers a HEAD. `eof`: the server has closed, so a close-delimited body is whole.
fn parse_response(buf: &[u8], no_body: bool, eof: bool) -> Option<(Resp, usize)> {
    let n = buf.len().min(7);
    assert!(
        buf[..n] == b"HTTP/1."[..n],
        "bytes where a response should start: {:?}",
        lossy(&buf[..buf.len().min(300)])
    );
    let mut fields = [httparse::EMPTY_HEADER; 128];
    let mut response = httparse::Response::new(&mut fields);
    let head_len = match response.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return None,
        Err(e) => panic!(
            "malformed response head ({e}): {:?}",
            lossy(&buf[..buf.len().min(600)])
        ),
    };
    let status = response.code.expect("a status code");
    let headers: Vec<(String, String)> = response
        .headers
        .iter()
        .map(|h| (h.name.to_string(), lossy(h.value)))
        .collect();
    let mut resp = Resp {
        head: lossy(&buf[..head_len]),
        status,
        headers,
        chunked: false,
        body: Vec::new(),
        trailers: Vec::new(),
    };
    resp.chunked = resp
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let rest = &buf[head_len..];
    let used = if no_body || status == 204 || status == 304 || (100..200).contains(&status) {
        0
    } else if resp.chunked {
        let (body, trailers, used) = decode_chunked(rest)?;
        resp.body = body;
        resp.trailers = trailers;
        used
    } else if let Some(length) = resp.header("content-length") {
        let length: usize = length.trim().parse().expect("a numeric content-length");
        if rest.len() < length {
            return None;
        }
        resp.body = rest[..length].to_vec();
        length
    } else {
        if !eof {
            return None;
        }
        resp.body = rest.to_vec();
        rest.len()
    };
    Some((resp, head_len + used))
}

/// A chunked body from the start of `buf`: its data, its trailer fields and the bytes it took;
/// `None` while incomplete. Malformed framing fails the test.
fn decode_chunked(buf: &[u8]) -> Option<(Vec<u8>, Fields, usize)> {
    let mut at = 0;
    let mut body = Vec::new();
    loop {
        let line_end = at + find(&buf[at..], b"\r\n")?;
        let line = std::str::from_utf8(&buf[at..line_end]).expect("a chunk-size line");
        let size = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size, 16)
            .unwrap_or_else(|_| panic!("chunk size is not hex: {line:?}"));
        at = line_end + 2;
        if size == 0 {
            let mut trailers = Vec::new();
            loop {
                let end = at + find(&buf[at..], b"\r\n")?;
                if end == at {
                    return Some((body, trailers, at + 2));
                }
                let line = lossy(&buf[at..end]);
                let (name, value) = line.split_once(':').expect("a trailer field");
                trailers.push((name.to_string(), value.trim().to_string()));
                at = end + 2;
            }
        }
        if buf.len() < at + size + 2 {
            return None;
        }
        body.extend_from_slice(&buf[at..at + size]);
        assert_eq!(
            &buf[at + size..at + size + 2],
            b"\r\n",
            "chunk data not followed by CRLF"
        );
        at += size + 2;
    }
}

/// A client connection: a raw socket and what has been read from it but not parsed yet.
struct Wire {
    stream: TcpStream,
    buf: Vec<u8>,
    /// The server has closed (EOF or reset).
    eof: bool,
}

impl Wire {
    async fn connect(addr: SocketAddr) -> Wire {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect within 5 s")
            .expect("connect to tollgate");
        Wire {
            stream,
            buf: Vec::new(),
            eof: false,
        }
    }

    async fn send(&mut self, bytes: impl AsRef<[u8]>) {
        tokio::time::timeout(WAIT, self.stream.write_all(bytes.as_ref()))
            .await
            .expect("write within 5 s")
            .expect("write to tollgate");
    }

    /// Reads once, at most `piece` bytes; notes a close.
    async fn more(&mut self, piece: usize) {
        let mut chunk = vec![0u8; piece];
        let read = tokio::time::timeout(WAIT, self.stream.read(&mut chunk))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "nothing from tollgate for 5 s; unparsed so far: {:?}",
                    lossy(&self.buf[..self.buf.len().min(600)])
                )
            });
        match read {
            Ok(0) | Err(_) => self.eof = true,
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
        }
    }

    /// The next response to a GET (or any method with a body to read).
    async fn response(&mut self) -> Resp {
        self.read_response(false, 64 * 1024, Duration::ZERO).await
    }

    /// The next response, to a HEAD: no body is read after its head.
    async fn head_response(&mut self) -> Resp {
        self.read_response(true, 64 * 1024, Duration::ZERO).await
    }

    /// The next response, read `piece` bytes at a time with `pause` before each read.
    async fn read_response(&mut self, no_body: bool, piece: usize, pause: Duration) -> Resp {
        loop {
            if let Some((resp, used)) = parse_response(&self.buf, no_body, self.eof) {
                self.buf.drain(..used);
                return resp;
            }
            assert!(
                !self.eof,
                "tollgate closed the connection mid-response: {:?}",
                lossy(&self.buf[..self.buf.len().min(600)])
            );
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            self.more(piece).await;
        }
    }

    /// Asserts that tollgate closes the connection within `within`, sending nothing more.
    /// Returns how long the close took.
    async fn assert_closed(&mut self, within: Duration, what: &str) -> Duration {
        let started = Instant::now();
        let deadline = started + within;
        while !self.eof {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut chunk = [0u8; 4096];
            match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
                Err(_) => panic!("{what}: the connection is still open after {within:?}"),
                Ok(Ok(0) | Err(_)) => self.eof = true,
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
        assert!(
            self.buf.is_empty(),
            "{what}: bytes after the last response: {:?}",
            lossy(&self.buf)
        );
        started.elapsed()
    }

    /// Asserts that for `quiet` nothing arrives and the connection stays open.
    async fn assert_open(&mut self, quiet: Duration, what: &str) {
        assert!(
            self.buf.is_empty(),
            "{what}: unread bytes {:?}",
            lossy(&self.buf)
        );
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout(quiet, self.stream.read(&mut chunk)).await {
            Err(_) => {}
            Ok(Ok(0) | Err(_)) => panic!("{what}: tollgate closed the connection"),
            Ok(Ok(n)) => panic!("{what}: unexpected bytes {:?}", lossy(&chunk[..n])),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A raw-TCP upstream that answers with fixed bytes.

/// What the raw upstream does with one request.
#[derive(Clone)]
struct Reply {
    bytes: Vec<u8>,
    /// Written in pieces of this many bytes, each flushed on its own (0: all at once).
    piece: usize,
    /// Waited before anything is written.
    delay: Duration,
    /// The connection is closed after the bytes.
    close: bool,
}

impl Reply {
    fn new(bytes: impl Into<Vec<u8>>) -> Reply {
        Reply {
            bytes: bytes.into(),
            piece: 0,
            delay: Duration::ZERO,
            close: false,
        }
    }

    /// `200` with `body`, framed by `Content-Length`.
    fn ok(body: &str) -> Reply {
        Reply::new(format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ))
    }

    fn closing(mut self) -> Reply {
        self.close = true;
        self
    }
}

type Script = Arc<dyn Fn(&str, &str) -> Reply + Send + Sync>;

/// An HTTP/1.1 upstream on raw TCP: it reads request heads (the requests here have no
/// bodies), records them as received, and answers each with what `script(method, target)`
/// says. Connections are kept open between requests unless a reply closes them.
struct RawUpstream {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawUpstream {
    async fn start(script: impl Fn(&str, &str) -> Reply + Send + Sync + 'static) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind raw upstream");
        let addr = listener.local_addr().expect("raw upstream addr");
        let heads: Arc<Mutex<Vec<String>>> = Arc::default();
        let script: Script = Arc::new(script);
        let seen = heads.clone();
        let task = tokio::spawn(async move {
            // Dropped (so every connection aborted) when the accept loop is aborted.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                while connections.try_join_next().is_some() {}
                connections.spawn(raw_connection(stream, script.clone(), seen.clone()));
            }
        });
        RawUpstream { addr, heads, task }
    }

    /// The request heads received so far, in order, as they came off the wire.
    fn heads(&self) -> Vec<String> {
        self.heads.lock().expect("lock").clone()
    }
}

async fn raw_connection(mut stream: TcpStream, script: Script, seen: Arc<Mutex<Vec<String>>>) {
    let mut buf = Vec::new();
    loop {
        let end = loop {
            if let Some(at) = find(&buf, b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = lossy(&buf[..end]);
        buf.drain(..end);
        let mut words = head.split(' ');
        let method = words.next().unwrap_or("").to_string();
        let target = words.next().unwrap_or("").to_string();
        seen.lock().expect("lock").push(head);
        let reply = script(&method, &target);
        if !reply.delay.is_zero() {
            tokio::time::sleep(reply.delay).await;
        }
        let piece = if reply.piece == 0 {
            reply.bytes.len().max(1)
        } else {
            reply.piece
        };
        for part in reply.bytes.chunks(piece) {
            if stream.write_all(part).await.is_err() || stream.flush().await.is_err() {
                return;
            }
        }
        if reply.close {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

/// Answers every request with `200` and its request target as the body.
fn echo_target(_method: &str, target: &str) -> Reply {
    Reply::ok(target)
}

/// Waits until `count()` reaches `n`, or fails after 5 s.
async fn until(what: &str, n: usize, count: impl Fn() -> usize) {
    let deadline = Instant::now() + WAIT;
    while count() < n {
        assert!(Instant::now() < deadline, "{what}: {} of {n}", count());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 1. A GET, then another on the same connection.

#[tokio::test]
async fn get_is_answered_with_date_and_content_length_and_the_connection_is_kept_alive() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;

    wire.send(get_req("/first")).await;
    let first = wire.response().await;
    // Today's exact head: the upstream's (hyper's) `content-length` and `date` in its order,
    // then tollgate's `x-request-id`; names lowercase.
    assert_eq!(
        first.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(first.text(), "upstream ok");
    assert_eq!(first.checked_length(), 11);
    let date = first.header("date").expect("a date");
    assert_eq!(date.len(), 29, "an IMF-fixdate: {date:?}");
    assert!(date.ends_with(" GMT"), "{date:?}");
    assert!(!first.chunked);

    // Still open, and a second request on it is served.
    wire.assert_open(Duration::from_millis(100), "after the first response")
        .await;
    wire.send(get_req("/second")).await;
    let second = wire.response().await;
    assert_eq!(second.status, 200);
    assert_eq!(second.text(), "upstream ok");
    assert_eq!(second.checked_length(), 11);
    assert_ne!(first.header("x-request-id"), second.header("x-request-id"));
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(uris, ["/first", "/second"]);
    wire.assert_open(Duration::from_millis(100), "after the second response")
        .await;
}

// 2. Pipelining.

#[tokio::test]
async fn three_pipelined_gets_in_one_write_get_three_responses_in_order() {
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;

    let batch = format!(
        "{}{}{}",
        get_req("/one"),
        get_req("/two?x=2"),
        get_req("/three")
    );
    wire.send(batch).await;
    let mut ids = Vec::new();
    for expected in ["/one", "/two?x=2", "/three"] {
        let resp = wire.response().await;
        assert_eq!(resp.status, 200, "{}", resp.head);
        assert_eq!(resp.text(), expected);
        resp.checked_length();
        ids.push(resp.header("x-request-id").expect("an id").to_string());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "three distinct request ids");
    let targets: Vec<String> = upstream
        .heads()
        .iter()
        .map(|h| h.split(' ').nth(1).unwrap_or("").to_string())
        .collect();
    assert_eq!(targets, ["/one", "/two?x=2", "/three"]);
    wire.assert_open(Duration::from_millis(100), "after the pipelined batch")
        .await;
}

// 3. HEAD.

#[tokio::test]
async fn head_gets_the_upstream_length_and_no_body_and_a_pipelined_get_after_it_is_answered() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;

    wire.send(format!(
        "HEAD /head HTTP/1.1\r\nHost: wire.test\r\n\r\n{}",
        get_req("/after")
    ))
    .await;
    let head = wire.head_response().await;
    // Today: the upstream's (hyper's) length of the GET body it would have sent.
    assert_eq!(
        head.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    // The next bytes are the GET's response, not a body of the HEAD's.
    let get = wire.response().await;
    assert_eq!(get.status, 200);
    assert_eq!(get.text(), "upstream ok");
    get.checked_length();
    let methods: Vec<String> = upstream
        .requests()
        .iter()
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect();
    assert_eq!(methods, ["HEAD /head", "GET /after"]);
    wire.assert_open(Duration::from_millis(100), "after HEAD and GET")
        .await;
}

#[tokio::test]
async fn head_with_a_chunked_upstream_answer_has_no_length_and_no_body() {
    // The upstream answers HEAD as it would GET with a chunked body, but sends no body.
    let upstream = RawUpstream::start(|method, target| {
        if method == "HEAD" {
            Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        } else {
            Reply::ok(target)
        }
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(format!(
        "HEAD /head HTTP/1.1\r\nHost: wire.test\r\n\r\n{}",
        get_req("/after")
    ))
    .await;
    let head = wire.head_response().await;
    // Today: neither `transfer-encoding` nor `content-length` in the head (the upstream's
    // `Transfer-Encoding` is hop-by-hop, and hyper frames no body for HEAD).
    assert_eq!(
        head.masked_head(),
        "HTTP/1.1 200 OK\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    let get = wire.response().await;
    assert_eq!(get.status, 200);
    assert_eq!(get.text(), "/after");
}

// 4. `Connection: close` from the client.

#[tokio::test]
async fn connection_close_request_gets_connection_close_and_the_socket_is_closed() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET /bye HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n")
        .await;
    let resp = wire.response().await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\
         connection: close\r\n\r\n"
    );
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after Connection: close")
        .await;
    // The client's `Connection` did not reach the upstream.
    assert!(upstream.last().headers.get("connection").is_none());
}

#[tokio::test]
async fn a_request_pipelined_behind_connection_close_is_not_answered_nor_forwarded() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(format!(
        "GET /last HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n{}",
        get_req("/ignored")
    ))
    .await;
    let resp = wire.response().await;
    assert_eq!(resp.header("connection"), Some("close"));
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after Connection: close")
        .await;
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(uris, ["/last"]);
}

// 5. HTTP/1.0 clients.

#[tokio::test]
async fn http10_request_without_keep_alive_is_answered_then_closed() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET /old HTTP/1.0\r\nHost: wire.test\r\n\r\n")
        .await;
    let resp = wire.response().await;
    // Today: an HTTP/1.0 status line (hyper answers in the client's version), no
    // `connection` field.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.0 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after an HTTP/1.0 request")
        .await;
    // Forwarded as HTTP/1.1.
    assert_eq!(upstream.last().version, http::Version::HTTP_11);
}

#[tokio::test]
async fn http10_request_with_connection_keep_alive_is_answered_then_closed() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET /old HTTP/1.0\r\nHost: wire.test\r\nConnection: keep-alive\r\n\r\n")
        .await;
    let resp = wire.response().await;
    // Today: HTTP/1.0 keep-alive is not honoured: an HTTP/1.0 status line, no `connection`
    // field (hyper answers in the client's version and, finding no `keep-alive` in an
    // HTTP/1.0 answer, turns keep-alive off), then the close.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.0 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after HTTP/1.0 keep-alive")
        .await;
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn http10_keep_alive_with_an_unknown_length_is_close_delimited_then_closed() {
    let upstream = RawUpstream::start(|_, _| {
        Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nold!\r\n0\r\n\r\n")
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET /old HTTP/1.0\r\nHost: wire.test\r\nConnection: keep-alive\r\n\r\n")
        .await;
    // An HTTP/1.0 client cannot take chunked: the body ends with the connection.
    let mut raw = Vec::new();
    let read = tokio::time::timeout(WAIT, wire.stream.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "the connection was not closed");
    let (resp, used) = parse_response(&raw, false, true).expect("a whole response");
    assert_eq!(used, raw.len());
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.0 200 OK\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), "old!");
}

// 6. A chunked upstream answer with a trailer.

/// A chunked answer announcing and sending the trailer field `X-Checksum`.
fn chunked_with_trailer(_method: &str, _target: &str) -> Reply {
    Reply::new(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\
         Trailer: X-Checksum\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nX-Checksum: abc123\r\n\r\n",
    )
}

#[tokio::test]
async fn chunked_upstream_answer_reaches_the_client_chunked_and_its_trailer_only_with_te() {
    let upstream = RawUpstream::start(chunked_with_trailer).await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;

    wire.send(get_req("/chunked")).await;
    let plain = wire.response().await;
    assert!(plain.chunked, "{}", plain.head);
    assert_eq!(plain.text(), "hello world");
    // Today: without `TE: trailers` the trailer is dropped (`Trailer` is hop-by-hop and is
    // not re-announced, and hyper sends only announced trailer fields).
    assert_eq!(
        plain.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-request-id: <id>\r\n\
         transfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert!(plain.trailers.is_empty(), "{:?}", plain.trailers);

    // With `TE: trailers` the announcement is passed on and the trailer arrives.
    wire.send("GET /chunked HTTP/1.1\r\nHost: wire.test\r\nTE: trailers\r\n\r\n")
        .await;
    let with_te = wire.response().await;
    assert!(with_te.chunked, "{}", with_te.head);
    assert_eq!(with_te.text(), "hello world");
    // Today: the announcement goes back as the upstream spelled its value.
    assert_eq!(
        with_te.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntrailer: X-Checksum\r\n\
         x-request-id: <id>\r\ntransfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(
        with_te.trailers,
        [("x-checksum".to_string(), "abc123".to_string())]
    );
    wire.assert_open(Duration::from_millis(100), "after two chunked answers")
        .await;
}

// 7. A close-delimited upstream body.

#[tokio::test]
async fn close_delimited_http11_upstream_body_is_sent_chunked_and_the_connection_stays_usable() {
    let upstream = RawUpstream::start(|_, target| {
        Reply::new(format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close: {target}"
        ))
        .closing()
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req("/eof")).await;
    let resp = wire.response().await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-request-id: <id>\r\n\
         transfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), "until close: /eof");
    wire.send(get_req("/again")).await;
    let again = wire.response().await;
    assert_eq!(again.status, 200);
    assert_eq!(again.text(), "until close: /again");
    wire.assert_open(
        Duration::from_millis(100),
        "after two close-delimited bodies",
    )
    .await;
}

#[tokio::test]
async fn close_delimited_http10_upstream_body_is_sent_as_http11_chunked_to_an_http11_client() {
    let upstream = RawUpstream::start(|_, target| {
        Reply::new(format!(
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nold upstream: {target}"
        ))
        .closing()
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req("/eof")).await;
    let resp = wire.response().await;
    // tollgate speaks its own version, and frames the unknown length with chunks.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-request-id: <id>\r\n\
         transfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), "old upstream: /eof");
    wire.send(get_req("/again")).await;
    let again = wire.response().await;
    assert_eq!(again.text(), "old upstream: /again");
}

// 8. 204 and 304.

#[tokio::test]
async fn no_content_and_not_modified_carry_no_body_and_the_next_pipelined_request_works() {
    let upstream = RawUpstream::start(|_, target| match target {
        "/204" => Reply::new("HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n"),
        "/304" => Reply::new(
            "HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nCache-Control: max-age=60\r\n\r\n",
        ),
        other => Reply::ok(other),
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    let batch = format!(
        "{}GET /304 HTTP/1.1\r\nHost: wire.test\r\nIf-None-Match: \"v1\"\r\n\r\n{}",
        get_req("/204"),
        get_req("/after")
    );
    wire.send(batch).await;

    let no_content = wire.response().await;
    assert_eq!(
        no_content.masked_head(),
        "HTTP/1.1 204 No Content\r\nx-kind: none\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    let not_modified = wire.response().await;
    assert_eq!(
        not_modified.masked_head(),
        "HTTP/1.1 304 Not Modified\r\netag: \"v1\"\r\ncache-control: max-age=60\r\n\
         x-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    for resp in [&no_content, &not_modified] {
        assert!(resp.header("transfer-encoding").is_none(), "{}", resp.head);
        assert!(resp.header("content-length").is_none(), "{}", resp.head);
    }
    // Right after the two heads comes the third response: no body bytes were sent for them.
    let after = wire.response().await;
    assert_eq!(after.status, 200);
    assert_eq!(after.text(), "/after");
    wire.assert_open(Duration::from_millis(100), "after 204 and 304")
        .await;
}

#[tokio::test]
async fn not_modified_with_a_content_length_arrives_without_it_and_without_a_body() {
    let upstream = RawUpstream::start(|_, target| match target {
        "/304" => {
            Reply::new("HTTP/1.1 304 Not Modified\r\nETag: \"v2\"\r\nContent-Length: 11\r\n\r\n")
        }
        other => Reply::ok(other),
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(format!("{}{}", get_req("/304"), get_req("/after")))
        .await;
    let not_modified = wire.response().await;
    // Today: the upstream's `Content-Length` (the length of the representation the 304
    // stands for) does not reach the client; no body either.
    assert_eq!(
        not_modified.masked_head(),
        "HTTP/1.1 304 Not Modified\r\netag: \"v2\"\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    let after = wire.response().await;
    assert_eq!(after.status, 200);
    assert_eq!(after.text(), "/after");
}

// 9. A large body to a slow reader.

#[tokio::test]
async fn one_mebibyte_body_reaches_a_slow_reader_whole_and_byte_exact() {
    const SIZE: usize = 1024 * 1024;
    let body: Vec<u8> = (0..SIZE).map(pattern_byte).collect();
    let mut reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {SIZE}\r\n\r\n").into_bytes();
    reply.extend_from_slice(&body);
    let upstream = RawUpstream::start(move |_, _| Reply {
        piece: 16 * 1024,
        ..Reply::new(reply.clone())
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req("/big")).await;
    let started = Instant::now();
    // 8 KiB reads with a pause before each: the client drains far slower than the upstream
    // writes, so tollgate must hold back rather than lose bytes.
    let resp = wire
        .read_response(false, 8 * 1024, Duration::from_millis(2))
        .await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-length"), Some("1048576"));
    assert!(!resp.chunked);
    assert_eq!(resp.body.len(), SIZE);
    assert!(
        resp.body == body,
        "the body differs from what the upstream sent"
    );
    assert!(started.elapsed() >= Duration::from_millis(200));
    // And the connection goes on.
    wire.send(get_req("/again")).await;
    assert!(wire.response().await.body == body);
}

// 10. A 429 on a keep-alive connection.

#[tokio::test]
async fn third_request_on_a_two_per_minute_route_gets_a_framed_429_and_the_connection_goes_on() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    for _ in 0..2 {
        wire.send(get_req("/limited")).await;
        let resp = wire.response().await;
        assert_eq!(resp.status, 200, "{}", resp.head);
        assert_eq!(resp.text(), "upstream ok");
    }
    wire.send(get_req("/limited")).await;
    let denied = wire.response().await;
    let body = "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
                \"title\":\"Too Many Requests\",\"status\":429,\
                \"violated-policies\":[\"limited:ip\"]}";
    assert_eq!(denied.text(), body);
    assert_eq!(denied.checked_length(), body.len());
    let retry = denied.header("retry-after").expect("retry-after");
    let retry: u64 = retry.parse().expect("seconds");
    assert!((1..=60).contains(&retry), "{retry}");
    // Today's head, with the varying values masked.
    let head = denied
        .masked_head()
        .replace(&format!("retry-after: {retry}\r\n"), "retry-after: <s>\r\n");
    let ratelimit = denied.header("ratelimit").expect("ratelimit").to_string();
    let head = head.replace(&ratelimit, "<ratelimit>");
    assert_eq!(
        head,
        format!(
            "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/problem+json\r\n\
             retry-after: <s>\r\nratelimit-policy: \"limited:ip\";q=2;w=60\r\n\
             ratelimit: <ratelimit>\r\nx-request-id: <id>\r\ncontent-length: {}\r\n\
             date: <date>\r\n\r\n",
            body.len()
        )
    );
    assert_eq!(upstream.count(), 2, "the 429 was not forwarded");
    // Today: the connection stays open after a 429 to a bodiless request.
    wire.assert_open(Duration::from_millis(100), "after the 429")
        .await;
    wire.send(get_req("/open")).await;
    let next = wire.response().await;
    assert_eq!(next.status, 200);
    assert_eq!(next.text(), "upstream ok");
}

// 11. tollgate's own 404.

#[tokio::test]
async fn no_route_404_is_framed_and_the_connection_stays_usable() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET /nowhere HTTP/1.1\r\nHost: other.test\r\n\r\n")
        .await;
    let missing = wire.response().await;
    assert_eq!(
        missing.masked_head(),
        "HTTP/1.1 404 Not Found\r\ncontent-type: text/plain; charset=utf-8\r\n\
         x-request-id: <id>\r\ncontent-length: 10\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(missing.text(), "Not Found\n");
    assert_eq!(upstream.count(), 0);
    wire.send(get_req("/here")).await;
    let found = wire.response().await;
    assert_eq!(found.status, 200);
    assert_eq!(found.text(), "upstream ok");
    wire.assert_open(Duration::from_millis(100), "after 404 and 200")
        .await;
}

#[tokio::test]
async fn http11_request_without_host_gets_400_and_the_connection_closes() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET /nohost HTTP/1.1\r\n\r\n").await;
    let resp = wire.response().await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
         connection: close\r\nx-request-id: <id>\r\ncontent-length: 12\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), "Bad Request\n");
    wire.assert_closed(Duration::from_secs(2), "after 400")
        .await;
    assert_eq!(upstream.count(), 0);
}

#[tokio::test]
async fn absolute_form_target_is_forwarded_in_origin_form() {
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send("GET http://wire.test/abs?x=1 HTTP/1.1\r\nHost: wire.test\r\n\r\n")
        .await;
    let resp = wire.response().await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "/abs?x=1");
    let head = upstream.heads().pop().expect("a head");
    assert!(head.contains("\r\nhost: wire.test\r\n"), "{head}");
    wire.assert_open(Duration::from_millis(100), "after an absolute-form target")
        .await;
}

// 12. Response header fields.

#[tokio::test]
async fn upstream_response_fields_arrive_unchanged_in_order_with_lowercase_names() {
    let upstream = RawUpstream::start(|_, _| {
        Reply::new(
            "HTTP/1.1 200 OK\r\nX-Custom: a\r\nSet-Cookie: a=1; Path=/\r\nX-Mixed-Case: Keep This\
             \r\nSet-Cookie: b=2; HttpOnly\r\nCache-Control: no-store\r\nContent-Length: 2\r\n\
             \r\nok",
        )
    })
    .await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req("/fields")).await;
    let resp = wire.response().await;
    assert_eq!(resp.text(), "ok");
    assert_eq!(resp.all("set-cookie"), ["a=1; Path=/", "b=2; HttpOnly"]);
    // Today: names lowercased, fields of one name grouped at the place of the first, values
    // untouched; `date` is added at the end.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\nx-custom: a\r\nset-cookie: a=1; Path=/\r\nset-cookie: b=2; HttpOnly\
         \r\nx-mixed-case: Keep This\r\ncache-control: no-store\r\ncontent-length: 2\r\n\
         x-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
}

#[tokio::test]
async fn upstream_connection_close_does_not_close_the_client_connection() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req("/close")).await;
    let resp = wire.response().await;
    // The upstream's `Connection: close` is hop-by-hop: not passed on.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ndate: <date>\r\ncontent-length: 7\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(resp.text(), "closing");
    wire.assert_open(Duration::from_millis(100), "after an upstream close")
        .await;
    wire.send(get_req("/close")).await;
    assert_eq!(wire.response().await.text(), "closing");
}

// 13. The request the upstream receives.

#[tokio::test]
async fn upstream_receives_a_plain_get_with_exactly_these_fields() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(
        "GET /plain?q=1 HTTP/1.1\r\nHost: wire.test\r\nUser-Agent: wire/1\r\nAccept: */*\r\n\
         Connection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: gone\r\n\
         Proxy-Connection: keep-alive\r\nTE: gzip\r\nX-Custom-In: kept\r\nCookie: a=1\r\n\
         Cookie: b=2\r\n\r\n",
    )
    .await;
    let resp = wire.response().await;
    assert_eq!(resp.status, 200);
    let seen = upstream.last();
    assert_eq!(seen.method, http::Method::GET);
    assert_eq!(seen.uri, "/plain?q=1");
    assert_eq!(seen.version, http::Version::HTTP_11);
    assert!(seen.body.is_empty());
    let mut fields: Vec<String> = seen
        .headers
        .iter()
        .filter(|(name, _)| *name != "x-request-id")
        .map(|(name, value)| format!("{name}: {}", value.to_str().expect("visible ASCII")))
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            "accept: */*",
            "cookie: a=1",
            "cookie: b=2",
            "host: wire.test",
            "user-agent: wire/1",
            "x-custom-in: kept",
            "x-forwarded-for: 127.0.0.1",
            "x-forwarded-host: wire.test",
            "x-forwarded-proto: http",
            "x-real-ip: 127.0.0.1",
        ]
    );
    // A fresh id, the one the client got back.
    let ids: Vec<_> = seen.headers.get_all("x-request-id").iter().collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(
        Some(ids[0].to_str().expect("ASCII")),
        resp.header("x-request-id")
    );
}

#[tokio::test]
async fn the_request_head_on_the_upstream_wire_has_this_order() {
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(
        "GET /order HTTP/1.1\r\nHost: wire.test\r\nUser-Agent: wire/1\r\nAccept: */*\r\n\
         X-Custom-In: kept\r\n\r\n",
    )
    .await;
    let resp = wire.response().await;
    assert_eq!(resp.text(), "/order");
    let head = upstream.heads().pop().expect("a head");
    let id = resp.header("x-request-id").expect("an id");
    // Today's bytes, names lowercase (hyper's client writes the map in its order).
    assert_eq!(
        head.replace(id, "<id>"),
        "GET /order HTTP/1.1\r\nhost: wire.test\r\nuser-agent: wire/1\r\naccept: */*\r\n\
         x-custom-in: kept\r\nx-request-id: <id>\r\nx-forwarded-for: 127.0.0.1\r\n\
         x-forwarded-proto: http\r\nx-forwarded-host: wire.test\r\nx-real-ip: 127.0.0.1\r\n\r\n"
    );
}

#[tokio::test]
async fn a_request_with_a_hundred_header_fields_reaches_the_upstream_whole() {
    // A raw upstream: the recording one (hyper) takes at most 100 fields itself, and tollgate
    // adds five.
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    // `Host` and 99 more: 100 fields, hyper's default maximum.
    let mut request = String::from("GET /many HTTP/1.1\r\nHost: wire.test\r\n");
    for i in 0..99 {
        request.push_str(&format!("X-Field-{i}: value-{i}\r\n"));
    }
    request.push_str("\r\n");
    wire.send(&request).await;
    let resp = wire.response().await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "/many");
    let head = upstream.heads().pop().expect("a head");
    let lines: Vec<&str> = head.split("\r\n").collect();
    let fields: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("x-field-"))
        .collect();
    let expected: Vec<String> = (0..99).map(|i| format!("x-field-{i}: value-{i}")).collect();
    assert_eq!(fields, expected, "all 99 fields, in order, names lowercase");
    // Request line, host, 99 fields, 5 added by tollgate, and the blank line's two empties.
    assert_eq!(lines.len(), 1 + 1 + 99 + 5 + 2, "{head}");
    wire.assert_open(Duration::from_millis(100), "after 100 fields")
        .await;
}

#[tokio::test]
async fn a_request_with_more_than_a_hundred_header_fields_gets_431() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    // `Host` and 100 more: 101 fields, past hyper's default of 100.
    let mut request = String::from("GET /many HTTP/1.1\r\nHost: wire.test\r\n");
    for i in 0..100 {
        request.push_str(&format!("X-Field-{i}: value-{i}\r\n"));
    }
    request.push_str("\r\n");
    wire.send(&request).await;
    let resp = wire.response().await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\
         date: <date>\r\n\r\n"
    );
    wire.assert_closed(Duration::from_secs(2), "after 431")
        .await;
    assert_eq!(upstream.count(), 0);
}

// 14. A client that half-closes after its request.

#[tokio::test]
async fn get_then_write_shutdown_is_not_answered_and_the_connection_closes() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req("/half")).await;
    wire.stream.shutdown().await.expect("shutdown(Write)");
    // Today: the FIN is taken for the client going away; the request is dropped and the
    // connection closed without an answer.
    wire.assert_closed(WAIT, "after the client's FIN").await;
}

#[tokio::test]
async fn pipelined_gets_then_write_shutdown_get_only_the_first_answer() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(format!("{}{}", get_req("/p1"), get_req("/p2")))
        .await;
    wire.stream.shutdown().await.expect("shutdown(Write)");
    // Today: while the second request's bytes wait behind the first, the FIN is not looked
    // for, so the first is answered; once they are read, the FIN is taken for the client
    // going away and the second, complete as it was, is dropped unanswered.
    let first = wire.response().await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text(), "upstream ok");
    wire.assert_closed(WAIT, "after the first of a half-closed pipelined pair")
        .await;
    assert_eq!(upstream.requests()[0].uri, "/p1");
}

// 15. The graceful stop.

#[tokio::test]
async fn drain_finishes_the_in_flight_request_with_connection_close_and_closes_idle_ones() {
    let upstream = Upstream::start().await;
    let mut proxy = proxy_for(upstream.addr).await;
    let addr = proxy.addr;
    let mut busy = Wire::connect(addr).await;
    let mut idle = Wire::connect(addr).await;
    idle.send(get_req("/before")).await;
    assert_eq!(idle.response().await.status, 200);
    busy.send(get_req("/slow/500")).await;
    until("requests at the upstream", 2, || upstream.count()).await;

    let server = proxy.server.take().expect("running");
    let drain_started = Instant::now();
    let stopping = tokio::spawn(server.shutdown());

    // The idle keep-alive connection closes at once, well before the slow answer.
    let idle_closed = idle
        .assert_closed(Duration::from_secs(1), "idle connection at the drain")
        .await;
    let resp = busy.response().await;
    let answered = drain_started.elapsed();
    assert!(idle_closed < answered, "{idle_closed:?} vs {answered:?}");
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ndate: <date>\r\nx-request-id: <id>\r\n\
         connection: close\r\n\r\n"
    );
    assert_eq!(resp.text(), "slow ok");
    busy.assert_closed(
        Duration::from_secs(2),
        "the drained connection after its answer",
    )
    .await;
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("shutdown within 5 s")
        .expect("shutdown task");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "still accepting after the stop"
    );
}

// The hand-over from tollgate's own path for simple requests to hyper's, mid-connection.

#[tokio::test]
async fn simple_requests_around_a_post_with_a_body_in_one_write_are_all_answered_in_order() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;

    // A GET (simple), a POST with a body (not simple: the rest of the connection is hyper's),
    // then another GET, in one write: the body must be read as the POST's, not as a head.
    let batch = format!(
        "{}POST /echo HTTP/1.1\r\nHost: wire.test\r\nContent-Length: 32\r\n\r\n\
         GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n{}",
        get_req("/first"),
        get_req("/last")
    );
    wire.send(batch).await;
    let first = wire.response().await;
    assert_eq!((first.status, first.text().as_str()), (200, "upstream ok"));
    let echoed = wire.response().await;
    assert_eq!(echoed.status, 200, "{}", echoed.head);
    assert_eq!(echoed.text(), "GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n");
    let last = wire.response().await;
    assert_eq!((last.status, last.text().as_str()), (200, "upstream ok"));
    for resp in [&first, &echoed, &last] {
        resp.checked_length();
    }
    let received: Vec<(String, String)> = upstream
        .received
        .lock()
        .expect("lock")
        .iter()
        .map(|r| (r.method.to_string(), r.uri.clone()))
        .collect();
    let expected = [("GET", "/first"), ("POST", "/echo"), ("GET", "/last")];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(m, u)| (m.to_string(), u.to_string()))
        .collect();
    assert_eq!(
        received, expected,
        "no smuggled request reached the upstream"
    );
    wire.assert_open(Duration::from_millis(100), "after the hand-over")
        .await;
}

#[tokio::test]
async fn a_head_split_over_many_writes_is_answered_once() {
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_for(upstream.addr).await;
    let mut wire = Wire::connect(proxy.addr).await;

    // One byte at a time: every read leaves the head unfinished until its last byte.
    for byte in get_req("/split").bytes() {
        wire.send([byte]).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let resp = wire.response().await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "/split"));
    wire.send(get_req("/after")).await;
    let resp = wire.response().await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "/after"));
    assert_eq!(upstream.heads().len(), 2, "{:?}", upstream.heads());
}
