//! What an operator sees of the consumer: lag for every assigned partition from the moment it is assigned, stored
//! positions committed to the group on assignment, and a worker left without partitions.

use crate::support::*;
use std::time::Duration;

const PAYMENTS: &str = "CREATE TABLE payments (order_id text PRIMARY KEY, amount integer NOT NULL);";

const PIPELINE: &str = r#"topics = ["orders"]
[key]
field = "/id"
[sink]
table = "payments"
[sink.columns]
order_id = "/id"
amount = "/amount"
"#;

const GROUP: &str = "idemflow-payments";

/// `per_partition` records with distinct keys on each of `partitions` partitions.
fn orders(partitions: i32, per_partition: usize, tag: &str) -> Vec<Out> {
    (0..partitions)
        .flat_map(|p| (0..per_partition).map(move |i| Out::json(p, format!(r#"{{"id":"{tag}-{p}-{i}","amount":1}}"#))))
        .collect()
}

/// Waits (at most 60 s) until `/readyz` answers 200.
async fn wait_ready(setup: &Setup, what: &str) {
    wait_until(Duration::from_secs(60), what, || async { http_get(setup.metrics, "/readyz").is_ok_and(|(status, _)| status == 200) }).await;
}

fn lags(m: &str, partitions: i32) -> Vec<Option<f64>> {
    (0..partitions)
        .map(|p| {
            let p = p.to_string();
            let labels = [("pipeline", "payments"), ("topic", "orders"), ("partition", p.as_str())];
            m.lines()
                .any(|l| l.starts_with("idemflow_consumer_lag_records{") && l.contains(&format!("partition=\"{p}\"")))
                .then(|| metric(m, "idemflow_consumer_lag_records", &labels))
        })
        .collect()
}

/// A backlog the worker cannot commit yet (the dedup table is locked against writes): every assigned partition's lag
/// is exported from the assignment on and is the whole backlog, not only what committed batches saw; once the
/// batches commit, it falls to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_is_exported_for_every_assigned_partition_from_its_assignment() {
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 4, &[("payments.toml", PIPELINE)]).await;
    kafka.produce("orders", &orders(4, 300, "a"));
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE idemflow.dedup IN EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    let worker = InProc::start(&setup).await;
    let render = || String::from_utf8(worker.metrics.render()).unwrap();
    wait_until(Duration::from_secs(30), "lag of all four partitions, while no batch can commit", || async {
        lags(&render(), 4) == vec![Some(300.0); 4]
    })
    .await;
    assert_eq!(worker.metric("idemflow_records_received_total", &[("pipeline", "payments")]), 0.0);
    assert_eq!(worker.metric("idemflow_assigned_partitions", &[("pipeline", "payments")]), 4.0);
    lock.rollback().await.unwrap();
    worker.wait_received("payments", 1200).await;
    wait_until(Duration::from_secs(30), "lag 0 on every partition", || async { lags(&render(), 4) == vec![Some(0.0); 4] }).await;
    assert!(worker.stop().await.is_empty());
}

/// `[offsets] store = "database"`: the group's committed offsets were left behind the stored positions (a crash
/// between the two commits, or an operator's reset); a worker that starts commits the stored positions to the group
/// when the partitions are assigned, with no new record arriving, and reports no lag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_positions_are_committed_to_the_group_on_assignment() {
    let pipeline = format!("{PIPELINE}[offsets]\nstore = \"database\"\n");
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 2, &[("payments.toml", &pipeline)]).await;
    kafka.produce("orders", &orders(2, 50, "b"));
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", 100).await;
    assert!(worker.stop().await.is_empty());
    assert_eq!(kafka.committed(GROUP, "orders", 2), vec![50, 50]);
    kafka.set_committed_all(GROUP, "orders", &[(0, 0), (1, 0)]);
    assert_eq!(kafka.committed(GROUP, "orders", 2), vec![0, 0]);

    let worker = InProc::start(&setup).await;
    let render = || String::from_utf8(worker.metrics.render()).unwrap();
    wait_until(Duration::from_secs(30), "the stored positions committed to the group, lag 0", || async {
        kafka.committed(GROUP, "orders", 2) == vec![50, 50] && lags(&render(), 2) == vec![Some(0.0); 2]
    })
    .await;
    let m = render();
    assert_eq!(metric(&m, "idemflow_records_received_total", &[("pipeline", "payments")]), 0.0, "nothing replayed");
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 100);
}

