//! Hardening: values never change silently (schema changes while running, time zones, number keys), inputs users
//! send (arrays), and the classification of replays.

use crate::support::*;
use std::time::Duration;

fn dead_letters(worker: &InProc, pipeline: &str, reason: &str) -> f64 {
    worker.metric("idemflow_dead_letters_total", &[("pipeline", pipeline), ("reason", reason)])
}

const PAYMENTS: &str = "CREATE TABLE payments (order_id text PRIMARY KEY, amount integer NOT NULL, paid_at timestamp);";

const ALTER: &str = "ALTER TABLE payments ALTER COLUMN paid_at TYPE timestamptz USING paid_at AT TIME ZONE 'UTC', \
                     ALTER COLUMN amount TYPE numeric";

/// The table form over [`PAYMENTS`].
const TABLE_PIPELINE: &str = r#"topics = ["orders"]
[key]
field = "/order/id"
[sink]
table = "payments"
[sink.columns]
order_id = "/order/id"
amount = "/order/amount"
paid_at = "/paid_at"
"#;

fn payment(id: &str, amount: &str, paid_at: &str) -> Out {
    Out::json(0, format!(r#"{{"order":{{"id":"{id}","amount":"{amount}"}},"paid_at":"{paid_at}"}}"#))
}

/// The issue's scenario, for one form of the sink: a running worker, then `ALTER TABLE` changes two column types;
/// the next records must be bound through the new types (09:00 UTC, 2.50), none dead-lettered.
async fn column_type_change_is_followed(pipeline: &str) {
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 1, &[("payments.toml", pipeline)]).await;
    kafka.produce("orders", &[payment("o-1", "5", "2026-11-29T10:00:00")]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", 1).await;
    sqlx::raw_sql(ALTER).execute(&db.pool).await.unwrap();
    kafka.produce("orders", &[payment("o-2", "7", "2026-11-29T10:00:00+01:00"), payment("o-3", "2.50", "2026-11-29T10:00:00Z")]);
    worker.wait_received("payments", 3).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 3.0);
    assert_eq!(dead_letters(&worker, "payments", "side_effect_rejected"), 0.0);
    assert!(worker.stop().await.is_empty());
    assert!(db.scalar::<bool>("SELECT paid_at = '2026-11-29T09:00:00Z' FROM payments WHERE order_id = 'o-2'").await);
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = 'o-3'").await, "2.50");
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = 'o-2'").await, "7");
    assert!(db.scalar::<bool>("SELECT paid_at = '2026-11-29T10:00:00Z' FROM payments WHERE order_id = 'o-1'").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_type_changed_while_running_is_followed_table_form() {
    column_type_change_is_followed(TABLE_PIPELINE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_type_changed_while_running_is_followed_sql_form() {
    column_type_change_is_followed(
        r#"topics = ["orders"]
[key]
field = "/order/id"
[sink]
sql = "INSERT INTO payments (order_id, amount, paid_at) VALUES (:id, :amount, :paid_at)"
[sink.params]
id = "/order/id"
amount = "/order/amount"
paid_at = "/paid_at"
"#,
    )
    .await;
}

/// Records received while a batch is in its transaction are prepared then, for their own batch (the worker's share
/// of the next batch overlaps the database's of this one). A batch stalled on a lock: the record produced meanwhile
/// is prepared ahead and used (`result="used"`). Stalled again, and the table's column types change before the lock
/// goes: what was prepared ahead was bound for the old types (2.50 for an integer column), so it is dropped with the
/// statements (`result="dropped"`) and the record is prepared again for the new ones: 2.50 lands in the numeric
/// column, nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_prepared_while_a_batch_waits_follow_a_schema_change() {
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 1, &[("payments.toml", TABLE_PIPELINE)]).await;
    kafka.produce("orders", &[payment("o-1", "5", "2026-11-29T10:00:00")]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", 1).await;
    let ahead = |result: &str| worker.metric("idemflow_records_prepared_ahead_total", &[("pipeline", "payments"), ("result", result)]);
    for alter in [false, true] {
        let (first, second) = if alter { ("o-4", "o-5") } else { ("o-2", "o-3") };
        let mut lock = db.pool.begin().await.unwrap();
        sqlx::raw_sql("LOCK TABLE payments IN SHARE ROW EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
        kafka.produce("orders", &[payment(first, "7", "2026-11-29T10:00:00")]);
        wait_until(Duration::from_secs(30), "the worker's batch waits for the lock", || async {
            db.scalar::<i64>("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'payments'::regclass").await > 0
        })
        .await;
        kafka.produce("orders", &[payment(second, "2.50", "2026-11-29T10:00:00Z")]);
        // The consumer is polled while the batch waits: the record arrives and is prepared meanwhile.
        tokio::time::sleep(Duration::from_secs(3)).await;
        if alter {
            sqlx::raw_sql(ALTER).execute(&mut *lock).await.unwrap();
            lock.commit().await.unwrap();
        } else {
            lock.rollback().await.unwrap();
        }
        let received = if alter { 5 } else { 3 };
        worker.wait_received("payments", received).await;
        if !alter {
            assert_eq!(ahead("used"), 1.0, "{second} was prepared while {first}'s batch waited");
            // Prepared for the integer column: dead-lettered there, as it would have been after its batch was cut.
            assert_eq!(dead_letters(&worker, "payments", "param_invalid") + dead_letters(&worker, "payments", "side_effect_rejected"), 1.0);
        }
    }
    let refused = dead_letters(&worker, "payments", "param_invalid") + dead_letters(&worker, "payments", "side_effect_rejected");
    assert_eq!(refused, 1.0, "o-3 only: o-5 is bound for the new column types, not as it was prepared for the old");
    assert_eq!(ahead("dropped"), 1.0, "o-5, prepared for the old column types, was dropped with them");
    assert_eq!(ahead("used"), 1.0);
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = 'o-5'").await, "2.50");
    assert_eq!(db.scalar::<String>("SELECT amount::text FROM payments WHERE order_id = 'o-4'").await, "7");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1, "o-3 only");
}

/// The business table of [`records_prepared_ahead_from_a_queue_bind_their_own_values`].
pub(crate) const ORDERS: &str = "CREATE TABLE orders (id text PRIMARY KEY, amount numeric NOT NULL);";

/// Prepare ahead from a queue (RabbitMQ, NATS JetStream), whose connectors call the hook from their own stash: a
/// running worker on `setup` (a table-form pipeline `payments` keyed by message id, `id` and `amount` mapped into
/// [`ORDERS`]); a batch stalled on a table lock; a message published meanwhile is prepared ahead (`result="used"`)
/// and lands with its own amount, and a message published after the lock goes with its own. `publish(id, amount)`
/// publishes one message with that message id and body `{"amount": amount}`.
pub(crate) async fn records_prepared_ahead_from_a_queue_bind_their_own_values<F, Fut>(setup: &Setup, db: &TestDb, publish: F)
where
    F: Fn(&'static str, &'static str) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    publish("o-1", "1").await;
    let worker = InProc::start(setup).await;
    worker.wait_received("payments", 1).await;
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::raw_sql("LOCK TABLE orders IN SHARE ROW EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    publish("o-2", "2").await;
    wait_until(Duration::from_secs(30), "the worker's batch waits for the lock", || async {
        db.scalar::<i64>("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'orders'::regclass").await > 0
    })
    .await;
    publish("o-3", "3.25").await;
    // The source is polled while the batch waits: o-3 arrives and is prepared meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    lock.rollback().await.unwrap();
    worker.wait_received("payments", 3).await;
    publish("o-4", "4.5").await;
    worker.wait_received("payments", 4).await;
    let ahead = |result: &str| worker.metric("idemflow_records_prepared_ahead_total", &[("pipeline", "payments"), ("result", result)]);
    assert_eq!(ahead("used"), 1.0, "o-3 was prepared while o-2's batch waited, and used");
    assert_eq!(ahead("dropped"), 0.0);
    assert!(worker.stop().await.is_empty());
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT id, amount::text FROM orders ORDER BY id").fetch_all(&db.pool).await.unwrap();
    let expected = [("o-1", "1"), ("o-2", "2"), ("o-3", "3.25"), ("o-4", "4.5")].map(|(i, a)| (i.to_owned(), a.to_owned()));
    assert_eq!(rows, expected, "each message applied once, with its own amount");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0);
}

/// A mapped column dropped while the worker runs: the pipeline stops loudly (a fatal error naming the column)
/// instead of dead-lettering the stream, and nothing of the batch is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_column_dropped_while_running_stops_the_pipeline() {
    let pipeline = TABLE_PIPELINE;
    let (db, kafka, setup) = fixture(PAYMENTS, "orders", 1, &[("payments.toml", pipeline)]).await;
    kafka.produce("orders", &[payment("o-1", "5", "2026-11-29T10:00:00")]);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", 1).await;
    sqlx::raw_sql("ALTER TABLE payments DROP COLUMN paid_at").execute(&db.pool).await.unwrap();
    kafka.produce("orders", &[payment("o-2", "7", "2026-11-29T10:00:00Z")]);
    let failures = worker.stop_when_pipelines_end().await;
    assert_eq!(failures.len(), 1);
    let text = failures[0].to_string();
    assert!(text.contains("paid_at") && text.contains("schema change"), "{text}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, 1);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 1);
}

/// Timestamps without a UTC offset: read in the pipeline's `time_zone` (UTC by default), or dead-lettered with
/// `naive_timestamps = "dead_letter"`; a value with an offset for a `timestamp` column is converted to the zone,
/// not stripped of its offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_timestamps_follow_the_pipeline_time_zone_or_are_dead_lettered() {
    let tables = "CREATE TABLE ny (id text PRIMARY KEY, at timestamptz, local timestamp);
                  CREATE TABLE utc (id text PRIMARY KEY, at timestamptz, local timestamp);
                  CREATE TABLE strict (id text PRIMARY KEY, at timestamptz);";
    let pipeline = |name: &str, extra: &str, local: bool| {
        format!(
            "topics = [\"events\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"{name}\"\n{extra}\n[sink.columns]\nid = \"/id\"\nat = \"/at\"\n{}",
            if local { "local = \"/at\"\n" } else { "" }
        )
    };
    let (ny, utc, strict) = (
        pipeline("ny", "time_zone = \"America/New_York\"", true),
        pipeline("utc", "", true),
        pipeline("strict", "naive_timestamps = \"dead_letter\"", false),
    );
    let (db, kafka, setup) =
        fixture(tables, "events", 1, &[("ny.toml", &ny), ("utc.toml", &utc), ("strict.toml", &strict)]).await;
    kafka.produce(
        "events",
        &[
            Out::json(0, r#"{"id":"naive","at":"2024-03-10T01:30:00"}"#),
            Out::json(0, r#"{"id":"zoned","at":"2026-11-29T10:00:00+01:00"}"#),
            Out::json(0, r#"{"id":"named","at":"2026-11-29 10:00:00 Europe/Berlin"}"#),
        ],
    );
    let worker = InProc::start(&setup).await;
    for p in ["ny", "utc", "strict"] {
        worker.wait_received(p, 3).await;
    }
    assert_eq!(dead_letters(&worker, "strict", "param_invalid"), 1.0);
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "strict")]), 2.0);
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "ny")]), 3.0);
    assert!(worker.stop().await.is_empty());
    let instant = |table: &str, id: &str| format!("SELECT to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI') FROM {table} WHERE id = '{id}'");
    let local = |table: &str, id: &str| format!("SELECT to_char(local, 'YYYY-MM-DD HH24:MI') FROM {table} WHERE id = '{id}'");
    // New York is UTC-5 on 2024-03-10 at 01:30 (daylight saving time starts at 02:00).
    assert_eq!(db.scalar::<String>(&instant("ny", "naive")).await, "2024-03-10 06:30");
    assert_eq!(db.scalar::<String>(&instant("utc", "naive")).await, "2024-03-10 01:30");
    for t in ["ny", "utc", "strict"] {
        assert_eq!(db.scalar::<String>(&instant(t, "zoned")).await, "2026-11-29 09:00", "{t}");
        assert_eq!(db.scalar::<String>(&instant(t, "named")).await, "2026-11-29 09:00", "{t}");
    }
    // timestamp (without time zone) columns get the local time of the pipeline's zone, never a dropped offset.
    assert_eq!(db.scalar::<String>(&local("ny", "zoned")).await, "2026-11-29 04:00");
    assert_eq!(db.scalar::<String>(&local("utc", "zoned")).await, "2026-11-29 09:00");
    assert_eq!(db.scalar::<String>(&local("ny", "naive")).await, "2024-03-10 01:30");
    let error: String = db.scalar("SELECT error FROM idemflow.dead_letters WHERE pipeline = 'strict'").await;
    assert!(error.contains("no UTC offset"), "{error}");
}

