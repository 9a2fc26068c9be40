//! One client connection, from the first byte after the handshake to its close: hyper-util's
//! auto builder (HTTP/1.1, or HTTP/2 by ALPN or prior knowledge), the watchdog that enforces
//! `idle_timeout` and `header_read_timeout` from the activity the connection records on its
//! server's coarse clock, the HTTP/2 stream executor, and the WebSocket session a checked
//! `101` turns the connection into. The server's module notes say what each rule is for.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

use super::coarse_clock::CoarseClock;
use super::streams::{NewStreams, StreamExecutor, StreamProgress};
use super::Phase;
use crate::body::{BodyError, ClientBody, ProxyBody, UpstreamBody};
use crate::forward::Splice;
use crate::http1::guard::FramingGuard;
use crate::pipeline::{ConnInfo, Proxy};

use crate::http1::lines::ResponseLines;
use crate::http1::server::{self as own_server, ClientStream};

/// HTTP/2 keep-alive pings: a peer that stops answering is dropped.
const H2_KEEPALIVE: Duration = Duration::from_secs(20);
/// HTTP/2 streams in flight per connection (contract §5): with a stalled stream reset after
/// `idle_timeout`, what one client connection can hold upstream at once.
const H2_MAX_STREAMS: u32 = 100;

/// The per-connection timeouts, from `[server]` as started.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConnSettings {
    pub(super) header_read_timeout: Duration,
    pub(super) idle_timeout: Duration,
    /// Whether HTTP/1.1 connections begin on the simple path (`ServerBuilder::http1_fast_path`).
    pub(super) fast_path: bool,
}

impl ConnSettings {
    /// The watchdog's longest sleep: a deadline of either rule can start at any moment (a
    /// response finishing starts the wait for the next head), so it looks again at least this
    /// often and never wakes late.
    pub(super) fn next_check(&self) -> Duration {
        self.idle_timeout.min(self.header_read_timeout)
    }
}

impl ClientStream for tokio::net::TcpStream {
    const SEES_CLOSE: bool = true;

    fn poll_peer_closed(&self, cx: &mut Context<'_>) -> Poll<bool> {
        let mut byte = [std::mem::MaybeUninit::uninit(); 1];
        let mut buf = ReadBuf::uninit(&mut byte);
        match self.poll_peek(cx, &mut buf) {
            Poll::Ready(Ok(0) | Err(_)) => Poll::Ready(true),
            Poll::Ready(Ok(_)) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    }

    fn may_speak_h1(&self) -> bool {
        true
    }
}

impl ClientStream for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    const SEES_CLOSE: bool = false;

    fn poll_peer_closed(&self, _: &mut Context<'_>) -> Poll<bool> {
        Poll::Pending
    }

    fn may_speak_h1(&self) -> bool {
        self.get_ref().1.alpn_protocol() != Some(crate::tls::ALPN_H2)
    }
}

