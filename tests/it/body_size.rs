//! `max_body_size` (contract §2 and §5): a request whose `Content-Length` exceeds the server's limit
//! (or its route's override) gets 413 before anything is forwarded or counted.
//!
//! Reproduces issue 17: "There is no request-body limit (nginx `client_max_body_size`)."

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use crate::common::*;

const CONFIG: &str = r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"
max_body_size = "1KiB"

[upstreams.app]
url = "http://@UPSTREAM@"
connect_timeout = "1s"
response_timeout = "2s"

[[routes]]
name = "uploads"
path_prefix = "/uploads"
upstream = "app"
max_body_size = "2MiB"

[[routes]]
name = "counted"
path_prefix = "/counted"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = 1
  window = "1h"

[[routes]]
name = "rest"
upstream = "app"
"#;

async fn setup() -> (Upstream, Proxy, H1Client) {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(CONFIG, upstream.addr, &[])).await;
    (upstream, proxy, h1_client())
}

/// Sends only the head of a POST announcing `len` bytes and returns the answer's status line.
/// The body is never written: an answer before it is the point, and a client still writing
/// a large body when tollgate closes would see a broken pipe instead of the 413.
async fn announce(proxy: &Proxy, path: &str, len: usize) -> String {
    let head = format!("POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len}\r\n\r\n");
    let answer = raw_exchange(proxy.addr, head.as_bytes(), Duration::from_secs(3)).await;
    answer.lines().next().unwrap_or("").to_string()
}

async fn post(client: &H1Client, url: &str, len: usize) -> Answer {
    let req = Request::post(url)
        .body(Full::new(Bytes::from(vec![b'x'; len])))
        .expect("request");
    send(client, req).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_over_the_server_limit_gets_413_unforwarded() {
    let (upstream, proxy, client) = setup().await;
    let at_limit = post(&client, &proxy.url("/rest/x"), 1024).await;
    assert_eq!(at_limit.status, StatusCode::OK);
    assert_eq!(upstream.last().body.len(), 1024);
    let over = announce(&proxy, "/rest/x", 1025).await;
    assert!(over.starts_with("HTTP/1.1 413"), "{over}");
    assert_eq!(upstream.count(), 1, "the oversized body was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_override_raises_the_limit() {
    let (upstream, proxy, client) = setup().await;
    let big = post(&client, &proxy.url("/uploads/a"), 1024 * 1024).await;
    assert_eq!(big.status, StatusCode::OK);
    assert_eq!(upstream.last().body.len(), 1024 * 1024);
    let too_big = announce(&proxy, "/uploads/a", 2 * 1024 * 1024 + 1).await;
    assert!(too_big.starts_with("HTTP/1.1 413"), "{too_big}");
    assert_eq!(upstream.count(), 1);
}

/// Nothing is counted: a refused upload leaves the limit of 1 untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_is_not_counted() {
    let (upstream, proxy, client) = setup().await;
    for _ in 0..3 {
        let over = announce(&proxy, "/counted", 4096).await;
        assert!(over.starts_with("HTTP/1.1 413"), "{over}");
    }
    let first = post(&client, &proxy.url("/counted"), 10).await;
    assert_eq!(
        first.status,
        StatusCode::OK,
        "an oversized request was counted"
    );
    let second = post(&client, &proxy.url("/counted"), 10).await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.count(), 1);
}

/// On HTTP/1.1 the unread body must not be taken for the next request: the connection closes
/// after the 413, and nothing of the upload reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_oversized_upload_gets_413_and_the_connection_closes() {
    let (upstream, proxy, _client) = setup().await;
    let mut request = b"POST /rest/x HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n".to_vec();
    request.extend_from_slice(b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n");
    let answer = raw_exchange(proxy.addr, &request, Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert_eq!(answer.matches("HTTP/1.1").count(), 1, "{answer}");
    assert_eq!(upstream.count(), 0);
}

/// A chunked body (no `Content-Length`) that grows past the limit is cut: the upstream
/// request is aborted and the client gets 413, since no response had started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_body_growing_past_the_limit_is_cut_with_413() {
    let (upstream, proxy, _client) = setup().await;
    let mut request =
        b"POST /rest/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..8 {
        request.extend_from_slice(b"200\r\n");
        request.extend_from_slice(&[b'y'; 0x200]);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    let answer = raw_exchange(proxy.addr, &request, Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // The upstream may have seen the start of the request, never a whole 4 KiB body.
    assert!(
        upstream.requests().iter().all(|r| r.body.len() <= 1024),
        "a body past the limit reached the upstream"
    );

    // Within the limit, a chunked body goes through whole.
    let mut small = b"POST /rest/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    small.extend_from_slice(b"400\r\n");
    small.extend_from_slice(&[b'z'; 0x400]);
    small.extend_from_slice(b"\r\n0\r\n\r\n");
    let answer = raw_exchange(proxy.addr, &small, Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(upstream.last().body.len(), 1024);
}

/// HTTP/2 without `content-length`: the same cut, on the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_stream_growing_past_the_limit_is_cut_with_413() {
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    let (upstream, proxy, _client) = setup().await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<StreamBody<
            futures_util::stream::Iter<
                std::vec::IntoIter<Result<Frame<Bytes>, std::convert::Infallible>>,
            >,
        >>();
    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = (0..8)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'w'; 512]))))
        .collect();
    let req = Request::post(proxy.url("/rest/x"))
        .body(StreamBody::new(futures_util::stream::iter(frames)))
        .expect("request");
    let response = client.request(req).await.expect("answer");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(upstream.requests().iter().all(|r| r.body.len() <= 1024));
}
