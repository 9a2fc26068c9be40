//! `X-Request-Id` (contract §5): kept from a trusted proxy when it is 1 to 128 visible ASCII
//! characters, otherwise a new random one (128 bits, hex); it goes upstream, comes back on
//! the response (tollgate's own answers included) and is in the access-log line.
//!
//! Reproduces issue 17: "There is no request id to correlate tollgate's access log with the
//! backend's."

mod common;

use std::io;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use common::*;

const ROUTES: &str = r#"
[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "app"

  [[routes.limits]]
  key = "global"
  requests = 1
  window = "1h"

[[routes]]
name = "api"
path_prefix = "/api"
upstream = "app"
"#;

async fn setup(trusted: bool) -> (Upstream, Proxy, H1Client) {
    let upstream = Upstream::start().await;
    let base = if trusted {
        BASE.replace(
            "[server]\n",
            "[server]\ntrusted_proxies = [\"127.0.0.1/32\"]\n",
        )
    } else {
        BASE.to_string()
    };
    let config = config_from(&format!("{base}{ROUTES}"), upstream.addr, &[]);
    (upstream, Proxy::start(config).await, h1_client())
}

async fn get_with_id(client: &H1Client, url: &str, ids: &[&str]) -> Answer {
    let mut req = Request::get(url);
    for id in ids {
        req = req.header("x-request-id", *id);
    }
    send(client, req.body(Full::new(Bytes::new())).expect("request")).await
}

fn is_generated(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_peer_gets_a_new_id_upstream_and_back() {
    let (upstream, proxy, client) = setup(false).await;
    let answer = get_with_id(&client, &proxy.url("/api/x"), &["chosen-by-client"]).await;
    assert_eq!(answer.status, StatusCode::OK);
    let sent = upstream.last();
    let upstream_saw: Vec<_> = sent.headers.get_all("x-request-id").iter().collect();
    assert_eq!(upstream_saw.len(), 1, "{upstream_saw:?}");
    let id = upstream_saw[0].to_str().expect("ascii");
    assert!(is_generated(id), "{id}");
    assert_eq!(answer.header("x-request-id"), Some(id));

    // Without one, too; and never the same twice.
    let second = get_with_id(&client, &proxy.url("/api/x"), &[]).await;
    let second_id = second.header("x-request-id").expect("an id");
    assert!(is_generated(second_id), "{second_id}");
    assert_ne!(second_id, id);
    assert_eq!(upstream.last().headers["x-request-id"], second_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_peer_keeps_a_valid_id_and_loses_an_invalid_one() {
    let (upstream, proxy, client) = setup(true).await;
    let kept = "lb-7f3a:req=42/~";
    let answer = get_with_id(&client, &proxy.url("/api/x"), &[kept]).await;
    assert_eq!(answer.header("x-request-id"), Some(kept));
    assert_eq!(upstream.last().headers["x-request-id"], kept);

    let longest = "i".repeat(128);
    let answer = get_with_id(&client, &proxy.url("/api/x"), &[&longest]).await;
    assert_eq!(answer.header("x-request-id"), Some(longest.as_str()));

    let too_long = "i".repeat(129);
    for refused in [
        &[too_long.as_str()][..],
        &["has space"],
        &["tab\there"],
        &["one", "two"],
    ] {
        let answer = get_with_id(&client, &proxy.url("/api/x"), refused).await;
        let id = answer.header("x-request-id").expect("an id").to_string();
        assert!(is_generated(&id), "{refused:?} gave {id}");
        let upstream_saw: Vec<_> = upstream
            .last()
            .headers
            .get_all("x-request-id")
            .iter()
            .cloned()
            .collect();
        assert_eq!(upstream_saw, [id.as_str()], "{refused:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgates_own_answers_carry_the_id() {
    let (upstream, proxy, client) = setup(true).await;
    // 404: no route.
    let answer = get_with_id(&client, &proxy.url("/nowhere"), &["id-404"]).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.header("x-request-id"), Some("id-404"));
    // 429: the second request over a limit of 1.
    get_with_id(&client, &proxy.url("/limited"), &[]).await;
    let answer = get_with_id(&client, &proxy.url("/limited"), &["id-429"]).await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(answer.header("x-request-id"), Some("id-429"));
    // 400: a malformed request, and a generated id when none was sent.
    let answer = get_with_id(&client, &proxy.url("/api/%2e%2e/%2e%2e/x"), &[]).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(answer.header("x-request-id").is_some_and(is_generated));
    assert_eq!(upstream.count(), 1, "only the first /limited was forwarded");
}

/// The access-log lines of this test binary, as JSON (one global subscriber for the process:
/// tollgate's workers log from their own threads).
fn access_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log: Arc<Mutex<Vec<u8>>> = Arc::default();
        let sink = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_env_filter("tollgate::access=info")
            .with_writer(move || Writer(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        log
    })
    .clone()
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_line_has_the_id() {
    let log = access_log();
    let (_upstream, proxy, client) = setup(false).await;
    let forwarded = get_with_id(&client, &proxy.url("/api/logged"), &[]).await;
    let own = get_with_id(&client, &proxy.url("/nowhere/logged"), &[]).await;
    let mut proxy = proxy;
    proxy.shutdown().await;
    let text = String::from_utf8(log.lock().expect("log lock").clone()).expect("utf-8");
    for answer in [forwarded, own] {
        let id = answer.header("x-request-id").expect("an id");
        let line = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line"))
            .find(|v| v["fields"]["request_id"] == id)
            .unwrap_or_else(|| panic!("no access line with request_id {id}:\n{text}"));
        assert_eq!(line["target"], "tollgate::access");
        assert_eq!(line["fields"]["status"], answer.status.as_u16());
    }
}
