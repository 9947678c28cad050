//! RocketMQ pipelines against a real broker (the Rust name server and broker from crates.io) and a real Postgres:
//! the core duplicate matrix, a SIGKILL crash loop, two workers rebalancing the queues, the broker restarted, a
//! database outage, and `check`'s refusals.

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, Payments, Rng};
use crate::support::rocketmq::{self, Cluster, Msg, Producer};
use crate::support::*;
use std::time::{Duration, Instant};

/// The shipped RocketMQ example pipeline, reading `topic` in consumer group [`group`]`(topic)`, with its offsets
/// in `store` ("database" or "broker").
fn example(topic: &str, store: &str) -> String {
    std::fs::read_to_string(project_root().join("examples/rocketmq/payments.toml"))
        .unwrap()
        .replace("topic = \"payments\"", &format!("topic = \"{topic}\""))
        .replace("# consumer_group = \"idemflow-payments\"", &format!("consumer_group = \"{}\"", group(topic)))
        .replace("store = \"database\"", &format!("store = \"{store}\""))
}

/// A consumer group of the test's own: the tests share a broker, and RocketMQ shares a group's queues among all
/// its members, whatever they subscribe to.
fn group(topic: &str) -> String {
    format!("idemflow-{topic}")
}

/// The payments stream as messages: the KEYS property is the order id (the same ids as the RabbitMQ tests'
/// message-ids: a republished copy keeps it, a mismatched one reuses it with another amount; a poison message has
/// a key of its own). Each goes to the queue of its record's partition.
fn messages(s: &Payments) -> Vec<Msg> {
    crate::rabbitmq::messages(s)
        .into_iter()
        .map(|m| Msg::keyed(&m.message_id.expect("every message has an id"), String::from_utf8(m.body).unwrap()))
        .collect()
}

async fn send(producer: &mut Producer, topic: &str, s: &Payments, msgs: &[Msg], from: usize) {
    producer.send(topic, msgs, |i| s.records[from + i].partition).await;
}

fn dup(m: &str, reason: &str) -> f64 {
    metric(m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)])
}

