//! The guarantee matrix: one set of black-box scenarios, written once, run through the binary on the real servers
//! against every source x store pair idemflow supports (Kafka, RabbitMQ, RocketMQ, NATS JetStream x PostgreSQL,
//! MariaDB, Redis).
//! Each scenario asserts the guarantee itself: every operation applied once with exact amounts, exact duplicate
//! counters where the scenario makes them exact, every poison record dead-lettered with its reason, nothing
//! dead-lettered for an outage. What differs per pair is only how a record is published and how the store is read:
//! [`Src`] and [`Dst`].
//!
//! | scenario | test |
//! |---|---|
//! | (a) the core duplicates (republished, payload mismatch, redelivered after a restart) with exact counters, and (d) poison records dead-lettered with their reason while the stream moves on | `core_<source>_<store>` |
//! | (b) a crash loop of SIGKILLs while the stream flows | `crash_loop_<source>_<store>` |
//! | (c) the store unavailable mid-stream | `store_cut_<source>_<store>` |
//! | (e) a second worker joining and leaving | `second_worker_<source>_<store>` |
//!
//! A queue (RabbitMQ) and a JetStream durable consumer cannot be rewound, so "redelivered after a restart" is not
//! forced there with an exact count: their redeliveries show up in the crash loop, where each one is counted and
//! nothing is applied twice. JetStream pairs run with `ack_wait = "4s"`, shorter than the store outage of (c):
//! there the in-progress acks must keep every held delivery from being redelivered.
//! The table in docs/guarantee.md is made from the test names here (`the_guarantee_page_table_is_made_from_the_matrix`).
//!
//! The same scenarios run again with the outbox (`matrix_outbox!`, `outbox_<scenario>_<source>_<store>`): the
//! shipped example's effect and an HTTP charge per operation through `[[sink.http]]` to the suite's payment
//! provider, on Kafka x PostgreSQL and MySQL/MariaDB (the stores that keep an outbox) and RabbitMQ x PostgreSQL's crash
//! loop: every operation also charged exactly once by the provider.
//!
//! Scenario (a) also runs with the payloads in Avro and in Protobuf ([`core_in`], `formats::matrix_core_*`): the
//! same stream encoded by confluent-kafka's serializers in the schema registry's wire format, read through
//! `[schema_registry]`; the poison records stay the bytes they are.

use crate::failures::{assert_counters_add_up, payments, Payments, Rng};
use crate::support::mariadb::MyDb;
use crate::support::nats::NatsServer;
use crate::support::redis::RedisServer;
use crate::support::relay::Relay;
use crate::support::rocketmq::{self, Producer};
use crate::support::{rabbitmq, *};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Operations in a scenario's stream (and 2% republished, 1% mismatched, poison records among them).
const DISTINCT: usize = 600;

/// A pair's broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Broker {
    Kafka,
    RabbitMq,
    RocketMq,
    Nats,
}

/// A pair's store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Db {
    Postgres,
    MariaDb,
    Redis,
}

/// The broker side of a pair, for one test: its topic or queue, its settings section, and publishing.
enum Src {
    Kafka(Kafka),
    RabbitMq { client: rabbitmq::Client, queue: String },
    RocketMq { producer: Producer, topic: String },
    Nats { server: NatsServer, stream: String },
}

/// The `ack_wait` of the JetStream pairs' consumer: shorter than the store outage of (c), longer than a batch's
/// `max_wait`; the crash loop's held deliveries come back after it.
const NATS_ACK_WAIT: &str = "4s";

/// Partitions (Kafka) or queues (RocketMQ) of a scenario's topic.
const PARTITIONS: i32 = 3;

impl Src {
    async fn new(broker: Broker) -> Src {
        match broker {
            Broker::Kafka => {
                let kafka = Kafka::new();
                kafka.create_topic("payments", PARTITIONS);
                Src::Kafka(kafka)
            }
            Broker::RabbitMq => {
                let client = rabbitmq::Client::connect(rabbitmq::shared_url()).await;
                let queue = format!("matrix-{}", unique());
                client.declare(&queue, "quorum", false).await;
                Src::RabbitMq { client, queue }
            }
            Broker::RocketMq => {
                let producer = Producer::start(rocketmq::shared()).await;
                Src::RocketMq { producer, topic: format!("matrix-{}", unique()) }
            }
            Broker::Nats => {
                let server = NatsServer::start();
                let stream = "PAYMENTS".to_owned();
                server.create_stream(&stream).await;
                Src::Nats { server, stream }
            }
        }
    }

    /// The pipeline's source: what replaces `topics = ["payments"]` in a shipped example.
    fn source(&self) -> String {
        match self {
            Src::Kafka(_) => "topics = [\"payments\"]".to_owned(),
            Src::RabbitMq { queue, .. } => format!("[source]\nkind = \"rabbitmq\"\nqueue = \"{queue}\""),
            // As the shipped RocketMQ example: positions stored with each batch (a RocketMQ consumer's offsets are
            // written back by the client every 5 s, so a crash or a rebalance would otherwise redeliver more).
            Src::RocketMq { topic, .. } => format!(
                "[source]\nkind = \"rocketmq\"\ntopic = \"{topic}\"\nconsumer_group = \"idemflow-{topic}\"\n[offsets]\nstore = \"database\""
            ),
            Src::Nats { stream, .. } => format!("[source]\nkind = \"nats\"\nstream = \"{stream}\"\nack_wait = \"{NATS_ACK_WAIT}\""),
        }
    }

