//! The MySQL and MariaDB positions: `idemflow_offsets` (stored positions, fenced by an owner epoch) and
//! `idemflow_processed` (the processed marks). What they mean is in [`crate::offsets`]. Rows are read with
//! `SELECT ... FOR UPDATE` before they are written, so a read sees the latest committed row and holds its lock to
//! the end of the batch transaction (InnoDB locking reads, MySQL Reference Manual "Locking Reads").

use super::{marks, rows};
use crate::offsets::{Claimed, Logs, Mark, NextOffsets, Positions, Processed, Renewal};
use sqlx::{MySqlConnection, MySqlPool};
use std::collections::HashMap;

/// `(topic, partition) IN ((?, ?), ...)` for `n` partitions.
fn partitions_in(n: usize) -> String {
    format!("(topic, `partition`) IN ({})", rows("(?, ?)", n))
}

/// Takes ownership of `partitions` for `pipeline`: increments each one's epoch (creating the row at epoch 1) and
/// returns the stored positions. A previous owner's batch still in flight holds the row locks: the claim waits for
/// it at most 5 s (`innodb_lock_wait_timeout` for this transaction), then fails and the caller retries.
///
/// Errors: any database error.
pub async fn claim(pool: &MySqlPool, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> sqlx::Result<Vec<Claimed>> {
    if partitions.is_empty() {
        return Ok(Vec::new());
    }
    let mut conn = pool.acquire().await?;
    // The shorter lock wait is this session's: the connection is closed afterwards (also when the claim is
    // dropped half-way, at a rebalance), never returned to the pool with it.
    conn.close_on_drop();
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 5").execute(&mut *conn).await?;
    claim_on(&mut conn, pipeline, owner, partitions).await
}

async fn claim_on(conn: &mut MySqlConnection, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> sqlx::Result<Vec<Claimed>> {
    use sqlx::Connection as _;
    let mut tx = conn.begin().await?;
    let sql = format!(
        "INSERT INTO idemflow_offsets (pipeline, topic, `partition`, owner_epoch, owner, claimed_at) VALUES {} \
         ON DUPLICATE KEY UPDATE owner_epoch = owner_epoch + 1, owner = VALUES(owner), claimed_at = VALUES(claimed_at)",
        rows("(?, ?, ?, 1, ?, CURRENT_TIMESTAMP(6))", partitions.len())
    );
    let mut q = sqlx::query(&sql);
    for (t, p) in partitions {
        q = q.bind(pipeline).bind(t).bind(p).bind(owner);
    }
    q.execute(&mut *tx).await?;
    let sql = format!(
        "SELECT CAST(topic AS CHAR), `partition`, next_offset, owner_epoch, CAST(ROUND(UNIX_TIMESTAMP(updated_at) * 1000) AS SIGNED), \
         (SELECT CAST(p.log_id AS CHAR) FROM idemflow_processed p WHERE p.pipeline = o.pipeline AND p.topic = o.topic \
          AND p.`partition` = o.`partition`) \
         FROM idemflow_offsets o WHERE pipeline = ? AND {}",
        partitions_in(partitions.len())
    );
    let mut q = sqlx::query_as::<_, (String, i32, Option<i64>, i64, Option<i64>, Option<String>)>(&sql).bind(pipeline);
    for (t, p) in partitions {
        q = q.bind(t).bind(p);
    }
    let rows = q.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(rows
        .into_iter()
        .map(|(topic, partition, next_offset, epoch, stored_at_ms, log)| Claimed { topic, partition, next_offset, epoch, stored_at_ms, log })
        .collect())
}

/// Stores `positions` inside the batch's transaction for the partitions whose epoch is still the one presented.
/// Returns the partitions that were fenced; the caller must then roll the whole transaction back.
///
/// Errors: any database error.
pub async fn advance(conn: &mut MySqlConnection, pipeline: &str, positions: &Positions) -> sqlx::Result<Vec<(String, i32)>> {
    if positions.0.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT CAST(topic AS CHAR), `partition`, owner_epoch FROM idemflow_offsets WHERE pipeline = ? AND {} FOR UPDATE",
        partitions_in(positions.0.len())
    );
    let mut q = sqlx::query_as::<_, (String, i32, i64)>(&sql).bind(pipeline);
    for (t, p, _, _) in &positions.0 {
        q = q.bind(&**t).bind(p);
    }
    let epochs: HashMap<(String, i32), i64> = q.fetch_all(&mut *conn).await?.into_iter().map(|(t, p, e)| ((t, p), e)).collect();
    let mut fenced = Vec::new();
    for (t, p, next, epoch) in &positions.0 {
        if epochs.get(&(t.to_string(), *p)) != Some(epoch) {
            fenced.push((t.to_string(), *p));
            continue;
        }
        sqlx::query(
            "UPDATE idemflow_offsets SET next_offset = ?, updated_at = CURRENT_TIMESTAMP(6) \
             WHERE pipeline = ? AND topic = ? AND `partition` = ? AND owner_epoch = ?",
        )
        .bind(next)
        .bind(pipeline)
        .bind(&**t)
        .bind(p)
        .bind(epoch)
        .execute(&mut *conn)
        .await?;
    }
    Ok(fenced)
}

/// The stored positions of `pipeline`: `(topic, partition, next offset)`.
///
/// Errors: any database error.
pub async fn stored(pool: &MySqlPool, pipeline: &str) -> sqlx::Result<Vec<(String, i32, Option<i64>)>> {
    sqlx::query_as("SELECT CAST(topic AS CHAR), `partition`, next_offset FROM idemflow_offsets WHERE pipeline = ?").bind(pipeline).fetch_all(pool).await
}

/// Sets the stored positions of `pipeline` (for `idemflow rewind`) and increments their epochs. Returns how many
/// partitions were written.
///
/// Errors: any database error.
pub async fn reset(pool: &MySqlPool, pipeline: &str, positions: &[(String, i32, i64)]) -> sqlx::Result<u64> {
    if positions.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "INSERT INTO idemflow_offsets (pipeline, topic, `partition`, next_offset, owner_epoch, owner, updated_at) VALUES {} \
         ON DUPLICATE KEY UPDATE next_offset = VALUES(next_offset), owner_epoch = owner_epoch + 1, owner = VALUES(owner), \
         updated_at = VALUES(updated_at)",
        rows("(?, ?, ?, ?, 1, 'idemflow rewind', CURRENT_TIMESTAMP(6))", positions.len())
    );
    let mut q = sqlx::query(&sql);
    for (t, p, o) in positions {
        q = q.bind(pipeline).bind(t).bind(p).bind(o);
    }
    let mut tx = pool.begin().await?;
    q.execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(positions.len() as u64)
}