/// Serves one client connection: simple HTTP/1.1 requests on tollgate's own path while they
/// last ([`own_server`], plain TCP or TLS), then everything else through the framing guard and
/// hyper (HTTP/2 from the start when TLS agreed on it by ALPN).
pub(super) async fn serve_connection<S>(
    mut stream: S,
    info: ConnInfo,
    proxy: Arc<Proxy>,
    settings: ConnSettings,
    mut phase: watch::Receiver<Phase>,
    clock: Arc<CoarseClock>,
) where
    S: ClientStream,
{
    let activity = Arc::new(Activity::new(clock));
    let (buffered, served) = if settings.fast_path && stream.may_speak_h1() {
        let service = Served {
            proxy: &proxy,
            info: &info,
            activity: &activity,
        };
        let simple = own_server::serve(&mut stream, &service);
        tokio::pin!(simple);
        let begin_drain = |_: Pin<&mut _>| activity.begin_drain();
        match supervise(simple, &activity, settings, &mut phase, begin_drain).await {
            Some(own_server::Ending::HandOver { buffered }) => {
                (buffered, activity.started.load(Ordering::Relaxed))
            }
            Some(own_server::Ending::Closed) | None => return,
        }
    } else {
        (bytes::Bytes::new(), 0)
    };
    // The guard goes on from where the simple path stopped: after `served` requests, with the
    // bytes it read and did not use read first.
    let stream = FramingGuard::after_requests(stream, served, buffered);
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
        bytes_waiting: false,
    });
    let requests = activity.clone();
    let peer_port = info.peer.port();
    let new_streams = Arc::new(NewStreams::default());
    let streams = new_streams.clone();
    let service = service_fn(move |req| {
        let proxy = proxy.clone();
        let info = info.clone();
        let in_flight = InFlight::start(requests.clone());
        let progress = (req.version() == http::Version::HTTP_2).then(|| streams.start());
        // Boxed: hyper moves the service's future into each HTTP/2 stream and the stream into
        // its task, and this future holds the whole proxy pipeline (kilobytes), where a box is
        // a pointer.
        Box::pin(async move {
            let version = req.version();
            let mut response = proxy.handle(req.map(ClientBody::Hyper), info).await;
            if version != http::Version::HTTP_2
                && response.status() != http::StatusCode::SWITCHING_PROTOCOLS
                && in_flight.connection().draining()
            {
                // The drain began while the simple path had the connection, and hyper was
                // handed a request it had read (in part): hyper's own graceful shutdown would
                // drop that unanswered, so it is answered, and closes the connection.
                response.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
            }
            if response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                // Only the forwarder's checked 101 carries a splice. The switch is armed now,
                // before hyper has the response, so the framing guard steps aside exactly for
                // the bytes after it.
                if let Some(splice) = response.extensions_mut().remove::<Splice>() {
                    in_flight.connection().switch_to(splice);
                }
            }
            // The request stays in progress until its body has been sent (or dropped).
            Ok::<_, Infallible>(response.map(|body| CountedBody {
                body,
                _in_flight: in_flight,
                progress,
            }))
        })
    });
    // HTTP/2 peers are pinged often enough that a dead one is dropped within about the idle
    // timeout even while a request is in flight (when no idle rule applies).
    let h2_ping = H2_KEEPALIVE
        .min(settings.idle_timeout / 2)
        .max(Duration::from_millis(100));
    // Each HTTP/2 stream's task runs under a watch that resets it once the client has not
    // taken its response for `idle_timeout` (see `streams`).
    let executor = StreamExecutor::new(new_streams, settings.idle_timeout);
    let mut builder = auto::Builder::new(executor);
    // hyper's own header-read timer is off: it arms a boxed timer and reads the clock for
    // every request (about 1,300 instructions each), where the watchdog below enforces
    // `header_read_timeout` from the activity it already keeps.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None::<Duration>)
        // Where tollgate sees a client's close itself, hyper need not read to see it. This does
        // not serve half-closed clients: the peek takes a client's FIN for its going away, as
        // hyper's read did (and nginx does).
        .half_close(S::SEES_CLOSE)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(h2_ping))
        .keep_alive_timeout(h2_ping)
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_header_list_size(crate::http1::rules::MAX_HEAD as u32);
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let served = supervise(conn, &activity, settings, &mut phase, |conn| {
        conn.graceful_shutdown()
    });
    match served.await {
        Some(Ok(())) => {}
        Some(Err(err)) => {
            tracing::debug!(peer = %peer_port, error = %err, "connection ended with an error");
        }
        None => return,
    }

    // After a real 101 the connection goes on as a WebSocket session, here: it keeps this
    // task's permit and gauge place, and counts as in flight until it closes (so only bytes
    // keep it open, and a drain waits for it). A drain that begins meanwhile changes nothing
    // for it; the end of `shutdown_timeout` closes it.
    let Some(splice) = activity.take_splice() else {
        return;
    };
    let _session = InFlight::start(activity.clone());
    let session = splice.run();
    tokio::pin!(session);
    if supervise(session, &activity, settings, &mut phase, |_| {})
        .await
        .is_none()
    {
        tracing::debug!(peer = %peer_port, "WebSocket session closed by tollgate");
    }
}

