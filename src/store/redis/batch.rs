//! One batch as one Lua script ([`SCRIPT`], `batch.lua` beside this file), run atomically by Redis.
//!
//! Arguments (all `ARGV`; idemflow refuses Redis Cluster, where a script must declare its keys):
//! `prefix ttl_ms stream seq pipeline token again lane` (`token`: the batch's number, the same on every attempt, empty
//! for none; `again`: `1` when an earlier attempt of this batch failed; `lane`: whose last answer is kept under
//! `<prefix>answer:<lane>`); `NP` and per partition `topic/partition next epoch expected`; `NR` and the
//! stream ids of dead letters being replayed; `NC` and per command `NA` and its arguments, the name first, each
//! `=text` for a constant or `?` for a record's value; then `N` and per record `kind dl_position blob` (`blob`: the
//! dead letter's `meta` JSON, a newline, the payload), followed for kinds `D` (a dead letter) and `DR` (a replayed
//! dead letter failing again) by
//! `topic partition offset reason error`, and for kinds `A` (apply) and `R<done>` (a replayed dead letter, its first
//! `done` commands not run again) by `digest value` and the record's values for the `?`s, in order.
//!
//! Commands, arities and constants go once per batch and only the values per record: Redis builds a Lua string
//! for every argument of a script, and that was most of a batch's time in Redis when each record carried its
//! whole commands.
//!
//! The script answers `{"ok", marks, results}` (marks: each partition's stored position before the batch), or
//! `{"ok", marks, results, "again"}`: an earlier attempt of the batch ran (its answer lost), and this is its answer,
//! kept by that run, nothing written again,
//! `{"refused", {{"fenced"|"lost", "topic/partition", ...}, ...}}` or `{"replayed", id}` (a dead letter being
//! replayed is gone: another replay took it) having written nothing, or Redis's own error of a command that is not
//! the record's fault (`NOPERM`, `OOM`, `READONLY`, ...) raised before any command of that record ran.

use super::{DedupValue, RedisStore};
use crate::metrics::DeadLetterReason;
use crate::offsets::{Positions, Processed};
use crate::record::{Position, Record, NO_PARTITION};
use crate::store::rows::Existing;
use redis::Value;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// The batch script.
pub const SCRIPT: &str = include_str!("batch.lua");

/// The batch script as the client runs it (`EVALSHA` by its SHA-1, loaded on `NOSCRIPT`), hashed once per process.
static BATCH_SCRIPT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| redis::Script::new(SCRIPT));

/// One record sent to the script.
pub enum Item<'a> {
    /// Claim the key; if new, run `commands` (the rendered `[sink] redis`).
    Apply {
        /// The record.
        record: &'a Record,
        /// SHA-256 of the business key.
        digest: [u8; 32],
        /// SHA-256 of the payload.
        fingerprint: [u8; 32],
        /// The record's values for the commands' placeholders ([`crate::store::redis::side_effect::SideEffect::render`]).
        values: Vec<String>,
        /// A dead letter being replayed: how many of its commands took effect when it failed (they are not run again).
        replay_skip: Option<i64>,
    },
    /// Write a dead letter.
    DeadLetter {
        /// The record.
        record: &'a Record,
        /// Why.
        reason: DeadLetterReason,
        /// The error text.
        error: &'a str,
        /// A dead letter being replayed that fails again: written anew even though its position has one.
        replayed: bool,
    },
}

/// What the script did with one [`Item`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ItemResult {
    /// The key was new and every command ran.
    Applied,
    /// The key existed: its value.
    Duplicate(Existing),
    /// The key was new and a command failed: the record was dead-lettered (`new`: for the first time at this
    /// position) after `done` of its commands took effect.
    Failed {
        /// First dead letter at this position.
        new: bool,
        /// Commands that took effect.
        done: i64,
        /// Which command failed, and Redis's error.
        error: String,
    },
    /// The dead letter was written (`true`), or this position had one already (`false`).
    DeadLettered(bool),
}

/// Which attempt of which batch a script run is ([`RedisStore::run_batch`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchAttempt<'a> {
    /// The batch's number, the same on every attempt of it (its first attempt's); `None`: no answer is kept (a
    /// dead letter replayed).
    pub token: Option<i64>,
    /// An earlier attempt of this batch failed: it may have run, its answer lost.
    pub again: bool,
    /// The worker lane, whose last answer is kept.
    pub lane: &'a str,
}

