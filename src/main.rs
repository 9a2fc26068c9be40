//! The `tollgate` command (SPEC section 1). This is the only place that reads the process
//! environment, installs signal handlers or exits the process; everything else is in the
//! library so that tests can run it in process.
//!
//! Exit codes: 0 success; 2 invalid configuration or usage; 1 any other failure. Output whose
//! reader has gone (a closed pipe) is dropped without changing the exit code.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::EnvFilter;

use tollgate::config::{self, Config, HostPattern, KeyPart};
use tollgate::key::BucketHasher;
use tollgate::limit::PlannedLimit;
use tollgate::log_format::TextFormat;
use tollgate::log_writer::{FlushOnDrop, LogWriter};
use tollgate::normalise::NormaliseError;
use tollgate::plan::{self, PlanError, RequestPlan};
use tollgate::store::postgres::{self, InitError, PostgresStore};
use tollgate::store::{Increment, Peeked, Store};
use tollgate::Server;

/// `println!` for a command's output (`check`, `migrate`, `explain`), through [`say_line`].
macro_rules! say {
    ($($arg:tt)*) => {
        say_line(format_args!($($arg)*))
    };
}

/// Writes one line to stdout. A reader that has gone away (`tollgate check | head -1`) ends
/// the output, not the command: the line is dropped (as is every later one: the pipe stays
/// closed) and the command finishes with its usual exit code, where `println!` would panic
/// (exit 101). Any other failure to write is reported, and the command exits 1.
fn say_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    match writeln!(std::io::stdout().lock(), "{line}") {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(err) => {
            eprintln!("tollgate: cannot write the output: {err}");
            std::process::exit(1);
        }
    }
}

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A rate-limiting reverse proxy with counters in PostgreSQL"
)]
struct Cli {
    /// Configuration file [default: $TOLLGATE_CONFIG, then ./proxy.toml]
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve until SIGTERM or SIGINT (the default)
    Run,
    /// Validate the configuration, print its routes and limits, and exit
    Check,
    /// Apply pending database migrations and exit
    Migrate {
        /// Also replace the stored key fingerprint with this configuration's (secret rotation)
        #[arg(long)]
        accept_new_key: bool,
    },
    /// Show which route and limits a request would meet, and whether it would be allowed now
    /// (reads the counters, never increments them)
    Explain {
        /// Client address the request comes from
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
        ip: IpAddr,
        /// A request header, as 'Name: value' (repeatable)
        #[arg(long = "header", value_name = "'Name: value'")]
        headers: Vec<String>,
        /// Request method, e.g. GET
        method: String,
        /// Request URL, e.g. http://api.example.com/oauth/register
        url: String,
    },
    /// Forget what a request's buckets counted (current window, and the previous one), in the
    /// database and in every running instance's cache of denials
    Reset {
        /// Client address the request comes from
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
        ip: IpAddr,
        /// A request header, as 'Name: value' (repeatable)
        #[arg(long = "header", value_name = "'Name: value'")]
        headers: Vec<String>,
        /// Request method, e.g. POST
        method: String,
        /// Request URL, e.g. http://api.example.com/oauth/register
        url: String,
    },
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Where the configuration path came from (SPEC 1: `--config`, then `$TOLLGATE_CONFIG`, then
/// `./proxy.toml`), so that a missing file's message can say which one to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConfigFrom {
    Flag,
    Env,
    Default,
}

fn config_path(flag: Option<PathBuf>) -> (PathBuf, ConfigFrom) {
    if let Some(path) = flag {
        return (path, ConfigFrom::Flag);
    }
    match env("TOLLGATE_CONFIG").filter(|p| !p.is_empty()) {
        Some(path) => (PathBuf::from(path), ConfigFrom::Env),
        None => (PathBuf::from("proxy.toml"), ConfigFrom::Default),
    }
}

/// The second line of a "cannot read" error for a file that does not exist: how the path was
/// chosen and how to give another. A newcomer who ran `tollgate` in the wrong directory sees
/// only `proxy.toml: cannot read` otherwise, with no hint that a flag or a variable exists.
fn missing_config_hint(path: &std::path::Path, from: ConfigFrom) -> String {
    let why = match from {
        ConfigFrom::Flag => "the file given with --config does not exist".to_owned(),
        ConfigFrom::Env => format!(
            "TOLLGATE_CONFIG names {}, which does not exist",
            path.display()
        ),
        ConfigFrom::Default => {
            "neither --config nor TOLLGATE_CONFIG is set, so tollgate looked for ./proxy.toml"
                .to_owned()
        }
    };
    format!(
        "tollgate: {why}; give the configuration file with --config PATH or TOLLGATE_CONFIG=PATH \
         (proxy.toml.example is a complete one to start from)"
    )
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `explain` and `reset` end every failure with a line of their own on stderr (SPEC 1: one
    // clear line); the store's failure log would say the same thing again as a WARN.
    let quiet = matches!(
        cli.command,
        Some(Command::Explain { .. } | Command::Reset { .. })
    );
    // Kept to the end of `main`: dropping it writes out the log's last lines.
    let (log_drops, _flush_log) = init_logging(if quiet { "error" } else { "info" });
    let (path, from) = config_path(cli.config);
    let config = match config::load_file(&path, &env) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            if !path.exists() {
                eprintln!("{}", missing_config_hint(&path, from));
            }
            return ExitCode::from(2);
        }
    };
    // Certificates are part of the configuration: a key that does not match its
    // certificate, or an expired certificate, is a configuration error like any other.
    let cert_errors = certificate_errors(&config);
    if !cert_errors.is_empty() {
        for line in cert_errors {
            eprintln!("{line}");
        }
        return ExitCode::from(2);
    }
    // Single-threaded: this thread is connection worker 0 and also runs the store, the admin
    // listener and the sweep; `server.workers` - 1 more workers get threads of their own
    // (see server::start_workers).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("tollgate: cannot start the async runtime: {err}");
            return ExitCode::from(1);
        }
    };
    match cli.command.unwrap_or(Command::Run) {
        Command::Run => runtime.block_on(run(config, path, log_drops)),
        Command::Check => {
            print_check(&config);
            ExitCode::SUCCESS
        }
        Command::Migrate { accept_new_key } => runtime.block_on(migrate(config, accept_new_key)),
        Command::Explain {
            ip,
            headers,
            method,
            url,
        } => runtime.block_on(explain(config, ip, headers, method, url)),
        Command::Reset {
            ip,
            headers,
            method,
            url,
        } => runtime.block_on(reset(config, ip, headers, method, url)),
    }
}

