//! Errors. [`RequestError`] is every way a request can end without reaching (or hearing from)
//! the upstream; [`RequestError::status`] is the only place that turns a failure into a status
//! code, so the mapping is decided once. [`StartupError`] is what stops the process from
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
    /// `TRACE`: it echoes the request back, credentials and cookies included, and no backend
    /// behind a rate limiter needs it (nginx answers 405 as well).
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
            RequestError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            RequestError::UpstreamUnreachable(_) | RequestError::UpstreamBadSwitch(_) => {
                StatusCode::BAD_GATEWAY
            }
            RequestError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            RequestError::StoreFailedClosed => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A short word for the access log's `decision` field.
    pub fn log_word(&self) -> &'static str {
        match self {
            RequestError::BadRequest(_) => "bad_request",
            RequestError::NoRoute => "no_route",
            RequestError::MethodNotAllowed => "method_not_allowed",
            RequestError::UpstreamUnreachable(_) | RequestError::UpstreamBadSwitch(_) => {
                "upstream_error"
            }
            RequestError::UpstreamTimeout => "upstream_timeout",
            RequestError::StoreFailedClosed => "failed_closed",
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
