//! HTTP/2 streams that never drain (issue 14, item 2; contract §5 and §9).
//!
//! The review's reproduction: a client that opens streams with its flow-control window at 0
//! and keeps answering pings held every upstream connection for as long as it liked (400
//! streams held for 40 s with `idle_timeout = 5s`), and under a 256 file-descriptor limit one
//! connection with 250 such streams stopped service to every other client for 30 s.
//!
//! The client here is the `h2` crate's, so that the tests choose the flow-control window
//! (`SETTINGS_INITIAL_WINDOW_SIZE`) and when to release capacity; its connection task answers
//! the proxy's keep-alive pings on its own for as long as it runs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::common::*;

/// `/big/` bodies far larger than any window or buffer on the way: a stalled stream cannot
/// finish by accident.
const BIG: &str = "/big/100000";

fn server_with(extra: &str) -> String {
    format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nshutdown_timeout = \"1s\"\n{extra}\n\n\
         [upstreams.app]\nurl = \"http://@UPSTREAM@\"\n\n\
         [[routes]]\nname = \"all\"\nupstream = \"app\"\n"
    )
}

/// An HTTP/2 connection (prior knowledge) whose streams start with `window` bytes of
/// flow-control window. Its driver task answers pings until the connection ends.
struct H2Client {
    send: h2::client::SendRequest<Bytes>,
    driver: JoinHandle<Result<(), h2::Error>>,
    addr: SocketAddr,
}

async fn h2_connect(addr: SocketAddr, window: u32) -> H2Client {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (send, mut connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("h2 handshake");
    let mut ping_pong = connection.ping_pong().expect("ping handle");
    let driver = tokio::spawn(connection);
    // One round trip first: the proxy's SETTINGS (its stream limit above all) come before
    // its answer, so the client knows the limit before it opens streams.
    ping_pong
        .ping(h2::Ping::opaque())
        .await
        .expect("the proxy answers a ping");
    H2Client { send, driver, addr }
}

impl H2Client {
    /// Opens a GET stream; beyond the server's stream limit, h2 queues it until a stream
    /// closes.
    async fn open(&self, path: &str) -> h2::client::ResponseFuture {
        let mut send = self.send.clone().ready().await.expect("connection ready");
        let request = Request::get(format!("http://{}{path}", self.addr))
            .body(())
            .expect("request");
        let (response, _) = send.send_request(request, true).expect("stream opened");
        response
    }
}

/// How a stream that never opens its window ended, and when.
struct Held {
    /// From the request being sent (the earliest the proxy can start holding the response).
    since_request: Duration,
    /// From the response head arriving (a little after the proxy began holding the response).
    since_head: Duration,
    outcome: Result<usize, h2::Error>,
}

/// Waits for a stream that never opens its window to end.
async fn held(response: h2::client::ResponseFuture) -> Held {
    let requested_at = Instant::now();
    let ended = |head_at: Instant, outcome| Held {
        since_request: requested_at.elapsed(),
        since_head: head_at.elapsed(),
        outcome,
    };
    let response = match response.await {
        Ok(response) => response,
        Err(err) => return ended(Instant::now(), Err(err)),
    };
    let head_at = Instant::now();
    let mut body = response.into_body();
    let mut received = 0;
    while let Some(chunk) = body.data().await {
        match chunk {
            Ok(chunk) => received += chunk.len(),
            Err(err) => return ended(head_at, Err(err)),
        }
    }
    ended(head_at, Ok(received))
}

async fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} (waited {within:?})");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The highest value `sample` has had since the call, sampled every 5 ms until `stop`.
fn watch_peak(sample: impl Fn() -> usize + Send + 'static) -> (Arc<AtomicUsize>, Arc<AtomicBool>) {
    let peak = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (p, s) = (peak.clone(), stop.clone());
    tokio::spawn(async move {
        while !s.load(Ordering::SeqCst) {
            p.fetch_max(sample(), Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    (peak, stop)
}

/// The review's 400 (here 150) zero-window streams, scaled to `idle_timeout = 1s`: at most
/// 100 are in flight at once (the upstream sees at most 100 requests and connections), each
/// is reset about `idle_timeout` after its response stopped moving, the upstream
/// connections they held are closed, and other clients are served as usual afterwards.
// Two threads: the client's connection task answers pings while 150 streams are busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_window_streams_are_capped_at_100_reset_after_the_idle_timeout_and_free_their_upstream_connections(
) {
    let upstream = Arc::new(Upstream::start().await);
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"1s\""),
        upstream.addr,
        &[],
    ))
    .await;
    let (peak_open, stop_sampling) = watch_peak({
        let upstream = upstream.clone();
        move || upstream.open_connections()
    });

    let client = h2_connect(proxy.addr, 0).await;
    let first_request = Instant::now();
    let mut streams = Vec::new();
    for _ in 0..150 {
        let response = client.open(BIG).await;
        streams.push(tokio::spawn(held(response)));
    }

    // No stream can be reset within idle_timeout of the first request (the watch's timer
    // starts after the response head), so until then every request the upstream has seen is
    // still in flight, each holding its own upstream connection (its response never ends).
    tokio::time::sleep_until((first_request + Duration::from_millis(900)).into()).await;
    let in_flight = upstream.count();
    let peak = peak_open.load(Ordering::SeqCst);
    assert!(
        in_flight <= 100 && peak <= 100,
        "one connection had {in_flight} streams in flight at once ({peak} upstream \
         connections open)"
    );

    // Every stream is reset about 1 s after its response head (from then on it held data the
    // client did not take): the first 100 at once, the 50 that waited for a free stream
    // after they got one and stalled in turn.
    for stream in streams {
        let joined = tokio::time::timeout(Duration::from_secs(6), stream).await;
        let held = joined
            .expect("a zero-window stream was never reset (it holds its upstream request)")
            .expect("stream task");
        match &held.outcome {
            Err(err) => assert!(err.is_reset(), "stream ended with {err}, not a reset"),
            Ok(bytes) => panic!("a zero-window stream received {bytes} bytes"),
        }
        // Not before idle_timeout: the proxy began holding the response after the request
        // was sent. Soon after it: the client saw the head a little after it was sent.
        assert!(
            held.since_request >= Duration::from_millis(990),
            "a stalled stream was reset {:?} after its request (idle_timeout = 1s)",
            held.since_request
        );
        assert!(
            held.since_head < Duration::from_millis(2500),
            "a stalled stream was reset {:?} after its response head (idle_timeout = 1s)",
            held.since_head
        );
    }
    assert_eq!(upstream.count(), 150);

    // The upstream connections the stalled requests held are closed, not kept.
    wait_until(
        "the reset streams' upstream connections stayed open",
        Duration::from_secs(3),
        || upstream.open_connections() == 0,
    )
    .await;
    stop_sampling.store(true, Ordering::SeqCst);

    // Everyone else is served as usual.
    let answer = tokio::time::timeout(
        Duration::from_secs(2),
        get(&h1_client(), &proxy.url("/after")),
    )
    .await
    .expect("another HTTP/1.1 client was served");
    assert_eq!(answer.status, StatusCode::OK);
    let answer = tokio::time::timeout(
        Duration::from_secs(2),
        get(&h2c_client(), &proxy.url("/after-h2")),
    )
    .await
    .expect("another HTTP/2 client was served");
    assert_eq!(answer.status, StatusCode::OK);
}

