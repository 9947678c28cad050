//! RabbitMQ pipelines against a real broker (Debian's rabbitmq-server) and a real Postgres: the core duplicate
//! matrix, a SIGKILL crash loop, a broker restart and closed connections, a database outage, two workers on one
//! queue, the shared cases that apply to a queue, and `check`'s refusals.

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, Payments, Rng};
use crate::support::rabbitmq::{self, Client, Msg, Node};
use crate::support::*;
use std::time::{Duration, Instant};

/// The shipped RabbitMQ example pipeline, reading `queue`.
fn example(queue: &str) -> String {
    std::fs::read_to_string(project_root().join("examples/rabbitmq/payments.toml"))
        .unwrap()
        .replace("queue = \"payments\"", &format!("queue = \"{queue}\""))
}

/// The payments stream as messages: the message-id is the order id (a republished copy keeps it, a mismatched
/// one reuses it with another amount); a poison message has an id of its own.
pub(crate) fn messages(s: &Payments) -> Vec<Msg> {
    s.records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let body = String::from_utf8(r.value.clone().unwrap()).unwrap();
            let id = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["order"]["id"].as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("poison-{i}"));
            Msg::json(&id, body)
        })
        .collect()
}

/// [`assert_exactly_once`] for a queue: a poison message redelivered after a lost ack is recorded again (a queue
/// has no stable position to recognise it by), so each poison payload has at least one dead letter.
async fn assert_exactly_once_from_a_queue(db: &TestDb, s: &Payments) {
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, s.distinct as i64);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, s.distinct as i64);
    let expected: String = db.scalar("SELECT sum(amount)::text FROM payments").await;
    assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, expected, "each deduction once");
    assert_eq!(db.scalar::<i64>("SELECT count(DISTINCT payload) FROM idemflow.dead_letters").await, s.poison as i64);
}

/// The business table of the small `orders` pipelines.
const ORDERS_TABLE: &str = "CREATE TABLE orders (id text PRIMARY KEY, amount numeric NOT NULL);";

/// A table-form pipeline on `queue` keyed by message-id, writing `orders`, with more TOML (`extra`) at the end.
fn orders_pipeline(queue: &str, extra: &str) -> String {
    format!(
        "[source]\nkind = \"rabbitmq\"\nqueue = \"{queue}\"\n[key]\nmessage_id = true\n[sink]\ntable = \"orders\"\n\
         [sink.columns]\nid = {{ property = \"message_id\" }}\namount = \"/amount\"\n{extra}"
    )
}

/// The dead-letter exchange cases: a queue, an exchange `dlx` whose queue `dlq` is bound with `bound_key`, and an
/// `orders` pipeline publishing its dead letters to `dlx` with routing key `poison`; a poison message and a good
/// one published.
struct DeadLetterExchangeCase {
    client: Client,
    queue: String,
    dlx: String,
    dlq: String,
    db: TestDb,
    setup: Setup,
}

async fn dead_letter_exchange_case(bound_key: &str) -> DeadLetterExchangeCase {
    let url = rabbitmq::shared_url();
    let (queue, dlx, dlq) = (format!("orders-{}", unique()), format!("dlx-{}", unique()), format!("dlq-{}", unique()));
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    client.declare_exchange_with_queue(&dlx, &dlq, bound_key).await;
    let db = TestDb::new(ORDERS_TABLE).await;
    let pipeline = orders_pipeline(&queue, &format!("[dead_letters]\nexchange = \"{dlx}\"\nrouting_key = \"poison\"\n"));
    let setup = Setup::rabbitmq(&db, url, &[("orders.toml", &pipeline)], "");
    client.publish(&queue, &[Msg::json("o-1", "{\"amount\": oops"), Msg::json("o-2", "{\"amount\": 2}")]).await;
    DeadLetterExchangeCase { client, queue, dlx, dlq, db, setup }
}

/// Waits (at most 10 s) for a message at `dlq` and returns it; `log` says what the worker did if none comes.
async fn next_dead_letter(client: &Client, dlq: &str, log: impl Fn() -> String) -> (Vec<u8>, lapin::types::FieldTable, Option<String>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(m) = client.get(dlq).await {
            return m;
        }
        assert!(Instant::now() < deadline, "no dead letter at the exchange's queue:\n{}", log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn dup(m: &str, reason: &str) -> f64 {
    metric(m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)])
}

