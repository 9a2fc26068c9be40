//! Loading `proxy.toml` into a validated [`Config`] (SPEC section 2).
//!
//! This module owns everything between the bytes of the file and the typed [`Config`]:
//! TOML parsing (with positions), `${NAME}` expansion, unknown-key detection, type and range
//! checks, defaults, and the cross-field checks (a route's upstream exists, route names are
//! unique, two limits that write the same bucket prefix agree on `requests` and `window`).
//!
//! The file is hostile input and the operator wants to fix it in one pass, so nothing here
//! stops at the first problem: every check runs, every problem becomes a [`ConfigError`] with
//! `FILE:LINE:COL: field.path: message`, and a [`Config`] is returned only when there are none.
//! The document is walked by hand (a [`TableReader`] per table records which keys it consumed)
//! rather than through serde, because serde stops at the first error and loses positions.
//!
//! Positions: lines and columns are 1-based; columns count characters (not bytes), as editors
//! do. Field paths use TOML dotted keys with 0-based indices into arrays:
//! `routes[2].limits[0].window`, `upstreams.api.url`, `server.listen[1]`.
//!
//! The loader never reads the process environment itself: `${NAME}` references and the
//! `TOLLGATE_DATABASE_URL` override go through the `env` function the caller passes, so tests
//! need no `std::env::set_var` and `main` stays the only place that touches the environment.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::num::NonZeroUsize;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::Scheme;
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri};
use ipnet::IpNet;
use toml_edit::{ImDocument, Item, Table, TableLike, Value};

use super::ProxyProtocolConfig;
use super::{
    AdminConfig, Algorithm, CertConfig, Config, HostPattern, KeyPart, KeySpec, KeysConfig,
    LimitConfig, RateLimitHeaders, RejectConfig, RouteConfig, ServerConfig, StoreConfig,
    StoreErrorPolicy, UpstreamConfig, DEFAULT_MEMORY_BUCKETS, MAX_MEMORY_BUCKETS,
};

/// The environment lookup the caller provides (`std::env::var(..).ok()` in `main`).
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A byte range in the source text, when toml_edit knows one.
type Span = Option<Range<usize>>;

/// Environment variable that overrides `store.url` when set and non-empty (SPEC section 2).
pub const DATABASE_URL_ENV: &str = "TOLLGATE_DATABASE_URL";

/// Upper bound for every duration in the file. Limit windows are capped at 366 days by the
/// spec; other durations share the cap so that no value can overflow `Instant + Duration`
/// further down (that addition panics on overflow).
const MAX_DURATION_SECS: u64 = 366 * 86_400;

/// Upper bound for `server.max_connections`: far above what one process can serve, and far
/// below what would make a semaphore constructor panic.
const MAX_CONNECTIONS: i64 = 10_000_000;

/// Idle upstream connections kept per worker and origin, unless the file says otherwise: like
/// a generous nginx `keepalive`, enough for a busy worker's reuse, bounded so that a burst's
/// connections (and their buffers) do not all stay open after it.
const DEFAULT_IDLE_CONNECTIONS: usize = 128;
const MAX_IDLE_CONNECTIONS: i64 = 65_535;
/// Upper bound for `server.workers`: each worker is an OS thread with its own runtime.
const MAX_WORKERS: i64 = 1024;

/// One problem in the configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, as the caller named it.
    pub file: String,
    /// 1-based; 0 when the problem has no position in the file (unreadable file, a bad
    /// `TOLLGATE_DATABASE_URL`).
    pub line: usize,
    /// 1-based, in characters; 0 when `line` is 0.
    pub col: usize,
    /// Dotted path of the offending field, e.g. `routes[2].limits[0].window`; empty for a TOML
    /// syntax error or an unreadable file.
    pub field: String,
    /// What is wrong. Never contains the value of `keys.secret` or `store.url`.
    pub message: String,
}

impl fmt::Display for ConfigError {
    /// `FILE:LINE:COL: field.path: message`; the position is left out when there is none and
    /// the field when it is empty (`FILE: cannot read: ...`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if self.line > 0 {
            write!(f, ":{}:{}", self.line, self.col)?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        // One problem, one line: a value quoted into the message may hold line breaks or
        // other control characters, which are shown escaped.
        f.write_str(": ")?;
        for c in self.message.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                write!(f, "{c}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one file, in file order. Never empty when returned by the loader.
#[derive(Debug)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    /// One error per line, no trailing newline.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Reads and validates the file at `path`. `env` looks up environment variables for `${NAME}`
/// and `TOLLGATE_DATABASE_URL`; the process environment is never read directly.
pub fn load_file(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    match std::fs::read_to_string(path) {
        Ok(text) => load_str(path, &text, env),
        Err(e) => Err(ConfigErrors(vec![ConfigError {
            file: path.display().to_string(),
            line: 0,
            col: 0,
            field: String::new(),
            message: format!("cannot read: {e}"),
        }])),
    }
}

/// Validates `text` as if read from `path`. `path` is used in messages and to resolve relative
/// `cert`, `key` and `ca_file` paths (against the directory containing `path`).
///
/// Defaults applied when a field is absent:
/// - `server.listen`: `["0.0.0.0:8080"]`, but only when `tls_listen` is absent too;
///   `server.tls_listen`, `server.trusted_proxies`, `server.certs`: empty;
///   `server.ipv6_prefix`: 64; `server.header_read_timeout`: 10s; `server.idle_timeout`: 60s;
///   `server.max_connections`: 10000; `server.shutdown_timeout`: 30s;
///   `server.rate_limit_headers`: `"draft"`; `server.underscores_in_headers`: false;
///   `[server.proxy_protocol]`: none (no peer sends a PROXY header).
/// - `[admin]`: no admin listener.
/// - `store.url`: none (memory store) unless `TOLLGATE_DATABASE_URL` is set and non-empty;
///   `store.pool_size`: 16; `store.timeout`: 100ms; `store.on_error`: `"allow"`;
///   `store.migrate`: true; `store.sweep_interval`: 60s; `store.synchronous_commit`: `"off"`;
///   `store.memory_buckets`: 1,000,000.
/// - `keys.secret`: none (plain SHA-256 digests).
/// - upstreams: `connect_timeout` 2s, `response_timeout` 30s, `preserve_host` true,
///   `ca_file` none, `http2` false, `max_idle_connections` 128, `fail_timeout` 10s.
/// - routes: `host` any, `path_prefix` `"/"`, `methods` any, `strip_prefix` false,
///   `on_store_error` = `store.on_error`, `shadow` false, `limits` none, `reject` none
///   (inside `[routes.reject]`: `status` 429, `content_type` none, `body` empty).
/// - limits: `scope` = the route's name, `shadow` false.
pub fn load_str(
    path: &Path,
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    let mut cx = Cx::new(path, text, env);
    let doc = match ImDocument::parse(text) {
        Ok(doc) => doc,
        Err(e) => {
            // toml_edit's message can span lines; one error is one line.
            let message = e
                .message()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(": ");
            cx.error(&e.span(), "", format!("TOML syntax error: {message}"));
            return Err(cx.into_errors());
        }
    };

    let root = TableReader::new(doc.as_table(), String::new(), Some(0..0), ROOT_KEYS);
    let server = read_server(&mut cx, root.get("server"));
    let admin = read_admin(&mut cx, root.get("admin"));
    let store = read_store(&mut cx, root.get("store"));
    let keys = read_keys(&mut cx, root.get("keys"));
    let upstreams = read_upstreams(&mut cx, root.get("upstreams"));
    let routes = read_routes(&mut cx, root.get("routes"), &upstreams.index);
    root.finish(&mut cx);
    if let (Some(server), Some(Some(admin))) = (&server, &admin) {
        check_admin_not_shared(&mut cx, server, admin.listen, &doc);
    }

    let (server, admin, store, keys, upstreams, routes) =
        match (server, admin, store, keys, upstreams.list, routes) {
            (Some(s), Some(a), Some(st), Some(k), Some(u), Some(r)) if cx.errors.is_empty() => {
                (s, a, st, k, u, r)
            }
            _ => {
                if cx.errors.is_empty() {
                    // A reader gave up without saying why: a bug here, but never a panic.
                    cx.error(&Some(0..0), "", "internal error: invalid configuration");
                }
                return Err(cx.into_errors());
            }
        };
    Ok(Config {
        source: path.to_path_buf(),
        server,
        admin,
        store,
        keys,
        upstreams,
        routes,
    })
}

// ---------------------------------------------------------------------------------------------
// Error collection and positions

/// The state of one load: the source (for positions), the environment, and the errors so far.
struct Cx<'a> {
    file: String,
    src: &'a str,
    /// Byte offset of the start of each line.
    line_starts: Vec<usize>,
    /// Relative paths in the file are resolved against this directory.
    base_dir: PathBuf,
    env: Env<'a>,
    errors: Vec<ConfigError>,
}

impl<'a> Cx<'a> {
    fn new(path: &Path, src: &'a str, env: Env<'a>) -> Self {
        let line_starts = std::iter::once(0)
            .chain(src.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Cx {
            file: path.display().to_string(),
            src,
            line_starts,
            base_dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            env,
            errors: Vec::new(),
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    fn position(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.src.len());
        let line = self.line_starts.partition_point(|&s| s <= offset).max(1);
        let start = self.line_starts.get(line - 1).copied().unwrap_or(0);
        let col = match self.src.get(start..offset) {
            Some(s) => s.chars().count(),
            // Not on a char boundary (never from toml_edit): count bytes rather than fail.
            None => offset - start,
        };
        (line, col + 1)
    }

    fn error(&mut self, span: &Span, field: &str, message: impl Into<String>) {
        let (line, col) = self.position(span.as_ref().map_or(0, |r| r.start));
        self.errors.push(ConfigError {
            file: self.file.clone(),
            line,
            col,
            field: field.to_string(),
            message: message.into(),
        });
    }

    /// An error that has no place in the file (it comes from the environment).
    fn error_unplaced(&mut self, field: &str, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.clone(),
            line: 0,
            col: 0,
            field: field.to_string(),
            message: message.into(),
        });
    }

    fn into_errors(mut self) -> ConfigErrors {
        // Readers run section by section and cross-checks run last; file order is what an
        // operator fixing the file wants. The sort is stable, so errors at one place keep
        // the order they were found in.
        self.errors.sort_by_key(|e| (e.line, e.col));
        ConfigErrors(self.errors)
    }

    fn type_error(&mut self, node: &Node<'_>, expected: &str) {
        let found = node.type_name();
        self.error(
            &node.span,
            &node.path,
            format!("expected {expected}, found {found}"),
        );
    }

    // -----------------------------------------------------------------------------------------
    // Typed values. Each reports its own errors and returns None after reporting.

    /// A string, after `${NAME}` expansion.
    fn string(&mut self, node: &Node<'_>) -> Option<String> {
        let Some(Value::String(s)) = node.value() else {
            self.type_error(node, "a string");
            return None;
        };
        match expand(s.value(), self.env) {
            Ok(v) => Some(v),
            Err(problems) => {
                for p in problems {
                    self.error(&node.span, &node.path, p);
                }
                None
            }
        }
    }

    fn integer(&mut self, node: &Node<'_>, min: i64, max: i64) -> Option<i64> {
        let Some(Value::Integer(i)) = node.value() else {
            self.type_error(node, "an integer");
            return None;
        };
        let i = *i.value();
        if i < min || i > max {
            self.error(
                &node.span,
                &node.path,
                format!("must be between {min} and {max}, got {i}"),
            );
            return None;
        }
        Some(i)
    }

    fn boolean(&mut self, node: &Node<'_>) -> Option<bool> {
        match node.value() {
            Some(Value::Boolean(b)) => Some(*b.value()),
            _ => {
                self.type_error(node, "a boolean (true or false)");
                None
            }
        }
    }

    /// One of a fixed set of strings.
    fn choice<T: Copy>(&mut self, node: &Node<'_>, options: &[(&str, T)]) -> Option<T> {
        let s = self.string(node)?;
        if let Some((_, v)) = options.iter().find(|(name, _)| *name == s) {
            return Some(*v);
        }
        let names: Vec<String> = options.iter().map(|(n, _)| format!("{n:?}")).collect();
        self.error(
            &node.span,
            &node.path,
            format!("expected one of {}, got {s:?}", names.join(", ")),
        );
        None
    }

    /// A duration string, greater than zero and at most 366 days.
    fn duration(&mut self, node: &Node<'_>) -> Option<Duration> {
        let s = self.string(node)?;
        match parse_duration(&s) {
            Ok(d) if d.is_zero() => {
                self.error(&node.span, &node.path, "must be greater than zero");
                None
            }
            Ok(d) if d > Duration::from_secs(MAX_DURATION_SECS) => {
                self.error(&node.span, &node.path, "must be at most 366d");
                None
            }
            Ok(d) => Some(d),
            Err(msg) => {
                self.error(&node.span, &node.path, msg);
                None
            }
        }
    }

    /// An optional size (`"10MiB"`): `Some(None)` when absent.
    fn optional_size(&mut self, node: Option<Node<'_>>) -> Option<Option<u64>> {
        let Some(node) = node else {
            return Some(None);
        };
        let s = self.string(&node)?;
        match parse_size(&s) {
            Ok(0) => {
                self.error(&node.span, &node.path, "must be greater than zero");
                None
            }
            Ok(n) => Some(Some(n)),
            Err(msg) => {
                self.error(&node.span, &node.path, msg);
                None
            }
        }
    }

    /// An optional duration with a default.
    fn duration_or(&mut self, node: Option<Node<'_>>, default: Duration) -> Option<Duration> {
        match node {
            Some(n) => self.duration(&n),
            None => Some(default),
        }
    }

    fn bool_or(&mut self, node: Option<Node<'_>>, default: bool) -> Option<bool> {
        match node {
            Some(n) => self.boolean(&n),
            None => Some(default),
        }
    }

    /// The elements of an array, each with its own path and span.
    fn array<'d>(&mut self, node: &Node<'d>) -> Option<Vec<Node<'d>>> {
        let Some(Value::Array(a)) = node.value() else {
            self.type_error(node, "an array");
            return None;
        };
        Some(
            a.iter()
                .enumerate()
                .map(|(i, v)| Node {
                    raw: Raw::Value(v),
                    path: format!("{}[{i}]", node.path),
                    span: v.span().or_else(|| node.span.clone()),
                })
                .collect(),
        )
    }

    /// An array whose elements are each parsed by `parse`; None if anything was wrong (all
    /// bad elements are reported, not just the first).
    fn list<'d, T>(
        &mut self,
        node: &Node<'d>,
        mut parse: impl FnMut(&mut Self, &Node<'d>) -> Option<T>,
    ) -> Option<Vec<T>> {
        let elems = self.array(node)?;
        let mut out = Vec::with_capacity(elems.len());
        let mut ok = true;
        for e in &elems {
            match parse(self, e) {
                Some(v) => out.push(v),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// A `[[name]]` array of tables (or an array of inline tables, which TOML treats alike).
    fn tables<'d>(&mut self, node: &Node<'d>) -> Option<Vec<Node<'d>>> {
        match node.raw {
            Raw::Item(Item::ArrayOfTables(a)) => Some(
                a.iter()
                    .enumerate()
                    .map(|(i, t)| Node {
                        raw: Raw::Table(t),
                        path: format!("{}[{i}]", node.path),
                        span: t.span().or_else(|| node.span.clone()),
                    })
                    .collect(),
            ),
            _ if matches!(node.value(), Some(Value::Array(_))) => self.array(node),
            _ => {
                let expected = format!("an array of tables ([[{}]])", toml_header(&node.path));
                self.type_error(node, &expected);
                None
            }
        }
    }

    /// A path to a file that must exist and be readable, resolved against the config file's
    /// directory when relative.
    fn readable_file(&mut self, node: &Node<'_>) -> Option<PathBuf> {
        let s = self.string(node)?;
        if s.is_empty() {
            self.error(&node.span, &node.path, "must not be empty");
            return None;
        }
        let path = self.base_dir.join(&s);
        // Opening proves readability for this user; the metadata check catches directories,
        // which open fine on Unix but cannot be read as PEM.
        let problem = match std::fs::File::open(&path).and_then(|f| f.metadata()) {
            Ok(m) if m.is_file() => None,
            Ok(_) => Some("is not a regular file".to_string()),
            Err(e) => Some(e.to_string()),
        };
        match problem {
            None => Some(path),
            Some(p) => {
                self.error(
                    &node.span,
                    &node.path,
                    format!("cannot read {}: {p}", path.display()),
                );
                None
            }
        }
    }

    fn socket_addr(&mut self, node: &Node<'_>) -> Option<SocketAddr> {
        let s = self.string(node)?;
        match SocketAddr::from_str(&s) {
            Ok(a) => Some(a),
            Err(_) => {
                self.error(
                    &node.span,
                    &node.path,
                    format!(
                        "{s:?} is not a socket address; expected IP:PORT, e.g. \"0.0.0.0:8080\" or \"[::1]:8443\""
                    ),
                );
                None
            }
        }
    }

    /// A name that ends up in metric labels and bucket strings.
    fn name_value(&mut self, node: &Node<'_>, what: &str) -> Option<String> {
        let s = self.string(node)?;
        if let Err(msg) = check_name(&s, what) {
            self.error(&node.span, &node.path, msg);
            return None;
        }
        Some(s)
    }
}

