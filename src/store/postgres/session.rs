//! Whether a session to PostgreSQL is its backend's own, and the timeouts of tollgate's own
//! statements on it, settled as the session is made.
//!
//! Is the backend that runs this session's statements the one the session started with?
//! Then session state (a `SET`, a `LISTEN`) stays with tollgate's session and dies with it;
//! otherwise a pooler in between may leave it on a server connection that other clients get
//! (docs/operations.md, "Connection poolers"). The server announces its backend at start-up
//! (BackendKeyData: the backend's process id and a secret, for cancel requests). A pooler
//! cannot pass a backend's key on, since its clients move between backends (in transaction
//! mode at every transaction) and a cancel request must reach the one serving the client now;
//! PgBouncer, in either mode, announces a key of its own. So the session is its backend's own
//! when `pg_backend_pid()` is the announced process id. An L4 proxy or NAT in between changes
//! nothing here: the key comes through. (Whether the connection also reaches its backend
//! directly, so that a statement may be prepared on it, is the stronger question of
//! [`super::direct`], which starts from the backend's addresses read here.)
//!
//! [`settle`] answers with one pipelined round trip as a connection is made, and sets the
//! timeouts of tollgate's own statements (a role's `statement_timeout` or `lock_timeout`, say
//! 1 ms, must not cancel them): for the session, on a session of its own; in that transaction
//! only, otherwise, so nothing stays on a pooler's server connection. There the caller wraps
//! its statements in `SET LOCAL` when the role's own timeouts are shorter than tollgate's
//! ([`Settled::short_defaults`]; docs/operations.md, "Connection poolers", "Timeouts of its
//! own").

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::direct::BackendSocket;

/// What [`settle`] learned about a session as it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// The TCP connection its backend serves, as the backend names it (`None`: a Unix
    /// socket), for [`Directness::look_up`](super::direct::Directness::look_up).
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
}
