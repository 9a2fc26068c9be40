//! HTTP/1.1 on raw TCP, for tests that pin exact bytes: a client socket with a strict response
//! parser ([`Wire`], [`parse_response`]), and a scripted upstream that records each request as
//! it came off the wire and answers with exact bytes ([`RawUpstream`], [`Reply`]).
//!
//! Every wait is bounded (by [`WAIT`] unless said otherwise): a hang fails the test.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use tollgate::testing::config::Config;

use super::paths::Paths;
use super::{config_from, Proxy, BASE};

/// The longest any single wait for tollgate lasts.
pub const WAIT: Duration = Duration::from_secs(5);

/// Routes after the shared preamble ([`BASE`], memory store): `/limited` allows two requests
/// a minute per client address, whatever the host; everything else is served only for the
/// host `wire.test` (any other host gets tollgate's 404).
pub const ROUTES: &str = r#"
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

/// [`BASE`] and [`ROUTES`] in front of `upstream`.
pub fn wire_config(upstream: SocketAddr) -> Config {
    config_from(&format!("{BASE}{ROUTES}"), upstream, &[])
}

/// tollgate with [`wire_config`] (on the default HTTP/1.1 paths).
pub async fn proxy_for(upstream: SocketAddr) -> Proxy {
    Proxy::start(wire_config(upstream)).await
}

/// tollgate with [`wire_config`] on `paths`, and a client connected to it.
pub async fn client_of(paths: Paths, upstream: SocketAddr) -> (Proxy, Wire) {
    let proxy = paths.start(wire_config(upstream)).await;
    let wire = Wire::connect(proxy.addr).await;
    (proxy, wire)
}

/// A plain HTTP/1.1 GET for `path` on `wire.test` (served by [`ROUTES`]).
pub fn wire_get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: wire.test\r\n\r\n")
}

