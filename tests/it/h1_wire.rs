//! HTTP/1.1 on the wire for simple requests (no body: no `Content-Length` nor
//! `Transfer-Encoding`, no `Upgrade`, no `Expect`), byte for byte as tollgate answers them
//! today.
//!
//! These tests pin the behaviour of hyper's HTTP/1.1 server as tollgate drives it, so that a
//! server path of tollgate's own for such requests can be checked against it: status lines,
//! header names and order, framing (`content-length`, chunked, close-delimited, none for HEAD,
//! 204 and 304), keep-alive and pipelining, `Connection: close`, HTTP/1.0 clients, tollgate's
//! own answers (404, 429) and the graceful stop.
//!
//! Clients are raw TCP sockets that write exact bytes and parse exactly what comes back.
//! Upstreams are either the recording `crate::common::Upstream` or the raw-TCP one of `crate::common::wire`
//! ([`RawUpstream`]) that writes fixed bytes, for response shapes a hyper server would not
//! produce on request (trailers, close-delimited bodies, 204 and 304, paced bodies).
//! Every read is bounded by a timeout: a hang fails the test.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::wire::*;
use crate::common::*;

/// A plain HTTP/1.1 GET for `path` on `wire.test`.
fn get_req(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: wire.test\r\n\r\n")
}

/// tollgate (with [`ROUTES`]) in front of `upstream`, and a client connected to it.
async fn client_of(upstream: SocketAddr) -> (Proxy, Wire) {
    let proxy = proxy_for(upstream).await;
    let wire = Wire::connect(proxy.addr).await;
    (proxy, wire)
}

// ---------------------------------------------------------------------------------------------
// 1. A GET, then another on the same connection.

#[tokio::test]
async fn get_is_answered_with_date_and_content_length_and_the_connection_is_kept_alive() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;

    let first = wire.exchange(get_req("/first")).await;
    // Today's exact head: the upstream's (hyper's) `content-length` and `date` in its order,
    // then tollgate's `x-request-id`; names lowercase.
    assert_eq!(
        first.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(first.text(), "upstream ok");
    assert_eq!(first.checked_length(), 11);
    let date = first.header("date").expect("a date");
    assert_eq!(date.len(), 29, "an IMF-fixdate: {date:?}");
    assert!(date.ends_with(" GMT"), "{date:?}");
    assert!(!first.chunked);

    // Still open, and a second request on it is served.
    wire.assert_open(Duration::from_millis(100), "after the first response")
        .await;
    let second = wire.exchange(get_req("/second")).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.text(), "upstream ok");
    assert_eq!(second.checked_length(), 11);
    assert_ne!(first.header("x-request-id"), second.header("x-request-id"));
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(uris, ["/first", "/second"]);
    wire.assert_open(Duration::from_millis(100), "after the second response")
        .await;
}

// 2. Pipelining.

#[tokio::test]
async fn three_pipelined_gets_in_one_write_get_three_responses_in_order() {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;

    let batch = format!(
        "{}{}{}",
        get_req("/one"),
        get_req("/two?x=2"),
        get_req("/three")
    );
    wire.send(batch).await;
    let mut ids = Vec::new();
    for expected in ["/one", "/two?x=2", "/three"] {
        let resp = wire.response().await;
        assert_eq!(resp.status, 200, "{}", resp.head);
        assert_eq!(resp.text(), expected);
        resp.checked_length();
        ids.push(resp.header("x-request-id").expect("an id").to_string());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "three distinct request ids");
    let targets: Vec<String> = upstream
        .heads()
        .iter()
        .map(|h| h.split(' ').nth(1).unwrap_or("").to_string())
        .collect();
    assert_eq!(targets, ["/one", "/two?x=2", "/three"]);
    wire.assert_open(Duration::from_millis(100), "after the pipelined batch")
        .await;
}

// 3. HEAD.

/// A HEAD for `/head` and a GET for `/after` pipelined behind it in one write; their
/// responses.
async fn head_then_get(wire: &mut Wire) -> (Resp, Resp) {
    wire.send(format!(
        "HEAD /head HTTP/1.1\r\nHost: wire.test\r\n\r\n{}",
        get_req("/after")
    ))
    .await;
    let head = wire.head_response().await;
    let get = wire.response().await;
    (head, get)
}

