//! Avro and JSON Schema payloads through the schema registry (docs/formats.md), encoded by confluent-kafka's own
//! serializers against the suite's registry (tests/schema-registry/), read from the Kafka mock cluster into
//! PostgreSQL by the worker.

use crate::support::registry::Registry;
use crate::support::*;
use std::time::Duration;

const TABLE: &str = "CREATE TABLE payments (
    order_id text PRIMARY KEY, account text NOT NULL, amount numeric NOT NULL, paid_at timestamptz, method text,
    tags jsonb, fingerprint bytea, channel text, seq bigint);";

/// Every kind of value a payment carries: a nested record, an exact decimal, a timestamp in a union with null, an
/// enum, an array, bytes, a map, a 64-bit integer beyond a double's exact range.
const PAYMENT_AVSC: &str = r#"{"type": "record", "name": "Payment", "namespace": "shop.events", "fields": [
  {"name": "order", "type": {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "string"},
    {"name": "account", "type": "string"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 18}}]}},
  {"name": "paid_at", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}], "default": null},
  {"name": "method", "type": {"type": "enum", "name": "Method", "symbols": ["CARD", "BANK", "WALLET"]}},
  {"name": "tags", "type": {"type": "array", "items": "string"}},
  {"name": "fingerprint", "type": "bytes"},
  {"name": "context", "type": {"type": "map", "values": "string"}},
  {"name": "seq", "type": "long"}
]}"#;

fn payment(id: &str, amount: &str) -> String {
    format!(
        "{{\"order\": {{\"id\": \"{id}\", \"account\": \"ACC-1\", \"amount\": {amount}}}, \"paid_at\": 1764410400123, \"method\": \"BANK\", \
         \"tags\": [\"a\", \"b\"], \"fingerprint\": {{\"$bytes\": \"dead\"}}, \"context\": {{\"channel\": \"web\"}}, \"seq\": 9007199254740993}}"
    )
}

fn pipeline(topic: &str, top: &str) -> String {
    format!(
        r#"topics = ["{topic}"]
{top}
[key]
field = "/order/id"
[sink]
table = "payments"
[sink.columns]
order_id = "/order/id"
account = "/order/account"
amount = "/order/amount"
paid_at = {{ field = "/paid_at", optional = true }}
method = "/method"
tags = "/tags"
fingerprint = "/fingerprint"
channel = "/context/channel"
seq = "/seq"
"#
    )
}

fn registry_section(registry: &Registry, auth: &str) -> String {
    format!("[schema_registry]\nurl = \"{}\"\ntimeout = \"2s\"\nmissing_schema_wait = \"1s\"\n{auth}\n", registry.url())
}

/// What most tests here start from: a registry (started with `args`), the payments table, the mock cluster with
/// topic `payments`, and the payments' Avro schema in a file.
struct Fixture {
    registry: Registry,
    db: TestDb,
    kafka: Kafka,
    avsc: std::path::PathBuf,
    _tmp: tempfile::TempDir,
}

async fn fixture(args: &[&str]) -> Fixture {
    let registry = Registry::start(args);
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let tmp = tempfile::tempdir().unwrap();
    let avsc = schema_file(tmp.path(), PAYMENT_AVSC);
    Fixture { registry, db, kafka, avsc, _tmp: tmp }
}

fn schema_file(dir: &std::path::Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("payment.avsc");
    std::fs::write(&path, text).unwrap();
    path
}

/// The serializer's bytes go through the worker as any producer's would: each payment applied once, its values
/// exact; the same bytes again and another amount under the same id are duplicates by reason; a payload that is
/// not in the wire format and one naming a schema id the registry does not know are dead letters
/// (`decode_failed`, the schema id named), and the stream moves on. The registry requires basic authentication, and
/// each schema id is fetched once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_payments_from_the_registry_are_applied_once_with_exact_values() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&["--user", "reader:s3cret"]).await;
    let docs = [payment("ORD-1", "100.000000000000000001"), payment("ORD-2", "-0.5"), payment("ORD-2", "7.0")];
    let values = registry.serialize("avro", "payments", &avsc, &docs);
    let mut unknown = vec![0, 0, 0, 3, 231];
    unknown.extend(&values[0][5..]);
    let records = [
        Out { value: Some(values[0].clone()), ..Out::default() },
        Out { value: Some(values[1].clone()), ..Out::default() },
        Out { value: Some(values[0].clone()), ..Out::default() },
        Out { value: Some(values[2].clone()), ..Out::default() },
        Out::json(0, r#"{"order":{"id":"ORD-9"}}"#),
        Out { value: Some(unknown), ..Out::default() },
    ];
    kafka.produce("payments", &records);
    let auth = "username = \"reader\"\npassword = \"s3cret\"";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &registry_section(&registry, auth));
    let w = InProc::start(&setup).await;
    w.wait_received("payments", records.len() as u64).await;
    let p = [("pipeline", "payments")];
    assert_eq!(w.metric("idemflow_records_applied_total", &p), 2.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "republished")]), 1.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "payload_mismatch")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 2.0);
    // Schema id 999 was waited on (missing_schema_wait = 1s) before its record was dead-lettered.
    assert!(w.metric("idemflow_schema_registry_retries_total", &p) >= 1.0);
    assert!(w.stop().await.is_empty());

    let row: String = db
        .scalar(
            "SELECT concat_ws('|', account, amount::text, paid_at = '2025-11-29T10:00:00.123Z', method, tags->>1, \
             encode(fingerprint, 'hex'), channel, seq) FROM payments WHERE order_id = 'ORD-1'",
        )
        .await;
    assert_eq!(row, "ACC-1|100.000000000000000001|t|BANK|b|dead|web|9007199254740993");
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = 'ORD-2'").await, "-0.500000000000000000");
    let errors: String = db.scalar("SELECT string_agg(reason || ': ' || error, E'\\n' ORDER BY \"offset\") FROM idemflow.dead_letters").await;
    assert!(errors.contains("decode_failed: not in the schema registry wire format: the first byte is 0x7b"), "{errors}");
    assert!(errors.contains("decode_failed: schema id 999 is not known to the schema registry"), "{errors}");
    assert_eq!(kafka.committed("idemflow-payments", "payments", 1), vec![6]);
    assert_eq!(registry.requests("/schemas/ids/1"), 1, "a schema id is fetched once");
}

