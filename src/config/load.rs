//! Loading `proxy.toml` into a validated [`Config`] (SPEC section 2).
//!
//! This module owns everything between the bytes of the file and the typed [`Config`]:
//! TOML parsing (with positions), `${NAME}` expansion, unknown-key detection, type and range
//! checks, defaults, and the cross-field checks (a route's upstream exists, route names are
//! unique, two limits that write the same bucket prefix agree on `requests` and `window`).
//! The syntax of single values (durations, hosts, ...) lives in [`super::syntax`].
//!
//! The file is hostile input and the operator wants to fix it in one pass, so nothing here
//! stops at the first problem: every check runs, every problem becomes a [`ConfigError`] with
//! `FILE:LINE:COL: field.path: message`, and a [`Config`] is returned only when there are none.
//! A reader that finds a bad value reports it and carries on with the default, so the rest of
//! the file is still checked; checks across fields run only on values that were valid, so one
//! mistake is never reported twice.
//!
//! Why not serde: serde stops at the first error, and the spanned-tree crates tried instead
//! (toml-span, toml 0.9's `DeTable`) either overflow the stack on deeply nested arrays or put
//! a duplicate table elsewhere than today's tests pin. toml_edit already keeps the position of
//! every key and value, so the document is walked directly, one [`TableReader`] per table.
//!
//! Positions: lines and columns are 1-based; columns count characters (not bytes), as editors
//! do. Field paths use TOML dotted keys with 0-based indices into arrays:
//! `routes[2].limits[0].window`, `upstreams.api.url`, `server.listen[1]`.
//!
//! The loader never reads the process environment itself: `${NAME}` references and the
//! `TOLLGATE_DATABASE_URL` override go through the `env` function the caller passes, so tests
//! need no `std::env::set_var` and `main` stays the only place that touches the environment.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use ipnet::IpNet;
use toml_edit::{ImDocument, Item, Table, TableLike, Value};

use super::syntax::{
    check_name, expand, format_secs, parse_algorithm, parse_cidr, parse_host, parse_key_part,
    parse_origin, parse_path_prefix, parse_socket_addr, parse_window, positive_duration,
    positive_size,
};
use super::{
    AdminConfig, Algorithm, CertConfig, Config, KeyPart, KeySpec, KeysConfig, LimitConfig,
    ProxyProtocolConfig, RateLimitHeaders, RejectConfig, RouteConfig, ServerConfig, StoreConfig,
    StoreErrorPolicy, UpstreamConfig, DEFAULT_MEMORY_BUCKETS, MAX_MEMORY_BUCKETS,
};

/// The environment lookup the caller provides (`std::env::var(..).ok()` in `main`).
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A byte range in the source text, when toml_edit knows one.
type Span = Option<Range<usize>>;

/// Environment variable that overrides `store.url` when set and non-empty (SPEC section 2).
pub const DATABASE_URL_ENV: &str = "TOLLGATE_DATABASE_URL";

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

const STORE_POLICIES: &[(&str, StoreErrorPolicy)] = &[
    ("allow", StoreErrorPolicy::Allow),
    ("deny", StoreErrorPolicy::Deny),
    ("local", StoreErrorPolicy::Local),
];

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
        Err(e) => {
            let mut cx = Cx::new(path, "", env);
            cx.error_unplaced("", format!("cannot read: {e}"));
            Err(cx.take_errors())
        }
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
            let message: Vec<&str> = e.message().lines().map(str::trim).collect();
            let message = message.into_iter().filter(|l| !l.is_empty());
            let message = message.collect::<Vec<_>>().join(": ");
            cx.error(&e.span(), "", format!("TOML syntax error: {message}"));
            return Err(cx.take_errors());
        }
    };
    let root = TableReader::new(doc.as_table(), String::new(), Some(0..0));
    let cx = &mut cx;
    let server = root.table(cx, "server");
    let server = read_server(cx, server);
    let admin = root.opt(cx, "admin", |cx, n| read_admin(cx, n, &server));
    let store = root.table(cx, "store");
    let store = read_store(cx, store);
    let keys = root.table(cx, "keys");
    let keys = read_keys(cx, keys);
    let (upstreams, index) = read_upstreams(cx, root.get("upstreams"));
    let routes = root.opt(cx, "routes", |cx, n| read_routes(cx, n, &index));
    root.finish(cx);
    if !cx.errors.is_empty() {
        return Err(cx.take_errors());
    }
    Ok(Config {
        source: path.to_path_buf(),
        server,
        admin,
        store,
        keys,
        upstreams,
        routes: routes.unwrap_or_default(),
    })
}

