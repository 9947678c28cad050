//! Upgrading a dedup store in place (issue 28's migration from SHA-256 digests to ordered key ids): rows written by
//! the previous version's claim, then `idemflow migrate`, then the same keys delivered to this version are still
//! duplicates; a batch of the previous version under way is waited for and moved with the rest; after it, the
//! previous version's claim fails instead of claiming a key a second time under its old identity. And migration 8
//! (the dedup store's `pipeline` compared bytewise), which needs no fence.

use crate::support::mariadb::MyDb;
use crate::support::*;
use idemflow::key::BusinessKey;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// The retention purge of the versions before migration 11, as it shipped: found old rows through the
/// `(pipeline, applied_at)` index.
const V10_POSTGRES_PURGE: &str = r#"
WITH lock AS (SELECT pg_try_advisory_xact_lock($1, hashtext($2)) AS held),
victims AS (
    SELECT d.ctid FROM idemflow.dedup d
    WHERE (SELECT held FROM lock) AND d.pipeline = $2 AND d.applied_at < now() - make_interval(secs => $3)
    ORDER BY d.applied_at
    LIMIT $4
    FOR UPDATE OF d SKIP LOCKED
),
deleted AS (DELETE FROM idemflow.dedup WHERE ctid IN (SELECT ctid FROM victims) RETURNING 1)
SELECT (SELECT held FROM lock), (SELECT count(*) FROM deleted)"#;

/// Migration 11 (retention by a sweep of the heap, no index on `applied_at`): the index is dropped in place and the
/// sweep cursors' table made; a worker of the previous version left running still purges correctly (by a scan); the
/// rollback builds the index again, and this version then refuses the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migration_11_drops_the_retention_index_and_the_rollback_builds_it_again() {
    let db = TestDb::at_version(10, "").await;
    sqlx::query(
        "INSERT INTO idemflow.dedup (pipeline, key_id, business_key, topic, partition, \"offset\", fingerprint, applied_at) \
         SELECT 'payments', convert_to('k' || g, 'UTF8'), 'k' || g, 't', 0, g, sha256(convert_to('k' || g, 'UTF8')), now() - CASE WHEN g <= 5 THEN interval '8 days' ELSE interval '1 hour' END \
         FROM generate_series(1, 8) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let index = "SELECT count(*) FROM pg_indexes WHERE schemaname = 'idemflow' AND indexname = 'dedup_pipeline_applied_at'";
    assert_eq!(db.scalar::<i64>(index).await, 1);
    idemflow::store::postgres::MIGRATOR.run(&db.pool).await.unwrap();
    assert_eq!(db.scalar::<i64>(index).await, 0);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.retention_sweeps").await, 0);
    // The previous version's purge still deletes exactly the expired rows.
    let (held, deleted): (Option<bool>, i64) = sqlx::query_as(V10_POSTGRES_PURGE)
        .bind(0x1de_f10)
        .bind("payments")
        .bind(7.0 * 24.0 * 3600.0)
        .bind(3_i64)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((held, deleted), (Some(true), 3));
    // This version's sweep takes the rest.
    let store = idemflow::store::Store::Postgres(db.pool.clone());
    let sweep = idemflow::retention::Sweep {
        pipeline: "payments",
        owner: "idemflow purge/1",
        retention: Duration::from_secs(7 * 24 * 3600),
        rows: 100,
        interval: Duration::from_secs(60),
        pace: idemflow::retention::Pace::FromStartAtOnce,
    };
    let o = store.sweep_pass(&sweep, |_| {}).await.unwrap();
    assert_eq!((o.purged, o.examined), (2, 5), "{o:?}");
    roll_back(&db, "postgres-0014.sql").await;
    roll_back(&db, "postgres-0013.sql").await;
    roll_back(&db, "postgres-0012.sql").await;
    roll_back(&db, "postgres-0011.sql").await;
    assert_eq!(db.scalar::<i64>(index).await, 1);
    assert_eq!(db.scalar::<Option<String>>("SELECT to_regclass('idemflow.retention_sweeps')::text").await, None);
    let err = idemflow::store::postgres::check_schema(&db.pool).await.unwrap_err();
    assert!(err.to_string().contains("at version 10, this binary needs 14"), "{err}");
}

