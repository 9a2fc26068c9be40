//! The HTTP/1.1 framing guard: the first stage of the pipeline, below hyper (contract §4a
//! and 9).
//!
//! hyper parses requests correctly but resolves ambiguity silently: with both
//! `Content-Length` and `Transfer-Encoding` it drops the length, it reads `Content-Length:
//! 010` as ten, and it accepts bare-LF line endings. Each is how a front end and a back end come
//! to disagree about where a request ends (request smuggling), and tollgate stands in front of
//! backends that trust it. So every byte a client sends on an HTTP/1 connection goes through
//! this guard first. It follows the framing itself — request head, then a `Content-Length` or
//! chunked body, then the next head — and refuses the connection at the first ambiguity:
//!
//! - a line ending that is not CRLF, or an obsolete folded header line;
//! - `Content-Length` that is not plain digits (no sign, no leading zero, no list), given twice,
//!   or given together with `Transfer-Encoding`;
//! - `Transfer-Encoding` other than exactly `chunked` (RFC 9112 6.1), or on HTTP/1.0;
//! - a chunk size that is not hex, overflows, or a chunk not followed by CRLF;
//! - a head larger than [`MAX_HEAD`] (431);
//! - a request target longer than [`MAX_TARGET`] (414, contract §5), whether the head is complete
//!   or already past [`MAX_HEAD`]: hyper would forward a target of up to 64 KiB, and the
//!   answer to a long target must not depend on how long the rest of the head is.
//!
//! A refused first request gets a `400` (or `414`, `431`) and the connection closes; later in a
//! connection the guard only closes, since a response to an earlier request may be on the
//! wire. Nothing after a refused byte reaches hyper, so nothing after it reaches an upstream.
//! HTTP/2 (prior knowledge or ALPN) passes through untouched: HTTP/2 frames carry their own
//! lengths. So does a connection after a real switch to WebSocket, but only once the server
//! says so ([`FramingGuard::step_aside`], called when it hands hyper a `101` that the forwarder
//! checked): nothing in the bytes, in either direction, turns the guard off. A response body
//! can say anything, `HTTP/1.1 101` included.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::head::{scan_head, HeadScan};
use super::rules::{
    self, BadChunkLine, ChunkSizes, GUARD_MAX_CHUNK_LINE, GUARD_MAX_FIELDS, MAX_HEAD, MAX_TARGET,
    MAX_TRAILERS,
};

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const BAD_REQUEST: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
content-length: 12\r\nconnection: close\r\n\r\nBad Request\n";
const TOO_LARGE: &[u8] =
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; \
charset=utf-8\r\ncontent-length: 32\r\nconnection: close\r\n\r\nRequest Header Fields Too Large\n";
const URI_TOO_LONG: &[u8] = b"HTTP/1.1 414 URI Too Long\r\ncontent-type: text/plain; \
charset=utf-8\r\ncontent-length: 13\r\nconnection: close\r\n\r\nURI Too Long\n";

/// Why a connection was refused (for the debug log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    BareLineFeed,
    ObsoleteFold,
    MalformedHead,
    HeadTooLarge,
    TargetTooLong,
    BadContentLength,
    DuplicateContentLength,
    LengthAndChunked,
    BadTransferEncoding,
    BadChunk,
}

#[derive(Debug)]
enum State {
    /// Before the first byte: HTTP/2's preface or an HTTP/1 head.
    Start,
    /// Collecting a request head.
    Head,
    /// `n` body bytes still to come.
    Body(u64),
    Chunked(Chunk),
    /// HTTP/2, or switched to WebSocket: not HTTP/1 framing any more.
    PassThrough,
    /// Refused: write `response[written..]`, then end the stream.
    Refused {
        response: &'static [u8],
        written: usize,
    },
    /// The refusal's response is written: the write side is being closed (through TLS a
    /// `close_notify`, after what TLS still held of the response).
    ShuttingDown,
    Closed,
}

