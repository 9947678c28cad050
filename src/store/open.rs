//! Opening the stores a set of pipelines writes to, whatever they are: which stores are needed ([`needed`]),
//! waiting for them at start-up ([`Stores::wait_for`]), connecting with idemflow's schema checked ([`Stores::open`]), whether a
//! database URL leads to a pooler ([`behind_pooler`]), and what a store's durability means for the pipelines on
//! it ([`Store::durability`]). One match per question, one arm per store.

use super::spec::{DatabaseSettings, RedisSettings, StoreKind};
use super::contract::NotReady;
use super::template::Dialect;
use super::{postgres, Store};
#[cfg(feature = "mysql")]
use super::mysql;
use std::time::Duration;

/// The stores' settings (`[database]`, `[redis]`), as the stores take them.
#[derive(Clone, Debug, Default)]
pub struct Stores {
    /// `[database]`: PostgreSQL, MySQL or MariaDB.
    pub database: Option<DatabaseSettings>,
    /// `[redis]`.
    pub redis: Option<RedisSettings>,
}

/// What a store asks of the pipelines writing to it, asked by the configuration's checks instead of which store it
/// is. Each `Err` holds the reason given to a pipeline that asks otherwise.
#[derive(Debug)]
pub struct StoreCapabilities {
    /// The store keeps a positional source's positions itself, written with the effects by the same step (Redis,
    /// whose last writes can be lost together with the positions): `[offsets] store` defaults to `"database"`, and
    /// `"broker"` is refused with this reason.
    pub keeps_positions: Result<(), &'static str>,
    /// `[dedup] purge_interval`, `purge_batch` and `purge_rate` (a store whose dedup keys expire by themselves has none).
    pub purge_settings: Result<(), &'static str>,
    /// `batch.concurrency` above 1.
    pub lanes: Result<(), &'static str>,
    /// `[dead_letters] topic` for a positional source.
    pub dead_letter_topic: Result<(), &'static str>,
}

const DATABASE: StoreCapabilities = StoreCapabilities { keeps_positions: Ok(()), purge_settings: Ok(()), lanes: Ok(()), dead_letter_topic: Ok(()) };

const REDIS: StoreCapabilities = StoreCapabilities {
    keeps_positions: Err(
        "a Redis sink keeps the consumed positions in Redis, written by the same script as the effects (\"database\", \
         the default): Redis can lose its last writes in a crash (appendfsync everysec), and positions committed to \
         Kafka would then skip the effects it lost. Remove the setting",
    ),
    purge_settings: Err("a Redis sink's dedup keys expire by themselves (their TTL is dedup.retention): there is nothing to purge"),
    lanes: Err(
        "more than 1 is not supported with a Redis sink yet (its stored positions are checked per consumer): \
         run more workers instead",
    ),
    dead_letter_topic: Err(
        "a Redis sink keeps its dead letters in a Redis stream (<key_prefix>dead-letters), written by the batch's \
         script; its positions are stored with them, so a dead letter not yet produced to a topic after a crash \
         would never be",
    ),
};

impl StoreKind {
    /// What the store asks of its pipelines ([`StoreCapabilities`]).
    pub fn capabilities(self) -> &'static StoreCapabilities {
        match self {
            StoreKind::Database => &DATABASE,
            StoreKind::Redis => &REDIS,
        }
    }

    /// Every store kind, the database first (the order `check` and `run` open them in).
    pub const ALL: [StoreKind; 2] = [StoreKind::Database, StoreKind::Redis];

    /// The store's name in messages: `database` or `redis`.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Database => "database",
            StoreKind::Redis => "redis",
        }
    }

    /// Whether its dedup keys expire by themselves after the retention (Redis), so `purge` has nothing to do.
    pub fn expires_dedup_keys(self) -> bool {
        match self {
            StoreKind::Database => false,
            StoreKind::Redis => true,
        }
    }
}

/// The store kinds among `kinds` (one per pipeline), each once, the database first.
pub fn needed(kinds: impl IntoIterator<Item = StoreKind>) -> Vec<StoreKind> {
    let kinds: Vec<StoreKind> = kinds.into_iter().collect();
    StoreKind::ALL.into_iter().filter(|k| kinds.contains(k)).collect()
}

