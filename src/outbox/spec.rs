//! What a pipeline declares of its outbox: `[[sink.http]]` and `[[sink.kafka]]` (the requests and records each new
//! business key sends) and `[outbox]`
//! (back-pressure and the relay's pace), read from the raw TOML and checked, every problem naming its field.
//!
//! Templates are the Redis form's (`{name}` placeholders naming `[sink.params]` entries, `{{` and `}}` for braces;
//! [`crate::store::redis_command::parse_arg`]).

pub use super::body::{Body, JsonTemplate, JsonType};
use super::body::json_template;
use super::placeholders::template;
use super::guard::{HostRule, Origin, PathShape, TopicRule, MARK};
pub use super::secret::{RawValue, SecretRef};
use crate::store::redis_command::{parse_arg, Arg, Piece};
use crate::store::spec::Binding;
use crate::validate::Problems;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The outbox of one pipeline.
#[derive(Clone, Debug)]
pub struct OutboxSpec {
    /// The HTTP requests of each record whose business key was new, in the order written (the order a key's
    /// requests are delivered in).
    pub http: Vec<HttpTarget>,
    /// The Kafka records of each record whose business key was new, after its HTTP requests.
    pub kafka: Vec<KafkaTarget>,
    /// The `[sink.params]` entries the templates name, in the order their values are taken ([`Binding`]s rendered
    /// as JSON, [`crate::field::Render::Json`]).
    pub params: Vec<Binding>,
    /// `[outbox]`.
    pub settings: OutboxSettings,
    /// `[outbox] key_prefix`: what each idempotency key starts with ([`super::render::idempotency_key`]); `None`:
    /// the pipeline's name. Set it to keep a pipeline's keys through a rename ([docs/operations.md], "Renaming a
    /// pipeline"): a provider recognises a request sent again after the rename as the one it answered.
    pub key_prefix: Option<String>,
}

impl OutboxSpec {
    /// The names of its targets, `[[sink.http]]`'s then `[[sink.kafka]]`'s: the `target` of the rows it writes.
    pub fn target_names(&self) -> impl Iterator<Item = &str> {
        self.http.iter().map(|t| t.name.as_str()).chain(self.kafka.iter().map(|t| t.name.as_str()))
    }
}

/// `[[sink.http]]`: one HTTP request per record whose business key was new.
#[derive(Clone, Debug)]
pub struct HttpTarget {
    /// `name`: the `target` label of the metrics and the dead letters (default `http`, `http-2`, ... in order).
    pub name: String,
    /// `method` (default `POST`), upper case.
    pub method: String,
    /// `url`: an `http://` or `https://` URL; each placeholder's value is percent-encoded. With a secret URL
    /// ([`HttpTarget::secret_url`]), a literal marker naming the secret: what rows store.
    pub url: Arg,
    /// `url = { env = ... }` or `{ file = ... }`: the whole URL is a secret (an incoming webhook's), read when a
    /// request is sent; rows keep [`HttpTarget::url`]'s marker instead.
    pub secret_url: Option<SecretRef>,
    /// `allow_hosts`: where a URL whose host comes from a record's values may go; `None` when the URL's scheme and
    /// authority are written in full (they are then the operator's, [`HttpTarget::origin`]).
    pub hosts: Option<HostRule>,
    /// `allow_private_addresses` (default false): a host from a record may resolve to loopback, private and other
    /// internal addresses (tests, internal services).
    pub private_addresses: bool,
    /// The origin of a URL whose scheme and authority are written in full: a row written for another origin (an
    /// older configuration's) is not sent with this target's headers.
    pub origin: Option<Origin>,
    /// The template's path: a record's values never change its segments.
    pub path: Option<PathShape>,
    /// `[sink.http.headers]` with text values: name and value template, in name order.
    pub headers: Vec<(String, Arg)>,
    /// `[sink.http.headers]` that are secret references: added when a request is sent, never stored.
    pub secret_headers: Vec<(String, SecretRef)>,
    /// `body`: a JSON template, or the record's payload as it is.
    pub body: Body,
    /// `content_type` (default `application/json`).
    pub content_type: String,
    /// `idempotency_header` (default `Idempotency-Key`): carries `<pipeline>:<business key>`, the same on every
    /// attempt (IETF httpapi draft "The Idempotency-Key HTTP Header Field").
    pub idempotency_header: String,
    /// `timeout` (default 10 s): the whole request, connecting included.
    pub timeout: Duration,
    /// `success` (default `["2xx"]`): statuses that confirm the request.
    pub success: Vec<Statuses>,
    /// `retry` (default `[408, 409, 425, 429, "5xx"]`): statuses worth another attempt (409: the draft's answer
    /// to a request whose key another request is still being processed under). Connection errors and time-outs
    /// are always retried; any other status can never succeed.
    pub retry: Vec<Statuses>,
    /// `max_attempts` (default 10): after as many, a request still failing becomes a dead letter.
    pub max_attempts: u32,
}