    /// The settings' broker section.
    fn section(&self) -> String {
        match self {
            Src::Kafka(kafka) => format!("[kafka]\nbootstrap_servers = \"{}\"\n[kafka.properties]{}\n", kafka.bootstrap(), TEST_KAFKA_PROPERTIES),
            Src::RabbitMq { .. } => rabbitmq::settings(rabbitmq::shared_url()),
            Src::RocketMq { .. } => rocketmq::settings(rocketmq::shared()),
            Src::Nats { server, .. } => server.settings(),
        }
    }

    /// The stream for this broker: a queue has one partition.
    fn stream(&self) -> Payments {
        payments(DISTINCT, if matches!(self, Src::RabbitMq { .. } | Src::Nats { .. }) { 1 } else { PARTITIONS }, false)
    }

    /// Publishes `s.records[range]`, each to its record's partition (Kafka) or queue (RocketMQ).
    async fn publish(&mut self, s: &Payments, range: std::ops::Range<usize>) {
        match self {
            Src::Kafka(kafka) => kafka.produce("payments", &s.records[range]),
            Src::RabbitMq { client, queue } => client.publish(queue, &crate::rabbitmq::messages(s)[range]).await,
            Src::RocketMq { producer, topic } => {
                let from = range.start;
                let msgs: Vec<rocketmq::Msg> = crate::rabbitmq::messages(s)[range]
                    .iter()
                    .map(|m| rocketmq::Msg::keyed(m.message_id.as_deref().unwrap(), String::from_utf8(m.body.clone()).unwrap()))
                    .collect();
                producer.send(topic, &msgs, |i| s.records[from + i].partition).await;
            }
            // Without Nats-Msg-Id: the copies stand for a producer publishing again after the stream's duplicate
            // window, which only idemflow's dedup rows catch.
            Src::Nats { server, stream } => {
                let msgs: Vec<(Option<String>, Vec<u8>)> = crate::rabbitmq::messages(s)[range].iter().map(|m| (None, m.body.clone())).collect();
                server.publish(&format!("{stream}.payments"), &msgs).await;
            }
        }
    }

    /// Whether its records have positions a rewind can go back to, and the store keeps them (a JetStream stream
    /// sequence classifies a redelivery, but the consumer's position is on the server: a redelivered poison
    /// message gets a second dead letter, as from a queue).
    fn positional(&self) -> bool {
        !matches!(self, Src::RabbitMq { .. } | Src::Nats { .. })
    }
}

/// The store side of a pair, for one test: a fresh database (or Redis server) with the shipped example's tables.
enum Dst {
    Postgres(TestDb),
    MariaDb(MyDb),
    Redis(RedisServer),
}

impl Dst {
    async fn new(db: Db) -> Dst {
        match db {
            Db::Postgres => Dst::Postgres(crate::failures::payments_db(None).await),
            Db::MariaDb => Dst::MariaDb(crate::mariadb::payments_db(None).await),
            Db::Redis => Dst::Redis(RedisServer::start()),
        }
    }

    /// The shipped example pipeline of this store, reading `source`.
    fn pipeline(&self, source: &str) -> String {
        let file = match self {
            Dst::Postgres(_) => "pipelines/payments.toml",
            Dst::MariaDb(_) => "examples/mysql/payments.toml",
            Dst::Redis(_) => "examples/redis/payments.toml",
        };
        let text = std::fs::read_to_string(project_root().join(file)).unwrap();
        assert!(text.contains("topics = [\"payments\"]"), "{file} reads topic payments");
        text.replace("topics = [\"payments\"]", source)
    }

    /// Whether the store keeps each partition's processed mark beside the stored positions (the databases), so a
    /// record replayed at a position already processed is a redelivery whatever its payload. Redis tells a
    /// redelivery by its dedup key's position only: a replayed copy counts under its own reason again.
    fn keeps_processed_marks(&self) -> bool {
        match self {
            Dst::Postgres(_) | Dst::MariaDb(_) => true,
            Dst::Redis(_) => false,
        }
    }

    /// Where the store listens.
    fn addr(&self) -> SocketAddr {
        let url = match self {
            Dst::Postgres(db) => db.url.clone(),
            Dst::MariaDb(db) => db.url.clone(),
            Dst::Redis(r) => r.url.clone(),
        };
        let u = url::Url::parse(&url).unwrap();
        SocketAddr::new(u.host_str().unwrap().parse().unwrap(), u.port().unwrap())
    }

    /// The settings' store section, through `relay` when given.
    fn section(&self, relay: Option<&Relay>) -> String {
        let url = |url: &str| match relay {
            Some(r) => {
                let mut u = url::Url::parse(url).unwrap();
                u.set_port(Some(r.addr.port())).unwrap();
                u.to_string()
            }
            None => url.to_owned(),
        };
        match self {
            Dst::Postgres(db) => format!("[database]\nurl = \"{}\"\nmax_connections = 4\nacquire_timeout = \"2s\"\n", url(&db.url)),
            Dst::MariaDb(db) => format!("[database]\nurl = \"{}\"\nmax_connections = 4\nacquire_timeout = \"2s\"\n", url(&db.url)),
            Dst::Redis(r) => format!("[redis]\nurl = \"{}\"\nconnect_timeout = \"2s\"\nresponse_timeout = \"5s\"\n", url(&r.url)),
        }
    }

