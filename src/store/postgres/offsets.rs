//! The Postgres positions: `idemflow.offsets` (stored positions, fenced by an owner epoch) and `idemflow.processed`
//! (the processed marks). What they mean is in [`crate::offsets`].

use crate::offsets::{Claimed, Logs, Mark, NextOffsets, Positions, Processed, Renewal};
use sqlx::{PgConnection, PgPool};

/// Takes ownership of `partitions` for `pipeline` in one statement: increments each one's epoch (creating the
/// row at epoch 1) and returns the stored positions. `owner` is recorded for operators (host and process).
///
/// Errors: any database error (the caller retries).
pub async fn claim(pool: &PgPool, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> sqlx::Result<Vec<Claimed>> {
    let (topics, parts): (Vec<&str>, Vec<i32>) = partitions.iter().map(|(t, p)| (t.as_str(), *p)).unzip();
    let mut tx = pool.begin().await?;
    // A previous owner frozen inside a batch would hold the row lock for as long as it is frozen: fail after a
    // while (the caller retries) rather than wait without end.
    sqlx::query("SET LOCAL lock_timeout = '5s'").persistent(super::persistent()).execute(&mut *tx).await?;
    // (topic, partition, next offset, epoch, when the position was stored in ms since the Unix epoch, the identity
    // of the log the processed mark was raised on)
    type Row = (String, i32, Option<i64>, i64, Option<i64>, Option<String>);
    let rows: Vec<Row> = sqlx::query_as(
        r#"
INSERT INTO idemflow.offsets AS o (pipeline, topic, partition, owner_epoch, owner, claimed_at)
SELECT $1, u.topic, u.partition, 1, $2, now() FROM unnest($3::text[], $4::int4[]) AS u(topic, partition)
ON CONFLICT (pipeline, topic, partition)
DO UPDATE SET owner_epoch = o.owner_epoch + 1, owner = excluded.owner, claimed_at = excluded.claimed_at
RETURNING topic, partition, next_offset, owner_epoch, (extract(epoch FROM updated_at) * 1000)::int8,
    (SELECT p.log_id FROM idemflow.processed p WHERE p.pipeline = o.pipeline AND p.topic = o.topic AND p.partition = o.partition)"#,
    )
    .bind(pipeline)
    .bind(owner)
    .bind(&topics)
    .bind(&parts)
    .persistent(super::persistent())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows
        .into_iter()
        .map(|(topic, partition, next_offset, epoch, stored_at_ms, log)| Claimed { topic, partition, next_offset, epoch, stored_at_ms, log })
        .collect())
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
    .persistent(super::persistent())
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
        .persistent(super::persistent())
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
    .persistent(super::persistent())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}

/// Locks the processed marks of the batch's partitions for the transaction and reads them (creating, for a
/// partition without one, a mark at the batch's first offset there, which no record of the batch is below). `ON
/// CONFLICT DO UPDATE` waits for a transaction still holding the row and returns its newest version.
const PROCESSED: &str = r#"
INSERT INTO idemflow.processed AS p (pipeline, topic, partition, next_offset, resume_from)
SELECT $1, topic, partition, first_offset, first_offset
FROM unnest($2::text[], $3::int4[], $4::int8[]) AS u(topic, partition, first_offset) ORDER BY topic, partition
ON CONFLICT (pipeline, topic, partition) DO UPDATE SET next_offset = p.next_offset
RETURNING topic, partition, next_offset, coalesce(resume_from, next_offset), (extract(epoch FROM updated_at) * 1000)::int8, log_id"#;

/// Raises the processed marks and floors of the batch's partitions to `next` (never lowers them), last before
/// `COMMIT`: a side effect that ended the transaction itself (a procedure's `COMMIT`) never leaves records it did not
/// apply below a committed floor. `updated_at` moves only when the mark rises (it dates the records processed). The
/// log's identity is kept where the source gives none.
const RAISE_PROCESSED: &str = r#"
INSERT INTO idemflow.processed AS p (pipeline, topic, partition, next_offset, resume_from, log_id)
SELECT $1, topic, partition, next_offset, next_offset, log_id
FROM unnest($2::text[], $3::int4[], $4::int8[], $5::text[]) AS u(topic, partition, next_offset, log_id) ORDER BY topic, partition
ON CONFLICT (pipeline, topic, partition) DO UPDATE
SET next_offset = greatest(p.next_offset, EXCLUDED.next_offset),
    resume_from = greatest(coalesce(p.resume_from, p.next_offset), EXCLUDED.next_offset),
    updated_at = CASE WHEN EXCLUDED.next_offset > p.next_offset THEN greatest(p.updated_at, now()) ELSE p.updated_at END,
    log_id = coalesce(EXCLUDED.log_id, p.log_id)"#;