/// Migration 10 (dead letters unique by position and payload digest): a dead letter of the previous version gets the
/// digest this version computes (the same poison record consumed again is recognised as the one dead-lettered, not
/// stored twice); the rollback refuses while a position holds two dead letters and goes through once it holds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migration_10_makes_dead_letters_unique_by_position_and_payload() {
    let db = TestDb::at_version(9, PAYMENTS).await;
    sqlx::query(
        r#"INSERT INTO idemflow.dead_letters (pipeline, topic, partition, "offset", payload, reason, error)
           VALUES ('payments', 'orders', 0, 0, '{bad', 'decode_failed', 'written by the previous version')"#,
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (kafka, setup, config) = on_orders(&db);
    let (status, out, err) = idemflow(&["migrate", "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert_eq!(db.scalar::<Vec<u8>>("SELECT payload_digest FROM idemflow.dead_letters").await, sha256(b"{bad"));

    kafka.produce("orders", &[Out::json(0, "{bad"), Out::json(0, payload("o-1"))]);
    let mut w = BinWorker::start(&setup);
    let start = std::time::Instant::now();
    while metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]) < 2.0 {
        assert!(start.elapsed() < Duration::from_secs(60), "nothing received in 60 s:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = w.scrape();
    assert_eq!(metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "redelivered")]), 1.0, "{m}");
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1, "recognised, not stored again");

    // Another payload at the same position (a topic created again): the rollback refuses, then goes through.
    sqlx::query(
        r#"INSERT INTO idemflow.dead_letters (pipeline, topic, partition, "offset", payload, reason, error, payload_digest)
           VALUES ('payments', 'orders', 0, 0, '{worse', 'decode_failed', 'at a reused position', sha256('{worse'))"#,
    )
    .execute(&db.pool)
    .await
    .unwrap();
    roll_back(&db, "postgres-0014.sql").await;
    roll_back(&db, "postgres-0013.sql").await;
    roll_back(&db, "postgres-0012.sql").await;
    roll_back(&db, "postgres-0011.sql").await;
    let rollback = std::fs::read_to_string(project_root().join("migrations/rollback/postgres-0010.sql")).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let e = sqlx::raw_sql(&rollback).execute(&mut *tx).await.unwrap_err();
    assert!(e.to_string().contains("more than one dead letter"), "{e}");
    drop(tx);
    sqlx::query("DELETE FROM idemflow.dead_letters WHERE payload = '{worse'").execute(&db.pool).await.unwrap();
    roll_back(&db, "postgres-0010.sql").await;
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("at version 9, this binary needs 14"), "{out}{err}");
}

/// Keys on both sides of the 64-byte limit, one cut inside a two-byte character, a number, and long ones that
/// share their first 31 bytes.
fn keys() -> Vec<String> {
    vec![
        "o-1".into(),
        "o-2".into(),
        "9007199254740993".into(),
        "ключ-🙂".into(),
        "k".repeat(64),
        "é".repeat(40),
        format!("{}-a", "p".repeat(100)),
        format!("{}-b", "p".repeat(100)),
        random_text(300, 7),
    ]
}

