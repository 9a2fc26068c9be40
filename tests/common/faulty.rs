//! A TCP relay that can be told to fail: stands between tollgate and PostgreSQL so tests can
//! take "the database" down, stall it, and bring it back without touching the real server.
//!
//! - up: bytes flow both ways;
//! - down: new connections are reset at once and open ones are cut (a dead server's port);
//! - stalled: connections stay open but no byte moves in either direction (a hung server or
//!   a network black hole); new connections are accepted and hang too.
//!
//! Independently of the mode, [`FaultyTcp::delay`] holds every chunk for a while in each
//! direction: a slow, distant or overloaded database.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Up,
    Down,
    Stalled,
}

pub struct FaultyTcp {
    pub addr: SocketAddr,
    mode: watch::Sender<(Mode, u64)>,
    /// Milliseconds each chunk is held before it is passed on.
    latency_ms: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultyTcp {
    fn drop(&mut self) {
        self.task.abort();
        self.mode.send_modify(|(m, g)| {
            *m = Mode::Down;
            *g += 1;
        });
    }
}

impl FaultyTcp {
    /// Relays to `target`; starts up or down.
    pub async fn start(target: SocketAddr, up: bool) -> FaultyTcp {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind faulty");
        let addr = listener.local_addr().expect("addr");
        let initial = if up { Mode::Up } else { Mode::Down };
        let (mode, watcher) = watch::channel((initial, 0u64));
        let latency_ms = Arc::new(AtomicU64::new(0));
        let latency = latency_ms.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if watcher.borrow().0 == Mode::Down {
                    drop(client);
                    continue;
                }
                tokio::spawn(relay(client, target, watcher.clone(), latency.clone()));
            }
        });
        FaultyTcp {
            addr,
            mode,
            latency_ms,
            task,
        }
    }

    /// Holds every chunk `by` before passing it on, both ways (zero: no delay).
    pub fn delay(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.latency_ms.store(ms, Ordering::Relaxed);
    }

    /// Down: refuse new connections and cut the open ones.
    pub fn down(&self) {
        self.mode.send_modify(|(m, g)| {
            *m = Mode::Down;
            *g += 1;
        });
    }

    /// Stalled: keep every connection open, move no byte.
    pub fn stall(&self) {
        self.mode.send_modify(|(m, _)| *m = Mode::Stalled);
    }

    pub fn up(&self) {
        self.mode.send_modify(|(m, _)| *m = Mode::Up);
    }
}

async fn relay(
    client: TcpStream,
    target: SocketAddr,
    mut watcher: watch::Receiver<(Mode, u64)>,
    latency_ms: Arc<AtomicU64>,
) {
    // Only cuts after this connection was made concern it.
    let generation = watcher.borrow_and_update().1;
    if !wait_until_flowing(&mut watcher, generation).await {
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pump(client_read, server_write, watcher.clone(), generation, &latency_ms) => {}
        _ = pump(server_read, client_write, watcher.clone(), generation, &latency_ms) => {}
    }
}

/// Waits while stalled; false once the relay is down (or cut since `generation`).
async fn wait_until_flowing(watcher: &mut watch::Receiver<(Mode, u64)>, generation: u64) -> bool {
    loop {
        let (mode, current) = *watcher.borrow();
        if current != generation || mode == Mode::Down {
            return false;
        }
        if mode == Mode::Up {
            return true;
        }
        if watcher.changed().await.is_err() {
            return false;
        }
    }
}

/// Copies one direction, holding each chunk while the relay is stalled.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut rx: watch::Receiver<(Mode, u64)>,
    generation: u64,
    latency_ms: &AtomicU64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut(&mut rx, generation) => return,
        };
        let latency = latency_ms.load(Ordering::Relaxed);
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        if !wait_until_flowing(&mut rx, generation).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Resolves when the relay is taken down after `generation`.
async fn cut(rx: &mut watch::Receiver<(Mode, u64)>, generation: u64) {
    loop {
        let (mode, current) = *rx.borrow_and_update();
        if current != generation || mode == Mode::Down {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}