/// While the registry answers 503 (or cannot be reached), the pipeline pauses and retries: nothing is applied,
/// nothing is dead-lettered, the retries are counted; once it answers, every record is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_outage_pauses_the_pipeline_and_dead_letters_nothing() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    let values = registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5"), payment("ORD-2", "2.5")]);
    kafka.produce("payments", &values.iter().map(|v| Out { value: Some(v.clone()), ..Out::default() }).collect::<Vec<_>>());
    registry.fail(503, -1);
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &registry_section(&registry, ""));
    let w = InProc::start(&setup).await;
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(30), "the fetch to be retried", || async {
        w.metric("idemflow_schema_registry_retries_total", &p) >= 3.0
    })
    .await;
    assert_eq!(w.metric("idemflow_records_applied_total", &p), 0.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 0.0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 0);
    registry.fail(0, 0);
    wait_until(Duration::from_secs(60), "the records to be applied", || async { w.metric("idemflow_records_applied_total", &p) >= 2.0 }).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0);
    assert_eq!(kafka.committed("idemflow-payments", "payments", 1), vec![2]);
}

/// JSON Schema payloads (confluent-kafka's `JSONSerializer`): the header names the schema, the document is read as
/// JSON is; and plain Avro datums (no header) read with the pipeline's `schema_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_payloads_and_plain_avro_with_a_schema_file() {
    let registry = Registry::start(&[]);
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("json-payments", 1);
    kafka.create_topic("avro-payments", 1);
    let tmp = tempfile::tempdir().unwrap();
    let schema = tmp.path().join("payment.json");
    std::fs::write(&schema, r#"{"$schema": "http://json-schema.org/draft-07/schema#", "title": "Payment", "type": "object",
        "properties": {"order": {"type": "object", "properties": {"id": {"type": "string"}, "account": {"type": "string"},
        "amount": {"type": "string"}}, "required": ["id", "account", "amount"]}}}"#).unwrap();
    let json = registry.serialize("json_schema", "json-payments", &schema, &[r#"{"order": {"id": "J-1", "account": "ACC-2", "amount": "12.34"}}"#.to_owned()]);
    kafka.produce("json-payments", &[Out { value: Some(json[0].clone()), ..Out::default() }]);
    let avsc = schema_file(tmp.path(), PAYMENT_AVSC);
    let avro = registry.serialize("avro", "avro-payments", &avsc, &[payment("A-1", "3.25")]);
    // A producer of plain datums: the same bytes without the wire format's header.
    kafka.produce("avro-payments", &[Out { value: Some(avro[0][5..].to_vec()), ..Out::default() }]);

    let json_pipeline = r#"topics = ["json-payments"]
format = "json_schema"
[key]
field = "/order/id"
[sink]
table = "payments"
[sink.columns]
order_id = "/order/id"
account = "/order/account"
amount = "/order/amount"
"#;
    let setup = Setup::with(
        &db,
        &kafka,
        &[("json.toml", json_pipeline), ("avro.toml", &pipeline("avro-payments", "format = \"avro\"\nschema_file = \"payment.avsc\""))],
        "",
        &registry_section(&registry, ""),
    );
    std::fs::write(setup.dir.path().join("pipelines/payment.avsc"), PAYMENT_AVSC).unwrap();
    let w = InProc::start(&setup).await;
    w.wait_received("json", 1).await;
    w.wait_received("avro", 1).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id || '=' || amount::text, ',' ORDER BY order_id) FROM payments").await, "A-1=3.250000000000000000,J-1=12.34");
}

