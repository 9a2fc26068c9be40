//! tollgate: a rate-limiting reverse proxy whose counters live in PostgreSQL.
//!
//! An in-process limiter behind N replicas silently allows N times its limit, because each
//! replica counts only what it saw. tollgate counts in one shared table instead, with one
//! atomic upsert per decision, so a limit holds however many instances run
//! (`migrations/0001_rate_limits.sql` has the schema and its reasoning, docs/contract.md the
//! contract).
//!
//! One pipeline, one direction; each stage is one module:
//!
//! ```text
//! accept -> TLS -> framing guard -> HTTP (h1/h2) -> normalise -> route -> key -> limit -> store
//!  server    tls    http1::guard     server, http1 normalise   route   key    limit    store
//!                                                          |
//!                forward (upstream pool, http1, headers) <- allow
//!                                                          '-> deny: 429 / 503
//! ```
//!
//! `pipeline` runs the per-request steps in that order and is the single place where a
//! request ends (the access log is written there). `config` feeds all of them; nothing below
//! `pipeline` knows about hyper's connection types, and only `http1` (every HTTP/1.1 byte
//! tollgate reads or writes itself) and `server` see bytes. The modules import each other in
//! one direction only (`.ci/module-cycles` checks it).
//!
//! The library's API is what the `tollgate` binary and embedders use: [`cli::main`] (the whole
//! command), [`Server`] with its builder, and [`Config`] with the functions that load it.
//! Everything else is private; tests and fuzz targets reach what they check through
//! `testing`, which lists it.

mod access_log;
mod admin;
mod body;
pub mod cli;
mod config;
mod deadline;
mod decision;
mod error;
mod forward;
mod headers;
mod http1;
mod key;
mod limit;
mod log_format;
mod log_gate;
mod log_writer;
mod metrics;
mod normalise;
mod pipeline;
mod route;
mod server;
mod store;
#[doc(hidden)]
pub mod testing;
mod tls;

pub use config::{load_file, load_str, Config, ConfigErrors};
pub use server::{RunningServer, Server, ServerBuilder};
