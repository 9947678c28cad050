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

pub mod contract;
pub mod disposition;
pub mod error;
pub mod open;
pub mod redis_command;
pub mod rename;
pub mod rows;
pub mod spec;
pub mod template;

pub use contract::{BatchTx, Connector, PrepareError, PreparedEffect, Session, StoreError, ATTEMPT_ROWS_KEPT, FORGET_REFUSED_WITHIN};
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod postgres;
pub mod redis;

use crate::store::spec::{Binding, SinkSpec, TimeSettings};
use crate::field::Render;
use crate::key::BusinessKey;
use crate::offsets::{Claimed, Logs, NextOffsets, Positions, Processed, Renewal};
use crate::store::rows::Apply;
use crate::record::Record;
use crate::retention::{PurgeOutcome, Slice, Sweep, SweepState};
use crate::dead_letter::Stored;
use crate::store::rows::{Claim, Existing, Explained};
use crate::metrics::DeadLetterReason;

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

/// Why a store this build leaves out cannot be used: `what` (the store) and the cargo `feature` to build with.
pub fn not_built(what: &str, feature: &str) -> String {
    format!("this idemflow was built without {what} (build it with `cargo build --release --features {feature}`, or with the default features)")
}

/// The one list of stores, as a dispatch: `each_store!(store, |s| expr)` is `expr` on the store's own connector
/// `s` ([`Connector`]).
macro_rules! each_store {
    ($store:expr, |$s:ident| $e:expr) => {
        match $store {
            Store::Postgres($s) => $e,
            #[cfg(feature = "mysql")]
            Store::MySql($s) => $e,
            #[cfg(feature = "redis")]
            Store::Redis($s) => $e,
        }
    };
}

impl Store {
    /// Creates or upgrades idemflow's tables; returns the schema version now ([`Connector::migrate`]).
    ///
    /// Errors: the migration's (the database unreachable, a migration changed since it was applied).
    pub async fn migrate(&self) -> Result<i64, sqlx::migrate::MigrateError> {
        each_store!(self, |s| Connector::migrate(s).await)
    }

    /// Whether idemflow's tables are migrated to the version this binary needs, with the unique index the claim
    /// depends on ([`Connector::check_schema`]).
    ///
    /// Errors: [`contract::NotReady`]: what is missing and what to run, or that the store could not be asked.
    pub async fn check_schema(&self) -> Result<(), contract::NotReady> {
        each_store!(self, |s| Connector::check_schema(s).await)
    }

    /// Closes the pool, waiting for connections in use to be returned.
    pub async fn close(&self) {
        each_store!(self, |s| Connector::close(s).await)
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
        // Unavailable where a batch would retry the same error (a wrong password would never succeed).
        let unavailable = |e: sqlx::Error, retry: bool| PrepareError { field: "database".into(), message: format!("cannot connect: {e}"), unavailable: retry };
        let refuse = |field: &str, message: &str| Err(PrepareError { field: field.into(), message: message.into(), unavailable: false });
        match (self, spec) {
            (Store::Postgres(pool), SinkSpec::Sql(effect)) => {
                let mut conn = pool.acquire().await.map_err(|e| {
                    let retry = postgres::error::classify_error(&e).is_retry();
                    unavailable(e, retry)
                })?;
                let (s, b) = postgres::side_effect::SideEffect::prepare(&mut conn, effect, time).await?;
                Ok((SideEffect::Sql(SqlSideEffect::Postgres(pool.clone(), s)), b))
            }
            #[cfg(feature = "mysql")]
            (Store::MySql(store), SinkSpec::Sql(effect)) => {
                let mut conn = store.pool.acquire().await.map_err(|e| {
                    let retry = mysql::error::classify_error(&e).is_retry();
                    unavailable(e, retry)
                })?;
                let (s, b) = mysql::side_effect::SideEffect::prepare(&mut conn, effect, time).await?;
                Ok((SideEffect::Sql(SqlSideEffect::MySql(store.clone(), s)), b))
            }
            #[cfg(feature = "redis")]
            (Store::Redis(r), SinkSpec::Redis(effect)) => {
                let (s, b) = redis::side_effect::SideEffect::prepare(r, effect).await?;
                Ok((SideEffect::Script(r.clone(), s), b))
            }
            #[cfg(feature = "redis")]
            (Store::Redis(_), SinkSpec::Sql(_)) => refuse("sink", "a SQL side effect needs [database], not [redis]"),
            (_, SinkSpec::Redis(_)) => refuse("sink.redis", "a Redis side effect runs in [redis], not in the database"),
        }
    }

