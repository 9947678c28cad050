//! `[source]`: which broker a pipeline reads, and what each broker's part of the pipeline file says.

use super::contract::{not_built, BrokerSpec, Capabilities, Conflict, Context, ParseContext, RawKeys};
use super::kafka::KafkaSpec;
use super::nats::NatsSpec;
use super::rabbitmq::RabbitMqSpec;
use super::rocketmq::RocketMqSpec;
use crate::validate::Problems;
use serde::Deserialize;
use std::time::Duration;

/// `[source]`: where a pipeline's records come from. `kind = "kafka"` is the default, and the top-level `topics`
/// and `group_id` of earlier versions still mean a Kafka source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    /// Kafka topics read by a consumer group.
    Kafka(KafkaSpec),
    /// RabbitMQ queues read by one consumer each (AMQP 0-9-1).
    RabbitMq(RabbitMqSpec),
    /// A RocketMQ topic read by a consumer group in clustering mode.
    RocketMq(RocketMqSpec),
    /// A NATS JetStream stream read through a durable pull consumer.
    Nats(NatsSpec),
}

/// What a source is given of its pipeline, with its `[source]` as the hub holds it ([`contract::Context`]).
pub type SourceContext = Context<SourceSpec>;

/// The brokers' settings (`[kafka]`, `[rabbitmq]`, `[rocketmq]`, `[nats]`), and the shutdown deadline their clients
/// must leave their groups within (`[shutdown] timeout`).
#[derive(Clone, Debug, Default)]
pub struct Brokers {
    /// `[kafka]` (defaults when absent: a Kafka pipeline's own checks then say what is missing).
    pub kafka: super::kafka::KafkaSettings,
    /// `[rabbitmq]`, required by RabbitMQ pipelines.
    pub rabbitmq: Option<super::rabbitmq::RabbitMqSettings>,
    /// `[rocketmq]`, required by RocketMQ pipelines.
    pub rocketmq: Option<super::rocketmq::RocketMqSettings>,
    /// `[nats]`, required by NATS JetStream pipelines.
    pub nats: Option<super::nats::NatsSettings>,
    /// `[shutdown] timeout`.
    pub shutdown_timeout: Duration,
}

/// The one list of brokers: each once, as `Variant(its spec type, its field of [`SourceKeys`], its section of
/// [`Brokers`])`, in the order their names are listed in messages. Every per-broker match of this file is made from
/// it: `with_brokers!(m! args)` calls `m! { [args] Kafka(KafkaSpec, kafka, |b| ...), ... }`.
macro_rules! with_brokers {
    ($m:ident ! $($args:tt)*) => {
        $m! { [$($args)*]
            Kafka(KafkaSpec, kafka, |b| Some(&b.kafka)),
            RabbitMq(RabbitMqSpec, rabbitmq, |b| b.rabbitmq.as_ref()),
            RocketMq(RocketMqSpec, rocketmq, |b| b.rocketmq.as_ref()),
            Nats(NatsSpec, nats, |b| b.nats.as_ref()),
        }
    };
}

/// The brokers' specs as a dispatch: `each_spec!(spec, |s| expr)` is `expr` on the broker's own spec `s`
/// ([`BrokerSpec`]); `each_spec!(spec, brokers, |s, settings| expr)` also binds its settings section of
/// [`Brokers`] (an `Option`).
macro_rules! each_spec {
    ($spec:expr, |$s:ident| $e:expr) => {
        with_brokers!(each_spec_arms! $spec, $s, $e)
    };
    ($spec:expr, $brokers:expr, |$s:ident, $set:ident| $e:expr) => {
        with_brokers!(each_spec_settings_arms! $spec, $brokers, $s, $set, $e)
    };
}

macro_rules! each_spec_arms {
    ([$spec:expr, $s:ident, $e:expr] $($v:ident($t:ty, $f:ident, |$b:ident| $set:expr)),* $(,)?) => {
        match $spec {
            $(SourceSpec::$v($s) => $e,)*
        }
    };
}

macro_rules! each_spec_settings_arms {
    ([$spec:expr, $brokers:expr, $s:ident, $setting:ident, $e:expr] $($v:ident($t:ty, $f:ident, |$b:ident| $set:expr)),* $(,)?) => {
        match $spec {
            $(SourceSpec::$v($s) => {
                let $setting = { let $b = $brokers; $set };
                $e
            })*
        }
    };
}