/// What tollgate's own HTTP/1.1 server serves on one connection: the proxy, for requests
/// whose bodies say they came from that server (`ClientBody::Simple`), and the connection's
/// activity record.
struct Served<'a> {
    proxy: &'a Proxy,
    info: &'a ConnInfo,
    activity: &'a Arc<Activity>,
}

impl own_server::Service for Served<'_> {
    type RequestBody = ClientBody;
    type ResponseBody = ProxyBody;
    type InFlight = InFlight;

    fn request_body(&self) -> ClientBody {
        ClientBody::Simple
    }

    fn call(
        &self,
        request: http::Request<ClientBody>,
    ) -> impl Future<Output = http::Response<ProxyBody>> + Send {
        self.proxy.handle(request, self.info.clone())
    }

    fn lines(body: &ProxyBody) -> Option<&ResponseLines> {
        match body {
            ProxyBody::Upstream(UpstreamBody::Direct(body)) => body.lines(),
            _ => None,
        }
    }

    fn finish_unsent(body: ProxyBody) {
        if let ProxyBody::Upstream(UpstreamBody::Direct(mut body)) = body {
            body.finish();
        }
    }

    fn touch(&self) {
        self.activity.touch();
    }

    fn draining(&self) -> bool {
        self.activity.draining()
    }

    fn start(&self) -> InFlight {
        InFlight::start(self.activity.clone())
    }
}

/// Drives `work` (one connection's part) to its end, or until the watchdog closes the
/// connection (`None`): idle (see [`Activity::time_left`]), or the shutdown timeout has
/// passed. `drain` is called once, when the drain begins.
///
/// `work` is polled at every wake-up; the watchdog's timer and the shutdown phase only when
/// one of them woke the task (they have a waker of their own, [`SideWake`]). A `select!` over
/// the three polled all of them at each of the two or three wake-ups a request causes, about
/// 700 instructions per request for a timer and a phase that had not moved (callgrind;
/// docs/performance.md, row "Watchdog polled only when it woke the task").
async fn supervise<F: Future>(
    mut work: Pin<&mut F>,
    activity: &Activity,
    settings: ConnSettings,
    phase: &mut watch::Receiver<Phase>,
    mut drain: impl FnMut(Pin<&mut F>),
) -> Option<F::Output> {
    let idle = tokio::time::sleep(settings.next_check());
    tokio::pin!(idle);
    let mut draining = false;
    let side = Arc::new(SideWake::default());
    let side_waker = Waker::from(side.clone());
    let mut parent: Option<Waker> = None;
    loop {
        let event = {
            let changed = phase.changed();
            tokio::pin!(changed);
            // A new `changed` (and a reset timer) must be polled once to register.
            side.due.store(true, Ordering::Relaxed);
            std::future::poll_fn(|cx| {
                if let Poll::Ready(output) = work.as_mut().poll(cx) {
                    return Poll::Ready(Side::Done(output));
                }
                side.follow(&mut parent, cx.waker());
                // Read first: a locked swap at every wake-up costs more than it looks.
                if side.due.load(Ordering::Acquire) && side.due.swap(false, Ordering::AcqRel) {
                    let mut side_cx = Context::from_waker(&side_waker);
                    if let Poll::Ready(changed) = changed.as_mut().poll(&mut side_cx) {
                        return Poll::Ready(Side::Phase(changed.is_err()));
                    }
                    if idle.as_mut().poll(&mut side_cx).is_ready() {
                        return Poll::Ready(Side::Idle);
                    }
                }
                Poll::Pending
            })
            .await
        };
        match event {
            Side::Done(output) => return Some(output),
            Side::Phase(closed) => {
                let now = if closed {
                    Phase::Forced
                } else {
                    *phase.borrow()
                };
                match now {
                    Phase::Running => {}
                    Phase::Draining if !draining => {
                        draining = true;
                        drain(work.as_mut());
                    }
                    Phase::Draining => {}
                    Phase::Forced | Phase::Stopped => return None,
                }
            }
            Side::Idle => match activity.time_left(&settings) {
                Ok(left) => idle.as_mut().reset(tokio::time::Instant::now() + left),
                Err(rule) => {
                    tracing::debug!(rule, "closing connection");
                    return None;
                }
            },
        }
    }
}