/// Waits (at most 240 s) until every operation is durable and every dead letter written; `log` says what the
/// worker did if not.
async fn wait_all_applied(db: &TestDb, s: &Payments, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let rows = db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await;
        let dead = db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await;
        if rows == s.distinct as i64 && dead == s.poison as i64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out: dedup rows {rows} of {}, dead letters {dead} of {}\n{}",
            s.distinct,
            s.poison,
            log().lines().rev().take(40).collect::<Vec<_>>().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the worker has received `n` records, reading its `/metrics`.
async fn wait_received(w: &mut BinWorker, n: usize) {
    let p = [("pipeline", "payments")];
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(&w.scrape(), "idemflow_records_received_total", &p) < n as f64 {
        assert!(Instant::now() < deadline, "received fewer than {n}:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The stored position of every queue (`[offsets] store = "database"`), summed: the next offsets.
async fn stored_sum(db: &TestDb) -> i64 {
    db.scalar::<Option<i64>>("SELECT sum(next_offset)::bigint FROM idemflow.offsets WHERE pipeline = 'payments'").await.unwrap_or(0)
}

/// The core matrix with the binary, as a user runs it: `check` passes, 2,000 operations over 4 queues with
/// republished copies, same-key-other-payload messages and poison messages; rows, sums and the three counters
/// exact; positions stored per queue; `explain` and `dead-letters` name the queue; a producer's retry after the
/// fact is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_matrix_from_a_topic() {
    let ns = rocketmq::shared();
    let topic = format!("payments-{}", unique());
    let db = payments_db(None).await;
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &example(&topic, "database"))], "");
    let s = payments(2_000, 4, false);
    let msgs = messages(&s);
    let mut producer = Producer::start(ns).await;
    send(&mut producer, &topic, &s, &msgs, 0).await;
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "check failed: {out}{err}");
    assert!(out.contains(&format!("topic {topic:?}: ")) && out.contains("read queue(s) on broker-a"), "{out}");
    assert!(out.contains("offsets \"database\""), "{out}");

    let mut w = BinWorker::start(&setup);
    wait_all_applied(&db, &s, || w.log_text()).await;
    wait_received(&mut w, s.records.len()).await;
    let p = [("pipeline", "payments")];
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), s.distinct as f64);
    assert_eq!(dup(&m, "republished"), s.republished as f64, "{m}");
    assert_eq!(dup(&m, "payload_mismatch"), s.mismatched as f64);
    assert_eq!(dup(&m, "redelivered"), 0.0);
    assert_eq!(metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), s.poison as f64);
    assert_counters_add_up(&m);
    assert!(metric(&m, "idemflow_assigned_partitions", &p) >= 4.0, "every queue of the topic: {m}");
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_exactly_once(&db, &s).await;
    assert_eq!(stored_sum(&db).await, s.records.len() as i64, "each queue's next offset is stored");
    let queues: Vec<String> = sqlx::query_scalar("SELECT DISTINCT topic FROM idemflow.offsets WHERE pipeline = 'payments'")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(queues, vec![format!("{topic}/broker-a")]);
    // The broker has the group's consume offsets too (for lag tools), after the batches committed.
    let (committed, end) = rocketmq::group_progress(ns, &group(&topic), &topic).await;
    assert_eq!((committed, end), (s.records.len() as i64, s.records.len() as i64));

    // The dead letters keep the queue, its offset and the message's properties; list and show print them.
    let (t, q, names): (String, i32, Vec<String>) =
        sqlx::query_as("SELECT topic, partition, property_names FROM idemflow.dead_letters ORDER BY id LIMIT 1").fetch_one(&db.pool).await.unwrap();
    assert_eq!(t, format!("{topic}/broker-a"));
    assert!((0..4).contains(&q));
    assert!(names.contains(&"keys".to_owned()) && names.contains(&"message_id".to_owned()), "{names:?}");
    let (status, out, _) = idemflow(&["dead-letters", "list", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success() && out.contains(&format!("{topic}/broker-a/")), "{out}");
    let (status, out, _) =
        idemflow(&["explain", "--config", setup.config.to_str().unwrap(), "--pipeline", "payments", "--key", "ORDERID_150"], setup.dir.path());
    assert!(status.success() && out.contains(&format!("{topic}/broker-a/")), "{out}");

    // A producer's retry after everything was applied: the same keys again, counted republished, nothing applied.
    let again: Vec<Msg> = msgs.iter().filter(|m| m.keys.as_deref().is_some_and(|k| k.starts_with("ORDERID_1"))).take(50).cloned().collect();
    producer.send(&topic, &again, |i| i as i32).await;
    let mut w = BinWorker::start(&setup);
    wait_received(&mut w, again.len()).await;
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), 0.0);
    assert_eq!(dup(&m, "republished") + dup(&m, "payload_mismatch"), again.len() as f64, "{m}");
    assert_eq!(dup(&m, "redelivered"), 0.0, "the stored positions start each queue after what was applied");

    // rewind: refused while a worker is in the group; with none, the topic is consumed again from its start and
    // every record is skipped.
    let config = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["rewind", "--config", config, "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(!status.success() && err.contains("member(s) online"), "{out}{err}");
    assert!(w.sigterm().success());
    producer.stop().await;
    let (status, out, err) = idemflow(&["rewind", "--config", config, "--pipeline", "payments", "--to", "earliest", "--dry-run"], setup.dir.path());
    assert!(status.success() && out.contains("dry run: nothing changed") && out.contains(&format!("{topic}/broker-a/0")), "{out}{err}");
    let total = s.records.len() + again.len();
    assert!(out.contains(&format!("{total} record(s) would be consumed again")), "{out}");
    let (status, out, err) = idemflow(&["rewind", "--config", config, "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(status.success() && out.contains("rewound"), "{out}{err}");
    assert_eq!(stored_sum(&db).await, 0, "the stored positions went back too");
    let mut w = BinWorker::start(&setup);
    wait_received(&mut w, total).await;
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), 0.0, "{m}");
    assert_counters_add_up(&m);
    assert!(w.sigterm().success());
    assert_exactly_once(&db, &s).await;
}

