//! Retention of the dedup store: the sweep's slices and cursor, one replica at a time, by hand and in the worker.

use crate::support::*;
use std::time::Duration;

async fn insert_rows(db: &TestDb, pipeline: &str, n: i32, age: &str) {
    sqlx::query(
        "INSERT INTO idemflow.dedup (pipeline, key_id, key_text, topic, partition, \"offset\", fingerprint, applied_at) \
         SELECT $1, convert_to($3 || g, 'UTF8'), $3 || g, 't', 0, g, '\\x00000000000000000000000000000000', now() - $2::interval FROM generate_series(1, $4) g",
    )
    .bind(pipeline)
    .bind(age)
    .bind(format!("{age}-"))
    .bind(n)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// A sweep of pipeline `payments` by replica `owner`, a week's retention, slices of about 100 rows.
fn sweep<'a>(owner: &'a str, interval: Duration, pace: idemflow::retention::Pace) -> idemflow::retention::Sweep<'a> {
    idemflow::retention::Sweep { pipeline: "payments", owner, retention: Duration::from_secs(7 * 24 * 3600), rows: 100, interval, pace }
}

/// The sweep walks the heap in slices of about `rows` rows, each committed with its cursor: it resumes where the
/// last slice stopped (a restarted worker), leaves the pass to the replica that holds its lease (without waiting),
/// never waits for a row a batch holds (it is left for the next pass), ends its pass at the end of the table having
/// deleted exactly this pipeline's expired rows, and starts the next only `purge_interval` later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_expired_rows_slice_by_slice_resuming_at_its_cursor() {
    use idemflow::retention::{Pace, Skipped, Slice};
    use idemflow::store::postgres::retention::sweep_slice;
    let db = TestDb::new("").await;
    // About 20 rows to a block (a 300-byte key each), so 1,000 rows span about 50 blocks, expired and fresh mixed.
    for (pipeline, n, age) in [("payments", 600, "8 days"), ("payments", 300, "1 hour"), ("other", 100, "8 days")] {
        sqlx::query(
            "INSERT INTO idemflow.dedup (pipeline, key_id, key_text, topic, partition, \"offset\", fingerprint, applied_at) \
             SELECT $1, convert_to(left($3 || g || repeat('x', 64), 64), 'UTF8'), $3 || g || repeat('x', 300), 't', 0, g, '\\x00000000000000000000000000000000', now() - $2::interval \
             FROM generate_series(1, $4) g ORDER BY random()",
        )
        .bind(pipeline)
        .bind(age)
        .bind(format!("{pipeline}-{age}-"))
        .bind(n)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    sqlx::query("ANALYZE idemflow.dedup").execute(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO idemflow.dedup_duplicates SELECT pipeline, key_id, applied_at, 1, now() FROM idemflow.dedup").execute(&db.pool).await.unwrap();
    let paced = Pace::RowsPerSecond(1_000_000);
    let (a, b) = (sweep("replica-a", Duration::ZERO, paced), sweep("replica-b", Duration::ZERO, paced));
    let cursor = || db.scalar::<i64>("SELECT next_block FROM idemflow.retention_sweeps WHERE pipeline = 'payments'");

    let first = sweep_slice(&db.pool, &a, false).await.unwrap();
    assert!(first.examined >= 50 && first.examined <= 200 && first.pass_seconds.is_none(), "{first:?}");
    let after_first = cursor().await;
    assert!(after_first >= 3, "the cursor moved past the slice: {after_first}");
    // A restarted worker's next slice starts at the stored cursor, not at the first block.
    let second = sweep_slice(&db.pool, &a, false).await.unwrap();
    assert!(second.pass_seconds.is_none(), "{second:?}");
    assert_eq!(cursor().await, 2 * after_first, "the second slice began where the first ended");

    // Another replica, while replica-a's lease on the pass holds: it leaves the pass alone.
    let other = sweep_slice(&db.pool, &b, false).await.unwrap();
    assert_eq!((other.skipped, other.examined), (Some(Skipped::OtherReplica), 0), "{other:?}");
    assert_eq!(cursor().await, 2 * after_first);

    // Another replica's slice holds the cursor at this moment: this one skips at once, deleting nothing.
    let before = db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await;
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idemflow.retention_sweeps WHERE pipeline = 'payments' FOR UPDATE").execute(&mut *holder).await.unwrap();
    let started = std::time::Instant::now();
    let skipped = sweep_slice(&db.pool, &a, false).await.unwrap();
    assert!(skipped.skipped == Some(Skipped::OtherReplica) && skipped.purged == 0 && skipped.examined == 0, "{skipped:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "it did not wait for the other replica");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, before);
    holder.rollback().await.unwrap();

    // Another transaction holds an expired row (`idemflow dedup forget` reading it, say): the sweep neither waits
    // for it nor deletes it under that transaction; the row is left for the next pass.
    let mut batch = db.pool.begin().await.unwrap();
    let held: String = sqlx::query_scalar(
        "SELECT key_text FROM idemflow.dedup WHERE pipeline = 'payments' AND applied_at < now() - interval '7 days' \
         ORDER BY ctid DESC LIMIT 1 FOR UPDATE",
    )
    .fetch_one(&mut *batch)
    .await
    .unwrap();

    // The rest of the pass, through the store as the worker runs it: slice by slice to the end of the table.
    let store = idemflow::store::Store::Postgres(db.pool.clone());
    let mut slices: Vec<Slice> = Vec::new();
    let started = std::time::Instant::now();
    let o = store.sweep_pass(&a, |s| slices.push(*s)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(10), "the sweep did not wait for the batch");
    assert!(o.pass_seconds.is_some() && o.skipped.is_none() && slices.len() >= 5, "{o:?} {slices:?}");
    assert_eq!(o.purged, slices.iter().map(|s| s.purged).sum::<u64>(), "each committed slice is reported as it goes");
    assert_eq!(first.purged + second.purged + o.purged, 599, "every expired row of the pipeline but the held one, once");
    batch.rollback().await.unwrap();
    let kept = format!("SELECT count(*) FROM idemflow.dedup WHERE key_text = '{held}'");
    assert_eq!(db.scalar::<i64>(&kept).await, 1);
    // Each row's duplicate count went with it, and only with it.
    let orphans = "SELECT count(*) FROM idemflow.dedup_duplicates c WHERE NOT EXISTS \
                   (SELECT FROM idemflow.dedup d WHERE (d.pipeline, d.key_id, d.applied_at) = (c.pipeline, c.key_id, c.applied_at))";
    assert_eq!(db.scalar::<i64>(orphans).await, 0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup_duplicates").await, 401, "the held row's, the fresh and the other pipeline's");
    assert_eq!(first.examined + second.examined + o.examined, 1000, "every row of the table examined once");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'payments'").await, 301, "the fresh rows stay");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'other'").await, 100, "other pipelines untouched");
    assert_eq!(cursor().await, 0, "the next pass starts at the first block");
    assert_eq!(db.scalar::<i64>("SELECT passes FROM idemflow.retention_sweeps WHERE pipeline = 'payments'").await, 1);
    assert_eq!(db.scalar::<Option<String>>("SELECT owner FROM idemflow.retention_sweeps WHERE pipeline = 'payments'").await, None, "the lease is freed");

    // The next pass is due `purge_interval` after this one ended, whichever replica asks.
    let hourly = sweep("replica-b", Duration::from_secs(3600), paced);
    let early = sweep_slice(&db.pool, &hourly, false).await.unwrap();
    assert_eq!((early.skipped, early.examined), (Some(Skipped::NotDue), 0), "{early:?}");
    // `idemflow purge`'s pass takes the pass over and starts from the first block, due or not.
    let by_hand = sweep("idemflow purge/1", Duration::from_secs(3600), Pace::FromStartAtOnce);
    let o = store.sweep_pass(&by_hand, |_| {}).await.unwrap();
    assert_eq!((o.purged, o.examined, o.skipped), (1, 401, None), "the row the batch held, now: {o:?}");
    assert_eq!(db.scalar::<i64>(&kept).await, 0);
}

/// Before PostgreSQL 14 (no TID range scans) a slice is a range of the pipeline's primary key, as on MySQL: the
/// statement examines the next `rows` keys after the cursor, returns the last, and deletes the expired among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_postgresql_14_a_slice_is_a_range_of_the_primary_key() {
    use idemflow::store::postgres::retention::key_range_slice;
    let db = TestDb::new("").await;
    sqlx::query(
        "INSERT INTO idemflow.dedup (pipeline, key_id, key_text, topic, partition, \"offset\", fingerprint, applied_at) \
         SELECT p, convert_to('k' || g, 'UTF8'), 'k' || g, 't', 0, g, '\\x00000000000000000000000000000000', now() - CASE WHEN g = 3 THEN interval '1 hour' ELSE interval '8 days' END \
         FROM generate_series(1, 7) g, (VALUES ('p'), ('q')) AS ps(p) ORDER BY random()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Every key had duplicates: the counts go with their rows, the fresh key's and the other pipeline's stay.
    sqlx::query("INSERT INTO idemflow.dedup_duplicates SELECT pipeline, key_id, applied_at, 1, now() FROM idemflow.dedup").execute(&db.pool).await.unwrap();
    let week = Duration::from_secs(7 * 24 * 3600);
    let (examined, last, purged) = key_range_slice(&db.pool, "p", 3, week, None).await.unwrap();
    assert_eq!((examined, last.as_deref(), purged), (3, Some(&b"k3"[..]), 2), "k1, k2 and the fresh k3");
    let (examined, last, purged) = key_range_slice(&db.pool, "p", 3, week, Some(b"k3")).await.unwrap();
    assert_eq!((examined, last.as_deref(), purged), (3, Some(&b"k6"[..]), 3));
    let (examined, last, purged) = key_range_slice(&db.pool, "p", 3, week, Some(b"k6")).await.unwrap();
    assert_eq!((examined, last.as_deref(), purged), (1, Some(&b"k7"[..]), 1), "fewer than asked: the pass ends");
    assert_eq!(db.scalar::<String>("SELECT string_agg(pipeline || ':' || key_text, ',' ORDER BY pipeline, key_id) FROM idemflow.dedup WHERE pipeline = 'p'").await, "p:k3");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'q'").await, 7, "another pipeline's keys untouched");
    assert_eq!(
        db.scalar::<String>("SELECT string_agg(pipeline || ':' || convert_from(key_id, 'UTF8'), ',' ORDER BY pipeline, key_id) FROM idemflow.dedup_duplicates WHERE pipeline = 'p'").await,
        "p:k3"
    );
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup_duplicates WHERE pipeline = 'q'").await, 7);
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
    // The sweep's own figures: the rows it looked at, its passes and how long the last one took.
    assert!(w.metric("idemflow_retention_rows_examined_total", &[("pipeline", "orders")]) >= 2.0);
    assert!(w.metric("idemflow_retention_passes_total", &[("pipeline", "orders")]) >= 1.0);
    assert!(w.metric("idemflow_retention_pass_seconds", &[("pipeline", "orders")]) >= 0.0);
    // `check` says how long the rows live: the retention, plus the last pass and purge_interval.
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("pipeline \"orders\": dedup rows live at least 1s and at most 2s"), "{out}");
    kafka.produce("orders", &[Out::json(0, r#"{"id":"a"}"#)]);
    w.wait_received("orders", 3).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM seen WHERE k = 'a'").await, 2, "applied again after expiry");
}

/// A pipeline `orders` swept in slices of about 40 rows, at most 400 rows a second (a pass over its 4,000 dedup rows
/// takes about 10 s), three in four of them older than its retention of a day.
async fn mid_sweep_fixture() -> (TestDb, Kafka, Setup) {
    let p = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = \"/id\"\n\
             [dedup]\nretention = \"1d\"\npurge_interval = \"100ms\"\npurge_batch = 40\npurge_rate = 400\n";
    let (db, kafka, setup) = fixture("CREATE TABLE seen (k text);", "orders", 1, &[("orders.toml", p)]).await;
    sqlx::query(
        "INSERT INTO idemflow.dedup (pipeline, key_id, key_text, topic, partition, \"offset\", fingerprint, applied_at) \
         SELECT 'orders', convert_to('k' || g, 'UTF8'), 'k' || g || repeat('x', 60), 't', 0, g, '\\x00000000000000000000000000000000', \
                now() - CASE WHEN g % 4 = 0 THEN interval '1 hour' ELSE interval '2 days' END \
         FROM generate_series(1, 4000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE idemflow.dedup").execute(&db.pool).await.unwrap();
    (db, kafka, setup)
}

/// A worker stopped (SIGTERM) in the middle of a pass gives up its lease as it stops, the cursor kept: another
/// replica takes the pass over where it stopped at its next try, not after the lease (40 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_mid_sweep_hands_the_pass_over_at_once() {
    let (db, _kafka, setup) = mid_sweep_fixture().await;
    let cursor = || db.scalar::<Option<i64>>("SELECT max(next_block) FROM idemflow.retention_sweeps WHERE pipeline = 'orders'");
    let leased = || db.scalar::<bool>("SELECT lease_until IS NOT NULL FROM idemflow.retention_sweeps WHERE pipeline = 'orders'");

    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the sweep to be part way through its pass", || async { cursor().await.unwrap_or(0) >= 10 }).await;
    assert!(leased().await, "the pass is leased while it runs");
    assert!(w.sigterm().success(), "{}", w.log_text());
    let at_stop = cursor().await.unwrap();
    assert!(!leased().await, "the lease given up as the worker stopped: {}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT passes FROM idemflow.retention_sweeps WHERE pipeline = 'orders'").await, 0, "the pass is still under way");

    let stopped_at = std::time::Instant::now();
    let _w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(20), "the new worker to take the pass over", || async { cursor().await.unwrap_or(0) != at_stop }).await;
    assert!(stopped_at.elapsed() < Duration::from_secs(20), "taken over before the lease (40 s) ran out: {:?}", stopped_at.elapsed());
    assert!(cursor().await.unwrap() > at_stop, "went on from the stored cursor ({at_stop}), not from the first block");
    wait_until(Duration::from_secs(60), "the pass to end", || async {
        db.scalar::<i64>("SELECT passes FROM idemflow.retention_sweeps WHERE pipeline = 'orders'").await >= 1
    })
    .await;
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 1000, "every fresh row kept, every expired one gone");
}

