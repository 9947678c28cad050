//! A record never steers a request (docs/security.md, "The outbox"): through the binary, against the suite's
//! payment provider, which logs every request's line and headers. A host, port or path from a record's values never
//! moves a request or its credentials; secrets are named (`{ env = ... }`, `{ file = ... }`), never stored or
//! logged; a row written for another origin is not sent with today's credentials, and a replay re-homes it; a
//! templated Kafka topic stays within `allow_topics`; a body placeholder's declared type is held to.

use crate::support::provider::Provider;
use crate::support::{idemflow, metric, unique, wait_until, BinWorker, Kafka, Out, Setup, TestDb};
use serde_json::Value;
use std::time::Duration;

const PAYMENTS: &str = "CREATE TABLE payments (id text PRIMARY KEY)";

/// The settings of every pipeline here: the table, then `[sink.params]` (`order` and each of `params`, a field of
/// the same name with a default) and the target (`http`, TOML lines of a `[[sink.http]]`), a quick relay.
fn pipeline(topic: &str, params: &[(&str, &str)], http: &str) -> String {
    let params: String = params.iter().map(|(name, default)| format!("{name} = {{ field = \"/{name}\", default = \"{default}\" }}\n")).collect();
    format!(
        r#"topics = ["{topic}"]
[key]
field = "/id"
[sink]
table = "payments"
[sink.columns]
id = "/id"
[sink.params]
order = "/id"
{params}[[sink.http]]
name = "provider"
timeout = "2s"
max_attempts = 2
{http}
[outbox]
poll_interval = "200ms"
backoff = "200ms"
max_backoff = "500ms"
lease = "8s"
"#
    )
}

/// The parameters of a URL whose host and account come from a record.
const HOST_PARAMS: &[(&str, &str)] = &[("host", "127.0.0.1"), ("account", "acct-1")];

/// The provider's log: every request's method, path and headers.
fn log(provider: &Provider) -> Vec<Value> {
    provider.state()["log"].as_array().cloned().unwrap_or_default()
}