// ---------------------------------------------------------------------------------------------
// Walking the document

/// What a [`Node`] points at: toml_edit has three shapes for "a thing at a path".
#[derive(Clone, Copy)]
enum Raw<'d> {
    Item(&'d Item),
    Value(&'d Value),
    /// An element of an array of tables.
    Table(&'d Table),
}

/// A value in the document with its field path and position.
#[derive(Clone)]
struct Node<'d> {
    raw: Raw<'d>,
    path: String,
    /// The value's span, or its key's when the value has none (implicit and dotted tables).
    span: Span,
}

impl<'d> Node<'d> {
    fn value(&self) -> Option<&'d Value> {
        match self.raw {
            Raw::Item(Item::Value(v)) | Raw::Value(v) => Some(v),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self.raw {
            Raw::Item(i) => i.type_name(),
            Raw::Value(v) => v.type_name(),
            Raw::Table(_) => "table",
        }
    }

    fn table_like(&self) -> Option<&'d dyn TableLike> {
        match self.raw {
            Raw::Item(i) => i.as_table_like(),
            Raw::Value(Value::InlineTable(t)) => Some(t),
            Raw::Value(_) => None,
            Raw::Table(t) => Some(t),
        }
    }
}

/// Reads one table: hands out its fields by name and, at the end, reports every key nobody
/// asked for. A typo must be an error, not a silently ignored limit.
struct TableReader<'d> {
    /// None for an absent table, which then yields only defaults.
    table: Option<&'d dyn TableLike>,
    path: String,
    /// Where "missing required field" points: the table's header.
    span: Span,
    known: &'static [&'static str],
}

impl<'d> TableReader<'d> {
    fn new(
        table: &'d dyn TableLike,
        path: String,
        span: Span,
        known: &'static [&'static str],
    ) -> Self {
        TableReader {
            table: Some(table),
            path,
            span,
            known,
        }
    }

    /// A reader over `node`, which must be a table; an absent node reads as an empty table.
    /// None (after reporting) when the node is something else.
    fn open(
        cx: &mut Cx<'_>,
        node: Option<&Node<'d>>,
        path: &str,
        known: &'static [&'static str],
    ) -> Option<Self> {
        let Some(node) = node else {
            return Some(TableReader {
                table: None,
                path: path.to_string(),
                span: None,
                known,
            });
        };
        match node.table_like() {
            Some(t) => Some(TableReader::new(
                t,
                node.path.clone(),
                node.span.clone(),
                known,
            )),
            None => {
                cx.type_error(node, "a table");
                None
            }
        }
    }

    fn field_path(&self, key: &str) -> String {
        join_path(&self.path, key)
    }

    fn get(&self, key: &str) -> Option<Node<'d>> {
        debug_assert!(
            self.known.contains(&key),
            "{key} missing from the known list"
        );
        let (k, item) = self.table?.get_key_value(key)?;
        if item.is_none() {
            return None;
        }
        Some(Node {
            raw: Raw::Item(item),
            path: self.field_path(key),
            span: item.span().or_else(|| k.span()),
        })
    }

    fn require(&self, cx: &mut Cx<'_>, key: &str) -> Option<Node<'d>> {
        let node = self.get(key);
        if node.is_none() {
            cx.error(&self.span, &self.field_path(key), "missing required field");
        }
        node
    }

    /// Reports every key that is not in the known list.
    fn finish(self, cx: &mut Cx<'_>) {
        let Some(table) = self.table else { return };
        for (key, item) in table.iter() {
            if self.known.contains(&key) {
                continue;
            }
            let span = table
                .key(key)
                .and_then(|k| k.span())
                .or_else(|| item.span())
                .or_else(|| self.span.clone());
            let hint = match closest(key, self.known) {
                Some(k) => format!("; did you mean `{k}`?"),
                None => format!("; expected one of: {}", self.known.join(", ")),
            };
            cx.error(&span, &self.field_path(key), format!("unknown field{hint}"));
        }
    }
}

fn join_path(parent: &str, key: &str) -> String {
    // Keys that are not bare TOML keys are quoted, so the path reads back as TOML.
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let key = if bare {
        key.to_string()
    } else {
        format!("{key:?}")
    };
    if parent.is_empty() {
        key
    } else {
        format!("{parent}.{key}")
    }
}

/// A field path as a TOML table header: `routes[0].limits` -> `routes.limits`.
fn toml_header(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => in_index = true,
            ']' => in_index = false,
            _ if !in_index => out.push(c),
            _ => {}
        }
    }
    out
}

/// The known key closest to a typo, if it is close enough to be a plausible misspelling.
fn closest<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    known
        .iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|(d, k)| *d <= if k.len() <= 4 { 1 } else { 2 })
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let subst = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = subst.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

// ---------------------------------------------------------------------------------------------
// Sections

const ROOT_KEYS: &[&str] = &["server", "admin", "store", "keys", "upstreams", "routes"];
const SERVER_KEYS: &[&str] = &[
    "listen",
    "tls_listen",
    "trusted_proxies",
    "ipv6_prefix",
    "header_read_timeout",
    "idle_timeout",
    "max_connections",
    "shutdown_timeout",
    "rate_limit_headers",
    "underscores_in_headers",
    "max_body_size",
    "workers",
    "certs",
    "proxy_protocol",
];
const PROXY_PROTOCOL_KEYS: &[&str] = &["from"];
const CERT_KEYS: &[&str] = &["cert", "key"];
const ADMIN_KEYS: &[&str] = &["listen"];
const STORE_KEYS: &[&str] = &[
    "url",
    "ca_file",
    "pool_size",
    "timeout",
    "on_error",
    "migrate",
    "sweep_interval",
    "synchronous_commit",
    "memory_buckets",
];
const KEYS_KEYS: &[&str] = &["secret"];
const UPSTREAM_KEYS: &[&str] = &[
    "url",
    "urls",
    "connect_timeout",
    "response_timeout",
    "preserve_host",
    "ca_file",
    "http2",
    "max_idle_connections",
    "fail_timeout",
];
const ROUTE_KEYS: &[&str] = &[
    "name",
    "host",
    "path_prefix",
    "methods",
    "upstream",
    "strip_prefix",
    "on_store_error",
    "shadow",
    "limits",
    "reject",
    "max_body_size",
];
const LIMIT_KEYS: &[&str] = &["key", "requests", "window", "scope", "shadow", "algorithm"];
const REJECT_KEYS: &[&str] = &["status", "content_type", "body"];

const STORE_POLICIES: &[(&str, StoreErrorPolicy)] = &[
    ("allow", StoreErrorPolicy::Allow),
    ("deny", StoreErrorPolicy::Deny),
    ("local", StoreErrorPolicy::Local),
];

/// `[server]`. Defaults are listed on [`load_str`].
fn read_server(cx: &mut Cx<'_>, node: Option<Node<'_>>) -> Option<ServerConfig> {
    let t = TableReader::open(cx, node.as_ref(), "server", SERVER_KEYS)?;

    let listen_node = t.get("listen");
    let tls_node = t.get("tls_listen");
    let listen = match &listen_node {
        Some(n) => cx.list(n, Cx::socket_addr),
        // One plain listener by default, unless the file asks for TLS only.
        None if tls_node.is_none() => Some(vec![SocketAddr::from(([0, 0, 0, 0], 8080))]),
        None => Some(Vec::new()),
    };
    let tls_listen = match &tls_node {
        Some(n) => cx.list(n, Cx::socket_addr),
        None => Some(Vec::new()),
    };
    if let (Some(l), Some(tl)) = (&listen, &tls_listen) {
        if l.is_empty() && tl.is_empty() {
            let span = listen_node
                .as_ref()
                .or(tls_node.as_ref())
                .and_then(|n| n.span.clone());
            cx.error(
                &span,
                "server.listen",
                "no listeners: listen and tls_listen are both empty",
            );
        }
        check_duplicate_addrs(cx, &[(listen_node.as_ref(), l), (tls_node.as_ref(), tl)]);
    }

    let trusted_proxies = match t.get("trusted_proxies") {
        Some(n) => cidr_list(cx, &n),
        None => Some(Vec::new()),
    };
    let proxy_protocol = match t.get("proxy_protocol") {
        Some(n) => read_proxy_protocol(cx, &n),
        None => Some(None),
    };
    let ipv6_prefix = match t.get("ipv6_prefix") {
        Some(n) => cx.integer(&n, 1, 128).and_then(|i| u8::try_from(i).ok()),
        None => Some(64),
    };
    let header_read_timeout = cx.duration_or(t.get("header_read_timeout"), Duration::from_secs(10));
    let idle_timeout = cx.duration_or(t.get("idle_timeout"), Duration::from_secs(60));
    let max_connections = match t.get("max_connections") {
        Some(n) => cx
            .integer(&n, 1, MAX_CONNECTIONS)
            .and_then(|i| usize::try_from(i).ok()),
        None => Some(10_000),
    };
    let shutdown_timeout = cx.duration_or(t.get("shutdown_timeout"), Duration::from_secs(30));
    // Absent = one worker per CPU the process may run on, decided at start.
    let workers = match t.get("workers") {
        Some(n) => cx
            .integer(&n, 1, MAX_WORKERS)
            .and_then(|i| usize::try_from(i).ok())
            .map(Some),
        None => Some(None),
    };
    let rate_limit_headers = match t.get("rate_limit_headers") {
        Some(n) => cx.choice(
            &n,
            &[
                ("draft", RateLimitHeaders::Draft),
                ("legacy", RateLimitHeaders::Legacy),
                ("both", RateLimitHeaders::Both),
                ("none", RateLimitHeaders::None),
            ],
        ),
        None => Some(RateLimitHeaders::Draft),
    };
    let underscores_in_headers = cx.bool_or(t.get("underscores_in_headers"), false);
    let max_body_size = cx.optional_size(t.get("max_body_size"));

    let certs_node = t.get("certs");
    let certs = match &certs_node {
        Some(n) => read_certs(cx, n),
        None => Some(Vec::new()),
    };
    if let (Some(tl), Some(tn)) = (&tls_listen, &tls_node) {
        if !tl.is_empty() && certs_node.is_none() {
            cx.error(
                &tn.span,
                &tn.path,
                "TLS listeners need at least one [[server.certs]] entry",
            );
        }
    }
    if let (Some(c), Some(cn)) = (&certs, &certs_node) {
        if c.is_empty() && tls_listen.as_ref().is_some_and(|tl| !tl.is_empty()) {
            cx.error(
                &cn.span,
                &cn.path,
                "TLS listeners need at least one certificate",
            );
        }
    }
    t.finish(cx);

    Some(ServerConfig {
        listen: listen?,
        tls_listen: tls_listen?,
        trusted_proxies: trusted_proxies?,
        ipv6_prefix: ipv6_prefix?,
        header_read_timeout: header_read_timeout?,
        idle_timeout: idle_timeout?,
        max_connections: max_connections?,
        shutdown_timeout: shutdown_timeout?,
        rate_limit_headers: rate_limit_headers?,
        underscores_in_headers: underscores_in_headers?,
        max_body_size: max_body_size?,
        workers: workers?,
        certs: certs?,
        proxy_protocol: proxy_protocol?,
    })
}

/// A list of CIDRs (or bare addresses), each bad one reported at its place.
fn cidr_list(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Vec<IpNet>> {
    cx.list(node, |cx, e| {
        let s = cx.string(e)?;
        match parse_cidr(&s) {
            Ok(net) => Some(net),
            Err(msg) => {
                cx.error(&e.span, &e.path, msg);
                None
            }
        }
    })
}

/// `[server.proxy_protocol]` (SPEC 4): `from` is required and not empty, since a table that
/// names no balancer would do nothing, which is more likely a mistake than a wish.
fn read_proxy_protocol(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Option<ProxyProtocolConfig>> {
    let t = TableReader::open(cx, Some(node), &node.path, PROXY_PROTOCOL_KEYS)?;
    let from = t.require(cx, "from").and_then(|n| {
        let nets = cidr_list(cx, &n)?;
        if nets.is_empty() {
            cx.error(
                &n.span,
                &n.path,
                "empty: list the balancers' addresses, or remove [server.proxy_protocol]",
            );
            return None;
        }
        Some(nets)
    });
    t.finish(cx);
    Some(Some(ProxyProtocolConfig { from: from? }))
}

/// Two listeners on one address would fail at bind time with a vaguer message; port 0 is
/// exempt because each such listener gets its own port.
fn check_duplicate_addrs(cx: &mut Cx<'_>, lists: &[(Option<&Node<'_>>, &Vec<SocketAddr>)]) {
    let mut seen: HashMap<SocketAddr, String> = HashMap::new();
    for (node, addrs) in lists {
        let Some(node) = node else { continue };
        let Some(Value::Array(arr)) = node.value() else {
            continue;
        };
        for ((i, addr), v) in addrs.iter().enumerate().zip(arr.iter()) {
            let path = format!("{}[{i}]", node.path);
            if addr.port() == 0 {
                continue;
            }
            if let Some(first) = seen.get(addr) {
                let msg = format!("{addr} is already listed at {first}");
                cx.error(&v.span(), &path, msg);
            } else {
                seen.insert(*addr, path);
            }
        }
    }
}

fn check_admin_not_shared(
    cx: &mut Cx<'_>,
    server: &ServerConfig,
    admin: SocketAddr,
    doc: &ImDocument<&str>,
) {
    if admin.port() == 0
        || !server
            .listen
            .iter()
            .chain(&server.tls_listen)
            .any(|a| *a == admin)
    {
        return;
    }
    let span = doc
        .get("admin")
        .and_then(|a| a.as_table_like())
        .and_then(|t| t.get("listen"))
        .and_then(Item::span);
    cx.error(
        &span,
        "admin.listen",
        format!("{admin} is also a server listener"),
    );
}

