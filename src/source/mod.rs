//! Sources: where a pipeline's records come from, one folder per broker.
//!
//! - [`kafka`]: a consumer-group member; positions are (topic, partition, offset), committed after each batch.
//! - [`rabbitmq`]: one consumer per queue; a batch is acknowledged (`basic.ack` with `multiple`) after it commits.
//! - [`rocketmq`]: a consumer-group member (clustering); positions are (topic/broker, queue id, queue offset), the
//!   consume offsets updated after each batch.
//! - [`nats`]: a durable JetStream pull consumer; positions are (stream, 0, stream sequence), each delivery
//!   acknowledged with a double ack after its batch commits.
//!
//! Each broker implements the contract in [`contract`]: [`contract::BrokerSpec`] for its `[source]` spec (always
//! built) and [`contract::Connector`] for its consumer, `check` and rewind (behind its cargo feature), where what
//! only some brokers can do has a default meaning "this connector cannot". This hub is the one list of them: the
//! closed enum [`Source`] (and [`spec::SourceSpec`]), dispatched by `each_source!`, so that every method here is
//! one line. A new broker is a new folder, a variant here and in `SourceSpec`, its line in each dispatch macro and
//! its settings field in [`Brokers`].

pub mod contract;
pub mod dead_letter_out;
pub mod kafka;
pub mod nats;
pub mod rabbitmq;
pub mod rewind;
pub mod rocketmq;
pub mod spec;

use crate::batch::{Batch, BatchSettings, Records};
use crate::metrics::PipelineMetrics;
use crate::offsets::{Claimed, PassedFloor, Positions};
use crate::record::Record;
use crate::shutdown::Shutdown;
use contract::{CheckError, Connector, Reads, StoredStart};
use spec::{Brokers, SourceContext, SourceSpec};
use std::path::Path;
use std::time::Duration;

/// The one list of connectors, as a dispatch: each arm names a variant of [`Source`] and [`SourceSpec`] once, with
/// its cargo feature, its connector type and its settings field of [`Brokers`].
///
/// - `each_source!(source, |c| expr)`: `expr` on the running connector `c`.
/// - `each_source!(for spec, brokers, |C, s, settings, variant| expr, |why| otherwise)`: `expr` with `C` the
///   connector type of `spec`'s broker, `s` its own spec, `settings` its settings section (an `Option`) and
///   `variant` the [`Source`] variant that wraps it; `otherwise` (with `why`, the sentence saying so) in a build
///   without that broker.
macro_rules! each_source {
    (for $spec:expr, $brokers:expr, |$C:ident, $s:pat, $set:pat, $variant:pat_param| $e:expr, |$why:ident| $otherwise:expr) => {
        match $spec {
            #[cfg(feature = "kafka")]
            SourceSpec::Kafka($s) => dispatch!($C = kafka::KafkaSource, $set = Some(&$brokers.kafka), $variant = Source::Kafka, $e),
            #[cfg(feature = "rabbitmq")]
            SourceSpec::RabbitMq($s) => dispatch!($C = rabbitmq::RabbitMqSource, $set = $brokers.rabbitmq.as_ref(), $variant = Source::RabbitMq, $e),
            #[cfg(feature = "rocketmq")]
            SourceSpec::RocketMq($s) => dispatch!($C = rocketmq::RocketMqSource, $set = $brokers.rocketmq.as_ref(), $variant = Source::RocketMq, $e),
            #[cfg(feature = "nats")]
            SourceSpec::Nats($s) => dispatch!($C = nats::NatsSource, $set = $brokers.nats.as_ref(), $variant = Source::Nats, $e),
            #[allow(unreachable_patterns)]
            other => {
                let $why = other.built().expect_err("every built connector has its arm above");
                $otherwise
            }
        }
    };
    ($source:expr, |$c:ident| $e:expr) => {
        match $source {
            #[cfg(feature = "kafka")]
            Source::Kafka($c) => $e,
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq($c) => $e,
            #[cfg(feature = "rocketmq")]
            Source::RocketMq($c) => $e,
            #[cfg(feature = "nats")]
            Source::Nats($c) => $e,
        }
    };
}

/// One arm of [`each_source!`]: binds the connector type, its settings and its variant for `$e`.
macro_rules! dispatch {
    ($C:ident = $ty:ty, $set:pat = $settings:expr, $variant:pat = $wrap:expr, $e:expr) => {{
        type $C = $ty;
        #[allow(unused_variables)]
        let $set = $settings;
        #[allow(unused_variables)]
        let $variant = $wrap;
        $e
    }};
}

