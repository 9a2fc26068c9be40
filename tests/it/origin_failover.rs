//! Origin failover (contract §5): with several `urls`, a connect that is refused or times out goes
//! on to the next origin (nothing was sent, so for any method), each origin once per request;
//! an origin that failed to connect is skipped by new requests for `fail_timeout` unless every
//! origin has failed; only when all fail is the answer 502. Counted in
//! `tollgate_upstream_connect_failures_total{upstream}`.
//!
//! (tests/it/failover.rs is about the database's failover, not the upstream's.)
//!
//! A refused origin is a port that was bound and released; it is "brought back" by binding
//! that port again, with a recording upstream on it, which is how the tests see whether
//! tollgate tries it. A connect that times out is one to a listener whose accept queue is full
//! (backlog 0, filled by the test): Linux drops further SYNs, so the connect hangs until
//! `connect_timeout`, all on 127.0.0.1.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::common::{config_from, get, h1_client, send, H1Client, Proxy, Upstream};

const COUNTER: &str = "tollgate_upstream_connect_failures_total{upstream=\"app\"}";

/// A configuration whose upstream `app` has these origins, in this order.
fn config(
    origins: &[SocketAddr],
    fail_timeout: &str,
    http2: bool,
) -> tollgate::testing::config::Config {
    let urls: Vec<String> = origins.iter().map(|a| format!("\"http://{a}\"")).collect();
    let text = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"

[upstreams.app]
urls = [{}]
connect_timeout = "300ms"
response_timeout = "5s"
fail_timeout = "{fail_timeout}"
http2 = {http2}

[[routes]]
name = "all"
upstream = "app"
"#,
        urls.join(", ")
    );
    // `@UPSTREAM@` is not used: the origins are in the text.
    config_from(&text, origins[0], &[])
}

/// An address on which nothing listens: connecting to it is refused.
fn refused_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

/// A recording upstream on `addr`, a port that refused connections until now.
async fn bring_up(addr: SocketAddr) -> Upstream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_reuseaddr(true).expect("reuseaddr");
    socket
        .bind(addr)
        .expect("bind the refused origin's port again");
    Upstream::start_on(socket.listen(1024).expect("listen")).await
}

/// A listener that never accepts, with its accept queue full: a connect to it neither
/// succeeds nor is refused, it times out. The connections that fill the queue are returned
/// with it and must be kept.
async fn blackhole() -> (TcpListener, Vec<TcpStream>, SocketAddr) {
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(0).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let mut filling = Vec::new();
    for _ in 0..64 {
        match tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => filling.push(stream),
            Ok(Err(e)) => panic!("connect to the backlog-0 listener failed: {e}"),
            // Full: this SYN was dropped, as tollgate's will be.
            Err(_) => return (listener, filling, addr),
        }
    }
    panic!(
        "a listener with backlog 0 kept accepting 64 connections: cannot make a connect time out"
    );
}

fn counter(proxy: &Proxy) -> u64 {
    let text = proxy.server().metrics().render();
    let Some(line) = text.lines().find(|l| l.starts_with(COUNTER)) else {
        return 0;
    };
    line[COUNTER.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("unreadable counter line {line:?}"))
}

async fn post(client: &H1Client, proxy: &Proxy, body: &'static [u8]) -> crate::common::Answer {
    let req = Request::post(proxy.url("/echo"))
        .body(Full::new(Bytes::from_static(body)))
        .expect("request");
    send(client, req).await
}

#[tokio::test]
async fn refused_origin_is_skipped_for_fail_timeout_then_tried_again() {
    let a = refused_port();
    let b = Upstream::start().await;
    let proxy = Proxy::start(config(&[a, b.addr], "3s", false)).await;
    let client = h1_client();
    let t0 = Instant::now();

    // The first request's turn is origin a: refused, so it goes to b.
    let first = post(&client, &proxy, b"first body").await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.text(), "first body");
    assert_eq!(b.count(), 1);
    assert_eq!(b.last().body, Bytes::from_static(b"first body"));
    assert_eq!(counter(&proxy), 1, "one refused connect counted");
    let text = proxy.server().metrics().render();
    assert!(
        !text.contains(&a.port().to_string()),
        "no origin address in the metrics:\n{text}"
    );

    // a is back, but within fail_timeout no request tries it, whichever origin's turn it is.
    let a_up = bring_up(a).await;
    for i in 0..6 {
        let answer = if i % 2 == 0 {
            get(&client, &proxy.url("/get")).await
        } else {
            post(&client, &proxy, b"a posted body").await
        };
        assert_eq!(answer.status, StatusCode::OK);
    }
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "the machine took {:?}, longer than fail_timeout: the test cannot tell",
        t0.elapsed()
    );
    assert_eq!(a_up.connections(), 0, "a was tried within fail_timeout");
    assert_eq!(b.count(), 7);
    let posts = b
        .requests()
        .iter()
        .filter(|r| r.method == http::Method::POST && r.body == "a posted body")
        .count();
    assert_eq!(posts, 3, "every POST reached b with its body");
    assert_eq!(counter(&proxy), 1);

    // Once fail_timeout has passed, a gets its turns again.
    let deadline = Instant::now() + Duration::from_secs(15);
    while a_up.count() == 0 {
        assert!(Instant::now() < deadline, "a never tried again");
        let answer = get(&client, &proxy.url("/again")).await;
        assert_eq!(answer.status, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        t0.elapsed() >= Duration::from_secs(3),
        "a was tried again after {:?}, before fail_timeout",
        t0.elapsed()
    );
    assert_eq!(counter(&proxy), 1);
}

