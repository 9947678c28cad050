//! Sources: where a pipeline's records come from, one module per broker.
//!
//! - [`kafka`]: a consumer-group member; positions are (topic, partition, offset), committed after each batch.
//! - [`rabbitmq`]: one consumer per queue; a batch is acknowledged (`basic.ack` with `multiple`) after it commits.
//! - [`rocketmq`]: a consumer-group member (clustering); positions are (topic/broker, queue id, queue offset), the
//!   consume offsets updated after each batch.
//! - [`nats`]: a durable JetStream pull consumer; positions are (stream, 0, stream sequence), each delivery
//!   acknowledged with a double ack after its batch commits.
//!
//! The worker drives every source through [`Source`], a closed enum over them: batches in, "durable up to here"
//! out, pauses while the store retries, and the records to drop when ownership moves (a Kafka rebalance, a lost
//! RabbitMQ channel). What only some sources can do (rewind, stored offsets, topic retention) is refused for the
//! others by the configuration checks, with the reason. A new broker is a new module here and a new variant.

// A build without some brokers leaves their arms out: the parameters and imports only they use are then unused.
#![cfg_attr(not(all(feature = "kafka", feature = "rabbitmq", feature = "rocketmq", feature = "nats")), allow(unused_variables, unused_imports))]

pub mod check;
pub mod kafka;
pub mod nats;
pub mod rabbitmq;
pub mod rewind;
pub mod rocketmq;
pub mod spec;

use crate::batch::{Batch, BatchSettings, Records};
use crate::dead_letter::DeadLetterSettings;
use crate::offsets::OffsetStore;
use spec::SourceSpec;
use crate::metrics::PipelineMetrics;
use crate::offsets::Positions;
use crate::record::Record;
use crate::shutdown::Shutdown;
use std::time::Duration;

#[cfg(feature = "kafka")]
pub use kafka::KafkaSource;
pub use kafka::KafkaSettings;
pub use rabbitmq::RabbitMqSettings;
pub use rocketmq::RocketMqSettings;
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::RabbitMqSource;
#[cfg(feature = "rocketmq")]
pub use rocketmq::RocketMqSource;
pub use nats::NatsSettings;
#[cfg(feature = "nats")]
pub use nats::NatsSource;

/// What a source is given of its pipeline: the pipeline's name and `[source]`, and what of the rest of the file
/// decides how it reads. The configuration builds it (`Pipeline::source_context`); a source never sees the rest.
#[derive(Clone, Debug)]
pub struct SourceContext {
    /// The pipeline's name: the default consumer group's suffix, the `pipeline` label of its metrics.
    pub name: String,
    /// `[source]`.
    pub source: SourceSpec,
    /// `[batch]`: a batch's bounds and the number of lanes (prefetch bounds follow from them).
    pub batch: BatchSettings,
    /// `max_payload_bytes`: larger payloads are not kept whole ([`crate::record::bounded`]).
    pub max_payload_bytes: usize,
    /// `[dedup] retention`, which a rewind and the topics' retention are compared with.
    pub dedup_retention: Duration,
    /// `[dead_letters]`: the broker's own dead-letter publisher, when the pipeline names one.
    pub dead_letters: DeadLetterSettings,
    /// `[offsets] store`: where the consumed positions are kept.
    pub offsets: OffsetStore,
}

/// The brokers' settings (`[kafka]`, `[rabbitmq]`, `[rocketmq]`), and the shutdown deadline their clients must
/// leave their groups within (`[shutdown] timeout`).
#[derive(Clone, Debug, Default)]
pub struct Brokers {
    /// `[kafka]` (defaults when absent: a Kafka pipeline's own checks then say what is missing).
    pub kafka: KafkaSettings,
    /// `[rabbitmq]`, required by RabbitMQ pipelines.
    pub rabbitmq: Option<RabbitMqSettings>,
    /// `[rocketmq]`, required by RocketMQ pipelines.
    pub rocketmq: Option<RocketMqSettings>,
    /// `[nats]`, required by NATS JetStream pipelines.
    pub nats: Option<NatsSettings>,
    /// `[shutdown] timeout`.
    pub shutdown_timeout: Duration,
}