async fn dead_letters(db: &TestDb, reason: &str) -> Vec<(String, String)> {
    sqlx::query_as::<_, (String, String)>(
        "SELECT coalesce(convert_from(payload, 'UTF8'), ''), error FROM idemflow.dead_letters WHERE reason = $1 ORDER BY id",
    )
    .bind(reason)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// A URL whose host comes from a record (`allow_hosts` = 127.0.0.1, loopback allowed for the test): the records
/// naming `localhost`, the cloud metadata address, another domain, or a host glued to an allowed one, and the
/// accounts `..`, `.` and empty, are `param_invalid` dead letters before any transaction; only the good records
/// reach the provider, at the path the template gives, with the credential read from the environment. Without
/// `allow_private_addresses` the same target's loopback address is refused. Without `allow_hosts` the pipeline is
/// refused (`check` names the field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_never_moves_a_request_to_another_host_or_path() {
    let provider = Provider::start(&[]);
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 1);
    let port = provider.port;
    let target = format!(
        "url = \"http://{{host}}:{port}/v1/accounts/{{account}}/charges\"\nallow_hosts = [\"127.0.0.1\"]\nallow_private_addresses = true\n\
         headers = {{ Authorization = {{ env = \"OUTBOX_TEST_PAY_TOKEN\", prefix = \"Bearer \" }} }}\nbody = {{ order = \"{{order}}\" }}"
    );
    // Refused without allow_hosts, naming the field.
    let unguarded = target.replace("allow_hosts = [\"127.0.0.1\"]\nallow_private_addresses = true\n", "");
    let refused = Setup::new(&db, &kafka, &[("orders.toml", &pipeline(&topic, HOST_PARAMS, &unguarded))]);
    let (status, out, err) = idemflow(&["check", "--config", refused.config.to_str().unwrap()], refused.dir.path());
    assert!(!status.success(), "{out}\n{err}");
    assert!(format!("{out}{err}").contains("sink.http.url: its scheme or host comes from a record's values"), "{out}\n{err}");
    let records = [
        r#"{"id":"good-1"}"#,
        r#"{"id":"good-2","account":"a/b"}"#,
        r#"{"id":"bad-localhost","host":"localhost"}"#,
        r#"{"id":"bad-metadata","host":"169.254.169.254"}"#,
        r#"{"id":"bad-decimal","host":"2852039166"}"#,
        r#"{"id":"bad-domain","host":"evil.example"}"#,
        r#"{"id":"bad-dotdot","account":".."}"#,
        r#"{"id":"bad-dot","account":"."}"#,
        r#"{"id":"bad-empty","account":""}"#,
    ];
    kafka.produce(&topic, &records.iter().map(|r| Out::json(0, *r)).collect::<Vec<_>>());
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &pipeline(&topic, HOST_PARAMS, &target))]);
    let mut w = BinWorker::start_with_env(&setup, &[("OUTBOX_TEST_PAY_TOKEN", "tok-123")]);
    wait_until(Duration::from_secs(60), "two charges and seven param_invalid dead letters", || async {
        provider.state()["charges"] == 2 && dead_letters(&db, "param_invalid").await.len() == 7
    })
    .await;
    let seen = log(&provider);
    assert_eq!(seen.len(), 2, "only the good records reached the provider: {seen:#?}");
    let paths: Vec<&str> = seen.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert!(paths.contains(&"/v1/accounts/acct-1/charges") && paths.contains(&"/v1/accounts/a%2Fb/charges"), "{paths:?}");
    for r in &seen {
        assert_eq!(r["headers"]["authorization"], "Bearer tok-123", "{r:#}");
    }
    let dead = dead_letters(&db, "param_invalid").await;
    assert!(dead.iter().all(|(payload, _)| payload.contains("bad-")), "{dead:#?}");
    assert!(dead.iter().any(|(_, e)| e.contains("not one of allow_hosts")), "{dead:#?}");
    assert!(dead.iter().any(|(_, e)| e.contains("'.' or '..'")), "{dead:#?}");
    w.sigterm();
    // Without allow_private_addresses: the loopback address a record names is refused at once.
    let strict = target.replace("allow_private_addresses = true\n", "");
    let topic2 = format!("orders_{}", unique());
    kafka.create_topic(&topic2, 1);
    kafka.produce(&topic2, &[Out::json(0, r#"{"id":"private-1"}"#)]);
    let db2 = TestDb::new(PAYMENTS).await;
    let setup = Setup::new(&db2, &kafka, &[("orders.toml", &pipeline(&topic2, HOST_PARAMS, &strict))]);
    let mut w = BinWorker::start_with_env(&setup, &[("OUTBOX_TEST_PAY_TOKEN", "tok-123")]);
    wait_until(Duration::from_secs(60), "the loopback address refused", || async {
        dead_letters(&db2, "param_invalid").await.iter().any(|(_, e)| e.contains("not a public address"))
    })
    .await;
    w.sigterm();
    assert_eq!(log(&provider).len(), 2, "nothing more reached the provider");
}

/// Secrets named, not written: the whole URL from the environment (a webhook whose path is its secret), a header
/// from a file, a body value from the environment. They reach the provider, and no outbox row, dead letter, log
/// line or `dead-letters show` holds them. A body placeholder declared a number sends a number, and a record whose
/// value is not one is a `param_invalid` dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_named_and_never_stored_shown_or_logged() {
    let provider = Provider::start(&[]);
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 1);
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "file-s3cr3t\n").unwrap();
    let hook = format!("{}/hooks/T0/B0/path-s3cr3t", provider.url());
    let target = format!(
        "url = {{ env = \"OUTBOX_TEST_HOOK_URL\" }}\nheaders = {{ Authorization = {{ file = \"{}\", prefix = \"Bearer \" }} }}\n\
         body = {{ order = \"{{order}}\", amount = \"{{amount:number}}\", api_key = {{ env = \"OUTBOX_TEST_BODY_KEY\" }} }}",
        token.display()
    );
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &pipeline(&topic, &[("amount", "1")], &target))]);
    let env = [("OUTBOX_TEST_HOOK_URL", hook.as_str()), ("OUTBOX_TEST_BODY_KEY", "body-s3cr3t")];
    // One charge goes through; the next answers 422 and is dead-lettered; one record's amount is not a number.
    kafka.produce(&topic, &[Out::json(0, r#"{"id":"o-1","amount":"12.50"}"#)]);
    let mut w = BinWorker::start_with_env(&setup, &env);
    wait_until(Duration::from_secs(60), "the first charge", || async { provider.state()["charges"] == 1 }).await;
    provider.fault(serde_json::json!({"status": 422, "count": -1}));
    kafka.produce(&topic, &[Out::json(0, r#"{"id":"o-2","amount":"3"}"#), Out::json(0, r#"{"id":"o-3","amount":{"x":1}}"#)]);
    wait_until(Duration::from_secs(60), "a delivery_failed and a param_invalid dead letter", || async {
        dead_letters(&db, "delivery_failed").await.len() == 1 && dead_letters(&db, "param_invalid").await.len() == 1
    })
    .await;
    let state = provider.state();
    let charged = &state["keys"]["orders:o-1"];
    assert_eq!(charged["path"], "/hooks/T0/B0/path-s3cr3t", "{state:#}");
    assert_eq!(charged["headers"]["authorization"], "Bearer file-s3cr3t", "{state:#}");
    assert_eq!(charged["body"]["api_key"], "body-s3cr3t", "{state:#}");
    assert_eq!(charged["body"]["amount"].as_f64(), Some(12.5), "a number, not a string: {state:#}");
    let param_invalid = dead_letters(&db, "param_invalid").await;
    assert!(param_invalid[0].1.contains("{amount:number} is an object, not a number"), "{param_invalid:?}");
    w.sigterm();
    let stored: String = db
        .scalar(
            "SELECT coalesce(string_agg(coalesce(request::text, '') || convert_from(coalesce(payload, ''), 'UTF8') || error, ' '), '') FROM idemflow.dead_letters",
        )
        .await;
    let outbox: String = db.scalar("SELECT coalesce(string_agg(url || convert_from(body, 'UTF8'), ' '), '') FROM idemflow.outbox").await;
    let dead: i64 = db.scalar("SELECT id FROM idemflow.dead_letters WHERE reason = 'delivery_failed'").await;
    let (_, shown, _) = idemflow(&["dead-letters", "show", "--config", setup.config.to_str().unwrap(), &dead.to_string()], setup.dir.path());
    let worker_log = w.log_text();
    for secret in ["path-s3cr3t", "file-s3cr3t", "body-s3cr3t"] {
        for (what, text) in [("the dead letters", &stored), ("the outbox", &outbox), ("dead-letters show", &shown), ("the worker's log", &worker_log)] {
            assert!(!text.contains(secret), "{secret} is in {what}: {text}");
        }
    }
    assert!(shown.contains("idemflow-secret-url:env OUTBOX_TEST_HOOK_URL"), "the row names its secret: {shown}");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "the secrets are not set in check's environment: {out}\n{err}");
    assert!(format!("{out}{err}").contains("the secret of env OUTBOX_TEST_HOOK_URL is not set"), "{out}\n{err}");
}

/// A row written for another origin (the pipeline's target moved to a new host while requests waited) is not sent
/// with today's credentials: it becomes a `delivery_failed` dead letter saying so, and the new host never sees it;
/// `idemflow dead-letters replay` re-homes it to the new origin (path kept), where it is charged once, with the same
/// idempotency key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_for_another_origin_is_re_homed_by_a_replay_never_sent_with_todays_credentials() {
    let (old, new) = (Provider::start(&[]), Provider::start(&[]));
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 1);
    let target = |base: &str| format!("url = \"{base}/v1/charges\"\nheaders = {{ Authorization = \"Bearer new-credential\" }}\nbody = {{ order = \"{{order}}\" }}");
    old.fault(serde_json::json!({"status": 503, "count": -1}));
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &pipeline(&topic, &[], &target(&old.url())).replace("max_attempts = 2", "max_attempts = 50"))]);
    kafka.produce(&topic, &[Out::json(0, r#"{"id":"o-1"}"#)]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the request waiting in the outbox", || async {
        db.scalar::<i64>("SELECT count(*) FROM idemflow.outbox").await == 1 && !log(&old).is_empty()
    })
    .await;
    w.sigterm();
    std::fs::write(setup.dir.path().join("pipelines/orders.toml"), pipeline(&topic, &[], &target(&new.url()))).unwrap();
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the old origin's row dead-lettered", || async {
        dead_letters(&db, "delivery_failed").await.len() == 1
    })
    .await;
    let dead = dead_letters(&db, "delivery_failed").await;
    assert!(dead[0].1.contains("re-homes it"), "{dead:?}");
    assert!(log(&new).is_empty(), "the new origin got the old row: {:#?}", log(&new));
    let id: i64 = db.scalar("SELECT id FROM idemflow.dead_letters WHERE reason = 'delivery_failed'").await;
    let (status, out, err) = idemflow(&["dead-letters", "replay", "--config", setup.config.to_str().unwrap(), &id.to_string()], setup.dir.path());
    assert!(status.success(), "{out}\n{err}");
    wait_until(Duration::from_secs(60), "the re-homed request charged", || async { new.state()["charges"] == 1 }).await;
    let state = new.state();
    assert_eq!(state["keys"]["orders:o-1"]["path"], "/v1/charges", "{state:#}");
    assert_eq!(state["keys"]["orders:o-1"]["headers"]["authorization"], "Bearer new-credential", "{state:#}");
    w.sigterm();
}

