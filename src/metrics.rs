//! Every Prometheus metric idemflow exports, in one place.
//!
//! Names follow Prometheus conventions: `idemflow_` prefix, base units, `_total` for counters, `_seconds` for
//! durations. Label values come only from closed sets (pipeline names from the config, reasons and results from
//! enums); never a business key, an offset or error text. Every `(pipeline, reason)` series is created at start-up
//! with value 0, so dashboards show 0 rather than "no data". Counters of a batch move only after its transaction
//! committed.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Why a duplicate was skipped. Label `reason` of `idemflow_duplicates_skipped_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DuplicateReason {
    /// The dedup row has the same topic, partition and offset: the broker delivered the same record again
    /// (restart before the offset commit, rebalance, lost acknowledgement).
    Redelivered,
    /// Same business key, same payload fingerprint, another offset: the operation was published again
    /// (a producer retry).
    Republished,
    /// Same business key, different payload: logged as a warning with both positions.
    PayloadMismatch,
}

impl DuplicateReason {
    /// Every reason, for pre-initialising series.
    pub const ALL: [DuplicateReason; 3] =
        [DuplicateReason::Redelivered, DuplicateReason::Republished, DuplicateReason::PayloadMismatch];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DuplicateReason::Redelivered => "redelivered",
            DuplicateReason::Republished => "republished",
            DuplicateReason::PayloadMismatch => "payload_mismatch",
        }
    }
}

/// Why a record went to the dead letters. Label `reason` of `idemflow_dead_letters_total` and the `reason` column
/// of `idemflow.dead_letters`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// The payload is not valid for the pipeline's format (including empty, too deeply nested, invalid UTF-8).
    DecodeFailed,
    /// The payload is larger than `max_payload_bytes`; it was not parsed.
    PayloadTooLarge,
    /// The business key is missing, null or empty.
    KeyMissing,
    /// The business key is present but unusable (wrong type, not UTF-8, U+0000, over `key.max_bytes`).
    KeyInvalid,
    /// A required side-effect value is missing or null.
    ParamMissing,
    /// A side-effect value cannot be bound (U+0000).
    ParamInvalid,
    /// The side effect raised a data or constraint error (SQLSTATE class 22, 23, ...) for this record.
    SideEffectRejected,
    /// The value is null and the pipeline dead-letters tombstones.
    Tombstone,
    /// An outbox request ([`crate::outbox`]) its target refused for good, or that ran out of its attempts: the
    /// dead letter keeps the request whole, and `idemflow dead-letters replay` puts it back in the outbox.
    DeliveryFailed,
}

impl DeadLetterReason {
    /// Every reason, for pre-initialising series.
    pub const ALL: [DeadLetterReason; 9] = [
        DeadLetterReason::DecodeFailed,
        DeadLetterReason::PayloadTooLarge,
        DeadLetterReason::KeyMissing,
        DeadLetterReason::KeyInvalid,
        DeadLetterReason::ParamMissing,
        DeadLetterReason::ParamInvalid,
        DeadLetterReason::SideEffectRejected,
        DeadLetterReason::Tombstone,
        DeadLetterReason::DeliveryFailed,
    ];

    /// The reason stored as `text` (its [`DeadLetterReason::as_str`]), if it is one.
    pub fn parse(text: &str) -> Option<DeadLetterReason> {
        DeadLetterReason::ALL.into_iter().find(|r| r.as_str() == text)
    }

    /// The label value and the stored reason.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::DecodeFailed => "decode_failed",
            DeadLetterReason::PayloadTooLarge => "payload_too_large",
            DeadLetterReason::KeyMissing => "key_missing",
            DeadLetterReason::KeyInvalid => "key_invalid",
            DeadLetterReason::ParamMissing => "param_missing",
            DeadLetterReason::ParamInvalid => "param_invalid",
            DeadLetterReason::SideEffectRejected => "side_effect_rejected",
            DeadLetterReason::Tombstone => "tombstone",
            DeadLetterReason::DeliveryFailed => "delivery_failed",
        }
    }
}

