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


use super::{KafkaSettings, KafkaSpec};

use crate::batch::BatchSettings;
use crate::source::SourceContext;
use crate::metrics::{CommitResult, PipelineMetrics, RebalanceEvent};
use crate::offsets::NextOffsets;
use crate::record::Record;
use crate::shutdown::Shutdown;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use crate::offsets::{self, Positions};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer};
use rdkafka::types::RDKafkaRespErr;
use crate::source::StoredStart;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// Properties the worker sets itself; a value for them in `[kafka.properties]` is ignored with a warning.
const OWNED: [&str; 3] = ["group.id", "enable.auto.commit", "enable.auto.offset.store"];

type Tp = (Arc<str>, i32);

#[derive(Default)]
struct Ownership {
    assigned: HashSet<Tp>,
    /// Revoked since the batch collector last looked.
    revoked: Vec<Tp>,
    /// Per owned partition, the next offset whose predecessors are all durable in Postgres.
    durable: HashMap<Tp, i64>,
    /// `[offsets] store = "database"`: per owned partition, the owner epoch this worker claimed.
    epochs: HashMap<Tp, i64>,
    /// Consumption is paused for a retry ([`KafkaSource::pause_for`]).
    paused: bool,
    /// Partitions given up after a fenced batch ([`KafkaSource::lose`]): kept paused until assigned again, or until
    /// claimed again when the time here is over while they are still assigned ([`KafkaSource::reclaim_fenced`]).
    fenced: HashMap<Tp, Instant>,
    /// Durable positions learned at assignment (claimed stored positions) that the group has not committed yet.
    commit_pending: bool,
    /// `[offsets] store = "database"`: an assignment waiting for its claim before the assign call.
    claiming: Option<Claiming>,
    /// `[offsets] store = "database"`: a new claim of fenced partitions still assigned here.
    reclaiming: Option<Reclaiming>,
}

/// A claim of partitions given up after a fenced batch and still assigned here ([`KafkaSource::reclaim_fenced`]).
struct Reclaiming {
    /// Which claim this is.
    id: u64,
    /// The claim task (aborted by a revoke).
    task: tokio::task::JoinHandle<()>,
    /// Its outcome, set by the task before it notifies: `Some(None)` when shutdown came first.
    outcome: Option<Option<Vec<offsets::Claimed>>>,
}

/// An assignment whose stored positions are being claimed (see the module documentation).
struct Claiming {
    /// Which claim this is (a newer rebalance replaces an older claim).
    id: u64,
    /// The partitions the group assigned.
    partitions: Vec<(String, i32)>,
    /// Incremental (cooperative) assignment rather than eager.
    cooperative: bool,
    /// The claim task (aborted when the claim is dropped).
    task: tokio::task::JoinHandle<()>,
    /// Its outcome, set by the task before it notifies: `Some(None)` when shutdown came first.
    outcome: Option<Option<Vec<offsets::Claimed>>>,
}

impl Ownership {
    /// Forgets a partition this consumer no longer owns (revoked, or fenced) and queues it for dropping its
    /// buffered records; returns its durable position, if it had one. (A fenced partition is fenced again after.)
    fn give_up(&mut self, tp: Tp) -> Option<i64> {
        self.assigned.remove(&tp);
        self.epochs.remove(&tp);
        self.fenced.remove(&tp);
        let durable = self.durable.remove(&tp);
        self.revoked.push(tp);
        durable
    }

    /// The fenced partitions to claim again at `now`: those whose time is over, among those the consumer still
    /// holds (`held`, its assignment as librdkafka has it), sorted. A fenced partition no longer held is forgotten
    /// (if it is assigned here again, that assignment claims it). The partitions returned stay fenced (paused)
    /// until they are taken back ([`Ownership::retaken`]).
    fn due_reclaims(&mut self, now: Instant, held: &HashSet<Tp>) -> Vec<Tp> {
        self.fenced.retain(|tp, _| held.contains(tp));
        let mut due: Vec<Tp> = self.fenced.iter().filter(|(_, at)| now >= **at).map(|(tp, _)| tp.clone()).collect();
        due.sort();
        due
    }

    /// Splits a finished new claim of fenced partitions, checked after it: those to take back (still fenced, so no
    /// rebalance moved them meanwhile, and still held) and those no longer here (revoked or assigned anew while the
    /// claim ran: left to their owner, whose own claim comes after, or which claims them again once fenced).
    fn reclaimable(&self, claimed: &[offsets::Claimed], held: &HashSet<Tp>) -> (Vec<offsets::Claimed>, Vec<offsets::Claimed>) {
        claimed.iter().cloned().partition(|c| {
            let tp = tp_of(&c.topic, c.partition);
            self.fenced.contains_key(&tp) && held.contains(&tp)
        })
    }

    /// Takes back a fenced partition sought to the position of its new claim `c`: owned again under the new epoch,
    /// the stored position durable (and to be committed to the group). Returns the partition.
    fn retaken(&mut self, c: &offsets::Claimed) -> Tp {
        let tp = tp_of(&c.topic, c.partition);
        self.fenced.remove(&tp);
        self.epochs.insert(tp.clone(), c.epoch);
        if let Some(next) = c.next_offset {
            self.durable.insert(tp.clone(), next);
            self.commit_pending = true;
        }
        self.assigned.insert(tp.clone());
        tp
    }
}

/// Claims `parts` for `owner` (`[offsets] store = "database"`), retrying with backoff while the store cannot be
/// reached (`waiting` is logged at each retry). `None` when shutdown came first.
async fn claim_while_down(
    store: &crate::store::Store,
    pipeline: &str,
    owner: &str,
    parts: &[(String, i32)],
    shutdown: &mut Shutdown,
    waiting: &str,
) -> Option<Vec<offsets::Claimed>> {
    let mut delays = crate::retry::backoff(Duration::from_millis(100), Duration::from_secs(10));
    loop {
        match store.claim_offsets(pipeline, owner, parts).await {
            Ok(claimed) => return Some(claimed),
            Err(e) => {
                let delay = delays.next().unwrap_or(Duration::from_secs(10));
                tracing::warn!(pipeline = %pipeline, error = %e, retry_in = ?delay, "{waiting}");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait() => return None,
                }
            }
        }
    }
}

/// The partitions of `tpl`.
fn partitions_in(tpl: &TopicPartitionList) -> HashSet<Tp> {
    tpl.elements().iter().map(|e| tp_of(e.topic(), e.partition())).collect()
}


/// The consumer context: rebalance and commit callbacks, and librdkafka's log lines into tracing.
pub struct GroupContext {
    pipeline: String,
    state: Arc<Mutex<Ownership>>,
    metrics: PipelineMetrics,
    stored: Option<StoredStart>,
    /// Set by [`KafkaSource::close`]: the consumer is leaving the group.
    closing: AtomicBool,
    /// Set by the rebalance callbacks: the housekeeping refreshes the lag of the new assignment.
    assignment_changed: AtomicBool,
    /// Notified when a claim finishes, so the source assigns its partitions at once.
    claimed: Arc<tokio::sync::Notify>,
}

