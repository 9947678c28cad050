//! The NATS JetStream source of one pipeline ([`crate::source::Source::Nats`]): a durable pull consumer on a stream
//! (the async-nats crate), whose deliveries are acknowledged one by one, each with a double ack, only after their
//! batch's transaction committed.
//!
//! # Why nothing is lost or applied twice
//!
//! - The consumer has explicit acks, no delivery limit and whole payloads (checked by `check` and `run`,
//!   [`verify_consumer`]): the server keeps every delivery pending until it is acknowledged, and redelivers it once
//!   `ack_wait` passes without an ack (to this worker or another on the consumer; never sooner, a lost connection
//!   included). Acks are per message, never `ack_policy = all`: with several workers on one consumer, an ack of all
//!   below a sequence would acknowledge deliveries another worker still holds. A `max_deliver` limit is refused: the
//!   server would drop a message delivered that many times (a crash loop) and only say so in an advisory.
//! - After the store's COMMIT, every delivery of the batch is acknowledged with a double ack (JetStream's
//!   `AckSync`: the server answers it), in a task that runs while the next batch is cut and applied (one batch's
//!   acks in flight at most; a clean stop waits for them). A failed or unanswered ack is retried (three attempts, each bounded by
//!   `request_timeout`); one still unanswered is logged and counted (`idemflow_offset_commits_total{result="error"}`),
//!   never fatal: the server redelivers it after `ack_wait` and its dedup row skips it. An answer is not proof the
//!   ack was recorded (a 2.9 server answers an ack of a delivery it no longer had pending too): the dedup rows, not
//!   the ack, make a redelivery harmless.
//! - A crash anywhere before the acks: the server redelivers every pending delivery after `ack_wait`; the ones whose
//!   transaction committed are skipped by their dedup rows.
//! - While deliveries are held (in a batch in its transaction, in a batch retried through a database outage, or in
//!   the stash for the next batch), the source sends an in-progress ack (`+WPI`) for each every third of the
//!   consumer's `ack_wait`: the server restarts their ack timers, so a slow or retried transaction does not let
//!   `ack_wait` expire. One that expires anyway (a round that could not be sent) is only a redelivery.
//! - Memory is bounded by the consumer's `max_ack_pending` (default twice `batch.max_records`; a consumer without a
//!   limit is refused): the server sends no more than that many unacknowledged deliveries, plus copies of held
//!   ones it redelivers after an expiry.
//! - A consumer idemflow creates starts at the stream's first message; it is created only when every message in
//!   the stream is younger than `[dedup] retention` ([`creation_refusal`]), and never again after it disappeared
//!   under a running worker (the pipeline stops instead: a new consumer decides where to start).
//!
//! # Positions and duplicates
//!
//! A delivery's position is its stream sequence (stream, partition 0, sequence), shown in dead letters and
//! `explain`. Deliveries do not follow sequence order (a redelivery comes after later messages, workers on one
//! consumer share its deliveries), so no processed marks are kept and sequences are never compared by order. A
//! sequence still names one message: a duplicate at the applied message's sequence with its payload is
//! `redelivered` (whatever the delivery count, [`Record::delivered_before`], says: a consumer created again delivers
//! it for the first time), at another sequence `republished`, another payload `payload_mismatch`
//! (`crate::sink::dedup::classify`).
//! The consumer's position (its ack floor) lives on the server: there is no offset to store or seek, so
//! `[offsets] store = "database"` and `rewind` are refused.
//!
//! # Order
//!
//! A stream delivers in sequence order to one worker. Several workers on one durable consumer share its
//! deliveries (competing consumers) and may commit their effects in any order. `max_ack_pending` is the
//! consumer's, shared by its workers: a worker that cannot reach its database keeps its deliveries (as a RabbitMQ
//! consumer keeps its prefetch, or a Kafka member its partitions), and they count against the others' share.

