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
use std::ops::Range;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::lines::{field_line, AddTo, ResponseLines};
use super::rules::HYPER_MAX_RESPONSE_HEAD;
use crate::error::RequestError;
use crate::headers::{Added, ResponseFields};

mod chunked;
mod compare;
mod head;
#[cfg(test)]
mod tests;

use chunked::{chunk_step, Chunked};
pub use compare::{lines_against_the_map, read_response};

/// Where the fields tollgate sets on a response go (`X-Request-Id`, the rate-limit fields):
/// the field lines of `body` when tollgate's own client read it for tollgate's own server,
/// else `map`, the response's own, with room made for them. `body`: the response's, when
/// tollgate's own client read it.
pub fn response_fields<'a>(
    body: Option<&'a mut DirectBody>,
    map: &'a mut HeaderMap,
) -> impl ResponseFields + 'a {
    let mut to = match body {
        Some(body) => body.fields_to(map),
        None => AddTo::Map(map),
    };
    if let AddTo::Map(headers) = &mut to {
        // Room for the rate-limit fields (up to four, with `both`) and `X-Request-Id` in one
        // growth of the map sized for the upstream's fields, instead of a growth (a rehash) on
        // the way.
        headers.reserve(5);
    }
    to
}

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

/// Where idle connections wait for their next request: the pool that made them (`forward`'s
/// lanes, one per connection worker). The client knows no more of the pool than this.
pub(crate) trait Park: Send + Sync {
    /// Takes `conn`, whose response has been read whole, back as idle on `worker`'s list of
    /// connections to `origin`.
    fn park(&self, worker: usize, origin: usize, conn: Box<DirectConn>);
}

/// Where a connection goes back to once its response has been read: its worker's lane.
pub(crate) struct Parking {
    pub(crate) pool: Arc<dyn Park>,
    pub(crate) worker: usize,
    pub(crate) origin: usize,
}

impl DirectConn {
    /// A connection on `stream`, which the pool's connector made (`UpstreamPool::connect`: the
    /// same resolution, `connect_timeout` and socket options as hyper's client gets) to a
    /// plain-HTTP origin.
    pub(crate) fn new(stream: TcpStream) -> Box<DirectConn> {
        Box::new(DirectConn {
            stream,
            buf: BytesMut::with_capacity(READ_CHUNK),
            out: Vec::with_capacity(512),
            fields: Vec::with_capacity(16),
            lines: ResponseLines::new(),
        })
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
pub(crate) fn exchange<'r, B>(
    mut conn: Box<DirectConn>,
    req: &'r Request<B>,
    added: &Added<'_>,
    reply: &'r Reply,
    parking: Parking,
) -> impl Future<Output = Result<Response<DirectBody>, ExchangeError>> + use<'r, B> {
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
fn encode_request<B>(req: &Request<B>, added: &Added<'_>, out: &mut Vec<u8>) {
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
            if let Some(head) = head::parse_head(&mut conn.buf, fields, head_only, &mut answer)? {
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
                parking.pool.park(parking.worker, parking.origin, conn);
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
    fn fields_to<'a>(&'a mut self, map: &'a mut HeaderMap) -> AddTo<'a> {
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
