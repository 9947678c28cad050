//! PostgreSQL retention: the sweep ([`crate::retention`]) by ranges of the dedup table's heap.
//!
//! A slice is one transaction: it locks the pipeline's row of `idemflow.retention_sweeps` without waiting
//! (`FOR UPDATE SKIP LOCKED`), skips when another replica holds the pass's lease or the pass is not due (see
//! [`crate::retention`]), reads a range of heap blocks `[next_block, next_block + n)` with a TID range scan
//! (PostgreSQL 14 and later: "TID Range Scan", no index needed), deletes the rows in it of this pipeline older than
//! the retention, those not locked by another transaction (`SKIP LOCKED`: never waited for, the row is left for the
//! next pass; a batch counting a duplicate holds its row so), with their keys' duplicate counts
//! (`idemflow.dedup_duplicates`), and moves the cursor and renews the lease. The last slice of a pass also deletes
//! the pipeline's counts left without their row (by a worker of the version before migration 12, whose sweep did
//! not know them, or a count locked when its row went), so the counts table cannot grow without end. `n` is about
//! `rows` rows' worth of blocks by the table's own statistics (`reltuples` / `relpages`), and at most `rows / 4`
//! blocks (a dedup row fits 4 times in a block at least: past about 2 KB its key is stored out of line), so stale
//! statistics cannot make one slice scan the table. The pass ends at the block the relation ends at when the slice
//! runs (`pg_relation_size`); rows inserted meanwhile are new, not expired. A heap range holds every pipeline's
//! rows: pipelines sharing the table each sweep all of it, each its own cursor.
//!
//! Before PostgreSQL 14 (no TID range scans) a slice is a range of the pipeline's primary key instead, as on
//! MySQL: the next `rows` key ids after the cursor (`swept_to`). A full pass then reads the heap in key order, about
//! nine times the work of a heap pass on a table of 10 million rows (docs/operations.md).

use crate::retention::{Skipped, Slice, Sweep};
use sqlx::{PgPool, Postgres, Transaction};

/// Rows per heap block assumed before the table has statistics (a dedup row with a short key is about 160 bytes of
/// heap: about 50 to a block of 8 KiB).
const ROWS_PER_BLOCK_UNKNOWN: f64 = 50.0;

/// The fewest rows a heap block holds, whatever the statistics say: a dedup row's key text is stored out of line
/// past about 2 KB, so a row takes at most about a quarter of a block.
const ROWS_PER_BLOCK_AT_LEAST: f64 = 4.0;

/// The first `server_version_num` with TID range scans (PostgreSQL 14).
const TID_RANGE_SCANS: i32 = 140_000;

/// A slice's last steps, after its `victims` CTE: the victims deleted (`deleted`) with their keys' duplicate counts,
/// those not locked by another transaction (a count left is deleted at the pass's end, [`ORPHAN_COUNTS`]).
macro_rules! delete_victims {
    () => {
        r#"deleted AS (DELETE FROM idemflow.dedup WHERE ctid = ANY (ARRAY(SELECT ctid FROM victims)) RETURNING pipeline, key_id),
counted AS (
    SELECT c.ctid FROM idemflow.dedup_duplicates c JOIN deleted x USING (pipeline, key_id)
    FOR UPDATE OF c SKIP LOCKED
),
uncounted AS (DELETE FROM idemflow.dedup_duplicates WHERE ctid = ANY (ARRAY(SELECT ctid FROM counted)))
"#
    };
}

/// One heap slice: `$2`, `$3` the first and the end block as `(n,0)`, `$4` the retention in seconds.
const HEAP_SLICE: &str = concat!(
    r#"
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
"#,
    delete_victims!(),
    "SELECT (SELECT count(*) FROM slice), (SELECT count(*) FROM deleted)"
);

/// One key slice (before PostgreSQL 14): `{after}` the lower bound when there is one (`$4`), `$2` the rows, `$3` the
/// retention in seconds.
fn key_slice(after: bool) -> String {
    let after = if after { " AND key_id > $4" } else { "" };
    format!(
        r#"
WITH slice AS MATERIALIZED (
    SELECT key_id, applied_at < now() - make_interval(secs => $3) AS expired
    FROM idemflow.dedup WHERE pipeline = $1{after} ORDER BY key_id LIMIT $2
),
victims AS (
    SELECT d.ctid FROM idemflow.dedup d JOIN slice s ON s.key_id = d.key_id
    WHERE s.expired AND d.pipeline = $1 AND d.applied_at < now() - make_interval(secs => $3)
    FOR UPDATE OF d SKIP LOCKED
),
{delete}SELECT (SELECT count(*) FROM slice), (SELECT key_id FROM slice ORDER BY key_id DESC LIMIT 1), (SELECT count(*) FROM deleted)"#,
        delete = delete_victims!()
    )
}

