//! Request normalisation at the edge (contract §3, §4a and 5; issue 14 items 4, 5 and 6 and four of
//! its smaller defects): one spelling of the host, path parameters that do not move a request
//! to another route, keyed headers a client cannot double, and the fields tollgate itself
//! answers for (`X-Real-IP`, `Forwarded`, the response's HTTP version, `TRACE`).
//!
//! Every test here reproduces what the review sent to main and saw pass a limit (or reach the
//! upstream) that it should not have.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;

/// How long a raw exchange waits for an answer that should come at once.
const RAW_WAIT: Duration = Duration::from_secs(3);

/// The status line of the first response tollgate sends back to `request` (raw bytes on a
/// fresh connection), e.g. `HTTP/1.1 429 Too Many Requests`.
async fn status_line(addr: SocketAddr, request: &str) -> String {
    let answer = raw_exchange(addr, request.as_bytes(), RAW_WAIT).await;
    answer.lines().next().unwrap_or("").to_string()
}

/// The status code of that first response.
async fn raw_status(addr: SocketAddr, request: &str) -> u16 {
    let line = status_line(addr, request).await;
    line.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in the answer to {request:?}: {line:?}"))
}

/// A GET that closes its connection after one answer, with the given header lines and
/// `Host: a.example` unless they name a Host themselves.
fn raw_get(target: &str, header_lines: &[&str]) -> String {
    let mut text = format!("GET {target} HTTP/1.1\r\n");
    if !header_lines
        .iter()
        .any(|l| l.to_ascii_lowercase().starts_with("host:"))
    {
        text.push_str("Host: a.example\r\n");
    }
    for line in header_lines {
        text.push_str(line);
        text.push_str("\r\n");
    }
    text.push_str("Connection: close\r\n\r\n");
    text
}

// ---------------------------------------------------------------------------------------------
// Item 4: trailing-dot hosts and malformed Host values

const HOSTED: &str = r#"
[[routes]]
name = "api"
host = "api.example.com"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "1h"
"#;

/// One HTTP/2 (prior knowledge) request on a fresh connection to `addr` whose `:authority` is
/// the authority of `uri`, whatever that name resolves to.
async fn h2_status(addr: SocketAddr, uri: &str) -> StatusCode {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http2::handshake::<_, _, Full<Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .expect("h2c handshake");
    tokio::spawn(conn);
    let req = Request::get(uri)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = sender.send_request(req).await.expect("h2 response");
    let status = response.status();
    let _ = response.into_body().collect().await;
    status
}

/// Review: `Host: api.example.com.` (any case, with a port, absolute-form, or HTTP/2
/// `:authority`) missed the host-scoped route and landed on the unlimited catch-all. Each
/// spelling must hit the same route and the same bucket: after the one allowed request every
/// one of them is denied.
#[tokio::test]
async fn trailing_dot_host_is_the_same_host_in_every_spelling() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", HOSTED),
        upstream.addr,
        &[],
    ))
    .await;
    let addr = proxy.addr;
    assert_eq!(
        raw_status(addr, &raw_get("/x", &["Host: api.example.com"])).await,
        200
    );
    for (what, request) in [
        ("trailing dot", raw_get("/x", &["Host: api.example.com."])),
        ("upper case", raw_get("/x", &["Host: API.Example.COM."])),
        (
            "with a port",
            raw_get("/x", &["Host: api.example.com.:8080"]),
        ),
        (
            "absolute-form",
            raw_get("http://api.example.com./x", &["Host: api.example.com."]),
        ),
        (
            "absolute-form, Host without the dot",
            raw_get("http://api.example.com./x", &["Host: api.example.com"]),
        ),
    ] {
        assert_eq!(raw_status(addr, &request).await, 429, "{what}: {request:?}");
    }
    assert_eq!(
        h2_status(addr, "http://api.example.com./x").await,
        StatusCode::TOO_MANY_REQUESTS,
        "HTTP/2 :authority with a trailing dot"
    );
    assert_eq!(
        upstream.count(),
        1,
        "only the first request may be forwarded"
    );
}

