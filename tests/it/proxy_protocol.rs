//! The PROXY protocol (contract §4) end to end: raw v1 and v2 headers, IPv4 and IPv6, over plain
//! TCP and before a TLS ClientHello; v2 `LOCAL`; peers outside `server.proxy_protocol.from`
//! never believed; listed peers without a valid header refused; buckets, `X-Forwarded-For`
//! and trusted-proxy checks following the header's address; and a real HAProxy with
//! `send-proxy-v2` in front.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::common::haproxy::{self, connect_from, HaProxy};
use crate::common::tls::TestPki;
use crate::common::*;

/// The balancer in these tests: tollgate's listed peer.
const BALANCER: [u8; 4] = [127, 0, 0, 1];
/// A loopback address outside `from`.
const STRANGER: [u8; 4] = [127, 0, 0, 2];
const HEADER_READ_TIMEOUT: Duration = Duration::from_millis(800);

struct Setup {
    upstream: Upstream,
    proxy: Proxy,
    tls_addr: SocketAddr,
    pki: TestPki,
}

/// tollgate with a plain and a TLS listener, PROXY headers required from 127.0.0.1, the
/// addresses in 10.0.0.0/8 trusted proxies, and `/limited` allowing 2 requests per client
/// address an hour.
async fn setup() -> Setup {
    let upstream = Upstream::start().await;
    let pki = TestPki::new();
    let cert = pki.issue("server", &["localhost"]);
    let server_extra = format!(
        "tls_listen = [\"127.0.0.1:0\"]\n\
         trusted_proxies = [\"10.0.0.0/8\"]\n\
         header_read_timeout = \"{}ms\"\n\
         [[server.certs]]\ncert = \"{}\"\nkey = \"{}\"\n\
         [server.proxy_protocol]\nfrom = [\"127.0.0.1\"]\n",
        HEADER_READ_TIMEOUT.as_millis(),
        cert.cert.display(),
        cert.key.display(),
    );
    let routes = r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"
  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
"#;
    let text = limits_config("", &server_extra, routes);
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let tls_addr = proxy.server().tls_addrs[0];
    Setup {
        upstream,
        proxy,
        tls_addr,
        pki,
    }
}

fn sock(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

/// Writes `preamble` then one HTTP/1.1 request for `path` (with `extra` header lines) and
/// reads the answer until the server closes. Returns the status (0 when the server closed
/// without answering) and the raw answer.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    preamble: &[u8],
    path: &str,
    extra: &str,
) -> (u16, String) {
    let mut bytes = preamble.to_vec();
    bytes.extend_from_slice(
        format!("GET {path} HTTP/1.1\r\nHost: example.com\r\n{extra}Connection: close\r\n\r\n")
            .as_bytes(),
    );
    let _ = stream.write_all(&bytes).await;
    read_answer(stream).await
}

async fn read_answer<S: AsyncRead + Unpin>(stream: &mut S) -> (u16, String) {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    assert!(
        read.is_ok(),
        "the server neither answered nor closed within 5 s"
    );
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// One request on a new plain connection from `from`, opened with `preamble`.
async fn plain(s: &Setup, from: [u8; 4], preamble: &[u8], path: &str) -> (u16, String) {
    let mut stream = connect_from(IpAddr::from(from), s.proxy.addr).await;
    exchange(&mut stream, preamble, path, "").await
}

/// One HTTPS request from the balancer: `preamble` on the TCP connection, then the TLS
/// handshake, then the request.
async fn over_tls(s: &Setup, preamble: &[u8], path: &str) -> (u16, String) {
    let mut tcp = connect_from(IpAddr::from(BALANCER), s.tls_addr).await;
    tcp.write_all(preamble)
        .await
        .expect("write the PROXY header");
    let tls =
        tollgate::testing::tls::client_config(Some(&s.pki.ca_file), false).expect("client config");
    let connector = tokio_rustls::TlsConnector::from(Arc::clone(&tls));
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let mut stream = connector
        .connect(name, tcp)
        .await
        .expect("TLS handshake after the PROXY header");
    exchange(&mut stream, b"", path, "").await
}

/// What the upstream's last request carried in `name`.
fn last_header(s: &Setup, name: &str) -> String {
    let last = s.upstream.last();
    last.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("the upstream got no {name}"))
        .to_string()
}

