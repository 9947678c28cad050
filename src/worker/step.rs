//! One batch of a lane: its schemas fetched, its records prepared, its transaction attempted and retried (a
//! back-off, fenced or lost partitions, statements rebuilt), then its metrics, published dead letters and the
//! dead-letter guard's verdict.

use super::Ready;
use crate::dead_letter::DeadLetterSettings;
use crate::http::Health;
use crate::metrics::{BatchCounts, PipelineMetrics};
use crate::prepare::{Ahead, PreparedBatch};
use crate::batch::Records;
use crate::record::Record;
use crate::retry::backoff;
use crate::shutdown::Shutdown;
use crate::sink::{Attempt, Earlier, SinkError};
use crate::source::dead_letter_out::DeadLetterOut;
use crate::source::Source;
use crate::store::disposition::Disposition;
use crate::store::Store;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// The dead letters of the most recent records, for the `[dead_letters] max_ratio` guard. Whole batches are
/// kept while they fit in `window` records (the newest batch always counts).
#[derive(Clone)]
struct DeadLetterWindow {
    settings: DeadLetterSettings,
    batches: VecDeque<(u64, u64)>,
}

impl DeadLetterWindow {
    fn new(settings: DeadLetterSettings) -> Self {
        DeadLetterWindow { settings, batches: VecDeque::new() }
    }

    fn totals(&self, newest: (u64, u64)) -> (u64, u64) {
        let mut total = newest;
        for (records, dead) in self.batches.iter().rev() {
            if total.0 + records > self.settings.window {
                break;
            }
            total = (total.0 + records, total.1 + dead);
        }
        total
    }

    /// Refuses a batch that would take the ratio over the limit.
    fn check(&self, counts: &BatchCounts) -> Result<(), SinkError> {
        let (records, dead_letters) = self.totals((counts.received, counts.dead_letters.iter().sum()));
        if self.over(records, dead_letters) {
            return Err(SinkError::DeadLetterRatio { dead_letters, records, max_ratio: self.settings.max_ratio });
        }
        Ok(())
    }

    fn over(&self, records: u64, dead_letters: u64) -> bool {
        records >= self.settings.min_records
            && records > 0
            && dead_letters as f64 > self.settings.max_ratio * records as f64
            && self.settings.max_ratio < 1.0
    }

    /// Records a written batch. Its dead letters were checked before `COMMIT` except those decided where nothing
    /// can be rolled back (inside a Redis script): when those take the ratio over the limit, the pipeline stops now,
    /// after the batch, rather than go on emptying the stream into the dead letters.
    fn record(&mut self, counts: &BatchCounts) -> Result<(), SinkError> {
        let newest = (counts.received, counts.dead_letters.iter().sum());
        let (records, dead_letters) = self.totals(newest);
        self.batches.push_back(newest);
        while self.batches.iter().map(|b| b.0).sum::<u64>() > self.settings.window && self.batches.len() > 1 {
            self.batches.pop_front();
        }
        if self.over(records, dead_letters) {
            return Err(SinkError::DeadLetterRatioWritten { dead_letters, records, max_ratio: self.settings.max_ratio });
        }
        Ok(())
    }
}

/// What one pipeline needs to process a batch.
pub(super) struct Step<'a> {
    /// The pipeline, rebuilt when its side effect's schema changes.
    ready: Ready,
    metrics: &'a PipelineMetrics,
    health: &'a Health,
    window: DeadLetterWindow,
    dead_letter_out: Option<&'a DeadLetterOut>,
    /// Recorded as the owner of the partitions this lane claims (`[offsets] store = "database"`).
    owner: String,
    /// `[database] batch_timeout` (none for Redis, whose client has its own response timeout).
    batch_timeout: Option<Duration>,
    /// The records received while a batch is in its transaction, prepared for the next one then.
    ahead: Ahead,
    /// Fault injection: the answer of the next batch's first `COMMIT` is lost ([`Faults::lose_commit_answer`]).
    pub(super) lose_commit_answer: bool,
    /// This lane's row in the store's attempts table ([`Attempt::lane`]).
    attempts_lane: std::sync::Arc<str>,
    /// The processed floors the last committed batch ended below ([`crate::sink::BatchOutcome::floors`]), for the
    /// source to move on to once the batch is committed to the broker.
    pub(super) floors: Vec<crate::offsets::PassedFloor>,
}

