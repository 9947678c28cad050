//! `pipelines/<name>.toml`: one pipeline per file, raw TOML validated into a [`Pipeline`].
//!
//! Every problem found in a file is reported, not just the first, and each names the file, the pipeline and the
//! field: `pipelines/payments.toml: pipeline "payments": key.field: "/order//id" has an empty segment ...`.

use crate::decode::{Decoder, Format};
use crate::key::{KeySource, KeySpec};
use crate::store::template::Dialect;
use serde::Deserialize;
use crate::source::spec::SourceKeys;
use crate::validate::Problems as _;
use crate::batch::{BatchSettings, DEFAULT_MAX_RECORDS, DEFAULT_MAX_WAIT, MAX_CONCURRENCY};
use crate::dead_letter::DeadLetterSettings;
use crate::offsets::OffsetStore;
use crate::source::spec::SourceSpec;
use crate::store::spec::{Meta, SinkSpec, StoreKind, TimeSettings, ValueSource};
use super::sink::{path_or_error, validate_sink, RawSink};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default `max_payload_bytes`: 4 MiB (Kafka's own default record limit is about 1 MiB).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 4 << 20;

/// One validated pipeline: topics in, side effect out.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// The pipeline's name: `[a-z0-9_-]`, 1 to 63 characters; the file stem unless `name` is set. Used as the
    /// `pipeline` column of the dedup store and the `pipeline` label of every metric.
    pub name: String,
    /// The file it was read from.
    pub file: PathBuf,
    /// Where records come from: Kafka topics or RabbitMQ queues (`[source]`).
    pub source: SourceSpec,
    /// How payloads are decoded.
    pub decoder: Decoder,
    /// How record keys are decoded, for a business key from a field of the record key (`[key] record_key = "/id"`).
    pub key_decoder: Option<Decoder>,
    /// Where the business key comes from.
    pub key: KeySpec,
    /// What happens to a null value (a tombstone).
    pub tombstones: TombstonePolicy,
    /// The side effect.
    pub sink: SinkSpec,
    /// Batch bounds.
    pub batch: BatchSettings,
    /// Dead-letter limits and the optional dead-letter topic.
    pub dead_letters: DeadLetterSettings,
    /// Retention of the pipeline's dedup rows.
    pub dedup: DedupSettings,
    /// Where the consumed position of each partition is kept.
    pub offsets: OffsetStore,
    /// How timestamps without a UTC offset are read (`[sink] time_zone`, `naive_timestamps`).
    pub time: TimeSettings,
    /// The requests each new business key sends through the outbox (`[[sink.http]]`, `[outbox]`); `None` without.
    pub outbox: Option<crate::outbox::spec::OutboxSpec>,
}

/// `[dedup]`: how long dedup rows are kept, and how they are purged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DedupSettings {
    /// Dedup rows older than this are deleted (default 7 days). A record redelivered after its row was purged is
    /// applied again, so this must cover the longest redelivery window (the topic's `retention.ms`).
    pub retention: Duration,
    /// How long the worker waits between two passes of its retention sweep (default 1 minute).
    pub purge_interval: Duration,
    /// Rows a slice of the sweep examines, one short transaction each (default 5000).
    pub purge_batch: u32,
    /// Rows the worker's sweep examines per second at most, its pace (default 5000: a pass over 10 million rows in
    /// about 35 minutes).
    pub purge_rate: u32,
    /// `new_history` (default false): start this pipeline's history even though its topics hold records another
    /// pipeline of the store (one not configured here) has processed. Without it a pipeline with no history of its
    /// own is refused there: a renamed pipeline file would apply every record still in the topics again
    /// ([`crate::worker::prepare`]).
    pub new_history: bool,
}

impl Default for DedupSettings {
    fn default() -> Self {
        DedupSettings {
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
            purge_batch: 5000,
            purge_rate: 5000,
            new_history: false,
        }
    }
}

/// What the worker does with a record whose value is null (a tombstone on a compacted topic).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TombstonePolicy {
    /// Skip it and count it in `idemflow_tombstones_skipped_total`; it writes no dedup row.
    #[default]
    Skip,
    /// Send it to the dead letters with reason `tombstone`.
    DeadLetter,
}

impl Pipeline {
    /// What its store's durability report needs of it ([`crate::store::contract::Tenant`]).
    pub fn tenant(&self) -> crate::store::contract::Tenant {
        crate::store::contract::Tenant { name: self.name.clone(), retention: self.dedup.retention, has_positions: self.source.positional() }
    }

    /// What its source is given of it ([`crate::source::spec::SourceContext`]).
    pub fn source_context(&self) -> crate::source::spec::SourceContext {
        crate::source::spec::SourceContext {
            name: self.name.clone(),
            source: self.source.clone(),
            batch: self.batch,
            max_payload_bytes: self.decoder.max_payload_bytes(),
            dedup_retention: self.dedup.retention,
            dead_letters: self.dead_letters.clone(),
            offsets: self.offsets,
        }
    }
}

/// A problem with one pipeline file.
#[derive(Debug, PartialEq, Eq)]
pub struct PipelineError {
    /// The file, as given.
    pub file: String,
    /// The pipeline's name (the file stem when the name itself is unreadable).
    pub pipeline: String,
    /// The field, as a TOML path such as `key.field` or `sink.params.amount`; empty for a whole-file error.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl PipelineError {
    /// The problems it holds, one each: a store that checked the whole side effect at once reports several under
    /// `sink`, one per line (`sink.columns.x: ...`), so `check` shows and counts each on its own line.
    pub fn split(self) -> Vec<PipelineError> {
        let parts: Vec<&str> = self.message.split("\n  ").collect();
        let fields: Option<Vec<(&str, &str)>> = parts
            .iter()
            .map(|p| p.split_once(": ").filter(|(f, _)| f.starts_with("sink") && !f.contains(char::is_whitespace)))
            .collect();
        match fields {
            Some(fields) if self.field == "sink" && fields.len() > 1 => fields
                .into_iter()
                .map(|(field, message)| PipelineError { file: self.file.clone(), pipeline: self.pipeline.clone(), field: field.to_owned(), message: message.to_owned() })
                .collect(),
            _ => vec![self],
        }
    }
}

