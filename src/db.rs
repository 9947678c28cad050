//! The Postgres connection pool and idemflow's embedded migrations (`migrations/`).

use crate::config::DatabaseSettings;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// The migrations in `migrations/`, embedded in the binary. They create the `idemflow` schema: the dedup store
/// and the dead letters. sqlx records applied versions in `_sqlx_migrations`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// A pool that connects on first use, so the worker can start before the database is up.
pub fn pool(settings: &DatabaseSettings) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy(settings.url.expose())
}

/// Connects once, directly, to tell whether the database is reachable, with the server's or the network's own
/// reason when it is not (a pool would only say it timed out). The error never contains the password.
pub async fn ping(settings: &DatabaseSettings) -> Result<(), String> {
    use sqlx::Connection as _;
    let attempt = sqlx::PgConnection::connect(settings.url.expose());
    match tokio::time::timeout(settings.acquire_timeout, attempt).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(format!("cannot connect to {}: {e}", settings.url)),
        Err(_) => Err(format!("cannot connect to {}: no answer within {:?}", settings.url, settings.acquire_timeout)),
    }
}

/// Whether the idemflow schema is migrated to the latest version this binary knows.
///
/// Errors: the database is unreachable, or the schema is missing or older (`run idemflow migrate`).
pub async fn check_schema(pool: &PgPool) -> Result<(), String> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default();
    let applied: Option<i64> = sqlx::query_scalar(
        "SELECT max(version) FROM _sqlx_migrations WHERE success AND to_regclass('idemflow.dedup') IS NOT NULL",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => {
            "the idemflow schema is missing: run `idemflow migrate --config ...` first".to_owned()
        }
        _ => format!("cannot read the schema version: {e}"),
    })?;
    match applied {
        Some(v) if v >= latest => Ok(()),
        Some(v) => Err(format!("the idemflow schema is at version {v}, this binary needs {latest}: run `idemflow migrate`")),
        None => Err("the idemflow schema is missing: run `idemflow migrate --config ...` first".to_owned()),
    }
}