fn payload(key: &str) -> String {
    format!(r#"{{"order":{{"id":{},"amount":"1.00"}}}}"#, serde_json::to_string(key).unwrap())
}

fn sha256(bytes: &[u8]) -> Vec<u8> {
    Sha256::digest(bytes).to_vec()
}

/// Each dedup row's key text and id, since migration 12 (the text stored only where the id is not the text).
const SHOWN_KEYS: &str = "SELECT coalesce(key_text, convert_from(key_id, 'UTF8')), key_id FROM idemflow.dedup";

/// The claim of the version before migration 0007, as it shipped.
const PREVIOUS_POSTGRES_CLAIM: &str = r#"
INSERT INTO idemflow.dedup (pipeline, key_digest, business_key, topic, partition, "offset", fingerprint)
SELECT $1, u.key_digest, u.business_key, u.topic, u.partition, u."offset", u.fingerprint
FROM unnest($2::bytea[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::bytea[])
     AS u(key_digest, business_key, topic, partition, "offset", fingerprint)
ON CONFLICT (pipeline, key_digest) DO NOTHING
RETURNING key_digest"#;

/// A batch of the previous version claiming `keys` (pipeline `payments`, topic `orders`), on `conn`.
async fn previous_postgres_claim(conn: &mut sqlx::PgConnection, keys: &[String], first_offset: i64) -> Result<usize, sqlx::Error> {
    let n = keys.len();
    let digests: Vec<Vec<u8>> = keys.iter().map(|k| sha256(k.as_bytes())).collect();
    let prints: Vec<Vec<u8>> = keys.iter().map(|k| sha256(payload(k).as_bytes())).collect();
    let offsets: Vec<i64> = (first_offset..first_offset + n as i64).collect();
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(PREVIOUS_POSTGRES_CLAIM)
        .bind("payments")
        .bind(&digests)
        .bind(keys)
        .bind(vec!["orders"; n])
        .bind(vec![0i32; n])
        .bind(&offsets)
        .bind(&prints)
        .fetch_all(conn)
        .await?;
    Ok(rows.len())
}

/// `idemflow migrate` started while `held` (a batch's transaction with its claim made) is open: the migration must
/// wait for it, then finish once it commits.
async fn migrate_while_open(setup: &Setup, held: sqlx::Transaction<'_, sqlx::Postgres>) {
    let mut migrate = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["migrate", "--config", setup.config.to_str().unwrap()])
        .current_dir(setup.dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(migrate.try_wait().unwrap().is_none(), "the migration waits for the batch under way");
    held.commit().await.unwrap();
    let status = wait_child(&mut migrate, Duration::from_secs(60)).expect("idemflow migrate finishes once the batch ended");
    let out = migrate.wait_with_output().unwrap();
    assert!(status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// Runs `migrations/rollback/<script>` in one transaction, as docs/operations.md says.
async fn roll_back(db: &TestDb, script: &str) {
    let rollback = std::fs::read_to_string(project_root().join("migrations/rollback").join(script)).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::raw_sql(&rollback).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
}

const PIPELINE: &str = r#"topics = ["orders"]
[key]
field = "/order/id"
[sink]
table = "payments"
[sink.columns]
order_id = "/order/id"
amount = "/order/amount"
"#;

/// The business table [`PIPELINE`] inserts into.
const PAYMENTS: &str = "CREATE TABLE payments (order_id text PRIMARY KEY, amount numeric NOT NULL);";

/// A mock cluster with topic `orders`, and the settings of [`PIPELINE`] on `db`, with their file's path.
fn on_orders(db: &TestDb) -> (Kafka, Setup, String) {
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let setup = Setup::new(db, &kafka, &[("payments.toml", PIPELINE)]);
    let config = setup.config.to_str().unwrap().to_owned();
    (kafka, setup, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upgrade_keeps_every_stored_key_a_duplicate_and_fences_the_previous_version() {
    let db = TestDb::at_version(6, PAYMENTS).await;
    let (kafka, setup, config) = on_orders(&db);
    let keys = keys();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(previous_postgres_claim(&mut conn, &keys, 0).await.unwrap(), keys.len());
    drop(conn);

    // This version refuses the old schema.
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("this binary needs 14"), "{out}{err}");

    // A batch of the previous version is under way (its claim made, not committed) when the migration starts.
    let mut held = db.pool.begin().await.unwrap();
    let held_key = vec!["o-held".to_owned()];
    assert_eq!(previous_postgres_claim(&mut held, &held_key, 100).await.unwrap(), 1);
    migrate_while_open(&setup, held).await;

    // Every stored row, the held batch's too, is at the id this version computes for its key.
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(SHOWN_KEYS).fetch_all(&db.pool).await.unwrap();
    assert_key_ids(&rows, keys.len() + 1);

    // The previous version's claim fails now, before it could claim anything.
    let mut conn = db.pool.acquire().await.unwrap();
    let e = previous_postgres_claim(&mut conn, &["o-late".to_owned()], 200).await.unwrap_err();
    assert_eq!(e.as_database_error().and_then(|d| d.code()).as_deref(), Some("42703"), "{e}");
    drop(conn);

    // The same keys delivered to this version are duplicates, classified against the stored rows; only the new key
    // is applied.
    let mut records: Vec<Out> = keys.iter().chain(&held_key).map(|k| Out::json(0, payload(k))).collect();
    records.push(Out::json(0, payload("o-new")));
    kafka.produce("orders", &records);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", records.len() as u64).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
    let skipped = |reason| worker.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    // Stored at the positions they are delivered at again: redelivered; the held batch's key was stored at offset
    // 100 and is at another offset now: republished.
    assert_eq!(skipped("redelivered"), keys.len() as f64);
    assert_eq!(skipped("republished"), 1.0);
    assert_eq!(skipped("payload_mismatch"), 0.0);
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',') FROM payments").await, "o-new");
    assert_eq!(db.scalar::<i64>("SELECT sum(duplicates)::int8 FROM idemflow.dedup_duplicates").await, (keys.len() + 1) as i64);

    // `explain` finds a long key by its text.
    let long = &keys[keys.len() - 1];
    let (status, out, err) = idemflow(&["explain", "--config", &config, "--pipeline", "payments", &format!("--key={long}")], setup.dir.path());
    assert!(status.success() && out.contains("duplicates skipped 1 since"), "{out}{err}");

    // Going back (docs/operations.md): the rollback scripts, the last migration's first, then the previous version's
    // claim works again and finds every key applied before and after the upgrade; this version refuses the schema.
    for script in ["postgres-0014.sql", "postgres-0013.sql", "postgres-0012.sql", "postgres-0011.sql", "postgres-0010.sql", "postgres-0009.sql", "postgres-0008.sql", "postgres-0007.sql"] {
        roll_back(&db, script).await;
    }
    let mut conn = db.pool.acquire().await.unwrap();
    let again: Vec<String> = keys.iter().chain(&held_key).cloned().chain(["o-new".to_owned(), "o-rolled-back".to_owned()]).collect();
    assert_eq!(previous_postgres_claim(&mut conn, &again, 300).await.unwrap(), 1, "only o-rolled-back is new");
    drop(conn);
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("this binary needs 14"), "{out}{err}");
}

/// The claim of the versions from migration 0007 to 0011, as it shipped (key ids, `src/key.rs`; the key text in every
/// row, the payload's whole SHA-256).
const V7_POSTGRES_CLAIM: &str = r#"
INSERT INTO idemflow.dedup (pipeline, key_id, business_key, topic, partition, "offset", fingerprint)
SELECT $1, u.key_id, u.business_key, u.topic, u.partition, u."offset", u.fingerprint
FROM unnest($2::bytea[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::bytea[])
     AS u(key_id, business_key, topic, partition, "offset", fingerprint)
ON CONFLICT (pipeline, key_id) DO NOTHING
RETURNING key_id"#;

/// A batch of a version before migration 8 claiming `keys` (pipeline `payments`, topic `orders`), on `conn`.
async fn v7_postgres_claim(conn: &mut sqlx::PgConnection, keys: &[String], first_offset: i64) -> Result<usize, sqlx::Error> {
    let n = keys.len();
    let ids: Vec<Vec<u8>> = keys.iter().map(|k| BusinessKey::new(k.clone()).key_id().into_owned()).collect();
    let prints: Vec<Vec<u8>> = keys.iter().map(|k| sha256(payload(k).as_bytes())).collect();
    let offsets: Vec<i64> = (first_offset..first_offset + n as i64).collect();
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(V7_POSTGRES_CLAIM)
        .bind("payments")
        .bind(&ids)
        .bind(keys)
        .bind(vec!["orders"; n])
        .bind(vec![0i32; n])
        .bind(&offsets)
        .bind(&prints)
        .fetch_all(conn)
        .await?;
    Ok(rows.len())
}

/// Migration 8 (the dedup store's `pipeline` compared bytewise, `COLLATE "C"`): it waits for a batch under way, keeps
/// every stored key a duplicate, and the claim of the version before it goes on working on the migrated table (no
/// fence is needed: equality is the same); its rollback puts the database's collation back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migration_8_compares_pipelines_bytewise_and_keeps_every_key() {
    let db = TestDb::at_version(7, PAYMENTS).await;
    let (kafka, setup, config) = on_orders(&db);
    let collation = "SELECT coalesce(collation_name, 'default') FROM information_schema.columns \
                     WHERE table_schema = 'idemflow' AND table_name = 'dedup' AND column_name = 'pipeline'";
    assert_eq!(db.scalar::<String>(collation).await, "default");
    let keys = keys();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(v7_postgres_claim(&mut conn, &keys, 0).await.unwrap(), keys.len());
    drop(conn);
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("at version 7, this binary needs 14"), "{out}{err}");

    let mut held = db.pool.begin().await.unwrap();
    let held_key = vec!["o-held".to_owned()];
    assert_eq!(v7_postgres_claim(&mut held, &held_key, 100).await.unwrap(), 1);
    // Up to migration 11, the last that keeps the v7 claim's columns (12 fences it).
    let up_to_11 = migrator_up_to("migrations/postgres", 11).await;
    let migrating = {
        let pool = db.pool.clone();
        tokio::spawn(async move { up_to_11.run(&pool).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!migrating.is_finished(), "the migration waits for the batch under way");
    held.commit().await.unwrap();
    migrating.await.unwrap().unwrap();
    assert_eq!(db.scalar::<String>(collation).await, "C");
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as("SELECT business_key, key_id FROM idemflow.dedup").fetch_all(&db.pool).await.unwrap();
    assert_key_ids(&rows, keys.len() + 1);

    // A worker of the version before, still running in a rolling upgrade: its claim finds every stored key and
    // claims a new one, once.
    let mut conn = db.pool.acquire().await.unwrap();
    let mixed: Vec<String> = keys.iter().cloned().chain(["o-v7-late".to_owned()]).collect();
    assert_eq!(v7_postgres_claim(&mut conn, &mixed, 0).await.unwrap(), 1, "only o-v7-late is new");
    drop(conn);
    idemflow::store::postgres::MIGRATOR.run(&db.pool).await.unwrap();

    // This version: the stored keys are duplicates, only the new key is applied.
    let mut records: Vec<Out> = keys.iter().chain(&held_key).map(|k| Out::json(0, payload(k))).collect();
    records.push(Out::json(0, payload("o-v7-late")));
    records.push(Out::json(0, payload("o-new")));
    kafka.produce("orders", &records);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", records.len() as u64).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',') FROM payments").await, "o-new");

    roll_back(&db, "postgres-0014.sql").await;
    roll_back(&db, "postgres-0013.sql").await;

    roll_back(&db, "postgres-0012.sql").await;
    roll_back(&db, "postgres-0011.sql").await;
    roll_back(&db, "postgres-0010.sql").await;
    roll_back(&db, "postgres-0009.sql").await;
    roll_back(&db, "postgres-0008.sql").await;
    assert_eq!(db.scalar::<String>(collation).await, "default");
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(v7_postgres_claim(&mut conn, &["o-new".to_owned(), "o-rolled-back".to_owned()], 300).await.unwrap(), 1);
    drop(conn);
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("at version 7, this binary needs 14"), "{out}{err}");
}

/// Migration 12 (the narrower dedup row): a database written by the previous version (every key's text, 32-byte
/// fingerprints, duplicate counts in the row), a batch of that version under way while `idemflow migrate` runs. After
/// it: every row at its key id with its text kept only where the id is not the text, the fingerprints cut to 16
/// bytes, the counts in `dedup_duplicates`; the previous version's claim fails (fenced); the stored keys are
/// duplicates to this version, classified against the migrated rows (redelivered, republished, payload_mismatch);
/// `explain` adds to the counts carried over. The rollback puts the previous shape back with every key and count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migration_12_narrows_the_dedup_row_keeps_every_key_and_fences_the_previous_version() {
    let db = TestDb::at_version(11, PAYMENTS).await;
    let (kafka, setup, config) = on_orders(&db);
    let keys = keys();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(v7_postgres_claim(&mut conn, &keys, 0).await.unwrap(), keys.len());
    drop(conn);
    sqlx::query("UPDATE idemflow.dedup SET duplicates = 2, last_duplicate_at = now() WHERE business_key = 'o-1'").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("at version 11, this binary needs 14"), "{out}{err}");

    let mut held = db.pool.begin().await.unwrap();
    let held_key = vec!["o-held".to_owned()];
    assert_eq!(v7_postgres_claim(&mut held, &held_key, 100).await.unwrap(), 1);
    migrate_while_open(&setup, held).await;

    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(SHOWN_KEYS).fetch_all(&db.pool).await.unwrap();
    assert_key_ids(&rows, keys.len() + 1);
    let long = keys.iter().filter(|k| k.len() > 64).count() as i64;
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE key_text IS NOT NULL").await, long, "only the long keys' texts");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE octet_length(fingerprint) = 16").await, keys.len() as i64 + 1);
    assert_eq!(db.scalar::<String>("SELECT encode(fingerprint, 'hex') FROM idemflow.dedup WHERE key_id = 'o-1'").await, hex::encode(&sha256(payload("o-1").as_bytes())[..16]));
    assert_eq!(db.scalar::<i64>("SELECT sum(duplicates)::int8 FROM idemflow.dedup_duplicates").await, 2);

    // The previous version's claim fails now, before it could claim anything.
    let mut conn = db.pool.acquire().await.unwrap();
    let e = v7_postgres_claim(&mut conn, &["o-late".to_owned()], 200).await.unwrap_err();
    assert_eq!(e.as_database_error().and_then(|d| d.code()).as_deref(), Some("42703"), "{e}");
    drop(conn);

    // This version: the stored keys at their stored positions are redelivered, the held key at another position
    // republished (its 16-byte fingerprint matches the payload's SHA-256), o-1 with another payload a mismatch; only
    // the new key is applied.
    let mut records: Vec<Out> = keys.iter().chain(&held_key).map(|k| Out::json(0, payload(k))).collect();
    records.push(Out::json(0, r#"{"order":{"id":"o-1","amount":"9.99"}}"#));
    records.push(Out::json(0, payload("o-new")));
    kafka.produce("orders", &records);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", records.len() as u64).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
    let skipped = |reason| worker.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!((skipped("redelivered"), skipped("republished"), skipped("payload_mismatch")), (keys.len() as f64, 1.0, 1.0));
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',') FROM payments").await, "o-new");
    assert_eq!(db.scalar::<Option<String>>("SELECT key_text FROM idemflow.dedup WHERE key_id = 'o-new'").await, None);

    // `explain`: the count carried over plus this run's two; a long key found by its text.
    let (status, out, err) = idemflow(&["explain", "--config", &config, "--pipeline", "payments", "--key", "o-1"], setup.dir.path());
    assert!(status.success() && out.contains("duplicates skipped 4 since") && out.contains("(its first 16 bytes)"), "{out}{err}");
    let long_key = &keys[keys.len() - 1];
    let (status, out, err) = idemflow(&["explain", "--config", &config, "--pipeline", "payments", &format!("--key={long_key}")], setup.dir.path());
    assert!(status.success() && out.contains("duplicates skipped 1 since"), "{out}{err}");

    // Going back: the previous shape with every key's text and count; its claim finds every key and claims a new one.
    roll_back(&db, "postgres-0014.sql").await;
    roll_back(&db, "postgres-0013.sql").await;
    roll_back(&db, "postgres-0012.sql").await;
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as("SELECT business_key, key_id FROM idemflow.dedup").fetch_all(&db.pool).await.unwrap();
    assert_key_ids(&rows, keys.len() + 2);
    assert_eq!(db.scalar::<i64>("SELECT duplicates FROM idemflow.dedup WHERE key_id = 'o-1'").await, 4);
    assert_eq!(db.scalar::<i64>("SELECT sum(duplicates)::int8 FROM idemflow.dedup").await, 2 + keys.len() as i64 + 2);
    let mut conn = db.pool.acquire().await.unwrap();
    let again: Vec<String> = keys.iter().chain(&held_key).cloned().chain(["o-new".to_owned(), "o-rolled-back".to_owned()]).collect();
    assert_eq!(v7_postgres_claim(&mut conn, &again, 300).await.unwrap(), 1, "only o-rolled-back is new");
    drop(conn);
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("at version 11, this binary needs 14"), "{out}{err}");
}

