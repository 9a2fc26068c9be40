//! HTTP/2 streams whose response the client does not take (contract §5).
//!
//! A client can open a stream with its flow-control window at 0 and never open it: hyper's
//! `PipeToSendStream` then holds a piece of the response and waits for send capacity, the
//! stream's task is never woken, and the upstream request (an upstream connection, a file
//! descriptor) stays held for as long as the client likes. The connection watchdog cannot
//! tell: the request is in progress, and the client's answers to keep-alive pings move bytes.
//!
//! The rule: **a stream that holds response data which the client's window has not let
//! through for `idle_timeout` is reset**, and dropping it drops its upstream request (an
//! HTTP/1.1 upstream connection is closed, an HTTP/2 upstream stream is reset).
//!
//! - The stall clock runs only while the stream holds response data it cannot send. Waiting
//!   for the response head is bounded by `response_timeout` (504), and waiting for the upstream
//!   to send more (a slow upstream, a long poll) is the upstream's doing, not the client's:
//!   neither is a stall. An upload the upstream is still reading does not count either way
//!   (that body is pulled by the upstream connection, not by the stream's task).
//! - Progress (a move) is h2 waking the stream's task: h2 does so when the client's `WINDOW_UPDATE`s
//!   (stream and connection) give the stream room for more, or when the stream ends. Pings,
//!   settings and other streams' traffic do not wake it.
//! - The response is handed to hyper in pieces of at most [`PIECE`] bytes, so that h2 needs the
//!   client to take each piece before it asks for the next, and the task wakes at least once
//!   per piece: a response that moves by less than 16 KiB per `idle_timeout` counts as stalled
//!   (at the default 60 s, under 273 bytes a second). Slicing a `Bytes` copies nothing, and
//!   HTTP/2 sends at most 16 KiB per DATA frame by default anyway.
//! - What the rule cannot tell apart: a stream that waits its turn for the connection's window
//!   behind other streams of the same client counts as held too (h2 hands the connection
//!   window out first come, first served). A client with many large responses in flight that
//!   reads all of them slower than about (streams × 64 KiB) per `idle_timeout` can see some
//!   of them reset.
//!
//! The mechanism: hyper's h2 server spawns one future per stream on the executor it is given
//! (`hyper/src/proto/h2/server.rs`, `Serving::poll_server`: `service.call(req)`, then
//! `exec.execute_h2stream(..)`). [`StreamExecutor`] wraps each in [`Watched`], which notes
//! every poll and completes once the stall has lasted `idle_timeout`; completing drops the
//! inner future, whose h2 `SendStream` sends `RST_STREAM(CANCEL)`, and whose response body
//! holds the upstream request. The response body ([`StreamProgress`]) tells the watch whether
//! it holds data or waits for the upstream; the two meet through [`NewStreams`], filled by
//! the service and emptied by the executor right after, in the connection's own task.
//!
//! The watch's timer looks four times per `idle_timeout` and resets a stream that four looks
//! in a row found holding data without having moved: between `idle_timeout` and 1¼ ×
//! `idle_timeout` after the response last moved. It counts moves rather than reading a clock,
//! so a busy worker can make a reset late, never early.
//!
//! Cost per stream: one small allocation (the shared watch) and a few relaxed atomics per
//! poll; a timer is armed only for a stream that actually waits for the client, and reset
//! four times per `idle_timeout` while it does, never per poll.

use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// The most response data handed to hyper at once (the default HTTP/2 frame size).
pub(super) const PIECE: usize = 16 * 1024;

/// A held stream's watch looks this many times per `idle_timeout`: a stream is reset after
/// this many looks in a row found it holding data without having moved, that is between
/// `idle_timeout` and 1¼ × `idle_timeout` after it last moved.
const LOOKS_PER_IDLE_TIMEOUT: u32 = 4;

/// Where one stream's response stands, shared by its body and its task (both only ever run
/// in the stream's task, one after the other, so relaxed atomics suffice).
///
/// A count of moves rather than a timestamp: the watch's own timer measures the quiet time,
/// so a worker too busy to tick the coarse clock can make a reset late, never early.
pub(super) struct StreamWatch {
    /// `moves << 1 | holding`: how often the response has moved, and whether the stream holds
    /// response data that the client's window has not let through.
    state: AtomicU64,
}

