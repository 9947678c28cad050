//! A throwaway broker that carries the demo's stream, one shape for the four brokers: started here with its topic,
//! queue or stream ([`ThrowawayBroker::start`]); the pipeline's `[source]` and the settings' broker section for a
//! worker to read it; records published as a user's producer publishes them, each acknowledged by the broker and
//! sent again until it is ([`ThrowawayBroker::publish`], [`ThrowawayBroker::flush`]); and taken down and up again
//! ([`ThrowawayBroker::down`], [`ThrowawayBroker::up`]) for the soak.
//!
//! Kafka is the embedded broker ([`super::kafka`]), whose producer retries by itself. RabbitMQ, RocketMQ and NATS
//! are servers of this process ([`super::rabbitmq`], [`super::rocketmq`], [`super::nats`]), published to by a task
//! of their own that keeps the records in order and sends one again after a failure, while the broker is down. A
//! record sent again may have been stored the first time (its acknowledgement was lost): RabbitMQ and RocketMQ then
//! hold a second copy, a duplicate the stream did not inject, and [`ThrowawayBroker::resent`] says how many such
//! records there may be; a JetStream stream drops it by its `Nats-Msg-Id` (each record's own, [`Outgoing::id`]).

use super::{kafka::EmbeddedKafka, nats, rabbitmq, rocketmq};
use anyhow::{bail, Context as _};
use rdkafka::producer::BaseRecord;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The topic (Kafka, RocketMQ), queue (RabbitMQ) or subject prefix (NATS) the stream goes to.
pub const TOPIC: &str = super::shipped::TOPIC;
/// The JetStream stream, on subjects `payments.>`.
pub const NATS_STREAM: &str = "PAYMENTS";
/// Queues of a RocketMQ topic created on first use ([`rocketmq::broker_properties`]).
const ROCKETMQ_QUEUES: i32 = 4;
/// The broker name of [`rocketmq::broker_properties`].
const ROCKETMQ_BROKER: &str = "broker-a";
/// How long one send waits for the broker's acknowledgement before it is tried again.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// A broker idemflow reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BrokerKind {
    /// librdkafka's mock cluster, embedded.
    Kafka,
    /// Debian's `rabbitmq-server`, a quorum queue.
    Rabbitmq,
    /// The Rust name server and broker from crates.io.
    Rocketmq,
    /// Debian's `nats-server` with JetStream, a stream.
    Nats,
}

impl BrokerKind {
    /// Every broker, in the guarantee matrix's order.
    pub const ALL: [BrokerKind; 4] = [BrokerKind::Kafka, BrokerKind::Rabbitmq, BrokerKind::Rocketmq, BrokerKind::Nats];

    /// Its name in prose.
    pub fn name(self) -> &'static str {
        match self {
            BrokerKind::Kafka => "Kafka",
            BrokerKind::Rabbitmq => "RabbitMQ",
            BrokerKind::Rocketmq => "RocketMQ",
            BrokerKind::Nats => "NATS JetStream",
        }
    }

    /// Its name on the command line.
    pub fn flag(self) -> &'static str {
        match self {
            BrokerKind::Kafka => "kafka",
            BrokerKind::Rabbitmq => "rabbitmq",
            BrokerKind::Rocketmq => "rocketmq",
            BrokerKind::Nats => "nats",
        }
    }

    /// Whether each partition's order reaches the worker (a Kafka partition, a RocketMQ queue, both read by one
    /// consumer at a time). A queue and a JetStream consumer hand a redelivery back after newer messages, so a
    /// copy with another amount may be applied before its original.
    pub fn keeps_order(self) -> bool {
        matches!(self, BrokerKind::Kafka | BrokerKind::Rocketmq)
    }

    /// Whether the worker keeps each record's position with its batch, so that a record it sees again is a
    /// redelivery and a poison record gets one dead letter per position (not a queue, nor a JetStream consumer,
    /// whose redelivered poison message gets a dead letter again).
    pub fn positional(self) -> bool {
        self.keeps_order()
    }
}

