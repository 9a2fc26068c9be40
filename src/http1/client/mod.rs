//! tollgate's own HTTP/1.1 client, for requests without a body to plain-HTTP upstreams
//! (issue 16, the upstream half of the simple path).
//!
//! hyper's connection-level client drives each upstream connection from a task of its own:
//! the request goes to it through a channel, the response head comes back through another,
//! and the body through a third, with a dispatcher, an encoder and a decoder around them. A
//! request that tollgate's own server path took (`http1::server`: no body, no
//! upgrade) needs none of that: here the request's own task writes the head to an idle
//! connection of its worker, reads the response head, parses it once, and hands the body on as
//! a [`DirectBody`] that reads the rest from the connection as the client takes it. When the
//! body has been read to its end and the upstream keeps the connection alive, the body puts
//! the connection back on the worker's idle list.
//!
//! What it does is what hyper 1.x's client does (`proto/h1/role.rs`, `Client`): the request
//! line and lower-case fields as given, no length for an empty body; a response head of at most
//! 100 fields (larger ones, or malformed ones, are errors: 502); 1xx heads before the response
//! skipped (a 101 ends the connection); no body for HEAD, 204 and 304; chunked when
//! `Transfer-Encoding` ends in `chunked`, else read to the close, `Content-Length` otherwise
//! (several must agree); the reason phrase kept when it is not the usual one; keep-alive by
//! the version and `Connection`. An idle connection the upstream closed is noticed without a
//! system call (its socket is readable) and not used. TLS and HTTP/2 upstreams, and every
//! request with a body, stay on hyper.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::head;
use super::lines::{field_line, AddTo, ResponseLines};
use super::rules::{
    self, ChunkSizes, HYPER_MAX_CHUNK_LINE, HYPER_MAX_EXTENSIONS, HYPER_MAX_FIELDS,
    HYPER_MAX_LENGTH, HYPER_MAX_RESPONSE_HEAD, MAX_TRAILERS,
};
use crate::body::RequestBody;
use crate::error::RequestError;
use crate::forward::{lock, Lane, UpstreamIo};
use crate::headers::{self, Added};
use hyper_rustls::MaybeHttpsStream;

/// What a connection's read buffer grows by.
const READ_CHUNK: usize = 8 * 1024;
/// Room left in a response's field map for what the proxy adds to it (rate-limit fields and
/// `X-Request-Id`), so it is not grown (rehashed) on the way: for an answer to HTTP/2, which
/// hyper's server encodes from the map. tollgate's own server gets those fields as lines
/// ([`AddTo`]), and a map sized for them would be allocated larger than it needs, past
/// the allocator's cache of small blocks, on every request.
pub(crate) const PROXY_FIELDS: usize = 5;

/// Where the forwarder wants a response's fields: as lines when the request came from
/// tollgate's own HTTP/1.1 server (its body says so: `ClientBody::Simple`), which writes them,
/// else in the map.
#[derive(Clone, Copy)]
pub(crate) enum Reply {
    /// Into the response's map, with room for `room` more (what the proxy adds to an answer
    /// to HTTP/2).
    Map { room: usize },
    /// As field lines, the map left empty ([`Answer::Lines`]); `keep_trailer`: the client
    /// takes trailers.
    Lines { keep_trailer: bool },
}

/// Where a response's fields go as its head is read.
enum Answer<'l> {
    /// Into the response's map, with room for `room` more.
    Map { room: usize },
    /// As field lines for tollgate's own HTTP/1.1 server, the map left empty
    /// ([`ResponseLines`], the connection's own, which the response's body carries to the
    /// server): the kept fields are copied once, where a map would parse, hash and insert each
    /// name, and the server's encoder write it out again (about 1,200 instructions per
    /// request). `keep_trailer`: the client takes trailers.
    Lines {
        lines: &'l mut ResponseLines,
        keep_trailer: bool,
    },
}