impl<'a> Step<'a> {
    /// The step of a lane whose attempts are recorded as `owner`'s; `batch_timeout` is `[database] batch_timeout`.
    pub(super) fn new(
        ready: Ready,
        metrics: &'a PipelineMetrics,
        health: &'a Health,
        dead_letter_out: Option<&'a DeadLetterOut>,
        owner: String,
        batch_timeout: Option<Duration>,
    ) -> Self {
        Step {
            window: DeadLetterWindow::new(ready.pipeline.dead_letters.clone()),
            ahead: Ahead::new(ready.pipeline.batch.max_records),
            attempts_lane: Attempt::lane(&owner),
            ready,
            metrics,
            health,
            dead_letter_out,
            owner,
            batch_timeout,
            lose_commit_answer: false,
            floors: Vec::new(),
        }
    }

    /// Takes the pipeline rebuilt after a schema change. What was prepared ahead was prepared through the statements
    /// as they were: dropped with them (the only place `ready` changes).
    fn rebuilt(&mut self, ready: Ready) {
        self.ready = ready;
        self.ahead.clear();
    }

    /// Between batches: resumes the partitions whose stored positions the store lost ([`Store::lost_positions`])
    /// from what it kept, dropping their records from `batch` (not applied yet). A failure to ask is left to the next
    /// check.
    ///
    /// Errors: the store holds no position at all for a partition, or the source could not be moved.
    pub(super) async fn resync_lost(&mut self, source: &mut Source, batch: &mut Vec<Record>) -> Result<(), SinkError> {
        let lost = match self.ready.store.lost_positions(&self.ready.pipeline.name, &source.owned()).await {
            Ok(lost) => lost,
            Err(e) => {
                tracing::debug!(pipeline = %self.ready.pipeline.name, error = %e, "cannot compare the stored positions while idle");
                return Ok(());
            }
        };
        if !lost.is_empty() {
            tracing::warn!(pipeline = %self.ready.pipeline.name, partitions = ?lost, "the store lost positions this worker had stored (and the effects written with them); resuming them from what it kept");
            resync(&self.ready, &self.owner, source, lost, batch).await?;
        }
        Ok(())
    }

    /// Prepares and applies one batch, retrying retryable failures with exponential backoff and jitter while
    /// consumption is paused. Returns the batch as committed (records of revoked partitions dropped on the way),
    /// or `None` when shutdown came while waiting to retry (nothing of the batch is committed to the broker then).
    pub(super) async fn process(
        &mut self,
        source: &mut Source,
        records: Vec<Record>,
        shutdown: &mut Shutdown,
    ) -> Result<Option<PreparedBatch>, SinkError> {
        let mut holding: BTreeMap<(&str, i32), i64> = BTreeMap::new();
        for run in records.chunk_by(|a, b| a.position.same_partition(&b.position)) {
            *holding.entry((run[0].position.topic_name(), run[0].position.partition)).or_default() += run.len() as i64;
        }
        // Before the schemas are fetched: a pipeline paused on the registry holds these records, and its
        // partitions count as stalled while it waits.
        self.metrics.in_flight(holding.iter().map(|((t, p), n)| (*t, *p, *n)));
        drop(holding);
        let Some(records) = self.fetch_schemas(source, records, shutdown).await else { return Ok(None) };
        let mut batch = self.ahead.take(records, &self.ready.preparer);
        self.metrics.prepared_ahead(self.ahead.tally());
        let mut retrying = Retrying::new(self.batch_timeout);
        let outcome = loop {
            if batch.is_empty() {
                // Every record of it went (its partitions revoked during a back-off): this lane waits on its store
                // no more, whatever an earlier attempt said; its next batch tells again.
                self.health.pipeline_store(&self.attempts_lane, &self.ready.pipeline.name, true);
                return Ok(Some(batch));
            }
            let result;
            (batch, result) = self.attempt(source, batch, &mut retrying).await;
            match result {
                Ok(outcome) => break outcome,
                Err(e) => {
                    if !self.recover(source, &mut batch, e, &mut retrying, shutdown).await? {
                        return Ok(None);
                    }
                }
            }
        };
        let finished = self.finish(source, &batch, &outcome, retrying.started, shutdown).await?;
        Ok(finished.then_some(batch))
    }

