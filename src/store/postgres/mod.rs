//! The PostgreSQL store: the connection pool, idemflow's embedded migrations (`migrations/postgres/`, schema
//! `idemflow`) and the schema check.
//!
//! - [`dedup`]: the claim, the existing rows, the duplicate counts, `explain`.
//! - [`side_effect`]: the table form (one set-based `INSERT`) and the SQL form (statements per record).
//! - `sql_loop`: the SQL form's statements for a whole batch in one round trip.
//! - [`dead_letter`]: the dead letters, `idemflow.dead_letters`.
//! - [`offsets`]: stored positions with fencing, and the processed marks.
//! - [`retention`]: the purge.
//! - [`error`]: the SQLSTATE table.

pub mod dead_letter;
pub mod dedup;
pub mod error;
pub mod offsets;
pub mod rename;
pub mod outbox;
pub mod retention;
pub mod side_effect;
mod quote;
mod sql_loop;
mod types;
pub mod connector;

use crate::store::spec::DatabaseSettings;
use crate::store::contract::NotReady;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions as _;
use std::sync::atomic::{AtomicBool, Ordering};
use sqlx::PgPool;

/// The migrations in `migrations/postgres/`, embedded in the binary. They create the `idemflow` schema: the dedup
/// store and the dead letters. sqlx records applied versions in `_sqlx_migrations`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

static PERSISTENT: AtomicBool = AtomicBool::new(true);

/// Whether queries use named prepared statements (`[database] prepared_statements`, set by [`pool`] for the
/// whole process). Every query of idemflow's passes this to sqlx's `persistent`.
pub fn persistent() -> bool {
    PERSISTENT.load(Ordering::Relaxed)
}

/// The connect options for `settings`: with `prepared_statements = false` (a transaction-pooling proxy), no
/// statement cache and no `extra_float_digits` startup parameter (PgBouncer refuses unknown ones).
///
/// Errors: the URL does not parse.
pub fn connect_options(settings: &DatabaseSettings) -> Result<PgConnectOptions, sqlx::Error> {
    crate::install_tls_provider();
    if url::Url::parse(settings.url.expose()).is_ok_and(|u| u.query_pairs().any(|(k, _)| k == "sslpassword")) {
        return Err(sqlx::Error::Configuration(
            "sslpassword (the passphrase of an encrypted client key) is not supported: give sslkey an unencrypted key \
             file readable only by the worker"
                .into(),
        ));
    }
    let options: PgConnectOptions = settings.url.expose().parse()?;
    Ok(if settings.prepared_statements {
        options
    } else {
        options.statement_cache_capacity(0).extra_float_digits(None)
    }
    // Lock waits (a claim waiting for another worker's batch) are not slow statements worth a warning.
    .log_slow_statements(log::LevelFilter::Debug, std::time::Duration::from_secs(1)))
}

/// A pool that connects on first use, so the worker can start before the database is up.
pub fn pool(settings: &DatabaseSettings) -> Result<PgPool, sqlx::Error> {
    PERSISTENT.store(settings.prepared_statements, Ordering::Relaxed);
    Ok(PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy_with(connect_options(settings)?))
}

/// Connects once, directly, to tell whether the database is reachable, with the server's or the network's own
/// reason when it is not (a pool would only say it timed out). The error never contains the password.
pub async fn ping(settings: &DatabaseSettings) -> Result<(), NotReady> {
    use sqlx::Connection as _;
    let url = &settings.url;
    let options = connect_options(settings).map_err(|e| NotReady::Refused(format!("cannot connect to {url}: {}", url.scrub(&e.to_string()))))?;
    let attempt = sqlx::PgConnection::connect_with(&options);
    match tokio::time::timeout(settings.acquire_timeout, attempt).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        // Waited for where a batch would retry (the server starting or shutting down, a refused or lost connection);
        // refused where it never would (a wrong password, SQLSTATE class 28; a database that does not exist, 3D000).
        Ok(Err(e)) => Err(NotReady::after(error::classify_error(&e), format!("cannot connect to {url}: {}", url.scrub(&e.to_string())))),
        Err(_) => Err(NotReady::Unavailable(format!("cannot connect to {}: no answer within {:?}", settings.url, settings.acquire_timeout))),
    }
}

