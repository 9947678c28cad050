//! Faults a process kill does not make: packets that vanish on the way to the database and to the broker (a
//! half-open TCP connection, no RST), for a moment and for longer than every timeout, then healed. Debian's
//! `iptables` drops them on loopback (`-I INPUT -i lo -p tcp --dport PORT -j DROP`, and `--sport` for the answers),
//! only on ports of servers the test started itself; the rules are removed when the test ends, however it ends.
//! Nothing is lost, nothing applied twice, every hang is bounded by a documented timeout (`[database]
//! batch_timeout`, the pool's `acquire_timeout`, librdkafka's `socket.timeout.ms`), and the worker resumes by
//! itself when the link heals. Needs root (the test suite runs as root, as CI does).

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, shipped, wait_all_durable_or_report, Rng};
use crate::support::postgres::Cluster;
use crate::support::*;
use std::process::Command;
use std::time::Duration;

/// Drops every packet to and from a loopback port while it lives (the soak's, [`idemflow::soak::faults::Blackhole`]).
struct Blackhole;

impl Blackhole {
    fn start(port: u16) -> idemflow::soak::faults::Blackhole {
        idemflow::soak::faults::Blackhole::start(port).unwrap_or_else(|e| panic!("{e:#} (Debian package iptables): run the suite as root"))
    }
}

/// The database's packets dropped three times at random moments while the stream flows (so a drop meets a claim,
/// a side effect or a COMMIT in flight), each for longer than `[database] batch_timeout` (5 s here) and the pool's
/// acquire timeout, then once for a moment; the broker's packets dropped for longer than its socket timeout. Every
/// operation applied once, every poison record dead-lettered once, counters add up, and the worker is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packets_dropped_to_the_database_and_the_broker_then_healed() {
    let cluster = Cluster::start_durable().unwrap();
    let port: u16 = url::Url::parse(&cluster.url()).unwrap().port().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    // 1 ms a payment, so a batch is in flight long enough for a drop to meet it.
    sqlx::raw_sql(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.001); RETURN NEW; END $$;
         CREATE TRIGGER slow BEFORE INSERT ON payments FOR EACH ROW EXECUTE FUNCTION slow();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let kafka = Kafka::new();
    kafka.create_topic("payments", 3);
    let s = payments(12_000, 3, false);
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &shipped())], "\"socket.timeout.ms\" = \"10000\"", "");
    let text = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(&setup.config, text.replace("acquire_timeout = \"2s\"", "acquire_timeout = \"2s\"\nbatch_timeout = \"5s\"")).unwrap();
    let chunks: Vec<&[Out]> = s.records.chunks(s.records.len() / 6 + 1).collect();
    kafka.produce("payments", chunks[0]);
    let mut w = BinWorker::start(&setup);
    let mut rng = Rng::from_clock();
    for (i, chunk) in chunks[1..].iter().enumerate() {
        kafka.produce("payments", chunk);
        tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
        let (what, hold) = match i {
            0..=2 => ("the database", Duration::from_secs(8)),
            3 => ("the database", Duration::from_millis(700)),
            _ => ("the broker", Duration::from_secs(12)),
        };
        if what == "the database" {
            // While a batch is in its transaction (a claim, the side effect, or its COMMIT).
            wait_until(Duration::from_secs(30), "a batch in flight", || async {
                db.scalar::<i64>("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state NOT IN ('idle') \
                     AND backend_type = 'client backend' AND pid <> pg_backend_pid()").await > 0
            })
            .await;
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        }
        let target = if what == "the database" { port } else { broker_port(&kafka) };
        let hole = Blackhole::start(target);
        tokio::time::sleep(hold).await;
        drop(hole);
        println!("dropped {what}'s packets for {hold:?}");
    }
    wait_all_durable_or_report(&db, &kafka, "idemflow-payments", "payments", 3, &s, &[&w]).await;
    wait_until(Duration::from_secs(60), "ready again", || async {
        http_get(setup.metrics, "/readyz").is_ok_and(|(status, _)| status == 200)
    })
    .await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    let retries: f64 = ["connection", "unavailable", "pool_timeout"]
        .iter()
        .map(|c| metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
        .sum();
    assert!(retries >= 1.0, "the drops must have been met and retried:\n{m}");
    assert!(w.log_text().contains("batch_timeout"), "a batch attempt was abandoned on its timeout:\n{}", w.log_text());
    assert!(w.sigterm().success());
    assert_exactly_once(&db, &s).await;
}

