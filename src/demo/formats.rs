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

/// Encodes JSON payments in a [`DemoFormat`].
pub(crate) enum Encoder {
    Json,
    Avro(apache_avro::Schema),
    Protobuf(prost_reflect::MessageDescriptor),
}

impl Encoder {
    /// The encoder of `format`, its schema parsed.
    ///
    /// Errors: a shipped schema that does not parse (a defect).
    pub(crate) fn new(format: DemoFormat) -> anyhow::Result<Encoder> {
        Ok(match format {
            DemoFormat::Json => Encoder::Json,
            DemoFormat::Avro => Encoder::Avro(apache_avro::Schema::parse_str(PAYMENT_AVSC).context("payment.avsc")?),
            DemoFormat::Protobuf => {
                let file = crate::decode::protobuf::ProtoFile::compile("payment.proto", PAYMENT_PROTO, &[]).map_err(anyhow::Error::msg)?;
                Encoder::Protobuf(file.message("Payment").map_err(anyhow::Error::msg)?)
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

    /// `body`, a JSON payment, in this format; a body that is not a payment (a poison record) as it is.
    pub(crate) fn encode(&self, body: &[u8]) -> Vec<u8> {
        let Ok(v) = serde_json::from_slice::<Value>(body) else { return body.to_vec() };
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let (order, paid_ms) = (&v["order"], v["paid_at"].as_str().and_then(|t| t.parse::<jiff::Timestamp>().ok()).map(|t| t.as_millisecond()));
        match self {
            Encoder::Json => body.to_vec(),
            Encoder::Avro(schema) => {
                use apache_avro::types::Value as A;
                let cents = cents(order["amount"].as_str().unwrap_or("0"));
                let value = A::Record(vec![
                    (
                        "order".into(),
                        A::Record(vec![
                            ("id".into(), A::String(text(&order["id"]))),
                            ("account".into(), A::String(text(&order["account"]))),
                            ("amount".into(), A::Decimal(apache_avro::Decimal::from(twos_complement(cents)))),
                            ("currency".into(), A::String(text(&order["currency"]))),
                        ]),
                    ),
                    ("paid_at".into(), paid_ms.map_or(A::Union(0, Box::new(A::Null)), |ms| A::Union(1, Box::new(A::TimestampMillis(ms))))),
                ]);
                apache_avro::to_avro_datum(schema, value).unwrap_or_else(|_| body.to_vec())
            }
            Encoder::Protobuf(message) => {
                use prost_reflect::prost::Message as _;
                use prost_reflect::{DynamicMessage, Kind, Value as P};
                let mut m = DynamicMessage::new(message.clone());
                let Some(Kind::Message(order_desc)) = message.get_field_by_name("order").map(|f| f.kind()) else { return body.to_vec() };
                let mut o = DynamicMessage::new(order_desc);
                for field in ["id", "account", "amount", "currency"] {
                    o.set_field_by_name(field, P::String(text(&order[field])));
                }
                m.set_field_by_name("order", P::Message(o));
                if let (Some(ms), Some(Kind::Message(ts_desc))) = (paid_ms, message.get_field_by_name("paid_at").map(|f| f.kind())) {
                    let mut ts = DynamicMessage::new(ts_desc);
                    ts.set_field_by_name("seconds", P::I64(ms.div_euclid(1000)));
                    ts.set_field_by_name("nanos", P::I32((ms.rem_euclid(1000) * 1_000_000) as i32));
                    m.set_field_by_name("paid_at", P::Message(ts));
                }
                m.encode_to_vec()
            }
        }
    }
}

/// `"123.45"` in cents.
fn cents(amount: &str) -> i64 {
    let (units, fraction) = amount.split_once('.').unwrap_or((amount, "0"));
    let fraction = format!("{fraction:0<2}");
    units.parse::<i64>().unwrap_or(0) * 100 + fraction[..2].parse::<i64>().unwrap_or(0)
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
        assert_eq!(cents("5.5"), 550);
    }
}
