//! The `tollgate` command (README, "Command line"): [`tollgate::cli::main`] with the process
//! environment. This is the only place that reads it; everything below gets it as a function.

use std::process::ExitCode;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn main() -> ExitCode {
    tollgate::cli::main(env)
}