fn read_certs(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Vec<CertConfig>> {
    let tables = cx.tables(node)?;
    let mut out = Vec::new();
    let mut ok = true;
    for n in &tables {
        let Some(t) = TableReader::open(cx, Some(n), &n.path, CERT_KEYS) else {
            ok = false;
            continue;
        };
        let cert = t.require(cx, "cert").and_then(|n| cx.readable_file(&n));
        let key = t.require(cx, "key").and_then(|n| cx.readable_file(&n));
        t.finish(cx);
        match (cert, key) {
            (Some(cert), Some(key)) => out.push(CertConfig { cert, key }),
            _ => ok = false,
        }
    }
    ok.then_some(out)
}

/// `[admin]`: Some(None) when absent.
fn read_admin(cx: &mut Cx<'_>, node: Option<Node<'_>>) -> Option<Option<AdminConfig>> {
    if node.is_none() {
        return Some(None);
    }
    let t = TableReader::open(cx, node.as_ref(), "admin", ADMIN_KEYS)?;
    let listen = t.require(cx, "listen").and_then(|n| cx.socket_addr(&n));
    t.finish(cx);
    Some(Some(AdminConfig { listen: listen? }))
}

/// `[store]`, then the `TOLLGATE_DATABASE_URL` override.
fn read_store(cx: &mut Cx<'_>, node: Option<Node<'_>>) -> Option<StoreConfig> {
    let t = TableReader::open(cx, node.as_ref(), "store", STORE_KEYS)?;

    // The trust root for TLS to the database must hold PEM certificates: a file that does
    // not would fail every connection attempt, long after `check` said OK.
    let ca_file = match t.get("ca_file") {
        Some(n) => {
            cx.readable_file(&n)
                .and_then(|path| match crate::store::pg_tls::read_roots(&path) {
                    Ok(_) => Some(Some(path)),
                    Err(m) => {
                        cx.error(&n.span, &n.path, m);
                        None
                    }
                })
        }
        None => Some(None),
    };
    // An unreadable ca_file is reported on its own line; the URL is then checked as if
    // there were none.
    let ca_path = ca_file.clone().flatten();
    let check_url = |url: &str| check_postgres_url(url, ca_path.as_deref());

    // The file's URL is checked even when the environment overrides it, so a file that
    // passes `check` on one machine is valid everywhere.
    let url = match t.get("url") {
        Some(n) => cx.string(&n).and_then(|u| match check_url(&u) {
            Ok(()) => Some(Some(u)),
            Err(m) => {
                cx.error(&n.span, &n.path, m);
                None
            }
        }),
        None => Some(None),
    };
    let url = match (cx.env)(DATABASE_URL_ENV).filter(|u| !u.is_empty()) {
        Some(env_url) => match check_url(&env_url) {
            Ok(()) => url.map(|_| Some(env_url)),
            Err(m) => {
                cx.error_unplaced("store.url", format!("{DATABASE_URL_ENV}: {m}"));
                None
            }
        },
        None => url,
    };

    let pool_size = match t.get("pool_size") {
        Some(n) => cx.integer(&n, 1, 1024).and_then(|i| u32::try_from(i).ok()),
        None => Some(16),
    };
    let timeout = cx.duration_or(t.get("timeout"), Duration::from_millis(100));
    let on_error = match t.get("on_error") {
        Some(n) => cx.choice(&n, STORE_POLICIES),
        None => Some(StoreErrorPolicy::Allow),
    };
    let migrate = cx.bool_or(t.get("migrate"), true);
    let sweep_interval = cx.duration_or(t.get("sweep_interval"), Duration::from_secs(60));
    let synchronous_commit = match t.get("synchronous_commit") {
        Some(n) => cx.choice(&n, &[("on", true), ("off", false)]),
        None => Some(false),
    };
    // Accepted with a database URL too (SPEC 2 shows both in one file, and the same file may
    // serve a memory-store instance elsewhere); the server warns at start that it is ignored.
    let memory_buckets = match t.get("memory_buckets") {
        Some(n) => cx
            .integer(&n, 1, MAX_MEMORY_BUCKETS as i64)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(NonZeroUsize::new),
        None => NonZeroUsize::new(DEFAULT_MEMORY_BUCKETS),
    };
    t.finish(cx);

    Some(StoreConfig {
        url: url?,
        pool_size: pool_size?,
        timeout: timeout?,
        on_error: on_error?,
        migrate: migrate?,
        sweep_interval: sweep_interval?,
        synchronous_commit: synchronous_commit?,
        memory_buckets: memory_buckets?,
        ca_file: ca_file?,
    })
}

/// Ok when the store can be built from `url` and `ca_file` (`store.ca_file`): tokio-postgres
/// accepts the URL, its TLS options (`sslmode`, `sslrootcert`) make sense together and the
/// trust root holds certificates (SPEC 6). The message never contains the URL or any part of
/// it but option names: it may carry a password.
fn check_postgres_url(url: &str, ca_file: Option<&Path>) -> Result<(), String> {
    if url.is_empty() {
        return Err("must not be empty (remove it to use the memory store)".to_string());
    }
    let (_, tls) = crate::store::pg_tls::parse(url, ca_file)?;
    // Reads an `sslrootcert` file; a `store.ca_file` was read above, and is again here.
    tls.connector().map(|_| ())
}

/// `[keys]`.
fn read_keys(cx: &mut Cx<'_>, node: Option<Node<'_>>) -> Option<KeysConfig> {
    let t = TableReader::open(cx, node.as_ref(), "keys", KEYS_KEYS)?;
    let secret = match t.get("secret") {
        Some(n) => match cx.string(&n) {
            Some(s) if s.is_empty() => {
                // An empty HMAC key is a key nobody meant: most likely an empty variable.
                cx.error(
                    &n.span,
                    &n.path,
                    "must not be empty (remove it to use plain SHA-256)",
                );
                None
            }
            Some(s) => Some(Some(s.into_bytes())),
            None => None,
        },
        None => Some(None),
    };
    t.finish(cx);
    Some(KeysConfig { secret: secret? })
}

/// The upstreams in file order, and every name under `[upstreams]` (valid or not) with its
/// index, so a route naming a broken upstream is not also told the upstream does not exist.
struct Upstreams {
    list: Option<Vec<Arc<UpstreamConfig>>>,
    index: HashMap<String, usize>,
}

fn read_upstreams(cx: &mut Cx<'_>, node: Option<Node<'_>>) -> Upstreams {
    let mut result = Upstreams {
        list: Some(Vec::new()),
        index: HashMap::new(),
    };
    let Some(node) = node else { return result };
    let Some(table) = node.table_like() else {
        cx.type_error(&node, "a table of [upstreams.NAME] tables");
        result.list = None;
        return result;
    };
    let mut list = Vec::new();
    let mut ok = true;
    for (i, (name, item)) in table.iter().enumerate() {
        result.index.insert(name.to_string(), i);
        let key_span = table.key(name).and_then(|k| k.span());
        let n = Node {
            raw: Raw::Item(item),
            path: join_path(&node.path, name),
            span: item.span().or_else(|| key_span.clone()),
        };
        let name_ok = match check_name(name, "upstream name") {
            Ok(()) => true,
            Err(msg) => {
                cx.error(&key_span, &n.path, msg);
                false
            }
        };
        match read_upstream(cx, name, &n) {
            Some(u) if name_ok => list.push(Arc::new(u)),
            _ => ok = false,
        }
    }
    result.list = ok.then_some(list);
    result
}

fn read_upstream(cx: &mut Cx<'_>, name: &str, node: &Node<'_>) -> Option<UpstreamConfig> {
    let t = TableReader::open(cx, Some(node), &node.path, UPSTREAM_KEYS)?;
    let urls = match (t.get("url"), t.get("urls")) {
        (Some(u), None) => cx
            .string(&u)
            .and_then(|s| upstream_origin(cx, &u, &s))
            .map(|u| vec![u]),
        (None, Some(us)) => match cx.list(&us, |cx, e| {
            cx.string(e).and_then(|s| upstream_origin(cx, e, &s))
        }) {
            Some(v) if v.is_empty() => {
                cx.error(&us.span, &us.path, "must list at least one URL");
                None
            }
            other => other,
        },
        (Some(_), Some(us)) => {
            cx.error(&us.span, &us.path, "give either url or urls, not both");
            None
        }
        (None, None) => {
            cx.error(
                &t.span,
                &t.field_path("url"),
                "missing required field (url, or urls for several origins)",
            );
            None
        }
    };
    let connect_timeout = cx.duration_or(t.get("connect_timeout"), Duration::from_secs(2));
    let response_timeout = cx.duration_or(t.get("response_timeout"), Duration::from_secs(30));
    let preserve_host = cx.bool_or(t.get("preserve_host"), true);
    let ca_file = match t.get("ca_file") {
        Some(n) => cx.readable_file(&n).map(Some),
        None => Some(None),
    };
    let http2 = cx.bool_or(t.get("http2"), false);
    let max_idle_connections = match t.get("max_idle_connections") {
        Some(n) => cx
            .integer(&n, 0, MAX_IDLE_CONNECTIONS)
            .and_then(|i| usize::try_from(i).ok()),
        None => Some(DEFAULT_IDLE_CONNECTIONS),
    };
    // nginx's default; meaningful only with several origins, harmless with one.
    let fail_timeout = cx.duration_or(t.get("fail_timeout"), Duration::from_secs(10));
    t.finish(cx);
    Some(UpstreamConfig {
        name: name.to_string(),
        urls: urls?,
        connect_timeout: connect_timeout?,
        response_timeout: response_timeout?,
        preserve_host: preserve_host?,
        ca_file: ca_file?,
        http2: http2?,
        max_idle_connections: max_idle_connections?,
        fail_timeout: fail_timeout?,
    })
}

/// An upstream URL reduced to its origin, canonically `scheme://authority/`.
fn upstream_origin(cx: &mut Cx<'_>, node: &Node<'_>, s: &str) -> Option<Uri> {
    match parse_origin(s) {
        Ok(u) => Some(u),
        Err(msg) => {
            cx.error(&node.span, &node.path, msg);
            None
        }
    }
}

/// Messages do not repeat the URL: the position points at it, and a URL may carry a
/// `user:password@` part.
fn parse_origin(s: &str) -> Result<Uri, String> {
    let uri = Uri::from_str(s).map_err(|e| format!("not a valid URL: {e}"))?;
    let scheme = match uri.scheme() {
        Some(sc) if *sc == Scheme::HTTP || *sc == Scheme::HTTPS => sc.clone(),
        _ => return Err("an upstream URL must start with http:// or https://".to_string()),
    };
    let Some(authority) = uri.authority() else {
        return Err("the URL has no host".to_string());
    };
    if authority.as_str().contains('@') {
        return Err("user info (user:password@) in upstream URLs is not supported".to_string());
    }
    if authority.host().is_empty() {
        return Err("the URL has no host".to_string());
    }
    if !matches!(uri.path(), "" | "/") {
        return Err(
            "the URL has a path; an upstream is an origin (scheme and authority) only, the request path is forwarded as is"
                .to_string(),
        );
    }
    if uri.query().is_some() {
        return Err("the URL has a query; an upstream is an origin only".to_string());
    }
    Uri::builder()
        .scheme(scheme)
        .authority(authority.clone())
        .path_and_query("/")
        .build()
        .map_err(|e| format!("not a valid URL: {e}"))
}

/// The first limit seen for a bucket prefix, for the cross-route check.
struct BucketOwner {
    path: String,
    route: String,
    requests: u32,
    window_secs: u32,
    algorithm: Algorithm,
}

fn read_routes(
    cx: &mut Cx<'_>,
    node: Option<Node<'_>>,
    upstreams: &HashMap<String, usize>,
) -> Option<Vec<RouteConfig>> {
    let Some(node) = node else {
        return Some(Vec::new());
    };
    let tables = cx.tables(&node)?;
    let mut routes = Vec::new();
    let mut ok = true;
    let mut names: HashMap<String, String> = HashMap::new();
    let mut buckets: HashMap<(String, String), BucketOwner> = HashMap::new();
    for n in &tables {
        match read_route(cx, n, upstreams, &mut names, &mut buckets) {
            Some(r) => routes.push(r),
            None => ok = false,
        }
    }
    ok.then_some(routes)
}

fn read_route(
    cx: &mut Cx<'_>,
    node: &Node<'_>,
    upstreams: &HashMap<String, usize>,
    names: &mut HashMap<String, String>,
    buckets: &mut HashMap<(String, String), BucketOwner>,
) -> Option<RouteConfig> {
    let t = TableReader::open(cx, Some(node), &node.path, ROUTE_KEYS)?;

    let name = t.require(cx, "name").and_then(|n| {
        let name = cx.name_value(&n, "route name")?;
        if let Some(first) = names.get(&name) {
            let msg = format!("duplicate route name {name:?} (first used by {first})");
            cx.error(&n.span, &n.path, msg);
            return None;
        }
        names.insert(name.clone(), node.path.clone());
        Some(name)
    });
    let host = match t.get("host") {
        Some(n) => cx.string(&n).and_then(|s| match parse_host(&s) {
            Ok(h) => Some(Some(h)),
            Err(msg) => {
                cx.error(&n.span, &n.path, msg);
                None
            }
        }),
        None => Some(None),
    };
    let path_prefix = match t.get("path_prefix") {
        Some(n) => cx.string(&n).and_then(|s| match parse_path_prefix(&s) {
            Ok(p) => Some(p),
            Err(msg) => {
                cx.error(&n.span, &n.path, msg);
                None
            }
        }),
        None => Some("/".to_string()),
    };
    let methods = match t.get("methods") {
        Some(n) => read_methods(cx, &n).map(Some),
        None => Some(None),
    };
    let upstream = t.require(cx, "upstream").and_then(|n| {
        let s = cx.string(&n)?;
        match upstreams.get(&s) {
            Some(i) => Some(*i),
            None => {
                let mut defined: Vec<&str> = upstreams.keys().map(String::as_str).collect();
                defined.sort_unstable();
                let msg = if defined.is_empty() {
                    format!("unknown upstream {s:?}: no [upstreams.NAME] is defined")
                } else {
                    format!("unknown upstream {s:?}; defined: {}", defined.join(", "))
                };
                cx.error(&n.span, &n.path, msg);
                None
            }
        }
    });
    let strip_prefix = cx.bool_or(t.get("strip_prefix"), false);
    let on_store_error = match t.get("on_store_error") {
        Some(n) => cx.choice(&n, STORE_POLICIES).map(Some),
        None => Some(None),
    };
    let shadow = cx.bool_or(t.get("shadow"), false);
    let limits = match t.get("limits") {
        Some(n) => read_limits(cx, &n, name.as_deref(), buckets),
        None => Some(Vec::new()),
    };
    let reject = match t.get("reject") {
        Some(n) => read_reject(cx, &n).map(Some),
        None => Some(None),
    };
    let max_body_size = cx.optional_size(t.get("max_body_size"));
    t.finish(cx);

    Some(RouteConfig {
        name: name?,
        host: host?,
        path_prefix: path_prefix?,
        methods: methods?,
        upstream: upstream?,
        strip_prefix: strip_prefix?,
        on_store_error: on_store_error?,
        shadow: shadow?,
        limits: limits?,
        reject: reject?,
        max_body_size: max_body_size?,
    })
}

fn read_methods(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Vec<Method>> {
    let elems = cx.array(node)?;
    if elems.is_empty() {
        cx.error(
            &node.span,
            &node.path,
            "must list at least one method (remove it to match any method)",
        );
        return None;
    }
    let mut out: Vec<Method> = Vec::new();
    let mut ok = true;
    for e in &elems {
        let Some(s) = cx.string(e) else {
            ok = false;
            continue;
        };
        match Method::from_bytes(s.to_ascii_uppercase().as_bytes()) {
            Ok(m) if out.contains(&m) => {
                cx.error(&e.span, &e.path, format!("method {m} is listed twice"));
                ok = false;
            }
            Ok(m) => out.push(m),
            Err(_) => {
                cx.error(&e.span, &e.path, format!("{s:?} is not an HTTP method"));
                ok = false;
            }
        }
    }
    ok.then_some(out)
}

fn read_reject(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<RejectConfig> {
    let t = TableReader::open(cx, Some(node), &node.path, REJECT_KEYS)?;
    let status = match t.get("status") {
        Some(n) => cx
            .integer(&n, 400, 599)
            .and_then(|i| u16::try_from(i).ok())
            .and_then(|i| StatusCode::from_u16(i).ok()),
        None => Some(StatusCode::TOO_MANY_REQUESTS),
    };
    let content_type = match t.get("content_type") {
        Some(n) => cx.string(&n).and_then(|s| {
            if s.is_empty() || HeaderValue::from_str(&s).is_err() {
                cx.error(&n.span, &n.path, "not a valid header value");
                None
            } else {
                Some(Some(s))
            }
        }),
        None => Some(None),
    };
    let body = match t.get("body") {
        Some(n) => cx.string(&n).map(Bytes::from),
        None => Some(Bytes::new()),
    };
    t.finish(cx);
    Some(RejectConfig {
        status: status?,
        content_type: content_type?,
        body: body?,
    })
}

fn read_limits(
    cx: &mut Cx<'_>,
    node: &Node<'_>,
    route: Option<&str>,
    buckets: &mut HashMap<(String, String), BucketOwner>,
) -> Option<Vec<LimitConfig>> {
    let tables = cx.tables(node)?;
    let mut out = Vec::new();
    let mut ok = true;
    // Bucket prefixes used by this route so far: a second limit on one prefix in one route
    // would increment the same counter twice per request.
    let mut mine: HashMap<(String, String), String> = HashMap::new();
    for n in &tables {
        let Some(limit) = read_limit(cx, n, route) else {
            ok = false;
            continue;
        };
        let id = (limit.scope.clone(), limit.key.label());
        if let Some(first) = mine.get(&id) {
            let msg = format!(
                "counts the same bucket {:?} as {first}: each request would be counted twice; give one of them its own scope",
                limit.policy_name()
            );
            cx.error(&n.span, &n.path, msg);
            ok = false;
            continue;
        }
        mine.insert(id.clone(), n.path.clone());
        match buckets.get(&id) {
            Some(owner) if owner.algorithm != limit.algorithm => {
                let msg = format!(
                    "conflicts with {} (route {:?}): both write bucket prefix {:?}, there with algorithm = {:?}, here with algorithm = {:?}; one row cannot be counted both ways: use the same algorithm, or a different scope",
                    owner.path,
                    owner.route,
                    limit.policy_name(),
                    owner.algorithm.as_str(),
                    limit.algorithm.as_str(),
                );
                cx.error(&n.span, &n.path, msg);
                ok = false;
                continue;
            }
            Some(owner)
                if owner.requests != limit.requests || owner.window_secs != limit.window_secs =>
            {
                let msg = format!(
                    "conflicts with {} (route {:?}): both write bucket prefix {:?}, there with requests = {}, window = \"{}\", here with requests = {}, window = \"{}\"; use the same values to share the budget, or a different scope",
                    owner.path,
                    owner.route,
                    limit.policy_name(),
                    owner.requests,
                    format_secs(owner.window_secs),
                    limit.requests,
                    format_secs(limit.window_secs),
                );
                cx.error(&n.span, &n.path, msg);
                ok = false;
                continue;
            }
            Some(_) => {}
            None => {
                buckets.insert(
                    id,
                    BucketOwner {
                        path: n.path.clone(),
                        route: route.unwrap_or_default().to_string(),
                        requests: limit.requests,
                        window_secs: limit.window_secs,
                        algorithm: limit.algorithm,
                    },
                );
            }
        }
        out.push(limit);
    }
    ok.then_some(out)
}

/// One limit. `route` is None when the route's name was invalid: the limit is still checked,
/// but without a scope it cannot take part in the bucket checks.
fn read_limit(cx: &mut Cx<'_>, node: &Node<'_>, route: Option<&str>) -> Option<LimitConfig> {
    let t = TableReader::open(cx, Some(node), &node.path, LIMIT_KEYS)?;
    let key = t.require(cx, "key").and_then(|n| read_key_spec(cx, &n));
    let requests = t
        .require(cx, "requests")
        .and_then(|n| cx.integer(&n, 1, i64::from(i32::MAX)))
        .and_then(|i| u32::try_from(i).ok());
    let window_secs = t.require(cx, "window").and_then(|n| {
        let s = cx.string(&n)?;
        match parse_window(&s) {
            Ok(w) => Some(w),
            Err(msg) => {
                cx.error(&n.span, &n.path, msg);
                None
            }
        }
    });
    let scope = match t.get("scope") {
        Some(n) => cx.name_value(&n, "scope"),
        None => route.map(str::to_string),
    };
    let shadow = cx.bool_or(t.get("shadow"), false);
    let algorithm = match t.get("algorithm") {
        None => Some(Algorithm::Fixed),
        Some(n) => cx.string(&n).and_then(|s| match s.as_str() {
            "fixed" => Some(Algorithm::Fixed),
            "sliding" => Some(Algorithm::Sliding),
            other => {
                cx.error(
                    &n.span,
                    &n.path,
                    format!("algorithm must be \"fixed\" or \"sliding\", got {other:?}"),
                );
                None
            }
        }),
    };
    t.finish(cx);
    Some(LimitConfig {
        key: key?,
        requests: requests?,
        window_secs: window_secs?,
        scope: scope?,
        shadow: shadow?,
        algorithm: algorithm?,
    })
}

/// `key = "ip"` or `key = ["header:x-tenant", "ip"]`.
fn read_key_spec(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<KeySpec> {
    if let Some(Value::String(_)) = node.value() {
        let s = cx.string(node)?;
        return match parse_key_part(&s) {
            Ok(p) => Some(KeySpec { parts: vec![p] }),
            Err(msg) => {
                cx.error(&node.span, &node.path, msg);
                None
            }
        };
    }
    if !matches!(node.value(), Some(Value::Array(_))) {
        cx.type_error(node, "a string or an array of strings");
        return None;
    }
    let elems = cx.array(node)?;
    if elems.is_empty() {
        cx.error(&node.span, &node.path, "must list at least one key part");
        return None;
    }
    let mut parts: Vec<KeyPart> = Vec::new();
    let mut ok = true;
    for e in &elems {
        let Some(s) = cx.string(e) else {
            ok = false;
            continue;
        };
        match parse_key_part(&s) {
            Ok(KeyPart::Global) if elems.len() > 1 => {
                cx.error(
                    &e.span,
                    &e.path,
                    "\"global\" cannot be combined with other key parts: it has no subject",
                );
                ok = false;
            }
            Ok(p) if parts.contains(&p) => {
                cx.error(&e.span, &e.path, format!("{s:?} is listed twice"));
                ok = false;
            }
            Ok(p) => parts.push(p),
            Err(msg) => {
                cx.error(&e.span, &e.path, msg);
                ok = false;
            }
        }
    }
    ok.then_some(KeySpec { parts })
}

fn parse_key_part(s: &str) -> Result<KeyPart, String> {
    match s {
        "ip" => Ok(KeyPart::Ip),
        "global" => Ok(KeyPart::Global),
        _ => match s.strip_prefix("header:") {
            Some(h) => HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes())
                .map(KeyPart::Header)
                .map_err(|_| format!("{h:?} is not a valid header name")),
            None => Err(format!(
                "unknown key {s:?}; expected \"ip\", \"global\" or \"header:<name>\""
            )),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Value syntax (pure functions)

/// Expands `${NAME}`, `${NAME:-default}` and `$$` in one string. Expanded values are not
/// scanned again, so a variable's value cannot inject further references. Errors name the
/// variable, never a value.
fn expand(s: &str, env: Env<'_>) -> Result<String, Vec<String>> {
    let mut out = String::with_capacity(s.len());
    let mut errors = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(a) = after.strip_prefix('{') {
            let Some(end) = a.find('}') else {
                errors.push(
                    "unterminated \"${\": expected \"}\" (write \"$$\" for a literal \"$\")"
                        .to_string(),
                );
                rest = "";
                break;
            };
            let inner = &a[..end];
            rest = &a[end + 1..];
            let (name, default) = match inner.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (inner, None),
            };
            if !is_var_name(name) {
                errors.push(format!(
                    "invalid variable reference \"${{{inner}}}\": expected ${{NAME}} or ${{NAME:-default}} with NAME made of letters, digits and _"
                ));
                continue;
            }
            // Like the shell's ${NAME:-default}: the default also replaces an empty value.
            match (env(name), default) {
                (Some(v), Some(d)) if v.is_empty() => out.push_str(d),
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    errors.push(format!("environment variable {name} is not set"));
                }
            }
        } else {
            // A lone `$` (as in a regex or a price) is kept as written.
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

fn is_var_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// `<integer><unit>`, unit one of ms, s, m, h, d.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || {
        format!("invalid duration {s:?}: expected an integer and a unit (ms, s, m, h or d), e.g. \"250ms\", \"10s\", \"5m\"")
    };
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad());
    }
    let (number, unit) = s.split_at(digits);
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    let too_large = || format!("duration {s:?} is too large");
    let n: u64 = number.parse().map_err(|_| too_large())?;
    let ms = n.checked_mul(ms_per_unit).ok_or_else(too_large)?;
    Ok(Duration::from_millis(ms))
}

/// A size: an integer and a unit, `B`, `KiB`, `MiB` or `GiB` (powers of 1024), e.g.
/// `"10MiB"`. Decimal units (`KB`, `MB`) are refused rather than guessed at.
fn parse_size(s: &str) -> Result<u64, String> {
    let bad = || {
        format!("invalid size {s:?}: expected an integer and a unit (B, KiB, MiB or GiB), e.g. \"512KiB\", \"10MiB\"")
    };
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad());
    }
    let (number, unit) = s.split_at(digits);
    let bytes_per_unit: u64 = match unit {
        "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    let too_large = || format!("size {s:?} is too large");
    let n: u64 = number.parse().map_err(|_| too_large())?;
    n.checked_mul(bytes_per_unit).ok_or_else(too_large)
}

/// A limit window: whole seconds, 1s..=366d.
fn parse_window(s: &str) -> Result<u32, String> {
    let d = parse_duration(s)?;
    if d.subsec_nanos() != 0 {
        return Err("window must be a whole number of seconds".to_string());
    }
    let secs = d.as_secs();
    if !(1..=MAX_DURATION_SECS).contains(&secs) {
        return Err(format!("window must be between 1s and 366d, got {s:?}"));
    }
    u32::try_from(secs).map_err(|_| format!("window must be between 1s and 366d, got {s:?}"))
}

/// Seconds in the largest unit that divides them, for messages.
fn format_secs(secs: u32) -> String {
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if secs >= size && secs.is_multiple_of(size) {
            return format!("{}{unit}", secs / size);
        }
    }
    format!("{secs}s")
}

