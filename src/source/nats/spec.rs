//! NATS's `[nats]` settings and the `[source]` of a JetStream pipeline.

use crate::secret::{Secret, SecretUrl};
use crate::source::contract::{BrokerSpec, Capabilities, Conflict, Context, ParseContext, RawKeys, LANES};
use std::path::Path;
use crate::validate::Problems;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// `[nats]`: the servers of the pipelines with `[source] kind = "nats"`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSettings {
    /// The servers: `nats://host:4222`, several separated by commas (`nats://a:4222,nats://b:4222`; the client
    /// also learns the cluster's other servers from the one it reaches). `tls://host:4222` requires TLS. Credentials
    /// may be in the URL (`nats://user:password@host:4222`, percent-encoded; `user` and `password` take precedence).
    /// Never printed: `Debug` and `Display` mask it.
    pub url: SecretUrl,
    /// User, for servers with user/password authorization (with `password`).
    #[serde(default)]
    pub user: Option<String>,
    /// The password of `user`. Never printed.
    #[serde(default)]
    pub password: Option<Secret>,
    /// A token, for servers with token authorization. Never printed.
    #[serde(default)]
    pub token: Option<Secret>,
    /// An NKey seed (`SU...`), for servers with NKey authorization. Never printed.
    #[serde(default)]
    pub nkey_seed: Option<Secret>,
    /// A `.creds` file (a user JWT and its NKey seed), for servers in decentralized JWT mode.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A PEM file of CA certificates to trust for the server's certificate, for a private CA (default: the
    /// system's roots). Setting it requires TLS.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate, for servers that verify clients (with `tls_key_file`).
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// The client certificate's private key, PEM.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// How long one connection attempt, and `idemflow check` as a whole, may take (default 10 s).
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long a JetStream API request (stream and consumer info, a double ack) may wait for its answer
    /// (default 5 s).
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_request_timeout() -> Duration {
    Duration::from_secs(5)
}

/// A NATS JetStream source: a durable pull consumer on a stream, with explicit acknowledgements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsSpec {
    /// The stream (created by the user; `idemflow check` checks it exists).
    pub stream: String,
    /// The durable consumer's name (default `idemflow-<pipeline>`). Bound to when it exists (its settings checked),
    /// created with the settings below when it does not.
    pub consumer: String,
    /// Subjects the created consumer takes (none: the whole stream). More than one needs a 2.10 server.
    pub filter_subjects: Vec<String>,
    /// How long the server waits for a delivery's ack before it redelivers it (`ack_wait`, default 30 s), for the
    /// consumer idemflow creates (an existing consumer keeps its own; `check` warns when they differ). While a batch
    /// waits for its transaction, in-progress acks keep its deliveries from being redelivered.
    pub ack_wait: Duration,
    /// Deliveries the server may have outstanding to the consumer it creates (`max_ack_pending`, shared by every
    /// worker on it). Default twice `batch.max_records`; never below `batch.max_records`, or no batch could fill.
    pub max_ack_pending: i64,
}

impl BrokerSpec for NatsSpec {
    type Raw = NatsRaw;

    fn parse(raw: &NatsRaw, cx: &ParseContext<'_>, e: &mut impl Problems) -> Option<Self> {
        parse(raw, cx.name, cx.max_records, e)
    }

    type Settings = NatsSettings;
    const CAPABILITIES: Capabilities = Capabilities {
        kind: "nats",
        fields: &["stream", "consumer", "filter_subjects", "ack_wait", "max_ack_pending"],
        positions: Err(
            "\"database\" is for sources a worker positions itself in (Kafka, RocketMQ); a JetStream durable consumer keeps \
             its position on the server (its ack floor and pending deliveries), which a worker cannot seek",
        ),
        lanes: Err(LANES),
        dead_letter_topic: Err("is a Kafka topic; a JetStream pipeline keeps its dead letters in the store"),
        dead_letter_exchange: Err("is a RabbitMQ exchange; a JetStream pipeline keeps its dead letters in the store"),
        key_properties: Ok(()),
        key_message_key: Err("is RocketMQ's KEYS property; for a JetStream message use message_id = true (its Nats-Msg-Id) or header"),
        key_record_key: Err("a JetStream message has no record key: use message_id = true (its Nats-Msg-Id), header or field"),
        bind_property: Ok(()),
        bind_record_key: Err("a JetStream message has no record key"),
        bind_partition: Ok(()),
    };
    const NAME: &'static str = "NATS JetStream";
    const FEATURE: &'static str = "nats";
    const BUILT: bool = cfg!(feature = "nats");

    fn settings_missing(settings: Option<&NatsSettings>) -> Option<&'static str> {
        settings.is_none().then_some("a NATS JetStream source needs [nats] url in the settings (or IDEMFLOW_NATS__URL)")
    }

    fn streams(&self) -> &[String] {
        std::slice::from_ref(&self.stream)
    }

    fn reads(&self, _cx: &Context<Self>) -> Vec<(&'static str, serde_json::Value)> {
        use serde_json::json;
        vec![
            ("stream", json!(self.stream)),
            ("consumer", json!(self.consumer)),
            ("ack_wait", json!(crate::terminal::duration(self.ack_wait))),
            ("max_ack_pending", json!(self.max_ack_pending)),
        ]
    }

    fn conflict_with(&self, earlier: &Self) -> Option<Conflict> {
        (earlier.stream == self.stream && earlier.consumer == self.consumer).then(|| Conflict {
            field: "source.consumer",
            what: format!("{:?} of stream {:?} is also consumed by", self.consumer, self.stream),
            why: ": two pipelines on one durable consumer would each see only part of its messages",
        })
    }

    // `check` compares the stream's max_age with the retention when it reads the stream (see `nats::check`).
    fn retention_note(&self, cx: &Context<Self>) -> Vec<String> {
        vec![format!(
            "pipeline {:?}: stream {:?}: [dedup] retention = {} must outlast how long the stream keeps a message \
             (max_age) and the longest a message can stay unacknowledged",
            cx.name, self.stream, crate::terminal::duration(cx.dedup_retention),
        )]
    }

    fn rewind_refusal(&self, cx: &Context<Self>, file: &Path) -> Option<String> {
        Some(format!(
            "{}: pipeline {:?} has a {} source: rewind moves a consumer's stored position back; a JetStream durable \
             consumer's position is its ack floor on the server, which cannot be moved back. To replay stream {:?}, create \
             a new consumer with the start you mean ({}) and name it in [source] consumer: the dedup \
             store skips every message already applied within [dedup] retention",
            file.display(),
            cx.name,
            Self::CAPABILITIES.kind,
            self.stream,
            add_command(self, cx.batch.max_records, &format!("{}-replay", self.consumer))
        ))
    }
}

