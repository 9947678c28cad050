//! What every broker's `idemflow rewind` shares: the target, each partition's (or queue's) move, and the rules
//! that keep a rewind from skipping a record never processed ([`reconcile`]): a position is never moved forward,
//! an impossible broker answer never moves it, and a partition without a committed position is never moved past
//! where the group's reset policy ([`Reset`]) would start it. The broker halves are
//! [`crate::source::kafka::rewind`] and [`crate::source::rocketmq::rewind`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};
/// Where to rewind to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The oldest record the broker still has in each partition (its log start offset).
    Earliest,
    /// The first record whose timestamp is at or after this instant (Kafka ListOffsets by timestamp); a
    /// partition with no such record moves to its end.
    Time(SystemTime),
}

impl std::str::FromStr for Target {
    type Err = String;

    /// `earliest`, or an RFC 3339 timestamp such as `2026-11-29T08:00:00Z`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "earliest" {
            return Ok(Target::Earliest);
        }
        humantime::parse_rfc3339_weak(s).map(Target::Time).map_err(|e| {
            format!("{s:?} is neither \"earliest\" nor an RFC 3339 timestamp like 2026-11-29T08:00:00Z ({e})")
        })
    }
}

/// Where the group starts a partition it has no committed position for: a Kafka consumer's `auto.offset.reset`
/// ([`crate::source::kafka::rewind::reset_policy`]); a RocketMQ group starts a queue without a consume offset at
/// its first message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reset {
    /// `earliest` (also `smallest`, `beginning`): at the partition's log start.
    Earliest,
    /// `latest` (also `largest`, `end`): at the partition's end when the consumer starts it.
    Latest,
    /// Any other value (`error`: the consumer raises an error rather than start the partition), or none: where
    /// the group would start is unknown. The value as configured.
    Other(Option<String>),
}

impl Reset {
    /// The policy of an `auto.offset.reset` value (librdkafka's names, in any case).
    pub fn parse(value: Option<&str>) -> Reset {
        match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            Some("earliest" | "smallest" | "beginning") => Reset::Earliest,
            Some("latest" | "largest" | "end") => Reset::Latest,
            _ => Reset::Other(value.map(str::to_owned)),
        }
    }
}

/// One partition's move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The group's committed offset before (`None`: nothing committed).
    pub from: Option<i64>,
    /// The new committed offset.
    pub to: i64,
    /// The partition's end offset (high watermark) when planned.
    pub end: i64,
}

impl Move {
    /// The move, never forward: a target past where the group is (a timestamp after its position) would skip
    /// records never processed, so such a partition stays where it is.
    pub fn backwards_only(mut self) -> Self {
        if let Some(from) = self.from {
            self.to = self.to.min(from);
        }
        self
    }

    /// How many records will be consumed again (from `to` to where the group was, or to the end).
    pub fn replayed(&self) -> i64 {
        (self.from.unwrap_or(self.end).min(self.end) - self.to).max(0)
    }
}

/// What the broker answered for one partition, and what the group knows: the input of [`reconcile`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answers {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The log start offset the broker reported.
    pub low: i64,
    /// The high watermark the broker reported.
    pub high: i64,
    /// The group's position (committed offset, or the stored position): `None` when it has none.
    pub position: Option<i64>,
    /// For a timestamp target, the broker's ListOffsets answer: `Some(offset)`, or `None` for "no record at or
    /// after the timestamp". `None` here for [`Target::Earliest`].
    pub by_time: Option<Option<i64>>,
    /// For a timestamp target, the target in milliseconds since the Unix epoch.
    pub target_ms: Option<i64>,
    /// The timestamp (ms) of the record at the `by_time` offset, when it could be read.
    pub found_timestamp_ms: Option<i64>,
    /// Where the group starts the partition when `position` is `None`.
    pub reset: Reset,
}