/// `check` and `run` refuse a wire-format pipeline without `[schema_registry]`, and a `schema_file` that is not an
/// Avro schema, naming the file, the pipeline and the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_without_its_schemas_is_refused_by_name() {
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    let setup = Setup::with(
        &db,
        &kafka,
        &[
            ("a.toml", &pipeline("a", "format = \"avro\"")),
            ("b.toml", &pipeline("b", "format = \"avro\"\nschema_file = \"bad.avsc\"")),
        ],
        "",
        "",
    );
    std::fs::write(setup.dir.path().join("pipelines/bad.avsc"), r#"{"type": "record", "name": "X"}"#).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    let text = format!("{out}{err}");
    assert!(text.contains("a.toml") && text.contains("pipeline \"a\"") && text.contains("format") && text.contains("no [schema_registry]"), "{text}");
    assert!(text.contains("b.toml") && text.contains("schema_file") && text.contains("bad.avsc is not an Avro schema"), "{text}");
}

const PAYMENT_PROTO: &str = r#"syntax = "proto3";
package shop.events;
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";

message Payment {
  message Order { string id = 1; string account = 2; string amount = 3; }
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
}
"#;

fn proto_payment(id: &str, amount: &str) -> String {
    format!(
        r#"{{"order": {{"id": "{id}", "account": "ACC-1", "amount": "{amount}"}}, "paidAt": "2025-11-29T10:00:00.123Z", "method": "BANK", "tags": ["a", "b"], "fingerprint": "3q0=", "context": {{"channel": "web"}}, "seq": "9007199254740993", "iban": "DE89", "note": "n"}}"#
    )
}

/// Protobuf payloads of confluent-kafka's `ProtobufSerializer` (the schema registered in its serialized form, the
/// message indexes after the id), and the same messages plain with a `.proto` `schema_file` and `message`: the
/// values exact (a `oneof` member by its name, a `Timestamp`, a wrapper as its value, an enum as its name), each
/// applied once; a message that is not valid Protobuf is `decode_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_payments_from_the_registry_and_from_a_proto_file() {
    let registry = Registry::start(&[]);
    let db = TestDb::new(&format!("{TABLE} ALTER TABLE payments ADD COLUMN iban text, ADD COLUMN note text;")).await;
    let kafka = Kafka::new();
    kafka.create_topic("proto-payments", 1);
    kafka.create_topic("plain-payments", 1);
    let tmp = tempfile::tempdir().unwrap();
    let proto = tmp.path().join("payment.proto");
    std::fs::write(&proto, PAYMENT_PROTO).unwrap();
    let values = registry.serialize_protobuf("proto-payments", &proto, "Payment", &[proto_payment("P-1", "100.000000000000000001"), proto_payment("P-2", "2.50")]);
    let mut garbage = values[0][..6].to_vec();
    garbage.extend([0xff, 0xff, 0xff]);
    let out = |v: &[u8]| Out { value: Some(v.to_vec()), ..Out::default() };
    kafka.produce("proto-payments", &[out(&values[0]), out(&values[1]), out(&values[0]), out(&garbage)]);
    // A plain producer: the message without the header (5 bytes) and the message indexes (one byte, [0]).
    let plain = registry.serialize_protobuf("plain-payments", &proto, "Payment", &[proto_payment("Q-1", "3.25")]);
    kafka.produce("plain-payments", &[out(&plain[0][6..])]);

    let columns = "[sink.columns]\norder_id = \"/order/id\"\naccount = \"/order/account\"\namount = \"/order/amount\"\n\
                   paid_at = \"/paid_at\"\nmethod = \"/method\"\ntags = \"/tags\"\nfingerprint = \"/fingerprint\"\n\
                   channel = \"/context/channel\"\nseq = \"/seq\"\niban = \"/iban\"\nnote = \"/note\"\n";
    let registry_pipeline = format!("topics = [\"proto-payments\"]\nformat = \"protobuf\"\n[key]\nfield = \"/order/id\"\n[sink]\ntable = \"payments\"\n{columns}");
    let file_pipeline = format!(
        "topics = [\"plain-payments\"]\nformat = \"protobuf\"\nschema_file = \"payment.proto\"\nmessage = \"shop.events.Payment\"\n[key]\nfield = \"/order/id\"\n[sink]\ntable = \"payments\"\n{columns}"
    );
    let setup = Setup::with(&db, &kafka, &[("proto.toml", &registry_pipeline), ("plain.toml", &file_pipeline)], "", &registry_section(&registry, ""));
    std::fs::write(setup.dir.path().join("pipelines/payment.proto"), PAYMENT_PROTO).unwrap();
    let w = InProc::start(&setup).await;
    w.wait_received("proto", 4).await;
    w.wait_received("plain", 1).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "proto")]), 2.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "proto"), ("reason", "republished")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "proto"), ("reason", "decode_failed")]), 1.0);
    assert!(w.stop().await.is_empty());
    let row: String = db
        .scalar(
            "SELECT concat_ws('|', account, amount::text, paid_at = '2025-11-29T10:00:00.123Z', method, tags->>1, \
             encode(fingerprint, 'hex'), channel, seq, iban, note) FROM payments WHERE order_id = 'P-1'",
        )
        .await;
    assert_eq!(row, "ACC-1|100.000000000000000001|t|BANK|b|dead|web|9007199254740993|DE89|n");
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',' ORDER BY order_id) FROM payments").await, "P-1,P-2,Q-1");
    let errors: String = db.scalar("SELECT string_agg(error, E'\\n') FROM idemflow.dead_letters").await;
    assert!(errors.contains("does not decode with schema id 1"), "{errors}");
}

