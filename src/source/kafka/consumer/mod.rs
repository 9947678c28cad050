//! The Kafka source of one pipeline ([`crate::source::Source::Kafka`]): a consumer-group member that hands out batches and commits offsets.
//!
//! Offsets are never committed automatically (`enable.auto.commit=false`): [`KafkaSource::commit`] is called only after
//! a batch's transaction committed. Ownership of partitions is tracked across rebalances:
//!
//! - rebalance callbacks run inside the consumer's poll: while a batch is collected ([`KafkaSource::next_batch`]),
//!   while a retry waits ([`KafkaSource::pause_for`]) and while a batch is in its transaction ([`KafkaSource::poll_while`]);
//!   a partition revoked while a batch is in flight is remembered, so the batch's offset for it is not committed
//!   and a retry of the batch drops its records;
//! - on revoke, the positions that are durable for the revoked partitions are committed synchronously before the
//!   partitions go (librdkafka allows commits from the rebalance callback), and records already buffered for them
//!   are dropped, so the new owner starts from durable work only;
//! - an offset is committed only for partitions still owned and not revoked while the batch was in flight; a late
//!   one is skipped, logged and counted (`idemflow_offset_commits_total{result="skipped_not_owned"}`), so a stale
//!   commit can never move a group's position backwards or past unprocessed records.
//!
//! Records of a partition are handed out in offset order and batches are processed one at a time, so
//! per-partition order is preserved.
//!
//! The consumer is polled all the time, also while a batch is in its database transaction
//! ([`KafkaSource::poll_while`]): a slow or unreachable database never keeps it from polling for longer than
//! `max.poll.interval.ms` (librdkafka would leave the group). Rebalance callbacks can therefore run while a batch
//! is in flight; that is safe because the offset commit after the transaction skips partitions no longer owned, a
//! revoked partition's durable position is committed before it goes (the batch in flight is then redelivered to
//! the new owner and skipped as a duplicate), and with `[offsets] store = "database"` the owner epochs fence a
//! batch whose partition another worker claimed meanwhile.
//!
//! With `[offsets] store = "database"`, the rebalance callback does not assign newly assigned partitions itself:
//! it starts their claim ([`crate::store::Store::claim_offsets`]) as a task and returns; the source keeps polling and, once the
//! claim is done, assigns the partitions from their stored positions (librdkafka waits for that assign call,
//! keeping the member in its group). So a database that is down during a rebalance delays the partitions, never
//! the consumer's poll. A revoke or a shutdown before the claim finishes drops it.
//!
//! A claim can still land after this worker lost the partition (a claim statement already sent when a revoke drops
//! it; a re-claim after the store lost writes racing a revoke), and it fences the partition's real owner. So a worker
//! fenced on a partition that the group still assigns to it does not keep it paused until its next rebalance (which
//! may never come under a cooperative assignor): once [`KafkaSource::fenced_for`] has passed (the group's session
//! timeout, at least [`FENCED_FOR_MIN`]: by then a worker whose view of the group was stale has learned that it
//! lost the partition) it claims the partition again, checking just before the claim and again after it that the
//! partition is still assigned here, and seeks it to its stored position ([`KafkaSource::reclaim_fenced`]). Two
//! workers that both believe they hold a partition can cost each other a fenced batch (rolled back whole, so nothing
//! is applied twice), never a record.
//!
//! Between records (and once a second while idle) the source does its housekeeping: it commits positions learned
//! at assignment (the stored positions of `[offsets] store = "database"`, so lag tools reading the group's
//! committed offsets see no lag that is not there), retries a failed offset commit, exports the lag of every
//! assigned partition from the moment it is assigned (`idemflow_consumer_lag_records`), and warns when the
//! consumer has had no partition for `[kafka] no_partitions_warning`.

use super::client::*;
use super::ownership::*;
use super::record::*;
use super::check::{check_topics, retention_report};
use super::spec::KafkaSettings;

use crate::batch::{BatchSettings, Records};
use super::spec::KafkaSpec;
use crate::source::contract::{CheckError, Connector, StoredStart};
use crate::metrics::{CommitResult, PipelineMetrics};
use crate::offsets::NextOffsets;
use crate::record::Record;
use crate::shutdown::Shutdown;
use crate::offsets::{self, Positions};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

mod claims;

/// How often the source does its housekeeping while idle (a failed offset commit retried, lag refreshed, the
/// time without partitions checked).
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(1);

/// How long [`KafkaSource::poll_while`] leaves the consumer unpolled once it keeps a full next batch: far below
/// `max.poll.interval.ms` (300 s by default) and `session.timeout.ms` (heartbeats run on librdkafka's own thread
/// anyway), long enough for most batch transactions.
const REST_AT_MOST: Duration = Duration::from_secs(1);

