//! Test support: a real Postgres, the Kafka mock cluster, and the worker (as the built binary or in-process).

pub mod kafka;
pub mod mariadb;
pub mod nats;
pub mod noida;
pub mod postgres;
pub mod provider;
pub mod rabbitmq;
pub mod redis;
pub mod registry;
pub mod relay;
pub mod rocketmq;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use kafka::{Kafka, Out};
pub use postgres::TestDb;

/// A test database a settings file can point at: a PostgreSQL [`TestDb`] or a MariaDB [`mariadb::MyDb`].
pub trait Database {
    /// Its URL, for `[database] url`.
    fn url(&self) -> &str;
}

impl Database for TestDb {
    fn url(&self) -> &str {
        &self.url
    }
}

/// A loopback port that was free a moment ago, below the kernel's ephemeral range (see
/// `idemflow::demo::host::free_port`).
pub fn free_port() -> u16 {
    idemflow::demo::host::free_port().expect("a free loopback port")
}

/// Starts one of the suite's own servers, `python3 <root>/<script> --port PORT <args>` on a free port, and waits for
/// its "listening" line (the schema registry, the payment provider); `what` names it in the failure.
pub fn start_python_server(script: &str, args: &[&str], what: &str) -> (Child, u16) {
    let port = free_port();
    let mut child = Command::new("python3")
        .arg(project_root().join(script))
        .args(["--port", &port.to_string()])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 (scripts/preflight.sh puts the test environment's first on PATH)");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("listening"), "{what} did not start: {line:?}");
    (child, port)
}

/// A name no other test in any process uses.
pub fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), nanos)
}

/// `len` pseudo-random letters from `seed` (xorshift64): high-entropy text that does not compress.
pub fn random_text(len: usize, seed: u64) -> String {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// The project's root (where `pipelines/` and `idemflow.toml` live).
pub fn project_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The project's migrations in `dir` (e.g. `migrations/postgres`) up to `version`, as an older release shipped
/// them: the same files, so the checksums recorded match the full set's and a later `idemflow migrate` goes on
/// from there.
pub async fn migrator_up_to(dir: &str, version: i64) -> sqlx::migrate::Migrator {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(project_root().join(dir)).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let v: i64 = name.split('_').next().unwrap().parse().unwrap();
        if v <= version {
            std::fs::copy(&path, tmp.path().join(&name)).unwrap();
        }
    }
    let migrator = sqlx::migrate::Migrator::new(tmp.path()).await.unwrap();
    assert_eq!(migrator.iter().map(|m| m.version).max(), Some(version), "{dir} has no migration {version}");
    migrator
}

/// Dedup rows read back as (key text, stored `key_id`): there are `n`, each at the id this version computes for its
/// key ([`idemflow::key::BusinessKey::key_id`]).
pub fn assert_key_ids(rows: &[(String, Vec<u8>)], n: usize) {
    assert_eq!(rows.len(), n);
    for (text, id) in rows {
        assert_eq!(&id[..], &*idemflow::key::BusinessKey::new(text.clone()).key_id(), "{text:?}");
    }
}

/// The usual start of a test: a fresh database with `setup_sql`, a mock cluster with `topic`, and the settings
/// with `pipelines`.
pub async fn fixture(setup_sql: &str, topic: &str, partitions: i32, pipelines: &[(&str, &str)]) -> (TestDb, Kafka, Setup) {
    let db = TestDb::new(setup_sql).await;
    let kafka = Kafka::new();
    kafka.create_topic(topic, partitions);
    let setup = Setup::new(&db, &kafka, pipelines);
    (db, kafka, setup)
}

/// A settings file and pipelines in a temporary directory.
pub struct Setup {
    /// The directory (removed on drop).
    pub dir: tempfile::TempDir,
    /// `idemflow.toml` in it.
    pub config: PathBuf,
    /// Where the worker serves `/metrics`.
    pub metrics: SocketAddr,
}

/// Kafka client properties that make the mock cluster's group protocol fast in tests.
pub const TEST_KAFKA_PROPERTIES: &str = r#"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
"topic.metadata.refresh.interval.ms" = "1000"
"#;

impl Setup {
    /// Writes `idemflow.toml` for `db` and `kafka`, and each `(file name, text)` into `pipelines/`.
    pub fn new(db: &dyn Database, kafka: &Kafka, pipelines: &[(&str, &str)]) -> Setup {
        Self::with(db, kafka, pipelines, "", "")
    }

