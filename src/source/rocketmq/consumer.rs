//! The RocketMQ source of one pipeline ([`crate::source::Source::RocketMq`]): a member of a consumer group in
//! clustering mode (the group's queues are shared among its workers), read with the `rocketmq-client-rust` lite
//! pull consumer, whose consume offsets are updated only after a batch commits.
//!
//! - A record's position is (`topic/broker`, queue id, queue offset) ([`crate::record::Position`]): a RocketMQ
//!   queue is named by its topic, broker and queue id, and its queue offsets number its messages in order. So
//!   `redelivered` / `republished` / `payload_mismatch` mean what they mean for Kafka, and a replay is a redelivery.
//! - Auto-commit is off. After a batch committed in the store, [`RocketMqSource::commit`] sets each queue's consume
//!   offset to the highest offset of the batch plus one (RocketMQ's consume offset, like Kafka's, is the next
//!   message to consume) and sends it to the queue's broker with an acknowledged `UPDATE_CONSUMER_OFFSET` request,
//!   only for queues this worker still owns. A failure is logged, counted and retried between batches; the records
//!   would be redelivered and skipped as duplicates.
//! - Ownership: the client rebalances the group's queues among its members (every 20 s and whenever a member
//!   comes or goes, as the Java client does); before each poll the source compares the consumer's assignment with
//!   what it owned, drops the kept records of queues it lost, and never commits an offset for them. RocketMQ
//!   members rebalance independently, so two workers can briefly both hold a queue: without stored positions the
//!   dedup rows make that harmless; with `[offsets] store = "database"` the owner epochs fence it.
//! - With `[offsets] store = "database"`, a queue newly assigned is claimed in the store
//!   ([`crate::store::Store::claim_offsets`], retried while the store is down) and the consumer seeks to its
//!   stored position; records polled from it before the seek are dropped (the seek clears the client's buffer of
//!   that queue, and polls and seeks run one after another in this task). A queue given up after a fenced batch is
//!   paused in the client until it is claimed and sought again, however it comes back (still assigned once
//!   [`FENCED_FOR`] is over, or revoked and assigned again before that): that start resumes it.
//! - The client's heartbeats, pulls and rebalances run on a runtime of its own, so a slow database never makes
//!   the worker miss a heartbeat; while a batch waits, the client buffers at most its flow-control limits
//!   (1,000 messages per queue).
//!
//! A poll is never cancelled (a dropped poll could lose the messages it had taken from the client's buffer):
//! polls are short (at most [`POLL_MS`]) and shutdown is checked between them.


use super::spec::{spec, RocketMqContext, RocketMqSettings, RocketMqSpec};
use super::check::check;
use super::client::*;

use crate::batch::{BatchSettings, Records};
use crate::source::contract::{CheckError, Connector, StoredStart};
use crate::metrics::{CommitResult, PipelineMetrics, RebalanceEvent};
use crate::offsets::{self, NextOffsets, Positions};
use crate::record::{Position, Record};
use crate::shutdown::Shutdown;
use rocketmq_client_rust::DefaultLitePullConsumer;
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_protocol::protocol::heartbeat::message_model::MessageModel;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;


/// The longest single poll, in milliseconds: the bound on how late shutdown and a batch's `max_wait` are noticed.
pub const POLL_MS: u64 = 200;

/// How often the lag of every owned queue is refreshed (one `GET_MAX_OFFSET` request per queue).
const LAG_EVERY: Duration = Duration::from_secs(5);

/// After a fenced batch, how long a queue stays given up before this worker claims it again if the group still
/// assigns it here: longer than the client's periodic rebalance (20 s), so a worker whose view of the group was
/// stale has dropped the queue by then.
const FENCED_FOR: Duration = Duration::from_secs(30);

/// A queue: (`topic/broker`, queue id), as in [`Position`].
type Queue = (Arc<str>, i32);

/// How long a queue whose seek failed waits before it is claimed again.
const RESEEK_AFTER: Duration = Duration::from_secs(3);


/// The queues this source paused in the client, and those it gave up with when they may be claimed again
/// ([`RocketMqSource::lose`], [`RocketMqSource::start_from`]): bookkeeping only, no client calls, so its rule can be
/// tested. A pause is ended only by a start from a claimed position ([`Holds::started`]), whatever happens in
/// between: not by a revoke. The source may see a queue go and come back while the client keeps (or has already
/// renewed) its entry for it, and the pause after a fenced batch can land on the client's new entry of a queue
/// taken back while the batch was in flight; a queue claimed and sought with its pause still on would never be
/// pulled again (seen: two queues silent for 120 s until an unrelated rebalance).
#[derive(Debug, Default)]
struct Holds {
    /// Given up after a fenced batch or a failed seek, with when they may be claimed again.
    given_up: HashMap<Queue, Instant>,
    /// Paused in the client by this source and not resumed since.
    paused: HashSet<Queue>,
}