// ---------------------------------------------------------------------------------------------
// Error collection, positions and typed values

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
        self.push(line, col, field, message.into());
    }

    /// An error that has no place in the file (it comes from the environment).
    fn error_unplaced(&mut self, field: &str, message: impl Into<String>) {
        self.push(0, 0, field, message.into());
    }

    fn push(&mut self, line: usize, col: usize, field: &str, message: String) {
        let (file, field) = (self.file.clone(), field.to_string());
        self.errors.push(ConfigError {
            file,
            line,
            col,
            field,
            message,
        });
    }

    fn take_errors(&mut self) -> ConfigErrors {
        // Readers run section by section; file order is what an operator fixing the file
        // wants. The sort is stable, so errors at one place keep the order they were found in.
        self.errors.sort_by_key(|e| (e.line, e.col));
        ConfigErrors(std::mem::take(&mut self.errors))
    }

    fn type_error(&mut self, node: &Node<'_>, expected: &str) {
        let found = node.type_name();
        let message = format!("expected {expected}, found {found}");
        self.error(&node.span, &node.path, message);
    }

    /// The value of `result`, or None after reporting its message at `node`.
    fn check<T, E: Into<String>>(&mut self, node: &Node<'_>, result: Result<T, E>) -> Option<T> {
        result
            .map_err(|m| self.error(&node.span, &node.path, m))
            .ok()
    }

    /// `items`, or None after reporting `message` when there are none.
    fn non_empty<T>(&mut self, node: &Node<'_>, items: Vec<T>, message: &str) -> Option<Vec<T>> {
        self.check(
            node,
            if items.is_empty() {
                Err(message)
            } else {
                Ok(items)
            },
        )
    }

    // Typed values: each reports its own errors and returns None after reporting.

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

    /// A string read by one of the value syntaxes in [`super::syntax`].
    fn parse<T>(
        &mut self,
        node: &Node<'_>,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Option<T> {
        let s = self.string(node)?;
        self.check(node, parse(&s))
    }

    /// An integer in `min..=max`, converted to the field's type (always possible in range).
    fn int<T: TryFrom<i64>>(&mut self, node: &Node<'_>, min: i64, max: i64) -> Option<T> {
        let Some(Value::Integer(i)) = node.value() else {
            self.type_error(node, "an integer");
            return None;
        };
        let i = *i.value();
        if i < min || i > max {
            let message = format!("must be between {min} and {max}, got {i}");
            self.error(&node.span, &node.path, message);
            return None;
        }
        T::try_from(i).ok()
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
        let found = options.iter().find(|(name, _)| *name == s).map(|(_, v)| *v);
        if found.is_none() {
            let names: Vec<String> = options.iter().map(|(n, _)| format!("{n:?}")).collect();
            let message = format!("expected one of {}, got {s:?}", names.join(", "));
            self.error(&node.span, &node.path, message);
        }
        found
    }

    /// A duration string, greater than zero and at most 366 days.
    fn duration(&mut self, node: &Node<'_>) -> Option<Duration> {
        self.parse(node, positive_duration)
    }

    /// A size (`"10MiB"`), greater than zero.
    fn size(&mut self, node: &Node<'_>) -> Option<u64> {
        self.parse(node, positive_size)
    }

    fn socket_addr(&mut self, node: &Node<'_>) -> Option<SocketAddr> {
        self.parse(node, parse_socket_addr)
    }

    /// A name that ends up in metric labels and bucket strings.
    fn name(&mut self, node: &Node<'_>, what: &str) -> Option<String> {
        self.parse(node, |s| check_name(s, what).map(|()| s.to_string()))
    }

    /// The elements of an array, each with its own path and span.
    fn array<'d>(&mut self, node: &Node<'d>) -> Option<Vec<Node<'d>>> {
        let Some(Value::Array(a)) = node.value() else {
            self.type_error(node, "an array");
            return None;
        };
        let elements = a.iter().enumerate();
        Some(
            elements
                .map(|(i, v)| node.element(i, Raw::Value(v), v.span()))
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
        let parsed: Vec<Option<T>> = self.array(node)?.iter().map(|e| parse(self, e)).collect();
        parsed.into_iter().collect()
    }

    /// A `[[name]]` array of tables (or an array of inline tables, which TOML treats alike).
    fn tables<'d>(&mut self, node: &Node<'d>) -> Option<Vec<Node<'d>>> {
        match node.raw {
            Raw::Item(Item::ArrayOfTables(a)) => {
                let elements = a.iter().enumerate();
                Some(
                    elements
                        .map(|(i, t)| node.element(i, Raw::Table(t), t.span()))
                        .collect(),
                )
            }
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
            return self.check(node, Err("must not be empty"));
        }
        let path = self.base_dir.join(&s);
        // Opening proves readability for this user; the metadata check catches directories,
        // which open fine on Unix but cannot be read as PEM.
        let problem = match std::fs::File::open(&path).and_then(|f| f.metadata()) {
            Ok(m) if m.is_file() => return Some(path),
            Ok(_) => "is not a regular file".to_string(),
            Err(e) => e.to_string(),
        };
        self.check(
            node,
            Err(format!("cannot read {}: {problem}", path.display())),
        )
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

    /// Element `i` of this array; it has the array's span when it has none of its own.
    fn element(&self, i: usize, raw: Raw<'d>, span: Span) -> Node<'d> {
        let path = format!("{}[{i}]", self.path);
        let span = span.or_else(|| self.span.clone());
        Node { raw, path, span }
    }
}

