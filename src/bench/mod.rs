//! `idemflow bench`: idemflow's throughput, cost and scaling against its baselines, side by side in one run.
//!
//! One stream of N records (about 190 bytes of JSON each, 2% duplicates: republished copies and reused keys with
//! another payload) is produced into the embedded Kafka broker before any timing starts, spread over enough
//! partitions for the mock cluster to keep it all. Then, one after another, each on a fresh database:
//!
//! 1. the worker with its default batching, table-form side effect;
//! 2. the worker with one record per transaction (`max_records = 1`), over a prefix of the stream;
//! 3. the ceiling: `COPY` of the same dedup rows and business rows into the same indexed tables, no Kafka;
//! 4. the worker as in (1) with `--preload` dedup keys already in the store;
//! 5. the broker's ceiling: a consume-only pass (decode and key extraction, no database);
//! 6. the worker with the per-record SQL form of the same side effect, over a prefix of the stream;
//! 7. the worker with a Redis sink (`[sink] redis`: each new order as a hash, one script per batch) on a throwaway
//!    `redis-server` (append-only file, `appendfsync everysec`); skipped when `redis-server` is not installed;
//! 8. the worker with the shipped example as it ships, `pipelines/payments.toml` on `pipelines/payments.sql` (the
//!    batch SQL form: one `INSERT ... SELECT ... FROM new_records` into `payments`, with its foreign key and check,
//!    and one `UPDATE accounts ... FROM` the batch's sums per account, per batch), its 10,000 accounts seeded;
//! 9. the ceiling of what the guarantee needs: `COPY` of the business rows and one dedup row per key (the key text
//!    as the primary key, nothing else) into fresh tables, no Kafka;
//! 10. a batched consumer written by hand (2,000 records per transaction: one statement inserts the batch's keys
//!     into a key table with `ON CONFLICT DO NOTHING` and the business rows of those that were new, from `unnest`
//!     arrays; then an asynchronous offset commit), no metrics, no dead letters, no duplicate reasons;
//! 11. the design guides' consumer: one transaction per message (insert its key into the key table, the business
//!     row if the key was new, `COMMIT`, then a synchronous offset commit), over the prefix of run (2);
//! 12. run (13) with one round trip per statement and record, as before the server-side loop: its `INSERT` given a
//!     `RETURNING` clause (a statement that returns rows keeps the per-record round trips), over the prefix of
//!     run (2);
//! 13. the same side effect as (8) in the per-record SQL form, as `examples/per-record-sql/payments.toml` ships it
//!     (an `INSERT` and an `UPDATE` per new record, run server-side in one round trip per batch), on the same
//!     tables;
//! 14. and 15. run (1) with `batch.concurrency = 2` and `4`: as many batch transactions at once, on disjoint
//!     partitions (one consumer each in the pipeline's group).
//! 16. and 17. run (1) with the same orders as Avro datums and as Protobuf messages (plain, of a `schema_file`),
//!     produced to topics of their own before any timing: the decode's cost beside JSON's, in worker CPU per record;
//! 18. and 19. run (5) over those topics: the decode and key extraction alone, per format.
//! 20. run (1) with an HTTP request per new key through the outbox (`[[sink.http]]` with its defaults) to a payment
//!     provider on a loopback port (the demo's, [`crate::demo::provider`]): until every request is confirmed; its note
//!     gives the commit-to-confirmation p50 and p99.
//!
//! With `--database-url mysql://...` (or `mariadb://`) runs (1), (2), (5) and (6) run on MySQL or MariaDB; (3), (4)
//! and (8) to (15) are PostgreSQL's.
//!
//! With `--source rabbitmq` the same stream is published to quorum queues of a throwaway RabbitMQ node instead
//! (message-id = order id, persistent, publisher confirms), and these runs compare: (1) the worker, table form, from a
//! queue; (5) the broker's ceiling, a consume-only pass from a queue with the same prefetch and one `basic.ack` with
//! `multiple` per batch; (7) the Redis sink; (8) the shipped payments example from a queue.
//!
//! The workers run as child processes (`idemflow run`), so their CPU time is that process's alone: user + system
//! time from `/proc/<pid>/stat` when the target is reached (start-up included, shutdown not; the notes also give
//! the whole process's from `wait4`), and their peak RSS its `/proc/<pid>/status` `VmHWM`, read just before it is
//! stopped. Throughput is taken between the first record received and the end: every record received and, for
//! runs that read the whole stream, every distinct key applied (so start-up and group join are left out, and a
//! rebalance's redeliveries cannot end a run early). Batch latencies are quantiles of the worker's own histogram,
//! interpolated within buckets as Prometheus' `histogram_quantile` does; end-to-end latencies are taken from the
//! run's own start (its first record received) until that share of its records was applied, from the metrics
//! scraped every 25 ms, since the stream is produced once before every run.

