//! `idemflow soak`: the guarantee held over time, under faults at random moments.
//!
//! A steady stream of payments with duplicates (producer retries, reused order ids, poison records: the demo's
//! stream, [`crate::demo::stream_from`], one second's worth at a time) flows from an embedded Kafka broker
//! ([`crate::demo::kafka`]) through the shipped `pipelines/payments.toml` into a throwaway PostgreSQL cluster with
//! durability on ([`crate::demo::postgres`]), on the release worker run as a child process (`idemflow run`), while at
//! random moments one of [`Fault`] happens: the worker SIGKILLed and started again, PostgreSQL restarted (a fast
//! shutdown, or an immediate one that is a crash with recovery), the broker down and up again, every packet to and
//! from the store's or the broker's port dropped for a while (Debian's `iptables` on loopback; needs root, left out
//! otherwise and said so). When the time is up the faults stop, the stream stops, and the soak waits until every
//! record is applied or dead-lettered, then checks:
//!
//! - every operation applied once: one `payments` row per distinct operation, the total deducted from the accounts
//!   equal to the distinct operations' sum, one dead letter per poison record, one dedup row per operation;
//! - the counters reconcile: the dedup rows' duplicate counts (written in the batches' transactions) equal the
//!   retries and reused ids injected; the workers' counters summed over every process (each one's last scrape)
//!   give `republished` = retries, `payload_mismatch` = reused ids, applied = distinct operations, and the last
//!   worker's `received = applied + duplicates + dead letters`. A process SIGKILLed after a batch's commit and
//!   before the next scrape takes that batch's counts with it: then the counted figures are short by that batch
//!   (never over), and the report says by how much;
//! - the worker's resident memory, open files and threads, sampled every 10 s, flat: the largest of the last
//!   third of the run at most the largest of the middle third plus a margin ([`flat`]).
//!
//! The report (Markdown) goes to stdout and to `--report`; the worker's log and settings stay beside it.

use crate::demo::{self, kafka::EmbeddedKafka, postgres::Throwaway};
use anyhow::{bail, Context as _};
use rdkafka::producer::BaseRecord;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Options of `idemflow soak`.
#[derive(Clone, Debug)]
pub struct SoakOptions {
    /// How long the stream flows under faults.
    pub duration: Duration,
    /// Records produced per second.
    pub rate: u32,
    /// The shortest and longest time between two faults.
    pub fault_gap: (Duration, Duration),
    /// Where the report (Markdown) is written; the worker's log and settings go into its directory.
    pub report: PathBuf,
    /// The random generator's seed (the faults' moments and kinds; the stream is the same for every seed).
    pub seed: u64,
}

/// A fault the soak injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The worker SIGKILLed, started again 0.5-3 s later.
    KillWorker,
    /// PostgreSQL stopped (fast shutdown, sessions terminated) and started again 2-8 s later.
    RestartStore,
    /// PostgreSQL stopped as by a crash (immediate shutdown: recovery at the next start), started again 2-8 s later.
    CrashStore,
    /// The broker refuses connections and drops those it had, for 3-10 s.
    RestartBroker,
    /// Every packet to and from the store's port dropped for 3-45 s (`[database] batch_timeout` is 30 s here).
    DropStorePackets,
    /// Every packet to and from the broker's port dropped for 3-45 s.
    DropBrokerPackets,
}

impl Fault {
    const ALL: [Fault; 6] =
        [Fault::KillWorker, Fault::RestartStore, Fault::CrashStore, Fault::RestartBroker, Fault::DropStorePackets, Fault::DropBrokerPackets];

    fn name(self) -> &'static str {
        match self {
            Fault::KillWorker => "worker SIGKILLed",
            Fault::RestartStore => "PostgreSQL restarted",
            Fault::CrashStore => "PostgreSQL crashed",
            Fault::RestartBroker => "broker down",
            Fault::DropStorePackets => "store's packets dropped",
            Fault::DropBrokerPackets => "broker's packets dropped",
        }
    }

    fn needs_iptables(self) -> bool {
        matches!(self, Fault::DropStorePackets | Fault::DropBrokerPackets)
    }
}

