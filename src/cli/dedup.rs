//! `idemflow dedup forget`: the operator's way out when a batch's keys stayed claimed though their effects never
//! ran (a procedure that ended the batch transaction itself, see [`idemflow::sink::SinkError::TransactionEnded`]):
//! the named dedup rows are deleted and the processed floors of their partitions lowered, so the records come back
//! through the pipeline and are applied. PostgreSQL and MySQL/MariaDB.

use super::{load, named, open_store, report};
use idemflow::config;
use idemflow::store::rows::Forget;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum DedupCommand {
    /// Delete dedup rows of a pipeline (named keys, or the keys applied from a range of one partition's records),
    /// so that their records are applied again when they come; lowers the pipeline's processed floor there. Stop
    /// the pipeline's workers first: refused while one ran a batch in the last minute.
    Forget(ForgetArgs),
}

#[derive(clap::Args)]
pub struct ForgetArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline.
    #[arg(long)]
    pipeline: String,
    /// A business key's canonical text (a composite key as its JSON array, e.g. '["o-1","3"]'); repeat for more.
    #[arg(long, conflicts_with_all = ["topic", "partition", "offsets"], required_unless_present = "offsets")]
    key: Vec<String>,
    /// With `--partition` and `--offsets`: the keys applied from this topic's records.
    #[arg(long, requires_all = ["partition", "offsets"])]
    topic: Option<String>,
    /// The partition (a RocketMQ queue id).
    #[arg(long, requires_all = ["topic", "offsets"])]
    partition: Option<i32>,
    /// The offsets, both included: `FROM-TO` (`50-99`), or one offset.
    #[arg(long, requires_all = ["topic", "partition"], value_parser = parse_offsets)]
    offsets: Option<(i64, i64)>,
    /// Print the rows that would be deleted and change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// `FROM-TO` or one offset, `FROM <= TO`, both at least 0.
fn parse_offsets(text: &str) -> Result<(i64, i64), String> {
    let number = |t: &str| t.trim().parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| format!("{t:?} is not an offset (a whole number, 0 or more)"));
    let (from, to) = match text.split_once('-') {
        Some((from, to)) => (number(from)?, number(to)?),
        None => (number(text)?, number(text)?),
    };
    if from > to {
        return Err(format!("{text:?}: the first offset is after the last"));
    }
    Ok((from, to))
}

/// Runs `dedup`.
///
/// Errors: the settings, the pipeline or the store cannot be read; the store refused (a worker running, Redis).
pub async fn run(command: DedupCommand) -> anyhow::Result<()> {
    let DedupCommand::Forget(a) = command;
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    let p = named(&pipelines, &a.pipeline, &settings)?;
    let store = open_store(&settings, &a.config, p.sink.store()).await?;
    let what = match (&a.topic, a.partition, a.offsets) {
        (Some(topic), Some(partition), Some((from, to))) => Forget::Positions { topic: topic.clone(), partition, from, to },
        _ => Forget::Keys(a.key.iter().map(|k| idemflow::key::BusinessKey::new(p.key.canonical_text(k))).collect()),
    };
    let rows = store.forget(&p.name, &what, a.dry_run).await?;
    let verb = if a.dry_run { "would forget" } else { "forgot" };
    println!("pipeline {:?}: {verb} {} dedup row(s)", p.name, rows.len());
    for r in &rows {
        let position = idemflow::record::Position { topic: r.topic.as_str().into(), partition: r.partition, offset: r.offset };
        println!("  {:?} applied at {} from {position}", r.business_key, r.applied_at);
    }
    if let Forget::Keys(keys) = &what {
        for k in keys.iter().filter(|k| !rows.iter().any(|r| r.business_key == k.text)) {
            println!("  {:?}: not in the dedup store (nothing to forget)", k.text);
        }
    }
    if a.dry_run {
        println!("dry run: nothing changed");
    } else {
        for ((topic, partition), lowest) in idemflow::store::rows::floors_to_lower(&what, &rows) {
            println!("  {topic}/{partition}: records from offset {lowest} on are consumed again and applied where their key is forgotten");
        }
        if !rows.is_empty() {
            println!(
                "their records are applied again when they come back: start the pipeline (its consumer resumes from its \
                 committed position; `idemflow rewind` if that is past them)"
            );
        }
    }
    Ok(())
}
