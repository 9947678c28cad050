//! The RabbitMQ source of one pipeline ([`crate::source::Source::RabbitMq`]): one consumer per queue (AMQP 0-9-1,
//! the lapin crate), batches of deliveries acknowledged only after their batch's transaction committed.
//!
//! # Why nothing is lost or applied twice
//!
//! - Each queue is consumed on a channel of its own with manual acknowledgements and a `basic.qos` prefetch count
//!   (`[source] prefetch`, default twice `batch.max_records`): the broker sends no more than that many
//!   unacknowledged deliveries, so memory stays bounded while a batch waits for the database, and nothing else
//!   needs pausing.
//! - A batch is acknowledged after its `COMMIT` with one `basic.ack` per queue, `multiple` set, on the batch's
//!   highest delivery tag of that channel (AMQP 0-9-1, `basic.ack`: "all outstanding messages up to and including
//!   the delivery tag"). That acknowledges exactly the batch: a channel's deliveries are handed out in delivery-tag
//!   order, every earlier batch was acknowledged, and deliveries received after the batch was cut keep higher tags.
//! - A crash, a lost connection or a closed channel before the ack: the broker requeues every unacknowledged
//!   delivery (marked `redelivered`; quorum queues also count `x-delivery-count`). Their dedup rows make the
//!   second delivery a skipped duplicate, counted as `redelivered`.
//! - Delivery tags number deliveries on one channel only. After a reconnect the source starts a new *generation*:
//!   records of an earlier generation still buffered are dropped (the broker requeued them), and a batch of an
//!   earlier generation is never acknowledged on the new channel (its tags would name other deliveries); its
//!   records come back as redeliveries.
//! - A database outage keeps the batch unacknowledged: the worker retries it with backoff while the broker holds
//!   back further deliveries at the prefetch limit. Nothing is rejected or requeued by the worker, so there is no
//!   requeue loop.
//!
//! # Order
//!
//! A queue delivers in order to one consumer, and a requeued delivery goes back to its original position (RabbitMQ
//! documentation, "Consumer Acknowledgements and Publisher Confirms"). With several workers on one queue
//! (competing consumers), deliveries are spread over them and their effects may commit in any order. Users who
//! need per-queue order declare the queue with `x-single-active-consumer` (the broker then delivers to one
//! consumer at a time, the others stand by) and set `[source] single_active_consumer = true`, which
//! `idemflow check` verifies.
//!
//! # Positions
//!
//! A delivery has no stable position: records carry the queue name, [`NO_PARTITION`] and their delivery tag, and
//! [`Record::delivered_before`] holds the broker's redelivery mark, from which duplicates are classified.


use super::spec::{RabbitMqSettings, RabbitMqSpec};

use crate::batch::{BatchSettings, Records};
use crate::offsets::NextOffsets;
use crate::source::contract::{CheckError, Connector, Context, StoredStart};
type RabbitMqContext = Context<RabbitMqSpec>;
use crate::metrics::{CommitResult, PipelineMetrics, RebalanceEvent};
use crate::record::{Position, Record, NO_PARTITION};
use crate::shutdown::Shutdown;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often the queue depth gauge is refreshed (a passive `queue.declare` per queue).
const DEPTH_EVERY: Duration = Duration::from_secs(5);

/// The longest a passive `queue.declare` for the depth gauge may take.
const DEPTH_TIMEOUT: Duration = Duration::from_secs(2);

/// What a queue's consumer task hands the source.
enum Event {
    /// A delivery from the queue with this index.
    Delivery(usize, lapin::message::Delivery),
    /// The consumer ended: the channel or the connection is gone, or the broker cancelled the consumer (the queue
    /// was deleted). Every unacknowledged delivery goes back to the queue.
    Lost(String),
}

/// A connection with one consuming channel per queue.
struct Live {
    connection: Arc<Connection>,
    /// The consuming channel of each queue, by queue index.
    channels: Vec<Channel>,
    /// A channel for the passive declares of the depth gauge (reopened when the broker closed it).
    admin: Option<Channel>,
    events: mpsc::UnboundedReceiver<Event>,
    forwarders: Vec<tokio::task::JoinHandle<()>>,
    /// Deliveries received and not yet acknowledged, by queue index.
    unacked: Vec<u64>,
}

