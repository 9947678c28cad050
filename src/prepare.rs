//! One record through decode, business key and value extraction: everything the sink needs, computed before the
//! transaction opens, so a bad record is classified without touching the database.

use crate::batch::Batch;
use crate::config::{Pipeline, TombstonePolicy};
use crate::store::spec::{Binding, Meta, ValueSource};
use crate::decode::{DecodeError, Decoder, Selection};
use crate::field::{self, Render};
use crate::key::{BusinessKey, KeyError, KeySpec};
use crate::metrics::DeadLetterReason;
use crate::record::{Receipt, Record};
use std::collections::VecDeque;
use serde_json::Value;
use std::borrow::Cow;
use sha2::{Digest, Sha256};
use std::time::{Duration, SystemTime};

/// What the sink does with one record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prepared {
    /// Claim the key; if new, apply the side effect with these values.
    Apply(Apply),
    /// Write to the dead letters.
    DeadLetter(DeadLetter),
    /// A tombstone skipped by policy: no dedup row, no effect.
    Tombstone,
}

use crate::store::rows::Apply;

/// A batch of records, each beside what the sink does with it ([`crate::batch::Batch`]).
pub type PreparedBatch = Batch<Prepared>;

/// Where a value from the payload is in the selected decode.
#[derive(Clone, Copy, Debug)]
struct Slot {
    slot: usize,
    /// No later binding reads this slot: the value is taken, not copied.
    last: bool,
}

/// A record that cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Why, from a closed set.
    pub reason: DeadLetterReason,
    /// The error text, for people.
    pub error: String,
}

impl Prepared {
    fn dead(reason: DeadLetterReason, error: impl ToString) -> Prepared {
        Prepared::DeadLetter(DeadLetter { reason, error: error.to_string() })
    }
}

/// Prepares the records of one pipeline.
#[derive(Clone, Debug)]
pub struct Preparer {
    decoder: Decoder,
    /// For a business key from a field of the record key: how record keys are decoded.
    key_decoder: Option<Decoder>,
    /// The members of a payload the key and the values read: decoding keeps only these.
    selection: Selection,
    key: KeySpec,
    /// The slot of each of the key's paths ([`KeySpec::paths`]) in the selected decode.
    key_slots: Vec<usize>,
    tombstones: TombstonePolicy,
    /// Each value the sink binds, rendered as given, with the slot of its path when it comes from the payload.
    bindings: Vec<(Binding, Render, Option<Slot>)>,
    refuse_naive: bool,
    /// The most bytes a record's values may take in the store ([`Preparer::with_max_record_bytes`]).
    max_record_bytes: Option<u64>,
    /// The pipeline's `time_zone`, for MySQL's time targets ([`field::wall_clock`]); UTC when jiff does not know
    /// the name (a PostgreSQL pipeline, whose server reads the zone itself).
    zone: jiff::tz::TimeZone,
    /// The outbox's requests (`[[sink.http]]`), with the pipeline's name (their idempotency keys') and where their
    /// values start among `bindings` (after the side effect's, each rendered as JSON).
    outbox: Option<(std::sync::Arc<crate::outbox::spec::OutboxSpec>, String, usize)>,
}

impl Preparer {
    /// A preparer for `pipeline`, whose sink binds `bindings` in this order, each rendered as given (from the
    /// target's type: JSON text for `json`/`jsonb`, array literals for arrays, see [`Render`]).
    pub fn new(pipeline: &Pipeline, mut bindings: Vec<(Binding, Render)>) -> Self {
        let outbox = pipeline.outbox.as_ref().map(|o| (std::sync::Arc::new(o.clone()), pipeline.name.clone(), bindings.len()));
        if let Some(o) = &pipeline.outbox {
            bindings.extend(o.params.iter().map(|b| (b.clone(), Render::Json)));
        }
        let mut selection = Selection::default();
        let key_slots = pipeline.key.paths().iter().map(|path| selection.add(path.tokens())).collect();
        let mut bindings: Vec<(Binding, Render, Option<Slot>)> = bindings
            .into_iter()
            .map(|(b, render)| {
                let slot = match &b.source {
                    ValueSource::Field(path) => Some(Slot { slot: selection.add(path.tokens()), last: false }),
                    _ => None,
                };
                (b, render, slot)
            })
            .collect();
        // The last binding to read a slot takes its value; the ones before it copy it.
        let mut seen = std::collections::HashSet::new();
        for (_, _, slot) in bindings.iter_mut().rev() {
            if let Some(s) = slot {
                s.last = seen.insert(s.slot);
            }
        }
        Preparer {
            decoder: pipeline.decoder.clone(),
            key_decoder: pipeline.key_decoder.clone(),
            selection,
            key: pipeline.key.clone(),
            key_slots,
            tombstones: pipeline.tombstones,
            bindings,
            refuse_naive: pipeline.time.naive == crate::store::spec::NaiveTimestamps::DeadLetter,
            max_record_bytes: None,
            zone: jiff::tz::TimeZone::get(&pipeline.time.zone).unwrap_or(jiff::tz::TimeZone::UTC),
            outbox,
        }
    }

