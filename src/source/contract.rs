//! The contract every broker's connector implements, and what it is given: a leaf of `source/` that the connector
//! folders import (never the hub, [`super`], which imports them).
//!
//! Two traits, one per side of a connector:
//!
//! - [`BrokerSpec`], always built: the broker's `[source]` spec as the configuration and `check` ask it (what it
//!   can do, where it reads, what two pipelines must not share, what it says of retention and rewind). A build
//!   without the broker's client still reads a pipeline file that names it, and refuses it with the reason.
//! - [`Connector`], behind the broker's cargo feature: its consumer at run time, its `check` against the broker and
//!   its rewind. What only some brokers can do (stored positions, ownership that moves, rewind) has a default that
//!   means "this connector cannot", so a queue writes nothing for what it lacks.
//!
//! The hub ([`super::Source`], [`super::spec::SourceSpec`]) keeps the one list of connectors: a closed enum each,
//! dispatched by one macro, every method one line (the shape of Vector's `enum Sources` over its `SourceConfig`
//! trait, and of Quickwit's `Source` trait whose "cannot" is a default method).

use crate::batch::{BatchSettings, Records};
use crate::dead_letter::DeadLetterSettings;
use crate::metrics::PipelineMetrics;
use crate::offsets::{Claimed, NextOffsets, OffsetStore, PassedFloor, Positions};
use crate::record::Record;
use crate::shutdown::Shutdown;
use std::path::Path;
use std::time::Duration;

/// What a source is given of its pipeline: the pipeline's name, its `[source]` (`S`: the broker's own spec in a
/// connector, [`super::spec::SourceSpec`] in the hub), and what of the rest of the file decides how it reads. The
/// configuration builds it (`Pipeline::source_context`); a source never sees the rest.
#[derive(Clone, Debug)]
pub struct Context<S> {
    /// The pipeline's name: the default consumer group's suffix, the `pipeline` label of its metrics.
    pub name: String,
    /// `[source]`.
    pub source: S,
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

impl<S> Context<S> {
    /// The same context with `source` as its spec: what the hub hands a connector (its own spec, typed).
    pub fn with<T: Clone>(&self, source: &T) -> Context<T> {
        Context {
            name: self.name.clone(),
            source: source.clone(),
            batch: self.batch,
            max_payload_bytes: self.max_payload_bytes,
            dedup_retention: self.dedup_retention,
            dead_letters: self.dead_letters.clone(),
            offsets: self.offsets,
        }
    }
}

/// What a broker's source can do, asked by the configuration's checks instead of which broker it is: one const per
/// broker ([`BrokerSpec::CAPABILITIES`]). Each `Err` holds the reason given to a pipeline that asks for it, as
/// `check` prints it.
#[derive(Debug)]
pub struct Capabilities {
    /// `[source] kind`.
    pub kind: &'static str,
    /// Its `[source]` keys besides `kind`: a key of another broker's list is refused with that broker's name.
    pub fields: &'static [&'static str],
    /// Positions a worker can seek to: `[offsets] store = "database"`, `rewind`, a Redis sink's stored positions.
    pub positions: Result<(), &'static str>,
    /// `batch.concurrency` above 1.
    pub lanes: Result<(), &'static str>,
    /// `[dead_letters] topic`, a Kafka topic.
    pub dead_letter_topic: Result<(), &'static str>,
    /// `[dead_letters] exchange`, a RabbitMQ exchange.
    pub dead_letter_exchange: Result<(), &'static str>,
    /// Message properties as the business key (`key.message_id`, `key.message_key`, `key.property`): refused with
    /// the field `key` when the source has none.
    pub key_properties: Result<(), &'static str>,
    /// `key.message_key` (RocketMQ's KEYS).
    pub key_message_key: Result<(), &'static str>,
    /// `key.record_key`.
    pub key_record_key: Result<(), &'static str>,
    /// A bound value from a message property (`{ property = ... }`).
    pub bind_property: Result<(), &'static str>,
    /// A bound value from the record key (`{ record_key = true }`).
    pub bind_record_key: Result<(), &'static str>,
    /// A bound partition or offset (`{ meta = "partition" }`, `"offset"`).
    pub bind_partition: Result<(), &'static str>,
}

