//! Hop-by-hop fields and underscored field names on every HTTP/1.1 path (docs/architecture.md,
//! `server` and `forward.rs` in "Modules"): tollgate has two HTTP/1.1 servers (its own for
//! simple requests, `http1::server`, and hyper's) and two HTTP/1.1 clients
//! (its own for bodyless plain-HTTP requests, `http1::client`, and hyper's). Each test body is
//! written once and run on every pairing (`crate::common::paths`), so that one contract holds
//! on all of them:
//!
//! - hop-by-hop fields (`Connection` and what it names, `Keep-Alive`, `Proxy-Connection`,
//!   `Proxy-Authorization`, `Proxy-Authenticate`, `TE` but `TE: trailers`, `Trailer`,
//!   `Transfer-Encoding`, `Upgrade`) are removed in both directions; `Trailer` comes back only
//!   as the announcement of a body that carries trailers on to a client that takes them;
//! - a field whose name has `_` is dropped before the upstream, unless
//!   `server.underscores_in_headers`, which forwards it; the only 400 such a name can get is
//!   for the underscore twin of a header a limit keys on (docs/configuration.md,
//!   `[[routes.limits]]`).
//!
//! Clients are raw sockets ([`Wire`]); the upstream is the raw-TCP one of `crate::common::wire`
//! ([`RawUpstream`]), which records each request head exactly as it arrived.

use crate::common::paths::*;
use crate::common::wire::*;
use crate::common::*;

/// tollgate in front of `upstream` with `routes` and then [`ROUTES`] (`wire.test` served),
/// `server_extra` in `[server]`, on `paths`.
async fn proxy_on(
    paths: Paths,
    upstream: std::net::SocketAddr,
    server_extra: &str,
    routes: &str,
) -> Proxy {
    let text = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"
{server_extra}

[upstreams.app]
url = "http://@UPSTREAM@"
connect_timeout = "1s"
response_timeout = "2s"
{routes}{ROUTES}"#
    );
    paths.start(config_from(&text, upstream, &[])).await
}

/// The names of a head's fields, lower-cased, in order.
fn names(head: &str) -> Vec<String> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .map(|(name, _)| name.trim().to_ascii_lowercase())
        .collect()
}

/// The value of a head's field `name` (the first), trimmed.
fn field<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        .map(|(_, value)| value.trim())
}

// ---------------------------------------------------------------------------------------------
// Hop-by-hop fields, client to upstream.

/// The request of the report: hop-by-hop fields of every kind, `Connection` naming one more,
/// an `Upgrade` that is not WebSocket, and an end-to-end field. tollgate's own server leaves
/// it to hyper's (its `Connection` names a field, and it asks to upgrade).
const EVERY_HOP_FIELD: &str = "GET /hop HTTP/1.1\r\nHost: wire.test\r\n\
    Connection: keep-alive, X-Custom-Hop\r\nX-Custom-Hop: private\r\nKeep-Alive: timeout=5\r\n\
    Proxy-Connection: keep-alive\r\nProxy-Authorization: Basic c2VjcmV0\r\nTE: gzip\r\n\
    Trailer: x-checksum\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\
    X-End-To-End: kept\r\n\r\n";

/// The same without what tollgate's own server leaves to hyper's (a `Connection` naming a
/// field, `Upgrade`): the request that server takes.
const SIMPLE_HOP_FIELDS: &str = "GET /hop HTTP/1.1\r\nHost: wire.test\r\n\
    Connection: keep-alive\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n\
    Proxy-Authorization: Basic c2VjcmV0\r\nTE: gzip\r\nTrailer: x-checksum\r\n\
    X-End-To-End: kept\r\n\r\n";

/// Hop-by-hop names, none of which may reach the upstream in these requests (`TE` only
/// as `TE: trailers`, which they do not send).
const HOP_NAMES: [&str; 10] = [
    "connection",
    "x-custom-hop",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
];

async fn hop_by_hop_request_fields_stay_behind(paths: Paths) {
    let upstream = RawUpstream::start(echo_target).await;
    let proxy = proxy_on(paths, upstream.addr, "", "").await;
    for request in [EVERY_HOP_FIELD, SIMPLE_HOP_FIELDS] {
        let mut wire = Wire::connect(proxy.addr).await;
        let resp = wire.exchange(request).await;
        assert_eq!(resp.status, 200, "{paths:?}: {}", resp.head);
        let head = upstream.heads().pop().expect("a head upstream");
        let case = format!("{paths:?}\nsent:\n{request}\nupstream got:\n{head}");
        let got = names(&head);
        for hop in HOP_NAMES {
            assert!(
                !got.iter().any(|n| n == hop),
                "{hop} reached the upstream: {case}"
            );
        }
        assert_eq!(field(&head, "x-end-to-end"), Some("kept"), "{case}");
    }
}