/// `FILE: server.certs[i]: problem` for every certificate that does not load.
fn certificate_errors(config: &Config) -> Vec<String> {
    config
        .server
        .certs
        .iter()
        .enumerate()
        .filter_map(|(i, cert)| {
            tollgate::tls::load_certified_key(cert)
                .err()
                .map(|err| format!("{}: server.certs[{i}]: {err}", config.source.display()))
        })
        .collect()
}

/// Logs go to stderr through the non-blocking writer (`tollgate::log_writer`) at `RUST_LOG`, or
/// `default` when it is unset: a request never waits for a write. Returns its count of dropped
/// lines and the guard that flushes it.
fn init_logging(default: &str) -> (Counter, Option<FlushOnDrop>) {
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
/// lines are written without tracing-subscriber's generic formatting (`tollgate::log_format`).
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

async fn run(config: Config, path: PathBuf, log_drops: Counter) -> ExitCode {
    // Before anything is bound: every connection and upstream request needs a descriptor
    // (SPEC 9). It logs the figure, or why it could not.
    let _ = tollgate::server::raise_open_file_limit();
    let mut server = match Server::builder(config).log_drops(log_drops).start().await {
        Ok(server) => server,
        Err(err) => {
            eprintln!("tollgate: {err}");
            return ExitCode::from(1);
        }
    };
    let signals = Signals::install();
    let Ok(mut signals) = signals else {
        eprintln!("tollgate: cannot install signal handlers");
        return ExitCode::from(1);
    };
    loop {
        tokio::select! {
            _ = signals.hangup.recv() => {
                tracing::info!("SIGHUP: reloading {}", path.display());
                server.reload_from(&path, env).await;
            }
            _ = signals.terminate.recv() => break,
            _ = signals.interrupt.recv() => break,
            message = server.fatal() => {
                eprintln!("tollgate: {message}");
                server.shutdown().await;
                return ExitCode::from(1);
            }
        }
    }
    tracing::info!("stopping: finishing in-flight requests");
    server.shutdown().await;
    ExitCode::SUCCESS
}

struct Signals {
    hangup: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            hangup: signal(SignalKind::hangup())?,
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }
}

