//! Consumed positions: `[offsets] store = "database"` (no redelivery after a crash, fencing of a worker that lost
//! its partitions) and `idemflow rewind`.

use crate::failures::{assert_exactly_once, payments, payments_db, shipped, wait_all_durable, wait_all_durable_or_report, Payments, Rng};
use crate::support::*;
use idemflow::offsets;
use std::time::Duration;

const TOPIC: &str = "payments";
const GROUP: &str = "idemflow-payments";
const FAST_GROUP: &str = "\"session.timeout.ms\" = \"1500\"\n\"heartbeat.interval.ms\" = \"200\"";

fn stored_positions() -> String {
    shipped() + "\n[offsets]\nstore = \"database\"\n"
}

fn dup(m: &str, reason: &str) -> f64 {
    metric(m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)])
}

/// The stored next offset of each partition of the `payments` pipeline, in partition order.
async fn stored_next_offsets(db: &TestDb) -> Vec<i64> {
    sqlx::query_scalar("SELECT next_offset FROM idemflow.offsets WHERE pipeline = 'payments' ORDER BY partition")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// The injected duplicates (republished and payload_mismatch) of `s`: what the dedup rows' `duplicates` column
/// must add up to when nothing was redelivered.
fn injected(s: &Payments) -> i64 {
    (s.republished + s.mismatched) as i64
}

/// A crash right after a batch's database commit and before its offset commit (injected, deterministic): with
/// the Kafka store the batch comes back and is skipped as `redelivered`; with the database store nothing comes
/// back, because the position committed with the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_commits_redelivers_nothing_with_the_database_store() {
    for (store, pipeline) in [("kafka", shipped()), ("database", stored_positions())] {
        let db = payments_db(None).await;
        let kafka = Kafka::new();
        kafka.create_topic(TOPIC, 2);
        let s = payments(3_000, 2, false);
        kafka.produce(TOPIC, &s.records);
        let pipeline = with_max_records(&pipeline, 200);
        let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], FAST_GROUP, "");
        let crash = idemflow::worker::Faults { crash_after_commits: Some(3), ..Default::default() };
        let w = InProc::start_with_faults(&setup, crash).await;
        let stopped = tokio::time::timeout(Duration::from_secs(60), w.stop_when_pipelines_end()).await;
        let crashed = stopped.expect("the injected crash ends the pipeline");
        assert!(crashed.is_empty(), "{crashed:?}");
        let applied_before = db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await;
        assert!(applied_before > 0);

        let w = InProc::start(&setup).await;
        wait_all_durable(&db, &kafka, GROUP, TOPIC, 2, &s).await;
        let m = String::from_utf8(w.metrics.render()).unwrap();
        assert!(w.stop().await.is_empty());
        assert_exactly_once(&db, &s).await;
        let redelivered = dup(&m, "redelivered");
        let stored_duplicates = db.scalar::<i64>("SELECT coalesce(sum(duplicates), 0)::int8 FROM idemflow.dedup_duplicates").await;
        match store {
            "kafka" => {
                assert!(redelivered > 0.0, "the uncommitted batch is redelivered with the Kafka store");
                assert!(stored_duplicates > injected(&s));
            }
            _ => {
                assert_eq!(redelivered, 0.0, "nothing is redelivered with the database store");
                assert_eq!(stored_duplicates, injected(&s), "only the injected duplicates were ever skipped");
                let end = kafka.end_offsets(TOPIC, 2);
                assert_eq!(stored_next_offsets(&db).await, end, "the stored positions are the end of each partition");
            }
        }
        eprintln!("store {store}: redelivered {redelivered} after the crash; {applied_before} keys applied before it");
    }
}

/// Two workers with the database store, SIGKILLed at random moments (five times) and restarted while they work:
/// every operation applied once, and no record was ever redelivered (the dedup rows' duplicate counts add up to
/// exactly the injected duplicates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkills_with_the_database_store_redeliver_nothing() {
    const PARTITIONS: i32 = 4;
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic(TOPIC, PARTITIONS);
    let s = payments(20_000, PARTITIONS, true);
    kafka.produce(TOPIC, &s.records);
    let pipeline = with_max_records(&stored_positions(), 100);
    let setups: Vec<Setup> =
        (0..2).map(|_| Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], FAST_GROUP, "")).collect();
    let mut workers: Vec<BinWorker> = setups.iter().map(BinWorker::start).collect();
    let mut rng = Rng::from_clock();
    let dedup_rows = || async { db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await };
    for kill in 0..5 {
        let before = dedup_rows().await;
        let all = s.distinct as i64;
        wait_until(Duration::from_secs(60), "progress before the next kill", || async {
            let now = dedup_rows().await;
            now > before || now == all
        })
        .await;
        if dedup_rows().await == all {
            eprintln!("every operation applied after {kill} kills");
            break;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(800))).await;
        let i = kill % 2;
        workers[i].kill();
        eprintln!("kill {}: worker {i} at {} dedup rows", kill + 1, dedup_rows().await);
        workers[i] = BinWorker::start(&setups[i]);
    }
    let durable = wait_all_durable(&db, &kafka, GROUP, TOPIC, PARTITIONS, &s);
    if tokio::time::timeout(Duration::from_secs(200), durable).await.is_err() {
        let rows: Vec<(i32, Option<i64>, i64, Option<String>)> = sqlx::query_as(
            "SELECT partition, next_offset, owner_epoch, owner FROM idemflow.offsets ORDER BY partition",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let tails: Vec<String> =
            workers.iter().map(|w| w.log_text().lines().rev().take(40).collect::<Vec<_>>().join("\n")).collect();
        panic!(
            "stalled: stored {rows:?}, end {:?}, committed {:?}\n{}",
            kafka.end_offsets(TOPIC, PARTITIONS),
            kafka.committed(GROUP, TOPIC, PARTITIONS),
            tails.join("\n=====\n")
        );
    }
    for w in &mut workers {
        let status = w.sigterm();
        assert!(status.success(), "{status:?}: {}", w.log_text().lines().rev().take(40).collect::<Vec<_>>().join("\n"));
    }
    assert_exactly_once(&db, &s).await;
    let stored_duplicates = db.scalar::<i64>("SELECT coalesce(sum(duplicates), 0)::int8 FROM idemflow.dedup_duplicates").await;
    assert_eq!(stored_duplicates, injected(&s), "a record was redelivered");
    assert_eq!(stored_next_offsets(&db).await, kafka.end_offsets(TOPIC, PARTITIONS));
}