/// A Kafka topic from a record's values needs `allow_topics`; a record naming a topic outside it (the registry's
/// `_schemas`, another team's) is a `param_invalid` dead letter, and nothing is produced there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_templated_kafka_topic_stays_within_allow_topics() {
    let topic = format!("orders_{}", unique());
    let db = TestDb::new(PAYMENTS).await;
    let kafka = Kafka::new();
    kafka.create_topic(&topic, 1);
    kafka.create_topic("tenant-a", 1);
    kafka.create_topic("_schemas", 1);
    let text = format!(
        r#"topics = ["{topic}"]
[key]
field = "/id"
[sink]
table = "payments"
[sink.columns]
id = "/id"
[sink.params]
tenant = "/tenant"
[[sink.kafka]]
topic = "{{tenant}}"
allow_topics = ["tenant-*"]
timeout = "5s"
[outbox]
poll_interval = "200ms"
lease = "12s"
"#
    );
    let unguarded = Setup::new(&db, &kafka, &[("orders.toml", &text.replace("allow_topics = [\"tenant-*\"]\n", ""))]);
    let (status, out, err) = idemflow(&["check", "--config", unguarded.config.to_str().unwrap()], unguarded.dir.path());
    assert!(!status.success() && format!("{out}{err}").contains("set allow_topics"), "{out}\n{err}");
    kafka.produce(&topic, &[Out::json(0, r#"{"id":"o-1","tenant":"tenant-a"}"#), Out::json(0, r#"{"id":"o-2","tenant":"_schemas"}"#)]);
    let setup = Setup::new(&db, &kafka, &[("orders.toml", &text)]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "one record produced and one dead letter", || async {
        kafka.end_offsets("tenant-a", 1) == vec![1] && dead_letters(&db, "param_invalid").await.len() == 1
    })
    .await;
    assert_eq!(kafka.end_offsets("_schemas", 1), vec![0]);
    assert!(dead_letters(&db, "param_invalid").await[0].1.contains("not one of allow_topics"));
    assert_eq!(metric(&w.scrape(), "idemflow_pipeline_up", &[("pipeline", "orders")]), 1.0);
    w.sigterm();
}
