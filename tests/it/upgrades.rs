//! HTTP/1.1 upgrades (contract §5): which upgrades are forwarded, what a `101` must say, the
//! framing guard around a switch, and the bounds a WebSocket session keeps (issue 14, items 1,
//! 3 and 8).
//!
//! Most cases here run against a raw-TCP upstream ([`RawUpstream`]) that does what a lenient
//! backend does (hypercorn with its defaults accepts `Upgrade: h2c`): it switches to whatever
//! protocol it is asked for, or answers `101` when it should not, and records the request
//! heads it received and every byte that reached it after a switch.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;

use crate::common::*;

/// How long a reply may take before the case fails.
const REPLY_WITHIN: Duration = Duration::from_secs(3);
/// Time given to bytes that must *not* reach the upstream before its record is read: absence
/// has no condition to poll for. What must arrive is waited for with `crate::common::wait::until`.
const SETTLE: Duration = Duration::from_millis(200);

/// The request every smuggling payload tries to hide.
const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n";

/// What the raw upstream answers.
#[derive(Clone, Copy)]
enum RawMode {
    /// A request with `Upgrade` gets a `101` to the (first) protocol it names; any other
    /// request gets `200 plain` and the connection closes.
    SwitchToAsked,
    /// Every request gets a `101` to this protocol, whatever it asked for.
    Always101(&'static str),
    /// `200` whose body (sent after a pause, so it goes out in its own write) reads like the
    /// start of a `101` response.
    BodyLooksLike101,
}

/// The body [`RawMode::BodyLooksLike101`] sends.
const FAKE_SWITCH: &[u8] = b"\r\nHTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n";

/// A backend on raw TCP, one request per connection.
struct RawUpstream {
    addr: SocketAddr,
    /// Every request head received, as text.
    heads: Arc<Mutex<Vec<String>>>,
    /// Every byte that reached the upstream after it answered `101`.
    tunnelled: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawUpstream {
    async fn start(mode: RawMode) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let heads: Arc<Mutex<Vec<String>>> = Arc::default();
        let tunnelled: Arc<Mutex<Vec<u8>>> = Arc::default();
        let (h, t) = (heads.clone(), tunnelled.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(raw_answer(stream, mode, h.clone(), t.clone()));
            }
        });
        RawUpstream {
            addr,
            heads,
            tunnelled,
            task,
        }
    }

    async fn heads(&self) -> Vec<String> {
        tokio::time::sleep(SETTLE).await;
        self.heads.lock().expect("lock").clone()
    }

    fn tunnelled(&self) -> String {
        String::from_utf8_lossy(&self.tunnelled.lock().expect("lock")).to_string()
    }
}

/// The value of the first `name` field of a head, lower-cased.
fn field(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_ascii_lowercase())
    })
}

async fn raw_answer(
    mut stream: TcpStream,
    mode: RawMode,
    heads: Arc<Mutex<Vec<String>>>,
    tunnelled: Arc<Mutex<Vec<u8>>>,
) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    heads.lock().expect("lock").push(head.clone());
    let switch_to = match mode {
        RawMode::SwitchToAsked => field(&head, "upgrade")
            .map(|asked| asked.split(',').next().unwrap_or("").trim().to_string()),
        RawMode::Always101(protocol) => Some(protocol.to_string()),
        RawMode::BodyLooksLike101 => {
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                FAKE_SWITCH.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = stream.write_all(FAKE_SWITCH).await;
            return;
        }
    };
    let Some(protocol) = switch_to else {
        let _ = stream
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\nplain\n")
            .await;
        return;
    };
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\
         Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
    );
    if stream.write_all(response.as_bytes()).await.is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    while let Ok(n) = stream.read(&mut buf).await {
        if n == 0 {
            return;
        }
        tunnelled.lock().expect("lock").extend_from_slice(&buf[..n]);
    }
}

/// One response read off a raw connection: its status and head, and its body when it has a
/// `Content-Length`. `None` when the connection closed (or nothing came) first.
async fn read_response(stream: &mut TcpStream) -> Option<(u16, String)> {
    let read = async {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return None,
            }
        }
        let head = String::from_utf8_lossy(&head).to_string();
        let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
        let length: usize = field(&head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await.ok()?;
        Some((status, head))
    };
    tokio::time::timeout(REPLY_WITHIN, read)
        .await
        .ok()
        .flatten()
}