impl std::fmt::Display for PipelineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: ", self.file)?;
        if !self.pipeline.is_empty() {
            write!(f, "pipeline {:?}: ", self.pipeline)?;
        }
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for PipelineError {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPipeline {
    name: Option<String>,
    topics: Option<Vec<String>>,
    group_id: Option<String>,
    source: Option<SourceKeys>,
    #[serde(default)]
    format: Format,
    schema_file: Option<PathBuf>,
    message: Option<String>,
    #[serde(default)]
    subject_name_strategy: crate::decode::SubjectNameStrategy,
    record_name: Option<String>,
    max_payload_bytes: Option<usize>,
    #[serde(default)]
    tombstones: TombstonePolicy,
    key: RawKey,
    sink: RawSink,
    #[serde(default)]
    batch: RawBatch,
    #[serde(default)]
    dead_letters: RawDeadLetters,
    #[serde(default)]
    dedup: RawDedup,
    #[serde(default)]
    offsets: RawOffsets,
    #[serde(default)]
    outbox: crate::outbox::spec::RawOutbox,
}



#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOffsets {
    store: Option<OffsetStore>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDedup {
    #[serde(default, with = "humantime_serde")]
    retention: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    purge_interval: Option<Duration>,
    purge_batch: Option<u32>,
    purge_rate: Option<u32>,
    new_history: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDeadLetters {
    max_ratio: Option<f64>,
    window: Option<u64>,
    min_records: Option<u64>,
    topic: Option<String>,
    exchange: Option<String>,
    routing_key: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    field: Option<String>,
    fields: Option<Vec<String>>,
    record_key: Option<RecordKey>,
    record_key_format: Option<Format>,
    header: Option<String>,
    property: Option<String>,
    message_id: Option<bool>,
    message_key: Option<bool>,
    #[serde(default)]
    allow_empty: bool,
    max_bytes: Option<usize>,
}

/// `[key] record_key`: `true` (the record key's bytes as UTF-8), or a path into the decoded record key.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum RecordKey {
    Whole(bool),
    Path(String),
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawBatch {
    max_records: Option<usize>,
    concurrency: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    max_wait: Option<Duration>,
}

/// Collects the errors of one file.
struct Errors<'a> {
    file: &'a str,
    pipeline: String,
    list: Vec<PipelineError>,
}

impl crate::validate::Problems for Errors<'_> {
    fn push(&mut self, field: &str, message: impl Into<String>) {
        self.list.push(PipelineError {
            file: self.file.to_owned(),
            pipeline: self.pipeline.clone(),
            field: field.to_owned(),
            message: message.into(),
        });
    }
    fn count(&self) -> usize {
        self.list.len()
    }
}

/// Reads and validates one pipeline file. Returns every problem found in it.
pub fn load_file(path: &Path) -> Result<Pipeline, Vec<PipelineError>> {
    load_file_in(path, Dialect::Postgres)
}

/// [`load_file`], for a store whose SQL follows `dialect` (`sink.sql` is scanned by its rules).
pub fn load_file_in(path: &Path, dialect: Dialect) -> Result<Pipeline, Vec<PipelineError>> {
    let file = path.display().to_string();
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut errors = Errors { file: &file, pipeline: stem.clone(), list: Vec::new() };
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            errors.push("", format!("cannot read the file: {e}"));
            return Err(errors.list);
        }
    };
    load_text_in(&text, path, dialect)
}

/// [`load_file_in`] for a pipeline file's text already read (`path` names it in errors and gives the default
/// pipeline name). Never panics, whatever the text (fuzzed: `fuzz/fuzz_targets/pipeline.rs`).
pub fn load_text_in(text: &str, path: &Path, dialect: Dialect) -> Result<Pipeline, Vec<PipelineError>> {
    let file = path.display().to_string();
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut errors = Errors { file: &file, pipeline: stem.clone(), list: Vec::new() };
    let raw: RawPipeline = match toml::from_str(text) {
        Ok(raw) => raw,
        Err(e) => {
            let (field, message) = toml_problem(text, &e);
            errors.push(&field, message);
            return Err(errors.list);
        }
    };
    let pipeline = validate(raw, path, &stem, dialect, &mut errors);
    if errors.list.is_empty() {
        Ok(pipeline.expect("no errors means a pipeline"))
    } else {
        Err(errors.list)
    }
}

/// A pipeline file's TOML or shape error as `(field, message)`: the field is the dotted path of the key the error
/// points at (`source.bogus`, `sink.params.qty`; empty for a syntax error outside any key), the message serde's
/// words on one line with where it is, `unknown key (expected one of ...)` for a key no section has, as the
/// settings file's errors read (`super::locate`).
fn toml_problem(text: &str, e: &toml::de::Error) -> (String, String) {
    let said = e.message().trim_end().replace('\n', "; ");
    let said = match said.strip_prefix("unknown field `").and_then(|rest| rest.split_once("`, ")) {
        Some((_, expected)) => format!("unknown key ({expected})"),
        None => said,
    };
    let Some(span) = e.span() else { return (String::new(), said) };
    let (line, column) = line_column(text, span.start);
    let field = toml_edit::ImDocument::parse(text).ok().map(|doc| key_path_at(doc.as_table(), span.start)).unwrap_or_default();
    (field.join("."), format!("{said} (line {line}, column {column})"))
}

