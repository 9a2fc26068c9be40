//! The response side of tollgate's own HTTP/1.1 server, written as hyper 1.x's HTTP/1.1
//! server writes it (`proto/h1/role.rs`): the status line and lower-case fields, the body's
//! framing, the `date` field, trailers.

use std::time::{SystemTime, UNIX_EPOCH};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use http_body::Body;

use crate::headers;
use crate::http1::lines::ResponseLines;
use crate::http1::rules;

/// What hyper knows of a body when it writes the head.
#[derive(Clone, Copy)]
enum Length {
    /// It has ended already (`is_end_stream`).
    Nothing,
    Known(u64),
    Unknown,
}

pub(super) enum BodyFraming {
    /// Bytes still to send.
    Length(u64),
    /// Chunked, with the trailer fields the response announced.
    Chunked(Option<Vec<HeaderName>>),
}

/// How one response's body goes: None when no body follows the head.
pub(super) struct Framing {
    pub(super) body: Option<BodyFraming>,
    /// The connection closes after this response.
    pub(super) last: bool,
}

impl Framing {
    fn none(last: bool) -> Self {
        Framing { body: None, last }
    }
}

/// Writes the status line and fields of a response into `out` (the map's, then `lines`, the
/// field lines its body carries: [`super::Service::lines`]), and says how `body` goes.
pub(super) fn encode_head(
    out: &mut Vec<u8>,
    date: &mut DateField,
    parts: &http::response::Parts,
    lines: Option<&ResponseLines>,
    body: &impl Body,
    head_request: bool,
    closing: bool,
) -> Framing {
    out.clear();
    let status = parts.status;
    let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>();
    if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
        // hyper cannot send a 1xx as the response either: it answers 500 and closes.
        out.extend_from_slice(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n");
        date.write(out);
        return Framing::none(true);
    }
    if status == StatusCode::OK && reason.is_none() {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        match reason {
            Some(reason) => out.extend_from_slice(reason.as_bytes()),
            None => {
                let canonical = status.canonical_reason().unwrap_or("<none>");
                out.extend_from_slice(canonical.as_bytes());
            }
        }
        out.extend_from_slice(b"\r\n");
    }
    // What hyper knows of the body when it writes the head.
    let known = if body.is_end_stream() {
        Length::Nothing
    } else {
        match body.size_hint().exact() {
            Some(n) => Length::Known(n),
            None => Length::Unknown,
        }
    };
    let chunkable = can_have_body(head_request, status);
    let mut last = closing;
    // What the upstream's own lines, when they are there, say (the map is empty then).
    let mut length: Option<u64> = lines.and_then(|lines| lines.length);
    let mut wrote_date = lines.is_some_and(|lines| lines.date);
    let mut close_said = false;
    let mut trailer_names: Option<Vec<HeaderName>> = None;
    // An unknown length takes the fields' own (hyper trusts a known one); fields that
    // disagree or do not read as a length: hyper refuses to send the response.
    let mut length_fields = None;
    if matches!(known, Length::Unknown) && parts.headers.contains_key(header::CONTENT_LENGTH) {
        let fields = parts.headers.get_all(header::CONTENT_LENGTH).iter();
        match rules::content_length(fields.map(HeaderValue::as_bytes)) {
            Some(n) => length_fields = Some(n),
            // hyper refuses to encode such a response: nothing of it goes out, and the
            // connection closes (the client sees it close).
            None => {
                out.clear();
                return Framing::none(true);
            }
        }
    }
    for (name, value) in parts.headers.iter() {
        match *name {
            header::CONTENT_LENGTH => match known {
                // The first is written; the body's own length frames it.
                Length::Known(n) if length.is_none() => length = Some(n),
                // Read once for all of them (below the loop's start): they agree.
                Length::Unknown if length.is_none() => length = length_fields,
                Length::Nothing if head_request => {}
                // hyper drops a length for an empty body (and writes its own below).
                _ => continue,
            },
            // Never on tollgate's responses (hop-by-hop, removed from upstream ones):
            // the body's own framing below is the only one written.
            header::TRANSFER_ENCODING => continue,
            header::CONNECTION if headers::lists_token(value.as_bytes(), "close") => {
                last = true;
                close_said = true;
            }
            header::DATE => wrote_date = true,
            header::TRAILER => {
                if !chunkable {
                    continue;
                }
                let names = value.to_str().ok().into_iter().flat_map(|v| v.split(','));
                let names = names.filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok());
                trailer_names.get_or_insert_with(Vec::new).extend(names);
            }
            _ => {}
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    // Where hyper's encoder would have written them had they been put into the map last.
    if let Some(lines) = lines {
        out.extend_from_slice(lines.as_bytes());
    }
    if last && !close_said {
        out.extend_from_slice(b"connection: close\r\n");
    }
    let mut framing = match (length, known) {
        (Some(n), _) => BodyFraming::Length(n),
        (None, Length::Unknown) if chunkable => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            BodyFraming::Chunked(trailer_names)
        }
        // Only where no body can follow anyway (HEAD, 204, 304).
        (None, Length::Unknown) => BodyFraming::Length(0),
        (None, Length::Nothing | Length::Known(0)) => {
            if can_have_length(status) && !head_request {
                out.extend_from_slice(b"content-length: 0\r\n");
            }
            BodyFraming::Length(0)
        }
        (None, Length::Known(n)) => {
            if can_have_length(status) {
                out.extend_from_slice(b"content-length: ");
                out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
                out.extend_from_slice(b"\r\n");
                BodyFraming::Length(n)
            } else {
                BodyFraming::Length(0)
            }
        }
    };
    if !chunkable {
        framing = BodyFraming::Length(0);
    }
    if wrote_date {
        out.extend_from_slice(b"\r\n");
    } else {
        date.write(out);
    }
    Framing {
        body: match framing {
            BodyFraming::Length(0) => None,
            framing => Some(framing),
        },
        // Nothing follows a 101 on HTTP/1.1 (none is expected here: no upgrade was asked).
        last: last || status == StatusCode::SWITCHING_PROTOCOLS,
    }
}

