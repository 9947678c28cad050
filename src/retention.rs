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

/// What a Kafka topic says about how long it keeps a record (its topic configuration, Kafka's "Topic Configs").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicRetention {
    /// `retention.ms`: how long a closed log segment is kept after its newest record (`-1`: forever).
    pub retention_ms: Option<i64>,
    /// `segment.ms`: how long a segment stays open before it rolls (7 days by default).
    pub segment_ms: Option<i64>,
    /// `cleanup.policy`: `delete`, `compact`, or `compact,delete`.
    pub cleanup_policy: Option<String>,
}

impl TopicRetention {
    /// How long a record can stay readable: a segment is deleted whole, once its newest record is older than
    /// `retention.ms`, and a segment takes records for up to `segment.ms` before it rolls; so the first record of a
    /// segment can live `retention.ms + segment.ms`. `None` for forever (`retention.ms = -1`); `segment.ms` counts
    /// as 0 when the broker did not say.
    pub fn longest_ms(&self, retention_ms: i64) -> Option<i64> {
        (retention_ms >= 0).then(|| retention_ms.saturating_add(self.segment_ms.unwrap_or(0).max(0)))
    }
}

/// Whether a topic can redeliver a record after its dedup row was purged: warnings to show, none when the dedup
/// retention covers what the topic can hold (its [`TopicRetention::longest_ms`]). A compacted topic keeps the
/// newest record of every key for good, so it always warns.
pub fn window_warnings(pipeline: &str, topic: &str, kept: &TopicRetention, dedup_retention: Duration) -> Vec<String> {
    let dedup = crate::terminal::duration(dedup_retention);
    let mut out = Vec::new();
    if kept.cleanup_policy.as_deref().is_some_and(|p| p.split(',').any(|p| p.trim() == "compact")) {
        out.push(format!(
            "pipeline {pipeline:?}: topic {topic:?} is compacted (cleanup.policy = {}): it keeps the newest record of every \
             key for good, but dedup rows are kept {dedup}: a consumer group that starts over (its offsets expired, a new \
             group_id, a rewind to earliest) would apply those records again once their dedup rows are purged",
            kept.cleanup_policy.as_deref().unwrap_or_default()
        ));
    }
    let Some(retention_ms) = kept.retention_ms else { return out };
    match kept.longest_ms(retention_ms) {
        None => out.push(format!(
            "pipeline {pipeline:?}: topic {topic:?} keeps records forever (retention.ms = -1) but dedup rows are kept \
             {dedup}: a consumer group rewound past that would apply older operations again"
        )),
        Some(longest) if Duration::from_millis(longest as u64) > dedup_retention => out.push(format!(
            "pipeline {pipeline:?}: topic {topic:?} can keep a record for {} (retention.ms {} + segment.ms {}: a segment is \
             deleted whole once its newest record is past retention.ms) but dedup rows are kept {dedup}: a record \
             redelivered after {dedup} (a rewind, a long outage) would be applied again; raise [dedup] retention to at \
             least that",
            crate::terminal::duration(Duration::from_millis(longest as u64)),
            crate::terminal::duration(Duration::from_millis(retention_ms as u64)),
            kept.segment_ms.map_or_else(|| "unknown".to_owned(), |ms| crate::terminal::duration(Duration::from_millis(ms.max(0) as u64))),
        )),
        Some(_) => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_when_the_topic_outlives_the_dedup_rows() {
        let day = 24 * 3600 * 1000;
        let week = Duration::from_secs(7 * 24 * 3600);
        let kept = |retention: i64, segment: Option<i64>, policy: &str| TopicRetention {
            retention_ms: Some(retention),
            segment_ms: segment,
            cleanup_policy: Some(policy.to_owned()),
        };
        assert!(window_warnings("p", "t", &kept(3 * day, Some(day), "delete"), week).is_empty());
        assert!(window_warnings("p", "t", &kept(3600 * 1000, None, "delete"), week).is_empty());
        // Kafka's defaults: 7 days of retention.ms and 7 days of segment.ms hold a record up to 14 days.
        let w = window_warnings("p", "t", &kept(7 * day, Some(7 * day), "delete"), week);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("14d") && w[0].contains("segment.ms 7d") && w[0].contains("kept 7d"), "{w:?}");
        assert!(window_warnings("p", "t", &kept(14 * day, None, "delete"), week)[0].contains("segment.ms unknown"));
        assert!(window_warnings("p", "t", &kept(-1, Some(day), "delete"), week)[0].contains("forever"));
        let compacted = window_warnings("p", "t", &kept(day, Some(day), "compact,delete"), week);
        assert_eq!(compacted.len(), 1, "{compacted:?}");
        assert!(compacted[0].contains("is compacted (cleanup.policy = compact,delete)"), "{compacted:?}");
        assert_eq!(window_warnings("p", "t", &kept(-1, None, "compact"), week).len(), 2);
        assert!(window_warnings("p", "t", &TopicRetention::default(), week).is_empty(), "nothing said, nothing to compare");
    }
}