    /// Fetches the schemas that the payloads of `records` name and that are not known yet (wire-format payloads,
    /// `[schema_registry]`), while the source keeps serving its broker. While the registry does not answer, the
    /// pipeline pauses and retries with the batches' back-off (`idemflow_schema_registry_retries_total`; its
    /// partitions stall): nothing is dead-lettered for an outage, and nothing is written before the schemas are
    /// known. Gives the records back (those of revoked partitions dropped), or `None` when shutdown came.
    async fn fetch_schemas(&mut self, source: &mut Source, mut records: Vec<Record>, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        let mut backoff = retry_backoff();
        let mut failing_since: Option<Instant> = None;
        loop {
            let ids: Vec<u32> = records.iter().flat_map(|r| self.ready.preparer.schemas_to_fetch(r)).collect();
            let Some(schemas) = self.ready.preparer.schemas().cloned().filter(|_| !ids.is_empty()) else { return Some(records) };
            let fetch = tokio::spawn(async move { schemas.fetch_all(ids).await }.in_current_span());
            let error = match source.poll_while(fetch).await {
                // Every id is now known, or known to be missing past its wait (its records are dead letters): asked
                // once, never again for this batch (a wait of 0 would otherwise ask without end).
                Ok(()) => {
                    if let Some(since) = failing_since {
                        tracing::info!(failing_for = ?since.elapsed(), "the schema registry answers again");
                    }
                    return Some(records);
                }
                Err(e) => e.to_string(),
            };
            let since = *failing_since.get_or_insert_with(Instant::now);
            self.metrics.schema_registry_retry();
            let delay = backoff.next().unwrap_or(MAX_RETRY_DELAY);
            tracing::warn!(error, retry_in = ?delay, failing_for = ?since.elapsed(),
                "fetching schemas from the schema registry failed; retrying with consumption paused (nothing is dead-lettered for this)");
            if !source.pause_for(delay, &mut records, shutdown).await {
                return None;
            }
        }
    }

    /// One attempt of `batch`: its transaction in its own task while the source keeps serving its broker and the
    /// records received meanwhile are prepared for the next batch. Gives the batch back, unchanged, with the
    /// attempt's result; a failed attempt is remembered in `retrying` for the next one to ask the store whether it
    /// committed after all.
    async fn attempt(
        &mut self,
        source: &mut Source,
        mut batch: PreparedBatch,
        retrying: &mut Retrying,
    ) -> (PreparedBatch, Result<crate::sink::BatchOutcome, SinkError>) {
        retrying.positions = source.positions(&batch);
        batch.observe_logs(source.logs(&batch));
        let (sink, window, limit, presented) =
            (self.ready.sink.clone(), self.window.clone(), retrying.attempt_limit, retrying.positions.clone());
        let this = Attempt {
            owner: self.attempts_lane.clone(),
            id: Attempt::next_id(),
            earlier: retrying.earlier.clone(),
            committing: Default::default(),
            lose_commit_answer: std::mem::take(&mut self.lose_commit_answer),
            session: Default::default(),
        };
        let (this_id, committing, session) = (this.id, this.committing.clone(), this.session.clone());
        let attempt = tokio::spawn(
            async move {
                let apply = sink.apply(&batch, presented.as_ref(), |counts| window.check(counts), &this);
                // Dropping the attempt on time-out drops its connection: the server rolls back what it did not
                // commit (once it hears of it), and the retry's claims wait for that.
                let result = match limit {
                    Some(limit) => tokio::time::timeout(limit, apply).await.unwrap_or(Err(SinkError::TimedOut(limit))),
                    None => apply.await,
                };
                (batch, result)
            }
            .in_current_span(),
        );
        // Meanwhile the records received for the next batch are prepared (decoded, keyed, their values taken):
        // the worker's share of that batch is done when this transaction ends.
        let (preparer, ahead) = (&self.ready.preparer, &mut self.ahead);
        let (batch, result) = source.poll_while_receiving(attempt, &mut |record| ahead.offer(record, preparer)).await;
        if result.is_err() {
            // The next attempt learns from the store whether this one committed after all.
            let sent = committing.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            retrying.earlier.push(Earlier { id: this_id, committing: sent.map(|o| (o, batch.receipts())) });
            retrying.session = session.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take().map(|s| (this_id, s));
        }
        (batch, result)
    }