#[tokio::test]
async fn head_gets_the_upstream_length_and_no_body_and_a_pipelined_get_after_it_is_answered() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;

    let (head, get) = head_then_get(&mut wire).await;
    // Today: the upstream's (hyper's) length of the GET body it would have sent.
    assert_eq!(
        head.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    // The next bytes are the GET's response, not a body of the HEAD's.
    assert_eq!(get.status, 200);
    assert_eq!(get.text(), "upstream ok");
    get.checked_length();
    let methods: Vec<String> = upstream
        .requests()
        .iter()
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect();
    assert_eq!(methods, ["HEAD /head", "GET /after"]);
    wire.assert_open(Duration::from_millis(100), "after HEAD and GET")
        .await;
}

#[tokio::test]
async fn head_with_a_chunked_upstream_answer_has_no_length_and_no_body() {
    // The upstream answers HEAD as it would GET with a chunked body, but sends no body.
    let upstream = RawUpstream::answering(|method, target| {
        if method == "HEAD" {
            Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        } else {
            Reply::ok(target)
        }
    })
    .await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let (head, get) = head_then_get(&mut wire).await;
    // Today: neither `transfer-encoding` nor `content-length` in the head (the upstream's
    // `Transfer-Encoding` is hop-by-hop, and hyper frames no body for HEAD).
    assert_eq!(
        head.masked_head(),
        "HTTP/1.1 200 OK\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(get.status, 200);
    assert_eq!(get.text(), "/after");
}

// 4. `Connection: close` from the client.

#[tokio::test]
async fn connection_close_request_gets_connection_close_and_the_socket_is_closed() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange("GET /bye HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\
         connection: close\r\n\r\n"
    );
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after Connection: close")
        .await;
    // The client's `Connection` did not reach the upstream.
    assert!(upstream.last().headers.get("connection").is_none());
}

#[tokio::test]
async fn a_request_pipelined_behind_connection_close_is_not_answered_nor_forwarded() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange(format!(
            "GET /last HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n{}",
            get_req("/ignored")
        ))
        .await;
    assert_eq!(resp.header("connection"), Some("close"));
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after Connection: close")
        .await;
    let uris: Vec<String> = upstream.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(uris, ["/last"]);
}

// 5. HTTP/1.0 clients.

#[tokio::test]
async fn http10_request_without_keep_alive_is_answered_then_closed() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange("GET /old HTTP/1.0\r\nHost: wire.test\r\n\r\n")
        .await;
    // Today: an HTTP/1.0 status line (hyper answers in the client's version), no
    // `connection` field.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.0 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after an HTTP/1.0 request")
        .await;
    // Forwarded as HTTP/1.1.
    assert_eq!(upstream.last().version, http::Version::HTTP_11);
}

#[tokio::test]
async fn http10_request_with_connection_keep_alive_is_answered_then_closed() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange("GET /old HTTP/1.0\r\nHost: wire.test\r\nConnection: keep-alive\r\n\r\n")
        .await;
    // Today: HTTP/1.0 keep-alive is not honoured: an HTTP/1.0 status line, no `connection`
    // field (hyper answers in the client's version and, finding no `keep-alive` in an
    // HTTP/1.0 answer, turns keep-alive off), then the close.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.0 200 OK\r\ncontent-length: 11\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(resp.text(), "upstream ok");
    wire.assert_closed(Duration::from_secs(2), "after HTTP/1.0 keep-alive")
        .await;
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn http10_keep_alive_with_an_unknown_length_is_close_delimited_then_closed() {
    let upstream = RawUpstream::answering(|_, _| {
        Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nold!\r\n0\r\n\r\n")
    })
    .await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    wire.send("GET /old HTTP/1.0\r\nHost: wire.test\r\nConnection: keep-alive\r\n\r\n")
        .await;
    // An HTTP/1.0 client cannot take chunked: the body ends with the connection.
    let mut raw = Vec::new();
    let read = tokio::time::timeout(WAIT, wire.stream.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "the connection was not closed");
    let (resp, used) = parse_response(&raw, false, true).expect("a whole response");
    assert_eq!(used, raw.len());
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.0 200 OK\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), "old!");
}

// 6. A chunked upstream answer with a trailer.

/// A chunked answer announcing and sending the trailer field `X-Checksum`.
fn chunked_with_trailer(_method: &str, _target: &str) -> Reply {
    Reply::new(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\
         Trailer: X-Checksum\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nX-Checksum: abc123\r\n\r\n",
    )
}