/// Locks and reads the processed marks of the batch's partitions, `first` holding each one's first offset in the
/// batch, first in the batch transaction: an upsert that creates a missing mark at the batch's first offset (no
/// record of the batch is below it) and changes nothing else but takes the row's lock, then a read of the rows.
/// [`raise_processed`] raises them last.
///
/// Errors: the database's.
pub async fn processed(conn: &mut MySqlConnection, pipeline: &str, first: &NextOffsets) -> sqlx::Result<Processed> {
    if first.0.is_empty() {
        return Ok(Processed::default());
    }
    let sql = format!(
        "INSERT INTO idemflow_processed (pipeline, topic, `partition`, next_offset, resume_from) VALUES {} \
         ON DUPLICATE KEY UPDATE next_offset = next_offset",
        rows(&format!("({})", marks(5)), first.0.len())
    );
    let mut q = sqlx::query(&sql);
    for ((t, p), o) in &first.0 {
        q = q.bind(pipeline).bind(&**t).bind(p).bind(o).bind(o);
    }
    q.execute(&mut *conn).await?;
    let sql = format!(
        "SELECT CAST(topic AS CHAR), `partition`, next_offset, COALESCE(resume_from, next_offset), \
         CAST(ROUND(UNIX_TIMESTAMP(updated_at) * 1000) AS SIGNED), CAST(log_id AS CHAR) FROM idemflow_processed \
         WHERE pipeline = ? AND {}",
        partitions_in(first.0.len())
    );
    let mut q = sqlx::query_as::<_, (String, i32, i64, i64, i64, Option<String>)>(&sql).bind(pipeline);
    for (t, p) in first.0.keys() {
        q = q.bind(&**t).bind(p);
    }
    let read = q.fetch_all(&mut *conn).await?;
    let mut marks = HashMap::new();
    for (topic, partition, next_offset, floor, raised_at_ms, log) in read {
        if let Some(((t, _), _)) = first.0.iter().find(|((t, p), _)| **t == *topic && *p == partition) {
            let mark = Mark { next: next_offset, floor: Some(floor), raised_at_ms: Some(raised_at_ms), log: log.map(Into::into) };
            marks.insert((t.clone(), partition), mark);
        }
    }
    Ok(Processed(marks))
}

/// Raises the processed marks and floors of the batch's partitions to `next` (never lowers them), last before
/// `COMMIT`; `updated_at` moves only when the mark rises. (Assignments run left to right, each seeing the columns as
/// the ones before it left them: the floor and the time are computed from the mark before it is raised.) The log's
/// identity from `logs` is kept where the source gives none.
///
/// Errors: the database's.
pub async fn raise_processed(conn: &mut MySqlConnection, pipeline: &str, next: &NextOffsets, logs: &Logs) -> sqlx::Result<()> {
    if next.0.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "INSERT INTO idemflow_processed (pipeline, topic, `partition`, next_offset, resume_from, log_id) VALUES {} \
         ON DUPLICATE KEY UPDATE resume_from = GREATEST(COALESCE(resume_from, next_offset), VALUES(next_offset)), \
         updated_at = IF(VALUES(next_offset) > next_offset, GREATEST(updated_at, CURRENT_TIMESTAMP(6)), updated_at), \
         next_offset = GREATEST(next_offset, VALUES(next_offset)), log_id = COALESCE(VALUES(log_id), log_id)",
        rows(&format!("({})", marks(6)), next.0.len())
    );
    let mut q = sqlx::query(&sql);
    for ((t, p), o) in &next.0 {
        let id = logs.0.get(&(t.clone(), *p)).and_then(|l| l.id.as_deref());
        q = q.bind(pipeline).bind(&**t).bind(p).bind(o).bind(o).bind(id);
    }
    q.execute(&mut *conn).await?;
    Ok(())
}