/// A schema id the registry does not know yet (a follower not caught up, a restore) is waited on, the pipeline
/// paused: once the registry learns it within `missing_schema_wait`, its records are applied, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_the_registry_learns_while_waited_on_is_read_not_dead_lettered() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    // Encoded against another registry (a scratch one), where the schema has id 1: this registry has no id 1 yet.
    let scratch = Registry::start(&[]);
    let values = scratch.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    kafka.produce("payments", &[Out { value: Some(values[0].clone()), ..Out::default() }]);
    let section = format!("[schema_registry]\nurl = \"{}\"\nmissing_schema_wait = \"5m\"\n", registry.url());
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &section);
    let w = InProc::start(&setup).await;
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(30), "the missing id to be asked for again", || async {
        w.metric("idemflow_schema_registry_retries_total", &p) >= 2.0
    })
    .await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 0.0);
    // The registry learns the schema (as id 1).
    registry.serialize("avro", "payments", &avsc, &[payment("ORD-0", "0.5")]);
    wait_until(Duration::from_secs(60), "the record to be applied", || async { w.metric("idemflow_records_applied_total", &p) >= 1.0 }).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0);
}

/// `check` holds the key's and the columns' paths to the subject's latest schema in the registry: a path it cannot
/// have is a problem naming the pipeline, the field, the path, the subject, its version and the schema id; the
/// right paths are found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_a_path_the_registered_schema_does_not_have() {
    let registry = Registry::start(&[]);
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    kafka.create_topic("orders", 1);
    let tmp = tempfile::tempdir().unwrap();
    let avsc = schema_file(tmp.path(), PAYMENT_AVSC);
    registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    registry.serialize("avro", "orders", &avsc, &[payment("ORD-1", "1.5")]);
    let typo = pipeline("orders", "format = \"avro\"").replace("amount = \"/order/amount\"", "amount = \"/order/amont\"");
    let setup = Setup::with(
        &db,
        &kafka,
        &[("payments.toml", &pipeline("payments", "format = \"avro\"")), ("orders.toml", &typo)],
        "",
        &registry_section(&registry, ""),
    );
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    let text = format!("{out}{err}");
    assert!(!status.success(), "{text}");
    assert!(
        text.contains("pipeline \"orders\": sink.columns.amount: /order/amont is not in subject orders-value version 1 (schema id 1): it has no /order/amont"),
        "{text}"
    );
    assert!(text.contains("pipeline \"payments\": subject payments-value version 1 (schema id 1): all 10 paths found"), "{text}");
}

