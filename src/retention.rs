//! Retention of the dedup store: rows older than the pipeline's `[dedup] retention` are deleted in bounded batches.
//!
//! Each batch is one short transaction that first takes a transaction-scoped advisory lock for the pipeline
//! (`pg_try_advisory_xact_lock`, PostgreSQL docs "Advisory Locks"): when another replica holds it, this one skips
//! the rest of its pass (without scanning: the lock is a one-time filter), so at any moment one replica deletes a
//! pipeline's rows and nobody waits. A batch deletes at most
//! `purge_batch` rows, oldest first, found through the `(pipeline, applied_at)` index and locked with
//! `FOR UPDATE SKIP LOCKED`, so no long lock is held and no giant `DELETE` runs.
//!
//! A record redelivered after its key's row was purged is applied again: retention must cover the longest time a
//! record can come back (the topic's retention, a consumer group rewound to the earliest offset). See the README.

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

/// What one purge pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeOutcome {
    /// Rows deleted.
    pub purged: u64,
    /// Batches run.
    pub batches: u64,
    /// Whether the pass was skipped because another replica held the pipeline's purge lock.
    pub skipped_locked: bool,
}

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
            .persistent(crate::db::persistent())
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

/// Whether a topic can redeliver a record after its dedup row was purged: a warning to show, or `None` when the
/// dedup retention covers the topic's retention. `topic_retention_ms` is the topic's `retention.ms` (`-1`: forever).
pub fn window_warning(pipeline: &str, topic: &str, topic_retention_ms: i64, dedup_retention: Duration) -> Option<String> {
    let dedup = humantime::format_duration(dedup_retention);
    if topic_retention_ms < 0 {
        return Some(format!(
            "pipeline {pipeline:?}: topic {topic:?} keeps records forever (retention.ms = -1) but dedup rows are kept \
             {dedup}: a consumer group rewound past that would apply older operations again"
        ));
    }
    let topic_retention = Duration::from_millis(topic_retention_ms as u64);
    (topic_retention > dedup_retention).then(|| {
        format!(
            "pipeline {pipeline:?}: topic {topic:?} keeps records for {} (retention.ms) but dedup rows are kept {dedup}: \
             a record redelivered after {dedup} (a rewind, a long outage) would be applied again; raise [dedup] \
             retention to at least the topic's retention",
            humantime::format_duration(topic_retention)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_when_the_topic_outlives_the_dedup_rows() {
        let week = Duration::from_secs(7 * 24 * 3600);
        assert_eq!(window_warning("p", "t", 7 * 24 * 3600 * 1000, week), None);
        assert_eq!(window_warning("p", "t", 3600 * 1000, week), None);
        let w = window_warning("p", "t", 14 * 24 * 3600 * 1000, week).unwrap();
        assert!(w.contains("14days") && w.contains("7days"), "{w}");
        assert!(window_warning("p", "t", -1, week).unwrap().contains("forever"));
    }
}