fn tp_of(topic: &str, partition: i32) -> Tp {
    (Arc::from(topic), partition)
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        let p = &self.pipeline;
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
                tracing::error!(pipeline = %p, facility = fac, "librdkafka: {log_message}")
            }
            RDKafkaLogLevel::Warning => tracing::warn!(pipeline = %p, facility = fac, "librdkafka: {log_message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(pipeline = %p, facility = fac, "librdkafka: {log_message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(pipeline = %p, facility = fac, "librdkafka: {log_message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(pipeline = %self.pipeline, %error, "kafka client error: {reason}");
    }
}

impl ConsumerContext for GroupContext {
    /// librdkafka's rebalance callback (it runs inside the consumer's poll). Replaces rdkafka's default only for
    /// `[offsets] store = "database"`: an assignment is not made here but after its stored positions are claimed
    /// (see the module documentation); otherwise it does what the default does.
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS if self.closing.load(Ordering::SeqCst) => {
                // Leaving the group: take nothing (librdkafka can abort when an assignment is still starting
                // while the consumer terminates).
                tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "closing: not taking the assigned partitions");
                consumer.unassign()
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                if let Some(stored) = &self.stored {
                    if tpl.count() > 0 {
                        // Assigned once the claim is done (`KafkaSource::finish_claim`); librdkafka waits for the call.
                        self.start_claim(stored, tpl, cooperative);
                        return;
                    }
                }
                let r = if cooperative { consumer.incremental_assign(tpl) } else { consumer.assign(tpl) };
                if r.is_ok() {
                    self.assigned(consumer, tpl);
                }
                r
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.revoked(consumer, tpl);
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                self.rebalance_error(KafkaError::Rebalance(other.into()));
                consumer.unassign()
            }
        };
        self.report(result);
    }
}

impl GroupContext {
    fn report(&self, result: KafkaResult<()>) {
        if let Err(e) = result {
            tracing::warn!(pipeline = %self.pipeline, error = %e, "applying the rebalance failed");
        }
    }

    fn revoked(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        self.metrics.rebalance(RebalanceEvent::Revoke);
        let mut commit = TopicPartitionList::new();
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(claiming) = st.claiming.take() {
                claiming.task.abort();
                tracing::info!(pipeline = %self.pipeline, "a rebalance came before the claim finished: dropping it");
            }
            if let Some(reclaiming) = st.reclaiming.take() {
                // Its partitions may be among the revoked: a claim of them now would fence their next owner.
                reclaiming.task.abort();
                tracing::info!(pipeline = %self.pipeline, "a rebalance came before the new claim of fenced partitions finished: dropping it");
            }
            for e in tpl.elements() {
                if let Some(next) = st.give_up(tp_of(e.topic(), e.partition())) {
                    let _ = commit.add_partition_offset(e.topic(), e.partition(), Offset::Offset(next));
                }
                self.metrics.forget_lag(e.topic(), e.partition());
            }
            self.metrics.assigned_partitions(st.assigned.len());
        }
        self.assignment_changed.store(true, Ordering::SeqCst);
        tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "partitions revoked");
        if self.closing.load(Ordering::SeqCst) {
            // KafkaSource::close committed the durable positions just before leaving; a commit from the callback
            // while the consumer terminates can abort librdkafka (rd_kafka_cgrp_terminated's assertion).
        } else if commit.count() > 0 && consumer.assignment_lost() {
            tracing::info!(pipeline = %self.pipeline, "assignment lost (session expired): not committing");
        } else if commit.count() > 0 {
            match consumer.commit(&commit, CommitMode::Sync) {
                Ok(()) => self.metrics.offset_commit(CommitResult::Ok),
                Err(e) => {
                    self.metrics.offset_commit(CommitResult::Error);
                    tracing::warn!(pipeline = %self.pipeline, error = %e, "offset commit on revoke failed; \
                        the new owner will skip the redelivered records as duplicates");
                }
            }
        }
    }

    fn rebalance_error(&self, e: KafkaError) {
        // rdkafka unassigns everything after a failed rebalance: treat it as losing every partition.
        self.metrics.rebalance(RebalanceEvent::Error);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(claiming) = st.claiming.take() {
            claiming.task.abort();
        }
        if let Some(reclaiming) = st.reclaiming.take() {
            reclaiming.task.abort();
        }
        let lost: Vec<Tp> = st.assigned.drain().collect();
        st.durable.clear();
        st.epochs.clear();
        for (topic, partition) in lost.iter().chain(st.fenced.keys()) {
            self.metrics.forget_lag(topic, *partition);
        }
        st.fenced.clear();
        st.revoked.extend(lost);
        drop(st);
        self.metrics.assigned_partitions(0);
        self.assignment_changed.store(true, Ordering::SeqCst);
        tracing::warn!(pipeline = %self.pipeline, error = %e, "rebalance error: every partition counts as lost");
    }

    fn assigned(&self, consumer: &impl Consumer<Self>, tpl: &TopicPartitionList) {
        self.metrics.rebalance(RebalanceEvent::Assign);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for e in tpl.elements() {
            let tp = tp_of(e.topic(), e.partition());
            st.fenced.remove(&tp);
            // An offset in the assignment is a claimed stored position (`start_from_stored`): durable, and to be
            // committed to the group so lag tools see it before the partition's next record arrives.
            if let Offset::Offset(next) = e.offset() {
                st.durable.insert(tp.clone(), next);
                st.commit_pending = true;
            }
            st.assigned.insert(tp);
        }
        let paused = st.paused;
        self.metrics.assigned_partitions(st.assigned.len());
        drop(st);
        self.assignment_changed.store(true, Ordering::SeqCst);
        // librdkafka keeps a partition's pause flag across a revoke and a new assignment (librdkafka issue
        // #1849): set it explicitly, or a partition paused before a rebalance would never be fetched again.
        let r = if paused { consumer.pause(tpl) } else { consumer.resume(tpl) };
        if let Err(e) = r {
            tracing::debug!(pipeline = %self.pipeline, error = %e, "setting the pause state of assigned partitions failed");
        }
        tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "partitions assigned");
    }

    /// Starts claiming the assigned partitions' stored positions ([`crate::store::Store::claim_offsets`]) in a task that retries while
    /// the database is unreachable, until shutdown; [`KafkaSource::finish_claim`] assigns them when it is done.
    fn start_claim(&self, stored: &StoredStart, tpl: &TopicPartitionList, cooperative: bool) {
        let partitions: Vec<(String, i32)> =
            tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect();
        let (store, pipeline, owner, parts) = (stored.store.clone(), self.pipeline.clone(), stored.owner.clone(), partitions.clone());
        let (mut shutdown, done, state) = (stored.shutdown.clone(), self.claimed.clone(), self.state.clone());
        static CLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = CLAIMS.fetch_add(1, Ordering::SeqCst);
        // Held until the claim is registered below, so the task cannot record its outcome before it exists.
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let task = stored.runtime.spawn(async move {
            let waiting = "cannot claim the stored positions of the assigned partitions; retrying (the consumer stays in its group)";
            let claimed = claim_while_down(&store, &pipeline, &owner, &parts, &mut shutdown, waiting).await;
            // The outcome is recorded before the notification, so the source finds it when it wakes up.
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(c) = st.claiming.as_mut().filter(|c| c.id == id) {
                c.outcome = Some(claimed);
            }
            drop(st);
            done.notify_one();
        });
        tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "partitions assigned: claiming their stored positions");
        if let Some(previous) = st.claiming.replace(Claiming { id, partitions, cooperative, task, outcome: None }) {
            previous.task.abort();
        }
    }
}