/// JSON numbers equal in value are one business key, in an exact canonical decimal form; exponent notation is
/// written out in bound values too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_numbers_are_one_business_key() {
    let table = "CREATE TABLE orders (order_id text PRIMARY KEY, note text);";
    let pipeline = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"orders\"\n[sink.columns]\norder_id = \"/id\"\nnote = { field = \"/note\", optional = true }\n";
    let (db, kafka, setup) = fixture(table, "orders", 1, &[("orders.toml", pipeline)]).await;
    kafka.produce(
        "orders",
        &[
            Out::json(0, r#"{"id":100}"#),
            Out::json(0, r#"{"id":"100"}"#),
            Out::json(0, r#"{"id":100.0}"#),
            Out::json(0, r#"{"id":1e2}"#),
            Out::json(0, r#"{"id":1.5E+3,"note":2.5e-1}"#),
        ],
    );
    let worker = InProc::start(&setup).await;
    worker.wait_received("orders", 5).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "orders")]), 2.0);
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM orders").await, 2);
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',' ORDER BY order_id) FROM orders").await, "100,1500");
    assert_eq!(db.scalar::<String>("SELECT note FROM orders WHERE order_id = '1500'").await, "0.25");
    assert_eq!(db.scalar::<String>("SELECT convert_from(key_id, 'UTF8') FROM idemflow.dedup ORDER BY key_id LIMIT 1").await, "100");
}

