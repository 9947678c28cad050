//! MySQL's and MariaDB's failures, by error number (MySQL Reference Manual, "Server Error Message Reference" and
//! "Client Error Message Reference"; MariaDB's own numbers from 1900 on are noted):
//!
//! | failure | numbers | disposition |
//! |---|---|---|
//! | the connection lost or killed (also during `COMMIT`: the dedup rows decide on the retry), a network error | 2002, 2003, 2006, 2013, 2055, 1927 (MariaDB: connection killed), 1053 (server shutdown), 1152, 1184, 1158-1161, 1180 (error during COMMIT), 3101 (Group Replication: certification failed at COMMIT), 1047 (Galera: node not ready) | retry the batch |
//! | deadlock, lock wait timeout | 1213, 1205 | retry the batch |
//! | the server busy, out of resources or read-only (a failover), a statement interrupted, over its time limit, or to be prepared again after a schema change | 1040 (too many connections), 1203, 1226, 1637, 1021, 1114, 1037, 1038, 1041, 1135, 1461, 1290 (`--read-only`; the same number covers other `--option` refusals), 1792 (read-only transaction), 1836 (read-only mode), 1317, 3024 and 1969 (statement time limit: like PostgreSQL's 57014, the batch redone record by record, [`time_limit`]), 4031 (idle session timed out), 1615, 1412 | retry the batch |
//! | a data error or a constraint of one record | 1062, 1586, 1022, 1169, 1859 (duplicate key on a business table), 1048 and 1263 (NULL into NOT NULL), 1264 (out of range), 1265 (truncated), 1292 (incorrect date/time/number), 1366 (incorrect value for the column), 1367, 1406 (too long), 1411 and 1441 (bad date or time value), 1365 (division by 0), 1690, 1916 (MariaDB: overflow), 1451, 1452, 1216, 1217, 1830, 1834 (foreign key), 3819 (MySQL CHECK), 4025 (MariaDB CHECK, JSON validity), 3140, 3141, 3156 (JSON, MySQL), 1242 and 1172 (a subquery returned more than one row), 1300 (invalid character string), 1153 (a record larger than `max_allowed_packet`), 1644 (`SIGNAL` raised by a trigger or procedure) | dead-letter that record (`side_effect_rejected`) |
//! | a missing table or column, a syntax error, a permission refused, and anything else | 1146, 1054, 1064, 1142, 1143, 1044, 1045, ... | fatal: the pipeline stops |

use crate::metrics::RetryCause;
use crate::store::disposition::Disposition;
use sqlx::mysql::MySqlDatabaseError;

/// Classifies a MySQL or MariaDB error by its number (see the module table).
pub fn classify(error: &MySqlDatabaseError) -> Disposition {
    classify_number(error.number())
}

/// Classifies an error number (see the module table).
pub fn classify_number(number: u16) -> Disposition {
    use Disposition::*;
    match number {
        2002 | 2003 | 2006 | 2013 | 2055 | 1927 | 1053 | 1152 | 1184 | 1158..=1161 | 1180 | 3101 | 1047 => Retry(RetryCause::Connection),
        1213 | 1205 => Retry(RetryCause::Conflict),
        1040 | 1203 | 1226 | 1637 | 1021 | 1114 | 1037 | 1038 | 1041 | 1135 | 1461 | 1290 | 1792 | 1836 | 1317 | 3024 | 1969
        | 4031 | 1615 | 1412 => Retry(RetryCause::Unavailable),
        1062 | 1586 | 1022 | 1169 | 1859 | 1048 | 1263 | 1264 | 1265 | 1292 | 1366 | 1367 | 1406 | 1411 | 1441 | 1365 | 1690
        | 1916 | 1451 | 1452 | 1216 | 1217 | 1830 | 1834 | 3819 | 4025 | 3140 | 3141 | 3156 | 1242 | 1172 | 1300 | 1153
        | 1644 => Record,
        _ => Fatal,
    }
}

/// Classifies a sqlx error of a MySQL or MariaDB connection: the server's answer by its error number
/// ([`classify`]), anything else as every SQL store does ([`crate::store::disposition::of_client`]).
pub fn classify_error(error: &sqlx::Error) -> Disposition {
    match error {
        sqlx::Error::Database(db) => db.try_downcast_ref::<MySqlDatabaseError>().map_or(Disposition::Fatal, classify),
        other => crate::store::disposition::of_client(other),
    }
}

/// A sqlx error's text with its error number when the server answered (`MySQL error 1366 (22007): ...`).
pub fn describe_error(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => db.try_downcast_ref::<MySqlDatabaseError>().map_or_else(|| db.message().to_owned(), describe),
        other => other.to_string(),
    }
}

/// Whether error `number` is a statement stopped by its time limit: 3024 (MySQL, `max_execution_time`) or 1969
/// (MariaDB, `max_statement_time`). 1317 (`KILL QUERY`) is not: it is retried as it is.
pub fn time_limit(number: u16) -> bool {
    matches!(number, 3024 | 1969)
}

/// The error as the dead letters and logs show it: `MySQL error 1366 (22007): Incorrect decimal value: ...`.
pub fn describe(error: &MySqlDatabaseError) -> String {
    format!("MySQL error {} ({}): {}", error.number(), error.code().unwrap_or("HY000"), error.message())
}

/// Whether `e` is MySQL's error 1305 for a savepoint: it no longer exists, because the transaction it belonged to
/// ended.
pub fn savepoint_gone(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|m| m.number() == 1305))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_number_table() {
        assert_eq!(classify_number(1062), Disposition::Record);
        assert_eq!(classify_number(1366), Disposition::Record);
        assert_eq!(classify_number(1406), Disposition::Record);
        assert_eq!(classify_number(1213), Disposition::Retry(RetryCause::Conflict));
        assert_eq!(classify_number(1205), Disposition::Retry(RetryCause::Conflict));
        assert_eq!(classify_number(2013), Disposition::Retry(RetryCause::Connection));
        assert_eq!(classify_number(1927), Disposition::Retry(RetryCause::Connection));
        assert_eq!(classify_number(1146), Disposition::Fatal);
        assert_eq!(classify_number(1054), Disposition::Fatal);
    }
}
