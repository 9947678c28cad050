//! The commands of the `idemflow` binary, one file each, and what they share: reading the settings, naming a
//! pipeline, opening its store. `main.rs` parses the command line and calls [`dispatch`].

mod check;
mod dead_letters;
mod dedup;
mod explain;
mod migrate;
mod purge;
mod rewind;
mod run;
#[cfg(feature = "tools")]
mod tools;

use anyhow::bail;
use clap::{Parser, Subcommand};
use idemflow::config::{self, PipelineError, Settings};
use idemflow::store::contract::NotReady;
use idemflow::store::spec::StoreKind;
use idemflow::store::Store;
use idemflow::{telemetry, worker};
use std::path::{Path, PathBuf};

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

/// `--config`, for the commands that need nothing else.
#[derive(clap::Args)]
pub struct ConfigArg {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
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

/// The settings of `path` (and `IDEMFLOW_*` variables), with logging set up from them.
///
/// Errors: a `--config` file that is not there, or settings that do not parse (file, line and key named).
fn load(path: &Path) -> anyhow::Result<Settings> {
    // Only the default settings file may be absent (settings then come from IDEMFLOW_* variables alone): a file
    // named with --config that is not there is a mistake, not a fallback.
    if !path.exists() && path != Path::new(DEFAULT_CONFIG) {
        bail!("{}: no such settings file (given with --config)", path.display());
    }
    let loaded = config::load_settings(path)?;
    telemetry::init(&loaded.settings.log);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    Ok(loaded.settings)
}


/// The settings file read when `--config` is not given.
const DEFAULT_CONFIG: &str = "idemflow.toml";

/// Prints every pipeline problem, one per line; the error counts them.
fn report(errors: &[PipelineError]) -> anyhow::Error {
    for e in errors {
        eprintln!("{e}");
    }
    anyhow::anyhow!("{} problem(s) in the pipelines", errors.len())
}

/// The pipeline named `name`, or an error saying where pipelines were looked for.
fn named<'p>(pipelines: &'p [config::Pipeline], name: &str, settings: &Settings) -> anyhow::Result<&'p config::Pipeline> {
    pipelines
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| anyhow::anyhow!("no pipeline named {name:?} in {}", settings.pipelines.display()))
}

/// The store of `kind`, reachable and with idemflow's schema, or the reason against the settings file `config`.
async fn open_store(settings: &Settings, config: &Path, kind: StoreKind) -> anyhow::Result<Store> {
    settings.stores().open(kind).await.map_err(|why| anyhow::anyhow!("{}: {why}", config.display()))
}

/// Every store `pipelines` write to, opened, the database first.
///
/// Errors: as [`idemflow::store::open::Stores::open`]; the caller names the settings file.
async fn open_stores(settings: &Settings, pipelines: &[config::Pipeline]) -> Result<Vec<(StoreKind, Store)>, NotReady> {
    let mut stores = Vec::new();
    for kind in idemflow::store::open::needed(pipelines.iter().map(|p| p.sink.store())) {
        stores.push((kind, settings.stores().open(kind).await?));
    }
    Ok(stores)
}

/// What each store's durability means for the pipelines writing to it: one line each, `warning: ` first where it
/// is one.
async fn durability(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Vec<String> {
    let mut lines = Vec::new();
    for (kind, store) in stores {
        let tenants: Vec<idemflow::store::contract::Tenant> = pipelines.iter().filter(|p| p.sink.store() == *kind).map(|p| p.tenant()).collect();
        lines.extend(store.durability(&tenants).await);
    }
    lines
}

/// How long each pipeline's dedup rows live, from its retention and its store's sweep
/// ([`idemflow::retention::lifetime_note`]); nothing for a store whose keys expire by themselves (Redis says its own).
async fn lifetimes(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Vec<String> {
    let mut lines = Vec::new();
    for p in pipelines.iter().filter(|p| !p.sink.store().expires_dedup_keys()) {
        let Some((_, store)) = stores.iter().find(|(kind, _)| *kind == p.sink.store()) else { continue };
        match store.sweep_state(&p.name).await {
            Ok(state) => lines.push(idemflow::retention::lifetime_note(&p.name, p.dedup.retention, p.dedup.purge_interval, p.dedup.purge_rate, state.as_ref())),
            Err(e) => lines.push(format!("warning: pipeline {:?}: could not read its retention sweep's state: {e}", p.name)),
        }
    }
    lines
}

/// Checks every pipeline against its store, all problems at once.
async fn prepare_all(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Result<Vec<worker::Ready>, worker::Unprepared> {
    let mut ready = Vec::new();
    let mut errors = worker::Unprepared { problems: Vec::new(), unavailable: false };
    for (kind, store) in stores {
        let mine: Vec<config::Pipeline> = pipelines.iter().filter(|p| p.sink.store() == *kind).cloned().collect();
        match worker::prepare(store, &mine).await {
            Ok(r) => ready.extend(r),
            Err(e) => {
                errors.unavailable |= e.unavailable;
                errors.problems.extend(e.problems);
            }
        }
    }
    if errors.problems.is_empty() { Ok(ready) } else { Err(errors) }
}