/// JSON arrays into PostgreSQL array columns, of every scalar kind, with elements needing quotes and NULLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_arrays_fill_array_columns() {
    let table = "CREATE TYPE mood AS ENUM ('ok', 'sad');
        CREATE TABLE items (order_id text PRIMARY KEY, tags text[] NOT NULL, qty int[], prices numeric[],
            flags boolean[], days date[], docs jsonb[], grid int[][], moods mood[], raw text[]);";
    let pipeline = r#"topics = ["items"]
[key]
field = "/order/id"
[sink]
table = "items"
[sink.columns]
order_id = "/order/id"
tags = "/order/tags"
qty = { field = "/order/qty", optional = true }
prices = { field = "/order/prices", optional = true }
flags = { field = "/order/flags", optional = true }
days = { field = "/order/days", optional = true }
docs = { field = "/order/docs", optional = true }
grid = { field = "/order/grid", optional = true }
moods = { field = "/order/moods", optional = true }
raw = { field = "/order/raw", optional = true }
"#;
    let (db, kafka, setup) = fixture(table, "items", 1, &[("items.toml", pipeline)]).await;
    kafka.produce(
        "items",
        &[
            Out::json(0, r#"{"order":{"id":"o-1","tags":["a","b"],"qty":[1,2]}}"#),
            Out::json(0, r#"{"order":{"id":"o-2","tags":["x,y","q\"u","b\\s","{}","NULL",null,""," sp "],
                "prices":[1.50,2e2,-0.001],"flags":[true,false,null],"days":["2026-11-30"],"docs":[{"a":[1]},"s",null],
                "grid":[[1,2],[3,4]],"moods":["ok","sad"],"raw":"{p,q}"}}"#),
            Out::json(0, r#"{"order":{"id":"o-3","tags":{"not":"an array"}}}"#),
            Out::json(0, r#"{"order":{"id":"o-4","tags":["a"],"grid":[[1,2],[3]]}}"#),
        ],
    );
    let worker = InProc::start(&setup).await;
    worker.wait_received("items", 4).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "items")]), 2.0);
    assert_eq!(dead_letters(&worker, "items", "param_invalid"), 1.0, "an object for an array column");
    assert_eq!(dead_letters(&worker, "items", "side_effect_rejected"), 1.0, "a ragged multidimensional array");
    assert!(worker.stop().await.is_empty());
    let one = |sql: &str| format!("SELECT ({sql})::text FROM items WHERE order_id = 'o-2'");
    assert_eq!(db.scalar::<String>("SELECT tags::text FROM items WHERE order_id = 'o-1'").await, "{a,b}");
    assert_eq!(db.scalar::<String>("SELECT qty::text FROM items WHERE order_id = 'o-1'").await, "{1,2}");
    assert_eq!(db.scalar::<i64>("SELECT cardinality(tags)::int8 FROM items WHERE order_id = 'o-2'").await, 8);
    assert_eq!(db.scalar::<String>(&one("tags[1]")).await, "x,y");
    assert_eq!(db.scalar::<String>(&one("tags[2]")).await, "q\"u");
    assert_eq!(db.scalar::<String>(&one("tags[3]")).await, "b\\s");
    assert_eq!(db.scalar::<String>(&one("tags[4]")).await, "{}");
    assert_eq!(db.scalar::<String>(&one("tags[5]")).await, "NULL");
    assert!(db.scalar::<bool>("SELECT tags[6] IS NULL FROM items WHERE order_id = 'o-2'").await);
    assert_eq!(db.scalar::<String>(&one("tags[7]")).await, "");
    assert_eq!(db.scalar::<String>(&one("tags[8]")).await, " sp ");
    assert_eq!(db.scalar::<String>(&one("prices")).await, "{1.50,200,-0.001}");
    assert_eq!(db.scalar::<String>(&one("flags")).await, "{t,f,NULL}");
    assert_eq!(db.scalar::<String>(&one("days")).await, "{2026-11-30}");
    assert_eq!(db.scalar::<String>(&one("docs[1]->'a'->>0")).await, "1");
    assert_eq!(db.scalar::<String>(&one("docs[2]")).await, "\"s\"");
    assert_eq!(db.scalar::<String>(&one("grid")).await, "{{1,2},{3,4}}");
    assert_eq!(db.scalar::<String>(&one("moods")).await, "{ok,sad}");
    assert_eq!(db.scalar::<String>(&one("raw")).await, "{p,q}");
}

