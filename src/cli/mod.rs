//! The `tollgate` command line (docs: README "Command line"): the arguments, where the
//! configuration file comes from, and one module per command. [`main`] parses, loads the
//! configuration and dispatches to them, and is the one place that decides the exit code;
//! the process environment comes from `main.rs` as an [`Env`] function.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config;

mod check;
mod explain;
mod logging;
mod migrate;
mod output;
mod overrides;
mod reading;
mod request;
mod reset;
mod run;
mod usage;

pub use check::{certificate_errors, check};
pub use explain::explain;
pub use logging::{init_logging, Logging};
pub use migrate::migrate;
pub use output::Out;
pub use overrides::overrides;
pub use reset::reset;
pub use run::run;
pub use usage::usage;

/// The whole `tollgate` command, for `main.rs`: parses the arguments, sets up the log, loads
/// the configuration and hands it to one command. `env` reads the process environment; only
/// `main.rs` passes the real one.
///
/// Exit codes: 0 success; 2 invalid configuration or usage; 1 any other failure. Output whose
/// reader has gone (a closed pipe) is dropped without changing the exit code.
pub fn main(env: Env) -> ExitCode {
    let cli = Cli::parse();
    // `explain`, `usage`, `reset` and `override` end every failure with a line of their own
    // on stderr (one clear line, README "Command line"); the store's failure log would say it
    // again as a WARN.
    let quiet = matches!(
        cli.command,
        Some(Command::Explain(_) | Command::Usage(_) | Command::Reset(_) | Command::Override(_))
    );
    // Kept to the end of `main`: dropping it writes out the log's last lines (after the
    // runtime, whose workers hand over their last access-log lines as they go).
    let logging = init_logging(if quiet { "error" } else { "info" }, env);
    let (path, from) = config_path(cli.config, env);
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
    let mut out = Out::stdout();
    let default_command = || Command::Run(Default::default());
    let code = match cli.command.unwrap_or_else(default_command) {
        Command::Run(args) => runtime.block_on(run(config, path, &args, &logging, env)),
        Command::Check => {
            check(&config, &mut out);
            ExitCode::SUCCESS
        }
        Command::Migrate { accept_new_key } => {
            runtime.block_on(migrate(config, accept_new_key, &mut out))
        }
        Command::Explain(args) => runtime.block_on(explain(&mut out, config, &args)),
        Command::Usage(args) => runtime.block_on(usage(&mut out, config, &args)),
        Command::Reset(args) => runtime.block_on(reset(&mut out, config, &args)),
        Command::Override(action) => runtime.block_on(overrides(&mut out, config, &action)),
    };
    match out.finish() {
        Ok(()) => code,
        Err(err) => {
            eprintln!("tollgate: cannot write the output: {err}");
            ExitCode::from(1)
        }
    }
}

/// The process environment as `main` reads it; tests pass their own.
pub type Env = fn(&str) -> Option<String>;

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A rate-limiting reverse proxy with counters in PostgreSQL"
)]
pub struct Cli {
    /// Configuration file [default: $TOLLGATE_CONFIG, then ./proxy.toml]
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve until SIGTERM or SIGINT (the default)
    Run(RunArgs),
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
    Explain(RequestArgs),
    /// What `explain` reads, as one JSON object: per limit that applies, its bucket, requests,
    /// window, algorithm, units used and left, and seconds until the window ends
    Usage(RequestArgs),
    /// Forget what a request's buckets counted (current window, and the previous one), in the
    /// database and in every running instance's cache of denials
    Reset(RequestArgs),
    /// Per-subject limits kept in the database, applied by every running instance within a
    /// second, without a reload
    #[command(subcommand)]
    Override(OverrideAction),
}

/// `tollgate override ...`.
#[derive(Subcommand)]
pub enum OverrideAction {
    /// Store (or replace) the `requests` of one subject's bucket of a limit
    Set {
        #[command(flatten)]
        subject: SubjectArgs,
        /// The subject's `requests` instead of the limit's; 0 blocks it
        #[arg(long, value_name = "N", allow_hyphen_values = true)]
        requests: String,
        /// When it stops applying, RFC 3339 (e.g. 2027-01-31T00:00:00Z); none: no end
        #[arg(long, value_name = "TIME", allow_hyphen_values = true)]
        until: Option<String>,
        /// Why, for the next operator (shown by `override list`)
        #[arg(long, value_name = "TEXT", default_value = "")]
        note: String,
    },
    /// Delete the override of one subject's bucket: the limit's `requests` apply again
    Remove {
        #[command(flatten)]
        subject: SubjectArgs,
    },
    /// Print every override (bucket digests, never a subject), one per line
    List {
        /// Only the overrides of this limit
        #[arg(long, value_name = "SCOPE:LABEL")]
        limit: Option<String>,
    },
}

/// Whose bucket an override is for: a limit, and the subject as `explain` takes it.
#[derive(clap::Args)]
pub struct SubjectArgs {
    /// The limit, as `check` and the rate-limit headers name it (e.g. api:authorization)
    #[arg(long, value_name = "SCOPE:LABEL")]
    pub limit: String,
    /// The client address, for a limit keyed on `ip`
    #[arg(long, value_name = "ADDR")]
    pub ip: Option<String>,
    /// A header the limit keys on, as 'Name: value' (repeatable)
    #[arg(long = "header", value_name = "'Name: value'")]
    pub headers: Vec<String>,
}

