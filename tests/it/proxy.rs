//! The proxy core: forwarding, headers, streaming, upgrades, errors, timeouts, graceful stop.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

const ROUTES: &str = r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"
strip_prefix = true

[[routes]]
name = "posts-only"
path_prefix = "/posts"
methods = ["POST"]
upstream = "app"

[[routes]]
name = "mirror"
host = "mirror.test"
upstream = "rehost"

[[routes]]
name = "everything"
host = "*.example.test"
upstream = "app"

[upstreams.rehost]
url = "http://@UPSTREAM@"
preserve_host = false
"#;

async fn setup() -> (Upstream, Proxy, H1Client) {
    let upstream = Upstream::start().await;
    let config = config_from(&format!("{BASE}{ROUTES}"), upstream.addr, &[]);
    let proxy = Proxy::start(config).await;
    (upstream, proxy, h1_client())
}

/// A proxy with a single connection worker, for tests that count upstream connections: each
/// worker keeps its own idle pool, so with several a client accepted by another worker would
/// rightly dial again. `upstream_extra` is added to `[upstreams.app]`.
async fn one_worker_proxy(upstream: &Upstream, upstream_extra: &str) -> Proxy {
    let base = BASE
        .replace("[server]\n", "[server]\nworkers = 1\n")
        .replace(
            "[upstreams.app]\n",
            &format!("[upstreams.app]\n{upstream_extra}"),
        );
    Proxy::start(config_from(&format!("{base}{ROUTES}"), upstream.addr, &[])).await
}

fn req(method: &str, url: &str, host: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(url)
        .header("host", host)
        .body(Full::new(body.into()))
        .expect("request")
}

