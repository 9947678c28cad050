//! Avro binary datums to JSON values, by their writer's schema.
//!
//! The schema is parsed by the Apache Avro crate (`apache-avro`: named types, namespaces, logical types,
//! references); the datum is read here. The crate's own datum decoder reserves room for as many items as a block
//! says before reading them (a payload of a few bytes claiming 500 million items asks for gigabytes, and the
//! process aborts when they cannot be had) and recurses as deep as a recursive schema's payload nests (a stack
//! overflow): a bad record would stop the worker instead of going to the dead letters. This reader bounds both: an
//! array or map grows only as its items are read, the values a datum may hold are bounded by its length
//! (one value a byte), and nesting by [`MAX_DEPTH`]. A `decimal` longer than its precision allows is refused
//! before it is converted (a huge one would take seconds of CPU to print).
//!
//! What each Avro type becomes (docs/formats.md has the table): records and maps are JSON objects (a record's
//! fields in schema order), arrays arrays, a union its branch's value (`null` as null), an enum its symbol, `int`
//! and `long` exact integers, `float` and `double` their shortest exact decimal (NaN and the infinities as the
//! strings `"NaN"`, `"Infinity"`, `"-Infinity"`), `bytes` and `fixed` `\x` and lowercase hex (PostgreSQL's `bytea`
//! text form), `decimal` its exact decimal value with its scale, `uuid` its text, `date` `YYYY-MM-DD`,
//! `time-millis`/`time-micros` `HH:MM:SS.fff(fff)`, `timestamp-*` RFC 3339 in UTC with `Z`,
//! `local-timestamp-*` the date and time without an offset, `duration` ISO 8601 (`P1M2DT3.004S`).
//! The rules are the Avro specification's (<https://avro.apache.org/docs/1.12.0/specification/>).

use apache_avro::schema::{Name, Namespace, Schema};
use serde_json::{Map, Number, Value};
use std::collections::HashMap;
use std::fmt::Write as _;

/// The deepest nesting of records, arrays, maps and unions a datum may have (as serde_json's 128 for JSON).
pub const MAX_DEPTH: usize = 128;

/// An Avro schema ready to read datums with: the schema and every named type it and its references define.
#[derive(Clone, Debug)]
pub struct AvroSchema {
    root: Schema,
    names: HashMap<Name, Schema>,
}

impl AvroSchema {
    /// Parses `text` (the schema's JSON), with `references` (the JSON of the schemas defining named types it
    /// uses, in any order).
    ///
    /// Errors: the schema or a reference does not parse, or a named type is used but defined nowhere.
    pub fn parse(text: &str, references: &[String]) -> Result<AvroSchema, String> {
        // Names as Java's Avro (and so the registry) accepts them; and the parser's bugs on a text the registry
        // accepted (fuzzed: fuzz/fuzz_targets/schema_text.rs) make the schema unusable, its records dead letters,
        // never a panic that stops the pipeline.
        super::avro_names::install();
        std::panic::catch_unwind(|| Self::parse_unguarded(text, references))
            .unwrap_or_else(|payload| Err(format!("the Avro schema parser failed on it ({})", super::panic_text(payload.as_ref()))))
    }

    fn parse_unguarded(text: &str, references: &[String]) -> Result<AvroSchema, String> {
        let text = fixed_logical_types(text)?;
        let references = references.iter().map(|r| fixed_logical_types(r)).collect::<Result<Vec<_>, _>>()?;
        let (root, refs) = if references.is_empty() {
            (Schema::parse_str(&text).map_err(|e| e.to_string())?, Vec::new())
        } else {
            Schema::parse_str_with_list(&text, &references).map_err(|e| e.to_string())?
        };
        let mut names = HashMap::new();
        for s in refs.iter().chain(std::iter::once(&root)) {
            define(s, &None, &mut names);
        }
        for s in refs.iter().chain(std::iter::once(&root)) {
            if let Some(missing) = undefined(s, &None, &names) {
                return Err(format!("the named type {} is defined nowhere", missing.fullname(None)));
            }
        }
        Ok(AvroSchema { root, names })
    }

    /// The schema's root type.
    pub fn root(&self) -> &Schema {
        &self.root
    }

    /// The type a `Schema::Ref` names, read in `namespace`.
    pub fn named(&self, name: &Name, namespace: &Namespace) -> Option<&Schema> {
        self.names.get(&name.fully_qualified_name(namespace))
    }

