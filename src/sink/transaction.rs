//! The batch transaction.
//!
//! Fast path, one transaction:
//! 0. start the side effect ([`Tx::begin_side_effect`]: settings, locks, and a check that the schema is still the one
//!    its statements were built for, else [`SinkError::SchemaChanged`]); record the attempt ([`Tx::mark_attempt`]:
//!    an earlier attempt of this batch found committed ends it here); with `[offsets] store = "database"`, store
//!    the batch's positions, fenced by the owner epoch ([`Tx::advance_offsets`]); lock and read the processed
//!    marks ([`Tx::processed`]): a record below its partition's mark is a redelivery, whatever its key's dedup
//!    row says, and one below its floor is neither claimed nor applied;
//! 1. claim the distinct keys of the batch and run the side effect for the keys that were new
//!    ([`Tx::claim_and_apply`]): in PostgreSQL's table form one statement, the claim's `RETURNING` feeding the
//!    table's `INSERT` (so a `statement_timeout` times both together: a batch past it is redone record by record,
//!    as below); otherwise the claim in one statement, then the side effect;
//! 2. read the dedup rows of keys that were not new (only when there are some) and classify those duplicates;
//! 3. write the outbox's requests of the records applied ([`Tx::write_outbox`], `[[sink.http]]`), the dead letters;
//!    raise the processed marks ([`Tx::raise_processed`]); 4. `COMMIT`.
//!
//! If the side effect raises an error that belongs to one record (see [`super::error`]), the transaction is
//! rolled back and the batch is redone record by record in a new one, each record inside a savepoint, so the
//! offending record is dead-lettered and the rest of the batch still commits. The slow path classifies
//! duplicates exactly as the fast path does, so a record's outcome never depends on how batches were cut.
//!
//! Redis has no interactive transaction: the same steps, in the same order (positions fenced, keys claimed, the
//! effect for new keys only, dead letters, positions stored), run inside one script that Redis executes atomically
//! ([`crate::store::redis::batch`]), and what it answers is classified here exactly as above. The dead-letter ratio
//! guard sees the records dead-lettered before the script (decoding, keys, values); a command failing inside the
//! script cannot be refused after the fact, because Redis has no rollback.

use crate::store::rows::{Claim, Existing};
use super::error::SinkError;
use crate::store::disposition::Disposition;
use crate::store::error::{classify, describe};
use crate::metrics::{BatchCounts, DeadLetterReason, DuplicateReason};
use crate::offsets::{LogChange, Logs, Positions, Processed, Replay};
use crate::prepare::{Prepared, PreparedBatch};
use crate::store::rows::Apply;
use crate::key::BusinessKey;
use crate::record::Record;
use super::{Attempt, BatchOutcome, Earlier, Fate, Sink};
use crate::store::{SqlSideEffect, Tx};
use crate::store::rows::{DigestMap, Digests};