/// The table's size in blocks now, its statistics' rows and blocks (as of the last `VACUUM` or `ANALYZE`), and the
/// server's version number.
const SIZE: &str = "SELECT pg_relation_size(c.oid) / current_setting('block_size')::int8, c.reltuples::float8, c.relpages::int8, \
                    current_setting('server_version_num')::int4 FROM pg_class c WHERE c.oid = 'idemflow.dedup'::regclass";

/// The pipeline's duplicate counts without the dedup row they were written for (see the module's documentation),
/// deleted at the end of a pass; a count a batch holds is left for the next.
const ORPHAN_COUNTS: &str = r#"
WITH orphans AS (
    SELECT c.ctid FROM idemflow.dedup_duplicates c
    WHERE c.pipeline = $1
      AND NOT EXISTS (SELECT FROM idemflow.dedup d WHERE d.pipeline = c.pipeline AND d.key_id = c.key_id AND d.applied_at = c.applied_at)
    FOR UPDATE OF c SKIP LOCKED
)
DELETE FROM idemflow.dedup_duplicates WHERE ctid = ANY (ARRAY(SELECT ctid FROM orphans))"#;

/// Where a slice leaves the cursor.
enum Cursor {
    /// The pass ended: back to the start.
    End,
    /// The next heap block.
    Block(i64),
    /// The last key id swept.
    Key(Vec<u8>),
}

