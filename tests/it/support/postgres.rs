//! A real PostgreSQL server for tests: `DATABASE_URL` when set, otherwise a throwaway cluster started from the
//! local binaries (initdb/pg_ctl, run as the `postgres` user when we are root) and stopped when this process
//! exits. Every test gets a fresh database with the idemflow schema migrated.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

static SERVER: OnceLock<String> = OnceLock::new();

/// The admin URL of the server (ends in `/postgres`).
pub fn server_url() -> &'static str {
    SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => start_throwaway(),
    })
}

fn pg_bin() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).filter(|p| p.join("initdb").exists()).collect())
        .unwrap_or_default();
    found.sort_by_key(|p| {
        p.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok()).unwrap_or(0)
    });
    match found.pop() {
        Some(bin) => bin,
        None => panic!(
            "no PostgreSQL server binaries found under /usr/lib/postgresql/*/bin. Install them with \
             `apt-get update && apt-get install -y postgresql`, or set DATABASE_URL to a server you run."
        ),
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

fn as_owner(bin: &Path, root: bool) -> Command {
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

fn run(mut c: Command, what: &str) {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what} failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

fn start_throwaway() -> String {
    let bin = pg_bin();
    let root = is_root();
    let dir = tempfile::Builder::new().prefix("idemflow-pg-").tempdir().expect("a temp dir").keep();
    let port = super::free_port();
    let pw = dir.join("pw");
    std::fs::write(&pw, "postgres\n").unwrap();
    if root {
        run(
            {
                let mut c = Command::new("chown");
                c.args(["-R", "postgres:postgres"]).arg(&dir);
                c
            },
            "chown",
        );
    }
    let data = dir.join("data");
    let mut initdb = as_owner(&bin.join("initdb"), root);
    initdb.arg("-D").arg(&data).args(["-U", "postgres", "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]);
    initdb.arg(format!("--pwfile={}", pw.display()));
    run(initdb, "initdb");
    let mut start = as_owner(&bin.join("pg_ctl"), root);
    start.arg("-D").arg(&data).arg("-l").arg(dir.join("server.log")).args(["-w", "-o"]).arg(format!(
        "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off -c max_connections=200",
        dir.display()
    ));
    start.arg("start");
    run(start, "pg_ctl start");
    // Stop the cluster and remove it when this test process exits, whichever way it exits.
    let owner = if root { "runuser -u postgres -- " } else { "" };
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {owner}{pg_ctl} -D {data} -m immediate stop >/dev/null 2>&1; rm -rf {dir}",
        pid = std::process::id(),
        pg_ctl = bin.join("pg_ctl").display(),
        data = data.display(),
        dir = dir.display(),
    );
    Command::new("sh").arg("-c").arg(script).spawn().expect("starting the cluster reaper");
    format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres")
}

/// A fresh database on the test server, with the idemflow schema migrated.
pub struct TestDb {
    /// Its URL.
    pub url: String,
    /// A pool on it for assertions.
    pub pool: sqlx::PgPool,
}

impl TestDb {
    /// Creates the database, migrates it, and runs `setup` SQL (business tables).
    pub async fn new(setup: &str) -> TestDb {
        let admin = server_url();
        let name = format!("t_{}", super::unique());
        let mut conn: sqlx::PgConnection = sqlx::Connection::connect(admin).await.expect("connecting to the test server");
        sqlx::Executor::execute(&mut conn, format!("CREATE DATABASE {name}").as_str()).await.unwrap();
        let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(admin);
        let url = format!("{base}/{name}");
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
        idemflow::db::MIGRATOR.run(&pool).await.unwrap();
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