/// The move of one partition from the broker's answers, never contradicting the group's position, and the
/// warnings for answers that are impossible (see the module documentation). A partition without a position is
/// never moved past where the group's reset policy would start it; `None` (with a warning saying why) when that
/// policy is unknown and the move would skip records: the partition is then left as it is.
pub fn reconcile(a: &Answers) -> (Option<Move>, Vec<String>) {
    let tp = format!("{}/{}", a.topic, a.partition);
    let mut warnings = Vec::new();
    let mut end = a.high;
    if let Some(position) = a.position.filter(|p| *p > a.high) {
        warnings.push(format!(
            "{tp}: the broker reported a high watermark of {} below the group's position {position}, which is \
             impossible; planning with {position} as the end",
            a.high
        ));
        end = position;
    }
    let stay = a.position.unwrap_or(end);
    let to = match (a.by_time, a.target_ms) {
        (Some(Some(found)), Some(target)) => match a.found_timestamp_ms {
            _ if found > end => {
                warnings.push(format!("{tp}: the broker answered offset {found} for the timestamp, past the end {end}: not moving this partition"));
                stay
            }
            Some(ts) if ts < target => {
                warnings.push(format!(
                    "{tp}: the broker answered offset {found} for the timestamp, but that record's timestamp ({}) is \
                     before it: the answer is impossible; not moving this partition",
                    rfc3339_ms(ts)
                ));
                stay
            }
            _ => found.max(a.low),
        },
        (Some(_), _) => end, // no record at or after the timestamp
        (None, _) => a.low,
    };
    let mut m = Move { topic: a.topic.clone(), partition: a.partition, from: a.position, to, end }.backwards_only();
    if a.position.is_some() || m.to <= a.low {
        // Where the group is, or a partition moved to its log start: nothing is skipped whatever the policy.
        return (Some(m), warnings);
    }
    match &a.reset {
        Reset::Earliest => {
            warnings.push(format!(
                "{tp}: the group has no committed position here, and auto.offset.reset = earliest starts it at its \
                 log start {low}: moving it there, not to {to}, which would skip {skipped} record(s) never consumed \
                 (a partition is never moved forward)",
                low = a.low,
                to = m.to,
                skipped = m.to.min(end) - a.low,
            ));
            m.to = a.low;
            (Some(m), warnings)
        }
        // The group would start at the end: a move to it or before it skips nothing.
        Reset::Latest => {
            if m.to < end {
                warnings.push(format!(
                    "{tp}: the group has no committed position here, and auto.offset.reset = latest would start it at \
                     its end: from offset {}, {} record(s) the group never consumed will be consumed",
                    m.to,
                    end - m.to
                ));
            }
            (Some(m), warnings)
        }
        Reset::Other(value) => {
            let value = value.as_deref().map_or_else(|| "(not set)".to_owned(), |v| format!("{v:?}"));
            warnings.push(format!(
                "{tp}: not moved: the group has no committed position here, and auto.offset.reset = {value} does not \
                 say where the group would start it, so a move to offset {} could skip records never consumed; \
                 rewind to earliest, or commit a position for it first",
                m.to
            ));
            (None, warnings)
        }
    }
}

/// `ms` since the Unix epoch as an RFC 3339 UTC timestamp with milliseconds.
pub fn rfc3339_ms(ms: i64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)).to_string()
}

/// A rewind's plan: each partition's move, and warnings about the broker's answers and the dedup retention.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// One move per partition of the pipeline's topics.
    pub moves: Vec<Move>,
    /// Corrections of impossible broker answers, and replays that reach records older than the dedup retention.
    pub warnings: Vec<String>,
}

/// The store's side of a rewind: the pipeline's store, whose processed marks' floors are lowered to where the group
/// moves ([`crate::store::Store::lower_floors`]: without that, the worker would skip the replayed records it had
/// processed before, as after a consumer group's offsets expired), and with `[offsets] store = "database"`
/// (`positions`) whose stored positions are the ones planned from and rewound.
#[derive(Clone, Copy, Debug)]
pub struct StoreSide<'a> {
    /// The pipeline's store.
    pub store: &'a crate::store::Store,
    /// Whether it keeps the consumed positions (`[offsets] store = "database"`).
    pub positions: bool,
}

impl<'a> StoreSide<'a> {
    /// The store when it keeps the positions.
    pub fn positions(&self) -> Option<&'a crate::store::Store> {
        self.positions.then_some(self.store)
    }

    /// Rewinds the store's side to `moves`: the stored positions (when it keeps them), then the floors.
    ///
    /// Errors: the store's.
    pub async fn rewind(&self, pipeline: &str, moves: &[Move]) -> Result<(), crate::store::StoreError> {
        let positions: Vec<(String, i32, i64)> = moves.iter().map(|m| (m.topic.clone(), m.partition, m.to)).collect();
        if self.positions {
            self.store.reset_offsets(pipeline, &positions).await?;
        }
        self.store.lower_floors(pipeline, &positions).await?;
        Ok(())
    }
}

/// What `idemflow rewind` was asked.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// Where to.
    pub to: Target,
    /// Print the plan and whether a real run would go ahead; change nothing.
    pub dry_run: bool,
    /// How long to wait for each broker request (and, on Kafka, for the group's assignment).
    pub timeout: Duration,
}

