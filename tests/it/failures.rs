//! Breaking things for real: SIGKILL, Postgres restarts and terminated backends, broker faults, group members
//! coming and going, the dead-letter guard and the dead-letter topic.

use crate::support::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A stream of payment deductions with every kind of duplicate, for the shipped `payments` pipeline.
pub(crate) struct Payments {
    pub(crate) records: Vec<Out>,
    pub(crate) distinct: usize,
    pub(crate) republished: usize,
    pub(crate) mismatched: usize,
    pub(crate) poison: usize,
    /// Sum of the amounts of first occurrences, in cents.
    expected_cents: i64,
}

impl Payments {
    /// The sum of the amounts of first occurrences, as a decimal with 2 digits (`1234.56`).
    pub(crate) fn expected_amount(&self) -> String {
        format!("{}.{:02}", self.expected_cents / 100, self.expected_cents % 100)
    }
}

fn amount_cents(i: usize) -> i64 {
    ((i % 1000 + 1) * 100 + i % 100) as i64
}

fn payment(i: usize, cents: i64) -> String {
    format!(
        r#"{{"order":{{"id":"ORDERID_{i}","account":"ACC-{}","amount":"{}.{:02}","currency":"USD"}},"paid_at":"2026-11-29T10:00:00Z"}}"#,
        i % 100,
        cents / 100,
        cents % 100
    )
}

/// `distinct` operations over `partitions`; then 2% republished (same bytes, same partition), 1% with another
/// amount, and poison records, interleaved after their originals. With `cross_partition`, republished copies go
/// to another partition.
pub(crate) fn payments(distinct: usize, partitions: i32, cross_partition: bool) -> Payments {
    let mut records = Vec::new();
    let (mut republished, mut mismatched, mut poison) = (0, 0, 0);
    let part = |i: usize| (i % partitions as usize) as i32;
    for i in 0..distinct {
        records.push(Out::json(part(i), payment(i, amount_cents(i))));
        if i >= 100 && i % 50 == 0 {
            let j = i - 100; // a retry of an earlier operation, later in the stream
            let p = if cross_partition { (part(j) + 1) % partitions } else { part(j) };
            records.push(Out::json(p, payment(j, amount_cents(j))));
            republished += 1;
        }
        if i >= 100 && i % 100 == 7 {
            let j = i - 50;
            records.push(Out::json(part(j), payment(j, amount_cents(j) + 1)));
            mismatched += 1;
        }
        if i % 500 == 3 {
            records.push(Out::json(part(i), format!("{{\"order\": poison {i}")));
            poison += 1;
        }
    }
    let expected_cents = (0..distinct).map(amount_cents).sum();
    Payments { records, distinct, republished, mismatched, poison, expected_cents }
}

/// Starts the worker of `setup` again and again and SIGKILLs it at a random moment once it is applying
/// (`pause_ms` plus up to `jitter_ms` after it first received records), until `max` kills or until consumer group
/// `idemflow-payments` has committed topic `payments` to its end. Returns the kills.
pub(crate) async fn kill_repeatedly(setup: &Setup, kafka: &Kafka, partitions: i32, max: usize, pause_ms: u64, jitter_ms: u64) -> usize {
    let mut rng = Rng::from_clock();
    let end = kafka.end_offsets("payments", partitions);
    let mut kills = 0;
    while kills < max {
        let mut w = BinWorker::start(setup);
        let start = Instant::now();
        while metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]) == 0.0 {
            assert!(start.elapsed() < Duration::from_secs(30), "no progress in 30 s:\n{}", w.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(pause_ms + rng.below(jitter_ms))).await;
        w.kill();
        kills += 1;
        if kafka.committed("idemflow-payments", "payments", partitions) == end {
            break;
        }
    }
    kills
}

const ACCOUNTS: &str = "INSERT INTO accounts SELECT 'ACC-' || g, 0 FROM generate_series(0, 99) g;";

pub(crate) async fn payments_db(admin: Option<&str>) -> TestDb {
    let sql = std::fs::read_to_string(project_root().join("pipelines/payments.sql")).unwrap() + ACCOUNTS;
    match admin {
        Some(url) => TestDb::on(url, &sql).await,
        None => TestDb::new(&sql).await,
    }
}