/// One record to publish.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The partition (Kafka) or queue (RocketMQ, modulo its 4 queues) it goes to; unused by a queue or a stream.
    pub partition: i32,
    /// This record's own id (not the business key: two copies of an operation have two ids): the message id
    /// (RabbitMQ), the `Nats-Msg-Id` (a JetStream stream drops a re-send of it), the message's KEYS (RocketMQ).
    pub id: String,
    /// The payload.
    pub body: Vec<u8>,
}

/// The running broker.
enum Server {
    Kafka(EmbeddedKafka),
    RabbitMq(rabbitmq::Throwaway),
    RocketMq(rocketmq::Throwaway),
    Nats(nats::Throwaway),
}

/// A throwaway broker with its topic, queue or stream, and its producer.
pub struct ThrowawayBroker {
    kind: BrokerKind,
    /// Kafka's partitions, RocketMQ's queues, or 1.
    partitions: i32,
    server: Server,
    /// RabbitMQ, RocketMQ, NATS: the publishing task.
    publisher: Option<Publisher>,
}

impl ThrowawayBroker {
    /// Starts `kind` with the stream's topic (Kafka: `partitions` partitions), queue or stream.
    ///
    /// Errors: the server is not installed (the message says how to install it) or did not start.
    pub async fn start(kind: BrokerKind, partitions: i32) -> anyhow::Result<ThrowawayBroker> {
        let server = match kind {
            BrokerKind::Kafka => {
                let kafka = EmbeddedKafka::start()?;
                kafka.create_topic(TOPIC, partitions)?;
                Server::Kafka(kafka)
            }
            BrokerKind::Rabbitmq => {
                let node = tokio::task::block_in_place(rabbitmq::Throwaway::start)?;
                rabbitmq::declare_quorum_queue(&node.url(), TOPIC).await.context("declaring the queue")?;
                Server::RabbitMq(node)
            }
            BrokerKind::Rocketmq => Server::RocketMq(tokio::task::block_in_place(rocketmq::Throwaway::start)?),
            BrokerKind::Nats => {
                let server = tokio::task::block_in_place(nats::Throwaway::start)?;
                nats::create_stream(&server.url(), NATS_STREAM, TOPIC).await?;
                Server::Nats(server)
            }
        };
        let publisher = match &server {
            Server::Kafka(_) => None,
            Server::RabbitMq(node) => Some(Publisher::spawn(Sender::RabbitMq { url: node.url(), channel: None })),
            Server::RocketMq(node) => Some(Publisher::spawn(Sender::RocketMq { name_server: node.name_server(), producer: None, routed: false })),
            Server::Nats(server) => Some(Publisher::spawn(Sender::Nats { url: server.url(), js: None })),
        };
        let partitions = match kind {
            BrokerKind::Kafka => partitions,
            BrokerKind::Rocketmq => ROCKETMQ_QUEUES,
            BrokerKind::Rabbitmq | BrokerKind::Nats => 1,
        };
        Ok(ThrowawayBroker { kind, partitions, server, publisher })
    }

    /// Where it is and what it holds, for a user to look at: `Kafka (embedded broker): 127.0.0.1:PORT (topic
    /// payments, ...)`, the RabbitMQ URL without its password, ...
    pub fn describe(&self) -> String {
        match &self.server {
            Server::Kafka(kafka) => format!(
                "Kafka (embedded broker): {} (topic {TOPIC}, {} partitions, consumer group idemflow-payments)",
                kafka.bootstrap_servers(),
                self.partitions
            ),
            Server::RabbitMq(node) => format!("RabbitMQ: {} (quorum queue {TOPIC}; user guest, from localhost only)", crate::secret::mask_url(&node.url())),
            Server::RocketMq(node) => format!("RocketMQ: name server {} (topic {TOPIC}, {ROCKETMQ_QUEUES} queues)", node.name_server()),
            Server::Nats(server) => {
                format!("NATS JetStream: {} (stream {NATS_STREAM}, subjects {TOPIC}.>, durable consumer idemflow-payments)", server.url())
            }
        }
    }

    /// Which broker this is.
    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    /// How many partitions the stream should be spread over: Kafka's topic's, RocketMQ's 4 queues, 1 for a queue
    /// or a stream.
    pub fn partitions(&self) -> i32 {
        self.partitions
    }

