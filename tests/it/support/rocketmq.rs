//! A real RocketMQ for tests: the Rust name server and broker from crates.io (`rocketmq-namesrv-rust`,
//! `rocketmq-broker-rust`; scripts/rocketmq-throwaway.sh installs them when missing). `ROCKETMQ_NAME_SERVER` when
//! set (scripts/test starts one name server and one broker for the whole suite), otherwise a pair of this test
//! process, started once. Tests that restart the broker start a [`Cluster`] of their own.

use idemflow::source::rocketmq::Runtime;
use rocketmq_client_rust::DefaultMQProducer;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

static SHARED: OnceLock<String> = OnceLock::new();

/// The name server address of the suite's broker.
pub fn shared() -> &'static str {
    SHARED.get_or_init(|| match std::env::var("ROCKETMQ_NAME_SERVER") {
        Ok(ns) if !ns.is_empty() => ns,
        _ => {
            let cluster = Cluster::start();
            let ns = cluster.name_server();
            std::mem::forget(cluster); // lives as long as the test process
            ns
        }
    })
}

/// `[rocketmq]` for `name_server`.
pub fn settings(name_server: &str) -> String {
    format!("[rocketmq]\nname_server = \"{name_server}\"\n")
}

fn binary(name: &str) -> PathBuf {
    idemflow::demo::rocketmq::binary(name).unwrap_or_else(|e| panic!("{e}"))
}

/// A name server and one broker in a temporary directory, on free ports. Killed on drop.
pub struct Cluster {
    dir: tempfile::TempDir,
    ns_port: u16,
    broker_port: u16,
    namesrv: Option<Child>,
    broker: Option<Child>,
}

impl Cluster {
    /// Starts both and waits until the broker serves a topic route (at most 60 s).
    pub fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let ns_port = super::free_port();
        let broker_port = idemflow::demo::rocketmq::free_broker_port().unwrap();
        let mut c = Cluster { dir, ns_port, broker_port, namesrv: None, broker: None };
        c.start_namesrv();
        c.start_broker();
        c
    }

    fn start_namesrv(&mut self) {
        let d = self.dir.path();
        let log = std::fs::File::create(d.join("namesrv.log")).unwrap();
        let child = Command::new(binary("rocketmq-namesrv-rust"))
            .args(["--listenPort", &self.ns_port.to_string(), "--bindAddress", "127.0.0.1", "--rocketmqHome"])
            .arg(d)
            .env("ROCKETMQ_HOME", d)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("starting rocketmq-namesrv-rust");
        self.namesrv = Some(child);
        wait_port(self.ns_port, &d.join("namesrv.log"));
    }

    /// Starts the broker (again: the same store directory) and waits until it listens and has registered.
    pub fn start_broker(&mut self) {
        let d = self.dir.path();
        let props = d.join("broker.properties");
        std::fs::write(&props, idemflow::demo::rocketmq::broker_properties(d, self.broker_port, self.ns_port)).unwrap();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(d.join("broker.log")).unwrap();
        let child = Command::new(binary("rocketmq-broker-rust"))
            .arg("-c")
            .arg(&props)
            .args(["-n", &format!("127.0.0.1:{}", self.ns_port)])
            .env("ROCKETMQ_HOME", d)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("starting rocketmq-broker-rust");
        self.broker = Some(child);
        wait_port(self.broker_port, &d.join("broker.log"));
        std::thread::sleep(Duration::from_secs(2)); // its first registration with the name server
    }

    /// SIGKILLs the broker.
    pub fn kill_broker(&mut self) {
        if let Some(mut b) = self.broker.take() {
            let _ = b.kill();
            let _ = b.wait();
        }
    }

    /// `host:port` of the name server.
    pub fn name_server(&self) -> String {
        format!("127.0.0.1:{}", self.ns_port)
    }

    /// The broker's log, for failure messages.
    pub fn broker_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("broker.log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_broker();
        if let Some(mut n) = self.namesrv.take() {
            let _ = n.kill();
            let _ = n.wait();
        }
    }
}

fn wait_port(port: u16, log: &Path) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "nothing listens on {port} after 60 s; its errors:\n{}",
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("ERROR") || l.contains("WARN") || l.contains("rror:"))
                .take(30)
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A message to send.
#[derive(Clone, Debug)]
pub struct Msg {
    /// The KEYS property.
    pub keys: Option<String>,
    /// The TAGS property.
    pub tags: Option<String>,
    /// User properties.
    pub properties: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Msg {
    /// A message with this key, tag `pay` and a text body.
    pub fn keyed(keys: &str, body: impl Into<String>) -> Msg {
        Msg { keys: Some(keys.to_owned()), tags: Some("pay".to_owned()), properties: Vec::new(), body: body.into().into_bytes() }
    }
}

/// A producer for tests (synchronous sends: each message acknowledged by the broker).
pub struct Producer {
    runtime: Option<Runtime>,
    producer: DefaultMQProducer,
    name_server: String,
    /// Topics whose route the name server was seen to have: not asked again.
    routed: std::collections::HashSet<String>,
}

impl Producer {
    /// Starts a producer on `name_server`.
    pub async fn start(name_server: &str) -> Producer {
        let runtime = Runtime::new("test-producer").unwrap();
        let mut producer = DefaultMQProducer::builder(runtime.client())
            .producer_group(format!("idemflow-test-{}", super::unique()))
            .name_server_addr(name_server.to_owned())
            .build();
        producer.start().await.expect("starting the producer");
        Producer { runtime: Some(runtime), producer, name_server: name_server.to_owned(), routed: Default::default() }
    }

