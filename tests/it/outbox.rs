//! The outbox ([[sink.http]], docs/outbox.md) through the binary, against the suite's payment provider
//! (tests/payment-provider/server.py: idempotency keys honoured as the IETF httpapi draft describes, failures on
//! demand): each business key charged once across a crash between the provider's answer and the outbox's record of
//! it, on PostgreSQL and MariaDB; retries, a dead letter and its replay; three workers on one outbox; back-pressure
//! while the provider is down.

use crate::support::mariadb::MyDb;
use crate::support::provider::Provider;
use crate::support::{http_get, metric, unique, wait_until, BinWorker, Database, Kafka, Out, Setup, TestDb};
use serde_json::Value;
use std::time::Duration;

/// The business table, the same on both stores.
const PAYMENTS: &str = "CREATE TABLE payments (id VARCHAR(64) PRIMARY KEY, amount DECIMAL(12, 2) NOT NULL)";

/// A pipeline that records each payment in `payments` and charges it through the provider at `url`, with `extra`
/// lines at the end (an `[outbox]` table's keys go there).
fn pipeline(topic: &str, url: &str, http_extra: &str, outbox_extra: &str) -> String {
    format!(
        r#"topics = ["{topic}"]
[key]
field = "/id"
[sink]
table = "payments"
[sink.columns]
id = "/id"
amount = "/amount"
[sink.params]
order = "/id"
amount = "/amount"
account = "/account"
[[sink.http]]
name = "provider"
url = "{url}/v1/accounts/{{account}}/charges"
body = {{ amount = "{{amount}}", order = "{{order}}" }}
headers = {{ X-Order = "{{order}}" }}
timeout = "2s"
max_attempts = 10
{http_extra}
[outbox]
poll_interval = "200ms"
backoff = "200ms"
max_backoff = "1s"
lease = "8s"
{outbox_extra}
"#
    )
}