/// xorshift64.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }

    fn between(&mut self, low: Duration, high: Duration) -> Duration {
        let span = high.saturating_sub(low).as_millis() as u64;
        low + Duration::from_millis(self.below(span + 1))
    }
}

/// Drops every TCP packet to and from a loopback port while it lives (two `iptables -I INPUT -i lo` rules, removed
/// on drop): the soak's packet faults, and the network tests' (`tests/it/network.rs`). Needs root.
pub struct Blackhole {
    port: u16,
}

impl Blackhole {
    fn rules(port: u16) -> [Vec<String>; 2] {
        let p = port.to_string();
        [
            ["INPUT", "-i", "lo", "-p", "tcp", "--dport", &p, "-j", "DROP"].map(str::to_owned).to_vec(),
            ["INPUT", "-i", "lo", "-p", "tcp", "--sport", &p, "-j", "DROP"].map(str::to_owned).to_vec(),
        ]
    }

    /// Whether `iptables` runs here (installed, and we are root).
    pub fn available() -> bool {
        Command::new("iptables").args(["-L", "INPUT", "-n"]).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    }

    /// Inserts the rules for `port`.
    ///
    /// Errors: `iptables` is missing or refuses (not root).
    pub fn start(port: u16) -> anyhow::Result<Blackhole> {
        let hole = Blackhole { port };
        for rule in Self::rules(port) {
            let status = Command::new("iptables").arg("-I").args(&rule).status().context("running iptables")?;
            if !status.success() {
                bail!("iptables -I {} failed", rule.join(" "));
            }
        }
        Ok(hole)
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        for rule in Self::rules(self.port) {
            let _ = Command::new("iptables").arg("-D").args(&rule).status();
        }
    }
}

/// What the counters of one worker process said at its last scrape.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    received: f64,
    applied: f64,
    republished: f64,
    redelivered: f64,
    mismatched: f64,
    dead_letters: f64,
    tombstones: f64,
}

impl Counts {
    fn of(scrape: &str) -> Option<Counts> {
        if !scrape.contains("idemflow_records_received_total") {
            return None;
        }
        let sum = |name: &str, reason: Option<&str>| -> f64 {
            scrape
                .lines()
                .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{' | b' ')))
                .filter(|l| reason.is_none_or(|r| l.contains(&format!("reason=\"{r}\""))))
                .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
                .sum()
        };
        Some(Counts {
            received: sum("idemflow_records_received_total", None),
            applied: sum("idemflow_records_applied_total", None),
            republished: sum("idemflow_duplicates_skipped_total", Some("republished")),
            redelivered: sum("idemflow_duplicates_skipped_total", Some("redelivered")),
            mismatched: sum("idemflow_duplicates_skipped_total", Some("payload_mismatch")),
            dead_letters: sum("idemflow_dead_letters_total", None),
            tombstones: sum("idemflow_tombstones_skipped_total", None),
        })
    }

    fn add(&mut self, o: &Counts) {
        self.received += o.received;
        self.applied += o.applied;
        self.republished += o.republished;
        self.redelivered += o.redelivered;
        self.mismatched += o.mismatched;
        self.dead_letters += o.dead_letters;
        self.tombstones += o.tombstones;
    }

    fn parts(&self) -> f64 {
        self.applied + self.republished + self.redelivered + self.mismatched + self.dead_letters + self.tombstones
    }
}

/// One sample of the worker process's resources.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Duration,
    pid: u32,
    rss_kib: u64,
    fds: u64,
    threads: u64,
}

impl Sample {
    fn of(pid: u32, at: Duration) -> Option<Sample> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| -> Option<u64> {
            status.lines().find_map(|l| l.strip_prefix(name))?.split_whitespace().next()?.parse().ok()
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
        Some(Sample { at, pid, rss_kib: field("VmRSS:")?, fds, threads: field("Threads:")? })
    }
}