impl Live {
    /// Stops the consumers and closes the connection in the background (the broker requeues what was not
    /// acknowledged); `code` and `why` go to the broker as the close reply.
    fn close_in_background(self, code: u16, why: &'static str) {
        let connection = self.connection.clone();
        drop(self);
        tokio::spawn(async move {
            let _ = connection.close(code, why.into()).await;
        });
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        for f in &self.forwarders {
            f.abort();
        }
    }
}

/// One pipeline's RabbitMQ consumers.
pub struct RabbitMqSource {
    settings: RabbitMqSettings,
    spec: RabbitMqSpec,
    pipeline: String,
    metrics: PipelineMetrics,
    max_payload_bytes: usize,
    queues: Vec<Arc<str>>,
    live: Option<Live>,
    /// Incremented at every connection: delivery tags are only meaningful within one.
    generation: u64,
    /// Deliveries of the current generation received and not yet in a batch, in arrival order.
    stash: VecDeque<Record>,
    /// The generation of the batch handed out last (acknowledged only if still current).
    batch_generation: Option<u64>,
    reconnect: Box<dyn Iterator<Item = Duration> + Send>,
    depth_refreshed: Option<Instant>,
    /// Set when the pipeline must stop (see [`RabbitMqSource::fatal`]).
    fatal: Option<String>,
}

impl Connector for RabbitMqSource {
    type Spec = RabbitMqSpec;

    fn open(settings: Option<&RabbitMqSettings>, cx: &RabbitMqContext, metrics: PipelineMetrics, _stored: Option<StoredStart>) -> Result<Self, String> {
        Ok(RabbitMqSource::new(settings.ok_or(URL_NOT_SET)?, cx, metrics))
    }

    async fn check(settings: Option<&RabbitMqSettings>, cx: &RabbitMqContext) -> Result<Vec<String>, CheckError> {
        check(settings.ok_or_else(|| CheckError::Broker(URL_NOT_SET.to_owned()))?, cx).await.map_err(CheckError::Broker)
    }