use super::spec::{add_command, NatsSettings, NatsSpec};
use super::check::check;
use super::client::*;
use super::record::to_record;
use crate::batch::{BatchSettings, Records};
use crate::metrics::{CommitResult, PipelineMetrics, RebalanceEvent};
use crate::record::Record;
use crate::shutdown::Shutdown;
use crate::offsets::NextOffsets;
use crate::source::contract::{CheckError, Connector, Context, StoredStart};
type NatsContext = Context<NatsSpec>;
use async_nats::jetstream::{self, consumer::pull, message::Acker, AckKind};
use futures_util::StreamExt;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A delivery's attempts at a double ack before it is left to be redelivered.
const ACK_ATTEMPTS: u32 = 3;

/// How many double acks are in flight at once: a whole default batch (each is a request the server answers; sent
/// together, their round trips overlap).
const ACKS_IN_FLIGHT: usize = 2048;

/// What the forwarding task hands the source.
enum Event {
    /// A delivery.
    Message(jetstream::Message),
    /// The pull stream ended or failed: it is started again (deliveries held keep their acks: an ack names its
    /// delivery, not the stream it came through).
    Lost(String),
    /// The consumer is gone from the server (deleted under the worker): the pipeline stops.
    Deleted,
    /// The server refuses what the pull stream asks, and always will: the pipeline stops with the reason.
    Refused(String),
}

/// A pull stream on the consumer, read by a forwarding task.
struct Live {
    events: mpsc::UnboundedReceiver<Event>,
    forwarder: tokio::task::JoinHandle<()>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.forwarder.abort();
    }
}

/// One pipeline's JetStream consumer.
pub struct NatsSource {
    settings: NatsSettings,
    spec: NatsSpec,
    pipeline: String,
    metrics: PipelineMetrics,
    max_payload_bytes: usize,
    max_records: usize,
    max_wait: Duration,
    stream: Arc<str>,
    client: Option<async_nats::Client>,
    live: Option<Live>,
    /// Deliveries received and not yet in a batch, in arrival order.
    stash: VecDeque<Record>,
    /// The ack handle of every delivery received and not yet acknowledged (stashed or in a batch), by stream
    /// sequence (a redelivery of a held sequence replaces the older handle: either acknowledges the message).
    held: HashMap<u64, Acker>,
    /// When in-progress acks were last sent for `held`.
    progress_sent: Instant,
    /// The messages the server had for the consumer beyond the last delivery (its `pending` count).
    pending: u64,
    /// The double acks of the last committed batch, in flight (see [`NatsSource::commit`]).
    acking: Option<tokio::task::JoinHandle<(usize, Vec<(u64, String)>)>>,
    /// The consumer's `ack_wait` (the pipeline's until bound): in-progress acks go every third of it.
    ack_wait: Duration,
    /// `[dedup] retention`: a consumer created from the stream's first message must not reach older messages.
    retention: Duration,
    reconnect: Box<dyn Iterator<Item = Duration> + Send>,
    /// Whether this worker has bound to (or created) the consumer: one missing afterwards was deleted under it, and
    /// is never created again silently.
    bound: bool,
    /// Set when the pipeline must stop (see [`NatsSource::fatal`]).
    fatal: Option<String>,
    /// The stream's identity, its creation time ([`crate::offsets::Log::id`]), read when the worker binds to its
    /// consumer: a stream deleted and created again deletes its consumers with it, so one bound to is of this stream.
    log_id: Option<Arc<str>>,
}

impl Connector for NatsSource {
    type Spec = NatsSpec;

    fn open(settings: Option<&NatsSettings>, cx: &NatsContext, metrics: PipelineMetrics, _stored: Option<StoredStart>) -> Result<Self, String> {
        NatsSource::new(settings.ok_or(URL_NOT_SET)?, cx, metrics)
    }

    async fn check(settings: Option<&NatsSettings>, cx: &NatsContext) -> Result<Vec<String>, CheckError> {
        check(settings.ok_or_else(|| CheckError::Broker(URL_NOT_SET.to_owned()))?, cx).await.map_err(CheckError::Broker)
    }