fn print_check(config: &Config) {
    say!("{}: configuration OK", config.source.display());
    for addr in &config.server.listen {
        say!("listen      {addr}");
    }
    for addr in &config.server.tls_listen {
        say!("tls_listen  {addr}");
    }
    if let Some(proxy_protocol) = &config.server.proxy_protocol {
        let from: Vec<String> = proxy_protocol
            .from
            .iter()
            .map(ToString::to_string)
            .collect();
        say!(
            "proxy_protocol from {} (PROXY v1/v2 header required from these peers)",
            from.join(", ")
        );
    }
    if let Some(admin) = &config.admin {
        say!("admin       {}", admin.listen);
    }
    match &config.store.url {
        Some(_) => say!(
            "store       postgres (on_error = {})",
            config.store.on_error.as_str()
        ),
        None => say!("store       memory (counters not shared between instances)"),
    }
    for upstream in &config.upstreams {
        let urls: Vec<String> = upstream.urls.iter().map(origin_text).collect();
        say!("upstream    {} -> {}", upstream.name, urls.join(", "));
    }
    for route in &config.routes {
        let host = match &route.host {
            Some(HostPattern::Exact(h)) => h.clone(),
            Some(HostPattern::Suffix(s)) => format!("*{s}"),
            None => "*".to_string(),
        };
        let methods = route
            .methods
            .as_ref()
            .map(|m| m.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(","))
            .unwrap_or_else(|| "any".to_string());
        say!(
            "route       {}: host {} path {} methods {} -> {}{}{}",
            route.name,
            host,
            route.path_prefix,
            methods,
            config.upstream(route).name,
            if route.shadow { " (shadow)" } else { "" },
            match route.on_store_error {
                Some(policy) => format!(" (on_store_error = {})", policy.as_str()),
                None => String::new(),
            }
        );
        for limit in &route.limits {
            say!(
                "  limit     {} {} per {}s {}{}",
                limit.policy_name(),
                limit.requests,
                limit.window_secs,
                limit.algorithm.as_str(),
                if limit.shadow { " (shadow)" } else { "" }
            );
        }
    }
}

/// An upstream origin as the file wrote it: `scheme://authority`. `Uri`'s own `Display`
/// adds the path `/` that an origin has none of, which reads as if tollgate changed the URL.
fn origin_text(origin: &Uri) -> String {
    match (origin.scheme_str(), origin.authority()) {
        (Some(scheme), Some(authority)) => format!("{scheme}://{authority}"),
        _ => origin.to_string(),
    }
}

async fn migrate(config: Config, accept_new_key: bool) -> ExitCode {
    if config.store.url.is_none() {
        eprintln!(
            "{}: store.url is not set: the memory store has nothing to migrate",
            config.source.display()
        );
        return ExitCode::from(2);
    }
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let store = match PostgresStore::new(&config.store) {
        Ok(store) => store,
        Err(err) => {
            eprintln!("tollgate: {err}");
            return ExitCode::from(1);
        }
    };
    match store.migrate(&hasher.fingerprint(), accept_new_key).await {
        Ok(report) => {
            say!("{report}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("tollgate: migrate failed: {err}");
            ExitCode::from(1)
        }
    }
}

/// A request given on the command line (`explain`, `reset`): the method, URL and headers
/// parsed, or a usage error.
struct CommandRequest {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
}

fn command_request(
    method: &str,
    url: &str,
    header_args: &[String],
) -> Result<CommandRequest, String> {
    let Ok(method) = Method::from_bytes(method.to_ascii_uppercase().as_bytes()) else {
        return Err(format!("not an HTTP method: {method}"));
    };
    let Ok(uri) = url.parse::<Uri>() else {
        return Err("URL does not parse".to_string());
    };
    let mut headers = HeaderMap::new();
    for arg in header_args {
        let Some((name, value)) = arg.split_once(':') else {
            return Err("--header takes 'Name: value'".to_string());
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.trim().as_bytes()),
            HeaderValue::from_str(value.trim()),
        ) else {
            return Err("--header has an invalid name or value".to_string());
        };
        headers.append(name, value);
    }
    Ok(CommandRequest {
        method,
        uri,
        headers,
    })
}

