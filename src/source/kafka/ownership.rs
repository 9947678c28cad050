//! Which partitions a Kafka source owns, and what happens at a rebalance: the ownership state shared by the
//! consumer's rebalance callbacks ([`GroupContext`]) and the source ([`super::KafkaSource`]), the claims of stored
//! positions (`[offsets] store = "database"`) that an assignment waits for, and the buffered records of partitions
//! no longer owned, dropped. The protocol is described in [`super::consumer`]'s module documentation.


use crate::metrics::{CommitResult, PipelineMetrics, RebalanceEvent};
use crate::batch::Records;
use crate::record::Record;
use crate::shutdown::Shutdown;
use rdkafka::config::RDKafkaLogLevel;
use crate::offsets::{self};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::types::RDKafkaRespErr;
use crate::source::contract::StoredStart;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

pub(super) type Tp = (Arc<str>, i32);

#[derive(Default)]
pub(super) struct Ownership {
    pub(super) assigned: HashSet<Tp>,
    /// Revoked since the batch collector last looked.
    pub(super) revoked: Vec<Tp>,
    /// Per owned partition, the next offset whose predecessors are all durable in Postgres.
    pub(super) durable: HashMap<Tp, i64>,
    /// `[offsets] store = "database"`: per owned partition, the owner epoch this worker claimed.
    pub(super) epochs: HashMap<Tp, i64>,
    /// Consumption is paused for a retry ([`super::KafkaSource::pause_for`]).
    pub(super) paused: bool,
    /// Partitions given up after a fenced batch ([`super::KafkaSource::lose`]): kept paused until assigned again, or until
    /// claimed again when the time here is over while they are still assigned ([`super::KafkaSource::reclaim_fenced`]).
    pub(super) fenced: HashMap<Tp, Instant>,
    /// Durable positions learned at assignment (claimed stored positions) that the group has not committed yet.
    pub(super) commit_pending: bool,
    /// `[offsets] store = "database"`: an assignment waiting for its claim before the assign call.
    pub(super) claiming: Option<Claiming>,
    /// `[offsets] store = "database"`: a new claim of fenced partitions still assigned here.
    pub(super) reclaiming: Option<Reclaiming>,
}

/// A claim of partitions given up after a fenced batch and still assigned here ([`super::KafkaSource::reclaim_fenced`]).
pub(super) struct Reclaiming {
    /// Which claim this is.
    pub(super) id: u64,
    /// The claim task (aborted by a revoke).
    pub(super) task: tokio::task::JoinHandle<()>,
    /// Its outcome, set by the task before it notifies: `Some(None)` when shutdown came first.
    pub(super) outcome: Option<Option<Vec<offsets::Claimed>>>,
}

/// An assignment whose stored positions are being claimed (see the module documentation).
pub(super) struct Claiming {
    /// Which claim this is (a newer rebalance replaces an older claim).
    pub(super) id: u64,
    /// The partitions the group assigned.
    pub(super) partitions: Vec<(String, i32)>,
    /// Incremental (cooperative) assignment rather than eager.
    pub(super) cooperative: bool,
    /// The claim task (aborted when the claim is dropped).
    pub(super) task: tokio::task::JoinHandle<()>,
    /// Its outcome, set by the task before it notifies: `Some(None)` when shutdown came first.
    pub(super) outcome: Option<Option<Vec<offsets::Claimed>>>,
}

impl Ownership {
    /// Forgets a partition this consumer no longer owns (revoked, or fenced) and queues it for dropping its
    /// buffered records; returns its durable position, if it had one. (A fenced partition is fenced again after.)
    pub(super) fn give_up(&mut self, tp: Tp) -> Option<i64> {
        self.assigned.remove(&tp);
        self.epochs.remove(&tp);
        self.fenced.remove(&tp);
        let durable = self.durable.remove(&tp);
        self.revoked.push(tp);
        durable
    }

    /// The fenced partitions to claim again at `now`: those whose time is over, among those the consumer still
    /// holds (`held`, its assignment as librdkafka has it), sorted. A fenced partition no longer held is forgotten
    /// (if it is assigned here again, that assignment claims it). The partitions returned stay fenced (paused)
    /// until they are taken back ([`Ownership::retaken`]).
    pub(super) fn due_reclaims(&mut self, now: Instant, held: &HashSet<Tp>) -> Vec<Tp> {
        self.fenced.retain(|tp, _| held.contains(tp));
        let mut due: Vec<Tp> = self.fenced.iter().filter(|(_, at)| now >= **at).map(|(tp, _)| tp.clone()).collect();
        due.sort();
        due
    }

