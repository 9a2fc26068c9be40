//! Whether a pool connection reaches its PostgreSQL backend directly, with nothing in between
//! that could hand the next statement to another server session (a transaction-mode pooler).
//!
//! Why: a statement prepared once per connection spares the server the parse, analysis and
//! plan of every call (docs/performance.md, row "Prepared on direct connections": 50-300 µs
//! of database CPU per call). Behind a transaction pooler it must not be used (contract §6: no named prepared
//! statement kept across transactions). The operator is not asked which case applies (issue
//! 15: prefer what is correct with or without a pooler); the connection is checked.
//!
//! How: the backend says which TCP connection it serves (`inet_client_addr()`,
//! `inet_client_port()`, `inet_server_addr()`, `inet_server_port()`). The connection is direct
//! when a socket of THIS process has exactly that four-tuple, seen from the client side: the
//! kernel's table of TCP sockets (`/proc/self/net/tcp`, `tcp6`) gives the socket with that
//! local and remote address, and its inode must be one of this process' open descriptors
//! (`/proc/self/fd`). A pooler, an L4 proxy, NAT or a container boundary in between makes the
//! backend see another socket's addresses, or a socket of another process, and the answer is
//! "not direct": the unnamed statement, as before, which is always correct. A Unix-domain
//! connection (the backend reports no address) and systems without `/proc` are "not direct"
//! as well. A TCP connection cannot be re-routed once made, so the answer holds for the
//! connection's life.
//!
//! When: the backend's addresses are read by one statement as the connection is made
//! ([`super::session::settle`], which also tells whether the session is its backend's own);
//! the look-up in the kernel's tables then runs on tokio's blocking pool, never on the
//! decision path. Those tables list every TCP socket of the network namespace, TIME_WAIT
//! included: after a burst of short connections they hold tens of thousands of lines, and
//! reading them took 30-60 ms, which inside the pool's connect made the first decision after
//! start-up miss its budget. Until the look-up answers, the connection counts as not direct.

use std::io::BufRead;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// The two ends of the backend's TCP connection as the backend reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendSocket {
    /// The client's end, as the server sees it (`inet_client_addr()`, `inet_client_port()`).
    pub client: SocketAddr,
    /// The server's own end (`inet_server_addr()`, `inet_server_port()`).
    pub server: SocketAddr,
}

/// What is known about one connection: not yet, direct, or not direct. Written once by the
/// look-up (or by the store, when preparing fails), read by every increment.
#[derive(Debug)]
pub struct Directness(AtomicU8);

const UNKNOWN: u8 = 0;
const DIRECT: u8 = 1;
const NOT_DIRECT: u8 = 2;

impl Directness {
    /// Starts the look-up for the connection whose backend reports `backend` (`None`: it
    /// reported no TCP addresses) and returns at once; the answer arrives in the background.
    pub fn look_up(backend: Option<BackendSocket>) -> Arc<Directness> {
        let directness = Arc::new(Directness(AtomicU8::new(UNKNOWN)));
        let Some(backend) = backend else {
            directness.settle(false);
            return directness;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let answer = Arc::clone(&directness);
                // The blocking pool: reading the kernel's tables is file I/O that can take
                // tens of milliseconds, and must not hold a worker that serves requests.
                drop(runtime.spawn_blocking(move || answer.settle(is_own_socket(backend))));
            }
            // No runtime to run it on: stay with what is always correct.
            Err(_) => directness.settle(false),
        }
        directness
    }

    /// Whether the look-up has answered.
    pub fn known(&self) -> bool {
        self.0.load(Ordering::Acquire) != UNKNOWN
    }

    /// Whether the connection is known to reach its backend directly.
    pub fn is_direct(&self) -> bool {
        self.0.load(Ordering::Acquire) == DIRECT
    }

    /// Takes a direct connection back to unnamed statements for good (the caller logs why):
    /// something it would prepare there failed.
    pub fn demote(&self) {
        self.0.store(NOT_DIRECT, Ordering::Release);
    }

    /// Records the answer.
    pub fn settle(&self, direct: bool) {
        self.0
            .store(if direct { DIRECT } else { NOT_DIRECT }, Ordering::Release);
        tracing::debug!(
            direct,
            "store connection: {}",
            if direct {
                "reaches its backend directly; the increment is prepared on it"
            } else {
                "a pooler, a proxy or a Unix socket may be in between; unnamed statements only"
            }
        );
    }
}

/// Whether a socket of this process is the client end of `backend`. Blocking file I/O: the
/// tables are read line by line, and the search stops at the first socket with that
/// four-tuple (an established four-tuple is unique in a network namespace).
pub fn is_own_socket(backend: BackendSocket) -> bool {
    let want = (canonical(backend.client), canonical(backend.server));
    let found = ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .into_iter()
        .find_map(|table| {
            let file = std::fs::File::open(table).ok()?;
            std::io::BufReader::new(file)
                .lines()
                .skip(1)
                .map_while(Result::ok)
                .find_map(|line| established_inode(&line, want))
        });
    found.is_some_and(holds_socket)
}