/// How often the lag of every assigned partition is refreshed from the high watermarks librdkafka knows.
const LAG_EVERY: Duration = Duration::from_secs(5);

/// The longest the source waits for the broker when it looks up committed offsets or watermarks for the lag.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);


/// How long a fenced partition whose seek to its new claim's position failed waits before it is claimed again.
const RESEEK_AFTER: Duration = Duration::from_secs(3);

/// One pipeline's consumer.
pub struct KafkaSource {
    consumer: StreamConsumer<GroupContext>,
    /// Records received while a batch was being retried, handed out first by the next batch.
    stash: Vec<Record>,
    /// Consume errors in a row, for backing off.
    consume_errors: u32,
    /// The last offset commit failed: retried while idle.
    commit_failed: bool,
    state: Arc<Mutex<Ownership>>,
    topics: HashMap<String, Arc<str>>,
    pipeline: String,
    metrics: PipelineMetrics,
    /// When the lag of every assigned partition was last refreshed.
    lag_refreshed: Option<Instant>,
    /// Since when the consumer has had no partition (from the start until the first assignment).
    unassigned_since: Option<Instant>,
    /// Warnings given about the current time without partitions.
    unassigned_warnings: u32,
    /// `[kafka] no_partitions_warning`.
    no_partitions_warning: Duration,
    /// The most records [`KafkaSource::poll_while`] keeps before pausing.
    keep: usize,
    /// `batch.max_records`: once [`KafkaSource::poll_while`] keeps a full next batch, the consumer rests.
    batch_records: usize,
    /// When the consumer was last polled: it rests at most [`REST_AT_MOST`] from then, however many batches the
    /// kept records fill meanwhile.
    polled_at: tokio::time::Instant,
    /// The pipeline's `max_payload_bytes`: larger values are not kept whole ([`crate::record::bounded`]).
    max_payload_bytes: usize,
    /// Partitions revoked while a batch was in flight ([`KafkaSource::poll_while`]): the batch's records of them are
    /// dropped if it is retried, and its offset commit skips them (another member may have moved them on, or they
    /// start again from the group's committed offset).
    revoked_in_flight: HashSet<Tp>,
    /// A partition without a committed offset starts at its low watermark (`auto.offset.reset` earliest, the
    /// default), otherwise at its high watermark.
    reset_to_earliest: bool,
    /// How long a partition given up after a fenced batch stays given up before it is claimed again, if the group
    /// still assigns it here ([`KafkaSource::reclaim_fenced`]): `session.timeout.ms` (librdkafka's default 45 s), at
    /// least [`FENCED_FOR_MIN`]. A member whose view of the group is stale learns that it lost its partitions within
    /// its session timeout (the coordinator's answer to its heartbeat, or librdkafka's own session timer), so after
    /// that a partition still assigned here is this worker's, and a fence was a claim that came late.
    fenced_for: Duration,
    /// The topics' ids, asked of the cluster every [`super::topic_ids::FRESH_FOR`] by a thread of their own
    /// ([`KafkaSource::logs`]).
    topic_ids: super::topic_ids::TopicIds,
}

impl Connector for KafkaSource {
    type Spec = KafkaSpec;

    fn open(settings: Option<&KafkaSettings>, cx: &KafkaContext, metrics: PipelineMetrics, stored: Option<StoredStart>) -> Result<Self, String> {
        KafkaSource::new(settings.unwrap_or(&KafkaSettings::default()), cx, metrics, stored)
            .map_err(|e| format!("cannot create the Kafka consumer: {}", describe_kafka_error(&e)))
    }

    async fn check(settings: Option<&KafkaSettings>, cx: &KafkaContext) -> Result<Vec<String>, CheckError> {
        let settings = settings.cloned().unwrap_or_default();
        check_properties(&settings, cx).map_err(|e| CheckError::Settings(describe_kafka_error(&e)))?;
        let cx = cx.clone();
        let topics = tokio::task::spawn_blocking(move || check_topics(&settings, &cx, Duration::from_secs(5)));
        match topics.await {
            Ok(Ok(())) => Ok(Vec::new()),
            Ok(Err(e)) => Err(CheckError::Broker(e.to_string())),
            Err(e) => Err(CheckError::Broker(e.to_string())),
        }
    }

    fn timing_warnings(settings: Option<&KafkaSettings>, cx: &KafkaContext, shutdown_timeout: Duration) -> Vec<String> {
        timing_warnings(settings.unwrap_or(&KafkaSettings::default()), cx, shutdown_timeout)
    }

