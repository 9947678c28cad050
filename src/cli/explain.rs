//! `idemflow explain`: was this business key applied, when, from which record, and how many duplicates of it
//! were skipped since (any store).

use super::workspace::{load, named, open_store, report};
use idemflow::config;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ExplainArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline.
    #[arg(long)]
    pipeline: String,
    /// The business key's canonical text (a composite key as its JSON array, e.g. '["o-1","3"]'; number parts are
    /// read as a record's would be: '["o-1",3]' is the same key).
    #[arg(long)]
    key: String,
}

/// Runs `explain`.
///
/// Errors: the settings, the pipeline or the store cannot be read.
pub async fn run(a: ExplainArgs) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    let p = named(&pipelines, &a.pipeline, &settings)?;
    let store = open_store(&settings, &a.config, p.sink.store()).await?;
    let canonical = p.key.canonical_text(&a.key);
    let key = idemflow::key::BusinessKey::new(canonical.clone());
    if canonical == a.key {
        println!("pipeline {:?}, business key {:?}", p.name, a.key);
    } else {
        println!("pipeline {:?}, business key {:?} (looked up as {canonical:?}: a composite key's parts are texts)", p.name, a.key);
    }
    let explained = store.explain(&p.name, &key).await?;
    let applied = explained.is_some();
    match explained {
        Some(e) => {
            println!("  applied at         {}", e.applied_at);
            let position = idemflow::record::Position { topic: e.topic.as_str().into(), partition: e.partition, offset: e.offset };
            println!("  from               {position}");
            if e.fingerprint.len() < 64 {
                println!("  payload sha256     {} (its first {} bytes)", e.fingerprint, e.fingerprint.len() / 2);
            } else {
                println!("  payload sha256     {}", e.fingerprint);
            }
            match e.last_duplicate_at {
                Some(at) => println!("  duplicates skipped {} since (the last at {at})", e.duplicates),
                None => println!("  duplicates skipped 0 since"),
            }
        }
        None => println!(
            "  not in the dedup store: never applied, dead-lettered (see `idemflow dead-letters list`), forgotten \
             (`idemflow dedup forget`), or purged after [dedup] retention = {}",
            idemflow::terminal::duration(p.dedup.retention)
        ),
    }
    if let Some(outbox) = &p.outbox {
        let requests = store.key_requests(&p.name, &key.digest).await?;
        for line in request_lines(&requests, outbox.target_names(), applied) {
            println!("{line}");
        }
    }
    Ok(())
}

/// Where each of a key's outbox requests is: waiting (and why), a dead letter (and its id), or confirmed (no row is
/// left of a request of an applied key). `targets`: the pipeline's targets now.
fn request_lines<'t>(requests: &[idemflow::store::rows::KeyRequest], targets: impl Iterator<Item = &'t str>, applied: bool) -> Vec<String> {
    let mut lines = Vec::new();
    let mut named: Vec<&str> = Vec::new();
    for r in requests {
        named.push(&r.target);
        let line = match (r.dead_letter, &r.error) {
            (Some(id), error) => format!(
                "dead letter {id} (delivery_failed: {}); `idemflow dead-letters replay {id}` sends it again with the same idempotency key",
                error.as_deref().unwrap_or("")
            ),
            (None, _) if r.leased => format!("being sent now (attempt {})", r.attempts),
            (None, Some(error)) => format!("waiting: {} attempt(s) failed, the last with {error}; next attempt at {}", r.attempts, r.next_attempt),
            (None, None) => format!("waiting to be sent (due at {})", r.next_attempt),
        };
        lines.push(format!("  request to {:<8} {line}", r.target));
    }
    if applied {
        for t in targets.filter(|t| !named.contains(t)) {
            lines.push(format!("  request to {t:<8} confirmed by its target (no row of it is left), or never written (the key applied before the target was configured)"));
        }
    }
    lines
}
