//! The dedup store: claiming business keys and classifying duplicates.
//!
//! The claim is insert-then-check: one multi-row `INSERT ... ON CONFLICT DO NOTHING RETURNING` over the primary
//! key `(pipeline, key_digest)`. The rows it returns are the keys that were new; the side effect runs for those
//! only. A key already present is never an error (a unique violation would abort the Postgres transaction), and
//! no key is ever checked before it is inserted. When another transaction holds an uncommitted row for the same
//! key, Postgres makes this `INSERT` wait for it (PostgreSQL docs, "INSERT ... ON CONFLICT"), so two workers can
//! never both claim a key.

use crate::key::BusinessKey;
use crate::metrics::DuplicateReason;
use crate::record::Position;
use sqlx::PgConnection;
use std::collections::HashSet;

/// A key claim for one record.
pub struct Claim<'a> {
    /// The key.
    pub key: &'a BusinessKey,
    /// Where the record is.
    pub position: &'a Position,
    /// SHA-256 of its payload.
    pub fingerprint: &'a [u8; 32],
}

/// The dedup row that was already there for a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Existing {
    /// Where the applied record was.
    pub position: Position,
    /// Its payload fingerprint.
    pub fingerprint: Vec<u8>,
}

/// Classifies a record against the dedup row of its key (see [`DuplicateReason`]). `delivered_before` is the
/// broker's own redelivery mark for sources without stable positions ([`crate::record::Record::delivered_before`]):
/// there a marked delivery with the applied payload is `redelivered`, and positions are never compared (a delivery
/// tag identifies nothing). A marked delivery with another payload stays `payload_mismatch`: a reconnect returns
/// the whole prefetch window marked, so the mark alone must not hide a payload that was never applied.
pub fn classify(existing: &Existing, position: &Position, delivered_before: Option<bool>, fingerprint: &[u8; 32]) -> DuplicateReason {
    let redelivered = match delivered_before {
        Some(mark) => mark && existing.fingerprint == fingerprint,
        None => existing.position == *position,
    };
    if redelivered {
        DuplicateReason::Redelivered
    } else if existing.fingerprint == fingerprint {
        DuplicateReason::Republished
    } else {
        DuplicateReason::PayloadMismatch
    }
}

const CLAIM: &str = r#"
INSERT INTO idemflow.dedup (pipeline, key_digest, business_key, topic, partition, "offset", fingerprint)
SELECT $1, u.key_digest, u.business_key, u.topic, u.partition, u."offset", u.fingerprint
FROM unnest($2::bytea[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::bytea[])
     AS u(key_digest, business_key, topic, partition, "offset", fingerprint)
ON CONFLICT (pipeline, key_digest) DO NOTHING
RETURNING key_digest"#;

const EXISTING: &str = r#"
SELECT key_digest, topic, partition, "offset", fingerprint
FROM idemflow.dedup
WHERE pipeline = $1 AND key_digest = ANY($2::bytea[])"#;

/// Claims distinct keys in one statement. Returns the digests that were new.
pub async fn claim(
    conn: &mut PgConnection,
    pipeline: &str,
    claims: &[Claim<'_>],
) -> Result<HashSet<[u8; 32]>, sqlx::Error> {
    let n = claims.len();
    let (mut digests, mut keys, mut topics) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut partitions, mut offsets, mut prints) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for c in claims {
        digests.push(&c.key.digest[..]);
        keys.push(c.key.text.as_str());
        topics.push(&*c.position.topic);
        partitions.push(c.position.partition);
        offsets.push(c.position.offset);
        prints.push(&c.fingerprint[..]);
    }
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(CLAIM)
        .bind(pipeline)
        .bind(&digests)
        .bind(&keys)
        .bind(&topics)
        .bind(&partitions)
        .bind(&offsets)
        .bind(&prints)
        .persistent(crate::db::persistent())
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.into_iter().filter_map(|d| d.try_into().ok()).collect())
}

/// Reads the dedup rows of keys that the claim did not return.
pub async fn existing(
    conn: &mut PgConnection,
    pipeline: &str,
    digests: &[&[u8]],
) -> Result<Vec<([u8; 32], Existing)>, sqlx::Error> {
    type Row = (Vec<u8>, String, i32, i64, Vec<u8>);
    let rows: Vec<Row> =
        sqlx::query_as(EXISTING).bind(pipeline).bind(digests).persistent(crate::db::persistent()).fetch_all(&mut *conn).await?;
    Ok(rows
        .into_iter()
        .filter_map(|(digest, topic, partition, offset, fingerprint)| {
            let digest: [u8; 32] = digest.try_into().ok()?;
            Some((digest, Existing { position: Position { topic: topic.into(), partition, offset }, fingerprint }))
        })
        .collect())
}

const COUNT_DUPLICATES: &str = r#"
UPDATE idemflow.dedup AS d
SET duplicates = d.duplicates + u.n, last_duplicate_at = now()
FROM unnest($2::bytea[], $3::int8[]) AS u(key_digest, n)
WHERE d.pipeline = $1 AND d.key_digest = u.key_digest"#;

/// Adds skipped duplicates to their keys' dedup rows (`duplicates`, `last_duplicate_at`), one statement for a
/// batch. Keys whose row is not there (a duplicate of a dead-lettered record) are left alone.
pub async fn count_duplicates(
    conn: &mut PgConnection,
    pipeline: &str,
    counts: &[([u8; 32], i64)],
) -> Result<(), sqlx::Error> {
    if counts.is_empty() {
        return Ok(());
    }
    // Rows are updated in digest order, so two workers updating the same keys cannot deadlock.
    let mut sorted: Vec<&([u8; 32], i64)> = counts.iter().collect();
    sorted.sort_unstable_by_key(|(d, _)| *d);
    let digests: Vec<&[u8]> = sorted.iter().map(|(d, _)| &d[..]).collect();
    let ns: Vec<i64> = sorted.iter().map(|(_, n)| *n).collect();
    sqlx::query(COUNT_DUPLICATES).bind(pipeline).bind(&digests).bind(&ns).persistent(crate::db::persistent()).execute(&mut *conn).await?;
    Ok(())
}

/// What the dedup store knows of one business key (`idemflow explain`).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct Explained {
    /// The key's canonical text.
    pub business_key: String,
    /// When it was applied (the batch transaction's start).
    pub applied_at: String,
    /// Where the applied record was.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// SHA-256 of its payload, hex.
    pub fingerprint: String,
    /// Duplicates of it skipped since.
    pub duplicates: i64,
    /// When the last one was skipped.
    pub last_duplicate_at: Option<String>,
}

/// Looks a business key up by its canonical text.
pub async fn explain(conn: &mut PgConnection, pipeline: &str, key: &crate::key::BusinessKey) -> Result<Option<Explained>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT business_key, applied_at::text AS applied_at, topic, partition, "offset", encode(fingerprint, 'hex') AS fingerprint,
                  duplicates, last_duplicate_at::text AS last_duplicate_at
           FROM idemflow.dedup WHERE pipeline = $1 AND key_digest = $2"#,
    )
    .bind(pipeline)
    .bind(&key.digest[..])
    .persistent(crate::db::persistent())
    .fetch_optional(&mut *conn)
    .await
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
    }
}