/// A business key from a field of an Avro record key (a Debezium key struct, `{"id": 42}` under `<topic>-key`):
/// the key is the field's value; the same key again is a duplicate whatever the value; a record key that does not
/// decode is `decode_failed`, one without the field `key_missing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_key_from_a_field_of_an_avro_record_key() {
    let registry = Registry::start(&[]);
    let db = TestDb::new("CREATE TABLE changes (id bigint PRIMARY KEY, name text);").await;
    let kafka = Kafka::new();
    kafka.create_topic("dbserver.inventory.customers", 1);
    let tmp = tempfile::tempdir().unwrap();
    let key_schema = tmp.path().join("key.avsc");
    std::fs::write(&key_schema, r#"{"type": "record", "name": "Key", "namespace": "dbserver.inventory.customers", "fields": [{"name": "id", "type": "long"}]}"#).unwrap();
    let keys = registry.serialize("avro", "dbserver.inventory.customers:key", &key_schema, &[r#"{"id": 42}"#.to_owned(), r#"{"id": 43}"#.to_owned()]);
    let rec = |key: &[u8], value: &str| Out { key: Some(key.to_vec()), value: Some(value.as_bytes().to_vec()), ..Out::default() };
    kafka.produce(
        "dbserver.inventory.customers",
        &[
            rec(&keys[0], r#"{"after": {"id": 42, "name": "Ada"}}"#),
            rec(&keys[1], r#"{"after": {"id": 43, "name": "Bob"}}"#),
            rec(&keys[0], r#"{"after": {"id": 42, "name": "Ada L."}}"#),
            rec(b"not avro", r#"{"after": {"id": 44, "name": "Cy"}}"#),
        ],
    );
    let pipeline = r#"topics = ["dbserver.inventory.customers"]
[key]
record_key = "/id"
record_key_format = "avro"
[sink]
table = "changes"
[sink.columns]
id = "/after/id"
name = "/after/name"
"#;
    let setup = Setup::with(&db, &kafka, &[("customers.toml", pipeline)], "", &registry_section(&registry, ""));
    let w = InProc::start(&setup).await;
    w.wait_received("customers", 4).await;
    let p = [("pipeline", "customers")];
    assert_eq!(w.metric("idemflow_records_applied_total", &p), 2.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "customers"), ("reason", "payload_mismatch")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "customers"), ("reason", "decode_failed")]), 1.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(id || '=' || name, ',' ORDER BY id) FROM changes").await, "42=Ada,43=Bob");
    let error: String = db.scalar("SELECT error FROM idemflow.dead_letters").await;
    assert!(error.starts_with("the record key: not in the schema registry wire format"), "{error}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'customers' AND key_id IN ('42', '43')").await, 2);

    // check looks the key's path up in the record keys' schema (<topic>-key).
    let (_, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(out.contains("record keys: subject dbserver.inventory.customers-key version 1 (schema id 1): /id found"), "{out}{err}");
    let typo = Setup::with(&db, &kafka, &[("customers.toml", &pipeline.replace("record_key = \"/id\"", "record_key = \"/ID\""))], "", &registry_section(&registry, ""));
    let (status, out, err) = idemflow(&["check", "--config", typo.config.to_str().unwrap()], typo.dir.path());
    assert!(!status.success() && err.contains("key.record_key: /ID is not in subject dbserver.inventory.customers-key"), "{out}{err}");
}

/// The registry over HTTPS with a private CA and bearer authentication: with `ca_file` the CA, the schema is
/// fetched and the records applied; with an unrelated CA, `check` says it cannot read the schema (the certificate
/// is not trusted) and the worker pauses and retries, dead-lettering nothing. The token is never printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_over_tls_with_a_private_ca_and_a_bearer_token() {
    let certs = tempfile::tempdir().unwrap();
    crate::security::certificates(certs.path());
    let (crt, key) = (certs.path().join("server.crt"), certs.path().join("server.key"));
    let registry = Registry::start(&["--bearer", "s3cret-token", "--tls", crt.to_str().unwrap(), key.to_str().unwrap()]);
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let tmp = tempfile::tempdir().unwrap();
    let avsc = schema_file(tmp.path(), PAYMENT_AVSC);
    // Encoded against a plain registry; the TLS one learns the same schema (as id 1) from a plain twin's text.
    let plain = Registry::start(&[]);
    let values = plain.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    registry.register_over_tls("payments-value", PAYMENT_AVSC, &certs.path().join("ca.crt"), "s3cret-token");
    kafka.produce("payments", &[Out { value: Some(values[0].clone()), ..Out::default() }]);
    let section = |ca: &str| {
        format!(
            "[schema_registry]\nurl = \"https://localhost:{}\"\nbearer_token = \"s3cret-token\"\nca_file = \"{}\"\nmissing_schema_wait = \"1s\"\n",
            registry.port,
            certs.path().join(ca).display()
        )
    };
    let wrong = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &section("other-ca.crt"));
    let (status, out, err) = idemflow(&["check", "--config", wrong.config.to_str().unwrap()], wrong.dir.path());
    let text = format!("{out}{err}");
    assert!(!status.success(), "{text}");
    assert!(text.contains("cannot read the schema its payloads are written with") && text.contains("unavailable"), "{text}");
    assert!(!text.contains("s3cret-token"), "{text}");
    let w = InProc::start(&wrong).await;
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(30), "the fetch to be retried", || async { w.metric("idemflow_schema_registry_retries_total", &p) >= 2.0 }).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &p), 0.0);
    assert!(w.stop().await.is_empty());

    let right = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &section("ca.crt"));
    let (status, out, err) = idemflow(&["check", "--config", right.config.to_str().unwrap()], right.dir.path());
    assert!(out.contains("subject payments-value version 1 (schema id 1): all 10 paths found"), "{out}{err}{status:?}");
    let w = InProc::start(&right).await;
    wait_until(Duration::from_secs(30), "the record to be applied", || async { w.metric("idemflow_records_applied_total", &p) >= 1.0 }).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0);
}

