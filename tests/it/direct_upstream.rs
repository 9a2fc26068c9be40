//! tollgate's own HTTP/1.1 upstream client (`http1::client`), used for requests without a
//! body (those tollgate's simple server path took, and HTTP/2 requests whose HEADERS ended the
//! stream) to plain-HTTP, HTTP/1.1 upstreams.
//!
//! It is meant to behave exactly as hyper 1.x's client did (`proto/h1/role.rs`, `Client`):
//! keep-alive and reuse of idle connections per worker, never a connection the upstream closed
//! or sent unexpected bytes on, 1xx heads skipped, at most 100 response fields, no body for
//! HEAD, 204 and 304, chunked / `Content-Length` / close-delimited framing with hyper's rules
//! for conflicts, reason phrases kept, failover on connect failures, and `max_idle_connections`.
//!
//! The upstream is the raw-TCP server of `crate::common::wire` ([`RawUpstream`]) that counts the
//! connections it accepts and still has open, records each request head with the connection it
//! came on, and writes exact response bytes. Clients are raw sockets ([`Wire`]) that parse
//! exactly what comes back. tollgate runs with one connection worker, so every request uses the
//! same lane of idle upstream connections. Every wait is bounded: a hang fails the test.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::wire::{
    echo_target, find, lossy, parse_response, until_eq, RawUpstream, Reply, Resp, Seen, Wire, WAIT,
};
use crate::common::{config_from, pattern_byte, Proxy, RefusedPort};

/// tollgate with one worker, memory store, and upstream `app` with these origins (in order);
/// `upstream_extra` goes into `[upstreams.app]`.
async fn proxy_with(origins: &[SocketAddr], upstream_extra: &str) -> Proxy {
    let urls: Vec<String> = origins.iter().map(|a| format!("\"http://{a}\"")).collect();
    let text = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"
workers = 1

[upstreams.app]
urls = [{}]
connect_timeout = "1s"
{timeout}
{upstream_extra}

[[routes]]
name = "all"
upstream = "app"
"#,
        urls.join(", "),
        timeout = if upstream_extra.contains("response_timeout") {
            ""
        } else {
            "response_timeout = \"3s\""
        },
    );
    Proxy::start(config_from(&text, origins[0], &[])).await
}

async fn proxy_for(upstream: &RawUpstream) -> Proxy {
    proxy_with(&[upstream.addr], "").await
}

/// The raw upstream with `script`, tollgate in front of it, and a client connected to tollgate.
async fn connected(
    script: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
) -> (RawUpstream, Proxy, Wire) {
    let upstream = RawUpstream::start(script).await;
    let proxy = proxy_for(&upstream).await;
    let wire = Wire::connect(proxy.addr).await;
    (upstream, proxy, wire)
}

/// A plain HTTP/1.1 GET for `path`.
fn get_req(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: direct.test\r\n\r\n")
}

impl Wire {
    /// A GET for `path` and its response.
    async fn get(&mut self, path: &str) -> Resp {
        self.exchange(get_req(path)).await
    }

    /// A GET for `path`, asserted to be answered `200` with `path` as the body (as
    /// [`echo_target`] answers).
    async fn get_echoed(&mut self, path: &str) {
        let resp = self.get(path).await;
        assert_eq!(resp.status, 200, "{path}: {}{}", resp.head, resp.text());
        assert_eq!(resp.text(), path);
    }
}

/// Asserts that what a client read before its connection closed is the head of a `200` and
/// `relayed`, the body bytes (as framed on the wire) that came before the upstream's fault, and
/// not a whole response: the head goes out as soon as it is known, the body as it comes, and
/// the cut shows as a close before the body's end.
fn assert_cut(bytes: &[u8], what: &str, relayed: &str) {
    if let Some((resp, _)) = parse_response(bytes, false, false) {
        panic!(
            "{what}: the client got a complete response ({}), body {:?}",
            resp.status_line(),
            resp.text()
        );
    }
    let text = lossy(bytes);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        panic!("{what}: no whole head before the close: {text:?}");
    };
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{what}: {head:?}");
    assert_eq!(body, relayed, "{what}: the body relayed before the cut");
}

// ---------------------------------------------------------------------------------------------
// 1. Keep-alive.

#[tokio::test]
async fn five_sequential_gets_go_over_one_upstream_connection() {
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_for(&upstream).await;
    // Three on one client connection, two on two more.
    let mut wire = Wire::connect(proxy.addr).await;
    for i in 0..3 {
        wire.get_echoed(&format!("/same/{i}")).await;
    }
    for i in 0..2 {
        let mut other = Wire::connect(proxy.addr).await;
        other.get_echoed(&format!("/other/{i}")).await;
    }
    assert_eq!(upstream.conns(), [0, 0, 0, 0, 0]);
    assert_eq!(upstream.accepted(), 1);
    let nths: Vec<usize> = upstream.seen().iter().map(|s| s.nth).collect();
    assert_eq!(nths, [0, 1, 2, 3, 4]);
}

#[tokio::test]
async fn five_sequential_gets_answered_with_connection_close_use_five_upstream_connections() {
    let (upstream, _proxy, mut wire) = connected(|seen| {
        Reply::new(format!(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
            seen.target.len(),
            seen.target
        ))
        .closing()
    })
    .await;
    for i in 0..5 {
        wire.get_echoed(&format!("/close/{i}")).await;
    }
    assert_eq!(upstream.conns(), [0, 1, 2, 3, 4]);
    assert_eq!(upstream.accepted(), 5);
    // The upstream's `Connection: close` is hop-by-hop: the client connection stays.
    wire.assert_open(Duration::from_millis(100), "after five answers")
        .await;
}