#[tokio::test]
async fn chunked_upstream_answer_reaches_the_client_chunked_and_its_trailer_only_with_te() {
    let upstream = RawUpstream::answering(chunked_with_trailer).await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;

    let plain = wire.exchange(get_req("/chunked")).await;
    assert!(plain.chunked, "{}", plain.head);
    assert_eq!(plain.text(), "hello world");
    // Today: without `TE: trailers` the trailer is dropped (`Trailer` is hop-by-hop and is
    // not re-announced, and hyper sends only announced trailer fields).
    assert_eq!(
        plain.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-request-id: <id>\r\n\
         transfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert!(plain.trailers.is_empty(), "{:?}", plain.trailers);

    // With `TE: trailers` the announcement is passed on and the trailer arrives.
    let with_te = wire
        .exchange("GET /chunked HTTP/1.1\r\nHost: wire.test\r\nTE: trailers\r\n\r\n")
        .await;
    assert!(with_te.chunked, "{}", with_te.head);
    assert_eq!(with_te.text(), "hello world");
    // Today: the announcement goes back as the upstream spelled its value.
    assert_eq!(
        with_te.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntrailer: X-Checksum\r\n\
         x-request-id: <id>\r\ntransfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(
        with_te.trailers,
        [("x-checksum".to_string(), "abc123".to_string())]
    );
    wire.assert_open(Duration::from_millis(100), "after two chunked answers")
        .await;
}

// 7. A close-delimited upstream body.

/// An upstream that answers every request with `status_line`, `Content-Type: text/plain` and
/// the body `{prefix}{target}`, ended by its close; tollgate in front of it; and a client
/// whose GET for `/eof` has been answered, as asserted here.
async fn after_a_close_delimited_answer(
    status_line: &'static str,
    prefix: &'static str,
) -> (RawUpstream, Proxy, Wire) {
    let upstream = RawUpstream::answering(move |_, target| {
        Reply::new(format!(
            "{status_line}\r\nContent-Type: text/plain\r\n\r\n{prefix}{target}"
        ))
        .closing()
    })
    .await;
    let (proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire.exchange(get_req("/eof")).await;
    // tollgate speaks its own version, and frames the unknown length with chunks.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-request-id: <id>\r\n\
         transfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), format!("{prefix}/eof"));
    (upstream, proxy, wire)
}

#[tokio::test]
async fn close_delimited_http11_upstream_body_is_sent_chunked_and_the_connection_stays_usable() {
    let (_upstream, _proxy, mut wire) =
        after_a_close_delimited_answer("HTTP/1.1 200 OK", "until close: ").await;
    let again = wire.exchange(get_req("/again")).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.text(), "until close: /again");
    wire.assert_open(
        Duration::from_millis(100),
        "after two close-delimited bodies",
    )
    .await;
}

#[tokio::test]
async fn close_delimited_http10_upstream_body_is_sent_as_http11_chunked_to_an_http11_client() {
    let (_upstream, _proxy, mut wire) =
        after_a_close_delimited_answer("HTTP/1.0 200 OK", "old upstream: ").await;
    let again = wire.exchange(get_req("/again")).await;
    assert_eq!(again.text(), "old upstream: /again");
}

// 8. 204 and 304.