/// The formats are the same for every broker: Avro payloads in the wire format from a RabbitMQ queue, and plain
/// Protobuf messages of a `.proto` schema_file from a NATS JetStream stream, each applied once with the same paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_and_nats_payloads_in_the_same_formats() {
    use crate::support::{nats::NatsServer, rabbitmq};
    let registry = Registry::start(&[]);
    let tmp = tempfile::tempdir().unwrap();
    let avsc = schema_file(tmp.path(), PAYMENT_AVSC);
    let queue = format!("avro-payments-{}", free_port());
    let values = registry.serialize("avro", &queue, &avsc, &[payment("R-1", "1.25"), payment("R-2", "2.5")]);
    let db = TestDb::new(TABLE).await;
    let client = rabbitmq::Client::connect(rabbitmq::shared_url()).await;
    client.declare(&queue, "classic", false).await;
    let msg = |id: &str, body: &[u8]| rabbitmq::Msg { message_id: Some(id.to_owned()), body: body.to_vec() };
    client.publish(&queue, &[msg("m-1", &values[0]), msg("m-2", &values[1]), msg("m-3", &values[0])]).await;
    // The Kafka pipeline's keys and columns, reading the queue instead of a topic.
    let rabbit_pipeline = pipeline("x", "format = \"avro\"")
        .replace("topics = [\"x\"]\nformat = \"avro\"\n", &format!("format = \"avro\"\n[source]\nkind = \"rabbitmq\"\nqueue = \"{queue}\"\n"));
    let setup = Setup::rabbitmq(&db, rabbitmq::shared_url(), &[("rabbit.toml", &rabbit_pipeline)], &registry_section(&registry, ""));
    let w = InProc::start(&setup).await;
    w.wait_received("rabbit", 3).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "rabbit")]), 2.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "rabbit"), ("reason", "republished")]), 1.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id || '=' || amount::text, ',' ORDER BY order_id) FROM payments").await, "R-1=1.250000000000000000,R-2=2.500000000000000000");

    let server = NatsServer::start();
    server.create_stream("PAYMENTS").await;
    let proto = tmp.path().join("payment.proto");
    std::fs::write(&proto, PAYMENT_PROTO).unwrap();
    let encoded = registry.serialize_protobuf("nats-payments", &proto, "Payment", &[proto_payment("N-1", "3.5")]);
    // Plain messages: without the wire format's header and message indexes.
    server.publish("PAYMENTS.created", &[(Some("n-1".into()), encoded[0][6..].to_vec()), (Some("n-2".into()), encoded[0][6..].to_vec())]).await;
    let nats_pipeline = "format = \"protobuf\"\nschema_file = \"payment.proto\"\nmessage = \"Payment\"\n\
        [source]\nkind = \"nats\"\nstream = \"PAYMENTS\"\n[key]\nfield = \"/order/id\"\n[sink]\ntable = \"payments\"\n\
        [sink.columns]\norder_id = \"/order/id\"\naccount = \"/order/account\"\namount = \"/order/amount\"\nseq = \"/seq\"\n";
    let setup = Setup::nats(&db, &server, &[("nats.toml", nats_pipeline)], "");
    std::fs::write(setup.dir.path().join("pipelines/payment.proto"), PAYMENT_PROTO).unwrap();
    let w = InProc::start(&setup).await;
    w.wait_received("nats", 2).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "nats")]), 1.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "nats"), ("reason", "republished")]), 1.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT amount::text || ' ' || seq FROM payments WHERE order_id = 'N-1'").await, "3.5 9007199254740993");
}

/// The guarantee matrix's scenario (a) and (d) with the payloads in Avro and in Protobuf (`matrix::core_in`): the
/// shipped example on Kafka and PostgreSQL, the stream encoded by confluent-kafka's serializers; every duplicate
/// counted under its reason, every poison record dead-lettered, then a rewind: nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_core_avro_kafka_postgres() {
    crate::matrix::core_in(crate::matrix::PayloadFormat::Avro, crate::matrix::Broker::Kafka, crate::matrix::Db::Postgres).await;
}

/// [`matrix_core_avro_kafka_postgres`] in Protobuf.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_core_protobuf_kafka_postgres() {
    crate::matrix::core_in(crate::matrix::PayloadFormat::Protobuf, crate::matrix::Broker::Kafka, crate::matrix::Db::Postgres).await;
}

/// `check` holds each bound path's kind of value to its column's type: a timestamp into a `numeric` column and a
/// record into a `bigint` are refused, naming the field, the path, the schema and the type; a record into a `jsonb`
/// or `text` column binds (as its JSON text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_a_value_its_column_cannot_take() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    let wrong = pipeline("payments", "format = \"avro\"")
        .replace("amount = \"/order/amount\"", "amount = \"/paid_at\"")
        .replace("seq = \"/seq\"", "seq = \"/order\"")
        .replace("tags = \"/tags\"", "tags = \"/context\"");
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &wrong)], "", &registry_section(&registry, ""));
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    let text = format!("{out}{err}");
    assert!(!status.success(), "{text}");
    let schema = "subject payments-value version 1 (schema id 1)";
    assert!(text.contains(&format!("sink.columns.amount: /paid_at is a date or time in {schema}, which its target's type numeric cannot take")), "{text}");
    assert!(text.contains(&format!("sink.columns.seq: /order is a record in {schema}, which its target's type bigint cannot take")), "{text}");
    assert!(!text.contains("sink.columns.tags"), "a map into jsonb binds: {text}");
}

