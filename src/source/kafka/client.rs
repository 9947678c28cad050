//! The Kafka consumer's client settings: its librdkafka configuration from `[kafka]` and the pipeline, the
//! properties idemflow sets itself, errors that must not show a secret, and the timings that work against each
//! other.

use super::spec::{KafkaSettings, KafkaSpec};

use crate::source::contract::Context;

/// What the Kafka connector is given of its pipeline: its context, with its own `[source]`.
pub type KafkaContext = Context<KafkaSpec>;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult};
use std::time::Duration;

/// Properties the worker sets itself; a value for them in `[kafka.properties]` is ignored with a warning.
pub(super) const OWNED: [&str; 3] = ["group.id", "enable.auto.commit", "enable.auto.offset.store"];

/// The Kafka source of a pipeline.
pub fn spec(pipeline: &KafkaContext) -> &KafkaSpec {
    &pipeline.source
}

/// How many records the consumer prefetches (librdkafka's `queued.min.messages`): 4 batches, at least 1,000 and
/// at most 100,000. [`super::KafkaSource::poll_while`] keeps at most as many records while a batch is in flight.
pub(super) fn prefetch_records(pipeline: &KafkaContext) -> usize {
    (4 * pipeline.batch.max_records).clamp(1000, 100_000)
}

/// The consumer's librdkafka configuration (see [`KafkaSource::new`]).
pub(crate) fn consumer_config(kafka: &KafkaSettings, pipeline: &KafkaContext) -> ClientConfig {
    let lanes = pipeline.batch.concurrency.max(1);
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka.bootstrap_servers)
        .set("auto.offset.reset", "earliest")
        .set("client.id", format!("idemflow-{}", pipeline.name))
        // Prefetch a few batches, not the whole backlog: librdkafka's defaults (100,000 messages per partition,
        // 64 MiB) make a worker that starts behind a large backlog hold hundreds of MiB of records it will not
        // process for minutes, and spend CPU fetching them.
        .set("queued.min.messages", prefetch_records(pipeline).to_string())
        // 16 MiB for the consumer's queue and 8 MiB per fetch response, divided among a pipeline's lanes
        // (`batch.concurrency`) down to 4 and 2 MiB each (a lane's 4 batches of 2,000 records of 200 bytes take
        // 1.6 MiB), and never below `message.max.bytes`, which librdkafka requires of `fetch.max.bytes`.
        .set("queued.max.messages.kbytes", (16_384 / lanes).max(4096).to_string())
        .set("fetch.max.bytes", (8_388_608 / lanes).max(2_097_152).max(max_message_bytes(kafka)).to_string())
        // When a partition's prefetch reaches those bounds librdkafka postpones its next fetch by this much
        // (default 1 s): with bounds of a few batches that stalled the worker about once a second.
        .set("fetch.queue.backoff.ms", "20");
    for (k, v) in &kafka.properties {
        if OWNED.contains(&k.as_str()) {
            tracing::warn!(pipeline = %pipeline.name, property = %k, "ignoring a Kafka property the worker sets itself");
        } else {
            config.set(k, v.to_string());
        }
    }
    config
        .set("group.id", &spec(pipeline).group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    config
}

/// A producer's configuration with the worker's Kafka settings: `acks=all`, idempotent, `client.id` as given (the
/// dead-letter topic's, the outbox's). Consumer-only properties in `[kafka.properties]` make librdkafka warn, not
/// fail.
pub fn producer_config(kafka: &KafkaSettings, client_id: String) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.bootstrap_servers);
    for (k, v) in &kafka.properties {
        config.set(k, v.to_string());
    }
    config.set("acks", "all").set("enable.idempotence", "true").set("client.id", client_id);
    config
}

/// `message.max.bytes` as set in `[kafka.properties]` (librdkafka's default, 1,000,000, otherwise).
pub(super) fn max_message_bytes(kafka: &KafkaSettings) -> usize {
    kafka.properties.get("message.max.bytes").and_then(|v| v.to_string().parse().ok()).unwrap_or(1_000_000)
}

/// Checks that librdkafka accepts the consumer configuration of `pipeline` (unknown properties, bad values),
/// without connecting. The error never contains a property's value ([`hide_config_value`]).
pub fn check_properties(kafka: &KafkaSettings, pipeline: &KafkaContext) -> KafkaResult<()> {
    consumer_config(kafka, pipeline).create_native_config().map(drop).map_err(hide_config_value)
}

