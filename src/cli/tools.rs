//! The tools beside the worker: `idemflow demo`, `idemflow demo-producer`, `idemflow bench` and `idemflow soak`.

use anyhow::bail;
use idemflow::{config, telemetry};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DemoProducerArgs {
    /// Kafka bootstrap servers (the environment's `IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS` when not given; ignored with
    /// --rocketmq-name-server or --nats-url, which say where to send instead).
    #[arg(long, env = "IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS", required_unless_present_any = ["rocketmq_name_server", "nats_url"])]
    bootstrap_servers: Option<String>,
    /// A RocketMQ name server (`host:port`) instead of Kafka: each payment is sent with its order id as the
    /// message's KEYS, tag `pay`.
    #[arg(long, conflicts_with = "nats_url")]
    rocketmq_name_server: Option<String>,
    /// A NATS server with JetStream (`nats://host:port`) instead of Kafka: each payment is published to the subject
    /// `--topic` with its order id as `Nats-Msg-Id`, and acknowledged by the stream that covers the subject.
    #[arg(long)]
    nats_url: Option<String>,
    /// With --nats-url: create this stream on `<first token of --topic>.>` (`payments.>`) if it does not exist yet
    /// (file storage, the server's 2-minute duplicate window); an existing one is left as it is.
    #[arg(long, requires = "nats_url")]
    create_stream: Option<String>,
    /// The topic (with --nats-url, the subject: `payments.created`).
    #[arg(long, default_value = "payments")]
    topic: String,
    /// Records per second.
    #[arg(long, default_value_t = 200)]
    rate: u32,
}

#[derive(clap::Args)]
pub struct DemoArgs {
    /// How many records to produce.
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    /// Use this server instead of a throwaway PostgreSQL cluster (a new database is created on it): postgres://...,
    /// or mysql://... / mariadb://... to run the demo on MySQL or MariaDB (through examples/mysql/payments.toml).
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// The broker: an embedded Kafka, a throwaway RabbitMQ node (needs Debian's rabbitmq-server), or a throwaway NATS
    /// server with JetStream (needs Debian's nats-server).
    #[arg(long, value_enum, default_value = "kafka")]
    source: idemflow::demo::DemoSource,
    /// The pipeline to run (default pipelines/payments.toml, or examples/rabbitmq/payments.toml with --source
    /// rabbitmq, examples/nats/payments.toml with --source nats); its tables are in the `.sql` file beside it.
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
    /// How the payments are encoded: json, or avro or protobuf (the schemas of examples/formats/, which the
    /// pipeline then reads as its schema_file).
    #[arg(long, value_enum, default_value = "json")]
    format: idemflow::demo::formats::DemoFormat,
    /// The side effect: table (the pipeline's own), or http: each payment also charged through a throwaway payment
    /// provider that honours idempotency keys, through the outbox ([[sink.http]]; docs/outbox.md).
    #[arg(long, value_enum, default_value = "table")]
    effect: idemflow::demo::DemoEffect,
}

#[derive(clap::Args)]
pub struct SoakArgs {
    /// How long the stream flows under faults, in minutes.
    #[arg(long, default_value_t = 60.0)]
    minutes: f64,
    /// Records produced per second (the demo's payments: 2% producer retries, 0.3% reused order ids, 0.1% poison).
    #[arg(long, default_value_t = 200)]
    rate: u32,
    /// The shortest time between two faults, in seconds.
    #[arg(long, default_value_t = 20)]
    fault_gap_min: u64,
    /// The longest time between two faults, in seconds.
    #[arg(long, default_value_t = 60)]
    fault_gap_max: u64,
    /// The seed of the faults' moments and kinds (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Where to write the report (Markdown); each pair's worker log and settings go into
    /// `soak-worker/<broker>-<store>/` beside it.
    #[arg(long, default_value = "target/soak/soak.md")]
    report: PathBuf,
    /// The broker of the pair.
    #[arg(long, value_enum, default_value = "kafka", conflicts_with = "every_pair")]
    source: idemflow::demo::broker::BrokerKind,
    /// The store of the pair.
    #[arg(long, value_enum, default_value = "postgres", conflicts_with = "every_pair")]
    store: idemflow::demo::store::StoreKind,
    /// Every broker x store pair of the guarantee matrix in turn (12), each for --minutes.
    #[arg(long)]
    every_pair: bool,
}

