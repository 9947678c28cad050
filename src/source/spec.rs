//! `[source]`: which broker a pipeline reads, and what each broker's part of the pipeline file says.

use super::contract::{not_built, BrokerSpec, Capabilities, Conflict, Context};
use super::kafka::KafkaSpec;
use super::nats::NatsSpec;
use super::rabbitmq::{QueueType, RabbitMqSpec};
use super::rocketmq::RocketMqSpec;
use crate::validate::Problems;
use serde::Deserialize;
use std::time::Duration;

/// `[source]`: where a pipeline's records come from. `kind = "kafka"` is the default, and the top-level `topics`
/// and `group_id` of earlier versions still mean a Kafka source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    /// Kafka topics read by a consumer group.
    Kafka(KafkaSpec),
    /// RabbitMQ queues read by one consumer each (AMQP 0-9-1).
    RabbitMq(RabbitMqSpec),
    /// A RocketMQ topic read by a consumer group in clustering mode.
    RocketMq(RocketMqSpec),
    /// A NATS JetStream stream read through a durable pull consumer.
    Nats(NatsSpec),
}

/// What a source is given of its pipeline, with its `[source]` as the hub holds it ([`contract::Context`]).
pub type SourceContext = Context<SourceSpec>;

/// The brokers' settings (`[kafka]`, `[rabbitmq]`, `[rocketmq]`, `[nats]`), and the shutdown deadline their clients
/// must leave their groups within (`[shutdown] timeout`).
#[derive(Clone, Debug, Default)]
pub struct Brokers {
    /// `[kafka]` (defaults when absent: a Kafka pipeline's own checks then say what is missing).
    pub kafka: super::kafka::KafkaSettings,
    /// `[rabbitmq]`, required by RabbitMQ pipelines.
    pub rabbitmq: Option<super::rabbitmq::RabbitMqSettings>,
    /// `[rocketmq]`, required by RocketMQ pipelines.
    pub rocketmq: Option<super::rocketmq::RocketMqSettings>,
    /// `[nats]`, required by NATS JetStream pipelines.
    pub nats: Option<super::nats::NatsSettings>,
    /// `[shutdown] timeout`.
    pub shutdown_timeout: Duration,
}

/// The one list of brokers' specs, as a dispatch: `each_spec!(spec, |s| expr)` is `expr` on the broker's own spec
/// `s` ([`BrokerSpec`]); `each_spec!(spec, brokers, |s, settings| expr)` also binds its settings section of
/// [`Brokers`] (an `Option`).
macro_rules! each_spec {
    ($spec:expr, |$s:ident| $e:expr) => {
        match $spec {
            SourceSpec::Kafka($s) => $e,
            SourceSpec::RabbitMq($s) => $e,
            SourceSpec::RocketMq($s) => $e,
            SourceSpec::Nats($s) => $e,
        }
    };
    ($spec:expr, $brokers:expr, |$s:ident, $set:ident| $e:expr) => {
        match $spec {
            SourceSpec::Kafka($s) => { let $set = Some(&$brokers.kafka); $e }
            SourceSpec::RabbitMq($s) => { let $set = $brokers.rabbitmq.as_ref(); $e }
            SourceSpec::RocketMq($s) => { let $set = $brokers.rocketmq.as_ref(); $e }
            SourceSpec::Nats($s) => { let $set = $brokers.nats.as_ref(); $e }
        }
    };
}

/// Every broker's capabilities, in the order their names are listed in messages.
pub const ALL: [&Capabilities; 4] =
    [&KafkaSpec::CAPABILITIES, &RabbitMqSpec::CAPABILITIES, &RocketMqSpec::CAPABILITIES, &NatsSpec::CAPABILITIES];

/// The capabilities of the broker named `kind` in `[source] kind`, if there is one.
pub fn by_kind(kind: &str) -> Option<&'static Capabilities> {
    ALL.into_iter().find(|c| c.kind == kind)
}

