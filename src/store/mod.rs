//! The store: the database that holds the business data and idemflow's own tables (dedup rows, dead letters,
//! stored positions), one module per database behind closed enums, as [`crate::source`] is for brokers.
//!
//! - [`Store`]: a connection pool, and what runs outside a batch: migrations, the schema check, stored positions
//!   (claim, read, reset), retention, `explain`, the dead-letter listing.
//! - [`SideEffect`]: a pipeline's side effect, checked against the store's tables and statements and bound to the
//!   store that built it: batches are opened through it ([`SqlSideEffect::begin`]), so there is no way to run a
//!   side effect in another store's transaction.
//! - [`Tx`]: one open batch transaction with the side effect it runs, and every step the batch protocol (the
//!   sink) takes in it: the claim, the lookup of existing dedup rows, the side effect, the dead letters, the
//!   fenced positions, the processed marks, savepoints, `COMMIT`.
//!
//! The protocol and the duplicate classification are written once, in the sink; a store provides only the
//! statements. Each store maps its error codes into the same dispositions ([`crate::store::error`]).
//!
//! - [`postgres`]: PostgreSQL (`postgres://`, `postgresql://`).
//! - [`mysql`]: MySQL and MariaDB (`mysql://`, `mariadb://`).
//! - [`redis`]: Redis (`[redis] url`), a store whose side effect is Redis commands. It has no interactive
//!   transaction: the whole batch runs as one script ([`redis::batch`]), so its side effect is
//!   [`SideEffect::Script`] and it has no [`Tx`]; the sink runs the same protocol through the script.

pub mod disposition;
pub mod error;
pub mod open;
pub mod rows;
pub mod spec;
pub mod template;

pub use open::{StoreCapabilities, Stores, Tenant};
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod postgres;
pub mod redis;

use crate::store::spec::{Binding, DatabaseSettings, SinkSpec, TimeSettings};
use crate::store::template::Dialect;
use crate::field::Render;
use crate::key::BusinessKey;
use crate::offsets::{Claimed, NextOffsets, Positions, Processed};
use crate::store::rows::Apply;
use crate::record::Record;
use crate::retention::PurgeOutcome;
use crate::dead_letter::Stored;
use crate::store::rows::{Claim, Existing, Explained};
use crate::metrics::DeadLetterReason;
use std::time::Duration;

/// A store's connection pool. Cheap to clone (the pool is shared).
#[derive(Clone, Debug)]
pub enum Store {
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// MySQL or MariaDB.
    #[cfg(feature = "mysql")]
    MySql(mysql::MySqlStore),
    /// Redis.
    #[cfg(feature = "redis")]
    Redis(redis::RedisStore),
}

/// A failure of the store outside a batch (positions, retention, `explain`, dead letters).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database's.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// Redis's.
    #[error("redis: {0}")]
    #[cfg(feature = "redis")]
    Redis(#[from] ::redis::RedisError),
    /// The request was refused, and why (`idemflow dedup forget` while a worker runs, or on Redis).
    #[error("{0}")]
    Refused(String),
}

/// Why a store this build leaves out cannot be used: `what` (the store) and the cargo `feature` to build with.
pub fn not_built(what: &str, feature: &str) -> String {
    format!("this idemflow was built without {what} (build it with `cargo build --release --features {feature}`, or with the default features)")
}

/// Why a side effect does not fit the database. Each is a configuration error naming the field.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PrepareError {
    /// The pipeline field at fault, such as `sink.table` or `sink.sql[1]`.
    pub field: String,
    /// What is wrong, with the database's own message where it gave one.
    pub message: String,
    /// The database could not be asked (connection, pool): worth retrying, not a configuration error.
    pub unavailable: bool,
}