pub fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Waits until `count()` reaches `n`, or fails after [`WAIT`].
pub async fn until(what: &str, n: usize, count: impl Fn() -> usize) {
    let deadline = Instant::now() + WAIT;
    while count() < n {
        assert!(Instant::now() < deadline, "{what}: {} of {n}", count());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until `value()` is `n`, or fails after `within`.
pub async fn until_eq(what: &str, n: usize, within: Duration, value: impl Fn() -> usize) {
    let deadline = Instant::now() + within;
    while value() != n {
        assert!(
            Instant::now() < deadline,
            "{what}: {} after {within:?}, expected {n}",
            value()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `text` (a response head, or more) with the values that change from run to run (`date`,
/// `x-request-id`) replaced by placeholders.
/// A head (`start line\r\nfields...\r\n\r\n`) with its field lines stably sorted by
/// lower-cased name (see [`Resp::masked_head_by_name`]).
pub fn by_name(head: &str) -> String {
    let body = head.strip_suffix("\r\n\r\n").unwrap_or(head);
    let mut lines = body.split("\r\n");
    let start = lines.next().unwrap_or("");
    let mut fields: Vec<&str> = lines.collect();
    fields.sort_by_key(|line| line.split(':').next().unwrap_or("").to_ascii_lowercase());
    let mut out = String::from(start);
    for field in fields {
        out.push_str("\r\n");
        out.push_str(field);
    }
    out.push_str("\r\n\r\n");
    out
}

pub fn masked(text: &str) -> String {
    text.split_inclusive("\r\n")
        .map(|line| match line.split_once(':') {
            Some((name, _)) if name.eq_ignore_ascii_case("date") => format!("{name}: <date>\r\n"),
            Some((name, _)) if name.eq_ignore_ascii_case("x-request-id") => {
                format!("{name}: <id>\r\n")
            }
            _ => line.to_string(),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The client side: a strict response parser and a raw socket.

/// Header or trailer fields in wire order: (name as received, value).
pub type Fields = Vec<(String, String)>;

/// One response as it came off the wire.
#[derive(Debug)]
pub struct Resp {
    /// The status line and header lines exactly as received, the blank line included.
    pub head: String,
    pub status: u16,
    /// Header fields in wire order, names spelled as received.
    pub headers: Fields,
    /// Framed with `transfer-encoding: chunked`.
    pub chunked: bool,
    /// The body, de-chunked.
    pub body: Vec<u8>,
    /// Trailer fields after the last chunk.
    pub trailers: Fields,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn text(&self) -> String {
        lossy(&self.body)
    }

    pub fn status_line(&self) -> &str {
        self.head.split("\r\n").next().unwrap_or("")
    }

    /// The head with the values that change from run to run (`date`, `x-request-id`)
    /// replaced by placeholders.
    pub fn masked_head(&self) -> String {
        masked(&self.head)
    }

    /// [`Resp::masked_head`] with its field lines in name order, the lines of one name kept in
    /// the order they came: the order the contract fixes. Fields of different names have no
    /// order that means anything (RFC 9110 5.3), and hyper's client, on the paths that use it,
    /// groups a name's lines at the place of its first and moves a field into the place of a
    /// removed `Connection`; tollgate's own client keeps the upstream's order.
    pub fn masked_head_by_name(&self) -> String {
        by_name(&self.masked_head())
    }

    /// The `content-length` the response announced, checked against the body received.
    pub fn checked_length(&self) -> usize {
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
pub fn parse_response(buf: &[u8], no_body: bool, eof: bool) -> Option<(Resp, usize)> {
    let n = buf.len().min(7);
    assert!(
        buf[..n] == b"HTTP/1."[..n],
        "bytes where a response should start: {:?}",
        lossy(&buf[..buf.len().min(300)])
    );
    let mut fields = [httparse::EMPTY_HEADER; 160];
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
    let headers: Fields = response
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
    } else if let Some(length) = content_length(&resp) {
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
pub fn decode_chunked(buf: &[u8]) -> Option<(Vec<u8>, Fields, usize)> {
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

/// The body length a response announces. A list of equal values (`2, 2`, in one field or in
/// several) is passed on as the upstream wrote it; values that disagree, or one that is not a
/// number, fail the test: a client could not know where such a response ends.
fn content_length(resp: &Resp) -> Option<usize> {
    let values = resp.headers.iter();
    let values = values.filter(|(n, _)| n.eq_ignore_ascii_case("content-length"));
    let lengths: Vec<usize> = values
        .flat_map(|(_, v)| v.split(','))
        .map(|v| v.trim().parse().expect("a numeric content-length"))
        .collect();
    let first = *lengths.first()?;
    assert!(
        lengths.iter().all(|&l| l == first),
        "content-length values that disagree: {lengths:?}"
    );
    Some(first)
}

// ---------------------------------------------------------------------------------------------
// Reading any stream (plain TCP or TLS) to its end, or to one response.

/// How a connection ended, as the client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// A clean end of stream: a FIN on plain TCP, `close_notify` over TLS.
    Clean,
    /// A read error; over TLS, `UnexpectedEof` is a close without `close_notify`.
    Error(std::io::ErrorKind),
    /// Still open when the wait ended.
    Open,
}

/// Everything read until the connection ends or `within` passes, and how it ended.
pub async fn read_to_end<S: AsyncRead + Unpin>(stream: &mut S, within: Duration) -> (Vec<u8>, End) {
    let deadline = tokio::time::Instant::now() + within;
    let mut bytes = Vec::new();
    let mut piece = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut piece)).await {
            Err(_) => return (bytes, End::Open),
            Ok(Ok(0)) => return (bytes, End::Clean),
            Ok(Ok(n)) => bytes.extend_from_slice(&piece[..n]),
            Ok(Err(err)) => return (bytes, End::Error(err.kind())),
        }
    }
}

/// Reads one whole response (not to a HEAD), failing the test after [`WAIT`].
pub async fn read_one<S: AsyncRead + Unpin>(stream: &mut S) -> Resp {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut bytes = Vec::new();
    let mut piece = vec![0u8; 64 * 1024];
    loop {
        if !bytes.is_empty() {
            if let Some((response, used)) = parse_response(&bytes, false, false) {
                assert_eq!(used, bytes.len(), "bytes after the response");
                return response;
            }
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut piece)).await {
            Err(_) => panic!("no whole response within 5 s: {:?}", lossy(&bytes)),
            Ok(Ok(0) | Err(_)) => panic!("closed before a whole response: {:?}", lossy(&bytes)),
            Ok(Ok(n)) => bytes.extend_from_slice(&piece[..n]),
        }
    }
}

/// The responses in `bytes` (read up to the close), each whole; `head_first`: the first
/// answers a HEAD.
pub fn responses_in(bytes: &[u8], head_first: bool) -> Vec<Resp> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let no_body = head_first && out.is_empty();
        let Some((response, used)) = parse_response(rest, no_body, true) else {
            panic!(
                "an incomplete response: {:?}",
                lossy(&rest[..rest.len().min(400)])
            );
        };
        out.push(response);
        rest = &rest[used..];
    }
    out
}

/// A client connection: a raw socket and what has been read from it but not parsed yet.
pub struct Wire {
    pub stream: TcpStream,
    pub buf: Vec<u8>,
    /// The server has closed (EOF or reset).
    pub eof: bool,
    /// The read error that ended the connection, when it did not end with a FIN (a reset).
    pub reset: Option<std::io::ErrorKind>,
}

impl Wire {
    pub async fn connect(addr: SocketAddr) -> Wire {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect within 5 s")
            .expect("connect to tollgate");
        Wire {
            stream,
            buf: Vec::new(),
            eof: false,
            reset: None,
        }
    }

    pub async fn send(&mut self, bytes: impl AsRef<[u8]>) {
        tokio::time::timeout(WAIT, self.stream.write_all(bytes.as_ref()))
            .await
            .expect("write within 5 s")
            .expect("write to tollgate");
    }

    /// Reads once; notes a close.
    pub async fn more(&mut self) {
        self.more_of(64 * 1024).await;
    }

    /// Reads once, at most `piece` bytes; notes a close.
    async fn more_of(&mut self, piece: usize) {
        let mut chunk = vec![0u8; piece];
        let read = tokio::time::timeout(WAIT, self.stream.read(&mut chunk))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "nothing from tollgate for 5 s; unparsed so far: {:?}",
                    lossy(&self.buf[..self.buf.len().min(600)])
                )
            });
        self.note(read.map(|n| (n, &chunk[..])));
    }

    /// Keeps what one read brought, or notes how the connection ended.
    fn note(&mut self, read: std::io::Result<(usize, &[u8])>) {
        match read {
            Ok((0, _)) => self.eof = true,
            Ok((n, chunk)) => self.buf.extend_from_slice(&chunk[..n]),
            Err(e) => {
                self.eof = true;
                self.reset = Some(e.kind());
            }
        }
    }

    /// Sends `request` and reads the response to it (not a HEAD).
    pub async fn exchange(&mut self, request: impl AsRef<[u8]>) -> Resp {
        self.send(request).await;
        self.response().await
    }

    /// The next response to a GET (or any method with a body to read).
    pub async fn response(&mut self) -> Resp {
        self.read_response(false, 64 * 1024, Duration::ZERO).await
    }

    /// The next response, to a HEAD: no body is read after its head.
    pub async fn head_response(&mut self) -> Resp {
        self.read_response(true, 64 * 1024, Duration::ZERO).await
    }

    /// The next response, read `piece` bytes at a time with `pause` before each read.
    pub async fn read_response(&mut self, no_body: bool, piece: usize, pause: Duration) -> Resp {
        loop {
            if let Some((resp, used)) = parse_response(&self.buf, no_body, self.eof) {
                self.buf.drain(..used);
                return resp;
            }
            assert!(
                !self.eof,
                "tollgate closed the connection mid-response (reset: {:?}): {:?}",
                self.reset,
                lossy(&self.buf[..self.buf.len().min(600)])
            );
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            self.more_of(piece).await;
        }
    }

    /// Reads until tollgate closes the connection or `within` passes; whether it closed.
    async fn read_to_close(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !self.eof {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut chunk = [0u8; 8192];
            match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(read) => self.note(read.map(|n| (n, &chunk[..]))),
            }
        }
        true
    }

    /// Asserts that tollgate closes the connection within `within` with a FIN (not a reset,
    /// which can discard what the client has not read yet), sending nothing more. Returns how
    /// long the close took.
    pub async fn assert_closed(&mut self, within: Duration, what: &str) -> Duration {
        let started = Instant::now();
        if !self.read_to_close(within).await {
            panic!("{what}: the connection is still open after {within:?}");
        }
        assert_eq!(
            self.reset, None,
            "{what}: the connection was reset, not closed"
        );
        assert!(
            self.buf.is_empty(),
            "{what}: bytes after the last response: {:?}",
            lossy(&self.buf)
        );
        started.elapsed()
    }

    /// Reads until tollgate closes the connection (failing the test if it does not within 5 s)
    /// and returns everything read and not parsed yet.
    pub async fn until_closed(&mut self, what: &str) -> Vec<u8> {
        if !self.read_to_close(WAIT).await {
            panic!(
                "{what}: the connection is still open after 5 s; read: {:?}",
                lossy(&self.buf)
            );
        }
        std::mem::take(&mut self.buf)
    }

    /// Asserts that for `quiet` nothing arrives and the connection stays open.
    pub async fn assert_open(&mut self, quiet: Duration, what: &str) {
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

/// One request as the raw upstream received it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Which accepted connection it came on (0 for the first).
    pub conn: usize,
    /// Its place among the requests on that connection (0 for the first).
    pub nth: usize,
    pub method: String,
    pub target: String,
    /// The head exactly as received.
    pub head: String,
    pub body: Vec<u8>,
}

/// What the raw upstream does with one request.
#[derive(Clone, Default)]
pub struct Reply {
    pub bytes: Vec<u8>,
    /// Waited before anything is written; a close by the proxy meanwhile ends the exchange.
    pub delay: Duration,
    /// Written in pieces of this many bytes, each flushed on its own (0: all at once), with
    /// `gap` between them.
    pub piece: usize,
    pub gap: Duration,
    /// Written this long after the reply, on the same connection (bytes nobody asked for).
    pub late: Option<(Duration, Vec<u8>)>,
    /// The connection is closed after the bytes.
    pub close: bool,
    /// ... with a reset (`SO_LINGER` 0) instead of a FIN.
    pub reset: bool,
}

impl Reply {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Reply {
        Reply {
            bytes: bytes.into(),
            ..Reply::default()
        }
    }

    /// `200` with `body`, framed by `Content-Length`.
    pub fn ok(body: &str) -> Reply {
        Reply::new(format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ))
    }

    pub fn closing(mut self) -> Reply {
        self.close = true;
        self
    }

    pub fn delayed(mut self, delay: Duration) -> Reply {
        self.delay = delay;
        self
    }
}

/// Answers every request with `200` and its request target as the body.
pub fn echo_target(seen: &Seen) -> Reply {
    Reply::ok(&seen.target)
}

type Script = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

/// What the raw upstream's tasks share.
#[derive(Default)]
struct Counts {
    accepted: AtomicUsize,
    open: AtomicUsize,
    seen: Mutex<Vec<Seen>>,
}

/// An HTTP/1.1 upstream on raw TCP: it reads requests (bodies by `Content-Length` or chunked),
/// records them as received, and answers each with what its script says. It counts the
/// connections it accepts and still has open. Connections stay open between requests unless
/// a reply closes them.
pub struct RawUpstream {
    pub addr: SocketAddr,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Counts one open upstream connection for as long as it lives.
struct OpenGuard(Arc<Counts>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl RawUpstream {
    /// Answers each request with `script(request)`.
    pub async fn start(script: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind raw upstream");
        let addr = listener.local_addr().expect("raw upstream addr");
        let counts: Arc<Counts> = Arc::default();
        let script: Script = Arc::new(script);
        let shared = counts.clone();
        let task = tokio::spawn(async move {
            // Dropped (so every connection aborted) when the accept loop is aborted.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
                shared.open.fetch_add(1, Ordering::SeqCst);
                let guard = OpenGuard(shared.clone());
                while connections.try_join_next().is_some() {}
                connections.spawn(raw_connection(stream, id, script.clone(), guard));
            }
        });
        RawUpstream { addr, counts, task }
    }

    /// Answers each request with `script(method, target)`.
    pub async fn answering(
        script: impl Fn(&str, &str) -> Reply + Send + Sync + 'static,
    ) -> RawUpstream {
        RawUpstream::start(move |seen| script(&seen.method, &seen.target)).await
    }

    /// TCP connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    /// Of those, the ones not closed yet (by either side).
    pub fn open(&self) -> usize {
        self.counts.open.load(Ordering::SeqCst)
    }

    /// The requests received so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.counts.seen.lock().expect("lock").clone()
    }

    /// The request heads received so far, in order, as they came off the wire.
    pub fn heads(&self) -> Vec<String> {
        self.seen().into_iter().map(|s| s.head).collect()
    }

    /// Which connection each request came on, in order.
    pub fn conns(&self) -> Vec<usize> {
        self.seen().iter().map(|s| s.conn).collect()
    }
}

/// Reads from `stream` into `buf`; false at EOF or on an error.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// A request body after `head`, from `buf` and then `stream`; None when the connection ends
/// first.
async fn read_body(stream: &mut TcpStream, buf: &mut Vec<u8>, head: &str) -> Option<Vec<u8>> {
    let field = |name: &str| {
        head.split("\r\n").find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    if field("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(at) = find(buf, b"\r\n") {
                    break at;
                }
                if !fill(stream, buf).await {
                    return None;
                }
            };
            let line = lossy(&buf[..line_end]);
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .expect("a chunk size from tollgate");
            buf.drain(..line_end + 2);
            if size == 0 {
                // No trailers are sent in these tests: the empty line ends the body.
                while buf.len() < 2 {
                    if !fill(stream, buf).await {
                        return None;
                    }
                }
                buf.drain(..2);
                return Some(body);
            }
            while buf.len() < size + 2 {
                if !fill(stream, buf).await {
                    return None;
                }
            }
            body.extend_from_slice(&buf[..size]);
            buf.drain(..size + 2);
        }
    }
    let length: usize = field("content-length").map_or(0, |v| v.parse().expect("a length"));
    while buf.len() < length {
        if !fill(stream, buf).await {
            return None;
        }
    }
    Some(buf.drain(..length).collect())
}