/// Whether the server closes `stream` within [`REPLY_WITHIN`], and what it sent until then.
async fn closes(stream: &mut TcpStream) -> (bool, String) {
    let mut out = Vec::new();
    let closed = tokio::time::timeout(REPLY_WITHIN, stream.read_to_end(&mut out)).await;
    let closed = matches!(closed, Ok(Ok(_)) | Ok(Err(_)));
    (closed, String::from_utf8_lossy(&out).to_string())
}

/// tollgate in front of `upstream`: `server_extra` goes into `[server]`; `/api` is limited to
/// one request per hour per client, `/open` and `/ws` have no limit, and every other path has
/// no route (404).
async fn proxy_for(upstream: SocketAddr, server_extra: &str) -> Proxy {
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n{server_extra}\n\n\
         [upstreams.app]\nurl = \"http://@UPSTREAM@\"\nconnect_timeout = \"1s\"\n\
         response_timeout = \"2s\"\n\n\
         [[routes]]\nname = \"api\"\npath_prefix = \"/api\"\nupstream = \"app\"\n\n\
         [[routes.limits]]\nkey = \"ip\"\nrequests = 1\nwindow = \"1h\"\n\n\
         [[routes]]\nname = \"open\"\npath_prefix = \"/open\"\nupstream = \"app\"\n\n\
         [[routes]]\nname = \"ws\"\npath_prefix = \"/ws\"\nupstream = \"app\"\n"
    );
    Proxy::start(config_from(&text, upstream, &[])).await
}

// ---------------------------------------------------------------------------------------------
// Item 1: only `websocket` is forwarded as an upgrade

