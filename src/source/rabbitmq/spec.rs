//! RabbitMQ's `[rabbitmq]` settings and the `[source]` of a RabbitMQ pipeline.

use crate::source::contract::{BrokerSpec, Capabilities, Conflict, Context, ParseContext, RawKeys, LANES};
use std::path::Path;
use crate::validate::Problems;
use crate::secret::SecretUrl;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// `[rabbitmq]`: the broker of the pipelines with `[source] kind = "rabbitmq"`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqSettings {
    /// An AMQP 0-9-1 URI (RabbitMQ's URI spec): `amqp://user:password@host:5672/vhost`, or `amqps://...` for TLS
    /// (server certificates checked against the system's roots). The vhost is URL-encoded (`/` is `%2f`; no path
    /// means the default vhost `/`). Query parameters of the spec (`heartbeat`, `connection_timeout`,
    /// `channel_max`, `frame_max`, `auth_mechanism`) are honoured. Never printed: `Debug` and `Display` mask it.
    pub url: SecretUrl,
    /// The AMQP heartbeat interval proposed to the broker, unless the URL sets `heartbeat` (default 30 s; 0 turns
    /// heartbeats off, which the RabbitMQ documentation advises against). A lost connection is noticed within
    /// about two intervals.
    #[serde(default = "default_heartbeat", with = "humantime_serde")]
    pub heartbeat: Duration,
    /// How long one connection attempt may take before it is retried (default 10 s).
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// With `amqps://`: a PEM file of CA certificates to trust for the broker's certificate, for a private CA
    /// (default: the system's roots only).
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// With `amqps://`: a PEM client certificate (chain) for brokers that require one (`ssl_options.verify =
    /// verify_peer` with `fail_if_no_peer_cert`); with `tls_key_file`.
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// The client certificate's private key, PEM (PKCS#8, `-----BEGIN PRIVATE KEY-----`).
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
}

fn default_heartbeat() -> Duration {
    Duration::from_secs(30)
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}

/// A RabbitMQ source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RabbitMqSpec {
    /// Queues to consume (declared by the user; `idemflow check` checks they exist). One channel each.
    pub queues: Vec<String>,
    /// Unacknowledged deliveries the broker may send per queue (`basic.qos` prefetch count). Default: twice
    /// `batch.max_records` (a batch in its transaction and the next one arriving), at most 65535; never below
    /// `batch.max_records`, or a batch could never fill.
    pub prefetch: u16,
    /// What `idemflow check` requires of each queue's type (`x-queue-type`); `None`: any type.
    pub queue_type: Option<QueueType>,
    /// Whether `idemflow check` requires each queue to have single active consumer (`x-single-active-consumer`),
    /// the way to keep a queue's order with several workers.
    pub single_active_consumer: bool,
}

/// `[source] queue_type`: a RabbitMQ queue type (`x-queue-type`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QueueType {
    /// A replicated Raft queue (the type the RabbitMQ documentation recommends for data safety).
    Quorum,
    /// A classic queue.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

impl BrokerSpec for RabbitMqSpec {
    type Raw = RabbitMqRaw;

    fn parse(raw: &RabbitMqRaw, cx: &ParseContext<'_>, e: &mut impl Problems) -> Option<Self> {
        parse(raw, cx.max_records, e)
    }

    const CAPABILITIES: Capabilities = Capabilities {
        kind: "rabbitmq",
        fields: &["queue", "queues", "prefetch", "queue_type", "single_active_consumer"],
        positions: Err(
            "\"database\" is for sources with positions a worker can seek to (Kafka, RocketMQ); a RabbitMQ queue has none \
             (an acknowledged delivery leaves the queue, an unacknowledged one is requeued), so there is nothing to store",
        ),
        lanes: Err(LANES),
        dead_letter_topic: Err("is a Kafka topic; a RabbitMQ pipeline keeps its dead letters in idemflow.dead_letters"),
        dead_letter_exchange: Ok(()),
        key_properties: Ok(()),
        key_message_key: Err("is RocketMQ's KEYS property; for a RabbitMQ message use message_id = true or property"),
        key_record_key: Err("a RabbitMQ message has no record key: use message_id = true, property, header or field"),
        bind_property: Ok(()),
        bind_record_key: Err("a RabbitMQ message has no record key"),
        bind_partition: Err("a RabbitMQ message has no partition or offset (a delivery tag numbers deliveries on one channel only)"),
    };
    type Settings = RabbitMqSettings;
    const NAME: &'static str = "RabbitMQ";
    const FEATURE: &'static str = "rabbitmq";
    const BUILT: bool = cfg!(feature = "rabbitmq");