    /// Splits a finished new claim of fenced partitions, checked after it: those to take back (still fenced, so no
    /// rebalance moved them meanwhile, and still held) and those no longer here (revoked or assigned anew while the
    /// claim ran: left to their owner, whose own claim comes after, or which claims them again once fenced).
    pub(super) fn reclaimable(&self, claimed: &[offsets::Claimed], held: &HashSet<Tp>) -> (Vec<offsets::Claimed>, Vec<offsets::Claimed>) {
        claimed.iter().cloned().partition(|c| {
            let tp = tp_of(&c.topic, c.partition);
            self.fenced.contains_key(&tp) && held.contains(&tp)
        })
    }

    /// Takes back a fenced partition sought to the position of its new claim `c`: owned again under the new epoch,
    /// the stored position durable (and to be committed to the group). Returns the partition.
    pub(super) fn retaken(&mut self, c: &offsets::Claimed) -> Tp {
        let tp = tp_of(&c.topic, c.partition);
        self.fenced.remove(&tp);
        self.epochs.insert(tp.clone(), c.epoch);
        if let Some(next) = c.next_offset {
            self.durable.insert(tp.clone(), next);
            self.commit_pending = true;
        }
        self.assigned.insert(tp.clone());
        tp
    }
}

/// Claims `parts` for `owner` (`[offsets] store = "database"`), retrying with backoff while the store cannot be
/// reached (`waiting` is logged at each retry). `None` when shutdown came first.
pub(super) async fn claim_while_down(
    store: &crate::store::PositionStore,
    pipeline: &str,
    owner: &str,
    parts: &[(String, i32)],
    shutdown: &mut Shutdown,
    waiting: &str,
) -> Option<Vec<offsets::Claimed>> {
    let mut delays = crate::retry::backoff(Duration::from_millis(100), Duration::from_secs(10));
    loop {
        match store.claim_offsets(pipeline, owner, parts).await {
            Ok(claimed) => return Some(claimed),
            Err(e) => {
                let delay = delays.next().unwrap_or(Duration::from_secs(10));
                tracing::warn!(pipeline = %pipeline, error = %e, retry_in = ?delay, "{waiting}");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait() => return None,
                }
            }
        }
    }
}

/// The partitions of `tpl`.
pub(super) fn partitions_in(tpl: &TopicPartitionList) -> HashSet<Tp> {
    tpl.elements().iter().map(|e| tp_of(e.topic(), e.partition())).collect()
}


/// The consumer context: rebalance and commit callbacks, and librdkafka's log lines into tracing.
pub struct GroupContext {
    pub(super) pipeline: String,
    pub(super) state: Arc<Mutex<Ownership>>,
    pub(super) metrics: PipelineMetrics,
    pub(super) stored: Option<StoredStart>,
    /// Set by [`super::KafkaSource::close`]: the consumer is leaving the group.
    pub(super) closing: AtomicBool,
    /// Set by the rebalance callbacks: the housekeeping refreshes the lag of the new assignment.
    pub(super) assignment_changed: AtomicBool,
    /// Notified when a claim finishes, so the source assigns its partitions at once.
    pub(super) claimed: Arc<tokio::sync::Notify>,
}

pub(super) fn tp_of(topic: &str, partition: i32) -> Tp {
    (Arc::from(topic), partition)
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        let p = &self.pipeline;
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
                tracing::error!(pipeline = %p, facility = fac, "librdkafka: {log_message}")
            }
            RDKafkaLogLevel::Warning => tracing::warn!(pipeline = %p, facility = fac, "librdkafka: {log_message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(pipeline = %p, facility = fac, "librdkafka: {log_message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(pipeline = %p, facility = fac, "librdkafka: {log_message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(pipeline = %self.pipeline, %error, "kafka client error: {reason}");
    }
}

impl ConsumerContext for GroupContext {
    /// librdkafka's rebalance callback (it runs inside the consumer's poll). Replaces rdkafka's default only for
    /// `[offsets] store = "database"`: an assignment is not made here but after its stored positions are claimed
    /// (see the module documentation); otherwise it does what the default does.
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS if self.closing.load(Ordering::SeqCst) => {
                // Leaving the group: take nothing (librdkafka can abort when an assignment is still starting
                // while the consumer terminates).
                tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "closing: not taking the assigned partitions");
                consumer.unassign()
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                if let Some(stored) = &self.stored {
                    if tpl.count() > 0 {
                        // Assigned once the claim is done (`KafkaSource::finish_claim`); librdkafka waits for the call.
                        self.start_claim(stored, tpl, cooperative);
                        return;
                    }
                }
                let r = if cooperative { consumer.incremental_assign(tpl) } else { consumer.assign(tpl) };
                if r.is_ok() {
                    self.assigned(consumer, tpl);
                }
                r
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.revoked(consumer, tpl);
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                self.rebalance_error(KafkaError::Rebalance(other.into()));
                consumer.unassign()
            }
        };
        self.report(result);
    }
}