pub(crate) fn shipped() -> String {
    std::fs::read_to_string(project_root().join("pipelines/payments.toml")).unwrap()
}

/// Every operation applied once, amounts exact, every poison record dead-lettered once.
pub(crate) async fn assert_exactly_once(db: &TestDb, s: &Payments) {
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, s.distinct as i64);
    assert_eq!(db.scalar::<i64>("SELECT count(DISTINCT order_id) FROM payments").await, s.distinct as i64);
    let expected = format!("{}.{:02}", s.expected_cents / 100, s.expected_cents % 100);
    assert_eq!(db.scalar::<String>("SELECT sum(amount)::text FROM payments").await, expected);
    assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, expected, "each deduction once");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, s.distinct as i64);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, s.poison as i64);
}

pub(crate) async fn wait_all_durable(db: &TestDb, kafka: &Kafka, group: &str, topic: &str, partitions: i32, s: &Payments) {
    wait_all_durable_or_report(db, kafka, group, topic, partitions, s, &[]).await
}

/// [`wait_all_durable`], showing the state and the tail of each worker's log if it times out.
pub(crate) async fn wait_all_durable_or_report(
    db: &TestDb,
    kafka: &Kafka,
    group: &str,
    topic: &str,
    partitions: i32,
    s: &Payments,
    workers: &[&BinWorker],
) {
    let end = kafka.end_offsets(topic, partitions);
    let done = || async {
        db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await == s.distinct as i64
            && db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await == s.poison as i64
            && kafka.committed(group, topic, partitions) == end
    };
    let deadline = Instant::now() + Duration::from_secs(240);
    while !done().await {
        if Instant::now() > deadline {
            let tails: Vec<String> = workers
                .iter()
                .map(|w| w.log_text().lines().rev().filter(|l| !l.contains("payload_mismatch") && !l.contains("dead-lettered")).take(40).collect::<Vec<_>>().join("\n"))
                .collect();
            type Backend = (i32, Option<String>, Option<String>, Option<String>, Option<String>);
            let activity: Vec<Backend> = sqlx::query_as(
                "SELECT pid, state, wait_event_type, wait_event, left(query, 80) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap();
            panic!(
                "timed out waiting for every record durable and every offset committed: dedup rows {} of {}, dead \
                 letters {} of {}, committed {:?}, end {end:?}\nbackends: {activity:#?}\n{}",
                db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await,
                s.distinct,
                db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await,
                s.poison,
                kafka.committed(group, topic, partitions),
                tails.join("\n=====\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn sum_metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && (l.as_bytes().get(name.len()) == Some(&b'{') || l.as_bytes().get(name.len()) == Some(&b' ')))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// received = applied + duplicates + dead letters + tombstones, in any scrape.
pub(crate) fn assert_counters_add_up(m: &str) {
    let received = sum_metric(m, "idemflow_records_received_total");
    let parts = sum_metric(m, "idemflow_records_applied_total")
        + sum_metric(m, "idemflow_duplicates_skipped_total")
        + sum_metric(m, "idemflow_dead_letters_total")
        + sum_metric(m, "idemflow_tombstones_skipped_total");
    assert_eq!(received, parts, "counters do not add up:\n{m}");
}

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// Seeded from the clock: each run kills at other moments.
    pub(crate) fn from_clock() -> Rng {
        Rng(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The crash test: 100,000+ records with injected duplicates of every kind; the worker process is SIGKILLed at
/// random moments while it works, 20 times, and restarted each time. At the end every operation is applied exactly
/// once, nothing is missing, and a full replay applies nothing and counts every record as redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_test_sigkill_at_random_moments() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    const PARTITIONS: i32 = 8;
    kafka.create_topic("payments", PARTITIONS);
    let distinct = std::env::var("IDEMFLOW_CRASH_OPERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(97_000);
    let s = payments(distinct, PARTITIONS, false);
    assert!(s.records.len() >= 100_000 || distinct != 97_000, "{}", s.records.len());
    kafka.produce("payments", &s.records);
    let props = "\"session.timeout.ms\" = \"1500\"\n\"heartbeat.interval.ms\" = \"200\"";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &shipped())], props, "");
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    let mut rng = Rng(seed);
    let mut kills = 0;
    let mut applied_before_kills = 0.0;
    let target: usize = std::env::var("IDEMFLOW_CRASH_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let end = kafka.end_offsets("payments", PARTITIONS);
    while kills < target {
        let w = BinWorker::start(&setup);
        // Kill only once the worker is applying batches: first progress, then a random moment. A fast machine
        // can get through the whole stream before `target` kills: once every offset is committed there is
        // nothing left to receive, and the kills end there.
        let start = Instant::now();
        let mut finished = false;
        let mut last_check = Instant::now();
        let progressed = loop {
            let m = w.scrape();
            if metric(&m, "idemflow_records_received_total", &[("pipeline", "payments")]) > 0.0 {
                break true;
            }
            if start.elapsed() > Duration::from_secs(3) && last_check.elapsed() > Duration::from_secs(1) {
                last_check = Instant::now();
                if kafka.committed("idemflow-payments", "payments", PARTITIONS) == end {
                    finished = true;
                    break false;
                }
            }
            if start.elapsed() > Duration::from_secs(30) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if finished {
            eprintln!("the stream was consumed to its end after {kills} kills");
            let mut w = w;
            w.kill();
            break;
        }
        assert!(progressed, "the worker made no progress within 30 s; log:\n{}", w.log_text());
        // At most 0.6 s: the worker applies 15,000 to 20,000 records a second here, so a longer wait lets it finish
        // the stream in fewer kills than the test needs.
        tokio::time::sleep(Duration::from_millis(rng.below(600))).await;
        let m = w.scrape();
        if !m.is_empty() {
            assert_counters_add_up(&m);
            applied_before_kills += metric(&m, "idemflow_records_applied_total", &[("pipeline", "payments")]);
        }
        let mut w = w;
        w.kill();
        kills += 1;
        eprintln!("kill {kills} after {:?}: applied so far {applied_before_kills}", start.elapsed());
    }
    assert!(kills >= 5, "only {kills} kills before the stream ended: the test did not exercise crashes");
    let mut w = BinWorker::start(&setup);
    let started = Instant::now();
    wait_all_durable(&db, &kafka, "idemflow-payments", "payments", PARTITIONS, &s).await;
    eprintln!("final run took {:?}", started.elapsed());
    let last = w.scrape();
    assert_counters_add_up(&last);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_exactly_once(&db, &s).await;

    // Replay everything (a new consumer group of the same pipeline starts at the earliest offsets): nothing is
    // applied, and every record fetched is a redelivery (its position was processed before), whatever its kind;
    // after a batch of each partition below its processed floor, the consumer moves on to the floor, so the group
    // reaches the end of every partition without fetching most of them.
    let replay = shipped().replace("topics = [\"payments\"]", "topics = [\"payments\"]\ngroup_id = \"payments-replay\"");
    let replay_setup = Setup::with(&db, &kafka, &[("payments.toml", &replay)], props, "");
    let mut w = BinWorker::start(&replay_setup);
    let total = s.records.len() as f64;
    let end = kafka.end_offsets("payments", PARTITIONS);
    let replay = wait_until(Duration::from_secs(240), "the full replay", || async {
        kafka.committed("payments-replay", "payments", PARTITIONS) == end
    });
    if tokio::time::timeout(Duration::from_secs(240), replay).await.is_err() {
        panic!("replay incomplete: {}\nlog tail:\n{}", w.scrape().lines().filter(|l| l.contains("received") || l.contains("commits")).collect::<Vec<_>>().join("\n"),
            w.log_text().lines().rev().take(15).collect::<Vec<_>>().join("\n"));
    }
    let m = w.scrape();
    let dup = |r| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", r)]);
    let received = metric(&m, "idemflow_records_received_total", &[("pipeline", "payments")]);
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "payments")]), 0.0);
    assert_eq!(dup("redelivered"), received);
    assert!(received > 0.0 && received < total, "moved on to the floors: {received} of {total} fetched");
    assert!(w.log_text().contains("moving on to the processed floor"), "{}", w.log_text());
    assert_eq!(dup("republished"), 0.0);
    assert_eq!(dup("payload_mismatch"), 0.0);
    assert_counters_add_up(&m);
    assert!(w.sigterm().success());
    assert_exactly_once(&db, &s).await;
    println!(
        "crash test (seed {seed}): {kills} SIGKILLs, {} records, {} applied exactly once ({} counted applied \
         before kills), injected: {} republished, {} payload_mismatch, {} poison; last run counted: {last_line}; \
         replay counted redelivered {}, republished {}, payload_mismatch {}; dead letters {}",
        s.records.len(),
        s.distinct,
        applied_before_kills,
        s.republished,
        s.mismatched,
        s.poison,
        dup("redelivered"),
        dup("republished"),
        dup("payload_mismatch"),
        s.poison,
        last_line = ["redelivered", "republished", "payload_mismatch"]
            .iter()
            .map(|r| format!("{r}={}", metric(&last, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", r)])))
            .collect::<Vec<_>>()
            .join(" "),
    );
}

/// Postgres is restarted in the middle of a run: no loss, no double effect, no dead letters from the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_run() {
    let cluster = postgres::Cluster::start().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 4);
    let s = payments(15_000, 4, false);
    // Half before the outage, half during it, so batches certainly meet it however fast the worker is.
    let (first, rest) = s.records.split_at(s.records.len() / 2);
    kafka.produce("payments", first);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &shipped())]);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 2_000).await;
    cluster.stop().unwrap();
    kafka.produce("payments", rest);
    // Longer than the pool's acquire_timeout (2 s here), which would otherwise ride out the outage unnoticed.
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster.start_again().unwrap();
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    wait_all_durable(&db, &kafka, "idemflow-payments", "payments", 4, &s).await;
    let retries: f64 = ["connection", "unavailable", "pool_timeout"]
        .iter()
        .map(|c| w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
        .sum();
    assert!(retries >= 1.0, "the outage must have been retried");
    assert_counters_add_up(&String::from_utf8(w.metrics.render()).unwrap());
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
}

/// Postgres down for 30 s with `max.poll.interval.ms = 7000` and the pool's default 10 s acquire wait: the consumer
/// keeps polling while the batch waits for the database, so it never exceeds the poll interval, never leaves its
/// group (no revoke, no rebalance error), and every operation is applied once after the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_longer_than_the_poll_interval_keeps_the_group() {
    let cluster = postgres::Cluster::start().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 2);
    let s = payments(4_000, 2, false);
    let (first, rest) = s.records.split_at(s.records.len() / 4);
    kafka.produce("payments", first);
    let props = "\"session.timeout.ms\" = \"6000\"\n\"max.poll.interval.ms\" = \"7000\"";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &shipped())], props, "");
    let text = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(&setup.config, text.replace("acquire_timeout = \"2s\"", "acquire_timeout = \"10s\"")).unwrap();
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 500).await;
    cluster.stop().unwrap();
    kafka.produce("payments", rest);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let retries: f64 = ["connection", "unavailable", "pool_timeout"]
        .iter()
        .map(|c| w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
        .sum();
    assert!(retries >= 1.0, "the outage must have been retried");
    cluster.start_again().unwrap();
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    wait_all_durable(&db, &kafka, "idemflow-payments", "payments", 2, &s).await;
    for event in ["revoke", "error"] {
        assert_eq!(w.metric("idemflow_rebalances_total", &[("pipeline", "payments"), ("event", event)]), 0.0,
            "the consumer left its group during the outage ({event})");
    }
    assert_eq!(w.metric("idemflow_rebalances_total", &[("pipeline", "payments"), ("event", "assign")]), 1.0);
    assert_counters_add_up(&String::from_utf8(w.metrics.render()).unwrap());
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
}

