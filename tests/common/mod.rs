//! Test harness: a recording upstream, tollgate started in process, raw-TCP helpers.
//!
//! Everything listens on 127.0.0.1 port 0 and reports the address it got; nothing sleeps to
//! wait for readiness (a bound listener already accepts).
#![allow(dead_code)]

pub mod db;
pub mod faulty;
pub mod haproxy;
pub mod log;
pub mod paths;
pub mod pgbouncer;
pub mod ratelimit;
pub mod tls;
pub mod wait;
pub mod wire;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use tollgate::testing::config::{self, Config};
use tollgate::{RunningServer, Server};

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: Method,
    pub uri: String,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The request's trailer fields, when its body ended with some.
    pub trailers: Option<HeaderMap>,
}

/// A real HTTP server standing in for the backend. It records every request it receives and
/// behaves according to the path:
/// - `/slow/<ms>`: waits before sending headers
/// - `/big/<bytes>`: a streamed body of that many bytes (a repeating pattern)
/// - `/echo`: the request body back
/// - `/hop`: a response carrying hop-by-hop headers
/// - `/trailers`: a body followed by a `grpc-status: 0` trailer
/// - `/ws`: a WebSocket echo
/// - `/close`: `200 closing` with `Connection: close`, then the connection closes
/// - `/status/<code>`: that status, body `status <code>`
/// - `/cost/<v1,v2,...>`: 200 with one `x-ratelimit-cost` line per value (`/cost/-`: none)
/// - `/cost-slow/<v>`: the head with `x-ratelimit-cost: <v>` at once, the body 1.5 s later
/// - anything else: `200 upstream ok`
pub struct Upstream {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Recorded>>>,
    /// TCP connections accepted so far.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    /// Of those, the ones not closed yet.
    open: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
enum Mode {
    H1,
    H2c,
    Tls(Arc<rustls::ServerConfig>),
}

type UpBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

impl Upstream {
    pub async fn start() -> Upstream {
        Self::start_with(false).await
    }

    /// `http2`: serve HTTP/2 prior knowledge (h2c) only.
    pub async fn start_with(http2: bool) -> Upstream {
        Self::start_mode(if http2 { Mode::H2c } else { Mode::H1 }).await
    }

    /// HTTPS with this certificate; HTTP/1.1 or HTTP/2 as ALPN decides.
    pub async fn start_tls(tls: Arc<rustls::ServerConfig>) -> Upstream {
        Self::start_mode(Mode::Tls(tls)).await
    }

    /// HTTP/1.1 on a listener the test made (a given port, a chosen backlog).
    pub async fn start_on(listener: TcpListener) -> Upstream {
        Self::serve(listener, Mode::H1)
    }

    async fn start_mode(mode: Mode) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        Self::serve(listener, mode)
    }