impl SourceSpec {
    /// What this source can do ([`Capabilities`]).
    pub fn capabilities(&self) -> &'static Capabilities {
        fn of<S: BrokerSpec>(_: &S) -> &'static Capabilities {
            &S::CAPABILITIES
        }
        each_spec!(self, |s| of(s))
    }

    /// Why its broker's settings are missing, if they are: the sentence `check` and `run` print
    /// ([`BrokerSpec::settings_missing`]).
    pub fn settings_missing(&self, brokers: &Brokers) -> Option<&'static str> {
        fn missing<S: BrokerSpec>(_: &S, settings: Option<&S::Settings>) -> Option<&'static str> {
            S::settings_missing(settings)
        }
        each_spec!(self, brokers, |s, settings| missing(s, settings))
    }

    /// What this source shares with `earlier` (another pipeline's) that two pipelines must not: a consumer group,
    /// or a queue ([`BrokerSpec::conflict_with`]). Sources of two brokers share nothing.
    pub fn conflict_with(&self, earlier: &SourceSpec) -> Option<Conflict> {
        match (earlier, self) {
            (SourceSpec::Kafka(a), SourceSpec::Kafka(b)) => b.conflict_with(a),
            (SourceSpec::RabbitMq(a), SourceSpec::RabbitMq(b)) => b.conflict_with(a),
            (SourceSpec::RocketMq(a), SourceSpec::RocketMq(b)) => b.conflict_with(a),
            (SourceSpec::Nats(a), SourceSpec::Nats(b)) => b.conflict_with(a),
            _ => None,
        }
    }

    /// Whether `topic` is one it consumes (a dead-letter topic must not be).
    pub fn consumes(&self, topic: &str) -> bool {
        self.streams().iter().any(|t| t == topic)
    }

    /// Whether its records have stable positions a worker can seek to (Kafka partitions, RocketMQ queues), which
    /// is what `[offsets] store = "database"`, `rewind` and a Redis sink need. A RabbitMQ queue has none.
    pub fn positional(&self) -> bool {
        self.capabilities().positions.is_ok()
    }

    /// The source's kind as written in `[source] kind`.
    pub fn kind(&self) -> &'static str {
        self.capabilities().kind
    }

    /// Its topics or queues, for logs and `check`.
    pub fn streams(&self) -> &[String] {
        each_spec!(self, |s| s.streams())
    }

    /// The settings that say where it reads, for `check` ([`BrokerSpec::reads`]).
    pub fn reads(&self, cx: &SourceContext) -> Vec<(&'static str, serde_json::Value)> {
        each_spec!(self, |s| s.reads(&cx.with(s)))
    }

    /// What `check` says of the dedup retention without asking the broker ([`BrokerSpec::retention_note`]).
    pub fn retention_note(&self, cx: &SourceContext) -> Vec<String> {
        each_spec!(self, |s| s.retention_note(&cx.with(s)))
    }

    /// Why `idemflow rewind` cannot move this source back, if it cannot ([`BrokerSpec::rewind_refusal`]).
    pub fn rewind_refusal(&self, cx: &SourceContext, file: &std::path::Path) -> Option<String> {
        each_spec!(self, |s| s.rewind_refusal(&cx.with(s), file))
    }

    /// Whether this build has the source's connector (its cargo feature).
    ///
    /// Errors: the broker and the feature to build with ([`crate::source::not_built`]).
    pub fn built(&self) -> Result<(), String> {
        fn built<S: BrokerSpec>(_: &S) -> Result<(), String> {
            if S::BUILT { Ok(()) } else { Err(not_built(S::NAME, S::FEATURE)) }
        }
        each_spec!(self, |s| built(s))
    }
}