/// What a source needs to start partitions (Kafka) or queues (RocketMQ) from their stored positions
/// (`[offsets] store = "database"`).
pub struct StoredStart {
    /// The store that keeps the positions.
    pub store: crate::store::Store,
    /// Recorded as the owner of claimed partitions (for operators): `host/pid` by default.
    pub owner: String,
    /// The runtime the Kafka source's claim tasks run on.
    pub runtime: tokio::runtime::Handle,
    /// Ends the claim's retries.
    pub shutdown: Shutdown,
}

/// A pipeline's source.
pub enum Source {
    /// Kafka topics.
    #[cfg(feature = "kafka")]
    Kafka(KafkaSource),
    /// RabbitMQ queues.
    #[cfg(feature = "rabbitmq")]
    RabbitMq(RabbitMqSource),
    /// A RocketMQ topic.
    #[cfg(feature = "rocketmq")]
    RocketMq(RocketMqSource),
    /// A NATS JetStream durable consumer.
    #[cfg(feature = "nats")]
    Nats(NatsSource),
}

impl Source {
    /// The source of `pipeline`. `stored` applies to Kafka and RocketMQ with `[offsets] store = "database"`.
    ///
    /// Errors: the consumer could not be created (a bad librdkafka property, a missing broker section), as text.
    pub fn new(
        settings: &Brokers,
        pipeline: &SourceContext,
        metrics: PipelineMetrics,
        stored: Option<StoredStart>,
    ) -> Result<Source, String> {
        match &pipeline.source {
            #[cfg(feature = "kafka")]
            SourceSpec::Kafka(_) => KafkaSource::new(&settings.kafka, pipeline, metrics, stored)
                .map(Source::Kafka)
                .map_err(|e| format!("cannot create the Kafka consumer: {}", kafka::describe_kafka_error(&e))),
            #[cfg(feature = "rabbitmq")]
            SourceSpec::RabbitMq(_) => {
                let rabbitmq = settings.rabbitmq.as_ref().ok_or("[rabbitmq] url is not set")?;
                Ok(Source::RabbitMq(RabbitMqSource::new(rabbitmq, pipeline, metrics)))
            }
            #[cfg(feature = "rocketmq")]
            SourceSpec::RocketMq(_) => {
                let rocketmq = settings.rocketmq.as_ref().ok_or("[rocketmq] name_server is not set")?;
                RocketMqSource::new(rocketmq, pipeline, metrics, stored).map(Source::RocketMq)
            }
            #[cfg(feature = "nats")]
            SourceSpec::Nats(_) => {
                let nats = settings.nats.as_ref().ok_or("[nats] url is not set")?;
                NatsSource::new(nats, pipeline, metrics).map(Source::Nats)
            }
            #[cfg(not(feature = "nats"))]
            SourceSpec::Nats(_) => Err(not_built("NATS JetStream", "nats")),
            #[cfg(not(feature = "kafka"))]
            SourceSpec::Kafka(_) => Err(not_built("Kafka", "kafka")),
            #[cfg(not(feature = "rabbitmq"))]
            SourceSpec::RabbitMq(_) => Err(not_built("RabbitMQ", "rabbitmq")),
            #[cfg(not(feature = "rocketmq"))]
            SourceSpec::RocketMq(_) => Err(not_built("RocketMQ", "rocketmq")),
        }
    }