    /// Takes ownership of `partitions` for `pipeline` (`[offsets] store = "database"`): increments each one's
    /// epoch and returns the stored positions. `owner` is recorded for operators.
    ///
    /// Errors: any database error (the caller retries).
    pub async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, StoreError> {
        each_store!(self, |s| Connector::claim_offsets(s, pipeline, owner, partitions).await)
    }

    /// Partitions of `pipeline`, among `owned` (assigned to this worker), whose positions as this worker stored
    /// them the store no longer holds: Redis after it lost its last writes. Always none for the databases, which keep
    /// what they committed.
    pub async fn lost_positions(&self, pipeline: &str, owned: &[(String, i32)]) -> Result<Vec<(String, i32)>, StoreError> {
        each_store!(self, |s| Connector::lost_positions(s, pipeline, owned).await)
    }

    /// The stored positions of `pipeline`: `(topic, partition, next offset)`.
    pub async fn stored_offsets(&self, pipeline: &str) -> Result<Vec<(String, i32, Option<i64>)>, StoreError> {
        each_store!(self, |s| Connector::stored_offsets(s, pipeline).await)
    }

    /// Sets the stored positions of `pipeline` (`idemflow rewind`) and increments their epochs, so a worker still
    /// holding one of these partitions is fenced. Returns how many rows were written.
    pub async fn reset_offsets(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        each_store!(self, |s| Connector::reset_offsets(s, pipeline, positions).await)
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
        each_store!(self, |s| Connector::end_session(s, session).await)
    }

    /// `idemflow dedup forget`: deletes the dedup rows of `pipeline` that `what` names (only reads them with
    /// `dry_run`) and lowers the processed floors of their partitions to the lowest offset forgotten, in one
    /// transaction; returns the rows as they were. Refused while a worker of the pipeline recorded a batch attempt
    /// within [`FORGET_REFUSED_WITHIN`].
    ///
    /// Errors: the database's; [`StoreError::Refused`] for Redis (its dedup keys are `SET NX PX` keys: delete them with
    /// `DEL`) and while a worker runs.
    pub async fn forget(&self, pipeline: &str, what: &rows::Forget, dry_run: bool) -> Result<rows::Forgotten, StoreError> {
        let running = each_store!(self, |s| Connector::recent_attempts(s, pipeline, FORGET_REFUSED_WITHIN).await)?;
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
        let mut forgotten = each_store!(self, |s| Connector::forget(s, pipeline, what, dry_run).await)?;
        forgotten.running = running;
        Ok(forgotten)
    }

    /// `idemflow pipeline rename`: moves every row of pipeline `old`'s history under `new` in one transaction
    /// ([`Connector::rename_pipeline`]; only counts them with `dry_run`). Refused while a worker of `old` recorded a
    /// batch attempt within [`rename::RUNNING_WITHIN`] (checked in the rename's transaction, after waiting for a
    /// batch in flight), and where `new` has a history.
    ///
    /// Errors: the database's; [`StoreError::Refused`] as above, and for a store that cannot rename (Redis).
    pub async fn rename_pipeline(&self, old: &str, new: &str, dry_run: bool) -> Result<rows::Renamed, StoreError> {
        each_store!(self, |s| Connector::rename_pipeline(s, old, new, dry_run).await)
    }