/// Waits until every operation is durable and every dead letter written, and the queue has nothing ready.
async fn wait_all_applied(db: &TestDb, client: &Client, queue: &str, s: &Payments, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let rows = db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await;
        let dead = db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await;
        if rows == s.distinct as i64 && dead >= s.poison as i64 && client.ready(queue).await == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out: dedup rows {rows} of {}, dead letters {dead} of {}, ready {}\n{}",
            s.distinct,
            s.poison,
            client.ready(queue).await,
            log().lines().rev().take(40).collect::<Vec<_>>().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The core matrix with the binary, as a user runs it: `check` passes, 2,000 operations with republished copies,
/// same-key-other-payload messages and poison messages; rows, sums and the three counters exact; the queue is
/// empty after the worker stops (every delivery acknowledged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_matrix_on_a_quorum_queue() {
    let url = rabbitmq::shared_url();
    let queue = format!("payments-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    let db = payments_db(None).await;
    let text = example(&queue).replace("# queue_type = \"quorum\"", "queue_type = \"quorum\"");
    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &text)], "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "check failed: {out}{err}");
    assert!(out.contains(&format!("queue {queue:?}: type quorum as configured")), "{out}");
    assert!(out.contains("queues"), "{out}");

    let s = payments(2_000, 1, false);
    client.publish(&queue, &messages(&s)).await;
    let mut w = BinWorker::start(&setup);
    wait_all_applied(&db, &client, &queue, &s, || w.log_text()).await;
    let p = [("pipeline", "payments")];
    wait_until(Duration::from_secs(30), "every message counted", || async {
        metric(&w.scrape(), "idemflow_records_received_total", &p) >= s.records.len() as f64
    })
    .await;
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), s.distinct as f64);
    assert_eq!(dup(&m, "republished"), s.republished as f64, "{m}");
    assert_eq!(dup(&m, "payload_mismatch"), s.mismatched as f64);
    assert_eq!(dup(&m, "redelivered"), 0.0);
    assert_eq!(metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), s.poison as f64);
    assert_counters_add_up(&m);
    assert!(
        m.lines().any(|l| l.starts_with("idemflow_consumer_lag_records{") && l.contains(&format!("topic=\"{queue}\"")) && l.contains("partition=\"-1\"")),
        "the queue depth is the lag gauge: {m}"
    );
    assert_eq!(metric(&m, "idemflow_assigned_partitions", &p), 1.0);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_exactly_once(&db, &s).await;
    assert_eq!(client.ready(&queue).await, 0, "every delivery was acknowledged");

    // The dead letters keep the queue, exchange, routing key and properties; list and show print them.
    let props: (String, i32, Vec<String>, Vec<String>) = sqlx::query_as(
        "SELECT topic, partition, property_names, property_values FROM idemflow.dead_letters ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((props.0.as_str(), props.1), (queue.as_str(), -1));
    assert!(props.2.contains(&"routing_key".to_owned()) && props.3.contains(&queue), "{props:?}");
    assert!(props.2.contains(&"message_id".to_owned()), "{props:?}");
    let (status, out, _) = idemflow(&["dead-letters", "list", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success() && out.contains(&format!("queue {queue} ")), "{out}");
    let id: i64 = db.scalar("SELECT min(id) FROM idemflow.dead_letters").await;
    let (status, out, _) = idemflow(&["dead-letters", "show", "--config", setup.config.to_str().unwrap(), &id.to_string()], setup.dir.path());
    assert!(status.success() && out.contains("property    message_id: poison-") && out.contains("property    exchange: "), "{out}");
    // explain names where the key was applied from.
    let (status, out, _) =
        idemflow(&["explain", "--config", setup.config.to_str().unwrap(), "--pipeline", "payments", "--key", "ORDERID_150"], setup.dir.path());
    assert!(status.success() && out.contains(&format!("from               queue {queue}")), "{out}");

    // A publisher retry after everything was applied: the same message-ids again, counted republished (no
    // redelivery mark), nothing applied.
    let again: Vec<Msg> = messages(&s).into_iter().filter(|m| m.message_id.as_deref().is_some_and(|i| i.starts_with("ORDERID_1"))).take(50).collect();
    client.publish(&queue, &again).await;
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the retries to be skipped", || async {
        metric(&w.scrape(), "idemflow_records_received_total", &p) >= again.len() as f64
    })
    .await;
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_records_applied_total", &p), 0.0);
    assert_eq!(dup(&m, "republished") + dup(&m, "payload_mismatch"), again.len() as f64, "{m}");
    assert!(w.sigterm().success());
    assert_exactly_once(&db, &s).await;
}

