//! Why a call to PostgreSQL failed, in the words an operator searches for (docs/operations.md,
//! "When the store fails"): every error is classified ([`Cause`]: by SQLSTATE, I/O error kind
//! or TLS error), told transient or not (whether waiting can help: then tollgate keeps serving
//! under its failure policy), described with the server's own message, and logged with the
//! database's host, port and name, at most one line per cause a second ([`FailureLog`]).

use std::error::Error as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::tls;
use crate::error::Detail;
use crate::store::StoreError;

/// At most one warning per cause in this interval; the next one counts what was left out.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Why [`PostgresStore::initialize`](super::PostgresStore::initialize) or
/// [`PostgresStore::migrate`](super::PostgresStore::migrate) failed.
///
/// [`InitError::is_retryable`] tells the caller whether to keep serving under the failure
/// policy and try again (contract §1) or to stop with exit code 1.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The database did not answer (refused, timed out, closed, shutting down, too many
    /// connections, read-only standby). Retryable.
    #[error("database unreachable: {0}")]
    Unreachable(#[source] Detail),
    /// `store.migrate = false` and the schema lacks migrations this binary needs. Retryable:
    /// the operator (or a deploy job) may be running `tollgate migrate` right now.
    #[error(
        "database schema is not up to date: migration {missing} has not been applied; \
         run `tollgate migrate` or set store.migrate = true"
    )]
    SchemaBehind { missing: &'static str },
    /// The database holds a different key fingerprint. Fatal. The message says what happened
    /// and how to rotate the key (`tollgate migrate --accept-new-key`).
    #[error("{0}")]
    FingerprintMismatch(String),
    /// A migration failed (its transaction was rolled back). Fatal.
    #[error("migration {name} failed: {message}")]
    Migration {
        name: &'static str,
        #[source]
        message: Detail,
    },
    /// Any other database error (authentication, missing database, permissions, TLS). Fatal.
    #[error("database error: {0}")]
    Database(#[source] Detail),
}

impl InitError {
    /// Whether trying again later can succeed without an operator changing something.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            InitError::Unreachable(_) | InitError::SchemaBehind { .. }
        )
    }
}

/// Why a call to the database failed, in the words an operator searches for (contract §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    Refused,
    Timeout,
    ReadOnly,
    Authentication,
    MissingTable,
    MissingDatabase,
    Permission,
    TooManyConnections,
    ShuttingDown,
    ConnectionLost,
    Tls,
    Network,
    Database,
}

impl Cause {
    pub(super) const ALL: usize = 13;

    fn as_str(self) -> &'static str {
        match self {
            Cause::Refused => "refused",
            Cause::Timeout => "timeout",
            Cause::ReadOnly => "read-only",
            Cause::Authentication => "authentication",
            Cause::MissingTable => "missing table",
            Cause::MissingDatabase => "missing database",
            Cause::Permission => "permission",
            Cause::TooManyConnections => "too many connections",
            Cause::ShuttingDown => "shutting down",
            Cause::ConnectionLost => "connection lost",
            Cause::Tls => "tls",
            Cause::Network => "network",
            Cause::Database => "database error",
        }
    }
}

/// Classifies a tokio-postgres error: by SQLSTATE for the server's errors, by the kind of
/// the I/O error in the chain for connection errors.
pub(super) fn cause(e: &tokio_postgres::Error) -> Cause {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        return match code {
            "25006" => Cause::ReadOnly,
            "28000" | "28P01" => Cause::Authentication,
            "3D000" => Cause::MissingDatabase,
            "42P01" | "3F000" => Cause::MissingTable,
            "42501" => Cause::Permission,
            "53300" | "53400" => Cause::TooManyConnections,
            "57P01" | "57P02" | "57P03" => Cause::ShuttingDown,
            "57014" => Cause::Timeout,
            _ if code.starts_with("08") => Cause::ConnectionLost,
            _ => Cause::Database,
        };
    }
    if tls::tls_problem(e).is_some() {
        return Cause::Tls;
    }
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::ConnectionRefused => Cause::Refused,
                std::io::ErrorKind::TimedOut => Cause::Timeout,
                // target_session_attrs=read-write found only servers that refuse writes.
                std::io::ErrorKind::PermissionDenied => Cause::ReadOnly,
                std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof => Cause::ConnectionLost,
                _ => Cause::Network,
            };
        }
        if s.is::<rustls::Error>() {
            return Cause::Tls;
        }
        source = s.source();
    }
    if e.is_closed() {
        Cause::ConnectionLost
    } else {
        Cause::Database
    }
}