/// One plain-TCP connection to an upstream origin. It lives boxed, from its connect to its
/// close, so that the pool, the exchange and the response body it moves through per request
/// move a pointer: inline, its 112 bytes were copied with every move of a response.
pub(crate) struct DirectConn {
    stream: TcpStream,
    /// Bytes read and not used yet.
    buf: BytesMut,
    /// The request head being written; kept from request to request.
    out: Vec<u8>,
    /// Where a response head's fields are (name, value), from its one parse; kept likewise.
    fields: Vec<(Range<usize>, Range<usize>)>,
    /// The response's field lines for tollgate's own server ([`Reply::Lines`]); kept likewise,
    /// emptied when the connection goes back to its lane.
    lines: ResponseLines,
}

/// Why an exchange gave no response.
pub(crate) enum ExchangeError {
    /// Not a byte of the request was written: it may go on another connection.
    Unsent(RequestError),
    /// The request had started to go: answered as it is (502), never sent again.
    Sent(RequestError),
}

/// Where a connection goes back to once its response has been read: its worker's lane.
pub(crate) struct Parking {
    pub(crate) lanes: Arc<[Mutex<Lane>]>,
    pub(crate) worker: usize,
    pub(crate) origin: usize,
}

impl DirectConn {
    /// A connection the pool's connector made (`UpstreamPool::connect`: the same resolution,
    /// `connect_timeout` and socket options as hyper's client gets) to a plain-HTTP origin.
    pub(crate) fn over(io: UpstreamIo) -> Result<Box<DirectConn>, RequestError> {
        let MaybeHttpsStream::Http(io) = io else {
            return Err(unreachable(
                "TLS to an origin tollgate's own client does not serve".into(),
            ));
        };
        Ok(Box::new(DirectConn {
            stream: io.into_inner(),
            buf: BytesMut::with_capacity(READ_CHUNK),
            out: Vec::with_capacity(512),
            fields: Vec::with_capacity(16),
            lines: ResponseLines::new(),
        }))
    }

    /// Whether an idle connection can carry a request: the upstream has not closed it and
    /// sent nothing since its last response. Its socket turns readable when anything arrives;
    /// until then this costs no system call.
    pub(crate) fn is_reusable(&self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        match self.stream.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            // Readable may be stale (a last read that did not drain the socket); a read
            // tells: anything but "nothing yet" ends the connection.
            Poll::Ready(Ok(())) => {
                let mut byte = [0u8; 1];
                matches!(self.stream.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
        }
    }
}

/// Sends `req` (whose body is empty) on `conn` and reads the response head; the body reads
/// the rest and puts the connection back at `parking` when it may be used again.
// Not an `async fn`: that would keep `conn` twice, as its argument and as a local of its
// body (rust-lang/rust#62958).
#[allow(clippy::manual_async_fn)]
pub(crate) fn exchange<'r>(
    mut conn: Box<DirectConn>,
    req: &'r Request<RequestBody>,
    added: &Added<'_>,
    reply: &'r Reply,
    parking: Parking,
) -> impl Future<Output = Result<Response<DirectBody>, ExchangeError>> + use<'r> {
    // Encoded now: the future need not hold `added`.
    encode_request(req, added, &mut conn.out);
    async move {
        let out = std::mem::take(&mut conn.out);
        let written = write_head(&mut conn.stream, &out).await;
        conn.out = out;
        if let Err((sent, err)) = written {
            let err = unreachable(format!("error writing a request: {err}"));
            return Err(if sent {
                ExchangeError::Sent(err)
            } else {
                ExchangeError::Unsent(err)
            });
        }
        let head_only = req.method() == Method::HEAD;
        loop {
            match read_head(&mut conn, head_only, *reply).await {
                Ok(Head::Informational) => continue,
                Ok(Head::Response {
                    response,
                    framing,
                    keep_alive,
                }) => {
                    let as_lines = matches!(*reply, Reply::Lines { .. });
                    let mut body = DirectBody {
                        conn: Some(conn),
                        framing,
                        keep_alive,
                        parking: Some(parking),
                        as_lines,
                    };
                    // A body read whole already goes back at once, unless it carries the
                    // lines that tollgate's own server has yet to write: then when the server
                    // is done with them (`DirectBody::finish`).
                    if !as_lines {
                        body.finish_if_done();
                    }
                    return Ok(response.map(|()| body));
                }
                Err(err) => return Err(ExchangeError::Sent(err)),
            }
        }
    }
}