/// The mock cluster's broker port (its bootstrap address).
fn broker_port(kafka: &Kafka) -> u16 {
    kafka.bootstrap().split(',').next().unwrap().rsplit_once(':').unwrap().1.parse().unwrap()
}

/// Drops every packet of one TCP connection on loopback (by the client's port) while it lives: the peer of that
/// connection vanishes without a FIN or an RST, as a host does that loses power or its network.
struct Cut {
    client_port: u16,
}

impl Cut {
    fn rules(port: u16) -> [Vec<String>; 2] {
        let p = port.to_string();
        [
            ["INPUT", "-i", "lo", "-p", "tcp", "--sport", &p, "-j", "DROP"].map(str::to_owned).to_vec(),
            ["INPUT", "-i", "lo", "-p", "tcp", "--dport", &p, "-j", "DROP"].map(str::to_owned).to_vec(),
        ]
    }

    fn start(client_port: u16) -> Cut {
        for rule in Self::rules(client_port) {
            let status = Command::new("iptables").arg("-I").args(&rule).status().expect("iptables (Debian package iptables; root)");
            assert!(status.success(), "iptables -I {rule:?}: run the suite as root");
        }
        Cut { client_port }
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        for rule in Self::rules(self.client_port) {
            let _ = Command::new("iptables").arg("-D").args(&rule).status();
        }
    }
}

/// Thirty payments from one account through the SQL form, one account row every batch updates.
const LOCKED_PIPELINE: &str = r#"topics = ["pay"]
[key]
field = "/id"
[sink]
sql = [
  "UPDATE accounts SET balance = balance - :amount WHERE account_id = 'A'",
  "INSERT INTO paid (id, amount) VALUES (:id, :amount)",
]
[sink.params]
id = "/id"
amount = { field = "/amount", type = "decimal" }
[batch]
max_wait = "200ms"
"#;

