//! What a pipeline's store is given: the `[database]` and `[redis]` settings, and the side effect of a pipeline
//! (`[sink]`: the table form, SQL statements, batch SQL or Redis commands) with the values it binds.

use crate::field::FieldPath;
use crate::secret::SecretUrl;
use crate::store::template::Statement;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// `[database]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// A libpq-style URL, `postgres://user:password@host:port/dbname`. Never printed: `Debug` redacts it.
    pub url: SecretUrl,
    /// Size of the connection pool. Each pipeline holds at most `batch.concurrency` connections at a time (its
    /// batch transactions, 1 by default), so their sum + 1 (retention) is enough; fewer works too, transactions
    /// then take turns.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// How long to wait for a pooled connection before the attempt counts as failed and is retried.
    #[serde(default = "default_acquire_timeout", with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// Whether statements are prepared once per connection and reused (named prepared statements, the
    /// default), or parsed for each execution (unnamed statements). Set `false` when connecting through a
    /// transaction-pooling proxy that hands each transaction a different server session, such as PgBouncer with
    /// `pool_mode = transaction` before version 1.21: named statements then collide (`prepared statement
    /// "sqlx_s_1" already exists`). With `false`, every database access runs inside a transaction and the
    /// `extra_float_digits` startup parameter is not sent.
    #[serde(default = "default_true")]
    pub prepared_statements: bool,
    /// The longest one batch attempt (its transaction, `COMMIT` included) may take before the worker abandons it,
    /// closing its connection, and retries the batch: bounds a hang on a connection whose packets vanish (a
    /// half-open TCP connection waits for the kernel's retransmission timeout, about 15 minutes). The dedup rows
    /// make the retry safe whether or not the abandoned attempt committed. Each attempt of the same batch that runs
    /// out of it gets twice as long the next time, so a batch that is merely slow still commits. Default 2 minutes;
    /// `"0s"` turns it off.
    #[serde(default = "default_batch_timeout", with = "humantime_serde")]
    pub batch_timeout: Duration,
}

/// How long a batch transaction may sit idle between two of its statements before the server ends its session
/// (PostgreSQL `idle_in_transaction_session_timeout`, MariaDB `idle_transaction_timeout`), unless the server is set
/// to a shorter time. A worker sends a batch's statements back to back, so the gap it leaves is its own stall; a
/// worker whose host vanished (power lost, a network cut: no FIN, no RST) would otherwise leave its transaction
/// open, holding the batch's dedup, processed-mark and offset row locks, until TCP gave up on the connection (over
/// two hours with Linux's defaults), and the partition's next owner would wait as long. Should a live worker stall
/// that long, the server's FATAL (SQLSTATE 25P03) is a lost connection: the batch is retried.
pub const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(15);

/// TCP keepalives of the server's end of a batch's connection (PostgreSQL `tcp_keepalives_idle`, `_interval` and
/// `_count`, unless the server is set to shorter ones): a first probe after this many seconds of silence, then one
/// every [`TCP_KEEPALIVE_INTERVAL_SECS`], [`TCP_KEEPALIVE_COUNT`] unanswered in all: a server session whose worker
/// vanished while a statement ran (a lock wait) is ended within about 30 seconds of the last packet, instead of
/// when the kernel's defaults give up (over two hours). The server notices the dead connection at
/// `client_connection_check_interval`, which the batch sets to 1 s (PostgreSQL 14 and later).
pub const TCP_KEEPALIVE_IDLE_SECS: u32 = 15;
/// See [`TCP_KEEPALIVE_IDLE_SECS`].
pub const TCP_KEEPALIVE_INTERVAL_SECS: u32 = 5;
/// See [`TCP_KEEPALIVE_IDLE_SECS`].
pub const TCP_KEEPALIVE_COUNT: u32 = 3;

/// `[database] batch_timeout` when unset.
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(120);

fn default_batch_timeout() -> Duration {
    DEFAULT_BATCH_TIMEOUT
}

fn default_true() -> bool {
    true
}

fn default_max_connections() -> u32 {
    8
}

fn default_acquire_timeout() -> Duration {
    Duration::from_secs(10)
}