/// The request line and fields, as hyper's client writes them for a request without a body,
/// with what tollgate adds behind the request's own fields, where the map would have had it.
fn encode_request(req: &Request<RequestBody>, added: &Added<'_>, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(req.method().as_str().as_bytes());
    out.push(b' ');
    let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
    out.extend_from_slice(if target.is_empty() {
        b"/"
    } else {
        target.as_bytes()
    });
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in req.headers() {
        // Framing is the body's (there is none); hyper drops a `Transfer-Encoding` for it.
        if name == header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    added.each_field(|name, value| field_line(out, name, value));
    out.extend_from_slice(b"\r\n");
}

/// Writes the whole head; on failure, whether any of it was written.
async fn write_head(stream: &mut TcpStream, head: &[u8]) -> Result<(), (bool, io::Error)> {
    let mut written = 0;
    while written < head.len() {
        match stream.write(&head[written..]).await {
            Ok(0) => {
                let err = io::Error::new(io::ErrorKind::WriteZero, "connection closed");
                return Err((written > 0, err));
            }
            Ok(n) => written += n,
            Err(err) => return Err((written > 0, err)),
        }
    }
    Ok(())
}

/// One response head read from the connection.
enum Head {
    /// A 1xx other than 101: skipped, the response follows.
    Informational,
    Response {
        response: Response<()>,
        framing: Framing,
        keep_alive: bool,
    },
}

/// Reads and parses the next response head.
async fn read_head(
    conn: &mut DirectConn,
    head_only: bool,
    reply: Reply,
) -> Result<Head, RequestError> {
    let mut answer = match reply {
        Reply::Map { room } => Answer::Map { room },
        Reply::Lines { keep_trailer } => Answer::Lines {
            lines: &mut conn.lines,
            keep_trailer,
        },
    };
    loop {
        if !conn.buf.is_empty() {
            let fields = &mut conn.fields;
            if let Some(head) = parse_head(&mut conn.buf, fields, head_only, &mut answer)? {
                return Ok(head);
            }
            if conn.buf.len() > HYPER_MAX_RESPONSE_HEAD {
                return Err(unreachable("response head too large".into()));
            }
        }
        conn.buf.reserve(READ_CHUNK);
        match conn.stream.read_buf(&mut conn.buf).await {
            Ok(0) => {
                let what = if conn.buf.is_empty() {
                    "connection closed before message completed"
                } else {
                    "connection closed in the middle of a response head"
                };
                return Err(unreachable(what.into()));
            }
            Ok(_) => {}
            Err(err) => return Err(unreachable(format!("error reading a response: {err}"))),
        }
    }
}

/// The head at the start of `buf`, taken out of it; None when it has not all come yet.
/// `head_only`: it answers a HEAD request (no body follows, whatever its fields say).
fn parse_head(
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

fn unreachable(text: String) -> RequestError {
    RequestError::UpstreamUnreachable(text.into())
}

/// How the rest of a response body is read.
enum Framing {
    /// Bytes still to come.
    Length(u64),
    Chunked(Chunked),
    /// Until the upstream closes the connection (which then cannot be used again).
    UntilClose,
    /// Read to its end.
    Done,
    /// Ended by an error not reported yet ([`DirectBody::fail`]). Kept here rather than in a
    /// field of its own, which would make every response that carries the body larger.
    Failed(io::Error),
}

enum Chunked {
    /// A chunk-size line; the chunk extensions' bytes so far in this body.
    Size(u64),
    /// Data bytes still to come in this chunk, then CRLF (and the extensions so far).
    Data(u64, u64),
    /// The CRLF after a chunk's data.
    DataEnd(u64),
    /// After the last chunk: the trailer section.
    Trailers,
}

/// A response body read from its upstream connection as it is polled.
pub struct DirectBody {
    /// None once the body has ended (the connection went back, or was closed).
    conn: Option<Box<DirectConn>>,
    framing: Framing,
    keep_alive: bool,
    parking: Option<Parking>,
    /// Its response's fields go to tollgate's own server as the connection's lines
    /// ([`Reply::Lines`]): the connection stays with the body until the server has written
    /// them (the body read to its end, or [`DirectBody::finish`]ed).
    as_lines: bool,
}

/// What one step of reading a body found.
enum Step {
    Frame(Frame<Bytes>),
    /// The body's last frame (its trailers).
    Last(Frame<Bytes>),
    /// More bytes are needed.
    Read,
    End,
}

impl DirectBody {
    /// Ends the body with `err`, reported at the next poll rather than this one. What polls
    /// the body may still hold, unsent, the response's head and the data just handed out:
    /// hyper's HTTP/2 server queues both, and a stream reset in the same turn discards them,
    /// so the client would get a bare reset where hyper's own client, whose errors come after
    /// a wait, lets the head and the data out first. One turn of the scheduler (the body wakes
    /// itself) lets whatever sends them run before the error.
    fn fail(
        &mut self,
        err: io::Error,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.conn = None;
        self.framing = Framing::Failed(err);
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Once the body has been read whole: the connection goes back to its lane when the
    /// upstream keeps it alive and nothing unexpected followed the response; else it closes.
    fn finish_if_done(&mut self) {
        if matches!(self.framing, Framing::Length(0)) {
            self.framing = Framing::Done;
        }
        if !matches!(self.framing, Framing::Done) {
            return;
        }
        let conn = self.conn.take();
        if let (Some(mut conn), Some(parking), true) = (conn, self.parking.take(), self.keep_alive)
        {
            if conn.buf.is_empty() {
                // The next response's lines start empty, and a grown buffer is given back.
                conn.lines.clear();
                lock(&parking.lanes[parking.worker]).park_direct(parking.origin, conn);
            }
        }
    }

    /// The end of a body that tollgate's own server sends nothing of (a response without a
    /// body, whose lines it has written): the connection goes back to its lane when the body
    /// has nothing left to read, as it would have at once had it not carried the lines.
    pub fn finish(&mut self) {
        self.finish_if_done();
    }

    /// The response's field lines, when they go to tollgate's own server ([`Reply::Lines`]):
    /// the upstream's kept fields, when the head went as lines (the response's map is then
    /// empty), then the fields tollgate set ([`DirectBody::fields_to`]).
    pub fn lines(&self) -> Option<&ResponseLines> {
        match &self.conn {
            Some(conn) if self.as_lines => Some(&conn.lines),
            _ => None,
        }
    }

    /// Where the fields tollgate sets on this response go: its lines when it carries them,
    /// else `map`, the response's.
    pub fn fields_to<'a>(&'a mut self, map: &'a mut HeaderMap) -> AddTo<'a> {
        match &mut self.conn {
            Some(conn) if self.as_lines => AddTo::Lines(&mut conn.lines),
            _ => AddTo::Map(map),
        }
    }

    /// Takes the next frame from what has been read, if it is there.
    fn step(&mut self) -> io::Result<Step> {
        match &mut self.conn {
            Some(conn) => body_step(&mut self.framing, &mut conn.buf),
            None => Ok(Step::End),
        }
    }
}

/// The next frame of a body framed as `framing`, from what `buf` holds.
fn body_step(framing: &mut Framing, buf: &mut BytesMut) -> io::Result<Step> {
    match framing {
        // A failed body has no connection left: `step` does not come here.
        Framing::Done | Framing::Length(0) | Framing::Failed(_) => Ok(Step::End),
        Framing::Length(left) => {
            if buf.is_empty() {
                return Ok(Step::Read);
            }
            let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
            *left -= take as u64;
            Ok(Step::Frame(Frame::data(buf.split_to(take).freeze())))
        }
        Framing::UntilClose => {
            if buf.is_empty() {
                return Ok(Step::Read);
            }
            Ok(Step::Frame(Frame::data(buf.split().freeze())))
        }
        Framing::Chunked(chunk) => chunk_step(chunk, buf),
    }
}

/// Which way [`lines_against_the_map`] found a head to go.
#[derive(Debug, PartialEq)]
pub enum WentAs {
    /// As lines, which agree with what the map would have given.
    Lines,
    /// Through the map (the lines left untouched).
    Map,
    /// Refused both ways, with the same error.
    Refused,
    /// No response yet both ways: a 1xx, or a head not all there (the lines left untouched).
    NoResponse,
}

/// Reads the response head at the start of `wire` (the answer to a GET, or to a HEAD) both
/// ways a response can reach tollgate's own HTTP/1.1 server path, and says where they
/// disagree: as lines (`Answer::Lines`), and into the map, carried through the forwarder's
/// handling (`rules::settle_response_length`, `headers::strip_hop_by_hop`) and the server
/// encoder's `Content-Length` rules. The lines, when they carry the head, must hold exactly
/// the fields the encoder would have written from the map (in any order: RFC 9110 5.3), tell
/// it the same length and whether a `Date` came, and give the same framing and keep-alive; a
/// head they do not carry must leave them untouched; an error must be the same error. For the
/// combinatorial unit test and the differential fuzz target (`upstream_response`).
pub fn lines_against_the_map(wire: &[u8], head_only: bool) -> Result<WentAs, String> {
    let mut buf = BytesMut::from(wire);
    let map = parse_head(
        &mut buf,
        &mut Vec::new(),
        head_only,
        &mut Answer::Map { room: 0 },
    );
    let mut lines = ResponseLines::default();
    let mut answer = Answer::Lines {
        lines: &mut lines,
        keep_trailer: false,
    };
    let mut buf = BytesMut::from(wire);
    let read = parse_head(&mut buf, &mut Vec::new(), head_only, &mut answer);
    let (read, map) = match (read, map) {
        (Err(err), Err(expected)) => {
            let (err, expected) = (err.to_string(), expected.to_string());
            if err != expected || !lines.bytes.is_empty() {
                return Err(format!(
                    "lines refused with {err:?}, the map with {expected:?}"
                ));
            }
            return Ok(WentAs::Refused);
        }
        (
            Ok(Some(Head::Response {
                response,
                framing,
                keep_alive,
            })),
            Ok(Some(Head::Response {
                response: mapped,
                framing: map_framing,
                keep_alive: map_keep_alive,
            })),
        ) => (
            (response, framing, keep_alive),
            (mapped, map_framing, map_keep_alive),
        ),
        (Ok(None), Ok(None)) | (Ok(Some(Head::Informational)), Ok(Some(Head::Informational))) => {
            return match lines.bytes.is_empty() {
                true => Ok(WentAs::NoResponse),
                false => Err("lines written for a head that gives no response".into()),
            };
        }
        (read, map) => {
            let what = |head: &Result<Option<Head>, RequestError>| match head {
                Err(err) => format!("error {err}"),
                Ok(None) => "no head yet".into(),
                Ok(Some(Head::Informational)) => "a 1xx".into(),
                Ok(Some(Head::Response { .. })) => "a response".into(),
            };
            return Err(format!(
                "lines read {}, the map {}",
                what(&read),
                what(&map)
            ));
        }
    };
    let ((response, framing, keep_alive), (mapped, map_framing, map_keep_alive)) = (read, map);
    if framing_text(&framing) != framing_text(&map_framing) || keep_alive != map_keep_alive {
        return Err(format!(
            "lines framed {} (keep-alive {keep_alive}), the map {} (keep-alive {map_keep_alive})",
            framing_text(&framing),
            framing_text(&map_framing)
        ));
    }
    if !response.headers().is_empty() {
        return match lines.bytes.is_empty() {
            true => Ok(WentAs::Map),
            false => Err("a head that went through the map left lines behind".into()),
        };
    }
    // What the server's encoder writes from the map once the forwarder has handled it.
    let mut map = mapped.headers().clone();
    let names = headers::FieldNames::of(&map, false);
    rules::settle_response_length(&mut map);
    headers::strip_hop_by_hop(&mut map, &names);
    let (mut expected, mut length) = (Vec::new(), None);
    for (name, value) in &map {
        let line = [name.as_str().as_bytes(), b": ", value.as_bytes()].concat();
        if name == header::CONTENT_LENGTH {
            match map_framing {
                Framing::Length(0) if head_only => {}
                Framing::Length(n) if n > 0 && length.is_none() => length = Some(n),
                _ => continue,
            }
        }
        expected.push(line);
    }
    expected.sort();
    let mut written: Vec<Vec<u8>> = lines
        .bytes
        .split(|&b| b == b'\n')
        .filter(|line| !line.is_empty())
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line).to_vec())
        .collect();
    written.sort();
    let dated = expected.iter().any(|line| line.starts_with(b"date:"));
    if written != expected || lines.length != length || lines.date != dated {
        let text = |lines: &[Vec<u8>]| {
            let lines = lines
                .iter()
                .map(|l| String::from_utf8_lossy(l).into_owned());
            lines.collect::<Vec<_>>()
        };
        return Err(format!(
            "lines {:?} (length {:?}, date {}), the map {:?} (length {length:?}, date {dated})",
            text(&written),
            lines.length,
            lines.date,
            text(&expected)
        ));
    }
    Ok(WentAs::Lines)
}

/// `framing` as text, for comparing two reads of one head.
fn framing_text(framing: &Framing) -> String {
    match framing {
        Framing::Length(n) => format!("length {n}"),
        Framing::Chunked(_) => "chunked".into(),
        Framing::UntilClose => "until close".into(),
        Framing::Done => "done".into(),
        Framing::Failed(_) => "failed".into(),
    }
}

/// A whole response, as tollgate's own client reads it.
pub type ReadResponse = (Response<()>, Vec<u8>, Option<HeaderMap>);

/// How tollgate's own client reads `wire`, all an upstream sent on a connection before it
/// closed, as the answer to a GET (or a HEAD): the response with its body and trailers, or why
/// it failed. For the differential fuzz target (`fuzz/fuzz_targets/upstream_response.rs`),
/// which reads the same bytes with hyper's client.
pub fn read_response(wire: &[u8], head_request: bool) -> Result<ReadResponse, String> {
    let mut buf = BytesMut::from(wire);
    let mut fields = Vec::new();
    let (response, mut framing) = loop {
        match parse_head(
            &mut buf,
            &mut fields,
            head_request,
            &mut Answer::Map { room: 0 },
        )
        .map_err(|e| e.to_string())?
        {
            Some(Head::Informational) => continue,
            Some(Head::Response {
                response, framing, ..
            }) => break (response, framing),
            None => return Err("connection closed before message completed".into()),
        }
    };
    let (mut body, mut trailers) = (Vec::new(), None);
    loop {
        match body_step(&mut framing, &mut buf).map_err(|e| e.to_string())? {
            Step::Frame(frame) => {
                if let Ok(data) = frame.into_data() {
                    body.extend_from_slice(&data);
                }
            }
            Step::Last(frame) => {
                trailers = frame.into_trailers().ok();
                break;
            }
            Step::End => break,
            Step::Read if matches!(framing, Framing::UntilClose) => break,
            Step::Read => return Err("connection closed in the middle of a body".into()),
        }
    }
    Ok((response, body, trailers))
}

/// One step of a chunked body.
fn chunk_step(chunk: &mut Chunked, buf: &mut BytesMut) -> io::Result<Step> {
    loop {
        match chunk {
            Chunked::Size(extensions) => {
                let Some(end) = memchr::memchr(b'\n', buf) else {
                    if buf.len() > HYPER_MAX_CHUNK_LINE {
                        return Err(invalid_body("chunk extensions over limit"));
                    }
                    return Ok(Step::Read);
                };
                let line = buf.split_to(end + 1);
                let (size, extension) = parse_chunk_line(&line)?;
                *extensions += extension;
                if *extensions >= HYPER_MAX_EXTENSIONS {
                    return Err(invalid_body("chunk extensions over limit"));
                }
                let extensions = *extensions;
                *chunk = if size == 0 {
                    Chunked::Trailers
                } else {
                    Chunked::Data(size, extensions)
                };
            }
            Chunked::Data(left, extensions) => {
                if buf.is_empty() {
                    return Ok(Step::Read);
                }
                let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
                *left -= take as u64;
                let data = buf.split_to(take).freeze();
                if *left == 0 {
                    *chunk = Chunked::DataEnd(*extensions);
                }
                return Ok(Step::Frame(Frame::data(data)));
            }
            Chunked::DataEnd(extensions) => {
                if buf.len() < 2 {
                    return Ok(Step::Read);
                }
                if &buf[..2] != b"\r\n" {
                    return Err(invalid_body("chunk data not followed by CRLF"));
                }
                buf.advance(2);
                *chunk = Chunked::Size(*extensions);
            }
            Chunked::Trailers => {
                if buf.starts_with(b"\r\n") {
                    buf.advance(2);
                    return Ok(Step::End);
                }
                let Some(end) = memchr::memmem::find(buf, b"\r\n\r\n") else {
                    if buf.len() > MAX_TRAILERS {
                        return Err(invalid_body("invalid trailer section"));
                    }
                    return Ok(Step::Read);
                };
                let section = buf.split_to(end + 4).freeze();
                // Every line ends in CRLF, as hyper's decoder insists (httparse alone would
                // take a bare LF).
                let bare = section
                    .windows(2)
                    .any(|w| (w[1] == b'\n' && w[0] != b'\r') || (w[0] == b'\r' && w[1] != b'\n'))
                    || section.first() == Some(&b'\n');
                if bare {
                    return Err(invalid_body("trailer line not ended by CRLF"));
                }
                let trailers = parse_trailers(&section)?;
                return Ok(Step::Last(Frame::trailers(trailers)));
            }
        }
    }
}

/// A chunk-size line (with its LF) as hyper's decoder reads one ([`rules::chunk_size`],
/// leniently): the size, and how many bytes of extensions it had.
fn parse_chunk_line(line: &[u8]) -> io::Result<(u64, u64)> {
    match rules::chunk_size(line, ChunkSizes::Lenient) {
        Ok(chunk) => Ok((chunk.size, chunk.extensions)),
        Err(rules::BadChunkLine::Overflow) => Err(invalid_body("chunk size overflows")),
        Err(_) => Err(invalid_body("invalid chunk-size line")),
    }
}

/// The trailer fields of a chunked body (the section with its final empty line).
fn parse_trailers(section: &Bytes) -> io::Result<HeaderMap> {
    let mut slots = [httparse::EMPTY_HEADER; HYPER_MAX_FIELDS];
    let fields = match httparse::parse_headers(section, &mut slots) {
        Ok(httparse::Status::Complete((_, fields))) => fields,
        _ => return Err(invalid_body("invalid trailer section")),
    };
    let mut trailers = HeaderMap::with_capacity(fields.len());
    for field in fields.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| invalid_body("invalid trailer field name"))?;
        let value = HeaderValue::from_maybe_shared(section.slice_ref(field.value))
            .map_err(|_| invalid_body("invalid trailer field value"))?;
        trailers.append(name, value);
    }
    Ok(trailers)
}

