//! `[source]`: which broker a pipeline reads, and what each broker's part of the pipeline file says.

use super::kafka::KafkaSpec;
use super::rabbitmq::RabbitMqSpec;
use super::rocketmq::RocketMqSpec;

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
pub const ALL: [&Capabilities; 3] = [&super::kafka::CAPABILITIES, &super::rabbitmq::CAPABILITIES, &super::rocketmq::CAPABILITIES];

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
            SourceSpec::Kafka(_) | SourceSpec::RabbitMq(_) | SourceSpec::RocketMq(_) => None,
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
            SourceSpec::RabbitMq(_) | SourceSpec::RocketMq(_) => None,
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
        };
        if built { Ok(()) } else { Err(crate::source::not_built(what, feature)) }
    }
}