/// A batch transaction just begun ([`Sink::begin_replaying`]).
enum Begun<'a, 'e> {
    /// Open, with the processed marks as they were.
    Open(Tx<'a>, Processed),
    /// Rolled back: this earlier attempt of the batch is found committed.
    Committed(&'e Earlier),
}

impl Sink {
    /// Opens the batch transaction; returns it with the processed marks as they were before this batch (none
    /// when replaying dead letters, whose positions are old by definition). With an `attempt`, records it first
    /// ([`Tx::mark_attempt`]); when the attempt recorded before it is an earlier attempt of this batch, that one
    /// committed: the transaction is rolled back and the earlier attempt is returned instead.
    async fn begin_replaying<'a, 'e>(
        &self,
        side_effect: &'a SqlSideEffect,
        batch: &PreparedBatch,
        replaying: &[i64],
        positions: Option<&Positions>,
        attempt: Option<&'e Attempt>,
    ) -> Result<Begun<'a, 'e>, SinkError> {
        // The session of a transaction this attempt ended already (its fast path, rolled back before the slow
        // path) serves someone else now: never ended on this attempt's behalf.
        if let Some(attempt) = attempt {
            *attempt.session.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
        let mut tx = self.begin(side_effect).await?;
        if let Some(attempt) = attempt {
            let (before, session) = tx.mark_attempt(&self.pipeline, &attempt.owner, attempt.id)
                .await
                .map_err(|e| SinkError::new("recording the batch attempt", e))?;
            *attempt.session.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(session);
            if let Some(committed) = before.and_then(|id| attempt.earlier.iter().find(|e| e.id == id)) {
                tx.rollback().await.map_err(|e| SinkError::new("rolling back", e))?;
                return Ok(Begun::Committed(committed));
            }
        }
        if let Some(positions) = positions {
            let fenced = tx.advance_offsets(&self.pipeline, positions)
                .await
                .map_err(|e| SinkError::new("storing consumed positions", e))?;
            if !fenced.is_empty() {
                tx.rollback().await.map_err(|e| SinkError::new("rolling back", e))?;
                return Err(SinkError::Fenced { partitions: fenced });
            }
        }
        if !replaying.is_empty() {
            tx.delete_dead_letters(&self.pipeline, replaying)
                .await
                .map_err(|e| SinkError::new("removing replayed dead letters", e))?;
            return Ok(Begun::Open(tx, Processed::default()));
        }
        // Read (and locked) first, raised last, just before COMMIT: a side effect that ends the transaction itself
        // must not commit a floor above records it never applied.
        let (records, first) = (batch.records(), batch.first_offsets());
        let mut processed = tx.processed(&self.pipeline, first)
            .await
            .map_err(|e| SinkError::new("reading the processed positions", e))?;
        let renewals = processed.renewals(first, batch.logs());
        if !renewals.is_empty() {
            tx.renew_processed(&self.pipeline, &renewals)
                .await
                .map_err(|e| SinkError::new("renewing the processed positions of a log created again", e))?;
            for r in &renewals {
                let mark = processed.0.get(&(r.topic.clone(), r.partition)).map(|m| m.next);
                let (topic, partition, next) = (&*r.topic, r.partition, r.next);
                match &r.change {
                    LogChange::Another { was, now } => tracing::warn!(pipeline = %self.pipeline, topic, partition, mark, was = %was,
                        now = %now, "the broker names another log than the one this pipeline's processed marks were raised on (another \
                         identity): the topic was deleted and created again; the marks from before are dropped and its records \
                         processed as new"),
                    LogChange::Shorter { end } => tracing::warn!(pipeline = %self.pipeline, topic, partition, mark, end, next,
                        "the partition's log ends below this pipeline's processed mark: the topic was deleted and created \
                         again (or its log truncated); the marks from before are dropped and its records claimed as new, \
                         their dedup rows deciding"),
                }
            }
            processed.renew(&renewals);
        }
        self.note_stamped_ahead(records, &processed, batch.logs());
        Ok(Begun::Open(tx, processed))
    }

    /// What an earlier attempt that is found committed means: its outcome, when it had sent `COMMIT` (its answer
    /// was lost); when it had not, the side effect ended that attempt's transaction itself (a procedure's `COMMIT`
    /// on MySQL/MariaDB), and part of the batch may be committed without the rest: the pipeline stops.
    fn committed_before(&self, earlier: &Earlier, records: &[Record]) -> Result<BatchOutcome, SinkError> {
        match &earlier.committing {
            Some((outcome, receipts)) => {
                tracing::info!(pipeline = %self.pipeline, attempt = earlier.id,
                    "an earlier attempt of this batch committed though its answer was lost: the batch is not run again");
                self.committed(records);
                Ok(BatchOutcome::recovered(outcome, receipts, records))
            }
            None => {
                tracing::error!(pipeline = %self.pipeline, attempt = earlier.id,
                    "an earlier attempt of this batch failed before its COMMIT, yet it is committed: the side effect ended its transaction itself");
                Err(SinkError::TransactionEnded)
            }
        }
    }

    /// The batch in one SQL transaction (see the module documentation).
    pub(super) async fn run_sql(
        &self,
        side_effect: &SqlSideEffect,
        batch: &PreparedBatch,
        positions: Option<&Positions>,
        guard: impl Fn(&BatchCounts) -> Result<(), SinkError>,
        replaying: &[i64],
        attempt: Option<&Attempt>,
    ) -> Result<BatchOutcome, SinkError> {
        let (records, prepared) = (batch.records(), batch.prepared());
        let (mut tx, processed) = match self.begin_replaying(side_effect, batch, replaying, positions, attempt).await? {
            Begun::Open(tx, processed) => (tx, processed),
            Begun::Committed(earlier) => return self.committed_before(earlier, records),
        };
        let fates = match self.fast_path(&mut tx, records, prepared, &processed).await {
            Ok(fates) => fates,
            Err(e) if e.disposition() == Disposition::Record || e.time_limit() => {
                if e.time_limit() {
                    tracing::warn!(pipeline = %self.pipeline, records = records.len(), error = %e,
                        "the batch ran past the statement time limit (statement_timeout, max_statement_time, max_execution_time) or was cancelled; redoing it record by record, each statement timed on its own");
                } else {
                    tracing::debug!(error = %e, "a record's side effect failed; redoing the batch record by record");
                }
                // Redoing it is right only if the claims are still undone: a side effect that committed them
                // (a procedure's COMMIT) would make every record of the redo a duplicate.
                tx = still_open(tx).await?;
                tx.rollback().await.map_err(|e| SinkError::new("rolling back", e))?;
                let processed = match self.begin_replaying(side_effect, batch, replaying, positions, attempt).await? {
                    Begun::Open(again, processed) => {
                        tx = again;
                        processed
                    }
                    Begun::Committed(earlier) => return self.committed_before(earlier, records),
                };
                self.slow_path(&mut tx, records, prepared, &processed).await?
            }
            Err(e) => return Err(e),
        };
        // The side effect may have ended the transaction itself (a procedure's COMMIT on MySQL): whatever it wrote
        // since was autocommitted, so nothing after this point may be written, and the batch must not be taken for
        // applied.
        let mut tx = still_open(tx).await?;
        let (counts, dead_letters) = self.record_fates(&mut tx, batch, fates, replaying).await?;
        if let Err(refused) = guard(&counts) {
            // The guard's message gives counts; the cause is in the dead letters it refused to write.
            if let Some(d) = dead_letters.iter().find(|d| d.new) {
                let p = &records[d.index].position;
                tracing::error!(
                    pipeline = %self.pipeline, position = %p, reason = d.reason.as_str(), error = %d.error,
                    "the dead-letter ratio guard refused this batch; the first of its dead letters"
                );
            }
            tx.rollback().await.map_err(|e| SinkError::new("rolling back", e))?;
            return Err(refused);
        }
        let outcome = BatchOutcome { counts, dead_letters, script_round_trip: None, floors: floors_passed_below(batch, &processed) };
        if let Some(attempt) = attempt {
            *attempt.committing.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(outcome.clone());
        }
        tx.commit().await.map_err(|e| SinkError::new("committing the batch", e))?;
        if attempt.is_some_and(|a| a.lose_commit_answer) {
            tracing::warn!(pipeline = %self.pipeline, "injected fault: the COMMIT went through, its answer is taken for lost");
            return Err(SinkError::new("committing the batch", sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())));
        }
        self.committed(records);
        self.log_dead_letters(records, &outcome.dead_letters);
        Ok(outcome)
    }

    /// What the fates of a batch's records write beside the effect, in its transaction: the outbox's requests of
    /// the records applied, the duplicates' counts per key, the dead letters, and (unless `replaying` dead letters)
    /// the processed positions. Returns the batch's counts and its dead letters.
    async fn record_fates(
        &self,
        tx: &mut Tx<'_>,
        batch: &PreparedBatch,
        fates: Vec<Fate>,
        replaying: &[i64],
    ) -> Result<(BatchCounts, Vec<crate::dead_letter::DeadLettered>), SinkError> {
        let mut per_key: DigestMap<(&BusinessKey, i64)> = DigestMap::default();
        for (p, fate) in batch.prepared().iter().zip(&fates) {
            if let (Prepared::Apply(a), Fate::Duplicate(_)) = (p, fate) {
                per_key.entry(a.key.digest).or_insert((&a.key, 0)).1 += 1;
            }
        }
        let per_key: Vec<(&BusinessKey, i64)> = per_key.into_values().collect();
        // The outbox's requests of the records applied (their keys were new), in the batch's order: a duplicate
        // writes none, so a request exists once per business key, committed or rolled back with its dedup row.
        let outgoing: Vec<(&Record, &Apply)> = batch
            .records()
            .iter()
            .zip(batch.prepared())
            .zip(&fates)
            .filter_map(|((r, p), fate)| match (p, fate) {
                (Prepared::Apply(a), Fate::Applied) if !a.requests.is_empty() => Some((r, a)),
                _ => None,
            })
            .collect();
        tx.write_outbox(&self.pipeline, &outgoing)
            .await
            .map_err(|e| SinkError::new("writing the outbox", e))?;
        tx.count_duplicates(&self.pipeline, &per_key)
            .await
            .map_err(|e| SinkError::new("counting duplicates", e))?;
        let mut counts = BatchCounts { received: batch.records().len() as u64, ..BatchCounts::default() };
        let mut dead_letters = Vec::new();
        for (index, (record, fate)) in batch.records().iter().zip(fates).enumerate() {
            match fate {
                Fate::Applied => counts.applied += 1,
                Fate::Duplicate(reason) => counts.duplicate(reason),
                Fate::Tombstone => counts.tombstones += 1,
                Fate::DeadLetter(reason, error) => {
                    let new = tx.write_dead_letter(&self.pipeline, record, reason, &error)
                        .await
                        .map_err(|e| SinkError::new("writing a dead letter", e))?;
                    self.tally_dead_letter(&mut counts, &mut dead_letters, index, reason, error, new);
                }
            }
        }
        if replaying.is_empty() {
            tx.raise_processed(&self.pipeline, batch.next_offsets(), batch.logs())
                .await
                .map_err(|e| SinkError::new("raising the processed positions", e))?;
        }
        Ok((counts, dead_letters))
    }

    /// Opens a batch transaction and starts the side effect in it ([`Tx::begin_side_effect`]).
    ///
    /// Errors: [`SinkError::SchemaChanged`] (rolled back) when the side effect's schema changed since it was built.
    async fn begin<'a>(&self, side_effect: &'a SqlSideEffect) -> Result<Tx<'a>, SinkError> {
        let mut tx = side_effect.begin().await.map_err(|e| SinkError::new("opening the batch transaction", e))?;
        let current = tx.begin_side_effect().await.map_err(|e| SinkError::new("starting the side effect", e))?;
        if !current {
            tx.rollback().await.map_err(|e| SinkError::new("rolling back", e))?;
            return Err(SinkError::SchemaChanged);
        }
        Ok(tx)
    }

