//! Consumed positions: what to commit after a batch, and the positions stored in the database.
//!
//! Kafka's committed offset is the offset of the *next* record to consume (Kafka protocol, OffsetCommit; the
//! Java client's `commitSync` documentation). So after a batch, each partition's commit is the highest offset
//! processed in it plus one. This module is the only place that adds that one.
//!
//! With `[offsets] store = "database"` the same positions are also written to the store's offsets table inside
//! the batch's transaction ([`crate::store::Tx::advance_offsets`]), so the position and the effects commit or roll
//! back together. Ownership is fenced with an epoch per partition: a worker assigned a partition increments the
//! epoch ([`crate::store::Store::claim_offsets`]) and its batches update the row only while the epoch is still
//! theirs. The claim waits for the row lock of a previous owner's batch still in flight (PostgreSQL, "Explicit
//! Locking"; InnoDB, "Locking Reads"), so the new owner starts exactly where the last committed batch ended, and a
//! batch of the previous owner that comes after the claim finds the epoch changed and rolls back whole (the store
//! reports it fenced).

use serde::Deserialize;
use crate::record::Record;
use std::collections::BTreeMap;
use std::sync::Arc;

/// For each `(topic, partition)` of a batch, the offset of the next record to consume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NextOffsets(pub BTreeMap<(Arc<str>, i32), i64>);

impl NextOffsets {
    /// The positions to commit once `records` (every record of a committed batch, dead letters and skipped
    /// duplicates included) are durable: per partition, the highest offset + 1. Records of sources without
    /// positions to commit (RabbitMQ, NATS JetStream: [`Record::delivered_before`] is set) are left out.
    pub fn after(records: &[Record]) -> Self {
        let mut next = BTreeMap::new();
        let mut raise = |p: &crate::record::Position, to: i64| {
            let e = next.entry((p.topic.clone(), p.partition)).or_insert(to);
            *e = (*e).max(to);
        };
        // A batch holds runs of records of one partition: each run is entered into the map once.
        let mut run: Option<(&crate::record::Position, i64)> = None;
        for r in records.iter().filter(|r| r.delivered_before.is_none()) {
            let p = &r.position;
            match &mut run {
                Some((q, to)) if q.same_partition(p) => *to = (*to).max(p.offset + 1),
                _ => {
                    if let Some((q, to)) = run.replace((p, p.offset + 1)) {
                        raise(q, to);
                    }
                }
            }
        }
        if let Some((q, to)) = run {
            raise(q, to);
        }
        NextOffsets(next)
    }
}

impl NextOffsets {
    /// Per partition, the lowest offset among `records` (records of sources without positions left out, as in
    /// [`NextOffsets::after`]): where a batch starts on each partition.
    pub fn first_of(records: &[Record]) -> Self {
        let mut first = BTreeMap::new();
        // A batch holds runs of records of one partition: each run is entered into the map once.
        for run in records.chunk_by(|a, b| a.position.same_partition(&b.position)) {
            let Some(low) = run.iter().filter(|r| r.delivered_before.is_none()).map(|r| r.position.offset).min() else { continue };
            let e = first.entry((run[0].position.topic.clone(), run[0].position.partition)).or_insert(low);
            *e = (*e).min(low);
        }
        NextOffsets(first)
    }
}

/// A partition's processed floor that a committed batch ended below ([`crate::sink::BatchOutcome::floors`]): the
/// records from the batch's end up to the floor were processed before, unless the partition holds records below the
/// floor produced after the mark was last raised (`raised_at_ms`), which the source asks its broker first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassedFloor {
    /// Topic.
    pub topic: Arc<str>,
    /// Partition.
    pub partition: i32,
    /// The floor ([`Mark::floor`]).
    pub floor: i64,
    /// When the mark was last raised ([`Mark::raised_at_ms`]).
    pub raised_at_ms: Option<i64>,
}

