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
