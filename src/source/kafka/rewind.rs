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
//!
//! A partition the group has no committed position for is not where the target is, but where the group would
//! start it: its consumer's `auto.offset.reset` ([`Reset`]). With `earliest` (idemflow's default) that is the
//! partition's log start, so such a partition moves to its log start whatever the target (a timestamp after its
//! records would otherwise commit its end, and its records, never consumed, would never be); with `latest` the group
//! would start at the end, and any target at or before it skips nothing. With any other policy (`error`) the plan
//! cannot tell where the group would start, and such a partition is left out of the plan (not moved), unless the
//! target is its log start, which skips nothing whatever the policy. Each is a warning of the plan.

use super::client::{consumer_config, hide_config_value, spec};
use super::spec::KafkaSettings;
use super::client::KafkaContext;
use crate::source::rewind::{reconcile, rfc3339_ms, Answers, Move, Plan, Reset, Target};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Message, Offset, TopicPartitionList};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where `pipeline`'s consumer starts a partition it has no committed position for ([`Reset`]): its
/// `auto.offset.reset`, as [`consumer_config`] sets it (`earliest` unless `[kafka.properties]` says otherwise).
pub fn reset_policy(kafka_settings: &KafkaSettings, pipeline: &KafkaContext) -> Reset {
    Reset::parse(consumer_config(kafka_settings, pipeline).get("auto.offset.reset"))
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
    move |source| RewindError::Kafka { what, source: hide_config_value(source) }
}

/// Whether the group has members now, from Kafka's DescribeGroups, without joining it: `Some(members)` when the
/// broker answered, `None` when it could not tell (the broker does not support the request, or did not answer
/// within `timeout`).
pub fn active_members(kafka_settings: &KafkaSettings, pipeline: &KafkaContext, timeout: Duration) -> Option<usize> {
    let consumer: BaseConsumer = consumer_config(kafka_settings, pipeline).create().ok()?;
    let groups = consumer.fetch_group_list(Some(&spec(pipeline).group_id), timeout).ok()?;
    let group = groups.groups().iter().find(|g| g.name() == spec(pipeline).group_id)?;
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
    pipeline: &KafkaContext,
    target: Target,
    positions: Option<&[(String, i32, Option<i64>)]>,
    timeout: Duration,
) -> Result<Plan, RewindError> {
    let consumer: BaseConsumer =
        consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let all = partitions_of(&consumer, pipeline, timeout)?;
    let reset = reset_policy(kafka_settings, pipeline);
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
        consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    let mut plan = Plan::default();
    let oldest_kept = SystemTime::now().checked_sub(pipeline.dedup_retention).unwrap_or(UNIX_EPOCH);
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
        let answers =
            Answers { topic: topic.to_owned(), partition, low, high, position, by_time: found, target_ms, found_timestamp_ms, reset: reset.clone() };
        let (m, warnings) = reconcile(&answers);
        plan.warnings.extend(warnings);
        // A partition left out (see `reconcile`) is not moved.
        let Some(m) = m else { continue };
        if m.replayed() > 0 {
            let first = if found == Some(Some(m.to)) { found_timestamp_ms } else { record_timestamp(&reader, topic, partition, m.to, timeout) };
            if let Some(ts) = first.filter(|ts| *ts < oldest_kept_ms) {
                plan.warnings.push(format!(
                    "{topic}/{partition}: the replay starts at a record from {} (offset {}), older than [dedup] retention = \
                     {}: dedup rows of operations that old may have been purged, and those would be applied again",
                    rfc3339_ms(ts),
                    m.to,
                    crate::terminal::duration(pipeline.dedup_retention),
                ));
            }
        }
        plan.moves.push(m);
    }
    Ok(plan)
}

/// Every partition of `pipeline`'s topics, from the cluster's metadata.
fn partitions_of(consumer: &BaseConsumer, pipeline: &KafkaContext, timeout: Duration) -> Result<TopicPartitionList, RewindError> {
    let mut all = TopicPartitionList::new();
    for topic in &spec(pipeline).topics {
        let md = consumer.fetch_metadata(Some(topic), timeout).map_err(kafka(format!("reading metadata of {topic:?}")))?;
        let t = md.topics().iter().find(|t| t.name() == topic).ok_or_else(|| RewindError::NoTopic(topic.clone()))?;
        if t.error().is_some() || t.partitions().is_empty() {
            return Err(RewindError::NoTopic(topic.clone()));
        }
        for p in t.partitions() {
            all.add_partition(topic, p.id());
        }
    }
    Ok(all)
}

