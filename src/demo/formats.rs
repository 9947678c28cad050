//! The demo's payments in Avro or Protobuf (`idemflow demo --format`): each JSON payment encoded with the Apache
//! Avro crate or prost, as a producer would, by the schemas shipped in `examples/formats/`; the pipeline reads them
//! as plain datums or messages of its `schema_file` (the demo runs no schema registry). Poison records stay the
//! bytes they are, and go to the dead letters as `decode_failed` as they do in JSON.

use anyhow::Context as _;
use serde_json::Value;

/// The Avro schema of the demo's payments.
pub(crate) const PAYMENT_AVSC: &str = include_str!("../../examples/formats/payment.avsc");
/// The `.proto` of the demo's payments.
pub(crate) const PAYMENT_PROTO: &str = include_str!("../../examples/formats/payment.proto");

/// How the demo encodes its payments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoFormat {
    /// JSON, as the shipped pipelines read it.
    #[default]
    Json,
    /// Avro datums of `examples/formats/payment.avsc`.
    Avro,
    /// Protobuf messages of `examples/formats/payment.proto`.
    Protobuf,
}

/// Encodes JSON records in a [`DemoFormat`], by a schema: the demo's payments, the bench's orders.
pub(crate) enum Encoder {
    Json,
    Avro(apache_avro::Schema),
    Protobuf(prost_reflect::MessageDescriptor),
}

impl Encoder {
    /// The encoder of `format` for the demo's payments (`examples/formats/`).
    ///
    /// Errors: a shipped schema that does not parse (a defect).
    pub(crate) fn new(format: DemoFormat) -> anyhow::Result<Encoder> {
        Encoder::of(format, PAYMENT_AVSC, PAYMENT_PROTO, "Payment")
    }

    /// The encoder of `format` with the Avro schema `avsc`, or the `.proto` `proto` and its `message`.
    ///
    /// Errors: a schema that does not parse.
    pub(crate) fn of(format: DemoFormat, avsc: &str, proto: &str, message: &str) -> anyhow::Result<Encoder> {
        Ok(match format {
            DemoFormat::Json => Encoder::Json,
            DemoFormat::Avro => Encoder::Avro(apache_avro::Schema::parse_str(avsc).context("the Avro schema")?),
            DemoFormat::Protobuf => {
                let file = crate::decode::protobuf::ProtoFile::compile("payment.proto", proto, &[]).map_err(anyhow::Error::msg)?;
                Encoder::Protobuf(file.message(message).map_err(anyhow::Error::msg)?)
            }
        })
    }

    /// The pipeline text `text` reading this format: `format` and `schema_file` (and Protobuf's `message`) first,
    /// and the schema file to write beside it, as (name, text).
    pub(crate) fn pipeline(&self, text: &str) -> (String, Option<(&'static str, &'static str)>) {
        match self {
            Encoder::Json => (text.to_owned(), None),
            Encoder::Avro(_) => (format!("format = \"avro\"\nschema_file = \"payment.avsc\"\n{text}"), Some(("payment.avsc", PAYMENT_AVSC))),
            Encoder::Protobuf(_) => (
                format!("format = \"protobuf\"\nschema_file = \"payment.proto\"\nmessage = \"idemflow.examples.Payment\"\n{text}"),
                Some(("payment.proto", PAYMENT_PROTO)),
            ),
        }
    }

    /// `body`, a JSON record, in this format (fields by name; a decimal from its text, a timestamp from RFC 3339, a
    /// union with `null` from the value or its absence); a body that is not JSON (a poison record) as it is.
    pub(crate) fn encode(&self, body: &[u8]) -> Vec<u8> {
        let Ok(v) = serde_json::from_slice::<Value>(body) else { return body.to_vec() };
        match self {
            Encoder::Json => body.to_vec(),
            Encoder::Avro(schema) => avro_value(&v, schema)
                .and_then(|value| apache_avro::to_avro_datum(schema, value).ok())
                .unwrap_or_else(|| body.to_vec()),
            Encoder::Protobuf(message) => {
                use prost_reflect::prost::Message as _;
                proto_message(&v, message).encode_to_vec()
            }
        }
    }
}