impl StreamWatch {
    fn new() -> Self {
        StreamWatch {
            state: AtomicU64::new(0),
        }
    }

    fn is_holding(&self) -> bool {
        self.state.load(Ordering::Relaxed) & 1 == 1
    }

    fn moves(&self) -> u64 {
        self.state.load(Ordering::Relaxed) >> 1
    }

    /// The stream got data to send, or sent some and holds more.
    fn moved(&self) {
        let state = self.state.load(Ordering::Relaxed);
        self.state
            .store((((state >> 1) + 1) << 1) | 1, Ordering::Relaxed);
    }

    /// Waiting for the upstream, or done: nothing held for the client.
    fn not_holding(&self) {
        let state = self.state.load(Ordering::Relaxed);
        self.state.store(state & !1, Ordering::Relaxed);
    }
}

/// Hands each new stream's watch from the service (which builds the response body) to the
/// executor (which spawns the stream's task). hyper calls the one and then the other, in the
/// connection's task, with nothing in between: the slot holds at most the stream being started.
#[derive(Default)]
pub(super) struct NewStreams {
    next: Mutex<Option<Arc<StreamWatch>>>,
}

impl NewStreams {
    /// A watch for the stream whose request the service is handling now.
    pub(super) fn start(&self) -> StreamProgress {
        let watch = Arc::new(StreamWatch::new());
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) = Some(watch.clone());
        StreamProgress {
            watch,
            rest: Bytes::new(),
        }
    }

    fn take(&self) -> Option<Arc<StreamWatch>> {
        self.next
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// The executor given to hyper for one connection: stream futures run [`Watched`]; anything
/// else hyper spawns (an HTTP/2 CONNECT tunnel's task) runs as it is.
#[derive(Clone)]
pub(super) struct StreamExecutor {
    new_streams: Arc<NewStreams>,
    idle_timeout: Duration,
}

impl StreamExecutor {
    pub(super) fn new(new_streams: Arc<NewStreams>, idle_timeout: Duration) -> Self {
        StreamExecutor {
            new_streams,
            idle_timeout,
        }
    }
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, stream: F) {
        match self.new_streams.take() {
            Some(watch) => {
                tokio::spawn(Watched {
                    stream,
                    watch,
                    every: self.idle_timeout / LOOKS_PER_IDLE_TIMEOUT,
                    look: None,
                    moves_seen: 0,
                    quiet_looks: 0,
                });
            }
            None => {
                tokio::spawn(stream);
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// One stream's task: the stream's future, ended early once its response has been held
    /// for `idle_timeout` without the client letting any of it through.
    struct Watched<F> {
        #[pin]
        stream: F,
        watch: Arc<StreamWatch>,
        // `idle_timeout / LOOKS_PER_IDLE_TIMEOUT`.
        every: Duration,
        // Armed when the stream first holds data for the client; boxed so that streams that
        // never wait (most) do not carry a timer.
        look: Option<Pin<Box<Sleep>>>,
        moves_seen: u64,
        quiet_looks: u32,
    }
}

impl<F: Future<Output = ()>> Future for Watched<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        let look_due = match this.look.as_mut() {
            Some(look) => look.as_mut().poll(cx).is_ready(),
            None => false,
        };
        if !this.watch.is_holding() {
            if look_due {
                // Due while the stream waited for the upstream: disarm, so that a stale timer
                // is not taken for a look in the next wait for the client.
                *this.look = None;
            }
        } else if look_due {
            let moves = this.watch.moves();
            if moves == *this.moves_seen {
                *this.quiet_looks += 1;
                if *this.quiet_looks >= LOOKS_PER_IDLE_TIMEOUT {
                    tracing::debug!(
                        "resetting an HTTP/2 stream: the client has not taken its response \
                         for idle_timeout"
                    );
                    // Dropping the stream's future resets the stream (RST_STREAM) and drops
                    // its upstream request.
                    return Poll::Ready(());
                }
            } else {
                *this.moves_seen = moves;
                *this.quiet_looks = 0;
            }
            if let Some(look) = this.look.as_mut() {
                look.as_mut().reset(Instant::now() + *this.every);
            }
        } else {
            // Held data, and h2 woke the task: the client made room (or the stream ended).
            this.watch.moved();
        }

        if this.stream.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        if this.watch.is_holding() {
            if this.look.is_none() {
                *this.look = Some(Box::pin(tokio::time::sleep(*this.every)));
                *this.moves_seen = this.watch.moves();
                *this.quiet_looks = 0;
            }
            if let Some(look) = this.look.as_mut() {
                if look.as_mut().poll(cx).is_ready() {
                    // Already due (a long poll): look at once rather than never.
                    cx.waker().wake_by_ref();
                }
            }
        }
        Poll::Pending
    }
}

/// An HTTP/2 response body's side of the watch: it hands the upstream's data to hyper in
/// pieces of at most [`PIECE`] bytes and tells the watch whether the stream now holds data
/// for the client or waits for the upstream.
pub(super) struct StreamProgress {
    watch: Arc<StreamWatch>,
    /// The part of the last upstream frame not handed out yet.
    rest: Bytes,
}

impl StreamProgress {
    pub(super) fn poll_frame<B>(
        &mut self,
        body: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>>
    where
        B: Body<Data = Bytes>,
    {
        if !self.rest.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(self.next_piece()))));
        }
        match body.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if data.is_empty() => Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(data) => {
                    self.rest = data;
                    Poll::Ready(Some(Ok(Frame::data(self.next_piece()))))
                }
                Err(trailers) => {
                    self.watch.not_holding();
                    Poll::Ready(Some(Ok(trailers)))
                }
            },
            other => {
                // Waiting for the upstream, finished, or failed.
                self.watch.not_holding();
                other
            }
        }
    }

    fn next_piece(&mut self) -> Bytes {
        self.watch.moved();
        if self.rest.len() <= PIECE {
            mem::take(&mut self.rest)
        } else {
            self.rest.split_to(PIECE)
        }
    }

    /// Whether everything taken from the upstream body has been handed out.
    pub(super) fn is_drained(&self) -> bool {
        self.rest.is_empty()
    }

    /// `hint` (the upstream body's) plus what is taken but not handed out yet.
    pub(super) fn size_hint(&self, hint: SizeHint) -> SizeHint {
        let held = self.rest.len() as u64;
        let mut total = SizeHint::new();
        total.set_lower(hint.lower().saturating_add(held));
        if let Some(upper) = hint.upper() {
            total.set_upper(upper.saturating_add(held));
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[tokio::test]
    async fn responses_are_handed_out_in_pieces_and_whole() {
        let new_streams = NewStreams::default();
        let mut progress = new_streams.start();
        assert!(new_streams.take().is_some(), "the executor finds the watch");
        assert!(new_streams.take().is_none(), "and only once");
        let data: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
        let mut body = Full::new(Bytes::from(data.clone()));
        let mut out = Vec::new();
        let mut sizes = Vec::new();
        loop {
            let frame =
                std::future::poll_fn(|cx| progress.poll_frame(Pin::new(&mut body), cx)).await;
            let Some(frame) = frame else { break };
            let piece = frame.expect("no error").into_data().expect("data");
            sizes.push(piece.len());
            out.extend_from_slice(&piece);
            if !progress.is_drained() {
                assert!(progress.watch.is_holding());
            }
        }
        assert_eq!(sizes, [PIECE, PIECE, 40_000 - 2 * PIECE]);
        assert_eq!(out, data);
        assert!(!progress.watch.is_holding(), "done: nothing held");
        assert_eq!(progress.watch.moves(), 3);
        assert!(body.is_end_stream());
    }

    #[test]
    fn the_size_hint_counts_what_is_held() {
        let progress = StreamProgress {
            watch: Arc::new(StreamWatch::new()),
            rest: Bytes::from_static(b"12345"),
        };
        let hint = progress.size_hint(SizeHint::with_exact(10));
        assert_eq!(hint.exact(), Some(15));
    }
}
