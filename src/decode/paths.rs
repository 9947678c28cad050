//! Whether a schema has a field path, and what kind of value it holds there (`idemflow check`): the key's and the
//! values' paths looked up in the Avro schema or the Protobuf message the payloads are written with, by the same
//! steps decoding takes ([`crate::field::FieldPath::tokens`]: member names, and array indexes as decimal text).

use super::avro::AvroSchema;
use apache_avro::schema::{Namespace, Schema};
use prost_reflect::{Kind, MessageDescriptor};

/// What kind of value a schema gives at a path, as its decoded JSON value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    /// A record, map or message: an object.
    Object,
    /// An array (`repeated`).
    Array,
    /// An integer, float or decimal.
    Number,
    /// A string, enum, uuid or duration: text.
    Text,
    /// `bytes` or `fixed`: `\x` and hex.
    Bytes,
    /// A boolean.
    Boolean,
    /// A date, time or timestamp: its text.
    Instant,
    /// `null`.
    Null,
    /// Anything (a protobuf `Struct` or `Value`).
    Any,
}

/// What a schema says of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Every step is in the schema (for a union, in one of its branches); the kinds of value there (several for a
    /// union).
    Found(Vec<Leaf>),
    /// The schema cannot have it: `at` is the path up to and including the first step it lacks.
    Missing {
        /// The path as far as the schema lacks it (`/order/idd`).
        at: String,
    },
}

fn missing(tokens: &[String], upto: usize) -> Lookup {
    Lookup::Missing { at: tokens[..=upto].iter().map(|t| format!("/{t}")).collect() }
}

/// Looks `tokens` up in an Avro schema.
pub fn avro(schema: &AvroSchema, tokens: &[String]) -> Lookup {
    avro_at(schema, schema.root(), &None, tokens, 0, 0)
}

fn avro_at(s: &AvroSchema, schema: &Schema, ns: &Namespace, tokens: &[String], i: usize, depth: usize) -> Lookup {
    if depth > super::avro::MAX_DEPTH {
        return missing(tokens, i.min(tokens.len().saturating_sub(1)));
    }
    if let Schema::Union(u) = schema {
        // Found in every branch that has it (their kinds together); else where the furthest-reaching branch stops.
        let (mut leaves, mut furthest) = (Vec::new(), None::<String>);
        for branch in u.variants() {
            match avro_at(s, branch, ns, tokens, i, depth + 1) {
                Lookup::Found(l) => leaves.extend(l),
                Lookup::Missing { at } if furthest.as_ref().is_none_or(|f| at.len() > f.len()) => furthest = Some(at),
                Lookup::Missing { .. } => {}
            }
        }
        return match (leaves.is_empty(), furthest) {
            (false, _) => Lookup::Found(leaves),
            (true, Some(at)) => Lookup::Missing { at },
            (true, None) => missing(tokens, i),
        };
    }
    if let Schema::Ref { name } = schema {
        return match s.named(name, ns) {
            Some(target) => avro_at(s, target, &name.fully_qualified_name(ns).namespace, tokens, i, depth + 1),
            None => missing(tokens, i.min(tokens.len().saturating_sub(1))),
        };
    }
    if i == tokens.len() {
        return Lookup::Found(vec![avro_leaf(schema)]);
    }
    match schema {
        Schema::Record(r) => {
            let inner = r.name.fully_qualified_name(ns).namespace;
            match r.fields.iter().find(|f| f.name == tokens[i]) {
                Some(f) => avro_at(s, &f.schema, &inner, tokens, i + 1, depth + 1),
                None => missing(tokens, i),
            }
        }
        Schema::Array(a) if tokens[i].parse::<usize>().is_ok() => avro_at(s, &a.items, ns, tokens, i + 1, depth + 1),
        Schema::Map(m) => avro_at(s, &m.types, ns, tokens, i + 1, depth + 1),
        _ => missing(tokens, i),
    }
}