    /// The same, with more `[kafka.properties]` lines and more settings (`extra`, TOML appended at the end).
    pub fn with(db: &dyn Database, kafka: &Kafka, pipelines: &[(&str, &str)], properties: &str, extra: &str) -> Setup {
        Self::with_bootstrap(db, kafka.bootstrap(), pipelines, properties, extra)
    }

    /// [`Setup::with`] for a Kafka at `bootstrap` (another implementation than the mock cluster).
    pub fn with_bootstrap(db: &dyn Database, bootstrap: &str, pipelines: &[(&str, &str)], properties: &str, extra: &str) -> Setup {
        let kafka = format!(
            "[kafka]\nbootstrap_servers = \"{bootstrap}\"\n[kafka.properties]{}\n",
            merge_properties(TEST_KAFKA_PROPERTIES, properties)
        );
        Self::write(db, &kafka, pipelines, extra)
    }

    /// Settings for NATS JetStream pipelines only: `[nats]` of `server`, no `[kafka]` section at all.
    pub fn nats(db: &dyn Database, server: &nats::NatsServer, pipelines: &[(&str, &str)], extra: &str) -> Setup {
        Self::write(db, &server.settings(), pipelines, extra)
    }

    /// Settings for RabbitMQ pipelines only: `[rabbitmq]` for `url`, no `[kafka]` section at all.
    pub fn rabbitmq(db: &dyn Database, url: &str, pipelines: &[(&str, &str)], extra: &str) -> Setup {
        Self::write(db, &rabbitmq::settings(url), pipelines, extra)
    }

    /// Settings for RocketMQ pipelines only: `[rocketmq]` for `name_server` with more lines of that section
    /// (`section`), no `[kafka]` section at all.
    pub fn rocketmq(db: &dyn Database, name_server: &str, pipelines: &[(&str, &str)], section: &str) -> Setup {
        Self::write(db, &format!("{}{section}", rocketmq::settings(name_server)), pipelines, "")
    }

    /// Settings for Redis pipelines reading Kafka: `[redis]` (no `[database]`), `[kafka]` with more properties.
    pub fn redis(server: &redis::RedisServer, kafka: &Kafka, pipelines: &[(&str, &str)], properties: &str, extra: &str) -> Setup {
        Self::redis_section(&server.section(), kafka, pipelines, properties, extra)
    }

    /// [`Setup::redis`] with the `[redis]` section given whole (Sentinel, say).
    pub fn redis_section(section: &str, kafka: &Kafka, pipelines: &[(&str, &str)], properties: &str, extra: &str) -> Setup {
        let broker = format!("[kafka]\nbootstrap_servers = \"{}\"\n[kafka.properties]{}\n", kafka.bootstrap(), merge_properties(TEST_KAFKA_PROPERTIES, properties));
        Self::write_sections(section, &broker, pipelines, extra)
    }

    /// Settings for Redis pipelines reading RabbitMQ: `[redis]` and `[rabbitmq]`, no `[database]` or `[kafka]`.
    pub fn redis_rabbitmq(server: &redis::RedisServer, url: &str, pipelines: &[(&str, &str)]) -> Setup {
        Self::write_sections(&server.section(), &rabbitmq::settings(url), pipelines, "")
    }

    /// Writes the pipelines and `idemflow.toml` with the broker's section (`broker`) and more settings (`extra`).
    fn write(db: &dyn Database, broker: &str, pipelines: &[(&str, &str)], extra: &str) -> Setup {
        let store = format!("[database]\nurl = \"{}\"\nmax_connections = 4\nacquire_timeout = \"2s\"\n", db.url());
        Self::write_sections(&store, broker, pipelines, extra)
    }

    /// Writes the pipelines and `idemflow.toml` with the store's section, the broker's and more settings (`extra`).
    pub fn sections(store: &str, broker: &str, pipelines: &[(&str, &str)], extra: &str) -> Setup {
        Self::write_sections(store, broker, pipelines, extra)
    }

    fn write_sections(store: &str, broker: &str, pipelines: &[(&str, &str)], extra: &str) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("pipelines")).unwrap();
        for (name, text) in pipelines {
            std::fs::write(dir.path().join("pipelines").join(name), text).unwrap();
        }
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let config = dir.path().join("idemflow.toml");
        std::fs::write(
            &config,
            format!(
                "{store}{broker}\
                 [metrics]\nlisten = \"{metrics}\"\n[log]\nlevel = \"info\"\n[shutdown]\ntimeout = \"20s\"\n{extra}\n",
            ),
        )
        .unwrap();
        Setup { dir, config, metrics }
    }

    /// The file the binary worker logs to.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("worker.log")
    }
}