#[tokio::test]
async fn keep_alive_connection_with_http10_keep_alive_is_reused_and_plain_http10_is_not() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/ka" => {
            Reply::new("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nka")
        }
        _ => Reply::new("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nno"),
    })
    .await;
    assert_eq!(wire.get("/ka").await.text(), "ka");
    assert_eq!(wire.get("/ka").await.text(), "ka");
    // HTTP/1.0 without keep-alive: the connection is not used again (the raw upstream keeps
    // it open, so a reuse would show).
    assert_eq!(wire.get("/plain").await.text(), "no");
    assert_eq!(wire.get("/ka").await.text(), "ka");
    assert_eq!(upstream.conns(), [0, 0, 0, 1]);
}

#[tokio::test]
async fn an_upstreams_connection_options_go_no_further_and_still_decide_reuse() {
    // `direct` keeps a plain `Connection: keep-alive` or `close` out of the response's map
    // altogether; any other value goes in and is stripped with what it names.
    let (upstream, _proxy, mut wire) = connected(|seen| {
        let (fields, body) = match seen.target.as_str() {
            "/ka" => ("Connection: Keep-Alive\r\nKeep-Alive: timeout=5\r\n", "ka"),
            "/close" => ("Connection: CLOSE\r\n", "cl"),
            _ => ("Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\n", "xh"),
        };
        // The upstream keeps every connection open, so a reuse after `close` would show.
        Reply::new(format!(
            "HTTP/1.1 200 OK\r\n{fields}Content-Length: 2\r\n\r\n{body}"
        ))
    })
    .await;
    for (target, body) in [
        ("/ka", "ka"),
        ("/close", "cl"),
        ("/hop", "xh"),
        ("/ka", "ka"),
    ] {
        let resp = wire.get(target).await;
        assert_eq!(resp.text(), body, "{target}");
        for name in ["connection", "keep-alive", "x-hop"] {
            assert_eq!(resp.header(name), None, "{target}: {}", resp.head);
        }
    }
    // `close` ended the first upstream connection: tollgate did not use it again.
    assert_eq!(upstream.conns(), [0, 0, 1, 1]);
    wire.assert_open(Duration::from_millis(100), "after the upstream's close")
        .await;
}

// 2. An idle connection the upstream closed.

#[tokio::test]
async fn idle_connection_closed_by_the_upstream_is_not_reused_and_the_next_get_gets_200() {
    let (upstream, _proxy, mut wire) = connected(|seen| Reply::ok(&seen.target).closing()).await;
    for i in 0..4 {
        wire.get_echoed(&format!("/n/{i}")).await;
    }
    assert_eq!(upstream.conns(), [0, 1, 2, 3]);
    // And after a pause, when the close has certainly been seen.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let resp = wire.get("/later").await;
    assert_eq!(resp.status, 200, "{}{}", resp.head, resp.text());
    assert_eq!(upstream.accepted(), 5);
}

#[tokio::test]
async fn idle_connection_reset_by_the_upstream_is_not_reused_and_the_next_get_gets_200() {
    let (upstream, _proxy, mut wire) = connected(|seen| Reply {
        reset: true,
        ..Reply::ok(&seen.target)
    })
    .await;
    for i in 0..3 {
        wire.get_echoed(&format!("/r/{i}")).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(upstream.conns(), [0, 1, 2]);
}

// 3. Informational responses.

#[tokio::test]
async fn continue_and_early_hints_before_the_response_are_skipped() {
    let (upstream, _proxy, mut wire) = connected(|seen| {
        let mut reply = Reply::new(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n\
             HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Real: yes\r\n\r\nfinal",
        );
        // The second time, in small pieces: heads split across reads.
        if seen.nth == 1 {
            reply.piece = 7;
            reply.gap = Duration::from_millis(2);
        }
        reply
    })
    .await;
    for round in 0..2 {
        let resp = wire.get("/hints").await;
        assert_eq!(resp.status_line(), "HTTP/1.1 200 OK", "round {round}");
        assert_eq!(resp.text(), "final");
        assert_eq!(resp.header("x-real"), Some("yes"));
        assert_eq!(resp.header("link"), None, "{}", resp.head);
        wire.assert_open(Duration::from_millis(100), "after the response")
            .await;
    }
    assert_eq!(upstream.conns(), [0, 0]);
}

// 4. The number of response fields.

/// A `200` with body `ok` and `fields` fields in all (`Content-Length` and `x-N` ones).
fn with_fields(fields: usize) -> Reply {
    let mut head = String::from("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n");
    for i in 1..fields {
        head.push_str(&format!("x-{i}: v\r\n"));
    }
    head.push_str("\r\nok");
    Reply::new(head)
}

#[tokio::test]
async fn response_with_101_fields_gets_502_and_with_100_fields_gets_200() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/101" => with_fields(101),
        _ => with_fields(100),
    })
    .await;
    let resp = wire.get("/101").await;
    assert_eq!(resp.status, 502, "{}", resp.head);
    let mut wire = Wire::connect(proxy.addr).await;
    let resp = wire.get("/100").await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "ok");
    assert_eq!(resp.header("x-99"), Some("v"));
    // The connection that sent the bad head is not used again.
    assert_eq!(upstream.conns(), [0, 1]);
}

