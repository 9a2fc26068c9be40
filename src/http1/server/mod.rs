//! tollgate's own HTTP/1.1 path for simple requests, on plain-TCP and TLS connections (issue 16).
//!
//! Most requests a rate-limiting proxy sees are HTTP/1.1 requests without a body (`GET`,
//! `HEAD`, `DELETE`...). For those, hyper's server parsed each head a second time after the
//! framing guard had parsed it, and ran its dispatcher, channels and encoder around a request
//! that is one head in and one response out. Here a connection starts on this path: one task
//! reads a head, parses it once (httparse), lets the framing guard's own judgement decide
//! whether it is clean ([`head::scan_head`], [`guard::accepts_without_body`]), builds the
//! request from that one parse, runs the proxy, and writes the response head into a buffer the
//! connection keeps, with small bodies copied behind it: usually one write per response.
//!
//! The path takes only what it can serve exactly as hyper would. At the first request it does
//! not take, it stops, and hands hyper the connection with the bytes it has read and not used
//! (the request's head first): that request and everything after it go through the framing
//! guard and hyper, as every request did before. It does not take:
//!
//! - anything that is not a whole, clean HTTP/1.1 head in the first [`SIMPLE_MAX_HEAD`] bytes
//!   (bare LF, folds, HTTP/1.0, HTTP/2's preface, a head too large or malformed: the guard and
//!   hyper answer those with their 400, 414 and 431, or switch to HTTP/2);
//! - a body (`Content-Length` other than 0, `Transfer-Encoding`);
//! - `Upgrade`, `Expect`, `CONNECT`, a `Connection` field with any token but `close` and
//!   `keep-alive`, more than hyper's 100 header fields, a target `http::Uri` refuses.
//!
//! What it does, it does as hyper 1.x's HTTP/1.1 server does (`proto/h1/role.rs`): the same
//! status line and lower-case field names; `content-length` from the body's known length or
//! `transfer-encoding: chunked` when it is unknown; no body for `HEAD`, 1xx, 204 and 304;
//! trailers only to a client that sent `TE: trailers`, only those announced in the
//! response's `Trailer` field and allowed in one; data past an announced length cut; a
//! `date` field when the response has none; `connection: close` when the client asked for it
//! or the server is draining, and then a close. A client that goes away while its request is
//! in flight is seen with a one-byte peek on a plain socket ([`ClientStream::poll_peer_closed`])
//! and by reading ahead through TLS (as hyper reads), and the request (with its upstream
//! exchange) is dropped, as on hyper's path. A TLS connection that agreed on HTTP/2 by ALPN
//! never comes here ([`ClientStream::may_speak_h1`]).

use std::future::Future;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use super::guard;
use super::head::{self, HeadScan};
use super::lines::ResponseLines;
use super::rules::{self, HYPER_MAX_FIELDS, SIMPLE_MAX_HEAD};
use crate::body::{BodyError, ClientBody, ProxyBody, UpstreamBody};
use crate::headers;
use crate::proxy::{ConnInfo, Proxy};
use crate::server::connection::{Activity, ClientStream, InFlight};

/// Fields the forwarder may add to a request's map on tollgate's own client (a `Trailer`
/// announcement; `Host` replaces the client's). What it adds for every request goes into the
/// head as lines (`headers::Added`), and hyper's clients reserve room for it themselves: a
/// map sized for it here would be allocated larger than it needs, past the allocator's cache
/// of small blocks, on every request.
const FORWARDER_FIELDS: usize = 1;
/// Body data at least this long is written from where it is, not copied behind the head.
const COPY_LIMIT: usize = 8 * 1024;
/// A body whose frames keep coming ready is written out once this much has gathered: the
/// response buffer stays bounded whatever the upstream sends.
const FLUSH_AT: usize = 64 * 1024;
/// What a connection's response buffer starts with: room for the usual head and small body.
const USUAL_OUT: usize = 1024;
/// The most a connection's response buffer keeps allocated between responses. A large
/// upstream head (up to about 408 KiB) or a body written in many small frames (up to
/// [`FLUSH_AT`] and one frame) grows it; kept at that size, a thousand idle keep-alive
/// connections could hold a hundred MiB.
const KEPT_OUT: usize = 16 * 1024;
/// What a connection's read buffer starts with, as hyper's.
const READ_BUFFER: usize = 8 * 1024;
/// Room kept for one read ahead while a request is in flight (TLS: [`poll_read_ahead`]).
const READ_AHEAD: usize = 4 * 1024;

