//! Retention of the dedup store: a continuous, paced sweep deletes the rows older than the pipeline's
//! `[dedup] retention`.
//!
//! No index is kept for retention (one on `applied_at` would be written by every claimed key): the sweep walks the
//! dedup table in slices instead, each slice one short transaction that examines about `purge_batch` rows, deletes
//! those of the pipeline older than the retention, and stores the sweep's cursor, so a sweep resumes where it stopped
//! after a restart. How each store slices: [`crate::store::postgres::retention`] by ranges of the heap (TID range
//! scans, PostgreSQL 14 and later; by ranges of the primary key before), [`crate::store::mysql::retention`] by
//! ranges of the clustered primary key. A pass ends when the cursor
//! reaches the end of the table; the worker paces its slices to `purge_rate` rows examined per second and waits
//! `purge_interval` between passes. One replica at a time sweeps a pipeline: a slice locks the pipeline's cursor
//! without waiting and renews its replica's lease on the pass ([`Sweep::lease`]); a replica that finds the cursor
//! locked, or the pass leased to another, skips (and takes the pass over once the lease runs out: its owner died),
//! and a new pass starts only `purge_interval` after the last one ended, whichever replica ran it.
//!
//! So a row lives at least its retention and at most its retention plus one full pass and `purge_interval` (a row
//! moved by an update while its pass runs, a duplicate counted, can wait one pass more). A record redelivered after
//! its key's row was purged is applied again: retention must cover the longest time a record can come back (the
//! topic's retention, a consumer group rewound to the earliest offset). See docs/operations.md, "Retention and growth".

use std::future::Future;
use std::time::Duration;

/// One pipeline's sweep, as a worker or `idemflow purge` runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sweep<'a> {
    /// The pipeline whose rows are deleted.
    pub pipeline: &'a str,
    /// Who sweeps: the worker's (or the `purge` command's) name, recorded as the pass's owner.
    pub owner: &'a str,
    /// `[dedup] retention`: rows older than this are deleted.
    pub retention: Duration,
    /// `[dedup] purge_batch`: about this many rows examined per slice.
    pub rows: u32,
    /// `[dedup] purge_interval`: a new pass starts no sooner than this after the last one ended, whichever replica
    /// ran it.
    pub interval: Duration,
    /// How the slices follow each other.
    pub pace: Pace,
}

impl Sweep<'_> {
    /// How long the owner's hold on a pass lasts after each of its slices: ten of its pauses between slices and
    /// [`LEASE_SLACK`] for a slow slice (at the defaults, 40 s). Another replica takes the pass over once it runs out
    /// (its owner stopped or died mid-pass).
    pub fn lease(&self) -> Duration {
        let pause = match self.pace {
            Pace::RowsPerSecond(rate) => Duration::from_secs_f64(f64::from(self.rows) / f64::from(rate.max(1))),
            Pace::FromStartAtOnce => Duration::ZERO,
        };
        pause * 10 + LEASE_SLACK
    }
}

/// What a lease on a pass adds to its owner's pauses between slices: a slice that takes long on a loaded server
/// does not lose its pass to another replica.
pub const LEASE_SLACK: Duration = Duration::from_secs(30);

/// Why a slice did nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skipped {
    /// Another replica is sweeping the pipeline: its slice holds the cursor now, or its lease on the pass under way
    /// has not run out.
    OtherReplica,
    /// The last pass ended less than `purge_interval` ago.
    NotDue,
}

/// What one slice of a sweep did ([`crate::store::Connector::sweep_slice`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Slice {
    /// Dedup rows the slice looked at: on PostgreSQL 14 and later of every pipeline sharing the table (a heap
    /// range), elsewhere of this pipeline (a key range).
    pub examined: u64,
    /// Rows deleted: this pipeline's, older than the retention.
    pub purged: u64,
    /// Nothing was done, and why.
    pub skipped: Option<Skipped>,
    /// The slice reached the end of the table: the pass ended, in this many seconds since its first slice (its
    /// cursor is back at the start). `Some(0.0)` from a store that has nothing to sweep.
    pub pass_seconds: Option<f64>,
}

/// What one sweep pass did ([`sweep_pass`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PurgeOutcome {
    /// Rows deleted.
    pub purged: u64,
    /// Rows examined.
    pub examined: u64,
    /// Slices run.
    pub slices: u64,
    /// Why the pass was given up before its end, if it was.
    pub skipped: Option<Skipped>,
    /// How long the pass took, from its first slice (by whichever replica) to its last; `None` when it did not end.
    pub pass_seconds: Option<f64>,
}

/// How a pass runs its slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pace {
    /// As the worker does: continue the pass the cursor is in (or start one when `purge_interval` has passed since
    /// the last ended), sleeping after each slice so that at most this many rows are examined per second.
    RowsPerSecond(u32),
    /// As `idemflow purge` does: take the pass over and start it from the beginning of the table, whatever replica
    /// held it, and run its slices back to back.
    FromStartAtOnce,
}

