//! Configuration: the validated, typed form of `proxy.toml` (contract §2).
//!
//! Loading happens in two steps. [`load`] walks the TOML document (with the position of every
//! item kept), rejects unknown keys, expands `${NAME}` references and turns each value into the
//! types below, collecting *every* problem with its `FILE:LINE:COL: field.path` instead of
//! stopping at the first. The types here carry no raw TOML: every invariant the rest of the
//! program relies on (a route's upstream exists, a window is whole seconds, ...) holds by
//! construction once a [`Config`] exists.

mod load;
mod syntax;
mod walk;

pub use load::{load_file, load_str};
// Each stage owns the settings it runs on; the configuration assembles them (the loader
// validates a store URL with the store's own parser, so the store cannot depend on config).
pub use crate::store::settings::{
    StoreConfig, StoreErrorPolicy, DEFAULT_MEMORY_BUCKETS, MAX_MEMORY_BUCKETS,
};
pub use crate::tls::CertConfig;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, StatusCode, Uri};
use ipnet::IpNet;

/// Everything one `proxy.toml` says.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from (for messages and reload).
    pub source: PathBuf,
    pub server: ServerConfig,
    pub admin: Option<AdminConfig>,
    pub store: StoreConfig,
    pub keys: KeysConfig,
    /// In file order; names are unique.
    pub upstreams: Vec<Arc<UpstreamConfig>>,
    /// In file order: the first match wins.
    pub routes: Vec<RouteConfig>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: Vec<SocketAddr>,
    pub tls_listen: Vec<SocketAddr>,
    pub trusted_proxies: Vec<IpNet>,
    /// 1..=128; 128 keys each IPv6 address on its own.
    pub ipv6_prefix: u8,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_timeout: Duration,
    pub rate_limit_headers: RateLimitHeaders,
    /// Forward header names containing `_` (default false: they are dropped, contract §4a).
    pub underscores_in_headers: bool,
    /// Largest request body in bytes (contract §5); `None` = no limit. Routes may override it.
    pub max_body_size: Option<u64>,
    /// Threads serving connections, each with its own single-threaded runtime; `None` = one
    /// per CPU the process may run on.
    pub workers: Option<usize>,
    /// The first is the default certificate.
    pub certs: Vec<CertConfig>,
    /// `[server.proxy_protocol]` (contract §4); `None` = no peer sends a PROXY header.
    pub proxy_protocol: Option<ProxyProtocolConfig>,
}

/// Peers that must open every connection with a PROXY protocol v1 or v2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyProtocolConfig {
    /// Not empty.
    pub from: Vec<IpNet>,
}

impl ServerConfig {
    /// How many connection-serving workers to start: `workers`, or one per CPU this process
    /// may run on (its affinity mask and cgroup quota, as `nproc` counts them).
    pub fn worker_count(&self) -> usize {
        self.workers.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimitHeaders {
    Draft,
    Legacy,
    Both,
    None,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
}

#[derive(Clone, Default)]
pub struct KeysConfig {
    /// HMAC-SHA256 key for subjects; `None` = plain SHA-256.
    pub secret: Option<Vec<u8>>,
}

impl fmt::Debug for KeysConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeysConfig")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    pub name: String,
    /// One or more origins (scheme + authority, no path); several are used round robin.
    pub urls: Vec<Uri>,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
    pub preserve_host: bool,
    pub ca_file: Option<PathBuf>,
    pub http2: bool,
    /// Idle HTTP/1.1 connections kept for reuse, per worker and per origin (nginx's
    /// `keepalive`); one more that goes idle is closed.
    pub max_idle_connections: usize,
    /// With several `urls`: how long an origin that failed to connect is skipped by new
    /// requests (nginx's `fail_timeout`), unless every origin has failed (contract §5).
    pub fail_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct RouteConfig {
    pub name: String,
    pub host: Option<HostPattern>,
    /// Starts with `/`; never ends with `/` unless it is exactly `/`.
    pub path_prefix: String,
    /// `None` = any method.
    pub methods: Option<Vec<Method>>,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    pub strip_prefix: bool,
    pub on_store_error: Option<StoreErrorPolicy>,
    pub shadow: bool,
    pub limits: Vec<LimitConfig>,
    pub reject: Option<RejectConfig>,
    /// Overrides `server.max_body_size` for this route.
    pub max_body_size: Option<u64>,
}

/// A route's `host`, lowercased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// `api.example.com`
    Exact(String),
    /// `*.example.com`, stored as `.example.com`: any depth of subdomain, not the bare domain.
    Suffix(String),
}

#[derive(Debug, Clone)]
pub struct LimitConfig {
    pub key: KeySpec,
    /// 1..=i32::MAX (the column is `integer`).
    pub requests: u32,
    /// Whole seconds, 1s..=366d.
    pub window_secs: u32,
    /// Defaults to the route's name.
    pub scope: String,
    pub shadow: bool,
    /// `algorithm`: fixed (the default) or sliding windows (contract §3a).
    pub algorithm: Algorithm,
    /// `reserve`: take the budget from the store in shares (contract §3c).
    pub reserve: bool,
    /// `cost`: the units one request takes, 1..=`requests` (contract §3d).
    pub cost: u32,
    /// `count`: which responses count (contract §3d); `All` by default.
    pub count: Counting,
    /// `cost_header`: the response field in which the upstream reports what a request cost
    /// (contract §3d), lowercased.
    pub cost_header: Option<HeaderName>,
}

/// `count` (contract §3d): every request, or only those whose response status is listed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Counting {
    #[default]
    All,
    Statuses(StatusSet),
}

