//! Attacks on tollgate's own HTTP/1.1 path over TLS (`http1::server`), where
//! the client's close is seen by reading ahead (a peek would see the encrypted `close_notify`),
//! the writes are flushed after each response, and the first request the path does not take
//! hands the connection to the framing guard and hyper with the bytes read and not used.
//!
//! What over TLS should be as over plain TCP is checked against plain TCP on the same server:
//! the bytes of the responses, request smuggling across the hand-over (a pipeline cut at every
//! byte), the bytes read ahead during a slow response handed on intact, cancellation when the
//! client leaves (`close_notify`, a half-close, a drop), the drain, rate limits. HTTP/2 by ALPN
//! (and by prior knowledge without ALPN) must still reach hyper.
//!
//! Every wait is bounded: a hang fails the test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::common::tls::TestPki;
use crate::common::wire::{self, lossy, read_one, read_to_end, responses_in, End, Resp, WAIT};
use crate::common::{config_from, pattern_byte, wait, Proxy, Upstream};

// ---------------------------------------------------------------------------------------------
// Set-up and clients.

/// One catch-all route, no limits.
const OPEN: &str = r#"
[[routes]]
name = "open"
upstream = "app"
"#;

/// tollgate with a plain and a TLS listener in front of a recording upstream.
struct Setup {
    pki: TestPki,
    upstream: Upstream,
    proxy: Proxy,
    tls_addr: SocketAddr,
    plain_addr: SocketAddr,
}

/// `server_extra` goes into `[server]`; `routes` after the upstream.
async fn setup(server_extra: &str, routes: &str) -> Setup {
    setup_for(None, server_extra, routes).await
}

/// The same, in front of the upstream at `other` when given (the recording upstream is started
/// all the same, and receives nothing then).
async fn setup_for(other: Option<SocketAddr>, server_extra: &str, routes: &str) -> Setup {
    let pki = TestPki::new();
    let cert = pki.issue("server", &["localhost", "127.0.0.1"]);
    let upstream = Upstream::start().await;
    let text = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
tls_listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"
{server_extra}

[[server.certs]]
cert = "{cert}"
key = "{key}"

[upstreams.app]
url = "http://@UPSTREAM@"

{routes}
"#,
        cert = cert.cert.display(),
        key = cert.key.display(),
    );
    let target = other.unwrap_or(upstream.addr);
    let proxy = Proxy::start(config_from(&text, target, &[])).await;
    let tls_addr = proxy.server().tls_addrs[0];
    let plain_addr = proxy.addr;
    Setup {
        pki,
        upstream,
        proxy,
        tls_addr,
        plain_addr,
    }
}

