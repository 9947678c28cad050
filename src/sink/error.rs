//! Why a batch did not commit ([`SinkError`]) and what the worker does about it: the disposition of each failure
//! is decided once, in [`crate::store::error`], for every store.

use crate::store::disposition::Disposition;
use crate::store::error::classify;
use std::time::Duration;

/// In how many consecutive attempts of its batch, and over how long at least ([`SOLO_TIME_LIMIT_SPAN`]), a record's
/// side effect must run past the server's statement time limit on its own before the record is dead-lettered as the
/// cause (`side_effect_rejected`). A lock wait or an I/O stall makes a good record slow for a while (a lock of a
/// vanished worker's transaction is held up to `idle_in_transaction_session_timeout`, 15 s); a record too slow for
/// the limit is slow every time. Between the attempts the batch is rolled back and the worker backs off as for any
/// retry (0.1 s doubling). A record not received from a broker (a dead letter replayed by `idemflow dead-letters
/// replay`, which retries nothing) is dead-lettered at the first.
pub const SOLO_TIME_LIMIT_ATTEMPTS: u32 = 3;

/// See [`SOLO_TIME_LIMIT_ATTEMPTS`]: the least time from the first of those attempts to the one that dead-letters.
pub const SOLO_TIME_LIMIT_SPAN: Duration = Duration::from_secs(20);

/// Why a batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// A database failure, with what was being done.
    #[error("{context}: {source}{}", crate::store::postgres::error::pooler_hint(source))]
    Database {
        /// What was being done, e.g. `claiming business keys`.
        context: &'static str,
        /// The error from sqlx.
        #[source]
        source: sqlx::Error,
    },
    /// A Redis failure, with what was being done.
    #[cfg(feature = "redis")]
    #[error("{context}: {source}")]
    Redis {
        /// What was being done.
        context: &'static str,
        /// The error from the Redis client.
        #[source]
        source: redis::RedisError,
    },
    /// Redis no longer holds positions this worker stored or claimed for these partitions (it lost its last writes:
    /// a crash with `appendfsync everysec`, a failover to a replica behind): the effects written with them are gone
    /// too. Nothing of the batch was written.
    #[error("Redis lost the stored positions of partitions {partitions:?} (and the effects written with them); resuming them from what it kept")]
    Lost {
        /// `(topic, partition)` of each partition.
        partitions: Vec<(String, i32)>,
    },
    /// Redis lost every position of these partitions, the claim included: it restarted without its data (no AOF,
    /// a replica promoted that never had it). What the pipeline applied before is gone too, so resuming from Kafka's
    /// committed offsets would skip it: the pipeline stops for an operator to decide.
    #[error(
        "Redis holds no stored position for partitions {partitions:?} any more: it lost its data (a restart without \
         persistence, a failover to an empty replica), and the effects applied before went with it. Restore Redis from \
         a backup, or replay the topic deliberately (idemflow rewind --to earliest) to rebuild the effects"
    )]
    PositionsGone {
        /// `(topic, partition)` of each partition.
        partitions: Vec<(String, i32)>,
    },
    /// A dead letter being replayed was taken by another replay meanwhile (Redis); nothing was written.
    #[error("dead letter {0} was replayed by another process meanwhile; nothing was written")]
    Replayed(String),
    /// The source could not be moved back to the positions the store kept.
    #[error("the source could not resume from the stored positions: {0}")]
    Source(String),
    /// `[offsets] store = "database"`: the stored positions of these partitions were claimed by another worker
    /// (or reset by a rewind) since this worker was assigned them. The batch was rolled back.
    #[error("fenced: partitions {partitions:?} were claimed by another worker; the batch was rolled back")]
    Fenced {
        /// `(topic, partition)` of each fenced partition.
        partitions: Vec<(String, i32)>,
    },
    /// A table or statement of the side effect changed (a column's type, NOT NULL, a default, a parameter's
    /// inferred type, the table itself) since the statements were built; the batch was rolled back before
    /// writing anything.
    #[error("the side effect's schema changed since its statements were built; the batch was rolled back")]
    SchemaChanged,
    /// After a schema change, the side effect no longer fits the database (a mapped column was dropped, a type
    /// idemflow cannot bind): the pipeline stops.
    #[error("the side effect no longer fits the database after a schema change: {0}")]
    Schema(String),
    /// The batch would have taken the dead-letter ratio over its limit; it was rolled back.
    #[error(
        "{dead_letters} of the last {records} records would go to the dead letters, over dead_letters.max_ratio = \
         {max_ratio}; stopping the pipeline instead (a bad deploy or a changed payload format?). The batch was rolled \
         back, nothing was committed; fix the cause and restart"
    )]
    DeadLetterRatio {
        /// Dead letters in the window, this batch included.
        dead_letters: u64,
        /// Records in the window, this batch included.
        records: u64,
        /// The configured limit.
        max_ratio: f64,
    },
    /// The dead letters of a batch that was already written took the ratio over its limit: dead letters decided
    /// where nothing can be rolled back (inside a Redis script). The pipeline stops after that batch.
    #[error(
        "{dead_letters} of the last {records} records went to the dead letters, over dead_letters.max_ratio = \
         {max_ratio}; stopping the pipeline (a bad deploy, a changed payload format, a key of the wrong type?). The \
         last batch was written (Redis cannot roll a script back) and its offsets were not committed; fix the cause \
         and restart (its records come back as duplicates)"
    )]
    DeadLetterRatioWritten {
        /// Dead letters in the window, the written batch included.
        dead_letters: u64,
        /// Records in the window, the written batch included.
        records: u64,
        /// The configured limit.
        max_ratio: f64,
    },
    /// The batch attempt took longer than `[database] batch_timeout` (a connection whose packets vanish, a lock
    /// held elsewhere): it was abandoned, its connection closed (the server rolls back what did not commit), and
    /// the batch is retried; the dedup rows make that safe whichever way an unanswered `COMMIT` went.
    #[error("the batch attempt took longer than database.batch_timeout = {0:?}: abandoned (its connection closed) and retried")]
    TimedOut(std::time::Duration),
    /// The side effect ended the batch transaction itself (a `COMMIT`, or a statement that commits implicitly,
    /// inside a procedure): the dedup rows claimed before it may be committed without the effects of the records
    /// after it. Found before `COMMIT`; the pipeline stops rather than go on.
    #[error(
        "the side effect ended the batch transaction itself (a COMMIT, ROLLBACK or a statement that commits \
         implicitly, run by a procedure or statement of the side effect): the batch's dedup rows may have been \
         committed without the effects of the records after that point. The pipeline stops. Remove the transaction \
         control from the procedure; then check the batch's records with `idemflow explain` and replay them \
         deliberately (idemflow rewind) if effects are missing"
    )]
    TransactionEnded,
    /// One record's side effect alone ran past the server's time limit for one statement, in fewer consecutive
    /// attempts than [`SOLO_TIME_LIMIT_ATTEMPTS`] or over less than [`SOLO_TIME_LIMIT_SPAN`]:
    /// a lock wait or an I/O stall can make a good record
    /// slow once, so the batch is rolled back and retried before the record is taken for the cause and
    /// dead-lettered.
    #[error(
        "the side effect of the record at {position} alone ran past the statement time limit ({attempts} attempt(s) in \
         a row; dead-lettered after {limit} over at least {span}s): {source}; the batch was rolled back and is retried",
        limit = SOLO_TIME_LIMIT_ATTEMPTS,
        span = SOLO_TIME_LIMIT_SPAN.as_secs()
    )]
    RecordTimeLimit {
        /// The record's position.
        position: crate::record::Position,
        /// The consecutive attempts in which it did, this one included.
        attempts: u32,
        /// The error from the database.
        #[source]
        source: sqlx::Error,
    },
}