/// The one-off commands' budget for a call to the store beyond making its connection: the
/// request path's `store.timeout` (100 ms by default) is a decision's budget, pool connect
/// included, and a command that connects afresh on a loaded machine or to a distant database
/// cannot keep to it (issue 19: `explain` failed under load).
const COMMAND_STORE_GRACE: Duration = Duration::from_secs(5);

/// Why a command could not use the store: the `store` line of `explain`'s output
/// (`unreachable (...)`), and the cause for the command's one stderr line.
struct StoreProblem {
    line: String,
    cause: String,
}

impl StoreProblem {
    /// A store that was reached but did not answer as needed, or could not be set up.
    fn failed(err: impl std::fmt::Display) -> StoreProblem {
        StoreProblem {
            line: format!("not usable ({err})"),
            cause: err.to_string(),
        }
    }

    fn from_init(err: InitError) -> StoreProblem {
        match err {
            // `run`'s message for this says how to rotate the secret; a command that only
            // reads or resets must not send an operator off rotating keys: most likely it was
            // given another file (or secret) than the running instances'.
            InitError::FingerprintMismatch(_) => StoreProblem {
                line: "key fingerprint mismatch: the database's counters were made with another \
                       keys.secret; the buckets below are this configuration's, not the ones the \
                       running instances count in"
                    .to_owned(),
                cause: "this configuration's keys.secret is not the one the database's instances \
                        use (key fingerprint mismatch): give the command the same configuration, \
                        and TOLLGATE_KEY_SECRET, as the running instances"
                    .to_owned(),
            },
            InitError::Unreachable(ref m) => StoreProblem {
                line: format!("unreachable ({m})"),
                cause: err.to_string(),
            },
            other => StoreProblem::failed(other),
        }
    }
}

/// The Postgres store for a command that reads or writes counters: no migration, but the key
/// fingerprint must match, or the buckets would not be the ones the running instances use.
/// Every call gets the time to make a connection plus [`COMMAND_STORE_GRACE`].
async fn command_store(
    config: &Config,
    hasher: &BucketHasher,
) -> Result<Arc<PostgresStore>, StoreProblem> {
    let mut store = config.store.clone();
    let connect = postgres::connect_deadline_for(&store).map_err(StoreProblem::failed)?;
    store.timeout = store.timeout.max(connect + COMMAND_STORE_GRACE);
    let pg = PostgresStore::new(&store).map_err(StoreProblem::failed)?;
    pg.initialize(&hasher.fingerprint(), false)
        .await
        .map_err(StoreProblem::from_init)?;
    Ok(pg)
}

/// The first half of `explain` and `reset`: plans `request` as the proxy would and prints
/// the request and route lines. `Err` is the exit code to stop with: a usage error, or
/// success when no route matches.
fn plan_and_say_route<'c>(
    config: &'c Config,
    hasher: &BucketHasher,
    ip: IpAddr,
    request: &CommandRequest,
    usage: impl Fn(String) -> ExitCode,
) -> Result<RequestPlan<'c>, ExitCode> {
    let plan = match plan::plan_request(
        config,
        hasher,
        ip,
        &request.method,
        &request.uri,
        &request.headers,
    ) {
        Ok(plan) => plan,
        Err(PlanError::Normalise(e @ NormaliseError::MissingHost)) => {
            return Err(usage(format!(
                "{e} (give an absolute URL or a Host header)"
            )))
        }
        Err(e) => return Err(usage(e.to_string())),
    };
    say!(
        "request     {} {}{} from {ip}",
        request.method,
        plan.authority,
        plan.path
    );
    if !say_route(config, &plan) {
        return Err(ExitCode::SUCCESS);
    }
    Ok(plan)
}

