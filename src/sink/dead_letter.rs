//! Dead letters: records that cannot be applied, kept whole in `idemflow.dead_letters` (an oversized payload as its
//! first 1 KiB with its size and SHA-256, see [`crate::record::bounded`]), written in the same transaction as their
//! batch so nothing is lost between "failed" and "recorded". A dead-lettered record writes no
//! dedup row, so the same operation, fixed and replayed, is applied then.

use crate::metrics::DeadLetterReason;
use crate::record::Record;
use sqlx::PgConnection;

const INSERT: &str = r#"
INSERT INTO idemflow.dead_letters
    (pipeline, topic, partition, "offset", record_key, header_names, header_values, payload, reason, error,
     payload_bytes, payload_sha256, property_names, property_values)
VALUES ($1, $2, $3, CASE WHEN $3 < 0 THEN nextval('idemflow.queue_dead_letter_seq') ELSE $4 END, $5, $6, $7, $8, $9, $10,
        $11, $12, $13, $14)
ON CONFLICT (pipeline, topic, partition, "offset") DO NOTHING"#;

/// Writes one dead letter. Returns `false` when this position was already dead-lettered (a redelivery; only
/// sources with stable positions can tell: a queue's dead letter gets a fresh "offset" from a sequence, see
/// migration 0006).
pub async fn write(
    conn: &mut PgConnection,
    pipeline: &str,
    record: &Record,
    reason: DeadLetterReason,
    error: &str,
) -> Result<bool, sqlx::Error> {
    let names: Vec<&str> = record.headers.iter().map(|(k, _)| k.as_str()).collect();
    let values: Vec<Option<&[u8]>> = record.headers.iter().map(|(_, v)| v.as_deref()).collect();
    // Postgres text cannot hold U+0000: keep the error readable rather than lose the row.
    let error = error.replace('\0', "\\u0000");
    let done = sqlx::query(INSERT)
        .bind(pipeline)
        .bind(&*record.position.topic)
        .bind(record.position.partition)
        .bind(record.position.offset)
        .bind(record.key.as_deref())
        .bind(&names)
        .bind(&values)
        .bind(record.payload.as_deref())
        .bind(reason.as_str())
        .bind(&error)
        .bind(record.oversized.as_ref().map(|o| o.size as i64))
        .bind(record.oversized.as_ref().map(|o| o.sha256.to_vec()))
        .bind(record.properties.iter().map(|(k, _)| *k).collect::<Vec<&str>>())
        .bind(record.properties.iter().map(|(_, v)| v.replace('\0', "\\u0000")).collect::<Vec<String>>())
        .persistent(crate::db::persistent())
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Deletes dead letters of `pipeline` by id (their replay is under way in the same transaction).
pub async fn delete(conn: &mut PgConnection, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error> {
    let done = sqlx::query("DELETE FROM idemflow.dead_letters WHERE pipeline = $1 AND id = ANY($2)")
        .bind(pipeline)
        .bind(ids)
        .persistent(crate::db::persistent())
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected())
}

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
}

const SELECT: &str = r#"SELECT id, pipeline, topic, partition, "offset", record_key, header_names, header_values, payload,
    property_names, property_values, payload_bytes, payload_sha256, reason, error, created_at::text AS created_at FROM idemflow.dead_letters"#;

/// The newest dead letters, optionally of one pipeline.
pub async fn list(conn: &mut PgConnection, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE $1::text IS NULL OR pipeline = $1 ORDER BY id DESC LIMIT $2"))
        .bind(pipeline)
        .bind(limit)
        .persistent(crate::db::persistent())
        .fetch_all(&mut *conn)
        .await
}

/// One dead letter by id.
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<Stored>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE id = $1")).bind(id).persistent(crate::db::persistent()).fetch_optional(&mut *conn).await
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
        }
    }
}
