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
//! stopped. Throughput is taken between the first and the last record received (so start-up and group join are
//! left out). Latencies are quantiles of the worker's
//! own histograms, interpolated within buckets as Prometheus' `histogram_quantile` does.

use crate::demo::kafka::EmbeddedKafka;
use crate::demo::postgres::Throwaway;
use crate::key::BusinessKey;
use anyhow::{bail, Context as _};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::BaseRecord;
use rdkafka::ClientConfig;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::{Connection, Executor, PgConnection};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const TOPIC: &str = "bench";
const PIPELINE: &str = "orders";

/// What `idemflow bench` runs.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Records in the stream (default 1,000,000).
    pub records: usize,
    /// Records for run (2), one per transaction.
    pub single_records: usize,
    /// Records for run (6), the per-record SQL form.
    pub sql_records: usize,
    /// Dedup keys preloaded for run (4).
    pub preload: u64,
    /// Use this PostgreSQL server instead of a throwaway cluster (its settings are reported as they are).
    pub database_url: Option<String>,
    /// Where the Markdown table goes.
    pub markdown: PathBuf,
    /// Where the JSON goes.
    pub json: PathBuf,
    /// Only these runs (1..=15); all when empty (a ratio needs both of its runs).
    pub only: Vec<u8>,
    /// Run each worker under `perf record -g` (output `perf-<run>.data` in the current directory).
    pub perf: bool,
    /// The broker: the embedded Kafka (every run), or a throwaway RabbitMQ node, NATS server or RocketMQ name
    /// server and broker (runs 1, 5, 7 and 8).
    pub source: BenchSource,
    /// How many times the selected runs are made, in order, one repetition after another (the embedded Kafka only;
    /// at least 1). Each ratio is then the median of its repetitions', with their lowest and highest: on a shared
    /// machine one repetition's figures move by up to 2x with the host's load, and a change smaller than that shows
    /// only in the median of alternating runs.
    pub repeat: u32,
}

/// The broker a bench reads from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchSource {
    /// An embedded Kafka broker (librdkafka's mock cluster).
    #[default]
    Kafka,
    /// A throwaway RabbitMQ node (Debian's `rabbitmq-server`) with a quorum queue per run.
    Rabbitmq,
    /// A throwaway NATS server with JetStream (Debian's `nats-server`) with a stream per run.
    Nats,
    /// A throwaway RocketMQ name server and broker (the Rust ones from crates.io, `scripts/rocketmq-throwaway.sh`
    /// installs them) with a topic of 4 queues per run.
    Rocketmq,
}

/// One run's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunResult {
    /// `(1)`..`(15)`.
    pub id: String,
    /// Which repetition of the selected runs this is, from 1 (`--repeat`).
    pub repetition: u32,
    /// What ran.
    pub name: String,
    /// Records processed in the timed window.
    pub records: u64,
    /// Seconds of the timed window.
    pub seconds: f64,
    /// Records per second.
    pub records_per_second: f64,
    /// Worker CPU (user + system) per record received, microseconds; `None` when no worker process ran.
    pub cpu_us_per_record: Option<f64>,
    /// Peak resident set of the worker process, MiB.
    pub peak_rss_mib: Option<f64>,
    /// The PostgreSQL cluster's CPU (user + system of the postmaster and every process it started, the ones that
    /// ended included) over the run, per record received, microseconds; `None` when the store is not a local
    /// PostgreSQL whose processes can be read.
    pub db_cpu_us_per_record: Option<f64>,
    /// Bytes of write-ahead log the PostgreSQL server wrote over the run (`pg_current_wal_lsn()` before and after,
    /// the whole server's: checkpoints' full-page images and autovacuum included), per record received. Unlike CPU
    /// time it does not move with the host's load (it is what a run makes the server write and flush), but a
    /// checkpoint inside the run adds the full-page images written after it. `None` on MySQL/MariaDB and Redis.
    pub wal_bytes_per_record: Option<f64>,
    /// Batch duration p50 / p99, milliseconds.
    pub batch_p50_ms: Option<f64>,
    /// Batch duration p99, milliseconds.
    pub batch_p99_ms: Option<f64>,
    /// End-to-end latency p50, milliseconds (from the record's timestamp: the stream was produced before the
    /// run, so this is dominated by the time records waited in the backlog).
    pub e2e_p50_ms: Option<f64>,
    /// End-to-end latency p99, milliseconds.
    pub e2e_p99_ms: Option<f64>,
    /// Notes (duplicates counted, preload time...).
    pub note: String,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Machine and settings.
    pub environment: Vec<(String, String)>,
    /// Each run.
    pub runs: Vec<RunResult>,
    /// Named ratios with their targets.
    pub ratios: Vec<Ratio>,
}

/// One ratio of the report: two runs' figures divided, in each repetition.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// Which runs and figures, e.g. `(1) / (10), against a batched consumer written by hand`.
    pub name: String,
    /// The median over the repetitions (the mean of the middle two for an even count).
    pub value: f64,
    /// The lowest of the repetitions.
    pub low: f64,
    /// The highest of the repetitions.
    pub high: f64,
    /// How many repetitions had both runs.
    pub repetitions: usize,
    /// The target (issue 28's, or `(measured)`).
    pub target: String,
}

/// The ratios of several repetitions, each a list of `(name, value, target)`, combined by name in the order they
/// first appear: the median, lowest and highest of each.
fn combine(repetitions: &[Vec<(String, f64, String)>]) -> Vec<Ratio> {
    let mut names: Vec<(&str, &str)> = Vec::new();
    for (name, _, target) in repetitions.iter().flatten() {
        if !names.iter().any(|(n, _)| n == name) {
            names.push((name, target));
        }
    }
    names
        .into_iter()
        .map(|(name, target)| {
            let mut values: Vec<f64> =
                repetitions.iter().flatten().filter(|(n, _, _)| n == name).map(|(_, v, _)| *v).collect();
            values.sort_by(f64::total_cmp);
            let mid = values.len() / 2;
            let value = if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 };
            Ratio { name: name.to_owned(), value, low: values[0], high: values[values.len() - 1], repetitions: values.len(), target: target.to_owned() }
        })
        .collect()
}

/// The stream: records (partition, payload) and how many distinct keys it has.
struct Stream {
    records: Vec<(i32, Vec<u8>)>,
    /// First occurrence of each key: (index into records).
    firsts: Vec<usize>,
    republished: u64,
    mismatched: u64,
}

