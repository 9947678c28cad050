//! NATS JetStream pipelines against a real server (Debian's nats-server with JetStream, one per test) and a real
//! PostgreSQL: the shipped example with both layers of deduplication, a server restart mid-stream, a consumer deleted
//! under the worker, `ack_wait` shorter than a slow transaction, and `check`'s refusals. The guarantee matrix
//! (tests/it/matrix.rs) runs the shared scenarios on JetStream x every store, two workers on one consumer among them.

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, Payments};
use crate::support::nats::NatsServer;
use crate::support::*;
use async_nats::jetstream::consumer::{pull, push, AckPolicy};
use std::time::{Duration, Instant};

const P: [(&str, &str); 1] = [("pipeline", "payments")];

/// The shipped JetStream example pipeline, reading `stream`, with more TOML in `[source]` (`source_extra`).
fn example(stream: &str, source_extra: &str) -> String {
    let text = std::fs::read_to_string(project_root().join("examples/nats/payments.toml")).unwrap();
    assert!(text.contains("stream = \"PAYMENTS\""));
    text.replace("stream = \"PAYMENTS\"", &format!("stream = \"{stream}\"\n{source_extra}"))
}

/// The payments stream as (Nats-Msg-Id, body): the order id (a republished copy keeps it, a mismatched one reuses
/// it with another amount); a poison message has an id of its own.
fn messages(s: &Payments) -> Vec<(Option<String>, Vec<u8>)> {
    crate::rabbitmq::messages(s).into_iter().map(|m| (m.message_id, m.body)).collect()
}

fn metric_of(w: &BinWorker, name: &str) -> f64 {
    metric(&w.scrape(), name, &P)
}

fn duplicates(m: &str, reason: &str) -> f64 {
    metric(m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)])
}

/// Waits (at most 120 s) until the dedup store has `keys` rows and the dead letters `dead` payloads.
async fn wait_applied(db: &TestDb, keys: usize, dead: usize, w: &BinWorker) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let rows: i64 = db.scalar("SELECT count(*) FROM idemflow.dedup").await;
        let dl: i64 = db.scalar("SELECT count(DISTINCT payload) FROM idemflow.dead_letters").await;
        if rows == keys as i64 && dl == dead as i64 {
            return;
        }
        assert!(Instant::now() < deadline, "timed out at {rows} of {keys} keys, {dl} of {dead} dead letters:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The shipped example keyed by `Nats-Msg-Id`: a publisher's retry within the stream's duplicate window is dropped
/// by the server itself; copies published after it (the window here is 1 s) reach the stream and are skipped by
/// idemflow, each under its reason; every operation applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_example_keyed_by_nats_msg_id() {
    let server = NatsServer::start();
    let js = server.jetstream().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "PAYMENTS".into(),
        subjects: vec!["payments.>".into()],
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .unwrap();
    let s = payments(300, 1, false);
    let all = messages(&s);
    // The first message of every order id (the original: its copies come later in the stream), poison aside.
    let mut seen = std::collections::HashSet::new();
    let originals: Vec<_> = all
        .iter()
        .filter(|(id, _)| id.as_deref().is_some_and(|id| !id.starts_with("poison-") && seen.insert(id.to_owned())))
        .cloned()
        .collect();
    assert_eq!(originals.len(), s.distinct);
    // Everything at once: the server drops the copies that share an id with a message inside its window.
    server.publish("payments.created", &all).await;
    let stored_first = js.get_stream("PAYMENTS").await.unwrap().info().await.unwrap().state.messages;
    assert!((stored_first as usize) < all.len(), "the server's duplicate window dropped the in-window retries");
    // After the window, a retry of every original reaches the stream: only idemflow can skip it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.publish("payments.created", &originals).await;
    let db = payments_db(None).await;
    let setup = Setup::nats(&db, &server, &[("payments.toml", &example("PAYMENTS", ""))], "");
    let w = BinWorker::start(&setup);
    let stored = js.get_stream("PAYMENTS").await.unwrap().info().await.unwrap().state.messages;
    let start = Instant::now();
    while metric_of(&w, "idemflow_records_received_total") < stored as f64 {
        assert!(start.elapsed() < Duration::from_secs(120), "received {} of {stored}:\n{}", metric_of(&w, "idemflow_records_received_total"), w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let m = w.scrape();
    assert_counters_add_up(&m);
    assert_eq!(metric(&m, "idemflow_records_applied_total", &P), s.distinct as f64, "each order once");
    assert_eq!(duplicates(&m, "redelivered"), 0.0, "a lone worker's deliveries come once");
    let skipped = duplicates(&m, "republished") + duplicates(&m, "payload_mismatch");
    assert_eq!(skipped as u64, stored - s.distinct as u64 - s.poison as u64, "every copy that reached the stream skipped");
    assert!(duplicates(&m, "republished") >= s.distinct as f64, "the late retries counted republished");
    println!(
        "{} messages published, {} kept by the server's duplicate window on the first pass, {stored} in the stream; \
         {} applied, {skipped} skipped by idemflow",
        all.len() + originals.len(),
        stored_first,
        s.distinct
    );
    let mut w = w;
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, s.distinct as i64);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, s.distinct as i64);
    assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, db.scalar::<String>("SELECT sum(amount)::text FROM payments").await);
    // The positions are the stream sequences: `explain` names them.
    let (status, out, err) = idemflow(&["explain", "--config", setup.config.to_str().unwrap(), "--pipeline", "payments", "--key", "ORDERID_1"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("PAYMENTS/0@"), "explain shows the stream sequence: {out}");
}

