//! The contract every store's connector implements, and the errors it answers with: a leaf of `store/` that the
//! store folders import (never the hub, [`super`], which imports them).
//!
//! - [`Connector`]: a store's connection pool and what runs outside a batch (migrations, the schema check, stored
//!   positions, retention, `explain`, dead letters, `dedup forget`). What only some stores do (lose positions, end
//!   an abandoned session, keep processed floors, purge) has a default that means "this store cannot" or "has
//!   nothing to do".
//! - [`BatchTx`]: one open batch transaction of a store with interactive transactions (PostgreSQL, MySQL/MariaDB),
//!   with every step the batch protocol (the sink) takes in it. Redis has none: its batch is one script.
//!
//! The hub ([`super::Store`], [`super::Tx`]) keeps the one list of stores: a closed enum each, dispatched by one
//! macro, every method one line, as [`crate::source`] does for brokers.

use crate::dead_letter::Stored;
use crate::key::BusinessKey;
use crate::metrics::DeadLetterReason;
use crate::offsets::{Claimed, Logs, NextOffsets, Positions, Processed, Renewal};
use crate::record::{Position, Record};
use crate::retention::{Slice, Sweep, SweepState};
use crate::store::rows::{Apply, Claim, Digests, Existing, Explained, Forget, Forgotten, Leased, KeyRequest, OutboxDepth, Renamed, Settled, Unsent};
use std::time::Duration;

/// `idemflow dedup forget` is refused while a lane of the pipeline recorded a batch attempt this recently.
pub const FORGET_REFUSED_WITHIN: Duration = Duration::from_secs(60);

/// How long a lane's row in the attempts table is kept after its last batch (see [`BatchTx::mark_attempt`]): the purge
/// deletes older ones, left by workers that stopped.
pub const ATTEMPT_ROWS_KEPT: Duration = Duration::from_secs(24 * 3600);

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

/// Why a store cannot be used yet ([`Connector::check_schema`], [`crate::store::open::Stores::open`]): the
/// worker waits out the first and stops on the second.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// The store could not be asked (a connection refused, lost or timed out, the pool timed out, a pooler's
    /// protocol error): what a store's own classification retries in a batch. Worth waiting for.
    #[error("{0}")]
    Unavailable(String),
    /// The store answered, and what it holds is not what this binary needs (the schema missing or behind, the
    /// dedup key gone, a server idemflow cannot run on), or its settings are refused: an operator must act.
    #[error("{0}")]
    Refused(String),
}

impl NotReady {
    /// `Unavailable(message)` when `transient`, else `Refused(message)`.
    pub fn new(transient: bool, message: String) -> NotReady {
        if transient { NotReady::Unavailable(message) } else { NotReady::Refused(message) }
    }

    /// `Unavailable(message)` where a batch would retry the error behind it (`disposition` is
    /// [`Disposition::Retry`]), else `Refused(message)`: start-up waits for what a batch would wait for.
    pub fn after(disposition: crate::store::disposition::Disposition, message: String) -> NotReady {
        NotReady::new(disposition.is_retry(), message)
    }

    /// Whether waiting may help.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, NotReady::Unavailable(_))
    }

    /// The same, its message prefixed with `what` (`database: ...`).
    pub fn within(self, what: &str) -> NotReady {
        match self {
            NotReady::Unavailable(m) => NotReady::Unavailable(format!("{what}: {m}")),
            NotReady::Refused(m) => NotReady::Refused(format!("{what}: {m}")),
        }
    }
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

/// The server session a batch transaction runs in, as [`BatchTx::mark_attempt`] learned it: PostgreSQL's backend
/// pid with its transaction's start (`now()`, which `pg_stat_activity.xact_start` shows: a pid alone may belong to
/// another session by the time it is used), MySQL/MariaDB's connection id (for the logs: it is not used to end a
/// session).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Session {
    /// `(pg_backend_pid(), now() in microseconds since the Unix epoch)`.
    Postgres(i32, i64),
    /// `CONNECTION_ID()`.
    MySql(u64),
}

/// A pipeline's side effect as its store built it: what the configuration and `check` ask of it.
pub trait PreparedEffect {
    /// The most bytes one record's values may take in the store, if it has a limit. Default: none.
    fn max_record_bytes(&self) -> Option<u64> {
        None
    }