/// Whether a resource stayed flat: the largest value of the last third of the run is at most the largest of the
/// middle third plus `margin` (the first third is the warm-up: caches, pools and librdkafka's buffers filling).
/// `None` when there are too few samples to tell.
fn flat(samples: &[Sample], value: impl Fn(&Sample) -> u64, margin: u64) -> Option<(u64, u64, bool)> {
    let end = samples.last()?.at;
    let third = end / 3;
    let max_in = |from: Duration, to: Duration| samples.iter().filter(|s| s.at >= from && s.at <= to).map(&value).max();
    let middle = max_in(third, third * 2)?;
    let last = max_in(third * 2, end)?;
    Some((middle, last, last <= middle + margin))
}

/// The worker as a child process.
struct Worker {
    child: Child,
    metrics: std::net::SocketAddr,
    last: Option<Counts>,
}

impl Worker {
    fn start(config: &Path, log: &Path, metrics: std::net::SocketAddr) -> anyhow::Result<Worker> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        let mut command = Command::new(std::env::current_exe()?);
        crate::demo::kafka::without_inherited_descriptors(&mut command);
        let child = command
            .args(["run", "--config"])
            .arg(config)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .context("starting idemflow run")?;
        Ok(Worker { child, metrics, last: None })
    }

    fn scrape(&mut self) {
        if let Some(c) = Counts::of(&crate::bench::scrape(self.metrics)) {
            self.last = Some(c);
        }
    }

    /// The exit status if it exited by itself.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn kill(mut self) -> Option<Counts> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.last
    }

    /// SIGTERM, then the exit status (waiting at most `timeout`, then SIGKILL).
    fn stop(mut self, timeout: Duration) -> (Option<std::process::ExitStatus>, Option<Counts>) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.exited() {
                return (Some(status), self.last);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        (None, self.kill())
    }
}

impl Drop for Worker {
    /// A soak that ends early (an error, a failed wait) leaves no worker behind.
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A fault under way: what heals it, and when.
enum Active {
    Store { back_at: Instant },
    Broker { back_at: Instant },
    Packets { _hole: Blackhole, until: Instant },
    WorkerDown { back_at: Instant },
}

/// Runs the soak; `Ok(true)` when every check passed. The report is printed and written to `options.report`.
///
/// Errors: a server could not be started, the stream could not be produced, or the records were not all processed
/// within 5 minutes of the end.
pub async fn run(options: SoakOptions) -> anyhow::Result<bool> {
    let dir = options.report.parent().map(Path::to_owned).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir)?;
    let started_at = jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC").to_string();
    eprintln!("idemflow soak: {:?} at {} records/s, a fault every {:?} to {:?}", options.duration, options.rate, options.fault_gap.0, options.fault_gap.1);
    eprintln!("starting a throwaway PostgreSQL cluster (durable: fsync and synchronous_commit on)...");
    let cluster = Throwaway::start_durable()?;
    let (db, url) = demo::database::DemoDb::create(&cluster.url(), "idemflow_soak").await?;
    db.setup(demo::SHIPPED_TABLES, demo::ACCOUNTS, demo::OPENING_BALANCE_CENTS).await?;
    let partitions = 8;
    let kafka = EmbeddedKafka::start()?;
    kafka.create_topic(demo::TOPIC, partitions)?;
    let broker_port: u16 = kafka.bootstrap_servers().rsplit_once(':').and_then(|(_, p)| p.parse().ok()).context("the broker's port")?;
    let iptables = Blackhole::available();
    let kinds: Vec<Fault> = Fault::ALL.into_iter().filter(|f| iptables || !f.needs_iptables()).collect();
    if !iptables {
        eprintln!("no iptables here (or not root): the soak runs without dropped packets");
    }