/// Issue 47, item 1: `Trailer` reached the upstream with a bodyless GET.
#[tokio::test]
async fn hop_by_hop_request_fields_trailer_included_stay_behind_on_every_path() {
    on_every_path(hop_by_hop_request_fields_stay_behind).await;
}

// ---------------------------------------------------------------------------------------------
// Hop-by-hop fields, upstream to client.

/// An answer with hop-by-hop fields of every kind (`Trailer` among them, though a body framed
/// by its length carries no trailers) and an end-to-end field.
fn hop_answer(_: &Seen) -> Reply {
    Reply::new(
        "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Up-Hop\r\nX-Up-Hop: secret\r\n\
         Keep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nProxy-Connection: keep-alive\r\n\
         Trailer: x-checksum\r\nUpgrade: h2c\r\nX-Up-End: kept\r\nContent-Length: 3\r\n\r\nhop",
    )
}

/// A chunked answer that announces and sends the trailer `x-checksum`.
fn chunked_trailer_answer(_: &Seen) -> Reply {
    Reply::new(
        "HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\n\
         Trailer: x-checksum\r\n\r\n3\r\nhop\r\n0\r\nx-checksum: c0ffee\r\n\r\n",
    )
}

async fn hop_by_hop_response_fields_stay_behind(paths: Paths) {
    let upstream = RawUpstream::start(hop_answer).await;
    let proxy = proxy_on(paths, upstream.addr, "", "").await;
    // With `TE: trailers` too: a client that takes trailers gets no announcement of a body
    // that cannot carry any.
    for te in ["", "TE: trailers\r\n"] {
        let mut wire = Wire::connect(proxy.addr).await;
        let request = format!("GET /hop HTTP/1.1\r\nHost: wire.test\r\n{te}\r\n");
        let resp = wire.exchange(&request).await;
        let case = format!("{paths:?}, {te:?}:\n{}", resp.head);
        assert_eq!(resp.status, 200, "{case}");
        assert_eq!(resp.text(), "hop", "{case}");
        let got = names(&resp.head);
        for hop in [
            "x-up-hop",
            "keep-alive",
            "proxy-authenticate",
            "proxy-connection",
            "trailer",
            "upgrade",
        ] {
            assert!(
                !got.iter().any(|n| n == hop),
                "{hop} reached the client: {case}"
            );
        }
        // hyper's server says nothing of the connection on a kept-alive HTTP/1.1 answer.
        assert_eq!(field(&resp.head, "connection"), None, "{case}");
        assert_eq!(field(&resp.head, "x-up-end"), Some("kept"), "{case}");
    }
}

/// The response direction of issue 47, item 1.
#[tokio::test]
async fn hop_by_hop_response_fields_trailer_included_stay_behind_on_every_path() {
    on_every_path(hop_by_hop_response_fields_stay_behind).await;
}

async fn response_trailers_go_only_to_a_client_that_takes_them(paths: Paths) {
    let upstream = RawUpstream::start(chunked_trailer_answer).await;
    let proxy = proxy_on(paths, upstream.addr, "", "").await;
    let mut wire = Wire::connect(proxy.addr).await;
    let plain = wire
        .exchange("GET /t HTTP/1.1\r\nHost: wire.test\r\n\r\n")
        .await;
    let case = format!("{paths:?}, without TE:\n{}", plain.head);
    assert_eq!((plain.status, plain.text()), (200, "hop".into()), "{case}");
    assert_eq!(field(&plain.head, "trailer"), None, "{case}");
    assert_eq!(field(&plain.head, "keep-alive"), None, "{case}");
    assert!(plain.trailers.is_empty(), "{case}: {:?}", plain.trailers);

    // The announcement is put back for the trailers it announces, as the HTTP/1.1 encoder
    // needs (trailers pass through: docs/architecture.md, `headers.rs`).
    let with_te = wire
        .exchange("GET /t HTTP/1.1\r\nHost: wire.test\r\nTE: trailers\r\n\r\n")
        .await;
    let case = format!("{paths:?}, with TE:\n{}", with_te.head);
    assert!(with_te.chunked, "{case}");
    assert_eq!(
        field(&with_te.head, "trailer"),
        Some("x-checksum"),
        "{case}"
    );
    assert_eq!(field(&with_te.head, "keep-alive"), None, "{case}");
    assert_eq!(
        with_te.trailers,
        [("x-checksum".to_string(), "c0ffee".to_string())],
        "{case}"
    );
}