/// The worker's sweep, SIGKILLed in the middle of a pass: nothing it had not committed is lost or done early, and
/// the restarted worker, once the killed one's lease on the pass has run out, goes on from the stored cursor instead
/// of starting the pass again; the pass then ends with every expired row deleted and every fresh one kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_sweep_resumes_at_the_stored_cursor() {
    let (db, _kafka, setup) = mid_sweep_fixture().await;
    let cursor = || db.scalar::<Option<i64>>("SELECT max(next_block) FROM idemflow.retention_sweeps WHERE pipeline = 'orders'");

    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the sweep to be part way through its pass", || async { cursor().await.unwrap_or(0) >= 10 }).await;
    w.kill();
    let at_kill = cursor().await.unwrap();
    let remaining = db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await;
    assert!(remaining < 4000 && remaining > 1000, "part of the expired rows deleted: {remaining}");
    assert_eq!(db.scalar::<i64>("SELECT passes FROM idemflow.retention_sweeps WHERE pipeline = 'orders'").await, 0);

    // The restarted worker is another replica to the sweep: it takes the pass over once the killed one's lease has
    // run out (10 pauses of 0.1 s and 30 s), not before.
    let killed_at = std::time::Instant::now();
    let _w = BinWorker::start(&setup);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(cursor().await.unwrap(), at_kill, "the pass is the killed worker's until its lease runs out");
    wait_until(Duration::from_secs(60), "the restarted sweep to move on", || async { cursor().await.unwrap_or(0) != at_kill }).await;
    assert!(killed_at.elapsed() >= Duration::from_secs(25), "taken over after the lease: {:?}", killed_at.elapsed());
    assert!(cursor().await.unwrap() > at_kill, "went on from the stored cursor ({at_kill}), not from the first block");
    wait_until(Duration::from_secs(60), "the pass to end", || async {
        db.scalar::<i64>("SELECT passes FROM idemflow.retention_sweeps WHERE pipeline = 'orders'").await >= 1
    })
    .await;
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE applied_at < now() - interval '1 day'").await, 0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 1000, "every fresh row kept");
}
