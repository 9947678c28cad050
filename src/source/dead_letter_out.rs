//! Where a pipeline's dead letters also go besides the store's dead-letter table: the broker's own dead-letter
//! publisher (a Kafka topic, a RabbitMQ exchange), when the pipeline's `[dead_letters]` names one.

// A build without some brokers leaves their arms out: the parameters only they use are then unused.
#![cfg_attr(not(all(feature = "kafka", feature = "rabbitmq")), allow(unused_variables, unused_imports))]

use super::contract::Context;
use super::kafka::KafkaSettings;
use super::rabbitmq::RabbitMqSettings;
use crate::record::Record;
use super::{kafka, rabbitmq};

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
    /// The publisher `pipeline`'s `[dead_letters]` names, if any, through the brokers' settings (`[kafka]`, for a
    /// topic; `[rabbitmq]`, for an exchange).
    ///
    /// Errors: the Kafka producer could not be created, as text.
    pub fn new<S>(kafka: &KafkaSettings, rabbitmq: Option<&RabbitMqSettings>, pipeline: &Context<S>) -> Result<Option<DeadLetterOut>, String> {
        let dl = &pipeline.dead_letters;
        Ok(match (&dl.topic, &dl.exchange, rabbitmq) {
            #[cfg(feature = "kafka")]
            (Some(topic), _, _) => Some(DeadLetterOut::Topic(
                kafka::dead_letters::DeadLetterTopic::new(kafka, &pipeline.name, topic).map_err(|e| {
                    format!("cannot create the dead-letter topic's producer: {}", kafka::describe_kafka_error(&e))
                })?,
            )),
            #[cfg(not(feature = "kafka"))]
            (Some(_), _, _) => return Err(super::contract::not_built("Kafka (for [dead_letters] topic)", "kafka")),
            #[cfg(feature = "rabbitmq")]
            (None, Some(exchange), Some(rabbitmq)) => {
                let routing_key = dl.routing_key.as_deref().unwrap_or(&pipeline.name);
                Some(DeadLetterOut::Exchange(rabbitmq::dead_letters::DeadLetterExchange::new(rabbitmq, &pipeline.name, exchange, routing_key)))
            }
            #[cfg(not(feature = "rabbitmq"))]
            (None, Some(_), Some(_)) => return Err(super::contract::not_built("RabbitMQ (for [dead_letters] exchange)", "rabbitmq")),
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
