//! Kafka messages as idemflow's records.


use crate::record::Record;
use std::collections::HashMap;
use std::sync::Arc;

/// One shared `Arc<str>` per topic name, so records do not each allocate their topic.
pub(super) fn intern(topics: &mut HashMap<String, Arc<str>>, name: &str) -> Arc<str> {
    if let Some(t) = topics.get(name) {
        return t.clone();
    }
    let t: Arc<str> = Arc::from(name);
    topics.insert(name.to_owned(), t.clone());
    t
}

/// Copies a message out of the consumer into a [`Record`]. `topic` is the interned topic name of the message; a
/// value over `max_payload_bytes` is kept as [`crate::record::bounded`] says.
pub fn to_record(message: &rdkafka::message::BorrowedMessage<'_>, topic: Arc<str>, max_payload_bytes: usize) -> Record {
    use rdkafka::message::{Headers, Message};
    let headers = message
        .headers()
        .map(|hs| hs.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
        .unwrap_or_default();
    Record {
        position: crate::record::Position { topic, partition: message.partition(), offset: message.offset() },
        timestamp_ms: message.timestamp().to_millis(),
        key: message.key().map(<[u8]>::to_vec),
        headers,
        payload: None,
        oversized: None,
        properties: Vec::new(),
        delivered_before: None,
        receipt: crate::record::Receipt::next(),
    }
    .with_payload(message.payload(), max_payload_bytes)
}
