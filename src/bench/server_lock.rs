//! One `idemflow bench` at a time per database server.
//!
//! A bench drops and re-creates its databases by name (`bench_1`, `bench_rabbitmq_8`, ...) and measures the server's
//! CPU and WAL: two benches against one server would drop each other's databases mid-run or, at best, measure each
//! other. So a bench holds a lock on the server for its whole run, a session-level advisory lock on PostgreSQL
//! (`pg_advisory_lock`) and a named lock on MySQL/MariaDB (`GET_LOCK`), on a connection of its own that it keeps
//! open until it ends; the server releases either when that connection closes, so a killed bench leaves no lock.
//! A second bench waits for the first, saying so, for at most [`WAIT`].

use anyhow::Context;
use sqlx::{Connection, Executor, Row};
use std::time::Duration;

/// How long a bench waits for another bench on the same server to finish before it gives up.
pub(super) const WAIT: Duration = Duration::from_secs(600);

/// The PostgreSQL advisory lock key: the bytes `idemflow` as a big-endian `bigint`.
const PG_KEY: i64 = i64::from_be_bytes(*b"idemflow");

/// The MySQL/MariaDB lock name (`GET_LOCK` names are per server, at most 64 characters).
const MYSQL_NAME: &str = "idemflow bench";

/// The held lock: the connection whose session holds it. Dropping it closes the connection, which releases it.
pub(super) enum ServerLock {
    Postgres(sqlx::PgConnection),
    MySql(sqlx::MySqlConnection),
}

impl ServerLock {
    /// Takes the bench lock on the server of `admin_url` (a PostgreSQL or MySQL/MariaDB URL), waiting up to [`WAIT`]
    /// if another bench holds it.
    ///
    /// # Errors
    /// The server cannot be reached, or another bench still holds the lock after [`WAIT`].
    pub(super) async fn take(admin_url: &str) -> anyhow::Result<Self> {
        let waiting = || eprintln!("another idemflow bench is running against this database server; waiting for it to end (at most {} s)", WAIT.as_secs());
        let gave_up = || anyhow::anyhow!("another idemflow bench held the database server's bench lock for {} s; not starting beside it", WAIT.as_secs());
        if super::workload::is_mysql(admin_url) {
            let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
            let options = crate::store::mysql::connect_options(&super::workload::settings_for(&format!("{base}/")))?;
            let mut conn = sqlx::MySqlConnection::connect_with(&options).await.context("connecting to MySQL/MariaDB")?;
            // GET_LOCK answers 1 when taken, 0 on timeout.
            let take = |wait: u64| format!("SELECT GET_LOCK('{MYSQL_NAME}', {wait})");
            if conn.fetch_one(take(0).as_str()).await?.try_get::<Option<i64>, _>(0)? != Some(1) {
                waiting();
                if conn.fetch_one(take(WAIT.as_secs()).as_str()).await?.try_get::<Option<i64>, _>(0)? != Some(1) {
                    return Err(gave_up());
                }
            }
            return Ok(Self::MySql(conn));
        }
        let mut conn = sqlx::PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(PG_KEY).fetch_one(&mut conn).await?;
        if !taken {
            waiting();
            // lock_timeout bounds the wait for an advisory lock too; SQLSTATE 55P03 (lock_not_available) when it ends.
            conn.execute(format!("SET lock_timeout = '{}s'", WAIT.as_secs()).as_str()).await?;
            match sqlx::query("SELECT pg_advisory_lock($1)").bind(PG_KEY).execute(&mut conn).await {
                Ok(_) => {}
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => return Err(gave_up()),
                Err(e) => return Err(e.into()),
            }
            conn.execute("RESET lock_timeout").await?;
        }
        Ok(Self::Postgres(conn))
    }

    /// Releases the lock by closing its connection (as dropping it would, but waiting for the server to hear it).
    pub(super) async fn release(self) {
        let closed = match self {
            Self::Postgres(c) => c.close().await,
            Self::MySql(c) => c.close().await,
        };
        if let Err(e) = closed {
            tracing::debug!(error = %e, "closing the bench lock's connection");
        }
    }
}