/// `[[sink.kafka]]`: one Kafka record per record whose business key was new, produced to the brokers of `[kafka]`
/// by an idempotent producer with `acks=all`.
#[derive(Clone, Debug)]
pub struct KafkaTarget {
    /// `name`: the `target` label (default `kafka`, `kafka-2`, ...).
    pub name: String,
    /// `topic`: the topic, a template.
    pub topic: Arg,
    /// `allow_topics`: the topics a templated `topic` may render (required then); `None` for a fixed topic.
    pub topics: Option<TopicRule>,
    /// `key`: the record key, a template; default the business key.
    pub key: Option<Arg>,
    /// `[sink.kafka.headers]` with text values: name and value template, in name order.
    pub headers: Vec<(String, Arg)>,
    /// `[sink.kafka.headers]` that are secret references: added when a record is produced, never stored.
    pub secret_headers: Vec<(String, SecretRef)>,
    /// `value`: a JSON template, or the record's payload as it is.
    pub value: Body,
    /// `idempotency_header` (default `Idempotency-Key`): the header carrying `<pipeline>:<business key>`, the same on
    /// every attempt, by which a consumer recognises a record produced again after a crash.
    pub idempotency_header: String,
    /// `timeout` (default 30 s): how long one attempt may wait for the brokers' acknowledgement
    /// (`message.timeout.ms`).
    pub timeout: Duration,
    /// `max_attempts` (default 10): after as many, a record still failing becomes a dead letter.
    pub max_attempts: u32,
}

/// Statuses in `success` or `retry`: one (`404`) or a class (`"4xx"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Statuses {
    /// First status.
    pub from: u16,
    /// Last status.
    pub to: u16,
}

impl Statuses {
    /// Whether `status` is one of them.
    pub fn contains(self, status: u16) -> bool {
        (self.from..=self.to).contains(&status)
    }
}

/// `[outbox]`: back-pressure and the relay's pace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutboxSettings {
    /// `max_rows` (default 10000): with more rows waiting, the pipeline stops consuming until the relay catches up.
    pub max_rows: u64,
    /// `max_age` (default 5 minutes): with a row the relay could send (due, the first of its business key) waiting
    /// for longer since it was due, the same. Rows waiting out a back-off (a key answered 429, a host down) and the
    /// rows behind them never count: one key or host never pauses the pipeline.
    pub max_age: Duration,
    /// `concurrency` (default 16): requests in flight at once in this worker.
    pub concurrency: usize,
    /// `backoff` (default 1 s): the wait before a request's second attempt, doubled for each one after.
    pub backoff: Duration,
    /// `max_backoff` (default 5 minutes): the longest wait between two attempts of the schedule (a longer
    /// `Retry-After` is honoured up to [`MAX_RETRY_AFTER`]; a shorter one does not shorten the schedule's wait).
    pub max_backoff: Duration,
    /// `poll_interval` (default 1 s): how often the relay looks for rows written by other workers, or due again
    /// (rows this worker commits are sent at once).
    pub poll_interval: Duration,
    /// `lease` (default: the longest request `timeout` plus 30 s): how long a relay holds the rows it is sending.
    /// A worker that died holding some leaves them to be sent again (with the same idempotency key) after it.
    /// Longer than every `timeout`, so a live relay's request ends before its lease does.
    pub lease: Option<Duration>,
}

/// The longest `Retry-After` honoured; a longer one waits this long.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

impl Default for OutboxSettings {
    fn default() -> Self {
        OutboxSettings {
            max_rows: 10_000,
            max_age: Duration::from_secs(300),
            concurrency: 16,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            poll_interval: Duration::from_secs(1),
            lease: None,
        }
    }
}

/// `[[sink.http]]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    name: Option<String>,
    method: Option<String>,
    url: RawValue,
    #[serde(default)]
    headers: BTreeMap<String, RawValue>,
    body: Option<toml::Value>,
    allow_hosts: Option<Vec<String>>,
    allow_private_addresses: Option<bool>,
    content_type: Option<String>,
    idempotency_header: Option<String>,
    #[serde(default, with = "humantime_serde")]
    timeout: Option<Duration>,
    success: Option<Vec<toml::Value>>,
    retry: Option<Vec<toml::Value>>,
    max_attempts: Option<u32>,
}

