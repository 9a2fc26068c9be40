//! HTTP/1.1 on the wire for simple requests (no body: no `Content-Length` nor
//! `Transfer-Encoding`, no `Upgrade`, no `Expect`), byte for byte as tollgate answers them
//! today.
//!
//! These tests were written against hyper's HTTP/1.1 server and client as tollgate drives them,
//! and each runs on every pairing of tollgate's HTTP/1.1 servers and clients
//! (`crate::common::paths`), so that its own server and client are held to the same bytes:
//! status lines, header names and order, framing (`content-length`, chunked, close-delimited,
//! none for HEAD, 204 and 304), keep-alive and pipelining, `Connection: close`, HTTP/1.0
//! clients, half-closes and the graceful stop. tollgate's own answers and the fields that
//! cross it are in `h1_wire_fields`.
//!
//! Clients are raw TCP sockets that write exact bytes and parse exactly what comes back.
//! Upstreams are either the recording `crate::common::Upstream` or the raw-TCP one of `crate::common::wire`
//! ([`RawUpstream`]) that writes fixed bytes, for response shapes a hyper server would not
//! produce on request (trailers, close-delimited bodies, 204 and 304, paced bodies).
//! Every read is bounded by a timeout: a hang fails the test.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::paths::*;
use crate::common::wire::*;
use crate::common::*;

// ---------------------------------------------------------------------------------------------
// 1. A GET, then another on the same connection.

async fn get_is_answered_with_date_and_content_length_and_the_connection_is_kept_alive(
    paths: Paths,
) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;

    let first = wire.exchange(wire_get("/first")).await;
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
    let second = wire.exchange(wire_get("/second")).await;
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

async fn three_pipelined_gets_in_one_write_get_three_responses_in_order(paths: Paths) {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;

    let batch = format!(
        "{}{}{}",
        wire_get("/one"),
        wire_get("/two?x=2"),
        wire_get("/three")
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
        wire_get("/after")
    ))
    .await;
    let head = wire.head_response().await;
    let get = wire.response().await;
    (head, get)
}

async fn head_gets_the_upstream_length_and_no_body_and_a_pipelined_get_after_it_is_answered(
    paths: Paths,
) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;

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

