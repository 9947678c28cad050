//! Scale-out: several worker processes in one consumer group share the partitions, and Postgres is the shared
//! truth, so members can die and come back while the stream flows without any operation taking effect twice.

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, shipped, wait_all_durable_or_report, Rng};
use crate::support::*;
use std::time::Duration;

/// Three worker processes against the mock cluster; the stream is produced in six parts while they run, with
/// the same operations republished to other partitions (so two members can hold the same business key at once).
/// After each part one member is SIGKILLed and restarted, in turn. At the end every operation took effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_killed_and_restarted_while_the_stream_flows() {
    const PARTITIONS: i32 = 6;
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", PARTITIONS);
    let s = payments(30_000, PARTITIONS, true);
    let props = "\"session.timeout.ms\" = \"1500\"\n\"heartbeat.interval.ms\" = \"200\"";
    let pipeline = with_max_records(&shipped(), 200);
    let setups: Vec<Setup> =
        (0..3).map(|_| Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], props, "")).collect();
    let mut workers: Vec<BinWorker> = setups.iter().map(BinWorker::start).collect();
    let mut rng = Rng::from_clock();
    let dedup_rows = || async { db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await };
    let parts = s.records.chunks(s.records.len().div_ceil(6));
    for (i, part) in parts.enumerate() {
        tokio::task::block_in_place(|| kafka.produce("payments", part));
        let before = dedup_rows().await;
        wait_until(Duration::from_secs(60), "progress on the new part", || async { dedup_rows().await > before }).await;
        tokio::time::sleep(Duration::from_millis(rng.below(1000))).await;
        let victim = i % 3;
        workers[victim].kill();
        eprintln!("part {}: killed worker {victim} at {} dedup rows", i + 1, dedup_rows().await);
        tokio::time::sleep(Duration::from_millis(500 + rng.below(1500))).await;
        workers[victim] = BinWorker::start(&setups[victim]);
    }
    let all: Vec<&BinWorker> = workers.iter().collect();
    wait_all_durable_or_report(&db, &kafka, "idemflow-payments", "payments", PARTITIONS, &s, &all).await;
    for w in &mut workers {
        assert_counters_add_up(&w.scrape());
    }
    let logs: Vec<String> = workers.iter().map(BinWorker::log_text).collect();
    for (i, w) in workers.iter_mut().enumerate() {
        assert!(w.sigterm().success(), "{}", w.log_text());
        assert!(logs[i].contains("partitions assigned"), "worker {i} never got partitions:\n{}", logs[i]);
    }
    assert_exactly_once(&db, &s).await;
}

/// `batch.concurrency = 3`: one worker process runs three batch transactions at once, on disjoint partitions (three
/// consumers in the pipeline's group). With operations republished to other partitions (two transactions can hold
/// the same business key at once) and the worker SIGKILLed once mid-stream, every operation takes effect once,
/// every offset is committed, and transactions on different connections overlapped in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_runs_batch_transactions_on_disjoint_partitions_at_once() {
    lanes_apply_each_operation_once(false).await;
}

/// The same with `[offsets] store = "database"`: each lane claims its partitions under an owner of its own
/// (`host/pid/lane`) and new epochs, and the stored positions reach the end of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_store_their_positions_in_the_database() {
    lanes_apply_each_operation_once(true).await;
}

async fn lanes_apply_each_operation_once(offsets_in_database: bool) {
    const PARTITIONS: i32 = 6;
    let db = payments_db(None).await;
    sqlx::raw_sql("CREATE TABLE spans (pid int, started timestamptz, ended timestamptz, PRIMARY KEY (pid, started))")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = Kafka::new();
    kafka.create_topic("payments", PARTITIONS);
    let s = payments(12_000, PARTITIONS, true);
    // Each transaction leaves its connection's backend, its start and the time of its last record. Each record
    // takes at least 0.5 ms (pg_sleep), so a batch of 200 lasts 100 ms or more: lanes that run side by side overlap
    // even on a loaded machine, where batches of a few milliseconds could happen to run one after the other.
    let span = "  \"INSERT INTO spans SELECT pg_backend_pid(), now(), clock_timestamp() FROM pg_sleep(0.0005) ON CONFLICT (pid, started) DO UPDATE SET ended = clock_timestamp()\",\n]";
    let shipped = shipped();
    let mut pipeline = with_max_records(&shipped.replacen("\n]", &format!("\n{span}"), 1), 200) + "concurrency = 3\n";
    assert!(pipeline.contains("spans") && pipeline.contains("[batch]\nmax_records = 200\nconcurrency = 3"), "{pipeline}");
    if offsets_in_database {
        pipeline += "[offsets]\nstore = \"database\"\n";
    }
    let props = "\"session.timeout.ms\" = \"1500\"\n\"heartbeat.interval.ms\" = \"200\"";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], props, "");
    let (first, rest) = s.records.split_at(s.records.len() / 2);
    kafka.produce("payments", first);
    let mut worker = BinWorker::start(&setup);
    let dedup_rows = || async { db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await };
    wait_until(Duration::from_secs(60), "progress", || async { dedup_rows().await > 1000 }).await;
    worker.kill();
    kafka.produce("payments", rest);
    let mut worker = BinWorker::start(&setup);
    if offsets_in_database {
        let end = kafka.end_offsets("payments", PARTITIONS).iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let stored = "SELECT coalesce(string_agg(next_offset::text, ',' ORDER BY partition), '') FROM idemflow.offsets";
        wait_until(Duration::from_secs(120), "every stored position at the end of its partition", || async {
            db.scalar::<String>(stored).await == end
        })
        .await;
        let owners: i64 = db.scalar("SELECT count(DISTINCT owner) FROM idemflow.offsets WHERE owner ~ '/[0-9]+/[0-2]$'").await;
        assert!(owners >= 2, "partitions claimed by {owners} lanes");
    } else {
        wait_all_durable_or_report(&db, &kafka, "idemflow-payments", "payments", PARTITIONS, &s, &[&worker]).await;
    }
    let m = worker.scrape();
    assert_counters_add_up(&m);
    assert_eq!(metric(&m, "idemflow_assigned_partitions", &[("pipeline", "payments")]), PARTITIONS as f64, "summed over the consumers");
    assert!(worker.sigterm().success(), "{}", worker.log_text());
    assert_exactly_once(&db, &s).await;
    let overlapping: i64 = db
        .scalar(
            "SELECT count(*) FROM spans a JOIN spans b ON a.pid < b.pid \
             WHERE a.started < b.ended AND b.started < a.ended",
        )
        .await;
    assert!(overlapping > 0, "no two transactions of different connections overlapped");
}
