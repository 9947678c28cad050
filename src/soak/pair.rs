//! One pair's soak, phase by phase: the servers and the worker's workspace ([`Soak::start`]), one second of the
//! stream ([`Soak::second`]) with the worker watched, the faults healed and injected, then the end: the faults
//! healed, the stream flushed, and every record waited for ([`Soak::finish`]). What it saw is an [`Outcome`], which
//! [`super::checks`] judges.

use super::faults::{Active, Blackhole, Fault, Rng};
use super::worker::{Counts, Sample, Worker};
use crate::demo::{self, broker::BrokerKind, broker::Outgoing, broker::ThrowawayBroker, database::DemoDb, store::StoreKind, store::ThrowawayStore};
use anyhow::{bail, Context as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Kafka partitions of the stream's topic.
const KAFKA_PARTITIONS: i32 = 8;
/// How long the end waits for every record once the faults and the stream stopped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(300);

/// What the stream injected, summed over its seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Injected {
    /// Records produced.
    pub produced: u64,
    /// Distinct operations.
    pub distinct: u64,
    /// Producer retries: an operation sent again, the same bytes.
    pub retries: u64,
    /// Order ids reused with another amount (one cent more).
    pub mismatches: u64,
    /// Records that are not JSON.
    pub poison: u64,
    /// The distinct operations' amounts, in cents.
    pub expected_cents: i64,
}

/// What one pair's soak saw: the figures its checks and report are made of.
pub struct Outcome {
    /// The broker.
    pub broker: BrokerKind,
    /// The store.
    pub store: StoreKind,
    /// The stream's partitions (Kafka, RocketMQ) or 1.
    pub partitions: i32,
    /// What was injected.
    pub injected: Injected,
    /// Records the producer sent again whose first send may have been stored ([`ThrowawayBroker::resent`]).
    pub resent: u64,
    /// The business tables at the end.
    pub totals: demo::database::Totals,
    /// idemflow's tables at the end.
    pub ledger: demo::database::Ledger,
    /// The counters summed over every worker process (each one's last scrape).
    pub counted: Counts,
    /// The last worker's counters.
    pub last: Counts,
    /// How the last worker ended after SIGTERM (`None`: it had to be killed).
    pub stopped: Option<std::process::ExitStatus>,
    /// Resource samples of the worker, every 10 s.
    pub samples: Vec<Sample>,
    /// The faults: when, which, for how long.
    pub journal: Vec<(Duration, Fault, Duration)>,
    /// Workers that exited by themselves.
    pub exits: Vec<String>,
    /// How long the stream flowed under faults.
    pub streamed: Duration,
    /// How long the end waited for every record.
    pub drained: Duration,
    /// The longest time without a record applied while records waited.
    pub longest_stall: Duration,
    /// Whether packets could be dropped (iptables, root).
    pub iptables: bool,
}

/// One pair's soak under way.
pub struct Soak {
    broker: ThrowawayBroker,
    store: ThrowawayStore,
    db: DemoDb,
    partitions: i32,
    config: PathBuf,
    log: PathBuf,
    metrics: std::net::SocketAddr,
    worker: Option<Worker>,
    /// The counters of the worker processes that ended.
    total: Counts,
    exits: Vec<String>,
    samples: Vec<Sample>,
    journal: Vec<(Duration, Fault, Duration)>,
    injected: Injected,
    kinds: Vec<Fault>,
    rng: Rng,
    active: Option<Active>,
    next_fault: Instant,
    fault_gap: (Duration, Duration),
    start: Instant,
    last_sample: Instant,
    /// When the applied count last grew, the count then, and the longest time it stood still while records waited.
    last_progress: Instant,
    applied_seen: f64,
    longest_stall: Duration,
    iptables: bool,
}

