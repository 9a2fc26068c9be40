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
use std::ops::Range;
use std::pin::{pin, Pin};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::head::{self, HeadScan};
use super::lines::ResponseLines;
use super::rules::SIMPLE_MAX_HEAD;

mod encode;
mod parse;

use encode::{encode_head, hex, write_trailers, BodyFraming, DateField};
pub use parse::simple_request;
use parse::{parse_head, request_from, Asks, ParsedHead};
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

/// A client connection's byte stream, and whether tollgate can see the client close it
/// without reading from it.
///
/// hyper notices a client that goes away while its request waits for the upstream by reading
/// from the connection (`mid_message_detect_eof`), and for that read it allocates a fresh
/// 8 KiB buffer per request (its last one still holds the request's head). Where the stream is
/// a plain socket, tollgate looks instead, the way nginx does: a peek of one byte, from the
/// socket wrapper's `poll_flush`, which hyper calls at every turn of the connection while the
/// request is in flight. Through TLS a peek would see the encrypted `close_notify`, not the
/// close, so hyper's read stays in charge there.
pub trait ClientStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Whether [`ClientStream::poll_peer_closed`] answers; hyper's own check is turned off
    /// (`half_close`) exactly when it does.
    const SEES_CLOSE: bool;

    /// `Ready(true)`: the client closed the connection (or it failed); `Ready(false)`: bytes
    /// are waiting to be read, so a close cannot be seen behind them; `Pending`: neither, and
    /// the task is woken when that changes. Never consumes a byte.
    fn poll_peer_closed(&self, cx: &mut Context<'_>) -> Poll<bool>;

    /// Whether HTTP/1.1 may be spoken on the connection, so that its first requests go to the
    /// simple path ([`serve`]): false only for TLS that agreed on HTTP/2 by ALPN.
    fn may_speak_h1(&self) -> bool;
}

/// What tollgate's own server serves requests for: the proxy behind it and the record the
/// connection keeps of its activity (`server::connection`). The server itself knows bytes and
/// HTTP/1.1 only; the request and response bodies are the service's.
pub trait Service {
    /// The body of a request this server read: there is none, and it says that the response
    /// goes back to this server, which takes field lines (`ClientBody::Simple`).
    type RequestBody;
    /// The body of a response.
    type ResponseBody: Body<Data = Bytes> + Unpin;
    /// Held while a request is in flight.
    type InFlight;

    /// The body of the next request.
    fn request_body(&self) -> Self::RequestBody;

    /// The response to `request`.
    fn call(
        &self,
        request: Request<Self::RequestBody>,
    ) -> impl Future<Output = Response<Self::ResponseBody>> + Send;

    /// The field lines a response's body carries, written after the map's fields: those of a
    /// response tollgate's own client read for this server (the upstream's kept fields and
    /// the ones tollgate set); None for any other, whose fields are all in its map.
    fn lines(body: &Self::ResponseBody) -> Option<&ResponseLines>;

    /// Drops a body of which nothing is sent (HEAD, 204, 304), as hyper does, once an upstream
    /// connection it keeps for its lines has gone back to its pool.
    fn finish_unsent(body: Self::ResponseBody);

    /// Bytes moved on the connection.
    fn touch(&self);

    /// The server is draining: close between requests, and say so on the response in flight.
    fn draining(&self) -> bool;

    /// A request starts; it is in flight until what this returns is dropped.
    fn start(&self) -> Self::InFlight;
}

/// How the simple path ended.
pub enum Ending {
    /// The connection is done: the client closed it, a response asked to close it, or it
    /// failed.
    Closed,
    /// A request this path does not take: hyper serves the rest of the connection, starting
    /// with `buffered` (the bytes read and not used), after the requests served here (as many
    /// as the connection's `Activity` has started).
    HandOver { buffered: Bytes },
}

/// Serves simple requests on `stream` until the connection ends or a request is not simple.
pub async fn serve<S: ClientStream, V: Service>(stream: &mut S, service: &V) -> Ending {
    let mut conn = Simple {
        stream,
        service,
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
        if !conn.exchange(request, asks).await {
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

/// Why the wait for a head ended without one.
enum Stop {
    Close,
    HandOver,
}

/// One connection on the simple path.
struct Simple<'a, S, V> {
    stream: &'a mut S,
    service: &'a V,
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

impl<'a, S: ClientStream, V: Service> Simple<'a, S, V> {
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
            let (stream, buf, service) = (&mut *self.stream, &mut self.buf, self.service);
            let read = std::future::poll_fn(|cx| {
                // A drain closes a connection between requests, as hyper's graceful shutdown
                // does; a head that has begun to arrive is read and answered first.
                if buf.is_empty() && service.draining() {
                    return Poll::Ready(Ok(0));
                }
                pin!(stream.read_buf(buf)).poll(cx)
            });
            match read.await {
                Ok(0) | Err(_) => return Err(Stop::Close),
                Ok(_) => self.service.touch(),
            }
        }
    }

    /// The request for a parsed head, and whether the client asked to close; None (the head
    /// left in the buffer) when `http` refuses a part of it that httparse accepted.
    fn build(&mut self, head: ParsedHead) -> Option<(Request<V::RequestBody>, Asks)> {
        // The target and values share the head's bytes, as hyper's do.
        let frozen = self.buf.split_to(head.len).freeze();
        let built = request_from(&frozen, &head, &self.fields, self.service.request_body());
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
        request: Request<V::RequestBody>,
        asks: Asks,
    ) -> impl Future<Output = bool> + use<'f, 'a, S, V> {
        async move {
            let head_request = request.method() == Method::HEAD;
            let _in_flight = self.service.start();
            self.watch.start(&self.buf);
            let response = {
                let handling = pin!(self.service.call(request));
                self.unless_client_goes(handling).await
            };
            let Some(response) = response else {
                return false;
            };
            let closing = asks.close || self.service.draining();
            let (parts, mut body) = response.into_parts();
            let (out, date) = (&mut self.out, &mut self.date);
            let lines = V::lines(&body);
            let mut framing = encode_head(out, date, &parts, lines, &body, head_request, closing);
            if !asks.trailers {
                if let Some(BodyFraming::Chunked(names)) = &mut framing.body {
                    *names = None;
                }
            }
            if framing.body.is_none() {
                // Nothing of the body goes out (HEAD, 204, 304...): dropped unread, as hyper does.
                V::finish_unsent(body);
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

    /// Streams the body behind the head in `out`, framed as `framing` says; false when the
    /// connection must end (the body failed, its length was wrong, the client went away).
    async fn send_body(
        &mut self,
        body: &mut V::ResponseBody,
        framing: &mut Option<BodyFraming>,
    ) -> bool {
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
                    self.service.touch();
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
enum Step<E> {
    Frame(Option<Result<Frame<Bytes>, E>>),
    /// The body has nothing ready: write what is buffered first.
    Flush,
    /// The client went away.
    Gone,
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