fn describe(tpl: &TopicPartitionList) -> String {
    let parts: Vec<String> = tpl
        .elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => format!("{}/{}@{o}", e.topic(), e.partition()),
            _ => format!("{}/{}", e.topic(), e.partition()),
        })
        .collect();
    parts.join(",")
}

/// How many records the consumer prefetches (librdkafka's `queued.min.messages`): 4 batches, at least 1,000 and
/// at most 100,000. [`KafkaSource::poll_while`] keeps at most as many records while a batch is in flight.
/// The Kafka source of a pipeline. Only Kafka pipelines reach this module (the worker and the commands dispatch on
/// [`crate::config::SourceSpec`] first).
pub fn spec(pipeline: &SourceContext) -> &KafkaSpec {
    pipeline.source.kafka().expect("only Kafka pipelines use the Kafka source")
}

fn prefetch_records(pipeline: &SourceContext) -> usize {
    (4 * pipeline.batch.max_records).clamp(1000, 100_000)
}

/// The consumer's librdkafka configuration (see [`KafkaSource::new`]).
pub(crate) fn consumer_config(kafka: &KafkaSettings, pipeline: &SourceContext) -> ClientConfig {
    let lanes = pipeline.batch.concurrency.max(1);
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka.bootstrap_servers)
        .set("auto.offset.reset", "earliest")
        .set("client.id", format!("idemflow-{}", pipeline.name))
        // Prefetch a few batches, not the whole backlog: librdkafka's defaults (100,000 messages per partition,
        // 64 MiB) make a worker that starts behind a large backlog hold hundreds of MiB of records it will not
        // process for minutes, and spend CPU fetching them.
        .set("queued.min.messages", prefetch_records(pipeline).to_string())
        // 16 MiB for the consumer's queue and 8 MiB per fetch response, divided among a pipeline's lanes
        // (`batch.concurrency`) down to 4 and 2 MiB each (a lane's 4 batches of 2,000 records of 200 bytes take
        // 1.6 MiB), and never below `message.max.bytes`, which librdkafka requires of `fetch.max.bytes`.
        .set("queued.max.messages.kbytes", (16_384 / lanes).max(4096).to_string())
        .set("fetch.max.bytes", (8_388_608 / lanes).max(2_097_152).max(max_message_bytes(kafka)).to_string())
        // When a partition's prefetch reaches those bounds librdkafka postpones its next fetch by this much
        // (default 1 s): with bounds of a few batches that stalled the worker about once a second.
        .set("fetch.queue.backoff.ms", "20");
    for (k, v) in &kafka.properties {
        if OWNED.contains(&k.as_str()) {
            tracing::warn!(pipeline = %pipeline.name, property = %k, "ignoring a Kafka property the worker sets itself");
        } else {
            config.set(k, v.to_string());
        }
    }
    config
        .set("group.id", &spec(pipeline).group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    config
}

/// `message.max.bytes` as set in `[kafka.properties]` (librdkafka's default, 1,000,000, otherwise).
fn max_message_bytes(kafka: &KafkaSettings) -> usize {
    kafka.properties.get("message.max.bytes").and_then(|v| v.to_string().parse().ok()).unwrap_or(1_000_000)
}

/// Checks that librdkafka accepts the consumer configuration of `pipeline` (unknown properties, bad values),
/// without connecting. The error never contains a property's value ([`hide_config_value`]).
pub fn check_properties(kafka: &KafkaSettings, pipeline: &SourceContext) -> KafkaResult<()> {
    consumer_config(kafka, pipeline).create_native_config().map(drop).map_err(hide_config_value)
}

/// A librdkafka configuration error without the property's value, which may be a password (`sasl.password`):
/// the value is removed from librdkafka's description too, and an unknown property gets the closest known name
/// as a hint. Other errors are returned as they are.
pub fn hide_config_value(e: KafkaError) -> KafkaError {
    match e {
        KafkaError::ClientConfig(result, description, key, value) => {
            let mut description = crate::secret::scrub(&description, &value);
            if result == rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN {
                let known = librdkafka_properties();
                if let Some(near) = crate::secret::closest(&key, known.iter().map(String::as_str)) {
                    description.push_str(&format!(" (did you mean \"{near}\"?)"));
                }
            }
            KafkaError::ClientConfig(result, description, key, "(value not shown)".to_owned())
        }
        other => other,
    }
}

/// The names of every librdkafka configuration property, from librdkafka's own table
/// (`rd_kafka_conf_properties_show`, the CONFIGURATION.md table: one `name | C/P | ...` row per property, aliases
/// included), written to a temporary file and read back.
fn librdkafka_properties() -> Vec<String> {
    let mut table = Vec::new();
    // SAFETY: `tmpfile` returns an open stream or null; it is written by librdkafka, rewound, read into `table`
    // with a bounded buffer, and closed (which also deletes it).
    unsafe {
        let file = libc::tmpfile();
        if file.is_null() {
            return Vec::new();
        }
        rdkafka::bindings::rd_kafka_conf_properties_show(file);
        libc::rewind(file);
        let mut buf = [0u8; 8192];
        loop {
            let n = libc::fread(buf.as_mut_ptr().cast(), 1, buf.len(), file);
            if n == 0 {
                break;
            }
            table.extend_from_slice(&buf[..n]);
        }
        libc::fclose(file);
    }
    String::from_utf8_lossy(&table)
        .lines()
        .filter_map(|line| line.split('|').next())
        .map(str::trim)
        .filter(|name| !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '_'))
        .map(str::to_owned)
        .collect()
}

/// A Kafka client error for a person: a configuration error as `kafka.properties."KEY": WHAT` (never the value,
/// see [`hide_config_value`]), anything else as the client says it.
pub fn describe_kafka_error(e: &KafkaError) -> String {
    match e {
        KafkaError::ClientConfig(_, description, key, _) => format!("kafka.properties.\"{key}\": {description}"),
        other => other.to_string(),
    }
}