async fn locked_fixture() -> (TestDb, Kafka, Setup) {
    let db = TestDb::new(
        "CREATE TABLE accounts (account_id text PRIMARY KEY, balance numeric NOT NULL);
         INSERT INTO accounts VALUES ('A', 1000);
         CREATE TABLE paid (id text PRIMARY KEY, amount numeric NOT NULL);",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("pay", 1);
    let setup = Setup::new(&db, &kafka, &[("pay.toml", LOCKED_PIPELINE)]);
    let records: Vec<Out> = (0..30).map(|i| Out::json(0, format!(r#"{{"id":"p{i}","amount":"1"}}"#))).collect();
    kafka.produce("pay", &records);
    (db, kafka, setup)
}

/// Holds the account row's lock from a session of the test's own until dropped or committed.
async fn hold_account_lock(db: &TestDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM accounts WHERE account_id = 'A' FOR UPDATE").execute(&mut *tx).await.unwrap();
    tx
}

/// The client port of the worker's session whose batch waits for the account's lock, once it does.
async fn session_waiting_for_the_lock(db: &TestDb) -> (i32, u16) {
    let query = "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()";
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((pid, port)) = sqlx::query_as::<_, (i32, i32)>(query).fetch_optional(&db.pool).await.unwrap() {
            return (pid, port as u16);
        }
        assert!(std::time::Instant::now() < deadline, "no batch of the worker came to wait for the account's lock");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn session_alive(db: &TestDb, pid: i32) -> bool {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_activity WHERE pid = $1").bind(pid).fetch_one(&db.pool).await.unwrap() > 0
}

/// A worker host that vanishes (its packets to PostgreSQL dropped, then the process SIGKILLed: no FIN, no RST) while
/// its batch waits inside its transaction used to leave that transaction open on the server, holding the batch's
/// dedup and processed-mark row locks, until TCP keepalive ended the session (over two hours with Linux's
/// defaults): the partition's next owner waited all that time. The batch's `idle_in_transaction_session_timeout`
/// (15 s) ends the abandoned session once its statement is done, so the next worker applies every payment, each
/// once, within the bound: 15 s for the session, 6 s for the group's session timeout, and the worker's start.
/// Issue 42, item 9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_vanishes_mid_transaction_holds_its_locks_for_a_bounded_time() {
    let (db, _kafka, setup) = locked_fixture().await;
    let lock = hold_account_lock(&db).await;
    let mut first = BinWorker::start(&setup);
    let (pid, port) = session_waiting_for_the_lock(&db).await;
    let cut = Cut::start(port);
    first.kill();
    // The lock goes; the vanished worker's statement completes, its answer lost, and its session sits idle in
    // its transaction, holding the dedup rows it claimed.
    lock.commit().await.unwrap();
    let killed = std::time::Instant::now();
    let second = BinWorker::start(&setup);
    let bound = Duration::from_secs(45);
    wait_until(bound, "every payment applied by the next worker", || async {
        db.scalar::<i64>("SELECT count(*) FROM paid").await == 30
    })
    .await;
    assert!(!session_alive(&db, pid).await, "the vanished worker's session was ended");
    eprintln!("applied by the next worker {:?} after the kill", killed.elapsed());
    drop(cut);
    drop(second);
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts").await, "970", "each payment once");
}

/// A worker frozen inside its batch transaction (SIGSTOP) for longer than the server's
/// `idle_in_transaction_session_timeout` (1 s, set for the database: shorter than the batch's own, so kept) finds
/// its session ended by the server when it wakes (FATAL, SQLSTATE 25P03): a lost connection, so the batch is
/// retried and applies, instead of the pipeline stopping. Issue 42, item 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_ended_by_idle_in_transaction_session_timeout_is_retried() {
    let (db, _kafka, setup) = locked_fixture().await;
    sqlx::raw_sql("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = %L', current_database(), '1s'); END $$")
        .execute(&db.pool)
        .await
        .unwrap();
    let lock = hold_account_lock(&db).await;
    let worker = BinWorker::start(&setup);
    let (pid, _) = session_waiting_for_the_lock(&db).await;
    worker.signal("STOP");
    lock.commit().await.unwrap();
    wait_until(Duration::from_secs(30), "the frozen worker's session ended by the server", || async { !session_alive(&db, pid).await }).await;
    worker.signal("CONT");
    wait_until(Duration::from_secs(60), "every payment applied", || async { db.scalar::<i64>("SELECT count(*) FROM paid").await == 30 }).await;
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts").await, "970", "each payment once");
    let scrape = worker.scrape();
    assert!(metric(&scrape, "idemflow_db_retries_total", &[("pipeline", "pay"), ("cause", "connection")]) >= 1.0, "{scrape}");
    let log = worker.log_text();
    assert!(!log.contains("pipeline stopped"), "{log}");
}

/// A batch attempt abandoned on `batch_timeout` (its statement stuck behind a row another session holds) has its
/// server session ended: the server rolls it back and releases its claims, and the pool gets the connection back.
/// Before, each abandoned attempt stayed in its statement on the server, holding a pool connection, until the lock
/// was released: after `max_connections` (4) attempts the pool was exhausted. At most one of the worker's sessions
/// waits on the lock at any moment; when the lock goes, the batch commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_abandoned_on_batch_timeout_has_its_session_ended() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let s = payments(3, 1, false);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &shipped())]);
    let text = std::fs::read_to_string(&setup.config).unwrap().replace("[database]\n", "[database]\nbatch_timeout = \"1s\"\n");
    std::fs::write(&setup.config, text).unwrap();
    // Another session holds the row every batch of the stream must update.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE accounts SET balance = balance").execute(&mut *held).await.unwrap();
    kafka.produce("payments", &s.records);
    let mut w = BinWorker::start(&setup);
    let waiting = || async {
        db.scalar::<i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' \
             AND pid <> pg_backend_pid()",
        )
        .await
    };
    let retries = |m: &str| m.lines().filter(|l| l.starts_with("idemflow_db_retries_total{")).filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok()).sum::<f64>();
    // Attempts of 1, 2, 4, 8 and 16 s: five abandoned, more than the pool's 4 connections.
    let start = std::time::Instant::now();
    let mut most = 0;
    while retries(&w.scrape()) < 5.0 {
        assert!(start.elapsed() < Duration::from_secs(90), "five attempts did not time out in 90 s:\n{}", w.log_text());
        most = most.max(waiting().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(most <= 1, "{most} of the worker's sessions waited on the lock at once: abandoned attempts stayed");
    let log = w.log_text();
    assert!(!log.contains("pool timed out"), "the pool ran out of connections:\n{log}");
    held.rollback().await.unwrap();
    wait_until(Duration::from_secs(60), "the batch commits once the lock goes", || async {
        db.scalar::<i64>("SELECT count(*) FROM payments").await == s.distinct as i64
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    crate::failures::assert_exactly_once(&db, &s).await;
}
