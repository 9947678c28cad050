//! One consumed record (a Kafka record or a RabbitMQ delivery), owned and detached from its consumer.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where a record sits in its source: a Kafka topic, partition and offset; for a RocketMQ message, `topic/broker`
/// (a RocketMQ queue is named by its topic, its broker and its queue id; neither name may contain `/`), the queue
/// id and the queue offset; for a RabbitMQ queue, the queue name, [`NO_PARTITION`] and the delivery tag (which
/// numbers deliveries on one channel only: not a stable position).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Position {
    /// Topic name; shared between the records of a batch.
    pub topic: Arc<str>,
    /// Partition number.
    pub partition: i32,
    /// The record's own offset (not the next one: see [`crate::offsets`]).
    pub offset: i64,
}

/// The partition of a record from a queue, which has none (RabbitMQ). Kafka partitions are never negative.
pub const NO_PARTITION: i32 = -1;

impl Position {
    /// The topic alone: without a RocketMQ position's `/broker` (Kafka and RocketMQ topic names never contain `/`);
    /// a RabbitMQ queue's name whole (it may).
    pub fn topic_name(&self) -> &str {
        if self.partition == NO_PARTITION {
            return &self.topic;
        }
        self.topic.split('/').next().unwrap_or_default()
    }
}

impl Position {
    /// Whether `other` is in the same partition (queue) of the same topic. A batch holds runs of records of one
    /// partition: callers that tally per partition group them with `chunk_by(|a, b| ...same_partition...)` and
    /// enter each run once, not each record.
    pub fn same_partition(&self, other: &Position) -> bool {
        self.partition == other.partition && self.topic == other.topic
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.partition == NO_PARTITION {
            write!(f, "queue {} (delivery {})", self.topic, self.offset)
        } else {
            write!(f, "{}/{}@{}", self.topic, self.partition, self.offset)
        }
    }
}

/// The message-id property (AMQP `message-id`), the business key the idempotence guides recommend for RabbitMQ.
pub const MESSAGE_ID: &str = "message_id";

/// RocketMQ's KEYS property (`Message.getKeys()`), the business key the RocketMQ idempotence guide recommends;
/// several keys are kept as the producer joined them (space-separated).
pub const MESSAGE_KEYS: &str = "keys";

/// RocketMQ's TAGS property (`Message.getTags()`).
pub const MESSAGE_TAGS: &str = "tags";

/// The message properties a record may carry, by the names a pipeline uses (`[key] property`, `{ property = ... }`).
/// RabbitMQ: the AMQP 0-9-1 basic properties that hold text, and the exchange and routing key a message was
/// published with. RocketMQ: `message_id` (the producer's unique id, `UNIQ_KEY`), `keys`, `tags`; its user
/// properties are headers. NATS JetStream: `subject`, and `message_id` (its `Nats-Msg-Id` header). A Kafka record
/// has none.
pub const PROPERTIES: &[&str] = &[
    MESSAGE_ID,
    "correlation_id",
    "type",
    "app_id",
    "user_id",
    "content_type",
    "content_encoding",
    "reply_to",
    "expiration",
    "timestamp",
    "exchange",
    "routing_key",
    MESSAGE_KEYS,
    MESSAGE_TAGS,
    "subject",
];