    async fn fast_path(
        &self,
        tx: &mut Tx<'_>,
        records: &[Record],
        prepared: &[Prepared],
        processed: &Processed,
    ) -> Result<Vec<Fate>, SinkError> {
        // Records below their partition's floor were processed before: neither claimed nor applied again.
        let below = below_floor(records, processed);
        self.log_below_floor(&below);
        let dead_below = self.dead_letters_below(tx, records, &below).await?;
        // The first occurrence of each key in the batch is the one that claims it, and the one applied if its key
        // was new (`firsts`, in the batch's order: the order effects are applied in).
        let mut first: DigestMap<usize> = DigestMap::default();
        let mut claims = Vec::new();
        let mut firsts: Vec<&Apply> = Vec::new();
        for (i, p) in prepared.iter().enumerate() {
            if below.get(i).copied().unwrap_or(false) {
                continue;
            }
            if let Prepared::Apply(a) = p {
                first.entry(a.key.digest).or_insert_with(|| {
                    claims.push(Claim { key: &a.key, position: &records[i].position, fingerprint: &a.fingerprint });
                    firsts.push(a);
                    i
                });
            }
        }
        // Claim in key id order, the unique index's: two workers claiming overlapping keys (the same operation on two
        // partitions) then take its locks in the same order and wait for each other instead of deadlocking, and the
        // inserts walk the index's leaves in order.
        claims.sort_by_cached_key(|c| c.key.key_id());
        // The claim, and the side effect of the keys it returned: one statement where the store can (PostgreSQL's
        // table form), otherwise the claim, then the side effect.
        let new = if claims.is_empty() {
            Digests::default()
        } else {
            tx.claim_and_apply(&self.pipeline, &claims, &firsts)
                .await
                .map_err(|e| SinkError::new("claiming business keys and applying the side effect", e))?
        };
        let old: Vec<&BusinessKey> = claims.iter().map(|c| c.key).filter(|k| !new.contains(&k.digest)).collect();
        let stored: DigestMap<Existing> = if old.is_empty() {
            DigestMap::default()
        } else {
            tx.existing(&self.pipeline, &old)
                .await
                .map_err(|e| SinkError::new("reading dedup rows", e))?
                .into_iter()
                .collect()
        };
        let mut fates = Vec::with_capacity(prepared.len());
        for (i, p) in prepared.iter().enumerate() {
            let fate = match p {
                Prepared::Tombstone => Fate::Tombstone,
                Prepared::DeadLetter(d) => Fate::DeadLetter(d.reason, d.error.clone()),
                Prepared::Apply(_) if below.get(i).copied().unwrap_or(false) => below_fate(&dead_below, &records[i]),
                Prepared::Apply(a) => {
                    let f = first[&a.key.digest];
                    if i == f && new.contains(&a.key.digest) {
                        Fate::Applied
                    } else {
                        // Against the stored row when the key existed before this batch, otherwise against the
                        // first occurrence in this batch (the row this batch is writing): the same answer the
                        // record would get in a later batch.
                        let against = match stored.get(&a.key.digest) {
                            Some(e) => e.clone(),
                            None if i != f => occurrence(&records[f], &prepared[f]),
                            None => {
                                tracing::warn!(pipeline = %self.pipeline, position = %records[i].position,
                                    "the dedup row of a conflicting key vanished (purged concurrently?)");
                                occurrence(&records[i], p)
                            }
                        };
                        Fate::Duplicate(self.duplicate(&a.key, &against, &records[i], &a.fingerprint, processed))
                    }
                }
            };
            fates.push(fate);
        }
        Ok(fates)
    }