/// Settings of `pipeline` that work against each other, each as one sentence naming the settings (`check` prints
/// them as warnings). Unset librdkafka properties count with librdkafka's defaults (`session.timeout.ms` 45000,
/// `heartbeat.interval.ms` 3000). (`max.poll.interval.ms` below `session.timeout.ms` is refused by librdkafka
/// itself; a slow database cannot exceed the poll interval, see the module documentation.)
pub fn timing_warnings(settings: &crate::source::Brokers, pipeline: &SourceContext) -> Vec<String> {
    let config = consumer_config(&settings.kafka, pipeline);
    let ms = |key: &str, default: u64| config.get(key).and_then(|v| v.parse::<u64>().ok()).unwrap_or(default);
    let (session, heartbeat) = (ms("session.timeout.ms", 45_000), ms("heartbeat.interval.ms", 3_000));
    let name = &pipeline.name;
    let mut out = Vec::new();
    if heartbeat * 3 > session {
        out.push(format!(
            "pipeline {name:?}: heartbeat.interval.ms = {heartbeat} is more than a third of session.timeout.ms = \
             {session}: one late heartbeat can expire the member and force a rebalance (Kafka's guidance: at most a third)"
        ));
    }
    let stop = settings.shutdown_timeout;
    if stop <= LEAVE_TIMEOUT {
        out.push(format!(
            "[shutdown] timeout = {stop:?} leaves no time after the {LEAVE_TIMEOUT:?} the consumer may wait to leave \
             its group: a clean stop can end in exit status 1 (nothing is lost)"
        ));
    }
    out
}

/// Why `check` refuses a pipeline's Kafka side.
#[derive(Debug, thiserror::Error)]
pub enum TopicCheckError {
    /// No broker answered a metadata request within the timeout.
    #[error("cannot reach Kafka at {servers}: {source}")]
    Unreachable {
        /// `bootstrap.servers`.
        servers: String,
        /// The client's error.
        source: KafkaError,
    },
    /// A topic the pipeline consumes is not in the cluster's metadata.
    #[error("topic {0:?} does not exist")]
    Missing(String),
}

/// Asks the cluster for the pipeline's topics with the consumer's own configuration (TLS, SASL included) and
/// waits at most `timeout` (the client's metadata request: Kafka protocol, Metadata). Blocking: call it from a
/// blocking context.
///
/// Errors: [`TopicCheckError`] for an unreachable cluster (or one that refuses the configuration) and for each
/// missing topic, the first found.
pub fn check_topics(kafka: &KafkaSettings, pipeline: &SourceContext, timeout: Duration) -> Result<(), TopicCheckError> {
    let unreachable = |source| TopicCheckError::Unreachable { servers: kafka.bootstrap_servers.clone(), source: hide_config_value(source) };
    let consumer: BaseConsumer = consumer_config(kafka, pipeline).create().map_err(unreachable)?;
    let metadata = consumer.fetch_metadata(None, timeout).map_err(unreachable)?;
    for topic in &spec(pipeline).topics {
        let found = metadata.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty());
        if !found {
            return Err(TopicCheckError::Missing(topic.clone()));
        }
    }
    Ok(())
}

/// One shared `Arc<str>` per topic name, so records do not each allocate their topic.
fn intern(topics: &mut HashMap<String, Arc<str>>, name: &str) -> Arc<str> {
    if let Some(t) = topics.get(name) {
        return t.clone();
    }
    let t: Arc<str> = Arc::from(name);
    topics.insert(name.to_owned(), t.clone());
    t
}

/// Takes the partitions revoked since the last look (empty when there are none).
fn take_revoked(state: &Mutex<Ownership>) -> HashSet<Tp> {
    let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
    st.revoked.drain(..).collect()
}

/// Removes the records of `revoked` partitions from each of `buffers`, logging how many.
fn drop_records_of(revoked: &HashSet<Tp>, pipeline: &str, buffers: &mut [&mut Vec<Record>]) {
    if revoked.is_empty() {
        return;
    }
    let mut dropped = 0;
    for buffer in buffers.iter_mut() {
        let before = buffer.len();
        buffer.retain(|r| !revoked.contains(&(r.position.topic.clone(), r.position.partition)));
        dropped += before - buffer.len();
    }
    if dropped > 0 {
        tracing::info!(pipeline = %pipeline, dropped, "dropped buffered records of revoked partitions before processing");
    }
}

/// Drops the records of partitions revoked since the last look from a batch being collected and the kept records:
/// the partition's next owner (maybe this consumer again, from the committed offset) will receive them.
fn drop_revoked(state: &Mutex<Ownership>, pipeline: &str, batch: &mut Vec<Record>, stash: &mut Vec<Record>) {
    drop_records_of(&take_revoked(state), pipeline, &mut [batch, stash]);
}

/// Drops the kept records of partitions revoked since the last look and remembers those partitions in `in_flight`
/// (for the batch in flight; see [`KafkaSource::poll_while`]).
fn drop_revoked_from(state: &Mutex<Ownership>, pipeline: &str, stash: &mut Vec<Record>, in_flight: &mut HashSet<Tp>) {
    let revoked = take_revoked(state);
    drop_records_of(&revoked, pipeline, &mut [stash]);
    in_flight.extend(revoked);
}

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

