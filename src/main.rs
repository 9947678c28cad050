//! The `idemflow` binary: parses the command line and runs one command ([`cli`], one file per command).

// The RocketMQ client's futures are deeply nested (its own crates set the same limit).
#![recursion_limit = "256"]

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    idemflow::install_tls_provider();
    let cli = cli::Cli::parse();
    if !cli.command.serves() {
        // An operator's command ends quietly when what reads its output goes away (`dead-letters list | head`), as
        // Unix tools do, instead of panicking on the first write after it. Rust ignores SIGPIPE by default; sockets
        // are written with MSG_NOSIGNAL (std, mio, librdkafka), so only a closed stdout or stderr raises it. The
        // worker and the tools that serve keep ignoring it.
        // SAFETY: called before any other thread exists; SIG_DFL is a valid disposition for SIGPIPE.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    match runtime.block_on(cli::dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
