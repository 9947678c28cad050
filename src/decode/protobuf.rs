//! Protobuf messages to JSON values, by descriptor at run time.
//!
//! Schemas are `.proto` text (what the schema registry serves, and `schema_file`), compiled by protox (a pure-Rust
//! protobuf compiler) with the well-known types (`google/protobuf/*.proto`) built in; a registry that answers with a
//! base64 `FileDescriptorProto` (its `format=serialized` form) is read as such. Messages are decoded by prost-reflect
//! (prost's decoder: nesting bounded at 100 levels, every item taking at least one byte of the payload).
//!
//! What each field becomes (docs/formats.md has the table): a message a JSON object of its fields by their names as
//! written in the `.proto` (a field with presence, such as a `oneof` member, a message, or an `optional` scalar, only
//! when set; a proto3 scalar without presence always, as its default when absent, since the wire cannot tell them
//! apart), `repeated` an array, `map` an object, an enum its value's name (its number when the schema has no such
//! value), 32-bit integers and 64-bit ones exact, `float` and `double` as for Avro, `bytes` `\x` and hex, and the
//! well-known types as their values: `Timestamp` RFC 3339 in UTC, `Duration` seconds with an `s`
//! (`"1.500s"`, as protobuf's JSON mapping writes it), the wrappers (`StringValue`, `Int64Value`, ...) their value,
//! `Struct`, `Value` and `ListValue` the JSON they hold.

use prost_reflect::{DescriptorPool, DynamicMessage, FileDescriptor, Kind, MapKey, MessageDescriptor, ReflectMessage as _, Value as PValue};
use serde_json::{Map, Value};
use std::collections::HashMap;

/// The most message indexes a wire-format payload may carry (the depth of nested message types it can name).
const MAX_INDEXES: usize = 64;

/// A compiled `.proto` file: the descriptors of its messages, and those of the files it imports.
#[derive(Clone, Debug)]
pub struct ProtoFile {
    file: FileDescriptor,
}

impl ProtoFile {
    /// Compiles `text`, the file `name`, whose imports are `imports` (import path, text or base64
    /// `FileDescriptorProto`) or the well-known types.
    ///
    /// Errors: a file that does not parse, an import that is neither given nor well-known, a type defined nowhere.
    pub fn compile(name: &str, text: &str, imports: &[(String, String)]) -> Result<ProtoFile, String> {
        // The compiler's bugs on a text the registry accepted (fuzzed: fuzz/fuzz_targets/schema_text.rs) make the
        // schema unusable, its records dead letters; never a panic that stops the pipeline.
        std::panic::catch_unwind(|| Self::compile_unguarded(name, text, imports))
            .unwrap_or_else(|payload| Err(format!("the Protobuf compiler failed on it ({})", super::panic_text(payload.as_ref()))))
    }

