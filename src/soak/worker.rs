//! The worker as a child process of the soak, what its counters said at its last scrape, and its resources over
//! time.

use anyhow::Context as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What the counters of one worker process said at its last scrape.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub received: f64,
    pub applied: f64,
    pub republished: f64,
    pub redelivered: f64,
    pub mismatched: f64,
    pub dead_letters: f64,
    pub tombstones: f64,
}

impl Counts {
    pub fn of(scrape: &str) -> Option<Counts> {
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

    pub fn add(&mut self, o: &Counts) {
        self.received += o.received;
        self.applied += o.applied;
        self.republished += o.republished;
        self.redelivered += o.redelivered;
        self.mismatched += o.mismatched;
        self.dead_letters += o.dead_letters;
        self.tombstones += o.tombstones;
    }

    pub fn parts(&self) -> f64 {
        self.applied + self.republished + self.redelivered + self.mismatched + self.dead_letters + self.tombstones
    }
}

/// One sample of the worker process's resources.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub at: Duration,
    pub pid: u32,
    pub rss_kib: u64,
    pub fds: u64,
    pub threads: u64,
}

impl Sample {
    pub fn of(pid: u32, at: Duration) -> Option<Sample> {
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
pub fn flat(samples: &[Sample], value: impl Fn(&Sample) -> u64, margin: u64) -> Option<(u64, u64, bool)> {
    let end = samples.last()?.at;
    let third = end / 3;
    let max_in = |from: Duration, to: Duration| samples.iter().filter(|s| s.at >= from && s.at <= to).map(&value).max();
    let middle = max_in(third, third * 2)?;
    let last = max_in(third * 2, end)?;
    Some((middle, last, last <= middle + margin))
}

/// The worker as a child process.
pub struct Worker {
    pub child: Child,
    metrics: std::net::SocketAddr,
    /// The counters at the last scrape that answered.
    pub last: Option<Counts>,
}

impl Worker {
    pub fn start(config: &Path, log: &Path, metrics: std::net::SocketAddr) -> anyhow::Result<Worker> {
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

    pub fn scrape(&mut self) {
        if let Some(c) = Counts::of(&crate::bench::scrape(self.metrics)) {
            self.last = Some(c);
        }
    }

    /// The exit status if it exited by itself.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn kill(mut self) -> Option<Counts> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.last
    }

    /// SIGTERM, then the exit status (waiting at most `timeout`, then SIGKILL).
    pub fn stop(mut self, timeout: Duration) -> (Option<std::process::ExitStatus>, Option<Counts>) {
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
