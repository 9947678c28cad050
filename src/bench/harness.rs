//! The harness: runs the worker as a child process (`idemflow run`) against a target and measures it (CPU time,
//! peak RSS, throughput, the worker's own histograms), with the environment the report states.

use crate::demo::kafka::EmbeddedKafka;
use anyhow::{bail, Context as _};
use sqlx::{Connection, Executor, PgConnection};
use std::time::{Duration, Instant};
use super::options::*;
use super::report::*;
use super::workload::*;

/// The `le` buckets of a histogram in a Prometheus text scrape, interpolated at quantile `q` (as
/// `histogram_quantile` does). `None` without observations.
pub fn histogram_quantile(scrape: &str, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = scrape
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            let count = l.rsplit_once(' ')?.1.parse().ok()?;
            Some((le, count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in &buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let within = if count > prev.1 { (rank - prev.1) / (count - prev.1) } else { 1.0 };
            return Some(prev.0 + (le - prev.0) * within);
        }
        prev = (le, count);
    }
    None
}

pub(super) fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{') | Some(b' ')))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// `GET /metrics` from `addr` (HTTP/1.0; 1 s to connect, 5 s to read): the body, empty when it does not answer.
pub(crate) fn scrape(addr: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return String::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()
}

/// Runs `idemflow run` as a child process on `pipeline` against `url` until it has received `target` records;
/// returns the figures.
/// One worker run: its label, the pipeline it runs, its consumer group, and how many records it takes.
pub(super) struct WorkerRun<'a> {
    pub(super) id: &'a str,
    pub(super) name: &'a str,
    pub(super) pipeline: String,
    pub(super) group: &'a str,
    pub(super) target: u64,
    /// With the whole stream read: its distinct keys, and the run also waits until that many were applied (so a
    /// rebalance's redeliveries, received again, do not end it early). `None` for a run over a prefix, or whose
    /// side effect applies another count (the shipped example's poison records).
    pub(super) applied: Option<u64>,
    /// With an outbox (`[[sink.http]]`): the run also waits until that many requests were confirmed by their
    /// target, and its note gives the commit-to-confirmation quantiles.
    pub(super) delivered: Option<u64>,
}

/// The `[kafka]` settings of a worker run on the embedded broker.
pub(super) fn kafka_settings(kafka: &EmbeddedKafka) -> String {
    format!("[kafka]\nbootstrap_servers = \"{}\"\n[kafka.properties]\n\"session.timeout.ms\" = \"6000\"\n", kafka.bootstrap_servers())
}

/// Runs the worker as a child process on `pipeline` until it has received `target` records. `broker` is the
/// broker's section of the settings (`[kafka]` or `[rabbitmq]`).
pub(super) async fn worker_run(run: WorkerRun<'_>, broker: &str, url: &str, perf: bool) -> anyhow::Result<RunResult> {
    let probe = Probe::of(url).await;
    worker_run_on(run, broker, &format!("[database]\nurl = \"{url}\"\nmax_connections = 8\n"), perf, &probe).await
}

