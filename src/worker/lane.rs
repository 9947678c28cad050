//! One lane of a pipeline: batch after batch from its source, each through [`Step`] (prepare, the sink
//! transaction), then the broker's commit, with the outbox's back-pressure and the injected crash between the two.

use super::step::{Step, LOST_POSITIONS_EVERY};
use super::{owner, Faults, PipelineFailure, Ready, CRASH_AFTER_COMMITS_VAR, PANIC_ON_PAYLOAD_VAR};
use crate::config::Settings;
use crate::http::Health;
use crate::metrics::PipelineMetrics;
use crate::offsets::OffsetStore;
use crate::shutdown::Shutdown;
use crate::source::contract::StoredStart;
use crate::source::dead_letter_out::DeadLetterOut;
use crate::source::Source;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// One lane of a pipeline (all of it unless `batch.concurrency` > 1; `lane` is then its number): source ->
/// prepare -> sink transaction -> offset commit, batch after batch, until shutdown.
pub(super) async fn run_lane(
    settings: &Settings,
    r: Ready,
    metrics: PipelineMetrics,
    health: Health,
    mut shutdown: Shutdown,
    faults: Faults,
    lane: Option<usize>,
    outbox: Option<crate::outbox::relay::Signals>,
) -> Result<(), PipelineFailure> {
    let name = r.pipeline.name.clone();
    let mut commits = 0u64;
    let source_error = |message| PipelineFailure::Source { pipeline: name.clone(), message };
    let owner = lane.map_or_else(owner, |lane| format!("{}/{lane}", owner()));
    let stored = (r.pipeline.offsets == OffsetStore::Database).then(|| StoredStart {
        store: crate::store::PositionStore::new(r.store.clone()),
        owner: owner.clone(),
        runtime: tokio::runtime::Handle::current(),
        shutdown: shutdown.clone(),
    });
    let (brokers, context) = (settings.brokers(), r.pipeline.source_context());
    let mut source = Source::new(&brokers, &context, metrics.clone(), stored).map_err(source_error)?;
    let dead_letter_out = DeadLetterOut::new(&brokers.kafka, brokers.rabbitmq.as_ref(), &context).map_err(source_error)?;
    tracing::info!(pipeline = %name, source = r.pipeline.source.kind(), streams = ?r.pipeline.source.streams(), "pipeline started");
    let batch_timeout = settings.database.as_ref().map(|d| d.batch_timeout).filter(|d| !d.is_zero());
    let mut step = Step::new(r.clone(), &metrics, &health, dead_letter_out.as_ref(), owner, batch_timeout);
    let mut outcome = Ok(());
    let mut batches = 0u64;
    let mut checked = Instant::now();
    while let Some(mut batch) = source.next_batch(r.pipeline.batch, &mut shutdown).await {
        // Once a second (between batches, or idle), a store that can lose acknowledged writes (Redis, after a crash
        // or a failover) is asked whether it still holds the positions this worker stored: a quiet partition must
        // not wait for its next record to have its lost effects applied again.
        if batch.is_empty() || checked.elapsed() >= LOST_POSITIONS_EVERY {
            checked = Instant::now();
            if let Err(e) = step.resync_lost(&mut source, &mut batch).await {
                outcome = Err(PipelineFailure::Fatal { pipeline: name.clone(), source: e });
                break;
            }
        }
        if batch.is_empty() {
            continue;
        }
        // Back-pressure: while the outbox is over its bounds the batch is held, consumption paused, until the relay
        // catches up (the relay logs the pause and its end, and /readyz says why).
        if let Some(signals) = &outbox {
            if !hold_while_paused(signals, &mut source, &mut batch, &mut shutdown).await {
                break;
            }
            if batch.is_empty() {
                continue;
            }
        }
        let span = tracing::info_span!(
            "batch", pipeline = %name, records = batch.len(),
            first = %batch[0].position, last = %batch[batch.len() - 1].position
        );
        batches += 1;
        if let Some(needle) = faults.panic_on_payload {
            let holds = |p: &[u8]| p.windows(needle.len()).any(|w| w == needle.as_bytes());
            if batch.iter().any(|r| r.payload.as_deref().is_some_and(holds)) {
                panic!("injected panic ({PANIC_ON_PAYLOAD_VAR}): pipeline {name} received a record holding {needle:?}");
            }
        }
        step.lose_commit_answer = faults.lose_commit_answer == Some(batches);
        let done = step.process(&mut source, batch, &mut shutdown).instrument(span).await;
        match done {
            Ok(Some(batch)) => {
                commits += 1;
                if let Some(signals) = &outbox {
                    signals.wake();
                }
                if faults.crash_after_commits == Some(commits) {
                    if faults.abort {
                        eprintln!("injected crash ({CRASH_AFTER_COMMITS_VAR}): pipeline {name} aborts the process after the database commit, before the offset commit");
                        std::process::abort();
                    }
                    tracing::warn!(pipeline = %name, "injected crash: stopping after the database commit, before the offset commit");
                    source.abandon().await; // closes the consumer without committing or acknowledging this batch
                    return Ok(());
                }
                source.commit(&batch).await;
                // A group that started over below what was processed moves on past it (once committed, above).
                source.skip_to_floors(&std::mem::take(&mut step.floors));
            }
            Ok(None) => break, // shutdown while retrying: nothing of this batch is committed; it will be redelivered
            Err(e) => {
                outcome = Err(PipelineFailure::Fatal { pipeline: name.clone(), source: e });
                break;
            }
        }
    }
    if let (Ok(()), Some(why)) = (&outcome, source.fatal()) {
        outcome = Err(PipelineFailure::Source { pipeline: name.clone(), message: why });
    }
    source.close().await;
    outcome
}

/// How long a lane holds its batch, consumption paused, before it looks at the outbox's back-pressure again.
const OUTBOX_PAUSE_STEP: Duration = Duration::from_millis(500);

/// Holds `batch`, consumption paused, while the outbox is over its bounds ([`crate::outbox::relay::Signals::paused`]),
/// dropping the records of partitions revoked meanwhile. `false` when shutdown came while holding.
async fn hold_while_paused(
    signals: &crate::outbox::relay::Signals,
    source: &mut Source,
    batch: &mut Vec<crate::record::Record>,
    shutdown: &mut Shutdown,
) -> bool {
    while signals.paused().is_some() {
        if !source.pause_for(OUTBOX_PAUSE_STEP, batch, shutdown).await {
            return false;
        }
    }
    true
}
