//! What each fuzz target exercises, with the invariants it checks beyond "no panic". Shared by the fuzz targets
//! (`fuzz/fuzz_targets/*.rs`, run with `cargo fuzz run <target>`) and by the test that replays the corpus
//! (`tests/it/fuzz_corpus.rs`), so a finding kept in `fuzz/corpus/<target>/` stays a regression test.

use idemflow::store::template::Dialect;
use idemflow::decode::{Decoder, Format};
use idemflow::field::{self, FieldPath, Render};
use idemflow::record::{Position, Record};
use idemflow::rounding;
use idemflow::store::template;
use idemflow::store::redis::numbers;
use idemflow::store::redis_command as command;
use std::path::Path;
use std::sync::Arc;

/// The schemas the `avro` target reads datums with: every kind of type, named types, a recursive one, and an
/// array of values that take no bytes.
const AVRO_SCHEMAS: [&str; 4] = [
    r#"{"type": "record", "name": "P", "namespace": "f", "fields": [
        {"name": "s", "type": "string"}, {"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 4}},
        {"name": "u", "type": ["null", "long", "double", "float", "boolean"]}, {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
        {"name": "a", "type": {"type": "array", "items": "int"}}, {"name": "m", "type": {"type": "map", "values": "bytes"}},
        {"name": "x", "type": {"type": "fixed", "name": "X", "size": 3}}, {"name": "e2", "type": "E"},
        {"name": "t", "type": {"type": "long", "logicalType": "timestamp-micros"}}, {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "tm", "type": {"type": "int", "logicalType": "time-millis"}}, {"name": "lt", "type": {"type": "long", "logicalType": "local-timestamp-nanos"}},
        {"name": "dur", "type": {"type": "fixed", "name": "D", "size": 12, "logicalType": "duration"}},
        {"name": "fd", "type": {"type": "fixed", "name": "FD", "size": 9, "logicalType": "decimal", "precision": 20, "scale": 25}}]}"#,
    r#"{"type": "record", "name": "L", "fields": [{"name": "v", "type": "long"}, {"name": "next", "type": ["null", "L"]}]}"#,
    r#"{"type": "array", "items": "null"}"#,
    r#"{"type": "map", "values": {"type": "array", "items": ["null", "string"]}}"#,
];

/// An Avro datum (the bytes after the first, whose value picks one of [`AVRO_SCHEMAS`]), and the same bytes as a
/// wire-format payload: never a panic, an abort or unbounded memory; a datum that decodes is its whole input (one
/// more byte is refused as left over).
pub fn avro(data: &[u8]) {
    let Some((pick, datum)) = data.split_first() else { return };
    let schema = idemflow::decode::avro::AvroSchema::parse(AVRO_SCHEMAS[usize::from(*pick) % AVRO_SCHEMAS.len()], &[]).unwrap();
    if schema.decode(datum).is_ok() {
        let mut longer = datum.to_vec();
        longer.push(0);
        assert!(schema.decode(&longer).is_err(), "a byte left over was not refused");
    }
    if let Ok((_, rest)) = idemflow::decode::wire::split(datum) {
        assert_eq!(rest.len() + 5, datum.len());
    }
}

/// The `.proto` the `protobuf` target reads messages with: nested messages, enums, maps, oneofs, well-known types,
/// and a recursive message.
const PROTO: &str = r#"syntax = "proto3";
package f;
import "google/protobuf/timestamp.proto";
import "google/protobuf/duration.proto";
import "google/protobuf/wrappers.proto";
import "google/protobuf/struct.proto";
message P {
  message Inner { string s = 1; repeated P again = 2; }
  enum E { Z = 0; A = 1; }
  Inner inner = 1; E e = 2; map<string, Inner> m = 3; map<int64, bytes> mb = 4;
  oneof o { string x = 5; double d = 6; }
  google.protobuf.Timestamp t = 7; google.protobuf.Duration du = 8; google.protobuf.Int64Value w = 9;
  google.protobuf.Struct st = 10; repeated float fl = 11; optional uint64 u = 12; sint32 si = 13;
}
"#;

