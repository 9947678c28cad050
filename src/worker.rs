//! Runs every pipeline: source -> prepare (decode, key, values) -> sink transaction -> offset commit, batch after
//! batch, until shutdown.

use crate::config::{Pipeline, PipelineError, Settings};
use crate::dead_letter::DeadLetterSettings;
use crate::metrics::BatchCounts;
use crate::http::Health;
use crate::metrics::{Metrics, PipelineMetrics};
use crate::prepare::{Ahead, PreparedBatch, Preparer};
use crate::batch::Records;
use crate::record::Record;
use crate::shutdown::Shutdown;
use crate::sink::{Attempt, Earlier, Sink, SinkError};
use crate::store::disposition::Disposition;
use crate::source::contract::StoredStart;
use crate::source::dead_letter_out::DeadLetterOut;
use crate::source::Source;
use crate::offsets::OffsetStore;
use crate::retry::backoff;
use crate::sweeper::Sweeper;
use crate::store::Store;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// A pipeline checked against the database, ready to run.
#[derive(Clone, Debug)]
pub struct Ready {
    /// The pipeline.
    pub pipeline: Pipeline,
    /// Its record preparation.
    pub preparer: Preparer,
    /// Its sink.
    pub sink: Sink,
    /// The store (for retention and stored positions).
    pub store: Store,
    /// What `check` says about the store's limits for this pipeline ([`crate::store::SideEffect::notes`]).
    pub notes: Vec<String>,
}

/// Why pipelines could not be prepared: every problem found, and whether the store could not be asked for one of
/// them (worth waiting for: [`crate::store::PrepareError::unavailable`]).
#[derive(Debug)]
pub struct Unprepared {
    /// Every problem, each naming its file, pipeline and field.
    pub problems: Vec<PipelineError>,
    /// The store could not be asked (a connection, the pool) for at least one pipeline.
    pub unavailable: bool,
}

impl std::fmt::Display for Unprepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lines: Vec<String> = self.problems.iter().map(ToString::to_string).collect();
        f.write_str(&lines.join("\n"))
    }
}

/// Checks every pipeline's side effect against the database (tables, columns, statements and their parameter
/// types) and builds what runs it. Returns all problems at once, of every pipeline, one per line.
pub async fn prepare(store: &Store, pipelines: &[Pipeline]) -> Result<Vec<Ready>, Unprepared> {
    let mut ready = Vec::new();
    let mut errors = Unprepared { problems: Vec::new(), unavailable: false };
    for p in pipelines {
        match Ready::prepare(store, p).await {
            Ok(r) => ready.push(r),
            Err(e) => {
                errors.unavailable |= e.unavailable;
                errors.problems.extend(e.problems.into_iter().flat_map(PipelineError::split));
            }
        }
    }
    if errors.problems.is_empty() {
        Ok(ready)
    } else {
        Err(errors)
    }
}

impl Ready {
    /// Checks one pipeline's side effect against the database and builds what runs it.
    ///
    /// Errors: the problem, naming the pipeline's file and field (`database` when it cannot connect, and then
    /// [`Unprepared::unavailable`]).
    pub async fn prepare(store: &Store, p: &Pipeline) -> Result<Ready, Unprepared> {
        let (side_effect, bindings) = store.prepare_side_effect(&p.sink, &p.time).await.map_err(|e| Unprepared {
            problems: vec![PipelineError { file: p.file.display().to_string(), pipeline: p.name.clone(), field: e.field, message: e.message }],
            unavailable: e.unavailable,
        })?;
        if p.outbox.is_some() {
            store.outbox_ready().await.map_err(|e| Unprepared {
                unavailable: e.is_unavailable(),
                problems: vec![PipelineError { file: p.file.display().to_string(), pipeline: p.name.clone(), field: "sink".into(), message: e.to_string() }],
            })?;
        }
        Ok(Ready {
            pipeline: p.clone(),
            preparer: Preparer::new(p, bindings).with_max_record_bytes(side_effect.max_record_bytes()),
            notes: side_effect.notes(),
            sink: Sink::new(p.name.clone(), side_effect, p.dedup.retention),
            store: store.clone(),
        })
    }
}

/// Why a pipeline stopped before shutdown.
#[derive(Debug, thiserror::Error)]
pub enum PipelineFailure {
    /// The source could not be created (a bad librdkafka property, a missing broker section).
    #[error("pipeline {pipeline:?}: {message}")]
    Source {
        /// Pipeline name.
        pipeline: String,
        /// What went wrong.
        message: String,
    },
    /// A fatal database error (for example SQLSTATE class 42: the configured SQL or table is wrong).
    #[error("pipeline {pipeline:?} stopped: {source}")]
    Fatal {
        /// Pipeline name.
        pipeline: String,
        /// The error.
        source: SinkError,
    },
}

