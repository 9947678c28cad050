//! The MySQL and MariaDB dead letters: `idemflow_dead_letters` (see [`crate::dead_letter`] for what they
//! keep). Headers and properties are JSON arrays (header values as hex strings, or null); a queue's dead letter
//! has a NULL `offset` and is numbered by its id.

use crate::metrics::DeadLetterReason;
use crate::record::{Record, NO_PARTITION};
use crate::dead_letter::Stored;
use sqlx::MySqlConnection;

const INSERT: &str = "INSERT INTO idemflow_dead_letters \
    (pipeline, topic, `partition`, `offset`, record_key, header_names, header_values, property_names, property_values, \
     payload, payload_bytes, payload_sha256, reason, error, payload_digest) \
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
    ON DUPLICATE KEY UPDATE redeliveries = redeliveries + 1";

/// Writes one dead letter. Returns `false` when this record (its position and its payload's digest,
/// [`Record::payload_sha256`]; another payload at the position is a dead letter of its own, migration 4) was already
/// dead-lettered (a redelivery: the row's
/// `redeliveries` goes up instead; MySQL reports 2 affected rows for an update by `ON DUPLICATE KEY UPDATE`, 1
/// for an insert).
pub async fn write(conn: &mut MySqlConnection, pipeline: &str, record: &Record, reason: DeadLetterReason, error: &str) -> Result<bool, sqlx::Error> {
    let names: Vec<&str> = record.headers.iter().map(|(k, _)| k.as_str()).collect();
    let values: Vec<Option<String>> = record.headers.iter().map(|(_, v)| v.as_deref().map(crate::terminal::hex)).collect();
    let property_names: Vec<&str> = record.properties.iter().map(|(k, _)| *k).collect();
    let property_values: Vec<&str> = record.properties.iter().map(|(_, v)| v.as_str()).collect();
    // A payload the statement could not carry (over max_allowed_packet) keeps its head, size and SHA-256, as an
    // oversized one does: the dead letter must fit, or the record would block its partition.
    let mut bounded = None;
    if let Some(payload) = record.payload.as_deref().filter(|p| p.len() as u64 > super::PACKET_MARGIN) {
        let packet = super::max_allowed_packet(conn).await?;
        // Everything else the row carries: the key, the error, the headers (values as hex: twice their size) and the
        // properties, as JSON.
        let headers: usize = record.headers.iter().map(|(k, v)| k.len() + 2 * v.as_ref().map_or(0, Vec::len) + 8).sum();
        let properties: usize = record.properties.iter().map(|(k, v)| k.len() + v.len() + 8).sum();
        let rest = (error.len() + record.key.as_ref().map_or(0, Vec::len) + headers + properties) as u64;
        let room = packet.saturating_sub(super::PACKET_MARGIN + rest);
        if payload.len() as u64 > room {
            bounded = Some(crate::record::bounded(payload, room as usize));
        }
    }
    let (payload, oversized) = match &bounded {
        Some((head, over)) => (Some(head.as_slice()), over.as_ref()),
        None => (record.payload.as_deref(), record.oversized.as_ref()),
    };
    let p = &record.position;
    let done = sqlx::query(INSERT)
        .bind(pipeline)
        .bind(&*p.topic)
        .bind(p.partition)
        .bind((p.partition != NO_PARTITION).then_some(p.offset))
        .bind(record.key.as_deref())
        .bind(json(&names))
        .bind(json(&values))
        .bind(json(&property_names))
        .bind(json(&property_values))
        .bind(payload)
        .bind(oversized.map(|o| o.size as i64))
        .bind(oversized.map(|o| o.sha256.to_vec()))
        .bind(reason.as_str())
        .bind(error)
        .bind(record.payload_sha256().to_vec())
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// A JSON text column's value: names and hex strings always serialise.
fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "[]".to_owned())
}

/// Deletes dead letters of `pipeline` by id (their replay is under way in the same transaction).
pub async fn delete(conn: &mut MySqlConnection, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql = format!("DELETE FROM idemflow_dead_letters WHERE pipeline = ? AND id IN ({})", super::marks(ids.len()));
    let mut q = sqlx::query(&sql).bind(pipeline);
    for id in ids {
        q = q.bind(id);
    }
    Ok(q.execute(&mut *conn).await?.rows_affected())
}

