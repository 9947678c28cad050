//! `idemflow demo`, as a newcomer runs it: the binary, a small stream, the summary and its checks.

use crate::support::*;

/// `idemflow demo <args>` from the project's root, its metrics on a free port, on the suite's PostgreSQL server
/// unless `DATABASE_URL` names another.
fn demo(args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"));
    cmd.arg("demo").args(args).args(["--metrics-listen", "127.0.0.1:0"]).current_dir(project_root());
    if std::env::var("DATABASE_URL").is_err() {
        cmd.env("DATABASE_URL", postgres::server_url());
    }
    cmd.output().unwrap()
}

#[test]
fn demo_summary_checks_exactly_once() {
    let out = demo(&["--records", "6000"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("through pipelines/payments.toml"), "the shipped pipeline is used: {stderr}");
    assert!(stderr.contains("worker A stopped abruptly") && stderr.contains("worker B joined") && stderr.contains("worker B left"), "{stderr}");
    let number = |label: &str| -> u64 {
        let line = stdout.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no {label:?} in:\n{stdout}"));
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert_eq!(number("records produced"), 6000);
    assert_eq!(number("applied (business effects)"), number("distinct operations"));
    assert!(number("republished (producer retries)") > 0);
    assert!(number("redelivered (crash, rebalance)") > 0, "the crash must cause redeliveries:\n{stdout}");
    assert!(number("payload_mismatch (order id reused)") > 0);
    assert!(number("decode_failed") > 0);
    assert!(stdout.contains("check: business rows") && stdout.matches(": ok").count() == 7, "{stdout}");
    assert!(!stdout.contains("differs"), "{stdout}");
    for line in ["consumed", "republished", "payload_mismatch", "dead letters"] {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(line) && l.ends_with(": ok")), "no reconciled {line:?} line:\n{stdout}");
    }
}

/// `demo --effect http`: the same stream, each payment also charged through the demo's payment provider over HTTP,
/// through the outbox, with the crash, the rebalance and the producer's retries; the provider drops some answers after
/// charging, the relay sends those again, and the provider recognises them: charges made == distinct operations.
#[test]
fn demo_with_the_http_effect_charges_each_operation_once() {
    let out = demo(&["--records", "4000", "--effect", "http"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("a throwaway payment provider on http://127.0.0.1:") && stderr.contains("worker A stopped abruptly"), "{stderr}");
    let number = |label: &str| -> u64 {
        let line = stdout.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no {label:?} in:\n{stdout}"));
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert_eq!(number("charges it made"), number("distinct operations"));
    assert!(number("answers it lost after charging") > 0, "{stdout}");
    assert!(number("repeated requests it recognised") >= number("answers it lost after charging"), "{stdout}");
    assert!(stdout.contains("check: charges made") && stdout.contains("check: total charged"), "{stdout}");
    assert!(!stdout.contains("FAILED") && !stdout.contains("differs"), "{stdout}");
}

/// `demo --keep-running` says where its broker and database are, so a user can look at them, without printing the
/// database password.
#[test]
fn demo_keep_running_prints_the_broker_and_database_addresses() {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"));
    cmd.args(["demo", "--records", "2000", "--metrics-listen", "127.0.0.1:0", "--keep-running"]).current_dir(project_root());
    if std::env::var("DATABASE_URL").is_err() {
        cmd.env("DATABASE_URL", postgres::server_url());
    }
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let done = line.trim_start().starts_with("PostgreSQL:");
        seen.push(line);
        if done {
            break;
        }
    }
    // The rest of its output read on, so that nothing it prints while it stops meets a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    // Sent right after the addresses print: the demo listens before it prints them, so this signal is not lost.
    let status = sigterm_child(&mut child, std::time::Duration::from_secs(60))
        .unwrap_or_else(|| panic!("the demo did not stop within 60 s of SIGTERM: {seen:?}"));
    assert!(status.success(), "{seen:?}");
    let text = seen.join("\n");
    let kafka = seen.iter().find(|l| l.contains("Kafka (embedded broker): 127.0.0.1:")).unwrap_or_else(|| panic!("{text}"));
    assert!(kafka.contains("topic payments"), "{text}");
    let pg = seen.iter().find(|l| l.trim_start().starts_with("PostgreSQL: postgres://")).unwrap_or_else(|| panic!("{text}"));
    assert!(pg.contains("/idemflow_demo_") && pg.contains(":***@"), "the address without the password: {pg}");
}

#[test]
fn demo_producer_sends_keyed_payments_with_duplicates() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::Message;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 3);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["demo-producer", "--bootstrap-servers", kafka.bootstrap(), "--rate", "300"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while kafka.end_offsets("payments", 3).iter().sum::<i64>() < 600 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(child.wait().unwrap().success());
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("group.id", "reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    c.subscribe(&["payments"]).unwrap();
    let mut ids = std::collections::HashMap::<Vec<u8>, usize>::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let total: i64 = kafka.end_offsets("payments", 3).iter().sum();
    let mut seen = 0;
    while seen < total && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(std::time::Duration::from_millis(200)) {
            seen += 1;
            *ids.entry(m.key().unwrap_or_default().to_vec()).or_default() += 1;
        }
    }
    assert!(total >= 600, "the producer keeps sending, round after round: {total}");
    assert_eq!(seen, total);
    assert!(ids.values().any(|n| *n > 1), "some operations are sent more than once");
    assert!(ids.keys().all(|k| k.starts_with(b"ORDERID_")), "records are keyed by order id");
}

