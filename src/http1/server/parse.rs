//! The request side of tollgate's own HTTP/1.1 server: which heads it takes (a whole, clean
//! HTTP/1.1 head that the framing guard lets through and that announces no body, no upgrade, no
//! `Expect`, at most hyper's number of fields), parsed once, and the request built from that
//! parse, its target and values sharing the head's bytes.

use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Method, Request, Uri, Version};

use crate::headers;
use crate::http1::guard;
use crate::http1::head::{self, HeadScan};
use crate::http1::rules::HYPER_MAX_FIELDS;

/// Fields the forwarder may add to a request's map on tollgate's own client (a `Trailer`
/// announcement; `Host` replaces the client's). What it adds for every request goes into the
/// head as lines (`headers::Added`), and hyper's clients reserve room for it themselves: a
/// map sized for it here would be allocated larger than it needs, past the allocator's cache
/// of small blocks, on every request.
const FORWARDER_FIELDS: usize = 1;

/// The simple path's verdict on the bytes at the start of a connection (or after a served
/// request): the head's length, the request it builds and whether the client asked to close,
/// or None when it would hand the bytes to the framing guard and hyper. For the differential
/// fuzz target (`fuzz/fuzz_targets/simple_head.rs`), which checks every head taken here
/// against the guard and httparse as hyper calls it.
pub fn simple_request(bytes: &[u8]) -> Option<(usize, Request<()>, bool)> {
    let HeadScan::Whole { end, folded: false } = head::scan_head(bytes) else {
        return None;
    };
    let mut fields = Vec::new();
    let head = parse_head(&bytes[..end], &mut fields)?;
    let frozen = Bytes::copy_from_slice(&bytes[..head.len]);
    let request = request_from(&frozen, &head, &fields, ())?;
    Some((head.len, request, head.asks.close))
}

/// Where a head's parts are in its bytes (its fields: [`Simple::fields`]): one parse, read
/// again once the bytes are frozen.
pub(super) struct ParsedHead {
    pub(super) len: usize,
    method: Method,
    target: Range<usize>,
    pub(super) asks: Asks,
}

/// What the client's fields ask of the response.
#[derive(Clone, Copy, Default)]
pub(super) struct Asks {
    /// `Connection: close`.
    pub(super) close: bool,
    /// `TE: trailers`: hyper sends a response's trailer fields only then.
    pub(super) trailers: bool,
}

/// The request of a head, with `body`: its bytes, its parse and its fields' places.
pub(super) fn request_from<B>(
    head: &Bytes,
    parsed: &ParsedHead,
    fields: &[(Range<usize>, Range<usize>)],
    body: B,
) -> Option<Request<B>> {
    let uri = Uri::from_maybe_shared(head.slice(parsed.target.clone())).ok()?;
    let mut request = Request::new(body);
    *request.method_mut() = parsed.method.clone();
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    // Filled in place: a map made apart would replace the request's own empty one, dropped.
    // Room for what the forwarder may add ([`FORWARDER_FIELDS`]), so the map is not grown
    // (rehashed) on the way upstream.
    let headers = request.headers_mut();
    headers.reserve(fields.len() + FORWARDER_FIELDS);
    for (name, value) in fields {
        let name = HeaderName::from_bytes(&head[name.clone()]).ok()?;
        let value = HeaderValue::from_maybe_shared(head.slice(value.clone())).ok()?;
        headers.append(name, value);
    }
    Some(request)
}

/// Parses a whole head that the guard's scan found clean, its fields' places into `fields`;
/// None when it is not one this path takes (see the module notes).
pub(super) fn parse_head(
    bytes: &[u8],
    fields: &mut Vec<(Range<usize>, Range<usize>)>,
) -> Option<ParsedHead> {
    fields.clear();
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; HYPER_MAX_FIELDS];
    let mut request = httparse::Request::new(&mut []);
    let len = match request.parse_with_uninit_headers(bytes, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        _ => return None,
    };
    if request.version != Some(1) || !guard::accepts_without_body(&request) {
        return None;
    }
    let method = Method::from_bytes(request.method?.as_bytes()).ok()?;
    if method == Method::CONNECT {
        return None;
    }
    // Every part httparse gives of a request is a slice of `bytes`; one that were not would
    // be hyper's to read.
    let offset = |part: &[u8]| head::place_in(bytes, part);
    let mut head = ParsedHead {
        len,
        method,
        target: offset(request.path?.as_bytes())?,
        asks: Asks::default(),
    };
    for field in request.headers.iter() {
        let name = field.name;
        if name.eq_ignore_ascii_case("upgrade") || name.eq_ignore_ascii_case("expect") {
            return None;
        }
        if name.eq_ignore_ascii_case("connection") {
            head.asks.close |= simple_connection_field(field.value)?;
        } else if name.eq_ignore_ascii_case("te") {
            head.asks.trailers |= headers::lists_token(field.value, "trailers");
        }
        fields.push((offset(name.as_bytes())?, offset(field.value)?));
    }
    Some(head)
}

/// A client's `Connection` field this path takes: only `close` and `keep-alive` tokens
/// (others name hop-by-hop fields, or an upgrade, for hyper's path). Some(true): it says close.
fn simple_connection_field(value: &[u8]) -> Option<bool> {
    let mut closes = false;
    for token in headers::raw_tokens(value) {
        if token.eq_ignore_ascii_case(b"close") {
            closes = true;
        } else if !token.eq_ignore_ascii_case(b"keep-alive") && !token.is_empty() {
            return None;
        }
    }
    Some(closes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(head: &str) -> Option<ParsedHead> {
        parse_head(head.as_bytes(), &mut Vec::new())
    }

    #[test]
    fn simple_heads_are_taken_and_others_left_to_hyper() {
        let taken = [
            "GET / HTTP/1.1\r\nHost: a\r\n\r\n",
            "HEAD /x?y=1 HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
            "DELETE /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: Keep-Alive, close\r\n\r\n",
        ];
        for head in taken {
            assert!(parsed(head).is_some(), "{head:?} should be taken");
        }
        let left = [
            "GET / HTTP/1.0\r\nHost: a\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: x-secret\r\n\r\n",
            "PUT / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 00\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\n",
            "GET / HTTP/1.1\r\nHost : a\r\n\r\n",
        ];
        for head in left {
            assert!(parsed(head).is_none(), "{head:?} should be left to hyper");
        }
        let many: String = (0..=HYPER_MAX_FIELDS)
            .map(|i| format!("x-{i}: v\r\n"))
            .collect();
        assert!(parsed(&format!("GET / HTTP/1.1\r\n{many}\r\n")).is_none());
    }

    #[test]
    fn a_close_token_anywhere_closes() {
        let head = parsed("GET / HTTP/1.1\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n");
        assert!(head.is_some_and(|h| h.asks.close));
        let head = parsed("GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n");
        assert!(head.is_some_and(|h| !h.asks.close));
        let head = parsed("GET / HTTP/1.1\r\nTE: gzip\r\nTE: Trailers\r\n\r\n");
        assert!(head.is_some_and(|h| h.asks.trailers));
    }
}