/// Fault injection, for the demo and for tests: what a crash would do, at a chosen moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// End each pipeline abruptly right after its Nth batch committed in the database and before that batch's offsets
    /// are committed to Kafka, as a crash at that point would: the consumer is closed without committing them, so
    /// the batch is redelivered to whoever owns its partitions next.
    pub crash_after_commits: Option<u64>,
    /// With `crash_after_commits`: end the whole process there with `abort()` (nothing closed, flushed, committed
    /// or acknowledged), as a SIGKILL at that moment would, instead of ending the pipeline alone.
    pub abort: bool,
    /// The answer of the Nth batch's `COMMIT` is lost: the commit goes through in the store, and the attempt fails
    /// as if the connection had broken before the answer came (SQL stores). The batch is retried; the next attempt
    /// must find out from the store that it committed.
    pub lose_commit_answer: Option<u64>,
    /// End the whole process with `abort()` right after the Nth outbox request its target confirmed, before the
    /// outbox records it ([`crate::outbox::relay::CRASH_AFTER_DELIVERIES_VAR`]).
    pub crash_after_deliveries: Option<u64>,
}

/// The variable that injects [`Faults`] into `idemflow run`: `IDEMFLOW_FAULT_CRASH_AFTER_COMMITS=N` aborts the
/// process right after the Nth batch's `COMMIT`, before its offset commit or acknowledgement. For tests (the
/// guarantee matrix kills the binary at exactly that point); a worker started with it says so loudly.
pub const CRASH_AFTER_COMMITS_VAR: &str = "IDEMFLOW_FAULT_CRASH_AFTER_COMMITS";

/// The variable that makes the answer of the Nth batch's `COMMIT` lost in `idemflow run` ([`Faults::lose_commit_answer`]):
/// `IDEMFLOW_FAULT_LOSE_COMMIT_ANSWER=N`. For tests; a worker started with it says so loudly.
pub const LOSE_COMMIT_ANSWER_VAR: &str = "IDEMFLOW_FAULT_LOSE_COMMIT_ANSWER";

impl Faults {
    /// The faults `idemflow run` is asked for through [`CRASH_AFTER_COMMITS_VAR`], [`LOSE_COMMIT_ANSWER_VAR`] and
    /// [`crate::outbox::relay::CRASH_AFTER_DELIVERIES_VAR`]; none when they are unset.
    ///
    /// Errors: a variable is set but is not a positive whole number.
    pub fn from_env() -> Result<Faults, String> {
        let batch = |var: &str| -> Result<Option<u64>, String> {
            let Ok(text) = std::env::var(var) else { return Ok(None) };
            match text.trim().parse::<u64>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(format!("{var} = {text:?}: expected a number of batches, 1 or more")),
            }
        };
        let crash_after_commits = batch(CRASH_AFTER_COMMITS_VAR)?;
        Ok(Faults {
            crash_after_commits,
            abort: crash_after_commits.is_some(),
            lose_commit_answer: batch(LOSE_COMMIT_ANSWER_VAR)?,
            crash_after_deliveries: batch(crate::outbox::relay::CRASH_AFTER_DELIVERIES_VAR)?,
        })
    }
}

/// Runs all pipelines until `shutdown`, each in its own task. A pipeline that fails fatally stops alone (its
/// `idemflow_pipeline_up` goes to 0 and `/readyz` fails); the others go on. Returns the failures, if any.
pub async fn run(
    settings: &Settings,
    ready: Vec<Ready>,
    metrics: &Metrics,
    health: &Health,
    shutdown: Shutdown,
) -> Vec<PipelineFailure> {
    run_with_faults(settings, ready, metrics, health, shutdown, Faults::default()).await
}