    /// Waits for the next batch: at least one delivery, then up to `max_records`, for at most `max_wait` after the
    /// first. Connects (again) first when needed. Returns `None` once `shutdown` is triggered while waiting for a
    /// first delivery; a batch being filled when shutdown comes is returned as it is, to be finished.
    async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        'connect: loop {
            if self.fatal.is_some() || !self.ensure_connected(shutdown).await {
                return None;
            }
            self.refresh_depth().await;
            let mut batch: Vec<Record> = Vec::new();
            let take = self.stash.len().min(settings.max_records);
            batch.extend(self.stash.drain(..take));
            let mut deadline = (!batch.is_empty()).then(|| Instant::now() + settings.max_wait);
            while batch.len() < settings.max_records {
                let live = self.live.as_mut().expect("connected above");
                let event = match deadline {
                    None => tokio::select! {
                        e = live.events.recv() => e,
                        _ = shutdown.wait() => return None,
                        _ = tokio::time::sleep(DEPTH_EVERY) => {
                            self.refresh_depth().await;
                            continue;
                        }
                    },
                    Some(at) => tokio::select! {
                        e = live.events.recv() => e,
                        _ = tokio::time::sleep_until(at) => break,
                    },
                };
                match event {
                    Some(Event::Delivery(queue, d)) => {
                        batch.push(self.record(queue, d));
                        if self.fatal.is_some() {
                            return None;
                        }
                        deadline.get_or_insert_with(|| Instant::now() + settings.max_wait);
                    }
                    other => {
                        self.event(other);
                        continue 'connect;
                    }
                }
            }
            self.batch_generation = Some(self.generation);
            return Some(batch);
        }
    }

    /// Waits `delay` before a retry of `batch`, without taking more than the prefetch window: deliveries that
    /// arrive are kept for later. If the connection is lost meanwhile, `batch` is emptied (the broker requeued it).
    /// Returns `false` if shutdown came first.
    async fn pause_for(&mut self, delay: Duration, batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool {
        let until = Instant::now() + delay;
        loop {
            let Some(live) = self.live.as_mut() else { break };
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                _ = shutdown.wait() => return false,
                e = live.events.recv() => self.event(e),
            }
        }
        self.drop_revoked(batch);
        if self.live.is_none() {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = shutdown.wait() => return false,
            }
        }
        true
    }

    /// Runs `work` (a spawned batch transaction) to its end, meanwhile taking deliveries into the stash (at most
    /// the prefetch window) and noticing a lost connection. A panic in `work` is resumed here.
    /// Each delivery kept is passed to `received` ([`crate::source::Source::poll_while_receiving`]).
    async fn poll_while<T: Send>(&mut self, mut work: tokio::task::JoinHandle<T>, received: &mut (dyn FnMut(&Record) + Send)) -> T {
        let joined = loop {
            let Some(live) = self.live.as_mut() else { break (&mut work).await };
            tokio::select! {
                biased;
                joined = &mut work => break joined,
                e = live.events.recv() => {
                    let kept = self.stash.len();
                    self.event(e);
                    self.stash.iter().skip(kept).for_each(&mut *received);
                }
            }
        };
        match joined {
            Ok(value) => value,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Drops the whole batch when the connection it was delivered on is gone: the broker requeued it, and its
    /// delivery tags could not be acknowledged anyway.
    fn drop_revoked(&mut self, batch: &mut dyn Records) {
        if !batch.records().is_empty() && (self.live.is_none() || self.batch_generation != Some(self.generation)) {
            tracing::info!(pipeline = %self.pipeline, records = batch.records().len(),
                "dropping a batch whose connection was lost: the broker redelivers it");
            batch.retain_records(&mut |_| false);
        }
    }

    /// Acknowledges a committed batch: per queue, one `basic.ack` with `multiple` on its highest delivery tag. A
    /// batch whose connection is gone is not acknowledged (the broker requeued it; counted as
    /// `skipped_not_owned`); a failed ack is logged and counted, never fatal: the deliveries come back and are
    /// skipped as duplicates.
    async fn commit(&mut self, batch: &[Record], _next: &NextOffsets) {
        let generation = self.batch_generation.take();
        if batch.is_empty() {
            return;
        }
        let Some(live) = self.live.as_mut().filter(|_| generation == Some(self.generation)) else {
            self.metrics.offset_commit(CommitResult::SkippedNotOwned);
            tracing::info!(pipeline = %self.pipeline, records = batch.len(),
                "not acknowledging a committed batch: its connection was lost, the broker redelivers it and its records are skipped as duplicates");
            return;
        };
        let mut failed = None;
        for (i, queue) in self.queues.iter().enumerate() {
            let mine = batch.iter().filter(|r| r.position.topic == *queue);
            let (count, highest) = mine.fold((0u64, None), |(n, h): (u64, Option<i64>), r| (n + 1, h.max(Some(r.position.offset))));
            let Some(tag) = highest else { continue };
            match live.channels[i].basic_ack(tag as u64, BasicAckOptions { multiple: true }).await {
                Ok(()) => {
                    live.unacked[i] = live.unacked[i].saturating_sub(count);
                    self.metrics.offset_commit(CommitResult::Ok);
                }
                Err(e) => {
                    self.metrics.offset_commit(CommitResult::Error);
                    failed = Some(self.settings.url.scrub(&e.to_string()));
                }
            }
        }
        if let Some(why) = failed {
            self.lost(&format!("acknowledging a committed batch failed: {why}"));
        }
    }

    /// Closes the connection without acknowledging anything more (an injected crash): the broker requeues every
    /// unacknowledged delivery.
    async fn abandon(mut self) {
        if let Some(live) = self.live.take() {
            let _ = live.connection.close(320, "idemflow: injected crash".into()).await;
        }
    }

    /// Closes the connection. Deliveries received and not acknowledged (none of them applied) go back to the
    /// queue.
    async fn close(mut self) {
        if let Some(live) = self.live.take() {
            let unacked: u64 = live.unacked.iter().sum();
            match tokio::time::timeout(Duration::from_secs(5), live.connection.close(200, "idemflow stopping".into())).await {
                Ok(Ok(())) => tracing::info!(pipeline = %self.pipeline, returned_to_queue = unacked, "RabbitMQ connection closed"),
                _ => tracing::warn!(pipeline = %self.pipeline, "closing the RabbitMQ connection did not finish; the broker will notice its loss"),
            }
        }
        self.metrics.assigned_partitions(0);
    }

    /// Why the pipeline cannot go on, once a delivery showed that a queue is a stream: a stream keeps its messages
    /// after an ack and does not redeliver what a lost consumer had not acknowledged (its consumers resume at an
    /// offset they choose), so acknowledging after COMMIT would not protect anything.
    fn fatal(&self) -> Option<String> {
        self.fatal.clone()
    }
}

/// What a RabbitMQ pipeline is told without `[rabbitmq]` in the settings.
const URL_NOT_SET: &str = "[rabbitmq] url is not set";

impl RabbitMqSource {
    /// A source for `pipeline` (which must have a RabbitMQ source). It connects on the first
    /// [`RabbitMqSource::next_batch`], and again with backoff whenever the connection is lost.
    pub fn new(settings: &RabbitMqSettings, pipeline: &RabbitMqContext, metrics: PipelineMetrics) -> Self {
        let spec = pipeline.source.clone();
        RabbitMqSource {
            settings: settings.clone(),
            queues: spec.queues.iter().map(|q| Arc::from(q.as_str())).collect(),
            spec,
            pipeline: pipeline.name.clone(),
            metrics,
            max_payload_bytes: pipeline.max_payload_bytes,
            live: None,
            generation: 0,
            stash: VecDeque::new(),
            batch_generation: None,
            reconnect: Box::new(reconnect_backoff()),
            depth_refreshed: None,
            fatal: None,
        }
    }

    /// Connects, opens a channel per queue with the prefetch count, and starts a consumer on each.
    async fn connect(&mut self) -> Result<(), String> {
        let scrub = |e: &dyn std::fmt::Display| self.settings.url.scrub(&e.to_string());
        let props = ConnectionProperties::default().with_connection_name(format!("idemflow {}", self.pipeline).into());
        let connection = Arc::new(connect(&self.settings, props).await?);
        let (tx, events) = mpsc::unbounded_channel();
        // Built step by step: if a queue cannot be consumed, dropping `live` stops the consumers already started,
        // and the connection is closed, so a failed attempt leaves nothing open.
        let mut live = Live {
            connection: connection.clone(),
            channels: Vec::new(),
            admin: None,
            events,
            forwarders: Vec::new(),
            unacked: vec![0; self.queues.len()],
        };
        let failed = |live: Live, why: String| {
            live.close_in_background(200, "idemflow: consuming failed, retrying");
            Err(why)
        };
        for (i, queue) in self.queues.iter().enumerate() {
            let channel = match connection.create_channel().await {
                Ok(c) => c,
                Err(e) => return failed(live, format!("opening a channel: {}", scrub(&e))),
            };
            if let Err(e) = channel.basic_qos(self.spec.prefetch, BasicQosOptions::default()).await {
                return failed(live, format!("setting the prefetch count (basic.qos {}): {}", self.spec.prefetch, scrub(&e)));
            }
            let consumed = channel.basic_consume((&**queue).into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await;
            let mut consumer = match consumed {
                Ok(c) => c,
                Err(e) => return failed(live, format!("consuming from queue {queue:?}: {}", scrub(&e))),
            };
            let tx = tx.clone();
            live.forwarders.push(tokio::spawn(async move {
                while let Some(delivery) = consumer.next().await {
                    match delivery {
                        Ok(d) => {
                            if tx.send(Event::Delivery(i, d)).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Event::Lost(e.to_string()));
                            return;
                        }
                    }
                }
                let _ = tx.send(Event::Lost("the broker cancelled the consumer (was the queue deleted?)".to_owned()));
            }));
            live.channels.push(channel);
        }
        self.generation += 1;
        self.live = Some(live);
        self.metrics.assigned_partitions(self.queues.len());
        self.metrics.rebalance(RebalanceEvent::Assign);
        tracing::info!(pipeline = %self.pipeline, queues = ?self.spec.queues, prefetch = self.spec.prefetch,
            generation = self.generation, "consuming from RabbitMQ");
        Ok(())
    }

    /// Connects until it works or shutdown comes (`false`), with backoff, saying why on every attempt.
    async fn ensure_connected(&mut self, shutdown: &mut Shutdown) -> bool {
        while self.live.is_none() {
            let attempt = tokio::select! {
                r = self.connect() => r,
                _ = shutdown.wait() => return false,
            };
            match attempt {
                Ok(()) => self.reconnect = Box::new(reconnect_backoff()),
                Err(why) => {
                    let delay = self.reconnect.next().unwrap_or(Duration::from_secs(30));
                    tracing::warn!(pipeline = %self.pipeline, error = %why, retry_in = ?delay, "cannot consume from RabbitMQ; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.wait() => return false,
                    }
                }
            }
        }
        true
    }

    /// The connection or a channel is gone: the broker requeues every unacknowledged delivery, so the buffered
    /// ones are dropped and the next batch starts on a new connection.
    fn lost(&mut self, why: &str) {
        if let Some(live) = self.live.take() {
            tracing::warn!(pipeline = %self.pipeline, error = %why, buffered = self.stash.len(),
                "RabbitMQ consumer lost: the broker requeues the unacknowledged deliveries; reconnecting");
            self.metrics.rebalance(RebalanceEvent::Revoke);
            self.metrics.assigned_partitions(0);
            live.close_in_background(320, "idemflow: consumer lost, reconnecting");
        }
        self.stash.clear();
    }

    fn record(&mut self, queue: usize, d: lapin::message::Delivery) -> Record {
        let stream = d.properties.headers().as_ref().is_some_and(|h| h.inner().contains_key("x-stream-offset"));
        if stream && self.fatal.is_none() {
            self.fatal = Some(format!(
                "queue {:?} is a RabbitMQ stream (its deliveries carry x-stream-offset): a stream does not redeliver what a lost \
                 consumer had not acknowledged, so the guarantee cannot hold; consume a quorum or classic queue",
                self.queues[queue]
            ));
        }
        if let Some(live) = &mut self.live {
            live.unacked[queue] += 1;
        }
        let returned = d.properties.headers().as_ref().and_then(|h| h.inner().get("x-delivery-count").and_then(integer)).unwrap_or(0);
        if returned >= DELIVERY_COUNT_WARNING {
            tracing::warn!(
                queue = %self.queues[queue], delivery_tag = d.delivery_tag, x_delivery_count = returned,
                "a message returned to its queue {returned} times (a crash loop, lost connections): a quorum queue with a \
                 delivery limit (x-delivery-limit; RabbitMQ 4 sets 20 by default) drops or dead-letters it past that \
                 many, out of idemflow's sight: give the queue a dead-letter exchange or no limit (docs/rabbitmq.md)"
            );
        }
        to_record(self.queues[queue].clone(), d, self.max_payload_bytes)
    }

    /// Handles one event; a delivery goes to the stash.
    fn event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Delivery(queue, d)) => {
                let r = self.record(queue, d);
                self.stash.push_back(r);
            }
            Some(Event::Lost(why)) => self.lost(&why),
            None => self.lost("the consumers ended"),
        }
    }

    /// Sets the lag gauge of each queue to this worker's part of its depth: its share of the ready messages (a
    /// passive `queue.declare` returns them and the number of consumers) plus the deliveries it holds
    /// unacknowledged. Summed over the workers of a queue, that is the queue's depth (within one message per
    /// worker, from the integer division).
    async fn refresh_depth(&mut self) {
        if self.depth_refreshed.is_some_and(|at| at.elapsed() < DEPTH_EVERY) {
            return;
        }
        self.depth_refreshed = Some(Instant::now());
        let Some(live) = self.live.as_mut() else { return };
        if live.admin.as_ref().is_none_or(|c| !c.status().connected()) {
            live.admin = tokio::time::timeout(DEPTH_TIMEOUT, live.connection.create_channel()).await.ok().and_then(Result::ok);
        }
        let Some(admin) = live.admin.clone() else { return };
        for (i, queue) in self.queues.iter().enumerate() {
            let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
            let declared = tokio::time::timeout(DEPTH_TIMEOUT, admin.queue_declare((&**queue).into(), passive, FieldTable::default())).await;
            match declared {
                Ok(Ok(q)) => {
                    // This worker's share of the ready messages, so that the sum over the workers of a queue (as
                    // the dashboard and the alerts take it) is the queue's depth.
                    let share = i64::from(q.message_count()) / i64::from(q.consumer_count().max(1));
                    self.metrics.lag(queue, NO_PARTITION, share + live.unacked[i] as i64);
                    // Only what this worker holds: a standby (single active consumer) never gets ready messages.
                    self.metrics.waiting(queue, NO_PARTITION, live.unacked[i] as i64)
                }
                Ok(Err(e)) => {
                    tracing::debug!(pipeline = %self.pipeline, queue = %queue, error = %e, "reading the queue depth failed");
                    break;
                }
                Err(_) => break,
            }
        }
    }

}

