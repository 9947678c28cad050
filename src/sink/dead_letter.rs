//! Dead letters: records that cannot be applied, kept whole in `idemflow.dead_letters`, written in the same
//! transaction as their batch so nothing is lost between "failed" and "recorded". A dead-lettered record writes no
//! dedup row, so the same operation, fixed and replayed, is applied then.

use crate::metrics::DeadLetterReason;
use crate::record::Record;
use sqlx::PgConnection;

const INSERT: &str = r#"
INSERT INTO idemflow.dead_letters
    (pipeline, topic, partition, "offset", record_key, header_names, header_values, payload, reason, error)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (pipeline, topic, partition, "offset") DO NOTHING"#;

/// Writes one dead letter. Returns `false` when this position was already dead-lettered (a redelivery).
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
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}
