//! What `idemflow bench` is asked to run: its options and the broker of the one-stream runs.

use std::path::PathBuf;

/// What `idemflow bench` runs.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Records in the stream (default 1,000,000).
    pub records: usize,
    /// Records for run (2), one per transaction.
    pub single_records: usize,
    /// Records for run (6), the per-record SQL form.
    pub sql_records: usize,
    /// Dedup keys preloaded for run (4).
    pub preload: u64,
    /// Use this PostgreSQL server instead of a throwaway cluster (its settings are reported as they are).
    pub database_url: Option<String>,
    /// Where the Markdown table goes.
    pub markdown: PathBuf,
    /// Where the JSON goes.
    pub json: PathBuf,
    /// Only these runs (1..=20); all when empty (a ratio needs both of its runs).
    pub only: Vec<u8>,
    /// Run each worker under `perf record -g` (output `perf-<run>.data` in the current directory).
    pub perf: bool,
    /// The broker: the embedded Kafka (every run), or a throwaway RabbitMQ node, NATS server or RocketMQ name
    /// server and broker (runs 1, 5, 7 and 8).
    pub source: BenchSource,
    /// How many times the selected runs are made, in order, one repetition after another (the embedded Kafka only;
    /// at least 1). Each ratio is then the median of its repetitions', with their lowest and highest: on a shared
    /// machine one repetition's figures move by up to 2x with the host's load, and a change smaller than that shows
    /// only in the median of alternating runs.
    pub repeat: u32,
}

/// The broker a bench reads from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchSource {
    /// An embedded Kafka broker (librdkafka's mock cluster).
    #[default]
    Kafka,
    /// A throwaway RabbitMQ node (Debian's `rabbitmq-server`) with a quorum queue per run.
    Rabbitmq,
    /// A throwaway NATS server with JetStream (Debian's `nats-server`) with a stream per run.
    Nats,
    /// A throwaway RocketMQ name server and broker (the Rust ones from crates.io, `scripts/rocketmq-throwaway.sh`
    /// installs them) with a topic of 4 queues per run.
    Rocketmq,
}