/// The server killed and started again mid-stream (its store kept): the worker's client reconnects, the pull
/// stream starts again, acknowledgements lost with the connection come back as redeliveries and are skipped;
/// every operation applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_stream_loses_nothing() {
    let mut server = NatsServer::start();
    server.create_stream("PAYMENTS").await;
    let s = payments(600, 1, false);
    let all = messages(&s);
    let half = all.len() / 2;
    server.publish("PAYMENTS.created", &all[..half]).await;
    let db = payments_db(None).await;
    let setup = Setup::nats(&db, &server, &[("payments.toml", &example("PAYMENTS", "ack_wait = \"5s\""))], "");
    let mut w = BinWorker::start(&setup);
    let start = Instant::now();
    while metric_of(&w, "idemflow_records_applied_total") == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(60), "nothing applied:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.start_again();
    server.publish("PAYMENTS.created", &all[half..]).await;
    wait_applied(&db, s.distinct, s.poison, &w).await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    println!(
        "server restart: {} received, {} applied, {} redelivered",
        metric(&m, "idemflow_records_received_total", &P),
        metric(&m, "idemflow_records_applied_total", &P),
        duplicates(&m, "redelivered")
    );
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, s.distinct as i64);
    let expected = s.expected_amount();
    assert_eq!(db.scalar::<String>("SELECT sum(amount)::text FROM payments").await, expected, "amounts exact");
    assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, expected, "each deduction once");
}

