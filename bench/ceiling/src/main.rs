//! The ceiling proxy of `bench/run.sh` (issue 16): how fast a reverse proxy built on hyper can
//! be on this machine, measured in the same run as nginx and tollgate.
//!
//! It does what every proxy must and nothing else: one thread (like nginx's one worker), an
//! HTTP/1.1 server connection per client, and the upstream connection that carries a client's
//! requests polled by that client connection's own task, not by a task of its own. A client
//! connection keeps its upstream connection for its lifetime and hands it to the thread's idle
//! list when it ends; a new client connection takes one from there, or opens one. No limits,
//! no header rewriting, no timeouts: whatever tollgate costs beyond this is tollgate's.
//!
//! Usage: `tollgate-bench-ceiling LISTEN_ADDR UPSTREAM_ADDR [inline|spawned]` (addresses as
//! `IP:PORT`, loopback in the benchmark). `spawned` gives each upstream connection a task of
//! its own instead (the other way to drive them, for comparison; `inline` is the default). It
//! runs until killed.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

type Connection = http1::Connection<TokioIo<TcpStream>, Incoming>;

/// One upstream connection: the handle requests go through, and the connection future that
/// does its I/O, polled by whichever client connection holds it.
struct Upstream {
    sender: SendRequest<Incoming>,
    /// None when the connection has a task of its own (`spawned`).
    connection: Option<Pin<Box<Connection>>>,
}

/// The upstream connection a client connection holds, if any. Shared by the request future
/// and the response body, both polled by that client connection's task, one at a time.
type Slot = Rc<RefCell<Option<Upstream>>>;

/// Idle upstream connections of the thread.
type Idle = Rc<RefCell<Vec<Upstream>>>;

/// Polls the held upstream connection, so that what it has to read or write moves on; a
/// connection that has ended is let go.
fn drive(slot: &Slot, cx: &mut Context<'_>) {
    let mut held = slot.borrow_mut();
    if let Some(connection) = held.as_mut().and_then(|up| up.connection.as_mut()) {
        if connection.as_mut().poll(cx).is_ready() {
            *held = None;
        }
    }
}

/// The upstream's response body, which polls the upstream connection each time the client
/// connection asks it for more.
struct InlineBody {
    inner: Option<Incoming>,
    slot: Slot,
}

impl Body for InlineBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        drive(&this.slot, cx);
        match this.inner.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// An upstream connection ready for a request: the held one, else an idle one, else new.
async fn ready_upstream(
    slot: &Slot,
    idle: &Idle,
    upstream: SocketAddr,
    spawned: bool,
) -> Result<(), String> {
    for _ in 0..3 {
        if slot.borrow().is_none() {
            let reused = idle.borrow_mut().pop();
            let up = match reused {
                Some(up) => up,
                None => {
                    let tcp = TcpStream::connect(upstream)
                        .await
                        .map_err(|e| e.to_string())?;
                    let _ = tcp.set_nodelay(true);
                    let (sender, connection) = http1::handshake(TokioIo::new(tcp))
                        .await
                        .map_err(|e| e.to_string())?;
                    let connection = if spawned {
                        tokio::task::spawn_local(connection);
                        None
                    } else {
                        Some(Box::pin(connection))
                    };
                    Upstream { sender, connection }
                }
            };
            *slot.borrow_mut() = Some(up);
        }
        let ready = poll_fn(|cx| {
            drive(slot, cx);
            match slot.borrow_mut().as_mut() {
                Some(up) => up.sender.poll_ready(cx).map(|r| r.is_ok()),
                None => Poll::Ready(false),
            }
        })
        .await;
        if ready {
            return Ok(());
        }
        *slot.borrow_mut() = None;
    }
    Err("no usable upstream connection".to_string())
}

async fn proxy(
    req: Request<Incoming>,
    slot: Slot,
    idle: Idle,
    upstream: SocketAddr,
    spawned: bool,
) -> Result<Response<InlineBody>, hyper::Error> {
    let bad_gateway = |slot: Slot| {
        let mut response = Response::new(InlineBody { inner: None, slot });
        *response.status_mut() = StatusCode::BAD_GATEWAY;
        response
    };
    if ready_upstream(&slot, &idle, upstream, spawned)
        .await
        .is_err()
    {
        return Ok(bad_gateway(slot));
    }
    let sent = slot
        .borrow_mut()
        .as_mut()
        .map(|up| up.sender.send_request(req));
    let Some(sent) = sent else {
        return Ok(bad_gateway(slot));
    };
    let mut sent = std::pin::pin!(sent);
    let response = poll_fn(|cx| {
        drive(&slot, cx);
        sent.as_mut().poll(cx)
    })
    .await;
    Ok(match response {
        Ok(response) => response.map(|body| InlineBody {
            inner: Some(body),
            slot,
        }),
        Err(_) => {
            slot.borrow_mut().take();
            bad_gateway(slot)
        }
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: tollgate-bench-ceiling LISTEN_ADDR UPSTREAM_ADDR [inline|spawned]";
    let listen: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let upstream: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let spawned = match args.next().as_deref() {
        None | Some("inline") => false,
        Some("spawned") => true,
        Some(_) => return Err(usage.into()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let local = tokio::task::LocalSet::new();
    let listener = local.block_on(&runtime, TcpListener::bind(listen))?;
    local.block_on(&runtime, async move {
        let idle: Idle = Rc::default();
        loop {
            let (tcp, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(_) => continue,
            };
            let _ = tcp.set_nodelay(true);
            let idle = idle.clone();
            tokio::task::spawn_local(async move {
                let slot: Slot = Rc::default();
                let service = {
                    let (slot, idle) = (slot.clone(), idle.clone());
                    service_fn(move |req| proxy(req, slot.clone(), idle.clone(), upstream, spawned))
                };
                let _ = server::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
                // The client is gone: its upstream connection, if still usable, serves the
                // next client connection instead of being closed.
                let held = slot.borrow_mut().take();
                if let Some(up) = held {
                    if up.sender.is_ready() {
                        idle.borrow_mut().push(up);
                    }
                }
            });
        }
    })
}