/// The shortest time a partition given up after a fenced batch stays given up before this worker claims it again
/// while the group still assigns it here ([`KafkaSource::fenced_for`] is the group's session timeout when longer):
/// with a short session timeout, two workers that both believe they hold a partition fence each other at most
/// every few seconds.
pub const FENCED_FOR_MIN: Duration = Duration::from_secs(10);

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
        pipeline: &SourceContext,
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
        })
    }

    /// Waits for the next batch: at least one record, then up to `max_records`, for at most `max_wait` after the
    /// first; an empty batch after [`HOUSEKEEPING_EVERY`] without a record (the worker's idle moment). Returns `None`
    /// once `shutdown` is triggered while waiting for a first record; a batch being filled when shutdown comes is
    /// returned as it is, to be finished.
    pub async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
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
    pub async fn pause_for(&mut self, delay: Duration, batch: &mut Vec<Record>, shutdown: &mut Shutdown) -> bool {
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
    pub fn positions(&self, next: &NextOffsets) -> Option<Positions> {
        self.consumer.context().stored.as_ref()?;
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Some(Positions::new(next, |t, p| st.epochs.get(&(t.clone(), p)).copied()))
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
    pub async fn poll_while<T>(&mut self, mut work: tokio::task::JoinHandle<T>, received: &mut (dyn FnMut(&Record) + Send)) -> T {
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
    pub fn drop_revoked(&mut self, batch: &mut Vec<Record>) {
        self.drop_revoked_in_flight(batch);
        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
    }

    fn drop_revoked_in_flight(&mut self, batch: &mut Vec<Record>) {
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

    /// Gives up partitions whose stored positions another worker has claimed (a fenced batch): they count as
    /// revoked (buffered records are dropped, no offset is committed for them) and consumption of them stays
    /// paused (retries do not resume them) until the group assigns them to this worker again, which claims them
    /// anew, or until [`KafkaSource::fenced_for`] has passed while the group still assigns them here: they are then
    /// claimed again and resumed ([`KafkaSource::reclaim_fenced`]; under a cooperative assignor a partition that does
    /// not move is not assigned again, and a claim that fenced this worker may have come late from a worker that no
    /// longer holds the partition). Their records are removed from `batch` too.
    ///
    /// A partition that this worker itself claimed again while the batch was in flight (a rebalance that revoked
    /// and re-assigned it; `used` holds the epochs the batch presented) is not given up: only the batch's records
    /// of it are dropped, and they come again from the stored position the new claim started it at.
    pub fn lose(&mut self, partitions: &[(String, i32)], used: Option<&Positions>, batch: &mut Vec<Record>) {
        let mut pause = TopicPartitionList::new();
        let until = Instant::now() + self.fenced_for;
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            for (t, p) in partitions {
                let tp = tp_of(t, *p);
                let presented = used.and_then(|u| u.0.iter().find(|(ut, up, _, _)| **ut == **t && up == p)).map(|u| u.3);
                let reclaimed = st.assigned.contains(&tp) && st.epochs.get(&tp).is_some_and(|e| Some(*e) != presented);
                if reclaimed {
                    // Only the batch's records: what was kept since the new claim follows its stored position.
                    self.revoked_in_flight.insert(tp);
                    continue;
                }
                st.give_up(tp.clone());
                st.fenced.insert(tp, until);
                pause.add_partition(t, *p);
                self.metrics.offset_commit(CommitResult::Fenced);
                // Its stall clock goes on: its records wait, and nothing applies them until it is claimed again
                // (a claim that keeps failing shows as a stall; [`KafkaSource::refresh_lag`] keeps it up to date).
            }
            self.metrics.assigned_partitions(st.assigned.len());
        }
        self.drop_revoked_in_flight(batch);
        if pause.count() > 0 {
            tracing::warn!(pipeline = %self.pipeline, partitions = %describe(&pause),
                "fenced: another worker claimed these partitions; dropping their records");
            if let Err(e) = self.consumer.pause(&pause) {
                tracing::debug!(pipeline = %self.pipeline, error = %e, "pausing fenced partitions failed");
            }
        }
        drop_revoked(&self.state, &self.pipeline, batch, &mut self.stash);
    }

    /// The partitions assigned to this consumer now.
    pub fn owned(&self) -> Vec<(String, i32)> {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.assigned.iter().map(|(t, p)| (t.to_string(), *p)).collect()
    }

    /// Starts partitions again from positions claimed anew (`claimed`), after the store lost positions this worker
    /// had stored (Redis after a crash that lost its last writes; see [`crate::store::redis`]): takes the new epochs,
    /// drops the buffered records of these partitions from `batch` and the kept records, and seeks the consumer to
    /// the stored positions, so what the store lost is consumed and applied again.
    ///
    /// Errors: a seek librdkafka refused (the partition is then left as it was; the caller stops the pipeline).
    pub fn resync(&mut self, claimed: &[offsets::Claimed], batch: &mut Vec<Record>) -> Result<(), String> {
        let mut moved = HashSet::new();
        let mut gone = HashSet::new();
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            for c in claimed {
                let tp = tp_of(&c.topic, c.partition);
                if !st.assigned.contains(&tp) {
                    // Revoked (or given up after a fence) while the claim ran: not this worker's to start. If the
                    // claim fenced the partition's owner, that owner claims it again (see the module documentation).
                    gone.insert(tp.clone());
                    moved.insert(tp);
                    continue;
                }
                st.epochs.insert(tp.clone(), c.epoch);
                if let Some(next) = c.next_offset {
                    st.durable.insert(tp.clone(), next);
                }
                moved.insert(tp);
            }
        }
        drop_records_of(&moved, &self.pipeline, &mut [batch, &mut self.stash]);
        for c in claimed {
            if gone.contains(&tp_of(&c.topic, c.partition)) {
                tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition,
                    "claimed again a partition no longer assigned here (revoked meanwhile): leaving it to its owner");
                continue;
            }
            let Some(next) = c.next_offset else { continue };
            tokio::task::block_in_place(|| self.consumer.seek(&c.topic, c.partition, Offset::Offset(next), Duration::from_secs(10)))
                .map_err(|e| format!("cannot seek {}/{} to {next}: {e}", c.topic, c.partition))?;
            tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, offset = next,
                "consuming the partition again from the position the store kept");
        }
        Ok(())
    }

    /// Moves partitions on to their processed floors (from a committed batch that ended below them: the group started
    /// over below what this pipeline had processed): drops the records kept of them, seeks the consumer to the floor
    /// and commits it to the group, so a group whose offsets expired fetches one batch below the floor, not the whole
    /// topic, and says so. Left as they are, fetched and skipped record by record as before: a partition not owned
    /// (revoked, fenced) or already fetched up to its floor; one whose log does not reach its floor (a seek past the
    /// end would send the consumer back to `auto.offset.reset` again and again); and one holding a record below its
    /// floor produced after the mark was last raised, or whose broker does not say (a topic created again, or a log
    /// truncated and refilled, that the batch did not show: each batch is judged on its records, as
    /// [`offsets::Replay`] says). A seek librdkafka refuses is logged and left the same way.
    pub fn skip_to_floors(&mut self, floors: &[offsets::PassedFloor]) {
        let fetched = self.fetch_positions();
        let mut moved: Vec<&offsets::PassedFloor> = {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            floors
                .iter()
                .filter(|f| {
                    let tp = tp_of(&f.topic, f.partition);
                    st.assigned.contains(&tp) && !st.fenced.contains_key(&tp) && fetched.get(&tp).is_none_or(|at| *at < f.floor)
                })
                .collect()
        };
        let dated: Vec<(&str, i32, i64)> =
            moved.iter().filter_map(|f| Some((&*f.topic, f.partition, f.raised_at_ms?.saturating_add(1)))).collect();
        let later = if dated.is_empty() { None } else { self.first_at_or_after(&dated) };
        moved.retain(|f| {
            let tp = tp_of(&f.topic, f.partition);
            let nothing_newer = later.as_ref().and_then(|m| m.get(&tp)).is_some_and(|first| first.is_none_or(|o| o >= f.floor));
            let high = self.cached_high_watermark(&f.topic, f.partition).or_else(|| {
                tokio::task::block_in_place(|| self.consumer.fetch_watermarks(&f.topic, f.partition, LOOKUP_TIMEOUT)).ok().map(|(_, high)| high)
            });
            nothing_newer && high.is_some_and(|high| f.floor <= high)
        });
        if moved.is_empty() {
            return;
        }
        // Everything kept of these partitions lies below the consumer's position, so below the floor.
        let parts: HashSet<Tp> = moved.iter().map(|f| tp_of(&f.topic, f.partition)).collect();
        drop_records_of(&parts, &self.pipeline, &mut [&mut self.stash]);
        let mut tpl = TopicPartitionList::new();
        for f in moved {
            let (topic, partition, floor) = (&*f.topic, f.partition, f.floor);
            match tokio::task::block_in_place(|| self.consumer.seek(topic, partition, Offset::Offset(floor), Duration::from_secs(10))) {
                Ok(()) => {
                    let _ = tpl.add_partition_offset(topic, partition, Offset::Offset(floor));
                    self.state.lock().unwrap_or_else(PoisonError::into_inner).durable.insert(tp_of(topic, partition), floor);
                    tracing::warn!(pipeline = %self.pipeline, topic, partition, floor,
                        "the consumer group started over below where this pipeline had processed (its offsets expired or \
                         were reset, a new group_id): moving on to the processed floor without fetching the records \
                         below it; `idemflow rewind` is the way to consume them again");
                }
                Err(e) => tracing::warn!(pipeline = %self.pipeline, topic, partition, floor, error = %e,
                    "cannot move the consumer on to the processed floor: fetching the records below it to skip them"),
            }
        }
        if tpl.count() > 0 {
            self.commit_list(&tpl);
        }
    }

    /// Commits `next` for the partitions still owned, synchronously, and counts the outcome. A failure is logged
    /// and counted, never fatal: the records are redelivered and skipped as duplicates.
    pub fn commit(&mut self, next: &NextOffsets) {
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

    /// Assigns the partitions of a finished claim from their stored positions (the assign call librdkafka waits
    /// for); after a shutdown during the claim, assigns nothing. Does nothing while no claim has finished.
    fn finish_claim(&mut self) {
        self.finish_reclaim();
        let claiming = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &st.claiming {
                Some(c) if c.outcome.is_some() => st.claiming.take(),
                _ => None,
            }
        };
        let Some(claiming) = claiming else { return };
        let claimed = claiming.outcome.flatten();
        let mut tpl = TopicPartitionList::new();
        if let Some(claimed) = &claimed {
            // Asked of the broker before the state is locked: the lookups wait for its answers.
            let starts: Vec<(&offsets::Claimed, Option<Offset>)> = claimed.iter().zip(self.stored_starts(claimed)).collect();
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            for (topic, partition) in &claiming.partitions {
                tpl.add_partition(topic, *partition);
                if let Some((c, start)) = starts.iter().find(|(c, _)| c.topic == *topic && c.partition == *partition) {
                    if let Some(start) = start {
                        let _ = tpl.set_partition_offset(topic, *partition, *start);
                    }
                    st.epochs.insert(tp_of(topic, *partition), c.epoch);
                }
            }
        }
        let consumer = &self.consumer;
        let r = if claiming.cooperative { consumer.incremental_assign(&tpl) } else { consumer.assign(&tpl) };
        match r {
            Ok(()) if tpl.count() > 0 => consumer.context().assigned(consumer, &tpl),
            Ok(()) => tracing::info!(pipeline = %self.pipeline, "shutting down before the claim finished: taking no partitions"),
            Err(e) => tracing::warn!(pipeline = %self.pipeline, error = %e, "applying the rebalance failed"),
        }
    }

    /// `[offsets] store = "database"`: starts a new claim of the partitions given up after a fenced batch whose
    /// [`KafkaSource::fenced_for`] is over, among those the group still assigns here (checked just before: the
    /// consumer's assignment, not lost), as a task that retries while the store is down, like an assignment's claim;
    /// [`KafkaSource::finish_reclaim`] takes them back. One at a time, and not while an assignment's claim is
    /// pending. A revoke drops it.
    fn reclaim_fenced(&self) {
        let Some(stored) = self.consumer.context().stored.as_ref() else { return };
        let now = Instant::now();
        {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if st.reclaiming.is_some() || st.claiming.is_some() || !st.fenced.values().any(|at| now >= *at) {
                return;
            }
        }
        // A lost assignment (the session expired) is about to be revoked: nothing of it is claimed.
        if self.consumer.assignment_lost() {
            return;
        }
        let Ok(assignment) = self.consumer.assignment() else { return };
        let held = partitions_in(&assignment);
        // Held until the claim is registered below, so the task cannot record its outcome before it exists.
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.reclaiming.is_some() || st.claiming.is_some() {
            return;
        }
        // A fenced partition the consumer no longer holds is forgotten here: its lag and stall clock go with it.
        for (topic, partition) in st.fenced.keys().filter(|tp| !held.contains(*tp)) {
            self.metrics.forget_lag(topic, *partition);
        }
        let due = st.due_reclaims(now, &held);
        if due.is_empty() {
            return;
        }
        let parts: Vec<(String, i32)> = due.iter().map(|(t, p)| (t.to_string(), *p)).collect();
        let (store, pipeline, owner) = (stored.store.clone(), self.pipeline.clone(), stored.owner.clone());
        let (mut shutdown, done, state) = (stored.shutdown.clone(), self.consumer.context().claimed.clone(), self.state.clone());
        static RECLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = RECLAIMS.fetch_add(1, Ordering::SeqCst);
        let names: Vec<String> = parts.iter().map(|(t, p)| format!("{t}/{p}")).collect();
        tracing::info!(pipeline = %self.pipeline, partitions = %names.join(","), after = ?self.fenced_for,
            "still assigned after being fenced: claiming the partitions again");
        let task = stored.runtime.spawn(async move {
            let waiting = "cannot claim the fenced partitions again; retrying (they stay paused)";
            let claimed = claim_while_down(&store, &pipeline, &owner, &parts, &mut shutdown, waiting).await;
            // The outcome is recorded before the notification, so the source finds it when it wakes up.
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(r) = st.reclaiming.as_mut().filter(|r| r.id == id) {
                r.outcome = Some(claimed);
            }
            drop(st);
            done.notify_one();
        });
        st.reclaiming = Some(Reclaiming { id, task, outcome: None });
    }

    /// Takes back the partitions of a finished [`KafkaSource::reclaim_fenced`] still fenced and still assigned here
    /// (checked again now: one revoked, or assigned anew, meanwhile is left alone), each sought to its stored position
    /// (without one: the group's committed offset, else where `auto.offset.reset` starts it) under its new epoch, and
    /// resumed (unless a retry has consumption paused; its end resumes it). A partition the consumer cannot seek is
    /// claimed again a few seconds later. Does nothing while no such claim has finished.
    fn finish_reclaim(&mut self) {
        let reclaiming = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &st.reclaiming {
                Some(r) if r.outcome.is_some() => st.reclaiming.take(),
                _ => None,
            }
        };
        let Some(reclaiming) = reclaiming else { return };
        let Some(claimed) = reclaiming.outcome.flatten() else { return }; // shutdown came first
        let held = if self.consumer.assignment_lost() {
            HashSet::new()
        } else {
            self.consumer.assignment().map(|a| partitions_in(&a)).unwrap_or_default()
        };
        let (take, gone) = self.state.lock().unwrap_or_else(PoisonError::into_inner).reclaimable(&claimed, &held);
        for c in &gone {
            tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition,
                "claimed again a fenced partition no longer assigned here (revoked meanwhile): leaving it to its owner");
        }
        let starts = self.stored_starts(&take);
        for (c, start) in take.into_iter().zip(starts) {
            // Sent back to its log start (a topic created again): the stored position is not durable for it.
            let c = if start == Some(Offset::Beginning) { offsets::Claimed { next_offset: None, ..c } } else { c };
            let start = match start {
                Some(start) => Some(start),
                None => self.start_without_stored(&c.topic, c.partition),
            };
            let sought = match start {
                Some(offset) => tokio::task::block_in_place(|| {
                    self.consumer.seek(&c.topic, c.partition, offset, Duration::from_secs(10))
                })
                .map_err(|e| e.to_string()),
                None => Err("the group's committed offset could not be read".to_owned()),
            };
            if let Err(e) = sought {
                tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, error = %e,
                    "cannot move the consumer to the stored position of a fenced partition; claiming it again in a few seconds");
                let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(at) = st.fenced.get_mut(&tp_of(&c.topic, c.partition)) {
                    *at = Instant::now() + RESEEK_AFTER;
                }
                continue;
            }
            let (paused, owned) = {
                let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                st.retaken(&c);
                (st.paused, st.assigned.len())
            };
            self.metrics.assigned_partitions(owned);
            self.consumer.context().assignment_changed.store(true, Ordering::SeqCst);
            if !paused {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(&c.topic, c.partition);
                if let Err(e) = self.consumer.resume(&tpl) {
                    tracing::debug!(pipeline = %self.pipeline, error = %e, "resuming a partition claimed again failed");
                }
            }
            tracing::info!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, offset = ?c.next_offset,
                "claimed the fenced partition again: consuming it from its stored position");
        }
    }

    /// Each partition's first offset whose record's timestamp is `at_ms` or later (`(topic, partition, at_ms)` each),
    /// asked of the broker in one request (ListOffsets by timestamp, `offsets_for_times`): `None` for a partition
    /// without such a record. `None` altogether when the broker did not answer within [`LOOKUP_TIMEOUT`] (logged).
    fn first_at_or_after(&self, asks: &[(&str, i32, i64)]) -> Option<HashMap<Tp, Option<i64>>> {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition, at_ms) in asks {
            // offsets_for_times takes the timestamp in the offset field.
            tpl.add_partition_offset(topic, *partition, Offset::Offset(*at_ms)).ok()?;
        }
        match tokio::task::block_in_place(|| self.consumer.offsets_for_times(tpl, LOOKUP_TIMEOUT)) {
            Ok(list) => Some(
                list.elements()
                    .iter()
                    .map(|e| (tp_of(e.topic(), e.partition()), if let Offset::Offset(o) = e.offset() { Some(o) } else { None }))
                    .collect(),
            ),
            Err(e) => {
                tracing::info!(pipeline = %self.pipeline, error = %e, "the broker did not say which records are later than a time");
                None
            }
        }
    }

    /// Where each claimed partition with a stored position starts, in `claimed`'s order (`None` without one): at the
    /// stored position, unless everything the partition holds was produced after the position was stored
    /// ([`offsets::Claimed::stored_at_ms`]: its first record at or after that time is its log start) and lies
    /// partly below it. A partition holding nothing from before its stored position was written is not the one the
    /// position was stored for: the topic was deleted and created again (or its log truncated and refilled), and
    /// starting there would skip its records below the position. It then starts at its log start instead, said in
    /// a warning, and the processed marks decide record by record what was processed ([`offsets::Replay`]). The test
    /// asks that the partition hold nothing older, not merely one newer record, so that producers whose clocks run
    /// ahead of the store's (or records stamped with a later event time) do not send a partition back to its start
    /// at every assignment; a topic whose every record is stamped later than the time its position was stored is
    /// taken for created again. Lookups the broker does not answer within [`LOOKUP_TIMEOUT`] keep the stored
    /// positions. Two requests for all the partitions.
    fn stored_starts(&self, claimed: &[offsets::Claimed]) -> Vec<Option<Offset>> {
        let dated: Vec<(&str, i32, i64)> = claimed
            .iter()
            .filter_map(|c| Some((c.topic.as_str(), c.partition, c.stored_at_ms?.saturating_add(1))).filter(|_| c.next_offset.is_some()))
            .collect();
        let (later, start) = if dated.is_empty() {
            (None, None)
        } else {
            let log_start: Vec<(&str, i32, i64)> = dated.iter().map(|(t, p, _)| (*t, *p, 0)).collect();
            (self.first_at_or_after(&dated), self.first_at_or_after(&log_start))
        };
        claimed
            .iter()
            .map(|c| {
                let next = c.next_offset?;
                let tp = tp_of(&c.topic, c.partition);
                let first_later = later.as_ref().and_then(|m| m.get(&tp).copied().flatten());
                let log_start = start.as_ref().and_then(|m| m.get(&tp).copied().flatten());
                match (first_later, log_start) {
                    (Some(first_later), Some(log_start)) if first_later == log_start && first_later < next => {
                        tracing::warn!(pipeline = %self.pipeline, topic = %c.topic, partition = c.partition, stored = next,
                            log_start, "every record of the partition was produced after its position was stored, some below \
                             it: the topic was deleted and created again (or its log truncated and refilled), and the stored \
                             position is the old topic's; consuming it from its start, where the processed marks tell what was \
                             processed");
                        Some(Offset::Beginning)
                    }
                    _ => Some(Offset::Offset(next)),
                }
            })
            .collect()
    }

    /// Where a partition without a stored position starts: the group's committed offset, else where
    /// `auto.offset.reset` starts it. `None` when the committed offset could not be read.
    fn start_without_stored(&self, topic: &str, partition: i32) -> Option<Offset> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        let committed = tokio::task::block_in_place(|| self.consumer.committed_offsets(tpl, LOOKUP_TIMEOUT)).ok()?;
        Some(match committed.find_partition(topic, partition).map(|e| e.offset()) {
            Some(Offset::Offset(next)) => Offset::Offset(next),
            _ if self.reset_to_earliest => Offset::Beginning,
            _ => Offset::End,
        })
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

    /// Drops the consumer without committing anything (an injected crash): no callback commits while it closes.
    pub fn abandon(self) {
        self.consumer.context().closing.store(true, Ordering::SeqCst);
        tokio::task::block_in_place(|| drop(self.consumer));
    }

    /// Commits every durable position synchronously, then leaves the group (closing the consumer). Leaving waits
    /// at most [`LEAVE_TIMEOUT`]: librdkafka's close can wait for a rebalance that other members are slow to
    /// complete (one that was just killed, for instance); past that the coordinator expires this member's session
    /// instead.
    pub fn close(self) {
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

/// How long [`KafkaSource::close`] waits for the consumer to leave its group.
pub const LEAVE_TIMEOUT: Duration = Duration::from_secs(8);

/// Each topic's `retention.ms`, `segment.ms` and `cleanup.policy` (Kafka topic configs), read with the admin API's
/// DescribeConfigs; a value the broker did not return is `None`.
///
/// Errors: the broker is unreachable or does not support DescribeConfigs (librdkafka's mock cluster does not).
pub async fn topic_retention(kafka: &KafkaSettings, topics: &[String]) -> KafkaResult<Vec<(String, crate::retention::TopicRetention)>> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.bootstrap_servers);
    for (k, v) in &kafka.properties {
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") {
            config.set(k, v.to_string());
        }
    }
    let admin: AdminClient<DefaultClientContext> = config.create().map_err(hide_config_value)?;
    let specs: Vec<ResourceSpecifier<'_>> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(5)));
    let results = admin.describe_configs(&specs, &options).await?;
    let mut out = Vec::new();
    for (topic, result) in topics.iter().zip(results) {
        let r = result.ok();
        let value = |name: &str| r.as_ref().and_then(|r| r.get(name).and_then(|e| e.value.clone()));
        let number = |name: &str| value(name).and_then(|v| v.parse::<i64>().ok());
        let kept = crate::retention::TopicRetention {
            retention_ms: number("retention.ms"),
            segment_ms: number("segment.ms"),
            cleanup_policy: value("cleanup.policy"),
        };
        out.push((topic.clone(), kept));
    }
    Ok(out)
}