/// Migration 12 in a database whose encoding is not UTF8 (LATIN1): every key keeps its text, before and after the
/// upgrade, so reading one back never converts; a key the encoding cannot hold fails its record (SQLSTATE 22P05) as
/// it did before, dead-lettered, instead of being claimed with a text no one can read back. What a copy would not
/// carry over (a trigger of the user's) stops the migration with nothing changed; the table's owner and grants are
/// carried over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migration_12_in_a_latin1_database_keeps_every_key_text_and_the_tables_owner() {
    let db = TestDb::in_encoding("LATIN1", 11, PAYMENTS).await;
    let (kafka, setup, config) = on_orders(&db);
    let keys: Vec<String> = vec!["o-1".into(), "café".into(), format!("{}-long", "é".repeat(40))];
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(v7_postgres_claim(&mut conn, &keys, 0).await.unwrap(), keys.len());
    drop(conn);
    // The table belongs to another role than the one migrating, which granted SELECT to a third.
    let (owner, reader) = (format!("owner_{}", unique()), format!("reader_{}", unique()));
    for role in [&owner, &reader] {
        sqlx::raw_sql(&format!("CREATE ROLE {role}")).execute(&db.pool).await.unwrap();
    }
    sqlx::raw_sql(&format!("ALTER TABLE idemflow.dedup OWNER TO {owner}; GRANT SELECT ON idemflow.dedup TO {reader}")).execute(&db.pool).await.unwrap();

    // A trigger of the user's on the table: the migration stops, nothing changed.
    sqlx::raw_sql(
        "CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$; \
         CREATE TRIGGER audit_dedup AFTER INSERT ON idemflow.dedup FOR EACH ROW EXECUTE FUNCTION audit()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (status, out, err) = idemflow(&["migrate", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("would not carry over: trigger audit_dedup"), "{out}{err}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE business_key IS NOT NULL").await, 3, "nothing changed");
    sqlx::raw_sql("DROP TRIGGER audit_dedup ON idemflow.dedup").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["migrate", "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");

    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE key_text IS NULL").await, 0, "every key keeps its text");
    let owned = "SELECT string_agg(relname || ':' || pg_get_userbyid(relowner), ',' ORDER BY relname) FROM pg_class \
                 WHERE relnamespace = 'idemflow'::regnamespace AND relname IN ('dedup', 'dedup_duplicates')";
    assert_eq!(db.scalar::<String>(owned).await, format!("dedup:{owner},dedup_duplicates:{owner}"));
    assert!(db.scalar::<bool>(&format!("SELECT has_table_privilege('{reader}', 'idemflow.dedup', 'SELECT')")).await);

    let euro = "€-1".to_owned();
    let mut records: Vec<Out> = keys.iter().map(|k| Out::json(0, payload(k))).collect();
    records.push(Out::json(0, payload("o-new")));
    records.push(Out::json(0, payload(&euro)));
    kafka.produce("orders", &records);
    let worker = InProc::start(&setup).await;
    worker.wait_received("payments", records.len() as u64).await;
    assert_eq!(worker.metric("idemflow_records_applied_total", &[("pipeline", "payments")]), 1.0);
    assert_eq!(worker.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "redelivered")]), 3.0);
    assert!(worker.stop().await.is_empty());
    assert_eq!(db.scalar::<String>("SELECT key_text FROM idemflow.dedup WHERE key_id = 'o-new'").await, "o-new");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 1, "the key LATIN1 cannot hold");
    let (status, out, err) = idemflow(&["explain", "--config", &config, "--pipeline", "payments", "--key", "café"], setup.dir.path());
    assert!(status.success() && out.contains("duplicates skipped 1 since"), "{out}{err}");

    roll_back(&db, "postgres-0014.sql").await;
    roll_back(&db, "postgres-0013.sql").await;

    roll_back(&db, "postgres-0012.sql").await;
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as("SELECT business_key, key_id FROM idemflow.dedup").fetch_all(&db.pool).await.unwrap();
    assert_key_ids(&rows, keys.len() + 1);
    assert_eq!(db.scalar::<String>("SELECT pg_get_userbyid(relowner)::text FROM pg_class WHERE oid = 'idemflow.dedup'::regclass").await, owner);
}