/// [`worker_run`] with the store's section of the settings (`[database]` or `[redis]`) given whole. `probe` reads
/// the PostgreSQL server whose CPU and WAL over the run are measured (nothing for another store).
pub(super) async fn worker_run_on(run: WorkerRun<'_>, broker: &str, store: &str, perf: bool, probe: &Probe) -> anyhow::Result<RunResult> {
    let WorkerRun { id, name, ref pipeline, group, target, applied: drain, delivered } = run;
    let dir = tempfile::Builder::new().prefix("idemflow-bench-").tempdir()?;
    std::fs::create_dir(dir.path().join("pipelines"))?;
    std::fs::write(dir.path().join("pipelines/orders.toml"), pipeline.replace("topics =", &format!("group_id = \"{group}\"\ntopics =")))?;
    let port = crate::demo::host::free_port()?;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    std::fs::write(
        dir.path().join("idemflow.toml"),
        format!(
            "pipelines = \"pipelines\"\n{store}{broker}\
             [metrics]\nlisten = \"{addr}\"\n[log]\nlevel = \"warn\"\n"
        ),
    )?;
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.path().join("worker.log"))?;
    let db0 = probe.read().await;
    let child = std::process::Command::new(exe)
        .args(["run", "--config"])
        .arg(dir.path().join("idemflow.toml"))
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting the worker")?;
    let pid = child.id() as libc::pid_t;
    let profiler = if perf {
        let out = format!("perf-{}.data", id.trim_matches(|c| c == '(' || c == ')'));
        Some(
            std::process::Command::new("perf")
                .args(["record", "-g", "-F", "499", "-o", &out, "-p", &pid.to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .inspect_err(|_| {
                    // SAFETY: a signal to our own child.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                })
                .context("starting perf")?,
        )
    } else {
        None
    };
    let log = dir.path().join("worker.log");
    let Watched { last_scrape, started, first, progress } = watch(addr, pid, id, target, drain, delivered, &log).await?;
    let received = |m: &str| sample(m, "idemflow_records_received_total");
    let end = Instant::now();
    let (db_cpu, wal) = probe.since(db0, received(&last_scrape)).await;
    let Stopped { cpu_at_target, peak_kib, whole } = stop(pid, child, profiler);
    let (mut t0, mut n0) = first.unwrap_or((started, 0.0));
    let mut short = "";
    if received(&last_scrape) - n0 <= 0.0 {
        // Everything arrived before the first scrape saw anything: time it from the start of the process.
        (t0, n0) = (started, 0.0);
        short = " (run shorter than a scrape: timed from process start)";
    }
    let total = received(&last_scrape);
    let cpu = cpu_at_target.unwrap_or(whole);
    let window = end.duration_since(t0).as_secs_f64().max(1e-9);
    let processed = total - n0;
    let ms = |v: Option<f64>| v.map(|s| s * 1000.0);
    let dup = sample(&last_scrape, "idemflow_duplicates_skipped_total");
    // A rebalance during the run redelivers what was committed in the database but not yet in Kafka: say so.
    let revocations: f64 = last_scrape
        .lines()
        .filter(|l| l.starts_with("idemflow_rebalances_total{") && l.contains("event=\"revoke\""))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum();
    let rebalanced = if revocations > 0.0 { format!(" ({revocations} rebalance revocations)") } else { String::new() };
    let outbox = match delivered {
        Some(_) => {
            let q = |p| ms(histogram_quantile(&last_scrape, "idemflow_outbox_delivery_seconds", p)).map_or("-".to_owned(), |v| format!("{v:.1}"));
            let dead = sample(&last_scrape, "idemflow_outbox_deliveries_total") - confirmed_deliveries(&last_scrape);
            anyhow::ensure!(dead == 0.0, "{id}: {dead} outbox requests were dead-lettered");
            format!(
                "; {} requests confirmed by the provider, commit to confirmation p50 {} ms, p99 {} ms",
                confirmed_deliveries(&last_scrape),
                q(0.5),
                q(0.99)
            )
        }
        None => String::new(),
    };
    Ok(RunResult {
        id: id.into(),
        repetition: 1,
        name: name.into(),
        records: processed as u64,
        seconds: window,
        records_per_second: processed / window,
        cpu_us_per_record: Some(cpu * 1e6 / total.max(1.0)),
        peak_rss_mib: peak_kib.map(|k| k / 1024.0),
        db_cpu_us_per_record: db_cpu,
        wal_bytes_per_record: wal,
        batch_p50_ms: ms(histogram_quantile(&last_scrape, "idemflow_batch_duration_seconds", 0.5)),
        batch_p99_ms: ms(histogram_quantile(&last_scrape, "idemflow_batch_duration_seconds", 0.99)),
        e2e_p50_ms: ms(applied_after(&progress, t0, 0.5)),
        e2e_p99_ms: ms(applied_after(&progress, t0, 0.99)),
        note: format!(
            "{total} received, {} applied, {dup} duplicates skipped{rebalanced}; CPU {cpu:.2} s to the target, {whole:.2} s with shutdown{short}{outbox}",
            sample(&last_scrape, "idemflow_records_applied_total")
        ),
    })
}

/// The outbox requests its targets confirmed, in a scrape (`idemflow_outbox_deliveries_total{outcome="confirmed"}`).
fn confirmed_deliveries(scrape: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with("idemflow_outbox_deliveries_total{") && l.contains("outcome=\"confirmed\""))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// What the scrapes of a worker run saw.
struct Watched {
    /// The last scrape of `/metrics`, taken when the target was reached.
    last_scrape: String,
    /// When the watch started (the process had just been started).
    started: Instant,
    /// When the first record was seen received, and how many were by then.
    first: Option<(Instant, f64)>,
    /// When each scrape saw how many records applied, for the latency from the run's own start.
    progress: Vec<(Instant, f64)>,
}

/// Scrapes the worker's `/metrics` at `addr` until it has received `target` records (and applied `drain`, and had
/// `delivered` outbox requests confirmed, if set).
/// The worker is killed and the run fails when it receives nothing in 60 s, applies nothing more in 60 s after
/// the last record arrived, or takes over 30 minutes; the failure quotes its log (`log`).
#[allow(clippy::too_many_arguments)]
async fn watch(
    addr: std::net::SocketAddr,
    pid: libc::pid_t,
    id: &str,
    target: u64,
    drain: Option<u64>,
    delivered: Option<u64>,
    log: &std::path::Path,
) -> anyhow::Result<Watched> {
    let received = |m: &str| sample(m, "idemflow_records_received_total");
    let applied = |m: &str| sample(m, "idemflow_records_applied_total");
    let started = Instant::now();
    let mut first: Option<(Instant, f64)> = None;
    let mut progress: Vec<(Instant, f64)> = Vec::new();
    let (mut pause, mut before) = (Duration::from_millis(25), (started, 0.0));
    let last_scrape = loop {
        tokio::time::sleep(pause).await;
        let m = scrape(addr);
        if m.is_empty() {
            // No answer this time (the worker busy, or gone: the time limits below still apply).
            if started.elapsed() > Duration::from_secs(1800) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
                bail!("{id}: the worker's /metrics did not answer");
            }
            continue;
        }
        let n = received(&m);
        let now = Instant::now();
        if n > 0.0 && first.is_none() {
            first = Some((now, n));
        }
        progress.push((now, applied(&m)));
        // A scrape renders every series, which costs the worker CPU that a consumer without metrics does not spend
        // (40 a second cost 6-8% of its CPU): every 25 ms only until the first record and from about a second
        // before the end (so both ends of the window are found within 25 ms), every 250 ms in between.
        let rate = (n - before.1) / now.duration_since(before.0).as_secs_f64().max(1e-3);
        let left = (target as f64 - n).max(0.0) / rate.max(1.0);
        pause = if first.is_some() && left > 1.0 { Duration::from_millis(250) } else { Duration::from_millis(25) };
        before = (now, n);
        let confirmed = |m: &str| confirmed_deliveries(m);
        if n >= target as f64 && drain.is_none_or(|want| applied(&m) >= want as f64) && delivered.is_none_or(|want| confirmed(&m) >= want as f64) {
            break m;
        }
        let moved = progress.iter().rev().find(|(_, a)| *a < applied(&m)).map_or(started, |(at, _)| *at);
        if n >= target as f64 && moved.elapsed() > Duration::from_secs(60) {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            unsafe { libc::kill(pid, libc::SIGKILL) };
            bail!("{id}: every record received, {} of {} distinct keys applied, none more in 60 s; its log:\n{log}", applied(&m), drain.unwrap_or(0));
        }
        if started.elapsed() > Duration::from_secs(1800) {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            unsafe { libc::kill(pid, libc::SIGKILL) };
            bail!("{id}: the worker received {n} of {target} records in 30 minutes; its log:\n{log}");
        }
        if started.elapsed() > Duration::from_secs(60) && first.is_none() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            unsafe { libc::kill(pid, libc::SIGKILL) };
            bail!("{id}: the worker received nothing in 60 s; its log:\n{log}");
        }
    };
    Ok(Watched { last_scrape, started, first, progress })
}

/// What a worker run's process cost, read as it is stopped.
struct Stopped {
    /// CPU seconds (user and system) up to the target, when `/proc` answered.
    cpu_at_target: Option<f64>,
    /// The worker's peak resident set, KiB.
    peak_kib: Option<f64>,
    /// CPU seconds of the whole process, its shutdown included.
    whole: f64,
}

/// Reads the worker's CPU and peak memory, stops `perf` if it ran, then stops the worker (SIGTERM) and reaps it.
fn stop(pid: libc::pid_t, child: std::process::Child, profiler: Option<std::process::Child>) -> Stopped {
    // CPU up to the target (utime + stime of /proc/<pid>/stat, in clock ticks): the worker's shutdown is not what a
    // record costs. With a backlog left (runs over a prefix), closing the consumer costs seconds of CPU in
    // librdkafka, which the whole-process figure from wait4 includes.
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| {
        let fields: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
        Some(fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?)
    });
    // SAFETY: sysconf has no preconditions.
    let cpu_at_target = ticks.map(|t| t / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64);
    if let Some(mut p) = profiler {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(p.id() as libc::pid_t, libc::SIGINT) };
        let _ = p.wait();
    }
    // The peak RSS of the worker's own address space (VmHWM; reset by exec). wait4's ru_maxrss would not do: Linux
    // carries the high-water mark of the forked copy of this (large) process across exec.
    let peak_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()));
    // SAFETY: plain syscalls on our own child's pid; `usage` is a zeroed out-parameter.
    let usage = unsafe {
        libc::kill(pid, libc::SIGTERM);
        let mut status = 0;
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::wait4(pid, &mut status, 0, &mut usage);
        usage
    };
    drop(child);
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let whole = secs(usage.ru_utime) + secs(usage.ru_stime);
    Stopped { cpu_at_target, peak_kib, whole }
}