    /// Lowers the floors of `pipeline`'s processed marks to where `idemflow rewind` moves its consumer group
    /// (`(topic, partition, offset)`; see [`crate::offsets::Mark::floor`]), so the replay is consumed and applied
    /// where no dedup row covers it any more. Returns how many marks changed. Redis keeps no floor: nothing to do.
    pub async fn lower_floors(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        each_store!(self, |s| Connector::lower_floors(s, pipeline, positions).await)
    }

    /// Where `pipeline`'s retention sweep stands ([`Connector::sweep_state`]); `None` where nothing is swept.
    ///
    /// Errors: the store's.
    pub async fn sweep_state(&self, pipeline: &str) -> Result<Option<SweepState>, StoreError> {
        each_store!(self, |s| Connector::sweep_state(s, pipeline).await)
    }

    /// Runs one pass of a retention sweep ([`crate::retention::sweep_pass`]): slices of about `sweep.rows` rows each
    /// ([`Connector::sweep_slice`]) at `sweep.pace`, until the pass ends, another replica is found sweeping, or the
    /// pass is not due; `on_slice` is told of each committed slice. Redis sweeps nothing: its dedup keys expire by
    /// themselves (their TTL is the retention), and its pass ends at once.
    ///
    /// Errors: the store's; the slices committed before it stay, and the next pass resumes at the stored cursor.
    pub async fn sweep_pass(&self, sweep: &Sweep<'_>, on_slice: impl FnMut(&Slice) + Send) -> Result<PurgeOutcome, StoreError> {
        let slice = |restart| async move { each_store!(self, |s| Connector::sweep_slice(s, sweep, restart).await) };
        crate::retention::sweep_pass(sweep.pace, slice, on_slice).await
    }

    /// Gives up this replica's lease on the pipeline's pass ([`Connector::release_sweep`]), the cursor kept.
    ///
    /// Errors: the store's.
    pub async fn release_sweep(&self, sweep: &Sweep<'_>) -> Result<(), StoreError> {
        each_store!(self, |s| Connector::release_sweep(s, sweep).await)
    }