    // The worker's workspace, kept beside the report.
    let work = dir.join("soak-worker");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("pipelines"))?;
    std::fs::write(work.join("pipelines/payments.toml"), demo::SHIPPED_PIPELINE)?;
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let config = work.join("idemflow.toml");
    let settings = format!(
        "[database]\nurl = \"{url}\"\nmax_connections = 4\nbatch_timeout = \"30s\"\n\
         [kafka]\nbootstrap_servers = \"{}\"\n[kafka.properties]\n\"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"500\"\n\
         [metrics]\nlisten = \"{metrics}\"\n[log]\nlevel = \"info\"\n",
        kafka.bootstrap_servers()
    );
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&config)?;
        std::io::Write::write_all(&mut f, settings.as_bytes())?;
    }
    let log = work.join("worker.log");

    let mut rng = Rng(options.seed | 1);
    let mut worker = Some(Worker::start(&config, &log, metrics)?);
    let mut total = Counts::default();
    let mut exits: Vec<String> = Vec::new();
    let mut samples: Vec<Sample> = Vec::new();
    let mut journal: Vec<(Duration, Fault, Duration)> = Vec::new();
    let (mut produced, mut distinct, mut retries, mut mismatches, mut poison, mut expected_cents) = (0u64, 0u64, 0u64, 0u64, 0u64, 0i64);
    let start = Instant::now();
    let mut next_fault = start + rng.between(options.fault_gap.0, options.fault_gap.1);
    let mut active: Option<Active> = None;
    let mut second = 0u64;
    let mut last_sample = start - Duration::from_secs(10);
    let mut last_line = start;
    // The longest time the applied count stood still while records waited (from the per-second scrapes).
    let (mut last_progress, mut applied_seen, mut longest_stall) = (start, 0.0f64, Duration::ZERO);

    while start.elapsed() < options.duration {
        // One second's records (their own order ids, their own retries and reused ids among them).
        let s = demo::stream_from(options.rate as usize, partitions, 100 + distinct, 0x5eed ^ second.wrapping_mul(0x9e37_79b9));
        for (partition, value) in &s.records {
            kafka.send(BaseRecord::<[u8], [u8]>::to(demo::TOPIC).partition(*partition).payload(value))?;
        }
        produced += s.records.len() as u64;
        distinct += s.distinct;
        retries += s.retries;
        mismatches += s.mismatches;
        poison += s.poison;
        expected_cents += s.expected_cents;
        second += 1;
        tokio::time::sleep_until((start + Duration::from_secs(second)).into()).await;

        if let Some(w) = worker.as_mut() {
            w.scrape();
            let applied_now = total.applied + w.last.map_or(0.0, |c| c.applied);
            if applied_now > applied_seen || applied_now >= distinct as f64 {
                applied_seen = applied_now;
                last_progress = Instant::now();
            }
            longest_stall = longest_stall.max(last_progress.elapsed());
            if let Some(status) = w.exited() {
                exits.push(format!("{:?}: the worker exited by itself ({status})", start.elapsed()));
                eprintln!("{}; started again", exits.last().expect("pushed"));
                if let Some(c) = worker.take().and_then(Worker::kill) {
                    total.add(&c);
                }
                worker = Some(Worker::start(&config, &log, metrics)?);
            }
        }
        if last_sample.elapsed() >= Duration::from_secs(10) {
            last_sample = Instant::now();
            if let Some(s) = worker.as_ref().and_then(|w| Sample::of(w.child.id(), start.elapsed())) {
                samples.push(s);
            }
        }
        // Heal what is due, then inject the next fault.
        let now = Instant::now();
        active = match active.take() {
            Some(Active::Store { back_at }) if now >= back_at => {
                cluster.start_again()?;
                None
            }
            Some(Active::Broker { back_at }) if now >= back_at => {
                kafka.mock().broker_up(1)?;
                None
            }
            Some(Active::Packets { until, .. }) if now >= until => None,
            Some(Active::WorkerDown { back_at }) if now >= back_at => {
                worker = Some(Worker::start(&config, &log, metrics)?);
                None
            }
            other => other,
        };
        if active.is_none() && now >= next_fault {
            let fault = kinds[rng.below(kinds.len() as u64) as usize];
            let (lasting, a) = match fault {
                Fault::KillWorker => {
                    let lasting = rng.between(Duration::from_millis(500), Duration::from_secs(3));
                    if let Some(mut w) = worker.take() {
                        w.scrape();
                        if let Some(c) = w.kill() {
                            total.add(&c);
                        }
                    }
                    (lasting, Active::WorkerDown { back_at: now + lasting })
                }
                Fault::RestartStore | Fault::CrashStore => {
                    let lasting = rng.between(Duration::from_secs(2), Duration::from_secs(8));
                    if fault == Fault::CrashStore { cluster.crash()? } else { cluster.stop()? }
                    (lasting, Active::Store { back_at: Instant::now() + lasting })
                }
                Fault::RestartBroker => {
                    let lasting = rng.between(Duration::from_secs(3), Duration::from_secs(10));
                    kafka.mock().broker_down(1)?;
                    (lasting, Active::Broker { back_at: now + lasting })
                }
                Fault::DropStorePackets | Fault::DropBrokerPackets => {
                    let lasting = rng.between(Duration::from_secs(3), Duration::from_secs(45));
                    let port = if fault == Fault::DropStorePackets { cluster.port() } else { broker_port };
                    (lasting, Active::Packets { _hole: Blackhole::start(port)?, until: now + lasting })
                }
            };
            journal.push((start.elapsed(), fault, lasting));
            eprintln!("{:>7.1} s  {} for {:.1} s", start.elapsed().as_secs_f64(), fault.name(), lasting.as_secs_f64());
            active = Some(a);
            next_fault = Instant::now() + lasting + rng.between(options.fault_gap.0, options.fault_gap.1);
        }
        if last_line.elapsed() >= Duration::from_secs(60) {
            last_line = Instant::now();
            let at = start.elapsed().as_secs_f64();
            match progress(&db).await {
                Ok((applied, dead)) => eprintln!("{at:>7.1} s  produced {produced}, distinct {distinct}: {applied} applied, {dead} dead letters"),
                Err(e) => eprintln!("{at:>7.1} s  produced {produced}, distinct {distinct}; the store did not answer: {e}"),
            }
        }
    }
    // The end: heal, stop the stream, wait for every record.
    match active.take() {
        Some(Active::Store { .. }) => cluster.start_again()?,
        Some(Active::Broker { .. }) => kafka.mock().broker_up(1)?,
        Some(Active::WorkerDown { .. }) => worker = Some(Worker::start(&config, &log, metrics)?),
        Some(Active::Packets { .. }) | None => {}
    }
    kafka.flush()?;
    let streamed = start.elapsed();
    eprintln!("{:.1} s: faults stopped, {produced} records produced; waiting for every record...", streamed.as_secs_f64());
    let drain = Instant::now();
    let mut w = worker.take().context("a worker")?;
    loop {
        w.scrape();
        if let Ok((applied, dead)) = progress(&db).await {
            if applied == distinct as i64 && dead >= poison as i64 {
                break;
            }
        }
        if drain.elapsed() > Duration::from_secs(300) {
            let (applied, dead) = progress(&db).await.unwrap_or((-1, -1));
            bail!("not every record processed within 5 minutes of the end: {applied} of {distinct} applied, {dead} of {poison} dead letters (log: {})", log.display());
        }
        if let Some(status) = w.exited() {
            exits.push(format!("{:?}: the worker exited by itself ({status})", start.elapsed()));
            if let Some(c) = w.kill() {
                total.add(&c);
            }
            w = Worker::start(&config, &log, metrics)?;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained = drain.elapsed();
    // Let the last batch's counters reach a scrape, then stop it as an operator would.
    tokio::time::sleep(Duration::from_secs(2)).await;
    w.scrape();
    let last = w.last.unwrap_or_default();
    let (status, counts) = w.stop(Duration::from_secs(30));
    total.add(&counts.unwrap_or_default());

    // The checks.
    let totals = db.totals(demo::ACCOUNTS, demo::OPENING_BALANCE_CENTS).await?;
    let demo::database::DemoDb::Postgres(pool) = &db else { bail!("the soak runs on PostgreSQL") };
    let (dedup_rows, duplicates, dead_rows): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM idemflow.dedup), (SELECT coalesce(sum(duplicates), 0)::bigint FROM idemflow.dedup), \
                (SELECT count(*) FROM idemflow.dead_letters)",
    )
    .fetch_one(pool)
    .await?;
    let short = distinct as f64 - total.applied;
    let mut checks: Vec<(bool, String)> = vec![
        (totals.rows == distinct as i64 && totals.distinct_rows == totals.rows,
            format!("business rows {} (distinct order ids {}) == distinct operations {distinct}", totals.rows, totals.distinct_rows)),
        (totals.deducted_cents == i128::from(expected_cents) && totals.applied_cents == totals.deducted_cents,
            format!("total deducted {} == sum of the applied payments {} == expected {}",
                demo::money(totals.deducted_cents as i64), demo::money(totals.applied_cents as i64), demo::money(expected_cents))),
        (dead_rows == poison as i64, format!("dead letters {dead_rows} == poison records {poison}")),
        (dedup_rows == distinct as i64, format!("dedup rows {dedup_rows} == distinct operations {distinct}")),
        (duplicates == (retries + mismatches) as i64,
            format!("duplicates counted in the dedup rows {duplicates} == retries {retries} + reused order ids {mismatches}")),
        (last.received == last.parts(),
            format!("last worker: received {} == applied + duplicates + dead letters + tombstones {}", last.received, last.parts())),
        (status.is_some_and(|s| s.success()), format!("last worker stopped by SIGTERM: {status:?}")),
    ];
    // The counters summed over every process: exact unless a SIGKILL took a committed batch's counts with it.
    let counted = [
        (total.applied, distinct as f64, "applied"),
        (total.republished, retries as f64, "republished"),
        (total.mismatched, mismatches as f64, "payload_mismatch"),
        (total.dead_letters, poison as f64, "dead letters"),
    ];
    for (got, want, what) in counted {
        let ok = if short == 0.0 { got == want } else { got <= want };
        checks.push((ok, format!("{what} counted over every worker process {got} {} {want}", if short == 0.0 { "==" } else { "<=" })));
    }
    let resources = [
        ("resident memory (KiB)", flat(&samples, |s| s.rss_kib, 8 * 1024)),
        ("open files", flat(&samples, |s| s.fds, 8)),
        ("threads", flat(&samples, |s| s.threads, 4)),
    ];
    for (what, f) in &resources {
        if let Some((middle, last, ok)) = f {
            checks.push((*ok, format!("{what}: largest in the last third {last}, in the middle third {middle}")));
        }
    }

    // The report.
    let mut r = String::new();
    writeln!(r, "# idemflow soak, {started_at}\n")?;
    writeln!(r, "Kafka (embedded, {partitions} partitions) x PostgreSQL (durable), `pipelines/payments.toml`, the release worker as a child process.\n")?;
    writeln!(r, "- stream: {:.0} s at {} records/s: {produced} records, {distinct} operations, {retries} producer retries, {mismatches} reused order ids, {poison} poison", streamed.as_secs_f64(), options.rate)?;
    writeln!(r, "- every record processed {:.1} s after the faults and the stream stopped", drained.as_secs_f64())?;
    writeln!(r, "- the longest time without a record applied while records waited: {:.0} s (faults included)", longest_stall.as_secs_f64())?;
    let mut by_kind = String::new();
    for kind in Fault::ALL {
        let n: Vec<_> = journal.iter().filter(|(_, f, _)| *f == kind).collect();
        if !n.is_empty() {
            let secs: f64 = n.iter().map(|(_, _, d)| d.as_secs_f64()).sum();
            let _ = write!(by_kind, "{} {} ({secs:.0} s), ", n.len(), kind.name());
        }
    }
    writeln!(r, "- faults ({} in all; seed {}): {}", journal.len(), options.seed, by_kind.trim_end_matches(", "))?;
    if !iptables {
        writeln!(r, "- no packets dropped: iptables unavailable (not root, or not installed)")?;
    }
    for e in &exits {
        writeln!(r, "- {e}")?;
    }
    if short > 0.0 {
        writeln!(r, "- counts taken by SIGKILLed processes before their next scrape: {short} applied records")?;
    }
    writeln!(r, "- counters summed over every worker process: received {}, applied {}, republished {}, redelivered {}, payload_mismatch {}, dead letters {}",
        total.received, total.applied, total.republished, total.redelivered, total.mismatched, total.dead_letters)?;
    writeln!(r, "\n## Checks\n")?;
    for (ok, text) in &checks {
        writeln!(r, "- {}: {text}", if *ok { "ok" } else { "FAILED" })?;
    }
    writeln!(r, "\n## The worker's resources (a sample every 10 s; the largest of each ~5 minutes)\n")?;
    writeln!(r, "| minutes | pid | resident MiB | open files | threads |\n|---|---|---|---|---|")?;
    let window = Duration::from_secs(300);
    let mut from = Duration::ZERO;
    while samples.iter().any(|s| s.at >= from) {
        let w: Vec<&Sample> = samples.iter().filter(|s| s.at >= from && s.at < from + window).collect();
        if let Some(peak) = w.iter().max_by_key(|s| s.rss_kib) {
            let fds = w.iter().map(|s| s.fds).max().unwrap_or(0);
            let threads = w.iter().map(|s| s.threads).max().unwrap_or(0);
            writeln!(r, "| {}-{} | {} | {:.1} | {fds} | {threads} |", from.as_secs() / 60, (from + window).as_secs() / 60, peak.pid, peak.rss_kib as f64 / 1024.0)?;
        }
        from += window;
    }
    writeln!(r, "\nThe faults, in order:\n")?;
    for (at, fault, lasting) in &journal {
        writeln!(r, "- {:.1} s: {} for {:.1} s", at.as_secs_f64(), fault.name(), lasting.as_secs_f64())?;
    }
    println!("{r}");
    std::fs::write(&options.report, &r).with_context(|| format!("writing {}", options.report.display()))?;
    eprintln!("written to {} (the worker's log: {})", options.report.display(), log.display());
    db.close().await;
    Ok(checks.iter().all(|(ok, _)| *ok))
}