/// Route names, upstream names and scopes: they go into metric labels and bucket strings,
/// where `:` separates fields and anything else would need escaping.
fn check_name(s: &str, what: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(format!(
            "{what} {s:?} may contain only letters, digits, '_', '.' and '-'"
        ));
    }
    Ok(())
}

/// A CIDR, or a bare address meaning just that address. Host bits are cleared, so
/// "10.1.2.3/8" means 10.0.0.0/8 as in other proxies' trusted-proxy lists.
fn parse_cidr(s: &str) -> Result<IpNet, String> {
    if let Ok(net) = IpNet::from_str(s) {
        return Ok(net.trunc());
    }
    if let Ok(ip) = IpAddr::from_str(s) {
        return Ok(IpNet::from(ip));
    }
    Err(format!(
        "{s:?} is not a CIDR or IP address; expected e.g. \"10.0.0.0/8\", \"192.0.2.1\" or \"2001:db8::/32\""
    ))
}

/// A route's host: an exact name or `*.suffix`, lowercased.
fn parse_host(s: &str) -> Result<HostPattern, String> {
    if s.contains("://") {
        return Err(format!("{s:?} must be a host name, not a URL"));
    }
    let lower = s.to_ascii_lowercase();
    if let Some(inner) = lower.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        // In RFC 5952 form, as requests' hosts are compared (`[0::1]` is `[::1]`).
        return match Ipv6Addr::from_str(inner) {
            Ok(addr) => Ok(HostPattern::Exact(format!("[{addr}]"))),
            Err(_) => Err(format!("{s:?} is not a valid IPv6 address literal")),
        };
    }
    if lower.contains(':') {
        return Err(format!(
            "{s:?} must not contain a port: routes match the host whatever the port"
        ));
    }
    let (suffix, name) = match lower.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, lower.as_str()),
    };
    check_host_name(name).map_err(|why| format!("{s:?} is not a valid host name: {why}"))?;
    Ok(if suffix {
        HostPattern::Suffix(format!(".{name}"))
    } else {
        HostPattern::Exact(name.to_string())
    })
}

/// DNS-style name: dot-separated labels of letters, digits, '-' and '_' (the latter appears in
/// internal names), 1..=63 characters each, 253 in all.
fn check_host_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.len() > 253 {
        return Err("it is longer than 253 characters");
    }
    if name.contains('*') {
        return Err("a wildcard is only allowed as a leading \"*.\"");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("it has an empty label");
        }
        if label.len() > 63 {
            return Err("a label is longer than 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("it may contain only letters, digits, '-', '_' and '.'");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a label starts or ends with '-'");
        }
    }
    Ok(())
}

/// A route's path prefix, in the normalised form requests are matched in (SPEC 4a), so a
/// prefix that no normalised path could ever carry is rejected instead of never matching.
fn parse_path_prefix(s: &str) -> Result<String, String> {
    if !s.starts_with('/') {
        return Err(format!("{s:?} must start with '/'"));
    }
    if s.contains(['?', '#']) {
        return Err(format!("{s:?} must be a path only, without '?' or '#'"));
    }
    if s.contains('%') {
        return Err(format!(
            "{s:?} must not contain '%': requests are matched after percent-decoding, write the character itself"
        ));
    }
    if s.contains("//") {
        return Err(format!("{s:?} must not contain an empty segment (\"//\")"));
    }
    if s.contains(';') {
        return Err(format!(
            "{s:?} must not contain ';': requests are matched without their path parameters (\";...\")"
        ));
    }
    if s.split('/').any(|seg| seg == "." || seg == "..") {
        return Err(format!(
            "{s:?} must not contain \".\" or \"..\" segments: requests are matched after they are removed"
        ));
    }
    // RFC 3986 pchar minus percent-encoding: anything else never appears in a request path.
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "/-._~!$&'()*+,;=:@".contains(*c)))
    {
        return Err(format!(
            "{s:?} contains {c:?}, which cannot appear in a request path"
        ));
    }
    let trimmed = if s.len() > 1 {
        s.strip_suffix('/').unwrap_or(s)
    } else {
        s
    };
    Ok(trimmed.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const FILE: &str = "/etc/tollgate/proxy.toml";

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn load(text: &str) -> Result<Config, ConfigErrors> {
        load_str(Path::new(FILE), text, &no_env)
    }

    fn load_ok(text: &str) -> Config {
        match load(text) {
            Ok(c) => c,
            Err(e) => panic!("expected a valid config, got:\n{e}"),
        }
    }

    /// (line, col, field) of every error.
    fn positions(text: &str) -> Vec<(usize, usize, String)> {
        positions_of(load(text))
    }

    fn positions_of(r: Result<Config, ConfigErrors>) -> Vec<(usize, usize, String)> {
        match r {
            Ok(_) => panic!("expected errors, the file was accepted"),
            Err(e) => e.0.into_iter().map(|e| (e.line, e.col, e.field)).collect(),
        }
    }

    /// The single error the file produces.
    fn one_error(text: &str) -> ConfigError {
        one_error_of(load(text))
    }

    fn one_error_of(r: Result<Config, ConfigErrors>) -> ConfigError {
        match r {
            Ok(_) => panic!("expected an error, the file was accepted"),
            Err(mut e) => {
                assert_eq!(e.0.len(), 1, "expected one error, got:\n{e}");
                e.0.remove(0)
            }
        }
    }

    fn assert_error(text: &str, line: usize, col: usize, field: &str, message_part: &str) {
        let e = one_error(text);
        assert_eq!(
            (e.line, e.col, e.field.as_str()),
            (line, col, field),
            "error was: {e}"
        );
        assert!(
            e.message.contains(message_part),
            "message {:?} lacks {message_part:?}",
            e.message
        );
    }

    /// A fresh directory under the system temp dir (no extra crate for one helper).
    fn temp_dir() -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tollgate-config-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(dir.join("certs")).expect("create temp dir");
        dir
    }

    const UPSTREAM: &str = "[upstreams.api]\nurl = \"http://127.0.0.1:9000\"\n";

    // The example of SPEC section 2, verbatim apart from `ca_file` living next to the certs.
    const SPEC_EXAMPLE: &str = r#"[server]