fn order(id: u64, cents: u64, account: u64) -> Vec<u8> {
    let mut s = format!(
        r#"{{"order":{{"id":"ORD-{id:010}","account":"ACC-{account:05}","amount":"{}.{:02}","currency":"EUR","channel":"web","note":"#,
        cents / 100,
        cents % 100
    );
    s.push_str(r#""standard delivery, leave at the door""#);
    s.push_str(r#"},"created_at":"2026-11-29T10:00:00Z"}"#);
    s.into_bytes()
}

fn stream(records: usize, partitions: i32) -> Stream {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut s = Stream { records: Vec::with_capacity(records), firsts: Vec::new(), republished: 0, mismatched: 0 };
    let mut sent: Vec<(u64, u64, u64)> = Vec::new();
    while s.records.len() < records {
        let roll = next() % 1000;
        let part = |id: u64| (id % partitions as u64) as i32;
        if roll < 15 && !sent.is_empty() {
            let (id, cents, account) = sent[sent.len() - 1 - (next() as usize % sent.len().min(1000))];
            s.records.push((part(id), order(id, cents, account)));
            s.republished += 1;
        } else if roll < 20 && !sent.is_empty() {
            let (id, cents, account) = sent[next() as usize % sent.len()];
            s.records.push((part(id), order(id, cents + 1, account)));
            s.mismatched += 1;
        } else {
            let id = sent.len() as u64;
            let (cents, account) = (100 + next() % 100_000, next() % 10_000);
            s.firsts.push(s.records.len());
            s.records.push((part(id), order(id, cents, account)));
            sent.push((id, cents, account));
        }
    }
    s
}

const TABLE_SQL: &str = "CREATE TABLE orders (order_id text PRIMARY KEY, account_id text NOT NULL, amount numeric NOT NULL, \
     currency text NOT NULL, created_at timestamptz NOT NULL)";
/// The same table on MySQL/MariaDB.
const MYSQL_TABLE_SQL: &str = "CREATE TABLE orders (order_id VARCHAR(64) PRIMARY KEY, account_id VARCHAR(64) NOT NULL, \
     amount DECIMAL(18, 2) NOT NULL, currency CHAR(3) NOT NULL, created_at TIMESTAMP(6) NOT NULL) \
     ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin";

/// Whether `url` names MySQL or MariaDB.
fn is_mysql(url: &str) -> bool {
    crate::config::Dialect::of_url(url) == crate::config::Dialect::MySql
}

/// Connect settings for `url`, for the bench's own connections.
fn settings_for(url: &str) -> crate::config::DatabaseSettings {
    crate::config::DatabaseSettings { url: url.to_owned().into(), max_connections: 2, acquire_timeout: Duration::from_secs(30), prepared_statements: true, batch_timeout: crate::config::DEFAULT_BATCH_TIMEOUT }
}

/// The business columns and where their values come from, for both forms of the side effect.
const COLUMNS: [(&str, &str); 5] = [
    ("order_id", "/order/id"),
    ("account_id", "/order/account"),
    ("amount", "/order/amount"),
    ("currency", "/order/currency"),
    ("created_at", "/created_at"),
];

fn pipeline_text(sink: &str, mapping: &str, batch: &str) -> String {
    let lines: String = COLUMNS.iter().map(|(c, path)| format!("{c} = \"{path}\"\n")).collect();
    format!("name = \"{PIPELINE}\"\ntopics = [\"{TOPIC}\"]\n[key]\nfield = \"/order/id\"\n[sink]\n{sink}\n[{mapping}]\n{lines}{batch}")
}

/// The table form (one set-based `INSERT` per batch), with an optional `batch.max_records`.
fn table_pipeline(max_records: Option<usize>) -> String {
    let batch = max_records.map(|n| format!("[batch]\nmax_records = {n}\n")).unwrap_or_default();
    pipeline_text("table = \"orders\"", "sink.columns", &batch)
}

/// The table form with default batching and `batch.concurrency = lanes` (runs (14) and (15)).
fn concurrent_table_pipeline(lanes: usize) -> String {
    pipeline_text("table = \"orders\"", "sink.columns", &format!("[batch]\nconcurrency = {lanes}\n"))
}

/// The SQL form of the same side effect: one `INSERT` statement per new record. `created_at` declares its type
/// (MySQL cannot infer it; PostgreSQL ignores the declaration).
fn sql_pipeline() -> String {
    let columns: Vec<&str> = COLUMNS.iter().map(|(c, _)| *c).collect();
    let params: Vec<String> = columns.iter().map(|c| format!(":{c}")).collect();
    let sql = format!("INSERT INTO orders ({}) VALUES ({})", columns.join(", "), params.join(", "));
    pipeline_text(&format!("sql = \"{sql}\""), "sink.params", "")
        .replace("created_at = \"/created_at\"", "created_at = { field = \"/created_at\", type = \"timestamp\" }")
}

/// The shipped example, `pipelines/payments.toml`, as it ships, on the bench's topic (the stream's orders carry the
/// fields it reads: `/order/id`, `/order/account`, `/order/amount`, `/order/currency`; `paid_at` and `details`
/// are optional and absent).
fn payments_pipeline() -> String {
    on_bench_topic(include_str!("../pipelines/payments.toml"))
}

/// The per-record SQL form of the shipped example, `examples/per-record-sql/payments.toml`, on the bench's topic.
fn per_record_payments_pipeline() -> String {
    on_bench_topic(include_str!("../examples/per-record-sql/payments.toml"))
}

/// A payments pipeline file (`topics = ["payments"]`) renamed to the bench's pipeline and moved to its topic.
fn on_bench_topic(shipped: &str) -> String {
    let text = shipped.replace("topics = [\"payments\"]", &format!("name = \"{PIPELINE}\"\ntopics = [\"{TOPIC}\"]"));
    assert_ne!(text, shipped, "a payments pipeline file names its topic as `topics = [\"payments\"]`");
    text
}

/// A database for runs (8), (12) and (13): migrated, with `pipelines/payments.sql` and the stream's 10,000 accounts.
async fn payments_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    let url = fresh_database(admin_url, name).await?;
    let mut conn = PgConnection::connect(&url).await?;
    conn.execute(sqlx::raw_sql(include_str!("../pipelines/payments.sql"))).await?;
    conn.execute("INSERT INTO accounts SELECT 'ACC-' || lpad(g::text, 5, '0'), 1e12 FROM generate_series(0, 9999) g").await?;
    Ok(url)
}

/// The key table of runs (9) to (11): the business key text as the primary key, nothing else.
const KEYS_SQL: &str = "CREATE TABLE processed_keys (business_key text PRIMARY KEY)";

/// A database for runs (9) to (11): the business table and the key table, no idemflow schema.
async fn minimal_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    let mut admin = PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
    admin.execute(format!("DROP DATABASE IF EXISTS {name}").as_str()).await?;
    admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
    let url = format!("{base}/{name}");
    let mut conn = PgConnection::connect(&url).await?;
    conn.execute(TABLE_SQL).await?;
    conn.execute(KEYS_SQL).await?;
    Ok(url)
}

/// The business row of an order payload, as the hand-written consumers and the ceilings read it: order id, account,
/// amount, currency, created_at.
fn order_row(payload: &[u8]) -> Option<[String; 5]> {
    let doc: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let o = &doc["order"];
    let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
    Some([text(&o["id"])?, text(&o["account"])?, text(&o["amount"])?, text(&o["currency"])?, text(&doc["created_at"])?])
}

/// The Redis form of the same side effect: each new order as a hash `order:<id>`.
fn redis_pipeline() -> String {
    let fields: String = COLUMNS.iter().skip(1).map(|(c, _)| format!(", \"{c}\", \"{{{c}}}\"")).collect();
    pipeline_text(&format!("redis = [[\"HSET\", \"order:{{order_id}}\"{fields}]]"), "sink.params", "")
}

/// A database for one run: created on the server, migrated, with the business table.
async fn fresh_database(admin_url: &str, name: &str) -> anyhow::Result<String> {
    if is_mysql(admin_url) {
        let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
        let options = crate::store::mysql::connect_options(&settings_for(&format!("{base}/")))?;
        let mut admin = sqlx::MySqlConnection::connect_with(&options).await.context("connecting to MySQL/MariaDB")?;
        admin.execute(format!("DROP DATABASE IF EXISTS {name}").as_str()).await?;
        admin.execute(format!("CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin").as_str()).await?;
        let url = format!("{base}/{name}");
        let pool = crate::store::mysql::pool(&settings_for(&url))?;
        crate::store::mysql::MIGRATOR.run(&pool).await?;
        sqlx::raw_sql(MYSQL_TABLE_SQL).execute(&pool).await?;
        pool.close().await;
        return Ok(url);
    }
    let mut admin = PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
    admin.execute(format!("DROP DATABASE IF EXISTS {name}").as_str()).await?;
    admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
    let url = format!("{base}/{name}");
    let mut conn = PgConnection::connect(&url).await?;
    crate::store::postgres::MIGRATOR.run(&mut conn).await?;
    conn.execute(TABLE_SQL).await?;
    Ok(url)
}

/// The `le` buckets of a histogram in a Prometheus text scrape, interpolated at quantile `q` (as
/// `histogram_quantile` does). `None` without observations.
pub fn histogram_quantile(scrape: &str, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = scrape
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            let count = l.rsplit_once(' ')?.1.parse().ok()?;
            Some((le, count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in &buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let within = if count > prev.1 { (rank - prev.1) / (count - prev.1) } else { 1.0 };
            return Some(prev.0 + (le - prev.0) * within);
        }
        prev = (le, count);
    }
    None
}

fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{') | Some(b' ')))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// `GET /metrics` from `addr` (HTTP/1.0; 1 s to connect, 5 s to read): the body, empty when it does not answer.
pub(crate) fn scrape(addr: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return String::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()
}

/// Runs `idemflow run` as a child process on `pipeline` against `url` until it has received `target` records;
/// returns the figures.
/// One worker run: its label, the pipeline it runs, its consumer group, and how many records it takes.
struct WorkerRun<'a> {
    id: &'a str,
    name: &'a str,
    pipeline: String,
    group: &'a str,
    target: u64,
}

/// The `[kafka]` settings of a worker run on the embedded broker.
fn kafka_settings(kafka: &EmbeddedKafka) -> String {
    format!("[kafka]\nbootstrap_servers = \"{}\"\n[kafka.properties]\n\"session.timeout.ms\" = \"6000\"\n", kafka.bootstrap_servers())
}

/// Runs the worker as a child process on `pipeline` until it has received `target` records. `broker` is the
/// broker's section of the settings (`[kafka]` or `[rabbitmq]`).
async fn worker_run(run: WorkerRun<'_>, broker: &str, url: &str, perf: bool) -> anyhow::Result<RunResult> {
    let probe = Probe::of(url).await;
    worker_run_on(run, broker, &format!("[database]\nurl = \"{url}\"\nmax_connections = 8\n"), perf, &probe).await
}

