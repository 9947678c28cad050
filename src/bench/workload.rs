//! The workload every run starts from: the stream of orders produced before any timing, the pipelines the runs
//! use, and the fresh databases and tables they write to.

use anyhow::Context as _;
use sqlx::{Connection, Executor, PgConnection};
use std::time::Duration;

pub(super) const TOPIC: &str = "bench";

pub(super) const PIPELINE: &str = "orders";

/// The stream: records (partition, payload) and how many distinct keys it has.
pub(super) struct Stream {
    pub(super) records: Vec<(i32, Vec<u8>)>,
    /// First occurrence of each key: (index into records).
    pub(super) firsts: Vec<usize>,
    pub(super) republished: u64,
    pub(super) mismatched: u64,
}

pub(super) fn order(id: u64, cents: u64, account: u64) -> Vec<u8> {
    let mut s = format!(
        r#"{{"order":{{"id":"ORD-{id:010}","account":"ACC-{account:05}","amount":"{}.{:02}","currency":"EUR","channel":"web","note":"#,
        cents / 100,
        cents % 100
    );
    s.push_str(r#""standard delivery, leave at the door""#);
    s.push_str(r#"},"created_at":"2026-11-29T10:00:00Z"}"#);
    s.into_bytes()
}

pub(super) fn stream(records: usize, partitions: i32) -> Stream {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut s = Stream { records: Vec::with_capacity(records), firsts: Vec::new(), republished: 0, mismatched: 0 };
    let mut sent: Vec<(u64, u64, u64)> = Vec::new();
    while s.records.len() < records {
        let roll = next() % 1000;
        let part = |id: u64| (id % partitions as u64) as i32;
        if roll < 15 && !sent.is_empty() {
            let (id, cents, account) = sent[sent.len() - 1 - (next() as usize % sent.len().min(1000))];
            s.records.push((part(id), order(id, cents, account)));
            s.republished += 1;
        } else if roll < 20 && !sent.is_empty() {
            let (id, cents, account) = sent[next() as usize % sent.len()];
            s.records.push((part(id), order(id, cents + 1, account)));
            s.mismatched += 1;
        } else {
            let id = sent.len() as u64;
            let (cents, account) = (100 + next() % 100_000, next() % 10_000);
            s.firsts.push(s.records.len());
            s.records.push((part(id), order(id, cents, account)));
            sent.push((id, cents, account));
        }
    }
    s
}

pub(super) const TABLE_SQL: &str = "CREATE TABLE orders (order_id text PRIMARY KEY, account_id text NOT NULL, amount numeric NOT NULL, \
     currency text NOT NULL, created_at timestamptz NOT NULL)";

/// The same table on MySQL/MariaDB.
pub(super) const MYSQL_TABLE_SQL: &str = "CREATE TABLE orders (order_id VARCHAR(64) PRIMARY KEY, account_id VARCHAR(64) NOT NULL, \
     amount DECIMAL(18, 2) NOT NULL, currency CHAR(3) NOT NULL, created_at TIMESTAMP(6) NOT NULL) \
     ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin";

/// Whether `url` names MySQL or MariaDB.
pub(super) fn is_mysql(url: &str) -> bool {
    crate::store::template::Dialect::of_url(url) == crate::store::template::Dialect::MySql
}

/// Connect settings for `url`, for the bench's own connections.
pub(super) fn settings_for(url: &str) -> crate::store::spec::DatabaseSettings {
    crate::store::spec::DatabaseSettings { url: url.to_owned().into(), max_connections: 2, acquire_timeout: Duration::from_secs(30), prepared_statements: true, batch_timeout: crate::store::spec::DEFAULT_BATCH_TIMEOUT }
}

/// The business columns and where their values come from, for both forms of the side effect.
pub(super) const COLUMNS: [(&str, &str); 5] = [
    ("order_id", "/order/id"),
    ("account_id", "/order/account"),
    ("amount", "/order/amount"),
    ("currency", "/order/currency"),
    ("created_at", "/created_at"),
];

pub(super) fn pipeline_text(sink: &str, mapping: &str, batch: &str) -> String {
    let lines: String = COLUMNS.iter().map(|(c, path)| format!("{c} = \"{path}\"\n")).collect();
    format!("name = \"{PIPELINE}\"\ntopics = [\"{TOPIC}\"]\n[key]\nfield = \"/order/id\"\n[sink]\n{sink}\n[{mapping}]\n{lines}{batch}")
}

/// The table form (one set-based `INSERT` per batch), with an optional `batch.max_records`.
pub(super) fn table_pipeline(max_records: Option<usize>) -> String {
    let batch = max_records.map(|n| format!("[batch]\nmax_records = {n}\n")).unwrap_or_default();
    pipeline_text("table = \"orders\"", "sink.columns", &batch)
}

/// Run (20): the table form, and one HTTP request per new key through the outbox (`[[sink.http]]`, its defaults) to
/// the provider at `url` (the demo's, [`crate::demo::provider`], on a loopback port).
pub(super) fn http_table_pipeline(url: &str) -> String {
    let http = format!(
        "[sink.params]\norder = \"/order/id\"\naccount = \"/order/account\"\namount = \"/order/amount\"\n\
         [[sink.http]]\nname = \"provider\"\nurl = \"{url}/v1/charges\"\n\
         body = {{ order = \"{{order}}\", account = \"{{account}}\", amount = \"{{amount}}\" }}\n"
    );
    pipeline_text("table = \"orders\"", "sink.columns", &http)
}

/// The table form with default batching and `batch.concurrency = lanes` (runs (14) and (15)).
pub(super) fn concurrent_table_pipeline(lanes: usize) -> String {
    pipeline_text("table = \"orders\"", "sink.columns", &format!("[batch]\nconcurrency = {lanes}\n"))
}

/// The SQL form of the same side effect: one `INSERT` statement per new record. `created_at` declares its type
/// (MySQL cannot infer it; PostgreSQL ignores the declaration).
pub(super) fn sql_pipeline() -> String {
    let columns: Vec<&str> = COLUMNS.iter().map(|(c, _)| *c).collect();
    let params: Vec<String> = columns.iter().map(|c| format!(":{c}")).collect();
    let sql = format!("INSERT INTO orders ({}) VALUES ({})", columns.join(", "), params.join(", "));
    pipeline_text(&format!("sql = \"{sql}\""), "sink.params", "")
        .replace("created_at = \"/created_at\"", "created_at = { field = \"/created_at\", type = \"timestamp\" }")
}

/// The shipped example, `pipelines/payments.toml`, as it ships, on the bench's topic (the stream's orders carry the
/// fields it reads: `/order/id`, `/order/account`, `/order/amount`, `/order/currency`; `paid_at` and `details`
/// are optional and absent).
pub(super) fn payments_pipeline() -> String {
    on_bench_topic(include_str!("../../pipelines/payments.toml"))
}

/// The per-record SQL form of the shipped example, `examples/per-record-sql/payments.toml`, on the bench's topic.
pub(super) fn per_record_payments_pipeline() -> String {
    on_bench_topic(include_str!("../../examples/per-record-sql/payments.toml"))
}

/// A payments pipeline file (`topics = ["payments"]`) renamed to the bench's pipeline and moved to its topic.
pub(super) fn on_bench_topic(shipped: &str) -> String {
    let text = shipped.replace("topics = [\"payments\"]", &format!("name = \"{PIPELINE}\"\ntopics = [\"{TOPIC}\"]"));
    assert_ne!(text, shipped, "a payments pipeline file names its topic as `topics = [\"payments\"]`");
    text
}

/// A database for runs (8), (12) and (13): migrated, with `pipelines/payments.sql` and the stream's 10,000 accounts.
pub(super) async fn payments_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    let url = fresh_database(admin_url, name).await?;
    let mut conn = PgConnection::connect(&url).await?;
    conn.execute(sqlx::raw_sql(include_str!("../../pipelines/payments.sql"))).await?;
    conn.execute("INSERT INTO accounts SELECT 'ACC-' || lpad(g::text, 5, '0'), 1e12 FROM generate_series(0, 9999) g").await?;
    Ok(url)
}

/// The key table of runs (9) to (11): the business key text as the primary key, nothing else.
pub(super) const KEYS_SQL: &str = "CREATE TABLE processed_keys (business_key text PRIMARY KEY)";

/// PostgreSQL database `name` made anew on the server of `admin_url` (dropped first if it exists): its URL and a
/// connection to it.
async fn new_postgres_database(admin_url: &str, name: &str) -> anyhow::Result<(String, PgConnection)> {
    let mut admin = PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
    admin.execute(format!("DROP DATABASE IF EXISTS {name}").as_str()).await?;
    admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
    let url = format!("{base}/{name}");
    let conn = PgConnection::connect(&url).await?;
    Ok((url, conn))
}

/// A database for runs (9) to (11): the business table and the key table, no idemflow schema.
pub(super) async fn minimal_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    let (url, mut conn) = new_postgres_database(admin_url, name).await?;
    conn.execute(TABLE_SQL).await?;
    conn.execute(KEYS_SQL).await?;
    Ok(url)
}