    fn message(topic: &str, m: &Msg) -> Message {
        let mut b = Message::builder().topic(topic).body_slice(&m.body);
        if let Some(k) = &m.keys {
            b = b.keys(vec![k.clone()]);
        }
        if let Some(t) = &m.tags {
            b = b.tags(t.as_str());
        }
        for (k, v) in &m.properties {
            b = b.raw_property(k.as_str(), v.as_str()).unwrap();
        }
        b.build().unwrap()
    }

    /// Sends `messages` to `topic` in order, each to queue `queue_of(i) % queues` (so a test decides which queue
    /// a copy goes to), retrying a send while the topic's route is being created, and returns once the name server
    /// has the topic's route (the broker registers a topic it created a moment after its first message is stored:
    /// a `check` right after the send found no route once). Returns the (queue id, offset) of each.
    pub async fn send(&mut self, topic: &str, messages: &[Msg], queue_of: impl Fn(usize) -> i32) -> Vec<(i32, i64)> {
        let mut out = Vec::with_capacity(messages.len());
        let mut broker: Option<String> = None;
        for (i, m) in messages.iter().enumerate() {
            let start = Instant::now();
            loop {
                let result = match &broker {
                    None => self.producer.send(Self::message(topic, m)).await,
                    Some(b) => self.producer.send_to_queue(Self::message(topic, m), MessageQueue::from_parts(topic, b.as_str(), queue_of(i) % 4)).await,
                };
                match result {
                    Ok(Some(r)) => {
                        let mq = r.message_queue.clone().expect("a send result names its queue");
                        if broker.is_none() {
                            // The first send creates the topic (autoCreateTopicEnable); it goes wherever the
                            // producer chose: send it again to its queue only if it matters (it does not: a
                            // first message is a first occurrence).
                            broker = Some(mq.broker_name().to_string());
                        }
                        out.push((mq.queue_id(), r.queue_offset as i64));
                        break;
                    }
                    Ok(None) => panic!("a synchronous send returned no result"),
                    Err(e) => {
                        assert!(start.elapsed() < Duration::from_secs(30), "send to {topic} failed for 30 s: {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        if self.routed.insert(topic.to_owned()) {
            wait_for_route(&self.name_server, topic).await;
        }
        out
    }

    /// Stops the producer.
    pub async fn stop(mut self) {
        self.producer.shutdown().await;
        if let Some(r) = self.runtime.take() {
            r.shutdown().await;
        }
    }
}

/// Waits until the name server has a route for `topic` (at most 30 s).
async fn wait_for_route(name_server: &str, topic: &str) {
    use rocketmq_client_rust::TopicAdmin;
    let runtime = Runtime::new("test-admin").unwrap();
    let mut admin = idemflow::source::rocketmq::admin(&runtime, &admin_settings(name_server)).await.unwrap();
    let start = Instant::now();
    while !matches!(admin.examine_topic_route_info(topic.into()).await, Ok(Some(_))) {
        assert!(start.elapsed() < Duration::from_secs(30), "the name server has no route for {topic} after 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    admin.shutdown().await;
    runtime.shutdown().await;
}

/// Settings for an admin client of `name_server`, without ACL.
fn admin_settings(name_server: &str) -> idemflow::source::rocketmq::RocketMqSettings {
    idemflow::source::rocketmq::RocketMqSettings { name_server: name_server.to_owned(), access_key: None, secret_key: None, timeout: Duration::from_secs(10) }
}

/// The consumer group's consume offsets of `topic` summed over its queues, and the queues' max offsets summed
/// (`(committed, end)`), read with an admin client.
pub async fn group_progress(name_server: &str, group: &str, topic: &str) -> (i64, i64) {
    use rocketmq_client_rust::ConsumerAdmin;
    let runtime = Runtime::new("test-admin").unwrap();
    let mut admin = idemflow::source::rocketmq::admin(&runtime, &admin_settings(name_server)).await.unwrap();
    let stats = admin.examine_consume_stats(group.into(), Some(topic.into()), None, None, None).await;
    admin.shutdown().await;
    runtime.shutdown().await;
    match stats {
        Ok(s) => s.offset_table.values().fold((0, 0), |(c, e), o| (c + o.get_consumer_offset().max(0), e + o.get_broker_offset())),
        Err(_) => (0, -1),
    }
}
