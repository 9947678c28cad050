//! Runs every pipeline: source -> prepare (decode, key, values) -> sink transaction -> offset commit, batch after
//! batch, until shutdown.

use crate::config::{Pipeline, PipelineError, Settings};
use crate::http::Health;
use crate::metrics::{Metrics, PipelineMetrics};
use crate::offsets::NextOffsets;
use crate::prepare::{Prepared, Preparer};
use crate::record::Record;
use crate::shutdown::Shutdown;
use crate::sink::side_effect::SideEffect;
use crate::sink::{BatchOutcome, Disposition, Sink, SinkError};
use crate::source::Source;
use backon::{BackoffBuilder, ExponentialBuilder};
use sqlx::PgPool;
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
}

/// Checks every pipeline's side effect against the database (tables, columns, statements and their parameter
/// types) and builds what runs it. Returns all problems at once.
pub async fn prepare(pool: &PgPool, pipelines: &[Pipeline]) -> Result<Vec<Ready>, Vec<PipelineError>> {
    let mut ready = Vec::new();
    let mut errors = Vec::new();
    for p in pipelines {
        let error = |field: String, message: String| PipelineError {
            file: p.file.display().to_string(),
            pipeline: p.name.clone(),
            field,
            message,
        };
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            Err(e) => {
                errors.push(error("database".into(), format!("cannot connect: {e}")));
                continue;
            }
        };
        match SideEffect::prepare(&mut conn, &p.sink).await {
            Ok((side_effect, bindings)) => ready.push(Ready {
                pipeline: p.clone(),
                preparer: Preparer::new(p, bindings),
                sink: Sink::new(p.name.clone(), pool.clone(), side_effect),
            }),
            Err(e) => errors.push(error(e.field, e.message)),
        }
    }
    if errors.is_empty() {
        Ok(ready)
    } else {
        Err(errors)
    }
}

/// Why a pipeline stopped before shutdown.
#[derive(Debug, thiserror::Error)]
pub enum PipelineFailure {
    /// The Kafka consumer could not be created.
    #[error("pipeline {pipeline:?}: cannot create the Kafka consumer: {source}")]
    Consumer {
        /// Pipeline name.
        pipeline: String,
        /// The client error.
        source: rdkafka::error::KafkaError,
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

/// Runs all pipelines until `shutdown`, each in its own task. A pipeline that fails fatally stops alone (its
/// `idemflow_pipeline_up` goes to 0 and `/readyz` fails); the others go on. Returns the failures, if any.
pub async fn run(
    settings: &Settings,
    ready: Vec<Ready>,
    metrics: &Metrics,
    health: &Health,
    shutdown: Shutdown,
) -> Vec<PipelineFailure> {
    let mut tasks = tokio::task::JoinSet::new();
    for r in ready {
        let kafka = settings.kafka.clone();
        let pm = metrics.pipeline(&r.pipeline.name);
        let health = health.clone();
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            let name = r.pipeline.name.clone();
            let result = run_pipeline(&kafka, r, pm.clone(), health.clone(), shutdown).await;
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

async fn run_pipeline(
    kafka: &crate::config::KafkaSettings,
    r: Ready,
    metrics: PipelineMetrics,
    health: Health,
    mut shutdown: Shutdown,
) -> Result<(), PipelineFailure> {
    let name = r.pipeline.name.clone();
    let mut source = Source::new(kafka, &r.pipeline, metrics.clone())
        .map_err(|source| PipelineFailure::Consumer { pipeline: name.clone(), source })?;
    tracing::info!(pipeline = %name, topics = ?r.pipeline.topics, group_id = %r.pipeline.group_id, "pipeline started");
    let mut outcome = Ok(());
    while let Some(batch) = source.next_batch(r.pipeline.batch, &mut shutdown).await {
        if batch.is_empty() {
            continue;
        }
        let span = tracing::info_span!(
            "batch", pipeline = %name, records = batch.len(),
            first = %batch[0].position, last = %batch[batch.len() - 1].position
        );
        let done = process(&r, &batch, &metrics, &health, &mut shutdown).instrument(span).await;
        match done {
            Ok(true) => source.commit(&NextOffsets::after(&batch)),
            Ok(false) => break, // shutdown while retrying: the batch rolled back; it will be redelivered
            Err(e) => {
                outcome = Err(PipelineFailure::Fatal { pipeline: name.clone(), source: e });
                break;
            }
        }
    }
    source.close();
    outcome
}

/// Prepares and applies one batch, retrying retryable failures with exponential backoff and jitter. Returns
/// `Ok(false)` when shutdown came while waiting to retry.
async fn process(
    r: &Ready,
    batch: &[Record],
    metrics: &PipelineMetrics,
    health: &Health,
    shutdown: &mut Shutdown,
) -> Result<bool, SinkError> {
    let prepared: Vec<Prepared> = batch.iter().map(|rec| r.preparer.prepare(rec)).collect();
    let started = Instant::now();
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build();
    loop {
        match r.sink.apply(batch, &prepared).await {
            Ok(BatchOutcome { counts }) => {
                health.database(true);
                metrics.batch_committed(&counts, started.elapsed());
                tracing::debug!(
                    applied = counts.applied, duplicates = counts.duplicates.iter().sum::<u64>(),
                    dead_letters = counts.dead_letters.iter().sum::<u64>(), "batch committed"
                );
                return Ok(true);
            }
            Err(e) => match e.disposition() {
                Disposition::Retry(cause) => {
                    health.database(false);
                    metrics.retry(cause);
                    let delay = backoff.next().unwrap_or(Duration::from_secs(30));
                    tracing::warn!(error = %e, retry_in = ?delay, "batch rolled back; retrying (nothing is dead-lettered for this)");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.wait() => return Ok(false),
                    }
                }
                Disposition::Record | Disposition::Fatal => return Err(e),
            },
        }
    }
}