    /// Waits for the next batch: at least one delivery, then up to `max_records`, for at most `max_wait` after the
    /// first. Starts the pull stream (again) first when needed. `None` once `shutdown` is triggered while waiting
    /// for a first delivery, or when the pipeline must stop ([`NatsSource::fatal`]).
    async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        'start: loop {
            if !self.ensure_started(shutdown).await {
                return None;
            }
            let mut batch: Vec<Record> = Vec::new();
            let take = self.stash.len().min(settings.max_records);
            batch.extend(self.stash.drain(..take));
            let mut deadline = (!batch.is_empty()).then(|| Instant::now() + settings.max_wait);
            while batch.len() < settings.max_records {
                self.progress().await;
                let tick = self.progress_sent + self.progress_every();
                let live = self.live.as_mut().expect("started above");
                let event = match deadline {
                    None => tokio::select! {
                        e = live.events.recv() => e,
                        _ = shutdown.wait() => return None,
                        _ = tokio::time::sleep_until(tick) => continue,
                    },
                    Some(at) => tokio::select! {
                        e = live.events.recv() => e,
                        _ = tokio::time::sleep_until(at) => break,
                        _ = tokio::time::sleep_until(tick) => continue,
                    },
                };
                match event {
                    Some(Event::Message(m)) => {
                        if let Some(r) = self.record(m) {
                            batch.push(r);
                            deadline.get_or_insert_with(|| Instant::now() + settings.max_wait);
                        }
                    }
                    other => {
                        self.event(other);
                        // Deliveries already taken stay held: they go back to the stash, in order.
                        for r in batch.drain(..).rev() {
                            self.stash.push_front(r);
                        }
                        continue 'start;
                    }
                }
            }
            self.gauges();
            return Some(batch);
        }
    }

    /// Waits `delay` before a retry of `batch`, taking deliveries into the stash (at most `max_ack_pending` are
    /// outstanding) and keeping every held delivery from expiring. `false` if shutdown came first.
    async fn pause_for(&mut self, delay: Duration, _batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool {
        let until = Instant::now() + delay;
        loop {
            self.progress().await;
            let tick = (self.progress_sent + self.progress_every()).min(until);
            match self.live.as_mut() {
                Some(live) => tokio::select! {
                    _ = tokio::time::sleep_until(tick) => {}
                    _ = shutdown.wait() => return false,
                    e = live.events.recv() => self.event(e),
                },
                None => tokio::select! {
                    _ = tokio::time::sleep_until(tick) => {}
                    _ = shutdown.wait() => return false,
                },
            }
            if Instant::now() >= until {
                return true;
            }
        }
    }

    /// Runs `work` (a spawned batch transaction) to its end, meanwhile taking deliveries into the stash and sending
    /// in-progress acks for everything held. A panic in `work` is resumed here.
    /// Each delivery kept is passed to `received` ([`crate::source::Source::poll_while_receiving`]).
    async fn poll_while<T: Send>(&mut self, mut work: tokio::task::JoinHandle<T>, received: &mut (dyn FnMut(&Record) + Send)) -> T {
        let joined = loop {
            self.progress().await;
            let tick = self.progress_sent + self.progress_every();
            match self.live.as_mut() {
                Some(live) => tokio::select! {
                    biased;
                    joined = &mut work => break joined,
                    e = live.events.recv() => {
                        let kept = self.stash.len();
                        self.event(e);
                        self.stash.iter().skip(kept).for_each(&mut *received);
                    }
                    _ = tokio::time::sleep_until(tick) => {}
                },
                None => tokio::select! {
                    joined = &mut work => break joined,
                    _ = tokio::time::sleep_until(tick) => {}
                },
            }
        };
        match joined {
            Ok(value) => value,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Acknowledges a committed batch: a double ack per delivery (the server answers each), [`ACKS_IN_FLIGHT`] at a
    /// time, each retried up to [`ACK_ATTEMPTS`] times. The acks run in a task of their own while the next batch is
    /// cut and applied (the server answers 2,000 double acks in about the time of a transaction; waiting for them
    /// would halve the rate); the previous batch's acks are awaited first, so one batch's acks at most are in flight.
    /// One still unanswered is logged and counted, never fatal: the server redelivers it and its dedup row skips it.
    async fn commit(&mut self, batch: &[Record], _next: &NextOffsets) {
        self.settle_acks().await;
        let ackers: Vec<(u64, Acker)> =
            batch.iter().filter_map(|r| u64::try_from(r.position.offset).ok()).filter_map(|seq| self.held.remove(&seq).map(|a| (seq, a))).collect();
        self.gauges();
        if ackers.is_empty() {
            return;
        }
        self.acking = Some(tokio::spawn(double_ack_all(ackers, self.settings.request_timeout)));
    }

    /// Ends without acknowledging anything more (an injected crash): the server redelivers what was held once
    /// `ack_wait` passes.
    async fn abandon(mut self) {
        self.live = None;
        if let Some(task) = self.acking.take() {
            task.abort();
        }
        if let Some(c) = self.client.take() {
            drop(c);
        }
    }

    /// Stops pulling, waits (at most 10 s) for the acks in flight, and closes the connection after flushing what
    /// was sent. Deliveries held and not acknowledged (none of them applied) are redelivered by the server after
    /// `ack_wait`.
    async fn close(mut self) {
        self.live = None;
        if tokio::time::timeout(Duration::from_secs(10), self.settle_acks()).await.is_err() {
            tracing::warn!(pipeline = %self.pipeline, "the last batch's acks were not all answered in 10 s: the server redelivers those messages after ack_wait, and they are skipped as duplicates");
        }
        if let Some(c) = self.client.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), c.flush()).await;
            tracing::info!(pipeline = %self.pipeline, unacknowledged = self.held.len(), "NATS connection closed");
            drop(c);
        }
        self.metrics.assigned_partitions(0);
    }

    /// Why the pipeline cannot go on: the consumer was deleted under the worker, or its settings cannot keep the
    /// guarantee.
    fn fatal(&self) -> Option<String> {
        self.fatal.clone()
    }

    /// The stream's creation time as its log's identity (a stream deleted and created again has another); where it
    /// ends is not said.
    fn logs(&self, next: &crate::offsets::NextOffsets) -> crate::offsets::Logs {
        let log = crate::offsets::Log { id: self.log_id.clone(), end: None };
        crate::offsets::Logs(next.0.keys().map(|tp| (tp.clone(), log.clone())).collect())
    }
}