/// The kind of value a (non-union, non-reference) Avro type decodes to.
fn avro_leaf(schema: &Schema) -> Leaf {
    match schema {
        Schema::Null => Leaf::Null,
        Schema::Boolean => Leaf::Boolean,
        Schema::Int | Schema::Long | Schema::Float | Schema::Double | Schema::Decimal(_) => Leaf::Number,
        Schema::Bytes | Schema::BigDecimal => Leaf::Bytes,
        Schema::Fixed(f) => match f.attributes.get(super::avro::FIXED_LOGICAL).and_then(serde_json::Value::as_str) {
            Some(_) => Leaf::Text,
            None => Leaf::Bytes,
        },
        Schema::String | Schema::Uuid | Schema::Enum(_) | Schema::Duration => Leaf::Text,
        Schema::Date
        | Schema::TimeMillis
        | Schema::TimeMicros
        | Schema::TimestampMillis
        | Schema::TimestampMicros
        | Schema::TimestampNanos
        | Schema::LocalTimestampMillis
        | Schema::LocalTimestampMicros
        | Schema::LocalTimestampNanos => Leaf::Instant,
        Schema::Array(_) => Leaf::Array,
        Schema::Record(_) | Schema::Map(_) => Leaf::Object,
        Schema::Union(_) | Schema::Ref { .. } => Leaf::Any,
    }
}

/// Looks `tokens` up in a Protobuf message (fields by their `.proto` names, a `oneof`'s members as fields; a
/// `Struct` or `Value` holds any path).
pub fn protobuf(message: &MessageDescriptor, tokens: &[String]) -> Lookup {
    let mut kind = Kind::Message(message.clone());
    let mut i = 0;
    while i < tokens.len() {
        let Kind::Message(m) = &kind else { return missing(tokens, i) };
        match m.full_name() {
            "google.protobuf.Struct" | "google.protobuf.Value" | "google.protobuf.ListValue" => return Lookup::Found(vec![Leaf::Any]),
            // The other well-known types decode to a value of their own: nothing below them.
            name if name.starts_with("google.protobuf.") && proto_leaf(&kind) != Leaf::Object => return missing(tokens, i),
            _ => {}
        }
        let Some(f) = m.fields().find(|f| f.name() == tokens[i]) else { return missing(tokens, i) };
        i += 1;
        if f.is_map() {
            if i == tokens.len() {
                return Lookup::Found(vec![Leaf::Object]);
            }
            let Kind::Message(entry) = f.kind() else { return missing(tokens, i - 1) };
            kind = entry.map_entry_value_field().kind();
            i += 1;
        } else if f.is_list() {
            if i == tokens.len() {
                return Lookup::Found(vec![Leaf::Array]);
            }
            if tokens[i].parse::<usize>().is_err() {
                return missing(tokens, i);
            }
            kind = f.kind();
            i += 1;
        } else {
            kind = f.kind();
        }
    }
    Lookup::Found(vec![proto_leaf(&kind)])
}

/// The kind of value a Protobuf field of `kind` decodes to (the well-known types as their values).
fn proto_leaf(kind: &Kind) -> Leaf {
    match kind {
        Kind::Bool => Leaf::Boolean,
        Kind::String | Kind::Enum(_) => Leaf::Text,
        Kind::Bytes => Leaf::Bytes,
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Timestamp" => Leaf::Instant,
            "google.protobuf.Duration" | "google.protobuf.StringValue" => Leaf::Text,
            "google.protobuf.BoolValue" => Leaf::Boolean,
            "google.protobuf.BytesValue" => Leaf::Bytes,
            "google.protobuf.DoubleValue" | "google.protobuf.FloatValue" | "google.protobuf.Int64Value" | "google.protobuf.UInt64Value"
            | "google.protobuf.Int32Value" | "google.protobuf.UInt32Value" => Leaf::Number,
            "google.protobuf.Struct" | "google.protobuf.Value" => Leaf::Any,
            "google.protobuf.ListValue" => Leaf::Array,
            _ => Leaf::Object,
        },
        _ => Leaf::Number,
    }
}

/// Whether a value of `leaf` can be bound to a target of `target` (a cast the store cannot make is refused: an
/// object into a number, a timestamp into a boolean; text always binds, its contents checked per record).
pub fn binds(leaf: Leaf, target: crate::store::spec::TargetKind) -> bool {
    use crate::store::spec::TargetKind as T;
    match target {
        T::Text => true,
        T::Number => !matches!(leaf, Leaf::Object | Leaf::Array | Leaf::Bytes | Leaf::Instant),
        T::Boolean => !matches!(leaf, Leaf::Object | Leaf::Array | Leaf::Bytes | Leaf::Instant),
        T::Instant => !matches!(leaf, Leaf::Object | Leaf::Array | Leaf::Bytes | Leaf::Boolean | Leaf::Number),
        T::Array => !matches!(leaf, Leaf::Object | Leaf::Number | Leaf::Boolean | Leaf::Instant | Leaf::Bytes),
    }
}