/// At least 10 SIGKILLs at random moments during a 33,000-message stream (20,000 ended after 8 once the worker
/// decoded faster): every operation once, sums exact, and
/// the deliveries of batches killed between COMMIT and their ack come back marked and are counted `redelivered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_loop_sigkill_at_random_moments() {
    let url = rabbitmq::shared_url();
    let queue = format!("payments-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    let db = payments_db(None).await;
    // Enough for at least ten lives: a faster worker (the narrower dedup row of PostgreSQL migration 12) applied
    // 32,500 operations in 8 kills once, each life up to 300 ms.
    let s = payments(45_000, 1, false);
    assert!(s.records.len() >= 45_500, "{}", s.records.len());
    client.publish(&queue, &messages(&s)).await;
    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &example(&queue))], "");
    let mut rng = Rng::from_clock();
    let p = [("pipeline", "payments")];
    let (mut kills, mut redelivered) = (0, 0.0);
    while kills < 12 {
        let mut w = BinWorker::start(&setup);
        let start = Instant::now();
        loop {
            if metric(&w.scrape(), "idemflow_records_received_total", &p) > 0.0 {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no progress in 30 s:\n{}", w.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(200))).await;
        let m = w.scrape();
        if !m.is_empty() {
            assert_counters_add_up(&m);
            redelivered += dup(&m, "redelivered");
        }
        w.kill();
        kills += 1;
        if db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await == s.distinct as i64 && client.ready(&queue).await == 0 {
            break;
        }
    }
    assert!(kills >= 10, "only {kills} kills before the stream ended");
    let mut w = BinWorker::start(&setup);
    wait_all_applied(&db, &client, &queue, &s, || w.log_text()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = w.scrape();
    redelivered += dup(&m, "redelivered");
    assert_counters_add_up(&m);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(client.ready(&queue).await, 0);
    assert_exactly_once_from_a_queue(&db, &s).await;
    assert!(redelivered > 0.0, "kills between COMMIT and ack must show up as redelivered duplicates");
    println!(
        "rabbitmq crash loop: {kills} SIGKILLs, {} messages, {} operations applied exactly once, {redelivered} counted redelivered, \
         {} republished and {} payload_mismatch injected",
        s.records.len(),
        s.distinct,
        s.republished,
        s.mismatched
    );
}

/// The broker's side of failures: every connection closed by the broker (`rabbitmqctl close_all_connections`) and
/// the broker restarted mid-stream. The worker reconnects by itself; nothing is lost, nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_and_closed_connections() {
    let mut node = Node::start().unwrap();
    let url = node.url();
    let queue = "payments";
    let client = Client::connect(&url).await;
    client.declare(queue, "quorum", false).await;
    let db = payments_db(None).await;
    let s = payments(12_000, 1, false);
    let all = messages(&s);
    let (first, rest) = all.split_at(all.len() / 2);
    client.publish(queue, first).await;
    let setup = Setup::rabbitmq(&db, &url, &[("payments.toml", &example(queue))], "");
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 1_000).await;
    node.ctl(&["close_all_connections", "idemflow test: closing every connection"]).unwrap();
    drop(client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    node.stop().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    node.start_again().unwrap();
    let client = Client::connect(&url).await;
    client.publish(queue, rest).await;
    wait_all_applied(&db, &client, queue, &s, String::new).await;
    assert!(w.metric("idemflow_rebalances_total", &[("pipeline", "payments"), ("event", "revoke")]) >= 2.0, "two losses seen");
    assert_counters_add_up(&String::from_utf8(w.metrics.render()).unwrap());
    assert!(w.stop().await.is_empty());
    assert_exactly_once_from_a_queue(&db, &s).await;
    assert_eq!(client.ready(queue).await, 0);
}

/// Postgres stopped for 30 s: the batch stays unacknowledged, the broker holds back further deliveries at the
/// prefetch limit, nothing is requeued (no delivery comes twice: `redelivered` stays 0), and everything is applied
/// once after the database returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_of_30_seconds_requeues_nothing() {
    let url = rabbitmq::shared_url();
    let queue = format!("payments-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    let cluster = postgres::Cluster::start().unwrap();
    let db = payments_db(Some(&cluster.url())).await;
    let s = payments(6_000, 1, false);
    let all = messages(&s);
    let (first, rest) = all.split_at(all.len() / 3);
    client.publish(&queue, first).await;
    // Batches of 500, so the prefetch window is 1,000 (twice max_records), a third of the stream.
    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &with_max_records(&example(&queue), 500))], "");
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 500).await;
    cluster.stop().unwrap();
    client.publish(&queue, rest).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    // While the database is down, at most the prefetch window (1,000) has left the queue.
    let ready = client.ready(&queue).await as usize;
    assert!(ready + 1_000 + s.records.len() / 3 >= s.records.len(), "ready {ready}: the prefetch window bounds what is taken");
    cluster.start_again().unwrap();
    let db = TestDb { pool: sqlx::PgPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
    wait_all_applied(&db, &client, &queue, &s, String::new).await;
    let m = String::from_utf8(w.metrics.render()).unwrap();
    assert!(sum_retries(&m) >= 1.0, "the outage was retried");
    assert_eq!(dup(&m, "redelivered"), 0.0, "nothing was requeued and delivered again");
    assert_counters_add_up(&m);
    assert!(w.stop().await.is_empty());
    assert_exactly_once_from_a_queue(&db, &s).await;
}

