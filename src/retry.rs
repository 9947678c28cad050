//! Retry delays shared by the worker, the sources and the commands: exponential, with jitter, without end.

use backon::{BackoffBuilder, ExponentialBuilder};
use std::time::Duration;

/// Exponential delays with jitter from `min` doubling up to `max`, without end (the backon crate).
pub fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default().with_min_delay(min).with_max_delay(max).with_jitter().without_max_times().build()
}