/// A client configuration that trusts the test CA only, offering `alpn` (none: an empty list);
/// TLS 1.2 only when `tls12`.
fn client_config(pki: &TestPki, alpn: &[&[u8]], tls12: bool) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(&pki.ca_file).expect("read the CA file");
    for cert in CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.expect("CA PEM")).expect("CA certificate");
    }
    let versions: &[&rustls::SupportedProtocolVersion] = if tls12 {
        &[&rustls::version::TLS12]
    } else {
        &[&rustls::version::TLS13, &rustls::version::TLS12]
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

async fn connect(addr: SocketAddr) -> TcpStream {
    tokio::time::timeout(WAIT, TcpStream::connect(addr))
        .await
        .expect("connect within 5 s")
        .expect("connect")
}

async fn handshake(config: Arc<rustls::ClientConfig>, stream: TcpStream) -> TlsStream<TcpStream> {
    let connector = tokio_rustls::TlsConnector::from(config);
    let name = ServerName::try_from("localhost").expect("server name");
    tokio::time::timeout(WAIT, connector.connect(name, stream))
        .await
        .expect("handshake within 5 s")
        .expect("handshake")
}

impl Setup {
    /// HTTP/1.1 over TLS 1.3 without ALPN, as most HTTP/1.1 clients connect.
    async fn tls(&self) -> TlsStream<TcpStream> {
        self.tls_with(&[], false).await
    }

    async fn tls_with(&self, alpn: &[&[u8]], tls12: bool) -> TlsStream<TcpStream> {
        let stream = connect(self.tls_addr).await;
        handshake(client_config(&self.pki, alpn, tls12), stream).await
    }

    /// Over TLS, with a 4 KiB receive buffer: tollgate's writes of a large response keep
    /// finding the socket full.
    async fn tls_small_window(&self) -> TlsStream<TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        let stream = tokio::time::timeout(WAIT, socket.connect(self.tls_addr))
            .await
            .expect("connect within 5 s")
            .expect("connect");
        handshake(client_config(&self.pki, &[], false), stream).await
    }

    /// A TLS connection on which `GET /slow/{ms}` has reached the upstream (which answers it
    /// `ms` milliseconds later).
    async fn slow_request_in_flight(&self, ms: u64) -> TlsStream<TcpStream> {
        let tls = self.tls().await;
        self.at_upstream(tls, &format!("/slow/{ms}")).await
    }

    /// A small-window TLS connection on which `GET /big/{size}` has reached the upstream.
    async fn large_response_waiting(&self, size: usize) -> TlsStream<TcpStream> {
        let tls = self.tls_small_window().await;
        self.at_upstream(tls, &format!("/big/{size}")).await
    }

    /// `tls` once a `GET` for `target` sent on it has reached the upstream (its first request).
    async fn at_upstream(
        &self,
        mut tls: TlsStream<TcpStream>,
        target: &str,
    ) -> TlsStream<TcpStream> {
        let request = format!("GET {target} HTTP/1.1\r\nHost: a\r\n\r\n");
        tls.write_all(request.as_bytes()).await.expect("write");
        tls.flush().await.expect("flush");
        wait::until("the request at the upstream", WAIT, || {
            self.upstream.count() == 1
        })
        .await;
        tls
    }

    fn uris(&self) -> Vec<String> {
        self.upstream
            .requests()
            .into_iter()
            .map(|r| r.uri)
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Reading.

fn statuses(responses: &[Resp]) -> Vec<u16> {
    responses.iter().map(|r| r.status).collect()
}

/// Whether `body` is the upstream's `/big/{size}` body: `size` bytes of its pattern.
fn is_big_body(body: &[u8], size: usize) -> bool {
    body.len() == size && body.iter().enumerate().all(|(i, b)| *b == pattern_byte(i))
}

/// A response in one line: the head with `date` and `x-request-id` masked, then the body (a
/// `/big/` body by its length and pattern), then the trailer fields.
fn summary(response: &Resp) -> String {
    let body = if response.body.len() > 256 {
        let pattern = is_big_body(&response.body, response.body.len());
        format!("<{} bytes, pattern {pattern}>", response.body.len())
    } else {
        format!("{:?}", lossy(&response.body))
    };
    format!(
        "{:?} {body} trailers {:?}",
        response.masked_head(),
        response.trailers
    )
}

/// Writes each of `writes` (flushed: over TLS, one record or more each), `pause` apart, then
/// reads until the connection ends (or 5 s pass). A failed write ends the writing.
async fn transcript<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    writes: &[&[u8]],
    pause: Duration,
) -> (Vec<u8>, End) {
    for (i, bytes) in writes.iter().enumerate() {
        if i > 0 && !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let written = tokio::time::timeout(WAIT, async {
            stream.write_all(bytes).await?;
            stream.flush().await
        })
        .await
        .expect("write within 5 s");
        if written.is_err() {
            break;
        }
    }
    read_to_end(stream, WAIT).await
}

/// `n` bytes of a pattern unlike the upstream's.
fn body_of(n: usize) -> Vec<u8> {
    (0..n).map(|i| b'a' + (i % 23) as u8).collect()
}

// ---------------------------------------------------------------------------------------------
// 1. The same bytes over TLS as over plain TCP; HTTP/2 still hyper's.

/// Whether the connection was closed: over TLS, with or without `close_notify`. (A request the
/// framing guard refuses gets its 400 and a close without `close_notify`, as it did before the
/// simple path served TLS: an ALPN-h2 connection, which goes to hyper's path at once, ends the
/// same way. Where `close_notify` is this change's to send, the tests below check it.)
fn closed(end: End) -> bool {
    matches!(
        end,
        End::Clean | End::Error(std::io::ErrorKind::UnexpectedEof)
    )
}

/// Requests of every kind the simple path serves or hands over (each followed, in the same
/// write, by a closing GET), on plain TCP and over TLS without ALPN, with ALPN `http/1.1` and
/// over TLS 1.2: the client reads the same responses, and the connection is closed in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http11_over_tls_is_answered_as_over_plain_tcp() {
    let s = setup("", OPEN).await;
    let end = "GET /end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let cases: &[(&str, bool)] = &[
        ("GET /x HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ("HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n", true),
        ("GET /trailers HTTP/1.1\r\nHost: a\r\nTE: trailers\r\n\r\n", false),
        ("GET /trailers HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ("GET /big/100000 HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ("GET /hop HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ("GET /close HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ("DELETE /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n", false),
        ("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc", false),
        (
            "POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            false,
        ),
        ("GET /x HTTP/1.0\r\nHost: a\r\n\r\n", false),
        ("GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n", false),
        ("OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", false),
        ("GET /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n", false),
        ("GET /x HTTP/1.1\r\nHost: a\r\n\r\n\x01\x02 garbage\r\n\r\n", false),
        ("GET /x HTTP/1.1\nHost: a\n\n", false),
        (
            "GET /x HTTP/1.1\r\nHost: a\r\n\r\n\
             POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\
             Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            false,
        ),
    ];
    let variants: [(&str, &[&[u8]], bool); 3] = [
        ("TLS without ALPN", &[], false),
        ("TLS with ALPN http/1.1", &[&b"http/1.1"[..]], false),
        ("TLS 1.2", &[], true),
    ];
    let mut failures = Vec::new();
    for (request, head) in cases {
        let bytes = format!("{request}{end}");
        let mut plain = connect(s.plain_addr).await;
        let (read, plain_end) = transcript(&mut plain, &[bytes.as_bytes()], Duration::ZERO).await;
        let expected: Vec<String> = responses_in(&read, *head).iter().map(summary).collect();
        assert!(
            closed(plain_end),
            "plain TCP: {request:?} ended {plain_end:?}"
        );
        for (label, alpn, tls12) in variants {
            let mut tls = s.tls_with(alpn, tls12).await;
            let (read, tls_end) = transcript(&mut tls, &[bytes.as_bytes()], Duration::ZERO).await;
            let got: Vec<String> = responses_in(&read, *head).iter().map(summary).collect();
            if got != expected || closed(tls_end) != closed(plain_end) {
                failures.push(format!(
                    "{request:?} over {label}: {got:#?} ending {tls_end:?}\n\
                     plain TCP: {expected:#?} ending {plain_end:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// HTTP/2 agreed by ALPN goes to hyper from the start (`may_speak_h1` is false); HTTP/2 by prior
/// knowledge over TLS without ALPN starts on the simple path, which hands the preface to hyper.
#[tokio::test]
async fn http2_over_tls_by_alpn_and_by_prior_knowledge_is_served_by_hyper() {
    let s = setup("", OPEN).await;
    for (label, alpn) in [("ALPN h2", &[&b"h2"[..]][..]), ("no ALPN", &[][..])] {
        let tls = s.tls_with(alpn, false).await;
        let agreed = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        assert_eq!(
            agreed,
            alpn.first().map(|p| p.to_vec()),
            "ALPN agreed ({label})"
        );
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .expect("HTTP/2 handshake");
        tokio::spawn(conn);
        let request = http::Request::get(format!("https://localhost/h2/{}", alpn.len()))
            .body(Empty::<Bytes>::new())
            .expect("request");
        let response = tokio::time::timeout(WAIT, sender.send_request(request))
            .await
            .unwrap_or_else(|_| panic!("no HTTP/2 response within 5 s ({label})"))
            .unwrap_or_else(|e| panic!("HTTP/2 request failed ({label}): {e}"));
        assert_eq!(response.version(), http::Version::HTTP_2, "{label}");
        assert_eq!(response.status(), http::StatusCode::OK, "{label}");
        let body = tokio::time::timeout(WAIT, response.into_body().collect())
            .await
            .expect("body within 5 s")
            .expect("body")
            .to_bytes();
        assert_eq!(&body[..], b"upstream ok", "{label}");
    }
    assert_eq!(s.uris(), ["/h2/1", "/h2/0"]);
}

// ---------------------------------------------------------------------------------------------
// 2. Smuggling and order across the hand-over, with bytes read ahead.

/// Runs `pipeline(tag)` cut in two writes at every byte (5 ms apart), each cut on its own TLS
/// connection (at most 12 at once), and returns what went wrong: each cut must get its four
/// answers in order and a clean close, and the upstream must see exactly its four requests.
async fn split_pipeline_failures(s: &Setup, slow_ms: u64) -> Vec<String> {
    let smuggled = "GET /smuggled HTTP/1.1\r\nX: y\r\n\r\n";
    // The upstream's answers: the echo returns the POST's body, which looks like a request.
    let expected_bodies = ["slow ok", "upstream ok", smuggled, "upstream ok"];
    let pipeline = move |cut: usize| {
        format!(
            "GET /slow/{slow_ms}?c={cut:04} HTTP/1.1\r\nHost: a\r\n\r\n\
             GET /s2?c={cut:04} HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n\
             POST /echo?c={cut:04} HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{smuggled}\
             GET /s3?c={cut:04} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            smuggled.len()
        )
    };
    let len = pipeline(0).len();
    let config = client_config(&s.pki, &[], false);
    let at_once = Arc::new(tokio::sync::Semaphore::new(12));
    let mut tasks = tokio::task::JoinSet::new();
    for cut in 1..len {
        let bytes = pipeline(cut).into_bytes();
        let (config, at_once, addr) = (config.clone(), at_once.clone(), s.tls_addr);
        tasks.spawn(async move {
            let _turn = at_once.acquire_owned().await.expect("semaphore");
            let mut tls = handshake(config, connect(addr).await).await;
            let (read, end) = transcript(
                &mut tls,
                &[&bytes[..cut], &bytes[cut..]],
                Duration::from_millis(5),
            )
            .await;
            (cut, read, end)
        });
    }
    let mut failures = Vec::new();
    let mut transcripts = Vec::new();
    while let Some(done) = tasks.join_next().await {
        transcripts.push(done.expect("a client task"));
    }
    let seen = s.upstream.requests();
    if let Some(r) = seen.iter().find(|r| !r.uri.contains("?c=")) {
        failures.push(format!("the upstream received {} {}", r.method, r.uri));
    }
    transcripts.sort_by_key(|(cut, _, _)| *cut);
    for (cut, read, end) in transcripts {
        let tag = format!("?c={cut:04}");
        let got: Vec<String> = seen
            .iter()
            .filter(|r| r.uri.ends_with(&tag))
            .map(|r| format!("{} {} {:?}", r.method, r.uri, lossy(&r.body)))
            .collect();
        let expected = [
            format!("GET /slow/{slow_ms}{tag} \"\""),
            format!("GET /s2{tag} \"\""),
            format!("POST /echo{tag} {smuggled:?}"),
            format!("GET /s3{tag} \"\""),
        ];
        let answers = responses_in(&read, false);
        let bodies: Vec<String> = answers.iter().map(|r| r.text()).collect();
        if got != expected
            || bodies != expected_bodies
            || statuses(&answers) != [200; 4]
            || end != End::Clean
        {
            failures.push(format!(
                "cut at {cut}: upstream {got:?}, answers {bodies:?} {:?}, end {end:?}",
                statuses(&answers)
            ));
        }
    }
    failures
}

/// Simple requests around a POST whose body looks like a request, cut in two TLS records at
/// every byte: wherever the cut, the upstream receives these four requests and no other, and
/// the client their four answers in order. The first request is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_pipeline_split_at_every_byte_over_tls_reaches_the_upstream_unchanged() {
    let s = setup("", OPEN).await;
    let failures = split_pipeline_failures(&s, 0).await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same with a first request that the upstream answers only after 40 ms: the rest, when cut
/// after the first request, arrives while it is in flight and is read ahead (up to 4 KiB kept
/// for the next request, the watch turned off), then handed to hyper at the POST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_pipeline_behind_a_slow_request_split_at_every_byte_over_tls_is_unchanged() {
    let s = setup("", OPEN).await;
    let failures = split_pipeline_failures(&s, 40).await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A whole pipeline written one byte per TLS record: every head is read a byte at a time on
/// the simple path, and the POST's body by hyper after the hand-over.
#[tokio::test]
async fn a_pipeline_written_a_byte_per_tls_record_is_answered_in_order() {
    let s = setup("", OPEN).await;
    let pipeline: &[u8] = b"GET /b1 HTTP/1.1\r\nHost: a\r\n\r\n\
        POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello\
        GET /b2 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let writes: Vec<&[u8]> = pipeline.chunks(1).collect();
    let mut tls = s.tls().await;
    let (read, end) = transcript(&mut tls, &writes, Duration::ZERO).await;
    let answers = responses_in(&read, false);
    let bodies: Vec<String> = answers.iter().map(|r| r.text()).collect();
    assert_eq!(bodies, ["upstream ok", "hello", "upstream ok"]);
    assert_eq!(end, End::Clean);
    assert_eq!(s.uris(), ["/b1", "/echo", "/b2"]);
}

/// A POST with a 200 kB body sent while a slow GET is in flight: the simple path reads its
/// first bytes ahead, and after the GET's answer hands them, with the rest still in TLS, to
/// hyper. The body reaches the upstream intact and the answers come in order.
#[tokio::test]
async fn a_large_post_read_ahead_behind_a_slow_get_reaches_the_upstream_whole_and_in_order() {
    let s = setup("", OPEN).await;
    let mut tls = s.slow_request_in_flight(300).await;
    let body = body_of(200_000);
    let mut rest = format!(
        "POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    rest.extend_from_slice(&body);
    rest.extend_from_slice(b"GET /after HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    let (read, end) = transcript(&mut tls, &[&rest], Duration::ZERO).await;
    let answers = responses_in(&read, false);
    assert_eq!(statuses(&answers), [200, 200, 200]);
    assert_eq!(answers[0].text(), "slow ok");
    assert!(answers[1].body == body, "the echoed body differs");
    assert_eq!(answers[2].text(), "upstream ok");
    assert_eq!(end, End::Clean);
    let seen = s.upstream.requests();
    let uris: Vec<&str> = seen.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(uris, ["/slow/300", "/echo", "/after"]);
    assert!(seen[1].body == body, "the upstream got a different body");
}

/// Requests sent while tollgate's write of a 6 MB response (more than the kernel's 4 MiB send
/// buffer and rustls' 64 KiB can hold) waits for a client that does not read yet: read ahead
/// during the write, they are answered after it, in order, and the large response arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sent_while_a_large_response_waits_are_answered_after_it() {
    let s = setup("", OPEN).await;
    let size = 6_000_000;
    let mut tls = s.large_response_waiting(size).await;
    // tollgate's write fills the small window and waits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rest: &[u8] = b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello\
        GET /after HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    tls.write_all(rest).await.expect("write");
    tls.flush().await.expect("flush");
    let (read, end) = read_to_end(&mut tls, Duration::from_secs(15)).await;
    assert_eq!(end, End::Clean, "after {} bytes", read.len());
    let answers = responses_in(&read, false);
    assert_eq!(statuses(&answers), [200, 200, 200]);
    assert!(
        is_big_body(&answers[0].body, size),
        "the large body differs from the upstream's"
    );
    assert_eq!(answers[1].text(), "hello");
    assert_eq!(answers[2].text(), "upstream ok");
    assert_eq!(
        s.uris(),
        [format!("/big/{size}"), "/echo".into(), "/after".into()]
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Clients that leave.

/// How a client leaves while its request waits for the upstream.
#[derive(Debug, Clone, Copy)]
enum Leave {
    /// `close_notify`, then the TCP write side shut (tokio-rustls' `shutdown`).
    CloseNotifyAndFin,
    /// `close_notify` only: the TCP connection stays open both ways.
    CloseNotifyOnly,
    /// The TCP write side shut, without `close_notify` (a truncation, for TLS).
    FinOnly,
    /// Bytes on the TCP connection that are not a record of the session: TLS fails.
    Garbage,
    /// The socket closed.
    Drop,
}

/// Sends a request the upstream answers in 5 s (a GET on the simple path, or, when
/// `after_hand_over`, a POST that hyper reads after a GET served on the simple path) and leaves
/// as `how` once it has reached the upstream: whether the upstream exchange was dropped within
/// 3 s, and how the connection then ended for the client (it must end, with no answer); None
/// for [`Leave::Drop`], where the client no longer holds the connection to see its end.
async fn leave_mid_request(how: Leave, after_hand_over: bool) -> (bool, Option<End>) {
    let s = setup("", OPEN).await;
    let mut tls = s.tls().await;
    let request: &[u8] = if after_hand_over {
        tls.write_all(b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .expect("write");
        tls.flush().await.expect("flush");
        assert_eq!(read_one(&mut tls).await.status, 200);
        b"POST /slow/5000 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi"
    } else {
        b"GET /slow/5000 HTTP/1.1\r\nHost: a\r\n\r\n"
    };
    let before = s.upstream.count();
    tls.write_all(request).await.expect("write");
    tls.flush().await.expect("flush");
    wait::until("the request at the upstream", WAIT, || {
        s.upstream.count() == before + 1 && s.upstream.open_connections() > 0
    })
    .await;
    // Exchanges done before it may leave an idle pooled connection open: the slow one must go.
    let open = s.upstream.open_connections();
    let mut kept = Some(tls);
    if let Some(tls) = kept.as_mut() {
        match how {
            Leave::CloseNotifyAndFin => tls.shutdown().await.expect("TLS shutdown"),
            Leave::CloseNotifyOnly => {
                tls.get_mut().1.send_close_notify();
                tls.flush().await.expect("flush close_notify");
            }
            Leave::FinOnly => tls.get_mut().0.shutdown().await.expect("TCP shutdown"),
            Leave::Garbage => {
                let record = b"\x17\x03\x03\x00\x05hello";
                tls.get_mut().0.write_all(record).await.expect("write");
            }
            Leave::Drop => {}
        }
    }
    if matches!(how, Leave::Drop) {
        kept = None;
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while s.upstream.open_connections() >= open && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released = s.upstream.open_connections() < open;
    let end = match kept {
        Some(mut tls) => {
            let (read, end) = read_to_end(&mut tls, WAIT).await;
            assert!(read.is_empty(), "{how:?}: answered {:?}", lossy(&read));
            Some(end)
        }
        None => None,
    };
    (released, end)
}

/// However a TLS client leaves while its request waits for the upstream (as over plain TCP,
/// where the peek sees the FIN), the upstream exchange is dropped and the connection ends: on
/// the simple path (its read ahead sees the end) and after the hand-over (hyper's read does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_that_leaves_mid_request_cancels_the_upstream_exchange_however_it_leaves() {
    let mut failures = Vec::new();
    for after_hand_over in [false, true] {
        for how in [
            Leave::CloseNotifyAndFin,
            Leave::CloseNotifyOnly,
            Leave::FinOnly,
            Leave::Garbage,
            Leave::Drop,
        ] {
            let (released, end) = leave_mid_request(how, after_hand_over).await;
            if !released || end == Some(End::Open) {
                failures.push(format!(
                    "{how:?} (after the hand-over: {after_hand_over}): upstream exchange \
                     dropped {released}, the client's connection {end:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A client that stops reading a large response and goes away: the simple path's write waits,
/// and the read ahead beside it sees the close, dropping the upstream exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_that_stops_reading_and_leaves_releases_the_upstream() {
    let s = setup("", OPEN).await;
    let tls = s.large_response_waiting(40_000_000).await;
    // Long enough for the socket buffers to fill and tollgate's write to wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.upstream.open_connections(), 1, "the exchange ended early");
    drop(tls);
    wait::until(
        "the upstream exchange was kept after its TLS client had gone",
        Duration::from_secs(3),
        || s.upstream.open_connections() == 0,
    )
    .await;
}

/// A TLS 1.3 `KeyUpdate` from the client while its request is in flight brings no bytes: the
/// read ahead must neither take it for the client's going away nor stop watching. The request
/// is answered, the connection goes on, and a later client that updates its keys and then
/// leaves still cancels its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_update_mid_request_is_neither_a_close_nor_a_request() {
    let s = setup("", OPEN).await;
    let mut tls = s.slow_request_in_flight(300).await;
    tls.get_mut()
        .1
        .refresh_traffic_keys()
        .expect("a key update");
    tls.flush().await.expect("flush the key update");
    let first = read_one(&mut tls).await;
    assert_eq!(first.text(), "slow ok");
    let (read, end) = transcript(
        &mut tls,
        &[b"GET /next HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"],
        Duration::ZERO,
    )
    .await;
    assert_eq!(
        responses_in(&read, false)
            .iter()
            .map(|r| r.text())
            .collect::<Vec<_>>(),
        ["upstream ok"]
    );
    assert_eq!(end, End::Clean);

    let mut tls = s.tls().await;
    tls.write_all(b"GET /slow/5000 HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    tls.flush().await.expect("flush");
    wait::until("the second slow request at the upstream", WAIT, || {
        s.upstream.count() == 3 && s.upstream.open_connections() >= 1
    })
    .await;
    let open = s.upstream.open_connections();
    tls.get_mut()
        .1
        .refresh_traffic_keys()
        .expect("a key update");
    tls.flush().await.expect("flush the key update");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        s.upstream.open_connections(),
        open,
        "a key update dropped the request"
    );
    drop(tls);
    wait::until(
        "the request was kept after its client updated its keys and left",
        Duration::from_secs(3),
        || s.upstream.open_connections() < open,
    )
    .await;
}

/// Two pipelined GETs and then `close_notify` with the TCP write side shut: as over plain TCP
/// with a FIN (tests/it/h1_wire.rs), the first is answered, the close is then taken for the
/// client's going away, and the connection ends.
#[tokio::test]
async fn pipelined_gets_then_close_notify_are_treated_as_over_plain_tcp() {
    let s = setup("", OPEN).await;
    let pair: &[u8] = b"GET /p1 HTTP/1.1\r\nHost: a\r\n\r\nGET /p2 HTTP/1.1\r\nHost: a\r\n\r\n";
    let mut plain = connect(s.plain_addr).await;
    plain.write_all(pair).await.expect("write");
    plain.shutdown().await.expect("shutdown");
    let (read, plain_end) = read_to_end(&mut plain, WAIT).await;
    let plain_answers: Vec<String> = responses_in(&read, false)
        .iter()
        .map(|r| r.text())
        .collect();

    let mut tls = s.tls().await;
    tls.write_all(pair).await.expect("write");
    tls.shutdown().await.expect("TLS shutdown");
    let (read, tls_end) = read_to_end(&mut tls, WAIT).await;
    let tls_answers: Vec<String> = responses_in(&read, false)
        .iter()
        .map(|r| r.text())
        .collect();
    assert_eq!(plain_answers, ["upstream ok"], "plain TCP");
    assert_eq!(tls_answers, plain_answers, "over TLS");
    assert_ne!(plain_end, End::Open);
    assert_eq!(tls_end, End::Clean, "over TLS");
}

// ---------------------------------------------------------------------------------------------
// 4. The drain and timeouts.

/// In a drain, the TLS request in flight is answered with `connection: close`, and a request
/// sent behind it meanwhile (read ahead) is neither answered nor forwarded; the connection ends
/// with `close_notify`.
#[tokio::test]
async fn a_drain_answers_the_tls_request_in_flight_and_forwards_nothing_read_ahead() {
    let mut s = setup("", OPEN).await;
    let mut tls = s.slow_request_in_flight(500).await;
    tls.write_all(b"GET /after HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    tls.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let server = s.proxy.server.take().expect("running");
    let stopping = tokio::spawn(server.shutdown());
    let (read, end) = read_to_end(&mut tls, WAIT).await;
    let answers = responses_in(&read, false);
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].text(), "slow ok");
    assert_eq!(answers[0].header("connection"), Some("close"));
    assert_eq!(end, End::Clean);
    assert_eq!(s.uris(), ["/slow/500"]);
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("stopped within 5 s")
        .expect("stop task");
}

/// Idle keep-alive TLS connections are closed by the drain with `close_notify` (RFC 8446 6.1:
/// each party must send it before closing its write side), whichever path served their last
/// request: hyper's (after a POST) shuts the stream down; the simple path (after a GET) must
/// too.
#[tokio::test]
async fn idle_tls_connections_closed_by_the_drain_end_with_close_notify() {
    let mut s = setup("", OPEN).await;
    let mut after_get = s.tls().await;
    after_get
        .write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    after_get.flush().await.expect("flush");
    assert_eq!(read_one(&mut after_get).await.status, 200);
    let mut after_post = s.tls().await;
    after_post
        .write_all(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
        .await
        .expect("write");
    after_post.flush().await.expect("flush");
    assert_eq!(read_one(&mut after_post).await.text(), "hi");

    let server = s.proxy.server.take().expect("running");
    let stopping = tokio::spawn(server.shutdown());
    let (read, hyper_end) = read_to_end(&mut after_post, Duration::from_secs(2)).await;
    assert!(read.is_empty(), "{:?}", lossy(&read));
    let (read, simple_end) = read_to_end(&mut after_get, Duration::from_secs(2)).await;
    assert!(read.is_empty(), "{:?}", lossy(&read));
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("stopped within 5 s")
        .expect("stop task");
    assert_eq!(
        [("hyper's path", hyper_end), ("the simple path", simple_end)],
        [
            ("hyper's path", End::Clean),
            ("the simple path", End::Clean)
        ],
        "how each idle connection ended at the drain (UnexpectedEof: no close_notify)"
    );
}

/// A client that ends its side cleanly between requests (`close_notify`, then a FIN) gets
/// tollgate's own `close_notify` before the close (RFC 8446 6.1; TLS 1.2, RFC 5246 7.2.1, asks
/// for the reply outright), whichever path served its last request, as over plain TCP the FIN
/// is answered with a FIN. hyper's path does: its read sees the end and it shuts the stream
/// down. On the simple path `next_head` takes the end for `Stop::Close`, and `serve` shuts the
/// stream down only when the server is draining, so the socket is dropped without
/// `close_notify` and the client reads `UnexpectedEof` (before this change, such a connection
/// was hyper's and closed cleanly).
#[tokio::test]
async fn a_client_close_notify_between_requests_is_answered_with_close_notify() {
    let s = setup("", OPEN).await;
    let mut ends = Vec::new();
    for (label, request) in [
        (
            "hyper's path",
            &b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi"[..],
        ),
        (
            "the simple path",
            &b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"[..],
        ),
    ] {
        let mut tls = s.tls().await;
        tls.write_all(request).await.expect("write");
        tls.flush().await.expect("flush");
        assert_eq!(read_one(&mut tls).await.status, 200, "{label}");
        tls.shutdown().await.expect("TLS shutdown");
        let (read, end) = read_to_end(&mut tls, WAIT).await;
        assert!(read.is_empty(), "{label}: {:?}", lossy(&read));
        ends.push((label, end));
    }
    assert_eq!(
        ends,
        [
            ("hyper's path", End::Clean),
            ("the simple path", End::Clean)
        ],
        "how each connection ended (UnexpectedEof: no close_notify)"
    );
}

/// A head whose start was read ahead while the previous request was in flight, then trickled a
/// byte at a time, is cut off at `header_read_timeout` (counted from the previous response).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_head_read_ahead_is_cut_off_at_the_header_read_timeout() {
    let s = setup(
        "header_read_timeout = \"500ms\"\nidle_timeout = \"30s\"",
        OPEN,
    )
    .await;
    let tls = s.slow_request_in_flight(300).await;
    let (mut reader, mut writer) = tokio::io::split(tls);
    writer
        .write_all(b"GET /b HTTP/1.1\r\nHost: a\r\nX-Pad: ")
        .await
        .expect("write");
    writer.flush().await.expect("flush");
    let started = Instant::now();
    let reading = tokio::spawn(async move {
        let (read, end) = read_to_end(&mut reader, WAIT).await;
        (read, end, started.elapsed())
    });
    while !reading.is_finished() && started.elapsed() < WAIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let sent = async {
            writer.write_all(b"p").await?;
            writer.flush().await
        };
        if sent.await.is_err() {
            break;
        }
    }
    let (read, end, after) = tokio::time::timeout(WAIT, reading)
        .await
        .expect("the reader ended")
        .expect("reader task");
    let answers = responses_in(&read, false);
    assert_eq!(
        answers.iter().map(|r| r.text()).collect::<Vec<_>>(),
        ["slow ok"]
    );
    assert_ne!(end, End::Open, "still open after {after:?}");
    assert!(
        after < Duration::from_millis(2500),
        "a head trickled over TLS was cut off only after {after:?}"
    );
    assert_eq!(s.uris(), ["/slow/300"]);
}

// ---------------------------------------------------------------------------------------------
// 5. Rate limits.

/// `/slow` allows two requests a day per address; `/five` five. A day, not a minute: a fixed
/// window that ends during a test admits its next request afresh.
const LIMITED: &str = r#"
[[routes]]
name = "slow"
path_prefix = "/slow"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1d"

[[routes]]
name = "five"
path_prefix = "/five"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 5
  window = "1d"

[[routes]]
name = "open"
upstream = "app"
"#;

/// The limit counts requests on both paths of one TLS connection, with the later requests read
/// ahead while the first was in flight: two allowed, and the third, a POST that hyper reads
/// after the hand-over, refused (its body unread, the connection closes).
#[tokio::test]
async fn a_limit_holds_over_tls_across_read_ahead_and_the_hand_over() {
    let s = setup("", LIMITED).await;
    let mut tls = s.slow_request_in_flight(300).await;
    let rest: &[u8] = b"GET /slow/0 HTTP/1.1\r\nHost: a\r\n\r\n\
        POST /slow/1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi\
        GET /slow/0 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let (read, end) = transcript(&mut tls, &[rest], Duration::ZERO).await;
    assert_eq!(statuses(&responses_in(&read, false)), [200, 200, 429]);
    assert_ne!(end, End::Open);
    assert_eq!(s.uris(), ["/slow/300", "/slow/0"]);
}

/// Six TLS connections at once, each pipelining simple requests around a POST (so across the
/// hand-over), against a limit of five: exactly five requests are allowed and reach the
/// upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_five_allows_five_over_concurrent_tls_connections() {
    let s = setup("", LIMITED).await;
    let config = client_config(&s.pki, &[], false);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..6 {
        let (config, addr) = (config.clone(), s.tls_addr);
        tasks.spawn(async move {
            let mut tls = handshake(config, connect(addr).await).await;
            let pipeline = format!(
                "GET /five/{i}a HTTP/1.1\r\nHost: a\r\n\r\n\
                 GET /five/{i}b HTTP/1.1\r\nHost: a\r\n\r\n\
                 POST /five/{i}c HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi\
                 GET /five/{i}d HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
            );
            let (read, _) = transcript(&mut tls, &[pipeline.as_bytes()], Duration::ZERO).await;
            statuses(&responses_in(&read, false))
        });
    }
    let mut allowed = 0;
    let mut all = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let got = done.expect("a client task");
        allowed += got.iter().filter(|s| **s == 200).count();
        all.push(got);
    }
    assert_eq!(allowed, 5, "statuses per connection: {all:?}");
    assert_eq!(s.upstream.count(), 5, "upstream saw {:?}", s.uris());
}

// ---------------------------------------------------------------------------------------------
// 6. More of the hand-over.

/// Heads read ahead in part while a slow request is in flight (the read ahead takes 4 KiB): one
/// of 10 kB that the simple path then reads whole and serves, one of 20 kB past the simple
/// path's 16 KiB (handed to hyper), and a closing GET after them. Every field reaches the
/// upstream whole, and the answers come in order.
#[tokio::test]
async fn large_heads_read_ahead_in_part_reach_the_upstream_whole() {
    let s = setup("", OPEN).await;
    let mut tls = s.slow_request_in_flight(200).await;
    let rest = format!(
        "GET /pad1 HTTP/1.1\r\nHost: a\r\nX-Pad: {}\r\n\r\n\
         GET /pad2 HTTP/1.1\r\nHost: a\r\nX-Pad: {}\r\n\r\n\
         GET /end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        "p".repeat(10_000),
        "q".repeat(20_000)
    );
    let (read, end) = transcript(&mut tls, &[rest.as_bytes()], Duration::ZERO).await;
    let answers = responses_in(&read, false);
    assert_eq!(statuses(&answers), [200, 200, 200, 200]);
    assert_eq!(end, End::Clean);
    let seen = s.upstream.requests();
    let got: Vec<(String, usize)> = seen
        .iter()
        .map(|r| {
            let pad = r.headers.get("x-pad").map_or(0, |v| v.len());
            (r.uri.clone(), pad)
        })
        .collect();
    assert_eq!(
        got,
        [
            ("/slow/200".to_string(), 0),
            ("/pad1".to_string(), 10_000),
            ("/pad2".to_string(), 20_000),
            ("/end".to_string(), 0),
        ]
    );
}

/// A WebSocket upgrade on a TLS connection that a simple request began: handed to hyper, checked,
/// switched, and the session echoes.
#[tokio::test]
async fn a_websocket_after_a_simple_request_on_one_tls_connection_echoes() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let s = setup("", OPEN).await;
    let mut tls = s.tls().await;
    tls.write_all(b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    tls.flush().await.expect("flush");
    assert_eq!(read_one(&mut tls).await.text(), "upstream ok");
    let request = "ws://localhost/ws"
        .into_client_request()
        .expect("a WebSocket request");
    let (mut ws, response) =
        tokio::time::timeout(WAIT, tokio_tungstenite::client_async(request, tls))
            .await
            .expect("a WebSocket handshake within 5 s")
            .expect("a WebSocket handshake through tollgate");
    assert_eq!(response.status(), http::StatusCode::SWITCHING_PROTOCOLS);
    for text in ["first", "second"] {
        ws.send(Message::text(text)).await.expect("send");
        let echoed = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("an echo within 5 s")
            .expect("a message")
            .expect("not an error");
        assert_eq!(echoed.into_text().expect("text"), text);
    }
    assert_eq!(s.uris(), ["/first", "/ws"]);
}

/// A drain that begins while a 6 MB response waits for a slow TLS reader: the response is
/// finished whole (its head went out before the drain) and the connection then ends with
/// `close_notify`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_during_a_large_tls_response_finishes_it_and_closes_cleanly() {
    let mut s = setup("", OPEN).await;
    let size = 6_000_000;
    let mut tls = s.large_response_waiting(size).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let server = s.proxy.server.take().expect("running");
    let stopping = tokio::spawn(server.shutdown());
    let (read, end) = read_to_end(&mut tls, Duration::from_secs(15)).await;
    assert_eq!(end, End::Clean, "after {} bytes", read.len());
    let answers = responses_in(&read, false);
    assert_eq!(statuses(&answers), [200]);
    assert!(
        is_big_body(&answers[0].body, size),
        "the large body differs from the upstream's"
    );
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("stopped within 5 s")
        .expect("stop task");
}

/// Upstream answers the recording upstream cannot give, written as raw bytes: a known length
/// past the simple path's copy limit, a length-framed body and a chunked one written in pieces
/// with pauses, and a body delimited by the upstream's close.
fn raw_shapes(_method: &str, target: &str) -> wire::Reply {
    match target {
        "/len" => {
            let n = 300_000;
            let mut bytes = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n").into_bytes();
            bytes.extend((0..n).map(pattern_byte));
            wire::Reply::new(bytes)
        }
        "/pieces" => {
            let body = "x".repeat(100);
            let mut reply = wire::Reply::ok(&body);
            reply.piece = 7;
            reply.gap = Duration::from_millis(2);
            reply
        }
        "/chunks" => {
            let mut bytes = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            for i in 0..40 {
                bytes.extend_from_slice(
                    format!("3e8\r\n{}\r\n", "c".repeat(999) + &(i % 10).to_string()).as_bytes(),
                );
            }
            bytes.extend_from_slice(b"0\r\n\r\n");
            let mut reply = wire::Reply::new(bytes);
            reply.piece = 4096;
            reply.gap = Duration::from_millis(1);
            reply
        }
        "/eof" => wire::Reply::new("HTTP/1.1 200 OK\r\n\r\nuntil the close").closing(),
        _ => wire::Reply::ok(target),
    }
}

/// Those answers reach a client over TLS (a slow one, with a 4 KiB window) as they reach one on
/// plain TCP, each followed by a closing request on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_upstream_answers_reach_a_slow_tls_client_as_a_plain_one() {
    let raw = wire::RawUpstream::answering(raw_shapes).await;
    let s = setup_for(Some(raw.addr), "", OPEN).await;
    let end = "GET /end HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let mut failures = Vec::new();
    for target in ["/len", "/pieces", "/chunks", "/eof"] {
        let bytes = format!("GET {target} HTTP/1.1\r\nHost: a\r\n\r\n{end}");
        let mut plain = connect(s.plain_addr).await;
        let (read, plain_end) = transcript(&mut plain, &[bytes.as_bytes()], Duration::ZERO).await;
        let expected: Vec<String> = responses_in(&read, false).iter().map(summary).collect();
        let mut tls = s.tls_small_window().await;
        let (read, tls_end) = transcript(&mut tls, &[bytes.as_bytes()], Duration::ZERO).await;
        let got: Vec<String> = responses_in(&read, false).iter().map(summary).collect();
        if got != expected || tls_end != End::Clean || plain_end != End::Clean {
            failures.push(format!(
                "{target} over TLS: {got:#?} ending {tls_end:?}\n\
                 plain TCP: {expected:#?} ending {plain_end:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A drain that begins while a large response waits for a slow TLS reader, with a POST read
/// ahead meanwhile: the response is finished whole, then the POST, read whole before the close,
/// is handed to hyper and answered with `connection: close` (as tests/it/simple_h1_attacks.rs
/// has a request read whole during the drain answered, whatever its kind), and the connection
/// ends cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_read_ahead_during_a_large_response_is_answered_when_the_drain_begins() {
    let mut s = setup("", OPEN).await;
    let size = 6_000_000;
    let mut tls = s.large_response_waiting(size).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    tls.write_all(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
        .await
        .expect("write");
    tls.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let server = s.proxy.server.take().expect("running");
    let stopping = tokio::spawn(server.shutdown());
    let (read, end) = read_to_end(&mut tls, Duration::from_secs(15)).await;
    let answers = responses_in(&read, false);
    assert_eq!(statuses(&answers), [200, 200], "ending {end:?}");
    assert_eq!(answers[0].body.len(), size);
    assert_eq!(answers[1].text(), "hi");
    assert_eq!(answers[1].header("connection"), Some("close"));
    assert_eq!(end, End::Clean);
    assert_eq!(s.uris(), [format!("/big/{size}"), "/echo".into()]);
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("stopped within 5 s")
        .expect("stop task");
}