/// `rewind --dry-run` says whether a real run would be refused (here the broker cannot describe groups, so it says
/// how a real run decides), and warns when the replay starts at records older than the dedup retention, whose
/// dedup rows may have been purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_dry_run_tells_the_refusal_rule_and_warns_past_the_dedup_retention() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic(TOPIC, 2);
    let s = payments(300, 2, false);
    kafka.produce(TOPIC, &s.records);
    let pipeline = shipped() + "\n[dedup]\nretention = \"2s\"\n";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], FAST_GROUP, "");
    let mut w = BinWorker::start(&setup);
    wait_all_durable(&db, &kafka, GROUP, TOPIC, 2, &s).await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let config = setup.config.to_str().unwrap().to_owned();
    let args = ["rewind", "--config", &config, "--pipeline", "payments", "--to", "earliest", "--dry-run"];
    let (status, out, err) = idemflow(&args, setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("the broker does not describe groups (DescribeGroups): a real run joins the group"), "{out}");
    for p in 0..2 {
        assert!(out.contains(&format!("warning: payments/{p}: the replay starts at a record from ")), "{out}");
    }
    assert!(out.contains("older than [dedup] retention = 2s"), "{out}");
    assert!(out.contains("dry run: nothing changed"), "{out}");
    assert_eq!(kafka.committed(GROUP, TOPIC, 2), kafka.end_offsets(TOPIC, 2));
}

/// On a broker that describes groups (noida-db; the mock cluster cannot), `rewind` refuses while a worker runs
/// *before joining the group*, so the running worker sees no rebalance; `--dry-run` says a real run would be
/// refused; once the worker has stopped, the rewind goes ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_refuses_before_joining_when_the_group_has_members() {
    let noida = noida::Noida::start();
    noida.create_topic("orders", 2).await;
    let db = TestDb::new("CREATE TABLE payments (order_id text PRIMARY KEY, amount integer NOT NULL);").await;
    let pipeline = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"payments\"\n[sink.columns]\norder_id = \"/id\"\namount = \"/amount\"\n";
    let values: Vec<String> = (0..40).map(|i| format!(r#"{{"id":"n-{i}","amount":1}}"#)).collect();
    noida.produce("orders", 2, &values);
    let setup = Setup::with_bootstrap(&db, noida.bootstrap(), &[("payments.toml", pipeline)], "", "");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the records applied", || async {
        metric(&w.scrape(), "idemflow_records_applied_total", &[("pipeline", "payments")]) == 40.0
    })
    .await;
    let rebalances = |w: &BinWorker| metric(&w.scrape(), "idemflow_rebalances_total", &[("pipeline", "payments"), ("event", "revoke")]);
    let before = rebalances(&w);
    let config = setup.config.to_str().unwrap().to_owned();
    let rewind = |extra: &[&str]| {
        let mut args = vec!["rewind", "--config", &config, "--pipeline", "payments", "--to", "earliest"];
        args.extend_from_slice(extra);
        idemflow(&args, setup.dir.path())
    };
    let (status, out, err) = rewind(&["--dry-run"]);
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("a real run would be refused: the group has 1 active member(s)"), "{out}");
    let (status, out, err) = rewind(&[]);
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("has 1 active member(s)") && err.contains("the group was not joined"), "{err}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(rebalances(&w), before, "the refused rewind must not force a rebalance on the running worker");
    assert!(w.sigterm().success(), "{}", w.log_text());
    // The stopped worker left the group (LeaveGroup); give the broker a moment to complete the group's state.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let out = loop {
        let (status, out, err) = rewind(&[]);
        if status.success() {
            break out;
        }
        assert!(err.contains("active member(s)") && std::time::Instant::now() < deadline, "{out}{err}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(out.contains("rewound: 40 record(s)"), "{out}");
}