    /// What the dedup store knows of one business key (`idemflow explain`).
    pub async fn explain(&self, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, StoreError> {
        each_store!(self, |s| Connector::explain(s, pipeline, key).await)
    }

    /// The newest `limit` dead letters, optionally of one pipeline.
    pub async fn dead_letters(&self, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, StoreError> {
        each_store!(self, |s| Connector::dead_letters(s, pipeline, limit).await)
    }

    /// One dead letter by id.
    pub async fn dead_letter(&self, id: i64) -> Result<Option<Stored>, StoreError> {
        each_store!(self, |s| Connector::dead_letter(s, id).await)
    }

    /// Whether this store can keep an outbox ([`Connector::outbox_ready`]).
    ///
    /// Errors: why not.
    pub async fn outbox_ready(&self) -> Result<(), contract::NotReady> {
        each_store!(self, |s| Connector::outbox_ready(s).await)
    }

    /// Leases up to `limit` due outbox rows of `pipeline` to `owner` for `lease` ([`Connector::outbox_lease`]).
    ///
    /// Errors: the store's; [`StoreError::Refused`] where there is no outbox (Redis).
    pub async fn outbox_lease(&self, pipeline: &str, owner: &str, limit: i64, lease: std::time::Duration) -> Result<Vec<rows::Leased>, StoreError> {
        each_store!(self, |s| Connector::outbox_lease(s, pipeline, owner, limit, lease).await)
    }

    /// Records what became of leased outbox rows, in one transaction; returns the failed rows moved to the dead
    /// letters ([`Connector::outbox_settle`]).
    ///
    /// Errors: the store's.
    pub async fn outbox_settle(&self, pipeline: &str, owner: &str, settled: &[rows::Settled]) -> Result<Vec<i64>, StoreError> {
        if settled.is_empty() {
            return Ok(Vec::new());
        }
        each_store!(self, |s| Connector::outbox_settle(s, pipeline, owner, settled).await)
    }

    /// How `pipeline`'s outbox stands: rows waiting (up to `up_to`), the oldest's age ([`Connector::outbox_depth`]).
    ///
    /// Errors: the store's.
    pub async fn outbox_depth(&self, pipeline: &str, up_to: i64) -> Result<rows::OutboxDepth, StoreError> {
        each_store!(self, |s| Connector::outbox_depth(s, pipeline, up_to).await)
    }

    /// The outbox requests of a business key not yet confirmed ([`Connector::key_requests`]; `idemflow explain`).
    pub async fn key_requests(&self, pipeline: &str, digest: &[u8]) -> Result<Vec<rows::KeyRequest>, StoreError> {
        each_store!(self, |s| Connector::key_requests(s, pipeline, digest).await)
    }

    /// `idemflow outbox retry-now` ([`Connector::outbox_retry_now`]).
    pub async fn outbox_retry_now(&self, pipeline: &str, target: Option<&str>, digest: Option<&[u8]>) -> Result<u64, StoreError> {
        each_store!(self, |s| Connector::outbox_retry_now(s, pipeline, target, digest).await)
    }

    /// Every pipeline's and target's requests not yet delivered ([`Connector::unsent`]): `check` and the worker's
    /// start name those of a pipeline or target that is not configured, which no relay sends.
    pub async fn unsent(&self) -> Result<Vec<rows::Unsent>, StoreError> {
        each_store!(self, |s| Connector::unsent(s).await)
    }

    /// Gives up `owner`'s leases on `pipeline`'s outbox rows ([`Connector::outbox_release`]).
    ///
    /// Errors: the store's.
    pub async fn outbox_release(&self, pipeline: &str, owner: &str) -> Result<u64, StoreError> {
        each_store!(self, |s| Connector::outbox_release(s, pipeline, owner).await)
    }

    /// Which pipelines have processed records of `topics` ([`Connector::histories`]).
    ///
    /// Errors: the store's.
    pub async fn histories(&self, topics: &[String]) -> Result<Vec<rows::History>, StoreError> {
        each_store!(self, |s| Connector::histories(s, topics).await)
    }

    /// Puts a `delivery_failed` dead letter's request back in the outbox, re-homed by `rehome`
    /// ([`Connector::outbox_requeue`]).
    ///
    /// Errors: the store's; [`StoreError::Refused`] where there is no outbox.
    pub async fn outbox_requeue(&self, id: i64, rehome: &str) -> Result<Option<i64>, StoreError> {
        each_store!(self, |s| Connector::outbox_requeue(s, id, rehome).await)
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
            SqlSideEffect::Postgres(pool, effect) => Tx::Postgres(postgres::connector::PgTx { tx: pool.begin().await?, effect }),
            #[cfg(feature = "mysql")]
            SqlSideEffect::MySql(store, effect) => {
                // The claim form first: reading it takes a connection of its own (once), which a pool of one could
                // not give while the transaction holds it.
                let form = store.claim_form().await?;
                let mut tx = store.pool.begin().await?;
                mysql::mark_transaction(&mut tx).await?;
                Tx::MySql(mysql::connector::MyTx { tx, form, effect })
            }
        })
    }
}

/// The side effects of every store, as a dispatch: `each_effect!(side_effect, |s| expr)` is `expr` on the store's
/// own side effect `s` ([`contract::PreparedEffect`]).
macro_rules! each_effect {
    ($effect:expr, |$s:ident| $e:expr) => {
        match $effect {
            SideEffect::Sql(SqlSideEffect::Postgres(_, $s)) => $e,
            #[cfg(feature = "mysql")]
            SideEffect::Sql(SqlSideEffect::MySql(_, $s)) => $e,
            #[cfg(feature = "redis")]
            SideEffect::Script(_, $s) => $e,
        }
    };
}

