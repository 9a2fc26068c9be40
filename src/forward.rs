//! Forwarding to upstreams (contract §5).
//!
//! One [`UpstreamPool`] per configured upstream, built at start (and at reload) and shared by
//! `Arc`. It keeps its own keep-alive connections to the backend, per connection worker, on
//! hyper's connection-level client (`hyper::client::conn`): a request takes the most recently
//! used idle HTTP/1.1 connection of its worker (or the worker's HTTP/2 connection), and the
//! connection goes back once the response body has been read to its end. hyper-util's
//! general-purpose pooled client did the same with a shared, hashed, lock-per-request pool and
//! several layers of futures: a quarter of tollgate's instructions per request in the
//! benchmark (docs/performance.md). A request without a body to a plain-HTTP origin goes on
//! tollgate's own HTTP/1.1 client instead ([`direct`]): no task, channel or dispatcher per
//! connection.
//!
//! With several origins (`urls`), requests go round robin; a connect that fails (refused,
//! timed out, TLS) has sent nothing, so the request moves on to the next origin, and the
//! origin is skipped by new requests for `fail_timeout` unless all have failed (contract §5, see
//! `UpstreamPool::send`).
//!
//! Bodies are never buffered: the client's `Incoming` goes upstream as it arrives (as a
//! [`RequestBody`], which cuts it at the route's `max_body_size`: a cut body is answered 413,
//! not 502) and the upstream's `Incoming` comes back the same way, trailers included. An HTTP/1.1 WebSocket
//! upgrade is forwarded as an upgrade; no other upgrade is (its request goes as a plain one),
//! and a `101` that switches to anything but what was forwarded gets 502 (contract §5). A checked
//! `101` carries its [`Splice`] (both pending upgrades) in its extensions: the client
//! connection's own task runs it after hyper is done with the connection (see
//! `server::serve_connection`), so the session keeps that connection's bounds.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use hyper::client::conn::{http1, http2};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower_service::Service;

use crate::body::{ClientBody, RequestBody, UpstreamBody};
use crate::config::UpstreamConfig;
use crate::deadline::Deadlines;
use crate::error::{Detail, RequestError, StartupError};
use crate::headers;
use crate::metrics::Metrics;

/// How long an idle upstream connection is kept for reuse.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Idle connections beyond `max_idle_connections` are closed once they have been idle this
/// long. Closing them the moment they go idle would close and reopen connections all through
/// a busy period (with 1,280 requests in flight, more than 128 are often idle for an
/// instant): only a burst's leftovers are meant.
const SURPLUS_GRACE: Duration = Duration::from_secs(1);
/// How often idle connections are looked over: without it, an expired or surplus one would
/// stay open until its worker next used that upstream.
const TRIM_EVERY: Duration = Duration::from_secs(1);

use crate::http1::client as direct;
use direct::{DirectConn, ExchangeError, Parking, Reply};

type Connector = HttpsConnector<HttpConnector>;
type UpstreamIo = MaybeHttpsStream<TokioIo<TcpStream>>;

pub struct UpstreamPool {
    pub config: Arc<UpstreamConfig>,
    /// The upstream's name, shared with the access log.
    pub name: Arc<str>,
    origins: Vec<Origin>,
    next: AtomicUsize,
    connector: Connector,
    /// One lane per connection worker. A connection is driven by a task on the runtime that
    /// opened it; a worker only uses its own lane, so a request and the upstream connection
    /// that carries it stay on one thread, and the lane's lock is only ever contended by the
    /// once-a-second trim ([`trim_idle`]).
    lanes: Arc<Lanes>,
    /// `response_timeout`s, one lane per worker as above, without a timer per request.
    deadlines: Arc<Deadlines>,
    /// When the pool was built: the clock of `Origin::failed_until`.
    born: std::time::Instant,
}

struct Origin {
    scheme: Scheme,
    authority: Authority,
    /// `Host` for requests to this origin when the client's is not preserved, made once.
    host: HeaderValue,
    /// `scheme://authority/`, what the connector dials.
    uri: Uri,
    /// Until when (milliseconds on the pool's clock) new requests skip this origin because
    /// it failed to connect; 0 = it did not.
    failed_until: AtomicU64,
}

/// One worker's connections to one upstream, by origin index.
#[derive(Default)]
struct Lane {
    /// Idle HTTP/1.1 connections of hyper's client, the most recently used last.
    idle: Vec<VecDeque<Idle<http1::SendRequest<RequestBody>>>>,
    /// Idle HTTP/1.1 connections of tollgate's own client ([`direct`]), likewise.
    direct: Vec<VecDeque<Idle<Box<DirectConn>>>>,
    /// The HTTP/2 connection, shared by all of this worker's requests to the origin.
    h2: Vec<Option<http2::SendRequest<RequestBody>>>,
}

/// Who sends a request upstream: the connection worker whose connections it uses (see
/// [`UpstreamPool`]), where connect failures are counted, and whether tollgate's own client
/// may carry it ([`ForwardRequest::direct_client`]).
#[derive(Clone, Copy)]
struct Via<'a> {
    worker: usize,
    metrics: &'a Metrics,
    direct_client: bool,
}

