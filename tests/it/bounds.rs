//! Bounds on what a client controls (contract §9): header size (431), `max_connections`,
//! idle connections, HTTP/2 stream limits. Nothing a client sends grows a buffer without bound.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

fn server_with(extra: &str) -> String {
    format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n{extra}\n\n[upstreams.app]\nurl = \"http://@UPSTREAM@\"\n\n\
         [[routes]]\nname = \"all\"\nupstream = \"app\"\n"
    )
}

/// An HTTP/2 connection (prior knowledge) to `addr`, its driver running in a task whose handle
/// tells when the connection has ended.
async fn h2_client(
    addr: std::net::SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    (sender, tokio::spawn(connection))
}

#[tokio::test]
async fn oversized_headers_get_431_and_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&server_with(""), upstream.addr, &[])).await;
    let mut request = b"GET /big HTTP/1.1\r\nHost: t\r\nX-Big: ".to_vec();
    request.extend(std::iter::repeat_n(b'a', 80 * 1024));
    request.extend_from_slice(b"\r\n\r\n");
    let reply = raw_exchange(proxy.addr, &request, Duration::from_secs(5)).await;
    assert!(
        reply.starts_with("HTTP/1.1 431"),
        "{}",
        &reply[..reply.len().min(200)]
    );
    assert_eq!(upstream.count(), 0);

    // Many small headers adding up past the bound too.
    let mut request = b"GET /many HTTP/1.1\r\nHost: t\r\n".to_vec();
    for i in 0..4000 {
        request.extend_from_slice(format!("X-H{i}: {}\r\n", "v".repeat(20)).as_bytes());
    }
    request.extend_from_slice(b"\r\n");
    let reply = raw_exchange(proxy.addr, &request, Duration::from_secs(5)).await;
    assert!(
        reply.starts_with("HTTP/1.1 431") || reply.starts_with("HTTP/1.1 400"),
        "{}",
        &reply[..reply.len().min(200)]
    );
    assert_eq!(upstream.count(), 0);
}

#[tokio::test]
async fn beyond_max_connections_accept_waits() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("max_connections = 2"),
        upstream.addr,
        &[],
    ))
    .await;
    // Two connections hold both slots (each has sent a request and stays open).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        stream
            .write_all(b"GET /hold HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 512];
        let n = stream.read(&mut buf).await.expect("response");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(stream);
    }
    // A third is accepted by the kernel's backlog but not served while the slots are full.
    let third = tokio::spawn({
        let url = proxy.url("/third");
        async move {
            let started = Instant::now();
            let answer = get(&h1_client(), &url).await;
            (answer.status, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served past max_connections"
    );
    assert_eq!(upstream.count(), 2);
    // Freeing one slot lets it in.
    drop(held.pop());
    let (status, waited) = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("served once a slot freed")
        .expect("task");
    assert_eq!(status, StatusCode::OK);
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
}

#[tokio::test]
async fn idle_http2_connections_are_closed() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"600ms\""),
        upstream.addr,
        &[],
    ))
    .await;
    // An HTTP/2 connection (prior knowledge) that sends its preface and then nothing.
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .expect("preface");
    let started = Instant::now();
    let waited = closed_after(&mut stream, started, "idle connection never closed").await;
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(3),
        "closed after {waited:?}"
    );
}

#[tokio::test]
async fn many_h2_streams_on_one_connection_are_queued_not_failed() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&server_with(""), upstream.addr, &[])).await;
    let client = h2c_client();
    // 600 concurrent slow requests on one connection: the server's stream limit (100) makes
    // the client queue the rest; all complete, none fail.
    let mut tasks = Vec::new();
    for _ in 0..600 {
        let client = client.clone();
        let url = proxy.url("/slow/50");
        tasks.push(tokio::spawn(async move {
            let req = Request::get(url)
                .body(Full::new(Bytes::new()))
                .expect("request");
            client.request(req).await.map(|r| r.status())
        }));
    }
    let mut ok = 0;
    for task in tasks {
        if let Ok(Ok(StatusCode::OK)) = task.await {
            ok += 1;
        }
    }
    assert_eq!(ok, 600);
}