/// `[offsets] store = "database"`: a rebalance while Postgres is down (worker B leaves the group during a 20 s
/// outage, longer than `max.poll.interval.ms = 7000`), so worker A must claim B's partitions, and its own again,
/// while the database is unreachable. The claim waits for the database without holding up A's poll: A never exceeds
/// the poll interval or leaves the group, and after the outage every operation is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_during_a_database_outage_claims_without_stopping_the_poll() {
    let cluster = postgres::Cluster::start().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 4);
    let s = payments(4_000, 4, false);
    let (first, rest) = s.records.split_at(s.records.len() / 4);
    kafka.produce("payments", first);
    let props = "\"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"500\"\n\"max.poll.interval.ms\" = \"7000\"";
    let pipeline = shipped() + "\n[offsets]\nstore = \"database\"\n";
    let setups: Vec<Setup> = (0..2).map(|_| Setup::with(&db, &kafka, &[("payments.toml", &pipeline)], props, "")).collect();
    let mut a = BinWorker::start(&setups[0]);
    let mut b = BinWorker::start(&setups[1]);
    let assigned = |w: &BinWorker| metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "both workers owning partitions", || async { assigned(&a) > 0.0 && assigned(&b) > 0.0 }).await;
    cluster.stop().unwrap();
    kafka.produce("payments", rest);
    b.sigterm(); // it leaves the group: A is assigned every partition and must claim them
    tokio::time::sleep(Duration::from_secs(20)).await;
    let log = a.log_text();
    assert!(log.contains("cannot claim the stored positions"), "the claim must have met the outage:\n{log}");
    assert_eq!(assigned(&a), 0.0, "no partition is consumed before its claim");
    cluster.start_again().unwrap();
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    wait_all_durable_or_report(&db, &kafka, "idemflow-payments", "payments", 4, &s, &[&a]).await;
    let log = a.log_text();
    assert!(!log.contains("maximum poll interval"), "the consumer exceeded max.poll.interval.ms:\n{log}");
    assert_eq!(assigned(&a), 4.0);
    assert!(a.sigterm().success(), "{}", a.log_text());
    assert_exactly_once(&db, &s).await;
}

