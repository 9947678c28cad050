//! `idemflow dedup forget`: the operator's way out when a batch's keys stayed claimed though their effects never
//! ran (a procedure that ended the batch transaction itself, see [`idemflow::sink::SinkError::TransactionEnded`]):
//! the named dedup rows are deleted and the processed floors of their partitions lowered, so the records come back
//! through the pipeline and are applied. PostgreSQL and MySQL/MariaDB.

use super::workspace::{load, named, open_store, report};
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
    #[arg(long, conflicts_with_all = ["topic", "partition", "offsets"])]
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
        _ if a.key.is_empty() => anyhow::bail!(
            "name what to forget: business keys with --key K (repeated for more), or the keys applied from a range of one \
             partition's records with --topic T --partition N --offsets FROM-TO"
        ),
        _ => Forget::Keys(a.key.iter().map(|k| idemflow::key::BusinessKey::new(p.key.canonical_text(k))).collect()),
    };
    if let Forget::Positions { topic, .. } = &what {
        // A RocketMQ queue's topic is `<topic>/<broker>` in its positions.
        if !p.source.streams().iter().any(|s| topic == s || topic.strip_prefix(s.as_str()).is_some_and(|rest| rest.starts_with('/'))) {
            println!("warning: pipeline {:?} does not consume {topic:?} (it consumes {:?})", p.name, p.source.streams());
        }
    }
    let done = store.forget(&p.name, &what, a.dry_run).await?;
    let verb = if a.dry_run { "would forget" } else { "forgot" };
    println!("pipeline {:?}: {verb} {} dedup row(s)", p.name, done.rows.len());
    for r in &done.rows {
        let position = idemflow::record::Position { topic: r.topic.as_str().into(), partition: r.partition, offset: r.offset };
        println!("  {:?} applied at {} from {position}", r.business_key, r.applied_at);
    }
    if let Forget::Keys(keys) = &what {
        for k in keys.iter().filter(|k| !done.rows.iter().any(|r| r.business_key == k.text)) {
            println!("  {:?}: not in the dedup store (nothing to forget)", k.text);
        }
    }
    let lowers = if a.dry_run { "would be lowered" } else { "lowered" };
    for (topic, partition, from, to) in &done.floors {
        println!(
            "  {topic}/{partition}: processed floor {lowers} from {from} to {to}: its records from offset {to} on are \
             consumed again without being skipped, and applied where their key has no dedup row"
        );
    }
    if a.dry_run {
        if !done.running.is_empty() {
            let lanes: Vec<String> = done.running.iter().map(|(lane, at)| format!("{lane} at {at}")).collect();
            println!("a real run would be refused: a worker of the pipeline ran a batch within the last minute ({})", lanes.join(", "));
        }
        println!("dry run: nothing changed");
    } else if !done.rows.is_empty() {
        println!(
            "their records are applied again when they come back: start the pipeline (its consumer resumes from its \
             committed position; `idemflow rewind` if that is past them)"
        );
    }
    Ok(())
}