/// Warnings about failing store calls, naming the cause and the database (host, port and
/// name from the URL, never its password nor the URL itself), at most one line per cause
/// every [`FAILURE_LOG_INTERVAL`]; the next line says how many were left out.
pub(super) struct FailureLog {
    pub(super) host: String,
    pub(super) port: String,
    pub(super) dbname: String,
    /// Per cause: when it was last logged and how many have been left out since.
    pub(super) slots: Mutex<[(Option<Instant>, u64); Cause::ALL]>,
}

impl FailureLog {
    pub(super) fn new(pg: &tokio_postgres::Config) -> FailureLog {
        let host = pg
            .get_hosts()
            .iter()
            .map(|h| match h {
                tokio_postgres::config::Host::Tcp(name) => name.clone(),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
            })
            .chain(pg.get_hostaddrs().iter().map(|a| a.to_string()))
            .take(pg.get_hosts().len().max(pg.get_hostaddrs().len()))
            .collect::<Vec<_>>()
            .join(",");
        let port = match pg.get_ports() {
            [] => "5432".to_owned(),
            ports => ports
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(","),
        };
        // libpq's default database is the user's name.
        let dbname = pg
            .get_dbname()
            .or(pg.get_user())
            .unwrap_or("postgres")
            .to_owned();
        FailureLog {
            host,
            port,
            dbname,
            slots: Mutex::new([(None, 0); Cause::ALL]),
        }
    }

    /// "host H, port P, database D", for messages.
    pub(super) fn location(&self) -> String {
        format!(
            "host {}, port {}, database {}",
            self.host, self.port, self.dbname
        )
    }

    pub(super) fn note(&self, cause: Cause, detail: &str) {
        let suppressed = {
            let Ok(mut slots) = self.slots.lock() else {
                return;
            };
            let (last, left_out) = &mut slots[cause as usize];
            let now = Instant::now();
            if last.is_some_and(|at| now.duration_since(at) < FAILURE_LOG_INTERVAL) {
                *left_out += 1;
                return;
            }
            *last = Some(now);
            std::mem::take(left_out)
        };
        // The target the module had before it was split: docs/operations.md ("When the store
        // fails") shows it, and operators filter and search their logs by it.
        tracing::warn!(
            target: "tollgate::store::postgres",
            cause = cause.as_str(),
            host = %self.host,
            port = %self.port,
            dbname = %self.dbname,
            suppressed,
            error = %detail,
            "rate-limit store call failed"
        );
    }
}

/// Whether an error is the database being (temporarily) out of reach rather than wrong:
/// network and connect errors, a closed connection, and the server-side codes that mean
/// "not now" (connection exceptions, insufficient resources, shutdown or start-up in
/// progress, a statement or lock timeout: tollgate sets its own, but a timeout is never a
/// reason to give up for good). Authentication failures, a missing database, permissions and TLS
/// misconfiguration are not: retrying would not help.
pub(super) fn is_transient(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    // TLS failures (the server declines TLS, its certificate is not trusted) are
    // configuration, but on either side: the server's may be fixed (ssl = on, a renewed
    // certificate) while tollgate waits. So tollgate keeps serving under its failure policy,
    // not ready, and says why in the failure log (issue 15), rather than exiting.
    if tls::tls_problem(e).is_some() {
        return true;
    }
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        return code.starts_with("08")
            || code.starts_with("53")
            || matches!(
                code,
                "57P01" | "57P02" | "57P03" | "25006" | "57014" | "55P03"
            );
    }
    // Connect errors (refused, timed out, "database does not allow writes" from
    // target_session_attrs=read-write) carry an io::Error somewhere in their chain.
    let mut source = e.source();
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// A message for a tokio-postgres error: the server's code and message for database errors
/// (tokio-postgres' Display says only "db error"), its own text otherwise.
pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(problem) = tls::tls_problem(e) {
        return problem;
    }
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
            // tokio-postgres' Display stops at its own words ("error connecting to server");
            // the cause (refused, timed out, ...) is in the source chain.
            let mut message = e.to_string();
            let mut source = e.source();
            while let Some(s) = source {
                message.push_str(": ");
                message.push_str(&s.to_string());
                source = s.source();
            }
            message
        }
    }
}

/// Maps an error met during initialization: transient ones to `Unreachable`, the rest with
/// `fatal`.
pub(super) fn classify(
    e: tokio_postgres::Error,
    fatal: impl FnOnce(Detail) -> InitError,
) -> InitError {
    let transient = is_transient(&e);
    let reason = Detail::caused_by(describe(&e), e);
    if transient {
        InitError::Unreachable(reason)
    } else {
        fatal(reason)
    }
}

/// Maps an error met while counting.
pub(super) fn query_error(e: tokio_postgres::Error) -> StoreError {
    if is_transient(&e) {
        StoreError::Unavailable(Detail::caused_by(describe(&e), e))
    } else {
        StoreError::Query(Detail::caused_by(describe(&e), e))
    }
}
