//! An embedded Kafka broker: librdkafka's mock cluster (`rdkafka::mocking`), which speaks the real Kafka protocol
//! on loopback ports, so consumers anywhere on this machine can use it. It keeps at most about 5 MiB per
//! partition (older data is dropped), so streams are spread over enough partitions.

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use std::time::Duration;

/// A mock cluster, owned by a producer into it.
pub struct EmbeddedKafka {
    producer: ThreadedProducer<DefaultProducerContext>,
    bootstrap: String,
}

impl EmbeddedKafka {
    /// A one-broker cluster whose consumer groups form without the usual initial rebalance delay.
    pub fn start() -> Result<EmbeddedKafka, KafkaError> {
        let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
            .set("test.mock.num.brokers", "1")
            // A produce request the broker appended but whose answer was lost (the soak takes the broker down and
            // drops its packets) is retried without a second copy: the broker drops it by the producer's sequence.
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .set("message.max.bytes", "10000000")
            .create()?;
        let bootstrap = producer.client().mock_cluster().expect("a mock cluster owned by its producer").bootstrap_servers();
        // SAFETY: the handle belongs to the producer's client, which lives as long as `self`.
        unsafe {
            let raw = rdkafka::bindings::rd_kafka_handle_mock_cluster(producer.client().native_ptr());
            rdkafka::bindings::rd_kafka_mock_group_initial_rebalance_delay_ms(raw, 0);
        }
        Ok(EmbeddedKafka { producer, bootstrap })
    }

    /// Sets how long a new consumer group waits for more members before its first assignment (Kafka's
    /// `group.initial.rebalance.delay.ms`, 3,000 ms by default on a real broker; 0 here since [`EmbeddedKafka::start`]).
    pub fn set_initial_rebalance_delay(&self, delay: Duration) {
        // SAFETY: the handle belongs to the producer's client, which lives as long as `self`.
        unsafe {
            let raw = rdkafka::bindings::rd_kafka_handle_mock_cluster(self.producer.client().native_ptr());
            rdkafka::bindings::rd_kafka_mock_group_initial_rebalance_delay_ms(raw, delay.as_millis().min(i32::MAX as u128) as i32);
        }
    }

    /// `host:port` of the broker.
    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }

    /// Makes the broker advertise `host:port` in its metadata instead of its own listener, so clients go on
    /// through a proxy in front of it (a TLS-terminating one, say); clients that bootstrap from the broker's own
    /// listener then follow the advertised address too.
    pub fn advertise(&self, host: &str, port: u16) {
        let host = std::ffi::CString::new(host).expect("a host name without NUL");
        // SAFETY: the handle belongs to the producer's client, which lives as long as `self`; librdkafka copies
        // the host name.
        unsafe {
            let raw = rdkafka::bindings::rd_kafka_handle_mock_cluster(self.producer.client().native_ptr());
            rdkafka::bindings::rd_kafka_mock_broker_set_host_port(raw, 1, host.as_ptr(), i32::from(port));
        }
    }

    /// The mock cluster, for topics and fault injection (broker ids start at 1).
    pub fn mock(&self) -> MockCluster<'_, DefaultProducerContext> {
        self.producer.client().mock_cluster().expect("a mock cluster owned by its producer")
    }

    /// Creates a topic with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), KafkaError> {
        self.mock().create_topic(topic, partitions, 1)
    }

    /// Queues one record (waiting while the local queue is full); [`EmbeddedKafka::flush`] waits for delivery.
    pub fn send(&self, record: BaseRecord<'_, [u8], [u8]>) -> Result<(), KafkaError> {
        let mut record = record;
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull), back)) => {
                    std::thread::sleep(Duration::from_millis(2));
                    record = back;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// Waits until every queued record is acknowledged.
    pub fn flush(&self) -> Result<(), KafkaError> {
        self.producer.flush(Duration::from_secs(60))
    }
}

/// Makes `command`'s process start with no file descriptor of this one beyond stdin, stdout and stderr. librdkafka
/// opens its sockets without close-on-exec, so a child started while an [`EmbeddedKafka`] runs (a worker, `pg_ctl`
/// and with it the PostgreSQL server) would otherwise hold copies of the broker's listening socket and its
/// connections: a broker taken down then could not listen on its port again while the copies live
/// (`rd_kafka_mock_broker_set_up` fails to bind), and its connections would not close.
pub fn without_inherited_descriptors(command: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: close_range(2) is async-signal-safe; nothing else runs between fork and exec. A kernel without it
    // (before 5.9) leaves the descriptors as they were.
    unsafe {
        command.pre_exec(|| {
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            Ok(())
        })
    }
}
