//! `idemflow rewind`: move a pipeline's consumer group back, so its topics are consumed again from an earlier
//! point. The dedup rows make the replay harmless: every replayed record whose key is still in the dedup store is
//! skipped and counted as a duplicate; nothing is applied twice.
//!
//! The group's offsets are changed the way Kafka allows for a group: by a member of it (the mock cluster, like
//! a broker's group coordinator, rejects an `OffsetCommit` from a client that is not a member of an existing
//! group). This command joins the group, and goes on only if the group coordinator assigns it *every* partition
//! of the pipeline's topics: a partition held by another member means a worker is still running, and the rewind
//! is refused. (A member holding no partition, a standby replica, is not seen; it would start from the new
//! offsets when it gets partitions.) It then commits the new offsets and leaves the group. A partition is never
//! moved forward: that would skip records never processed.
//!
//! With `[offsets] store = "database"`, the stored positions are rewound too ([`crate::store::Store::reset_offsets`]), which
//! also fences any worker that still holds them.
//!
//! Before joining, the group is described (Kafka DescribeGroups): a group with members is refused at once, without
//! the join that would force a rebalance on the running workers. Brokers that do not answer DescribeGroups (the
//! librdkafka mock cluster) fall back to the join test above.
//!
//! The plan never contradicts what the group knows: a high watermark below the group's committed offset is
//! impossible and the committed offset counts as the end; a timestamp look-up is checked against the record it
//! points at (Kafka's ListOffsets answers the earliest offset whose timestamp is at or after the target), and a
//! partition with an impossible answer stays where it is. Each such correction is a warning of the plan.

use crate::config::{KafkaSettings, Pipeline};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Message, Offset, TopicPartitionList};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// Why a rewind did not happen.
#[derive(Debug, thiserror::Error)]
pub enum RewindError {
    /// A Kafka request failed.
    #[error("{what}: {source}")]
    Kafka {
        /// What was being done.
        what: String,
        /// The client error.
        source: KafkaError,
    },
    /// A topic does not exist.
    #[error("topic {0:?} does not exist")]
    NoTopic(String),
    /// The group has members, as the broker describes it (checked before joining).
    #[error(
        "consumer group {group:?} has {members} active member(s): stop every worker of pipeline {pipeline:?} first \
         (nothing was changed, and the group was not joined)"
    )]
    MembersActive {
        /// The group.
        group: String,
        /// The pipeline.
        pipeline: String,
        /// Members the broker reported.
        members: usize,
    },
    /// Other members hold partitions of the group.
    #[error(
        "consumer group {group:?} has other active members (this rewind was assigned {got} of {total} partitions): \
         stop every worker of pipeline {pipeline:?} first"
    )]
    GroupActive {
        /// The group.
        group: String,
        /// The pipeline.
        pipeline: String,
        /// Partitions assigned to the rewind.
        got: usize,
        /// Partitions of the pipeline's topics.
        total: usize,
    },
    /// The database side of the rewind failed; nothing was committed to Kafka.
    #[error("rewinding the stored positions: {0}; the group's offsets were not changed")]
    Database(String),
    /// The group coordinator assigned nothing in time.
    #[error("consumer group {group:?}: no partitions were assigned within {timeout:?}")]
    NoAssignment {
        /// The group.
        group: String,
        /// How long it waited.
        timeout: Duration,
    },
}

fn kafka(what: impl Into<String>) -> impl FnOnce(KafkaError) -> RewindError {
    let what = what.into();
    move |source| RewindError::Kafka { what, source: crate::source::kafka::hide_config_value(source) }
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
}

/// The move of one partition from the broker's answers, never contradicting the group's position, and the
/// warnings for answers that are impossible (see the module documentation).
pub fn reconcile(a: &Answers) -> (Move, Vec<String>) {
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
                    crate::rewind::rfc3339_ms(ts)
                ));
                stay
            }
            _ => found.max(a.low),
        },
        (Some(_), _) => end, // no record at or after the timestamp
        (None, _) => a.low,
    };
    (Move { topic: a.topic.clone(), partition: a.partition, from: a.position, to, end }.backwards_only(), warnings)
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

/// Whether the group has members now, from Kafka's DescribeGroups, without joining it: `Some(members)` when the
/// broker answered, `None` when it could not tell (the broker does not support the request, or did not answer
/// within `timeout`).
pub fn active_members(kafka_settings: &KafkaSettings, pipeline: &Pipeline, timeout: Duration) -> Option<usize> {
    let consumer: BaseConsumer = crate::source::kafka::consumer_config(kafka_settings, pipeline).create().ok()?;
    let groups = consumer.fetch_group_list(Some(&crate::source::kafka::spec(pipeline).group_id), timeout).ok()?;
    let group = groups.groups().iter().find(|g| g.name() == crate::source::kafka::spec(pipeline).group_id)?;
    Some(if group.state() == "Dead" { 0 } else { group.members().len() })
}

