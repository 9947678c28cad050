//! Redis as the store (`[sink] redis`) against a real Redis (Debian's redis-server 7.0) and the Kafka mock cluster:
//! the core duplicate matrix with exact values, a SIGKILL crash loop, Redis SIGKILLed mid-stream under
//! `appendfsync everysec` and restarted from its append-only file, connections killed with `CLIENT KILL`, two
//! workers with cross-partition duplicates, a `WRONGTYPE` failure in the middle of a record's commands (dead letter,
//! replay of the rest), and what `check`, `explain` and `dead-letters` say.

use crate::failures::{assert_counters_add_up, kill_repeatedly, payments, Payments};
use crate::support::redis::RedisServer;
use crate::support::*;
use ::redis::Commands;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The Redis example pipeline (examples/redis/payments.toml).
fn example() -> String {
    std::fs::read_to_string(project_root().join("examples/redis/payments.toml")).unwrap()
}

/// The keys matching `pattern` (KEYS: a test's own server).
fn keys(r: &mut ::redis::Connection, pattern: &str) -> Vec<String> {
    ::redis::cmd("KEYS").arg(pattern).query(r).unwrap()
}

/// The length of a stream (0 when it does not exist).
fn xlen(r: &mut ::redis::Connection, key: &str) -> usize {
    ::redis::cmd("XLEN").arg(key).query(r).unwrap()
}

/// Cents from a `123.45` text.
pub(crate) fn cents(text: &str) -> i64 {
    let (units, frac) = text.split_once('.').unwrap_or((text, "0"));
    let frac = format!("{frac:0<2}");
    let sign = if units.starts_with('-') { -1 } else { 1 };
    units.parse::<i64>().unwrap() * 100 + sign * frac[..2].parse::<i64>().unwrap()
}

/// What the example wrote: (payment hashes, sum of their amounts in cents, sum of the balances rounded to cents,
/// sum of the payment counts, entries in `payments-applied`, dedup keys, dead letters).
pub(crate) fn state(r: &mut ::redis::Connection) -> (usize, i64, i64, i64, usize, usize, usize) {
    let payments: Vec<String> = keys(r, "payment:*");
    let mut amount = 0;
    for p in &payments {
        let a: String = r.hget(p, "amount").unwrap();
        amount += cents(&a);
    }
    let balances: Vec<String> = keys(r, "balance:*");
    let (mut total, mut count) = (0i64, 0i64);
    for b in &balances {
        let t: HashMap<String, String> = r.hgetall(b).unwrap();
        total += (t.get("total").map_or(0.0, |v| v.parse::<f64>().unwrap()) * 100.0).round() as i64;
        count += t.get("payments").map_or(0, |v| v.parse::<i64>().unwrap());
    }
    let applied: usize = xlen(r, "payments-applied");
    let dedup: Vec<String> = keys(r, "idemflow:payments:k:*");
    let dead: usize = xlen(r, "idemflow:dead-letters");
    (payments.len(), amount, total, count, applied, dedup.len(), dead)
}

pub(crate) fn expected_cents(s: &Payments) -> i64 {
    cents(&s.expected_amount())
}

/// Every operation applied once with exact values, every poison record dead-lettered once.
fn assert_exactly_once(server: &RedisServer, s: &Payments) {
    assert_applied_once(server, s);
    let dead = xlen(&mut server.conn(), "idemflow:dead-letters");
    assert_eq!(dead, s.poison, "one dead letter per poison record");
}

/// Every operation applied once with exact values (the dead letters aside).
pub(crate) fn assert_applied_once(server: &RedisServer, s: &Payments) {
    let (payments, amount, total, count, applied, dedup, _) = state(&mut server.conn());
    assert_eq!(payments, s.distinct, "one payment hash per operation");
    assert_eq!(amount, expected_cents(s), "amounts exact");
    assert_eq!(total, expected_cents(s), "each deduction once");
    assert_eq!(count, s.distinct as i64, "each count once");
    assert_eq!(applied, s.distinct, "one stream entry per operation");
    assert_eq!(dedup, s.distinct, "one dedup key per operation");
}