fn reconnect_backoff() -> impl Iterator<Item = Duration> + Send {
    crate::retry::backoff(Duration::from_millis(200), Duration::from_secs(30))
}

/// Opens a connection with the settings' heartbeat (unless the URL sets one) and connection timeout.
///
/// Errors: the problem as text, with the URL's credentials masked.
pub async fn connect(settings: &RabbitMqSettings, props: ConnectionProperties) -> Result<Connection, String> {
    crate::install_tls_provider();
    let scrub = |e: &dyn std::fmt::Display| settings.url.scrub(&e.to_string());
    let mut uri: lapin::uri::AMQPUri = settings
        .url
        .expose()
        .parse()
        .map_err(|e: String| format!("[rabbitmq] url {}: {}", settings.url, scrub(&e)))?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(settings.heartbeat.as_secs().min(u64::from(u16::MAX)) as u16);
    }
    let tls = tls_config(settings)?;
    let runtime = lapin::runtime::default_runtime().map_err(|e| format!("starting the AMQP client: {e}"))?;
    let connecting = Connection::connect_uri_with_config(uri, props, tls, runtime);
    match tokio::time::timeout(settings.connect_timeout, connecting).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("connecting to {}: {}", settings.url, scrub(&e))),
        Err(_) => Err(format!("connecting to {}: no answer within {:?}", settings.url, settings.connect_timeout)),
    }
}

