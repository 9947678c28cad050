//! The `idemflow` command: `migrate`, `check`, `run`.

// The RocketMQ client's futures are deeply nested (its own crates set the same limit).
#![recursion_limit = "256"]

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use idemflow::config::{self, PipelineError, Settings, StoreKind};
use idemflow::store::Store;
use idemflow::{http, metrics, shutdown, telemetry, worker};
use std::path::PathBuf;
use std::process::ExitCode;

/// Exactly-once effects from at-least-once brokers (Kafka topics, RabbitMQ queues, RocketMQ topics) into
/// PostgreSQL, MySQL/MariaDB or Redis: per batch one transaction (one script on Redis) writes a dedup row per
/// business key and applies the side effect only for keys never seen, then the broker's offsets are committed.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade idemflow's tables (dedup rows, dead letters, stored positions) in PostgreSQL or
    /// MySQL/MariaDB; Redis needs none.
    Migrate(ConfigArg),
    /// Validate the settings and every pipeline, ask each broker (Kafka, RabbitMQ, RocketMQ) for its topics or
    /// queues, and prepare each side effect against its store (PostgreSQL, MySQL/MariaDB, Redis).
    Check(ConfigArg),
    /// Run the worker (every pipeline, any broker and store) until SIGTERM or SIGINT; serves /metrics, /healthz and
    /// /readyz.
    Run(ConfigArg),
    /// Was this business key applied? When, from which record, and how many duplicates of it were skipped since
    /// (any store).
    Explain(ExplainArgs),
    /// Inspect dead letters and replay them once the cause is fixed (any store).
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// Move a pipeline's consumer group back (with its workers stopped) so its topics are consumed again: Kafka and
    /// RocketMQ (a RabbitMQ queue has no position to go back to); the dedup store skips every record already applied.
    Rewind(RewindArgs),
    /// Run one retention pass by hand: delete each pipeline's dedup rows older than its [dedup] retention
    /// (PostgreSQL, MySQL/MariaDB; Redis expires its dedup keys by themselves).
    Purge(PurgeArgs),
    /// See the whole job on this machine: an embedded Kafka broker (or a throwaway RabbitMQ), a throwaway PostgreSQL
    /// (or MySQL/MariaDB, Redis), a stream of payments with duplicates of every kind, and a summary that checks
    /// each payment took effect exactly once.
    Demo(DemoArgs),
    /// Measure throughput, CPU, memory and latency against the baselines (one record per transaction, a raw COPY,
    /// a consume-only pass), side by side in one run, on an embedded broker and a throwaway PostgreSQL.
    Bench(BenchArgs),
    /// Send the demo's stream of payments (with duplicates) to a real Kafka or RocketMQ, continuously (for
    /// docker-compose, and for trying a pipeline on your own broker).
    DemoProducer(DemoProducerArgs),
}

#[derive(clap::Args)]
struct DemoProducerArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS", required_unless_present = "rocketmq_name_server")]
    bootstrap_servers: Option<String>,
    /// A RocketMQ name server (`host:port`) instead of Kafka: each payment is sent with its order id as the
    /// message's KEYS, tag `pay`.
    #[arg(long, conflicts_with = "bootstrap_servers")]
    rocketmq_name_server: Option<String>,
    /// The topic.
    #[arg(long, default_value = "payments")]
    topic: String,
    /// Records per second.
    #[arg(long, default_value_t = 200)]
    rate: u32,
}

#[derive(Subcommand)]
enum DeadLettersCommand {
    /// The newest dead letters: id, pipeline, position, reason, time, error.
    List {
        /// The settings file.
        #[arg(long, short, default_value = "idemflow.toml")]
        config: PathBuf,
        /// Only this pipeline.
        #[arg(long)]
        pipeline: Option<String>,
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// The dead letters of Redis pipelines (the `<key_prefix>dead-letters` stream), when `[database]` is set too.
        #[arg(long)]
        redis: bool,
    },
    /// One dead letter in full: key, headers, payload (as text when it is UTF-8, else hex), error.
    Show {
        /// The settings file.
        #[arg(long, short, default_value = "idemflow.toml")]
        config: PathBuf,
        /// Its id.
        id: i64,
        /// A dead letter of a Redis pipeline, when `[database]` is set too.
        #[arg(long)]
        redis: bool,
    },
    /// Apply a dead letter through the pipeline's transactional path; its row is removed in the same transaction
    /// (if it fails again, it is dead-lettered again with the new error).
    Replay {
        /// The settings file.
        #[arg(long, short, default_value = "idemflow.toml")]
        config: PathBuf,
        /// Its id.
        id: i64,
        /// Replace the stored payload with this file's bytes (a fixed record).
        #[arg(long)]
        payload: Option<PathBuf>,
        /// A dead letter of a Redis pipeline, when `[database]` is set too.
        #[arg(long)]
        redis: bool,
    },
}

use idemflow::terminal::{escape, printable};

/// Where a dead letter came from: `topic/partition@offset`, or `queue NAME` (a queue has no stable position; the
/// stored "offset" of a queue's dead letter only numbers it).
fn stored_position(d: &idemflow::sink::dead_letter::Stored) -> String {
    if d.partition == idemflow::record::NO_PARTITION {
        format!("queue {}", d.topic)
    } else {
        d.record().position.to_string()
    }
}