/// Runs slices until a pass ends, another replica is found sweeping (or the pass is not due), or a slice fails.
/// `slice(restart)` runs one slice (`restart`: take the pass over and put the cursor back at the start of the table
/// first); `on_slice` is told of each committed slice as it goes (the worker counts its rows in the metrics then,
/// not once per pass).
///
/// # Errors
/// The slice's; the slices committed before it stay committed, and the next pass resumes at the stored cursor.
pub async fn sweep_pass<E, F, Fut>(pace: Pace, mut slice: F, mut on_slice: impl FnMut(&Slice)) -> Result<PurgeOutcome, E>
where
    F: FnMut(bool) -> Fut,
    Fut: Future<Output = Result<Slice, E>>,
{
    let mut outcome = PurgeOutcome::default();
    let mut restart = pace == Pace::FromStartAtOnce;
    loop {
        let s = slice(restart).await?;
        restart = false;
        if s.skipped.is_some() {
            outcome.skipped = s.skipped;
            return Ok(outcome);
        }
        outcome.slices += 1;
        outcome.examined += s.examined;
        outcome.purged += s.purged;
        on_slice(&s);
        if s.pass_seconds.is_some() {
            outcome.pass_seconds = s.pass_seconds;
            return Ok(outcome);
        }
        if let Pace::RowsPerSecond(rate) = pace {
            tokio::time::sleep(Duration::from_secs_f64(s.examined as f64 / f64::from(rate.max(1)))).await;
        }
    }
}

/// Where a pipeline's sweep stands, as its store keeps it ([`crate::store::Connector::sweep_state`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SweepState {
    /// Full passes finished.
    pub passes: u64,
    /// How long the last full pass took, in seconds; `None` before the first.
    pub last_pass_seconds: Option<f64>,
    /// How long the pass under way has been running, in seconds; `None` between passes.
    pub current_pass_seconds: Option<f64>,
    /// About how many rows a pass examines (the dedup table's row estimate from the database's statistics), so
    /// how long one takes at `purge_rate`; `None` when the statistics have none yet.
    pub rows: Option<f64>,
}

/// How long `pipeline`'s dedup rows live, as `check` says it: at least `retention`; at most `retention` plus a
/// full pass and `purge_interval`, the pass being the longest of: the table's rows at `purge_rate` (a worker's paced
/// pass), the last pass recorded (which may be an unpaced `idemflow purge`), and the one under way.
pub fn lifetime_note(pipeline: &str, retention: Duration, purge_interval: Duration, purge_rate: u32, state: Option<&SweepState>) -> String {
    let d = crate::terminal::duration;
    let state = state.copied().unwrap_or_default();
    let paced = state.rows.filter(|r| *r > 0.0).map(|rows| rows / f64::from(purge_rate.max(1)));
    let pass = [paced, state.last_pass_seconds, state.current_pass_seconds].into_iter().flatten().reduce(f64::max);
    let Some(pass) = pass else {
        return format!(
            "pipeline {pipeline:?}: dedup rows live at least {} (the most is the retention plus a full pass of the retention \
             sweep and purge_interval, {}; the table has no row estimate and no pass yet)",
            d(retention),
            d(purge_interval)
        );
    };
    let pass = Duration::from_secs(pass.max(1.0).ceil() as u64);
    format!(
        "pipeline {pipeline:?}: dedup rows live at least {} and at most {} (the retention, plus a full pass of the retention \
         sweep, about {}{}, and purge_interval, {}; a pass more for a row an update moved behind the sweep; {} passes so far)",
        d(retention),
        d(retention + pass + purge_interval),
        d(pass),
        paced.map_or(String::new(), |_| format!(" for about {} rows at purge_rate {purge_rate}/s", state.rows.unwrap_or_default().round() as u64)),
        d(purge_interval),
        state.passes
    )
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
    fn the_lifetime_is_the_retention_plus_the_longest_pass_and_the_interval() {
        let (day, minute) = (Duration::from_secs(24 * 3600), Duration::from_secs(60));
        let state = |rows: Option<f64>, last: Option<f64>, current: Option<f64>| SweepState {
            passes: 3,
            last_pass_seconds: last,
            current_pass_seconds: current,
            rows,
        };
        // 3 million rows at 5,000 a second: a paced pass of 10 minutes, longer than an unpaced one by hand.
        let note = lifetime_note("p", day, minute, 5000, Some(&state(Some(3e6), Some(4.0), None)));
        assert!(note.contains("live at least 1d and at most 1d 11m") && note.contains("about 10m for about 3000000 rows at purge_rate 5000/s"), "{note}");
        assert!(note.contains("3 passes"), "{note}");
        // A pass under way or recorded that took longer counts.
        let note = lifetime_note("p", day, minute, 5000, Some(&state(Some(3e6), Some(600.0), Some(1200.0))));
        assert!(note.contains("at most 1d 21m"), "{note}");
        let note = lifetime_note("p", day, minute, 5000, Some(&state(None, Some(90.0), None)));
        assert!(note.contains("at most 1d 2m 30s") && note.contains("about 1m 30s, and"), "{note}");
        let note = lifetime_note("p", day, minute, 5000, None);
        assert!(note.contains("live at least 1d (the most is") && note.contains("no row estimate and no pass yet"), "{note}");
    }

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