/// The timestamp (ms) of the record at `offset` of a partition, read with an assigned (not subscribed) consumer:
/// `None` if no record came within `timeout`.
fn record_timestamp(consumer: &BaseConsumer, topic: &str, partition: i32, offset: i64, timeout: Duration) -> Option<i64> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset)).ok()?;
    consumer.assign(&tpl).ok()?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            if m.topic() == topic && m.partition() == partition && m.offset() >= offset {
                return m.timestamp().to_millis();
            }
        }
    }
    None
}

/// Plans the rewind of `pipeline`'s group to `target`: every partition of its topics, where the group is now
/// (`positions` overrides the committed offsets: the stored positions of `[offsets] store = "database"`) and where
/// it will be. Warns about impossible broker answers ([`reconcile`]) and about replays that start at records older
/// than the pipeline's dedup retention (their dedup rows may have been purged, so those operations would be
/// applied again). Blocking (Kafka metadata, watermarks, committed offsets, ListOffsets, reading the first record
/// to replay of each partition); `timeout` per request.
pub fn plan(
    kafka_settings: &KafkaSettings,
    pipeline: &Pipeline,
    target: Target,
    positions: Option<&[(String, i32, Option<i64>)]>,
    timeout: Duration,
) -> Result<Plan, RewindError> {
    let consumer: BaseConsumer =
        crate::source::kafka::consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let mut all = TopicPartitionList::new();
    for topic in &crate::source::kafka::spec(pipeline).topics {
        let md = consumer.fetch_metadata(Some(topic), timeout).map_err(kafka(format!("reading metadata of {topic:?}")))?;
        let t = md.topics().iter().find(|t| t.name() == topic).ok_or_else(|| RewindError::NoTopic(topic.clone()))?;
        if t.error().is_some() || t.partitions().is_empty() {
            return Err(RewindError::NoTopic(topic.clone()));
        }
        for p in t.partitions() {
            all.add_partition(topic, p.id());
        }
    }
    let committed = consumer.committed_offsets(all.clone(), timeout).map_err(kafka("reading the committed offsets"))?;
    let by_time = match target {
        Target::Earliest => None,
        Target::Time(at) => {
            let ms = at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as i64;
            let mut query = TopicPartitionList::new();
            for e in all.elements() {
                let _ = query.add_partition_offset(e.topic(), e.partition(), Offset::Offset(ms));
            }
            Some(consumer.offsets_for_times(query, timeout).map_err(kafka("looking up offsets by timestamp"))?)
        }
    };
    let target_ms = match target {
        Target::Earliest => None,
        Target::Time(at) => Some(at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as i64),
    };
    let reader: BaseConsumer =
        crate::source::kafka::consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let mut plan = Plan::default();
    let oldest_kept = SystemTime::now().checked_sub(pipeline.dedup.retention).unwrap_or(UNIX_EPOCH);
    let oldest_kept_ms = oldest_kept.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as i64;
    for e in all.elements() {
        let (topic, partition) = (e.topic(), e.partition());
        let (low, high) = consumer
            .fetch_watermarks(topic, partition, timeout)
            .map_err(kafka(format!("reading the watermarks of {topic}/{partition}")))?;
        let position = match positions.and_then(|ps| ps.iter().find(|(t, p, _)| t == topic && *p == partition)) {
            Some((_, _, Some(next))) => Some(*next),
            _ => match committed.find_partition(topic, partition).map(|c| c.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            },
        };
        let found = by_time.as_ref().map(|found| match found.find_partition(topic, partition).map(|f| f.offset()) {
            Some(Offset::Offset(o)) if o >= 0 => Some(o),
            _ => None,
        });
        let found_timestamp_ms = match found {
            Some(Some(o)) if o < high.max(position.unwrap_or(high)) => record_timestamp(&reader, topic, partition, o, timeout),
            _ => None,
        };
        let answers = Answers { topic: topic.to_owned(), partition, low, high, position, by_time: found, target_ms, found_timestamp_ms };
        let (m, warnings) = reconcile(&answers);
        plan.warnings.extend(warnings);
        if m.replayed() > 0 {
            let first = if found == Some(Some(m.to)) { found_timestamp_ms } else { record_timestamp(&reader, topic, partition, m.to, timeout) };
            if let Some(ts) = first.filter(|ts| *ts < oldest_kept_ms) {
                plan.warnings.push(format!(
                    "{topic}/{partition}: the replay starts at a record from {} (offset {}), older than [dedup] retention = \
                     {}: dedup rows of operations that old may have been purged, and those would be applied again",
                    rfc3339_ms(ts),
                    m.to,
                    humantime::format_duration(pipeline.dedup.retention),
                ));
            }
        }
        plan.moves.push(m);
    }
    Ok(plan)
}