impl PrepareError {
    /// Every problem found at once, as one error: a single problem keeps its field; several are listed under
    /// `sink`, one per line.
    pub fn all(mut problems: Vec<PrepareError>) -> PrepareError {
        let message = problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  ");
        let field = if problems.len() == 1 { problems.remove(0).field } else { "sink".to_owned() };
        let message = if field == "sink" { message } else { message.split_once(": ").map_or(message.clone(), |m| m.1.to_owned()) };
        PrepareError { field, message, unavailable: false }
    }
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
            Dialect::MySql => return Err(sqlx::Error::Configuration(not_built("MySQL/MariaDB", "mysql").into())),
        })
    }

    /// A Redis store for `settings` that connects on first use.
    ///
    /// Errors: the URL does not parse, or a TLS file cannot be read.
    pub fn redis(settings: &crate::store::spec::RedisSettings) -> Result<Store, String> {
        #[cfg(feature = "redis")]
        return redis::RedisStore::new(settings).map(Store::Redis);
        #[cfg(not(feature = "redis"))]
        {
            let _ = settings;
            Err(not_built("Redis", "redis"))
        }
    }

    /// Connects once, directly, to tell whether the database is reachable, with the server's or the network's
    /// own reason when it is not. The error never contains the password.
    pub async fn ping(settings: &DatabaseSettings) -> Result<(), String> {
        match Dialect::of_url(settings.url.expose()) {
            Dialect::Postgres => postgres::ping(settings).await,
            #[cfg(feature = "mysql")]
            Dialect::MySql => mysql::ping(settings).await,
            #[cfg(not(feature = "mysql"))]
            Dialect::MySql => Err(not_built("MySQL/MariaDB", "mysql")),
        }
    }

    /// Creates or upgrades idemflow's tables; returns the schema version now.
    ///
    /// Errors: the migration's (the database unreachable, a migration changed since it was applied).
    pub async fn migrate(&self) -> Result<i64, sqlx::migrate::MigrateError> {
        match self {
            Store::Postgres(pool) => {
                postgres::migrate(pool).await?;
                Ok(postgres::MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default())
            }
            #[cfg(feature = "mysql")]
            Store::MySql(s) => {
                mysql::check_binlog(&s.pool).await.map_err(|why| sqlx::migrate::MigrateError::Execute(sqlx::Error::Configuration(why.into())))?;
                mysql::MIGRATOR.run(&s.pool).await?;
                Ok(mysql::MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default())
            }
            // Redis has no schema: its keys are created by the batches.
            #[cfg(feature = "redis")]
            Store::Redis(_) => Ok(0),
        }
    }

    /// Whether idemflow's tables are migrated to the version this binary needs, with the unique index the claim
    /// depends on.
    ///
    /// Errors: what is missing and what to run.
    pub async fn check_schema(&self) -> Result<(), String> {
        match self {
            Store::Postgres(pool) => postgres::check_schema(pool).await,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::check_schema(&s.pool).await,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.check_server().await.map(drop),
        }
    }

    /// Closes the pool, waiting for connections in use to be returned.
    pub async fn close(&self) {
        match self {
            Store::Postgres(pool) => pool.close().await,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => s.pool.close().await,
            #[cfg(feature = "redis")]
            Store::Redis(_) => {}
        }
    }

    /// Checks a pipeline's side effect against the database and builds its statements. Returns the side effect
    /// and its bindings in value order, each with how its values are rendered.
    ///
    /// Errors: a [`PrepareError`] naming the field at fault, or with `unavailable` set when the database could
    /// not be asked.
    pub async fn prepare_side_effect(
        &self,
        spec: &SinkSpec,
        time: &TimeSettings,
    ) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
        let unavailable = |e: sqlx::Error| PrepareError { field: "database".into(), message: format!("cannot connect: {e}"), unavailable: true };
        match self {
            Store::Postgres(pool) => {
                let mut conn = pool.acquire().await.map_err(unavailable)?;
                let (s, b) = postgres::side_effect::SideEffect::prepare(&mut conn, spec, time).await?;
                Ok((SideEffect::Sql(SqlSideEffect::Postgres(pool.clone(), s)), b))
            }
            #[cfg(feature = "mysql")]
            Store::MySql(store) => {
                let mut conn = store.pool.acquire().await.map_err(unavailable)?;
                let (s, b) = mysql::side_effect::SideEffect::prepare(&mut conn, spec, time).await?;
                Ok((SideEffect::Sql(SqlSideEffect::MySql(store.clone(), s)), b))
            }
            #[cfg(feature = "redis")]
            Store::Redis(r) => {
                let (s, b) = redis::side_effect::SideEffect::prepare(r, spec).await?;
                Ok((SideEffect::Script(r.clone(), s), b))
            }
        }
    }

    /// Takes ownership of `partitions` for `pipeline` (`[offsets] store = "database"`): increments each one's
    /// epoch and returns the stored positions. `owner` is recorded for operators.
    ///
    /// Errors: any database error (the caller retries).
    pub async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => postgres::offsets::claim(pool, pipeline, owner, partitions).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::offsets::claim(&s.pool, pipeline, owner, partitions).await?,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.claim_offsets(pipeline, owner, partitions).await?,
        })
    }

    /// Partitions of `pipeline`, among `owned` (assigned to this worker), whose positions as this worker stored
    /// them the store no longer holds: Redis after it lost its last writes. Always none for the databases, which keep
    /// what they committed.
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))]
    pub async fn lost_positions(&self, pipeline: &str, owned: &[(String, i32)]) -> Result<Vec<(String, i32)>, StoreError> {
        Ok(match self {
            Store::Postgres(_) => Vec::new(),
            #[cfg(feature = "mysql")]
            Store::MySql(_) => Vec::new(),
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.lost_positions(pipeline, owned).await?,
        })
    }

    /// The stored positions of `pipeline`: `(topic, partition, next offset)`.
    pub async fn stored_offsets(&self, pipeline: &str) -> Result<Vec<(String, i32, Option<i64>)>, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => postgres::offsets::stored(pool, pipeline).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::offsets::stored(&s.pool, pipeline).await?,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.stored_offsets(pipeline).await?,
        })
    }

    /// Sets the stored positions of `pipeline` (`idemflow rewind`) and increments their epochs, so a worker still
    /// holding one of these partitions is fenced. Returns how many rows were written.
    pub async fn reset_offsets(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => postgres::offsets::reset(pool, pipeline, positions).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::offsets::reset(&s.pool, pipeline, positions).await?,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.reset_offsets(pipeline, positions).await?,
        })
    }

    /// Ends the server session of a batch attempt abandoned on `[database] batch_timeout` before its `COMMIT`
    /// (PostgreSQL: `pg_terminate_backend` of that backend while it is still in that transaction): the server rolls
    /// its transaction back and releases its locks (its claims, which the retry would otherwise wait on), and the
    /// pool gets its connection back at once instead of when the statement it was stuck in ends. Returns whether a
    /// session was ended (`false`: it had ended already, or moved on). MySQL/MariaDB: nothing is ended, since a
    /// connection id cannot be matched to the transaction it ran without the PROCESS privilege (the id may name
    /// another session by then: the pool handed the connection on, or the server behind a proxy is another one);
    /// there the session's `innodb_lock_wait_timeout` and MariaDB's `idle_transaction_timeout` bound the wait.
    /// Redis has no sessions.
    ///
    /// Errors: the database's (the server cannot be reached).
    pub async fn end_session(&self, session: Session) -> Result<bool, StoreError> {
        Ok(match (self, session) {
            (Store::Postgres(pool), Session::Postgres(pid, started)) => postgres::offsets::end_session(pool, pid, started).await?,
            _ => false,
        })
    }

    /// `idemflow dedup forget`: deletes the dedup rows of `pipeline` that `what` names (only reads them with
    /// `dry_run`) and lowers the processed floors of their partitions to the lowest offset forgotten, in one
    /// transaction; returns the rows as they were. Refused while a worker of the pipeline recorded a batch attempt
    /// within [`FORGET_REFUSED_WITHIN`].
    ///
    /// Errors: the database's; [`StoreError::Refused`] for Redis (its dedup keys are `SET NX PX` keys: delete them with
    /// `DEL`) and while a worker runs.
    pub async fn forget(&self, pipeline: &str, what: &rows::Forget, dry_run: bool) -> Result<rows::Forgotten, StoreError> {
        let running = match self {
            Store::Postgres(pool) => postgres::dedup::recent_attempts(pool, pipeline, FORGET_REFUSED_WITHIN).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::dedup::recent_attempts(&s.pool, pipeline, FORGET_REFUSED_WITHIN).await?,
            #[cfg(feature = "redis")]
            Store::Redis(_) => {
                return Err(StoreError::Refused(
                    "a Redis store keeps its dedup keys as keys with a TTL, and no processed floors: delete a key with \
                     redis-cli DEL <key_prefix><pipeline>:k:<sha256 of the business key, hex>"
                        .to_owned(),
                ))
            }
        };
        if !running.is_empty() && !dry_run {
            let lanes: Vec<String> = running.iter().map(|(lane, at)| format!("{lane} at {at}")).collect();
            return Err(StoreError::Refused(format!(
                "a worker of pipeline {pipeline:?} ran a batch within the last {}s (each lane of a running worker records \
                 its batches in the attempts table: {}): stop every worker of the pipeline, wait {}s, and run this again \
                 (a batch in flight would raise the floor again, and a forgotten key could be claimed meanwhile)",
                FORGET_REFUSED_WITHIN.as_secs(),
                lanes.join(", "),
                FORGET_REFUSED_WITHIN.as_secs()
            )));
        }
        let mut forgotten = match self {
            Store::Postgres(pool) => postgres::dedup::forget(pool, pipeline, what, dry_run).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::dedup::forget(&s.pool, pipeline, what, dry_run).await?,
            #[cfg(feature = "redis")]
            Store::Redis(_) => unreachable!("refused above"),
        };
        forgotten.running = running;
        Ok(forgotten)
    }

    /// Lowers the floors of `pipeline`'s processed marks to where `idemflow rewind` moves its consumer group
    /// (`(topic, partition, offset)`; see [`crate::offsets::Mark::floor`]), so the replay is consumed and applied
    /// where no dedup row covers it any more. Returns how many marks changed. Redis keeps no floor: nothing to do.
    pub async fn lower_floors(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => postgres::offsets::lower_floors(pool, pipeline, positions).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::offsets::lower_floors(&s.pool, pipeline, positions).await?,
            #[cfg(feature = "redis")]
            Store::Redis(_) => 0,
        })
    }

    /// Deletes the dedup rows of `pipeline` older than `retention`, `batch` rows per transaction, until none is
    /// left (see [`crate::retention`]). `on_batch` is called after each committed batch with the rows it deleted.
    ///
    /// Redis purges nothing: its dedup keys expire by themselves (their TTL is the retention).
    ///
    /// Errors: the database's; a pass interrupted by one leaves the store consistent (each batch is atomic).
    pub async fn purge(&self, pipeline: &str, retention: Duration, batch: u32, on_batch: impl FnMut(u64)) -> Result<PurgeOutcome, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => {
                let outcome = postgres::retention::purge(pool, pipeline, retention, batch, on_batch).await?;
                postgres::offsets::forget_attempts(pool, pipeline, ATTEMPT_ROWS_KEPT).await?;
                outcome
            }
            #[cfg(feature = "mysql")]
            Store::MySql(s) => {
                let outcome = mysql::retention::purge(&s.pool, pipeline, retention, batch, on_batch).await?;
                mysql::offsets::forget_attempts(&s.pool, pipeline, ATTEMPT_ROWS_KEPT).await?;
                outcome
            }
            #[cfg(feature = "redis")]
            Store::Redis(_) => PurgeOutcome::default(),
        })
    }

    /// What the dedup store knows of one business key (`idemflow explain`).
    pub async fn explain(&self, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => {
                // In a transaction, as every access is (a transaction-pooling proxy, PgBouncer).
                let mut tx = pool.begin().await?;
                postgres::dedup::explain(&mut tx, pipeline, key).await?
            }
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::dedup::explain(&mut *s.pool.acquire().await?, pipeline, key).await?,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.explain(pipeline, key).await?,
        })
    }

    /// The newest `limit` dead letters, optionally of one pipeline.
    pub async fn dead_letters(&self, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => postgres::dead_letter::list(&mut *pool.begin().await?, pipeline, limit).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::dead_letter::list(&mut *s.pool.acquire().await?, pipeline, limit).await?,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.dead_letters(pipeline, limit).await?,
        })
    }

    /// One dead letter by id.
    pub async fn dead_letter(&self, id: i64) -> Result<Option<Stored>, StoreError> {
        Ok(match self {
            Store::Postgres(pool) => postgres::dead_letter::get(&mut *pool.begin().await?, id).await?,
            #[cfg(feature = "mysql")]
            Store::MySql(s) => mysql::dead_letter::get(&mut *s.pool.acquire().await?, id).await?,
            #[cfg(feature = "redis")]
            Store::Redis(r) => r.dead_letter(id).await?,
        })
    }
}