/// Joins `pipeline`'s consumer group, checks that it was assigned every partition of its topics (no worker is
/// running; a partition left out of the plan counts too), and runs `before_commit` (the database side of the
/// rewind) and then commits `moves`' offsets as a group member; leaves the group in any case. Blocking.
///
/// Errors: [`RewindError::GroupActive`] when other members hold partitions, [`RewindError::NoAssignment`] after
/// `timeout` with no assignment, Kafka errors, and [`RewindError::Database`] from `before_commit` (nothing is
/// committed to Kafka then).
pub fn apply(
    kafka_settings: &KafkaSettings,
    pipeline: &KafkaContext,
    moves: &[Move],
    timeout: Duration,
    before_commit: impl FnOnce() -> Result<(), String>,
) -> Result<(), RewindError> {
    if let Some(members) = active_members(kafka_settings, pipeline, timeout).filter(|m| *m > 0) {
        return Err(RewindError::MembersActive { group: spec(pipeline).group_id.clone(), pipeline: pipeline.name.clone(), members });
    }
    let consumer: BaseConsumer =
        consumer_config(kafka_settings, pipeline).create().map_err(kafka("creating a Kafka client"))?;
    // Every partition, not only those of `moves`: a worker holding only partitions left out of the plan is running too.
    let all = partitions_of(&consumer, pipeline, timeout)?;
    let topics: Vec<&str> = spec(pipeline).topics.iter().map(String::as_str).collect();
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
                return Err(RewindError::NoAssignment { group: spec(pipeline).group_id.clone(), timeout });
            }
        };
        let mine = consumer.assignment().unwrap_or_default();
        let all_mine = moves.iter().all(|m| mine.find_partition(&m.topic, m.partition).is_some())
            && all.elements().iter().all(|e| mine.find_partition(e.topic(), e.partition()).is_some());
        if !all_mine {
            return Err(RewindError::GroupActive {
                group: spec(pipeline).group_id.clone(),
                pipeline: pipeline.name.clone(),
                got: assigned,
                total: all.count().max(moves.len()),
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

/// `idemflow rewind` for a Kafka pipeline: the plan from the group's committed offsets (or the stored positions in
/// `store`), printed; with `dry_run`, whether the group has members; otherwise the stored positions rewound and
/// the group's offsets committed by a member that holds every partition ([`apply`]).
///
/// Errors: [`RewindError`], and a store that cannot be read.
pub async fn run(
    kafka: &KafkaSettings,
    pipeline: &KafkaContext,
    request: crate::source::rewind::Request,
    side: Option<crate::source::rewind::StoreSide<'_>>,
) -> anyhow::Result<()> {
    let store = side.and_then(|s| s.positions());
    let positions = match store {
        Some(store) => Some(store.stored_offsets(&pipeline.name).await?),
        None => None,
    };
    let (settings, p) = (kafka.clone(), pipeline.clone());
    let plan = tokio::task::spawn_blocking(move || plan(&settings, &p, request.to, positions.as_deref(), request.timeout)).await??;
    let moves = plan.moves;
    let total = crate::source::rewind::print_plan(&pipeline.name, &spec(pipeline).group_id, store.is_some(), "partition", 32, &moves, &plan.warnings);
    if request.dry_run {
        let (settings, p) = (kafka.clone(), pipeline.clone());
        let members = tokio::task::spawn_blocking(move || active_members(&settings, &p, request.timeout)).await?;
        match members {
            Some(0) => println!("the group has no active members: a real run would go ahead"),
            Some(n) => println!("a real run would be refused: the group has {n} active member(s); stop every worker of the pipeline first"),
            None => println!(
                "the broker does not describe groups (DescribeGroups): a real run joins the group and is refused if a worker \
                 still holds a partition"
            ),
        }
        println!("dry run: nothing changed; {total} record(s) would be consumed again");
        return Ok(());
    }
    let runtime = tokio::runtime::Handle::current();
    let (settings, p, mv) = (kafka.clone(), pipeline.clone(), moves.clone());
    let side = side.map(|s| (s.store.clone(), s.positions));
    tokio::task::spawn_blocking(move || {
        apply(&settings, &p, &mv, request.timeout, || match &side {
            Some((store, positions)) => {
                let side = crate::source::rewind::StoreSide { store, positions: *positions };
                runtime.block_on(side.rewind(&p.name, &mv)).map_err(|e| e.to_string())
            }
            None => Ok(()),
        })
    })
    .await??;
    crate::source::rewind::print_rewound(total);
    Ok(())
}