/// What ended one wait of [`supervise`].
enum Side<T> {
    Done(T),
    /// The phase changed; `true`: its sender is gone.
    Phase(bool),
    Idle,
}

/// The waker of the watchdog's timer and of the phase: marks them due, then wakes the
/// connection's task (whose current waker it follows).
#[derive(Default)]
struct SideWake {
    due: AtomicBool,
    parent: std::sync::Mutex<Option<Waker>>,
}

impl SideWake {
    /// Keeps the task's waker, locking only when it changed (`last` is the caller's copy).
    fn follow(&self, last: &mut Option<Waker>, current: &Waker) {
        if last.as_ref().is_some_and(|w| w.will_wake(current)) {
            return;
        }
        *self.parent.lock().unwrap_or_else(PoisonError::into_inner) = Some(current.clone());
        *last = Some(current.clone());
    }
}

impl std::task::Wake for SideWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.due.store(true, Ordering::Release);
        let parent = self
            .parent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(parent) = parent {
            parent.wake();
        }
    }
}

/// When bytes last moved on a connection (on the coarse clock).
///
/// A connection is idle when no byte has moved for the idle timeout (a stalled upload, a
/// client that stopped reading, a dead peer), or when no request has been in progress for it.
/// The second rule is what closes an idle HTTP/2 connection whose peer keeps answering pings:
/// the pings themselves move bytes.
///
/// On HTTP/1.1 the same record enforces `header_read_timeout`: while no request is in progress
/// the connection is waiting for a head, and that wait may last no longer than the timeout
/// (from the connection's start, or from the end of its previous response, as hyper counts
/// it). An HTTP/2 or upgraded connection has no such wait.
///
/// It also carries the connection's switch to WebSocket, from the service that hands hyper
/// the checked `101` to the framing guard (which steps aside) and to the connection's task
/// (which runs the splice).
struct Activity {
    /// The server's clock these times are on.
    clock: Arc<CoarseClock>,
    last_byte_ms: AtomicU64,
    last_request_ms: AtomicU64,
    in_flight: AtomicU32,
    /// Requests started on the connection so far.
    started: AtomicU64,
    http1_heads: AtomicBool,
    /// A real `101` is being, or has been, handed to hyper.
    switched: AtomicBool,
    /// Its splice, until the connection's task takes it.
    splice: std::sync::Mutex<Option<Splice>>,
    /// The server is draining: the simple HTTP/1.1 path closes between requests, and says
    /// `connection: close` on the response in flight.
    draining: AtomicBool,
}

impl Activity {
    fn new(clock: Arc<CoarseClock>) -> Self {
        let now = clock.now_ms();
        Activity {
            clock,
            last_byte_ms: AtomicU64::new(now),
            last_request_ms: AtomicU64::new(now),
            in_flight: AtomicU32::new(0),
            started: AtomicU64::new(0),
            http1_heads: AtomicBool::new(true),
            switched: AtomicBool::new(false),
            splice: std::sync::Mutex::new(None),
            draining: AtomicBool::new(false),
        }
    }

    fn begin_drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Arms the switch: from the next read on, the framing guard lets the bytes through, and
    /// once hyper is done the connection's task runs `splice`.
    fn switch_to(&self, splice: Splice) {
        *self.splice.lock().unwrap_or_else(PoisonError::into_inner) = Some(splice);
        self.switched.store(true, Ordering::Release);
    }