/// A pipeline's side effect, built by its store ([`Store::prepare_side_effect`]) and bound to that store's pool:
/// batches are opened through it, so a side effect runs only where it was built, and a transaction carries the side
/// effect it runs ([`Tx`]).
#[derive(Clone, Debug)]
pub enum SideEffect {
    /// A database with interactive transactions: each batch is one [`Tx`].
    Sql(SqlSideEffect),
    /// Redis, which has no interactive transaction: each batch is one script ([`redis::batch`]) that runs these
    /// commands. See [`redis::side_effect`].
    #[cfg(feature = "redis")]
    Script(redis::RedisStore, redis::side_effect::SideEffect),
}

/// `idemflow dedup forget` is refused while a lane of the pipeline recorded a batch attempt this recently.
pub const FORGET_REFUSED_WITHIN: Duration = Duration::from_secs(60);

/// How long a lane's row in the attempts table is kept after its last batch (see [`Tx::mark_attempt`]): the purge
/// deletes older ones, left by workers that stopped.
pub const ATTEMPT_ROWS_KEPT: Duration = Duration::from_secs(24 * 3600);

/// A side effect on a database with interactive transactions, with the pool its transactions come from.
#[derive(Clone, Debug)]
pub enum SqlSideEffect {
    /// See [`postgres::side_effect`].
    Postgres(sqlx::PgPool, postgres::side_effect::SideEffect),
    /// See [`mysql::side_effect`].
    #[cfg(feature = "mysql")]
    MySql(mysql::MySqlStore, mysql::side_effect::SideEffect),
}