#[derive(Debug)]
enum Chunk {
    /// Reading a chunk-size line.
    Size,
    /// `n` data bytes to come, then CRLF.
    Data(u64),
    /// After a chunk's data: expecting `\r` (false) then `\n` (true).
    DataEnd(bool),
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

pub struct FramingGuard<S> {
    inner: S,
    /// Bytes read from `inner` before the guard took over (by tollgate's simple HTTP/1.1
    /// path), read first and judged like any others.
    prefix: Bytes,
    state: State,
    /// The head, chunk-size line or trailer section being collected.
    pending: Vec<u8>,
    /// Request heads accepted so far on this connection.
    heads_seen: u64,
    /// Of those, the heads whose bytes were handed to hyper (a refused read is not).
    heads_delivered: u64,
    trailer_bytes: usize,
}

impl<S> FramingGuard<S> {
    pub fn new(inner: S) -> Self {
        FramingGuard {
            inner,
            prefix: Bytes::new(),
            state: State::Start,
            pending: Vec::new(),
            heads_seen: 0,
            heads_delivered: 0,
            trailer_bytes: 0,
        }
    }

    /// A guard for a connection from which tollgate's simple HTTP/1.1 path has read
    /// `requests` requests whole, and `unread` bytes after them: those are read first. After a
    /// request, the next byte starts a head, HTTP/2's preface is no longer possible, and a
    /// refused head only closes the connection (a response went out before it).
    pub fn after_requests(inner: S, requests: u64, unread: Bytes) -> Self {
        let mut guard = FramingGuard::new(inner);
        guard.prefix = unread;
        if requests > 0 {
            guard.state = State::Head;
            guard.heads_seen = requests;
            guard.heads_delivered = requests;
        }
        guard
    }

    /// The stream the guard reads from, for a look that takes no bytes (a peek).
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Whether bytes read before the guard took over are still to be read: a look at the
    /// stream would not see them.
    pub fn has_unread(&self) -> bool {
        !self.prefix.is_empty()
    }

    /// Whether every request so far has been read whole (head and body) and the next byte
    /// would start a new head: the only time hyper's reads stop while a request is in flight.
    pub fn between_requests(&self) -> bool {
        matches!(self.state, State::Head)
    }

    /// Whether bytes of a request that hyper has not dispatched yet have been handed to it:
    /// the start of a head (split over reads), or `heads` (requests dispatched so far)
    /// fewer than the heads handed over (pipelined requests read together). hyper holds them
    /// in its buffer until it is done with the request in flight.
    pub fn hands_over_more_than(&self, heads: u64) -> bool {
        !self.pending.is_empty() || self.heads_delivered > heads
    }

    /// Whether the connection still carries HTTP/1 request heads: false once it has turned out
    /// to be HTTP/2 or has been upgraded. The connection's header-read deadline applies only
    /// while this holds.
    pub fn reads_http1_heads(&self) -> bool {
        !matches!(self.state, State::PassThrough)
    }

    /// The connection has switched to another protocol: a `101` that the forwarder checked is
    /// being handed to hyper, which reads no request head after it. From the next read on, the
    /// bytes are the new protocol's and pass untouched. A connection already refused stays
    /// refused.
    pub fn step_aside(&mut self) {
        if !matches!(
            self.state,
            State::Refused { .. } | State::ShuttingDown | State::Closed
        ) {
            self.pending = Vec::new();
            self.state = State::PassThrough;
        }
    }