/// `n` payments (ids `o-0` ...), over two partitions, then the first `again` of them produced once more (a
/// producer's retries: the same payload at another offset).
fn payments(n: usize, again: usize) -> Vec<Out> {
    let one = |i: usize| Out::json((i % 2) as i32, format!(r#"{{"id":"o-{i}","amount":{}.50,"account":"acct-{}"}}"#, i + 1, i % 3));
    (0..n).map(one).chain((0..again).map(one)).collect()
}

/// The outbox's rows on either store.
async fn outbox_rows(db: &Store) -> i64 {
    match db {
        Store::Pg(db) => db.scalar("SELECT count(*) FROM idemflow.outbox").await,
        Store::My(db) => db.scalar("SELECT COUNT(*) FROM idemflow_outbox").await,
    }
}

async fn business_rows(db: &Store) -> i64 {
    match db {
        Store::Pg(db) => db.scalar("SELECT count(*) FROM payments").await,
        Store::My(db) => db.scalar("SELECT COUNT(*) FROM payments").await,
    }
}

/// Both stores the outbox runs on.
enum Store {
    Pg(TestDb),
    My(MyDb),
}

impl Store {
    fn db(&self) -> &dyn Database {
        match self {
            Store::Pg(db) => db,
            Store::My(db) => db,
        }
    }
}

/// Every key the provider charged, charged once; returns the provider's state.
fn charged_once(provider: &Provider, n: usize, pipeline: &str) -> Value {
    let state = provider.state();
    assert_eq!(state["distinct_keys"], n, "{state:#}");
    assert_eq!(state["charges"], n, "each key charged once: {state:#}");
    for i in 0..n {
        let key = format!("{pipeline}:o-{i}");
        let k = &state["keys"][&key];
        assert_eq!(k["charges"], 1, "{key}: {k:#}");
        assert_eq!(k["headers"]["x-order"], format!("o-{i}"), "{key}: {k:#}");
        assert_eq!(k["path"], format!("/v1/accounts/acct-{}/charges", i % 3), "{key}: {k:#}");
    }
    state
}

/// The worker aborts right after the provider confirmed a charge and before the outbox recorded it; started again,
/// it sends that request again with the same idempotency key (after the dead worker's lease), the provider answers
/// it from its record of the key, and every payment is charged exactly once (none lost, none doubled), while the
/// producer's retries charge nothing.
async fn a_crash_after_the_target_confirmed(db: Store) {
    let provider = Provider::start(&[]);
    let topic = format!("orders_{}", unique());
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 2);
    let setup = Setup::new(db.db(), &kafka, &[("orders.toml", &pipeline(&topic, &provider.url(), "", ""))]);
    kafka.produce(&topic, &payments(40, 10));
    let mut w = BinWorker::start_with_env(&setup, &[("IDEMFLOW_FAULT_CRASH_AFTER_DELIVERIES", "5")]);
    let status = w.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "the injected crash aborts the worker: {status:?}");
    assert!(w.log_text().contains("injected crash (IDEMFLOW_FAULT_CRASH_AFTER_DELIVERIES)"), "{}", w.log_text());
    let before = provider.state();
    assert!(before["charges"].as_u64().unwrap() >= 5, "{before:#}");
    assert!(outbox_rows(&db).await > 0, "the confirmed request was not recorded as delivered");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(90), "every payment charged and the outbox empty", || async {
        provider.state()["distinct_keys"] == 40 && outbox_rows(&db).await == 0
    })
    .await;
    w.sigterm();
    let state = charged_once(&provider, 40, "orders");
    let replayed: Vec<&String> = state["keys"].as_object().unwrap().iter().filter(|(_, k)| k["replays"].as_u64() > Some(0)).map(|(key, _)| key).collect();
    assert!(!replayed.is_empty(), "the request confirmed before the crash was sent again and recognised: {state:#}");
    assert_eq!(state["mismatches"], 0, "a request sent again is the same request: {state:#}");
    assert_eq!(business_rows(&db).await, 40, "the producer's retries were duplicates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_target_confirmed_charges_once_on_postgres() {
    a_crash_after_the_target_confirmed(Store::Pg(TestDb::new(PAYMENTS).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_target_confirmed_charges_once_on_mariadb() {
    a_crash_after_the_target_confirmed(Store::My(MyDb::new(PAYMENTS).await)).await;
}

/// Answers worth retrying (503, 429 with Retry-After, a connection reset, a slow answer past the timeout whose
/// charge stands, and the 409 the provider gives a retry while that charge is in flight) are retried until
/// confirmed, each payment charged once; a 422 makes the request a `delivery_failed` dead letter with the status and
/// the answer's head, and `dead-letters replay` sends it again: charged then. The metrics count every attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_and_a_refused_request_is_dead_lettered_then_replayed() {
    let provider = Provider::start(&[]);
    for rule in [
        serde_json::json!({"status": 503, "count": 2}),
        serde_json::json!({"status": 429, "count": 1, "retry_after": 1}),
        serde_json::json!({"reset": true, "count": 1}),
        serde_json::json!({"delay": 3.0, "count": 1}),
        serde_json::json!({"status": 422, "count": 1}),
    ] {
        provider.fault(rule);
    }
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 2);
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &pipeline(&topic, &provider.url(), "", ""))]);
    kafka.produce(&topic, &payments(10, 0));
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "nine payments charged, one dead-lettered", || async {
        db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 0
            && db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await == 1
    })
    .await;
    let state = provider.state();
    assert_eq!(state["distinct_keys"], 9, "{state:#}");
    let (id, error, request): (i64, String, Value) =
        sqlx::query_as("SELECT id, error, request FROM idemflow.dead_letters WHERE reason = 'delivery_failed'").fetch_one(&db.pool).await.unwrap();
    assert!(error.contains("HTTP 422") && error.contains("/v1/accounts/"), "{error}");
    assert_eq!(request["target"], "provider", "{request}");
    // `explain` says where each key's request is: the refused one a dead letter, the others confirmed.
    let explain = |key: &str| crate::support::idemflow(&["explain", "--config", setup.config.to_str().unwrap(), "--pipeline", "orders", "--key", key], setup.dir.path());
    let refused = (0..10).find(|i| state["keys"].get(format!("orders:o-{i}")).is_none_or(|k| k["charges"] != 1)).expect("the refused key");
    let (status, out, err) = explain(&format!("o-{refused}"));
    assert!(status.success() && out.contains(&format!("dead letter {id} (delivery_failed: ")) && out.contains("HTTP 422"), "{out}\n{err}");
    let (status, out, err) = explain(&format!("o-{}", (refused + 1) % 10));
    assert!(status.success() && out.contains("request to provider") && out.contains("confirmed by its target"), "{out}\n{err}");
    let (status, out, err) = crate::support::idemflow(&["dead-letters", "replay", "--config", setup.config.to_str().unwrap(), &id.to_string()], setup.dir.path());
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("back in the outbox"), "{out}");
    wait_until(Duration::from_secs(30), "the replayed request charged", || async { provider.state()["distinct_keys"] == 10 }).await;
    wait_until(Duration::from_secs(10), "the outbox empty", || async { db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 0 }).await;
    let metrics = w.scrape();
    w.sigterm();
    charged_once(&provider, 10, "orders");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0, "the replay took the dead letter out");
    let attempts = |result: &str| metric(&metrics, "idemflow_outbox_attempts_total", &[("pipeline", "orders"), ("target", "provider"), ("result", result)]);
    assert!(attempts("retry_status") >= 3.0, "two 503s and a 429 at least:\n{metrics}");
    assert!(attempts("connection") >= 1.0, "the reset:\n{metrics}");
    assert!(attempts("timeout") >= 1.0, "the slow answer:\n{metrics}");
    assert_eq!(attempts("rejected"), 1.0, "the 422:\n{metrics}");
    assert_eq!(attempts("confirmed"), 10.0, "{metrics}");
    let deliveries = |outcome: &str| metric(&metrics, "idemflow_outbox_deliveries_total", &[("pipeline", "orders"), ("target", "provider"), ("outcome", outcome)]);
    assert_eq!(deliveries("confirmed"), 10.0, "{metrics}");
    assert_eq!(deliveries("dead_lettered"), 1.0, "{metrics}");
}