/// The natscli command that creates a consumer named `name` on `spec`'s stream as idemflow would create its own,
/// with the start left to the user (`--deliver`: all, new, a stream sequence, or a duration back from now such as
/// 36h). `max_records`: the pipeline's batch, which `max_ack_pending` must reach.
pub fn add_command(spec: &NatsSpec, max_records: usize, name: &str) -> String {
    let filters: String = spec.filter_subjects.iter().map(|f| format!(" --filter {f}")).collect();
    format!(
        "`nats consumer add {} {} --pull --ack explicit --max-deliver=-1 --max-pending {} --wait {}s{filters} \
         --deliver <all|new|SEQUENCE|DURATION> --defaults`, with the nats CLI (github.com/nats-io/natscli)",
        spec.stream,
        name,
        spec.max_ack_pending.max(max_records as i64),
        spec.ack_wait.as_secs().max(1)
    )
}

/// Whether `name` is a valid stream or consumer name: JetStream refuses whitespace, `.`, `*`, `>`, path
/// separators and non-printable characters (nats-server's `isValidName`); at most 255 bytes here. Positions rely on
/// the missing `/` (see [`crate::record::Position`]).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name.chars().all(|c| !c.is_whitespace() && !c.is_control() && !matches!(c, '.' | '*' | '>' | '/' | '\\'))
}

/// A JetStream pipeline's `[source]` keys as written.
#[derive(Debug, Default)]
pub struct NatsRaw {
    /// `stream`.
    pub stream: Option<String>,
    /// `consumer`.
    pub consumer: Option<String>,
    /// `filter_subjects`.
    pub filter_subjects: Option<Vec<String>>,
    /// `ack_wait`, a duration (`30s`).
    pub ack_wait: Option<Duration>,
    /// `max_ack_pending`.
    pub max_ack_pending: Option<i64>,
}

impl RawKeys for NatsRaw {
    fn take<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        match key {
            "stream" => self.stream = Some(map.next_value()?),
            "consumer" => self.consumer = Some(map.next_value()?),
            "filter_subjects" => self.filter_subjects = Some(map.next_value()?),
            "ack_wait" => self.ack_wait = Some(map.next_value::<humantime_serde::Serde<Duration>>()?.into_inner()),
            "max_ack_pending" => self.max_ack_pending = Some(map.next_value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The `[source]` of a JetStream pipeline named `name` (`s`), its `max_ack_pending` defaulting from
/// `max_records`. Every problem goes to `e`; `None` when the spec cannot be built.
fn parse(s: &NatsRaw, name: &str, max_records: usize, e: &mut impl Problems) -> Option<NatsSpec> {
    let Some(stream) = s.stream.clone() else {
        e.push("source.stream", "a NATS JetStream source needs its stream");
        return None;
    };
    if !valid_name(&stream) {
        e.push("source.stream", format!("{stream:?} is not a JetStream stream name (no whitespace, '.', '*', '>', '/' or '\\')"));
    }
    let consumer = s.consumer.clone().unwrap_or_else(|| format!("idemflow-{name}"));
    if !valid_name(&consumer) {
        e.push("source.consumer", format!("{consumer:?} is not a JetStream consumer name (no whitespace, '.', '*', '>', '/' or '\\')"));
    }
    let filter_subjects = s.filter_subjects.clone().unwrap_or_default();
    for (i, f) in filter_subjects.iter().enumerate() {
        if f.is_empty() || f.contains(char::is_whitespace) || f.starts_with('.') || f.ends_with('.') || f.contains("..") {
            e.push(&format!("source.filter_subjects[{i}]"), format!("{f:?} is not a NATS subject"));
        }
    }
    let ack_wait = s.ack_wait.unwrap_or(Duration::from_secs(30));
    if ack_wait < Duration::from_secs(1) {
        e.push("source.ack_wait", "must be at least 1s: in-progress acks are sent every third of it while a batch commits");
    }
    let default = max_records.saturating_mul(2).min(i64::MAX as usize) as i64;
    let max_ack_pending = s.max_ack_pending.unwrap_or(default);
    if max_ack_pending < 1 {
        e.push("source.max_ack_pending", format!("{max_ack_pending} is not a positive number of deliveries"));
    } else if (max_ack_pending as usize) < max_records {
        e.push(
            "source.max_ack_pending",
            format!("{max_ack_pending} is below batch.max_records = {max_records}: no batch could fill, every one would wait batch.max_wait"),
        );
    }
    Some(NatsSpec { stream, consumer, filter_subjects, ack_wait, max_ack_pending })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_servers_rules() {
        assert!(valid_name("PAYMENTS"));
        assert!(valid_name("idemflow-payments_1"));
        for bad in ["", "a.b", "a b", "a*", "a>", "a/b", "a\\b", "a\u{7}"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
