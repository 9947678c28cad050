//! A JetStream message as a [`Record`].

use crate::record::{Position, Record};
use std::sync::Arc;

/// The header JetStream deduplicates a publisher's retries on (within the stream's duplicate window); idemflow's
/// `message_id` property.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// A delivery as a [`Record`]: the stream, partition 0 and the stream sequence as its position, the time the
/// server stored it (milliseconds), its headers (a repeated header once per value), its subject as the `subject`
/// property, its `Nats-Msg-Id` header as the `message_id` property, and whether the server delivered it before
/// (`delivered`, its count of deliveries, above 1).
pub fn to_record(stream: Arc<str>, seq: u64, published_ns: i128, delivered: i64, m: async_nats::Message, max_payload_bytes: usize) -> Record {
    let mut headers: Vec<(String, Option<Vec<u8>>)> = Vec::new();
    let mut properties: Vec<(&'static str, String)> = vec![("subject", m.subject.to_string())];
    if let Some(h) = &m.headers {
        for (name, values) in h.iter() {
            for v in values {
                let bytes: &[u8] = v.as_ref();
                headers.push((name.to_string(), Some(bytes.to_vec())));
            }
        }
        if let Some(id) = h.get(MSG_ID_HEADER) {
            properties.push((crate::record::MESSAGE_ID, id.as_str().to_owned()));
        }
    }
    Record {
        position: Position { topic: stream, partition: 0, offset: seq.min(i64::MAX as u64) as i64 },
        timestamp_ms: i64::try_from(published_ns / 1_000_000).ok(),
        key: None,
        headers,
        payload: None,
        oversized: None,
        properties,
        delivered_before: Some(delivered > 1),
        receipt: crate::record::Receipt::next(),
    }
    .with_payload(Some(&m.payload), max_payload_bytes)
}
