//! Differential fuzzing of tollgate's own HTTP/1.1 path for simple requests
//! (src/http1/server.rs) against the framing guard and httparse as hyper's
//! server calls it.
//!
//! The simple path may take a head only where the guard + hyper path would read the same
//! request from the same bytes: it must agree with them, or be stricter (hand the bytes to
//! them), never more lenient. For every head it takes:
//! - the framing guard, fed the same bytes, hands them all on without refusing, and is then
//!   between requests (it saw no body to follow);
//! - httparse with its default configuration (hyper's) parses the same length, method,
//!   target and version, and the same fields in the same order;
//! - the request says HTTP/1.1, no body (`Content-Length` absent or 0, no
//!   `Transfer-Encoding`), no `Upgrade` or `Expect`, not CONNECT, at most 100 fields, and its
//!   URI is the one `http` builds from the target, as hyper's is.
#![no_main]

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};
use tollgate::testing::http1::guard::FramingGuard;

mod wire;

use wire::Wire;

/// Feeds `head` to a framing guard: whether it handed every byte on, wrote nothing, and is
/// between requests afterwards.
fn guard_takes_without_body(head: &[u8]) -> bool {
    let written = RefCell::new(Vec::new());
    let wire = Wire {
        input: head,
        at: 0,
        pieces: &[],
        piece: 0,
        written: &written,
    };
    let mut guard = FramingGuard::new(wire);
    let mut cx = Context::from_waker(Waker::noop());
    let mut delivered = Vec::new();
    let mut buffer = vec![0u8; 1 << 17];
    for _ in 0..4 {
        let mut buf = ReadBuf::new(&mut buffer);
        match Pin::new(&mut guard).poll_read(&mut cx, &mut buf) {
            Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
            Poll::Ready(Ok(())) => delivered.extend_from_slice(buf.filled()),
            _ => return false,
        }
    }
    delivered == head && written.borrow().is_empty() && guard.between_requests()
}

fuzz_target!(|data: &[u8]| {
    let Some((len, request, _closes)) = tollgate::testing::http1::server::simple_request(data) else {
        return;
    };
    let head = &data[..len];
    assert!(
        guard_takes_without_body(head),
        "the simple path took a head the framing guard refuses or reads a body after"
    );

    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; 128];
    let mut parsed = httparse::Request::new(&mut []);
    let config = httparse::ParserConfig::default();
    let status = config.parse_request_with_uninit_headers(&mut parsed, head, &mut slots);
    assert_eq!(status.ok(), Some(httparse::Status::Complete(len)), "httparse's length");
    assert_eq!(parsed.version, Some(1), "taken only as HTTP/1.1");
    assert_eq!(parsed.method, Some(request.method().as_str()), "method");
    let target = parsed.path.expect("a complete parse has a target");
    let uri = http::Uri::from_maybe_shared(bytes::Bytes::copy_from_slice(target.as_bytes()))
        .expect("the simple path built this URI from this target");
    assert_eq!(&uri, request.uri(), "the URI hyper would build");
    assert!(parsed.headers.len() <= 100, "more fields than hyper takes");
    let fields: Vec<(String, &[u8])> = parsed
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value))
        .collect();
    let built: Vec<(String, &[u8])> = request
        .headers()
        .iter()
        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes()))
        .collect();
    // A map groups the values of one name together, in the order they came.
    let mut grouped = fields.clone();
    let order: Vec<String> = {
        let mut names: Vec<String> = Vec::new();
        for (name, _) in &fields {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names
    };
    grouped.sort_by_key(|(name, _)| order.iter().position(|n| n == name));
    assert_eq!(built, grouped, "the request's fields are the head's");

    assert_eq!(request.version(), http::Version::HTTP_11);
    assert_ne!(request.method(), http::Method::CONNECT);
    for name in ["transfer-encoding", "upgrade", "expect"] {
        assert!(!request.headers().contains_key(name), "{name} taken");
    }
    for length in request.headers().get_all("content-length") {
        assert_eq!(length.as_bytes().trim_ascii(), b"0", "a body announced");
    }
});