/// [`worker_run`] with the store's section of the settings (`[database]` or `[redis]`) given whole. `probe` reads
/// the PostgreSQL server whose CPU and WAL over the run are measured (nothing for another store).
async fn worker_run_on(run: WorkerRun<'_>, broker: &str, store: &str, perf: bool, probe: &Probe) -> anyhow::Result<RunResult> {
    let WorkerRun { id, name, ref pipeline, group, target } = run;
    let dir = tempfile::Builder::new().prefix("idemflow-bench-").tempdir()?;
    std::fs::create_dir(dir.path().join("pipelines"))?;
    std::fs::write(dir.path().join("pipelines/orders.toml"), pipeline.replace("topics =", &format!("group_id = \"{group}\"\ntopics =")))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    std::fs::write(
        dir.path().join("idemflow.toml"),
        format!(
            "pipelines = \"pipelines\"\n{store}{broker}\
             [metrics]\nlisten = \"{addr}\"\n[log]\nlevel = \"warn\"\n"
        ),
    )?;
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.path().join("worker.log"))?;
    let db0 = probe.read().await;
    let child = std::process::Command::new(exe)
        .args(["run", "--config"])
        .arg(dir.path().join("idemflow.toml"))
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting the worker")?;
    let pid = child.id() as libc::pid_t;
    let profiler = if perf {
        let out = format!("perf-{}.data", id.trim_matches(|c| c == '(' || c == ')'));
        Some(
            std::process::Command::new("perf")
                .args(["record", "-g", "-F", "499", "-o", &out, "-p", &pid.to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .inspect_err(|_| {
                    // SAFETY: a signal to our own child.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                })
                .context("starting perf")?,
        )
    } else {
        None
    };
    let received = |m: &str| sample(m, "idemflow_records_received_total");
    let started = Instant::now();
    let mut first: Option<(Instant, f64)> = None;
    let last_scrape = loop {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let m = scrape(addr);
        let n = received(&m);
        if n > 0.0 && first.is_none() {
            first = Some((Instant::now(), n));
        }
        if n >= target as f64 {
            break m;
        }
        if started.elapsed() > Duration::from_secs(1800) {
            let log = std::fs::read_to_string(dir.path().join("worker.log")).unwrap_or_default();
            unsafe { libc::kill(pid, libc::SIGKILL) };
            bail!("{id}: the worker received {n} of {target} records in 30 minutes; its log:\n{log}");
        }
        if started.elapsed() > Duration::from_secs(60) && first.is_none() {
            let log = std::fs::read_to_string(dir.path().join("worker.log")).unwrap_or_default();
            unsafe { libc::kill(pid, libc::SIGKILL) };
            bail!("{id}: the worker received nothing in 60 s; its log:\n{log}");
        }
    };
    let end = Instant::now();
    let (db_cpu, wal) = probe.since(db0, received(&last_scrape)).await;
    // CPU up to the target (utime + stime of /proc/<pid>/stat, in clock ticks): the worker's shutdown is not what a
    // record costs. With a backlog left (runs over a prefix), closing the consumer costs seconds of CPU in
    // librdkafka, which the whole-process figure from wait4 includes.
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| {
        let fields: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
        Some(fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?)
    });
    // SAFETY: sysconf has no preconditions.
    let cpu_at_target = ticks.map(|t| t / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64);
    if let Some(mut p) = profiler {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(p.id() as libc::pid_t, libc::SIGINT) };
        let _ = p.wait();
    }
    let (mut t0, mut n0) = first.unwrap_or((started, 0.0));
    let mut short = "";
    if received(&last_scrape) - n0 <= 0.0 {
        // Everything arrived before the first scrape saw anything: time it from the start of the process.
        (t0, n0) = (started, 0.0);
        short = " (run shorter than a scrape: timed from process start)";
    }
    let total = received(&last_scrape);
    // The peak RSS of the worker's own address space (VmHWM; reset by exec). wait4's ru_maxrss would not do: Linux
    // carries the high-water mark of the forked copy of this (large) process across exec.
    let peak_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()));
    // SAFETY: plain syscalls on our own child's pid; `usage` is a zeroed out-parameter.
    let usage = unsafe {
        libc::kill(pid, libc::SIGTERM);
        let mut status = 0;
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::wait4(pid, &mut status, 0, &mut usage);
        usage
    };
    drop(child);
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let whole = secs(usage.ru_utime) + secs(usage.ru_stime);
    let cpu = cpu_at_target.unwrap_or(whole);
    let window = end.duration_since(t0).as_secs_f64().max(1e-9);
    let processed = total - n0;
    let ms = |v: Option<f64>| v.map(|s| s * 1000.0);
    let dup = sample(&last_scrape, "idemflow_duplicates_skipped_total");
    // A rebalance during the run redelivers what was committed in the database but not yet in Kafka: say so.
    let revocations: f64 = last_scrape
        .lines()
        .filter(|l| l.starts_with("idemflow_rebalances_total{") && l.contains("event=\"revoke\""))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum();
    let rebalanced = if revocations > 0.0 { format!(" ({revocations} rebalance revocations)") } else { String::new() };
    Ok(RunResult {
        id: id.into(),
        repetition: 1,
        name: name.into(),
        records: processed as u64,
        seconds: window,
        records_per_second: processed / window,
        cpu_us_per_record: Some(cpu * 1e6 / total.max(1.0)),
        peak_rss_mib: peak_kib.map(|k| k / 1024.0),
        db_cpu_us_per_record: db_cpu,
        wal_bytes_per_record: wal,
        batch_p50_ms: ms(histogram_quantile(&last_scrape, "idemflow_batch_duration_seconds", 0.5)),
        batch_p99_ms: ms(histogram_quantile(&last_scrape, "idemflow_batch_duration_seconds", 0.99)),
        e2e_p50_ms: ms(histogram_quantile(&last_scrape, "idemflow_end_to_end_latency_seconds", 0.5)),
        e2e_p99_ms: ms(histogram_quantile(&last_scrape, "idemflow_end_to_end_latency_seconds", 0.99)),
        note: format!(
            "{total} received, {} applied, {dup} duplicates skipped{rebalanced}; CPU {cpu:.2} s to the target, {whole:.2} s with shutdown{short}",
            sample(&last_scrape, "idemflow_records_applied_total")
        ),
    })
}

/// Run (3): the same dedup rows and business rows, loaded with `COPY` into the same indexed tables in one
/// transaction.
async fn copy_ceiling(url: &str, s: &Stream, total: usize) -> anyhow::Result<RunResult> {
    let mut dedup = String::with_capacity(s.firsts.len() * 200);
    let mut orders = String::with_capacity(s.firsts.len() * 120);
    let hex = crate::terminal::hex;
    for &i in &s.firsts {
        let (partition, payload) = &s.records[i];
        let doc: serde_json::Value = serde_json::from_slice(payload)?;
        let o = &doc["order"];
        let id = o["id"].as_str().unwrap_or_default();
        let key = BusinessKey::new(id.to_owned());
        let fingerprint: [u8; 32] = Sha256::digest(payload).into();
        dedup.push_str(&format!(
            "{PIPELINE}\t\\\\x{}\t{id}\t{TOPIC}\t{partition}\t{i}\t\\\\x{}\n",
            hex(&key.key_id()),
            hex(&fingerprint)
        ));
        orders.push_str(&format!(
            "{id}\t{}\t{}\t{}\t{}\n",
            o["account"].as_str().unwrap_or_default(),
            o["amount"].as_str().unwrap_or_default(),
            o["currency"].as_str().unwrap_or_default(),
            doc["created_at"].as_str().unwrap_or_default()
        ));
    }
    let copy_dedup = r#"COPY idemflow.dedup (pipeline, key_id, business_key, topic, partition, "offset", fingerprint) FROM STDIN"#;
    let secs = copy_with_orders(url, copy_dedup, &dedup, &orders).await?;
    Ok(RunResult {
        id: "(3)".into(),
        name: "ceiling: COPY of the same dedup and business rows, no Kafka".into(),
        records: total as u64,
        seconds: secs,
        records_per_second: total as f64 / secs,
        note: format!("{} dedup rows and {} business rows for {total} records", s.firsts.len(), s.firsts.len()),
        ..RunResult::default()
    })
}

/// Loads `rows` with `copy` (a `COPY ... FROM STDIN` in text format) and `orders` into the business table, in one
/// transaction on a new connection to `url`; returns the seconds from `BEGIN` to the end of `COMMIT`.
async fn copy_with_orders(url: &str, copy: &str, rows: &str, orders: &str) -> anyhow::Result<f64> {
    let mut conn = PgConnection::connect(url).await?;
    let started = Instant::now();
    let mut tx = conn.begin().await?;
    for (sql, data) in [(copy, rows), ("COPY orders (order_id, account_id, amount, currency, created_at) FROM STDIN", orders)] {
        let mut copy = tx.copy_in_raw(sql).await?;
        copy.send(data.as_bytes()).await?;
        copy.finish().await?;
    }
    tx.commit().await?;
    Ok(started.elapsed().as_secs_f64())
}