/// The built `idemflow` binary, as a separate process.
pub struct BinWorker {
    child: Option<Child>,
    /// Its `/metrics` address.
    pub metrics: SocketAddr,
    log: PathBuf,
}

/// Runs `idemflow <args...>` to completion and returns (status, stdout, stderr).
pub fn idemflow(args: &[&str], cwd: &Path) -> (ExitStatus, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemflow")).args(args).current_dir(cwd).output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

impl BinWorker {
    /// Starts `idemflow run --config <setup>`, appending its log to the setup's log file.
    pub fn start(setup: &Setup) -> BinWorker {
        BinWorker::start_with_env(setup, &[])
    }

    /// [`BinWorker::start`] with environment variables set for the worker (fault injection, overrides).
    pub fn start_with_env(setup: &Setup, vars: &[(&str, &str)]) -> BinWorker {
        let log = setup.log();
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemflow"))
            .args(["run", "--config"])
            .arg(&setup.config)
            .env_remove("RUST_LOG")
            .envs(vars.iter().copied())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        BinWorker { child: Some(child), metrics: setup.metrics, log }
    }

    /// Sends SIGTERM and waits (at most 30 s) for the exit status.
    pub fn sigterm(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        sigterm_child(&mut child, Duration::from_secs(30))
            .unwrap_or_else(|| panic!("the worker did not exit within 30 s of SIGTERM; log:\n{}", self.log_text()))
    }

    /// Waits (at most `timeout`) for the worker to exit by itself and returns its status; the log if it does not.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let status = wait_child(self.child.as_mut().expect("running"), timeout);
        let status = status.unwrap_or_else(|| panic!("the worker did not exit within {timeout:?}; log:\n{}", self.log_text()));
        self.child = None;
        status
    }

    /// [`BinWorker::start`] with a limit on the worker's open file descriptors (`RLIMIT_NOFILE`).
    pub fn start_with_fd_limit(setup: &Setup, fds: u64) -> BinWorker {
        use std::os::unix::process::CommandExt;
        let log = setup.log();
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemflow"));
        cmd.args(["run", "--config"]).arg(&setup.config).env_remove("RUST_LOG").stdout(Stdio::null()).stderr(file);
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let limit = libc::rlimit { rlim_cur: fds, rlim_max: fds };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        BinWorker { child: Some(cmd.spawn().unwrap()), metrics: setup.metrics, log }
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends a signal (`"STOP"`, `"CONT"`, ...) to the running worker.
    pub fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("running");
        Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).status().unwrap();
    }

    /// SIGKILLs the worker.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The worker's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Scrapes `/metrics` (empty when not up yet).
    pub fn scrape(&self) -> String {
        http_get(self.metrics, "/metrics").map(|(_, body)| body).unwrap_or_default()
    }
}

impl Drop for BinWorker {
    /// Kills the worker; when the test is failing (a panic is unwinding), prints the end of the worker's log first,
    /// so a failure shows what the worker was doing, not only the assertion.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(60).collect::<Vec<_>>().into_iter().rev().collect();
            eprintln!("----- the last {} lines of the worker's log ({}) -----\n{}\n-----", tail.len(), self.log.display(), tail.join("\n"));
        }
        self.kill();
    }
}

/// A minimal HTTP/1.0 GET: (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// The value of one sample in Prometheus text format, `labels` matched exactly as `name{a="x",b="y"}` in any
/// order; 0 when absent.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let (n, l) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        let mut have: Vec<&str> = l.split(',').filter(|s| !s.is_empty()).collect();
        let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        have.sort_unstable();
        want.sort_unstable();
        if have == want {
            return value.parse().unwrap();
        }
    }
    0.0
}

