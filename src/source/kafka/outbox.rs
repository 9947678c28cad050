//! The outbox's Kafka records (`[[sink.kafka]]`, [`crate::outbox`]): produced to the brokers of `[kafka]` by an
//! idempotent producer with `acks=all`, one attempt at a time, each bounded by its target's `timeout`
//! (`message.timeout.ms`). Whether a failure is worth another attempt is decided by librdkafka's error code, never by
//! its message.

use super::spec::KafkaSettings;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::time::Duration;

/// One target's producer. One that hit a fatal error (an idempotent producer cannot go on after one: a missing
/// `IDEMPOTENT_WRITE` ACL, a broken sequence) is made again for the next record.
pub struct OutboxProducer {
    producer: std::sync::Mutex<FutureProducer>,
    config: ClientConfig,
}

/// Why a record was not acknowledged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProduceError {
    /// Worth another attempt: the brokers unreachable, a leader moving, replicas short.
    Retry(String),
    /// Not acknowledged within the target's `timeout` (`MSG_TIMED_OUT`): worth another attempt.
    TimedOut(String),
    /// It can never succeed as it is: too large, refused by the topic's ACL, an invalid record or topic.
    Rejected(String),
}

impl OutboxProducer {
    /// A producer with the worker's Kafka settings (`acks=all`, idempotent), records timing out after `timeout`.
    ///
    /// Errors: librdkafka refuses a property (its value hidden: it may be a secret).
    pub fn new(kafka: &KafkaSettings, pipeline: &str, target: &str, timeout: Duration) -> Result<OutboxProducer, KafkaError> {
        let mut config = super::client::producer_config(kafka, format!("idemflow-{pipeline}-outbox-{target}"));
        config.set("message.timeout.ms", timeout.as_millis().clamp(1, i32::MAX as u128).to_string());
        let producer = config.create().map_err(super::client::hide_config_value)?;
        Ok(OutboxProducer { producer: std::sync::Mutex::new(producer), config })
    }

    fn current(&self) -> FutureProducer {
        self.producer.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Produces one record and waits for the brokers' acknowledgement (at most the producer's timeout, plus a second
    /// for the local queue).
    ///
    /// Errors: [`ProduceError`], by librdkafka's code.
    pub async fn produce(&self, topic: &str, key: Option<&[u8]>, headers: &[(String, String)], value: &[u8]) -> Result<(), ProduceError> {
        let mut h = OwnedHeaders::new_with_capacity(headers.len());
        for (k, v) in headers {
            h = h.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(h).payload(value);
        if let Some(k) = key {
            record = record.key(k);
        }
        let producer = self.current();
        match producer.send(record, Duration::from_secs(1)).await {
            Ok(_) => Ok(()),
            Err((e, _)) => {
                if producer.client().fatal_error().is_some() {
                    tracing::warn!(error = %e, "the outbox's Kafka producer hit a fatal error; making a new one for the next record");
                    if let Ok(fresh) = self.config.create::<FutureProducer>() {
                        *self.producer.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
                    }
                    return Err(ProduceError::Retry(format!("{e} (fatal for that producer: a new one sends the next attempt)")));
                }
                Err(classify(&e))
            }
        }
    }

    /// Whether `topic` exists on the brokers (`check`), asked within `within`; no record produced.
    ///
    /// Errors: the brokers could not be asked.
    pub fn topic_exists(&self, topic: &str, within: Duration) -> Result<bool, String> {
        let metadata = self.current().client().fetch_metadata(Some(topic), within).map_err(|e| e.to_string())?;
        Ok(metadata.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    }
}

/// Rejected for librdkafka's codes that no retry can change; every other failure is retried.
fn classify(e: &KafkaError) -> ProduceError {
    let code = e.rdkafka_error_code();
    let permanent = matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
                | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                | RDKafkaErrorCode::UnsupportedForMessageFormat
        )
    );
    let text = format!("{e}");
    if permanent {
        ProduceError::Rejected(text)
    } else if code == Some(RDKafkaErrorCode::MessageTimedOut) {
        ProduceError::TimedOut(text)
    } else {
        ProduceError::Retry(text)
    }
}