/// Run (9): the business rows and one key row per distinct key, loaded with `COPY` into fresh tables (the key text
/// as the primary key) in one transaction.
async fn minimal_copy_ceiling(url: &str, s: &Stream, total: usize) -> anyhow::Result<RunResult> {
    let mut keys = String::with_capacity(s.firsts.len() * 20);
    let mut orders = String::with_capacity(s.firsts.len() * 120);
    for &i in &s.firsts {
        let row = order_row(&s.records[i].1).context("(9): an order without its fields")?;
        keys.push_str(&row[0]);
        keys.push('\n');
        orders.push_str(&row.join("\t"));
        orders.push('\n');
    }
    let secs = copy_with_orders(url, "COPY processed_keys (business_key) FROM STDIN", &keys, &orders).await?;
    Ok(RunResult {
        id: "(9)".into(),
        name: "ceiling: COPY of the minimal rows (business rows, one key-text primary key row per key), no Kafka".into(),
        records: total as u64,
        seconds: secs,
        records_per_second: total as f64 / secs,
        note: format!("{} key rows and {} business rows for {total} records", s.firsts.len(), s.firsts.len()),
        ..RunResult::default()
    })
}

/// A consumer of the bench topic for runs (10) and (11), with the worker's fetch settings.
fn hand_written_consumer(kafka: &EmbeddedKafka, group: &str) -> anyhow::Result<BaseConsumer> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap_servers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("queued.min.messages", "8000")
        .set("queued.max.messages.kbytes", "16384")
        .set("fetch.max.bytes", "8388608")
        .set("fetch.queue.backoff.ms", "20")
        .create()?;
    consumer.subscribe(&[TOPIC])?;
    Ok(consumer)
}

/// Run (10): a batched consumer as one would write it by hand (see the module documentation), over `total` records.
async fn hand_written_batched(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str) -> anyhow::Result<RunResult> {
    use rdkafka::consumer::CommitMode;
    use rdkafka::Message as _;
    let consumer = hand_written_consumer(kafka, group)?;
    let mut conn = PgConnection::connect(url).await?;
    let (mut n, mut applied, mut t0) = (0usize, 0u64, None);
    let deadline = Instant::now() + Duration::from_secs(900);
    let probe = Probe::of(url).await;
    let db0 = probe.read().await;
    let cpu0 = process_cpu_seconds();
    while n < total {
        if Instant::now() > deadline {
            bail!("(10): consumed {n} of {total} records in 15 minutes");
        }
        let mut columns: [Vec<String>; 5] = Default::default();
        let mut seen = std::collections::HashSet::new();
        let mut taken = 0;
        let batch_started = Instant::now();
        while taken < 2000 && n + taken < total && batch_started.elapsed() < Duration::from_millis(20) {
            match consumer.poll(Duration::from_millis(5)) {
                Some(Ok(m)) => {
                    t0.get_or_insert_with(Instant::now);
                    taken += 1;
                    if let Some(row) = m.payload().and_then(order_row) {
                        if seen.insert(row[0].clone()) {
                            for (c, v) in columns.iter_mut().zip(row) {
                                c.push(v);
                            }
                        }
                    }
                }
                Some(Err(e)) => tracing::debug!(error = %e, "consume error"),
                None => {}
            }
        }
        if taken == 0 {
            continue;
        }
        let mut tx = conn.begin().await?;
        let done = sqlx::query(
            "WITH new AS (INSERT INTO processed_keys (business_key) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING \
             RETURNING business_key) \
             INSERT INTO orders (order_id, account_id, amount, currency, created_at) \
             SELECT u.id, u.account, u.amount::numeric, u.currency, u.created_at::timestamptz \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS u(id, account, amount, currency, created_at) \
             JOIN new ON new.business_key = u.id",
        )
        .bind(&columns[0])
        .bind(&columns[1])
        .bind(&columns[2])
        .bind(&columns[3])
        .bind(&columns[4])
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        applied += done.rows_affected();
        consumer.commit_consumer_state(CommitMode::Async)?;
        n += taken;
    }
    let mut r = ceiling_result("a batched consumer written by hand (unnest + ON CONFLICT, 2,000 per transaction)", n, t0, format!("{applied} applied; CPU is the bench process's, the embedded broker's included"));
    r.id = "(10)".into();
    r.cpu_us_per_record = Some((process_cpu_seconds() - cpu0) * 1e6 / n.max(1) as f64);
    (r.db_cpu_us_per_record, r.wal_bytes_per_record) = probe.since(db0, n as f64).await;
    Ok(r)
}

/// Run (11): the design guides' consumer, one transaction per message, over `total` records.
async fn per_message(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str) -> anyhow::Result<RunResult> {
    use rdkafka::consumer::CommitMode;
    use rdkafka::Message as _;
    let consumer = hand_written_consumer(kafka, group)?;
    let mut conn = PgConnection::connect(url).await?;
    let (mut n, mut applied, mut t0) = (0usize, 0u64, None);
    let deadline = Instant::now() + Duration::from_secs(900);
    let cpu0 = process_cpu_seconds();
    while n < total {
        if Instant::now() > deadline {
            bail!("(11): consumed {n} of {total} records in 15 minutes");
        }
        let m = match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "consume error");
                continue;
            }
            None => continue,
        };
        t0.get_or_insert_with(Instant::now);
        if let Some(row) = m.payload().and_then(order_row) {
            let mut tx = conn.begin().await?;
            let new = sqlx::query("INSERT INTO processed_keys (business_key) VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(&row[0])
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if new == 1 {
                sqlx::query("INSERT INTO orders (order_id, account_id, amount, currency, created_at) VALUES ($1, $2, $3::numeric, $4, $5::timestamptz)")
                    .bind(&row[0])
                    .bind(&row[1])
                    .bind(&row[2])
                    .bind(&row[3])
                    .bind(&row[4])
                    .execute(&mut *tx)
                    .await?;
                applied += 1;
            }
            tx.commit().await?;
        }
        consumer.commit_message(&m, CommitMode::Sync)?;
        n += 1;
    }
    let mut r = ceiling_result("the guides' consumer: one transaction and one synchronous offset commit per message", n, t0, format!("{applied} applied; CPU is the bench process's, the embedded broker's included"));
    r.id = "(11)".into();
    r.cpu_us_per_record = Some((process_cpu_seconds() - cpu0) * 1e6 / n.max(1) as f64);
    Ok(r)
}

/// CPU seconds (user + system) of this process so far; the hand-written consumers run inside it, beside the
/// embedded Kafka broker, whose CPU is counted with theirs: their CPU figures are upper bounds.
fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills a zeroed out-parameter.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// A local PostgreSQL cluster whose CPU time can be read from `/proc`: its postmaster's process id.
#[derive(Clone, Copy, Debug)]
struct Cluster(i32);

impl Cluster {
    /// The cluster serving `url`: the parent of the backend that answers (the postmaster). `None` for another
    /// store, or a server whose processes this one cannot see (another machine, another namespace).
    async fn of(url: &str) -> Option<Cluster> {
        if is_mysql(url) {
            return None;
        }
        let mut conn = PgConnection::connect(url).await.ok()?;
        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn).await.ok()?;
        // Read while the backend lives: it ends with the connection.
        let stat = std::fs::read_to_string(format!("/proc/{backend}/stat")).ok();
        let _ = conn.close().await;
        let stat = stat?;
        let postmaster: i32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        Some(Cluster(postmaster))
    }

    /// CPU seconds the cluster has used so far: the postmaster's own and its ended children's (`utime`, `stime`,
    /// `cutime`, `cstime` of `/proc/<pid>/stat`), and the running children's (backends, WAL writer, checkpointer,
    /// autovacuum). A backend that ends between two readings moves from the second sum to the first, whole.
    fn cpu_seconds(self) -> Option<f64> {
        let fields = |pid: i32| -> Option<(i32, [f64; 4])> {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            Some((f.get(1)?.parse().ok()?, [n(11), n(12), n(13), n(14)]))
        };
        let (_, own) = fields(self.0)?;
        let mut ticks: f64 = own.iter().sum();
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            if let Some((_, t)) = fields(pid).filter(|(parent, _)| *parent == self.0) {
                ticks += t[0] + t[1];
            }
        }
        // SAFETY: sysconf has no preconditions.
        Some(ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64)
    }
}

/// What the bench reads of a PostgreSQL server over a run: its cluster's CPU (when its processes are local) and
/// its write-ahead log position. Reads nothing for MySQL/MariaDB or Redis.
#[derive(Clone, Debug, Default)]
struct Probe {
    cluster: Option<Cluster>,
    url: Option<String>,
}

/// One [`Probe::read`]: cluster CPU seconds and WAL bytes so far.
#[derive(Clone, Copy, Debug)]
struct Reading {
    cpu: Option<f64>,
    wal: Option<f64>,
}

impl Probe {
    async fn of(url: &str) -> Probe {
        if is_mysql(url) {
            return Probe::default();
        }
        Probe { cluster: Cluster::of(url).await, url: Some(url.to_owned()) }
    }

    /// The server's figures now. The WAL position is read on a connection of its own, before the CPU at the start
    /// of a run and after it at the end ([`Probe::since`]), so the connection's own CPU falls outside the window.
    async fn read(&self) -> Reading {
        let wal = self.wal().await;
        Reading { cpu: self.cluster.and_then(Cluster::cpu_seconds), wal }
    }

