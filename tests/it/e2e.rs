//! The built `idemflow` binary, as a user runs it, against the Kafka mock cluster and a real Postgres, with the
//! shipped `pipelines/payments.toml` (the batch SQL form) and its per-record SQL form
//! `examples/per-record-sql/payments.toml`.

use crate::support::*;
use std::time::Duration;

const TOPIC: &str = "payments";
const PARTITIONS: i32 = 3;

struct Stream {
    records: Vec<Out>,
    /// (partition, kind) of every record, kind one of "new", "republished", "payload_mismatch".
    kinds: Vec<(i32, &'static str)>,
}

fn order(id: &str, account: &str, amount: &str) -> String {
    format!(
        r#"{{"order":{{"id":{id},"account":"{account}","amount":"{amount}","currency":"USD","details":{{"channel":"web","tags":["a","b"]}}}},"paid_at":"2026-11-29T10:00:00+01:00"}}"#
    )
}

fn stream() -> Stream {
    let mut records = Vec::new();
    let mut kinds = Vec::new();
    let mut originals = Vec::new();
    for i in 1..=30 {
        let p = i % PARTITIONS;
        let body = order(&format!("\"ORDERID_{i}\""), &format!("ACC-{}", i % 3 + 1), &format!("{}.{:02}", 100 + i, i));
        records.push(Out::json(p, body.clone()));
        kinds.push((p, "new"));
        originals.push((p, body));
    }
    // A numeric business key beyond f64's exact range, and an amount beyond f64's precision.
    records.push(Out::json(0, order("9007199254740993", "ACC-1", "100.000000000000000001")));
    kinds.push((0, "new"));
    // Producer retries: the same bytes again, same partition, new offsets.
    for (p, body) in &originals[..5] {
        records.push(Out::json(*p, body.clone()));
        kinds.push((*p, "republished"));
    }
    // The same order ids with another amount.
    for i in [6, 7] {
        let p = i % PARTITIONS;
        records.push(Out::json(p, order(&format!("\"ORDERID_{i}\""), &format!("ACC-{}", i % 3 + 1), "999.99")));
        kinds.push((p, "payload_mismatch"));
    }
    Stream { records, kinds }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_applies_each_payment_once_counts_duplicates_and_commits_offsets() {
    applies_each_payment_once("pipelines/payments.toml").await;
}

/// The same stream and checks through the per-record SQL form of the example (`sql`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_record_sql_example_applies_each_payment_once_counts_duplicates_and_commits_offsets() {
    applies_each_payment_once("examples/per-record-sql/payments.toml").await;
}

/// Runs the binary with the pipeline file `pipeline` (relative to the project root; it reads `payments` and writes
/// `pipelines/payments.sql`'s tables) over a stream of new, republished and mismatching payments, stops it, rewinds
/// a partition and runs it again: every payment applied once, exact, duplicates counted by reason.
async fn applies_each_payment_once(pipeline: &str) {
    let setup_sql = std::fs::read_to_string(project_root().join("pipelines/payments.sql")).unwrap()
        + "INSERT INTO accounts VALUES ('ACC-1', 1000000), ('ACC-2', 1000000), ('ACC-3', 1000000);";
    let db = TestDb::new(&setup_sql).await;
    let kafka = Kafka::new();
    kafka.create_topic(TOPIC, PARTITIONS);
    let shipped = std::fs::read_to_string(project_root().join(pipeline)).unwrap();
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &shipped)]);
    let s = stream();
    kafka.produce(TOPIC, &s.records);
    let total = s.records.len() as f64;

    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "check failed: {out}{err}");
    assert!(out.contains("pipeline \"payments\""), "{out}");
    // The mock cluster does not implement DescribeConfigs: check says it could not compare the retentions.
    assert!(out.contains("retention.ms"), "check compares [dedup] retention with the topics' retention: {out}");

    let mut worker = BinWorker::start(&setup);
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(60), "the worker to process every record", || async {
        metric(&worker.scrape(), "idemflow_records_received_total", &p) >= total
    })
    .await;
    let m = worker.scrape();
    let dup = |reason: &str| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), 31.0, "{}", worker.log_text());
    assert_eq!(dup("republished"), 5.0);
    assert_eq!(dup("payload_mismatch"), 2.0);
    assert_eq!(dup("redelivered"), 0.0, "pre-initialised to 0");
    assert!(m.contains("idemflow_batch_duration_seconds_bucket{pipeline=\"payments\""), "{m}");
    assert_eq!(http_get(worker.metrics, "/healthz").unwrap().0, 200);
    assert_eq!(http_get(worker.metrics, "/readyz").unwrap().0, 200);

    // Exactly one business row per order id, amounts exact, every deduction once.
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 31);
    assert_eq!(db.scalar::<i64>("SELECT count(DISTINCT order_id) FROM payments").await, 31);
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = '9007199254740993'").await, "100.000000000000000001");
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = 'ORDERID_6'").await, "106.06");
    assert!(db.scalar::<bool>("SELECT (SELECT sum(amount) FROM payments) = (SELECT sum(1000000 - balance) FROM accounts)").await);
    assert!(db.scalar::<bool>("SELECT paid_at = '2026-11-29T09:00:00Z' FROM payments WHERE order_id = 'ORDERID_1'").await);
    assert_eq!(db.scalar::<String>("SELECT details->'tags'->>1 FROM payments WHERE order_id = 'ORDERID_1'").await, "b");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'payments'").await, 31);

    let status = worker.sigterm();
    assert!(status.success(), "exit status {status:?}; log:\n{}", worker.log_text());
    let end = kafka.end_offsets(TOPIC, PARTITIONS);
    assert_eq!(kafka.committed("idemflow-payments", TOPIC, PARTITIONS), end, "{}", worker.log_text());

    // Redelivery: an operator rewinds partition 0 (as a lost offset commit would); every record there comes
    // back and is skipped, nothing is applied twice.
    kafka.set_committed("idemflow-payments", TOPIC, 0, 0);
    let in_p0 = |kind: &str| s.kinds.iter().filter(|(p, k)| *p == 0 && *k == kind).count() as f64;
    let mut worker = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the worker to reprocess partition 0", || async {
        metric(&worker.scrape(), "idemflow_records_received_total", &p) >= end[0] as f64
    })
    .await;
    let m = worker.scrape();
    let dup = |reason: &str| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), 0.0);
    // Every record of the partition was processed before: all are redeliveries, whatever their first delivery
    // was counted as (a replay must not move republished or payload_mismatch again).
    assert_eq!(dup("redelivered"), in_p0("new") + in_p0("republished") + in_p0("payload_mismatch"));
    assert_eq!(dup("republished"), 0.0);
    assert_eq!(dup("payload_mismatch"), 0.0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 31);
    assert!(db.scalar::<bool>("SELECT (SELECT sum(amount) FROM payments) = (SELECT sum(1000000 - balance) FROM accounts)").await);
    let status = worker.sigterm();
    assert!(status.success(), "exit status {status:?}; log:\n{}", worker.log_text());
    assert_eq!(kafka.committed("idemflow-payments", TOPIC, PARTITIONS), end);
}