impl Stores {
    /// Why the settings of the store of `kind` are missing, if they are: the sentence `check` and `run` print.
    pub fn settings_missing(&self, kind: StoreKind) -> Option<&'static str> {
        match kind {
            StoreKind::Database if self.database.is_none() => Some(
                "a SQL side effect (sink.table or sink.sql) needs [database] url in the settings (or IDEMFLOW_DATABASE__URL)",
            ),
            StoreKind::Redis if self.redis.is_none() => {
                Some("a Redis side effect (sink.redis) needs [redis] url in the settings (or IDEMFLOW_REDIS__URL)")
            }
            StoreKind::Database | StoreKind::Redis => None,
        }
    }

    /// Whether this build has the store of `kind` (its cargo feature; for the database, the driver its URL names).
    ///
    /// Errors: the store and the feature to build with ([`super::not_built`]).
    pub fn built(&self, kind: StoreKind) -> Result<(), String> {
        let mysql = self.database.as_ref().is_some_and(|d| Dialect::of_url(d.url.expose()) == Dialect::MySql);
        match kind {
            StoreKind::Database if mysql && !cfg!(feature = "mysql") => Err(super::not_built("MySQL/MariaDB", "mysql")),
            StoreKind::Database => Ok(()),
            StoreKind::Redis if !cfg!(feature = "redis") => Err(super::not_built("Redis", "redis")),
            StoreKind::Redis => Ok(()),
        }
    }

    fn database(&self) -> Result<&DatabaseSettings, String> {
        self.database.as_ref().ok_or_else(|| "missing [database] (or IDEMFLOW_DATABASE__URL)".to_owned())
    }

    fn redis(&self) -> Result<&RedisSettings, String> {
        self.redis.as_ref().ok_or_else(|| "missing [redis] (or IDEMFLOW_REDIS__URL)".to_owned())
    }

    /// One direct connection attempt to the store of `kind`.
    ///
    /// Errors, prefixed with the store (`database: ...`, `redis: ...`): [`NotReady::Refused`] when its section is
    /// missing or what it answered can never change by waiting (a wrong password, a database that does not exist);
    /// [`NotReady::Unavailable`] when it cannot be reached yet.
    pub async fn reachable(&self, kind: StoreKind) -> Result<(), NotReady> {
        let refused = |why: String| NotReady::Refused(why);
        let result = match kind {
            StoreKind::Database => Store::ping(self.database().map_err(refused)?).await,
            #[cfg(feature = "redis")]
            StoreKind::Redis => super::redis::ping(self.redis().map_err(refused)?).await,
            #[cfg(not(feature = "redis"))]
            StoreKind::Redis => Err(NotReady::Refused(self.redis().err().unwrap_or_else(|| super::not_built("Redis", "redis")))),
        };
        result.map_err(|e| e.within(kind.name()))
    }

    /// A pool for the store of `kind`, without connecting.
    ///
    /// Errors: its section is missing or its URL is refused.
    pub fn pool(&self, kind: StoreKind) -> Result<Store, String> {
        match kind {
            StoreKind::Database => Store::connect(self.database()?).map_err(|e| e.to_string()),
            StoreKind::Redis => Store::redis(self.redis()?),
        }
    }

    /// These settings with `[database] prepared_statements` off when the URL leads to PgBouncer: named prepared
    /// statements collide behind a pooler in transaction mode, and whether they do depends on which server
    /// connection a statement lands on; unnamed ones work in every mode (idemflow's statements are a few per batch).
    pub async fn behind_pgbouncer(&self) -> Stores {
        let mut stores = self.clone();
        if let Some(db) = stores.database.as_mut() {
            if db.prepared_statements && Dialect::of_url(db.url.expose()) == Dialect::Postgres {
                if let Some(what) = super::postgres::pgbouncer(db).await {
                    tracing::info!(pooler = %what, "the database URL leads to PgBouncer: statements are not prepared by name (as with prepared_statements = false)");
                    db.prepared_statements = false;
                }
            }
        }
        stores
    }

    /// The store of `kind`, reachable and with idemflow's schema (the database) or a usable server (Redis).
    ///
    /// Errors, each prefixed with the store (`database: ...`): [`NotReady::Refused`]: its section is missing, this
    /// build leaves it out, its URL is refused, or the schema is missing or behind; [`NotReady::Unavailable`]: it
    /// cannot be reached or asked (worth waiting for, as [`Stores::wait_for`] does).
    pub async fn open(&self, kind: StoreKind) -> Result<Store, NotReady> {
        // A missing section and a store this build leaves out are refused by `reachable` too.
        self.reachable(kind).await?;
        let refused = |why: String| NotReady::Refused(format!("{}: {why}", kind.name()));
        // Only the database can be behind PgBouncer: opening Redis asks nothing of it.
        let store = match kind {
            StoreKind::Database => self.behind_pgbouncer().await.pool(kind),
            StoreKind::Redis => self.pool(kind),
        }
        .map_err(refused)?;
        store.check_schema().await.map_err(|e| e.within(kind.name()))?;
        Ok(store)
    }

    /// At start-up the stores may not be up yet (a compose file starts everything at once): waits for each of
    /// `kinds`, with exponential backoff, saying why on every attempt.
    ///
    /// Errors: a store's [`NotReady::Refused`], which waiting cannot change (a wrong password, a database that does
    /// not exist): said at once instead of retried forever.
    pub async fn wait_for(&self, kinds: &[StoreKind]) -> Result<(), NotReady> {
        for kind in kinds {
            let mut backoff = crate::retry::backoff(Duration::from_millis(200), Duration::from_secs(10));
            loop {
                match self.reachable(*kind).await {
                    Ok(()) => break,
                    Err(e @ NotReady::Refused(_)) => return Err(e),
                    Err(NotReady::Unavailable(why)) => {
                        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
                        tracing::warn!(retry_in = ?delay, "{why}");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether `database` leads to a connection pooler rather than the database itself: `prepared_statements = false`
/// says so, or PgBouncer answers at the URL. Migrations take a session-level lock that a transaction pooler cannot
/// keep.
pub async fn behind_pooler(database: &DatabaseSettings) -> bool {
    !database.prepared_statements
        || (Dialect::of_url(database.url.expose()) == Dialect::Postgres && super::postgres::pgbouncer(database).await.is_some())
}

impl Store {
    /// A pool for `settings.url` that connects on first use, so the worker can start before the database is up.
    ///
    /// Errors: the URL does not parse, or names no store idemflow knows.
    pub fn connect(settings: &DatabaseSettings) -> Result<Store, sqlx::Error> {
        Ok(match Dialect::of_url(settings.url.expose()) {
            Dialect::Postgres => Store::Postgres(postgres::pool(settings)?),
            #[cfg(feature = "mysql")]
            Dialect::MySql => Store::MySql(mysql::MySqlStore::new(mysql::pool(settings)?)),
            #[cfg(not(feature = "mysql"))]
            Dialect::MySql => return Err(sqlx::Error::Configuration(super::not_built("MySQL/MariaDB", "mysql").into())),
        })
    }

    /// A Redis store for `settings` that connects on first use.
    ///
    /// Errors: the URL does not parse, or a TLS file cannot be read.
    pub fn redis(settings: &crate::store::spec::RedisSettings) -> Result<Store, String> {
        #[cfg(feature = "redis")]
        return super::redis::RedisStore::new(settings).map(Store::Redis);
        #[cfg(not(feature = "redis"))]
        {
            let _ = settings;
            Err(super::not_built("Redis", "redis"))
        }
    }

    /// Connects once, directly, to tell whether the database is reachable, with the server's or the network's
    /// own reason when it is not. The error never contains the password.
    pub async fn ping(settings: &DatabaseSettings) -> Result<(), NotReady> {
        match Dialect::of_url(settings.url.expose()) {
            Dialect::Postgres => postgres::ping(settings).await,
            #[cfg(feature = "mysql")]
            Dialect::MySql => mysql::ping(settings).await,
            #[cfg(not(feature = "mysql"))]
            Dialect::MySql => Err(NotReady::Refused(super::not_built("MySQL/MariaDB", "mysql"))),
        }
    }

    /// What this store's durability means for `pipelines` (those writing to it): one line each, warnings prefixed
    /// `warning: `. The databases make every COMMIT durable and say nothing; Redis depends on its settings.
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))]
    pub async fn durability(&self, pipelines: &[super::contract::Tenant]) -> Vec<String> {
        match self {
            Store::Postgres(_) => Vec::new(),
            #[cfg(feature = "mysql")]
            Store::MySql(_) => Vec::new(),
            #[cfg(feature = "redis")]
            Store::Redis(redis) => redis.durability(pipelines).await,
        }
    }
}