// 5. Content-Length.

#[tokio::test]
async fn two_differing_content_lengths_get_502() {
    let upstream = RawUpstream::start(|seen| match seen.target.as_str() {
        "/differ" => {
            Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!")
        }
        "/list" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok!"),
        other => Reply::ok(other),
    })
    .await;
    let proxy = proxy_for(&upstream).await;
    for path in ["/differ", "/list"] {
        let mut wire = Wire::connect(proxy.addr).await;
        let resp = wire.get(path).await;
        assert_eq!(resp.status, 502, "{path}: {}{}", resp.head, resp.text());
    }
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.status, 200);
    assert_eq!(upstream.conns(), [0, 1, 2]);
}

#[tokio::test]
async fn two_equal_content_lengths_give_200_with_the_body_once() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/same" => {
            Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok")
        }
        "/list" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok"),
        other => Reply::ok(other),
    })
    .await;
    for path in ["/same", "/list"] {
        let resp = wire.get(path).await;
        assert_eq!(resp.status, 200, "{path}: {}", resp.head);
        assert_eq!(resp.text(), "ok", "{path}");
    }
    // Right after comes the next response: the body was sent once.
    let resp = wire.get("/after").await;
    assert_eq!(resp.text(), "/after");
    wire.assert_open(Duration::from_millis(100), "after the three")
        .await;
    assert_eq!(upstream.conns(), [0, 0, 0]);
}

// 6. Transfer-Encoding on HTTP/1.0.

#[tokio::test]
async fn http10_response_with_transfer_encoding_chunked_gets_502() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/te10" => {
            Reply::new("HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        }
        other => Reply::ok(other),
    })
    .await;
    let resp = wire.get("/te10").await;
    assert_eq!(resp.status, 502, "{}{}", resp.head, resp.text());
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

#[tokio::test]
async fn transfer_encoding_not_ending_in_chunked_is_read_to_the_close() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/gzip" => Reply::new(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, identity\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        )
        .closing(),
        other => Reply::ok(other),
    })
    .await;
    let resp = wire.get("/gzip").await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    // Not chunked for tollgate (its last coding is not `chunked`):
    // everything until the close is the body.
    assert_eq!(resp.text(), "2\r\nok\r\n0\r\n\r\n");
    assert_eq!(wire.get("/after").await.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

// 7. Chunked bodies.

#[tokio::test]
async fn chunked_response_with_extensions_upper_case_sizes_and_a_trailer_arrives_whole() {
    let (upstream, _proxy, mut wire) = connected(|_| {
        Reply::new(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n\
             A;name=value\r\n0123456789\r\n1B ; q=\"quoted;\"\r\nabcdefghijklmnopqrstuvwxyz!\r\n\
             0;last\r\nX-Checksum: abc123\r\n\r\n",
        )
    })
    .await;
    let expected = "0123456789abcdefghijklmnopqrstuvwxyz!";

    // Without `TE: trailers`, as pinned in tests/it/h1_wire.rs: the trailer is dropped.
    let plain = wire.get("/chunked").await;
    assert_eq!(plain.status, 200, "{}", plain.head);
    assert_eq!(plain.text(), expected);
    assert!(plain.trailers.is_empty(), "{:?}", plain.trailers);
    assert_eq!(plain.header("trailer"), None, "{}", plain.head);

    // With it, the announcement and the trailer arrive.
    wire.send("GET /chunked HTTP/1.1\r\nHost: direct.test\r\nTE: trailers\r\n\r\n")
        .await;
    let with_te = wire.response().await;
    assert_eq!(with_te.status, 200, "{}", with_te.head);
    assert_eq!(with_te.text(), expected);
    assert_eq!(with_te.header("trailer"), Some("X-Checksum"));
    assert_eq!(
        with_te.trailers,
        [("x-checksum".to_string(), "abc123".to_string())]
    );
    wire.assert_open(Duration::from_millis(100), "after two chunked answers")
        .await;
    // The body was read to its end, trailer included: the connection was used again.
    assert_eq!(upstream.conns(), [0, 0]);
}

#[tokio::test]
async fn chunked_response_split_into_one_byte_writes_arrives_whole() {
    let (upstream, _proxy, mut wire) = connected(|_| {
        let mut reply = Reply::new(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n\
             3;a=b\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\n",
        );
        reply.piece = 1;
        reply.gap = Duration::from_millis(1);
        reply
    })
    .await;
    for _ in 0..2 {
        wire.send("GET /slow HTTP/1.1\r\nHost: direct.test\r\nTE: trailers\r\n\r\n")
            .await;
        let resp = wire.response().await;
        assert_eq!(resp.text(), "abcde");
        assert_eq!(resp.trailers, [("x-t".to_string(), "1".to_string())]);
    }
    assert_eq!(upstream.conns(), [0, 0]);
}

/// Sends a GET for `path` on a new connection and returns the whole response, or None when
/// the connection closed before one had arrived (what was read is in the panic message of the
/// caller).
async fn whole_response(proxy: &Proxy, path: &str) -> (Option<Resp>, Vec<u8>) {
    let mut wire = Wire::connect(proxy.addr).await;
    wire.send(get_req(path)).await;
    loop {
        if let Some((resp, _)) = parse_response(&wire.buf, false, wire.eof) {
            return (Some(resp), Vec::new());
        }
        if wire.eof {
            return (None, std::mem::take(&mut wire.buf));
        }
        wire.more().await;
    }
}

/// hyper's chunked decoder reads any number of leading zeros in a chunk size (it only checks
/// the value for overflow).
#[tokio::test]
async fn chunk_size_with_seventeen_digits_of_leading_zeros_is_read_as_hyper_reads_it() {
    let upstream = RawUpstream::start(|_| {
        Reply::new(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
             00000000000000002\r\nok\r\n0\r\n\r\n",
        )
    })
    .await;
    let proxy = proxy_for(&upstream).await;
    let (resp, read) = whole_response(&proxy, "/zeros").await;
    let resp = resp.unwrap_or_else(|| panic!("body cut; the client read {:?}", lossy(&read)));
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "ok");
}