    /// The next batch: at least one record, at most `settings.max_records`, waiting at most `max_wait` after the
    /// first; or (Kafka, RocketMQ) an empty batch after a second without records, so the worker can do its idle checks.
    /// `None` once shutdown comes while waiting for a first record.
    pub async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.next_batch(settings, shutdown).await,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.next_batch(settings, shutdown).await,
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.next_batch(settings, shutdown).await,
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.next_batch(settings, shutdown).await,
        }
    }

    /// Waits `delay` before a retry without taking more records than the source's prefetch bound, serving the
    /// broker meanwhile; drops from `batch` what this worker no longer owns. `false` if shutdown came first.
    pub async fn pause_for(&mut self, delay: Duration, batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.pause_for(delay, batch, shutdown).await,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.pause_for(delay, batch, shutdown).await,
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.pause_for(delay, batch, shutdown).await,
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.pause_for(delay, batch, shutdown).await,
        }
    }

    /// The positions a batch stores in its transaction (`[offsets] store = "database"`; Kafka and RocketMQ).
    pub fn positions<P>(&self, batch: &Batch<P>) -> Option<Positions> {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.positions(batch.next_offsets()),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.positions(batch.next_offsets()),
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(_) => None,
            #[cfg(feature = "nats")]
            Source::Nats(_) => None,
        }
    }

    /// Runs `work` (spawned: a claim, a rebuild of the statements) to its end while the source keeps serving its
    /// broker.
    pub async fn poll_while<T>(&mut self, work: tokio::task::JoinHandle<T>) -> T {
        self.poll_while_receiving(work, &mut |_| {}).await
    }

    /// Runs `work` (the batch transaction, spawned) to its end while the source keeps serving its broker, calling
    /// `received` once for each record the source receives meanwhile and keeps for a later batch (in the order
    /// received; the worker prepares them ahead, see [`crate::prepare::Ahead`]). A record passed to `received` may
    /// still be dropped before its batch (its partition revoked, its channel lost). RocketMQ's client buffers
    /// what it pulls on its own runtime: nothing is received here, and nothing is passed.
    pub async fn poll_while_receiving<T>(
        &mut self,
        work: tokio::task::JoinHandle<T>,
        received: &mut (dyn FnMut(&Record) + Send),
    ) -> T {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.poll_while(work, received).await,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.poll_while(work, received).await,
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => {
                let _ = received;
                s.poll_while(work).await
            }
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.poll_while(work, received).await,
        }
    }

    /// Why the pipeline must stop, when [`Source::next_batch`] returned `None` for a reason other than shutdown
    /// (a RabbitMQ stream found where a queue was expected, a RocketMQ consumer that could not start).
    pub fn fatal(&self) -> Option<String> {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(_) => None,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.fatal().map(str::to_owned),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.fatal().map(str::to_owned),
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.fatal().map(str::to_owned),
        }
    }

    /// Drops from `batch` the records this worker no longer owns (partitions revoked, a lost channel).
    pub fn drop_revoked(&mut self, batch: &mut dyn Records) {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.drop_revoked(batch),
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.drop_revoked(batch),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.drop_revoked(batch),
            #[cfg(feature = "nats")]
            Source::Nats(_) => {}
        }
    }

    /// After a batch committed to the broker that ended below processed floors (a group that started over:
    /// [`crate::sink::BatchOutcome::floors`]): moves those partitions on to their floors where nothing below them can
    /// have been missed, so what was processed below them is not fetched to be skipped. Kafka only; RocketMQ's queues
    /// fetch and skip.
    #[cfg_attr(not(feature = "kafka"), allow(unused_variables))]
    pub fn skip_to_floors(&mut self, floors: &[crate::offsets::PassedFloor]) {
        if floors.is_empty() {
            return;
        }
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.skip_to_floors(floors),
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }

    /// A batch was fenced (`[offsets] store = "database"`): gives up `partitions` and drops their records.
    /// Only sources with positions (Kafka, RocketMQ) store them, so only they can be fenced.
    pub async fn lose(&mut self, partitions: &[(String, i32)], used: Option<&Positions>, batch: &mut dyn Records) {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.lose(partitions, used, batch),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.lose(partitions, used, batch).await,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(_) => {}
            #[cfg(feature = "nats")]
            Source::Nats(_) => {}
        }
    }

    /// The partitions (Kafka) or queues (RocketMQ: `topic/broker`, queue id) assigned to this worker now; none for
    /// a RabbitMQ queue.
    pub fn owned(&self) -> Vec<(String, i32)> {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.owned(),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.owned(),
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(_) => Vec::new(),
            #[cfg(feature = "nats")]
            Source::Nats(_) => Vec::new(),
        }
    }

    /// The store lost positions this worker had stored (see the sink's `SinkError::Lost`): starts the partitions
    /// of `claimed` again from the positions it kept, dropping their records from `batch`. Only sources with stored
    /// positions (Kafka, RocketMQ) can lose them.
    ///
    /// Errors: the consumer could not be moved.
    pub async fn resync(&mut self, claimed: &[crate::offsets::Claimed], batch: &mut dyn Records) -> Result<(), String> {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.resync(claimed, batch),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.resync(claimed, batch).await,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(_) => Ok(()),
            #[cfg(feature = "nats")]
            Source::Nats(_) => Ok(()),
        }
    }

    /// Tells the broker that `batch` (committed in the store) is done: Kafka offsets are committed, RabbitMQ
    /// deliveries acknowledged, RocketMQ consume offsets updated, JetStream deliveries double-acked.
    pub async fn commit<P>(&mut self, batch: &Batch<P>) {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.commit(batch.next_offsets()),
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.commit(batch.next_offsets()).await,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.commit(batch.records()).await,
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.commit(batch.records()).await,
        }
    }

    /// Ends without telling the broker anything more (an injected crash).
    pub async fn abandon(self) {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.abandon(),
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.abandon().await,
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.abandon().await,
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.abandon().await,
        }
    }

    /// Ends cleanly: commits what is durable (Kafka), leaves the group or closes the connection.
    pub async fn close(self) {
        match self {
            #[cfg(feature = "kafka")]
            Source::Kafka(s) => s.close(),
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq(s) => s.close().await,
            #[cfg(feature = "rocketmq")]
            Source::RocketMq(s) => s.close().await,
            #[cfg(feature = "nats")]
            Source::Nats(s) => s.close().await,
        }
    }
}