/// Target types the worker cannot bind are refused when the pipeline is checked, naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_types_it_cannot_bind() {
    let table = "CREATE TYPE money2 AS (amount numeric, currency text);
        CREATE TABLE t (id text PRIMARY KEY, price money2, prices money2[], span int4range);";
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\nprice = \"/p\"\nprices = \"/ps\"\nspan = \"/s\"\n";
    let (_db, _kafka, setup) = fixture(table, "t", 1, &[("t.toml", pipeline)]).await;
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    let text = format!("{out}{err}");
    assert!(text.contains("sink.columns.price") || text.contains("column \"price\""), "{text}");
    assert!(text.contains("composite type"), "{text}");
    assert!(text.contains("prices") && text.contains("array of a composite type"), "{text}");
    assert!(!text.contains("\"span\""), "ranges bind from their text form: {text}");
}

/// `check` refuses a dedup store whose unique index was dropped (the claim needs it), and says how to restore it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_a_dedup_store_without_its_unique_index() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let (db, _kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 1, &[("t.toml", pipeline)]).await;
    let config = setup.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    sqlx::raw_sql("ALTER TABLE idemflow.dedup DROP CONSTRAINT dedup_pkey").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("no valid unique index on (pipeline, key_id)") && err.contains("ADD PRIMARY KEY"), "{err}");
    // A unique index on other columns does not count.
    sqlx::raw_sql("CREATE UNIQUE INDEX ON idemflow.dedup (pipeline, topic, key_id)").execute(&db.pool).await.unwrap();
    let (status, _, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("no valid unique index"), "{err}");
    sqlx::raw_sql("ALTER TABLE idemflow.dedup ADD PRIMARY KEY (pipeline, key_id)").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
}