async fn head_with_a_chunked_upstream_answer_has_no_length_and_no_body(paths: Paths) {
    // The upstream answers HEAD as it would GET with a chunked body, but sends no body.
    let upstream = RawUpstream::answering(|method, target| {
        if method == "HEAD" {
            Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        } else {
            Reply::ok(target)
        }
    })
    .await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn connection_close_request_gets_connection_close_and_the_socket_is_closed(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn a_request_pipelined_behind_connection_close_is_not_answered_nor_forwarded(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    let resp = wire
        .exchange(format!(
            "GET /last HTTP/1.1\r\nHost: wire.test\r\nConnection: close\r\n\r\n{}",
            wire_get("/ignored")
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

async fn http10_request_without_keep_alive_is_answered_then_closed(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn http10_request_with_connection_keep_alive_is_answered_then_closed(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn http10_keep_alive_with_an_unknown_length_is_close_delimited_then_closed(paths: Paths) {
    let upstream = RawUpstream::answering(|_, _| {
        Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nold!\r\n0\r\n\r\n")
    })
    .await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn chunked_upstream_answer_reaches_the_client_chunked_and_its_trailer_only_with_te(
    paths: Paths,
) {
    let upstream = RawUpstream::answering(chunked_with_trailer).await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;

    let plain = wire.exchange(wire_get("/chunked")).await;
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
/// the body `{prefix}{target}`, ended by its close; tollgate on `paths` in front of it; and a client
/// whose GET for `/eof` has been answered, as asserted here.
async fn after_a_close_delimited_answer(
    paths: Paths,
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
    let (proxy, mut wire) = client_of(paths, upstream.addr).await;
    let resp = wire.exchange(wire_get("/eof")).await;
    // tollgate speaks its own version, and frames the unknown length with chunks.
    assert_eq!(
        resp.masked_head(),
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-request-id: <id>\r\n\
         transfer-encoding: chunked\r\ndate: <date>\r\n\r\n"
    );
    assert_eq!(resp.text(), format!("{prefix}/eof"));
    (upstream, proxy, wire)
}

async fn close_delimited_http11_upstream_body_is_sent_chunked_and_the_connection_stays_usable(
    paths: Paths,
) {
    let (_upstream, _proxy, mut wire) =
        after_a_close_delimited_answer(paths, "HTTP/1.1 200 OK", "until close: ").await;
    let again = wire.exchange(wire_get("/again")).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.text(), "until close: /again");
    wire.assert_open(
        Duration::from_millis(100),
        "after two close-delimited bodies",
    )
    .await;
}

async fn close_delimited_http10_upstream_body_is_sent_as_http11_chunked_to_an_http11_client(
    paths: Paths,
) {
    let (_upstream, _proxy, mut wire) =
        after_a_close_delimited_answer(paths, "HTTP/1.0 200 OK", "old upstream: ").await;
    let again = wire.exchange(wire_get("/again")).await;
    assert_eq!(again.text(), "old upstream: /again");
}

// 8. 204 and 304.

async fn no_content_and_not_modified_carry_no_body_and_the_next_pipelined_request_works(
    paths: Paths,
) {
    let upstream = RawUpstream::answering(|_, target| match target {
        "/204" => Reply::new("HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n"),
        "/304" => Reply::new(
            "HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nCache-Control: max-age=60\r\n\r\n",
        ),
        other => Reply::ok(other),
    })
    .await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    let batch = format!(
        "{}GET /304 HTTP/1.1\r\nHost: wire.test\r\nIf-None-Match: \"v1\"\r\n\r\n{}",
        wire_get("/204"),
        wire_get("/after")
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

async fn not_modified_with_a_content_length_arrives_without_it_and_without_a_body(paths: Paths) {
    let upstream = RawUpstream::answering(|_, target| match target {
        "/304" => {
            Reply::new("HTTP/1.1 304 Not Modified\r\nETag: \"v2\"\r\nContent-Length: 11\r\n\r\n")
        }
        other => Reply::ok(other),
    })
    .await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    wire.send(format!("{}{}", wire_get("/304"), wire_get("/after")))
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

async fn one_mebibyte_body_reaches_a_slow_reader_whole_and_byte_exact(paths: Paths) {
    const SIZE: usize = 1024 * 1024;
    let body: Vec<u8> = (0..SIZE).map(pattern_byte).collect();
    let mut reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {SIZE}\r\n\r\n").into_bytes();
    reply.extend_from_slice(&body);
    let upstream = RawUpstream::answering(move |_, _| Reply {
        piece: 16 * 1024,
        ..Reply::new(reply.clone())
    })
    .await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    wire.send(wire_get("/big")).await;
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
    assert!(wire.exchange(wire_get("/again")).await.body == body);
}

// 10. A client that half-closes after its request.

async fn get_then_write_shutdown_is_not_answered_and_the_connection_closes(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    // The upstream waits before it answers, so that the FIN is there before any answer could
    // be: with an immediate one, a loaded machine sometimes answered between the two writes.
    wire.send(wire_get("/slow/300")).await;
    wire.stream.shutdown().await.expect("shutdown(Write)");
    // Today: the FIN is taken for the client going away; the request is dropped and the
    // connection closed without an answer.
    wire.assert_closed(WAIT, "after the client's FIN").await;
}

async fn pipelined_gets_then_write_shutdown_get_only_the_first_answer(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    wire.send(format!("{}{}", wire_get("/p1"), wire_get("/p2")))
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

// 11. The graceful stop.

async fn drain_finishes_the_in_flight_request_with_connection_close_and_closes_idle_ones(
    paths: Paths,
) {
    let upstream = Upstream::start().await;
    let mut proxy = paths.start(wire_config(upstream.addr)).await;
    let addr = proxy.addr;
    let mut busy = Wire::connect(addr).await;
    let mut idle = Wire::connect(addr).await;
    idle.send(wire_get("/before")).await;
    assert_eq!(idle.response().await.status, 200);
    busy.send(wire_get("/slow/500")).await;
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

async fn simple_requests_around_a_post_with_a_body_in_one_write_are_all_answered_in_order(
    paths: Paths,
) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;

    // A GET (simple), a POST with a body (not simple: the rest of the connection is hyper's),
    // then another GET, in one write: the body must be read as the POST's, not as a head.
    let batch = format!(
        "{}POST /echo HTTP/1.1\r\nHost: wire.test\r\nContent-Length: 32\r\n\r\n\
         GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n{}",
        wire_get("/first"),
        wire_get("/last")
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

async fn a_head_split_over_many_writes_is_answered_once(paths: Paths) {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;

    // One byte at a time: every read leaves the head unfinished until its last byte.
    for byte in wire_get("/split").bytes() {
        wire.send([byte]).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let resp = wire.response().await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "/split"));
    let resp = wire.exchange(wire_get("/after")).await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "/after"));
    assert_eq!(upstream.heads().len(), 2, "{:?}", upstream.heads());
}

every_path_tests!(
    get_is_answered_with_date_and_content_length_and_the_connection_is_kept_alive,
    three_pipelined_gets_in_one_write_get_three_responses_in_order,
    head_gets_the_upstream_length_and_no_body_and_a_pipelined_get_after_it_is_answered,
    head_with_a_chunked_upstream_answer_has_no_length_and_no_body,
    connection_close_request_gets_connection_close_and_the_socket_is_closed,
    a_request_pipelined_behind_connection_close_is_not_answered_nor_forwarded,
    http10_request_without_keep_alive_is_answered_then_closed,
    http10_request_with_connection_keep_alive_is_answered_then_closed,
    http10_keep_alive_with_an_unknown_length_is_close_delimited_then_closed,
    chunked_upstream_answer_reaches_the_client_chunked_and_its_trailer_only_with_te,
    close_delimited_http11_upstream_body_is_sent_chunked_and_the_connection_stays_usable,
    close_delimited_http10_upstream_body_is_sent_as_http11_chunked_to_an_http11_client,
    no_content_and_not_modified_carry_no_body_and_the_next_pipelined_request_works,
    not_modified_with_a_content_length_arrives_without_it_and_without_a_body,
    one_mebibyte_body_reaches_a_slow_reader_whole_and_byte_exact,
    get_then_write_shutdown_is_not_answered_and_the_connection_closes,
    pipelined_gets_then_write_shutdown_get_only_the_first_answer,
    drain_finishes_the_in_flight_request_with_connection_close_and_closes_idle_ones,
    simple_requests_around_a_post_with_a_body_in_one_write_are_all_answered_in_order,
    a_head_split_over_many_writes_is_answered_once,
);