    fn compile_unguarded(name: &str, text: &str, imports: &[(String, String)]) -> Result<ProtoFile, String> {
        let serialized = std::panic::catch_unwind(|| serialized(name, text, imports)).map_err(|_| "the serialized descriptor is not usable".to_owned())?;
        if let Some(file) = serialized? {
            return Ok(ProtoFile { file });
        }
        let mut sources: HashMap<String, String> = imports.iter().cloned().collect();
        sources.insert(name.to_owned(), text.to_owned());
        let mut resolver = protox::file::ChainFileResolver::new();
        resolver.add(Sources(sources));
        resolver.add(protox::file::GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler.include_imports(true);
        compiler.open_file(name).map_err(|e| e.to_string())?;
        let pool = compiler.descriptor_pool();
        let file = pool.get_file_by_name(name).ok_or_else(|| format!("{name} is not in its own compilation"))?;
        Ok(ProtoFile { file })
    }

    /// The message `name` (its full name, `package.Message`; or its name alone when the file's package holds it).
    ///
    /// Errors: the file has no such message, naming those it has.
    pub fn message(&self, name: &str) -> Result<MessageDescriptor, String> {
        let pool = self.file.parent_pool();
        let package = self.file.package_name();
        let qualified = if package.is_empty() || name.contains('.') { name.to_owned() } else { format!("{package}.{name}") };
        pool.get_message_by_name(&qualified).or_else(|| pool.get_message_by_name(name)).ok_or_else(|| {
            let all: Vec<String> = pool.all_messages().filter(|m| m.parent_file() == self.file).map(|m| m.full_name().to_owned()).collect();
            format!("no message {name:?} (the file has {})", all.join(", "))
        })
    }

    /// The file's top-level messages.
    pub fn messages(&self) -> Vec<MessageDescriptor> {
        self.file.messages().collect()
    }

    /// The message a wire-format payload's message indexes name: the first index a top-level message of the file,
    /// each next one a message nested in the one before.
    ///
    /// Errors: an index out of range.
    pub fn by_indexes(&self, indexes: &[i64]) -> Result<MessageDescriptor, String> {
        let mut found: Option<MessageDescriptor> = None;
        for &i in indexes {
            let at = usize::try_from(i).map_err(|_| format!("message index {i} is negative"))?;
            let next = match &found {
                None => self.file.messages().nth(at),
                Some(m) => m.child_messages().nth(at),
            };
            found = Some(next.ok_or_else(|| format!("message indexes {indexes:?} name no message of {}", self.file.name()))?);
        }
        found.ok_or_else(|| "no message index".to_owned())
    }
}

/// A file given as a base64 `FileDescriptorProto` (with its imports in the same form), or `None` for `.proto` text.
fn serialized(name: &str, text: &str, imports: &[(String, String)]) -> Result<Option<FileDescriptor>, String> {
    use prost_reflect::prost::Message as _;
    let decode = |t: &str| {
        let bytes = base64_decode(t.trim())?;
        prost_reflect::prost_types::FileDescriptorProto::decode(bytes.as_slice()).ok()
    };
    let Some(mut main) = decode(text) else { return Ok(None) };
    if main.name.as_deref().unwrap_or_default().is_empty() {
        main.name = Some(name.to_owned());
    }
    let main_name = main.name.clone().unwrap_or_default();
    let mut files: Vec<prost_reflect::prost_types::FileDescriptorProto> = Vec::new();
    for (import, t) in imports {
        let mut f = decode(t).ok_or_else(|| format!("the import {import} is not in the same serialized form"))?;
        f.name = Some(import.clone());
        files.push(f);
    }
    files.push(main);
    // The well-known types the files import and do not carry, from protox's own copies.
    let given: Vec<String> = files.iter().filter_map(|f| f.name.clone()).collect();
    let mut pool = DescriptorPool::new();
    for dep in files.iter().flat_map(|f| f.dependency.iter()).filter(|d| !given.contains(d)) {
        let mut compiler = protox::Compiler::with_file_resolver(protox::file::GoogleFileResolver::new());
        compiler.include_imports(true);
        compiler.open_file(dep).map_err(|e| format!("the import {dep}: {e}"))?;
        for f in compiler.file_descriptor_set().file {
            if pool.get_file_by_name(f.name()).is_none() {
                pool.add_file_descriptor_proto(f).map_err(|e| e.to_string())?;
            }
        }
    }
    pool.add_file_descriptor_protos(files).map_err(|e| e.to_string())?;
    // prost-reflect takes a map entry's key and value fields for granted: a descriptor without them is refused
    // here, before a decode would panic on it.
    if let Some(bad) = pool.all_messages().find(|m| m.is_map_entry() && (m.get_field(1).is_none() || m.get_field(2).is_none())) {
        return Err(format!("the map entry {} has no key or value field", bad.full_name()));
    }
    Ok(pool.get_file_by_name(&main_name))
}

/// Standard base64 (with or without padding); `None` when `text` is not that.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|c| *c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// The `.proto` files a compilation reads, by import path.
struct Sources(HashMap<String, String>);

impl protox::file::FileResolver for Sources {
    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        match self.0.get(name) {
            Some(text) => protox::file::File::from_source(name, text),
            None => Err(protox::Error::file_not_found(name)),
        }
    }
}

