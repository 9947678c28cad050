//! `idemflow soak`: the guarantee held over time, under faults at random moments, on one broker x store pair or
//! on every pair of the guarantee matrix in turn.
//!
//! A steady stream of payments with duplicates (producer retries, reused order ids, poison records: the demo's
//! stream, [`crate::demo::stream_from`], one second's worth at a time) flows from a throwaway broker
//! ([`crate::demo::broker`]: an embedded Kafka, RabbitMQ, RocketMQ or NATS JetStream) through the store's shipped
//! example pipeline into a throwaway store with durability on ([`crate::demo::store`]: PostgreSQL, MariaDB or
//! Redis), on the release worker run as a child process (`idemflow run`), while at random moments one of [`faults::Fault`]
//! happens: the worker SIGKILLed and started again, the store restarted (a clean stop, or a crash with recovery),
//! the broker down and up again, every packet to and from the store's or the broker's port dropped for a while
//! (Debian's `iptables` on loopback; needs root, left out otherwise and said so). The phases of one pair are in
//! [`pair`], what is checked and reported in [`checks`]. When the time is up the faults stop, the stream stops,
//! and the soak waits until every record is applied or dead-lettered, then checks:
//!
//! - every operation applied once: one `payments` row (Redis: hash) per distinct operation, the total deducted
//!   from the accounts equal to the distinct operations' sum, one dead letter per poison record, one dedup row per
//!   operation;
//! - the counters reconcile: the dedup rows' duplicate counts (written in the batches' transactions) equal the
//!   retries and reused ids injected; the workers' counters summed over every process (each one's last scrape)
//!   give `republished` = retries, `payload_mismatch` = reused ids, applied = distinct operations, and the last
//!   worker's `received = applied + duplicates + dead letters`. Where a queue or a JetStream consumer makes a
//!   figure inexact (order, redeliveries), the check is the bound that holds, as [`checks`] says. A process
//!   SIGKILLed after a batch's commit and before the next scrape takes that batch's counts with it: then the
//!   counted figures are short by that batch (never over), and the report says by how much;
//! - the worker's resident memory, open files and threads, sampled every 10 s, flat: the largest of the last
//!   third of the run at most the largest of the middle third plus a margin.
//!
//! The report (Markdown, a section per pair) goes to stdout and to `--report`; each pair's worker log and settings
//! stay beside it, in `soak-worker/<broker>-<store>/`.

pub mod checks;
pub mod faults;
pub mod pair;
mod worker;


use crate::demo::{broker::BrokerKind, store::StoreKind};
use anyhow::Context as _;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Options of `idemflow soak`.
#[derive(Clone, Debug)]
pub struct SoakOptions {
    /// The broker x store pairs, run one after the other, each for `duration`.
    pub pairs: Vec<(BrokerKind, StoreKind)>,
    /// How long the stream flows under faults, per pair.
    pub duration: Duration,
    /// Records produced per second.
    pub rate: u32,
    /// The shortest and longest time between two faults.
    pub fault_gap: (Duration, Duration),
    /// Where the report (Markdown) is written; the workers' logs and settings go into its directory.
    pub report: PathBuf,
    /// The random generator's seed (the faults' moments and kinds; the stream is the same for every seed).
    pub seed: u64,
}

/// Every pair of the guarantee matrix, brokers outside.
pub fn every_pair() -> Vec<(BrokerKind, StoreKind)> {
    BrokerKind::ALL.into_iter().flat_map(|b| StoreKind::ALL.into_iter().map(move |s| (b, s))).collect()
}

/// Runs the soak on each pair in turn; `Ok(true)` when every check of every pair passed. The report is printed
/// and written to `options.report`; a pair that could not be run (a server missing, the records not all
/// processed within 5 minutes of its end) is a failed pair with its error in the report, and the next pair runs.
///
/// Errors: the report could not be written.
pub async fn run(options: SoakOptions) -> anyhow::Result<bool> {
    let dir = options.report.parent().map(Path::to_owned).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir)?;
    let started_at = jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC").to_string();
    eprintln!(
        "idemflow soak: {} pair(s), {:?} each at {} records/s, a fault every {:?} to {:?}",
        options.pairs.len(), options.duration, options.rate, options.fault_gap.0, options.fault_gap.1
    );
    let mut summary: Vec<(String, bool, String)> = Vec::new();
    let mut sections = String::new();
    for &(broker, store) in &options.pairs {
        let name = format!("{} x {}", broker.name(), store.name());
        eprintln!("\n== {name}");
        let work = dir.join("soak-worker").join(format!("{}-{}", broker.flag(), store.flag()));
        match run_pair(broker, store, &options, &work).await {
            Ok((ok, section, line)) => {
                summary.push((name, ok, line));
                sections.push_str(&section);
            }
            Err(e) => {
                eprintln!("{name}: {e:#}");
                summary.push((name.clone(), false, format!("did not run to the end: {e:#}")));
                let _ = writeln!(sections, "## {name}\n\nDid not run to the end: {e:#} (the worker's log: {})\n", work.join("worker.log").display());
            }
        }
    }
    let mut r = String::new();
    writeln!(r, "# idemflow soak, {started_at}\n")?;
    writeln!(r, "{} minutes per pair at {} records/s, a fault every {:?} to {:?} (seed {}).\n",
        options.duration.as_secs_f64() / 60.0, options.rate, options.fault_gap.0, options.fault_gap.1, options.seed)?;
    writeln!(r, "| pair | checks | figures |\n|---|---|---|")?;
    for (name, ok, line) in &summary {
        writeln!(r, "| {name} | {} | {line} |", if *ok { "ok" } else { "FAILED" })?;
    }
    writeln!(r)?;
    r.push_str(&sections);
    println!("{r}");
    std::fs::write(&options.report, &r).with_context(|| format!("writing {}", options.report.display()))?;
    eprintln!("written to {} (the workers' logs: {})", options.report.display(), dir.join("soak-worker").display());
    Ok(summary.iter().all(|(_, ok, _)| *ok))
}

/// One pair: `(every check passed, its section of the report, its line in the summary)`.
async fn run_pair(broker: BrokerKind, store: StoreKind, options: &SoakOptions, work: &Path) -> anyhow::Result<(bool, String, String)> {
    let mut soak = pair::Soak::start(broker, store, options.seed, options.fault_gap, work).await?;
    let mut second = 0u64;
    while soak.elapsed() < options.duration {
        soak.second(second, options.rate).await?;
        second += 1;
    }
    let outcome = soak.finish().await?;
    let checks = checks::checks(&outcome);
    let ok = checks.iter().all(|(ok, _)| *ok);
    let i = &outcome.injected;
    let line = format!(
        "{} records, {} operations, {} faults; {} dedup rows, {} duplicates counted, {} dead letters; processed {:.1} s after the end",
        i.produced, i.distinct, outcome.journal.len(), outcome.ledger.dedup_rows, outcome.ledger.duplicates, outcome.ledger.dead_letters,
        outcome.drained.as_secs_f64()
    );
    Ok((ok, checks::report(&outcome, &checks, options.rate, options.seed), line))
}
