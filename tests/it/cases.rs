//! The real-world cases (the team's collection of production reports, kept outside this repository), each written
//! out here as one named test with the input it describes and the outcome it expects.
//!
//! Common fixture (from the cases' README): pipeline `payments`, topic `orders`, business key `/order/id`, side
//! effect one row in `payments(order_id text, amount numeric, paid_at timestamptz)`.

use crate::support::*;
use std::time::Duration;

const TABLE: &str = "CREATE TABLE payments (order_id text NOT NULL, amount numeric, paid_at timestamptz, currency text);";

fn pipeline(extra_top: &str, sql: &str) -> String {
    format!(
        r#"topics = ["orders"]
{extra_top}
[key]
field = "/order/id"
[sink]
sql = [{sql}]
[sink.params]
order_id = "/order/id"
amount = {{ field = "/order/amount", optional = true }}
paid_at = {{ field = "/paid_at", optional = true }}
"#
    )
}

const INSERT: &str = r#""INSERT INTO payments (order_id, amount, paid_at) VALUES (:order_id, :amount, :paid_at)""#;

fn order(id: &str, amount: &str) -> String {
    format!(r#"{{"order":{{"id":"{id}","amount":"{amount}"}}}}"#)
}

async fn rows_per_key(db: &TestDb) -> (i64, i64) {
    (
        db.scalar::<i64>("SELECT count(*) FROM payments").await,
        db.scalar::<i64>("SELECT count(DISTINCT order_id) FROM payments").await,
    )
}

fn dup(text: &str, reason: &str) -> f64 {
    metric(text, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)])
}

fn received(text: &str) -> f64 {
    metric(text, "idemflow_records_received_total", &[("pipeline", "payments")])
}

async fn wait_scrape(w: &BinWorker, what: &str, check: impl Fn(&str) -> bool) {
    wait_until(Duration::from_secs(60), what, || async { check(&w.scrape()) }).await;
}