/// Prints a plan, whatever the broker: the group, then one line per partition (`unit` = "partition") or queue
/// ("queue") with where it is, where it goes, its end and how many records it replays, then the plan's warnings.
/// Returns how many records the plan replays.
pub fn print_plan(pipeline: &str, group: &str, stored: bool, unit: &str, width: usize, moves: &[Move], warnings: &[String]) -> i64 {
    println!("pipeline {pipeline:?}, consumer group {group:?}{}", if stored { ", stored positions too" } else { "" });
    println!("{unit:<width$} {:>12} {:>12} {:>12} {:>12}", "from", "to", "end", "replayed");
    for m in moves {
        let from = m.from.map_or("-".to_owned(), |o| o.to_string());
        let at = format!("{}/{}", m.topic, m.partition);
        println!("{at:<width$} {from:>12} {:>12} {:>12} {:>12}", m.to, m.end, m.replayed());
    }
    for w in warnings {
        println!("warning: {w}");
    }
    moves.iter().map(Move::replayed).sum()
}

/// The last line of a rewind that went ahead.
pub fn print_rewound(total: i64) {
    println!(
        "rewound: {total} record(s) will be consumed again when the workers start; those already applied are skipped as duplicates (idemflow_duplicates_skipped_total)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!("earliest".parse::<Target>(), Ok(Target::Earliest));
        let t: Target = "2026-11-29T08:00:00Z".parse().unwrap();
        assert_eq!(t, Target::Time(UNIX_EPOCH + Duration::from_secs(1_795_939_200)));
        let e = "yesterday".parse::<Target>().unwrap_err();
        assert!(e.contains("neither \"earliest\" nor an RFC 3339 timestamp"), "{e}");
    }

    fn answers(low: i64, high: i64, position: Option<i64>) -> Answers {
        Answers {
            topic: "t".into(),
            partition: 0,
            low,
            high,
            position,
            by_time: None,
            target_ms: None,
            found_timestamp_ms: None,
            reset: Reset::Earliest,
        }
    }

    /// `reconcile`'s move, which these answers always give.
    fn moved(a: &Answers) -> (Move, Vec<String>) {
        let (m, warnings) = reconcile(a);
        (m.expect("a move"), warnings)
    }

    #[test]
    fn an_under_reported_high_watermark_never_shrinks_the_replay() {
        // A broker that reports 1,292 as the end while the group is at 2,110 (seen on a Kafka-compatible broker).
        let (m, warnings) = moved(&answers(0, 1292, Some(2110)));
        assert_eq!((m.to, m.end, m.replayed()), (0, 2110, 2110));
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("high watermark of 1292 below the group's position 2110"), "{warnings:?}");
        let (m, warnings) = moved(&answers(0, 2110, Some(2110)));
        assert_eq!((m.end, m.replayed(), warnings.len()), (2110, 2110, 0));
    }

    #[test]
    fn an_impossible_timestamp_answer_does_not_move_the_partition() {
        // A timestamp after every record resolved to offset 0, whose record is older than the target.
        let target = 1_795_939_200_000;
        let a = Answers { by_time: Some(Some(0)), target_ms: Some(target), found_timestamp_ms: Some(target - 3_600_000), ..answers(0, 500, Some(500)) };
        let (m, warnings) = moved(&a);
        assert_eq!((m.to, m.replayed()), (500, 0));
        assert!(warnings[0].contains("that record's timestamp (2026-11-29T07:00:00.000Z) is before it"), "{warnings:?}");
        // A consistent answer moves it.
        let a = Answers { by_time: Some(Some(120)), target_ms: Some(target), found_timestamp_ms: Some(target + 5), ..answers(0, 500, Some(500)) };
        let (m, warnings) = moved(&a);
        assert_eq!((m.to, m.replayed(), warnings.len()), (120, 380, 0));
        // An offset past the end is impossible too; "no record at or after" means the end.
        let a = Answers { by_time: Some(Some(900)), target_ms: Some(target), ..answers(0, 500, Some(500)) };
        assert_eq!(moved(&a).0.to, 500);
        let a = Answers { by_time: Some(None), target_ms: Some(target), ..answers(0, 500, Some(400)) };
        assert_eq!(reconcile(&a), (Some(Move { topic: "t".into(), partition: 0, from: Some(400), to: 400, end: 500 }), vec![]));
    }

    #[test]
    fn reset_policies_parse() {
        assert_eq!(Reset::parse(Some("earliest")), Reset::Earliest);
        assert_eq!(Reset::parse(Some("smallest")), Reset::Earliest);
        assert_eq!(Reset::parse(Some("Beginning")), Reset::Earliest);
        assert_eq!(Reset::parse(Some("latest")), Reset::Latest);
        assert_eq!(Reset::parse(Some("largest")), Reset::Latest);
        assert_eq!(Reset::parse(Some("end")), Reset::Latest);
        assert_eq!(Reset::parse(Some("error")), Reset::Other(Some("error".into())));
        assert_eq!(Reset::parse(None), Reset::Other(None));
    }

    /// A partition the group never committed (10 records at offsets 0..10): a timestamp after its records
    /// (ListOffsets: no record at or after it) must not move it to its end, which would skip all 10.
    #[test]
    fn a_partition_without_a_position_is_never_moved_past_where_the_group_would_start_it() {
        let target = 1_795_939_200_000;
        let after = |reset| Answers { by_time: Some(None), target_ms: Some(target), reset, ..answers(0, 10, None) };
        // earliest (idemflow's default): its log start, with a warning.
        let (m, warnings) = reconcile(&after(Reset::Earliest));
        assert_eq!(m, Some(Move { topic: "t".into(), partition: 0, from: None, to: 0, end: 10 }));
        assert_eq!(m.unwrap().replayed(), 10);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("t/0: the group has no committed position here, and auto.offset.reset = earliest"), "{warnings:?}");
        assert!(warnings[0].contains("log start 0: moving it there, not to 10, which would skip 10 record(s)"), "{warnings:?}");
        // A log start above 0 (records deleted): there, never below it.
        let a = Answers { by_time: Some(Some(7)), target_ms: Some(target), found_timestamp_ms: Some(target + 1), ..answers(4, 10, None) };
        let (m, warnings) = moved(&a);
        assert_eq!((m.to, m.replayed()), (4, 6));
        assert!(warnings[0].contains("log start 4: moving it there, not to 7, which would skip 3 record(s)"), "{warnings:?}");
        // An impossible answer leaves a partition "where it is": for one without a position, where the group would
        // start it.
        let a = Answers { by_time: Some(Some(90)), target_ms: Some(target), ..answers(0, 10, None) };
        assert_eq!(moved(&a).0.to, 0);
        // latest: the group would start at the end, so the target (or the end) skips nothing.
        let (m, warnings) = moved(&after(Reset::Latest));
        assert_eq!((m.to, m.replayed(), warnings.len()), (10, 0, 0));
        let a = Answers { by_time: Some(Some(3)), target_ms: Some(target), found_timestamp_ms: Some(target), reset: Reset::Latest, ..answers(0, 10, None) };
        let (m, warnings) = moved(&a);
        assert_eq!((m.to, m.replayed()), (3, 7));
        assert!(warnings[0].contains("auto.offset.reset = latest would start it at its end"), "{warnings:?}");
        // Unknown (error): left out, with the reason; earliest skips nothing whatever the policy, so it goes ahead.
        let (m, warnings) = reconcile(&after(Reset::Other(Some("error".into()))));
        assert_eq!(m, None);
        assert!(warnings[0].starts_with("t/0: not moved: the group has no committed position here, and auto.offset.reset = \"error\""), "{warnings:?}");
        let a = Answers { reset: Reset::Other(Some("error".into())), ..answers(0, 10, None) };
        assert_eq!(reconcile(&a), (Some(Move { topic: "t".into(), partition: 0, from: None, to: 0, end: 10 }), vec![]));
        // A partition with a position is unchanged by the policy.
        let a = Answers { by_time: Some(None), target_ms: Some(target), reset: Reset::Other(None), ..answers(0, 10, Some(6)) };
        assert_eq!(reconcile(&a), (Some(Move { topic: "t".into(), partition: 0, from: Some(6), to: 6, end: 10 }), vec![]));
    }

    #[test]
    fn replayed_counts_from_the_target_to_where_the_group_was() {
        let m = |from, to, end| Move { topic: "t".into(), partition: 0, from, to, end };
        assert_eq!(m(Some(100), 0, 120).replayed(), 100);
        assert_eq!(m(None, 0, 120).replayed(), 120);
        assert_eq!(m(Some(100), 150, 160).replayed(), 0);
        assert_eq!(m(Some(100), 150, 160).backwards_only().to, 100, "never forward");
        assert_eq!(m(Some(100), 20, 160).backwards_only().to, 20);
        assert_eq!(m(None, 150, 160).backwards_only().to, 150);
    }
}