#[derive(clap::Args)]
struct ExplainArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline.
    #[arg(long)]
    pipeline: String,
    /// The business key's canonical text (a composite key as its JSON array, e.g. '["o-1","3"]').
    #[arg(long)]
    key: String,
}

#[derive(clap::Args)]
struct RewindArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// The pipeline.
    #[arg(long)]
    pipeline: String,
    /// `earliest`, or an RFC 3339 timestamp (the first record at or after it), e.g. 2026-11-29T08:00:00Z.
    #[arg(long)]
    to: idemflow::source::rewind::Target,
    /// Print the plan and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// How long to wait for each Kafka request and for the group's assignment.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    timeout: std::time::Duration,
}

#[derive(clap::Args)]
struct PurgeArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// Only this pipeline.
    #[arg(long)]
    pipeline: Option<String>,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// How many records to produce.
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    /// Use this server instead of a throwaway PostgreSQL cluster (a new database is created on it): postgres://...,
    /// or mysql://... / mariadb://... to run the demo on MySQL or MariaDB (through examples/mysql/payments.toml).
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// The broker: an embedded Kafka, or a throwaway RabbitMQ node (needs Debian's rabbitmq-server).
    #[arg(long, value_enum, default_value = "kafka")]
    source: idemflow::demo::DemoSource,
    /// The pipeline to run (default pipelines/payments.toml, or examples/rabbitmq/payments.toml with --source
    /// rabbitmq); its tables are in the `.sql` file beside it.
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Where to serve /metrics while the demo runs.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_listen: std::net::SocketAddr,
    /// Keep the worker and /metrics up after the summary, until Ctrl-C.
    #[arg(long)]
    keep_running: bool,
    /// Redis as the store, through examples/redis/payments.toml: a throwaway redis-server (needs Debian's
    /// redis-server), or the server of a redis:// --database-url (its keys are written as they are: use a spare
    /// database number, redis://host:port/15).
    #[arg(long)]
    redis: bool,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Records in the stream (about 190 bytes of JSON each, 2% duplicates).
    #[arg(long, default_value_t = 1_000_000)]
    records: usize,
    /// Records for run (2), one transaction per record (the per-message pattern).
    #[arg(long, default_value_t = 20_000)]
    single_records: usize,
    /// Records for run (6), the per-record SQL form.
    #[arg(long, default_value_t = 200_000)]
    sql_records: usize,
    /// Dedup keys preloaded for run (4).
    #[arg(long, default_value_t = 10_000_000)]
    preload: u64,
    /// Use this server instead of a throwaway PostgreSQL cluster (databases bench_1.. are created on it): postgres://...,
    /// or mysql://... / mariadb://... for runs (1), (2), (5) and (6) on MySQL or MariaDB.
    #[arg(long)]
    database_url: Option<String>,
    /// Where to write the Markdown table.
    #[arg(long, default_value = "target/bench/bench.md")]
    markdown: PathBuf,
    /// Where to write the JSON.
    #[arg(long, default_value = "target/bench/bench.json")]
    json: PathBuf,
    /// Only these runs, e.g. `--only 1,5,7` (a ratio needs both of its runs).
    #[arg(long, value_delimiter = ',')]
    only: Vec<u8>,
    /// Profile each worker run with `perf record -g` (writes perf-N.data here; CPU figures then include perf).
    #[arg(long)]
    perf: bool,
    /// The broker: the embedded Kafka (runs 1-6), or a throwaway RabbitMQ node (runs 1 and 5 from quorum queues;
    /// needs Debian's rabbitmq-server).
    #[arg(long, value_enum, default_value = "kafka")]
    source: idemflow::demo::DemoSource,
}

#[derive(clap::Args)]
struct ConfigArg {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
}

fn main() -> ExitCode {
    idemflow::install_tls_provider();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: &std::path::Path) -> anyhow::Result<Settings> {
    // Only the default settings file may be absent (settings then come from IDEMFLOW_* variables alone): a file
    // named with --config that is not there is a mistake, not a fallback.
    if !path.exists() && path != std::path::Path::new(DEFAULT_CONFIG) {
        bail!("{}: no such settings file (given with --config)", path.display());
    }
    let loaded = config::load_settings(path)?;
    telemetry::init(&loaded.settings.log);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    Ok(loaded.settings)
}

/// The settings file read when `--config` is not given.
const DEFAULT_CONFIG: &str = "idemflow.toml";

fn report(errors: &[PipelineError]) -> anyhow::Error {
    for e in errors {
        eprintln!("{e}");
    }
    anyhow::anyhow!("{} problem(s) in the pipelines", errors.len())
}

