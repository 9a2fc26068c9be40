//! A response head, read once: its fields into the response's map or, for tollgate's own
//! server, into field lines ([`Answer`]), as the map would have carried them through the
//! forwarder; whether the connection may carry another request; and how the body is framed
//! (hyper's `Client::decoder`, RFC 9112 6.3).

use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode, Version};

use super::chunked::Chunked;
use super::{unreachable, Answer, Framing, Head};
use crate::error::RequestError;
use crate::headers;
use crate::http1::head;
use crate::http1::lines::ResponseLines;
use crate::http1::rules::{self, HYPER_MAX_FIELDS, HYPER_MAX_LENGTH};

/// The head at the start of `buf`, taken out of it; None when it has not all come yet.
/// `head_only`: it answers a HEAD request (no body follows, whatever its fields say).
pub(super) fn parse_head(
    buf: &mut BytesMut,
    fields: &mut Vec<(Range<usize>, Range<usize>)>,
    head_only: bool,
    answer: &mut Answer<'_>,
) -> Result<Option<Head>, RequestError> {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; HYPER_MAX_FIELDS];
    let mut parsed = httparse::Response::new(&mut []);
    // hyper's client parses with httparse's default (strict) configuration too.
    let config = httparse::ParserConfig::default();
    let len = match config.parse_response_with_uninit_headers(&mut parsed, buf, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(unreachable(format!("invalid response head: {err}"))),
    };
    let invalid = |what: &str| unreachable(format!("invalid response head: {what}"));
    let status = parsed
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| invalid("status"))?;
    let version = if parsed.version == Some(1) {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let place = |part: &[u8]| head::place_in(buf, part).ok_or_else(|| invalid("field"));
    // httparse gives an empty reason that is not in the buffer for a status line without one,
    // or with obs-text in it: hyper keeps it as an empty reason phrase.
    let reason = parsed.reason.unwrap_or("");
    let reason = match head::place_in(buf, reason.as_bytes()) {
        _ if Some(reason) == status.canonical_reason() => None,
        Some(place) if !reason.is_empty() => Some(place),
        _ => Some(0..0),
    };
    fields.clear();
    for field in parsed.headers.iter() {
        fields.push((place(field.name.as_bytes())?, place(field.value)?));
    }
    let head = buf.split_to(len).freeze();
    if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
        return Ok(Some(Head::Informational));
    }
    let reason = match reason {
        None => None,
        Some(reason) if reason.is_empty() => Some(hyper::ext::ReasonPhrase::from_static(b"")),
        Some(reason) => Some(
            hyper::ext::ReasonPhrase::try_from(head.slice(reason))
                .map_err(|_| invalid("reason phrase"))?,
        ),
    };
    let room = match answer {
        Answer::Map { room } => *room,
        Answer::Lines { .. } => 0,
    };
    // A 101 (never asked for here) is refused by the forwarder, and goes through the map.
    let as_lines = match answer {
        Answer::Lines {
            lines,
            keep_trailer,
        } if status != StatusCode::SWITCHING_PROTOCOLS => {
            fields_as_lines(&head, fields, lines, *keep_trailer, version)
                .map(|found| found.finish(lines, status, version, head_only))
        }
        _ => None,
    };
    let (headers, framing, reuse) = match as_lines {
        Some(finished) => {
            let (framing, reuse) = finished?;
            // The response's own empty map stays: no second one made and dropped.
            (None, framing, reuse)
        }
        None => {
            let (headers, framing, reuse) = fields_into_map(&head, fields, room, version)?;
            let framing = framing_of(status, version, head_only, &framing)?;
            (Some(headers), framing, reuse)
        }
    };
    let keep_alive = reuse.keep_alive;
    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    if let Some(reason) = reason {
        response.extensions_mut().insert(reason);
    }
    if let Some(headers) = headers {
        *response.headers_mut() = headers;
    }
    // A 101 (there was no upgrade to ask for one) ends the connection: the forwarder answers
    // it 502.
    let keep_alive = keep_alive && status != StatusCode::SWITCHING_PROTOCOLS;
    let framing = match framing {
        _ if status == StatusCode::SWITCHING_PROTOCOLS => Framing::Length(0),
        framing => framing,
    };
    Ok(Some(Head::Response {
        response,
        framing,
        keep_alive,
    }))
}

/// Whether the upstream connection may carry another request, from the version and the
/// `Connection` fields met so far.
struct Reuse {
    keep_alive: bool,
    said_close: bool,
}