#[tokio::test]
async fn timed_out_connect_goes_to_the_next_origin() {
    let (_listener, _filling, a) = blackhole().await;
    let b = Upstream::start().await;
    let proxy = Proxy::start(config(&[a, b.addr], "30s", false)).await;
    let client = h1_client();

    let started = Instant::now();
    let first = post(&client, &proxy, b"after a timeout").await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert_eq!(first.text(), "after a timeout");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "a's connect did not wait for connect_timeout: was it really blackholed?"
    );
    assert_eq!(counter(&proxy), 1, "one timed-out connect counted");

    for _ in 0..4 {
        let answer = post(&client, &proxy, b"again").await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.text(), "again");
    }
    assert_eq!(b.count(), 5);
    assert_eq!(counter(&proxy), 1, "a was tried again within fail_timeout");
}

#[tokio::test]
async fn all_origins_down_is_502_after_each_is_tried_once() {
    let a = refused_port();
    let b = refused_port();
    let (_listener, _filling, c) = blackhole().await;
    let proxy = Proxy::start(config(&[a, b, c], "30s", false)).await;
    let client = h1_client();

    let answer = post(&client, &proxy, b"nowhere to go").await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert_eq!(counter(&proxy), 3, "each origin tried once");

    // All are resting: they are all tried anyway, once each.
    let answer = get(&client, &proxy.url("/")).await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert_eq!(counter(&proxy), 6);

    // One comes back while all rest: found, because with all down all are tried.
    let b_up = bring_up(b).await;
    let answer = post(&client, &proxy, b"found b").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "found b");
    let after = counter(&proxy);
    assert!((6..=8).contains(&after), "{after}");
    // b connected again: new requests go to it without trying the others.
    for _ in 0..3 {
        let answer = get(&client, &proxy.url("/")).await;
        assert_eq!(answer.status, StatusCode::OK);
    }
    assert_eq!(
        counter(&proxy),
        after,
        "resting origins were tried while b works"
    );
    assert_eq!(b_up.count(), 4);
}

#[tokio::test]
async fn failure_after_the_request_was_sent_is_not_retried() {
    // a accepts, reads the start of the request, and closes: something was sent.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = listener.local_addr().expect("addr");
    let dropper = tokio::spawn(async move {
        let mut seen = 0;
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = [0u8; 64];
            let _ = stream.read(&mut buf).await;
            seen += 1;
            drop(stream);
            if seen == 1 {
                return seen;
            }
        }
        seen
    });
    let b = Upstream::start().await;
    let proxy = Proxy::start(config(&[a, b.addr], "30s", false)).await;
    let client = h1_client();

    let answer = post(&client, &proxy, b"sent once").await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert_eq!(dropper.await.expect("dropper"), 1);
    assert_eq!(
        b.count(),
        0,
        "a request that reached an origin went to another"
    );
    assert_eq!(counter(&proxy), 0, "not a connect failure");
}

#[tokio::test]
async fn http2_upstream_fails_over_too() {
    let a = refused_port();
    let b = Upstream::start_with(true).await;
    let proxy = Proxy::start(config(&[a, b.addr], "30s", true)).await;
    let client = h1_client();

    for _ in 0..3 {
        let answer = post(&client, &proxy, b"h2 body").await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        assert_eq!(answer.text(), "h2 body");
    }
    assert_eq!(b.count(), 3);
    assert_eq!(b.last().version, http::Version::HTTP_2);
    assert_eq!(counter(&proxy), 1);
}
