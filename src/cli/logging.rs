//! The process's log: `tracing` to stderr through the non-blocking writer, text or JSON lines
//! (docs/operations.md, "Logs").

use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::EnvFilter;

use crate::log_format::TextFormat;
use crate::log_writer::{FlushOnDrop, LogWriter};

use super::Env;

/// Logs go to stderr through the non-blocking writer (`crate::log_writer`) at `RUST_LOG`, or
/// `default` when it is unset: a request never waits for a write. Returns its count of dropped
/// lines and the guard that flushes it.
pub fn init_logging(default: &str, env: Env) -> (Counter, Option<FlushOnDrop>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal();
    let json = env("TOLLGATE_LOG").as_deref() == Some("json");
    let Ok((writer, flush)) = LogWriter::stderr() else {
        // No thread for the writer: write directly, as before it existed.
        install_logging(filter, ansi, json, std::io::stderr);
        return (Counter::default(), None);
    };
    let dropped = writer.dropped();
    install_logging(filter, ansi, json, writer);
    (dropped, Some(flush))
}

/// Makes the process's subscriber: `filter`ed, in JSON or in the text format whose access-log
/// lines are written without tracing-subscriber's generic formatting (`crate::log_format`).
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
        builder.event_format(TextFormat::new()).init();
    }
}