    /// What `check` says about the store's limits, one line each. Default: nothing to say.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

/// What a store's durability report needs to know of one pipeline writing to it.
#[derive(Clone, Debug)]
pub struct Tenant {
    /// The pipeline's name.
    pub name: String,
    /// `[dedup] retention`.
    pub retention: Duration,
    /// Whether its source has positions to resume from (a queue has none: an acknowledged message is gone).
    pub has_positions: bool,
}

/// A store's connection and what runs outside a batch. Implemented in each store's folder, behind its feature.
// Dispatched statically through the hub's enum, on the concrete types: their futures' `Send` is known there.
#[allow(async_fn_in_trait)]
pub trait Connector: Send + Sync {
    /// Creates or upgrades idemflow's tables; returns the schema version now.
    ///
    /// Errors: the migration's (the database unreachable, a migration changed since it was applied).
    async fn migrate(&self) -> Result<i64, sqlx::migrate::MigrateError>;

    /// Whether idemflow's tables are migrated to the version this binary needs, with the unique index the claim
    /// depends on.
    ///
    /// Errors: [`NotReady::Refused`] with what is missing and what to run; [`NotReady::Unavailable`] when the
    /// store could not be asked.
    async fn check_schema(&self) -> Result<(), NotReady>;

    /// Closes the pool, waiting for connections in use to be returned. Default: nothing to close.
    async fn close(&self) {}

    /// Takes ownership of `partitions` for `pipeline`: increments each one's epoch and returns the stored positions.
    ///
    /// Errors: the store's (the caller retries).
    async fn claim_offsets(&self, pipeline: &str, owner: &str, partitions: &[(String, i32)]) -> Result<Vec<Claimed>, StoreError>;

    /// Partitions of `pipeline`, among `owned`, whose positions as this worker stored them the store no longer
    /// holds. Default: none (a store that keeps what it committed).
    async fn lost_positions(&self, _pipeline: &str, _owned: &[(String, i32)]) -> Result<Vec<(String, i32)>, StoreError> {
        Ok(Vec::new())
    }

    /// The stored positions of `pipeline`: `(topic, partition, next offset)`.
    async fn stored_offsets(&self, pipeline: &str) -> Result<Vec<(String, i32, Option<i64>)>, StoreError>;

    /// Sets the stored positions of `pipeline` and increments their epochs. Returns how many rows were written.
    async fn reset_offsets(&self, pipeline: &str, positions: &[(String, i32, i64)]) -> Result<u64, StoreError>;

    /// Ends the server session of a batch attempt abandoned before its `COMMIT`. Returns whether one was ended.
    /// Default: nothing can be ended (no sessions, or none that can be matched to their transaction).
    async fn end_session(&self, _session: Session) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// The lanes of `pipeline` that recorded a batch attempt within `within`, with when (`dedup forget` is refused
    /// while there are any).
    ///
    /// Errors: the store's; [`StoreError::Refused`] where keys cannot be forgotten this way.
    async fn recent_attempts(&self, pipeline: &str, within: Duration) -> Result<Vec<(String, String)>, StoreError>;

    /// Deletes the dedup rows of `pipeline` that `what` names (only reads them with `dry_run`) and lowers the
    /// processed floors of their partitions, in one transaction; returns the rows as they were.
    ///
    /// Errors: the store's; [`StoreError::Refused`] where keys cannot be forgotten this way.
    async fn forget(&self, pipeline: &str, what: &Forget, dry_run: bool) -> Result<Forgotten, StoreError>;

    /// Moves every row of pipeline `old`'s history (dedup rows, counts, processed marks, stored positions, attempts,
    /// dead letters, outbox requests, the retention sweep's cursor) under `new`, in one transaction; only counts them
    /// with `dry_run`. Refused, with nothing changed, where `new` already has rows. Default: this store cannot.
    ///
    /// Errors: the store's; [`StoreError::Refused`] where `new` has a history or the store cannot rename.
    async fn rename_pipeline(&self, _old: &str, _new: &str, _dry_run: bool) -> Result<Renamed, StoreError> {
        Err(StoreError::Refused(
            "this store cannot rename a pipeline: keep the old name in the file (name = \"...\"), see docs/operations.md, \"Renaming a pipeline\"".into(),
        ))
    }