/// `[redis]`: the store of the pipelines with `[sink] redis = [...]`. Standalone Redis 7.0 or later, or a
/// Sentinel-managed primary (`sentinels`); Redis Cluster is refused by `check`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSettings {
    /// `redis://[user:password@]host:port/db` (the database number is the path, default 0), `rediss://...` for
    /// TLS (server certificates checked against the system's roots, or `tls_ca_file`), or
    /// `redis+unix:///path/to/socket?db=N`. Never printed: `Debug` and `Display` mask it.
    pub url: SecretUrl,
    /// Prefix of every key idemflow writes: dedup keys (`<prefix><pipeline>:k:<sha256 of the business key>`),
    /// stored positions (`<prefix><pipeline>:offsets`) and the dead-letter stream (`<prefix>dead-letters`).
    /// Default `idemflow:`.
    #[serde(default = "default_redis_prefix")]
    pub key_prefix: String,
    /// How long one connection attempt may take (default 10 s).
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long a command (a batch's script included) may take to answer before the attempt counts as failed and
    /// the batch is retried (default 30 s; a batch's dedup keys make the retry safe).
    #[serde(default = "default_redis_response_timeout", with = "humantime_serde")]
    pub response_timeout: Duration,
    /// Redis Sentinel: the sentinels' `host:port` addresses. With them the primary's address is asked of the
    /// sentinels (`SENTINEL GET-MASTER-ADDR-BY-NAME`, Redis documentation "High availability with Redis Sentinel")
    /// when the worker connects, and again after a lost connection or a `READONLY` answer (a failover); `url`'s host
    /// and port are then not used, its user, password, database number and TLS are.
    #[serde(default)]
    pub sentinels: Vec<String>,
    /// The name the sentinels monitor the primary by (`sentinel monitor <name> ...`); required with `sentinels`.
    #[serde(default)]
    pub sentinel_master: Option<String>,
    /// With `rediss://`: a PEM file of CA certificates to trust for the server's certificate, for a private CA.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// With `rediss://`: a PEM client certificate for servers that require one (`tls-auth-clients yes`); with
    /// `tls_key_file`.
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// The client certificate's private key, PEM.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
}

fn default_redis_prefix() -> String {
    "idemflow:".to_owned()
}

fn default_redis_response_timeout() -> Duration {
    Duration::from_secs(30)
}

/// The side effect of a pipeline, in the form of the store it runs in: each store is handed its own form only
/// ([`crate::store::Store::prepare_side_effect`] refuses the other).
#[derive(Clone, Debug)]
pub enum SinkSpec {
    /// Statements run in the batch's transaction in the database of `[database]` (PostgreSQL, MySQL/MariaDB).
    Sql(SqlEffect),
    /// Redis commands run by the batch's script in Redis (`[redis]`).
    Redis(RedisEffect),
}

/// A side effect in SQL, run in the batch's transaction: the table, `sql` and `batch_sql` forms of `[sink]`.
#[derive(Clone, Debug)]
pub enum SqlEffect {
    /// A generated set-based `INSERT` of all new records of a batch in one statement.
    Table {
        /// The target table as written (`payments` or `schema.payments`).
        table: String,
        /// Target columns and the values that fill them.
        columns: Vec<Binding>,
        /// What a conflict with an existing business row does.
        on_conflict: OnConflict,
        /// Conflict target for `on_conflict = "update"`; `None`: the table's primary key.
        conflict_columns: Option<Vec<String>>,
    },
    /// Statements with named parameters, run for each new record, in order, inside the batch transaction.
    PerRecord {
        /// The statements, parameters already located.
        statements: Vec<Statement>,
        /// The value of each named parameter.
        params: Vec<Binding>,
        /// `[sink] allow_procedures`: MySQL/MariaDB run `CALL` statements (a procedure may end the batch
        /// transaction, which is checked before each `COMMIT`). PostgreSQL always allows `CALL`: it refuses
        /// transaction control in a procedure called inside a transaction block.
        allow_procedures: bool,
    },
    /// Statements run once per batch over the batch's new records as the relation `new_records` (`[sink]
    /// batch_sql`, PostgreSQL only): set-based, so a batch costs one round trip per statement whatever its size.
    BatchSql {
        /// The statements, without parameters (they read `new_records`).
        statements: Vec<Statement>,
        /// The columns of `new_records`, in order, each with its PostgreSQL type in [`Binding::type_name`].
        columns: Vec<Binding>,
    },
}

/// Redis commands run for each new record, in order, by the batch's script in Redis (`[sink] redis`).
#[derive(Clone, Debug)]
pub struct RedisEffect {
    /// The commands, placeholders located.
    pub commands: Vec<RedisCommand>,
    /// The value of each placeholder.
    pub params: Vec<Binding>,
}

use super::redis_command::RedisCommand;