/// Prints the route line of `explain`/`reset`; false when there is nothing more to say.
fn say_route(config: &Config, plan: &RequestPlan<'_>) -> bool {
    let Some((_, route)) = plan.route else {
        say!("route       none: the request would get 404 and not be forwarded");
        return false;
    };
    say!(
        "route       {} -> upstream {}",
        route.name,
        config.upstream(route).name
    );
    if route.limits.is_empty() {
        say!("limits      none: the request would be forwarded");
        return false;
    }
    true
}

/// `limit ...: does not apply (no X header)` for a limit whose key the request lacks.
fn say_not_applying(limit: &config::LimitConfig, headers: &HeaderMap) {
    let missing: Vec<String> = limit
        .key
        .parts
        .iter()
        .filter_map(|p| match p {
            KeyPart::Header(h) if !headers.contains_key(h) => Some(h.to_string()),
            _ => None,
        })
        .collect();
    say!(
        "limit       {}: does not apply (no {} header)",
        limit.policy_name(),
        missing.join("/")
    );
}

async fn explain(
    config: Config,
    ip: IpAddr,
    header_args: Vec<String>,
    method: String,
    url: String,
) -> ExitCode {
    let usage = |message: String| {
        eprintln!("tollgate explain: {message}");
        ExitCode::from(2)
    };
    let request = match command_request(&method, &url, &header_args) {
        Ok(r) => r,
        Err(message) => return usage(message),
    };
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let plan = match plan_and_say_route(&config, &hasher, ip, &request, usage) {
        Ok(plan) => plan,
        Err(code) => return code,
    };
    // What the store says, or why it says nothing: either way every limit and its bucket is
    // shown, since those come from the configuration alone (issue 19).
    let planned: Vec<&PlannedLimit> = plan.planned().collect();
    let counts = if planned.is_empty() {
        Ok(Vec::new())
    } else {
        explain_counts(&config, &hasher, &planned).await
    };
    let (mut counts, problem) = match counts {
        Ok(counts) => (counts.into_iter(), None),
        Err(problem) => {
            let kind = if config.store.url.is_some() {
                "postgres"
            } else {
                "memory"
            };
            say!("store       {kind}: {}", problem.line);
            (Vec::new().into_iter(), Some(problem))
        }
    };
    let mut would_allow = true;
    for (limit, planned) in &plan.limits {
        let Some(planned) = planned else {
            say_not_applying(limit, &request.headers);
            continue;
        };
        let head = format!(
            "limit       {}{}: {} per {}s{}, bucket {}",
            planned.policy,
            if planned.shadow { " (shadow)" } else { "" },
            planned.requests,
            planned.window_secs,
            if planned.sliding { " sliding" } else { "" },
            planned.bucket,
        );
        let Some(peeked) = counts.next() else {
            say!("{head}, count unknown");
            continue;
        };
        let (standing, fits) = standing(planned, &peeked);
        if !fits && !planned.shadow {
            would_allow = false;
        }
        say!(
            "{head}, {standing}, window resets in {}s -> {}",
            tollgate::limit::seconds_until(peeked.now_ms, peeked.window_end_ms),
            if fits { "within" } else { "exceeded" }
        );
    }
    if let Some(problem) = problem {
        say!("decision    unknown: the counters could not be read");
        eprintln!(
            "tollgate explain: cannot read the counters: {}",
            problem.cause
        );
        return ExitCode::from(1);
    }
    say!(
        "decision    {}",
        if would_allow {
            "allowed"
        } else {
            "limited (429)"
        }
    );
    ExitCode::SUCCESS
}

/// `explain`'s one read of the counters of `planned` (one round trip), in that order, and
/// the `store` line that says where they come from. The memory store's counts live in the
/// running process: a fresh one here reads 0.
async fn explain_counts(
    config: &Config,
    hasher: &BucketHasher,
    planned: &[&PlannedLimit],
) -> Result<Vec<Peeked>, StoreProblem> {
    let (store, line): (Arc<dyn Store>, &str) = match &config.store.url {
        Some(_) => (
            command_store(config, hasher).await?,
            "store       postgres: counts as the database has them now",
        ),
        None => (
            Arc::new(tollgate::store::memory::MemoryStore::new()),
            "store       memory: counts live inside the running process; shown as 0 here",
        ),
    };
    let probe: Vec<Increment> = planned
        .iter()
        .map(|p| Increment {
            bucket: p.bucket.clone(),
            window_secs: p.window_secs,
            by: 0,
            sliding: None,
            enforce: None,
        })
        .collect();
    match store.peek(&probe).await {
        Ok(peeked) if peeked.len() == probe.len() => {
            say!("{line}");
            Ok(peeked)
        }
        Ok(_) => Err(StoreProblem::failed("the store answered oddly")),
        Err(err) => Err(StoreProblem::failed(err)),
    }
}

