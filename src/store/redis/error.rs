//! Redis failures, classified into the dispositions every store shares ([`crate::store::error`]).
//!
//! | failure | disposition |
//! |---|---|
//! | connection refused, dropped or timed out; `LOADING` (a restart reading its data), `BUSY` (another script running), `MASTERDOWN`, `READONLY` (a failover under way), `TRYAGAIN`, `OOM` (maxmemory reached), `MISCONF` (Redis cannot persist), `NOREPLICAS` | retry the batch |
//! | `NOSCRIPT` | retried by the client itself: the script is loaded again and run |
//! | anything else (`NOPERM`: the user may not run scripts or a command; a script error) | fatal: the pipeline stops |
//!
//! Errors of a record's own commands (`WRONGTYPE`, "value is not an integer") never get here: the script catches
//! them and dead-letters the record. The same codes as above met by a record's first command (`NOPERM`: the user
//! may not run it; `OOM`, `READONLY`, ...) are not the record's fault: the script releases its key and answers with
//! that error, and the batch follows this table. Since Redis 7.0 an error inside a script keeps its code.

use crate::metrics::RetryCause;
use crate::store::disposition::Disposition;

/// The disposition of a Redis error.
pub fn classify(e: &redis::RedisError) -> Disposition {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        return Disposition::Retry(RetryCause::Connection);
    }
    match e.code() {
        Some("LOADING" | "BUSY" | "MASTERDOWN" | "READONLY" | "TRYAGAIN" | "OOM" | "CLUSTERDOWN" | "MISCONF" | "NOREPLICAS") => {
            Disposition::Retry(RetryCause::Unavailable)
        }
        _ => match e.retry_method() {
            redis::RetryMethod::Reconnect | redis::RetryMethod::WaitAndRetry | redis::RetryMethod::RetryImmediately => {
                Disposition::Retry(RetryCause::Connection)
            }
            _ => Disposition::Fatal,
        },
    }
}