async fn dead_letters(cmd: DeadLettersCommand) -> anyhow::Result<()> {
    let (config, redis) = match &cmd {
        DeadLettersCommand::List { config, redis, .. } | DeadLettersCommand::Show { config, redis, .. } | DeadLettersCommand::Replay { config, redis, .. } => {
            (config.clone(), *redis)
        }
    };
    let settings = load(&config)?;
    let kind = if redis || settings.database.is_none() { StoreKind::Redis } else { StoreKind::Database };
    let store = open_store(&settings, &config, kind).await?;
    match cmd {
        DeadLettersCommand::List { pipeline, limit, .. } => {
            let rows = store.dead_letters(pipeline.as_deref(), limit).await?;
            println!("{:>8}  {:<16} {:<28} {:<22} {:<32} error", "id", "pipeline", "position", "reason", "created_at");
            for d in &rows {
                let error: String = escape(&d.error).chars().take(100).collect();
                let position = stored_position(&d);
                println!("{:>8}  {:<16} {:<28} {:<22} {:<32} {error}", d.id, d.pipeline, position, d.reason, d.created_at);
            }
            println!("{} dead letter(s)", rows.len());
            Ok(())
        }
        DeadLettersCommand::Show { id, .. } => {
            let Some(d) = store.dead_letter(id).await? else { bail!("no dead letter with id {id}") };
            println!("id          {}", d.id);
            println!("pipeline    {}", d.pipeline);
            println!("position    {}", stored_position(&d));
            println!("reason      {}", d.reason);
            println!("error       {}", escape(&d.error));
            println!("created_at  {}", d.created_at);
            println!("key         {}", d.record_key.as_deref().map_or("(none)".to_owned(), printable));
            for (k, v) in d.property_names.iter().zip(&d.property_values) {
                println!("property    {}: {}", escape(k), escape(v));
            }
            for (k, v) in d.header_names.iter().zip(&d.header_values) {
                println!("header      {}: {}", escape(k), v.as_deref().map_or("(null)".to_owned(), printable));
            }
            println!("payload     {}", d.payload.as_deref().map_or("(null: a tombstone)".to_owned(), printable));
            if let (Some(size), Some(sha256)) = (d.payload_bytes, &d.payload_sha256) {
                let hex = idemflow::terminal::hex(sha256);
                println!(
                    "            (the first {} of {size} bytes; sha256 of the whole payload {hex}; replay it with --payload FILE)",
                    d.payload.as_ref().map_or(0, Vec::len)
                );
            }
            Ok(())
        }
        DeadLettersCommand::Replay { id, payload, .. } => {
            let Some(d) = store.dead_letter(id).await? else { bail!("no dead letter with id {id}") };
            let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
            let Some(p) = pipelines.into_iter().find(|p| p.name == d.pipeline) else {
                bail!("dead letter {id} belongs to pipeline {:?}, which is not configured in {}", d.pipeline, settings.pipelines.display());
            };
            let ready = worker::prepare(&store, std::slice::from_ref(&p)).await.map_err(|e| report(&e))?;
            let r = &ready[0];
            let mut record = d.record();
            if let Some(file) = payload {
                record.payload = Some(std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?);
                record.oversized = None;
            } else if let Some(o) = &record.oversized {
                let hex = idemflow::terminal::hex(&o.sha256);
                bail!(
                    "dead letter {id} kept only the first {} of its {} payload bytes: replay it with --payload FILE (the \
                     whole payload's sha256 was {hex})",
                    record.payload.as_ref().map_or(0, Vec::len),
                    o.size
                );
            }
            let prepared = r.preparer.prepare(&record);
            let outcome = r
                .sink
                .apply_replaying(std::slice::from_ref(&record), std::slice::from_ref(&prepared), |_| Ok(()), &[id])
                .await?;
            let c = &outcome.counts;
            if c.applied == 1 {
                println!("dead letter {id}: applied; its row is removed");
            } else if c.duplicates.iter().sum::<u64>() == 1 {
                println!("dead letter {id}: its business key was applied already (a duplicate); its row is removed");
            } else if let Some(again) = outcome.dead_letters.first() {
                println!("dead letter {id}: failed again ({}: {}); kept as a new dead letter", again.reason.as_str(), escape(&again.error));
                store.close().await;
                bail!("replay failed");
            } else {
                println!("dead letter {id}: skipped (a tombstone); its row is removed");
            }
            store.close().await;
            Ok(())
        }
    }
}

async fn rewind(a: RewindArgs) -> anyhow::Result<()> {
    use idemflow::config::OffsetStore;
    use idemflow::source::kafka::rewind;
    let settings = load(&a.config)?;
    let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
    let p = named(&pipelines, &a.pipeline, &settings)?.clone();
    let stored = p.offsets == OffsetStore::Database;
    if let config::SourceSpec::RocketMq(r) = &p.source {
        return rewind_rocketmq(&settings, &a, &p, r).await;
    }
    let Some(kafka_source) = p.source.kafka().cloned() else {
        bail!(
            "{}: pipeline {:?} has a {} source: rewind moves a consumer group back; a queue has no positions to go \
             back to (an acknowledged message has left it). Publish the messages again instead: the dedup store skips \
             those already applied",
            p.file.display(), p.name, p.source.kind()
        );
    };
    let store = if stored { Some(open_store(&settings, &a.config, p.sink.store()).await?) } else { None };
    // With stored positions, those are where the pipeline is: plan from them.
    let positions = match &store {
        Some(store) => Some(store.stored_offsets(&p.name).await?),
        None => None,
    };
    let (kafka, pp) = (settings.kafka.clone(), p.clone());
    let plan = tokio::task::spawn_blocking(move || rewind::plan(&kafka, &pp, a.to, positions.as_deref(), a.timeout)).await??;
    let moves = plan.moves;
    println!("pipeline {:?}, consumer group {:?}{}", p.name, kafka_source.group_id, if stored { ", stored positions too" } else { "" });
    println!("{:<32} {:>12} {:>12} {:>12} {:>12}", "partition", "from", "to", "end", "replayed");
    for m in &moves {
        let from = m.from.map_or("-".to_owned(), |o| o.to_string());
        let tp = format!("{}/{}", m.topic, m.partition);
        println!("{tp:<32} {from:>12} {:>12} {:>12} {:>12}", m.to, m.end, m.replayed());
    }
    for w in &plan.warnings {
        println!("warning: {w}");
    }
    let total: i64 = moves.iter().map(idemflow::source::rewind::Move::replayed).sum();
    if a.dry_run {
        let (kafka, pp) = (settings.kafka.clone(), p.clone());
        let members = tokio::task::spawn_blocking(move || rewind::active_members(&kafka, &pp, a.timeout)).await?;
        match members {
            Some(0) => println!("the group has no active members: a real run would go ahead"),
            Some(n) => println!("a real run would be refused: the group has {n} active member(s); stop every worker of the pipeline first"),
            None => println!(
                "the broker does not describe groups (DescribeGroups): a real run joins the group and is refused if a worker \
                 still holds a partition"
            ),
        }
        println!("dry run: nothing changed; {total} record(s) would be consumed again");
        return Ok(());
    }
    let runtime = tokio::runtime::Handle::current();
    let (kafka, pp, mv) = (settings.kafka.clone(), p.clone(), moves.clone());
    tokio::task::spawn_blocking(move || {
        rewind::apply(&kafka, &pp, &mv, a.timeout, || match &store {
            Some(store) => {
                let positions: Vec<(String, i32, i64)> = mv.iter().map(|m| (m.topic.clone(), m.partition, m.to)).collect();
                runtime.block_on(store.reset_offsets(&pp.name, &positions)).map(drop).map_err(|e| e.to_string())
            }
            None => Ok(()),
        })
    })
    .await??;
    println!(
        "rewound: {total} record(s) will be consumed again when the workers start; those already applied are skipped as duplicates (idemflow_duplicates_skipped_total)"
    );
    Ok(())
}