/// A wire-format Protobuf value (message indexes, then the message's bytes) of [`PROTO`]: never a panic; indexes
/// that name a message decode or fail, never both ways for the same bytes.
pub fn protobuf(data: &[u8]) {
    static FILE: std::sync::OnceLock<idemflow::decode::protobuf::ProtoFile> = std::sync::OnceLock::new();
    let file = FILE.get_or_init(|| idemflow::decode::protobuf::ProtoFile::compile("f.proto", PROTO, &[]).unwrap());
    let Ok((indexes, body)) = idemflow::decode::protobuf::message_indexes(data) else { return };
    let Ok(message) = file.by_indexes(&indexes) else { return };
    let first = idemflow::decode::protobuf::decode(&message, body);
    assert_eq!(first.is_ok(), idemflow::decode::protobuf::decode(&message, body).is_ok());
}

/// A schema's text as a registry serves it: the first byte picks Avro's JSON (even) or a `.proto` file (odd), the
/// rest is the text. The parsers' own panics are caught and make the schema unusable in the worker, but under
/// libFuzzer (which aborts on a panic) a panic is still a finding to fix; a schema whose names follow Java's Avro
/// rule (Unicode letters) parses as the registry's Java code parses it.
pub fn schema_text(data: &[u8]) {
    let Some((pick, text)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(text) else { return };
    if pick % 2 == 0 {
        let parsed = idemflow::decode::avro::AvroSchema::parse(text, &[]);
        if text.contains("\"Überweisung\"") && text.contains("\"type\": \"record\"") {
            assert!(parsed.is_ok(), "{parsed:?}");
        }
    } else {
        let _ = idemflow::decode::protobuf::ProtoFile::compile("fuzzed.proto", text, &[]);
    }
}

/// A pipeline file's text: validated for both SQL dialects, never a panic.
pub fn pipeline(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for dialect in [Dialect::Postgres, Dialect::MySql] {
        if let Ok(p) = idemflow::config::pipeline::load_text_in(text, Path::new("fuzz.toml"), dialect) {
            assert!(!p.name.is_empty());
        }
    }
}

/// SQL statements as `sink.sql` holds them (named parameters, comments, dollar quotes, strings): scanned for both
/// dialects; every parameter is a plain name, and rendering a statement back with its `:name`s gives text the
/// scanner reads to the same parameters.
pub fn sql(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = template::after_leading_with(text);
    for dialect in [Dialect::Postgres, Dialect::MySql] {
        let Ok(statements) = template::parse_in(text, dialect) else { continue };
        for s in &statements {
            for name in &s.params {
                // PostgreSQL's lexer rule, which the scanner follows: ASCII letters, digits, `_`, and any non-ASCII
                // character (a finding of the fuzzer: `:SELEū\u{7ed}OM` is one name).
                assert!(
                    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || !c.is_ascii()),
                    "{name:?}"
                );
            }
            let written = s.render(|n| format!(":{}", s.params[n]));
            if let Ok(again) = template::parse_in(&written, dialect) {
                let names: Vec<&String> = again.iter().flat_map(|a| &a.params).collect();
                for name in &s.params {
                    assert!(names.contains(&name), "{name:?} lost when {written:?} was read again");
                }
            }
        }
    }
}

