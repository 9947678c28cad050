//! Batches: how a pipeline's records are grouped into batch transactions (`[batch]`), and one batch as one value
//! ([`Batch`]). A leaf the worker, the sink, the sources and the configuration share.

use crate::offsets::{Logs, NextOffsets};
use crate::record::{Receipt, Record};
use std::time::Duration;

/// Default `batch.max_records`.
pub const DEFAULT_MAX_RECORDS: usize = 2000;
/// Default `batch.max_wait`.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(20);
/// How many records a batch may hold and how long the worker waits to fill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSettings {
    /// At most this many records per batch (and per transaction), at least 1.
    pub max_records: usize,
    /// After the first record of a batch arrives, wait at most this long for more.
    pub max_wait: Duration,
    /// At most this many batch transactions at once, on disjoint partitions (`batch.concurrency`, 1 to
    /// [`MAX_CONCURRENCY`], default 1): one Kafka consumer per transaction in the pipeline's consumer group, so
    /// Kafka's group assignment keeps each partition on one of them (its order kept, its offsets committed after its
    /// own batches commit).
    pub concurrency: usize,
}

/// The largest `batch.concurrency`.
pub const MAX_CONCURRENCY: usize = 64;


/// One batch, as one value: its records in the order received, beside each its prepared form (`P`: what the
/// worker made of the record: decoded, keyed, its values taken), and the positions computed from the records once
/// ([`NextOffsets::after`], [`NextOffsets::first_of`]).
///
/// The parts cannot fall out of step: every operation that changes the records (dropping a revoked partition's
/// records, re-preparing after the statements were rebuilt) changes the prepared forms and the positions with them,
/// and nothing gives out one part to be changed alone. The worker hands it to the sink ([`crate::sink::Sink::apply`])
/// and then to the source's commit; sources see it through [`Records`], which lets them take records out and never
/// put any in.
#[derive(Clone, Debug)]
pub struct Batch<P> {
    /// Invariant: `prepared[i]` was made from `records[i]`; `next` and `first` were computed from `records`.
    records: Vec<Record>,
    prepared: Vec<P>,
    next: NextOffsets,
    first: NextOffsets,
    /// What the source said of its partitions' logs when the batch was attempted ([`Batch::observe_logs`]).
    logs: Logs,
}

impl<P> Batch<P> {
    /// The batch of `records`, each prepared by `prepare` (called once per record, in order).
    pub fn new(records: Vec<Record>, prepare: impl FnMut(&Record) -> P) -> Self {
        let prepared = records.iter().map(prepare).collect();
        let (next, first) = (NextOffsets::after(&records), NextOffsets::first_of(&records));
        Batch { records, prepared, next, first, logs: Logs::default() }
    }

    /// A batch of one record and its prepared form (a dead letter replayed alone).
    pub fn single(record: Record, prepared: P) -> Self {
        let records = vec![record];
        let (next, first) = (NextOffsets::after(&records), NextOffsets::first_of(&records));
        Batch { records, prepared: vec![prepared], next, first, logs: Logs::default() }
    }

    /// The records, in the order received.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// The prepared forms: the `i`th belongs to the `i`th record.
    pub fn prepared(&self) -> &[P] {
        &self.prepared
    }

    /// Each record with its prepared form.
    pub fn iter(&self) -> impl Iterator<Item = (&Record, &P)> {
        self.records.iter().zip(&self.prepared)
    }

    /// How many records it holds.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether it holds no record (every one dropped: its partitions revoked).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The positions to commit once the batch is durable: per partition, the highest offset + 1
    /// ([`NextOffsets::after`]).
    pub fn next_offsets(&self) -> &NextOffsets {
        &self.next
    }

    /// Where the batch starts on each partition ([`NextOffsets::first_of`]).
    pub fn first_offsets(&self) -> &NextOffsets {
        &self.first
    }

    /// What the source said of the logs of the batch's partitions (their identity, where they end) when the batch
    /// was last attempted; empty where it says nothing ([`crate::source::contract::Connector::logs`]).
    pub fn logs(&self) -> &Logs {
        &self.logs
    }

    /// Keeps what the source says of the logs of the batch's partitions now, for the attempt about to start: the
    /// batch transaction judges its processed marks on it ([`crate::offsets::Processed::renewals`]).
    pub fn observe_logs(&mut self, logs: Logs) {
        self.logs = logs;
    }

    /// The receipts of its records, in order: which records an attempt was made for.
    pub fn receipts(&self) -> Vec<Receipt> {
        self.records.iter().map(|r| r.receipt).collect()
    }

    /// Keeps the records for which `keep` is true, each with its prepared form; the positions are computed again
    /// when a record went. Returns how many went.
    pub fn retain(&mut self, mut keep: impl FnMut(&Record) -> bool) -> usize {
        let before = self.records.len();
        let kept: Vec<bool> = self.records.iter().map(&mut keep).collect();
        if kept.iter().all(|k| *k) {
            return 0;
        }
        let mut flags = kept.iter();
        self.prepared.retain(|_| *flags.next().unwrap_or(&false));
        let mut flags = kept.iter();
        self.records.retain(|_| *flags.next().unwrap_or(&false));
        self.next = NextOffsets::after(&self.records);
        self.first = NextOffsets::first_of(&self.records);
        before - self.records.len()
    }