    async fn slow_path(
        &self,
        tx: &mut Tx<'_>,
        records: &[Record],
        prepared: &[Prepared],
        processed: &Processed,
    ) -> Result<Vec<Fate>, SinkError> {
        let mut fates = Vec::with_capacity(prepared.len());
        let below = below_floor(records, processed);
        self.log_below_floor(&below);
        let dead_below = self.dead_letters_below(tx, records, &below).await?;
        for ((record, p), below) in records.iter().zip(prepared).zip(below.iter().copied().chain(std::iter::repeat(false))) {
            if below && matches!(p, Prepared::Apply(_)) {
                fates.push(below_fate(&dead_below, record));
                continue;
            }
            let a = match p {
                Prepared::Tombstone => {
                    fates.push(Fate::Tombstone);
                    continue;
                }
                Prepared::DeadLetter(d) => {
                    fates.push(Fate::DeadLetter(d.reason, d.error.clone()));
                    continue;
                }
                Prepared::Apply(a) => a,
            };
            tx.savepoint().await.map_err(|e| SinkError::new("opening a savepoint", e))?;
            let claim = [Claim { key: &a.key, position: &record.position, fingerprint: &a.fingerprint }];
            let new = match tx.claim(&self.pipeline, &claim).await {
                Ok(new) => !new.is_empty(),
                Err(e) => match classify(&e) {
                    Disposition::Record => {
                        tx.rollback_to_savepoint().await.map_err(savepoint_failed("rolling back a savepoint"))?;
                        fates.push(Fate::DeadLetter(DeadLetterReason::KeyInvalid, describe(&e)));
                        continue;
                    }
                    _ => return Err(SinkError::new("claiming a business key", e)),
                },
            };
            if !new {
                let stored = tx.existing(&self.pipeline, &[&a.key])
                    .await
                    .map_err(|e| SinkError::new("reading a dedup row", e))?;
                let against = stored.into_iter().next().map_or_else(|| occurrence(record, p), |(_, e)| e);
                tx.release_savepoint().await.map_err(savepoint_failed("releasing a savepoint"))?;
                fates.push(Fate::Duplicate(self.duplicate(&a.key, &against, record, &a.fingerprint, processed)));
                continue;
            }
            match tx.apply_one(a).await {
                Ok(()) => {
                    tx.release_savepoint().await.map_err(savepoint_failed("releasing a savepoint"))?;
                    fates.push(Fate::Applied);
                }
                Err(e) if classify(&e) == Disposition::Record => {
                    tx.rollback_to_savepoint().await.map_err(savepoint_failed("rolling back a savepoint"))?;
                    fates.push(Fate::DeadLetter(DeadLetterReason::SideEffectRejected, describe(&e)));
                }
                // One record's side effect alone past the statement time limit: the smallest piece the batch can be
                // cut into. Slow in attempt after attempt, it is this record's error (the dead-letter ratio guard
                // stops the pipeline should every record meet it: a timeout too short for any record); slow once
                // may be a lock wait or a stall that was not its own, so the batch is retried first.
                Err(e) if crate::store::error::time_limit(&e) => {
                    tx.rollback_to_savepoint().await.map_err(savepoint_failed("rolling back a savepoint"))?;
                    let (attempts, proven) = self.solo_time_limit(record);
                    if !proven && record.receipt != crate::record::Receipt::NONE {
                        return Err(SinkError::RecordTimeLimit { position: record.position.clone(), attempts, source: e });
                    }
                    tracing::warn!(pipeline = %self.pipeline, position = %record.position, attempts,
                        "one record's side effect alone ran past the statement time limit in every attempt; dead-lettered");
                    fates.push(Fate::DeadLetter(
                        DeadLetterReason::SideEffectRejected,
                        format!(
                            "{} (this record's side effect alone ran past the statement time limit, in {attempts} attempts in a row over at least {}s)",
                            describe(&e),
                            super::error::SOLO_TIME_LIMIT_SPAN.as_secs()
                        ),
                    ));
                }
                Err(e) => return Err(SinkError::new("applying the side effect", e)),
            }
        }
        Ok(fates)
    }

}