impl Holds {
    /// A fenced batch gave `q` up until `until` (a time already set is kept).
    fn fenced(&mut self, q: &Queue, until: Instant) {
        self.given_up.entry(q.clone()).or_insert(until);
    }

    /// `q` is being paused in the client. Returns `false` if it was already.
    fn pause(&mut self, q: &Queue) -> bool {
        self.paused.insert(q.clone())
    }

    /// A seek of `q` failed: it is claimed again at `at` (it is not paused for that: its records are dropped until
    /// it has an epoch again).
    fn retry_at(&mut self, q: &Queue, at: Instant) {
        self.given_up.insert(q.clone(), at);
    }

    /// `q` was revoked: no claim of it is due any more (if it is assigned again it is claimed then). A pause stays.
    fn revoked(&mut self, q: &Queue) {
        self.given_up.remove(q);
    }

    /// The queues given up whose time is over, given up no more: the caller claims those it still owns.
    fn due(&mut self, now: Instant) -> Vec<Queue> {
        let mut due: Vec<Queue> = self.given_up.iter().filter(|(_, at)| now >= **at).map(|(q, _)| q.clone()).collect();
        due.sort();
        for q in &due {
            self.given_up.remove(q);
        }
        due
    }

    /// `q` was started from a claimed position: it is given up no more. Returns whether it must be resumed in the
    /// client (this source paused it and has not resumed it since).
    fn started(&mut self, q: &Queue) -> bool {
        self.given_up.remove(q);
        self.paused.remove(q)
    }
}