/// Waits `delay`, keeping whatever arrives meanwhile in `buf`; false when the proxy closes
/// the connection first (it dropped the exchange).
async fn wait_watching(stream: &mut TcpStream, buf: &mut Vec<u8>, delay: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + delay;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => return true,
            more = fill(stream, buf) => {
                if !more {
                    return false;
                }
            }
        }
    }
}

async fn raw_connection(mut stream: TcpStream, conn: usize, script: Script, guard: OpenGuard) {
    let counts = guard.0.clone();
    let _guard = guard;
    let mut buf = Vec::new();
    let mut nth = 0;
    loop {
        let end = loop {
            if let Some(at) = find(&buf, b"\r\n\r\n") {
                break at + 4;
            }
            if !fill(&mut stream, &mut buf).await {
                return;
            }
        };
        let head = lossy(&buf[..end]);
        buf.drain(..end);
        let Some(body) = read_body(&mut stream, &mut buf, &head).await else {
            return;
        };
        let mut words = head.split(' ');
        let seen = Seen {
            conn,
            nth,
            method: words.next().unwrap_or("").to_string(),
            target: words.next().unwrap_or("").to_string(),
            head: head.clone(),
            body,
        };
        nth += 1;
        counts.seen.lock().expect("lock").push(seen.clone());
        let reply = script(&seen);
        if !reply.delay.is_zero() && !wait_watching(&mut stream, &mut buf, reply.delay).await {
            return;
        }
        let piece = if reply.piece == 0 {
            reply.bytes.len().max(1)
        } else {
            reply.piece
        };
        for (i, part) in reply.bytes.chunks(piece).enumerate() {
            if i > 0 && !reply.gap.is_zero() {
                tokio::time::sleep(reply.gap).await;
            }
            if stream.write_all(part).await.is_err() || stream.flush().await.is_err() {
                return;
            }
        }
        if let Some((after, bytes)) = &reply.late {
            tokio::time::sleep(*after).await;
            if stream.write_all(bytes).await.is_err() {
                return;
            }
        }
        if reply.reset {
            // Linger 0 makes the close a reset at once; nothing blocks on it.
            #[allow(deprecated)]
            let _ = stream.set_linger(Some(Duration::ZERO));
            return;
        }
        if reply.close {
            let _ = stream.shutdown().await;
            return;
        }
    }
}
