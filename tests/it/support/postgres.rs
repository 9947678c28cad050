//! A real PostgreSQL server for tests: `DATABASE_URL` when set, otherwise a throwaway cluster started from the
//! local binaries (initdb/pg_ctl, run as the `postgres` user when we are root) and stopped when this process
//! exits. Every test gets a fresh database with the idemflow schema migrated.

use std::sync::OnceLock;

static SERVER: OnceLock<String> = OnceLock::new();

/// The admin URL of the server (ends in `/postgres`).
pub fn server_url() -> &'static str {
    SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => start_throwaway(),
    })
}

/// A cluster of the test's own, stoppable and restartable (for outage tests): the same throwaway cluster the
/// `idemflow demo` command starts.
pub use idemflow::demo::postgres::Throwaway as Cluster;

fn start_throwaway() -> String {
    let cluster = Cluster::start().unwrap_or_else(|e| panic!("{e}"));
    let url = cluster.url();
    std::mem::forget(cluster); // lives as long as the test process; its watcher stops it when the process exits
    url
}

/// A fresh database on the test server, with the idemflow schema migrated.
pub struct TestDb {
    /// Its URL.
    pub url: String,
    /// A pool on it for assertions.
    pub pool: sqlx::PgPool,
}

impl TestDb {
    /// Creates the database on the shared test server, migrates it, and runs `setup` SQL (business tables).
    pub async fn new(setup: &str) -> TestDb {
        Self::on(server_url(), setup).await
    }

    /// The same on the server at `admin` (for example a [`Cluster`] of the test's own).
    pub async fn on(admin: &str, setup: &str) -> TestDb {
        Self::created(admin, "", setup, None).await
    }

    /// A database on the shared test server with the idemflow schema as an older version left it: migrated up to
    /// `version` (upgrade tests).
    pub async fn at_version(version: i64, setup: &str) -> TestDb {
        Self::created(server_url(), "", setup, Some(version)).await
    }

    /// A database on the shared test server in `encoding` (`LATIN1`, say; collation `C`), migrated up to `version`.
    pub async fn in_encoding(encoding: &str, version: i64, setup: &str) -> TestDb {
        let options = format!(" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0");
        Self::created(server_url(), &options, setup, Some(version)).await
    }

    /// A database made on `admin` with `CREATE DATABASE ...{options}`, migrated (up to `version`), with `setup` run.
    async fn created(admin: &str, options: &str, setup: &str, version: Option<i64>) -> TestDb {
        let name = format!("t_{}", super::unique());
        let mut conn: sqlx::PgConnection = sqlx::Connection::connect(admin).await.expect("connecting to the test server");
        sqlx::Executor::execute(&mut conn, format!("CREATE DATABASE {name}{options}").as_str()).await.unwrap();
        let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(admin);
        let url = format!("{base}/{name}");
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
        match version {
            None => idemflow::store::postgres::MIGRATOR.run(&pool).await.unwrap(),
            Some(v) => super::migrator_up_to("migrations/postgres", v).await.run(&pool).await.unwrap(),
        }
        if !setup.is_empty() {
            sqlx::raw_sql(setup).execute(&pool).await.unwrap();
        }
        TestDb { url, pool }
    }

    /// `SELECT` one scalar.
    pub async fn scalar<T>(&self, sql: &str) -> T
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
    {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}