#[tokio::test]
async fn method_path_query_and_body_round_trip() {
    let (upstream, proxy, client) = setup().await;
    let answer = send(
        &client,
        req(
            "PUT",
            &proxy.url("/echo?x=1&y=%20z"),
            "a.example.test",
            "hello body",
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "hello body");
    let seen = upstream.last();
    assert_eq!(seen.method, "PUT");
    assert_eq!(seen.uri, "/echo?x=1&y=%20z");
    assert_eq!(&seen.body[..], b"hello body");
    assert_eq!(seen.headers.get("host").unwrap(), "a.example.test");
}

#[tokio::test]
async fn twenty_megabytes_stream_both_ways_intact() {
    let (upstream, proxy, client) = setup().await;
    const SIZE: usize = 20 * 1024 * 1024;
    let download = send(
        &client,
        req(
            "GET",
            &proxy.url(&format!("/big/{SIZE}")),
            "a.example.test",
            "",
        ),
    )
    .await;
    assert_eq!(download.status, StatusCode::OK);
    assert_eq!(download.body.len(), SIZE);
    assert!(download
        .body
        .iter()
        .enumerate()
        .all(|(i, b)| *b == pattern_byte(i)));

    let upload: Vec<u8> = (0..SIZE).map(|i| pattern_byte(i * 7)).collect();
    let answer = send(
        &client,
        req(
            "POST",
            &proxy.url("/echo"),
            "a.example.test",
            upload.clone(),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.body.len(), SIZE);
    assert!(answer.body[..] == upload[..], "echoed upload differs");
    assert!(
        upstream.last().body[..] == upload[..],
        "upstream saw a different upload"
    );
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_both_ways_and_te_trailers_kept() {
    let (upstream, proxy, client) = setup().await;
    let request = Request::get(proxy.url("/hop"))
        .header("host", "a.example.test")
        .header("connection", "x-client-hop")
        .header("x-client-hop", "private")
        .header("keep-alive", "timeout=9")
        .header("proxy-authorization", "Basic c2VjcmV0")
        .header("proxy-connection", "keep-alive")
        .header("te", "trailers")
        .header("x-end-to-end", "kept")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let answer = send(&client, request).await;
    assert_eq!(answer.status, StatusCode::OK);
    let seen = upstream.last();
    for gone in [
        "x-client-hop",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
    ] {
        assert!(
            seen.headers.get(gone).is_none(),
            "{gone} reached the upstream"
        );
    }
    assert_eq!(seen.headers.get("te").unwrap(), "trailers");
    assert_eq!(seen.headers.get("x-end-to-end").unwrap(), "kept");
    for gone in ["x-up-hop", "keep-alive", "proxy-authenticate"] {
        assert!(answer.header(gone).is_none(), "{gone} reached the client");
    }
    assert_eq!(answer.header("x-up-end"), Some("kept"));
}

#[tokio::test]
async fn forwarded_headers_are_set_and_spoofed_proto_replaced() {
    let (upstream, proxy, client) = setup().await;
    let request = Request::get(proxy.url("/fwd"))
        .header("host", "a.example.test")
        .header("x-forwarded-for", "198.51.100.1")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "evil.test")
        .body(Full::new(Bytes::new()))
        .expect("request");
    send(&client, request).await;
    let seen = upstream.last();
    assert_eq!(
        seen.headers.get("x-forwarded-for").unwrap(),
        "198.51.100.1, 127.0.0.1"
    );
    assert_eq!(seen.headers.get("x-forwarded-proto").unwrap(), "http");
    assert_eq!(
        seen.headers.get("x-forwarded-host").unwrap(),
        "a.example.test"
    );
}

#[tokio::test]
async fn strip_prefix_removes_the_route_prefix() {
    let (upstream, proxy, client) = setup().await;
    send(
        &client,
        req("GET", &proxy.url("/api/v1/items?q=1"), "any", ""),
    )
    .await;
    assert_eq!(upstream.last().uri, "/v1/items?q=1");
    send(&client, req("GET", &proxy.url("/api"), "any", "")).await;
    assert_eq!(upstream.last().uri, "/");
    // Segment boundary: /apix is not under /api and matches no route for this host.
    let answer = send(&client, req("GET", &proxy.url("/apix"), "any", "")).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn preserve_host_both_ways() {
    let (upstream, proxy, client) = setup().await;
    send(
        &client,
        req("GET", &proxy.url("/x"), "Deep.A.Example.Test", ""),
    )
    .await;
    assert_eq!(
        upstream.last().headers.get("host").unwrap(),
        "deep.a.example.test"
    );
    // X-Forwarded-Host carries the normalised spelling too, not the client's.
    assert_eq!(
        upstream.last().headers.get("x-forwarded-host").unwrap(),
        "deep.a.example.test"
    );
    send(&client, req("GET", &proxy.url("/x"), "mirror.test", "")).await;
    assert_eq!(
        upstream.last().headers.get("host").unwrap(),
        &upstream.addr.to_string()
    );
}

#[tokio::test]
async fn routes_match_host_method_and_order() {
    let (upstream, proxy, client) = setup().await;
    // The bare domain does not match "*.example.test".
    let answer = send(&client, req("GET", &proxy.url("/x"), "example.test", "")).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    // /posts only takes POST; GET falls through to the host route.
    let answer = send(&client, req("GET", &proxy.url("/posts"), "nohost", "")).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    let answer = send(&client, req("POST", &proxy.url("/posts"), "nohost", "x")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(upstream.count(), 1, "only the POST was forwarded");
}

#[tokio::test]
async fn no_route_is_404_and_never_forwarded() {
    let (upstream, proxy, client) = setup().await;
    let answer = send(
        &client,
        req("GET", &proxy.url("/nothing"), "unknown.host", ""),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(upstream.count(), 0);
}

#[tokio::test]
async fn h2c_client_reaches_an_http1_upstream_with_trailers() {
    let (upstream, proxy, _) = setup().await;
    let client = h2c_client();
    // Over HTTP/2 the authority is the URI's; a disagreeing `host` header would be a 400.
    let request = Request::post(proxy.url("/api/echo"))
        .body(Full::new(Bytes::from_static(b"over h2")))
        .expect("request");
    let answer = send(&client, request).await;
    assert_eq!(answer.version, Version::HTTP_2);
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "over h2");
    assert_eq!(upstream.last().version, Version::HTTP_11);

    // HTTP/2 may carry cookies as several fields; HTTP/1.1 gets one, joined by "; ".
    let request = Request::get(proxy.url("/api/cookies"))
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body(Full::new(Bytes::new()))
        .expect("request");
    assert_eq!(send(&client, request).await.status, StatusCode::OK);
    let seen = upstream.last();
    let cookies: Vec<_> = seen.headers.get_all("cookie").iter().collect();
    assert_eq!(cookies, ["a=1; b=2"]);

    // Trailers come back over HTTP/2 when the client asks for them.
    let request = Request::get(proxy.url("/api/trailers"))
        .header("te", "trailers")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = client.request(request).await.expect("trailers request");
    let collected = response.into_body().collect().await.expect("body");
    let trailers = collected
        .trailers()
        .cloned()
        .expect("trailers passed through");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    assert_eq!(&collected.to_bytes()[..], b"payload");

    // And over HTTP/1.1 (chunked), with the client's TE: trailers.
    let request = Request::get(proxy.url("/api/trailers"))
        .header("te", "trailers")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = h1_client()
        .request(request)
        .await
        .expect("h1 trailers request");
    let collected = response.into_body().collect().await.expect("body");
    let trailers = collected
        .trailers()
        .cloned()
        .expect("h1 trailers passed through");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
}

#[tokio::test]
async fn websocket_echo_through_the_proxy() {
    let (upstream, proxy, _) = setup().await;
    let url = format!("ws://{}/ws", proxy.addr);
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(url)
            .expect("ws request");
    request
        .headers_mut()
        .insert("host", "a.example.test".parse().expect("host"));
    let (mut ws, response) = tokio_tungstenite::connect_async(request)
        .await
        .expect("websocket handshake through tollgate");
    assert_eq!(response.status(), StatusCode::SWITCHING_PROTOCOLS);
    use tokio_tungstenite::tungstenite::Message;
    for text in ["first", "second"] {
        ws.send(Message::text(text)).await.expect("send");
        let echoed = tokio::time::timeout(Duration::from_secs(5), ws.next())
            .await
            .expect("echo in time")
            .expect("a message")
            .expect("not an error");
        assert_eq!(echoed.into_text().expect("text"), text);
    }
    let seen = upstream.last();
    assert_eq!(seen.headers.get("upgrade").unwrap(), "websocket");
}

#[tokio::test]
async fn unreachable_upstream_is_502_and_slow_upstream_504() {
    let closed = RefusedPort::new();
    let upstream = Upstream::start().await;
    let text = format!(
        "{BASE}
[upstreams.dead]
url = \"http://{closed}\"
connect_timeout = \"500ms\"

[upstreams.slow]
url = \"http://@UPSTREAM@\"
response_timeout = \"300ms\"

[[routes]]
name = \"dead\"
path_prefix = \"/dead\"
upstream = \"dead\"

[[routes]]
name = \"slow\"
upstream = \"slow\"
"
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let client = h1_client();
    let answer = send(&client, req("GET", &proxy.url("/dead"), "x", "")).await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    let started = Instant::now();
    let answer = send(&client, req("GET", &proxy.url("/slow/3000"), "x", "")).await;
    assert_eq!(answer.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "504 came after {:?}, not at the response timeout",
        started.elapsed()
    );
}

#[tokio::test]
async fn slow_headers_are_cut_off_while_others_are_served() {
    let upstream = Upstream::start().await;
    let text = "[server]
listen = [\"127.0.0.1:0\"]
header_read_timeout = \"500ms\"

[upstreams.app]
url = \"http://@UPSTREAM@\"

[[routes]]
name = \"all\"
upstream = \"app\"
"
    .to_string();
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let mut slow = TcpStream::connect(proxy.addr).await.expect("connect");
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("partial headers");
    let started = Instant::now();

    // Meanwhile another client is served normally.
    let answer = get(&h1_client(), &proxy.url("/fast")).await;
    assert_eq!(answer.status, StatusCode::OK);

    let waited = closed_after(&mut slow, started, "the slow connection was not closed").await;
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(3),
        "closed after {waited:?}"
    );
    assert_eq!(
        upstream.count(),
        1,
        "only the fast request reached the upstream"
    );
}

#[tokio::test]
async fn graceful_stop_lets_an_in_flight_request_finish() {
    let (upstream, mut proxy, client) = setup().await;
    let url = proxy.url("/slow/800");
    let in_flight = tokio::spawn({
        let client = client.clone();
        async move { send(&client, req("GET", &url, "a.example.test", "")).await }
    });
    // Wait until the upstream has the request, then stop.
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.count() == 0 {
        assert!(
            Instant::now() < deadline,
            "request never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let addr = proxy.addr;
    proxy.shutdown().await;
    let answer = in_flight.await.expect("task");
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "slow ok");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "still accepting after shutdown"
    );
}

/// Sends `n` requests for `path` at once, each from a client of its own, and checks they all
/// succeed.
async fn concurrent_slow_requests(proxy: &Proxy, n: usize, path: &str) {
    let burst = (0..n).map(|_| {
        let client = h1_client();
        let url = proxy.url(path);
        tokio::spawn(async move { send(&client, req("GET", &url, "a.example.test", "")).await })
    });
    for answer in futures_util::future::join_all(burst).await {
        assert_eq!(answer.expect("task").status, StatusCode::OK);
    }
}

/// Upstream connections are kept alive and reused: a keep-alive client's sequential requests
/// travel on one upstream connection, and a burst opens at most one per concurrent request.
/// One worker: each worker keeps its own idle connections, so with several a new client
/// accepted by another worker would rightly open one of its own.
#[tokio::test]
async fn upstream_connections_are_reused() {
    let upstream = Upstream::start().await;
    let proxy = one_worker_proxy(&upstream, "").await;
    let client = h1_client();
    for _ in 0..20 {
        let answer = send(&client, req("GET", &proxy.url("/x"), "a.example.test", "")).await;
        assert_eq!(answer.status, StatusCode::OK);
    }
    assert_eq!(upstream.count(), 20);
    assert_eq!(upstream.connections(), 1);

    concurrent_slow_requests(&proxy, 8, "/slow/100").await;
    let after_burst = upstream.connections();
    assert!(
        (2..=9).contains(&after_burst),
        "8 concurrent slow requests opened {} connections in all",
        after_burst
    );
    // The burst's connections went back to the pool: more requests open none.
    for _ in 0..8 {
        let client = h1_client();
        let answer = send(&client, req("GET", &proxy.url("/x"), "a.example.test", "")).await;
        assert_eq!(answer.status, StatusCode::OK);
    }
    assert_eq!(upstream.connections(), after_burst);
}

/// An upstream connection whose response body is still streaming to a slow client carries no
/// other request (HTTP/1.1 has one exchange at a time; a request queued behind the stalled
/// download would hang): the other client's requests get a connection of their own and reuse
/// it, and the download arrives whole once its client reads on.
#[tokio::test]
async fn a_connection_still_streaming_a_response_is_not_reused() {
    let upstream = Upstream::start().await;
    let proxy = one_worker_proxy(&upstream, "").await;

    const SIZE: usize = 8 * 1024 * 1024;
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut slow, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(connection);
    let request = Request::get(format!("/big/{SIZE}"))
        .header("host", "a.example.test")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let mut download = slow
        .send_request(request)
        .await
        .expect("response head")
        .into_body();
    let first = download
        .frame()
        .await
        .expect("a first frame")
        .expect("frame")
        .into_data()
        .expect("data");
    for (i, byte) in first.iter().enumerate() {
        assert_eq!(*byte, pattern_byte(i), "byte {i}");
    }

    // The download has stalled with most of its body unread; other requests go on.
    let client = h1_client();
    for _ in 0..5 {
        let answer = send(&client, req("GET", &proxy.url("/x"), "a.example.test", "")).await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.body, "upstream ok");
    }
    assert_eq!(
        upstream.connections(),
        2,
        "the download's connection was lent out, or the others were not reused"
    );

    let mut position = first.len();
    while let Some(frame) = download.frame().await {
        let data = frame.expect("frame").into_data().unwrap_or_default();
        for (offset, byte) in data.iter().enumerate() {
            assert_eq!(
                *byte,
                pattern_byte(position + offset),
                "byte {}",
                position + offset
            );
        }
        position += data.len();
    }
    assert_eq!(position, SIZE);
}

/// At most `max_idle_connections` idle upstream connections are kept (per worker and
/// origin): the rest of a burst's connections are closed within a few seconds of going idle,
/// and the kept ones are reused.
#[tokio::test]
async fn idle_upstream_connections_beyond_the_cap_are_closed() {
    let upstream = Upstream::start().await;
    let proxy = one_worker_proxy(&upstream, "max_idle_connections = 2\n").await;

    concurrent_slow_requests(&proxy, 8, "/slow/200").await;
    let opened = upstream.connections();
    assert!(
        opened >= 4,
        "8 concurrent slow requests shared {opened} connections"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.open_connections() > 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        upstream.open_connections(),
        2,
        "{opened} opened; only the 2 kept idle may stay open"
    );
    // The two kept are the ones used next.
    for _ in 0..4 {
        let client = h1_client();
        let answer = send(&client, req("GET", &proxy.url("/x"), "a.example.test", "")).await;
        assert_eq!(answer.status, StatusCode::OK);
    }
    assert_eq!(
        upstream.connections(),
        opened,
        "no new connection for reuse"
    );
}

/// An upstream that ends its connection after a response (`Connection: close`) gets a new
/// connection for the next request; none of them fails.
#[tokio::test]
async fn an_upstream_closing_its_connections_is_dialled_again() {
    let (upstream, proxy, client) = setup().await;
    for _ in 0..5 {
        let answer = send(
            &client,
            req("GET", &proxy.url("/close"), "a.example.test", ""),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.text(), "closing");
        assert!(
            answer.header("connection").is_none(),
            "hop-by-hop field leaked"
        );
    }
    assert_eq!(upstream.connections(), 5);
}

/// An idle pooled connection that the upstream closed quietly (a keep-alive timeout, no
/// `Connection: close`) is not used again: the next request goes out on a new connection.
#[tokio::test]
async fn an_idle_connection_closed_by_the_upstream_is_not_reused() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    // One answer per connection, with keep-alive, then the socket closes 50 ms later.
    let server = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match stream.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            });
        }
    });
    let config = config_from(&format!("{BASE}{ROUTES}"), addr, &[]);
    let proxy = Proxy::start(config).await;
    let client = h1_client();
    for round in 0..3 {
        let answer = send(&client, req("GET", &proxy.url("/x"), "a.example.test", "")).await;
        assert_eq!(answer.status, StatusCode::OK, "round {round}");
        assert_eq!(answer.text(), "ok");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
    server.abort();
}

