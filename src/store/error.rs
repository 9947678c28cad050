//! Every store failure is classified once, here, and the code path follows the class. Each store maps its own
//! codes into these dispositions: Postgres's SQLSTATEs in [`crate::store::postgres::error`], MySQL's and MariaDB's
//! error numbers in [`crate::store::mysql::error`], Redis's error codes in [`crate::store::redis::error`]. For every
//! store:
//!
//! | failure | disposition |
//! |---|---|
//! | I/O errors, a connection lost (during `COMMIT` too: the dedup rows decide on the retry), a deadlock, a lock wait timeout, the server shutting down or out of connections | retry the batch |
//! | pool acquire timeout | retry the batch |
//! | a data error or a constraint violated by one record's side effect | dead-letter that record (`side_effect_rejected`), the rest of the batch commits |
//! | a missing table or column, a syntax error, a permission refused, and anything else | fatal: the pipeline stops |

use super::disposition::Disposition;

/// Classifies a sqlx error (see the module table).
pub fn classify(error: &sqlx::Error) -> Disposition {
    use Disposition::Fatal;
    match error {
        sqlx::Error::Database(db) => {
            #[cfg(feature = "mysql")]
            if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return crate::store::mysql::error::classify(my);
            }
            match db.code() {
                Some(code) => crate::store::postgres::error::classify_sqlstate(&code),
                None => Fatal,
            }
        }
        other => super::disposition::of_client(other),
    }
}

/// An error's text for the dead letters and logs, with its code: `SQLSTATE 23505: ...` (Postgres) or
/// `MySQL error 1366 (22007): ...` (MySQL and MariaDB).
pub fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => {
            #[cfg(feature = "mysql")]
            if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return crate::store::mysql::error::describe(my);
            }
            match db.code() {
                Some(code) => format!("SQLSTATE {code}: {}", db.message()),
                None => db.message().to_owned(),
            }
        }
        other => other.to_string(),
    }
}

/// Whether `error` is a statement stopped by the server's time limit for one statement: PostgreSQL's SQLSTATE 57014
/// (`query_canceled`: `statement_timeout`, or a cancel request), MySQL's error 3024 (`max_execution_time`) or
/// MariaDB's 1969 (`max_statement_time`). Decided by the code alone, never by the message, which a server with
/// `lc_messages` in another language words in that language. A batch stopped that way may simply be too big for the
/// limit: the sink redoes it record by record, each statement timed on its own (see [`crate::sink::transaction`]).
pub fn time_limit(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else { return false };
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return crate::store::mysql::error::time_limit(my.number());
    }
    db.code().as_deref() == Some(crate::store::postgres::error::QUERY_CANCELED)
}

/// Whether a failed savepoint statement means the batch transaction was ended by the side effect itself: on
/// MySQL/MariaDB error 1305, the savepoint does not exist (a procedure's `COMMIT`). PostgreSQL refuses transaction
/// control inside a transaction block, so there it never is.
pub fn savepoint_gone(error: &sqlx::Error) -> bool {
    #[cfg(feature = "mysql")]
    return crate::store::mysql::error::savepoint_gone(error);
    #[cfg(not(feature = "mysql"))]
    {
        let _ = error;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::RetryCause;

    #[test]
    fn errors_without_a_database_code() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), Disposition::Retry(RetryCause::PoolTimeout));
        assert_eq!(classify(&sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())), Disposition::Retry(RetryCause::Connection));
    }
}