/// Copies a message out of the consumer into a [`Record`]. `topic` is the interned topic name of the message; a
/// value over `max_payload_bytes` is kept as [`crate::record::bounded`] says.
pub fn to_record(message: &rdkafka::message::BorrowedMessage<'_>, topic: Arc<str>, max_payload_bytes: usize) -> Record {
    use rdkafka::message::{Headers, Message};
    let headers = message
        .headers()
        .map(|hs| hs.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
        .unwrap_or_default();
    Record {
        position: crate::record::Position { topic, partition: message.partition(), offset: message.offset() },
        timestamp_ms: message.timestamp().to_millis(),
        key: message.key().map(<[u8]>::to_vec),
        headers,
        payload: None,
        oversized: None,
        properties: Vec::new(),
        delivered_before: None,
        receipt: crate::record::Receipt::next(),
    }
    .with_payload(message.payload(), max_payload_bytes)
}

/// Compares `dedup_retention` with what each of `topics` can keep (`retention.ms` + `segment.ms`, and whether it is
/// compacted; read within 8 s): one line per topic, or `warning: ...` lines where the dedup rows could be purged
/// before the broker drops the records they guard, or where the broker did not say.
pub async fn retention_report(kafka: &KafkaSettings, pipeline: &str, topics: &[String], dedup_retention: Duration) -> Vec<String> {
    let read = tokio::time::timeout(Duration::from_secs(8), topic_retention(kafka, topics)).await;
    match read {
        Ok(Ok(topics)) => topics
            .into_iter()
            .flat_map(|(topic, kept)| {
                if kept.retention_ms.is_none() {
                    return vec![format!("warning: pipeline {pipeline:?}: topic {topic:?}: the broker did not return retention.ms")];
                }
                let warnings = crate::retention::window_warnings(pipeline, &topic, &kept, dedup_retention);
                if warnings.is_empty() {
                    vec![format!(
                        "pipeline {pipeline:?}: topic {topic:?}: dedup retention covers what the topic can keep (retention.ms + segment.ms)"
                    )]
                } else {
                    warnings.into_iter().map(|w| format!("warning: {w}")).collect()
                }
            })
            .collect(),
        Ok(Err(e)) => vec![format!(
            "warning: pipeline {pipeline:?}: could not read the topics' retention.ms to compare with [dedup] retention: {e}"
        )],
        Err(_) => vec![format!("warning: pipeline {pipeline:?}: could not read the topics' retention.ms (no answer from Kafka in 8 s)")],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offsets::Claimed;

    fn claimed(partition: i32, next_offset: Option<i64>, epoch: i64) -> Claimed {
        Claimed { topic: "t".into(), partition, next_offset, epoch, stored_at_ms: None }
    }

    /// Owns `partitions` under epoch 1, then is fenced on them until `until` (as [`KafkaSource::lose`] does).
    fn fenced(partitions: &[i32], until: Instant) -> Ownership {
        let mut st = Ownership::default();
        for p in partitions {
            let tp = tp_of("t", *p);
            st.assigned.insert(tp.clone());
            st.epochs.insert(tp.clone(), 1);
            let _ = st.give_up(tp.clone());
            st.fenced.insert(tp, until);
        }
        st.revoked.clear();
        st
    }

    /// A late claim from a worker that no longer holds partition 0 fenced this worker, which the group still
    /// assigns it to: once its time is over it claims it again and takes it back (before, it stayed paused until
    /// its next rebalance).
    #[test]
    fn a_fenced_partition_still_assigned_here_is_claimed_again_once_its_time_is_over() {
        let t0 = Instant::now();
        let mut st = fenced(&[0], t0 + FENCED_FOR_MIN);
        let p0 = tp_of("t", 0);
        let held: HashSet<Tp> = [p0.clone()].into_iter().collect();
        assert!(st.due_reclaims(t0, &held).is_empty(), "not before its time");
        assert_eq!(st.due_reclaims(t0 + FENCED_FOR_MIN, &held), vec![p0.clone()]);
        assert!(st.fenced.contains_key(&p0), "paused until taken back");
        let (take, gone) = st.reclaimable(&[claimed(0, Some(120), 3)], &held);
        assert_eq!((take.clone(), gone), (vec![claimed(0, Some(120), 3)], vec![]));
        assert_eq!(st.retaken(&take[0]), p0);
        assert!(st.assigned.contains(&p0) && st.fenced.is_empty());
        assert_eq!((st.epochs[&p0], st.durable[&p0], st.commit_pending), (3, 120, true));
    }

    /// A partition is claimed again only while the consumer holds it, checked before the claim and after it: one
    /// revoked before its time is forgotten (its next assignment claims it), and a claim whose partition was revoked
    /// (or revoked and assigned again) while it ran is not taken.
    #[test]
    fn a_partition_no_longer_assigned_here_is_neither_claimed_again_nor_taken_back() {
        let t0 = Instant::now();
        let due = t0 + FENCED_FOR_MIN;
        let (p0, p1) = (tp_of("t", 0), tp_of("t", 1));
        // Before: no longer held.
        let mut st = fenced(&[0, 1], due);
        let only_p1: HashSet<Tp> = [p1.clone()].into_iter().collect();
        assert_eq!(st.due_reclaims(due, &only_p1), vec![p1.clone()]);
        assert!(!st.fenced.contains_key(&p0), "forgotten: not held");
        // After: revoked while the claim ran (the revoke gives it up, which ends its fence).
        let _ = st.give_up(p1.clone());
        let (take, gone) = st.reclaimable(&[claimed(1, Some(7), 4)], &only_p1);
        assert_eq!((take.len(), gone.len()), (0, 1));
        // After: still fenced, but no longer in the consumer's assignment.
        let mut st = fenced(&[0], due);
        let (take, gone) = st.reclaimable(&[claimed(0, Some(7), 4)], &HashSet::new());
        assert_eq!((take.len(), gone.len()), (0, 1));
        assert!(st.due_reclaims(due, &HashSet::new()).is_empty());
        // Assigned again (the assignment's own claim takes it): no longer fenced, so the late answer is not taken.
        let mut st = fenced(&[0], due);
        st.fenced.remove(&p0);
        st.assigned.insert(p0.clone());
        let held: HashSet<Tp> = [p0.clone()].into_iter().collect();
        let (take, _) = st.reclaimable(&[claimed(0, Some(7), 4)], &held);
        assert!(take.is_empty());
    }
}