impl GroupContext {
    pub(super) fn report(&self, result: KafkaResult<()>) {
        if let Err(e) = result {
            tracing::warn!(pipeline = %self.pipeline, error = %e, "applying the rebalance failed");
        }
    }

    pub(super) fn revoked(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        self.metrics.rebalance(RebalanceEvent::Revoke);
        let mut commit = TopicPartitionList::new();
        {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(claiming) = st.claiming.take() {
                claiming.task.abort();
                tracing::info!(pipeline = %self.pipeline, "a rebalance came before the claim finished: dropping it");
            }
            if let Some(reclaiming) = st.reclaiming.take() {
                // Its partitions may be among the revoked: a claim of them now would fence their next owner.
                reclaiming.task.abort();
                tracing::info!(pipeline = %self.pipeline, "a rebalance came before the new claim of fenced partitions finished: dropping it");
            }
            for e in tpl.elements() {
                if let Some(next) = st.give_up(tp_of(e.topic(), e.partition())) {
                    let _ = commit.add_partition_offset(e.topic(), e.partition(), Offset::Offset(next));
                }
                self.metrics.forget_lag(e.topic(), e.partition());
            }
            self.metrics.assigned_partitions(st.assigned.len());
        }
        self.assignment_changed.store(true, Ordering::SeqCst);
        tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "partitions revoked");
        if self.closing.load(Ordering::SeqCst) {
            // KafkaSource::close committed the durable positions just before leaving; a commit from the callback
            // while the consumer terminates can abort librdkafka (rd_kafka_cgrp_terminated's assertion).
        } else if commit.count() > 0 && consumer.assignment_lost() {
            tracing::info!(pipeline = %self.pipeline, "assignment lost (session expired): not committing");
        } else if commit.count() > 0 {
            match consumer.commit(&commit, CommitMode::Sync) {
                Ok(()) => self.metrics.offset_commit(CommitResult::Ok),
                Err(e) => {
                    self.metrics.offset_commit(CommitResult::Error);
                    tracing::warn!(pipeline = %self.pipeline, error = %e, "offset commit on revoke failed; \
                        the new owner will skip the redelivered records as duplicates");
                }
            }
        }
    }

    pub(super) fn rebalance_error(&self, e: KafkaError) {
        // rdkafka unassigns everything after a failed rebalance: treat it as losing every partition.
        self.metrics.rebalance(RebalanceEvent::Error);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(claiming) = st.claiming.take() {
            claiming.task.abort();
        }
        if let Some(reclaiming) = st.reclaiming.take() {
            reclaiming.task.abort();
        }
        let lost: Vec<Tp> = st.assigned.drain().collect();
        st.durable.clear();
        st.epochs.clear();
        for (topic, partition) in lost.iter().chain(st.fenced.keys()) {
            self.metrics.forget_lag(topic, *partition);
        }
        st.fenced.clear();
        st.revoked.extend(lost);
        drop(st);
        self.metrics.assigned_partitions(0);
        self.assignment_changed.store(true, Ordering::SeqCst);
        tracing::warn!(pipeline = %self.pipeline, error = %e, "rebalance error: every partition counts as lost");
    }

    pub(super) fn assigned(&self, consumer: &impl Consumer<Self>, tpl: &TopicPartitionList) {
        self.metrics.rebalance(RebalanceEvent::Assign);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for e in tpl.elements() {
            let tp = tp_of(e.topic(), e.partition());
            st.fenced.remove(&tp);
            // An offset in the assignment is a claimed stored position (`start_from_stored`): durable, and to be
            // committed to the group so lag tools see it before the partition's next record arrives.
            if let Offset::Offset(next) = e.offset() {
                st.durable.insert(tp.clone(), next);
                st.commit_pending = true;
            }
            st.assigned.insert(tp);
        }
        let paused = st.paused;
        self.metrics.assigned_partitions(st.assigned.len());
        drop(st);
        self.assignment_changed.store(true, Ordering::SeqCst);
        // librdkafka keeps a partition's pause flag across a revoke and a new assignment (librdkafka issue
        // #1849): set it explicitly, or a partition paused before a rebalance would never be fetched again.
        let r = if paused { consumer.pause(tpl) } else { consumer.resume(tpl) };
        if let Err(e) = r {
            tracing::debug!(pipeline = %self.pipeline, error = %e, "setting the pause state of assigned partitions failed");
        }
        tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "partitions assigned");
    }

    /// Starts claiming the assigned partitions' stored positions ([`crate::store::Store::claim_offsets`]) in a task that retries while
    /// the database is unreachable, until shutdown; [`super::KafkaSource::finish_claim`] assigns them when it is done.
    pub(super) fn start_claim(&self, stored: &StoredStart, tpl: &TopicPartitionList, cooperative: bool) {
        let partitions: Vec<(String, i32)> =
            tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect();
        let (store, pipeline, owner, parts) = (stored.store.clone(), self.pipeline.clone(), stored.owner.clone(), partitions.clone());
        let (mut shutdown, done, state) = (stored.shutdown.clone(), self.claimed.clone(), self.state.clone());
        static CLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = CLAIMS.fetch_add(1, Ordering::SeqCst);
        // Held until the claim is registered below, so the task cannot record its outcome before it exists.
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let task = stored.runtime.spawn(async move {
            let waiting = "cannot claim the stored positions of the assigned partitions; retrying (the consumer stays in its group)";
            let claimed = claim_while_down(&store, &pipeline, &owner, &parts, &mut shutdown, waiting).await;
            // The outcome is recorded before the notification, so the source finds it when it wakes up.
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(c) = st.claiming.as_mut().filter(|c| c.id == id) {
                c.outcome = Some(claimed);
            }
            drop(st);
            done.notify_one();
        });
        tracing::info!(pipeline = %self.pipeline, partitions = %describe(tpl), "partitions assigned: claiming their stored positions");
        if let Some(previous) = st.claiming.replace(Claiming { id, partitions, cooperative, task, outcome: None }) {
            previous.task.abort();
        }
    }
}

