//! Shutdown is a value passed in: any task holding a [`Shutdown`] can wait for it, and tests trigger it directly.

use tokio::sync::watch;

/// Triggers shutdown once.
#[derive(Debug)]
pub struct Trigger(watch::Sender<bool>);

impl Trigger {
    /// Asks every holder of the matching [`Shutdown`] to stop at its next safe point.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

/// Waits for shutdown.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

/// A connected trigger and signal.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

impl Shutdown {
    /// Whether shutdown was asked for.
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once shutdown is asked for (at once if it already was, or if the trigger is gone).
    pub async fn wait(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Resolves on the first SIGTERM or SIGINT. A second signal exits the process at once with status 130: still
/// safe, since nothing is ever committed to Kafka that is not durable in Postgres.
pub async fn signals() {
    first_signal().await;
    tokio::spawn(async {
        first_signal().await;
        eprintln!("second signal: exiting now");
        std::process::exit(130);
    });
}

#[cfg(unix)]
async fn first_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received: finishing the batch in flight, then stopping"),
        _ = int.recv() => tracing::info!("SIGINT received: finishing the batch in flight, then stopping"),
    }
}

#[cfg(not(unix))]
async fn first_signal() {
    let _ = tokio::signal::ctrl_c().await;
}
