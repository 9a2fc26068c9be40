//! The admin listener (contract §7): `/healthz` (the process serves), `/readyz` (decisions
//! succeed: the outcome of recent decisions, or when there were none a probe that runs the
//! store's real statement) and `/metrics` (Prometheus text 0.0.4, or OpenMetrics when the
//! scraper's `Accept` asks for it; readiness is sampled into `tollgate_ready` on each scrape,
//! the same answer `/readyz` gives). It is a separate listener so
//! that it can be bound to loopback or an internal network while the proxy faces the world.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::body::ProxyBody;
use crate::metrics::{Format, Metrics};
use crate::store::Store;

pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    store: Arc<dyn Store>,
    stopped: impl Future<Output = ()>,
) {
    tokio::pin!(stopped);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stopped => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let metrics = metrics.clone();
        let store = store.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let metrics = metrics.clone();
                let store = store.clone();
                async move { Ok::<_, Infallible>(answer(&req, &metrics, store.as_ref()).await) }
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10));
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(
    req: &Request<Incoming>,
    metrics: &Metrics,
    store: &dyn Store,
) -> Response<ProxyBody> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            // Recent decisions, else a round trip with the real statement: a dropped table, a
            // revoked privilege or a read-only database is not ready, and a store that
            // recovered is seen as ready even with no traffic.
            let ready = store.probe().await.is_ok();
            metrics.ready.set(i64::from(ready));
            if ready {
                text(StatusCode::OK, "ready\n")
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, "decisions are failing\n")
            }
        }
        "/metrics" => {
            let ready = store.probe().await.is_ok();
            metrics.ready.set(i64::from(ready));
            // Several Accept fields are one list (RFC 9110 5.3); one that is not text asks
            // for nothing.
            let accept: Vec<&str> = req
                .headers()
                .get_all(header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let accept = accept.join(",");
            let format = Format::negotiate((!accept.is_empty()).then_some(accept.as_str()));
            let mut response = Response::new(ProxyBody::text(metrics.render_as(format)));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(format.content_type()),
            );
            // Caches between the scraper and tollgate must not hand one format to the other.
            response
                .headers_mut()
                .insert(header::VARY, header::HeaderValue::from_static("accept"));
            response
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::text(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
