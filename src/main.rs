//! The `tollgate` command (README, "Command line"). `main` parses the arguments, sets up the
//! log, loads the configuration and hands it to one command of [`cli`]. It is the only place
//! that reads the process environment (the commands get it as a function) or decides the exit
//! code.
//!
//! Exit codes: 0 success; 2 invalid configuration or usage; 1 any other failure. Output whose
//! reader has gone (a closed pipe) is dropped without changing the exit code.

use std::process::ExitCode;

use clap::Parser;

use tollgate::config;

mod cli;

use cli::{Cli, Command, Out};

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `explain` and `reset` end every failure with a line of their own on stderr (one clear
    // line, README "Command line"); the store's failure log would say it again as a WARN.
    let quiet = matches!(cli.command, Some(Command::Explain(_) | Command::Reset(_)));
    // Kept to the end of `main`: dropping it writes out the log's last lines.
    let (log_drops, _flush_log) = cli::init_logging(if quiet { "error" } else { "info" }, env);
    let (path, from) = cli::config_path(cli.config, env);
    let config = match config::load_file(&path, &env) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            if !path.exists() {
                eprintln!("{}", cli::missing_config_hint(&path, from));
            }
            return ExitCode::from(2);
        }
    };
    // Certificates are part of the configuration: a key that does not match its
    // certificate, or an expired certificate, is a configuration error like any other.
    let cert_errors = cli::certificate_errors(&config);
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
    let run = || Command::Run(Default::default());
    let code = match cli.command.unwrap_or_else(run) {
        Command::Run(args) => runtime.block_on(cli::run(config, path, &args, log_drops, env)),
        Command::Check => {
            cli::check(&config, &mut out);
            ExitCode::SUCCESS
        }
        Command::Migrate { accept_new_key } => {
            runtime.block_on(cli::migrate(config, accept_new_key, &mut out))
        }
        Command::Explain(args) => runtime.block_on(cli::explain(&mut out, config, &args)),
        Command::Reset(args) => runtime.block_on(cli::reset(&mut out, config, &args)),
    };
    match out.finish() {
        Ok(()) => code,
        Err(err) => {
            eprintln!("tollgate: cannot write the output: {err}");
            ExitCode::from(1)
        }
    }
}