/// At least 10 SIGKILLs at random moments during a stream of more than 20,000 messages over 4 queues, offsets in
/// the broker (the default): every operation once, sums exact. (A kill between COMMIT and the offset update, whose
/// batch comes back `redelivered`, is rare at random moments: [`a_crash_after_commit_replays_the_batch_as_redelivered`]
/// places one there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_loop_sigkill_at_random_moments() {
    let ns = rocketmq::shared();
    let topic = format!("payments-{}", unique());
    let db = payments_db(None).await;
    let s = payments(39_000, 4, false);
    assert!(s.records.len() >= 20_000, "{}", s.records.len());
    let msgs = messages(&s);
    let mut producer = Producer::start(ns).await;
    send(&mut producer, &topic, &s, &msgs, 0).await;
    producer.stop().await;
    let text = with_max_records(&example(&topic, "broker"), 200);
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &text)], "");
    let mut rng = Rng::from_clock();
    let p = [("pipeline", "payments")];
    let (mut kills, mut redelivered) = (0, 0.0);
    while kills < 12 {
        let mut w = BinWorker::start(&setup);
        let start = Instant::now();
        while metric(&w.scrape(), "idemflow_records_received_total", &p) == 0.0 {
            assert!(start.elapsed() < Duration::from_secs(60), "no progress in 60 s:\n{}", w.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Within a quarter of a second: a worker left running longer applies the stream in fewer than 10 kills.
        tokio::time::sleep(Duration::from_millis(rng.below(250))).await;
        let m = w.scrape();
        if !m.is_empty() {
            assert_counters_add_up(&m);
            redelivered += dup(&m, "redelivered");
        }
        w.kill();
        kills += 1;
        if db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await == s.distinct as i64 {
            break;
        }
    }
    assert!(kills >= 10, "only {kills} kills before the stream ended");
    let mut w = BinWorker::start(&setup);
    wait_all_applied(&db, &s, || w.log_text()).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while rocketmq::group_progress(ns, &group(&topic), &topic).await.0 < s.records.len() as i64 {
        assert!(Instant::now() < deadline, "the consume offsets never reached the end:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = w.scrape();
    redelivered += dup(&m, "redelivered");
    assert_counters_add_up(&m);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_exactly_once(&db, &s).await;
    println!(
        "rocketmq crash loop: {kills} SIGKILLs, {} messages, {} operations applied exactly once, {redelivered} counted \
         redelivered, {} republished and {} payload_mismatch injected",
        s.records.len(),
        s.distinct,
        s.republished,
        s.mismatched
    );
}

/// A crash right after a batch's COMMIT and before its consume offsets reach the broker (offsets in the broker):
/// the next worker gets that batch again, skips every record of it as `redelivered`, and applies nothing twice.
/// With `[offsets] store = "database"` the same crash replays nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_commit_replays_the_batch_as_redelivered() {
    let ns = rocketmq::shared();
    for store in ["broker", "database"] {
        let topic = format!("payments-{}", unique());
        let db = payments_db(None).await;
        let s = payments(3_000, 4, false);
        let mut producer = Producer::start(ns).await;
        send(&mut producer, &topic, &s, &messages(&s), 0).await;
        producer.stop().await;
        let text = with_max_records(&example(&topic, store), 100);
        let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &text)], "");
        let crashed = InProc::start_with_faults(&setup, idemflow::worker::Faults { crash_after_commits: Some(5), ..Default::default() }).await;
        assert!(crashed.stop_when_pipelines_end().await.is_empty());
        let w = InProc::start(&setup).await;
        wait_all_applied(&db, &s, String::new).await;
        let m = String::from_utf8(w.metrics.render()).unwrap();
        assert_counters_add_up(&m);
        let redelivered = dup(&m, "redelivered");
        if store == "broker" {
            assert!((1.0..=100.0).contains(&redelivered), "the last batch before the crash comes back: {redelivered}\n{m}");
        } else {
            assert_eq!(redelivered, 0.0, "stored positions replay nothing");
        }
        assert!(w.stop().await.is_empty());
        assert_exactly_once(&db, &s).await;
    }
}