impl SinkError {
    /// Wraps a database error with what was being done.
    pub fn new(context: &'static str, source: sqlx::Error) -> Self {
        SinkError::Database { context, source }
    }

    /// Wraps a Redis error with what was being done.
    #[cfg(feature = "redis")]
    pub fn redis(context: &'static str, source: redis::RedisError) -> Self {
        SinkError::Redis { context, source }
    }

    /// Whether a statement of the batch was stopped by the server's time limit for one statement
    /// ([`crate::store::error::time_limit`]: PostgreSQL 57014, MySQL 3024, MariaDB 1969): the batch as a whole may be
    /// too big for the limit, so it is redone record by record, each statement timed on its own, rather than
    /// retried as it is forever.
    pub fn time_limit(&self) -> bool {
        matches!(self, SinkError::Database { source, .. } if crate::store::error::time_limit(source))
    }

    /// How to handle it.
    pub fn disposition(&self) -> Disposition {
        match self {
            SinkError::Database { source, .. } => classify(source),
            #[cfg(feature = "redis")]
            SinkError::Redis { source, .. } => crate::store::redis::error::classify(source),
            SinkError::Lost { .. } => Disposition::Resync,
            SinkError::PositionsGone { .. } | SinkError::Source(_) | SinkError::Replayed(_) => Disposition::Fatal,
            SinkError::DeadLetterRatio { .. } | SinkError::DeadLetterRatioWritten { .. } => Disposition::Fatal,
            SinkError::TransactionEnded => Disposition::Fatal,
            SinkError::TimedOut(_) => Disposition::Retry(crate::metrics::RetryCause::Connection),
            SinkError::RecordTimeLimit { .. } => Disposition::Retry(crate::metrics::RetryCause::Unavailable),
            SinkError::Fenced { .. } => Disposition::Fenced,
            SinkError::SchemaChanged => Disposition::Rebuild,
            SinkError::Schema(_) => Disposition::Fatal,
        }
    }
}