/// Waits (at most 240 s) until every operation is applied, every poison record dead-lettered and every partition's
/// position stored at the end of the topic; shows the workers' logs if not.
async fn wait_all_durable(server: &RedisServer, kafka: &Kafka, partitions: i32, s: &Payments, workers: &[&BinWorker]) {
    let end = kafka.end_offsets("payments", partitions);
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let done = (|| {
            let mut r = ::redis::Client::open(server.url.as_str()).ok()?.get_connection().ok()?;
            let dedup: Vec<String> = ::redis::cmd("KEYS").arg("idemflow:payments:k:*").query(&mut r).ok()?;
            let dead: usize = ::redis::cmd("XLEN").arg("idemflow:dead-letters").query(&mut r).ok()?;
            let offsets: HashMap<String, String> = r.hgetall("idemflow:payments:offsets").ok()?;
            let at_end = end.iter().enumerate().all(|(p, e)| {
                offsets.get(&format!("payments/{p}")).and_then(|v| v.split_once(' ')).is_some_and(|(_, n)| n.parse::<i64>().ok() == Some(*e))
            });
            Some((dedup.len(), dead, at_end))
        })();
        if let Some((rows, dead, true)) = done {
            if rows == s.distinct && dead == s.poison {
                return;
            }
        }
        if Instant::now() > deadline {
            let tails: Vec<String> = workers.iter().map(|w| w.log_text().lines().rev().take(30).collect::<Vec<_>>().join("\n")).collect();
            panic!("timed out: {done:?} (distinct {}, poison {}), end {end:?}\n{}", s.distinct, s.poison, tails.join("\n=====\n"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The payments stream on a 3-partition topic, the example pipeline, and its settings.
fn fixture(server: &RedisServer, distinct: usize, props: &str) -> (Kafka, Setup, Payments) {
    fixture_in_batches(server, distinct, props, 2000)
}

/// [`fixture`] with the example's batches of `max_records` instead of its 2,000: smaller batches make the stream
/// last, so that a crash lands in the middle of it.
fn fixture_in_batches(server: &RedisServer, distinct: usize, props: &str, max_records: usize) -> (Kafka, Setup, Payments) {
    let kafka = Kafka::new();
    kafka.create_topic("payments", 3);
    let s = payments(distinct, 3, false);
    kafka.produce("payments", &s.records);
    let pipeline = example().replace("max_records = 2000", &format!("max_records = {max_records}"));
    let setup = Setup::redis(server, &kafka, &[("payments.toml", &pipeline)], props, "");
    (kafka, setup, s)
}

#[tokio::test(flavor = "multi_thread")]
async fn core_duplicates_exactly_once_on_redis() {
    let server = RedisServer::start();
    let (kafka, setup, s) = fixture(&server, 3_000, "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "check failed:\n{out}\n{err}");
    assert!(out.contains("appendonly yes, appendfsync everysec"), "{out}");
    assert!(out.contains("nothing to purge: its dedup keys expire by themselves after [dedup] retention = 7d"), "{out}");
    let w = BinWorker::start(&setup);
    wait_all_durable(&server, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&server, &s);
    let m = w.scrape();
    assert_counters_add_up(&m);
    let dup = |reason| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!(dup("republished"), s.republished as f64, "{m}");
    assert_eq!(dup("payload_mismatch"), s.mismatched as f64);
    assert_eq!(dup("redelivered"), 0.0);
    assert_eq!(metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), s.poison as f64);
    assert!(metric(&m, "idemflow_redis_script_duration_seconds_count", &[("pipeline", "payments")]) > 0.0, "{m}");
    // Every dedup key expires after the retention, and carries the duplicates it absorbed.
    let mut r = server.conn();
    let dedup_keys: Vec<String> = keys(&mut r, "idemflow:payments:k:*");
    let mut absorbed = 0;
    for k in &dedup_keys {
        let ttl: i64 = r.pttl(k).unwrap();
        assert!(ttl > 6 * 24 * 3600 * 1000 && ttl <= 7 * 24 * 3600 * 1000, "{k}: ttl {ttl}");
        let v: String = r.get(k).unwrap();
        absorbed += v.split('|').nth(2).unwrap().parse::<usize>().unwrap();
    }
    assert_eq!(absorbed, s.republished + s.mismatched);
    // explain and dead-letters read Redis.
    let config = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["explain", "--config", config, "--pipeline", "payments", "--key", "ORDERID_150"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("from               payments/0@") && out.contains("duplicates skipped 1 since"), "{out}");
    let (status, out, err) = idemflow(&["dead-letters", "list", "--config", config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains(&format!("{} dead letter(s)", s.poison)) && out.contains("decode_failed"), "{out}");
    let (status, out, err) = idemflow(&["dead-letters", "show", "--config", config, "1"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("payload     {\"order\": poison ") && out.contains("reason      decode_failed"), "{out}");
    let (status, out, err) = idemflow(&["purge", "--config", config], setup.dir.path());
    assert!(status.success() && out.contains("nothing to purge"), "{out}{err}");
}

/// Worker SIGKILLs at random moments: batches of 100, so a kill lands between or inside many scripts. 45,000
/// records, killed within 130 ms of applying: with 30,000 and 170 ms a quiet machine finished the stream after 8.
#[tokio::test(flavor = "multi_thread")]
async fn crash_loop_sigkill_on_redis() {
    let server = RedisServer::start();
    let props = "\"session.timeout.ms\" = \"1500\"\n\"heartbeat.interval.ms\" = \"200\"";
    let (kafka, setup, s) = fixture_in_batches(&server, 45_000, props, 100);
    let kills = kill_repeatedly(&setup, &kafka, 3, 12, 10, 120).await;
    assert!(kills >= 10, "only {kills} kills before the stream ended");
    let w = BinWorker::start(&setup);
    wait_all_durable(&server, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&server, &s);
    eprintln!("{kills} SIGKILLs over {} records ({} operations): each operation applied once", s.records.len(), s.distinct);
}

/// Redis SIGKILLed mid-stream with `appendfsync everysec`, losing its last writes as a machine crash would (the
/// unsynced tail of its append-only file cut): effects, dedup keys and stored positions are lost together.
/// Restarted from the file, the worker notices the positions it stored are gone, consumes those partitions again
/// from what Redis kept, and every operation ends applied once. (Every partition has a stored position older than
/// the cut: one whose whole history the cut removed stops the pipeline instead, see
/// `redis_restarted_empty_stops_the_pipeline_until_a_rewind`.)
#[tokio::test(flavor = "multi_thread")]
async fn redis_killed_and_restarted_from_its_aof_mid_stream() {
    let mut server = RedisServer::start();
    let (kafka, setup, s) = fixture_in_batches(&server, 30_000, "", 20);
    let w = BinWorker::start(&setup);
    let received = || metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "every partition's position stored", || async {
        let offsets: HashMap<String, String> = server.conn().hgetall("idemflow:payments:offsets").unwrap();
        (0..3).all(|p| offsets.get(&format!("payments/{p}")).is_some_and(|v| !v.ends_with(" -")))
    })
    .await;
    // What Redis holds now goes into the base file; the cut below takes from the writes after it only.
    server.rewrite_aof();
    let from = received();
    wait_until(Duration::from_secs(60), "the worker applying", || async { received() > from + 3_000.0 }).await;
    let cut = server.kill_losing_last_writes(0.3);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = w.scrape();
    assert_eq!(metric(&during, "idemflow_pipeline_up", &[("pipeline", "payments")]), 1.0, "the pipeline must wait, not stop");
    server.start_again();
    wait_all_durable(&server, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&server, &s);
    let m = w.scrape();
    assert!(metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "connection")]) > 0.0, "{m}");
    let resumed = w.log_text().matches("consuming the partition again from the position the store kept").count();
    eprintln!("Redis SIGKILLed, {cut} bytes of its AOF cut; {resumed} partition(s) resumed from the positions Redis kept");
    assert!(resumed > 0, "the lost positions were noticed:\n{}", w.log_text());
}

/// Redis restarted without its data mid-stream (its append-only files gone: a server without persistence, a
/// failover to an empty replica): the effects applied so far went with it, and Kafka's committed offsets are past
/// them, so the worker stops the pipeline with the reason rather than resume there and skip them for good. Nothing is
/// written meanwhile (a worker resuming from Kafka's offsets would write the rest of the stream); `idemflow rewind
/// --to earliest` and a new worker rebuild every effect once.
#[tokio::test(flavor = "multi_thread")]
async fn redis_restarted_empty_stops_the_pipeline_until_a_rewind() {
    let mut server = RedisServer::start();
    let (kafka, setup, s) = fixture_in_batches(&server, 20_000, "", 20);
    let mut w = BinWorker::start(&setup);
    let received = || metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "the worker applying", || async { received() > 3_000.0 }).await;
    server.kill_losing_everything();
    server.start_again();
    wait_until(Duration::from_secs(60), "the pipeline to stop", || async { w.log_text().contains("pipeline stopped") }).await;
    let log = w.log_text();
    assert!(log.contains("Redis holds no stored position for partitions") && log.contains("idemflow rewind --to earliest"), "the reason is logged:\n{log}");
    assert_eq!(metric(&w.scrape(), "idemflow_pipeline_up", &[("pipeline", "payments")]), 0.0);
    // Nothing written since the restart, and nothing later either: no effect, no dedup key, no dead letter.
    assert_eq!(state(&mut server.conn()), (0, 0, 0, 0, 0, 0, 0), "nothing written after Redis came back empty");
    // The stopped pipeline's consumer leaves the group (the rewind below refuses a group with members).
    wait_until(Duration::from_secs(30), "the stopped pipeline to leave the group", || async {
        w.log_text().contains("left the consumer group")
    })
    .await;
    assert_eq!(state(&mut server.conn()), (0, 0, 0, 0, 0, 0, 0), "nothing written after Redis came back empty");
    w.kill();
    let config = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["rewind", "--config", config, "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let w = BinWorker::start(&setup);
    wait_all_durable(&server, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&server, &s);
}

/// The worker's connection killed and the script cache flushed every 100 ms for 10 s (`CLIENT KILL TYPE normal`,
/// `SCRIPT FLUSH`): scripts hit mid-way are retried, the script is loaded again after `NOSCRIPT`, and every operation
/// applies once.
#[tokio::test(flavor = "multi_thread")]
async fn connections_killed_and_scripts_flushed_mid_run() {
    let server = RedisServer::start();
    let (kafka, setup, s) = fixture(&server, 20_000, "");
    let w = BinWorker::start(&setup);
    let mut r = server.conn();
    let mut killed = 0;
    // Kills for 10 s (the client's reconnects and the worker's retry backoff slow it down meanwhile), then lets it finish.
    let deadline = Instant::now() + Duration::from_secs(10);
    while kafka.committed("idemflow-payments", "payments", 3) != kafka.end_offsets("payments", 3) && Instant::now() < deadline {
        let n: i64 = ::redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal").arg("SKIPME").arg("yes").query(&mut r).unwrap();
        killed += n;
        // The batch script forgotten too (a restart, a failover, SCRIPT FLUSH): the next EVALSHA gets NOSCRIPT and
        // the client loads it again.
        let _: () = ::redis::cmd("SCRIPT").arg("FLUSH").query(&mut r).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(killed > 3, "killed only {killed} connections");
    wait_all_durable(&server, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&server, &s);
    let m = w.scrape();
    assert_counters_add_up(&m);
    assert!(metric(&m, "idemflow_db_retries_total", &[("pipeline", "payments"), ("cause", "connection")]) > 0.0, "{m}");
}

/// Two worker processes in one consumer group, the second joining mid-stream (a rebalance, its partitions claimed
/// under new epochs), with the same operations republished to other partitions.
#[tokio::test(flavor = "multi_thread")]
async fn two_workers_with_cross_partition_duplicates() {
    let server = RedisServer::start();
    let kafka = Kafka::new();
    kafka.create_topic("payments", 6);
    let s = payments(20_000, 6, true);
    // The second half is produced once B has partitions: A alone could finish the whole stream before B joins.
    let (first, second) = s.records.split_at(s.records.len() / 2);
    kafka.produce("payments", first);
    let props = "\"session.timeout.ms\" = \"3000\"\n\"heartbeat.interval.ms\" = \"300\"";
    let setups: Vec<Setup> = (0..2).map(|_| Setup::redis(&server, &kafka, &[("payments.toml", &example())], props, "")).collect();
    let received = |w: &BinWorker| metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    let assigned = |w: &BinWorker| metric(&w.scrape(), "idemflow_assigned_partitions", &[("pipeline", "payments")]);
    let a = BinWorker::start(&setups[0]);
    wait_until(Duration::from_secs(30), "A to start", || async { received(&a) > 0.0 }).await;
    let b = BinWorker::start(&setups[1]);
    wait_until(Duration::from_secs(30), "B to be assigned partitions", || async { assigned(&b) > 0.0 }).await;
    kafka.produce("payments", second);
    wait_all_durable(&server, &kafka, 6, &s, &[&a, &b]).await;
    assert_exactly_once(&server, &s);
    let (ma, mb) = (a.scrape(), b.scrape());
    assert!(received(&a) > 0.0 && received(&b) > 0.0, "both workers consumed: {} and {}", received(&a), received(&b));
    assert_counters_add_up(&ma);
    assert_counters_add_up(&mb);
}

/// A key of the wrong type in the middle of a record's commands: the record is dead-lettered after its first command
/// took effect (not undone: Redis has no rollback), no later copy runs that command again, the other records apply,
/// and a replay after the key is fixed runs only the commands that had not.
#[tokio::test(flavor = "multi_thread")]
async fn wrongtype_in_the_middle_of_a_record() {
    let server = RedisServer::start();
    let mut r = server.conn();
    let _: () = r.set("balance:ACC-5", "not a hash").unwrap();
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let order = |id: &str, account: &str, amount: &str| {
        Out::json(0, format!(r#"{{"order":{{"id":"{id}","account":"{account}","amount":"{amount}"}}}}"#))
    };
    kafka.produce("payments", &[
        order("O-1", "ACC-1", "10.00"),
        order("O-2", "ACC-5", "20.00"),
        order("O-3", "ACC-1", "30.00"),
        order("O-2", "ACC-5", "20.00"),
        order("O-4", "ACC-1", "not a number"),
    ]);
    let setup = Setup::redis(&server, &kafka, &[("payments.toml", &example())], "", "");
    let w = InProc::start_redis(&setup, Default::default()).await;
    w.wait_received("payments", 5).await;
    let total: String = r.hget("balance:ACC-1", "total").unwrap();
    assert_eq!(total, "40", "O-1 and O-3 applied; O-4 never ran a command");
    assert!(r.exists::<_, bool>("payment:O-2").unwrap(), "O-2's first command took effect");
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "side_effect_rejected")]), 1.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "param_invalid")]), 1.0);
    assert_eq!(w.metric("idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", "republished")]), 1.0, "the copy of O-2 runs nothing");
    let applied: usize = xlen(&mut r, "payments-applied");
    assert_eq!(applied, 2);
    assert!(w.stop().await.is_empty());
    let config = setup.config.to_str().unwrap();
    let (_, out, _) = idemflow(&["dead-letters", "show", "--config", config, "1"], setup.dir.path());
    assert!(out.contains("command 2 of 4 (HINCRBYFLOAT) failed: WRONGTYPE") && out.contains("first 1 command(s) took effect"), "{out}");
    let (_, out, _) = idemflow(&["dead-letters", "show", "--config", config, "2"], setup.dir.path());
    assert!(out.contains("sink.params.amount: its type says a number, got \"not a number\""), "{out}");
    // Fixed, and replayed: commands 2 to 4 run, the payment hash is not written again.
    let _: () = r.del("balance:ACC-5").unwrap();
    let _: () = r.hset("payment:O-2", "marker", "kept").unwrap();
    let (status, out, err) = idemflow(&["dead-letters", "replay", "--config", config, "1"], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("dead letter 1: applied"), "{out}");
    let marker: Option<String> = r.hget("payment:O-2", "marker").unwrap();
    assert_eq!(marker.as_deref(), Some("kept"), "HSET was not run again");
    let total: String = r.hget("balance:ACC-5", "total").unwrap();
    assert_eq!(total, "20");
    let applied: usize = xlen(&mut r, "payments-applied");
    assert_eq!(applied, 3);
    let (_, out, _) = idemflow(&["dead-letters", "list", "--config", config], setup.dir.path());
    assert!(out.contains("1 dead letter(s)"), "only O-4's is left: {out}");
    // O-4 replayed unchanged fails again and is dead-lettered anew (not taken for a redelivery of its position).
    let (status, out, _) = idemflow(&["dead-letters", "replay", "--config", config, "2"], setup.dir.path());
    assert!(!status.success() && out.contains("dead letter 2: failed again (param_invalid") && out.contains("kept as dead letter 3 (it replaces 2"), "{out}");
    let (_, out, _) = idemflow(&["dead-letters", "list", "--config", config], setup.dir.path());
    assert!(out.contains("1 dead letter(s)") && out.lines().any(|l| l.trim_start().starts_with("3 ")), "O-4's, as dead letter 3: {out}");
}