/// Why a batch was retried. Label `cause` of `idemflow_db_retries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryCause {
    /// The connection failed or was lost (SQLSTATE class 08, I/O errors, a lost `COMMIT`).
    Connection,
    /// Serialization failure or deadlock (40001, 40P01).
    Conflict,
    /// The server is shutting down, starting, or out of resources (57P0x, 53xxx, 55P03, 58xxx).
    Unavailable,
    /// No pooled connection within `database.acquire_timeout`.
    PoolTimeout,
}

impl RetryCause {
    const ALL: [RetryCause; 4] =
        [RetryCause::Connection, RetryCause::Conflict, RetryCause::Unavailable, RetryCause::PoolTimeout];

    fn as_str(self) -> &'static str {
        match self {
            RetryCause::Connection => "connection",
            RetryCause::Conflict => "conflict",
            RetryCause::Unavailable => "unavailable",
            RetryCause::PoolTimeout => "pool_timeout",
        }
    }
}

/// How an attempt at an outbox request ended ([`crate::outbox::deliver`]): label `result` of
/// `idemflow_outbox_attempts_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptResult {
    /// A `success` status.
    Confirmed,
    /// A `retry` status.
    RetryStatus,
    /// Another status.
    Rejected,
    /// No connection, or the connection was lost before the answer.
    Connection,
    /// No answer within `timeout`.
    Timeout,
}

impl AttemptResult {
    /// Every result, for pre-initialising series.
    pub const ALL: [AttemptResult; 5] =
        [AttemptResult::Confirmed, AttemptResult::RetryStatus, AttemptResult::Rejected, AttemptResult::Connection, AttemptResult::Timeout];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptResult::Confirmed => "confirmed",
            AttemptResult::RetryStatus => "retry_status",
            AttemptResult::Rejected => "rejected",
            AttemptResult::Connection => "connection",
            AttemptResult::Timeout => "timeout",
        }
    }
}

/// Result of an offset commit. Label `result` of `idemflow_offset_commits_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitResult {
    /// The broker accepted it.
    Ok,
    /// It failed; the dedup rows absorb the redelivery this causes.
    Error,
    /// Not sent: the partition is no longer owned by this consumer.
    SkippedNotOwned,
    /// `[offsets] store = "database"`: the stored position was claimed by another worker; the batch rolled back.
    Fenced,
}

impl CommitResult {
    const ALL: [CommitResult; 4] =
        [CommitResult::Ok, CommitResult::Error, CommitResult::SkippedNotOwned, CommitResult::Fenced];

    fn as_str(self) -> &'static str {
        match self {
            CommitResult::Ok => "ok",
            CommitResult::Error => "error",
            CommitResult::SkippedNotOwned => "skipped_not_owned",
            CommitResult::Fenced => "fenced",
        }
    }
}

/// Rebalance events. Label `event` of `idemflow_rebalances_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RebalanceEvent {
    /// Partitions assigned to this consumer.
    Assign,
    /// Partitions taken away.
    Revoke,
    /// The rebalance failed.
    Error,
}

impl RebalanceEvent {
    const ALL: [RebalanceEvent; 3] = [RebalanceEvent::Assign, RebalanceEvent::Revoke, RebalanceEvent::Error];

    fn as_str(self) -> &'static str {
        match self {
            RebalanceEvent::Assign => "assign",
            RebalanceEvent::Revoke => "revoke",
            RebalanceEvent::Error => "error",
        }
    }
}

/// After how long without progress, while records wait, a partition is stalled by default (`[metrics]
/// stall_after`).
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(300);

/// Per partition of every pipeline (`(pipeline, topic, partition)`): when its durable position last advanced, or
/// nothing waited on it.
#[derive(Debug)]
struct Stalls {
    after_secs: AtomicU64,
    partitions: Mutex<HashMap<(String, String, i32), Progress>>,
}

#[derive(Debug)]
struct Progress {
    /// The last progress (a committed batch of it, or nothing waiting), or when the partition was first seen.
    since: Instant,
    /// Records waiting that the source knows of ([`PipelineMetrics::waiting`]).
    waiting: i64,
    /// Records of it in the batch being applied ([`PipelineMetrics::in_flight`]).
    in_flight: i64,
    /// Whether it was stalled when last looked at (a change is logged).
    stalled: bool,
}