    /// The same, refusing a record whose values take more than `limit` bytes in all (`param_invalid`): the store
    /// could not take the statement carrying them (MySQL's `max_allowed_packet`).
    pub fn with_max_record_bytes(self, limit: Option<u64>) -> Self {
        Preparer { max_record_bytes: limit, ..self }
    }

    /// What the sink binds, each as the store prepared it (with its target's type, [`Binding::target_type`]).
    pub fn bindings(&self) -> impl Iterator<Item = &Binding> {
        let sink = self.outbox.as_ref().map_or(self.bindings.len(), |(_, _, from)| *from);
        self.bindings[..sink].iter().map(|(b, ..)| b)
    }

    /// The schema ids `record` waits on, its payload's and its record key's ([`Decoder::schema_to_fetch`]): it is
    /// prepared only once they were fetched. None for an oversized record (a dead letter whatever its schema).
    pub fn schemas_to_fetch(&self, record: &Record) -> impl Iterator<Item = u32> {
        // A tombstone or an oversized record is what it is without its key.
        let decoded = record.oversized.is_none() && record.payload.is_some();
        let value = if decoded { self.decoder.schema_to_fetch(record.payload.as_deref()) } else { None };
        let key = self.key_decoder.as_ref().filter(|_| decoded).and_then(|k| k.schema_to_fetch(record.key.as_deref()));
        value.into_iter().chain(key)
    }

    /// Whether `record` may be prepared ahead of its batch ([`Ahead`]): every schema it names is fetched (a record
    /// naming one still missing is prepared with its batch, after the registry was asked again).
    pub fn prepares_ahead(&self, record: &Record) -> bool {
        self.decoder.decodes_for_good(record.payload.as_deref())
            && self.key_decoder.as_ref().is_none_or(|k| k.decodes_for_good(record.key.as_deref()))
    }

    /// The schema registry's schemas this preparer's decoders read, if any (one cache for the process).
    pub fn schemas(&self) -> Option<&crate::decode::schemas::Schemas> {
        self.decoder.schemas().or_else(|| self.key_decoder.as_ref().and_then(Decoder::schemas))
    }