/// Copies a polled message into a [`Record`]: payload (bounded), born timestamp, the properties `message_id`
/// (the producer's unique id, `UNIQ_KEY`, else the broker's message id), `keys` and `tags`, and the user
/// properties as headers, sorted by name (the client keeps them in a hash map; a stable order keeps payload
/// fingerprints stable).
fn record_of(m: &MessageExt, topic: Arc<str>, max_payload_bytes: usize) -> Record {
    let message = &m.message;
    let mut properties: Vec<(&'static str, String)> = Vec::new();
    let uniq = message.property("UNIQ_KEY").map(str::to_owned).unwrap_or_else(|| m.msg_id.to_string());
    properties.push((crate::record::MESSAGE_ID, uniq));
    if let Some(keys) = message.property("KEYS") {
        properties.push((crate::record::MESSAGE_KEYS, keys.to_owned()));
    }
    if let Some(tags) = message.tags() {
        properties.push((crate::record::MESSAGE_TAGS, tags.to_owned()));
    }
    let system = &rocketmq_model::common::message::STRING_HASH_SET;
    let mut headers: Vec<(String, Option<Vec<u8>>)> = message
        .properties()
        .as_map()
        .iter()
        .filter(|(k, _)| !system.contains(k.as_str()))
        .map(|(k, v)| (k.to_string(), Some(v.as_bytes().to_vec())))
        .collect();
    headers.sort();
    let born = if m.born_timestamp > 0 { m.born_timestamp } else { m.store_timestamp };
    Record {
        position: Position { topic, partition: m.queue_id, offset: m.queue_offset },
        timestamp_ms: (born > 0).then_some(born),
        key: None,
        headers,
        payload: None,
        oversized: None,
        properties,
        delivered_before: None,
        receipt: crate::record::Receipt::next(),
    }
    .with_payload(Some(message.body_slice()), max_payload_bytes)
}

/// Forwards each assignment the client computes to the source, so a queue dropped and assigned again between two
/// looks at the assignment is still seen as revoked (and claimed and sought again).
struct AssignmentEvents {
    topic: String,
    sender: tokio::sync::mpsc::UnboundedSender<HashSet<MessageQueue>>,
}

impl rocketmq_client_rust::MessageQueueListener for AssignmentEvents {
    fn message_queue_changed(&self, topic: &str, _all: &HashSet<MessageQueue>, assigned: &HashSet<MessageQueue>) {
        if topic == self.topic {
            let _ = self.sender.send(assigned.clone());
        }
    }
}

/// The queue of a record, as (`topic/broker`, queue id).
fn queue_of(r: &Record) -> Queue {
    (r.position.topic.clone(), r.position.partition)
}

/// A pipeline's RocketMQ consumer and what it owns.
pub struct RocketMqSource {
    pipeline: String,
    spec: RocketMqSpec,
    metrics: PipelineMetrics,
    max_payload_bytes: usize,
    runtime: Option<Runtime>,
    consumer: DefaultLitePullConsumer,
    /// Set until the consumer starts.
    listener: Option<Arc<AssignmentEvents>>,
    events: tokio::sync::mpsc::UnboundedReceiver<HashSet<MessageQueue>>,
    started: bool,
    fatal: Option<String>,
    /// The queues this worker owns, as of its last look at the consumer's assignment.
    owned: HashMap<Queue, MessageQueue>,
    /// `[offsets] store = "database"`: the owner epoch claimed for each owned queue. An owned queue without one
    /// (not claimed yet, or given up after a fence) hands out no record.
    epochs: HashMap<Queue, i64>,
    /// `[offsets] store = "database"`: queues assigned and not claimed yet.
    to_claim: Vec<Queue>,
    /// Queues given up after a fenced batch or a failed seek, with when they may be claimed again, and queues
    /// paused in the client after a fenced batch, until they start again from a claimed position.
    holds: Holds,
    /// Queues lost (revoked or fenced) while the batch in flight was being applied: no offset is committed for
    /// them and a retry drops their records.
    revoked_in_flight: HashSet<Queue>,
    /// Records polled and not yet handed out, in poll order.
    stash: Vec<Record>,
    topics: HashMap<String, Arc<str>>,
    stored: Option<StoredStart>,
    /// Consume offsets whose acknowledged update failed, retried between batches at most every second.
    unsent: HashMap<Queue, i64>,
    last_retry: Option<Instant>,
    /// Per owned queue, the consume offset last committed (for the lag, and never to send a lower one).
    committed: HashMap<Queue, i64>,
    last_lag: Option<Instant>,
}

/// What a RocketMQ pipeline is told without `[rocketmq]` in the settings.
const NAME_SERVER_NOT_SET: &str = "[rocketmq] name_server is not set";

impl Connector for RocketMqSource {
    type Spec = RocketMqSpec;

    fn open(settings: Option<&RocketMqSettings>, cx: &RocketMqContext, metrics: PipelineMetrics, stored: Option<StoredStart>) -> Result<Self, String> {
        RocketMqSource::new(settings.ok_or(NAME_SERVER_NOT_SET)?, cx, metrics, stored)
    }

    async fn check(settings: Option<&RocketMqSettings>, cx: &RocketMqContext) -> Result<Vec<String>, CheckError> {
        let settings = settings.ok_or_else(|| CheckError::Broker(NAME_SERVER_NOT_SET.to_owned()))?;
        check(settings, cx).await.map_err(CheckError::Broker)
    }

    async fn rewind(
        settings: Option<&RocketMqSettings>,
        cx: &RocketMqContext,
        file: &std::path::Path,
        request: crate::source::rewind::Request,
        store: Option<crate::source::rewind::StoreSide<'_>>,
    ) -> anyhow::Result<()> {
        super::rewind::run(settings, cx, file, request, store).await
    }

    /// The next batch: at least one record, at most `settings.max_records`, waiting at most `max_wait` after the
    /// first; an empty batch after a second without records; `None` on shutdown (or a consumer that cannot start,
    /// see [`RocketMqSource::fatal`]).
    async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        if !self.start().await {
            return None;
        }
        let idle_until = Instant::now() + Duration::from_secs(1);
        let mut deadline: Option<Instant> = None;
        loop {
            if shutdown.is_triggered() {
                return None;
            }
            self.housekeeping().await;
            if !self.follow_assignment(shutdown).await {
                return None;
            }
            if !self.stash.is_empty() {
                deadline.get_or_insert_with(|| Instant::now() + settings.max_wait);
            }
            let now = Instant::now();
            if self.stash.len() >= settings.max_records || deadline.is_some_and(|d| now >= d) {
                let n = self.stash.len().min(settings.max_records);
                // No batch is in flight now: what was lost while the last one was is settled.
                self.revoked_in_flight.clear();
                return Some(self.stash.drain(..n).collect());
            }
            if deadline.is_none() && now >= idle_until {
                return Some(Vec::new());
            }
            let until = deadline.unwrap_or(idle_until);
            let wait = until.saturating_duration_since(now).as_millis().clamp(1, u128::from(POLL_MS)) as u64;
            self.poll(wait).await;
        }
    }

    /// Waits `delay` before a retry (the client keeps its heartbeats and buffers at most its flow-control limits),
    /// then drops from `batch` the records of queues lost meanwhile. `false` if shutdown came first.
    async fn pause_for(&mut self, delay: Duration, batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.wait() => return false,
        }
        self.observe().await;
        self.drop_revoked(batch);
        true
    }

    /// The positions a batch stores (`[offsets] store = "database"`), with this worker's epochs.
    fn positions(&self, next: &NextOffsets) -> Option<Positions> {
        self.stored.as_ref()?;
        Some(Positions::new(next, |t, p| self.epochs.get(&(t.clone(), p)).copied()))
    }

    /// Runs `work` (the batch transaction) to its end. Nothing to poll meanwhile: the client serves its brokers
    /// (heartbeats, pulls into its buffer) on its own runtime.
    async fn poll_while<T: Send>(&mut self, work: tokio::task::JoinHandle<T>, _received: &mut (dyn FnMut(&Record) + Send)) -> T {
        work.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// Drops from `batch` the records of queues lost while it was in flight or since.
    fn drop_revoked(&mut self, batch: &mut dyn Records) {
        let lost = std::mem::take(&mut self.revoked_in_flight);
        batch.retain_records(&mut |r| {
            let q = queue_of(r);
            !lost.contains(&q) && self.ready(&q)
        });
    }

    /// Gives up queues whose stored positions another worker claimed (a fenced batch): their records are dropped
    /// from `batch` and the kept ones, the client stops pulling them, no offset is committed for them, and they are
    /// claimed again after [`FENCED_FOR`] if the group still assigns them here.
    async fn lose(&mut self, partitions: &[(String, i32)], used: Option<&Positions>, batch: &mut dyn Records) {
        let mut pause = Vec::new();
        for (t, p) in partitions {
            let q = (self.intern(t), *p);
            let presented = used.and_then(|u| u.0.iter().find(|(ut, up, _, _)| **ut == **t && up == p)).map(|u| u.3);
            if self.epochs.get(&q).is_some_and(|e| Some(*e) != presented) {
                // Claimed again by this worker while the batch was in flight: only the batch's records go (they
                // come again from the new claim's position).
                self.revoked_in_flight.insert(q);
                continue;
            }
            tracing::warn!(pipeline = %self.pipeline, queue = %t, id = p, "fenced: another worker claimed this queue; dropping its records");
            self.epochs.remove(&q);
            self.holds.fenced(&q, Instant::now() + FENCED_FOR);
            self.unsent.remove(&q);
            self.stash.retain(|r| queue_of(r) != q);
            if let Some(mq) = self.owned.get(&q) {
                // Paused until started again from a claimed position, however it is taken back.
                self.holds.pause(&q);
                pause.push(mq.clone());
            }
            self.revoked_in_flight.insert(q);
            self.metrics.offset_commit(CommitResult::Fenced);
        }
        if !pause.is_empty() {
            self.consumer.pause(pause).await;
        }
        let lost = &self.revoked_in_flight;
        batch.retain_records(&mut |r| !lost.contains(&queue_of(r)));
    }

    /// The queues this worker owns now, as (`topic/broker`, queue id).
    fn owned(&self) -> Vec<(String, i32)> {
        self.owned.keys().map(|(t, q)| (t.to_string(), *q)).collect()
    }

    /// Starts queues again from positions claimed anew after the store lost positions this worker had stored
    /// (see the sink's `SinkError::Lost`), dropping their records from `batch`. A queue the client cannot move
    /// now is claimed again a few seconds later.
    async fn resync(&mut self, claimed: &[offsets::Claimed], batch: &mut dyn Records) -> Result<(), String> {
        self.start_from(claimed).await;
        let moved: HashSet<(String, i32)> = claimed.iter().map(|c| (c.topic.clone(), c.partition)).collect();
        batch.retain_records(&mut |r| !moved.contains(&(r.position.topic.to_string(), r.position.partition)));
        Ok(())
    }

    /// Tells the brokers that `batch` is durable: each queue's consume offset becomes the highest offset of the
    /// batch plus one (`next`), sent with an acknowledged request. Queues lost while the batch was in flight
    /// (looked up again now) are skipped and counted (`skipped_not_owned`): a stale offset would move the new
    /// owner's position back.
    async fn commit(&mut self, _records: &[Record], next: &NextOffsets) {
        self.observe().await;
        let lost = std::mem::take(&mut self.revoked_in_flight);
        let mut send = HashMap::new();
        for ((t, p), offset) in &next.0 {
            let q = (t.clone(), *p);
            if lost.contains(&q) || !self.ready(&q) {
                self.metrics.offset_commit(CommitResult::SkippedNotOwned);
                continue;
            }
            send.insert(q, *offset);
        }
        self.send_offsets(send).await;
    }

    /// Why the pipeline must stop: the consumer could not start.
    fn fatal(&self) -> Option<String> {
        self.fatal.clone()
    }

    /// Ends without telling the brokers anything more (an injected crash): the client's tasks stop at once.
    async fn abandon(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.owner.shutdown_background();
        }
    }

    /// Ends cleanly: the consumer leaves its group (its consume offsets, all committed already, are flushed once
    /// more) and the client's runtime stops.
    async fn close(mut self) {
        if self.started && tokio::time::timeout(CLOSE_TIMEOUT, self.consumer.shutdown()).await.is_err() {
            tracing::warn!(pipeline = %self.pipeline, timeout = ?CLOSE_TIMEOUT,
                "the RocketMQ consumer did not stop in time; left to stop in the background (its consume offsets were sent after each batch)");
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown().await;
        }
    }
}