/// Whether any record of the batch can lie below its partition's floor: a batch holds runs of one partition's
/// records in offset order, so only a run that starts below its floor can hold one. One look-up a run: the usual
/// batch, nowhere near a floor, costs nothing more per record.
fn starts_below_a_floor(records: &[Record], processed: &Processed) -> bool {
    records.chunk_by(|a, b| a.position.same_partition(&b.position)).any(|run| {
        let p = &run[0].position;
        processed.0.get(&(p.topic.clone(), p.partition)).and_then(|m| m.floor).is_some_and(|floor| p.offset < floor)
    })
}

/// The partitions of `records` that start below their floor and end below it too, with the floor (see
/// [`BatchOutcome::floors`]): the records between the batch's end and the floor were processed before, so the
/// source can move on to the floor. A partition found created again has no mark left here, so it is not one.
fn floors_passed_below(batch: &PreparedBatch, processed: &Processed) -> Vec<crate::offsets::PassedFloor> {
    if !starts_below_a_floor(batch.records(), processed) {
        return Vec::new();
    }
    batch.next_offsets().0
        .iter()
        .filter_map(|((topic, partition), after)| {
            let mark = processed.0.get(&(topic.clone(), *partition))?;
            let floor = mark.floor?;
            (*after < floor).then(|| crate::offsets::PassedFloor { topic: topic.clone(), partition: *partition, floor, raised_at_ms: mark.raised_at_ms })
        })
        .collect()
}