/// `check` refuses a Redis Cluster node, unknown commands and wrong arities, with the reason.
#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_cluster_unknown_commands_and_arity() {
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let cluster = RedisServer::start_with("everysec", &["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]);
    let setup = Setup::redis(&cluster, &kafka, &[("payments.toml", &example())], "", "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}");
    assert!(err.contains("this is a Redis Cluster node"), "{err}");
    let server = RedisServer::start();
    let bad = |command: &str| {
        format!("topics = [\"payments\"]\n[key]\nfield = \"/id\"\n[sink]\nredis = [[\"SET\", \"p:{{id}}\", \"1\"], {command}]\n[sink.params]\nid = \"/id\"\n")
    };
    let (a, b, c) = (bad(r#"["HSETT", "p", "a", "1"]"#), bad(r#"["GET", "a", "b"]"#), bad(r#"["INCRBY", "n", "x"]"#));
    let setup = Setup::redis(&server, &kafka, &[("a.toml", &a), ("b.toml", &b), ("c.toml", &c)], "", "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}");
    assert!(err.contains("pipeline \"a\": sink.redis[1]: Redis does not know the command HSETT"), "{err}");
    assert!(err.contains("pipeline \"b\": sink.redis[1]: GET takes exactly 1 argument(s) after its name; 2 given"), "{err}");
    assert!(err.contains("pipeline \"c\": sink.redis[1]: argument 2 of INCRBY must be an integer: \"x\""), "{err}");
}

/// The example on a RabbitMQ queue, keyed by message-id (the guide's Redis `SETNX` for RabbitMQ users, done with
/// the effect in the same script): exact, and `check` warns that a queue needs `appendfsync always`, which it does
/// not with `always`.
#[tokio::test(flavor = "multi_thread")]
async fn from_a_rabbitmq_queue_and_the_fsync_warning() {
    use crate::support::rabbitmq::{self, Client};
    let url = rabbitmq::shared_url();
    let queue = format!("payments-{}", unique());
    let client = Client::connect(url).await;
    client.declare(&queue, "quorum", false).await;
    let pipeline = example()
        .replace("topics = [\"payments\"]", &format!("[source]\nkind = \"rabbitmq\"\nqueue = \"{queue}\""))
        .replace("[key]\nfield = \"/order/id\"", "[key]\nmessage_id = true");
    let server = RedisServer::start();
    let setup = Setup::redis_rabbitmq(&server, url, &[("payments.toml", &pipeline)]);
    let config = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["check", "--config", config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("warning: pipeline \"payments\": a queue has no position to resume from") && out.contains("Set appendfsync always"), "{out}");
    let always = RedisServer::start_with("always", &[]);
    let quiet = Setup::redis_rabbitmq(&always, url, &[("payments.toml", &pipeline)]);
    let (status, out, err) = idemflow(&["check", "--config", quiet.config.to_str().unwrap()], quiet.dir.path());
    assert!(status.success() && !out.contains("Set appendfsync always"), "{out}{err}");

    let s = payments(2_000, 1, false);
    let messages = crate::rabbitmq::messages(&s);
    client.publish(&queue, &messages).await;
    let w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(120), "every message applied or dead-lettered", || async {
        metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]) >= s.records.len() as f64
    })
    .await;
    assert_exactly_once(&server, &s);
    let m = w.scrape();
    assert_counters_add_up(&m);
    let dup = |reason| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!(dup("republished"), s.republished as f64, "{m}");
    assert_eq!(dup("payload_mismatch"), s.mismatched as f64);
    assert_eq!(client.ready(&queue).await, 0, "every delivery was acknowledged");
}

