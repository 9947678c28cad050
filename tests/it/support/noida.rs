//! `noida-db` (PyPI), a second implementation of the Kafka protocol, for what librdkafka's mock cluster does not
//! serve (DescribeGroups). Installed by scripts/preflight.sh into the test virtual environment, which is on PATH.

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `noida-db` Kafka listener on a free port, stopped on drop.
pub struct Noida {
    child: Child,
    bootstrap: String,
    _dir: tempfile::TempDir,
}

impl Noida {
    /// Starts it and waits until it answers metadata requests.
    pub fn start() -> Noida {
        let dir = tempfile::tempdir().unwrap();
        let port = super::free_port();
        // In a process group of its own: `noida-db` on PATH is pip's launcher, which starts the server as its child,
        // and the whole group is ended on drop (killing the launcher alone left the server running).
        use std::os::unix::process::CommandExt;
        let child = Command::new("noida-db")
            .args(["start", "--data-dir"])
            .arg(dir.path())
            .args(["--only", "kafka", "--kafka-port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("noida-db is needed (scripts/preflight.sh installs it from PyPI): {e}"));
        let noida = Noida { child, bootstrap: format!("127.0.0.1:{port}"), _dir: dir };
        let producer = noida.producer();
        let deadline = Instant::now() + Duration::from_secs(30);
        while producer.client().fetch_metadata(None, Duration::from_secs(1)).is_err() {
            assert!(Instant::now() < deadline, "noida-db did not answer within 30 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        noida
    }

    /// `host:port`.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    fn producer(&self) -> BaseProducer {
        ClientConfig::new().set("bootstrap.servers", &self.bootstrap).create().unwrap()
    }

    /// Creates a topic (auto-created topics get one partition).
    pub async fn create_topic(&self, topic: &str, partitions: i32) {
        self.create_topic_with(topic, partitions, &[]).await
    }

    /// Creates a topic with topic configs (`("retention.ms", "86400000")`, ...).
    pub async fn create_topic_with(&self, topic: &str, partitions: i32, configs: &[(&str, &str)]) {
        let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
        for (k, v) in configs {
            new = new.set(k, v);
        }
        let admin: AdminClient<DefaultClientContext> =
            ClientConfig::new().set("bootstrap.servers", &self.bootstrap).create().unwrap();
        let results = admin
            .create_topics(&[new], &AdminOptions::new())
            .await
            .unwrap();
        for r in results {
            r.unwrap();
        }
    }

    /// Produces JSON values to partition 0, each with its own timestamp (milliseconds since the Unix epoch: a
    /// producer's clock, or an event time), and waits for every acknowledgement.
    pub fn produce_at(&self, topic: &str, values: &[(String, i64)]) {
        let producer = self.producer();
        for (v, at) in values {
            let record = BaseRecord::<(), str>::to(topic).partition(0).payload(v.as_str()).timestamp(*at);
            producer.send(record).map_err(|(e, _)| e).unwrap();
            producer.poll(Duration::ZERO);
        }
        producer.flush(Duration::from_secs(30)).unwrap();
    }

    /// Produces JSON values round-robin over `partitions` and waits for every acknowledgement.
    pub fn produce(&self, topic: &str, partitions: i32, values: &[String]) {
        let producer = self.producer();
        for (i, v) in values.iter().enumerate() {
            let record = BaseRecord::<(), str>::to(topic).partition(i as i32 % partitions).payload(v.as_str());
            producer.send(record).map_err(|(e, _)| e).unwrap();
            producer.poll(Duration::ZERO);
        }
        producer.flush(Duration::from_secs(30)).unwrap();
    }
}

impl Drop for Noida {
    fn drop(&mut self) {
        // SAFETY: kill has no memory preconditions; the group is the one started above.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
