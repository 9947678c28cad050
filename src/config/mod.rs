//! Configuration: the worker's settings (`idemflow.toml`) and its pipelines (`pipelines/*.toml`).
//!
//! Settings are read with figment: the TOML file, then environment variables `IDEMFLOW_<SECTION>__<KEY>` (for
//! example `IDEMFLOW_DATABASE__URL`, `IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS`). Only the known top-level sections are
//! taken from the environment; any other `IDEMFLOW_*` variable (orchestrators inject some, such as
//! `IDEMFLOW_PORT` for a service named idemflow) is reported as a warning and ignored, never a failure.

pub mod pipeline;
mod sink;
pub mod schema;

pub use pipeline::{DedupSettings, Pipeline, PipelineError, TombstonePolicy};
use crate::source::kafka::KafkaSettings;
use crate::source::nats::NatsSettings;
use crate::source::rabbitmq::RabbitMqSettings;
use crate::source::rocketmq::RocketMqSettings;
use crate::store::spec::{DatabaseSettings, RedisSettings};
use crate::store::template::Dialect;

use figment::providers::{Format as _, Toml};
use figment::Figment;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Top-level sections that may be set from the environment.
const SECTIONS: [&str; 11] = ["database", "redis", "kafka", "rabbitmq", "rocketmq", "nats", "schema_registry", "metrics", "log", "pipelines", "shutdown"];

/// The worker's settings, from `idemflow.toml` and the environment.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Directory of pipeline files (`*.toml`); a relative path is taken from the settings file's directory.
    #[serde(default = "default_pipelines")]
    pub pipelines: PathBuf,
    /// The database (PostgreSQL, MySQL or MariaDB), for pipelines with a SQL side effect (`[sink] table` or
    /// `sql`; required then).
    pub database: Option<DatabaseSettings>,
    /// Redis, for pipelines whose side effect is Redis commands (`[sink] redis`; required then).
    pub redis: Option<RedisSettings>,
    /// Kafka, for pipelines with a Kafka source (required then).
    #[serde(default)]
    pub kafka: KafkaSettings,
    /// RabbitMQ, for pipelines with a RabbitMQ source (required then).
    pub rabbitmq: Option<RabbitMqSettings>,
    /// RocketMQ, for pipelines with a RocketMQ source (required then).
    pub rocketmq: Option<RocketMqSettings>,
    /// NATS, for pipelines with a NATS JetStream source (required then).
    pub nats: Option<NatsSettings>,
    /// The schema registry, for pipelines whose payloads are in its wire format (`format = "avro"` or
    /// `"json_schema"` without `schema_file`; required then).
    pub schema_registry: Option<crate::schema_registry::RegistrySettings>,
    /// The `/metrics` endpoint.
    #[serde(default)]
    pub metrics: MetricsSettings,
    /// Logging.
    #[serde(default)]
    pub log: LogSettings,
    /// Graceful shutdown.
    #[serde(default)]
    pub shutdown: ShutdownSettings,
}

fn default_pipelines() -> PathBuf {
    PathBuf::from("pipelines")
}

impl Settings {
    /// The stores' settings, as the stores take them ([`crate::store::open::Stores`]).
    pub fn stores(&self) -> crate::store::open::Stores {
        crate::store::open::Stores { database: self.database.clone(), redis: self.redis.clone() }
    }

    /// The brokers' settings, as the sources take them ([`crate::source::spec::Brokers`]).
    pub fn brokers(&self) -> crate::source::spec::Brokers {
        crate::source::spec::Brokers {
            kafka: self.kafka.clone(),
            rabbitmq: self.rabbitmq.clone(),
            rocketmq: self.rocketmq.clone(),
            nats: self.nats.clone(),
            shutdown_timeout: self.shutdown.timeout,
        }
    }
}

/// `[metrics]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSettings {
    /// Address of the HTTP endpoint serving `/metrics`, `/healthz` and `/readyz` (default `127.0.0.1:9464`).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// After how long without progress, while records wait on it, a partition (a queue) counts as stalled: logged
    /// as an error, `/readyz` answers 503, and `idemflow_partition_stalled_seconds` is over it (default 5 minutes;
    /// `"0s"` turns it off).
    #[serde(default = "default_stall_after", with = "humantime_serde")]
    pub stall_after: std::time::Duration,
}