mod baselines;
mod harness;
mod one_stream;
mod options;
mod report;
mod server_lock;
mod workload;

pub use harness::histogram_quantile;
pub(crate) use harness::scrape;
pub use options::{BenchOptions, BenchSource};
pub use report::{markdown, Ratio, Report, RunResult};

use crate::demo::kafka::EmbeddedKafka;
use crate::demo::postgres::Throwaway;
use std::time::Duration;
use baselines::*;
use harness::*;
use one_stream::*;
use report::*;
use server_lock::ServerLock;
use workload::*;

/// Runs the benchmark and writes the Markdown table and the JSON.
pub async fn run(o: BenchOptions) -> anyhow::Result<Report> {
    if cfg!(debug_assertions) {
        eprintln!("warning: this is a debug build; run `cargo run --release -- bench` for meaningful figures");
    }
    let throwaway;
    let admin_url = match &o.database_url {
        Some(url) => url.clone(),
        None => {
            eprintln!("starting a throwaway PostgreSQL cluster (fsync on, synchronous_commit on)...");
            throwaway = Throwaway::start_durable()?;
            throwaway.url()
        }
    };
    if o.source != BenchSource::Kafka {
        anyhow::ensure!(o.repeat <= 1, "--repeat is for the embedded Kafka's runs; run `idemflow bench --source {:?}` several times instead", o.source);
    }
    let lock = ServerLock::take(&admin_url).await?;
    let report = if o.source == BenchSource::Kafka { run_kafka(&o, &admin_url).await } else { run_one_stream(&o, &admin_url).await };
    lock.release().await;
    report
}

/// The runs on the embedded Kafka broker's stream, (1) to (15), `--repeat` times.
async fn run_kafka(o: &BenchOptions, admin_url: &str) -> anyhow::Result<Report> {
    let mysql = is_mysql(admin_url);
    let kafka = EmbeddedKafka::start()?;
    // About 200 bytes a record; the mock keeps about 5 MiB per partition: stay under 2 MiB.
    let partitions = ((o.records * 230) / (2 << 20) + 1).max(4) as i32;
    kafka.create_topic(TOPIC, partitions)?;
    let env = environment(admin_url, o.database_url.is_none(), o, partitions).await?;
    for (k, v) in &env {
        eprintln!("{k}: {v}");
    }
    let s = produce(&kafka, o.records, partitions)?;
    let total = s.records.len() as u64;
    // The same orders as Avro and Protobuf, for runs (16) to (19), with their schema files.
    let schemas = tempfile::Builder::new().prefix("idemflow-bench-schemas-").tempdir()?;
    let formats = FORMATS;
    if (16..=19).any(|n| o.only.is_empty() || o.only.contains(&n)) {
        for (format, topic, file, text) in formats {
            std::fs::write(schemas.path().join(file), text)?;
            kafka.create_topic(topic, partitions)?;
            let avg = produce_encoded(&kafka, &s, topic, format)?;
            eprintln!("produced the same records as {format:?} to {topic} ({avg} bytes on average)");
        }
    }
    // The whole stream's runs also wait until every distinct key was applied.
    let distinct = Some(s.firsts.len() as u64);
    let mut runs = Vec::new();
    let report_run = |r: &RunResult| eprintln!("{} {}: {:.0} records/s ({})", r.id, r.name, r.records_per_second, r.note);

    // On MySQL/MariaDB, runs (3) and (4) are PostgreSQL's (a COPY ceiling, a preload with generate_series).
    let want = |n: u8| (o.only.is_empty() || o.only.contains(&n)) && !(mysql && matches!(n, 3 | 4 | 8..=20));
    if mysql {
        eprintln!("MySQL/MariaDB: runs (1), (2), (5) and (6); (3), (4) and (8) to (15) are PostgreSQL's");
    }

    let mut repetitions = Vec::new();
    for repetition in 1..=o.repeat.max(1) {
        // Each repetition's consumer groups are new, so each reads the topic from its start.
        let tag = if repetition == 1 { String::new() } else { format!("-r{repetition}") };
        let first = runs.len();
        for n in 1..=20u8 {
            if !want(n) {
                continue;
            }
            let runs_of = Runs { o, admin_url, kafka: &kafka, s: &s, total, distinct, schemas: schemas.path(), tag: &tag };
            let Some(r) = runs_of.one(n).await? else { continue };
            let r = RunResult { repetition, ..r };
            report_run(&r);
            runs.push(r);
        }
        repetitions.push(ratios(&runs[first..], mysql));
    }
    let report = Report { environment: env, runs, ratios: combine(&repetitions) };
    write_outputs(&report, &o.markdown, &o.json)?;
    Ok(report)
}