/// The latency quantile `q` of a run's records from the run's own start `t0` (its first record received: the stream
/// waits in the broker from then on, as if produced then), seconds: when a `q` share of the records applied by the
/// end was applied, interpolated linearly between the two scrapes around it (`progress`: when, and how many
/// applied). `None` before anything was applied. Not the worker's `idemflow_end_to_end_latency_seconds`, which
/// counts from each record's timestamp: the stream is produced once before every run, so a later run would carry
/// the earlier runs' time.
fn applied_after(progress: &[(Instant, f64)], t0: Instant, q: f64) -> Option<f64> {
    let want = q * progress.last()?.1;
    let i = progress.iter().position(|(_, n)| *n > 0.0 && *n >= want)?;
    let (at, n) = progress[i];
    let at = match i.checked_sub(1).map(|j| progress[j]) {
        Some((was, m)) if n > m => was + at.duration_since(was).mul_f64((want - m) / (n - m)),
        _ => at,
    };
    Some(at.saturating_duration_since(t0).as_secs_f64())
}

/// CPU seconds (user + system) of this process so far; the hand-written consumers run inside it, beside the
/// embedded Kafka broker, whose CPU is counted with theirs: their CPU figures are upper bounds.
pub(super) fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills a zeroed out-parameter.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// A local PostgreSQL cluster whose CPU time can be read from `/proc`: its postmaster's process id.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cluster(pub(super) i32);