#[tokio::test]
async fn no_content_and_not_modified_carry_no_body_and_the_next_pipelined_request_works() {
    let upstream = RawUpstream::answering(|_, target| match target {
        "/204" => Reply::new("HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n"),
        "/304" => Reply::new(
            "HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nCache-Control: max-age=60\r\n\r\n",
        ),
        other => Reply::ok(other),
    })
    .await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let batch = format!(
        "{}GET /304 HTTP/1.1\r\nHost: wire.test\r\nIf-None-Match: \"v1\"\r\n\r\n{}",
        get_req("/204"),
        get_req("/after")
    );
    wire.send(batch).await;
    let no_content = wire.response().await;
    assert_eq!(
        no_content.masked_head(),
        "HTTP/1.1 204 No Content\r\nx-kind: none\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    let not_modified = wire.response().await;
    assert_eq!(
        not_modified.masked_head(),
        "HTTP/1.1 304 Not Modified\r\netag: \"v1\"\r\ncache-control: max-age=60\r\n\
         x-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    for resp in [&no_content, &not_modified] {
        assert!(resp.header("transfer-encoding").is_none(), "{}", resp.head);
        assert!(resp.header("content-length").is_none(), "{}", resp.head);
    }
    // Right after the two heads comes the third response: no body bytes were sent for them.
    let after = wire.response().await;
    assert_eq!(after.status, 200);
    assert_eq!(after.text(), "/after");
    wire.assert_open(Duration::from_millis(100), "after 204 and 304")
        .await;
}

#[tokio::test]
async fn not_modified_with_a_content_length_arrives_without_it_and_without_a_body() {
    let upstream = RawUpstream::answering(|_, target| match target {
        "/304" => {
            Reply::new("HTTP/1.1 304 Not Modified\r\nETag: \"v2\"\r\nContent-Length: 11\r\n\r\n")
        }
        other => Reply::ok(other),
    })
    .await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    wire.send(format!("{}{}", get_req("/304"), get_req("/after")))
        .await;
    let not_modified = wire.response().await;
    // Today: the upstream's `Content-Length` (the length of the representation the 304
    // stands for) does not reach the client; no body either.
    assert_eq!(
        not_modified.masked_head(),
        "HTTP/1.1 304 Not Modified\r\netag: \"v2\"\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
    let after = wire.response().await;
    assert_eq!(after.status, 200);
    assert_eq!(after.text(), "/after");
}

// 9. A large body to a slow reader.

#[tokio::test]
async fn one_mebibyte_body_reaches_a_slow_reader_whole_and_byte_exact() {
    const SIZE: usize = 1024 * 1024;
    let body: Vec<u8> = (0..SIZE).map(pattern_byte).collect();
    let mut reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {SIZE}\r\n\r\n").into_bytes();
    reply.extend_from_slice(&body);
    let upstream = RawUpstream::answering(move |_, _| Reply {
        piece: 16 * 1024,
        ..Reply::new(reply.clone())
    })
    .await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    wire.send(get_req("/big")).await;
    let started = Instant::now();
    // 8 KiB reads with a pause before each: the client drains far slower than the upstream
    // writes, so tollgate must hold back rather than lose bytes.
    let resp = wire
        .read_response(false, 8 * 1024, Duration::from_millis(2))
        .await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-length"), Some("1048576"));
    assert!(!resp.chunked);
    assert_eq!(resp.body.len(), SIZE);
    assert!(
        resp.body == body,
        "the body differs from what the upstream sent"
    );
    assert!(started.elapsed() >= Duration::from_millis(200));
    // And the connection goes on.
    assert!(wire.exchange(get_req("/again")).await.body == body);
}

// 10. A 429 on a keep-alive connection.

#[tokio::test]
async fn third_request_on_a_two_per_minute_route_gets_a_framed_429_and_the_connection_goes_on() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    for _ in 0..2 {
        let resp = wire.exchange(get_req("/limited")).await;
        assert_eq!(resp.status, 200, "{}", resp.head);
        assert_eq!(resp.text(), "upstream ok");
    }
    let denied = wire.exchange(get_req("/limited")).await;
    let body = "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
                \"title\":\"Too Many Requests\",\"status\":429,\
                \"violated-policies\":[\"limited:ip\"]}";
    assert_eq!(denied.text(), body);
    assert_eq!(denied.checked_length(), body.len());
    let retry = denied.header("retry-after").expect("retry-after");
    let retry: u64 = retry.parse().expect("seconds");
    assert!((1..=60).contains(&retry), "{retry}");
    // Today's head, with the varying values masked.
    let head = denied
        .masked_head()
        .replace(&format!("retry-after: {retry}\r\n"), "retry-after: <s>\r\n");
    let ratelimit = denied.header("ratelimit").expect("ratelimit").to_string();
    let head = head.replace(&ratelimit, "<ratelimit>");
    assert_eq!(
        head,
        format!(
            "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/problem+json\r\n\
             retry-after: <s>\r\nratelimit-policy: \"limited:ip\";q=2;w=60\r\n\
             ratelimit: <ratelimit>\r\nx-request-id: <id>\r\ncontent-length: {}\r\n\
             date: <date>\r\n\r\n",
            body.len()
        )
    );
    assert_eq!(upstream.count(), 2, "the 429 was not forwarded");
    // Today: the connection stays open after a 429 to a bodiless request.
    wire.assert_open(Duration::from_millis(100), "after the 429")
        .await;
    let next = wire.exchange(get_req("/open")).await;
    assert_eq!(next.status, 200);
    assert_eq!(next.text(), "upstream ok");
}

// 11. tollgate's own 404.

#[tokio::test]
async fn no_route_404_is_framed_and_the_connection_stays_usable() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let missing = wire
        .exchange("GET /nowhere HTTP/1.1\r\nHost: other.test\r\n\r\n")
        .await;
    assert_eq!(
        missing.masked_head(),
        "HTTP/1.1 404 Not Found\r\ncontent-type: text/plain; charset=utf-8\r\n\
         x-request-id: <id>\r\ncontent-length: 10\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(missing.text(), "Not Found\n");
    assert_eq!(upstream.count(), 0);
    let found = wire.exchange(get_req("/here")).await;
    assert_eq!(found.status, 200);
    assert_eq!(found.text(), "upstream ok");
    wire.assert_open(Duration::from_millis(100), "after 404 and 200")
        .await;
}

#[tokio::test]
async fn http11_request_without_host_gets_400_and_the_connection_closes() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire.exchange("GET /nohost HTTP/1.1\r\n\r\n").await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
         connection: close\r\nx-request-id: <id>\r\ncontent-length: 12\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), "Bad Request\n");
    wire.assert_closed(Duration::from_secs(2), "after 400")
        .await;
    assert_eq!(upstream.count(), 0);
}

