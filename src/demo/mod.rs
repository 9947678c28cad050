//! `idemflow demo`: the whole job on one machine, with nothing to set up.
//!
//! An embedded Kafka broker ([`kafka`]), or with `--source rabbitmq` a throwaway RabbitMQ node ([`rabbitmq`], from
//! Debian's `rabbitmq-server`) and a quorum queue, or with `--source nats` a throwaway NATS server with JetStream
//! ([`nats`], Debian's `nats-server`) and a stream, and a throwaway PostgreSQL cluster ([`postgres`], or a server given with
//! `--database-url`) carry a stream of payment deductions through the shipped `pipelines/payments.toml`, on the
//! real worker code path ([`crate::worker`]). Duplicates happen the three ways they happen in production:
//!
//! - producer retries: an operation is sent again after its first send, landing at a new offset;
//! - redelivery: a worker stops abruptly after a batch's database commit and before its offset commit
//!   ([`crate::worker::Faults`]), and is restarted;
//! - a consumer-group rebalance: a second worker joins mid-stream and later leaves.
//!
//! Plus a few records reusing an order id with another amount, and a few poison records. At the end a summary, and
//! the check that matters: one business row per distinct operation, and the total deducted equals the expected
//! total.

pub mod broker;
pub mod database;
pub mod formats;
pub mod host;
pub mod kafka;
pub mod mariadb;
pub mod nats;
pub mod postgres;
pub mod provider;
pub mod rabbitmq;
pub mod redis;
pub mod rocketmq;
pub(crate) mod shipped;
pub mod store;
mod stream;

use crate::config::{self, Settings};
use broker::{BrokerKind, Outgoing, ThrowawayBroker};
use crate::http::{self, Health};
use crate::metrics::Metrics;
use crate::shutdown::{self, Shutdown};
use crate::worker::{self, Faults, PipelineFailure};
use anyhow::{bail, Context as _};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

use shipped::*;
pub(crate) use stream::{message_id, money, stream_from, Stream};
use stream::stream;

/// Options of `idemflow demo`.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// How many records to produce (default 100,000).
    pub records: usize,
    /// A PostgreSQL server to use (a new database is created on it); `None`: a throwaway cluster.
    pub database_url: Option<String>,
    /// The broker.
    pub source: DemoSource,
    /// The pipeline file (default `pipelines/payments.toml`, or `examples/rabbitmq/payments.toml` for RabbitMQ; its
    /// `.sql` sibling holds the tables, else the shipped `pipelines/payments.sql`).
    pub pipeline: Option<PathBuf>,
    /// Where `/metrics` is served during the run.
    pub metrics_listen: SocketAddr,
    /// Keep the worker and `/metrics` up after the summary, until Ctrl-C.
    pub keep_running: bool,
    /// Redis as the store (`examples/redis/payments.toml`): a throwaway `redis-server`, or the server of a
    /// `redis://` `database_url`.
    pub redis: bool,
    /// How the payments are encoded: JSON, or Avro or Protobuf (`examples/formats/`), which the pipeline then reads
    /// with its `schema_file`.
    pub format: formats::DemoFormat,
    /// The side effect: the pipeline's tables only, or with `http` each payment also charged through a throwaway
    /// payment provider over HTTP, through the outbox (`[[sink.http]]`).
    pub effect: DemoEffect,
}

/// The demo's side effect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoEffect {
    /// The pipeline's own: rows and balances in the store.
    #[default]
    Table,
    /// The same, and each payment charged through a throwaway payment provider that honours idempotency keys
    /// ([`provider`]), through the outbox; the provider drops every 50th answer after charging, so the relay sends
    /// those again and the provider recognises them.
    Http,
}

/// The `[[sink.http]]` the demo adds to its pipeline with `--effect http`: each payment charged at `url`, from the
/// shipped pipelines' `[sink.params]` (order_id, account_id, amount, currency).
fn http_effect(url: &str) -> String {
    format!(
        "\n# Added by `idemflow demo --effect http`: each new payment also charged through the provider, via the outbox.\n\
         [[sink.http]]\nname = \"provider\"\nurl = \"{url}/v1/charges\"\n\
         body = {{ order = \"{{order_id}}\", account = \"{{account_id}}\", amount = \"{{amount}}\", currency = \"{{currency}}\" }}\n\
         timeout = \"5s\"\n\n[outbox]\npoll_interval = \"200ms\"\nbackoff = \"200ms\"\nmax_backoff = \"2s\"\n"
    )
}

/// The broker the demo runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoSource {
    /// An embedded Kafka broker (librdkafka's mock cluster).
    #[default]
    Kafka,
    /// A throwaway RabbitMQ node (Debian's `rabbitmq-server`) with a quorum queue.
    Rabbitmq,
    /// A throwaway NATS server with JetStream (Debian's `nats-server`) with a stream.
    Nats,
}

