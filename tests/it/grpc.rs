//! gRPC through tollgate (contract §5c), with a real gRPC client (tonic) and a real gRPC service
//! upstream (tonic's server half on a hyper HTTP/2 connection). The messages are written by
//! hand with `prost` derives: no protoc, no generated code.
//!
//! Reproduces issue 17: a rate-limited gRPC call got a plain 429 with a JSON body, which
//! gRPC clients report as `UNAVAILABLE` with no metadata (and retry); every answer tollgate
//! makes itself must be a trailers-only gRPC response instead.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use http::uri::PathAndQuery;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tonic::{Code, Status};

use crate::common::*;

#[derive(Clone, PartialEq, prost::Message)]
struct Say {
    #[prost(string, tag = "1")]
    text: String,
    /// How many replies a streaming call asks for.
    #[prost(uint32, tag = "2")]
    count: u32,
}

type Codec = tonic_prost::ProstCodec<Say, Say>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type SayStream = Pin<Box<dyn Stream<Item = Result<Say, Status>> + Send>>;

/// `/test.Echo/Say`: one reply, `echo: <text>`; `/test.Echo/Fail`: the upstream's own
/// `NOT_FOUND`; `/test.Echo/Slow`: replies after two seconds.
#[derive(Clone)]
struct Unary {
    path: &'static str,
}

impl tower_service::Service<tonic::Request<Say>> for Unary {
    type Response = tonic::Response<Say>;
    type Error = Status;
    type Future = BoxFuture<Result<tonic::Response<Say>, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<Say>) -> Self::Future {
        let path = self.path;
        Box::pin(async move {
            let say = req.into_inner();
            match path {
                "/test.Echo/Fail" => Err(Status::not_found("no such greeting")),
                "/test.Echo/Slow" => {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    Ok(tonic::Response::new(say))
                }
                _ => {
                    let mut reply = tonic::Response::new(Say {
                        text: format!("echo: {}", say.text),
                        count: 1,
                    });
                    reply
                        .metadata_mut()
                        .insert("x-upstream", "tonic".parse().expect("static"));
                    Ok(reply)
                }
            }
        })
    }
}

/// `/test.Echo/Count`: `count` replies, numbered.
#[derive(Clone)]
struct Count;

impl tower_service::Service<tonic::Request<Say>> for Count {
    type Response = tonic::Response<SayStream>;
    type Error = Status;
    type Future = BoxFuture<Result<tonic::Response<SayStream>, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::Request<Say>) -> Self::Future {
        Box::pin(async move {
            let say = req.into_inner();
            let replies = (1..=say.count).map(move |i| {
                Ok(Say {
                    text: format!("{} #{i}", say.text),
                    count: i,
                })
            });
            let stream: SayStream = Box::pin(futures_util::stream::iter(replies));
            Ok(tonic::Response::new(stream))
        })
    }
}

async fn dispatch(req: Request<Incoming>) -> http::Response<tonic::body::Body> {
    let mut grpc = tonic::server::Grpc::new(Codec::default());
    match req.uri().path() {
        "/test.Echo/Count" => grpc.server_streaming(Count, req).await,
        "/test.Echo/Fail" => {
            grpc.unary(
                Unary {
                    path: "/test.Echo/Fail",
                },
                req,
            )
            .await
        }
        "/test.Echo/Slow" => {
            grpc.unary(
                Unary {
                    path: "/test.Echo/Slow",
                },
                req,
            )
            .await
        }
        _ => {
            grpc.unary(
                Unary {
                    path: "/test.Echo/Say",
                },
                req,
            )
            .await
        }
    }
}

/// A gRPC service on 127.0.0.1 (HTTP/2 prior knowledge).
struct GrpcUpstream {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GrpcUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl GrpcUpstream {
    async fn start() -> GrpcUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let service =
                        service_fn(|req| async move { Ok::<_, Infallible>(dispatch(req).await) });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .timer(TokioTimer::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        GrpcUpstream { addr, task }
    }
}

/// `[server]` and the upstream (h2c, short timeouts); `store` is the `[store]` body.
fn grpc_config(store: &str, routes: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
shutdown_timeout = "5s"

[store]
{store}

[keys]
secret = "test-secret"

[upstreams.app]
url = "http://@UPSTREAM@"
http2 = true
connect_timeout = "1s"
response_timeout = "500ms"

{routes}
"#
    )
}

const OPEN_ROUTE: &str = r#"
[[routes]]
name = "echo"
path_prefix = "/test.Echo"
upstream = "app"
"#;

