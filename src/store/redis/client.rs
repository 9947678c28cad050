//! Redis as a store whose side effect is Redis itself (`[sink] redis = [...]`, `[redis] url`).
//!
//! A Redis dedup key cannot share a transaction with a write to another database, so the only honest Redis
//! pipeline is one whose effect is in Redis too. Each batch is one Lua script ([`batch`]), loaded once and run
//! with `EVALSHA` (reloaded after `NOSCRIPT`); Redis runs a script atomically, with no other command in between
//! (Redis documentation, "Scripting with Lua"). The script checks the batch's stored positions (fenced by owner
//! epochs), claims each record's dedup key with `SET key value NX PX retention` (insert-then-check), runs the
//! record's commands only for a new key, writes dead letters to a stream, and stores the new positions last.
//!
//! Keys, under `[redis] key_prefix` (default `idemflow:`):
//! - `<prefix><pipeline>:k:<hex SHA-256 of the business key>`: the dedup key, a string
//!   `A|applied ms|duplicates|last duplicate ms|partition|offset|payload SHA-256 hex|topic` (`D|...` when some of
//!   the record's commands ran before one failed), expiring after `[dedup] retention`;
//! - `<prefix><pipeline>:offsets`: a hash `topic/partition` -> `epoch next-offset` (`-` before the first batch);
//!   `<prefix><pipeline>:owners`: who claimed each partition;
//! - `<prefix>dead-letters`: a stream of dead letters, entry ids `N-0` with `N` from `<prefix>dead-letters:seq`;
//!   `<prefix><pipeline>:dl:topic/partition/offset`: the dead letter of a Kafka position (a redelivered record is
//!   not dead-lettered twice), expiring with the dedup keys.
//!
//! What Redis does not give, and what idemflow does instead:
//! - no rollback: a command that fails inside the script leaves the record's earlier commands applied. Arity is
//!   checked against the server (`COMMAND INFO`) by `check` and at start, numbers before the script runs; a record
//!   whose command fails is dead-lettered with the count of its commands that took effect, its dedup key marked so
//!   that no copy runs them again, and a replay runs only the rest.
//! - durability is the server's: with `appendfsync everysec` a crash loses up to about a second of writes. The
//!   positions are written by the same script, so they are lost together with the effects; the script notices
//!   that a position it was shown is gone ("lost") and the worker resumes those partitions from what Redis kept.
//!   A queue source (RabbitMQ) has no position to resume from: `check` warns unless `appendfsync always`.


use crate::store::contract::NotReady;
use crate::store::spec::RedisSettings;
use crate::key::BusinessKey;
use crate::store::rows::Explained;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// A connection to one Redis server, shared by the pipelines that write to it. Cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    settings: Arc<RedisSettings>,
    /// The connection (multiplexed, reconnecting), and with Sentinel the primary's address it was made for.
    conn: Arc<tokio::sync::RwLock<Option<Current>>>,
    prefix: String,
    /// Per `(pipeline, "topic/partition")`, the position this worker last stored or claimed: what each batch expects
    /// to find, so that writes Redis lost are noticed (see [`batch`]).
    expected: Arc<Mutex<HashMap<(String, String), (i64, String)>>>,
}