/// `v` as an Avro value of `schema` (the types the demo's and the bench's schemas use).
fn avro_value(v: &Value, schema: &apache_avro::Schema) -> Option<apache_avro::types::Value> {
    use apache_avro::schema::Schema as S;
    use apache_avro::types::Value as A;
    Some(match schema {
        S::Record(r) => A::Record(r.fields.iter().map(|f| Some((f.name.clone(), avro_value(&v[&f.name], &f.schema)?))).collect::<Option<_>>()?),
        S::String => A::String(v.as_str()?.to_owned()),
        S::Long => A::Long(v.as_i64()?),
        S::Decimal(d) => {
            let text = v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string());
            let (units, fraction) = text.split_once('.').unwrap_or((&text, ""));
            let unscaled: i64 = format!("{units}{fraction:0<width$}", width = d.scale).parse().ok()?;
            A::Decimal(apache_avro::Decimal::from(twos_complement(unscaled)))
        }
        S::TimestampMillis => A::TimestampMillis(v.as_str()?.parse::<jiff::Timestamp>().ok()?.as_millisecond()),
        S::Union(u) => match (v.is_null(), u.variants().iter().position(|b| *b != S::Null)) {
            (true, _) | (_, None) => A::Union(0, Box::new(A::Null)),
            (false, Some(i)) => A::Union(i as u32, Box::new(avro_value(v, &u.variants()[i])?)),
        },
        _ => return None,
    })
}

/// `v` as a `message` (string and message fields, `google.protobuf.Timestamp` from RFC 3339).
fn proto_message(v: &Value, message: &prost_reflect::MessageDescriptor) -> prost_reflect::DynamicMessage {
    use prost_reflect::{DynamicMessage, Kind, Value as P};
    let mut m = DynamicMessage::new(message.clone());
    for f in message.fields() {
        let field = &v[f.name()];
        let value = match (f.kind(), field) {
            (_, Value::Null) => continue,
            (Kind::Message(t), Value::String(text)) if t.full_name() == "google.protobuf.Timestamp" => {
                let Ok(at) = text.parse::<jiff::Timestamp>() else { continue };
                let mut ts = DynamicMessage::new(t);
                ts.set_field_by_name("seconds", P::I64(at.as_second()));
                ts.set_field_by_name("nanos", P::I32(at.subsec_nanosecond()));
                P::Message(ts)
            }
            (Kind::Message(t), _) => P::Message(proto_message(field, &t)),
            (Kind::String, _) => P::String(field.as_str().map(str::to_owned).unwrap_or_else(|| field.to_string())),
            _ => continue,
        };
        m.set_field_by_name(f.name(), value);
    }
    m
}

/// `n` as the shortest big-endian two's complement bytes (Avro's `decimal` on `bytes`).
fn twos_complement(n: i64) -> Vec<u8> {
    let bytes = n.to_be_bytes();
    let mut start = 0;
    while start < 7 && ((bytes[start] == 0 && bytes[start + 1] & 0x80 == 0) || (bytes[start] == 0xff && bytes[start + 1] & 0x80 != 0)) {
        start += 1;
    }
    bytes[start..].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Decoder, FileSchema, Format};

    const PAYMENT: &str = r#"{"order":{"id":"ORDERID_7","account":"ACC-3","amount":"123.45","currency":"USD"},"paid_at":"2026-11-29T10:00:00+01:00"}"#;

    #[test]
    fn the_encoded_payments_decode_to_the_same_values() {
        let avro = Encoder::new(DemoFormat::Avro).unwrap();
        let schema = crate::decode::avro::AvroSchema::parse(PAYMENT_AVSC, &[]).unwrap();
        let d = Decoder::new(Format::Avro, 1 << 20).with_schema_file(FileSchema::Avro(schema), "payment.avsc");
        let v = d.decode(&avro.encode(PAYMENT.as_bytes())).unwrap();
        assert_eq!(v.to_string(), r#"{"order":{"id":"ORDERID_7","account":"ACC-3","amount":123.45,"currency":"USD"},"paid_at":"2026-11-29T09:00:00Z"}"#);
        let proto = Encoder::new(DemoFormat::Protobuf).unwrap();
        let Encoder::Protobuf(m) = &proto else { unreachable!() };
        let d = Decoder::new(Format::Protobuf, 1 << 20).with_schema_file(FileSchema::Protobuf(m.clone()), "payment.proto");
        let v = d.decode(&proto.encode(PAYMENT.as_bytes())).unwrap();
        assert_eq!(v.to_string(), r#"{"order":{"id":"ORDERID_7","account":"ACC-3","amount":"123.45","currency":"USD"},"paid_at":"2026-11-29T09:00:00Z"}"#);
        assert_eq!(avro.encode(b"{\"order\": {\"id"), b"{\"order\": {\"id".to_vec(), "poison stays poison");
        assert_eq!(twos_complement(-12345), vec![0xcf, 0xc7]);
        assert_eq!(twos_complement(128), vec![0x00, 0x80]);
    }
}
