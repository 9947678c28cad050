//! Every database failure is classified once, here, and the code path follows the class.
//!
//! | failure | disposition |
//! |---|---|
//! | SQLSTATE class 08 (connection), I/O errors, a connection lost during `COMMIT` | retry the batch |
//! | 40001 serialization failure, 40P01 deadlock | retry the batch |
//! | 57P01/57P02/57P03 (admin shutdown, crash shutdown, cannot connect now), 57014 (statement cancelled or timed out), class 53 (insufficient resources, 53300 too many connections), 55P03 (lock not available), 25006 (read-only transaction: a failover to a standby), class 58 (system error) | retry the batch |
//! | pool acquire timeout | retry the batch |
//! | class 22 (data exception), 23 (integrity constraint), 21 (cardinality), 54 (program limit exceeded, e.g. a business index row too large), P0 (raised by PL/pgSQL), 2F, 39, 44, raised by one record's side effect | dead-letter that record (`side_effect_rejected`), the rest of the batch commits |
//! | class 42 (syntax error or access rule violation: the configured SQL or table is wrong), 0A, 3F, 28, and anything else | fatal: the pipeline stops |
//!
//! SQLSTATE classes are PostgreSQL's (Appendix A, "PostgreSQL Error Codes").

use crate::metrics::RetryCause;

/// What to do about a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Roll back and retry the whole batch after a backoff.
    Retry(RetryCause),
    /// The record being applied is at fault: isolate it and dead-letter it.
    Record,
    /// Stop the pipeline.
    Fatal,
    /// Some partitions of the batch belong to another worker now: drop their records and redo the rest.
    Fenced,
    /// The side effect's schema changed: build its statements again, prepare the records again, redo the batch.
    Rebuild,
}

/// Why a batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// A database failure, with what was being done.
    #[error("{context}: {source}{}", pooler_hint(source))]
    Database {
        /// What was being done, e.g. `claiming business keys`.
        context: &'static str,
        /// The error from sqlx.
        #[source]
        source: sqlx::Error,
    },
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
}

impl SinkError {
    /// Wraps a database error with what was being done.
    pub fn new(context: &'static str, source: sqlx::Error) -> Self {
        SinkError::Database { context, source }
    }

    /// How to handle it.
    pub fn disposition(&self) -> Disposition {
        match self {
            SinkError::Database { source, .. } => classify(source),
            SinkError::DeadLetterRatio { .. } => Disposition::Fatal,
            SinkError::Fenced { .. } => Disposition::Fenced,
            SinkError::SchemaChanged => Disposition::Rebuild,
            SinkError::Schema(_) => Disposition::Fatal,
        }
    }
}

/// A sentence for the errors a transaction-pooling proxy causes when named prepared statements are used
/// (SQLSTATE 42P05 duplicate prepared statement, 26000 invalid statement name); empty for every other error.
pub fn pooler_hint(error: &sqlx::Error) -> &'static str {
    match error {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("42P05" | "26000")) => {
            " (connecting through PgBouncer or another pooler in transaction mode? set [database] \
             prepared_statements = false)"
        }
        _ => "",
    }
}

/// Classifies a sqlx error (see the module table).
pub fn classify(error: &sqlx::Error) -> Disposition {
    use Disposition::*;
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => classify_sqlstate(&code),
            None => Fatal,
        },
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => {
            Retry(RetryCause::Connection)
        }
        sqlx::Error::PoolTimedOut => Retry(RetryCause::PoolTimeout),
        sqlx::Error::PoolClosed => Fatal,
        _ => Fatal,
    }
}

/// Classifies a SQLSTATE (see the module table).
pub fn classify_sqlstate(code: &str) -> Disposition {
    use Disposition::*;
    let class = code.get(..2).unwrap_or_default();
    match (class, code) {
        ("08", _) => Retry(RetryCause::Connection),
        (_, "40001" | "40P01") => Retry(RetryCause::Conflict),
        (_, "57P01" | "57P02" | "57P03" | "57014" | "55P03" | "25006") | ("53" | "58", _) => Retry(RetryCause::Unavailable),
        ("22" | "23" | "21" | "54" | "P0" | "2F" | "39" | "44", _) => Record,
        _ => Fatal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstate_table() {
        assert_eq!(classify_sqlstate("08006"), Disposition::Retry(RetryCause::Connection));
        assert_eq!(classify_sqlstate("40P01"), Disposition::Retry(RetryCause::Conflict));
        assert_eq!(classify_sqlstate("57P01"), Disposition::Retry(RetryCause::Unavailable));
        assert_eq!(classify_sqlstate("53300"), Disposition::Retry(RetryCause::Unavailable));
        assert_eq!(classify_sqlstate("22P02"), Disposition::Record);
        assert_eq!(classify_sqlstate("23505"), Disposition::Record);
        assert_eq!(classify_sqlstate("54000"), Disposition::Record);
        assert_eq!(classify_sqlstate("42P01"), Disposition::Fatal);
        assert_eq!(classify_sqlstate("42703"), Disposition::Fatal);
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), Disposition::Retry(RetryCause::PoolTimeout));
    }
}