/// Two workers with stored positions: the second joins mid-stream, the group's queues are rebalanced between
/// them (RocketMQ members rebalance independently, so a queue can briefly be held by both: the owner epochs
/// fence the older one), republished copies go to other queues. Every operation once; both worked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_rebalance_the_queues() {
    let ns = rocketmq::shared();
    let topic = format!("payments-{}", unique());
    let db = payments_db(None).await;
    let s = payments(8_000, 4, true);
    let msgs = messages(&s);
    let text = with_max_records(&example(&topic, "database"), 100);
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &text)], "");
    let setup2 = Setup::rocketmq(&db, ns, &[("payments.toml", &text)], "");
    let mut producer = Producer::start(ns).await;
    let half = msgs.len() / 2;
    send(&mut producer, &topic, &s, &msgs[..half], 0).await;
    let mut w1 = BinWorker::start(&setup);
    wait_received(&mut w1, 1_000).await;
    let mut w2 = BinWorker::start(&setup2);
    send(&mut producer, &topic, &s, &msgs[half..], half).await;
    producer.stop().await;
    wait_all_applied(&db, &s, || format!("{}\n---\n{}", w1.log_text(), w2.log_text())).await;
    let p = [("pipeline", "payments")];
    let deadline = Instant::now() + Duration::from_secs(60);
    while stored_sum(&db).await < s.records.len() as i64 {
        assert!(Instant::now() < deadline, "stored positions {} of {}", stored_sum(&db).await, s.records.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (m1, m2) = (w1.scrape(), w2.scrape());
    let applied = metric(&m1, "idemflow_records_applied_total", &p) + metric(&m2, "idemflow_records_applied_total", &p);
    assert_eq!(applied, s.distinct as f64);
    assert!(metric(&m2, "idemflow_records_received_total", &p) > 0.0, "the second worker got queues:\n{}", w2.log_text());
    assert!(metric(&m1, "idemflow_rebalances_total", &[("pipeline", "payments"), ("event", "revoke")]) >= 1.0, "{m1}");
    assert_counters_add_up(&m1);
    assert_counters_add_up(&m2);
    assert!(w1.sigterm().success() && w2.sigterm().success());
    assert_exactly_once(&db, &s).await;
}

/// The broker SIGKILLed mid-stream and started again on its store: the worker's pulls and offset updates fail
/// meanwhile and resume by themselves; nothing is lost, nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_restarted() {
    let mut cluster = Cluster::start();
    let ns = cluster.name_server();
    let topic = "payments";
    let db = payments_db(None).await;
    let s = payments(8_000, 4, false);
    let msgs = messages(&s);
    let half = msgs.len() / 2;
    let mut producer = Producer::start(&ns).await;
    send(&mut producer, topic, &s, &msgs[..half], 0).await;
    producer.stop().await;
    let setup = Setup::rocketmq(&db, &ns, &[("payments.toml", &example(topic, "broker"))], "");
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 1_000).await;
    cluster.kill_broker();
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.start_broker();
    let mut producer = Producer::start(&ns).await;
    send(&mut producer, topic, &s, &msgs[half..], half).await;
    producer.stop().await;
    wait_all_applied(&db, &s, || cluster.broker_log()).await;
    let m = String::from_utf8(w.metrics.render()).unwrap();
    assert_counters_add_up(&m);
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
}

/// Postgres stopped for 30 s: the batch is retried with consumption paused (the client keeps its heartbeats),
/// nothing is consumed twice (`redelivered` 0), and everything is applied once after the database returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_of_30_seconds() {
    let ns = rocketmq::shared();
    let topic = format!("payments-{}", unique());
    let cluster = postgres::Cluster::start().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    let s = payments(6_000, 4, false);
    let msgs = messages(&s);
    let third = msgs.len() / 3;
    let mut producer = Producer::start(ns).await;
    send(&mut producer, &topic, &s, &msgs[..third], 0).await;
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &example(&topic, "database"))], "");
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 500).await;
    cluster.stop().unwrap();
    send(&mut producer, &topic, &s, &msgs[third..], third).await;
    producer.stop().await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    cluster.start_again().unwrap();
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    wait_all_applied(&db, &s, String::new).await;
    let m = String::from_utf8(w.metrics.render()).unwrap();
    let retries: f64 = ["connection", "unavailable", "pool_timeout"]
        .iter()
        .map(|c| metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
        .sum();
    assert!(retries >= 1.0, "the outage was retried: {m}");
    assert_eq!(dup(&m, "redelivered"), 0.0, "nothing was consumed twice");
    assert_counters_add_up(&m);
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
}

/// `check` names what is wrong: an unknown topic, a name server that does not answer; and the configuration
/// refuses what a RocketMQ source has not got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_what_cannot_run() {
    let ns = rocketmq::shared();
    let db = payments_db(None).await;
    let missing = format!("nothing-{}", unique());
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &example(&missing, "database"))], "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}");
    assert!(err.contains(&format!("topic {missing:?} has no route")), "{err}");

    let dead = format!("127.0.0.1:{}", free_port());
    let setup = Setup::rocketmq(&db, &dead, &[("payments.toml", &example("payments", "database"))], "timeout = \"3s\"\n");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}");
    assert!(err.contains("rocketmq:") && err.contains(&dead), "{err}");

    // A consumer group a worker already uses for another topic.
    let (a, b, shared) = (format!("a-{}", unique()), format!("b-{}", unique()), format!("shared-{}", unique()));
    let mut producer = Producer::start(ns).await;
    let one = [Msg::keyed("ORDERID_1", r#"{"order":{"id":"ORDERID_1","account":"ACC-1","amount":"1.00"}}"#)];
    producer.send(&a, &one, |_| 0).await;
    producer.send(&b, &one, |_| 0).await;
    producer.stop().await;
    let on = |topic: &str| example(topic, "database").replace(&format!("consumer_group = \"{}\"", group(topic)), &format!("consumer_group = \"{shared}\""));
    let setup_a = Setup::rocketmq(&db, ns, &[("payments.toml", &on(&a))], "");
    let mut w = BinWorker::start(&setup_a);
    wait_received(&mut w, 1).await;
    let setup_b = Setup::rocketmq(&db, ns, &[("payments.toml", &on(&b))], "");
    let (status, out, err) = idemflow(&["check", "--config", setup_b.config.to_str().unwrap()], setup_b.dir.path());
    assert!(!status.success(), "{out}");
    assert!(err.contains(&format!("consumer group {shared:?} is also used for topic(s) [{a:?}]")), "{err}");
    assert!(w.sigterm().success());

    let text = example("payments", "database").replace("message_key = true", "record_key = true");
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &text)], "");
    let (status, _, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success() && err.contains("key.record_key: a RocketMQ message has no record key"), "{err}");
}

