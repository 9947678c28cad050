//! Retention of the dedup store: bounded batches, one replica at a time, by hand and on the worker's interval.

use crate::support::*;
use std::time::Duration;

async fn insert_rows(db: &TestDb, pipeline: &str, n: i32, age: &str) {
    sqlx::query(
        "INSERT INTO idemflow.dedup (pipeline, key_id, business_key, topic, partition, \"offset\", fingerprint, applied_at) \
         SELECT $1, convert_to($3 || g, 'UTF8'), $3 || g, 't', 0, g, '\\x00', now() - $2::interval FROM generate_series(1, $4) g",
    )
    .bind(pipeline)
    .bind(age)
    .bind(format!("{age}-"))
    .bind(n)
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_expired_rows_in_bounded_batches_one_replica_at_a_time() {
    let db = TestDb::new("").await;
    insert_rows(&db, "payments", 10, "8 days").await;
    insert_rows(&db, "payments", 3, "1 hour").await;
    insert_rows(&db, "other", 5, "8 days").await;
    let week = Duration::from_secs(7 * 24 * 3600);
    let mut batches = Vec::new();

    // Another replica holds the pipeline's purge lock: this one skips, it does not wait.
    let mut other: sqlx::PgConnection = sqlx::Connection::connect(&db.url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1, hashtext('payments'))").bind(0x1de_f10).execute(&mut other).await.unwrap();
    let o = idemflow::store::postgres::retention::purge(&db.pool, "payments", week, 3, |n| batches.push(n)).await.unwrap();
    assert!(o.skipped_locked && o.purged == 0, "{o:?}");
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext('payments'))").bind(0x1de_f10).execute(&mut other).await.unwrap();

    let o = idemflow::store::postgres::retention::purge(&db.pool, "payments", week, 3, |n| batches.push(n)).await.unwrap();
    assert_eq!((o.purged, o.batches, o.skipped_locked), (10, 4, false), "10 rows in batches of 3");
    // Each committed batch is reported as it goes (the worker's idemflow_dedup_rows_purged_total moves with each).
    assert_eq!(batches, vec![3, 3, 3, 1]);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'payments'").await, 3);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'other'").await, 5, "other pipelines untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_command_runs_one_pass() {
    let db = TestDb::new("CREATE TABLE seen (k text);").await;
    insert_rows(&db, "events", 4, "2 hours").await;
    insert_rows(&db, "events", 2, "1 minute").await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("pipelines")).unwrap();
    std::fs::write(
        dir.path().join("pipelines/events.toml"),
        "topics = [\"events\"]\n[key]\nrecord_key = true\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = { record_key = true }\n[dedup]\nretention = \"1h\"\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("idemflow.toml"), format!("[database]\nurl = \"{}\"\n[kafka]\nbootstrap_servers = \"127.0.0.1:1\"\n", db.url)).unwrap();
    let (status, out, err) = idemflow(&["purge", "--config", "idemflow.toml"], dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("pipeline \"events\": purged 4 dedup rows older than 1h"), "{out}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 2);
    let (status, _, err) = idemflow(&["purge", "--config", "idemflow.toml", "--pipeline", "nope"], dir.path());
    assert!(!status.success() && err.contains("no pipeline named \"nope\""), "{err}");
}

/// The worker purges on its interval; a record redelivered after its row expired is applied again, which is why
/// retention must cover the redelivery window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_purges_on_its_interval() {
    let p = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = \"/id\"\n\
             [dedup]\nretention = \"1s\"\npurge_interval = \"300ms\"\n";
    let (db, kafka, setup) = fixture("CREATE TABLE seen (k text);", "orders", 1, &[("orders.toml", p)]).await;
    kafka.produce("orders", &[Out::json(0, r#"{"id":"a"}"#), Out::json(0, r#"{"id":"b"}"#)]);
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 2).await;
    wait_until(Duration::from_secs(30), "the expired rows to be purged", || async {
        w.metric("idemflow_dedup_rows_purged_total", &[("pipeline", "orders")]) >= 2.0
    })
    .await;
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 0);
    kafka.produce("orders", &[Out::json(0, r#"{"id":"a"}"#)]);
    w.wait_received("orders", 3).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM seen WHERE k = 'a'").await, 2, "applied again after expiry");
}