    /// What replaces `topics = ["payments"]` in a shipped pipeline to read this broker: RocketMQ with its
    /// positions stored with each batch, as the shipped RocketMQ example.
    pub fn source_toml(&self) -> String {
        match self.kind {
            BrokerKind::Rocketmq => format!("{}\n[offsets]\nstore = \"database\"", self.source_for(TOPIC)),
            BrokerKind::Nats => self.source_for(NATS_STREAM),
            BrokerKind::Kafka | BrokerKind::Rabbitmq => self.source_for(TOPIC),
        }
    }

    /// Where its clients connect: Kafka's bootstrap servers, RabbitMQ's AMQP URL, RocketMQ's name server, the NATS
    /// URL.
    pub fn address(&self) -> String {
        match &self.server {
            Server::Kafka(kafka) => kafka.bootstrap_servers().to_owned(),
            Server::RabbitMq(node) => node.url(),
            Server::RocketMq(node) => node.name_server(),
            Server::Nats(server) => server.url(),
        }
    }

    /// What the server says of its version, for an environment table (empty if it says nothing).
    pub fn version(&self) -> String {
        match &self.server {
            Server::Kafka(_) => "librdkafka's mock cluster".to_owned(),
            Server::RabbitMq(node) => node.ctl(&["version"]).map(|v| format!("RabbitMQ {}", v.trim())).unwrap_or_default(),
            Server::RocketMq(_) => "RocketMQ name server and broker, the Rust implementation from crates.io".to_owned(),
            Server::Nats(server) => server.version(),
        }
    }

    /// Makes another stream, `name`, beside the demo's: a topic of as many partitions (Kafka), a quorum queue
    /// (RabbitMQ), a stream on subjects `<name>.>` (NATS); RocketMQ's topic is made by its first message.
    ///
    /// Errors: the broker refused.
    pub async fn create(&self, name: &str) -> anyhow::Result<()> {
        match &self.server {
            Server::Kafka(kafka) => kafka.create_topic(name, self.partitions)?,
            Server::RabbitMq(node) => rabbitmq::declare_quorum_queue(&node.url(), name).await?,
            Server::RocketMq(_) => {}
            Server::Nats(server) => nats::create_stream(&server.url(), name, name).await?,
        }
        Ok(())
    }

    /// Publishes `messages` (id, body) to stream `name` (made by [`ThrowawayBroker::create`]) and returns once the
    /// broker acknowledged every one; a failure is an error, nothing is sent again (a bench's stream, published
    /// before timing starts). NATS: on subject `<name>.payments`, without `Nats-Msg-Id` (the stream keeps every copy).
    ///
    /// Errors: a message was not acknowledged.
    pub async fn publish_to(&self, name: &str, messages: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
        match &self.server {
            Server::Kafka(kafka) => {
                for (_, body) in messages {
                    kafka.send(BaseRecord::<[u8], [u8]>::to(name).payload(body))?;
                }
                Ok(tokio::task::block_in_place(|| kafka.flush())?)
            }
            Server::RabbitMq(node) => rabbitmq::publish(&node.url(), name, messages).await,
            Server::RocketMq(node) => {
                let bodies: Vec<Vec<u8>> = messages.iter().map(|(_, body)| body.clone()).collect();
                rocketmq::publish(&node.name_server(), name, &bodies).await
            }
            Server::Nats(server) => nats::publish(&server.url(), &format!("{name}.payments"), messages, false).await.map(drop),
        }
    }

    /// The `[source]` reading stream `name` (made by [`ThrowawayBroker::create`]), as [`ThrowawayBroker::source_toml`]
    /// reads the demo's.
    pub fn source_for(&self, name: &str) -> String {
        match self.kind {
            BrokerKind::Kafka => format!("topics = [\"{name}\"]"),
            BrokerKind::Rabbitmq => format!("[source]\nkind = \"rabbitmq\"\nqueue = \"{name}\""),
            BrokerKind::Rocketmq => format!("[source]\nkind = \"rocketmq\"\ntopic = \"{name}\""),
            BrokerKind::Nats => format!("[source]\nkind = \"nats\"\nstream = \"{name}\""),
        }
    }