/// What a JetStream pipeline is told without `[nats]` in the settings.
const URL_NOT_SET: &str = "[nats] url is not set";

impl NatsSource {
    /// A source for `pipeline` (which must have a JetStream source). It connects on the first
    /// [`NatsSource::next_batch`], and starts its pull stream again with backoff whenever it fails.
    pub fn new(settings: &NatsSettings, pipeline: &NatsContext, metrics: PipelineMetrics) -> Result<Self, String> {
        let spec = &pipeline.source;
        Ok(NatsSource {
            settings: settings.clone(),
            stream: Arc::from(spec.stream.as_str()),
            spec: spec.clone(),
            pipeline: pipeline.name.clone(),
            metrics,
            max_payload_bytes: pipeline.max_payload_bytes,
            max_records: pipeline.batch.max_records,
            max_wait: pipeline.batch.max_wait,
            client: None,
            live: None,
            stash: VecDeque::new(),
            held: HashMap::new(),
            progress_sent: Instant::now(),
            pending: 0,
            acking: None,
            ack_wait: spec.ack_wait,
            retention: pipeline.dedup_retention,
            reconnect: Box::new(reconnect_backoff()),
            bound: false,
            fatal: None,
            log_id: None,
        })
    }

    /// Connects (once: the client reconnects by itself), binds to the durable consumer or creates it (after
    /// [`creation_refusal`]), checks its settings ([`verify_consumer`]), and starts a pull stream read by a
    /// forwarding task. A setting that cannot keep the guarantee sets [`NatsSource::fatal`].
    async fn start(&mut self) -> Result<(), String> {
        let client = match &self.client {
            Some(c) => c.clone(),
            None => {
                let c = connect(&self.settings, &format!("idemflow {}", self.pipeline)).await?;
                self.client = Some(c.clone());
                c
            }
        };
        let version = client.server_info().version;
        let js = context(&self.settings, client);
        let mut stream = js.get_stream(&self.spec.stream).await.map_err(|e| stream_error(&self.spec.stream, &e, str::to_owned))?;
        self.log_id = Some(Arc::from(format!("stream-created:{}", stream.cached_info().created.unix_timestamp_nanos())));
        let info = match stream.consumer_info(&self.spec.consumer).await {
            Ok(info) => info,
            Err(e) if self.bound && not_found(&e) => {
                self.event(Some(Event::Deleted));
                return Err(self.fatal.clone().unwrap_or_default());
            }
            Err(e) if not_found(&e) => {
                let stream_info = stream.info().await.map_err(|e| format!("reading stream {:?}: {e}", self.spec.stream))?.clone();
                if let Some(why) = creation_refusal(&stream_info, &self.spec, self.batch(), self.retention, &version) {
                    self.fatal = Some(why.clone());
                    return Err(why);
                }
                let created = stream.create_consumer(consumer_config(&self.spec)).await.map_err(|e| {
                    format!("creating the durable consumer {:?} on stream {:?}: {e}", self.spec.consumer, self.spec.stream)
                })?;
                tracing::info!(pipeline = %self.pipeline, stream = %self.spec.stream, consumer = %self.spec.consumer,
                    ack_wait = ?self.spec.ack_wait, max_ack_pending = self.spec.max_ack_pending, "created the durable consumer");
                created.cached_info().clone()
            }
            Err(e) => return Err(format!("reading the durable consumer {:?} of stream {:?}: {e}", self.spec.consumer, self.spec.stream)),
        };
        self.bound = true;
        if let Err(why) = verify_consumer(&info.config, &self.spec, self.batch()) {
            self.fatal = Some(why.clone());
            return Err(why);
        }
        if info.config.ack_wait != self.spec.ack_wait {
            tracing::warn!(pipeline = %self.pipeline, consumer = %self.spec.consumer, consumer_ack_wait = ?info.config.ack_wait,
                pipeline_ack_wait = ?self.spec.ack_wait,
                "the consumer's ack_wait is not the pipeline's: [source] ack_wait applies only to a consumer idemflow creates; in-progress acks follow the consumer's (change it with `nats consumer edit`)");
        }
        self.ack_wait = info.config.ack_wait;
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_consumer(&self.spec.consumer)
            .await
            .map_err(|e| format!("binding to the durable consumer {:?} of stream {:?}: {e}", self.spec.consumer, self.spec.stream))?;
        let (batch, expires) = pull_request(&info.config, self.max_records);
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch)
            .expires(expires)
            .heartbeat(expires / 6)
            .messages()
            .await
            .map_err(|e| format!("starting to pull from consumer {:?}: {e}", self.spec.consumer))?;
        let (tx, events) = mpsc::unbounded_channel();
        let forwarder = tokio::spawn(forward(messages, tx));
        self.live = Some(Live { events, forwarder });
        self.metrics.assigned_partitions(1);
        self.metrics.rebalance(RebalanceEvent::Assign);
        tracing::info!(pipeline = %self.pipeline, stream = %self.spec.stream, consumer = %self.spec.consumer,
            pending = info.num_pending, ack_pending = info.num_ack_pending, ack_wait = ?self.ack_wait, "consuming from NATS JetStream");
        Ok(())
    }

    /// The batch bounds, as [`verify_consumer`] and [`creation_refusal`] take them.
    fn batch(&self) -> (usize, Duration) {
        (self.max_records, self.max_wait)
    }

    /// Starts the pull stream until it works or shutdown comes (`false`), with backoff, saying why on every attempt.
    async fn ensure_started(&mut self, shutdown: &mut Shutdown) -> bool {
        while self.live.is_none() {
            if self.fatal.is_some() {
                return false;
            }
            let attempt = tokio::select! {
                r = self.start() => r,
                _ = shutdown.wait() => return false,
            };
            match attempt {
                // The backoff starts over only once a delivery arrives (see `record`): a pull stream the server
                // ends at once must not be started again in a tight loop.
                Ok(()) => {}
                Err(_) if self.fatal.is_some() => return false,
                Err(why) => {
                    let delay = self.reconnect.next().unwrap_or(Duration::from_secs(30));
                    tracing::warn!(pipeline = %self.pipeline, error = %self.settings.url.scrub(&why), retry_in = ?delay,
                        "cannot consume from NATS JetStream; retrying");
                    if !self.sleep_serving(delay, shutdown).await {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Sleeps `delay`, sending in-progress acks for what is held when they are due. `false` if shutdown came.
    async fn sleep_serving(&mut self, delay: Duration, shutdown: &mut Shutdown) -> bool {
        let until = Instant::now() + delay;
        loop {
            self.progress().await;
            let next = (self.progress_sent + self.progress_every()).min(until);
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = shutdown.wait() => return false,
            }
            if Instant::now() >= until {
                return true;
            }
        }
    }

    /// How often in-progress acks are sent: a third of `ack_wait`, so one lost in-progress ack is not enough for
    /// the server to redeliver.
    fn progress_every(&self) -> Duration {
        (self.ack_wait / 3).max(Duration::from_millis(100))
    }

    /// Sends an in-progress ack for every held delivery when a third of `ack_wait` has passed since the last ones.
    /// A failed one is logged: the next round (or the delivery's redelivery, a skipped duplicate) covers it.
    async fn progress(&mut self) {
        if self.progress_sent.elapsed() < self.progress_every() {
            return;
        }
        // Also with nothing held: the next round is due a third of ack_wait from now, never in the past (the
        // waits below sleep until it).
        self.progress_sent = Instant::now();
        if self.held.is_empty() {
            return;
        }
        let mut failed = 0usize;
        // Each in-progress ack is a publish: while the client reconnects, its command queue fills and a publish
        // waits. The round is given at most a third of ack_wait; what it could not send counts as failed.
        let deadline = Instant::now() + self.progress_every();
        for acker in self.held.values() {
            match tokio::time::timeout_at(deadline, acker.ack_with(AckKind::Progress)).await {
                Ok(Ok(())) => {}
                _ => failed += 1,
            }
        }
        if failed > 0 {
            tracing::warn!(pipeline = %self.pipeline, failed, held = self.held.len(),
                "in-progress acks failed: the server may redeliver those deliveries, which are then skipped as duplicates");
        } else {
            tracing::debug!(pipeline = %self.pipeline, held = self.held.len(), "in-progress acks sent");
        }
    }

    /// Handles one event: a delivery goes to the stash.
    fn event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Message(m)) => {
                if let Some(r) = self.record(m) {
                    self.stash.push_back(r);
                }
            }
            Some(Event::Lost(why)) => self.lost(&why),
            Some(Event::Deleted) => {
                self.fatal = Some(format!(
                    "the durable consumer {:?} of stream {:?} was deleted on the server while the worker consumed from it: \
                     its position and pending deliveries are gone. Nothing committed is lost, but a new consumer decides \
                     where to start: create it deliberately ({}), or restart the worker to let it create one from the \
                     stream's first message, which it does only while every message in the stream is younger than \
                     [dedup] retention (older ones could be applied again)",
                    self.spec.consumer,
                    self.spec.stream,
                    add_command(&self.spec, self.max_records, &self.spec.consumer)
                ));
                self.live = None;
            }
            Some(Event::Refused(why)) => {
                self.fatal = Some(why);
                self.live = None;
            }
            None => self.lost("the pull stream ended"),
        }
    }

    fn lost(&mut self, why: &str) {
        if self.live.take().is_some() {
            tracing::warn!(pipeline = %self.pipeline, error = %self.settings.url.scrub(why), held = self.held.len(),
                "the JetStream pull stream failed; starting it again (held deliveries keep their acks)");
            self.metrics.rebalance(RebalanceEvent::Revoke);
            self.metrics.assigned_partitions(0);
        }
    }

    /// A delivery as a record, its ack handle held; `None` (logged) for a message that is not a JetStream delivery.
    fn record(&mut self, m: jetstream::Message) -> Option<Record> {
        let (seq, pending, published_ns, delivered) = match m.info() {
            Ok(info) => (info.stream_sequence, info.pending, info.published.unix_timestamp_nanos(), info.delivered),
            Err(e) => {
                tracing::warn!(pipeline = %self.pipeline, subject = %m.subject, error = %e, "a message without JetStream metadata; ignored");
                return None;
            }
        };
        self.reconnect = Box::new(reconnect_backoff());
        let (message, acker) = m.split();
        self.held.insert(seq, acker);
        self.pending = pending;
        Some(to_record(self.stream.clone(), seq, published_ns, delivered, message, self.max_payload_bytes))
    }

    /// Sets the lag gauge (the messages the server has for the consumer, as of the last delivery, plus those this
    /// worker holds) and the waiting gauge (those it holds): once a batch, not once a message.
    fn gauges(&self) {
        let held = self.held.len() as i64;
        self.metrics.lag(&self.stream, 0, i64::try_from(self.pending).unwrap_or(i64::MAX).saturating_add(held));
        self.metrics.waiting(&self.stream, 0, held);
    }

    /// Waits for the acks in flight (see [`NatsSource::commit`]) and counts their outcome.
    async fn settle_acks(&mut self) {
        let Some(task) = self.acking.take() else { return };
        let (acked, failed) = match task.await {
            Ok(outcome) => outcome,
            Err(e) => (0, vec![(0, format!("the ack task ended: {e}"))]),
        };
        if failed.is_empty() {
            self.metrics.offset_commit(CommitResult::Ok);
        } else {
            self.metrics.offset_commit(CommitResult::Error);
            let (seq, why) = &failed[0];
            tracing::warn!(pipeline = %self.pipeline, acked, unconfirmed = failed.len(), first_sequence = seq,
                error = %self.settings.url.scrub(why),
                "double acks of a committed batch were not answered: the server redelivers those messages after ack_wait and they are skipped as duplicates");
        }
    }

}

