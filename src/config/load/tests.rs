use super::*;
use crate::config::syntax::{expand, parse_duration, parse_size};
use crate::config::{ConfigError, HostPattern};
use http::Uri;
use std::path::PathBuf;
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

// The example of contract §2, verbatim apart from `ca_file` living next to the certs.
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
    let text =
        format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\nmax_body_size = \"0B\"\n");
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
    format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n[[routes.limits]]\n{limit}\n")
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
    let text = "[upstreams.api]\nurl = \"ftp://x\"\n[[routes]]\nname = \"r\"\nupstream = \"api\"\n";
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
    let config =
        load_ok("[server]\n[server.proxy_protocol]\nfrom = [\"10.0.0.0/8\", \"2001:db8::1\"]\n");
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
    let text =
        format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\npath_prefix = \"api\"\n");
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
        format!("{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"api\"\n[routes.reject]\n{r}\n")
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

/// A bad value is replaced by its default so the rest of the file is still checked; the
/// checks across fields must not then report the stand-in as a second problem.
#[test]
fn a_bad_value_is_not_reported_again_by_the_cross_checks() {
    let limit = |algorithm: &str| {
        format!("[[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"\nscope = \"shared\"\nalgorithm = \"{algorithm}\"\n")
    };
    let text = format!(
        "{UPSTREAM}[[routes]]\nname = \"a\"\nupstream = \"api\"\n{}[[routes]]\nname = \"b\"\nupstream = \"api\"\n{}",
        limit("sliding"),
        limit("slidin"),
    );
    assert_error(
        &text,
        20,
        13,
        "routes[1].limits[0].algorithm",
        "\"fixed\" or \"sliding\"",
    );
    // Unreadable certificates are the problem, not "no certificate" for the TLS listener.
    let text = "[server]\ntls_listen = [\"0.0.0.0:1\"]\n[[server.certs]]\ncert = \"nope.pem\"\nkey = \"nope.key\"\n";
    assert_eq!(
        positions(text),
        [
            (4, 8, "server.certs[0].cert".to_string()),
            (5, 7, "server.certs[0].key".to_string()),
        ]
    );
    // A broken listener list is not also "no listeners".
    assert_error(
        "[server]\nlisten = [\"nope\"]\n",
        2,
        11,
        "server.listen[0]",
        "not a socket address",
    );
}

/// `reserve` (contract §3c): a boolean, false by default; limits that write one bucket prefix
/// must agree on it, since a row whose budget is taken in shares must not also be counted per
/// request.
#[test]
fn reserve_is_read_and_must_agree_on_a_shared_prefix() {
    let limit = |extra: &str| {
        format!("[[routes.limits]]\nkey = \"ip\"\nrequests = 5\nwindow = \"1h\"\nscope = \"shared\"\n{extra}")
    };
    let route = |name: &str, extra: &str| {
        format!(
            "[[routes]]\nname = \"{name}\"\nupstream = \"api\"\n{}",
            limit(extra)
        )
    };
    let both = format!(
        "{UPSTREAM}{}{}",
        route("a", "reserve = true\n"),
        route("b", "reserve = true\n")
    );
    let c = load_ok(&both);
    assert!(c.routes[0].limits[0].reserve && c.routes[1].limits[0].reserve);
    let plain = load_ok(&format!("{UPSTREAM}{}", route("a", "")));
    assert!(!plain.routes[0].limits[0].reserve, "false by default");
    let e = one_error(&format!(
        "{UPSTREAM}{}{}",
        route("a", "reserve = true\n"),
        route("b", "")
    ));
    assert_eq!(e.field, "routes[1].limits[0]");
    assert!(e.message.contains("reserve = true"), "{}", e.message);
    assert_error(
        &format!("{UPSTREAM}{}", route("a", "reserve = \"yes\"\n")),
        11,
        11,
        "routes[0].limits[0].reserve",
        "boolean",
    );
}