#[tokio::test]
async fn absolute_form_target_is_forwarded_in_origin_form() {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange("GET http://wire.test/abs?x=1 HTTP/1.1\r\nHost: wire.test\r\n\r\n")
        .await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "/abs?x=1");
    let head = upstream.heads().pop().expect("a head");
    assert!(head.contains("\r\nhost: wire.test\r\n"), "{head}");
    wire.assert_open(Duration::from_millis(100), "after an absolute-form target")
        .await;
}

// 12. Response header fields.

#[tokio::test]
async fn upstream_response_fields_arrive_unchanged_in_order_with_lowercase_names() {
    let upstream = RawUpstream::answering(|_, _| {
        Reply::new(
            "HTTP/1.1 200 OK\r\nX-Custom: a\r\nSet-Cookie: a=1; Path=/\r\nX-Mixed-Case: Keep This\
             \r\nSet-Cookie: b=2; HttpOnly\r\nCache-Control: no-store\r\nContent-Length: 2\r\n\
             \r\nok",
        )
    })
    .await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire.exchange(get_req("/fields")).await;
    assert_eq!(resp.text(), "ok");
    assert_eq!(resp.all("set-cookie"), ["a=1; Path=/", "b=2; HttpOnly"]);
    // Names lowercased, fields in the order the upstream sent them (as nginx passes them on;
    // hyper's client, which carries the other requests, groups the fields of one name at the
    // place of the first), values untouched; `date` is added at the end.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\nx-custom: a\r\nset-cookie: a=1; Path=/\r\nx-mixed-case: Keep This\
         \r\nset-cookie: b=2; HttpOnly\r\ncache-control: no-store\r\ncontent-length: 2\r\n\
         x-request-id: <id>\r\ndate: <date>\r\n\r\n"
    );
}

#[tokio::test]
async fn upstream_connection_close_does_not_close_the_client_connection() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire.exchange(get_req("/close")).await;
    // The upstream's `Connection: close` is hop-by-hop: not passed on. The other fields keep
    // the upstream's order (its head: connection, content-length, date): tollgate's own client
    // never puts a plain `Connection` into the map, where removing it would move the last
    // field into its place (hyper's client path still does that; the order of fields with
    // different names carries no meaning, RFC 9110 5.3).
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
    );
    assert_eq!(resp.text(), "closing");
    wire.assert_open(Duration::from_millis(100), "after an upstream close")
        .await;
    assert_eq!(wire.exchange(get_req("/close")).await.text(), "closing");
}

// 13. The request the upstream receives.

