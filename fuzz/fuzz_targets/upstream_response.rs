//! Differential fuzzing of tollgate's own HTTP/1.1 client (src/http1/client.rs) against
//! hyper's.
//!
//! The input's first byte says whether the request was a GET or a HEAD; the rest is all an
//! upstream sends on the connection before it closes. hyper's client reads it over an
//! in-memory stream; tollgate's reads it with `forward::read_response`. tollgate's must agree,
//! or be stricter (fail where hyper reads a response), never more lenient: whenever it reads a
//! response, hyper reads the same status, fields, body and trailers.
//!
//! The same head is also read the two ways it can reach tollgate's own HTTP/1.1 server path,
//! as lines and through the map (`forward::lines_against_the_map`): the lines must carry what
//! the map, the forwarder and the server's encoder would have sent, or leave the head to the
//! map.
#![no_main]

use std::cell::RefCell;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

thread_local! {
    static RUNTIME: RefCell<tokio::runtime::Runtime> = RefCell::new(
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime"),
    );
}

type Read = (http::response::Parts, Vec<u8>, Option<http::HeaderMap>);

/// hyper's client reading `wire` as the answer to one request.
async fn hyper_reads(wire: Vec<u8>, head: bool) -> Option<Read> {
    let (client, mut server) = tokio::io::duplex(1 << 20);
    let upstream = tokio::spawn(async move {
        let mut request = [0u8; 1024];
        // The request first (a real upstream answers after it), then the answer and the close.
        let _ = server.read(&mut request).await;
        let _ = server.write_all(&wire).await;
        let _ = server.shutdown().await;
        let mut rest = Vec::new();
        let _ = server.read_to_end(&mut rest).await;
    });
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(client))
            .await
            .ok()?;
    tokio::spawn(connection);
    let method = if head { http::Method::HEAD } else { http::Method::GET };
    let request = http::Request::builder()
        .method(method)
        .uri("/")
        .header("host", "up")
        .body(Empty::new())
        .ok()?;
    let response = sender.send_request(request).await.ok()?;
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.ok()?;
    let trailers = collected.trailers().cloned();
    let data = collected.to_bytes().to_vec();
    upstream.abort();
    Some((parts, data, trailers))
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, wire)) = data.split_first() else {
        return;
    };
    let head = first & 1 == 1;
    if let Err(disagreement) = tollgate::testing::http1::client::lines_against_the_map(wire, head) {
        panic!("the lines and the map disagree: {disagreement}");
    }
    let Ok((response, body, trailers)) = tollgate::testing::http1::client::read_response(wire, head) else {
        // Failing is always allowed: the request is answered 502.
        return;
    };
    let hyper = RUNTIME.with(|rt| {
        rt.borrow().block_on(async {
            tokio::time::timeout(Duration::from_secs(5), hyper_reads(wire.to_vec(), head)).await
        })
    });
    let hyper = hyper.expect("hyper's client answered within 5 s");
    let Some((parts, hyper_body, hyper_trailers)) = hyper else {
        panic!("tollgate's client read a response where hyper's failed");
    };
    assert_eq!(response.status(), parts.status, "status");
    assert_eq!(response.version(), parts.version, "version");
    assert_eq!(response.headers(), &parts.headers, "fields");
    let reason = |ext: &http::Extensions| {
        ext.get::<hyper::ext::ReasonPhrase>()
            .map(|r| r.as_bytes().to_vec())
    };
    assert_eq!(reason(response.extensions()), reason(&parts.extensions), "reason");
    assert_eq!(body, hyper_body, "body");
    assert_eq!(trailers, hyper_trailers, "trailers");
});