/// The TLS settings of `[rabbitmq]`: a private CA (`tls_ca_file`) and a client certificate and key
/// (`tls_cert_file`, `tls_key_file`), read from their files.
///
/// Errors: a file that cannot be read, or a certificate without its key, naming the setting.
fn tls_config(settings: &RabbitMqSettings) -> Result<lapin::tcp::OwnedTLSConfig, String> {
    let read = |name: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("[rabbitmq] {name} = {:?}: cannot read it: {e}", path.display()))
    };
    let cert_chain = match &settings.tls_ca_file {
        Some(path) => Some(String::from_utf8(read("tls_ca_file", path)?).map_err(|_| "[rabbitmq] tls_ca_file: not a PEM file".to_owned())?),
        None => None,
    };
    let identity = match (&settings.tls_cert_file, &settings.tls_key_file) {
        (Some(cert), Some(key)) => {
            Some(lapin::tcp::OwnedIdentity::PKCS8 { pem: read("tls_cert_file", cert)?, key: read("tls_key_file", key)? })
        }
        (None, None) => None,
        _ => return Err("[rabbitmq] tls_cert_file and tls_key_file go together".to_owned()),
    };
    Ok(lapin::tcp::OwnedTLSConfig { identity, cert_chain })
}

/// From this many returns to the queue (`x-delivery-count`, quorum queues) a delivery is logged as a warning: half
/// of RabbitMQ 4's default `x-delivery-limit` (20), past which the broker drops or dead-letters the message itself.
pub const DELIVERY_COUNT_WARNING: i64 = 10;