pub(super) fn describe(tpl: &TopicPartitionList) -> String {
    let parts: Vec<String> = tpl
        .elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => format!("{}/{}@{o}", e.topic(), e.partition()),
            _ => format!("{}/{}", e.topic(), e.partition()),
        })
        .collect();
    parts.join(",")
}

/// Takes the partitions revoked since the last look (empty when there are none).
pub(super) fn take_revoked(state: &Mutex<Ownership>) -> HashSet<Tp> {
    let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
    st.revoked.drain(..).collect()
}

/// Removes the records of `revoked` partitions from each of `buffers`, logging how many.
pub(super) fn drop_records_of(revoked: &HashSet<Tp>, pipeline: &str, buffers: &mut [&mut dyn Records]) {
    if revoked.is_empty() {
        return;
    }
    let mut dropped = 0;
    for buffer in buffers.iter_mut() {
        dropped += buffer.retain_records(&mut |r| !revoked.contains(&(r.position.topic.clone(), r.position.partition)));
    }
    if dropped > 0 {
        tracing::info!(pipeline = %pipeline, dropped, "dropped buffered records of revoked partitions before processing");
    }
}

/// Drops the records of partitions revoked since the last look from a batch being collected and the kept records:
/// the partition's next owner (maybe this consumer again, from the committed offset) will receive them.
pub(super) fn drop_revoked(state: &Mutex<Ownership>, pipeline: &str, batch: &mut dyn Records, stash: &mut Vec<Record>) {
    drop_records_of(&take_revoked(state), pipeline, &mut [batch, stash]);
}

/// Drops the kept records of partitions revoked since the last look and remembers those partitions in `in_flight`
/// (for the batch in flight; see [`super::KafkaSource::poll_while`]).
pub(super) fn drop_revoked_from(state: &Mutex<Ownership>, pipeline: &str, stash: &mut Vec<Record>, in_flight: &mut HashSet<Tp>) {
    let revoked = take_revoked(state);
    drop_records_of(&revoked, pipeline, &mut [stash]);
    in_flight.extend(revoked);
}