/// Fencing: a worker that lost a partition can neither overwrite the new owner's position nor move it
/// backwards, and its batch rolls back whole; a new owner's claim waits for the old owner's batch in flight and
/// starts exactly after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_lost_its_partition_is_fenced() {
    let db = payments_db(None).await;
    let pool = &db.pool;
    let p0 = [(TOPIC.to_owned(), 0)];
    let a = idemflow::store::postgres::offsets::claim(pool, "payments", "worker-a", &p0).await.unwrap();
    assert_eq!((a[0].next_offset, a[0].epoch), (None, 1));
    let positions = |next: i64, epoch: i64| offsets::Positions(vec![(TOPIC.into(), 0, next, epoch)]);

    // A stores 100 in a batch transaction that is still open when B is assigned the partition.
    let mut tx = pool.begin().await.unwrap();
    assert!(idemflow::store::postgres::offsets::advance(&mut tx, "payments", &positions(100, 1)).await.unwrap().is_empty());
    let claim_b = tokio::spawn({
        let pool = pool.clone();
        let p0 = p0.clone();
        async move { idemflow::store::postgres::offsets::claim(&pool, "payments", "worker-b", &p0).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!claim_b.is_finished(), "B's claim waits for A's batch in flight");
    tx.commit().await.unwrap();
    let b = claim_b.await.unwrap();
    assert_eq!((b[0].next_offset, b[0].epoch), (Some(100), 2), "B starts right after A's committed batch");

    // A, not yet told it lost the partition, tries its next batch: fenced, and it rolls back whole.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO accounts VALUES ('ZOMBIE', 0)").execute(&mut *tx).await.unwrap();
    let fenced = idemflow::store::postgres::offsets::advance(&mut tx, "payments", &positions(150, 1)).await.unwrap();
    assert_eq!(fenced, vec![(TOPIC.to_owned(), 0)]);
    tx.rollback().await.unwrap();
    // Nor can it move the position backwards.
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(idemflow::store::postgres::offsets::advance(&mut tx, "payments", &positions(50, 1)).await.unwrap().len(), 1);
    tx.commit().await.unwrap();
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE partition = 0").await, 100);
    // B's batches go through.
    let mut tx = pool.begin().await.unwrap();
    assert!(idemflow::store::postgres::offsets::advance(&mut tx, "payments", &positions(130, 2)).await.unwrap().is_empty());
    tx.commit().await.unwrap();
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE partition = 0").await, 130);
    assert_eq!(db.scalar::<String>("SELECT owner FROM idemflow.offsets WHERE partition = 0").await, "worker-b");

    // Through the sink: a fenced batch applies nothing at all.
    let setup_kafka = Kafka::new();
    let setup = Setup::new(&db, &setup_kafka, &[("payments.toml", &stored_positions())]);
    let settings = idemflow::config::load_settings_from(&setup.config, []).unwrap().settings;
    let pipelines = idemflow::config::load_pipelines(&settings.pipelines).unwrap();
    let ready = idemflow::worker::prepare(&idemflow::store::Store::Postgres(pool.clone()), &pipelines).await.unwrap();
    let r = &ready[0];
    let record = idemflow::record::Record {
        position: idemflow::record::Position { topic: TOPIC.into(), partition: 0, offset: 130 },
        timestamp_ms: None,
        key: None,
        headers: vec![],
        payload: Some(br#"{"order":{"id":"Z-1","account":"ACC-1","amount":"1.00"}}"#.to_vec()),
        oversized: None,
        properties: Vec::new(),
        delivered_before: None,
        receipt: idemflow::record::Receipt::NONE,
    };
    let prepared = r.preparer.prepare(&record);
    let batch = idemflow::batch::Batch::single(record, prepared);
    let stale = positions(131, 1);
    let attempt = idemflow::sink::Attempt { owner: "test/1".into(), id: idemflow::sink::Attempt::next_id(), ..Default::default() };
    let e = r.sink.apply(&batch, Some(&stale), |_| Ok(()), &attempt).await;
    assert!(matches!(e, Err(idemflow::sink::SinkError::Fenced { .. })), "{e:?}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 0);
    let current = positions(131, 2);
    let attempt = idemflow::sink::Attempt { owner: "test/1".into(), id: idemflow::sink::Attempt::next_id(), ..Default::default() };
    let done = r.sink.apply(&batch, Some(&current), |_| Ok(()), &attempt).await;
    assert_eq!(done.unwrap().counts.applied, 1);
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE partition = 0").await, 131);
}

/// `idemflow rewind --to earliest` with the workers stopped: the next run consumes everything again, applies
/// nothing, and counts every replayed record as a duplicate of its kind. With a worker running, the rewind is
/// refused and changes nothing. Both offset stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_to_earliest_replays_without_effects() {
    for (store, pipeline) in [("kafka", shipped()), ("database", stored_positions())] {
        const PARTITIONS: i32 = 3;
        let db = payments_db(None).await;
        let kafka = Kafka::new();
        kafka.create_topic(TOPIC, PARTITIONS);
        let s = payments(2_000, PARTITIONS, true);
        kafka.produce(TOPIC, &s.records);
        let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], FAST_GROUP, "");
        let config = setup.config.to_str().unwrap().to_owned();
        let rewind = |extra: &[&str]| {
            let mut args = vec!["rewind", "--config", &config, "--pipeline", "payments", "--to", "earliest"];
            args.extend_from_slice(extra);
            idemflow(&args, setup.dir.path())
        };

        let mut w = BinWorker::start(&setup);
        wait_all_durable(&db, &kafka, GROUP, TOPIC, PARTITIONS, &s).await;
        let end = kafka.end_offsets(TOPIC, PARTITIONS);
        // Refused while a worker holds partitions.
        let (status, out, err) = rewind(&[]);
        assert!(!status.success(), "{out}{err}");
        assert!(err.contains("has other active members") && err.contains("stop every worker"), "{err}");
        assert!(w.sigterm().success(), "{}", w.log_text());
        assert_eq!(kafka.committed(GROUP, TOPIC, PARTITIONS), end, "the refused rewind changed nothing");

        let (status, out, err) = rewind(&["--dry-run"]);
        assert!(status.success(), "{out}{err}");
        let total = s.records.len();
        assert!(out.contains(&format!("dry run: nothing changed; {total} record(s) would be consumed again")), "{out}");
        assert_eq!(kafka.committed(GROUP, TOPIC, PARTITIONS), end);

        let (status, out, err) = rewind(&[]);
        assert!(status.success(), "{out}{err}");
        assert!(out.contains(&format!("rewound: {total} record(s)")), "{out}");
        println!("{out}");
        assert_eq!(kafka.committed(GROUP, TOPIC, PARTITIONS), vec![0; PARTITIONS as usize]);

        let mut w = BinWorker::start(&setup);
        wait_until(Duration::from_secs(90), "the replay", || async {
            metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]) >= total as f64
        })
        .await;
        let m = w.scrape();
        assert!(w.sigterm().success(), "{}", w.log_text());
        assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "payments")]), 0.0, "store {store}");
        // A replay is a redelivery: every record, whatever its first delivery was counted as; republished and
        // payload_mismatch (and the alert on it) do not move again.
        assert_eq!(dup(&m, "redelivered"), total as f64, "store {store}");
        assert_eq!(dup(&m, "republished"), 0.0);
        assert_eq!(dup(&m, "payload_mismatch"), 0.0);
        assert_eq!(metric(&m, "idemflow_records_received_total", &[("pipeline", "payments")]), total as f64);
        assert_exactly_once(&db, &s).await;
        assert_eq!(kafka.committed(GROUP, TOPIC, PARTITIONS), end);
    }
}