/// A partition's stored position after [`crate::store::Store::claim_offsets`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The offset of the next record to consume; `None` if no batch of this pipeline has stored one yet (the
    /// consumer group's committed offset, or `auto.offset.reset`, applies then).
    pub next_offset: Option<i64>,
    /// The epoch the claimant now holds; its batches must present it to [`crate::store::Tx::advance_offsets`].
    pub epoch: i64,
    /// When the stored position was last written (by the batch that committed up to it), in milliseconds since the
    /// Unix epoch on the store's clock; `None` where nothing was stored, or where the store does not say (Redis).
    /// A record below the position produced after this time is not one the pipeline processed there: the topic was
    /// deleted and created again, and the position is the old topic's (see the Kafka source's start).
    pub stored_at_ms: Option<i64>,
    /// The identity of the log the partition's processed mark was last raised on ([`Mark::log`]), where the store
    /// keeps one: another identity from the broker now says the stored position is an old topic's.
    pub log: Option<String>,
}

/// The positions a batch stores, with the epoch its worker holds for each partition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Positions(pub Vec<(Arc<str>, i32, i64, i64)>);

impl Positions {
    /// `(topic, partition, next offset, epoch)` for each partition of `next`, with its epoch from `epoch_of`.
    /// A partition without one gets epoch -1, which no row holds, so the store reports it fenced.
    pub fn new(next: &NextOffsets, epoch_of: impl Fn(&Arc<str>, i32) -> Option<i64>) -> Self {
        Positions(next.0.iter().map(|((t, p), o)| (t.clone(), *p, *o, epoch_of(t, *p).unwrap_or(-1))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Position;

    fn rec(topic: &str, partition: i32, offset: i64) -> Record {
        Record {
            position: Position { topic: topic.into(), partition, offset },
            timestamp_ms: None,
            key: None,
            headers: vec![],
            payload: None,
            oversized: None,
            properties: Vec::new(),
            delivered_before: None,
            receipt: crate::record::Receipt::NONE,
        }
    }

    /// A record below the floor is processed, whatever its timestamp says; at or above the floor, or where the store
    /// keeps no floor, it is new.
    #[test]
    fn a_record_below_the_floor_was_processed_whatever_its_timestamp() {
        let at = |offset: i64, ts: Option<i64>| Record { timestamp_ms: ts, ..rec("t", 0, offset) };
        let mark = Mark { next: 100, floor: Some(80), raised_at_ms: Some(5_000), log: None };
        let mut processed = Processed([(("t".into(), 0), mark)].into_iter().collect());
        assert_eq!(processed.replay(&at(79, Some(4_000))), Replay::Processed);
        assert_eq!(processed.replay(&at(79, None)), Replay::Processed, "no timestamp: processed");
        assert_eq!(processed.replay(&at(0, Some(5_001))), Replay::Processed, "stamped ahead: processed all the same");
        assert_eq!(processed.replay(&at(80, Some(1))), Replay::New, "at the floor: a rewind's replay");
        assert_eq!(processed.replay(&at(95, Some(1))), Replay::New);
        assert!(processed.before(&at(95, None).position), "still a redelivery by its position");
        assert_eq!(processed.replay(&rec("t", 1, 0)), Replay::New, "another partition: no mark");
        processed.0.insert(("t".into(), 1), Mark { next: 10, floor: None, raised_at_ms: None, log: None });
        assert_eq!(processed.replay(&rec("t", 1, 0)), Replay::New, "no floor kept (Redis)");
    }

    /// A partition's marks are renewed (at the batch's first offset) on evidence about its log only: another
    /// identity, or a log ending below the mark whatever the identities say; never for the same identity and a log
    /// reaching the mark.
    #[test]
    fn marks_are_renewed_only_on_evidence_about_the_log() {
        let id = |s: &str| Some(Arc::<str>::from(s));
        let mark = |log: Option<Arc<str>>| Mark { next: 100, floor: Some(100), raised_at_ms: Some(5_000), log };
        let first = NextOffsets([(("t".into(), 0), 0)].into_iter().collect());
        let judge = |m: Mark, log: Log| {
            let processed = Processed([(("t".into(), 0), m)].into_iter().collect());
            processed.renewals(&first, &Logs([(("t".into(), 0), log)].into_iter().collect())).into_iter().map(|r| (r.next, r.change)).collect::<Vec<_>>()
        };
        let log = |i: Option<Arc<str>>, end: Option<i64>| Log { id: i, end };
        assert_eq!(judge(mark(id("A")), log(id("A"), Some(500))), vec![], "the same log");
        assert_eq!(judge(mark(id("A")), log(id("B"), Some(500))), vec![(0, LogChange::Another { was: "A".into(), now: "B".into() })]);
        assert_eq!(judge(mark(id("A")), log(id("A"), Some(40))), vec![(0, LogChange::Shorter { end: 40 })], "truncated");
        assert_eq!(judge(mark(None), log(id("A"), Some(40))), vec![(0, LogChange::Shorter { end: 40 })], "no identity stored yet");
        assert_eq!(judge(mark(id("A")), log(None, Some(40))), vec![(0, LogChange::Shorter { end: 40 })], "the broker gives none");
        assert_eq!(judge(mark(None), log(None, Some(500))), vec![], "nothing says the log changed");
        assert_eq!(judge(mark(None), log(None, None)), vec![], "the broker says nothing");
        let redis = Mark { floor: None, ..mark(id("A")) };
        assert_eq!(judge(redis, log(id("B"), Some(1))), vec![], "no floor kept: nothing to renew");
    }

    #[test]
    fn next_offset_is_highest_plus_one_per_partition() {
        let n = NextOffsets::after(&[rec("a", 0, 5), rec("a", 1, 2), rec("a", 0, 7), rec("b", 0, 0)]);
        let got: Vec<_> = n.0.iter().map(|((t, p), o)| (t.to_string(), *p, *o)).collect();
        assert_eq!(got, vec![("a".into(), 0, 8), ("a".into(), 1, 3), ("b".into(), 0, 1)]);
    }
}

/// Per partition, what this pipeline had processed before the batch (`idemflow.processed`): see [`Mark`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Processed(pub std::collections::HashMap<(Arc<str>, i32), Mark>);

/// What a pipeline had processed of one partition before a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    /// One past the highest offset whose batch committed. A record below it was processed before: it is a
    /// redelivery (counted `redelivered`), whatever its dedup row says.
    pub next: i64,
    /// Where the pipeline may consume the partition from again without an operator's `idemflow rewind`: the mark
    /// itself, or lower after a rewind, raised again by the batches of the replay. A record below it that comes
    /// back (the consumer group's offsets expired, a new `group_id`, `auto.offset.reset` to the log start) is not
    /// claimed nor applied again, even when its dedup row was purged: it was processed, and only an operator's
    /// rewind asks for it again. `None` where the store keeps no floor (Redis, whose stored positions are where
    /// the consumer starts).
    pub floor: Option<i64>,
    /// When a batch last raised the mark, in milliseconds since the Unix epoch on the store's clock; `None` where
    /// the store does not say. Only said in the log: a record's timestamp (the producer's clock, or a business
    /// time) never decides whether it was processed.
    pub raised_at_ms: Option<i64>,
    /// The identity of the log the mark was raised on, as its source named it ([`Log::id`]: a Kafka topic id, a
    /// JetStream stream's creation time); `None` where the source does not say, or for a mark from before
    /// PostgreSQL migration 14 / MySQL migration 7 until a batch raises it.
    pub log: Option<Arc<str>>,
}

/// What a broker says of one partition's log beside a batch ([`crate::source::contract::Connector::logs`]): the
/// evidence, about the log itself, that decides whether a partition's processed marks belong to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Log {
    /// The log's identity, which a log deleted and created again under the same name does not keep: Kafka's topic id
    /// (KIP-516, brokers from 2.8; base64 as Kafka's tools print it), a JetStream stream's creation time. `None`
    /// where the broker does not say (Kafka before 2.8, RocketMQ).
    pub id: Option<Arc<str>>,
    /// One past the log's last offset as the broker last said (Kafka's high watermark, from the fetch responses).
    /// A log of the same identity never ends below what was processed of it, unless it was truncated.
    pub end: Option<i64>,
}

/// [`Log`] per `(topic, partition)` of a batch; a partition the source says nothing of is missing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Logs(pub std::collections::HashMap<(Arc<str>, i32), Log>);

/// Why a partition's processed marks are not the log's any more ([`Processed::renewals`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogChange {
    /// The broker names another log than the one the marks were raised on: the topic was deleted and created again.
    Another {
        /// The identity the marks were raised on.
        was: Arc<str>,
        /// The identity the broker names now.
        now: Arc<str>,
    },
    /// The log ends below the mark: the topic was deleted and created again, or its log truncated (an unclean
    /// leader election lost its last records). Both are renewed at the batch's first offset: its records are
    /// claimed as new, and their dedup rows decide (a truncated log's last records were processed recently, so
    /// their rows are still kept); a stale identity (the broker's answer a few seconds old) cannot make a topic
    /// created again look truncated and skip its records.
    Shorter {
        /// Where the log ends now ([`Log::end`]).
        end: i64,
    },
}