/// Runs one slice of `sweep` (see the module's documentation); `restart` takes the pass over and puts the cursor
/// back at the start first.
///
/// # Errors
/// The database's; the slice's transaction is rolled back, the cursor stays where it was.
pub async fn sweep_slice(pool: &PgPool, sweep: &Sweep<'_>, restart: bool) -> Result<Slice, sqlx::Error> {
    let persistent = super::persistent();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO idemflow.retention_sweeps (pipeline) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(sweep.pipeline)
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
    let state: Option<(i64, Option<Vec<u8>>, bool, bool)> = sqlx::query_as(
        "SELECT next_block, swept_to, coalesce(owner IS DISTINCT FROM $2 AND lease_until > now(), false), \
         coalesce(pass_started_at IS NULL AND last_pass_ended_at > now() - make_interval(secs => $3), false) \
         FROM idemflow.retention_sweeps WHERE pipeline = $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(sweep.pipeline)
    .bind(sweep.owner)
    .bind(sweep.interval.as_secs_f64())
    .persistent(persistent)
    .fetch_optional(&mut *tx)
    .await?;
    let skipped = match &state {
        None => Some(Skipped::OtherReplica),
        Some((_, _, true, _)) if !restart => Some(Skipped::OtherReplica),
        Some((_, _, _, true)) if !restart => Some(Skipped::NotDue),
        Some(_) => None,
    };
    let (Some((next_block, swept_to, _, _)), None) = (state, skipped) else {
        tx.rollback().await?;
        return Ok(Slice { skipped, ..Slice::default() });
    };
    let (blocks, reltuples, relpages, version): (i64, f64, i64, i32) = sqlx::query_as(SIZE).persistent(persistent).fetch_one(&mut *tx).await?;
    let (examined, purged, cursor) = if version >= TID_RANGE_SCANS {
        let from = if restart { 0 } else { next_block };
        let per_block = if reltuples > 0.0 && relpages > 0 { reltuples / relpages as f64 } else { ROWS_PER_BLOCK_UNKNOWN };
        let span = ((f64::from(sweep.rows) / per_block.max(ROWS_PER_BLOCK_AT_LEAST)).ceil() as i64).max(1);
        let to = from.saturating_add(span);
        let (examined, purged) = if from < blocks {
            sqlx::query_as::<_, (i64, i64)>(HEAP_SLICE)
                .bind(sweep.pipeline)
                .bind(format!("({from},0)"))
                .bind(format!("({},0)", to.min(i64::from(u32::MAX))))
                .bind(sweep.retention.as_secs_f64())
                .persistent(persistent)
                .fetch_one(&mut *tx)
                .await?
        } else {
            (0, 0)
        };
        (examined, purged, if to >= blocks { Cursor::End } else { Cursor::Block(to) })
    } else {
        let after = if restart { None } else { swept_to };
        let (examined, last, purged) = run_key_slice(&mut tx, sweep.pipeline, sweep.rows, sweep.retention, after.as_deref()).await?;
        let cursor = match last {
            Some(last) if examined >= i64::from(sweep.rows) => Cursor::Key(last),
            _ => Cursor::End,
        };
        (examined, purged, cursor)
    };
    let pass_seconds = move_cursor(&mut tx, sweep, restart, cursor).await?;
    tx.commit().await?;
    Ok(Slice { examined: examined as u64, purged: purged as u64, skipped: None, pass_seconds })
}

/// Stores where the slice left the cursor and renews the owner's lease; at the end of a pass, counts it, frees the
/// lease, and returns how long the pass took (from its first slice, this one on a restart).
async fn move_cursor(tx: &mut Transaction<'_, Postgres>, sweep: &Sweep<'_>, restart: bool, cursor: Cursor) -> Result<Option<f64>, sqlx::Error> {
    let persistent = super::persistent();
    let (block, key) = match cursor {
        Cursor::End => {
            sqlx::query(ORPHAN_COUNTS).bind(sweep.pipeline).persistent(persistent).execute(&mut **tx).await?;
            let seconds: f64 = sqlx::query_scalar(
                "UPDATE idemflow.retention_sweeps SET next_block = 0, swept_to = NULL, passes = passes + 1, \
                 last_pass_seconds = extract(epoch FROM now() - CASE WHEN $2 THEN now() ELSE coalesce(pass_started_at, now()) END)::float8, \
                 pass_started_at = NULL, last_pass_ended_at = now(), owner = NULL, lease_until = NULL, updated_at = now() \
                 WHERE pipeline = $1 RETURNING last_pass_seconds",
            )
            .bind(sweep.pipeline)
            .bind(restart)
            .persistent(persistent)
            .fetch_one(&mut **tx)
            .await?;
            return Ok(Some(seconds));
        }
        Cursor::Block(block) => (block, None),
        Cursor::Key(key) => (0, Some(key)),
    };
    sqlx::query(
        "UPDATE idemflow.retention_sweeps SET next_block = $2, swept_to = $3, \
         pass_started_at = CASE WHEN $4 OR pass_started_at IS NULL THEN now() ELSE pass_started_at END, \
         owner = $5, lease_until = now() + make_interval(secs => $6), updated_at = now() WHERE pipeline = $1",
    )
    .bind(sweep.pipeline)
    .bind(block)
    .bind(key)
    .bind(restart)
    .bind(sweep.owner)
    .bind(sweep.lease().as_secs_f64())
    .persistent(persistent)
    .execute(&mut **tx)
    .await?;
    Ok(None)
}

/// Gives up `sweep.owner`'s lease on the pipeline's pass ([`crate::store::contract::Connector::release_sweep`]): the
/// cursor and the pass's start stay, so another replica resumes the pass at its next slice.
///
/// # Errors
/// The database's.
pub async fn release(pool: &PgPool, sweep: &Sweep<'_>) -> Result<(), sqlx::Error> {
    // In a transaction, as every access is (a transaction-pooling proxy keeps a statement's steps on one session).
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE idemflow.retention_sweeps SET lease_until = NULL, updated_at = now() WHERE pipeline = $1 AND owner = $2")
        .persistent(super::persistent())
        .bind(sweep.pipeline)
        .bind(sweep.owner)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Where `pipeline`'s sweep stands ([`crate::retention::SweepState`]): no pass before its first slice, and the
/// table's row estimate (`reltuples`; none before the first `ANALYZE`).
///
/// # Errors
/// The database's.
pub async fn sweep_state(pool: &PgPool, pipeline: &str) -> Result<Option<crate::retention::SweepState>, sqlx::Error> {
    // In a transaction, as every access is (a transaction-pooling proxy, PgBouncer).
    let mut tx = pool.begin().await?;
    let (passes, last_pass_seconds, current_pass_seconds, rows): (Option<i64>, Option<f64>, Option<f64>, f64) = sqlx::query_as(
        "SELECT s.passes, s.last_pass_seconds, extract(epoch FROM now() - s.pass_started_at)::float8, \
         (SELECT reltuples::float8 FROM pg_class WHERE oid = 'idemflow.dedup'::regclass) \
         FROM (SELECT 1) AS one LEFT JOIN idemflow.retention_sweeps s ON s.pipeline = $1",
    )
    .bind(pipeline)
    .persistent(super::persistent())
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(crate::retention::SweepState {
        passes: passes.unwrap_or_default().max(0) as u64,
        last_pass_seconds,
        current_pass_seconds,
        rows: (rows > 0.0).then_some(rows),
    }))
}

/// Runs one key-range slice (before PostgreSQL 14): `(examined, last key id, purged)` of the `rows` keys of
/// `pipeline` after `after` (from its first key when `None`).
async fn run_key_slice(
    conn: &mut sqlx::PgConnection,
    pipeline: &str,
    rows: u32,
    retention: std::time::Duration,
    after: Option<&[u8]>,
) -> Result<(i64, Option<Vec<u8>>, i64), sqlx::Error> {
    let sql = key_slice(after.is_some());
    let query = sqlx::query_as(&sql).bind(pipeline).bind(i64::from(rows)).bind(retention.as_secs_f64());
    let query = match after {
        Some(after) => query.bind(after),
        None => query,
    };
    query.persistent(super::persistent()).fetch_one(conn).await
}

/// The key-range slice's statement, for tests on a server that has TID range scans (PostgreSQL 14 and later) to run
/// the path older servers take ([`run_key_slice`]), outside a sweep's transaction.
///
/// # Errors
/// The database's.
#[doc(hidden)]
pub async fn key_range_slice(pool: &PgPool, pipeline: &str, rows: u32, retention: std::time::Duration, after: Option<&[u8]>) -> Result<(i64, Option<Vec<u8>>, i64), sqlx::Error> {
    run_key_slice(&mut *pool.acquire().await?, pipeline, rows, retention, after).await
}
