//! Payload bytes to a JSON document: JSON itself, or Avro and JSON Schema payloads read by their schemas
//! ([`Format`]; docs/formats.md).
//!
//! The size limit is checked before parsing, so an oversized payload costs no memory beyond its bytes. Nesting is
//! bounded by serde_json's recursion limit (128 levels): a deeper document is an error, never a stack overflow.
//! Numbers are kept as their exact text (serde_json's `arbitrary_precision`), so `9007199254740993` and
//! `100.000000000000000001` are never rounded through a float.
//!
//! A pipeline reads a few members of each document (its key and its values: a [`Selection`]), so
//! [`Decoder::decode_selected`] keeps only those: the whole document is parsed and checked exactly as
//! [`Decoder::decode`] checks it (the same parser, the same errors: UTF-8, escapes, lone surrogates, nesting,
//! trailing characters), but members outside the selection are never built into values, so they cost no
//! allocation. Each selected path has a slot, numbered when the selection is built, and the decode puts the value
//! at that path straight into it ([`Selected`]): no objects or member names are built on the way, and the slot
//! holds what looking the path up in the whole document gives.
//!
//! An Avro payload is read whole into a JSON value by its writer's schema ([`avro`]), and the selection taken
//! from it. Payloads in the schema registry's wire format ([`wire`]) name their schema by id; the ids are fetched
//! before decoding ([`schemas::Schemas::fetch_all`]), so decoding never waits on the network.

pub mod avro;
pub mod avro_names;
mod json;
pub mod paths;
pub mod protobuf;
pub mod schemas;
mod select;
pub mod wire;

use json::json_selected;
pub use select::{Selected, Selection};
use schemas::{Known, Schemas};
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// How a pipeline's payloads are encoded (`format`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// UTF-8 JSON (RFC 8259), one document per record.
    #[default]
    Json,
    /// JSON documents in the schema registry's wire format (Confluent's `JSONSerializer`): the header names a JSON
    /// Schema in the registry; the document after it is read as [`Format::Json`] is.
    JsonSchema,
    /// Apache Avro binary: in the schema registry's wire format (Confluent's `AvroSerializer`, Kafka Connect's
    /// `AvroConverter`), or plain datums of the pipeline's `schema_file` (`.avsc`).
    Avro,
    /// Protocol Buffers: in the schema registry's wire format (Confluent's `ProtobufSerializer`: the message
    /// indexes after the schema id name the message), or plain messages of the pipeline's `schema_file` (`.proto`)
    /// and `message`.
    Protobuf,
}

impl Format {
    /// The name a pipeline file gives it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::JsonSchema => "json_schema",
            Format::Avro => "avro",
            Format::Protobuf => "protobuf",
        }
    }
}

/// How the subject a pipeline's value schema is registered under is named: the Confluent serializers'
/// `value.subject.name.strategy` (`TopicNameStrategy`, `RecordNameStrategy`, `TopicRecordNameStrategy`). Decoding
/// needs none (payloads carry their schema id); `check` reads the subject's latest version.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SubjectNameStrategy {
    /// `<topic>-value` (the default of every Confluent serializer).
    #[default]
    TopicName,
    /// `<record name>`: the record's (message's) full name, whatever the topic.
    RecordName,
    /// `<topic>-<record name>`.
    TopicRecordName,
}

/// The schema `check` holds a pipeline's paths to.
#[derive(Clone, Debug)]
pub enum CheckedSchema {
    /// An Avro schema.
    Avro(avro::AvroSchema),
    /// The Protobuf messages the payloads may be (a path is the schema's when one of them has it).
    Protobuf(Vec<prost_reflect::MessageDescriptor>),
}