/// The durable consumer deleted while the worker consumes from it: the pipeline stops with the reason (never a
/// silent new consumer that would start over somewhere): logged, and `idemflow_pipeline_up` 0 (the worker keeps
/// serving /metrics, as for every pipeline stopped on a fatal error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_deleted_under_the_worker_stops_it_with_the_reason() {
    let server = NatsServer::start();
    server.create_stream("PAYMENTS").await;
    let s = payments(50, 1, false);
    server.publish("PAYMENTS.created", &messages(&s)).await;
    let db = payments_db(None).await;
    let setup = Setup::nats(&db, &server, &[("payments.toml", &example("PAYMENTS", ""))], "");
    let mut w = BinWorker::start(&setup);
    wait_applied(&db, s.distinct, s.poison, &w).await;
    let js = server.jetstream().await;
    js.get_stream("PAYMENTS").await.unwrap().delete_consumer("idemflow-payments").await.expect("deletes the consumer");
    let start = Instant::now();
    while !w.log_text().contains("pipeline stopped") {
        assert!(start.elapsed() < Duration::from_secs(60), "the pipeline did not stop:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = w.log_text();
    assert!(log.contains("was deleted on the server"), "the reason is logged:\n{log}");
    assert_eq!(metric_of(&w, "idemflow_pipeline_up"), 0.0);
    assert_exactly_once(&db, &s).await;
    w.kill();
}

/// `ack_wait` (2 s) far shorter than each transaction (every record's side effect sleeps, a batch takes about 5 s):
/// the in-progress acks sent every third of `ack_wait` keep the server from redelivering, so nothing is delivered
/// twice; measured as `redelivered` = 0 and `received` = the messages published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_wait_shorter_than_a_slow_transaction() {
    let server = NatsServer::start();
    server.create_stream("ORDERS").await;
    let db = TestDb::new("CREATE TABLE orders (id text PRIMARY KEY, amount numeric NOT NULL);").await;
    let pipeline = "[source]\nkind = \"nats\"\nstream = \"ORDERS\"\nack_wait = \"2s\"\n[batch]\nmax_records = 10\nmax_wait = \"50ms\"\n\
        [key]\nmessage_id = true\n[sink]\nsql = [\"INSERT INTO orders (id, amount) VALUES (:id, :amount)\", \"SELECT pg_sleep(0.5)\"]\n\
        [sink.params]\nid = { property = \"message_id\" }\namount = \"/amount\"\n";
    let msgs: Vec<(Option<String>, Vec<u8>)> = (0..30).map(|i| (Some(format!("o-{i}")), format!("{{\"amount\": {i}}}").into_bytes())).collect();
    server.publish("ORDERS.created", &msgs).await;
    let setup = Setup::nats(&db, &server, &[("payments.toml", pipeline)], "");
    let mut w = BinWorker::start(&setup);
    let start = Instant::now();
    while db.scalar::<i64>("SELECT count(*) FROM orders").await < 30 {
        assert!(start.elapsed() < Duration::from_secs(120), "not all applied:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A redelivery would have arrived by now (ack_wait has passed several times over).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = w.scrape();
    let seconds = metric(&m, "idemflow_batch_duration_seconds_sum", &P) / metric(&m, "idemflow_batch_duration_seconds_count", &P).max(1.0);
    println!("ack_wait 2 s, mean transaction {seconds:.1} s: received {}, redelivered {}", metric(&m, "idemflow_records_received_total", &P), duplicates(&m, "redelivered"));
    assert_eq!(metric(&m, "idemflow_records_received_total", &P), 30.0, "each message delivered once");
    assert_eq!(duplicates(&m, "redelivered"), 0.0);
    assert!(w.sigterm().success(), "{}", w.log_text());
}

/// `idemflow check` on what cannot keep the guarantee: each refusal with its reason, the warnings, and a missing
/// consumer reported as the one `run` creates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_what_cannot_work() {
    let server = NatsServer::start();
    server.create_stream("PAYMENTS").await;
    let js = server.jetstream().await;
    let stream = js.get_stream("PAYMENTS").await.unwrap();
    let pull_consumer = |name: &str, f: &dyn Fn(&mut pull::Config)| {
        let mut c = pull::Config { durable_name: Some(name.into()), ack_policy: AckPolicy::Explicit, ack_wait: Duration::from_secs(30), max_ack_pending: 5000, ..Default::default() };
        f(&mut c);
        c
    };
    stream.create_consumer(pull_consumer("none", &|c| c.ack_policy = AckPolicy::None)).await.unwrap();
    stream.create_consumer(pull_consumer("all", &|c| c.ack_policy = AckPolicy::All)).await.unwrap();
    stream.create_consumer(pull_consumer("quick", &|c| c.ack_wait = Duration::from_millis(10))).await.unwrap();
    stream.create_consumer(pull_consumer("unbounded", &|c| c.max_ack_pending = -1)).await.unwrap();
    stream.create_consumer(pull_consumer("small", &|c| c.max_ack_pending = 100)).await.unwrap();
    stream.create_consumer(pull_consumer("limited", &|c| c.max_deliver = 5)).await.unwrap();
    stream.create_consumer(pull_consumer("other-filter", &|c| c.filter_subject = "PAYMENTS.other".into())).await.unwrap();
    stream.create_consumer(pull_consumer("headers", &|c| c.headers_only = true)).await.unwrap();
    stream
        .create_consumer(push::Config { durable_name: Some("pushed".into()), deliver_subject: "deliver.here".into(), ack_policy: AckPolicy::Explicit, ..Default::default() })
        .await
        .unwrap();
    let db = payments_db(None).await;
    let check = |source_extra: &str, stream_name: &str| {
        let setup = Setup::nats(&db, &server, &[("payments.toml", &example(stream_name, source_extra))], "");
        let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
        (status.success(), format!("{out}{err}"))
    };
    let refused = |extra: &str, stream_name: &str, why: &str| {
        let (ok, text) = check(extra, stream_name);
        assert!(!ok && text.contains(why), "refused with {why:?}:\n{text}");
    };
    refused("", "NOPE", "stream \"NOPE\" does not exist");
    refused("consumer = \"none\"", "PAYMENTS", "idemflow needs explicit acks");
    refused("consumer = \"all\"", "PAYMENTS", "idemflow needs explicit acks");
    refused("consumer = \"quick\"", "PAYMENTS", "not above batch.max_wait");
    refused("consumer = \"unbounded\"", "PAYMENTS", "no max_ack_pending limit");
    refused("consumer = \"small\"", "PAYMENTS", "below batch.max_records");
    refused("consumer = \"pushed\"", "PAYMENTS", "is a push consumer");
    refused("consumer = \"other-filter\"\nfilter_subjects = [\"PAYMENTS.created\"]", "PAYMENTS", "not [source] filter_subjects");
    refused("consumer = \"limited\"", "PAYMENTS", "has max_deliver 5");
    refused("consumer = \"headers\"", "PAYMENTS", "delivers headers only");
    // Several filter subjects need a 2.10 server; this one is 2.9.
    refused("filter_subjects = [\"PAYMENTS.a\", \"PAYMENTS.b\"]", "PAYMENTS", "needs nats-server 2.10 or later");
    let (ok, text) = check("", "PAYMENTS");
    assert!(ok && text.contains("does not exist yet: `idemflow run` creates it"), "{text}");
    assert!(text.contains("duplicate_window"), "the server's duplicate window is reported:\n{text}");
    assert!(text.contains("keeps messages until its limits"), "a stream without max_age outlasts the retention:\n{text}");
    // All is well: the client's own INFO lines (`event: connected`) are not shown.
    assert!(!text.contains("what the client libraries logged") && !text.contains("NATS connection"), "{text}");
    // A stream holding messages older than the dedup retention: `check` and `run` refuse to create a consumer from
    // its first message (the dedup rows of the oldest may be gone); the worker stops with the reason.
    server.publish("PAYMENTS.created", &[(None, b"{}".to_vec())]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let old = example("PAYMENTS", "").replace("[key]", "[dedup]\nretention = \"2s\"\n\n[key]");
    assert!(old.contains("retention = \"2s\""), "{old}");
    let setup = Setup::nats(&db, &server, &[("payments.toml", &old)], "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success() && format!("{out}{err}").contains("older than [dedup] retention"), "{out}{err}");
    let mut w = BinWorker::start(&setup);
    let start = Instant::now();
    while !w.log_text().contains("pipeline stopped") {
        assert!(start.elapsed() < Duration::from_secs(60), "the pipeline did not stop:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(w.log_text().contains("nats consumer add PAYMENTS idemflow-payments"), "{}", w.log_text());
    w.kill();
    assert!(stream.consumer_info("idemflow-payments").await.is_err(), "no consumer was created");
    // The pipeline file's own mistakes, before any server is asked.
    refused("[offsets]\nstore = \"database\"", "PAYMENTS", "a JetStream durable consumer keeps its position on the server");
    refused("max_ack_pending = 10", "PAYMENTS", "source.max_ack_pending");
    refused("queue = \"q\"", "PAYMENTS", "source.queue: belongs to a rabbitmq source");
    // JetStream off: a server without -js.
    let plain = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = std::process::Command::new("/usr/sbin/nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .current_dir(plain.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let setup = Setup::sections(
        &format!("[database]\nurl = \"{}\"\n", db.url),
        &format!("[nats]\nurl = \"nats://127.0.0.1:{port}\"\nrequest_timeout = \"2s\"\n"),
        &[("payments.toml", &example("PAYMENTS", ""))],
        "",
    );
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    let _ = child.kill();
    let _ = child.wait();
    assert!(!status.success() && format!("{out}{err}").contains("JetStream is not enabled"), "{out}{err}");
    // Rewind is refused with the way to replay.
    let setup = Setup::nats(&db, &server, &[("payments.toml", &example("PAYMENTS", ""))], "");
    let (status, out, err) = idemflow(&["rewind", "--config", setup.config.to_str().unwrap(), "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(!status.success() && err.contains("nats consumer add PAYMENTS idemflow-payments-replay ") && err.contains("[source] consumer"), "a new name, not the one in use: {out}{err}");
}

/// `[nats]` credentials and TLS: user and password (in the settings or in the URL), a token, and TLS with a private
/// CA; a wrong password or an unrelated CA is refused with the reason, and no credential is ever printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_and_tls_with_a_private_ca() {
    let db = payments_db(None).await;
    let check = |section: &str| {
        let setup = Setup::sections(
            &format!("[database]\nurl = \"{}\"\n", db.url),
            &format!("[nats]\n{section}connect_timeout = \"3s\"\nrequest_timeout = \"2s\"\n"),
            &[("payments.toml", &example("PAYMENTS", ""))],
            "",
        );
        let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
        (status.success(), format!("{out}{err}"))
    };
    // User and password.
    let server = NatsServer::start_with(&["--user", "idem", "--pass", "s3cret-pw"]);
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::with_user_and_password("idem".into(), "s3cret-pw".into()).connect(&server.url).await.unwrap(),
    );
    js.create_stream(async_nats::jetstream::stream::Config { name: "PAYMENTS".into(), subjects: vec!["payments.>".into()], ..Default::default() })
        .await
        .unwrap();
    let url = &server.url;
    let (ok, text) = check(&format!("url = \"{url}\"\nuser = \"idem\"\npassword = \"s3cret-pw\"\n"));
    assert!(ok && text.contains("consumer \"idemflow-payments\" does not exist yet"), "{text}");
    let in_url = url.replace("nats://", "nats://idem:s3cret-pw@");
    let (ok, text) = check(&format!("url = \"{in_url}\"\n"));
    assert!(ok, "credentials in the URL: {text}");
    let (ok, text) = check(&format!("url = \"{url}\"\nuser = \"idem\"\npassword = \"wr0ng-pw\"\n"));
    assert!(!ok && text.to_lowercase().contains("authorization"), "a wrong password is refused with the reason: {text}");
    for (what, t) in [("right", &text)] {
        assert!(!t.contains("s3cret-pw") && !t.contains("wr0ng-pw"), "{what}: no password printed: {t}");
    }
    drop(server);
    // A token.
    let server = NatsServer::start_with(&["--auth", "t0ken-xyz"]);
    let js = async_nats::jetstream::new(async_nats::ConnectOptions::with_token("t0ken-xyz".into()).connect(&server.url).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config { name: "PAYMENTS".into(), subjects: vec!["payments.>".into()], ..Default::default() })
        .await
        .unwrap();
    let (ok, text) = check(&format!("url = \"{}\"\ntoken = \"t0ken-xyz\"\n", server.url));
    assert!(ok && !text.contains("t0ken-xyz"), "{text}");
    drop(server);
    // TLS with a private CA: the server's certificate names localhost, signed by the test CA (the test's own client
    // needs the process's TLS provider, as the worker installs it).
    idemflow::install_tls_provider();
    let certs = tempfile::tempdir().unwrap();
    crate::security::certificates(certs.path());
    let file = |name: &str| certs.path().join(name).display().to_string();
    let server = NatsServer::start_with(&["--tls", "--tlscert", &file("server.crt"), "--tlskey", &file("server.key")]);
    let tls_url = format!("tls://localhost:{}", server.port());
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::new().add_root_certificates(certs.path().join("ca.crt")).require_tls(true).connect(&tls_url).await.unwrap(),
    );
    js.create_stream(async_nats::jetstream::stream::Config { name: "PAYMENTS".into(), subjects: vec!["payments.>".into()], ..Default::default() })
        .await
        .unwrap();
    let (ok, text) = check(&format!("url = \"{tls_url}\"\ntls_ca_file = \"{}\"\n", file("ca.crt")));
    assert!(ok && text.contains("stream \"PAYMENTS\""), "TLS with the private CA: {text}");
    let (ok, text) = check(&format!("url = \"{tls_url}\"\ntls_ca_file = \"{}\"\n", file("other-ca.crt")));
    assert!(!ok, "a certificate from another CA is refused: {text}");
}

/// Messages fetched while a batch is in its transaction are prepared ahead from the connector's own stash, each for
/// itself (see [`crate::hardening::records_prepared_ahead_from_a_queue_bind_their_own_values`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_fetched_while_a_batch_waits_are_prepared_ahead() {
    let server = NatsServer::start();
    server.create_stream("ORDERS").await;
    let db = TestDb::new(crate::hardening::ORDERS).await;
    let pipeline = "[source]\nkind = \"nats\"\nstream = \"ORDERS\"\n[key]\nmessage_id = true\n[sink]\ntable = \"orders\"\n\
        [sink.columns]\nid = { property = \"message_id\" }\namount = \"/amount\"\n";
    let setup = Setup::nats(&db, &server, &[("payments.toml", pipeline)], "");
    let publish = |id: &'static str, amount: &'static str| {
        let server = &server;
        async move { server.publish("ORDERS.created", &[(Some(id.to_owned()), format!("{{\"amount\": {amount}}}").into_bytes())]).await }
    };
    crate::hardening::records_prepared_ahead_from_a_queue_bind_their_own_values(&setup, &db, publish).await;
}

/// A stream deleted and created again numbers its messages from 1 again: a new poison message at the sequence an
/// old one was dead-lettered at is a dead letter of its own, with its body (dead letters are unique by position and
/// payload digest, PostgreSQL migration 10), not a `redelivered` duplicate of the old one; the old dead letter stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_poison_message_at_the_sequence_of_an_old_one_after_the_stream_was_created_again() {
    let server = NatsServer::start();
    server.create_stream("PAYMENTS").await;
    let first = br#"{"order": {"id": "A-1""#.to_vec();
    server.publish("PAYMENTS.created", &[(Some("poison-a".into()), first.clone())]).await;
    let db = payments_db(None).await;
    let setup = Setup::nats(&db, &server, &[("payments.toml", &example("PAYMENTS", ""))], "");
    let mut w = BinWorker::start(&setup);
    wait_applied(&db, 0, 1, &w).await;
    assert!(w.sigterm().success(), "{}", w.log_text());

    let js = server.jetstream().await;
    js.delete_stream("PAYMENTS").await.expect("deletes the stream");
    server.create_stream("PAYMENTS").await;
    let second = br#"{"order": {"id": "B-1""#.to_vec();
    server.publish("PAYMENTS.created", &[(Some("poison-b".into()), second.clone())]).await;
    let w = BinWorker::start(&setup);
    wait_applied(&db, 0, 2, &w).await;
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), 1.0, "{m}");
    assert_eq!(duplicates(&m, "redelivered") + duplicates(&m, "republished"), 0.0, "{m}");
    let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(r#"SELECT "offset", payload FROM idemflow.dead_letters ORDER BY id"#)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![(1, first), (1, second)], "both kept, at the same sequence");
}

/// Duplicates are classified by the stream sequence, not the delivery count: the durable consumer deleted while the
/// worker is stopped and created again by it delivers every applied message for the first time (delivery count 1),
/// and each is `redelivered` (its own sequence), none `republished`; nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_created_again_delivers_applied_messages_as_redelivered() {
    let server = NatsServer::start();
    server.create_stream("PAYMENTS").await;
    let s = payments(30, 1, false);
    server.publish("PAYMENTS.created", &messages(&s)).await;
    let db = payments_db(None).await;
    let setup = Setup::nats(&db, &server, &[("payments.toml", &example("PAYMENTS", ""))], "");
    let mut w = BinWorker::start(&setup);
    wait_applied(&db, s.distinct, s.poison, &w).await;
    let first = w.scrape();
    assert!(w.sigterm().success(), "{}", w.log_text());
    let js = server.jetstream().await;
    js.get_stream("PAYMENTS").await.unwrap().delete_consumer("idemflow-payments").await.expect("deletes the consumer");

    let w = BinWorker::start(&setup);
    // What the stream holds: its duplicate window dropped the copies that reuse an order id's Nats-Msg-Id.
    let total = metric(&first, "idemflow_records_received_total", &P);
    let start = Instant::now();
    while metric_of(&w, "idemflow_records_received_total") < total {
        assert!(start.elapsed() < Duration::from_secs(60), "not every message delivered again in 60 s:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    // Poison messages too: each found dead-lettered at its sequence with its payload.
    assert_eq!(duplicates(&m, "redelivered"), total, "every message at its own sequence again\nfirst run:\n{first}\nsecond run:\n{m}");
    assert_eq!(duplicates(&m, "republished") + duplicates(&m, "payload_mismatch"), 0.0, "{m}");
    assert_eq!(metric(&m, "idemflow_records_applied_total", &P), 0.0, "{m}");
    assert_exactly_once(&db, &s).await;
}