/// The worker's backends are terminated (`pg_terminate_backend`) again and again mid-run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_terminated_mid_run() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 4);
    let s = payments(15_000, 4, false);
    kafka.produce("payments", &s.records);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &shipped())]);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 1_000).await;
    let mut terminated = 0;
    for _ in 0..8 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name <> 'keep'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(0);
        terminated += n;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(terminated > 0);
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    wait_all_durable(&db, &kafka, "idemflow-payments", "payments", 4, &s).await;
    assert_counters_add_up(&String::from_utf8(w.metrics.render()).unwrap());
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
}

/// Broker faults from the mock cluster: fetch and offset-commit request errors, injected latency, the broker down
/// and up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_faults() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 4);
    let s = payments(10_000, 4, false);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &shipped())]);
    let (first, rest) = s.records.split_at(3_000);
    kafka.produce("payments", first);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 500).await;
    let mock = kafka.mock();
    mock.request_errors(RDKafkaApiKey::Fetch, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION; 5]);
    mock.request_errors(RDKafkaApiKey::OffsetCommit, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS; 3]);
    mock.broker_round_trip_time(1, Duration::from_millis(150)).unwrap();
    kafka.produce("payments", &rest[..3_000]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    mock.broker_down(1).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    mock.broker_up(1).unwrap();
    mock.broker_round_trip_time(1, Duration::ZERO).unwrap();
    kafka.produce("payments", &rest[3_000..]);
    wait_all_durable(&db, &kafka, "idemflow-payments", "payments", 4, &s).await;
    assert_counters_add_up(&String::from_utf8(w.metrics.render()).unwrap());
    assert!(w.metric("idemflow_offset_commits_total", &[("pipeline", "payments"), ("result", "error")]) >= 1.0);
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
}

