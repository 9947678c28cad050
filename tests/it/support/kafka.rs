//! librdkafka's mock cluster: real Kafka protocol on localhost ports, so the worker binary in another process can
//! consume from it (idemflow's embedded broker, `idemflow::demo::kafka`).

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::BaseRecord;
use rdkafka::{Offset, TopicPartitionList};
use std::time::Duration;

/// A mock cluster and a producer into it: the demo's embedded broker.
pub struct Kafka {
    inner: idemflow::demo::kafka::EmbeddedKafka,
}

/// One record to produce.
#[derive(Clone, Debug, Default)]
pub struct Out {
    /// Partition.
    pub partition: i32,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Headers.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Value; `None` is a tombstone.
    pub value: Option<Vec<u8>>,
    /// The record's timestamp (CreateTime, milliseconds since the Unix epoch: a producer's clock, or a business
    /// time); `None`: the producer's clock now.
    pub timestamp_ms: Option<i64>,
}

impl Out {
    /// A JSON value on `partition`.
    pub fn json(partition: i32, value: impl Into<String>) -> Out {
        Out { partition, value: Some(value.into().into_bytes()), ..Out::default() }
    }
}

impl Kafka {
    /// A one-broker mock cluster with fast group joins.
    pub fn new() -> Kafka {
        Kafka { inner: idemflow::demo::kafka::EmbeddedKafka::start().expect("a mock cluster") }
    }

    /// `host:port` of the cluster.
    pub fn bootstrap(&self) -> &str {
        self.inner.bootstrap_servers()
    }

    /// Advertises `host:port` (a proxy in front of the broker) in the metadata; see
    /// `idemflow::demo::kafka::EmbeddedKafka::advertise`. Produce before: this client then follows the address too.
    pub fn advertise(&self, host: &str, port: u16) {
        self.inner.advertise(host, port);
    }

    /// The mock cluster, for fault injection (broker ids start at 1).
    pub fn mock(&self) -> rdkafka::mocking::MockCluster<'_, rdkafka::producer::DefaultProducerContext> {
        self.inner.mock()
    }

    /// Creates a topic.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        self.inner.create_topic(topic, partitions).expect("creating a topic");
    }

    /// Produces records in order and waits until all are acknowledged.
    pub fn produce(&self, topic: &str, records: &[Out]) {
        for r in records {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &r.headers {
                headers = headers.insert(Header { key: k, value: Some(v) });
            }
            let mut rec: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic).partition(r.partition).headers(headers);
            if let Some(k) = &r.key {
                rec = rec.key(k);
            }
            if let Some(v) = &r.value {
                rec = rec.payload(v);
            }
            if let Some(at) = r.timestamp_ms {
                rec = rec.timestamp(at);
            }
            self.inner.send(rec).expect("producing");
        }
        self.inner.flush().expect("flushing");
    }

    fn group_consumer(&self, group: &str) -> BaseConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer")
    }

    /// The group's committed offsets of `topic`'s partitions `0..partitions` (-1 where none).
    pub fn committed(&self, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
        let c = self.group_consumer(group);
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let got = c.committed_offsets(tpl, Duration::from_secs(10)).expect("committed offsets");
        (0..partitions)
            .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            })
            .collect()
    }

    /// Sets the group's committed offset (the group must have no active members), as an operator would with
    /// `kafka-consumer-groups --reset-offsets`. The mock cluster only accepts commits from a group member, so this
    /// joins the group, commits, and leaves.
    pub fn set_committed(&self, group: &str, topic: &str, partition: i32, offset: i64) {
        self.set_committed_all(group, topic, &[(partition, offset)]);
    }

    /// [`Kafka::set_committed`] for several partitions at once.
    pub fn set_committed_all(&self, group: &str, topic: &str, offsets: &[(i32, i64)]) {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("session.timeout.ms", "6000")
            .create()
            .expect("a consumer");
        c.subscribe(&[topic]).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while c.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
            assert!(std::time::Instant::now() < deadline, "never got an assignment in group {group}");
            let _ = c.poll(Duration::from_millis(100));
        }
        let mut tpl = TopicPartitionList::new();
        for (partition, offset) in offsets {
            tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)).unwrap();
        }
        c.commit(&tpl, CommitMode::Sync).expect("committing offsets");
        // Dropping the consumer closes it and leaves the group.
    }

    /// The high watermark (next offset) of each partition.
    pub fn end_offsets(&self, topic: &str, partitions: i32) -> Vec<i64> {
        let c = self.group_consumer("watermarks");
        (0..partitions)
            .map(|p| c.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks").1)
            .collect()
    }
}
