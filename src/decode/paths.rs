//! Whether a schema has a field path (`idemflow check`): the key's and the values' paths looked up in the Avro
//! schema or the Protobuf message the payloads are written with, by the same steps decoding takes
//! ([`crate::field::FieldPath::tokens`]: member names, and array indexes as decimal text).

use super::avro::AvroSchema;
use apache_avro::schema::{Namespace, Schema};
use prost_reflect::{Kind, MessageDescriptor};

/// What a schema says of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Every step is in the schema (for a union, in one of its branches).
    Found,
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
    if i == tokens.len() {
        return Lookup::Found;
    }
    if depth > super::avro::MAX_DEPTH {
        return missing(tokens, i);
    }
    match schema {
        Schema::Record(r) => {
            let inner = r.name.fully_qualified_name(ns).namespace;
            match r.fields.iter().find(|f| f.name == tokens[i]) {
                Some(f) => avro_at(s, &f.schema, &inner, tokens, i + 1, depth + 1),
                None => missing(tokens, i),
            }
        }
        Schema::Union(u) => {
            let mut found = missing(tokens, i);
            for branch in u.variants() {
                match avro_at(s, branch, ns, tokens, i, depth + 1) {
                    Lookup::Found => return Lookup::Found,
                    // The branch that goes furthest says where the path stops.
                    Lookup::Missing { at } if at.len() > missing_len(&found) => found = Lookup::Missing { at },
                    Lookup::Missing { .. } => {}
                }
            }
            found
        }
        Schema::Array(a) if tokens[i].parse::<usize>().is_ok() => avro_at(s, &a.items, ns, tokens, i + 1, depth + 1),
        Schema::Map(m) => avro_at(s, &m.types, ns, tokens, i + 1, depth + 1),
        Schema::Ref { name } => match s.named(name, ns) {
            Some(target) => avro_at(s, target, &name.fully_qualified_name(ns).namespace, tokens, i, depth + 1),
            None => missing(tokens, i),
        },
        _ => missing(tokens, i),
    }
}

fn missing_len(l: &Lookup) -> usize {
    match l {
        Lookup::Missing { at } => at.len(),
        Lookup::Found => usize::MAX,
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
            "google.protobuf.Struct" | "google.protobuf.Value" | "google.protobuf.ListValue" => return Lookup::Found,
            _ => {}
        }
        let Some(f) = m.fields().find(|f| f.name() == tokens[i]) else { return missing(tokens, i) };
        i += 1;
        if f.is_map() {
            let Kind::Message(entry) = f.kind() else { return missing(tokens, i - 1) };
            if i == tokens.len() {
                return Lookup::Found;
            }
            kind = entry.map_entry_value_field().kind();
            i += 1;
        } else if f.is_list() {
            if i == tokens.len() {
                return Lookup::Found;
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
    Lookup::Found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(path: &str) -> Vec<String> {
        path.split('/').skip(1).map(str::to_owned).collect()
    }

    #[test]
    fn avro_paths() {
        let s = AvroSchema::parse(
            r#"{"type": "record", "name": "P", "fields": [
                {"name": "order", "type": ["null", {"type": "record", "name": "O", "fields": [{"name": "id", "type": "string"}]}]},
                {"name": "tags", "type": {"type": "array", "items": "string"}},
                {"name": "ctx", "type": {"type": "map", "values": "O"}}]}"#,
            &[],
        )
        .unwrap();
        assert_eq!(avro(&s, &t("/order/id")), Lookup::Found);
        assert_eq!(avro(&s, &t("/tags/0")), Lookup::Found);
        assert_eq!(avro(&s, &t("/ctx/any/id")), Lookup::Found);
        assert_eq!(avro(&s, &t("/order/idd")), Lookup::Missing { at: "/order/idd".into() });
        assert_eq!(avro(&s, &t("/tags/x")), Lookup::Missing { at: "/tags/x".into() });
        assert_eq!(avro(&s, &t("/nope/id")), Lookup::Missing { at: "/nope".into() });
    }

    #[test]
    fn protobuf_paths() {
        let f = super::super::protobuf::ProtoFile::compile(
            "p.proto",
            "syntax = \"proto3\"; import \"google/protobuf/struct.proto\";
             message P { message O { string id = 1; } O order = 1; repeated O lines = 2; map<string, O> ctx = 3;
             oneof o { string card = 4; } google.protobuf.Struct extra = 5; }",
            &[],
        )
        .unwrap();
        let m = f.message("P").unwrap();
        assert_eq!(protobuf(&m, &t("/order/id")), Lookup::Found);
        assert_eq!(protobuf(&m, &t("/lines/3/id")), Lookup::Found);
        assert_eq!(protobuf(&m, &t("/ctx/k/id")), Lookup::Found);
        assert_eq!(protobuf(&m, &t("/card")), Lookup::Found);
        assert_eq!(protobuf(&m, &t("/extra/anything/deep")), Lookup::Found);
        assert_eq!(protobuf(&m, &t("/order/idd")), Lookup::Missing { at: "/order/idd".into() });
        assert_eq!(protobuf(&m, &t("/card/x")), Lookup::Missing { at: "/card/x".into() });
    }
}
