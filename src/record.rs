//! One consumed Kafka record, owned and detached from the consumer.

use rdkafka::message::{BorrowedMessage, Headers, Message};
use std::fmt;
use std::sync::Arc;

/// Where a record sits in Kafka: topic, partition and offset.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Position {
    /// Topic name; shared between the records of a batch.
    pub topic: Arc<str>,
    /// Partition number.
    pub partition: i32,
    /// The record's own offset (not the next one: see [`crate::offsets`]).
    pub offset: i64,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.topic, self.partition, self.offset)
    }
}

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
    /// The value; `None` is a tombstone (a null value, as used by compacted topics).
    pub payload: Option<Vec<u8>>,
}

impl Record {
    /// Copies a message out of the consumer. `topic` is the interned topic name of the message.
    pub fn from_message(message: &BorrowedMessage<'_>, topic: Arc<str>) -> Self {
        let headers = message
            .headers()
            .map(|hs| hs.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
            .unwrap_or_default();
        Record {
            position: Position { topic, partition: message.partition(), offset: message.offset() },
            timestamp_ms: message.timestamp().to_millis(),
            key: message.key().map(<[u8]>::to_vec),
            headers,
            payload: message.payload().map(<[u8]>::to_vec),
        }
    }

    /// The value of the last header with this name (Kafka allows repeats; the last one wins, as in the Java
    /// client's `Headers.lastHeader`). Outer `None`: no such header; inner `None`: a header with a null value.
    pub fn header(&self, name: &str) -> Option<Option<&[u8]>> {
        self.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_deref())
    }
}