/// hyper's chunked decoder allows 16 KiB of chunk extensions (`CHUNKED_EXTENSIONS_LIMIT`),
/// however they arrive; here a 5,000-byte extension comes in pieces of 1,000 bytes.
#[tokio::test]
async fn chunk_extension_of_5000_bytes_arriving_in_pieces_is_read_as_hyper_reads_it() {
    let upstream = RawUpstream::start(|_| {
        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut reply = Reply::new(format!("{head}2;x={}\r\nok\r\n0\r\n\r\n", "e".repeat(5000)));
        reply.piece = 1000;
        reply.gap = Duration::from_millis(5);
        reply
    })
    .await;
    let proxy = proxy_for(&upstream).await;
    let (resp, read) = whole_response(&proxy, "/long-extension").await;
    let resp = resp.unwrap_or_else(|| panic!("body cut; the client read {:?}", lossy(&read)));
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "ok");
}

/// hyper refuses a `Content-Length` above its largest length (`u64::MAX - 2`, `MAX_LEN`):
/// `DecodedLength::checked_new` fails, 502.
#[tokio::test]
async fn content_length_of_u64_max_gets_502() {
    let (_upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/max" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551615\r\n\r\nabc")
            .closing(),
        other => Reply::ok(other),
    })
    .await;
    wire.send(get_req("/max")).await;
    let deadline = Instant::now() + WAIT;
    while find(&wire.buf, b"\r\n\r\n").is_none() && !wire.eof && Instant::now() < deadline {
        wire.more().await;
    }
    assert!(
        wire.buf.starts_with(b"HTTP/1.1 502 "),
        "the client read {:?}",
        lossy(&wire.buf)
    );
}

/// A `101` to a request that asked for no upgrade: 502, and the connection is not used again.
#[tokio::test]
async fn switching_protocols_to_a_plain_get_gets_502_and_the_connection_is_not_reused() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/switch" => Reply::new(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        ),
        other => Reply::ok(other),
    })
    .await;
    let resp = wire.get("/switch").await;
    assert_eq!(resp.status, 502, "{}", resp.head);
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

#[tokio::test]
async fn one_mebibyte_bodies_by_length_and_chunked_arrive_byte_exact_and_the_connection_is_reused()
{
    const SIZE: usize = 1024 * 1024;
    let (upstream, _proxy, mut wire) = connected(|seen| {
        let data: Vec<u8> = (0..SIZE).map(pattern_byte).collect();
        let mut bytes = Vec::new();
        match seen.target.as_str() {
            "/length" => {
                bytes.extend_from_slice(
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {SIZE}\r\n\r\n").as_bytes(),
                );
                bytes.extend_from_slice(&data);
            }
            _ => {
                bytes.extend_from_slice(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
                // Chunks of assorted sizes, some larger than any read.
                let mut at = 0;
                for size in [1, 4095, 8192, 70_000, 3].iter().cycle() {
                    if at == SIZE {
                        break;
                    }
                    let size = (*size).min(SIZE - at);
                    bytes.extend_from_slice(format!("{size:X}\r\n").as_bytes());
                    bytes.extend_from_slice(&data[at..at + size]);
                    bytes.extend_from_slice(b"\r\n");
                    at += size;
                }
                bytes.extend_from_slice(b"0\r\n\r\n");
            }
        }
        let mut reply = Reply::new(bytes);
        reply.piece = 60_000;
        reply
    })
    .await;
    for path in ["/length", "/chunked", "/length", "/chunked"] {
        let resp = wire.get(path).await;
        assert_eq!(resp.status, 200, "{path}: {}", resp.head);
        assert_eq!(resp.body.len(), SIZE, "{path}");
        let wrong = resp
            .body
            .iter()
            .enumerate()
            .position(|(i, &b)| b != pattern_byte(i));
        assert_eq!(wrong, None, "{path}: first wrong byte");
    }
    assert_eq!(upstream.conns(), [0, 0, 0, 0]);
}

#[tokio::test]
async fn client_leaving_mid_body_closes_the_upstream_connection_and_the_next_get_uses_a_new_one() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/big" => {
            let mut bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\n\r\n".to_vec();
            bytes.resize(bytes.len() + 10_000_000, b'x');
            let mut reply = Reply::new(bytes);
            reply.piece = 100_000;
            reply.gap = Duration::from_millis(5);
            reply
        }
        other => Reply::ok(other),
    })
    .await;
    wire.send(get_req("/big")).await;
    while find(&wire.buf, b"\r\n\r\n").is_none() {
        assert!(!wire.eof, "closed before the head: {:?}", lossy(&wire.buf));
        wire.more().await;
    }
    drop(wire);
    until_eq(
        "open upstream connections after the client left",
        0,
        Duration::from_secs(3),
        || upstream.open(),
    )
    .await;
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

