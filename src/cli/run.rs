//! `tollgate run`: the server started, then driven by signals (SIGHUP reloads; SIGTERM and
//! SIGINT drain and stop).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::Config;
use crate::Server;

use super::{Env, Http1Stack, Logging, RunArgs};

/// `tollgate run`: serves until SIGTERM or SIGINT; SIGHUP reloads the file at `path`.
pub async fn run(
    config: Config,
    path: PathBuf,
    args: &RunArgs,
    logging: &Logging,
    env: Env,
) -> ExitCode {
    // Before anything is bound: every connection and upstream request needs a descriptor
    // (contract §9). It logs the figure, or why it could not.
    let _ = crate::server::raise_open_file_limit();
    let fast = args.http1 == Http1Stack::Fast;
    let mut builder = Server::builder(config)
        .log_drops(logging.drops.clone())
        .http1_fast_path(fast)
        .http1_direct_client(fast);
    if let Some(access) = &logging.access {
        builder = builder.access_log(access.clone());
    }
    let mut server = match builder.start().await {
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