impl CheckedSchema {
    /// Whether the schema has the path `tokens` ([`paths`]).
    pub fn lookup(&self, tokens: &[String]) -> paths::Lookup {
        match self {
            CheckedSchema::Avro(a) => paths::avro(a, tokens),
            CheckedSchema::Protobuf(messages) => {
                let mut lookups = messages.iter().map(|m| paths::protobuf(m, tokens));
                let first = lookups.next().unwrap_or(paths::Lookup::Found(vec![paths::Leaf::Any]));
                if matches!(first, paths::Lookup::Found(_)) {
                    return first;
                }
                lookups.find(|l| matches!(l, paths::Lookup::Found(_))).unwrap_or(first)
            }
        }
    }
}

/// One schema a pipeline's payloads are written with now: where it is (`schema_file payment.avsc`, `subject
/// payments-value version 3 (schema id 7)`), and the schema when its paths can be checked (`None` for a JSON
/// Schema, or a subject not registered yet).
#[derive(Clone, Debug)]
pub struct CurrentSchema {
    /// Where it is, for messages.
    pub label: String,
    /// The schema.
    pub schema: Option<CheckedSchema>,
}

/// Why a payload could not be decoded. Each sends the record to the dead letters.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The payload is larger than the pipeline's `max_payload_bytes`.
    #[error("payload of {size} bytes exceeds max_payload_bytes = {limit}")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },
    /// Not a JSON document (including an empty payload, invalid UTF-8, a lone surrogate escape, or nesting deeper
    /// than 128 levels).
    #[error("payload is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Not in the schema registry's wire format.
    #[error("{0}")]
    Wire(#[from] wire::WireError),
    /// The schema id is not known to the registry, its schema cannot be read, or it is not of the pipeline's
    /// format.
    #[error("{0}")]
    Schema(String),
    /// The bytes do not decode with their schema (Avro or Protobuf).
    #[error("payload does not decode with {schema}: {why}")]
    Undecodable {
        /// `schema id N` or `schema_file <path>`.
        schema: String,
        /// The decoder's words.
        why: String,
    },
}

/// The schema of a pipeline's `schema_file`.
#[derive(Clone, Debug)]
pub enum FileSchema {
    /// An Avro schema (`.avsc`).
    Avro(avro::AvroSchema),
    /// The pipeline's `message` of a `.proto` file.
    Protobuf(prost_reflect::MessageDescriptor),
}

/// Where a pipeline's payloads find their schema.
#[derive(Clone, Debug)]
enum SchemaSource {
    /// `schema_file`: every payload a plain datum or message of this schema.
    File(Arc<FileSchema>, Arc<str>),
    /// The schema registry: payloads in its wire format.
    Registry(Schemas),
}

/// Decodes payloads of one pipeline.
#[derive(Clone, Debug)]
pub struct Decoder {
    format: Format,
    max_payload_bytes: usize,
    schema: Option<SchemaSource>,
    /// How its subjects are named, and the record name the record-name strategies need.
    subjects: (SubjectNameStrategy, Option<String>),
    /// A record key's decoder: its subjects are `<topic>-key`.
    of_keys: bool,
}

impl Decoder {
    /// A decoder for `format` that rejects payloads over `max_payload_bytes` bytes before parsing. A format other
    /// than JSON needs its schemas: [`Decoder::with_schema_file`] or [`Decoder::with_registry`].
    pub fn new(format: Format, max_payload_bytes: usize) -> Self {
        Decoder { format, max_payload_bytes, schema: None, subjects: (SubjectNameStrategy::TopicName, None), of_keys: false }
    }

    /// The same, its subjects named by `strategy` (with `record_name` for the record-name strategies).
    pub fn with_subjects(self, strategy: SubjectNameStrategy, record_name: Option<String>) -> Self {
        Decoder { subjects: (strategy, record_name), ..self }
    }

    /// The same, for record keys: its subjects are `<topic>-key` (the key serializers' topic name strategy).
    pub fn with_subjects_for_keys(self) -> Self {
        Decoder { of_keys: true, ..self }
    }