/// `idemflow rewind --to TIME` with a partition the group never committed (its records came while no worker ran):
/// a timestamp after its records must not move it to its end, which would skip them all (seen: partition 2 moved
/// to its end, "0 record(s) will be consumed again", its 10 records never applied). The group's reset policy
/// (`auto.offset.reset = earliest`, idemflow's default) would start it at its log start, so the rewind moves it
/// there, with a warning; the next run applies every record. Both offset stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_to_a_time_never_skips_a_partition_without_a_committed_offset() {
    for (store, pipeline) in [("kafka", shipped()), ("database", stored_positions())] {
        const PARTITIONS: i32 = 3;
        let db = payments_db(None).await;
        let kafka = Kafka::new();
        kafka.create_topic(TOPIC, PARTITIONS);
        let s = payments(300, PARTITIONS, false);
        // Every copy of an operation is on its own partition (`cross_partition` false): partition 2's operations
        // come only with its records.
        let (late, early): (Vec<Out>, Vec<Out>) = s.records.iter().cloned().partition(|r| r.partition == 2);
        kafka.produce(TOPIC, &early);
        let setup = Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], FAST_GROUP, "");
        let mut w = BinWorker::start(&setup);
        let end = kafka.end_offsets(TOPIC, PARTITIONS);
        assert_eq!(end[2], 0);
        wait_until(Duration::from_secs(90), "partitions 0 and 1 consumed and committed", || async {
            let committed = kafka.committed(GROUP, TOPIC, PARTITIONS);
            committed[0] == end[0] && committed[1] == end[1]
        })
        .await;
        assert!(w.sigterm().success(), "{}", w.log_text());
        assert_eq!(kafka.committed(GROUP, TOPIC, PARTITIONS)[2], -1, "the group never committed partition 2");

        // Records on partition 2 while no worker runs, then a rewind to a time after all of them.
        kafka.produce(TOPIC, &late);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let after = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let config = setup.config.to_str().unwrap().to_owned();
        let args = ["rewind", "--config", &config, "--pipeline", "payments", "--to", &after];
        let (status, out, err) = idemflow(&args, setup.dir.path());
        assert!(status.success(), "store {store}: {out}{err}");
        println!("{out}");
        let n = late.len();
        assert!(out.contains(&format!("rewound: {n} record(s) will be consumed again")), "store {store}: {out}");
        assert!(
            out.contains("warning: payments/2: the group has no committed position here, and auto.offset.reset = earliest starts it at its log start 0"),
            "store {store}: {out}"
        );
        assert_eq!(kafka.committed(GROUP, TOPIC, PARTITIONS), vec![end[0], end[1], 0], "store {store}: never forward");

        let mut w = BinWorker::start(&setup);
        wait_all_durable_or_report(&db, &kafka, GROUP, TOPIC, PARTITIONS, &s, &[&w]).await;
        let m = w.scrape();
        assert!(w.sigterm().success(), "{}", w.log_text());
        assert_eq!(metric(&m, "idemflow_records_received_total", &[("pipeline", "payments")]), n as f64, "store {store}");
        assert_eq!(dup(&m, "redelivered"), 0.0, "store {store}: partitions 0 and 1 stayed where they were");
        assert_exactly_once(&db, &s).await;
    }
}