/// `[sink] http` or `[sink] kafka`: one table (`[sink.http]`) or an array of them (`[[sink.http]]`).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    /// `[sink.http]`.
    One(Box<T>),
    /// `[[sink.http]]`.
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The entries, in order.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(r) => vec![*r],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `[[sink.kafka]]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKafka {
    name: Option<String>,
    topic: String,
    allow_topics: Option<Vec<String>>,
    key: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, RawValue>,
    value: Option<toml::Value>,
    idempotency_header: Option<String>,
    #[serde(default, with = "humantime_serde")]
    timeout: Option<Duration>,
    max_attempts: Option<u32>,
}

/// `[outbox]` as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawOutbox {
    max_rows: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    max_age: Option<Duration>,
    concurrency: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    backoff: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    max_backoff: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    lease: Option<Duration>,
    key_prefix: Option<String>,
}

impl RawOutbox {
    /// Whether anything was set (an `[outbox]` without `[sink.http]` is refused).
    pub fn is_set(&self) -> bool {
        self.max_rows.is_some()
            || self.max_age.is_some()
            || self.concurrency.is_some()
            || self.backoff.is_some()
            || self.max_backoff.is_some()
            || self.poll_interval.is_some()
            || self.lease.is_some()
            || self.key_prefix.is_some()
    }
}

/// The names of the `[sink.params]` entries `http`'s templates use, each once (for the check that every entry is
/// used by some form).
pub fn used_params(http: &[RawHttp], kafka: &[RawKafka]) -> Vec<String> {
    let mut names = Vec::new();
    let mut texts: Vec<&str> = Vec::new();
    for h in http {
        texts.extend(h.url.text());
        texts.extend(h.headers.values().filter_map(RawValue::text));
        if let Some(body) = &h.body {
            strings(body, &mut texts);
        }
    }
    for k in kafka {
        texts.push(&k.topic);
        texts.extend(k.key.as_deref());
        texts.extend(k.headers.values().filter_map(RawValue::text));
        if let Some(value) = &k.value {
            strings(value, &mut texts);
        }
    }
    for t in texts {
        if let Some((name, _)) = super::body::typed_placeholder(t) {
            names.push(name.to_owned());
        } else if let Ok(arg) = parse_arg(t) {
            names.extend(arg.params().map(str::to_owned));
        }
    }
    names.sort();
    names.dedup();
    names
}

fn strings<'a>(v: &'a toml::Value, out: &mut Vec<&'a str>) {
    match v {
        toml::Value::String(s) => out.push(s),
        toml::Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
        toml::Value::Table(t) if !super::secret::is_reference(t) => t.values().for_each(|v| strings(v, out)),
        _ => {}
    }
}

/// The outbox of a pipeline: `http` checked, the `params` (every `[sink.params]` entry) its templates name taken,
/// `[outbox]` read. `None` after reporting problems to `e`.
pub fn parse(http: Vec<RawHttp>, kafka: Vec<RawKafka>, params: &[Binding], raw: RawOutbox, e: &mut impl Problems) -> Option<OutboxSpec> {
    let known = |name: &str| params.iter().any(|b| b.name == name);
    let mut ok = true;
    let targets = parse_http(http, &known, &mut ok, e);
    let records = parse_kafka(kafka, &known, &mut ok, e);
    let names: std::collections::HashSet<&str> = targets.iter().map(|t| t.name.as_str()).chain(records.iter().map(|t| t.name.as_str())).collect();
    if names.len() != targets.len() + records.len() {
        ok = false;
        e.push(if records.is_empty() { "sink.http" } else { "sink" }, "two requests have the same name: give each its own (name = \"...\")");
    }
    let d = OutboxSettings::default();
    let settings = OutboxSettings {
        max_rows: raw.max_rows.unwrap_or(d.max_rows),
        max_age: raw.max_age.unwrap_or(d.max_age),
        concurrency: raw.concurrency.unwrap_or(d.concurrency),
        backoff: raw.backoff.unwrap_or(d.backoff),
        max_backoff: raw.max_backoff.unwrap_or(d.max_backoff),
        poll_interval: raw.poll_interval.unwrap_or(d.poll_interval),
        lease: raw.lease,
    };
    // A Kafka record also waits up to a second for the producer's local queue.
    let longest = targets.iter().map(|t| t.timeout).chain(records.iter().map(|t| t.timeout + Duration::from_secs(1))).max().unwrap_or_default();
    if settings.lease.is_some_and(|l| l < longest + MIN_LEASE_MARGIN) {
        ok = false;
        e.push(
            "outbox.lease",
            format!("must outlast the longest request timeout ({}) by {} at least", humantime::format_duration(longest), humantime::format_duration(MIN_LEASE_MARGIN)),
        );
    }
    for (bad, field, why) in [
        (settings.max_rows == 0, "outbox.max_rows", "must be at least 1"),
        (settings.max_age.is_zero(), "outbox.max_age", "must be more than 0s"),
        (!(1..=1024).contains(&settings.concurrency), "outbox.concurrency", "must be from 1 to 1024"),
        (settings.backoff.is_zero(), "outbox.backoff", "must be more than 0s"),
        (settings.max_backoff < settings.backoff, "outbox.max_backoff", "must be at least backoff"),
        (settings.poll_interval.is_zero(), "outbox.poll_interval", "must be more than 0s"),
    ] {
        if bad {
            ok = false;
            e.push(field, why);
        }
    }
    let used = targets.iter().flat_map(HttpTarget::params).chain(records.iter().flat_map(KafkaTarget::params)).collect::<std::collections::HashSet<_>>();
    let params = params.iter().filter(|b| used.contains(b.name.as_str())).cloned().collect();
    if raw.key_prefix.as_deref().is_some_and(|p| !(1..=200).contains(&p.len()) || !p.bytes().all(|b| b.is_ascii_graphic())) {
        ok = false;
        e.push("outbox.key_prefix", "must be 1 to 200 visible ASCII characters (no blank, no control character)");
    }
    ok.then_some(OutboxSpec { http: targets, kafka: records, params, settings, key_prefix: raw.key_prefix })
}

/// `[[sink.http]]`, checked; problems to `e`, `ok` cleared with the first.
fn parse_http(http: Vec<RawHttp>, known: &dyn Fn(&str) -> bool, ok: &mut bool, e: &mut impl Problems) -> Vec<HttpTarget> {
    let many = http.len() > 1;
    let mut targets = Vec::new();
    for (i, h) in http.into_iter().enumerate() {
        let field = if many { format!("sink.http[{i}]") } else { "sink.http".to_owned() };
        let mut push = |f: &str, m: String| {
            *ok = false;
            e.push(&format!("{field}.{f}"), m);
        };
        targets.extend(http_target(i, h, known, &mut push));
    }
    targets
}

/// One `[[sink.http]]` (the `i`th), checked: problems to `push` (a field under the target's own, and the message).
fn http_target(i: usize, h: RawHttp, known: &dyn Fn(&str) -> bool, push: &mut dyn FnMut(&str, String)) -> Option<HttpTarget> {
    let where_to = http_url(&h, known, push);
    let method = h.method.unwrap_or_else(|| "POST".to_owned()).to_ascii_uppercase();
    if method.is_empty() || method.len() > 16 || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
        push("method", format!("{method:?} is not an HTTP method (GET, POST, PUT, PATCH, DELETE)"));
    }
    let idempotency_header = h.idempotency_header.clone().unwrap_or_else(|| "Idempotency-Key".to_owned());
    if !token(&idempotency_header) {
        push("idempotency_header", format!("{idempotency_header:?} is not a header name"));
    }
    let (headers, secret_headers) = http_headers(&h.headers, &idempotency_header, known, push);
    let body = match h.body {
        None => Some(Body::Payload),
        Some(v) => json_template(v, &mut |m| push("body", m), known).map(Body::Json),
    };
    let statuses = |list: Option<Vec<toml::Value>>, default: &[Statuses], f: &str, push: &mut dyn FnMut(&str, String)| -> Vec<Statuses> {
        let Some(list) = list else { return default.to_vec() };
        list.iter()
            .filter_map(|v| {
                let s = status(v);
                if s.is_none() {
                    push(f, format!("{v} is not a status (a number from 100 to 599, or a class such as \"5xx\")"));
                }
                s
            })
            .collect()
    };
    let success = statuses(h.success, &[Statuses { from: 200, to: 299 }], "success", push);
    let retry = statuses(h.retry, &DEFAULT_RETRY, "retry", push);
    let timeout = h.timeout.unwrap_or(Duration::from_secs(10));
    if timeout.is_zero() {
        push("timeout", "must be more than 0s".to_owned());
    }
    let max_attempts = h.max_attempts.unwrap_or(10);
    if max_attempts == 0 {
        push("max_attempts", "must be at least 1".to_owned());
    }
    let name = h.name.unwrap_or_else(|| if i == 0 { "http".to_owned() } else { format!("http-{}", i + 1) });
    if !target_name(&name) {
        push("name", format!("{name:?}: 1 to 64 letters, digits, _, - and . only"));
    }
    let (Where { url, secret_url, hosts, origin, path }, body) = (where_to?, body?);
    Some(HttpTarget {
        name,
        method,
        url,
        secret_url,
        hosts,
        private_addresses: h.allow_private_addresses.unwrap_or(false),
        origin,
        path,
        headers,
        secret_headers,
        body,
        content_type: h.content_type.unwrap_or_else(|| "application/json".to_owned()),
        idempotency_header,
        timeout,
        success,
        retry,
    max_attempts,
    })
}

/// `headers` of one `[[sink.http]]`, checked: each a header name the client does not set itself, set once whatever
/// its case, not the idempotency key's, with a value template or a secret reference. Returns the templates and the
/// secrets.
fn http_headers(
    raw: &BTreeMap<String, RawValue>,
    idempotency_header: &str,
    known: &dyn Fn(&str) -> bool,
    push: &mut dyn FnMut(&str, String),
) -> (Vec<(String, Arg)>, Vec<(String, SecretRef)>) {
    let (mut headers, mut secrets) = (Vec::new(), Vec::new());
    let mut seen: Vec<String> = Vec::new();
    for (name, value) in raw {
        let lower = name.to_ascii_lowercase();
        let field = format!("headers.{name}");
        if !token(name) {
            push(&field, format!("{name:?} is not a header name"));
        } else if seen.contains(&lower) {
            push(&field, "is set twice (header names are the same whatever their case)".to_owned());
        } else if lower == "content-type" {
            push(&field, "is set by content_type (default application/json)".to_owned());
        } else if ["content-length", "host", "transfer-encoding", "connection"].contains(&lower.as_str()) {
            push(&field, "is set by the HTTP client for each request".to_owned());
        } else if name.eq_ignore_ascii_case(idempotency_header) {
            push(&field, "is the idempotency key's header, which idemflow sets (to <pipeline>:<business key>); set idempotency_header to use another".to_owned());
        } else {
            match value {
                RawValue::Secret(raw) => match SecretRef::parse(raw) {
                    Ok(secret) => secrets.push((name.clone(), secret)),
                    Err(why) => push(&field, why),
                },
                RawValue::Text(text) if parse_arg(text).ok().and_then(|a| a.literal()).is_some_and(|v| reqwest::header::HeaderValue::from_str(&v).is_err()) => {
                    push(&field, "is not a header value (a control character)".to_owned());
                }
                RawValue::Text(text) => headers.extend(template(text, known, &mut |m| push(&field, m)).map(|arg| (name.clone(), arg))),
            }
        }
        seen.push(lower);
    }
    (headers, secrets)
}

/// Where one `[[sink.http]]` sends its requests, checked.
struct Where {
    url: Arg,
    secret_url: Option<SecretRef>,
    hosts: Option<HostRule>,
    origin: Option<Origin>,
    path: Option<PathShape>,
}

/// `url`, `allow_hosts` and `allow_private_addresses` of one `[[sink.http]]`: a template whose scheme and authority
/// are written in full, or one with a placeholder there and `allow_hosts`, or a secret reference (the whole URL).
fn http_url(h: &RawHttp, known: &dyn Fn(&str) -> bool, push: &mut dyn FnMut(&str, String)) -> Option<Where> {
    let hosts = match h.allow_hosts.as_deref().map(HostRule::parse) {
        Some(Ok(rule)) if rule.is_empty() => {
            push("allow_hosts", "names no host: list the hosts (api.example.com) or .suffixes a record's values may send to".to_owned());
            None
        }
        Some(Ok(rule)) => Some(rule),
        Some(Err(why)) => {
            push("allow_hosts", why);
            None
        }
        None => None,
    };
    let text = match &h.url {
        RawValue::Secret(raw) => {
            if h.allow_hosts.is_some() {
                push("allow_hosts", "is for a url whose host comes from a record's values; this url is a secret of the operator's".to_owned());
            }
            let secret = SecretRef::parse(raw).map_err(|why| push("url", why)).ok()?;
            // What rows keep: a marker naming the secret, never its value.
            let marker = Arg(vec![Piece::Text(format!("{SECRET_URL}{}", secret.describe()))]);
            return Some(Where { url: marker, secret_url: Some(secret), hosts: None, origin: None, path: None });
        }
        RawValue::Text(text) => text,
    };
    let url = template(text, known, &mut |m| push("url", m))?;
    let sample_with = |mark: &str| -> String {
        url.0.iter().map(|p| match p {
            Piece::Text(t) => t.as_str(),
            Piece::Param(_) => mark,
        }).collect()
    };
    let sample = sample_with(MARK);
    check_url(&sample, text, push);
    // The scheme and authority are written in full when two different values give the same origin, and the values
    // are not in it (`https:///{host}/x` parses with its placeholder as the host).
    let origin = Origin::of(&sample);
    let parses = origin.is_some();
    let fixed = parses && origin == Origin::of(&sample_with("idemflowanotherplaceholder")) && !origin.as_ref().is_some_and(|o| o.0.contains(MARK));
    match (fixed, &h.allow_hosts) {
        (false, None) if parses => push(
            "url",
            "its scheme or host comes from a record's values (a placeholder before the path): set allow_hosts to the hosts (or .suffixes) a record may send to, \
             or write the host in full"
                .to_owned(),
        ),
        (true, Some(_)) => push("allow_hosts", "is for a url whose host comes from a record's values; this url's host is written in full".to_owned()),
        _ => {}
    }
    if h.allow_private_addresses.is_some() && fixed {
        push("allow_private_addresses", "is for a url whose host comes from a record's values; a host written in full is the operator's".to_owned());
    }
    let origin = if fixed { origin } else { None };
    Some(Where { path: PathShape::of(&sample), url, secret_url: None, hosts: if fixed { None } else { hosts }, origin })
}

