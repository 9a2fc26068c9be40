//! Forwarding to upstreams (SPEC section 5).
//!
//! One [`UpstreamPool`] per configured upstream, built at start (and at reload) and shared by
//! `Arc`: it owns a pooled keep-alive client, so connections to the backend are reused across
//! requests. Bodies are never buffered: the client's `Incoming` goes upstream as it arrives and
//! the upstream's `Incoming` comes back the same way, trailers included. HTTP/1.1 upgrades
//! (WebSocket) are forwarded as upgrades and both sides are spliced after `101`.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::config::UpstreamConfig;
use crate::error::{RequestError, StartupError};
use crate::headers;

/// How long an idle pooled upstream connection is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

thread_local! {
    /// Which connection worker runs on this thread (0 on any other thread).
    static WORKER: Cell<usize> = const { Cell::new(0) };
}

/// Marks the current thread as connection worker `index`, so that it uses its own upstream
/// client (see [`UpstreamPool`]).
pub fn set_worker_index(index: usize) {
    WORKER.with(|w| w.set(index));
}

pub struct UpstreamPool {
    pub config: Arc<UpstreamConfig>,
    /// The upstream's name, shared with the access log.
    pub name: Arc<str>,
    origins: Vec<(Scheme, Authority)>,
    next: AtomicUsize,
    /// One pooled client per connection worker. A client's connections are driven by tasks
    /// on the runtime that opened them; with one client per worker, a request and the
    /// upstream connection that carries it stay on one thread, with no cross-thread wake-up
    /// per request.
    clients: Vec<Client<HttpsConnector<HttpConnector>, Incoming>>,
}

/// Where and how one request goes upstream, decided by the proxy.
pub struct ForwardRequest<'a> {
    /// The normalised path (prefix already stripped when the route says so) and the query,
    /// as sent upstream.
    pub target: String,
    /// The authority the client asked for.
    pub client_authority: &'a str,
    pub forwarded: headers::ForwardedFor<'a>,
}

