//! The sink: the batch protocol, written once for every store ([`crate::store`]): one transaction per batch that
//! claims business keys, applies the side effect for the new ones, writes the dead letters and commits.
//!
//! - [`dedup`]: what a claim returns and how duplicates are classified.
//! - [`dead_letter`] (a leaf the stores and the dead-letter publishers share): what a dead letter keeps.
//! - [`error`]: how every database failure is classified: retry, dead-letter the record, or fatal.
//! - [`template`]: named parameters in `sink.sql`.
//! - [`transaction`]: the batch transaction that ties them together.

pub mod dedup;
pub mod error;
#[cfg(feature = "redis")]
mod script;
pub mod transaction;

pub use error::SinkError;
use error::{SOLO_TIME_LIMIT_ATTEMPTS, SOLO_TIME_LIMIT_SPAN};
use crate::dead_letter::DeadLettered;

use crate::key::BusinessKey;
use crate::metrics::{BatchCounts, DeadLetterReason, DuplicateReason};
use crate::offsets::{Positions, Processed};
use crate::prepare::PreparedBatch;
use crate::record::{Position, Receipt, Record};
use crate::store::rows::Existing;
use std::collections::HashMap;
use crate::store::SideEffect;
use std::time::Duration;

/// The sink of one pipeline.
#[derive(Clone, Debug)]
pub struct Sink {
    pub(super) pipeline: String,
    /// The side effect, bound to the store that runs it.
    pub(super) side_effect: SideEffect,
    /// How long dedup keys are kept (Redis: their TTL).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(super) retention: Duration,
    /// The records whose side effect alone ran past the statement time limit in the last attempts of their batch,
    /// with how many attempts in a row it did ([`error::SOLO_TIME_LIMIT_ATTEMPTS`]). Shared by the clones of the sink that
    /// run one lane's attempts; an entry goes when its batch commits.
    pub(super) solo_time_limits: std::sync::Arc<std::sync::Mutex<SoloTimeLimits>>,
}

/// Per record (its receipt and position), the consecutive attempts in which its side effect alone ran past the
/// statement time limit, and when the first of them did.
type SoloTimeLimits = HashMap<(Receipt, Position), (u32, std::time::Instant)>;

/// What a committed batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Counts for the metrics.
    pub counts: BatchCounts,
    /// Every dead-lettered record of the batch: index into the batch, reason, error text, and whether its row was
    /// new (`false`: the same position was dead-lettered before, this is a redelivery).
    pub dead_letters: Vec<DeadLettered>,
    /// Redis: the batch script's round trip.
    pub script_round_trip: Option<Duration>,
    /// The partitions whose records reached back below their processed floor (a consumer group that started over:
    /// its offsets expired, a new `group_id`) and whose batch ended below it, each with its floor: every record up to
    /// the floor was processed by this pipeline, so the source may move on to it instead of fetching them all to
    /// skip them ([`crate::source::Source::skip_to_floors`]). Empty where the store keeps no floor (Redis).
    pub floors: Vec<crate::offsets::PassedFloor>,
}

/// One attempt at a batch, as the sink sees it ([`Sink::apply`]): the lane that makes it, its number, and the
/// attempts of the same batch before it. Its number is recorded first in the batch transaction (the store's
/// attempts table, one row per lane and pipeline), and what was recorded before is read back: when that is an
/// earlier attempt of this batch, that attempt committed though its answer never came (a connection lost during
/// `COMMIT`, `[database] batch_timeout`), and the batch is not run again.
#[derive(Clone, Debug, Default)]
pub struct Attempt {
    /// The lane ([`Attempt::lane`]), whose row in the attempts table this attempt writes.
    pub owner: std::sync::Arc<str>,
    /// This attempt's number ([`Attempt::next_id`]).
    pub id: i64,
    /// The earlier attempts of the same batch, oldest first.
    pub earlier: Vec<Earlier>,
    /// Set just before this attempt sends `COMMIT`: the outcome it commits. The worker keeps it with the attempt's
    /// number for the next attempt ([`Earlier::committing`]), also when the attempt was abandoned on a time-out.
    pub committing: std::sync::Arc<std::sync::Mutex<Option<BatchOutcome>>>,
    /// Fault injection ([`crate::worker::Faults::lose_commit_answer`]): the `COMMIT` goes through and the attempt
    /// then fails as if the connection had been lost before its answer came.
    pub lose_commit_answer: bool,
    /// The server session its transaction runs in, once [`crate::store::Tx::mark_attempt`] learned it: an attempt
    /// abandoned on `batch_timeout` has it ended ([`crate::store::Store::end_session`]).
    pub session: std::sync::Arc<std::sync::Mutex<Option<crate::store::Session>>>,
}

