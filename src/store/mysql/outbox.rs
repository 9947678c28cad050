//! The MySQL/MariaDB outbox: `idemflow_outbox` (migration 6; [`crate::outbox`] has the protocol), as PostgreSQL's:
//! rows written in the batch's transaction, leased by the relay in a short transaction of their own (`FOR UPDATE
//! SKIP LOCKED`: MySQL 8.0, MariaDB 10.6), settled in another. Header values are kept as hex, as the dead letters
//! keep them, so a failed row moves to the dead letters as it is.

use crate::record::{Record, NO_PARTITION};
use crate::store::rows::{Apply, Leased, OutboxDepth, OutboxRequest, Settled};
use sqlx::{MySqlConnection, MySqlPool};
use std::time::Duration;

/// Rows per `INSERT` (12 placeholders each), and the bytes of bodies after which a statement is sent before it
/// grows past a server's `max_allowed_packet` (16 MiB by default on MariaDB, 64 MiB on MySQL).
const ROWS_PER_INSERT: usize = 1000;
const BYTES_PER_INSERT: usize = 4 << 20;

/// Whether a server of `version` (`SELECT VERSION()`) takes `FOR UPDATE SKIP LOCKED`: MySQL 8.0, MariaDB 10.6 and
/// later.
///
/// Errors: the version, and what is needed.
pub fn supported(version: &str) -> Result<(), String> {
    let mut parts = version.split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let (ok, needed) = if version.contains("MariaDB") { ((major, minor) >= (10, 6), "MariaDB 10.6") } else { (major >= 8, "MySQL 8.0") };
    if ok {
        Ok(())
    } else {
        Err(format!("the outbox's relay takes rows with FOR UPDATE SKIP LOCKED, which needs {needed} or later; this server is {version}"))
    }
}

/// Writes the requests of `rows`, in order, in as few statements as fit.
pub async fn write(conn: &mut MySqlConnection, pipeline: &str, rows: &[(&Record, &Apply)]) -> Result<(), sqlx::Error> {
    let all: Vec<(&Record, &[u8; 32], &OutboxRequest)> =
        rows.iter().flat_map(|(record, apply)| apply.requests.iter().map(move |r| (*record, &apply.key.digest, r))).collect();
    let mut start = 0;
    while start < all.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < all.len() && end - start < ROWS_PER_INSERT && (end == start || bytes < BYTES_PER_INSERT) {
            bytes += all[end].2.body.len() + all[end].2.url.len();
            end += 1;
        }
        let chunk = &all[start..end];
        let values = vec!["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!(
            "INSERT INTO idemflow_outbox (pipeline, key_digest, target, method, url, header_names, header_values, body, record_key, topic, `partition`, `offset`) VALUES {values}"
        );
        let mut q = sqlx::query(&sql);
        for (record, digest, r) in chunk {
            let p = &record.position;
            q = q
                .bind(pipeline)
                .bind(&digest[..])
                .bind(&r.target)
                .bind(&r.method)
                .bind(&r.url)
                .bind(serde_json::Value::from(r.headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>()).to_string())
                .bind(serde_json::Value::from(r.headers.iter().map(|(_, v)| crate::terminal::hex(v.as_bytes())).collect::<Vec<_>>()).to_string())
                .bind(&r.body)
                .bind(r.key.as_deref())
                .bind(&*p.topic)
                .bind(p.partition)
                .bind((p.partition != NO_PARTITION).then_some(p.offset));
        }
        q.execute(&mut *conn).await?;
        start = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn skip_locked_needs_mysql_8_or_mariadb_10_6() {
        assert!(super::supported("8.0.36").is_ok());
        assert!(super::supported("10.11.6-MariaDB-0+deb12u1").is_ok());
        assert!(super::supported("10.6.1-MariaDB").is_ok());
        assert!(super::supported("10.5.23-MariaDB").unwrap_err().contains("MariaDB 10.6"));
        assert!(super::supported("5.7.44").unwrap_err().contains("MySQL 8.0"));
    }
}