/// The review's h2c tunnel: `Upgrade: h2c` with `HTTP2-Settings` was forwarded, the upstream
/// switched, and everything the client sent after the `101` went straight to the upstream — a
/// path tollgate answers 404 and a route over its limit (1 per hour here) both reached it.
#[tokio::test]
async fn h2c_upgrade_is_forwarded_as_a_plain_request_not_a_tunnel() {
    let upstream = RawUpstream::start(RawMode::SwitchToAsked).await;
    let proxy = proxy_for(upstream.addr, "").await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(
            b"GET /api/first HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n\
              Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        )
        .await
        .expect("write");
    let first = read_response(&mut client).await;
    assert_eq!(
        first.as_ref().map(|(status, _)| *status),
        Some(200),
        "an h2c upgrade must be answered as a plain request: {first:?}"
    );
    // Still tollgate's HTTP/1.1 on this connection: routing and the limit apply.
    client
        .write_all(b"GET /api/second HTTP/1.1\r\nHost: t\r\n\r\nGET /not-routed HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    let second = read_response(&mut client).await.map(|(s, _)| s);
    let third = read_response(&mut client).await.map(|(s, _)| s);
    assert_eq!((second, third), (Some(429), Some(404)));

    let heads = upstream.heads().await;
    assert_eq!(heads.len(), 1, "upstream saw {heads:?}");
    let head = &heads[0];
    assert!(head.starts_with("GET /api/first "), "{head}");
    assert_eq!(field(head, "upgrade"), None, "{head}");
    assert_eq!(field(head, "http2-settings"), None, "{head}");
    assert!(
        !field(head, "connection").is_some_and(|c| c.contains("upgrade")),
        "{head}"
    );
    assert_eq!(upstream.tunnelled(), "", "bytes went through a tunnel");
}

/// `HTTP2-Settings` is h2c's connection option: it goes even when `Connection` does not name
/// it, and any upgrade token other than `websocket` goes, with or without `Connection: upgrade`.
#[tokio::test]
async fn non_websocket_upgrades_lose_upgrade_connection_and_http2_settings() {
    let upstream = RawUpstream::start(RawMode::SwitchToAsked).await;
    let proxy = proxy_for(upstream.addr, "").await;
    let variants = [
        "Connection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        "Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        "Connection: upgrade\r\nUpgrade: TLS/1.0\r\n",
        "Connection: keep-alive, Upgrade\r\nUpgrade: h2c, foo/2\r\n",
    ];
    for (i, lines) in variants.iter().enumerate() {
        let request = format!("GET /open/{i} HTTP/1.1\r\nHost: t\r\n{lines}\r\n");
        let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
        client.write_all(request.as_bytes()).await.expect("write");
        let answer = read_response(&mut client).await;
        assert_eq!(answer.map(|(s, _)| s), Some(200), "{lines:?}");
    }
    let heads = upstream.heads().await;
    assert_eq!(heads.len(), variants.len(), "{heads:?}");
    for head in &heads {
        assert_eq!(field(head, "upgrade"), None, "{head}");
        assert_eq!(field(head, "http2-settings"), None, "{head}");
        assert!(
            !field(head, "connection").is_some_and(|c| c.contains("upgrade")),
            "{head}"
        );
    }
    assert_eq!(upstream.tunnelled(), "");
}

/// A WebSocket upgrade request, raw.
fn websocket_request(path: &str, upgrade: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: {upgrade}\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
}

/// Of a list of upgrade tokens, only `websocket` goes upstream; the switch to it goes through.
#[tokio::test]
async fn only_websocket_of_an_upgrade_list_goes_upstream() {
    let upstream = RawUpstream::start(RawMode::SwitchToAsked).await;
    let proxy = proxy_for(upstream.addr, "").await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    let request = websocket_request("/open/list", "h2c, WebSocket");
    client.write_all(request.as_bytes()).await.expect("write");
    let answer = read_response(&mut client).await;
    let (status, head) = answer.expect("a response");
    assert_eq!(status, 101, "{head}");
    assert_eq!(
        field(&head, "upgrade").as_deref(),
        Some("websocket"),
        "{head}"
    );
    let heads = upstream.heads().await;
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert_eq!(field(&heads[0], "upgrade").as_deref(), Some("websocket"));
    // After a real switch the bytes are the new protocol's, carried both ways.
    client.write_all(b"frames").await.expect("write");
    let arrived = || upstream.tunnelled().len() >= "frames".len();
    crate::common::wait::until(
        "the bytes sent after the switch never reached the upstream",
        REPLY_WITHIN,
        arrived,
    )
    .await;
    assert_eq!(upstream.tunnelled(), "frames");
}

/// A `101` to another protocol than the one asked for (an upstream that switches a WebSocket
/// request to h2c) would open the same tunnel: 502, and nothing the client sends afterwards
/// reaches the upstream.
#[tokio::test]
async fn a_101_to_another_protocol_than_websocket_is_502() {
    let upstream = RawUpstream::start(RawMode::Always101("h2c")).await;
    let proxy = proxy_for(upstream.addr, "").await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    let request = websocket_request("/ws", "websocket");
    client.write_all(request.as_bytes()).await.expect("write");
    let answer = read_response(&mut client).await;
    assert_eq!(answer.as_ref().map(|(s, _)| *s), Some(502), "{answer:?}");
    let _ = client.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    tokio::time::sleep(SETTLE).await;
    assert_eq!(upstream.tunnelled(), "");
}

/// A `101` to a request that was not forwarded as an upgrade (the client asked for h2c, so it
/// went as a plain request; or it asked for nothing) switches nothing: 502.
#[tokio::test]
async fn a_101_to_a_plain_request_is_502() {
    for protocol in ["h2c", "websocket"] {
        let upstream = RawUpstream::start(RawMode::Always101(protocol)).await;
        let proxy = proxy_for(upstream.addr, "").await;
        for request in [
            "GET /open/plain HTTP/1.1\r\nHost: t\r\n\r\n",
            "GET /open/h2c HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n\
             Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        ] {
            let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
            client.write_all(request.as_bytes()).await.expect("write");
            let answer = read_response(&mut client).await;
            assert_eq!(
                answer.as_ref().map(|(s, _)| *s),
                Some(502),
                "101 {protocol} to {request:?}: {answer:?}"
            );
            let _ = client.write_all(b"tunnelled?").await;
        }
        tokio::time::sleep(SETTLE).await;
        assert_eq!(upstream.tunnelled(), "", "101 {protocol}");
    }
}

/// A 2xx to `CONNECT` is a switch too (hyper takes the connection over on both sides), and no
/// client may ask tollgate for a tunnel: CONNECT gets 405 before it reaches an upstream that
/// would have switched (the forwarder also answers 502 to a 2xx to CONNECT, should one ever
/// be sent).
#[tokio::test]
async fn connect_gets_405_before_an_upstream_that_would_tunnel() {
    let upstream = RawUpstream::start(RawMode::SwitchToAsked).await;
    let proxy = proxy_for(upstream.addr, "").await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(b"CONNECT /open/tunnel HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    let answer = read_response(&mut client).await;
    assert_eq!(answer.as_ref().map(|(s, _)| *s), Some(405), "{answer:?}");
    let _ = client.write_all(b"tunnelled?").await;
    tokio::time::sleep(SETTLE).await;
    assert_eq!(upstream.tunnelled(), "");
}

// ---------------------------------------------------------------------------------------------
// Item 3: a response body cannot switch the framing guard off

/// The review's guard switch: after a request with any `Upgrade` header, a response body with
/// `\r\nHTTP/1.1 101 ` in it turned the framing guard off for the rest of the connection, so a
/// CL.TE or bare-LF request behind it was forwarded and `header_read_timeout` no longer held.
/// Only a real switch, signalled by the forwarder, may turn it off.
#[tokio::test]
async fn a_response_body_that_looks_like_a_101_does_not_switch_the_framing_guard_off() {
    let upstream = RawUpstream::start(RawMode::BodyLooksLike101).await;
    let proxy = proxy_for(
        upstream.addr,
        "header_read_timeout = \"1s\"\nidle_timeout = \"10s\"",
    )
    .await;
    let body = "0\r\n\r\n";
    let cl_te = format!(
        "POST /open/second HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\
         Transfer-Encoding: chunked\r\n\r\n{body}{SMUGGLED}",
        body.len() + SMUGGLED.len()
    );
    let bare_lf = format!("GET /open/second HTTP/1.1\nHost: t\n\n{SMUGGLED}");
    for (what, second) in [("CL.TE", cl_te.as_str()), ("bare LF", bare_lf.as_str())] {
        let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
        for upgrade in [
            "Upgrade: websocket\r\n",
            "Connection: upgrade\r\nUpgrade: foo\r\n",
        ] {
            let first = format!("GET /open/first HTTP/1.1\r\nHost: t\r\n{upgrade}\r\n");
            client.write_all(first.as_bytes()).await.expect("write");
            let answer = read_response(&mut client).await;
            assert_eq!(answer.map(|(s, _)| s), Some(200), "{what}");
        }
        let _ = client.write_all(second.as_bytes()).await;
        let (closed, rest) = closes(&mut client).await;
        assert!(closed, "{what}: connection left open; got {rest:?}");
        assert!(
            rest.is_empty() || rest.starts_with("HTTP/1.1 400"),
            "{what}: {rest:?}"
        );
    }
    let heads = upstream.heads().await;
    assert!(
        heads.iter().all(|h| h.starts_with("GET /open/first ")),
        "a request behind the fake 101 reached the upstream: {heads:?}"
    );

    // And the wait for the next head is still bounded by header_read_timeout.
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(b"GET /open/first HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n\r\n")
        .await
        .expect("write");
    assert_eq!(read_response(&mut client).await.map(|(s, _)| s), Some(200));
    let since = Instant::now();
    client
        .write_all(b"GET /open/slow HTTP/1.1\r\n")
        .await
        .expect("write");
    let waited = closed_after(&mut client, since, "head wait after a fake 101").await;
    assert!(
        waited < Duration::from_millis(2500),
        "header_read_timeout (1s) no longer applied: closed after {waited:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Item 8: a WebSocket session keeps the bounds of the connection it came on

type Session =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A WebSocket session through tollgate to the harness upstream's `/ws` echo, checked with
/// one echo.
async fn open_session(proxy: &Proxy) -> Session {
    let url = format!("ws://{}/ws", proxy.addr);
    let (mut ws, response) =
        tokio::time::timeout(REPLY_WITHIN, tokio_tungstenite::connect_async(url))
            .await
            .expect("handshake in time")
            .expect("websocket handshake through tollgate");
    assert_eq!(response.status(), StatusCode::SWITCHING_PROTOCOLS);
    echo(&mut ws, "hello").await;
    ws
}

async fn echo(ws: &mut Session, text: &str) {
    ws.send(Message::text(text)).await.expect("send");
    let echoed = tokio::time::timeout(REPLY_WITHIN, ws.next())
        .await
        .expect("echo in time")
        .expect("a message")
        .expect("not an error");
    assert_eq!(echoed.into_text().expect("text"), text);
}

/// Whether the session is closed from tollgate's side within `within` (the socket closes:
/// end of stream or an error, as a dropped connection gives).
async fn session_closed_within(ws: &mut Session, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => return false,
            Ok(None) | Ok(Some(Err(_))) => return true,
            Ok(Some(Ok(Message::Close(_)))) => return true,
            Ok(Some(Ok(_))) => continue,
        }
    }
}

/// The review: 10 sessions open under `max_connections = 3`, and the open-connections gauge
/// at 0. Each session is a connection: it is counted while it lasts.
#[tokio::test]
async fn open_websocket_sessions_are_counted_in_the_connections_gauge() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr, "").await;
    let gauge = || proxy.server().metrics().open_connections.get();
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(open_session(&proxy).await);
    }
    assert_eq!(gauge(), 3, "three open sessions");
    for ws in &mut sessions {
        echo(ws, "still here").await;
    }
    for mut ws in sessions {
        ws.close(None).await.expect("close");
        while let Some(Ok(_)) = ws.next().await {}
    }
    let deadline = Instant::now() + REPLY_WITHIN;
    while gauge() != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gauge(), 0, "closed sessions leave the gauge");
}