/// Whether a response can carry a body (hyper's `can_chunked`): not to HEAD, and not 1xx, 204
/// or 304.
fn can_have_body(head_request: bool, status: StatusCode) -> bool {
    !head_request && can_have_length(status)
}

/// Whether a response can carry a `Content-Length` (hyper's `can_have_content_length`).
fn can_have_length(status: StatusCode) -> bool {
    !status.is_informational()
        && status != StatusCode::NO_CONTENT
        && status != StatusCode::NOT_MODIFIED
}

/// Writes the trailer fields that were announced and are allowed in a trailer section (RFC
/// 9110 6.5.1, hyper's list); none when nothing was announced.
pub(super) fn write_trailers(out: &mut Vec<u8>, trailers: &HeaderMap, announced: &[HeaderName]) {
    for (name, value) in trailers {
        if !announced.contains(name) || !allowed_in_trailers(name) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

fn allowed_in_trailers(name: &HeaderName) -> bool {
    !matches!(
        *name,
        header::AUTHORIZATION
            | header::CACHE_CONTROL
            | header::CONTENT_ENCODING
            | header::CONTENT_LENGTH
            | header::CONTENT_RANGE
            | header::CONTENT_TYPE
            | header::HOST
            | header::MAX_FORWARDS
            | header::SET_COOKIE
            | header::TRAILER
            | header::TRANSFER_ENCODING
            | header::TE
    )
}

/// `n` in upper-case hex, as hyper writes a chunk size.
pub(super) fn hex(mut n: usize, buf: &mut [u8; 16]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b"0123456789ABCDEF"[n & 0xf];
        n >>= 4;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// The `date` field, formatted once a second.
#[derive(Default)]
pub(super) struct DateField {
    second: u64,
    /// `date: <IMF-fixdate>\r\n\r\n`: the field and the end of the head.
    line: Vec<u8>,
}

impl DateField {
    pub(super) fn write(&mut self, out: &mut Vec<u8>) {
        let now = SystemTime::now();
        let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if second != self.second || self.line.is_empty() {
            self.second = second;
            self.line = format!("date: {}\r\n\r\n", httpdate::HttpDate::from(now)).into_bytes();
        }
        out.extend_from_slice(&self.line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_upper_case_hex() {
        let mut buf = [0u8; 16];
        assert_eq!(hex(0, &mut buf), b"0");
        assert_eq!(hex(255, &mut buf), b"FF");
        assert_eq!(hex(0x1000, &mut buf), b"1000");
        assert_eq!(hex(usize::MAX, &mut buf).len(), usize::BITS as usize / 4);
    }

    #[test]
    fn the_date_field_is_an_imf_fixdate() {
        let mut date = DateField::default();
        let mut out = Vec::new();
        date.write(&mut out);
        let text = String::from_utf8(out).expect("ascii");
        let value = text
            .strip_prefix("date: ")
            .and_then(|t| t.strip_suffix("\r\n\r\n"));
        let value = value.expect("a date field ending the head");
        assert!(httpdate::parse_http_date(value).is_ok(), "{value}");
    }
}