/// Joins `pipeline`'s consumer group, checks that it was assigned every partition of `moves` (no worker is
/// running), and runs `before_commit` (the database side of the rewind) and then commits `moves`' offsets as a
/// group member; leaves the group in any case. Blocking.
///
/// Errors: [`RewindError::GroupActive`] when other members hold partitions, [`RewindError::NoAssignment`] after
/// `timeout` with no assignment, Kafka errors, and [`RewindError::Database`] from `before_commit` (nothing is
/// committed to Kafka then).
pub fn apply(
    kafka_settings: &KafkaSettings,
    pipeline: &Pipeline,
    moves: &[Move],
    timeout: Duration,
    before_commit: impl FnOnce() -> Result<(), String>,
) -> Result<(), RewindError> {
    if let Some(members) = active_members(kafka_settings, pipeline, timeout).filter(|m| *m > 0) {
        return Err(RewindError::MembersActive { group: crate::source::kafka::spec(pipeline).group_id.clone(), pipeline: pipeline.name.clone(), members });
    }
    let consumer: BaseConsumer =
        crate::source::kafka::consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let topics: Vec<&str> = crate::source::kafka::spec(pipeline).topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topics).map_err(kafka("joining the consumer group"))?;
    let result = (|| {
        let deadline = Instant::now() + timeout;
        let assigned = loop {
            if let Some(msg) = consumer.poll(Duration::from_millis(100)) {
                // Records fetched meanwhile are ignored; errors too (they are retried by the client).
                drop(msg);
            }
            let got = consumer.assignment().map(|a| a.count()).unwrap_or(0);
            if got > 0 {
                break got;
            }
            if Instant::now() > deadline {
                return Err(RewindError::NoAssignment { group: crate::source::kafka::spec(pipeline).group_id.clone(), timeout });
            }
        };
        let mine = consumer.assignment().unwrap_or_default();
        let all_mine = moves.iter().all(|m| mine.find_partition(&m.topic, m.partition).is_some());
        if !all_mine {
            return Err(RewindError::GroupActive {
                group: crate::source::kafka::spec(pipeline).group_id.clone(),
                pipeline: pipeline.name.clone(),
                got: assigned,
                total: moves.len(),
            });
        }
        before_commit().map_err(RewindError::Database)?;
        let mut tpl = TopicPartitionList::new();
        for m in moves {
            let _ = tpl.add_partition_offset(&m.topic, m.partition, Offset::Offset(m.to));
        }
        consumer.commit(&tpl, CommitMode::Sync).map_err(kafka(
            "committing the new offsets (the database side, if any, was already rewound: run the rewind again)",
        ))
    })();
    consumer.unsubscribe();
    drop(consumer); // closes the consumer: it leaves the group
    result
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
        Answers { topic: "t".into(), partition: 0, low, high, position, by_time: None, target_ms: None, found_timestamp_ms: None }
    }

    #[test]
    fn an_under_reported_high_watermark_never_shrinks_the_replay() {
        // A broker that reports 1,292 as the end while the group is at 2,110 (seen on a Kafka-compatible broker).
        let (m, warnings) = reconcile(&answers(0, 1292, Some(2110)));
        assert_eq!((m.to, m.end, m.replayed()), (0, 2110, 2110));
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("high watermark of 1292 below the group's position 2110"), "{warnings:?}");
        let (m, warnings) = reconcile(&answers(0, 2110, Some(2110)));
        assert_eq!((m.end, m.replayed(), warnings.len()), (2110, 2110, 0));
    }

    #[test]
    fn an_impossible_timestamp_answer_does_not_move_the_partition() {
        // A timestamp after every record resolved to offset 0, whose record is older than the target.
        let target = 1_795_939_200_000;
        let a = Answers { by_time: Some(Some(0)), target_ms: Some(target), found_timestamp_ms: Some(target - 3_600_000), ..answers(0, 500, Some(500)) };
        let (m, warnings) = reconcile(&a);
        assert_eq!((m.to, m.replayed()), (500, 0));
        assert!(warnings[0].contains("that record's timestamp (2026-11-29T07:00:00.000Z) is before it"), "{warnings:?}");
        // A consistent answer moves it.
        let a = Answers { by_time: Some(Some(120)), target_ms: Some(target), found_timestamp_ms: Some(target + 5), ..answers(0, 500, Some(500)) };
        let (m, warnings) = reconcile(&a);
        assert_eq!((m.to, m.replayed(), warnings.len()), (120, 380, 0));
        // An offset past the end is impossible too; "no record at or after" means the end.
        let a = Answers { by_time: Some(Some(900)), target_ms: Some(target), ..answers(0, 500, Some(500)) };
        assert_eq!(reconcile(&a).0.to, 500);
        let a = Answers { by_time: Some(None), target_ms: Some(target), ..answers(0, 500, Some(400)) };
        assert_eq!(reconcile(&a), (Move { topic: "t".into(), partition: 0, from: Some(400), to: 400, end: 500 }, vec![]));
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
