//! MySQL and MariaDB retention: the sweep ([`crate::retention`]) by ranges of the clustered primary key,
//! `(pipeline, key_id)`: InnoDB keeps the rows in that order, so a range of one pipeline's keys is a range of pages.
//!
//! A slice is one transaction (`READ COMMITTED`, as every idemflow session): it locks the pipeline's row of
//! `idemflow_retention_sweeps` without waiting (`FOR UPDATE NOWAIT`, MySQL 8.0 and MariaDB 10.3; error 3572 on
//! MySQL, 1205 on MariaDB when another replica's slice holds it: this one skips its pass), skips when another
//! replica holds the pass's lease or the pass is not due (see [`crate::retention`]), finds the next `rows` key ids
//! after the cursor, deletes those of them older than the retention, and moves the cursor to the last and renews
//! the lease. The pass ends when fewer than `rows` keys were left. Its `DELETE` waits for a row a batch holds, as any
//! statement does (MariaDB 10.5 has no `SKIP LOCKED`): at most `innodb_lock_wait_timeout`, and a deadlock rolls one
//! of the two back (a batch retries; a slice is tried again next pass).

use crate::retention::{Skipped, Slice, Sweep};
use sqlx::MySqlPool;
use std::time::Duration;

/// Error codes of a `NOWAIT` lock that was held: MySQL's `ER_LOCK_NOWAIT` and MariaDB's `ER_LOCK_WAIT_TIMEOUT`
/// (MariaDB reports `NOWAIT` as a lock wait that timed out at once).
const LOCK_HELD: [u16; 2] = [3572, 1205];

/// Runs one slice of `sweep` (see the module's documentation); `restart` takes the pass over and puts the cursor
/// back at the pipeline's first key first.
///
/// # Errors
/// The database's; the slice's transaction is rolled back, the cursor stays where it was.
pub async fn sweep_slice(pool: &MySqlPool, sweep: &Sweep<'_>, restart: bool) -> Result<Slice, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let state = lock_cursor(&mut tx, sweep).await?;
    let skipped = match &state {
        None => Some(Skipped::OtherReplica),
        Some(CursorRow { leased_elsewhere: true, .. }) if !restart => Some(Skipped::OtherReplica),
        Some(CursorRow { not_due: true, .. }) if !restart => Some(Skipped::NotDue),
        Some(_) => None,
    };
    let (Some(CursorRow { swept_to, .. }), None) = (state, skipped) else {
        tx.rollback().await?;
        return Ok(Slice { skipped, ..Slice::default() });
    };
    let after = if restart { None } else { swept_to };
    let bound = if after.is_some() { " AND key_id > ?" } else { "" };
    let range = format!("SELECT COUNT(*), MAX(key_id) FROM (SELECT key_id FROM idemflow_dedup WHERE pipeline = ?{bound} ORDER BY key_id LIMIT ?) s");
    let range = sqlx::query_as::<_, (i64, Option<Vec<u8>>)>(&range).bind(sweep.pipeline);
    let range = match &after {
        Some(after) => range.bind(after),
        None => range,
    };
    let (examined, last) = range.bind(sweep.rows).fetch_one(&mut *tx).await?;
    let purged = match &last {
        Some(last) => {
            let delete = format!(
                "DELETE FROM idemflow_dedup WHERE pipeline = ?{bound} AND key_id <= ? \
                 AND applied_at < CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
            );
            let delete = sqlx::query(&delete).bind(sweep.pipeline);
            let delete = match &after {
                Some(after) => delete.bind(after),
                None => delete,
            };
            delete.bind(last).bind(micros(sweep.retention)).execute(&mut *tx).await?.rows_affected()
        }
        None => 0,
    };
    let pass_seconds = if examined < i64::from(sweep.rows) {
        Some(end_pass(&mut tx, sweep, restart).await?)
    } else {
        advance(&mut tx, sweep, restart, last.as_deref()).await?;
        None
    };
    tx.commit().await?;
    Ok(Slice { examined: examined as u64, purged, skipped: None, pass_seconds })
}

/// Microseconds of `d` for an `INTERVAL ? MICROSECOND`, saturated.
fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The pipeline's row of `idemflow_retention_sweeps`, as a slice finds it.
struct CursorRow {
    /// The last key id the pass has examined; `None` before a pass's first slice.
    swept_to: Option<Vec<u8>>,
    /// Another replica holds the pass's lease, unexpired.
    leased_elsewhere: bool,
    /// No pass runs and the last one ended less than `purge_interval` ago.
    not_due: bool,
}