async fn client(proxy: &Proxy) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", proxy.addr))
        .expect("channel url")
        .connect()
        .await
        .expect("connect to tollgate");
    tonic::client::Grpc::new(channel)
}

async fn say(
    grpc: &mut tonic::client::Grpc<tonic::transport::Channel>,
    path: &'static str,
) -> Result<tonic::Response<Say>, Status> {
    grpc.ready().await.expect("channel ready");
    let request = tonic::Request::new(Say {
        text: "hello".into(),
        count: 0,
    });
    grpc.unary(request, PathAndQuery::from_static(path), Codec::default())
        .await
}

fn metadata<'a>(status: &'a Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_call_and_upstream_status_pass_through() {
    let upstream = GrpcUpstream::start().await;
    let proxy = Proxy::start(config_from(
        &grpc_config("", OPEN_ROUTE),
        upstream.addr,
        &[],
    ))
    .await;
    let mut grpc = client(&proxy).await;

    let reply = say(&mut grpc, "/test.Echo/Say").await.expect("unary call");
    assert_eq!(reply.get_ref().text, "echo: hello");
    assert_eq!(
        reply.metadata().get("x-upstream").map(|v| v.to_str().ok()),
        Some(Some("tonic"))
    );

    // The upstream's own status (in its trailers) reaches the client unchanged.
    let status = say(&mut grpc, "/test.Echo/Fail").await.expect_err("fails");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(status.message(), "no such greeting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_streaming_call_passes_through() {
    let upstream = GrpcUpstream::start().await;
    let proxy = Proxy::start(config_from(
        &grpc_config("", OPEN_ROUTE),
        upstream.addr,
        &[],
    ))
    .await;
    let mut grpc = client(&proxy).await;
    grpc.ready().await.expect("ready");
    let request = tonic::Request::new(Say {
        text: "tick".into(),
        count: 5,
    });
    let response = grpc
        .server_streaming(
            request,
            PathAndQuery::from_static("/test.Echo/Count"),
            Codec::default(),
        )
        .await
        .expect("streaming call");
    let mut stream = response.into_inner();
    let mut texts = Vec::new();
    while let Some(message) = stream.message().await.expect("stream message") {
        texts.push(message.text);
    }
    assert_eq!(
        texts,
        ["tick #1", "tick #2", "tick #3", "tick #4", "tick #5"]
    );
    // The stream ended with the upstream's `grpc-status: 0` trailer.
    let trailers = stream.trailers().await.expect("trailers");
    assert!(trailers.is_some(), "the upstream's trailers did not arrive");
}

/// Issue 17: the third call over a limit of 2 got HTTP 429 with JSON, which tonic reports as
/// UNAVAILABLE with no metadata (before the fix: `Code::Unavailable`, "mapped from HTTP status
/// code 429").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn third_call_over_a_limit_of_two_is_resource_exhausted_with_pushback() {
    let upstream = GrpcUpstream::start().await;
    let routes = r#"
[[routes]]
name = "echo"
path_prefix = "/test.Echo"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"

[routes.reject]
status = 418
content_type = "text/plain"
body = "not for grpc"
"#;
    let proxy = Proxy::start(config_from(&grpc_config("", routes), upstream.addr, &[])).await;
    let mut grpc = client(&proxy).await;
    for _ in 0..2 {
        say(&mut grpc, "/test.Echo/Say")
            .await
            .expect("within the limit");
    }
    let status = say(&mut grpc, "/test.Echo/Say").await.expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("echo:ip"),
        "message names the policy: {status:?}"
    );
    let retry_after: u64 = metadata(&status, "retry-after")
        .and_then(|v| v.parse().ok())
        .expect("retry-after");
    assert!((1..=3600).contains(&retry_after), "{retry_after}");
    let pushback: u64 = metadata(&status, "grpc-retry-pushback-ms")
        .and_then(|v| v.parse().ok())
        .expect("grpc-retry-pushback-ms");
    assert_eq!(pushback, retry_after * 1000);
    assert!(
        metadata(&status, "ratelimit").is_some_and(|v| v.contains("\"echo:ip\";r=0")),
        "{status:?}"
    );
    assert!(
        metadata(&status, "ratelimit-policy").is_some(),
        "{status:?}"
    );
}

/// The status of one call to `path` through a proxy on `grpc_config(store, routes)` in front
/// of `upstream`, which must fail.
async fn failed_call(
    upstream: SocketAddr,
    store: &str,
    routes: &str,
    path: &'static str,
) -> Status {
    let proxy = Proxy::start(config_from(&grpc_config(store, routes), upstream, &[])).await;
    let mut grpc = client(&proxy).await;
    say(&mut grpc, path)
        .await
        .expect_err("the call should fail")
}

