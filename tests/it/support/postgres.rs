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

/// A PostgreSQL cluster of this test process: started from the local binaries, stoppable and restartable (for
/// outage tests), stopped and removed when dropped or when the process exits.
pub struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    root: bool,
    port: u16,
}

impl Cluster {
    /// initdb + start.
    pub fn start() -> Cluster {
        let bin = pg_bin();
        let root = is_root();
        let dir = tempfile::Builder::new().prefix("idemflow-pg-").tempdir().expect("a temp dir").keep();
        let port = super::free_port();
        let pw = dir.join("pw");
        std::fs::write(&pw, "postgres\n").unwrap();
        if root {
            let mut c = Command::new("chown");
            c.args(["-R", "postgres:postgres"]).arg(&dir);
            run(c, "chown");
        }
        let mut initdb = as_owner(&bin.join("initdb"), root);
        initdb.arg("-D").arg(dir.join("data")).args(["-U", "postgres", "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]);
        initdb.arg(format!("--pwfile={}", pw.display()));
        run(initdb, "initdb");
        let cluster = Cluster { bin, dir, root, port };
        cluster.pg_ctl("start");
        // Stop the cluster and remove it when this test process exits, whichever way it exits.
        let owner = if root { "runuser -u postgres -- " } else { "" };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {owner}{pg_ctl} -D {dir}/data -m immediate stop >/dev/null 2>&1; rm -rf {dir}",
            pid = std::process::id(),
            pg_ctl = cluster.bin.join("pg_ctl").display(),
            dir = cluster.dir.display(),
        );
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting the cluster reaper");
        cluster
    }

    fn pg_ctl(&self, action: &str) {
        let mut c = as_owner(&self.bin.join("pg_ctl"), self.root);
        c.arg("-D").arg(self.dir.join("data")).arg("-l").arg(self.dir.join("server.log")).args(["-w", "-m", "fast"]);
        if action != "stop" {
            c.arg("-o").arg(format!(
                "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off -c max_connections=300",
                self.port,
                self.dir.display()
            ));
        }
        c.arg(action);
        run(c, &format!("pg_ctl {action}"));
    }

    /// The admin URL.
    pub fn url(&self) -> String {
        format!("postgres://postgres:postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown: connections are terminated).
    pub fn stop(&self) {
        self.pg_ctl("stop");
    }

    /// Starts it again on the same port.
    pub fn start_again(&self) {
        self.pg_ctl("start");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut c = as_owner(&self.bin.join("pg_ctl"), self.root);
        c.arg("-D").arg(self.dir.join("data")).args(["-m", "immediate", "stop"]);
        let _ = c.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_throwaway() -> String {
    let cluster = Cluster::start();
    let url = cluster.url();
    std::mem::forget(cluster); // lives as long as the process; the reaper stops it
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
