//! `idemflow bench` end to end, small: every run happens and the figures are written as Markdown and JSON. (The
//! figures themselves are measurements, never asserted: see docs/benchmarks.md.)

use crate::support::*;

/// Runs `idemflow <args>` in `cwd` (off the async runtime), asserts it succeeded, and returns its standard output
/// and the JSON report it wrote to `json`.
async fn bench(args: Vec<String>, cwd: &std::path::Path, json: &std::path::Path) -> (String, serde_json::Value) {
    let cwd = cwd.to_owned();
    let (status, out, err) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        idemflow(&args, &cwd)
    })
    .await
    .unwrap();
    assert!(status.success(), "{out}\n{err}");
    (out, serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_every_baseline_and_writes_markdown_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let (md, json) = (dir.path().join("bench.md"), dir.path().join("bench.json"));
    let args: Vec<String> = [
        "bench", "--records", "4000", "--single-records", "200", "--sql-records", "1000", "--preload", "20000",
        "--database-url", postgres::server_url(), "--markdown", md.to_str().unwrap(), "--json", json.to_str().unwrap(),
    ]
    .map(String::from)
    .into();
    let (out, report) = bench(args, dir.path(), &json).await;
    let runs = report["runs"].as_array().unwrap();
    let ids: Vec<&str> = runs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        ["(1)", "(2)", "(3)", "(4)", "(5)", "(6)", "(7)", "(8)", "(9)", "(10)", "(11)", "(12)", "(13)", "(14)", "(15)", "(16)", "(17)", "(18)", "(19)", "(20)"]
    );
    for r in runs {
        assert!(r["records_per_second"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["records"].as_u64().unwrap() > 0, "{r}");
    }
    for worker_run in [0, 1, 3, 5, 6, 7, 11, 12, 13, 14, 15, 16, 19] {
        let r = &runs[worker_run];
        assert!(r["cpu_us_per_record"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["peak_rss_mib"].as_f64().unwrap() > 1.0, "{r}");
        assert!(r["batch_p50_ms"].as_f64().is_some(), "{r}");
    }
    assert!(runs[3]["note"].as_str().unwrap().starts_with("20000 preloaded keys"), "{}", runs[3]);
    assert!(runs[19]["note"].as_str().unwrap().contains("requests confirmed by the provider, commit to confirmation p50"), "{}", runs[19]);
    let ratios: Vec<&str> = report["ratios"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        ratios,
        [
            "(1) / min((3), (5))",
            "(1) / (2)",
            "(4) / (1), with the dedup keys preloaded",
            "(6) / (1)",
            "(7) / (1), Redis against the Postgres table form",
            "(7) / (5), Redis against consume-only",
            "(8) / (1), the shipped example (batch SQL form) against the table form",
            "(8) / (13), the shipped example against its per-record SQL form",
            "(13) / (12), the per-record SQL form: server-side loop against per-record round trips",
            "(14) / (1), two batch transactions at once against one",
            "(15) / (1), four batch transactions at once against one",
            "(1) / (9), the table form against COPY of the minimal rows",
            "(1) / (10), against a batched consumer written by hand",
            "(14) / (10), two batch transactions at once against the hand-written consumer",
            "PostgreSQL CPU per record, (1) / (10)",
            "PostgreSQL WAL bytes per record, (1) / (10)",
            "worker CPU µs per record of (1) (a figure, not a ratio)",
            "peak RSS MiB of (1), the default configuration (a figure)",
            "(1) / (11), against the guides' per-message consumer",
            "(16) / (1), Avro payloads against JSON",
            "(17) / (1), Protobuf payloads against JSON",
            "(18) / (5), consume-only: Avro decode against JSON",
            "(19) / (5), consume-only: Protobuf decode against JSON",
            "(20) / (1), an HTTP request per new key through the outbox against the table form alone",
            "worker CPU µs per record, (16) - (1): Avro's decode against JSON's (a figure)",
            "worker CPU µs per record, (17) - (1): Protobuf's decode against JSON's (a figure)",
        ]
    );
    // Each with its target and whether the median meets it.
    for r in report["ratios"].as_array().unwrap() {
        let target = r["target"].as_str().unwrap();
        assert!(target == "(measured)" || target.starts_with(">= ") || target.starts_with("<= "), "{r}");
    }
    assert!(runs[7]["note"].as_str().unwrap().contains("4000 received"), "the shipped example: {}", runs[7]);
    assert!(runs[12]["note"].as_str().unwrap().contains("4000 received"), "its per-record form: {}", runs[12]);
    let applied = |r: &serde_json::Value| r["note"].as_str().unwrap().split(" applied").next().unwrap().rsplit(' ').next().unwrap().to_owned();
    assert!(applied(&runs[7]).parse::<u64>().unwrap() > 3000, "{}", runs[7]);
    assert_eq!(applied(&runs[12]), applied(&runs[7]), "the per-record form applies what the batch SQL form does");
    // The same orders as Avro and Protobuf: the same records applied as from JSON, every one prepared.
    assert_eq!(applied(&runs[15]), applied(&runs[0]), "Avro: {}", runs[15]);
    assert_eq!(applied(&runs[16]), applied(&runs[0]), "Protobuf: {}", runs[16]);
    for consume_only in [17, 18] {
        assert!(runs[consume_only]["note"].as_str().unwrap().starts_with("4000 records prepared"), "{}", runs[consume_only]);
    }
    for hand_written in [9, 10] {
        assert!(runs[hand_written]["cpu_us_per_record"].as_f64().unwrap() > 0.0, "{}", runs[hand_written]);
    }
    // The PostgreSQL cluster's CPU over each run on it: every worker run but Redis's, and the hand-written (10).
    for on_postgres in [0, 1, 3, 5, 7, 9, 11, 12, 13, 14, 19] {
        assert!(runs[on_postgres]["db_cpu_us_per_record"].as_f64().unwrap() > 0.0, "{}", runs[on_postgres]);
        // Every record's dedup row, at least its key, goes through the WAL.
        assert!(runs[on_postgres]["wal_bytes_per_record"].as_f64().unwrap() > 10.0, "{}", runs[on_postgres]);
    }
    assert!(runs[6]["db_cpu_us_per_record"].is_null(), "the Redis run has no PostgreSQL: {}", runs[6]);
    assert!(runs[6]["wal_bytes_per_record"].is_null(), "the Redis run has no PostgreSQL: {}", runs[6]);
    assert!(runs[6]["note"].as_str().unwrap().contains("4000 received"), "the Redis run: {}", runs[6]);
    let settings = report["environment"].to_string();
    assert!(settings.contains("synchronous_commit") && settings.contains("fsync"), "{settings}");
    let table = std::fs::read_to_string(&md).unwrap();
    assert!(table.contains("| (1) | idemflow, default batching (table form) |"), "{table}");
    assert!(out.contains("| ratio | measured | target | met |"), "{out}");
    assert!(out.contains("| yes |") || out.contains("| no |"), "{out}");
}

/// `idemflow bench --only 1,10 --repeat 3`, small: the two runs three times in turn, each repetition reading the
/// whole stream in its own consumer groups, and each ratio the median of the three with their range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_repeats_runs_in_turn_and_gives_the_median_ratio() {
    let dir = tempfile::tempdir().unwrap();
    let (md, json) = (dir.path().join("bench.md"), dir.path().join("bench.json"));
    let args: Vec<String> = [
        "bench", "--records", "3000", "--only", "1,10", "--repeat", "3", "--database-url", postgres::server_url(),
        "--markdown", md.to_str().unwrap(), "--json", json.to_str().unwrap(),
    ]
    .map(String::from)
    .into();
    let (out, report) = bench(args, dir.path(), &json).await;
    let runs = report["runs"].as_array().unwrap();
    let seen: Vec<(String, u64)> =
        runs.iter().map(|r| (r["id"].as_str().unwrap().to_owned(), r["repetition"].as_u64().unwrap())).collect();
    let expected: Vec<(String, u64)> =
        [("(1)", 1), ("(10)", 1), ("(1)", 2), ("(10)", 2), ("(1)", 3), ("(10)", 3)].map(|(i, n)| (i.to_owned(), n)).into();
    assert_eq!(seen, expected);
    for r in runs {
        // Each repetition read the whole stream: its groups were new, not resumed from the one before.
        let whole = if r["id"] == "(1)" { r["note"].as_str().unwrap().contains("3000 received") } else { r["records"] == 3000 };
        assert!(whole, "{r}");
        assert!(r["wal_bytes_per_record"].as_f64().unwrap() > 10.0, "{r}");
        if r["id"] == "(1)" {
            // Every distinct key applied before the run ended, and the end-to-end latency counted from the run's
            // own start: within the run, not carrying the earlier repetitions' time.
            let applied: u64 = r["note"].as_str().unwrap().split(" applied").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
            assert!(applied > 2900, "{r}");
            let (p50, p99) = (r["e2e_p50_ms"].as_f64().unwrap(), r["e2e_p99_ms"].as_f64().unwrap());
            assert!(p50 <= p99 && p99 <= r["seconds"].as_f64().unwrap() * 1000.0 + 1.0, "{r}");
        }
    }
    let ratio = |name: &str| report["ratios"].as_array().unwrap().iter().find(|r| r["name"] == name).cloned().unwrap();
    let rates: Vec<f64> = [0, 2, 4]
        .map(|i| runs[i]["records_per_second"].as_f64().unwrap() / runs[i + 1]["records_per_second"].as_f64().unwrap())
        .into();
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    let against = ratio("(1) / (10), against a batched consumer written by hand");
    assert_eq!(against["repetitions"], 3, "{against}");
    assert!((against["value"].as_f64().unwrap() - sorted[1]).abs() < 1e-9, "the median of {rates:?}: {against}");
    assert!((against["low"].as_f64().unwrap() - sorted[0]).abs() < 1e-9, "{against}");
    assert!((against["high"].as_f64().unwrap() - sorted[2]).abs() < 1e-9, "{against}");
    assert_eq!(ratio("PostgreSQL WAL bytes per record, (1) / (10)")["repetitions"], 3);
    assert!(out.contains("(median of 3;"), "{out}");
    assert!(std::fs::read_to_string(&md).unwrap().contains("| (10) #3 |"));
}

