//! A request target longer than 8 KiB gets 414 (contract §5), however long it is: below the head
//! limit (where hyper would have forwarded it), and above it (where the framing guard said 431
//! and hyper, past 64 KiB, would say 414 itself). Sent as raw bytes, so nothing in a client
//! library shortens or refuses the target first.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use crate::common::*;

const ROUTES: &str = r#"
[[routes]]
name = "all"
upstream = "app"
"#;

/// `GET <target> HTTP/1.1` where the target is `/` and `len - 1` more characters.
fn request_with_target(len: usize) -> Vec<u8> {
    let mut target = String::from("/");
    target.push_str(&"a".repeat(len - 1));
    format!("GET {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").into_bytes()
}

fn status_line(answer: &str) -> &str {
    answer.lines().next().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_over_8_kib_get_414_at_every_length() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&format!("{BASE}{ROUTES}"), upstream.addr, &[])).await;
    let within = Duration::from_secs(3);

    let at_limit = raw_exchange(proxy.addr, &request_with_target(8 * 1024), within).await;
    assert!(
        status_line(&at_limit).starts_with("HTTP/1.1 200"),
        "{}",
        status_line(&at_limit)
    );
    assert_eq!(upstream.count(), 1);

    for len in [
        8 * 1024 + 1,
        16 * 1024,
        32 * 1024,
        60 * 1024,
        64 * 1024 - 40,
        64 * 1024,
        65_535,
        70 * 1024,
        200 * 1024,
    ] {
        let answer = raw_exchange(proxy.addr, &request_with_target(len), within).await;
        assert!(
            status_line(&answer).starts_with("HTTP/1.1 414"),
            "target of {len} bytes: {}",
            status_line(&answer)
        );
    }
    assert_eq!(upstream.count(), 1, "a long target was forwarded");
}

/// HTTP/2 carries the target in `:path`, past the HTTP/1 framing guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_paths_over_8_kib_get_414() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(config_from(&format!("{BASE}{ROUTES}"), upstream.addr, &[])).await;
    let client = h2c_client();
    let ok = get(
        &client,
        &proxy.url(&format!("/{}", "b".repeat(8 * 1024 - 1))),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK);
    let req = Request::get(proxy.url(&format!("/{}", "b".repeat(9 * 1024))))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let long = send(&client, req).await;
    assert_eq!(long.status, StatusCode::URI_TOO_LONG);
    assert_eq!(upstream.count(), 1);
}
