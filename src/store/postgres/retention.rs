//! Postgres retention: each purge batch is one short transaction that first takes a transaction-scoped advisory
//! lock for the pipeline (`pg_try_advisory_xact_lock`, PostgreSQL docs "Advisory Locks"); when another replica holds
//! it, this one skips the rest of its pass. A batch deletes at most `purge_batch` rows, oldest first, found through
//! the `(pipeline, applied_at)` index and locked with `FOR UPDATE SKIP LOCKED`.

use crate::retention::PurgeOutcome;
use sqlx::PgPool;
use std::time::Duration;

/// The first key of the advisory lock (the second is the pipeline name's hash): "idemflow purge".
const LOCK_CLASS: i32 = 0x1de_f10;

const PURGE: &str = r#"
WITH lock AS (SELECT pg_try_advisory_xact_lock($1, hashtext($2)) AS held),
victims AS (
    SELECT d.ctid FROM idemflow.dedup d
    WHERE (SELECT held FROM lock) AND d.pipeline = $2 AND d.applied_at < now() - make_interval(secs => $3)
    ORDER BY d.applied_at
    LIMIT $4
    FOR UPDATE OF d SKIP LOCKED
),
deleted AS (DELETE FROM idemflow.dedup WHERE ctid IN (SELECT ctid FROM victims) RETURNING 1)
SELECT (SELECT held FROM lock), (SELECT count(*) FROM deleted)"#;

/// Deletes the dedup rows of `pipeline` older than `retention`, `batch` rows per transaction, until none is left.
///
/// Errors: the database's; a pass interrupted by one leaves the store consistent (each batch is atomic).
///
/// `on_batch` is called after each committed purge batch with the rows it deleted (the worker counts them in
/// `idemflow_dedup_rows_purged_total` as they go, not once per pass).
pub async fn purge(
    pool: &PgPool,
    pipeline: &str,
    retention: Duration,
    batch: u32,
    mut on_batch: impl FnMut(u64),
) -> Result<PurgeOutcome, sqlx::Error> {
    let mut outcome = PurgeOutcome::default();
    loop {
        let mut tx = pool.begin().await?;
        let (held, deleted): (Option<bool>, i64) = sqlx::query_as(PURGE)
            .bind(LOCK_CLASS)
            .bind(pipeline)
            .bind(retention.as_secs_f64())
            .bind(i64::from(batch))
            .persistent(super::persistent())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        if held != Some(true) {
            outcome.skipped_locked = true;
            return Ok(outcome);
        }
        outcome.batches += 1;
        outcome.purged += deleted as u64;
        on_batch(deleted as u64);
        if (deleted as u64) < u64::from(batch) {
            return Ok(outcome);
        }
    }
}

