//! The faults the soak injects, the random moments they come at, and the packet drops they use.

use anyhow::{bail, Context as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A fault the soak injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The worker SIGKILLed, started again 0.5-3 s later.
    KillWorker,
    /// The store stopped as an operator stops it (PostgreSQL's fast shutdown, SIGTERM) and started again 2-8 s
    /// later.
    RestartStore,
    /// The store stopped as by a crash (PostgreSQL's immediate shutdown, SIGKILL: recovery at the next start),
    /// started again 2-8 s later.
    CrashStore,
    /// The broker down for 3-10 s: Kafka's refuses connections and drops those it had, RabbitMQ's node stopped,
    /// RocketMQ's broker and the NATS server killed; then started again on the same data.
    RestartBroker,
    /// Every packet to and from the store's port dropped for 3-45 s (`[database] batch_timeout` is 30 s here).
    DropStorePackets,
    /// Every packet to and from the broker's port dropped for 3-45 s.
    DropBrokerPackets,
}

impl Fault {
    /// Every fault, in the report's order.
    pub const ALL: [Fault; 6] =
        [Fault::KillWorker, Fault::RestartStore, Fault::CrashStore, Fault::RestartBroker, Fault::DropStorePackets, Fault::DropBrokerPackets];

    /// Its name in the report, for a pair whose store is `store` (PostgreSQL, ...).
    pub fn name(self, store: &str) -> String {
        match self {
            Fault::KillWorker => "worker SIGKILLed".into(),
            Fault::RestartStore => format!("{store} restarted"),
            Fault::CrashStore => format!("{store} crashed"),
            Fault::RestartBroker => "broker down".into(),
            Fault::DropStorePackets => "store's packets dropped".into(),
            Fault::DropBrokerPackets => "broker's packets dropped".into(),
        }
    }

    /// Whether it needs `iptables` (root).
    pub fn needs_iptables(self) -> bool {
        matches!(self, Fault::DropStorePackets | Fault::DropBrokerPackets)
    }

    /// How long it lasts: drawn from its range.
    pub fn lasting(self, rng: &mut Rng) -> Duration {
        let (low, high) = match self {
            Fault::KillWorker => (Duration::from_millis(500), Duration::from_secs(3)),
            Fault::RestartStore | Fault::CrashStore => (Duration::from_secs(2), Duration::from_secs(8)),
            Fault::RestartBroker => (Duration::from_secs(3), Duration::from_secs(10)),
            Fault::DropStorePackets | Fault::DropBrokerPackets => (Duration::from_secs(3), Duration::from_secs(45)),
        };
        rng.between(low, high)
    }
}

/// A fault under way: what heals it, and when.
pub enum Active {
    /// The store is down.
    Store { back_at: Instant },
    /// The broker is down.
    Broker { back_at: Instant },
    /// Packets to a port are dropped while the hole lives.
    Packets { _hole: Blackhole, until: Instant },
    /// The worker is killed.
    WorkerDown { back_at: Instant },
}

impl Active {
    /// Whether it is due to heal at `now`.
    pub fn due(&self, now: Instant) -> bool {
        match self {
            Active::Store { back_at } | Active::Broker { back_at } | Active::WorkerDown { back_at } => now >= *back_at,
            Active::Packets { until, .. } => now >= *until,
        }
    }
}

/// xorshift64: the faults' moments and kinds, the same for a seed.
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }

    /// A duration from `low` to `high`, to the millisecond.
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
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