/// Rewinds `pipeline`'s group (and its stored positions in `store`, with `[offsets] store = "database"`), printing
/// the plan, one line per partition or queue, and what happened.
///
/// Errors: the source has no positions (a queue), the group has members, a broker or store request failed; the
/// message names the pipeline's file where it is about the pipeline.
#[cfg_attr(not(all(feature = "kafka", feature = "rocketmq")), allow(unused_variables))]
pub async fn rewind_group(
    brokers: &Brokers,
    pipeline: &SourceContext,
    file: &std::path::Path,
    request: rewind::Request,
    store: Option<rewind::StoreSide<'_>>,
) -> anyhow::Result<()> {
    match &pipeline.source {
        #[cfg(feature = "kafka")]
        SourceSpec::Kafka(_) => kafka::rewind::run(&brokers.kafka, pipeline, request, store).await,
        #[cfg(feature = "rocketmq")]
        SourceSpec::RocketMq(_) => rocketmq::rewind::run(brokers.rocketmq.as_ref(), pipeline, file, request, store).await,
        #[cfg(not(feature = "kafka"))]
        SourceSpec::Kafka(_) => anyhow::bail!("{}: {}", file.display(), not_built("Kafka", "kafka")),
        #[cfg(not(feature = "rocketmq"))]
        SourceSpec::RocketMq(_) => anyhow::bail!("{}: {}", file.display(), not_built("RocketMQ", "rocketmq")),
        SourceSpec::Nats(n) => anyhow::bail!(
            "{}: pipeline {:?} has a {} source: rewind moves a consumer's stored position back; a JetStream durable \
             consumer's position is its ack floor on the server, which cannot be moved back. To replay stream {:?}, create \
             a new consumer with the start you mean ({}) and name it in [source] consumer: the dedup \
             store skips every message already applied within [dedup] retention",
            file.display(),
            pipeline.name,
            pipeline.source.kind(),
            n.stream,
            nats_add_command(n, pipeline.batch.max_records, &format!("{}-replay", n.consumer))
        ),
        SourceSpec::RabbitMq(_) => anyhow::bail!(
            "{}: pipeline {:?} has a {} source: rewind moves a consumer group back; a queue has no positions to go \
             back to (an acknowledged message has left it). Publish the messages again instead: the dedup store skips \
             those already applied",
            file.display(),
            pipeline.name,
            pipeline.source.kind()
        ),
    }
}

