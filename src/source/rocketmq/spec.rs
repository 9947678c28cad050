//! RocketMQ's `[rocketmq]` settings and the `[source]` of a RocketMQ pipeline.

use crate::offsets::OffsetStore;
use crate::source::contract::{BrokerSpec, Capabilities, Conflict, Context, ParseContext, RawKeys, LANES};
use crate::validate::Problems;
use crate::secret::Secret;
use serde::Deserialize;
use std::time::Duration;

/// `[rocketmq]`: the name servers of the pipelines with `[source] kind = "rocketmq"`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RocketMqSettings {
    /// Name server addresses, `host:port`, several separated by `;` (RocketMQ's `namesrvAddr` form). The brokers
    /// are found through the topic's route.
    pub name_server: String,
    /// ACL 1.0 credentials, for brokers with `aclEnable=true`: the access key (with `secret_key`). Every request
    /// is signed with them (HMAC-SHA1, as the Java client's `AclClientRPCHook` does).
    #[serde(default)]
    pub access_key: Option<String>,
    /// The secret key of `access_key`. Never printed.
    #[serde(default)]
    pub secret_key: Option<Secret>,
    /// How long `idemflow check` waits for the name server and the brokers (default 10 s).
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

/// A RocketMQ source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RocketMqSpec {
    /// The topic to consume.
    pub topic: String,
    /// The consumer group (default `idemflow-<name>`); its queues are shared among its workers (clustering).
    pub consumer_group: String,
    /// Which tags to consume: `*` (all, the default) or `TagA || TagB` (RocketMQ's tag subscription expression,
    /// filtered by the broker).
    pub tag_expression: String,
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}

/// What the RocketMQ connector is given of its pipeline: its context, with its own `[source]`.
pub type RocketMqContext = Context<RocketMqSpec>;

impl BrokerSpec for RocketMqSpec {
    type Raw = RocketMqRaw;

    fn parse(raw: &RocketMqRaw, cx: &ParseContext<'_>, e: &mut impl Problems) -> Option<Self> {
        parse(raw, cx.name, e)
    }

    const CAPABILITIES: Capabilities = Capabilities {
        kind: "rocketmq",
        fields: &["topic", "consumer_group", "tag_expression"],
        positions: Ok(()),
        lanes: Err(LANES),
        dead_letter_topic: Err("is a Kafka topic; a RocketMQ pipeline keeps its dead letters in the store"),
        dead_letter_exchange: Err("is a RabbitMQ exchange; a RocketMQ pipeline keeps its dead letters in the store"),
        key_properties: Ok(()),
        key_message_key: Ok(()),
        key_record_key: Err(
            "a RocketMQ message has no record key: use message_key = true (its KEYS), message_id = true, property, header or field",
        ),
        bind_property: Ok(()),
        bind_record_key: Err("a RocketMQ message has no record key: its KEYS are { property = \"keys\" }"),
        bind_partition: Ok(()),
    };
    type Settings = RocketMqSettings;
    const NAME: &'static str = "RocketMQ";
    const FEATURE: &'static str = "rocketmq";
    const BUILT: bool = cfg!(feature = "rocketmq");

    fn settings_missing(settings: Option<&RocketMqSettings>) -> Option<&'static str> {
        settings.is_none().then_some("a RocketMQ source needs [rocketmq] name_server in the settings (or IDEMFLOW_ROCKETMQ__NAME_SERVER)")
    }

    fn streams(&self) -> &[String] {
        std::slice::from_ref(&self.topic)
    }

    fn reads(&self, cx: &Context<Self>) -> Vec<(&'static str, serde_json::Value)> {
        use serde_json::json;
        vec![
            ("topic", json!(self.topic)),
            ("consumer_group", json!(self.consumer_group)),
            ("offsets", json!(if cx.offsets == OffsetStore::Database { "database" } else { "broker" })),
        ]
    }

    fn conflict_with(&self, earlier: &Self) -> Option<Conflict> {
        (earlier.consumer_group == self.consumer_group).then(|| Conflict {
            field: "source.consumer_group",
            what: format!("{:?} is also used by", self.consumer_group),
            why: "",
        })
    }

    fn retention_note(&self, cx: &Context<Self>) -> Vec<String> {
        vec![format!(
            "pipeline {:?}: topic {:?}: a RocketMQ broker keeps messages for its fileReservedTime (72 h by default); \
             [dedup] retention = {} must outlast it, or a replay of older messages (a rewind) would apply them again",
            cx.name, self.topic, crate::terminal::duration(cx.dedup_retention),
        )]
    }
}

/// A RocketMQ pipeline's `[source]` keys as written.
#[derive(Debug, Default)]
pub struct RocketMqRaw {
    /// `topic`.
    pub topic: Option<String>,
    /// `consumer_group`.
    pub consumer_group: Option<String>,
    /// `tag_expression`.
    pub tag_expression: Option<String>,
}

impl RawKeys for RocketMqRaw {
    fn take<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        match key {
            "topic" => self.topic = Some(map.next_value()?),
            "consumer_group" => self.consumer_group = Some(map.next_value()?),
            "tag_expression" => self.tag_expression = Some(map.next_value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The `[source]` of a RocketMQ pipeline named `name` (`s`). Every problem goes to `e`; `None` when the spec cannot
/// be built.
fn parse(s: &RocketMqRaw, name: &str, e: &mut impl Problems) -> Option<RocketMqSpec> {
    // RocketMQ topic and group names: at most 127 characters of [%|a-zA-Z0-9_-] (the brokers'
    // TopicValidator); '/' never occurs, which positions rely on (see `record::Position`).
    let valid = |n: &str| !n.is_empty() && n.len() <= 127 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"%|_-".contains(&b));
    let Some(topic) = s.topic.clone() else {
        e.push("source.topic", "a RocketMQ source needs its topic");
        return None;
    };
    if !valid(&topic) {
        e.push("source.topic", format!("{topic:?} is not a valid RocketMQ topic name (1 to 127 of a-z, A-Z, 0-9, %, |, _, -)"));
    }
    let consumer_group = s.consumer_group.clone().unwrap_or_else(|| format!("idemflow-{name}"));
    if !valid(&consumer_group) || consumer_group == "DEFAULT_CONSUMER" {
        e.push("source.consumer_group", format!("{consumer_group:?} is not a valid RocketMQ consumer group name"));
    }
    let tag_expression = s.tag_expression.clone().unwrap_or_else(|| "*".to_owned());
    if tag_expression.trim().is_empty() {
        e.push("source.tag_expression", "must not be empty: \"*\" consumes every tag");
    }
    Some(RocketMqSpec { topic, consumer_group, tag_expression: tag_expression.trim().to_owned() })
}

/// The RocketMQ source of a pipeline.
#[cfg(feature = "rocketmq")]
pub fn spec(pipeline: &RocketMqContext) -> &RocketMqSpec {
    &pipeline.source
}