/// `missing_schema_wait = "0s"`: a record naming an id the registry does not know is dead-lettered at once, the
/// registry asked about it once per batch (never in a loop), and the stream moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_wait_an_unknown_id_is_dead_lettered_at_once_and_asked_once() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    let values = registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    let mut unknown = vec![0, 0, 0, 0, 77];
    unknown.extend(&values[0][5..]);
    kafka.produce("payments", &[Out { value: Some(unknown), ..Out::default() }, Out { value: Some(values[0].clone()), ..Out::default() }]);
    let section = format!("[schema_registry]\nurl = \"{}\"\nmissing_schema_wait = \"0s\"\n", registry.url());
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &section);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 2).await;
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(30), "the record to be applied", || async { w.metric("idemflow_records_applied_total", &p) >= 1.0 }).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 1.0);
    assert!(w.stop().await.is_empty());
    let asked = registry.requests("/schemas/ids/77");
    assert!((1..=3).contains(&asked), "asked {asked} times");
}

/// An Avro datum of the record `Überweisung` below: zigzag varints and length-prefixed strings, in the wire format
/// (magic byte, schema id), as a Java producer's serializer writes it.
fn ueberweisung(id: u32, reference: &str, amount: i64, recipient: &str) -> Vec<u8> {
    fn varint(mut n: u64, out: &mut Vec<u8>) {
        while n >= 0x80 {
            out.push((n as u8 & 0x7f) | 0x80);
            n >>= 7;
        }
        out.push(n as u8);
    }
    let long = |n: i64, out: &mut Vec<u8>| varint(((n << 1) ^ (n >> 63)) as u64, out);
    let mut out = vec![0];
    out.extend(id.to_be_bytes());
    long(reference.len() as i64, &mut out);
    out.extend(reference.as_bytes());
    long(amount, &mut out);
    long(recipient.len() as i64, &mut out);
    out.extend(recipient.as_bytes());
    out
}

/// A schema whose names Java's Avro accepts and the Avro specification's ASCII rule does not (the record
/// `Überweisung` in namespace `de.bank.überweisungen`, a field `Empfänger`), registered as Confluent's registry
/// registers it: the binary applies its records, and a JSON pipeline of the same worker goes on. apache-avro's own
/// name check panicked on it, and the panic took the whole worker down (exit 101) at every restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_avro_schema_with_non_ascii_names_is_read_and_the_other_pipelines_go_on() {
    let registry = Registry::start(&[]);
    let db = TestDb::new(
        "CREATE TABLE transfers (ref text PRIMARY KEY, amount bigint NOT NULL, recipient text NOT NULL);
         CREATE TABLE orders (id text PRIMARY KEY);",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("transfers", 1);
    kafka.create_topic("orders", 1);
    let schema = r#"{"type": "record", "name": "Überweisung", "namespace": "de.bank.überweisungen", "fields": [
        {"name": "Referenz", "type": "string"}, {"name": "Betrag", "type": "long"}, {"name": "Empfänger", "type": "string"}]}"#;
    let id = registry.register("transfers-value", schema);
    let transfers = [("T-1", 1250, "Müller"), ("T-2", -7, "Ørsted"), ("T-1", 1250, "Müller")];
    let records: Vec<Out> =
        transfers.iter().map(|(r, a, who)| Out { value: Some(ueberweisung(id, r, *a, who)), ..Out::default() }).collect();
    kafka.produce("transfers", &records);
    kafka.produce("orders", &[Out::json(0, r#"{"id":"o-1"}"#), Out::json(0, r#"{"id":"o-2"}"#)]);
    let transfers_pipeline = r#"topics = ["transfers"]
format = "avro"
[key]
field = "/Referenz"
[sink]
table = "transfers"
[sink.columns]
ref = "/Referenz"
amount = "/Betrag"
recipient = "/Empfänger"
"#;
    let orders_pipeline = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"orders\"\n[sink.columns]\nid = \"/id\"\n";
    let setup = Setup::with(
        &db,
        &kafka,
        &[("transfers.toml", transfers_pipeline), ("orders.toml", orders_pipeline)],
        "",
        &registry_section(&registry, ""),
    );
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "both pipelines applied their records", || async {
        db.scalar::<i64>("SELECT count(*) FROM transfers").await == 2 && db.scalar::<i64>("SELECT count(*) FROM orders").await == 2
    })
    .await;
    assert!(db.scalar::<bool>("SELECT amount = 1250 AND recipient = 'Müller' FROM transfers WHERE ref = 'T-1'").await);
    assert!(db.scalar::<bool>("SELECT amount = -7 AND recipient = 'Ørsted' FROM transfers WHERE ref = 'T-2'").await);
    let scraped = w.scrape();
    assert_eq!(metric(&scraped, "idemflow_pipeline_up", &[("pipeline", "transfers")]), 1.0, "{scraped}");
    assert_eq!(metric(&scraped, "idemflow_dead_letters_total", &[("pipeline", "transfers"), ("reason", "decode_failed")]), 0.0);
    kafka.produce("orders", &[Out::json(0, r#"{"id":"o-3"}"#)]);
    wait_until(Duration::from_secs(30), "the JSON pipeline still applies", || async {
        db.scalar::<i64>("SELECT count(*) FROM orders").await == 3
    })
    .await;
    assert!(!w.log_text().contains("panicked"), "{}", w.log_text());
    assert!(w.sigterm().success());
}

/// The registry's client follows a redirect only within the registry's origin: a registry that answers 307 to
/// another host (a second registry here, which holds the same schema under the same id) is not followed, the
/// pipeline pauses on an unavailable registry (retries counted, nothing dead-lettered) and the other host hears
/// nothing; the registry answering again, the record is applied. The client used to follow up to 10 redirects
/// anywhere, https to http included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_client_follows_no_redirect_to_another_origin() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    let values = registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    let elsewhere = Registry::start(&[]);
    assert_eq!(elsewhere.register("payments-value", PAYMENT_AVSC), 1);
    registry.redirect_to(&elsewhere.url());
    kafka.produce("payments", &[Out { value: Some(values[0].clone()), ..Out::default() }]);
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &registry_section(&registry, ""));
    let w = InProc::start(&setup).await;
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(30), "the fetch retried while the registry redirects", || async {
        w.metric("idemflow_schema_registry_retries_total", &p) >= 2.0
    })
    .await;
    assert_eq!(elsewhere.requests("/schemas/ids/1"), 0, "the redirect was followed");
    assert_eq!(w.metric("idemflow_records_applied_total", &p), 0.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 0.0);
    registry.redirect_to("");
    w.wait_received("payments", 1).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &p), 1.0);
    assert!(w.stop().await.is_empty());
}