impl UpstreamPool {
    /// `workers`: the number of connection workers (one client each).
    pub fn new(config: Arc<UpstreamConfig>, workers: usize) -> Result<Self, StartupError> {
        let mut origins = Vec::with_capacity(config.urls.len());
        for url in &config.urls {
            let (Some(scheme), Some(authority)) = (url.scheme(), url.authority()) else {
                return Err(StartupError::Upstream(format!(
                    "upstream {}: url has no scheme or authority",
                    config.name
                )));
            };
            origins.push((scheme.clone(), authority.clone()));
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout));
        // The TLS connector wraps the plain one and takes over for https:// origins.
        http.enforce_http(false);
        let tls = crate::tls::client_config(config.ca_file.as_deref(), config.http2)
            .map_err(|e| StartupError::Upstream(format!("upstream {}: {e}", config.name)))?;
        // hyper-rustls sets ALPN itself from the enabled HTTP versions below.
        let mut tls = (*tls).clone();
        tls.alpn_protocols.clear();
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        // ALPN offers exactly what this upstream is configured to speak.
        let connector = if config.http2 {
            builder.enable_http2().wrap_connector(http)
        } else {
            builder.enable_http1().wrap_connector(http)
        };
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .http2_only(config.http2)
            // We set Host ourselves (preserve_host); the client must not add another.
            .set_host(false);
        let clients = (0..workers.max(1))
            .map(|_| builder.build(connector.clone()))
            .collect();
        Ok(UpstreamPool {
            name: Arc::from(config.name.as_str()),
            config,
            origins,
            next: AtomicUsize::new(0),
            clients,
        })
    }

    /// This thread's client: its worker's own (the modulo covers a thread that is not a
    /// worker, and a pool built for fewer workers).
    fn client(&self) -> &Client<HttpsConnector<HttpConnector>, Incoming> {
        let worker = WORKER.with(Cell::get);
        &self.clients[worker % self.clients.len()]
    }

    /// Round robin over the upstream's origins.
    fn pick(&self) -> &(Scheme, Authority) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.origins.len();
        &self.origins[i]
    }

    /// Sends the request upstream and returns its response with hop-by-hop headers removed.
    pub async fn forward(
        &self,
        mut req: Request<Incoming>,
        fwd: ForwardRequest<'_>,
    ) -> Result<Response<Incoming>, RequestError> {
        let (scheme, authority) = self.pick();
        let path_and_query = PathAndQuery::try_from(fwd.target)
            .map_err(|_| RequestError::BadRequest("unusable request target"))?;
        let uri = Uri::builder()
            .scheme(scheme.clone())
            .authority(authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|_| RequestError::BadRequest("unusable request target"))?;

        // An HTTP/1.1 upgrade is carried through as an upgrade; anything else loses its
        // hop-by-hop headers.
        let upgrade = if req.version() == Version::HTTP_11
            && !self.config.http2
            && headers::is_upgrade_request(req.headers())
        {
            req.headers()
                .get(header::UPGRADE)
                .cloned()
                .map(|protocol| (protocol, hyper::upgrade::on(&mut req)))
        } else {
            None
        };
        let from_h2 = req.version() == Version::HTTP_2;
        let client_takes_trailers = headers::accepts_trailers(req.headers());
        let headers = req.headers_mut();
        headers::strip_hop_by_hop(headers);
        // Framing is tollgate's: the body is re-framed from what actually arrives.
        headers.remove(header::CONTENT_LENGTH);
        if from_h2 && !self.config.http2 {
            headers::join_cookies(headers);
        }
        headers::add_forwarded(headers, &fwd.forwarded);
        let host = if self.config.preserve_host {
            HeaderValue::from_str(fwd.client_authority)
        } else {
            HeaderValue::from_str(authority.as_str())
        };
        if let Ok(host) = host {
            headers.insert(header::HOST, host);
        }
        if let Some((protocol, _)) = &upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, protocol.clone());
        }
        *req.uri_mut() = uri;
        *req.version_mut() = if self.config.http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };

        let sent = tokio::time::timeout(self.config.response_timeout, self.client().request(req));
        let mut response = match sent.await {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => return Err(RequestError::UpstreamUnreachable(describe(&err))),
            Err(_) => return Err(RequestError::UpstreamTimeout),
        };

        if let Some((_, client_upgrade)) = upgrade {
            if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                let protocol = response.headers().get(header::UPGRADE).cloned();
                let upstream_upgrade = hyper::upgrade::on(&mut response);
                tokio::spawn(splice(client_upgrade, upstream_upgrade));
                let headers = response.headers_mut();
                headers::strip_hop_by_hop(headers);
                headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                if let Some(protocol) = protocol {
                    headers.insert(header::UPGRADE, protocol);
                }
                return Ok(response);
            }
        }
        let announced = response.headers().get(header::TRAILER).cloned();
        headers::strip_hop_by_hop(response.headers_mut());
        // hyper's HTTP/1.1 encoder only sends the trailer fields that `Trailer` announces; a
        // client that negotiated trailers (`TE: trailers`, e.g. gRPC) gets the announcement
        // back so its trailers actually arrive.
        if let (true, Some(announced)) = (client_takes_trailers, announced) {
            response.headers_mut().insert(header::TRAILER, announced);
        }
        Ok(response)
    }
}

/// Copies bytes both ways between the upgraded client and upstream connections until either
/// side closes.
async fn splice(client: hyper::upgrade::OnUpgrade, upstream: hyper::upgrade::OnUpgrade) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(pair) => pair,
        Err(err) => {
            tracing::debug!(error = %err, "upgrade did not complete");
            return;
        }
    };
    let mut client = TokioIo::new(client);
    let mut upstream = TokioIo::new(upstream);
    if let Err(err) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        tracing::debug!(error = %err, "upgraded connection ended with an error");
    }
}

/// A one-line reason for the log; the full error chain of hyper's client is long.
fn describe(err: &hyper_util::client::legacy::Error) -> String {
    use std::error::Error as _;
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