/// An earlier attempt of a batch ([`Attempt::earlier`]).
#[derive(Clone, Debug)]
pub struct Earlier {
    /// Its number.
    pub id: i64,
    /// What it was committing when it sent `COMMIT`, with the receipts of the records it was made for (the batch
    /// may have lost records since: a partition revoked during the back-off); `None` if it failed before.
    pub committing: Option<(BatchOutcome, Vec<Receipt>)>,
}

impl Attempt {
    /// A number for a new attempt: 63 random bits (a counter through a hash keyed afresh in every process), so no
    /// two attempts share one, across processes and restarts, whatever the clock does.
    pub fn next_id() -> i64 {
        use std::hash::{BuildHasher, Hasher};
        use std::sync::atomic::{AtomicU64, Ordering};
        static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut h = KEYS.get_or_init(Default::default).build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        (h.finish() & (i64::MAX as u64)) as i64
    }

    /// The name of a lane's row in the attempts table: its owner (`host/pid[/lane]`) and a number drawn once per
    /// process, so two processes that share a host name and a process id (no `HOSTNAME` under systemd, pid 1 in
    /// every container) never share a row.
    pub fn lane(owner: &str) -> std::sync::Arc<str> {
        static NONCE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        let nonce = NONCE.get_or_init(|| (Attempt::next_id() & 0xffff_ffff) as u32);
        format!("{owner}#{nonce:08x}").into()
    }
}

impl BatchOutcome {
    /// The outcome an earlier attempt committed, for `records` (the batch as it is now): its counts as they were,
    /// and its dead letters of records still in the batch, at their indexes now.
    fn recovered(committed: &BatchOutcome, receipts: &[Receipt], records: &[Record]) -> BatchOutcome {
        let mut outcome = committed.clone();
        outcome.dead_letters = committed
            .dead_letters
            .iter()
            .filter_map(|d| {
                let receipt = receipts.get(d.index)?;
                let index = records.iter().position(|r| r.receipt == *receipt)?;
                Some(DeadLettered { index, ..d.clone() })
            })
            .collect();
        outcome
    }
}

/// The fate of one record inside an attempt, before commit.
pub(super) enum Fate {
    Applied,
    Duplicate(DuplicateReason),
    DeadLetter(DeadLetterReason, String),
    Tombstone,
}

impl Sink {
    /// A sink running `side_effect` (built by its store, [`crate::store::Store::prepare_side_effect`]) for
    /// `pipeline`, keeping dedup keys for `retention` (Redis; the databases purge theirs in [`crate::retention`]).
    pub fn new(pipeline: String, side_effect: SideEffect, retention: Duration) -> Self {
        Sink { pipeline, side_effect, retention, solo_time_limits: Default::default() }
    }

    /// Counts one more attempt in which `record`'s side effect alone ran past the statement time limit; returns how
    /// many in a row it has now and whether they prove it the cause (enough of them, over long enough).
    pub(super) fn solo_time_limit(&self, record: &Record) -> (u32, bool) {
        let mut seen = self.solo_time_limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (n, since) = seen.entry((record.receipt, record.position.clone())).or_insert((0, std::time::Instant::now()));
        *n += 1;
        (*n, *n >= SOLO_TIME_LIMIT_ATTEMPTS && since.elapsed() >= SOLO_TIME_LIMIT_SPAN)
    }

    /// Forgets the time-limit attempts of a committed batch's records.
    pub(super) fn committed(&self, records: &[Record]) {
        let mut seen = self.solo_time_limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !seen.is_empty() {
            for r in records {
                seen.remove(&(r.receipt, r.position.clone()));
            }
        }
    }