/// With `max_connections = 3`, three open sessions hold every place: a fourth connection is
/// not served until one of them closes.
#[tokio::test]
async fn websocket_sessions_hold_their_max_connections_places() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr, "max_connections = 3").await;
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(open_session(&proxy).await);
    }
    let fourth = tokio::spawn({
        let url = proxy.url("/open/fourth");
        async move { get(&h1_client(), &url).await.status }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !fourth.is_finished(),
        "a fourth connection was served while three sessions held max_connections = 3"
    );
    let mut first = sessions.remove(0);
    first.close(None).await.expect("close");
    while let Some(Ok(_)) = first.next().await {}
    let status = tokio::time::timeout(REPLY_WITHIN, fourth)
        .await
        .expect("served once a session closed")
        .expect("task");
    assert_eq!(status, StatusCode::OK);
    // The others are still there.
    for ws in &mut sessions {
        echo(ws, "after").await;
    }
}

/// A session is cut after `idle_timeout` with no byte either way, and not while it is in use.
#[tokio::test]
async fn a_websocket_session_with_no_traffic_is_closed_after_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr, "idle_timeout = \"1s\"").await;
    let mut ws = open_session(&proxy).await;
    // In use for twice the idle timeout: not cut.
    for i in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        echo(&mut ws, &format!("busy {i}")).await;
    }
    let quiet_since = Instant::now();
    assert!(
        session_closed_within(&mut ws, Duration::from_secs(3)).await,
        "a session with no traffic outlived idle_timeout (1s) by 3s"
    );
    let after = quiet_since.elapsed();
    assert!(
        after >= Duration::from_millis(800),
        "closed after {after:?}"
    );
}

