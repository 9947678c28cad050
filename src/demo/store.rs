//! A throwaway store with durability on, one shape for the three stores: started here
//! ([`ThrowawayStore::start`]), a database made on it with the shipped example's tables
//! ([`ThrowawayStore::database`]), the pipeline and the settings' store section for a worker to write to it, and
//! stopped, crashed and started again on the same data for the soak.

use super::{database::DemoDb, mariadb, postgres, redis};

/// A store idemflow writes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// A PostgreSQL cluster from the local server binaries (`fsync` and `synchronous_commit` on).
    Postgres,
    /// Debian's `mariadbd` (`innodb_flush_log_at_trx_commit = 1`).
    Mariadb,
    /// Debian's `redis-server` (`appendonly yes`, `appendfsync always`).
    Redis,
}

impl StoreKind {
    /// Every store, in the guarantee matrix's order.
    pub const ALL: [StoreKind; 3] = [StoreKind::Postgres, StoreKind::Mariadb, StoreKind::Redis];

    /// Its name in prose.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Postgres => "PostgreSQL",
            StoreKind::Mariadb => "MariaDB",
            StoreKind::Redis => "Redis",
        }
    }

    /// Its name on the command line.
    pub fn flag(self) -> &'static str {
        match self {
            StoreKind::Postgres => "postgres",
            StoreKind::Mariadb => "mariadb",
            StoreKind::Redis => "redis",
        }
    }

    /// The shipped pipeline for this store (reading Kafka topic `payments`): `pipelines/payments.toml`,
    /// `examples/mysql/payments.toml`, `examples/redis/payments.toml`.
    pub fn pipeline(self) -> &'static str {
        match self {
            StoreKind::Postgres => super::shipped::SHIPPED_PIPELINE,
            StoreKind::Mariadb => super::shipped::SHIPPED_MYSQL_PIPELINE,
            StoreKind::Redis => super::shipped::SHIPPED_REDIS_PIPELINE,
        }
    }

    /// The business tables of [`StoreKind::pipeline`] (Redis: none).
    fn tables(self) -> &'static str {
        match self {
            StoreKind::Postgres => super::shipped::SHIPPED_TABLES,
            StoreKind::Mariadb => super::shipped::SHIPPED_MYSQL_TABLES,
            StoreKind::Redis => "",
        }
    }
}

/// A running store of this process.
pub enum ThrowawayStore {
    /// A PostgreSQL cluster.
    Postgres(postgres::Throwaway),
    /// A MariaDB server.
    MariaDb(mariadb::Throwaway),
    /// A Redis server.
    Redis(redis::Throwaway),
}

impl ThrowawayStore {
    /// Starts `kind`, durable.
    ///
    /// Errors: the server is not installed (the message says how to install it) or did not start.
    pub fn start(kind: StoreKind) -> anyhow::Result<ThrowawayStore> {
        Ok(match kind {
            StoreKind::Postgres => ThrowawayStore::Postgres(postgres::Throwaway::start_durable()?),
            StoreKind::Mariadb => ThrowawayStore::MariaDb(mariadb::Throwaway::start()?),
            StoreKind::Redis => ThrowawayStore::Redis(redis::Throwaway::start_durable()?),
        })
    }

    /// Which store this is.
    pub fn kind(&self) -> StoreKind {
        match self {
            ThrowawayStore::Postgres(_) => StoreKind::Postgres,
            ThrowawayStore::MariaDb(_) => StoreKind::Mariadb,
            ThrowawayStore::Redis(_) => StoreKind::Redis,
        }
    }

    /// Makes database `name` (Redis: the server as it is) with idemflow's tables, the shipped example's business
    /// tables and the demo's accounts; returns it and the URL a worker connects to.
    ///
    /// Errors: the server refused.
    pub async fn database(&self, name: &str) -> anyhow::Result<(DemoDb, String)> {
        let (db, url) = match self {
            ThrowawayStore::Postgres(cluster) => DemoDb::create(&cluster.url(), name).await?,
            ThrowawayStore::MariaDb(server) => DemoDb::create(&server.url(), name).await?,
            ThrowawayStore::Redis(server) => DemoDb::redis(Some(&server.url()))?,
        };
        db.setup(self.kind().tables(), super::shipped::ACCOUNTS, super::shipped::OPENING_BALANCE_CENTS).await?;
        Ok((db, url))
    }

    /// The settings' store section for `url` (from [`ThrowawayStore::database`]): `[database]` with a
    /// `batch_timeout` of 30 s, or `[redis]`.
    pub fn settings_toml(&self, url: &str) -> String {
        match self {
            ThrowawayStore::Postgres(_) | ThrowawayStore::MariaDb(_) => {
                format!("[database]\nurl = {}\nmax_connections = 4\nbatch_timeout = \"30s\"\n", super::host::toml_string(url))
            }
            ThrowawayStore::Redis(_) => {
                format!("[redis]\nurl = {}\nconnect_timeout = \"5s\"\nresponse_timeout = \"30s\"\n", super::host::toml_string(url))
            }
        }
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        match self {
            ThrowawayStore::Postgres(c) => c.port(),
            ThrowawayStore::MariaDb(s) => s.port(),
            ThrowawayStore::Redis(s) => s.port(),
        }
    }

    /// Stops it as an operator would (PostgreSQL's fast shutdown, MariaDB's and Redis's SIGTERM).
    ///
    /// Errors: `pg_ctl` failed.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        match self {
            ThrowawayStore::Postgres(c) => c.stop()?,
            ThrowawayStore::MariaDb(s) => s.stop(),
            ThrowawayStore::Redis(s) => s.stop(),
        }
        Ok(())
    }

    /// Stops it as a crash would (PostgreSQL's immediate shutdown, SIGKILL): recovery at the next start.
    ///
    /// Errors: `pg_ctl` failed.
    pub fn crash(&mut self) -> anyhow::Result<()> {
        match self {
            ThrowawayStore::Postgres(c) => c.crash()?,
            ThrowawayStore::MariaDb(s) => s.crash(),
            ThrowawayStore::Redis(s) => s.crash(),
        }
        Ok(())
    }

    /// Starts it again on the same data and port.
    ///
    /// Errors: it did not start.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        match self {
            ThrowawayStore::Postgres(c) => c.start_again()?,
            ThrowawayStore::MariaDb(s) => s.start_again()?,
            ThrowawayStore::Redis(s) => s.start_again()?,
        }
        Ok(())
    }
}