    /// The subjects the value schemas of `streams` (topics, queues) are registered under.
    pub fn subjects(&self, streams: &[String]) -> Vec<String> {
        if self.of_keys {
            return streams.iter().map(|t| format!("{t}-key")).collect();
        }
        match &self.subjects {
            (SubjectNameStrategy::RecordName, Some(record)) => vec![record.clone()],
            (SubjectNameStrategy::TopicRecordName, Some(record)) => streams.iter().map(|t| format!("{t}-{record}")).collect(),
            _ => streams.iter().map(|t| format!("{t}-value")).collect(),
        }
    }

    /// The schemas the payloads of `streams` are written with now, for `check`: the `schema_file`, or the latest
    /// version of each subject ([`Decoder::subjects`]) fetched from the registry (for Protobuf, the message
    /// `record_name` names, or every top-level message of the subject's file). Nothing for JSON.
    ///
    /// Errors: the registry gave no answer, or a subject's schema cannot be read or is not of the pipeline's format.
    pub async fn current_schemas(&self, streams: &[String]) -> Result<Vec<CurrentSchema>, String> {
        match &self.schema {
            None => Ok(Vec::new()),
            Some(SchemaSource::File(schema, file)) => Ok(vec![CurrentSchema {
                label: format!("schema_file {file}"),
                schema: Some(match &**schema {
                    FileSchema::Avro(a) => CheckedSchema::Avro(a.clone()),
                    FileSchema::Protobuf(m) => CheckedSchema::Protobuf(vec![m.clone()]),
                }),
            }]),
            Some(SchemaSource::Registry(schemas)) => {
                let mut out = Vec::new();
                for subject in self.subjects(streams) {
                    let Some(latest) = schemas.registry().latest(&subject).await.map_err(|e| e.to_string())? else {
                        out.push(CurrentSchema { label: format!("subject {subject} (not registered yet)"), schema: None });
                        continue;
                    };
                    let version = latest.subject_version.as_ref().map_or(0, |(_, v)| *v);
                    let label = format!("subject {subject} version {version} (schema id {})", latest.id);
                    schemas.fetch(latest.id).await.map_err(|e| format!("{label}: {e}"))?;
                    let known = schemas.get(latest.id).ok_or_else(|| format!("{label}: not fetched"))?;
                    let schema = match (self.format, &*known) {
                        (_, Known::Unusable(why)) => return Err(format!("{label}: {why}")),
                        (Format::Avro, Known::Avro(a)) => Some(CheckedSchema::Avro(a.clone())),
                        (Format::Protobuf, Known::Protobuf(f)) => Some(CheckedSchema::Protobuf(match &self.subjects.1 {
                            // The record-name strategies name the message; otherwise any top-level message of the file.
                            Some(record) if self.subjects.0 != SubjectNameStrategy::TopicName => vec![f.message(record).map_err(|e| format!("{label}: {e}"))?],
                            _ => f.messages(),
                        })),
                        (Format::JsonSchema, Known::Json) => None,
                        (format, other) => return Err(format!("{label} is a {} schema, and the pipeline's format is {}", other.kind(), format.name())),
                    };
                    out.push(CurrentSchema { label, schema });
                }
                Ok(out)
            }
        }
    }

    /// The same, reading every payload as a plain datum or message of `schema` (from `file`, named in errors).
    pub fn with_schema_file(self, schema: FileSchema, file: &str) -> Self {
        Decoder { schema: Some(SchemaSource::File(Arc::new(schema), file.into())), ..self }
    }

    /// The same, reading payloads in the wire format with the registry's schemas.
    pub fn with_registry(self, schemas: Schemas) -> Self {
        Decoder { schema: Some(SchemaSource::Registry(schemas)), ..self }
    }

    /// The payload format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Whether this decoder reads wire-format payloads and has no registry yet (a pipeline whose format is not
    /// JSON and that names no `schema_file`).
    pub fn needs_registry(&self) -> bool {
        self.format != Format::Json && self.schema.is_none()
    }

