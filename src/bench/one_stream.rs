//! The runs on another broker than Kafka (`--source rabbitmq`, `nats`, `rocketmq`): the same stream published to
//! a throwaway broker, and the runs that compare there.

use std::time::Instant;
use super::options::*;
use super::report::*;
use super::workload::*;
use super::harness::*;
use super::baselines::*;
use crate::demo::broker::{BrokerKind, ThrowawayBroker};

/// A broker the bench reads through one queue or stream per run, its messages published before timing starts:
/// RabbitMQ (`--source rabbitmq`, a quorum queue per run), NATS JetStream (`--source nats`, a stream per run,
/// read by a durable pull consumer the worker creates) or RocketMQ (`--source rocketmq`, a topic of 4 queues per
/// run, read by the worker's pull consumer in clustering mode): the throwaway broker of the demo and the soak
/// ([`ThrowawayBroker`]), one stream of its own per run.
pub(super) struct OneStream(ThrowawayBroker);

impl OneStream {
    pub(super) async fn start(source: BenchSource) -> anyhow::Result<OneStream> {
        let kind = match source {
            BenchSource::Nats => BrokerKind::Nats,
            BenchSource::Rocketmq => BrokerKind::Rocketmq,
            BenchSource::Rabbitmq | BenchSource::Kafka => BrokerKind::Rabbitmq,
        };
        eprintln!("starting a throwaway {} broker...", kind.name());
        Ok(OneStream(ThrowawayBroker::start(kind, 1).await?))
    }

    /// Its name in the runs' names and ratios, and in database names.
    pub(super) fn tag(&self) -> (&'static str, &'static str) {
        (self.0.kind().flag(), self.0.kind().name())
    }

    /// The broker's line of the environment table.
    pub(super) fn describe(&self) -> String {
        let how = match self.0.kind() {
            BrokerKind::Rabbitmq => "throwaway node, quorum queues",
            BrokerKind::Nats => "throwaway server, JetStream file storage, a durable pull consumer with explicit acks",
            _ => "throwaway, one broker, a topic of 4 queues per run, consume offsets kept by the broker",
        };
        format!("{} ({how})", self.0.version())
    }

    /// Where run `n` reads, in the runs' names.
    pub(super) fn what(&self) -> &'static str {
        match self.0.kind() {
            BrokerKind::Rabbitmq => "a RabbitMQ quorum queue",
            BrokerKind::Nats => "a NATS JetStream stream",
            _ => "a RocketMQ topic",
        }
    }

    /// Run `n`'s queue, stream or topic.
    pub(super) fn name(n: u8) -> String {
        format!("bench-{n}")
    }

    /// Creates run `n`'s queue or stream and publishes `messages` to it, each confirmed by the broker. A JetStream
    /// publish carries no Nats-Msg-Id: the stream keeps the republished copies, as the Kafka and RabbitMQ runs do.
    pub(super) async fn publish(&self, n: u8, messages: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
        self.0.create(&Self::name(n)).await?;
        self.0.publish_to(&Self::name(n), messages).await
    }

    /// The `[source]` of run `n`.
    pub(super) fn source(&self, n: u8) -> String {
        self.0.source_for(&Self::name(n))
    }

    /// The settings' broker section.
    pub(super) fn section(&self) -> String {
        self.0.settings_toml()
    }
}

/// `idemflow bench --source rabbitmq` or `--source nats`: the stream published to a queue (a stream) per run of a
/// throwaway RabbitMQ node (NATS server), then (1) the worker (table form, default batching), (5) a consume-only
/// pass, (7) the Redis sink and (8) the shipped example, each from its own queue (stream).
pub(super) async fn run_one_stream(o: &BenchOptions, admin_url: &str) -> anyhow::Result<Report> {
    let broker = OneStream::start(o.source).await?;
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
            let run = WorkerRun { id: "(8)", name: &name, pipeline: from_queue(payments_pipeline()), group: "", target: total, applied: None, delivered: None };
            worker_run(run, &section, &url, o.perf).await?
        } else if n == 1 {
            let name = format!("idemflow from {what}, default batching (table form)");
            let run = WorkerRun { id: "(1)", name: &name, pipeline, group: "", target: total, applied: Some(s.firsts.len() as u64), delivered: None };
            worker_run(run, &section, &url, o.perf).await?
        } else if n == 7 {
            let redis = crate::demo::redis::Throwaway::start()?;
            let name = format!("idemflow from {what}, Redis sink (one script per batch)");
            let run = WorkerRun { id: "(7)", name: &name, pipeline: from_queue(redis_pipeline()), group: "", target: total, applied: Some(s.firsts.len() as u64), delivered: None };
            worker_run_on(run, &section, &format!("[redis]\nurl = \"{}\"\n", redis.url()), o.perf, &Probe::default()).await?
        } else {
            let (address, name, total) = (broker.0.address(), OneStream::name(n), s.records.len());
            match broker.0.kind() {
                BrokerKind::Rabbitmq => consume_only_rabbitmq(&address, &name, &url, &pipeline, total).await?,
                BrokerKind::Nats => consume_only_nats(&address, &name, &url, &pipeline, total).await?,
                _ => consume_only_rocketmq(&address, &url, &pipeline, total).await?,
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