/// What a row of a target whose URL is a secret keeps as its URL: this, then where the secret comes from.
pub const SECRET_URL: &str = "idemflow-secret-url:";

/// A URL template's shape: with every placeholder a marker (`sample`), it must parse as http or https with a host,
/// and hold no user or password. `written` is the template as written (shown without its user, password and query).
fn check_url(sample: &str, written: &str, push: &mut dyn FnMut(&str, String)) {
    match url::Url::parse(sample) {
        // Credentials in the URL would be kept in every row and dead letter: a header is added when sent.
        Ok(u) if !u.username().is_empty() || u.password().is_some() => push(
            "url",
            "holds a user or password: put credentials in headers (Authorization = { env = \"NAME\", prefix = \"Basic \" }), which are added when a request is sent and kept nowhere".to_owned(),
        ),
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some_and(|h| !h.is_empty()) => {}
        Ok(u) => push("url", format!("{:?}: the scheme must be http or https with a host (found {:?})", shown_template(written), u.scheme())),
        Err(why) => push("url", format!("is not a URL: {why}")),
    }
}

/// `[[sink.kafka]]`, checked; problems to `e`, `ok` cleared with the first.
fn parse_kafka(kafka: Vec<RawKafka>, known: &dyn Fn(&str) -> bool, ok: &mut bool, e: &mut impl Problems) -> Vec<KafkaTarget> {
    let many = kafka.len() > 1;
    let mut records = Vec::new();
    for (i, k) in kafka.into_iter().enumerate() {
        let field = if many { format!("sink.kafka[{i}]") } else { "sink.kafka".to_owned() };
        let mut push = |f: &str, m: String| {
            *ok = false;
            e.push(&format!("{field}.{f}"), m);
        };
        let topic = template(&k.topic, known, &mut |m| push("topic", m));
        if let Some(literal) = topic.as_ref().and_then(Arg::literal) {
            if !kafka_topic(&literal) {
                push("topic", format!("{literal:?} is not a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -)"));
            }
        }
        let topics = kafka_topics(topic.as_ref(), k.allow_topics.as_deref(), &mut push);
        let key = k.key.as_deref().map(|t| template(t, known, &mut |m| push("key", m)));
        let idempotency_header = k.idempotency_header.unwrap_or_else(|| "Idempotency-Key".to_owned());
        if idempotency_header.is_empty() {
            push("idempotency_header", "must name a header".to_owned());
        }
        let (mut headers, mut secret_headers) = (Vec::new(), Vec::new());
        for (name, value) in &k.headers {
            let field = format!("headers.{name}");
            if name == &idempotency_header {
                push(&field, "is the idempotency key's header, which idemflow sets (to <pipeline>:<business key>); set idempotency_header to use another".to_owned());
                continue;
            }
            match value {
                RawValue::Secret(raw) => match SecretRef::parse(raw) {
                    Ok(secret) => secret_headers.push((name.clone(), secret)),
                    Err(why) => push(&field, why),
                },
                RawValue::Text(text) => headers.extend(template(text, known, &mut |m| push(&field, m)).map(|arg| (name.clone(), arg))),
            }
        }
        let value = match k.value {
            None => Some(Body::Payload),
            Some(v) => json_template(v, &mut |m| push("value", m), known).map(Body::Json),
        };
        let timeout = k.timeout.unwrap_or(Duration::from_secs(30));
        // librdkafka refuses a message.timeout.ms not above linger.ms (5 ms by default).
        if timeout < Duration::from_secs(1) {
            push("timeout", "must be 1s or more (message.timeout.ms must outlast the producer's linger.ms)".to_owned());
        }
        let max_attempts = k.max_attempts.unwrap_or(10);
        if max_attempts == 0 {
            push("max_attempts", "must be at least 1".to_owned());
        }
        let name = k.name.unwrap_or_else(|| if i == 0 { "kafka".to_owned() } else { format!("kafka-{}", i + 1) });
        if !target_name(&name) {
            push("name", format!("{name:?}: 1 to 64 letters, digits, _, - and . only"));
        }
        let key_ok = !matches!(key, Some(None));
        if let (Some(topic), true, Some(value)) = (topic, key_ok, value) {
            records.push(KafkaTarget { name, topic, topics, key: key.flatten(), headers, secret_headers, value, idempotency_header, timeout, max_attempts });
        }
    }
    records
}