    /// Bytes written to the WAL so far (`pg_current_wal_lsn()` from 0/0).
    async fn wal(&self) -> Option<f64> {
        let mut conn = PgConnection::connect(self.url.as_deref()?).await.ok()?;
        let bytes: f64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8").fetch_one(&mut conn).await.ok()?;
        let _ = conn.close().await;
        Some(bytes)
    }

    /// Cluster CPU microseconds and WAL bytes per record between `before` and now.
    async fn since(&self, before: Reading, records: f64) -> (Option<f64>, Option<f64>) {
        let cpu = self.cluster.and_then(Cluster::cpu_seconds);
        let wal = self.wal().await;
        let per = |now: Option<f64>, then: Option<f64>, scale: f64| Some((now? - then?) * scale / records.max(1.0));
        (per(cpu, before.cpu, 1e6), per(wal, before.wal, 1.0))
    }
}

/// Run (5): consume the whole topic, decode and extract each key; no database.
/// The pipeline `text` and its record preparation, checked against the database at `url` as the worker would.
async fn preparer(url: &str, text: &str) -> anyhow::Result<(crate::config::Pipeline, crate::prepare::Preparer)> {
    let dir = tempfile::Builder::new().prefix("idemflow-bench-").tempdir()?;
    let file = dir.path().join("orders.toml");
    std::fs::write(&file, text)?;
    let pipeline = crate::config::pipeline::load_file_in(&file, crate::config::Dialect::of_url(url)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let store = crate::store::Store::connect(&settings_for(url))?;
    let ready = crate::worker::prepare(&store, std::slice::from_ref(&pipeline)).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
    store.close().await;
    Ok((pipeline, ready[0].preparer.clone()))
}

/// A consume-only run's figures: `n` records since `t0`.
fn ceiling_result(name: &str, n: usize, t0: Option<Instant>, note: String) -> RunResult {
    let secs = t0.map_or(0.0, |t| t.elapsed().as_secs_f64()).max(1e-9);
    RunResult {
        id: "(5)".into(),
        name: name.into(),
        records: n as u64,
        seconds: secs,
        records_per_second: n as f64 / secs,
        note,
        ..RunResult::default()
    }
}

async fn consume_only(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str) -> anyhow::Result<RunResult> {
    let (pipeline, preparer) = preparer(url, &table_pipeline(None)).await?;
    let max_payload_bytes = pipeline.decoder.max_payload_bytes();
    let bootstrap = kafka.bootstrap_servers().to_owned();
    let group = group.to_owned();
    tokio::task::spawn_blocking(move || -> anyhow::Result<RunResult> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()?;
        consumer.subscribe(&[TOPIC])?;
        let topic: std::sync::Arc<str> = std::sync::Arc::from(TOPIC);
        let mut n = 0usize;
        let mut applied = 0usize;
        let mut t0 = None;
        let deadline = Instant::now() + Duration::from_secs(600);
        while n < total {
            if Instant::now() > deadline {
                bail!("(5): consumed {n} of {total} records in 10 minutes");
            }
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    t0.get_or_insert_with(Instant::now);
                    let record = crate::source::kafka::to_record(&m, topic.clone(), max_payload_bytes);
                    if matches!(preparer.prepare(&record), crate::prepare::Prepared::Apply(_)) {
                        applied += 1;
                    }
                    n += 1;
                }
                Some(Err(e)) => tracing::debug!(error = %e, "consume error"),
                None => {}
            }
        }
        let name = "ceiling: consume-only pass (decode and key extraction, no database)";
        Ok(ceiling_result(name, n, t0, format!("{applied} records prepared for applying")))
    })
    .await?
}

async fn environment(admin_url: &str, throwaway: bool, o: &BenchOptions, partitions: i32) -> anyhow::Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':').map(|(_, v)| v.trim().to_owned()))
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .map(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()).unwrap_or(0) / 1024 / 1024)
        .unwrap_or(0);
    env.push(("machine".into(), format!("{cores} cores ({cpu}), {mem} GiB RAM")));
    if is_mysql(admin_url) {
        let mut conn = sqlx::MySqlConnection::connect_with(&crate::store::mysql::connect_options(&settings_for(admin_url))?).await?;
        let version: String = sqlx::query_scalar("SELECT CAST(VERSION() AS CHAR)").fetch_one(&mut conn).await?;
        env.push(("mysql".into(), version));
        for setting in ["innodb_flush_log_at_trx_commit", "sync_binlog", "log_bin", "innodb_buffer_pool_size", "innodb_doublewrite"] {
            let value: Option<String> = sqlx::query_scalar(&format!("SELECT CAST(@@GLOBAL.{setting} AS CHAR)")).fetch_one(&mut conn).await?;
            env.push((setting.into(), value.unwrap_or_default()));
        }
    } else {
        let mut conn = PgConnection::connect(admin_url).await?;
        let version: String = sqlx::query_scalar("SELECT version()").fetch_one(&mut conn).await?;
        env.push(("postgres".into(), format!("{version}{}", if throwaway { " (throwaway cluster on local disk)" } else { "" })));
        for setting in ["synchronous_commit", "fsync", "full_page_writes", "wal_level", "shared_buffers", "max_wal_size"] {
            let value: String = sqlx::query_scalar(&format!("SHOW {setting}")).fetch_one(&mut conn).await?;
            env.push((setting.into(), value));
        }
    }
    env.push(("kafka".into(), format!("librdkafka {} mock cluster, 1 broker, {partitions} partitions", rdkafka::util::get_rdkafka_version().1)));
    env.push((
        "stream".into(),
        if is_mysql(admin_url) {
            format!("{} records; runs (2) and (6) over the first {} and {}", o.records, o.single_records.min(o.records), o.sql_records.min(o.records))
        } else {
            format!("{} records; runs (2) and (6) over the first {} and {}; (4) with {} dedup keys preloaded", o.records, o.single_records.min(o.records), o.sql_records.min(o.records), o.preload)
        },
    ));
    env.push(("idemflow".into(), format!("{} (release build: {})", env!("CARGO_PKG_VERSION"), !cfg!(debug_assertions))));
    Ok(env)
}