/// The inode of the socket on one line of a `/proc/net/tcp`-format table (the header
/// excluded), if it is established with local address `want.0` and remote address `want.1`.
fn established_inode(line: &str, want: (SocketAddr, SocketAddr)) -> Option<u64> {
    const ESTABLISHED: &str = "01";
    let mut fields = line.split_whitespace();
    let _slot = fields.next()?;
    let local = parse_endpoint(fields.next()?)?;
    let remote = parse_endpoint(fields.next()?)?;
    let state = fields.next()?;
    // tx_queue:rx_queue, tr:tm->when, retrnsmt, uid, timeout, then the inode.
    let inode = fields.nth(5)?.parse::<u64>().ok()?;
    (state == ESTABLISHED && (local, remote) == want && inode != 0).then_some(inode)
}

/// `0100007F:1538` (IPv4: the address as the kernel's 32-bit word printed in hex, so the
/// bytes are reversed on little-endian machines; the port in hex) or 32 hex digits for IPv6
/// (four such words). IPv4-mapped IPv6 addresses come back as IPv4.
fn parse_endpoint(field: &str) -> Option<SocketAddr> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 => {
            let mut octets = [0u8; 16];
            for (i, chunk) in octets.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(addr.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

/// One 32-bit word of an address in the kernel's table, as the bytes it holds in memory.
fn word(hex: &str) -> Option<[u8; 4]> {
    let value = u32::from_str_radix(hex, 16).ok()?;
    Some(value.to_ne_bytes())
}

/// IPv4-mapped IPv6 (`::ffff:127.0.0.1`, how a dual-stack listener reports an IPv4 peer) as
/// IPv4, so both ends compare equal whichever family each side's socket has.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), addr.port()),
            None => addr,
        },
        IpAddr::V4(_) => addr,
    }
}

/// Whether one of this process' descriptors is the socket `inode` (`/proc/self/fd/N` ->
/// `socket:[inode]`); stops at the first that is.
fn holds_socket(inode: u64) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    let wanted = std::ffi::OsString::from(format!("socket:[{inode}]"));
    dir.filter_map(Result::ok)
        .any(|entry| std::fs::read_link(entry.path()).is_ok_and(|target| target == wanted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_as_the_kernel_prints_them() {
        // 127.0.0.1:5432 on a little-endian machine.
        let v4 = format!("{:08X}:1538", u32::from_ne_bytes([127, 0, 0, 1]));
        assert_eq!(parse_endpoint(&v4), Some("127.0.0.1:5432".parse().unwrap()));
        // ::1 port 80: four words, the last holding the 1.
        let v6 = format!(
            "{:08X}{:08X}{:08X}{:08X}:0050",
            0,
            0,
            0,
            u32::from_ne_bytes([0, 0, 0, 1])
        );
        assert_eq!(parse_endpoint(&v6), Some("[::1]:80".parse().unwrap()));
        // ::ffff:10.0.0.2 becomes 10.0.0.2.
        let mapped = format!(
            "{:08X}{:08X}{:08X}{:08X}:0001",
            0,
            0,
            u32::from_ne_bytes([0, 0, 0xff, 0xff]),
            u32::from_ne_bytes([10, 0, 0, 2])
        );
        assert_eq!(parse_endpoint(&mapped), Some("10.0.0.2:1".parse().unwrap()));
        assert_eq!(parse_endpoint("zz:1"), None);
        assert_eq!(parse_endpoint("0100007F"), None);
    }

    #[test]
    fn a_socket_of_this_process_is_found_and_an_unused_port_is_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (_server_side, _) = listener.accept().expect("accept");
        let ours = BackendSocket {
            client: client.local_addr().expect("local"),
            server: client.peer_addr().expect("peer"),
        };
        assert!(
            is_own_socket(ours),
            "the client end of {ours:?} is this process'"
        );
        let nobody = BackendSocket {
            client: "127.0.0.1:1".parse().unwrap(),
            server: ours.server,
        };
        assert!(!is_own_socket(nobody));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_look_up_answers_in_the_background_and_no_address_is_not_direct() {
        let none = Directness::look_up(None);
        assert!(
            none.known() && !none.is_direct(),
            "a Unix socket: not direct at once"
        );
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (_server_side, _) = listener.accept().expect("accept");
        let ours = Directness::look_up(Some(BackendSocket {
            client: client.local_addr().expect("local"),
            server: client.peer_addr().expect("peer"),
        }));
        for _ in 0..500 {
            if ours.known() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(
            ours.is_direct(),
            "a socket of this process, found by the look-up"
        );
    }

    #[test]
    fn a_socket_of_another_process_is_not_ours() {
        // A socket in the kernel's table that this process does not hold: the inode check
        // must refuse it even though the addresses match.
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:D431 0100007F:1538 01 00000000:00000000 00:00000000 00000000   106        0 999999999 1 0 20 4 30 10 -1\n";
        let want = (
            parse_endpoint("0100007F:D431").expect("local"),
            parse_endpoint("0100007F:1538").expect("remote"),
        );
        let line = table.lines().nth(1).expect("a socket line");
        assert_eq!(established_inode(line, want), Some(999_999_999));
        assert!(!holds_socket(999_999_999));
        // Not established: ignored.
        let listening = line.replace(" 01 ", " 0A ");
        assert_eq!(established_inode(&listening, want), None);
    }
}