    async fn retention_report(settings: Option<&KafkaSettings>, cx: &KafkaContext) -> Vec<String> {
        let settings = settings.cloned().unwrap_or_default();
        retention_report(&settings, &cx.name, &cx.source.topics, cx.dedup_retention).await
    }

    async fn rewind(
        settings: Option<&KafkaSettings>,
        cx: &KafkaContext,
        _file: &std::path::Path,
        request: crate::source::rewind::Request,
        store: Option<crate::source::rewind::StoreSide<'_>>,
    ) -> anyhow::Result<()> {
        super::rewind::run(settings.unwrap_or(&KafkaSettings::default()), cx, request, store).await
    }

    async fn lose(&mut self, partitions: &[(String, i32)], used: Option<&Positions>, batch: &mut dyn Records) {
        self.give_up_fenced(partitions, used, batch);
    }

    fn owned(&self) -> Vec<(String, i32)> {
        self.assigned_now()
    }

    async fn resync(&mut self, claimed: &[offsets::Claimed], batch: &mut dyn Records) -> Result<(), String> {
        self.start_again_from(claimed, batch)
    }

    fn skip_to_floors(&mut self, floors: &[offsets::PassedFloor]) {
        self.move_on_to_floors(floors);
    }

    /// Waits for the next batch: at least one record, then up to `max_records`, for at most `max_wait` after the
    /// first; an empty batch after [`HOUSEKEEPING_EVERY`] without a record (the worker's idle moment). Returns `None`
    /// once `shutdown` is triggered while waiting for a first record; a batch being filled when shutdown comes is
    /// returned as it is, to be finished.
    async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        let mut batch: Vec<Record> = Vec::new();
        let mut deadline: Option<Instant> = None;
        let claimed = self.consumer.context().claimed.clone();
        self.housekeeping();
        drop_revoked(&self.state, &self.pipeline, &mut batch, &mut self.stash);
        if !self.stash.is_empty() {
            let take = self.stash.len().min(settings.max_records);
            batch.extend(self.stash.drain(..take));
            deadline = Some(Instant::now() + settings.max_wait);
        }
        while batch.len() < settings.max_records {
            let received = match deadline {
                None => tokio::select! {
                    m = self.consumer.recv() => m,
                    _ = shutdown.wait() => return None,
                    _ = claimed.notified() => {
                        self.finish_claim();
                        continue;
                    }
                    // While idle: commit positions learned at assignment or retry a failed commit, so the
                    // group's position (and the lag) does not stay behind until the next record arrives; refresh
                    // the lag; watch the time without partitions.
                    _ = tokio::time::sleep(HOUSEKEEPING_EVERY) => {
                        self.housekeeping();
                        // Idle: an empty batch lets the worker do its own idle checks (the batch holds nothing yet).
                        return Some(batch);
                    }
                },
                Some(at) => tokio::select! {
                    m = tokio::time::timeout_at(at, self.consumer.recv()) => match m {
                        Ok(m) => m,
                        Err(_) => break,
                    },
                    _ = shutdown.wait() => break,
                },
            };
            self.polled_at = tokio::time::Instant::now();
            drop_revoked(&self.state, &self.pipeline, &mut batch, &mut self.stash);
            match received {
                Ok(message) => {
                    self.consume_errors = 0;
                    let topic = intern(&mut self.topics, rdkafka::Message::topic(&message));
                    batch.push(to_record(&message, topic, self.max_payload_bytes));
                    deadline.get_or_insert_with(|| Instant::now() + settings.max_wait);
                }
                Err(e) => {
                    // Repeated errors (an unreachable broker) back off up to 5 s and are logged once per step.
                    self.consume_errors += 1;
                    let delay = Duration::from_millis(100 * (1u64 << self.consume_errors.min(6))).min(Duration::from_secs(5));
                    tracing::warn!(pipeline = %self.pipeline, error = %e, retry_in = ?delay, "consume error");
                    tokio::time::sleep(delay).await;
                }
            }
            if batch.is_empty() {
                deadline = None;
            }
            if self.consumer.context().assignment_changed.load(Ordering::SeqCst) {
                self.housekeeping();
            } else {
                self.finish_claim();
            }
        }
        drop_revoked(&self.state, &self.pipeline, &mut batch, &mut self.stash);
        Some(batch)
    }

    /// Waits `delay` before a retry without leaving the consumer group: consumption of the owned partitions is
    /// paused and the consumer keeps polling, so rebalance callbacks are served and `max.poll.interval.ms` is not
    /// exceeded. Records of `batch` whose partition is revoked meanwhile are dropped (their next owner gets them);
    /// records that still arrive are kept for the next batch. Returns `false` if shutdown came first.
    async fn pause_for(&mut self, delay: Duration, batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool {
        self.pause_owned();
        let deadline = Instant::now() + delay;
        let mut stopped = false;
        let claimed = self.consumer.context().claimed.clone();
        loop {
            tokio::select! {
                _ = claimed.notified() => self.finish_claim(),
                m = tokio::time::timeout_at(deadline, self.consumer.recv()) => match m {
                    Err(_) => break,
                    Ok(Ok(message)) => {
                        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
                        let topic = intern(&mut self.topics, rdkafka::Message::topic(&message));
                        self.stash.push(to_record(&message, topic, self.max_payload_bytes));
                    }
                    Ok(Err(e)) => {
                        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
                        tracing::debug!(pipeline = %self.pipeline, error = %e, "consume error while paused");
                    }
                },
                _ = shutdown.wait() => {
                    stopped = true;
                    break;
                }
            }
        }
        // Polled all along (a timed-out poll counts: it served the callbacks).
        self.polled_at = tokio::time::Instant::now();
        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
        self.resume_owned();
        !stopped
    }

    /// The positions to store in the batch's transaction after `next`, with this worker's epochs; `None` unless
    /// `[offsets] store = "database"`.
    fn positions(&self, next: &NextOffsets) -> Option<Positions> {
        self.consumer.context().stored.as_ref()?;
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Some(Positions::new(next, |t, p| st.epochs.get(&(t.clone(), p)).copied()))
    }

    /// Each partition's log as the cluster says: the topic's id ([`super::topic_ids`]: as last learnt by the
    /// source's own thread, at most [`super::topic_ids::FRESH_FOR`] old; a topic's first batch waits for its first
    /// lookup, at most [`super::topic_ids::FIRST_WAIT`]) and where the log ends (the high watermark of the last fetch
    /// response, no request).
    fn logs(&self, next: &NextOffsets) -> offsets::Logs {
        let mut topics: Vec<&str> = next.0.keys().map(|(t, _)| &**t).collect();
        topics.sort_unstable();
        topics.dedup();
        let ids = self.topic_ids.ids(&topics);
        offsets::Logs(
            next.0
                .keys()
                .map(|(t, p)| {
                    let log = offsets::Log { id: ids.get(&**t).cloned().flatten(), end: self.cached_high_watermark(t, *p) };
                    ((t.clone(), *p), log)
                })
                .collect(),
        )
    }

    /// Runs `work` (a spawned batch transaction) to its end while the consumer keeps polling: rebalance callbacks
    /// are served, `max.poll.interval.ms` is never exceeded however long the database takes, and the source's
    /// housekeeping goes on. Records that arrive meanwhile are kept for the next batch. Once a full next batch is
    /// kept the consumer rests (is not polled) until [`REST_AT_MOST`] after its last poll: librdkafka goes on prefetching into its
    /// own queue, bounded by `queued.min.messages` and `queued.max.messages.kbytes`, so a backlog flows without a
    /// stall. A longer transaction polls again, and once as many records are kept as the consumer prefetches
    /// (4 batches, at least 1,000) consumption is paused until `work` ends, bounding memory. (Pausing is not the
    /// normal path: librdkafka drops a paused partition's prefetched records and fetches them again on resume, which
    /// stalled a backlog for hundreds of milliseconds per batch when it was.) A panic in `work` is resumed here.
    /// Each record kept is passed to `received` ([`crate::source::Source::poll_while_receiving`]).
    async fn poll_while<T: Send>(&mut self, mut work: tokio::task::JoinHandle<T>, received: &mut (dyn FnMut(&Record) + Send)) -> T {
        let keep = self.keep;
        let mut paused_here = false;
        let claimed = self.consumer.context().claimed.clone();
        let mut tick = tokio::time::interval(HOUSEKEEPING_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let joined = loop {
            let mut full = false;
            let rest_until = self.polled_at + REST_AT_MOST;
            let resting = self.stash.len() >= self.batch_records && tokio::time::Instant::now() < rest_until;
            tokio::select! {
                biased;
                joined = &mut work => break joined,
                _ = claimed.notified() => self.finish_claim(),
                _ = tokio::time::sleep_until(rest_until), if resting => {}
                m = self.consumer.recv(), if !resting => {
                    self.polled_at = tokio::time::Instant::now();
                    // Revocations the callbacks made inside this poll apply to what was kept before it, never to
                    // a record of a partition assigned again since (as `next_batch` does); the batch in flight
                    // learns of them afterwards.
                    drop_revoked_from(&self.state, &self.pipeline, &mut self.stash, &mut self.revoked_in_flight);
                    match m {
                        Ok(message) => {
                            let topic = intern(&mut self.topics, rdkafka::Message::topic(&message));
                            let record = to_record(&message, topic, self.max_payload_bytes);
                            received(&record);
                            self.stash.push(record);
                            full = self.stash.len() >= keep;
                        }
                        Err(e) => tracing::debug!(pipeline = %self.pipeline, error = %e, "consume error while a batch is in flight"),
                    }
                }
                _ = tick.tick() => self.housekeeping(),
            }
            if full && !paused_here {
                self.pause_owned();
                paused_here = true;
            }
        };
        drop_revoked_from(&self.state, &self.pipeline, &mut self.stash, &mut self.revoked_in_flight);
        if paused_here {
            self.resume_owned();
        }
        joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// Drops from `batch` (a batch to retry) its records of partitions revoked while it was in flight, and of
    /// partitions revoked since (from the kept records too).
    fn drop_revoked(&mut self, batch: &mut dyn Records) {
        self.drop_revoked_in_flight(batch);
        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
    }

    /// Commits `next` for the partitions still owned, synchronously, and counts the outcome. A failure is logged
    /// and counted, never fatal: the records are redelivered and skipped as duplicates.
    async fn commit(&mut self, _records: &[Record], next: &NextOffsets) {
        let revoked = std::mem::take(&mut self.revoked_in_flight);
        let tpl = self.owned_list(next, &revoked);
        if tpl.count() == 0 {
            return;
        }
        // Lag from the high watermarks librdkafka already knows from its fetches (no request).
        let fetched = self.fetch_positions();
        let kept = self.kept();
        for e in tpl.elements() {
            if let (Some(high), Offset::Offset(next)) = (self.cached_high_watermark(e.topic(), e.partition()), e.offset()) {
                self.metrics.lag(e.topic(), e.partition(), (high - next).max(0));
                let tp = tp_of(e.topic(), e.partition());
                let from = fetched.get(&tp).copied().unwrap_or(next).max(next);
                self.metrics.waiting(e.topic(), e.partition(), (high - from).max(0) + kept.get(&tp).copied().unwrap_or(0));
            }
        }
        self.commit_list(&tpl);
    }

    /// Drops the consumer without committing anything (an injected crash): no callback commits while it closes.
    async fn abandon(self) {
        self.consumer.context().closing.store(true, Ordering::SeqCst);
        tokio::task::block_in_place(|| drop(self.consumer));
    }

    /// Commits every durable position synchronously, then leaves the group (closing the consumer). Leaving waits
    /// at most [`LEAVE_TIMEOUT`]: librdkafka's close can wait for a rebalance that other members are slow to
    /// complete (one that was just killed, for instance); past that the coordinator expires this member's session
    /// instead.
    async fn close(self) {
        let tpl = self.durable_list();
        let consumer = self.consumer;
        let pipeline = self.pipeline;
        consumer.context().closing.store(true, Ordering::SeqCst);
        // A claim still running: drop it and answer librdkafka's pending assign call with nothing, or leaving the
        // group would wait for that call.
        let claiming = self.state.lock().unwrap_or_else(PoisonError::into_inner).claiming.take();
        if let Some(claiming) = claiming {
            claiming.task.abort();
            let none = TopicPartitionList::new();
            let _ = if claiming.cooperative { consumer.incremental_assign(&none) } else { consumer.assign(&none) };
        }
        if let Some(reclaiming) = self.state.lock().unwrap_or_else(PoisonError::into_inner).reclaiming.take() {
            reclaiming.task.abort();
        }
        if tpl.count() > 0 {
            match tokio::task::block_in_place(|| consumer.commit(&tpl, CommitMode::Sync)) {
                Ok(()) => tracing::info!(pipeline = %pipeline, offsets = %describe(&tpl), "offsets committed"),
                Err(e) => tracing::warn!(pipeline = %pipeline, error = %e, offsets = %describe(&tpl),
                    "final offset commit refused (the group moved on: a rebalance during shutdown): the records after \
                     the last committed offsets come back to the partitions' next owner and are skipped as \
                     duplicates; nothing is lost or applied twice"),
            }
        }
        let (left, leaving) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            consumer.unsubscribe();
            drop(consumer);
            let _ = left.send(());
        });
        match tokio::task::block_in_place(|| leaving.recv_timeout(LEAVE_TIMEOUT)) {
            Ok(()) => tracing::info!(pipeline = %pipeline, "left the consumer group"),
            Err(_) => tracing::warn!(pipeline = %pipeline, timeout = ?LEAVE_TIMEOUT,
                "leaving the consumer group did not finish in time; the coordinator will expire this member's session"),
        }
    }
}