/// How the simple path ended.
pub(crate) enum Ending {
    /// The connection is done: the client closed it, a response asked to close it, or it
    /// failed.
    Closed,
    /// A request this path does not take: hyper serves the rest of the connection, starting
    /// with `buffered` (the bytes read and not used), after the requests served here (as many
    /// as the connection's `Activity` has started).
    HandOver { buffered: Bytes },
}

/// Serves simple requests on `stream` until the connection ends or a request is not simple.
pub(crate) async fn serve<S: ClientStream>(
    stream: &mut S,
    info: &ConnInfo,
    proxy: &Proxy,
    activity: &Arc<Activity>,
) -> Ending {
    let mut conn = Simple {
        stream,
        activity,
        buf: BytesMut::with_capacity(READ_BUFFER),
        out: Vec::with_capacity(USUAL_OUT),
        fields: Vec::with_capacity(16),
        date: DateField::default(),
        watch: CloseWatch { on: false },
    };
    loop {
        let head = match conn.next_head().await {
            Ok(head) => head,
            Err(Stop::Close) => {
                // The client's close or a drain: either way the connection ends with a close
                // of tollgate's own, which through TLS is a `close_notify` (TLS 1.3 asks for
                // one before the write side closes, TLS 1.2 for one in answer to the peer's),
                // as hyper's path shuts its stream down.
                let _ = conn.stream.shutdown().await;
                return Ending::Closed;
            }
            Err(Stop::HandOver) => return conn.hand_over(),
        };
        let Some((request, asks)) = conn.build(head) else {
            return conn.hand_over();
        };
        if !conn.exchange(request, asks, info, proxy).await {
            let _ = conn.stream.shutdown().await;
            return Ending::Closed;
        }
    }
}

/// An emptied response buffer, its allocation given back when a response grew it past
/// [`KEPT_OUT`].
fn give_back_grown(out: &mut Vec<u8>) {
    if out.capacity() > KEPT_OUT {
        *out = Vec::with_capacity(USUAL_OUT);
    }
}

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
    let request = request_from(&frozen, &head, &fields)?;
    Some((head.len, request.map(|_| ()), head.asks.close))
}

/// Why the wait for a head ended without one.
enum Stop {
    Close,
    HandOver,
}

/// One connection on the simple path.
struct Simple<'a, S> {
    stream: &'a mut S,
    activity: &'a Arc<Activity>,
    /// Bytes read and not used yet: the next head, and whatever a client pipelined after it.
    buf: BytesMut,
    /// The response being written; kept (cleared) from response to response.
    out: Vec<u8>,
    /// Where the head's fields are (name, value), from its one parse; kept likewise.
    fields: Vec<(Range<usize>, Range<usize>)>,
    date: DateField,
    watch: CloseWatch,
}

/// The look for a client's close while its request is in flight (a peek of one byte). Bytes
/// already read after the request (a pipelining client), or seen waiting, hide a close behind
/// them, as they did from hyper's own check: the look stops for the rest of the exchange.
struct CloseWatch {
    on: bool,
}

impl CloseWatch {
    fn start(&mut self, buffered: &BytesMut) {
        self.on = buffered.is_empty();
    }

    /// Whether the client has gone; when it has not, the task is woken if it does. A plain
    /// socket is peeked at ([`ClientStream::poll_peer_closed`]). Through TLS a peek would see
    /// the encrypted `close_notify` rather than the close, so the stream is read instead, as
    /// hyper reads it: what arrives is the next request's, and goes to `buffered`.
    fn client_gone<S: ClientStream>(
        &mut self,
        stream: &mut S,
        buffered: &mut BytesMut,
        cx: &mut Context<'_>,
    ) -> bool {
        if !self.on {
            return false;
        }
        let seen = if S::SEES_CLOSE {
            stream.poll_peer_closed(cx)
        } else {
            poll_read_ahead(stream, buffered, cx)
        };
        match seen {
            Poll::Ready(true) => true,
            // Bytes are waiting: a close cannot be seen behind them.
            Poll::Ready(false) => {
                self.on = false;
                false
            }
            Poll::Pending => false,
        }
    }
}