/// For each record, whether it lies below its partition's floor and was processed before ([`Replay::Processed`]);
/// empty when none does (the common case: nothing allocated per record).
fn below_floor(records: &[Record], processed: &Processed) -> Vec<bool> {
    if !starts_below_a_floor(records, processed) {
        return Vec::new();
    }
    let below: Vec<bool> = records.iter().map(|r| processed.replay(r) != Replay::New).collect();
    if below.contains(&true) { below } else { Vec::new() }
}

impl Sink {
    /// Says in the log where records below a floor, skipped as processed, were stamped after the mark was last raised
    /// (producers whose clocks run ahead, a future business time): once per partition and batch, a warning where
    /// the broker gives no identity to tell the log is the same (a topic created again that already holds more records
    /// than were processed of the old one looks the same, and its first records are skipped: `idemflow rewind`
    /// applies them), a debug line where the id says it is.
    fn note_stamped_ahead(&self, records: &[Record], processed: &Processed, logs: &Logs) {
        if !starts_below_a_floor(records, processed) {
            return;
        }
        for run in records.chunk_by(|a, b| a.position.same_partition(&b.position)) {
            let p = &run[0].position;
            let tp = (p.topic.clone(), p.partition);
            let Some(mark) = processed.0.get(&tp) else { continue };
            let (Some(floor), Some(raised)) = (mark.floor, mark.raised_at_ms) else { continue };
            let Some(ahead) = run.iter().filter(|r| r.position.offset < floor).filter_map(|r| r.timestamp_ms).filter(|t| *t > raised).max() else {
                continue;
            };
            let id = logs.0.get(&tp).and_then(|l| l.id.clone());
            let (topic, partition) = (&*p.topic, p.partition);
            if id.is_some() && id == mark.log {
                tracing::debug!(pipeline = %self.pipeline, topic, partition, floor, stamped_ms = ahead, mark_raised_ms = raised,
                    "records below the processed floor are stamped after the mark was raised; the log's identity is the marks': skipped as processed");
            } else {
                tracing::warn!(pipeline = %self.pipeline, topic, partition, floor, stamped_ms = ahead, mark_raised_ms = raised,
                    "records below the processed floor are stamped after the mark was raised, and the broker gives no identity \
                     to tell whether the topic is the one processed: skipped as processed (timestamps never decide). If the \
                     topic was deleted and created again, `idemflow rewind` applies its records");
            }
        }
    }
}