    /// Prepares every record again (the statements were rebuilt: what was prepared through the old ones is dropped).
    pub fn prepare_again(&mut self, prepare: impl FnMut(&Record) -> P) {
        self.prepared = self.records.iter().map(prepare).collect();
    }

    /// Its records, without their prepared forms.
    pub fn into_records(self) -> Vec<Record> {
        self.records
    }
}

/// What a source may do to a batch (or to its own buffer of records): look at the records, and take some out. A
/// source never adds a record to a batch, nor sees its prepared forms.
pub trait Records: Send {
    /// The records, in order.
    fn records(&self) -> &[Record];

    /// Keeps the records for which `keep` is true (with whatever belongs to them). Returns how many went.
    fn retain_records(&mut self, keep: &mut dyn FnMut(&Record) -> bool) -> usize;
}

impl Records for Vec<Record> {
    fn records(&self) -> &[Record] {
        self
    }

    fn retain_records(&mut self, keep: &mut dyn FnMut(&Record) -> bool) -> usize {
        let before = self.len();
        self.retain(|r| keep(r));
        before - self.len()
    }
}

impl<P: Send> Records for Batch<P> {
    fn records(&self) -> &[Record] {
        &self.records
    }

    fn retain_records(&mut self, keep: &mut dyn FnMut(&Record) -> bool) -> usize {
        self.retain(keep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Position;
    use std::sync::Arc;

    fn record(partition: i32, offset: i64) -> Record {
        Record {
            position: Position { topic: Arc::from("t"), partition, offset },
            timestamp_ms: None,
            key: None,
            headers: Vec::new(),
            payload: Some(format!("{partition}:{offset}").into_bytes()),
            oversized: None,
            properties: Vec::new(),
            delivered_before: None,
            receipt: Receipt::next(),
        }
    }

    /// What a record's prepared form is made of here: its own payload, so a record paired with another's is seen.
    fn prepare(r: &Record) -> String {
        String::from_utf8(r.payload.clone().unwrap_or_default()).unwrap()
    }

    fn assert_aligned(batch: &Batch<String>) {
        assert_eq!(batch.records().len(), batch.prepared().len());
        for (r, p) in batch.iter() {
            assert_eq!(&prepare(r), p, "record at {} paired with another record's prepared form", r.position);
        }
        assert_eq!(batch.next_offsets(), &NextOffsets::after(batch.records()));
        assert_eq!(batch.first_offsets(), &NextOffsets::first_of(batch.records()));
    }

    /// Every operation keeps each record beside its own prepared form and the positions computed from the records
    /// it holds: dropping a partition's records (a revocation), dropping one in the middle (a fenced record's
    /// partition), preparing again (statements rebuilt), one record alone, and the view sources get.
    #[test]
    fn the_parts_stay_aligned_through_every_operation() {
        let records = vec![record(0, 5), record(1, 9), record(0, 6), record(1, 10), record(2, 1), record(0, 7)];
        let mut batch = Batch::new(records, prepare);
        assert_aligned(&batch);
        assert_eq!(batch.next_offsets().0.get(&(Arc::from("t"), 1)), Some(&11));

        // A revoked partition's records go, through the view a source gets.
        let view: &mut dyn Records = &mut batch;
        assert_eq!(view.retain_records(&mut |r| r.position.partition != 1), 2);
        assert_aligned(&batch);
        assert_eq!(batch.len(), 4);
        assert_eq!(batch.next_offsets().0.get(&(Arc::from("t"), 1)), None, "no commit for a partition it no longer holds");

        // One record in the middle goes.
        assert_eq!(batch.retain(|r| r.position.offset != 6), 1);
        assert_aligned(&batch);
        assert_eq!(batch.first_offsets().0.get(&(Arc::from("t"), 0)), Some(&5));
        assert_eq!(batch.next_offsets().0.get(&(Arc::from("t"), 0)), Some(&8));

        // Nothing goes: nothing changes.
        let before = batch.receipts();
        assert_eq!(batch.retain(|_| true), 0);
        assert_eq!(batch.receipts(), before);

        // Prepared again (after a rebuild): still each record's own.
        let mut calls = 0;
        batch.prepare_again(|r| {
            calls += 1;
            prepare(r)
        });
        assert_eq!(calls, batch.len());
        assert_aligned(&batch);

        // A record alone.
        let one = Batch::single(record(3, 42), "3:42".to_owned());
        assert_aligned(&one);
        assert_eq!(one.next_offsets().0.get(&(Arc::from("t"), 3)), Some(&43));

        // Every record goes.
        batch.retain(|_| false);
        assert!(batch.is_empty());
        assert_aligned(&batch);
        assert!(batch.next_offsets().0.is_empty());
    }

    /// Records without positions to commit (a queue's deliveries) are in the batch and its prepared forms, never in
    /// its offsets.
    #[test]
    fn queue_deliveries_have_no_offsets() {
        let mut r = record(0, 1);
        r.delivered_before = Some(false);
        let batch = Batch::new(vec![r], prepare);
        assert_eq!(batch.len(), 1);
        assert!(batch.next_offsets().0.is_empty());
        assert!(batch.first_offsets().0.is_empty());
    }
}