/// A database that cannot answer the worker's start-up reads after it was seen reachable (here its migration record
/// locked past the database's `lock_timeout`: SQLSTATE 55P03, as a restart or a pooler's failure would fail them):
/// the worker waits and retries, saying why, instead of exiting, and runs once it can read them. A schema that is
/// behind still stops it at once (`check_refuses_a_dedup_store_without_its_unique_index`, `upgrade::`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_cannot_answer_at_start_is_waited_for() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let (db, kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 1, &[("t.toml", pipeline)]).await;
    let name = db.url.rsplit_once('/').unwrap().1.split('?').next().unwrap().to_owned();
    sqlx::raw_sql(&format!("ALTER DATABASE \"{name}\" SET lock_timeout = '300ms'")).execute(&db.pool).await.unwrap();
    let mut lock = db.pool.begin().await.unwrap();
    let home = idemflow::store::postgres::migrations_schema(&mut lock).await.unwrap().expect("migrated");
    sqlx::raw_sql(&format!("LOCK TABLE {home}._sqlx_migrations IN ACCESS EXCLUSIVE MODE")).execute(&mut *lock).await.unwrap();
    kafka.produce("t", &[Out::json(0, r#"{"id":"a"}"#)]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "the worker saying it waits for the schema version", || async {
        w.log_text().matches("starting: database: cannot read the schema version").count() >= 2
    })
    .await;
    lock.rollback().await.unwrap();
    wait_until(Duration::from_secs(30), "the record applied once the reads answer", || async {
        db.scalar::<i64>("SELECT count(*) FROM t").await == 1
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());
}

/// A database that can never answer as configured (one that does not exist, SQLSTATE 3D000; a wrong password would
/// be class 28): `run` says so and exits at once instead of waiting for it forever, as it waits for one not up yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_does_not_exist_stops_the_worker_at_once() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let (db, _kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 1, &[("t.toml", pipeline)]).await;
    let name = db.url.rsplit_once('/').unwrap().1.split('?').next().unwrap().to_owned();
    let text = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(&setup.config, text.replace(&format!("/{name}"), "/no_such_database_here")).unwrap();
    let mut w = BinWorker::start(&setup);
    let status = w.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{}", w.log_text());
    assert!(w.log_text().contains("no_such_database_here\" does not exist"), "{}", w.log_text());
}

