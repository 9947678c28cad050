//! Consumed positions: what to commit after a batch, and the positions stored in Postgres.
//!
//! Kafka's committed offset is the offset of the *next* record to consume (Kafka protocol, OffsetCommit; the
//! Java client's `commitSync` documentation). So after a batch, each partition's commit is the highest offset
//! processed in it plus one. This module is the only place that adds that one.
//!
//! With `[offsets] store = "database"` the same positions are also written to `idemflow.offsets` inside the
//! batch's transaction ([`advance`]), so the position and the effects commit or roll back together. Ownership
//! is fenced with an epoch per partition: a worker assigned a partition increments the epoch ([`claim`]) and
//! its batches update the row only while the epoch is still theirs. The claim's `UPDATE` waits for the row
//! lock of a previous owner's batch still in flight (Postgres row locking, "Explicit Locking" in its manual),
//! so the new owner starts exactly where the last committed batch ended, and a batch of the previous owner
//! that comes after the claim finds the epoch changed and rolls back whole ([`advance`] reports it fenced).

use crate::record::Record;
use sqlx::{PgConnection, PgPool};
use std::collections::BTreeMap;
use std::sync::Arc;

/// For each `(topic, partition)` of a batch, the offset of the next record to consume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NextOffsets(pub BTreeMap<(Arc<str>, i32), i64>);

impl NextOffsets {
    /// The positions to commit once `records` (every record of a committed batch, dead letters and skipped
    /// duplicates included) are durable: per partition, the highest offset + 1. Records of sources without
    /// stable positions (RabbitMQ: [`Record::delivered_before`] is set) have none and are left out.
    pub fn after(records: &[Record]) -> Self {
        let mut next = BTreeMap::new();
        for r in records.iter().filter(|r| r.delivered_before.is_none()) {
            let p = &r.position;
            let e = next.entry((p.topic.clone(), p.partition)).or_insert(p.offset + 1);
            *e = (*e).max(p.offset + 1);
        }
        NextOffsets(next)
    }
}

/// A partition's stored position after [`claim`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The offset of the next record to consume; `None` if no batch of this pipeline has stored one yet (the
    /// consumer group's committed offset, or `auto.offset.reset`, applies then).
    pub next_offset: Option<i64>,
    /// The epoch the claimant now holds; its batches must present it to [`advance`].
    pub epoch: i64,
}

/// Takes ownership of `partitions` for `pipeline` in one statement: increments each one's epoch (creating the
/// row at epoch 1) and returns the stored positions. `owner` is recorded for operators (host and process).
///
/// Errors: any database error (the caller retries).
pub async fn claim(pool: &PgPool, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> sqlx::Result<Vec<Claimed>> {
    let (topics, parts): (Vec<&str>, Vec<i32>) = partitions.iter().map(|(t, p)| (t.as_str(), *p)).unzip();
    let mut tx = pool.begin().await?;
    // A previous owner frozen inside a batch would hold the row lock for as long as it is frozen: fail after a
    // while (the caller retries) rather than wait without end.
    sqlx::query("SET LOCAL lock_timeout = '5s'").persistent(crate::db::persistent()).execute(&mut *tx).await?;
    let rows: Vec<(String, i32, Option<i64>, i64)> = sqlx::query_as(
        r#"
INSERT INTO idemflow.offsets AS o (pipeline, topic, partition, owner_epoch, owner, claimed_at)
SELECT $1, u.topic, u.partition, 1, $2, now() FROM unnest($3::text[], $4::int4[]) AS u(topic, partition)
ON CONFLICT (pipeline, topic, partition)
DO UPDATE SET owner_epoch = o.owner_epoch + 1, owner = excluded.owner, claimed_at = excluded.claimed_at
RETURNING topic, partition, next_offset, owner_epoch"#,
    )
    .bind(pipeline)
    .bind(owner)
    .bind(&topics)
    .bind(&parts)
    .persistent(crate::db::persistent())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows.into_iter().map(|(topic, partition, next_offset, epoch)| Claimed { topic, partition, next_offset, epoch }).collect())
}

/// The positions a batch stores, with the epoch its worker holds for each partition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Positions(pub Vec<(Arc<str>, i32, i64, i64)>);

impl Positions {
    /// `(topic, partition, next offset, epoch)` for each partition of `next`, with its epoch from `epoch_of`.
    /// A partition without one gets epoch -1, which no row holds, so [`advance`] reports it fenced.
    pub fn new(next: &NextOffsets, epoch_of: impl Fn(&Arc<str>, i32) -> Option<i64>) -> Self {
        Positions(next.0.iter().map(|((t, p), o)| (t.clone(), *p, *o, epoch_of(t, *p).unwrap_or(-1))).collect())
    }
}