/// A stream that reads its response slowly but steadily (8 KiB every 200 ms, far slower
/// than the proxy could send, for more than twice `idle_timeout`) is not a stalled one: it
/// is read to its end. A zero-window stream opened at the same time is reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_steady_http2_reader_is_not_reset_but_a_stalled_one_is() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"1s\""),
        upstream.addr,
        &[],
    ))
    .await;
    const LENGTH: usize = 96 * 1024;
    let steady = h2_connect(proxy.addr, 8 * 1024).await;
    let stalled = h2_connect(proxy.addr, 0).await;
    let started = Instant::now();
    let stalled_stream = tokio::spawn(held(stalled.open(BIG).await));
    let response = steady
        .open(&format!("/big/{LENGTH}"))
        .await
        .await
        .expect("response head");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut read = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap_or_else(|e| {
            panic!(
                "the steady reader's stream ended after {} bytes and {:?}: {e}",
                read.len(),
                started.elapsed()
            )
        });
        read.extend_from_slice(&chunk);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    assert_eq!(read.len(), LENGTH);
    assert!(read.iter().enumerate().all(|(i, b)| *b == pattern_byte(i)));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the slow read took only {:?}; it must outlast idle_timeout twice",
        started.elapsed()
    );

    let outcome = tokio::time::timeout(Duration::from_secs(3), stalled_stream)
        .await
        .expect("the zero-window stream was never reset")
        .expect("stream task")
        .outcome;
    assert!(
        matches!(&outcome, Err(err) if err.is_reset()),
        "zero-window stream: {outcome:?}"
    );
}

/// Once its stalled streams are reset, a connection has no request in progress, and the
/// proxy's pings, which the client keeps answering, do not make it active: it is closed
/// about `idle_timeout` later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_streams_were_reset_is_closed_although_it_answers_pings() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &server_with("idle_timeout = \"1s\""),
        upstream.addr,
        &[],
    ))
    .await;
    let client = h2_connect(proxy.addr, 0).await;
    let mut streams = Vec::new();
    for _ in 0..3 {
        streams.push(tokio::spawn(held(client.open(BIG).await)));
    }
    for stream in streams {
        let outcome = tokio::time::timeout(Duration::from_secs(3), stream)
            .await
            .expect("a zero-window stream was never reset")
            .expect("stream task")
            .outcome;
        assert!(
            matches!(&outcome, Err(err) if err.is_reset()),
            "zero-window stream: {outcome:?}"
        );
    }
    let reset_at = Instant::now();
    // The proxy pings every 500 ms here; the driver answers each one.
    let H2Client { send, driver, .. } = client;
    let ended = tokio::time::timeout(Duration::from_secs(3), driver).await;
    assert!(
        ended.is_ok(),
        "a connection whose streams were all reset stayed open while it answered pings"
    );
    assert!(
        reset_at.elapsed() >= Duration::from_millis(500),
        "closed {:?} after its streams were reset, before idle_timeout",
        reset_at.elapsed()
    );
    drop(send);
    wait_until(
        "the proxy still counts the connection as open",
        Duration::from_secs(2),
        || proxy.server().metrics().open_connections.get() == 0,
    )
    .await;
}