/// Three workers share one outbox: every row is sent by one of them, once (no request twice, so none the provider
/// had to answer 409 for), and each payment is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_share_one_outbox_without_sending_a_row_twice() {
    let provider = Provider::start(&[]);
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 2);
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &pipeline(&topic, &provider.url(), "", "concurrency = 4"))]);
    let mut workers: Vec<BinWorker> = (0..3).map(|_| BinWorker::start(&setup)).collect();
    kafka.produce(&topic, &payments(150, 30));
    wait_until(Duration::from_secs(90), "every payment charged and the outbox empty", || async {
        provider.state()["distinct_keys"] == 150 && db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 0
    })
    .await;
    for w in &mut workers {
        w.sigterm();
    }
    let state = charged_once(&provider, 150, "orders");
    assert_eq!(state["requests"], 150, "no row sent twice: {state:#}");
    assert_eq!(state["conflicts"], 0, "{state:#}");
}

/// While the provider is down, the outbox grows past `max_rows` and the pipeline stops consuming: said in the log,
/// `idemflow_outbox_paused` and `/readyz`; the provider back, the relay catches up, consumption resumes by itself,
/// and every payment is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_down_pauses_consumption_until_the_outbox_drains() {
    let provider = Provider::start(&[]);
    provider.fault(serde_json::json!({"status": 503, "count": -1}));
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 2);
    let text = pipeline(&topic, &provider.url(), "", "max_rows = 5\n[batch]\nmax_records = 3\nmax_wait = \"50ms\"").replace("max_attempts = 10", "max_attempts = 1000");
    let n = 400;
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &text)]);
    kafka.produce(&topic, &payments(n, 0));
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the pipeline paused", || async {
        metric(&w.scrape(), "idemflow_outbox_paused", &[("pipeline", "orders")]) == 1.0
    })
    .await;
    let (status, body) = http_get(w.metrics, "/readyz").unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("paused") && body.contains("max_rows"), "{body}");
    let received = |m: &str| metric(m, "idemflow_records_received_total", &[("pipeline", "orders")]);
    let first = received(&w.scrape());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = received(&w.scrape());
    assert_eq!(first, later, "nothing consumed while paused");
    assert!(later < n as f64, "{later}");
    let rows = db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await;
    assert!(rows > 5 && (rows as f64) <= later, "the outbox stopped growing past its bound: {rows} rows");
    assert!(w.log_text().contains("consumption paused: the outbox holds"), "{}", w.log_text());
    // A request failing the same way again and again is said once (issue 64: thousands of warning lines an outage).
    let log = w.log_text();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("outbox request failed; retrying") || l.contains("outbox request answered a retry status"))
        .filter_map(|l| l.split(" row=").nth(1).and_then(|r| r.split(' ').next()))
        .collect();
    let rows: std::collections::HashSet<&str> = said.iter().copied().collect();
    assert!(!said.is_empty() && said.len() == rows.len(), "each failing row said once, not once per attempt: {said:?}\n{log}");
    provider.clear_faults();
    wait_until(Duration::from_secs(90), "every payment charged and the outbox empty", || async {
        provider.state()["distinct_keys"] == n && db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 0
    })
    .await;
    wait_until(Duration::from_secs(10), "ready again", || async { http_get(w.metrics, "/readyz").is_ok_and(|(s, _)| s == 200) }).await;
    assert!(w.log_text().contains("consumption resumed"), "{}", w.log_text());
    w.sigterm();
    charged_once(&provider, n, "orders");
}

