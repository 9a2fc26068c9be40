//! TLS termination and HTTP/2 end to end (contract §2): verified HTTPS limited like plain
//! HTTP, ALPN h2, SNI, no TLS 1.1, stalled handshakes, https upstreams with a private CA, h2c
//! upstreams and a gRPC-style exchange with trailers.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::common::tls::TestPki;
use crate::common::*;
use tollgate::testing::config::CertConfig;

type HttpsClient =
    hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A client that trusts the test CA and offers h2 and http/1.1.
fn https_client(pki: &TestPki) -> HttpsClient {
    let tls =
        tollgate::testing::tls::client_config(Some(&pki.ca_file), false).expect("client config");
    let mut tls = (*tls).clone();
    tls.alpn_protocols.clear();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_all_versions()
        .build();
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector)
}

/// A GET through `client`.
async fn https_get(
    client: &HttpsClient,
    url: &str,
) -> Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error> {
    let request = Request::get(url)
        .body(Full::new(Bytes::new()))
        .expect("request");
    client.request(request).await
}

fn cert_toml(certs: &[&CertConfig]) -> String {
    certs
        .iter()
        .map(|c| {
            format!(
                "[[server.certs]]\ncert = \"{}\"\nkey = \"{}\"\n",
                c.cert.display(),
                c.key.display()
            )
        })
        .collect()
}

struct Setup {
    pki: TestPki,
    upstream: Upstream,
    proxy: Proxy,
    tls_addr: std::net::SocketAddr,
    default_cert: CertConfig,
    other_cert: CertConfig,
    /// The text it started with (`@UPSTREAM@` unfilled).
    text: String,
}

async fn setup() -> Setup {
    setup_with("700ms").await
}