/// A batch the script ran.
#[derive(Debug)]
pub struct Ran {
    /// Per partition, the stored position before the batch: a record below it was processed before.
    pub marks: Processed,
    /// An earlier attempt of this batch ran though its answer was lost: this is its answer, kept by that run;
    /// nothing was written again.
    pub again: bool,
    /// One result per item, in order.
    pub results: Vec<ItemResult>,
    /// The script's round trip.
    pub round_trip: Duration,
}

/// Why a batch did not run.
#[derive(Debug)]
pub enum Refused {
    /// Redis's error (the script did not run, or stopped with an error Redis raised).
    Redis(redis::RedisError),
    /// These partitions were claimed by another worker.
    Fenced(Vec<(String, i32)>),
    /// Redis lost positions this worker had stored or claimed for these partitions.
    Lost(Vec<(String, i32)>),
    /// The dead letter being replayed was taken by another replay meanwhile; nothing was written.
    Replayed(String),
    /// The script answered something it never answers (a bug, or a script of another version under the same SHA).
    Unexpected(String),
}

impl From<redis::RedisError> for Refused {
    fn from(e: redis::RedisError) -> Self {
        Refused::Redis(e)
    }
}

/// What a dead letter keeps besides its position and payload, as JSON in the stream entry's `meta` field.
#[derive(Debug, Default, Deserialize, Serialize)]
pub(crate) struct Meta {
    /// Record key, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Headers: name and hex value (null for a null value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, Option<String>)>,
    /// Message properties.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub properties: Vec<(String, String)>,
    /// The payload is null (a tombstone).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub null: bool,
    /// An oversized payload's full size; the payload field holds its prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// An oversized payload's SHA-256, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

impl Meta {
    fn of(record: &Record) -> Meta {
        Meta {
            key: record.key.as_deref().map(hex::encode),
            headers: record.headers.iter().map(|(k, v)| (k.clone(), v.as_deref().map(hex::encode))).collect(),
            properties: record.properties.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
            null: record.payload.is_none(),
            size: record.oversized.as_ref().map(|o| o.size),
            sha256: record.oversized.as_ref().map(|o| hex::encode(o.sha256)),
        }
    }
}

/// `topic/partition`: a partition's field in the offsets hash (Kafka topic names hold no `/`).
pub(crate) fn partition_field(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}")
}

fn parse_field(field: &str) -> Option<(String, i32)> {
    let (t, p) = field.rsplit_once('/')?;
    Some((t.to_owned(), p.parse().ok()?))
}