/// Why `batch.concurrency` above 1 needs a source whose partitions a group assignment spreads (Kafka).
pub const LANES: &str = "more than 1 needs a Kafka source, whose partitions Kafka's group assignment spreads over the transactions: \
     consumers sharing a queue would take its messages out of order (run more workers on more queues instead)";

/// What a pipeline's source shares with another pipeline's that two pipelines must not (a consumer group, a
/// queue): the message is `<what> <the other pipeline's file><why>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The pipeline-file key it is about (`group_id`, `source.queues`).
    pub field: &'static str,
    /// What is shared, up to the other pipeline's file (`"payments" is also used by`).
    pub what: String,
    /// Why it matters, after the file (may be empty).
    pub why: &'static str,
}

/// A broker's own `[source]` keys as written, before its rules check them: read key by key from the pipeline file's
/// `[source]` table by the hub ([`super::spec::SourceKeys`]), so the document's positions stay with any error.
pub trait RawKeys: Default {
    /// Reads the value of `key` from `map` into this struct when `key` is one of its broker's keys. Returns whether
    /// it was.
    ///
    /// Errors: the value has the wrong type (the deserializer's error, with its position).
    fn take<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error>;
}

/// What a broker's [`BrokerSpec::parse`] is given of its pipeline besides its own keys.
#[derive(Clone, Copy, Debug)]
pub struct ParseContext<'a> {
    /// The pipeline's name (the default consumer group or durable consumer is named after it).
    pub name: &'a str,
    /// `[batch] max_records` (a prefetch or `max_ack_pending` must hold a batch).
    pub max_records: usize,
    /// The top-level `topics` of earlier versions (a Kafka source).
    pub legacy_topics: Option<&'a Vec<String>>,
    /// The top-level `group_id` of earlier versions (a Kafka source).
    pub legacy_group: Option<&'a String>,
}

/// A broker's `[source]` spec: what the configuration and `check` ask of it, in every build. Implemented by each
/// broker's spec type in its folder (`<broker>/spec.rs`).
pub trait BrokerSpec: Clone + Sized {
    /// Its settings section (`[kafka]`, `[rabbitmq]`, ...).
    type Settings;
    /// Its `[source]` keys as written ([`RawKeys`]).
    type Raw: RawKeys;

    /// Its spec from its keys (`raw`: all unset when the pipeline has no `[source]`), checked by its own rules.
    /// Every problem goes to `e`; `None` when the spec cannot be built.
    fn parse(raw: &Self::Raw, cx: &ParseContext<'_>, e: &mut impl crate::validate::Problems) -> Option<Self>;
    /// What it can do.
    const CAPABILITIES: Capabilities;
    /// Its name in messages (`"RabbitMQ"`).
    const NAME: &'static str;
    /// The cargo feature that builds its connector (`"rabbitmq"`).
    const FEATURE: &'static str;
    /// Whether this build has its connector (`cfg!(feature = ...)`, asked in its folder).
    const BUILT: bool;

    /// Why its settings are missing, if they are (`settings` is its section, when the settings file has one): the
    /// sentence `check` and `run` print.
    fn settings_missing(settings: Option<&Self::Settings>) -> Option<&'static str>;

    /// Its topics, queues or stream, for logs and `check`.
    fn streams(&self) -> &[String];

    /// The settings that say where it reads, for `check`'s `ok` line and its JSON report, each under its
    /// pipeline-file key, in the order the line shows them (durations as settings files write them, `30s`).
    fn reads(&self, cx: &Context<Self>) -> Vec<(&'static str, serde_json::Value)>;

    /// What it shares with `earlier` (another pipeline's source of the same broker) that two pipelines must not.
    /// Default: nothing can be shared wrongly.
    fn conflict_with(&self, _earlier: &Self) -> Option<Conflict> {
        None
    }

    /// What `check` says of the dedup retention against how long the broker keeps messages, when it is said
    /// without asking the broker (a sentence each). Default: nothing here; the connector reads it from the broker
    /// ([`Connector::retention_report`]).
    fn retention_note(&self, _cx: &Context<Self>) -> Vec<String> {
        Vec::new()
    }

    /// Why `idemflow rewind` cannot move this source back, and what to do instead, for a pipeline in `file`.
    /// Default: it can ([`Connector::rewind`]).
    fn rewind_refusal(&self, _cx: &Context<Self>, _file: &Path) -> Option<String> {
        None
    }
}

/// A broker's settings section, as its connector takes it.
pub type SettingsOf<C> = <<C as Connector>::Spec as BrokerSpec>::Settings;

/// Why `check` refuses a pipeline's source.
#[derive(Debug)]
pub enum CheckError {
    /// The settings file is wrong (a librdkafka property the client refuses): reported against the settings file,
    /// at once.
    Settings(String),
    /// The broker is unreachable or lacks what the pipeline needs (a missing topic or queue): reported with the
    /// pipeline's file, after the store's problems are collected too.
    Broker(String),
}

/// What the pipeline reads, for `check`'s `ok` line and its JSON report: the broker (`kind`, as `[source] kind`
/// names it) and the settings that say where it reads, each under its pipeline-file key (`topics`, `group_id`,
/// `queues`, `prefetch`, `topic`, `consumer_group`, `offsets`, `stream`, `consumer`, `ack_wait`, `max_ack_pending`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Reads {
    /// `kafka`, `rabbitmq`, `rocketmq` or `nats`.
    pub kind: &'static str,
    /// The settings, in the order the line shows them; durations as settings files write them (`30s`).
    #[serde(flatten)]
    pub settings: serde_json::Map<String, serde_json::Value>,
}

impl std::fmt::Display for Reads {
    /// `topics ["payments"], group_id "idemflow-payments"`: each setting's key and its value as JSON.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (key, value)) in self.settings.iter().enumerate() {
            write!(f, "{}{key} {value}", if i == 0 { "" } else { ", " })?;
        }
        Ok(())
    }
}