    /// Dedup rows (keys) and the distinct payloads among the dead letters, or `None` when the store cannot be read.
    async fn progress(&self) -> Option<(i64, i64)> {
        match self {
            Dst::Postgres(db) => {
                let rows = sqlx::query_scalar("SELECT count(*) FROM idemflow.dedup").fetch_one(&db.pool).await.ok()?;
                let dead = sqlx::query_scalar("SELECT count(DISTINCT payload) FROM idemflow.dead_letters").fetch_one(&db.pool).await.ok()?;
                Some((rows, dead))
            }
            Dst::MariaDb(db) => {
                let rows = sqlx::query_scalar("SELECT COUNT(*) FROM idemflow_dedup").fetch_one(&db.pool).await.ok()?;
                let dead = sqlx::query_scalar("SELECT COUNT(DISTINCT payload) FROM idemflow_dead_letters").fetch_one(&db.pool).await.ok()?;
                Some((rows, dead))
            }
            Dst::Redis(r) => {
                let mut c = ::redis::Client::open(r.url.as_str()).ok()?.get_connection().ok()?;
                let keys: Vec<String> = ::redis::cmd("KEYS").arg("idemflow:payments:k:*").query(&mut c).ok()?;
                Some((keys.len() as i64, redis_dead_payloads(&mut c).len() as i64))
            }
        }
    }

    /// Every operation applied once with exact amounts, one dedup row each, every poison payload dead-lettered
    /// (once per position; a queue's redelivered poison message may be recorded again, never another payload).
    async fn assert_exactly_once(&self, s: &Payments, positional: bool) {
        self.assert_once(s, Order::Kept, positional).await
    }

    /// [`Dst::assert_exactly_once`], where with [`Order::Lost`] the copy with another amount may be the first to
    /// arrive (two consumers sharing a queue), so each operation's amount is its original's or its copy's, and
    /// the deductions are exactly the applied amounts. With a `positional` source dead letters are counted
    /// exactly (one per poison record: a redelivered one has the same position); from a queue, by distinct payload.
    async fn assert_once(&self, s: &Payments, order: Order, positional: bool) {
        let expected = s.expected_amount();
        let cents = |text: &str| crate::redis::cents(text);
        let amount_ok = |applied: &str| match order {
            Order::Kept => applied == expected,
            Order::Lost => (cents(&expected)..=cents(&expected) + s.mismatched as i64).contains(&cents(applied)),
        };
        match self {
            Dst::Postgres(db) => {
                assert_eq!(db.scalar::<i64>("SELECT count(*) FROM payments").await, s.distinct as i64, "one payment per operation");
                let applied = db.scalar::<String>("SELECT sum(amount)::text FROM payments").await;
                assert!(amount_ok(&applied), "amounts exact: {applied}, expected {expected} ({order:?})");
                assert_eq!(db.scalar::<String>("SELECT (-sum(balance))::text FROM accounts").await, applied, "each deduction once");
                assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dedup").await, s.distinct as i64);
                assert_eq!(db.scalar::<i64>("SELECT count(DISTINCT payload) FROM idemflow.dead_letters").await, s.poison as i64);
                if positional {
                    assert_eq!(db.scalar::<i64>("SELECT count(*) FROM idemflow.dead_letters").await, s.poison as i64, "one dead letter per position");
                }
                let reasons: Vec<String> = sqlx::query_scalar("SELECT DISTINCT reason FROM idemflow.dead_letters").fetch_all(&db.pool).await.unwrap();
                assert_eq!(reasons, ["decode_failed"], "poison records only, with their reason");
            }
            Dst::MariaDb(db) => {
                assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM payments").await, s.distinct as i64, "one payment per operation");
                let applied = db.scalar::<String>("SELECT CAST(SUM(amount) AS CHAR) FROM payments").await;
                assert!(amount_ok(&applied), "amounts exact: {applied}, expected {expected} ({order:?})");
                assert_eq!(db.scalar::<String>("SELECT CAST(-SUM(balance) AS CHAR) FROM accounts").await, applied, "each deduction once");
                assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dedup").await, s.distinct as i64);
                assert_eq!(db.scalar::<i64>("SELECT COUNT(DISTINCT payload) FROM idemflow_dead_letters").await, s.poison as i64);
                if positional {
                    assert_eq!(db.scalar::<i64>("SELECT COUNT(*) FROM idemflow_dead_letters").await, s.poison as i64, "one dead letter per position");
                }
                let reasons: Vec<String> = sqlx::query_scalar("SELECT DISTINCT CAST(reason AS CHAR) FROM idemflow_dead_letters").fetch_all(&db.pool).await.unwrap();
                assert_eq!(reasons, ["decode_failed"], "poison records only, with their reason");
            }
            Dst::Redis(r) => {
                let mut c = r.conn();
                let (payments, amount, total, count, applied, dedup, _) = crate::redis::state(&mut c);
                assert_eq!(payments, s.distinct, "one payment hash per operation");
                let text = format!("{}.{:02}", amount / 100, amount % 100);
                assert!(amount_ok(&text), "amounts exact: {text}, expected {expected} ({order:?})");
                assert_eq!(total, amount, "each deduction once");
                assert_eq!(count, s.distinct as i64, "each count once");
                assert_eq!(applied, s.distinct, "one stream entry per operation");
                assert_eq!(dedup, s.distinct, "one dedup key per operation");
                let dead = redis_dead_payloads(&mut c);
                assert_eq!(dead.len(), s.poison, "one dead-lettered payload per poison record");
                if positional {
                    assert_eq!(redis_dead_field(&mut c, "payload").len(), s.poison, "one dead letter per position");
                }
                let reasons: HashSet<String> = redis_dead_field(&mut c, "reason").into_iter().collect();
                assert_eq!(reasons, HashSet::from(["decode_failed".to_owned()]), "poison records only, with their reason");
            }
        }
    }
}

/// Whether the stream's order reaches the store: kept per partition or queue by one consumer at a time (Kafka,
/// RocketMQ, a queue with one consumer); lost between consumers sharing a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Kept,
    Lost,
}

