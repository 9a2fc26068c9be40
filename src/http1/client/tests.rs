//! The own client's unit tests.

use http::header::HeaderValue;

use super::chunked::{chunk_step, Chunked};
use super::compare::WentAs;
use super::head::parse_head;
use super::*;
use crate::headers;
use crate::http1::rules::{HYPER_MAX_CHUNK_LINE, HYPER_MAX_FIELDS};

/// `text` read as a response head, its fields going where `answer` says.
fn read_text(text: &str, head_only: bool, answer: &mut Answer<'_>) -> Result<Option<Head>, String> {
    let mut buf = BytesMut::from(text.as_bytes());
    parse_head(&mut buf, &mut Vec::new(), head_only, answer).map_err(|e| e.to_string())
}

/// `text` read as a response head into a map.
fn read_into_map(text: &str, head_only: bool) -> Result<Option<Head>, String> {
    read_text(text, head_only, &mut Answer::Map { room: 0 })
}

/// The parse of `text` as a response head: its framing and keep-alive, or the error.
fn parsed(text: &str, head_only: bool) -> Result<Option<(u16, Framing, bool)>, String> {
    let head = read_into_map(text, head_only)?;
    Ok(head.map(|head| match head {
        Head::Informational => (100, Framing::Done, false),
        Head::Response {
            response,
            framing,
            keep_alive,
        } => (response.status().as_u16(), framing, keep_alive),
    }))
}

/// The response head `text` read for tollgate's own server path: the lines, the length
/// and `Date` they give the encoder, and how many fields went into the map instead.
fn read_as_lines(
    text: &str,
    head_only: bool,
    keep_trailer: bool,
) -> (String, Option<u64>, bool, usize) {
    let mut lines = ResponseLines::default();
    lines.bytes.extend_from_slice(b"before: 1\r\n");
    let mut answer = Answer::Lines {
        lines: &mut lines,
        keep_trailer,
    };
    let head = read_text(text, head_only, &mut answer);
    let Ok(Some(Head::Response { response, .. })) = head else {
        panic!("no response in {text:?}");
    };
    let text = String::from_utf8_lossy(&lines.bytes).into_owned();
    (text, lines.length, lines.date, response.headers().len())
}

#[test]
fn an_upstreams_fields_go_on_as_lines_as_the_map_would_carry_them() {
    let read = |text: &str, head_only| read_as_lines(text, head_only, false);
    // Lower-case names, the upstream's order, hop-by-hop fields out, values untouched.
    let (lines, length, date, in_map) = read(
        "HTTP/1.1 200 OK\r\nX-A: One Two\r\nKeep-Alive: timeout=5\r\nSet-Cookie: a\r\n\
         Connection: keep-alive\r\nDate: Mon\r\nUpgrade: h2c\r\nSet-Cookie: b\r\n\
         Content-Length: 5\r\nTrailer: x\r\n\r\n",
        false,
    );
    assert_eq!(
        lines,
        "before: 1\r\nx-a: One Two\r\nset-cookie: a\r\ndate: Mon\r\nset-cookie: b\r\n\
         content-length: 5\r\n"
    );
    assert_eq!((length, date, in_map), (Some(5), true, 0));
    // Of several equal lengths, one; none beside a transfer coding, or for an empty body
    // (the encoder writes its own `0`); one in an answer to HEAD too.
    let (lines, length, ..) = read(
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-B: 1\r\ncontent-length: 2\r\n\r\n",
        false,
    );
    assert_eq!(lines, "before: 1\r\ncontent-length: 2\r\nx-b: 1\r\n");
    assert_eq!(length, Some(2));
    let (lines, length, ..) = read(
        "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\nX-C: 1\r\n\r\n",
        false,
    );
    assert_eq!((lines.as_str(), length), ("before: 1\r\nx-c: 1\r\n", None));
    let (lines, length, ..) = read("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", false);
    assert_eq!((lines.as_str(), length), ("before: 1\r\n", None));
    let (lines, length, ..) = read(
        "HTTP/1.1 200 OK\r\nContent-Length: 7\r\nContent-Length: 7\r\n\r\n",
        true,
    );
    assert_eq!(
        (lines.as_str(), length),
        ("before: 1\r\ncontent-length: 7\r\n", None)
    );
    // A client that takes trailers gets the announcement: through the map.
    let (lines, _, _, in_map) = read_as_lines(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x\r\n\r\n",
        false,
        true,
    );
    assert_eq!((lines.as_str(), in_map), ("before: 1\r\n", 2));
}