impl Reuse {
    /// Before any `Connection` field: HTTP/1.1 keeps the connection, HTTP/1.0 does not.
    fn new(version: Version) -> Self {
        Reuse {
            keep_alive: version == Version::HTTP_11,
            said_close: false,
        }
    }

    /// Takes in one `Connection` field's options.
    fn connection(&mut self, options: &[u8]) {
        if options.eq_ignore_ascii_case(b"keep-alive") {
            // The usual value, without the token scan.
            self.keep_alive |= !self.said_close;
        } else if self.said_close || headers::lists_token(options, "close") {
            self.said_close = true;
            self.keep_alive = false;
        } else if !self.keep_alive {
            self.keep_alive = headers::lists_token(options, "keep-alive");
        }
    }
}

/// The head's fields in a map, `room` more to come; the framing fields noted on the way, so
/// that the framing is not looked up again in the map (two hashed look-ups each), and whether
/// the connection may be used again.
fn fields_into_map<'h>(
    head: &'h Bytes,
    fields: &[(Range<usize>, Range<usize>)],
    room: usize,
    version: Version,
) -> Result<(HeaderMap, FramingFields<'h>, Reuse), RequestError> {
    let invalid = |what: &str| unreachable(format!("invalid response head: {what}"));
    let mut headers = HeaderMap::with_capacity(fields.len() + room);
    let mut framing_fields = FramingFields::default();
    let mut reuse = Reuse::new(version);
    for (name, value) in fields {
        let name =
            HeaderName::from_bytes(&head[name.clone()]).map_err(|_| invalid("field name"))?;
        if name == header::CONNECTION {
            let options = &head[value.clone()];
            reuse.connection(options);
            // A plain `keep-alive` or `close` names no field but the hop-by-hop `Keep-Alive`:
            // it is not put into the map, where the forwarder would only look it up and
            // remove it again (`headers::strip_hop_by_hop`).
            if headers::is_plain_connection_option(options) {
                continue;
            }
        }
        if name == header::TRANSFER_ENCODING {
            framing_fields.transfer_encoding = Some(&head[value.clone()]);
        } else if name == header::CONTENT_LENGTH {
            framing_fields.lengths.push(&head[value.clone()]);
        }
        let value = HeaderValue::from_maybe_shared(head.slice(value.clone()))
            .map_err(|_| invalid("field value"))?;
        headers.append(name, value);
    }
    Ok((headers, framing_fields, reuse))
}

/// A head's fields written as lines by [`fields_as_lines`], before its framing is known.
struct AsLines<'h> {
    /// Where the head's lines start in the buffer.
    start: usize,
    framing: FramingFields<'h>,
    /// Where the `Content-Length` line is: the first one's, the only one written (a repeated
    /// length is counted in `framing`, where values that differ are refused, and sent once).
    length_line: Option<Range<usize>>,
    /// Whether a `Date` is among the lines.
    date: bool,
    reuse: Reuse,
}

/// The largest field name `HeaderName` takes (a longer one is the map's error to give).
const MAX_NAME: usize = (1 << 16) - 1;

/// Writes the fields of a response head that go on to the client into `lines`, as the map
/// would have carried them through the forwarder and the server's encoder: the name in lower
/// case, hop-by-hop fields left out, a `Content-Length` left out beside a
/// `Transfer-Encoding` (RFC 9112 6.3) and written once when the upstream repeats it
/// ([`rules::settle_response_length`]). None, with `lines` as it was, for a head that needs
/// the map's handling: a `Connection` that names other fields, a `TE`, a `Trailer` to keep,
/// a field tollgate sets itself, a name the map would refuse, a `Content-Length` that is not
/// plain digits. httparse has checked every
/// name (a token) and value (no control but tab) as `HeaderName` and `HeaderValue` would.
fn fields_as_lines<'h>(
    head: &'h Bytes,
    fields: &[(Range<usize>, Range<usize>)],
    lines: &mut ResponseLines,
    keep_trailer: bool,
    version: Version,
) -> Option<AsLines<'h>> {
    let out = &mut lines.bytes;
    let start = out.len();
    let mut found = AsLines {
        start,
        framing: FramingFields::default(),
        length_line: None,
        date: false,
        reuse: Reuse::new(version),
    };
    for (name, value) in fields {
        let (name, value) = (&head[name.clone()], &head[value.clone()]);
        if name.len() > MAX_NAME {
            out.truncate(start);
            return None;
        }
        let line = out.len();
        // Copied, then lowered in place: a byte-by-byte push would check the room each time.
        out.extend_from_slice(name);
        out[line..].make_ascii_lowercase();
        let lower = &out[line..];
        let is_length = lower == b"content-length";
        let kept = match headers::response_field(lower) {
            headers::ResponseField::Kept if is_length => {
                // A length the map would re-state (a list, leading zeros, not a number) goes
                // through the map; a repeated plain one is written once.
                if rules::plain_length(value).is_none() {
                    out.truncate(start);
                    return None;
                }
                found.framing.lengths.push(value);
                found.length_line.is_none()
            }
            headers::ResponseField::Kept => {
                if lower == b"date" {
                    found.date = true;
                }
                true
            }
            headers::ResponseField::HopByHop => {
                if lower == b"transfer-encoding" {
                    found.framing.transfer_encoding = Some(value);
                }
                false
            }
            headers::ResponseField::Connection if headers::is_plain_connection_option(value) => {
                found.reuse.connection(value);
                false
            }
            headers::ResponseField::Trailer if !keep_trailer => false,
            _ => {
                out.truncate(start);
                return None;
            }
        };
        if kept {
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
            if is_length {
                found.length_line = Some(line..out.len());
            }
        } else {
            out.truncate(line);
        }
    }
    Some(found)
}