listen = ["0.0.0.0:8080"]          # plain listeners: HTTP/1.1, and HTTP/2 with prior knowledge (h2c)
tls_listen = ["0.0.0.0:8443"]      # TLS listeners (needs [[server.certs]]); ALPN h2 and http/1.1
trusted_proxies = ["10.0.0.0/8"]   # peers whose X-Forwarded-For is believed (section 4); default none
ipv6_prefix = 64                   # IPv6 clients are keyed by this prefix; 128 = whole address
header_read_timeout = "10s"        # time to receive a request's headers (slowloris guard)
idle_timeout = "60s"               # keep-alive connection with no request
max_connections = 10000            # accepted at once; beyond it, accept waits
shutdown_timeout = "30s"
rate_limit_headers = "draft"       # "draft" | "legacy" | "both" | "none" (section 5)
max_body_size = "10MiB"            # optional: larger request bodies get 413 (section 5); default none.
                                   # Sizes: an integer with B, KiB, MiB or GiB
underscores_in_headers = false     # true = forward header names containing "_" (section 4a)

[[server.certs]]                   # SNI picks the certificate whose names match; the first is the default
cert = "certs/example.pem"         # PEM chain
key = "certs/example.key"          # PEM private key (PKCS#8, PKCS#1 or SEC1)

[admin]
listen = "127.0.0.1:9901"          # /healthz, /readyz, /metrics; no [admin] = no admin listener

[store]
url = "postgres://tollgate@db.internal/tollgate"  # absent = in-process memory store (single instance only)
pool_size = 16
timeout = "100ms"                  # budget for one decision, pool wait included
on_error = "allow"                 # store failing or slower than timeout: "allow" (fail open) | "deny" (503)
migrate = true                     # apply pending migrations at start
sweep_interval = "60s"             # how often expired rows are deleted
synchronous_commit = "off"         # tollgate's own sessions; "on" = every increment durable before the
                                   # decision (a crash with "off" forgets at most the last moment's counts)

[keys]
secret = "${TOLLGATE_KEY_SECRET}"  # HMAC-SHA256 key for subjects; absent = plain SHA-256, logged as a warning

[upstreams.api]
url = "http://127.0.0.1:9000"      # http:// or https://; or urls = [...] for round robin
connect_timeout = "2s"
response_timeout = "30s"           # until the upstream's response headers
preserve_host = true               # default true: send the client's Host; false = the upstream's authority
ca_file = "certs/internal-ca.pem"  # extra trust root for https upstreams (optional)
http2 = false                      # true = speak HTTP/2 to this upstream (h2 over TLS, h2c over http)

[[routes]]
name = "oauth.register"            # unique; used in logs, metrics and as the default limit scope
host = "api.example.com"           # optional: exact, or "*.example.com" (any depth of subdomain, not the
                                   # bare domain); case-insensitive, port ignored
path_prefix = "/oauth/register"    # default "/"; matches on segment boundaries (/a matches /a, /a/, /a/b, not /ab)
methods = ["POST"]                 # optional
upstream = "api"
strip_prefix = false               # true = remove path_prefix before forwarding (/api itself becomes /)
on_store_error = "deny"            # optional override of store.on_error
shadow = false                     # true = count and report, never reject (for rolling out a limit)
max_body_size = "100MiB"           # optional override of server.max_body_size

  [[routes.limits]]
  key = "ip"                       # "ip" | "header:<name>" | "global" | a list, e.g. ["header:x-tenant", "ip"]
  requests = 5
  window = "1h"                    # whole seconds, from 1s to 366d
  scope = "oauth.register"         # optional; default: the route's name
  shadow = false