/// [`run`], with injected faults.
pub async fn run_with_faults(
    settings: &Settings,
    ready: Vec<Ready>,
    metrics: &Metrics,
    health: &Health,
    shutdown: Shutdown,
    faults: Faults,
) -> Vec<PipelineFailure> {
    if let Some(db) = &settings.database {
        let transactions: usize = ready.iter().map(|r| r.pipeline.batch.concurrency).sum();
        if transactions + 1 > db.max_connections as usize {
            tracing::warn!(
                max_connections = db.max_connections, transactions,
                "database.max_connections is below the pipelines' batch transactions at once (the sum of their \
                 batch.concurrency) plus one for retention: transactions will wait for a connection"
            );
        }
    }
    let mut tasks = tokio::task::JoinSet::new();
    for r in ready {
        let settings = settings.clone();
        let pm = metrics.pipeline(&r.pipeline.name);
        let pm_root = metrics.clone();
        let health = health.clone();
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            let name = r.pipeline.name.clone();
            // Retention runs beside the pipeline and ends with it, and starts no slice once shutdown is asked for;
            // a pass left there is handed over, where it stopped, once the pipeline has stopped.
            let sweeps = !r.pipeline.sink.store().expires_dedup_keys();
            // The sweep's owner carries the process's nonce, as the lanes' attempt rows do: two replicas with the same
            // host name and pid (containers) do not take each other's lease for their own.
            let sweeper = sweeps.then(|| Sweeper::new(r.store.clone(), name.clone(), Attempt::lane(&owner()).to_string(), r.pipeline.dedup));
            let stopping = shutdown.clone();
            // The outbox's relay runs beside the pipeline in a task of its own, and ends its round when the pipeline
            // ends (bounded by its lease), then gives up what it still holds.
            let outbox = match r.pipeline.outbox.clone().map(|spec| {
                let signals = crate::outbox::relay::Signals::default();
                // Each relay its own owner, even two in one process (tests run several workers in one).
                static RELAYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let owner = format!("{}/relay{}", Attempt::lane(&owner()), RELAYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
                let relay = crate::outbox::relay::Relay::new(
                    r.store.clone(), name.clone(), owner, spec, &settings.brokers().kafka, signals.clone(), pm_root.outbox(&name), health.clone(), faults.crash_after_deliveries,
                );
                relay.map(|relay| (signals, std::sync::Arc::new(relay)))
            }) {
                Some(Err(message)) => return Err(PipelineFailure::Source { pipeline: name.clone(), message }),
                Some(Ok(pair)) => Some(pair),
                None => None,
            };
            let (relay_stop, relay_shutdown) = crate::shutdown::channel();
            let relay_task = outbox.as_ref().map(|(_, relay)| {
                let relay = relay.clone();
                tokio::spawn(async move { relay.run(relay_shutdown).await }.in_current_span())
            });
            let signals = outbox.as_ref().map(|(s, _)| s.clone());
            let result = tokio::select! {
                result = run_pipeline(&settings, r, pm.clone(), health.clone(), shutdown.clone(), faults, signals) => result,
                never = Sweeper::run_if_any(sweeper.as_ref(), pm.clone(), shutdown) => match never {},
                never = stall_watch(pm.clone()) => match never {},
            };
            if let (Some(sweeper), true) = (&sweeper, stopping.is_triggered()) {
                sweeper.release().await;
            }
            if let (Some(task), Some((_, relay))) = (relay_task, &outbox) {
                relay_stop.trigger();
                let abort = task.abort_handle();
                if tokio::time::timeout(relay.round_bound(), task).await.is_err() {
                    abort.abort();
                }
                relay.release().await;
            }
            if let Err(e) = &result {
                pm.set_fatal();
                health.pipeline_fatal();
                tracing::error!(pipeline = %name, error = %e, "pipeline stopped; the other pipelines go on");
            }
            result
        });
    }
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failures.push(e),
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    failures
}

/// Looks at the stall signal every few seconds ([`crate::metrics::Metrics::stalls`]), so that a stalled partition
/// is logged even when nothing scrapes `/metrics` or asks `/readyz`. Dropped when its pipeline ends.
async fn stall_watch(metrics: PipelineMetrics) -> std::convert::Infallible {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        metrics.stalls();
    }
}