/// Two workers on a one-partition topic: one of them stays without a partition. It says so in its log after
/// `[kafka] no_partitions_warning` and exports `idemflow_assigned_partitions 0`; the other exports 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_partitions_warns_and_exports_it() {
    let (_db, kafka, first) = fixture(PAYMENTS, "orders", 1, &[("payments.toml", PIPELINE)]).await;
    let second = Setup::new(&_db, &kafka, &[("payments.toml", PIPELINE)]);
    for setup in [&first, &second] {
        let text = std::fs::read_to_string(&setup.config).unwrap();
        std::fs::write(&setup.config, text.replace("[kafka]\n", "[kafka]\nno_partitions_warning = \"2s\"\n")).unwrap();
    }
    let workers = [BinWorker::start(&first), BinWorker::start(&second)];
    let assigned = |w: &BinWorker| metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "one worker with the partition and one without, warned", || async {
        let counts = [assigned(&workers[0]), assigned(&workers[1])];
        let idle = counts.iter().position(|c| *c == 0.0);
        counts.iter().sum::<f64>() == 1.0
            && idle.is_some_and(|i| workers[i].log_text().contains("no partition assigned to this worker"))
    })
    .await;
    kafka.produce("orders", &orders(1, 10, "c"));
    wait_until(Duration::from_secs(30), "the owner applies the records", || async {
        workers.iter().map(|w| metric(&w.scrape(), "idemflow_records_applied_total", &[("pipeline", "payments")])).sum::<f64>() == 10.0
    })
    .await;
}

/// A final offset commit the group refuses at a clean shutdown (IllegalGeneration: the group moved on) is explained
/// as what it means for the user, not reported as an error, and the worker exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_final_offset_commit_says_what_it_means() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let (_db, kafka, setup) = fixture(PAYMENTS, "orders", 1, &[("payments.toml", PIPELINE)]).await;
    kafka.produce("orders", &orders(1, 10, "d"));
    let mut worker = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the records applied", || async {
        metric(&worker.scrape(), "idemflow_records_applied_total", &[("pipeline", "payments")]) == 10.0
    })
    .await;
    let errors = [RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION; 5];
    kafka.mock().request_errors(RDKafkaApiKey::OffsetCommit, &errors);
    assert!(worker.sigterm().success());
    let log = worker.log_text();
    let line = log.lines().find(|l| l.contains("final offset commit")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("WARN") && !line.contains("ERROR"), "{line}");
    assert!(line.contains("skipped as duplicates") && line.contains("nothing is lost or applied twice"), "{line}");
}

/// Nothing stalls without a word: a partition whose records wait and whose batch cannot commit (the dedup table
/// locked; the same for a batch retried forever, a paused or fenced partition) is exported with the seconds it has
/// gone without progress, logged once as stalled past `[metrics] stall_after`, and makes `/readyz` answer 503 naming
/// it; once batches commit again the gauge is 0 and the worker is ready. Issue: exactly-once holes, "nothing stalls
/// or drains without saying so".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_partition_is_exported_logged_and_not_ready() {
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 2, &[("payments.toml", PIPELINE)]).await;
    let text = std::fs::read_to_string(&setup.config).unwrap().replace("[metrics]\n", "[metrics]\nstall_after = \"2s\"\n");
    std::fs::write(&setup.config, text).unwrap();
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE idemflow.dedup IN EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    kafka.produce("orders", &orders(2, 50, "s"));
    let mut worker = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "/readyz names the stalled partitions", || async {
        http_get(setup.metrics, "/readyz")
            .is_ok_and(|(status, body)| status == 503 && body.contains("stalled") && body.contains("orders/0") && body.contains("orders/1"))
    })
    .await;
    let m = worker.scrape();
    let stalled = metric(&m, "idemflow_partition_stalled_seconds", &[("pipeline", "payments"), ("topic", "orders"), ("partition", "0")]);
    assert!(stalled >= 2.0, "{stalled}\n{m}");
    assert!(worker.log_text().contains("stalled: records wait on this partition"), "{}", worker.log_text());
    lock.rollback().await.unwrap();
    wait_ready(&setup, "ready again once the batches commit").await;
    let m = worker.scrape();
    assert_eq!(metric(&m, "idemflow_partition_stalled_seconds", &[("pipeline", "payments"), ("topic", "orders"), ("partition", "0")]), 0.0);
    assert!(worker.log_text().contains("the stalled partition moves again"));
    assert!(worker.sigterm().success());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 100);
}

