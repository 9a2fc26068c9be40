//! Errors. [`RequestError`] is every way a request can end without reaching (or hearing from)
//! the upstream; [`RequestError::status`] is the only place that turns a failure into an HTTP
//! status code, and [`RequestError::grpc_code`] the only place that turns it into a gRPC one
//! (contract §5c), so each mapping is decided once. [`StartupError`] is what stops the process from
//! starting, each with one clear line for stderr. [`Detail`] is the text of the errors that
//! wrap another one, with that error kept as the `source()`, so a report that walks the
//! chain (tracing's error fields, `{:#}`-style formatting) reaches the cause.

use std::error::Error;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use http::StatusCode;

use crate::decision::Decision;

/// Why a request was answered by tollgate itself instead of the upstream.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    #[error("no route matches")]
    NoRoute,
    /// A request target over `http1::rules::MAX_TARGET`; HTTP/1.1 ones are refused by the framing
    /// guard already, HTTP/2 `:path`s here.
    #[error("request target too long")]
    UriTooLong,
    /// A body announced (`Content-Length`) larger than the route's `max_body_size`.
    #[error("request body larger than max_body_size")]
    PayloadTooLarge,
    /// `TRACE`: it echoes the request back, credentials and cookies included, and no backend
    /// behind a rate limiter needs it (nginx answers 405 as well). `CONNECT`: a reverse proxy
    /// opens no tunnels, and one would pass every limit.
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(#[source] Detail),
    /// A `101` that switches to something the client did not ask for, or to a request that
    /// was not forwarded as an upgrade: passing it on would open a tunnel past every limit.
    #[error("upstream switched protocols unasked: {0}")]
    UpstreamBadSwitch(&'static str),
    #[error("upstream sent no response headers within the response timeout")]
    UpstreamTimeout,
    #[error("rate-limit store failing and the route fails closed")]
    StoreFailedClosed,
}

impl RequestError {
    pub fn status(&self) -> StatusCode {
        match self {
            RequestError::BadRequest(_) => StatusCode::BAD_REQUEST,
            RequestError::NoRoute => StatusCode::NOT_FOUND,
            RequestError::UriTooLong => StatusCode::URI_TOO_LONG,
            RequestError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RequestError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            RequestError::UpstreamUnreachable(_) | RequestError::UpstreamBadSwitch(_) => {
                StatusCode::BAD_GATEWAY
            }
            RequestError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            RequestError::StoreFailedClosed => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The gRPC status of tollgate's own answer to a gRPC request (contract §5c). Codes a gRPC
    /// client retries by default (`UNAVAILABLE`) are kept for what is transient: a store or
    /// an upstream that may answer the next attempt. What the next attempt would meet again
    /// (a request tollgate cannot take, a route that does not exist, an upstream that breaks
    /// the protocol) gets a code that is not retried.
    pub fn grpc_code(&self) -> GrpcCode {
        match self {
            RequestError::BadRequest(_) | RequestError::UriTooLong => GrpcCode::Internal,
            // gRPC always POSTs: a TRACE or CONNECT is a call of something not implemented here.
            RequestError::NoRoute | RequestError::MethodNotAllowed => GrpcCode::Unimplemented,
            RequestError::UpstreamUnreachable(_) | RequestError::StoreFailedClosed => {
                GrpcCode::Unavailable
            }
            RequestError::UpstreamBadSwitch(_) => GrpcCode::Internal,
            RequestError::UpstreamTimeout => GrpcCode::DeadlineExceeded,
            // gRPC's own code for a message over the receiver's size limit.
            RequestError::PayloadTooLarge => GrpcCode::ResourceExhausted,
        }
    }

    /// The `grpc-message` of that answer: fixed text, never the underlying error (an
    /// upstream's connect error names its address, which stays in tollgate's log).
    pub fn grpc_message(&self) -> &'static str {
        match self {
            RequestError::BadRequest(reason) => reason,
            RequestError::NoRoute => "no route matches",
            RequestError::UriTooLong => "request target too long",
            RequestError::PayloadTooLarge => "request body too large",
            RequestError::MethodNotAllowed => "method not allowed",
            RequestError::UpstreamUnreachable(_) => "upstream unreachable",
            RequestError::UpstreamBadSwitch(_) => "upstream switched protocols unasked",
            RequestError::UpstreamTimeout => "upstream timeout",
            RequestError::StoreFailedClosed => "rate-limit store unavailable",
        }
    }

    /// What the access log calls a request that ended so.
    pub fn decision(&self) -> Decision {
        match self {
            RequestError::BadRequest(_) => Decision::BadRequest,
            RequestError::NoRoute => Decision::NoRoute,
            RequestError::UriTooLong => Decision::UriTooLong,
            RequestError::PayloadTooLarge => Decision::BodyTooLarge,
            RequestError::MethodNotAllowed => Decision::MethodNotAllowed,
            RequestError::UpstreamUnreachable(_) | RequestError::UpstreamBadSwitch(_) => {
                Decision::UpstreamError
            }
            RequestError::UpstreamTimeout => Decision::UpstreamTimeout,
            RequestError::StoreFailedClosed => Decision::FailedClosed,
        }
    }
}

/// The gRPC status codes tollgate answers with, numbered as in gRPC's `status.proto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    DeadlineExceeded = 4,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
}

impl GrpcCode {
    /// The `grpc-status` value.
    pub fn as_str(self) -> &'static str {
        match self {
            GrpcCode::DeadlineExceeded => "4",
            GrpcCode::ResourceExhausted => "8",
            GrpcCode::Unimplemented => "12",
            GrpcCode::Internal => "13",
            GrpcCode::Unavailable => "14",
        }
    }
}