impl Progress {
    fn waiting(&self) -> i64 {
        self.waiting.max(self.in_flight)
    }
}

/// The registry and every metric family.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    records_received: IntCounterVec,
    records_applied: IntCounterVec,
    duplicates_skipped: IntCounterVec,
    dead_letters: IntCounterVec,
    tombstones_skipped: IntCounterVec,
    batch_duration: HistogramVec,
    batch_records: HistogramVec,
    end_to_end_latency: HistogramVec,
    redis_script: HistogramVec,
    consumer_lag: IntGaugeVec,
    assigned_partitions: IntGaugeVec,
    dedup_rows_purged: IntCounterVec,
    retention_rows_examined: IntCounterVec,
    retention_passes: IntCounterVec,
    retention_pass_seconds: GaugeVec,
    db_retries: IntCounterVec,
    schema_registry_retries: IntCounterVec,
    prepared_ahead: IntCounterVec,
    offset_commits: IntCounterVec,
    rebalances: IntCounterVec,
    pipeline_up: IntGaugeVec,
    partition_stalled: IntGaugeVec,
    stalls: Arc<Stalls>,
    outbox_rows: IntGaugeVec,
    outbox_oldest: GaugeVec,
    outbox_due_wait: GaugeVec,
    outbox_paused: IntGaugeVec,
    outbox_attempts: IntCounterVec,
    outbox_deliveries: IntCounterVec,
    outbox_delivery_seconds: HistogramVec,
    /// Held while a batch's counts are added and while the registry is read, so every scrape sees whole batches:
    /// received = applied + duplicates + dead letters + tombstones in any scrape.
    batch_counts: std::sync::Arc<std::sync::Mutex<()>>,
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(c.clone())).expect("registered once");
    c
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> HistogramVec {
    histogram_by(registry, name, help, buckets, &["pipeline"])
}

fn histogram_by(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>, labels: &[&str]) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).expect("valid metric");
    registry.register(Box::new(h.clone())).expect("registered once");
    h
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(g.clone())).expect("registered once");
    g
}

fn float_gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(g.clone())).expect("registered once");
    g
}