    fn serve(listener: TcpListener, mode: Mode) -> Upstream {
        let addr = listener.local_addr().expect("upstream addr");
        let received: Arc<Mutex<Vec<Recorded>>> = Arc::default();
        let rec = received.clone();
        let accepted: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let counter = accepted.clone();
        let open: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let open_counter = open.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let rec = rec.clone();
                let mode = mode.clone();
                let still_open = OpenConnection::new(open_counter.clone());
                tokio::spawn(async move {
                    let _still_open = still_open;
                    let service = service_fn(move |req| upstream_answer(req, rec.clone()));
                    match mode {
                        Mode::H2c => {
                            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                .timer(TokioTimer::new())
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                        Mode::H1 => {
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .with_upgrades()
                                .await;
                        }
                        Mode::Tls(config) => {
                            let acceptor = tokio_rustls::TlsAcceptor::from(config);
                            let Ok(tls) = acceptor.accept(stream).await else {
                                return;
                            };
                            let _ =
                                hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                                    .serve_connection_with_upgrades(TokioIo::new(tls), service)
                                    .await;
                        }
                    }
                });
            }
        });
        Upstream {
            addr,
            received,
            accepted,
            open,
            task,
        }
    }

    /// TCP connections the upstream has accepted.
    pub fn connections(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// TCP connections open now (accepted and not yet closed by either side).
    pub fn open_connections(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn count(&self) -> usize {
        self.received.lock().expect("lock").len()
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.received.lock().expect("lock").clone()
    }

    pub fn last(&self) -> Recorded {
        self.requests()
            .pop()
            .expect("the upstream received no request")
    }
}

/// Counts one open upstream connection for as long as it lives.
struct OpenConnection(Arc<std::sync::atomic::AtomicUsize>);

impl OpenConnection {
    fn new(open: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        OpenConnection(open)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn full(bytes: impl Into<Bytes>) -> UpBody {
    Full::new(bytes.into()).boxed()
}

async fn upstream_answer(
    mut req: Request<Incoming>,
    rec: Arc<Mutex<Vec<Recorded>>>,
) -> Result<Response<UpBody>, Infallible> {
    let path = req.uri().path().to_string();
    if path == "/ws" {
        return Ok(websocket_echo(&mut req, rec));
    }
    let (parts, body) = req.into_parts();
    let (body, trailers) = match body.collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        }
        Err(_) => (Bytes::new(), None),
    };
    rec.lock().expect("lock").push(Recorded {
        method: parts.method.clone(),
        uri: parts.uri.to_string(),
        version: parts.version,
        headers: parts.headers.clone(),
        body: body.clone(),
        trailers,
    });
    if let Some(ms) = path.strip_prefix("/slow/") {
        let ms: u64 = ms.parse().unwrap_or(1000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        return Ok(Response::new(full("slow ok")));
    }
    if let Some(answer) = cost_answer(&path) {
        return Ok(answer);
    }
    if let Some(n) = path.strip_prefix("/big/") {
        let n: usize = n.parse().unwrap_or(0);
        return Ok(Response::new(big_body(n)));
    }
    match path.as_str() {
        "/echo" => Ok(Response::new(full(body))),
        "/close" => {
            let mut r = Response::new(full("closing"));
            r.headers_mut()
                .insert("connection", "close".parse().expect("static"));
            Ok(r)
        }
        "/hop" => {
            let mut r = Response::new(full("hop"));
            let h = r.headers_mut();
            h.insert("connection", "x-up-hop".parse().expect("static"));
            h.insert("x-up-hop", "secret".parse().expect("static"));
            h.insert("keep-alive", "timeout=5".parse().expect("static"));
            h.insert("proxy-authenticate", "Basic".parse().expect("static"));
            h.insert("x-up-end", "kept".parse().expect("static"));
            Ok(r)
        }
        "/trailers" => {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().expect("static"));
            let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
                Ok(Frame::data(Bytes::from_static(b"payload"))),
                Ok(Frame::trailers(trailers)),
            ];
            let body = BodyExt::boxed(StreamBody::new(futures_util::stream::iter(frames)));
            let mut r = Response::new(body);
            r.headers_mut()
                .insert("content-type", "application/grpc".parse().expect("static"));
            // HTTP/1.1 servers announce their trailer fields.
            r.headers_mut()
                .insert("trailer", "grpc-status".parse().expect("static"));
            Ok(r)
        }
        _ => Ok(Response::new(full("upstream ok"))),
    }
}

/// The answers of `/status/`, `/cost/` and `/cost-slow/` (contract §3d's charges).
fn cost_answer(path: &str) -> Option<Response<UpBody>> {
    if let Some(code) = path.strip_prefix("/status/") {
        let status = StatusCode::from_u16(code.parse().ok()?).ok()?;
        let mut r = Response::new(full(format!("status {code}")));
        *r.status_mut() = status;
        return Some(r);
    }
    if let Some(values) = path.strip_prefix("/cost/") {
        let mut r = Response::new(full("charged"));
        for v in values.split(',').filter(|v| *v != "-") {
            r.headers_mut()
                .append("x-ratelimit-cost", v.parse().expect("a field value"));
        }
        return Some(r);
    }
    let value = path.strip_prefix("/cost-slow/")?;
    let later = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"streamed")))
    };
    let body = BodyExt::boxed(StreamBody::new(futures_util::stream::once(later)));
    let mut r = Response::new(body);
    r.headers_mut()
        .insert("x-ratelimit-cost", value.parse().expect("a field value"));
    Some(r)
}

