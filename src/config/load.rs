//! Loading `proxy.toml` into a validated [`Config`] (contract §2): the schema, meaning one
//! reader per section with its defaults, and the checks across fields (a route's upstream
//! exists, route names are unique, limits that write one bucket prefix agree). Value syntax is
//! in [`super::syntax`], walking the document with positions in [`super::walk`].
//!
//! The file is hostile input and the operator wants to fix it in one pass, so every check runs
//! and every problem becomes a [`ConfigError`](super::ConfigError) at `FILE:LINE:COL:
//! field.path` (1-based; columns in characters; paths such as `routes[2].limits[0].window`). A
//! bad value is reported and replaced by its default so the rest is still checked; checks
//! across fields see only valid values, so one mistake is reported once. Why this walks
//! toml_edit rather than using serde: docs/architecture.md, `config/`.
//!
//! The process environment is never read here: `${NAME}` and `TOLLGATE_DATABASE_URL` go
//! through the caller's `env` function, so tests need no `std::env::set_var`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use ipnet::IpNet;
use toml_edit::{ImDocument, Value};

use super::syntax::{
    check_name, format_secs, parse_algorithm, parse_cidr, parse_cost_header, parse_host,
    parse_key_part, parse_origin, parse_path_prefix, parse_window,
};
use super::walk::{join_path, Cx, Node, Raw, TableReader};
use super::{
    AdminConfig, Algorithm, CertConfig, Config, ConfigErrors, Counting, KeyPart, KeySpec,
    KeysConfig, LimitConfig, ProxyProtocolConfig, RateLimitHeaders, RejectConfig, RouteConfig,
    ServerConfig, StatusSet, StoreConfig, StoreErrorPolicy, UpstreamConfig, DEFAULT_MEMORY_BUCKETS,
    MAX_MEMORY_BUCKETS,
};

/// Environment variable that overrides `store.url` when set and non-empty (contract §2).
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
/// A field that is absent takes its default: the value each reader below passes to
/// [`TableReader::or`], listed for operators in docs/configuration.md's tables (absent
/// optional sections, such as `[admin]` or `store.url`, mean the feature is off).
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
    let root = TableReader::new(Some(doc.as_table()), String::new(), Some(0..0));
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
    // The TLS listeners' node, when there are any: where a missing certificate is reported.
    let tls_used = tls_listen.as_ref().is_some_and(|tl| !tl.is_empty());
    let tls_used = tls_node.as_ref().filter(|_| tls_used);
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
        certs: read_certs(cx, t.get("certs"), tls_used),
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

/// `[server.proxy_protocol]` (contract §4): `from` is required and not empty, since a table that
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
            if let Some(first) = seen.get(addr) {
                let message = format!("{addr} is already listed at {first}");
                cx.error(&v.span(), &path, message);
            } else {
                seen.insert(*addr, path);
            }
        }
    }
}