/// A Sentinel-managed primary with one replica in sync, failed over mid-stream (`SENTINEL FAILOVER`): the worker,
/// which knows only the sentinel, finds the new primary after its old one answers `READONLY`, resumes from the
/// positions the new primary holds (replication is asynchronous: what it had not received is consumed again), and
/// every operation ends applied once on it.
#[tokio::test(flavor = "multi_thread")]
async fn sentinel_failover_mid_stream() {
    use crate::support::redis::Sentinel;
    let primary = RedisServer::start_with("everysec", &["--repl-diskless-sync-delay", "0"]);
    let port = primary.port().to_string();
    let replica = RedisServer::start_with("everysec", &["--replicaof", "127.0.0.1", &port]);
    wait_until(Duration::from_secs(30), "the replica in sync", || async {
        let info: String = ::redis::cmd("INFO").arg("replication").query(&mut replica.conn()).unwrap();
        info.contains("master_link_status:up") && info.contains("master_sync_in_progress:0")
    })
    .await;
    let sentinel = Sentinel::start(primary.port());
    let kafka = Kafka::new();
    kafka.create_topic("payments", 3);
    let s = payments(30_000, 3, false);
    let (before, after) = s.records.split_at(s.records.len() / 2);
    kafka.produce("payments", before);
    let small = example().replace("max_records = 2000", "max_records = 20");
    // The URL's host and port are not used with sentinels: the worker asks the sentinel.
    let section = format!(
        "[redis]\nurl = \"redis://127.0.0.1:1/0\"\nsentinels = [\"127.0.0.1:{}\"]\nsentinel_master = \"mymaster\"\nconnect_timeout = \"2s\"\nresponse_timeout = \"5s\"\n",
        sentinel.port
    );
    let setup = Setup::redis_section(&section, &kafka, &[("payments.toml", &small)], "", "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let w = BinWorker::start(&setup);
    let received = || metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]);
    wait_until(Duration::from_secs(60), "the worker applying", || async { received() > 3_000.0 }).await;
    // Every partition has a batch stored on the primary (the consumer takes partitions in turn): a partition whose
    // first batch the new primary never received would stop the pipeline (nothing says where it had started).
    wait_until(Duration::from_secs(60), "a batch stored for every partition", || async {
        let offsets: HashMap<String, String> = primary.conn().hgetall("idemflow:payments:offsets").unwrap();
        offsets.len() == 3 && offsets.values().all(|v| !v.ends_with(" -"))
    })
    .await;
    // The replica acknowledges what the primary had so far (replication is asynchronous: on this machine it ran
    // megabytes behind); what the worker writes after this may not reach it, and is lost by the failover.
    let _: i64 = ::redis::cmd("WAIT").arg(1).arg(60_000).query(&mut primary.conn()).unwrap();
    sentinel.failover();
    wait_until(Duration::from_secs(60), "the sentinel to name the replica", || async { sentinel.primary_port() == replica.port() }).await;
    // The rest of the stream, which the worker writes to the new primary once it found it.
    kafka.produce("payments", after);
    wait_all_durable(&replica, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&replica, &s);
    assert!(w.log_text().contains("the Redis primary moved (a Sentinel failover)"), "{}", w.log_text());
}