/// A field of every entry of the Redis dead-letter stream.
fn redis_dead_field(c: &mut ::redis::Connection, field: &str) -> Vec<String> {
    let entries: Vec<(String, Vec<(String, String)>)> =
        ::redis::cmd("XRANGE").arg("idemflow:dead-letters").arg("-").arg("+").query(c).unwrap_or_default();
    entries.into_iter().filter_map(|(_, fields)| fields.into_iter().find(|(k, _)| k == field).map(|(_, v)| v)).collect()
}

/// The distinct payloads of the Redis dead-letter stream.
fn redis_dead_payloads(c: &mut ::redis::Connection) -> HashSet<String> {
    redis_dead_field(c, "payload").into_iter().collect()
}

/// One pair, live for a test: its broker, its store, the stream, and settings for the worker(s).
struct Pair {
    src: Src,
    dst: Dst,
    s: Payments,
    broker: Broker,
    db: Db,
    /// The schema registry the payloads' schemas are in, and its `[schema_registry]` section (not JSON).
    registry: Option<(crate::support::registry::Registry, String)>,
    /// The pipeline's `format` line (empty for JSON).
    format: &'static str,
    /// With [`Effect::Outbox`]: the payment provider every operation is also charged at, through the outbox.
    provider: Option<crate::support::provider::Provider>,
}

/// The side effect a scenario runs: the shipped example's, or that and an HTTP charge per operation through the
/// outbox (`[[sink.http]]` to the suite's payment provider), each operation then also charged exactly once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    Sink,
    Outbox,
}

/// The `[[sink.http]]` the outbox scenarios add to the shipped example: each operation charged at `url`, from its
/// `[sink.params]` (the same names in every shipped database example).
fn http_effect(url: &str) -> String {
    format!(
        "\n[[sink.http]]\nname = \"provider\"\nurl = \"{url}/v1/charges\"\n\
         body = {{ order = \"{{order_id}}\", account = \"{{account_id}}\", amount = \"{{amount}}\" }}\n\
         timeout = \"2s\"\n\n[outbox]\npoll_interval = \"200ms\"\nbackoff = \"200ms\"\nmax_backoff = \"1s\"\nlease = \"8s\"\n"
    )
}

/// How a scenario's payloads are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PayloadFormat {
    /// JSON, as the shipped examples read it.
    Json,
    /// Avro of `examples/formats/payment.avsc`, in the schema registry's wire format.
    Avro,
    /// Protobuf of `examples/formats/payment.proto`, in the schema registry's wire format.
    Protobuf,
}

impl Pair {
    /// [`Dst::assert_exactly_once`] for this pair's source.
    async fn assert_exactly_once(&self) {
        self.dst.assert_exactly_once(&self.s, self.src.positional()).await;
        self.assert_charged_once();
    }

    /// With the outbox: every operation charged once by the provider, no key twice.
    fn assert_charged_once(&self) {
        let Some(provider) = &self.provider else { return };
        let state = provider.state();
        assert_eq!(state["distinct_keys"], self.s.distinct, "{state:#}");
        assert_eq!(state["charges"], self.s.distinct, "each operation charged once: {state:#}");
        assert_eq!(state["mismatches"], 0, "a request sent again is the same request: {state:#}");
    }

    async fn new(broker: Broker, db: Db, effect: Effect) -> Pair {
        let mut pair = Pair::new_in(PayloadFormat::Json, broker, db).await;
        if effect == Effect::Outbox {
            pair.provider = Some(crate::support::provider::Provider::start(&[]));
        }
        pair
    }

    /// A pair whose stream is encoded in `format` by confluent-kafka's serializers (poison records as they are),
    /// their schema registered in a registry of the test's own.
    async fn new_in(format: PayloadFormat, broker: Broker, db: Db) -> Pair {
        let src = Src::new(broker).await;
        let dst = Dst::new(db).await;
        let mut s = src.stream();
        let (registry, format) = match format {
            PayloadFormat::Json => (None, ""),
            f => {
                let registry = crate::support::registry::Registry::start(&[]);
                let docs: Vec<(usize, String)> = s
                    .records
                    .iter()
                    .enumerate()
                    .filter_map(|(i, r)| {
                        let text = String::from_utf8(r.value.clone()?).ok()?;
                        serde_json::from_str::<serde_json::Value>(&text).ok().map(|_| (i, text))
                    })
                    .collect();
                let texts: Vec<String> = docs.iter().map(|(_, t)| t.clone()).collect();
                let root = project_root().join("examples/formats");
                let (encoded, line) = if f == PayloadFormat::Avro {
                    (registry.serialize("avro", "payments", &root.join("payment.avsc"), &texts), "format = \"avro\"\n")
                } else {
                    // Protobuf's JSON mapping names the field paidAt.
                    let texts: Vec<String> = texts.iter().map(|t| t.replace("\"paid_at\"", "\"paidAt\"")).collect();
                    (registry.serialize_protobuf("payments", &root.join("payment.proto"), "Payment", &texts), "format = \"protobuf\"\n")
                };
                for ((i, _), bytes) in docs.iter().zip(encoded) {
                    s.records[*i].value = Some(bytes);
                }
                let section = format!("[schema_registry]\nurl = \"{}\"\n", registry.url());
                (Some((registry, section)), line)
            }
        };
        Pair { src, dst, s, broker, db, registry, format, provider: None }
    }

