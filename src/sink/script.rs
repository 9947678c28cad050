//! A batch on Redis: one Lua script that Redis runs atomically ([`crate::store::redis::batch`]) takes the place of
//! the SQL transaction, with the same steps in the same order (positions fenced, keys claimed, the effect for new
//! keys only, dead letters, positions stored), and its answer is counted and classified by the same rules as the
//! SQL path ([`super::transaction`]). A script whose answer was lost (a reply cut off, `[redis] response_timeout`)
//! ran or did not: a script that runs keeps its answer under the batch's number (the first attempt's), and the
//! retry's script, finding it, answers it again and writes nothing, so the batch is counted once, as it was applied.

use super::error::SinkError;
use super::{BatchOutcome, Fate, Sink};
use crate::metrics::{BatchCounts, DeadLetterReason};
use crate::offsets::Positions;
use crate::prepare::{Prepared, PreparedBatch};
use crate::store::redis::batch::{BatchAttempt, Item, ItemResult, Refused};
use crate::store::redis::RedisStore;
use crate::store::redis::side_effect::SideEffect;

/// Which attempt of its batch this run is: the batch's number (its first attempt's), whether an earlier attempt
/// failed, the lane (see `batch.lua`: a retry gets the answer of an earlier attempt that ran).
fn batch_attempt(attempt: Option<&super::Attempt>) -> BatchAttempt<'_> {
    BatchAttempt {
        token: attempt.map(|a| a.earlier.first().map_or(a.id, |e| e.id)),
        again: attempt.is_some_and(|a| !a.earlier.is_empty()),
        lane: attempt.map_or("", |a| &a.owner),
    }
}

/// Each prepared record's fate before the script (a tombstone, a dead letter, one whose values the commands
/// cannot take) and the commands' values of each record to apply.
type Rendered = (Vec<Option<Fate>>, Vec<Option<Result<Vec<String>, String>>>);

fn render(side_effect: &SideEffect, prepared: &[Prepared]) -> Rendered {
    let mut fates: Vec<Option<Fate>> = Vec::with_capacity(prepared.len());
    let mut rendered: Vec<Option<Result<Vec<String>, String>>> = Vec::with_capacity(prepared.len());
    for p in prepared {
        let (fate, commands) = match p {
            Prepared::Tombstone => (Some(Fate::Tombstone), None),
            Prepared::DeadLetter(d) => (Some(Fate::DeadLetter(d.reason, d.error.clone())), None),
            Prepared::Apply(a) => match side_effect.render(a) {
                Ok(c) => (None, Some(Ok(c))),
                Err(why) => (Some(Fate::DeadLetter(DeadLetterReason::ParamInvalid, why)), None),
            },
        };
        fates.push(fate);
        rendered.push(commands);
    }
    (fates, rendered)
}

impl Sink {
    /// The batch as one Redis script (see [`super::transaction`]): the same steps as the SQL transaction, in the same
    /// order, run by Redis atomically; what it answers is classified as the SQL path classifies.
    pub(super) async fn run_script(
        &self,
        redis: &RedisStore,
        side_effect: &SideEffect,
        batch: &PreparedBatch,
        positions: Option<&Positions>,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        replaying: &[i64],
        attempt: Option<&super::Attempt>,
    ) -> Result<BatchOutcome, SinkError> {
        let (lose_answer, this) = (attempt.is_some_and(|a| a.lose_commit_answer), batch_attempt(attempt));
        let (records, prepared) = (batch.records(), batch.prepared());
        // A replayed dead letter does not run again the commands that took effect when it failed.
        let mut skip = None;
        if let Some(id) = replaying.first() {
            let stored = redis.dead_letter(*id).await.map_err(|e| SinkError::redis("reading the replayed dead letter", e))?;
            skip = Some(stored.and_then(|d| d.commands_done).unwrap_or(0));
        }
        let (fates, mut rendered) = render(side_effect, prepared);
        let mut before = BatchCounts { received: records.len() as u64, ..BatchCounts::default() };
        for f in fates.iter().flatten() {
            if let Fate::DeadLetter(reason, _) = f {
                before.dead_letter(*reason);
            }
        }
        guard(&before)?;
        let mut items = Vec::new();
        let mut sent = Vec::new();
        for (i, (record, fate)) in records.iter().zip(&fates).enumerate() {
            let item = match (fate, &prepared[i], rendered[i].take()) {
                (Some(Fate::DeadLetter(reason, error)), _, _) => Item::DeadLetter { record, reason: *reason, error, replayed: skip.is_some() },
                (None, Prepared::Apply(a), Some(Ok(values))) => {
                    Item::Apply { record, digest: a.key.digest, fingerprint: a.fingerprint, values, replay_skip: skip }
                }
                _ => continue,
            };
            items.push(item);
            sent.push(i);
        }
        let ran = match redis.run_batch(&this, &self.pipeline, self.retention, positions, replaying, &side_effect.template(), &items).await {
            Ok(ran) => ran,
            Err(Refused::Redis(e)) => return Err(SinkError::redis("running the batch script", e)),
            Err(Refused::Fenced(partitions)) => return Err(SinkError::Fenced { partitions }),
            Err(Refused::Lost(partitions)) => return Err(SinkError::Lost { partitions }),
            Err(Refused::Replayed(id)) => return Err(SinkError::Replayed(id)),
            Err(Refused::Unexpected(why)) => return Err(SinkError::Schema(why)),
        };
        if ran.again {
            tracing::info!(pipeline = %self.pipeline,
                "an earlier attempt of this batch ran though its answer was lost: its outcome is counted, nothing was written again");
        }
        if lose_answer {
            // Fault injection ([`crate::worker::Faults::lose_commit_answer`]): the script ran, its answer is lost. The
            // retry finds this very batch applied and reads its outcome back (`batch.lua`).
            let lost = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "the script's answer was lost (fault injection)");
            return Err(SinkError::redis("running the batch script", lost.into()));
        }
        let mut counts = BatchCounts { received: records.len() as u64, ..BatchCounts::default() };
        let mut dead_letters = Vec::new();
        let mut results = sent.iter().copied().zip(ran.results);
        let mut next = results.next();
        for (index, (record, fate)) in records.iter().zip(fates).enumerate() {
            let result = match &next {
                Some((at, _)) if *at == index => next.take().map(|(_, r)| r),
                _ => None,
            };
            if result.is_some() {
                next = results.next();
            }
            match (fate, result) {
                (Some(Fate::Tombstone), _) => counts.tombstones += 1,
                (_, Some(ItemResult::Applied)) => counts.applied += 1,
                (_, Some(ItemResult::Duplicate(existing))) => {
                    let Prepared::Apply(a) = &prepared[index] else { unreachable!("only records to apply are claimed") };
                    counts.duplicate(self.duplicate(&a.key, &existing, record, &a.fingerprint, &ran.marks));
                }
                (_, Some(ItemResult::Failed { new, error, .. })) => {
                    self.tally_dead_letter(&mut counts, &mut dead_letters, index, DeadLetterReason::SideEffectRejected, error, new);
                }
                (Some(Fate::DeadLetter(reason, error)), Some(ItemResult::DeadLettered(new))) => {
                    self.tally_dead_letter(&mut counts, &mut dead_letters, index, reason, error, new)
                }
                (fate, result) => unreachable!("record {index}: {:?} answered {result:?}", fate.is_some()),
            }
        }
        self.log_dead_letters(records, &dead_letters);
        Ok(BatchOutcome { counts, dead_letters, script_round_trip: Some(ran.round_trip), floors: Vec::new() })
    }
}