/// A leased row as read: id, target, method, url, header names (JSON), header values (JSON, hex), body, record key,
/// attempts, age in microseconds.
type LeasedRow = (i64, String, String, String, String, String, Vec<u8>, Option<Vec<u8>>, i32, i64);

fn leased((id, target, method, url, names, values, body, key, attempts, age_us): LeasedRow) -> Result<Leased, sqlx::Error> {
    let bad = |what: &str| sqlx::Error::Decode(format!("outbox row {id}: its {what} are not what idemflow writes").into());
    let names: Vec<String> = serde_json::from_str(&names).map_err(|_| bad("header names"))?;
    let values: Vec<String> = serde_json::from_str(&values).map_err(|_| bad("header values"))?;
    let values = values
        .iter()
        .map(|v| hex::decode(v).ok().and_then(|b| String::from_utf8(b).ok()).ok_or_else(|| bad("header values")))
        .collect::<Result<Vec<String>, _>>()?;
    let request = OutboxRequest { target, method, url, headers: names.into_iter().zip(values).collect(), body, key };
    Ok(Leased { id, request, attempts, age_seconds: age_us.max(0) as f64 / 1e6 })
}

fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Leases up to `limit` due rows of `pipeline` to `owner` ([`crate::store::Connector::outbox_lease`]), in one
/// transaction: the due rows locked (skipping those another relay is leasing), their lease written, read back.
pub async fn lease(pool: &MySqlPool, pipeline: &str, owner: &str, limit: i64, lease: Duration) -> Result<Vec<Leased>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT o.id FROM idemflow_outbox o
         WHERE o.pipeline = ? AND o.next_attempt_at <= NOW(6) AND (o.leased_until IS NULL OR o.leased_until < NOW(6))
           AND NOT EXISTS (SELECT 1 FROM idemflow_outbox e WHERE e.pipeline = o.pipeline AND e.key_digest = o.key_digest AND e.id < o.id)
         ORDER BY o.id LIMIT ?
         FOR UPDATE SKIP LOCKED",
    )
    .bind(pipeline)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    if ids.is_empty() {
        tx.commit().await?;
        return Ok(Vec::new());
    }
    let list = placeholders(ids.len());
    let update_sql = format!(
        "UPDATE idemflow_outbox SET leased_until = NOW(6) + INTERVAL ? MICROSECOND, lease_owner = ?, attempts = attempts + 1 WHERE id IN ({list})"
    );
    let mut update = sqlx::query(&update_sql)
    .bind(lease.as_micros() as i64)
    .bind(owner);
    for id in &ids {
        update = update.bind(id);
    }
    update.execute(&mut *tx).await?;
    let read_sql = format!(
        "SELECT id, CAST(target AS CHAR), CAST(method AS CHAR), CAST(url AS CHAR), CAST(header_names AS CHAR), CAST(header_values AS CHAR), body, record_key, attempts,
                TIMESTAMPDIFF(MICROSECOND, created_at, NOW(6))
         FROM idemflow_outbox WHERE id IN ({list}) ORDER BY id"
    );
    let mut read = sqlx::query_as::<_, LeasedRow>(&read_sql);
    for id in &ids {
        read = read.bind(id);
    }
    let rows = read.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    rows.into_iter().map(leased).collect()
}