/// Three worker processes in one consumer group, joining, being killed and leaving mid-stream, with the same
/// operations republished to other partitions (so two members can hold the same key at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_members_join_and_leave_mid_stream() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 6);
    let s = payments(30_000, 6, true);
    kafka.produce("payments", &s.records);
    let props = "\"session.timeout.ms\" = \"3000\"\n\"heartbeat.interval.ms\" = \"300\"";
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &shipped())], props, "");
    let setups: Vec<Setup> = (0..3).map(|_| Setup::with(&db, &kafka, &[("payments.toml", &shipped())], props, "")).collect();
    let received = |w: &BinWorker| metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    let mut a = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "A to start", || async { received(&a) > 0.0 }).await;
    let mut b = BinWorker::start(&setups[0]);
    let mut c = BinWorker::start(&setups[1]);
    tokio::time::sleep(Duration::from_secs(4)).await;
    b.kill(); // a member dies
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(a.sigterm().success(), "{}", a.log_text()); // a member leaves cleanly
    let b2 = BinWorker::start(&setups[2]); // and one joins
    wait_all_durable(&db, &kafka, "idemflow-payments", "payments", 6, &s).await;
    for w in [&b2, &c] {
        assert_counters_add_up(&w.scrape());
    }
    assert!(c.sigterm().success(), "{}", c.log_text());
    drop(b2);
    assert_exactly_once(&db, &s).await;
}