    fn settings_missing(settings: Option<&RabbitMqSettings>) -> Option<&'static str> {
        settings.is_none().then_some("a RabbitMQ source needs [rabbitmq] url in the settings (or IDEMFLOW_RABBITMQ__URL)")
    }

    fn streams(&self) -> &[String] {
        &self.queues
    }

    fn reads(&self, _cx: &Context<Self>) -> Vec<(&'static str, serde_json::Value)> {
        vec![("queues", serde_json::json!(self.queues)), ("prefetch", serde_json::json!(self.prefetch))]
    }

    fn conflict_with(&self, earlier: &Self) -> Option<Conflict> {
        self.queues.iter().find(|q| earlier.queues.contains(q)).map(|q| Conflict {
            field: "source.queues",
            what: format!("{q:?} is also consumed by"),
            why: ": competing pipelines would each see only part of its messages",
        })
    }

    fn retention_note(&self, cx: &Context<Self>) -> Vec<String> {
        vec![format!(
            "pipeline {:?}: a queue has no retention.ms to compare with; [dedup] retention = {} must outlast the longest \
             time a message can wait in its queues (a message redelivered after its dedup row was purged is applied again)",
            cx.name, crate::terminal::duration(cx.dedup_retention),
        )]
    }

    fn rewind_refusal(&self, cx: &Context<Self>, file: &Path) -> Option<String> {
        Some(format!(
            "{}: pipeline {:?} has a {} source: rewind moves a consumer group back; a queue has no positions to go \
             back to (an acknowledged message has left it). Publish the messages again instead: the dedup store skips \
             those already applied",
            file.display(),
            cx.name,
            Self::CAPABILITIES.kind
        ))
    }
}

/// A RabbitMQ pipeline's `[source]` keys as written.
#[derive(Debug, Default)]
pub struct RabbitMqRaw {
    /// `queue`.
    pub queue: Option<String>,
    /// `queues`.
    pub queues: Option<Vec<String>>,
    /// `prefetch`.
    pub prefetch: Option<u32>,
    /// `queue_type`.
    pub queue_type: Option<QueueType>,
    /// `single_active_consumer`.
    pub single_active_consumer: Option<bool>,
}

impl RawKeys for RabbitMqRaw {
    fn take<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        match key {
            "queue" => self.queue = Some(map.next_value()?),
            "queues" => self.queues = Some(map.next_value()?),
            "prefetch" => self.prefetch = Some(map.next_value()?),
            "queue_type" => self.queue_type = Some(map.next_value()?),
            "single_active_consumer" => self.single_active_consumer = Some(map.next_value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The `[source]` of a RabbitMQ pipeline (`s`), its prefetch defaulting from `max_records`. Every problem goes to
/// `e`; `None` when the spec cannot be built.
fn parse(s: &RabbitMqRaw, max_records: usize, e: &mut impl Problems) -> Option<RabbitMqSpec> {
    let queues = match (&s.queue, &s.queues) {
        (Some(q), None) => vec![q.clone()],
        (None, Some(qs)) if !qs.is_empty() => qs.clone(),
        _ => {
            e.push("source.queue", "set exactly one of queue or queues (a non-empty list)");
            return None;
        }
    };
    for (i, q) in queues.iter().enumerate() {
        // AMQP 0-9-1 queue names are short strings: at most 255 bytes. Names starting with "amq." are
        // reserved for the broker.
        if q.is_empty() || q.len() > 255 {
            e.push(&format!("source.queues[{i}]"), format!("{q:?} is not a RabbitMQ queue name (1 to 255 bytes)"));
        }
    }
    let mut sorted = queues.clone();
    sorted.sort();
    sorted.dedup();
    if sorted.len() != queues.len() {
        e.push("source.queues", "lists a queue twice");
    }
    let default = (max_records.saturating_mul(2)).min(u16::MAX as usize) as u32;
    let prefetch = s.prefetch.unwrap_or(default);
    if prefetch > u32::from(u16::MAX) || prefetch == 0 {
        e.push("source.prefetch", format!("{prefetch} is not between 1 and 65535 (basic.qos prefetch count)"));
    } else if (prefetch as usize) < max_records {
        e.push(
            "source.prefetch",
            format!("{prefetch} is below batch.max_records = {max_records}: the broker would stop sending before a batch fills"),
        );
    }
    Some(RabbitMqSpec {
        queues,
        prefetch: prefetch.clamp(1, u32::from(u16::MAX)) as u16,
        queue_type: s.queue_type,
        single_active_consumer: s.single_active_consumer.unwrap_or(false),
    })
}