/// The dotted path (`["sink", "params", "qty"]`, an array of tables' element as `batch_sql[1]`) of the innermost key
/// whose key or value spans byte `offset` of the text `table` was parsed from.
fn key_path_at(table: &dyn toml_edit::TableLike, offset: usize) -> Vec<String> {
    let covers = |r: Option<std::ops::Range<usize>>| r.is_some_and(|r| r.start <= offset && offset < r.end.max(r.start + 1));
    for (name, item) in table.iter() {
        let key_span = table.key(name).and_then(|k| k.span());
        let mut path = vec![name.to_owned()];
        if let Some(inner) = item.as_table_like() {
            let deeper = key_path_at(inner, offset);
            if !deeper.is_empty() {
                path.extend(deeper);
                return path;
            }
        }
        if let Some(array) = item.as_array_of_tables() {
            for (i, t) in array.iter().enumerate() {
                let deeper = key_path_at(t, offset);
                if !deeper.is_empty() || covers(t.span()) {
                    path[0] = format!("{name}[{i}]");
                    path.extend(deeper);
                    return path;
                }
            }
        }
        if covers(key_span) || covers(item.span()) {
            return path;
        }
    }
    Vec::new()
}

/// Whether `name` can name a pipeline: 1 to 63 characters of `a-z`, `0-9`, `_` and `-` (it goes into consumer group
/// names, metric labels and idempotency keys).
pub fn valid_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn validate(raw: RawPipeline, path: &Path, stem: &str, dialect: Dialect, e: &mut Errors<'_>) -> Option<Pipeline> {
    let name = raw.name.clone().unwrap_or_else(|| stem.to_owned());
    e.pipeline = name.clone();
    if !valid_name(&name) {
        let field = if raw.name.is_some() { "name" } else { "(file stem)" };
        e.push(field, format!("{name:?} must be 1 to 63 characters of a-z, 0-9, '_' or '-'"));
    }
    let max_records = raw.batch.max_records.unwrap_or(DEFAULT_MAX_RECORDS);
    let source = crate::source::spec::parse(raw.source.as_ref(), raw.topics.as_ref(), raw.group_id.as_ref(), &name, max_records, e);
    let max_payload_bytes = raw.max_payload_bytes.unwrap_or(DEFAULT_MAX_PAYLOAD_BYTES);
    if max_payload_bytes == 0 {
        e.push("max_payload_bytes", "must be at least 1");
    }
    let decoder = validate_format(&raw, path, max_payload_bytes, e);
    let key = validate_key(&raw.key, e);
    let key_decoder = match (&raw.key.record_key, raw.key.record_key_format) {
        (Some(RecordKey::Path(_)), format) => Some(Decoder::new(format.unwrap_or_default(), max_payload_bytes).with_subjects_for_keys()),
        (_, Some(_)) => {
            e.push("key.record_key_format", "is for record_key = \"/path\" (a field of the decoded record key)");
            None
        }
        _ => None,
    };
    let time = TimeSettings {
        zone: raw.sink.time_zone.clone().unwrap_or_else(|| TimeSettings::default().zone),
        naive: raw.sink.naive_timestamps.unwrap_or_default(),
    };
    let zone_chars = |c: char| c.is_ascii_alphanumeric() || "_/+-:.".contains(c);
    if time.zone.is_empty() || time.zone.len() > 64 || !time.zone.chars().all(zone_chars) {
        e.push("sink.time_zone", format!("{:?} is not a time zone name (like \"UTC\" or \"America/New_York\")", time.zone));
    }
    let store = if raw.sink.redis.is_some() { StoreKind::Redis } else { StoreKind::Database };
    let caps = store.capabilities();
    let positional = source.as_ref().is_some_and(SourceSpec::positional);
    let offsets = validate_offsets(&raw, &caps, positional, e);
    let (sink, outbox) = match validate_sink(raw.sink, raw.outbox, dialect, e) {
        Some((sink, outbox)) => (Some(sink), outbox),
        None => (None, None),
    };
    if let (Some(source), Some(sink)) = (&source, &sink) {
        check_bindings_for_source(source, sink, e);
    }
    if max_records == 0 {
        e.push("batch.max_records", "must be at least 1");
    }
    let max_wait = raw.batch.max_wait.unwrap_or(DEFAULT_MAX_WAIT);
    let concurrency = raw.batch.concurrency.unwrap_or(1);
    if !(1..=MAX_CONCURRENCY).contains(&concurrency) {
        e.push("batch.concurrency", format!("must be from 1 to {MAX_CONCURRENCY}"));
    } else if let (true, Err(why)) = (concurrency > 1, caps.lanes) {
        e.push("batch.concurrency", why);
    } else if let (true, Some(Err(why))) = (concurrency > 1, source.as_ref().map(|s| s.capabilities().lanes)) {
        e.push("batch.concurrency", why);
    }
    let dead_letters = validate_dead_letters(raw.dead_letters, source.as_ref(), e);
    if let Some(source) = &source {
        check_capabilities(source, &raw.key, raw.offsets.store, &dead_letters, e);
    }
    if let (true, true, Err(why)) = (positional, dead_letters.topic.is_some(), caps.dead_letter_topic) {
        e.push("dead_letters.topic", why);
    } else if offsets == OffsetStore::Database && dead_letters.topic.is_some() {
        e.push(
            "offsets.store",
            "\"database\" cannot be combined with dead_letters.topic: a position stored with its batch is not \
             replayed after a crash, so a dead letter not yet produced to the topic would never be",
        );
    }
    let dedup = validate_dedup(&raw.dedup, e);
    Some(Pipeline {
        name,
        file: path.to_owned(),
        source: source?,
        decoder: decoder?,
        key_decoder,
        key: key?,
        tombstones: raw.tombstones,
        sink: sink?,
        batch: BatchSettings { max_records, max_wait, concurrency },
        dead_letters,
        dedup,
        offsets,
        time,
        outbox,
    })
}