/// `idemflow demo --source rabbitmq`: a throwaway RabbitMQ node and a quorum queue, the shipped RabbitMQ example
/// pipeline, a worker killed between its commit and its acknowledgement, a second consumer on the queue: every
/// operation applied once, the counts reconciled.
#[test]
fn demo_on_rabbitmq_checks_exactly_once() {
    let (stdout, stderr, number) = demo_on_one_stream("rabbitmq");
    assert!(stderr.contains("through examples/rabbitmq/payments.toml") && stderr.contains("quorum queue payments"), "{stderr}");
    assert!(stderr.contains("before its acknowledgement; restarted") && stderr.contains("worker B started on the same queue"), "{stderr}");
    assert!(number("republished (producer retries)") > 0, "{stdout}");
}

/// `idemflow demo --source nats`: a throwaway nats-server and a stream, the shipped JetStream example pipeline, a
/// worker killed between its commit and its acks, a second worker on the same durable consumer: every operation
/// applied once, the stream's own drops (its duplicate window) and idemflow's skips reconciled.
#[test]
fn demo_on_nats_checks_exactly_once() {
    let (stdout, stderr, number) = demo_on_one_stream("nats");
    assert!(stderr.contains("through examples/nats/payments.toml") && stderr.contains("stream PAYMENTS"), "{stderr}");
    assert!(stderr.contains("before its acks; restarted") && stderr.contains("worker B started on the same durable consumer"), "{stderr}");
    assert!(number("dropped by the stream (duplicate window)") > 0, "the stream drops in-window retries itself:\n{stdout}");
}

/// Runs `idemflow demo --source <source>` over 6,000 records (competing consumers: no order kept) and checks what
/// holds on every such broker: each operation applied once, the crash before the acknowledgement redelivered, every
/// check ok and the counts reconciled. Returns stdout, stderr and a reader of the summary's numbers.
fn demo_on_one_stream(source: &str) -> (String, String, impl Fn(&str) -> u64) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"));
    cmd.args(["demo", "--source", source, "--records", "6000", "--metrics-listen", "127.0.0.1:0"]).current_dir(project_root());
    if std::env::var("DATABASE_URL").is_err() {
        cmd.env("DATABASE_URL", postgres::server_url());
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let summary = stdout.clone();
    let number = move |label: &str| -> u64 {
        let line = summary.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no {label:?} in:\n{summary}"));
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert_eq!(number("applied (business effects)"), number("distinct operations"));
    assert!(number("redelivered (crash, rebalance)") > 0, "the crash before the acknowledgement must cause redeliveries:\n{stdout}");
    assert!(!stdout.contains("differs") && !stdout.contains("FAILED"), "{stdout}");
    assert!(stdout.lines().any(|l| l.contains("consumed again") && l.ends_with(": ok")), "{stdout}");
    (stdout, stderr, number)
}

/// Runs `idemflow demo` over 6,000 records with `args`, checks it passed every check, and returns its stdout and
/// stderr.
fn demo_passes(args: &[&str]) -> (String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["demo", "--records", "6000", "--metrics-listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("DATABASE_URL")
        .current_dir(project_root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("check: business rows") && stdout.matches(": ok").count() == 7, "{stdout}");
    assert!(!stdout.contains("differs") && !stdout.contains("FAILED"), "{stdout}");
    (stdout, stderr)
}

/// `idemflow demo --database-url mysql://...`: the same demo on MariaDB, through examples/mysql/payments.toml.
#[test]
fn demo_on_mariadb_checks_exactly_once() {
    let (_, stderr) = demo_passes(&["--database-url", &mariadb::server_url()]);
    assert!(stderr.contains("through examples/mysql/payments.toml") && stderr.contains("(MySQL/MariaDB)"), "{stderr}");
}

/// `idemflow demo --redis`: the same demo on a throwaway redis-server, through examples/redis/payments.toml. The
/// positions are stored in Redis with the effects, so the crash and the rebalances redeliver nothing.
#[test]
fn demo_on_redis_checks_exactly_once() {
    let (stdout, stderr) = demo_passes(&["--redis"]);
    assert!(stderr.contains("through examples/redis/payments.toml") && stderr.contains("throwaway redis-server"), "{stderr}");
    assert!(stdout.contains("redelivered 0 (consumed again"), "{stdout}");
}

/// `idemflow demo --format avro` and `--format protobuf`: the same payments encoded as Avro datums and Protobuf
/// messages of `examples/formats/`, read by the pipeline with its `schema_file`; every check passes, poison records
/// dead-lettered as `decode_failed`.
#[test]
fn demo_in_avro_and_protobuf_checks_exactly_once() {
    for format in ["avro", "protobuf"] {
        let (stdout, stderr) = demo_passes(&["--format", format]);
        let shown = if format == "avro" { "Avro" } else { "Protobuf" };
        assert!(stderr.contains(&format!("its payments in {shown}")), "{stderr}");
        assert!(stdout.contains("decode_failed"), "{stdout}");
    }
}