/// [`setup`] with another `server.header_read_timeout`.
async fn setup_with(header_read_timeout: &str) -> Setup {
    let pki = TestPki::new();
    let default_cert = pki.issue("default", &["localhost", "127.0.0.1"]);
    let other_cert = pki.issue("other", &["b.test", "*.wild.test"]);
    let upstream = Upstream::start().await;
    let text = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
tls_listen = ["127.0.0.1:0"]
header_read_timeout = "{header_read_timeout}"

{certs}

[upstreams.app]
url = "http://@UPSTREAM@"

[upstreams.h2c]
url = "http://@UPSTREAM@"
http2 = true

[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "366d"

[[routes]]
name = "charged"
path_prefix = "/cost"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 10
  window = "366d"
  cost_header = "x-ratelimit-cost"

[[routes]]
name = "rest"
upstream = "app"
"#,
        certs = cert_toml(&[&default_cert, &other_cert])
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let tls_addr = proxy.server().tls_addrs[0];
    Setup {
        pki,
        upstream,
        proxy,
        tls_addr,
        default_cert,
        other_cert,
        text,
    }
}

#[tokio::test]
async fn https_is_verified_and_limited_like_plain_http() {
    let s = setup().await;
    let client = https_client(&s.pki);
    let url = format!("https://localhost:{}/api/x", s.tls_addr.port());
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let response = https_get(&client, &url)
            .await
            .expect("https request verifies against the test CA");
        statuses.push(response.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let seen = s.upstream.last();
    assert_eq!(seen.headers.get("x-forwarded-proto").unwrap(), "https");
    // The same client over plain HTTP shares the bucket: limits are identical on both.
    let plain = get(&h1_client(), &s.proxy.url("/api/x")).await;
    assert_eq!(plain.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(s.upstream.count(), 2);
}

/// Contract §3d over TLS: the upstream's reported cost is charged and its field removed.
#[tokio::test]
async fn https_requests_are_charged_what_the_upstream_reports() {
    let s = setup().await;
    let client = https_client(&s.pki);
    let left = |response: &http::Response<hyper::body::Incoming>| {
        let field = response.headers().get("ratelimit").expect("RateLimit");
        crate::common::ratelimit::members(field.to_str().expect("text"))[0].param("r")
    };
    let url = |path: &str| format!("https://localhost:{}{path}", s.tls_addr.port());
    let first = https_get(&client, &url("/cost/4")).await.expect("https");
    assert_eq!(first.status(), StatusCode::OK);
    assert!(
        first.headers().get("x-ratelimit-cost").is_none(),
        "the field went on"
    );
    assert_eq!(left(&first), 10);
    let second = https_get(&client, &url("/cost/-")).await.expect("https");
    assert_eq!(left(&second), 6, "4 charged");
}

#[tokio::test]
async fn alpn_negotiates_h2() {
    let s = setup().await;
    let client = https_client(&s.pki);
    let url = format!("https://localhost:{}/anything", s.tls_addr.port());
    let response = https_get(&client, &url).await.expect("h2 request");
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(s.upstream.last().version, Version::HTTP_11);
}

/// Connects with `server_name` as SNI and returns the leaf certificate the server presented.
async fn presented_leaf(s: &Setup, server_name: &str) -> Vec<u8> {
    let tls =
        tollgate::testing::tls::client_config(Some(&s.pki.ca_file), false).expect("client config");
    let connector = tokio_rustls::TlsConnector::from(tls);
    let stream = TcpStream::connect(s.tls_addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from(server_name.to_string()).expect("name");
    // The client verifies the name; for an unknown name we only want to see the default
    // certificate, so a verification failure there is expected and the DER is read from it.
    match connector.connect(name, stream).await {
        Ok(tls) => {
            let (_, session) = tls.get_ref();
            session.peer_certificates().expect("peer certs")[0]
                .as_ref()
                .to_vec()
        }
        Err(err) => panic!("handshake for {server_name} failed: {err}"),
    }
}

#[tokio::test]
async fn sni_picks_the_certificate_for_each_name() {
    let s = setup().await;
    assert_eq!(
        presented_leaf(&s, "b.test").await,
        TestPki::leaf_der(&s.other_cert)
    );
    assert_eq!(
        presented_leaf(&s, "x.wild.test").await,
        TestPki::leaf_der(&s.other_cert)
    );
    assert_eq!(
        presented_leaf(&s, "localhost").await,
        TestPki::leaf_der(&s.default_cert)
    );
}

/// `openssl s_client` with one protocol version forced; the configuration it loads is
/// ignored so that a distribution's minimum-version policy does not decide for the server.
fn openssl_handshake(addr: String, version: &'static str) -> std::process::Output {
    Command::new("openssl")
        .args(["s_client", "-connect", &addr, version])
        .args(["-cipher", "DEFAULT@SECLEVEL=0", "-servername", "localhost"])
        .env("OPENSSL_CONF", "/dev/null")
        .stdin(Stdio::null())
        .output()
        .expect("openssl is needed for this test (apt-get install openssl)")
}

#[tokio::test]
async fn a_tls_1_1_client_is_refused() {
    let s = setup().await;
    let addr = s.tls_addr.to_string();
    let modern = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || openssl_handshake(addr, "-tls1_2")
    })
    .await
    .expect("task");
    assert!(
        modern.status.success(),
        "TLS 1.2 should work: {}",
        String::from_utf8_lossy(&modern.stderr)
    );
    let old = tokio::task::spawn_blocking(move || openssl_handshake(addr, "-tls1_1"))
        .await
        .expect("task");
    let stdout = String::from_utf8_lossy(&old.stdout);
    assert!(!old.status.success(), "TLS 1.1 was accepted: {stdout}");
    // openssl prints the protocol it tried; what matters is that no cipher was agreed.
    assert!(stdout.contains("Cipher is (NONE)"), "{stdout}");
}

#[tokio::test]
async fn a_stalled_handshake_times_out_while_others_are_served() {
    let s = setup().await;
    let mut stalled = TcpStream::connect(s.tls_addr).await.expect("connect");
    // The first bytes of a ClientHello record, then nothing.
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .expect("partial hello");
    let started = Instant::now();
    let client = https_client(&s.pki);
    let url = format!("https://localhost:{}/meanwhile", s.tls_addr.port());
    let response = https_get(&client, &url)
        .await
        .expect("served while another handshake stalls");
    assert_eq!(response.status(), StatusCode::OK);
    let waited = closed_after(&mut stalled, started, "stalled handshake was never closed").await;
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
}

#[tokio::test]
async fn https_upstream_with_a_private_ca() {
    let pki = TestPki::new();
    let upstream_cert = pki.issue("upstream", &["127.0.0.1"]);
    let server_config =
        tollgate::testing::tls::server_config(&[upstream_cert]).expect("upstream tls");
    let upstream = Upstream::start_tls(server_config).await;
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n\
         [upstreams.secure]\nurl = \"https://@UPSTREAM@\"\nca_file = \"{}\"\n\n\
         [upstreams.untrusted]\nurl = \"https://@UPSTREAM@\"\n\n\
         [[routes]]\nname = \"bad\"\npath_prefix = \"/bad\"\nupstream = \"untrusted\"\n\n\
         [[routes]]\nname = \"good\"\nupstream = \"secure\"\n",
        pki.ca_file.display()
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let client = h1_client();
    let answer = get(&client, &proxy.url("/echo-me")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "upstream ok");
    assert_eq!(upstream.last().uri, "/echo-me");
    // Without the private CA the upstream's certificate is not trusted: 502, nothing sent.
    let before = upstream.count();
    let answer = get(&client, &proxy.url("/bad")).await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert_eq!(upstream.count(), before);
}

#[tokio::test]
async fn h2c_upstream_and_grpc_style_trailers() {
    let upstream = Upstream::start_with(true).await;
    let text = "[server]\nlisten = [\"127.0.0.1:0\"]\n\n\
         [upstreams.grpc]\nurl = \"http://@UPSTREAM@\"\nhttp2 = true\n\n\
         [[routes]]\nname = \"grpc\"\nupstream = \"grpc\"\n";
    let proxy = Proxy::start(config_from(text, upstream.addr, &[])).await;

    // HTTP/1.1 client, HTTP/2 upstream.
    let answer = get(&h1_client(), &proxy.url("/plain")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(upstream.last().version, Version::HTTP_2);

    // gRPC shape: h2 end to end, POST with te: trailers, a streamed request body, response
    // trailers.
    let (sender, body) = {
        type Chunk = Result<hyper::body::Frame<Bytes>, std::convert::Infallible>;
        let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(4);
        (
            tx,
            http_body_util::StreamBody::new(Box::pin(tokio_stream_from(rx))),
        )
    };
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let request = Request::post(proxy.url("/trailers"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .expect("request");
    let feeding = tokio::spawn(async move {
        for chunk in [&b"\x00\x00\x00\x00\x02hi"[..], &b"more"[..]] {
            sender
                .send(Ok(hyper::body::Frame::data(Bytes::copy_from_slice(chunk))))
                .await
                .expect("send chunk");
        }
    });
    let response = client.request(request).await.expect("grpc-style request");
    assert_eq!(response.version(), Version::HTTP_2);
    let collected = response.into_body().collect().await.expect("body");
    let trailers = collected.trailers().cloned().expect("response trailers");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    feeding.await.expect("feeder");
    let seen = upstream.last();
    assert_eq!(seen.version, Version::HTTP_2);
    assert_eq!(seen.headers.get("te").unwrap(), "trailers");
    assert_eq!(&seen.body[..], b"\x00\x00\x00\x00\x02himore");
}

/// An mpsc receiver as a stream of frames.
fn tokio_stream_from<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
}

#[tokio::test]
async fn reload_swaps_certificates_and_a_bad_one_changes_nothing() {
    let s = setup().await;
    let new_cert = s.pki.issue("renewed", &["b.test"]);
    let text_with = |certs: &[&CertConfig]| {
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\ntls_listen = [\"127.0.0.1:0\"]\n{}\n\
             [upstreams.app]\nurl = \"http://@UPSTREAM@\"\n[[routes]]\nname = \"rest\"\nupstream = \"app\"\n",
            cert_toml(certs)
        )
    };
    let renewed = config_from(
        &text_with(&[&s.default_cert, &new_cert]),
        s.upstream.addr,
        &[],
    );
    assert!(s.proxy.server().reload(renewed).await);
    assert_eq!(
        presented_leaf(&s, "b.test").await,
        TestPki::leaf_der(&new_cert)
    );

    // A key that does not match its certificate: the reload fails, the old certificate stays.
    let mismatched = CertConfig {
        cert: s.other_cert.cert.clone(),
        key: s.default_cert.key.clone(),
    };
    let broken = config_from(
        &text_with(&[&s.default_cert, &mismatched]),
        s.upstream.addr,
        &[],
    );
    assert!(!s.proxy.server().reload(broken).await);
    assert_eq!(
        presented_leaf(&s, "b.test").await,
        TestPki::leaf_der(&new_cert)
    );
}

/// A certificate renewed under the same path is a change, though the file is the same: the
/// reload counts `success` and serves the new certificate; the same again is `unchanged`.
#[tokio::test]
async fn a_certificate_renewed_in_place_is_a_change() {
    let s = setup().await;
    let reloads = |result: &str| {
        let series = format!("tollgate_config_reloads_total{{result=\"{result}\"}}");
        let text = s.proxy.server().metrics().render();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(&series)?
                    .strip_prefix(' ')?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no {series}"))
    };
    let config = || config_from(&s.text, s.upstream.addr, &[]);
    assert!(s.proxy.server().reload(config()).await);
    assert_eq!((reloads("success"), reloads("unchanged")), (0.0, 1.0));
    // The same paths, a new certificate and key.
    let renewed = s.pki.issue("renewed", &["b.test", "*.wild.test"]);
    std::fs::copy(&renewed.cert, &s.other_cert.cert).expect("renew the certificate");
    std::fs::copy(&renewed.key, &s.other_cert.key).expect("renew the key");
    assert!(s.proxy.server().reload(config()).await);
    assert_eq!((reloads("success"), reloads("unchanged")), (1.0, 1.0));
    assert_eq!(
        presented_leaf(&s, "b.test").await,
        TestPki::leaf_der(&renewed)
    );
    assert!(s.proxy.server().reload(config()).await);
    assert_eq!((reloads("success"), reloads("unchanged")), (1.0, 2.0));
}

#[test]
fn check_refuses_a_key_that_does_not_match_its_certificate() {
    let pki = TestPki::new();
    let a = pki.issue("a", &["a.test"]);
    let b = pki.issue("b", &["b.test"]);
    let path = pki.dir.join("mismatch.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\ntls_listen = [\"127.0.0.1:0\"]\n[[server.certs]]\ncert = \"{}\"\nkey = \"{}\"\n\
             [upstreams.a]\nurl = \"http://127.0.0.1:9\"\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n",
            a.cert.display(),
            b.key.display()
        ),
    )
    .expect("write config");
    let out = tollgate_check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(&format!("{}: server.certs[0]:", path.display())),
        "{stderr}"
    );
}

/// Over TLS too, a client that goes away while its request waits for the upstream cancels the
/// upstream request (tests/it/bounds.rs has the same over plain TCP, where tollgate notices the
/// close itself; over TLS, hyper's read does).
#[tokio::test]
async fn a_tls_client_that_goes_away_mid_request_cancels_its_upstream_request() {
    let s = setup().await;
    let tls =
        tollgate::testing::tls::client_config(Some(&s.pki.ca_file), false).expect("client config");
    let connector = tokio_rustls::TlsConnector::from(tls);
    let stream = TcpStream::connect(s.tls_addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from("localhost".to_string()).expect("name");
    let mut client = connector.connect(name, stream).await.expect("handshake");
    client
        .write_all(b"GET /slow/20000 HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("request");
    client.flush().await.expect("flush");
    wait::until(
        "the request never reached the upstream",
        Duration::from_secs(5),
        || s.upstream.count() == 1 && s.upstream.open_connections() == 1,
    )
    .await;
    drop(client);
    wait::until(
        "the upstream request was kept after its TLS client had gone",
        Duration::from_secs(5),
        || s.upstream.open_connections() == 0,
    )
    .await;
}

/// A raw HTTP/1.1 client over TLS (no ALPN offered, as curl --http1.1 or most HTTP/1.1 clients).
async fn raw_tls_client(s: &Setup) -> tokio_rustls::client::TlsStream<TcpStream> {
    let stream = TcpStream::connect(s.tls_addr).await.expect("connect");
    raw_tls_over(s, stream).await
}

async fn raw_tls_over(s: &Setup, stream: TcpStream) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tls =
        tollgate::testing::tls::client_config(Some(&s.pki.ca_file), false).expect("client config");
    let mut tls = (*tls).clone();
    tls.alpn_protocols.clear();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls));
    let name = rustls::pki_types::ServerName::try_from("localhost".to_string()).expect("name");
    connector.connect(name, stream).await.expect("handshake")
}

/// Everything the server sends on `client` until it closes the connection, parsed into
/// responses. The close must be a clean one, with `close_notify`: without it the client cannot
/// tell the server's close from a cut.
async fn responses_until_closed(
    client: &mut tokio_rustls::client::TlsStream<TcpStream>,
) -> Vec<wire::Resp> {
    let (bytes, end) = wire::read_to_end(client, wire::WAIT).await;
    assert_eq!(
        end,
        wire::End::Clean,
        "how the connection ended, after {:?}",
        wire::lossy(&bytes)
    );
    wire::responses_in(&bytes, false)
}

/// HTTP/1.1 over TLS starts on tollgate's own path, as over plain TCP. What shows it: a clean
/// request and garbage in one read. hyper's path (behind the framing guard) refuses the whole
/// read with a 400; the simple path answers the request first, and the connection then ends at
/// the garbage without a second response.
#[tokio::test]
async fn simple_requests_over_tls_take_tollgates_own_path() {
    let s = setup().await;
    let mut client = raw_tls_client(&s).await;
    client
        .write_all(b"GET /rest/one HTTP/1.1\r\nHost: localhost\r\n\r\n\x01\x02 garbage\r\n\r\n")
        .await
        .expect("request");
    client.flush().await.expect("flush");
    let responses = responses_until_closed(&mut client).await;
    let statuses: Vec<u16> = responses.iter().map(|r| r.status).collect();
    assert_eq!(statuses, vec![200], "the responses: {responses:?}");
    assert_eq!(s.upstream.count(), 1);
    assert_eq!(s.upstream.last().uri, "/rest/one");
}

/// Pipelined requests over TLS, across the hand-over to hyper at the first one with a body: each
/// answered once, in order, and each reaches the upstream whole.
#[tokio::test]
async fn pipelined_requests_over_tls_are_answered_in_order_across_the_hand_over() {
    let s = setup().await;
    let mut client = raw_tls_client(&s).await;
    client
        .write_all(
            b"GET /rest/a HTTP/1.1\r\nHost: localhost\r\n\r\n\
              GET /rest/b HTTP/1.1\r\nHost: localhost\r\n\r\n\
              POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello\
              GET /rest/c HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        )
        .await
        .expect("requests");
    client.flush().await.expect("flush");
    let responses = responses_until_closed(&mut client).await;
    let statuses: Vec<u16> = responses.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses,
        vec![200, 200, 200, 200],
        "the responses: {responses:?}"
    );
    assert_eq!(responses[2].text(), "hello");
    assert_eq!(responses[3].header("connection"), Some("close"));
    let seen: Vec<(String, Bytes)> = s
        .upstream
        .requests()
        .into_iter()
        .map(|r| (r.uri, r.body))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("/rest/a".to_string(), Bytes::new()),
            ("/rest/b".to_string(), Bytes::new()),
            ("/echo".to_string(), Bytes::from_static(b"hello")),
            ("/rest/c".to_string(), Bytes::new()),
        ]
    );
}