    /// Reads one datum that is the whole of `bytes`.
    ///
    /// Errors: the bytes end early, do not follow the schema (a union branch or enum symbol out of range, a string
    /// that is not UTF-8, a negative length), nest deeper than [`MAX_DEPTH`], hold more values than their length
    /// allows, or bytes are left over.
    pub fn decode(&self, bytes: &[u8]) -> Result<Value, String> {
        let mut r = Reader { bytes, pos: 0, budget: bytes.len().saturating_add(1024), schema: self };
        let value = r.value(&self.root, &None, 0)?;
        if r.pos != bytes.len() {
            return Err(format!("{} bytes left over after the datum", bytes.len() - r.pos));
        }
        Ok(value)
    }
}

/// The attribute a `fixed` type carries instead of `"logicalType": "uuid"` (16 bytes) or `"duration"` (12 bytes)
/// when [`fixed_logical_types`] rewrote it: its value is the logical type.
pub(super) const FIXED_LOGICAL: &str = "idemflow.logicalType";

/// The schema text with the `uuid` and `duration` logical types of `fixed` types moved to [`FIXED_LOGICAL`]: the
/// Avro crate parses both into types that no longer say they are `fixed` of a size and a name (a uuid on `fixed(16)`
/// would be read as a string, a named duration could not be referred to). A logical type on a `fixed` of the wrong
/// size is dropped, as the specification says (the type reads as its `fixed`).
fn fixed_logical_types(text: &str) -> Result<String, String> {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(o) => {
                let size = o.get("size").and_then(Value::as_u64);
                let logical = o.get("logicalType").and_then(Value::as_str).map(str::to_owned);
                if o.get("type").and_then(Value::as_str) == Some("fixed") {
                    match (logical.as_deref(), size) {
                        (Some("uuid"), Some(16)) | (Some("duration"), Some(12)) => {
                            o.remove("logicalType");
                            o.insert(FIXED_LOGICAL.to_owned(), Value::String(logical.unwrap_or_default()));
                        }
                        (Some("uuid" | "duration"), _) => {
                            o.remove("logicalType");
                        }
                        _ => {}
                    }
                }
                o.values_mut().for_each(walk);
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    let mut v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    walk(&mut v);
    Ok(v.to_string())
}

/// Adds the named types `schema` defines (records, enums, fixed; a named `decimal` on `fixed` too) to `names`, by
/// their full names in `ns`.
fn define(schema: &Schema, ns: &Namespace, names: &mut HashMap<Name, Schema>) {
    match schema {
        Schema::Record(r) => {
            let full = r.name.fully_qualified_name(ns);
            names.insert(full.clone(), schema.clone());
            for f in &r.fields {
                define(&f.schema, &full.namespace, names);
            }
        }
        Schema::Enum(e) => {
            names.insert(e.name.fully_qualified_name(ns), schema.clone());
        }
        Schema::Fixed(f) => {
            names.insert(f.name.fully_qualified_name(ns), schema.clone());
        }
        Schema::Decimal(d) => {
            if let Schema::Fixed(f) = &*d.inner {
                names.insert(f.name.fully_qualified_name(ns), schema.clone());
            }
        }
        Schema::Array(a) => define(&a.items, ns, names),
        Schema::Map(m) => define(&m.types, ns, names),
        Schema::Union(u) => u.variants().iter().for_each(|v| define(v, ns, names)),
        _ => {}
    }
}

/// A named type `schema` uses that `names` does not define.
fn undefined(schema: &Schema, ns: &Namespace, names: &HashMap<Name, Schema>) -> Option<Name> {
    match schema {
        Schema::Ref { name } => {
            let full = name.fully_qualified_name(ns);
            (!names.contains_key(&full)).then_some(full)
        }
        Schema::Record(r) => {
            let inner = r.name.fully_qualified_name(ns).namespace;
            r.fields.iter().find_map(|f| undefined(&f.schema, &inner, names))
        }
        Schema::Array(a) => undefined(&a.items, ns, names),
        Schema::Map(m) => undefined(&m.types, ns, names),
        Schema::Union(u) => u.variants().iter().find_map(|v| undefined(v, ns, names)),
        _ => None,
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Values still allowed: every value read takes one. Items of `null` take no bytes, so a block's count alone
    /// could say a billion; the budget (one value a byte, and 1,024) bounds what a datum decodes to. Every other
    /// type takes at least a byte a value (a boolean, an array of booleans), so no valid datum that is not mostly
    /// `null`s comes near it; the memory it bounds is about what serde_json builds for a JSON array of as many
    /// numbers.
    budget: usize,
    schema: &'a AvroSchema,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.bytes.len()).ok_or_else(|| {
            format!("ends early: {n} bytes wanted at byte {}, {} left", self.pos, self.bytes.len() - self.pos)
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// A zig-zag varint `long` (at most 10 bytes).
    fn long(&mut self) -> Result<i64, String> {
        let mut n: u64 = 0;
        for i in 0..10 {
            let b = *self.take(1)?.first().unwrap_or(&0);
            n |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(((n >> 1) as i64) ^ -((n & 1) as i64));
            }
        }
        Err(format!("a variable-length integer longer than 10 bytes at byte {}", self.pos))
    }

    fn int(&mut self) -> Result<i32, String> {
        let n = self.long()?;
        i32::try_from(n).map_err(|_| format!("{n} is out of an int's range"))
    }

    fn len(&mut self) -> Result<usize, String> {
        let n = self.long()?;
        usize::try_from(n).map_err(|_| format!("a negative length {n}"))
    }

    fn bytes_value(&mut self) -> Result<&[u8], String> {
        let n = self.len()?;
        self.take(n)
    }

    fn text(&mut self) -> Result<String, String> {
        let b = self.bytes_value()?;
        std::str::from_utf8(b).map(str::to_owned).map_err(|e| format!("a string that is not UTF-8: {e}"))
    }

    /// The count of the next block of an array or map (a negative count is followed by the block's size in bytes,
    /// which is skipped).
    fn block(&mut self) -> Result<usize, String> {
        let n = self.long()?;
        if n < 0 {
            self.len()?;
            return usize::try_from(n.unsigned_abs()).map_err(|_| "a block count out of range".to_owned());
        }
        Ok(n as usize)
    }

    fn spend(&mut self) -> Result<(), String> {
        self.budget = self.budget.checked_sub(1).ok_or("holds more values than its length allows")?;
        Ok(())
    }

    /// An array's blocks of `items` values, until the empty block.
    fn array(&mut self, items: &Schema, ns: &Namespace, depth: usize) -> Result<Value, String> {
        let mut values = Vec::new();
        loop {
            let n = self.block()?;
            if n == 0 {
                return Ok(Value::Array(values));
            }
            for _ in 0..n {
                values.push(self.value(items, ns, depth + 1)?);
            }
        }
    }

    /// A map's blocks of string keys and `types` values, until the empty block.
    fn map(&mut self, types: &Schema, ns: &Namespace, depth: usize) -> Result<Value, String> {
        let mut entries = Map::new();
        loop {
            let n = self.block()?;
            if n == 0 {
                return Ok(Value::Object(entries));
            }
            for _ in 0..n {
                let key = self.text()?;
                let v = self.value(types, ns, depth + 1)?;
                entries.insert(key, v);
            }
        }
    }

    fn value(&mut self, schema: &Schema, ns: &Namespace, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err(format!("nests deeper than {MAX_DEPTH} levels"));
        }
        self.spend()?;
        Ok(match schema {
            Schema::Null => Value::Null,
            Schema::Boolean => match self.take(1)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{b} is not a boolean")),
            },
            Schema::Int => Value::from(self.int()?),
            Schema::Long => Value::from(self.long()?),
            Schema::Float => {
                let b = self.take(4)?;
                float(f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])), &f32::from_le_bytes([b[0], b[1], b[2], b[3]]).to_string())
            }
            Schema::Double => {
                let b: [u8; 8] = self.take(8)?.try_into().map_err(|_| "a double of the wrong size")?;
                let d = f64::from_le_bytes(b);
                float(d, &d.to_string())
            }
            Schema::Bytes | Schema::BigDecimal => Value::String(hex(self.bytes_value()?)),
            Schema::Fixed(f) => match f.attributes.get(FIXED_LOGICAL).and_then(Value::as_str) {
                Some("uuid") => Value::String(uuid(self.take(16)?)),
                Some("duration") => duration(self.take(12)?),
                _ => Value::String(hex(self.take(f.size)?)),
            },
            Schema::String | Schema::Uuid => Value::String(self.text()?),
            Schema::Enum(e) => {
                let i = self.int()?;
                let symbol = usize::try_from(i).ok().and_then(|i| e.symbols.get(i));
                Value::String(symbol.ok_or_else(|| format!("enum {} has no symbol {i}", e.name.name))?.clone())
            }
            Schema::Union(u) => {
                let i = self.long()?;
                let branch = usize::try_from(i).ok().and_then(|i| u.variants().get(i));
                let branch = branch.ok_or_else(|| format!("union branch {i} of {}", u.variants().len()))?;
                self.value(branch, ns, depth + 1)?
            }
            Schema::Array(a) => self.array(&a.items, ns, depth)?,
            Schema::Map(m) => self.map(&m.types, ns, depth)?,
            Schema::Record(r) => {
                let inner = r.name.fully_qualified_name(ns).namespace;
                let mut fields = Map::new();
                for f in &r.fields {
                    let v = self.value(&f.schema, &inner, depth + 1)?;
                    fields.insert(f.name.clone(), v);
                }
                Value::Object(fields)
            }
            Schema::Ref { name } => {
                let target = self.schema.named(name, ns).ok_or_else(|| format!("the named type {} is defined nowhere", name.name))?;
                let inner = name.fully_qualified_name(ns).namespace;
                // The value was counted for the reference; the type it names counts it again.
                self.budget += 1;
                return self.value(target, &inner, depth + 1);
            }
            Schema::Decimal(d) => {
                let raw = match &*d.inner {
                    Schema::Fixed(f) => self.take(f.size)?,
                    _ => self.bytes_value()?,
                };
                decimal(raw, d.precision, d.scale)?
            }
            Schema::Date => {
                let days = self.int()?;
                let out_of_range = || format!("date {days} days from 1970-01-01 is out of range");
                let span = jiff::Span::new().try_days(i64::from(days)).map_err(|_| out_of_range())?;
                Value::String(jiff::civil::date(1970, 1, 1).checked_add(span).map_err(|_| out_of_range())?.to_string())
            }
            Schema::TimeMillis => Value::String(time_of_day(i64::from(self.int()?) * 1_000, 3)?),
            Schema::TimeMicros => Value::String(time_of_day(self.long()?, 6)?),
            Schema::TimestampMillis => instant(i128::from(self.long()?) * 1_000_000, false)?,
            Schema::TimestampMicros => instant(i128::from(self.long()?) * 1_000, false)?,
            Schema::TimestampNanos => instant(i128::from(self.long()?), false)?,
            Schema::LocalTimestampMillis => instant(i128::from(self.long()?) * 1_000_000, true)?,
            Schema::LocalTimestampMicros => instant(i128::from(self.long()?) * 1_000, true)?,
            Schema::LocalTimestampNanos => instant(i128::from(self.long()?), true)?,
            // Rewritten to a fixed by `fixed_logical_types`; read the same should a schema still have it.
            Schema::Duration => duration(self.take(12)?),
        })
    }
}