/// The byte at position `i` of a `/big/` body.
pub fn pattern_byte(i: usize) -> u8 {
    (i % 251) as u8
}

fn big_body(n: usize) -> UpBody {
    const CHUNK: usize = 64 * 1024;
    let chunks = (0..n.div_ceil(CHUNK)).map(move |c| {
        let start = c * CHUNK;
        let end = (start + CHUNK).min(n);
        let data: Vec<u8> = (start..end).map(pattern_byte).collect();
        Ok::<_, Infallible>(Frame::data(Bytes::from(data)))
    });
    BodyExt::boxed(StreamBody::new(futures_util::stream::iter(chunks)))
}

fn websocket_echo(req: &mut Request<Incoming>, rec: Arc<Mutex<Vec<Recorded>>>) -> Response<UpBody> {
    use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
    use tokio_tungstenite::tungstenite::protocol::Role;
    rec.lock().expect("lock").push(Recorded {
        method: req.method().clone(),
        uri: req.uri().to_string(),
        version: req.version(),
        headers: req.headers().clone(),
        body: Bytes::new(),
        trailers: None,
    });
    let Some(key) = req.headers().get("sec-websocket-key") else {
        let mut r = Response::new(full("no key"));
        *r.status_mut() = StatusCode::BAD_REQUEST;
        return r;
    };
    let accept = derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
            TokioIo::new(upgraded),
            Role::Server,
            None,
        )
        .await;
        while let Some(Ok(msg)) = ws.next().await {
            if msg.is_text() || msg.is_binary() {
                if ws.send(msg).await.is_err() {
                    return;
                }
            } else if msg.is_close() {
                return;
            }
        }
    });
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert("connection", "upgrade".parse().expect("static"));
    h.insert("upgrade", "websocket".parse().expect("static"));
    h.insert("sec-websocket-accept", accept.parse().expect("accept key"));
    r
}

/// A loopback port on which connections are refused, reserved for as long as the value lives.
/// A socket is bound there and never listens, so a connect gets a reset, and no test running
/// beside this one can take the port: one bound and released at once can be taken, and then
/// "nothing listens there" silently becomes some other test's server.
pub struct RefusedPort {
    _socket: tokio::net::TcpSocket,
    pub addr: SocketAddr,
}

impl RefusedPort {
    pub fn new() -> RefusedPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind");
        let addr = socket.local_addr().expect("addr");
        RefusedPort {
            _socket: socket,
            addr,
        }
    }
}

impl std::fmt::Display for RefusedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.addr.fmt(f)
    }
}