#[tokio::test]
async fn upstream_receives_a_plain_get_with_exactly_these_fields() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange(
            "GET /plain?q=1 HTTP/1.1\r\nHost: wire.test\r\nUser-Agent: wire/1\r\nAccept: */*\r\n\
         Connection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: gone\r\n\
         Proxy-Connection: keep-alive\r\nTE: gzip\r\nX-Custom-In: kept\r\nCookie: a=1\r\n\
         Cookie: b=2\r\n\r\n",
        )
        .await;
    assert_eq!(resp.status, 200);
    let seen = upstream.last();
    assert_eq!(seen.method, http::Method::GET);
    assert_eq!(seen.uri, "/plain?q=1");
    assert_eq!(seen.version, http::Version::HTTP_11);
    assert!(seen.body.is_empty());
    let mut fields: Vec<String> = seen
        .headers
        .iter()
        .filter(|(name, _)| *name != "x-request-id")
        .map(|(name, value)| format!("{name}: {}", value.to_str().expect("visible ASCII")))
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            "accept: */*",
            "cookie: a=1",
            "cookie: b=2",
            "host: wire.test",
            "user-agent: wire/1",
            "x-custom-in: kept",
            "x-forwarded-for: 127.0.0.1",
            "x-forwarded-host: wire.test",
            "x-forwarded-proto: http",
            "x-real-ip: 127.0.0.1",
        ]
    );
    // A fresh id, the one the client got back.
    let ids: Vec<_> = seen.headers.get_all("x-request-id").iter().collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(
        Some(ids[0].to_str().expect("ASCII")),
        resp.header("x-request-id")
    );
}

#[tokio::test]
async fn the_request_head_on_the_upstream_wire_has_this_order() {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    let resp = wire
        .exchange(
            "GET /order HTTP/1.1\r\nHost: wire.test\r\nUser-Agent: wire/1\r\nAccept: */*\r\n\
         X-Custom-In: kept\r\n\r\n",
        )
        .await;
    assert_eq!(resp.text(), "/order");
    let head = upstream.heads().pop().expect("a head");
    let id = resp.header("x-request-id").expect("an id");
    // Today's bytes, names lowercase (hyper's client writes the map in its order).
    assert_eq!(
        head.replace(id, "<id>"),
        "GET /order HTTP/1.1\r\nhost: wire.test\r\nuser-agent: wire/1\r\naccept: */*\r\n\
         x-custom-in: kept\r\nx-request-id: <id>\r\nx-forwarded-for: 127.0.0.1\r\n\
         x-forwarded-proto: http\r\nx-forwarded-host: wire.test\r\nx-real-ip: 127.0.0.1\r\n\r\n"
    );
}

/// A GET for `/many` with `Host` and `n` more fields, `X-Field-{i}: value-{i}`.
fn many_fields(n: usize) -> String {
    let mut request = String::from("GET /many HTTP/1.1\r\nHost: wire.test\r\n");
    for i in 0..n {
        request.push_str(&format!("X-Field-{i}: value-{i}\r\n"));
    }
    request.push_str("\r\n");
    request
}

#[tokio::test]
async fn a_request_with_a_hundred_header_fields_reaches_the_upstream_whole() {
    // A raw upstream: the recording one (hyper) takes at most 100 fields itself, and tollgate
    // adds five.
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    // `Host` and 99 more: 100 fields, hyper's default maximum.
    let resp = wire.exchange(many_fields(99)).await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "/many");
    let head = upstream.heads().pop().expect("a head");
    let lines: Vec<&str> = head.split("\r\n").collect();
    let fields: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("x-field-"))
        .collect();
    let expected: Vec<String> = (0..99).map(|i| format!("x-field-{i}: value-{i}")).collect();
    assert_eq!(fields, expected, "all 99 fields, in order, names lowercase");
    // Request line, host, 99 fields, 5 added by tollgate, and the blank line's two empties.
    assert_eq!(lines.len(), 1 + 1 + 99 + 5 + 2, "{head}");
    wire.assert_open(Duration::from_millis(100), "after 100 fields")
        .await;
}

#[tokio::test]
async fn a_request_with_more_than_a_hundred_header_fields_gets_431() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    // `Host` and 100 more: 101 fields, past hyper's default of 100.
    let resp = wire.exchange(many_fields(100)).await;
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\
         date: <date>\r\n\r\n"
    );
    wire.assert_closed(Duration::from_secs(2), "after 431")
        .await;
    assert_eq!(upstream.count(), 0);
}

// 14. A client that half-closes after its request.

#[tokio::test]
async fn get_then_write_shutdown_is_not_answered_and_the_connection_closes() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    // The upstream waits before it answers, so that the FIN is there before any answer could
    // be: with an immediate one, a loaded machine sometimes answered between the two writes.
    wire.send(get_req("/slow/300")).await;
    wire.stream.shutdown().await.expect("shutdown(Write)");
    // Today: the FIN is taken for the client going away; the request is dropped and the
    // connection closed without an answer.
    wire.assert_closed(WAIT, "after the client's FIN").await;
}