fn sum_retries(m: &str) -> f64 {
    ["connection", "unavailable", "pool_timeout"]
        .iter()
        .map(|c| metric(m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
        .sum()
}

/// Two workers on one queue, every operation published twice back to back, so the two copies are usually in
/// flight on both workers at the same moment: each applied once (the unique index decides), the other copy
/// counted as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_on_one_queue_apply_each_operation_once() {
    let url = rabbitmq::shared_url();
    let queue = format!("payments-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    let db = payments_db(None).await;
    let s = payments(5_000, 1, false);
    // Small batches and prefetch, so both workers get deliveries all the time.
    let text = with_max_records(&example(&queue).replace("# prefetch = 4000", "prefetch = 100"), 50);
    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &text)], "");
    let mut w1 = BinWorker::start(&setup);
    let setup2 = Setup::rabbitmq(&db, url, &[("payments.toml", &text)], "");
    let mut w2 = BinWorker::start(&setup2);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let twice: Vec<Msg> = messages(&s).into_iter().flat_map(|m| [m.clone(), m]).collect();
    client.publish(&queue, &twice).await;
    let deadline = Instant::now() + Duration::from_secs(180);
    let p = [("pipeline", "payments")];
    loop {
        let received = metric(&w1.scrape(), "idemflow_records_received_total", &p) + metric(&w2.scrape(), "idemflow_records_received_total", &p);
        if received >= twice.len() as f64 {
            break;
        }
        assert!(Instant::now() < deadline, "received {received} of {}", twice.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (m1, m2) = (w1.scrape(), w2.scrape());
    let applied = metric(&m1, "idemflow_records_applied_total", &p) + metric(&m2, "idemflow_records_applied_total", &p);
    assert_eq!(applied, s.distinct as f64);
    assert!(metric(&m1, "idemflow_records_applied_total", &p) > 0.0 && metric(&m2, "idemflow_records_applied_total", &p) > 0.0, "both worked");
    assert!(w1.sigterm().success() && w2.sigterm().success());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, s.distinct as i64);
    let expected: String = db.scalar("SELECT sum(amount)::text FROM payments").await;
    assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, expected);
    assert_eq!(client.ready(&queue).await, 0);
}