/// `[offsets] store` for a store of `caps` (`positional`: the source has positions), and the `[dedup]` purge
/// settings such a store may refuse.
fn validate_offsets(raw: &RawPipeline, caps: &crate::store::open::StoreCapabilities, positional: bool, e: &mut Errors<'_>) -> OffsetStore {
    // A store that keeps the positions with its effects (Redis): what it loses (its last writes, with `appendfsync
    // everysec`) it loses together, and the worker resumes from what it kept.
    let keeps_positions = positional && caps.keeps_positions.is_err();
    let offsets = match raw.offsets.store {
        None if keeps_positions => OffsetStore::Database,
        None => OffsetStore::Broker,
        Some(OffsetStore::Broker) if keeps_positions => {
            e.push("offsets.store", caps.keeps_positions.err().unwrap_or_default());
            OffsetStore::Broker
        }
        Some(store) => store,
    };
    if let Err(why) = caps.purge_settings {
        for (set, field) in [
            (raw.dedup.purge_interval.is_some(), "dedup.purge_interval"),
            (raw.dedup.purge_batch.is_some(), "dedup.purge_batch"),
            (raw.dedup.purge_rate.is_some(), "dedup.purge_rate"),
        ] {
            if set {
                e.push(field, why);
            }
        }
    }
    offsets
}

/// The pipeline's decoder: `format`, with the schema of `schema_file` (read relative to the pipeline file's
/// directory: an Avro schema, or a `.proto` file and its `message`) when one is named. A format that reads the
/// schema registry gets it later ([`super::attach_registry`]).
fn validate_format(raw: &RawPipeline, path: &Path, max_payload_bytes: usize, e: &mut Errors<'_>) -> Option<Decoder> {
    use crate::decode::{FileSchema, SubjectNameStrategy};
    let decoder = Decoder::new(raw.format, max_payload_bytes).with_subjects(raw.subject_name_strategy, raw.record_name.clone());
    if raw.subject_name_strategy == SubjectNameStrategy::TopicName && raw.record_name.is_some() {
        e.push("record_name", "is for subject_name_strategy = \"record_name\" or \"topic_record_name\" (the default, \"topic_name\", names subjects <topic>-value)");
    }
    if raw.subject_name_strategy != SubjectNameStrategy::TopicName && raw.record_name.is_none() {
        e.push("record_name", "is required with subject_name_strategy = \"record_name\" or \"topic_record_name\" (the record's full name, as the producer's serializer names its subject)");
    }
    if raw.message.is_some() && !(raw.format == Format::Protobuf && raw.schema_file.is_some()) {
        e.push("message", "is for format = \"protobuf\" with a schema_file (the message of the .proto file payloads are)");
        return None;
    }
    let Some(file) = &raw.schema_file else { return Some(decoder) };
    if !matches!(raw.format, Format::Avro | Format::Protobuf) {
        e.push("schema_file", format!("is for format = \"avro\" or \"protobuf\" (plain datums or messages); format = {:?} takes no schema file", raw.format.name()));
        return None;
    }
    let full = path.parent().map_or_else(|| file.clone(), |dir| dir.join(file));
    let text = match std::fs::read_to_string(&full) {
        Ok(text) => text,
        Err(err) => {
            e.push("schema_file", format!("cannot read {}: {err}", full.display()));
            return None;
        }
    };
    let shown = file.display().to_string();
    let schema = if raw.format == Format::Avro {
        crate::decode::avro::AvroSchema::parse(&text, &[]).map(FileSchema::Avro).map_err(|err| format!("{} is not an Avro schema: {err}", full.display()))
    } else {
        let name = file.file_name().map_or_else(|| shown.clone(), |n| n.to_string_lossy().into_owned());
        crate::decode::protobuf::ProtoFile::compile(&name, &text, &[])
            .map_err(|err| format!("{} is not a .proto file idemflow can compile: {err}", full.display()))
            .and_then(|f| match &raw.message {
                Some(m) => f.message(m).map(FileSchema::Protobuf).map_err(|err| format!("message: {err}")),
                None => f.by_indexes(&[0]).map(FileSchema::Protobuf).map_err(|err| format!("{}: {err}", full.display())),
            })
    };
    match schema {
        Ok(schema) => Some(decoder.with_schema_file(schema, &shown)),
        Err(err) => {
            e.push(if err.starts_with("message: ") { "message" } else { "schema_file" }, err.trim_start_matches("message: ").to_owned());
            None
        }
    }
}

/// Refuses bound values the pipeline's source cannot give: message properties from Kafka; a record key, a partition
/// or an offset from a queue (a delivery tag is no position).
fn check_bindings_for_source(source: &SourceSpec, sink: &SinkSpec, e: &mut Errors<'_>) {
    let (table, bindings) = sink.bindings();
    for b in bindings {
        let caps = source.capabilities();
        let can = match &b.source {
            ValueSource::Property(_) => caps.bind_property,
            ValueSource::RecordKey => caps.bind_record_key,
            ValueSource::Meta(Meta::Partition | Meta::Offset) => caps.bind_partition,
            ValueSource::Field(_) | ValueSource::Header(_) | ValueSource::Meta(_) => Ok(()),
        };
        if let Err(why) = can {
            e.push(&format!("{table}.{}", b.name), why);
        }
    }
}

/// `[dead_letters]`: the guard's limits and where dead letters also go, checked.
fn validate_dead_letters(raw: RawDeadLetters, source: Option<&SourceSpec>, e: &mut Errors<'_>) -> DeadLetterSettings {
    let d = DeadLetterSettings::default();
    let dead_letters = DeadLetterSettings {
        max_ratio: raw.max_ratio.unwrap_or(d.max_ratio),
        window: raw.window.unwrap_or(d.window),
        min_records: raw.min_records.unwrap_or(d.min_records),
        topic: raw.topic,
        exchange: raw.exchange,
        routing_key: raw.routing_key,
    };
    if dead_letters.routing_key.is_some() && dead_letters.exchange.is_none() {
        e.push("dead_letters.routing_key", "only applies with dead_letters.exchange");
    }
    if !(0.0..=1.0).contains(&dead_letters.max_ratio) {
        e.push("dead_letters.max_ratio", format!("{} is not between 0 and 1", dead_letters.max_ratio));
    }
    if dead_letters.window == 0 {
        e.push("dead_letters.window", "must be at least 1");
    }
    if let (Some(t), Some(source)) = (&dead_letters.topic, source) {
        if source.capabilities().dead_letter_topic.is_ok() && source.consumes(t) {
            e.push("dead_letters.topic", format!("{t:?} is also a source topic: dead letters would be consumed again"));
        }
    }
    dead_letters
}