impl Soak {
    /// Starts the pair's servers, makes the database, writes the worker's workspace into `dir` (its settings,
    /// the pipeline: the store's shipped example reading the broker) and starts the worker. `seed` draws the
    /// faults' moments and kinds, `fault_gap` is the shortest and longest time between two.
    ///
    /// Errors: a server could not start, or the workspace could not be written.
    pub async fn start(broker: BrokerKind, store: StoreKind, seed: u64, fault_gap: (Duration, Duration), dir: &Path) -> anyhow::Result<Soak> {
        eprintln!("starting a throwaway {} (durable)...", store.name());
        let store_server = tokio::task::block_in_place(|| ThrowawayStore::start(store))?;
        let (db, url) = store_server.database("idemflow_soak").await?;
        eprintln!("starting a throwaway {} broker...", broker.name());
        let broker_server = ThrowawayBroker::start(broker, KAFKA_PARTITIONS).await?;
        let iptables = Blackhole::available();
        if !iptables {
            eprintln!("no iptables here (or not root): the soak runs without dropped packets");
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("pipelines"))?;
        let pipeline = store.pipeline();
        if !pipeline.contains("topics = [\"payments\"]") {
            bail!("the shipped {} pipeline no longer reads topics = [\"payments\"]", store.name());
        }
        std::fs::write(dir.join("pipelines/payments.toml"), pipeline.replace("topics = [\"payments\"]", &broker_server.source_toml()))?;
        let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], crate::demo::host::free_port()?));
        let config = dir.join("idemflow.toml");
        let settings = format!(
            "{}{}[metrics]\nlisten = \"{metrics}\"\n[log]\nlevel = \"info\"\n",
            store_server.settings_toml(&url),
            broker_server.settings_toml()
        );
        demo::host::write_private(&config, &settings)?;
        let log = dir.join("worker.log");
        let worker = Some(Worker::start(&config, &log, metrics)?);
        let mut rng = Rng(seed | 1);
        let start = Instant::now();
        let next_fault = start + rng.between(fault_gap.0, fault_gap.1);
        Ok(Soak {
            partitions: broker_server.partitions(),
            broker: broker_server,
            store: store_server,
            db,
            config,
            log,
            metrics,
            worker,
            total: Counts::default(),
            exits: Vec::new(),
            samples: Vec::new(),
            journal: Vec::new(),
            injected: Injected::default(),
            kinds: Fault::ALL.into_iter().filter(|f| iptables || !f.needs_iptables()).collect(),
            rng,
            active: None,
            next_fault,
            fault_gap,
            start,
            last_sample: start - Duration::from_secs(10),
            last_progress: start,
            applied_seen: 0.0,
            longest_stall: Duration::ZERO,
            iptables,
        })
    }

    /// How long the soak has run.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Second number `second` (from 0): its records published, then (at its end) the worker watched, sampled,
    /// the fault under way healed when due and the next one injected when due.
    ///
    /// Errors: a record could not be handed to the producer, or a server could not be stopped or started.
    pub async fn second(&mut self, second: u64, rate: u32) -> anyhow::Result<()> {
        let seed = 0x5eed ^ second.wrapping_mul(0x9e37_79b9);
        let s = demo::stream_from(rate as usize, self.partitions, 100 + self.injected.distinct, seed);
        let records = s
            .records
            .into_iter()
            .enumerate()
            .map(|(i, (partition, body))| Outgoing { partition, id: format!("{second}-{i}"), body })
            .collect::<Vec<_>>();
        let i = &mut self.injected;
        i.produced += records.len() as u64;
        (i.distinct, i.retries, i.mismatches, i.poison) = (i.distinct + s.distinct, i.retries + s.retries, i.mismatches + s.mismatches, i.poison + s.poison);
        i.expected_cents += s.expected_cents;
        self.broker.publish(records)?;
        tokio::time::sleep_until((self.start + Duration::from_secs(second + 1)).into()).await;
        self.watch_worker()?;
        if self.last_sample.elapsed() >= Duration::from_secs(10) {
            self.last_sample = Instant::now();
            if let Some(s) = self.worker.as_ref().and_then(|w| Sample::of(w.child.id(), self.start.elapsed())) {
                self.samples.push(s);
            }
        }
        self.heal_due()?;
        self.inject()?;
        if second % 60 == 59 {
            let at = self.start.elapsed().as_secs_f64();
            let i = self.injected;
            match self.db.progress().await {
                Ok((applied, dead)) => eprintln!("{at:>7.1} s  produced {}, distinct {}: {applied} applied, {dead} dead letters", i.produced, i.distinct),
                Err(e) => eprintln!("{at:>7.1} s  produced {}, distinct {}; the store did not answer: {e}", i.produced, i.distinct),
            }
        }
        Ok(())
    }

    /// Scrapes the worker, follows the applied count, and starts a worker that exited by itself again.
    fn watch_worker(&mut self) -> anyhow::Result<()> {
        let Some(w) = self.worker.as_mut() else { return Ok(()) };
        w.scrape();
        let applied_now = self.total.applied + w.last.map_or(0.0, |c| c.applied);
        if applied_now > self.applied_seen || applied_now >= self.injected.distinct as f64 {
            self.applied_seen = applied_now;
            self.last_progress = Instant::now();
        }
        self.longest_stall = self.longest_stall.max(self.last_progress.elapsed());
        if let Some(status) = w.exited() {
            self.exits.push(format!("{:?}: the worker exited by itself ({status})", self.start.elapsed()));
            eprintln!("{}; started again", self.exits.last().expect("pushed"));
            self.end_worker();
            self.worker = Some(Worker::start(&self.config, &self.log, self.metrics)?);
        }
        Ok(())
    }

    /// Kills the worker (if one runs) and keeps its last counts.
    fn end_worker(&mut self) {
        if let Some(mut w) = self.worker.take() {
            w.scrape();
            if let Some(c) = w.kill() {
                self.total.add(&c);
            }
        }
    }

    /// Heals the fault under way when it is due.
    fn heal_due(&mut self) -> anyhow::Result<()> {
        match self.active.take() {
            Some(a) if a.due(Instant::now()) => self.heal(a),
            other => {
                self.active = other;
                Ok(())
            }
        }
    }

    fn heal(&mut self, active: Active) -> anyhow::Result<()> {
        match active {
            Active::Store { .. } => tokio::task::block_in_place(|| self.store.start_again())?,
            Active::Broker { .. } => self.broker.up()?,
            Active::WorkerDown { .. } => self.worker = Some(Worker::start(&self.config, &self.log, self.metrics)?),
            Active::Packets { .. } => {}
        }
        Ok(())
    }

    /// Injects the next fault when it is due and none is under way.
    fn inject(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        if self.active.is_some() || now < self.next_fault {
            return Ok(());
        }
        let fault = self.kinds[self.rng.below(self.kinds.len() as u64) as usize];
        let lasting = fault.lasting(&mut self.rng);
        let active = match fault {
            Fault::KillWorker => {
                self.end_worker();
                Active::WorkerDown { back_at: now + lasting }
            }
            Fault::RestartStore | Fault::CrashStore => {
                let store = &mut self.store;
                tokio::task::block_in_place(|| if fault == Fault::CrashStore { store.crash() } else { store.stop() })?;
                Active::Store { back_at: Instant::now() + lasting }
            }
            Fault::RestartBroker => {
                self.broker.down()?;
                Active::Broker { back_at: Instant::now() + lasting }
            }
            Fault::DropStorePackets | Fault::DropBrokerPackets => {
                let port = if fault == Fault::DropStorePackets { self.store.port() } else { self.broker.port()? };
                Active::Packets { _hole: Blackhole::start(port)?, until: now + lasting }
            }
        };
        self.journal.push((self.start.elapsed(), fault, lasting));
        let name = fault.name(self.store.kind().name());
        eprintln!("{:>7.1} s  {name} for {:.1} s", self.start.elapsed().as_secs_f64(), lasting.as_secs_f64());
        self.active = Some(active);
        self.next_fault = Instant::now() + lasting + self.rng.between(self.fault_gap.0, self.fault_gap.1);
        Ok(())
    }

    /// The end: the fault under way healed, the stream flushed to the broker, every record waited for (applied or
    /// dead-lettered), the last worker stopped by SIGTERM; then the store read back.
    ///
    /// Errors: the broker did not take the stream, or not every record was processed within 5 minutes.
    pub async fn finish(mut self) -> anyhow::Result<Outcome> {
        if let Some(a) = self.active.take() {
            self.heal(a)?;
        }
        if self.worker.is_none() {
            self.worker = Some(Worker::start(&self.config, &self.log, self.metrics)?);
        }
        self.broker.flush(Duration::from_secs(120)).await.context("the broker did not take the whole stream")?;
        let streamed = self.start.elapsed();
        let (distinct, poison) = (self.injected.distinct, self.injected.poison);
        eprintln!("{:.1} s: faults stopped, {} records produced; waiting for every record...", streamed.as_secs_f64(), self.injected.produced);
        let drain = Instant::now();
        loop {
            self.watch_worker()?;
            if let Ok((applied, dead)) = self.db.progress().await {
                // At least: one applied twice is for the checks to report, not a wait that never ends.
                if applied >= distinct as i64 && dead >= poison as i64 {
                    break;
                }
            }
            if drain.elapsed() > DRAIN_TIMEOUT {
                let (applied, dead) = self.db.progress().await.unwrap_or((-1, -1));
                bail!(
                    "not every record processed within {DRAIN_TIMEOUT:?} of the end: {applied} of {distinct} applied, {dead} of {poison} dead letters (log: {})",
                    self.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let drained = drain.elapsed();
        // Let the last batch's counters reach a scrape, then stop it as an operator would.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut w = self.worker.take().context("a worker")?;
        w.scrape();
        let last = w.last.unwrap_or_default();
        let (stopped, counts) = w.stop(Duration::from_secs(30));
        self.total.add(&counts.unwrap_or_default());
        let totals = self.db.totals(demo::shipped::ACCOUNTS, demo::shipped::OPENING_BALANCE_CENTS).await?;
        let ledger = self.db.ledger().await?;
        self.db.close().await;
        Ok(Outcome {
            broker: self.broker.kind(),
            store: self.store.kind(),
            partitions: self.partitions,
            injected: self.injected,
            resent: self.broker.resent(),
            totals,
            ledger,
            counted: self.total,
            last,
            stopped,
            samples: self.samples,
            journal: self.journal,
            exits: self.exits,
            streamed,
            drained,
            longest_stall: self.longest_stall,
            iptables: self.iptables,
        })
    }

    /// The worker's log.
    pub fn log(&self) -> &Path {
        &self.log
    }
}