/// Preloads `keys` dedup rows of other keys for the pipeline (run (4)); returns the seconds it took.
async fn preload(url: &str, keys: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut conn = PgConnection::connect(url).await?;
    eprintln!("(4) preloading {keys} dedup keys...");
    sqlx::query(
        r#"INSERT INTO idemflow.dedup (pipeline, key_id, business_key, topic, partition, "offset", fingerprint)
           SELECT $1, convert_to('PRE-' || g, 'UTF8'), 'PRE-' || g, 'preload', 0, g, sha256(convert_to(g::text, 'UTF8'))
           FROM generate_series(1, $2::int8) g"#,
    )
    .bind(PIPELINE)
    .bind(keys as i64)
    .execute(&mut conn)
    .await?;
    conn.execute("VACUUM ANALYZE idemflow.dedup").await?;
    Ok(started.elapsed().as_secs_f64())
}

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
        return run_one_stream(&o, &admin_url).await;
    }
    let mysql = is_mysql(&admin_url);
    let kafka = EmbeddedKafka::start()?;
    // About 200 bytes a record; the mock keeps about 5 MiB per partition: stay under 2 MiB.
    let partitions = ((o.records * 230) / (2 << 20) + 1).max(4) as i32;
    kafka.create_topic(TOPIC, partitions)?;
    let env = environment(&admin_url, o.database_url.is_none(), &o, partitions).await?;
    for (k, v) in &env {
        eprintln!("{k}: {v}");
    }
    let s = stream(o.records, partitions);
    let started = Instant::now();
    for (partition, value) in &s.records {
        kafka.send(BaseRecord::<[u8], [u8]>::to(TOPIC).partition(*partition).payload(value))?;
    }
    kafka.flush()?;
    let avg = s.records.iter().map(|r| r.1.len()).sum::<usize>() / s.records.len().max(1);
    eprintln!(
        "produced {} records ({avg} bytes on average; {} distinct keys, {} republished, {} payload mismatches) in {:.1} s",
        s.records.len(), s.firsts.len(), s.republished, s.mismatched, started.elapsed().as_secs_f64()
    );
    let total = s.records.len() as u64;
    let mut runs = Vec::new();
    let report_run = |r: &RunResult| eprintln!("{} {}: {:.0} records/s ({})", r.id, r.name, r.records_per_second, r.note);

    // On MySQL/MariaDB, runs (3) and (4) are PostgreSQL's (a COPY ceiling, a preload with generate_series).
    let want = |n: u8| (o.only.is_empty() || o.only.contains(&n)) && !(mysql && matches!(n, 3 | 4 | 8..=15));
    let perf = o.perf;
    if mysql {
        eprintln!("MySQL/MariaDB: runs (1), (2), (5) and (6); (3), (4) and (8) to (15) are PostgreSQL's");
    }

    let mut repetitions = Vec::new();
    for repetition in 1..=o.repeat.max(1) {
        // Each repetition's consumer groups are new, so each reads the topic from its start.
        let tag = if repetition == 1 { String::new() } else { format!("-r{repetition}") };
        let group = |n: u8| format!("bench-{n}{tag}");
        let first = runs.len();
        for n in 1..=15u8 {
            if !want(n) {
                continue;
            }
            let r = if (8..=15).contains(&n) {
                match n {
                    14 | 15 => {
                        let lanes = if n == 14 { 2 } else { 4 };
                        let url = fresh_database(&admin_url, &format!("bench_{n}")).await?;
                        let (id, name) = if n == 14 {
                            ("(14)", "idemflow, default batching (table form), batch.concurrency = 2")
                        } else {
                            ("(15)", "idemflow, default batching (table form), batch.concurrency = 4")
                        };
                        let group = group(n);
                        let run = WorkerRun { id, name, pipeline: concurrent_table_pipeline(lanes), group: &group, target: total };
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
                        let url = payments_database(&admin_url, "bench_13").await?;
                        let name = "idemflow, the shipped example in the per-record SQL form, examples/per-record-sql/payments.toml";
                        let run = WorkerRun { id: "(13)", name, pipeline: per_record_payments_pipeline(), group: &group(13), target: total };
                        worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                    }
                    12 => {
                        let url = payments_database(&admin_url, "bench_12").await?;
                        let name = "idemflow, the per-record SQL form with one round trip per statement and record (its INSERT given RETURNING)";
                        let per_record = per_record_payments_pipeline();
                        let pipeline = per_record.replace(":paid_at, :details)", ":paid_at, :details) RETURNING order_id");
                        anyhow::ensure!(pipeline != per_record, "examples/per-record-sql/payments.toml's INSERT ends with `:paid_at, :details)`");
                        let single = o.single_records.min(o.records) as u64;
                        let run = WorkerRun { id: "(12)", name, pipeline, group: &group(12), target: single };
                        worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                    }
                    8 => {
                        let url = payments_database(&admin_url, "bench_8").await?;
                        let name = "idemflow, the shipped example pipelines/payments.toml (batch SQL form: INSERT payments + UPDATE accounts per batch)";
                        let run = WorkerRun { id: "(8)", name, pipeline: payments_pipeline(), group: &group(8), target: total };
                        worker_run(run, &kafka_settings(&kafka), &url, perf).await?
                    }
                    9 => minimal_copy_ceiling(&minimal_database(&admin_url, "bench_9").await?, &s, s.records.len()).await?,
                    10 => hand_written_batched(&kafka, &minimal_database(&admin_url, "bench_10").await?, s.records.len(), &group(10)).await?,
                    _ => {
                        let single = o.single_records.min(o.records);
                        per_message(&kafka, &minimal_database(&admin_url, "bench_11").await?, single, &group(11)).await?
                    }
                }
            } else if n == 7 {
                if mysql {
                    continue;
                }
                let redis = match crate::demo::redis::Throwaway::start() {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("(7) skipped: {e}");
                        continue;
                    }
                };
                eprintln!("redis: {} (throwaway server, appendonly yes, appendfsync everysec)", redis.version());
                let run = WorkerRun { id: "(7)", name: "idemflow, Redis sink (one script per batch)", pipeline: redis_pipeline(), group: &group(7), target: total };
                let store = format!("[redis]\nurl = \"{}\"\n", redis.url());
                worker_run_on(run, &kafka_settings(&kafka), &store, perf, &Probe::default()).await?
            } else {
                let url = fresh_database(&admin_url, &format!("bench_{n}")).await?;
                let run_group = group(n);
                let worker = |id, name, pipeline, target| WorkerRun { id, name, pipeline, group: &run_group, target };
                match n {
                    1 => worker_run(worker("(1)", "idemflow, default batching (table form)", table_pipeline(None), total), &kafka_settings(&kafka), &url, perf).await?,
                    2 => {
                        let single = o.single_records.min(o.records) as u64;
                        let name = "idemflow, one record per transaction (max_records = 1)";
                        worker_run(worker("(2)", name, table_pipeline(Some(1)), single), &kafka_settings(&kafka), &url, perf).await?
                    }
                    3 => copy_ceiling(&url, &s, s.records.len()).await?,
                    4 => {
                        let preload_secs = preload(&url, o.preload).await?;
                        let name = "idemflow, default batching, dedup store preloaded";
                        let mut r = worker_run(worker("(4)", name, table_pipeline(None), total), &kafka_settings(&kafka), &url, perf).await?;
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
            };
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

/// The ratios of one repetition's runs, `(name, value, target)`, each where both of its runs ran.
fn ratios(runs: &[RunResult], mysql: bool) -> Vec<(String, f64, String)> {
    let rate = |id: &str| runs.iter().find(|r| r.id == id).map(|r| r.records_per_second);
    let mut ratios = Vec::new();
    let mut ratio = |name: &str, a: Option<f64>, b: Option<f64>, target: &str| {
        if let (Some(a), Some(b)) = (a, b) {
            ratios.push((name.to_owned(), a / b, target.to_owned()));
        }
    };
    if mysql {
        ratio("(1) / (5)", rate("(1)"), rate("(5)"), "(measured)");
        ratio("(1) / (2)", rate("(1)"), rate("(2)"), "(measured)");
        ratio("(6) / (1)", rate("(6)"), rate("(1)"), "(measured)");
        return ratios;
    }
    let floor = rate("(3)").zip(rate("(5)")).map(|(c, k)| c.min(k));
    ratio("(1) / min((3), (5))", rate("(1)"), floor, ">= 0.60");
    ratio("(1) / (2)", rate("(1)"), rate("(2)"), ">= 50");
    ratio("(4) / (1)", rate("(4)"), rate("(1)"), ">= 0.80");
    ratio("(6) / (1)", rate("(6)"), rate("(1)"), "(measured)");
    ratio("(7) / (1), Redis against the Postgres table form", rate("(7)"), rate("(1)"), ">= 2");
    ratio("(7) / (5), Redis against consume-only", rate("(7)"), rate("(5)"), ">= 0.60");
    ratio("(8) / (1), the shipped example (batch SQL form) against the table form", rate("(8)"), rate("(1)"), ">= 0.60");
    ratio("(8) / (13), the shipped example against its per-record SQL form", rate("(8)"), rate("(13)"), "(measured)");
    ratio("(13) / (12), the per-record SQL form: server-side loop against per-record round trips", rate("(13)"), rate("(12)"), "(measured)");
    ratio("(14) / (1), two batch transactions at once against one", rate("(14)"), rate("(1)"), "(measured)");
    ratio("(15) / (1), four batch transactions at once against one", rate("(15)"), rate("(1)"), "(measured)");
    ratio("(1) / (9), the table form against COPY of the minimal rows", rate("(1)"), rate("(9)"), ">= 0.50");
    ratio("(1) / (10), against a batched consumer written by hand", rate("(1)"), rate("(10)"), ">= 1.0");
    ratio("(14) / (10), two batch transactions at once against the hand-written consumer", rate("(14)"), rate("(10)"), ">= 1.6");
    let db_cpu = |id: &str| runs.iter().find(|r| r.id == id).and_then(|r| r.db_cpu_us_per_record);
    ratio("PostgreSQL CPU per record, (1) / (10)", db_cpu("(1)"), db_cpu("(10)"), "<= 1.2");
    let wal = |id: &str| runs.iter().find(|r| r.id == id).and_then(|r| r.wal_bytes_per_record);
    ratio("PostgreSQL WAL bytes per record, (1) / (10)", wal("(1)"), wal("(10)"), "(measured)");
    ratio("(1) / (11), against the guides' per-message consumer", rate("(1)"), rate("(11)"), "(measured)");
    ratios
}

/// A broker the bench reads through one queue or stream per run, its messages published before timing starts:
/// RabbitMQ (`--source rabbitmq`, a quorum queue per run), NATS JetStream (`--source nats`, a stream per run,
/// read by a durable pull consumer the worker creates) or RocketMQ (`--source rocketmq`, a topic of 4 queues per
/// run, read by the worker's pull consumer in clustering mode).
enum OneStream {
    RabbitMq(crate::demo::rabbitmq::Throwaway),
    Nats(crate::demo::nats::Throwaway),
    RocketMq(crate::demo::rocketmq::Throwaway),
}

impl OneStream {
    fn start(source: BenchSource) -> anyhow::Result<OneStream> {
        Ok(match source {
            BenchSource::Nats => {
                eprintln!("starting a throwaway NATS server with JetStream (Debian's nats-server)...");
                OneStream::Nats(crate::demo::nats::Throwaway::start()?)
            }
            BenchSource::Rocketmq => {
                eprintln!("starting a throwaway RocketMQ name server and broker (rocketmq-namesrv-rust, rocketmq-broker-rust)...");
                OneStream::RocketMq(crate::demo::rocketmq::Throwaway::start()?)
            }
            BenchSource::Rabbitmq | BenchSource::Kafka => {
                eprintln!("starting a throwaway RabbitMQ node (Debian's rabbitmq-server)...");
                OneStream::RabbitMq(crate::demo::rabbitmq::Throwaway::start()?)
            }
        })
    }

    /// Its name in the runs' names and ratios, and in database names.
    fn tag(&self) -> (&'static str, &'static str) {
        match self {
            OneStream::RabbitMq(_) => ("rabbitmq", "RabbitMQ"),
            OneStream::Nats(_) => ("nats", "NATS JetStream"),
            OneStream::RocketMq(_) => ("rocketmq", "RocketMQ"),
        }
    }

    /// The broker's line of the environment table.
    fn describe(&self) -> String {
        match self {
            OneStream::RabbitMq(node) => format!("RabbitMQ {} (throwaway node, quorum queues)", node.ctl(&["version"]).unwrap_or_default().trim()),
            OneStream::Nats(server) => {
                format!("{} (throwaway server, JetStream file storage, a durable pull consumer with explicit acks)", server.version())
            }
            OneStream::RocketMq(_) => "RocketMQ name server and broker, the Rust implementation from crates.io (throwaway, one broker, a topic of 4 queues per run, consume offsets kept by the broker)".to_owned(),
        }
    }

    /// Where run `n` reads, in the runs' names.
    fn what(&self) -> &'static str {
        match self {
            OneStream::RabbitMq(_) => "a RabbitMQ quorum queue",
            OneStream::Nats(_) => "a NATS JetStream stream",
            OneStream::RocketMq(_) => "a RocketMQ topic",
        }
    }

    fn name(n: u8) -> String {
        format!("bench-{n}")
    }

    /// Creates run `n`'s queue or stream and publishes `messages` to it, each confirmed by the broker. A JetStream
    /// publish carries no Nats-Msg-Id: the stream keeps the republished copies, as the Kafka and RabbitMQ runs do.
    async fn publish(&self, n: u8, messages: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
        match self {
            OneStream::RabbitMq(node) => {
                crate::demo::rabbitmq::declare_quorum_queue(&node.url(), &Self::name(n)).await?;
                crate::demo::rabbitmq::publish(&node.url(), &Self::name(n), messages).await
            }
            OneStream::Nats(server) => {
                let stream = format!("BENCH_{n}");
                crate::demo::nats::create_stream(&server.url(), &stream, &stream).await?;
                crate::demo::nats::publish(&server.url(), &format!("{stream}.payments"), messages, false).await.map(drop)
            }
            OneStream::RocketMq(node) => {
                let bodies: Vec<Vec<u8>> = messages.iter().map(|(_, body)| body.clone()).collect();
                crate::demo::rocketmq::publish(&node.name_server(), &Self::name(n), &bodies).await
            }
        }
    }

    /// The `[source]` of run `n`.
    fn source(&self, n: u8) -> String {
        match self {
            OneStream::RabbitMq(_) => format!("[source]\nkind = \"rabbitmq\"\nqueue = \"{}\"", Self::name(n)),
            OneStream::Nats(_) => format!("[source]\nkind = \"nats\"\nstream = \"BENCH_{n}\""),
            OneStream::RocketMq(_) => format!("[source]\nkind = \"rocketmq\"\ntopic = \"{}\"", Self::name(n)),
        }
    }

    /// The settings' broker section.
    fn section(&self) -> String {
        match self {
            OneStream::RabbitMq(node) => format!("[rabbitmq]\nurl = \"{}\"\n", node.url()),
            OneStream::Nats(server) => format!("[nats]\nurl = \"{}\"\n", server.url()),
            OneStream::RocketMq(node) => format!("[rocketmq]\nname_server = \"{}\"\n", node.name_server()),
        }
    }
}

/// `idemflow bench --source rabbitmq` or `--source nats`: the stream published to a queue (a stream) per run of a
/// throwaway RabbitMQ node (NATS server), then (1) the worker (table form, default batching), (5) a consume-only
/// pass, (7) the Redis sink and (8) the shipped example, each from its own queue (stream).
async fn run_one_stream(o: &BenchOptions, admin_url: &str) -> anyhow::Result<Report> {
    let broker = OneStream::start(o.source)?;
    let what = broker.what();
    let mut env = environment(admin_url, o.database_url.is_none(), o, 1).await?;
    env.retain(|(k, _)| k != "kafka" && k != "stream");
    env.push(("stream".into(), format!("{} records, published to each run's queue or stream before timing starts", o.records)));
    env.push(("broker".into(), broker.describe()));
    for (k, v) in &env {
        eprintln!("{k}: {v}");
    }
    let s = stream(o.records, 1);
    let messages: Vec<(String, Vec<u8>)> =
        s.records.iter().enumerate().map(|(i, (_, body))| (crate::demo::message_id(i, body), body.clone())).collect();
    let want = |n: u8| o.only.is_empty() || o.only.contains(&n);
    let runs_wanted: Vec<u8> = [1u8, 5, 7, 8].into_iter().filter(|n| want(*n)).collect();
    for n in &runs_wanted {
        let started = Instant::now();
        broker.publish(*n, &messages).await?;
        eprintln!("published {} messages for run ({n}) in {:.1} s", messages.len(), started.elapsed().as_secs_f64());
    }
    let section = broker.section();
    let total = s.records.len() as u64;
    let (tag, broker_name) = broker.tag();
    let mut runs = Vec::new();
    for n in runs_wanted {
        let from_queue = |text: String| text.replace(&format!("topics = [\"{TOPIC}\"]"), &broker.source(n));
        let pipeline = from_queue(table_pipeline(None));
        let url = if n == 8 {
            payments_database(admin_url, &format!("bench_{tag}_8")).await?
        } else {
            fresh_database(admin_url, &format!("bench_{tag}_{n}")).await?
        };
        let r = if n == 8 {
            let name = format!("idemflow from {what}, the shipped example pipelines/payments.toml (batch SQL form)");
            let run = WorkerRun { id: "(8)", name: &name, pipeline: from_queue(payments_pipeline()), group: "", target: total };
            worker_run(run, &section, &url, o.perf).await?
        } else if n == 1 {
            let name = format!("idemflow from {what}, default batching (table form)");
            let run = WorkerRun { id: "(1)", name: &name, pipeline, group: "", target: total };
            worker_run(run, &section, &url, o.perf).await?
        } else if n == 7 {
            let redis = crate::demo::redis::Throwaway::start()?;
            let name = format!("idemflow from {what}, Redis sink (one script per batch)");
            let run = WorkerRun { id: "(7)", name: &name, pipeline: from_queue(redis_pipeline()), group: "", target: total };
            worker_run_on(run, &section, &format!("[redis]\nurl = \"{}\"\n", redis.url()), o.perf, &Probe::default()).await?
        } else {
            match &broker {
                OneStream::RabbitMq(node) => consume_only_rabbitmq(&node.url(), &OneStream::name(n), &url, &pipeline, s.records.len()).await?,
                OneStream::Nats(server) => consume_only_nats(&server.url(), &format!("BENCH_{n}"), &url, &pipeline, s.records.len()).await?,
                OneStream::RocketMq(node) => consume_only_rocketmq(&node.name_server(), &url, &pipeline, s.records.len()).await?,
            }
        };
        eprintln!("{} {}: {:.0} records/s ({})", r.id, r.name, r.records_per_second, r.note);
        runs.push(RunResult { repetition: 1, ..r });
    }
    let rate = |id: &str| runs.iter().find(|r| r.id == id).map(|r| r.records_per_second);
    let mut ratios = Vec::new();
    for (name, a, b, target) in [
        (format!("(1) / (5), {broker_name}"), "(1)", "(5)", "(measured)"),
        (format!("(7) / (1), {broker_name}: Redis against the Postgres table form"), "(7)", "(1)", ">= 2"),
        (format!("(7) / (5), {broker_name}: Redis against consume-only"), "(7)", "(5)", ">= 0.60"),
        (format!("(8) / (1), {broker_name}: the shipped example (batch SQL form) against the table form"), "(8)", "(1)", ">= 0.50"),
    ] {
        if let (Some(a), Some(b)) = (rate(a), rate(b)) {
            ratios.push((name, a / b, target.to_owned()));
        }
    }
    let report = Report { environment: env, runs, ratios: combine(&[ratios]) };
    write_outputs(&report, &o.markdown, &o.json)?;
    Ok(report)
}

/// Run (5) on NATS JetStream: consume `total` messages from `stream` through a durable pull consumer with the
/// worker's settings (explicit acks, max_ack_pending twice a batch), decode each and take its key as the worker
/// would, and double-ack each batch of 2,000 (every message, confirmed, as the worker acknowledges).
async fn consume_only_nats(url: &str, stream: &str, db_url: &str, pipeline_text: &str, total: usize) -> anyhow::Result<RunResult> {
    use futures_util::StreamExt;
    let (pipeline, preparer) = preparer(db_url, pipeline_text).await?;
    let crate::config::SourceSpec::Nats(spec) = &pipeline.source else { bail!("(5): not a NATS pipeline") };
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    let consumer = js.get_stream(stream).await?.create_consumer(crate::source::nats::consumer_config(spec)).await?;
    let mut messages = consumer.stream().max_messages_per_batch(2000).messages().await?;
    let stream_name: std::sync::Arc<str> = std::sync::Arc::from(stream);
    let (mut n, mut applied, mut t0) = (0usize, 0usize, None);
    let max_payload_bytes = pipeline.decoder.max_payload_bytes();
    let mut ackers = Vec::with_capacity(2000);
    while n < total {
        let next = tokio::time::timeout(Duration::from_secs(60), messages.next()).await;
        let message = match next {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => bail!("(5): consuming failed: {e}"),
            Ok(None) | Err(_) => bail!("(5): consumed {n} of {total} messages, then nothing for 60 s"),
        };
        t0.get_or_insert_with(Instant::now);
        let (seq, published, delivered) = {
            let info = message.info().map_err(|e| anyhow::anyhow!("(5): {e}"))?;
            (info.stream_sequence, info.published.unix_timestamp_nanos(), info.delivered)
        };
        let (message, acker) = message.split();
        ackers.push(acker);
        let record = crate::source::nats::to_record(stream_name.clone(), seq, published, delivered, message, max_payload_bytes);
        if matches!(preparer.prepare(&record), crate::prepare::Prepared::Apply(_)) {
            applied += 1;
        }
        n += 1;
        if n % 2000 == 0 || n == total {
            for r in futures_util::future::join_all(ackers.iter().map(|a| a.double_ack())).await {
                r.map_err(|e| anyhow::anyhow!("(5): a double ack failed: {e}"))?;
            }
            ackers.clear();
        }
    }
    Ok(ceiling_result(
        "ceiling: consume-only pass from a NATS JetStream stream (decode and key extraction, a double ack per message, no database)",
        n,
        t0,
        format!("{applied} records prepared for applying; max_ack_pending {}", spec.max_ack_pending),
    ))
}

/// Run (5) on RocketMQ: the worker's own pull consumer ([`crate::source::Source`], the consumer group's offsets
/// kept by the broker) reads `total` messages in the worker's batches, each decoded and keyed as the worker would,
/// each batch's consume offsets committed after it, as the worker commits them; no database.
async fn consume_only_rocketmq(name_server: &str, db_url: &str, pipeline_text: &str, total: usize) -> anyhow::Result<RunResult> {
    let (pipeline, preparer) = preparer(db_url, pipeline_text).await?;
    let rocketmq = crate::config::RocketMqSettings {
        name_server: name_server.to_owned(),
        access_key: None,
        secret_key: None,
        timeout: Duration::from_secs(10),
    };
    let brokers = crate::source::Brokers {
        kafka: crate::config::KafkaSettings::default(),
        rabbitmq: None,
        rocketmq: Some(rocketmq),
        nats: None,
        shutdown_timeout: Duration::from_secs(10),
    };
    let metrics = crate::metrics::Metrics::new().pipeline(&pipeline.name);
    let mut source = crate::source::Source::new(&brokers, &pipeline.source_context(), metrics, None).map_err(anyhow::Error::msg)?;
    let (_stop, mut shutdown) = crate::shutdown::channel();
    let (mut n, mut applied, mut t0) = (0usize, 0usize, None);
    let mut progressed = Instant::now();
    while n < total {
        let Some(batch) = source.next_batch(pipeline.batch, &mut shutdown).await else {
            bail!("(5): the RocketMQ consumer stopped after {n} of {total} messages: {}", source.fatal().unwrap_or_default());
        };
        if batch.is_empty() {
            anyhow::ensure!(progressed.elapsed() < Duration::from_secs(60), "(5): consumed {n} of {total} messages, then nothing for 60 s");
            continue;
        }
        progressed = Instant::now();
        t0.get_or_insert_with(Instant::now);
        let batch = crate::batch::Batch::new(batch, |r| preparer.prepare(r));
        applied += batch.prepared().iter().filter(|p| matches!(p, crate::prepare::Prepared::Apply(_))).count();
        n += batch.len();
        source.commit(&batch).await;
    }
    let result = ceiling_result(
        "ceiling: consume-only pass from a RocketMQ topic (the worker's pull consumer, decode and key extraction, consume offsets committed per batch, no database)",
        n,
        t0,
        format!("{applied} records prepared for applying"),
    );
    source.close().await;
    Ok(result)
}

/// Run (5) on RabbitMQ: consume `total` messages from `queue` with the worker's default prefetch, decode each and
/// take its key as the worker would, acknowledging each batch of 2,000 with one `basic.ack` (`multiple`).
async fn consume_only_rabbitmq(amqp: &str, queue: &str, url: &str, pipeline_text: &str, total: usize) -> anyhow::Result<RunResult> {
    use futures_util::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    let (pipeline, preparer) = preparer(url, pipeline_text).await?;
    let prefetch = match &pipeline.source {
        crate::config::SourceSpec::RabbitMq(r) => r.prefetch,
        _ => bail!("(5): not a RabbitMQ pipeline"),
    };
    let connection = lapin::Connection::connect(amqp, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let mut consumer = channel.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), lapin::types::FieldTable::default()).await?;
    let queue_name: std::sync::Arc<str> = std::sync::Arc::from(queue);
    let (mut n, mut applied, mut t0) = (0usize, 0usize, None);
    let max_payload_bytes = pipeline.decoder.max_payload_bytes();
    while n < total {
        let next = tokio::time::timeout(Duration::from_secs(60), consumer.next()).await;
        let delivery = match next {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => bail!("(5): consuming failed: {e}"),
            Ok(None) | Err(_) => bail!("(5): consumed {n} of {total} messages, then nothing for 60 s"),
        };
        t0.get_or_insert_with(Instant::now);
        let tag = delivery.delivery_tag;
        let record = crate::source::rabbitmq::to_record(queue_name.clone(), delivery, max_payload_bytes);
        if matches!(preparer.prepare(&record), crate::prepare::Prepared::Apply(_)) {
            applied += 1;
        }
        n += 1;
        if n % 2000 == 0 || n == total {
            channel.basic_ack(tag, BasicAckOptions { multiple: true }).await?;
        }
    }
    let result = ceiling_result(
        "ceiling: consume-only pass from a RabbitMQ quorum queue (decode and key extraction, acks, no database)",
        n,
        t0,
        format!("{applied} records prepared for applying; prefetch {prefetch}"),
    );
    let _ = connection.close(200, "done".into()).await;
    Ok(result)
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The report as Markdown: settings, the runs table and the ratios.
pub fn markdown(r: &Report) -> String {
    let mut md = String::from("| setting | value |\n|---|---|\n");
    for (k, v) in &r.environment {
        md.push_str(&format!("| {k} | {v} |\n"));
    }
    md.push_str(
        "\n| run | what | records | seconds | records/s | worker CPU µs/record | PostgreSQL CPU µs/record | PostgreSQL WAL bytes/record | peak RSS MiB | batch p50 / p99 ms | end-to-end p50 / p99 ms | notes |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    let repeated = r.runs.iter().any(|x| x.repetition > 1);
    for x in &r.runs {
        let id = if repeated { format!("{} #{}", x.id, x.repetition) } else { x.id.clone() };
        md.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.0} | {} | {} | {} | {} | {} / {} | {} / {} | {} |\n",
            id,
            x.name,
            x.records,
            x.seconds,
            x.records_per_second,
            opt(x.cpu_us_per_record, 2),
            opt(x.db_cpu_us_per_record, 2),
            opt(x.wal_bytes_per_record, 0),
            opt(x.peak_rss_mib, 1),
            opt(x.batch_p50_ms, 1),
            opt(x.batch_p99_ms, 1),
            opt(x.e2e_p50_ms, 0),
            opt(x.e2e_p99_ms, 0),
            x.note
        ));
    }
    md.push_str("\n| ratio | measured | target |\n|---|---:|---|\n");
    for x in &r.ratios {
        let measured = if x.repetitions > 1 {
            format!("{:.2} (median of {}; {:.2} to {:.2})", x.value, x.repetitions, x.low, x.high)
        } else {
            format!("{:.2}", x.value)
        };
        md.push_str(&format!("| {} | {measured} | {} |\n", x.name, x.target));
    }
    md
}

fn write_outputs(r: &Report, md_path: &Path, json_path: &Path) -> anyhow::Result<()> {
    for p in [md_path, json_path] {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
    }
    std::fs::write(md_path, markdown(r))?;
    std::fs::write(json_path, serde_json::to_string_pretty(r)?)?;
    Ok(())
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