/// A client that stops sending its body, or stops reading its response, holds nothing for
/// longer than `idle_timeout`.
#[tokio::test]
async fn stalled_uploads_and_stalled_readers_are_cut_after_the_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"700ms\"\nheader_read_timeout = \"10s\""),
        upstream.addr,
        &[],
    ))
    .await;

    // Headers promise 1,000 bytes; 10 arrive, then nothing.
    let mut upload = TcpStream::connect(proxy.addr).await.expect("connect");
    upload
        .write_all(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n0123456789")
        .await
        .expect("partial body");
    let started = Instant::now();
    let waited = closed_after(&mut upload, started, "a stalled upload kept its connection").await;
    assert!(waited >= Duration::from_millis(600), "{waited:?}");

    // A 50 MB download that the client never reads: once the socket buffers are full nothing
    // moves, and the connection is closed.
    let mut reader = TcpStream::connect(proxy.addr).await.expect("connect");
    reader
        .write_all(b"GET /big/52428800 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("request");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Now read: the stream must end well before 50 MB (it was cut), and soon.
    let mut total = 0usize;
    let mut chunk = vec![0u8; 64 * 1024];
    let drained = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match reader.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await;
    assert!(
        drained.is_ok(),
        "a stalled reader's connection was never closed"
    );
    assert!(
        total < 52_428_800,
        "the whole response was delivered ({total} bytes)"
    );
}

/// An HTTP/2 client that keeps answering pings but sends no request is still closed after
/// the idle timeout: the pings move bytes, so idleness is judged by requests too.
#[tokio::test]
async fn an_idle_http2_client_that_answers_pings_is_closed() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"800ms\""),
        upstream.addr,
        &[],
    ))
    .await;
    let (mut sender, connection) = h2_client(proxy.addr).await;
    let request = Request::get(proxy.url("/once"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    drop(response);
    let started = Instant::now();
    // The server pings every 400 ms here and the client answers; the connection must end anyway.
    let ended = tokio::time::timeout(Duration::from_secs(5), connection).await;
    assert!(
        ended.is_ok(),
        "an idle HTTP/2 connection answering pings stayed open"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
}

/// A peer that stops answering (here: a relay that stalls) is dropped within about the idle
/// timeout even while its request is still in flight: by the unanswered keep-alive pings or
/// by the silence, whichever comes first (this test does not tell them apart).
#[tokio::test]
async fn a_dead_http2_peer_is_dropped_with_its_request_in_flight() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"2s\""),
        upstream.addr,
        &[],
    ))
    .await;
    let relay = crate::common::faulty::FaultyTcp::start(proxy.addr, true).await;
    let (mut sender, _connection) = h2_client(relay.addr).await;
    let request = Request::get(proxy.url("/slow/10000"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    tokio::spawn(async move {
        let _ = sender.send_request(request).await;
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.count() == 0 {
        assert!(
            Instant::now() < deadline,
            "request never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let open = || proxy.server().metrics().open_connections.get();
    assert_eq!(open(), 1);
    relay.stall();
    let stalled_at = Instant::now();
    while open() > 0 {
        assert!(
            stalled_at.elapsed() < Duration::from_secs(8),
            "a peer that answers no ping kept its connection"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Well before the slow response (10 s) could have ended the request.
    assert!(stalled_at.elapsed() < Duration::from_secs(8));
}

/// `header_read_timeout` on HTTP/1.1 counts the wait for a request's head: from the
/// connection's start, and again from the end of each response. A connection that never
/// sends a byte and a keep-alive connection that sends no next request are both closed after
/// it, well before `idle_timeout`; a request whose response takes longer than the timeout is
/// not cut by it (the head arrived; only `idle_timeout` governs the rest).
#[tokio::test]
async fn http1_waits_for_a_head_are_bounded_but_slow_responses_are_not() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"30s\"\nheader_read_timeout = \"400ms\""),
        upstream.addr,
        &[],
    ))
    .await;

    // Silent from the start.
    let mut silent = TcpStream::connect(proxy.addr).await.expect("connect");
    let started = Instant::now();
    let waited = closed_after(&mut silent, started, "a silent connection stayed open").await;
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "silent connection closed after {waited:?}"
    );

    // One request whose response takes 1.2 s (three times the timeout), then silence.
    let mut keep_alive = TcpStream::connect(proxy.addr).await.expect("connect");
    keep_alive
        .write_all(b"GET /slow/1200 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("request");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), keep_alive.read(&mut byte))
            .await
            .expect("the slow response arrived")
            .expect("read");
        assert_eq!(
            n,
            1,
            "closed before the response: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("content-length");
    let mut body = vec![0u8; length];
    keep_alive.read_exact(&mut body).await.expect("body");
    let answered = Instant::now();
    let waited = closed_after(&mut keep_alive, answered, "an idle keep-alive stayed open").await;
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "keep-alive closed {waited:?} after its response"
    );
    assert_eq!(upstream.count(), 1);
}

/// HTTP/2 has no head to wait for: an HTTP/2 connection quiet for longer than
/// `header_read_timeout` stays open and serves its next request.
#[tokio::test]
async fn header_read_timeout_does_not_close_http2_connections() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"30s\"\nheader_read_timeout = \"300ms\""),
        upstream.addr,
        &[],
    ))
    .await;
    let (mut sender, connection) = h2_client(proxy.addr).await;
    for round in 0..2 {
        // Quiet for three times the timeout before each request.
        tokio::time::sleep(Duration::from_millis(900)).await;
        let request = Request::get(proxy.url("/once"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let response = sender
            .send_request(request)
            .await
            .unwrap_or_else(|e| panic!("request {round} after a quiet spell: {e}"));
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert!(!connection.is_finished(), "the HTTP/2 connection ended");
    assert_eq!(upstream.count(), 2);
}

/// A client that goes away while its request waits for the upstream cancels that request: the
/// upstream connection is closed at once, not held until the response comes (nginx's default,
/// `proxy_ignore_client_abort off`, does the same). On plain TCP tollgate notices the close
/// with a peek while the request is in flight, in place of hyper's read, which is off there
/// (`half_close(true)`; docs/performance.md, row "Client close seen by a peek").
#[tokio::test]
async fn a_client_that_goes_away_mid_request_cancels_its_upstream_request() {
    client_gone_while_upstream_works(b"GET /slow/20000 HTTP/1.1\r\nHost: t\r\n\r\n").await;
}

/// The same once a request body has been sent whole: tollgate, not hyper, notices the close
/// then (`server::connection::ClientStream`), in both framings.
#[tokio::test]
async fn a_client_that_goes_away_after_its_body_cancels_its_upstream_request() {
    let sized = b"POST /slow/20000 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello";
    client_gone_while_upstream_works(sized).await;
    let chunked = b"POST /slow/20000 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n\
5\r\nhello\r\n0\r\n\r\n";
    client_gone_while_upstream_works(chunked).await;
}

/// A client that pipelines two requests and then half-closes (`shutdown(SHUT_WR)`, as
/// `nc -N` does) still gets the answer to the first: while hyper holds the second request
/// unread, the close behind it is not looked for (hyper's own check behaved so too). The
/// second request is then dropped as its client is gone, and the connection closes.
#[tokio::test]
async fn a_pipelining_client_that_half_closes_gets_its_first_answer() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&server_with(""), upstream.addr, &[])).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client
        .write_all(b"GET /slow/300 HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("requests");
    client.shutdown().await.expect("half-close");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer));
    read.await
        .expect("the connection was not closed")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 200 OK\r\n") && answer.contains("slow ok"),
        "no answer to the first request: {answer:?}"
    );
}