[routes.reject]                    # optional; default: 429 with an RFC 9457 problem body (section 5)
status = 429
content_type = "application/json"
body = '{"error":"slow down"}'
"#;

    fn spec_example_dir() -> PathBuf {
        let dir = temp_dir();
        for f in ["example.pem", "example.key", "internal-ca.pem"] {
            std::fs::write(dir.join("certs").join(f), "-----BEGIN X-----\n").expect("write");
        }
        dir
    }

    #[test]
    fn spec_example_loads() {
        let dir = spec_example_dir();
        let path = dir.join("proxy.toml");
        std::fs::write(&path, SPEC_EXAMPLE).expect("write");
        let env = env_of(&[("TOLLGATE_KEY_SECRET", "s3cret")]);
        let c = match load_file(&path, &env) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(c.source, path);
        let s = &c.server;
        assert_eq!(
            s.listen,
            vec!["0.0.0.0:8080".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(
            s.tls_listen,
            vec!["0.0.0.0:8443".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(
            s.trusted_proxies,
            vec!["10.0.0.0/8".parse::<IpNet>().unwrap()]
        );
        assert_eq!(s.ipv6_prefix, 64);
        assert_eq!(s.header_read_timeout, Duration::from_secs(10));
        assert_eq!(s.idle_timeout, Duration::from_secs(60));
        assert_eq!(s.max_connections, 10_000);
        assert_eq!(s.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(s.rate_limit_headers, RateLimitHeaders::Draft);
        assert!(!s.underscores_in_headers);
        assert_eq!(s.max_body_size, Some(10 * 1024 * 1024));
        assert_eq!(s.certs.len(), 1);
        assert_eq!(s.certs[0].cert, dir.join("certs/example.pem"));
        assert_eq!(s.certs[0].key, dir.join("certs/example.key"));
        assert_eq!(
            c.admin.as_ref().map(|a| a.listen),
            Some("127.0.0.1:9901".parse().unwrap())
        );
        assert_eq!(
            c.store.url.as_deref(),
            Some("postgres://tollgate@db.internal/tollgate")
        );
        assert_eq!(c.store.pool_size, 16);
        assert_eq!(c.store.timeout, Duration::from_millis(100));
        assert_eq!(c.store.on_error, StoreErrorPolicy::Allow);
        assert!(c.store.migrate);
        assert_eq!(c.store.sweep_interval, Duration::from_secs(60));
        assert!(!c.store.synchronous_commit);
        assert_eq!(c.keys.secret.as_deref(), Some(&b"s3cret"[..]));

        assert_eq!(c.upstreams.len(), 1);
        let u = &c.upstreams[0];
        assert_eq!(u.name, "api");
        assert_eq!(u.urls, vec![Uri::from_static("http://127.0.0.1:9000/")]);
        assert_eq!(u.connect_timeout, Duration::from_secs(2));
        assert_eq!(u.response_timeout, Duration::from_secs(30));
        assert!(u.preserve_host);
        assert_eq!(
            u.ca_file.as_deref(),
            Some(&*dir.join("certs/internal-ca.pem"))
        );
        assert!(!u.http2);

        assert_eq!(c.routes.len(), 1);
        let r = &c.routes[0];
        assert_eq!(r.name, "oauth.register");
        assert_eq!(r.host, Some(HostPattern::Exact("api.example.com".into())));
        assert_eq!(r.path_prefix, "/oauth/register");
        assert_eq!(r.methods, Some(vec![Method::POST]));
        assert_eq!(r.upstream, 0);
        assert_eq!(c.upstream(r).name, "api");
        assert!(!r.strip_prefix);
        assert_eq!(r.max_body_size, Some(100 * 1024 * 1024));
        assert_eq!(r.on_store_error, Some(StoreErrorPolicy::Deny));
        assert!(!r.shadow);
        assert_eq!(r.limits.len(), 1);
        let l = &r.limits[0];
        assert_eq!(
            l.key,
            KeySpec {
                parts: vec![KeyPart::Ip]
            }
        );
        assert_eq!(l.requests, 5);
        assert_eq!(l.window_secs, 3600);
        assert_eq!(l.scope, "oauth.register");
        assert!(!l.shadow);
        assert_eq!(l.policy_name(), "oauth.register:ip");
        let rej = r.reject.as_ref().expect("reject");
        assert_eq!(rej.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(rej.content_type.as_deref(), Some("application/json"));
        assert_eq!(rej.body, Bytes::from_static(br#"{"error":"slow down"}"#));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn spec_example_without_secret_variable_names_it() {
        let dir = spec_example_dir();
        let path = dir.join("proxy.toml");
        std::fs::write(&path, SPEC_EXAMPLE).expect("write");
        let e = one_error_of(load_file(&path, &no_env));
        assert_eq!((e.line, e.col, e.field.as_str()), (33, 10, "keys.secret"));
        assert_eq!(
            e.message,
            "environment variable TOLLGATE_KEY_SECRET is not set"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn empty_file_gets_every_default() {
        let c = load_ok("");
        let s = &c.server;
        assert_eq!(s.listen, vec![SocketAddr::from(([0, 0, 0, 0], 8080))]);
        assert!(s.tls_listen.is_empty());
        assert!(s.trusted_proxies.is_empty());
        assert_eq!(s.ipv6_prefix, 64);
        assert_eq!(s.header_read_timeout, Duration::from_secs(10));
        assert_eq!(s.idle_timeout, Duration::from_secs(60));
        assert_eq!(s.max_connections, 10_000);
        assert_eq!(s.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(s.rate_limit_headers, RateLimitHeaders::Draft);
        assert!(s.certs.is_empty());
        assert!(c.admin.is_none());
        let st = &c.store;
        assert_eq!(st.url, None);
        assert_eq!(st.pool_size, 16);
        assert_eq!(st.timeout, Duration::from_millis(100));
        assert_eq!(st.on_error, StoreErrorPolicy::Allow);
        assert!(st.migrate);
        assert_eq!(st.sweep_interval, Duration::from_secs(60));
        assert!(!st.synchronous_commit);
        assert_eq!(c.keys.secret, None);
        assert!(c.upstreams.is_empty());
        assert!(c.routes.is_empty());
    }

    #[test]
    fn route_upstream_and_limit_defaults() {
        let c = load_ok(&format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n[[routes.limits]]\nkey = \"global\"\nrequests = 1\nwindow = \"1s\"\n[routes.reject]\n"
        ));
        let u = &c.upstreams[0];
        assert_eq!(u.connect_timeout, Duration::from_secs(2));
        assert_eq!(u.response_timeout, Duration::from_secs(30));
        assert!(u.preserve_host);
        assert_eq!(u.ca_file, None);
        assert!(!u.http2);
        assert_eq!(u.max_idle_connections, 128);
        let r = &c.routes[0];
        assert_eq!(r.host, None);
        assert_eq!(r.path_prefix, "/");
        assert_eq!(r.methods, None);
        assert!(!r.strip_prefix);
        assert_eq!(r.on_store_error, None);
        assert!(!r.shadow);
        let l = &r.limits[0];
        assert_eq!(l.scope, "r");
        assert!(l.key.is_global());
        assert_eq!(l.policy_name(), "r:global");
        assert!(!l.shadow);
        let rej = r.reject.as_ref().expect("reject");
        assert_eq!(rej.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(rej.content_type, None);
        assert!(rej.body.is_empty());
    }

    #[test]
    fn tls_only_server_has_no_default_plain_listener() {
        let dir = spec_example_dir();
        let path = dir.join("proxy.toml");
        let text = "[server]\ntls_listen = [\"[::1]:8443\"]\n[[server.certs]]\ncert = \"certs/example.pem\"\nkey = \"certs/example.key\"\n";
        let c = load_str(&path, text, &no_env).expect("valid");
        assert!(c.server.listen.is_empty());
        assert_eq!(
            c.server.tls_listen,
            vec!["[::1]:8443".parse::<SocketAddr>().unwrap()]
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn server_values_are_read() {
        let c = load_ok(
            "[server]\nlisten = [\"127.0.0.1:0\", \"[::]:80\"]\ntrusted_proxies = [\"10.1.2.3/8\", \"192.0.2.1\", \"2001:db8::1\"]\nipv6_prefix = 128\nheader_read_timeout = \"250ms\"\nidle_timeout = \"5m\"\nmax_connections = 1\nshutdown_timeout = \"1h\"\nrate_limit_headers = \"both\"\n",
        );
        let s = &c.server;
        assert_eq!(s.listen.len(), 2);
        let nets: Vec<String> = s.trusted_proxies.iter().map(ToString::to_string).collect();
        assert_eq!(nets, ["10.0.0.0/8", "192.0.2.1/32", "2001:db8::1/128"]);
        assert_eq!(s.ipv6_prefix, 128);
        assert_eq!(s.header_read_timeout, Duration::from_millis(250));
        assert_eq!(s.idle_timeout, Duration::from_secs(300));
        assert_eq!(s.max_connections, 1);
        assert_eq!(s.shutdown_timeout, Duration::from_secs(3600));
        assert_eq!(s.rate_limit_headers, RateLimitHeaders::Both);
        assert_eq!(s.workers, None, "absent: decided at start");
        assert!(s.worker_count() >= 1);
        let c = load_ok("[server]\nworkers = 3\n");
        assert_eq!((c.server.workers, c.server.worker_count()), (Some(3), 3));
        for (v, want) in [
            ("legacy", RateLimitHeaders::Legacy),
            ("none", RateLimitHeaders::None),
            ("draft", RateLimitHeaders::Draft),
        ] {
            let c = load_ok(&format!("[server]\nrate_limit_headers = \"{v}\"\n"));
            assert_eq!(c.server.rate_limit_headers, want);
        }
    }

    #[test]
    fn underscores_in_headers_defaults_to_dropping_them() {
        assert!(!load_ok("").server.underscores_in_headers);
        assert!(
            !load_ok("[server]\nunderscores_in_headers = false\n")
                .server
                .underscores_in_headers
        );
        assert!(
            load_ok("[server]\nunderscores_in_headers = true\n")
                .server
                .underscores_in_headers
        );
        assert_error(
            "[server]\nunderscores_in_headers = \"yes\"\n",
            2,
            26,
            "server.underscores_in_headers",
            "boolean",
        );
    }

    #[test]
    fn store_values_are_read() {
        let c = load_ok(
            "[store]\nurl = \"host=db1,db2 user=t target_session_attrs=read-write\"\npool_size = 1024\ntimeout = \"1s\"\non_error = \"deny\"\nmigrate = false\nsweep_interval = \"1d\"\nsynchronous_commit = \"on\"\n",
        );
        let s = &c.store;
        assert_eq!(
            s.url.as_deref(),
            Some("host=db1,db2 user=t target_session_attrs=read-write")
        );
        assert_eq!(s.pool_size, 1024);
        assert_eq!(s.timeout, Duration::from_secs(1));
        assert_eq!(s.on_error, StoreErrorPolicy::Deny);
        assert!(!s.migrate);
        assert_eq!(s.sweep_interval, Duration::from_secs(86_400));
        assert!(s.synchronous_commit);
        // The URL never shows up in Debug output.
        assert!(!format!("{s:?}").contains("db1"));
    }

    #[test]
    fn database_url_override() {
        let text = "[store]\nurl = \"postgres://file@db/x\"\n";
        let env = env_of(&[("TOLLGATE_DATABASE_URL", "postgres://env@db/y")]);
        let c = load_str(Path::new(FILE), text, &env).expect("valid");
        assert_eq!(c.store.url.as_deref(), Some("postgres://env@db/y"));
        // Also when the file has no url (memory store otherwise).
        let c = load_str(Path::new(FILE), "", &env).expect("valid");
        assert_eq!(c.store.url.as_deref(), Some("postgres://env@db/y"));
        // Set but empty: no override.
        let env = env_of(&[("TOLLGATE_DATABASE_URL", "")]);
        let c = load_str(Path::new(FILE), text, &env).expect("valid");
        assert_eq!(c.store.url.as_deref(), Some("postgres://file@db/x"));
        let c = load_str(Path::new(FILE), "", &env).expect("valid");
        assert_eq!(c.store.url, None);
        // An invalid override is an error without a position, and without the value.
        let env = env_of(&[("TOLLGATE_DATABASE_URL", "postgres://u:hunter2@h:notaport/d")]);
        let e = one_error_of(load_str(Path::new(FILE), text, &env));
        assert_eq!((e.line, e.col, e.field.as_str()), (0, 0, "store.url"));
        assert!(
            e.message.starts_with("TOLLGATE_DATABASE_URL: "),
            "{}",
            e.message
        );
        assert!(!e.to_string().contains("hunter2"));
        assert_eq!(e.to_string(), format!("{FILE}: store.url: {}", e.message));
    }

    #[test]
    fn secrets_never_appear_in_messages() {
        // A broken URL with a password in it, via the environment and literally.
        let env = env_of(&[("DB", "postgres://u:hunter2@h:99999999/d")]);
        let e = one_error_of(load_str(
            Path::new(FILE),
            "[store]\nurl = \"${DB}\"\n",
            &env,
        ));
        assert_eq!((e.line, e.col, e.field.as_str()), (2, 7, "store.url"));
        assert!(!e.message.contains("hunter2"), "{}", e.message);
        assert!(
            e.message.contains("invalid value for option `port`"),
            "{}",
            e.message
        );
        for url in [
            "postgres://u:hunter2@h/d?bogus_hunter2=1",
            "hunter2",
            "host='hunter2",
        ] {
            let e = one_error(&format!("[store]\nurl = \"{url}\"\n"));
            assert_eq!(e.field, "store.url");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
        // An empty secret (e.g. an empty variable) is rejected without echoing anything.
        let env = env_of(&[("K", "")]);
        let e = one_error_of(load_str(
            Path::new(FILE),
            "[keys]\nsecret = \"${K}\"\n",
            &env,
        ));
        assert_eq!((e.line, e.col, e.field.as_str()), (2, 10, "keys.secret"));
        assert!(e.message.contains("must not be empty"));
        assert_error(
            "[store]\nurl = \"\"\n",
            2,
            7,
            "store.url",
            "must not be empty",
        );
    }

    #[test]
    fn expand_rules() {
        let env = env_of(&[("A", "alpha"), ("EMPTY", ""), ("REF", "${A}")]);
        let ok = |s: &str| expand(s, &env).expect("expands");
        assert_eq!(ok("x${A}y"), "xalphay");
        assert_eq!(ok("${A}${A}"), "alphaalpha");
        assert_eq!(ok("${A:-d}"), "alpha");
        assert_eq!(ok("${UNSET:-d}"), "d");
        assert_eq!(ok("${EMPTY:-d}"), "d");
        assert_eq!(ok("${EMPTY}"), "");
        assert_eq!(ok("${UNSET:-}"), "");
        assert_eq!(ok("${UNSET:-a:-b}"), "a:-b");
        assert_eq!(ok("$$"), "$");
        assert_eq!(ok("$${A}"), "${A}");
        assert_eq!(ok("$$$$"), "$$");
        assert_eq!(ok("a$b"), "a$b");
        assert_eq!(ok("end$"), "end$");
        assert_eq!(ok("^/x$"), "^/x$");
        assert_eq!(ok("$A"), "$A");
        assert_eq!(ok("€${A}€"), "€alpha€");
        // A value is never expanded again.
        assert_eq!(ok("${REF}"), "${A}");

        let err = |s: &str| expand(s, &env).expect_err("fails");
        assert_eq!(err("${NOPE}"), ["environment variable NOPE is not set"]);
        assert_eq!(
            err("${X}/${Y}"),
            [
                "environment variable X is not set",
                "environment variable Y is not set"
            ]
        );
        assert!(err("${A")[0].starts_with("unterminated"));
        assert!(err("ok ${A} ${")[0].starts_with("unterminated"));
        assert!(err("${}")[0].starts_with("invalid variable reference"));
        assert!(err("${1A}")[0].starts_with("invalid variable reference"));
        assert!(err("${A-d}")[0].starts_with("invalid variable reference"));
        assert!(err("${A B}")[0].starts_with("invalid variable reference"));
    }

    #[test]
    fn every_string_is_expanded_including_array_elements() {
        let env = env_of(&[
            ("PORT", "9090"),
            ("UP", "http://10.0.0.1:9000"),
            ("N", "7"),
            ("RT", "api"),
        ]);
        let text = "[server]\nlisten = [\"${HOST:-127.0.0.1}:${PORT}\", \"[::1]:$${PORT}\"]\n[upstreams.api]\nurls = [\"${UP}\"]\n[[routes]]\nname = \"r${N}\"\nupstream = \"${RT}\"\nmethods = [\"${M:-get}\"]\n";
        let e = one_error_of(load_str(Path::new(FILE), text, &env));
        // `$$` is a literal `$`, so the second address is not a socket address.
        assert_eq!(
            (e.line, e.col, e.field.as_str()),
            (2, 41, "server.listen[1]")
        );
        let text = text.replace("$${PORT}", "${PORT}");
        let c = load_str(Path::new(FILE), &text, &env).expect("valid");
        assert_eq!(
            c.server.listen,
            vec![
                "127.0.0.1:9090".parse::<SocketAddr>().unwrap(),
                "[::1]:9090".parse().unwrap()
            ]
        );
        assert_eq!(
            c.upstreams[0].urls,
            vec![Uri::from_static("http://10.0.0.1:9000/")]
        );
        assert_eq!(c.routes[0].name, "r7");
        assert_eq!(c.routes[0].methods, Some(vec![Method::GET]));
    }

    #[test]
    fn unset_variable_in_array_points_at_element() {
        assert_error(
            "[server]\nlisten = [\"0.0.0.0:1\", \"${ADDR}\"]\n",
            2,
            24,
            "server.listen[1]",
            "environment variable ADDR is not set",
        );
        assert_error(
            "[server]\nlisten = [\"${ADDR\"]\n",
            2,
            11,
            "server.listen[0]",
            "unterminated",
        );
    }

    #[test]
    fn sizes() {
        for (s, n) in [
            ("1B", 1),
            ("512KiB", 512 * 1024),
            ("10MiB", 10 << 20),
            ("2GiB", 2 << 30),
        ] {
            assert_eq!(parse_size(s), Ok(n), "{s}");
        }
        for s in [
            "",
            "10",
            "10 MiB",
            "10MB",
            "10mib",
            "1.5MiB",
            "-1B",
            "KiB",
            "99999999999999999999B",
            "17179869184GiB",
        ] {
            assert!(parse_size(s).is_err(), "{s:?} accepted");
        }
        let text = format!("[server]\nmax_body_size = \"10MB\"\n{UPSTREAM}");
        assert_error(&text, 2, 17, "server.max_body_size", "B, KiB, MiB or GiB");
        let text = format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nmax_body_size = \"0B\"\n"
        );
        assert_error(&text, 6, 17, "routes[0].max_body_size", "greater than zero");
        let config = load_ok(&format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nmax_body_size = \"5KiB\"\n"
        ));
        assert_eq!(config.server.max_body_size, None);
        assert_eq!(config.routes[0].max_body_size, Some(5 * 1024));
    }

    #[test]
    fn durations() {
        let ok = [
            ("250ms", Duration::from_millis(250)),
            ("0ms", Duration::ZERO),
            ("10s", Duration::from_secs(10)),
            ("5m", Duration::from_secs(300)),
            ("1h", Duration::from_secs(3600)),
            ("1d", Duration::from_secs(86_400)),
            ("007s", Duration::from_secs(7)),
        ];
        for (s, d) in ok {
            assert_eq!(parse_duration(s), Ok(d), "{s}");
        }
        for s in [
            "",
            "s",
            "10",
            "10 s",
            " 10s",
            "10S",
            "1.5s",
            "-1s",
            "+1s",
            "1w",
            "10sec",
            "1h30m",
            "99999999999999999999s",
            "18446744073709551615d",
            "١s",
        ] {
            assert!(parse_duration(s).is_err(), "{s:?} accepted");
        }
        assert_error(
            "[server]\nidle_timeout = \"0s\"\n",
            2,
            16,
            "server.idle_timeout",
            "greater than zero",
        );
        assert_error(
            "[store]\ntimeout = \"367d\"\n",
            2,
            11,
            "store.timeout",
            "at most 366d",
        );
        assert_error(
            "[store]\nsweep_interval = 60\n",
            2,
            18,
            "store.sweep_interval",
            "expected a string, found integer",
        );
        assert_error(
            "[server]\nshutdown_timeout = \"30\"\n",
            2,
            20,
            "server.shutdown_timeout",
            "invalid duration \"30\"",
        );
    }

    #[test]
    fn windows() {
        assert_eq!(parse_window("1s"), Ok(1));
        assert_eq!(parse_window("1000ms"), Ok(1));
        assert_eq!(parse_window("1h"), Ok(3600));
        assert_eq!(parse_window("366d"), Ok(366 * 86_400));
        assert_eq!(
            parse_window("1500ms"),
            Err("window must be a whole number of seconds".to_string())
        );
        assert!(parse_window("0s").is_err());
        assert!(parse_window("367d").is_err());
        assert!(parse_window("9999999999999s").is_err());
        let text = format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n  [[routes.limits]]\n  key = \"ip\"\n  requests = 5\n  window = \"1500ms\"\n"
        );
        assert_error(
            &text,
            9,
            12,
            "routes[0].limits[0].window",
            "window must be a whole number of seconds",
        );
    }

    fn route_with_limit(limit: &str) -> String {
        format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n[[routes.limits]]\n{limit}\n"
        )
    }

    #[test]
    fn typo_in_limit_is_an_error_with_a_suggestion() {
        let text = route_with_limit("key = \"ip\"\nreqests = 5\nwindow = \"1m\"");
        let errs = positions(&text);
        assert_eq!(
            errs,
            [
                (6, 1, "routes[0].limits[0].requests".to_string()),
                (8, 1, "routes[0].limits[0].reqests".to_string()),
            ]
        );
        let e = load(&text).expect_err("invalid");
        assert_eq!(e.0[0].message, "missing required field");
        assert_eq!(e.0[1].message, "unknown field; did you mean `requests`?");
    }

    #[test]
    fn unknown_keys_everywhere() {
        let text = "bogus = 1\n[server]\nlisten_on = []\n[admin]\nlisten = \"127.0.0.1:1\"\nport = 1\n[store]\nurll = \"x\"\n[keys]\nsecrets = \"x\"\n[upstreams.api]\nurl = \"http://a\"\nretries = 3\n[[routes]]\nname = \"r\"\nupstream = \"api\"\nlimit = []\n[routes.reject]\ncode = 400\n";
        let errs = positions(text);
        let fields: Vec<&str> = errs.iter().map(|e| e.2.as_str()).collect();
        assert_eq!(
            fields,
            [
                "bogus",
                "server.listen_on",
                "admin.port",
                "store.urll",
                "keys.secrets",
                "upstreams.api.retries",
                "routes[0].limit",
                "routes[0].reject.code",
            ]
        );
        assert_eq!(errs[1].0, 3);
        assert_eq!(errs[1].1, 1);
        let e = load(text).expect_err("invalid");
        assert!(e.0[7]
            .message
            .contains("expected one of: status, content_type, body"));
        assert!(e.0[6].message.contains("did you mean `limits`?"));
    }

    #[test]
    fn unknown_upstream() {
        let text = format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"apii\"\n");
        assert_error(
            &text,
            5,
            12,
            "routes[0].upstream",
            "unknown upstream \"apii\"; defined: api",
        );
        assert_error(
            "[[routes]]\nname = \"r\"\nupstream = \"api\"\n",
            3,
            12,
            "routes[0].upstream",
            "no [upstreams.NAME] is defined",
        );
    }

    #[test]
    fn broken_upstream_is_not_also_unknown() {
        let text =
            "[upstreams.api]\nurl = \"ftp://x\"\n[[routes]]\nname = \"r\"\nupstream = \"api\"\n";
        assert_error(text, 2, 7, "upstreams.api.url", "http:// or https://");
    }

    #[test]
    fn upstream_index_follows_file_order() {
        let c = load_ok(
            "[upstreams.b]\nurl = \"http://b\"\n[upstreams.a]\nurls = [\"https://a1:8443\", \"http://a2/\"]\nhttp2 = true\npreserve_host = false\nconnect_timeout = \"1s\"\nresponse_timeout = \"2m\"\nmax_idle_connections = 0\n[[routes]]\nname = \"r1\"\nupstream = \"a\"\n[[routes]]\nname = \"r2\"\nupstream = \"b\"\n",
        );
        let names: Vec<&str> = c.upstreams.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(c.routes[0].upstream, 1);
        assert_eq!(c.routes[1].upstream, 0);
        let a = &c.upstreams[1];
        assert_eq!(
            a.urls,
            vec![
                Uri::from_static("https://a1:8443/"),
                Uri::from_static("http://a2/")
            ]
        );
        assert!(a.http2);
        assert!(!a.preserve_host);
        assert_eq!(a.connect_timeout, Duration::from_secs(1));
        assert_eq!(a.response_timeout, Duration::from_secs(120));
        assert_eq!(a.max_idle_connections, 0);
        assert_eq!(c.upstreams[0].max_idle_connections, 128, "default");
        assert_eq!(
            c.upstreams[0].fail_timeout,
            Duration::from_secs(10),
            "default"
        );
    }

    #[test]
    fn fail_timeout_is_a_positive_duration() {
        let c = load_ok("[upstreams.a]\nurls = [\"http://a\", \"http://b\"]\nfail_timeout = \"250ms\"\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n");
        assert_eq!(c.upstreams[0].fail_timeout, Duration::from_millis(250));
        for (bad, message) in [
            ("\"0s\"", "greater than zero"),
            ("\"10\"", "invalid duration"),
            ("10", "string"),
            ("\"367d\"", "at most 366d"),
        ] {
            assert_error(
                &format!("[upstreams.a]\nurls = [\"http://a\", \"http://b\"]\nfail_timeout = {bad}\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n"),
                3,
                16,
                "upstreams.a.fail_timeout",
                message,
            );
        }
    }

    #[test]
    fn max_idle_connections_is_bounded() {
        let c = load_ok("[upstreams.a]\nurl = \"http://a\"\nmax_idle_connections = 65535\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n");
        assert_eq!(c.upstreams[0].max_idle_connections, 65_535);
        for bad in ["-1", "65536", "\"8\""] {
            let e = one_error(&format!(
                "[upstreams.a]\nurl = \"http://a\"\nmax_idle_connections = {bad}\n[[routes]]\nname = \"r\"\nupstream = \"a\"\n"
            ));
            assert_eq!(
                (e.line, e.col, e.field.as_str()),
                (3, 24, "upstreams.a.max_idle_connections"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn upstream_urls() {
        for ok in [
            "http://a",
            "http://a/",
            "https://a:1",
            "http://[::1]:80",
            "HTTP://A.example",
        ] {
            assert!(parse_origin(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a:80",
            "/x",
            "ftp://a",
            "http://a/x",
            "http://a?x=1",
            "http://a/?x",
            "http://u:p@a",
            "http://",
            "http:// a",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad:?} accepted");
        }
        // A credential in an upstream URL is refused without being repeated.
        for bad in [
            "http://u:hunter2@a",
            "http://u:hunter2@a/path",
            "ftp://u:hunter2@a",
        ] {
            let msg = parse_origin(bad).expect_err("refused");
            assert!(!msg.contains("hunter2"), "{msg}");
        }
        assert_error(
            "[upstreams.api]\nurl = \"http://a\"\nurls = [\"http://b\"]\n",
            3,
            8,
            "upstreams.api.urls",
            "either url or urls",
        );
        assert_error(
            "[upstreams.api]\nurls = []\n",
            2,
            8,
            "upstreams.api.urls",
            "at least one",
        );
        assert_error(
            "[upstreams.api]\nhttp2 = true\n",
            1,
            1,
            "upstreams.api.url",
            "missing required field",
        );
        assert_error(
            "[upstreams.api]\nurls = [\"http://a\", \"http://b/path\"]\n",
            2,
            21,
            "upstreams.api.urls[1]",
            "has a path",
        );
        assert_error(
            "[upstreams.\"my api\"]\nurl = \"http://a\"\n",
            1,
            12,
            "upstreams.\"my api\"",
            "upstream name \"my api\" may contain only",
        );
        assert_error("upstreams = 1\n", 1, 13, "upstreams", "expected a table");
        assert_error(
            "[upstreams]\napi = \"http://a\"\n",
            2,
            7,
            "upstreams.api",
            "expected a table, found string",
        );
    }

    #[test]
    fn ca_file_must_be_readable() {
        let dir = spec_example_dir();
        let path = dir.join("proxy.toml");
        let text = "[upstreams.api]\nurl = \"https://a\"\nca_file = \"certs/missing.pem\"\n";
        let e = one_error_of(load_str(&path, text, &no_env));
        assert_eq!(
            (e.line, e.col, e.field.as_str()),
            (3, 11, "upstreams.api.ca_file")
        );
        assert!(e.message.contains("missing.pem"), "{}", e.message);
        let text = "[upstreams.api]\nurl = \"https://a\"\nca_file = \"certs\"\n";
        let e = one_error_of(load_str(&path, text, &no_env));
        assert!(e.message.contains("not a regular file"), "{}", e.message);
        // Absolute paths are taken as they are.
        let abs = dir.join("certs/internal-ca.pem");
        let text = format!(
            "[upstreams.api]\nurl = \"https://a\"\nca_file = \"{}\"\n",
            abs.display()
        );
        let c = load_str(Path::new("/elsewhere/proxy.toml"), &text, &no_env).expect("valid");
        assert_eq!(c.upstreams[0].ca_file.as_deref(), Some(&*abs));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn duplicate_route_names() {
        let text = format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n[[routes]]\nname = \"x\"\nupstream = \"api\"\n[[routes]]\nname = \"r\"\nupstream = \"api\"\n"
        );
        assert_error(
            &text,
            10,
            8,
            "routes[2].name",
            "duplicate route name \"r\" (first used by routes[0])",
        );
    }

    #[test]
    fn names_and_scopes_charset() {
        let text = format!("{UPSTREAM}[[routes]]\nname = \"a b\"\nupstream = \"api\"\n");
        assert_error(&text, 4, 8, "routes[0].name", "may contain only");
        let text = format!("{UPSTREAM}[[routes]]\nname = \"\"\nupstream = \"api\"\n");
        assert_error(&text, 4, 8, "routes[0].name", "must not be empty");
        let text = route_with_limit("key = \"ip\"\nrequests = 1\nwindow = \"1s\"\nscope = \"a:b\"");
        assert_error(
            &text,
            10,
            9,
            "routes[0].limits[0].scope",
            "may contain only",
        );
    }

    #[test]
    fn missing_required_fields_point_at_the_table_header() {
        let text = format!(
            "{UPSTREAM}\n[[routes]]\npath_prefix = \"/\"\n  [[routes.limits]]\n  shadow = true\n"
        );
        let errs = positions(&text);
        assert_eq!(
            errs,
            [
                (4, 1, "routes[0].name".to_string()),
                (4, 1, "routes[0].upstream".to_string()),
                (6, 3, "routes[0].limits[0].key".to_string()),
                (6, 3, "routes[0].limits[0].requests".to_string()),
                (6, 3, "routes[0].limits[0].window".to_string()),
            ]
        );
        assert_error("[admin]\n", 1, 1, "admin.listen", "missing required field");
        let dir = spec_example_dir();
        let e = one_error_of(load_str(
            &dir.join("p.toml"),
            "[server]\ntls_listen = [\"0.0.0.0:1\"]\n[[server.certs]]\ncert = \"certs/example.pem\"\n",
            &no_env,
        ));
        assert_eq!(
            (e.line, e.col, e.field.as_str()),
            (3, 1, "server.certs[0].key")
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn bucket_prefix_conflicts() {
        // Same scope and label with other values in another route: error at the later one.
        let text = format!(
            "{UPSTREAM}[[routes]]\nname = \"a\"\nupstream = \"api\"\n[[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"\nscope = \"shared\"\n[[routes]]\nname = \"b\"\nupstream = \"api\"\n[[routes.limits]]\nkey = [\"ip\"]\nrequests = 6\nwindow = \"1h\"\nscope = \"shared\"\n"
        );
        let e = one_error(&text);
        assert_eq!(
            (e.line, e.col, e.field.as_str()),
            (14, 1, "routes[1].limits[0]")
        );
        assert!(
            e.message
                .starts_with("conflicts with routes[0].limits[0] (route \"a\")"),
            "{}",
            e.message
        );
        assert!(e.message.contains("\"shared:ip\""), "{}", e.message);
        // The same values: a budget shared on purpose.
        let shared = text.replace("requests = 6", "requests = 5");
        let c = load_ok(&shared);
        assert_eq!(c.routes[1].limits[0].policy_name(), "shared:ip");
        // A different window conflicts too.
        let e = one_error(&shared.replacen("window = \"1h\"", "window = \"30m\"", 1));
        assert_eq!(e.field, "routes[1].limits[0]");
        assert!(e.message.contains("window = \"1h\""), "{}", e.message);
        let e = one_error(&format!("{shared}[[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"2h\"\nscope = \"shared\"\n"));
        assert_eq!(
            (e.line, e.col, e.field.as_str()),
            (19, 1, "routes[1].limits[1]")
        );
        // Default scopes are route names, so different routes do not collide.
        let c = load_ok(&text.replace("scope = \"shared\"\n", ""));
        assert_eq!(c.routes[0].limits[0].scope, "a");
        assert_eq!(c.routes[1].limits[0].scope, "b");
    }

    #[test]
    fn same_bucket_twice_in_one_route() {
        let text = route_with_limit(
            "key = \"ip\"\nrequests = 5\nwindow = \"1h\"\n[[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"",
        );
        assert_error(
            &text,
            10,
            1,
            "routes[0].limits[1]",
            "counts the same bucket \"r:ip\" as routes[0].limits[0]",
        );
        // Different labels or scopes are fine.
        let text = route_with_limit(
            "key = \"ip\"\nrequests = 5\nwindow = \"1h\"\n[[routes.limits]]\nkey = \"ip\"\nrequests = 50\nwindow = \"1d\"\nscope = \"daily\"\n[[routes.limits]]\nkey = [\"header:X-Tenant\", \"ip\"]\nrequests = 5\nwindow = \"1h\"",
        );
        let c = load_ok(&text);
        let names: Vec<String> = c.routes[0]
            .limits
            .iter()
            .map(LimitConfig::policy_name)
            .collect();
        assert_eq!(names, ["r:ip", "daily:ip", "r:x-tenant+ip"]);
    }

    #[test]
    fn key_specs() {
        assert_eq!(parse_key_part("ip"), Ok(KeyPart::Ip));
        assert_eq!(parse_key_part("global"), Ok(KeyPart::Global));
        assert_eq!(
            parse_key_part("header:Authorization"),
            Ok(KeyPart::Header(http::header::AUTHORIZATION))
        );
        for bad in [
            "",
            "IP",
            "header:",
            "header:a b",
            "header:é",
            "cookie:x",
            "header",
        ] {
            assert!(parse_key_part(bad).is_err(), "{bad:?}");
        }
        let limit =
            |key: &str| route_with_limit(&format!("key = {key}\nrequests = 1\nwindow = \"1s\""));
        let c = load_ok(&limit("[\"global\"]"));
        assert!(c.routes[0].limits[0].key.is_global());
        assert_error(
            &limit("[]"),
            7,
            7,
            "routes[0].limits[0].key",
            "at least one",
        );
        assert_error(
            &limit("[\"ip\", \"global\"]"),
            7,
            14,
            "routes[0].limits[0].key[1]",
            "cannot be combined",
        );
        assert_error(
            &limit("[\"header:A\", \"header:a\"]"),
            7,
            20,
            "routes[0].limits[0].key[1]",
            "listed twice",
        );
        assert_error(
            &limit("\"ipv4\""),
            7,
            7,
            "routes[0].limits[0].key",
            "unknown key \"ipv4\"",
        );
        assert_error(
            &limit("7"),
            7,
            7,
            "routes[0].limits[0].key",
            "expected a string or an array of strings, found integer",
        );
        assert_error(
            &limit("[7]"),
            7,
            8,
            "routes[0].limits[0].key[0]",
            "expected a string, found integer",
        );
    }

    #[test]
    fn requests_range() {
        let limit =
            |r: &str| route_with_limit(&format!("key = \"ip\"\nrequests = {r}\nwindow = \"1s\""));
        assert_eq!(
            load_ok(&limit("2147483647")).routes[0].limits[0].requests,
            i32::MAX as u32
        );
        assert_error(
            &limit("0"),
            8,
            12,
            "routes[0].limits[0].requests",
            "between 1 and 2147483647",
        );
        assert_error(
            &limit("2147483648"),
            8,
            12,
            "routes[0].limits[0].requests",
            "between 1",
        );
        assert_error(
            &limit("-1"),
            8,
            12,
            "routes[0].limits[0].requests",
            "between 1",
        );
        assert_error(
            &limit("5.0"),
            8,
            12,
            "routes[0].limits[0].requests",
            "expected an integer, found float",
        );
        assert_error(
            &limit("\"5\""),
            8,
            12,
            "routes[0].limits[0].requests",
            "expected an integer, found string",
        );
    }

    #[test]
    fn tls_listen_needs_certs() {
        assert_error(
            "[server]\ntls_listen = [\"0.0.0.0:8443\"]\n",
            2,
            14,
            "server.tls_listen",
            "[[server.certs]]",
        );
        assert_error(
            "[server]\ntls_listen = [\"0.0.0.0:8443\"]\ncerts = []\n",
            3,
            9,
            "server.certs",
            "at least one certificate",
        );
    }

    #[test]
    fn cert_files_must_be_readable_and_resolve_relative_to_the_file() {
        let dir = spec_example_dir();
        let path = dir.join("proxy.toml");
        let text = "[server]\ntls_listen = [\"0.0.0.0:8443\"]\n[[server.certs]]\ncert = \"certs/example.pem\"\nkey = \"certs/example.key\"\n[[server.certs]]\ncert = \"certs/nope.pem\"\nkey = \"/nonexistent/tollgate/x.key\"\n";
        let errs = positions_of(load_str(&path, text, &no_env));
        assert_eq!(
            errs,
            [
                (7, 8, "server.certs[1].cert".to_string()),
                (8, 7, "server.certs[1].key".to_string()),
            ]
        );
        let e = load_str(&path, text, &no_env).expect_err("invalid");
        assert!(e.0[0]
            .message
            .contains(&*dir.join("certs/nope.pem").display().to_string()));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn trusted_proxies() {
        assert_eq!(
            parse_cidr("10.0.0.0/8").map(|n| n.to_string()),
            Ok("10.0.0.0/8".into())
        );
        assert_eq!(
            parse_cidr("::1").map(|n| n.to_string()),
            Ok("::1/128".into())
        );
        for bad in [
            "10.0.0.0/33",
            "10.0.0",
            "example.com",
            "",
            "10.0.0.0/",
            "::/129",
        ] {
            assert!(parse_cidr(bad).is_err(), "{bad:?}");
        }
        assert_error(
            "[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n",
            2,
            34,
            "server.trusted_proxies[1]",
            "not a CIDR",
        );
    }

    #[test]
    fn proxy_protocol_from() {
        let config = load_ok(
            "[server]\n[server.proxy_protocol]\nfrom = [\"10.0.0.0/8\", \"2001:db8::1\"]\n",
        );
        let from: Vec<String> = config
            .server
            .proxy_protocol
            .expect("proxy_protocol")
            .from
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(from, ["10.0.0.0/8", "2001:db8::1/128"]);
        assert!(load_ok("[server]\n").server.proxy_protocol.is_none());
        assert_error(
            "[server.proxy_protocol]\nfrom = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n",
            2,
            23,
            "server.proxy_protocol.from[1]",
            "not a CIDR",
        );
        assert_error(
            "[server.proxy_protocol]\nfrom = []\n",
            2,
            8,
            "server.proxy_protocol.from",
            "empty",
        );
        assert_error(
            "[server.proxy_protocol]\nfrom = [\"10.0.0.1\"]\nfrm = [\"10.0.0.1\"]\n",
            3,
            1,
            "server.proxy_protocol.frm",
            "did you mean `from`",
        );
        let missing = one_error("[server.proxy_protocol]\n");
        assert_eq!(missing.field, "server.proxy_protocol.from");
        assert!(
            missing.message.contains("missing required field"),
            "{missing}"
        );
    }

    #[test]
    fn listeners() {
        assert_error(
            "[server]\nlisten = [\"localhost:80\"]\n",
            2,
            11,
            "server.listen[0]",
            "not a socket address",
        );
        assert_error(
            "[server]\nlisten = \"0.0.0.0:80\"\n",
            2,
            10,
            "server.listen",
            "expected an array, found string",
        );
        assert_error(
            "[server]\nlisten = []\n",
            2,
            10,
            "server.listen",
            "no listeners",
        );
        assert_error(
            "[server]\nlisten = [\"0.0.0.0:80\", \"127.0.0.1:0\", \"127.0.0.1:0\", \"0.0.0.0:80\"]\n",
            2,
            55,
            "server.listen[3]",
            "already listed at server.listen[0]",
        );
        assert_error(
            "[server]\nlisten = [\"127.0.0.1:80\"]\n[admin]\nlisten = \"127.0.0.1:80\"\n",
            4,
            10,
            "admin.listen",
            "also a server listener",
        );
        assert_error(
            "[admin]\nlisten = 80\n",
            2,
            10,
            "admin.listen",
            "expected a string",
        );
        // Reported alongside unrelated errors, not only once the rest is valid.
        assert_eq!(
            positions("[server]\nlisten = [\"127.0.0.1:80\"]\n[admin]\nlisten = \"127.0.0.1:80\"\n[store]\npool_size = 0\n"),
            [
                (4, 10, "admin.listen".to_string()),
                (6, 13, "store.pool_size".to_string())
            ]
        );
        // An empty plain list is fine next to TLS listeners (checked elsewhere for certs).
        let e = one_error("[server]\nlisten = []\ntls_listen = [\"0.0.0.0:1\"]\n");
        assert_eq!(e.field, "server.tls_listen");
    }

    #[test]
    fn server_ranges_and_choices() {
        assert_error(
            "[server]\nipv6_prefix = 0\n",
            2,
            15,
            "server.ipv6_prefix",
            "between 1 and 128",
        );
        assert_error(
            "[server]\nipv6_prefix = 129\n",
            2,
            15,
            "server.ipv6_prefix",
            "between 1 and 128",
        );
        assert_error(
            "[server]\nmax_connections = 0\n",
            2,
            19,
            "server.max_connections",
            "between 1",
        );
        for bad in ["0", "1025"] {
            assert_error(
                &format!("[server]\nworkers = {bad}\n"),
                2,
                11,
                "server.workers",
                "between 1 and 1024",
            );
        }
        assert_error(
            "[server]\nrate_limit_headers = \"ietf\"\n",
            2,
            22,
            "server.rate_limit_headers",
            "expected one of \"draft\", \"legacy\", \"both\", \"none\", got \"ietf\"",
        );
        assert_error(
            "[store]\npool_size = 0\n",
            2,
            13,
            "store.pool_size",
            "between 1 and 1024",
        );
        assert_error(
            "[store]\npool_size = 1025\n",
            2,
            13,
            "store.pool_size",
            "between 1 and 1024",
        );
        assert_error(
            "[store]\non_error = \"open\"\n",
            2,
            12,
            "store.on_error",
            "\"allow\", \"deny\"",
        );
        assert_error(
            "[store]\nmigrate = \"yes\"\n",
            2,
            11,
            "store.migrate",
            "expected a boolean",
        );
        assert_error(
            "[store]\nsynchronous_commit = true\n",
            2,
            22,
            "store.synchronous_commit",
            "expected a string, found boolean",
        );
        assert_error(
            "server = []\n",
            1,
            10,
            "server",
            "expected a table, found array",
        );
    }

    #[test]
    fn hosts() {
        let exact = |s: &str| Ok(HostPattern::Exact(s.to_string()));
        assert_eq!(parse_host("API.Example.com"), exact("api.example.com"));
        assert_eq!(parse_host("localhost"), exact("localhost"));
        assert_eq!(parse_host("10.0.0.1"), exact("10.0.0.1"));
        assert_eq!(parse_host("[::1]"), exact("[::1]"));
        assert_eq!(parse_host("[0:0::1]"), exact("[::1]"));
        assert_eq!(parse_host("[2001:DB8::1]"), exact("[2001:db8::1]"));
        assert_eq!(
            parse_host("*.Example.com"),
            Ok(HostPattern::Suffix(".example.com".into()))
        );
        for bad in [
            "",
            "*",
            "*.",
            "a.*.com",
            "*example.com",
            "api.example.com:443",
            "https://api.example.com",
            "api..example.com",
            "api.example.com.",
            "-api.example.com",
            "api example.com",
            "api/x",
            "[::1]:80",
            "[nope]",
            "ex\u{e4}mple.com",
        ] {
            assert!(parse_host(bad).is_err(), "{bad:?} accepted");
        }
        let text =
            format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nhost = \"a.b:80\"\n");
        assert_error(&text, 6, 8, "routes[0].host", "must not contain a port");
    }

    #[test]
    fn path_prefixes() {
        for (s, want) in [
            ("/", "/"),
            ("/api", "/api"),
            ("/api/", "/api"),
            ("/a/b-c_d~e.f/", "/a/b-c_d~e.f"),
            ("/v1:batch", "/v1:batch"),
            ("/.well-known", "/.well-known"),
        ] {
            assert_eq!(parse_path_prefix(s).as_deref(), Ok(want), "{s}");
        }
        for bad in [
            "", "api", "/a?b", "/a#b", "/a/../b", "/a/./b", "/..", "/.", "//", "/a//b", "/a%2Fb",
            "/a b", "/\u{e9}", "/a\\b", "/a;b", "/a;", "/a/;x",
        ] {
            assert!(parse_path_prefix(bad).is_err(), "{bad:?} accepted");
        }
        let text = format!(
            "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\npath_prefix = \"api\"\n"
        );
        assert_error(&text, 6, 15, "routes[0].path_prefix", "must start with '/'");
    }

    #[test]
    fn methods() {
        let text = |m: &str| {
            format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nmethods = {m}\n")
        };
        let c = load_ok(&text("[\"get\", \"Post\", \"PURGE\"]"));
        assert_eq!(
            c.routes[0].methods,
            Some(vec![
                Method::GET,
                Method::POST,
                Method::from_bytes(b"PURGE").unwrap()
            ])
        );
        assert_error(
            &text("[]"),
            6,
            11,
            "routes[0].methods",
            "at least one method",
        );
        assert_error(
            &text("[\"GET\", \"get\"]"),
            6,
            19,
            "routes[0].methods[1]",
            "listed twice",
        );
        assert_error(
            &text("[\"GE T\"]"),
            6,
            12,
            "routes[0].methods[0]",
            "not an HTTP method",
        );
        assert_error(
            &text("\"GET\""),
            6,
            11,
            "routes[0].methods",
            "expected an array",
        );
    }

    #[test]
    fn reject_table() {
        let text = |r: &str| {
            format!(
                "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n[routes.reject]\n{r}\n"
            )
        };
        let c = load_ok(&text(
            "status = 503\ncontent_type = \"text/plain\"\nbody = \"no\"",
        ));
        let r = c.routes[0].reject.as_ref().expect("reject");
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.body, Bytes::from_static(b"no"));
        assert_error(
            &text("status = 200"),
            7,
            10,
            "routes[0].reject.status",
            "between 400 and 599",
        );
        assert_error(
            &text("status = 600"),
            7,
            10,
            "routes[0].reject.status",
            "between 400 and 599",
        );
        assert_error(
            &text("content_type = \"text/plain\\nX-Evil: 1\""),
            7,
            16,
            "routes[0].reject.content_type",
            "not a valid header value",
        );
        assert_error(
            &text("body = 1"),
            7,
            8,
            "routes[0].reject.body",
            "expected a string",
        );
    }

    #[test]
    fn route_flags() {
        let text = format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nstrip_prefix = true\nshadow = true\non_store_error = \"allow\"\n[[routes.limits]]\nkey = \"header:X-Api-Key\"\nrequests = 10\nwindow = \"1m\"\nshadow = true\n");
        let c = load_ok(&text);
        let r = &c.routes[0];
        assert!(r.strip_prefix && r.shadow);
        assert_eq!(r.on_store_error, Some(StoreErrorPolicy::Allow));
        assert!(r.limits[0].shadow);
        assert_eq!(r.limits[0].policy_name(), "r:x-api-key");
        assert_error(
            &format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nshadow = 1\n"),
            6,
            10,
            "routes[0].shadow",
            "expected a boolean",
        );
    }

    #[test]
    fn local_is_a_store_failure_policy() {
        let c = load_ok(&format!(
            "[store]\non_error = \"local\"\n{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\non_store_error = \"local\"\n"
        ));
        assert_eq!(c.store.on_error, StoreErrorPolicy::Local);
        assert_eq!(c.routes[0].on_store_error, Some(StoreErrorPolicy::Local));
        assert_error(
            "[store]\non_error = \"locally\"\n",
            2,
            12,
            "store.on_error",
            "\"allow\", \"deny\", \"local\"",
        );
    }

    #[test]
    fn inline_tables_are_accepted() {
        let c = load_ok(
            "upstreams = { api = { url = \"http://a\" } }\nroutes = [ { name = \"r\", upstream = \"api\", limits = [ { key = \"ip\", requests = 1, window = \"1s\" } ] } ]\n",
        );
        assert_eq!(c.routes[0].limits[0].policy_name(), "r:ip");
        assert_error(
            "routes = [ { name = \"r\", upstream = \"api\", limits = [ { key = \"ip\", requests = 1, window = \"1s\", burst = 2 } ] } ]\n[upstreams.api]\nurl = \"http://a\"\n",
            1,
            98,
            "routes[0].limits[0].burst",
            "unknown field",
        );
        assert_error(
            "routes = [1]\n",
            1,
            11,
            "routes[0]",
            "expected a table, found integer",
        );
        assert_error(
            "[routes]\nname = \"r\"\n",
            1,
            1,
            "routes",
            "expected an array of tables ([[routes]])",
        );
        assert_error(
            &format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nlimits = 3\n"),
            6,
            10,
            "routes[0].limits",
            "expected an array of tables ([[routes.limits]]), found integer",
        );
    }

    #[test]
    fn syntax_error_is_one_error_with_a_position() {
        let e = one_error("[server]\nlisten = [\"0.0.0.0:1\"\nidle_timeout = \"1s\"\n");
        assert_eq!((e.line, e.col, e.field.as_str()), (3, 1, ""));
        assert!(
            e.message.starts_with("TOML syntax error: "),
            "{}",
            e.message
        );
        assert!(!e.message.contains('\n'));
        assert_eq!(e.to_string(), format!("{FILE}:3:1: {}", e.message));
        // Duplicate tables are a TOML error too.
        let e = one_error(&format!("{UPSTREAM}{UPSTREAM}"));
        assert_eq!((e.line, e.col), (3, 1));
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        // "ü" is two bytes; the error column is still where an editor shows it.
        assert_error(
            "[server] # ü\nlisten = [\"ü\", \"0.0.0.0:1\"]\n",
            2,
            11,
            "server.listen[0]",
            "not a socket address",
        );
        assert_error("a = \"ü\" ; b = 1\n", 1, 9, "", "TOML syntax error");
    }

    #[test]
    fn several_problems_are_all_reported() {
        let text = format!(
            "[server]\nipv6_prefix = 200\nlisten = [\"nope\"]\n[store]\ntimeout = \"fast\"\n{UPSTREAM}http = 2\n[[routes]]\nname = \"r\"\nupstream = \"missing\"\n[[routes.limits]]\nkey = \"ip\"\nrequests = 0\nwindow = \"1500ms\"\n[[routes]]\nname = \"r\"\nupstream = \"api\"\npath_prefix = \"x\"\n"
        );
        let errs = positions(&text);
        let want = [
            (2, 15, "server.ipv6_prefix"),
            (3, 11, "server.listen[0]"),
            (5, 11, "store.timeout"),
            (8, 1, "upstreams.api.http"),
            (11, 12, "routes[0].upstream"),
            (14, 12, "routes[0].limits[0].requests"),
            (15, 10, "routes[0].limits[0].window"),
            (17, 8, "routes[1].name"),
            (19, 15, "routes[1].path_prefix"),
        ];
        let want: Vec<(usize, usize, String)> = want
            .iter()
            .map(|(l, c, f)| (*l, *c, f.to_string()))
            .collect();
        assert_eq!(errs, want);
    }

    #[test]
    fn load_file_reports_unreadable_files() {
        let path = Path::new("/nonexistent/tollgate/proxy.toml");
        let e = one_error_of(load_file(path, &no_env));
        assert_eq!((e.line, e.col, e.field.as_str()), (0, 0, ""));
        assert!(e.message.starts_with("cannot read: "), "{}", e.message);
        assert_eq!(
            e.to_string(),
            format!("/nonexistent/tollgate/proxy.toml: {}", e.message)
        );
        // A directory is not a file either.
        let dir = temp_dir();
        assert!(load_file(&dir, &no_env).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn display_formats() {
        let e = ConfigError {
            file: "p.toml".into(),
            line: 3,
            col: 7,
            field: "routes[0].name".into(),
            message: "bad".into(),
        };
        assert_eq!(e.to_string(), "p.toml:3:7: routes[0].name: bad");
        let errs = ConfigErrors(vec![e.clone(), ConfigError { line: 4, ..e }]);
        assert_eq!(
            errs.to_string(),
            "p.toml:3:7: routes[0].name: bad\np.toml:4:7: routes[0].name: bad"
        );
        let _: &dyn std::error::Error = &errs;
    }

    #[test]
    fn format_secs_for_messages() {
        assert_eq!(format_secs(1), "1s");
        assert_eq!(format_secs(90), "90s");
        assert_eq!(format_secs(120), "2m");
        assert_eq!(format_secs(3600), "1h");
        assert_eq!(format_secs(86_400 * 2), "2d");
    }

    /// Hostile input must never panic: every prefix of a full file, and some junk.
    #[test]
    fn no_panic_on_truncated_or_odd_input() {
        let env = env_of(&[("TOLLGATE_KEY_SECRET", "k")]);
        // A sample of the cuts and changes that the `config` fuzz target (fuzz/) explores
        // exhaustively: cutting at every byte took 12 s of every `cargo test`. The odd
        // strides still land inside keys, values, strings, table headers and line ends.
        let mut cut = 0;
        while cut <= SPEC_EXAMPLE.len() {
            if let Some(prefix) = SPEC_EXAMPLE.get(..cut) {
                let _ = load_str(Path::new(FILE), prefix, &env);
            }
            cut += 7;
        }
        for junk in [
            "\u{feff}",
            "\0",
            "[[routes]]\n[[routes.limits]]\n[[routes.limits]]\n",
            "routes = [[]]\n",
            "server.listen = [[1]]\n",
            "[routes.limits]\n",
            "upstreams.api.url.x = 1\n",
            "[server]\nmax_connections = 9223372036854775807\n",
            "[server]\nidle_timeout = \"18446744073709551615ms\"\n",
            "[[routes]]\nlimits = [{key = [[\"ip\"]]}]\n",
            "a = \"\\u00e9\" \n\r\n",
        ] {
            let _ = load_str(Path::new(FILE), junk, &env);
        }
        // Deep nesting is refused by the parser's recursion limit, not by a stack overflow.
        let deep = format!("a = {}1{}\n", "[".repeat(5000), "]".repeat(5000));
        assert!(load(&deep).is_err());
        let deep = format!("a = {}\n", "{ b = ".repeat(5000));
        assert!(load(&deep).is_err());
        // Every 37th character of a full file replaced by something syntactically loaded.
        let chars: Vec<char> = SPEC_EXAMPLE.chars().collect();
        for i in (0..chars.len()).step_by(37) {
            for c in ['"', '[', ']', '=', '\n', '$', '{', '}', '0', '.'] {
                let mut m = chars.clone();
                m[i] = c;
                let text: String = m.into_iter().collect();
                let _ = load_str(Path::new(FILE), &text, &env);
            }
        }
    }

    /// Every `tests/fixtures/bad_*.toml` produces exactly the errors its `# expect:` lines
    /// list, as `LINE:COL: field.path` (the field is empty for a TOML syntax error).
    #[test]
    fn fixtures() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
            .expect("fixtures directory")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("bad_") && n.ends_with(".toml"))
            })
            .collect();
        entries.sort();
        assert!(entries.len() >= 10, "only {} fixtures", entries.len());
        for path in entries {
            let text = std::fs::read_to_string(&path).expect("read fixture");
            let want: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("# expect:"))
                .map(|l| l.trim().to_string())
                .collect();
            assert!(!want.is_empty(), "{}: no # expect: line", path.display());
            let got: Vec<String> = match load_file(&path, &no_env) {
                Ok(_) => panic!("{} was accepted", path.display()),
                Err(e) => {
                    e.0.iter()
                        .map(|e| {
                            format!("{}:{}: {}", e.line, e.col, e.field)
                                .trim()
                                .to_string()
                        })
                        .collect()
                }
            };
            assert_eq!(got, want, "{}", path.display());
        }
    }
}
