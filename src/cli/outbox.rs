//! `idemflow outbox`: what waits in the outbox, per pipeline and target (`list`), and a backed-off request sent at
//! once (`retry-now`). PostgreSQL, MySQL/MariaDB.

use super::workspace::{load, named, open_store, open_stores, report, unsent_because};
use idemflow::config;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum OutboxCommand {
    /// What waits per pipeline and target: rows due, in back-off and being sent, the oldest's age, the next attempt,
    /// the last error, and `delivery_failed` dead letters; a pipeline or target that is not configured is said so.
    List(ListArgs),
    /// Send a pipeline's requests waiting out a back-off at the relay's next look (every `poll_interval`): all of
    /// them, a target's, or one business key's. Their attempts so far still count.
    RetryNow(RetryNowArgs),
}

#[derive(clap::Args)]
pub struct ListArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// Only this pipeline.
    #[arg(long)]
    pipeline: Option<String>,
}

#[derive(clap::Args)]
pub struct RetryNowArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline.
    #[arg(long)]
    pipeline: String,
    /// Only this target's requests (its `name`).
    #[arg(long)]
    target: Option<String>,
    /// Only this business key's requests (its canonical text, as for `explain`).
    #[arg(long)]
    key: Option<String>,
}

/// Runs `outbox`.
///
/// Errors: the settings, the pipelines or the store cannot be read.
pub async fn run(command: OutboxCommand) -> anyhow::Result<()> {
    match command {
        OutboxCommand::List(a) => list(a).await,
        OutboxCommand::RetryNow(a) => retry_now(a).await,
    }
}

async fn list(a: ListArgs) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    if let Some(name) = &a.pipeline {
        named(&pipelines, name, &settings)?;
    }
    let stores = open_stores(&settings, &pipelines).await.map_err(|e| anyhow::anyhow!("{}: {e}", a.config.display()))?;
    let mut any = false;
    for (kind, store) in &stores {
        for u in store.unsent().await?.into_iter().filter(|u| a.pipeline.as_ref().is_none_or(|p| *p == u.pipeline)) {
            any = true;
            let configured = unsent_because(&pipelines, *kind, &u).is_none();
            let oldest = idemflow::terminal::duration(std::time::Duration::from_secs_f64(u.oldest_seconds.floor()));
            println!(
                "pipeline {:?} target {:?}{}: {} waiting ({} due, {} in back-off, {} being sent), the oldest for {oldest}; {} delivery_failed dead letter(s)",
                u.pipeline,
                u.target,
                if configured { "" } else { " (not configured: no relay sends it)" },
                u.waiting,
                u.due,
                u.backing_off,
                u.leased,
                u.dead_letters
            );
            if let Some(next) = &u.next_attempt {
                println!("  next attempt at {next}");
            }
            if let Some(error) = &u.last_error {
                println!("  last error: {error}");
            }
        }
    }
    if !any {
        println!("nothing waits in the outbox, and no request is a dead letter");
    }
    Ok(())
}

async fn retry_now(a: RetryNowArgs) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    let p = named(&pipelines, &a.pipeline, &settings)?;
    let store = open_store(&settings, &a.config, p.sink.store()).await?;
    let key = a.key.as_ref().map(|k| idemflow::key::BusinessKey::new(p.key.canonical_text(k)));
    let moved = store.outbox_retry_now(&p.name, a.target.as_deref(), key.as_ref().map(|k| &k.digest[..])).await?;
    println!(
        "pipeline {:?}: {moved} request(s) in back-off due now; a running worker's relay sends them within its poll_interval",
        p.name
    );
    Ok(())
}