/// Records what became of leased rows, in one transaction ([`crate::store::Connector::outbox_settle`]).
pub async fn settle(pool: &MySqlPool, pipeline: &str, owner: &str, settled: &[Settled]) -> Result<Vec<i64>, sqlx::Error> {
    let mut moved = Vec::new();
    let mut tx = pool.begin().await?;
    let confirmed: Vec<i64> = settled.iter().filter_map(|s| if let Settled::Confirmed(id) = s { Some(*id) } else { None }).collect();
    let done: Vec<i64> = settled.iter().filter_map(|s| match s {
        Settled::Confirmed(id) | Settled::Failed { id, .. } => Some(*id),
        Settled::Retry { .. } => None,
    }).collect();
    if !done.is_empty() {
        // A key's next request waited behind this one: due from now, so back-pressure's `max_age` counts its wait
        // from here, not from when it was written.
        let sql = format!(
            "UPDATE idemflow_outbox n JOIN idemflow_outbox d ON n.pipeline = d.pipeline AND n.key_digest = d.key_digest AND n.id > d.id
             SET n.next_attempt_at = NOW(6)
             WHERE d.pipeline = ? AND d.id IN ({}) AND n.attempts = 0 AND n.next_attempt_at < NOW(6)",
            placeholders(done.len())
        );
        let mut bump = sqlx::query(&sql).bind(pipeline);
        for id in &done {
            bump = bump.bind(id);
        }
        bump.execute(&mut *tx).await?;
    }
    if !confirmed.is_empty() {
        let sql = format!("DELETE FROM idemflow_outbox WHERE pipeline = ? AND id IN ({})", placeholders(confirmed.len()));
        let mut delete = sqlx::query(&sql).bind(pipeline);
        for id in &confirmed {
            delete = delete.bind(id);
        }
        delete.execute(&mut *tx).await?;
    }
    for s in settled {
        match s {
            Settled::Confirmed(_) => {}
            Settled::Retry { id, after, error } => {
                sqlx::query(
                    "UPDATE idemflow_outbox SET next_attempt_at = NOW(6) + INTERVAL ? MICROSECOND, leased_until = NULL, lease_owner = NULL, last_error = ?
                     WHERE pipeline = ? AND id = ? AND lease_owner = ?",
                )
                .bind(after.as_micros() as i64)
                .bind(error)
                .bind(pipeline)
                .bind(id)
                .bind(owner)
                .execute(&mut *tx)
                .await?;
            }
            Settled::Failed { id, error } => {
                // One locked step: the row is locked while this relay holds it, then copied and deleted; a row another
                // relay leased meanwhile is left to it (never both delivered and dead-lettered).
                let held: Option<i64> = sqlx::query_scalar("SELECT id FROM idemflow_outbox WHERE pipeline = ? AND id = ? AND lease_owner = ? FOR UPDATE")
                    .bind(pipeline)
                    .bind(id)
                    .bind(owner)
                    .fetch_optional(&mut *tx)
                    .await?;
                if held.is_none() {
                    continue;
                }
                // The request moves whole; the digest makes each failed row a dead letter of its own.
                sqlx::query(
                    "INSERT INTO idemflow_dead_letters
                         (pipeline, topic, `partition`, `offset`, record_key, header_names, header_values, property_names, property_values,
                          payload, reason, error, payload_digest, request)
                     SELECT pipeline, topic, `partition`, `offset`, record_key, header_names, header_values, '[]', '[]',
                            body, 'delivery_failed', ?, UNHEX(SHA2(CONCAT('outbox:', id), 256)),
                            JSON_OBJECT('target', target, 'method', method, 'url', url, 'key_digest', LOWER(HEX(key_digest)))
                     FROM idemflow_outbox WHERE pipeline = ? AND id = ? AND lease_owner = ?
                     ON DUPLICATE KEY UPDATE redeliveries = redeliveries + 1",
                )
                .bind(error)
                .bind(pipeline)
                .bind(id)
                .bind(owner)
                .execute(&mut *tx)
                .await?;
                sqlx::query("DELETE FROM idemflow_outbox WHERE pipeline = ? AND id = ? AND lease_owner = ?")
                    .bind(pipeline)
                    .bind(id)
                    .bind(owner)
                    .execute(&mut *tx)
                    .await?;
                moved.push(*id);
            }
        }
    }
    tx.commit().await?;
    Ok(moved)
}