/// Readiness is per pipeline: one pipeline whose batches keep failing against its store (its table locked by
/// another session, each attempt past `batch_timeout`) keeps `/readyz` at 503 naming it, however often another
/// pipeline of the worker commits meanwhile; once its batches commit, the worker is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pipeline_failing_against_its_store_keeps_the_worker_not_ready() {
    let refunds = PIPELINE.replace(r#"topics = ["orders"]"#, r#"topics = ["refunds"]"#).replace(r#"table = "payments""#, r#"table = "refunds""#);
    let tables = format!("{PAYMENTS} CREATE TABLE refunds (order_id text PRIMARY KEY, amount integer NOT NULL);");
    let (db, kafka, setup) = fixture(&tables, "orders", 1, &[("payments.toml", PIPELINE), ("refunds.toml", &refunds)]).await;
    kafka.create_topic("refunds", 1);
    let text = std::fs::read_to_string(&setup.config).unwrap().replace("[database]\n", "[database]\nbatch_timeout = \"2s\"\n");
    std::fs::write(&setup.config, text).unwrap();
    kafka.produce("refunds", &orders(1, 1, "r0"));
    let mut worker = BinWorker::start(&setup);
    let applied = |w: &BinWorker| metric(&w.scrape(), "idemflow_records_applied_total", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "both pipelines up, refunds applying", || async {
        metric(&worker.scrape(), "idemflow_records_applied_total", &[("pipeline", "refunds")]) == 1.0
    })
    .await;
    // Another session holds the refunds table (its statements are prepared already: the lock meets their execution).
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE refunds IN EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    kafka.produce("refunds", &orders(1, 4, "r"));
    wait_until(Duration::from_secs(60), "refunds' batch retried", || async {
        worker.scrape().lines().any(|l| l.starts_with("idemflow_db_retries_total{") && l.contains("pipeline=\"refunds\"") && !l.ends_with(" 0"))
    })
    .await;
    // Payments commit batch after batch; refunds still fail: not ready, every time, naming refunds.
    for round in 0..8 {
        kafka.produce("orders", &[Out::json(0, format!(r#"{{"id":"p-{round}","amount":1}}"#))]);
        wait_until(Duration::from_secs(30), "a payments batch committed", || async { applied(&worker) == f64::from(round + 1) }).await;
        let (status, body) = http_get(setup.metrics, "/readyz").unwrap();
        assert!(status == 503 && body.contains("refunds") && !body.contains("payments"), "round {round}: {status} {body}");
    }
    lock.rollback().await.unwrap();
    wait_ready(&setup, "ready again once refunds commit").await;
    assert!(worker.sigterm().success(), "{}", worker.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM refunds").await, 5);
}

/// A partition whose records the worker has fetched and keeps for its next batch, behind a batch of another
/// partition retried again and again (its row held by another session), is stalled too: the records kept count as
/// waiting (the high watermark no longer shows them), so its stall clock does not start again at every attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_kept_behind_a_retried_batch_stall_their_partition() {
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 2, &[("payments.toml", PIPELINE)]).await;
    let text = std::fs::read_to_string(&setup.config)
        .unwrap()
        .replace("[metrics]\n", "[metrics]\nstall_after = \"2s\"\n")
        .replace("[database]\n", "[database]\nbatch_timeout = \"2s\"\n");
    std::fs::write(&setup.config, text).unwrap();
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO payments VALUES ('a-0', 1)").execute(&mut *held).await.unwrap();
    kafka.produce("orders", &[Out::json(0, r#"{"id":"a-0","amount":1}"#)]);
    let mut worker = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "partition 0's batch retried", || async {
        worker.scrape().lines().any(|l| l.starts_with("idemflow_db_retries_total{") && !l.ends_with(" 0"))
    })
    .await;
    kafka.produce("orders", &[Out::json(1, r#"{"id":"b-0","amount":1}"#)]);
    let stalled = |body: &str| body.contains("orders/1");
    wait_until(Duration::from_secs(60), "/readyz names partition 1", || async {
        http_get(setup.metrics, "/readyz").is_ok_and(|(status, body)| status == 503 && stalled(&body))
    })
    .await;
    // And it stays stalled through the attempts that follow (each fetches while it runs).
    for _ in 0..16 {
        let (status, body) = http_get(setup.metrics, "/readyz").unwrap();
        assert!(status == 503 && stalled(&body), "{status} {body}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    held.rollback().await.unwrap();
    wait_ready(&setup, "ready again once the batches commit").await;
    assert!(worker.sigterm().success(), "{}", worker.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 2);
}

/// `[offsets] store = "database"`: a partition given up after a fenced batch, whose new claim keeps failing (the
/// row of its stored position held by another session), is stalled: its records wait and nothing applies them, so
/// its stall clock goes on (before, a fenced partition was dropped from the stall signal, and the worker looked
/// ready). Once the claim goes through, the partition moves again and every record is applied. Issue 42, item 11.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_partition_whose_new_claim_keeps_failing_is_stalled() {
    let pipeline = format!("{PIPELINE}[offsets]\nstore = \"database\"\n");
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 1, &[("payments.toml", &pipeline)]).await;
    let text = std::fs::read_to_string(&setup.config).unwrap().replace("[metrics]\n", "[metrics]\nstall_after = \"2s\"\n");
    std::fs::write(&setup.config, text).unwrap();
    kafka.produce("orders", &orders(1, 5, "a"));
    let mut worker = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the first records applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM payments").await == 5
    })
    .await;
    // Another claim (as a worker with a stale view of the group makes one) takes the partition's epoch.
    sqlx::query("UPDATE idemflow.offsets SET owner_epoch = owner_epoch + 1, owner = 'elsewhere' WHERE pipeline = 'payments'")
        .execute(&db.pool)
        .await
        .unwrap();
    kafka.produce("orders", &orders(1, 5, "b"));
    wait_until(Duration::from_secs(60), "the next batch fenced", || async { worker.log_text().contains("fenced: another worker claimed") }).await;
    // The row held: the worker's new claim of the partition times out, again and again.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM idemflow.offsets WHERE pipeline = 'payments' FOR UPDATE").execute(&mut *held).await.unwrap();
    wait_until(Duration::from_secs(90), "the new claim failing", || async { worker.log_text().contains("cannot claim the fenced partitions again") })
        .await;
    let (status, body) = http_get(setup.metrics, "/readyz").unwrap();
    assert!(status == 503 && body.contains("orders/0"), "the fenced partition is stalled: {status} {body}");
    let labels = [("pipeline", "payments"), ("topic", "orders"), ("partition", "0")];
    assert!(metric(&worker.scrape(), "idemflow_partition_stalled_seconds", &labels) >= 2.0);
    held.rollback().await.unwrap();
    wait_ready(&setup, "ready again once the partition is claimed again").await;
    wait_until(Duration::from_secs(60), "every record applied", || async { db.scalar::<i64>("SELECT count(*) FROM payments").await == 10 }).await;
    assert!(worker.sigterm().success(), "{}", worker.log_text());
}