/// The business row of an order payload, as the hand-written consumers and the ceilings read it: order id, account,
/// amount, currency, created_at.
pub(super) fn order_row(payload: &[u8]) -> Option<[String; 5]> {
    let doc: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let o = &doc["order"];
    let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
    Some([text(&o["id"])?, text(&o["account"])?, text(&o["amount"])?, text(&o["currency"])?, text(&doc["created_at"])?])
}

/// The Redis form of the same side effect: each new order as a hash `order:<id>`.
pub(super) fn redis_pipeline() -> String {
    let fields: String = COLUMNS.iter().skip(1).map(|(c, _)| format!(", \"{c}\", \"{{{c}}}\"")).collect();
    pipeline_text(&format!("redis = [[\"HSET\", \"order:{{order_id}}\"{fields}]]"), "sink.params", "")
}

/// A database for one run: created on the server, migrated, with the business table.
pub(super) async fn fresh_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    if is_mysql(admin_url) {
        let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
        let options = crate::store::mysql::connect_options(&settings_for(&format!("{base}/")))?;
        let mut admin = sqlx::MySqlConnection::connect_with(&options).await.context("connecting to MySQL/MariaDB")?;
        admin.execute(format!("DROP DATABASE IF EXISTS {name}").as_str()).await?;
        admin.execute(format!("CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin").as_str()).await?;
        let url = format!("{base}/{name}");
        let pool = crate::store::mysql::pool(&settings_for(&url))?;
        crate::store::mysql::MIGRATOR.run(&pool).await?;
        sqlx::raw_sql(MYSQL_TABLE_SQL).execute(&pool).await?;
        pool.close().await;
        return Ok(url);
    }
    let (url, mut conn) = new_postgres_database(admin_url, name).await?;
    crate::store::postgres::MIGRATOR.run(&mut conn).await?;
    conn.execute(TABLE_SQL).await?;
    Ok(url)
}