/// The dot is removed in the `Host` and `X-Forwarded-Host` the upstream gets, so the backend
/// sees the spelling the router saw.
#[tokio::test]
async fn trailing_dot_is_removed_from_host_and_x_forwarded_host_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream.addr, &[])).await;
    assert_eq!(
        raw_status(proxy.addr, &raw_get("/x", &["Host: Plain.Example.:8080"])).await,
        200
    );
    let seen = upstream.last();
    assert_eq!(seen.headers.get("host").unwrap(), "plain.example:8080");
    assert_eq!(
        seen.headers.get("x-forwarded-host").unwrap(),
        "plain.example:8080"
    );
}

/// Review: Host values that are no `host[:port]` were routed (to the catch-all) instead of
/// refused: a non-numeric port, brackets around a name, a list, empty labels.
#[tokio::test]
async fn malformed_host_values_get_400_and_are_never_forwarded() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", HOSTED),
        upstream.addr,
        &[],
    ))
    .await;
    for host in [
        "api.example.com:abc",
        "api.example.com:80x",
        "api.example.com:99999",
        "[api.example.com]",
        "[api.example.com]:80",
        "api.example.com, other.example",
        "api.example.com,other.example",
        "api..example.com",
        ".api.example.com",
        "api.example.com..",
        ".",
        "api.example.com:",
        "[::1",
        "[::1]x",
    ] {
        let host_line = format!("Host: {host}");
        let request = raw_get("/x", &[&host_line]);
        assert_eq!(raw_status(proxy.addr, &request).await, 400, "{host:?}");
    }
    // Well-formed ones still pass: an IPv6 literal, an IPv4 address, a port.
    for host in ["[::1]:8080", "[::1]", "192.0.2.1:80", "localhost"] {
        let host_line = format!("Host: {host}");
        let request = raw_get("/x", &[&host_line]);
        assert_eq!(raw_status(proxy.addr, &request).await, 200, "{host:?}");
    }
    assert_eq!(upstream.count(), 4, "a malformed Host reached the upstream");
}

// ---------------------------------------------------------------------------------------------
// Item 5: duplicate keyed headers and underscore twins

const KEYED: &str = r#"
[[routes]]
name = "keyed"
path_prefix = "/keyed"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 1
  window = "1h"

[[routes]]
name = "bearer"
path_prefix = "/bearer"
upstream = "app"

  [[routes.limits]]
  key = ["header:authorization", "ip"]
  requests = 1
  window = "1h"
"#;

/// Review: with two `X-Api-Key` fields tollgate keyed the first while the upstream got both,
/// so a client rotating the first got a fresh budget per request while the backend
/// authenticated the last. contract §3: a keyed header sent more than once gets 400.
#[tokio::test]
async fn a_keyed_header_sent_twice_gets_400_and_is_not_forwarded() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", KEYED),
        upstream.addr,
        &[],
    ))
    .await;
    let addr = proxy.addr;
    for n in 0..3 {
        let rotating = format!("X-Api-Key: rotating-{n}");
        let request = raw_get("/keyed", &[&rotating, "X-Api-Key: victim"]);
        assert_eq!(raw_status(addr, &request).await, 400, "{request:?}");
        let rotating = format!("Authorization: Bearer rotating-{n}");
        let request = raw_get("/bearer", &[&rotating, "Authorization: Bearer victim"]);
        assert_eq!(raw_status(addr, &request).await, 400, "{request:?}");
    }
    assert_eq!(upstream.count(), 0, "a doubled keyed header was forwarded");
    // One copy is counted as before, and a header that no limit names may repeat.
    let one = raw_get("/keyed", &["X-Api-Key: victim", "X-Other: 1", "X-Other: 2"]);
    assert_eq!(raw_status(addr, &one).await, 200);
    assert_eq!(raw_status(addr, &one).await, 429);
    // A route whose limits do not name the header does not care how often it comes.
    let elsewhere = raw_get("/open", &["X-Api-Key: a", "X-Api-Key: b"]);
    assert_eq!(raw_status(addr, &elsewhere).await, 200);
}