    /// Runs the framing state machine over `bytes`; an error means they must not be handed on.
    fn inspect(&mut self, bytes: &[u8]) -> Result<(), Refusal> {
        let mut i = 0;
        while i < bytes.len() {
            match &mut self.state {
                State::Start => {
                    // Decide by the first bytes whether this is HTTP/2's preface.
                    let seen = self.pending.len();
                    let probe = &bytes[i..(i + H2_PREFACE.len() - seen).min(bytes.len())];
                    if H2_PREFACE[seen..].starts_with(probe) {
                        self.pending.extend_from_slice(probe);
                        i += probe.len();
                        if self.pending.len() == H2_PREFACE.len() {
                            self.pending.clear();
                            self.state = State::PassThrough;
                        }
                    } else {
                        // HTTP/1: what an earlier read held back is a head's start; this
                        // read's bytes go on as head bytes from `i`, uncopied.
                        self.state = State::Head;
                        let collected = std::mem::take(&mut self.pending);
                        if !collected.is_empty() {
                            self.inspect_head_bytes(&collected)?;
                        }
                    }
                }
                State::Head => {
                    let consumed = self.head_bytes(&bytes[i..])?;
                    i += consumed;
                }
                State::Body(remaining) => {
                    let take = (*remaining).min((bytes.len() - i) as u64);
                    *remaining -= take;
                    i += take as usize;
                    if *remaining == 0 {
                        self.state = State::Head;
                    }
                }
                State::Chunked(_) => {
                    let consumed = self.chunk_bytes(&bytes[i..])?;
                    i += consumed;
                }
                State::PassThrough
                | State::Refused { .. }
                | State::ShuttingDown
                | State::Closed => return Ok(()),
            }
        }
        Ok(())
    }

