//! Kafka's `[kafka]` settings and the `[source]` of a Kafka pipeline.

use crate::source::contract::{BrokerSpec, Capabilities, Conflict, Context, ParseContext, RawKeys};
use crate::validate::Problems;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// `[kafka]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSettings {
    /// `host:port[,host:port...]`. Required when a pipeline has a Kafka source.
    #[serde(default)]
    pub bootstrap_servers: String,
    /// librdkafka properties passed through as they are (see librdkafka's CONFIGURATION.md), for example
    /// `"session.timeout.ms" = "6000"` or `"security.protocol" = "ssl"`. Values may be strings, numbers or
    /// booleans. The worker owns `group.id`, `enable.auto.commit` and `enable.auto.offset.store`.
    #[serde(default)]
    pub properties: BTreeMap<String, PropertyValue>,
    /// How long a pipeline's consumer may stay without any assigned partition before the worker warns (and warns
    /// again after each further period): a broker that never answers the JoinGroup, or a group stuck behind a
    /// member that does not finish its rebalance, otherwise looks like an idle worker. `idemflow_assigned_partitions`
    /// shows the same at any time. Default 2 minutes.
    #[serde(default = "default_no_partitions_warning", with = "humantime_serde")]
    pub no_partitions_warning: Duration,
}

impl Default for KafkaSettings {
    fn default() -> Self {
        KafkaSettings {
            bootstrap_servers: String::new(),
            properties: BTreeMap::new(),
            no_partitions_warning: default_no_partitions_warning(),
        }
    }
}

fn default_no_partitions_warning() -> Duration {
    Duration::from_secs(120)
}

/// A librdkafka property value as written in TOML.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PropertyValue {
    /// `"6000"`.
    Text(String),
    /// `6000`.
    Integer(i64),
    /// `true`.
    Bool(bool),
    /// `0.5`.
    Float(f64),
}

impl fmt::Display for PropertyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PropertyValue::Text(s) => f.write_str(s),
            PropertyValue::Integer(i) => write!(f, "{i}"),
            PropertyValue::Bool(b) => write!(f, "{b}"),
            PropertyValue::Float(x) => write!(f, "{x}"),
        }
    }
}

/// A Kafka source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaSpec {
    /// Topics to consume.
    pub topics: Vec<String>,
    /// Kafka consumer group (default `idemflow-<name>`).
    pub group_id: String,
}

impl BrokerSpec for KafkaSpec {
    type Raw = KafkaRaw;

    fn parse(raw: &KafkaRaw, cx: &ParseContext<'_>, e: &mut impl Problems) -> Option<Self> {
        parse(raw, cx, e)
    }

    const CAPABILITIES: Capabilities = Capabilities {
        kind: "kafka",
        fields: &["topics", "group_id"],
        positions: Ok(()),
        lanes: Ok(()),
        dead_letter_topic: Ok(()),
        dead_letter_exchange: Err("is a RabbitMQ exchange; a Kafka pipeline can also produce its dead letters to dead_letters.topic"),
        key_properties: Err("a Kafka record has no message properties: use field, fields, record_key = true or header"),
        key_message_key: Ok(()),
        key_record_key: Ok(()),
        bind_property: Err("a Kafka record has no message properties"),
        bind_record_key: Ok(()),
        bind_partition: Ok(()),
    };
    type Settings = KafkaSettings;
    const NAME: &'static str = "Kafka";
    const FEATURE: &'static str = "kafka";
    const BUILT: bool = cfg!(feature = "kafka");

    fn settings_missing(settings: Option<&KafkaSettings>) -> Option<&'static str> {
        settings.is_none_or(|k| k.bootstrap_servers.trim().is_empty()).then_some(
            "a Kafka source needs [kafka] bootstrap_servers in the settings (or IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS)",
        )
    }

    fn streams(&self) -> &[String] {
        &self.topics
    }

    fn reads(&self, _cx: &Context<Self>) -> Vec<(&'static str, serde_json::Value)> {
        vec![("topics", serde_json::json!(self.topics)), ("group_id", serde_json::json!(self.group_id))]
    }

    fn conflict_with(&self, earlier: &Self) -> Option<Conflict> {
        (earlier.group_id == self.group_id).then(|| Conflict { field: "group_id", what: format!("{:?} is also used by", self.group_id), why: "" })
    }
}

/// A Kafka pipeline's `[source]` keys as written.
#[derive(Debug, Default)]
pub struct KafkaRaw {
    /// `topics`.
    pub topics: Option<Vec<String>>,
    /// `group_id`.
    pub group_id: Option<String>,
}

impl RawKeys for KafkaRaw {
    fn take<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        match key {
            "topics" => self.topics = Some(map.next_value()?),
            "group_id" => self.group_id = Some(map.next_value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The `[source]` of a Kafka pipeline named `name`: its topics and consumer group, from `[source]` (`s`) or from the
/// top-level `topics` and `group_id` of earlier versions (`legacy_topics`, `legacy_group`). Every problem goes to
/// `e`; `None` when the spec cannot be built.
fn parse(s: &KafkaRaw, cx: &ParseContext<'_>, e: &mut impl Problems) -> Option<KafkaSpec> {
    let (legacy_topics, legacy_group, name) = (cx.legacy_topics, cx.legacy_group, cx.name);
    if (legacy_topics.is_some() || legacy_group.is_some()) && (s.topics.is_some() || s.group_id.is_some()) {
        e.push("topics", "set the source in [source] or with the top-level topics and group_id, not both");
        return None;
    }
    let (topics, field) = match s.topics.clone() {
        Some(t) => (t, "source.topics"),
        None => (legacy_topics.cloned().unwrap_or_default(), "topics"),
    };
    if topics.is_empty() {
        e.push(field, "at least one topic is required");
    }
    for (i, t) in topics.iter().enumerate() {
        if t.is_empty() || t.len() > 249 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
            e.push(&format!("{field}[{i}]"), format!("{t:?} is not a valid Kafka topic name"));
        }
    }
    let (group_id, field) = match s.group_id.clone() {
        Some(g) => (g, "source.group_id"),
        None => (legacy_group.cloned().unwrap_or_else(|| format!("idemflow-{name}")), "group_id"),
    };
    if group_id.is_empty() {
        e.push(field, "must not be empty");
    }
    Some(KafkaSpec { topics, group_id })
}
