//! Whether a pool connection reaches its PostgreSQL backend directly, with nothing in between
//! that could hand the next statement to another server session (a transaction-mode pooler).
//!
//! Why: a statement prepared once per connection spares the server the parse, analysis and
//! plan of every call (docs/performance.md, "Sixth December session": 50-300 µs of database
//! CPU per call). Behind a transaction pooler it must not be used (SPEC 6: no named prepared
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
//! When: the backend's addresses are read by one statement as the connection is made; the
//! look-up in the kernel's tables then runs on tokio's blocking pool, never on the decision
//! path. Those tables list every TCP socket of the network namespace, TIME_WAIT included:
//! after a burst of short connections they hold tens of thousands of lines, and reading them
//! took 30-60 ms, which inside the pool's connect made the first decision after start-up
//! miss its budget. Until the look-up answers, the connection counts as not direct.
//!
//! # A session of its own, and its timeouts
//!
//! A weaker question has a cheaper, wider answer: is the backend that runs this session's
//! statements the one the session started with? Then session state (a `SET`, a `LISTEN`)
//! stays with tollgate's session and dies with it; otherwise a pooler in between may leave it
//! on a server connection that other clients get (docs/operations.md, "Connection
//! poolers"). The server announces its backend at start-up (BackendKeyData: the backend's
//! process id and a secret, for cancel requests). A pooler cannot pass a backend's key on, since its clients move between
//! backends (in transaction mode at every transaction) and a cancel request must reach the
//! one serving the client now; PgBouncer, in either mode, announces a key of its own. So the
//! session is its backend's own when `pg_backend_pid()` is the announced process id. An L4
//! proxy or NAT in between changes nothing here: the key comes through.
//!
//! [`settle`] answers both questions with one pipelined round trip as a connection is made,
//! and sets the timeouts of tollgate's own statements (a role's `statement_timeout` or
//! `lock_timeout`, say 1 ms, must not cancel them): for the session, on a session of its
//! own; in that transaction only, otherwise, so nothing stays on a pooler's server
//! connection. There the caller wraps its statements in `SET LOCAL` when the role's own
//! timeouts are shorter than tollgate's ([`Settled::short_defaults`]; docs/operations.md,
//! "Connection poolers", "Timeouts of its own").

use std::io::BufRead;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

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

/// What [`settle`] learned about a session as it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// The TCP connection its backend serves, as the backend names it (`None`: a Unix
    /// socket), for [`Directness::look_up`].
    pub backend: Option<BackendSocket>,
    /// Whether the backend is the session's own (see the module notes). Only then did
    /// [`settle`] set the session's timeouts.
    pub own: bool,
    /// Whether the role's (or the database's) own `statement_timeout` or `lock_timeout` is
    /// set and shorter than tollgate's bound: on a session that is not its own, tollgate's
    /// statements then need `SET LOCAL` in a transaction of their own.
    pub short_defaults: bool,
}

/// The statement of [`settle`]: the backend's addresses, whether it is the announced one
/// (`$1`, `NULL` when unknown), whether the role's defaults (`pg_settings.reset_val`, in
/// milliseconds; 0 is "no limit") are shorter than `$2` ms, and on the session's own backend
/// the session's timeouts set to `$3` (ms). `set_config(..., false)` in the transaction
/// survives its commit, and after a `SET LOCAL` of the same setting too.
const SETTLE_SQL: &str = "\
SELECT host(inet_client_addr()), inet_client_port(), host(inet_server_addr()), inet_server_port(),
       coalesce(pg_backend_pid() = $1, false),
       coalesce((SELECT bool_or(reset_val::int8 BETWEEN 1 AND $2 - 1) FROM pg_settings
                 WHERE name IN ('statement_timeout', 'lock_timeout')), false),
       CASE WHEN pg_backend_pid() = $1
            THEN set_config('statement_timeout', $3, false) || set_config('lock_timeout', $3, false)
       END";

/// `SET LOCAL` of both timeouts to `bound`: the statement (after a `BEGIN`) that lets the
/// rest of a transaction run under tollgate's timeouts whatever the session's are.
pub fn set_local_timeouts(bound: Duration) -> String {
    let ms = bound.as_millis().max(1);
    format!("SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}")
}