// 8. A malformed chunk.

#[tokio::test]
async fn invalid_chunk_size_cuts_the_response_and_the_upstream_connection_is_not_reused() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        // The connection stays open: a reuse would show.
        "/bad" => Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
        other => Reply::ok(other),
    })
    .await;
    wire.send(get_req("/bad")).await;
    let read = wire.until_closed("after an invalid chunk size").await;
    assert_cut(&read, "invalid chunk size", "");

    let mut wire = Wire::connect(proxy.addr).await;
    let resp = wire.get("/after").await;
    assert_eq!(resp.status, 200, "{}{}", resp.head, resp.text());
    assert_eq!(resp.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

#[tokio::test]
async fn chunk_data_not_followed_by_crlf_cuts_the_response() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/bad" => {
            Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n")
        }
        other => Reply::ok(other),
    })
    .await;
    wire.send(get_req("/bad")).await;
    let read = wire.until_closed("after chunk data without CRLF").await;
    assert_cut(&read, "chunk data without CRLF", "2\r\nok\r\n");
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

// 9. The upstream closes mid-body.

#[tokio::test]
async fn upstream_closing_mid_body_cuts_the_response_and_the_next_get_uses_a_new_connection() {
    let (upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/cut" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789").closing(),
        other => Reply::ok(other),
    })
    .await;
    assert_eq!(wire.get("/first").await.text(), "/first");
    wire.send(get_req("/cut")).await;
    let read = wire.until_closed("after a body cut by the upstream").await;
    assert_cut(&read, "body cut by the upstream", "0123456789");

    let mut wire = Wire::connect(proxy.addr).await;
    let resp = wire.get("/after").await;
    assert_eq!(resp.status, 200, "{}{}", resp.head, resp.text());
    assert_eq!(upstream.conns(), [0, 0, 1]);
}

#[tokio::test]
async fn upstream_closing_mid_chunked_body_cuts_the_response() {
    let (_upstream, proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/cut" => {
            Reply::new("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123").closing()
        }
        other => Reply::ok(other),
    })
    .await;
    wire.send(get_req("/cut")).await;
    let read = wire
        .until_closed("after a chunked body cut by the upstream")
        .await;
    assert_cut(&read, "chunked body cut by the upstream", "4\r\n0123\r\n");
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.status, 200);
}

#[tokio::test]
async fn close_delimited_body_ends_at_the_close_and_the_next_get_uses_a_new_connection() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/eof" => Reply::new("HTTP/1.1 200 OK\r\nX-Kind: eof\r\n\r\nuntil the close").closing(),
        other => Reply::ok(other),
    })
    .await;
    let resp = wire.get("/eof").await;
    assert_eq!(resp.text(), "until the close");
    assert_eq!(wire.get("/after").await.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

// 10. HEAD.

#[tokio::test]
async fn head_response_with_a_content_length_has_no_body_and_the_connection_is_reused() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.method.as_str() {
        "HEAD" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
        _ => Reply::ok(&seen.target),
    })
    .await;
    wire.send("HEAD /head HTTP/1.1\r\nHost: direct.test\r\n\r\n")
        .await;
    let head = wire.head_response().await;
    assert_eq!(head.status, 200, "{}", head.head);
    assert_eq!(head.header("content-length"), Some("5"), "{}", head.head);
    let resp = wire.get("/after").await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "/after");
    assert_eq!(upstream.conns(), [0, 0]);
}

/// hyper's `Client::decoder` answers HEAD (no body) before it looks at the framing fields, so
/// framing a GET response could not have (conflicting lengths, chunked on HTTP/1.0) does not
/// make a HEAD response an error.
#[tokio::test]
async fn head_response_with_framing_hyper_ignores_for_head_is_not_an_error() {
    let upstream = RawUpstream::start(|seen| match seen.target.as_str() {
        "/differ" => {
            Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n")
        }
        "/te10" => Reply::new(
            "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n",
        ),
        other => Reply::ok(other),
    })
    .await;
    let proxy = proxy_for(&upstream).await;
    let mut statuses = Vec::new();
    for path in ["/differ", "/te10"] {
        let mut wire = Wire::connect(proxy.addr).await;
        wire.send(format!("HEAD {path} HTTP/1.1\r\nHost: direct.test\r\n\r\n"))
            .await;
        let resp = wire.head_response().await;
        statuses.push((path, resp.status));
    }
    assert_eq!(statuses, [("/differ", 200), ("/te10", 200)]);
}

// 11. 204 and 304.

#[tokio::test]
async fn no_content_and_not_modified_without_a_body_are_followed_by_a_reused_connection() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/204" => Reply::new("HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n"),
        "/304" => Reply::new("HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\n\r\n"),
        // Lengths these statuses cannot have a body for: none is read.
        "/204-length" => Reply::new("HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
        "/304-length" => Reply::new("HTTP/1.1 304 Not Modified\r\nContent-Length: 11\r\n\r\n"),
        other => Reply::ok(other),
    })
    .await;
    for (path, status) in [
        ("/204", 204),
        ("/304", 304),
        ("/204-length", 204),
        ("/304-length", 304),
    ] {
        let resp = wire.get(path).await;
        assert_eq!(resp.status, status, "{path}: {}", resp.head);
        let resp = wire.get("/after").await;
        assert_eq!(resp.status, 200, "after {path}: {}", resp.head);
        assert_eq!(resp.text(), "/after");
    }
    wire.assert_open(Duration::from_millis(100), "after 204 and 304")
        .await;
    assert_eq!(upstream.conns(), [0; 8]);
}