fn default_stall_after() -> std::time::Duration {
    crate::metrics::DEFAULT_STALL_AFTER
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}

impl Default for MetricsSettings {
    fn default() -> Self {
        MetricsSettings { listen: default_listen(), stall_after: default_stall_after() }
    }
}

/// `[log]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    /// `pretty` (for people) or `json` (one object per line, for log shippers).
    #[serde(default)]
    pub format: LogFormat,
    /// A tracing filter directive such as `info` or `idemflow=debug,rdkafka=warn`; `RUST_LOG` overrides it.
    #[serde(default = "default_level")]
    pub level: String,
}

fn default_level() -> String {
    "info".to_owned()
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings { format: LogFormat::default(), level: default_level() }
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Pretty,
    /// JSON lines.
    Json,
}

/// `[shutdown]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownSettings {
    /// How long a graceful shutdown may take (finishing the batch in flight, committing offsets, leaving the
    /// group) before the worker exits anyway with status 1. Default 30s.
    #[serde(default = "default_shutdown_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        ShutdownSettings { timeout: default_shutdown_timeout() }
    }
}

/// Settings as loaded, with what was noticed on the way.
#[derive(Debug)]
pub struct Loaded {
    /// The settings, with `pipelines` resolved against the settings file's directory.
    pub settings: Settings,
    /// Warnings to log once logging is up (ignored environment variables).
    pub warnings: Vec<String>,
}

/// Why the settings could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct SettingsError {
    /// The settings file.
    pub file: String,
    /// What is wrong, with the key path when figment knows it.
    pub message: String,
}

/// Loads settings from `file` and the process environment.
pub fn load_settings(file: &Path) -> Result<Loaded, SettingsError> {
    load_settings_from(file, std::env::vars())
}