/// `cost` (contract §3d): 1 by default, 1 to the limit's `requests`; limits sharing a bucket
/// prefix may each have their own cost (one budget, dearer and cheaper requests).
#[test]
fn cost_is_read_between_one_and_the_limits_requests() {
    let route = |name: &str, extra: &str| {
        format!(
            "[[routes]]\nname = \"{name}\"\nupstream = \"api\"\n[[routes.limits]]\nkey = \"ip\"\nrequests = 10\nwindow = \"1h\"\nscope = \"shared\"\n{extra}"
        )
    };
    let c = load_ok(&format!(
        "{UPSTREAM}{}{}",
        route("a", "cost = 3\n"),
        route("b", "")
    ));
    assert_eq!(c.routes[0].limits[0].cost, 3);
    assert_eq!(c.routes[1].limits[0].cost, 1, "1 by default");
    let full = load_ok(&format!("{UPSTREAM}{}", route("a", "cost = 10\n")));
    assert_eq!(
        full.routes[0].limits[0].cost, 10,
        "requests itself is a cost"
    );
    assert_error(
        &format!("{UPSTREAM}{}", route("a", "cost = 0\n")),
        11,
        8,
        "routes[0].limits[0].cost",
        "must be between 1 and",
    );
    assert_error(
        &format!("{UPSTREAM}{}", route("a", "cost = 11\n")),
        11,
        8,
        "routes[0].limits[0].cost",
        "more than the limit's requests = 10",
    );
    assert_error(
        &format!("{UPSTREAM}{}", route("a", "cost = \"3\"\n")),
        11,
        8,
        "routes[0].limits[0].cost",
        "integer",
    );
}

/// `count` and `cost_header` (contract §3d): statuses 100-599 and classes, never an empty
/// list; a header name that does not frame the body; neither together with `reserve`.
#[test]
fn count_and_cost_header_are_checked() {
    let route = |extra: &str| {
        format!(
            "{UPSTREAM}[[routes]]\nname = \"a\"\nupstream = \"api\"\n[[routes.limits]]\nkey = \"ip\"\nrequests = 10\nwindow = \"1h\"\n{extra}"
        )
    };
    let c = load_ok(&route("count = [401, \"5XX\"]\ncost_header = \"X-Cost\"\n"));
    let limit = &c.routes[0].limits[0];
    let Counting::Statuses(set) = &limit.count else {
        panic!("a list of statuses: {:?}", limit.count);
    };
    assert!(set.contains(401) && set.contains(500) && set.contains(599));
    assert!(!set.contains(400) && !set.contains(200));
    assert_eq!(limit.count.to_string(), "[401, \"5xx\"]");
    assert_eq!(
        limit.cost_header.as_ref().map(|h| h.as_str()),
        Some("x-cost")
    );
    assert!(limit.charged_after());
    let plain = load_ok(&route("count = \"all\"\n"));
    assert!(!plain.routes[0].limits[0].charged_after());
    let e = |extra: &str| one_error(&route(extra));
    let empty = e("count = []\n");
    assert_eq!(empty.field, "routes[0].limits[0].count");
    assert!(
        empty.message.contains("at least one status"),
        "{}",
        empty.message
    );
    assert_eq!((empty.line, empty.col), (10, 9), "{empty}");
    let out = e("count = [401, 600]\n");
    assert_eq!(out.field, "routes[0].limits[0].count[1]");
    assert!(
        out.message.contains("600 is outside 100-599"),
        "{}",
        out.message
    );
    let class = e("count = [\"6xx\"]\n");
    assert!(
        class.message.contains("not a status class"),
        "{}",
        class.message
    );
    let word = e("count = \"some\"\n");
    assert!(
        word.message.contains("expected \"all\""),
        "{}",
        word.message
    );
    let framing = e("cost_header = \"Content-Length\"\n");
    assert_eq!(framing.field, "routes[0].limits[0].cost_header");
    assert!(
        framing.message.contains("frames the response body"),
        "{}",
        framing.message
    );
    let bad_name = e("cost_header = \"x cost\"\n");
    assert!(
        bad_name.message.contains("not a valid header name"),
        "{}",
        bad_name.message
    );
    for extra in [
        "reserve = true\ncount = [401]\n",
        "reserve = true\ncost_header = \"x-cost\"\n",
    ] {
        let both = e(extra);
        assert_eq!(both.field, "routes[0].limits[0].reserve", "{extra}");
        assert!(
            both.message.contains("cannot be combined"),
            "{}",
            both.message
        );
    }
}
