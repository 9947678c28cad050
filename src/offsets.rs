//! Consumed positions: what to commit after a batch, and the positions stored in the database.
//!
//! Kafka's committed offset is the offset of the *next* record to consume (Kafka protocol, OffsetCommit; the
//! Java client's `commitSync` documentation). So after a batch, each partition's commit is the highest offset
//! processed in it plus one. This module is the only place that adds that one.
//!
//! With `[offsets] store = "database"` the same positions are also written to the store's offsets table inside
//! the batch's transaction ([`crate::store::Tx::advance_offsets`]), so the position and the effects commit or roll
//! back together. Ownership is fenced with an epoch per partition: a worker assigned a partition increments the
//! epoch ([`crate::store::Store::claim_offsets`]) and its batches update the row only while the epoch is still
//! theirs. The claim waits for the row lock of a previous owner's batch still in flight (PostgreSQL, "Explicit
//! Locking"; InnoDB, "Locking Reads"), so the new owner starts exactly where the last committed batch ended, and a
//! batch of the previous owner that comes after the claim finds the epoch changed and rolls back whole (the store
//! reports it fenced).

use serde::Deserialize;
use crate::record::Record;
use std::collections::BTreeMap;
use std::sync::Arc;

/// For each `(topic, partition)` of a batch, the offset of the next record to consume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NextOffsets(pub BTreeMap<(Arc<str>, i32), i64>);

impl NextOffsets {
    /// The positions to commit once `records` (every record of a committed batch, dead letters and skipped
    /// duplicates included) are durable: per partition, the highest offset + 1. Records of sources without
    /// positions to commit (RabbitMQ, NATS JetStream: [`Record::delivered_before`] is set) are left out.
    pub fn after(records: &[Record]) -> Self {
        let mut next = BTreeMap::new();
        let mut raise = |p: &crate::record::Position, to: i64| {
            let e = next.entry((p.topic.clone(), p.partition)).or_insert(to);
            *e = (*e).max(to);
        };
        // A batch holds runs of records of one partition: each run is entered into the map once.
        let mut run: Option<(&crate::record::Position, i64)> = None;
        for r in records.iter().filter(|r| r.delivered_before.is_none()) {
            let p = &r.position;
            match &mut run {
                Some((q, to)) if q.same_partition(p) => *to = (*to).max(p.offset + 1),
                _ => {
                    if let Some((q, to)) = run.replace((p, p.offset + 1)) {
                        raise(q, to);
                    }
                }
            }
        }
        if let Some((q, to)) = run {
            raise(q, to);
        }
        NextOffsets(next)
    }
}

/// A partition's stored position after [`crate::store::Store::claim_offsets`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The offset of the next record to consume; `None` if no batch of this pipeline has stored one yet (the
    /// consumer group's committed offset, or `auto.offset.reset`, applies then).
    pub next_offset: Option<i64>,
    /// The epoch the claimant now holds; its batches must present it to [`crate::store::Tx::advance_offsets`].
    pub epoch: i64,
}

/// The positions a batch stores, with the epoch its worker holds for each partition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Positions(pub Vec<(Arc<str>, i32, i64, i64)>);

impl Positions {
    /// `(topic, partition, next offset, epoch)` for each partition of `next`, with its epoch from `epoch_of`.
    /// A partition without one gets epoch -1, which no row holds, so the store reports it fenced.
    pub fn new(next: &NextOffsets, epoch_of: impl Fn(&Arc<str>, i32) -> Option<i64>) -> Self {
        Positions(next.0.iter().map(|((t, p), o)| (t.clone(), *p, *o, epoch_of(t, *p).unwrap_or(-1))).collect())
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
            oversized: None,
            properties: Vec::new(),
            delivered_before: None,
            receipt: crate::record::Receipt::NONE,
        }
    }

    #[test]
    fn next_offset_is_highest_plus_one_per_partition() {
        let n = NextOffsets::after(&[rec("a", 0, 5), rec("a", 1, 2), rec("a", 0, 7), rec("b", 0, 0)]);
        let got: Vec<_> = n.0.iter().map(|((t, p), o)| (t.to_string(), *p, *o)).collect();
        assert_eq!(got, vec![("a".into(), 0, 8), ("a".into(), 1, 3), ("b".into(), 0, 1)]);
    }
}

/// Per partition, one past the highest offset this pipeline had processed before the batch (`idemflow.processed`).
/// A record below its partition's mark was processed before: it is a redelivery.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Processed(pub std::collections::HashMap<(Arc<str>, i32), i64>);

impl Processed {
    /// Whether the record at `position` was processed by an earlier batch.
    pub fn before(&self, position: &crate::record::Position) -> bool {
        self.0.get(&(position.topic.clone(), position.partition)).is_some_and(|next| position.offset < *next)
    }
}

/// `[offsets] store`: where a pipeline keeps the consumed position of each partition.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OffsetStore {
    /// The consumer group's committed offsets in the broker (Kafka, or a RocketMQ broker's consumer offsets),
    /// committed after each batch's transaction. A crash between the two redelivers that batch, and its records
    /// are skipped as `redelivered` duplicates. Written `"broker"` or `"kafka"`.
    #[default]
    #[serde(alias = "kafka")]
    Broker,
    /// The `idemflow.offsets` table, written in each batch's transaction and fenced by an owner epoch; on
    /// assignment the worker starts each partition from its stored position, so a crash or a rebalance
    /// redelivers nothing. The Kafka commit is still made afterwards, for lag monitoring and as the fallback
    /// for partitions with no stored position yet.
    Database,
}