/// The connection in use.
struct Current {
    /// With Sentinel: the primary's `(host, port)` the connection is for.
    primary: Option<(String, u16)>,
    manager: ConnectionManager,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

/// The oldest Redis this store runs on: 7.0, from which an error raised inside a script keeps its code (`OOM`,
/// `READONLY`, `NOPERM`; before, every one was `ERR Error running script`), which the retries depend on.
const MIN_VERSION: (u32, u32) = (7, 0);

/// A client for `settings.url` with its TLS files, at `primary` instead of the URL's host and port when given (the
/// address Sentinel named).
///
/// Errors: the URL does not parse, or a TLS file cannot be read.
fn client(settings: &RedisSettings, primary: Option<&(String, u16)>) -> Result<redis::Client, String> {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    let scrub = |e: redis::RedisError| format!("redis.url: {}", settings.url.scrub(&e.to_string()));
    let mut info = settings.url.expose().into_connection_info().map_err(scrub)?;
    if let Some((host, port)) = primary {
        let addr = match info.addr().clone() {
            ConnectionAddr::TcpTls { insecure, tls_params, .. } => ConnectionAddr::TcpTls { host: host.clone(), port: *port, insecure, tls_params },
            _ => ConnectionAddr::Tcp(host.clone(), *port),
        };
        info = info.set_addr(addr);
    }
    let tls_files = settings.tls_ca_file.is_some() || settings.tls_cert_file.is_some() || settings.tls_key_file.is_some();
    if !tls_files {
        return redis::Client::open(info).map_err(scrub);
    }
    let read = |field: &str, path: &std::path::Path| std::fs::read(path).map_err(|e| format!("redis.{field}: {}: {e}", path.display()));
    let root_cert = settings.tls_ca_file.as_deref().map(|p| read("tls_ca_file", p)).transpose()?;
    let client_tls = match (&settings.tls_cert_file, &settings.tls_key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig { client_cert: read("tls_cert_file", cert)?, client_key: read("tls_key_file", key)? }),
        (None, None) => None,
        _ => return Err("redis.tls_cert_file and redis.tls_key_file go together".to_owned()),
    };
    redis::Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert }).map_err(scrub)
}

/// A reconnecting connection for `client` (it connects on first use).
fn manager(settings: &RedisSettings, client: redis::Client) -> Result<ConnectionManager, redis::RedisError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(settings.connect_timeout))
        .set_response_timeout(Some(settings.response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(std::time::Duration::from_secs(2));
    ConnectionManager::new_lazy_with_config(client, config)
}

/// Asks the sentinels, in order, where the primary named `settings.sentinel_master` is.
///
/// Errors: no sentinel answered with an address.
async fn ask_sentinels(settings: &RedisSettings) -> Result<(String, u16), redis::RedisError> {
    let master = settings.sentinel_master.as_deref().unwrap_or_default();
    let mut why = Vec::new();
    for addr in &settings.sentinels {
        let attempt = async {
            let client = redis::Client::open(format!("redis://{addr}/"))?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg(master).query_async::<Option<(String, String)>>(&mut conn).await
        };
        match tokio::time::timeout(settings.connect_timeout, attempt).await {
            Ok(Ok(Some((host, port)))) => match port.parse() {
                Ok(port) => return Ok((host, port)),
                Err(_) => why.push(format!("{addr}: port {port:?}")),
            },
            Ok(Ok(None)) => why.push(format!("{addr}: monitors no primary named {master:?}")),
            Ok(Err(e)) => why.push(format!("{addr}: {e}")),
            Err(_) => why.push(format!("{addr}: no answer in {:?}", settings.connect_timeout)),
        }
    }
    Err(redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        format!("no sentinel named the Redis primary: {}", why.join("; ")),
    )))
}

impl RedisStore {
    /// A store for `settings` that connects on first use (and reconnects after a lost connection, with backoff; with
    /// Sentinel, to the primary the sentinels name).
    ///
    /// Errors: the URL does not parse, a TLS file cannot be read, or `sentinels` without `sentinel_master`.
    pub fn new(settings: &RedisSettings) -> Result<RedisStore, String> {
        crate::install_tls_provider();
        let current = if settings.sentinels.is_empty() {
            Some(Current { primary: None, manager: manager(settings, client(settings, None)?).map_err(|e| e.to_string())? })
        } else if settings.sentinel_master.as_deref().is_none_or(str::is_empty) {
            return Err("redis.sentinel_master: required with redis.sentinels (the name in `sentinel monitor <name> ...`)".to_owned());
        } else {
            client(settings, None)?; // the URL's other parts, checked now
            None
        };
        Ok(RedisStore {
            settings: Arc::new(settings.clone()),
            conn: Arc::new(tokio::sync::RwLock::new(current)),
            prefix: settings.key_prefix.clone(),
            expected: Arc::default(),
        })
    }