fn invalid_body(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl Body for DirectBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if matches!(this.framing, Framing::Failed(_)) {
            if let Framing::Failed(err) = std::mem::replace(&mut this.framing, Framing::Done) {
                return Poll::Ready(Some(Err(err)));
            }
        }
        loop {
            match this.step() {
                Ok(Step::Frame(frame)) => {
                    this.finish_if_done();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Ok(Step::Last(frame)) => {
                    this.framing = Framing::Done;
                    this.finish_if_done();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Ok(Step::End) => {
                    this.framing = Framing::Done;
                    this.finish_if_done();
                    return Poll::Ready(None);
                }
                Ok(Step::Read) => {}
                Err(err) => return this.fail(err, cx),
            }
            let Some(conn) = &mut this.conn else {
                return Poll::Ready(None);
            };
            conn.buf.reserve(READ_CHUNK);
            let read = pin!(conn.stream.read_buf(&mut conn.buf)).poll(cx);
            match read {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) if matches!(this.framing, Framing::UntilClose) => {
                    // The close is the end of this body; the connection cannot be used again.
                    this.framing = Framing::Done;
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => {
                    let err = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "upstream closed the connection in the middle of a response body",
                    );
                    return this.fail(err, cx);
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(err)) => return this.fail(err, cx),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::Done | Framing::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` read as a response head, its fields going where `answer` says.
    fn read_text(
        text: &str,
        head_only: bool,
        answer: &mut Answer<'_>,
    ) -> Result<Option<Head>, String> {
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
        let mut req = Request::new(RequestBody::unlimited(crate::body::ClientBody::Empty));
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
            let mut req = Request::new(RequestBody::unlimited(crate::body::ClientBody::Empty));
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
}