impl Metrics {
    /// Creates every metric family and `idemflow_build_info`.
    pub fn new() -> Self {
        let r = Registry::new();
        let build_info = gauge(&r, "idemflow_build_info", "Always 1; the version label says which idemflow is running.", &["version"]);
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let pipeline_up = gauge(&r, "idemflow_pipeline_up", "1 while the pipeline runs, 0 once it stopped on a fatal error.", &["pipeline"]);
        Metrics {
            records_received: counter(&r, "idemflow_records_received_total", "Records consumed and processed by a committed batch.", &["pipeline"]),
            records_applied: counter(&r, "idemflow_records_applied_total", "Records whose business key was new and whose side effect committed.", &["pipeline"]),
            duplicates_skipped: counter(&r, "idemflow_duplicates_skipped_total", "Records skipped because their business key was already applied, by reason.", &["pipeline", "reason"]),
            dead_letters: counter(&r, "idemflow_dead_letters_total", "Records written to the dead letters, by reason.", &["pipeline", "reason"]),
            tombstones_skipped: counter(&r, "idemflow_tombstones_skipped_total", "Records with a null value skipped without effect.", &["pipeline"]),
            batch_duration: histogram(&r, "idemflow_batch_duration_seconds", "Time from a batch's first database statement to its commit, retries included.",
                vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
            batch_records: histogram(&r, "idemflow_batch_records", "Records per committed batch.",
                vec![1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0]),
            end_to_end_latency: histogram(&r, "idemflow_end_to_end_latency_seconds", "Time from a record's Kafka timestamp to the commit of its batch.",
                vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0]),
            redis_script: histogram(&r, "idemflow_redis_script_duration_seconds", "Round trip of a Redis pipeline's batch script (EVALSHA): the time Redis ran the batch plus the network.",
                vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
            consumer_lag: gauge(&r, "idemflow_consumer_lag_records", "Records between the partition's durable position and its high watermark, for every partition assigned to this worker (from the moment it is assigned); for a RabbitMQ queue (partition -1), this worker's share of its ready messages plus the deliveries it holds unacknowledged (summed over workers: the queue's depth).", &["pipeline", "topic", "partition"]),
            assigned_partitions: gauge(&r, "idemflow_assigned_partitions", "Partitions currently assigned to this worker's consumer of the pipeline (RabbitMQ: queues being consumed).", &["pipeline"]),
            dedup_rows_purged: counter(&r, "idemflow_dedup_rows_purged_total", "Dedup rows deleted by retention.", &["pipeline"]),
            retention_rows_examined: counter(&r, "idemflow_retention_rows_examined_total", "Dedup rows the retention sweep looked at (on PostgreSQL, of every pipeline sharing the table).", &["pipeline"]),
            retention_passes: counter(&r, "idemflow_retention_passes_total", "Full passes of the retention sweep over the dedup table.", &["pipeline"]),
            retention_pass_seconds: float_gauge(&r, "idemflow_retention_pass_seconds", "Seconds the last full pass of the retention sweep took, first slice to last: a dedup row lives at most its retention plus this and purge_interval (one pass more if an update moved it behind the sweep while its pass ran).", &["pipeline"]),
            db_retries: counter(&r, "idemflow_db_retries_total", "Batch attempts that failed with a retryable database error, by cause.", &["pipeline", "cause"]),
            schema_registry_retries: counter(&r, "idemflow_schema_registry_retries_total", "Fetches of schemas from the schema registry that failed (unreachable, timed out, 5xx, credentials refused) and were retried with consumption paused.", &["pipeline"]),
            prepared_ahead: counter(&r, "idemflow_records_prepared_ahead_total", "Records prepared (decoded, keyed, their values taken) while the batch before theirs was in its transaction, by result: used for their batch, or dropped unused (their partition revoked, fenced or resynced, or their channel lost, before it; the statements rebuilt).", &["pipeline", "result"]),
            offset_commits: counter(&r, "idemflow_offset_commits_total", "Kafka offset commits and RabbitMQ acknowledgements after a batch's COMMIT, by result.", &["pipeline", "result"]),
            rebalances: counter(&r, "idemflow_rebalances_total", "Consumer group rebalance events (RabbitMQ: consumers started, assign, and lost with their connection, revoke), by event.", &["pipeline", "event"]),
            pipeline_up,
            partition_stalled: gauge(&r, "idemflow_partition_stalled_seconds", "For every partition (RabbitMQ: queue) assigned to this worker: seconds since its durable position last advanced while records wait on it (its consumer lag above 0); 0 while nothing waits. A partition over [metrics] stall_after is stalled: logged, and /readyz answers 503.", &["pipeline", "topic", "partition"]),
            stalls: Arc::new(Stalls { after_secs: AtomicU64::new(DEFAULT_STALL_AFTER.as_secs()), partitions: Mutex::default() }),
            outbox_rows: gauge(&r, "idemflow_outbox_rows", "Outbox rows of the pipeline waiting for delivery (every worker's: the outbox is shared), counted up to twice [outbox] max_rows.", &["pipeline"]),
            outbox_oldest: float_gauge(&r, "idemflow_outbox_oldest_seconds", "Seconds since the oldest outbox row of the pipeline still waiting was written; 0 when none waits.", &["pipeline"]),
            outbox_due_wait: float_gauge(&r, "idemflow_outbox_due_wait_seconds", "The longest an outbox row the relay could send now (due, first of its business key) has waited since it was due, in seconds; what [outbox] max_age bounds. 0 when none waits.", &["pipeline"]),
            outbox_paused: gauge(&r, "idemflow_outbox_paused", "1 while the pipeline does not consume because its outbox is over [outbox] max_rows or max_age (back-pressure), else 0.", &["pipeline"]),
            outbox_attempts: counter(&r, "idemflow_outbox_attempts_total", "Attempts at delivering outbox requests, by target and result: confirmed, retry_status, rejected, connection, timeout.", &["pipeline", "target", "result"]),
            outbox_deliveries: counter(&r, "idemflow_outbox_deliveries_total", "Outbox requests done with, by target and outcome: confirmed by the target, or dead_lettered (delivery_failed).", &["pipeline", "target", "outcome"]),
            outbox_delivery_seconds: histogram_by(&r, "idemflow_outbox_delivery_seconds", "Time from an outbox row's write (its batch's commit) to its target's confirmation, retries included.",
                vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0], &["pipeline", "target"]),
            batch_counts: Default::default(),
            registry: r,
        }
    }