/// Double-acks every delivery of `ackers` (by stream sequence), [`ACKS_IN_FLIGHT`] at a time, each attempt bounded
/// by `request_timeout` (while the client reconnects a publish waits for room in its command queue) and retried up
/// to [`ACK_ATTEMPTS`] times. Returns how many were answered, and the sequence and last error of each that was not.
async fn double_ack_all(ackers: Vec<(u64, Acker)>, request_timeout: Duration) -> (usize, Vec<(u64, String)>) {
    let mut failed: Vec<(u64, String)> = Vec::new();
    let mut acked = 0usize;
    for chunk in ackers.chunks(ACKS_IN_FLIGHT) {
        let results = futures_util::future::join_all(chunk.iter().map(|(seq, acker)| async move {
            let mut last = String::new();
            for attempt in 0..ACK_ATTEMPTS {
                match tokio::time::timeout(request_timeout, acker.double_ack()).await {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(e)) => last = e.to_string(),
                    Err(_) => last = format!("no answer within {request_timeout:?}"),
                }
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
            Err((*seq, last))
        }))
        .await;
        for r in results {
            match r {
                Ok(()) => acked += 1,
                Err(f) => failed.push(f),
            }
        }
    }
    (acked, failed)
}

/// Forwards the pull stream's deliveries and failures to the source; ends when the source is gone.
async fn forward(mut messages: pull::Stream, tx: mpsc::UnboundedSender<Event>) {
    while let Some(m) = messages.next().await {
        let event = match m {
            Ok(m) => Event::Message(m),
            Err(e) => match e.kind() {
                // A missed idle heartbeat: the pull request may be lost (a server restart); the stream is started
                // again, which sends a new one.
                pull::MessagesErrorKind::MissingHeartbeat => Event::Lost(e.to_string()),
                pull::MessagesErrorKind::ConsumerDeleted => Event::Deleted,
                pull::MessagesErrorKind::RequestLimitExceeded => Event::Refused(format!(
                    "the server refused the pull request: {e} (the consumer's max_batch, max_expires or max_bytes; \
                     idemflow asks for at most batch.max_records messages)"
                )),
                _ => Event::Lost(e.to_string()),
            },
        };
        let end = !matches!(event, Event::Message(_));
        if tx.send(event).is_err() || end {
            return;
        }
    }
    let _ = tx.send(Event::Lost("the pull stream ended".to_owned()));
}

fn reconnect_backoff() -> impl Iterator<Item = Duration> + Send {
    crate::retry::backoff(Duration::from_millis(200), Duration::from_secs(30))
}
