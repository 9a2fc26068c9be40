//! A TCP forwarder that can be told to fail: stands between tollgate and PostgreSQL so tests
//! can take "the database" down and bring it back without touching the real server.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct FaultyTcp {
    pub addr: SocketAddr,
    up: Arc<AtomicBool>,
    /// Bumped on every `cut`, so forwarding tasks drop their connections.
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultyTcp {
    fn drop(&mut self) {
        self.task.abort();
        self.generation.send_modify(|g| *g += 1);
    }
}

impl FaultyTcp {
    /// Forwards to `target`; starts up or down.
    pub async fn start(target: SocketAddr, up: bool) -> FaultyTcp {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind faulty");
        let addr = listener.local_addr().expect("addr");
        let up_flag = Arc::new(AtomicBool::new(up));
        let (generation, gen_rx) = watch::channel(0u64);
        let flag = up_flag.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if !flag.load(Ordering::SeqCst) {
                    // Down: the connection is reset at once, like a dead server's port.
                    drop(client);
                    continue;
                }
                let mut gen_rx = gen_rx.clone();
                // Only cuts after this connection was made concern it.
                gen_rx.borrow_and_update();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = gen_rx.changed() => {}
                    }
                });
            }
        });
        FaultyTcp {
            addr,
            up: up_flag,
            generation,
            task,
        }
    }

    /// Down: refuse new connections and cut the open ones.
    pub fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}