/// Loads settings from `file` and the given environment (a seam for tests).
pub fn load_settings_from(
    file: &Path,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Loaded, SettingsError> {
    let err = |message: String| SettingsError { file: file.display().to_string(), message };
    let mut warnings = Vec::new();
    let base = if file.is_file() {
        Figment::new().merge(Toml::file_exact(file))
    } else {
        warnings.push(format!("no settings file at {}: using IDEMFLOW_* environment variables only", file.display()));
        Figment::new()
    };
    let mut known = Vec::new();
    for (name, value) in env {
        let Some(rest) = name.strip_prefix("IDEMFLOW_") else { continue };
        let section = rest.split("__").next().unwrap_or_default().to_ascii_lowercase();
        if SECTIONS.contains(&section.as_str()) {
            known.push((name, value));
        } else {
            warnings.push(format!("ignoring environment variable {name}: {section:?} is not a settings section"));
        }
    }
    // The same nesting as figment's `Env::prefixed("IDEMFLOW_").split("__")`, over the given variables only.
    let from_env: Vec<(String, String)> =
        known.iter().map(|(name, _)| (name["IDEMFLOW_".len()..].to_ascii_lowercase().replace("__", "."), name.clone())).collect();
    let figment = known.into_iter().fold(base, |f, (name, value)| {
        let key = name["IDEMFLOW_".len()..].to_ascii_lowercase().replace("__", ".");
        f.merge(figment::providers::Serialized::default(&key, parse_env_value(&value)))
    });
    let mut settings: Settings = figment.extract().map_err(|e| {
        let text = std::fs::read_to_string(file).ok();
        let located = e.into_iter().map(|e| locate(&e, text.as_deref(), &from_env)).collect::<Vec<_>>().join("; ");
        err(located)
    })?;
    if let Err(e) = tracing_subscriber::EnvFilter::try_new(&settings.log.level) {
        return Err(err(format!("log.level: {:?} is not a tracing filter (e.g. \"info\" or \"info,idemflow=debug\"): {e}", settings.log.level)));
    }
    if settings.pipelines.is_relative() && file.is_file() {
        let base = file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        settings.pipelines = base.join(&settings.pipelines);
    }
    if settings.database.as_ref().is_some_and(|d| d.max_connections == 0) {
        return Err(err("database.max_connections must be at least 1".to_owned()));
    }
    Ok(Loaded { settings, warnings })
}

/// One settings error as `line L, column C: key: problem` when the value comes from the settings file (`text`), or
/// `key (from environment variable IDEMFLOW_...): problem` when it comes from the environment (`from_env` maps
/// dotted keys to variable names). An unknown key is located at the key; a missing one at its section's header.
fn locate(e: &figment::Error, text: Option<&str>, from_env: &[(String, String)]) -> String {
    let mut path: Vec<&str> = e.path.iter().map(String::as_str).skip_while(|k| *k == "default").collect();
    let mut problem = e.kind.to_string();
    let mut at_key = false;
    match &e.kind {
        figment::error::Kind::UnknownField(name, expected) => {
            if path.last() != Some(&name.as_str()) {
                path.push(name);
            }
            at_key = true;
            problem = if path.len() == 1 {
                format!("unknown section (expected one of {})", SECTIONS.map(|s| format!("[{s}]")).join(", "))
            } else {
                format!("unknown key (expected one of {})", expected.join(", "))
            };
        }
        figment::error::Kind::MissingField(name) => {
            path.push(name);
            problem = "missing (it has no default)".to_owned();
        }
        _ => {}
    }
    let key = path.join(".");
    // A value given for a whole section, or for a key that can hold a credential, is never echoed.
    let secret = path.len() <= 1 || path.iter().any(|k| *k == "url" || *k == "properties" || crate::secret::is_secret_name(k));
    if secret {
        let found = |actual: &figment::error::Actual| match actual {
            figment::error::Actual::Str(_) => "a string (not shown)".to_owned(),
            figment::error::Actual::Signed(_) | figment::error::Actual::Unsigned(_) => "an integer (not shown)".to_owned(),
            figment::error::Actual::Float(_) => "a number (not shown)".to_owned(),
            other => kind_of(other).to_string(),
        };
        match &e.kind {
            figment::error::Kind::InvalidType(actual, expected) => problem = format!("invalid type: found {}, expected {expected}", found(actual)),
            figment::error::Kind::InvalidValue(actual, expected) => problem = format!("invalid value: found {}, expected {expected}", found(actual)),
            _ => {}
        }
    }
    if let Some((_, var)) = from_env.iter().find(|(k, _)| *k == key || key.starts_with(&format!("{k}."))) {
        return format!("{key} (from environment variable {var}): {problem}");
    }
    let at = text.and_then(|t| position(t, &path, at_key).map(|offset| pipeline::line_column(t, offset)));
    match at {
        Some((line, column)) => format!("line {line}, column {column}: {key}: {problem}"),
        None if key.is_empty() => problem,
        None => format!("{key}: {problem}"),
    }
}

/// What kind of value `actual` is, without the value.
fn kind_of(actual: &figment::error::Actual) -> &'static str {
    use figment::error::Actual;
    match actual {
        Actual::Bool(_) => "a boolean",
        Actual::Char(_) => "a character",
        Actual::Bytes(_) => "bytes",
        Actual::Unit => "nothing",
        Actual::Option => "an option",
        Actual::Seq => "a sequence",
        Actual::Map => "a table",
        _ => "a value",
    }
}

/// The byte offset of `path` in a TOML text: the value of a present key (its key with `at_key`, or when the value
/// has no span), or the header of the deepest table present (for a missing key).
fn position(text: &str, path: &[&str], at_key: bool) -> Option<usize> {
    let doc = toml_edit::ImDocument::parse(text).ok()?;
    let mut table: &dyn toml_edit::TableLike = doc.as_table();
    let mut found = None;
    for (i, k) in path.iter().enumerate() {
        let Some(item) = table.get(k) else { break };
        let key_span = || table.key(k).and_then(|key| key.span());
        let span = if at_key && i + 1 == path.len() { key_span().or_else(|| item.span()) } else { item.span().or_else(key_span) };
        found = span.map(|r| r.start).or(found);
        if i + 1 == path.len() {
            return found;
        }
        match item.as_table_like() {
            Some(t) => table = t,
            None => break,
        }
    }
    found
}