    /// Whether a batch committed in the store whose offset commit or acknowledgement a crash prevented comes back
    /// to the next worker: yes where the broker keeps the positions (Kafka's group offsets beside a database,
    /// RabbitMQ's and JetStream's acknowledgements); no where the positions are stored with each batch (the RocketMQ pairs use
    /// `[offsets] store = "database"`; a Redis sink keeps a Kafka consumer's positions in Redis).
    fn replays_a_committed_batch(&self) -> bool {
        match (self.broker, self.db) {
            (Broker::RabbitMq | Broker::Nats, _) => true,
            (Broker::Kafka, Db::Postgres | Db::MariaDb) => true,
            (Broker::Kafka, Db::Redis) | (Broker::RocketMq, _) => false,
        }
    }

    /// Settings and the pipeline for one worker (each worker gets its own `/metrics` port), through `relay` when
    /// given.
    fn setup(&self, relay: Option<&Relay>) -> Setup {
        let http = self.provider.as_ref().map(|p| http_effect(&p.url())).unwrap_or_default();
        let pipeline = format!("{}{}{http}", self.format, self.dst.pipeline(&self.src.source()));
        let extra = self.registry.as_ref().map_or("", |(_, section)| section.as_str());
        Setup::sections(&self.dst.section(relay), &self.src.section(), &[("payments.toml", &pipeline)], extra)
    }

