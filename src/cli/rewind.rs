//! `idemflow rewind`: move a stopped pipeline's consumer group back (Kafka, RocketMQ); the dedup store skips every
//! record already applied.

use super::workspace::{load, named, open_store, report};
use idemflow::config;
use idemflow::offsets::OffsetStore;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct RewindArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline.
    #[arg(long)]
    pipeline: String,
    /// `earliest`, or an RFC 3339 timestamp (the first record at or after it), e.g. 2026-11-29T08:00:00Z.
    #[arg(long)]
    to: idemflow::source::rewind::Target,
    /// Print the plan and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// How long to wait for each Kafka request and for the group's assignment.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    timeout: std::time::Duration,
}

/// Runs `rewind`: the plan printed, and unless `--dry-run` the group's offsets (and the stored positions) moved.
///
/// Errors: the source has no positions, the group has members, or a broker or store request failed.
pub async fn run(a: RewindArgs) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    let p = named(&pipelines, &a.pipeline, &settings)?;
    let context = p.source_context();
    if !p.source.positional() {
        // Said before the store is opened: a queue has nothing to rewind, whatever the store.
        return idemflow::source::rewind_group(&settings.brokers(), &context, &p.file, request(&a), None).await;
    }
    // The store always: its processed marks' floors go down with the group (a replay below them would be skipped),
    // and with `[offsets] store = "database"` it holds the positions themselves.
    let store = open_store(&settings, &a.config, p.sink.store()).await?;
    let side = idemflow::source::rewind::StoreSide { store: &store, positions: p.offsets == OffsetStore::Database };
    idemflow::source::rewind_group(&settings.brokers(), &context, &p.file, request(&a), Some(side)).await
}

fn request(a: &RewindArgs) -> idemflow::source::rewind::Request {
    idemflow::source::rewind::Request { to: a.to, dry_run: a.dry_run, timeout: a.timeout }
}