/// An Avro `duration`: three little-endian unsigned 32-bit integers (months, days, milliseconds), as ISO 8601.
fn duration(b: &[u8]) -> Value {
    let part = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (months, days, millis) = (part(0), part(4), part(8));
    Value::String(format!("P{months}M{days}DT{}.{:03}S", millis / 1000, millis % 1000))
}

/// 16 bytes as a UUID's text (RFC 9562: lowercase hex, hyphens 8-4-4-4-12).
fn uuid(b: &[u8]) -> String {
    let h = hex(b);
    let h = &h[2..];
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// A float's value: its shortest exact decimal (`text`, Rust's), or the name of a value JSON cannot hold.
pub(super) fn float(v: f64, text: &str) -> Value {
    if v.is_nan() {
        Value::String("NaN".to_owned())
    } else if v.is_infinite() {
        Value::String(if v > 0.0 { "Infinity" } else { "-Infinity" }.to_owned())
    } else {
        text.parse::<Number>().map(Value::Number).unwrap_or(Value::Null)
    }
}

/// `\x` and lowercase hex: PostgreSQL's `bytea` text form.
pub(super) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * bytes.len());
    s.push_str("\\x");
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A `decimal`: the two's-complement big-endian unscaled value `raw`, with `scale` digits after the point, of at
/// most `precision` digits (the Avro specification's rule: a value beyond its precision is not of its type).
fn decimal(raw: &[u8], precision: usize, scale: usize) -> Result<Value, String> {
    // A `precision`-digit value needs at most precision * log2(10) / 8 + 1 bytes; more is refused unconverted.
    if raw.len() > precision.saturating_mul(3322) / 8000 + 2 {
        return Err(format!("a decimal of {} bytes is longer than its precision of {precision} digits allows", raw.len()));
    }
    let unscaled = num_bigint::BigInt::from_signed_bytes_be(raw).to_string();
    let digits = unscaled.trim_start_matches('-').len();
    if digits > precision && unscaled != "0" {
        return Err(format!("decimal {unscaled} (unscaled) has {digits} digits, more than its precision of {precision}"));
    }
    let (sign, digits) = match unscaled.strip_prefix('-') {
        Some(d) => ("-", d),
        None => ("", unscaled.as_str()),
    };
    let text = if scale == 0 {
        format!("{sign}{digits}")
    } else if digits.len() > scale {
        format!("{sign}{}.{}", &digits[..digits.len() - scale], &digits[digits.len() - scale..])
    } else {
        format!("{sign}0.{}{digits}", "0".repeat(scale - digits.len()))
    };
    text.parse::<Number>().map(Value::Number).map_err(|e| format!("decimal {text}: {e}"))
}