/// The alternating formats of runs (16) to (19): the format, its topic, its schema file's name and text.
const FORMATS: [(crate::demo::formats::DemoFormat, &str, &str, &str); 2] = [
    (crate::demo::formats::DemoFormat::Avro, "bench-avro", "orders.avsc", ORDER_AVSC),
    (crate::demo::formats::DemoFormat::Protobuf, "bench-protobuf", "orders.proto", ORDER_PROTO),
];

/// What every run on the embedded Kafka's stream shares, in one repetition.
struct Runs<'a> {
    o: &'a BenchOptions,
    admin_url: &'a str,
    kafka: &'a EmbeddedKafka,
    s: &'a Stream,
    /// Records in the stream.
    total: u64,
    /// Distinct keys in the stream (the runs that wait until each was applied).
    distinct: Option<u64>,
    /// Where the schema files of runs (16) and (17) are.
    schemas: &'a std::path::Path,
    /// The repetition's suffix of consumer group names ("" for the first).
    tag: &'a str,
}

impl Runs<'_> {
    /// Run (`n`), or `None` when it does not apply here (Redis not installed, MySQL).
    async fn one(&self, n: u8) -> anyhow::Result<Option<RunResult>> {
        let Runs { o, admin_url, kafka, s, total, distinct, schemas, tag } = *self;
        let group = |n: u8| format!("bench-{n}{tag}");
        let (perf, mysql, formats) = (o.perf, is_mysql(admin_url), FORMATS);
        Ok(Some(if n == 20 {
            let provider = crate::demo::provider::Provider::start(None).await?;
            let url = fresh_database(admin_url, "bench_20").await?;
            let name = "idemflow, default batching (table form) and an HTTP request per new key through the outbox, to a local provider";
            let pipeline = http_table_pipeline(&provider.url());
            let run = WorkerRun { id: "(20)", name, pipeline, group: &group(20), target: total, applied: distinct, delivered: distinct };
            worker_run(run, &kafka_settings(&kafka), &url, perf).await?
        } else if (16..=19).contains(&n) {
            let (format, topic, file, _) = formats[usize::from(n % 2 == 1)];
            let pipeline = format_table_pipeline(topic, format, &schemas.join(file));
            let url = fresh_database(admin_url, &format!("bench_{n}")).await?;
            match n {
                16 | 17 => {
                    let (id, name) = if n == 16 {
                        ("(16)", "idemflow, default batching (table form), Avro payloads")
                    } else {
                        ("(17)", "idemflow, default batching (table form), Protobuf payloads")
                    };
                    let run = WorkerRun { id, name, pipeline, group: &group(n), target: total, applied: distinct, delivered: None };
                    worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                }
                _ => {
                    let (id, name) = if n == 18 {
                        ("(18)", "ceiling: consume-only pass, Avro payloads (decode and key extraction, no database)")
                    } else {
                        ("(19)", "ceiling: consume-only pass, Protobuf payloads (decode and key extraction, no database)")
                    };
                    RunResult { id: id.to_owned(), ..consume_only_of(&kafka, &url, s.records.len(), &group(n), (topic, &pipeline, name)).await? }
                }
            }
        } else if (8..=15).contains(&n) {
            match n {
                14 | 15 => {
                    let lanes = if n == 14 { 2 } else { 4 };
                    let url = fresh_database(admin_url, &format!("bench_{n}")).await?;
                    let (id, name) = if n == 14 {
                        ("(14)", "idemflow, default batching (table form), batch.concurrency = 2")
                    } else {
                        ("(15)", "idemflow, default batching (table form), batch.concurrency = 4")
                    };
                    let group = group(n);
                    let run = WorkerRun { id, name, pipeline: concurrent_table_pipeline(lanes), group: &group, target: total, applied: distinct, delivered: None };
                    // The lanes' consumers join the new group together, as on a real broker, whose new groups wait
                    // 3 s for more members before the first assignment; with the mock's 0 they would join one after
                    // another, each join a rebalance that the mock holds for session.timeout.ms - 1 s while the
                    // offset commits of the members already consuming are refused.
                    kafka.set_initial_rebalance_delay(Duration::from_secs(3));
                    let r = worker_run(run, &kafka_settings(&kafka), &url, perf).await;
                    kafka.set_initial_rebalance_delay(Duration::ZERO);
                    r?
                }
                13 => {
                    let url = payments_database(admin_url, "bench_13").await?;
                    let name = "idemflow, the shipped example in the per-record SQL form, examples/per-record-sql/payments.toml";
                    let run = WorkerRun { id: "(13)", name, pipeline: per_record_payments_pipeline(), group: &group(13), target: total, applied: None, delivered: None };
                    worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                }
                12 => {
                    let url = payments_database(admin_url, "bench_12").await?;
                    let name = "idemflow, the per-record SQL form with one round trip per statement and record (its INSERT given RETURNING)";
                    let per_record = per_record_payments_pipeline();
                    let pipeline = per_record.replace(":paid_at, :details)", ":paid_at, :details) RETURNING order_id");
                    anyhow::ensure!(pipeline != per_record, "examples/per-record-sql/payments.toml's INSERT ends with `:paid_at, :details)`");
                    let single = o.single_records.min(o.records) as u64;
                    let run = WorkerRun { id: "(12)", name, pipeline, group: &group(12), target: single, applied: None, delivered: None };
                    worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                }
                8 => {
                    let url = payments_database(admin_url, "bench_8").await?;
                    let name = "idemflow, the shipped example pipelines/payments.toml (batch SQL form: INSERT payments + UPDATE accounts per batch)";
                    let run = WorkerRun { id: "(8)", name, pipeline: payments_pipeline(), group: &group(8), target: total, applied: None, delivered: None };
                    worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                }
                9 => minimal_copy_ceiling(&minimal_database(admin_url, "bench_9").await?, &s, s.records.len()).await?,
                10 => hand_written_batched(&kafka, &minimal_database(admin_url, "bench_10").await?, s.records.len(), &group(10)).await?,
                _ => {
                    let single = o.single_records.min(o.records);
                    per_message(&kafka, &minimal_database(admin_url, "bench_11").await?, single, &group(11)).await?
                }
            }
        } else if n == 7 {
            if mysql {
                return Ok(None);
            }
            let redis = match crate::demo::redis::Throwaway::start() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("(7) skipped: {e}");
                    return Ok(None);
                }
            };
            eprintln!("redis: {} (throwaway server, appendonly yes, appendfsync everysec)", redis.version());
            let run = WorkerRun { id: "(7)", name: "idemflow, Redis sink (one script per batch)", pipeline: redis_pipeline(), group: &group(7), target: total, applied: distinct, delivered: None };
            let store = format!("[redis]\nurl = \"{}\"\n", redis.url());
            worker_run_on(run, &kafka_settings(&kafka), &store, perf, &Probe::default()).await?
        } else {
            let url = fresh_database(admin_url, &format!("bench_{n}")).await?;
            let run_group = group(n);
            let worker = |id, name, pipeline, target| WorkerRun { id, name, pipeline, group: &run_group, target, applied: None, delivered: None };
            match n {
                1 => {
                    let run = WorkerRun { applied: distinct, ..worker("(1)", "idemflow, default batching (table form)", table_pipeline(None), total) };
                    worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                }
                2 => {
                    let single = o.single_records.min(o.records) as u64;
                    let name = "idemflow, one record per transaction (max_records = 1)";
                    worker_run(worker("(2)", name, table_pipeline(Some(1)), single), &kafka_settings(&kafka), &url, perf).await?
                }
                3 => copy_ceiling(&url, &s, s.records.len()).await?,
                4 => {
                    let preload_secs = preload(&url, o.preload).await?;
                    let name = "idemflow, default batching, dedup store preloaded";
                    let run = WorkerRun { applied: distinct, ..worker("(4)", name, table_pipeline(None), total) };
                    let mut r = worker_run(run, &kafka_settings(&kafka), &url, perf).await?;
                    r.note = format!("{} preloaded keys (in {preload_secs:.1} s); {}", o.preload, r.note);
                    r
                }
                5 => consume_only(&kafka, &url, s.records.len(), &group(5)).await?,
                _ => {
                    let sql = o.sql_records.min(o.records) as u64;
                    let name = "idemflow, default batching, per-record SQL form";
                    worker_run(worker("(6)", name, sql_pipeline(), sql), &kafka_settings(&kafka), &url, perf).await?
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let m = "x_bucket{pipeline=\"p\",le=\"0.1\"} 50\nx_bucket{pipeline=\"p\",le=\"0.2\"} 100\nx_bucket{pipeline=\"p\",le=\"+Inf\"} 100\n";
        assert_eq!(histogram_quantile(m, "x", 0.5), Some(0.1));
        assert!((histogram_quantile(m, "x", 0.75).unwrap() - 0.15).abs() < 1e-9);
        assert_eq!(histogram_quantile("", "x", 0.5), None);
    }

    #[test]
    fn ratios_of_repetitions_are_their_median_and_range_by_name() {
        let one = |v: f64| vec![("a".to_owned(), v, ">= 1".to_owned()), ("b".to_owned(), v * 2.0, "(measured)".to_owned())];
        let mut reps = vec![one(0.9), one(0.5), one(0.7)];
        reps[1].truncate(1); // "b" missing from one repetition: its runs did not both run there
        let r = combine(&reps);
        assert_eq!(r.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!((r[0].value, r[0].low, r[0].high, r[0].repetitions), (0.7, 0.5, 0.9, 3));
        assert_eq!(r[0].target, ">= 1");
        // An even count: the mean of the middle two.
        assert!((r[1].value - 1.6).abs() < 1e-12 && r[1].repetitions == 2, "{:?}", r[1]);
    }

    #[test]
    fn the_stream_has_two_percent_duplicates_of_about_200_bytes() {
        let s = stream(100_000, 8);
        let dup = (s.republished + s.mismatched) as f64 / s.records.len() as f64;
        assert!((0.015..0.025).contains(&dup), "{dup}");
        let avg = s.records.iter().map(|r| r.1.len()).sum::<usize>() / s.records.len();
        assert!((180..=230).contains(&avg), "{avg}");
        assert_eq!(s.firsts.len() as u64 + s.republished + s.mismatched, 100_000);
    }
}