/// What keeps tollgate from starting (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    /// `Display` and `source()` are the [`Detail`]'s: the line on stderr is its text alone.
    #[error(transparent)]
    Tls(Detail),
    #[error(transparent)]
    Store(Detail),
    #[error(transparent)]
    Upstream(Detail),
    #[error("cannot start a connection worker: {0}")]
    Runtime(io::Error),
}

/// What went wrong, as the one line of text that is logged or printed, and the error it came
/// from when there is one.
///
/// The texts are built the way they always were (a prefix and the cause's own message), so
/// logs and stderr read the same; the cause is kept besides, for whatever walks `source()`.
#[derive(Clone)]
pub struct Detail(Repr);

/// Shared (`Arc`), so that one failure handed to every request of a coalesced statement is
/// cloned by a reference count.
#[derive(Clone)]
enum Repr {
    /// Only text: nothing caused it, or the cause was reduced to text where it was made.
    Text(String),
    /// An error as it is: its `Display`, and its `source()` chain.
    Error(Arc<dyn Error + Send + Sync>),
    /// `text` (which usually ends with `source`'s message), caused by `source`.
    Context {
        text: String,
        source: Arc<dyn Error + Send + Sync>,
    },
}

impl Detail {
    /// `error` itself: its message is the text, its sources are the chain.
    pub fn of(error: impl Error + Send + Sync + 'static) -> Self {
        Detail(Repr::Error(Arc::new(error)))
    }

    /// `text`, caused by `source`. `text` is shown as it is; include `source`'s message in it
    /// when the line should say it.
    pub fn caused_by(text: impl Into<String>, source: impl Error + Send + Sync + 'static) -> Self {
        Detail(Repr::Context {
            text: text.into(),
            source: Arc::new(source),
        })
    }

    /// The same cause with its text rewritten (to add where it happened, say).
    pub fn map_text(self, f: impl FnOnce(String) -> String) -> Self {
        Detail(match self.0 {
            Repr::Text(text) => Repr::Text(f(text)),
            Repr::Context { text, source } => Repr::Context {
                text: f(text),
                source,
            },
            Repr::Error(e) => Repr::Context {
                text: f(e.to_string()),
                source: e,
            },
        })
    }
}

