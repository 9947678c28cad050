//! MySQL and MariaDB retention: a purge pass holds a named lock for the pipeline (`GET_LOCK(name, 0)`, MySQL
//! Reference Manual "Locking Functions") on one connection; when another replica holds it, this one skips its pass.
//! Each batch is one `DELETE ... ORDER BY applied_at LIMIT n` through the `(pipeline, applied_at)` index, committed
//! on its own. The lock is a session's: the pass's connection is closed when the pass ends, however it ends, and the
//! server releases the lock with it (a connection returned to the pool would keep holding it).

use crate::retention::PurgeOutcome;
use sha2::{Digest, Sha256};
use sqlx::MySqlPool;
use std::time::Duration;

/// The lock's name: `idemflow_purge_` and 24 hex digits of the pipeline name's SHA-256 (lock names are limited to
/// 64 characters).
fn lock_name(pipeline: &str) -> String {
    format!("idemflow_purge_{}", &crate::terminal::hex(&Sha256::digest(pipeline.as_bytes()))[..24])
}

/// Deletes the dedup rows of `pipeline` older than `retention`, `batch` rows per statement, until none is left.
///
/// Errors: the database's; a pass interrupted by one leaves the store consistent (each batch is atomic).
pub async fn purge(pool: &MySqlPool, pipeline: &str, retention: Duration, batch: u32, mut on_batch: impl FnMut(u64)) -> Result<PurgeOutcome, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    // The lock and the connection go together: however the pass ends (an error, or the pass dropped when its
    // pipeline stops), the connection is closed rather than returned to the pool, and the server releases the lock.
    conn.close_on_drop();
    let name = lock_name(pipeline);
    let held: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)").bind(&name).fetch_one(&mut *conn).await?;
    if held != Some(1) {
        return Ok(PurgeOutcome { skipped_locked: true, ..PurgeOutcome::default() });
    }
    let mut outcome = PurgeOutcome::default();
    let pass = async {
        loop {
            let deleted = sqlx::query(
                "DELETE FROM idemflow_dedup WHERE pipeline = ? AND applied_at < CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                 ORDER BY applied_at LIMIT ?",
            )
            .bind(pipeline)
            .bind(i64::try_from(retention.as_micros()).unwrap_or(i64::MAX))
            .bind(batch)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            outcome.batches += 1;
            outcome.purged += deleted;
            on_batch(deleted);
            if deleted < u64::from(batch) {
                return Ok::<_, sqlx::Error>(());
            }
        }
    }
    .await;
    pass.map(|()| outcome)
}