impl DemoSource {
    /// The broker this is.
    fn broker(self) -> BrokerKind {
        match self {
            DemoSource::Kafka => BrokerKind::Kafka,
            DemoSource::Rabbitmq => BrokerKind::Rabbitmq,
            DemoSource::Nats => BrokerKind::Nats,
        }
    }
}

/// One in-process worker of the demo.
struct DemoWorker {
    trigger: shutdown::Trigger,
    handle: JoinHandle<Vec<PipelineFailure>>,
}

fn lines(errors: &[config::PipelineError]) -> anyhow::Error {
    anyhow::anyhow!("{}", errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))
}

/// Starts one worker on the pipelines `ready` (prepared once for all the demo's workers).
fn start_worker(settings: &Settings, ready: &[worker::Ready], metrics: &Metrics, health: &Health, faults: Faults) -> DemoWorker {
    let (trigger, stop): (shutdown::Trigger, Shutdown) = shutdown::channel();
    let (settings, ready, metrics, health) = (settings.clone(), ready.to_vec(), metrics.clone(), health.clone());
    let handle = tokio::spawn(async move { worker::run_with_faults(&settings, ready, &metrics, &health, stop, faults).await });
    DemoWorker { trigger, handle }
}

impl DemoWorker {
    async fn stop(self) -> anyhow::Result<()> {
        self.trigger.trigger();
        let failures = self.handle.await?;
        if let Some(f) = failures.first() {
            bail!("{f}");
        }
        Ok(())
    }
}

struct Progress {
    bar: Option<indicatif::ProgressBar>,
    last_line: Instant,
    /// The last progress line written without a terminal: one that says nothing new is not written again.
    last_text: String,
}