    fn take_splice(&self) -> Option<Splice> {
        self.splice
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn touch(&self) {
        self.last_byte_ms
            .store(self.clock.now_ms(), Ordering::Relaxed);
    }

    /// How long the connection may stay open before the watchdog looks again, or the rule that
    /// closes it now: `idle_timeout` (no byte moved, or no request in progress) or, on
    /// HTTP/1.1, `header_read_timeout` (waiting that long for a request's head).
    fn time_left(&self, settings: &ConnSettings) -> Result<Duration, &'static str> {
        let now = self.clock.now_ms();
        let bytes = now.saturating_sub(self.last_byte_ms.load(Ordering::Relaxed));
        let waiting = if self.in_flight.load(Ordering::Acquire) > 0 {
            None
        } else {
            Some(now.saturating_sub(self.last_request_ms.load(Ordering::Relaxed)))
        };
        let quiet = Duration::from_millis(bytes.max(waiting.unwrap_or(0)));
        let Some(mut left) = settings
            .idle_timeout
            .checked_sub(quiet)
            .filter(|d| !d.is_zero())
        else {
            return Err("idle_timeout");
        };
        let head_wait = waiting.filter(|_| self.http1_heads.load(Ordering::Relaxed));
        if let Some(waiting) = head_wait {
            match settings
                .header_read_timeout
                .checked_sub(Duration::from_millis(waiting))
            {
                Some(head_left) if !head_left.is_zero() => left = left.min(head_left),
                _ => return Err("header_read_timeout"),
            }
        }
        Ok(left.min(settings.next_check()))
    }
}

/// One request in progress on a connection, from its headers until its response body is done.
struct InFlight(Arc<Activity>);

/// A response body that keeps its request counted as in progress until hyper drops it; on
/// HTTP/2 it also reports to its stream's watch.
struct CountedBody {
    body: ProxyBody,
    _in_flight: InFlight,
    progress: Option<StreamProgress>,
}