    /// Waits (at most 240 s) until every operation has its dedup row and every poison payload its dead letter,
    /// and `received` says the worker has seen at least `at_least` records; the workers' logs if not.
    async fn wait_done(&self, workers: &[&BinWorker], at_least: f64) {
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            let progress = self.dst.progress().await;
            let received: f64 = workers.iter().map(|w| received(&w.scrape())).sum();
            // With the outbox, also until the provider has charged every operation (the relay runs in the workers).
            let charged = self.provider.as_ref().is_none_or(|p| p.state()["distinct_keys"].as_u64().unwrap_or(0) >= self.s.distinct as u64);
            if progress == Some((self.s.distinct as i64, self.s.poison as i64)) && received >= at_least && charged {
                return;
            }
            if Instant::now() > deadline {
                let tails: Vec<String> = workers.iter().map(|w| w.log_text().lines().rev().take(40).collect::<Vec<_>>().join("\n")).collect();
                panic!(
                    "timed out: (dedup rows, dead-lettered payloads) = {progress:?} of ({}, {}), received {received} of at least \
                     {at_least}\n{}",
                    self.s.distinct,
                    self.s.poison,
                    tails.join("\n=====\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn len(&self) -> usize {
        self.s.records.len()
    }
}

const P: [(&str, &str); 1] = [("pipeline", "payments")];

/// Waits (at most 60 s) until `w` serves `/metrics` with its pipeline up: a worker asked to stop before it has
/// started would not stop cleanly.
async fn wait_up(w: &BinWorker) {
    let start = Instant::now();
    while metric(&w.scrape(), "idemflow_pipeline_up", &P) != 1.0 {
        assert!(start.elapsed() < Duration::from_secs(60), "the worker did not start in 60 s:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGTERM, and a clean exit, but for one thing outside the guarantee: the RocketMQ client's consumer sometimes
/// does not stop its pull tasks ("lite pull task shutdown report is unhealthy") after other members of its group
/// were SIGKILLed, and the worker exits 1 once `shutdown.timeout` has passed; everything it applied is committed
/// and nothing is lost. Counted and printed, never hidden.
fn stop(mut w: BinWorker, broker: Broker) {
    let status = w.sigterm();
    let log = w.log_text();
    if !status.success() {
        assert!(
            broker == Broker::RocketMq && log.contains("shutdown took longer than shutdown.timeout"),
            "the worker did not stop cleanly ({status}):\n{log}"
        );
        println!("the RocketMQ client did not stop in shutdown.timeout; the worker exited {status}");
    }
}

/// The worker's `/metrics`, scraped again (for at most 10 s) when a scrape comes back empty (a busy machine): for
/// the assertions at the end of a scenario, which must not read an empty scrape as zero counts.
async fn scrape_whole(w: &BinWorker) -> String {
    let start = Instant::now();
    loop {
        let m = w.scrape();
        if m.contains("idemflow_records_received_total") {
            return m;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "/metrics answered nothing for 10 s:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn received(m: &str) -> f64 {
    metric(m, "idemflow_records_received_total", &P)
}

fn duplicates(m: &str, reason: &str) -> f64 {
    metric(m, "idemflow_duplicates_skipped_total", &[("pipeline", "payments"), ("reason", reason)])
}

/// (a) and (d): the whole stream through one worker: every duplicate counted under its reason, exactly; every
/// poison record dead-lettered with its reason while the rest commits. Then, where the source has positions, the
/// group rewound with `idemflow rewind` and the stream consumed again by a new worker: every original counted
/// `redelivered`, every copy under its reason again, nothing applied twice.
async fn core(broker: Broker, db: Db, effect: Effect) {
    let pair = Pair::new(broker, db, effect).await;
    core_of(pair).await
}

/// [`core`] with the payloads in `format`: Kafka's pairs (the other brokers' messages are published as text, with
/// the JSON order id as their message id).
pub(crate) async fn core_in(format: PayloadFormat, broker: Broker, db: Db) {
    assert!(format == PayloadFormat::Json || broker == Broker::Kafka, "encoded payloads are published to Kafka only");
    core_of(Pair::new_in(format, broker, db).await).await
}

async fn core_of(mut pair: Pair) {
    let n = pair.len();
    pair.src.publish(&pair.s, 0..n).await;
    let setup = pair.setup(None);
    let mut w = BinWorker::start(&setup);
    pair.wait_done(&[&w], n as f64).await;
    let m = scrape_whole(&w).await;
    assert_counters_add_up(&m);
    assert_eq!(received(&m), n as f64, "each record delivered once to a lone worker");
    assert_eq!(metric(&m, "idemflow_records_applied_total", &P), pair.s.distinct as f64);
    assert_eq!(duplicates(&m, "republished"), pair.s.republished as f64, "republished copies");
    assert_eq!(duplicates(&m, "payload_mismatch"), pair.s.mismatched as f64, "copies with another payload");
    assert_eq!(duplicates(&m, "redelivered"), 0.0);
    assert_eq!(
        metric(&m, "idemflow_dead_letters_total", &[("pipeline", "payments"), ("reason", "decode_failed")]),
        pair.s.poison as f64,
        "poison records dead-lettered with their reason"
    );
    assert!(w.sigterm().success(), "{}", w.log_text());
    pair.assert_exactly_once().await;
    if !pair.src.positional() {
        return;
    }
    let config = setup.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["rewind", "--config", &config, "--pipeline", "payments", "--to", "earliest"], setup.dir.path());
    assert!(status.success(), "rewind: {out}{err}");
    println!("{out}");
    let mut w = BinWorker::start(&setup);
    pair.wait_done(&[&w], n as f64).await;
    let m = scrape_whole(&w).await;
    assert_counters_add_up(&m);
    assert_eq!(received(&m), n as f64, "the whole stream replayed");
    assert_eq!(metric(&m, "idemflow_records_applied_total", &P), 0.0, "nothing applied twice");
    if pair.dst.keeps_processed_marks() {
        // Every record comes again at its own position: all of them are redeliveries, copies included.
        assert_eq!(duplicates(&m, "redelivered"), n as f64, "every record redelivered at its position");
        assert_eq!(duplicates(&m, "republished") + duplicates(&m, "payload_mismatch"), 0.0);
    } else {
        // Redis keeps no processed marks: a copy is told by its dedup key's position, the original's.
        assert_eq!(duplicates(&m, "redelivered"), (pair.s.distinct + pair.s.poison) as f64, "every original redelivered at its position");
        assert_eq!(duplicates(&m, "republished"), pair.s.republished as f64);
        assert_eq!(duplicates(&m, "payload_mismatch"), pair.s.mismatched as f64);
    }
    assert!(w.sigterm().success(), "{}", w.log_text());
    pair.assert_exactly_once().await;
}

/// (b): crashes at both kinds of moment while the stream flows, a third of the stream published before each worker.
/// The first worker aborts itself right after its first batch's `COMMIT`, before that batch's offset commit or
/// acknowledgement ([`idemflow::worker::CRASH_AFTER_COMMITS_VAR`]): where the broker keeps the positions the next
/// worker gets that batch again and skips it as `redelivered`; where the positions are stored with each batch
/// nothing comes back. The next two are SIGKILLed at random moments while they apply; a last worker finishes:
/// every operation applied once.
async fn crash_loop(broker: Broker, db: Db, effect: Effect) {
    let mut pair = Pair::new(broker, db, effect).await;
    let n = pair.len();
    let setup = pair.setup(None);
    pair.src.publish(&pair.s, 0..n / 3).await;
    let mut crashed = BinWorker::start_with_env(&setup, &[(idemflow::worker::CRASH_AFTER_COMMITS_VAR, "1")]);
    let status = crashed.wait_exit(Duration::from_secs(120));
    let log = crashed.log_text();
    assert!(!status.success() && log.contains("injected crash"), "the worker aborts after its first COMMIT ({status}):\n{log}");
    let (committed, _) = pair.dst.progress().await.expect("the store answers");
    assert!(committed > 0, "the batch before the crash committed its dedup rows");
    let mut rng = Rng::from_clock();
    let mut redelivered = 0.0;
    for third in 1..3 {
        pair.src.publish(&pair.s, n * third / 3..n * (third + 1) / 3).await;
        let mut w = BinWorker::start(&setup);
        let start = Instant::now();
        while received(&w.scrape()) == 0.0 {
            assert!(start.elapsed() < Duration::from_secs(120), "no progress in 120 s:\n{}", w.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if third == 1 && pair.replays_a_committed_batch() {
            while duplicates(&w.scrape(), "redelivered") == 0.0 {
                assert!(
                    start.elapsed() < Duration::from_secs(120),
                    "the batch committed before the crash did not come back as redelivered in 120 s:\n{}",
                    w.log_text()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        redelivered += duplicates(&scrape_whole(&w).await, "redelivered");
        w.kill();
    }
    let w = BinWorker::start(&setup);
    wait_up(&w).await;
    pair.wait_done(&[&w], 0.0).await;
    let m = scrape_whole(&w).await;
    assert_counters_add_up(&m);
    redelivered += duplicates(&m, "redelivered");
    if !pair.replays_a_committed_batch() {
        assert_eq!(redelivered, 0.0, "positions stored with each batch: no crash replays a committed record");
    }
    println!("crash loop {broker:?} x {db:?}: {committed} keys committed before the abort, {redelivered} counted redelivered after it and 2 SIGKILLs");
    stop(w, broker);
    pair.assert_exactly_once().await;
}

/// (c): the store unreachable for 8 s mid-stream (every connection to it cut, new ones refused): the worker waits
/// and retries (counted in `idemflow_db_retries_total`); nothing is dead-lettered for it, nothing lost, nothing
/// applied twice.
async fn store_cut(broker: Broker, db: Db, effect: Effect) {
    let mut pair = Pair::new(broker, db, effect).await;
    let n = pair.len();
    let relay = Relay::start(pair.dst.addr());
    pair.src.publish(&pair.s, 0..n / 2).await;
    let setup = pair.setup(Some(&relay));
    let mut w = BinWorker::start(&setup);
    let start = Instant::now();
    while metric(&w.scrape(), "idemflow_records_applied_total", &P) == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(120), "nothing applied in 120 s:\n{}", w.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.cut();
    pair.src.publish(&pair.s, n / 2..n).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    relay.heal();
    pair.wait_done(&[&w], 0.0).await;
    let m = scrape_whole(&w).await;
    assert_counters_add_up(&m);
    let retries: f64 = m.lines().filter(|l| l.starts_with("idemflow_db_retries_total{")).filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok()).sum();
    assert!(retries > 0.0, "the batches that met the cut store were retried:\n{m}");
    if broker == Broker::Nats {
        // The outage (8 s) outlasts ack_wait (4 s): the in-progress acks kept every held delivery from coming back.
        assert_eq!(duplicates(&m, "redelivered"), 0.0, "in-progress acks held the deliveries through the outage");
        assert_eq!(received(&m), n as f64, "each message delivered once");
    }
    assert!(w.sigterm().success(), "{}", w.log_text());
    pair.assert_exactly_once().await;
}

/// (e): a second worker joins the first mid-stream (the group, or the queue's consumers, rebalance) and receives
/// records of its own, then the first leaves (SIGTERM): every operation applied once.
async fn second_worker(broker: Broker, db: Db, effect: Effect) {
    let mut pair = Pair::new(broker, db, effect).await;
    let n = pair.len();
    pair.src.publish(&pair.s, 0..n / 2).await;
    let (one, two) = (pair.setup(None), pair.setup(None));
    let mut a = BinWorker::start(&one);
    let start = Instant::now();
    while received(&a.scrape()) == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(120), "no progress in 120 s:\n{}", a.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = BinWorker::start(&two);
    wait_up(&b).await;
    // Publish once the newcomer has partitions (queues) from its group, or consumes its queue or pull consumer
    // (`idemflow_assigned_partitions` counts those too): published before, they could all be taken by the first
    // worker meanwhile.
    let start = Instant::now();
    while metric(&b.scrape(), "idemflow_assigned_partitions", &P) == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(120), "the second worker was assigned nothing in 120 s:\n{}", b.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pair.src.publish(&pair.s, n / 2..n).await;
    // Both work: the group gives the newcomer partitions (queues), or the queue its share of the messages.
    let start = Instant::now();
    while received(&b.scrape()) == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(120), "the second worker received nothing in 120 s:\n{}", b.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(a.sigterm().success(), "{}", a.log_text());
    pair.wait_done(&[&b], 0.0).await;
    assert_counters_add_up(&scrape_whole(&b).await);
    stop(b, broker);
    // Two consumers of one queue take its messages in any order: a copy with another amount may come first.
    pair.dst.assert_once(&pair.s, if pair.src.positional() { Order::Kept } else { Order::Lost }, pair.src.positional()).await;
    pair.assert_charged_once();
}

macro_rules! matrix {
    ($($name:ident: $scenario:ident($broker:ident, $db:ident);)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $scenario(Broker::$broker, Db::$db, Effect::Sink).await;
            }
        )*
    };
}

/// The matrix's scenarios with the outbox beside the shipped example's effect (`[[sink.http]]` to the suite's payment
/// provider), on the stores that keep an outbox: every operation also charged exactly once, through a rewind (a),
/// a crash after `COMMIT` and SIGKILLs (b), the store cut (c), a second worker (e).
macro_rules! matrix_outbox {
    ($($name:ident: $scenario:ident($broker:ident, $db:ident);)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $scenario(Broker::$broker, Db::$db, Effect::Outbox).await;
            }
        )*
    };
}

matrix_outbox! {
    outbox_core_kafka_postgres: core(Kafka, Postgres);
    outbox_core_kafka_mariadb: core(Kafka, MariaDb);
    outbox_crash_loop_kafka_postgres: crash_loop(Kafka, Postgres);
    outbox_crash_loop_kafka_mariadb: crash_loop(Kafka, MariaDb);
    outbox_store_cut_kafka_postgres: store_cut(Kafka, Postgres);
    outbox_store_cut_kafka_mariadb: store_cut(Kafka, MariaDb);
    outbox_second_worker_kafka_postgres: second_worker(Kafka, Postgres);
    outbox_second_worker_kafka_mariadb: second_worker(Kafka, MariaDb);
    outbox_crash_loop_rabbitmq_postgres: crash_loop(RabbitMq, Postgres);
}

matrix! {
    core_kafka_postgres: core(Kafka, Postgres);
    core_kafka_mariadb: core(Kafka, MariaDb);
    core_kafka_redis: core(Kafka, Redis);
    core_rabbitmq_postgres: core(RabbitMq, Postgres);
    core_rabbitmq_mariadb: core(RabbitMq, MariaDb);
    core_rabbitmq_redis: core(RabbitMq, Redis);
    core_rocketmq_postgres: core(RocketMq, Postgres);
    core_rocketmq_mariadb: core(RocketMq, MariaDb);
    core_rocketmq_redis: core(RocketMq, Redis);
    crash_loop_kafka_postgres: crash_loop(Kafka, Postgres);
    crash_loop_kafka_mariadb: crash_loop(Kafka, MariaDb);
    crash_loop_kafka_redis: crash_loop(Kafka, Redis);
    crash_loop_rabbitmq_postgres: crash_loop(RabbitMq, Postgres);
    crash_loop_rabbitmq_mariadb: crash_loop(RabbitMq, MariaDb);
    crash_loop_rabbitmq_redis: crash_loop(RabbitMq, Redis);
    crash_loop_rocketmq_postgres: crash_loop(RocketMq, Postgres);
    crash_loop_rocketmq_mariadb: crash_loop(RocketMq, MariaDb);
    crash_loop_rocketmq_redis: crash_loop(RocketMq, Redis);
    store_cut_kafka_postgres: store_cut(Kafka, Postgres);
    store_cut_kafka_mariadb: store_cut(Kafka, MariaDb);
    store_cut_kafka_redis: store_cut(Kafka, Redis);
    store_cut_rabbitmq_postgres: store_cut(RabbitMq, Postgres);
    store_cut_rabbitmq_mariadb: store_cut(RabbitMq, MariaDb);
    store_cut_rabbitmq_redis: store_cut(RabbitMq, Redis);
    store_cut_rocketmq_postgres: store_cut(RocketMq, Postgres);
    store_cut_rocketmq_mariadb: store_cut(RocketMq, MariaDb);
    store_cut_rocketmq_redis: store_cut(RocketMq, Redis);
    second_worker_kafka_postgres: second_worker(Kafka, Postgres);
    second_worker_kafka_mariadb: second_worker(Kafka, MariaDb);
    second_worker_kafka_redis: second_worker(Kafka, Redis);
    second_worker_rabbitmq_postgres: second_worker(RabbitMq, Postgres);
    second_worker_rabbitmq_mariadb: second_worker(RabbitMq, MariaDb);
    second_worker_rabbitmq_redis: second_worker(RabbitMq, Redis);
    second_worker_rocketmq_postgres: second_worker(RocketMq, Postgres);
    second_worker_rocketmq_mariadb: second_worker(RocketMq, MariaDb);
    second_worker_rocketmq_redis: second_worker(RocketMq, Redis);
    core_nats_postgres: core(Nats, Postgres);
    core_nats_mariadb: core(Nats, MariaDb);
    core_nats_redis: core(Nats, Redis);
    crash_loop_nats_postgres: crash_loop(Nats, Postgres);
    crash_loop_nats_mariadb: crash_loop(Nats, MariaDb);
    crash_loop_nats_redis: crash_loop(Nats, Redis);
    store_cut_nats_postgres: store_cut(Nats, Postgres);
    store_cut_nats_mariadb: store_cut(Nats, MariaDb);
    store_cut_nats_redis: store_cut(Nats, Redis);
    second_worker_nats_postgres: second_worker(Nats, Postgres);
    second_worker_nats_mariadb: second_worker(Nats, MariaDb);
    second_worker_nats_redis: second_worker(Nats, Redis);
}

/// The table of the matrix in docs/guarantee.md (scenario x pair -> test), between `<!-- matrix -->` and
/// `<!-- /matrix -->`, made from the `matrix!` invocation above; `IDEMFLOW_WRITE_DOCS=1` writes it.
#[test]
fn the_guarantee_page_table_is_made_from_the_matrix() {
    let source = std::fs::read_to_string(project_root().join("tests/it/matrix.rs")).unwrap();
    let body = source.split("matrix! {\n").nth(1).unwrap().split("\n}").next().unwrap();
    let tests: Vec<(String, String, String, String)> = body
        .lines()
        .filter_map(|l| {
            let (name, call) = l.trim().trim_end_matches(';').split_once(": ")?;
            let (scenario, args) = call.split_once('(')?;
            let (broker, db) = args.trim_end_matches(')').split_once(", ")?;
            Some((name.to_owned(), scenario.to_owned(), broker.to_owned(), db.to_owned()))
        })
        .collect();
    assert_eq!(tests.len(), 48, "every scenario on every pair");
    let scenarios = [
        ("core", "(a) duplicates counted exactly (republished, payload mismatch, redelivered after a rewind) and (d) poison records dead-lettered with their reason"),
        ("crash_loop", "(b) a crash after COMMIT, then SIGKILLs while the stream flows"),
        ("store_cut", "(c) the store unreachable mid-stream"),
        ("second_worker", "(e) a second worker joins, the first leaves"),
    ];
    let pairs: Vec<(String, String)> = tests.iter().filter(|t| t.1 == "core").map(|t| (t.2.clone(), t.3.clone())).collect();
    fn name(s: &str) -> &str {
        match s {
            "RabbitMq" => "RabbitMQ",
            "RocketMq" => "RocketMQ",
            "Nats" => "NATS JetStream",
            "Postgres" => "PostgreSQL",
            "MariaDb" => "MySQL/MariaDB",
            other => other,
        }
    }
    let mut table = String::from("| scenario |");
    for (b, d) in &pairs {
        table += &format!(" {} x {} |", name(b), name(d));
    }
    table += "\n|---|";
    table += &"---|".repeat(pairs.len());
    for (scenario, what) in scenarios {
        table += &format!("\n| {what} |");
        for (b, d) in &pairs {
            let t = tests.iter().find(|t| t.1 == scenario && &t.2 == b && &t.3 == d).expect("every pair runs every scenario");
            table += &format!(" `matrix::{}` |", t.0);
        }
    }
    table += "\n";
    let page_path = project_root().join("docs/guarantee.md");
    let page = std::fs::read_to_string(&page_path).unwrap();
    let (before, rest) = page.split_once("<!-- matrix -->\n").expect("docs/guarantee.md has <!-- matrix -->");
    let (current, after) = rest.split_once("<!-- /matrix -->").expect("docs/guarantee.md has <!-- /matrix -->");
    if current != table {
        if std::env::var("IDEMFLOW_WRITE_DOCS").as_deref() == Ok("1") {
            std::fs::write(&page_path, format!("{before}<!-- matrix -->\n{table}<!-- /matrix -->{after}")).unwrap();
        } else {
            panic!("the matrix table of docs/guarantee.md is not the matrix's: run IDEMFLOW_WRITE_DOCS=1 scripts/test matrix::the_guarantee_page_table\n{table}");
        }
    }
}