impl KafkaSource {
    /// Creates the consumer and subscribes to the pipeline's topics.
    ///
    /// The worker sets `group.id`, `enable.auto.commit=false` and `enable.auto.offset.store=false`, and defaults
    /// `auto.offset.reset=earliest` (a new group starts from the beginning of each partition), `client.id`,
    /// `queued.min.messages` (4 batches, at least 1000) and `queued.max.messages.kbytes=16384`, `fetch.max.bytes=8388608` and `fetch.queue.backoff.ms=20` (prefetch
    /// bounds);
    /// every other librdkafka property comes from `[kafka.properties]`, which also overrides these defaults.
    ///
    /// With `stored` (`[offsets] store = "database"`), each assigned partition starts from its position stored in
    /// `idemflow.offsets`, claimed under a new owner epoch (see [`crate::offsets`]); a partition with no stored
    /// position starts from the group's committed offset.
    pub fn new(
        kafka: &KafkaSettings,
        pipeline: &KafkaContext,
        metrics: PipelineMetrics,
        stored: Option<StoredStart>,
    ) -> KafkaResult<Self> {
        let config = consumer_config(kafka, pipeline);
        let state = Arc::new(Mutex::new(Ownership::default()));
        let context =
            GroupContext {
            pipeline: pipeline.name.clone(),
            state: state.clone(),
            metrics: metrics.clone(),
            stored,
            closing: AtomicBool::new(false),
            assignment_changed: AtomicBool::new(false),
            claimed: Arc::new(tokio::sync::Notify::new()),
        };
        let reset_to_earliest = !matches!(
            config.get("auto.offset.reset"),
            Some("latest" | "largest" | "end" | "error")
        );
        let session_ms = config.get("session.timeout.ms").and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(45_000);
        let fenced_for = Duration::from_millis(session_ms).max(FENCED_FOR_MIN);
        let consumer: StreamConsumer<GroupContext> = config.create_with_context(context).map_err(hide_config_value)?;
        // After the consumer: a configuration librdkafka refuses has been reported by then, with its value hidden.
        let topic_ids = super::topic_ids::TopicIds::start(config.clone(), &pipeline.name, &spec(pipeline).topics);
        let topics: Vec<&str> = spec(pipeline).topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        Ok(KafkaSource {
            consumer,
            stash: Vec::new(),
            consume_errors: 0,
            commit_failed: false,
            state,
            topics: spec(pipeline).topics.iter().map(|t| (t.clone(), Arc::from(t.as_str()))).collect(),
            pipeline: pipeline.name.clone(),
            metrics,
            lag_refreshed: None,
            unassigned_since: Some(Instant::now()),
            unassigned_warnings: 0,
            no_partitions_warning: kafka.no_partitions_warning,
            keep: prefetch_records(pipeline),
            batch_records: pipeline.batch.max_records,
            polled_at: tokio::time::Instant::now(),
            max_payload_bytes: pipeline.max_payload_bytes,
            revoked_in_flight: HashSet::new(),
            reset_to_earliest,
            fenced_for,
            topic_ids,
        })
    }