/// What a record below its floor ([`below_floor`]) becomes: its dead letter again, where it was dead-lettered when it
/// was processed (written again, it is found there and counted `redelivered`, and published again where the pipeline
/// has a dead-letter topic: a crash before that publish was confirmed must not lose it), otherwise a `redelivered`
/// duplicate.
fn below_fate(dead: &std::collections::HashMap<crate::record::Position, (DeadLetterReason, String)>, record: &Record) -> Fate {
    match dead.get(&record.position) {
        Some((reason, error)) => Fate::DeadLetter(*reason, error.clone()),
        None => Fate::Duplicate(DuplicateReason::Redelivered),
    }
}

impl Sink {
    /// The dead letters stored at the positions of the records below their floor (`below`, from [`below_floor`]).
    async fn dead_letters_below(
        &self,
        tx: &mut Tx<'_>,
        records: &[Record],
        below: &[bool],
    ) -> Result<std::collections::HashMap<crate::record::Position, (DeadLetterReason, String)>, SinkError> {
        let below: Vec<&Record> = records.iter().zip(below).filter(|(_, b)| **b).map(|(r, _)| r).collect();
        let found = tx.dead_letters_at(&self.pipeline, &below)
            .await
            .map_err(|e| SinkError::new("reading the dead letters of records below the processed floor", e))?;
        Ok(found
            .into_iter()
            .filter_map(|(position, reason, error)| DeadLetterReason::parse(&reason).map(|r| (position, (r, error))))
            .collect())
    }