/// The natscli command that creates a JetStream pipeline's consumer (see `nats::add_command`), also in a build
/// without the NATS client.
fn nats_add_command(spec: &nats::NatsSpec, max_records: usize, name: &str) -> String {
    #[cfg(feature = "nats")]
    return nats::add_command(spec, max_records, name);
    #[cfg(not(feature = "nats"))]
    return format!("`nats consumer add {} {name} --pull --ack explicit --max-deliver=-1 --deliver <start>`", spec.stream);
}

/// Why a broker this build leaves out cannot be used: `what` (the broker) and the cargo `feature` to build with.
pub fn not_built(what: &str, feature: &str) -> String {
    format!("this idemflow was built without {what} (build it with `cargo build --release --features {feature}`, or with the default features)")
}

/// Where a pipeline's dead letters also go besides the store's dead-letter table, before the batch's offsets are
/// committed or its deliveries acknowledged: the broker's own dead-letter publisher, when the pipeline names one.
pub enum DeadLetterOut {
    /// A Kafka topic (`[dead_letters] topic`).
    #[cfg(feature = "kafka")]
    Topic(kafka::dead_letters::DeadLetterTopic),
    /// A RabbitMQ exchange (`[dead_letters] exchange`), with publisher confirms.
    #[cfg(feature = "rabbitmq")]
    Exchange(rabbitmq::dead_letters::DeadLetterExchange),
}

impl DeadLetterOut {
    /// The publisher `pipeline`'s `[dead_letters]` names, if any.
    ///
    /// Errors: the Kafka producer could not be created, as text.
    pub fn new(settings: &Brokers, pipeline: &SourceContext) -> Result<Option<DeadLetterOut>, String> {
        let dl = &pipeline.dead_letters;
        Ok(match (&dl.topic, &dl.exchange, &settings.rabbitmq) {
            #[cfg(feature = "kafka")]
            (Some(topic), _, _) => Some(DeadLetterOut::Topic(
                kafka::dead_letters::DeadLetterTopic::new(&settings.kafka, &pipeline.name, topic).map_err(|e| {
                    format!("cannot create the dead-letter topic's producer: {}", kafka::describe_kafka_error(&e))
                })?,
            )),
            #[cfg(not(feature = "kafka"))]
            (Some(_), _, _) => return Err(not_built("Kafka (for [dead_letters] topic)", "kafka")),
            #[cfg(feature = "rabbitmq")]
            (None, Some(exchange), Some(rabbitmq)) => {
                let routing_key = dl.routing_key.as_deref().unwrap_or(&pipeline.name);
                Some(DeadLetterOut::Exchange(rabbitmq::dead_letters::DeadLetterExchange::new(rabbitmq, &pipeline.name, exchange, routing_key)))
            }
            #[cfg(not(feature = "rabbitmq"))]
            (None, Some(_), Some(_)) => return Err(not_built("RabbitMQ (for [dead_letters] exchange)", "rabbitmq")),
            _ => None,
        })
    }

    /// Publishes `dead` (indexes into `batch`), confirmed by the broker.
    ///
    /// Errors: the broker refused or did not confirm, as text; the worker retries the batch's end.
    #[cfg_attr(not(any(feature = "kafka", feature = "rabbitmq")), allow(unused_variables))]
    pub async fn publish(&self, batch: &[Record], dead: &[crate::dead_letter::DeadLettered]) -> Result<(), String> {
        match *self {
            #[cfg(feature = "kafka")]
            DeadLetterOut::Topic(ref t) => t.publish(batch, dead).await.map_err(|e| e.to_string()),
            #[cfg(feature = "rabbitmq")]
            DeadLetterOut::Exchange(ref x) => x.publish(batch, dead).await,
        }
    }
}