/// The same over HTTP/2, where the fields arrive as separate header-block entries.
#[tokio::test]
async fn a_keyed_header_sent_twice_over_http2_gets_400() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", KEYED),
        upstream.addr,
        &[],
    ))
    .await;
    let client = h2c_client();
    let req = Request::get(proxy.url("/keyed"))
        .header("x-api-key", "rotating")
        .header("x-api-key", "victim")
        .body(Full::new(Bytes::new()))
        .expect("request");
    assert_eq!(send(&client, req).await.status, StatusCode::BAD_REQUEST);
    assert_eq!(upstream.count(), 0);
}

/// HTTP/2 may split `cookie` into several fields (RFC 9113 8.2.3): that is one header, not a
/// doubled one. A limit keyed on it counts the joined value, and the request passes.
#[tokio::test]
async fn split_http2_cookies_are_one_keyed_header() {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "session"
upstream = "app"

  [[routes.limits]]
  key = "header:cookie"
  requests = 1
  window = "1h"
"#;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", routes),
        upstream.addr,
        &[],
    ))
    .await;
    let client = h2c_client();
    let split = |second: &str| {
        Request::get(proxy.url("/x"))
            .header("cookie", "a=1")
            .header("cookie", second)
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    assert_eq!(send(&client, split("b=2")).await.status, StatusCode::OK);
    assert_eq!(upstream.last().headers.get("cookie").unwrap(), "a=1; b=2");
    // The same joined value is the same bucket; another second crumb is another one.
    assert_eq!(
        send(&client, split("b=2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&client, split("b=3")).await.status, StatusCode::OK);
}

/// Review: `X_Api_Key` is not counted by a `header:x-api-key` limit but was forwarded, and
/// CGI/WSGI backends read it as `X-Api-Key`. contract §4a: names with `_` are dropped by default.
#[tokio::test]
async fn underscore_header_names_are_dropped_before_forwarding() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", KEYED),
        upstream.addr,
        &[],
    ))
    .await;
    for n in 0..3 {
        let twin = format!("X_Api_Key: rotating-{n}");
        let request = raw_get("/keyed", &[&twin, "X-Custom_Field: 1", "X-Kept: yes"]);
        assert_eq!(raw_status(proxy.addr, &request).await, 200);
    }
    for seen in upstream.requests() {
        let underscored: Vec<&str> = seen
            .headers
            .keys()
            .map(|k| k.as_str())
            .filter(|k| k.contains('_'))
            .collect();
        assert!(underscored.is_empty(), "forwarded: {underscored:?}");
        assert_eq!(seen.headers.get("x-kept").unwrap(), "yes");
    }
}

/// `server.underscores_in_headers = true` keeps them (nginx's option of the same name).
#[tokio::test]
async fn underscores_in_headers_true_forwards_them() {
    let upstream = Upstream::start().await;
    let text = limits_config("", "underscores_in_headers = true", "");
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let request = raw_get("/x", &["X_Legacy_Field: 1"]);
    assert_eq!(raw_status(proxy.addr, &request).await, 200);
    assert_eq!(upstream.last().headers.get("x_legacy_field").unwrap(), "1");
}

/// The option is read per request, like `trusted_proxies`: a reload applies it (it changes no
/// listener or connection, only how the next request is rewritten).
#[tokio::test]
async fn a_reload_applies_underscores_in_headers() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream.addr, &[])).await;
    let request = raw_get("/x", &["X_Legacy_Field: 1"]);
    assert_eq!(raw_status(proxy.addr, &request).await, 200);
    assert!(upstream.last().headers.get("x_legacy_field").is_none());
    let keep = limits_config("", "underscores_in_headers = true", "");
    assert!(
        proxy
            .server()
            .reload(config_from(&keep, upstream.addr, &[]))
            .await
    );
    assert_eq!(raw_status(proxy.addr, &request).await, 200);
    assert_eq!(upstream.last().headers.get("x_legacy_field").unwrap(), "1");
}

// ---------------------------------------------------------------------------------------------
// Item 6: path parameters

const LOGIN: &str = r#"
[[routes]]
name = "login"
path_prefix = "/login"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 1
  window = "1h"

[[routes]]
name = "app"
path_prefix = "/app"
upstream = "app"
strip_prefix = true
"#;