/// A delivery as a [`Record`]: the queue name, [`NO_PARTITION`] and the delivery tag as its position, the
/// message's timestamp property (seconds, AMQP 0-9-1) in milliseconds, its headers as text, its text properties,
/// the exchange and routing key it was published with, and the broker's redelivery mark.
pub fn to_record(queue: Arc<str>, d: lapin::message::Delivery, max_payload_bytes: usize) -> Record {
    let p = &d.properties;
    let headers: Vec<(String, Option<Vec<u8>>)> = p
        .headers()
        .as_ref()
        .map(|h| h.inner().iter().map(|(k, v)| (k.as_str().to_owned(), header_value(v))).collect())
        .unwrap_or_default();
    let delivery_count = p
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").cloned())
        .and_then(|v| integer(&v))
        .unwrap_or(0);
    let mut properties: Vec<(&'static str, String)> = Vec::new();
    let texts = [
        (crate::record::MESSAGE_ID, p.message_id()),
        ("correlation_id", p.correlation_id()),
        ("type", p.kind()),
        ("app_id", p.app_id()),
        ("user_id", p.user_id()),
        ("content_type", p.content_type()),
        ("content_encoding", p.content_encoding()),
        ("reply_to", p.reply_to()),
        ("expiration", p.expiration()),
    ];
    for (name, value) in texts {
        if let Some(v) = value {
            properties.push((name, v.as_str().to_owned()));
        }
    }
    if let Some(ts) = p.timestamp() {
        properties.push(("timestamp", ts.to_string()));
    }
    properties.push(("exchange", d.exchange.as_str().to_owned()));
    properties.push(("routing_key", d.routing_key.as_str().to_owned()));
    let timestamp_ms = p.timestamp().and_then(|s| i64::try_from(s).ok()).and_then(|s| s.checked_mul(1000));
    Record {
        position: Position { topic: queue, partition: NO_PARTITION, offset: d.delivery_tag as i64 },
        timestamp_ms,
        key: None,
        headers,
        payload: None,
        oversized: None,
        properties,
        delivered_before: Some(d.redelivered || delivery_count > 0),
        receipt: crate::record::Receipt::next(),
    }
    .with_payload(Some(&d.data), max_payload_bytes)
}

fn integer(v: &AMQPValue) -> Option<i64> {
    Some(match v {
        AMQPValue::ShortShortInt(i) => i64::from(*i),
        AMQPValue::ShortShortUInt(i) => i64::from(*i),
        AMQPValue::ShortInt(i) => i64::from(*i),
        AMQPValue::ShortUInt(i) => i64::from(*i),
        AMQPValue::LongInt(i) => i64::from(*i),
        AMQPValue::LongUInt(i) => i64::from(*i),
        AMQPValue::LongLongInt(i) => *i,
        _ => return None,
    })
}

/// A header value as the bytes a key or a bound value is read from: strings and byte arrays as they are, numbers
/// and booleans as their text, tables and arrays as JSON; `None` for a void (null) value.
fn header_value(v: &AMQPValue) -> Option<Vec<u8>> {
    Some(match v {
        AMQPValue::Void => return None,
        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
        AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
        AMQPValue::Boolean(b) => b.to_string().into_bytes(),
        AMQPValue::Float(f) => f.to_string().into_bytes(),
        AMQPValue::Double(f) => f.to_string().into_bytes(),
        AMQPValue::Timestamp(t) => t.to_string().into_bytes(),
        other => match integer(other) {
            Some(i) => i.to_string().into_bytes(),
            None => serde_json::to_vec(other).unwrap_or_default(),
        },
    })
}

/// Declares the existing durable `queue` again with `arguments`, on a channel of its own. RabbitMQ has no AMQP
/// request that reads a queue's arguments: such a declare succeeds only if they are equivalent ("inequivalent arg"
/// otherwise, which closes the channel), and never changes an existing queue. The outer error is a channel that
/// could not be opened; the inner one the broker's answer.
async fn redeclare(connection: &Connection, queue: &str, arguments: FieldTable) -> Result<lapin::Result<lapin::Queue>, String> {
    let channel = connection.create_channel().await.map_err(|e| format!("opening a channel: {e}"))?;
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    Ok(channel.queue_declare(queue.into(), durable, arguments).await)
}

/// What `idemflow check` reports about a RabbitMQ pipeline: it connects, checks every queue exists, and verifies
/// the queue type and single active consumer the pipeline asks for. Returns lines to print (`warning: ...` for what
/// could not be verified).
///
/// Errors: the first problem that stops the pipeline from running, as a sentence.
pub async fn check(settings: &RabbitMqSettings, pipeline: &RabbitMqContext) -> Result<Vec<String>, String> {
    let spec = &pipeline.source;
    let scrub = |e: &dyn std::fmt::Display| settings.url.scrub(&e.to_string());
    let connection = connect(settings, ConnectionProperties::default().with_connection_name("idemflow check".into())).await?;
    let mut lines = Vec::new();
    // Every answer is waited for at most `connect_timeout`: lapin leaves a request pending forever when its
    // connection dies under it (seen once in CI: `check` waited with no socket left), and `check` must end.
    let result = async {
        for queue in &spec.queues {
            let channel = connection.create_channel().await.map_err(|e| format!("opening a channel: {}", scrub(&e)))?;
            let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
            let q = channel.queue_declare(queue.as_str().into(), passive, FieldTable::default()).await.map_err(|e| {
                let text = scrub(&e);
                // AMQP's reply code, never the words: 404 NOT_FOUND closes the channel of a passive declare.
                let not_found = matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404);
                if not_found {
                    format!(
                        "queue {queue:?} does not exist on {}: declare it first (durable; a quorum queue is the safe \
                         choice); idemflow consumes queues, it does not declare them",
                        settings.url
                    )
                } else {
                    format!("queue {queue:?}: {text}")
                }
            })?;
            lines.push(format!(
                "pipeline {:?}: queue {queue:?}: {} message(s) ready, {} consumer(s)",
                pipeline.name,
                q.message_count(),
                q.consumer_count()
            ));
            // A stream accepts an equivalent declare with x-queue-type = stream: refuse it (see `fatal`).
            let mut stream = FieldTable::default();
            stream.insert("x-queue-type".into(), AMQPValue::LongString("stream".into()));
            if redeclare(&connection, queue, stream).await.map_err(|e| scrub(&e))?.is_ok() {
                return Err(format!(
                    "queue {queue:?} is a RabbitMQ stream: a stream does not redeliver what a lost consumer had not \
                     acknowledged, so the guarantee cannot hold; consume a quorum or classic queue"
                ));
            }
            let mut expected = FieldTable::default();
            if let Some(t) = spec.queue_type {
                expected.insert("x-queue-type".into(), AMQPValue::LongString(t.as_str().into()));
            }
            if spec.single_active_consumer {
                expected.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
            }
            if expected.inner().is_empty() {
                continue;
            }
            match redeclare(&connection, queue, expected).await.map_err(|e| scrub(&e))? {
                Ok(_) => lines.push(format!(
                    "pipeline {:?}: queue {queue:?}: {}{} as configured",
                    pipeline.name,
                    spec.queue_type.map(|t| format!("type {}", t.as_str())).unwrap_or_default(),
                    if spec.single_active_consumer { ", single active consumer" } else { "" }
                )),
                Err(e) => {
                    let text = scrub(&e);
                    // Only an argument that was asked for is refused: the broker reports the first inequivalent
                    // argument, which may be one the pipeline does not care about.
                    if text.contains("'x-queue-type'") && spec.queue_type.is_some() {
                        return Err(format!("queue {queue:?} is not of [source] queue_type = {:?}: {text}", spec.queue_type.map(|t| t.as_str()).unwrap_or_default()));
                    } else if text.contains("'x-single-active-consumer'") && spec.single_active_consumer {
                        return Err(format!(
                            "queue {queue:?} is not declared with x-single-active-consumer = true, which [source] \
                             single_active_consumer = true requires (per-queue order with several workers): {text}"
                        ));
                    } else {
                        lines.push(format!(
                            "warning: pipeline {:?}: queue {queue:?}: its type and arguments could not be verified ({text}); \
                             see `rabbitmqctl list_queues name type durable arguments`",
                            pipeline.name
                        ));
                    }
                }
            }
        }
        if !spec.single_active_consumer {
            lines.push(format!(
                "pipeline {:?}: several workers on one queue share its deliveries and do not keep its order; declare the \
                 queue with x-single-active-consumer and set [source] single_active_consumer = true if order matters",
                pipeline.name
            ));
        }
        Ok(())
    };
    let result = match tokio::time::timeout(settings.connect_timeout, result).await {
        Ok(result) => result,
        Err(_) => Err(format!("{}: no answer within {:?} while checking the queues", settings.url, settings.connect_timeout)),
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "idemflow check done".into())).await;
    result.map(|()| lines)
}