/// A set of response statuses, 100 to 599: codes and whole classes (`"4xx"`).
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet {
    /// Bit `s` set: status `s` is in the set.
    bits: [u64; 10],
}

impl StatusSet {
    /// Statuses this set can hold.
    pub const RANGE: std::ops::RangeInclusive<u16> = 100..=599;

    /// Adds `status`; false when it is outside [`StatusSet::RANGE`].
    pub fn insert(&mut self, status: u16) -> bool {
        if !Self::RANGE.contains(&status) {
            return false;
        }
        self.bits[usize::from(status / 64)] |= 1 << (status % 64);
        true
    }

    /// Adds the class `digit`xx (1 to 5).
    pub fn insert_class(&mut self, digit: u16) -> bool {
        (1..=5).contains(&digit) && (digit * 100..digit * 100 + 100).all(|s| self.insert(s))
    }

    pub fn contains(&self, status: u16) -> bool {
        Self::RANGE.contains(&status)
            && self.bits[usize::from(status / 64)] & (1 << (status % 64)) != 0
    }
}

/// `[401, 403]`, `["5xx", 429]`: whole classes as classes, as a file would write them.
impl fmt::Display for Counting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Counting::Statuses(set) = self else {
            return f.write_str("\"all\"");
        };
        let mut parts = Vec::new();
        for class in 1..=5u16 {
            let statuses = class * 100..class * 100 + 100;
            if statuses.clone().all(|s| set.contains(s)) {
                parts.push(format!("\"{class}xx\""));
            } else {
                parts.extend(statuses.filter(|s| set.contains(*s)).map(|s| s.to_string()));
            }
        }
        write!(f, "[{}]", parts.join(", "))
    }
}

impl fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(Self::RANGE.filter(|s| self.contains(*s)))
            .finish()
    }
}

impl LimitConfig {
    /// Whether the limit is charged after the response (contract §3d): admitted by a read
    /// before forwarding, counted once the response head says what to count.
    pub fn charged_after(&self) -> bool {
        self.count != Counting::All || self.cost_header.is_some()
    }
}

/// How a limit's windows count (contract §2 `algorithm`, 3 and 3a).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// One counter per epoch-aligned window; up to twice the limit across a boundary.
    #[default]
    Fixed,
    /// The current window's count plus the previous window's, weighted by how much of it
    /// still overlaps the last `window` seconds; denied requests are not counted.
    Sliding,
}

impl Algorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Fixed => "fixed",
            Algorithm::Sliding => "sliding",
        }
    }
}

impl LimitConfig {
    /// `<scope>:<label>`: the bucket prefix and the policy name in headers and problem bodies.
    pub fn policy_name(&self) -> String {
        format!("{}:{}", self.scope, self.key.label())
    }
}

/// What a limit counts by. A list of parts means "all of these together"; `Global` is never
/// part of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    pub parts: Vec<KeyPart>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    Ip,
    /// The header name, lowercased.
    Header(HeaderName),
    Global,
}

impl KeySpec {
    /// `ip`, `authorization`, `global`, `x-tenant+ip`.
    pub fn label(&self) -> String {
        let labels: Vec<&str> = self
            .parts
            .iter()
            .map(|p| match p {
                KeyPart::Ip => "ip",
                KeyPart::Header(h) => h.as_str(),
                KeyPart::Global => "global",
            })
            .collect();
        labels.join("+")
    }

    pub fn is_global(&self) -> bool {
        self.parts == [KeyPart::Global]
    }
}

#[derive(Debug, Clone)]
pub struct RejectConfig {
    pub status: StatusCode,
    pub content_type: Option<String>,
    pub body: Bytes,
}

impl Config {
    pub fn upstream(&self, route: &RouteConfig) -> &Arc<UpstreamConfig> {
        &self.upstreams[route.upstream]
    }
}

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