/// The shared cases that apply to a queue (../shared/cases): a poison message, a missing message-id, a message-id
/// with NUL, an empty body (dead-lettered `decode_failed`), a payload over `max_payload_bytes`; the stream moves on
/// past each, and a valid message after them is applied; the poison one, replayed with a fixed payload, is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_cases_on_a_queue() {
    let url = rabbitmq::shared_url();
    let queue = format!("cases-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "classic", false).await;
    let db = TestDb::new(ORDERS_TABLE).await;
    let pipeline = format!("max_payload_bytes = 4096\n{}", orders_pipeline(&queue, ""));
    let setup = Setup::rabbitmq(&db, url, &[("orders.toml", &pipeline)], "");
    let huge = format!("{{\"amount\": 1, \"pad\": \"{}\"}}", "x".repeat(10_000));
    let huge_len = huge.len() as i64;
    let msgs = vec![
        Msg::json("o-1", "{\"amount\": poison"),
        Msg { message_id: None, body: b"{\"amount\": 2}".to_vec() },
        Msg::json("o-\u{0}3", "{\"amount\": 3}"),
        Msg::json("o-4", ""),
        Msg::json("o-5", huge),
        Msg::json("o-6", "{\"amount\": 6.5}"),
    ];
    client.publish(&queue, &msgs).await;
    let w = InProc::start(&setup).await;
    w.wait_received("orders", msgs.len() as u64).await;
    let reasons: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT reason, payload_bytes FROM idemflow.dead_letters ORDER BY id").fetch_all(&db.pool).await.unwrap();
    let reasons: Vec<(&str, Option<i64>)> = reasons.iter().map(|(r, b)| (r.as_str(), *b)).collect();
    assert_eq!(
        reasons,
        vec![("decode_failed", None), ("key_missing", None), ("key_invalid", None), ("decode_failed", None), ("payload_too_large", Some(huge_len))]
    );
    assert_eq!(db.scalar::<String>("SELECT string_agg(id || '=' || amount, ',') FROM orders").await, "o-6=6.5");
    assert!(w.stop().await.is_empty());
    assert_eq!(client.ready(&queue).await, 0, "the stream moved on past every bad message");

    // `dead-letters replay` of a queue's dead letter: the poison o-1, with a fixed payload, is applied under the
    // message-id its row kept, and its row is removed.
    let id: i64 = db.scalar("SELECT min(id) FROM idemflow.dead_letters").await;
    let fixed = setup.dir.path().join("fixed.json");
    std::fs::write(&fixed, "{\"amount\": 1}").unwrap();
    let args = ["dead-letters", "replay", "--config", setup.config.to_str().unwrap(), &id.to_string(), "--payload", fixed.to_str().unwrap()];
    let (status, out, err) = idemflow(&args, setup.dir.path());
    assert!(status.success() && out.contains("applied; its row is removed"), "{out}{err}");
    assert_eq!(db.scalar::<String>("SELECT string_agg(id || '=' || amount, ',' ORDER BY id) FROM orders").await, "o-1=1,o-6=6.5");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 4);
}