/// A response far larger than the socket's buffers arrives whole over TLS on the simple path,
/// with the connection kept open: what TLS holds back after a write (the socket was full) is
/// flushed, not left in its buffer until the next write or the close. The `header_read_timeout`
/// (which starts when tollgate has written the response) is longer than the test's wait, so a
/// close, which would also push such bytes out, cannot hide their absence; a second request on
/// the connection then shows it was kept. (Whether TLS holds bytes back at the last write
/// depends on the socket's room at that moment, which the kernel decides: with the flush taken
/// out this test still passed in the runs tried, so it guards the flush only by chance.)
#[tokio::test]
async fn a_large_response_over_tls_arrives_whole_on_a_kept_connection() {
    use tokio::io::AsyncReadExt;
    let s = setup_with("120s").await;
    // A small receive buffer, read slowly: tollgate's writes keep finding the socket full, the
    // last one included.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let stream = socket.connect(s.tls_addr).await.expect("connect");
    let mut client = raw_tls_over(&s, stream).await;
    // More than the kernel's largest send buffer (tcp_wmem's 4 MiB) can hold.
    let size = 6 * 1024 * 1024 + 17;
    let request = format!("GET /big/{size} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    client.write_all(request.as_bytes()).await.expect("request");
    client.flush().await.expect("flush");
    // The upstream's body has no length, so tollgate sends it chunked: the response is whole
    // once its last chunk has come (parsing 6 MiB at every read would be slow).
    let mut bytes = Vec::new();
    let mut piece = vec![0u8; 16 * 1024];
    // Not read at first, so that tollgate's writes fill the socket and wait; then read in sips,
    // so that the socket is still full when TLS takes the response's last bytes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Making and encrypting 6 MiB takes a debug build seconds, more on a loaded machine.
    let within = Duration::from_secs(30);
    let whole = tokio::time::timeout(within, async {
        while !(bytes.len() > size && bytes.ends_with(b"\r\n0\r\n\r\n")) {
            tokio::time::sleep(Duration::from_millis(2)).await;
            match client.read(&mut piece).await {
                Ok(0) | Err(_) => panic!("the connection ended after {} bytes", bytes.len()),
                Ok(n) => bytes.extend_from_slice(&piece[..n]),
            }
        }
    })
    .await;
    assert!(
        whole.is_ok(),
        "the response was not whole within {within:?}: {} bytes came",
        bytes.len()
    );
    let (response, used) = wire::parse_response(&bytes, false, false).expect("a whole response");
    assert_eq!(used, bytes.len(), "bytes after the response");
    assert_eq!(response.status, 200);
    assert!(response.chunked);
    assert_eq!(response.body.len(), size);
    assert!(
        response
            .body
            .iter()
            .enumerate()
            .all(|(i, b)| *b == pattern_byte(i)),
        "the body's bytes differ from what the upstream sent"
    );
    client
        .write_all(b"GET /rest/after HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("second request");
    client.flush().await.expect("flush");
    let after = wire::read_one(&mut client).await;
    assert_eq!(after.status, 200, "{}", after.head);
}

/// A graceful stop closes an idle keep-alive TLS connection as TLS should close: with
/// `close_notify`, which the client reads as a clean end, not as a cut connection (hyper's path
/// shuts its stream down the same way).
#[tokio::test]
async fn a_drain_closes_an_idle_tls_connection_with_close_notify() {
    let mut s = setup().await;
    let mut client = raw_tls_client(&s).await;
    client
        .write_all(b"GET /rest/before HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("request");
    assert_eq!(wire::read_one(&mut client).await.status, 200);
    let stopping = tokio::spawn(async move { s.proxy.shutdown().await });
    let (after, end) = wire::read_to_end(&mut client, Duration::from_secs(2)).await;
    assert!(after.is_empty(), "{:?}", wire::lossy(&after));
    assert_eq!(
        end,
        wire::End::Clean,
        "how the idle connection ended at the drain"
    );
    tokio::time::timeout(wire::WAIT, stopping)
        .await
        .expect("shutdown within 5 s")
        .expect("shutdown task");
}

/// A first request that the framing guard refuses over TLS (here `Content-Length` beside
/// `Transfer-Encoding`) gets the guard's 400 whole, and the connection then ends as TLS ends a
/// connection, with `close_notify`, not cut. Nothing reaches the upstream.
#[tokio::test]
async fn a_refused_first_request_over_tls_gets_its_400_then_close_notify() {
    let s = setup().await;
    let mut client = raw_tls_client(&s).await;
    client
        .write_all(
            b"POST /rest/x HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\n\
              Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        )
        .await
        .expect("request");
    client.flush().await.expect("flush");
    let (bytes, end) = wire::read_to_end(&mut client, wire::WAIT).await;
    let (response, used) = wire::parse_response(&bytes, false, true).expect("a whole response");
    assert_eq!(response.status, 400);
    assert_eq!(
        used,
        bytes.len(),
        "bytes after the 400: {:?}",
        wire::lossy(&bytes)
    );
    assert_eq!(end, wire::End::Clean, "how the connection ended");
    assert_eq!(s.upstream.count(), 0);
}