    fn drop_revoked_in_flight(&mut self, batch: &mut dyn Records) {
        let revoked = std::mem::take(&mut self.revoked_in_flight);
        drop_records_of(&revoked, &self.pipeline, &mut [batch]);
    }

    /// Pauses consumption of every assigned partition (also of those assigned while paused).
    fn pause_owned(&mut self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).paused = true;
        let paused = self.consumer.assignment().unwrap_or_default();
        if let Err(e) = self.consumer.pause(&paused) {
            tracing::debug!(pipeline = %self.pipeline, error = %e, "pausing partitions failed");
        }
    }

    /// Resumes consumption of every assigned partition except those given up after a fenced batch.
    fn resume_owned(&mut self) {
        let fenced: HashSet<Tp> = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.paused = false;
            st.fenced.keys().cloned().collect()
        };
        let mut owned = TopicPartitionList::new();
        for e in self.consumer.assignment().unwrap_or_default().elements() {
            if !fenced.contains(&tp_of(e.topic(), e.partition())) {
                owned.add_partition(e.topic(), e.partition());
            }
        }
        if let Err(e) = self.consumer.resume(&owned) {
            tracing::debug!(pipeline = %self.pipeline, error = %e, "resuming partitions failed");
        }
    }

    fn commit_list(&mut self, tpl: &TopicPartitionList) {
        match tokio::task::block_in_place(|| self.consumer.commit(tpl, CommitMode::Sync)) {
            Ok(()) => {
                self.metrics.offset_commit(CommitResult::Ok);
                self.commit_failed = false;
            }
            Err(e) => {
                self.metrics.offset_commit(CommitResult::Error);
                self.commit_failed = true;
                tracing::warn!(pipeline = %self.pipeline, error = %e, offsets = %describe(tpl),
                    "offset commit failed (retried when idle); unless it succeeds, the records will be redelivered \
                     and skipped as duplicates");
            }
        }
    }

    /// The source's work between records: commits positions learned at assignment and retries a failed commit,
    /// refreshes the lag of every assigned partition (at once after a rebalance, otherwise every [`LAG_EVERY`]),
    /// and warns each `[kafka] no_partitions_warning` while the consumer has no partition.
    fn housekeeping(&mut self) {
        self.finish_claim();
        self.reclaim_fenced();
        let changed = self.consumer.context().assignment_changed.swap(false, Ordering::SeqCst);
        let (pending, owned) = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            (std::mem::take(&mut st.commit_pending), st.assigned.len())
        };
        if pending || self.commit_failed {
            self.recommit();
        }
        if changed || self.lag_refreshed.is_none_or(|at| at.elapsed() >= LAG_EVERY) {
            self.refresh_lag();
            self.lag_refreshed = Some(Instant::now());
        }
        if owned > 0 {
            self.unassigned_since = None;
            self.unassigned_warnings = 0;
            return;
        }
        let since = *self.unassigned_since.get_or_insert_with(Instant::now);
        let warn_at = self.no_partitions_warning * (self.unassigned_warnings + 1);
        if !self.no_partitions_warning.is_zero() && since.elapsed() >= warn_at {
            self.unassigned_warnings += 1;
            tracing::warn!(pipeline = %self.pipeline, without_partitions = ?since.elapsed(),
                "no partition assigned to this worker: the consumer group may be stuck (a broker that does not \
                 answer JoinGroup, a member that does not finish its rebalance), or the group has more members than \
                 the topics have partitions");
        }
    }

    /// Sets `idemflow_consumer_lag_records` for every assigned partition: its high watermark (as librdkafka last
    /// saw it in a fetch; looked up from the broker if it has not fetched yet) minus its durable position. A
    /// partition whose durable position is not known yet takes the group's committed offset (looked up once; it
    /// is durable by construction, since only durable positions are ever committed), or without one the offset
    /// `auto.offset.reset` starts it from. Lookups that time out leave a partition's lag as it was. A partition
    /// given up after a fenced batch and still held by the consumer ([`KafkaSource::lose`]) counts too, from the
    /// group's committed offset: all its records wait until it is claimed again, so a claim that keeps failing
    /// shows as a stall.
    fn refresh_lag(&mut self) {
        let (owned, fenced, unknown) = {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let mut unknown = TopicPartitionList::new();
            for (topic, partition) in st.assigned.iter().filter(|tp| !st.durable.contains_key(*tp)).chain(st.fenced.keys()) {
                unknown.add_partition(topic, *partition);
            }
            let fenced: HashSet<Tp> = st.fenced.keys().cloned().collect();
            (st.assigned.iter().chain(&fenced).cloned().collect::<Vec<Tp>>(), fenced, unknown)
        };
        // Where each fenced partition was last committed: not durable for this worker (it holds no epoch of it).
        let mut fenced_at: HashMap<Tp, i64> = HashMap::new();
        if unknown.count() > 0 {
            match tokio::task::block_in_place(|| self.consumer.committed_offsets(unknown, LOOKUP_TIMEOUT)) {
                Ok(committed) => {
                    let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                    for e in committed.elements() {
                        let tp = tp_of(e.topic(), e.partition());
                        let Offset::Offset(next) = e.offset() else { continue };
                        if fenced.contains(&tp) {
                            fenced_at.insert(tp, next);
                        } else if st.assigned.contains(&tp) {
                            st.durable.entry(tp).or_insert(next);
                        }
                    }
                }
                Err(e) => tracing::debug!(pipeline = %self.pipeline, error = %e, "looking up committed offsets for the lag failed"),
            }
        }
        let durable: HashMap<Tp, i64> = {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            owned.iter().filter_map(|tp| st.durable.get(tp).or(fenced_at.get(tp)).map(|o| (tp.clone(), *o))).collect()
        };
        // Look-ups stop after LOOKUP_TIMEOUT in all (an unreachable leader must not hold up the poll); the partitions
        // left keep their lag until the next refresh.
        let deadline = Instant::now() + LOOKUP_TIMEOUT;
        let fetched = self.fetch_positions();
        let kept = self.kept();
        for tp in owned {
            let (topic, partition) = (&*tp.0, tp.1);
            let cached = self.cached_high_watermark(topic, partition);
            // A fenced partition is always looked up (its cache stops moving), within the same bound.
            if (cached.is_none() || fenced.contains(&tp)) && Instant::now() >= deadline {
                continue;
            }
            let position = durable.get(&tp).copied();
            let (low, high) = match (cached, position) {
                // A paused (fenced) partition fetches nothing: its cached high watermark stops moving.
                (Some(high), Some(_)) if !fenced.contains(&tp) => (None, high),
                _ => match tokio::task::block_in_place(|| self.consumer.fetch_watermarks(topic, partition, LOOKUP_TIMEOUT)) {
                    Ok((low, high)) => (Some(low), high),
                    Err(e) => {
                        tracing::debug!(pipeline = %self.pipeline, topic, partition, error = %e, "looking up watermarks for the lag failed");
                        continue;
                    }
                },
            };
            let start = match (position, low) {
                (Some(next), _) => next,
                (None, Some(low)) if self.reset_to_earliest => low,
                _ => high,
            };
            self.metrics.lag(topic, partition, (high - start).max(0));
            // A fenced partition's fetched records were dropped: everything past its committed offset waits.
            let from = if fenced.contains(&tp) { start } else { fetched.get(&tp).copied().unwrap_or(start).max(start) };
            self.metrics.waiting(topic, partition, (high - from).max(0) + kept.get(&tp).copied().unwrap_or(0));
        }
    }

    /// Records fetched and kept for the next batch, per partition: past the fetch position, so the high watermark
    /// does not show them, yet they wait (behind a batch of other partitions retried again and again, say).
    fn kept(&self) -> HashMap<Tp, i64> {
        let mut kept: HashMap<Tp, i64> = HashMap::new();
        for run in self.stash.chunk_by(|a, b| a.position.same_partition(&b.position)) {
            *kept.entry(tp_of(run[0].position.topic_name(), run[0].position.partition)).or_default() += run.len() as i64;
        }
        kept
    }

    /// Where the consumer's fetches are, per assigned partition (librdkafka's position: the next offset it hands
    /// out; local, no request). Records before it were fetched: in a batch or kept, which the worker accounts for.
    fn fetch_positions(&self) -> HashMap<Tp, i64> {
        let positions = self.consumer.position().unwrap_or_default();
        positions
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some((tp_of(e.topic(), e.partition()), o)),
                _ => None,
            })
            .collect()
    }

    /// Commits every durable position of the partitions still owned again, after a failed commit.
    fn recommit(&mut self) {
        let tpl = self.durable_list();
        if tpl.count() == 0 {
            self.commit_failed = false;
            return;
        }
        self.commit_list(&tpl);
    }

    fn durable_list(&self) -> TopicPartitionList {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), offset) in &st.durable {
            let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset));
        }
        tpl
    }

    /// The high watermark librdkafka last saw in a fetch response (`rd_kafka_get_watermark_offsets`: local, no
    /// request). `None` before the first fetch.
    fn cached_high_watermark(&self, topic: &str, partition: i32) -> Option<i64> {
        let topic = std::ffi::CString::new(topic).ok()?;
        let (mut low, mut high) = (-1i64, -1i64);
        // SAFETY: the client pointer is valid while `self.consumer` lives; the out-pointers are to locals.
        let err = unsafe {
            rdkafka::bindings::rd_kafka_get_watermark_offsets(
                self.consumer.client().native_ptr(),
                topic.as_ptr(),
                partition,
                &mut low,
                &mut high,
            )
        };
        (err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some(high)
    }

    /// The offsets of `next` to commit: those of partitions owned now and not `revoked` while the batch was in
    /// flight (a partition that left and came back may have been moved on by another member meanwhile; it starts
    /// again from the group's committed offset, so committing this batch's end could move it backwards).
    fn owned_list(&self, next: &NextOffsets, revoked: &HashSet<Tp>) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for ((topic, partition), offset) in &next.0 {
            let tp = (topic.clone(), *partition);
            if st.assigned.contains(&tp) && !revoked.contains(&tp) {
                let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset));
                st.durable.insert(tp, *offset);
            } else {
                self.metrics.offset_commit(CommitResult::SkippedNotOwned);
                tracing::warn!(pipeline = %self.pipeline, topic = %topic, partition, offset,
                    "not committing the offset of a partition no longer owned");
            }
        }
        tpl
    }

}