    /// After a failed attempt: whatever its error asks before the next one (a back-off, giving up fenced
    /// partitions, claiming lost ones again, rebuilding the statements), keeping `batch` to what this worker still
    /// owns, each record with its own prepared form. `Ok(false)` when shutdown came while waiting.
    ///
    /// Errors: the error itself when no attempt can succeed (a record's failure that cannot be isolated, a fatal
    /// one), or a schema the pipeline can no longer run on.
    async fn recover(
        &mut self,
        source: &mut Source,
        batch: &mut PreparedBatch,
        e: SinkError,
        retrying: &mut Retrying,
        shutdown: &mut Shutdown,
    ) -> Result<bool, SinkError> {
        match e.disposition() {
            Disposition::Retry(cause) => {
                if let SinkError::TimedOut(limit) = e {
                    // Doubled after each attempt that ran out of it: a batch that is merely slow (its record-by-record
                    // redo over a slow link) gets the time it needs; a connection whose packets vanish costs one
                    // limit per attempt.
                    retrying.attempt_limit = Some(limit.saturating_mul(2));
                    // Never one that sent its COMMIT: ended while its commit waits (for a synchronous standby, say),
                    // it would commit locally without the standby's confirmation, and the retry would take it for
                    // committed. The server's own timeouts end those.
                    if let Some((id, abandoned)) = retrying.session.take() {
                        let sent_commit = retrying.earlier.iter().any(|a| a.id == id && a.committing.is_some());
                        if !sent_commit {
                            end_session(&self.ready.store, abandoned);
                        }
                    }
                }
                self.health.pipeline_store(&self.attempts_lane, &self.ready.pipeline.name, false);
                self.metrics.retry(cause);
                let delay = retrying.next_delay();
                retrying.attempts += 1;
                tracing::warn!(error = %e, retry_in = ?delay, attempt = retrying.attempts, failing_for = ?retrying.started.elapsed(),
                    "batch rolled back; retrying with consumption paused (nothing is dead-lettered for this)");
                source.drop_revoked(batch);
                Ok(source.pause_for(delay, batch, shutdown).await)
            }
            Disposition::Fenced => {
                if let SinkError::Fenced { partitions } = &e {
                    source.lose(partitions, retrying.positions.as_ref(), batch).await;
                }
                Ok(true)
            }
            Disposition::Resync => {
                let SinkError::Lost { partitions } = &e else { return Err(e) };
                tracing::warn!(error = %e, "claiming the partitions again");
                if !resync(&self.ready, &self.owner, source, partitions.clone(), batch).await? {
                    let delay = retrying.next_delay();
                    return Ok(source.pause_for(delay, batch, shutdown).await);
                }
                Ok(true)
            }
            Disposition::Rebuild => {
                // Rebuild the statements from the schema as it is now and prepare the records again: no value is
                // ever bound through a stale type. A database error while rebuilding is retried like any other; a
                // schema the pipeline can no longer run on stops it.
                let (store, pipeline) = (self.ready.store.clone(), self.ready.pipeline.clone());
                let rebuild = tokio::spawn(async move { Ready::prepare(&store, &pipeline).await }.in_current_span());
                match source.poll_while(rebuild).await {
                    Ok(rebuilt) => {
                        tracing::warn!("the side effect's tables or statements changed: statements rebuilt");
                        self.rebuilt(rebuilt);
                        source.drop_revoked(batch);
                        // Prepared through the old statements: made again, every record.
                        let preparer = &self.ready.preparer;
                        batch.prepare_again(|r| preparer.prepare(r));
                        Ok(true)
                    }
                    Err(problem) if problem.unavailable => {
                        let delay = retrying.next_delay();
                        tracing::warn!(error = %problem, retry_in = ?delay, "rebuilding the side effect failed; retrying");
                        Ok(source.pause_for(delay, batch, shutdown).await)
                    }
                    Err(problem) => Err(SinkError::Schema(problem.to_string())),
                }
            }
            Disposition::Record | Disposition::Fatal => Err(e),
        }
    }