    /// Lowers the floors of `pipeline`'s processed marks to `positions`. Returns how many marks changed. Default:
    /// no floors kept, nothing to do.
    async fn lower_floors(&self, _pipeline: &str, _positions: &[(String, i32, i64)]) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// Runs one slice of a retention sweep ([`crate::retention`]): resumes at the stored cursor (takes the pass
    /// over and starts at the beginning of the table with `restart`), examines about `sweep.rows` dedup rows,
    /// deletes those of the pipeline older than its retention, and stores the cursor and the owner's lease, in one
    /// transaction; when the slice ends a pass, also deletes the attempt rows of lanes gone for
    /// [`ATTEMPT_ROWS_KEPT`]. Another replica sweeping the pipeline is not waited for, nor a pass begun before it is
    /// due: the slice says why in [`Slice::skipped`]. Default: nothing to sweep (keys that expire by themselves), a
    /// pass that ends at once.
    ///
    /// Errors: the store's; the slice is rolled back and its cursor stays.
    async fn sweep_slice(&self, _sweep: &Sweep<'_>, _restart: bool) -> Result<Slice, StoreError> {
        Ok(Slice { pass_seconds: Some(0.0), ..Slice::default() })
    }

    /// Gives up `sweep.owner`'s lease on the pipeline's pass, keeping the cursor: the worker stops mid-pass, and
    /// another replica takes the pass over where it stopped at its next slice instead of after the lease
    /// ([`Sweep::lease`]). Nothing when the lease is another's. Default: no lease kept here.
    ///
    /// Errors: the store's; the lease then runs out by itself.
    async fn release_sweep(&self, _sweep: &Sweep<'_>) -> Result<(), StoreError> {
        Ok(())
    }

    /// Where `pipeline`'s retention sweep stands: its passes, the last one's duration, the current one's age.
    /// Default: nothing swept here (`None`).
    ///
    /// Errors: the store's.
    async fn sweep_state(&self, _pipeline: &str) -> Result<Option<SweepState>, StoreError> {
        Ok(None)
    }