    /// Sets after how long without progress, while records wait, a partition counts as stalled (`[metrics]
    /// stall_after`; default [`DEFAULT_STALL_AFTER`]). Zero turns the stall signal off (the gauge still shows the
    /// seconds).
    pub fn set_stall_after(&self, after: Duration) {
        self.stalls.after_secs.store(after.as_secs(), Ordering::Relaxed);
    }

    /// Brings `idemflow_partition_stalled_seconds` up to date and returns the partitions stalled now, one
    /// description each (`pipeline "p": topic/2: 312 s without progress, 1,200 records waiting`). A partition that
    /// becomes stalled is logged once as an error, and once more when it moves again. Called by every scrape, by
    /// `/readyz` and every few seconds by the worker, so a stall is seen whoever looks.
    pub fn stalls(&self) -> Vec<String> {
        let after = self.stalls.after_secs.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut stalled = Vec::new();
        let mut partitions = self.stalls.partitions.lock().unwrap_or_else(PoisonError::into_inner);
        for ((pipeline, topic, partition), p) in partitions.iter_mut() {
            let waiting = p.waiting();
            let waited = if waiting > 0 { now.duration_since(p.since).as_secs() } else { 0 };
            self.partition_stalled.with_label_values(&[pipeline, topic, &partition.to_string()]).set(waited as i64);
            let is = after > 0 && waiting > 0 && waited >= after;
            if is && !p.stalled {
                tracing::error!(pipeline = %pipeline, topic = %topic, partition = *partition, seconds = waited, waiting,
                    "stalled: records wait on this partition and none has been applied since (a batch retried, a paused or \
                     fenced partition, a consumer that stopped fetching); see the pipeline's earlier warnings for the cause");
            } else if !is && p.stalled {
                tracing::info!(pipeline = %pipeline, topic = %topic, partition = *partition, "the stalled partition moves again");
            }
            p.stalled = is;
            if is {
                stalled.push(format!("pipeline {pipeline:?}: {topic}/{partition}: {waited} s without progress, {waiting} record(s) waiting"));
            }
        }
        stalled.sort();
        stalled
    }

    /// The handle one pipeline uses, with every one of its series initialised to 0.
    pub fn pipeline(&self, name: &str) -> PipelineMetrics {
        let p = name;
        for reason in DuplicateReason::ALL {
            self.duplicates_skipped.with_label_values(&[p, reason.as_str()]);
        }
        for reason in DeadLetterReason::ALL {
            self.dead_letters.with_label_values(&[p, reason.as_str()]);
        }
        for cause in RetryCause::ALL {
            self.db_retries.with_label_values(&[p, cause.as_str()]);
        }
        for result in CommitResult::ALL {
            self.offset_commits.with_label_values(&[p, result.as_str()]);
        }
        self.schema_registry_retries.with_label_values(&[p]);
        for result in ["used", "dropped"] {
            self.prepared_ahead.with_label_values(&[p, result]);
        }
        for event in RebalanceEvent::ALL {
            self.rebalances.with_label_values(&[p, event.as_str()]);
        }
        self.pipeline_up.with_label_values(&[p]).set(1);
        self.assigned_partitions.with_label_values(&[p]).set(0);
        self.dedup_rows_purged.with_label_values(&[p]);
        self.retention_rows_examined.with_label_values(&[p]);
        self.retention_passes.with_label_values(&[p]);
        self.retention_pass_seconds.with_label_values(&[p]).set(0.0);
        PipelineMetrics {
            name: name.to_owned(),
            metrics: self.clone(),
            received: self.records_received.with_label_values(&[p]),
            applied: self.records_applied.with_label_values(&[p]),
            tombstones: self.tombstones_skipped.with_label_values(&[p]),
            batch_duration: self.batch_duration.with_label_values(&[p]),
            redis_script: self.redis_script.with_label_values(&[p]),
            batch_records: self.batch_records.with_label_values(&[p]),
            end_to_end_latency: self.end_to_end_latency.with_label_values(&[p]),
            up: self.pipeline_up.with_label_values(&[p]),
            lane: 0,
            lane_partitions: Default::default(),
        }
    }