/// What a RabbitMQ pipeline cannot do is refused with the reason; a missing queue, a wrong queue type and a queue
/// without single active consumer are named by `check`; the Kafka-only `rewind` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_what_a_queue_cannot_do() {
    let url = rabbitmq::shared_url();
    let db = payments_db(None).await;
    let client = Client::connect(url).await;
    let classic = format!("classic-{}", unique());
    client.declare(&classic, "classic", false).await;
    let run_check = |text: String| {
        let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &text)], "");
        let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
        (status.success(), format!("{out}{err}"))
    };
    let (ok, out) = run_check(example("no-such-queue"));
    assert!(!ok && out.contains("queue \"no-such-queue\" does not exist"), "{out}");
    let (ok, out) = run_check(example(&classic).replace("# queue_type = \"quorum\"", "queue_type = \"quorum\""));
    assert!(!ok && out.contains("is not of [source] queue_type") && out.contains("x-queue-type"), "{out}");
    let (ok, out) = run_check(example(&classic).replace("# single_active_consumer = true", "single_active_consumer = true"));
    assert!(!ok && out.contains("x-single-active-consumer"), "{out}");
    let sac = format!("sac-{}", unique());
    client.declare(&sac, "quorum", true).await;
    let (ok, out) = run_check(
        example(&sac).replace("# single_active_consumer = true", "single_active_consumer = true").replace("# queue_type = \"quorum\"", "queue_type = \"quorum\""),
    );
    assert!(ok && out.contains("single active consumer as configured"), "{out}");
    // Only single_active_consumer asked for, on a quorum queue: the broker's first complaint is about the queue
    // type, which the pipeline did not ask about: a warning, not a refusal.
    let (ok, out) = run_check(example(&sac).replace("# single_active_consumer = true", "single_active_consumer = true"));
    assert!(ok && out.contains("could not be verified") && out.contains("x-queue-type"), "{out}");
    // A stream is refused: it does not redeliver what a lost consumer had not acknowledged.
    let stream = format!("stream-{}", unique());
    client.declare(&stream, "stream", false).await;
    let (ok, out) = run_check(example(&stream));
    assert!(!ok && out.contains("is a RabbitMQ stream"), "{out}");
    let (ok, out) = run_check(example(&classic) + "[offsets]\nstore = \"database\"\n");
    assert!(!ok && out.contains("offsets.store") && out.contains("RabbitMQ queue has none"), "{out}");
    let (ok, out) = run_check(example(&classic).replace("[source]", "topics = [\"x\"]\n[source]"));
    assert!(!ok && out.contains("not both"), "{out}");

    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &example(&classic))], "");
    let (status, _, err) =
        idemflow(&["rewind", "--config", setup.config.to_str().unwrap(), "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(!status.success() && err.contains("has a rabbitmq source") && err.contains("Publish the messages again"), "{err}");
    let bad = Setup::rabbitmq(&db, "amqp://guest:s3cret@127.0.0.1:1/%2f", &[("payments.toml", &example(&classic))], "");
    let (status, out, err) = idemflow(&["check", "--config", bad.config.to_str().unwrap()], bad.dir.path());
    assert!(!status.success() && err.contains("connecting to amqp://guest:***@127.0.0.1:1"), "{out}{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

/// `[dead_letters] exchange`: each dead letter is also published to the exchange (persistent, mandatory, with
/// publisher confirms) before the batch is acknowledged, with its body, message-id and provenance headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_published_to_the_dead_letter_exchange() {
    let DeadLetterExchangeCase { client, queue, dlq, db, setup, .. } = dead_letter_exchange_case("poison").await;
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 2).await;
    let (body, headers, id) = next_dead_letter(&client, &dlq, String::new).await;
    assert_eq!(body, b"{\"amount\": oops");
    assert_eq!(id.as_deref(), Some("o-1"));
    let header = |k: &str| match headers.inner().get(k) {
        Some(lapin::types::AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
        other => format!("{other:?}"),
    };
    assert!(header("x-idemflow-reason").contains("decode_failed"), "{headers:?}");
    assert!(header("x-idemflow-queue").contains(&queue) && header("x-idemflow-pipeline").contains("orders"), "{headers:?}");
    assert!(client.get(&dlq).await.is_none(), "one dead letter, once");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1);
    assert!(w.stop().await.is_empty());
    assert_eq!(client.ready(&queue).await, 0, "both messages acknowledged");
}

/// `amqps://` with a private CA (`[rabbitmq] tls_ca_file`): `check` and the worker connect over TLS and apply the
/// messages; the same broker with another CA configured is refused with the certificate problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_private_ca() {
    use std::os::unix::fs::PermissionsExt;
    let certs = tempfile::tempdir().unwrap();
    crate::security::certificates(certs.path());
    std::fs::set_permissions(certs.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for f in std::fs::read_dir(certs.path()).unwrap() {
        std::fs::set_permissions(f.unwrap().path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let path = |f: &str| certs.path().join(f).display().to_string();
    let tls_port = free_port();
    let conf = format!(
        "listeners.ssl.default = {tls_port}\nssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
         ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n",
        path("ca.crt"),
        path("server.crt"),
        path("server.key")
    );
    let node = Node::start_with_config(&conf).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_err() {
        assert!(Instant::now() < deadline, "no TLS listener");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = Client::connect(&node.url()).await;
    client.declare("orders", "quorum", false).await;
    client.publish("orders", &[Msg::json("o-1", "{\"amount\": 1}"), Msg::json("o-2", "{\"amount\": 2}")]).await;
    let db = TestDb::new(ORDERS_TABLE).await;
    let pipeline = &orders_pipeline("orders", "");
    let tls_url = format!("amqps://guest:guest@localhost:{tls_port}/%2f");
    let with_ca = |ca: &str| {
        let setup = Setup::rabbitmq(&db, &tls_url, &[("orders.toml", pipeline)], "");
        let text = std::fs::read_to_string(&setup.config).unwrap();
        std::fs::write(&setup.config, text.replace("connect_timeout = \"3s\"\n", &format!("connect_timeout = \"3s\"\ntls_ca_file = \"{}\"\n", path(ca))))
            .unwrap();
        setup
    };
    let wrong = with_ca("other-ca.crt");
    let (status, out, err) = idemflow(&["check", "--config", wrong.config.to_str().unwrap()], wrong.dir.path());
    assert!(!status.success() && err.contains("connecting to amqps://guest:***@localhost"), "{out}{err}");
    assert!(err.to_lowercase().contains("certificate") || err.contains("UnknownIssuer"), "the reason is the certificate: {err}");
    let setup = with_ca("ca.crt");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 2).await;
    assert_eq!(db.scalar::<String>("SELECT string_agg(id || '=' || amount, ',' ORDER BY id) FROM orders").await, "o-1=1,o-2=2");
    assert!(w.stop().await.is_empty());
    drop(node);
}

/// A worker that receives deliveries from a RabbitMQ stream (which `check` would have refused) stops the pipeline
/// with the reason instead of acknowledging: a stream does not redeliver what a lost consumer had not acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stops_the_pipeline_with_the_reason() {
    let url = rabbitmq::shared_url();
    let stream = format!("stream-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&stream, "stream", false).await;
    let db = payments_db(None).await;
    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &example(&stream))], "");
    let w = InProc::start(&setup).await;
    // A stream consumer starts at the next message: publish once it is consuming.
    tokio::time::sleep(Duration::from_secs(1)).await;
    client.publish(&stream, &messages(&payments(10, 1, false))).await;
    let failures = tokio::time::timeout(Duration::from_secs(30), w.stop_when_pipelines_end()).await.expect("the pipeline stops");
    assert_eq!(failures.len(), 1);
    assert!(failures[0].to_string().contains("is a RabbitMQ stream"), "{}", failures[0]);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 0, "nothing applied from a stream");
}

