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

pub mod admin;
pub mod body;
pub mod config;
pub mod deadline;
pub mod decision;
pub mod error;
pub mod forward;
pub mod headers;
pub mod http1;
pub mod key;
pub mod limit;
pub mod log_format;
pub mod log_writer;
pub mod metrics;
pub mod normalise;
pub mod pipeline;
pub mod route;
pub mod server;
pub mod store;
pub mod tls;

pub use config::Config;
pub use server::{RunningServer, Server, ServerBuilder};