/// Runs one pipeline: one lane, or with `batch.concurrency = N` N lanes at once, each its own consumer in the
/// pipeline's consumer group and its own batch transactions. Kafka's group assignment gives each partition to one
/// lane, so partitions are disjoint, each keeps its order, and its offsets are committed by its lane after that
/// lane's batch commits; a rebalance among the lanes is one among any consumers of the group. A lane that fails
/// stops the others: the pipeline stops as one.
async fn run_pipeline(
    settings: &Settings,
    r: Ready,
    metrics: PipelineMetrics,
    health: Health,
    shutdown: Shutdown,
    faults: Faults,
    outbox: Option<crate::outbox::relay::Signals>,
) -> Result<(), PipelineFailure> {
    let lanes = r.pipeline.batch.concurrency;
    if lanes <= 1 {
        return run_lane(settings, r, metrics, health, shutdown, faults, None, outbox).await;
    }
    let (stop, lane_shutdown) = crate::shutdown::channel();
    let stop = std::sync::Arc::new(stop);
    let forward = {
        let (stop, mut shutdown) = (stop.clone(), shutdown);
        tokio::spawn(async move {
            shutdown.wait().await;
            stop.trigger();
        })
    };
    /// Stops the other lanes when its lane ends, however it ends (an error, a panic, an injected crash).
    struct StopOthers(std::sync::Arc<crate::shutdown::Trigger>);
    impl Drop for StopOthers {
        fn drop(&mut self) {
            self.0.trigger();
        }
    }
    let mut set = tokio::task::JoinSet::new();
    for lane in 0..lanes {
        let (settings, r, metrics, health) = (lane_settings(settings, lane), r.clone(), metrics.lane(lane), health.clone());
        let (shutdown, stop) = (lane_shutdown.clone(), StopOthers(stop.clone()));
        let span = tracing::info_span!("lane", lane);
        let outbox = outbox.clone();
        set.spawn(
            async move {
                let _stop = stop;
                run_lane(&settings, r, metrics, health, shutdown, faults, Some(lane), outbox).await
            }
            .instrument(span),
        );
    }
    let mut outcome = Ok(());
    let mut panicked = None;
    // Every lane ends (the first to end stops the others) before the pipeline does, a panic included.
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Err(e)) if outcome.is_ok() => outcome = Err(e),
            Ok(_) => {}
            Err(e) if e.is_panic() && panicked.is_none() => panicked = Some(e.into_panic()),
            Err(_) => {}
        }
    }
    forward.abort();
    if let Some(payload) = panicked {
        std::panic::resume_unwind(payload);
    }
    outcome
}

/// The settings of lane `lane`: a static group membership (`group.instance.id` in `[kafka.properties]`) gets the
/// lane's number after it, since Kafka lets one member at a time hold a static id.
fn lane_settings(settings: &Settings, lane: usize) -> Settings {
    let mut settings = settings.clone();
    if let Some(id) = settings.kafka.properties.get_mut("group.instance.id") {
        *id = crate::source::kafka::PropertyValue::Text(format!("{id}-{lane}"));
    }
    settings
}

/// One lane of a pipeline (all of it unless `batch.concurrency` > 1; `lane` is then its number): source ->
/// prepare -> sink transaction -> offset commit, batch after batch, until shutdown.
async fn run_lane(
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
    let attempts_lane = Attempt::lane(&owner);
    let mut step = Step {
        ready: r.clone(),
        metrics: &metrics,
        health: &health,
        window: DeadLetterWindow::new(r.pipeline.dead_letters.clone()),
        dead_letter_out: dead_letter_out.as_ref(),
        owner,
        batch_timeout: settings.database.as_ref().map(|d| d.batch_timeout).filter(|d| !d.is_zero()),
        ahead: Ahead::new(r.pipeline.batch.max_records),
        lose_commit_answer: false,
        attempts_lane,
        floors: Vec::new(),
    };
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
            let mut stopped = false;
            while signals.paused().is_some() {
                if !source.pause_for(OUTBOX_PAUSE_STEP, &mut batch, &mut shutdown).await {
                    stopped = true;
                    break;
                }
            }
            if stopped {
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
struct Step<'a> {
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
    lose_commit_answer: bool,
    /// This lane's row in the store's attempts table ([`Attempt::lane`]).
    attempts_lane: std::sync::Arc<str>,
    /// The processed floors the last committed batch ended below ([`crate::sink::BatchOutcome::floors`]), for the
    /// source to move on to once the batch is committed to the broker.
    floors: Vec<crate::offsets::PassedFloor>,
}

impl Step<'_> {
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
    async fn resync_lost(&mut self, source: &mut Source, batch: &mut Vec<Record>) -> Result<(), SinkError> {
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
    async fn process(
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
        batch: PreparedBatch,
        retrying: &mut Retrying,
    ) -> (PreparedBatch, Result<crate::sink::BatchOutcome, SinkError>) {
        retrying.positions = source.positions(&batch);
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

/// Who claims partitions, as recorded in `idemflow.offsets.owner`: `$HOSTNAME/pid` (the container name under
/// Docker and Kubernetes), and `/lane` after it for a pipeline with `batch.concurrency` > 1.
fn owner() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown-host".to_owned());
    format!("{host}/{}", std::process::id())
}

const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// How often the worker asks its store whether it lost the positions this worker stored ([`Store::lost_positions`]).
const LOST_POSITIONS_EVERY: Duration = Duration::from_secs(1);

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