/// `(dedup rows, dead letters)`: one dead letter per poison record, at its own offset (two poison records may
/// have the same bytes, so [`demo::database::DemoDb::progress`]'s distinct payloads would not do).
async fn progress(db: &demo::database::DemoDb) -> anyhow::Result<(i64, i64)> {
    let demo::database::DemoDb::Postgres(pool) = db else { bail!("the soak runs on PostgreSQL") };
    Ok(sqlx::query_as("SELECT (SELECT count(*) FROM idemflow.dedup), (SELECT count(*) FROM idemflow.dead_letters)").fetch_one(pool).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, rss: u64) -> Sample {
        Sample { at: Duration::from_secs(secs), pid: 1, rss_kib: rss, fds: 10, threads: 5 }
    }

    #[test]
    fn flat_compares_the_last_third_with_the_middle_one() {
        let steady: Vec<Sample> = (0..=90).map(|i| at(i * 10, if i < 10 { 100 } else { 50_000 + i % 3 })).collect();
        assert_eq!(flat(&steady, |s| s.rss_kib, 1024).map(|f| f.2), Some(true));
        let growing: Vec<Sample> = (0..=90).map(|i| at(i * 10, 50_000 + i * 500)).collect();
        assert_eq!(flat(&growing, |s| s.rss_kib, 1024).map(|f| f.2), Some(false));
        assert_eq!(flat(&[], |s| s.rss_kib, 0), None);
    }

    #[test]
    fn counts_read_a_scrape() {
        let text = "idemflow_records_received_total{pipeline=\"payments\"} 10\n\
                    idemflow_records_applied_total{pipeline=\"payments\"} 7\n\
                    idemflow_duplicates_skipped_total{pipeline=\"payments\",reason=\"republished\"} 2\n\
                    idemflow_dead_letters_total{pipeline=\"payments\",reason=\"decode_failed\"} 1\n";
        let c = Counts::of(text).unwrap();
        assert_eq!((c.received, c.applied, c.republished, c.dead_letters), (10.0, 7.0, 2.0, 1.0));
        assert_eq!(c.parts(), 10.0);
        assert!(Counts::of("").is_none());
    }
}
