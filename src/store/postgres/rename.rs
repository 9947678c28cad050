//! `idemflow pipeline rename` on PostgreSQL: every row of a pipeline's history moved under its new name in one
//! transaction.

use crate::store::rows::Renamed;
use sqlx::PgPool;

/// The tables that keep a pipeline's history, each with its `pipeline` column: dedup rows and their duplicate
/// counts, processed marks, stored positions, batch attempts, dead letters, outbox requests, and the retention
/// sweep's cursor.
pub const TABLES: [&str; 8] = ["dedup", "dedup_duplicates", "processed", "offsets", "attempts", "dead_letters", "outbox", "retention_sweeps"];

/// Moves every row of `old` under `new` in one transaction (counts per table; with `dry_run`, only counted). Waits
/// at most 5 s for a row another transaction holds (an in-flight batch: SQLSTATE 55P03, an error). Returns
/// `Err(table)` without changing anything where `new` already has rows in one of [`TABLES`].
///
/// Errors: the database's.
pub async fn rename(pool: &PgPool, old: &str, new: &str, dry_run: bool) -> Result<Result<Renamed, &'static str>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '5s'").execute(&mut *tx).await?;
    for table in TABLES {
        let taken: bool = sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM idemflow.{table} WHERE pipeline = $1)"))
            .bind(new)
            .fetch_one(&mut *tx)
            .await?;
        if taken {
            return Ok(Err(table));
        }
    }
    let mut moved = Vec::with_capacity(TABLES.len());
    for table in TABLES {
        let rows = if dry_run {
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM idemflow.{table} WHERE pipeline = $1")).bind(old).fetch_one(&mut *tx).await?;
            n as u64
        } else {
            sqlx::query(&format!("UPDATE idemflow.{table} SET pipeline = $2 WHERE pipeline = $1")).bind(old).bind(new).execute(&mut *tx).await?.rows_affected()
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
