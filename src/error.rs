//! Errors. [`RequestError`] is every way a request can end without reaching (or hearing from)
//! the upstream; [`RequestError::status`] is the only place that turns a failure into an HTTP
//! status code, and [`RequestError::grpc_code`] the only place that turns it into a gRPC one
//! (SPEC 5c), so each mapping is decided once. [`StartupError`] is what stops the process from
//! starting, each with one clear line for stderr.

use std::io;
use std::net::SocketAddr;

use http::StatusCode;

/// Why a request was answered by tollgate itself instead of the upstream.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    #[error("no route matches")]
    NoRoute,
    /// A request target over `framing::MAX_TARGET`; HTTP/1.1 ones are refused by the framing
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
    UpstreamUnreachable(String),
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

    /// The gRPC status of tollgate's own answer to a gRPC request (SPEC 5c). Codes a gRPC
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

    /// A short word for the access log's `decision` field.
    pub fn log_word(&self) -> &'static str {
        match self {
            RequestError::BadRequest(_) => "bad_request",
            RequestError::NoRoute => "no_route",
            RequestError::UriTooLong => "uri_too_long",
            RequestError::PayloadTooLarge => "body_too_large",
            RequestError::MethodNotAllowed => "method_not_allowed",
            RequestError::UpstreamUnreachable(_) | RequestError::UpstreamBadSwitch(_) => {
                "upstream_error"
            }
            RequestError::UpstreamTimeout => "upstream_timeout",
            RequestError::StoreFailedClosed => "failed_closed",
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
    #[error("{0}")]
    Tls(String),
    #[error("{0}")]
    Store(String),
    #[error("{0}")]
    Upstream(String),
    #[error("cannot start a connection worker: {0}")]
    Runtime(io::Error),
}
