//! The one response body type tollgate hands to hyper: either the upstream's body, streamed
//! through untouched (trailers included), or a small body tollgate wrote itself. An enum rather
//! than a boxed trait object keeps the hot path free of an allocation per response.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

pub enum ProxyBody {
    Upstream(Incoming),
    Local(Option<Bytes>),
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
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
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