impl Cluster {
    /// The cluster serving `url`: the parent of the backend that answers (the postmaster). `None` for another
    /// store, or a server whose processes this one cannot see (another machine, another namespace).
    pub(super) async fn of(url: &str) -> Option<Cluster> {
        if is_mysql(url) {
            return None;
        }
        let mut conn = PgConnection::connect(url).await.ok()?;
        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn).await.ok()?;
        // Read while the backend lives: it ends with the connection.
        let stat = std::fs::read_to_string(format!("/proc/{backend}/stat")).ok();
        let _ = conn.close().await;
        let stat = stat?;
        let postmaster: i32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        Some(Cluster(postmaster))
    }

    /// CPU seconds the cluster has used so far: the postmaster's own and its ended children's (`utime`, `stime`,
    /// `cutime`, `cstime` of `/proc/<pid>/stat`), and the running children's (backends, WAL writer, checkpointer,
    /// autovacuum). A backend that ends between two readings moves from the second sum to the first, whole.
    pub(super) fn cpu_seconds(self) -> Option<f64> {
        let fields = |pid: i32| -> Option<(i32, [f64; 4])> {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            Some((f.get(1)?.parse().ok()?, [n(11), n(12), n(13), n(14)]))
        };
        let (_, own) = fields(self.0)?;
        let mut ticks: f64 = own.iter().sum();
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            if let Some((_, t)) = fields(pid).filter(|(parent, _)| *parent == self.0) {
                ticks += t[0] + t[1];
            }
        }
        // SAFETY: sysconf has no preconditions.
        Some(ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64)
    }
}