/// A partition whose marks are set afresh in the batch's transaction ([`Processed::renewals`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Renewal {
    /// Topic.
    pub topic: Arc<str>,
    /// Partition.
    pub partition: i32,
    /// The new mark and floor: the batch's first offset of the partition (every record of it from there is claimed
    /// as new).
    pub next: i64,
    /// The identity the marks are raised on from now ([`Log::id`]).
    pub log: Option<Arc<str>>,
    /// Why.
    pub change: LogChange,
}

/// What a record's position says about it, against its partition's [`Mark`] ([`Processed::replay`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replay {
    /// At or above the floor (or no mark): claimed and applied if its key is new.
    New,
    /// Below the floor: processed before; skipped as `redelivered`, neither claimed nor applied. (A partition whose
    /// log is not the one its marks were raised on had its marks renewed first: [`Processed::renewals`].)
    Processed,
}

impl Processed {
    /// Whether the record at `position` was processed by an earlier batch.
    pub fn before(&self, position: &crate::record::Position) -> bool {
        self.0.get(&(position.topic.clone(), position.partition)).is_some_and(|m| position.offset < m.next)
    }

    /// Where `record` stands against its partition's mark (see [`Replay`]).
    pub fn replay(&self, record: &Record) -> Replay {
        let p = &record.position;
        let Some(mark) = self.0.get(&(p.topic.clone(), p.partition)) else { return Replay::New };
        match mark.floor {
            Some(floor) if p.offset < floor => Replay::Processed,
            _ => Replay::New,
        }
    }

