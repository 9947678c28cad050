//! `idemflow dead-letters`: list, show and replay dead letters, in any store.

use super::workspace::{load, open_store, report};
use anyhow::{bail, Context as _};
use clap::Subcommand;
use idemflow::config::{self, Settings};
use idemflow::store::spec::StoreKind;
use idemflow::store::Store;
use idemflow::terminal::{escape, printable};
use idemflow::worker;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DeadLettersCommand {
    /// The newest dead letters: id, pipeline, position, reason, time, error.
    List {
        /// The settings file.
        #[arg(long, short, default_value = "idemflow.toml")]
        config: PathBuf,
        /// Only this pipeline.
        #[arg(long)]
        pipeline: Option<String>,
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// The dead letters of Redis pipelines (the `<key_prefix>dead-letters` stream), when `[database]` is set too.
        #[arg(long)]
        redis: bool,
    },
    /// One dead letter in full: key, headers, payload (as text when it is UTF-8, else hex), error.
    Show {
        /// The settings file.
        #[arg(long, short, default_value = "idemflow.toml")]
        config: PathBuf,
        /// Its id.
        id: i64,
        /// A dead letter of a Redis pipeline, when `[database]` is set too.
        #[arg(long)]
        redis: bool,
    },
    /// Apply a dead letter through the pipeline's transactional path; its row is removed in the same transaction
    /// (if it fails again, it is dead-lettered again with the new error). An outbox request (`delivery_failed`) is
    /// put back in the outbox instead, for the relay to send again.
    Replay {
        /// The settings file.
        #[arg(long, short, default_value = "idemflow.toml")]
        config: PathBuf,
        /// Its id.
        id: i64,
        /// Replace the stored payload with this file's bytes (a fixed record).
        #[arg(long)]
        payload: Option<PathBuf>,
        /// A dead letter of a Redis pipeline, when `[database]` is set too.
        #[arg(long)]
        redis: bool,
    },
}

/// Where a dead letter came from: `topic/partition@offset`, or `queue NAME` (a queue has no stable position; the
/// stored "offset" of a queue's dead letter only numbers it).
fn stored_position(d: &idemflow::dead_letter::Stored) -> String {
    if d.partition == idemflow::record::NO_PARTITION {
        format!("queue {}", d.topic)
    } else {
        d.record().position.to_string()
    }
}

/// Runs one `dead-letters` subcommand.
///
/// Errors: the settings, the store or the pipeline cannot be read, no dead letter has that id, or a replay failed
/// again.
pub async fn run(cmd: DeadLettersCommand) -> anyhow::Result<()> {
    let (config, redis) = match &cmd {
        DeadLettersCommand::List { config, redis, .. } | DeadLettersCommand::Show { config, redis, .. } | DeadLettersCommand::Replay { config, redis, .. } => {
            (config.clone(), *redis)
        }
    };
    let settings = load(&config)?;
    let kind = if redis || settings.database.is_none() { StoreKind::Redis } else { StoreKind::Database };
    let store = open_store(&settings, &config, kind).await?;
    match cmd {
        DeadLettersCommand::List { pipeline, limit, .. } => list(&store, pipeline.as_deref(), limit).await,
        DeadLettersCommand::Show { id, .. } => show(&store, id).await,
        DeadLettersCommand::Replay { id, payload, .. } => replay(&settings, &store, id, payload).await,
    }
}

/// `dead-letters list`: the newest `limit` dead letters (of `pipeline` if given), one a line.
async fn list(store: &Store, pipeline: Option<&str>, limit: i64) -> anyhow::Result<()> {
    let rows = store.dead_letters(pipeline, limit).await?;
    println!("{:>8}  {:<16} {:<28} {:<22} {:<32} error", "id", "pipeline", "position", "reason", "created_at");
    for d in &rows {
        let error: String = escape(&d.error).chars().take(100).collect();
        let position = stored_position(d);
        println!("{:>8}  {:<16} {:<28} {:<22} {:<32} {error}", d.id, d.pipeline, position, d.reason, d.created_at);
    }
    println!("{} dead letter(s)", rows.len());
    Ok(())
}

