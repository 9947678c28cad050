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

impl SourceSpec {
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
        !matches!(self, SourceSpec::RabbitMq(_))
    }

    /// The source's kind as written in `[source] kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceSpec::Kafka(_) => "kafka",
            SourceSpec::RabbitMq(_) => "rabbitmq",
            SourceSpec::RocketMq(_) => "rocketmq",
        }
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