/// Rows of `pipeline` waiting (up to `up_to`), the age of the oldest, and the longest a row the relay could send
/// (due, and first of its key) has waited since it was due ([`crate::store::Connector::outbox_depth`]).
pub async fn depth(pool: &MySqlPool, pipeline: &str, up_to: i64) -> Result<OutboxDepth, sqlx::Error> {
    let (rows, oldest_us, due_us): (i64, Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT COUNT(*), TIMESTAMPDIFF(MICROSECOND, MIN(created_at), NOW(6)), TIMESTAMPDIFF(MICROSECOND, MIN(due_since), NOW(6))
         FROM (SELECT o.created_at,
                      CASE WHEN o.next_attempt_at <= NOW(6) AND NOT EXISTS (SELECT 1 FROM idemflow_outbox e
                                WHERE e.pipeline = o.pipeline AND e.key_digest = o.key_digest AND e.id < o.id)
                           THEN GREATEST(o.created_at, o.next_attempt_at) END AS due_since
               FROM idemflow_outbox o WHERE o.pipeline = ? ORDER BY o.id LIMIT ?) s",
    )
    .bind(pipeline)
    .bind(up_to)
    .fetch_one(pool)
    .await?;
    let seconds = |us: Option<i64>| us.unwrap_or(0).max(0) as f64 / 1e6;
    Ok(OutboxDepth { rows, oldest_seconds: seconds(oldest_us), due_seconds: seconds(due_us) })
}

/// Gives up `owner`'s leases ([`crate::store::Connector::outbox_release`]).
pub async fn release(pool: &MySqlPool, pipeline: &str, owner: &str) -> Result<u64, sqlx::Error> {
    let done = sqlx::query("UPDATE idemflow_outbox SET leased_until = NULL, lease_owner = NULL WHERE pipeline = ? AND lease_owner = ?")
        .bind(pipeline)
        .bind(owner)
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

/// Puts dead letter `id`'s request back in the outbox, re-homed by `rehome` ([`crate::store::Connector::outbox_requeue`]).
pub async fn requeue(pool: &MySqlPool, id: i64, rehome: &str) -> Result<Option<i64>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let found: Option<i64> = sqlx::query_scalar(
        "SELECT id FROM idemflow_dead_letters WHERE id = ? AND reason = 'delivery_failed' AND request IS NOT NULL FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    if found.is_none() {
        tx.commit().await?;
        return Ok(None);
    }
    let done = sqlx::query(
        "INSERT INTO idemflow_outbox (pipeline, key_digest, target, method, url, header_names, header_values, body, record_key, topic, `partition`, `offset`)
         SELECT pipeline, UNHEX(JSON_UNQUOTE(JSON_EXTRACT(request, '$.key_digest'))), JSON_UNQUOTE(JSON_EXTRACT(request, '$.target')),
                JSON_UNQUOTE(JSON_EXTRACT(request, '$.method')),
                CASE WHEN home IS NULL THEN JSON_UNQUOTE(JSON_EXTRACT(request, '$.url'))
                     WHEN home LIKE '=%' THEN SUBSTRING(home, 2)
                     ELSE REGEXP_REPLACE(JSON_UNQUOTE(JSON_EXTRACT(request, '$.url')), '^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*', home) END,
                header_names, header_values, COALESCE(payload, ''), record_key, topic, `partition`, `offset`
         FROM (SELECT d.*, JSON_UNQUOTE(JSON_EXTRACT(?, CONCAT('$.\"', JSON_UNQUOTE(JSON_EXTRACT(d.request, '$.target')), '\"'))) AS home
               FROM idemflow_dead_letters d WHERE d.id = ?) r",
    )
    .bind(rehome)
    .bind(id)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM idemflow_dead_letters WHERE id = ?").bind(id).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(Some(done.last_insert_id() as i64))
}