/// A field path (the first line; several separated by tabs for the selected decode) and a payload (the rest):
/// decoded, looked up, rendered for every kind of target, keys and decimals made canonical, and the rounding check
/// of a column: never a panic; a canonical decimal is its own canonical form; a value rounded for a column fits it.
pub fn values(data: &[u8]) {
    let (line, payload) = match data.iter().position(|b| *b == b'\n') {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &b""[..]),
    };
    let Ok(line) = std::str::from_utf8(line) else { return };
    let decoder = Decoder::new(Format::Json, 1 << 16);
    // The selected decode (what the worker runs) refuses what the whole one refuses, with the same error, and
    // finds what the whole one finds at each selected path (paths inside one another, and a path given twice,
    // share the decode).
    let paths: Vec<FieldPath> = line.split('\t').take(4).filter_map(|p| FieldPath::parse(p).ok()).collect();
    if !paths.is_empty() {
        let mut selection = idemflow::decode::Selection::default();
        let slots: Vec<usize> = paths.iter().map(|p| selection.add(p.tokens())).collect();
        let (whole, part) = (decoder.decode(payload), decoder.decode_selected(payload, &selection));
        match (&whole, &part) {
            (Ok(w), Ok(s)) => {
                for (p, slot) in paths.iter().zip(&slots) {
                    assert_eq!(p.lookup(w), s.get(*slot), "{p}");
                }
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            _ => panic!("whole {whole:?}, selected {part:?}"),
        }
    }
    let path = line.split('\t').next().unwrap_or_default();
    let Ok(doc) = decoder.decode(payload) else { return };
    let found = FieldPath::parse(path).ok().and_then(|p| p.lookup(&doc).cloned()).unwrap_or(doc);
    for render in [Render::Text, Render::Json, Render::Zoned, Render::Array { json: false }, Render::Array { json: true }, Render::Numeric] {
        for refuse_naive in [false, true] {
            if let Ok(text) = field::render(&found, render, refuse_naive) {
                check_decimal(&text);
            }
        }
    }
    let record = Record {
        position: Position { topic: Arc::from("t"), partition: 0, offset: 0 },
        timestamp_ms: None,
        key: Some(payload.to_vec()),
        headers: vec![("h".to_owned(), Some(payload.to_vec()))],
        payload: Some(payload.to_vec()),
        oversized: None,
        properties: Vec::new(),
        delivered_before: None,
        receipt: idemflow::record::Receipt::NONE,
    };
    let text = format!("topics = [\"t\"]\n[key]\nfield = {}\n[sink]\ntable = \"t\"\n[sink.columns]\na = \"/a\"\n", toml_string(path));
    if let Ok(p) = idemflow::config::pipeline::load_text_in(&text, Path::new("fuzz.toml"), Dialect::Postgres) {
        let _ = p.key.extract(&record, &found);
    }
}

fn check_decimal(text: &str) {
    if let Some(c) = field::canonical_decimal(text) {
        assert_eq!(field::canonical_decimal(&c).as_deref(), Some(c.as_str()), "canonical form of {text:?}");
    }
    let _ = field::plain_decimal(text);
    for scale in [-2, 0, 2, 6] {
        if let Some(rounded) = rounding::round_decimal(text, scale) {
            assert_eq!(rounding::round_decimal(&rounded, scale), None, "{text:?} rounded at {scale} to {rounded:?}, which does not fit");
        }
    }
    let _ = rounding::excess_fraction(text, 0);
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// A `[sink] redis` argument and a number: parsed and written back to the same argument; numbers checked as Redis
/// parses them, never a panic, and an integer Redis takes is one Rust reads the same.
pub fn redis(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(arg) = command::parse_arg(text) {
        let again = command::parse_arg(&arg.to_string()).expect("an argument written back parses");
        assert_eq!(again, arg, "{text:?}");
    }
    if let Some(n) = numbers::integer(text) {
        assert_eq!(n.to_string(), text, "string2ll takes only the canonical form");
    }
    let _ = numbers::float(text);
    let words: Vec<&str> = text.split(' ').collect();
    if let Some((name, rest)) = words.split_first() {
        let args: Vec<command::Arg> = rest.iter().filter_map(|w| command::parse_arg(w).ok()).collect();
        if let Ok(slots) = numbers::schema(&name.to_ascii_uppercase(), &args) {
            assert_eq!(slots.len(), args.len());
        }
    }
}
