//! The body types tollgate hands to hyper.
//!
//! - [`ProxyBody`], every response: either the upstream's body, streamed through untouched
//!   (trailers included), or a small body tollgate wrote itself. An enum rather than a boxed
//!   trait object keeps the hot path free of an allocation per response.
//! - [`ClientBody`], the body of every request the proxy handles: hyper's, or none at all for a
//!   request that tollgate's own HTTP/1.1 server read (it takes only requests without a body),
//!   which also says that the response may go back to that server as field lines.
//! - [`RequestBody`], every request body sent upstream: the client's, streamed as it arrives,
//!   and cut with an error once it grows past the route's `max_body_size` (contract §5), which
//!   makes hyper abort the upstream request. Nothing is buffered.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use http::HeaderMap;

use crate::headers::ResponseFields;
use crate::http1::client::DirectBody;

pub enum ProxyBody {
    Upstream(UpstreamBody),
    Local(Option<Bytes>),
}

/// An upstream's response body: hyper's, or read by tollgate's own HTTP/1.1 client
/// (`http1::client`).
pub enum UpstreamBody {
    Hyper(Incoming),
    Direct(DirectBody),
}

/// Why an upstream's response body stopped before its end.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
    #[error("upstream response body: {0}")]
    Direct(#[from] std::io::Error),
}

impl UpstreamBody {
    /// Where the fields tollgate sets on this response go (`X-Request-Id`, the rate-limit
    /// fields): the field lines of a response tollgate's own client read for tollgate's own
    /// server, else `map`, the response's own, with room made for them.
    pub fn fields_to<'a>(&'a mut self, map: &'a mut HeaderMap) -> impl ResponseFields + 'a {
        let direct = match self {
            UpstreamBody::Direct(body) => Some(body),
            UpstreamBody::Hyper(_) => None,
        };
        crate::http1::client::response_fields(direct, map)
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            UpstreamBody::Hyper(inner) => Pin::new(inner).poll_frame(cx).map_err(Into::into),
            UpstreamBody::Direct(inner) => Pin::new(inner).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Hyper(inner) => inner.is_end_stream(),
            UpstreamBody::Direct(inner) => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Hyper(inner) => inner.size_hint(),
            UpstreamBody::Direct(inner) => inner.size_hint(),
        }
    }
}

impl ProxyBody {
    pub fn empty() -> Self {
        ProxyBody::Local(None)
    }

    pub fn text(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        if bytes.is_empty() {
            ProxyBody::Local(None)
        } else {
            ProxyBody::Local(Some(bytes))
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            ProxyBody::Upstream(inner) => Pin::new(inner).poll_frame(cx),
            ProxyBody::Local(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Upstream(inner) => inner.is_end_stream(),
            ProxyBody::Local(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Upstream(inner) => inner.size_hint(),
            ProxyBody::Local(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

/// A request's body as the client connection delivered it.
pub enum ClientBody {
    /// Read by hyper (HTTP/2, and HTTP/1.1 requests that are not simple).
    Hyper(Incoming),
    /// A request without a body that tollgate's own HTTP/1.1 server read (`http1::server`).
    /// Its response goes back to that server, which writes the fields it is given as lines
    /// (`http1::lines`): the forwarder asks tollgate's own client for them so.
    Simple,
    /// A request that has no body: an HTTP/2 request whose HEADERS frame ended the stream
    /// (`forward`).
    Empty,
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ClientBody::Hyper(inner) => Pin::new(inner).poll_frame(cx),
            ClientBody::Simple | ClientBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Hyper(inner) => inner.is_end_stream(),
            ClientBody::Simple | ClientBody::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Hyper(inner) => inner.size_hint(),
            ClientBody::Simple | ClientBody::Empty => SizeHint::with_exact(0),
        }
    }
}

/// The client's request body on its way upstream, with an optional size limit.
pub struct RequestBody {
    inner: ClientBody,
    cap: Option<Cap>,
}

struct Cap {
    /// Bytes still allowed.
    left: u64,
    /// Set when the body went past the limit, for the forwarder to tell a cut body from an
    /// upstream failure.
    exceeded: Arc<AtomicBool>,
}

/// Why a request body stopped: the client's connection failed, or the body grew past
/// `max_body_size`.
#[derive(Debug, thiserror::Error)]
pub enum RequestBodyError {
    #[error(transparent)]
    Client(#[from] hyper::Error),
    #[error("request body larger than max_body_size")]
    TooLarge,
}

impl RequestBody {
    /// Whether the request has no body at all ([`ClientBody::Simple`], [`ClientBody::Empty`]):
    /// such a request may go on tollgate's own upstream client (`http1::client`).
    pub fn is_absent(&self) -> bool {
        matches!(self.inner, ClientBody::Simple | ClientBody::Empty)
    }

    /// The body as it is, without a limit.
    pub fn unlimited(inner: ClientBody) -> Self {
        RequestBody { inner, cap: None }
    }

    /// The body cut after `max` bytes; the flag says whether that happened.
    pub fn capped(inner: ClientBody, max: u64) -> (Self, Arc<AtomicBool>) {
        let exceeded = Arc::new(AtomicBool::new(false));
        let cap = Cap {
            left: max,
            exceeded: exceeded.clone(),
        };
        let body = RequestBody {
            inner,
            cap: Some(cap),
        };
        (body, exceeded)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        let this = self.get_mut();
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(err))) => return Poll::Ready(Some(Err(err.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let (Some(cap), Some(data)) = (&mut this.cap, frame.data_ref()) {
            let len = data.len() as u64;
            if len > cap.left {
                cap.exceeded.store(true, Ordering::Release);
                return Poll::Ready(Some(Err(RequestBodyError::TooLarge)));
            }
            cap.left -= len;
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