    /// A connection handle (multiplexed: clones share one connection). With Sentinel, the first call asks the
    /// sentinels where the primary is.
    ///
    /// Errors: no sentinel named the primary.
    pub(crate) async fn conn(&self) -> Result<ConnectionManager, redis::RedisError> {
        if let Some(c) = &*self.conn.read().await {
            return Ok(c.manager.clone());
        }
        self.follow_primary().await
    }

    /// With Sentinel: asks the sentinels where the primary is and, when it moved (or on the first call), connects
    /// there. Returns the connection.
    async fn follow_primary(&self) -> Result<ConnectionManager, redis::RedisError> {
        let primary = ask_sentinels(&self.settings).await?;
        let mut current = self.conn.write().await;
        if let Some(c) = &*current {
            if c.primary.as_ref() == Some(&primary) {
                return Ok(c.manager.clone());
            }
        }
        let client = client(&self.settings, Some(&primary)).map_err(|why| redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "redis", why)))?;
        let manager = manager(&self.settings, client)?;
        if current.is_some() {
            tracing::warn!(primary = %format!("{}:{}", primary.0, primary.1), "the Redis primary moved (a Sentinel failover): connecting to it");
        }
        *current = Some(Current { primary: Some(primary), manager: manager.clone() });
        Ok(manager)
    }

    /// Called with a failure that may mean the primary moved (a lost connection, `READONLY`, `MASTERDOWN`): with
    /// Sentinel, follows the primary. A failure to ask is left to the next attempt.
    pub(crate) async fn after_failure(&self, e: &redis::RedisError) {
        if self.settings.sentinels.is_empty() {
            return;
        }
        let moved = e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
            || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if moved {
            if let Err(why) = self.follow_primary().await {
                tracing::warn!(error = %why, "cannot ask the sentinels where the Redis primary is; retrying with the batch");
            }
        }
    }

    /// `<prefix><pipeline>:`.
    pub(crate) fn pipeline_prefix(&self, pipeline: &str) -> String {
        format!("{}{pipeline}:", self.prefix)
    }

    /// The dead-letter stream's key.
    pub(crate) fn dead_letter_stream(&self) -> String {
        format!("{}dead-letters", self.prefix)
    }

    pub(super) fn expected(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), (i64, String)>> {
        self.expected.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the dedup store knows of one business key (`idemflow explain`).
    ///
    /// Errors: Redis's.
    pub async fn explain(&self, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, redis::RedisError> {
        let dk = format!("{}k:{}", self.pipeline_prefix(pipeline), hex::encode(key.digest));
        let value: Option<String> = redis::cmd("GET").arg(&dk).query_async(&mut self.conn().await?).await?;
        Ok(value.and_then(|v| DedupValue::parse(&v)).map(|d| Explained {
            business_key: key.text.clone(),
            applied_at: format_ms(d.applied_ms),
            topic: d.topic,
            partition: d.partition,
            offset: d.offset,
            fingerprint: d.fingerprint,
            duplicates: d.duplicates,
            last_duplicate_at: d.last_duplicate_ms.map(format_ms),
        }))
    }
}

/// A dedup key's value, as the script writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DedupValue {
    /// `false` when some of the record's commands ran before one failed (the record is a dead letter).
    pub applied: bool,
    pub applied_ms: i64,
    pub duplicates: i64,
    pub last_duplicate_ms: Option<i64>,
    pub partition: i32,
    pub offset: i64,
    /// Hex.
    pub fingerprint: String,
    pub topic: String,
}

impl DedupValue {
    /// The part of the value the worker writes (the script prepends state, time and counts).
    pub fn tail(partition: i32, offset: i64, fingerprint: &[u8; 32], topic: &str) -> String {
        format!("{partition}|{offset}|{}|{topic}", hex::encode(fingerprint))
    }