/// `[source]` as written (`kind` and every broker's keys), before validation by the broker it names.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawSource {
    /// `kind`: `kafka` (the default), `rabbitmq`, `rocketmq` or `nats`.
    pub kind: Option<String>,
    /// `topics`.
    pub topics: Option<Vec<String>>,
    /// `group_id`.
    pub group_id: Option<String>,
    /// `queue`.
    pub queue: Option<String>,
    /// `queues`.
    pub queues: Option<Vec<String>>,
    /// `prefetch`.
    pub prefetch: Option<u32>,
    /// `queue_type`.
    pub queue_type: Option<QueueType>,
    /// `single_active_consumer`.
    pub single_active_consumer: Option<bool>,
    /// `topic`.
    pub topic: Option<String>,
    /// `consumer_group`.
    pub consumer_group: Option<String>,
    /// `tag_expression`.
    pub tag_expression: Option<String>,
    /// `stream`.
    pub stream: Option<String>,
    /// `consumer`.
    pub consumer: Option<String>,
    /// `filter_subjects`.
    pub filter_subjects: Option<Vec<String>>,
    /// `ack_wait`.
    #[serde(default, with = "humantime_serde")]
    pub ack_wait: Option<std::time::Duration>,
    /// `max_ack_pending`.
    pub max_ack_pending: Option<i64>,
}

impl RawSource {
    /// The `[source]` keys this file sets (`kind` aside), as the brokers' capabilities list them.
    pub fn set_fields(&self) -> Vec<&'static str> {
        let set = [
            ("topics", self.topics.is_some()),
            ("group_id", self.group_id.is_some()),
            ("queue", self.queue.is_some()),
            ("queues", self.queues.is_some()),
            ("prefetch", self.prefetch.is_some()),
            ("queue_type", self.queue_type.is_some()),
            ("single_active_consumer", self.single_active_consumer.is_some()),
            ("topic", self.topic.is_some()),
            ("consumer_group", self.consumer_group.is_some()),
            ("tag_expression", self.tag_expression.is_some()),
            ("stream", self.stream.is_some()),
            ("consumer", self.consumer.is_some()),
            ("filter_subjects", self.filter_subjects.is_some()),
            ("ack_wait", self.ack_wait.is_some()),
            ("max_ack_pending", self.max_ack_pending.is_some()),
        ];
        set.into_iter().filter(|(_, set)| *set).map(|(f, _)| f).collect()
    }
}

/// A pipeline's source from its `[source]` (`s`, or none) and the top-level `topics` and `group_id` of earlier
/// versions: the keys checked against the kind's ([`Capabilities::fields`]), then the broker's own rules. Every
/// problem goes to `e`; `None` when the spec cannot be built.
pub fn parse(
    s: Option<&RawSource>,
    legacy_topics: Option<&Vec<String>>,
    legacy_group: Option<&String>,
    name: &str,
    max_records: usize,
    e: &mut impl Problems,
) -> Option<SourceSpec> {
    let kind = s.and_then(|s| s.kind.as_deref()).unwrap_or("kafka");
    let top_level = legacy_topics.is_some() || legacy_group.is_some();
    if top_level && s.is_some_and(|s| s.topics.is_some() || s.group_id.is_some() || kind != "kafka") {
        e.push("topics", "set the source in [source] or with the top-level topics and group_id, not both");
        return None;
    }
    // A key of another broker's [source] is refused with that broker's name.
    if let (Some(s), Some(mine)) = (s, by_kind(kind)) {
        let set = s.set_fields();
        for other in ALL.iter().filter(|c| c.kind != kind) {
            for field in other.fields.iter().filter(|f| set.contains(f) && !mine.fields.contains(f)) {
                e.push(&format!("source.{field}"), format!("belongs to a {} source, not to kind = {kind:?}", other.kind));
            }
        }
    }
    match kind {
        "kafka" => super::kafka::parse(s, legacy_topics, legacy_group, name, e).map(SourceSpec::Kafka),
        "rabbitmq" => super::rabbitmq::parse(s.expect("kind comes from [source]"), max_records, e).map(SourceSpec::RabbitMq),
        "rocketmq" => super::rocketmq::parse(s.expect("kind comes from [source]"), name, e).map(SourceSpec::RocketMq),
        "nats" => super::nats::parse(s.expect("kind comes from [source]"), name, max_records, e).map(SourceSpec::Nats),
        other => {
            e.push("source.kind", format!("{other:?} is not a source kind: kafka, rabbitmq, rocketmq or nats"));
            None
        }
    }
}
