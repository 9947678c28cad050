//! The MySQL/MariaDB store against a real MariaDB (Debian's mariadb-server 10.11) and the Kafka mock cluster: the
//! core duplicate matrix, a SIGKILL crash loop, the server SIGKILLed and restarted mid-run, connections killed with
//! `KILL CONNECTION`, two workers with cross-partition duplicates, strict-mode values, `check`'s refusals, and the
//! operator commands (explain, dead letters, replay, purge, stored positions and rewind).

use crate::failures::{assert_counters_add_up, kill_repeatedly, payments, Payments};
use crate::support::mariadb::{MyDb, Server};
use crate::support::*;
use std::time::{Duration, Instant};

/// The MySQL example pipeline (examples/mysql/payments.toml).
fn example() -> String {
    std::fs::read_to_string(project_root().join("examples/mysql/payments.toml")).unwrap()
}

/// The example's tables and 100 accounts at 0, on `server` (the shared one when `None`).
pub(crate) async fn payments_db(server: Option<&str>) -> MyDb {
    let accounts: Vec<String> = (0..100).map(|i| format!("('ACC-{i}', 0)")).collect();
    let sql = std::fs::read_to_string(project_root().join("examples/mysql/payments.sql")).unwrap()
        + &format!("\nINSERT INTO accounts VALUES {};", accounts.join(", "));
    match server {
        Some(url) => MyDb::on(url, &sql).await,
        None => MyDb::new(&sql).await,
    }
}

/// The shipped MariaDB example's side effect, prepared by `store` (whose database has the example's tables, as
/// [`payments_db`] makes it): batch transactions are opened through a side effect.
pub(crate) async fn example_side_effect(store: &idemflow::store::Store) -> idemflow::store::SqlSideEffect {
    let text = std::fs::read_to_string(project_root().join("examples/mysql/payments.toml")).unwrap();
    let path = std::path::Path::new("payments.toml");
    let p = idemflow::config::pipeline::load_text_in(&text, path, idemflow::store::template::Dialect::MySql).unwrap();
    match store.prepare_side_effect(&p.sink, &p.time).await.unwrap().0 {
        idemflow::store::SideEffect::Sql(sql) => sql,
        #[allow(unreachable_patterns)]
        _ => panic!("a MariaDB side effect runs in SQL transactions"),
    }
}

/// Every operation applied once, amounts exact, every poison record dead-lettered once.
async fn assert_exactly_once(db: &MyDb, s: &Payments) {
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM payments").await, s.distinct as i64);
    assert_eq!(db.scalar::<i64>("SELECT COUNT(DISTINCT order_id) FROM payments").await, s.distinct as i64);
    let expected = s.expected_amount();
    assert_eq!(db.scalar::<String>("SELECT CAST(SUM(amount) AS CHAR) FROM payments").await, expected);
    assert_eq!(db.scalar::<String>("SELECT CAST(-SUM(balance) AS CHAR) FROM accounts").await, expected, "each deduction once");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, s.distinct as i64);
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, s.poison as i64);
}

/// Waits (at most 240 s) until every operation has its dedup row, every poison record its dead letter, and every
/// offset is committed; shows the workers' logs if not.
async fn wait_all_durable(db: &MyDb, kafka: &Kafka, partitions: i32, s: &Payments, workers: &[&BinWorker]) {
    let end = kafka.end_offsets("payments", partitions);
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let rows = sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM idemflow_dedup").fetch_one(&db.pool).await.unwrap_or(-1);
        let dead = sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM idemflow_dead_letters").fetch_one(&db.pool).await.unwrap_or(-1);
        let committed = kafka.committed("idemflow-payments", "payments", partitions);
        if rows == s.distinct as i64 && dead == s.poison as i64 && committed == end {
            return;
        }
        if Instant::now() > deadline {
            let tails: Vec<String> =
                workers.iter().map(|w| w.log_text().lines().rev().take(30).collect::<Vec<_>>().join("\n")).collect();
            panic!(
                "timed out: dedup rows {rows} of {}, dead letters {dead} of {}, committed {committed:?}, end {end:?}\n{}",
                s.distinct,
                s.poison,
                tails.join("\n=====\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The payments stream on a 3-partition topic, the example pipeline, and its settings.
async fn fixture(distinct: usize, cross_partition: bool, server: Option<&str>) -> (MyDb, Kafka, Setup, Payments) {
    let db = payments_db(server).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 3);
    let s = payments(distinct, 3, cross_partition);
    kafka.produce("payments", &s.records);
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &example())]);
    (db, kafka, setup, s)
}

#[tokio::test(flavor = "multi_thread")]
async fn core_duplicates_exactly_once_on_mariadb() {
    let (db, kafka, setup, s) = fixture(3_000, false, None).await;
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "check failed:\n{out}\n{err}");
    let w = BinWorker::start(&setup);
    wait_all_durable(&db, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&db, &s).await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    let dup = |reason| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!(dup("republished"), s.republished as f64, "{m}");
    assert_eq!(dup("payload_mismatch"), s.mismatched as f64);
    assert_eq!(dup("redelivered"), 0.0);
    assert_eq!(metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), s.poison as f64);
    // The dedup rows count the duplicates they absorbed; paid_at's offset was converted to the instant (UTC).
    let absorbed: i64 = db.scalar("SELECT CAST(SUM(duplicates) AS SIGNED) FROM idemflow_dedup").await;
    assert_eq!(absorbed, (s.republished + s.mismatched) as i64);
    let paid_at: String = db.scalar("SELECT CAST(paid_at AS CHAR) FROM payments WHERE order_id = 'ORDERID_1'").await;
    assert_eq!(paid_at, "2026-11-29 10:00:00.000000");
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_loop_sigkill_on_mariadb() {
    let (db, kafka, _, s) = fixture(40_000, false, None).await;
    let props = "\"session.timeout.ms\" = \"1500\"\n\"heartbeat.interval.ms\" = \"200\"";
    // Batches of 500, not 2,000: the stream lasts long enough for ten kills also on a quiet machine (with 2,000 a
    // worker run could finish it after nine), and kills land inside and between more transactions. 40,000 records:
    // with 24,000 a quiet machine and the worker's faster decode (issue 28) finished it after nine kills.
    let small = format!("{}\n[batch]\nmax_records = 500\n", example());
    let setup = Setup::with(&db, &kafka, &[("payments.toml", &small)], props, "");
    let kills = kill_repeatedly(&setup, &kafka, 3, 12, 50, 350).await;
    assert!(kills >= 10, "only {kills} kills before the stream ended");
    let w = BinWorker::start(&setup);
    wait_all_durable(&db, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&db, &s).await;
    eprintln!("{kills} SIGKILLs over {} records ({} operations): each operation applied once", s.records.len(), s.distinct);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_server_killed_and_restarted_mid_run() {
    let server = Server::start();
    let (db, kafka, setup, s) = fixture(6_000, false, Some(&server.url)).await;
    let w = BinWorker::start(&setup);
    let received = || metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "the worker applying", || async { received() > 0.0 }).await;
    server.kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = w.scrape();
    assert!(metric(&during, "idemflow_pipeline_up", &[("pipeline", "payments")]) == 1.0, "the pipeline must wait, not stop");
    server.start_again();
    wait_all_durable(&db, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&db, &s).await;
    let m = w.scrape();
    // A batch under way when the server died fails on its connection; one starting while it is down waits for a
    // pooled connection that cannot be opened until the pool's acquire timeout: either way it is retried.
    let retries = |cause| metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", cause)]);
    assert!(retries("connection") + retries("pool_timeout") > 0.0, "{m}");
}

/// The worker's sessions killed every 50 ms while it runs (`KILL CONNECTION`): batches hit mid-way are retried
/// (at least one over 20,000 operations), idle pooled connections are replaced, and every operation applies once.
#[tokio::test(flavor = "multi_thread")]
async fn connections_killed_mid_run() {
    let (db, kafka, setup, s) = fixture(20_000, false, None).await;
    let w = BinWorker::start(&setup);
    let database: String = db.scalar("SELECT DATABASE()").await;
    let mut killed = 0;
    // One connection of the test's own for the killing: `ID <> CONNECTION_ID()` spares only the connection asking, so
    // the pool's other connections would be killed under the test's feet.
    let mut own = db.pool.acquire().await.unwrap();
    // Killing for 20 s (every connection of the database, four times a second) covers every step of many batches;
    // the worker then finishes without kills (killing every 50 ms until the end kept it retrying for two minutes).
    let deadline = Instant::now() + Duration::from_secs(20);
    while kafka.committed("idemflow-payments", "payments", 3) != kafka.end_offsets("payments", 3) && Instant::now() < deadline {
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID()",
        )
        .bind(&database)
        .fetch_all(&mut *own)
        .await
        .unwrap();
        for id in ids {
            if sqlx::query(&format!("KILL CONNECTION {id}")).execute(&mut *own).await.is_ok() {
                killed += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(own);
    assert!(killed > 3, "killed only {killed} connections");
    wait_all_durable(&db, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&db, &s).await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    assert!(metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "connection")]) > 0.0, "{m}");
}