/// What the pipeline asks of its source (a dead-letter topic or exchange, a key from properties or the record key,
/// stored positions), refused with the source's own reason where it cannot ([`crate::source::spec::Capabilities`]).
fn check_capabilities(source: &SourceSpec, key: &RawKey, offsets: Option<OffsetStore>, dead_letters: &DeadLetterSettings, e: &mut Errors<'_>) {
    let caps = source.capabilities();
    let asks = [
        (dead_letters.exchange.is_some(), "dead_letters.exchange", caps.dead_letter_exchange),
        (dead_letters.topic.is_some(), "dead_letters.topic", caps.dead_letter_topic),
        (key.message_id == Some(true) || key.message_key == Some(true) || key.property.is_some(), "key", caps.key_properties),
        (key.message_key == Some(true), "key.message_key", caps.key_message_key),
        (matches!(key.record_key, Some(RecordKey::Whole(true)) | Some(RecordKey::Path(_))), "key.record_key", caps.key_record_key),
        (offsets == Some(OffsetStore::Database), "offsets.store", caps.positions),
    ];
    for (asked, field, can) in asks {
        if let (true, Err(why)) = (asked, can) {
            e.push(field, why);
        }
    }
}

/// The most rows `[dedup] purge_batch` may ask one slice of the retention sweep to examine: a slice is one
/// transaction, holding the locks of the expired rows it deletes until it commits.
const MAX_PURGE_BATCH: u32 = 1_000_000;

/// `[dedup]`: retention and purging, checked.
fn validate_dedup(raw: &RawDedup, e: &mut Errors<'_>) -> DedupSettings {
    let dd = DedupSettings::default();
    let dedup = DedupSettings {
        retention: raw.retention.unwrap_or(dd.retention),
        purge_interval: raw.purge_interval.unwrap_or(dd.purge_interval),
        purge_batch: raw.purge_batch.unwrap_or(dd.purge_batch),
        purge_rate: raw.purge_rate.unwrap_or(dd.purge_rate),
        new_history: raw.new_history.unwrap_or(false),
    };
    if dedup.retention.is_zero() {
        e.push("dedup.retention", "must be longer than 0");
    }
    if dedup.purge_interval.is_zero() {
        e.push("dedup.purge_interval", "must be longer than 0");
    }
    if dedup.purge_batch == 0 {
        e.push("dedup.purge_batch", "must be at least 1");
    }
    if dedup.purge_batch > MAX_PURGE_BATCH {
        e.push("dedup.purge_batch", format!("must be at most {MAX_PURGE_BATCH} (rows a slice of the retention sweep examines in one transaction)"));
    }
    if dedup.purge_rate == 0 {
        e.push("dedup.purge_rate", "must be at least 1 (rows examined per second)");
    }
    dedup
}

fn validate_key(raw: &RawKey, e: &mut Errors<'_>) -> Option<KeySpec> {
    let given = [
        raw.field.is_some(),
        raw.fields.is_some(),
        matches!(raw.record_key, Some(RecordKey::Whole(true)) | Some(RecordKey::Path(_))),
        raw.header.is_some(),
        raw.property.is_some(),
        raw.message_id == Some(true),
        raw.message_key == Some(true),
    ];
    if given.iter().filter(|g| **g).count() != 1 {
        e.push("key", "set exactly one of field, fields, record_key = true (or a path into the record key), header, property, message_id = true, message_key = true");
        return None;
    }
    if raw.max_bytes == Some(0) {
        e.push("key.max_bytes", "must be at least 1");
    }
    let source = if let Some(f) = &raw.field {
        KeySource::Field(path_or_error(f, "key.field", e)?)
    } else if let Some(fs) = &raw.fields {
        if fs.is_empty() {
            e.push("key.fields", "list at least one field");
            return None;
        }
        let paths: Vec<_> =
            fs.iter().enumerate().map(|(i, f)| path_or_error(f, &format!("key.fields[{i}]"), e)).collect();
        KeySource::Fields(paths.into_iter().collect::<Option<_>>()?)
    } else if let Some(RecordKey::Path(p)) = &raw.record_key {
        KeySource::RecordKeyField(path_or_error(p, "key.record_key", e)?)
    } else if matches!(raw.record_key, Some(RecordKey::Whole(true))) {
        KeySource::RecordKey
    } else if raw.message_id == Some(true) {
        KeySource::Property(crate::record::MESSAGE_ID.to_owned())
    } else if raw.message_key == Some(true) {
        KeySource::Property(crate::record::MESSAGE_KEYS.to_owned())
    } else if let Some(p) = &raw.property {
        if !crate::record::PROPERTIES.contains(&p.as_str()) {
            e.push("key.property", format!("{p:?} is not a message property: one of {}", crate::record::PROPERTIES.join(", ")));
        }
        KeySource::Property(p.clone())
    } else {
        let h = raw.header.clone().unwrap_or_default();
        if h.is_empty() {
            e.push("key.header", "must name a header");
        }
        KeySource::Header(h)
    };
    Some(KeySpec { source, allow_empty: raw.allow_empty, max_bytes: raw.max_bytes })
}