#[tokio::test]
async fn v1_and_v2_headers_name_the_client_over_plain_tcp() {
    let s = setup().await;
    let to = sock("127.0.0.1:8080");
    for (header, client) in [
        (haproxy::v1(sock("192.0.2.7:40000"), to), "192.0.2.7"),
        (
            haproxy::v1(sock("[2001:db8::7]:40000"), sock("[2001:db8::1]:80")),
            "2001:db8::7",
        ),
        (haproxy::v2(sock("192.0.2.8:40000"), to, &[]), "192.0.2.8"),
        (
            haproxy::v2(sock("[2001:db8::8]:1"), sock("[2001:db8::1]:80"), &[]),
            "2001:db8::8",
        ),
        // With TLVs (an AWS NLB endpoint id, type 0xEA), which are skipped.
        (
            haproxy::v2(
                sock("192.0.2.9:40000"),
                to,
                &[0xEA, 0x00, 0x04, 0x01, b'v', b'p', b'c'],
            ),
            "192.0.2.9",
        ),
    ] {
        let (status, answer) = plain(&s, BALANCER, &header, "/open").await;
        assert_eq!(status, 200, "{client}: {answer}");
        assert_eq!(last_header(&s, "x-forwarded-for"), client);
        assert_eq!(last_header(&s, "x-real-ip"), client);
    }
}

