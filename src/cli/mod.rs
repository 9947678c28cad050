//! The commands of the `idemflow` binary, one file each, and what they share ([`workspace`]): reading the settings,
//! naming a pipeline, opening its store. `main.rs` parses the command line and calls [`dispatch`].

mod check;
mod dead_letters;
mod dedup;
mod explain;
mod migrate;
mod outbox;
mod pipeline;
mod purge;
mod rewind;
mod run;
#[cfg(feature = "tools")]
mod tools;
mod workspace;
pub use workspace::ConfigArg;

use clap::{Parser, Subcommand};
use idemflow::config;

/// Exactly-once effects from at-least-once brokers (Kafka topics, RabbitMQ queues, RocketMQ topics, NATS JetStream
/// streams) into PostgreSQL, MySQL/MariaDB or Redis: per batch one transaction (one script on Redis) writes a dedup
/// row per business key and applies the side effect only for keys never seen; only then are the broker's offsets
/// committed or its deliveries acknowledged.
#[derive(Parser)]
#[command(version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    /// The command to run.
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Create or upgrade idemflow's tables (dedup rows, dead letters, stored positions) in PostgreSQL or
    /// MySQL/MariaDB; Redis needs none.
    Migrate(ConfigArg),
    /// Validate the settings and every pipeline, ask each broker (Kafka, RabbitMQ, RocketMQ, NATS JetStream) for its
    /// topics, queues or stream and consumer, and prepare each side effect against its store (PostgreSQL,
    /// MySQL/MariaDB, Redis).
    Check(check::CheckArgs),
    /// Run the worker (every pipeline, any broker and store) until SIGTERM or SIGINT; serves /metrics, /healthz and
    /// /readyz.
    Run(ConfigArg),
    /// Was this business key applied? When, from which record, and how many duplicates of it were skipped since
    /// (any store).
    Explain(explain::ExplainArgs),
    /// Inspect dead letters and replay them once the cause is fixed (any store).
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLettersCommand),
    /// Operate on the dedup store: `forget` keys whose effects never ran (after a side effect that ended the batch
    /// transaction itself), so their records are applied when they come again (PostgreSQL, MySQL/MariaDB).
    #[command(subcommand)]
    Dedup(dedup::DedupCommand),
    /// Move a pipeline's consumer group back (with its workers stopped) so its topics are consumed again: Kafka and
    /// RocketMQ (a RabbitMQ queue has no position to go back to, a JetStream consumer keeps its own on the server);
    /// the dedup store skips every record already applied.
    Rewind(rewind::RewindArgs),
    /// What waits in the outbox per pipeline and target (`list`), and requests in back-off sent at once
    /// (`retry-now`) (PostgreSQL, MySQL/MariaDB).
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
    /// Operate on a pipeline's history: `rename` it to a new name, with its dedup rows, processed marks, stored
    /// positions, dead letters and outbox requests, in one transaction (PostgreSQL, MySQL/MariaDB).
    #[command(subcommand)]
    Pipeline(pipeline::PipelineCommand),
    /// Run one retention pass by hand: delete each pipeline's dedup rows older than its [dedup] retention
    /// (PostgreSQL, MySQL/MariaDB; Redis expires its dedup keys by themselves).
    Purge(purge::PurgeArgs),
    /// See the whole job on this machine: an embedded Kafka broker (or a throwaway RabbitMQ or NATS), a throwaway
    /// PostgreSQL (or MySQL/MariaDB, Redis), a stream of payments with duplicates of every kind, and a summary that checks
    /// each payment took effect exactly once.
    #[cfg(feature = "tools")]
    Demo(tools::DemoArgs),
    /// Measure throughput, CPU, memory and latency against the baselines (one record per transaction, a raw COPY,
    /// a consume-only pass), side by side in one run, on an embedded Kafka (or a throwaway RabbitMQ or NATS) and a
    /// throwaway PostgreSQL.
    #[cfg(feature = "tools")]
    Bench(tools::BenchArgs),
    /// Hold the guarantee under faults for a while (an hour by default): a steady stream with duplicates from an
    /// embedded Kafka into a throwaway PostgreSQL while the worker is SIGKILLed, PostgreSQL and the broker restarted
    /// and packets dropped at random moments; then checks every operation applied once, the counters and the
    /// worker's memory, open files and threads.
    #[cfg(feature = "tools")]
    Soak(tools::SoakArgs),
    /// Print a shell completion script for idemflow's commands and options: `idemflow completions bash >
    /// /etc/bash_completion.d/idemflow` (or zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the JSON Schema of idemflow.toml (`settings`) or of a pipeline file (`pipeline`), for editors with a
    /// TOML language server and for CI: `idemflow schema pipeline > pipeline.schema.json`.
    Schema {
        /// Which file.
        #[arg(value_enum)]
        file: SchemaFile,
    },
    /// Send the demo's stream of payments (with duplicates) to a real Kafka, RocketMQ or NATS JetStream, at --rate
    /// records a second until interrupted (Ctrl-C or SIGTERM; for docker-compose, and for trying a pipeline on your
    /// own broker).
    #[cfg(feature = "tools")]
    DemoProducer(tools::DemoProducerArgs),
}

/// The files `idemflow schema` describes.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SchemaFile {
    /// `idemflow.toml`: the worker's settings.
    Settings,
    /// `pipelines/<name>.toml`: one pipeline.
    Pipeline,
}

impl Command {
    /// Whether the command serves (the worker) or drives servers and child processes (the tools), rather than
    /// printing an answer and ending: those keep SIGPIPE ignored, so a peer or a child that goes away never ends them.
    pub fn serves(&self) -> bool {
        match self {
            Command::Run(_) => true,
            #[cfg(feature = "tools")]
            Command::Demo(_) | Command::Bench(_) | Command::Soak(_) => true,
            _ => false,
        }
    }
}

/// Runs `command`.
///
/// Errors: the command's, with the settings file or pipeline it is about.
pub async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate(a) => migrate::run(a).await,
        Command::Check(a) => check::run(a).await,
        Command::Run(a) => run::run(a).await,
        Command::Explain(a) => explain::run(a).await,
        Command::DeadLetters(cmd) => dead_letters::run(cmd).await,
        Command::Dedup(cmd) => dedup::run(cmd).await,
        Command::Rewind(a) => rewind::run(a).await,
        Command::Purge(a) => purge::run(a).await,
        Command::Pipeline(cmd) => pipeline::run(cmd).await,
        Command::Outbox(cmd) => outbox::run(cmd).await,
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "idemflow", &mut std::io::stdout());
            Ok(())
        }
        Command::Schema { file } => {
            print!("{}", match file {
                SchemaFile::Settings => config::schema::SETTINGS,
                SchemaFile::Pipeline => config::schema::PIPELINE,
            });
            Ok(())
        }
        #[cfg(feature = "tools")]
        Command::Demo(a) => tools::demo(a).await,
        #[cfg(feature = "tools")]
        Command::Bench(a) => tools::bench(a).await,
        #[cfg(feature = "tools")]
        Command::Soak(a) => tools::soak(a).await,
        #[cfg(feature = "tools")]
        Command::DemoProducer(a) => tools::demo_producer(a).await,
    }
}