    /// Decodes the record, takes its key and values. Never fails: failures are dead letters. A record that
    /// names a schema to fetch ([`Preparer::schemas_to_fetch`]) is prepared only after it was fetched.
    pub fn prepare(&self, record: &Record) -> Prepared {
        let Some(payload) = record.payload.as_deref() else {
            return match self.tombstones {
                TombstonePolicy::Skip => Prepared::Tombstone,
                TombstonePolicy::DeadLetter => Prepared::dead(DeadLetterReason::Tombstone, "the record value is null"),
            };
        };
        if let Some(o) = &record.oversized {
            let e = DecodeError::TooLarge { size: o.size as usize, limit: self.decoder.max_payload_bytes() };
            return Prepared::dead(DeadLetterReason::PayloadTooLarge, e);
        }
        let mut doc = match self.decoder.decode_selected(payload, &self.selection) {
            Ok(doc) => doc,
            Err(e @ DecodeError::TooLarge { .. }) => return Prepared::dead(DeadLetterReason::PayloadTooLarge, e),
            Err(e) => return Prepared::dead(DeadLetterReason::DecodeFailed, e),
        };
        let record_key = match self.record_key(record) {
            Ok(k) => k,
            Err(dead) => return dead,
        };
        let key = match self.key.extract_found(record, |i| match &record_key {
            Some(k) => k.as_ref(),
            None => self.key_slots.get(i).and_then(|s| doc.get(*s)),
        }) {
            Ok(key) => key,
            Err(e @ KeyError::Missing { .. }) => return Prepared::dead(DeadLetterReason::KeyMissing, e),
            Err(e @ KeyError::Invalid { .. }) => return Prepared::dead(DeadLetterReason::KeyInvalid, e),
        };
        let mut values = Vec::with_capacity(self.bindings.len());
        for (binding, render, slot) in &self.bindings {
            let found = match slot {
                Some(Slot { slot, last: true }) => doc.take(*slot).map(Cow::Owned),
                Some(Slot { slot, last: false }) => doc.get(*slot).map(Cow::Borrowed),
                None => None,
            };
            let v = match value(binding, *render, self.refuse_naive, record, found, &key) {
                Ok(Some(v)) if matches!(render, Render::UtcWallClock | Render::LocalWallClock) => match field::wall_clock(v, *render, &self.zone) {
                    Ok(v) => Some(v),
                    Err(e) => return Prepared::dead(DeadLetterReason::ParamInvalid, format!("{}: {e}", binding.name)),
                },
                Ok(v) => v,
                Err(dead) => return dead,
            };
            // A value its column would round is refused, unless the column says it may (crate::rounding).
            if let (Some(v), Some(limit), false) = (&v, &binding.limit, binding.round) {
                if let Err(why) = limit.check(v) {
                    return Prepared::dead(DeadLetterReason::ParamInvalid, format!("{}: {why}", binding.name));
                }
            }
            values.push(v);
        }
        let requests = match &self.outbox {
            Some((spec, pipeline, from)) => match spec.render(pipeline, &key, payload, &values.split_off(*from)) {
                Ok(requests) => requests,
                Err(why) => return Prepared::dead(DeadLetterReason::ParamInvalid, why),
            },
            None => Vec::new(),
        };
        if let Some(limit) = self.max_record_bytes {
            let size: u64 = values.iter().flatten().map(|v| v.len() as u64).sum::<u64>() + key.text.len() as u64;
            if size > limit {
                return Prepared::dead(
                    DeadLetterReason::ParamInvalid,
                    format!(
                        "the record's key and values take {size} bytes, more than one statement can carry to the server \
                         ({limit} bytes under its max_allowed_packet): raise max_allowed_packet to apply such records"
                    ),
                );
            }
        }
        Prepared::Apply(Apply { key, fingerprint: Sha256::digest(payload).into(), values, requests })
    }
}

impl Preparer {
    /// For a business key from a field of the record key: the value at that field of the decoded record key
    /// (`Some(None)` when the record key has no such field, or there is no record key). `Ok(None)` for any other key.
    fn record_key(&self, record: &Record) -> Result<Option<Option<Value>>, Prepared> {
        let (crate::key::KeySource::RecordKeyField(path), Some(decoder)) = (&self.key.source, &self.key_decoder) else { return Ok(None) };
        let Some(bytes) = record.key.as_deref() else { return Ok(Some(None)) };
        match decoder.decode(bytes) {
            Ok(doc) => Ok(Some(path.lookup(&doc).cloned())),
            Err(e) => Err(Prepared::dead(DeadLetterReason::DecodeFailed, format!("the record key: {e}"))),
        }
    }
}