/// A dead-letter exchange that routes nowhere (no queue bound for the routing key): the worker retries and the
/// batch stays unacknowledged (nothing is acked past a dead letter that went nowhere); once a queue is bound, the
/// dead letter arrives and the batch is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_dead_letter_exchange_holds_the_ack_until_it_routes() {
    let DeadLetterExchangeCase { client, queue, dlx, dlq, db, setup } = dead_letter_exchange_case("elsewhere").await;
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the publish to be retried", || async { w.log_text().contains("routed no queue") }).await;
    // The batch committed (its dead letter is in the table) but is not acknowledged: stopping the worker returns it.
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1);
    assert!(client.get(&dlq).await.is_none());
    w.kill();
    wait_until(Duration::from_secs(10), "the unacknowledged batch back in the queue", || async { client.ready(&queue).await == 2 }).await;
    client.bind(&dlx, &dlq, "poison").await;
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the queue to be drained", || async { client.ready(&queue).await == 0 }).await;
    let (body, _, id) = next_dead_letter(&client, &dlq, || w.log_text()).await;
    assert_eq!((body.as_slice(), id.as_deref()), (&b"{\"amount\": oops"[..], Some("o-1")));
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(client.ready(&queue).await, 0, "acknowledged once the dead letter was confirmed");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM orders").await, 1);
}

