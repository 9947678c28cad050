//! The worker's retention sweeper: beside each pipeline whose dedup store keeps rows (not Redis, whose keys expire
//! by themselves), passes over the dedup table at `purge_rate` ([`crate::retention`] has the sweep and its rules).

use crate::config::DedupSettings;
use crate::metrics::PipelineMetrics;
use crate::retention::{Pace, Skipped, Sweep};
use crate::shutdown::Shutdown;
use crate::store::Store;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How long a stopped pipeline waits for its store to take back its lease on a retention pass
/// ([`Store::release_sweep`]) before leaving the lease to run out.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// One pipeline's sweeper.
pub struct Sweeper {
    /// The pipeline's dedup store.
    store: Store,
    /// The pipeline.
    pipeline: String,
    /// This worker's name, the pass's owner while it sweeps.
    owner: String,
    /// The pipeline's `[dedup]` settings: retention, `purge_batch`, `purge_interval`, `purge_rate`.
    dedup: DedupSettings,
    /// Whether a pass is under way: set before it starts, cleared when it returns. Still set once the pipeline has
    /// stopped, the pass was dropped in the middle (whichever noticed shutdown first): only then is there a lease to
    /// give up.
    in_pass: AtomicBool,
}

impl Sweeper {
    /// The sweeper of `pipeline`'s dedup rows in `store`, sweeping as `owner` with the pipeline's `dedup` settings.
    pub fn new(store: Store, pipeline: String, owner: String, dedup: DedupSettings) -> Sweeper {
        Sweeper { store, pipeline, owner, dedup, in_pass: AtomicBool::new(false) }
    }

    fn sweep(&self) -> Sweep<'_> {
        Sweep {
            pipeline: &self.pipeline,
            owner: &self.owner,
            retention: self.dedup.retention,
            rows: self.dedup.purge_batch,
            interval: self.dedup.purge_interval,
            pace: Pace::RowsPerSecond(self.dedup.purge_rate),
        }
    }

    /// [`Sweeper::run`] for `sweeper`; with none (a store that sweeps nothing), waits forever.
    pub async fn run_if_any(sweeper: Option<&Sweeper>, metrics: PipelineMetrics, shutdown: Shutdown) -> std::convert::Infallible {
        match sweeper {
            Some(s) => s.run(metrics, shutdown).await,
            None => std::future::pending().await,
        }
    }

    /// Sweeps the pipeline's expired dedup rows forever (the future is dropped when its pipeline ends): a pass at
    /// `purge_rate` rows examined per second, then `purge_interval` before the next. A pass that fails, finds
    /// another replica sweeping, or is not due yet (another replica ended one less than `purge_interval` ago) is
    /// tried again after `purge_interval`, resuming at the stored cursor; a failure is logged. The first pass starts
    /// `purge_interval` after the pipeline does. Once shutdown is asked for, no slice starts, and one under way is
    /// rolled back with its transaction; [`Sweeper::release`] then hands the pass over.
    pub async fn run(&self, metrics: PipelineMetrics, mut shutdown: Shutdown) -> std::convert::Infallible {
        let sweep = self.sweep();
        let pipeline = &self.pipeline;
        loop {
            tokio::time::sleep(self.dedup.purge_interval).await;
            if shutdown.is_triggered() {
                break;
            }
            self.in_pass.store(true, Ordering::Relaxed);
            let pass = tokio::select! {
                pass = self.store.sweep_pass(&sweep, |s| metrics.swept(s)) => pass,
                () = shutdown.wait() => break,
            };
            self.in_pass.store(false, Ordering::Relaxed);
            match pass {
                Ok(o) if o.skipped == Some(Skipped::OtherReplica) => {
                    tracing::debug!(pipeline = %pipeline, "another replica is sweeping the dedup rows");
                }
                Ok(o) if o.pass_seconds.is_some() => tracing::info!(
                    pipeline = %pipeline, purged = o.purged, examined = o.examined, slices = o.slices,
                    pass_seconds = o.pass_seconds.unwrap_or_default(), "retention sweep: a pass ended"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(pipeline = %pipeline, error = %e, "retention sweep failed; resuming after purge_interval"),
            }
        }
        // Shutting down: the pipeline ends this future with itself.
        std::future::pending().await
    }

    /// Gives up this worker's lease on a pass shutdown stopped in the middle (nothing otherwise), the cursor kept,
    /// so another replica resumes the pass at its next slice instead of after the lease ([`Sweep::lease`], 40 s at
    /// the defaults). Run once the pipeline has stopped, when no slice of this worker's can run any more. Bounded by
    /// [`RELEASE_TIMEOUT`]: a store that does not answer lets the lease run out; either failure is logged.
    pub async fn release(&self) {
        if !self.in_pass.load(Ordering::Relaxed) {
            return;
        }
        let pipeline = &self.pipeline;
        match tokio::time::timeout(RELEASE_TIMEOUT, self.store.release_sweep(&self.sweep())).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(pipeline = %pipeline, error = %e, "giving up the retention sweep's lease failed; it runs out by itself"),
            Err(_) => tracing::warn!(pipeline = %pipeline, "giving up the retention sweep's lease took over {RELEASE_TIMEOUT:?}; it runs out by itself"),
        }
    }
}