/// Review: `/login;jsessionid=1` missed the `/login` route (Tomcat, Jetty and Spring serve it
/// as `/login`) and went to the catch-all, unlimited. Every spelling with parameters is the
/// same route and bucket, and goes upstream with its parameters.
#[tokio::test]
async fn path_parameters_do_not_move_a_request_off_its_route() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", LOGIN),
        upstream.addr,
        &[],
    ))
    .await;
    let addr = proxy.addr;
    assert_eq!(
        raw_status(addr, &raw_get("/login;jsessionid=1", &[])).await,
        200
    );
    assert_eq!(upstream.last().uri, "/login;jsessionid=1");
    for target in [
        "/login;jsessionid=2",
        "/login;",
        "/login;a=1;b=2/",
        "/login;x/next",
        "/login%3Bjsessionid=3",
        "/login%3bjsessionid=3",
        "/;jsessionid=4/login",
        "//;x//login;y",
        "/login?x=1;y",
    ] {
        assert_eq!(
            raw_status(addr, &raw_get(target, &[])).await,
            429,
            "{target}"
        );
    }
    assert_eq!(upstream.count(), 1);
}

/// The path goes upstream with its parameters; `strip_prefix` removes the matched segments
/// with theirs; dot segments still apply to whole segments (`/login;x/..` is the root).
#[tokio::test]
async fn path_parameters_go_upstream_and_strip_prefix_removes_matched_ones() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", LOGIN),
        upstream.addr,
        &[],
    ))
    .await;
    for (sent, forwarded) in [
        ("/app;v=1/x;y=2?q=1;2", "/x;y=2?q=1;2"),
        ("/app;v=1", "/"),
        ("/;s=1/app/x", "/x"),
        ("/app/%78;a", "/x;a"),
        ("/login;x/../other;p", "/other;p"),
    ] {
        assert_eq!(
            raw_status(proxy.addr, &raw_get(sent, &[])).await,
            200,
            "{sent}"
        );
        assert_eq!(upstream.last().uri, forwarded, "{sent}");
    }
}

/// `..;` is a dot segment to Tomcat (`/public/..;/login` is `/login` there) and a plain name to
/// most others: backends disagree, so a dot segment with parameters is refused.
#[tokio::test]
async fn dot_segments_with_parameters_get_400() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", LOGIN),
        upstream.addr,
        &[],
    ))
    .await;
    for target in [
        "/public/..;/login",
        "/public/..;x=1/login",
        "/public/%2e%2e;/login",
        "/public/..%3B/login",
        "/public/.;/login",
    ] {
        assert_eq!(
            raw_status(proxy.addr, &raw_get(target, &[])).await,
            400,
            "{target}"
        );
    }
    assert_eq!(upstream.count(), 0);
}

// ---------------------------------------------------------------------------------------------
// Smaller defects: HTTP/1.0 without Host, the response's version, X-Real-IP and Forwarded,
// TRACE

const HOST_AND_HEALTH: &str = r#"
[[routes]]
name = "hosted"
host = "api.example.com"
path_prefix = "/health"
upstream = "app"
strip_prefix = true
"#;

/// Review: HAProxy's default `option httpchk` (`OPTIONS / HTTP/1.0`, no Host) got 400 and
/// marked tollgate down. contract §4a: accepted, and only routes without `host` match it.
#[tokio::test]
async fn http10_without_host_is_served_by_routes_without_host() {
    let upstream = Upstream::start().await;
    let text = limits_config("", "", HOST_AND_HEALTH);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let answer = raw_exchange(proxy.addr, b"OPTIONS / HTTP/1.0\r\n\r\n", RAW_WAIT).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer:?}");
    let answer = raw_exchange(proxy.addr, b"GET /health HTTP/1.0\r\n\r\n", RAW_WAIT).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer:?}");
    // The catch-all got it (the hosted route would have stripped `/health`), with a Host the
    // upstream can use (its own authority) and no X-Forwarded-Host.
    let seen = upstream.last();
    assert_eq!(seen.uri, "/health");
    assert_eq!(
        seen.headers.get("host").unwrap().to_str().unwrap(),
        upstream.addr.to_string()
    );
    assert!(seen.headers.get("x-forwarded-host").is_none());
    // HTTP/1.1 still needs its Host.
    let answer = raw_exchange(proxy.addr, b"GET /health HTTP/1.1\r\n\r\n", RAW_WAIT).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    assert_eq!(upstream.count(), 2);
}