/// Environment values are strings; numbers and booleans are typed the way figment's `Env` types them.
fn parse_env_value(value: &str) -> figment::value::Value {
    value.parse::<figment::value::Value>().unwrap_or_else(|_| figment::value::Value::from(value.to_owned()))
}

/// Loads and validates every `*.toml` file in `dir`, sorted by name, for a PostgreSQL store. Returns all errors of
/// all files at once.
pub fn load_pipelines(dir: &Path) -> Result<Vec<Pipeline>, Vec<PipelineError>> {
    load_pipelines_in(dir, Dialect::Postgres)
}

/// The pipelines of `settings` (`settings.pipelines`), their SQL scanned by the rules of the store that
/// `[database] url` names ([`Dialect::of_url`]).
pub fn load_pipelines_for(settings: &Settings) -> Result<Vec<Pipeline>, Vec<PipelineError>> {
    let (pipelines, errors) = load_some_pipelines_for(settings);
    if errors.is_empty() {
        Ok(pipelines)
    } else {
        Err(errors)
    }
}

/// [`load_pipelines`], for a store whose SQL follows `dialect`.
pub fn load_pipelines_in(dir: &Path, dialect: Dialect) -> Result<Vec<Pipeline>, Vec<PipelineError>> {
    let (pipelines, errors) = load_pipelines_partly(dir, dialect);
    if errors.is_empty() {
        Ok(pipelines)
    } else {
        Err(errors)
    }
}

/// The pipelines of `settings` that load, and the problems of those that do not (and of names or sources two
/// files share): `idemflow check` goes on with the first to report every file's problems in one run.
pub fn load_some_pipelines_for(settings: &Settings) -> (Vec<Pipeline>, Vec<PipelineError>) {
    let dialect = settings.database.as_ref().map_or(Dialect::Postgres, |d| Dialect::of_url(d.url.expose()));
    let (mut pipelines, mut errors) = load_pipelines_partly(&settings.pipelines, dialect);
    attach_registry(settings, &mut pipelines, &mut errors);
    (pipelines, errors)
}

/// Gives the pipelines whose payloads are in the schema registry's wire format the registry of `settings`, one
/// client and one schema cache for all ([`crate::decode::schemas::Schemas`]). A pipeline that needs it when there
/// is no `[schema_registry]`, or when its settings are wrong, is an error (and is left out).
pub fn attach_registry(settings: &Settings, pipelines: &mut Vec<Pipeline>, errors: &mut Vec<PipelineError>) {
    let needs = |p: &Pipeline| p.decoder.needs_registry() || p.key_decoder.as_ref().is_some_and(crate::decode::Decoder::needs_registry);
    if !pipelines.iter().any(needs) {
        return;
    }
    let registry = match &settings.schema_registry {
        None => Err("no [schema_registry] in the settings: set its url, or name an Avro schema_file in the pipeline".to_owned()),
        Some(r) => crate::schema_registry::SchemaRegistry::new(r)
            .map(|registry| crate::decode::schemas::Schemas::new(registry, r.missing_schema_wait))
            .map_err(|why| format!("[schema_registry] {why}")),
    };
    pipelines.retain_mut(|p| {
        if !needs(p) {
            return true;
        }
        match &registry {
            Ok(schemas) => {
                if p.decoder.needs_registry() {
                    p.decoder = p.decoder.clone().with_registry(schemas.clone());
                }
                if let Some(k) = p.key_decoder.as_mut().filter(|k| k.needs_registry()) {
                    *k = k.clone().with_registry(schemas.clone());
                }
                true
            }
            Err(why) => {
                let (field, format) = match &p.key_decoder {
                    Some(k) if k.needs_registry() && !p.decoder.needs_registry() => ("key.record_key_format", k.format()),
                    _ => ("format", p.decoder.format()),
                };
                errors.push(dup_error(p, field, format!("format {:?} reads the schema registry's wire format: {why}", format.name())));
                false
            }
        }
    });
}