    /// Parses a whole value; `None` when it is not one idemflow wrote.
    pub fn parse(v: &str) -> Option<DedupValue> {
        let mut it = v.splitn(8, '|');
        let applied = match it.next()? {
            "A" => true,
            "D" => false,
            _ => return None,
        };
        let applied_ms = it.next()?.parse().ok()?;
        let duplicates = it.next()?.parse().ok()?;
        let last = it.next()?;
        let last_duplicate_ms = if last.is_empty() { None } else { Some(last.parse().ok()?) };
        let partition = it.next()?.parse().ok()?;
        let offset = it.next()?.parse().ok()?;
        let fingerprint = it.next()?.to_owned();
        let topic = it.next()?.to_owned();
        Some(DedupValue { applied, applied_ms, duplicates, last_duplicate_ms, partition, offset, fingerprint, topic })
    }
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC text.
pub(crate) fn format_ms(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms).map(|t| t.to_string()).unwrap_or_else(|_| ms.to_string())
}

/// Connects once, directly, to tell whether Redis is reachable and answers `PING` (with Sentinel: the primary the
/// sentinels name), with Redis's or the network's own reason when it is not. The error never contains the password.
pub async fn ping(settings: &RedisSettings) -> Result<(), NotReady> {
    let attempt = async {
        let primary = if settings.sentinels.is_empty() { None } else { Some(ask_sentinels(settings).await?) };
        let client = client(settings, primary.as_ref()).map_err(|why| redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "redis", why)))?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    let at = if settings.sentinels.is_empty() { settings.url.to_string() } else { format!("the primary the sentinels {:?} name", settings.sentinels) };
    match tokio::time::timeout(settings.connect_timeout * 2, attempt).await {
        Ok(Ok(_)) => Ok(()),
        // Waited for where a batch would retry (a refused or lost connection, LOADING, a failover); refused where it
        // never would (a wrong password, a configuration the client refuses).
        Ok(Err(e)) => Err(NotReady::after(
            super::error::classify(&e),
            format!("cannot connect to Redis at {at}: {}", settings.url.scrub(&e.to_string())),
        )),
        Err(_) => Err(NotReady::Unavailable(format!("cannot connect to Redis at {at}: no answer in {:?}", settings.connect_timeout * 2))),
    }
}

/// What `check` learns of the server.
#[derive(Clone, Debug, Default)]
pub struct ServerFacts {
    /// `redis_version`.
    pub version: String,
    /// `aof_enabled`.
    pub aof: bool,
    /// `appendfsync`, when `CONFIG GET` is allowed.
    pub appendfsync: Option<String>,
    /// `maxmemory-policy` and whether `maxmemory` is set, when `CONFIG GET` is allowed.
    pub eviction: Option<(String, bool)>,
}

impl RedisStore {
    /// What this server's durability means for `pipelines` (those writing to it), for `check` and `run`: one line
    /// each, warnings prefixed `warning: `.
    pub async fn durability(&self, pipelines: &[crate::store::contract::Tenant]) -> Vec<String> {
        let mut lines = Vec::new();
        let facts = match self.check_server().await {
            Ok(f) => f,
            Err(why) => return vec![format!("warning: redis: {why}")],
        };
        let fsync = facts.appendfsync.clone().unwrap_or_else(|| "unknown (CONFIG GET is not allowed)".to_owned());
        lines.push(format!("redis {}: appendonly {}, appendfsync {fsync}", facts.version, if facts.aof { "yes" } else { "no" }));
        match &facts.eviction {
            Some((policy, true)) if policy != "noeviction" => lines.push(format!(
                "warning: redis: maxmemory-policy {policy} with maxmemory set: Redis may evict dedup keys (they all have a TTL) \
                 or stored positions before their time, and an operation whose key was evicted is applied again when it comes \
                 back. Set maxmemory-policy noeviction (a full Redis then refuses writes, and the worker waits and retries)"
            )),
            None => lines.push("warning: redis: cannot read maxmemory-policy (CONFIG GET is not allowed): make sure it is noeviction".to_owned()),
            _ => {}
        }
        if !facts.aof {
            lines.push(
                "warning: redis: appendonly is off: a restart loses every dedup key, stored position and effect written since the \
                 last snapshot; a pipeline with positions then stops (its positions are gone) and a RabbitMQ pipeline loses what \
                 it acknowledged. Set appendonly yes"
                    .to_owned(),
            );
        }
        for p in pipelines {
            lines.push(format!(
                "pipeline {:?}: nothing to purge: its dedup keys expire by themselves after [dedup] retention = {}",
                p.name,
                crate::terminal::duration(p.retention)
            ));
            if !p.has_positions && facts.appendfsync.as_deref() != Some("always") {
                lines.push(format!(
                    "warning: pipeline {:?}: a queue has no position to resume from: a message is acknowledged once its batch's \
                     script ran, and a crash of Redis before it wrote that script to disk (appendfsync {fsync}) loses its effect \
                     for good. Set appendfsync always on the Redis server",
                    p.name
                ));
            }
        }
        lines
    }