/// Two worker processes in one consumer group, the second joining mid-stream (a rebalance), with the same
/// operations republished to other partitions, so both can hold the same key at once.
#[tokio::test(flavor = "multi_thread")]
async fn two_workers_with_cross_partition_duplicates() {
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 6);
    let s = payments(20_000, 6, true);
    // The second half is produced once B has partitions: A alone could finish the whole stream before B joins.
    let (first, second) = s.records.split_at(s.records.len() / 2);
    kafka.produce("payments", first);
    let props = "\"session.timeout.ms\" = \"3000\"\n\"heartbeat.interval.ms\" = \"300\"";
    let setups: Vec<Setup> = (0..2).map(|_| Setup::with(&db, &kafka, &[("payments.toml", &example())], props, "")).collect();
    let received = |w: &BinWorker| metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    let assigned = |w: &BinWorker| metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "payments")]);
    let a = BinWorker::start(&setups[0]);
    wait_until(Duration::from_secs(30), "A to start", || async { received(&a) > 0.0 }).await;
    let b = BinWorker::start(&setups[1]);
    wait_until(Duration::from_secs(30), "B to be assigned partitions", || async { assigned(&b) > 0.0 }).await;
    kafka.produce("payments", second);
    let end = kafka.end_offsets("payments", 6);
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let rows = db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await;
        let dead = db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await;
        if rows == s.distinct as i64 && dead == s.poison as i64 && kafka.committed("idemflow-payments", "payments", 6) == end {
            break;
        }
        assert!(Instant::now() < deadline, "timed out: {rows} rows, {dead} dead letters\n{}\n=====\n{}", a.log_text(), b.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_exactly_once(&db, &s).await;
    let (ma, mb) = (a.scrape(), b.scrape());
    assert!(received(&a) > 0.0 && received(&b) > 0.0, "both workers consumed: {} and {}", received(&a), received(&b));
    let conflicts: f64 = [&ma, &mb].iter().map(|m| metric(m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "conflict")])).sum();
    eprintln!("two workers: {conflicts} batches retried after a deadlock or lock wait timeout");
    assert_counters_add_up(&ma);
    assert_counters_add_up(&mb);
}

/// The strict-mode and exact-value cases: table form into every kind of column.
const VALUES_TABLE: &str = "CREATE TABLE vals (
    id       VARCHAR(64)     NOT NULL PRIMARY KEY,
    exact    DECIMAL(65, 30) NULL,
    big      BIGINT          NULL,
    flag     BOOLEAN         NULL,
    at_dt    DATETIME(6)     NULL,
    at_ts    TIMESTAMP(6)    NULL,
    doc      JSON            NULL,
    label    VARCHAR(255)    NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;";