/// A settings file named with --config that does not exist is an error, not an environment-only fallback.
#[test]
fn a_missing_config_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (status, out, err) = idemflow(&["check", "--config", "no-such-idemflow.toml"], dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("no-such-idemflow.toml: no such settings file"), "{err}");
    assert!(!err.contains("missing [database]"), "{err}");
}

/// `check` says quickly when Kafka cannot be reached or a topic does not exist, and still checks the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_an_unreachable_kafka_and_a_missing_topic() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let (db, _kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "other", 1, &[("t.toml", pipeline)]).await;
    let config = setup.config.to_str().unwrap().to_owned();
    let started = std::time::Instant::now();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("pipeline \"t\": kafka: topic \"t\" does not exist"), "{err}");
    let text = std::fs::read_to_string(&setup.config).unwrap();
    let port = free_port();
    let unreachable = text.lines().map(|l| if l.starts_with("bootstrap_servers") { format!("bootstrap_servers = \"127.0.0.1:{port}\"") } else { l.to_owned() }).collect::<Vec<_>>().join("\n");
    std::fs::write(&setup.config, unreachable).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains(&format!("kafka: cannot reach Kafka at 127.0.0.1:{port}")), "{err}");
    assert!(err.contains("the database, its schema and every pipeline's statements are right"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "both answers within the 5 s metadata timeout each");
    // A broker problem does not hide the database's: both are reported.
    sqlx::query("DROP TABLE t").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("cannot reach Kafka") && err.contains("sink.table") && err.contains("does not exist"), "{err}");
    drop(db);
}

/// `check` warns about timing settings that work against each other: a heartbeat interval above a third of the
/// session timeout, and a shutdown timeout shorter than leaving the group can take. A consistent configuration
/// gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_warns_about_timing_settings_that_cannot_work_together() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let (db, _kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 1, &[("t.toml", pipeline)]).await;
    let config = setup.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(!out.contains("heartbeat.interval.ms") && !out.contains("[shutdown]"), "{out}");

    let stored = format!("{pipeline}[offsets]\nstore = \"database\"\n");
    std::fs::write(setup.dir.path().join("pipelines/t.toml"), stored).unwrap();
    let text = std::fs::read_to_string(&setup.config)
        .unwrap()
        .replace("\"heartbeat.interval.ms\" = \"500\"", "\"heartbeat.interval.ms\" = \"2500\"\n\"max.poll.interval.ms\" = \"6000\"")
        .replace("acquire_timeout = \"2s\"", "acquire_timeout = \"10s\"")
        .replace("timeout = \"20s\"", "timeout = \"5s\"");
    std::fs::write(&setup.config, text).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "warnings do not fail check: {out}{err}");
    assert!(out.contains("warning: pipeline \"t\": heartbeat.interval.ms = 2500 is more than a third of session.timeout.ms = 6000"), "{out}");
    assert!(out.contains("warning: [shutdown] timeout = 5s leaves no time"), "{out}");
    drop(db);
}