/// A session still open at shutdown is waited for like an in-flight request (it keeps
/// working during the drain) and closed when `shutdown_timeout` ends; `shutdown()` returns.
#[tokio::test]
async fn a_websocket_session_open_at_shutdown_is_closed_when_shutdown_timeout_ends() {
    let upstream = Upstream::start().await;
    let mut proxy = proxy_for(upstream.addr, "workers = 1\nshutdown_timeout = \"1s\"").await;
    let mut ws = open_session(&proxy).await;
    let server = proxy.server.take().expect("running");
    let started = Instant::now();
    let drain = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        echo(&mut ws, "during the drain").await;
    };
    let stop = tokio::time::timeout(Duration::from_secs(5), server.shutdown());
    let (stopped, ()) = tokio::join!(stop, drain);
    assert!(stopped.is_ok(), "shutdown() did not return");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "shutdown did not wait for the open session: {took:?}"
    );
    assert!(
        session_closed_within(&mut ws, Duration::from_secs(1)).await,
        "the session outlived the shutdown"
    );
}

/// Once the upstream has closed its side, the session is over: a client that keeps its own
/// half open (it never closes the socket) does not keep the session, and its connection
/// place, until idle_timeout. (With a copy that waited for both halves, it did.)
#[tokio::test]
async fn a_session_ends_when_the_upstream_closes_even_if_the_client_keeps_its_half_open() {
    let upstream = Upstream::start().await;
    let proxy = proxy_for(upstream.addr, "").await;
    let gauge = || proxy.server().metrics().open_connections.get();
    let mut ws = open_session(&proxy).await;
    assert_eq!(gauge(), 1);
    // The harness upstream ends its side on a close frame, without answering it.
    ws.close(None).await.expect("close");
    assert!(
        session_closed_within(&mut ws, REPLY_WITHIN).await,
        "tollgate kept the client side open after the upstream closed"
    );
    let deadline = Instant::now() + REPLY_WITHIN;
    while gauge() != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gauge(), 0, "the session outlived the upstream's close");
    drop(ws);
}
