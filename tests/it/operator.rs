//! The operator's tools, as an operator runs them.

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_tells_when_and_from_where_a_key_was_applied_and_its_duplicates() {
    let p = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = \"/id\"\n";
    let (_db, kafka, setup) = fixture("CREATE TABLE seen (k text);", "orders", 1, &[("orders.toml", p)]).await;
    kafka.produce(
        "orders",
        &[
            Out::json(0, r#"{"id":"o-1"}"#),
            Out::json(0, r#"{"id":"o-2"}"#),
            Out::json(0, r#"{"id":"o-1"}"#),
            Out::json(0, r#"{"id":"o-1", "v": 2}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 4).await;
    assert!(w.stop().await.is_empty());
    let cfg = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-1"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("from               orders/0@0"), "{out}");
    assert!(out.contains("duplicates skipped 2 since"), "{out}");
    // PostgreSQL keeps the first 16 bytes of the payload's SHA-256 (migration 12).
    let line = out.lines().find(|l| l.contains("payload sha256")).unwrap();
    let digest = line.split_whitespace().nth(2).unwrap();
    let applied = <sha2::Sha256 as sha2::Digest>::digest(br#"{"id":"o-1"}"#);
    assert_eq!(digest, hex::encode(&applied[..16]), "{out}");
    assert!(line.ends_with("(its first 16 bytes)"), "{out}");
    let (_, out, _) = idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-2"], setup.dir.path());
    assert!(out.contains("from               orders/0@1") && out.contains("duplicates skipped 0 since"), "{out}");
    let (status, out, _) = idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-9"], setup.dir.path());
    assert!(status.success() && out.contains("not in the dedup store"), "{out}");
    let (status, _, err) = idemflow(&["explain", "--config", cfg, "--pipeline", "nope", "--key", "o-1"], setup.dir.path());
    assert!(!status.success() && err.contains("no pipeline named \"nope\""), "{err}");
}

/// A duplicate count left by an earlier row of the key (purged by retention while a batch was counting on it, then
/// the key claimed again) is not the new row's: `explain` does not show it, and the next duplicate starts it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_left_by_an_earlier_row_of_the_key_is_not_shown_and_starts_over() {
    let p = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = \"/id\"\n";
    let (db, kafka, setup) = fixture("CREATE TABLE seen (k text);", "orders", 1, &[("orders.toml", p)]).await;
    kafka.produce("orders", &[Out::json(0, r#"{"id":"o-1"}"#)]);
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 1).await;
    assert!(w.stop().await.is_empty());
    sqlx::query("INSERT INTO idemflow.dedup_duplicates VALUES ('orders', 'o-1', now() - interval '30 days', 5, now() - interval '29 days')")
        .execute(&db.pool)
        .await
        .unwrap();
    let cfg = setup.config.to_str().unwrap();
    let explain = || idemflow(&["explain", "--config", cfg, "--pipeline", "orders", "--key", "o-1"], setup.dir.path());
    let (status, out, err) = explain();
    assert!(status.success() && out.contains("duplicates skipped 0 since"), "{out}{err}");
    kafka.produce("orders", &[Out::json(0, r#"{"id":"o-1"}"#)]);
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 1).await;
    assert!(w.stop().await.is_empty());
    let (_, out, _) = explain();
    assert!(out.contains("duplicates skipped 1 since"), "{out}");
    assert_eq!(db.scalar::<i64>("SELECT duplicates FROM idemflow.dedup_duplicates").await, 1);
}

/// `dedup forget` on PostgreSQL: by key and by offsets, a dry run first; the rows go with their duplicate counts
/// (a long key found by its text, its key text read back), and the processed floor is lowered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_forget_takes_the_rows_with_their_counts_and_lowers_the_floor() {
    let p = "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"seen\"\n[sink.columns]\nk = \"/id\"\n";
    let (db, kafka, setup) = fixture("CREATE TABLE seen (k text);", "orders", 1, &[("orders.toml", p)]).await;
    let long = format!("o-{}", "x".repeat(100));
    let json = |id: &str| Out::json(0, format!(r#"{{"id":{}}}"#, serde_json::to_string(id).unwrap()));
    kafka.produce("orders", &[json("o-1"), json(&long), json("o-3"), json("o-1"), json(&long)]);
    let w = InProc::start(&setup).await;
    w.wait_received("orders", 5).await;
    assert!(w.stop().await.is_empty());
    assert_eq!(db.scalar::<i64>("SELECT sum(duplicates)::int8 FROM idemflow.dedup_duplicates").await, 2);
    sqlx::query("UPDATE idemflow.attempts SET updated_at = now() - interval '2 minutes'").execute(&db.pool).await.unwrap();
    let cfg = setup.config.to_str().unwrap();
    let forget = |extra: &[&str]| {
        let mut args = vec!["dedup", "forget", "--config", cfg, "--pipeline", "orders"];
        args.extend_from_slice(extra);
        idemflow(&args, setup.dir.path())
    };
    let long_arg = format!("--key={long}");
    let (status, out, err) = forget(&["--key", "o-1", &long_arg, "--dry-run"]);
    assert!(status.success() && out.contains("would forget 2 dedup row(s)") && out.contains(&format!("{long:?} applied at")), "{out}{err}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup_duplicates").await, 2, "a dry run changes nothing");
    let (status, out, err) = forget(&["--key", "o-1", &long_arg]);
    assert!(status.success() && out.contains("forgot 2 dedup row(s)"), "{out}{err}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, 1);
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup_duplicates").await, 0, "the counts went with their rows");
    let (status, out, err) = forget(&["--topic", "orders", "--partition", "0", "--offsets", "2-2", "--dry-run"]);
    assert!(status.success() && out.contains("would forget 1 dedup row(s)") && out.contains("\"o-3\" applied at") && out.contains("from orders/0@2"), "{out}{err}");
    // The floor was lowered to the lowest offset forgotten (o-1's, 0): the records from there may be consumed
    // again (after a rewind) without being skipped as processed.
    assert_eq!(db.scalar::<Option<i64>>("SELECT resume_from FROM idemflow.processed WHERE pipeline = 'orders'").await, Some(0));
    assert_eq!(db.scalar::<String>("SELECT string_agg(convert_from(key_id, 'UTF8'), ',') FROM idemflow.dedup").await, "o-3");
    let (status, out, err) = forget(&["--key", "o-9"]);
    assert!(status.success() && out.contains("forgot 0 dedup row(s)") && out.contains("\"o-9\": not in the dedup store"), "{out}{err}");
}

/// A payment for an unknown account is dead-lettered (foreign key); the operator lists and shows it, fixes the
/// cause (creates the account), and replays it: applied once, its dead-letter row removed in the same transaction.
/// A bad payload replayed with a fixed one is applied too; replaying something still broken keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_show_and_replay() {
    let tables = std::fs::read_to_string(project_root().join("pipelines/payments.sql")).unwrap()
        + "INSERT INTO accounts VALUES ('ACC-1', 100);";
    let shipped = std::fs::read_to_string(project_root().join("pipelines/payments.toml")).unwrap();
    let (db, kafka, setup) = fixture(&tables, "payments", 1, &[("payments.toml", &shipped)]).await;
    kafka.produce(
        "payments",
        &[
            Out { partition: 0, key: Some(b"k-1".to_vec()), headers: vec![("trace".into(), b"t-1".to_vec())],
                  value: Some(br#"{"order":{"id":"o-1","account":"ACC-2","amount":"10.00"}}"#.to_vec()), ..Out::default() },
            Out::json(0, "{not json"),
            Out::json(0, r#"{"order":{"id":"o-3","account":"ACC-1","amount":"1.00"}}"#),
        ],
    );
    let w = InProc::start(&setup).await;
    w.wait_received("payments", 3).await;
    assert!(w.stop().await.is_empty());
    let cfg = setup.config.to_str().unwrap();
    let cwd = setup.dir.path();

    let (status, out, err) = idemflow(&["dead-letters", "list", "--config", cfg], cwd);
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("payments/0@0") && out.contains("side_effect_rejected") && out.contains("decode_failed"), "{out}");
    assert!(out.contains("2 dead letter(s)"), "{out}");
    // `dead-letters list | head`: what reads the output goes away before the command writes; it ends quietly, by
    // SIGPIPE as Unix tools do, never with a panic and a backtrace (issue 61, item 5).
    let mut listing = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["dead-letters", "list", "--config", cfg])
        .current_dir(cwd)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(listing.stdout.take());
    let ended = listing.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&ended.stderr);
    use std::os::unix::process::ExitStatusExt;
    assert!(!err.contains("panicked") && (ended.status.signal() == Some(libc::SIGPIPE) || ended.status.success()), "{:?}: {err}", ended.status);
    let fk_id: i64 = db.scalar("SELECT id FROM idemflow.dead_letters WHERE \"offset\" = 0").await;
    let bad_id: i64 = db.scalar("SELECT id FROM idemflow.dead_letters WHERE \"offset\" = 1").await;

    let (status, out, _) = idemflow(&["dead-letters", "show", "--config", cfg, &fk_id.to_string()], cwd);
    assert!(status.success());
    assert!(out.contains("SQLSTATE 23503") && out.contains("key         k-1") && out.contains("header      trace: t-1"), "{out}");
    assert!(out.contains(r#""account":"ACC-2""#), "{out}");

    // Replaying before the fix fails again and keeps the dead letter.
    let (status, out, _) = idemflow(&["dead-letters", "replay", "--config", cfg, &fk_id.to_string()], cwd);
    assert!(!status.success() && out.contains("failed again"), "{out}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters WHERE \"offset\" = 0").await, 1);
    let new_id: i64 = db.scalar("SELECT id FROM idemflow.dead_letters WHERE \"offset\" = 0").await;
    assert!(out.contains(&format!("kept as dead letter {new_id} (it replaces {fk_id}")), "the new id is named: {out}");
    let fk_id = new_id;

    // Fix the cause, replay: applied once, row gone.
    sqlx::query("INSERT INTO accounts VALUES ('ACC-2', 50)").execute(&db.pool).await.unwrap();
    let (status, out, err) = idemflow(&["dead-letters", "replay", "--config", cfg, &fk_id.to_string()], cwd);
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("applied"), "{out}");
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts WHERE account_id = 'ACC-2'").await, "40.00");
    let (_, out, _) = idemflow(&["dead-letters", "replay", "--config", cfg, &fk_id.to_string()], cwd);
    assert!(out.is_empty() || !out.contains("applied"), "the row is gone: {out}");
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts WHERE account_id = 'ACC-2'").await, "40.00");

    // A broken payload replayed with a fixed one.
    let fixed = cwd.join("fixed.json");
    std::fs::write(&fixed, r#"{"order":{"id":"o-2","account":"ACC-1","amount":"2.00"}}"#).unwrap();
    let (status, out, err) = idemflow(&["dead-letters", "replay", "--config", cfg, &bad_id.to_string(), "--payload", fixed.to_str().unwrap()], cwd);
    assert!(status.success(), "{out}{err}");
    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, 0);
    assert_eq!(db.scalar::<String>("SELECT string_agg(order_id, ',' ORDER BY order_id) FROM payments").await, "o-1,o-2,o-3");
    assert_eq!(db.scalar::<String>("SELECT balance::text FROM accounts WHERE account_id = 'ACC-1'").await, "97.00");
}