const SELECT: &str = "SELECT id, CAST(pipeline AS CHAR), CAST(topic AS CHAR), `partition`, COALESCE(`offset`, id), record_key, \
    CAST(header_names AS CHAR), CAST(header_values AS CHAR), CAST(property_names AS CHAR), CAST(property_values AS CHAR), \
    payload, payload_bytes, payload_sha256, CAST(reason AS CHAR), CAST(error AS CHAR), \
    DATE_FORMAT(created_at, '%Y-%m-%d %H:%i:%s.%f+00') FROM idemflow_dead_letters";

type Row = (
    i64,
    String,
    String,
    i32,
    i64,
    Option<Vec<u8>>,
    String,
    String,
    String,
    String,
    Option<Vec<u8>>,
    Option<i64>,
    Option<Vec<u8>>,
    String,
    String,
    String,
);

fn stored(row: Row) -> Result<Stored, sqlx::Error> {
    let (id, pipeline, topic, partition, offset, record_key, hn, hv, pn, pv, payload, payload_bytes, payload_sha256, reason, error, created_at) =
        row;
    let decode = |e: serde_json::Error| sqlx::Error::Decode(Box::new(e));
    let header_values: Vec<Option<String>> = serde_json::from_str(&hv).map_err(decode)?;
    Ok(Stored {
        id,
        pipeline,
        topic,
        partition,
        offset,
        record_key,
        header_names: serde_json::from_str(&hn).map_err(decode)?,
        header_values: header_values.into_iter().map(|v| v.map(|h| unhex(&h))).collect(),
        property_names: serde_json::from_str(&pn).map_err(decode)?,
        property_values: serde_json::from_str(&pv).map_err(decode)?,
        payload,
        payload_bytes,
        payload_sha256,
        reason,
        error,
        created_at,
        commands_done: None,
    })
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2).filter_map(|i| u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()).collect()
}

/// The newest dead letters, optionally of one pipeline.
pub async fn list(conn: &mut MySqlConnection, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(&format!("{SELECT} WHERE ? IS NULL OR pipeline = ? ORDER BY id DESC LIMIT ?"))
        .bind(pipeline)
        .bind(pipeline)
        .bind(limit)
        .fetch_all(&mut *conn)
        .await?;
    rows.into_iter().map(stored).collect()
}

/// One dead letter by id.
pub async fn get(conn: &mut MySqlConnection, id: i64) -> Result<Option<Stored>, sqlx::Error> {
    let row: Option<Row> = sqlx::query_as(&format!("{SELECT} WHERE id = ?")).bind(id).fetch_optional(&mut *conn).await?;
    row.map(stored).transpose()
}

/// The dead letters of `pipeline` stored at `positions` (see [`crate::store::postgres::dead_letter::at`]), in chunks
/// of 500 positions a statement.
///
/// Errors: the database's.
pub async fn at(conn: &mut MySqlConnection, pipeline: &str, records: &[&Record]) -> Result<Vec<(crate::record::Position, String, String)>, sqlx::Error> {
    let mut out = Vec::new();
    for chunk in records.chunks(500) {
        let sql = format!(
            "SELECT CAST(topic AS CHAR), `partition`, `offset`, CAST(reason AS CHAR), CAST(error AS CHAR) FROM idemflow_dead_letters \
             WHERE pipeline = ? AND (topic, `partition`, `offset`, payload_digest) IN ({})",
            vec!["(?, ?, ?, ?)"; chunk.len()].join(", ")
        );
        let mut q = sqlx::query_as::<_, (String, i32, i64, String, String)>(&sql).bind(pipeline);
        for r in chunk {
            q = q.bind(&*r.position.topic).bind(r.position.partition).bind(r.position.offset).bind(r.payload_sha256().to_vec());
        }
        for (topic, partition, offset, reason, error) in q.fetch_all(&mut *conn).await? {
            out.push((crate::record::Position { topic: topic.into(), partition, offset }, reason, error));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_round_trip() {
        let bytes = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(super::unhex(&crate::terminal::hex(&bytes)), bytes);
    }
}