/// The shortest time a partition given up after a fenced batch stays given up before this worker claims it again
/// while the group still assigns it here ([`super::KafkaSource::fenced_for`] is the group's session timeout when longer):
/// with a short session timeout, two workers that both believe they hold a partition fence each other at most
/// every few seconds.
pub const FENCED_FOR_MIN: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offsets::Claimed;

    fn claimed(partition: i32, next_offset: Option<i64>, epoch: i64) -> Claimed {
        Claimed { topic: "t".into(), partition, next_offset, epoch, stored_at_ms: None, log: None }
    }

    /// Owns `partitions` under epoch 1, then is fenced on them until `until` (as [`super::KafkaSource::lose`] does).
    fn fenced(partitions: &[i32], until: Instant) -> Ownership {
        let mut st = Ownership::default();
        for p in partitions {
            let tp = tp_of("t", *p);
            st.assigned.insert(tp.clone());
            st.epochs.insert(tp.clone(), 1);
            let _ = st.give_up(tp.clone());
            st.fenced.insert(tp, until);
        }
        st.revoked.clear();
        st
    }

    /// A late claim from a worker that no longer holds partition 0 fenced this worker, which the group still
    /// assigns it to: once its time is over it claims it again and takes it back (before, it stayed paused until
    /// its next rebalance).
    #[test]
    fn a_fenced_partition_still_assigned_here_is_claimed_again_once_its_time_is_over() {
        let t0 = Instant::now();
        let mut st = fenced(&[0], t0 + FENCED_FOR_MIN);
        let p0 = tp_of("t", 0);
        let held: HashSet<Tp> = [p0.clone()].into_iter().collect();
        assert!(st.due_reclaims(t0, &held).is_empty(), "not before its time");
        assert_eq!(st.due_reclaims(t0 + FENCED_FOR_MIN, &held), vec![p0.clone()]);
        assert!(st.fenced.contains_key(&p0), "paused until taken back");
        let (take, gone) = st.reclaimable(&[claimed(0, Some(120), 3)], &held);
        assert_eq!((take.clone(), gone), (vec![claimed(0, Some(120), 3)], vec![]));
        assert_eq!(st.retaken(&take[0]), p0);
        assert!(st.assigned.contains(&p0) && st.fenced.is_empty());
        assert_eq!((st.epochs[&p0], st.durable[&p0], st.commit_pending), (3, 120, true));
    }

    /// A partition is claimed again only while the consumer holds it, checked before the claim and after it: one
    /// revoked before its time is forgotten (its next assignment claims it), and a claim whose partition was revoked
    /// (or revoked and assigned again) while it ran is not taken.
    #[test]
    fn a_partition_no_longer_assigned_here_is_neither_claimed_again_nor_taken_back() {
        let t0 = Instant::now();
        let due = t0 + FENCED_FOR_MIN;
        let (p0, p1) = (tp_of("t", 0), tp_of("t", 1));
        // Before: no longer held.
        let mut st = fenced(&[0, 1], due);
        let only_p1: HashSet<Tp> = [p1.clone()].into_iter().collect();
        assert_eq!(st.due_reclaims(due, &only_p1), vec![p1.clone()]);
        assert!(!st.fenced.contains_key(&p0), "forgotten: not held");
        // After: revoked while the claim ran (the revoke gives it up, which ends its fence).
        let _ = st.give_up(p1.clone());
        let (take, gone) = st.reclaimable(&[claimed(1, Some(7), 4)], &only_p1);
        assert_eq!((take.len(), gone.len()), (0, 1));
        // After: still fenced, but no longer in the consumer's assignment.
        let mut st = fenced(&[0], due);
        let (take, gone) = st.reclaimable(&[claimed(0, Some(7), 4)], &HashSet::new());
        assert_eq!((take.len(), gone.len()), (0, 1));
        assert!(st.due_reclaims(due, &HashSet::new()).is_empty());
        // Assigned again (the assignment's own claim takes it): no longer fenced, so the late answer is not taken.
        let mut st = fenced(&[0], due);
        st.fenced.remove(&p0);
        st.assigned.insert(p0.clone());
        let held: HashSet<Tp> = [p0.clone()].into_iter().collect();
        let (take, _) = st.reclaimable(&[claimed(0, Some(7), 4)], &held);
        assert!(take.is_empty());
    }
}