/// The message indexes at the start of a wire-format Protobuf value (after the schema id), and the message's
/// bytes after them: a zig-zag varint count, then as many zig-zag varints; a count of 0 is `[0]`, the first
/// message of the file.
///
/// Errors: the bytes end early, or claim more than [`MAX_INDEXES`].
pub fn message_indexes(body: &[u8]) -> Result<(Vec<i64>, &[u8]), String> {
    let mut pos = 0;
    let mut next = || -> Result<i64, String> {
        let mut n: u64 = 0;
        for i in 0..10 {
            let b = *body.get(pos).ok_or("the message indexes end early")?;
            pos += 1;
            n |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(((n >> 1) as i64) ^ -((n & 1) as i64));
            }
        }
        Err("a message index longer than 10 bytes".to_owned())
    };
    let count = next()?;
    let count = usize::try_from(count).ok().filter(|c| *c <= MAX_INDEXES).ok_or_else(|| format!("{count} message indexes"))?;
    let indexes = if count == 0 { vec![0] } else { (0..count).map(|_| next()).collect::<Result<Vec<_>, _>>()? };
    Ok((indexes, &body[pos..]))
}

/// Decodes `bytes` as a `message` and renders it whole (see the module documentation).
///
/// Errors: the bytes are not a valid encoding of the message, a well-known type holds a value out of its range, or
/// the message renders to more values than its length allows ([`Renderer`]).
pub fn decode(message: &MessageDescriptor, bytes: &[u8]) -> Result<Value, String> {
    let mut selection = super::select::Selection::default();
    let slot = selection.add(&[]);
    let mut selected = decode_selected(message, bytes, &selection)?;
    Ok(selected.take(slot).unwrap_or(Value::Null))
}

/// Decodes `bytes` as a `message`, rendering only what `selection` reads: a plain message on a selected path is
/// walked field by field, and only the selected values (and the lists, maps and well-known types a path goes
/// through) are rendered. Each selected path's slot holds what looking it up in the whole rendering gives.
///
/// Errors: as [`decode`].
pub(super) fn decode_selected(message: &MessageDescriptor, bytes: &[u8], selection: &super::select::Selection) -> Result<super::select::Selected, String> {
    // A descriptor the registry served that prost-reflect cannot use may make it panic: an error, never a crash.
    let decoded = std::panic::catch_unwind(|| DynamicMessage::decode(message.clone(), bytes))
        .map_err(|_| "the message's descriptor is not usable".to_owned())?
        .map_err(|e| e.to_string())?;
    let mut slots = vec![None; selection.slots];
    let mut r = Renderer { budget: bytes.len().saturating_mul(4).saturating_add(4096) };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Some(s) = selection.whole {
            slots[s] = Some(r.message(&decoded)?);
        }
        walk(selection, &decoded, &mut slots, &mut r)
    }))
    .map_err(|_| "the message's descriptor is not usable".to_owned())??;
    Ok(super::select::Selected { slots })
}

/// Fills the slots of `sel`'s members from message `m`.
fn walk(sel: &super::select::Selection, m: &DynamicMessage, slots: &mut [Option<Value>], r: &mut Renderer) -> Result<(), String> {
    for (name, child) in &sel.members {
        let Some(f) = m.descriptor().get_field_by_name(name) else { continue };
        if f.supports_presence() && !m.has_field(&f) {
            continue;
        }
        let v = m.get_field(&f);
        match &*v {
            PValue::Message(sub) if !f.is_list() && !f.is_map() && !well_known(sub.descriptor().full_name()) => {
                if let Some(s) = child.whole {
                    slots[s] = Some(r.message(sub)?);
                }
                walk(child, sub, slots, r)?;
            }
            _ => {
                let value = r.field(&f, &v)?;
                child.fill(&value, slots);
                if let Some(s) = child.whole {
                    slots[s] = Some(value);
                }
            }
        }
    }
    Ok(())
}