/// A bad deploy: every record is undecodable. The pipeline stops once the dead-letter share of the window goes
/// over the limit, rather than dead-lettering the whole stream; the offending batch is not committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_ratio_guard_stops_the_pipeline() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let p = format!("{}\n[dead_letters]\nmax_ratio = 0.2\nwindow = 200\nmin_records = 50\n", with_max_records(&shipped(), 20));
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &p)]);
    let mut records: Vec<Out> = (0..100).map(|i| Out::json(0, payment(i, 100))).collect();
    records.extend((0..400).map(|i| Out::json(0, format!("<xml>{i}</xml>"))));
    kafka.produce("payments", &records);
    let w = InProc::start(&setup).await;
    wait_until(Duration::from_secs(30), "the pipeline to stop", || async {
        String::from_utf8(w.metrics.render()).unwrap().contains("idemflow_pipeline_up{pipeline=\"payments\"} 0")
    })
    .await;
    let failures = w.stop().await;
    assert_eq!(failures.len(), 1);
    assert!(failures[0].to_string().contains("max_ratio"), "{}", failures[0]);
    let dead = db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await;
    assert!(dead > 0 && dead <= 60, "only the records before the limit was crossed are dead-lettered: {dead}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 100);
    let committed = kafka.committed("idemflow-payments", "payments", 1)[0];
    assert_eq!(committed, 100 + dead, "the refused batch is not committed");
}

/// With `[dead_letters] topic`, every dead letter is also produced to Kafka with provenance headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_produced_to_the_dead_letter_topic() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    kafka.create_topic("payments.dlq", 1);
    let p = format!("{}\n[dead_letters]\ntopic = \"payments.dlq\"\n", shipped());
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &p)]);
    kafka.produce(
        "payments",
        &[
            Out::json(0, payment(1, 100)),
            Out { partition: 0, key: Some(b"k-2".to_vec()), value: Some(b"not json".to_vec()), ..Out::default() },
            Out::json(0, r#"{"order":{"id":"ORDERID_3","account":"NOPE","amount":"1.00"}}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 3).await;
    assert!(w.stop().await.is_empty());
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("group.id", "dlq-reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    c.subscribe(&["payments.dlq"]).unwrap();
    type Received = (Option<Vec<u8>>, HashMap<String, String>);
    let mut got: Vec<Received> = Vec::new();
    // Reads the topic until `n` dead letters in all were received, for 30 s at most.
    let read_up_to = |got: &mut Vec<Received>, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.len() < n && Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
                let headers = m
                    .headers()
                    .map(|h| h.iter().map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned())).collect())
                    .unwrap_or_default();
                got.push((m.payload().map(<[u8]>::to_vec), headers));
            }
        }
    };
    read_up_to(&mut got, 2);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].0.as_deref(), Some(&b"not json"[..]));
    assert_eq!(got[0].1["idemflow.reason"], "decode_failed");
    assert_eq!(got[0].1["idemflow.topic"], "payments");
    assert_eq!(got[0].1["idemflow.offset"], "1");
    assert_eq!(got[1].1["idemflow.reason"], "side_effect_rejected");
    assert!(got[1].1["idemflow.error"].contains("SQLSTATE 23503"), "{:?}", got[1].1);
    assert_eq!(kafka.committed("idemflow-payments", "payments", 1), vec![3]);

    // The records consumed again from below the processed floor (here the group's offset set back, as after a crash
    // before the dead letters' publish was confirmed): the applied one is skipped, and both dead letters, the one the
    // side effect's error made included, are produced to the topic again (at least once), not counted again.
    kafka.set_committed("idemflow-payments", "payments", 0, 0);
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 3).await;
    let redelivered = w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "redelivered")]);
    let dead: f64 = ["decode_failed", "side_effect_rejected"]
        .iter()
        .map(|r| w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", r)]))
        .sum();
    assert!(w.stop().await.is_empty());
    assert_eq!((redelivered, dead), (3.0, 0.0));
    read_up_to(&mut got, 4);
    let reasons: Vec<&str> = got[2..].iter().map(|(_, h)| h["idemflow.reason"].as_str()).collect();
    assert_eq!(reasons, ["decode_failed", "side_effect_rejected"], "both dead letters produced again");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 2, "stored once each");
}