/// A pipeline's source: the running connector of its broker.
pub enum Source {
    /// Kafka topics.
    #[cfg(feature = "kafka")]
    Kafka(kafka::KafkaSource),
    /// RabbitMQ queues.
    #[cfg(feature = "rabbitmq")]
    RabbitMq(rabbitmq::RabbitMqSource),
    /// A RocketMQ topic.
    #[cfg(feature = "rocketmq")]
    RocketMq(rocketmq::RocketMqSource),
    /// A NATS JetStream durable consumer.
    #[cfg(feature = "nats")]
    Nats(nats::NatsSource),
}

impl Source {
    /// The source of `pipeline` ([`Connector::open`]). `stored` applies to sources with positions, with
    /// `[offsets] store = "database"`.
    ///
    /// Errors: the consumer could not be created (a bad librdkafka property, a missing broker section, a broker
    /// this build leaves out), as text.
    pub fn new(brokers: &Brokers, pipeline: &SourceContext, metrics: PipelineMetrics, stored: Option<StoredStart>) -> Result<Source, String> {
        each_source!(for &pipeline.source, brokers, |C, s, settings, variant| C::open(settings, &pipeline.with(s), metrics, stored).map(variant), |why| Err(why))
    }

    /// The next batch ([`Connector::next_batch`]).
    pub async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>> {
        each_source!(self, |c| c.next_batch(settings, shutdown).await)
    }

