//! Runs every pipeline: source -> prepare (decode, key, values) -> sink transaction -> offset commit, batch after
//! batch, until shutdown.

use crate::config::{Pipeline, PipelineError, Settings};
use crate::http::Health;
use crate::metrics::{Metrics, PipelineMetrics};
use crate::prepare::Preparer;
use crate::shutdown::Shutdown;
use crate::sink::{Attempt, Sink, SinkError};
use crate::sweeper::Sweeper;
use crate::store::Store;
use std::time::Duration;
use tracing::Instrument;

mod lane;
mod step;

use lane::run_lane;
pub use step::END_SESSION_TIMEOUT;

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
/// types) and builds what runs it, and refuses a pipeline that would start a new history on topics another
/// pipeline has processed ([`history_problem`]). Returns all problems at once, of every pipeline, one per line.
pub async fn prepare(store: &Store, pipelines: &[Pipeline]) -> Result<Vec<Ready>, Unprepared> {
    let mut ready = Vec::new();
    let mut errors = Unprepared { problems: Vec::new(), unavailable: false };
    let configured: Vec<&str> = pipelines.iter().map(|p| p.name.as_str()).collect();
    for p in pipelines.iter().filter(|p| !p.dedup.new_history) {
        match store.histories(p.source.streams()).await {
            Ok(histories) => errors.problems.extend(history_problem(p, &histories, &configured)),
            Err(e) => {
                errors.unavailable = true;
                let message = format!("cannot read which pipelines processed its topics: {e}");
                errors.problems.push(PipelineError { file: p.file.display().to_string(), pipeline: p.name.clone(), field: "database".into(), message });
            }
        }
    }
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

/// A pipeline's identity is its name: its dedup rows, processed marks, default consumer group and idempotency keys
/// are all under it. A pipeline with no history of its own (no processed mark) on topics another pipeline of the
/// store has processed, one not configured beside it, is most likely that pipeline renamed (its file renamed, its
/// `name` changed): started, it would read the topics from their start under a new group and apply every record
/// again (charge every refund again). It is refused, naming the other pipeline, its marks, and the remedies: the old
/// `name` in the file, or `[dedup] new_history = true` to start a new history on purpose.
fn history_problem(p: &Pipeline, histories: &[crate::store::rows::History], configured: &[&str]) -> Option<PipelineError> {
    if histories.iter().any(|h| h.pipeline == p.name) {
        return None;
    }
    let others: Vec<&crate::store::rows::History> = histories.iter().filter(|h| !configured.contains(&h.pipeline.as_str())).collect();
    let first = others.first()?;
    let said: Vec<String> = others
        .iter()
        .map(|h| format!("pipeline {:?} processed {} record(s) of {:?} on {} partition(s), last at {}", h.pipeline, h.processed, h.topic, h.partitions, h.last))
        .collect();
    let message = format!(
        "has no history of its own, and {}: renamed from {:?}? Started, it would apply every record still in the topics again \
         (its dedup rows, marks and idempotency keys are under its name). Keep the history: set name = {:?} in this file. \
         Start a new one on purpose: set [dedup] new_history = true (docs/operations.md, \"Renaming a pipeline\")",
        said.join("; "),
        first.pipeline,
        first.pipeline
    );
    Some(PipelineError { file: p.file.display().to_string(), pipeline: p.name.clone(), field: "name".into(), message })
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
    /// The pipeline's code panicked (a dependency's bug on input a peer system accepted): the pipeline stops with
    /// the panic's message, the process's other pipelines go on.
    #[error("pipeline {pipeline:?} stopped: a panic (a bug; please report it with this message): {message}")]
    Panicked {
        /// Pipeline name.
        pipeline: String,
        /// The panic's message.
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
    /// Panic in the pipeline that receives a record whose payload holds these bytes ([`PANIC_ON_PAYLOAD_VAR`]), as
    /// a dependency's bug on such input would: that pipeline stops with the panic's message, the others go on.
    pub panic_on_payload: Option<&'static str>,
}

/// The variable that makes a pipeline panic on a record whose payload holds its text ([`Faults::panic_on_payload`]):
/// `IDEMFLOW_FAULT_PANIC_ON_PAYLOAD=TEXT`. For tests; a worker started with it says so loudly.
pub const PANIC_ON_PAYLOAD_VAR: &str = "IDEMFLOW_FAULT_PANIC_ON_PAYLOAD";

/// The variable that injects [`Faults`] into `idemflow run`: `IDEMFLOW_FAULT_CRASH_AFTER_COMMITS=N` aborts the
/// process right after the Nth batch's `COMMIT`, before its offset commit or acknowledgement. For tests (the
/// guarantee matrix kills the binary at exactly that point); a worker started with it says so loudly.
pub const CRASH_AFTER_COMMITS_VAR: &str = "IDEMFLOW_FAULT_CRASH_AFTER_COMMITS";

/// The variable that makes the answer of the Nth batch's `COMMIT` lost in `idemflow run` ([`Faults::lose_commit_answer`]):
/// `IDEMFLOW_FAULT_LOSE_COMMIT_ANSWER=N`. For tests; a worker started with it says so loudly.
pub const LOSE_COMMIT_ANSWER_VAR: &str = "IDEMFLOW_FAULT_LOSE_COMMIT_ANSWER";

impl Faults {
    /// The faults `idemflow run` is asked for through [`CRASH_AFTER_COMMITS_VAR`], [`LOSE_COMMIT_ANSWER_VAR`],
    /// [`crate::outbox::relay::CRASH_AFTER_DELIVERIES_VAR`] and [`PANIC_ON_PAYLOAD_VAR`]; none when they are unset.
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
            // Read once per process: leaked, so that the faults stay a plain copyable value.
            panic_on_payload: std::env::var(PANIC_ON_PAYLOAD_VAR).ok().filter(|t| !t.is_empty()).map(|t| &*Box::leak(t.into_boxed_str())),
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
            let outbox = match new_relay(&r, &settings, &pm_root, &health, faults) {
                Err(message) => return Err(PipelineFailure::Source { pipeline: name.clone(), message }),
                Ok(relay) => relay,
            };
            let (relay_stop, relay_shutdown) = crate::shutdown::channel();
            let mut relay_task = outbox.as_ref().map(|(_, relay)| {
                let relay = relay.clone();
                tokio::spawn(async move { relay.run(relay_shutdown).await }.in_current_span())
            });
            let signals = outbox.as_ref().map(|(s, _)| s.clone());
            // A panic anywhere in the pipeline (a dependency's, on input a peer system accepted) stops this pipeline
            // with its message, never the process's other pipelines.
            let running = std::panic::AssertUnwindSafe(run_pipeline(&settings, r, pm.clone(), health.clone(), shutdown.clone(), faults, signals));
            let result = tokio::select! {
                result = futures_util::FutureExt::catch_unwind(running) => result.unwrap_or_else(|payload| {
                    Err(PipelineFailure::Panicked { pipeline: name.clone(), message: panic_message(payload.as_ref()) })
                }),
                // The relay supervised: a panic of it stops the pipeline with its message, never a frozen outbox.
                message = relay_panicked(&mut relay_task) => {
                    Err(PipelineFailure::Panicked { pipeline: name.clone(), message: format!("its outbox relay panicked: {message}") })
                }
                never = Sweeper::run_if_any(sweeper.as_ref(), pm.clone(), shutdown) => match never {},
                never = stall_watch(pm.clone()) => match never {},
            };
            if let (Some(sweeper), true) = (&sweeper, stopping.is_triggered()) {
                sweeper.release().await;
            }
            if let Some((_, relay)) = &outbox {
                relay_stop.trigger();
                if let Some(task) = relay_task {
                    let abort = task.abort_handle();
                    if tokio::time::timeout(relay.round_bound(), task).await.is_err() {
                        abort.abort();
                    }
                }
                relay.release().await;
            }
            if let Err(e) = &result {
                pm.set_fatal();
                health.pipeline_fatal(&name, &e.to_string());
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
            // The task's own code outside the pipeline (its relay's start) panicked: the pipeline is not named.
            Err(e) if e.is_panic() => failures.push(PipelineFailure::Panicked {
                pipeline: "(unknown)".to_owned(),
                message: panic_message(e.into_panic().as_ref()),
            }),
            Err(_) => {}
        }
    }
    failures
}

/// The relay of `r`'s outbox, if it has one, with the signals it shares with the pipeline's lanes.
///
/// Errors: a target's client or producer cannot be built, or a secret cannot be used ([`crate::outbox::relay::Relay::new`]).
fn new_relay(
    r: &Ready,
    settings: &Settings,
    metrics: &Metrics,
    health: &Health,
    faults: Faults,
) -> Result<Option<(crate::outbox::relay::Signals, std::sync::Arc<crate::outbox::relay::Relay>)>, String> {
    let Some(spec) = r.pipeline.outbox.clone() else { return Ok(None) };
    let name = &r.pipeline.name;
    let signals = crate::outbox::relay::Signals::default();
    // Each relay its own owner, even two in one process (tests run several workers in one).
    static RELAYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let owner = format!("{}/relay{}", Attempt::lane(&owner()), RELAYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let relay = crate::outbox::relay::Relay::new(
        r.store.clone(), name.clone(), owner, spec, &settings.brokers().kafka, signals.clone(), metrics.outbox(name), health.clone(), faults.crash_after_deliveries,
    )?;
    Ok(Some((signals, std::sync::Arc::new(relay))))
}

/// Waits for the relay's task (none: forever) and returns its panic's message; `task` is `None` once it ended. A
/// relay that returns (only at shutdown, which ends the pipeline first) is waited on no more.
async fn relay_panicked(task: &mut Option<tokio::task::JoinHandle<()>>) -> String {
    if let Some(handle) = task.as_mut() {
        let ended = handle.await;
        *task = None;
        if let Err(e) = ended {
            if e.is_panic() {
                return panic_message(e.into_panic().as_ref());
            }
        }
    }
    std::future::pending().await
}

/// A panic's message: its `&str` or `String` payload, or a word that it had none.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    crate::panics::message(payload).unwrap_or_else(|| "a panic without a message".to_owned())
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

/// Who claims partitions, as recorded in `idemflow.offsets.owner`: `$HOSTNAME/pid` (the container name under
/// Docker and Kubernetes), and `/lane` after it for a pipeline with `batch.concurrency` > 1.
fn owner() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown-host".to_owned());
    format!("{host}/{}", std::process::id())
}
