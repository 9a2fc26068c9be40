//! The README's quick start, as written: examples/demo_backend.py behind tollgate configured
//! by proxy.toml.example (only the fixed ports swapped for port 0). The README's loop of seven
//! POSTs to /login gets 200 five times, then 429; with `python3 -m http.server`, which it used
//! to suggest, the five were 501s. The demo backend also answers PUT, DELETE and PATCH with
//! their bodies read, chunked or not.

use crate::common::repo;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use crate::common::{config_from, h1_client, send, Proxy};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;

/// examples/demo_backend.py on a free port, killed on drop.
struct DemoBackend {
    child: Child,
    addr: SocketAddr,
}

impl DemoBackend {
    fn start() -> DemoBackend {
        let mut child = Command::new("python3")
            .arg(repo("examples/demo_backend.py"))
            .args(["--bind", "127.0.0.1", "--port", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("python3 is needed for examples/demo_backend.py ({e}); install python3")
            });
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the backend's first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("demo backend said {line:?}, not 'listening on ADDR'"));
        DemoBackend { child, addr }
    }
}

impl Drop for DemoBackend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// proxy.toml.example with its fixed ports replaced: each replacement must have happened, so
/// an edit to the example that moves them fails here instead of silently testing another file.
fn example_config() -> String {
    let mut text = std::fs::read_to_string(repo("proxy.toml.example")).expect("example");
    for (from, to) in [
        (
            "listen = [\"127.0.0.1:8080\"]",
            "listen = [\"127.0.0.1:0\"]",
        ),
        ("listen = \"127.0.0.1:9901\"", "listen = \"127.0.0.1:0\""),
        (
            "url = \"http://127.0.0.1:9000\"",
            "url = \"http://@UPSTREAM@\"",
        ),
    ] {
        assert!(
            text.contains(from),
            "proxy.toml.example no longer has {from}"
        );
        text = text.replace(from, to);
    }
    text
}

fn request(method: Method, url: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request")
}

#[tokio::test]
async fn the_readme_loop_prints_200_five_times_then_429() {
    let backend = DemoBackend::start();
    let config = config_from(&example_config(), backend.addr, &[]);
    let mut proxy = Proxy::start(config).await;
    let client = h1_client();

    let mut codes = Vec::new();
    for _ in 0..7 {
        let answer = send(&client, request(Method::POST, &proxy.url("/login"), "")).await;
        if answer.status == StatusCode::OK {
            assert!(
                answer.text().contains("\"method\": \"POST\""),
                "{}",
                answer.text()
            );
        }
        codes.push(answer.status.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429, 429]);
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_demo_backend_answers_every_method_and_reads_the_body() {
    let backend = DemoBackend::start();
    let config = config_from(&example_config(), backend.addr, &[]);
    let mut proxy = Proxy::start(config).await;
    let client = h1_client();

    for method in [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
    ] {
        let answer = send(
            &client,
            request(method.clone(), &proxy.url("/items/7?x=1"), "hello"),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK, "{method}: {}", answer.text());
        let echo: serde_json::Value = serde_json::from_slice(&answer.body).expect("JSON echo");
        assert_eq!(echo["method"], method.as_str());
        assert_eq!(echo["path"], "/items/7?x=1");
        assert_eq!(echo["body_bytes"], 5, "{method}");
        assert_eq!(echo["body"], "hello", "{method}");
    }
    proxy.shutdown().await;
}

#[test]
fn the_demo_backend_reads_chunked_bodies_and_keeps_the_connection() {
    use std::io::{Read, Write};
    let backend = DemoBackend::start();
    let mut stream = std::net::TcpStream::connect(backend.addr).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    let one = "PATCH /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    let two = "DELETE /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok";
    stream
        .write_all(format!("{one}{two}").as_bytes())
        .expect("write");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !(seen.contains("\"path\": \"/a\"") && seen.contains("\"path\": \"/b\"")) {
        let n = stream.read(&mut buf).expect("read both answers");
        assert!(n > 0, "connection closed after: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert_eq!(seen.matches("HTTP/1.1 200 OK").count(), 2, "{seen}");
    assert!(
        seen.contains("\"body_bytes\": 5, \"body\": \"abcde\""),
        "{seen}"
    );
    assert!(
        seen.contains("\"body_bytes\": 2, \"body\": \"ok\""),
        "{seen}"
    );
}