/// `allow_topics` of a `[[sink.kafka]]` whose `topic` is `topic`: required when the topic comes from a record's
/// values, refused when it is written in full.
fn kafka_topics(topic: Option<&Arg>, allow: Option<&[String]>, push: &mut dyn FnMut(&str, String)) -> Option<TopicRule> {
    let templated = topic.is_some_and(|t| t.literal().is_none());
    match (templated, allow.map(TopicRule::parse)) {
        (true, None) => {
            push("topic", "comes from a record's values: set allow_topics to the topics (or prefixes ending in *) a record may produce to".to_owned());
            None
        }
        (false, Some(_)) => {
            push("allow_topics", "is for a topic that comes from a record's values; this topic is written in full".to_owned());
            None
        }
        (_, Some(Ok(rule))) if rule.is_empty() => {
            push("allow_topics", "names no topic".to_owned());
            None
        }
        (_, Some(Ok(rule))) => Some(rule),
        (_, Some(Err(why))) => {
            push("allow_topics", why);
            None
        }
        (false, None) => None,
    }
}

/// A URL template as errors show it: without a user and password, and its query as `?...` (either may hold a
/// credential).
fn shown_template(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let rest = match rest[..authority_end].rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    let shown = match rest.split_once('?') {
        Some((before, _)) => format!("{before}?..."),
        None => rest.to_owned(),
    };
    if scheme.is_empty() { shown } else { format!("{scheme}://{shown}") }
}