/// How `run` serves.
#[derive(clap::Args, Default)]
pub struct RunArgs {
    /// Which HTTP/1.1 code carries requests: `fast` (tollgate's own server and client for
    /// simple requests, hyper's for the rest) or `hyper` (hyper's for every request); for
    /// diagnosis and measurement (docs/performance.md)
    #[arg(long, value_enum, default_value_t = Http1Stack::Fast)]
    pub http1: Http1Stack,
}

/// `run --http1`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Http1Stack {
    #[default]
    Fast,
    Hyper,
}

/// A request given on the command line, as `explain`, `usage` and `reset` take it.
#[derive(clap::Args)]
pub struct RequestArgs {
    /// Client address the request comes from
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub ip: IpAddr,
    /// A request header, as 'Name: value' (repeatable)
    #[arg(long = "header", value_name = "'Name: value'")]
    pub headers: Vec<String>,
    /// Request method, e.g. GET
    pub method: String,
    /// Request URL, e.g. http://api.example.com/oauth/register
    pub url: String,
}

/// Where the configuration path came from (contract §1: `--config`, then `$TOLLGATE_CONFIG`, then
/// `./proxy.toml`), so that a missing file's message can say which one to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigFrom {
    Flag,
    Env,
    Default,
}

pub fn config_path(flag: Option<PathBuf>, env: Env) -> (PathBuf, ConfigFrom) {
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
pub fn missing_config_hint(path: &std::path::Path, from: ConfigFrom) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn config_env(name: &str) -> Option<String> {
        (name == "TOLLGATE_CONFIG").then(|| "/etc/tollgate/from-env.toml".to_owned())
    }

    fn empty_config_env(name: &str) -> Option<String> {
        (name == "TOLLGATE_CONFIG").then(String::new)
    }

    #[test]
    fn the_flag_wins_then_the_variable_then_proxy_toml() {
        let flag = Some(PathBuf::from("given.toml"));
        assert_eq!(
            config_path(flag.clone(), config_env),
            (PathBuf::from("given.toml"), ConfigFrom::Flag)
        );
        assert_eq!(
            config_path(None, config_env),
            (
                PathBuf::from("/etc/tollgate/from-env.toml"),
                ConfigFrom::Env
            )
        );
        assert_eq!(
            config_path(None, no_env),
            (PathBuf::from("proxy.toml"), ConfigFrom::Default)
        );
        // An empty variable is as good as unset.
        assert_eq!(
            config_path(None, empty_config_env),
            (PathBuf::from("proxy.toml"), ConfigFrom::Default)
        );
    }

    #[test]
    fn a_missing_file_says_how_its_path_was_chosen() {
        let path = std::path::Path::new("proxy.toml");
        let hint = missing_config_hint(path, ConfigFrom::Default);
        assert!(
            hint.contains("neither --config nor TOLLGATE_CONFIG"),
            "{hint}"
        );
        let hint = missing_config_hint(path, ConfigFrom::Env);
        assert!(hint.contains("TOLLGATE_CONFIG names proxy.toml"), "{hint}");
        let hint = missing_config_hint(path, ConfigFrom::Flag);
        assert!(hint.contains("given with --config"), "{hint}");
        for from in [ConfigFrom::Flag, ConfigFrom::Env, ConfigFrom::Default] {
            let hint = missing_config_hint(path, from);
            assert!(hint.contains("proxy.toml.example"), "{hint}");
        }
    }

    #[test]
    fn explain_takes_a_method_a_url_and_repeated_headers() {
        let cli = Cli::try_parse_from([
            "tollgate",
            "explain",
            "--config",
            "p.toml",
            "--ip",
            "192.0.2.7",
            "--header",
            "Authorization: Bearer x",
            "--header",
            "X-Tenant: a",
            "POST",
            "http://api.example.com/login",
        ])
        .expect("parses");
        assert_eq!(cli.config, Some(PathBuf::from("p.toml")));
        let Some(Command::Explain(RequestArgs {
            ip,
            headers,
            method,
            url,
        })) = cli.command
        else {
            panic!("not explain");
        };
        assert_eq!(ip, "192.0.2.7".parse::<IpAddr>().expect("an address"));
        assert_eq!(headers, ["Authorization: Bearer x", "X-Tenant: a"]);
        assert_eq!(
            (method.as_str(), url.as_str()),
            ("POST", "http://api.example.com/login")
        );
    }

    /// `--requests -1` reaches the command, which refuses it in one line (contract §1), rather
    /// than clap taking `-1` for an unknown flag and printing its usage block.
    #[test]
    fn override_set_takes_a_negative_requests_as_a_value() {
        let cli = Cli::try_parse_from([
            "tollgate",
            "override",
            "set",
            "--limit",
            "api:authorization",
            "--header",
            "Authorization: Bearer x",
            "--requests",
            "-1",
        ])
        .expect("parses");
        let Some(Command::Override(OverrideAction::Set {
            subject, requests, ..
        })) = cli.command
        else {
            panic!("not override set");
        };
        assert_eq!(requests, "-1");
        assert_eq!(subject.limit, "api:authorization");
        assert_eq!(subject.headers, ["Authorization: Bearer x"]);
    }

    #[test]
    fn run_is_the_default_command() {
        let cli = Cli::try_parse_from(["tollgate"]).expect("parses");
        assert!(cli.command.is_none());
        assert!(Cli::try_parse_from(["tollgate", "bogus"]).is_err());
    }
}