/// Every pipeline's and target's rows waiting (due, in back-off, leased) and `delivery_failed` dead letters
/// ([`crate::store::Connector::unsent`]).
pub async fn unsent(pool: &MySqlPool) -> Result<Vec<crate::store::rows::Unsent>, sqlx::Error> {
    let rows: Vec<crate::store::rows::UnsentRow> = sqlx::query_as(
        "SELECT CONVERT(pipeline USING utf8mb4), CONVERT(target USING utf8mb4), CAST(SUM(waiting) AS SIGNED), COALESCE(MAX(oldest_us), 0) / 1e6,
                CAST(SUM(failed) AS SIGNED), CAST(SUM(due) AS SIGNED), CAST(SUM(backing) AS SIGNED), CAST(SUM(leased) AS SIGNED),
                CAST(MIN(next_at) AS CHAR), CONVERT(MAX(last_error) USING utf8mb4) FROM (
             SELECT o.pipeline, o.target, COUNT(*) AS waiting, TIMESTAMPDIFF(MICROSECOND, MIN(o.created_at), NOW(6)) AS oldest_us, 0 AS failed,
                    SUM(o.next_attempt_at <= NOW(6) AND (o.leased_until IS NULL OR o.leased_until < NOW(6))) AS due,
                    SUM(o.next_attempt_at > NOW(6) AND (o.leased_until IS NULL OR o.leased_until < NOW(6))) AS backing,
                    SUM(COALESCE(o.leased_until >= NOW(6), 0)) AS leased,
                    MIN(CASE WHEN o.next_attempt_at > NOW(6) THEN o.next_attempt_at END) AS next_at,
                    (SELECT l.last_error FROM idemflow_outbox l WHERE l.pipeline = o.pipeline AND l.target = o.target
                       AND l.last_error IS NOT NULL ORDER BY l.id DESC LIMIT 1) AS last_error
             FROM idemflow_outbox o GROUP BY o.pipeline, o.target
             UNION ALL
             SELECT pipeline, JSON_UNQUOTE(JSON_EXTRACT(request, '$.target')), 0, 0, COUNT(*), 0, 0, 0, NULL, NULL
             FROM idemflow_dead_letters WHERE reason = 'delivery_failed' AND request IS NOT NULL GROUP BY 1, 2
         ) u GROUP BY pipeline, target ORDER BY pipeline, target",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(crate::store::rows::Unsent::from).collect())
}

/// Moves the next attempt of `pipeline`'s rows in back-off (of `target`, of the key whose digest is `digest`, where
/// given) to now; rows a relay holds are left. Returns how many ([`crate::store::Connector::outbox_retry_now`]).
pub async fn retry_now(pool: &MySqlPool, pipeline: &str, target: Option<&str>, digest: Option<&[u8]>) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE idemflow_outbox SET next_attempt_at = NOW(6)
         WHERE pipeline = ? AND (? IS NULL OR target = ?) AND (? IS NULL OR key_digest = ?)
           AND next_attempt_at > NOW(6) AND (leased_until IS NULL OR leased_until < NOW(6))",
    )
    .bind(pipeline)
    .bind(target)
    .bind(target)
    .bind(digest)
    .bind(digest)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// A business key's requests not yet confirmed ([`crate::store::Connector::key_requests`]).
pub async fn key_requests(pool: &MySqlPool, pipeline: &str, digest: &[u8]) -> Result<Vec<crate::store::rows::KeyRequest>, sqlx::Error> {
    let rows: Vec<(String, Option<i64>, i64, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT CONVERT(target USING utf8mb4), CAST(NULL AS SIGNED), CAST(attempts AS SIGNED), CAST(next_attempt_at AS CHAR),
                CAST(COALESCE(leased_until > NOW(6), 0) AS SIGNED), CONVERT(last_error USING utf8mb4)
         FROM idemflow_outbox WHERE pipeline = ? AND key_digest = ?
         UNION ALL
         SELECT CONVERT(JSON_UNQUOTE(JSON_EXTRACT(request, '$.target')) USING utf8mb4), id, 0, '', 0, CONVERT(error USING utf8mb4)
         FROM idemflow_dead_letters WHERE pipeline = ? AND reason = 'delivery_failed'
              AND JSON_UNQUOTE(JSON_EXTRACT(request, '$.key_digest')) = LOWER(HEX(?))",
    )
    .bind(pipeline)
    .bind(digest)
    .bind(pipeline)
    .bind(digest)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(target, dead_letter, attempts, next_attempt, leased, error)| crate::store::rows::KeyRequest {
            target,
            dead_letter,
            attempts,
            next_attempt,
            leased: leased != 0,
            error,
        })
        .collect())
}