// 12. Bytes after a complete response.

#[tokio::test]
async fn extra_bytes_after_a_complete_response_keep_the_connection_from_being_reused() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/dirty" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE"),
        "/dirty-chunked" => Reply::new(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nGARBAGE",
        ),
        other => Reply::ok(other),
    })
    .await;
    for path in ["/dirty", "/dirty-chunked"] {
        let resp = wire.get(path).await;
        assert_eq!(resp.status, 200, "{path}: {}", resp.head);
        assert_eq!(resp.text(), "ok", "{path}");
        let resp = wire.get("/after").await;
        assert_eq!(resp.status, 200, "{}{}", resp.head, resp.text());
        assert_eq!(resp.text(), "/after");
    }
    assert_eq!(upstream.conns(), [0, 1, 1, 2]);
}

#[tokio::test]
async fn bytes_arriving_on_an_idle_connection_keep_it_from_being_reused() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/late" => Reply {
            late: Some((Duration::from_millis(30), b"HTTP/1.1 200 OK\r\n".to_vec())),
            ..Reply::ok("ok")
        },
        other => Reply::ok(other),
    })
    .await;
    assert_eq!(wire.get("/late").await.text(), "ok");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resp = wire.get("/after").await;
    assert_eq!(resp.status, 200, "{}{}", resp.head, resp.text());
    assert_eq!(resp.text(), "/after");
    assert_eq!(upstream.conns(), [0, 1]);
}

// 13. Failover.

#[tokio::test]
async fn a_refused_origin_fails_over_to_the_next_one() {
    let refused = RefusedPort::new();
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_with(&[refused.addr, upstream.addr], "fail_timeout = \"1s\"").await;
    let mut wire = Wire::connect(proxy.addr).await;
    for i in 0..4 {
        wire.get_echoed(&format!("/f/{i}")).await;
    }
    assert_eq!(upstream.conns(), [0, 0, 0, 0]);
}

#[tokio::test]
async fn with_every_origin_refused_the_answer_is_502() {
    let refused = [RefusedPort::new(), RefusedPort::new()];
    let addrs = [refused[0].addr, refused[1].addr];
    let proxy = proxy_with(&addrs, "").await;
    let mut wire = Wire::connect(proxy.addr).await;
    let resp = wire.get("/none").await;
    assert_eq!(resp.status, 502, "{}", resp.head);
}

// 14. A request with a body.

#[tokio::test]
async fn post_with_a_body_is_forwarded_with_it_and_a_get_after_it_works() {
    let (upstream, proxy, mut wire) = connected(|seen| {
        Reply::ok(&format!(
            "{} {} {}",
            seen.method,
            seen.target,
            lossy(&seen.body)
        ))
    })
    .await;
    wire.send(
        "POST /post HTTP/1.1\r\nHost: direct.test\r\nContent-Length: 11\r\n\
         Content-Type: text/plain\r\n\r\nhello world",
    )
    .await;
    let resp = wire.response().await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "POST /post hello world");
    let resp = wire.get("/get").await;
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.text(), "GET /get ");
    let seen = upstream.seen();
    assert_eq!(seen[0].body, b"hello world");
    assert!(
        seen[0]
            .head
            .to_ascii_lowercase()
            .contains("content-type: text/plain"),
        "{}",
        seen[0].head
    );
    // A new client connection's GET still works beside them.
    let mut other = Wire::connect(proxy.addr).await;
    assert_eq!(other.get("/get2").await.text(), "GET /get2 ");
}

// 15. Reason phrases.

#[tokio::test]
async fn reason_phrases_are_passed_on_as_the_upstream_wrote_them() {
    let (upstream, _proxy, mut wire) = connected(|seen| match seen.target.as_str() {
        "/fine" => Reply::new("HTTP/1.1 200 Fine\r\nContent-Length: 2\r\n\r\nok"),
        "/empty" => Reply::new("HTTP/1.1 299 \r\nContent-Length: 2\r\n\r\nok"),
        "/canonical" => Reply::new("HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno"),
        "/other" => Reply::new("HTTP/1.1 404 Nope\r\nContent-Length: 2\r\n\r\nno"),
        other => Reply::ok(other),
    })
    .await;
    let mut lines = Vec::new();
    for path in ["/fine", "/empty", "/canonical", "/other"] {
        let resp = wire.get(path).await;
        lines.push(resp.status_line().to_string());
    }
    assert_eq!(
        lines,
        [
            "HTTP/1.1 200 Fine",
            // hyper keeps an empty reason (it is not the canonical one): the line ends
            // after the status code's space.
            "HTTP/1.1 299 ",
            "HTTP/1.1 404 Not Found",
            "HTTP/1.1 404 Nope",
        ]
    );
    assert_eq!(upstream.conns(), [0, 0, 0, 0]);
}

