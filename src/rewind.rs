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
//! With `[offsets] store = "database"`, the stored positions are rewound too ([`crate::offsets::reset`]), which
//! also fences any worker that still holds them.

use crate::config::{KafkaSettings, Pipeline};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
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
    move |source| RewindError::Kafka { what, source }
}

/// Plans the rewind of `pipeline`'s group to `target`: every partition of its topics, where the group is now and
/// where it will be. Blocking (Kafka metadata, watermarks, committed offsets, ListOffsets); `timeout` per request.
pub fn plan(kafka_settings: &KafkaSettings, pipeline: &Pipeline, target: Target, timeout: Duration) -> Result<Vec<Move>, RewindError> {
    let consumer: BaseConsumer =
        crate::source::consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let mut all = TopicPartitionList::new();
    for topic in &pipeline.topics {
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
    let mut moves = Vec::new();
    for e in all.elements() {
        let (topic, partition) = (e.topic(), e.partition());
        let (low, high) = consumer
            .fetch_watermarks(topic, partition, timeout)
            .map_err(kafka(format!("reading the watermarks of {topic}/{partition}")))?;
        let to = match &by_time {
            None => low,
            Some(found) => match found.find_partition(topic, partition).map(|f| f.offset()) {
                Some(Offset::Offset(o)) if o >= 0 => o.max(low),
                _ => high, // no record at or after the timestamp
            },
        };
        let from = match committed.find_partition(topic, partition).map(|c| c.offset()) {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        };
        moves.push(Move { topic: topic.to_owned(), partition, from, to, end: high }.backwards_only());
    }
    Ok(moves)
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
    let consumer: BaseConsumer =
        crate::source::consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let topics: Vec<&str> = pipeline.topics.iter().map(String::as_str).collect();
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
                return Err(RewindError::NoAssignment { group: pipeline.group_id.clone(), timeout });
            }
        };
        let mine = consumer.assignment().unwrap_or_default();
        let all_mine = moves.iter().all(|m| mine.find_partition(&m.topic, m.partition).is_some());
        if !all_mine {
            return Err(RewindError::GroupActive {
                group: pipeline.group_id.clone(),
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