/// One read into `buffered` while a request is in flight: `Ready(true)` when the stream ended
/// or failed, `Ready(false)` when bytes arrived. It reads into the buffer's spare room, which
/// is not zeroed first as an array on the stack would be at every poll.
fn poll_read_ahead<S: AsyncRead + Unpin>(
    stream: &mut S,
    buffered: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<bool> {
    buffered.reserve(READ_AHEAD);
    match pin!(stream.read_buf(buffered)).poll(cx) {
        Poll::Ready(Ok(n)) => Poll::Ready(n == 0),
        Poll::Ready(Err(_)) => Poll::Ready(true),
        Poll::Pending => Poll::Pending,
    }
}

/// Where a head's parts are in its bytes (its fields: [`Simple::fields`]): one parse, read
/// again once the bytes are frozen.
struct ParsedHead {
    len: usize,
    method: Method,
    target: Range<usize>,
    asks: Asks,
}

/// What the client's fields ask of the response.
#[derive(Clone, Copy, Default)]
struct Asks {
    /// `Connection: close`.
    close: bool,
    /// `TE: trailers`: hyper sends a response's trailer fields only then.
    trailers: bool,
}

impl<'a, S: ClientStream> Simple<'a, S> {
    fn hand_over(&mut self) -> Ending {
        Ending::HandOver {
            buffered: std::mem::take(&mut self.buf).freeze(),
        }
    }

    /// Reads until the buffer starts with a whole head, and parses it.
    async fn next_head(&mut self) -> Result<ParsedHead, Stop> {
        loop {
            if !self.buf.is_empty() {
                match head::scan_head(&self.buf) {
                    HeadScan::Whole { end, folded: false } => {
                        let parsed = parse_head(&self.buf[..end], &mut self.fields);
                        return parsed.ok_or(Stop::HandOver);
                    }
                    HeadScan::Unfinished if self.buf.len() < SIMPLE_MAX_HEAD => {}
                    _ => return Err(Stop::HandOver),
                }
            }
            self.buf.reserve(READ_BUFFER);
            let (stream, buf, activity) = (&mut *self.stream, &mut self.buf, self.activity);
            let read = std::future::poll_fn(|cx| {
                // A drain closes a connection between requests, as hyper's graceful shutdown
                // does; a head that has begun to arrive is read and answered first.
                if buf.is_empty() && activity.draining() {
                    return Poll::Ready(Ok(0));
                }
                pin!(stream.read_buf(buf)).poll(cx)
            });
            match read.await {
                Ok(0) | Err(_) => return Err(Stop::Close),
                Ok(_) => self.activity.touch(),
            }
        }
    }

    /// The request for a parsed head, and whether the client asked to close; None (the head
    /// left in the buffer) when `http` refuses a part of it that httparse accepted.
    fn build(&mut self, head: ParsedHead) -> Option<(Request<ClientBody>, Asks)> {
        // The target and values share the head's bytes, as hyper's do.
        let frozen = self.buf.split_to(head.len).freeze();
        let built = request_from(&frozen, &head, &self.fields);
        if built.is_none() {
            // Give the head back: hyper answers what `http` refuses.
            let mut whole = BytesMut::with_capacity(frozen.len() + self.buf.len());
            whole.extend_from_slice(&frozen);
            whole.extend_from_slice(&self.buf);
            self.buf = whole;
        }
        built.map(|request| (request, head.asks))
    }

    /// Runs one request and writes its response; false when the connection must end.
    // Not an `async fn`: that would keep `request` twice, as its argument and as a local of its
    // body (rust-lang/rust#62958).
    #[allow(clippy::manual_async_fn)]
    fn exchange<'f>(
        &'f mut self,
        request: Request<ClientBody>,
        asks: Asks,
        info: &'f ConnInfo,
        proxy: &'f Proxy,
    ) -> impl Future<Output = bool> + use<'f, 'a, S> {
        async move {
            let head_request = request.method() == Method::HEAD;
            let _in_flight = InFlight::start(self.activity.clone());
            self.watch.start(&self.buf);
            let response = {
                let handling = pin!(proxy.handle(request, info.clone()));
                self.unless_client_goes(handling).await
            };
            let Some(response) = response else {
                return false;
            };
            let closing = asks.close || self.activity.draining();
            let (parts, mut body) = response.into_parts();
            let mut framing = self.encode_head(&parts, &body, head_request, closing);
            if !asks.trailers {
                if let Some(BodyFraming::Chunked(names)) = &mut framing.body {
                    *names = None;
                }
            }
            if framing.body.is_none() {
                // Nothing of the body goes out (HEAD, 204, 304...): dropped unread, as hyper does,
                // once an upstream connection it holds for its lines has gone back.
                body.finish_unsent();
            } else if !self.send_body(&mut body, &mut framing.body).await {
                // What was ready goes out, as hyper writes it before it closes: the client sees a
                // cut response, not none.
                let _ = self.flush_out().await;
                return false;
            }
            if !self.flush_out().await {
                return false;
            }
            give_back_grown(&mut self.out);
            !framing.last
        }
    }

    /// Waits for `work`, watching for the client's close while it runs: None when the client
    /// went away (and `work` is dropped, with whatever it had started upstream).
    async fn unless_client_goes<T>(
        &mut self,
        mut work: Pin<&mut impl Future<Output = T>>,
    ) -> Option<T> {
        let (stream, buf, watch) = (&mut *self.stream, &mut self.buf, &mut self.watch);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = work.as_mut().poll(cx) {
                return Poll::Ready(Some(output));
            }
            if watch.client_gone(stream, buf, cx) {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await
    }

    /// Writes the status line and fields into `out` (the map's, then the lines the body
    /// carries: [`lines_of`]), and says how the body goes.
    fn encode_head(
        &mut self,
        parts: &http::response::Parts,
        body: &ProxyBody,
        head_request: bool,
        closing: bool,
    ) -> Framing {
        let out = &mut self.out;
        out.clear();
        let status = parts.status;
        let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>();
        if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
            // hyper cannot send a 1xx as the response either: it answers 500 and closes.
            out.extend_from_slice(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n");
            self.date.write(out);
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
        let lines = lines_of(body);
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
                None => return self.refused_response(),
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
                    let names =
                        names.filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok());
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
            self.date.write(out);
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

    /// What hyper sends for a response it refuses to encode (conflicting lengths): nothing of
    /// it, an error, and the connection closes. The client sees it close.
    fn refused_response(&mut self) -> Framing {
        self.out.clear();
        Framing::none(true)
    }

    /// Streams the body behind the head in `out`, framed as `framing` says; false when the
    /// connection must end (the body failed, its length was wrong, the client went away).
    async fn send_body(&mut self, body: &mut ProxyBody, framing: &mut Option<BodyFraming>) -> bool {
        loop {
            let (stream, buf, watch) = (&mut *self.stream, &mut self.buf, &mut self.watch);
            let has_output = !self.out.is_empty();
            let step = std::future::poll_fn(|cx| match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(frame) => Poll::Ready(Step::Frame(frame)),
                // Whatever is ready goes out in one write before waiting for more.
                Poll::Pending if has_output => Poll::Ready(Step::Flush),
                Poll::Pending if watch.client_gone(stream, buf, cx) => Poll::Ready(Step::Gone),
                Poll::Pending => Poll::Pending,
            })
            .await;
            let frame = match step {
                Step::Flush => {
                    if !self.flush_out().await {
                        return false;
                    }
                    continue;
                }
                Step::Gone | Step::Frame(Some(Err(_))) => return false,
                Step::Frame(None) => return self.end_body(framing),
                Step::Frame(Some(Ok(frame))) => frame,
            };
            let frame = match frame.into_data() {
                Ok(data) => {
                    if !self.send_data(data, framing).await {
                        return false;
                    }
                    if matches!(framing, Some(BodyFraming::Length(0))) {
                        // The announced length has gone out: hyper stops there, and drops
                        // the rest of the body unread.
                        return true;
                    }
                    if self.out.len() >= FLUSH_AT && !self.flush_out().await {
                        return false;
                    }
                    continue;
                }
                Err(frame) => frame,
            };
            // Trailer fields go out only where the client said it takes them (`TE:
            // trailers`) and the response announced them; else the body ends without them.
            if let (Ok(trailers), Some(BodyFraming::Chunked(Some(names)))) =
                (frame.into_trailers(), &*framing)
            {
                self.out.extend_from_slice(b"0\r\n");
                write_trailers(&mut self.out, &trailers, names);
                self.out.extend_from_slice(b"\r\n");
                // The last chunk is written: nothing more may follow.
                *framing = None;
            }
        }
    }

    /// One data frame, framed as `framing` says.
    async fn send_data(&mut self, data: Bytes, framing: &mut Option<BodyFraming>) -> bool {
        if data.is_empty() {
            return true;
        }
        match framing {
            Some(BodyFraming::Length(left)) => {
                // More than the announced length: hyper sends what was announced, no more.
                let fits = usize::try_from(*left).unwrap_or(usize::MAX);
                let data = if data.len() > fits {
                    data.slice(..fits)
                } else {
                    data
                };
                *left -= data.len() as u64;
                self.send_bytes(&data, b"").await
            }
            Some(BodyFraming::Chunked(_)) => {
                let mut size = [0u8; 16];
                let size = hex(data.len(), &mut size);
                self.out.extend_from_slice(size);
                self.out.extend_from_slice(b"\r\n");
                self.send_bytes(&data, b"\r\n").await
            }
            // After the last chunk: nothing is written.
            None => true,
        }
    }

    /// `data` then `suffix` behind what `out` holds: copied when short, else written from
    /// where it is, with `out`, in one vectored write.
    async fn send_bytes(&mut self, data: &[u8], suffix: &[u8]) -> bool {
        if data.len() < COPY_LIMIT {
            self.out.extend_from_slice(data);
            self.out.extend_from_slice(suffix);
            return true;
        }
        let out = std::mem::take(&mut self.out);
        let sent = self.write_all(&[&out, data, suffix]).await;
        self.out = out;
        self.out.clear();
        sent
    }

    /// The end of the body: the last chunk, or a check that the announced length was sent.
    fn end_body(&mut self, framing: &Option<BodyFraming>) -> bool {
        match framing {
            Some(BodyFraming::Chunked(_)) => {
                self.out.extend_from_slice(b"0\r\n\r\n");
                true
            }
            // Fewer bytes than announced: the client must not wait for the rest.
            Some(BodyFraming::Length(left)) => *left == 0,
            None => true,
        }
    }

    async fn flush_out(&mut self) -> bool {
        if self.out.is_empty() {
            return true;
        }
        let out = std::mem::take(&mut self.out);
        let sent = self.write_all(&[&out]).await;
        self.out = out;
        self.out.clear();
        sent
    }

    /// Writes all of `parts` (vectored); false when the write failed or the client went away
    /// while it waited (a client that stops reading and leaves would otherwise hold its
    /// request until `idle_timeout`).
    async fn write_all(&mut self, parts: &[&[u8]]) -> bool {
        // At most a buffer, a data frame and its chunk's end: no allocation per write.
        let mut storage = [IoSlice::new(&[]); 3];
        let mut count = 0;
        for part in parts.iter().filter(|p| !p.is_empty()).take(storage.len()) {
            storage[count] = IoSlice::new(part);
            count += 1;
        }
        let mut slices = &mut storage[..count];
        while !slices.is_empty() {
            let written = self
                .io_unless_client_goes(|stream, cx| stream.poll_write_vectored(cx, slices))
                .await;
            match written {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    self.activity.touch();
                    IoSlice::advance_slices(&mut slices, n);
                }
            }
        }
        // TLS keeps what it could not send yet (a socket's flush does nothing).
        let flushed = self.io_unless_client_goes(|stream, cx| stream.poll_flush(cx));
        flushed.await.is_ok()
    }

    /// One operation on the stream (`poll`), until it is done or the client is seen to have
    /// gone while it waits: then a `ConnectionAborted` error.
    async fn io_unless_client_goes<T>(
        &mut self,
        mut poll: impl FnMut(Pin<&mut S>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> io::Result<T> {
        let (stream, buf, watch) = (&mut *self.stream, &mut self.buf, &mut self.watch);
        std::future::poll_fn(|cx| match poll(Pin::new(&mut *stream), cx) {
            Poll::Pending if watch.client_gone(stream, buf, cx) => {
                Poll::Ready(Err(io::ErrorKind::ConnectionAborted.into()))
            }
            done => done,
        })
        .await
    }
}

/// One wait of [`Simple::send_body`].
enum Step {
    Frame(Option<Result<Frame<Bytes>, BodyError>>),
    /// The body has nothing ready: write what is buffered first.
    Flush,
    /// The client went away.
    Gone,
}

/// What hyper knows of a body when it writes the head.
#[derive(Clone, Copy)]
enum Length {
    /// It has ended already (`is_end_stream`).
    Nothing,
    Known(u64),
    Unknown,
}

enum BodyFraming {
    /// Bytes still to send.
    Length(u64),
    /// Chunked, with the trailer fields the response announced.
    Chunked(Option<Vec<HeaderName>>),
}

/// The field lines a response carries to this server: those of a response tollgate's own
/// client read for it (`DirectBody::lines`), the upstream's kept fields and the ones tollgate
/// set; None for any other response, whose fields are all in its map.
fn lines_of(body: &ProxyBody) -> Option<&ResponseLines> {
    match body {
        ProxyBody::Upstream(UpstreamBody::Direct(body)) => body.lines(),
        _ => None,
    }
}

/// How one response's body goes: None when no body follows the head.
struct Framing {
    body: Option<BodyFraming>,
    /// The connection closes after this response.
    last: bool,
}

impl Framing {
    fn none(last: bool) -> Self {
        Framing { body: None, last }
    }
}

/// The request of a head: its bytes, its parse and its fields' places.
fn request_from(
    head: &Bytes,
    parsed: &ParsedHead,
    fields: &[(Range<usize>, Range<usize>)],
) -> Option<Request<ClientBody>> {
    let uri = Uri::from_maybe_shared(head.slice(parsed.target.clone())).ok()?;
    let mut request = Request::new(ClientBody::Simple);
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
fn parse_head(bytes: &[u8], fields: &mut Vec<(Range<usize>, Range<usize>)>) -> Option<ParsedHead> {
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
fn write_trailers(out: &mut Vec<u8>, trailers: &HeaderMap, announced: &[HeaderName]) {
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
fn hex(mut n: usize, buf: &mut [u8; 16]) -> &[u8] {
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
struct DateField {
    second: u64,
    /// `date: <IMF-fixdate>\r\n\r\n`: the field and the end of the head.
    line: Vec<u8>,
}

impl DateField {
    fn write(&mut self, out: &mut Vec<u8>) {
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

    fn parsed(head: &str) -> Option<ParsedHead> {
        parse_head(head.as_bytes(), &mut Vec::new())
    }

    #[test]
    fn a_response_buffer_grown_past_the_kept_size_is_given_back() {
        let mut out = Vec::with_capacity(USUAL_OUT);
        out.extend_from_slice(&[b'x'; KEPT_OUT / 2]);
        out.clear();
        give_back_grown(&mut out);
        assert!(out.capacity() >= KEPT_OUT / 2, "a usual size is kept");
        out.extend_from_slice(&vec![b'x'; FLUSH_AT + COPY_LIMIT]);
        out.clear();
        give_back_grown(&mut out);
        assert!(
            out.capacity() <= KEPT_OUT,
            "a grown buffer is given back: {}",
            out.capacity()
        );
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