/// Records prepared before their batch is cut. While a batch is in its transaction the worker prepares the
/// records its source receives meanwhile ([`crate::source::Source::poll_while_receiving`]), so that the next
/// batch's decoding, keys and values are done when that transaction ends instead of after it. At most one batch's
/// worth is kept ([`Ahead::new`]), the first records received: when the source already keeps more than a batch
/// (a Kafka backlog during a long transaction), the later ones are prepared with their batch. The memory this
/// takes is one batch's decoded values and keys per lane, beside the records the source keeps.
///
/// An entry is used only for the very record it was prepared from: it is found by the record's [`Receipt`] (never
/// given twice in a process), and [`Preparer::prepare`] depends on nothing but the record and the preparer. A
/// record dropped before its batch (its partition revoked, its channel lost) leaves its entry unused; a batch drops
/// every entry received before the records it takes. The entries belong to the preparer that made them: the worker
/// clears them ([`Ahead::clear`]) when it rebuilds its statements after a schema change.
#[derive(Debug, Default)]
pub struct Ahead {
    /// In the order the records were received (increasing receipts).
    entries: VecDeque<(Receipt, Prepared)>,
    limit: usize,
    /// Entries used for their record, and dropped unused, since [`Ahead::tally`] was last asked.
    used: u64,
    dropped: u64,
}

impl Ahead {
    /// Keeps at most `limit` prepared records (the pipeline's `batch.max_records`).
    pub fn new(limit: usize) -> Self {
        Ahead { limit, ..Ahead::default() }
    }

    /// Prepares `record` now, for its batch later, unless it has no receipt or the limit is reached.
    pub fn offer(&mut self, record: &Record, preparer: &Preparer) {
        let newest = self.entries.back().map_or(Receipt::NONE, |(r, _)| *r);
        if record.receipt == Receipt::NONE || self.entries.len() >= self.limit || record.receipt <= newest {
            return;
        }
        // Its schema is fetched before its batch is prepared (the worker's own step, which may pause).
        if !preparer.prepares_ahead(record) {
            return;
        }
        // A panic here (a bug) would unwind while the batch before is in its transaction: the record is left to be
        // prepared with its batch instead, where a panic stops the pipeline before anything of it is written.
        if let Ok(prepared) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| preparer.prepare(record))) {
            self.entries.push_back((record.receipt, prepared));
        }
    }

    /// The batch of `records`, each with what `preparer` makes of it: prepared ahead where it was, now otherwise.
    /// Entries of records received before the batch's last one and not in it are dropped (their records were
    /// dropped).
    pub fn take(&mut self, records: Vec<Record>, preparer: &Preparer) -> PreparedBatch {
        Batch::new(records, |record| {
            while self.entries.front().is_some_and(|(r, _)| *r < record.receipt) {
                self.entries.pop_front();
                self.dropped += 1;
            }
            match self.entries.front() {
                // Never an entry for Receipt::NONE (see `offer`).
                Some((r, _)) if *r == record.receipt => {
                    self.used += 1;
                    self.entries.pop_front().map_or_else(|| preparer.prepare(record), |(_, p)| p)
                }
                _ => preparer.prepare(record),
            }
        })
    }

    /// Drops every entry: they were made by a preparer the worker no longer uses.
    pub fn clear(&mut self) {
        self.dropped += self.entries.len() as u64;
        self.entries.clear();
    }

    /// Entries used and dropped since the last call (for `idemflow_records_prepared_ahead_total`).
    pub fn tally(&mut self) -> (u64, u64) {
        (std::mem::take(&mut self.used), std::mem::take(&mut self.dropped))
    }
}