impl SqlSideEffect {
    /// Opens a batch transaction that runs this side effect. The caller then starts the side effect in it
    /// ([`Tx::begin_side_effect`]).
    ///
    /// Errors: the database's (no connection within the pool's timeout, the connection lost).
    pub async fn begin(&self) -> Result<Tx<'_>, sqlx::Error> {
        Ok(match self {
            SqlSideEffect::Postgres(pool, effect) => Tx::Postgres(pool.begin().await?, effect),
            #[cfg(feature = "mysql")]
            SqlSideEffect::MySql(store, effect) => {
                // The claim form first: reading it takes a connection of its own (once), which a pool of one could
                // not give while the transaction holds it.
                let form = store.claim_form().await?;
                let mut tx = store.pool.begin().await?;
                mysql::mark_transaction(&mut tx).await?;
                Tx::MySql(tx, form, effect)
            }
        })
    }
}

impl SideEffect {
    /// The most bytes one record's values may take in the store, if it has a limit: MySQL/MariaDB take statements of
    /// at most `max_allowed_packet` (see [`mysql::side_effect::SideEffect::max_record_bytes`]).
    pub fn max_record_bytes(&self) -> Option<u64> {
        match self {
            SideEffect::Sql(SqlSideEffect::Postgres(..)) => None,
            #[cfg(feature = "redis")]
            SideEffect::Script(..) => None,
            #[cfg(feature = "mysql")]
            SideEffect::Sql(SqlSideEffect::MySql(_, s)) => Some(s.max_record_bytes()),
        }
    }