#[tokio::test]
async fn pipelined_gets_then_write_shutdown_get_only_the_first_answer() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;
    wire.send(format!("{}{}", get_req("/p1"), get_req("/p2")))
        .await;
    wire.stream.shutdown().await.expect("shutdown(Write)");
    // Today: while the second request's bytes wait behind the first, the FIN is not looked
    // for, so the first is answered; once they are read, the FIN is taken for the client
    // going away and the second, complete as it was, is dropped unanswered.
    let first = wire.response().await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text(), "upstream ok");
    wire.assert_closed(WAIT, "after the first of a half-closed pipelined pair")
        .await;
    assert_eq!(upstream.requests()[0].uri, "/p1");
}

// 15. The graceful stop.

#[tokio::test]
async fn drain_finishes_the_in_flight_request_with_connection_close_and_closes_idle_ones() {
    let upstream = Upstream::start().await;
    let mut proxy = proxy_for(upstream.addr).await;
    let addr = proxy.addr;
    let mut busy = Wire::connect(addr).await;
    let mut idle = Wire::connect(addr).await;
    idle.send(get_req("/before")).await;
    assert_eq!(idle.response().await.status, 200);
    busy.send(get_req("/slow/500")).await;
    until("requests at the upstream", 2, || upstream.count()).await;

    let server = proxy.server.take().expect("running");
    let drain_started = Instant::now();
    let stopping = tokio::spawn(server.shutdown());

    // The idle keep-alive connection closes at once, well before the slow answer.
    let idle_closed = idle
        .assert_closed(Duration::from_secs(1), "idle connection at the drain")
        .await;
    let resp = busy.response().await;
    let answered = drain_started.elapsed();
    assert!(idle_closed < answered, "{idle_closed:?} vs {answered:?}");
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ndate: <date>\r\nx-request-id: <id>\r\n\
         connection: close\r\n\r\n"
    );
    assert_eq!(resp.text(), "slow ok");
    busy.assert_closed(
        Duration::from_secs(2),
        "the drained connection after its answer",
    )
    .await;
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("shutdown within 5 s")
        .expect("shutdown task");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "still accepting after the stop"
    );
}

// The hand-over from tollgate's own path for simple requests to hyper's, mid-connection.

#[tokio::test]
async fn simple_requests_around_a_post_with_a_body_in_one_write_are_all_answered_in_order() {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;

    // A GET (simple), a POST with a body (not simple: the rest of the connection is hyper's),
    // then another GET, in one write: the body must be read as the POST's, not as a head.
    let batch = format!(
        "{}POST /echo HTTP/1.1\r\nHost: wire.test\r\nContent-Length: 32\r\n\r\n\
         GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n{}",
        get_req("/first"),
        get_req("/last")
    );
    wire.send(batch).await;
    let first = wire.response().await;
    assert_eq!((first.status, first.text().as_str()), (200, "upstream ok"));
    let echoed = wire.response().await;
    assert_eq!(echoed.status, 200, "{}", echoed.head);
    assert_eq!(echoed.text(), "GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n");
    let last = wire.response().await;
    assert_eq!((last.status, last.text().as_str()), (200, "upstream ok"));
    for resp in [&first, &echoed, &last] {
        resp.checked_length();
    }
    let received: Vec<(String, String)> = upstream
        .received
        .lock()
        .expect("lock")
        .iter()
        .map(|r| (r.method.to_string(), r.uri.clone()))
        .collect();
    let expected = [("GET", "/first"), ("POST", "/echo"), ("GET", "/last")];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(m, u)| (m.to_string(), u.to_string()))
        .collect();
    assert_eq!(
        received, expected,
        "no smuggled request reached the upstream"
    );
    wire.assert_open(Duration::from_millis(100), "after the hand-over")
        .await;
}

#[tokio::test]
async fn a_head_split_over_many_writes_is_answered_once() {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(upstream.addr).await;

    // One byte at a time: every read leaves the head unfinished until its last byte.
    for byte in get_req("/split").bytes() {
        wire.send([byte]).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let resp = wire.response().await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "/split"));
    let resp = wire.exchange(get_req("/after")).await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "/after"));
    assert_eq!(upstream.heads().len(), 2, "{:?}", upstream.heads());
}