/// Which store a side effect runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// The database of `[database]` (the table and SQL forms).
    Database,
    /// Redis (`[redis]`).
    Redis,
}

impl SinkSpec {
    /// The store this side effect runs in.
    pub fn store(&self) -> StoreKind {
        match self {
            SinkSpec::Sql(_) => StoreKind::Database,
            SinkSpec::Redis(_) => StoreKind::Redis,
        }
    }

    /// The values the side effect binds, with the `[sink]` table that declares them (`sink.columns` or
    /// `sink.params`).
    pub fn bindings(&self) -> (&'static str, &[Binding]) {
        match self {
            SinkSpec::Sql(SqlEffect::Table { columns, .. }) => ("sink.columns", columns),
            SinkSpec::Sql(SqlEffect::PerRecord { params, .. }) | SinkSpec::Redis(RedisEffect { params, .. }) => ("sink.params", params),
            SinkSpec::Sql(SqlEffect::BatchSql { columns, .. }) => ("sink.params", columns),
        }
    }
}

/// `on_conflict` of the table form.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnConflict {
    /// A conflicting business row is an error for that record (dead-lettered as `side_effect_rejected`).
    #[default]
    Error,
    /// A conflicting business row is left as it is.
    Nothing,
    /// A conflicting business row is updated with the new values (`ON CONFLICT (...) DO UPDATE`).
    Update,
}

/// A named value bound into the side effect: a column of the table form or a parameter of the SQL form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// Column or parameter name.
    pub name: String,
    /// Where the value comes from.
    pub source: ValueSource,
    /// Text used when the value is missing or null.
    pub default: Option<String>,
    /// Whether a missing or null value binds NULL (`true`) or dead-letters the record as `param_missing`.
    pub optional: bool,
    /// `type = ...`: the target's type, for the SQL form on a store that does not infer parameter types (MySQL and
    /// MariaDB). PostgreSQL reads every parameter's type from the statement and ignores it.
    pub declared: Option<DeclaredType>,
    /// `type = ...` of a `batch_sql` column: the PostgreSQL type of that column of `new_records` as written
    /// (`numeric`, `timestamptz`, `jsonb`); `None` is `text`. Resolved by the server when the pipeline starts.
    pub type_name: Option<String>,
    /// `round = true` on a column of the table form: its column may round the value (`numeric(12, 2)`,
    /// `timestamptz(0)`); otherwise a value it would change is refused ([`crate::rounding`]).
    pub round: bool,
    /// What the target column keeps of a value, where it would round the rest: set by the store when the pipeline
    /// starts (the table form), never from the file.
    pub limit: Option<crate::rounding::Limit>,
    /// The target's type as its store names it (`numeric`, `timestamp with time zone`, `bytea`; MySQL's
    /// `DATA_TYPE`): set by the store when the pipeline starts, for `check` ([`TargetKind::of`]); `None` where the
    /// store does not say (the SQL form on MySQL and MariaDB, Redis).
    pub target_type: Option<String>,
}

/// What kind of value a target type takes, for `check`'s comparison with the field types of a payload's schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetKind {
    /// Numbers (`numeric`, `integer`, `double precision`; MySQL's `DECIMAL`, `INT`, ...).
    Number,
    /// `boolean`.
    Boolean,
    /// Dates and times (`timestamptz`, `timestamp`, `date`, `time`; MySQL's `DATETIME`, `TIMESTAMP`, ...).
    Instant,
    /// Arrays (`text[]`, ...).
    Array,
    /// Anything that takes text (`text`, `varchar`, `jsonb`, `bytea`, `uuid`, enums, ...).
    Text,
}

impl TargetKind {
    /// The kind of the type named `name` (PostgreSQL's `format_type`, or MySQL's `DATA_TYPE`).
    pub fn of(name: &str) -> TargetKind {
        let name = name.to_ascii_lowercase();
        if name.ends_with("[]") {
            return TargetKind::Array;
        }
        match name.as_str() {
            "numeric" | "decimal" | "integer" | "bigint" | "smallint" | "real" | "double precision" | "tinyint" | "mediumint" | "int"
            | "float" | "double" => TargetKind::Number,
            "boolean" => TargetKind::Boolean,
            n if n.starts_with("timestamp") || n.starts_with("time ") || matches!(n, "date" | "time" | "datetime") => TargetKind::Instant,
            _ => TargetKind::Text,
        }
    }
}