/// A `COMMIT` that went through but whose answer was lost (here injected: the commit is made, then the attempt fails
/// as on a lost connection) used to make the retry count its own batch as duplicates (`redelivered`). The retry now
/// reads the attempt recorded in the store: the earlier attempt committed, so the batch is not run again and its
/// counts are that attempt's: every record applied once, no duplicate counted, one retry. Issue 42, item 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_was_lost_is_recognised_by_the_retry() {
    let db = TestDb::new("CREATE TABLE paid (id text PRIMARY KEY, amount numeric NOT NULL);").await;
    let kafka = Kafka::new();
    kafka.create_topic("pay", 1);
    let pipeline = "topics = [\"pay\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\namount = \"/amount\"\n\
                    [batch]\nmax_wait = \"500ms\"\n";
    let mut records: Vec<Out> = (0..30).map(|i| Out::json(0, format!(r#"{{"id":"p{i}","amount":"1"}}"#))).collect();
    records.push(Out::json(0, "not json"));
    kafka.produce("pay", &records);
    let setup = Setup::new(&db, &kafka, &[("pay.toml", pipeline)]);
    let faults = idemflow::worker::Faults { lose_commit_answer: Some(1), ..Default::default() };
    let w = InProc::start_with_faults(&setup, faults).await;
    w.wait_received("pay", 31).await;
    wait_until(Duration::from_secs(30), "the batch committed", || async {
        w.metric("idemflow_records_applied_total", &[("pipeline", "pay")]) == 30.0
    })
    .await;
    let metric = |name: &str, labels: &[(&str, &str)]| w.metric(name, labels);
    let duplicates: f64 = ["redelivered", "republished", "payload_mismatch"]
        .iter()
        .map(|r| metric("idemflow_duplicates_skipped_total", &[("pipeline", "pay"), ("reason", r)]))
        .sum();
    let dead = metric("idemflow_dead_letters_total", &[("pipeline", "pay"), ("reason", "decode_failed")]);
    let retries = metric("idemflow_db_retries_total", &[("pipeline", "pay"), ("cause", "connection")]);
    assert!(w.stop().await.is_empty());
    assert_eq!(duplicates, 0.0, "the batch's own records are not counted as duplicates");
    assert_eq!(dead, 1.0, "its dead letter counted once");
    assert_eq!(retries, 1.0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM paid").await, 30);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1);
    assert_eq!(db.scalar::<i64>("SELECT coalesce(sum(duplicates), 0)::int8 FROM idemflow.dedup_duplicates").await, 0);
}

/// A panic in one pipeline (injected with `IDEMFLOW_FAULT_PANIC_ON_PAYLOAD`, as a dependency's bug on a record a
/// peer system accepted would panic) stops that pipeline with the panic's message: its `idemflow_pipeline_up` is 0,
/// `/readyz` names it and says why, and the process's other pipeline goes on applying its records. A panic used to
/// cross the pipeline's task and end the whole process (exit 101), every pipeline with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_one_pipeline_stops_that_pipeline_and_no_other() {
    let db = TestDb::new("CREATE TABLE poisoned (id text PRIMARY KEY); CREATE TABLE healthy (id text PRIMARY KEY);").await;
    let kafka = Kafka::new();
    kafka.create_topic("poisoned", 1);
    kafka.create_topic("healthy", 1);
    let pipeline = |t: &str| format!("topics = [\"{t}\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"{t}\"\n[sink.columns]\nid = \"/id\"\n");
    let setup = Setup::new(&db, &kafka, &[("poisoned.toml", &pipeline("poisoned")), ("healthy.toml", &pipeline("healthy"))]);
    kafka.produce("poisoned", &[Out::json(0, r#"{"id":"p-1","note":"BOOM-6c1f"}"#)]);
    kafka.produce("healthy", &[Out::json(0, r#"{"id":"h-1"}"#)]);
    let mut w = BinWorker::start_with_env(&setup, &[("IDEMFLOW_FAULT_PANIC_ON_PAYLOAD", "BOOM-6c1f")]);
    wait_until(Duration::from_secs(60), "the poisoned pipeline stopped and the healthy one applied its record", || async {
        metric(&w.scrape(), "idemflow_pipeline_up", &[("pipeline", "poisoned")]) == 0.0
            && db.scalar::<i64>("SELECT count(*) FROM healthy").await == 1
    })
    .await;
    let (status, body) = http_get(w.metrics, "/readyz").unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("poisoned") && body.contains("panic"), "/readyz names the pipeline and the panic: {body}");
    assert!(w.log_text().contains("injected panic"), "{}", w.log_text());
    kafka.produce("healthy", &[Out::json(0, r#"{"id":"h-2"}"#), Out::json(0, r#"{"id":"h-3"}"#)]);
    wait_until(Duration::from_secs(30), "the healthy pipeline goes on", || async {
        db.scalar::<i64>("SELECT count(*) FROM healthy").await == 3
    })
    .await;
    assert_eq!(metric(&w.scrape(), "idemflow_pipeline_up", &[("pipeline", "healthy")]), 1.0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM poisoned").await, 0, "nothing of the panicking batch was committed");
    w.sigterm();
}

/// A pipeline's identity is its name (its dedup rows, processed marks, default consumer group and idempotency keys).
/// Its file renamed (so its name, by default the file's stem), it would read the topic again under a new group and
/// apply every record a second time: `check` and `run` refuse it, naming the pipeline that processed the topic and
/// the remedies. With its old `name` written in the renamed file it goes on where it was (each record once); another
/// pipeline over the same topic, alone in its worker, starts with `[dedup] new_history = true`, on purpose. It used to
/// double every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_pipeline_is_refused_until_it_keeps_its_name_or_starts_a_new_history_on_purpose() {
    let db = TestDb::new("CREATE TABLE ledger (id text NOT NULL); CREATE TABLE audit (id text NOT NULL);").await;
    let kafka = Kafka::new();
    kafka.create_topic("refunds", 2);
    let pipeline = |table: &str, extra: &str| {
        format!("{extra}topics = [\"refunds\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"INSERT INTO {table} (id) VALUES (:id)\"\n[sink.params]\nid = \"/id\"\n")
    };
    let refunds = |range: std::ops::Range<usize>| range.map(|i| Out::json((i % 2) as i32, format!(r#"{{"id":"r-{i}"}}"#))).collect::<Vec<_>>();
    kafka.produce("refunds", &refunds(0..20));
    let setup = Setup::new(&db, &kafka, &[("refunds.toml", &pipeline("ledger", ""))]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "20 refunds applied", || async { db.scalar::<i64>("SELECT count(*) FROM ledger").await == 20 }).await;
    w.sigterm();
    // The file renamed: refused by check and by run.
    let dir = setup.dir.path().join("pipelines");
    std::fs::remove_file(dir.join("refunds.toml")).unwrap();
    std::fs::write(dir.join("refunds-v2.toml"), pipeline("ledger", "")).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    let said = format!("{out}{err}");
    assert!(!status.success(), "{said}");
    assert!(said.contains("pipeline \"refunds\" processed 20 record(s) of \"refunds\"") && said.contains("set name = \"refunds\""), "{said}");
    let mut w = BinWorker::start(&setup);
    assert!(!w.wait_exit(Duration::from_secs(60)).success(), "run refuses it too");
    assert!(w.log_text().contains("renamed from \"refunds\"?"), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM ledger").await, 20, "nothing applied again");
    // Its old name kept in the renamed file: it goes on where it was.
    std::fs::write(dir.join("refunds-v2.toml"), pipeline("ledger", "name = \"refunds\"\n")).unwrap();
    kafka.produce("refunds", &refunds(20..25));
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the 5 new refunds applied", || async { db.scalar::<i64>("SELECT count(*) FROM ledger").await == 25 }).await;
    w.sigterm();
    assert_eq!(db.scalar::<i64>("SELECT count(DISTINCT id) FROM ledger").await, 25, "each refund once");
    // Another pipeline over the same topic, alone in its worker: refused, then started on purpose.
    std::fs::remove_file(dir.join("refunds-v2.toml")).unwrap();
    std::fs::write(dir.join("audit.toml"), pipeline("audit", "")).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success() && format!("{out}{err}").contains("new_history = true"), "{out}\n{err}");
    std::fs::write(dir.join("audit.toml"), pipeline("audit", "") + "[dedup]\nnew_history = true\n").unwrap();
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the audit pipeline read the topic from its start", || async {
        db.scalar::<i64>("SELECT count(*) FROM audit").await == 25
    })
    .await;
    w.sigterm();
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM ledger").await, 25);
}