/// Finds out what [`Settled`] says about the session of `client`, and sets its timeouts to
/// `bound` if it is its backend's own: `BEGIN` with [`set_local_timeouts`], [`SETTLE_SQL`],
/// `COMMIT`, pipelined (one round trip). In one transaction, so that a transaction pooler
/// runs all of it on one server connection, and [`SETTLE_SQL`] itself runs under `bound`
/// rather than a role's 1 ms (a fresh backend's first statement loads its catalog caches).
/// Only `BEGIN` and the `SET LOCAL`s run under the role's own timeouts: no catalog access.
pub async fn settle(client: &Client, bound: Duration) -> Result<Settled, tokio_postgres::Error> {
    let announced = announced_pid(client).await;
    let ms = bound.as_millis().max(1);
    let bound_ms = i64::try_from(ms).unwrap_or(i64::MAX);
    let value = ms.to_string();
    let begin = format!("BEGIN; {}", set_local_timeouts(bound));
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&announced, Type::INT4),
        (&bound_ms, Type::INT8),
        (&value, Type::TEXT),
    ];
    let (begun, row, ended) = tokio::join!(
        client.batch_execute(&begin),
        client.query_typed_one(SETTLE_SQL, &params),
        client.batch_execute("COMMIT"),
    );
    begun?;
    let row = row?;
    ended?;
    let end = |addr: Option<String>, port: Option<i32>| -> Option<SocketAddr> {
        let ip: IpAddr = addr?.parse().ok()?;
        Some(SocketAddr::new(ip, u16::try_from(port?).ok()?))
    };
    let backend = (|| {
        Some(BackendSocket {
            client: end(row.try_get(0).ok()?, row.try_get(1).ok()?)?,
            server: end(row.try_get(2).ok()?, row.try_get(3).ok()?)?,
        })
    })();
    Ok(Settled {
        backend,
        own: row.try_get(4)?,
        short_defaults: row.try_get(5)?,
    })
}

/// The backend process id the server announced to `client` at start-up (BackendKeyData), if
/// it can be read. tokio-postgres keeps it to itself except in the cancel request it writes,
/// so the request is written into memory and read back, never sent: `CancelRequest` is
/// length 16, code 80877102, then the process id and the secret (big-endian); before it,
/// with an `sslmode` that asks for TLS, comes an `SSLRequest` (length 8, code 80877103),
/// answered `S` here and followed by a "TLS" that passes the bytes through unchanged.
async fn announced_pid(client: &Client) -> Option<i32> {
    let (ours, theirs) = tokio::io::duplex(64);
    let token = client.cancel_token();
    let (written, pid) = tokio::join!(
        token.cancel_query_raw(ours, PassThrough),
        read_cancel_request(theirs)
    );
    written.ok()?;
    pid
}

/// The process id of the cancel request written into `stream` (see [`announced_pid`]).
async fn read_cancel_request(mut stream: DuplexStream) -> Option<i32> {
    const SSL_REQUEST: i32 = 80_877_103;
    const CANCEL_REQUEST: i32 = 80_877_102;
    // At most an SSLRequest, then the CancelRequest.
    for _ in 0..2 {
        let mut head = [0u8; 8];
        stream.read_exact(&mut head).await.ok()?;
        let word =
            |at: usize| i32::from_be_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        match (word(0), word(4)) {
            (8, SSL_REQUEST) => stream.write_all(b"S").await.ok()?,
            (16, CANCEL_REQUEST) => {
                let mut body = [0u8; 8];
                stream.read_exact(&mut body).await.ok()?;
                return Some(i32::from_be_bytes([body[0], body[1], body[2], body[3]]));
            }
            _ => return None,
        }
    }
    None
}

/// The "TLS" of [`announced_pid`]: the stream itself, so the request stays readable.
struct PassThrough;

impl TlsConnect<DuplexStream> for PassThrough {
    type Stream = PassedThrough;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<PassedThrough, std::io::Error>>;

    fn connect(self, stream: DuplexStream) -> Self::Future {
        std::future::ready(Ok(PassedThrough(stream)))
    }
}

struct PassedThrough(DuplexStream);

impl TlsStream for PassedThrough {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for PassedThrough {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PassedThrough {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
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

    /// The process id comes out of the cancel request tokio-postgres writes, whether an
    /// `SSLRequest` (answered `S`) comes first or not; anything else gives none.
    #[tokio::test(flavor = "current_thread")]
    async fn the_cancel_request_gives_the_announced_process_id() {
        const CANCEL: [u8; 8] = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
        const SSL: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        let pid_and_secret = [0, 0, 0x30, 0x39, 9, 9, 9, 9];
        let cases = [
            (
                [&CANCEL[..], &pid_and_secret].concat(),
                Some(12345),
                &b""[..],
            ),
            (
                [&SSL[..], &CANCEL, &pid_and_secret].concat(),
                Some(12345),
                b"S",
            ),
            (vec![0, 0, 0, 8, 0, 0, 0, 0], None, b""),
        ];
        for (written, expected, answered) in cases {
            let (mut client, server) = tokio::io::duplex(64);
            let reading = tokio::spawn(read_cancel_request(server));
            client.write_all(&written).await.expect("write");
            assert_eq!(reading.await.expect("read"), expected);
            let mut answer = Vec::new();
            client.read_to_end(&mut answer).await.expect("answer");
            assert_eq!(answer, answered);
        }
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
