//! What the worker does about a failure of the store: the dispositions every store maps its own codes into
//! ([`crate::store::error`] has the table). A leaf: the stores' error modules and the sink share it.

use crate::metrics::RetryCause;

/// The disposition of a sqlx error that is not the server's answer (the connection, the pool): the same on every
/// SQL store. A server's answer ([`sqlx::Error::Database`]) is its store's to classify, by its own codes: fatal here.
pub fn of_client(error: &sqlx::Error) -> Disposition {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => {
            Disposition::Retry(RetryCause::Connection)
        }
        sqlx::Error::PoolTimedOut => Disposition::Retry(RetryCause::PoolTimeout),
        _ => Disposition::Fatal,
    }
}

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
    /// The store lost positions this worker had stored (Redis after a crash that lost its last writes): claim the
    /// partitions again and consume them from the positions the store kept.
    Resync,
}

impl Disposition {
    /// Whether a batch would retry after this failure: what start-up and `prepare` wait for instead of refusing.
    pub fn is_retry(self) -> bool {
        matches!(self, Disposition::Retry(_))
    }
}