fn values_pipeline(extra: &str) -> String {
    format!(
        "topics = [\"vals\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"vals\"\ntime_zone = \"Europe/Paris\"\n{extra}\n\
         [sink.columns]\nid = \"/id\"\nexact = {{ field = \"/exact\", optional = true }}\nbig = {{ field = \"/big\", optional = true }}\n\
         flag = {{ field = \"/flag\", optional = true }}\nat_dt = {{ field = \"/at\", optional = true }}\nat_ts = {{ field = \"/at\", optional = true }}\n\
         doc = {{ field = \"/doc\", optional = true }}\nlabel = {{ field = \"/label\", optional = true }}\n"
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn strict_mode_dead_letters_what_does_not_fit_and_keeps_values_exact() {
    let db = MyDb::new(VALUES_TABLE).await;
    let kafka = Kafka::new();
    kafka.create_topic("vals", 1);
    let long = "x".repeat(300);
    let records = vec![
        Out::json(0, r#"{"id":"exact","exact":12345678901234567890.123456789012345678901234567890,"big":9007199254740993,"flag":true}"#),
        Out::json(0, r#"{"id":"zoned","at":"2026-11-30T10:00:00.123456+02:00"}"#),
        Out::json(0, r#"{"id":"naive","at":"2026-11-30 10:00:00"}"#),
        Out::json(0, r#"{"id":"json","doc":{"a":[1,2,{"b":"ü😀"}]},"label":"emoji 😀 ok"}"#),
        Out::json(0, r#"{"id":"jsonstring","doc":"just text"}"#),
        Out::json(0, r#"{"id":"abc","exact":"abc"}"#),
        Out::json(0, format!(r#"{{"id":"long","label":"{long}"}}"#)),
        Out::json(0, r#"{"id":"baddate","at":"2026-13-45T10:00:00Z"}"#),
        Out::json(0, r#"{"id":"toobig","big":99999999999999999999999}"#),
        Out::json(0, r#"{"id":"after","label":"the stream moved on"}"#),
    ];
    kafka.produce("vals", &records);
    let setup = Setup::new(&db, &kafka, &[("vals.toml", &values_pipeline(""))]);
    let w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "every record applied or dead-lettered", || async {
        db.scalar::<i64>("SELECT COUNT(*) FROM vals").await + db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await == 10
    })
    .await;
    let text = |sql: &'static str| db.scalar::<Option<String>>(sql);
    assert_eq!(
        text("SELECT CAST(exact AS CHAR) FROM vals WHERE id = 'exact'").await.unwrap(),
        "12345678901234567890.123456789012345678901234567890"
    );
    assert_eq!(text("SELECT CAST(big AS CHAR) FROM vals WHERE id = 'exact'").await.unwrap(), "9007199254740993");
    assert_eq!(text("SELECT CAST(flag AS CHAR) FROM vals WHERE id = 'exact'").await.unwrap(), "1");
    // An offset: TIMESTAMP holds the instant (08:00 UTC); DATETIME the wall-clock time in the pipeline's zone.
    assert_eq!(text("SELECT CAST(at_ts AS CHAR) FROM vals WHERE id = 'zoned'").await.unwrap(), "2026-11-30 08:00:00.123456");
    assert_eq!(text("SELECT CAST(at_dt AS CHAR) FROM vals WHERE id = 'zoned'").await.unwrap(), "2026-11-30 09:00:00.123456");
    // No offset: read in the pipeline's zone for TIMESTAMP (Paris is UTC+1 in winter), kept for DATETIME.
    assert_eq!(text("SELECT CAST(at_ts AS CHAR) FROM vals WHERE id = 'naive'").await.unwrap(), "2026-11-30 09:00:00.000000");
    assert_eq!(text("SELECT CAST(at_dt AS CHAR) FROM vals WHERE id = 'naive'").await.unwrap(), "2026-11-30 10:00:00.000000");
    assert_eq!(text("SELECT CAST(JSON_EXTRACT(doc, '$.a[2].b') AS CHAR) FROM vals WHERE id = 'json'").await.unwrap(), "\"ü😀\"");
    assert_eq!(text("SELECT CAST(label AS CHAR) FROM vals WHERE id = 'json'").await.unwrap(), "emoji 😀 ok");
    assert_eq!(text("SELECT CAST(JSON_UNQUOTE(doc) AS CHAR) FROM vals WHERE id = 'jsonstring'").await.unwrap(), "just text");
    assert_eq!(text("SELECT CAST(label AS CHAR) FROM vals WHERE id = 'after'").await.unwrap(), "the stream moved on");
    // What does not fit is a dead letter with the server's reason, never a silent 0, truncation or zero date.
    let reason = |id: &'static str| {
        let db = &db;
        async move {
            sqlx::query_scalar::<_, String>("SELECT CAST(error AS CHAR) FROM idemflow_dead_letters WHERE CAST(payload AS CHAR) LIKE ?")
                .bind(format!("%\"id\":\"{id}\"%"))
                .fetch_one(&db.pool)
                .await
                .unwrap_or_else(|e| panic!("no dead letter for {id}: {e}"))
        }
    };
    assert!(reason("abc").await.contains("MySQL error 1366"), "{}", reason("abc").await);
    assert!(reason("long").await.contains("MySQL error 1406"), "{}", reason("long").await);
    assert!(reason("toobig").await.contains("MySQL error 1264"), "{}", reason("toobig").await);
    assert!(reason("baddate").await.contains("not a timestamp"), "{}", reason("baddate").await);
    for id in ["abc", "long", "toobig", "baddate"] {
        let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM vals WHERE id = ?").bind(id).fetch_one(&db.pool).await.unwrap();
        assert_eq!(stored, 0, "{id} must not be stored");
    }
    drop(w);
}

#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_utf8mb3_columns_and_names_missing_tables_and_columns() {
    let db = MyDb::new(
        "CREATE TABLE legacy (id VARCHAR(64) PRIMARY KEY, note VARCHAR(255) CHARACTER SET utf8mb3) ENGINE = InnoDB;",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let pipeline = |table: &str, column: &str| {
        format!("topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"{table}\"\n[sink.columns]\nid = \"/id\"\n{column} = \"/note\"\n")
    };
    let check = |setup: &Setup| idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    let setup = Setup::new(&db, &kafka, &[("legacy.toml", &pipeline("legacy", "note"))]);
    let (status, out, err) = check(&setup);
    assert!(!status.success(), "{out}");
    assert!(err.contains("sink.columns.note") && err.contains("utf8mb3") && err.contains("utf8mb4"), "{err}");
    let setup = Setup::new(&db, &kafka, &[("legacy.toml", &pipeline("nowhere", "note"))]);
    let (_, _, err) = check(&setup);
    assert!(err.contains("sink.table") && err.contains("does not exist"), "{err}");
    let setup = Setup::new(&db, &kafka, &[("legacy.toml", &pipeline("legacy", "nope"))]);
    let (_, _, err) = check(&setup);
    assert!(err.contains("sink.columns.nope") && err.contains("has no column"), "{err}");
    let sql = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"INSERT INTO nowhere (id) VALUES (:id)\"\n[sink.params]\nid = \"/id\"\n";
    let setup = Setup::new(&db, &kafka, &[("legacy.toml", sql)]);
    let (_, _, err) = check(&setup);
    assert!(err.contains("sink.sql") && err.contains("1146"), "{err}");
}

/// `check` tries each value fed by record metadata as a batch binds it, under the session's strict mode: what a
/// column or a typed parameter cannot take is refused, naming it, its type and the metadata (every record would be
/// dead-lettered at run time); what fits passes (a timestamp into DATETIME, rendered as its wall clock).
#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_metadata_a_column_or_typed_parameter_cannot_take_on_mariadb() {
    let db = MyDb::new(
        "CREATE TABLE audit (id VARCHAR(64) PRIMARY KEY, seen INT, source BIGINT, at DATETIME(3), stamp TIMESTAMP(3) NULL, \
         part INT, pos BIGINT, name VARCHAR(255)) ENGINE = InnoDB;",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let check = |pipeline: &str| {
        let setup = Setup::new(&db, &kafka, &[("audit.toml", pipeline)]);
        let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
        (status.success(), format!("{out}{err}"))
    };
    let table = |columns: &str| format!("topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"audit\"\n[sink.columns]\nid = \"/id\"\n{columns}");
    let (ok, out) = check(&table("seen = { meta = \"timestamp\" }\nsource = { meta = \"topic\" }\n"));
    assert!(!ok, "{out}");
    assert!(out.contains("sink.columns.seen: column \"seen\" is int(11): meta = \"timestamp\" gives the record's timestamp"), "{out}");
    assert!(out.contains("sink.columns.source: column \"source\" is bigint(20): meta = \"topic\""), "{out}");
    let (ok, out) = check(&table(
        "at = { meta = \"timestamp\" }\nstamp = { meta = \"timestamp\" }\npart = { meta = \"partition\" }\npos = { meta = \"offset\" }\nname = { meta = \"topic\" }\n",
    ));
    assert!(ok, "{out}");
    // The SQL form: a parameter with a type is cast as the type says; one without is text the statement converts.
    let sql = |seen: &str| {
        format!(
            "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"INSERT INTO audit (id, seen) VALUES (:id, :seen)\"\n\
             [sink.params]\nid = \"/id\"\nseen = {seen}\n"
        )
    };
    let (ok, out) = check(&sql("{ meta = \"topic\", type = \"integer\" }"));
    assert!(!ok && out.contains("sink.params.seen: parameter :seen is BIGINT: meta = \"topic\""), "{out}");
    let (ok, out) = check(&sql("{ meta = \"topic\", type = \"datetime\" }"));
    assert!(!ok && out.contains("sink.params.seen: parameter :seen is DATETIME(6): meta = \"topic\""), "{out}");
    let (ok, out) = check(&sql("{ meta = \"offset\", type = \"integer\" }"));
    assert!(ok, "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_explain_dead_letters_replay_and_purge_on_mariadb() {
    // A fresh database without idemflow's tables: `check` says to migrate, `migrate` creates them.
    let base = crate::support::mariadb::server_url();
    let db = MyDb::new("CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, amount DECIMAL(12, 2) NOT NULL) ENGINE = InnoDB;").await;
    db.exec("DROP TABLE idemflow_dedup, idemflow_dead_letters, idemflow_offsets, idemflow_processed, idemflow_attempts, idemflow_retention_sweeps, idemflow_outbox, _sqlx_migrations").await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let pipeline = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"orders\"\n[sink.columns]\nid = \"/id\"\namount = \"/amount\"\n\
                    [dedup]\nretention = \"1s\"\npurge_interval = \"1h\"\n";
    let setup = Setup::new(&db, &kafka, &[("orders.toml", pipeline)]);
    let run = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", setup.config.to_str().unwrap()]);
        idemflow(&all, setup.dir.path())
    };
    let (status, _, err) = run(&["check"]);
    assert!(!status.success() && err.contains("idemflow migrate"), "{err}");
    let (status, out, err) = run(&["migrate"]);
    assert!(status.success() && out.contains("version 7"), "{out}{err}");
    let (status, out, err) = run(&["check"]);
    assert!(status.success(), "{out}{err}");
    kafka.produce("orders", &[Out::json(0, r#"{"id":"o-1","amount":"12.50"}"#), Out::json(0, r#"{"id":"o-2","amount":"abc"}"#)]);
    kafka.produce("orders", &[Out::json(0, r#"{"id":"o-1","amount":"12.50"}"#)]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "o-1 applied and o-2 dead-lettered", || async {
        db.scalar::<i64>("SELECT COUNT(*) FROM orders").await == 1 && db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await == 1
    })
    .await;
    wait_until(Duration::from_secs(30), "the duplicate counted", || async {
        metric(&w.scrape(), "idemflow_duplicates_skipped_total", &[("pipeline", "orders"), ("reason", "republished")]) == 1.0
    })
    .await;
    w.sigterm();
    let (status, out, err) = run(&["explain", "--pipeline", "orders", "--key", "o-1"]);
    assert!(status.success() && out.contains("orders/0@0") && out.contains("duplicates skipped 1"), "{out}{err}");
    let (status, out, _) = run(&["dead-letters", "list"]);
    assert!(status.success() && out.contains("side_effect_rejected") && out.contains("1366"), "{out}");
    let id: i64 = db.scalar("SELECT id FROM idemflow_dead_letters").await;
    let (status, out, _) = run(&["dead-letters", "show", &id.to_string()]);
    assert!(status.success() && out.contains("\"amount\":\"abc\""), "{out}");
    let fixed = setup.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"id":"o-2","amount":"7.25"}"#).unwrap();
    let (status, out, err) = run(&["dead-letters", "replay", &id.to_string(), "--payload", fixed.to_str().unwrap()]);
    assert!(status.success() && out.contains("applied"), "{out}{err}");
    assert_eq!(db.scalar::<String>("SELECT CAST(amount AS CHAR) FROM orders WHERE id = 'o-2'").await, "7.25");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, 0);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, out, err) = run(&["purge"]);
    assert!(status.success() && out.contains("purged 2 dedup rows"), "{out}{err}");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, 0);
    let _ = base;
}

#[tokio::test(flavor = "multi_thread")]
async fn stored_positions_fenced_and_rewound_on_mariadb() {
    let (db, kafka, _, s) = fixture(2_000, false, None).await;
    let stored = example() + "\n[offsets]\nstore = \"database\"\n";
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &stored)]);
    let mut w = BinWorker::start(&setup);
    wait_all_durable(&db, &kafka, 3, &s, &[&w]).await;
    w.sigterm();
    let stored_total: i64 = db.scalar("SELECT CAST(SUM(next_offset) AS SIGNED) FROM idemflow_offsets WHERE pipeline = 'payments'").await;
    assert_eq!(stored_total, kafka.end_offsets("payments", 3).iter().sum::<i64>());
    assert_exactly_once(&db, &s).await;
    // Rewind to the start: everything is consumed again and skipped as redelivered.
    let (status, out, err) =
        idemflow(&["rewind", "--config", setup.config.to_str().unwrap(), "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let epochs: i64 = db.scalar("SELECT CAST(MIN(owner_epoch) AS SIGNED) FROM idemflow_offsets").await;
    assert!(epochs >= 2, "rewind fences the previous owner");
    let w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(120), "the replay skipped as redelivered", || async {
        metric(&w.scrape(), "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "redelivered")])
            >= (s.records.len() - s.poison) as f64
    })
    .await;
    assert_exactly_once(&db, &s).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mysqls_claim_without_returning_tells_new_keys_from_old() {
    use idemflow::store::mysql::{ClaimForm, MySqlStore};
    let db = payments_db(None).await;
    let store = idemflow::store::Store::MySql(MySqlStore::with_claim_form(db.pool.clone(), ClaimForm::Token));
    let effect = example_side_effect(&store).await;
    let keys: Vec<idemflow::key::BusinessKey> = (0..5).map(|i| idemflow::key::BusinessKey::new(format!("k-{i}"))).collect();
    let position = idemflow::record::Position { topic: "t".into(), partition: 0, offset: 1 };
    fn claims<'a>(
        ks: &'a [idemflow::key::BusinessKey],
        position: &'a idemflow::record::Position,
    ) -> Vec<idemflow::store::rows::Claim<'a>> {
        ks.iter().map(|k| idemflow::store::rows::Claim { key: k, position, fingerprint: &[7; 32] }).collect()
    }
    let mut tx = effect.begin().await.unwrap();
    assert_eq!(tx.claim("p", &claims(&keys[..3], &position)).await.unwrap().len(), 3);
    tx.commit().await.unwrap();
    let mut tx = effect.begin().await.unwrap();
    let new = tx.claim("p", &claims(&keys, &position)).await.unwrap();
    assert_eq!(new.len(), 2, "only k-3 and k-4 are new");
    assert!(new.contains(&keys[3].digest) && new.contains(&keys[4].digest));
    tx.rollback().await.unwrap();
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, 3);
}

/// The shared cases (`../shared/cases/`) that concern the store, on MariaDB: pipeline `payments`, topic `orders`,
/// key `/order/id`, one row per order in `payments`.
mod cases {
    use super::*;

    const TABLE: &str = "CREATE TABLE payments (order_id LONGTEXT NOT NULL, amount DECIMAL(20, 4), paid_at TIMESTAMP(6) NULL, \
                         currency VARCHAR(8)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;";
    const INSERT: &str = r#""INSERT INTO payments (order_id, amount, paid_at) VALUES (:order_id, :amount, :paid_at)""#;

    fn pipeline(extra_top: &str, sql: &str) -> String {
        format!(
            "topics = [\"orders\"]\n{extra_top}\n[key]\nfield = \"/order/id\"\n[sink]\nsql = [{sql}]\n[sink.params]\n\
             order_id = \"/order/id\"\namount = {{ field = \"/order/amount\", optional = true }}\n\
             paid_at = {{ field = \"/paid_at\", optional = true, type = \"timestamp\" }}\n"
        )
    }

    fn order(id: &str, amount: &str) -> String {
        format!(r#"{{"order":{{"id":"{id}","amount":"{amount}"}}}}"#)
    }

    async fn fixture(table: &str, partitions: i32, pipelines: &[(&str, &str)], server: Option<&str>) -> (MyDb, Kafka, Setup) {
        let db = match server {
            Some(url) => MyDb::on(url, table).await,
            None => MyDb::new(table).await,
        };
        let kafka = Kafka::new();
        kafka.create_topic("orders", partitions);
        let setup = Setup::new(&db, &kafka, pipelines);
        (db, kafka, setup)
    }

    async fn rows(db: &MyDb) -> (i64, i64) {
        (db.scalar("SELECT COUNT(*) FROM payments").await, db.scalar("SELECT COUNT(DISTINCT order_id) FROM payments").await)
    }

    async fn ids(db: &MyDb) -> String {
        db.scalar::<Option<String>>("SELECT CAST(GROUP_CONCAT(order_id ORDER BY order_id) AS CHAR) FROM payments").await.unwrap_or_default()
    }

    fn dead(w: &InProc, reason: &str) -> f64 {
        w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", reason)])
    }

    /// c06: the claim is made, then the side effect blocks on a locked table and its connection is killed: the
    /// batch is retried, o-9 applied once, nothing dead-lettered.
    #[tokio::test(flavor = "multi_thread")]
    async fn case_c06_side_effect_fails_after_claim() {
        let (db, kafka, setup) = fixture(TABLE, 1, &[("payments.toml", &pipeline("", INSERT))], None).await;
        let w = InProc::start(&setup).await;
        let mut lock = db.pool.acquire().await.unwrap();
        sqlx::query("LOCK TABLES payments WRITE").execute(&mut *lock).await.unwrap();
        kafka.produce("orders", &[Out::json(0, order("o-9", "9"))]);
        let database: String = db.scalar("SELECT DATABASE()").await;
        let blocked = || {
            sqlx::query_scalar::<_, i64>(
                "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST WHERE DB = ? AND STATE LIKE '%lock%' AND INFO LIKE 'INSERT INTO payments%'",
            )
            .bind(&database)
            .fetch_optional(&db.pool)
        };
        wait_until(Duration::from_secs(30), "the worker to block on the lock", || async { blocked().await.unwrap().is_some() }).await;
        let id = blocked().await.unwrap().unwrap();
        sqlx::query(&format!("KILL CONNECTION {id}")).execute(&db.pool).await.unwrap();
        sqlx::query("UNLOCK TABLES").execute(&mut *lock).await.unwrap();
        w.wait_received("payments", 1).await;
        assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
        assert!(w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "connection")]) >= 1.0);
        assert!(w.stop().await.is_empty());
        assert_eq!(rows(&db).await, (1, 1));
        assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, 0);
    }

    /// c09: keys of 300 and 5,000 characters, each twice, then o-1: each deduplicated exactly (the dedup key is the
    /// key's digest; InnoDB's 3072-byte index limit does not apply).
    #[tokio::test(flavor = "multi_thread")]
    async fn case_c09_long_keys() {
        let (db, kafka, setup) = fixture(TABLE, 1, &[("payments.toml", &pipeline("", INSERT))], None).await;
        let keys = [random_text(300, 7), random_text(5000, 8), "a".repeat(5000)];
        let mut records: Vec<Out> = keys.iter().map(|k| Out::json(0, order(k, "1"))).collect();
        records.extend(records.clone());
        records.push(Out::json(0, order("o-1", "1")));
        kafka.produce("orders", &records);
        let w = InProc::start(&setup).await;
        w.wait_received("payments", 7).await;
        assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 4.0);
        assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "republished")]), 3.0);
        assert!(w.stop().await.is_empty());
        assert_eq!(rows(&db).await, (4, 4));
        assert_eq!(db.scalar::<i64>("SELECT MAX(CHAR_LENGTH(business_key)) FROM idemflow_dedup").await, 5000);
    }

    /// c10, c11, c14, c16: U+0000 in a key (refused for every store, one rule), invalid UTF-8, missing, null and
    /// empty keys, a 200-level-deep document, an oversized payload, a tombstone and an empty value: each a dead
    /// letter or a skip with its reason, the good records applied, the offset past all of them.
    #[tokio::test(flavor = "multi_thread")]
    async fn cases_c10_c11_c14_c16_bad_records_move_on() {
        let (db, kafka, setup) = fixture(TABLE, 1, &[("payments.toml", &pipeline("max_payload_bytes = 1048576", INSERT))], None).await;
        let deep = format!(r#"{{"order":{{"id":"o-1","amount":"1","meta":{}1{}}}}}"#, "[".repeat(200), "]".repeat(200));
        let huge = format!("{}{}", "[".repeat(700_000), "]".repeat(700_000));
        let records = vec![
            Out::json(0, r#"{"order":{"id":"A\u0000B","amount":"1"}}"#),
            Out::json(0, r#"{"order":{"id":"o-2","note":"\ud800","amount":"2"}}"#),
            Out::json(0, r#"{"order":{}}"#),
            Out::json(0, r#"{"order":{"id":null}}"#),
            Out::json(0, r#"{"order":{"id":""}}"#),
            Out::json(0, deep),
            Out::json(0, huge),
            Out { partition: 0, key: Some(b"o-1".to_vec()), ..Out::default() },
            Out { partition: 0, key: Some(b"o-1".to_vec()), value: Some(Vec::new()), ..Out::default() },
            Out::json(0, order("o-3", "3")),
        ];
        kafka.produce("orders", &records);
        let w = InProc::start(&setup).await;
        w.wait_received("payments", 10).await;
        assert_eq!(dead(&w, "key_invalid"), 1.0);
        assert_eq!(dead(&w, "key_missing"), 3.0);
        assert_eq!(dead(&w, "decode_failed"), 3.0); // bad unicode, too deep, empty value
        assert_eq!(dead(&w, "payload_too_large"), 1.0);
        assert_eq!(w.metric("idemflow_tombstones_skipped_total", &[("pipeline", "payments")]), 1.0);
        assert!(w.stop().await.is_empty());
        assert_eq!(ids(&db).await, "o-3");
        assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, 8);
        assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, 1);
        assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![10]);
    }

    /// c17: the payload shape drifts: a missing optional value binds its default, a missing required one is
    /// dead-lettered naming the field, a value MySQL cannot convert is dead-lettered with its error number.
    #[tokio::test(flavor = "multi_thread")]
    async fn case_c17_schema_drift() {
        let p = "topics = [\"orders\"]\n[key]\nfield = \"/order/id\"\n[sink]\n\
                 sql = \"INSERT INTO payments (order_id, amount, currency) VALUES (:order_id, :amount, :currency)\"\n[sink.params]\n\
                 order_id = \"/order/id\"\namount = \"/order/amount\"\ncurrency = { field = \"/order/currency\", default = \"EUR\" }\n";
        let (db, kafka, setup) = fixture(TABLE, 1, &[("payments.toml", p)], None).await;
        kafka.produce(
            "orders",
            &[
                Out::json(0, r#"{"order":{"id":"old","amount":"1.00"}}"#),
                Out::json(0, r#"{"order":{"id":"new","amount":{"value":"5.00","unit":"EUR"}}}"#),
                Out::json(0, r#"{"order":{"id":"none"}}"#),
                Out::json(0, r#"{"order":{"id":"later","amount":"2.00","currency":"USD"}}"#),
            ],
        );
        let w = InProc::start(&setup).await;
        w.wait_received("payments", 4).await;
        assert!(w.stop().await.is_empty());
        let applied: String =
            db.scalar("SELECT CAST(GROUP_CONCAT(CONCAT(order_id, '=', currency) ORDER BY order_id) AS CHAR) FROM payments").await;
        assert_eq!(applied, "later=USD,old=EUR");
        let e: String = db.scalar("SELECT CAST(error AS CHAR) FROM idemflow_dead_letters WHERE reason = 'side_effect_rejected'").await;
        assert!(e.contains("MySQL error 1366"), "{e}");
        let e: String = db.scalar("SELECT CAST(error AS CHAR) FROM idemflow_dead_letters WHERE reason = 'param_missing'").await;
        assert!(e.contains("/order/amount"), "{e}");
    }

    /// c18: a poison pill is dead-lettered and the partition moves on; while MariaDB is down nothing is
    /// dead-lettered, the worker retries, and applies the record once the server is back.
    #[tokio::test(flavor = "multi_thread")]
    async fn case_c18_poison_pill_and_an_outage() {
        let server = Server::start();
        let (db, kafka, setup) = fixture(TABLE, 1, &[("payments.toml", &pipeline("", INSERT))], Some(&server.url)).await;
        kafka.produce("orders", &[Out::json(0, "not json"), Out::json(0, order("o-2", "2"))]);
        let w = InProc::start(&setup).await;
        w.wait_received("payments", 2).await;
        assert_eq!(dead(&w, "decode_failed"), 1.0);
        assert_eq!(kafka.committed("idemflow-payments", "orders", 1), vec![2]);
        server.kill();
        kafka.produce("orders", &[Out::json(0, order("o-3", "3"))]);
        wait_until(Duration::from_secs(30), "retries while MariaDB is down", || async {
            ["connection", "pool_timeout", "unavailable"]
                .iter()
                .map(|c| w.metric("idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", c)]))
                .sum::<f64>()
                >= 2.0
        })
        .await;
        assert_eq!(w.metric("idemflow_records_received_total", &[("pipeline", "payments")]), 2.0);
        server.start_again();
        w.wait_received("payments", 3).await;
        assert!(w.stop().await.is_empty());
        let db = MyDb { pool: sqlx::MySqlPool::connect(&db.url).await.unwrap(), url: db.url.clone() };
        assert_eq!(ids(&db).await, "o-2,o-3");
        assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, 1);
    }

    /// c21: a pool of one connection with 8 partitions and two pipelines competing for it: no deadlock, every
    /// record applied once.
    #[tokio::test(flavor = "multi_thread")]
    async fn case_c21_small_connection_pool() {
        let both = format!("{TABLE} CREATE TABLE payments_b LIKE payments;");
        let b = pipeline("", &INSERT.replace("INTO payments", "INTO payments_b"));
        let (db, kafka, setup) = fixture(&both, 8, &[("payments.toml", &pipeline("", INSERT)), ("b.toml", &b)], None).await;
        let text = std::fs::read_to_string(&setup.config).unwrap().replace("max_connections = 4", "max_connections = 1");
        std::fs::write(&setup.config, text).unwrap();
        let records: Vec<Out> = (0..2000).map(|i| Out::json(i % 8, order(&format!("o-{i}"), "1"))).collect();
        kafka.produce("orders", &records);
        let w = InProc::start(&setup).await;
        w.wait_received("payments", 2000).await;
        w.wait_received("b", 2000).await;
        assert!(w.stop().await.is_empty());
        assert_eq!(rows(&db).await, (2000, 2000));
        assert_eq!(db.scalar::<i64>("SELECT COUNT(DISTINCT order_id) FROM payments_b").await, 2000);
    }
}

/// The table form's `on_conflict` on MySQL: `error` dead-letters a business row that exists (1062), `nothing`
/// skips it, `update` overwrites the columns outside the key; a batch larger than one statement's placeholders is
/// split and applied whole.
#[tokio::test(flavor = "multi_thread")]
async fn table_form_on_conflict_and_large_batches() {
    let table = "CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, amount DECIMAL(12, 2) NOT NULL, note VARCHAR(64) NULL) ENGINE = InnoDB;\
                 INSERT INTO orders VALUES ('taken', 1.00, 'before');";
    for (mode, expect_amount, expect_note, dead) in [("error", "1.00", "before", 1), ("nothing", "1.00", "before", 0), ("update", "9.00", "after", 0)] {
        let db = MyDb::new(table).await;
        let kafka = Kafka::new();
        kafka.create_topic("orders", 1);
        let pipeline = format!(
            "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"orders\"\non_conflict = \"{mode}\"\n\
             [sink.columns]\nid = \"/id\"\namount = \"/amount\"\nnote = {{ field = \"/note\", optional = true }}\n[batch]\nmax_records = 20000\nmax_wait = \"500ms\"\n"
        );
        let setup = Setup::new(&db, &kafka, &[("orders.toml", &pipeline)]);
        let mut records = vec![Out::json(0, r#"{"id":"taken","amount":"9.00","note":"after"}"#)];
        records.extend((0..20_000).map(|i| Out::json(0, format!(r#"{{"id":"o-{i}","amount":"{}.{:02}","note":"n{i}"}}"#, i % 500, i % 100))));
        kafka.produce("orders", &records);
        let w = InProc::start(&setup).await;
        w.wait_received("orders", 20_001).await;
        assert!(w.stop().await.is_empty());
        assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM orders").await, 20_001, "{mode}");
        assert_eq!(db.scalar::<String>("SELECT CAST(amount AS CHAR) FROM orders WHERE id = 'taken'").await, expect_amount, "{mode}");
        assert_eq!(db.scalar::<String>("SELECT CAST(note AS CHAR) FROM orders WHERE id = 'taken'").await, expect_note, "{mode}");
        assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, dead, "{mode}");
        if dead == 1 {
            let e: String = db.scalar("SELECT CAST(error AS CHAR) FROM idemflow_dead_letters").await;
            assert!(e.contains("MySQL error 1062"), "{e}");
        }
        let expected: i64 = (0..20_000i64).map(|i| (i % 500) * 100 + i % 100).sum();
        let sum: String = db.scalar("SELECT CAST(SUM(amount * 100) AS CHAR) FROM orders WHERE id <> 'taken'").await;
        assert_eq!(sum, format!("{expected}.00"), "{mode}");
    }
}

/// MySQL's claim (no `RETURNING`: a claim token), end to end on MariaDB: the payments stream with every kind of
/// duplicate, and a crash after a database commit before the offset commit, through a worker whose store is forced
/// to the token form.
#[tokio::test(flavor = "multi_thread")]
async fn the_token_claim_end_to_end_with_a_crash() {
    use idemflow::store::mysql::{ClaimForm, MySqlStore};
    let (db, kafka, setup, s) = fixture(3_000, true, None).await;
    let settings = idemflow::config::load_settings_from(&setup.config, []).unwrap().settings;
    let token = || idemflow::store::Store::MySql(MySqlStore::with_claim_form(idemflow::store::mysql::pool(settings.database.as_ref().unwrap()).unwrap(), ClaimForm::Token));
    let crashed = InProc::start_on(&setup, token(), idemflow::worker::Faults { crash_after_commits: Some(2), ..Default::default() }).await;
    assert!(crashed.stop_when_pipelines_end().await.is_empty());
    let w = InProc::start_on(&setup, token(), idemflow::worker::Faults::default()).await;
    let end = kafka.end_offsets("payments", 3);
    wait_until(Duration::from_secs(120), "every record durable", || async {
        db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await == s.distinct as i64
            && kafka.committed("idemflow-payments", "payments", 3) == end
    })
    .await;
    let dup = |reason| w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    // A duplicate that was in the batch committed before the crash comes back at a position already processed:
    // counted as redelivered then, not under its first reason.
    assert!(dup("redelivered") > 0.0, "the crash redelivers a committed batch");
    assert!(dup("republished") <= s.republished as f64 && dup("payload_mismatch") <= s.mismatched as f64);
    assert_counters_add_up(&String::from_utf8(w.metrics.render()).unwrap());
    assert!(w.stop().await.is_empty());
    assert_exactly_once(&db, &s).await;
    let tokens: i64 = db.scalar("SELECT COUNT(DISTINCT claim_token) FROM idemflow_dedup").await;
    assert!(tokens > 1, "rows were claimed by the token form");
}

/// Fencing on MariaDB: a worker that lost a partition can neither overwrite the new owner's position nor move it
/// backwards, and the new owner's claim waits for the old owner's batch in flight.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_that_lost_its_partition_is_fenced() {
    let db = payments_db(None).await;
    let store = idemflow::store::Store::MySql(idemflow::store::mysql::MySqlStore::new(db.pool.clone()));
    let effect = example_side_effect(&store).await;
    let p0 = [("payments".to_owned(), 0)];
    let a = store.claim_offsets("payments", "worker-a", &p0).await.unwrap();
    assert_eq!((a[0].next_offset, a[0].epoch), (None, 1));
    let positions = |next: i64, epoch: i64| idemflow::offsets::Positions(vec![("payments".into(), 0, next, epoch)]);
    let mut tx = effect.begin().await.unwrap();
    assert!(tx.advance_offsets("payments", &positions(100, 1)).await.unwrap().is_empty());
    let claim_b = tokio::spawn({
        let store = store.clone();
        let p0 = p0.clone();
        async move { store.claim_offsets("payments", "worker-b", &p0).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!claim_b.is_finished(), "B's claim waits for A's batch in flight");
    tx.commit().await.unwrap();
    let b = claim_b.await.unwrap();
    assert_eq!((b[0].next_offset, b[0].epoch), (Some(100), 2), "B starts right after A's committed batch");
    let mut tx = effect.begin().await.unwrap();
    assert_eq!(tx.advance_offsets("payments", &positions(150, 1)).await.unwrap(), vec![("payments".to_owned(), 0)]);
    tx.rollback().await.unwrap();
    let mut tx = effect.begin().await.unwrap();
    assert!(tx.advance_offsets("payments", &positions(130, 2)).await.unwrap().is_empty());
    tx.commit().await.unwrap();
    assert_eq!(db.scalar::<i64>("SELECT next_offset FROM idemflow_offsets").await, 130);
    assert_eq!(db.scalar::<String>("SELECT CAST(owner AS CHAR) FROM idemflow_offsets").await, "worker-b");
}

/// A column's type changed while the pipeline runs (`DATETIME` to `TIMESTAMP`): the batch after the change is
/// rebuilt from the new schema before anything is written, so the new column gets the instant, not the old
/// rendering.
#[tokio::test(flavor = "multi_thread")]
async fn a_column_type_changed_while_running_rebuilds_the_statement() {
    let db = MyDb::new("CREATE TABLE evs (id VARCHAR(64) PRIMARY KEY, at DATETIME(6) NOT NULL) ENGINE = InnoDB;").await;
    let kafka = Kafka::new();
    kafka.create_topic("evs", 1);
    let pipeline = "topics = [\"evs\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"evs\"\ntime_zone = \"Europe/Paris\"\n\
                    [sink.columns]\nid = \"/id\"\nat = \"/at\"\n";
    let setup = Setup::new(&db, &kafka, &[("evs.toml", pipeline)]);
    let w = InProc::start(&setup).await;
    kafka.produce("evs", &[Out::json(0, r#"{"id":"before","at":"2026-11-30T10:00:00Z"}"#)]);
    w.wait_received("evs", 1).await;
    db.exec("ALTER TABLE evs MODIFY at TIMESTAMP(6) NOT NULL").await;
    kafka.produce("evs", &[Out::json(0, r#"{"id":"after","at":"2026-11-30T10:00:00Z"}"#)]);
    w.wait_received("evs", 2).await;
    assert!(w.stop().await.is_empty());
    // DATETIME held Paris wall-clock time (11:00), kept by the ALTER as it was; TIMESTAMP holds the instant (10:00
    // UTC, shown in the session's UTC).
    assert_eq!(db.scalar::<String>("SELECT CAST(at AS CHAR) FROM evs WHERE id = 'before'").await, "2026-11-30 11:00:00.000000");
    assert_eq!(db.scalar::<String>("SELECT CAST(at AS CHAR) FROM evs WHERE id = 'after'").await, "2026-11-30 10:00:00.000000");
}

/// The SQL form's `type = "decimal"` keeps arithmetic exact (MySQL computes `balance - '0.01'` as a DOUBLE), and
/// `check` refuses what cannot run in the batch transaction: `IGNORE`, an implicit commit, `on_conflict` on a table
/// with several unique keys, a BIT column.
#[tokio::test(flavor = "multi_thread")]
async fn declared_decimals_are_exact_and_unsafe_statements_are_refused() {
    let db = MyDb::new(
        "CREATE TABLE acc (id VARCHAR(8) PRIMARY KEY, balance DECIMAL(30, 2) NOT NULL) ENGINE = InnoDB;\
         INSERT INTO acc VALUES ('a', 1000000000000000000.00);\
         CREATE TABLE two (id VARCHAR(8) PRIMARY KEY, code VARCHAR(8) NOT NULL UNIQUE, flags BIT(8) NULL) ENGINE = InnoDB;",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let sql = |statement: &str, amount: &str| {
        format!("topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"{statement}\"\n[sink.params]\namount = {amount}\n")
    };
    let exact = sql("UPDATE acc SET balance = balance - :amount WHERE id = 'a'", "{ field = \"/amount\", type = \"decimal\" }");
    let setup = Setup::new(&db, &kafka, &[("t.toml", &exact)]);
    kafka.produce("t", &[Out::json(0, r#"{"id":"x1","amount":"0.01"}"#), Out::json(0, r#"{"id":"x2","amount":"abc"}"#)]);
    let w = InProc::start(&setup).await;
    w.wait_received("t", 2).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT CAST(balance AS CHAR) FROM acc").await, "999999999999999999.99");
    let e: String = db.scalar("SELECT CAST(error AS CHAR) FROM idemflow_dead_letters").await;
    assert!(e.contains("MySQL error 1292"), "{e}");

    let check = |pipeline: &str| {
        let setup = Setup::new(&db, &kafka, &[("t.toml", pipeline)]);
        let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
        assert!(!status.success(), "{out}");
        err
    };
    let err = check(&sql("INSERT IGNORE INTO acc VALUES (:amount, 0)", "\"/amount\""));
    assert!(err.contains("sink.sql") && err.contains("IGNORE"), "{err}");
    let err = check(&sql("TRUNCATE acc", "\"/amount\"").replace("[sink.params]\namount = \"/amount\"\n", ""));
    assert!(err.contains("sink.sql") && err.contains("TRUNCATE"), "{err}");
    let table = |extra: &str, columns: &str| {
        format!("topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"two\"\n{extra}\n[sink.columns]\nid = \"/id\"\n{columns}")
    };
    let err = check(&table("on_conflict = \"update\"", "code = \"/code\"\n"));
    assert!(err.contains("sink.on_conflict") && err.contains("2 unique keys"), "{err}");
    let err = check(&table("", "code = \"/code\"\nflags = \"/flags\"\n"));
    assert!(err.contains("sink.columns.flags") && err.contains("BIT"), "{err}");
}

/// Retention on MariaDB: the sweep walks the pipeline's primary key in slices, each committed with its cursor (the
/// last key id swept), resumes there, skips at once while another replica holds the pipeline's cursor, and ends its
/// pass at the last key, having deleted the expired rows and kept the fresh one.
#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_walks_the_primary_key_in_slices_one_replica_at_a_time() {
    use idemflow::retention::{Pace, Skipped};
    let db = MyDb::new("").await;
    let rows: Vec<String> = (0..7)
        .map(|i| format!("('p', 'k{i}', 'k{i}', 't', 0, {i}, UNHEX(SHA2('{i}', 256)), NOW(6) - INTERVAL 8 DAY)"))
        .collect();
    db.exec(&format!(
        "INSERT INTO idemflow_dedup (pipeline, key_id, business_key, topic, `partition`, `offset`, fingerprint, applied_at) VALUES {}, \
         ('p', 'k3a', 'k3a', 't', 0, 9, UNHEX(SHA2('9', 256)), NOW(6)), ('q', 'k0', 'k0', 't', 0, 9, UNHEX(SHA2('9', 256)), NOW(6) - INTERVAL 8 DAY)",
        rows.join(", ")
    ))
    .await;
    let store = idemflow::store::Store::MySql(idemflow::store::mysql::MySqlStore::new(db.pool.clone()));
    let sweep = |owner, interval| idemflow::retention::Sweep {
        pipeline: "p",
        owner,
        retention: Duration::from_secs(7 * 24 * 3600),
        rows: 3,
        interval,
        pace: Pace::RowsPerSecond(1_000_000),
    };
    let (a, b) = (sweep("replica-a", Duration::ZERO), sweep("replica-b", Duration::ZERO));
    let pool = &db.pool;
    let slice = |s| async move { idemflow::store::mysql::retention::sweep_slice(pool, &s, false).await };
    let first = slice(a).await.unwrap();
    assert_eq!((first.examined, first.purged, first.pass_seconds), (3, 3, None), "k0, k1, k2");
    let cursor = || db.scalar::<String>("SELECT CAST(swept_to AS CHAR) FROM idemflow_retention_sweeps WHERE pipeline = 'p'");
    assert_eq!(cursor().await, "k2");
    // Another replica, while replica-a's lease on the pass holds: it leaves the pass alone.
    assert_eq!(slice(b).await.unwrap().skipped, Some(Skipped::OtherReplica));
    assert_eq!(cursor().await, "k2");

    // Another replica's slice holds the cursor at this moment: this one skips at once.
    let mut other = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idemflow_retention_sweeps WHERE pipeline = 'p' FOR UPDATE").execute(&mut *other).await.unwrap();
    let started = std::time::Instant::now();
    let skipped = slice(a).await.unwrap();
    assert!(skipped.skipped == Some(Skipped::OtherReplica) && skipped.examined == 0, "{skipped:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "it did not wait for the other replica");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, 6);
    other.rollback().await.unwrap();

    // Replica-b's release is not replica-a's: the lease holds. Replica-a stopping gives it up, the cursor kept,
    // and replica-b goes on from k2 at once.
    idemflow::store::mysql::retention::release(pool, &b).await.unwrap();
    assert_eq!(slice(b).await.unwrap().skipped, Some(Skipped::OtherReplica));
    idemflow::store::mysql::retention::release(pool, &a).await.unwrap();
    assert_eq!(cursor().await, "k2");
    let taken = slice(b).await.unwrap();
    assert_eq!((taken.skipped, taken.examined, taken.purged), (None, 3, 2), "k3, k3a (fresh, kept), k4");
    // Replica-a stopped; the rest of the pass is replica-b's from here, and replica-a takes it back once released.
    idemflow::store::mysql::retention::release(pool, &b).await.unwrap();

    // The rest of the pass resumes after k4: k5, k6 and the end of the pipeline's keys.
    let mut examined = Vec::new();
    let o = store.sweep_pass(&a, |s| examined.push(s.examined)).await.unwrap();
    assert_eq!(examined, vec![2], "{o:?}");
    assert_eq!((o.purged, o.slices), (2, 1));
    assert!(o.pass_seconds.is_some(), "{o:?}");
    assert_eq!(db.scalar::<String>("SELECT GROUP_CONCAT(CAST(key_id AS CHAR) ORDER BY pipeline, key_id) FROM idemflow_dedup").await, "k3a,k0", "the fresh row and the other pipeline's stay");
    assert_eq!(db.scalar::<Option<String>>("SELECT CAST(swept_to AS CHAR) FROM idemflow_retention_sweeps WHERE pipeline = 'p'").await, None);
    assert_eq!(db.scalar::<i64>("SELECT passes FROM idemflow_retention_sweeps WHERE pipeline = 'p'").await, 1);
    // The next pass is due `purge_interval` after this one ended, whichever replica asks.
    assert_eq!(slice(sweep("replica-b", Duration::from_secs(3600))).await.unwrap().skipped, Some(Skipped::NotDue));
}

/// With the binary log on in `STATEMENT` format, InnoDB refuses writes in `READ COMMITTED`: `migrate` and `check`
/// say which setting to change before anything else, instead of a raw error 1665.
#[tokio::test(flavor = "multi_thread")]
async fn statement_binlog_format_is_named_by_migrate_and_check() {
    let server = Server::start_with("--log-bin --binlog-format=STATEMENT");
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let db = MyDb { url: server.url.clone(), pool: sqlx::MySqlPool::connect(&server.url).await.unwrap() };
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let setup = Setup::new(&db, &kafka, &[("t.toml", pipeline)]);
    for command in ["migrate", "check"] {
        let (status, out, err) = idemflow(&[command, "--config", setup.config.to_str().unwrap()], setup.dir.path());
        assert!(!status.success(), "{out}");
        assert!(err.contains("binlog_format = STATEMENT") && err.contains("ROW"), "{command}: {err}");
    }
}

/// A procedure that commits the batch transaction (the usual MySQL shape: `START TRANSACTION ... COMMIT`, an exit
/// handler that rolls back, with or without `RESIGNAL`) must never cost records: `check` refuses `CALL` unless
/// `allow_procedures = true`, and with it the worker finds that the transaction it opened was ended (before
/// redoing the batch record by record, and before COMMIT) and stops the pipeline instead of counting the rest of the
/// batch as duplicates. Comments before a statement are read past (`-- note` + `TRUNCATE`, `/* x */ COMMIT` were
/// let through before). Issue: exactly-once holes, item 1.
#[tokio::test(flavor = "multi_thread")]
async fn a_procedure_that_commits_the_batch_transaction_stops_the_pipeline() {
    // The last shape leaves a transaction open (COMMIT; START TRANSACTION): still not the batch's.
    for (handler, tail) in [("ROLLBACK; RESIGNAL;", ""), ("ROLLBACK;", ""), ("ROLLBACK; START TRANSACTION;", "START TRANSACTION;")] {
        procedure_that_commits(handler, tail).await;
    }
}

async fn procedure_that_commits(handler: &str, tail: &str) {
    let db = MyDb::new(&format!(
        "CREATE TABLE ledger (id VARCHAR(16) PRIMARY KEY, amount DECIMAL(10, 2) NOT NULL) ENGINE = InnoDB;\
         CREATE PROCEDURE apply_payment(IN p_id VARCHAR(16), IN p_amount VARCHAR(32)) \
         BEGIN DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN {handler} END; \
         START TRANSACTION; INSERT INTO ledger VALUES (p_id, p_amount); COMMIT; {tail} END",
    ))
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let pipeline = |statement: &str, extra: &str| {
        format!(
            "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"{statement}\"\n{extra}\n[sink.params]\nid = \"/id\"\namount = \"/amount\"\n"
        )
    };
    let check = |pipeline: &str| {
        let setup = Setup::new(&db, &kafka, &[("t.toml", pipeline)]);
        let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
        (status.success(), format!("{out}{err}"))
    };
    let (ok, out) = check(&pipeline("CALL apply_payment(:id, :amount)", ""));
    assert!(!ok && out.contains("sink.sql") && out.contains("allow_procedures"), "{out}");
    for hidden in ["-- note\\nTRUNCATE ledger", "/* x */ COMMIT", "/*!50000 COMMIT */"] {
        let text = pipeline(hidden, "").replace("[sink.params]\nid = \"/id\"\namount = \"/amount\"\n", "");
        let (ok, out) = check(&text);
        assert!(!ok && out.contains("sink.sql"), "{hidden}: {out}");
    }

    // Opted in: 100 records, one of them invalid. The procedure's START TRANSACTION commits the batch's dedup rows
    // at the first record; the worker must notice and stop, not count the rest as duplicates.
    let records: Vec<Out> = (0..100)
        .map(|i| {
            let amount = if i == 50 { "not a number".to_owned() } else { format!("{i}.00") };
            Out::json(0, format!(r#"{{"id":"p{i}","amount":"{amount}"}}"#))
        })
        .collect();
    kafka.produce("t", &records);
    let allowed = pipeline("CALL apply_payment(:id, :amount)", "allow_procedures = true");
    let setup = Setup::new(&db, &kafka, &[("t.toml", &allowed)]);
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "allowed: {out}{err}");
    let w = InProc::start(&setup).await;
    let failures = tokio::time::timeout(Duration::from_secs(120), w.stop_when_pipelines_end()).await.expect("the pipeline stops");
    let text: Vec<String> = failures.iter().map(ToString::to_string).collect();
    assert!(text.iter().any(|f| f.contains("ended the batch transaction itself")), "{handler}: {text:?}");
    assert_eq!(w_duplicates(&db).await, 0, "{handler}: no record was counted as a duplicate of a claim the procedure committed");
    let dead: i64 = db.scalar("SELECT COUNT(*) FROM idemflow_dead_letters").await;
    assert_eq!(dead, 0, "{handler}: nothing was dead-lettered for it");
}

/// The duplicates counted in the dedup rows (each skipped copy adds 1 to its key's row).
async fn w_duplicates(db: &MyDb) -> i64 {
    db.scalar::<i64>("SELECT CAST(COALESCE(SUM(duplicates), 0) AS SIGNED) FROM idemflow_dedup").await
}

/// MySQL/MariaDB round to a `DECIMAL`'s scale and a `DATETIME`'s fractional digits with a note, not an error, even
/// in strict mode: the table form refuses such a value (`param_invalid`) rather than store another one, unless the
/// column says `round = true`. Issue: exactly-once holes, item 4.
#[tokio::test(flavor = "multi_thread")]
async fn values_a_column_would_round_are_refused_on_mariadb() {
    let db = MyDb::new(
        "CREATE TABLE pays (id VARCHAR(16) PRIMARY KEY, amount DECIMAL(12, 2) NOT NULL, at DATETIME(1) NULL, \
         rounded DECIMAL(12, 2) NULL) ENGINE = InnoDB;",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("pays", 1);
    let table = "topics = [\"pays\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"pays\"\n[sink.columns]\nid = \"/id\"\n\
                 amount = \"/amount\"\nat = { field = \"/at\", optional = true }\nrounded = { field = \"/rounded\", optional = true, round = true }\n";
    let setup = Setup::new(&db, &kafka, &[("pays.toml", table)]);
    kafka.produce("pays", &[
        Out::json(0, r#"{"id":"exact","amount":"10.550","at":"2026-11-30 10:00:00","rounded":"1.005"}"#),
        Out::json(0, r#"{"id":"amount","amount":"10.555"}"#),
        Out::json(0, r#"{"id":"at","amount":"1","at":"2026-11-30 10:00:00.65"}"#),
    ]);
    let w = InProc::start(&setup).await;
    w.wait_received("pays", 3).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(
        db.scalar::<String>("SELECT CAST(GROUP_CONCAT(CONCAT(id, '=', amount, '/', rounded)) AS CHAR) FROM pays").await,
        "exact=10.55/1.01"
    );
    let errors: String = db.scalar("SELECT CAST(GROUP_CONCAT(error ORDER BY id SEPARATOR ' | ') AS CHAR) FROM idemflow_dead_letters").await;
    assert!(errors.contains("amount: its column is decimal(12,2), which would store \"10.555\" as 10.56"), "{errors}");
    assert!(errors.contains("at: its column is datetime(1)") && errors.contains("fraction .65"), "{errors}");
}

/// A record larger than the server's `max_allowed_packet` (1 MiB here, one record of 1.5 MiB) used to break the
/// connection at every retry and block its partition forever. It is dead-lettered now (`param_invalid`, the dead
/// letter keeping the payload's head, size and SHA-256), the records around it apply, and `check` says what the
/// limit means. Issue: exactly-once holes, item 7.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_over_max_allowed_packet_is_dead_lettered_and_the_stream_moves_on() {
    let server = Server::start_with("--max-allowed-packet=1M");
    let db = MyDb::on(&server.url, "CREATE TABLE docs (id VARCHAR(16) PRIMARY KEY, body LONGTEXT NOT NULL) ENGINE = InnoDB;").await;
    let kafka = Kafka::new();
    kafka.create_topic("docs", 1);
    let pipeline = "topics = [\"docs\"]\nmax_payload_bytes = 4194304\n[key]\nfield = \"/id\"\n[sink]\ntable = \"docs\"\n[sink.columns]\nid = \"/id\"\nbody = \"/body\"\n";
    let big = "x".repeat(1_500_000);
    let big_record = format!(r#"{{"id":"big","body":"{big}"}}"#);
    kafka.produce("docs", &[
        Out::json(0, r#"{"id":"before","body":"a"}"#),
        Out::json(0, big_record.clone()),
        Out::json(0, r#"{"id":"after","body":"b"}"#),
    ]);
    let setup = Setup::new(&db, &kafka, &[("docs.toml", pipeline)]);
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success() && out.contains("max_allowed_packet is 1048576 bytes"), "{out}{err}");
    let w = InProc::start(&setup).await;
    w.wait_received("docs", 3).await;
    wait_until(Duration::from_secs(60), "both small records applied", || async {
        w.metric("idemflow_records_applied_total", &[("pipeline", "docs")]) == 2.0
    })
    .await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT CAST(GROUP_CONCAT(id ORDER BY id) AS CHAR) FROM docs").await, "after,before");
    let (reason, error, size, kept): (String, String, Option<i64>, i64) = sqlx::query_as(
        "SELECT CAST(reason AS CHAR), CAST(error AS CHAR), payload_bytes, CAST(LENGTH(payload) AS SIGNED) FROM idemflow_dead_letters",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(reason, "param_invalid");
    assert!(error.contains("max_allowed_packet"), "{error}");
    assert_eq!(size, Some(big_record.len() as i64), "the dead letter keeps the payload's size");
    assert!(kept < 1_048_576, "and only its head: {kept} bytes");
}

/// MariaDB's `max_statement_time` (error 1969) stops a statement the way PostgreSQL's `statement_timeout` does, and is
/// handled the same way instead of being retried as it is forever: a table-form batch that a 10 ms trigger makes too
/// slow as one statement (150 rows against 0.5 s) is redone record by record, and a record whose statement alone
/// runs past the limit (in the table form, and in the SQL form among 10) is dead-lettered after three attempts in a
/// row over 20 s at least, the rest applied. Issue 42, item 5.
#[tokio::test(flavor = "multi_thread")]
async fn max_statement_time_redoes_the_batch_record_by_record() {
    let server = Server::start_with("--max-statement-time=0.5");
    let db = MyDb::on(
        &server.url,
        "CREATE TABLE orders (id VARCHAR(16) PRIMARY KEY, amount DECIMAL(12, 2) NOT NULL) ENGINE = InnoDB;
         CREATE TRIGGER slow BEFORE INSERT ON orders FOR EACH ROW SET @slept = SLEEP(IF(NEW.amount = 999, 1, 0.01));
         CREATE TABLE ledger (id VARCHAR(16) PRIMARY KEY) ENGINE = InnoDB;",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    kafka.create_topic("ledger", 1);
    let table = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"orders\"\n[sink.columns]\nid = \"/id\"\n\
                 amount = \"/amount\"\n[batch]\nmax_wait = \"500ms\"\n";
    let sql = "topics = [\"ledger\"]\n[key]\nfield = \"/id\"\n[sink]\n\
               sql = [\"INSERT INTO ledger (id) SELECT :id FROM DUAL WHERE SLEEP(IF(:amount = 999, 1, 0)) = 0\"]\n\
               [sink.params]\nid = \"/id\"\namount = \"/amount\"\n[batch]\nmax_wait = \"500ms\"\n";
    let setup = Setup::new(&db, &kafka, &[("orders.toml", table), ("ledger.toml", sql)]);
    let amount = |i: usize, slow: usize| if i == slow { 999 } else { 1 };
    let orders: Vec<Out> = (0..150).map(|i| Out::json(0, format!(r#"{{"id":"o{i}","amount":"{}"}}"#, amount(i, 70)))).collect();
    let ledger: Vec<Out> = (0..10).map(|i| Out::json(0, format!(r#"{{"id":"l{i}","amount":"{}"}}"#, amount(i, 4)))).collect();
    kafka.produce("orders", &orders);
    kafka.produce("ledger", &ledger);
    let w = InProc::start(&setup).await;
    let settled = |pipeline: &'static str, applied: f64| {
        let w = &w;
        async move {
            w.metric("idemflow_records_applied_total", &[("pipeline", pipeline)]) == applied
                && w.metric("idemflow_dead_letters_total", &[("pipeline", pipeline), ("reason", "side_effect_rejected")]) == 1.0
        }
    };
    wait_until(Duration::from_secs(120), "the table form: 149 applied, the slow record dead-lettered", || settled("orders", 149.0)).await;
    wait_until(Duration::from_secs(60), "the SQL form: 9 applied, the slow record dead-lettered", || settled("ledger", 9.0)).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM orders").await, 149);
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM ledger").await, 9);
    let errors: String =
        db.scalar("SELECT CAST(GROUP_CONCAT(CONCAT(pipeline, ': ', error) ORDER BY pipeline SEPARATOR ' | ') AS CHAR) FROM idemflow_dead_letters").await;
    assert_eq!(errors.matches("MySQL error 1969").count(), 2, "{errors}");
    assert_eq!(errors.matches("alone ran past the statement time limit, in ").count(), 2, "{errors}");
    assert_eq!(errors.matches("attempts in a row over at least 20s").count(), 2, "{errors}");
}

/// A `COMMIT` whose answer was lost though it committed (injected) is recognised by the retry on MariaDB as on
/// PostgreSQL: every record applied once, none counted as a duplicate. Issue 42, item 10.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_whose_answer_was_lost_is_recognised_on_mariadb() {
    let db = MyDb::new("CREATE TABLE paid (id VARCHAR(16) PRIMARY KEY, amount DECIMAL(10, 2) NOT NULL) ENGINE = InnoDB;").await;
    let kafka = Kafka::new();
    kafka.create_topic("pay", 1);
    let pipeline = "topics = [\"pay\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\namount = \"/amount\"\n\
                    [batch]\nmax_wait = \"500ms\"\n";
    kafka.produce("pay", &(0..30).map(|i| Out::json(0, format!(r#"{{"id":"p{i}","amount":"1"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(&db, &kafka, &[("pay.toml", pipeline)]);
    let faults = idemflow::worker::Faults { lose_commit_answer: Some(1), ..Default::default() };
    let w = InProc::start_with_faults(&setup, faults).await;
    w.wait_received("pay", 30).await;
    wait_until(Duration::from_secs(30), "the batch committed", || async {
        w.metric("idemflow_records_applied_total", &[("pipeline", "pay")]) == 30.0
    })
    .await;
    let retries = w.metric("idemflow_db_retries_total", &[("pipeline", "pay"), ("cause", "connection")]);
    let redelivered = w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "pay"), ("reason", "redelivered")]);
    assert!(w.stop().await.is_empty());
    assert_eq!((retries, redelivered), (1.0, 0.0));
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM paid").await, 30);
    assert_eq!(w_duplicates(&db).await, 0);
}

/// `allow_procedures`: a procedure that commits at every record (its own `START TRANSACTION ... COMMIT`), then a
/// retryable failure later in the batch (a lock wait timeout, error 1205, on record 50's row held by another
/// session, `innodb_lock_wait_timeout = 2`). The batch's claims were committed by the first procedure call, so the
/// retry would have found every key claimed and counted the records never applied as duplicates: 50 applied, 100
/// duplicates, the pipeline up. The retry reads the attempt recorded in the store: the earlier attempt, which never
/// reached its COMMIT, is committed, so the side effect ended its transaction: the pipeline stops, nothing counted
/// as a duplicate. Issue 42, item 2.
#[tokio::test(flavor = "multi_thread")]
async fn a_procedure_that_commits_then_a_lock_wait_timeout_stops_the_pipeline() {
    let server = Server::start_with("--innodb-lock-wait-timeout=2");
    let db = MyDb::on(
        &server.url,
        "CREATE TABLE ledger (id VARCHAR(16) PRIMARY KEY, amount DECIMAL(10, 2) NOT NULL) ENGINE = InnoDB;\
         CREATE PROCEDURE apply_payment(IN p_id VARCHAR(16), IN p_amount VARCHAR(32)) \
         BEGIN START TRANSACTION; INSERT INTO ledger VALUES (p_id, p_amount); COMMIT; END",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"CALL apply_payment(:id, :amount)\"\nallow_procedures = true\n\
                    [sink.params]\nid = \"/id\"\namount = \"/amount\"\n[batch]\nmax_wait = \"500ms\"\n";
    // Another session holds record 50's row.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO ledger VALUES ('p50', 0)").execute(&mut *held).await.unwrap();
    kafka.produce("t", &(0..100).map(|i| Out::json(0, format!(r#"{{"id":"p{i}","amount":"{i}.00"}}"#))).collect::<Vec<_>>());
    let setup = Setup::new(&db, &kafka, &[("t.toml", pipeline)]);
    let w = InProc::start(&setup).await;
    let failures = tokio::time::timeout(Duration::from_secs(120), w.stop_when_pipelines_end()).await.expect("the pipeline stops");
    let text: Vec<String> = failures.iter().map(ToString::to_string).collect();
    assert!(text.iter().any(|f| f.contains("ended the batch transaction itself")), "{text:?}");
    held.rollback().await.unwrap();
    assert_eq!(w_duplicates(&db).await, 0, "no record was counted as a duplicate of a claim the procedure committed");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM ledger").await, 50, "the records before the lock, committed by the procedure");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, 100, "every key of the batch stayed claimed");

    // The way out (docs/mysql.md): the transaction control taken out of the procedure, then the keys whose effects
    // never ran forgotten, and the pipeline started again: each payment applied once.
    db.exec("DROP PROCEDURE apply_payment").await;
    db.exec("CREATE PROCEDURE apply_payment(IN p_id VARCHAR(16), IN p_amount VARCHAR(32)) BEGIN INSERT INTO ledger VALUES (p_id, p_amount); END").await;
    let config = setup.config.to_str().unwrap().to_owned();
    let forget = |extra: &[&str]| {
        let mut args = vec!["dedup", "forget", "--config", &config, "--pipeline", "t", "--topic", "t", "--partition", "0", "--offsets", "50-99"];
        args.extend_from_slice(extra);
        idemflow(&args, setup.dir.path())
    };
    let (status, out, err) = forget(&[]);
    assert!(!status.success() && err.contains("ran a batch within the last 60s") && err.contains("stop every worker"), "refused just after a batch: {out}{err}");
    let (status, out, err) = forget(&["--dry-run"]);
    assert!(status.success() && out.contains("would forget 50 dedup row(s)") && out.contains("dry run: nothing changed"), "{out}{err}");
    assert!(out.contains("a real run would be refused"), "the dry run says what the real one would do: {out}");
    // A minute later (the lane's attempt row aged by hand), the same command goes ahead.
    db.exec("UPDATE idemflow_attempts SET updated_at = NOW(6) - INTERVAL 2 MINUTE").await;
    let (status, out, err) = forget(&[]);
    assert!(status.success() && out.contains("forgot 50 dedup row(s)") && out.contains("\"p99\" applied at"), "{out}{err}");
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, 50);
    let w = InProc::start(&setup).await;
    w.wait_received("t", 100).await;
    wait_until(Duration::from_secs(60), "the forgotten records applied", || async {
        w.metric("idemflow_records_applied_total", &[("pipeline", "t")]) == 50.0
    })
    .await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM ledger").await, 100, "each payment once");
    assert_eq!(db.scalar::<String>("SELECT CAST(SUM(amount) AS CHAR) FROM ledger").await, "4950.00");
}