    /// The handle of one pipeline's outbox relay, its series initialised to 0.
    pub fn outbox(&self, pipeline: &str) -> OutboxMetrics {
        self.outbox_rows.with_label_values(&[pipeline]).set(0);
        self.outbox_oldest.with_label_values(&[pipeline]).set(0.0);
        self.outbox_due_wait.with_label_values(&[pipeline]).set(0.0);
        self.outbox_paused.with_label_values(&[pipeline]).set(0);
        OutboxMetrics { pipeline: pipeline.to_owned(), metrics: self.clone() }
    }

    /// The text exposition format (version 0.0.4) of every metric.
    pub fn render(&self) -> Vec<u8> {
        self.stalls();
        let families = {
            let _whole_batches = self.batch_counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.registry.gather()
        };
        let mut out = Vec::new();
        TextEncoder::new().encode(&families, &mut out).expect("encoding to a Vec");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// What one committed batch did, counted at once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Records in the batch.
    pub received: u64,
    /// Records applied.
    pub applied: u64,
    /// Tombstones skipped.
    pub tombstones: u64,
    /// Duplicates by reason, in [`DuplicateReason::ALL`] order.
    pub duplicates: [u64; 3],
    /// Dead letters by reason, in [`DeadLetterReason::ALL`] order.
    pub dead_letters: [u64; 9],
}

impl BatchCounts {
    /// Counts one duplicate.
    pub fn duplicate(&mut self, reason: DuplicateReason) {
        let i = DuplicateReason::ALL.iter().position(|r| *r == reason).expect("in ALL");
        self.duplicates[i] += 1;
    }

    /// Counts one dead letter.
    pub fn dead_letter(&mut self, reason: DeadLetterReason) {
        let i = DeadLetterReason::ALL.iter().position(|r| *r == reason).expect("in ALL");
        self.dead_letters[i] += 1;
    }
}

/// One pipeline's metrics, label values resolved once.
#[derive(Clone)]
pub struct PipelineMetrics {
    name: String,
    metrics: Metrics,
    received: IntCounter,
    applied: IntCounter,
    tombstones: IntCounter,
    batch_duration: Histogram,
    batch_records: Histogram,
    end_to_end_latency: Histogram,
    redis_script: Histogram,
    up: IntGauge,
    /// Which of the pipeline's consumers (`batch.concurrency`) this handle is for.
    lane: usize,
    /// Partitions assigned to each of the pipeline's consumers; the gauge shows their sum.
    lane_partitions: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
}

impl PipelineMetrics {
    /// Records the round trip of a Redis batch script.
    pub fn script_round_trip(&self, d: Duration) {
        self.redis_script.observe(d.as_secs_f64());
    }

    /// Records a committed batch: its counts and its duration (first statement to commit, retries included).
    pub fn batch_committed(&self, counts: &BatchCounts, duration: Duration) {
        let _whole_batch = self.metrics.batch_counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.received.inc_by(counts.received);
        self.applied.inc_by(counts.applied);
        self.tombstones.inc_by(counts.tombstones);
        for (reason, n) in DuplicateReason::ALL.iter().zip(counts.duplicates) {
            if n > 0 {
                self.metrics.duplicates_skipped.with_label_values(&[&self.name, reason.as_str()]).inc_by(n);
            }
        }
        for (reason, n) in DeadLetterReason::ALL.iter().zip(counts.dead_letters) {
            if n > 0 {
                self.metrics.dead_letters.with_label_values(&[&self.name, reason.as_str()]).inc_by(n);
            }
        }
        self.batch_duration.observe(duration.as_secs_f64());
        self.batch_records.observe(counts.received as f64);
    }

    /// Observes the end-to-end latency of committed records: `now` minus each record timestamp (milliseconds since
    /// the Unix epoch). Timestamps in the future (clock skew) count as 0.
    pub fn end_to_end(&self, timestamps_ms: impl Iterator<Item = i64>) {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default();
        for ts in timestamps_ms {
            self.end_to_end_latency.observe((now_ms - ts).max(0) as f64 / 1000.0);
        }
    }