/// The MariaDB claim of the version before migration 0002 (its `INSERT IGNORE ... RETURNING` form), as it shipped.
async fn previous_mysql_claim(conn: &mut sqlx::MySqlConnection, keys: &[String], first_offset: i64) -> Result<usize, sqlx::Error> {
    let marks = vec!["(?, ?, ?, ?, ?, ?, ?)"; keys.len()].join(", ");
    let sql = format!(
        "INSERT IGNORE INTO idemflow_dedup (pipeline, key_digest, business_key, topic, `partition`, `offset`, fingerprint) \
         VALUES {marks} RETURNING key_digest"
    );
    let mut q = sqlx::query_scalar::<_, Vec<u8>>(&sql);
    for (i, k) in keys.iter().enumerate() {
        q = q
            .bind("payments")
            .bind(sha256(k.as_bytes()))
            .bind(k.as_str())
            .bind("orders")
            .bind(0i32)
            .bind(first_offset + i as i64)
            .bind(sha256(payload(k).as_bytes()));
    }
    Ok(q.fetch_all(conn).await?.len())
}

#[tokio::test(flavor = "multi_thread")]
async fn mariadb_upgrade_keeps_every_stored_key_a_duplicate_and_fences_the_previous_version() {
    let sql = std::fs::read_to_string(project_root().join("examples/mysql/payments.sql")).unwrap();
    let db = MyDb::at_version(1, &sql).await;
    let keys = keys();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(previous_mysql_claim(&mut conn, &keys, 0).await.unwrap(), keys.len());
    drop(conn);
    let err = idemflow::store::mysql::check_schema(&db.pool).await.unwrap_err();
    assert!(matches!(&err, idemflow::store::contract::NotReady::Refused(m) if m.contains("this binary needs 7")), "{err}");

    // A batch of the previous version under way when the migration starts: the migration waits for it.
    let mut held = db.pool.begin().await.unwrap();
    let held_key = vec!["o-held".to_owned()];
    assert_eq!(previous_mysql_claim(&mut held, &held_key, 100).await.unwrap(), 1);
    let pool = db.pool.clone();
    let migrate = tokio::spawn(async move { idemflow::store::mysql::MIGRATOR.run(&pool).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!migrate.is_finished(), "the migration waits for the previous version's batch");
    held.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), migrate).await.expect("the migration ends").unwrap().unwrap();
    idemflow::store::mysql::check_schema(&db.pool).await.unwrap();

    let rows: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT CAST(business_key AS CHAR), key_id FROM idemflow_dedup").fetch_all(&db.pool).await.unwrap();
    assert_key_ids(&rows, keys.len() + 1);

    // The previous version's claim fails now (unknown column).
    let mut conn = db.pool.acquire().await.unwrap();
    let e = previous_mysql_claim(&mut conn, &["o-late".to_owned()], 200).await.unwrap_err();
    assert_eq!(e.as_database_error().and_then(|d| d.code()).as_deref(), Some("42S22"), "{e}");
    drop(conn);

    // Migration 5: retention sweeps the primary key; the (pipeline, applied_at) index is gone.
    let retention_index = "SELECT COUNT(DISTINCT index_name) FROM information_schema.statistics WHERE table_schema = DATABASE() \
                           AND table_name = 'idemflow_dedup' AND index_name = 'dedup_pipeline_applied_at'";
    assert_eq!(db.scalar::<i64>(retention_index).await, 0);

    // This version's claim of the same keys and a new one: only the new one is claimed, the others are found.
    let store = idemflow::store::Store::MySql(idemflow::store::mysql::MySqlStore::new(db.pool.clone()));
    let effect = crate::mariadb::example_side_effect(&store).await;
    let mut all: Vec<BusinessKey> = keys.iter().chain(&held_key).map(|k| BusinessKey::new(k.clone())).collect();
    all.push(BusinessKey::new("o-new".into()));
    let position = idemflow::record::Position { topic: "orders".into(), partition: 0, offset: 500 };
    let claims: Vec<idemflow::store::rows::Claim<'_>> =
        all.iter().map(|k| idemflow::store::rows::Claim { key: k, position: &position, fingerprint: &[7; 32] }).collect();
    let mut tx = effect.begin().await.unwrap();
    let new = tx.claim("payments", &claims).await.unwrap();
    assert_eq!(new.len(), 1);
    assert!(new.contains(&all[all.len() - 1].digest));
    let old: Vec<&BusinessKey> = all[..all.len() - 1].iter().collect();
    let found = tx.existing("payments", &old).await.unwrap();
    assert_eq!(found.len(), old.len());
    tx.rollback().await.unwrap();

    // A migration recorded as incomplete (it stopped between its statements) keeps this version's workers out.
    db.exec("UPDATE _sqlx_migrations SET success = FALSE WHERE version = 7").await;
    let err = idemflow::store::mysql::check_schema(&db.pool).await.unwrap_err();
    assert!(matches!(&err, idemflow::store::contract::NotReady::Refused(m) if m.contains("this binary needs 7")), "{err}");

    // Going back (docs/operations.md): the rollback script, then the previous version's claim finds every key
    // again (o-new was only claimed in a transaction rolled back above).
    for script in ["mysql-0007.sql", "mysql-0006.sql", "mysql-0005.sql", "mysql-0004.sql", "mysql-0003.sql", "mysql-0002.sql"] {
        db.exec(&std::fs::read_to_string(project_root().join("migrations/rollback").join(script)).unwrap()).await;
        if script == "mysql-0005.sql" {
            assert_eq!(db.scalar::<i64>(retention_index).await, 1, "the rollback builds the index again");
        }
    }
    let mut conn = db.pool.acquire().await.unwrap();
    let again: Vec<String> = keys.iter().chain(&held_key).cloned().chain(["o-new".to_owned(), "o-rolled-back".to_owned()]).collect();
    assert_eq!(previous_mysql_claim(&mut conn, &again, 300).await.unwrap(), 2, "only o-new and o-rolled-back are new");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upgrade_stops_with_nothing_changed_when_a_key_text_is_not_what_was_hashed() {
    let db = TestDb::at_version(6, "").await;
    let mut conn = db.pool.acquire().await.unwrap();
    previous_postgres_claim(&mut conn, &["o-1".to_owned(), "o-2".to_owned()], 0).await.unwrap();
    drop(conn);
    // Edited by hand: no longer the text its digest was made of.
    sqlx::query("UPDATE idemflow.dedup SET business_key = 'o-edited' WHERE business_key = 'o-2'").execute(&db.pool).await.unwrap();
    // Both runs on one session, as `idemflow migrate` runs (a process of its own): sqlx's migrator takes a
    // session-level advisory lock and does not release it when a migration fails, so a second run from another
    // pooled connection would wait for it for ever (this test hung once so, waiting in pg_advisory_lock).
    let mut session = db.pool.acquire().await.unwrap();
    let e = idemflow::store::postgres::MIGRATOR.run(&mut *session).await.unwrap_err().to_string();
    assert!(e.contains("1 dedup rows hold a key text that is not what their digest was made of (for example 'o-edited'"), "{e}");
    assert_eq!(db.scalar::<i64>("SELECT max(version) FROM _sqlx_migrations").await, 6);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup WHERE key_digest = sha256('o-1'::bytea)").await, 1);
    // Given up (as docs/operations.md says), the rest migrates.
    sqlx::query("DELETE FROM idemflow.dedup WHERE key_digest <> sha256(convert_to(business_key, 'UTF8'))").execute(&db.pool).await.unwrap();
    idemflow::store::postgres::MIGRATOR.run(&mut *session).await.unwrap();
    drop(session);
    assert_eq!(db.scalar::<Vec<u8>>("SELECT key_id FROM idemflow.dedup").await, b"o-1");
}

