//! The Postgres dead letters: `idemflow.dead_letters` (see [`crate::dead_letter`] for what they keep).

use crate::metrics::DeadLetterReason;
use crate::record::Record;
use crate::dead_letter::Stored;
use sqlx::PgConnection;

const INSERT: &str = r#"
INSERT INTO idemflow.dead_letters
    (pipeline, topic, partition, "offset", record_key, header_names, header_values, payload, reason, error,
     payload_bytes, payload_sha256, property_names, property_values, payload_digest)
VALUES ($1, $2, $3, CASE WHEN $3 < 0 THEN nextval('idemflow.queue_dead_letter_seq') ELSE $4 END, $5, $6, $7, $8, $9, $10,
        $11, $12, $13, $14, $15)
ON CONFLICT (pipeline, topic, partition, "offset", payload_digest) DO NOTHING"#;

/// Writes one dead letter. Returns `false` when this record (its position and its payload's digest,
/// [`Record::payload_sha256`]) was already dead-lettered: a redelivery. Only sources with stable positions can tell:
/// a queue's dead letter gets a fresh "offset" from a sequence, see migration 0006. Another payload at a position
/// already dead-lettered (a topic or stream created again) is a dead letter of its own (migration 10).
pub async fn write(
    conn: &mut PgConnection,
    pipeline: &str,
    record: &Record,
    reason: DeadLetterReason,
    error: &str,
) -> Result<bool, sqlx::Error> {
    // Postgres text cannot hold U+0000, and a header name can (AMQP and Kafka header names are any text): it is
    // written `\u0000`, as in the error, rather than the row (and with it the pipeline) failing.
    let names: Vec<String> = record.headers.iter().map(|(k, _)| k.replace('\0', "\\u0000")).collect();
    let values: Vec<Option<&[u8]>> = record.headers.iter().map(|(_, v)| v.as_deref()).collect();
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
        .bind(record.payload_sha256().to_vec())
        .persistent(super::persistent())
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Deletes dead letters of `pipeline` by id (their replay is under way in the same transaction).
pub async fn delete(conn: &mut PgConnection, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error> {
    let done = sqlx::query("DELETE FROM idemflow.dead_letters WHERE pipeline = $1 AND id = ANY($2)")
        .bind(pipeline)
        .bind(ids)
        .persistent(super::persistent())
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected())
}

const SELECT: &str = r#"SELECT id, pipeline, topic, partition, "offset", record_key, header_names, header_values, payload,
    property_names, property_values, payload_bytes, payload_sha256, reason, error, created_at::text AS created_at FROM idemflow.dead_letters"#;

/// The newest dead letters, optionally of one pipeline.
pub async fn list(conn: &mut PgConnection, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE $1::text IS NULL OR pipeline = $1 ORDER BY id DESC LIMIT $2"))
        .bind(pipeline)
        .bind(limit)
        .persistent(super::persistent())
        .fetch_all(&mut *conn)
        .await
}

/// One dead letter by id.
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<Stored>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE id = $1")).bind(id).persistent(super::persistent()).fetch_optional(&mut *conn).await
}

/// The dead letters of `pipeline` stored for `records` (consumed again below the processed floor: their dead letters
/// are published again where the pipeline has a dead-letter topic), each found by its position and its payload's
/// digest (another payload at the position is another record), as `(position, reason, error)`.
///
/// Errors: the database's.
pub async fn at(conn: &mut PgConnection, pipeline: &str, records: &[&Record]) -> Result<Vec<(crate::record::Position, String, String)>, sqlx::Error> {
    let topics: Vec<&str> = records.iter().map(|r| &*r.position.topic).collect();
    let partitions: Vec<i32> = records.iter().map(|r| r.position.partition).collect();
    let offsets: Vec<i64> = records.iter().map(|r| r.position.offset).collect();
    let digests: Vec<Vec<u8>> = records.iter().map(|r| r.payload_sha256().to_vec()).collect();
    let rows: Vec<(String, i32, i64, String, String)> = sqlx::query_as(
        r#"SELECT d.topic, d.partition, d."offset", d.reason, d.error FROM idemflow.dead_letters d
           JOIN unnest($2::text[], $3::int4[], $4::int8[], $5::bytea[]) AS u(topic, partition, "offset", payload_digest)
             ON d.pipeline = $1 AND d.topic = u.topic AND d.partition = u.partition AND d."offset" = u."offset"
            AND d.payload_digest = u.payload_digest"#,
    )
    .bind(pipeline)
    .bind(&topics)
    .bind(&partitions)
    .bind(&offsets)
    .bind(&digests)
    .persistent(super::persistent())
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(topic, partition, offset, reason, error)| (crate::record::Position { topic: topic.into(), partition, offset }, reason, error))
        .collect())
}