/// A target's name: 1 to 64 of `a-z A-Z 0-9 _ - .`.
fn target_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
}

/// The least a lease outlasts the longest `timeout` by (`[outbox] lease`): time to record the answer.
pub const MIN_LEASE_MARGIN: Duration = Duration::from_secs(5);

/// A Kafka topic name: 1 to 249 characters of `a-z A-Z 0-9 . _ -`, not `.` or `..` (Kafka's own rule,
/// `org.apache.kafka.common.internals.Topic`).
pub fn kafka_topic(name: &str) -> bool {
    (1..=249).contains(&name.len()) && name != "." && name != ".." && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// `retry`'s default.
const DEFAULT_RETRY: [Statuses; 5] = [
    Statuses { from: 408, to: 408 },
    Statuses { from: 409, to: 409 },
    Statuses { from: 425, to: 425 },
    Statuses { from: 429, to: 429 },
    Statuses { from: 500, to: 599 },
];

impl HttpTarget {
    /// The parameter names its templates use.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        let body: Vec<&str> = match &self.body {
            Body::Json(t) => t.params(),
            Body::Payload => Vec::new(),
        };
        self.url.params().chain(self.headers.iter().flat_map(|(_, a)| a.params())).chain(body)
    }

    /// The URL's host and port when no placeholder is in them (what `check` tries to connect to; a secret URL is
    /// read for it).
    pub fn fixed_host(&self) -> Option<(String, u16)> {
        let sample: String = match &self.secret_url {
            Some(secret) => secret.resolve().ok()?,
            None => self.url.0.iter().map(|p| match p {
                Piece::Text(t) => t.as_str(),
                Piece::Param(_) => MARK,
            }).collect(),
        };
        // A placeholder in the port does not parse; one in the host shows in it.
        let u = url::Url::parse(&sample).ok()?;
        let host = u.host_str().filter(|h| !h.contains(MARK))?;
        Some((host.to_owned(), u.port_or_known_default()?))
    }

    /// What looks like a credential written in clear in it ([`super::secret::warnings`]), as `(field, warning)`
    /// with the field under the target's own.
    pub fn warnings(&self) -> Vec<(String, String)> {
        let url = self.url.literal().filter(|_| self.secret_url.is_none());
        let headers: Vec<(&str, bool)> = self.headers.iter().map(|(n, a)| (n.as_str(), a.literal().is_some())).collect();
        let body = match &self.body {
            Body::Json(t) => t.literal_credentials(""),
            Body::Payload => Vec::new(),
        };
        super::secret::warnings(url.as_deref(), &headers, &body)
    }

    /// The secrets it reads when a request is sent (the URL, headers, body values), each with where it is used.
    pub fn secrets(&self) -> Vec<(String, &SecretRef)> {
        let url = self.secret_url.iter().map(|s| ("url".to_owned(), s));
        let headers = self.secret_headers.iter().map(|(n, s)| (format!("headers.{n}"), s));
        let body: Vec<&SecretRef> = match &self.body {
            Body::Json(t) => t.secrets(),
            Body::Payload => Vec::new(),
        };
        url.chain(headers).chain(body.into_iter().map(|s| ("body".to_owned(), s))).collect()
    }
}

