//! Retention of the dedup store: rows older than the pipeline's `[dedup] retention` are deleted in bounded batches.
//!
//! Each batch is one short transaction deleting at most `purge_batch` rows, oldest first, through the
//! `(pipeline, applied_at)` index, so no long lock is held and no giant `DELETE` runs. One replica at a time purges
//! a pipeline: one that finds another's purge lock held skips its pass (without scanning), so nobody waits. How each
//! store does it: [`crate::store::postgres::retention`] (an advisory lock per batch transaction) and
//! [`crate::store::mysql::retention`] (`GET_LOCK` for the pass).
//!
//! A record redelivered after its key's row was purged is applied again: retention must cover the longest time a
//! record can come back (the topic's retention, a consumer group rewound to the earliest offset). See docs/operations.md, "Retention and growth".

use std::time::Duration;

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