/// A client that half-closes and stops reading in the middle of a large response is noticed
/// while the response waits to be written (hyper does not flush then), not only at
/// `idle_timeout`: the upstream's streaming response is dropped within seconds.
#[tokio::test]
async fn a_client_that_half_closes_and_stops_reading_releases_a_streaming_response() {
    let (upstream, _proxy, mut client) =
        upstream_working_on(b"GET /big/1000000000 HTTP/1.1\r\nHost: t\r\n\r\n").await;
    // Never read from: within moments the socket buffers on both sides are full and
    // tollgate's writes wait (which nothing outside the kernel shows, hence the pause; on a
    // machine too slow to fill them by then, the close is seen between writes instead and
    // the test still holds). Then the half-close.
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.shutdown().await.expect("half-close");
    upstream_released(
        &upstream,
        "the upstream response was kept streaming to a client that had gone",
    )
    .await;
    drop(client);
}

/// Sends `request` (whose response the upstream delays by 20 s), waits until the upstream
/// holds it, drops the client, and expects the upstream connection closed within 5 s.
async fn client_gone_while_upstream_works(request: &[u8]) {
    let (upstream, _proxy, client) = upstream_working_on(request).await;
    drop(client);
    // The response would come after 20 s: well within that, the upstream connection is gone.
    upstream_released(
        &upstream,
        "the upstream request was kept after its client had gone",
    )
    .await;
}

/// A proxy in front of a fresh upstream, and a client that has sent `request`, once the
/// upstream holds it on its one connection.
async fn upstream_working_on(request: &[u8]) -> (Upstream, Proxy, TcpStream) {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&server_with(""), upstream.addr, &[])).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    client.write_all(request).await.expect("request");
    crate::common::wait::until(
        "the request never reached the upstream",
        Duration::from_secs(5),
        || upstream.count() == 1 && upstream.open_connections() == 1,
    )
    .await;
    (upstream, proxy, client)
}

/// Waits up to 5 s for the upstream's connections to close; `why` is the failure.
async fn upstream_released(upstream: &Upstream, why: &str) {
    crate::common::wait::until(why, Duration::from_secs(5), || {
        upstream.open_connections() == 0
    })
    .await;
}