impl SideEffect {
    /// The most bytes one record's values may take in the store, if it has a limit ([`PreparedEffect::max_record_bytes`]).
    pub fn max_record_bytes(&self) -> Option<u64> {
        each_effect!(self, |s| PreparedEffect::max_record_bytes(s))
    }

    /// What `check` says about the store's limits, one line each ([`PreparedEffect::notes`]).
    pub fn notes(&self) -> Vec<String> {
        each_effect!(self, |s| PreparedEffect::notes(s))
    }
}

/// One open batch transaction with the side effect it runs ([`SqlSideEffect::begin`]), of a store with interactive
/// transactions ([`BatchTx`]). Dropped without [`Tx::commit`], it rolls back.
pub enum Tx<'a> {
    /// PostgreSQL.
    Postgres(postgres::connector::PgTx<'a>),
    /// MySQL or MariaDB.
    #[cfg(feature = "mysql")]
    MySql(mysql::connector::MyTx<'a>),
}

/// The one list of stores with interactive transactions, as a dispatch: `each_tx!(tx, |t| expr)` is `expr` on the
/// store's own transaction `t` ([`BatchTx`]).
macro_rules! each_tx {
    ($tx:expr, |$t:ident| $e:expr) => {
        match $tx {
            Tx::Postgres($t) => $e,
            #[cfg(feature = "mysql")]
            Tx::MySql($t) => $e,
        }
    };
}

impl Tx<'_> {
    /// `COMMIT`.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.commit().await)
    }

    /// Whether the batch transaction is still open, just before `COMMIT`: a side effect may have ended it (on
    /// MySQL/MariaDB a procedure's `COMMIT` or an implicit commit; see [`mysql::transaction_open`]). PostgreSQL
    /// refuses transaction control inside a function or a procedure called in a transaction block, so it is
    /// always open there.
    pub async fn still_open(&mut self) -> Result<bool, sqlx::Error> {
        each_tx!(self, |t| t.still_open().await)
    }

    /// `ROLLBACK`.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.rollback().await)
    }

    /// Runs SQL without parameters on the simple (text) protocol: no prepared statement, so nothing collides
    /// behind a transaction-pooling proxy.
    async fn raw(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.raw(sql).await)
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
        each_tx!(self, |t| t.begin_side_effect().await)
    }

    /// Applies the side effect for one record (the slow path).
    pub async fn apply_one(&mut self, row: &Apply) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.apply_one(row).await)
    }

    /// Claims distinct keys in one statement, insert-then-check. Returns the digests of the keys that were new.
    pub async fn claim(&mut self, pipeline: &str, claims: &[Claim<'_>]) -> Result<crate::store::rows::Digests, sqlx::Error> {
        each_tx!(self, |t| t.claim(pipeline, claims).await)
    }

    /// Claims `claims` and applies the side effect for those of `rows` (one per claim, in the batch's order) whose
    /// keys were new ([`BatchTx::claim_and_apply`]): one statement where the store can, two otherwise. Returns the
    /// digests of the keys that were new.
    pub async fn claim_and_apply(&mut self, pipeline: &str, claims: &[Claim<'_>], rows: &[&Apply]) -> Result<crate::store::rows::Digests, sqlx::Error> {
        each_tx!(self, |t| t.claim_and_apply(pipeline, claims, rows).await)
    }

    /// Reads the dedup rows of keys that the claim did not return, by their keys' digests.
    pub async fn existing(&mut self, pipeline: &str, keys: &[&BusinessKey]) -> Result<Vec<([u8; 32], Existing)>, sqlx::Error> {
        each_tx!(self, |t| t.existing(pipeline, keys).await)
    }

    /// Adds skipped duplicates to their keys' dedup rows, in key id order (two workers cannot deadlock on them).
    pub async fn count_duplicates(&mut self, pipeline: &str, counts: &[(&BusinessKey, i64)]) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.count_duplicates(pipeline, counts).await)
    }

    /// Writes the outbox requests of records whose keys this batch claimed as new ([`BatchTx::write_outbox`]).
    pub async fn write_outbox(&mut self, pipeline: &str, rows: &[(&Record, &Apply)]) -> Result<(), sqlx::Error> {
        if rows.iter().all(|(_, a)| a.requests.is_empty()) {
            return Ok(());
        }
        each_tx!(self, |t| t.write_outbox(pipeline, rows).await)
    }

    /// Writes one dead letter. Returns `false` when this record (its position and payload) was already dead-lettered
    /// (a redelivery).
    pub async fn write_dead_letter(&mut self, pipeline: &str, record: &Record, reason: DeadLetterReason, error: &str) -> Result<bool, sqlx::Error> {
        each_tx!(self, |t| t.write_dead_letter(pipeline, record, reason, error).await)
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
        each_tx!(self, |t| t.dead_letters_at(pipeline, records).await)
    }

    /// Deletes dead letters of `pipeline` by id (their replay is under way in this transaction).
    pub async fn delete_dead_letters(&mut self, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error> {
        each_tx!(self, |t| t.delete_dead_letters(pipeline, ids).await)
    }

    /// Stores `positions` for the partitions whose epoch is still the one presented. Returns the partitions that
    /// were fenced; the caller must then roll the whole transaction back.
    pub async fn advance_offsets(&mut self, pipeline: &str, positions: &Positions) -> Result<Vec<(String, i32)>, sqlx::Error> {
        each_tx!(self, |t| t.advance_offsets(pipeline, positions).await)
    }

    /// Locks and reads the processed marks of the batch's partitions (`first`: each one's first offset in the batch,
    /// where a missing mark is created), first in the batch transaction.
    pub async fn processed(&mut self, pipeline: &str, first: &NextOffsets) -> Result<Processed, sqlx::Error> {
        each_tx!(self, |t| t.processed(pipeline, first).await)
    }

    /// Raises the processed marks and floors of the batch's partitions to `next` (never lowers them), last before
    /// `COMMIT`, and records the identity of each partition's log where `logs` gives one ([`crate::offsets::Log::id`]).
    pub async fn raise_processed(&mut self, pipeline: &str, next: &NextOffsets, logs: &Logs) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.raise_processed(pipeline, next, logs).await)
    }

    /// Records `attempt` as lane `owner`'s latest batch attempt of `pipeline` (first in the batch transaction) and
    /// returns the one recorded before it: the latest attempt of that lane that committed. A previous attempt still
    /// open on the server is waited for.
    ///
    /// Also returns the server session the transaction runs in ([`Session`]): an attempt abandoned on
    /// `batch_timeout` is ended by it ([`Store::end_session`]).
    pub async fn mark_attempt(&mut self, pipeline: &str, owner: &str, attempt: i64) -> Result<(Option<i64>, Session), sqlx::Error> {
        each_tx!(self, |t| t.mark_attempt(pipeline, owner, attempt).await)
    }

    /// Sets the processed marks and floors of `renewed` afresh, with their logs' identities: the log is not the one
    /// the marks were raised on ([`crate::offsets::Processed::renewals`]).
    pub async fn renew_processed(&mut self, pipeline: &str, renewed: &[Renewal]) -> Result<(), sqlx::Error> {
        each_tx!(self, |t| t.renew_processed(pipeline, renewed).await)
    }
}

/// The part of a store a broker's consumer uses with `[offsets] store = "database"`: claiming its partitions'
/// stored positions, and nothing else of the [`Store`] (not its batches, its dead letters, its rewinds).
#[derive(Clone)]
pub struct PositionStore(Store);

impl PositionStore {
    /// The positions kept in `store`.
    pub fn new(store: Store) -> PositionStore {
        PositionStore(store)
    }

    /// [`Store::claim_offsets`]: takes ownership of `partitions` for `pipeline`, returns their stored positions.
    ///
    /// Errors: any store error (the caller retries).
    pub async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, StoreError> {
        self.0.claim_offsets(pipeline, owner, partitions).await
    }
}
