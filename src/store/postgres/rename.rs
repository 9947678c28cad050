//! `idemflow pipeline rename` on PostgreSQL: every row of a pipeline's history moved under its new name in one
//! transaction.

use crate::store::rename::{self, running, RUNNING_WITHIN};
use crate::store::rows::Renamed;
use sqlx::PgPool;

/// The tables that keep a pipeline's history, each with its `pipeline` column: dedup rows and their duplicate
/// counts, processed marks, stored positions, batch attempts, dead letters, outbox requests, and the retention
/// sweep's cursor.
pub const TABLES: [&str; 8] = ["dedup", "dedup_duplicates", "processed", "offsets", "attempts", "dead_letters", "outbox", "retention_sweeps"];

/// Moves every row of `old` under `new` in one transaction (counts per table; with `dry_run`, only counted). Waits
/// at most 5 s for a row another transaction holds (an in-flight batch: SQLSTATE 55P03, an error). Returns
/// the refusal, without changing anything, where `new` already has rows in one of [`TABLES`] or a lane of `old`
/// recorded a batch attempt within [`RUNNING_WITHIN`] (outside a dry run).
///
/// Errors: the database's.
pub async fn rename(pool: &PgPool, old: &str, new: &str, dry_run: bool) -> Result<Result<Renamed, String>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '5s'").execute(&mut *tx).await?;
    // Each lane's attempts row, locked: a batch in flight holds its own until it ends, so this waits for it (then
    // sees its attempt). The moves below are later statements, with a snapshot taken after these locks.
    sqlx::query("SELECT 1 FROM idemflow.attempts WHERE pipeline = $1 FOR UPDATE").bind(old).execute(&mut *tx).await?;
    let recent: Vec<String> = sqlx::query_scalar(
        "SELECT owner || ' at ' || updated_at::text FROM idemflow.attempts WHERE pipeline = $1 AND updated_at > now() - make_interval(secs => $2)",
    )
    .bind(old)
    .bind(RUNNING_WITHIN.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    if !recent.is_empty() && !dry_run {
        return Ok(Err(running(old, &recent)));
    }
    // The first table where the new name has rows, in one statement.
    let taken: Vec<String> = TABLES.iter().map(|t| format!("SELECT '{t}' WHERE EXISTS (SELECT 1 FROM idemflow.{t} WHERE pipeline = $1)")).collect();
    let taken: Option<String> = sqlx::query_scalar(&format!("{} LIMIT 1", taken.join(" UNION ALL "))).bind(new).fetch_optional(&mut *tx).await?;
    if let Some(table) = taken {
        return Ok(Err(rename::taken(new, &table)));
    }
    // Every table's rows moved (or counted) in one statement: `moved_<table>` each.
    let each: Vec<String> = if dry_run {
        TABLES.iter().map(|t| format!("m_{t} AS (SELECT 1 FROM idemflow.{t} WHERE pipeline = $1)")).collect()
    } else {
        TABLES.iter().map(|t| format!("m_{t} AS (UPDATE idemflow.{t} SET pipeline = $2 WHERE pipeline = $1 RETURNING 1)")).collect()
    };
    let counts: Vec<String> = TABLES.iter().map(|t| format!("(SELECT count(*) FROM m_{t})")).collect();
    let statement = format!("WITH {} SELECT ARRAY[{}]::int8[]", each.join(", "), counts.join(", "));
    let query = sqlx::query_scalar(&statement).bind(old);
    let moved: Vec<i64> = if dry_run { query } else { query.bind(new) }.fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(Ok(Renamed { tables: TABLES.iter().copied().zip(moved.into_iter().map(|n| n.max(0) as u64)).collect() }))
}