/// What the bench reads of a PostgreSQL server over a run: its cluster's CPU (when its processes are local) and
/// its write-ahead log position. Reads nothing for MySQL/MariaDB or Redis.
#[derive(Clone, Debug, Default)]
pub(super) struct Probe {
    pub(super) cluster: Option<Cluster>,
    pub(super) url: Option<String>,
}

/// One [`Probe::read`]: cluster CPU seconds and WAL bytes so far.
#[derive(Clone, Copy, Debug)]
pub(super) struct Reading {
    pub(super) cpu: Option<f64>,
    pub(super) wal: Option<f64>,
}

impl Probe {
    pub(super) async fn of(url: &str) -> Probe {
        if is_mysql(url) {
            return Probe::default();
        }
        Probe { cluster: Cluster::of(url).await, url: Some(url.to_owned()) }
    }

    /// The server's figures now. The WAL position is read on a connection of its own, before the CPU at the start
    /// of a run and after it at the end ([`Probe::since`]), so the connection's own CPU falls outside the window.
    pub(super) async fn read(&self) -> Reading {
        let wal = self.wal().await;
        Reading { cpu: self.cluster.and_then(Cluster::cpu_seconds), wal }
    }

    /// Bytes written to the WAL so far (`pg_current_wal_lsn()` from 0/0).
    pub(super) async fn wal(&self) -> Option<f64> {
        let mut conn = PgConnection::connect(self.url.as_deref()?).await.ok()?;
        let bytes: f64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8").fetch_one(&mut conn).await.ok()?;
        let _ = conn.close().await;
        Some(bytes)
    }

    /// Cluster CPU microseconds and WAL bytes per record between `before` and now.
    pub(super) async fn since(&self, before: Reading, records: f64) -> (Option<f64>, Option<f64>) {
        let cpu = self.cluster.and_then(Cluster::cpu_seconds);
        let wal = self.wal().await;
        let per = |now: Option<f64>, then: Option<f64>, scale: f64| Some((now? - then?) * scale / records.max(1.0));
        (per(cpu, before.cpu, 1e6), per(wal, before.wal, 1.0))
    }
}