/// `check` compares `[dedup] retention` with what each topic can keep: `retention.ms` plus `segment.ms` (Kafka deletes
/// a segment whole, once its newest record is past `retention.ms`, so its first record can live both), and warns on
/// a compacted topic, which keeps every key's newest record for good; a topic whose window the dedup rows cover is
/// said to be covered. Read from a broker that answers DescribeConfigs (noida-db). Issue 42, item 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_compares_the_dedup_retention_with_what_each_topic_can_keep() {
    let noida = noida::Noida::start();
    let day = (24 * 3600 * 1000).to_string();
    let three_days = (3 * 24 * 3600 * 1000).to_string();
    noida.create_topic_with("covered", 1, &[("retention.ms", &day), ("segment.ms", &day)]).await;
    noida.create_topic_with("segments", 1, &[("retention.ms", &three_days), ("segment.ms", &three_days)]).await;
    noida.create_topic_with("compacted", 1, &[("cleanup.policy", "compact"), ("retention.ms", &day), ("segment.ms", &day)]).await;
    let db = TestDb::new("CREATE TABLE payments (order_id text PRIMARY KEY);").await;
    let pipeline = |topic: &str| {
        format!("topics = [\"{topic}\"]\n[key]\nfield = \"/id\"\n[dedup]\nretention = \"5d\"\n[sink]\ntable = \"payments\"\n[sink.columns]\norder_id = \"/id\"\n")
    };
    let (covered, segments, compacted) = (pipeline("covered"), pipeline("segments"), pipeline("compacted"));
    let setup = Setup::with_bootstrap(
        &db,
        noida.bootstrap(),
        &[("covered.toml", &covered), ("segments.toml", &segments), ("compacted.toml", &compacted)],
        "",
        "",
    );
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("pipeline \"covered\": topic \"covered\": dedup retention covers what the topic can keep"), "{out}");
    assert!(
        out.contains("warning: pipeline \"segments\": topic \"segments\" can keep a record for 6d (retention.ms 3d + segment.ms 3d")
            && out.contains("but dedup rows are kept 5d"),
        "3 days of retention.ms are covered by 5 days, 3 + 3 are not: {out}"
    );
    assert!(out.contains("warning: pipeline \"compacted\": topic \"compacted\" is compacted (cleanup.policy = compact)"), "{out}");
}