/// A librdkafka configuration error without the property's value, which may be a password (`sasl.password`):
/// the value is removed from librdkafka's description too, and an unknown property gets the closest known name
/// as a hint. Other errors are returned as they are.
pub fn hide_config_value(e: KafkaError) -> KafkaError {
    match e {
        KafkaError::ClientConfig(result, description, key, value) => {
            let mut description = crate::secret::scrub(&description, &value);
            if result == rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN {
                let known = librdkafka_properties();
                if let Some(near) = crate::secret::closest(&key, known.iter().map(String::as_str)) {
                    description.push_str(&format!(" (did you mean \"{near}\"?)"));
                }
            }
            KafkaError::ClientConfig(result, description, key, "(value not shown)".to_owned())
        }
        other => other,
    }
}

/// The names of every librdkafka configuration property, from librdkafka's own table
/// (`rd_kafka_conf_properties_show`, the CONFIGURATION.md table: one `name | C/P | ...` row per property, aliases
/// included), written to a temporary file and read back.
pub(super) fn librdkafka_properties() -> Vec<String> {
    let mut table = Vec::new();
    // SAFETY: `tmpfile` returns an open stream or null; it is written by librdkafka, rewound, read into `table`
    // with a bounded buffer, and closed (which also deletes it).
    unsafe {
        let file = libc::tmpfile();
        if file.is_null() {
            return Vec::new();
        }
        rdkafka::bindings::rd_kafka_conf_properties_show(file);
        libc::rewind(file);
        let mut buf = [0u8; 8192];
        loop {
            let n = libc::fread(buf.as_mut_ptr().cast(), 1, buf.len(), file);
            if n == 0 {
                break;
            }
            table.extend_from_slice(&buf[..n]);
        }
        libc::fclose(file);
    }
    String::from_utf8_lossy(&table)
        .lines()
        .filter_map(|line| line.split('|').next())
        .map(str::trim)
        .filter(|name| !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '_'))
        .map(str::to_owned)
        .collect()
}

/// A Kafka client error for a person: a configuration error as `kafka.properties."KEY": WHAT` (never the value,
/// see [`hide_config_value`]), anything else as the client says it.
pub fn describe_kafka_error(e: &KafkaError) -> String {
    match e {
        KafkaError::ClientConfig(_, description, key, _) => format!("kafka.properties.\"{key}\": {description}"),
        other => other.to_string(),
    }
}

/// Settings of `pipeline` that work against each other, each as one sentence naming the settings (`check` prints
/// them as warnings). Unset librdkafka properties count with librdkafka's defaults (`session.timeout.ms` 45000,
/// `heartbeat.interval.ms` 3000). (`max.poll.interval.ms` below `session.timeout.ms` is refused by librdkafka
/// itself; a slow database cannot exceed the poll interval, see the module documentation.)
pub fn timing_warnings(kafka: &KafkaSettings, pipeline: &KafkaContext, shutdown_timeout: Duration) -> Vec<String> {
    let config = consumer_config(kafka, pipeline);
    let ms = |key: &str, default: u64| config.get(key).and_then(|v| v.parse::<u64>().ok()).unwrap_or(default);
    let (session, heartbeat) = (ms("session.timeout.ms", 45_000), ms("heartbeat.interval.ms", 3_000));
    let name = &pipeline.name;
    let mut out = Vec::new();
    if heartbeat * 3 > session {
        out.push(format!(
            "pipeline {name:?}: heartbeat.interval.ms = {heartbeat} is more than a third of session.timeout.ms = \
             {session}: one late heartbeat can expire the member and force a rebalance (Kafka's guidance: at most a third)"
        ));
    }
    let stop = shutdown_timeout;
    if stop <= LEAVE_TIMEOUT {
        out.push(format!(
            "[shutdown] timeout = {stop:?} leaves no time after the {LEAVE_TIMEOUT:?} the consumer may wait to leave \
             its group: a clean stop can end in exit status 1 (nothing is lost)"
        ));
    }
    out
}

/// How long the Kafka source's `close` waits for the consumer to leave its group.
pub const LEAVE_TIMEOUT: Duration = Duration::from_secs(8);
