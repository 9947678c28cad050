//! Claiming business keys and classifying duplicates: what every store's dedup rows mean.
//!
//! The claim is insert-then-check on a unique index over `(pipeline, key_id)`, never check-then-insert: each
//! store inserts the batch's keys in one statement and learns which rows were new (see
//! [`crate::store::postgres::dedup`] and [`crate::store::mysql::dedup`]). The side effect runs for those only.
//! When another transaction holds an uncommitted row for the same key, the database makes the insert wait for it,
//! so two workers can never both claim a key. The rows that were there already are read back as [`Existing`] and
//! classified here, once for every store.

use crate::metrics::DuplicateReason;
use crate::record::Position;
use crate::store::rows::Existing;

/// Classifies a record against the dedup row of its key (see [`DuplicateReason`]).
///
/// - A source whose position names one record (a Kafka offset, a RocketMQ queue offset: `delivered_before` is
///   `None`): the applied record's position is a redelivery, any other a publish again.
/// - A queue (`delivered_before` is the broker's own redelivery mark, the position has no partition: a delivery tag
///   identifies nothing): a marked delivery with the applied payload is `redelivered`. A marked delivery with another
///   payload stays `payload_mismatch`: a reconnect returns the whole prefetch window marked, so the mark alone must
///   not hide a payload that was never applied.
/// - A JetStream consumer (a mark, and a position that is the stream sequence): the sequence names one message of the
///   stream, so the applied message's sequence with its payload is `redelivered` whatever the delivery count says (a
///   consumer created again delivers it for the first time), and another sequence is another publish even when
///   delivered twice. Only equality is used: the order of sequences proves nothing, deliveries do not follow it.
///   The same sequence with another payload (a stream created again) is `payload_mismatch`.
pub fn classify(existing: &Existing, position: &Position, delivered_before: Option<bool>, fingerprint: &[u8; 32]) -> DuplicateReason {
    let same_payload = existing.same_payload(fingerprint);
    let redelivered = match delivered_before {
        None => existing.position == *position,
        Some(mark) if position.partition == crate::record::NO_PARTITION => mark && same_payload,
        Some(_) => existing.position == *position && same_payload,
    };
    if redelivered {
        DuplicateReason::Redelivered
    } else if same_payload {
        DuplicateReason::Republished
    } else {
        DuplicateReason::PayloadMismatch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_by_position_or_by_the_brokers_mark() {
        let at = |offset| Position { topic: "t".into(), partition: 0, offset };
        let existing = Existing { position: at(5), fingerprint: vec![1; 32] };
        let (same, other) = ([1u8; 32], [2u8; 32]);
        // Kafka: the position decides a redelivery.
        assert_eq!(classify(&existing, &at(5), None, &same), DuplicateReason::Redelivered);
        assert_eq!(classify(&existing, &at(9), None, &same), DuplicateReason::Republished);
        assert_eq!(classify(&existing, &at(9), None, &other), DuplicateReason::PayloadMismatch);
        // A queue: the broker's mark, never the delivery tag; a marked delivery with another payload is a mismatch.
        let queue = |offset| Position { topic: "q".into(), partition: crate::record::NO_PARTITION, offset };
        let applied = Existing { position: queue(5), fingerprint: vec![1; 32] };
        assert_eq!(classify(&applied, &queue(5), Some(false), &same), DuplicateReason::Republished);
        assert_eq!(classify(&applied, &queue(7), Some(true), &same), DuplicateReason::Redelivered);
        assert_eq!(classify(&applied, &queue(7), Some(true), &other), DuplicateReason::PayloadMismatch);
        // A JetStream stream sequence: equality names the message, whatever the delivery count.
        let seq = |offset| Position { topic: "PAYMENTS".into(), partition: 0, offset };
        let stored = Existing { position: seq(5), fingerprint: vec![1; 32] };
        assert_eq!(classify(&stored, &seq(5), Some(false), &same), DuplicateReason::Redelivered, "a consumer created again");
        assert_eq!(classify(&stored, &seq(5), Some(true), &same), DuplicateReason::Redelivered);
        assert_eq!(classify(&stored, &seq(9), Some(true), &same), DuplicateReason::Republished, "a publish again, delivered twice");
        assert_eq!(classify(&stored, &seq(9), Some(false), &same), DuplicateReason::Republished);
        assert_eq!(classify(&stored, &seq(5), Some(true), &other), DuplicateReason::PayloadMismatch, "a stream created again");
    }

    #[test]
    fn a_fingerprint_of_16_bytes_is_the_payloads_sha256_prefix() {
        let at = |offset| Position { topic: "t".into(), partition: 0, offset };
        let mut same = [1u8; 32];
        same[20] = 9; // past the stored 16 bytes: not compared
        let mut other = [1u8; 32];
        other[15] = 9;
        let stored = Existing { position: at(5), fingerprint: vec![1; 16] };
        assert_eq!(classify(&stored, &at(5), None, &same), DuplicateReason::Redelivered);
        assert_eq!(classify(&stored, &at(9), None, &same), DuplicateReason::Republished);
        assert_eq!(classify(&stored, &at(9), None, &other), DuplicateReason::PayloadMismatch);
        // Fewer than 16 bytes compare as another payload, never as the same.
        let short = Existing { position: at(5), fingerprint: vec![1; 8] };
        assert_eq!(classify(&short, &at(9), None, &same), DuplicateReason::PayloadMismatch);
    }
}