/// c01: a rebalance while a slow batch is in flight. Worker A sleeps 3 s inside the side effect of o-1 (partition
/// 0); worker B joins during the sleep. Exactly one row for o-1; partition 1's committed offset never moves back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c01_rebalance_mid_batch() {
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 2);
    let sql = format!(r#"{INSERT}, "SELECT pg_sleep(CASE WHEN :order_id = 'o-1' THEN 3 ELSE 0 END)""#);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &pipeline("", &sql))]);
    kafka.produce("orders", &[Out::json(1, order("p1-a", "1")), Out::json(1, order("p1-b", "1"))]);
    let mut a = BinWorker::start(&setup);
    wait_scrape(&a, "A to apply partition 1", |m| received(m) >= 2.0).await;
    let p1_before = kafka.committed("idemflow-payments", "orders", 2)[1];
    kafka.produce("orders", &[Out::json(0, r#"{"order":{"id":"o-1","amount":"10.00"}}"#)]);
    tokio::time::sleep(Duration::from_millis(800)).await; // A is now inside pg_sleep(3)
    let setup_b = Setup::new(&db, &kafka, &[("payments.toml", &pipeline("", &sql))]);
    let mut b = BinWorker::start(&setup_b);
    let mut p1_seen = vec![p1_before];
    for _ in 0..40 {
        p1_seen.push(kafka.committed("idemflow-payments", "orders", 2)[1]);
        if db.scalar::<i64>("SELECT count(*) FROM payments WHERE order_id = 'o-1'").await == 1 && p1_seen.len() > 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    kafka.produce("orders", &[Out::json(0, order("o-1", "10.00")), Out::json(1, order("p1-c", "1"))]);
    wait_until(Duration::from_secs(60), "every record applied or skipped", || async {
        db.scalar::<i64>("SELECT count(*) FROM payments WHERE order_id = 'p1-c'").await == 1
            && db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await == 4
    })
    .await;
    let (a_status, b_status) = (a.sigterm(), b.sigterm());
    assert!(a_status.success() && b_status.success(), "A log:\n{}\nB log:\n{}", a.log_text(), b.log_text());
    p1_seen.push(kafka.committed("idemflow-payments", "orders", 2)[1]);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments WHERE order_id = 'o-1'").await, 1);
    assert_eq!(rows_per_key(&db).await, (4, 4));
    assert!(p1_seen.windows(2).all(|w| w[0] <= w[1]), "partition 1's committed offset moved backwards: {p1_seen:?}");
    assert_eq!(kafka.committed("idemflow-payments", "orders", 2), kafka.end_offsets("orders", 2));
}

/// c02: the batch outlives the worker's group membership, so partition 0 is revoked before the transaction commits.
/// (The consumer keeps polling while a batch is in its transaction, so a slow side effect alone no longer costs the
/// membership: the worker process is frozen with SIGSTOP for longer than `session.timeout.ms` while its slow batch
/// runs, as a VM pause or a stop-the-world stall would.) The late offset commit is refused and counted, never a
/// panic; the worker rejoins, resumes from the group's committed offset, skips record 41 as `redelivered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c02_stale_offset_after_revoke() {
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let sql = format!(r#"{INSERT}, "SELECT pg_sleep(CASE WHEN :order_id = 'o-41' THEN 5 ELSE 0 END)""#);
    let props = "\"session.timeout.ms\" = \"3000\"\n\"heartbeat.interval.ms\" = \"300\"\n\"max.poll.interval.ms\" = \"3000\"";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("", &sql))], props, "");
    let first: Vec<Out> = (0..41).map(|i| Out::json(0, order(&format!("o-{i}"), "1"))).collect();
    kafka.produce("orders", &first);
    let mut w = BinWorker::start(&setup);
    wait_scrape(&w, "records 0..40 applied", |m| received(m) >= 41.0).await;
    kafka.produce("orders", &[Out::json(0, order("o-41", "1"))]);
    wait_until(Duration::from_secs(30), "o-41's batch in its transaction", || async {
        db.scalar::<i64>("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep%' AND state = 'active' AND pid <> pg_backend_pid()").await == 1
    })
    .await;
    w.signal("STOP");
    // Three times the session timeout: the mock coordinator checks sessions on a timer of its own, and on a busy
    // machine a stop of barely more than the timeout did not always get the member expired.
    tokio::time::sleep(Duration::from_secs(9)).await;
    w.signal("CONT");
    wait_scrape(&w, "o-41 redelivered after the rejoin", |m| dup(m, "redelivered") >= 1.0).await;
    let m = w.scrape();
    let refused = metric(&m, "idemflow_offset_commits_total", &[("pipeline", "payments"), ("result", "error")])
        + metric(&m, "idemflow_offset_commits_total", &[("pipeline", "payments"), ("result", "skipped_not_owned")]);
    assert!(refused >= 1.0, "the late commit must be refused and counted:\n{m}\n{}", w.log_text());
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(!w.log_text().contains("panicked"));
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments WHERE order_id = 'o-41'").await, 1);
    assert_eq!(rows_per_key(&db).await, (42, 42));
    assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![42]);
}

/// c03: a clean restart must not replay the last record; after SIGKILL right after the database commit, o-3 may
/// come back and is skipped as `redelivered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c03_clean_restart() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("", INSERT))]).await;
    kafka.produce("orders", &["o-1", "o-2", "o-3"].map(|id| Out::json(0, order(id, "1"))));
    let mut w = BinWorker::start(&setup);
    wait_scrape(&w, "three records", |m| received(m) >= 3.0).await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![3]);
    let w = BinWorker::start(&setup);
    wait_scrape(&w, "the restarted worker to serve metrics", |m| m.contains("idemflow_records_received_total")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = w.scrape();
    assert_eq!(received(&m), 0.0, "nothing is redelivered after a clean stop");
    for reason in ["redelivered", "republished", "payload_mismatch"] {
        assert_eq!(dup(&m, reason), 0.0);
    }
    drop(w);

    // Variant: SIGKILL as soon as the rows are committed, before the offset commit can be relied on.
    kafka.produce("orders", &["o-4", "o-5"].map(|id| Out::json(0, order(id, "1"))));
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "o-5 committed", || async {
        db.scalar::<i64>("SELECT count(*) FROM payments WHERE order_id = 'o-5'").await == 1
    })
    .await;
    w.kill();
    let w = BinWorker::start(&setup);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "payments")]), 0.0);
    assert_eq!(received(&m), dup(&m, "redelivered"), "whatever came back was skipped as redelivered");
    assert_eq!(rows_per_key(&db).await, (5, 5));
}