/// One record as consumed: position, timestamp, key, headers and payload, all owned.
#[derive(Clone, Debug)]
pub struct Record {
    /// Topic, partition and offset.
    pub position: Position,
    /// The record timestamp in milliseconds since the Unix epoch (producer or broker time), when it has one.
    pub timestamp_ms: Option<i64>,
    /// The Kafka record key, `None` when the record has no key.
    pub key: Option<Vec<u8>>,
    /// Headers in order; a header may repeat, and its value may be null.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The value; `None` is a tombstone (a null value, as used by compacted topics). For an oversized value, its
    /// first [`OVERSIZED_PREFIX_BYTES`] only (see [`Record::oversized`]).
    pub payload: Option<Vec<u8>>,
    /// Set when the value was larger than the pipeline's `max_payload_bytes`: it is not kept whole (a batch of such
    /// records would otherwise hold every one in memory), only its prefix in `payload`, its size and digest here.
    pub oversized: Option<Oversized>,
    /// Message properties by name (see [`PROPERTIES`]); empty for a Kafka record.
    pub properties: Vec<(&'static str, String)>,
    /// Whether the broker says this message was delivered before, for sources whose deliveries do not follow their
    /// positions: RabbitMQ's `redelivered` flag, or an `x-delivery-count` above 0 (quorum queues); a JetStream
    /// delivery count above 1. `None` for sources whose position
    /// identifies a record (Kafka): there, a record at a position processed before is a redelivery.
    pub delivered_before: Option<bool>,
    /// Which reception this is ([`Receipt::next`]); [`Receipt::NONE`] for a record not received from a broker.
    pub receipt: Receipt,
}

/// The number of one reception of a record from its broker, in the order the process received them: never given
/// twice in a process (a record received again, after a rebalance or on a new channel, gets a new one; copies of
/// one `Record` share it). What the worker prepares ahead for a record is found again by it
/// (`prepare::Ahead`): a position alone would not do, as RabbitMQ numbers deliveries per channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Receipt(u64);

impl Receipt {
    /// A record not received from a broker (a dead letter replayed, a test): never matches a prepared entry.
    pub const NONE: Receipt = Receipt(0);

    /// The next number, from 1. Each connector numbers a record when it converts the broker's message.
    pub fn next() -> Receipt {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Receipt(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// How many bytes of an oversized value are kept (for the dead letter's row and for people to look at).
pub const OVERSIZED_PREFIX_BYTES: usize = 1024;

/// The size and digest of a value that was not kept whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oversized {
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 of the whole value.
    pub sha256: [u8; 32],
}

/// `payload` as a record keeps it: whole when it is at most `max_payload_bytes`, otherwise its first
/// [`OVERSIZED_PREFIX_BYTES`] (at most `max_payload_bytes`) with its size and digest.
pub fn bounded(payload: &[u8], max_payload_bytes: usize) -> (Vec<u8>, Option<Oversized>) {
    use sha2::{Digest, Sha256};
    if payload.len() <= max_payload_bytes {
        return (payload.to_vec(), None);
    }
    let keep = OVERSIZED_PREFIX_BYTES.min(max_payload_bytes);
    (payload[..keep].to_vec(), Some(Oversized { size: payload.len() as u64, sha256: Sha256::digest(payload).into() }))
}

impl Record {
    /// Sets the payload, kept as [`bounded`] says.
    pub fn with_payload(mut self, payload: Option<&[u8]>, max_payload_bytes: usize) -> Self {
        if let Some(p) = payload {
            let (kept, oversized) = bounded(p, max_payload_bytes);
            self.payload = Some(kept);
            self.oversized = oversized;
        }
        self
    }

    /// The SHA-256 of the whole payload as received (of no bytes for a record without one; an oversized record's
    /// kept digest): with the position, what makes a dead letter unique (PostgreSQL migration 10, MySQL/MariaDB 4),
    /// so that a new record at a reused position (a topic or stream deleted and created again) is not taken for a
    /// redelivery of the one dead-lettered there.
    pub fn payload_sha256(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        match &self.oversized {
            Some(o) => o.sha256,
            None => Sha256::digest(self.payload.as_deref().unwrap_or_default()).into(),
        }
    }

    /// The value of the last header with this name (Kafka allows repeats; the last one wins, as in the Java
    /// client's `Headers.lastHeader`). Outer `None`: no such header; inner `None`: a header with a null value.
    pub fn header(&self, name: &str) -> Option<Option<&[u8]>> {
        self.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_deref())
    }

    /// A message property's value (see [`PROPERTIES`]); `None` when the message does not carry it.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_values_keep_a_prefix_their_size_and_digest() {
        assert_eq!(bounded(b"abc", 3), (b"abc".to_vec(), None));
        let big = vec![b'x'; 5000];
        let (kept, oversized) = bounded(&big, 4096);
        assert_eq!(kept.len(), OVERSIZED_PREFIX_BYTES);
        let o = oversized.unwrap();
        assert_eq!(o.size, 5000);
        use sha2::Digest;
        assert_eq!(o.sha256, <[u8; 32]>::from(sha2::Sha256::digest(&big)));
        assert_eq!(bounded(&big, 100).0.len(), 100, "never more than the limit");
    }
}