/// Runs `soak`.
///
/// Errors: the soak could not be set up, did not finish, or one of its checks failed.
pub async fn soak(a: SoakArgs) -> anyhow::Result<()> {
    // The brokers' own clients (the soak's producers) complain while the soak has the broker down: that is the
    // point, not news.
    telemetry::init(&config::LogSettings {
        level: "error,rdkafka=off,librdkafka=off,rocketmq_transport=off,rocketmq_client_rust=off,rocketmq_remoting=off".into(),
        ..Default::default()
    });
    if a.fault_gap_min > a.fault_gap_max || a.minutes <= 0.0 || a.rate == 0 {
        bail!("--fault-gap-min must not exceed --fault-gap-max, and --minutes and --rate must be above 0");
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let options = idemflow::soak::SoakOptions {
        pairs: if a.every_pair { idemflow::soak::every_pair() } else { vec![(a.source, a.store)] },
        duration: std::time::Duration::from_secs_f64(a.minutes * 60.0),
        rate: a.rate,
        fault_gap: (std::time::Duration::from_secs(a.fault_gap_min), std::time::Duration::from_secs(a.fault_gap_max)),
        report: a.report,
        seed,
    };
    if idemflow::soak::run(options).await? {
        Ok(())
    } else {
        bail!("a soak check failed (see the report)")
    }
}

#[derive(clap::Args)]
pub struct BenchArgs {
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
    /// The broker: the embedded Kafka (runs 1-20), a throwaway RabbitMQ node (runs 1, 5, 7 and 8 from quorum queues;
    /// needs Debian's rabbitmq-server), a throwaway NATS server (the same runs from JetStream streams; needs Debian's
    /// nats-server), or a throwaway RocketMQ name server and broker (the same runs from topics; needs
    /// rocketmq-namesrv-rust and rocketmq-broker-rust: scripts/rocketmq-throwaway.sh installs them).
    #[arg(long, value_enum, default_value = "kafka")]
    source: idemflow::bench::BenchSource,
    /// Make the selected runs this many times, one repetition after another, and give each ratio as the median of
    /// the repetitions' with their range (e.g. `--only 1,10 --repeat 5`: a shared machine's load moves one run's
    /// figures by up to 2x). The embedded Kafka only.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeat: u32,
}

/// Runs `bench`.
///
/// Errors: a run could not be set up or failed.
pub async fn bench(a: BenchArgs) -> anyhow::Result<()> {
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
        repeat: a.repeat,
    };
    let report = idemflow::bench::run(options).await?;
    println!("{}", idemflow::bench::markdown(&report));
    println!("written to {} and {}", a.markdown.display(), a.json.display());
    Ok(())
}

/// Runs `demo-producer` until stopped.
///
/// Errors: the producer could not be created.
pub async fn demo_producer(a: DemoProducerArgs) -> anyhow::Result<()> {
    use idemflow::demo::ProducerTarget;
    let target = match (a.rocketmq_name_server, a.nats_url, a.bootstrap_servers) {
        (Some(ns), _, _) => ProducerTarget::RocketMq(ns),
        (None, Some(url), _) => ProducerTarget::Nats { url, create_stream: a.create_stream },
        (None, None, Some(bootstrap)) => ProducerTarget::Kafka(bootstrap),
        (None, None, None) => bail!("give --bootstrap-servers (Kafka), --rocketmq-name-server or --nats-url"),
    };
    idemflow::demo::produce_forever(&target, &a.topic, a.rate).await
}

/// Runs `demo`.
///
/// Errors: the demo could not be set up, or its exactly-once check failed.
pub async fn demo(a: DemoArgs) -> anyhow::Result<()> {
    telemetry::init(&config::LogSettings { level: "error".into(), ..Default::default() });
    let options = idemflow::demo::DemoOptions {
        records: a.records,
        database_url: a.database_url,
        source: a.source,
        pipeline: a.pipeline,
        metrics_listen: a.metrics_listen,
        keep_running: a.keep_running,
        redis: a.redis,
        format: a.format,
        effect: a.effect,
    };
    if idemflow::demo::run(options).await? {
        Ok(())
    } else {
        bail!("the exactly-once check failed")
    }
}