/// Text without a cause, for the places that still build their message with `format!`.
impl From<String> for Detail {
    fn from(text: String) -> Self {
        Detail(Repr::Text(text))
    }
}

impl From<&str> for Detail {
    fn from(text: &str) -> Self {
        Detail(Repr::Text(text.to_owned()))
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Text(text) | Repr::Context { text, .. } => f.write_str(text),
            Repr::Error(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl fmt::Debug for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Text(text) => fmt::Debug::fmt(text, f),
            Repr::Error(e) => fmt::Debug::fmt(e, f),
            Repr::Context { text, source } => f
                .debug_struct("Detail")
                .field("text", text)
                .field("source", source)
                .finish(),
        }
    }
}

impl Error for Detail {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match &self.0 {
            Repr::Text(_) => None,
            // `Detail::of(e)` stands for `e`: the chain continues with `e`'s source, so `e`'s
            // message is not repeated.
            Repr::Error(e) => e.source(),
            Repr::Context { source, .. } => Some(&**source),
        }
    }
}

/// The errors under `e` (its `source()`, theirs, and so on), for tests that look for a cause.
#[cfg(test)]
pub(crate) fn sources<'a>(e: &'a (dyn Error + 'static)) -> Vec<&'a (dyn Error + 'static)> {
    std::iter::successors(e.source(), |&s| s.source()).collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::tls::TlsError;

    /// Every message of `e`'s `source()` chain, `e` first.
    fn chain(e: &(dyn Error + 'static)) -> Vec<String> {
        std::iter::once(e)
            .chain(sources(e))
            .map(|e| e.to_string())
            .collect()
    }

    fn unreadable_cert() -> TlsError {
        TlsError::Read {
            path: PathBuf::from("/etc/tollgate/cert.pem"),
            source: io::Error::new(io::ErrorKind::NotFound, "No such file or directory"),
        }
    }

    #[test]
    fn startup_errors_keep_their_text_and_reach_the_cause() {
        let tls = unreadable_cert();
        let text = tls.to_string();
        let err = StartupError::from(tls);
        // The stderr line is what `StartupError::Tls(e.to_string())` printed.
        assert_eq!(err.to_string(), text);
        assert_eq!(
            chain(&err),
            [
                "cannot read /etc/tollgate/cert.pem: No such file or directory",
                "No such file or directory"
            ]
        );
        let cause = err.source().expect("a source");
        assert_eq!(
            cause.downcast_ref::<io::Error>().map(io::Error::kind),
            Some(io::ErrorKind::NotFound)
        );

        let io = io::Error::other("connection refused");
        let err = StartupError::Upstream(Detail::caused_by(format!("upstream api: {io}"), io));
        assert_eq!(
            chain(&err),
            ["upstream api: connection refused", "connection refused"]
        );

        // Text alone still works, and has no cause.
        let err = StartupError::Store("store.url is not set".to_owned().into());
        assert_eq!(err.to_string(), "store.url is not set");
        assert!(err.source().is_none());
    }

    #[test]
    fn an_unreachable_upstream_keeps_its_text_and_its_cause() {
        let io = io::Error::new(io::ErrorKind::ConnectionRefused, "connection refused");
        let err = RequestError::UpstreamUnreachable(Detail::caused_by(
            format!("client error (Connect): {io}"),
            io,
        ));
        assert_eq!(
            err.to_string(),
            "upstream unreachable: client error (Connect): connection refused"
        );
        assert_eq!(
            chain(&err)[1..],
            [
                "client error (Connect): connection refused",
                "connection refused"
            ]
        );
        assert_eq!(err.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(err.grpc_message(), "upstream unreachable");
        let err = RequestError::UpstreamUnreachable("upstream has no origin".into());
        assert_eq!(
            err.to_string(),
            "upstream unreachable: upstream has no origin"
        );
    }
}
