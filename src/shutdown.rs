//! Shutdown is a value passed in: any task holding a [`Shutdown`] can wait for it, and tests trigger it directly.

use std::time::Duration;
use tokio::sync::watch;

/// How long after the first signal another is taken for the same one delivered twice ([`Signals::first`]); a person
/// who presses Ctrl-C again to stop at once does so later than that.
pub const ECHO_WINDOW: Duration = Duration::from_millis(500);

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

/// SIGTERM and SIGINT listeners, registered when made (on Unix; elsewhere Ctrl-C, listened for once awaited): a signal
/// that arrives between [`Signals::new`] and the await of [`Signals::first`] is kept for it. (A listener made after a
/// signal never sees it, and once a handler was installed the signal no longer ends the process by itself: a signal
/// between two listeners would be lost.)
pub struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Registers the listeners.
    ///
    /// Panics when the process cannot install a signal handler (no Tokio runtime with signals enabled).
    #[allow(clippy::new_without_default)]
    pub fn new() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals {
                term: signal(SignalKind::terminate()).expect("installing a SIGTERM handler"),
                int: signal(SignalKind::interrupt()).expect("installing a SIGINT handler"),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// Resolves on the first SIGTERM or SIGINT since [`Signals::new`]. A second signal exits the process at once with
    /// status 130: still safe, since nothing is acknowledged to a broker that is not durable in the store. A signal
    /// within [`ECHO_WINDOW`] of the first is the same one delivered twice, not a second: coreutils' `timeout` sends
    /// its signal to the command and then to the command's whole process group (`timeout -s INT 5 idemflow ...` in a
    /// script), and the two arrive as two when the first was taken before the second came.
    pub async fn first(mut self) {
        self.received().await;
        let first = tokio::time::Instant::now();
        // The same listeners wait for the second: one made only now would miss a signal that came in between.
        tokio::spawn(async move {
            loop {
                self.received().await;
                if first.elapsed() >= ECHO_WINDOW {
                    break;
                }
                tracing::debug!("the same signal again, {:?} after the first: not a second one", first.elapsed());
            }
            eprintln!("second signal: exiting now");
            std::process::exit(130);
        });
    }

    #[cfg(unix)]
    async fn received(&mut self) {
        tokio::select! {
            _ = self.term.recv() => tracing::info!("SIGTERM received: finishing the batch in flight, then stopping"),
            _ = self.int.recv() => tracing::info!("SIGINT received: finishing the batch in flight, then stopping"),
        }
    }

    #[cfg(not(unix))]
    async fn received(&mut self) {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::time::Duration;

    /// A SIGTERM that arrives after the listeners are made and before anything awaits them is kept (the demo's
    /// `--keep-running` lost one sent as it printed its addresses, when it made its listener only then).
    #[tokio::test]
    async fn a_signal_before_the_await_is_kept() {
        let mut signals = super::Signals::new();
        let sent = std::process::Command::new("kill").args(["-TERM", &std::process::id().to_string()]).status().unwrap();
        assert!(sent.success());
        tokio::time::sleep(Duration::from_millis(200)).await;
        tokio::time::timeout(Duration::from_secs(10), signals.received()).await.expect("the SIGTERM was kept for the await");
    }

    /// The same signal delivered twice at once (coreutils' `timeout` signals the command, then its process group) is
    /// one: the process stops as asked, not at once. A second signal later than [`super::ECHO_WINDOW`] would exit the
    /// test process with status 130, which fails the test; so only the echo is sent here.
    #[tokio::test]
    async fn a_signal_delivered_twice_at_once_is_one() {
        let signals = super::Signals::new();
        let me = std::process::id().to_string();
        let send = || assert!(std::process::Command::new("kill").args(["-INT", &me]).status().unwrap().success());
        send();
        tokio::time::timeout(Duration::from_secs(10), signals.first()).await.expect("the first SIGINT");
        send();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Still here: the echo did not exit the process.
    }
}