/// contract §5: trailers pass through, the request's too. A client streams a body that ends in a
/// `x-checksum` trailer, over HTTP/1.1 (chunked, announced in `Trailer` as HTTP/1.1 senders
/// do) and over HTTP/2, to an HTTP/1.1 and to an HTTP/2 upstream: each upstream sees the
/// trailer. An HTTP/1.1 upstream only gets trailers that the request head announced, so the
/// announcement goes with the request there, and only there. (An HTTP/2 client that announces
/// nothing reaches an HTTP/2 upstream with its trailers, but not an HTTP/1.1 one: see
/// docs/configuration.md.)
#[tokio::test]
async fn request_trailers_reach_http1_and_http2_upstreams() {
    use std::convert::Infallible;

    use http_body_util::combinators::BoxBody;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    type TrailerClient = hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        BoxBody<Bytes, Infallible>,
    >;
    fn client(http2: bool) -> TrailerClient {
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(http2)
            .build(hyper_util::client::legacy::connect::HttpConnector::new())
    }
    fn with_trailer(url: String, announce: bool) -> Request<BoxBody<Bytes, Infallible>> {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-checksum", "c0ffee".parse().expect("static"));
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"streamed "))),
            Ok(Frame::data(Bytes::from_static(b"body"))),
            Ok(Frame::trailers(trailers)),
        ];
        let mut request = Request::post(url);
        if announce {
            request = request.header("trailer", "x-checksum");
        }
        request
            .body(BodyExt::boxed(StreamBody::new(futures_util::stream::iter(
                frames,
            ))))
            .expect("request")
    }

    let h1_upstream = Upstream::start().await;
    let h2_upstream = Upstream::start_with(true).await;
    let text = format!(
        "{BASE}[upstreams.h2]\nurl = \"http://{}\"\nhttp2 = true\n\n\
         [[routes]]\nname = \"to-h2\"\npath_prefix = \"/h2\"\nupstream = \"h2\"\n\n\
         [[routes]]\nname = \"to-h1\"\nupstream = \"app\"\n",
        h2_upstream.addr
    );
    let proxy = Proxy::start(config_from(&text, h1_upstream.addr, &[])).await;

    // (client HTTP/2, upstream HTTP/2, the client announces its trailer)
    let cases = [
        (false, false, true),
        (false, true, true),
        (true, false, true),
        (true, true, true),
        (true, true, false),
    ];
    for (client_h2, upstream_h2, announce) in cases {
        let case = format!(
            "client {}, upstream {}, announced {announce}",
            if client_h2 { "h2" } else { "h1" },
            if upstream_h2 { "h2" } else { "h1" }
        );
        let (path, upstream) = if upstream_h2 {
            ("/h2/upload", &h2_upstream)
        } else {
            ("/upload", &h1_upstream)
        };
        // An HTTP/1.1 client must announce its trailer; an HTTP/2 one need not, but may.
        let request = with_trailer(proxy.url(path), announce);
        let response = client(client_h2)
            .request(request)
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(response.status(), StatusCode::OK, "{case}");
        let seen = upstream.last();
        assert_eq!(&seen.body[..], b"streamed body", "{case}");
        let trailers = seen
            .trailers
            .unwrap_or_else(|| panic!("{case}: the upstream got no trailers"));
        assert_eq!(trailers.get("x-checksum").unwrap(), "c0ffee", "{case}");
        // The announcement is for the HTTP/1.1 hop's encoder; an HTTP/2 upstream gets none.
        assert_eq!(
            seen.headers.get("trailer").is_some(),
            !upstream_h2,
            "{case}: Trailer announcement"
        );
    }
}