    fn inspect_head_bytes(&mut self, bytes: &[u8]) -> Result<(), Refusal> {
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                State::Head => i += self.head_bytes(&bytes[i..])?,
                // A head completed inside the preface probe (tiny requests): go on normally.
                _ => return self.inspect(&bytes[i..]),
            }
        }
        Ok(())
    }

    /// Feeds head bytes; returns how many were consumed (up to the end of the head).
    fn head_bytes(&mut self, bytes: &[u8]) -> Result<usize, Refusal> {
        if self.pending.is_empty() {
            if let Some(consumed) = self.whole_head(bytes)? {
                return Ok(consumed);
            }
        }
        let mut n = 0;
        while n < bytes.len() {
            // Ordinary bytes are copied a run at a time; only CR and LF need a closer look.
            let run = bytes[n..]
                .iter()
                .position(|&b| b == b'\r' || b == b'\n')
                .unwrap_or(bytes.len() - n);
            if run > 0 {
                if self.pending.last() == Some(&b'\r') {
                    return Err(Refusal::BareLineFeed);
                }
                self.pending.extend_from_slice(&bytes[n..n + run]);
                if self.pending.len() > MAX_HEAD {
                    return Err(oversized(&self.pending));
                }
                n += run;
                continue;
            }
            let b = bytes[n];
            n += 1;
            // Line endings are checked byte by byte, not when the head is complete: hyper
            // sees these bytes as soon as this read returns, and it would accept a head
            // ended by bare LFs that never completes here.
            let previous = self.pending.last().copied();
            if b == b'\n' && previous != Some(b'\r') {
                return Err(Refusal::BareLineFeed);
            }
            if previous == Some(b'\r') && b != b'\n' {
                return Err(Refusal::BareLineFeed);
            }
            // Leading empty lines before a request line are tolerated (RFC 9112 2.2).
            if self.pending == b"\r" && b == b'\n' {
                self.pending.clear();
                continue;
            }
            self.pending.push(b);
            if self.pending.len() > MAX_HEAD {
                return Err(oversized(&self.pending));
            }
            if self.pending.ends_with(b"\r\n\r\n") {
                if Self::has_fold(&self.pending) {
                    return Err(Refusal::ObsoleteFold);
                }
                // Judged in place and cleared, so the buffer's capacity serves the next head.
                let next = judge_head(&self.pending)?;
                self.pending.clear();
                self.state = next;
                self.heads_seen += 1;
                return Ok(n);
            }
        }
        Ok(bytes.len())
    }

    /// The common case, judged in place without copying: a read that starts with a whole
    /// head whose every line ends in CRLF ([`scan_head`]). `None` sends the bytes the
    /// byte-by-byte way instead (a head split over reads, leading empty lines, a stray CR or
    /// LF, a head past [`MAX_HEAD`]), which refuses exactly what it refused before.
    fn whole_head(&mut self, bytes: &[u8]) -> Result<Option<usize>, Refusal> {
        match scan_head(bytes) {
            // A fold is judged only once the head is whole, as the byte-by-byte way does, so
            // both refuse the same head for the same reason.
            HeadScan::Whole { folded: true, .. } => Err(Refusal::ObsoleteFold),
            HeadScan::Whole { end, .. } => {
                self.state = judge_head(&bytes[..end])?;
                self.heads_seen += 1;
                Ok(Some(end))
            }
            HeadScan::Unfinished | HeadScan::Irregular => Ok(None),
        }
    }

    /// Whether a complete head has an obsolete folded line (one that starts with whitespace).
    fn has_fold(head: &[u8]) -> bool {
        head.windows(3)
            .any(|w| w[0] == b'\r' && w[1] == b'\n' && (w[2] == b' ' || w[2] == b'\t'))
    }

    fn chunk_bytes(&mut self, bytes: &[u8]) -> Result<usize, Refusal> {
        let mut i = 0;
        while i < bytes.len() {
            let State::Chunked(chunk) = &mut self.state else {
                return Ok(i);
            };
            match chunk {
                Chunk::Data(remaining) => {
                    let take = (*remaining).min((bytes.len() - i) as u64);
                    *remaining -= take;
                    i += take as usize;
                    if *remaining == 0 {
                        *chunk = Chunk::DataEnd(false);
                    }
                }
                Chunk::DataEnd(seen_cr) => {
                    let b = bytes[i];
                    i += 1;
                    match (*seen_cr, b) {
                        (false, b'\r') => *chunk = Chunk::DataEnd(true),
                        (true, b'\n') => *chunk = Chunk::Size,
                        _ => return Err(Refusal::BadChunk),
                    }
                }
                Chunk::Size => {
                    let b = bytes[i];
                    i += 1;
                    self.pending.push(b);
                    if self.pending.len() > GUARD_MAX_CHUNK_LINE {
                        return Err(Refusal::BadChunk);
                    }
                    if b == b'\n' {
                        let line = std::mem::take(&mut self.pending);
                        let size = parse_chunk_size(&line)?;
                        *chunk = if size == 0 {
                            self.trailer_bytes = 0;
                            Chunk::Trailers
                        } else {
                            Chunk::Data(size)
                        };
                    }
                }
                Chunk::Trailers => {
                    let b = bytes[i];
                    i += 1;
                    self.pending.push(b);
                    self.trailer_bytes += 1;
                    if self.trailer_bytes > MAX_TRAILERS {
                        return Err(Refusal::BadChunk);
                    }
                    if b == b'\n' {
                        let line = std::mem::take(&mut self.pending);
                        if !line.ends_with(b"\r\n") || line[..line.len() - 2].contains(&b'\r') {
                            return Err(Refusal::BareLineFeed);
                        }
                        if line.len() == 2 {
                            self.state = State::Head;
                        } else if line[0] == b' ' || line[0] == b'\t' {
                            return Err(Refusal::ObsoleteFold);
                        }
                    }
                }
            }
        }
        Ok(i)
    }

    fn refuse(&mut self, why: Refusal) {
        tracing::debug!(reason = ?why, "refused a request with ambiguous or malformed framing");
        self.pending = Vec::new();
        // Once hyper has a request, a response may be on the wire already: just close.
        self.state = if self.heads_delivered == 0 {
            let response = match why {
                Refusal::HeadTooLarge => TOO_LARGE,
                Refusal::TargetTooLong => URI_TOO_LONG,
                _ => BAD_REQUEST,
            };
            State::Refused {
                response,
                written: 0,
            }
        } else {
            State::Closed
        };
    }
}

/// Checks a complete head, whose line endings and folds were already checked
/// ([`scan_head`], or the guard's byte-by-byte way), and says what follows it.
fn judge_head(head: &[u8]) -> Result<State, Refusal> {
    // Left uninitialised for httparse to fill, as hyper does: zeroing 128 entries (4 KiB)
    // for a head of a few lines cost more than parsing it.
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; GUARD_MAX_FIELDS];
    let mut request = httparse::Request::new(&mut []);
    match request.parse_with_uninit_headers(head, &mut headers) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) | Err(_) => return Err(Refusal::MalformedHead),
    }
    judge_parsed(&request)
}