/// c06: the side effect fails transiently after the dedup row was written (the connection dies while the insert
/// waits on a lock). The attempt rolls back both; the retry applies o-9 once; no duplicate is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c06_side_effect_fails_after_claim() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("", INSERT))]).await;
    let w = InProc::start(&setup).await;
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE payments IN ACCESS EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    kafka.produce("orders", &[Out::json(0, order("o-9", "9"))]);
    // Wait until the worker's transaction has claimed o-9 and is blocked on the business table, then kill it.
    wait_until(Duration::from_secs(30), "the worker to block on the lock", || async {
        db.scalar::<i64>("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'").await >= 1
    })
    .await;
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")
        .execute(&db.pool)
        .await
        .unwrap();
    lock.rollback().await.unwrap();
    w.wait_received("payments", 1).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
    for reason in ["redelivered", "republished", "payload_mismatch"] {
        assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]), 0.0);
    }
    assert_eq!(w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "unavailable")]), 1.0, "57P01");
    assert!(w.stop().await.is_empty());
    assert_eq!(rows_per_key(&db).await, (1, 1));
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0);
}

/// c09: keys longer than a btree entry allows (300 and 5,000 random characters, 5,000 copies of "a"), each twice,
/// then o-1: each key deduplicated exactly, o-1 applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c09_long_keys() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("", INSERT))]).await;
    let keys = [random_text(300, 7), random_text(5000, 8), "a".repeat(5000)];
    let mut records: Vec<Out> = keys.iter().map(|k| Out::json(0, order(k, "1"))).collect();
    records.extend(records.clone());
    records.push(Out::json(0, order("o-1", "1")));
    kafka.produce("orders", &records);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 7).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 4.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "republished")]), 3.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "key_invalid")]), 0.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(rows_per_key(&db).await, (4, 4));

    // With a configured key limit, over-long keys are dead-lettered as key_invalid; o-2 still goes through.
    let db = TestDb::new(TABLE).await;
    let limited = pipeline("", INSERT).replace("field = \"/order/id\"", "field = \"/order/id\"\nmax_bytes = 1000");
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &limited)]);
    kafka.produce("orders", &[Out::json(0, order(&keys[1], "1")), Out::json(0, order("o-2", "1"))]);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 2).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "key_invalid")]), 1.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(rows_per_key(&db).await, (1, 1));
    assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![2]);
}

/// c10: U+0000 in a key, a lone surrogate in a value: one rule for keys and values, no retry loop, o-3 applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c10_nul_and_bad_unicode() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("", INSERT))]).await;
    kafka.produce(
        "orders",
        &[
            Out::json(0, r#"{"order":{"id":"A\u0000B","amount":"1"}}"#),
            Out::json(0, r#"{"order":{"id":"o-2","note":"\ud800","amount":"2"}}"#),
            Out::json(0, r#"{"order":{"id":"o-3","amount":"3"}}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 3).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "key_invalid")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 1.0);
    assert_eq!(w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "connection")]), 0.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',') FROM payments").await, "o-3");
    let errors: String = db.scalar("SELECT string_agg(reason || ': ' || error, E'\\n' ORDER BY \"offset\") FROM idemflow.dead_letters").await;
    assert!(errors.contains("key_invalid: business key /order/id contains U+0000") && errors.contains("decode_failed: payload is not valid JSON"), "{errors}");
    assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![3]);
}

