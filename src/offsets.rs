//! Kafka offsets after a batch.
//!
//! Kafka's committed offset is the offset of the *next* record to consume (Kafka protocol, OffsetCommit; the
//! Java client's `commitSync` documentation). So after a batch, each partition's commit is the highest offset
//! processed in it plus one. This module is the only place that adds that one.

use crate::record::Record;
use std::collections::BTreeMap;
use std::sync::Arc;

/// For each `(topic, partition)` of a batch, the offset of the next record to consume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NextOffsets(pub BTreeMap<(Arc<str>, i32), i64>);

impl NextOffsets {
    /// The positions to commit once `records` (every record of a committed batch, dead letters and skipped
    /// duplicates included) are durable: per partition, the highest offset + 1.
    pub fn after(records: &[Record]) -> Self {
        let mut next = BTreeMap::new();
        for r in records {
            let p = &r.position;
            let e = next.entry((p.topic.clone(), p.partition)).or_insert(p.offset + 1);
            *e = (*e).max(p.offset + 1);
        }
        NextOffsets(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Position;

    fn rec(topic: &str, partition: i32, offset: i64) -> Record {
        Record {
            position: Position { topic: topic.into(), partition, offset },
            timestamp_ms: None,
            key: None,
            headers: vec![],
            payload: None,
        }
    }

    #[test]
    fn next_offset_is_highest_plus_one_per_partition() {
        let n = NextOffsets::after(&[rec("a", 0, 5), rec("a", 1, 2), rec("a", 0, 7), rec("b", 0, 0)]);
        let got: Vec<_> = n.0.iter().map(|((t, p), o)| (t.to_string(), *p, *o)).collect();
        assert_eq!(got, vec![("a".into(), 0, 8), ("a".into(), 1, 3), ("b".into(), 0, 1)]);
    }
}