impl AsLines<'_> {
    /// The body's framing and the connection's reuse, once the lines are settled: the
    /// `Content-Length` line stays where hyper's server encoder would have written it from
    /// the map for a body so framed (for a body of known length, and in an answer to HEAD; not
    /// for an empty body, the encoder writing its own `0`, nor beside a `Transfer-Encoding`,
    /// which the forwarder removes), and the encoder
    /// (`http1::server`'s `encode_head`) learns the length it need not write again and
    /// whether a `Date` came. A framing that is an error leaves the lines as they were.
    fn finish(
        self,
        lines: &mut ResponseLines,
        status: StatusCode,
        version: Version,
        head_only: bool,
    ) -> Result<(Framing, Reuse), RequestError> {
        let framing = match framing_of(status, version, head_only, &self.framing) {
            Ok(framing) => framing,
            Err(err) => {
                lines.bytes.truncate(self.start);
                return Err(err);
            }
        };
        let keep = match &framing {
            _ if self.framing.transfer_encoding.is_some() => false,
            // An answer to HEAD: nothing read its length; one that does not read as a length
            // (values that differ) is left out, as `rules::settle_response_length` does.
            Framing::Length(0) => {
                head_only && rules::content_length(self.framing.lengths.iter().copied()).is_some()
            }
            Framing::Length(n) => {
                lines.length = Some(*n);
                true
            }
            _ => false,
        };
        lines.date = self.date;
        if let (false, Some(at)) = (keep, self.length_line) {
            lines.bytes.drain(at);
        }
        Ok((framing, self.reuse))
    }
}

/// How a response's body is delimited (hyper's `Client::decoder`, RFC 9112 6.3). A response
/// to HEAD (`head_only`) has none, whatever its fields say: hyper decides that before it looks
/// at them.
fn framing_of(
    status: StatusCode,
    version: Version,
    head_only: bool,
    fields: &FramingFields<'_>,
) -> Result<Framing, RequestError> {
    if head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Framing::Length(0));
    }
    let invalid = |what: &str| unreachable(format!("invalid response head: {what}"));
    if let Some(last) = &fields.transfer_encoding {
        if version == Version::HTTP_10 {
            return Err(invalid("Transfer-Encoding in HTTP/1.0"));
        }
        return Ok(if rules::ends_in_chunked(last) {
            Framing::Chunked(Chunked::Size(0))
        } else {
            Framing::UntilClose
        });
    }
    if fields.lengths.is_empty() {
        return Ok(Framing::UntilClose);
    }
    match rules::content_length(fields.lengths.iter().copied()) {
        Some(n) if n <= HYPER_MAX_LENGTH => Ok(Framing::Length(n)),
        _ => Err(invalid("Content-Length")),
    }
}

/// The fields of a response head that frame its body, as [`parse_head`] met them: their
/// values, in the head.
#[derive(Default)]
struct FramingFields<'h> {
    /// The last `Transfer-Encoding` line: hyper reads the last coding of the last line.
    transfer_encoding: Option<&'h [u8]>,
    /// Every `Content-Length` line, in order; nearly always one.
    lengths: smallvec::SmallVec<[&'h [u8]; 1]>,
}