/// A kind in words, for messages.
pub fn describe(leaf: Leaf) -> &'static str {
    match leaf {
        Leaf::Object => "a record",
        Leaf::Array => "an array",
        Leaf::Number => "a number",
        Leaf::Text => "text",
        Leaf::Bytes => "bytes",
        Leaf::Boolean => "a boolean",
        Leaf::Instant => "a date or time",
        Leaf::Null => "null",
        Leaf::Any => "any value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::spec::TargetKind;

    fn t(path: &str) -> Vec<String> {
        path.split('/').skip(1).map(str::to_owned).collect()
    }

    #[test]
    fn avro_paths() {
        let s = AvroSchema::parse(
            r#"{"type": "record", "name": "P", "fields": [
                {"name": "order", "type": ["null", {"type": "record", "name": "O", "fields": [{"name": "id", "type": "string"}]}]},
                {"name": "tags", "type": {"type": "array", "items": "string"}},
                {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}]},
                {"name": "ctx", "type": {"type": "map", "values": "O"}}]}"#,
            &[],
        )
        .unwrap();
        assert_eq!(avro(&s, &t("/order/id")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(avro(&s, &t("/order")), Lookup::Found(vec![Leaf::Null, Leaf::Object]));
        assert_eq!(avro(&s, &t("/tags/0")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(avro(&s, &t("/tags")), Lookup::Found(vec![Leaf::Array]));
        assert_eq!(avro(&s, &t("/at")), Lookup::Found(vec![Leaf::Null, Leaf::Instant]));
        assert_eq!(avro(&s, &t("/ctx/any/id")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(avro(&s, &t("/order/idd")), Lookup::Missing { at: "/order/idd".into() });
        assert_eq!(avro(&s, &t("/tags/x")), Lookup::Missing { at: "/tags/x".into() });
        assert_eq!(avro(&s, &t("/nope/id")), Lookup::Missing { at: "/nope".into() });
    }

    #[test]
    fn protobuf_paths() {
        let f = super::super::protobuf::ProtoFile::compile(
            "p.proto",
            "syntax = \"proto3\"; import \"google/protobuf/struct.proto\"; import \"google/protobuf/timestamp.proto\";
             message P { message O { string id = 1; } O order = 1; repeated O lines = 2; map<string, O> ctx = 3;
             oneof o { string card = 4; } google.protobuf.Struct extra = 5; google.protobuf.Timestamp at = 6; }",
            &[],
        )
        .unwrap();
        let m = f.message("P").unwrap();
        assert_eq!(protobuf(&m, &t("/order/id")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(protobuf(&m, &t("/order")), Lookup::Found(vec![Leaf::Object]));
        assert_eq!(protobuf(&m, &t("/lines/3/id")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(protobuf(&m, &t("/lines")), Lookup::Found(vec![Leaf::Array]));
        assert_eq!(protobuf(&m, &t("/ctx/k/id")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(protobuf(&m, &t("/card")), Lookup::Found(vec![Leaf::Text]));
        assert_eq!(protobuf(&m, &t("/at")), Lookup::Found(vec![Leaf::Instant]));
        assert_eq!(protobuf(&m, &t("/extra/anything/deep")), Lookup::Found(vec![Leaf::Any]));
        assert_eq!(protobuf(&m, &t("/order/idd")), Lookup::Missing { at: "/order/idd".into() });
        assert_eq!(protobuf(&m, &t("/card/x")), Lookup::Missing { at: "/card/x".into() });
        assert_eq!(protobuf(&m, &t("/at/seconds")), Lookup::Missing { at: "/at/seconds".into() });
    }

    #[test]
    fn what_binds_where() {
        assert!(!binds(Leaf::Object, TargetKind::of("numeric")));
        assert!(binds(Leaf::Text, TargetKind::of("numeric")));
        assert!(!binds(Leaf::Number, TargetKind::of("timestamp with time zone")));
        assert!(binds(Leaf::Object, TargetKind::of("jsonb")));
        assert!(!binds(Leaf::Bytes, TargetKind::of("bigint")));
        assert!(binds(Leaf::Array, TargetKind::of("text[]")));
        assert!(!binds(Leaf::Instant, TargetKind::of("DECIMAL")));
    }
}