/// `[$(capabilities),*]` of the listed brokers.
macro_rules! all_capabilities {
    ([] $($v:ident($t:ty, $f:ident, |$b:ident| $set:expr)),* $(,)?) => {
        [$(&<$t as BrokerSpec>::CAPABILITIES),*]
    };
}

/// The two specs' conflict when both are of the same broker.
macro_rules! conflict_arms {
    ([$earlier:expr, $this:expr] $($v:ident($t:ty, $f:ident, |$b:ident| $set:expr)),* $(,)?) => {
        match ($earlier, $this) {
            $((SourceSpec::$v(a), SourceSpec::$v(b)) => b.conflict_with(a),)*
            #[allow(unreachable_patterns)]
            _ => None,
        }
    };
}

/// [`SourceKeys`]: `kind`, the keys set, and each broker's own keys ([`BrokerSpec::Raw`]).
macro_rules! source_keys {
    ([] $($v:ident($t:ty, $f:ident, |$b:ident| $set:expr)),* $(,)?) => {
        /// `[source]` as written: its `kind`, and each broker's own keys read by that broker's raw struct
        /// ([`RawKeys`]), key by key from the document, so an error keeps its position. A key no broker takes is
        /// refused as serde refuses an unknown key (`unknown field ..., expected one of ...`, every broker's keys
        /// listed); a key of another broker than `kind`'s is refused by [`parse`], with that broker's name.
        #[derive(Debug, Default)]
        pub struct SourceKeys {
            /// `kind`: `kafka` (the default), or another broker's kind ([`Capabilities::kind`]).
            pub kind: Option<String>,
            /// The keys it sets besides `kind`, in the order written.
            pub keys: Vec<String>,
            $($f: <$t as BrokerSpec>::Raw,)*
        }

        impl SourceKeys {
            /// Reads `key` into the raw struct of the broker that takes it; whether one did.
            fn take<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
                $(if self.$f.take(key, map)? {
                    return Ok(true);
                })*
                Ok(false)
            }

            /// The spec of the broker of kind `kind`, parsed from its keys (`None` for a kind no broker has).
            fn parse_kind(&self, kind: &str, cx: &ParseContext<'_>, e: &mut impl Problems) -> Option<Option<SourceSpec>> {
                $(if kind == <$t as BrokerSpec>::CAPABILITIES.kind {
                    return Some(<$t as BrokerSpec>::parse(&self.$f, cx, e).map(SourceSpec::$v));
                })*
                None
            }
        }
    };
}

with_brokers!(source_keys!);

/// Every broker's capabilities, in the order their names are listed in messages.
pub const ALL: &[&Capabilities] = &with_brokers!(all_capabilities!);

/// The capabilities of the broker named `kind` in `[source] kind`, if there is one.
pub fn by_kind(kind: &str) -> Option<&'static Capabilities> {
    ALL.iter().copied().find(|c| c.kind == kind)
}