#[tokio::test]
async fn http2_prior_knowledge_follows_the_header_byte_for_byte() {
    let s = setup().await;
    let mut tcp = connect_from(IpAddr::from(BALANCER), s.proxy.addr).await;
    let header = haproxy::v2(sock("[2001:db8::44]:7"), sock("[2001:db8::1]:80"), &[]);
    tcp.write_all(&header)
        .await
        .expect("write the PROXY header");
    let (mut sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2c handshake after the PROXY header");
    tokio::spawn(conn);
    let request = http::Request::get("http://example.com/open")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("request");
    let response = sender.send_request(request).await.expect("h2c request");
    assert_eq!(response.status(), 200);
    assert_eq!(last_header(&s, "x-forwarded-for"), "2001:db8::44");
}

#[tokio::test]
async fn headers_come_before_the_tls_client_hello() {
    let s = setup().await;
    let header = haproxy::v1(sock("192.0.2.20:5000"), sock("127.0.0.1:443"));
    let (status, answer) = over_tls(&s, &header, "/open").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(last_header(&s, "x-forwarded-for"), "192.0.2.20");
    assert_eq!(last_header(&s, "x-forwarded-proto"), "https");

    let header = haproxy::v2(sock("[2001:db8::21]:5000"), sock("[::1]:443"), &[]);
    let (status, answer) = over_tls(&s, &header, "/open").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(last_header(&s, "x-forwarded-for"), "2001:db8::21");

    // No header before the ClientHello from the balancer: closed, no handshake.
    let tcp = connect_from(IpAddr::from(BALANCER), s.tls_addr).await;
    let tls =
        tollgate::testing::tls::client_config(Some(&s.pki.ca_file), false).expect("client config");
    let connector = tokio_rustls::TlsConnector::from(tls);
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    assert!(
        connector.connect(name, tcp).await.is_err(),
        "a TLS handshake without a PROXY header from a listed peer succeeded"
    );
}

#[tokio::test]
async fn v2_local_and_v1_unknown_keep_the_tcp_peer() {
    let s = setup().await;
    for header in [haproxy::v2_local(), b"PROXY UNKNOWN\r\n".to_vec()] {
        let (status, answer) = plain(&s, BALANCER, &header, "/open").await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(last_header(&s, "x-forwarded-for"), "127.0.0.1");
    }
    let (status, answer) = over_tls(&s, &haproxy::v2_local(), "/open").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(last_header(&s, "x-forwarded-for"), "127.0.0.1");
}

#[tokio::test]
async fn a_peer_outside_from_is_never_believed() {
    let s = setup().await;
    // Without a header it is served as usual, keyed and forwarded as itself.
    let (status, answer) = plain(&s, STRANGER, b"", "/open").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(last_header(&s, "x-forwarded-for"), "127.0.0.2");
    let before = s.upstream.count();
    // A header from it is just bytes that are not HTTP.
    let to = sock("127.0.0.1:8080");
    for header in [
        haproxy::v1(sock("192.0.2.66:1"), to),
        haproxy::v2(sock("192.0.2.66:1"), to, &[]),
    ] {
        let (status, answer) = plain(&s, STRANGER, &header, "/open").await;
        assert_eq!(status, 400, "{answer}");
    }
    assert_eq!(
        s.upstream.count(),
        before,
        "a request behind a header got through"
    );
    // Its limit is its own address's, whatever it claims.
    for expected in [200, 200, 429] {
        let (status, answer) = plain(&s, STRANGER, b"", "/limited").await;
        assert_eq!(status, expected, "{answer}");
    }
}

#[tokio::test]
async fn a_listed_peer_without_a_valid_header_is_refused() {
    let s = setup().await;
    let before = s.upstream.count();
    for (what, preamble) in [
        ("no header", &b""[..]),
        ("garbled v1", b"PROXY TCP4 192.0.2.1 nonsense 1 2\r\n"),
        ("v1 too long", &[b'P'; 200][..]),
        ("not PROXY", b"HELLO\r\n"),
        ("bad v2 command", &haproxy::v2_raw(0x2F, 0x11, &[0; 12])[..]),
    ] {
        let (status, answer) = plain(&s, BALANCER, preamble, "/open").await;
        assert_eq!((status, answer.as_str()), (0, ""), "{what}");
    }
    assert_eq!(
        s.upstream.count(),
        before,
        "a refused connection was forwarded"
    );

    // A slow header is cut off at header_read_timeout, not before and not much after.
    let mut stream = connect_from(IpAddr::from(BALANCER), s.proxy.addr).await;
    let started = Instant::now();
    stream
        .write_all(b"PROXY TCP4 192.0.2.")
        .await
        .expect("write");
    let (status, answer) = read_answer(&mut stream).await;
    let waited = started.elapsed();
    assert_eq!((status, answer.as_str()), (0, ""));
    assert!(
        waited >= HEADER_READ_TIMEOUT - Duration::from_millis(50),
        "closed after {waited:?}, before header_read_timeout"
    );
    assert!(
        waited < HEADER_READ_TIMEOUT + Duration::from_secs(2),
        "closed only after {waited:?}"
    );

    // A header that stops half way and closes is refused at once.
    let mut stream = connect_from(IpAddr::from(BALANCER), s.proxy.addr).await;
    let started = Instant::now();
    stream
        .write_all(&haproxy::V2_SIGNATURE[..8])
        .await
        .expect("write");
    stream.shutdown().await.expect("half-close");
    let (status, _) = read_answer(&mut stream).await;
    assert_eq!(status, 0);
    assert!(
        started.elapsed() < HEADER_READ_TIMEOUT,
        "a half-closed header waited for the timeout"
    );
}

#[tokio::test]
async fn buckets_follow_the_header_address() {
    let s = setup().await;
    let to = sock("127.0.0.1:8080");
    let a = |port| haproxy::v1(SocketAddr::new([192, 0, 2, 30].into(), port), to);
    let b = |port| haproxy::v2(SocketAddr::new([192, 0, 2, 31].into(), port), to, &[]);
    // Same address (any port, either version) shares one bucket: the third is denied.
    assert_eq!(plain(&s, BALANCER, &a(1000), "/limited").await.0, 200);
    assert_eq!(over_tls(&s, &a(1001), "/limited").await.0, 200);
    let (status, answer) = plain(
        &s,
        BALANCER,
        &haproxy::v2(sock("192.0.2.30:1002"), to, &[]),
        "/limited",
    )
    .await;
    assert_eq!(status, 429, "{answer}");
    // Another address behind the same balancer has its own.
    assert_eq!(plain(&s, BALANCER, &b(2000), "/limited").await.0, 200);
    assert_eq!(plain(&s, BALANCER, &b(2001), "/limited").await.0, 200);
    assert_eq!(plain(&s, BALANCER, &b(2002), "/limited").await.0, 429);
    // And the balancer's own address (LOCAL) is a third.
    assert_eq!(
        plain(&s, BALANCER, &haproxy::v2_local(), "/limited")
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn a_header_address_in_trusted_proxies_has_its_forwarded_for_walked() {
    let s = setup().await;
    let header = haproxy::v1(sock("10.1.2.3:1000"), sock("127.0.0.1:8080"));
    for expected in [200, 200, 429] {
        let mut stream = connect_from(IpAddr::from(BALANCER), s.proxy.addr).await;
        let (status, answer) = exchange(
            &mut stream,
            &header,
            "/limited",
            "X-Forwarded-For: 198.51.100.9\r\n",
        )
        .await;
        assert_eq!(status, expected, "{answer}");
    }
    // The client is the address the trusted proxy named; the chain shows both.
    assert_eq!(last_header(&s, "x-real-ip"), "198.51.100.9");
    assert_eq!(last_header(&s, "x-forwarded-for"), "198.51.100.9, 10.1.2.3");
    // An untrusted header address's X-Forwarded-For is not believed.
    let header = haproxy::v1(sock("192.0.2.40:1000"), sock("127.0.0.1:8080"));
    let mut stream = connect_from(IpAddr::from(BALANCER), s.proxy.addr).await;
    let (status, _) = exchange(
        &mut stream,
        &header,
        "/open",
        "X-Forwarded-For: 198.51.100.9\r\n",
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(last_header(&s, "x-real-ip"), "192.0.2.40");
}

/// A real HAProxy in TCP mode, `send-proxy-v2`, from 127.0.0.3 (tollgate's only listed
/// peer): the limit is keyed on the client address HAProxy saw, and X-Forwarded-For names it.
#[tokio::test]
async fn behind_a_real_haproxy_send_proxy_v2() {
    let upstream = Upstream::start().await;
    let routes = r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"
  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
"#;
    let text = limits_config(
        "",
        "[server.proxy_protocol]\nfrom = [\"127.0.0.3\"]\n",
        routes,
    );
    let proxy = Proxy::start(config_from(&text, upstream.addr, &[])).await;
    let haproxy = HaProxy::send_proxy_v2(proxy.addr, [127, 0, 0, 3].into());

    let through = |client: [u8; 4], path: &'static str| {
        let addr = haproxy.addr;
        async move {
            let mut stream = connect_from(IpAddr::from(client), addr).await;
            exchange(&mut stream, b"", path, "").await
        }
    };
    for expected in [200, 200, 429] {
        let (status, answer) = through([127, 0, 0, 5], "/limited").await;
        assert_eq!(status, expected, "client 127.0.0.5: {answer}");
    }
    let (status, answer) = through([127, 0, 0, 6], "/limited").await;
    assert_eq!(status, 200, "client 127.0.0.6 has its own bucket: {answer}");
    let last = upstream.last();
    assert_eq!(
        last.headers
            .get("x-forwarded-for")
            .and_then(|v| v.to_str().ok()),
        Some("127.0.0.6")
    );
    // The same client straight to tollgate is not a listed peer: served as itself, with no
    // header required, and its bucket is the one HAProxy's header named.
    let mut stream = connect_from([127, 0, 0, 5].into(), proxy.addr).await;
    let (status, answer) = exchange(&mut stream, b"", "/limited", "").await;
    assert_eq!(status, 429, "{answer}");
}

#[test]
fn check_prints_the_listed_peers() {
    let dir = std::env::temp_dir().join(format!("tollgate-pp-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        "[server]\nlisten = [\"127.0.0.1:8080\"]\n\
         [server.proxy_protocol]\nfrom = [\"10.0.0.0/16\", \"2001:db8::7\"]\n\
         [upstreams.api]\nurl = \"http://127.0.0.1:9000\"\n\
         [[routes]]\nname = \"all\"\nupstream = \"api\"\n",
    )
    .expect("write config");
    let out = tollgate_check(&path);
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("proxy_protocol from 10.0.0.0/16, 2001:db8::7/128"),
        "{stdout}"
    );
}