/// An upstream that answers every request with `HTTP/1.0 200 OK` and a Content-Length, then
/// closes, as an HTTP/1.0 server does.
async fn http10_upstream() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = stream
                    .write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\nold ok")
                    .await;
            });
        }
    });
    (addr, task)
}

/// Reads one response with a Content-Length body from `stream`; returns its head and body.
async fn read_response(stream: &mut TcpStream) -> (String, String) {
    let mut data = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&data[..end]).to_string();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or_else(|| panic!("no Content-Length in {head:?}"));
            if data.len() >= end + 4 + length {
                let body = String::from_utf8_lossy(&data[end + 4..end + 4 + length]).to_string();
                return (head, body);
            }
        }
        let n = tokio::time::timeout(RAW_WAIT, stream.read(&mut buf))
            .await
            .expect("a response in time")
            .expect("read");
        assert!(n > 0, "connection closed mid-response: {data:?}");
        data.extend_from_slice(&buf[..n]);
    }
}

/// Review: the status line copied the upstream's version (`HTTP/1.0 200` to an HTTP/1.1
/// client), and the client's keep-alive connection broke. contract §5: tollgate's own version.
#[tokio::test]
async fn an_http10_upstream_does_not_downgrade_the_client_connection() {
    let (upstream_addr, _task) = http10_upstream().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream_addr, &[])).await;
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    for n in 0..2 {
        stream
            .write_all(b"GET /old HTTP/1.1\r\nHost: a.example\r\n\r\n")
            .await
            .expect("write");
        let (head, body) = read_response(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 200"), "response {n}: {head:?}");
        assert_eq!(body, "old ok");
    }
}

/// Review: `X-Real-IP` and `Forwarded` from an untrusted client reached the upstream as sent,
/// and a backend that believes them was spoofed.
#[tokio::test]
async fn x_real_ip_is_set_and_untrusted_forwarded_removed() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream.addr, &[])).await;
    let request = raw_get(
        "/x",
        &[
            "Host: a.example",
            "X-Real-IP: 6.6.6.6",
            "X-Real-IP: 7.7.7.7",
            "Forwarded: for=6.6.6.6;proto=https",
            "X-Forwarded-For: 6.6.6.6",
        ],
    );
    assert_eq!(raw_status(proxy.addr, &request).await, 200);
    let seen = upstream.last();
    let real: Vec<_> = seen.headers.get_all("x-real-ip").iter().collect();
    assert_eq!(real, ["127.0.0.1"]);
    assert!(seen.headers.get("forwarded").is_none());
}

/// From a trusted proxy, `X-Real-IP` is the client address of contract §4 (what the limiter keys
/// on), and its `Forwarded` passes.
#[tokio::test]
async fn behind_a_trusted_proxy_x_real_ip_is_the_walked_client_and_forwarded_passes() {
    let upstream = Upstream::start().await;
    let text = limits_config("", "trusted_proxies = [\"127.0.0.1/32\"]", "");
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let request = raw_get(
        "/x",
        &[
            "Host: a.example",
            "X-Real-IP: 6.6.6.6",
            "Forwarded: for=198.51.100.7",
            "X-Forwarded-For: 6.6.6.6, 198.51.100.7",
        ],
    );
    assert_eq!(raw_status(proxy.addr, &request).await, 200);
    let seen = upstream.last();
    assert_eq!(seen.headers.get("x-real-ip").unwrap(), "198.51.100.7");
    assert_eq!(seen.headers.get("forwarded").unwrap(), "for=198.51.100.7");
}

/// Review: `TRACE` was forwarded (it reflects the request, credentials included, and nginx
/// answers 405). contract §4a: 405, never forwarded.
#[tokio::test]
async fn trace_gets_405_and_is_not_forwarded() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream.addr, &[])).await;
    let answer = raw_exchange(
        proxy.addr,
        b"TRACE /x HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n",
        RAW_WAIT,
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer:?}");
    let client = h2c_client();
    let req = Request::builder()
        .method("TRACE")
        .uri(proxy.url("/x"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    assert_eq!(
        send(&client, req).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(upstream.count(), 0);
}