    /// Waits `delay` before a retry, serving the broker, dropping from `batch` what this worker no longer owns
    /// ([`Connector::pause_for`]). `false` if shutdown came first.
    pub async fn pause_for(&mut self, delay: Duration, batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool {
        each_source!(self, |c| c.pause_for(delay, batch, shutdown).await)
    }

    /// The positions `batch` stores in its transaction (`[offsets] store = "database"`; [`Connector::positions`]).
    pub fn positions<P>(&self, batch: &Batch<P>) -> Option<Positions> {
        each_source!(self, |c| c.positions(batch.next_offsets()))
    }

    /// What the broker says of the logs of `batch`'s partitions ([`Connector::logs`]).
    pub fn logs<P>(&self, batch: &Batch<P>) -> crate::offsets::Logs {
        each_source!(self, |c| c.logs(batch.next_offsets()))
    }

    /// Runs `work` (spawned: a claim, a rebuild of the statements) to its end while the source keeps serving its
    /// broker.
    pub async fn poll_while<T: Send>(&mut self, work: tokio::task::JoinHandle<T>) -> T {
        self.poll_while_receiving(work, &mut |_| {}).await
    }

    /// Runs `work` (the batch transaction, spawned) to its end while the source keeps serving its broker, calling
    /// `received` once for each record the source receives meanwhile and keeps for a later batch (in the order
    /// received; the worker prepares them ahead, see [`crate::prepare::Ahead`]). A record passed to `received` may
    /// still be dropped before its batch (its partition revoked, its channel lost). RocketMQ's client buffers
    /// what it pulls on its own runtime: nothing is received here, and nothing is passed.
    pub async fn poll_while_receiving<T: Send>(&mut self, work: tokio::task::JoinHandle<T>, received: &mut (dyn FnMut(&Record) + Send)) -> T {
        each_source!(self, |c| c.poll_while(work, received).await)
    }

    /// Why the pipeline must stop, when [`Source::next_batch`] returned `None` for a reason other than shutdown
    /// (a RabbitMQ stream found where a queue was expected, a RocketMQ consumer that could not start).
    pub fn fatal(&self) -> Option<String> {
        each_source!(self, |c| c.fatal())
    }

    /// Drops from `batch` the records this worker no longer owns (partitions revoked, a lost channel).
    pub fn drop_revoked(&mut self, batch: &mut dyn Records) {
        each_source!(self, |c| c.drop_revoked(batch))
    }

    /// After a batch committed to the broker that ended below processed floors (a group that started over:
    /// [`crate::sink::BatchOutcome::floors`]): moves those partitions on to their floors where nothing below them can
    /// have been missed ([`Connector::skip_to_floors`]).
    pub fn skip_to_floors(&mut self, floors: &[PassedFloor]) {
        // Almost every batch passes none: no look at the consumer's positions then.
        if floors.is_empty() {
            return;
        }
        each_source!(self, |c| c.skip_to_floors(floors))
    }

    /// A batch was fenced (`[offsets] store = "database"`): gives up `partitions` and drops their records
    /// ([`Connector::lose`]).
    pub async fn lose(&mut self, partitions: &[(String, i32)], used: Option<&Positions>, batch: &mut dyn Records) {
        each_source!(self, |c| c.lose(partitions, used, batch).await)
    }

    /// The partitions or queues assigned to this worker now ([`Connector::owned`]).
    pub fn owned(&self) -> Vec<(String, i32)> {
        each_source!(self, |c| c.owned())
    }

    /// The store lost positions this worker had stored: starts the partitions of `claimed` again from the positions
    /// it kept, dropping their records from `batch` ([`Connector::resync`]).
    ///
    /// Errors: the consumer could not be moved.
    pub async fn resync(&mut self, claimed: &[Claimed], batch: &mut dyn Records) -> Result<(), String> {
        each_source!(self, |c| c.resync(claimed, batch).await)
    }

    /// Tells the broker that `batch` (committed in the store) is done: Kafka offsets are committed, RabbitMQ
    /// deliveries acknowledged, RocketMQ consume offsets updated, JetStream deliveries double-acked.
    pub async fn commit<P>(&mut self, batch: &Batch<P>) {
        each_source!(self, |c| c.commit(batch.records(), batch.next_offsets()).await)
    }

    /// Ends without telling the broker anything more (an injected crash).
    pub async fn abandon(self) {
        each_source!(self, |c| c.abandon().await)
    }

    /// Ends cleanly: commits what is durable (Kafka), leaves the group or closes the connection.
    pub async fn close(self) {
        each_source!(self, |c| c.close().await)
    }
}

/// Checks `pipeline`'s source against its broker ([`Connector::check`]); the lines to print (`warning: ...` for
/// what could not be verified).
///
/// Errors: [`CheckError`].
pub async fn check(brokers: &Brokers, pipeline: &SourceContext) -> Result<Vec<String>, CheckError> {
    each_source!(for &pipeline.source, brokers, |C, s, settings, _| C::check(settings, &pipeline.with(s)).await, |why| Err(CheckError::Broker(why)))
}

/// What `pipeline` reads, for `check`'s `ok` line and its JSON report ([`Reads`]).
pub fn summary(pipeline: &SourceContext) -> Reads {
    let settings = pipeline.source.reads(pipeline);
    Reads { kind: pipeline.source.kind(), settings: settings.into_iter().map(|(k, v)| (k.to_owned(), v)).collect() }
}

/// Settings of `pipeline` and of its broker's client that work against each other, one sentence each (`check`
/// prints them as warnings; [`Connector::timing_warnings`]).
pub fn timing_warnings(brokers: &Brokers, pipeline: &SourceContext) -> Vec<String> {
    each_source!(for &pipeline.source, brokers, |C, s, settings, _| C::timing_warnings(settings, &pipeline.with(s), brokers.shutdown_timeout), |_why| Vec::new())
}

/// Compares `pipeline`'s dedup retention with how long its broker keeps messages: one line per topic
/// (`warning: ...` where the retention falls short or could not be read). What is said without asking the broker
/// ([`contract::BrokerSpec::retention_note`]) comes first; otherwise the broker is asked
/// ([`Connector::retention_report`]).
pub async fn retention_report(brokers: &Brokers, pipeline: &SourceContext) -> Vec<String> {
    let note = pipeline.source.retention_note(pipeline);
    if !note.is_empty() {
        return note;
    }
    each_source!(for &pipeline.source, brokers, |C, s, settings, _| C::retention_report(settings, &pipeline.with(s)).await,
        |why| vec![format!("warning: pipeline {:?}: {why}", pipeline.name)])
}

/// Rewinds `pipeline`'s group (and its stored positions in `store`, with `[offsets] store = "database"`), printing
/// the plan, one line per partition or queue, and what happened ([`Connector::rewind`]).
///
/// Errors: the source has no positions (a queue: [`contract::BrokerSpec::rewind_refusal`] says why and what to do
/// instead), the group has members, a broker or store request failed; the message names the pipeline's file where
/// it is about the pipeline.
pub async fn rewind_group(
    brokers: &Brokers,
    pipeline: &SourceContext,
    file: &Path,
    request: rewind::Request,
    store: Option<rewind::StoreSide<'_>>,
) -> anyhow::Result<()> {
    if let Some(why) = pipeline.source.rewind_refusal(pipeline, file) {
        anyhow::bail!(why);
    }
    each_source!(for &pipeline.source, brokers, |C, s, settings, _| C::rewind(settings, &pipeline.with(s), file, request, store).await,
        |why| anyhow::bail!("{}: {why}", file.display()))
}