    /// What the dedup store knows of one business key (`idemflow explain`).
    async fn explain(&self, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, StoreError>;

    /// The newest `limit` dead letters, optionally of one pipeline.
    async fn dead_letters(&self, pipeline: Option<&str>, limit: i64) -> Result<Vec<Stored>, StoreError>;

    /// One dead letter by id.
    async fn dead_letter(&self, id: i64) -> Result<Option<Stored>, StoreError>;

    /// Whether this store can keep an outbox: `Err` says why not (a store without one, a server without `FOR UPDATE
    /// SKIP LOCKED`). Default: it cannot.
    ///
    /// Errors: [`NotReady::Refused`] with the reason, for the pipeline's `[[sink.http]]`; [`NotReady::Unavailable`]
    /// when the server could not be asked.
    async fn outbox_ready(&self) -> Result<(), NotReady> {
        Err(NotReady::Refused(NO_OUTBOX.to_owned()))
    }

    /// Leases up to `limit` outbox rows of `pipeline` that are due, for `lease`, to `owner` ([`crate::outbox`]): rows
    /// no other relay holds (`FOR UPDATE SKIP LOCKED`, then a lease that outlives the transaction), whose next
    /// attempt is due, and that are the oldest row of their business key (a key's rows go one at a time, in the
    /// order they were written); each one's attempts go up by one. In id order. Default: this store keeps no outbox.
    ///
    /// Errors: the store's; [`StoreError::Refused`] where there is no outbox.
    async fn outbox_lease(&self, _pipeline: &str, _owner: &str, _limit: i64, _lease: Duration) -> Result<Vec<Leased>, StoreError> {
        Err(StoreError::Refused(NO_OUTBOX.to_owned()))
    }

    /// Records what became of leased rows, in one transaction: confirmed rows deleted, rows to retry given a next
    /// attempt and their lease given up (only where `owner` still holds it), failed rows moved to the dead letters
    /// (only where `owner` still holds them, each in one locked step: a row another relay leased meanwhile is never
    /// both delivered and dead-lettered). Returns the failed rows moved, the only ones to count as dead letters.
    /// Default: this store keeps no outbox.
    ///
    /// Errors: the store's (nothing is recorded; the leases run out and the rows are sent again with the same
    /// idempotency key).
    async fn outbox_settle(&self, _pipeline: &str, _owner: &str, _settled: &[Settled]) -> Result<Vec<i64>, StoreError> {
        Err(StoreError::Refused(NO_OUTBOX.to_owned()))
    }

    /// How many rows of `pipeline`'s outbox wait (counted up to `up_to`) and the age of the oldest. Default: none.
    ///
    /// Errors: the store's.
    async fn outbox_depth(&self, _pipeline: &str, _up_to: i64) -> Result<OutboxDepth, StoreError> {
        Ok(OutboxDepth::default())
    }

    /// The outbox requests of `pipeline`'s business key whose digest is `digest` ([`crate::key::BusinessKey::digest`])
    /// not yet confirmed: waiting in the outbox, or `delivery_failed` dead letters. Default: no outbox here.
    ///
    /// Errors: the store's.
    async fn key_requests(&self, _pipeline: &str, _digest: &[u8]) -> Result<Vec<KeyRequest>, StoreError> {
        Ok(Vec::new())
    }

    /// Moves the next attempt of `pipeline`'s rows waiting out a back-off (only `target`'s, only the business key
    /// whose digest is `digest`, where given) to now, so the relay sends them at its next look; rows a relay holds
    /// are left alone. Returns how many (`idemflow outbox retry-now`). Default: no outbox here.
    ///
    /// Errors: the store's.
    async fn outbox_retry_now(&self, _pipeline: &str, _target: Option<&str>, _digest: Option<&[u8]>) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// Every pipeline's and target's requests not yet delivered: rows waiting in the outbox and `delivery_failed`
    /// dead letters, by pipeline and target name. Default: no outbox here.
    ///
    /// Errors: the store's.
    async fn unsent(&self) -> Result<Vec<Unsent>, StoreError> {
        Ok(Vec::new())
    }

    /// Gives up `owner`'s leases on `pipeline`'s outbox rows (a relay that stops with deliveries in flight): another
    /// relay sends them at once instead of after their lease. Returns how many. Default: none held here.
    ///
    /// Errors: the store's (the leases then run out by themselves).
    async fn outbox_release(&self, _pipeline: &str, _owner: &str) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// Which pipelines have processed records of `topics` (queues, streams), and how far: one line per pipeline and
    /// topic, from the processed marks. Default: this store cannot tell (none).
    ///
    /// Errors: the store's.
    async fn histories(&self, _topics: &[String]) -> Result<Vec<crate::store::rows::History>, StoreError> {
        Ok(Vec::new())
    }

    /// Puts the request of dead letter `id` (reason `delivery_failed`) back in its pipeline's outbox and deletes the
    /// dead letter, in one transaction; returns the new outbox row's id, `None` when `id` is no such dead letter.
    /// `rehome` (a JSON object, target name to where its requests go now: an origin `scheme://host:port`, or `=`
    /// and a whole URL, a secret URL's marker or a Kafka topic) moves a request of a target named there to it: its
    /// URL's scheme and authority replaced by the origin (path and query kept), or the whole URL by what follows `=`. Default: this store keeps no outbox.
    ///
    /// Errors: the store's; [`StoreError::Refused`] where there is no outbox.
    async fn outbox_requeue(&self, _id: i64, _rehome: &str) -> Result<Option<i64>, StoreError> {
        Err(StoreError::Refused(NO_OUTBOX.to_owned()))
    }
}

/// What a store without an outbox answers ([`Connector::outbox_lease`]).
pub const NO_OUTBOX: &str = "this store keeps no outbox: HTTP effects ([[sink.http]]) run on PostgreSQL and MySQL/MariaDB stores";

/// One open batch transaction of a store with interactive transactions, with the side effect it runs: every step
/// the batch protocol takes in it (see [`super::Tx`], which documents each step). Dropped without
/// [`BatchTx::commit`], it rolls back.
#[allow(async_fn_in_trait)]
pub trait BatchTx: Send {
    /// `COMMIT`.
    async fn commit(self) -> Result<(), sqlx::Error>;
    /// `ROLLBACK`.
    async fn rollback(self) -> Result<(), sqlx::Error>;
    /// Default: a store whose side effects cannot end the transaction (PostgreSQL refuses transaction control
    /// inside a function or a procedure called in a transaction block).
    async fn still_open(&mut self) -> Result<bool, sqlx::Error> {
        Ok(true)
    }
    /// Runs SQL without parameters on the simple (text) protocol: no prepared statement.
    async fn raw(&mut self, sql: &str) -> Result<(), sqlx::Error>;
    /// Starts the side effect in this transaction; `false` when its schema changed (roll back, prepare again).
    async fn begin_side_effect(&mut self) -> Result<bool, sqlx::Error>;
    /// Applies the side effect for all `rows` (the fast path).
    async fn apply_all(&mut self, rows: &[&Apply]) -> Result<(), sqlx::Error>;
    /// Applies the side effect for one record (the slow path).
    async fn apply_one(&mut self, row: &Apply) -> Result<(), sqlx::Error>;
    /// Claims distinct keys in one statement, insert-then-check; the digests of the keys that were new.
    async fn claim(&mut self, pipeline: &str, claims: &[Claim<'_>]) -> Result<Digests, sqlx::Error>;
    /// The fast path's two steps: claims `claims` and applies the side effect for those of `rows` whose keys were
    /// new; `rows` holds one record per claim, in the batch's order, which is the order their effects are applied
    /// in. The digests of the keys that were new. Default: [`claim_then_apply`], two steps; a store that can do
    /// both in one statement for some side effects does (PostgreSQL's table form).
    async fn claim_and_apply(&mut self, pipeline: &str, claims: &[Claim<'_>], rows: &[&Apply]) -> Result<Digests, sqlx::Error>
    where
        Self: Sized,
    {
        claim_then_apply(self, pipeline, claims, rows).await
    }
    /// Reads the dedup rows of keys that the claim did not return.
    async fn existing(&mut self, pipeline: &str, keys: &[&BusinessKey]) -> Result<Vec<([u8; 32], Existing)>, sqlx::Error>;
    /// Adds skipped duplicates to their keys' dedup rows, in key id order.
    async fn count_duplicates(&mut self, pipeline: &str, counts: &[(&BusinessKey, i64)]) -> Result<(), sqlx::Error>;
    /// Writes the outbox requests of `rows` (records whose keys this batch claimed as new, [`Apply::requests`]) in
    /// one statement, in their order: the order the relay delivers a key's requests in.
    async fn write_outbox(&mut self, pipeline: &str, rows: &[(&Record, &Apply)]) -> Result<(), sqlx::Error>;
    /// Writes one dead letter; `false` when this record was dead-lettered before.
    async fn write_dead_letter(&mut self, pipeline: &str, record: &Record, reason: DeadLetterReason, error: &str) -> Result<bool, sqlx::Error>;
    /// The dead letters of `pipeline` stored for `records`, as `(position, reason, error)`.
    async fn dead_letters_at(&mut self, pipeline: &str, records: &[&Record]) -> Result<Vec<(Position, String, String)>, sqlx::Error>;
    /// Deletes dead letters of `pipeline` by id.
    async fn delete_dead_letters(&mut self, pipeline: &str, ids: &[i64]) -> Result<u64, sqlx::Error>;
    /// Stores `positions` where the epoch is still the one presented; the partitions that were fenced.
    async fn advance_offsets(&mut self, pipeline: &str, positions: &Positions) -> Result<Vec<(String, i32)>, sqlx::Error>;
    /// Locks and reads the processed marks of the batch's partitions.
    async fn processed(&mut self, pipeline: &str, first: &NextOffsets) -> Result<Processed, sqlx::Error>;
    /// Raises the processed marks and floors to `next`, last before `COMMIT`, with the logs' identities.
    async fn raise_processed(&mut self, pipeline: &str, next: &NextOffsets, logs: &Logs) -> Result<(), sqlx::Error>;
    /// Records `attempt` as the lane's latest; the one recorded before it, and the server session.
    async fn mark_attempt(&mut self, pipeline: &str, owner: &str, attempt: i64) -> Result<(Option<i64>, Session), sqlx::Error>;
    /// Sets the processed marks and floors of `renewed` afresh (a topic created again, a log truncated).
    async fn renew_processed(&mut self, pipeline: &str, renewed: &[Renewal]) -> Result<(), sqlx::Error>;
}

/// [`BatchTx::claim_and_apply`] in two steps: the claim, then [`BatchTx::apply_all`] of the rows whose keys it
/// returned, in their order.
///
/// Errors: the claim's or the side effect's.
pub async fn claim_then_apply<T: BatchTx>(tx: &mut T, pipeline: &str, claims: &[Claim<'_>], rows: &[&Apply]) -> Result<Digests, sqlx::Error> {
    let new = tx.claim(pipeline, claims).await?;
    let fresh: Vec<&Apply> = rows.iter().copied().filter(|r| new.contains(&r.key.digest)).collect();
    tx.apply_all(&fresh).await?;
    Ok(new)
}