impl KafkaTarget {
    /// The parameter names its templates use.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        let value: Vec<&str> = match &self.value {
            Body::Json(t) => t.params(),
            Body::Payload => Vec::new(),
        };
        self.topic.params().chain(self.key.iter().flat_map(Arg::params)).chain(self.headers.iter().flat_map(|(_, a)| a.params())).chain(value)
    }

    /// The secrets it reads when a record is produced (headers, value), each with where it is used.
    pub fn secrets(&self) -> Vec<(String, &SecretRef)> {
        let headers = self.secret_headers.iter().map(|(n, s)| (format!("headers.{n}"), s));
        let value: Vec<&SecretRef> = match &self.value {
            Body::Json(t) => t.secrets(),
            Body::Payload => Vec::new(),
        };
        headers.chain(value.into_iter().map(|s| ("value".to_owned(), s))).collect()
    }
}

impl OutboxSpec {
    /// Every secret its targets read, as `(field, secret)` with the field in the pipeline file's words
    /// (`sink.http.headers.Authorization`): checked at start ([`OutboxSpec::unreadable_secrets`]) and by `check`.
    pub fn secrets(&self) -> Vec<(String, &SecretRef)> {
        let http = self.http.iter().enumerate().flat_map(|(i, t)| {
            let at = if self.http.len() > 1 { format!("sink.http[{i}]") } else { "sink.http".to_owned() };
            t.secrets().into_iter().map(move |(f, s)| (format!("{at}.{f}"), s))
        });
        let kafka = self.kafka.iter().enumerate().flat_map(|(i, t)| {
            let at = if self.kafka.len() > 1 { format!("sink.kafka[{i}]") } else { "sink.kafka".to_owned() };
            t.secrets().into_iter().map(move |(f, s)| (format!("{at}.{f}"), s))
        });
        http.chain(kafka).collect()
    }

    /// The secrets that cannot be read now, or cannot go where they are used (a header value with a control
    /// character, a URL that is not http or https), each as `(field, why)` (never a value).
    pub fn unreadable_secrets(&self) -> Vec<(String, String)> {
        let usable = |field: &str, value: &str| {
            if field.contains(".headers.") && reqwest::header::HeaderValue::from_str(value).is_err() {
                return Err("is not a header value (a control character)");
            }
            let url_ok = || url::Url::parse(value).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some());
            if field.ends_with(".url") && !url_ok() {
                return Err("is not an http or https URL with a host");
            }
            Ok(())
        };
        self.secrets()
            .into_iter()
            .filter_map(|(field, s)| {
                let why = match s.resolve() {
                    Err(why) => why,
                    Ok(value) => format!("the secret of {} {}", s.describe(), usable(&field, &value).err()?),
                };
                Some((field, why))
            })
            .collect()
    }

    /// What looks like a credential written in clear in its targets, as `(field, warning)`.
    pub fn warnings(&self) -> Vec<(String, String)> {
        self.http
            .iter()
            .enumerate()
            .flat_map(|(i, t)| {
                let at = if self.http.len() > 1 { format!("sink.http[{i}]") } else { "sink.http".to_owned() };
                t.warnings().into_iter().map(move |(f, w)| (format!("{at}.{f}"), w))
            })
            .collect()
    }
}