    /// The settings' broker section (`[kafka]`, `[rabbitmq]`, `[rocketmq]`, `[nats]`), with timeouts that notice a
    /// broker gone within seconds.
    pub fn settings_toml(&self) -> String {
        match &self.server {
            Server::Kafka(kafka) => format!(
                "[kafka]\nbootstrap_servers = \"{}\"\n[kafka.properties]\n\"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"500\"\n",
                kafka.bootstrap_servers()
            ),
            Server::RabbitMq(node) => format!("[rabbitmq]\nurl = \"{}\"\nheartbeat = \"5s\"\nconnect_timeout = \"5s\"\n", node.url()),
            Server::RocketMq(node) => format!("[rocketmq]\nname_server = \"{}\"\n", node.name_server()),
            Server::Nats(server) => format!("[nats]\nurl = \"{}\"\nconnect_timeout = \"5s\"\nrequest_timeout = \"5s\"\n", server.url()),
        }
    }

    /// The port whose packets the soak drops: the broker's (not RocketMQ's name server's).
    pub fn port(&self) -> anyhow::Result<u16> {
        let from_url = |url: &str| url.rsplit_once(':').and_then(|(_, p)| p.split('/').next()?.parse().ok());
        match &self.server {
            Server::Kafka(kafka) => from_url(kafka.bootstrap_servers()),
            Server::RabbitMq(node) => from_url(&node.url()),
            Server::RocketMq(node) => Some(node.broker_port()),
            Server::Nats(server) => Some(server.port()),
        }
        .context("the broker's port")
    }

    /// Publishes `records` in order: Kafka's producer takes them at once; the others' task sends them (and again
    /// after a failure) while the caller goes on.
    ///
    /// Errors: Kafka's producer refused a record (its queue full), or the publishing task ended.
    pub fn publish(&mut self, records: Vec<Outgoing>) -> anyhow::Result<()> {
        match (&self.server, &mut self.publisher) {
            (Server::Kafka(kafka), _) => {
                for r in &records {
                    kafka.send(BaseRecord::<[u8], [u8]>::to(TOPIC).partition(r.partition).payload(&r.body))?;
                }
                Ok(())
            }
            (_, Some(p)) => {
                // In slices of 1,000: one send each, its acknowledgements awaited together.
                let mut records = records.into_iter().peekable();
                while records.peek().is_some() {
                    p.queue(records.by_ref().take(1000).collect())?;
                }
                Ok(())
            }
            (_, None) => bail!("no publisher"),
        }
    }

    /// Waits until every record published so far is acknowledged by the broker, at most `timeout`.
    ///
    /// Errors: not all were acknowledged within `timeout` (the broker down, say).
    pub async fn flush(&mut self, timeout: Duration) -> anyhow::Result<()> {
        match (&self.server, &self.publisher) {
            (Server::Kafka(kafka), _) => Ok(tokio::task::block_in_place(|| kafka.flush())?),
            (_, Some(p)) => p.flush(timeout).await,
            (_, None) => Ok(()),
        }
    }

    /// Records sent again after a failure whose first send may have been stored: at most this many copies the
    /// stream did not inject (0 for Kafka, whose producer retries by itself, and for NATS, whose stream drops a
    /// re-sent `Nats-Msg-Id`).
    pub fn resent(&self) -> u64 {
        match (&self.server, &self.publisher) {
            (Server::RabbitMq(_) | Server::RocketMq(_), Some(p)) => p.resent.load(Ordering::Relaxed),
            _ => 0,
        }
    }

    /// Publishes the NATS stream dropped as duplicates of a `Nats-Msg-Id` it had seen within its duplicate window
    /// (2 minutes by default): a re-send, or a record whose [`Outgoing::id`] another had.
    pub fn dropped(&self) -> u64 {
        self.publisher.as_ref().map_or(0, |p| p.dropped.load(Ordering::Relaxed))
    }