struct Idle<C> {
    conn: C,
    since: Instant,
}

impl<C> Idle<C> {
    fn new(conn: C) -> Self {
        let since = Instant::now();
        Idle { conn, since }
    }
}

/// A pool's lanes, one per connection worker.
struct Lanes(Box<[Mutex<Lane>]>);

/// Where tollgate's own client puts a connection whose response it has read whole.
impl direct::Park for Lanes {
    fn park(&self, worker: usize, origin: usize, conn: Box<DirectConn>) {
        lock(&self.0[worker]).park_direct(origin, conn);
    }
}

/// tollgate's own client on a connection the connector made to a plain-HTTP origin.
fn direct_conn(io: UpstreamIo) -> Result<Box<DirectConn>, RequestError> {
    match io {
        MaybeHttpsStream::Http(io) => Ok(DirectConn::new(io.into_inner())),
        MaybeHttpsStream::Https(_) => Err(RequestError::UpstreamUnreachable(
            "TLS to an origin tollgate's own client does not serve".into(),
        )),
    }
}

impl Lane {
    /// Puts a ready connection at the most-recently-used end of the origin's idle list.
    /// Expired and surplus connections are closed by `trim_idle`, not here.
    fn park(&mut self, origin: usize, sender: http1::SendRequest<RequestBody>) {
        self.idle[origin].push_back(Idle::new(sender));
    }

    /// The same for a connection of tollgate's own client, once its response was read whole.
    fn park_direct(&mut self, origin: usize, conn: Box<DirectConn>) {
        self.direct[origin].push_back(Idle::new(conn));
    }
}

/// Where and how one request goes upstream, decided by the proxy.
pub struct ForwardRequest<'a> {
    /// The normalised path (prefix already stripped when the route says so) and the query,
    /// as sent upstream.
    pub target: String,
    pub forwarded: headers::ForwardedFor<'a>,
    /// The request's field names, scanned once by the proxy (underscored ones may have been
    /// dropped since).
    pub names: headers::FieldNames,
    /// The `X-Request-Id` tollgate made for a request that carried none, not yet in its map.
    pub request_id: Option<headers::RequestId>,
    /// The route's `max_body_size`: a body growing past it is cut and the request aborted.
    pub max_body_size: Option<u64>,
    /// Where connect failures are counted.
    pub metrics: &'a Metrics,
    /// The connection worker sending it, whose own upstream connections it uses (see
    /// [`UpstreamPool`]).
    pub worker: usize,
    /// Whether it may go on tollgate's own client ([`direct`]) when it has no body; false
    /// only in tests that hold hyper's client to the same contract.
    pub direct_client: bool,
    /// Whether the answer's fields may reach tollgate's own server as lines; false when the
    /// proxy reads a field of the answer (a route charged after the response, contract §3d),
    /// which it reads in the answer's map.
    pub fields_as_lines: bool,
}

/// What [`UpstreamPool::rewrite_head`] leaves for sending the request and reading its answer.
struct Outbound<'a> {
    /// The fields tollgate adds, where the client that sends the request puts them.
    added: headers::Added<'a>,
    /// Where the answer's fields go.
    reply: Reply,
    host: HostHeader,
    /// The client's side of a WebSocket upgrade being carried through.
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    /// `TE: trailers`: the client takes trailers, so their announcement goes back to it.
    client_takes_trailers: bool,
}

/// The upstream's answer as the client gets it: hop-by-hop fields out, its length settled
/// (contract §4), and a `101` passed on only as the WebSocket switch the client asked for
/// (`client_upgrade`), spliced to it; with the answer, its field names for the proxy.
fn rewrite_response_head(
    mut response: Response<UpstreamBody>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    client_takes_trailers: bool,
) -> Result<(Response<UpstreamBody>, headers::FieldNames), RequestError> {
    let response_names = headers::FieldNames::of(response.headers(), false);
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        // A switch is only passed on when it is the one the client asked for: anything else
        // would hand the client a connection that no limit sees again.
        let Some(client_upgrade) = client_upgrade else {
            return Err(RequestError::UpstreamBadSwitch(
                "101 to a request forwarded without an upgrade",
            ));
        };
        if !headers::switches_to_websocket(response.headers()) {
            return Err(RequestError::UpstreamBadSwitch(
                "101 to another protocol than websocket",
            ));
        }
        let splice = Splice {
            client: client_upgrade,
            upstream: hyper::upgrade::on(&mut response),
        };
        response.extensions_mut().insert(splice);
        let headers = response.headers_mut();
        headers::strip_hop_by_hop(headers, &response_names);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, headers::websocket_upgrade());
        return Ok((response, response_names));
    }
    let announced = response_names.trailer(response.headers(), response.body());
    crate::http1::rules::settle_response_length(response.headers_mut());
    headers::strip_hop_by_hop(response.headers_mut(), &response_names);
    // A client that negotiated trailers (`TE: trailers`, e.g. gRPC) gets the announcement back
    // with a body that carries them, so that they actually arrive (`FieldNames::trailer`).
    if let (true, Some(announced)) = (client_takes_trailers, announced) {
        response.headers_mut().insert(header::TRAILER, announced);
    }
    Ok((response, response_names))
}

