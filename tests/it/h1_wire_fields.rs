//! HTTP/1.1 on the wire for simple requests, continued from `h1_wire` (same helpers, same
//! rules): tollgate's own answers (429, 404, 400) and the fields of a response and of a request
//! as they cross it, byte for byte, on every pairing of the HTTP/1.1 paths
//! (`crate::common::paths`).

use std::time::Duration;

use crate::common::paths::*;
use crate::common::wire::*;
use crate::common::*;

// ---------------------------------------------------------------------------------------------
// 1. A 429 on a keep-alive connection.

async fn third_request_on_a_two_per_minute_route_gets_a_framed_429_and_the_connection_goes_on(
    paths: Paths,
) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    for _ in 0..2 {
        let resp = wire.exchange(wire_get("/limited")).await;
        assert_eq!(resp.status, 200, "{}", resp.head);
        assert_eq!(resp.text(), "upstream ok");
    }
    let denied = wire.exchange(wire_get("/limited")).await;
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
    let next = wire.exchange(wire_get("/open")).await;
    assert_eq!(next.status, 200);
    assert_eq!(next.text(), "upstream ok");
}

// 2. tollgate's own 404.

async fn no_route_404_is_framed_and_the_connection_stays_usable(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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
    let found = wire.exchange(wire_get("/here")).await;
    assert_eq!(found.status, 200);
    assert_eq!(found.text(), "upstream ok");
    wire.assert_open(Duration::from_millis(100), "after 404 and 200")
        .await;
}

async fn http11_request_without_host_gets_400_and_the_connection_closes(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn absolute_form_target_is_forwarded_in_origin_form(paths: Paths) {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

// 3. Response header fields.

async fn upstream_response_fields_arrive_unchanged_in_order_with_lowercase_names(paths: Paths) {
    let upstream = RawUpstream::answering(|_, _| {
        Reply::new(
            "HTTP/1.1 200 OK\r\nX-Custom: a\r\nSet-Cookie: a=1; Path=/\r\nX-Mixed-Case: Keep This\
             \r\nSet-Cookie: b=2; HttpOnly\r\nCache-Control: no-store\r\nContent-Length: 2\r\n\
             \r\nok",
        )
    })
    .await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    let resp = wire.exchange(wire_get("/fields")).await;
    assert_eq!(resp.text(), "ok");
    assert_eq!(resp.all("set-cookie"), ["a=1; Path=/", "b=2; HttpOnly"]);
    // Names lowercased, every field and value untouched, the lines of one name in the order the
    // upstream sent them, and `date` added: compared in name order, the order the contract fixes
    // (`Resp::masked_head_by_name`).
    assert_eq!(
        resp.masked_head_by_name(),
        by_name(
            "HTTP/1.1 200 OK\r\nx-custom: a\r\nset-cookie: a=1; Path=/\r\n\
             x-mixed-case: Keep This\r\nset-cookie: b=2; HttpOnly\r\ncache-control: no-store\r\n\
             content-length: 2\r\nx-request-id: <id>\r\ndate: <date>\r\n\r\n"
        )
    );
}

async fn upstream_connection_close_does_not_close_the_client_connection(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
    let resp = wire.exchange(wire_get("/close")).await;
    // The upstream's `Connection: close` is hop-by-hop: not passed on; the other fields are
    // (compared in name order: `Resp::masked_head_by_name`).
    assert_eq!(
        resp.masked_head_by_name(),
        by_name(
            "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ndate: <date>\r\nx-request-id: <id>\r\n\r\n"
        )
    );
    assert_eq!(resp.text(), "closing");
    wire.assert_open(Duration::from_millis(100), "after an upstream close")
        .await;
    assert_eq!(wire.exchange(wire_get("/close")).await.text(), "closing");
}

// 4. The request the upstream receives.

async fn upstream_receives_a_plain_get_with_exactly_these_fields(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn the_request_head_on_the_upstream_wire_has_this_order(paths: Paths) {
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn a_request_with_a_hundred_header_fields_reaches_the_upstream_whole(paths: Paths) {
    // A raw upstream: the recording one (hyper) takes at most 100 fields itself, and tollgate
    // adds five.
    let upstream = RawUpstream::start(echo_target).await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

async fn a_request_with_more_than_a_hundred_header_fields_gets_431(paths: Paths) {
    let upstream = Upstream::start().await;
    let (_proxy, mut wire) = client_of(paths, upstream.addr).await;
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

every_path_tests!(
    third_request_on_a_two_per_minute_route_gets_a_framed_429_and_the_connection_goes_on,
    no_route_404_is_framed_and_the_connection_stays_usable,
    http11_request_without_host_gets_400_and_the_connection_closes,
    absolute_form_target_is_forwarded_in_origin_form,
    upstream_response_fields_arrive_unchanged_in_order_with_lowercase_names,
    upstream_connection_close_does_not_close_the_client_connection,
    upstream_receives_a_plain_get_with_exactly_these_fields,
    the_request_head_on_the_upstream_wire_has_this_order,
    a_request_with_a_hundred_header_fields_reaches_the_upstream_whole,
    a_request_with_more_than_a_hundred_header_fields_gets_431,
);