    /// The partitions whose marks were raised on another log than the one the batch comes from, judged on evidence
    /// about the log itself (`logs`), never on the records' timestamps: the broker names another identity than the
    /// mark's ([`LogChange::Another`]), or the log ends below the mark ([`LogChange::Shorter`]); either is renewed
    /// at the batch's first offset of the partition (`first`). Only partitions with a floor (PostgreSQL,
    /// MySQL/MariaDB) and with a first offset in `first` are judged.
    pub fn renewals(&self, first: &NextOffsets, logs: &Logs) -> Vec<Renewal> {
        let mut out = Vec::new();
        for ((topic, partition), at) in &first.0 {
            let key = (topic.clone(), *partition);
            let (Some(mark), Some(log)) = (self.0.get(&key), logs.0.get(&key)) else { continue };
            if mark.floor.is_none() {
                continue;
            }
            let shorter = log.end.filter(|end| *end < mark.next);
            let change = match (&mark.log, &log.id, shorter) {
                (Some(was), Some(now), _) if was != now => LogChange::Another { was: was.clone(), now: now.clone() },
                (_, _, Some(end)) => LogChange::Shorter { end },
                _ => continue,
            };
            out.push(Renewal { topic: topic.clone(), partition: *partition, next: *at, log: log.id.clone(), change });
        }
        out
    }

    /// Sets the marks of `renewed` afresh (as [`crate::store::Tx::renew_processed`] stores them).
    pub fn renew(&mut self, renewed: &[Renewal]) {
        for r in renewed {
            if let Some(mark) = self.0.get_mut(&(r.topic.clone(), r.partition)) {
                *mark = Mark { next: r.next, floor: Some(r.next), raised_at_ms: None, log: r.log.clone() };
            }
        }
    }
}

/// `[offsets] store`: where a pipeline keeps the consumed position of each partition.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OffsetStore {
    /// The consumer group's committed offsets in the broker (Kafka, or a RocketMQ broker's consumer offsets),
    /// committed after each batch's transaction. A crash between the two redelivers that batch, and its records
    /// are skipped as `redelivered` duplicates. Written `"broker"` or `"kafka"`.
    #[default]
    #[serde(alias = "kafka")]
    Broker,
    /// The `idemflow.offsets` table, written in each batch's transaction and fenced by an owner epoch; on
    /// assignment the worker starts each partition from its stored position, so a crash or a rebalance
    /// redelivers nothing. The Kafka commit is still made afterwards, for lag monitoring and as the fallback
    /// for partitions with no stored position yet.
    Database,
}
