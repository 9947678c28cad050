//! What `idemflow check` and `idemflow run` ask of every source, whatever its broker: reach the broker and find
//! the pipeline's topics or queues ([`check`]), one line saying what the pipeline reads ([`summary`]), settings that
//! work against each other ([`timing_warnings`]), and whether the dedup retention outlasts how long the broker
//! keeps messages ([`retention_report`]). One match per question, one arm per broker.

// A build without some brokers leaves their arms out: the parameters and imports only they use are then unused.
#![cfg_attr(not(all(feature = "kafka", feature = "rabbitmq", feature = "rocketmq", feature = "nats")), allow(unused_variables, unused_imports))]

use super::spec::SourceSpec;
#[cfg(feature = "kafka")]
use super::kafka;
#[cfg(feature = "rabbitmq")]
use super::rabbitmq;
#[cfg(feature = "rocketmq")]
use super::rocketmq;
#[cfg(feature = "nats")]
use super::nats;
use super::{Brokers, SourceContext};
use crate::offsets::OffsetStore;
use std::time::Duration;

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

/// Checks `pipeline`'s source against its broker; the lines to print (`warning: ...` for what could not be
/// verified).
///
/// Errors: [`CheckError`].
pub async fn check(brokers: &Brokers, pipeline: &SourceContext) -> Result<Vec<String>, CheckError> {
    match &pipeline.source {
        #[cfg(feature = "kafka")]
        SourceSpec::Kafka(_) => {
            kafka::check_properties(&brokers.kafka, pipeline).map_err(|e| CheckError::Settings(kafka::describe_kafka_error(&e)))?;
            let (settings, pipeline) = (brokers.kafka.clone(), pipeline.clone());
            let topics = tokio::task::spawn_blocking(move || kafka::check_topics(&settings, &pipeline, Duration::from_secs(5)));
            match topics.await {
                Ok(Ok(())) => Ok(Vec::new()),
                Ok(Err(e)) => Err(CheckError::Broker(e.to_string())),
                Err(e) => Err(CheckError::Broker(e.to_string())),
            }
        }
        #[cfg(feature = "rabbitmq")]
        SourceSpec::RabbitMq(_) => {
            let settings = brokers.rabbitmq.as_ref().ok_or_else(|| CheckError::Broker("[rabbitmq] url is not set".to_owned()))?;
            rabbitmq::check(settings, pipeline).await.map_err(CheckError::Broker)
        }
        #[cfg(feature = "rocketmq")]
        SourceSpec::RocketMq(_) => {
            let settings = brokers.rocketmq.as_ref().ok_or_else(|| CheckError::Broker("[rocketmq] name_server is not set".to_owned()))?;
            rocketmq::check(settings, pipeline).await.map_err(CheckError::Broker)
        }
        #[cfg(feature = "nats")]
        SourceSpec::Nats(_) => {
            let settings = brokers.nats.as_ref().ok_or_else(|| CheckError::Broker("[nats] url is not set".to_owned()))?;
            nats::check(settings, pipeline).await.map_err(CheckError::Broker)
        }
        #[cfg(not(feature = "nats"))]
        SourceSpec::Nats(_) => Err(CheckError::Broker(super::not_built("NATS JetStream", "nats"))),
        #[cfg(not(feature = "kafka"))]
        SourceSpec::Kafka(_) => Err(CheckError::Broker(super::not_built("Kafka", "kafka"))),
        #[cfg(not(feature = "rabbitmq"))]
        SourceSpec::RabbitMq(_) => Err(CheckError::Broker(super::not_built("RabbitMQ", "rabbitmq"))),
        #[cfg(not(feature = "rocketmq"))]
        SourceSpec::RocketMq(_) => Err(CheckError::Broker(super::not_built("RocketMQ", "rocketmq"))),
    }
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

/// What `pipeline` reads: see [`Reads`].
pub fn summary(pipeline: &SourceContext) -> Reads {
    use serde_json::json;
    let (kind, settings) = match &pipeline.source {
        SourceSpec::Kafka(k) => ("kafka", vec![("topics", json!(k.topics)), ("group_id", json!(k.group_id))]),
        SourceSpec::RabbitMq(q) => ("rabbitmq", vec![("queues", json!(q.queues)), ("prefetch", json!(q.prefetch))]),
        SourceSpec::RocketMq(r) => (
            "rocketmq",
            vec![
                ("topic", json!(r.topic)),
                ("consumer_group", json!(r.consumer_group)),
                ("offsets", json!(if pipeline.offsets == OffsetStore::Database { "database" } else { "broker" })),
            ],
        ),
        SourceSpec::Nats(n) => (
            "nats",
            vec![
                ("stream", json!(n.stream)),
                ("consumer", json!(n.consumer)),
                ("ack_wait", json!(crate::terminal::duration(n.ack_wait))),
                ("max_ack_pending", json!(n.max_ack_pending)),
            ],
        ),
    };
    Reads { kind, settings: settings.into_iter().map(|(k, v)| (k.to_owned(), v)).collect() }
}

/// Settings of `pipeline` and of its broker's client that work against each other, one sentence each (`check`
/// prints them as warnings). Only Kafka's consumer has such timings.
#[cfg_attr(not(feature = "kafka"), allow(unused_variables))]
pub fn timing_warnings(brokers: &Brokers, pipeline: &SourceContext) -> Vec<String> {
    match &pipeline.source {
        #[cfg(feature = "kafka")]
        SourceSpec::Kafka(_) => kafka::timing_warnings(brokers, pipeline),
        #[cfg(not(feature = "kafka"))]
        SourceSpec::Kafka(_) => Vec::new(),
        SourceSpec::RabbitMq(_) | SourceSpec::RocketMq(_) | SourceSpec::Nats(_) => Vec::new(),
    }
}

/// Compares `pipeline`'s dedup retention with how long its broker keeps messages: one line per topic
/// (`warning: ...` where the retention falls short or could not be read).
#[cfg_attr(not(feature = "kafka"), allow(unused_variables))]
pub async fn retention_report(brokers: &Brokers, pipeline: &SourceContext) -> Vec<String> {
    let retention = crate::terminal::duration(pipeline.dedup_retention);
    match &pipeline.source {
        SourceSpec::RocketMq(r) => vec![format!(
            "pipeline {:?}: topic {:?}: a RocketMQ broker keeps messages for its fileReservedTime (72 h by default); \
             [dedup] retention = {retention} must outlast it, or a replay of older messages (a rewind) would apply them again",
            pipeline.name, r.topic,
        )],
        SourceSpec::RabbitMq(_) => vec![format!(
            "pipeline {:?}: a queue has no retention.ms to compare with; [dedup] retention = {retention} must outlast the longest \
             time a message can wait in its queues (a message redelivered after its dedup row was purged is applied again)",
            pipeline.name,
        )],
        // `check` compares the stream's max_age with the retention when it reads the stream (see `nats::check`).
        SourceSpec::Nats(n) => vec![format!(
            "pipeline {:?}: stream {:?}: [dedup] retention = {retention} must outlast how long the stream keeps a message \
             (max_age) and the longest a message can stay unacknowledged",
            pipeline.name, n.stream,
        )],
        #[cfg(feature = "kafka")]
        SourceSpec::Kafka(k) => kafka::retention_report(&brokers.kafka, &pipeline.name, &k.topics, pipeline.dedup_retention).await,
        #[cfg(not(feature = "kafka"))]
        SourceSpec::Kafka(_) => vec![format!("warning: pipeline {:?}: {}", pipeline.name, super::not_built("Kafka", "kafka"))],
    }
}
