//! Behind PgBouncer in transaction pooling mode (Debian's `pgbouncer`): found by its admin database whatever the
//! settings, so named statements are never used through it and the outcome never depends on which server connection
//! a statement lands on; with `[database] prepared_statements = false` too, `check` and `run` work, a worker killed
//! mid-batch and a PgBouncer restart lose nothing and apply nothing twice.

use crate::failures::{assert_counters_add_up, assert_exactly_once, payments, payments_db, shipped};
use crate::support::*;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A PgBouncer in transaction pooling mode in front of the test server, with a server pool smaller than the
/// worker's connection pool, so server sessions are shared between client connections.
struct PgBouncer {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl PgBouncer {
    fn start() -> PgBouncer {
        let url = crate::support::postgres::server_url();
        let (host_port, _) = url.rsplit_once('/').unwrap();
        let (_, server) = host_port.rsplit_once('@').unwrap();
        let (host, server_port) = server.split_once(':').unwrap();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let server_password = url::Url::parse(url).unwrap().password().unwrap_or_default().to_owned();
        std::fs::write(dir.path().join("users.txt"), format!("\"postgres\" \"{server_password}\"\n")).unwrap();
        // One server connection per database: every client shares it, so named statements of one client always
        // meet another's (PgBouncer before 1.21 keeps them on the server connection in transaction mode), and the
        // collision the test shows first is certain, not up to which server connection a client gets.
        std::fs::write(
            dir.path().join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host={host} port={server_port}\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {0}/users.txt\npool_mode = transaction\n\
                 default_pool_size = 1\nmax_client_conn = 100\nignore_startup_parameters = extra_float_digits\n\
                 logfile = {0}/pgbouncer.log\npidfile = {0}/pgbouncer.pid\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let mut b = PgBouncer { dir, port, child: None };
        b.run();
        b
    }

    /// Starts the process (PgBouncer refuses to run as root: as `postgres` then) and waits for its port.
    fn run(&mut self) {
        let ini = self.dir.path().join("pgbouncer.ini");
        let root = unsafe { libc::geteuid() } == 0;
        let mut cmd = if root {
            let _ = Command::new("chown").args(["-R", "postgres:postgres"]).arg(self.dir.path()).status();
            std::fs::set_permissions(self.dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "pgbouncer"]).arg(&ini);
            c
        } else {
            let mut c = Command::new("pgbouncer");
            c.arg(&ini);
            c
        };
        let child = cmd.spawn().unwrap_or_else(|e| panic!("starting pgbouncer (apt-get install pgbouncer): {e}"));
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "pgbouncer did not listen: {}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }

    /// Stops it at once (SIGKILL: every client and server connection drops).
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = std::fs::read_to_string(self.dir.path().join("pgbouncer.pid")).ok().and_then(|p| p.trim().parse::<i32>().ok());
            if let Some(pid) = pid {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = c.kill();
            let _ = c.wait();
            let _ = std::fs::remove_file(self.dir.path().join("pgbouncer.pid"));
        }
    }

    /// The URL of `db` through PgBouncer.
    fn url(&self, db: &TestDb) -> String {
        let name = db.url.rsplit_once('/').unwrap().1;
        format!("postgres://postgres:pooled@127.0.0.1:{}/{name}", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Points the setup's settings at `url`, with or without `prepared_statements = false`.
fn through(setup: &Setup, db: &TestDb, url: &str, prepared_statements: bool) {
    let text = std::fs::read_to_string(&setup.config).unwrap();
    let mut text = text.replace(&db.url, url);
    if !prepared_statements {
        text = text.replace("max_connections = 4", "max_connections = 4\nprepared_statements = false");
    }
    std::fs::write(&setup.config, text).unwrap();
}

/// The shipped example (the batch SQL form) behind PgBouncer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_in_transaction_mode() {
    behind_pgbouncer(&shipped()).await;
}

/// The per-record SQL form behind PgBouncer: its server-side loop is a function each server session creates in
/// its `pg_temp`, and two workers' connections share one server session here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_record_sql_form_behind_pgbouncer_in_transaction_mode() {
    let per_record = std::fs::read_to_string(project_root().join("examples/per-record-sql/payments.toml")).unwrap();
    assert!(per_record.contains("\nsql = ["), "the per-record example runs statements per record");
    behind_pgbouncer(&per_record).await;
}

/// What a worker reads outside a batch (the start-up schema check, the cleanup of attempt rows) shares PgBouncer's one
/// server connection with other clients: each read runs in a transaction, so a statement parsed for one client is
/// never bound by another's. Outside one, the extended protocol's two round trips (parse and describe, then bind and
/// execute) may each land on the server connection when another client's unnamed statement is there: "bind message
/// supplies 1 parameters, but prepared statement requires 0" or "invalid message format" (SQLSTATE 08P01), and a
/// worker starting beside another exited on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_outside_a_batch_behind_pgbouncer_stay_on_one_server_connection() {
    let bouncer = PgBouncer::start();
    let db = payments_db(None).await;
    // As a worker's pool is behind PgBouncer: no statement prepared by name.
    let settings = idemflow::store::spec::DatabaseSettings {
        url: bouncer.url(&db).into(),
        max_connections: 1,
        acquire_timeout: Duration::from_secs(10),
        prepared_statements: false,
        batch_timeout: idemflow::store::spec::DEFAULT_BATCH_TIMEOUT,
    };
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..16 {
        let pool = idemflow::store::postgres::pool(&settings).unwrap();
        clients.spawn(async move {
            for round in 0..200 {
                let checked = idemflow::store::postgres::check_schema(&pool).await;
                let cleaned = idemflow::store::postgres::offsets::forget_attempts(&pool, "payments", Duration::from_secs(3600)).await;
                if let Err(e) = checked.as_ref().map(drop).map_err(ToString::to_string).and(cleaned.map(drop).map_err(|e| e.to_string())) {
                    return Err(format!("client {client}, round {round}: {e}"));
                }
            }
            Ok(())
        });
    }
    while let Some(done) = clients.join_next().await {
        done.unwrap().unwrap();
    }
}

async fn behind_pgbouncer(pipeline: &str) {
    let mut bouncer = PgBouncer::start();
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 4);
    let s = payments(6000, 4, false);