/// Where one limit stands for `explain`, and whether this request would fit: a fixed window
/// by its count (`count + 1 <= requests`); a sliding one by SPEC 3a's estimate
/// `previous * (window - elapsed) / window + count + 1`, with the rule the stores admit by.
fn standing(planned: &PlannedLimit, peeked: &Peeked) -> (String, bool) {
    if !planned.sliding {
        let fits = peeked.count.saturating_add(1) <= planned.requests;
        return (format!("count {}", peeked.count), fits);
    }
    let len_ms = i64::from(planned.window_secs) * 1000;
    let left_ms = (peeked.window_end_ms - peeked.now_ms).clamp(0, len_ms);
    let weighs = tollgate::limit::weighted_previous(peeked.previous, left_ms, len_ms);
    let estimate = weighs + f64::from(peeked.count) + 1.0;
    let fits = tollgate::store::memory::sliding_admits(
        planned.requests,
        peeked.previous,
        peeked.count,
        1,
        left_ms,
        len_ms,
    ) == 1;
    (
        format!(
            "count {}, previous window {} (weighs {weighs:.2}), estimate {estimate:.2} with this request",
            peeked.count, peeked.previous
        ),
        fits,
    )
}

/// `tollgate reset` (SPEC 3b): the buckets `explain` names, deleted for the current and the
/// previous window, and every running instance told to forget them.
async fn reset(
    config: Config,
    ip: IpAddr,
    header_args: Vec<String>,
    method: String,
    url: String,
) -> ExitCode {
    let usage = |message: String| {
        eprintln!("tollgate reset: {message}");
        ExitCode::from(2)
    };
    let request = match command_request(&method, &url, &header_args) {
        Ok(r) => r,
        Err(message) => return usage(message),
    };
    if config.store.url.is_none() {
        eprintln!(
            "tollgate reset: {}: the memory store's counters live inside the running tollgate \
             process, which another process cannot reach; restart it to forget them",
            config.source.display()
        );
        return ExitCode::from(1);
    }
    let hasher = BucketHasher::new(config.keys.secret.as_deref());
    let plan = match plan_and_say_route(&config, &hasher, ip, &request, usage) {
        Ok(plan) => plan,
        Err(code) => return code,
    };
    for (limit, planned) in &plan.limits {
        if planned.is_none() {
            say_not_applying(limit, &request.headers);
        }
    }
    // Two limits of one route may share a bucket (same scope and key): reset it once.
    let mut buckets: Vec<(Arc<str>, u32)> = Vec::new();
    for planned in plan.planned() {
        if !buckets.iter().any(|(b, _)| *b == planned.bucket) {
            buckets.push((planned.bucket.clone(), planned.window_secs));
        }
    }
    if buckets.is_empty() {
        say!("reset       nothing: no limit applies to this request");
        return ExitCode::SUCCESS;
    }
    let pg = match command_store(&config, &hasher).await {
        Ok(pg) => pg,
        Err(problem) => {
            eprintln!(
                "tollgate reset: cannot reset the counters: {}",
                problem.cause
            );
            return ExitCode::from(1);
        }
    };
    match pg.reset(&buckets).await {
        Ok(done) => {
            for bucket in done {
                let previous = match bucket.previous {
                    Some(count) => format!(", previous window {count}"),
                    None => String::new(),
                };
                say!(
                    "reset       bucket {}: count was {}{previous}",
                    bucket.bucket,
                    bucket.count
                );
            }
            say!("notified    every running instance forgets these buckets within a second");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("tollgate reset: cannot reset the counters: {err}");
            ExitCode::from(1)
        }
    }
}