/// Whether `settings.url` leads to PgBouncer rather than to PostgreSQL itself, and if so what it said. PgBouncer
/// answers for its admin database `pgbouncer` (its version for an admin user, `not allowed` for another, or
/// `unsupported startup parameter` before either); PostgreSQL has no such database (`3D000`). The answer does not
/// depend on which server connection a statement would land on, so a pooler in transaction mode is found before
/// any named prepared statement could collide. `None` also when the question cannot be answered in 5 s (the caller
/// keeps the settings as they are).
pub async fn pgbouncer(settings: &DatabaseSettings) -> Option<String> {
    use sqlx::Connection as _;
    let options = connect_options(settings).ok()?.database("pgbouncer");
    match tokio::time::timeout(std::time::Duration::from_secs(5), sqlx::PgConnection::connect_with(&options)).await {
        Ok(Ok(mut conn)) => {
            let rows = sqlx::Executor::fetch_all(&mut conn, sqlx::raw_sql("SHOW VERSION")).await.ok()?;
            let version: String = rows.first().and_then(|r| sqlx::Row::try_get(r, 0).ok())?;
            let _ = conn.close().await;
            version.contains("PgBouncer").then_some(version)
        }
        // PgBouncer refuses a role not in `admin_users`/`stats_users` ("not allowed"), or a startup parameter it does
        // not pass on, with SQLSTATE 08P01 (protocol_violation), which PostgreSQL itself does not answer to a valid
        // startup message; PostgreSQL without a database of that name answers 3D000.
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("08P01") => {
            Some(format!("PgBouncer (its admin database answered: {})", e.message()))
        }
        _ => None,
    }
}

/// The schema that holds idemflow's migration record (`_sqlx_migrations`), quoted for SQL: found in the catalog, not
/// through the session's `search_path`, as the one whose record is the furthest along (its highest successful
/// version); before the first migration, none. Through the search path alone the record could move: a role named
/// like the `idemflow` schema has `"$user"` first on PostgreSQL's default path, which names that schema only once the
/// first migration has created it, so the next `migrate` would start a new, empty record there and run migration 1
/// again (and `check` would then read that empty record).
///
/// Errors: the database's.
pub async fn migrations_schema(conn: &mut sqlx::PgConnection) -> Result<Option<String>, sqlx::Error> {
    // Only records this role may read: a refused read would abort the transaction the schema check runs in.
    let schemas: Vec<String> = sqlx::query_scalar(
        "SELECT quote_ident(n.nspname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = '_sqlx_migrations' AND c.relkind IN ('r', 'p') \
           AND has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT') ORDER BY n.nspname",
    )
    .persistent(false)
    .fetch_all(&mut *conn)
    .await?;
    let mut best: Option<(i64, String)> = None;
    for schema in schemas {
        // A record this role cannot read is not one it keeps (filtered above; a column privilege refused still
        // comes here).
        let version: Option<i64> = match sqlx::query_scalar(&format!("SELECT max(version) FROM {schema}._sqlx_migrations WHERE success"))
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(v) => v,
            Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42501") => continue,
            Err(e) => return Err(e),
        };
        if best.as_ref().is_none_or(|(v, _)| version.unwrap_or(-1) > *v) {
            best = Some((version.unwrap_or(-1), schema));
        }
    }
    Ok(best.map(|(_, schema)| schema))
}