impl RocketMqSource {
    /// A consumer of `pipeline`'s topic in its consumer group (clustering, auto-commit off, starting a new group
    /// from each queue's first offset). It connects on the first [`RocketMqSource::next_batch`].
    ///
    /// Errors: the client runtime or the consumer could not be built, or only one of the ACL keys is set, as text.
    pub fn new(
        settings: &RocketMqSettings,
        pipeline: &RocketMqContext,
        metrics: PipelineMetrics,
        stored: Option<StoredStart>,
    ) -> Result<RocketMqSource, String> {
        let spec = spec(pipeline).clone();
        let runtime = Runtime::new(&pipeline.name)?;
        let max_records = pipeline.batch.max_records;
        // The client id is `ip@instance`, and a group's queues are shared by the position of each member's id in
        // the sorted member list: it must be unique even among containers that all run as PID 1 on one address.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let mut builder = DefaultLitePullConsumer::builder(runtime.client())
            .name_server_addr(settings.name_server.as_str())
            .consumer_group(spec.consumer_group.as_str())
            .instance_name(format!("idemflow-{}-{}-{nanos}", pipeline.name, std::process::id()))
            .message_model(MessageModel::Clustering)
            .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
            .auto_commit(false)
            .pull_batch_size(max_records.clamp(1, 1024) as i32)
            .poll_timeout_millis(POLL_MS);
        if let Some(hook) = acl_hook(settings)? {
            builder = builder.rpc_hook(hook);
        }
        let consumer = builder.build().map_err(|e| format!("cannot create the RocketMQ consumer: {e}"))?;
        let (sender, events) = tokio::sync::mpsc::unbounded_channel();
        Ok(RocketMqSource {
            pipeline: pipeline.name.clone(),
            listener: Some(Arc::new(AssignmentEvents { topic: spec.topic.clone(), sender })),
            spec,
            metrics,
            max_payload_bytes: pipeline.max_payload_bytes,
            runtime: Some(runtime),
            consumer,
            events,
            started: false,
            fatal: None,
            owned: HashMap::new(),
            epochs: HashMap::new(),
            to_claim: Vec::new(),
            holds: Holds::default(),
            revoked_in_flight: HashSet::new(),
            stash: Vec::new(),
            topics: HashMap::new(),
            stored,
            unsent: HashMap::new(),
            last_retry: None,
            committed: HashMap::new(),
            last_lag: None,
        })
    }