/// Schema ids the registry does not know, one batch after another (a topic whose payloads name random ids): the
/// burst is waited on once, not once per batch: six records, one a batch, each naming its own unknown id, are all
/// dead-lettered within about one `missing_schema_wait` (15 s) instead of six (90 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_unknown_schema_ids_is_waited_on_once() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    let values = registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5")]);
    let records: Vec<Out> = (0..6u32)
        .map(|i| {
            let mut v = values[0].clone();
            v[1..5].copy_from_slice(&(1000 + i * 7919).to_be_bytes());
            Out { value: Some(v), ..Out::default() }
        })
        .collect();
    kafka.produce("payments", &records);
    let section = format!("[schema_registry]\nurl = \"{}\"\ntimeout = \"2s\"\nmissing_schema_wait = \"15s\"\n", registry.url());
    let pipeline = with_max_records(&pipeline("payments", "format = \"avro\""), 1);
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], "", &section);
    let w = InProc::start(&setup).await;
    wait_until(Duration::from_secs(50), "six unknown ids dead-lettered after one wait", || async {
        w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]) == 6.0
    })
    .await;
    assert!(w.stop().await.is_empty());
}

/// A record is dead-lettered for a missing schema only on a fresh "no such schema": an id that was missing past
/// `missing_schema_wait` (its first record dead-lettered) and that the registry learns afterwards is asked for
/// again by the next record naming it more than a few seconds later, which is applied. It used to be asked again
/// only once per `missing_schema_wait` (8 s here), so the next record was dead-lettered on a stale answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_registered_after_its_wait_is_read_by_the_next_record() {
    let Fixture { registry, db, kafka, avsc, _tmp } = fixture(&[]).await;
    let values = registry.serialize("avro", "payments", &avsc, &[payment("ORD-1", "1.5"), payment("ORD-2", "2.5")]);
    // Id 2 is not registered yet: the schema registered below gets it.
    let as_id_2 = |v: &Vec<u8>| {
        let mut v = v.clone();
        v[1..5].copy_from_slice(&2u32.to_be_bytes());
        Out { value: Some(v), ..Out::default() }
    };
    kafka.produce("payments", &[as_id_2(&values[0])]);
    let section = format!("[schema_registry]\nurl = \"{}\"\ntimeout = \"2s\"\nmissing_schema_wait = \"8s\"\n", registry.url());
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("payments", "format = \"avro\""))], "", &section);
    let w = InProc::start(&setup).await;
    let dead = || w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]);
    wait_until(Duration::from_secs(40), "the first record dead-lettered after the wait", || async { dead() == 1.0 }).await;
    // The same schema text with a doc: another schema, id 2, whose datums read as the first's.
    let second = PAYMENT_AVSC.replacen("\"type\": \"record\",", "\"type\": \"record\", \"doc\": \"v2\",", 1);
    assert_eq!(registry.register("payments-value", &second), 2);
    tokio::time::sleep(Duration::from_secs(6)).await;
    kafka.produce("payments", &[as_id_2(&values[1])]);
    w.wait_received("payments", 2).await;
    assert_eq!(dead(), 1.0, "the second record was dead-lettered on a stale answer");
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
    assert!(w.stop().await.is_empty());
}