/// What a source needs to start partitions (Kafka) or queues (RocketMQ) from their stored positions
/// (`[offsets] store = "database"`).
pub struct StoredStart {
    /// The store that keeps the positions: only its claims.
    pub store: crate::store::PositionStore,
    /// Recorded as the owner of claimed partitions (for operators): `host/pid` by default.
    pub owner: String,
    /// The runtime the Kafka source's claim tasks run on.
    pub runtime: tokio::runtime::Handle,
    /// Ends the claim's retries.
    pub shutdown: Shutdown,
}

/// A broker's connector: its consumer at run time, its `check` and its rewind. Implemented in the broker's folder,
/// behind its cargo feature.
///
/// The methods with a default are what only some brokers can do; the default is "this connector cannot" (no
/// positions, nothing owned that can move, no rewind).
// Dispatched statically through the hub's enum, on the concrete types: their futures' `Send` is known there.
#[allow(async_fn_in_trait)]
pub trait Connector: Sized + Send {
    /// Its `[source]` spec.
    type Spec: BrokerSpec;

    /// Its consumer for the pipeline `cx` (`settings`: its section; `stored`: with `[offsets] store = "database"`).
    ///
    /// Errors: the consumer cannot be created (a missing settings section, a bad client property), as text.
    fn open(
        settings: Option<&SettingsOf<Self>>,
        cx: &Context<Self::Spec>,
        metrics: PipelineMetrics,
        stored: Option<StoredStart>,
    ) -> Result<Self, String>;

    /// Reaches the broker and finds the pipeline's topics, queues or stream; the lines to print (`warning: ...`
    /// for what could not be verified).
    ///
    /// Errors: [`CheckError`].
    async fn check(settings: Option<&SettingsOf<Self>>, cx: &Context<Self::Spec>) -> Result<Vec<String>, CheckError>;

    /// Settings of the pipeline and of the broker's client that work against each other, one sentence each
    /// (`shutdown_timeout`: `[shutdown] timeout`). Default: none.
    fn timing_warnings(_settings: Option<&SettingsOf<Self>>, _cx: &Context<Self::Spec>, _shutdown_timeout: Duration) -> Vec<String> {
        Vec::new()
    }

    /// Compares the dedup retention with how long the broker keeps the pipeline's messages, as read from the
    /// broker: one line per topic (`warning: ...` where it falls short). Default: nothing to read
    /// ([`BrokerSpec::retention_note`] says it).
    async fn retention_report(_settings: Option<&SettingsOf<Self>>, _cx: &Context<Self::Spec>) -> Vec<String> {
        Vec::new()
    }