impl RedisStore {
    /// Runs one batch of `pipeline` in one script: `positions` (Kafka) fenced and stored, `replaying` (dead-letter
    /// ids) removed, `items` claimed, applied (`template`: the commands, see
    /// [`crate::store::redis::side_effect::SideEffect::template`]) and dead-lettered in order. Records expire
    /// `retention` after they are applied.
    ///
    /// Errors: see [`Refused`]. A refused batch wrote nothing; a Redis error may come after the script ran (a lost
    /// answer): run the same batch again with its `attempt` saying so, and the script answers that run's answer
    /// ([`Ran::again`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn run_batch(
        &self,
        attempt: &BatchAttempt<'_>,
        pipeline: &str,
        retention: Duration,
        positions: Option<&Positions>,
        replaying: &[i64],
        template: &[Vec<Option<String>>],
        items: &[Item<'_>],
    ) -> Result<Ran, Refused> {
        let prefix = self.pipeline_prefix(pipeline);
        let stream = self.dead_letter_stream();
        let mut inv = BATCH_SCRIPT.prepare_invoke();
        inv.arg(&prefix).arg(retention.as_millis().max(1) as u64).arg(&stream).arg(format!("{stream}:seq")).arg(pipeline);
        inv.arg(attempt.token.map_or_else(String::new, |t| t.to_string())).arg(if attempt.again { "1" } else { "0" }).arg(attempt.lane);
        let parts: Vec<(String, i64)> = positions.map_or_else(Vec::new, |p| p.0.iter().map(|(t, p, next, _)| (partition_field(t, *p), *next)).collect());
        inv.arg(parts.len());
        {
            let expected = self.expected();
            for ((field, next), (_, _, _, epoch)) in parts.iter().zip(positions.map_or(&[][..], |p| &p.0[..])) {
                // Without a claim on record, "?" matches no stored position: the batch is refused as lost and the
                // partition claimed again.
                let exp = expected.get(&(pipeline.to_owned(), field.clone())).map_or("?", |(_, next)| next.as_str());
                inv.arg(field).arg(next).arg(epoch).arg(exp);
            }
        }
        inv.arg(replaying.len());
        for id in replaying {
            inv.arg(format!("{id}-0"));
        }
        inv.arg(template.len());
        for command in template {
            inv.arg(command.len());
            for arg in command {
                match arg {
                    Some(text) => inv.arg(format!("={text}")),
                    None => inv.arg("?"),
                };
            }
        }
        inv.arg(items.len());
        let mut blob = Vec::new();
        for item in items {
            push_item(&mut inv, item, &mut blob);
        }
        let started = Instant::now();
        let answer: Result<Value, redis::RedisError> = async { inv.invoke_async(&mut self.conn().await?).await }.await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                self.after_failure(&e).await;
                return Err(Refused::Redis(e));
            }
        };
        let round_trip = started.elapsed();
        let ran = parse_answer(answer, &parts, items.len())?;
        let mut expected = self.expected();
        for ((field, next), (_, _, _, epoch)) in parts.iter().zip(positions.map_or(&[][..], |p| &p.0[..])) {
            let entry = expected.entry((pipeline.to_owned(), field.clone())).or_insert((*epoch, String::new()));
            // A claim of this worker that came in meanwhile holds a newer epoch, and the position it read is this one.
            if entry.0 <= *epoch {
                *entry = (*epoch, next.to_string());
            }
        }
        drop(expected);
        let (marks, again) = (ran.0, ran.2);
        let marks = Processed(
            parts
                .iter()
                .zip(marks)
                .filter_map(|((field, _), mark)| {
                    let (t, p) = parse_field(field)?;
                    let next = mark?;
                    Some(((t.as_str().into(), p), crate::offsets::Mark { next, floor: None, raised_at_ms: None, log: None }))
                })
                .collect(),
        );
        Ok(Ran { marks, results: ran.1, round_trip, again })
    }

    /// Records what this worker claimed for `pipeline` (`(field, epoch, next)`): batches expect to find these
    /// positions.
    pub(crate) fn claimed(&self, pipeline: &str, positions: impl IntoIterator<Item = (String, i64, Option<i64>)>) {
        let mut expected = self.expected();
        for (field, epoch, next) in positions {
            expected.insert((pipeline.to_owned(), field), (epoch, next.map_or_else(|| "-".to_owned(), |n| n.to_string())));
        }
    }

    /// The partitions of `pipeline` among `owned` (assigned to this worker now) whose stored position is no longer
    /// the one this worker stored or claimed under its epoch (Redis lost writes between batches: a restart, a
    /// failover). Partitions another worker claimed since (a higher epoch) are forgotten, not reported.
    ///
    /// Errors: Redis's.
    pub async fn lost_positions(&self, pipeline: &str, owned: &[(String, i32)]) -> Result<Vec<(String, i32)>, redis::RedisError> {
        let owned: Vec<String> = owned.iter().map(|(t, p)| partition_field(t, *p)).collect();
        let mine: Vec<(String, i64, String)> = {
            let mut expected = self.expected();
            // Partitions this worker no longer owns are another's to check.
            expected.retain(|(p, f), _| p != pipeline || owned.contains(f));
            expected.iter().filter(|((p, _), _)| p == pipeline).map(|((_, f), (e, n))| (f.clone(), *e, n.clone())).collect()
        };
        if mine.is_empty() {
            return Ok(Vec::new());
        }
        let fields: Vec<&str> = mine.iter().map(|(f, _, _)| f.as_str()).collect();
        let stored: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(format!("{}offsets", self.pipeline_prefix(pipeline)))
            .arg(&fields)
            .query_async(&mut self.conn().await?)
            .await?;
        let mut lost = Vec::new();
        let mut expected = self.expected();
        for ((field, epoch, next), now) in mine.iter().zip(stored) {
            let (e, n) = now.as_deref().and_then(|v| v.split_once(' ')).map_or((-1, "-"), |(e, n)| (e.parse().unwrap_or(-1), n));
            if e > *epoch {
                expected.remove(&(pipeline.to_owned(), field.clone()));
            } else if e < *epoch || n != next {
                lost.extend(parse_field(field));
            }
        }
        Ok(lost)
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

/// Per partition its mark (`None` before the first batch), per item its result, and whether an earlier attempt's
/// run was read back.
type Parsed = (Vec<Option<i64>>, Vec<ItemResult>, bool);

fn parse_answer(answer: Value, parts: &[(String, i64)], items: usize) -> Result<Parsed, Refused> {
    let unexpected = |what: &str| Refused::Unexpected(format!("the batch script answered {what}"));
    let Value::Array(top) = answer else { return Err(unexpected("a non-array")) };
    match top.first().and_then(text).as_deref() {
        Some("refused") => {
            let Some(Value::Array(bad)) = top.get(1) else { return Err(unexpected("a refusal without partitions")) };
            let (mut fenced, mut lost) = (Vec::new(), Vec::new());
            for b in bad {
                let Value::Array(b) = b else { return Err(unexpected("a malformed refusal")) };
                let (Some(why), Some(tp)) = (b.first().and_then(text), b.get(1).and_then(text).as_deref().and_then(parse_field)) else {
                    return Err(unexpected("a malformed refusal"));
                };
                if why == "fenced" { fenced.push(tp) } else { lost.push(tp) }
            }
            // Fenced wins: the partition is another worker's, whatever this one lost.
            if fenced.is_empty() { Err(Refused::Lost(lost)) } else { Err(Refused::Fenced(fenced)) }
        }
        Some("replayed") => Err(Refused::Replayed(top.get(1).and_then(text).unwrap_or_default())),
        Some("ok") => {
            let (Some(Value::Array(marks)), Some(Value::Array(out))) = (top.get(1), top.get(2)) else {
                return Err(unexpected("no marks or results"));
            };
            if marks.len() != parts.len() || out.len() != items {
                return Err(unexpected("a different number of partitions or records than it was given"));
            }
            let marks = marks.iter().map(int).collect();
            let results = out.iter().map(|r| parse_result(r).ok_or_else(|| unexpected("a malformed record result"))).collect::<Result<_, _>>()?;
            let again = top.get(3).and_then(text).is_some_and(|t| t == "again");
            Ok((marks, results, again))
        }
        _ => Err(unexpected("an unknown status")),
    }
}

fn parse_result(r: &Value) -> Option<ItemResult> {
    if let Value::Int(0) = r {
        return Some(ItemResult::Applied);
    }
    let Value::Array(r) = r else { return None };
    Some(match int(r.first()?)? {
        0 => ItemResult::Applied,
        1 => {
            let v = DedupValue::parse(&text(r.get(1)?)?)?;
            let fingerprint = hex::decode(&v.fingerprint).ok()?;
            ItemResult::Duplicate(Existing { position: Position { topic: v.topic.as_str().into(), partition: v.partition, offset: v.offset }, fingerprint })
        }
        2 => ItemResult::Failed { new: int(r.get(1)?)? == 1, done: int(r.get(3)?)?, error: text(r.get(4)?)? },
        3 => ItemResult::DeadLettered(int(r.get(1)?)? == 1),
        _ => return None,
    })
}
/// Adds one item's arguments to the batch script's invocation: its kind, its dead-letter position, its metadata and
/// payload (in `blob`, reused), then a dead letter's position, reason and error, or a record's key digest, dedup
/// value and side-effect values.
fn push_item(inv: &mut redis::ScriptInvocation<'_>, item: &Item<'_>, blob: &mut Vec<u8>) {
    let record = match item {
        Item::Apply { record, .. } | Item::DeadLetter { record, .. } => record,
    };
    let p = &record.position;
    let kind = match item {
        Item::DeadLetter { replayed: false, .. } => "D".to_owned(),
        Item::DeadLetter { replayed: true, .. } => "DR".to_owned(),
        Item::Apply { replay_skip: Some(done), .. } => format!("R{done}"),
        Item::Apply { .. } => "A".to_owned(),
    };
    // A Kafka position is dead-lettered once; a queue's delivery tag identifies nothing.
    let dl_position = if p.partition == NO_PARTITION { String::new() } else { format!("{}/{}/{}", p.topic, p.partition, p.offset) };
    blob.clear();
    serde_json::to_writer(&mut *blob, &Meta::of(record)).expect("plain data");
    blob.push(b'\n');
    blob.extend_from_slice(record.payload.as_deref().unwrap_or_default());
    inv.arg(kind).arg(dl_position).arg(&blob[..]);
    match item {
        Item::DeadLetter { reason, error, .. } => {
            inv.arg(&*p.topic).arg(p.partition).arg(p.offset).arg(reason.as_str()).arg(*error);
        }
        Item::Apply { digest, fingerprint, values, .. } => {
            inv.arg(hex::encode(digest)).arg(DedupValue::tail(p.partition, p.offset, fingerprint, &p.topic));
            for v in values {
                inv.arg(v);
            }
        }
    }
}

