//! The optional dead-letter topic (`[dead_letters] topic`): every dead letter of a committed batch is also produced
//! to Kafka, with provenance headers, and the batch's offsets are committed only after the broker acknowledged
//! all of them. A crash in between redelivers the batch; its dead letters are produced again (at least once).
//!
//! Headers added to the original ones: `idemflow.pipeline`, `idemflow.topic`, `idemflow.partition`,
//! `idemflow.offset`, `idemflow.reason`, `idemflow.error`. Key and value are the original record's, byte for byte.

use super::spec::KafkaSettings;
use crate::record::Record;
use crate::dead_letter::DeadLettered;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Duration;

/// A producer to one pipeline's dead-letter topic.
pub struct DeadLetterTopic {
    producer: FutureProducer,
    topic: String,
    pipeline: String,
}

impl DeadLetterTopic {
    /// A producer with the worker's Kafka settings (`acks=all`, idempotent).
    pub fn new(kafka: &KafkaSettings, pipeline: &str, topic: &str) -> Result<Self, KafkaError> {
        let config = super::client::producer_config(kafka, format!("idemflow-{pipeline}-dead-letters"));
        Ok(DeadLetterTopic { producer: config.create().map_err(super::client::hide_config_value)?, topic: topic.to_owned(), pipeline: pipeline.to_owned() })
    }

    /// Produces the dead letters of a committed batch and waits for every acknowledgement.
    ///
    /// Errors: the first delivery failure; the caller retries the whole call (duplicates in the topic are
    /// possible, losses are not).
    pub async fn publish(&self, batch: &[Record], dead: &[DeadLettered]) -> Result<(), KafkaError> {
        let mut pending = Vec::with_capacity(dead.len());
        for d in dead {
            let r = &batch[d.index];
            let mut headers = OwnedHeaders::new_with_capacity(r.headers.len() + 6);
            for (k, v) in &r.headers {
                headers = headers.insert(Header { key: k, value: v.as_deref() });
            }
            let partition = r.position.partition.to_string();
            let offset = r.position.offset.to_string();
            // An oversized payload was not kept whole: its prefix goes to the topic, with its full size and digest.
            if let Some(o) = &r.oversized {
                let size = o.size.to_string();
                let sha256 = crate::terminal::hex(&o.sha256);
                headers = headers.insert(Header { key: "idemflow.payload_bytes", value: Some(&size) });
                headers = headers.insert(Header { key: "idemflow.payload_sha256", value: Some(&sha256) });
            }
            for (k, v) in [
                ("idemflow.pipeline", self.pipeline.as_str()),
                ("idemflow.topic", &*r.position.topic),
                ("idemflow.partition", &partition),
                ("idemflow.offset", &offset),
                ("idemflow.reason", d.reason.as_str()),
                ("idemflow.error", &d.error),
            ] {
                headers = headers.insert(Header { key: k, value: Some(v) });
            }
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.topic).headers(headers);
            if let Some(k) = &r.key {
                record = record.key(k);
            }
            if let Some(p) = &r.payload {
                record = record.payload(p);
            }
            pending.push(self.producer.send(record, Duration::from_secs(30)));
        }
        for p in pending {
            p.await.map_err(|(e, _)| e)?;
        }
        Ok(())
    }
}