/// 1-based line and column (in characters) of a byte offset.
pub(super) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or_default().chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::spec::{OnConflict, SqlEffect};
    use crate::source::kafka::KafkaSpec;
    use crate::source::rabbitmq::RabbitMqSpec;
    use crate::source::rocketmq::RocketMqSpec;

    fn load(text: &str) -> Result<Pipeline, Vec<PipelineError>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("payments.toml");
        std::fs::write(&path, text).unwrap();
        load_file(&path)
    }

    #[test]
    fn redis_sinks_store_positions_in_redis_and_check_placeholders() {
        let base = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nredis = [[\"HSET\", \"p:{id}\", \"amount\", \"{amount}\"]]\n\
                    [sink.params]\nid = \"/id\"\namount = \"/amount\"\n";
        let p = load(base).unwrap();
        assert_eq!(p.sink.store(), StoreKind::Redis);
        assert_eq!(p.offsets, OffsetStore::Database, "a Redis sink stores its positions with its effects");
        let fields = |text: &str| load(text).unwrap_err().into_iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>();
        let e = fields(&format!("{base}[offsets]\nstore = \"kafka\"\n"));
        assert!(e[0].starts_with("offsets.store: a Redis sink keeps the consumed positions in Redis"), "{e:?}");
        let e = fields(&format!("{base}[dedup]\npurge_batch = 10\n"));
        assert!(e[0].starts_with("dedup.purge_batch: a Redis sink's dedup keys expire by themselves"), "{e:?}");
        let e = fields(&base.replace("{amount}", "{amt}"));
        assert!(e.iter().any(|e| e.starts_with("sink.params: {amt} is used in sink.redis but has no entry in [sink.params]")), "{e:?}");
        assert!(e.iter().any(|e| e.starts_with("sink.params.amount: is not used in sink.redis (no {amount} there)")), "{e:?}");
        let e = fields(&base.replace("{amount}", "{amuont}"));
        assert!(e.iter().any(|e| e.ends_with("has no entry in [sink.params] (did you mean sink.params.amount?)")), "{e:?}");
        assert!(e.iter().any(|e| e.ends_with("(no {amount} there) (did you mean {amuont}?)")), "{e:?}");
        let e = fields(&base.replace("\"p:{id}\"", "\"p:{id\""));
        assert!(e[0].starts_with("sink.redis[0]: argument 1: \"p:{id\": a '{' without its '}'"), "{e:?}");
        let e = fields(&base.replace("[sink]\n", "[sink]\ntable = \"x\"\n"));
        assert!(e[0].starts_with("sink: set exactly one of table (with [sink.columns]), sql, batch_sql or redis (each with [sink.params])"), "{e:?}");
        let queue = base.replace("topics = [\"t\"]", "[source]\nkind = \"rabbitmq\"\nqueue = \"q\"");
        assert_eq!(load(&queue).unwrap().offsets, OffsetStore::Broker, "a queue has no positions to store");
    }

    #[test]
    fn the_retention_sweep_settings_are_bounded() {
        let base = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n[dedup]\n";
        let p = load(&format!("{base}purge_batch = 1000000\npurge_rate = 20000\npurge_interval = \"30s\"\n")).unwrap();
        assert_eq!((p.dedup.purge_batch, p.dedup.purge_rate, p.dedup.purge_interval), (1_000_000, 20_000, Duration::from_secs(30)));
        let fields = |text: &str| load(text).unwrap_err().into_iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>();
        let e = fields(&format!("{base}purge_batch = 1000001\npurge_rate = 0\n"));
        assert!(e.iter().any(|e| e.starts_with("dedup.purge_batch: must be at most 1000000")), "{e:?}");
        assert!(e.iter().any(|e| e.starts_with("dedup.purge_rate: must be at least 1")), "{e:?}");
    }

    #[test]
    fn a_rocketmq_source() {
        let rest = "[key]\nmessage_key = true\n[sink]\ntable = \"x\"\n[sink.columns]\nid = \"/id\"\nq = { meta = \"partition\" }\n";
        let p = load(&format!("[source]\nkind = \"rocketmq\"\ntopic = \"payments\"\n{rest}")).unwrap();
        assert_eq!(
            p.source,
            SourceSpec::RocketMq(RocketMqSpec { topic: "payments".into(), consumer_group: "idemflow-payments".into(), tag_expression: "*".into() })
        );
        assert_eq!(p.key.source, KeySource::Property("keys".into()));
        assert_eq!(p.offsets, OffsetStore::Broker, "offsets in the broker by default");
        let stored = load(&format!("[source]\nkind = \"rocketmq\"\ntopic = \"payments\"\n{rest}[offsets]\nstore = \"database\"\n")).unwrap();
        assert_eq!(stored.offsets, OffsetStore::Database);
        let broker = load(&format!("[source]\nkind = \"rocketmq\"\ntopic = \"payments\"\n{rest}[offsets]\nstore = \"broker\"\n")).unwrap();
        assert_eq!(broker.offsets, OffsetStore::Broker);
        let text = |source: &str, rest: &str| {
            let errs = load(&format!("{source}{rest}")).unwrap_err();
            errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n")
        };
        let e = text("[source]\nkind = \"rocketmq\"\ntopic = \"a/b\"\nqueue = \"q\"\n", rest);
        assert!(e.contains("source.topic: \"a/b\" is not a valid RocketMQ topic name"), "{e}");
        assert!(e.contains("source.queue: belongs to a rabbitmq source"), "{e}");
        let e = text("[source]\nkind = \"rocketmq\"\n", rest);
        assert!(e.contains("source.topic: a RocketMQ source needs its topic"), "{e}");
        let e = text("[source]\nkind = \"rocketmq\"\ntopic = \"t\"\n", &rest.replace("message_key = true", "record_key = true"));
        assert!(e.contains("key.record_key: a RocketMQ message has no record key"), "{e}");
        let e = text("[source]\nkind = \"rocketmq\"\ntopic = \"t\"\n", &format!("{rest}[dead_letters]\ntopic = \"dlq\"\n"));
        assert!(e.contains("dead_letters.topic: is a Kafka topic"), "{e}");
        let e = text("topics = [\"t\"]\n", rest);
        assert!(e.contains("key: a Kafka record has no message properties"), "{e}");
    }

    #[test]
    fn sources_kafka_by_default_or_rabbitmq_in_source() {
        let rest = "[key]\nmessage_id = true\n[sink]\ntable = \"x\"\n[sink.columns]\nid = \"/id\"\n";
        let legacy = load(&format!("topics = [\"t\"]\n{}", rest.replace("message_id = true", "field = \"/id\""))).unwrap();
        assert_eq!(legacy.source, SourceSpec::Kafka(KafkaSpec { topics: vec!["t".into()], group_id: "idemflow-payments".into() }));
        let kafka_rest = rest.replace("message_id = true", "field = \"/id\"");
        let kafka = load(&format!("[source]\ntopics = [\"t\"]\ngroup_id = \"g\"\n{kafka_rest}")).unwrap();
        let e = load(&format!("[source]\ntopics = [\"t\"]\n{rest}")).unwrap_err();
        assert!(e[0].to_string().contains("key: a Kafka record has no message properties"), "{e:?}");
        assert_eq!(kafka.source, SourceSpec::Kafka(KafkaSpec { topics: vec!["t".into()], group_id: "g".into() }));
        for both in ["group_id = \"g\"\n[source]\ntopics = [\"t\"]\n", "topics = [\"t\"]\n[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n"] {
            let e = load(&format!("{both}{kafka_rest}")).unwrap_err();
            assert!(e[0].to_string().contains("topics: set the source in [source] or with the top-level topics and group_id, not both"), "{e:?}");
        }
        let rabbit = load(&format!("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n{rest}")).unwrap();
        assert_eq!(
            rabbit.source,
            SourceSpec::RabbitMq(RabbitMqSpec { queues: vec!["q".into()], prefetch: 4000, queue_type: None, single_active_consumer: false })
        );
        assert_eq!(rabbit.key.source, KeySource::Property("message_id".into()));
        let text = |source: &str| {
            let errs = load(&format!("{source}{rest}")).unwrap_err();
            errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n")
        };
        let e = text("[source]\nkind = \"rabbitmq\"\nqueues = [\"a\", \"a\"]\nprefetch = 10\n");
        assert!(e.contains("source.queues: lists a queue twice"), "{e}");
        assert!(e.contains("source.prefetch: 10 is below batch.max_records = 2000"), "{e}");
        let e = text("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\ntopics = [\"t\"]\n");
        assert!(e.contains("source.topics: belongs to a kafka source"), "{e}");
        let e = text("[source]\nkind = \"sqs\"\n");
        assert!(e.contains("source.kind: \"sqs\" is not a source kind"), "{e}");
        let e = text("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n[offsets]\nstore = \"database\"\n");
        assert!(e.contains("offsets.store") && e.contains("a RabbitMQ queue has none"), "{e}");
        let e = text("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n[dead_letters]\ntopic = \"dlq\"\n");
        assert!(e.contains("dead_letters.topic: is a Kafka topic"), "{e}");
        let kafka_dlx = format!("topics = [\"t\"]\n{kafka_rest}[dead_letters]\nexchange = \"x\"\n");
        let e = load(&kafka_dlx).unwrap_err();
        assert!(e[0].to_string().contains("dead_letters.exchange: is a RabbitMQ exchange"), "{e:?}");
        let meta = rest.replace("id = \"/id\"", "id = \"/id\"\noffset = { meta = \"offset\" }");
        let e = load(&format!("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n{meta}")).unwrap_err();
        assert!(e[0].to_string().contains("sink.columns.offset: a RabbitMQ message has no partition or offset"), "{e:?}");
        let e = load(&format!("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n{}", rest.replace("message_id = true", "property = \"nope\""))).unwrap_err();
        assert!(e[0].to_string().contains("key.property: \"nope\" is not a message property"), "{e:?}");
    }

    #[test]
    fn offsets_store() {
        let base = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"x\"\n[sink.columns]\nid = \"/id\"\n";
        assert_eq!(load(base).unwrap().offsets, OffsetStore::Broker);
        let stored = format!("{base}[offsets]\nstore = \"database\"\n");
        assert_eq!(load(&stored).unwrap().offsets, OffsetStore::Database);
        let errs = load(&format!("{stored}[dead_letters]\ntopic = \"dlq\"\n")).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "offsets.store");
        assert!(errs[0].message.contains("cannot be combined with dead_letters.topic"), "{}", errs[0]);
        let errs = load(&format!("{base}[offsets]\nstore = \"zookeeper\"\n")).unwrap_err();
        assert!(errs[0].to_string().contains("zookeeper"), "{}", errs[0]);
    }

    #[test]
    fn reports_every_error_with_file_pipeline_and_field() {
        let errs = load(
            r#"
topics = []
[key]
field = "/order//id"
[sink]
sql = "UPDATE accounts SET balance = balance - :amount WHERE id = :account"
[sink.params]
amount = "/order/amount"
unused = "/x"
"#,
        )
        .unwrap_err();
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert!(text.iter().all(|t| t.contains("payments.toml: pipeline \"payments\": ")), "{text:#?}");
        assert!(text.iter().any(|t| t.contains("topics: at least one topic")), "{text:#?}");
        assert!(text.iter().any(|t| t.contains("key.field: \"/order//id\"")), "{text:#?}");
        assert!(text.iter().any(|t| t.contains(":account is used in sink.sql")), "{text:#?}");
        assert!(text.iter().any(|t| t.contains("sink.params.unused: is not used")), "{text:#?}");
    }

    #[test]
    fn unknown_fields_are_errors() {
        let errs = load("topics = [\"a\"]\nbogus = 1\n[key]\nfield = \"id\"\n[sink]\ntable = \"t\"\n").unwrap_err();
        assert_eq!(errs[0].field, "bogus", "{errs:?}");
        assert!(errs[0].message.starts_with("unknown key (expected one of `name`"), "{errs:?}");
        assert!(errs[0].message.ends_with("(line 2, column 1)"), "{errs:?}");
        // A key deep in a section is named by its dotted path, on one line, as the settings file's keys are.
        let errs = load("topics = [\"a\"]\n[key]\nfield = \"id\"\n[sink]\ntable = \"t\"\n[batch]\nmax_wait = \"1s\"\nmax_recods = 5\n").unwrap_err();
        assert_eq!(errs[0].field, "batch.max_recods", "{errs:?}");
        assert!(errs[0].message.starts_with("unknown key (expected one of") && errs[0].message.ends_with("(line 8, column 1)"), "{errs:?}");
        let errs = load("topics = [\"a\"]\n[key]\nfield = \"id\"\n[sink]\ntable = \"t\"\n[batch]\nmax_records = \"many\"\n").unwrap_err();
        assert_eq!(errs[0].field, "batch.max_records", "{errs:?}");
        assert!(!errs[0].message.contains('\n') && errs[0].message.contains("(line 7, column"), "{errs:?}");
        let errs = load("topics = [\"a\"]\n[key]\nfield = \"id\"\n[source]\nkind = \"kafka\"\nqueu = \"q\"\n[sink]\ntable = \"t\"\n").unwrap_err();
        assert_eq!(errs[0].field, "source.queu", "{errs:?}");
        // A syntax error has no key: where it is, on one line.
        let errs = load("topics = [\"a\"\n").unwrap_err();
        assert_eq!(errs[0].message, "invalid array; expected `]` (line 2, column 1)", "{errs:?}");
    }

    #[test]
    fn bindings_in_every_form() {
        let p = load(
            r#"
topics = ["orders"]
[key]
fields = ["/order/id", "order.line"]
[sink]
table = "payments"
on_conflict = "nothing"
[sink.columns]
order_id = "/order/id"
currency = { field = "/order/currency", default = "USD" }
note = { field = "/order/note", optional = true }
source_topic = { meta = "topic" }
rk = { record_key = true }
msg = { header = "message-id" }
"#,
        )
        .unwrap();
        let SourceSpec::Kafka(kafka) = &p.source else { panic!("a Kafka source") };
        assert_eq!(kafka.group_id, "idemflow-payments");
        assert_eq!(p.batch, BatchSettings { max_records: DEFAULT_MAX_RECORDS, max_wait: Duration::from_millis(20), concurrency: 1 });
        let SinkSpec::Sql(SqlEffect::Table { columns, on_conflict, .. }) = &p.sink else { panic!("table form") };
        assert_eq!(*on_conflict, OnConflict::Nothing);
        let by_name = |n: &str| columns.iter().find(|b| b.name == n).unwrap().clone();
        assert_eq!(by_name("currency").default.as_deref(), Some("USD"));
        assert!(by_name("note").optional);
        assert_eq!(by_name("source_topic").source, ValueSource::Meta(Meta::Topic));
        assert_eq!(by_name("rk").source, ValueSource::RecordKey);
        assert_eq!(by_name("msg").source, ValueSource::Header("message-id".into()));
    }

    #[test]
    fn batch_sql_reads_new_records_with_typed_columns_on_postgres_only() {
        let base = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nbatch_sql = [\"INSERT INTO t SELECT id, amount FROM new_records\"]\n\
                    [sink.params]\nid = \"/id\"\namount = { field = \"/amount\", type = \"numeric(12, 2)\" }\n";
        let p = load(base).unwrap();
        let SinkSpec::Sql(SqlEffect::BatchSql { statements, columns }) = &p.sink else { panic!("{:?}", p.sink) };
        assert_eq!(statements.len(), 1);
        assert_eq!(statements[0].origin, "sink.batch_sql");
        assert_eq!(columns.iter().map(|c| (c.name.as_str(), c.type_name.as_deref())).collect::<Vec<_>>(), [("amount", Some("numeric(12, 2)")), ("id", None)]);
        assert_eq!(p.sink.store(), StoreKind::Database);
        let fields = |text: &str| load(text).unwrap_err().into_iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>();
        let e = fields(&base.replace("FROM new_records", "FROM new_records WHERE amount > :floor"));
        assert_eq!(e, ["sink.batch_sql: reads the batch as the relation new_records: write new_records.floor (a column), not :floor"]);
        let e = fields(&base.replace("[sink.params]", "sql = \"SELECT 1\"\n[sink.params]"));
        assert!(e[0].starts_with("sink: set exactly one of table (with [sink.columns]), sql, batch_sql or redis"), "{e:?}");
        let e = fields(&base.replace("numeric(12, 2)", " "));
        assert_eq!(e, ["sink.params.amount.type: must name a PostgreSQL type (such as numeric, timestamptz, jsonb, text[])"]);
        let e = fields(&format!("{base}[sink.columns]\nid = \"/id\"\n"));
        assert!(e[0].starts_with("sink.columns: belongs to the table form"), "{e:?}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(&path, base).unwrap();
        let e = load_file_in(&path, Dialect::MySql).unwrap_err();
        assert_eq!(e[0].field, "sink.batch_sql");
        assert!(e[0].message.starts_with("runs on PostgreSQL only"), "{e:?}");
    }

    #[test]
    fn batch_concurrency_is_for_kafka_sources() {
        let rest = "[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n[batch]\nconcurrency = 4\n";
        assert_eq!(load(&format!("topics = [\"t\"]\n{rest}")).unwrap().batch.concurrency, 4);
        let fields = |text: &str| load(text).unwrap_err().into_iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>();
        let e = fields(&format!("[source]\nkind = \"rabbitmq\"\nqueue = \"q\"\n{rest}"));
        assert!(e[0].starts_with("batch.concurrency: more than 1 needs a Kafka source"), "{e:?}");
        let e = fields(&format!("topics = [\"t\"]\n{}", rest.replace("= 4", "= 0")));
        assert_eq!(e, ["batch.concurrency: must be from 1 to 64"]);
        let redis = rest.replace("table = \"t\"\n[sink.columns]", "redis = [[\"SET\", \"k:{id}\", \"1\"]]\n[sink.params]");
        let e = fields(&format!("topics = [\"t\"]\n{redis}"));
        assert!(e[0].starts_with("batch.concurrency: more than 1 is not supported with a Redis sink"), "{e:?}");
    }
}