    /// Sets the lag of one owned partition, in records (`idemflow_consumer_lag_records`).
    pub fn lag(&self, topic: &str, partition: i32, records: i64) {
        let p = partition.to_string();
        self.metrics.consumer_lag.with_label_values(&[&self.name, topic, &p]).set(records);
    }

    /// Sets how many records of an owned partition wait to be consumed that nothing is doing anything about, for the
    /// stall signal ([`Metrics::stalls`]): for Kafka the records past what the consumer has fetched (not the lag:
    /// a transaction's commit marker after the last record keeps the lag at 1 for good); for a queue the deliveries
    /// held unacknowledged. A partition with nothing waiting and no batch in flight is never stalled.
    pub fn waiting(&self, topic: &str, partition: i32, records: i64) {
        self.progress(topic, partition, |p, now| {
            p.waiting = records.max(0);
            if p.waiting == 0 && p.in_flight == 0 {
                p.since = now;
            }
        });
    }

    /// Records that a batch holding these partitions' records (with their counts) is being applied: they wait until
    /// it commits ([`PipelineMetrics::progressed`]), whatever the source says.
    pub fn in_flight<'a>(&self, partitions: impl IntoIterator<Item = (&'a str, i32, i64)>) {
        for (topic, partition, records) in partitions {
            self.progress(topic, partition, |p, _| p.in_flight = records);
        }
    }

    /// Records that a committed batch moved these partitions' durable positions (records of them were applied,
    /// skipped or dead-lettered): the stall clock of each starts again.
    pub fn progressed<'a>(&self, partitions: impl IntoIterator<Item = (&'a str, i32)>) {
        for (topic, partition) in partitions {
            self.progress(topic, partition, |p, now| {
                p.since = now;
                p.in_flight = 0;
            });
        }
    }

    fn progress(&self, topic: &str, partition: i32, update: impl FnOnce(&mut Progress, Instant)) {
        let now = Instant::now();
        let mut all = self.metrics.stalls.partitions.lock().unwrap_or_else(PoisonError::into_inner);
        let e = all
            .entry((self.name.clone(), topic.to_owned(), partition))
            .or_insert(Progress { since: now, waiting: 0, in_flight: 0, stalled: false });
        update(e, now);
    }

    /// The handle of the pipeline's consumer number `lane` (0 for the first; `batch.concurrency` runs several):
    /// the same series, with [`PipelineMetrics::assigned_partitions`] counted per consumer and summed.
    pub fn lane(&self, lane: usize) -> PipelineMetrics {
        PipelineMetrics { lane, ..self.clone() }
    }

    /// Sets the number of partitions assigned to this handle's consumer; the gauge shows the pipeline's total.
    pub fn assigned_partitions(&self, partitions: usize) {
        let mut lanes = self.lane_partitions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if lanes.len() <= self.lane {
            lanes.resize(self.lane + 1, 0);
        }
        lanes[self.lane] = partitions;
        let total: usize = lanes.iter().sum();
        self.metrics.assigned_partitions.with_label_values(&[&self.name]).set(total as i64);
    }

    /// Drops the lag series of a partition no longer owned.
    pub fn forget_lag(&self, topic: &str, partition: i32) {
        let p = partition.to_string();
        let _ = self.metrics.consumer_lag.remove_label_values(&[&self.name, topic, &p]);
        let _ = self.metrics.partition_stalled.remove_label_values(&[&self.name, topic, &p]);
        let mut all = self.metrics.stalls.partitions.lock().unwrap_or_else(PoisonError::into_inner);
        all.remove(&(self.name.clone(), topic.to_owned(), partition));
    }

    /// Counts one committed slice of the retention sweep: the rows it examined and deleted, and, when it ended a
    /// pass, the pass and its duration.
    pub fn swept(&self, slice: &crate::retention::Slice) {
        let p = [self.name.as_str()];
        self.metrics.dedup_rows_purged.with_label_values(&p).inc_by(slice.purged);
        self.metrics.retention_rows_examined.with_label_values(&p).inc_by(slice.examined);
        if let Some(seconds) = slice.pass_seconds {
            self.metrics.retention_passes.with_label_values(&p).inc();
            self.metrics.retention_pass_seconds.with_label_values(&p).set(seconds);
        }
    }

    /// Counts one failed, retryable batch attempt.
    pub fn retry(&self, cause: RetryCause) {
        self.metrics.db_retries.with_label_values(&[&self.name, cause.as_str()]).inc();
    }

    /// Counts one failed fetch of schemas from the schema registry, retried with consumption paused.
    pub fn schema_registry_retry(&self) {
        self.metrics.schema_registry_retries.with_label_values(&[&self.name]).inc();
    }

    /// Counts records prepared ahead ([`crate::prepare::Ahead::tally`]): `(used, dropped)`.
    pub fn prepared_ahead(&self, (used, dropped): (u64, u64)) {
        for (result, n) in [("used", used), ("dropped", dropped)] {
            if n > 0 {
                self.metrics.prepared_ahead.with_label_values(&[&self.name, result]).inc_by(n);
            }
        }
    }

    /// Counts one offset commit outcome.
    pub fn offset_commit(&self, result: CommitResult) {
        self.metrics.offset_commits.with_label_values(&[&self.name, result.as_str()]).inc();
    }

    /// Counts one rebalance event.
    pub fn rebalance(&self, event: RebalanceEvent) {
        self.metrics.rebalances.with_label_values(&[&self.name, event.as_str()]).inc();
    }

    /// [`Metrics::stalls`], for the pipeline's watcher.
    pub fn stalls(&self) -> Vec<String> {
        self.metrics.stalls()
    }

    /// Marks the pipeline stopped on a fatal error.
    pub fn set_fatal(&self) {
        self.up.set(0);
    }
}

