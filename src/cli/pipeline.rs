//! `idemflow pipeline rename OLD NEW`: a pipeline renamed on purpose keeps its history. Every row of it (dedup rows,
//! duplicate counts, processed marks, stored positions, batch attempts, dead letters, outbox requests, the retention
//! sweep's cursor) moves under the new name in one transaction, with the pipeline's workers stopped (PostgreSQL,
//! MySQL/MariaDB). docs/operations.md, "Renaming a pipeline".

use super::workspace::{load, open_store, report};
use anyhow::bail;
use idemflow::config;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum PipelineCommand {
    /// Move a pipeline's whole history (dedup rows, processed marks, stored positions, dead letters, outbox
    /// requests) to a new name in one transaction, so the renamed pipeline goes on where the old one stopped
    /// (PostgreSQL, MySQL/MariaDB). Stop the pipeline's workers first: refused while one ran a batch in the last
    /// minute, and where the new name already has a history.
    Rename(RenameArgs),
}

#[derive(clap::Args)]
pub struct RenameArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline's name now (its history's).
    old: String,
    /// Its new name: the file's stem, or `name` in it.
    new: String,
    /// Count what would move and change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// Runs `pipeline`.
///
/// Errors: the settings, the pipelines or the store cannot be read; neither name is configured; the store refused
/// (a worker running, the new name's history, Redis).
pub async fn run(command: PipelineCommand) -> anyhow::Result<()> {
    let PipelineCommand::Rename(a) = command;
    if a.old == a.new {
        bail!("the old and the new name are the same ({:?})", a.old);
    }
    if !config::pipeline::valid_name(&a.new) {
        bail!("{:?} cannot name a pipeline: 1 to 63 characters of a-z, 0-9, '_' or '-'", a.new);
    }
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    let configured = |name: &str| pipelines.iter().find(|p| p.name == name);
    let Some(p) = configured(&a.new).or_else(|| configured(&a.old)) else {
        bail!(
            "neither {:?} nor {:?} is a pipeline in {}: the store is the configured pipeline's, so configure one of them",
            a.old,
            a.new,
            settings.pipelines.display()
        );
    };
    let store = open_store(&settings, &a.config, p.sink.store()).await?;
    let renamed = store.rename_pipeline(&a.old, &a.new, a.dry_run).await?;
    let total: u64 = renamed.tables.iter().map(|(_, n)| n).sum();
    if total == 0 {
        bail!("pipeline {:?} has no history in this store: nothing to rename (is {:?} its name? see `idemflow check`)", a.old, a.old);
    }
    let verb = if a.dry_run { "would move" } else { "moved" };
    println!("pipeline {:?} -> {:?}: {verb} {total} row(s) in one transaction", a.old, a.new);
    for (table, n) in renamed.tables.iter().filter(|(_, n)| *n > 0) {
        println!("  {table}: {n}");
    }
    if a.dry_run {
        println!("dry run: nothing changed");
        return Ok(());
    }
    for line in next_steps(&a.old, &a.new, configured(&a.old).is_some(), p.outbox.is_some()) {
        println!("{line}");
    }
    Ok(())
}

/// What the operator does after the rows moved.
fn next_steps(old: &str, new: &str, old_configured: bool, outbox: bool) -> Vec<String> {
    let mut lines = Vec::new();
    if old_configured {
        lines.push(format!(
            "next: pipeline {old:?} is still configured: rename its file to {new}.toml (or set name = \"{new}\" in it) before \
             starting its workers; started as it is, it would begin a new history, which `idemflow check` refuses"
        ));
    }
    lines.push(format!(
        "a consumer group or durable consumer named after the pipeline (the default group_id of Kafka and RocketMQ, the \
         default JetStream consumer: idemflow-<name>) changes with it: keep it by setting group_id = \"idemflow-{old}\" \
         (consumer = \"idemflow-{old}\" for JetStream) in the file. A new group starts where auto.offset.reset says: at \
         the topics' start (the default) it moves on to the processed floors without applying anything again; at their \
         end, records produced while the workers were stopped are never read"
    ));
    if outbox {
        lines.push(format!(
            "the outbox's requests keep the idempotency keys they were written with ({old}:<business key>); operations \
             from now on are sent as {new}:<business key>, unless [outbox] key_prefix = \"{old}\" keeps the old prefix"
        ));
    }
    lines
}
