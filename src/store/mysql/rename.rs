//! `idemflow pipeline rename` on MySQL and MariaDB: every row of a pipeline's history moved under its new name in one
//! transaction.

use crate::store::rename::{self, running, RUNNING_WITHIN};
use crate::store::rows::Renamed;
use sqlx::MySqlPool;

/// The tables that keep a pipeline's history, each with its `pipeline` column: dedup rows (with their duplicate
/// counts), processed marks, stored positions, batch attempts, dead letters, outbox requests, and the retention
/// sweep's cursor.
pub const TABLES: [&str; 7] = ["dedup", "processed", "offsets", "attempts", "dead_letters", "outbox", "retention_sweeps"];

/// Moves every row of `old` under `new` in one transaction (counts per table; with `dry_run`, only counted). Waits
/// at most 5 s for a row another transaction holds (an in-flight batch: error 1205, `innodb_lock_wait_timeout`).
/// Returns
/// the refusal, without changing anything, where `new` already has rows in one of [`TABLES`] or a lane of `old`
/// recorded a batch attempt within [`RUNNING_WITHIN`] (outside a dry run).
///
/// Errors: the database's.
pub async fn rename(pool: &MySqlPool, old: &str, new: &str, dry_run: bool) -> Result<Result<Renamed, String>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 5").execute(&mut *conn).await?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // Each lane's attempts row, locked: a batch in flight holds its own until it ends, so this waits for it (then
    // sees its attempt, a locking read reading the newest rows).
    let recent: Vec<String> = sqlx::query_scalar(
        "SELECT CONVERT(CONCAT(owner, ' at ', CAST(updated_at AS CHAR)) USING utf8mb4) FROM idemflow_attempts
         WHERE pipeline = ? AND updated_at > NOW(6) - INTERVAL ? MICROSECOND FOR UPDATE",
    )
    .bind(old)
    .bind(RUNNING_WITHIN.as_micros() as i64)
    .fetch_all(&mut *tx)
    .await?;
    if !recent.is_empty() && !dry_run {
        return Ok(Err(running(old, &recent)));
    }
    for table in TABLES {
        let taken: i64 = sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM idemflow_{table} WHERE pipeline = ?)"))
            .bind(new)
            .fetch_one(&mut *tx)
            .await?;
        if taken != 0 {
            return Ok(Err(rename::taken(new, table)));
        }
    }
    let mut moved = Vec::with_capacity(TABLES.len());
    for table in TABLES {
        let rows = if dry_run {
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM idemflow_{table} WHERE pipeline = ?")).bind(old).fetch_one(&mut *tx).await?;
            n as u64
        } else {
            sqlx::query(&format!("UPDATE idemflow_{table} SET pipeline = ? WHERE pipeline = ?")).bind(new).bind(old).execute(&mut *tx).await?.rows_affected()
        };
        moved.push((table, rows));
    }
    if dry_run {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(Ok(Renamed { tables: moved }))
}
