//! How a pipeline's records are grouped into batch transactions (`[batch]`): a leaf the worker, the sources
//! and the configuration share.

use std::time::Duration;

/// Default `batch.max_records`.
pub const DEFAULT_MAX_RECORDS: usize = 2000;
/// Default `batch.max_wait`.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(20);
/// How many records a batch may hold and how long the worker waits to fill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSettings {
    /// At most this many records per batch (and per transaction), at least 1.
    pub max_records: usize,
    /// After the first record of a batch arrives, wait at most this long for more.
    pub max_wait: Duration,
    /// At most this many batch transactions at once, on disjoint partitions (`batch.concurrency`, 1 to
    /// [`MAX_CONCURRENCY`], default 1): one Kafka consumer per transaction in the pipeline's consumer group, so
    /// Kafka's group assignment keeps each partition on one of them (its order kept, its offsets committed after its
    /// own batches commit).
    pub concurrency: usize,
}

/// The largest `batch.concurrency`.
pub const MAX_CONCURRENCY: usize = 64;