/// `idemflow rewind` for a RocketMQ pipeline: the plan from the group's consume offsets (or the stored positions),
/// printed; unless `--dry-run`, the group's offsets set (refused while members are online) and the stored
/// positions rewound too.
async fn rewind_rocketmq(settings: &Settings, a: &RewindArgs, p: &config::Pipeline, r: &config::RocketMqSpec) -> anyhow::Result<()> {
    use idemflow::config::OffsetStore;
    let rocketmq = settings
        .rocketmq
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("{}: a RocketMQ source needs [rocketmq] name_server", a.config.display()))?;
    let store = if p.offsets == OffsetStore::Database { Some(open_store(settings, &a.config, p.sink.store()).await?) } else { None };
    let positions = match &store {
        Some(store) => Some(store.stored_offsets(&p.name).await?),
        None => None,
    };
    let (moves, warnings, members) = idemflow::source::rocketmq::rewind(rocketmq, p, a.to, positions.as_deref(), a.dry_run, a.timeout)
        .await
        .map_err(|e| anyhow::anyhow!("{}: pipeline {:?}: rocketmq: {e}", p.file.display(), p.name))?;
    println!("pipeline {:?}, consumer group {:?}{}", p.name, r.consumer_group, if store.is_some() { ", stored positions too" } else { "" });
    println!("{:<40} {:>12} {:>12} {:>12} {:>12}", "queue", "from", "to", "end", "replayed");
    for m in &moves {
        let from = m.from.map_or("-".to_owned(), |o| o.to_string());
        let q = format!("{}/{}", m.topic, m.partition);
        println!("{q:<40} {from:>12} {:>12} {:>12} {:>12}", m.to, m.end, m.replayed());
    }
    for w in &warnings {
        println!("warning: {w}");
    }
    let total: i64 = moves.iter().map(idemflow::source::rewind::Move::replayed).sum();
    if a.dry_run {
        match members {
            0 => println!("the group has no members online: a real run would go ahead"),
            n => println!("a real run would be refused: the group has {n} member(s) online; stop every worker of the pipeline first"),
        }
        println!("dry run: nothing changed; {total} record(s) would be consumed again");
        return Ok(());
    }
    if let Some(store) = &store {
        let positions: Vec<(String, i32, i64)> = moves.iter().map(|m| (m.topic.clone(), m.partition, m.to)).collect();
        store.reset_offsets(&p.name, &positions).await?;
    }
    println!(
        "rewound: {total} record(s) will be consumed again when the workers start; those already applied are skipped as duplicates (idemflow_duplicates_skipped_total)"
    );
    Ok(())
}

/// Compares a pipeline's dedup retention with its topics' `retention.ms`: one line per topic.
async fn retention_report(settings: &Settings, p: &config::Pipeline) -> Vec<String> {
    if let config::SourceSpec::RocketMq(r) = &p.source {
        return vec![format!(
            "pipeline {:?}: topic {:?}: a RocketMQ broker keeps messages for its fileReservedTime (72 h by default); \
             [dedup] retention = {} must outlast it, or a replay of older messages (a rewind) would apply them again",
            p.name,
            r.topic,
            humantime::format_duration(p.dedup.retention)
        )];
    }
    let Some(kafka) = p.source.kafka() else {
        return vec![format!(
            "pipeline {:?}: a queue has no retention.ms to compare with; [dedup] retention = {} must outlast the longest \
             time a message can wait in its queues (a message redelivered after its dedup row was purged is applied again)",
            p.name,
            humantime::format_duration(p.dedup.retention)
        )];
    };
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(8),
        idemflow::source::kafka::topic_retention_ms(&settings.kafka, &kafka.topics),
    )
    .await;
    match read {
        Ok(Ok(topics)) => topics
            .into_iter()
            .map(|(topic, ms)| match ms {
                Some(ms) => idemflow::retention::window_warning(&p.name, &topic, ms, p.dedup.retention)
                    .map(|w| format!("warning: {w}"))
                    .unwrap_or_else(|| format!("pipeline {:?}: topic {topic:?}: dedup retention covers the topic's retention", p.name)),
                None => format!("warning: pipeline {:?}: topic {topic:?}: the broker did not return retention.ms", p.name),
            })
            .collect(),
        Ok(Err(e)) => vec![format!(
            "warning: pipeline {:?}: could not read the topics' retention.ms to compare with [dedup] retention: {e}",
            p.name
        )],
        Err(_) => vec![format!(
            "warning: pipeline {:?}: could not read the topics' retention.ms (no answer from Kafka in 8 s)",
            p.name
        )],
    }
}