    /// What `check` says about the store's limits, one line each.
    pub fn notes(&self) -> Vec<String> {
        match self {
            SideEffect::Sql(SqlSideEffect::Postgres(..)) => Vec::new(),
            #[cfg(feature = "redis")]
            SideEffect::Script(..) => Vec::new(),
            #[cfg(feature = "mysql")]
            SideEffect::Sql(SqlSideEffect::MySql(_, s)) => vec![format!(
                "the server's max_allowed_packet is {} bytes: a record whose values take more than {} bytes goes to the dead \
                 letters (param_invalid), and a dead letter keeps the first {} bytes of a payload over that with its size and \
                 SHA-256; raise max_allowed_packet for larger records",
                s.max_allowed_packet(),
                s.max_record_bytes(),
                crate::record::OVERSIZED_PREFIX_BYTES
            )],
        }
    }
}

/// The server session a batch transaction runs in, as [`Tx::mark_attempt`] learned it: PostgreSQL's backend pid
/// with its transaction's start (`now()`, which `pg_stat_activity.xact_start` shows: a pid alone may belong to
/// another session by the time it is used), MySQL/MariaDB's connection id (for the logs: it is not used to end a session).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Session {
    /// `(pg_backend_pid(), now() in microseconds since the Unix epoch)`.
    Postgres(i32, i64),
    /// `CONNECTION_ID()`.
    MySql(u64),
}