    /// The schema registry this decoder fetches from, if any.
    pub fn schemas(&self) -> Option<&Schemas> {
        match &self.schema {
            Some(SchemaSource::Registry(s)) => Some(s),
            _ => None,
        }
    }

    /// The largest payload decoded, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// The schema id `payload` names when it must be fetched before the payload is decoded
    /// ([`schemas::Schemas::fetch_all`]); `None` for a payload that decodes (or fails) without the registry.
    pub fn schema_to_fetch(&self, payload: Option<&[u8]>) -> Option<u32> {
        match (&self.schema, payload) {
            (Some(SchemaSource::Registry(s)), Some(p)) if p.len() <= self.max_payload_bytes => {
                wire::schema_id(p).filter(|id| s.needs_fetch(*id))
            }
            _ => None,
        }
    }

    /// Whether `payload` decodes now the same as at any later time: it names no schema, or one fetched (not one
    /// missing, which the registry may learn before the record's batch).
    pub fn decodes_for_good(&self, payload: Option<&[u8]>) -> bool {
        match (&self.schema, payload) {
            (Some(SchemaSource::Registry(s)), Some(p)) if p.len() <= self.max_payload_bytes => wire::schema_id(p).is_none_or(|id| s.is_ready(id)),
            _ => true,
        }
    }

    /// Decodes one non-null payload.
    pub fn decode(&self, payload: &[u8]) -> Result<Value, DecodeError> {
        let mut selection = Selection::default();
        let slot = selection.add(&[]);
        let mut selected = self.decode_selected(payload, &selection)?;
        Ok(selected.take(slot).unwrap_or(Value::Null))
    }

    /// Decodes one non-null payload as [`Decoder::decode`] does, keeping only the members in `selection` (see the
    /// module documentation): the same payloads are refused with the same errors, and each selected path's slot
    /// holds what looking it up in the whole document gives.
    pub fn decode_selected(&self, payload: &[u8], selection: &Selection) -> Result<Selected, DecodeError> {
        if payload.len() > self.max_payload_bytes {
            return Err(DecodeError::TooLarge { size: payload.len(), limit: self.max_payload_bytes });
        }
        let failed = |schema: String| move |why: String| DecodeError::Undecodable { schema, why };
        match (self.format, &self.schema) {
            (Format::Json, _) => Ok(json_selected(payload, selection)?),
            (Format::Avro, Some(SchemaSource::File(schema, file))) => match &**schema {
                FileSchema::Avro(a) => Ok(Selected::from_value(selection, a.decode(payload).map_err(failed(format!("schema_file {file}")))?)),
                FileSchema::Protobuf(_) => Err(DecodeError::Schema(format!("schema_file {file} is not an Avro schema"))),
            },
            (Format::Protobuf, Some(SchemaSource::File(schema, file))) => match &**schema {
                FileSchema::Protobuf(m) => protobuf::decode_selected(m, payload, selection).map_err(failed(format!("schema_file {file}"))),
                FileSchema::Avro(_) => Err(DecodeError::Schema(format!("schema_file {file} is not a .proto file"))),
            },
            (format, Some(SchemaSource::Registry(schemas))) => {
                let (id, body) = wire::split(payload)?;
                let known = schemas.get(id).ok_or_else(|| {
                    DecodeError::Schema(format!("schema id {id} was not fetched from the schema registry (a defect: please report it)"))
                })?;
                let schema = || format!("schema id {id}");
                match (format, &*known) {
                    (_, Known::Unusable(why)) => Err(DecodeError::Schema(why.clone())),
                    (Format::Avro, Known::Avro(a)) => Ok(Selected::from_value(selection, a.decode(body).map_err(failed(schema()))?)),
                    (Format::Protobuf, Known::Protobuf(file)) => {
                        let (indexes, message) = protobuf::message_indexes(body).map_err(failed(schema()))?;
                        let descriptor = file.by_indexes(&indexes).map_err(failed(schema()))?;
                        protobuf::decode_selected(&descriptor, message, selection).map_err(failed(schema()))
                    }
                    (Format::JsonSchema, Known::Json) => Ok(json_selected(body, selection)?),
                    (format, other) => Err(DecodeError::Schema(format!(
                        "schema id {id} is a {} schema, and the pipeline's format is {}",
                        other.kind(),
                        format.name()
                    ))),
                }
            }
            (Format::JsonSchema, Some(SchemaSource::File(..))) => Err(DecodeError::Schema("format json_schema takes no schema_file".to_owned())),
            (format, None) => Err(DecodeError::Schema(format!("format {} has no schema: set schema_file or [schema_registry]", format.name()))),
        }
    }
}