/// Waits (at most `timeout`) for `child` to exit; its status, or `None` if it still runs.
pub fn wait_child(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends SIGTERM to `child` and waits (at most `timeout`) for its exit status; `None`, with the child SIGKILLed, if it
/// did not exit in time.
pub fn sigterm_child(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = wait_child(child, timeout);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    status
}

/// Polls `check` every 100 ms until it returns true; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `base` property lines with those of `more` replacing lines of the same name.
fn merge_properties(base: &str, more: &str) -> String {
    let name = |l: &str| l.split('=').next().unwrap_or_default().trim().to_owned();
    let more_names: Vec<String> = more.lines().filter(|l| l.contains('=')).map(name).collect();
    let mut out: Vec<&str> = base.lines().filter(|l| !l.contains('=') || !more_names.contains(&name(l))).collect();
    out.extend(more.lines());
    out.join("\n")
}

/// The worker in this process: faster to start and stop than the binary, same code path.
pub struct InProc {
    trigger: idemflow::shutdown::Trigger,
    handle: tokio::task::JoinHandle<Vec<idemflow::worker::PipelineFailure>>,
    /// Its metrics.
    pub metrics: idemflow::metrics::Metrics,
}

impl InProc {
    /// Loads the setup's settings and pipelines, prepares them and runs the worker.
    pub async fn start(setup: &Setup) -> InProc {
        Self::start_with_faults(setup, idemflow::worker::Faults::default()).await
    }

    /// [`InProc::start`], with injected faults.
    pub async fn start_with_faults(setup: &Setup, faults: idemflow::worker::Faults) -> InProc {
        let settings = idemflow::config::load_settings_from(&setup.config, []).unwrap().settings;
        let store = idemflow::store::Store::connect(settings.database.as_ref().unwrap()).unwrap();
        Self::start_on(setup, store, faults).await
    }

    /// [`InProc::start_with_faults`] for Redis pipelines (`[redis]`).
    pub async fn start_redis(setup: &Setup, faults: idemflow::worker::Faults) -> InProc {
        let settings = idemflow::config::load_settings_from(&setup.config, []).unwrap().settings;
        let store = idemflow::store::Store::redis(settings.redis.as_ref().unwrap()).unwrap();
        Self::start_on(setup, store, faults).await
    }

    /// [`InProc::start_with_faults`] on a store built by the test (a MySQL claim form forced, say).
    pub async fn start_on(setup: &Setup, store: idemflow::store::Store, faults: idemflow::worker::Faults) -> InProc {
        let _ = tracing_subscriber::fmt().with_env_filter("info,librdkafka=warn").with_test_writer().try_init();
        let settings = idemflow::config::load_settings_from(&setup.config, []).unwrap().settings;
        let pipelines = idemflow::config::load_pipelines_for(&settings).unwrap();
        let ready = idemflow::worker::prepare(&store, &pipelines).await.unwrap();
        let metrics = idemflow::metrics::Metrics::new();
        let health = idemflow::http::Health::default();
        let (trigger, stop) = idemflow::shutdown::channel();
        let m = metrics.clone();
        let handle = tokio::spawn(async move { idemflow::worker::run_with_faults(&settings, ready, &m, &health, stop, faults).await });
        InProc { trigger, handle, metrics }
    }

    /// The metric value (see [`metric`]).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric(&String::from_utf8(self.metrics.render()).unwrap(), name, labels)
    }

    /// Waits until the pipeline has received `n` records (committed batches).
    pub async fn wait_received(&self, pipeline: &str, n: u64) {
        wait_until(Duration::from_secs(60), &format!("{pipeline} to receive {n} records"), || async {
            self.metric("idemflow_records_received_total", &[("pipeline", pipeline)]) as u64 >= n
        })
        .await;
    }

    /// Waits until every pipeline has ended by itself (an injected crash, a fatal error) and returns the failures.
    pub async fn stop_when_pipelines_end(self) -> Vec<idemflow::worker::PipelineFailure> {
        let failures = self.handle.await.unwrap();
        drop(self.trigger);
        failures
    }

    /// Shuts down and returns the pipeline failures.
    pub async fn stop(self) -> Vec<idemflow::worker::PipelineFailure> {
        self.trigger.trigger();
        self.handle.await.unwrap()
    }

}

/// `pipeline` (TOML text) with `[batch] max_records = n`: the value replaced when the pipeline sets one, otherwise a
/// `[batch]` table added at the end (the shipped examples leave batching at its defaults).
pub fn with_max_records(pipeline: &str, n: usize) -> String {
    if let Some(at) = pipeline.find("\nmax_records = ") {
        let end = pipeline[at + 1..].find('\n').map_or(pipeline.len(), |e| at + 1 + e);
        format!("{}\nmax_records = {n}{}", &pipeline[..at], &pipeline[end..])
    } else {
        format!("{pipeline}\n[batch]\nmax_records = {n}\n")
    }
}