fn columns(offsets: &NextOffsets) -> (Vec<&str>, Vec<i32>, Vec<i64>) {
    let mut topics = Vec::with_capacity(offsets.0.len());
    let mut partitions = Vec::with_capacity(offsets.0.len());
    let mut values = Vec::with_capacity(offsets.0.len());
    for ((t, p), o) in &offsets.0 {
        topics.push(&**t);
        partitions.push(*p);
        values.push(*o);
    }
    (topics, partitions, values)
}

/// Locks and reads the processed marks of the batch's partitions, `first` holding each one's first offset in the
/// batch, first in the batch transaction ([`PROCESSED`]); [`raise_processed`] raises them last.
///
/// Errors: the database's.
pub async fn processed(conn: &mut PgConnection, pipeline: &str, first: &NextOffsets) -> sqlx::Result<Processed> {
    if first.0.is_empty() {
        return Ok(Processed::default());
    }
    let (topics, partitions, offsets) = columns(first);
    let rows: Vec<(String, i32, i64, i64, i64, Option<String>)> = sqlx::query_as(PROCESSED)
        .bind(pipeline)
        .bind(&topics)
        .bind(&partitions)
        .bind(&offsets)
        .persistent(super::persistent())
        .fetch_all(&mut *conn)
        .await?;
    let mut marks = std::collections::HashMap::new();
    for (topic, partition, next_offset, floor, raised_at_ms, log) in rows {
        if let Some(((t, _), _)) = first.0.iter().find(|((t, p), _)| **t == *topic && *p == partition) {
            let mark = Mark { next: next_offset, floor: Some(floor), raised_at_ms: Some(raised_at_ms), log: log.map(Into::into) };
            marks.insert((t.clone(), partition), mark);
        }
    }
    Ok(Processed(marks))
}