/// Locks the pipeline's cursor row without waiting, making it on the pipeline's first slice; `None` when another
/// replica's slice holds it.
async fn lock_cursor(tx: &mut sqlx::Transaction<'_, sqlx::MySql>, sweep: &Sweep<'_>) -> Result<Option<CursorRow>, sqlx::Error> {
    let lock = "SELECT swept_to, COALESCE(NOT (owner <=> ?) AND lease_until > CURRENT_TIMESTAMP(6), FALSE), \
                COALESCE(pass_started_at IS NULL AND last_pass_ended_at > CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND, FALSE) \
                FROM idemflow_retention_sweeps WHERE pipeline = ? FOR UPDATE NOWAIT";
    for _ in 0..2 {
        let row = sqlx::query_as::<_, (Option<Vec<u8>>, bool, bool)>(lock)
            .bind(sweep.owner)
            .bind(micros(sweep.interval))
            .bind(sweep.pipeline)
            .fetch_optional(&mut **tx)
            .await;
        match row {
            Ok(Some((swept_to, leased_elsewhere, not_due))) => return Ok(Some(CursorRow { swept_to, leased_elsewhere, not_due })),
            // The pipeline's first slice: its cursor row is made (INSERT IGNORE could wait on a row locked by
            // another replica's slice, so it runs only when no row was found) and locked.
            Ok(None) => {
                sqlx::query("INSERT IGNORE INTO idemflow_retention_sweeps (pipeline) VALUES (?)").bind(sweep.pipeline).execute(&mut **tx).await?;
            }
            Err(sqlx::Error::Database(e))
                if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|m| LOCK_HELD.contains(&m.number())) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// Ends the pass: the cursor back to the start, the lease released, the pass counted; answers its duration in
/// seconds, from its first slice (this one, on a restart) to now.
async fn end_pass(tx: &mut sqlx::Transaction<'_, sqlx::MySql>, sweep: &Sweep<'_>, restart: bool) -> Result<f64, sqlx::Error> {
    // MySQL assigns left to right, so the duration is computed before pass_started_at is cleared.
    sqlx::query(
        "UPDATE idemflow_retention_sweeps SET swept_to = NULL, passes = passes + 1, \
         last_pass_seconds = TIMESTAMPDIFF(MICROSECOND, CASE WHEN ? THEN CURRENT_TIMESTAMP(6) ELSE COALESCE(pass_started_at, CURRENT_TIMESTAMP(6)) END, CURRENT_TIMESTAMP(6)) / 1e6, \
         pass_started_at = NULL, last_pass_ended_at = CURRENT_TIMESTAMP(6), owner = NULL, lease_until = NULL, \
         updated_at = CURRENT_TIMESTAMP(6) WHERE pipeline = ?",
    )
    .bind(restart)
    .bind(sweep.pipeline)
    .execute(&mut **tx)
    .await?;
    let seconds: Option<f64> = sqlx::query_scalar("SELECT last_pass_seconds FROM idemflow_retention_sweeps WHERE pipeline = ?")
        .bind(sweep.pipeline)
        .fetch_one(&mut **tx)
        .await?;
    Ok(seconds.unwrap_or_default())
}

/// Moves the cursor to `last`, starts the pass if this is its first slice, and renews this replica's lease.
async fn advance(tx: &mut sqlx::Transaction<'_, sqlx::MySql>, sweep: &Sweep<'_>, restart: bool, last: Option<&[u8]>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE idemflow_retention_sweeps SET swept_to = ?, \
         pass_started_at = CASE WHEN ? OR pass_started_at IS NULL THEN CURRENT_TIMESTAMP(6) ELSE pass_started_at END, \
         owner = ?, lease_until = CURRENT_TIMESTAMP(6) + INTERVAL ? MICROSECOND, updated_at = CURRENT_TIMESTAMP(6) WHERE pipeline = ?",
    )
    .bind(last)
    .bind(restart)
    .bind(sweep.owner)
    .bind(micros(sweep.lease()))
    .bind(sweep.pipeline)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Gives up `sweep.owner`'s lease on the pipeline's pass ([`crate::store::contract::Connector::release_sweep`]): the
/// cursor and the pass's start stay, so another replica resumes the pass at its next slice.
///
/// # Errors
/// The database's.
pub async fn release(pool: &MySqlPool, sweep: &Sweep<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE idemflow_retention_sweeps SET lease_until = NULL, updated_at = CURRENT_TIMESTAMP(6) WHERE pipeline = ? AND owner = ?")
        .bind(sweep.pipeline)
        .bind(sweep.owner)
        .execute(pool)
        .await?;
    Ok(())
}

/// Where `pipeline`'s sweep stands ([`crate::retention::SweepState`]): no pass before its first slice, and the
/// table's row estimate (`information_schema.tables.table_rows`, InnoDB's).
///
/// # Errors
/// The database's.
pub async fn sweep_state(pool: &MySqlPool, pipeline: &str) -> Result<Option<crate::retention::SweepState>, sqlx::Error> {
    let (passes, last_pass_seconds, current_pass_seconds, rows): (Option<i64>, Option<f64>, Option<f64>, Option<i64>) = sqlx::query_as(
        "SELECT s.passes, s.last_pass_seconds, TIMESTAMPDIFF(MICROSECOND, s.pass_started_at, CURRENT_TIMESTAMP(6)) / 1e6, \
         (SELECT CAST(table_rows AS SIGNED) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'idemflow_dedup') \
         FROM (SELECT 1 AS one) AS one LEFT JOIN idemflow_retention_sweeps s ON s.pipeline = ?",
    )
    .bind(pipeline)
    .fetch_one(pool)
    .await?;
    Ok(Some(crate::retention::SweepState {
        passes: passes.unwrap_or_default().max(0) as u64,
        last_pass_seconds,
        current_pass_seconds,
        rows: rows.filter(|r| *r > 0).map(|r| r as f64),
    }))
}
