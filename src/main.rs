//! The `idemflow` command: `migrate`, `check`, `run`.

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use idemflow::config::{self, PipelineError, Settings};
use idemflow::{db, http, metrics, shutdown, telemetry, worker};
use std::path::PathBuf;
use std::process::ExitCode;

/// Exactly-once effects from at-least-once Kafka delivery, with Postgres.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the idemflow schema (dedup store, dead letters).
    Migrate(ConfigArg),
    /// Validate the settings and every pipeline, and prepare their SQL against the database.
    Check(ConfigArg),
    /// Run the worker until SIGTERM or SIGINT.
    Run(ConfigArg),
}

#[derive(clap::Args)]
struct ConfigArg {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: &std::path::Path) -> anyhow::Result<Settings> {
    let loaded = config::load_settings(path)?;
    telemetry::init(&loaded.settings.log);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    Ok(loaded.settings)
}

fn report(errors: &[PipelineError]) -> anyhow::Error {
    for e in errors {
        eprintln!("{e}");
    }
    anyhow::anyhow!("{} problem(s) in the pipelines", errors.len())
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate(a) => {
            let settings = load(&a.config)?;
            let pool = db::pool(&settings.database)?;
            db::MIGRATOR.run(&pool).await.context("applying migrations")?;
            println!("idemflow schema is up to date");
            Ok(())
        }
        Command::Check(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines(&settings.pipelines).map_err(|e| report(&e))?;
            let pool = db::pool(&settings.database)?;
            if let Err(why) = db::check_schema(&pool).await {
                bail!("{}: database: {why}", a.config.display());
            }
            let ready = worker::prepare(&pool, &pipelines).await.map_err(|e| report(&e))?;
            for r in &ready {
                let p = &r.pipeline;
                println!("pipeline {:?} ({}): ok, topics {:?}, group {:?}", p.name, p.file.display(), p.topics, p.group_id);
            }
            Ok(())
        }
        Command::Run(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines(&settings.pipelines).map_err(|e| report(&e))?;
            let pool = db::pool(&settings.database)?;
            if let Err(why) = db::check_schema(&pool).await {
                bail!("{}: database: {why}", a.config.display());
            }
            let ready = worker::prepare(&pool, &pipelines).await.map_err(|e| report(&e))?;
            let metrics = metrics::Metrics::new();
            let health = http::Health::default();
            let server = http::serve(settings.metrics.listen, metrics.clone(), health.clone())
                .with_context(|| format!("binding metrics.listen = {}", settings.metrics.listen))?;
            tracing::info!(address = %server.addr(), "serving /metrics, /healthz and /readyz");
            let (trigger, stop) = shutdown::channel();
            let timeout = settings.shutdown.timeout;
            tokio::spawn(async move {
                shutdown::signals().await;
                trigger.trigger();
                tokio::time::sleep(timeout).await;
                eprintln!("shutdown took longer than shutdown.timeout = {timeout:?}; exiting");
                std::process::exit(1);
            });
            let failures = worker::run(&settings, ready, &metrics, &health, stop).await;
            pool.close().await;
            if failures.is_empty() {
                tracing::info!("stopped cleanly");
                Ok(())
            } else {
                bail!("{} pipeline(s) failed: {}", failures.len(), failures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; "))
            }
        }
    }
}