/// Whether a message type renders as a value of its own rather than an object of its fields.
fn well_known(name: &str) -> bool {
    name.starts_with("google.protobuf.")
        && matches!(
            &name["google.protobuf.".len()..],
            "Timestamp" | "Duration" | "DoubleValue" | "FloatValue" | "Int64Value" | "UInt64Value" | "Int32Value" | "UInt32Value"
                | "BoolValue" | "StringValue" | "BytesValue" | "Struct" | "Value" | "ListValue"
        )
}

/// Renders decoded values as JSON, each value taking one of its budget: four values a byte of the payload, and
/// 4,096 (proto3 fields without presence render as their defaults, so a list of empty sub-messages, two bytes
/// each, could otherwise render to billions of values).
struct Renderer {
    budget: usize,
}

impl Renderer {
    fn spend(&mut self) -> Result<(), String> {
        self.budget = self.budget.checked_sub(1).ok_or("the message renders to more values than its length allows")?;
        Ok(())
    }

    fn message(&mut self, m: &DynamicMessage) -> Result<Value, String> {
        self.spend()?;
        let desc = m.descriptor();
        let field = |n: u32| desc.get_field(n);
        match desc.full_name() {
            "google.protobuf.Timestamp" => {
                let (s, n) = seconds_nanos(m);
                return jiff::Timestamp::new(s, n).map(|t| Value::String(t.to_string())).map_err(|_| format!("a Timestamp out of range ({s} s, {n} ns)"));
            }
            "google.protobuf.Duration" => {
                let (s, n) = seconds_nanos(m);
                if n.unsigned_abs() >= 1_000_000_000 || (s > 0 && n < 0) || (s < 0 && n > 0) {
                    return Err(format!("a Duration out of range ({s} s, {n} ns)"));
                }
                let sign = if s < 0 || n < 0 { "-" } else { "" };
                let (s, n) = (s.unsigned_abs(), n.unsigned_abs());
                // 0, 3, 6 or 9 digits of the fraction, as protobuf's JSON mapping writes a Duration.
                let fraction = match n {
                    0 => String::new(),
                    n if n % 1_000_000 == 0 => format!(".{:03}", n / 1_000_000),
                    n if n % 1_000 == 0 => format!(".{:06}", n / 1_000),
                    n => format!(".{n:09}"),
                };
                return Ok(Value::String(format!("{sign}{s}{fraction}s")));
            }
            name if well_known(name) && name != "google.protobuf.Value" => {
                return match field(1) {
                    Some(f) => self.value(&m.get_field(&f), &f.kind()),
                    None => Ok(Value::Null),
                };
            }
            "google.protobuf.Value" => {
                return match m.fields().next() {
                    Some((f, v)) if f.name() != "null_value" => self.value(v, &f.kind()),
                    _ => Ok(Value::Null),
                };
            }
            _ => {}
        }
        let mut out = Map::new();
        for f in desc.fields() {
            if f.supports_presence() && !m.has_field(&f) {
                continue;
            }
            let rendered = self.field(&f, &m.get_field(&f))?;
            out.insert(f.name().to_owned(), rendered);
        }
        Ok(Value::Object(out))
    }

    /// The value `v` of field `f` (a map field's entries as an object).
    fn field(&mut self, f: &prost_reflect::FieldDescriptor, v: &PValue) -> Result<Value, String> {
        if f.is_map() {
            let Kind::Message(entry) = f.kind() else { return Ok(Value::Null) };
            return self.map(v, &entry.map_entry_value_field().kind());
        }
        self.value(v, &f.kind())
    }

    fn map(&mut self, v: &PValue, value_kind: &Kind) -> Result<Value, String> {
        self.spend()?;
        let PValue::Map(entries) = v else { return Ok(Value::Null) };
        let mut keys: Vec<&MapKey> = entries.keys().collect();
        keys.sort();
        let mut out = Map::new();
        for k in keys {
            out.insert(map_key(k), self.value(&entries[k], value_kind)?);
        }
        Ok(Value::Object(out))
    }