/// c11: missing, null and empty keys go to the dead letters as `key_missing`; no NULL reaches the dedup table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c11_missing_null_empty_key() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("", INSERT))]).await;
    let bodies = [r#"{"order":{}}"#, r#"{"order":{}}"#, r#"{"order":{"id":null}}"#, r#"{"order":{"id":null}}"#, r#"{"order":{"id":""}}"#, r#"{"order":{"id":""}}"#];
    kafka.produce("orders", &bodies.map(|b| Out::json(0, b)));
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 6).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "key_missing")]), 6.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 0);
    assert!(db.scalar::<bool>("SELECT attnotnull FROM pg_attribute WHERE attrelid = 'idemflow.dedup'::regclass AND attname = 'key_id'").await);
}

/// c14: a 200-level-deep document is dead-lettered (`decode_failed`), an oversized payload is rejected by the
/// configured maximum before parsing, o-2 is applied. (3 MB instead of the case's 50 MB: the mock cluster keeps
/// at most about 5 MiB per partition.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c14_deep_nesting_and_huge_payloads() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("max_payload_bytes = 1048576", INSERT))]).await;
    let deep = format!(r#"{{"order":{{"id":"o-1","amount":"1","meta":{}1{}}}}}"#, "[".repeat(200), "]".repeat(200));
    let huge = format!("{}{}", "[".repeat(1_500_000), "]".repeat(1_500_000));
    kafka.produce("orders", &[Out::json(0, deep), Out::json(0, huge), Out::json(0, order("o-2", "2"))]);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 3).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "payload_too_large")]), 1.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',') FROM payments").await, "o-2");
}

/// c16: a tombstone is skipped and counted (no dedup row), an empty value is `decode_failed`, o-2 is applied and
/// the offsets move past all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c16_tombstones_and_empty_values() {
    let (db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("", INSERT))]).await;
    kafka.produce(
        "orders",
        &[
            Out { partition: 0, key: Some(b"o-1".to_vec()), ..Out::default() },
            Out { partition: 0, key: Some(b"o-1".to_vec()), value: Some(Vec::new()), ..Out::default() },
            Out::json(0, r#"{"order":{"id":"o-2"}}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 3).await;
    assert_eq!(w.metric("idemflow_tombstones_skipped_total", &[("pipeline", "payments")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 1.0);
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',') FROM payments").await, "o-2");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 1);
    assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![3]);

    // Configured to dead-letter tombstones instead.
    let (_db, kafka, setup) = fixture(TABLE, "orders", 1, &[("payments.toml", &pipeline("tombstones = \"dead_letter\"", INSERT))]).await;
    kafka.produce("orders", &[Out { partition: 0, key: Some(b"o-1".to_vec()), ..Out::default() }]);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 1).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "tombstone")]), 1.0);
    assert!(w.stop().await.is_empty());
}