#[tokio::test(flavor = "multi_thread")]
async fn mariadb_upgrade_stops_with_nothing_changed_when_a_key_text_is_not_what_was_hashed() {
    let db = MyDb::at_version(1, "").await;
    let mut conn = db.pool.acquire().await.unwrap();
    previous_mysql_claim(&mut conn, &["o-1".to_owned(), "o-2".to_owned()], 0).await.unwrap();
    drop(conn);
    db.exec("UPDATE idemflow_dedup SET business_key = 'o-edited' WHERE business_key = 'o-2'").await;
    // One session for both runs, as in the PostgreSQL test above (sqlx keeps its migration lock, GET_LOCK, after a
    // failed migration).
    let mut session = db.pool.acquire().await.unwrap();
    let e = idemflow::store::mysql::MIGRATOR.run(&mut *session).await.unwrap_err().to_string();
    assert!(e.contains("every_key_text_is_what_its_digest_was_made_of"), "{e}");
    // Not recorded, not even as partially applied: `idemflow migrate` can simply run again.
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM _sqlx_migrations WHERE version = 2").await, 0);
    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup WHERE key_digest = UNHEX(SHA2('o-1', 256))").await, 1);
    db.exec("DELETE FROM idemflow_dedup WHERE key_digest <> UNHEX(SHA2(business_key, 256))").await;
    idemflow::store::mysql::MIGRATOR.run(&mut *session).await.unwrap();
    drop(session);
    assert_eq!(db.scalar::<Vec<u8>>("SELECT key_id FROM idemflow_dedup").await, b"o-1");
    idemflow::store::mysql::check_schema(&db.pool).await.unwrap();
}