    /// Runs one batch (its records, each with its prepared form) in one transaction. `positions`, with
    /// `[offsets] store = "database"`, are stored in the same transaction (first, so a fenced batch stops early).
    /// `guard` sees the batch's counts just before `COMMIT` and may refuse them (the dead-letter ratio limit),
    /// which rolls the batch back. `attempt` says which attempt this is and which came before it: when one of those
    /// committed though its answer was lost, the batch is not run again and its outcome is that attempt's (SQL
    /// stores; on Redis the retry's script finds the batch applied by its stored positions, writes nothing, and
    /// answers the outcome that attempt left).
    ///
    /// Errors: a [`SinkError`] whose [`SinkError::disposition`] is `Retry` (roll back, back off, call again with
    /// the same batch, the failed attempt added to the next one's [`Attempt::earlier`]: the dedup rows make that
    /// safe even when a lost `COMMIT` had in fact committed), `Fenced`
    /// (drop the records of the partitions named, call again with the rest) or `Fatal`.
    pub async fn apply(
        &self,
        batch: &PreparedBatch,
        positions: Option<&Positions>,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        attempt: &Attempt,
    ) -> Result<BatchOutcome, SinkError> {
        self.run(batch, positions, guard, &[], Some(attempt)).await
    }

    /// [`Sink::apply`] for dead letters being replayed: the dead-letter rows `replaying` are deleted in the same
    /// transaction, before the batch runs (a record that fails again is dead-lettered again, with its new error).
    pub async fn apply_replaying(
        &self,
        batch: &PreparedBatch,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        replaying: &[i64],
    ) -> Result<BatchOutcome, SinkError> {
        self.run(batch, None, guard, replaying, None).await
    }

    pub(super) fn log_dead_letters(&self, records: &[Record], dead_letters: &[DeadLettered]) {
        for d in dead_letters.iter().filter(|d| d.new) {
            let p = &records[d.index].position;
            tracing::warn!(
                pipeline = %self.pipeline, topic = %p.topic, partition = p.partition, offset = p.offset,
                reason = d.reason.as_str(), error = %d.error, "record dead-lettered"
            );
        }
    }

    pub(super) fn tally_dead_letter(
        &self,
        counts: &mut BatchCounts,
        dead_letters: &mut Vec<DeadLettered>,
        index: usize,
        reason: DeadLetterReason,
        error: String,
        new: bool,
    ) {
        if new {
            counts.dead_letter(reason);
        } else {
            // This very record (same topic, partition, offset, same payload) was dead-lettered before.
            counts.duplicate(DuplicateReason::Redelivered);
        }
        dead_letters.push(DeadLettered { index, reason, error, new });
    }

    pub(super) fn duplicate(
        &self,
        key: &BusinessKey,
        against: &Existing,
        record: &Record,
        fingerprint: &[u8; 32],
        processed: &Processed,
    ) -> DuplicateReason {
        let position = &record.position;
        // A record at a position an earlier batch processed is a redelivery (a replay after a rewind, a batch
        // redelivered after a crash), however its first delivery was classified.
        if processed.before(position) {
            return DuplicateReason::Redelivered;
        }
        let reason = dedup::classify(against, position, record.delivered_before, fingerprint);
        if reason == DuplicateReason::PayloadMismatch {
            let shown: String = key.text.chars().take(200).collect();
            tracing::warn!(
                pipeline = %self.pipeline, business_key = %shown, applied = %against.position, skipped = %position,
                "payload_mismatch: a record reuses an applied business key with a different payload; skipped"
            );
        }
        reason
    }

    /// The batch through its store's engine: one SQL transaction, or one Redis script.
    async fn run(
        &self,
        batch: &PreparedBatch,
        positions: Option<&Positions>,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        replaying: &[i64],
        attempt: Option<&Attempt>,
    ) -> Result<BatchOutcome, SinkError> {
        // Each prepared form belongs to the record beside it: the batch is one value that keeps them so
        // ([`crate::batch::Batch`]), whatever the worker did to it since it was prepared.
        match &self.side_effect {
            SideEffect::Sql(sql) => self.run_sql(sql, batch, positions, guard, replaying, attempt).await,
            #[cfg(feature = "redis")]
            SideEffect::Script(redis, commands) => self.run_script(redis, commands, batch, positions, guard, replaying, attempt).await,
        }
    }
}