/// c17: the payload shape drifts. A missing optional value binds NULL or its default; a missing required one is
/// dead-lettered naming the field; a value Postgres cannot cast is dead-lettered with its SQLSTATE; later records
/// are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c17_schema_drift() {
    let db = TestDb::new(TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let p = r#"topics = ["orders"]
[key]
field = "/order/id"
[sink]
sql = "INSERT INTO payments (order_id, amount, currency) VALUES (:order_id, :amount, :currency)"
[sink.params]
order_id = "/order/id"
amount = "/order/amount"
currency = { field = "/order/currency", default = "EUR" }
"#;
    let setup = Setup::new(&db, &kafka, &[("payments.toml", p)]);
    kafka.produce(
        "orders",
        &[
            Out::json(0, r#"{"order":{"id":"old","amount":"1.00"}}"#),
            Out::json(0, r#"{"order":{"id":"new","amount":{"value":"5.00","unit":"EUR"}}}"#),
            Out::json(0, r#"{"order":{"id":"none"}}"#),
            Out::json(0, r#"{"order":{"id":"later","amount":"2.00","currency":"USD"}}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 4).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id || '=' || currency, ',' ORDER BY order_id) FROM payments").await, "later=USD,old=EUR");
    let e: String = db.scalar("SELECT error FROM idemflow.dead_letters WHERE reason = 'side_effect_rejected'").await;
    assert!(e.contains("SQLSTATE 22P02"), "{e}");
    let e: String = db.scalar("SELECT error FROM idemflow.dead_letters WHERE reason = 'param_missing'").await;
    assert!(e.contains("/order/amount"), "{e}");
}

/// c18: a poison pill does not block its partition: dead-lettered, offset committed, o-2 applied. Contrast: while
/// Postgres is down nothing is dead-lettered; the worker retries with backoff and applies the record afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c18_poison_pill() {
    let cluster = postgres::Cluster::start().unwrap();
    let db = TestDb::on(&cluster.url(), TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &pipeline("", INSERT))]);
    kafka.produce("orders", &[Out::json(0, "not json"), Out::json(0, order("o-2", "2"))]);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 2).await;
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 1.0);
    assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![2]);

    db.pool.close().await;
    cluster.stop().unwrap();
    kafka.produce("orders", &[Out::json(0, order("o-3", "3"))]);
    wait_until(Duration::from_secs(30), "retries while Postgres is down", || async {
        ["connection", "pool_timeout", "unavailable"].iter().map(|c| w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)])).sum::<f64>() >= 2.0
    })
    .await;
    assert_eq!(w.metric("idemflow_records_received_total", &[("pipeline", "payments")]), 2.0);
    let dead_total: f64 = ["decode_failed", "key_missing", "side_effect_rejected", "param_missing"]
        .iter()
        .map(|r| w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", r)]))
        .sum();
    assert_eq!(dead_total, 1.0, "an outage dead-letters nothing");
    cluster.start_again().unwrap();
    w.wait_received("payments", 3).await;
    assert!(w.stop().await.is_empty());
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',' ORDER BY order_id) FROM payments").await, "o-2,o-3");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1);
}

/// c21: a pool of one connection (and of two) with 8 partitions and two pipelines competing for it: no deadlock,
/// pool timeouts are retries, every record applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c21_small_connection_pool() {
    for pool_size in [1, 2] {
        let db = TestDb::new(&format!("{TABLE} CREATE TABLE payments_b (LIKE payments);")).await;
        let kafka = Kafka::new();
        kafka.create_topic("orders", 8);
        let slow = format!(r#"{INSERT}, "SELECT pg_sleep(0.002)""#);
        let b = pipeline("", &slow.replace("INTO payments", "INTO payments_b"));
        let extra = format!("[database]\nmax_connections = {pool_size}\nacquire_timeout = \"100ms\"");
        let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline("", &slow)), ("b.toml", &b)], "", "");
        // Replace the pool settings written by Setup.
        let text = std::fs::read_to_string(&setup.config).unwrap();
        let text = text.replace("max_connections = 4\nacquire_timeout = \"2s\"", &extra.replace("[database]\n", ""));
        std::fs::write(&setup.config, text).unwrap();
        let records: Vec<Out> = (0..2000).map(|i| Out::json(i % 8, order(&format!("o-{i}"), "1"))).collect();
        kafka.produce("orders", &records);
        let w = InProc::start(&setup).await;
        w.wait_received("payments", 2000).await;
        w.wait_received("b", 2000).await;
        assert!(w.stop().await.is_empty());
        assert_eq!(rows_per_key(&db).await, (2000, 2000), "pool size {pool_size}");
        assert_eq!(db.scalar::<i64>("SELECT count(DISTINCT order_id) FROM payments_b").await, 2000);
        assert_eq!(kafka.committed("idemflow-payments", "orders", 8), kafka.end_offsets("orders", 8));
    }
}