/// `dead-letters show`: one dead letter whole, an outbox request's credential headers hidden.
async fn show(store: &Store, id: i64) -> anyhow::Result<()> {
    let Some(d) = store.dead_letter(id).await? else { bail!("no dead letter with id {id}") };
    println!("id          {}", d.id);
    println!("pipeline    {}", d.pipeline);
    println!("position    {}", stored_position(&d));
    println!("reason      {}", d.reason);
    println!("error       {}", escape(&d.error));
    println!("created_at  {}", d.created_at);
    println!("key         {}", d.record_key.as_deref().map_or("(none)".to_owned(), printable));
    for (k, v) in d.property_names.iter().zip(&d.property_values) {
        println!("property    {}: {}", escape(k), escape(v));
    }
    for (k, v) in d.header_names.iter().zip(&d.header_values) {
        // An outbox request's credentials are not shown (a template may have put one there).
        let hidden = d.reason == idemflow::metrics::DeadLetterReason::DeliveryFailed.as_str() && idemflow::outbox::secret::credential_name(k);
        let shown = if hidden { "(hidden)".to_owned() } else { v.as_deref().map_or("(null)".to_owned(), printable) };
        println!("header      {}: {}", escape(k), shown);
    }
    println!("payload     {}", d.payload.as_deref().map_or("(null: a tombstone)".to_owned(), printable));
    if let (Some(size), Some(sha256)) = (d.payload_bytes, &d.payload_sha256) {
        let hex = idemflow::terminal::hex(sha256);
        println!(
            "            (the first {} of {size} bytes; sha256 of the whole payload {hex}; replay it with --payload FILE)",
            d.payload.as_ref().map_or(0, Vec::len)
        );
    }
    Ok(())
}

/// `dead-letters replay`: the record prepared and applied again in its pipeline's transaction (its dead letter
/// removed, or replaced if it fails again), or an outbox request put back in the outbox.
async fn replay(settings: &Settings, store: &Store, id: i64, payload: Option<PathBuf>) -> anyhow::Result<()> {
    let Some(d) = store.dead_letter(id).await? else { bail!("no dead letter with id {id}") };
    if d.reason == idemflow::metrics::DeadLetterReason::DeliveryFailed.as_str() {
        return requeue(settings, store, &d, payload.is_some()).await;
    }
    let pipelines = config::load_pipelines_for(settings).map_err(|e| report(&e))?;
    let Some(p) = pipelines.into_iter().find(|p| p.name == d.pipeline) else {
        bail!("dead letter {id} belongs to pipeline {:?}, which is not configured in {}", d.pipeline, settings.pipelines.display());
    };
    let ready = worker::prepare(store, std::slice::from_ref(&p)).await.map_err(|e| report(&e.problems))?;
    let r = &ready[0];
    let mut record = d.record();
    if let Some(file) = payload {
        record.payload = Some(std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?);
        record.oversized = None;
    } else if let Some(o) = &record.oversized {
        let hex = idemflow::terminal::hex(&o.sha256);
        bail!(
            "dead letter {id} kept only the first {} of its {} payload bytes: replay it with --payload FILE (the \
             whole payload's sha256 was {hex})",
            record.payload.as_ref().map_or(0, Vec::len),
            o.size
        );
    }
    // A wire-format payload's schema, from the registry, as the worker fetches it before preparing.
    let ids: Vec<u32> = r.preparer.schemas_to_fetch(&record).collect();
    if let (Some(schemas), false) = (r.preparer.schemas(), ids.is_empty()) {
        if let Err(e) = schemas.fetch_all(ids.clone()).await {
            bail!("dead letter {id}: cannot fetch its schemas (ids {ids:?}): {e}; the dead letter is kept");
        }
    }
    let prepared = r.preparer.prepare(&record);
    let batch = idemflow::batch::Batch::single(record, prepared);
    let outcome = r.sink.apply_replaying(&batch, |_| Ok(()), &[id]).await?;
    let c = &outcome.counts;
    if c.applied == 1 {
        println!("dead letter {id}: applied; its row is removed");
    } else if c.duplicates.iter().sum::<u64>() == 1 {
        println!("dead letter {id}: its business key was applied already (a duplicate); its row is removed");
    } else if let Some(again) = outcome.dead_letters.first() {
        // The row was replaced in the replay's transaction: the new one is the newest of this pipeline with
        // this record's topic and payload (a queue's dead letter gets a new number as its position too).
        let newer = store.dead_letters(Some(&d.pipeline), 100).await?;
        let new_id = newer.iter().find(|n| n.id > id && n.topic == d.topic && n.payload == batch.records()[0].payload).map(|n| n.id);
        let kept = match new_id {
            Some(n) => format!("kept as dead letter {n} (it replaces {id}: `idemflow dead-letters replay {n}` once the cause is fixed)"),
            None => "kept as a new dead letter (`idemflow dead-letters list` shows its id)".to_owned(),
        };
        println!("dead letter {id}: failed again ({}: {}); {kept}", again.reason.as_str(), escape(&again.error));
        store.close().await;
        bail!("replay failed");
    } else {
        println!("dead letter {id}: skipped (a tombstone); its row is removed");
    }
    store.close().await;
    Ok(())
}

