//! The `idemflow` binary: parses the command line and runs one command ([`cli`], one file per command).

// The RocketMQ client's futures are deeply nested (its own crates set the same limit).
#![recursion_limit = "256"]

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    idemflow::install_tls_provider();
    let cli = cli::Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    match runtime.block_on(cli::dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