    // Without the setting: PgBouncer is found (its admin database answers), named statements are not used, and
    // `check` passes every time, whichever server connection its statements land on; `migrate` is refused. Two
    // workers with the default settings, their connections sharing PgBouncer's one server connection, apply a
    // stream of their own (another database and broker) with no collision.
    {
        let db = payments_db(None).await;
        let kafka = Kafka::new();
        kafka.create_topic("payments", 4);
        let s = payments(2000, 4, false);
        let setup = Setup::new(&db, &kafka, &[("payments.toml", pipeline)]);
        let config = setup.config.to_str().unwrap().to_owned();
        through(&setup, &db, &bouncer.url(&db), true);
        for _ in 0..3 {
            let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
            assert!(status.success(), "{out}{err}");
        }
        let (status, out, err) = idemflow(&["migrate", "--config", &config], setup.dir.path());
        assert!(!status.success() && err.contains("PostgreSQL itself"), "{out}{err}");
        let second = Setup::new(&db, &kafka, &[("payments.toml", pipeline)]);
        through(&second, &db, &bouncer.url(&db), true);
        kafka.produce("payments", &s.records);
        let (mut a, mut b) = (BinWorker::start(&setup), BinWorker::start(&second));
        crate::failures::wait_all_durable_or_report(&db, &kafka, "idemflow-payments", "payments", 4, &s, &[&a, &b]).await;
        assert!(a.sigterm().success() && b.sigterm().success());
        for w in [&a, &b] {
            let log = w.log_text();
            assert!(log.contains("leads to PgBouncer") && !log.contains("already exists") && !log.contains("does not exist"), "{log}");
        }
        assert_exactly_once(&db, &s).await;
    }

    // With it: check, run, a SIGKILL mid-batch, a PgBouncer restart.
    let setup = Setup::new(&db, &kafka, &[("payments.toml", pipeline)]);
    let config = setup.config.to_str().unwrap().to_owned();
    through(&setup, &db, &bouncer.url(&db), false);
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let (status, out, err) = idemflow(&["migrate", "--config", &config], setup.dir.path());
    assert!(!status.success() && err.contains("PostgreSQL itself"), "{out}{err}");

    kafka.produce("payments", &s.records[..s.records.len() / 2]);
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "progress through PgBouncer", || async {
        metric(&w.scrape(), "idemflow_records_applied_total", &[("pipeline", "payments")]) > 0.0
    })
    .await;
    w.kill();
    let mut w = BinWorker::start(&setup);
    // Up again through PgBouncer: it holds the partitions (the first worker may have committed the whole first half
    // before its kill, leaving this one nothing to receive yet).
    wait_until(Duration::from_secs(60), "progress after the kill", || async {
        let m = w.scrape();
        let p = [("pipeline", "payments")];
        metric(&m, "idemflow_records_received_total", &p) > 0.0 || metric(&m, "idemflow_assigned_partitions", &p) > 0.0
    })
    .await;
    bouncer.kill();
    kafka.produce("payments", &s.records[s.records.len() / 2..]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    bouncer.run();
    crate::failures::wait_all_durable(&db, &kafka, "idemflow-payments", "payments", 4, &s).await;
    let m = w.scrape();
    assert_counters_add_up(&m);
    assert!(w.sigterm().success(), "{}", w.log_text());
    assert!(!w.log_text().contains("already exists"), "{}", w.log_text());
    assert_exactly_once(&db, &s).await;
}