/// Issue 17: no route answered 404 text, which a gRPC client can only guess at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_route_is_unimplemented() {
    let upstream = GrpcUpstream::start().await;
    let status = failed_call(upstream.addr, "", OPEN_ROUTE, "/other.Service/Say").await;
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    assert_eq!(status.message(), "no route matches", "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_store_under_deny_is_unavailable() {
    let upstream = GrpcUpstream::start().await;
    let closed = RefusedPort::new();
    let store = format!(
        "url = \"postgres://postgres@{closed}/tollgate\"\ntimeout = \"200ms\"\non_error = \"deny\""
    );
    let routes = r#"
[[routes]]
name = "echo"
path_prefix = "/test.Echo"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 100
  window = "1h"
"#;
    let status = failed_call(upstream.addr, &store, routes, "/test.Echo/Say").await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        status.message(),
        "rate-limit store unavailable",
        "{status:?}"
    );
    assert_eq!(metadata(&status, "grpc-retry-pushback-ms"), Some("1000"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_upstream_is_deadline_exceeded() {
    let upstream = GrpcUpstream::start().await;
    let status = failed_call(upstream.addr, "", OPEN_ROUTE, "/test.Echo/Slow").await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(status.message(), "upstream timeout", "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_is_unavailable() {
    let closed = RefusedPort::new();
    let status = failed_call(closed.addr, "", OPEN_ROUTE, "/test.Echo/Say").await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // The connect error (with the upstream's address) stays in tollgate's log.
    assert_eq!(status.message(), "upstream unreachable", "{status:?}");
}

/// The wire form, seen by a plain HTTP/2 client: HTTP 200, `content-type: application/grpc`,
/// the status in the response headers and no body (a trailers-only response);
/// `application/grpc+proto` counts as gRPC, a plain request keeps its 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_answers_are_trailers_only_on_the_wire() {
    let upstream = GrpcUpstream::start().await;
    let proxy = Proxy::start(config_from(
        &grpc_config("", OPEN_ROUTE),
        upstream.addr,
        &[],
    ))
    .await;
    let client = h2c_client();
    for content_type in ["application/grpc", "application/grpc+proto"] {
        let req = Request::post(proxy.url("/nowhere/Say"))
            .header("content-type", content_type)
            .header("te", "trailers")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let response = client.request(req).await.expect("answer");
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers().clone();
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], "12");
        assert_eq!(headers["grpc-message"], "no route matches");
        let collected = response.into_body().collect().await.expect("body");
        assert!(collected.trailers().is_none());
        assert!(
            collected.to_bytes().is_empty(),
            "a body on a trailers-only answer"
        );
    }
    // A malformed gRPC request (a path escaping the root): INTERNAL.
    let req = Request::post(proxy.url("/test.Echo/%2e%2e/%2e%2e/x"))
        .header("content-type", "application/grpc")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = client.request(req).await.expect("answer");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "13");
    // Not gRPC: `application/grpcx` is another type.
    let req = Request::post(proxy.url("/nowhere"))
        .header("content-type", "application/grpcx")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = client.request(req).await.expect("answer");
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert!(response.headers().get("grpc-status").is_none());
}

/// Contract §3d on gRPC: a limit counting the calls whose HTTP status is 2xx (every gRPC
/// answer, success or not, is HTTP 200) checks before forwarding and charges when the
/// response head arrives; the third call over a limit of two is RESOURCE_EXHAUSTED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_charged_when_its_response_head_arrives() {
    let upstream = GrpcUpstream::start().await;
    let routes = r#"
[[routes]]
name = "echo"
path_prefix = "/test.Echo"
upstream = "app"

  [[routes.limits]]
  key = "ip"
  requests = 2
  window = "1h"
  count = ["2xx"]
"#;
    let proxy = Proxy::start(config_from(&grpc_config("", routes), upstream.addr, &[])).await;
    let mut grpc = client(&proxy).await;
    let reply = say(&mut grpc, "/test.Echo/Say").await.expect("first call");
    assert_eq!(reply.get_ref().text, "echo: hello");
    let failed = say(&mut grpc, "/test.Echo/Fail")
        .await
        .expect_err("the upstream's own");
    assert_eq!(
        failed.code(),
        Code::NotFound,
        "charged too: its HTTP status is 200"
    );
    let status = say(&mut grpc, "/test.Echo/Say").await.expect_err("limited");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let text = proxy.server().metrics().render();
    let counted = "tollgate_decisions_total{route=\"echo\",decision=\"counted_after\"}";
    assert_eq!(crate::limits::metric_value(&text, counted), 2.0, "{text}");
}