/// `rediss://` with a private CA (`tls_ca_file`): the worker connects over TLS and applies; a CA that did not sign
/// the server's certificate is refused by `check`, with the reason.
#[tokio::test(flavor = "multi_thread")]
async fn tls_with_a_private_ca() {
    let certs = tempfile::tempdir().unwrap();
    crate::security::certificates(certs.path());
    let server = RedisServer::start_tls(certs.path());
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let s = payments(500, 1, false);
    kafka.produce("payments", &s.records);
    let section = |ca: &str| {
        format!("[redis]\nurl = \"{}\"\ntls_ca_file = \"{}\"\nconnect_timeout = \"2s\"\n", server.url, certs.path().join(ca).display())
    };
    let setup = Setup::redis_section(&section("ca.crt"), &kafka, &[("payments.toml", &example())], "", "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "every record processed over TLS", || async {
        metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]) >= s.records.len() as f64
    })
    .await;
    assert_eq!(metric(&w.scrape(), "idemflow_records_applied_total", &[("pipeline", "payments")]), s.distinct as f64);
    let other = Setup::redis_section(&section("other-ca.crt"), &kafka, &[("payments.toml", &example())], "", "");
    let (status, out, err) = idemflow(&["check", "--config", other.config.to_str().unwrap()], other.dir.path());
    assert!(!status.success(), "{out}");
    assert!(err.contains("cannot connect to Redis at rediss://localhost:") && err.to_lowercase().contains("certificate"), "{err}");
}