/// Run (5): consume the whole topic, decode and extract each key; no database.
/// The pipeline `text` and its record preparation, checked against the database at `url` as the worker would.
pub(super) async fn preparer(url: &str, text: &str) -> anyhow::Result<(crate::config::Pipeline, crate::prepare::Preparer)> {
    let dir = tempfile::Builder::new().prefix("idemflow-bench-").tempdir()?;
    let file = dir.path().join("orders.toml");
    std::fs::write(&file, text)?;
    let pipeline = crate::config::pipeline::load_file_in(&file, crate::store::template::Dialect::of_url(url)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let store = crate::store::Store::connect(&settings_for(url))?;
    let ready = crate::worker::prepare(&store, std::slice::from_ref(&pipeline)).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
    store.close().await;
    Ok((pipeline, ready[0].preparer.clone()))
}

/// A consume-only run's figures: `n` records since `t0`.
pub(super) fn ceiling_result(name: &str, n: usize, t0: Option<Instant>, note: String) -> RunResult {
    let secs = t0.map_or(0.0, |t| t.elapsed().as_secs_f64()).max(1e-9);
    RunResult {
        id: "(5)".into(),
        name: name.into(),
        records: n as u64,
        seconds: secs,
        records_per_second: n as f64 / secs,
        note,
        ..RunResult::default()
    }
}

pub(super) async fn environment(admin_url: &str, throwaway: bool, o: &BenchOptions, partitions: i32) -> anyhow::Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':').map(|(_, v)| v.trim().to_owned()))
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .map(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()).unwrap_or(0) / 1024 / 1024)
        .unwrap_or(0);
    env.push(("machine".into(), format!("{cores} cores ({cpu}), {mem} GiB RAM")));
    if is_mysql(admin_url) {
        let mut conn = sqlx::MySqlConnection::connect_with(&crate::store::mysql::connect_options(&settings_for(admin_url))?).await?;
        let version: String = sqlx::query_scalar("SELECT CAST(VERSION() AS CHAR)").fetch_one(&mut conn).await?;
        env.push(("mysql".into(), version));
        for setting in ["innodb_flush_log_at_trx_commit", "sync_binlog", "log_bin", "innodb_buffer_pool_size", "innodb_doublewrite"] {
            let value: Option<String> = sqlx::query_scalar(&format!("SELECT CAST(@@GLOBAL.{setting} AS CHAR)")).fetch_one(&mut conn).await?;
            env.push((setting.into(), value.unwrap_or_default()));
        }
    } else {
        let mut conn = PgConnection::connect(admin_url).await?;
        let version: String = sqlx::query_scalar("SELECT version()").fetch_one(&mut conn).await?;
        env.push(("postgres".into(), format!("{version}{}", if throwaway { " (throwaway cluster on local disk)" } else { "" })));
        for setting in ["synchronous_commit", "fsync", "full_page_writes", "wal_level", "shared_buffers", "max_wal_size"] {
            let value: String = sqlx::query_scalar(&format!("SHOW {setting}")).fetch_one(&mut conn).await?;
            env.push((setting.into(), value));
        }
    }
    env.push(("kafka".into(), format!("librdkafka {} mock cluster, 1 broker, {partitions} partitions", rdkafka::util::get_rdkafka_version().1)));
    env.push((
        "stream".into(),
        if is_mysql(admin_url) {
            format!("{} records; runs (2) and (6) over the first {} and {}", o.records, o.single_records.min(o.records), o.sql_records.min(o.records))
        } else {
            format!("{} records; runs (2) and (6) over the first {} and {}; (4) with {} dedup keys preloaded", o.records, o.single_records.min(o.records), o.sql_records.min(o.records), o.preload)
        },
    ));
    env.push(("idemflow".into(), format!("{} (release build: {})", env!("CARGO_PKG_VERSION"), !cfg!(debug_assertions))));
    Ok(env)
}

/// Preloads `keys` dedup rows of other keys for the pipeline (run (4)); returns the seconds it took.
pub(super) async fn preload(url: &str, keys: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut conn = PgConnection::connect(url).await?;
    eprintln!("(4) preloading {keys} dedup keys...");
    sqlx::query(
        r#"INSERT INTO idemflow.dedup (pipeline, key_id, topic, partition, "offset", fingerprint)
           SELECT $1, convert_to('PRE-' || g, 'UTF8'), 'preload', 0, g, substring(sha256(convert_to(g::text, 'UTF8')) FROM 1 FOR 16)
           FROM generate_series(1, $2::int8) g"#,
    )
    .bind(PIPELINE)
    .bind(keys as i64)
    .execute(&mut conn)
    .await?;
    conn.execute("VACUUM ANALYZE idemflow.dedup").await?;
    Ok(started.elapsed().as_secs_f64())
}