/// The value `binding` binds for `record`; `field` is what the payload holds at the binding's path, for a value
/// from the payload.
fn value(
    binding: &Binding,
    render: Render,
    refuse_naive: bool,
    record: &Record,
    field: Option<Cow<'_, Value>>,
    key: &BusinessKey,
) -> Result<Option<String>, Prepared> {
    let invalid = |e: &dyn std::fmt::Display| {
        Prepared::dead(DeadLetterReason::ParamInvalid, format!("{}: {e}", binding.name))
    };
    let utf8 = |bytes: Option<&[u8]>| -> Result<Option<String>, Prepared> {
        bytes
            .map(|b| match std::str::from_utf8(b) {
                Ok(s) if s.contains('\0') => Err(invalid(&field::ValueError::Nul)),
                Ok(s) if render == Render::Json => Ok(Value::String(s.to_owned()).to_string()),
                Ok(s) => field::render_cow(Cow::Owned(Value::String(s.to_owned())), render, refuse_naive).map_err(|e| invalid(&e)),
                Err(e) => Err(invalid(&format!("not UTF-8: {e}"))),
            })
            .transpose()
    };
    let found: Option<String> = match &binding.source {
        ValueSource::Field(_) => match field {
            None => None,
            Some(v) if v.is_null() => None,
            Some(v) => Some(field::render_cow(v, render, refuse_naive).map_err(|e| invalid(&e))?),
        },
        ValueSource::RecordKey => utf8(record.key.as_deref())?,
        ValueSource::Header(name) => utf8(record.header(name).flatten())?,
        ValueSource::Property(name) => utf8(record.property(name).map(str::as_bytes))?,
        ValueSource::Meta(meta) => {
            let text = match meta {
                Meta::Topic => Some(record.position.topic_name().to_owned()),
                Meta::Partition => Some(record.position.partition.to_string()),
                Meta::Offset => Some(record.position.offset.to_string()),
                Meta::Timestamp => record.timestamp_ms.and_then(|ms| u64::try_from(ms).ok()).map(|ms| {
                    humantime::format_rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
                }),
                Meta::BusinessKey => Some(key.text.clone()),
            };
            match (text, render) {
                (Some(t), Render::Json) => Some(Value::String(t).to_string()),
                (t, _) => t,
            }
        }
    };
    match found {
        Some(v) => Ok(Some(v)),
        None => match &binding.default {
            // For json/jsonb targets a default is JSON text when it parses as JSON, otherwise a JSON string.
            Some(d) if render == Render::Json && serde_json::from_str::<Value>(d).is_err() => {
                Ok(Some(Value::String(d.clone()).to_string()))
            }
            Some(d) => Ok(Some(d.clone())),
            None if binding.optional => Ok(None),
            None => Err(Prepared::dead(
                DeadLetterReason::ParamMissing,
                format!("required value {} ({}) is missing or null", binding.name, describe(&binding.source)),
            )),
        },
    }
}

