//! The sink: the batch protocol, written once for every store ([`crate::store`]): one transaction per batch that
//! claims business keys, applies the side effect for the new ones, writes the dead letters and commits.
//!
//! - [`dedup`]: what a claim returns and how duplicates are classified.
//! - [`dead_letter`] (a leaf the stores and the dead-letter publishers share): what a dead letter keeps.
//! - [`error`]: how every database failure is classified: retry, dead-letter the record, or fatal.
//! - [`template`]: named parameters in `sink.sql`.
//! - [`transaction`]: the batch transaction that ties them together.

pub use crate::dead_letter;
pub mod dedup;
pub mod error;
pub use crate::store::template;
#[cfg(feature = "redis")]
mod script;
pub mod transaction;

pub use error::{Disposition, SinkError};
pub use crate::dead_letter::DeadLettered;

use crate::key::BusinessKey;
use crate::metrics::{BatchCounts, DeadLetterReason, DuplicateReason};
use crate::offsets::{Positions, Processed};
use crate::prepare::Prepared;
use crate::record::Record;
use crate::store::rows::Existing;
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
}

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
        Sink { pipeline, side_effect, retention }
    }

    /// Runs one batch in one transaction. `prepared[i]` belongs to `records[i]`. `positions`, with
    /// `[offsets] store = "database"`, are stored in the same transaction (first, so a fenced batch stops early).
    /// `guard` sees the batch's counts just before `COMMIT` and may refuse them (the dead-letter ratio limit),
    /// which rolls the batch back.
    ///
    /// Errors: a [`SinkError`] whose [`SinkError::disposition`] is `Retry` (roll back, back off, call again with
    /// the same batch: the dedup rows make that safe even when a lost `COMMIT` had in fact committed), `Fenced`
    /// (drop the records of the partitions named, call again with the rest) or `Fatal`.
    pub async fn apply(
        &self,
        records: &[Record],
        prepared: &[Prepared],
        positions: Option<&Positions>,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
    ) -> Result<BatchOutcome, SinkError> {
        self.run(records, prepared, positions, guard, &[]).await
    }

    /// [`Sink::apply`] for dead letters being replayed: the dead-letter rows `replaying` are deleted in the same
    /// transaction, before the batch runs (a record that fails again is dead-lettered again, with its new error).
    pub async fn apply_replaying(
        &self,
        records: &[Record],
        prepared: &[Prepared],
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        replaying: &[i64],
    ) -> Result<BatchOutcome, SinkError> {
        self.run(records, prepared, None, guard, replaying).await
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
            // This very record (same topic, partition, offset) was dead-lettered before.
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
        records: &[Record],
        prepared: &[Prepared],
        positions: Option<&Positions>,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        replaying: &[i64],
    ) -> Result<BatchOutcome, SinkError> {
        match &self.side_effect {
            SideEffect::Sql(sql) => self.run_sql(sql, records, prepared, positions, guard, replaying).await,
            #[cfg(feature = "redis")]
            SideEffect::Script(redis, commands) => script::run(self, redis, commands, records, prepared, positions, guard, replaying).await,
        }
    }
}