/// One direct connection attempt to the store of `kind`, reported against the settings file.
///
/// Errors: the store's section is missing, or the store cannot be reached.
async fn reachable(settings: &Settings, config: &std::path::Path, kind: StoreKind) -> anyhow::Result<()> {
    match kind {
        StoreKind::Database => {
            let database = database_settings(settings, config)?;
            Store::ping(database).await.map_err(|why| anyhow::anyhow!("{}: database: {why}", config.display()))
        }
        StoreKind::Redis => {
            let redis = redis_settings(settings, config)?;
            idemflow::store::redis::ping(redis).await.map_err(|why| anyhow::anyhow!("{}: redis: {why}", config.display()))
        }
    }
}

fn database_settings<'s>(settings: &'s Settings, config: &std::path::Path) -> anyhow::Result<&'s config::DatabaseSettings> {
    settings.database.as_ref().ok_or_else(|| anyhow::anyhow!("{}: missing [database] (or IDEMFLOW_DATABASE__URL)", config.display()))
}

fn redis_settings<'s>(settings: &'s Settings, config: &std::path::Path) -> anyhow::Result<&'s config::RedisSettings> {
    settings.redis.as_ref().ok_or_else(|| anyhow::anyhow!("{}: missing [redis] (or IDEMFLOW_REDIS__URL)", config.display()))
}

/// A pool for the store of `kind`, without connecting.
fn store_of(settings: &Settings, config: &std::path::Path, kind: StoreKind) -> anyhow::Result<Store> {
    Ok(match kind {
        StoreKind::Database => Store::connect(database_settings(settings, config)?)?,
        StoreKind::Redis => Store::redis(redis_settings(settings, config)?).map_err(|why| anyhow::anyhow!("{}: {why}", config.display()))?,
    })
}

/// `settings`, with `[database] prepared_statements` off when the URL leads to PgBouncer: named prepared
/// statements collide behind a pooler in transaction mode, and whether they do depends on which server connection a
/// statement lands on; unnamed ones work in every mode (idemflow's statements are a few per batch).
async fn behind_pgbouncer(settings: &Settings, kind: StoreKind) -> Settings {
    let mut settings = settings.clone();
    if let (StoreKind::Database, Some(db)) = (kind, settings.database.as_mut()) {
        if db.prepared_statements && config::Dialect::of_url(db.url.expose()) == config::Dialect::Postgres {
            if let Some(what) = idemflow::store::postgres::pgbouncer(db).await {
                tracing::info!(pooler = %what, "the database URL leads to PgBouncer: statements are not prepared by name (as with prepared_statements = false)");
                db.prepared_statements = false;
            }
        }
    }
    settings
}

/// The store of `kind`, reachable and with idemflow's schema (the database) or a usable server (Redis).
async fn open_store(settings: &Settings, config: &std::path::Path, kind: StoreKind) -> anyhow::Result<Store> {
    reachable(settings, config, kind).await?;
    let settings = &behind_pgbouncer(settings, kind).await;
    let store = store_of(settings, config, kind)?;
    if let Err(why) = store.check_schema().await {
        let what = if kind == StoreKind::Redis { "redis" } else { "database" };
        bail!("{}: {what}: {why}", config.display());
    }
    Ok(store)
}

/// What `check` and `run` say about a Redis store's durability, and about retention, for the pipelines writing to
/// it: one line each, warnings prefixed `warning: `.
async fn redis_durability(redis: &idemflow::store::redis::RedisStore, pipelines: &[config::Pipeline]) -> Vec<String> {
    let mine: Vec<&config::Pipeline> = pipelines.iter().filter(|p| p.sink.store() == StoreKind::Redis).collect();
    let mut lines = Vec::new();
    let facts = match redis.check_server().await {
        Ok(f) => f,
        Err(why) => return vec![format!("warning: redis: {why}")],
    };
    let fsync = facts.appendfsync.clone().unwrap_or_else(|| "unknown (CONFIG GET is not allowed)".to_owned());
    lines.push(format!("redis {}: appendonly {}, appendfsync {fsync}", facts.version, if facts.aof { "yes" } else { "no" }));
    match &facts.eviction {
        Some((policy, true)) if policy != "noeviction" => lines.push(format!(
            "warning: redis: maxmemory-policy {policy} with maxmemory set: Redis may evict dedup keys (they all have a TTL) \
             or stored positions before their time, and an operation whose key was evicted is applied again when it comes \
             back. Set maxmemory-policy noeviction (a full Redis then refuses writes, and the worker waits and retries)"
        )),
        None => lines.push("warning: redis: cannot read maxmemory-policy (CONFIG GET is not allowed): make sure it is noeviction".to_owned()),
        _ => {}
    }
    if !facts.aof {
        lines.push(
            "warning: redis: appendonly is off: a restart loses every dedup key, stored position and effect written since the              last snapshot; a Kafka pipeline then stops (its positions are gone) and a RabbitMQ pipeline loses what it              acknowledged. Set appendonly yes"
                .to_owned(),
        );
    }
    for p in &mine {
        lines.push(format!(
            "pipeline {:?}: nothing to purge: its dedup keys expire by themselves after [dedup] retention = {}",
            p.name,
            humantime::format_duration(p.dedup.retention)
        ));
        if p.source.kafka().is_none() && facts.appendfsync.as_deref() != Some("always") {
            lines.push(format!(
                "warning: pipeline {:?}: a queue has no position to resume from: a message is acknowledged once its batch's                  script ran, and a crash of Redis before it wrote that script to disk (appendfsync {fsync}) loses its effect                  for good. Set appendfsync always on the Redis server",
                p.name
            ));
        }
    }
    lines
}