fn load_pipelines_partly(dir: &Path, dialect: Dialect) -> (Vec<Pipeline>, Vec<PipelineError>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            return (Vec::new(), vec![PipelineError {
                file: dir.display().to_string(),
                pipeline: String::new(),
                field: String::new(),
                message: format!("cannot read the pipelines directory: {e}"),
            }])
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml") && p.is_file())
        .collect();
    files.sort();
    let mut pipelines = Vec::new();
    let mut errors = Vec::new();
    for file in &files {
        match pipeline::load_file_in(file, dialect) {
            Ok(p) => pipelines.push(p),
            Err(mut e) => errors.append(&mut e),
        }
    }
    if files.is_empty() {
        errors.push(PipelineError {
            file: dir.display().to_string(),
            pipeline: String::new(),
            field: String::new(),
            message: "no pipeline files (*.toml) in the pipelines directory".to_owned(),
        });
    }
    let mut seen: Vec<&Pipeline> = Vec::new();
    for p in &pipelines {
        for other in &seen {
            let file = other.file.display();
            if other.name == p.name {
                errors.push(dup_error(p, "name", format!("{:?} is also the name in {file}", p.name)));
                continue;
            }
            if let Some(c) = p.source.conflict_with(&other.source) {
                errors.push(dup_error(p, c.field, format!("{} {file}{}", c.what, c.why)));
            }
        }
        seen.push(p);
    }
    (pipelines, errors)
}

/// Checks that every pipeline's source has its broker settings: `[kafka] bootstrap_servers` for a Kafka source,
/// `[rabbitmq] url` for a RabbitMQ one. Errors name the pipeline's file and the missing section.
pub fn check_sources(settings: &Settings, pipelines: &[Pipeline]) -> Result<(), Vec<PipelineError>> {
    let mut errors = Vec::new();
    let (brokers, stores) = (settings.brokers(), settings.stores());
    for p in pipelines {
        let missing = p.source.settings_missing(&brokers);
        if let Some(message) = missing {
            errors.push(dup_error(p, "source", message.to_owned()));
        }
        let store = stores.settings_missing(p.sink.store());
        if let Some(message) = store {
            errors.push(dup_error(p, "sink", message.to_owned()));
        }
        if let Err(why) = p.source.built() {
            errors.push(dup_error(p, "source.kind", why));
        }
        if let Err(why) = settings.stores().built(p.sink.store()) {
            errors.push(dup_error(p, "sink", why));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn dup_error(p: &Pipeline, field: &str, message: String) -> PipelineError {
    PipelineError { file: p.file.display().to_string(), pipeline: p.name.clone(), field: field.to_owned(), message }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> PathBuf {
        let file = dir.join("idemflow.toml");
        std::fs::write(&file, text).unwrap();
        file
    }

    const MINIMAL: &str = "[database]\nurl = \"postgres://u:secret@h/db\"\n[kafka]\nbootstrap_servers = \"k:9092\"\n";

    #[test]
    fn env_overrides_known_sections_and_warns_on_others() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), MINIMAL);
        let env = [
            ("IDEMFLOW_DATABASE__MAX_CONNECTIONS", "3"),
            ("IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS", "other:9092"),
            ("IDEMFLOW_PORT", "tcp://10.0.0.1:9464"),
            ("UNRELATED", "x"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let loaded = load_settings_from(&file, env).unwrap();
        assert_eq!(loaded.settings.database.as_ref().unwrap().max_connections, 3);
        assert_eq!(loaded.settings.kafka.bootstrap_servers, "other:9092");
        assert_eq!(loaded.settings.pipelines, dir.path().join("pipelines"));
        assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
        assert!(loaded.warnings[0].contains("IDEMFLOW_PORT"));
    }

    #[test]
    fn secrets_are_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let loaded = load_settings_from(&write(dir.path(), MINIMAL), []).unwrap();
        let shown = format!("{:?}", loaded.settings);
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("postgres://u:***@h/db"), "{shown}");
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), &format!("{MINIMAL}[metrics]\nlisten = \"nowhere\"\n"));
        let e = load_settings_from(&file, []).unwrap_err().to_string();
        assert!(e.contains("idemflow.toml") && e.contains("metrics.listen"), "{e}");
        let file = write(dir.path(), &format!("{MINIMAL}[log]\nformt = \"json\"\n"));
        let e = load_settings_from(&file, []).unwrap_err().to_string();
        assert!(e.contains("formt"), "{e}");
    }
}