    fn value(&mut self, v: &PValue, kind: &Kind) -> Result<Value, String> {
        if let PValue::Message(m) = v {
            return self.message(m);
        }
        if let PValue::Map(_) = v {
            let value_kind = match kind {
                Kind::Message(entry) if entry.is_map_entry() => entry.map_entry_value_field().kind(),
                other => other.clone(),
            };
            return self.map(v, &value_kind);
        }
        self.spend()?;
        Ok(match v {
            PValue::Bool(b) => Value::Bool(*b),
            PValue::I32(n) => Value::from(*n),
            PValue::I64(n) => Value::from(*n),
            PValue::U32(n) => Value::from(*n),
            PValue::U64(n) => Value::from(*n),
            PValue::F32(f) => super::avro::float(f64::from(*f), &f.to_string()),
            PValue::F64(f) => super::avro::float(*f, &f.to_string()),
            PValue::String(s) => Value::String(s.clone()),
            PValue::Bytes(b) => Value::String(super::avro::hex(b)),
            PValue::EnumNumber(n) => match kind {
                Kind::Enum(e) => e.get_value(*n).map_or_else(|| Value::from(*n), |v| Value::String(v.name().to_owned())),
                _ => Value::from(*n),
            },
            PValue::List(items) => Value::Array(items.iter().map(|i| self.value(i, kind)).collect::<Result<_, _>>()?),
            PValue::Message(_) | PValue::Map(_) => unreachable!("handled above"),
        })
    }
}

fn seconds_nanos(m: &DynamicMessage) -> (i64, i32) {
    let get = |n: u32| m.descriptor().get_field(n).map(|f| m.get_field(&f).into_owned());
    let s = match get(1) {
        Some(PValue::I64(s)) => s,
        _ => 0,
    };
    let n = match get(2) {
        Some(PValue::I32(n)) => n,
        _ => 0,
    };
    (s, n)
}