    /// Subscribes and starts the consumer once. A failure stops the pipeline ([`RocketMqSource::fatal`]).
    async fn start(&mut self) -> bool {
        if self.started {
            return true;
        }
        if let Some(listener) = self.listener.take() {
            self.consumer.set_message_queue_listener(Some(listener)).await;
        }
        let started = async {
            self.consumer.subscribe_with_expression(&self.spec.topic, &self.spec.tag_expression).await?;
            self.consumer.start().await
        }
        .await;
        match started {
            Ok(()) => {
                self.started = true;
                tracing::info!(pipeline = %self.pipeline, topic = %self.spec.topic, group = %self.spec.consumer_group,
                    tags = %self.spec.tag_expression, "RocketMQ consumer started");
                true
            }
            Err(e) => {
                self.fatal = Some(format!("cannot start the RocketMQ consumer of topic {:?}: {e}", self.spec.topic));
                false
            }
        }
    }

    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(t) = self.topics.get(name) {
            return t.clone();
        }
        let t: Arc<str> = Arc::from(name);
        self.topics.insert(name.to_owned(), t.clone());
        t
    }

    fn queue(&mut self, mq: &MessageQueue) -> Queue {
        (self.intern(&position_topic(mq.topic().as_str(), mq.broker_name().as_str())), mq.queue_id())
    }

    /// Whether records of `q` may be handed out: it is owned and, with stored positions, claimed (with an epoch).
    fn ready(&self, q: &Queue) -> bool {
        self.owned.contains_key(q) && (self.stored.is_none() || self.epochs.contains_key(q))
    }

    /// One poll of at most `wait_ms`, its records kept if their queue is ready ([`RocketMqSource::ready`]) after
    /// looking at the assignment again: a record of a queue not claimed yet comes again after its claim's seek;
    /// one of a queue no longer owned belongs to its new owner.
    async fn poll(&mut self, wait_ms: u64) {
        let messages = self.consumer.poll_with_timeout_zero_copy(wait_ms).await;
        if messages.is_empty() {
            return;
        }
        let records: Vec<Record> = messages
            .iter()
            .map(|m| {
                let topic = self.intern(&position_topic(m.message.topic().as_str(), m.broker_name.as_str()));
                record_of(m, topic, self.max_payload_bytes)
            })
            .collect();
        if records.iter().any(|r| !self.owned.contains_key(&queue_of(r))) {
            self.observe().await;
        }
        let before = records.len();
        let kept: Vec<Record> = records.into_iter().filter(|r| self.ready(&queue_of(r))).collect();
        if kept.len() != before {
            tracing::debug!(pipeline = %self.pipeline, dropped = before - kept.len(), "dropped records of queues not owned or not claimed yet");
        }
        self.stash.extend(kept);
    }

    /// Applies every assignment the client computed since the last look, then the current one: a queue missing
    /// from any of them is given up (even if it is back: the client started it again from the group's consume
    /// offset, so it is taken anew); a new queue is taken (and, with stored positions, queued for its claim).
    async fn observe(&mut self) {
        let mut views = Vec::new();
        while let Ok(view) = self.events.try_recv() {
            views.push(view);
        }
        match self.consumer.assignment().await {
            Ok(now) => views.push(now),
            Err(e) => tracing::debug!(pipeline = %self.pipeline, error = %e, "cannot read the consumer's assignment"),
        }
        for view in views {
            let mut now: HashMap<Queue, MessageQueue> = HashMap::new();
            for mq in view {
                if mq.topic().as_str() == self.spec.topic {
                    now.insert(self.queue(&mq), mq);
                }
            }
            let gone: Vec<Queue> = self.owned.keys().filter(|q| !now.contains_key(*q)).cloned().collect();
            if !gone.is_empty() {
                for q in &gone {
                    self.give_up(q);
                }
                self.metrics.rebalance(RebalanceEvent::Revoke);
                tracing::info!(pipeline = %self.pipeline, queues = %describe(&gone), "queues revoked");
            }
            let new: Vec<Queue> = now.keys().filter(|q| !self.owned.contains_key(*q)).cloned().collect();
            if !new.is_empty() {
                for q in &new {
                    self.owned.insert(q.clone(), now[q].clone());
                    if self.stored.is_some() {
                        self.to_claim.push(q.clone());
                    }
                }
                self.metrics.rebalance(RebalanceEvent::Assign);
                tracing::info!(pipeline = %self.pipeline, queues = %describe(&new), "queues assigned");
                self.last_lag = None;
            }
            if !gone.is_empty() || !new.is_empty() {
                self.metrics.assigned_partitions(self.owned.len());
            }
        }
    }

    /// Forgets a queue this worker no longer owns: its kept records, epoch, pending claim and offsets, its lag. A
    /// pause stays until the queue is started again ([`Holds`]).
    fn give_up(&mut self, q: &Queue) {
        self.owned.remove(q);
        self.epochs.remove(q);
        self.holds.revoked(q);
        self.to_claim.retain(|c| c != q);
        self.unsent.remove(q);
        self.committed.remove(q);
        self.metrics.forget_lag(&q.0, q.1);
        self.revoked_in_flight.insert(q.clone());
        self.stash.retain(|r| queue_of(r) != *q);
    }

    /// [`RocketMqSource::observe`], then the claims due: queues newly assigned, and queues given up after a fence
    /// whose [`FENCED_FOR`] is over while the group still assigns them here. `false` on shutdown during a claim. A
    /// queue paused after a fenced batch is resumed once its claim has moved it ([`RocketMqSource::start_from`]),
    /// whichever way it was taken back.
    async fn follow_assignment(&mut self, shutdown: &mut Shutdown) -> bool {
        self.observe().await;
        for q in self.holds.due(Instant::now()) {
            if !self.owned.contains_key(&q) {
                continue;
            }
            tracing::info!(pipeline = %self.pipeline, queue = %describe(std::slice::from_ref(&q)), "still assigned after being given up: claiming it again");
            if !self.to_claim.contains(&q) {
                self.to_claim.push(q);
            }
        }
        if self.stored.is_none() || self.to_claim.is_empty() {
            return true;
        }
        let queues = std::mem::take(&mut self.to_claim);
        self.claim(&queues, shutdown).await
    }

    /// Claims `queues`' stored positions (retrying while the store is down) and starts each still owned from its
    /// stored position. `false` on shutdown first.
    async fn claim(&mut self, queues: &[Queue], shutdown: &mut Shutdown) -> bool {
        let stored = self.stored.as_ref().expect("claims only with stored positions");
        let parts: Vec<(String, i32)> = queues.iter().map(|(t, q)| (t.to_string(), *q)).collect();
        let mut delays = crate::retry::backoff(Duration::from_millis(100), Duration::from_secs(10));
        let claimed = loop {
            match stored.store.claim_offsets(&self.pipeline, &stored.owner, &parts).await {
                Ok(c) => break c,
                Err(e) => {
                    let delay = delays.next().unwrap_or(Duration::from_secs(10));
                    tracing::warn!(pipeline = %self.pipeline, error = %e, retry_in = ?delay,
                        "cannot claim the stored positions of the assigned queues; retrying (the consumer stays in its group)");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.wait() => return false,
                    }
                }
            }
        };
        self.start_from(&claimed).await;
        true
    }

    /// Takes the epochs of `claimed` and starts each queue still owned from its stored position, or without one
    /// from the group's consume offset (else its first offset), dropping its kept records. A stored position below
    /// the queue's first offset (its messages expired) starts from the first offset, with a warning. A queue the
    /// client refuses to move (it is being rebalanced) is given up for a few seconds and claimed again. A queue
    /// started is given up no more, and resumed if it was paused after a fenced batch ([`Holds`]): this is the one
    /// place a queue is taken back, after a new assignment, the fence's time, or a resync alike.
    async fn start_from(&mut self, claimed: &[offsets::Claimed]) {
        for c in claimed {
            let q = (self.intern(&c.topic), c.partition);
            let Some(mq) = self.owned.get(&q).cloned() else { continue };
            self.stash.retain(|r| queue_of(r) != q);
            let next = match c.next_offset {
                Some(n) => Some(n),
                None => self.consumer.committed(&mq).await.ok().filter(|n| *n >= 0),
            };
            let min = self.consumer.min_offset(&mq).await.unwrap_or(0);
            let sought = match next {
                Some(n) if n >= min => self.consumer.seek(&mq, n).await,
                Some(n) => {
                    tracing::warn!(pipeline = %self.pipeline, queue = %describe(std::slice::from_ref(&q)), stored = n, first = min,
                        "the stored position is below the queue's first offset (its messages expired): starting from the first offset");
                    self.consumer.seek_to_begin(&mq).await
                }
                None => self.consumer.seek_to_begin(&mq).await,
            };
            match sought {
                Ok(()) => {
                    self.epochs.insert(q.clone(), c.epoch);
                    if let Some(n) = next {
                        self.committed.insert(q.clone(), n);
                    }
                    if self.holds.started(&q) {
                        self.consumer.resume(vec![mq.clone()]).await;
                        tracing::info!(pipeline = %self.pipeline, queue = %c.topic, id = c.partition, "resuming the queue paused after a fenced batch");
                    }
                    tracing::info!(pipeline = %self.pipeline, queue = %c.topic, id = c.partition, offset = ?next, "consuming the queue from its stored position");
                }
                Err(e) => {
                    tracing::warn!(pipeline = %self.pipeline, queue = %c.topic, id = c.partition, error = %e,
                        "cannot move the consumer to the stored position (the queue is being rebalanced?); claiming it again in a few seconds");
                    self.epochs.remove(&q);
                    self.holds.retry_at(&q, Instant::now() + RESEEK_AFTER);
                }
            }
        }
    }

    /// Between batches: retries unsent consume offsets (at most every second) and refreshes the lag every
    /// [`LAG_EVERY`] (one request per queue, all at once).
    async fn housekeeping(&mut self) {
        if !self.unsent.is_empty() && self.last_retry.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            self.last_retry = Some(Instant::now());
            let unsent = std::mem::take(&mut self.unsent);
            self.send_offsets(unsent).await;
        }
        if self.last_lag.is_some_and(|t| t.elapsed() < LAG_EVERY) {
            return;
        }
        self.last_lag = Some(Instant::now());
        let consumer = &self.consumer;
        let asks = self.owned.iter().map(|(q, mq)| async move { (q.clone(), consumer.max_offset(mq).await) });
        let answers = futures_util::future::join_all(asks).await;
        for (q, max) in answers {
            if let (Ok(max), Some(next)) = (max, self.committed.get(&q)) {
                self.metrics.lag(&q.0, q.1, (max - next).max(0));
                self.metrics.waiting(&q.0, q.1, (max - next).max(0));
            }
        }
    }

    /// Updates the client's consume offsets (so its periodic flush sends these values, never older ones) and sends
    /// each to its broker, acknowledged, all at once. An offset below one already sent is dropped; failures are
    /// kept (the highest per queue) for the next housekeeping.
    async fn send_offsets(&mut self, offsets: HashMap<Queue, i64>) {
        let offsets: HashMap<Queue, (MessageQueue, i64)> = offsets
            .into_iter()
            .filter(|(q, o)| self.committed.get(q).is_none_or(|c| o > c))
            .filter_map(|(q, o)| self.owned.get(&q).map(|mq| (q, (mq.clone(), o))))
            .collect();
        if offsets.is_empty() {
            return;
        }
        self.consumer.commit_with_map(offsets.values().cloned().collect(), false).await;
        let Some(store) = self.consumer.offset_store().await else {
            tracing::warn!(pipeline = %self.pipeline, "the RocketMQ consumer has no offset store; offsets not committed");
            return;
        };
        let store = &store;
        let sends = offsets.into_iter().map(|(q, (mq, o))| async move { (q, o, store.update_consume_offset_to_broker(&mq, o, false).await) });
        for (q, offset, result) in futures_util::future::join_all(sends).await {
            match result {
                Ok(()) => {
                    self.metrics.offset_commit(CommitResult::Ok);
                    self.committed.insert(q.clone(), offset);
                    if self.unsent.get(&q).is_some_and(|u| *u <= offset) {
                        self.unsent.remove(&q);
                    }
                }
                Err(e) => {
                    self.metrics.offset_commit(CommitResult::Error);
                    tracing::warn!(pipeline = %self.pipeline, queue = %q.0, id = q.1, offset, error = %e,
                        "consume offset update failed (retried between batches); unless it succeeds, the records will \
                         be redelivered and skipped as duplicates");
                    let u = self.unsent.entry(q).or_insert(offset);
                    *u = (*u).max(offset);
                }
            }
        }
    }

}