/// Stores `positions` inside the batch's transaction, in one statement, for the partitions whose epoch is
/// still the one presented. Returns the partitions that were fenced (another worker claimed them since, or a
/// rewind reset them); the caller must then roll the whole transaction back.
///
/// Errors: any database error.
pub async fn advance(conn: &mut PgConnection, pipeline: &str, positions: &Positions) -> sqlx::Result<Vec<(String, i32)>> {
    if positions.0.is_empty() {
        return Ok(Vec::new());
    }
    let mut topics = Vec::with_capacity(positions.0.len());
    let (mut parts, mut next, mut epochs) = (Vec::new(), Vec::new(), Vec::new());
    for (t, p, o, e) in &positions.0 {
        topics.push(&**t);
        parts.push(*p);
        next.push(*o);
        epochs.push(*e);
    }
    let updated: Vec<(String, i32)> = sqlx::query_as(
        r#"
UPDATE idemflow.offsets AS o SET next_offset = u.next_offset, updated_at = now()
FROM unnest($2::text[], $3::int4[], $4::int8[], $5::int8[]) AS u(topic, partition, next_offset, epoch)
WHERE o.pipeline = $1 AND o.topic = u.topic AND o.partition = u.partition AND o.owner_epoch = u.epoch
RETURNING o.topic, o.partition"#,
    )
    .bind(pipeline)
    .bind(&topics)
    .bind(&parts)
    .bind(&next)
    .bind(&epochs)
    .persistent(crate::db::persistent())
    .fetch_all(&mut *conn)
    .await?;
    Ok(positions
        .0
        .iter()
        .filter(|(t, p, _, _)| !updated.iter().any(|(ut, up)| ut == &**t && up == p))
        .map(|(t, p, _, _)| (t.to_string(), *p))
        .collect())
}

/// The stored positions of `pipeline`: `(topic, partition, next offset)`.
///
/// Errors: any database error.
pub async fn stored(pool: &PgPool, pipeline: &str) -> sqlx::Result<Vec<(String, i32, Option<i64>)>> {
    // In a transaction, as every access is (`[database] prepared_statements = false` behind PgBouncer).
    let mut tx = pool.begin().await?;
    let rows = sqlx::query_as("SELECT topic, partition, next_offset FROM idemflow.offsets WHERE pipeline = $1")
        .bind(pipeline)
        .persistent(crate::db::persistent())
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(rows)
}

/// Sets the stored positions of `pipeline` (for `idemflow rewind`) and increments their epochs, so a worker
/// still holding one of these partitions is fenced. Returns how many rows were written.
///
/// Errors: any database error.
pub async fn reset(pool: &PgPool, pipeline: &str, positions: &[(String, i32, i64)]) -> sqlx::Result<u64> {
    let topics: Vec<&str> = positions.iter().map(|p| p.0.as_str()).collect();
    let parts: Vec<i32> = positions.iter().map(|p| p.1).collect();
    let next: Vec<i64> = positions.iter().map(|p| p.2).collect();
    let mut tx = pool.begin().await?;
    let done = sqlx::query(
        r#"
INSERT INTO idemflow.offsets AS o (pipeline, topic, partition, next_offset, owner_epoch, owner, updated_at)
SELECT $1, u.topic, u.partition, u.next_offset, 1, 'idemflow rewind', now()
FROM unnest($2::text[], $3::int4[], $4::int8[]) AS u(topic, partition, next_offset)
ON CONFLICT (pipeline, topic, partition) DO UPDATE SET next_offset = excluded.next_offset,
    owner_epoch = o.owner_epoch + 1, owner = excluded.owner, updated_at = excluded.updated_at"#,
    )
    .bind(pipeline)
    .bind(&topics)
    .bind(&parts)
    .bind(&next)
    .persistent(crate::db::persistent())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
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

const PROCESSED: &str = r#"
WITH batch AS (
    SELECT * FROM unnest($2::text[], $3::int4[], $4::int8[]) AS u(topic, partition, next_offset)
), before AS (
    SELECT p.topic, p.partition, p.next_offset FROM idemflow.processed p
    JOIN batch b ON p.pipeline = $1 AND p.topic = b.topic AND p.partition = b.partition
), raised AS (
    INSERT INTO idemflow.processed AS p (pipeline, topic, partition, next_offset)
    SELECT $1, topic, partition, next_offset FROM batch ORDER BY topic, partition
    ON CONFLICT (pipeline, topic, partition) DO UPDATE
    SET next_offset = greatest(p.next_offset, EXCLUDED.next_offset), updated_at = now()
)
SELECT topic, partition, next_offset FROM before"#;

/// Raises the processed marks of the batch's partitions to `next` (never lowers them) and returns the marks as
/// they were before, in one statement inside the batch transaction (a data-modifying CTE's sibling reads the
/// snapshot from before the update: PostgreSQL docs, "Data-Modifying Statements in WITH").
///
/// Errors: the database's.
pub async fn processed(conn: &mut PgConnection, pipeline: &str, next: &NextOffsets) -> sqlx::Result<Processed> {
    if next.0.is_empty() {
        return Ok(Processed::default());
    }
    let mut topics = Vec::with_capacity(next.0.len());
    let mut partitions = Vec::with_capacity(next.0.len());
    let mut offsets = Vec::with_capacity(next.0.len());
    for ((t, p), o) in &next.0 {
        topics.push(&**t);
        partitions.push(*p);
        offsets.push(*o);
    }
    let rows: Vec<(String, i32, i64)> = sqlx::query_as(PROCESSED)
        .bind(pipeline)
        .bind(&topics)
        .bind(&partitions)
        .bind(&offsets)
        .persistent(crate::db::persistent())
        .fetch_all(&mut *conn)
        .await?;
    let mut marks = std::collections::HashMap::new();
    for (topic, partition, mark) in rows {
        if let Some(((t, _), _)) = next.0.iter().find(|((t, p), _)| **t == *topic && *p == partition) {
            marks.insert((t.clone(), partition), mark);
        }
    }
    Ok(Processed(marks))
}