fn describe(source: &ValueSource) -> String {
    match source {
        ValueSource::Field(p) => p.to_string(),
        ValueSource::RecordKey => "the record key".to_owned(),
        ValueSource::Header(h) => format!("header {h:?}"),
        ValueSource::Property(p) => format!("property {p}"),
        ValueSource::Meta(m) => format!("{m:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::template::Dialect;
    use crate::record::Position;
    use std::path::Path;
    use std::sync::Arc;

    fn binding(name: &str, path: &str) -> (Binding, Render) {
        let source = ValueSource::Field(crate::field::FieldPath::parse(path).unwrap());
        let b = Binding { name: name.into(), source, default: None, optional: true, declared: None, type_name: None, round: false, limit: None, target_type: None };
        (b, Render::Text)
    }

    fn record(payload: &str) -> Record {
        Record {
            position: Position { topic: Arc::from("t"), partition: 0, offset: 7 },
            timestamp_ms: None,
            key: None,
            headers: Vec::new(),
            payload: Some(payload.as_bytes().to_vec()),
            oversized: None,
            properties: Vec::new(),
            delivered_before: None,
            receipt: crate::record::Receipt::NONE,
        }
    }

    /// A path the key and several values read is read once and given to each (the last reader takes it, the others
    /// copy it); a path the payload lacks, or holds a scalar on the way to, binds NULL.
    #[test]
    fn values_sharing_a_path_each_get_it() {
        let text = "topics = [\"t\"]\n[key]\nfield = \"/order/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\na = \"/a\"\n";
        let pipeline = crate::config::pipeline::load_text_in(text, Path::new("p.toml"), Dialect::Postgres).unwrap();
        let bindings = vec![
            binding("id", "/order/id"),
            binding("again", "/order/id"),
            binding("amount", "/order/amount"),
            binding("missing", "/order/note"),
            binding("through", "/order/id/x"),
            binding("id_last", "/order/id"),
        ];
        let p = Preparer::new(&pipeline, bindings);
        let Prepared::Apply(a) = p.prepare(&record(r#"{"order":{"id":"A-1","amount":12.50},"other":[1]}"#)) else { panic!() };
        assert_eq!(a.key.text, "A-1");
        let some = |s: &str| Some(s.to_owned());
        assert_eq!(a.values, [some("A-1"), some("A-1"), some("12.50"), None, None, some("A-1")]);
    }

    /// A record prepared ahead is found again only by its own receipt: the batch gets exactly what preparing it now
    /// would give; entries of records dropped before their batch are dropped, records without a receipt and past
    /// the limit are prepared when their batch comes, and `clear` drops everything (a rebuilt preparer).
    #[test]
    fn records_prepared_ahead_are_used_only_for_themselves() {
        use crate::record::Receipt;
        let text = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\na = \"/a\"\n";
        let pipeline = crate::config::pipeline::load_text_in(text, Path::new("p.toml"), Dialect::Postgres).unwrap();
        let p = Preparer::new(&pipeline, vec![binding("a", "/a")]);
        let received = |id: &str| Record { receipt: Receipt::next(), ..record(&format!(r#"{{"id":"{id}","a":"{id}"}}"#)) };
        let (r1, r2, r3, r4) = (received("1"), received("2"), received("3"), received("4"));
        let mut ahead = Ahead::new(3);
        for r in [&r1, &r2, &r3, &r4] {
            ahead.offer(r, &p);
        }
        ahead.offer(&r2, &p); // already offered: not twice
        // r1 was dropped (its partition revoked); r4 was past the limit; a record without a receipt is never found.
        let unnumbered = record(r#"{"id":"x","a":"x"}"#);
        let batch = [r2.clone(), r3.clone(), r4.clone(), unnumbered.clone()];
        let got = ahead.take(batch.to_vec(), &p);
        assert_eq!(got.prepared(), batch.iter().map(|r| p.prepare(r)).collect::<Vec<_>>());
        assert_eq!(ahead.tally(), (2, 1), "r2 and r3 used, r1 dropped");
        // Another record at r2's position, received again (a new channel): prepared anew, not r2's entry.
        let again = Record { receipt: Receipt::next(), ..record(r#"{"id":"other","a":"other"}"#) };
        let mut ahead = Ahead::new(10);
        ahead.offer(&r2, &p);
        let got = ahead.take(vec![again], &p);
        let Prepared::Apply(a) = &got.prepared()[0] else { panic!() };
        assert_eq!(a.key.text, "other");
        assert_eq!(ahead.tally(), (0, 1));
        ahead.offer(&received("5"), &p);
        ahead.clear();
        assert_eq!(ahead.tally(), (0, 1));
        assert!(ahead.entries.is_empty());
    }

    /// A prepared batch that lost records in the middle, or whose statements were rebuilt, pairs each record with
    /// its own values, as preparing it now would: the batch keeps its parts together through every change.
    #[test]
    fn a_changed_batch_keeps_each_record_with_its_own_values() {
        use crate::record::Receipt;
        let text = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\na = \"/a\"\n";
        let pipeline = crate::config::pipeline::load_text_in(text, Path::new("p.toml"), Dialect::Postgres).unwrap();
        let p = Preparer::new(&pipeline, vec![binding("a", "/a")]);
        let received = |id: &str| Record { receipt: Receipt::next(), ..record(&format!(r#"{{"id":"{id}","a":"{id}"}}"#)) };
        let mut ahead = Ahead::new(10);
        let mut batch = ahead.take(vec![received("1"), received("2"), received("3")], &p);
        let keys = |batch: &PreparedBatch| -> Vec<String> {
            batch.prepared().iter().map(|x| match x { Prepared::Apply(a) => a.key.text.clone(), _ => "-".into() }).collect()
        };
        let fresh = |batch: &PreparedBatch| batch.records().iter().map(|r| p.prepare(r)).collect::<Vec<_>>();
        assert_eq!(keys(&batch), ["1", "2", "3"]);
        let two = batch.records()[1].receipt;
        batch.retain(|r| r.receipt != two);
        assert_eq!(keys(&batch), ["1", "3"], "a record dropped in the middle");
        assert_eq!(batch.prepared(), fresh(&batch));
        let rebuilt = Preparer::new(&pipeline, vec![binding("a", "/id")]);
        batch.prepare_again(|r| rebuilt.prepare(r));
        assert_eq!(batch.prepared(), batch.records().iter().map(|r| rebuilt.prepare(r)).collect::<Vec<_>>(), "statements rebuilt");
    }
}