impl Progress {
    fn new(total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos:>7}/{len:7} consumed  {msg}  [{elapsed}]")
                    .expect("a valid template"),
            );
            bar
        });
        Progress { bar, last_line: Instant::now(), last_text: String::new() }
    }

    fn update(&mut self, consumed: u64, applied: u64, duplicates: u64, event: Option<&str>) {
        let msg = format!("applied {applied}  duplicates {duplicates}");
        match &self.bar {
            Some(bar) => {
                bar.set_position(consumed);
                bar.set_message(msg);
                if let Some(e) = event {
                    bar.println(e);
                }
            }
            None => {
                if let Some(e) = event {
                    eprintln!("{e}");
                }
                let text = format!("consumed {consumed}  {msg}");
                if self.last_line.elapsed() >= Duration::from_secs(2) && text != self.last_text {
                    eprintln!("{text}");
                    self.last_line = Instant::now();
                    self.last_text = text;
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

fn counter(metrics: &Metrics, name: &str, reason: Option<&str>) -> u64 {
    let text = String::from_utf8(metrics.render()).unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains("pipeline=\"payments\""))
        .filter(|l| reason.is_none_or(|r| l.contains(&format!("reason=\"{r}\""))))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum::<f64>() as u64
}

/// Runs the demo; `Ok(true)` when the final check passed.
pub async fn run(options: DemoOptions) -> anyhow::Result<bool> {
    let plan = Plan::of(&options)?;
    let (nats, rabbit) = (plan.nats, plan.rabbit);
    eprintln!("idemflow demo: {} records through {}", options.records, plan.label);

    // Postgres: a throwaway cluster, or a new database on the given server. Redis: a throwaway server, or the
    // given one as it is.
    let (throwaway, db, url) = open_store(&options, &plan).await?;

    // Kafka: the embedded broker, with enough partitions for the mock's per-partition limit. RabbitMQ: a node of
    // this demo and a quorum queue.
    let partitions = if rabbit { 1 } else { ((options.records * 200) / (3 << 20) + 1).max(4) as i32 };
    eprintln!("starting a throwaway {} broker...", options.source.broker().name());
    let mut broker = ThrowawayBroker::start(options.source.broker(), partitions).await?;
    eprintln!("{}", broker.describe());

    // Workspace: settings and the pipeline, as a user would have them.
    let dir = tempfile::Builder::new().prefix("idemflow-demo-").tempdir()?;
    // SIGTERM or Ctrl-C before the end: remove the workspace and exit (the throwaway cluster's watcher removes the
    // cluster once this process is gone). With --keep-running, the end waits for the signal itself.
    let interrupted = {
        let workspace = dir.path().to_owned();
        let signals = shutdown::Signals::new();
        tokio::spawn(async move {
            signals.first().await;
            let _ = std::fs::remove_dir_all(&workspace);
            eprintln!("interrupted: the demo's temporary files are removed");
            std::process::exit(130);
        })
    };
    // --effect http: the throwaway payment provider, and the pipeline's [[sink.http]] pointed at it.
    let mut plan = plan;
    let provider = match options.effect {
        DemoEffect::Table => None,
        DemoEffect::Http => {
            let p = provider::Provider::start(Some(LOSE_EVERY)).await.context("starting the demo's payment provider")?;
            eprintln!("a throwaway payment provider on {} (it honours Idempotency-Key; it drops every {LOSE_EVERY}th answer after charging)", p.url());
            plan.pipeline_text.push_str(&http_effect(&p.url()));
            Some(p)
        }
    };
    let settings = write_workspace(dir.path(), &plan, &url, &broker, options.metrics_listen)?;
    db.setup(&plan.tables_sql, ACCOUNTS, OPENING_BALANCE_CENTS).await?;

    let s = stream(options.records, partitions);
    // Each record with its order id as its message id (RabbitMQ, NATS: the examples' business key), as a
    // producer retry keeps it; a JetStream stream drops a copy whose Nats-Msg-Id it saw within its duplicate window.
    let records = s.records.iter().enumerate().map(|(i, (partition, body))| Outgoing {
        partition: *partition,
        id: message_id(i, body),
        body: plan.encoder.encode(body),
    });
    broker.publish(records.collect())?;
    broker.flush(Duration::from_secs(600)).await.context("publishing")?;
    let dropped = broker.dropped();
    eprintln!(
        "{} {} records: {} operations, {} {} retries, {} reused order ids, {} poison records",
        if rabbit { "published" } else { "produced" },
        s.records.len(), s.distinct, s.retries, if rabbit { "publisher" } else { "producer" }, s.mismatches, s.poison
    );
    if nats {
        eprintln!(
            "the stream dropped {dropped} of them itself: a Nats-Msg-Id it had seen within its duplicate window (2 minutes), \
             reused order ids with another amount among them (JetStream compares the id only); idemflow sees the rest"
        );
    }

    let metrics = Metrics::new();
    let health = Health::default();
    let server = http::serve(options.metrics_listen, metrics.clone(), health.clone())
        .with_context(|| format!("serving /metrics on {}", options.metrics_listen))?;
    eprintln!("metrics on http://{}/metrics", server.addr());

    let a = drive(&plan, &settings, &db, &metrics, &health, &s, dropped, provider.as_ref()).await?;

    // The summary, from the metrics and the business tables.
    let totals = db.totals(ACCOUNTS, OPENING_BALANCE_CENTS).await?;
    let checked = summary(&plan, &metrics, &s, &totals, dropped) & provider.as_ref().is_none_or(|p| provider_summary(&p.counts(), &s, &totals));

    // Listening before the interruption handler goes, so that a signal in between (a user's Ctrl-C as the addresses
    // print) is kept for the end of --keep-running rather than lost.
    let keep_running = options.keep_running.then(shutdown::Signals::new);
    interrupted.abort();
    if let Some(signals) = keep_running {
        let database = crate::secret::SecretUrl::from(url.clone());
        eprintln!("\nkeeping the worker and http://{}/metrics up; Ctrl-C to stop", server.addr());
        eprintln!("  {}", broker.describe());
        match &throwaway {
            Some(cluster) => eprintln!(
                "  PostgreSQL: {database} (a throwaway cluster: the password of its superuser postgres is in {}, readable \
                 only by you)",
                cluster.password_file().display()
            ),
            None if db.is_redis() => eprintln!("  Redis: {database} (keys payment:*, balance:*, payments-applied, idemflow:*)"),
            None => eprintln!(
                "  {}: {database} (the password of your --database-url)",
                if db.is_mysql() { "MySQL/MariaDB" } else { "PostgreSQL" }
            ),
        }
        signals.first().await;
    }
    a.stop().await?;
    db.close().await;
    Ok(checked)
}

/// What the demo runs: the broker, the store, and the pipeline with its business tables.
struct Plan {
    /// NATS JetStream.
    nats: bool,
    /// A queue or a JetStream consumer shared by two workers (RabbitMQ, NATS): deliveries without a kept order.
    rabbit: bool,
    /// The Redis store.
    redis: bool,
    /// A Redis server given with `--database-url`.
    redis_url: Option<String>,
    /// The pipeline file's text.
    pipeline_text: String,
    /// The business tables' SQL (Redis: none).
    tables_sql: String,
    /// Where the pipeline came from, for the first line.
    label: String,
    /// How the payments are encoded, and the schema file the pipeline reads them with.
    encoder: formats::Encoder,
}

impl Plan {
    /// The plan for `options`.
    ///
    /// Errors: a broker and a store the demo does not pair, or a pipeline file that cannot be read.
    fn of(options: &DemoOptions) -> anyhow::Result<Plan> {
        let nats = options.source == DemoSource::Nats;
        // A queue, or a JetStream consumer shared by two workers: deliveries without a kept order (competing consumers).
        let rabbit = options.source == DemoSource::Rabbitmq || nats;
        let source_flag = if nats { "--source nats" } else { "--source rabbitmq" };
        let mysql = options.database_url.as_deref().is_some_and(|u| crate::store::template::Dialect::of_url(u) == crate::store::template::Dialect::MySql);
        if rabbit && mysql {
            bail!("the demo runs RabbitMQ and NATS with PostgreSQL, and MySQL/MariaDB with Kafka: choose one of {source_flag} and a mysql:// --database-url");
        }
        let redis_url = options.database_url.as_deref().filter(|u| u.starts_with("redis://") || u.starts_with("rediss://"));
        let redis = options.redis || redis_url.is_some();
        let mysql = mysql && !redis;
        if redis && rabbit {
            bail!("the Redis demo runs with Kafka: drop {source_flag}");
        }
        if redis && options.effect == DemoEffect::Http {
            bail!("--effect http runs through the outbox, in a database: drop --redis (or --store redis)");
        }
        let (default_file, built_in, shipped_tables) = if redis {
            ("examples/redis/payments.toml", SHIPPED_REDIS_PIPELINE, "")
        } else if nats {
            ("examples/nats/payments.toml", SHIPPED_NATS_PIPELINE, SHIPPED_TABLES)
        } else if rabbit {
            ("examples/rabbitmq/payments.toml", SHIPPED_RABBITMQ_PIPELINE, SHIPPED_TABLES)
        } else if mysql {
            ("examples/mysql/payments.toml", SHIPPED_MYSQL_PIPELINE, SHIPPED_MYSQL_TABLES)
        } else {
            ("pipelines/payments.toml", SHIPPED_PIPELINE, SHIPPED_TABLES)
        };
        let file = options.pipeline.clone().unwrap_or_else(|| PathBuf::from(default_file));
        let (pipeline_text, tables_sql, source) = if file.is_file() {
            let sql_path = file.with_extension("sql");
            let sql = if redis {
                String::new()
            } else if sql_path.is_file() || options.pipeline.is_some() {
                std::fs::read_to_string(&sql_path).with_context(|| format!("reading {}", sql_path.display()))?
            } else {
                shipped_tables.to_owned()
            };
            (std::fs::read_to_string(&file)?, sql, file.display().to_string())
        } else if options.pipeline.is_some() {
            bail!("{}: no such pipeline file", file.display());
        } else {
            (built_in.to_owned(), shipped_tables.to_owned(), format!("the built-in copy of {default_file}"))
        };
        let redis_url = redis_url.map(str::to_owned);
        let encoder = formats::Encoder::new(options.format)?;
        let (pipeline_text, label) = match options.format {
            formats::DemoFormat::Json => (pipeline_text, source),
            f => (encoder.pipeline(&pipeline_text).0, format!("{source}, its payments in {f:?}")),
        };
        Ok(Plan { nats, rabbit, redis, redis_url, pipeline_text, tables_sql, label, encoder })
    }
}

/// The demo's store: a throwaway PostgreSQL cluster (or a new database on `--database-url`), or Redis (a
/// throwaway server, or the one given as it is); returns the cluster it started, the database and its URL.
///
/// Errors: the server could not be started or reached.
async fn open_store(options: &DemoOptions, plan: &Plan) -> anyhow::Result<(Option<postgres::Throwaway>, database::DemoDb, String)> {
    let (redis, redis_url) = (plan.redis, plan.redis_url.as_deref());
    Ok(if redis {
        if redis_url.is_none() {
            eprintln!("starting a throwaway redis-server (appendonly yes, appendfsync everysec)...");
        }
        let (db, url) = database::DemoDb::redis(redis_url)?;
        eprintln!("Redis on {}", crate::secret::mask_url(&url));
        (None, db, url)
    } else {
        let (throwaway, admin_url) = match &options.database_url {
            Some(url) => (None, url.clone()),
            None => {
                eprintln!("starting a throwaway PostgreSQL cluster from the local server binaries...");
                let cluster = postgres::Throwaway::start()?;
                let url = cluster.url();
                (Some(cluster), url)
            }
        };
        // The second and this process's id: two demos started in the same second on one server get databases of
        // their own.
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
        let database = format!("idemflow_demo_{secs}_{}", std::process::id());
        let (db, url) = database::DemoDb::create(&admin_url, &database).await?;
        eprintln!("database {database} created{}", if db.is_mysql() { " (MySQL/MariaDB)" } else { "" });
        (throwaway, db, url)
    })
}

/// Writes the workspace into `dir` as a user would have it: `pipelines/payments.toml` and an `idemflow.toml` whose
/// store section is `url`'s and whose broker section is `broker`'s; returns the settings loaded from it.
///
/// Errors: the files could not be written or the settings not loaded.
fn write_workspace(dir: &std::path::Path, plan: &Plan, url: &str, broker: &ThrowawayBroker, listen: SocketAddr) -> anyhow::Result<Settings> {
    let (redis, pipeline_text) = (plan.redis, &plan.pipeline_text);
    std::fs::create_dir(dir.join("pipelines"))?;
    std::fs::write(dir.join("pipelines/payments.toml"), pipeline_text)?;
    if let Some((name, text)) = plan.encoder.pipeline("").1 {
        std::fs::write(dir.join("pipelines").join(name), text)?;
    }
    let store_section = if redis {
        format!("[redis]\nurl = {}\nresponse_timeout = \"30s\"\n", host::toml_string(url))
    } else {
        format!("[database]\nurl = {}\nmax_connections = 4\n", host::toml_string(url))
    };
    let settings_text = format!(
        "pipelines = \"pipelines\"\n{store_section}{}[metrics]\nlisten = \"{}\"\n",
        broker.settings_toml(),
        listen
    );
    let settings_file = dir.join("idemflow.toml");
    host::write_private(&settings_file, &settings_text)?;
    Ok(config::load_settings_from(&settings_file, std::iter::empty()).map_err(|e| anyhow::anyhow!("{e}"))?.settings)
}

/// The script: worker A crashes after a database commit and is restarted; B joins and later leaves; until every
/// operation is applied and every poison record dead-lettered. Returns worker A, still running.
///
/// Errors: a worker failed, or the demo did not finish within 30 minutes.
async fn drive(
    plan: &Plan,
    settings: &Settings,
    db: &database::DemoDb,
    metrics: &Metrics,
    health: &Health,
    s: &Stream,
    dropped: u64,
    provider: Option<&provider::Provider>,
) -> anyhow::Result<DemoWorker> {
    let (nats, rabbit, redis) = (plan.nats, plan.rabbit, plan.redis);
    let total = s.records.len() as u64;
    let batches_before_crash = (total / 5 / 500).max(1);
    let mut progress = Progress::new(total);
    let pipelines = config::load_pipelines_for(settings).map_err(|e| lines(&e))?;
    let ready = worker::prepare(&db.store(), &pipelines).await.map_err(|e| lines(&e.problems))?;
    let mut a = start_worker(settings, &ready, metrics, health, Faults { crash_after_commits: Some(batches_before_crash), ..Default::default() });
    let mut b: Option<DemoWorker> = None;
    let (mut crashed, mut joined, mut left) = (false, false, false);
    let deadline = Instant::now() + Duration::from_secs(30 * 60);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let consumed = counter(metrics, "idemflow_records_received_total", None);
        let applied = counter(metrics, "idemflow_records_applied_total", None);
        let duplicates = counter(metrics, "idemflow_duplicates_skipped_total", None);
        let mut event = None;
        if !crashed && a.handle.is_finished() {
            crashed = true;
            a = start_worker(settings, &ready, metrics, health, Faults::default());
            let durable_at = if nats { "acks" } else if rabbit { "acknowledgement" } else { "offset commit" };
            // Redis has no commit: a batch is durable once its script ran (the positions went with it).
            let committed = if redis { "its batch's Redis script ran" } else { "a database commit" };
            event = Some(format!("worker A stopped abruptly after {committed}, before its {durable_at}; restarted"));
        } else if crashed && !joined && consumed >= total * 2 / 5 {
            joined = true;
            b = Some(start_worker(settings, &ready, metrics, health, Faults::default()));
            event = Some(if nats {
                "worker B started on the same durable consumer: a competing consumer".to_owned()
            } else if rabbit {
                "worker B started on the same queue: a competing consumer".to_owned()
            } else {
                "worker B joined the consumer group: rebalance".to_owned()
            });
        } else if joined && !left && consumed >= total * 7 / 10 {
            left = true;
            if let Some(w) = b.take() {
                w.stop().await?;
            }
            event = Some(if rabbit { "worker B stopped".to_owned() } else { "worker B left the consumer group: rebalance".to_owned() });
        }
        progress.update(consumed, applied, duplicates, event.as_deref());
        // Distinct payloads: a queue records a poison message redelivered after the crash a second time.
        let done = db.progress().await?;
        // With --effect http, until every payment is charged and every answer the provider lost was sent again.
        let charged = provider.is_none_or(|p| {
            let c = p.counts();
            c.charges >= s.distinct && c.replays >= c.lost_answers
        });
        if left && done == (s.distinct as i64, s.poison as i64) && consumed >= total - dropped && charged {
            break;
        }
        if Instant::now() > deadline {
            bail!("the demo did not finish within 30 minutes");
        }
    }
    progress.update(
        counter(metrics, "idemflow_records_received_total", None),
        counter(metrics, "idemflow_records_applied_total", None),
        counter(metrics, "idemflow_duplicates_skipped_total", None),
        None,
    );
    progress.finish();
    Ok(a)
}

/// How often the demo's provider loses an answer after charging (`--effect http`).
const LOSE_EVERY: u64 = 50;

/// The summary's lines for `--effect http`: what the provider did, and the checks that each distinct operation was
/// charged once, for its applied amount. Returns whether they passed.
fn provider_summary(c: &provider::Counts, s: &Stream, totals: &database::Totals) -> bool {
    let line = |label: &str, n: u64| println!("  {label:<44} {n:>10}");
    println!("  the payment provider (--effect http, through the outbox)");
    line("  requests it received", c.requests);
    line("  charges it made", c.charges);
    line("  answers it lost after charging", c.lost_answers);
    line("  repeated requests it recognised", c.replays);
    let once = c.charges == s.distinct && c.mismatches == 0;
    println!("  check: charges made {} == distinct operations {}: {}", c.charges, s.distinct, if once { "ok" } else { "FAILED" });
    let amounts = c.charged_cents == totals.applied_cents;
    println!(
        "  check: total charged {} == sum of the applied payments {}: {}",
        money(c.charged_cents as i64),
        money(totals.applied_cents as i64),
        if amounts { "ok" } else { "FAILED" }
    );
    once && amounts
}

/// Prints the summary: what was injected and counted, the checks on the business tables, and how the counters
/// reconcile with what was injected; returns whether every check passed.
fn summary(plan: &Plan, metrics: &Metrics, s: &Stream, totals: &database::Totals, dropped: u64) -> bool {
    let (nats, rabbit) = (plan.nats, plan.rabbit);
    let total = s.records.len() as u64;
    let expected = money(s.expected_cents);
    let (rows, distinct_rows) = (totals.rows, totals.distinct_rows);
    let (deducted, applied_sum) = (money(totals.deducted_cents as i64), money(totals.applied_cents as i64));
    let as_published = totals.deducted_cents == i128::from(s.expected_cents);
    let each_once = totals.deducted_cents == totals.applied_cents;
    let line = |label: &str, n: u64| println!("  {label:<44} {n:>10}");
    println!();
    println!("idemflow demo summary");
    line("records produced", total);
    if nats {
        line("dropped by the stream (duplicate window)", dropped);
    }
    line("distinct operations", s.distinct);
    line("applied (business effects)", counter(metrics, "idemflow_records_applied_total", None));
    println!("  duplicates skipped");
    line("  republished (producer retries)", counter(metrics, "idemflow_duplicates_skipped_total", Some("republished")));
    line("  redelivered (crash, rebalance)", counter(metrics, "idemflow_duplicates_skipped_total", Some("redelivered")));
    line("  payload_mismatch (order id reused)", counter(metrics, "idemflow_duplicates_skipped_total", Some("payload_mismatch")));
    println!("  dead letters");
    for reason in crate::metrics::DeadLetterReason::ALL {
        let n = counter(metrics, "idemflow_dead_letters_total", Some(reason.as_str()));
        if n > 0 {
            line(&format!("  {}", reason.as_str()), n);
        }
    }
    let rows_ok = rows == s.distinct as i64 && distinct_rows == rows;
    println!();
    println!("  check: business rows {rows} == distinct operations {}: {}", s.distinct, if rows_ok { "ok" } else { "FAILED" });
    // Kafka keeps each partition's order, so every order id is applied with its first-published amount. Competing
    // consumers on a queue do not keep order: a reused order id may be applied before its original (the original is
    // then the payload_mismatch). Exactly once holds either way: each applied payment is deducted once.
    let total_ok = if rabbit {
        println!("  check: total deducted {deducted} == sum of the applied payments {applied_sum}: {}", if each_once { "ok" } else { "FAILED" });
        if !as_published {
            println!(
                "  note: the first-published amounts total {expected}: some reused order ids were applied before their \
                 originals (competing consumers on a queue do not keep order; see docs/rabbitmq.md)"
            );
        }
        each_once
    } else {
        println!("  check: total deducted {deducted} == expected {expected}: {}", if as_published && each_once { "ok" } else { "FAILED" });
        as_published && each_once
    };
    // How the counts reconcile with what was injected: every consumed record is counted exactly once as applied,
    // skipped or dead-lettered; a record consumed again after the crash or a rebalance is a `redelivered` skip.
    let count = |name: &str, reason: Option<&str>| counter(metrics, name, reason);
    let consumed = count("idemflow_records_received_total", None);
    let applied = count("idemflow_records_applied_total", None);
    let skipped = count("idemflow_duplicates_skipped_total", None);
    let dead = count("idemflow_dead_letters_total", None);
    let tombstones = count("idemflow_tombstones_skipped_total", None);
    let redelivered = count("idemflow_duplicates_skipped_total", Some("redelivered"));
    let republished = count("idemflow_duplicates_skipped_total", Some("republished"));
    let mismatched = count("idemflow_duplicates_skipped_total", Some("payload_mismatch"));
    let verdict = |ok: bool| if ok { "ok" } else { "differs" };
    let first = (consumed == applied + skipped + dead + tombstones,
        format!("consumed {consumed} = applied {applied} + duplicates skipped {skipped} + dead letters {dead} + tombstones {tombstones}"));
    // A queue has no positions: a delivery dropped unprocessed by the crashed worker comes back marked redelivered
    // too, so the reasons cannot be matched one to one with what was injected. What holds is that every delivery
    // processed again is one more skip or dead letter.
    let queue_lines = [
        first.clone(),
        (skipped + dead + total == s.retries + s.mismatches + s.poison + consumed,
            if nats {
                format!(
                    "duplicates skipped {skipped} + dead letters {dead} + dropped by the stream {dropped} = retries {} + reused order ids {} + poison {} + consumed again {} (consumed {consumed} - stored {})",
                    s.retries, s.mismatches, s.poison, consumed.saturating_sub(total - dropped), total - dropped
                )
            } else {
                format!(
                    "duplicates skipped {skipped} + dead letters {dead} = retries {} + reused order ids {} + poison {} + consumed again {} (consumed {consumed} - published {total})",
                    s.retries, s.mismatches, s.poison, consumed.saturating_sub(total)
                )
            }),
    ];
    let reconciled = if rabbit { queue_lines.to_vec() } else { vec![
        first,
        (consumed == total + redelivered,
            format!("consumed {consumed} = produced {total} + redelivered {redelivered} (consumed again after the crash and rebalances)")),
        (republished == s.retries, format!("republished {republished} = producer retries injected {}", s.retries)),
        (mismatched == s.mismatches, format!("payload_mismatch {mismatched} = reused order ids injected {}", s.mismatches)),
        (dead == s.poison, format!("dead letters {dead} = poison records injected {}", s.poison)),
    ] };
    println!("  reconciliation with what was injected");
    for (ok, text) in &reconciled {
        println!("    {text}: {}", verdict(*ok));
    }
    if nats {
        println!(
            "  why the reasons do not match the injected counts one by one: a JetStream consumer keeps no positions \
             that say what was processed; after the crash, every delivery the worker held and had applied comes back \
             at its own stream sequence and counts as redelivered; the sum above matches"
        );
    } else if rabbit {
        println!(
            "  why the reasons do not match the injected counts one by one: a queue has no positions that say what \
             was processed, so a copy is classified by the broker's own mark; after the crash, every delivery the \
             worker held comes back redelivered (RabbitMQ's mark), the retries among them too, and counts as \
             redelivered; the sum above matches"
        );
    }
    let reconciled = reconciled.iter().all(|(ok, _)| *ok);
    rows_ok && total_ok && reconciled
}


/// Where `idemflow demo-producer` sends.
pub enum ProducerTarget {
    /// A Kafka cluster: bootstrap servers.
    Kafka(String),
    /// A RocketMQ cluster: its name server(s), `host:port[;host:port]`.
    RocketMq(String),
    /// A NATS server with JetStream: its URL, and the stream to create (on `<subject's first token>.>`) when it does
    /// not exist yet.
    Nats {
        /// `nats://host:port`, as `[nats] url` takes it.
        url: String,
        /// `--create-stream`.
        create_stream: Option<String>,
    },
}

/// The open producer of [`produce_forever`].
enum Producer {
    Kafka(rdkafka::producer::FutureProducer),
    RocketMq(crate::source::rocketmq::Runtime, rocketmq_client_rust::DefaultMQProducer),
    /// The JetStream context, and how many publishes the stream dropped as duplicates of a `Nats-Msg-Id` it had
    /// seen within its duplicate window.
    Nats(async_nats::jetstream::Context, u64),
}

impl Producer {
    /// Opens the producer for `target`; `topic` is the subject a NATS stream created here covers.
    async fn open(target: &ProducerTarget, topic: &str) -> anyhow::Result<Producer> {
        Ok(match target {
            ProducerTarget::Kafka(bootstrap) => Producer::Kafka(
                rdkafka::ClientConfig::new().set("bootstrap.servers", bootstrap).set("acks", "all").set("linger.ms", "20").create()?,
            ),
            ProducerTarget::RocketMq(name_server) => {
                let (runtime, producer) = rocketmq::start_producer(name_server, "idemflow-demo-producer").await?;
                Producer::RocketMq(runtime, producer)
            }
            ProducerTarget::Nats { url, create_stream } => {
                let client = tokio::time::timeout(Duration::from_secs(10), async_nats::connect(url.as_str()))
                    .await
                    .map_err(|_| anyhow::anyhow!("NATS server {url}: no answer within 10 s"))?
                    .with_context(|| format!("connecting to {url}"))?;
                let js = async_nats::jetstream::new(client);
                if let Some(name) = create_stream {
                    nats::ensure_stream(&js, name, topic).await?;
                }
                Producer::Nats(js, 0)
            }
        })
    }

    /// Sends `(key, value)` records to `topic` and waits for every acknowledgement; failures are printed.
    async fn send(&mut self, topic: &str, records: &[(String, &[u8])]) {
        match self {
            Producer::Kafka(producer) => {
                let pending: Vec<_> = records
                    .iter()
                    .map(|(key, value)| producer.send(rdkafka::producer::FutureRecord::to(topic).key(key.as_bytes()).payload(*value), Duration::from_secs(30)))
                    .collect();
                for p in pending {
                    if let Err((e, _)) = p.await {
                        eprintln!("demo-producer: delivery failed: {e}");
                    }
                }
            }
            Producer::RocketMq(_, producer) => {
                for (key, value) in records {
                    let message = rocketmq_model::common::message::message_single::Message::builder()
                        .topic(topic)
                        .tags("pay")
                        .keys(vec![key.clone()])
                        .body_slice(value)
                        .build();
                    let sent = match message {
                        Ok(m) => producer.send(m).await.map(drop).map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    if let Err(e) = sent {
                        eprintln!("demo-producer: send failed: {e}");
                    }
                }
            }
            Producer::Nats(js, dropped) => match nats::publish_to(js, topic, records).await {
                Ok(n) => *dropped += n,
                Err(e) => eprintln!("demo-producer: {e:#}"),
            },
        }
    }

    async fn close(self) {
        match self {
            Producer::RocketMq(runtime, mut producer) => {
                producer.shutdown().await;
                runtime.shutdown().await;
            }
            Producer::Nats(_, dropped) => eprintln!(
                "demo-producer: the stream itself dropped {dropped} of them (a Nats-Msg-Id it had seen within its duplicate window)"
            ),
            Producer::Kafka(_) => {}
        }
    }
}

/// `idemflow demo-producer`: sends the demo's stream of payment deductions (with producer retries, reused order ids
/// and poison records) to a real Kafka, RocketMQ or NATS JetStream, `rate` records per second, until stopped. Used
/// by docker-compose.yml so the dashboards show live duplicate rates. The order id is the record key (Kafka: it
/// chooses the partition, as a producer keyed by order would), the message's KEYS (RocketMQ, tag `pay`) or its
/// `Nats-Msg-Id` (JetStream; `topic` is the subject, each publish acknowledged by the stream).
pub async fn produce_forever(target: &ProducerTarget, topic: &str, rate: u32) -> anyhow::Result<()> {
    let mut producer = Producer::open(target, topic).await?;
    let mut stop = {
        let (trigger, stop) = shutdown::channel();
        let signals = shutdown::Signals::new();
        tokio::spawn(async move {
            signals.first().await;
            trigger.trigger();
        });
        stop
    };
    let rate = rate.max(1) as usize;
    let mut round = 0u64;
    let mut sent = 0u64;
    loop {
        let s = stream_from(rate, 1, 100 + round * 10_000_000, round.wrapping_mul(0x9e37_79b9) ^ 0x5eed);
        let started = Instant::now();
        let records: Vec<(String, &[u8])> = s
            .records
            .iter()
            .map(|(_, value)| {
                let text = String::from_utf8_lossy(value);
                let id = text.split("\"id\":\"").nth(1).or_else(|| text.split("\"id\": \"").nth(1)).unwrap_or_default();
                (id.split('"').next().unwrap_or_default().to_owned(), value.as_slice())
            })
            .collect();
        producer.send(topic, &records).await;
        sent += s.records.len() as u64;
        round += 1;
        if round.is_multiple_of(10) {
            eprintln!("demo-producer: {sent} records sent to {topic}");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1).saturating_sub(started.elapsed())) => {}
            _ = stop.wait() => break,
        }
    }
    eprintln!("demo-producer: {sent} records sent to {topic}");
    producer.close().await;
    Ok(())
}