/// Sets the processed marks and floors of `renewed` afresh, with their logs' identities (the marks were of another
/// log: see [`crate::offsets::Processed::renewals`]), inside the batch transaction.
///
/// Errors: the database's.
pub async fn renew_processed(conn: &mut MySqlConnection, pipeline: &str, renewed: &[Renewal]) -> sqlx::Result<()> {
    for r in renewed {
        sqlx::query(
            "UPDATE idemflow_processed SET next_offset = ?, resume_from = ?, updated_at = CURRENT_TIMESTAMP(6), log_id = ? \
             WHERE pipeline = ? AND topic = ? AND `partition` = ?",
        )
        .bind(r.next)
        .bind(r.next)
        .bind(r.log.as_deref())
        .bind(pipeline)
        .bind(&*r.topic)
        .bind(r.partition)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Lowers the floors of `partitions` (`(topic, partition, offset)`) to where `idemflow rewind` moves the consumer
/// group (never raises one; partitions without a mark are left alone). Returns how many marks changed.
///
/// Errors: the database's.
pub async fn lower_floors(pool: &MySqlPool, pipeline: &str, partitions: &[(String, i32, i64)]) -> sqlx::Result<u64> {
    let mut tx = pool.begin().await?;
    let mut changed = 0;
    for (topic, partition, to) in partitions {
        changed += lower_floor(&mut tx, pipeline, topic, *partition, *to).await?;
    }
    tx.commit().await?;
    Ok(changed)
}

/// Lowers one partition's floor to `to` (never raises it; nothing without a mark). Returns the rows changed (0 or 1).
///
/// Errors: the database's.
pub async fn lower_floor(conn: &mut MySqlConnection, pipeline: &str, topic: &str, partition: i32, to: i64) -> sqlx::Result<u64> {
    let done = sqlx::query(
        "UPDATE idemflow_processed SET resume_from = ? \
         WHERE pipeline = ? AND topic = ? AND `partition` = ? AND COALESCE(resume_from, next_offset) > ?",
    )
    .bind(to)
    .bind(pipeline)
    .bind(topic)
    .bind(partition)
    .bind(to)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected())
}

/// Records `attempt` as the lane `owner`'s latest batch attempt of `pipeline`, first in the batch transaction, and
/// returns the attempt recorded before it: the latest one that committed. An upsert, then a read of the row this
/// transaction now holds locked: InnoDB waits for a previous attempt's transaction still open and updates the row
/// as that transaction left it ("Locking Reads": writes use the latest committed version).
///
/// Errors: the database's.
pub async fn mark_attempt(conn: &mut MySqlConnection, pipeline: &str, owner: &str, attempt: i64) -> sqlx::Result<(Option<i64>, crate::store::contract::Session)> {
    sqlx::query(
        "INSERT INTO idemflow_attempts (pipeline, owner, attempt) VALUES (?, ?, ?) \
         ON DUPLICATE KEY UPDATE previous = attempt, attempt = VALUES(attempt), updated_at = CURRENT_TIMESTAMP(6)",
    )
    .bind(pipeline)
    .bind(owner)
    .bind(attempt)
    .execute(&mut *conn)
    .await?;
    let row: Option<(Option<i64>, u64)> =
        sqlx::query_as("SELECT previous, CONNECTION_ID() FROM idemflow_attempts WHERE pipeline = ? AND owner = ? AND attempt = ?")
            .bind(pipeline)
            .bind(owner)
            .bind(attempt)
            .fetch_optional(&mut *conn)
            .await?;
    let (previous, id) = match row {
        Some((previous, id)) => (previous, id),
        None => (None, sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await?),
    };
    Ok((previous, crate::store::contract::Session::MySql(id)))
}

/// Deletes `pipeline`'s attempt rows of lanes that wrote none for `idle`. Returns how many.
///
/// Errors: the database's.
pub async fn forget_attempts(pool: &MySqlPool, pipeline: &str, idle: std::time::Duration) -> sqlx::Result<u64> {
    let done = sqlx::query("DELETE FROM idemflow_attempts WHERE pipeline = ? AND updated_at < NOW(6) - INTERVAL ? SECOND")
        .bind(pipeline)
        .bind(idle.as_secs())
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}