/// One merchant's account answers every charge with 429 and `Retry-After: 600` (issue 64's slow key): its requests
/// wait out their back-off, and `max_age` (here 2 s) counts only rows the relay could send, so the pipeline is
/// never paused by them and every other account's payments are charged as they come. Before, the oldest row's age
/// (the merchant's) paused the pipeline and no healthy payment produced after it was charged.
async fn a_key_in_back_off_never_pauses_the_pipeline(db: Store) {
    let provider = Provider::start(&[]);
    provider.fault(serde_json::json!({"status": 429, "count": -1, "retry_after": 600, "path": "/v1/accounts/acct-0/"}));
    let topic = format!("orders_{}", unique());
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 2);
    let text = pipeline(&topic, &provider.url(), "", "max_age = \"2s\"\n[batch]\nmax_wait = \"50ms\"");
    let setup = Setup::new(db.db(), &kafka, &[("orders.toml", &text)]);
    let mut w = BinWorker::start(&setup);
    let healthy = |n: usize| (0..n).filter(|i| i % 3 != 0).count();
    kafka.produce(&topic, &payments(30, 0));
    wait_until(Duration::from_secs(60), "the healthy accounts' payments charged", || async { provider.state()["distinct_keys"] == healthy(30) }).await;
    // Past max_age with the merchant's rows waiting: then a second wave, charged all the same.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let wave: Vec<Out> = payments(90, 0).into_iter().skip(30).collect();
    kafka.produce(&topic, &wave);
    wait_until(Duration::from_secs(60), "the second wave's healthy payments charged", || async { provider.state()["distinct_keys"] == healthy(90) }).await;
    let m = w.scrape();
    assert!(!w.log_text().contains("consumption paused"), "{}", w.log_text());
    assert_eq!(metric(&m, "idemflow_outbox_paused", &[("pipeline", "orders")]), 0.0);
    assert_eq!(metric(&m, "idemflow_records_received_total", &[("pipeline", "orders")]), 90.0);
    assert!(metric(&m, "idemflow_outbox_due_wait_seconds", &[("pipeline", "orders")]) < 2.0, "{m}");
    assert!(metric(&m, "idemflow_outbox_oldest_seconds", &[("pipeline", "orders")]) > 2.0, "the merchant's rows still wait: {m}");
    // The healthy requests' confirmations recorded (a moment after the provider's answers): the merchant's 30 wait.
    wait_until(Duration::from_secs(30), "only the merchant's 30 requests waiting", || async { outbox_rows(&db).await == 30 }).await;
    let (status, out, err) =
        crate::support::idemflow(&["explain", "--config", setup.config.to_str().unwrap(), "--pipeline", "orders", "--key", "o-3"], setup.dir.path());
    assert!(status.success() && out.contains("waiting: 1 attempt(s) failed, the last with POST") && out.contains("HTTP 429") && out.contains("next attempt at"), "{out}\n{err}");
    // The operator's view, and the merchant back: one key sent at once, then the rest.
    let outbox = |args: &[&str]| crate::support::idemflow(&[&["outbox"], args, &["--config", setup.config.to_str().unwrap()]].concat(), setup.dir.path());
    let (status, out, err) = outbox(&["list", "--pipeline", "orders"]);
    assert!(status.success() && out.contains("target \"provider\": 30 waiting (0 due, 30 in back-off, 0 being sent)") && out.contains("last error:"), "{out}\n{err}");
    provider.clear_faults();
    let (status, out, err) = outbox(&["retry-now", "--pipeline", "orders", "--key", "o-3"]);
    assert!(status.success() && out.contains("1 request(s) in back-off due now"), "{out}\n{err}");
    wait_until(Duration::from_secs(30), "o-3 charged", || async { provider.state()["keys"]["orders:o-3"]["charges"] == 1 }).await;
    assert_eq!(outbox_rows(&db).await, 29, "the others still wait out their back-off");
    let (status, out, err) = outbox(&["retry-now", "--pipeline", "orders", "--target", "provider"]);
    assert!(status.success() && out.contains("29 request(s)"), "{out}\n{err}");
    wait_until(Duration::from_secs(30), "every payment charged", || async { provider.state()["distinct_keys"] == 90 && outbox_rows(&db).await == 0 }).await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    charged_once(&provider, 90, "orders");
    assert_eq!(business_rows(&db).await, 90);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_back_off_never_pauses_the_pipeline_on_postgres() {
    a_key_in_back_off_never_pauses_the_pipeline(Store::Pg(TestDb::new(PAYMENTS).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_back_off_never_pauses_the_pipeline_on_mariadb() {
    a_key_in_back_off_never_pauses_the_pipeline(Store::My(MyDb::new(PAYMENTS).await)).await;
}

/// A pipeline renamed on purpose with `idemflow pipeline rename` (issue 59, item 1; issue 64, item 3): 13 refunds
/// charged and 7 waiting in the outbox (one merchant answering 503) under "refunds", the workers stopped, the history
/// moved to "refunds-v2" and the file renamed. Started under the new name and a new consumer group, the pipeline goes
/// on where the old one stopped: nothing applied or charged again (before, the new name applied and charged all 20
/// again under new idempotency keys), the 7 waiting requests sent with the keys they were written with, and the new
/// records under the new name. A rename while a worker runs is refused.
async fn a_pipeline_renamed_on_purpose_keeps_its_history(db: Store) {
    let provider = Provider::start(&[]);
    provider.fault(serde_json::json!({"status": 503, "count": -1, "path": "/v1/accounts/acct-0/"}));
    let topic = format!("orders_{}", unique());
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 2);
    let text = pipeline(&topic, &provider.url(), "", "[batch]\nmax_wait = \"50ms\"").replace("max_attempts = 10", "max_attempts = 1000");
    let setup = Setup::new(db.db(), &kafka, &[("refunds.toml", &text)]);
    let config = setup.config.to_str().unwrap().to_owned();
    kafka.produce(&topic, &payments(20, 0));
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "13 refunds charged, 7 waiting", || async {
        provider.state()["distinct_keys"] == 13 && business_rows(&db).await == 20 && outbox_rows(&db).await == 7
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());
    // The workers stopped a while ago: their last batch attempts are over a minute old.
    match &db {
        Store::Pg(db) => sqlx::query("UPDATE idemflow.attempts SET updated_at = now() - interval '2 minutes'").execute(&db.pool).await.map(drop),
        Store::My(db) => sqlx::query("UPDATE idemflow_attempts SET updated_at = NOW(6) - INTERVAL 2 MINUTE").execute(&db.pool).await.map(drop),
    }
    .unwrap();
    let rename = |args: &[&str]| crate::support::idemflow(&[&["pipeline", "rename", "--config", &config], args].concat(), setup.dir.path());
    let (status, out, err) = rename(&["refunds", "refunds-v2", "--dry-run"]);
    assert!(status.success() && out.contains("would move") && out.contains("outbox: 7"), "{out}\n{err}");
    let (status, out, err) = rename(&["refunds", "refunds-v2"]);
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("moved") && out.contains("processed: 2") && out.contains("is still configured"), "{out}");
    let (status, _, err) = rename(&["refunds", "refunds-v2"]);
    assert!(!status.success() && err.contains("already has a history"), "a second time: {err}");
    // The file not renamed yet: check refuses the old name's new history and names the requests no relay sends.
    let (status, out, err) = crate::support::idemflow(&["check", "--config", &config], setup.dir.path());
    let said = format!("{out}{err}");
    assert!(!status.success() && said.contains("renamed from \"refunds-v2\"?"), "{said}");
    assert!(said.contains("target \"provider\" of pipeline \"refunds-v2\": 7 request(s) waiting in the outbox") && said.contains("which no relay sends"), "{said}");
    let dir = setup.dir.path().join("pipelines");
    std::fs::remove_file(dir.join("refunds.toml")).unwrap();
    std::fs::write(dir.join("refunds-v2.toml"), &text).unwrap();
    let (status, out, err) = crate::support::idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "check accepts the renamed pipeline: {out}\n{err}");
    provider.clear_faults();
    let mut w = BinWorker::start(&setup);
    let more: Vec<Out> = payments(25, 0).into_iter().skip(20).collect();
    kafka.produce(&topic, &more);
    wait_until(Duration::from_secs(60), "every refund charged", || async {
        provider.state()["distinct_keys"] == 25 && outbox_rows(&db).await == 0
    })
    .await;
    let (status, _, err) = rename(&["refunds-v2", "refunds-v3"]);
    assert!(!status.success() && err.contains("ran a batch within the last"), "refused while a worker runs: {err}");
    let m = w.scrape();
    assert!(w.sigterm().success(), "{}", w.log_text());
    let state = provider.state();
    assert_eq!(state["charges"], 25, "each refund charged once: {state:#}");
    for i in 0..25 {
        let prefix = if i < 20 { "refunds" } else { "refunds-v2" };
        assert_eq!(state["keys"][format!("{prefix}:o-{i}")]["charges"], 1, "o-{i} under {prefix}: {state:#}");
    }
    assert_eq!(business_rows(&db).await, 25, "nothing applied again");
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "refunds-v2")]), 5.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_renamed_on_purpose_keeps_its_history_on_postgres() {
    a_pipeline_renamed_on_purpose_keeps_its_history(Store::Pg(TestDb::new(PAYMENTS).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_renamed_on_purpose_keeps_its_history_on_mariadb() {
    a_pipeline_renamed_on_purpose_keeps_its_history(Store::My(MyDb::new(PAYMENTS).await)).await;
}

/// `check` says whether each target accepts connections, without sending it a request, and refuses a host that
/// does not resolve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_tells_whether_each_target_answers() {
    let provider = Provider::start(&[]);
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 1);
    let fixed = pipeline(&topic, &provider.url(), "", "");
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &fixed)]);
    let (status, out, err) = crate::support::idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains(&format!("sink.http provider: 127.0.0.1:{} (127.0.0.1:{}) accepts connections", provider.port, provider.port)), "{out}");
    assert_eq!(provider.state()["requests"], 0, "no request sent");
    let nowhere = fixed.replace(&provider.url(), "http://no-such-host.invalid");
    std::fs::write(setup.dir.path().join("pipelines/orders.toml"), nowhere).unwrap();
    let (status, out, err) = crate::support::idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}\n{err}");
    assert!(err.contains("sink.http: provider: the host does not resolve"), "{err}");
}