impl http_body::Body for CountedBody {
    type Data = bytes::Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, BodyError>>> {
        let this = self.get_mut();
        match &mut this.progress {
            Some(progress) => progress.poll_frame(Pin::new(&mut this.body), cx),
            None => Pin::new(&mut this.body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream() && self.progress.as_ref().is_none_or(|p| p.is_drained())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.progress {
            Some(progress) => progress.size_hint(self.body.size_hint()),
            None => self.body.size_hint(),
        }
    }
}

impl InFlight {
    fn start(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.started.fetch_add(1, Ordering::Relaxed);
        let now = activity.clock.now_ms();
        activity.last_request_ms.store(now, Ordering::Relaxed);
        InFlight(activity)
    }
}

impl InFlight {
    /// The connection this request came on.
    fn connection(&self) -> &Activity {
        &self.0
    }
}

impl Drop for InFlight {
    // Also on cancellation: a request whose client went away no longer counts.
    fn drop(&mut self) {
        let now = self.0.clock.now_ms();
        self.0.last_request_ms.store(now, Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A socket that records its activity for the idle watchdog, including whether its framing
/// guard still expects HTTP/1 heads, and that tells the guard when the connection has
/// switched to WebSocket (the only way the guard learns it).
///
/// While an HTTP/1 request is in flight it also watches for the client's close
/// ([`ClientStream`]), and fails the connection when it sees one, so that the request and its
/// upstream exchange are dropped as hyper's own check would drop them.
struct Tracked<S> {
    inner: FramingGuard<S>,
    activity: Arc<Activity>,
    /// The watch saw bytes waiting in the socket (a pipelined request). A close behind them
    /// is not looked for until hyper has read them (and dispatched them: see
    /// [`Tracked::client_went_away`]), as hyper's own check stopped once its buffer held bytes:
    /// a pipelining client that half-closes gets its first answers.
    bytes_waiting: bool,
}

impl<S: ClientStream> Tracked<S> {
    /// Whether the client has closed a connection whose HTTP/1 request is in flight. Only
    /// looked at once the request's body has been read whole: until then hyper reads, and
    /// sees a close itself (a peek per read of an upload would be a system call each).
    fn client_went_away(&mut self, cx: &mut Context<'_>) -> bool {
        if !S::SEES_CLOSE
            || self.bytes_waiting
            || self.inner.has_unread()
            || self.activity.in_flight.load(Ordering::Acquire) == 0
            || !self.inner.between_requests()
            || self.activity.switched.load(Ordering::Acquire)
            || self
                .inner
                .hands_over_more_than(self.activity.started.load(Ordering::Relaxed))
        {
            return false;
        }
        match self.inner.get_ref().poll_peer_closed(cx) {
            Poll::Ready(true) => true,
            Poll::Ready(false) => {
                self.bytes_waiting = true;
                false
            }
            Poll::Pending => false,
        }
    }

    /// A write's `result`, or the client's close when the write waits: hyper does not flush
    /// while a write waits, so a client that stopped reading and went away would otherwise
    /// hold its request until `idle_timeout`.
    fn unless_client_went_away(
        &mut self,
        result: Poll<io::Result<usize>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        if result.is_pending() && self.client_went_away(cx) {
            return Poll::Ready(Err(client_gone()));
        }
        result
    }
}

fn client_gone() -> io::Error {
    let why = "the client closed its connection while its request was in flight";
    io::Error::new(io::ErrorKind::ConnectionAborted, why)
}

impl<S: ClientStream> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.bytes_waiting = false;
        if self.activity.switched.load(Ordering::Acquire) {
            self.inner.step_aside();
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
            if !self.inner.reads_http1_heads() {
                self.activity.http1_heads.store(false, Ordering::Relaxed);
            }
        }
        result
    }
}

impl<S: ClientStream> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        self.unless_client_went_away(result, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        self.unless_client_went_away(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    // hyper flushes at every turn of an HTTP/1 connection, including the turns where it only
    // waits for the service: the one place a watch for the client's close gets polled then.
    // The watch looks after the flush, so whatever was written has gone out before it fails
    // the connection.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        if matches!(flushed, Poll::Ready(Ok(()))) && self.client_went_away(cx) {
            return Poll::Ready(Err(client_gone()));
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(idle: Duration) -> ConnSettings {
        ConnSettings {
            header_read_timeout: idle,
            idle_timeout: idle,
            fast_path: true,
        }
    }

    /// `supervise` with `work` and its output, with how many drains began; bounded, so that
    /// a wake-up that never comes fails the test instead of hanging it.
    async fn supervised<F: Future>(
        work: F,
        activity: &Activity,
        idle: Duration,
        mut phase: watch::Receiver<Phase>,
    ) -> (Option<F::Output>, u32) {
        tokio::pin!(work);
        let mut drains = 0;
        let supervised = supervise(work, activity, settings(idle), &mut phase, |_| drains += 1);
        let output = tokio::time::timeout(Duration::from_secs(5), supervised)
            .await
            .expect("supervise woke up");
        (output, drains)
    }

    #[tokio::test]
    async fn work_that_ends_is_returned() {
        let activity = Activity::new(Arc::new(CoarseClock::new()));
        let (_tx, phase) = watch::channel(Phase::Running);
        let work = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            7
        };
        let idle = Duration::from_secs(60);
        assert_eq!(supervised(work, &activity, idle, phase).await, (Some(7), 0));
    }

    #[tokio::test]
    async fn a_phase_change_wakes_the_watchdog_though_the_work_never_wakes() {
        let activity = Activity::new(Arc::new(CoarseClock::new()));
        let (tx, phase) = watch::channel(Phase::Running);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx.send(Phase::Draining);
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx.send(Phase::Forced);
        });
        let work = std::future::pending::<()>();
        let idle = Duration::from_secs(60);
        // Closed once forced, after the drain began once.
        assert_eq!(supervised(work, &activity, idle, phase).await, (None, 1));
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed_by_its_timer() {
        let clock = Arc::new(CoarseClock::new());
        tokio::spawn(clock.clone().run());
        let activity = Activity::new(clock);
        let (_tx, phase) = watch::channel(Phase::Running);
        let started = std::time::Instant::now();
        let work = std::future::pending::<()>();
        let idle = Duration::from_millis(100);
        assert_eq!(supervised(work, &activity, idle, phase).await, (None, 0));
        assert!(started.elapsed() >= idle);
    }
}