/// A panic's message, for a schema the parsers could not read ([`avro::AvroSchema::parse`],
/// [`protobuf::ProtoFile::compile`]): its `&str` or `String` payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    format!("a panic: {}", crate::panics::message(payload).unwrap_or_else(|| "no message".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_oversized_before_parsing_and_deep_nesting_without_crashing() {
        let d = Decoder::new(Format::Json, 16);
        assert!(matches!(d.decode(&[b' '; 17]), Err(DecodeError::TooLarge { size: 17, limit: 16 })));
        let d = Decoder::new(Format::Json, 1 << 20);
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(matches!(d.decode(deep.as_bytes()), Err(DecodeError::Json(_))));
        assert!(matches!(d.decode(b""), Err(DecodeError::Json(_))));
        assert!(matches!(d.decode(br#"{"a":"\ud800"}"#), Err(DecodeError::Json(_))));
        assert!(d.decode(br#"{"a":1}"#).is_ok());
    }

    /// The selection of `paths`, and each path's slot.
    fn selection(paths: &[&str]) -> (Selection, Vec<usize>) {
        let mut s = Selection::default();
        let slots = paths.iter().map(|p| s.add(crate::field::FieldPath::parse(p).unwrap().tokens())).collect();
        (s, slots)
    }

    /// Every selected path's slot holds what looking it up in the whole document gives, and a document is refused
    /// by both decodes or by neither, with the same message.
    fn same(doc: &[u8], paths: &[&str]) {
        let d = Decoder::new(Format::Json, 1 << 20);
        let (sel, slots) = selection(paths);
        match (d.decode(doc), d.decode_selected(doc, &sel)) {
            (Ok(whole), Ok(part)) => {
                for (p, slot) in paths.iter().zip(&slots) {
                    let path = crate::field::FieldPath::parse(p).unwrap();
                    assert_eq!(path.lookup(&whole), part.get(*slot), "{p} in {}", String::from_utf8_lossy(doc));
                }
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{}", String::from_utf8_lossy(doc)),
            (a, b) => panic!("{}: whole {a:?}, selected {b:?}", String::from_utf8_lossy(doc)),
        }
    }

    /// The whole document selected (the empty path), with a path inside it.
    fn whole_document(doc: &[u8]) {
        let d = Decoder::new(Format::Json, 1 << 20);
        let mut sel = Selection::default();
        let root = sel.add(&[]);
        let path = crate::field::FieldPath::parse("/order/id").unwrap();
        let id = sel.add(path.tokens());
        if let (Ok(whole), Ok(part)) = (d.decode(doc), d.decode_selected(doc, &sel)) {
            assert_eq!(part.get(root), Some(&whole));
            assert_eq!(part.get(id), path.lookup(&whole));
        }
    }

    #[test]
    fn a_selected_decode_finds_what_the_whole_one_finds_and_refuses_what_it_refuses() {
        let paths = ["/order/id", "/order/amount", "/items/1/sku", "/n", "/deep/a/b", "/0", "/list/0"];
        // Paths selected whole with paths inside them, and the whole document.
        let nested = ["/order", "/order/id", "/items/1", "/items/1/sku", "/deep/a/b/c/1/d", "/deep"];
        let docs: &[&[u8]] = &[
            br#"{"order":{"id":"A-1","amount":12.50,"note":"x"},"items":[{"sku":"a"},{"sku":"b"},{"sku":"c"}],"n":9007199254740993}"#,
            br#"{"order":{"id":1e400,"amount":"100.000000000000000001"},"n":null,"deep":{"a":5}}"#,
            br#"{"order":{"id":"first"},"order":{"id":"second"}}"#,
            br#"{"order":{"id":"first","amount":5},"order":{"id":"second"}}"#,
            br#"{"order":{"id":"first"},"order":"scalar"}"#,
            br#"{"order":"scalar","order":{"amount":1}}"#,
            br#"{"items":[{"sku":"a"},{"sku":"b"}],"items":[{"sku":"c"}]}"#,
            br#"{"items":[{"sku":"a"}],"0":"zero","list":[[1,2],3]}"#,
            br#"{"order":"scalar","items":"no","deep":{"a":{"b":{"c":[1,{"d":true}]}}}}"#,
            br#"[{"order":1},2]"#,
            br#"{"skipped":"\ud800","order":{"id":"x"}}"#,
            br#"{"skipped":"\u00e9\n","order":{"id":"x"}}"#,
            b"{\"skipped\":\"\xff\",\"order\":{\"id\":\"x\"}}",
            br#"{"order":{"id":"x"}} trailing"#,
            br#"{"order":{"id":"x"},}"#,
            br#"{"skipped":[1,2,}"#,
            br#"{"skipped":01}"#,
            br#""#,
            br#"null"#,
            br#""just a string""#,
        ];
        for doc in docs {
            same(doc, &paths);
            same(doc, &nested);
            whole_document(doc);
        }
        let deep = format!(r#"{{"order":{{"id":"x"}},"skipped":{}{}}}"#, "[".repeat(200), "]".repeat(200));
        same(deep.as_bytes(), &paths);
        // serde_json's private names as a payload's own members (see NUMBER).
        let private: &[&[u8]] = &[
            br#"{"$serde_json::private::RawValue":"{\"order\":{\"id\":\"A\"}}"}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::Number":"zz"}}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::Number":"12.5"}}"#,
            br#"{"$serde_json::private::RawValue":"nope","order":{"id":"A"}}"#,
            br#"{"order":{"$serde_json::private::RawValue":"{\"id\":7}"}}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::RawValue":"[1,"}}"#,
            br#"{"order":{"id":"A","$serde_json::private::Number":"zz"}}"#,
            br#"{"$serde_json::private::Number":"1","order":{"id":"A"}}"#,
            // Not strings: refused with serde_json's own words.
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::Number":1}}"#,
            br#"{"$serde_json::private::RawValue":null}"#,
            br#"{"order":{"$serde_json::private::RawValue":["x"]}}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::Number":"1x"}}"#,
        ];
        for doc in private {
            same(doc, &paths);
        }
    }

    #[test]
    fn a_path_added_twice_has_one_slot_and_the_rest_is_not_kept() {
        let d = Decoder::new(Format::Json, 1 << 20);
        let (sel, slots) = selection(&["/order/id", "/order/amount", "/order/id"]);
        assert_eq!(slots, [0, 1, 0]);
        let doc = d.decode_selected(br#"{"order":{"id":"A","note":"long text"},"other":[1,2,3]}"#, &sel).unwrap();
        assert_eq!(doc, Selected { slots: vec![Some(serde_json::json!("A")), None] });
        assert_eq!(doc.get(2), None, "a slot the selection does not have");
        let doc = d.decode_selected(br#"{"order":{"id":"A"}}"#, &Selection::default()).unwrap();
        assert_eq!(doc, Selected::default());
    }
}
