//! A response's field lines for tollgate's own HTTP/1.1 server: the bytes it writes after the
//! map's fields, so that what tollgate's own client read and what tollgate sets need not go
//! through a map on the way.
//!
//! They belong to the upstream connection of tollgate's own client ([`super::client`]), which
//! writes an upstream's kept fields into them when the request came from tollgate's own server
//! (the request body says so: `ClientBody::Simple`), and they travel to that server inside the
//! response body (`DirectBody`), which is how the server finds them: nothing between the two
//! carries them as a parameter. The fields tollgate sets on a response go where the response's
//! body says ([`AddTo`]): into these lines when it carries them, else into the map.

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;

use crate::headers::{Indexing, RequestId, ResponseFields, X_REQUEST_ID};

/// The most a connection's [`ResponseLines`] keeps allocated between its responses.
pub const KEPT_LINES: usize = 16 * 1024;

/// A response's field lines for tollgate's own HTTP/1.1 server, written after its map's fields
/// (`http1::server`): the fields tollgate sets ([`AddTo::Lines`]) and, ahead of them, the
/// upstream's own when tollgate's own client read the response (`http1::client`), which then
/// leaves the map empty. What the server's encoder would have learnt from the upstream's fields
/// in the map comes with them.
#[derive(Default)]
pub struct ResponseLines {
    pub(crate) bytes: Vec<u8>,
    /// The body's length, when a `Content-Length` line among the upstream's gives it (the
    /// encoder then writes none of its own).
    pub(crate) length: Option<u64>,
    /// Whether the upstream's lines hold a `Date` (the encoder then writes none of its own).
    pub(crate) date: bool,
}

impl ResponseLines {
    /// Room for the usual response's lines (nginx's five fields and tollgate's own).
    const USUAL: usize = 512;

    pub fn new() -> Self {
        ResponseLines {
            bytes: Vec::with_capacity(Self::USUAL),
            ..ResponseLines::default()
        }
    }

    /// Empty again, for the next response, keeping the allocation unless an upstream's
    /// unusually large head grew it past [`KEPT_LINES`]: that much is not held for as long as
    /// the connection stays open.
    pub fn clear(&mut self) {
        self.bytes.clear();
        if self.bytes.capacity() > KEPT_LINES {
            self.bytes.shrink_to(Self::USUAL);
        }
        self.length = None;
        self.date = false;
    }

    /// The lines written so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Field lines cost no hashed insert and no allocation per value (about 1,000 instructions per
/// request against the map).
impl ResponseFields for ResponseLines {
    /// Copied into the lines.
    fn request_id(&mut self, id: &RequestId) {
        field_line(&mut self.bytes, &X_REQUEST_ID, id.as_bytes());
    }

    /// Copied into the lines.
    fn value(&mut self, name: &HeaderName, value: &HeaderValue) {
        field_line(&mut self.bytes, name, value.as_bytes());
    }

    fn written(
        &mut self,
        name: &HeaderName,
        _: Indexing,
        write: impl FnOnce(&mut Vec<u8>) -> bool,
    ) {
        let out = &mut self.bytes;
        let start = out.len();
        field_name(out, name);
        if write(out) {
            out.extend_from_slice(b"\r\n");
        } else {
            out.truncate(start);
        }
    }
}

/// Where the fields tollgate sets on one response go, as its body says (`UpstreamBody::fields_to`):
/// the lines of a response that tollgate's own client read for tollgate's own server, else the
/// response's map.
pub enum AddTo<'a> {
    Map(&'a mut HeaderMap),
    Lines(&'a mut ResponseLines),
}

impl ResponseFields for AddTo<'_> {
    fn request_id(&mut self, id: &RequestId) {
        match self {
            AddTo::Map(headers) => headers.request_id(id),
            AddTo::Lines(lines) => lines.request_id(id),
        }
    }

    fn value(&mut self, name: &HeaderName, value: &HeaderValue) {
        match self {
            AddTo::Map(headers) => headers.value(name, value),
            AddTo::Lines(lines) => lines.value(name, value),
        }
    }

    fn written(
        &mut self,
        name: &HeaderName,
        indexing: Indexing,
        write: impl FnOnce(&mut Vec<u8>) -> bool,
    ) {
        match self {
            AddTo::Map(headers) => headers.written(name, indexing, write),
            AddTo::Lines(lines) => lines.written(name, indexing, write),
        }
    }
}

/// One HTTP/1.1 field line, `name: value` and its end, as the encoders of tollgate's own server
/// and client write each of a map's fields. They keep their own loops: calling this from them
/// cost 90–130 more instructions per request (`bench/instructions.sh`).
pub(crate) fn field_line(out: &mut Vec<u8>, name: &HeaderName, value: &[u8]) {
    field_name(out, name);
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The start of a field line: `name: `.
fn field_name(out: &mut Vec<u8>, name: &HeaderName) {
    out.extend_from_slice(name.as_str().as_bytes());
    out.extend_from_slice(b": ");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::{add_rate_limit_headers, sample_outcome_sets, RATE_LIMIT_MODES};

    #[test]
    fn response_lines_grown_by_a_large_head_are_given_back() {
        let mut lines = ResponseLines::new();
        lines.bytes.extend_from_slice(&[b'x'; 400]);
        lines.length = Some(1);
        lines.date = true;
        lines.clear();
        assert_eq!(
            (lines.bytes.len(), lines.length, lines.date),
            (0, None, false)
        );
        assert!(lines.bytes.capacity() >= 400, "the usual size is kept");
        lines.bytes.extend_from_slice(&vec![b'x'; 100_000]);
        lines.clear();
        assert!(
            lines.bytes.capacity() <= KEPT_LINES,
            "{}",
            lines.bytes.capacity()
        );
    }

    /// The rate-limit fields and the request id as lines are what an encoder writes from the
    /// map, in the same order.
    #[test]
    fn rate_limit_fields_as_lines_are_the_maps_fields() {
        let (sets, modes) = (sample_outcome_sets(), RATE_LIMIT_MODES);
        let id = RequestId::random();
        for outcomes in &sets {
            for mode in modes {
                let mut map = HeaderMap::new();
                let mut to = AddTo::Map(&mut map);
                add_rate_limit_headers(&mut to, mode, outcomes, None);
                to.request_id(&id);
                let mut from_map = Vec::new();
                for (name, value) in &map {
                    field_line(&mut from_map, name, value.as_bytes());
                }
                let mut lines = ResponseLines::new();
                let mut to = AddTo::Lines(&mut lines);
                add_rate_limit_headers(&mut to, mode, outcomes, None);
                to.request_id(&id);
                let lossy = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
                assert_eq!(
                    lossy(lines.as_bytes()),
                    lossy(&from_map),
                    "{mode:?} {outcomes:?}"
                );
            }
        }
    }
}