/// docs/rocketmq.md's walkthrough on a RocketMQ topic: `idemflow demo-producer --rocketmq-name-server` sends the demo's
/// payments (order id as KEYS, producer retries and reused order ids among them) while a worker runs the shipped
/// example; every applied payment is deducted once, and the retries are counted as duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_producer_feeds_the_example_pipeline() {
    let ns = rocketmq::shared();
    let topic = format!("payments-{}", unique());
    let db = payments_db(None).await;
    let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &example(&topic, "database"))], "");
    let mut w = BinWorker::start(&setup);
    let producer = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["demo-producer", "--rocketmq-name-server", ns, "--topic", &topic, "--rate", "200"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    unsafe { libc::kill(producer.id() as i32, libc::SIGINT) };
    let out = producer.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{said}");
    let sent: usize = said
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("demo-producer: ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count: {said}"));
    assert!(sent >= 400, "{said}");
    wait_received(&mut w, sent).await;
    let p = [("pipeline", "payments")];
    let m = w.scrape();
    let applied = metric(&m, "idemflow_records_applied_total", &p);
    assert!(applied > 0.0 && dup(&m, "republished") > 0.0, "{m}");
    assert_counters_add_up(&m);
    assert!(w.sigterm().success());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await as f64, applied);
    let expected: String = db.scalar("SELECT sum(amount)::text FROM payments").await;
    assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, expected, "each deduction once");
}

/// `idemflow rewind --to TIME` for a group without consume offsets (a new group: the messages came before any
/// worker ran): a time after every message must not move the queues to their ends, which would skip them all. The
/// group starts a queue without a consume offset at its first offset, so the rewind moves it no further than that,
/// and the next run applies every message. Both offset stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_to_a_time_never_skips_a_queue_without_a_consume_offset() {
    let ns = rocketmq::shared();
    for store in ["broker", "database"] {
        let topic = format!("payments-{}", unique());
        let db = payments_db(None).await;
        let s = payments(200, 4, false);
        let msgs = messages(&s);
        let setup = Setup::rocketmq(&db, ns, &[("payments.toml", &example(&topic, store))], "");
        let config = setup.config.to_str().unwrap();
        // The group exists and has consumed queue 0's first message only: the other queues have no consume offset.
        let mut producer = Producer::start(ns).await;
        send(&mut producer, &topic, &s, &msgs[..1], 0).await;
        let mut w = BinWorker::start(&setup);
        wait_received(&mut w, 1).await;
        assert!(w.sigterm().success(), "{}", w.log_text());
        send(&mut producer, &topic, &s, &msgs[1..], 1).await;
        producer.stop().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let after = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let (status, out, err) = idemflow(&["rewind", "--config", config, "--pipeline", "payments", "--to", &after], setup.dir.path());
        assert!(status.success(), "store {store}: {out}{err}");
        println!("store {store}:\n{out}");
        // However the broker reports a queue without a consume offset (none, or 0), nothing is skipped: the queues
        // never consumed start at their first offset, queue 0 where it was (1).
        let (committed, end) = rocketmq::group_progress(ns, &group(&topic), &topic).await;
        assert!(committed <= 1, "store {store}: no queue moved past what was consumed: {committed} (end {end})\n{out}");
        let mut w = BinWorker::start(&setup);
        wait_all_applied(&db, &s, || w.log_text()).await;
        wait_received(&mut w, s.records.len() - 1).await;
        assert!(w.sigterm().success(), "{}", w.log_text());
        assert_exactly_once(&db, &s).await;
    }
}