/// One open batch transaction with the side effect it runs ([`SqlSideEffect::begin`]). Dropped without
/// [`Tx::commit`], it rolls back.
pub enum Tx<'a> {
    /// PostgreSQL.
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>, &'a postgres::side_effect::SideEffect),
    /// MySQL or MariaDB, with how its claim learns which keys were new.
    #[cfg(feature = "mysql")]
    MySql(sqlx::Transaction<'static, sqlx::MySql>, mysql::ClaimForm, &'a mysql::side_effect::SideEffect),
}

impl Tx<'_> {
    /// `COMMIT`.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => tx.commit().await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => tx.commit().await,
        }
    }

    /// Whether the batch transaction is still open, just before `COMMIT`: a side effect may have ended it (on
    /// MySQL/MariaDB a procedure's `COMMIT` or an implicit commit; see [`mysql::transaction_open`]). PostgreSQL
    /// refuses transaction control inside a function or a procedure called in a transaction block, so it is
    /// always open there.
    pub async fn still_open(&mut self) -> Result<bool, sqlx::Error> {
        match self {
            Tx::Postgres(..) => Ok(true),
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::transaction_open(tx).await,
        }
    }

    /// `ROLLBACK`.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => tx.rollback().await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => tx.rollback().await,
        }
    }

    /// Runs SQL without parameters on the simple (text) protocol: no prepared statement, so nothing collides
    /// behind a transaction-pooling proxy.
    async fn raw(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        use sqlx::Executor as _;
        match self {
            Tx::Postgres(tx, _) => tx.execute(sqlx::raw_sql(sql)).await.map(drop),
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => tx.execute(sqlx::raw_sql(sql)).await.map(drop),
        }
    }

    /// `SAVEPOINT` (one record of the slow path).
    pub async fn savepoint(&mut self) -> Result<(), sqlx::Error> {
        self.raw("SAVEPOINT idemflow_record").await
    }

    /// `RELEASE SAVEPOINT`: keeps what the record did.
    pub async fn release_savepoint(&mut self) -> Result<(), sqlx::Error> {
        self.raw("RELEASE SAVEPOINT idemflow_record").await
    }

    /// `ROLLBACK TO SAVEPOINT` then `RELEASE`: undoes what the record did, the transaction goes on.
    pub async fn rollback_to_savepoint(&mut self) -> Result<(), sqlx::Error> {
        self.raw("ROLLBACK TO SAVEPOINT idemflow_record").await?;
        self.raw("RELEASE SAVEPOINT idemflow_record").await
    }

    /// Starts the side effect in this transaction (settings, locks, and a check that the schema is still the one
    /// its statements were built for). Returns `false` when it changed: roll back and prepare again.
    pub async fn begin_side_effect(&mut self) -> Result<bool, sqlx::Error> {
        match self {
            Tx::Postgres(tx, s) => s.begin(tx).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, s) => s.begin(tx).await,
        }
    }

    /// Applies the side effect for all `rows` (the fast path).
    pub async fn apply_all(&mut self, rows: &[&Apply]) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, s) => s.apply_all(tx, rows).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, s) => s.apply_all(tx, rows).await,
        }
    }

    /// Applies the side effect for one record (the slow path).
    pub async fn apply_one(&mut self, row: &Apply) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, s) => s.apply_one(tx, row).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, s) => s.apply_one(tx, row).await,
        }
    }

    /// Claims distinct keys in one statement, insert-then-check. Returns the digests of the keys that were new.
    pub async fn claim(&mut self, pipeline: &str, claims: &[Claim<'_>]) -> Result<crate::store::rows::Digests, sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::dedup::claim(tx, pipeline, claims).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, form, _) => mysql::dedup::claim(tx, *form, pipeline, claims).await,
        }
    }

    /// Reads the dedup rows of keys that the claim did not return, by their keys' digests.
    pub async fn existing(&mut self, pipeline: &str, keys: &[&BusinessKey]) -> Result<Vec<([u8; 32], Existing)>, sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::dedup::existing(tx, pipeline, keys).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::dedup::existing(tx, pipeline, keys).await,
        }
    }

    /// Adds skipped duplicates to their keys' dedup rows, in key id order (two workers cannot deadlock on them).
    pub async fn count_duplicates(&mut self, pipeline: &str, counts: &[(&BusinessKey, i64)]) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::dedup::count_duplicates(tx, pipeline, counts).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::dedup::count_duplicates(tx, pipeline, counts).await,
        }
    }

    /// Writes one dead letter. Returns `false` when this record (its position and payload) was already dead-lettered
    /// (a redelivery).
    pub async fn write_dead_letter(&mut self, pipeline: &str, record: &Record, reason: DeadLetterReason, error: &str) -> Result<bool, sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::dead_letter::write(tx, pipeline, record, reason, error).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::dead_letter::write(tx, pipeline, record, reason, error).await,
        }
    }

    /// The dead letters of `pipeline` stored for `records` (by position and payload), as `(position, reason, error)`.
    pub async fn dead_letters_at(
        &mut self,
        pipeline: &str,
        records: &[&Record],
    ) -> Result<Vec<(crate::record::Position, String, String)>, sqlx::Error> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Tx::Postgres(tx, _) => postgres::dead_letter::at(tx, pipeline, records).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::dead_letter::at(tx, pipeline, records).await,
        }
    }

    /// Deletes dead letters of `pipeline` by id (their replay is under way in this transaction).
    pub async fn delete_dead_letters(&mut self, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::dead_letter::delete(tx, pipeline, ids).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::dead_letter::delete(tx, pipeline, ids).await,
        }
    }

    /// Stores `positions` for the partitions whose epoch is still the one presented. Returns the partitions that
    /// were fenced; the caller must then roll the whole transaction back.
    pub async fn advance_offsets(&mut self, pipeline: &str, positions: &Positions) -> Result<Vec<(String, i32)>, sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::offsets::advance(tx, pipeline, positions).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::offsets::advance(tx, pipeline, positions).await,
        }
    }

    /// Locks and reads the processed marks of the batch's partitions (`first`: each one's first offset in the batch,
    /// where a missing mark is created), first in the batch transaction.
    pub async fn processed(&mut self, pipeline: &str, first: &NextOffsets) -> Result<Processed, sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::offsets::processed(tx, pipeline, first).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::offsets::processed(tx, pipeline, first).await,
        }
    }

    /// Raises the processed marks and floors of the batch's partitions to `next` (never lowers them), last before
    /// `COMMIT`.
    pub async fn raise_processed(&mut self, pipeline: &str, next: &NextOffsets) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::offsets::raise_processed(tx, pipeline, next).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::offsets::raise_processed(tx, pipeline, next).await,
        }
    }

    /// Records `attempt` as lane `owner`'s latest batch attempt of `pipeline` (first in the batch transaction) and
    /// returns the one recorded before it: the latest attempt of that lane that committed. A previous attempt still
    /// open on the server is waited for.
    ///
    /// Also returns the server session the transaction runs in ([`Session`]): an attempt abandoned on
    /// `batch_timeout` is ended by it ([`Store::end_session`]).
    pub async fn mark_attempt(&mut self, pipeline: &str, owner: &str, attempt: i64) -> Result<(Option<i64>, Session), sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::offsets::mark_attempt(tx, pipeline, owner, attempt).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::offsets::mark_attempt(tx, pipeline, owner, attempt).await,
        }
    }

    /// Sets the processed marks and floors of `partitions` (`(topic, partition, next offset)`) afresh: their topic
    /// was created again since the marks were raised ([`crate::offsets::Replay::Recreated`]).
    pub async fn renew_processed(&mut self, pipeline: &str, partitions: &[(&str, i32, i64)]) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx, _) => postgres::offsets::renew_processed(tx, pipeline, partitions).await,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx, _, _) => mysql::offsets::renew_processed(tx, pipeline, partitions).await,
        }
    }
}