/// httparse gives an empty reason phrase that is not part of the head when the status line
/// has no space after the code, and when the reason has obs-text bytes; hyper keeps it as an
/// empty, non-canonical reason.
#[tokio::test]
async fn status_lines_without_a_reason_or_with_obs_text_get_an_empty_reason() {
    let upstream = RawUpstream::start(|seen| match seen.target.as_str() {
        "/no-space" => Reply::new("HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok"),
        "/no-space-404" => Reply::new("HTTP/1.1 404\r\nContent-Length: 2\r\n\r\nno"),
        "/obs-text" => Reply::new(b"HTTP/1.1 200 X\xFFZ\r\nContent-Length: 2\r\n\r\nok".to_vec()),
        other => Reply::ok(other),
    })
    .await;
    let proxy = proxy_for(&upstream).await;
    let mut lines = Vec::new();
    for path in ["/no-space", "/no-space-404", "/obs-text"] {
        let (resp, read) = whole_response(&proxy, path).await;
        lines.push(match resp {
            Some(resp) => format!("{} {:?}", resp.status_line(), resp.text()),
            None => format!("closed after {:?}", lossy(&read)),
        });
    }
    assert_eq!(
        lines,
        [
            "HTTP/1.1 200  \"ok\"",
            "HTTP/1.1 404  \"no\"",
            "HTTP/1.1 200  \"ok\"",
        ]
    );
    // tollgate still serves.
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.text(), "/after");
}

// Timeouts and the request on the wire.

#[tokio::test]
async fn response_timeout_gets_504_and_the_connection_is_not_reused() {
    let upstream = RawUpstream::start(|seen| match seen.target.as_str() {
        "/slow" => Reply::ok("late").delayed(Duration::from_millis(1500)),
        other => Reply::ok(other),
    })
    .await;
    let proxy = proxy_with(&[upstream.addr], "response_timeout = \"300ms\"").await;
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/first").await.text(), "/first");
    let resp = wire.get("/slow").await;
    assert_eq!(resp.status, 504, "{}", resp.head);
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/after").await.text(), "/after");
    // The late answer must not be taken for the next request's.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut wire = Wire::connect(proxy.addr).await;
    assert_eq!(wire.get("/later").await.text(), "/later");
    assert_eq!(upstream.conns(), [0, 0, 1, 1]);
}

#[tokio::test]
async fn the_request_head_on_the_upstream_wire_is_the_one_hyper_wrote() {
    let (upstream, _proxy, mut wire) = connected(echo_target).await;
    wire.send(
        "GET /order?q=1&r=%20 HTTP/1.1\r\nHost: direct.test\r\nUser-Agent: wire/1\r\n\
         Accept: */*\r\nConnection: keep-alive\r\nCookie: a=1\r\nCookie: b=2\r\n\
         X-Custom-In: kept\r\nX-Empty:\r\n\r\n",
    )
    .await;
    let resp = wire.response().await;
    assert_eq!(resp.text(), "/order?q=1&r=%20");
    let seen = upstream.seen().pop().expect("a request");
    let id = resp.header("x-request-id").expect("an id");
    assert_eq!(
        seen.head.replace(id, "<id>"),
        // As hyper's client wrote it (the field map's order, names lowercase: removing
        // `Connection` moved the last field into its place), then what tollgate adds, in the
        // order it is put into the map for hyper's clients (`headers::Added`).
        "GET /order?q=1&r=%20 HTTP/1.1\r\nhost: direct.test\r\nuser-agent: wire/1\r\n\
         accept: */*\r\nx-empty: \r\ncookie: a=1\r\ncookie: b=2\r\n\
         x-custom-in: kept\r\nx-request-id: <id>\r\nx-forwarded-for: 127.0.0.1\r\n\
         x-forwarded-proto: http\r\nx-forwarded-host: direct.test\r\nx-real-ip: 127.0.0.1\r\n\r\n"
    );
}

/// What tollgate adds to a request that carried none of those fields is written behind its own
/// (`headers::Added`); a client's own copy of any one of them sends the request the other way,
/// through the map, where it is replaced (`X-Forwarded-For`: kept in front of the peer, as
/// nginx's `$proxy_add_x_forwarded_for`). Each sent alone by an untrusted client: the upstream
/// gets one field of each name, tollgate's, and no `Forwarded`.
#[tokio::test]
async fn a_clients_own_forwarding_field_is_replaced_not_sent_beside_ours() {
    let (upstream, _proxy, mut wire) = connected(echo_target).await;
    let sent = [
        ("X-Forwarded-For", "6.6.6.6"),
        ("X-Forwarded-Proto", "gopher"),
        ("X-Forwarded-Host", "evil.test"),
        ("X-Real-IP", "6.6.6.6"),
        ("X-Request-Id", "chosen-by-client"),
        ("Forwarded", "for=6.6.6.6"),
    ];
    for (name, value) in sent {
        let resp = wire
            .exchange(format!(
                "GET /f HTTP/1.1\r\nHost: direct.test\r\n{name}: {value}\r\n\r\n"
            ))
            .await;
        assert_eq!(resp.status, 200, "{name}: {}", resp.head);
        let id = resp.header("x-request-id").expect("an id").to_string();
        let seen = upstream.seen().pop().expect("a request");
        let values = |field: &str| -> Vec<String> {
            let lines = seen.head.split("\r\n").skip(1);
            let lines = lines.filter_map(|line| line.split_once(": "));
            let lines = lines.filter(|(n, _)| n.eq_ignore_ascii_case(field));
            lines.map(|(_, v)| v.to_string()).collect()
        };
        let for_value = if name == "X-Forwarded-For" {
            "6.6.6.6, 127.0.0.1"
        } else {
            "127.0.0.1"
        };
        assert_eq!(
            values("x-forwarded-for"),
            [for_value],
            "{name}: {:?}",
            seen.head
        );
        assert_eq!(values("x-forwarded-proto"), ["http"], "{name}");
        assert_eq!(values("x-forwarded-host"), ["direct.test"], "{name}");
        assert_eq!(values("x-real-ip"), ["127.0.0.1"], "{name}");
        assert_eq!(values("x-request-id"), [id], "{name}");
        assert_ne!(values("x-request-id"), ["chosen-by-client"], "{name}");
        assert!(values("forwarded").is_empty(), "{name}: {:?}", seen.head);
    }
}

