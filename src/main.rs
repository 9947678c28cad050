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

/// At start-up the database may not be up yet (a compose file starts everything at once): wait for it, with
/// exponential backoff, saying why on every attempt.
async fn wait_for_database(settings: &Settings) {
    use backon::BackoffBuilder;
    let mut backoff = backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(200))
        .with_max_delay(std::time::Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
        .build();
    while let Err(why) = db::ping(&settings.database).await {
        let delay = backoff.next().unwrap_or(std::time::Duration::from_secs(10));
        tracing::warn!(retry_in = ?delay, "database: {why}");
        tokio::time::sleep(delay).await;
    }
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate(a) => {
            let settings = load(&a.config)?;
            db::ping(&settings.database).await.map_err(|why| anyhow::anyhow!("{}: database: {why}", a.config.display()))?;
            let pool = db::pool(&settings.database)?;
            db::MIGRATOR.run(&pool).await.context("applying migrations")?;
            println!("idemflow schema is up to date");
            Ok(())
        }
        Command::Check(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines(&settings.pipelines).map_err(|e| report(&e))?;
            db::ping(&settings.database).await.map_err(|why| anyhow::anyhow!("{}: database: {why}", a.config.display()))?;
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
            wait_for_database(&settings).await;
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