/// `[[server.certs]]`; TLS listeners (`tls`, their node when there are any) need at least one.
fn read_certs(cx: &mut Cx<'_>, node: Option<Node<'_>>, tls: Option<&Node<'_>>) -> Vec<CertConfig> {
    let Some(node) = node else {
        if let Some(tls) = tls {
            let message = "TLS listeners need at least one [[server.certs]] entry";
            cx.error(&tls.span, &tls.path, message);
        }
        return Vec::new();
    };
    let before = cx.errors.len();
    let mut out = Vec::new();
    for n in &cx.tables(&node).unwrap_or_default() {
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
    // Only when no entry was broken: an empty list is the problem, not a consequence.
    if tls.is_some() && out.is_empty() && cx.errors.len() == before {
        let message = "TLS listeners need at least one certificate";
        cx.error(&node.span, &node.path, message);
    }
    out
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
    let url_node = t.get("url");
    let ca_file = t.opt(cx, "ca_file", |cx, n| {
        let path = cx.readable_file(n)?;
        let roots = crate::store::postgres::tls::read_roots(&path).map_err(|e| e.to_string());
        cx.check(n, roots).map(|_| path)
    });
    let check_url = |url: &str| check_postgres_url(url, ca_file.as_deref());
    // The file's URL is checked even when the environment overrides it, so a file that
    // passes `check` on one machine is valid everywhere.
    let file_url = url_node.and_then(|n| {
        let url = cx.string(&n)?;
        cx.check(&n, check_url(&url)).map(|()| url)
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
        // Accepted with a database URL too (contract §2 shows both in one file, and the same file
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
/// trust root holds certificates (contract §6). The message never contains the URL or any part of
/// it but option names: it may carry a password.
fn check_postgres_url(url: &str, ca_file: Option<&Path>) -> Result<(), String> {
    if url.is_empty() {
        return Err("must not be empty (remove it to use the memory store)".to_string());
    }
    let (_, tls) = crate::store::postgres::tls::parse(url, ca_file)?;
    // Reads an `sslrootcert` file; a `store.ca_file` was read above, and is again here.
    tls.connector().map(|_| ()).map_err(|e| e.to_string())
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
    reserve: bool,
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
            Some(owner) if owner.reserve != limit.reserve => Some(format!(
                "conflicts with {} (route {:?}): both write bucket prefix {policy:?}, there with reserve = {}, here with reserve = {}; a row whose budget is taken in shares must be counted only in shares: use the same value, or a different scope",
                owner.path, owner.route, owner.reserve, limit.reserve,
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
                    reserve: limit.reserve,
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
    let reserve = t.or(cx, "reserve", false, Cx::boolean);
    let cost = read_cost(cx, &t, requests);
    let count = t.or(cx, "count", Counting::All, read_counting);
    let cost_header = t.opt(cx, "cost_header", |cx, n| cx.parse(n, parse_cost_header));
    if reserve && (count != Counting::All || cost_header.is_some()) {
        if let Some(n) = t.get("reserve") {
            let message = "cannot be combined with count or cost_header: a share is taken before \
                           the response, and those limits are charged after it";
            cx.error(&n.span, &n.path, message);
        }
    }
    let valid = cx.errors.len() == before;
    t.finish(cx);
    let limit = LimitConfig {
        key: key?,
        requests: requests?,
        window_secs: window_secs?,
        scope: scope?,
        shadow,
        algorithm,
        reserve,
        cost,
        count,
        cost_header,
    };
    valid.then_some(limit)
}

/// `count = "all"` or a list of statuses (100-599) and classes (`"4xx"`), contract §3d.
fn read_counting(cx: &mut Cx<'_>, node: &Node<'_>) -> Option<Counting> {
    if let Some(Value::String(_)) = node.value() {
        return cx.parse(node, |s| match s {
            "all" => Ok(Counting::All),
            _ => Err(format!(
                "expected \"all\" or a list of statuses such as [401, 403] or [\"5xx\"], got {s:?}"
            )),
        });
    }
    if !matches!(node.value(), Some(Value::Array(_))) {
        cx.type_error(node, "\"all\" or an array of statuses");
        return None;
    }
    let elements = cx.array(node)?;
    let message =
        "must list at least one status (remove it, or write \"all\", to count every response)";
    let elements = cx.non_empty(node, elements, message)?;
    let mut set = StatusSet::default();
    let mut valid = true;
    for e in &elements {
        let added = match e.value() {
            Some(Value::Integer(i)) => u16::try_from(*i.value())
                .ok()
                .is_some_and(|status| set.insert(status))
                .then_some(())
                .ok_or_else(|| format!("status {} is outside 100-599", i.value())),
            Some(Value::String(s)) => parse_status_class(s.value()).and_then(|digit| {
                set.insert_class(digit)
                    .then_some(())
                    .ok_or_else(|| format!("{:?} is not a status class", s.value()))
            }),
            _ => Err("expected a status (an integer) or a class such as \"4xx\"".to_string()),
        };
        if let Err(message) = added {
            cx.error(&e.span, &e.path, message);
            valid = false;
        }
    }
    valid.then_some(Counting::Statuses(set))
}

/// `"4xx"` (any case) -> 4.
fn parse_status_class(s: &str) -> Result<u16, String> {
    let lower = s.to_ascii_lowercase();
    match lower.as_bytes() {
        [d @ b'1'..=b'5', b'x', b'x'] => Ok(u16::from(d - b'0')),
        _ => Err(format!(
            "{s:?} is not a status class; expected \"1xx\" to \"5xx\""
        )),
    }
}

/// `cost` (contract §3d): the units one request takes, 1 to `requests` (a cost above
/// `requests` could never be admitted). `requests`: the limit's, when it was valid.
fn read_cost(cx: &mut Cx<'_>, t: &TableReader<'_>, requests: Option<u32>) -> u32 {
    let Some(n) = t.get("cost") else {
        return 1;
    };
    let Some(cost) = cx.int::<u32>(&n, 1, i32::MAX.into()) else {
        return 1;
    };
    match requests {
        Some(requests) if cost > requests => {
            let message = format!(
                "{cost} is more than the limit's requests = {requests}: no request could ever be admitted; at most {requests}"
            );
            cx.error(&n.span, &n.path, message);
            1
        }
        _ => cost,
    }
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