    /// Takes the broker down: Kafka's broker refuses connections and drops those it had; RabbitMQ's node stops
    /// (`rabbitmqctl stop`); RocketMQ's broker and the NATS server are killed (SIGKILL).
    ///
    /// Errors: the server could not be stopped.
    pub fn down(&mut self) -> anyhow::Result<()> {
        match &mut self.server {
            Server::Kafka(kafka) => kafka.mock().broker_down(1)?,
            Server::RabbitMq(node) => tokio::task::block_in_place(|| node.stop())?,
            Server::RocketMq(node) => node.broker_down(),
            Server::Nats(server) => server.crash(),
        }
        Ok(())
    }

    /// Brings the broker back on the same port and data.
    ///
    /// Errors: the server did not start again.
    pub fn up(&mut self) -> anyhow::Result<()> {
        match &mut self.server {
            Server::Kafka(kafka) => kafka.mock().broker_up(1)?,
            Server::RabbitMq(node) => tokio::task::block_in_place(|| node.start_again())?,
            Server::RocketMq(node) => tokio::task::block_in_place(|| node.broker_up())?,
            Server::Nats(server) => tokio::task::block_in_place(|| server.start_again())?,
        }
        Ok(())
    }
}

/// The publishing task of a broker other than Kafka: records in order, each sent until acknowledged.
struct Publisher {
    tx: mpsc::UnboundedSender<Vec<Outgoing>>,
    queued: u64,
    acknowledged: Arc<AtomicU64>,
    resent: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
    failure: Arc<std::sync::Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Publisher {
    /// A broker given up on (its server gone) leaves no task sending to it.
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Publisher {
    fn spawn(mut sender: Sender) -> Publisher {
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Outgoing>>();
        let acknowledged = Arc::new(AtomicU64::new(0));
        let resent = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let failure = Arc::new(std::sync::Mutex::new(None));
        let (acked, again, failed, duplicate) = (acknowledged.clone(), resent.clone(), failure.clone(), dropped.clone());
        let task = tokio::spawn(async move {
            while let Some(mut batch) = rx.recv().await {
                let mut backoff = Duration::from_millis(200);
                while !batch.is_empty() {
                    let attempted = batch.len() as u64;
                    match sender.send(&batch, &duplicate).await {
                        Ok(()) => {
                            acked.fetch_add(attempted, Ordering::Relaxed);
                            batch.clear();
                        }
                        Err(SendError { stored, uncertain, error }) => {
                            // `stored` are acknowledged (sent no more); of the rest, `uncertain` may have been stored.
                            acked.fetch_add(stored.len() as u64, Ordering::Relaxed);
                            let mut index = 0;
                            batch.retain(|_| {
                                index += 1;
                                !stored.contains(&(index - 1))
                            });
                            again.fetch_add(uncertain as u64, Ordering::Relaxed);
                            *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
            }
        });
        Publisher { tx, queued: 0, acknowledged, resent, dropped, failure, task }
    }

    fn queue(&mut self, records: Vec<Outgoing>) -> anyhow::Result<()> {
        self.queued += records.len() as u64;
        self.tx.send(records).map_err(|_| anyhow::anyhow!("the publishing task ended"))
    }

    async fn flush(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while self.acknowledged.load(Ordering::Relaxed) < self.queued {
            if Instant::now() > deadline {
                let last = self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default();
                bail!(
                    "{} of {} records acknowledged by the broker after {timeout:?} (the last failure: {last})",
                    self.acknowledged.load(Ordering::Relaxed),
                    self.queued
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }
}

/// A failed send of a batch: which of its records were acknowledged (their indices), how many of the rest may have
/// been stored anyway, and why.
struct SendError {
    stored: Vec<usize>,
    uncertain: usize,
    error: String,
}

impl SendError {
    fn before_sending(error: impl std::fmt::Display) -> SendError {
        SendError { stored: Vec::new(), uncertain: 0, error: error.to_string() }
    }
}

/// A RocketMQ producer and the client runtime it runs on.
type RocketMqProducer = (crate::source::rocketmq::Runtime, rocketmq_client_rust::DefaultMQProducer);

/// A producer that connects again after a failure.
enum Sender {
    /// Publisher confirms on a channel (RabbitMQ documentation, "Consumer Acknowledgements and Publisher
    /// Confirms"), persistent messages through the default exchange.
    RabbitMq { url: String, channel: Option<(lapin::Connection, lapin::Channel)> },
    /// Synchronous batch sends, one per queue.
    RocketMq {
        name_server: String,
        producer: Option<Box<RocketMqProducer>>,
        /// Whether the topic exists (a send has succeeded).
        routed: bool,
    },
    /// JetStream publishes, each acknowledged by the stream.
    Nats { url: String, js: Option<async_nats::jetstream::Context> },
}

impl Sender {
    /// Sends `batch` in order; a NATS publish the stream dropped as a duplicate adds one to `dropped`.
    async fn send(&mut self, batch: &[Outgoing], dropped: &AtomicU64) -> Result<(), SendError> {
        let result = match self {
            Sender::RabbitMq { url, channel } => Self::send_rabbitmq(url, channel, batch).await,
            Sender::RocketMq { name_server, producer, routed } => Self::send_rocketmq(name_server, producer, routed, batch).await,
            Sender::Nats { url, js } => Self::send_nats(url, js, batch, dropped).await,
        };
        if result.is_err() {
            self.disconnect().await;
        }
        result
    }

    async fn disconnect(&mut self) {
        match self {
            Sender::RabbitMq { channel, .. } => {
                if let Some((connection, _)) = channel.take() {
                    let _ = tokio::time::timeout(Duration::from_secs(1), connection.close(200, "reconnecting".into())).await;
                }
            }
            Sender::RocketMq { producer, .. } => {
                if let Some((runtime, mut p)) = producer.take().map(|b| *b) {
                    p.shutdown().await;
                    runtime.shutdown().await;
                }
            }
            Sender::Nats { .. } => {}
        }
    }

    async fn send_rabbitmq(url: &str, channel: &mut Option<(lapin::Connection, lapin::Channel)>, batch: &[Outgoing]) -> Result<(), SendError> {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        if channel.is_none() {
            let opened = tokio::time::timeout(SEND_TIMEOUT, async {
                let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
                let ch = connection.create_channel().await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                Ok::<_, lapin::Error>((connection, ch))
            })
            .await;
            match opened {
                Ok(Ok(c)) => *channel = Some(c),
                Ok(Err(e)) => return Err(SendError::before_sending(format!("connecting to RabbitMQ: {e}"))),
                Err(_) => return Err(SendError::before_sending("connecting to RabbitMQ: no answer")),
            }
        }
        let ch = &channel.as_ref().expect("opened above").1;
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            let props = lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(m.id.as_str().into());
            match ch.basic_publish("".into(), TOPIC.into(), BasicPublishOptions::default(), &m.body, props).await {
                Ok(confirm) => pending.push(confirm),
                // The ones before may be stored; this one and those after were not sent.
                Err(e) => return Err(SendError { stored: Vec::new(), uncertain: pending.len(), error: format!("publishing: {e}") }),
            }
        }
        let sent = pending.len();
        for (stored, p) in pending.into_iter().enumerate() {
            let failed = |error: String| SendError { stored: (0..stored).collect(), uncertain: sent - stored, error };
            match tokio::time::timeout(SEND_TIMEOUT, p).await {
                Ok(Ok(lapin::Confirmation::Ack(_))) => {}
                Ok(Ok(other)) => return Err(failed(format!("not confirmed: {other:?}"))),
                Ok(Err(e)) => return Err(failed(format!("waiting for confirms: {e}"))),
                Err(_) => return Err(failed("no confirm within 10 s".into())),
            }
        }
        Ok(())
    }

    async fn send_rocketmq(
        name_server: &str,
        producer: &mut Option<Box<RocketMqProducer>>,
        routed: &mut bool,
        batch: &[Outgoing],
    ) -> Result<(), SendError> {
        use rocketmq_model::common::message::message_queue::MessageQueue;
        use rocketmq_model::common::message::message_single::Message;
        if producer.is_none() {
            let started = rocketmq::start_producer(name_server, &format!("idemflow-soak-{}", std::process::id())).await;
            *producer = Some(Box::new(started.map_err(|e| SendError::before_sending(format!("{e:#}")))?));
        }
        let p = &producer.as_ref().expect("started above").1;
        let message = |m: &Outgoing| Message::builder().topic(TOPIC).keys(vec![m.id.clone()]).body_slice(&m.body).build();
        // The indices acknowledged so far: on a failure they are not sent again.
        let mut stored: Vec<usize> = Vec::new();
        if !*routed {
            // The topic does not exist yet: the first send, to a queue the producer chooses, creates it
            // (autoCreateTopicEnable); a send to a queue of a topic without a route is refused. That record is the
            // stream's first, a first occurrence; the stream reuses no order id that early, so no copy of it
            // follows in another queue (the exact checks would see one applied before it).
            let m = message(&batch[0]).map_err(|e| SendError::before_sending(e.to_string()))?;
            match tokio::time::timeout(SEND_TIMEOUT, p.send(m)).await {
                Ok(Ok(_)) => {
                    *routed = true;
                    stored.push(0);
                }
                Ok(Err(e)) => return Err(SendError::before_sending(format!("creating topic {TOPIC}: {e}"))),
                Err(_) => return Err(SendError { stored, uncertain: 1, error: format!("creating topic {TOPIC}: no answer within 10 s") }),
            }
        }
        // One synchronous batch send per queue, in the records' order within each queue.
        for queue in 0..ROCKETMQ_QUEUES {
            let of_queue: Vec<usize> =
                (0..batch.len()).filter(|i| !stored.contains(i) && batch[*i].partition.rem_euclid(ROCKETMQ_QUEUES) == queue).collect();
            if of_queue.is_empty() {
                continue;
            }
            let messages: Result<Vec<Message>, _> = of_queue.iter().map(|i| message(&batch[*i])).collect();
            let messages = messages.map_err(|e| SendError::before_sending(e.to_string()))?;
            let sending = p.send_batch_to_queue(messages, MessageQueue::from_parts(TOPIC, ROCKETMQ_BROKER, queue));
            match tokio::time::timeout(SEND_TIMEOUT, sending).await {
                Ok(Ok(_)) => stored.extend(of_queue),
                failed => {
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "no answer within 10 s".to_owned(),
                    };
                    // The queues sent before are stored; this queue's records may have been.
                    return Err(SendError { stored, uncertain: of_queue.len(), error });
                }
            }
        }
        Ok(())
    }

    async fn send_nats(url: &str, js: &mut Option<async_nats::jetstream::Context>, batch: &[Outgoing], dropped: &AtomicU64) -> Result<(), SendError> {
        if js.is_none() {
            let client = tokio::time::timeout(SEND_TIMEOUT, async_nats::connect(url)).await;
            match client {
                Ok(Ok(c)) => *js = Some(async_nats::jetstream::new(c)),
                Ok(Err(e)) => return Err(SendError::before_sending(format!("connecting to {url}: {e}"))),
                Err(_) => return Err(SendError::before_sending(format!("connecting to {url}: no answer"))),
            }
        }
        let js = js.as_ref().expect("connected above");
        let subject = format!("{TOPIC}.created");
        let mut acks = Vec::with_capacity(batch.len());
        for m in batch {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(crate::source::nats::MSG_ID_HEADER, m.id.as_str());
            match js.publish_with_headers(subject.clone(), headers, bytes::Bytes::copy_from_slice(&m.body)).await {
                Ok(ack) => acks.push(ack),
                Err(e) => return Err(SendError::before_sending(format!("publishing: {e}"))),
            }
        }
        // A re-send is dropped by the stream (its Nats-Msg-Id seen within the duplicate window): nothing uncertain.
        for (stored, ack) in acks.into_iter().enumerate() {
            let failed = |error: String| SendError { stored: (0..stored).collect(), uncertain: 0, error };
            match tokio::time::timeout(SEND_TIMEOUT, ack).await {
                Ok(Ok(ack)) => {
                    if ack.duplicate {
                        dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(Err(e)) => return Err(failed(format!("not acknowledged: {e}"))),
                Err(_) => return Err(failed("no acknowledgement within 10 s".into())),
            }
        }
        Ok(())
    }
}