/// `idemflow bench --source rabbitmq`, small: the worker from a quorum queue into PostgreSQL (table form and the
/// shipped example) and into Redis, and the consume-only ceiling, all run and written, with their ratios.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_on_rabbitmq_runs_the_worker_and_the_consume_only_ceiling() {
    bench_on_one_stream("rabbitmq", "RabbitMQ").await
}

/// `idemflow bench --source nats`, small: the same runs from JetStream streams of a throwaway nats-server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_on_nats_runs_the_worker_and_the_consume_only_ceiling() {
    bench_on_one_stream("nats", "NATS JetStream").await
}

/// `idemflow bench --source rocketmq`, small: the same runs from topics of a throwaway RocketMQ name server and
/// broker, (5) through the worker's own pull consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_on_rocketmq_runs_the_worker_and_the_consume_only_ceiling() {
    bench_on_one_stream("rocketmq", "RocketMQ").await
}

/// Runs (1), (5), (7) and (8) of `idemflow bench --source <source>` over 5,000 records, each with every record
/// received, and the ratios named after `broker`.
async fn bench_on_one_stream(source: &str, broker: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (md, json) = (dir.path().join("bench.md"), dir.path().join("bench.json"));
    let args: Vec<String> = [
        "bench", "--source", source, "--records", "5000", "--database-url", postgres::server_url(), "--markdown",
        md.to_str().unwrap(), "--json", json.to_str().unwrap(),
    ]
    .map(String::from)
    .into();
    let (_, report) = bench(args, dir.path(), &json).await;
    let runs = report["runs"].as_array().unwrap();
    let ids: Vec<&str> = runs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["(1)", "(5)", "(7)", "(8)"]);
    for r in runs {
        assert!(r["records"].as_u64().unwrap() > 0, "{r}");
        assert!(r["records_per_second"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(runs[0]["note"].as_str().unwrap().contains("5000 received"), "{}", runs[0]);
    assert_eq!(report["ratios"][0]["name"].as_str().unwrap(), format!("(1) / (5), {broker}"));
    assert_eq!(report["ratios"][2]["name"].as_str().unwrap(), format!("(7) / (5), {broker}: Redis against consume-only"));
    assert!(runs[2]["note"].as_str().unwrap().contains("5000 received"), "the Redis run: {}", runs[2]);
    assert!(runs[3]["note"].as_str().unwrap().contains("5000 received"), "the shipped example: {}", runs[3]);
    assert_eq!(
        report["ratios"][3]["name"].as_str().unwrap(),
        format!("(8) / (1), {broker}: the shipped example (batch SQL form) against the table form")
    );
    assert!(std::fs::read_to_string(&md).unwrap().contains(broker));
}

/// `idemflow bench --database-url mysql://...`, small: runs (1), (2), (5) and (6) on MariaDB, with its settings and
/// the ratios.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_on_mariadb_runs_the_worker_runs_and_the_consume_only_ceiling() {
    let dir = tempfile::tempdir().unwrap();
    let (md, json) = (dir.path().join("bench.md"), dir.path().join("bench.json"));
    let args: Vec<String> = [
        "bench", "--records", "4000", "--single-records", "200", "--sql-records", "1000", "--database-url",
        &mariadb::server_url(), "--markdown", md.to_str().unwrap(), "--json", json.to_str().unwrap(),
    ]
    .map(String::from)
    .into();
    let (_, report) = bench(args, dir.path(), &json).await;
    let runs = report["runs"].as_array().unwrap();
    let ids: Vec<&str> = runs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["(1)", "(2)", "(5)", "(6)"]);
    for r in runs {
        assert!(r["records_per_second"].as_f64().unwrap() > 0.0, "{r}");
    }
    let applied = runs[3]["note"].as_str().unwrap();
    assert!(applied.contains("applied"), "the SQL form applies records on MySQL: {applied}");
    let ratios: Vec<&str> = report["ratios"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(ratios, ["(1) / (5)", "(1) / (2)", "(6) / (1)"]);
    let settings = report["environment"].to_string();
    assert!(settings.contains("MariaDB") && settings.contains("innodb_flush_log_at_trx_commit"), "{settings}");
}

/// Two benches against one database server run in turn, not side by side (they would drop each other's databases
/// and measure each other): a bench that finds the server's bench lock held says so and waits, then runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_bench_on_the_same_server_waits_for_the_first() {
    use sqlx::Connection;
    // The lock a bench holds: PostgreSQL's session-level advisory lock on the bytes "idemflow" as a bigint.
    let key = i64::from_be_bytes(*b"idemflow");
    let mut holder = sqlx::PgConnection::connect(postgres::server_url()).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)").bind(key).execute(&mut holder).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let args: Vec<String> = [
        "bench", "--records", "500", "--only", "5", "--database-url", postgres::server_url(), "--markdown",
        dir.path().join("bench.md").to_str().unwrap(), "--json", json.to_str().unwrap(),
    ]
    .map(String::from)
    .into();
    let cwd = dir.path().to_owned();
    let second = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        idemflow(&args, &cwd)
    });
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    assert!(!second.is_finished() && !json.exists(), "the second bench ran while the lock was held");
    holder.close().await.unwrap();
    let (status, out, err) = second.await.unwrap();
    assert!(status.success(), "{out}\n{err}");
    assert!(err.contains("another idemflow bench is running against this database server; waiting"), "{err}");
    assert!(json.exists());
}