/// A rebalance while a batch is in its transaction that takes the partition away and gives it straight back (the
/// eager protocol revokes everything first): records that arrived after the partition came back are kept and
/// applied, the batch's late offset commit is skipped, and every record is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_revoked_and_given_back_during_a_batch_loses_nothing() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n\
                    [batch]\nmax_records = 50\nmax_wait = \"200ms\"\n";
    let (db, kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 1, &[("t.toml", pipeline)]).await;
    let records = |from: i32, to: i32| (from..to).map(|i| Out::json(0, format!(r#"{{"id":"r-{i}"}}"#))).collect::<Vec<_>>();
    let w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the worker owning the partition", || async {
        metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "t")]) == 1.0
    })
    .await;
    // The first batch cannot commit while the table is locked.
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE t IN EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    kafka.produce("t", &records(0, 50));
    wait_until(Duration::from_secs(30), "the first batch waiting for the lock", || async {
        db.scalar::<i64>("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()").await >= 1
    })
    .await;
    kafka.produce("t", &records(50, 200));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Another member joins: the group revokes the partition from the worker (eager protocol) and assigns it to one
    // of the two. The range assignor gives it to the member whose id sorts first, and the mock cluster's member ids
    // are pointers ("%p" in librdkafka's rdkafka_mock_cgrp.c), so which one is not fixed: when it went to the other
    // member, that member leaves the group and the partition comes back to the worker, still while its batch waits.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let member = {
        let (bootstrap, stop) = (kafka.bootstrap().to_owned(), stop.clone());
        std::thread::spawn(move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("group.id", "idemflow-t")
                .set("client.id", "zzzz-member")
                .set("enable.auto.commit", "false")
                .set("session.timeout.ms", "6000")
                .create()
                .unwrap();
            c.subscribe(&["t"]).unwrap();
            let mut got = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(Ok(_)) = c.poll(Duration::from_millis(100)) {
                    got += 1;
                }
            }
            got
        })
    };
    let rebalanced = wait_until(Duration::from_secs(90), "the worker's partition revoked and assigned again", || async {
        let m = w.scrape();
        metric(&m, "idemflow_rebalances_total", &[("pipeline", "t"), ("event", "revoke")]) >= 1.0
            && metric(&m, "idemflow_rebalances_total", &[("pipeline", "t"), ("event", "assign")]) >= 2.0
    });
    if tokio::time::timeout(Duration::from_secs(35), rebalanced).await.is_err() {
        panic!("no rebalance; log:\n{}", w.log_text());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let owned = || async { metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "t")]) == 1.0 };
    let mut member = Some(member);
    let mut other_read = 0;
    if !owned().await {
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        other_read = member.take().unwrap().join().unwrap();
        let back = wait_until(Duration::from_secs(60), "the partition given back to the worker", owned);
        if tokio::time::timeout(Duration::from_secs(65), back).await.is_err() {
            panic!("the partition did not come back; log:\n{}", w.log_text());
        }
    }
    assert!(
        db.scalar::<i64>("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()").await >= 1,
        "the first batch still waits for the lock: the partition went and came back during it"
    );
    lock.rollback().await.unwrap();
    let done = wait_until(Duration::from_secs(60), "every record applied", || async {
        db.scalar::<i64>("SELECT count(*) FROM t").await == 200
    });
    if tokio::time::timeout(Duration::from_secs(65), done).await.is_err() {
        panic!("applied {} of 200; log:\n{}", db.scalar::<i64>("SELECT count(*) FROM t").await, w.log_text());
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(member) = member {
        other_read = member.join().unwrap();
    }
    // The other member starts at the partition's end (no committed offset, auto.offset.reset = latest): whether or
    // not it held the partition for a while, it read nothing.
    assert_eq!(other_read, 0, "the other member read no record");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 200);
}