    /// Says how many records of the batch were below their floor and skipped, once per batch.
    fn log_below_floor(&self, below: &[bool]) {
        let n = below.iter().filter(|b| **b).count();
        if n > 0 {
            tracing::warn!(pipeline = %self.pipeline, records = n,
                "records consumed again from below where this pipeline had processed (the consumer group's offsets \
                 expired or were reset, a new group_id, auto.offset.reset to the log start): skipped as redelivered, \
                 neither claimed nor applied; `idemflow rewind` is the way to consume a range again");
        }
    }
}

/// `tx` back when the batch transaction is still the one opened; otherwise (the side effect ended it itself, a
/// procedure's `COMMIT`) it is rolled back and the error is [`SinkError::TransactionEnded`].
async fn still_open(mut tx: Tx<'_>) -> Result<Tx<'_>, SinkError> {
    if tx.still_open().await.map_err(|e| SinkError::new("checking that the batch transaction is still open", e))? {
        return Ok(tx);
    }
    let _ = tx.rollback().await;
    Err(SinkError::TransactionEnded)
}

/// A savepoint that failed: on MySQL/MariaDB, error 1305 (the savepoint does not exist) means the side effect ended
/// the batch transaction itself (a procedure's `COMMIT`).
fn savepoint_failed(context: &'static str) -> impl FnOnce(sqlx::Error) -> SinkError {
    move |e| if crate::store::error::savepoint_gone(&e) { SinkError::TransactionEnded } else { SinkError::new(context, e) }
}

fn occurrence(record: &Record, prepared: &Prepared) -> Existing {
    let fingerprint = match prepared {
        Prepared::Apply(a) => a.fingerprint.to_vec(),
        _ => Vec::new(),
    };
    Existing { position: record.position.clone(), fingerprint }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offsets::Mark;
    use crate::record::Position;

    fn at(partition: i32, offset: i64, ts: i64) -> Record {
        Record {
            position: Position { topic: "t".into(), partition, offset },
            timestamp_ms: Some(ts),
            key: None,
            headers: vec![],
            payload: None,
            oversized: None,
            properties: Vec::new(),
            delivered_before: None,
            receipt: crate::record::Receipt::NONE,
        }
    }

    /// Every record below a floor is skipped, whatever its timestamp (a topic created again is found by the evidence
    /// about its log, before: [`Processed::renewals`]); nothing is allocated when no record lies below.
    #[test]
    fn every_record_below_the_floor_is_skipped_whatever_its_timestamp() {
        let mark = Mark { next: 100, floor: Some(100), raised_at_ms: Some(1_000), log: None };
        let processed = Processed([(("t".into(), 0), mark.clone()), (("t".into(), 1), mark)].into_iter().collect());
        let batch = [at(1, 0, 500), at(1, 1, 9_000), at(1, 100, 9_001)];
        assert_eq!(below_floor(&batch, &processed), vec![true, true, false], "the newer record below the floor is skipped too");
        assert!(below_floor(&[at(0, 100, 1)], &processed).is_empty(), "nothing below: no allocation");
    }
}