/// A command the Redis user may not run (an ACL without `~balance:*`) stops the pipeline before any of the record's
/// commands runs: it is never taken for the record's fault (Redis 7.0 reports it inside a script as `ERR The user
/// executing the script can't ...`, not `NOPERM`). Nothing is dead-lettered, nothing half applied; once the
/// permission is granted, a restart applies every record once. Issue: exactly-once holes, item 2.
#[tokio::test(flavor = "multi_thread")]
async fn a_command_the_user_may_not_run_stops_the_pipeline() {
    let server = RedisServer::start();
    let mut r = server.conn();
    let _: () = ::redis::cmd("ACL")
        .arg(&["SETUSER", "worker", "on", ">secret", "~payment:*", "~payments-applied", "~idemflow:*", "+@all"])
        .query(&mut r)
        .unwrap();
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    let orders: Vec<Out> = (0..20)
        .map(|i| Out::json(0, format!(r#"{{"order":{{"id":"O-{i}","account":"ACC-{}","amount":"1.50"}}}}"#, i % 3)))
        .collect();
    kafka.produce("payments", &orders);
    let url = server.url.replace("redis://", "redis://worker:secret@");
    let section = format!("[redis]\nurl = \"{url}\"\nconnect_timeout = \"2s\"\nresponse_timeout = \"5s\"\n");
    let setup = Setup::redis_section(&section, &kafka, &[("payments.toml", &example())], "", "");
    let w = InProc::start_redis(&setup, Default::default()).await;
    let failures = tokio::time::timeout(Duration::from_secs(60), w.stop_when_pipelines_end()).await.expect("the pipeline stops");
    let text: Vec<String> = failures.iter().map(ToString::to_string).collect();
    assert!(text.iter().any(|f| f.to_uppercase().contains("NOPERM") && f.contains("command 2 of 4 (HINCRBYFLOAT)")), "{text:?}");
    let (payments, _, _, _, applied, dedup, dead) = state(&mut r);
    assert_eq!((payments, applied, dedup, dead), (0, 0, 0, 0), "nothing half applied, nothing dead-lettered");

    let _: () = ::redis::cmd("ACL").arg(&["SETUSER", "worker", "~balance:*"]).query(&mut r).unwrap();
    let w = InProc::start_redis(&setup, Default::default()).await;
    w.wait_received("payments", 20).await;
    assert!(w.stop().await.is_empty());
    let (payments, amount, total, count, applied, dedup, dead) = state(&mut r);
    assert_eq!((payments, amount, total, count, applied, dedup, dead), (20, 3000, 3000, 20, 20, 20, 0));
}

/// Numbers Redis would refuse are caught before the script, exactly as Redis parses them (`"007"` and `"-0"` for
/// `INCRBY`, a `ZADD` score `"abc"`, `SET ... EX "abc"`): the record goes to the dead letters as `param_invalid`
/// with none of its commands run, never half applied. `check` refuses a command whose numeric arguments idemflow
/// does not know. Issue: exactly-once holes, item 6.
#[tokio::test(flavor = "multi_thread")]
async fn numbers_redis_would_refuse_run_nothing_of_the_record() {
    let server = RedisServer::start();
    let mut r = server.conn();
    let kafka = Kafka::new();
    kafka.create_topic("n", 1);
    let pipeline = "topics = [\"n\"]\n[key]\nfield = \"/id\"\n[sink]\nredis = [\n  [\"HSET\", \"seen:{id}\", \"at\", \"1\"],\n  \
                    [\"INCRBY\", \"count:{id}\", \"{n}\"],\n  [\"ZADD\", \"scores\", \"{score}\", \"{id}\"],\n  \
                    [\"SET\", \"ttl:{id}\", \"1\", \"EX\", \"{ttl}\"],\n]\n[sink.params]\nid = \"/id\"\nn = \"/n\"\nscore = \"/score\"\nttl = \"/ttl\"\n";
    let record = |id: &str, n: &str, score: &str, ttl: &str| {
        Out::json(0, format!(r#"{{"id":"{id}","n":"{n}","score":"{score}","ttl":"{ttl}"}}"#))
    };
    kafka.produce("n", &[
        record("good", "7", "1.5", "60"),
        record("zeros", "007", "1", "60"),
        record("minus-zero", "-0", "1", "60"),
        record("score", "1", "abc", "60"),
        record("ttl", "1", "1", "abc"),
        record("ttl-zero", "1", "1", "0"),
        record("inf", "1", "-inf", "60"),
    ]);
    let setup = Setup::redis(&server, &kafka, &[("n.toml", pipeline)], "", "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let w = InProc::start_redis(&setup, Default::default()).await;
    w.wait_received("n", 7).await;
    assert_eq!(w.metric("idemflow_records_applied_total", &[("pipeline", "n")]), 2.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "n"), ("reason", "param_invalid")]), 5.0);
    assert_eq!(w.metric("idemflow_dead_letters_total", &[("pipeline", "n"), ("reason", "side_effect_rejected")]), 0.0);
    assert!(w.stop().await.is_empty());
    let seen = keys(&mut r, "seen:*");
    assert_eq!(seen.len(), 2, "only the records Redis takes ran their first command: {seen:?}");
    let count: i64 = r.get("count:good").unwrap();
    assert_eq!(count, 7);

    let unknown = "topics = [\"n\"]\n[key]\nfield = \"/id\"\n[sink]\nredis = [[\"BITFIELD\", \"b:{id}\", \"INCRBY\", \"u8\", \"0\", \"1\"]]\n[sink.params]\nid = \"/id\"\n";
    let setup = Setup::redis(&server, &kafka, &[("u.toml", unknown)], "", "");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success() && err.contains("sink.redis[0]: idemflow does not know where BITFIELD takes numbers"), "{out}{err}");
}

/// A script that ran but whose answer was lost (injected: the script runs, then the attempt fails as on a lost
/// connection) used to make the retry count its own batch as duplicates (`redelivered`, every key's duplicate count
/// raised). The retry's script now finds every partition at the batch's next position, writes nothing, and answers
/// the outcome the lost attempt left: the counts are those of a batch applied once. Issue 42, item 10, on Redis.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_script_answer_counts_the_batch_once() {
    let server = RedisServer::start();
    let (kafka, setup, s) = fixture(&server, 3_000, "");
    let w = BinWorker::start_with_env(&setup, &[(idemflow::worker::LOSE_COMMIT_ANSWER_VAR, "1")]);
    wait_all_durable(&server, &kafka, 3, &s, &[&w]).await;
    assert_exactly_once(&server, &s);
    let m = w.scrape();
    assert_counters_add_up(&m);
    let dup = |reason| metric(&m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)]);
    assert_eq!(dup("redelivered"), 0.0, "the batch's own records are not counted as duplicates: {m}");
    assert_eq!(dup("republished"), s.republished as f64, "{m}");
    assert_eq!(dup("payload_mismatch"), s.mismatched as f64);
    assert_eq!(metric(&m, "idemflow_records_applied_total", &[("pipeline", "payments")]), s.distinct as f64);
    assert_eq!(metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]), s.poison as f64);
    let mut r = server.conn();
    let absorbed: usize = keys(&mut r, "idemflow:payments:k:*")
        .iter()
        .map(|k| r.get::<_, String>(k).unwrap().split('|').nth(2).unwrap().parse::<usize>().unwrap())
        .sum();
    assert_eq!(absorbed, s.republished + s.mismatched, "no key's duplicate count raised by the retry");
    assert!(w.log_text().contains("fault injection"), "the fault was injected: {}", w.log_text());
}