fn map_key(k: &MapKey) -> String {
    match k {
        MapKey::Bool(b) => b.to_string(),
        MapKey::I32(n) => n.to_string(),
        MapKey::I64(n) => n.to_string(),
        MapKey::U32(n) => n.to_string(),
        MapKey::U64(n) => n.to_string(),
        MapKey::String(s) => s.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAYMENT: &str = r#"
syntax = "proto3";
package shop.events;
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";

message Payment {
  message Order {
    string id = 1;
    string account = 2;
    string amount = 3;
  }
  enum Method { METHOD_UNSPECIFIED = 0; CARD = 1; BANK = 2; }
  Order order = 1;
  google.protobuf.Timestamp paid_at = 2;
  Method method = 3;
  repeated string tags = 4;
  bytes fingerprint = 5;
  map<string, string> context = 6;
  int64 seq = 7;
  oneof instrument { string card = 8; string iban = 9; }
  google.protobuf.StringValue note = 10;
  uint32 retries = 11;
}
"#;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn field(n: u32, wire: u8, out: &mut Vec<u8>) {
        varint(u64::from(n) << 3 | u64::from(wire), out);
    }

    fn bytes_field(n: u32, b: &[u8], out: &mut Vec<u8>) {
        field(n, 2, out);
        varint(b.len() as u64, out);
        out.extend(b);
    }

    #[test]
    fn a_message_reads_as_exact_json() {
        let file = ProtoFile::compile("payment.proto", PAYMENT, &[]).unwrap();
        let m = file.message("Payment").unwrap();
        assert_eq!(m.full_name(), "shop.events.Payment");
        let mut order = Vec::new();
        bytes_field(1, b"ORD-1", &mut order);
        bytes_field(3, b"100.000000000000000001", &mut order);
        let mut ts = Vec::new();
        field(1, 0, &mut ts);
        varint(1_764_410_400, &mut ts);
        field(2, 0, &mut ts);
        varint(123_000_000, &mut ts);
        let mut entry = Vec::new();
        bytes_field(1, b"channel", &mut entry);
        bytes_field(2, b"web", &mut entry);
        let mut b = Vec::new();
        bytes_field(1, &order, &mut b);
        bytes_field(2, &ts, &mut b);
        field(3, 0, &mut b);
        varint(2, &mut b);
        bytes_field(4, b"a", &mut b);
        bytes_field(4, b"b", &mut b);
        bytes_field(5, &[0xde, 0xad], &mut b);
        bytes_field(6, &entry, &mut b);
        field(7, 0, &mut b);
        varint(9_007_199_254_740_993, &mut b);
        bytes_field(9, b"DE89", &mut b);
        let v = decode(&m, &b).unwrap();
        assert_eq!(
            v.to_string(),
            r#"{"order":{"id":"ORD-1","account":"","amount":"100.000000000000000001"},"paid_at":"2025-11-29T10:00:00.123Z","method":"BANK","tags":["a","b"],"fingerprint":"\\xdead","context":{"channel":"web"},"seq":9007199254740993,"iban":"DE89","retries":0}"#
        );
        assert!(decode(&m, &[0xff]).is_err());
        // A list of empty sub-messages, two bytes each, each rendering its defaults: bounded, an error.
        let mut many = Vec::new();
        for _ in 0..5000 {
            bytes_field(1, &[], &mut many);
        }
        let fields: String = (1..=12).map(|n| format!("int32 f{n} = {n}; ")).collect();
        let f = ProtoFile::compile("l.proto", &format!("syntax = \"proto3\"; message E {{ {fields}}} message L {{ repeated E e = 1; }}"), &[]).unwrap();
        let bounded = decode(&f.message("L").unwrap(), &many);
        assert!(bounded.as_ref().is_err_and(|e| e.contains("more values")), "{:?}", bounded.map(|v| v.to_string().len()));
        // A Timestamp out of range is an error, not a null.
        let mut ts = Vec::new();
        field(1, 0, &mut ts);
        varint(i64::MAX as u64, &mut ts);
        let mut b = Vec::new();
        bytes_field(2, &ts, &mut b);
        assert!(decode(&m, &b).unwrap_err().contains("Timestamp out of range"));
    }

    #[test]
    fn message_indexes_name_nested_messages() {
        let file = ProtoFile::compile("payment.proto", PAYMENT, &[]).unwrap();
        assert_eq!(message_indexes(&[0, 7]).unwrap(), (vec![0], &[7u8][..]));
        // [0, 0]: Payment.Order (count 2, zig-zag).
        let (idx, rest) = message_indexes(&[4, 0, 0, 9]).unwrap();
        assert_eq!((idx.as_slice(), rest), (&[0i64, 0][..], &[9u8][..]));
        assert_eq!(file.by_indexes(&idx).unwrap().full_name(), "shop.events.Payment.Order");
        assert!(file.by_indexes(&[3]).is_err());
        assert!(message_indexes(&[2]).is_err());
        assert!(message_indexes(&[0xfe, 0x01]).is_err(), "127 indexes");
    }

    #[test]
    fn bad_schemas_are_errors() {
        assert!(ProtoFile::compile("a.proto", "syntax = \"proto3\"; message A { B b = 1; }", &[]).is_err());
        assert!(ProtoFile::compile("a.proto", "syntax = \"proto3\"; import \"other.proto\";", &[]).is_err());
        let other = ("other.proto".to_owned(), "syntax = \"proto3\"; package o; message B { int32 x = 1; }".to_owned());
        let f = ProtoFile::compile("a.proto", "syntax = \"proto3\"; import \"other.proto\"; message A { o.B b = 1; }", &[other]).unwrap();
        assert!(f.message("A").is_ok());
        assert!(f.message("Nope").unwrap_err().contains("no message"));
    }
}
