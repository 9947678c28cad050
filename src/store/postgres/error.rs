//! Postgres's failures, by SQLSTATE (PostgreSQL docs, Appendix A, "PostgreSQL Error Codes"):
//!
//! | failure | disposition |
//! |---|---|
//! | class 08 (connection), 25P03 and 25P04 (FATAL: the server ended the session, `idle_in_transaction_session_timeout` or PostgreSQL 17's `transaction_timeout`) | retry the batch |
//! | 40001 serialization failure, 40P01 deadlock | retry the batch |
//! | 57P01/57P02/57P03 (admin shutdown, crash shutdown, cannot connect now), 57014 (statement cancelled or timed out), class 53 (insufficient resources, 53300 too many connections), 55P03 (lock not available), 25006 (read-only transaction: a failover to a standby), class 58 (system error) | retry the batch |
//! | class 22 (data exception), 23 (integrity constraint), 21 (cardinality), 54 (program limit exceeded, e.g. a business index row too large), P0 (raised by PL/pgSQL), 2F, 39, 44, raised by one record's side effect | dead-letter that record (`side_effect_rejected`), the rest of the batch commits |
//! | class 42 (syntax error or access rule violation: the configured SQL or table is wrong), 0A, 3F, 28, and anything else | fatal: the pipeline stops |

use crate::metrics::RetryCause;
use crate::store::disposition::Disposition;

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

/// PostgreSQL's `query_canceled`: a statement stopped by `statement_timeout` or by a cancel request
/// (`pg_cancel_backend`). The SQLSTATE is the same for both, and the message is in the server's `lc_messages`, so
/// neither tells them apart: both are taken for a statement too slow for its limit (the store's `error::time_limit`).
/// A wait for a lock ends as 55P03 before the limit (the batch sets a shorter `lock_timeout`), so it is not one.
pub const QUERY_CANCELED: &str = "57014";

/// Classifies a sqlx error of a PostgreSQL connection: the server's answer by its SQLSTATE
/// ([`classify_sqlstate`]), anything else as every SQL store does ([`crate::store::disposition::of_client`]).
pub fn classify_error(error: &sqlx::Error) -> Disposition {
    match error {
        sqlx::Error::Database(db) => db.code().map_or(Disposition::Fatal, |code| classify_sqlstate(&code)),
        other => crate::store::disposition::of_client(other),
    }
}

/// Classifies a SQLSTATE (see the module table).
pub fn classify_sqlstate(code: &str) -> Disposition {
    use Disposition::*;
    let class = code.get(..2).unwrap_or_default();
    match (class, code) {
        ("08", _) | (_, "25P03" | "25P04") => Retry(RetryCause::Connection),
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
        assert_eq!(classify_sqlstate("25P03"), Disposition::Retry(RetryCause::Connection));
        assert_eq!(classify_sqlstate("25P04"), Disposition::Retry(RetryCause::Connection));
        assert_eq!(classify_sqlstate("25P02"), Disposition::Fatal);
        assert_eq!(classify_sqlstate("40P01"), Disposition::Retry(RetryCause::Conflict));
        assert_eq!(classify_sqlstate("57P01"), Disposition::Retry(RetryCause::Unavailable));
        assert_eq!(classify_sqlstate("53300"), Disposition::Retry(RetryCause::Unavailable));
        assert_eq!(classify_sqlstate("22P02"), Disposition::Record);
        assert_eq!(classify_sqlstate("23505"), Disposition::Record);
        assert_eq!(classify_sqlstate("54000"), Disposition::Record);
        assert_eq!(classify_sqlstate(super::super::sql_loop::CANCELLED_LOOP), Disposition::Record);
        assert_eq!(classify_sqlstate("42P01"), Disposition::Fatal);
        assert_eq!(classify_sqlstate("42703"), Disposition::Fatal);
    }
}
