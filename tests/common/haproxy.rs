//! PROXY protocol peers for tests (contract §4): raw v1 and v2 headers as a balancer writes them,
//! clients that connect from a chosen loopback address, and a real HAProxy in TCP mode with
//! `send-proxy-v2` in front of tollgate.
//!
//! HAProxy is Debian's `haproxy` package (`.ci/run` installs it when it is missing); a test
//! that needs it panics when it is not there, it never skips. It runs in the foreground (`-db`)
//! on a free port with a configuration in a temporary directory, and is killed when the
//! [`HaProxy`] is dropped. Readiness is its frontend accepting a connection, polled, not a
//! sleep.

// Each test binary uses a different part of this harness.
#![allow(dead_code)]

use std::io::Read;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::{TcpSocket, TcpStream};

/// The v2 signature.
pub const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";

/// A v1 (text) header for a TCP connection from `source` to `destination`.
pub fn v1(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let family = if source.is_ipv4() { "TCP4" } else { "TCP6" };
    format!(
        "PROXY {family} {} {} {} {}\r\n",
        source.ip(),
        destination.ip(),
        source.port(),
        destination.port()
    )
    .into_bytes()
}

/// A v2 (binary) `PROXY` header for a TCP connection from `source` to `destination`, with
/// `tlvs` (already encoded) after the addresses.
pub fn v2(source: SocketAddr, destination: SocketAddr, tlvs: &[u8]) -> Vec<u8> {
    let mut addresses = Vec::new();
    let family = match (source.ip(), destination.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            addresses.extend_from_slice(&s.octets());
            addresses.extend_from_slice(&d.octets());
            0x11
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            addresses.extend_from_slice(&s.octets());
            addresses.extend_from_slice(&d.octets());
            0x21
        }
        _ => panic!("a PROXY header's two addresses are of one family"),
    };
    addresses.extend_from_slice(&source.port().to_be_bytes());
    addresses.extend_from_slice(&destination.port().to_be_bytes());
    addresses.extend_from_slice(tlvs);
    v2_raw(0x21, family, &addresses)
}

/// A v2 `LOCAL` header (a balancer's own health check), no addresses.
pub fn v2_local() -> Vec<u8> {
    v2_raw(0x20, 0x00, &[])
}

/// A v2 header from its parts: version and command byte, family and transport byte, and the
/// bytes after the length.
pub fn v2_raw(version_command: u8, family_transport: u8, rest: &[u8]) -> Vec<u8> {
    let mut out = V2_SIGNATURE.to_vec();
    out.push(version_command);
    out.push(family_transport);
    let len = u16::try_from(rest.len()).expect("a v2 header's length fits 16 bits");
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(rest);
    out
}

/// A TCP connection to `to` from the loopback address `from` (any of 127.0.0.0/8 works on
/// Linux without configuration), so a test can be a peer inside or outside
/// `server.proxy_protocol.from`.
pub async fn connect_from(from: IpAddr, to: SocketAddr) -> TcpStream {
    let socket = match from {
        IpAddr::V4(_) => TcpSocket::new_v4(),
        IpAddr::V6(_) => TcpSocket::new_v6(),
    }
    .expect("socket");
    socket
        .bind(SocketAddr::new(from, 0))
        .unwrap_or_else(|e| panic!("bind the client to {from}: {e}"));
    socket
        .connect(to)
        .await
        .unwrap_or_else(|e| panic!("connect from {from} to {to}: {e}"))
}

/// A running HAProxy; dropped, it is killed and its directory removed.
pub struct HaProxy {
    child: Child,
    dir: PathBuf,
    /// Where clients connect.
    pub addr: SocketAddr,
}

impl HaProxy {
    /// HAProxy in TCP mode on 127.0.0.1, relaying every connection to `backend` with a
    /// PROXY v2 header (`send-proxy-v2`), connecting from the address `source`.
    pub fn send_proxy_v2(backend: SocketAddr, source: IpAddr) -> HaProxy {
        let mut last_error = String::new();
        // A free port found by binding port 0: HAProxy cannot report a port it chose. If
        // another process takes it in between, the next attempt uses another.
        for _ in 0..5 {
            match try_start(backend, source) {
                Ok(haproxy) => return haproxy,
                Err(e) => last_error = e,
            }
        }
        panic!("haproxy did not start: {last_error}");
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn try_start(backend: SocketAddr, source: IpAddr) -> Result<HaProxy, String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let dir = std::env::temp_dir().join(format!(
        "tollgate-haproxy-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("temp dir: {e}"))?;
    let cfg = format!(
        "global\n\
         \x20   maxconn 200\n\
         defaults\n\
         \x20   mode tcp\n\
         \x20   timeout connect 2s\n\
         \x20   timeout client 10s\n\
         \x20   timeout server 10s\n\
         frontend edge\n\
         \x20   bind 127.0.0.1:{port}\n\
         \x20   default_backend tollgate\n\
         backend tollgate\n\
         \x20   server tollgate {backend} send-proxy-v2 source {source}\n"
    );
    let cfg_path = dir.join("haproxy.cfg");
    std::fs::write(&cfg_path, cfg).map_err(|e| format!("write config: {e}"))?;
    let mut child = Command::new(program())
        .arg("-db")
        .arg("-f")
        .arg(&cfg_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "could not run haproxy ({}): {e}; install Debian's package: \
                 apt-get install -y haproxy (.ci/run does)",
                program()
            )
        });
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut stderr);
            }
            let _ = std::fs::remove_dir_all(&dir);
            return Err(format!("haproxy exited with {status}: {stderr}"));
        }
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            // stderr is left unread: HAProxy writes little, and a full pipe only blocks its
            // logging, which this configuration does not do.
            return Ok(HaProxy { child, dir, addr });
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&dir);
            return Err("its frontend did not accept within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// HAProxy from PATH, or where Debian puts it; panics loudly when there is none.
fn program() -> String {
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("haproxy"))
                .collect()
        })
        .unwrap_or_default();
    candidates.push(PathBuf::from("/usr/sbin/haproxy"));
    match candidates.into_iter().find(|p| p.is_file()) {
        Some(path) => path.display().to_string(),
        None => panic!(
            "haproxy is not installed: these tests need a real HAProxy in front of tollgate; \
             install Debian's package with `apt-get install -y haproxy` (.ci/run does)"
        ),
    }
}