/// The store kinds `pipelines` write to, the database first.
fn kinds(pipelines: &[config::Pipeline]) -> Vec<StoreKind> {
    let mut kinds: Vec<StoreKind> = Vec::new();
    for k in [StoreKind::Database, StoreKind::Redis] {
        if pipelines.iter().any(|p| p.sink.store() == k) {
            kinds.push(k);
        }
    }
    kinds
}

/// Checks every pipeline against its store, all problems at once.
async fn prepare_all(stores: &[(StoreKind, Store)], pipelines: &[config::Pipeline]) -> Result<Vec<worker::Ready>, Vec<PipelineError>> {
    let mut ready = Vec::new();
    let mut errors = Vec::new();
    for (kind, store) in stores {
        let mine: Vec<config::Pipeline> = pipelines.iter().filter(|p| p.sink.store() == *kind).cloned().collect();
        match worker::prepare(store, &mine).await {
            Ok(r) => ready.extend(r),
            Err(e) => errors.extend(e),
        }
    }
    if errors.is_empty() { Ok(ready) } else { Err(errors) }
}

/// The pipeline named `name`, or an error saying where pipelines were looked for.
fn named<'p>(pipelines: &'p [config::Pipeline], name: &str, settings: &Settings) -> anyhow::Result<&'p config::Pipeline> {
    pipelines
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| anyhow::anyhow!("no pipeline named {name:?} in {}", settings.pipelines.display()))
}