    /// Checks the server idemflow runs on: version, not a Cluster node. Returns what it found (for the warnings
    /// about durability, [`ServerFacts`]).
    ///
    /// Errors: [`NotReady::Refused`] with the reason the server cannot be used; Redis's error, as
    /// [`NotReady::Unavailable`] where a batch would retry it ([`super::error::classify`]).
    pub async fn check_server(&self) -> Result<ServerFacts, NotReady> {
        let asked = |e: redis::RedisError| NotReady::after(super::error::classify(&e), e.to_string());
        let mut conn = self.conn().await.map_err(asked)?;
        let info: String = redis::cmd("INFO").arg("server").arg("persistence").arg("cluster").query_async(&mut conn).await.map_err(asked)?;
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':'))).map(str::trim);
        let version = field("redis_version").unwrap_or("unknown").to_owned();
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if (major, minor) < MIN_VERSION {
            return Err(NotReady::Refused(format!(
                "Redis {version} is too old: idemflow needs {}.{} or later (before 7.0 an error inside a script loses its code, \
                 so a failover's READONLY or an OOM could not be told from a fatal error)",
                MIN_VERSION.0, MIN_VERSION.1
            )));
        }
        if field("cluster_enabled") == Some("1") {
            return Err(NotReady::Refused(
                "this is a Redis Cluster node: idemflow runs each batch as one script, and a script can touch keys of one \
                 hash slot only, while a batch's dedup keys, effects and positions span many. Use a standalone Redis (or a \
                 Sentinel-managed primary)"
                    .to_owned(),
            ));
        }
        let aof = field("aof_enabled") == Some("1");
        let get = |name: &'static str| {
            let mut conn = conn.clone();
            async move { redis::cmd("CONFIG").arg("GET").arg(name).query_async::<Vec<String>>(&mut conn).await.ok().and_then(|v| v.get(1).cloned()) }
        };
        let appendfsync = get("appendfsync").await;
        let eviction = match (get("maxmemory-policy").await, get("maxmemory").await) {
            (Some(policy), Some(max)) => Some((policy, max != "0")),
            _ => None,
        };
        Ok(ServerFacts { version, aof, appendfsync, eviction })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedup_values_round_trip() {
        let tail = DedupValue::tail(3, 42, &[0xab; 32], "pay|ments");
        let v = DedupValue::parse(&format!("A|1700000000000|2|1700000000500|{tail}")).unwrap();
        assert!(v.applied);
        assert_eq!((v.partition, v.offset, v.duplicates, v.last_duplicate_ms), (3, 42, 2, Some(1700000000500)));
        assert_eq!(v.topic, "pay|ments");
        assert_eq!(v.fingerprint, "ab".repeat(32));
        let d = DedupValue::parse(&format!("D|1|0||{tail}")).unwrap();
        assert!(!d.applied && d.last_duplicate_ms.is_none());
        assert!(DedupValue::parse("something else").is_none());
    }
}