/// `dead-letters replay` of an outbox request (`delivery_failed`): back in the outbox of its pipeline as configured
/// now, re-homed to where its target sends now, sent again with the same idempotency key.
async fn requeue(settings: &Settings, store: &Store, d: &idemflow::dead_letter::Stored, with_payload: bool) -> anyhow::Result<()> {
    let id = d.id;
    // An outbox request: back in the outbox, sent again by the pipeline's relay with the same idempotency
    // key (the target recognises it if an earlier attempt did reach it).
    if with_payload {
        bail!("dead letter {id} is an outbox request (delivery_failed): it is sent again as it was, without --payload");
    }
    // Sent by the relay of the pipeline as configured now: a pipeline without it would never send it. Each
    // target's request goes where the target sends now (re-homed: an older configuration's origin is replaced).
    let pipelines = config::load_pipelines_for(settings).map_err(|e| report(&e))?;
    let Some(outbox) = pipelines.iter().find(|p| p.name == d.pipeline).and_then(|p| p.outbox.as_ref()) else {
        bail!(
            "dead letter {id} is a request of pipeline {:?}, which is not configured with an outbox in {}: no relay would send it (configure the pipeline, then replay)",
            d.pipeline,
            settings.pipelines.display()
        );
    };
    // An origin replaces a URL's scheme and authority; `=` and a text replaces it whole (a secret URL's marker, a
    // fixed Kafka topic).
    let http = outbox.http.iter().filter_map(|t| {
        let whole = t.url.literal().filter(|_| t.secret_url.is_some()).map(|marker| format!("={marker}"));
        whole.or_else(|| t.origin.as_ref().map(|o| o.0.clone())).map(|home| (t.name.clone(), home))
    });
    let kafka = outbox.kafka.iter().filter_map(|t| t.topic.literal().map(|topic| (t.name.clone(), format!("={topic}"))));
    let rehome = serde_json::Value::Object(http.chain(kafka).map(|(name, home)| (name, serde_json::Value::String(home))).collect());
    let Some(row) = store.outbox_requeue(id, &rehome.to_string()).await? else {
        bail!("dead letter {id} keeps no request to send again (written before migration 13, or replayed meanwhile)");
    };
    println!(
        "dead letter {id}: its request is back in the outbox (row {row}), addressed where its target sends now; the relay of a running \
         worker of pipeline {:?} sends it with the same idempotency key, and the row is gone once its target confirms it",
        d.pipeline
    );
    store.close().await;
    Ok(())
}
