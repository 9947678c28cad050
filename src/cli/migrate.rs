//! `idemflow migrate`: create or upgrade idemflow's tables in PostgreSQL or MySQL/MariaDB; Redis needs none.

use super::workspace::{load, ConfigArg};
use anyhow::{bail, Context as _};
use idemflow::store::spec::StoreKind;
use idemflow::store::Store;

/// Runs `migrate`.
///
/// Errors: the database is unreachable or reached through a pooler, or a migration failed.
pub async fn run(a: ConfigArg) -> anyhow::Result<()> {
    let settings = load(&a.config)?;
    let Some(database) = &settings.database else {
        println!("no [database] in {}: nothing to migrate (Redis needs no schema: its keys are written by the batches)", a.config.display());
        return Ok(());
    };
    settings.stores().reachable(StoreKind::Database).await.map_err(|why| anyhow::anyhow!("{}: {why}", a.config.display()))?;
    if idemflow::store::open::behind_pooler(database).await {
        bail!(
            "{}: the database URL leads to a pooler (PgBouncer answers there, or database.prepared_statements = \
             false says so): run \
             `idemflow migrate` with a URL to PostgreSQL itself (IDEMFLOW_DATABASE__URL=... idemflow migrate): \
             migrations take a session-level lock that a transaction pooler cannot keep",
            a.config.display()
        );
    }
    let store = match idemflow::store::template::Dialect::of_url(database.url.expose()) {
        // The migrator's `CREATE TABLE IF NOT EXISTS _sqlx_migrations` draws a NOTICE ("relation already exists,
        // skipping") on every run after the first: not news to an operator.
        idemflow::store::template::Dialect::Postgres => {
            let options = idemflow::store::postgres::connect_options(database)?.options([("client_min_messages", "warning")]);
            Store::Postgres(sqlx::postgres::PgPoolOptions::new().max_connections(1).acquire_timeout(database.acquire_timeout).connect_lazy_with(options))
        }
        _ => Store::connect(database)?,
    };
    let latest = store.migrate().await.context("applying migrations")?;
    println!("idemflow schema at version {latest} (migrations recorded in _sqlx_migrations)");
    Ok(())
}