/// `HH:MM:SS` and `digits` digits of the second's fraction, from microseconds after midnight.
fn time_of_day(micros: i64, digits: usize) -> Result<String, String> {
    if !(0..86_400_000_000).contains(&micros) {
        return Err(format!("time of day {micros} µs is not within a day"));
    }
    let (s, frac) = (micros / 1_000_000, micros % 1_000_000);
    let frac = if digits == 3 { format!("{:03}", frac / 1000) } else { format!("{frac:06}") };
    Ok(format!("{:02}:{:02}:{:02}.{frac}", s / 3600, s / 60 % 60, s % 60))
}

/// An instant `nanos` after the Unix epoch: RFC 3339 in UTC, or (`local`) the date and time it is in UTC, without
/// an offset (Avro's `local-timestamp-*`: a wall-clock time in no zone).
fn instant(nanos: i128, local: bool) -> Result<Value, String> {
    let t = jiff::Timestamp::from_nanosecond(nanos).map_err(|_| format!("timestamp {nanos} ns is out of range"))?;
    Ok(Value::String(if local { t.to_zoned(jiff::tz::TimeZone::UTC).datetime().to_string() } else { t.to_string() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zz(n: i64) -> Vec<u8> {
        let mut u = ((n << 1) ^ (n >> 63)) as u64;
        let mut out = Vec::new();
        loop {
            let b = (u & 0x7f) as u8;
            u >>= 7;
            if u == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }

    const PAYMENT: &str = r#"{"type":"record","name":"Payment","namespace":"shop","fields":[
        {"name":"id","type":"string"},
        {"name":"amount","type":{"type":"bytes","logicalType":"decimal","precision":20,"scale":2}},
        {"name":"seq","type":"long"},
        {"name":"note","type":["null","string"]},
        {"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}},
        {"name":"day","type":{"type":"int","logicalType":"date"}},
        {"name":"kind","type":{"type":"enum","name":"Kind","symbols":["CARD","BANK"]}},
        {"name":"tags","type":{"type":"array","items":"string"}},
        {"name":"raw","type":"bytes"},
        {"name":"next","type":["null","Kind"]}
    ]}"#;

    #[test]
    fn a_datum_reads_as_exact_json() {
        let s = AvroSchema::parse(PAYMENT, &[]).unwrap();
        let mut b = Vec::new();
        b.extend(zz(5));
        b.extend(b"ORD-1");
        // -12345 as two's complement big-endian: 0xCF 0xC7; scale 2: -123.45
        b.extend(zz(2));
        b.extend([0xCF, 0xC7]);
        b.extend(zz(9_007_199_254_740_993));
        b.extend(zz(1));
        b.extend(zz(2));
        b.extend(b"hi");
        b.extend(zz(1_764_410_400_123));
        b.extend(zz(20_000));
        b.extend(zz(1));
        b.extend(zz(2));
        b.extend(zz(1));
        b.extend(b"a");
        b.extend(zz(1));
        b.extend(b"b");
        b.extend(zz(0));
        b.extend(zz(2));
        b.extend([0xde, 0xad]);
        b.extend(zz(1));
        b.extend(zz(0));
        let v = s.decode(&b).unwrap();
        assert_eq!(
            v.to_string(),
            r#"{"id":"ORD-1","amount":-123.45,"seq":9007199254740993,"note":"hi","at":"2025-11-29T10:00:00.123Z","day":"2024-10-04","kind":"BANK","tags":["a","b"],"raw":"\\xdead","next":"CARD"}"#
        );
    }

    #[test]
    fn bad_datums_are_errors_never_aborts() {
        let s = AvroSchema::parse(r#"{"type":"array","items":"null"}"#, &[]).unwrap();
        // A block that claims a billion nulls in a few bytes.
        let mut b = zz(1_000_000_000);
        b.extend(zz(0));
        assert!(s.decode(&b).unwrap_err().contains("more values"));
        let s = AvroSchema::parse(r#"{"type":"array","items":"long"}"#, &[]).unwrap();
        assert!(s.decode(&zz(i64::MAX)).unwrap_err().contains("ends early"));
        // Recursion as deep as the bytes go.
        let list = r#"{"type":"record","name":"L","fields":[{"name":"next","type":["null","L"]}]}"#;
        let s = AvroSchema::parse(list, &[]).unwrap();
        let mut b = vec![2u8; 100_000];
        b.push(0);
        assert!(s.decode(&b).unwrap_err().contains("deeper"));
        assert!(s.decode(&[2, 0, 7]).unwrap_err().contains("left over"));
        let s = AvroSchema::parse(r#""string""#, &[]).unwrap();
        assert!(s.decode(&[4, 0xff, 0xfe]).unwrap_err().contains("UTF-8"));
        assert!(s.decode(&zz(-3)).unwrap_err().contains("negative"));
    }

    #[test]
    fn logical_values() {
        assert_eq!(decimal(&[0x00, 0x01], 5, 3).unwrap().to_string(), "0.001");
        assert!(decimal(&[0x01; 40], 38, 2).unwrap_err().contains("longer"));
        assert!(decimal(&[0x27, 0x10], 4, 0).unwrap_err().contains("more than its precision"));
        assert_eq!(decimal(&[0xff], 1, 0).unwrap().to_string(), "-1");
        assert_eq!(time_of_day(3_723_004_005, 6).unwrap(), "01:02:03.004005");
        assert_eq!(instant(-1_000_000, true).unwrap(), Value::String("1969-12-31T23:59:59.999".into()));
        assert_eq!(float(f64::from(0.1f32), &0.1f32.to_string()).to_string(), "0.1");
        assert_eq!(float(f64::NAN, "NaN"), Value::String("NaN".into()));
        let s = AvroSchema::parse(r#"{"type":"fixed","name":"D","size":12,"logicalType":"duration"}"#, &[]).unwrap();
        let mut b = 1u32.to_le_bytes().to_vec();
        b.extend(2u32.to_le_bytes());
        b.extend(3004u32.to_le_bytes());
        assert_eq!(s.decode(&b).unwrap(), Value::String("P1M2DT3.004S".into()));
    }

    #[test]
    fn uuid_and_duration_on_named_fixed_types() {
        let schema = r#"{"type": "record", "name": "R", "fields": [
            {"name": "id", "type": {"type": "fixed", "name": "U", "size": 16, "logicalType": "uuid"}},
            {"name": "d", "type": {"type": "fixed", "name": "D", "size": 12, "logicalType": "duration"}},
            {"name": "again", "type": "D"},
            {"name": "odd", "type": {"type": "fixed", "name": "O", "size": 2, "logicalType": "duration"}},
            {"name": "day", "type": {"type": "int", "logicalType": "date"}}]}"#;
        let s = AvroSchema::parse(schema, &[]).unwrap();
        let mut b: Vec<u8> = (0u8..16).collect();
        for _ in 0..2 {
            b.extend(1u32.to_le_bytes());
            b.extend(2u32.to_le_bytes());
            b.extend(3004u32.to_le_bytes());
        }
        b.extend([0xab, 0xcd]);
        b.extend(zz(-1));
        assert_eq!(
            s.decode(&b).unwrap().to_string(),
            r#"{"id":"00010203-0405-0607-0809-0a0b0c0d0e0f","d":"P1M2DT3.004S","again":"P1M2DT3.004S","odd":"\\xabcd","day":"1969-12-31"}"#
        );
        // A date far out of range is a decode error, never a panic.
        let mut far = b[..b.len() - 1].to_vec();
        far.extend(zz(8_000_000));
        assert!(s.decode(&far).unwrap_err().contains("out of range"));
    }

    #[test]
    fn named_types_from_references() {
        let kind = r#"{"type":"enum","name":"Kind","namespace":"shop","symbols":["CARD","BANK"]}"#;
        let top = r#"{"type":"record","name":"P","namespace":"shop","fields":[{"name":"k","type":"shop.Kind"}]}"#;
        let s = AvroSchema::parse(top, &[kind.to_owned()]).unwrap();
        assert_eq!(s.decode(&[2]).unwrap().to_string(), r#"{"k":"BANK"}"#);
        assert!(AvroSchema::parse(top, &[]).is_err());
    }
}