// 16. max_idle_connections.

#[tokio::test]
async fn with_max_idle_connections_1_only_one_idle_upstream_connection_remains() {
    let upstream =
        RawUpstream::start(|seen| Reply::ok(&seen.target).delayed(Duration::from_millis(200)))
            .await;
    let proxy = proxy_with(&[upstream.addr], "max_idle_connections = 1").await;
    let mut clients = Vec::new();
    for i in 0..3 {
        let addr = proxy.addr;
        clients.push(tokio::spawn(async move {
            let mut wire = Wire::connect(addr).await;
            let resp = wire.get(&format!("/c/{i}")).await;
            assert_eq!(resp.status, 200, "{}", resp.head);
            wire
        }));
    }
    let mut wires = Vec::new();
    for client in clients {
        wires.push(client.await.expect("client task"));
    }
    assert_eq!(
        upstream.accepted(),
        3,
        "three concurrent requests, three connections"
    );
    let done = Instant::now();
    until_eq(
        "open upstream connections",
        1,
        Duration::from_millis(2500),
        || upstream.open(),
    )
    .await;
    let took = done.elapsed();
    // The one kept stays, and is the one used next.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(upstream.open(), 1, "after {took:?} and 1.2 s more");
    let resp = wires[0].get("/next").await;
    assert_eq!(resp.status, 200);
    assert_eq!(upstream.accepted(), 3);
}

// 17. HTTP/2 requests without a body.

/// An HTTP/2 GET whose HEADERS frame ends the stream has no body: it goes on the same client
/// as the simple path's GETs, over the same idle connection of the worker's lane, where hyper's
/// client would open a connection of its own. An HTTP/1.1 GET that hyper's server read (it came
/// behind an empty line, which the simple path hands over) still goes on hyper's client: a new
/// connection. Each head carries one `host` field, which HTTP/1.1 requires and HTTP/2 sends as
/// `:authority`.
#[tokio::test]
async fn an_http2_get_goes_on_the_simple_paths_upstream_connection() {
    let (upstream, proxy, mut wire) = connected(echo_target).await;
    wire.get_echoed("/h1-simple").await;

    let answer = h2_get(proxy.addr, "/h2").await;
    assert_eq!(answer.version, http::Version::HTTP_2);
    assert_eq!(answer.status, 200);
    assert_eq!(&answer.body[..], b"/h2");
    assert_eq!(
        upstream.conns(),
        [0, 0],
        "the HTTP/2 GET took the idle connection"
    );

    let mut handed_over = Wire::connect(proxy.addr).await;
    let resp = handed_over
        .exchange("\r\nGET /h1-hyper HTTP/1.1\r\nHost: direct.test\r\n\r\n")
        .await;
    assert_eq!(resp.status, 200, "{}{}", resp.head, resp.text());
    assert_eq!(resp.text(), "/h1-hyper");
    assert_eq!(
        upstream.conns(),
        [0, 0, 1],
        "hyper's client has its own connection"
    );
    for seen in upstream.seen() {
        let head = seen.head.to_ascii_lowercase();
        let hosts = head.lines().filter(|l| l.starts_with("host:")).count();
        assert_eq!(hosts, 1, "{}", seen.head);
    }
}

/// An HTTP/2 GET whose response body the upstream cuts: the client gets the head, then a
/// reset instead of the body's end; the next GET goes on a new upstream connection.
#[tokio::test]
async fn an_http2_get_whose_body_the_upstream_cuts_gets_its_head_then_a_reset() {
    use http_body_util::BodyExt;
    let (upstream, proxy, _wire) = connected(|seen| match seen.target.as_str() {
        "/cut" => Reply::new("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789").closing(),
        other => Reply::ok(other),
    })
    .await;
    let client = crate::common::h2c_client();
    let response = client
        .request(h2_request(proxy.addr, "/cut"))
        .await
        .expect("the head arrives");
    assert_eq!(response.status(), 200);
    let body = tokio::time::timeout(WAIT, response.into_body().collect()).await;
    assert!(
        matches!(body, Ok(Err(_))),
        "the body ended without an error"
    );
    let answer = h2_get(proxy.addr, "/after").await;
    assert_eq!(answer.status, 200);
    assert_eq!(&answer.body[..], b"/after");
    assert_eq!(upstream.accepted(), 2);
}

/// An HTTP/2 (prior knowledge) GET for `path`, without a body.
fn h2_request(proxy: SocketAddr, path: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    http::Request::get(format!("http://{proxy}{path}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("request")
}

/// [`h2_request`]'s answer, on a new HTTP/2 connection.
async fn h2_get(proxy: SocketAddr, path: &str) -> crate::common::Answer {
    crate::common::send(&crate::common::h2c_client(), h2_request(proxy, path)).await
}