/// Reads one table: hands out its fields by name and, at the end, reports every key nobody
/// asked for. A typo must be an error, not a silently ignored limit. The keys a table knows
/// are exactly those its reader asks for (every reader asks for all of them, whatever the
/// file holds), so the list of known keys cannot drift from the code that reads them.
struct TableReader<'d> {
    /// None for an absent table (or one that is not a table), which yields only defaults.
    table: Option<&'d dyn TableLike>,
    path: String,
    /// Where "missing required field" points: the table's header.
    span: Span,
    /// Every key asked for so far, in the order asked.
    known: RefCell<Vec<&'static str>>,
}

impl<'d> TableReader<'d> {
    fn new(table: &'d dyn TableLike, path: String, span: Span) -> Self {
        let known = RefCell::default();
        let table = Some(table);
        TableReader {
            table,
            path,
            span,
            known,
        }
    }

    /// A reader over `node`; None (after reporting) when it is not a table.
    fn of(cx: &mut Cx<'_>, node: &Node<'d>) -> Option<Self> {
        let Some(table) = node.table_like() else {
            cx.type_error(node, "a table");
            return None;
        };
        Some(TableReader::new(
            table,
            node.path.clone(),
            node.span.clone(),
        ))
    }

    /// The sub-table `key`; absent, or not a table (reported), it reads as an empty table.
    fn table(&self, cx: &mut Cx<'_>, key: &'static str) -> TableReader<'d> {
        let node = self.get(key);
        let reader = node.and_then(|n| TableReader::of(cx, &n));
        reader.unwrap_or_else(|| TableReader {
            table: None,
            path: self.field_path(key),
            span: None,
            known: RefCell::default(),
        })
    }

    fn field_path(&self, key: &str) -> String {
        join_path(&self.path, key)
    }

    fn get(&self, key: &'static str) -> Option<Node<'d>> {
        self.known.borrow_mut().push(key);
        let (k, item) = self.table?.get_key_value(key)?;
        if item.is_none() {
            return None;
        }
        let (path, span) = (self.field_path(key), item.span().or_else(|| k.span()));
        let raw = Raw::Item(item);
        Some(Node { raw, path, span })
    }

    /// The field `key`, reported as missing when absent.
    fn require(&self, cx: &mut Cx<'_>, key: &'static str) -> Option<Node<'d>> {
        let node = self.get(key);
        if node.is_none() {
            cx.error(&self.span, &self.field_path(key), "missing required field");
        }
        node
    }

    /// A required field read by `read`; None when missing or invalid (both reported).
    fn req<'a, T>(
        &self,
        cx: &mut Cx<'a>,
        key: &'static str,
        read: impl FnOnce(&mut Cx<'a>, &Node<'d>) -> Option<T>,
    ) -> Option<T> {
        self.require(cx, key).and_then(|n| read(cx, &n))
    }

    /// An optional field read by `read`; None when absent or invalid (reported).
    fn opt<'a, T>(
        &self,
        cx: &mut Cx<'a>,
        key: &'static str,
        read: impl FnOnce(&mut Cx<'a>, &Node<'d>) -> Option<T>,
    ) -> Option<T> {
        self.get(key).and_then(|n| read(cx, &n))
    }

    /// An optional field with a default, which also stands in for an invalid value (reported).
    fn or<'a, T>(
        &self,
        cx: &mut Cx<'a>,
        key: &'static str,
        default: T,
        read: impl FnOnce(&mut Cx<'a>, &Node<'d>) -> Option<T>,
    ) -> T {
        self.opt(cx, key, read).unwrap_or(default)
    }

    /// Reports every key that was not asked for.
    fn finish(self, cx: &mut Cx<'_>) {
        let Some(table) = self.table else { return };
        let known = self.known.borrow();
        for (key, item) in table.iter() {
            if known.iter().any(|k| *k == key) {
                continue;
            }
            let key_span = table.key(key).and_then(|k| k.span());
            let span = key_span
                .or_else(|| item.span())
                .or_else(|| self.span.clone());
            let hint = match closest(key, &known) {
                Some(k) => format!("; did you mean `{k}`?"),
                None => format!("; expected one of: {}", known.join(", ")),
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
    let mut in_index = false;
    let keep = |c: &char| match c {
        '[' | ']' => {
            in_index = *c == '[';
            false
        }
        _ => !in_index,
    };
    path.chars().filter(keep).collect()
}

/// The known key closest to a typo, if it is close enough to be a plausible misspelling.
fn closest<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    known
        .iter()
        .map(|k| (strsim::levenshtein(key, k), *k))
        .filter(|(d, k)| *d <= if k.len() <= 4 { 1 } else { 2 })
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

// ---------------------------------------------------------------------------------------------
// Sections

/// `[server]`. Defaults are listed on [`load_str`].
fn read_server(cx: &mut Cx<'_>, t: TableReader<'_>) -> ServerConfig {
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
            let span = listen_node.as_ref().or(tls_node.as_ref());
            let span = span.and_then(|n| n.span.clone());
            let message = "no listeners: listen and tls_listen are both empty";
            cx.error(&span, "server.listen", message);
        }
        check_duplicate_addrs(cx, &[(listen_node.as_ref(), l), (tls_node.as_ref(), tl)]);
    }
    let certs_node = t.get("certs");
    let certs = certs_node.as_ref().map(|n| read_certs(cx, n));
    if tls_listen.as_ref().is_some_and(|tl| !tl.is_empty()) {
        match (&tls_node, &certs_node, &certs) {
            (Some(tn), None, _) => {
                let message = "TLS listeners need at least one [[server.certs]] entry";
                cx.error(&tn.span, &tn.path, message);
            }
            (_, Some(cn), Some(Some(c))) if c.is_empty() => {
                let message = "TLS listeners need at least one certificate";
                cx.error(&cn.span, &cn.path, message);
            }
            _ => {}
        }
    }
    let header_options = [
        ("draft", RateLimitHeaders::Draft),
        ("legacy", RateLimitHeaders::Legacy),
        ("both", RateLimitHeaders::Both),
        ("none", RateLimitHeaders::None),
    ];
    let server = ServerConfig {
        listen: listen.unwrap_or_default(),
        tls_listen: tls_listen.unwrap_or_default(),
        trusted_proxies: t.or(cx, "trusted_proxies", Vec::new(), cidr_list),
        ipv6_prefix: t.or(cx, "ipv6_prefix", 64, |cx, n| cx.int(n, 1, 128)),
        header_read_timeout: t.or(cx, "header_read_timeout", secs(10), Cx::duration),
        idle_timeout: t.or(cx, "idle_timeout", secs(60), Cx::duration),
        max_connections: t.or(cx, "max_connections", 10_000, |cx, n| {
            cx.int(n, 1, MAX_CONNECTIONS)
        }),
        shutdown_timeout: t.or(cx, "shutdown_timeout", secs(30), Cx::duration),
        rate_limit_headers: t.or(
            cx,
            "rate_limit_headers",
            RateLimitHeaders::Draft,
            |cx, n| cx.choice(n, &header_options),
        ),
        underscores_in_headers: t.or(cx, "underscores_in_headers", false, Cx::boolean),
        max_body_size: t.opt(cx, "max_body_size", Cx::size),
        // Absent = one worker per CPU the process may run on, decided at start.
        workers: t.opt(cx, "workers", |cx, n| cx.int(n, 1, MAX_WORKERS)),
        certs: certs.flatten().unwrap_or_default(),
        proxy_protocol: t.opt(cx, "proxy_protocol", read_proxy_protocol),
    };
    t.finish(cx);
    server
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// A list of CIDRs (or bare addresses), each bad one reported at its place.
fn cidr_list(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Vec<IpNet>> {
    cx.list(node, |cx, e| cx.parse(e, parse_cidr))
}

/// `[server.proxy_protocol]` (SPEC 4): `from` is required and not empty, since a table that
/// names no balancer would do nothing, which is more likely a mistake than a wish.
fn read_proxy_protocol(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<ProxyProtocolConfig> {
    let t = TableReader::of(cx, node)?;
    let from = t.req(cx, "from", |cx, n| {
        let nets = cidr_list(cx, n)?;
        let message = "empty: list the balancers' addresses, or remove [server.proxy_protocol]";
        cx.non_empty(n, nets, message)
    });
    t.finish(cx);
    Some(ProxyProtocolConfig { from: from? })
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
            match seen.get(addr) {
                Some(first) => cx.error(
                    &v.span(),
                    &path,
                    format!("{addr} is already listed at {first}"),
                ),
                None => drop(seen.insert(*addr, path)),
            }
        }
    }
}

fn read_certs(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Vec<CertConfig>> {
    let before = cx.errors.len();
    let mut out = Vec::new();
    for n in &cx.tables(node)? {
        let Some(t) = TableReader::of(cx, n) else {
            continue;
        };
        let cert = t.req(cx, "cert", Cx::readable_file);
        let key = t.req(cx, "key", Cx::readable_file);
        t.finish(cx);
        if let (Some(cert), Some(key)) = (cert, key) {
            out.push(CertConfig { cert, key });
        }
    }
    (cx.errors.len() == before).then_some(out)
}

/// `[admin]`, which must not share a server listener's address.
fn read_admin(cx: &mut Cx<'_>, node: &Node<'_>, server: &ServerConfig) -> Option<AdminConfig> {
    let t = TableReader::of(cx, node)?;
    let listen = t.req(cx, "listen", |cx, n| {
        let addr = cx.socket_addr(n)?;
        let mut listeners = server.listen.iter().chain(&server.tls_listen);
        if addr.port() != 0 && listeners.any(|a| *a == addr) {
            cx.error(
                &n.span,
                &n.path,
                format!("{addr} is also a server listener"),
            );
        }
        Some(addr)
    });
    t.finish(cx);
    Some(AdminConfig { listen: listen? })
}

/// `[store]`, then the `TOLLGATE_DATABASE_URL` override.
fn read_store(cx: &mut Cx<'_>, t: TableReader<'_>) -> StoreConfig {
    // The trust root for TLS to the database must hold PEM certificates: a file that does
    // not would fail every connection attempt, long after `check` said OK. An unreadable one
    // is reported on its own line; the URL is then checked as if there were none.
    let ca_file = t.opt(cx, "ca_file", |cx, n| {
        let path = cx.readable_file(n)?;
        let roots = crate::store::pg_tls::read_roots(&path);
        cx.check(n, roots).map(|_| path)
    });
    let check_url = |url: &str| check_postgres_url(url, ca_file.as_deref());
    // The file's URL is checked even when the environment overrides it, so a file that
    // passes `check` on one machine is valid everywhere.
    let file_url = t.opt(cx, "url", |cx, n| {
        let url = cx.string(n)?;
        cx.check(n, check_url(&url)).map(|()| url)
    });
    let url = match (cx.env)(DATABASE_URL_ENV).filter(|u| !u.is_empty()) {
        Some(env_url) => match check_url(&env_url) {
            Ok(()) => Some(env_url),
            Err(m) => {
                cx.error_unplaced("store.url", format!("{DATABASE_URL_ENV}: {m}"));
                None
            }
        },
        None => file_url,
    };
    let commit_options = [("on", true), ("off", false)];
    let default_buckets = NonZeroUsize::new(DEFAULT_MEMORY_BUCKETS).unwrap_or(NonZeroUsize::MIN);
    let store = StoreConfig {
        url,
        pool_size: t.or(cx, "pool_size", 16, |cx, n| cx.int(n, 1, 1024)),
        timeout: t.or(cx, "timeout", Duration::from_millis(100), Cx::duration),
        on_error: t.or(cx, "on_error", StoreErrorPolicy::Allow, |cx, n| {
            cx.choice(n, STORE_POLICIES)
        }),
        migrate: t.or(cx, "migrate", true, Cx::boolean),
        sweep_interval: t.or(cx, "sweep_interval", secs(60), Cx::duration),
        synchronous_commit: t.or(cx, "synchronous_commit", false, |cx, n| {
            cx.choice(n, &commit_options)
        }),
        // Accepted with a database URL too (SPEC 2 shows both in one file, and the same file
        // may serve a memory-store instance elsewhere); the server warns at start that it is
        // ignored.
        memory_buckets: t.or(cx, "memory_buckets", default_buckets, |cx, n| {
            let max = MAX_MEMORY_BUCKETS as i64;
            cx.int(n, 1, max).and_then(NonZeroUsize::new)
        }),
        ca_file,
    };
    t.finish(cx);
    store
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
fn read_keys(cx: &mut Cx<'_>, t: TableReader<'_>) -> KeysConfig {
    let secret = t.opt(cx, "secret", |cx, n| {
        // An empty HMAC key is a key nobody meant: most likely an empty variable.
        let s = cx.string(n)?;
        let empty = "must not be empty (remove it to use plain SHA-256)";
        cx.check(n, if s.is_empty() { Err(empty) } else { Ok(s) })
    });
    t.finish(cx);
    KeysConfig {
        secret: secret.map(String::into_bytes),
    }
}

/// The upstreams in file order, and every name under `[upstreams]` (valid or not) with its
/// index, so a route naming a broken upstream is not also told the upstream does not exist.
fn read_upstreams(
    cx: &mut Cx<'_>,
    node: Option<Node<'_>>,
) -> (Vec<Arc<UpstreamConfig>>, HashMap<String, usize>) {
    let (mut list, mut index) = (Vec::new(), HashMap::new());
    let Some(node) = node else {
        return (list, index);
    };
    let Some(table) = node.table_like() else {
        cx.type_error(&node, "a table of [upstreams.NAME] tables");
        return (list, index);
    };
    for (i, (name, item)) in table.iter().enumerate() {
        index.insert(name.to_string(), i);
        let key_span = table.key(name).and_then(|k| k.span());
        let path = join_path(&node.path, name);
        let span = item.span().or_else(|| key_span.clone());
        let n = Node {
            raw: Raw::Item(item),
            path,
            span,
        };
        if let Err(message) = check_name(name, "upstream name") {
            cx.error(&key_span, &n.path, message);
        }
        list.extend(read_upstream(cx, name, &n).map(Arc::new));
    }
    (list, index)
}

fn read_upstream(cx: &mut Cx<'_>, name: &str, node: &Node<'_>) -> Option<UpstreamConfig> {
    let t = TableReader::of(cx, node)?;
    let origin = |cx: &mut Cx<'_>, n: &Node<'_>| cx.parse(n, parse_origin);
    let urls = match (t.get("url"), t.get("urls")) {
        (Some(u), None) => origin(cx, &u).map(|u| vec![u]),
        (None, Some(us)) => {
            let urls = cx.list(&us, origin);
            urls.and_then(|urls| cx.non_empty(&us, urls, "must list at least one URL"))
        }
        (Some(_), Some(us)) => cx.check(&us, Err("give either url or urls, not both")),
        (None, None) => {
            let message = "missing required field (url, or urls for several origins)";
            cx.error(&t.span, &t.field_path("url"), message);
            None
        }
    };
    let upstream = UpstreamConfig {
        name: name.to_string(),
        urls: urls.unwrap_or_default(),
        connect_timeout: t.or(cx, "connect_timeout", secs(2), Cx::duration),
        response_timeout: t.or(cx, "response_timeout", secs(30), Cx::duration),
        preserve_host: t.or(cx, "preserve_host", true, Cx::boolean),
        ca_file: t.opt(cx, "ca_file", Cx::readable_file),
        http2: t.or(cx, "http2", false, Cx::boolean),
        max_idle_connections: t.or(
            cx,
            "max_idle_connections",
            DEFAULT_IDLE_CONNECTIONS,
            |cx, n| cx.int(n, 0, MAX_IDLE_CONNECTIONS),
        ),
        // nginx's default; meaningful only with several origins, harmless with one.
        fail_timeout: t.or(cx, "fail_timeout", secs(10), Cx::duration),
    };
    t.finish(cx);
    Some(upstream)
}

/// The first limit seen for a bucket prefix, for the cross-route check.
struct BucketOwner {
    path: String,
    route: String,
    requests: u32,
    window_secs: u32,
    algorithm: Algorithm,
}

/// What the routes read so far have claimed: route names (with the route's path) and bucket
/// prefixes, keyed by (scope, key label).
#[derive(Default)]
struct Claims {
    names: HashMap<String, String>,
    buckets: HashMap<(String, String), BucketOwner>,
}

fn read_routes(
    cx: &mut Cx<'_>,
    node: &Node<'_>,
    upstreams: &HashMap<String, usize>,
) -> Option<Vec<RouteConfig>> {
    let mut claims = Claims::default();
    let tables = cx.tables(node)?;
    let routes = tables
        .iter()
        .filter_map(|n| read_route(cx, n, upstreams, &mut claims));
    Some(routes.collect())
}

fn read_route(
    cx: &mut Cx<'_>,
    node: &Node<'_>,
    upstreams: &HashMap<String, usize>,
    claims: &mut Claims,
) -> Option<RouteConfig> {
    let t = TableReader::of(cx, node)?;
    let name = t.req(cx, "name", |cx, n| {
        let name = cx.name(n, "route name")?;
        if let Some(first) = claims.names.get(&name) {
            let message = format!("duplicate route name {name:?} (first used by {first})");
            return cx.check(n, Err(message));
        }
        claims.names.insert(name.clone(), node.path.clone());
        Some(name)
    });
    let host = t.opt(cx, "host", |cx, n| cx.parse(n, parse_host));
    let path_prefix = t.or(cx, "path_prefix", "/".to_string(), |cx, n| {
        cx.parse(n, parse_path_prefix)
    });
    let methods = t.opt(cx, "methods", read_methods);
    let upstream = t.req(cx, "upstream", |cx, n| {
        let s = cx.string(n)?;
        let found = upstreams.get(&s).copied();
        if found.is_none() {
            let mut defined: Vec<&str> = upstreams.keys().map(String::as_str).collect();
            defined.sort_unstable();
            let message = if defined.is_empty() {
                format!("unknown upstream {s:?}: no [upstreams.NAME] is defined")
            } else {
                format!("unknown upstream {s:?}; defined: {}", defined.join(", "))
            };
            cx.error(&n.span, &n.path, message);
        }
        found
    });
    let route = RouteConfig {
        host,
        path_prefix,
        methods,
        upstream: upstream.unwrap_or_default(),
        strip_prefix: t.or(cx, "strip_prefix", false, Cx::boolean),
        on_store_error: t.opt(cx, "on_store_error", |cx, n| cx.choice(n, STORE_POLICIES)),
        shadow: t.or(cx, "shadow", false, Cx::boolean),
        limits: t.or(cx, "limits", Vec::new(), |cx, n| {
            read_limits(cx, n, name.as_deref(), &mut claims.buckets)
        }),
        reject: t.opt(cx, "reject", read_reject),
        max_body_size: t.opt(cx, "max_body_size", Cx::size),
        name: name.unwrap_or_default(),
    };
    t.finish(cx);
    Some(route)
}

fn read_methods(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Vec<Method>> {
    let elements = cx.array(node)?;
    let message = "must list at least one method (remove it to match any method)";
    let elements = cx.non_empty(node, elements, message)?;
    let mut out: Vec<Method> = Vec::new();
    for e in &elements {
        let Some(s) = cx.string(e) else { continue };
        match Method::from_bytes(s.to_ascii_uppercase().as_bytes()) {
            Ok(m) if out.contains(&m) => {
                cx.error(&e.span, &e.path, format!("method {m} is listed twice"))
            }
            Ok(m) => out.push(m),
            Err(_) => cx.error(&e.span, &e.path, format!("{s:?} is not an HTTP method")),
        }
    }
    // Every element that did not make it into `out` was reported.
    (out.len() == elements.len()).then_some(out)
}

fn read_reject(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<RejectConfig> {
    let t = TableReader::of(cx, node)?;
    let header_value = |s: &str| match HeaderValue::from_str(s) {
        Ok(_) if !s.is_empty() => Ok(s.to_string()),
        _ => Err("not a valid header value".to_string()),
    };
    let reject = RejectConfig {
        status: t.or(cx, "status", StatusCode::TOO_MANY_REQUESTS, |cx, n| {
            let code: u16 = cx.int(n, 400, 599)?;
            StatusCode::from_u16(code).ok()
        }),
        content_type: t.opt(cx, "content_type", |cx, n| cx.parse(n, header_value)),
        body: t.or(cx, "body", Bytes::new(), |cx, n| {
            cx.string(n).map(Bytes::from)
        }),
    };
    t.finish(cx);
    Some(reject)
}

fn read_limits(
    cx: &mut Cx<'_>,
    node: &Node<'_>,
    route: Option<&str>,
    buckets: &mut HashMap<(String, String), BucketOwner>,
) -> Option<Vec<LimitConfig>> {
    let mut out = Vec::new();
    // Bucket prefixes used by this route so far: a second limit on one prefix in one route
    // would increment the same counter twice per request.
    let mut mine: HashMap<(String, String), String> = HashMap::new();
    for n in &cx.tables(node)? {
        let Some(limit) = read_limit(cx, n, route) else {
            continue;
        };
        let id = (limit.scope.clone(), limit.key.label());
        let policy = limit.policy_name();
        if let Some(first) = mine.get(&id) {
            let message = format!(
                "counts the same bucket {policy:?} as {first}: each request would be counted twice; give one of them its own scope",
            );
            cx.error(&n.span, &n.path, message);
            continue;
        }
        mine.insert(id.clone(), n.path.clone());
        let conflict = match buckets.get(&id) {
            Some(owner) if owner.algorithm != limit.algorithm => Some(format!(
                "conflicts with {} (route {:?}): both write bucket prefix {policy:?}, there with algorithm = {:?}, here with algorithm = {:?}; one row cannot be counted both ways: use the same algorithm, or a different scope",
                owner.path,
                owner.route,
                owner.algorithm.as_str(),
                limit.algorithm.as_str(),
            )),
            Some(owner)
                if owner.requests != limit.requests || owner.window_secs != limit.window_secs =>
            {
                Some(format!(
                    "conflicts with {} (route {:?}): both write bucket prefix {policy:?}, there with requests = {}, window = \"{}\", here with requests = {}, window = \"{}\"; use the same values to share the budget, or a different scope",
                    owner.path,
                    owner.route,
                    owner.requests,
                    format_secs(owner.window_secs),
                    limit.requests,
                    format_secs(limit.window_secs),
                ))
            }
            Some(_) => None,
            None => {
                let owner = BucketOwner {
                    path: n.path.clone(),
                    route: route.unwrap_or_default().to_string(),
                    requests: limit.requests,
                    window_secs: limit.window_secs,
                    algorithm: limit.algorithm,
                };
                buckets.insert(id, owner);
                None
            }
        };
        match conflict {
            Some(message) => cx.error(&n.span, &n.path, message),
            None => out.push(limit),
        }
    }
    Some(out)
}

/// One limit; None when any of its values was invalid. `route` is None when the route's name
/// was invalid: the limit is still checked, but without a scope it cannot take part in the
/// bucket checks.
fn read_limit(cx: &mut Cx<'_>, node: &Node<'_>, route: Option<&str>) -> Option<LimitConfig> {
    let t = TableReader::of(cx, node)?;
    let before = cx.errors.len();
    let key = t.req(cx, "key", read_key_spec);
    let requests = t.req(cx, "requests", |cx, n| cx.int(n, 1, i32::MAX.into()));
    let window_secs = t.req(cx, "window", |cx, n| cx.parse(n, parse_window));
    let scope = match t.get("scope") {
        Some(n) => cx.name(&n, "scope"),
        None => route.map(str::to_string),
    };
    let shadow = t.or(cx, "shadow", false, Cx::boolean);
    let algorithm = t.or(cx, "algorithm", Algorithm::Fixed, |cx, n| {
        cx.parse(n, parse_algorithm)
    });
    let valid = cx.errors.len() == before;
    t.finish(cx);
    let limit = LimitConfig {
        key: key?,
        requests: requests?,
        window_secs: window_secs?,
        scope: scope?,
        shadow,
        algorithm,
    };
    valid.then_some(limit)
}

/// `key = "ip"` or `key = ["header:x-tenant", "ip"]`.
fn read_key_spec(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<KeySpec> {
    if let Some(Value::String(_)) = node.value() {
        let part = cx.parse(node, parse_key_part)?;
        return Some(KeySpec { parts: vec![part] });
    }
    if !matches!(node.value(), Some(Value::Array(_))) {
        cx.type_error(node, "a string or an array of strings");
        return None;
    }
    let elements = cx.array(node)?;
    let elements = cx.non_empty(node, elements, "must list at least one key part")?;
    let mut parts: Vec<KeyPart> = Vec::new();
    for e in &elements {
        let Some(s) = cx.string(e) else { continue };
        let problem = match parse_key_part(&s) {
            Ok(KeyPart::Global) if elements.len() > 1 => {
                "\"global\" cannot be combined with other key parts: it has no subject".to_string()
            }
            Ok(p) if parts.contains(&p) => format!("{s:?} is listed twice"),
            Ok(p) => {
                parts.push(p);
                continue;
            }
            Err(message) => message,
        };
        cx.error(&e.span, &e.path, problem);
    }
    // Every element that did not make it into `parts` was reported.
    (parts.len() == elements.len()).then_some(KeySpec { parts })
}

#[cfg(test)]
mod tests;