/// At start-up the stores may not be up yet (a compose file starts everything at once): wait for each of `kinds`,
/// with exponential backoff, saying why on every attempt.
async fn wait_for_stores(settings: &Settings, kinds: &[StoreKind]) {
    for kind in kinds {
        let mut backoff = idemflow::retry::backoff(std::time::Duration::from_millis(200), std::time::Duration::from_secs(10));
        loop {
            let (what, result) = match kind {
                StoreKind::Database => ("database", Store::ping(settings.database.as_ref().expect("checked by check_sources")).await),
                StoreKind::Redis => ("redis", idemflow::store::redis::ping(settings.redis.as_ref().expect("checked by check_sources")).await),
            };
            let Err(why) = result else { break };
            let delay = backoff.next().unwrap_or(std::time::Duration::from_secs(10));
            tracing::warn!(retry_in = ?delay, "{what}: {why}");
            tokio::time::sleep(delay).await;
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Explain(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
            let p = named(&pipelines, &a.pipeline, &settings)?;
            let store = open_store(&settings, &a.config, p.sink.store()).await?;
            let key = idemflow::key::BusinessKey::new(a.key.clone());
            println!("pipeline {:?}, business key {:?}", p.name, a.key);
            match store.explain(&p.name, &key).await? {
                Some(e) => {
                    println!("  applied at         {}", e.applied_at);
                    let position = idemflow::record::Position { topic: e.topic.as_str().into(), partition: e.partition, offset: e.offset };
                    println!("  from               {position}");
                    println!("  payload sha256     {}", e.fingerprint);
                    match e.last_duplicate_at {
                        Some(at) => println!("  duplicates skipped {} since (the last at {at})", e.duplicates),
                        None => println!("  duplicates skipped 0 since"),
                    }
                }
                None => println!(
                    "  not in the dedup store: never applied, dead-lettered (see `idemflow dead-letters list`), or purged after \
                     [dedup] retention = {}",
                    humantime::format_duration(p.dedup.retention)
                ),
            }
            Ok(())
        }
        Command::DeadLetters(cmd) => dead_letters(cmd).await,
        Command::Rewind(a) => rewind(a).await,
        Command::Purge(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
            if let Some(name) = &a.pipeline {
                named(&pipelines, name, &settings)?;
            }
            let chosen: Vec<&config::Pipeline> = pipelines.iter().filter(|p| a.pipeline.as_ref().is_none_or(|n| *n == p.name)).collect();
            for p in chosen.iter().filter(|p| p.sink.store() == StoreKind::Redis) {
                println!(
                    "pipeline {:?}: nothing to purge, its dedup keys in Redis expire by themselves after [dedup] retention = {}",
                    p.name, humantime::format_duration(p.dedup.retention)
                );
            }
            let chosen: Vec<&config::Pipeline> = chosen.into_iter().filter(|p| p.sink.store() == StoreKind::Database).collect();
            if chosen.is_empty() {
                return Ok(());
            }
            let store = open_store(&settings, &a.config, StoreKind::Database).await?;
            for p in chosen {
                let o = store.purge(&p.name, p.dedup.retention, p.dedup.purge_batch, |_| {}).await?;
                if o.skipped_locked {
                    println!("pipeline {:?}: skipped, another process is purging it", p.name);
                } else {
                    println!(
                        "pipeline {:?}: purged {} dedup rows older than {} in {} batch(es)",
                        p.name, o.purged, humantime::format_duration(p.dedup.retention), o.batches
                    );
                }
            }
            Ok(())
        }
        Command::Bench(a) => {
            telemetry::init(&config::LogSettings { level: "warn".into(), ..Default::default() });
            let options = idemflow::bench::BenchOptions {
                records: a.records,
                single_records: a.single_records,
                sql_records: a.sql_records,
                preload: a.preload,
                database_url: a.database_url,
                markdown: a.markdown.clone(),
                json: a.json.clone(),
                only: a.only,
                perf: a.perf,
                source: a.source,
            };
            let report = idemflow::bench::run(options).await?;
            println!("{}", idemflow::bench::markdown(&report));
            println!("written to {} and {}", a.markdown.display(), a.json.display());
            Ok(())
        }
        Command::DemoProducer(a) => {
            use idemflow::demo::ProducerTarget;
            let target = match (a.rocketmq_name_server, a.bootstrap_servers) {
                (Some(ns), _) => ProducerTarget::RocketMq(ns),
                (None, Some(bootstrap)) => ProducerTarget::Kafka(bootstrap),
                (None, None) => bail!("give --bootstrap-servers (Kafka) or --rocketmq-name-server"),
            };
            idemflow::demo::produce_forever(&target, &a.topic, a.rate).await
        }
        Command::Demo(a) => {
            telemetry::init(&config::LogSettings { level: "error".into(), ..Default::default() });
            let options = idemflow::demo::DemoOptions {
                records: a.records,
                database_url: a.database_url,
                source: a.source,
                pipeline: a.pipeline,
                metrics_listen: a.metrics_listen,
                keep_running: a.keep_running,
                redis: a.redis,
            };
            if idemflow::demo::run(options).await? {
                Ok(())
            } else {
                bail!("the exactly-once check failed")
            }
        }
        Command::Migrate(a) => {
            let settings = load(&a.config)?;
            let Some(database) = &settings.database else {
                println!("no [database] in {}: nothing to migrate (Redis needs no schema: its keys are written by the batches)", a.config.display());
                return Ok(());
            };
            reachable(&settings, &a.config, StoreKind::Database).await?;
            let pooled = config::Dialect::of_url(database.url.expose()) == config::Dialect::Postgres
                && idemflow::store::postgres::pgbouncer(database).await.is_some();
            if !database.prepared_statements || pooled {
                bail!(
                    "{}: the database URL leads to a pooler (PgBouncer answers there, or database.prepared_statements = \
                     false says so): run \
                     `idemflow migrate` with a URL to PostgreSQL itself (IDEMFLOW_DATABASE__URL=... idemflow migrate): \
                     migrations take a session-level lock that a transaction pooler cannot keep",
                    a.config.display()
                );
            }
            let store = Store::connect(database)?;
            let latest = store.migrate().await.context("applying migrations")?;
            println!("idemflow schema at version {latest} (migrations recorded in _sqlx_migrations)");
            Ok(())
        }
        Command::Check(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
            config::check_sources(&settings, &pipelines).map_err(|e| report(&e))?;
            let mut source_lines = Vec::new();
            // A broker problem does not hide the database's: every pipeline's statements are still checked, and all
            // problems are reported together.
            let mut broker_problems: Vec<String> = Vec::new();
            for p in &pipelines {
                match &p.source {
                    config::SourceSpec::Kafka(_) => {
                        use idemflow::source::kafka;
                        kafka::check_properties(&settings.kafka, p)
                            .map_err(|e| anyhow::anyhow!("{}: {}", a.config.display(), kafka::describe_kafka_error(&e)))?;
                        let (kafka, pipeline) = (settings.kafka.clone(), p.clone());
                        let topics = tokio::task::spawn_blocking(move || {
                            idemflow::source::kafka::check_topics(&kafka, &pipeline, std::time::Duration::from_secs(5))
                        });
                        if let Err(e) = topics.await? {
                            broker_problems.push(format!("{}: pipeline {:?}: kafka: {e}", p.file.display(), p.name));
                        }
                    }
                    config::SourceSpec::RabbitMq(_) => {
                        let rabbitmq = settings.rabbitmq.as_ref().expect("checked by check_sources");
                        match idemflow::source::rabbitmq::check(rabbitmq, p).await {
                            Ok(lines) => source_lines.extend(lines),
                            Err(e) => broker_problems.push(format!("{}: pipeline {:?}: rabbitmq: {e}", p.file.display(), p.name)),
                        }
                    }
                    config::SourceSpec::RocketMq(_) => {
                        let rocketmq = settings.rocketmq.as_ref().expect("checked by check_sources");
                        match idemflow::source::rocketmq::check(rocketmq, p).await {
                            Ok(lines) => source_lines.extend(lines),
                            Err(e) => broker_problems.push(format!("{}: pipeline {:?}: rocketmq: {e}", p.file.display(), p.name)),
                        }
                    }
                }
            }
            let brokers = |problems: &[String]| {
                for problem in problems {
                    eprintln!("{problem}");
                }
            };
            let database = async {
                let mut stores = Vec::new();
                for kind in kinds(&pipelines) {
                    stores.push((kind, open_store(&settings, &a.config, kind).await?));
                }
                for (_, store) in &stores {
                    if let Store::Redis(redis) = store {
                        source_lines.extend(redis_durability(redis, &pipelines).await);
                    }
                }
                prepare_all(&stores, &pipelines).await.map_err(|e| report(&e))
            };
            let ready = match database.await {
                Ok(ready) => ready,
                Err(e) if broker_problems.is_empty() => return Err(e),
                Err(e) => {
                    brokers(&broker_problems);
                    bail!("{e}, and {} problem(s) with the brokers", broker_problems.len());
                }
            };
            if !broker_problems.is_empty() {
                brokers(&broker_problems);
                bail!(
                    "{} problem(s) with the brokers (the database, its schema and every pipeline's statements are right)",
                    broker_problems.len()
                );
            }
            for r in &ready {
                let p = &r.pipeline;
                match &p.source {
                    config::SourceSpec::Kafka(k) => {
                        println!("pipeline {:?} ({}): ok, topics {:?}, group {:?}", p.name, p.file.display(), k.topics, k.group_id)
                    }
                    config::SourceSpec::RabbitMq(q) => {
                        println!("pipeline {:?} ({}): ok, queues {:?}, prefetch {}", p.name, p.file.display(), q.queues, q.prefetch)
                    }
                    config::SourceSpec::RocketMq(r) => println!(
                        "pipeline {:?} ({}): ok, topic {:?}, consumer group {:?}, offsets in {}",
                        p.name,
                        p.file.display(),
                        r.topic,
                        r.consumer_group,
                        if p.offsets == config::OffsetStore::Database { "the store" } else { "the broker" }
                    ),
                }
            }
            for r in &ready {
                for note in &r.notes {
                    println!("pipeline {:?}: {note}", r.pipeline.name);
                }
            }
            for line in source_lines {
                println!("{line}");
            }
            let mut timing: Vec<String> = pipelines
                .iter()
                .filter(|p| p.source.kafka().is_some())
                .flat_map(|p| idemflow::source::kafka::timing_warnings(&settings, p))
                .collect();
            timing.dedup();
            for w in timing {
                println!("warning: {w}");
            }
            for p in &pipelines {
                for line in retention_report(&settings, p).await {
                    println!("{line}");
                }
            }
            Ok(())
        }
        Command::Run(a) => {
            let settings = load(&a.config)?;
            let pipelines = config::load_pipelines_for(&settings).map_err(|e| report(&e))?;
            config::check_sources(&settings, &pipelines).map_err(|e| report(&e))?;
            // Serve /healthz from the start: the process is alive while it waits for the database.
            let metrics = metrics::Metrics::new();
            metrics.set_stall_after(settings.metrics.stall_after);
            let health = http::Health::default();
            health.database(false);
            let server = http::serve(settings.metrics.listen, metrics.clone(), health.clone())
                .with_context(|| format!("binding metrics.listen = {}", settings.metrics.listen))?;
            tracing::info!(address = %server.addr(), "serving /metrics, /healthz and /readyz");
            let (trigger, mut stop) = shutdown::channel();
            let timeout = settings.shutdown.timeout;
            tokio::spawn(async move {
                shutdown::signals().await;
                trigger.trigger();
                tokio::time::sleep(timeout).await;
                eprintln!("shutdown took longer than shutdown.timeout = {timeout:?}; exiting");
                std::process::exit(1);
            });
            let needed = kinds(&pipelines);
            tokio::select! {
                _ = wait_for_stores(&settings, &needed) => {}
                _ = stop.wait() => {
                    tracing::info!("stopped before the stores were reachable");
                    return Ok(());
                }
            }
            health.database(true);
            let mut stores = Vec::new();
            for kind in needed {
                stores.push((kind, open_store(&settings, &a.config, kind).await?));
            }
            for (_, store) in &stores {
                if let Store::Redis(redis) = store {
                    for line in redis_durability(redis, &pipelines).await {
                        match line.strip_prefix("warning: ") {
                            Some(w) => tracing::warn!("{w}"),
                            None => tracing::info!("{line}"),
                        }
                    }
                }
            }
            let ready = prepare_all(&stores, &pipelines).await.map_err(|e| report(&e))?;
            for p in pipelines.clone() {
                let settings = settings.clone();
                tokio::spawn(async move {
                    for line in retention_report(&settings, &p).await {
                        match line.strip_prefix("warning: ") {
                            Some(w) => tracing::warn!("{w}"),
                            None => tracing::info!("{line}"),
                        }
                    }
                });
            }
            let failures = worker::run(&settings, ready, &metrics, &health, stop.clone()).await;
            if !failures.is_empty() && !stop.is_triggered() {
                // Every pipeline stopped on a fatal error: keep /metrics and /readyz up (pipeline_up 0, not ready)
                // so monitoring sees why, rather than exiting into a restart loop. Exit 1 on SIGTERM/SIGINT.
                tracing::error!("every pipeline has stopped on a fatal error; serving /metrics until stopped");
                stop.wait().await;
            }
            for (_, store) in &stores {
                store.close().await;
            }
            if failures.is_empty() {
                tracing::info!("stopped cleanly");
                Ok(())
            } else {
                bail!("{} pipeline(s) failed: {}", failures.len(), failures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; "))
            }
        }
    }
}