impl SourceSpec {
    /// What this source can do ([`Capabilities`]).
    pub fn capabilities(&self) -> &'static Capabilities {
        fn of<S: BrokerSpec>(_: &S) -> &'static Capabilities {
            &S::CAPABILITIES
        }
        each_spec!(self, |s| of(s))
    }

    /// Why its broker's settings are missing, if they are: the sentence `check` and `run` print
    /// ([`BrokerSpec::settings_missing`]).
    pub fn settings_missing(&self, brokers: &Brokers) -> Option<&'static str> {
        fn missing<S: BrokerSpec>(_: &S, settings: Option<&S::Settings>) -> Option<&'static str> {
            S::settings_missing(settings)
        }
        each_spec!(self, brokers, |s, settings| missing(s, settings))
    }

    /// What this source shares with `earlier` (another pipeline's) that two pipelines must not: a consumer group,
    /// or a queue ([`BrokerSpec::conflict_with`]). Sources of two brokers share nothing.
    pub fn conflict_with(&self, earlier: &SourceSpec) -> Option<Conflict> {
        with_brokers!(conflict_arms! earlier, self)
    }

    /// Whether `topic` is one it consumes (a dead-letter topic must not be).
    pub fn consumes(&self, topic: &str) -> bool {
        self.streams().iter().any(|t| t == topic)
    }

    /// Whether its records have stable positions a worker can seek to (Kafka partitions, RocketMQ queues), which
    /// is what `[offsets] store = "database"`, `rewind` and a Redis sink need. A RabbitMQ queue has none.
    pub fn positional(&self) -> bool {
        self.capabilities().positions.is_ok()
    }

    /// The source's kind as written in `[source] kind`.
    pub fn kind(&self) -> &'static str {
        self.capabilities().kind
    }

    /// Its topics or queues, for logs and `check`.
    pub fn streams(&self) -> &[String] {
        each_spec!(self, |s| s.streams())
    }

    /// The settings that say where it reads, for `check` ([`BrokerSpec::reads`]).
    pub fn reads(&self, cx: &SourceContext) -> Vec<(&'static str, serde_json::Value)> {
        each_spec!(self, |s| s.reads(&cx.with(s)))
    }

    /// What `check` says of the dedup retention without asking the broker ([`BrokerSpec::retention_note`]).
    pub fn retention_note(&self, cx: &SourceContext) -> Vec<String> {
        each_spec!(self, |s| s.retention_note(&cx.with(s)))
    }

    /// Why `idemflow rewind` cannot move this source back, if it cannot ([`BrokerSpec::rewind_refusal`]).
    pub fn rewind_refusal(&self, cx: &SourceContext, file: &std::path::Path) -> Option<String> {
        each_spec!(self, |s| s.rewind_refusal(&cx.with(s), file))
    }

    /// Whether this build has the source's connector (its cargo feature).
    ///
    /// Errors: the broker and the feature to build with ([`crate::source::contract::not_built`]).
    pub fn built(&self) -> Result<(), String> {
        fn built<S: BrokerSpec>(_: &S) -> Result<(), String> {
            if S::BUILT { Ok(()) } else { Err(not_built(S::NAME, S::FEATURE)) }
        }
        each_spec!(self, |s| built(s))
    }
}


/// Every `[source]` key: `kind`, then each broker's, in the order of [`ALL`] (the list an unknown key's error gives).
static KEYS: std::sync::LazyLock<Vec<&'static str>> =
    std::sync::LazyLock::new(|| std::iter::once("kind").chain(ALL.iter().flat_map(|c| c.fields.iter().copied())).collect());

impl<'de> Deserialize<'de> for SourceKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = SourceKeys;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a table of source settings")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<SourceKeys, A::Error> {
                let mut raw = SourceKeys::default();
                while let Some(key) = map.next_key_seed(Known)? {
                    if key == "kind" {
                        raw.kind = Some(map.next_value()?);
                        continue;
                    }
                    if !raw.take(&key, &mut map)? {
                        // A key in a broker's `CAPABILITIES.fields` that its raw struct does not read (a defect).
                        return Err(serde::de::Error::custom(format!("no broker reads the [source] key `{key}`")));
                    }
                    raw.keys.push(key);
                }
                Ok(raw)
            }
        }
        deserializer.deserialize_map(Keys)
    }
}

/// A `[source]` key, refused as serde refuses an unknown field when no broker takes it: while the key is read, so
/// the error is placed at the key.
struct Known;

impl<'de> serde::de::DeserializeSeed<'de> for Known {
    type Value = String;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        let key = String::deserialize(deserializer)?;
        if KEYS.contains(&key.as_str()) {
            Ok(key)
        } else {
            Err(serde::de::Error::unknown_field(&key, &KEYS))
        }
    }
}

/// The kind of a pipeline without `[source] kind`, the only one before there were others.
const DEFAULT_KIND: &str = "kafka";