/// The stored answer of a batch is for that batch only: a retry of it (an earlier attempt failed) gets it back, and
/// nothing runs again; the same batch after it lost a partition's records (revoked during the back-off) has other
/// sizes, runs as it is now, and finds its remaining keys claimed (without the size check its answer would not
/// line up, and the pipeline would stop).
#[tokio::test(flavor = "multi_thread")]
async fn a_stored_answer_is_for_the_same_batch_only() {
    use idemflow::offsets::Positions;
    use idemflow::record::{Position, Receipt, Record};
    use idemflow::store::redis::batch::{BatchAttempt, Item, ItemResult};
    let server = RedisServer::start();
    let store = idemflow::store::redis::RedisStore::new(&idemflow::demo::database::DemoDb::redis_settings(&server.url)).unwrap();
    let parts = vec![("t".to_owned(), 0), ("t".to_owned(), 1)];
    let claimed = store.claim_offsets("p", "me", &parts).await.unwrap();
    let epoch = |p: i32| claimed.iter().find(|c| c.partition == p).unwrap().epoch;
    let record = |partition: i32| Record {
        position: Position { topic: "t".into(), partition, offset: 0 },
        timestamp_ms: None,
        key: None,
        headers: Vec::new(),
        payload: Some(format!("{{\"p\":{partition}}}").into_bytes()),
        oversized: None,
        properties: Vec::new(),
        delivered_before: None,
        receipt: Receipt::NONE,
    };
    let records = [record(0), record(1)];
    let items: Vec<Item<'_>> = records
        .iter()
        .map(|r| Item::Apply {
            record: r,
            digest: [r.position.partition as u8; 32],
            fingerprint: [7; 32],
            values: vec![format!("applied:{}", r.position.partition)],
            replay_skip: None,
        })
        .collect();
    let both = Positions(vec![("t".into(), 0, 1, epoch(0)), ("t".into(), 1, 1, epoch(1))]);
    let template = vec![vec![Some("INCR".to_owned()), None]];
    let retention = Duration::from_secs(3600);
    let first = BatchAttempt { token: Some(42), again: false, lane: "host/1" };
    let ran = store.run_batch(&first, "p", retention, Some(&both), &[], &template, &items).await.unwrap();
    assert!(!ran.again);
    assert!(ran.results.iter().all(|r| matches!(r, ItemResult::Applied)), "{:?}", ran.results);
    // Its answer lost: the retry gets it back, and nothing runs again.
    let retry = BatchAttempt { token: Some(42), again: true, lane: "host/1" };
    let ran = store.run_batch(&retry, "p", retention, Some(&both), &[], &template, &items).await.unwrap();
    assert!(ran.again, "the stored answer");
    assert!(ran.results.iter().all(|r| matches!(r, ItemResult::Applied)), "{:?}", ran.results);
    let mut c = server.conn();
    assert_eq!((c.get::<_, i64>("applied:0").unwrap(), c.get::<_, i64>("applied:1").unwrap()), (1, 1), "each command ran once");
    // Partition 1 revoked meanwhile: the smaller batch runs as it is, its record's key found claimed.
    let one = Positions(vec![("t".into(), 0, 1, epoch(0))]);
    let ran = store.run_batch(&retry, "p", retention, Some(&one), &[], &template, &items[..1]).await.unwrap();
    assert!(!ran.again, "not the answer of a batch of another size");
    assert!(matches!(ran.results[0], ItemResult::Duplicate(_)), "{:?}", ran.results);
    assert_eq!(c.get::<_, i64>("applied:0").unwrap(), 1, "nothing applied twice");
}
