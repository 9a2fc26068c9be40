//! Bypasses an independent attack found in the issue 14 fixes themselves (contract §3, §4a, 9): a
//! keyed header's value that the limiter and the upstream read differently, the underscore
//! twin back behind `underscores_in_headers = true`, `HEAD` past a `GET` route, and a
//! chunk-size line with leading whitespace. Each test is the attack's reproduction.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::Full;

use crate::common::*;

const KEYED: &str = r#"
[[routes]]
name = "keyed"
path_prefix = "/keyed"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 2
  window = "1h"
"#;

/// Attack F1: over HTTP/2 (whose field values h2 passes with their padding) `x-api-key: k`,
/// `"k "`, `"k\t"`, `" k"` were four subjects, four buckets, while every HTTP/1.1 parser
/// upstream strips the padding and reads `k`: a limit of 2 allowed 6 of 6. RFC 9113 8.2.1
/// calls such a field malformed; a keyed one now gets 400 and is never counted or forwarded.
#[tokio::test]
async fn padded_keyed_header_values_over_http2_get_400_not_a_fresh_bucket() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", KEYED),
        upstream.addr,
        &[],
    ))
    .await;
    let client = h2c_client();
    let request = |value: &'static str| {
        Request::get(proxy.url("/keyed/y"))
            .header("x-api-key", HeaderValue::from_static(value))
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    for padded in ["k ", "k\t", " k", "\tk", "k  "] {
        let answer = send(&client, request(padded)).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{padded:?}");
    }
    assert_eq!(upstream.count(), 0, "a padded keyed value was forwarded");
    // The plain value is one bucket, counted as before.
    assert_eq!(send(&client, request("k")).await.status, StatusCode::OK);
    assert_eq!(send(&client, request("k")).await.status, StatusCode::OK);
    assert_eq!(
        send(&client, request("k")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Attack F8: obs-text in a keyed value (`k1\xa0`) was keyed raw while an application that
/// decodes Latin-1 and strips it reads `k1`. A keyed value is visible ASCII with inner spaces.
#[tokio::test]
async fn keyed_header_values_outside_visible_ascii_get_400() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", KEYED),
        upstream.addr,
        &[],
    ))
    .await;
    let mut request = b"GET /keyed HTTP/1.1\r\nHost: a.example\r\nX-Api-Key: k1".to_vec();
    request.extend_from_slice(b"\xa0\r\nConnection: close\r\n\r\n");
    let answer = raw_exchange(proxy.addr, &request, Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
    // Inner spaces are part of a value (`Bearer token`), and pass.
    let plain =
        "GET /keyed HTTP/1.1\r\nHost: a.example\r\nX-Api-Key: key one\r\nConnection: close\r\n\r\n";
    let answer = raw_exchange(proxy.addr, plain.as_bytes(), Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer:?}");
    assert_eq!(upstream.count(), 1);
}

/// Attack F4: with `underscores_in_headers = true`, `X_Api_Key` was neither counted by a
/// `header:x-api-key` limit nor refused, and was forwarded, where CGI/WSGI backends read it
/// as `X-Api-Key`: item 5's twin again, behind the switch. With the switch on, a request that
/// carries a keyed header's underscore twin gets 400.
#[tokio::test]
async fn with_underscores_forwarded_a_keyed_headers_twin_gets_400() {
    let upstream = Upstream::start().await;
    let text = limits_config("", "underscores_in_headers = true", KEYED);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    for n in 0..4 {
        let request = format!(
            "GET /keyed HTTP/1.1\r\nHost: a.example\r\nX_Api_Key: rotating-{n}\r\nConnection: close\r\n\r\n"
        );
        let answer = raw_exchange(proxy.addr, request.as_bytes(), Duration::from_secs(3)).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
    }
    assert_eq!(upstream.count(), 0, "a keyed header's twin was forwarded");
    // Other underscored names still pass, as the option promises.
    let other = "GET /keyed HTTP/1.1\r\nHost: a.example\r\nX-Api-Key: k\r\nX_Legacy: 1\r\nConnection: close\r\n\r\n";
    let answer = raw_exchange(proxy.addr, other.as_bytes(), Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer:?}");
    assert_eq!(upstream.last().headers.get("x_legacy").unwrap(), "1");
}

/// Attack F6: `methods = ["GET"]` did not cover HEAD, so `HEAD /verify` went to the
/// catch-all, unlimited, while Express, Flask, Django, Rails, Spring and Go run the GET
/// handler for HEAD (nginx's `limit_except GET` includes HEAD for this reason). A route that
/// lists GET now matches HEAD too.
#[tokio::test]
async fn head_counts_against_a_get_route() {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "verify"
path_prefix = "/verify"
methods = ["GET"]
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
"#;
    let proxy = Proxy::start(config_from(
        &limits_config("", "", routes),
        upstream.addr,
        &[],
    ))
    .await;
    let client = h1_client();
    let request = |method: &str| {
        Request::builder()
            .method(method)
            .uri(proxy.url("/verify?code=1"))
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    assert_eq!(send(&client, request("GET")).await.status, StatusCode::OK);
    assert_eq!(send(&client, request("HEAD")).await.status, StatusCode::OK);
    for method in ["HEAD", "GET", "HEAD"] {
        let answer = send(&client, request(method)).await;
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS, "{method}");
    }
    assert_eq!(upstream.count(), 2);
    // Other methods are still not this route's: POST goes to the catch-all.
    assert_eq!(send(&client, request("POST")).await.status, StatusCode::OK);
}

/// Attack F8: the framing guard accepted a chunk-size line with leading whitespace, which
/// hyper refuses (RFC 9112 7.1 has none before the size): they disagreed about the body. The
/// guard now refuses it itself, and nothing behind it is forwarded.
#[tokio::test]
async fn a_chunk_size_with_leading_whitespace_is_refused_by_the_guard() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream.addr, &[])).await;
    for size_line in [" 3", "\t3"] {
        let request = format!(
            "POST /echo HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n{size_line}\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a.example\r\n\r\n"
        );
        let answer = raw_exchange(proxy.addr, request.as_bytes(), Duration::from_secs(3)).await;
        assert!(
            answer.starts_with("HTTP/1.1 400 "),
            "{size_line:?}: {answer:?}"
        );
    }
    assert_eq!(
        upstream.count(),
        0,
        "a request with a padded chunk size was forwarded"
    );
    // Whitespace after the size, before an extension, is the grammar's BWS and passes.
    let request = "POST /echo HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3 ;x=1\r\nabc\r\n0\r\n\r\n";
    let answer = raw_exchange(proxy.addr, request.as_bytes(), Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer:?}");
}

/// Found with the upgrade fix: an origin-form `CONNECT /x` was forwarded to the upstream
/// (only its 2xx answer was refused, with 502). A reverse proxy opens no tunnels: CONNECT gets
/// 405 like TRACE and never reaches the upstream.
#[tokio::test]
async fn connect_gets_405_and_is_not_forwarded() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&limits_config("", "", ""), upstream.addr, &[])).await;
    let request = "CONNECT /open/x HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n";
    let answer = raw_exchange(proxy.addr, request.as_bytes(), Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 405 "), "{answer:?}");
    assert_eq!(upstream.count(), 0, "CONNECT was forwarded");
}