/// Every head of up to three fields from a set of the ones the lines treat apart, in
/// answers of several statuses, to GET and to HEAD: read as lines, a head gives the
/// encoder what the map and the forwarder would have given it, or goes through the map.
#[test]
fn lines_give_the_encoder_what_the_map_would_for_every_small_head() {
    let pool = [
        "Content-Length: 2",
        "content-length: 2",
        "Content-Length: 0",
        "Content-Length: 3",
        "Content-Length: x",
        "Transfer-Encoding: chunked",
        "Transfer-Encoding: gzip",
        "TE: trailers",
        "Trailer: x-t",
        "Connection: keep-alive",
        "Connection: Close",
        "Connection: x-a",
        "Keep-Alive: timeout=5",
        "Proxy-Connection: keep-alive",
        "Upgrade: h2c",
        "X-A: 1",
        "Date: Mon",
        "Set-Cookie: c=1",
        "X-Request-Id: up",
    ];
    let mut picks: Vec<Vec<&str>> = vec![vec![]];
    for _ in 0..3 {
        let longer: Vec<Vec<&str>> = picks
            .iter()
            .filter(|p| p.len() == picks.last().map_or(0, Vec::len))
            .flat_map(|p| pool.iter().map(move |f| [p.clone(), vec![*f]].concat()))
            .collect();
        picks.extend(longer);
    }
    let (mut as_lines, mut in_map) = (0, 0);
    for fields in &picks {
        for status in [
            "200 OK",
            "204 No Content",
            "304 Not Modified",
            "404 Not Found",
        ] {
            for version in ["HTTP/1.1", "HTTP/1.0"] {
                for head_only in [false, true] {
                    let mut text = format!("{version} {status}\r\n");
                    for field in fields {
                        text.push_str(field);
                        text.push_str("\r\n");
                    }
                    text.push_str("\r\n");
                    match lines_against_the_map(text.as_bytes(), head_only) {
                        Ok(WentAs::Lines) => as_lines += 1,
                        Ok(WentAs::Map) => in_map += 1,
                        Ok(WentAs::Refused | WentAs::NoResponse) => {}
                        Err(disagreement) => panic!("{text:?}: {disagreement}"),
                    }
                }
            }
        }
    }
    // Both ways were taken, many times each.
    assert!(as_lines > 10_000 && in_map > 10_000, "{as_lines} {in_map}");
}

#[test]
fn heads_the_lines_cannot_carry_go_through_the_map_and_leave_the_lines_alone() {
    for head in [
        // A field tollgate sets itself, which it may have to replace.
        "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-Request-Id: up\r\nContent-Length: 0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nRateLimit: up\r\nContent-Length: 0\r\n\r\n",
        // A `Connection` that names other fields.
        "HTTP/1.1 200 OK\r\nX-A: 1\r\nConnection: x-a, keep-alive\r\nContent-Length: 0\r\n\r\n",
        // `TE`, which the forwarder puts back as `TE: trailers`.
        "HTTP/1.1 200 OK\r\nTE: trailers\r\nContent-Length: 0\r\n\r\n",
    ] {
        let (lines, length, date, in_map) = read_as_lines(head, false, false);
        assert_eq!(lines, "before: 1\r\n", "{head}");
        assert_eq!((length, date), (None, false), "{head}");
        assert!(in_map > 0, "{head}");
    }
    // A 101 too (the forwarder refuses it).
    let (lines, .., in_map) = read_as_lines(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
        false,
        false,
    );
    assert_eq!((lines.as_str(), in_map), ("before: 1\r\n", 1));
    // A head whose framing is an error leaves nothing either.
    let mut lines = ResponseLines::default();
    let mut answer = Answer::Lines {
        lines: &mut lines,
        keep_trailer: false,
    };
    let text = "HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: x\r\n\r\n";
    assert!(read_text(text, false, &mut answer).is_err());
    assert!(lines.bytes.is_empty());
}

fn framing(text: &str) -> String {
    match parsed(text, false) {
        Ok(Some((_, Framing::Length(n), _))) => format!("length {n}"),
        Ok(Some((_, Framing::Chunked(_), _))) => "chunked".into(),
        Ok(Some((_, Framing::UntilClose, _))) => "until close".into(),
        Ok(Some((_, Framing::Done, _))) => "informational".into(),
        Ok(Some((_, Framing::Failed(_), _))) => "failed".into(),
        Ok(None) => "partial".into(),
        Err(_) => "error".into(),
    }
}