/// Runs the migrations ([`MIGRATOR`]) on one connection whose `search_path` starts with the schema of the migration
/// record ([`migrations_schema`]; before the first migration, the session's `current_schema()`), so that the record
/// stays where it was started whatever the role's path resolves to later. idemflow's own objects are all named with
/// their schema (`idemflow.*`).
///
/// Errors: the database's, or a migration's.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?;
    let home = match migrations_schema(&mut conn).await? {
        Some(home) => home,
        None => sqlx::query_scalar::<_, Option<String>>("SELECT quote_ident(current_schema())")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?
            .unwrap_or_else(|| "public".to_owned()),
    };
    let path: String = sqlx::query_scalar("SELECT current_setting('search_path')").persistent(false).fetch_one(&mut *conn).await?;
    sqlx::query("SELECT set_config('search_path', $1, false)").bind(format!("{home}, {path}")).persistent(false).execute(&mut *conn).await?;
    let ran = MIGRATOR.run(&mut *conn).await;
    // The connection goes back to the pool: with the role's own path again.
    let _ = sqlx::query("SELECT set_config('search_path', $1, false)").bind(&path).persistent(false).execute(&mut *conn).await;
    ran
}

/// Whether the idemflow schema is migrated to the latest version this binary knows.
///
/// Errors: [`NotReady::Refused`]: the schema is missing or older (`run idemflow migrate`), or the dedup key is gone;
/// [`NotReady::Unavailable`]: the database could not be asked (by [`error::classify_error`]: what a batch retries).
pub async fn check_schema(pool: &PgPool) -> Result<(), NotReady> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default();
    let missing = || NotReady::Refused("the idemflow schema is missing: run `idemflow migrate --config ...` first".to_owned());
    let asked = |what: &str, e: sqlx::Error| NotReady::after(error::classify_error(&e), format!("{what}: {e}"));
    // In a transaction, as every access is: behind a transaction-pooling proxy (PgBouncer before 1.21) a statement
    // of the extended protocol outside one may be parsed on one server connection and bound on another.
    let mut conn = pool.begin().await.map_err(|e| asked("cannot read the schema version", e))?;
    let Some(home) = migrations_schema(&mut conn).await.map_err(|e| asked("cannot read the schema version", e))? else {
        return Err(missing());
    };
    let applied: Option<i64> = sqlx::Executor::fetch_one(
        &mut *conn,
        sqlx::raw_sql(&format!("SELECT max(version) FROM {home}._sqlx_migrations WHERE success AND to_regclass('idemflow.dedup') IS NOT NULL")),
    )
    .await
    .and_then(|row| sqlx::Row::try_get(&row, 0))
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => missing(),
        _ => asked("cannot read the schema version", e),
    })?;
    // Whether the dedup store still has the unique index the claim depends on: `(pipeline, key_id)`, valid and
    // unique (`INSERT ... ON CONFLICT (pipeline, key_id)` needs it; without it nothing would stop a key from being
    // applied twice, and the first batch would fail with SQLSTATE 42P10).
    let usable: bool = match applied {
        Some(v) if v >= latest => sqlx::Executor::fetch_one(
            &mut *conn,
            sqlx::raw_sql(
                "SELECT EXISTS (SELECT FROM pg_index i WHERE i.indrelid = 'idemflow.dedup'::regclass AND i.indisunique \
                 AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL AND i.indnkeyatts = 2 \
                 AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a \
                      WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)) = ARRAY['key_id', 'pipeline'])",
            ),
        )
        .await
        .and_then(|row| sqlx::Row::try_get(&row, 0))
        .map_err(|e| asked("cannot read the dedup store's indexes", e))?,
        Some(v) => return Err(NotReady::Refused(format!("the idemflow schema is at version {v}, this binary needs {latest}: run `idemflow migrate`"))),
        None => return Err(missing()),
    };
    let _ = conn.rollback().await;
    if usable {
        Ok(())
    } else {
        Err(NotReady::Refused(
            "idemflow.dedup has no valid unique index on (pipeline, key_id), which the claim needs to apply each \
             key once: restore it (ALTER TABLE idemflow.dedup ADD PRIMARY KEY (pipeline, key_id))"
                .to_owned(),
        ))
    }
}