/// Where the `Host` of a forwarded request comes from.
enum HostHeader {
    /// The client's, kept (`preserve_host`), already in the request.
    Client,
    /// The origin's authority, set for whichever origin the request goes to.
    Origin,
}

/// Why one origin gave no response.
enum Failure {
    /// No connection could be made: nothing was sent, and the request comes back to go to
    /// the next origin.
    /// (Boxed: it is the rare case, and would otherwise make every attempt's result large.)
    Connect(Box<Request<RequestBody>>, RequestError),
    /// The request had started to go, or failed in a way another origin would not change:
    /// answered as it is (502), never sent again.
    Sent(RequestError),
}

/// Why upstream `name` cannot start: its name and `cause`'s message as the text, and `cause`
/// itself kept as the source, for whatever walks the chain.
fn upstream_error(
    name: &str,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> StartupError {
    StartupError::Upstream(Detail::caused_by(
        format!("upstream {name}: {cause}"),
        cause,
    ))
}

impl UpstreamPool {
    /// `workers`: the number of connection workers (one lane each).
    pub fn new(config: Arc<UpstreamConfig>, workers: usize) -> Result<Self, StartupError> {
        let mut origins = Vec::with_capacity(config.urls.len());
        for url in &config.urls {
            let (Some(scheme), Some(authority)) = (url.scheme(), url.authority()) else {
                return Err(StartupError::Upstream(
                    format!("upstream {}: url has no scheme or authority", config.name).into(),
                ));
            };
            let uri = Uri::builder()
                .scheme(scheme.clone())
                .authority(authority.clone())
                .path_and_query("/")
                .build()
                .map_err(|e| upstream_error(&config.name, e))?;
            let host = HeaderValue::from_str(authority.as_str())
                .map_err(|e| upstream_error(&config.name, e))?;
            origins.push(Origin {
                scheme: scheme.clone(),
                authority: authority.clone(),
                host,
                uri,
                failed_until: AtomicU64::new(0),
            });
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout));
        // The TLS connector wraps the plain one and takes over for https:// origins.
        http.enforce_http(false);
        let tls = crate::tls::client_config(config.ca_file.as_deref(), config.http2)
            .map_err(|e| upstream_error(&config.name, e))?;
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
        let lanes = (0..workers.max(1))
            .map(|_| {
                Mutex::new(Lane {
                    idle: origins.iter().map(|_| VecDeque::new()).collect(),
                    direct: origins.iter().map(|_| VecDeque::new()).collect(),
                    h2: origins.iter().map(|_| None).collect(),
                })
            })
            .collect();
        let lanes = Arc::new(Lanes(lanes));
        // Outside a runtime (`check`) nothing is ever pooled, so there is nothing to trim.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(trim_idle(
                Arc::downgrade(&lanes),
                config.max_idle_connections,
            ));
        }
        Ok(UpstreamPool {
            name: Arc::from(config.name.as_str()),
            config,
            origins,
            next: AtomicUsize::new(0),
            connector,
            deadlines: Deadlines::new(lanes.0.len()),
            lanes,
            born: std::time::Instant::now(),
        })
    }

    /// Round robin over the upstream's origins.
    fn pick(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.origins.len()
    }

    /// Sends the request upstream and returns its response with hop-by-hop headers removed,
    /// and the scan of its field names (what the proxy asks of it next: `FieldNames::own`).
    // Not an `async fn`: that would keep `req` twice, as its argument and as a local of its
    // body (rust-lang/rust#62958); the block below uses the argument in place.
    #[allow(clippy::manual_async_fn)]
    pub fn forward<'a>(
        &'a self,
        mut req: Request<ClientBody>,
        mut fwd: ForwardRequest<'a>,
    ) -> impl Future<Output = Result<(Response<UpstreamBody>, headers::FieldNames), RequestError>> + 'a
    {
        async move {
            let path_and_query = PathAndQuery::try_from(std::mem::take(&mut fwd.target))
                .map_err(|_| RequestError::BadRequest("unusable request target"))?;
            let connect = req.method() == Method::CONNECT;
            let out = self.rewrite_head(&mut req, path_and_query, &mut fwd);

            // The body goes as it arrives; with a limit, it is cut where it passes the limit
            // (an error from the body makes hyper abort the upstream request).
            let (req, cut) = match fwd.max_body_size {
                Some(max) => {
                    let (parts, body) = req.into_parts();
                    let (body, cut) = RequestBody::capped(body, max);
                    (Request::from_parts(parts, body), Some(cut))
                }
                None => (req.map(RequestBody::unlimited), None),
            };
            let worker = fwd.worker % self.lanes.0.len();
            let via = Via {
                worker,
                metrics: fwd.metrics,
                direct_client: fwd.direct_client,
            };
            let sent = self.deadlines.timeout(
                worker,
                self.config.response_timeout,
                self.send(via, req, &out.host, out.added, &out.reply),
            );
            let sent = sent.await;
            // Whatever the upstream connection made of it, a body cut at the limit is the
            // client's doing: 413, not 502.
            if cut.is_some_and(|cut| cut.load(std::sync::atomic::Ordering::Acquire)) {
                if let Ok(Err(_)) = &sent {
                    return Err(RequestError::PayloadTooLarge);
                }
            }
            let response = match sent {
                Ok(result) => result?,
                Err(_) => return Err(RequestError::UpstreamTimeout),
            };
            // hyper's client takes a 2xx to CONNECT for a switch, as it does a 101, and so would
            // hyper's server towards the client. tollgate opens no CONNECT tunnels.
            if connect && response.status().is_success() {
                return Err(RequestError::UpstreamBadSwitch("2xx to CONNECT"));
            }
            rewrite_response_head(response, out.client_upgrade, out.client_takes_trailers)
        }
    }

    /// The request's head as the upstream gets it: hop-by-hop fields out (a WebSocket upgrade
    /// carried through as one), the target in origin form, the version the upstream speaks,
    /// and what the request goes on with (see [`Outbound`]).
    fn rewrite_head<'a>(
        &self,
        req: &mut Request<ClientBody>,
        target: PathAndQuery,
        fwd: &mut ForwardRequest<'a>,
    ) -> Outbound<'a> {
        let names = &fwd.names;
        // An HTTP/1.1 WebSocket upgrade is carried through as an upgrade (to `websocket`
        // alone, whatever else the client listed); any other request, other upgrades (h2c)
        // included, loses its hop-by-hop headers and goes as a plain request.
        let client_upgrade = if req.version() == Version::HTTP_11
            && !self.config.http2
            && names.wants_websocket(req.headers())
        {
            Some(hyper::upgrade::on(&mut *req))
        } else {
            None
        };
        let from_h2 = req.version() == Version::HTTP_2;
        // An HTTP/2 request whose HEADERS frame ended the stream has no body at all: from
        // here it is one, as the simple path's are, and goes on tollgate's own client
        // (`direct`) like them, not through hyper's client and a task per connection.
        // HTTP/1.1 requests that hyper's server read stay on hyper's client: they include
        // the upgrades, which `direct` does not carry, and hyper's HTTP/1.1 server drops a
        // response's buffered head when the body fails in the same poll that gave its
        // first bytes, which `direct`'s body can do (hyper's client's cannot).
        if from_h2 && req.body().is_end_stream() {
            *req.body_mut() = ClientBody::Empty;
        }
        let simple = matches!(req.body(), ClientBody::Simple);
        let client_takes_trailers = names.accepts_trailers(req.headers());
        // Towards an HTTP/1.1 upstream the client's `Trailer` goes along with a body that
        // carries trailers, or they would be dropped (`FieldNames::trailer`; trailers pass
        // through: docs/architecture.md, `headers.rs`). HTTP/2 sends trailers unannounced.
        let announced_trailers = if self.config.http2 {
            None
        } else {
            names.trailer(req.headers(), req.body())
        };
        let headers = req.headers_mut();
        headers::strip_hop_by_hop(headers, names);
        if let Some(announced) = announced_trailers {
            headers.insert(header::TRAILER, announced);
        }
        // Framing is tollgate's: the body is re-framed from what actually arrives.
        headers.remove(header::CONTENT_LENGTH);
        if from_h2 && !self.config.http2 {
            headers::join_cookies(headers);
        }
        // What tollgate adds where the client sent nothing to replace waits for the client
        // that sends the request: tollgate's own writes it into the head, hyper's get it in
        // the map (`headers::Added`).
        let mut added = headers::Added::new(fwd.request_id.take());
        added.forwarding(headers, fwd.forwarded, names);
        // An answer to HTTP/2 gets the proxy's fields in its map; one to tollgate's own
        // HTTP/1.1 server (its request's body says it came from there), the only HTTP/1.1
        // requests on tollgate's own client, as lines, and the upstream's fields too when
        // tollgate's own client reads them (`http1::lines`). It goes down by reference:
        // by value, the futures that carry it were moved with four more `memcpy` calls per
        // request (about 130 instructions, `bench/instructions.sh`).
        let reply = if simple && fwd.fields_as_lines {
            Reply::Lines {
                keep_trailer: client_takes_trailers,
            }
        } else {
            Reply::Map {
                room: if from_h2 { direct::PROXY_FIELDS } else { 0 },
            }
        };
        // An HTTP/1.0 request may name no host; HTTP/1.1 upstream needs one: the origin's,
        // set by `aim` for whichever origin the request goes to.
        let host = match fwd.forwarded.host {
            Some(host) if self.config.preserve_host => {
                headers.insert(header::HOST, host.clone());
                HostHeader::Client
            }
            _ => HostHeader::Origin,
        };
        if client_upgrade.is_some() {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, headers::websocket_upgrade());
        }
        // HTTP/1.1 sends the origin form (`/path?query`); HTTP/2 takes `:scheme` and
        // `:authority` from an absolute URI, set by `aim`.
        *req.uri_mut() = Uri::from(target);
        *req.version_mut() = if self.config.http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        Outbound {
            added,
            reply,
            host,
            client_upgrade,
            client_takes_trailers,
        }
    }

    fn lane(&self, worker: usize) -> MutexGuard<'_, Lane> {
        lock(&self.lanes.0[worker])
    }

    /// Sends the request to the upstream's next origin (round robin). An origin that cannot
    /// be connected to has been sent nothing, so the request goes on to the next, whatever
    /// its method, each origin once (contract §5). Origins that failed to connect less than
    /// `fail_timeout` ago are skipped, and tried (in their turn) only once every other one
    /// has failed this request too: when all are down, they are all tried anyway, which is
    /// also how an origin that came back is found when nothing else works.
    // Not an `async fn`, for the reason given on `forward`.
    #[allow(clippy::manual_async_fn)]
    fn send<'a>(
        &'a self,
        via: Via<'a>,
        mut req: Request<RequestBody>,
        host: &'a HostHeader,
        mut added: headers::Added<'a>,
        reply: &'a Reply,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, RequestError>> + use<'a> {
        async move {
            let Via {
                worker,
                metrics,
                direct_client,
            } = via;
            let count = self.origins.len();
            let start = self.pick();
            // Filled only while some origin rests, so a request allocates nothing otherwise.
            let mut skipped: Vec<usize> = Vec::new();
            let mut step = 0;
            let mut last = None;
            loop {
                let origin = if step < count {
                    let origin = (start + step) % count;
                    step += 1;
                    if count > 1 && self.resting(origin) {
                        skipped.push(origin);
                        continue;
                    }
                    origin
                } else {
                    match skipped.get(step - count) {
                        Some(&origin) => {
                            step += 1;
                            origin
                        }
                        None => break,
                    }
                };
                self.aim(&mut req, origin, host)?;
                let attempt = if self.config.http2 {
                    added.move_into(req.headers_mut());
                    self.send_h2(worker, origin, req).await
                } else {
                    let direct = direct_client && req.body().is_absent();
                    self.send_h1(worker, origin, req, &mut added, reply, direct)
                        .await
                };
                match attempt {
                    Ok(response) => {
                        // It connects again: new requests need not skip it any longer.
                        let failed = &self.origins[origin].failed_until;
                        if failed.load(Ordering::Relaxed) != 0 {
                            failed.store(0, Ordering::Relaxed);
                        }
                        return Ok(response);
                    }
                    Err(Failure::Sent(err)) => return Err(err),
                    Err(Failure::Connect(unsent, err)) => {
                        self.connect_failed(origin, &err, metrics);
                        req = *unsent;
                        last = Some(err);
                    }
                }
            }
            Err(last.unwrap_or_else(|| {
                RequestError::UpstreamUnreachable("upstream has no origin".into())
            }))
        }
    }

    /// Points the request at `origin`: its `Host` when the client's is not kept, and for
    /// HTTP/2 the absolute URI (`:scheme`, `:authority`). Set again when a request moves on
    /// to another origin.
    fn aim(
        &self,
        req: &mut Request<RequestBody>,
        origin: usize,
        host: &HostHeader,
    ) -> Result<(), RequestError> {
        let Origin {
            scheme,
            authority,
            host: origin_host,
            ..
        } = &self.origins[origin];
        if let HostHeader::Origin = host {
            req.headers_mut().insert(header::HOST, origin_host.clone());
        }
        if self.config.http2 {
            let path_and_query = req
                .uri()
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"));
            *req.uri_mut() = Uri::builder()
                .scheme(scheme.clone())
                .authority(authority.clone())
                .path_and_query(path_and_query)
                .build()
                .map_err(|_| RequestError::BadRequest("unusable request target"))?;
        }
        Ok(())
    }

    /// Milliseconds since the pool was built: the clock of `Origin::failed_until`.
    fn clock(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether `origin` failed to connect less than `fail_timeout` ago.
    fn resting(&self, origin: usize) -> bool {
        let until = self.origins[origin].failed_until.load(Ordering::Relaxed);
        until != 0 && until > self.clock()
    }

    /// Counts and remembers a failed connect: new requests skip the origin for
    /// `fail_timeout`. With one origin there is nothing to skip to, and the request's own
    /// warning says it all.
    fn connect_failed(&self, origin: usize, err: &RequestError, metrics: &Metrics) {
        metrics.upstream_connect_failure(&self.name);
        let fail_timeout = u64::try_from(self.config.fail_timeout.as_millis()).unwrap_or(u64::MAX);
        let until = self.clock().saturating_add(fail_timeout).max(1);
        self.origins[origin]
            .failed_until
            .store(until, Ordering::Relaxed);
        if self.origins.len() > 1 {
            // The origin by its place in `urls`: configuration, but no address in a log line.
            tracing::warn!(
                upstream = %self.name,
                origin,
                error = %err,
                "upstream origin failed to connect; trying the next, and skipping it for fail_timeout"
            );
        }
    }

    /// HTTP/1.1: an idle connection of this worker if one is still open, else a new one. A
    /// request that an idle connection could not even start to send (the upstream closed it
    /// a moment ago) goes once more, on a new connection. Only a new connection that cannot
    /// be made gives the request back ([`Failure::Connect`]).
    // Not an `async fn`, for the reason given on `forward`.
    #[allow(clippy::manual_async_fn)]
    fn send_h1<'a, 'b>(
        &'a self,
        worker: usize,
        origin: usize,
        mut req: Request<RequestBody>,
        added: &'a mut headers::Added<'b>,
        reply: &'a Reply,
        direct: bool,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, Failure>> + use<'a, 'b> {
        async move {
            // A request without a body (`direct`: it has none and may go so) to a plain-HTTP
            // origin goes on tollgate's own client.
            if direct && self.origins[origin].scheme == Scheme::HTTP {
                return self.send_direct(worker, origin, req, added, reply).await;
            }
            added.move_into(req.headers_mut());
            if let Some(mut sender) = self.idle_h1(worker, origin) {
                match sender.try_send_request(req).await {
                    Ok(response) => {
                        self.recycle_h1(worker, origin, sender);
                        return Ok(response.map(UpstreamBody::Hyper));
                    }
                    Err(mut err) => match err.take_message() {
                        Some(unsent) => req = unsent,
                        None => return Err(Failure::Sent(unreachable(&err.into_error()))),
                    },
                }
            }
            // Boxed: connecting is the rare path, and its futures (TCP, TLS, handshake) would
            // otherwise make every request's future several times larger, and every move of it
            // a large copy.
            let mut sender = match Box::pin(self.open_h1(origin)).await {
                Ok(sender) => sender,
                Err(err) => return Err(Failure::Connect(Box::new(req), err)),
            };
            let response = sender
                .send_request(req)
                .await
                .map_err(|e| Failure::Sent(unreachable(&e)))?;
            self.recycle_h1(worker, origin, sender);
            Ok(response.map(UpstreamBody::Hyper))
        }
    }

    /// HTTP/1.1 on tollgate's own client ([`direct`]), with the same rules as [`Self::send_h1`]:
    /// an idle connection of this worker if one is still open, once more on a new connection
    /// when not a byte of the request could be written to it, and the request given back only
    /// when no new connection can be made.
    // Not an `async fn`, for the reason given on `forward`.
    #[allow(clippy::manual_async_fn)]
    fn send_direct<'a, 'b>(
        &'a self,
        worker: usize,
        origin: usize,
        req: Request<RequestBody>,
        added: &'a headers::Added<'b>,
        reply: &'a Reply,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, Failure>> + use<'a, 'b> {
        async move {
            let parking = || Parking {
                pool: self.lanes.clone(),
                worker,
                origin,
            };
            if let Some(conn) = self.idle_direct(worker, origin) {
                match direct::exchange(conn, &req, added, reply, parking()).await {
                    Ok(response) => return Ok(response.map(UpstreamBody::Direct)),
                    Err(ExchangeError::Unsent(_)) => {}
                    Err(ExchangeError::Sent(err)) => return Err(Failure::Sent(err)),
                }
            }
            // Boxed, as in `send_h1`: connecting is the rare path.
            let connected = Box::pin(self.connect(origin)).await;
            let conn = match connected.and_then(direct_conn) {
                Ok(conn) => conn,
                Err(err) => return Err(Failure::Connect(Box::new(req), err)),
            };
            match direct::exchange(conn, &req, added, reply, parking()).await {
                Ok(response) => Ok(response.map(UpstreamBody::Direct)),
                Err(ExchangeError::Unsent(err) | ExchangeError::Sent(err)) => {
                    Err(Failure::Sent(err))
                }
            }
        }
    }

    /// The most recently used idle connection of tollgate's own client that is still open,
    /// as [`Self::idle_h1`].
    fn idle_direct(&self, worker: usize, origin: usize) -> Option<Box<DirectConn>> {
        take_idle(&mut self.lane(worker).direct[origin], |conn| {
            conn.is_reusable()
        })
    }

    /// A new HTTP/1.1 connection, driven by a task on this worker.
    async fn open_h1(
        &self,
        origin: usize,
    ) -> Result<http1::SendRequest<RequestBody>, RequestError> {
        let io = self.connect(origin).await?;
        let (sender, connection) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|e| unreachable(&e))?;
        tokio::spawn(async move {
            if let Err(err) = connection.with_upgrades().await {
                tracing::debug!(error = %err, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }

    /// The most recently used idle connection that is still open; idle ones past
    /// [`POOL_IDLE_TIMEOUT`] (which `trim_idle` has not reached yet) are closed on the way.
    fn idle_h1(&self, worker: usize, origin: usize) -> Option<http1::SendRequest<RequestBody>> {
        take_idle(
            &mut self.lane(worker).idle[origin],
            http1::SendRequest::is_ready,
        )
    }

    /// Returns the connection to the worker's idle list once its response has been read to
    /// the end (an HTTP/1.1 connection carries one exchange at a time). A connection that
    /// closes instead, or was taken over by an upgrade, is dropped.
    fn recycle_h1(
        &self,
        worker: usize,
        origin: usize,
        mut sender: http1::SendRequest<RequestBody>,
    ) {
        // A small response has usually been read whole by the time its head is handed over:
        // then the connection goes back at once, without a task to wait for it (a task per
        // request cost about 1,900 instructions).
        if sender.is_ready() {
            self.lane(worker).park(origin, sender);
            return;
        }
        let lanes = self.lanes.clone();
        tokio::spawn(async move {
            if sender.ready().await.is_ok() {
                lock(&lanes.0[worker]).park(origin, sender);
            }
        });
    }

    /// HTTP/2: the worker's connection to the origin, opened on first use and replaced
    /// when it closes.
    async fn send_h2(
        &self,
        worker: usize,
        origin: usize,
        req: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, Failure> {
        let open = self.lane(worker).h2[origin]
            .clone()
            .filter(|sender| !sender.is_closed());
        let mut sender = match open {
            Some(sender) => sender,
            None => {
                let sender = match Box::pin(self.open_h2(origin)).await {
                    Ok(sender) => sender,
                    Err(err) => return Err(Failure::Connect(Box::new(req), err)),
                };
                self.lane(worker).h2[origin] = Some(sender.clone());
                sender
            }
        };
        let sent = async {
            sender.ready().await?;
            sender.send_request(req).await
        };
        sent.await
            .map(|response| response.map(UpstreamBody::Hyper))
            .map_err(|e| Failure::Sent(unreachable(&e)))
    }

    /// A new HTTP/2 connection, driven by a task on this worker.
    async fn open_h2(
        &self,
        origin: usize,
    ) -> Result<http2::SendRequest<RequestBody>, RequestError> {
        let io = self.connect(origin).await?;
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(io)
            .await
            .map_err(|e| unreachable(&e))?;
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(error = %err, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }

    /// A new TCP (and, for https origins, TLS) connection; `connect_timeout` bounds the TCP
    /// part.
    async fn connect(&self, origin: usize) -> Result<UpstreamIo, RequestError> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(|e| unreachable(&*e))?;
        connector
            .call(self.origins[origin].uri.clone())
            .await
            .map_err(|e| unreachable(&*e))
    }
}

/// Once a second until the pool is gone: closes idle connections past [`POOL_IDLE_TIMEOUT`],
/// and the oldest beyond `keep` per lane and origin once idle for [`SURPLUS_GRACE`], like
/// nginx's `keepalive`. Dropping a sender closes its connection, on whichever worker drives
/// it.
async fn trim_idle(lanes: Weak<Lanes>, keep: usize) {
    let mut tick = tokio::time::interval(TRIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(lanes) = lanes.upgrade() else {
            return;
        };
        let now = Instant::now();
        for lane in lanes.0.iter() {
            let lane = &mut *lock(lane);
            for (hyper, direct) in lane.idle.iter_mut().zip(lane.direct.iter_mut()) {
                trim(hyper, direct, now, keep);
            }
        }
    }
}

/// The most recently used of `idle` that `usable` accepts; the unusable ones on the way are
/// closed, and all of them once one is past [`POOL_IDLE_TIMEOUT`] (everything older is older
/// still, and `trim_idle` has not reached them yet).
fn take_idle<C>(idle: &mut VecDeque<Idle<C>>, usable: impl Fn(&C) -> bool) -> Option<C> {
    while let Some(candidate) = idle.pop_back() {
        if candidate.since.elapsed() > POOL_IDLE_TIMEOUT {
            idle.clear();
            return None;
        }
        if usable(&candidate.conn) {
            return Some(candidate.conn);
        }
    }
    None
}

/// One origin's idle connections of a lane, hyper's and tollgate's own client's: closes those
/// past [`POOL_IDLE_TIMEOUT`], then the oldest of either kind while there are more than `keep`
/// of both together, once idle for [`SURPLUS_GRACE`]. `max_idle_connections` bounds them
/// together.
fn trim<A, B>(
    hyper: &mut VecDeque<Idle<A>>,
    direct: &mut VecDeque<Idle<B>>,
    now: Instant,
    keep: usize,
) {
    let expired = |idle: Option<&Instant>| {
        idle.is_some_and(|since| now.duration_since(*since) > POOL_IDLE_TIMEOUT)
    };
    while expired(hyper.front().map(|i| &i.since)) {
        hyper.pop_front();
    }
    while expired(direct.front().map(|i| &i.since)) {
        direct.pop_front();
    }
    while hyper.len() + direct.len() > keep {
        let oldest_is_hyper = match (hyper.front(), direct.front()) {
            (Some(h), Some(d)) => h.since <= d.since,
            (Some(_), None) => true,
            _ => false,
        };
        let since = if oldest_is_hyper {
            hyper.front().map(|i| i.since)
        } else {
            direct.front().map(|i| i.since)
        };
        if since.is_none_or(|since| now.duration_since(since) < SURPLUS_GRACE) {
            return;
        }
        if oldest_is_hyper {
            hyper.pop_front();
        } else {
            direct.pop_front();
        }
    }
}

/// A lane's lock. A panic while it was held leaves nothing half-done that matters (a lane
/// only holds connections), so a poisoned lock is used as it is.
fn lock(lane: &Mutex<Lane>) -> MutexGuard<'_, Lane> {
    lane.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Both halves of a WebSocket switch the forwarder checked: the client's connection and the
/// upstream's, each handed over by hyper once its `101` has gone through. It travels in the
/// `101` response's extensions to the client connection's task, which runs it; it is `Clone`
/// only because extensions must be (a clone shares the same pending upgrades).
#[derive(Clone)]
pub struct Splice {
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
}

impl Splice {
    /// Copies bytes both ways, through a buffer of [`SPLICE_BUFFER`] per direction, until
    /// either side closes; once everything that side sent has been passed on, both are closed.
    /// A WebSocket has its own close handshake, so a half-closed session has nothing more to
    /// say, and waiting for the other half would let one peer hold the session (and its
    /// connection place) after the other is gone; nginx ends an upgraded session the same way.
    /// Dropping the future closes both connections.
    pub async fn run(self) {
        let (client, upstream) = match tokio::try_join!(self.client, self.upstream) {
            Ok(pair) => pair,
            Err(err) => {
                tracing::debug!(error = %err, "upgrade did not complete");
                return;
            }
        };
        let (client_reads, mut client_writes) = tokio::io::split(TokioIo::new(client));
        let (upstream_reads, mut upstream_writes) = tokio::io::split(TokioIo::new(upstream));
        let mut from_client = BufReader::with_capacity(SPLICE_BUFFER, client_reads);
        let mut from_upstream = BufReader::with_capacity(SPLICE_BUFFER, upstream_reads);
        let ended = tokio::select! {
            up = tokio::io::copy_buf(&mut from_client, &mut upstream_writes) => {
                let _ = upstream_writes.shutdown().await;
                up
            }
            down = tokio::io::copy_buf(&mut from_upstream, &mut client_writes) => {
                let _ = client_writes.shutdown().await;
                down
            }
        };
        if let Err(err) = ended {
            tracing::debug!(error = %err, "upgraded connection ended with an error");
        }
    }
}

/// The bytes a WebSocket session buffers per direction: what one session holds in tollgate,
/// whatever the peers send.
pub const SPLICE_BUFFER: usize = 8 * 1024;

/// A 502 with a one-line reason for the log: the error and its sources.
fn unreachable(err: &(dyn std::error::Error + 'static)) -> RequestError {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    RequestError::UpstreamUnreachable(text.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// Idle lists of hyper's and the own client's connections, each entry named and idle for
    /// the given seconds (oldest first), trimmed at `keep`: the names left.
    fn trimmed(
        hyper: &[(&'static str, u64)],
        direct: &[(&'static str, u64)],
        keep: usize,
    ) -> Vec<&'static str> {
        let now = Instant::now() + Duration::from_secs(1000);
        let list = |entries: &[(&'static str, u64)]| -> VecDeque<Idle<&'static str>> {
            entries
                .iter()
                .map(|&(conn, idle)| Idle {
                    conn,
                    since: now - Duration::from_secs(idle),
                })
                .collect()
        };
        let (mut hyper, mut direct) = (list(hyper), list(direct));
        trim(&mut hyper, &mut direct, now, keep);
        hyper.iter().chain(direct.iter()).map(|i| i.conn).collect()
    }

    #[test]
    fn max_idle_connections_bounds_both_clients_connections_together() {
        // The oldest go first, whichever client they belong to.
        let left = trimmed(
            &[("h-old", 30), ("h-new", 2)],
            &[("d-old", 20), ("d-new", 5)],
            2,
        );
        assert_eq!(left, ["h-new", "d-new"]);
        // Connections idle for less than the grace are kept, even past the bound.
        assert_eq!(trimmed(&[("h", 0)], &[("d", 0)], 0), ["h", "d"]);
        // Past the idle timeout, a connection goes whatever the bound.
        let expired = POOL_IDLE_TIMEOUT.as_secs() + 1;
        assert_eq!(
            trimmed(&[("h", expired)], &[("d", expired), ("d2", 3)], 10),
            ["d2"]
        );
    }

    fn upstream_with_ca(ca_file: PathBuf) -> UpstreamConfig {
        UpstreamConfig {
            name: "app".into(),
            urls: vec![Uri::from_static("https://127.0.0.1:1")],
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            preserve_host: false,
            ca_file: Some(ca_file),
            http2: false,
            max_idle_connections: 1,
            fail_timeout: Duration::from_secs(1),
        }
    }

    /// A start-up error names the upstream and keeps what caused it as its `source()`, so
    /// the reason is not flattened into text where it was made (issue 19).
    #[test]
    fn an_unreadable_ca_file_is_an_upstream_error_with_its_cause() {
        let missing = std::env::temp_dir().join("tollgate-no-such-ca-file.pem");
        let Err(err) = UpstreamPool::new(Arc::new(upstream_with_ca(missing)), 1) else {
            panic!("a CA file that does not exist must keep the upstream from starting");
        };
        assert!(matches!(err, StartupError::Upstream(_)), "{err:?}");
        let text = err.to_string();
        assert!(text.starts_with("upstream app: "), "{text}");
        let cause = std::error::Error::source(&err).expect("the TLS error is kept as the cause");
        assert!(text.contains(&cause.to_string()), "{text} / {cause}");
    }
}