/// A pipeline's source from its `[source]` (`s`, or none) and the top-level `topics` and `group_id` of earlier
/// versions: the keys checked against the kind's ([`Capabilities::fields`]), then the broker's own rules. Every
/// problem goes to `e`; `None` when the spec cannot be built.
pub fn parse(
    s: Option<&SourceKeys>,
    legacy_topics: Option<&Vec<String>>,
    legacy_group: Option<&String>,
    name: &str,
    max_records: usize,
    e: &mut impl Problems,
) -> Option<SourceSpec> {
    let kind = s.and_then(|s| s.kind.as_deref()).unwrap_or(DEFAULT_KIND);
    // The top-level keys of earlier versions belong to the default kind, which reads them ([`ParseContext`]).
    if (legacy_topics.is_some() || legacy_group.is_some()) && kind != DEFAULT_KIND {
        e.push("topics", "set the source in [source] or with the top-level topics and group_id, not both");
        return None;
    }
    // A key of another broker's [source] is refused with that broker's name.
    if let (Some(s), Some(mine)) = (s, by_kind(kind)) {
        for other in ALL.iter().filter(|c| c.kind != kind) {
            for field in other.fields.iter().filter(|f| s.keys.iter().any(|k| k == *f) && !mine.fields.contains(f)) {
                e.push(&format!("source.{field}"), format!("belongs to a {} source, not to kind = {kind:?}", other.kind));
            }
        }
    }
    let cx = ParseContext { name, max_records, legacy_topics, legacy_group };
    let none = SourceKeys::default();
    match s.unwrap_or(&none).parse_kind(kind, &cx, e) {
        Some(spec) => spec,
        None => {
            let kinds: Vec<&str> = ALL.iter().map(|c| c.kind).collect();
            let (last, rest) = kinds.split_last().expect("brokers");
            e.push("source.kind", format!("{kind:?} is not a source kind: {} or {last}", rest.join(", ")));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of the right type for each `[source]` key.
    const SAMPLES: &[(&str, &str)] = &[
        ("topics", "[\"t\"]"),
        ("group_id", "\"g\""),
        ("queue", "\"q\""),
        ("queues", "[\"q\"]"),
        ("prefetch", "10"),
        ("queue_type", "\"quorum\""),
        ("single_active_consumer", "true"),
        ("topic", "\"t\""),
        ("consumer_group", "\"g\""),
        ("tag_expression", "\"*\""),
        ("stream", "\"S\""),
        ("consumer", "\"c\""),
        ("filter_subjects", "[\"a.b\"]"),
        ("ack_wait", "\"30s\""),
        ("max_ack_pending", "10"),
    ];

    #[derive(Debug, Deserialize)]
    struct File {
        source: SourceKeys,
    }

    /// Every key a broker's capabilities list is read by its raw struct (a key listed but not read would be
    /// refused as no broker's), each broker's keys in its own part; a key no broker takes is refused at its place.
    #[test]
    fn each_brokers_keys_are_read_by_its_own_raw_struct() {
        for caps in ALL {
            let mut text = format!("[source]\nkind = {:?}\n", caps.kind);
            for field in caps.fields {
                let value = SAMPLES.iter().find(|(k, _)| k == field).unwrap_or_else(|| panic!("no sample value for {field}")).1;
                text.push_str(&format!("{field} = {value}\n"));
            }
            let raw = toml::from_str::<File>(&text).unwrap_or_else(|e| panic!("{}: {e}", caps.kind)).source;
            assert_eq!(raw.kind.as_deref(), Some(caps.kind));
            assert_eq!(raw.keys, caps.fields, "{}", caps.kind);
        }
        let raw = toml::from_str::<File>("[source]\nkind = \"nats\"\nstream = \"S\"\nack_wait = \"2m\"\n").unwrap().source;
        assert_eq!(raw.nats.ack_wait, Some(std::time::Duration::from_secs(120)));
        let e = toml::from_str::<File>("[source]\nkind = \"nats\"\nstream = \"S\"\nbogus = 1\n").unwrap_err();
        assert!(e.message().starts_with("unknown field `bogus`, expected one of `kind`, `topics`, `group_id`, `queue`"), "{e}");
        assert_eq!(e.span().map(|s| &"[source]\nkind = \"nats\"\nstream = \"S\"\nbogus = 1\n"[s]), Some("bogus"));
        let e = toml::from_str::<File>("[source]\nprefetch = \"many\"\n").unwrap_err();
        assert!(e.message().contains("invalid type"), "{e}");
        assert_eq!(e.span().map(|s| &"[source]\nprefetch = \"many\"\n"[s]), Some("\"many\""));
    }
}