    /// After the batch's COMMIT: its metrics, the dead letters published where the pipeline also sends them (before
    /// the broker's commit or ack, retried until they are), and the dead-letter guard's verdict. `Ok(false)` if
    /// shutdown came while publishing.
    async fn finish(
        &mut self,
        source: &mut Source,
        batch: &PreparedBatch,
        outcome: &crate::sink::BatchOutcome,
        started: Instant,
        shutdown: &mut Shutdown,
    ) -> Result<bool, SinkError> {
        let batch = batch.records();
        self.health.pipeline_store(&self.attempts_lane, &self.ready.pipeline.name, true);
        let mut moved: Vec<(&str, i32)> = batch
            .chunk_by(|a, b| a.position.same_partition(&b.position))
            .map(|run| (run[0].position.topic_name(), run[0].position.partition))
            .collect();
        moved.sort_unstable();
        moved.dedup();
        self.metrics.progressed(moved);
        let guarded = self.window.record(&outcome.counts);
        self.metrics.batch_committed(&outcome.counts, started.elapsed());
        if let Some(rt) = outcome.script_round_trip {
            self.metrics.script_round_trip(rt);
        }
        self.metrics.end_to_end(batch.iter().filter_map(|r| r.timestamp_ms));
        let c = &outcome.counts;
        tracing::debug!(
            applied = c.applied, duplicates = c.duplicates.iter().sum::<u64>(),
            dead_letters = c.dead_letters.iter().sum::<u64>(), "batch committed"
        );
        if let (Some(out), false) = (self.dead_letter_out, outcome.dead_letters.is_empty()) {
            let mut backoff = retry_backoff();
            while let Err(e) = out.publish(batch, &outcome.dead_letters).await {
                let delay = backoff.next().unwrap_or(MAX_RETRY_DELAY);
                tracing::warn!(error = %e, retry_in = ?delay, "publishing dead letters failed; the batch's offset commit or ack waits");
                let mut keep = batch.to_vec();
                if !source.pause_for(delay, &mut keep, shutdown).await {
                    return Ok(false);
                }
            }
        }
        guarded?;
        // Not past dead letters to publish again: with a dead-letter topic, the records below a floor are fetched,
        // so that a crash before a batch's dead letters were confirmed loses none (their batch may come back shorter
        // than it was, and end below the floor).
        if self.dead_letter_out.is_none() {
            self.floors = outcome.floors.clone();
        }
        Ok(true)
    }
}

/// How long ending an abandoned attempt's session may take ([`end_session`]).
pub const END_SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// Ends, in the background, the server session of a batch attempt abandoned on `batch_timeout`
/// ([`Store::end_session`]): dropping the attempt leaves its connection in the statement it was stuck in (the pool
/// tests a returned connection with a ping, which waits behind that statement), holding its claims' row locks,
/// which the retry's claims would wait on, and a pool connection. Bounded by [`END_SESSION_TIMEOUT`]; a failure is
/// logged (the server ends the session by itself once its statement ends or the session's timeouts pass).
fn end_session(store: &Store, session: crate::store::Session) {
    let store = store.clone();
    tokio::spawn(
        async move {
            match tokio::time::timeout(END_SESSION_TIMEOUT, store.end_session(session)).await {
                Ok(Ok(ended)) => tracing::debug!(?session, ended, "the abandoned attempt's session ended"),
                Ok(Err(e)) => tracing::warn!(?session, error = %e, "ending the abandoned attempt's session failed"),
                Err(_) => tracing::warn!(?session, timeout = ?END_SESSION_TIMEOUT, "ending the abandoned attempt's session took too long"),
            }
        }
        .in_current_span(),
    );
}

