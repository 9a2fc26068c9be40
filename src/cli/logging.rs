//! The process's log: `tracing` to stderr through the non-blocking writer, text or JSON lines,
//! and the access log written by the connection workers themselves into the same writer
//! (docs/operations.md, "Logs").

use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::EnvFilter;

use crate::access_log::AccessLog;
use crate::log_format::{LineFormat, ACCESS_TARGET};
use crate::log_writer::{FlushOnDrop, LogWriter};

use super::Env;

/// The process's log, as [`init_logging`] set it up.
pub struct Logging {
    /// The count of dropped lines (`tollgate_log_lines_dropped_total`).
    pub drops: Counter,
    /// The access log for the server to write itself; `None`: its lines are `tracing` events
    /// (see [`init_logging`]).
    pub access: Option<AccessLog>,
    /// Writes out the last lines when dropped: keep it to the end of `main`.
    pub flush: Option<FlushOnDrop>,
}

/// Logs go to stderr through the non-blocking writer (`crate::log_writer`) at `RUST_LOG`, or
/// `default` when it is unset: a request never waits for a write.
///
/// Access-log lines are written by the server's workers (`crate::access_log`) in the format
/// the subscriber would give them, when `RUST_LOG` lets them through. That is asked once,
/// here: whether the filter just installed enables an INFO event of target
/// `tollgate::access`, the question it answers for the event itself (by target and level:
/// access lines are in no span). When it does not, or stderr is a terminal (whose lines are
/// in colour), or there is no writer thread, `access` is `None` and the lines are `tracing`
/// events like any other: filtered, or written by the subscriber.
pub fn init_logging(default: &str, env: Env) -> Logging {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal();
    let json = env("TOLLGATE_LOG").as_deref() == Some("json");
    let Ok((writer, flush)) = LogWriter::stderr() else {
        // No thread for the writer: write directly, as before it existed.
        install_logging(filter, ansi, json, std::io::stderr);
        return Logging {
            drops: Counter::default(),
            access: None,
            flush: None,
        };
    };
    let drops = writer.dropped();
    install_logging(filter, ansi, json, writer.clone());
    let format = match (json, ansi) {
        (true, _) => Some(LineFormat::Json),
        (false, false) => Some(LineFormat::Text),
        (false, true) => None,
    };
    let enabled = tracing::enabled!(target: ACCESS_TARGET, tracing::Level::INFO);
    Logging {
        drops,
        access: format
            .filter(|_| enabled)
            .map(|format| AccessLog::new(writer, format)),
        flush: Some(flush),
    }
}

/// Makes the process's subscriber: `filter`ed, in tracing-subscriber's text or JSON format.
fn install_logging<W>(filter: EnvFilter, ansi: bool, json: bool, writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}