#[test]
fn response_bodies_are_framed_as_hyper_frames_them() {
    let cases = [
        ("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", "length 5"),
        (
            "HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n",
            "length 5",
        ),
        (
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
            "length 5",
        ),
        (
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "error",
        ),
        ("HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "error"),
        (
            "HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551613\r\n\r\n",
            "length 18446744073709551613",
        ),
        (
            "HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551614\r\n\r\n",
            "error",
        ),
        (
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "chunked",
        ),
        (
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "chunked",
        ),
        (
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            "until close",
        ),
        // hyper reads a value that is not visible ASCII as naming no coding.
        (
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: \u{e9}, chunked\r\n\r\n",
            "until close",
        ),
        (
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "error",
        ),
        ("HTTP/1.1 200 OK\r\n\r\n", "until close"),
        (
            "HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n",
            "length 0",
        ),
        ("HTTP/1.1 304 Not Modified\r\n\r\n", "length 0"),
        ("HTTP/1.1 100 Continue\r\n\r\n", "informational"),
        (
            "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
            "informational",
        ),
        ("HTTP/1.1 101 Switching Protocols\r\n\r\n", "length 0"),
        ("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n", "partial"),
        ("HTTP/1.1 200 OK\r\nBad Field: x\r\n\r\n", "error"),
    ];
    for (text, expected) in cases {
        assert_eq!(framing(text), expected, "{text:?}");
    }
    let many: String = (0..=HYPER_MAX_FIELDS)
        .map(|i| format!("x-{i}: v\r\n"))
        .collect();
    assert_eq!(framing(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")), "error");
}

#[test]
fn a_response_to_head_has_no_body_whatever_its_length_fields_say() {
    let text = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n";
    let parsed = parsed(text, true).expect("parsed").expect("whole");
    assert!(matches!(parsed.1, Framing::Length(0)));
}

#[test]
fn keep_alive_follows_the_version_and_connection() {
    let keep = |text: &str| parsed(text, false).expect("parsed").expect("whole").2;
    assert!(keep("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"));
    assert!(!keep("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"));
    assert!(!keep(
        "HTTP/1.1 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n"
    ));
    assert!(!keep("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"));
    assert!(keep(
        "HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n"
    ));
    assert!(!keep("HTTP/1.1 101 Switching Protocols\r\n\r\n"));
}

#[test]
fn an_unusual_reason_phrase_is_kept_and_the_usual_one_is_not() {
    let reason = |text: &str| match read_into_map(text, false) {
        Ok(Some(Head::Response { response, .. })) => response
            .extensions()
            .get::<hyper::ext::ReasonPhrase>()
            .map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned()),
        _ => panic!("{text:?} did not parse"),
    };
    assert_eq!(reason("HTTP/1.1 200 OK\r\n\r\n"), None);
    assert_eq!(reason("HTTP/1.1 200 Fine\r\n\r\n").as_deref(), Some("Fine"));
    // No reason, or one with obs-text (which httparse gives as an empty one that is not in
    // the buffer): an empty reason, as hyper keeps it.
    assert_eq!(reason("HTTP/1.1 200\r\n\r\n").as_deref(), Some(""));
    assert_eq!(reason("HTTP/1.1 404 \r\n\r\n").as_deref(), Some(""));
    assert_eq!(reason("HTTP/1.1 200 X\u{ff}Z\r\n\r\n").as_deref(), Some(""));
}

/// Runs the chunked decoder over `wire` fed in pieces of `step` bytes: the data, the
/// trailers, and whether it ended.
fn dechunk(wire: &[u8], step: usize) -> io::Result<(Vec<u8>, Option<HeaderMap>, bool)> {
    let mut chunk = Chunked::Size(0);
    let mut buf = BytesMut::new();
    let (mut data, mut trailers) = (Vec::new(), None);
    let mut pieces = wire.chunks(step);
    loop {
        match chunk_step(&mut chunk, &mut buf)? {
            Step::Frame(frame) => data.extend_from_slice(&frame.into_data().expect("data")),
            Step::Last(frame) => {
                trailers = frame.into_trailers().ok();
                return Ok((data, trailers, true));
            }
            Step::End => return Ok((data, trailers, true)),
            Step::Read => match pieces.next() {
                Some(piece) => buf.extend_from_slice(piece),
                None => return Ok((data, trailers, false)),
            },
        }
    }
}

#[test]
fn chunked_bodies_are_read_whatever_the_pieces() {
    let wire = b"5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nx-sum: 7\r\n\r\n";
    for step in [1, 2, 3, 7, wire.len()] {
        let (data, trailers, ended) = dechunk(wire, step).expect("valid");
        assert_eq!(data, b"hello0123456789", "step {step}");
        assert!(ended);
        let trailers = trailers.expect("trailers");
        assert_eq!(trailers.get("x-sum").map(|v| v.as_bytes()), Some(&b"7"[..]));
    }
    let wire = b"00000000000000003 \t;x\r\nabc\r\n0\r\n\r\n";
    let (data, _, ended) = dechunk(wire, 1).expect("leading zeros and spaces are fine");
    assert_eq!((data.as_slice(), ended), (&b"abc"[..], true));
    let (data, trailers, ended) = dechunk(b"3\r\nabc\r\n0\r\n\r\n", 1).expect("valid");
    assert_eq!(
        (data.as_slice(), trailers.is_none(), ended),
        (&b"abc"[..], true, true)
    );
}

#[test]
fn malformed_chunked_bodies_are_errors() {
    for wire in [
        &b"zz\r\nabc\r\n0\r\n\r\n"[..],
        b"3\r\nabcX\r\n0\r\n\r\n",
        b"3\nabc\r\n0\r\n\r\n",
        b" 3\r\nabc\r\n0\r\n\r\n",
        b"3 x\r\nabc\r\n0\r\n\r\n",
        b"3;a\rb\r\nabc\r\n0\r\n\r\n",
        b"3\r\nabc\r\n0\r\nx-a: 1\nx-b: 2\r\n\r\n",
        b"11111111111111111\r\n",
    ] {
        assert!(
            dechunk(wire, 1).is_err(),
            "{:?}",
            String::from_utf8_lossy(wire)
        );
    }
    let long_line = vec![b'1'; HYPER_MAX_CHUNK_LINE + 1];
    assert!(dechunk(&long_line, long_line.len()).is_err());
    // hyper's limit on extensions counts over the whole body, however the bytes come.
    let ext = "e".repeat(9000);
    let body = format!("1;{ext}\r\na\r\n1;{ext}\r\nb\r\n0\r\n\r\n");
    for step in [1000, body.len()] {
        assert!(dechunk(body.as_bytes(), step).is_err(), "step {step}");
    }
    let body = format!("1;{}\r\na\r\n0\r\n\r\n", "e".repeat(5000));
    for step in [1000, body.len()] {
        assert!(dechunk(body.as_bytes(), step).is_ok(), "step {step}");
    }
}

#[test]
fn the_request_head_is_written_as_hyper_writes_it() {
    let mut req = Request::new(());
    *req.uri_mut() = "/a/b?c=d".parse().expect("uri");
    req.headers_mut()
        .insert(header::HOST, HeaderValue::from_static("up:80"));
    req.headers_mut()
        .append("x-two", HeaderValue::from_static("1"));
    req.headers_mut()
        .append("x-two", HeaderValue::from_static("2"));
    let mut out = Vec::new();
    encode_request(&req, &Added::default(), &mut out);
    assert_eq!(
        String::from_utf8_lossy(&out),
        "GET /a/b?c=d HTTP/1.1\r\nhost: up:80\r\nx-two: 1\r\nx-two: 2\r\n\r\n"
    );
}

/// What tollgate adds is written where the map would have had it: the same head as the
/// map holding it, which is what hyper's clients are given.
#[test]
fn added_fields_are_written_as_the_map_would_have_them() {
    let peer = headers::peer_value("192.0.2.9".parse().expect("ip"));
    let client = headers::peer_value("198.51.100.7".parse().expect("ip"));
    let host = HeaderValue::from_static("api.example");
    for host in [Some(&host), None] {
        let mut req = Request::new(());
        req.headers_mut()
            .insert(header::HOST, HeaderValue::from_static("up:80"));
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        let names = headers::FieldNames::of(req.headers(), true);
        let fwd = headers::ForwardedFor {
            peer: &peer,
            peer_trusted: false,
            client: &client,
            proto: "https",
            host,
        };
        let mut added = Added::new(Some(headers::RequestId::Kept(HeaderValue::from_static(
            "id-1",
        ))));
        added.forwarding(req.headers_mut(), fwd, &names);
        let mut written = Vec::new();
        encode_request(&req, &added, &mut written);
        added.move_into(req.headers_mut());
        let mut from_map = Vec::new();
        encode_request(&req, &added, &mut from_map);
        assert_eq!(
            String::from_utf8_lossy(&written),
            String::from_utf8_lossy(&from_map)
        );
        let expected = match host {
            Some(_) => "x-forwarded-host: api.example\r\n",
            None => "",
        };
        let expected = format!(
            "GET / HTTP/1.1\r\nhost: up:80\r\naccept: */*\r\nx-request-id: id-1\r\n\
             x-forwarded-for: 192.0.2.9\r\nx-forwarded-proto: https\r\n{expected}\
             x-real-ip: 198.51.100.7\r\n\r\n"
        );
        assert_eq!(String::from_utf8_lossy(&written), expected);
    }
}