/// Trailers still pass through to a client that takes them, with their announcement, and to
/// no other.
#[tokio::test]
async fn response_trailers_go_only_to_a_client_that_takes_them_on_every_path() {
    on_every_path(response_trailers_go_only_to_a_client_that_takes_them).await;
}

// ---------------------------------------------------------------------------------------------
// Underscored field names.

/// A request with two underscored fields (one of them the twin of a field a limit might key
/// on) and a plain one.
const UNDERSCORED: &str = "GET /u HTTP/1.1\r\nHost: wire.test\r\nX_Api_Key: k1\r\n\
    x_trace: t1\r\nX-Plain: p1\r\n\r\n";

async fn underscored_names_follow_the_setting(paths: Paths, allowed: bool) {
    let upstream = RawUpstream::start(echo_target).await;
    let extra = format!("underscores_in_headers = {allowed}");
    let proxy = proxy_on(paths, upstream.addr, &extra, "").await;
    let mut wire = Wire::connect(proxy.addr).await;
    let resp = wire.exchange(UNDERSCORED).await;
    let case = format!(
        "{paths:?}, underscores_in_headers = {allowed}:\n{}",
        resp.head
    );
    assert_eq!(resp.status, 200, "{case}");
    assert_eq!(resp.text(), "/u", "{case}");
    let head = upstream.heads().pop().expect("a head upstream");
    let case = format!("{case}\nupstream got:\n{head}");
    let (key, trace) = if allowed {
        (Some("k1"), Some("t1"))
    } else {
        (None, None)
    };
    assert_eq!(field(&head, "x_api_key"), key, "{case}");
    assert_eq!(field(&head, "x_trace"), trace, "{case}");
    assert_eq!(field(&head, "x-plain"), Some("p1"), "{case}");
    // The connection goes on either way.
    let again = wire
        .exchange("GET /again HTTP/1.1\r\nHost: wire.test\r\n\r\n")
        .await;
    assert_eq!(
        (again.status, again.text()),
        (200, "/again".into()),
        "{case}"
    );
}

/// Issue 47, item 2: with `underscores_in_headers = true` such a request got 400.
#[tokio::test]
async fn underscored_names_are_forwarded_when_allowed_on_every_path() {
    on_every_path(|paths| underscored_names_follow_the_setting(paths, true)).await;
}

#[tokio::test]
async fn underscored_names_are_dropped_by_default_on_every_path() {
    on_every_path(|paths| underscored_names_follow_the_setting(paths, false)).await;
}

/// The one 400 an underscored name can get, alike on every path: with
/// `underscores_in_headers = true`, the underscore twin of a header a limit keys on
/// (`X_Api_Key` for `header:x-api-key`), which CGI and WSGI backends read as that header
/// (docs/configuration.md, `[[routes.limits]]`; `key::keyed_header_problem`). Other
/// underscored names on the same route pass.
async fn a_keyed_headers_twin_is_refused_and_other_names_pass(paths: Paths) {
    let upstream = RawUpstream::start(echo_target).await;
    let routes = r#"
[[routes]]
name = "keyed"
path_prefix = "/keyed"
upstream = "app"

  [[routes.limits]]
  key = "header:x-api-key"
  requests = 100
  window = "1h"
"#;
    let proxy = proxy_on(
        paths,
        upstream.addr,
        "underscores_in_headers = true",
        routes,
    )
    .await;
    let mut wire = Wire::connect(proxy.addr).await;
    let twin = wire
        .exchange("GET /keyed HTTP/1.1\r\nHost: wire.test\r\nX_Api_Key: k1\r\n\r\n")
        .await;
    assert_eq!(twin.status, 400, "{paths:?}: {}", twin.head);
    assert!(
        upstream.heads().is_empty(),
        "{paths:?}: the twin was forwarded"
    );
    let mut wire = Wire::connect(proxy.addr).await;
    let other = wire
        .exchange("GET /keyed HTTP/1.1\r\nHost: wire.test\r\nX-Api-Key: k1\r\nX_Trace: t1\r\n\r\n")
        .await;
    assert_eq!(other.status, 200, "{paths:?}: {}", other.head);
    let head = upstream.heads().pop().expect("a head upstream");
    assert_eq!(field(&head, "x_trace"), Some("t1"), "{paths:?}:\n{head}");
}

#[tokio::test]
async fn a_keyed_headers_underscore_twin_gets_400_on_every_path() {
    on_every_path(a_keyed_headers_twin_is_refused_and_other_names_pass).await;
}