/// A parameter's declared target type (`type = "decimal" | "integer" | "timestamp" | "datetime" | "json"` in
/// `[sink.params]`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DeclaredType {
    /// An exact number: on MySQL the parameter is `CAST(? AS DECIMAL(65, 30))`, so arithmetic and comparisons with
    /// it are exact (a text parameter in an expression is converted to a floating-point DOUBLE by MySQL).
    Decimal,
    /// An integer: on MySQL `CAST(? AS SIGNED)`, exact beyond 2^53 in comparisons and arithmetic.
    Integer,
    /// A MySQL `TIMESTAMP`: a value with a UTC offset is converted to UTC ([`crate::field::Render::UtcWallClock`]).
    Timestamp,
    /// A MySQL `DATETIME`: a value with a UTC offset is converted to the pipeline's `time_zone`.
    Datetime,
    /// A `JSON` column: the value's JSON text, a string quoted.
    Json,
}

impl DeclaredType {
    /// How a value of this type is rendered.
    pub fn render(self) -> crate::field::Render {
        match self {
            DeclaredType::Timestamp => crate::field::Render::UtcWallClock,
            DeclaredType::Datetime => crate::field::Render::LocalWallClock,
            DeclaredType::Json => crate::field::Render::Json,
            DeclaredType::Decimal | DeclaredType::Integer => crate::field::Render::Numeric,
        }
    }
}

/// Where a bound value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueSource {
    /// A field of the payload.
    Field(FieldPath),
    /// The Kafka record key (UTF-8).
    RecordKey,
    /// A Kafka header's value (UTF-8; the last header with this name).
    Header(String),
    /// A message property (RabbitMQ's `message_id`, `correlation_id`, ...: see [`crate::record::PROPERTIES`]).
    Property(String),
    /// Something about the record rather than in it.
    Meta(Meta),
}

/// Record metadata that can be bound.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Meta {
    /// The topic name.
    Topic,
    /// The partition number.
    Partition,
    /// The record's offset.
    Offset,
    /// The record timestamp as RFC 3339 UTC text with milliseconds (bind it to `timestamptz`).
    Timestamp,
    /// The business key's canonical text.
    BusinessKey,
}

/// What a [`Meta`] value looks like, for `check`'s trial of whether its target can take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaSample {
    /// The name as a pipeline file writes it (`meta = "timestamp"`).
    pub name: &'static str,
    /// A value of the shape every record gives, as text before any rendering for its target.
    pub text: &'static str,
    /// What the value is, in words.
    pub what: &'static str,
}

impl Meta {
    /// A value of this metadata's shape; `None` for the business key, whose shape is the payload's.
    pub fn sample(self) -> Option<MetaSample> {
        let (name, text, what) = match self {
            Meta::Topic => ("topic", "orders", "the topic's name"),
            Meta::Partition => ("partition", "0", "the partition number"),
            Meta::Offset => ("offset", "0", "the record's offset"),
            Meta::Timestamp => ("timestamp", "2026-12-04T10:00:00.000Z", "the record's timestamp as RFC 3339 text"),
            Meta::BusinessKey => return None,
        };
        Some(MetaSample { name, text, what })
    }
}

/// `[sink] time_zone` and `naive_timestamps`: how time values meet `timestamptz` and `timestamp` targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimeSettings {
    /// The IANA time zone (as PostgreSQL's `TimeZone` setting names it: `UTC`, `Europe/Berlin`) in which a value
    /// without a UTC offset is read for a `timestamptz` target, and into which a value with an offset is converted
    /// for a `timestamp` (without time zone) target. Default `UTC`. Set for each batch with `SET LOCAL TIME ZONE`,
    /// so the database's or the role's own setting plays no part.
    pub zone: String,
    /// What a value without a UTC offset for a `timestamptz` target does.
    pub naive: NaiveTimestamps,
}

impl Default for TimeSettings {
    fn default() -> Self {
        TimeSettings { zone: "UTC".to_owned(), naive: NaiveTimestamps::default() }
    }
}

/// `[sink] naive_timestamps`: what a value without a UTC offset (`2024-03-10T02:30:00`) does when its target is
/// `timestamptz`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NaiveTimestamps {
    /// It is read in `time_zone` (default UTC). In a zone with daylight saving time, a local time in the spring
    /// gap or the autumn overlap is resolved as PostgreSQL resolves it.
    #[default]
    TimeZone,
    /// The record is dead-lettered (`param_invalid`): the producer must say which instant it means.
    DeadLetter,
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}