/// Loads a configuration from text. `@UPSTREAM@` becomes the upstream's `host:port`; the
/// environment is the given map (tests never touch the process environment).
/// A file of the repository, by its path from the top.
pub fn repo(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `tollgate check --config path`, without the process's `TOLLGATE_DATABASE_URL` (which would
/// change the store it prints).
pub fn tollgate_check(path: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(path)
        .env_remove("TOLLGATE_DATABASE_URL")
        .output()
        .expect("run tollgate check")
}

/// Writes `text` to `proxy.toml` in a folder of its own under the temporary directory,
/// `tollgate-<suite>-<pid>-<name>`, for a `tollgate` child process to read; its path.
pub fn write_config_file(suite: &str, name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-{suite}-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

pub fn config_from(text: &str, upstream: SocketAddr, env: &[(&str, &str)]) -> Config {
    let text = text.replace("@UPSTREAM@", &upstream.to_string());
    let map: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = move |name: &str| map.get(name).cloned();
    match config::load_str(Path::new("test.toml"), &text, &lookup) {
        Ok(config) => config,
        Err(errors) => panic!("test configuration rejected:\n{errors}"),
    }
}

/// tollgate running in this process.
pub struct Proxy {
    pub server: Option<RunningServer>,
    pub addr: SocketAddr,
}

impl Proxy {
    pub async fn start(config: Config) -> Proxy {
        Proxy::start_built(Server::builder(config)).await
    }

    /// A server given a store or a clock of the test's (`Server::builder`).
    pub async fn start_built(builder: tollgate::ServerBuilder) -> Proxy {
        let server = builder.start().await.expect("tollgate starts");
        let addr = server.listen_addrs[0];
        Proxy {
            server: Some(server),
            addr,
        }
    }

    pub fn server(&self) -> &RunningServer {
        self.server.as_ref().expect("server running")
    }

    /// Waits until the store decides (for PostgreSQL: migrated, fingerprint checked, and a
    /// probe increment answered), or panics after `within`. Tests of exact counts call it
    /// before their flood: `Server::start` waits only briefly for the database, and under
    /// `on_error = "allow"` a decision before that is (announced) fail-open.
    pub async fn until_store_ready(&self, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let store = self.server().store();
            if store.probe().await.is_ok() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the store of tollgate at {} was not ready within {within:?}",
                self.addr
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the instance hears the database's reset notifications
    /// (`tollgate_reset_listener_up` 1), or panics after `within`. Its first notification
    /// clears whatever denials it cached before (they were cached without a listener): a test
    /// that counts which denials the cache answered waits for it first.
    pub async fn until_hearing_resets(&self, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        let hearing = |text: &str| text.lines().any(|l| l == "tollgate_reset_listener_up 1");
        while !hearing(&self.server().metrics().render()) {
            assert!(
                std::time::Instant::now() < deadline,
                "tollgate at {} did not hear reset notifications within {within:?}",
                self.addr
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn shutdown(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
    }
}

/// A whole configuration for limit tests: `server_extra` goes into `[server]` (a following
/// `[admin]` table works too), `store` is the body of `[store]`, `routes` come before a final
/// catch-all route `open` without limits; the key secret is `test-secret` and the upstream
/// `app` is `@UPSTREAM@`.
pub fn limits_config(store: &str, server_extra: &str, routes: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"
{server_extra}

[store]
{store}

[keys]
secret = "test-secret"

[upstreams.app]
url = "http://@UPSTREAM@"

{routes}

[[routes]]
name = "open"
upstream = "app"
"#
    )
}

/// The `[store]` body for this test's database, with a timeout generous enough for a busy
/// machine.
pub fn pg_store(db: &db::TestDb) -> String {
    format!("url = \"{}\"\ntimeout = \"2s\"", db.url)
}

/// The listen/upstream preamble most tests share.
pub const BASE: &str = r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"

[upstreams.app]
url = "http://@UPSTREAM@"
connect_timeout = "1s"
response_timeout = "2s"
"#;

/// A pooled HTTP/1.1 client whose request body type is a full byte buffer.
pub type H1Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

pub fn h1_client() -> H1Client {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new())
}

pub fn h2c_client() -> H1Client {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(hyper_util::client::legacy::connect::HttpConnector::new())
}

/// A response with its body collected.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub version: Version,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
}

pub async fn send(client: &H1Client, req: Request<Full<Bytes>>) -> Answer {
    let response = client.request(req).await.expect("request through tollgate");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("response body").to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
        version: parts.version,
    }
}

pub async fn get(client: &H1Client, url: &str) -> Answer {
    let req = Request::get(url)
        .body(Full::new(Bytes::new()))
        .expect("request");
    send(client, req).await
}

/// Reads `stream` until the server closes it, and returns how long after `since` that was.
/// Fails the test (naming `what`) if the server keeps it open for 5 s.
pub async fn closed_after(stream: &mut TcpStream, since: Instant, what: &str) -> Duration {
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "{what}");
    since.elapsed()
}

/// Sends raw bytes on a fresh TCP connection and reads until the server closes it or
/// `within` passes. Returns what was read.
pub async fn raw_exchange(addr: SocketAddr, bytes: &[u8], within: Duration) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(within, stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_string()
}

pub mod pg_cluster;