/// Claims `partitions` again and moves the source back to the positions the store kept (the store lost writes:
/// see [`SinkError::Lost`]), dropping their records from `batch`. Returns `false` when the claim failed (the caller
/// backs off and tries again).
///
/// Errors: the store holds no position at all for a partition ([`SinkError::PositionsGone`]), or the source could
/// not be moved.
async fn resync(
    ready: &Ready,
    owner: &str,
    source: &mut Source,
    partitions: Vec<(String, i32)>,
    batch: &mut dyn Records,
) -> Result<bool, SinkError> {
    // Only partitions this worker still owns: a claim for one revoked meanwhile would fence its new owner.
    let owned = source.owned();
    let partitions: Vec<(String, i32)> = partitions.into_iter().filter(|p| owned.contains(p)).collect();
    if partitions.is_empty() {
        source.drop_revoked(batch);
        return Ok(true);
    }
    let (store, pipeline, owner) = (ready.store.clone(), ready.pipeline.name.clone(), owner.to_owned());
    let claim = tokio::spawn(async move { store.claim_offsets(&pipeline, &owner, &partitions).await }.in_current_span());
    match source.poll_while(claim).await {
        Ok(claimed) => {
            let gone: Vec<(String, i32)> = claimed.iter().filter(|c| c.next_offset.is_none()).map(|c| (c.topic.clone(), c.partition)).collect();
            if !gone.is_empty() {
                return Err(SinkError::PositionsGone { partitions: gone });
            }
            source.resync(&claimed, batch).await.map_err(SinkError::Source)?;
            Ok(true)
        }
        Err(e) => {
            tracing::warn!(error = %e, "claiming the partitions again failed; retrying");
            Ok(false)
        }
    }
}

const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// How often the worker asks its store whether it lost the positions this worker stored ([`Store::lost_positions`]).
pub(super) const LOST_POSITIONS_EVERY: Duration = Duration::from_secs(1);

fn retry_backoff() -> impl Iterator<Item = Duration> {
    backoff(Duration::from_millis(100), MAX_RETRY_DELAY)
}

/// What the attempts of one batch carry from one to the next.
struct Retrying {
    /// When the first attempt started (the batch's duration, and how long it has been failing).
    started: Instant,
    backoff: Box<dyn Iterator<Item = Duration> + Send>,
    /// Failed attempts so far.
    attempts: u32,
    /// `[database] batch_timeout` for the next attempt: doubled after each attempt that ran out of it.
    attempt_limit: Option<Duration>,
    /// The attempts that failed, for the next one to ask the store whether one committed after all.
    earlier: Vec<Earlier>,
    /// The positions the last attempt presented (`[offsets] store = "database"`): a fenced attempt's partitions are
    /// compared with them.
    positions: Option<crate::offsets::Positions>,
    /// The last failed attempt's number and server session, when it learned it (ended if it was abandoned on
    /// time-out before sending its `COMMIT`).
    session: Option<(i64, crate::store::Session)>,
}

impl Retrying {
    fn new(batch_timeout: Option<Duration>) -> Self {
        Retrying {
            started: Instant::now(),
            backoff: Box::new(retry_backoff()),
            attempts: 0,
            attempt_limit: batch_timeout,
            earlier: Vec::new(),
            positions: None,
            session: None,
        }
    }

    /// The next back-off delay.
    fn next_delay(&mut self) -> Duration {
        self.backoff.next().unwrap_or(MAX_RETRY_DELAY)
    }
}
