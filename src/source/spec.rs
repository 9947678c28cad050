//! `[source]`: which broker a pipeline reads, and what each broker's part of the pipeline file says.

use super::kafka::KafkaSpec;
use super::rabbitmq::RabbitMqSpec;
use super::rocketmq::RocketMqSpec;
use super::nats::NatsSpec;
use super::rabbitmq::QueueType;
use crate::validate::Problems;
use serde::Deserialize;

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

/// What a broker's source can do, asked by the configuration's checks instead of which broker it is: one const per
/// broker, in its `spec.rs`. Each `Err` holds the reason given to a pipeline that asks for it, as `check` prints it.
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
pub(crate) const LANES: &str = "more than 1 needs a Kafka source, whose partitions Kafka's group assignment spreads over the transactions: \
     consumers sharing a queue would take its messages out of order (run more workers on more queues instead)";

/// Every broker's capabilities, in the order their names are listed in messages.
pub const ALL: [&Capabilities; 4] =
    [&super::kafka::CAPABILITIES, &super::rabbitmq::CAPABILITIES, &super::rocketmq::CAPABILITIES, &super::nats::CAPABILITIES];

/// The capabilities of the broker named `kind` in `[source] kind`, if there is one.
pub fn by_kind(kind: &str) -> Option<&'static Capabilities> {
    ALL.into_iter().find(|c| c.kind == kind)
}

impl SourceSpec {
    /// What this source can do ([`Capabilities`]).
    pub fn capabilities(&self) -> &'static Capabilities {
        match self {
            SourceSpec::Kafka(_) => &super::kafka::CAPABILITIES,
            SourceSpec::RabbitMq(_) => &super::rabbitmq::CAPABILITIES,
            SourceSpec::RocketMq(_) => &super::rocketmq::CAPABILITIES,
            SourceSpec::Nats(_) => &super::nats::CAPABILITIES,
        }
    }

    /// Why its broker's settings are missing, if they are: the sentence `check` and `run` print.
    pub fn settings_missing(&self, brokers: &super::Brokers) -> Option<&'static str> {
        match self {
            SourceSpec::Kafka(_) if brokers.kafka.bootstrap_servers.trim().is_empty() => {
                Some("a Kafka source needs [kafka] bootstrap_servers in the settings (or IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS)")
            }
            SourceSpec::RabbitMq(_) if brokers.rabbitmq.is_none() => {
                Some("a RabbitMQ source needs [rabbitmq] url in the settings (or IDEMFLOW_RABBITMQ__URL)")
            }
            SourceSpec::RocketMq(_) if brokers.rocketmq.is_none() => {
                Some("a RocketMQ source needs [rocketmq] name_server in the settings (or IDEMFLOW_ROCKETMQ__NAME_SERVER)")
            }
            SourceSpec::Nats(_) if brokers.nats.is_none() => {
                Some("a NATS JetStream source needs [nats] url in the settings (or IDEMFLOW_NATS__URL)")
            }
            SourceSpec::Kafka(_) | SourceSpec::RabbitMq(_) | SourceSpec::RocketMq(_) | SourceSpec::Nats(_) => None,
        }
    }

    /// What this source shares with `earlier` (another pipeline's) that two pipelines must not: a consumer group,
    /// or a queue. `(field, what, why)` for the message `<what> <earlier's file><why>`.
    pub fn conflict_with(&self, earlier: &SourceSpec) -> Option<(&'static str, String, &'static str)> {
        match (earlier, self) {
            (SourceSpec::Kafka(a), SourceSpec::Kafka(b)) if a.group_id == b.group_id => {
                Some(("group_id", format!("{:?} is also used by", b.group_id), ""))
            }
            (SourceSpec::RocketMq(a), SourceSpec::RocketMq(b)) if a.consumer_group == b.consumer_group => {
                Some(("source.consumer_group", format!("{:?} is also used by", b.consumer_group), ""))
            }
            (SourceSpec::Nats(a), SourceSpec::Nats(b)) if a.stream == b.stream && a.consumer == b.consumer => Some((
                "source.consumer",
                format!("{:?} of stream {:?} is also consumed by", b.consumer, b.stream),
                ": two pipelines on one durable consumer would each see only part of its messages",
            )),
            (SourceSpec::RabbitMq(a), SourceSpec::RabbitMq(b)) => b.queues.iter().find(|q| a.queues.contains(q)).map(|q| {
                ("source.queues", format!("{q:?} is also consumed by"), ": competing pipelines would each see only part of its messages")
            }),
            _ => None,
        }
    }

    /// Whether `topic` is one it consumes (a dead-letter topic must not be).
    pub fn consumes(&self, topic: &str) -> bool {
        self.streams().iter().any(|t| t == topic)
    }

    /// The Kafka source, for what only Kafka has (topic retention, dead-letter topics).
    pub fn kafka(&self) -> Option<&KafkaSpec> {
        match self {
            SourceSpec::Kafka(k) => Some(k),
            SourceSpec::RabbitMq(_) | SourceSpec::RocketMq(_) | SourceSpec::Nats(_) => None,
        }
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
        match self {
            SourceSpec::Kafka(k) => &k.topics,
            SourceSpec::RabbitMq(r) => &r.queues,
            SourceSpec::RocketMq(r) => std::slice::from_ref(&r.topic),
            SourceSpec::Nats(n) => std::slice::from_ref(&n.stream),
        }
    }

    /// Whether this build has the source's connector (its cargo feature).
    ///
    /// Errors: the broker and the feature to build with ([`crate::source::not_built`]).
    pub fn built(&self) -> Result<(), String> {
        let (what, feature, built) = match self {
            SourceSpec::Kafka(_) => ("Kafka", "kafka", cfg!(feature = "kafka")),
            SourceSpec::RabbitMq(_) => ("RabbitMQ", "rabbitmq", cfg!(feature = "rabbitmq")),
            SourceSpec::RocketMq(_) => ("RocketMQ", "rocketmq", cfg!(feature = "rocketmq")),
            SourceSpec::Nats(_) => ("NATS JetStream", "nats", cfg!(feature = "nats")),
        };
        if built { Ok(()) } else { Err(crate::source::not_built(what, feature)) }
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