/// Whether a head parsed by httparse from bytes that [`scan_head`] found whole and unfolded is
/// one the guard lets through, announcing no body: tollgate's own HTTP/1.1 path takes only
/// those, with the guard's own judgement, so the two paths refuse the same heads.
pub fn accepts_without_body(request: &httparse::Request<'_, '_>) -> bool {
    matches!(judge_parsed(request), Ok(State::Head))
}

/// The checks of [`judge_head`] on a parsed head.
fn judge_parsed(request: &httparse::Request<'_, '_>) -> Result<State, Refusal> {
    if request.path.map_or(0, str::len) > MAX_TARGET {
        return Err(Refusal::TargetTooLong);
    }
    let http10 = request.version == Some(0);
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut transfer_encoding_seen = false;
    for header in request.headers.iter() {
        if header.name.eq_ignore_ascii_case("content-length") {
            if length.is_some() {
                return Err(Refusal::DuplicateContentLength);
            }
            length = Some(parse_length(header.value)?);
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            if transfer_encoding_seen || http10 {
                return Err(Refusal::BadTransferEncoding);
            }
            transfer_encoding_seen = true;
            if !rules::is_exactly_chunked(header.value) {
                return Err(Refusal::BadTransferEncoding);
            }
            chunked = true;
        }
    }
    if chunked && length.is_some() {
        return Err(Refusal::LengthAndChunked);
    }
    // An upgrade request is judged like any other: the guard stays on until the server
    // says a real switch happened (`step_aside`). A declined upgrade goes on as HTTP/1.1,
    // guarded; a client must not send its new protocol before the 101.
    Ok(if chunked {
        State::Chunked(Chunk::Size)
    } else {
        match length {
            Some(0) | None => State::Head,
            Some(n) => State::Body(n),
        }
    })
}

/// Why a head past [`MAX_HEAD`] is refused: for its target, when the request line (as far as
/// it has come) already holds more than [`MAX_TARGET`] bytes of one, else for its size. Only
/// a refused head is looked at, once.
fn oversized(head: &[u8]) -> Refusal {
    let line = head.split(|&b| b == b'\r').next().unwrap_or(head);
    let target = line.splitn(3, |&b| b == b' ').nth(1).map_or(0, <[u8]>::len);
    if target > MAX_TARGET {
        Refusal::TargetTooLong
    } else {
        Refusal::HeadTooLarge
    }
}

/// `Content-Length` as the guard reads it: the field's whitespace trimmed, then a plain
/// length ([`rules::plain_length`]).
fn parse_length(value: &[u8]) -> Result<u64, Refusal> {
    rules::plain_length(trim(value)).ok_or(Refusal::BadContentLength)
}

/// A chunk-size line, strictly ([`rules::chunk_size`]).
fn parse_chunk_size(line: &[u8]) -> Result<u64, Refusal> {
    match rules::chunk_size(line, ChunkSizes::Strict) {
        Ok(chunk) => Ok(chunk.size),
        Err(BadChunkLine::NoCrlf) => Err(Refusal::BareLineFeed),
        Err(BadChunkLine::Malformed | BadChunkLine::Overflow) => Err(Refusal::BadChunk),
    }
}

