//! A real MariaDB server for tests (Debian's `mariadb-server`): the shared one at `MARIADB_URL` (`scripts/test`
//! starts it, see scripts/mariadb-throwaway.sh), or a server of the test's own that it can crash and restart.
//! Every test gets a fresh database with idemflow's tables migrated.

use std::path::PathBuf;
use std::process::Command;

/// The shared server's URL (its database part is replaced per test).
pub fn server_url() -> String {
    match std::env::var("MARIADB_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "MARIADB_URL is not set: run the tests with scripts/test, which starts a throwaway MariaDB for the run (or \
             `source scripts/mariadb-throwaway.sh && mariadb_throwaway_start` first)"
        ),
    }
}

/// A fresh database on a MariaDB server, with idemflow's tables migrated.
pub struct MyDb {
    /// Its URL.
    pub url: String,
    /// A pool on it for assertions and setup.
    pub pool: sqlx::MySqlPool,
}

impl MyDb {
    /// Creates the database on the shared server, migrates it, and runs `setup` SQL (business tables).
    pub async fn new(setup: &str) -> MyDb {
        Self::on(&server_url(), setup).await
    }

    /// The same on the server at `url` (for example a [`Server`] of the test's own).
    pub async fn on(url: &str, setup: &str) -> MyDb {
        Self::migrated(url, setup, None).await
    }

    /// A database on the shared server with idemflow's tables as an older version left them: migrated up to
    /// `version` (upgrade tests).
    pub async fn at_version(version: i64, setup: &str) -> MyDb {
        Self::migrated(&server_url(), setup, Some(version)).await
    }

    async fn migrated(url: &str, setup: &str, version: Option<i64>) -> MyDb {
        let name = format!("t_{}", super::unique());
        let base = url.rsplit_once('/').map(|(b, _)| b).unwrap_or(url);
        let admin: sqlx::MySqlPool = sqlx::MySqlPool::connect(&format!("{base}/")).await.expect("connecting to MariaDB");
        sqlx::query(&format!("CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")).execute(&admin).await.unwrap();
        admin.close().await;
        let url = format!("{base}/{name}");
        let settings = idemflow::store::spec::DatabaseSettings {
            url: url.clone().into(),
            max_connections: 4,
            acquire_timeout: std::time::Duration::from_secs(10),
            prepared_statements: true,
            batch_timeout: idemflow::store::spec::DEFAULT_BATCH_TIMEOUT,
        };
        let pool = idemflow::store::mysql::pool(&settings).unwrap();
        match version {
            None => idemflow::store::mysql::MIGRATOR.run(&pool).await.unwrap(),
            Some(v) => super::migrator_up_to("migrations/mysql", v).await.run(&pool).await.unwrap(),
        }
        if !setup.is_empty() {
            sqlx::raw_sql(setup).execute(&pool).await.unwrap_or_else(|e| panic!("{setup}: {e}"));
        }
        MyDb { url, pool }
    }

    /// `SELECT` one scalar.
    pub async fn scalar<T>(&self, sql: &str) -> T
    where
        T: for<'r> sqlx::Decode<'r, sqlx::MySql> + sqlx::Type<sqlx::MySql> + Send + Unpin,
    {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Runs one statement.
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql).execute(&self.pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

impl super::Database for MyDb {
    fn url(&self) -> &str {
        &self.url
    }
}

/// A MariaDB server of the test's own (scripts/mariadb-throwaway.sh), which it can SIGKILL and start again on the
/// same data directory and port; removed on drop.
pub struct Server {
    dir: PathBuf,
    port: u16,
    /// Its URL, database `idemflow`.
    pub url: String,
}

fn script(body: &str, env: &[(&str, String)]) -> String {
    let root = super::project_root();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("set -e; source scripts/mariadb-throwaway.sh; {body}"))
        .current_dir(&root)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(out.status.success(), "{body}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Server {
    /// Initialises and starts a server.
    pub fn start() -> Server {
        Self::start_with("")
    }

    /// [`Server::start`] with more server options (`--log-bin --binlog-format=STATEMENT`, say).
    pub fn start_with(options: &str) -> Server {
        let out = script(
            "mariadb_throwaway_start >/dev/null; echo \"$MARIADB_THROWAWAY_DIR $MARIADB_PORT\"",
            &[("MARIADB_EXTRA_ARGS", options.to_owned())],
        );
        let (dir, port) = out.trim().split_once(' ').expect("dir and port");
        let port: u16 = port.parse().unwrap();
        Server { dir: dir.into(), port, url: format!("mysql://root:root@127.0.0.1:{port}/idemflow") }
    }

    /// SIGKILLs the server, as a crash would (InnoDB recovers from its redo log at the next start).
    pub fn kill(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            Command::new("kill").args(["-KILL", pid.trim()]).status().unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while Command::new("kill").args(["-0", pid.trim()]).status().is_ok_and(|s| s.success()) {
                assert!(std::time::Instant::now() < deadline, "mariadbd did not die");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }

    /// Starts the server again on its data directory and port.
    pub fn start_again(&self) {
        script(
            "mariadb_throwaway_serve",
            &[("MARIADB_THROWAWAY_DIR", self.dir.display().to_string()), ("MARIADB_PORT", self.port.to_string())],
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