/// A pipeline whose consumer group's offsets are gone (Kafka deletes them `offsets.retention.minutes` after the group
/// became empty: a pipeline stopped for a week; or a new `group_id`) starts its partitions again from the log start,
/// and the purge had removed the dedup rows of what it had applied. Those records were applied a second time; now
/// they are below the partitions' processed floor: skipped as `redelivered`, neither claimed nor applied, and only
/// the records after them are applied. An operator's `idemflow rewind` lowers the floor: what it replays is applied
/// where no dedup row covers it (the rebuild a rewind is for, after effects were lost). Issue 42, item 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_offsets_are_gone_does_not_apply_purged_records_again() {
    let db = TestDb::new(
        "CREATE TABLE accounts (account_id text PRIMARY KEY, balance numeric NOT NULL);
         INSERT INTO accounts VALUES ('A', 0);
         CREATE TABLE paid (id text PRIMARY KEY, amount numeric NOT NULL);",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("pay", 2);
    let pipeline = |group: &str| {
        format!(
            "topics = [\"pay\"]\ngroup_id = \"{group}\"\n[key]\nfield = \"/id\"\n[dedup]\nretention = \"1h\"\n[sink]\nsql = [\n  \
             \"INSERT INTO paid (id, amount) VALUES (:id, :amount)\",\n  \
             \"UPDATE accounts SET balance = balance + :amount WHERE account_id = 'A'\",\n]\n\
             [sink.params]\nid = \"/id\"\namount = {{ field = \"/amount\", type = \"decimal\" }}\n[batch]\nmax_wait = \"200ms\"\n"
        )
    };
    let first: Vec<Out> = (0..300).map(|i| Out::json(i % 2, format!(r#"{{"id":"p{i}","amount":"1"}}"#))).collect();
    kafka.produce("pay", &first);
    let setup = Setup::new(&db, &kafka, &[("pay.toml", &pipeline("pay-v1"))]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("pay", 300).await;
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts").await, "300");

    // A week later: the dedup rows are past retention and purged; the group's offsets are gone (a new group_id is
    // the same state), so its consumer starts at the log start.
    sqlx::query("UPDATE idemflow.dedup SET applied_at = now() - interval '8 days'").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["purge", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success() && out.contains("purged 300 dedup rows"), "{out}{err}");
    let second: Vec<Out> = (300..320).map(|i| Out::json(i % 2, format!(r#"{{"id":"p{i}","amount":"1"}}"#))).collect();
    kafka.produce("pay", &second);
    let setup = Setup::new(&db, &kafka, &[("pay.toml", &pipeline("pay-v2"))]);
    let worker = InProc::start(&setup).await;
    // Records below the floor are skipped, or not even fetched once a batch ended below it (the consumer moves on
    // to the floor: `a_group_that_starts_over_moves_on_to_the_processed_floor`).
    wait_until(Duration::from_secs(60), "the records after the floor applied", || async {
        worker.metric("idemflow_records_applied_total", &[("pipeline", "pay")]) == 20.0
    })
    .await;
    let redelivered = worker.metric("idemflow_duplicates_skipped_total", &[("pipeline", "pay"), ("reason", "redelivered")]);
    assert!(worker.stop().await.is_empty());
    assert!((1.0..=300.0).contains(&redelivered), "the records below the floor fetched: skipped as redelivered ({redelivered})");
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts").await, "320", "each payment once");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 20, "nothing claimed below the floor");

    // The operator's rewind to the log start, to rebuild effects that were lost (here: taken out by hand): the replay
    // is applied where dedup rows no longer cover it.
    sqlx::raw_sql("DELETE FROM paid WHERE id NOT IN (SELECT convert_from(key_id, 'UTF8') FROM idemflow.dedup); UPDATE accounts SET balance = 20")
        .execute(&db.pool)
        .await
        .unwrap();
    let config = setup.config.to_str().unwrap().to_owned();
    let (status, out, err) =
        idemflow(&["rewind", "--config", &config, "--pipeline", "pay", "--to", "earliest"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert_eq!(
        db.scalar::<i64>("SELECT min(resume_from) FROM idemflow.processed WHERE pipeline = 'pay'").await,
        0,
        "the floors go down with the group"
    );
    let worker = InProc::start(&setup).await;
    worker.wait_received("pay", 320).await;
    let applied = worker.metric("idemflow_records_applied_total", &[("pipeline", "pay")]);
    assert!(worker.stop().await.is_empty());
    assert_eq!(applied, 300.0, "the purged records applied again, as the rewind asked; the 20 others are duplicates");
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts").await, "320");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM paid").await, 320);
}

/// Pipeline `pay` (`pipeline`) processes 50 records (`old-0` to `old-49`) of topic `pay` on a cluster of its own,
/// which then goes away with its topic.
async fn processed_on_a_topic_since_deleted(db: &TestDb, pipeline: &str) {
    let old = Kafka::new();
    old.create_topic("pay", 1);
    old.produce("pay", &(0..50).map(|i| Out::json(0, format!(r#"{{"id":"old-{i}"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(db, &old, &[("pay.toml", pipeline)]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("pay", 50).await;
    assert!(worker.stop().await.is_empty());
}

/// A topic deleted and created again under the same name (here: another cluster's topic of that name, its offsets
/// from 0 again, with another topic id) reuses the positions below the pipeline's processed marks, and holds more
/// records (80) than the old one had (50), so only its identity tells it apart: the broker names another topic id
/// than the one the marks were raised on, so the marks are renewed, said in the log, and every record of the new
/// topic applied, none skipped for a position of the old one. Issue 42, items 1 and 4; issue 59, item 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_again_is_processed_from_its_start() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    let pipeline = "topics = [\"pay\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n[batch]\nmax_wait = \"200ms\"\n";
    processed_on_a_topic_since_deleted(&db, pipeline).await;
    let old_id = db.scalar::<Option<String>>("SELECT log_id FROM idemflow.processed WHERE pipeline = 'pay'").await.unwrap_or_default();
    assert_eq!(old_id.len(), 22, "the topic id the marks were raised on, in base64: {old_id:?}");
    let new = Kafka::new();
    new.create_topic("pay", 1);
    new.produce("pay", &(0..80).map(|i| Out::json(0, format!(r#"{{"id":"new-{i}"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(&db, &new, &[("pay.toml", pipeline)]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the new topic's records applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM paid WHERE id LIKE 'new-%'").await == 80
    })
    .await;
    let m = w.scrape();
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "pay")]), 80.0, "every record of the new topic applied");
    assert!(w.log_text().contains("the broker names another log than the one this pipeline's processed marks"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.processed WHERE pipeline = 'pay'").await, 80, "the marks renewed");
    let new_id = db.scalar::<String>("SELECT log_id FROM idemflow.processed WHERE pipeline = 'pay'").await;
    assert!(new_id != old_id && new_id.len() == 22, "the new topic's id kept: {new_id}");
}

/// A broker that gives no topic id (noida-db answers the all-zero id, as brokers before Kafka 2.8 do) and a topic
/// created again there whose log ends (30 records) below the processed mark (50): the log's end is the evidence, so
/// the marks are renewed and its records applied. Issue 59, item 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_again_that_ends_below_the_mark_is_processed_without_topic_ids() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    let pipeline = "topics = [\"pay\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n[batch]\nmax_wait = \"200ms\"\n";
    processed_on_a_topic_since_deleted(&db, pipeline).await;
    let new = noida::Noida::start();
    new.create_topic("pay", 1).await;
    new.produce("pay", 1, &(0..30).map(|i| format!(r#"{{"id":"new-{i}"}}"#)).collect::<Vec<_>>());
    let setup = Setup::with_bootstrap(&db, new.bootstrap(), &[("pay.toml", pipeline)], "", "");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the new topic's records applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM paid WHERE id LIKE 'new-%'").await == 30
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(w.log_text().contains("the partition's log ends below this pipeline's processed mark"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.processed WHERE pipeline = 'pay'").await, 30);
}

/// Records stamped an hour ahead (producers whose clocks run fast, or a scheduled payment's business time), every
/// one of them: applied, their dedup rows aged past retention and purged, then a consumer group that starts over
/// from the log start. Their timestamps are later than the processed mark, yet the log reaches the mark: nothing
/// about the log says the topic was created again, so nothing is applied twice. (Before, the timestamps alone renewed the marks: 400 rows for 200 records.) Issue 59, item 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_stamped_ahead_are_not_applied_again_after_their_dedup_rows_are_purged() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    let kafka = Kafka::new();
    kafka.create_topic("pay", 1);
    let ahead = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64 + 3_600_000;
    let records: Vec<Out> =
        (0..200).map(|i| Out { timestamp_ms: Some(ahead + i), ..Out::json(0, format!(r#"{{"id":"p{i}"}}"#)) }).collect();
    kafka.produce("pay", &records);
    let pipeline = |group: &str| {
        format!(
            "topics = [\"pay\"]\ngroup_id = \"{group}\"\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n\
             [batch]\nmax_records = 50\nmax_wait = \"100ms\"\n"
        )
    };
    let setup = Setup::new(&db, &kafka, &[("pay.toml", &pipeline("pay-v1"))]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("pay", 200).await;
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM paid").await, 200);
    sqlx::query("UPDATE idemflow.dedup SET applied_at = now() - interval '8 days'").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["purge", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success() && out.contains("purged 200 dedup rows"), "{out}{err}");
    let setup = Setup::new(&db, &kafka, &[("pay.toml", &pipeline("pay-v2"))]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the new group at the end", || async { kafka.committed("pay-v2", "pay", 1) == [200] }).await;
    let m = w.scrape();
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "pay")]), 0.0, "nothing applied twice\n{}", w.log_text());
    let skipped = metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "pay"), ("reason", "redelivered")]);
    assert!((1.0..=200.0).contains(&skipped), "the records below the floor fetched were skipped as redelivered ({skipped})\n{m}");
    assert!(!w.log_text().contains("created again"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM paid").await, 200);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 0, "nothing claimed below the floor");
}

/// A group that starts over (here a new `group_id`) far below where the pipeline had processed fetches one batch
/// below the processed floor, not the whole topic: the batch ends below the floor, so the consumer moves on to it
/// (seeks and commits it), says so, and applies what comes after. Before, all 2,000 records were fetched to be
/// skipped one by one. A crash right after the first batch's COMMIT, before its offset commit and the move, costs
/// that batch fetched again. Issue 42, item 1 ("a partition never starts below its processed mark").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_starts_over_moves_on_to_the_processed_floor() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    let kafka = Kafka::new();
    kafka.create_topic("pay", 1);
    let pipeline = |group: &str| {
        format!(
            "topics = [\"pay\"]\ngroup_id = \"{group}\"\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n\
             [batch]\nmax_records = 50\nmax_wait = \"100ms\"\n"
        )
    };
    kafka.produce("pay", &(0..2000).map(|i| Out::json(0, format!(r#"{{"id":"p{i}"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(&db, &kafka, &[("pay.toml", &pipeline("pay-v1"))]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("pay", 2000).await;
    assert!(worker.stop().await.is_empty());
    kafka.produce("pay", &(2000..2010).map(|i| Out::json(0, format!(r#"{{"id":"p{i}"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(&db, &kafka, &[("pay.toml", &pipeline("pay-v2"))]);
    let mut crashed = BinWorker::start_with_env(&setup, &[(idemflow::worker::CRASH_AFTER_COMMITS_VAR, "1")]);
    let status = crashed.wait_exit(Duration::from_secs(60));
    assert!(!status.success() && crashed.log_text().contains("injected crash"), "{}", crashed.log_text());
    assert!(!crashed.log_text().contains("moving on to the processed floor"), "{}", crashed.log_text());
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the records after the floor applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM paid").await == 2010
    })
    .await;
    let m = w.scrape();
    let received = metric(&m, "idemflow_records_received_total", &[("pipeline", "pay")]);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(received < 1000.0, "moved on to the floor after a batch or two, not fetched to the end: {received} received\n{m}");
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "pay")]), 10.0);
    assert!(w.log_text().contains("moving on to the processed floor"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 2010, "nothing claimed twice");
}

/// `[offsets] store = "database"` and a topic deleted and created again: the stored position (50, the old topic's)
/// lies inside the new topic (80 records). Started there, the worker would skip the new topic's first 50 records,
/// lost. The topic's id is not the one the partition's processed mark was raised on, so the partition starts at its
/// log start, said in the log, and the processed marks (renewed on the same evidence) let every new record through.
/// Issue 42, item 4; issue 59, item 2 (the topic's identity, not the records' timestamps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_again_is_not_started_at_the_old_topics_stored_position() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    processed_on_a_topic_since_deleted(&db, STORED).await;
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE pipeline = 'pay'").await, 50);
    let new = Kafka::new();
    new.create_topic("pay", 1);
    new.produce("pay", &(0..80).map(|i| Out::json(0, format!(r#"{{"id":"new-{i}"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(&db, &new, &[("pay.toml", STORED)]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the new topic's records applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM paid WHERE id LIKE 'new-%'").await == 80
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(w.log_text().contains("the topic's id is not the one its processed marks were raised on"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE pipeline = 'pay'").await, 80);
}

/// A pipeline with `[offsets] store = "database"`.
const STORED: &str = "topics = [\"pay\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n\
                      [batch]\nmax_wait = \"200ms\"\n[offsets]\nstore = \"database\"\n";

/// The same on a broker without topic ids (noida-db), its new topic shorter (30 records) than the stored position:
/// the broker's first record produced after the position was stored is below it, so the partition starts at its log
/// start; its log ends below the processed mark, so the marks are renewed and every new record applied. noida-db's
/// ListOffsets answers by timestamp (the mock cluster's does not). Issue 42, item 4; issue 59, item 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_again_is_not_started_at_the_old_topics_stored_position_without_topic_ids() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    processed_on_a_topic_since_deleted(&db, STORED).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let new = noida::Noida::start();
    new.create_topic("pay", 1).await;
    new.produce("pay", 1, &(0..30).map(|i| format!(r#"{{"id":"new-{i}"}}"#)).collect::<Vec<_>>());
    let setup = Setup::with_bootstrap(&db, new.bootstrap(), &[("pay.toml", STORED)], "", "");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the new topic's records applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM paid WHERE id LIKE 'new-%'").await == 30
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(w.log_text().contains("the topic was deleted and created again"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE pipeline = 'pay'").await, 30);
}

/// Producers whose clocks run ahead of the store's, or records stamped with a later event time: records below a
/// stored position (and below a processed floor) stamped after it was stored. With `[offsets] store = "database"`
/// the partition still starts at its stored position: it holds older records too, so it is not a topic created
/// again (one record newer than the position is not enough). And a new group's consumer does not move on to a floor
/// below which a record is newer than the mark: it fetches and skips them, judged batch by batch. Nothing is applied
/// twice either way. Issue 42, items 1 and 4, after review.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_stamped_ahead_neither_send_a_stored_position_back_nor_are_jumped_over() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY);").await;
    let noida = noida::Noida::start();
    noida.create_topic("pay", 1).await;
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    // 150 records stamped an hour ago, then 50 stamped an hour ahead.
    let values: Vec<(String, i64)> = (0..200)
        .map(|i| (format!(r#"{{"id":"p{i}"}}"#), if i < 150 { now_ms - 3_600_000 } else { now_ms + 3_600_000 }))
        .collect();
    noida.produce_at("pay", &values);
    let pipeline = |group: &str, offsets: &str| {
        format!(
            "topics = [\"pay\"]\ngroup_id = \"{group}\"\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n\
             [batch]\nmax_records = 50\nmax_wait = \"100ms\"\n{offsets}"
        )
    };
    let stored = pipeline("pay-v1", "[offsets]\nstore = \"database\"\n");
    let setup = Setup::with_bootstrap(&db, noida.bootstrap(), &[("pay.toml", &stored)], "", "");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "every record applied", || async { db.scalar::<i64>("SELECT count(*) FROM paid").await == 200 }).await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow.offsets WHERE pipeline = 'pay'").await, 200);
    // Started again: at its stored position, nothing fetched again.
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the partition assigned", || async {
        metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "pay")]) == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let received = metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "pay")]);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(received, 0.0, "started at the stored position:\n{}", w.log_text());
    assert!(!w.log_text().contains("created again"), "{}", w.log_text());
    // A new group from the log start: the first batch ends below the floor, yet records below it are newer than the
    // mark, so the consumer fetches them all and skips them.
    let setup = Setup::with_bootstrap(&db, noida.bootstrap(), &[("pay.toml", &pipeline("pay-v2", ""))], "", "");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the new group at the end", || async {
        metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "pay")]) == 200.0
    })
    .await;
    let m = w.scrape();
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(!w.log_text().contains("moving on to the processed floor"), "{}", w.log_text());
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "pay")]), 0.0, "nothing applied twice");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM paid").await, 200);
}