/// One pipeline's outbox metrics ([`Metrics::outbox`]).
#[derive(Clone)]
pub struct OutboxMetrics {
    pipeline: String,
    metrics: Metrics,
}

impl OutboxMetrics {
    /// Initialises the series of one target.
    pub fn target(&self, target: &str) {
        let p = self.pipeline.as_str();
        for result in AttemptResult::ALL {
            self.metrics.outbox_attempts.with_label_values(&[p, target, result.as_str()]);
        }
        for outcome in ["confirmed", "dead_lettered"] {
            self.metrics.outbox_deliveries.with_label_values(&[p, target, outcome]);
        }
        self.metrics.outbox_delivery_seconds.with_label_values(&[p, target]);
    }

    /// Sets the rows waiting, the oldest one's age and the longest a row due has waited since it was due (seconds).
    pub fn depth(&self, rows: i64, oldest_seconds: f64, due_seconds: f64) {
        self.metrics.outbox_rows.with_label_values(&[&self.pipeline]).set(rows);
        self.metrics.outbox_oldest.with_label_values(&[&self.pipeline]).set(oldest_seconds);
        self.metrics.outbox_due_wait.with_label_values(&[&self.pipeline]).set(due_seconds);
    }

    /// Sets whether consumption is paused for the outbox.
    pub fn paused(&self, paused: bool) {
        self.metrics.outbox_paused.with_label_values(&[&self.pipeline]).set(i64::from(paused));
    }

    /// Counts one attempt.
    pub fn attempt(&self, target: &str, result: AttemptResult) {
        self.metrics.outbox_attempts.with_label_values(&[&self.pipeline, target, result.as_str()]).inc();
    }

    /// Counts one request confirmed, `seconds` after its row was written.
    pub fn confirmed(&self, target: &str, seconds: f64) {
        self.metrics.outbox_deliveries.with_label_values(&[&self.pipeline, target, "confirmed"]).inc();
        self.metrics.outbox_delivery_seconds.with_label_values(&[&self.pipeline, target]).observe(seconds);
    }

    /// Counts one request dead-lettered, in `idemflow_dead_letters_total{reason="delivery_failed"}` too.
    pub fn dead_lettered(&self, target: &str) {
        self.metrics.outbox_deliveries.with_label_values(&[&self.pipeline, target, "dead_lettered"]).inc();
        self.metrics.dead_letters.with_label_values(&[&self.pipeline, DeadLetterReason::DeliveryFailed.as_str()]).inc();
    }
}