    /// Moves the pipeline's consumer group back (and its stored positions, through `store`), printing the plan and
    /// what happened. Default: it cannot ([`BrokerSpec::rewind_refusal`] says why).
    ///
    /// Errors: the group has members, a broker or store request failed.
    async fn rewind(
        _settings: Option<&SettingsOf<Self>>,
        cx: &Context<Self::Spec>,
        file: &Path,
        _request: super::rewind::Request,
        _store: Option<super::rewind::StoreSide<'_>>,
    ) -> anyhow::Result<()> {
        anyhow::bail!("{}: pipeline {:?}: a {} source has no positions to move back", file.display(), cx.name, Self::Spec::NAME)
    }

    /// The next batch: at least one record, at most `settings.max_records`, waiting at most `max_wait` after the
    /// first; or an empty batch after a second without records, so the worker can do its idle checks (brokers
    /// that can). `None` once shutdown comes while waiting for a first record.
    async fn next_batch(&mut self, settings: BatchSettings, shutdown: &mut Shutdown) -> Option<Vec<Record>>;

    /// Waits `delay` before a retry without taking more records than the prefetch bound, serving the broker
    /// meanwhile; drops from `batch` what this worker no longer owns. `false` if shutdown came first.
    async fn pause_for(&mut self, delay: Duration, batch: &mut dyn Records, shutdown: &mut Shutdown) -> bool;

    /// Runs `work` (spawned: the batch transaction, a claim, a rebuild) to its end while serving the broker, calling
    /// `received` once for each record received meanwhile and kept for a later batch.
    async fn poll_while<T: Send>(&mut self, work: tokio::task::JoinHandle<T>, received: &mut (dyn FnMut(&Record) + Send)) -> T;

    /// Tells the broker that a batch (`records`, ending at `next`), committed in the store, is done.
    async fn commit(&mut self, records: &[Record], next: &NextOffsets);

    /// Ends without telling the broker anything more (an injected crash).
    async fn abandon(self);

    /// Ends cleanly: commits what is durable, leaves the group or closes the connection.
    async fn close(self);

    /// Why the pipeline must stop, when [`Connector::next_batch`] returned `None` for a reason other than shutdown.
    /// Default: never.
    fn fatal(&self) -> Option<String> {
        None
    }

    /// Drops from `batch` the records this worker no longer owns. Default: it owns all it was given.
    fn drop_revoked(&mut self, _batch: &mut dyn Records) {}

    /// The positions a batch ending at `next` stores in its transaction (`[offsets] store = "database"`). Default:
    /// none (no positions a worker can seek to).
    fn positions(&self, _next: &NextOffsets) -> Option<Positions> {
        None
    }

    /// What the broker says of the logs of the partitions of `next` (a batch's): their identity and where they end
    /// ([`crate::offsets::Log`]), the evidence that decides whether the pipeline's processed marks belong to them
    /// ([`crate::offsets::Processed::renewals`]). Called before each attempt of a batch; it may ask the broker, briefly.
    /// Default: nothing is said, and records below a processed floor are always skipped as processed.
    fn logs(&self, _next: &NextOffsets) -> crate::offsets::Logs {
        crate::offsets::Logs::default()
    }

    /// After a batch committed to the broker that ended below processed floors: moves those partitions on to their
    /// floors. Default: the records below them are fetched and skipped.
    fn skip_to_floors(&mut self, _floors: &[PassedFloor]) {}

    /// A batch was fenced: gives up `partitions` and drops their records from `batch`. Default: nothing to give up
    /// (no stored positions, so never fenced).
    async fn lose(&mut self, _partitions: &[(String, i32)], _used: Option<&Positions>, _batch: &mut dyn Records) {}

    /// The partitions or queues assigned to this worker now. Default: none.
    fn owned(&self) -> Vec<(String, i32)> {
        Vec::new()
    }

    /// The store lost positions this worker had stored: starts the partitions of `claimed` again from the positions
    /// it kept, dropping their records from `batch`. Default: nothing stored, nothing to start again.
    ///
    /// Errors: the consumer could not be moved.
    async fn resync(&mut self, _claimed: &[Claimed], _batch: &mut dyn Records) -> Result<(), String> {
        Ok(())
    }
}

/// Why a broker this build leaves out cannot be used: `what` (the broker) and the cargo `feature` to build with.
pub fn not_built(what: &str, feature: &str) -> String {
    format!("this idemflow was built without {what} (build it with `cargo build --release --features {feature}`, or with the default features)")
}