fn trim(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

impl<S: AsyncRead + Unpin> FramingGuard<S> {
    /// A read from the stream, the unread prefix first.
    fn read_inner(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        buf.put_slice(&self.prefix.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for FramingGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            match &mut self.state {
                State::Refused { response, written } => {
                    let (response, from) = (*response, *written);
                    match Pin::new(&mut self.inner).poll_write(cx, &response[from..]) {
                        Poll::Ready(Ok(n)) if n > 0 && from + n < response.len() => {
                            self.state = State::Refused {
                                response,
                                written: from + n,
                            };
                        }
                        // Sent (or the client is gone). No request reached hyper, so no
                        // response of hyper's can follow: the write side is closed, so that
                        // the response arrives whole and the connection ends as its transport
                        // ends one (hyper, which may hold the head's first bytes, would only
                        // drop it).
                        Poll::Ready(_) => self.state = State::ShuttingDown,
                        Poll::Pending => return Poll::Pending,
                    }
                }
                State::ShuttingDown => {
                    if Pin::new(&mut self.inner).poll_shutdown(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // Then end of stream for hyper.
                    self.state = State::Closed;
                }
                State::Closed => return Poll::Ready(Ok(())),
                State::PassThrough => return self.read_inner(cx, buf),
                _ => break,
            }
        }
        let before = buf.filled().len();
        let result = self.read_inner(cx, buf);
        if let Poll::Ready(Ok(())) = result {
            let verdict = self.inspect(&buf.filled()[before..]);
            if let Err(why) = verdict {
                // Nothing of a refused read reaches hyper.
                buf.set_filled(before);
                self.refuse(why);
                return self.poll_read(cx, buf);
            }
            self.heads_delivered = self.heads_seen;
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FramingGuard<S> {
    // Writes pass untouched: what goes out never changes how the input is read.
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces of `step` bytes and returns the first refusal.
    fn run(input: &[u8], step: usize) -> Result<(), Refusal> {
        let mut guard = FramingGuard::new(());
        for piece in input.chunks(step.max(1)) {
            guard.inspect(piece)?;
        }
        Ok(())
    }

    fn refused(input: &[u8]) -> Option<Refusal> {
        let whole = run(input, input.len()).err();
        // The verdict must not depend on how the bytes were split.
        for step in [1, 2, 3, 7] {
            assert_eq!(run(input, step).err(), whole, "split by {step}");
        }
        whole
    }

    /// Reads a guard to its end: what it handed on.
    fn drain<S: AsyncRead + AsyncWrite + Unpin>(guard: &mut FramingGuard<S>) -> Vec<u8> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        let mut buffer = [0u8; 64];
        loop {
            let mut buf = ReadBuf::new(&mut buffer);
            match Pin::new(&mut *guard).poll_read(&mut cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return out,
                Poll::Ready(Ok(())) => out.extend_from_slice(buf.filled()),
                other => panic!("a stream in memory answered {other:?}"),
            }
        }
    }

    #[test]
    fn a_guard_after_requests_reads_the_unread_bytes_first_and_judges_them() {
        // A body that starts in the bytes the simple path read and ends in the stream.
        let unread = Bytes::from_static(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhe");
        let rest: &[u8] = b"lloGET / HTTP/1.1\r\n\r\n";
        let stream = std::io::Cursor::new(rest.to_vec());
        let mut guard = FramingGuard::after_requests(stream, 1, unread.clone());
        assert!(guard.has_unread());
        assert_eq!(drain(&mut guard), [&unread[..], rest].concat());
        assert!(!guard.has_unread());
        // A refused head after a served request: nothing handed on, nothing written (no 400:
        // a response went out before), and HTTP/2's preface is a refused head there.
        for refused in [&b"GET / HTTP/1.1\nHost: a\r\n\r\n"[..], H2_PREFACE] {
            let unread = Bytes::copy_from_slice(refused);
            let mut guard =
                FramingGuard::after_requests(std::io::Cursor::new(Vec::new()), 1, unread);
            assert_eq!(
                drain(&mut guard),
                b"",
                "{:?}",
                String::from_utf8_lossy(refused)
            );
            assert!(guard.get_ref().get_ref().is_empty(), "wrote an answer");
        }
        // Before any request, the same head gets the guard's 400.
        let unread = Bytes::from_static(b"GET / HTTP/1.1\nHost: a\r\n\r\n");
        let mut guard = FramingGuard::after_requests(std::io::Cursor::new(Vec::new()), 0, unread);
        assert_eq!(drain(&mut guard), b"");
        assert!(guard.get_ref().get_ref().starts_with(b"HTTP/1.1 400 "));
    }

    #[test]
    fn ordinary_requests_pass() {
        assert_eq!(refused(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"), None);
        assert_eq!(
            refused(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\nHost: a\r\n\r\n"),
            None
        );
        assert_eq!(
            refused(b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nx-t: 1\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"),
            None
        );
        assert_eq!(refused(b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"), None);
        assert_eq!(refused(H2_PREFACE), None);
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        let cases: [(&[u8], Refusal); 12] = [
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG", Refusal::LengthAndChunked),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 6\r\n\r\n", Refusal::LengthAndChunked),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n", Refusal::BadTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n", Refusal::BadTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n", Refusal::BadTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", Refusal::DuplicateContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 010\r\n\r\n", Refusal::BadContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n", Refusal::BadContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\n", Refusal::BadContentLength),
            (b"GET / HTTP/1.1\nHost: a\r\n\r\n", Refusal::BareLineFeed),
            (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n folded\r\n\r\n", Refusal::ObsoleteFold),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\n", Refusal::BadChunk),
        ];
        for (input, why) in cases {
            assert_eq!(
                refused(input),
                Some(why),
                "{}",
                String::from_utf8_lossy(input)
            );
        }
    }

    /// The same input as the second request of a connection: its head then starts a read
    /// with nothing held back, which is where whole heads are judged without a copy.
    fn refused_after_a_first_request(input: &[u8]) -> Option<Refusal> {
        let mut both = b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n".to_vec();
        let first = both.len();
        both.extend_from_slice(input);
        let mut guard = FramingGuard::new(());
        let in_two_reads = guard
            .inspect(&both[..first])
            .and_then(|()| guard.inspect(&both[first..]))
            .err();
        assert_eq!(
            in_two_reads,
            refused(&both),
            "{}",
            String::from_utf8_lossy(input)
        );
        in_two_reads
    }

    #[test]
    fn whole_heads_judged_in_place_agree_with_the_byte_by_byte_way() {
        let cases: [(&[u8], Option<Refusal>); 12] = [
            (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", None),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcGET / HTTP/1.1\r\n\r\n",
                None,
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /2 HTTP/1.1\r\nHo",
                None,
            ),
            (b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", None),
            (
                b"GET / HTTP/1.1\r\nHost: a\nX: 1\r\n\r\n",
                Some(Refusal::BareLineFeed),
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a\rX: 1\r\n\r\n",
                Some(Refusal::BareLineFeed),
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a\r\n\n",
                Some(Refusal::BareLineFeed),
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\r\n\tfolded\r\n\r\n",
                Some(Refusal::ObsoleteFold),
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                Some(Refusal::LengthAndChunked),
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 01\r\n\r\n",
                Some(Refusal::BadContentLength),
            ),
            (
                b"GET / HTTP/1.1\r\nBad Header: 1\r\n\r\n",
                Some(Refusal::MalformedHead),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nz\r\n",
                Some(Refusal::BadChunk),
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(
                refused_after_a_first_request(input),
                expected,
                "{}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn the_h2_preface_is_recognised_across_reads_and_near_misses_are_http1() {
        for step in [1, 2, 5, H2_PREFACE.len()] {
            let mut guard = FramingGuard::new(());
            for piece in H2_PREFACE.chunks(step) {
                assert!(guard.reads_http1_heads(), "before the whole preface");
                assert_eq!(guard.inspect(piece), Ok(()));
            }
            assert!(matches!(guard.state, State::PassThrough), "split by {step}");
            assert!(
                !guard.reads_http1_heads(),
                "HTTP/2 has no HTTP/1 heads to time"
            );
        }
        // A head that starts like the preface is judged as HTTP/1 (the preface itself is
        // not a valid HTTP/1 head).
        assert_eq!(
            refused(b"PRI * HTTP/2.0\r\n\r\nSX"),
            Some(Refusal::MalformedHead)
        );
        assert_eq!(
            refused(b"PRI * HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\n\r\n"),
            None
        );
        assert_eq!(
            refused(b"PUT / HTTP/1.1\r\nHost: a\nX: 1\r\n\r\n"),
            Some(Refusal::BareLineFeed)
        );
    }

    #[test]
    fn only_step_aside_ends_http1_framing_and_never_after_a_refusal() {
        // An upgrade request, then bytes that are no HTTP/1 head: refused while no switch
        // was signalled, whatever the request asked for.
        let upgrade =
            b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n";
        let mut guard = FramingGuard::new(());
        assert_eq!(guard.inspect(upgrade), Ok(()));
        assert!(guard.reads_http1_heads());
        assert_eq!(
            guard.inspect(b"\x81\x05hello\n"),
            Err(Refusal::BareLineFeed)
        );

        let mut guard = FramingGuard::new(());
        assert_eq!(guard.inspect(upgrade), Ok(()));
        guard.step_aside();
        assert!(!guard.reads_http1_heads());
        assert_eq!(guard.inspect(b"\x81\x05hello\n"), Ok(()));

        let mut guard = FramingGuard::new(());
        guard.refuse(Refusal::BareLineFeed);
        guard.step_aside();
        assert!(
            matches!(guard.state, State::Refused { .. }),
            "a refused connection stays refused: {:?}",
            guard.state
        );
    }

    #[test]
    fn oversized_heads_are_refused() {
        let mut head = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: ".to_vec();
        head.extend(std::iter::repeat_n(b'a', MAX_HEAD));
        assert_eq!(refused(&head), Some(Refusal::HeadTooLarge));
    }

    #[test]
    fn long_targets_are_refused_whatever_the_head_size() {
        let with_target = |len: usize, header: usize| {
            let mut head = b"GET /".to_vec();
            head.extend(std::iter::repeat_n(b'a', len - 1));
            head.extend_from_slice(b" HTTP/1.1\r\nHost: a\r\nX-Pad: ");
            head.extend(std::iter::repeat_n(b'p', header));
            head.extend_from_slice(b"\r\n\r\n");
            refused(&head)
        };
        assert_eq!(with_target(MAX_TARGET, 0), None);
        assert_eq!(with_target(MAX_TARGET + 1, 0), Some(Refusal::TargetTooLong));
        // Past the head limit, by the target or by a header after a long target.
        assert_eq!(with_target(MAX_HEAD, 0), Some(Refusal::TargetTooLong));
        assert_eq!(
            with_target(MAX_TARGET + 1, MAX_HEAD),
            Some(Refusal::TargetTooLong)
        );
        // A short target with a huge header is still 431.
        assert_eq!(with_target(10, MAX_HEAD), Some(Refusal::HeadTooLarge));
        // A request line that never ends.
        let mut endless = b"GET /".to_vec();
        endless.extend(std::iter::repeat_n(b'a', MAX_HEAD + 10));
        assert_eq!(refused(&endless), Some(Refusal::TargetTooLong));
    }

    #[test]
    fn chunk_lines_and_trailer_sections_are_bounded() {
        // What the guard holds back for a chunked body is bounded whatever the client sends:
        // a chunk-size line (extensions included) up to GUARD_MAX_CHUNK_LINE, trailers up to
        // MAX_TRAILERS.
        let start = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        let mut long_line = start.clone();
        long_line.extend_from_slice(b"5;ext=");
        long_line.extend(std::iter::repeat_n(b'x', GUARD_MAX_CHUNK_LINE));
        assert_eq!(run(&long_line, 4096), Err(Refusal::BadChunk));

        let mut long_trailers = start;
        long_trailers.extend_from_slice(b"0\r\n");
        for i in 0..MAX_TRAILERS / 16 + 1 {
            long_trailers.extend_from_slice(format!("x-t{i:05}: 12345\r\n").as_bytes());
        }
        assert_eq!(run(&long_trailers, 4096), Err(Refusal::BadChunk));
    }

    #[test]
    fn chunk_data_must_end_with_crlf() {
        assert_eq!(
            refused(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX"),
            Some(Refusal::BadChunk)
        );
    }
}