/// A header name with a NUL (any header a broker can deliver) is kept in the dead letters, and the stream moves on:
/// PostgreSQL text cannot hold U+0000, and the dead-letter insert used to fail and stop the pipeline. Issue:
/// exactly-once holes, item 8.
#[tokio::test(flavor = "multi_thread")]
async fn a_nul_in_a_header_name_is_dead_lettered_and_the_stream_moves_on() {
    let url = rabbitmq::shared_url();
    let queue = format!("nul-header-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "classic", false).await;
    let db = TestDb::new(ORDERS_TABLE).await;
    let setup = Setup::rabbitmq(&db, url, &[("orders.toml", &orders_pipeline(&queue, ""))], "");
    client.publish_with_headers(&queue, &Msg::json("o-1", "{\"amount\": poison"), &[("x-\u{0}trace", "a\u{0}b"), ("plain", "v")]).await;
    client.publish_with_headers(&queue, &Msg::json("o-2", "{\"amount\": 2}"), &[("x-\u{0}trace", "c")]).await;
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 2).await;
    assert!(w.stop().await.is_empty(), "the pipeline kept running");
    assert_eq!(db.scalar::<String>("SELECT string_agg(id || '=' || amount, ',') FROM orders").await, "o-2=2");
    let names: String = db.scalar("SELECT array_to_string(header_names, ',') FROM idemflow.dead_letters").await;
    let mut names: Vec<&str> = names.split(',').collect();
    names.sort_unstable();
    assert_eq!(names, ["plain", "x-\\u0000trace"], "the name kept, its NUL escaped");
    let (_, out, _) = idemflow(&["dead-letters", "list", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(out.contains("1 dead letter(s)"), "{out}");
}

/// Messages delivered while a batch is in its transaction are prepared ahead from the connector's own stash, each
/// for itself (see [`crate::hardening::records_prepared_ahead_from_a_queue_bind_their_own_values`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_delivered_while_a_batch_waits_are_prepared_ahead() {
    let url = rabbitmq::shared_url();
    let queue = format!("ahead-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    let db = TestDb::new(crate::hardening::ORDERS).await;
    let setup = Setup::rabbitmq(&db, url, &[("payments.toml", &orders_pipeline(&queue, ""))], "");
    let publish = |id: &'static str, amount: &'static str| {
        let (client, queue) = (&client, &queue);
        async move { client.publish(queue, &[Msg::json(id, format!("{{\"amount\": {amount}}}"))]).await }
    };
    crate::hardening::records_prepared_ahead_from_a_queue_bind_their_own_values(&setup, &db, publish).await;
}

/// A delivery returned to its queue many times (`x-delivery-count` at or past `DELIVERY_COUNT_WARNING`, 10, in
/// `src/source/rabbitmq/consumer.rs`) is logged as a warning naming the quorum
/// queues' delivery limit, which would drop it out of idemflow's sight; it is applied as any other. (A classic
/// queue passes the publisher's header through, which stands in here for a quorum queue's own count.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_returned_many_times_warns_of_the_delivery_limit() {
    let url = rabbitmq::shared_url();
    let queue = format!("returned-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "classic", false).await;
    let db = TestDb::new(ORDERS_TABLE).await;
    let setup = Setup::rabbitmq(&db, url, &[("orders.toml", &orders_pipeline(&queue, ""))], "");
    let count = lapin::types::AMQPValue::LongLongInt(10);
    client.publish_with_values(&queue, &Msg::json("o-1", "{\"amount\": 1}"), vec![("x-delivery-count", count)]).await;
    client.publish(&queue, &[Msg::json("o-2", "{\"amount\": 2}")]).await;
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "both applied", || async { db.scalar::<i64>("SELECT count(*) FROM orders").await == 2 }).await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    let log = w.log_text();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("x-delivery-limit")).collect();
    assert_eq!(warned.len(), 1, "one warning, for o-1:\n{log}");
    assert!(warned[0].contains("WARN") && warned[0].contains(&queue), "{}", warned[0]);
}
