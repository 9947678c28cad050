//! PostgreSQL retention: the sweep ([`crate::retention`]) by ranges of the dedup table's heap.
//!
//! A slice is one transaction: it locks the pipeline's row of `idemflow.retention_sweeps` without waiting
//! (`FOR UPDATE SKIP LOCKED`; a replica that finds it locked skips its pass), reads a range of heap blocks
//! `[next_block, next_block + n)` with a TID range scan (PostgreSQL 14 and later: "TID Range Scan", no index needed),
//! deletes the rows in it of this pipeline older than the retention, those not locked by a batch in flight
//! (`SKIP LOCKED`: a batch counting a duplicate on a row is never waited for, the row is left for the next pass), and
//! moves the cursor. `n` is about `rows` rows' worth of blocks, from the table's own statistics (`reltuples` /
//! `relpages`). The pass ends at the block the relation ends at when the slice runs (`pg_relation_size`); rows
//! inserted meanwhile are new, not expired.
//!
//! A heap range holds every pipeline's rows: pipelines sharing the table each sweep all of it, each its own cursor.

use crate::retention::Slice;
use sqlx::PgPool;
use std::time::Duration;

/// Rows per heap block assumed before the table has statistics (a dedup row with a short key is about 160 bytes of
/// heap: about 50 to a block of 8 KiB).
const ROWS_PER_BLOCK_UNKNOWN: f64 = 50.0;

const SLICE: &str = r#"
WITH slice AS MATERIALIZED (
    SELECT ctid, pipeline = $1 AND applied_at < now() - make_interval(secs => $4) AS expired
    FROM idemflow.dedup
    WHERE ctid >= $2::text::tid AND ctid < $3::text::tid
),
victims AS (
    SELECT d.ctid FROM idemflow.dedup d
    WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM slice WHERE expired))
      AND d.pipeline = $1 AND d.applied_at < now() - make_interval(secs => $4)
    FOR UPDATE OF d SKIP LOCKED
),
deleted AS (DELETE FROM idemflow.dedup WHERE ctid = ANY (ARRAY(SELECT ctid FROM victims)) RETURNING 1)
SELECT (SELECT count(*) FROM slice), (SELECT count(*) FROM deleted)"#;

/// The table's size in blocks now, and its statistics' rows and blocks (as of the last `VACUUM` or `ANALYZE`).
/// And the server's version number (`server_version_num`): TID range scans are PostgreSQL 14's.
const SIZE: &str = "SELECT pg_relation_size(c.oid) / current_setting('block_size')::int8, c.reltuples::float8, c.relpages::int8, \
                    current_setting('server_version_num')::int4 FROM pg_class c WHERE c.oid = 'idemflow.dedup'::regclass";

/// The first `server_version_num` with TID range scans (PostgreSQL 14).
const TID_RANGE_SCANS: i32 = 140_000;

/// Runs one slice of `pipeline`'s sweep, examining about `rows` rows (see the module's documentation); `restart`
/// puts the cursor back at the first block first.
///
/// # Errors
/// The database's; the slice's transaction is rolled back, the cursor stays where it was.
pub async fn sweep_slice(pool: &PgPool, pipeline: &str, retention: Duration, rows: u32, restart: bool) -> Result<Slice, sqlx::Error> {
    let persistent = super::persistent();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO idemflow.retention_sweeps (pipeline) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(pipeline)
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
    let cursor: Option<i64> =
        sqlx::query_scalar("SELECT next_block FROM idemflow.retention_sweeps WHERE pipeline = $1 FOR UPDATE SKIP LOCKED")
            .bind(pipeline)
            .persistent(persistent)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(cursor) = cursor else {
        tx.rollback().await?;
        return Ok(Slice { skipped_locked: true, ..Slice::default() });
    };
    let from = if restart { 0 } else { cursor };
    let (blocks, reltuples, relpages, version): (i64, f64, i64, i32) = sqlx::query_as(SIZE).persistent(persistent).fetch_one(&mut *tx).await?;
    if version < TID_RANGE_SCANS {
        // Before PostgreSQL 14 a slice would read the whole table: refused, and said at every pass.
        return Err(sqlx::Error::Protocol(format!(
            "the retention sweep needs PostgreSQL 14 or later (TID range scans); this server is version {version}: \
             expired dedup rows are not deleted (`idemflow purge` neither); upgrade the server (PostgreSQL 13 is past its end of life)"
        )));
    }
    let per_block = if reltuples > 0.0 && relpages > 0 { reltuples / relpages as f64 } else { ROWS_PER_BLOCK_UNKNOWN };
    let span = ((f64::from(rows) / per_block).ceil() as i64).max(1);
    let to = from.saturating_add(span);
    let (examined, purged) = if from < blocks {
        let (examined, purged): (i64, i64) = sqlx::query_as(SLICE)
            .bind(pipeline)
            .bind(format!("({from},0)"))
            .bind(format!("({},0)", to.min(i64::from(u32::MAX))))
            .bind(retention.as_secs_f64())
            .persistent(persistent)
            .fetch_one(&mut *tx)
            .await?;
        (examined as u64, purged as u64)
    } else {
        (0, 0)
    };
    let pass_seconds = if to >= blocks {
        // The pass ends: its duration from its first slice (this one, on a restart) to now.
        let seconds: f64 = sqlx::query_scalar(
            "UPDATE idemflow.retention_sweeps SET next_block = 0, passes = passes + 1, \
             last_pass_seconds = extract(epoch FROM now() - CASE WHEN $2 THEN now() ELSE coalesce(pass_started_at, now()) END)::float8, \
             pass_started_at = NULL, updated_at = now() WHERE pipeline = $1 RETURNING last_pass_seconds",
        )
        .bind(pipeline)
        .bind(restart)
        .persistent(persistent)
        .fetch_one(&mut *tx)
        .await?;
        Some(seconds)
    } else {
        sqlx::query(
            "UPDATE idemflow.retention_sweeps SET next_block = $2, \
             pass_started_at = CASE WHEN $3 OR pass_started_at IS NULL THEN now() ELSE pass_started_at END, updated_at = now() \
             WHERE pipeline = $1",
        )
        .bind(pipeline)
        .bind(to)
        .bind(restart)
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
        None
    };
    tx.commit().await?;
    Ok(Slice { examined, purged, skipped_locked: false, pass_seconds })
}

/// Where `pipeline`'s sweep stands ([`crate::retention::SweepState`]); `None` before its first slice.
///
/// # Errors
/// The database's.
pub async fn sweep_state(pool: &PgPool, pipeline: &str) -> Result<Option<crate::retention::SweepState>, sqlx::Error> {
    // In a transaction, as every access is (a transaction-pooling proxy, PgBouncer).
    let mut tx = pool.begin().await?;
    let row: Option<(i64, Option<f64>, Option<f64>)> = sqlx::query_as(
        "SELECT passes, last_pass_seconds, extract(epoch FROM now() - pass_started_at)::float8 \
         FROM idemflow.retention_sweeps WHERE pipeline = $1",
    )
    .bind(pipeline)
    .persistent(super::persistent())
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(row.map(|(passes, last_pass_seconds, current_pass_seconds)| crate::retention::SweepState {
        passes: passes.max(0) as u64,
        last_pass_seconds,
        current_pass_seconds,
    }))
}