/// The stream of `records` orders over `partitions` ([`stream`]), produced into the embedded broker's topic before
/// any timing, with a line saying what it holds.
///
/// Errors: the broker refused a record or the flush.
pub(super) fn produce(kafka: &crate::demo::kafka::EmbeddedKafka, records: usize, partitions: i32) -> anyhow::Result<Stream> {
    let s = stream(records, partitions);
    let started = std::time::Instant::now();
    for (partition, value) in &s.records {
        kafka.send(rdkafka::producer::BaseRecord::<[u8], [u8]>::to(TOPIC).partition(*partition).payload(value))?;
    }
    kafka.flush()?;
    let avg = s.records.iter().map(|r| r.1.len()).sum::<usize>() / s.records.len().max(1);
    eprintln!(
        "produced {} records ({avg} bytes on average; {} distinct keys, {} republished, {} payload mismatches) in {:.1} s",
        s.records.len(), s.firsts.len(), s.republished, s.mismatched, started.elapsed().as_secs_f64()
    );
    Ok(s)
}

/// The orders' Avro schema, for runs (16) and (18).
pub(super) const ORDER_AVSC: &str = r#"{"type": "record", "name": "Order", "namespace": "idemflow.bench", "fields": [
  {"name": "order", "type": {"type": "record", "name": "Details", "fields": [
    {"name": "id", "type": "string"}, {"name": "account", "type": "string"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 2}},
    {"name": "currency", "type": "string"}, {"name": "channel", "type": "string"}, {"name": "note", "type": "string"}]}},
  {"name": "created_at", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}"#;

/// The orders' `.proto`, for runs (17) and (19).
pub(super) const ORDER_PROTO: &str = r#"syntax = "proto3";
package idemflow.bench;
import "google/protobuf/timestamp.proto";
message Order {
  message Details { string id = 1; string account = 2; string amount = 3; string currency = 4; string channel = 5; string note = 6; }
  Details order = 1;
  google.protobuf.Timestamp created_at = 2;
}
"#;

/// The stream's records in `format`, produced to `topic` (the same partitions), for the format runs (16) to
/// (19). Returns the encoded records' average size in bytes.
pub(super) fn produce_encoded(kafka: &crate::demo::kafka::EmbeddedKafka, s: &Stream, topic: &str, format: crate::demo::formats::DemoFormat) -> anyhow::Result<usize> {
    let encoder = crate::demo::formats::Encoder::of(format, ORDER_AVSC, ORDER_PROTO, "Order")?;
    let mut bytes = 0;
    for (partition, value) in &s.records {
        let encoded = encoder.encode(value);
        bytes += encoded.len();
        kafka.send(rdkafka::producer::BaseRecord::<[u8], [u8]>::to(topic).partition(*partition).payload(&encoded))?;
    }
    kafka.flush()?;
    Ok(bytes / s.records.len().max(1))
}

/// The table form of run (1) reading `topic`, whose payloads are `format` with the schema in `schema_file` (an
/// absolute path).
pub(super) fn format_table_pipeline(topic: &str, format: crate::demo::formats::DemoFormat, schema_file: &std::path::Path) -> String {
    let head = match format {
        crate::demo::formats::DemoFormat::Protobuf => format!("format = \"protobuf\"\nschema_file = {:?}\nmessage = \"idemflow.bench.Order\"\n", schema_file),
        _ => format!("format = \"avro\"\nschema_file = {:?}\n", schema_file),
    };
    format!("{head}{}", table_pipeline(None).replace(&format!("topics = [\"{TOPIC}\"]"), &format!("topics = [\"{topic}\"]")))
}