fn describe(queues: &[Queue]) -> String {
    let mut names: Vec<String> = queues.iter().map(|(t, q)| format!("{t}/{q}")).collect();
    names.sort();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(id: i32) -> Queue {
        (Arc::from("payments/broker-a"), id)
    }

    /// The measured case: worker A's batch is fenced while the client revoked the queue and assigned it again (the
    /// pause lands on the client's new entry); A sees "queues revoked", "queues assigned", claims the queue and
    /// seeks it to its stored position. That start must resume it, though the fence's timer was dropped with the
    /// revoke and never comes due.
    #[test]
    fn a_queue_paused_after_a_fence_is_resumed_when_taken_back_after_a_revoke() {
        let mut h = Holds::default();
        let t0 = Instant::now();
        h.fenced(&q(0), t0 + FENCED_FOR);
        assert!(h.pause(&q(0)));
        assert!(!h.pause(&q(0)), "paused once");
        h.revoked(&q(0));
        assert!(h.due(t0 + FENCED_FOR * 2).is_empty(), "a revoked queue is no longer claimed by the timer");
        assert!(h.started(&q(0)), "claimed after its new assignment and sought: resumed");
        assert!(!h.started(&q(0)), "resumed once");
    }

    /// Still assigned when the fence's time is over: due once (claimed again), then resumed by the start.
    #[test]
    fn the_fence_timer_claims_the_queue_again_and_its_start_resumes_it() {
        let mut h = Holds::default();
        let t0 = Instant::now();
        h.fenced(&q(1), t0 + FENCED_FOR);
        h.pause(&q(1));
        h.fenced(&q(1), t0 + FENCED_FOR * 3);
        assert!(h.due(t0).is_empty());
        assert_eq!(h.due(t0 + FENCED_FOR), vec![q(1)], "the first time set is kept");
        assert!(h.due(t0 + FENCED_FOR * 4).is_empty(), "due once");
        assert!(h.started(&q(1)));
    }

    /// A failed seek is retried without a pause; a start that comes first (a resync, a new assignment) ends the
    /// wait, so the queue is not claimed a second time.
    #[test]
    fn a_start_ends_every_wait_and_only_a_pause_is_resumed() {
        let mut h = Holds::default();
        let t0 = Instant::now();
        h.retry_at(&q(2), t0 + RESEEK_AFTER);
        assert_eq!(h.due(t0 + RESEEK_AFTER), vec![q(2)]);
        assert!(!h.started(&q(2)), "never paused: nothing to resume");
        h.fenced(&q(3), t0 + FENCED_FOR);
        h.pause(&q(3));
        h.retry_at(&q(3), t0 + RESEEK_AFTER);
        assert!(h.started(&q(3)));
        assert!(h.due(t0 + FENCED_FOR).is_empty(), "started: given up no more");
    }
}