/// `[[sink.kafka]]` on the embedded broker: each new key's record produced once (the producer's retries and a
/// redelivery produce nothing), keyed by the business key, with its idempotency header and the value template; read
/// back from the topic. Then the worker aborted right after the brokers acknowledged a record and before the outbox
/// recorded it: that record is produced again, with the same idempotency header (at least once: a consumer
/// recognises it by the header), and every key is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_records_are_produced_for_new_keys_with_their_idempotency_header() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::Message;
    let (input, output) = (format!("orders_{}", unique()), format!("charged_{}", unique()));
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&input, 2);
    kafka.create_topic(&output, 1);
    let text = format!(
        r#"topics = ["{input}"]
[key]
field = "/id"
[sink]
table = "payments"
[sink.columns]
id = "/id"
amount = "/amount"
[sink.params]
order = "/id"
amount = "/amount"
[[sink.kafka]]
name = "events"
topic = "{output}"
value = {{ order = "{{order}}", amount = "{{amount}}", kind = "charged" }}
headers = {{ source = "idemflow" }}
timeout = "5s"
[outbox]
poll_interval = "200ms"
lease = "12s"
"#
    );
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &text)]);
    let (status, out, err) = crate::support::idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains(&format!("sink.kafka events: topic {output:?} exists")), "{out}");
    kafka.produce(&input, &payments(30, 10));
    let mut w = BinWorker::start_with_env(&setup, &[("IDEMFLOW_FAULT_CRASH_AFTER_DELIVERIES", "40")]);
    wait_until(Duration::from_secs(60), "30 records produced and the outbox empty", || async {
        kafka.end_offsets(&output, 1) == vec![30] && db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 0
    })
    .await;
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("group.id", format!("reader_{}", unique()))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    c.subscribe(&[output.as_str()]).unwrap();
    let mut got: Vec<(String, String, std::collections::HashMap<String, String>)> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while got.len() < 30 && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
            let headers = m
                .headers()
                .map(|h| {
                    use rdkafka::message::Headers;
                    h.iter().map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned())).collect()
                })
                .unwrap_or_default();
            let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
            got.push((key, String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned(), headers));
        }
    }
    assert_eq!(got.len(), 30);
    let mut keys: Vec<&str> = got.iter().map(|(k, ..)| k.as_str()).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 30, "each key once");
    for (key, value, headers) in &got {
        assert_eq!(headers["Idempotency-Key"], format!("orders:{key}"), "{headers:?}");
        assert_eq!(headers["source"], "idemflow");
        let v: Value = serde_json::from_str(value).unwrap();
        assert_eq!(v["order"], key.as_str());
        assert_eq!(v["kind"], "charged");
    }
    // A crash after the 40th acknowledgement in all (the 10th of these), before the outbox records it.
    kafka.produce(&input, &(30..40).map(|i| Out::json(0, format!(r#"{{"id":"o-{i}","amount":1.50,"account":"a"}}"#))).collect::<Vec<_>>());
    let status = w.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "the injected crash aborts the worker: {status:?}");
    let _ = w;
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "every record produced and the outbox empty", || async {
        kafka.end_offsets(&output, 1)[0] >= 40 && db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 0
    })
    .await;
    w.sigterm();
    let mut more: Vec<(String, String)> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let end = kafka.end_offsets(&output, 1)[0] as usize;
    while 30 + more.len() < end && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
            use rdkafka::message::Headers;
            let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
            let header = m.headers().and_then(|h| h.iter().find(|h| h.key == "Idempotency-Key").and_then(|h| h.value).map(|v| String::from_utf8_lossy(v).into_owned()));
            more.push((key, header.unwrap_or_default()));
        }
    }
    let mut keys: Vec<&str> = more.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 10, "every new key produced: {more:?}");
    assert!(more.len() > 10, "the record acknowledged before the crash was produced again: {more:?}");
    for (key, header) in &more {
        assert_eq!(header, &format!("orders:{key}"), "the same key on every copy");
    }
}