/// Raises the processed marks of the batch's partitions to `next`, last before `COMMIT` ([`RAISE_PROCESSED`]), with
/// the identities of their logs from `logs`.
///
/// Errors: the database's.
pub async fn raise_processed(conn: &mut PgConnection, pipeline: &str, next: &NextOffsets, logs: &Logs) -> sqlx::Result<()> {
    if next.0.is_empty() {
        return Ok(());
    }
    let (topics, partitions, offsets) = columns(next);
    let ids: Vec<Option<&str>> = next.0.keys().map(|tp| logs.0.get(tp).and_then(|l| l.id.as_deref())).collect();
    sqlx::query(RAISE_PROCESSED)
        .bind(pipeline)
        .bind(&topics)
        .bind(&partitions)
        .bind(&offsets)
        .bind(&ids)
        .persistent(super::persistent())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Sets the processed marks and floors of `renewed` afresh, with their logs' identities (the marks were of another
/// log: see [`crate::offsets::Processed::renewals`]), inside the batch transaction.
///
/// Errors: the database's.
pub async fn renew_processed(conn: &mut PgConnection, pipeline: &str, renewed: &[Renewal]) -> sqlx::Result<()> {
    for r in renewed {
        sqlx::query(
            "UPDATE idemflow.processed SET next_offset = $4, resume_from = $4, updated_at = now(), log_id = $5 \
             WHERE pipeline = $1 AND topic = $2 AND partition = $3",
        )
        .bind(pipeline)
        .bind(&*r.topic)
        .bind(r.partition)
        .bind(r.next)
        .bind(r.log.as_deref())
        .persistent(super::persistent())
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Lowers the floors of `partitions` (`(topic, partition, offset)`) to where `idemflow rewind` moves the consumer
/// group, so that the replay from there is consumed and applied where dedup rows no longer cover it. Never raises a
/// floor; partitions without a mark are left alone. Returns how many marks changed.
///
/// Errors: the database's.
pub async fn lower_floors(pool: &PgPool, pipeline: &str, partitions: &[(String, i32, i64)]) -> sqlx::Result<u64> {
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
pub async fn lower_floor(conn: &mut PgConnection, pipeline: &str, topic: &str, partition: i32, to: i64) -> sqlx::Result<u64> {
    let done = sqlx::query(
        "UPDATE idemflow.processed SET resume_from = $4 \
         WHERE pipeline = $1 AND topic = $2 AND partition = $3 AND coalesce(resume_from, next_offset) > $4",
    )
    .bind(pipeline)
    .bind(topic)
    .bind(partition)
    .bind(to)
    .persistent(super::persistent())
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected())
}

/// Records `attempt` as the lane `owner`'s latest batch attempt of `pipeline`, first in the batch transaction, and
/// returns the attempt recorded before it: the latest one that committed. A previous attempt whose transaction is
/// still open on the server (its `COMMIT` unanswered) is waited for, and its row, committed or not, is the one read
/// (`ON CONFLICT DO UPDATE` locks and updates the newest version of the row, visible to this statement's snapshot
/// or not: PostgreSQL docs, "INSERT", "ON CONFLICT Clause").
///
/// Errors: the database's.
pub async fn mark_attempt(conn: &mut PgConnection, pipeline: &str, owner: &str, attempt: i64) -> sqlx::Result<(Option<i64>, crate::store::contract::Session)> {
    let (previous, pid, started): (Option<i64>, i32, i64) = sqlx::query_as(
        "INSERT INTO idemflow.attempts AS a (pipeline, owner, attempt) VALUES ($1, $2, $3) \
         ON CONFLICT (pipeline, owner) DO UPDATE SET previous = a.attempt, attempt = EXCLUDED.attempt, updated_at = now() \
         RETURNING previous, pg_backend_pid(), (extract(epoch FROM now()) * 1000000)::int8",
    )
    .bind(pipeline)
    .bind(owner)
    .bind(attempt)
    .persistent(super::persistent())
    .fetch_one(&mut *conn)
    .await?;
    Ok((previous, crate::store::contract::Session::Postgres(pid, started)))
}

/// Terminates backend `pid` if it is still in the transaction that started at `started` (microseconds since the
/// Unix epoch, as [`mark_attempt`] read `now()`: a pid of a session that ended meanwhile may be another's, and a
/// pooled session that went on to another transaction has another start) and is not waiting for a synchronous
/// standby (`wait_event = 'SyncRep'`: terminated there, its commit would stand without the standby). Returns whether
/// it was terminated. On a connection of its own, not the pool's (the pool may be what ran dry). Needs no privilege
/// for the role's own backends.
///
/// Errors: the database's.
pub async fn end_session(pool: &PgPool, pid: i32, started: i64) -> sqlx::Result<bool> {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect_with(&pool.connect_options()).await?;
    // In a transaction, as every access is (a transaction-pooling proxy).
    let mut tx = conn.begin().await?;
    let ended: Option<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE pid = $1 AND (extract(epoch FROM xact_start) * 1000000)::int8 = $2 \
           AND wait_event IS DISTINCT FROM 'SyncRep'",
    )
    .bind(pid)
    .bind(started)
    .persistent(false)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    let _ = conn.close().await;
    Ok(ended.unwrap_or(false))
}

/// Deletes `pipeline`'s attempt rows of lanes that wrote none for `idle` (gone: a worker that stopped, or a pid of
/// a process long ended). Returns how many.
///
/// Errors: the database's.
pub async fn forget_attempts(pool: &PgPool, pipeline: &str, idle: std::time::Duration) -> sqlx::Result<u64> {
    // In a transaction, as every access is (a transaction-pooling proxy).
    let mut tx = pool.begin().await?;
    let done = sqlx::query("DELETE FROM idemflow.attempts WHERE pipeline = $1 AND updated_at < now() - make_interval(secs => $2)")
        .bind(pipeline)
        .bind(idle.as_secs_f64())
        .persistent(super::persistent())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}
