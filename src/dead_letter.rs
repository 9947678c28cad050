//! Dead letters: records that cannot be applied, kept whole in `idemflow.dead_letters` (an oversized payload as its
//! first 1 KiB with its size and SHA-256, see [`crate::record::bounded`]), written in the same transaction as their
//! batch so nothing is lost between "failed" and "recorded". A dead-lettered record writes no
//! dedup row, so the same operation, fixed and replayed, is applied then.

use crate::metrics::DeadLetterReason;
use crate::record::Record;

/// One stored dead letter.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Stored {
    /// Its id.
    pub id: i64,
    /// The pipeline.
    pub pipeline: String,
    /// Where the record was.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// The record key.
    pub record_key: Option<Vec<u8>>,
    /// Header names.
    pub header_names: Vec<String>,
    /// Header values.
    pub header_values: Vec<Option<Vec<u8>>>,
    /// Message property names (see [`crate::record::PROPERTIES`]).
    pub property_names: Vec<String>,
    /// Their values.
    pub property_values: Vec<String>,
    /// The raw value (its first 1 KiB when `payload_bytes` is set).
    pub payload: Option<Vec<u8>>,
    /// The full size of a payload kept only in part (over `max_payload_bytes`).
    pub payload_bytes: Option<i64>,
    /// The SHA-256 of such a payload, whole.
    pub payload_sha256: Option<Vec<u8>>,
    /// Why (a closed set, see `DeadLetterReason`).
    pub reason: String,
    /// The error text.
    pub error: String,
    /// When it was written.
    pub created_at: String,
    /// Redis: how many of the record's commands took effect before one failed (they are not undone; a replay runs
    /// only the rest). `None` elsewhere, and when none did.
    #[sqlx(default)]
    pub commands_done: Option<i64>,
}

impl Stored {
    /// The record as it was consumed (its timestamp is not kept).
    pub fn record(&self) -> Record {
        Record {
            position: crate::record::Position {
                topic: self.topic.as_str().into(),
                partition: self.partition,
                offset: self.offset,
            },
            timestamp_ms: None,
            key: self.record_key.clone(),
            headers: self.header_names.iter().cloned().zip(self.header_values.iter().cloned()).collect(),
            payload: self.payload.clone(),
            oversized: match (self.payload_bytes, self.payload_sha256.as_deref().and_then(|d| <[u8; 32]>::try_from(d).ok())) {
                (Some(size), Some(sha256)) => Some(crate::record::Oversized { size: size as u64, sha256 }),
                _ => None,
            },
            properties: self
                .property_names
                .iter()
                .zip(&self.property_values)
                .filter_map(|(k, v)| crate::record::PROPERTIES.iter().find(|p| **p == k).map(|p| (*p, v.clone())))
                .collect(),
            delivered_before: (self.partition == crate::record::NO_PARTITION).then_some(false),
            receipt: crate::record::Receipt::NONE,
        }
    }
}

/// One dead-lettered record of a committed batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLettered {
    /// Index of the record in the batch.
    pub index: usize,
    /// Why.
    pub reason: DeadLetterReason,
    /// The error text.
    pub error: String,
    /// Whether this position was dead-lettered for the first time.
    pub new: bool,
}

/// `[dead_letters]`: the guard against dead-lettering a whole stream, and the optional dead-letter topic.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterSettings {
    /// Stop the pipeline (fatal) rather than commit a batch that takes the share of dead letters among the last
    /// `window` records above this (0 to 1; default 0.5). 1 disables the guard.
    pub max_ratio: f64,
    /// How many recent records the ratio is taken over (default 1000).
    pub window: u64,
    /// The guard acts only once the window holds at least this many records (default 100).
    pub min_records: u64,
    /// Also produce every dead letter to this Kafka topic, with provenance headers, before the batch's offsets
    /// are committed. `None` (the default): the `idemflow.dead_letters` table only. Kafka pipelines only.
    pub topic: Option<String>,
    /// RabbitMQ pipelines: also publish every dead letter to this exchange (with `routing_key`), with publisher
    /// confirms, before the batch is acknowledged (`source::rabbitmq::dead_letters`).
    pub exchange: Option<String>,
    /// The routing key of those publishes (default: the pipeline's name).
    pub routing_key: Option<String>,
}

impl Default for DeadLetterSettings {
    fn default() -> Self {
        DeadLetterSettings { max_ratio: 0.5, window: 1000, min_records: 100, topic: None, exchange: None, routing_key: None }
    }
}