fn status(v: &toml::Value) -> Option<Statuses> {
    match v {
        toml::Value::Integer(i) if (100..=599).contains(i) => Some(Statuses { from: *i as u16, to: *i as u16 }),
        toml::Value::String(s) if s.len() == 3 && s.ends_with("xx") => {
            let class = s[..1].parse::<u16>().ok().filter(|c| (1..=5).contains(c))?;
            Some(Statuses { from: class * 100, to: class * 100 + 99 })
        }
        _ => None,
    }
}

/// An HTTP header name (RFC 9110 `token`).
fn token(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Collect(Vec<String>);
    impl Problems for Collect {
        fn push(&mut self, field: &str, message: impl Into<String>) {
            self.0.push(format!("{field}: {}", message.into()));
        }
        fn count(&self) -> usize {
            self.0.len()
        }
    }

    fn param(name: &str) -> Binding {
        Binding {
            name: name.into(),
            source: crate::store::spec::ValueSource::Field(crate::field::FieldPath::parse(&format!("/{name}")).unwrap()),
            default: None,
            optional: false,
            declared: None,
            type_name: None,
            round: false,
            limit: None,
            target_type: None,
        }
    }

    fn raw(text: &str) -> Vec<RawHttp> {
        #[derive(Deserialize)]
        struct Doc {
            http: OneOrMany<RawHttp>,
        }
        toml::from_str::<Doc>(text).unwrap().http.into_vec()
    }

    /// Headers the client sets, the same name twice, and credentials in the URL are refused; a Kafka timeout under
    /// a second too.
    #[test]
    fn colliding_headers_credentials_in_urls_and_short_kafka_timeouts_are_refused() {
        let mut e = Collect(Vec::new());
        let http = raw("[http]\nurl = \"https://user:pw@pay.example/c\"\nheaders = { Content-Type = \"text/plain\", X-A = \"1\", x-a = \"2\", Host = \"h\" }\n");
        #[derive(Deserialize)]
        struct Doc {
            kafka: OneOrMany<RawKafka>,
        }
        let kafka = toml::from_str::<Doc>("[kafka]\ntopic = \"t\"\ntimeout = \"5ms\"\n").unwrap().kafka.into_vec();
        assert!(parse(http, kafka, &[], RawOutbox::default(), &mut e).is_none());
        let text = e.0.join("\n");
        for expected in [
            "sink.http.url: holds a user or password",
            "sink.http.headers.Content-Type: is set by content_type",
            "sink.http.headers.x-a: is set twice",
            "sink.http.headers.Host: is set by the HTTP client",
            "sink.kafka.timeout: must be 1s or more",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from:\n{text}");
        }
    }

    #[test]
    fn url_templates_are_shown_without_credentials() {
        assert_eq!(shown_template("ftp://u:p@x/{nope}?key=s3cret"), "ftp://x/{nope}?...");
        assert_eq!(shown_template("http://h/a"), "http://h/a");
    }

    /// Templates name [sink.params] entries; only those used are taken; every problem names its field.
    #[test]
    fn requests_are_checked_field_by_field() {
        let params = [param("account"), param("amount"), param("unused")];
        let mut e = Collect(Vec::new());
        let spec = parse(
            raw("[http]\nurl = \"https://pay.example/accounts/{account}/charges\"\nbody = { amount = \"{amount}\", note = \"for {account}\" }\n"),
            Vec::new(),
            &params,
            RawOutbox::default(),
            &mut e,
        )
        .unwrap();
        assert!(e.0.is_empty(), "{:?}", e.0);
        assert_eq!(spec.params.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(), ["account", "amount"]);
        assert_eq!(spec.http[0].name, "http");
        assert_eq!(spec.http[0].method, "POST");
        assert_eq!(spec.http[0].fixed_host(), Some(("pay.example".to_owned(), 443)), "a placeholder in the path only");
        let bad = raw(
            "[[http]]\nurl = \"ftp://x/{nope}\"\nmethod = \"P O\"\nsuccess = [200, \"7xx\"]\nheaders = { \"Idempotency-Key\" = \"x\", \"bad name\" = \"y\" }\n\
             [[http]]\nurl = \"http://h/\"\nname = \"http\"\n",
        );
        let mut e = Collect(Vec::new());
        assert!(parse(bad, Vec::new(), &params, RawOutbox::default(), &mut e).is_none());
        let text = e.0.join("\n");
        for expected in [
            "sink.http[0].url: {nope} is used but has no entry in [sink.params]",
            "sink.http[0].url: \"ftp://x/{nope}\": the scheme must be http or https",
            "sink.http[0].method: \"P O\" is not an HTTP method",
            "sink.http[0].success: \"7xx\" is not a status",
            "sink.http[0].headers.Idempotency-Key: is the idempotency key's header",
            "sink.http[0].headers.bad name: \"bad name\" is not a header name",
            "sink.http: two requests have the same name",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from:\n{text}");
        }
    }
}
