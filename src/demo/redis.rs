//! A throwaway Redis server for the demo and the bench: Debian's `redis-server` on a free port, in a temporary
//! directory, with the append-only file on (`appendfsync everysec`, Redis's default for it), stopped on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running throwaway server.
pub struct Throwaway {
    child: Option<Child>,
    dir: tempfile::TempDir,
    port: u16,
    fsync: &'static str,
}

/// Where `redis-server` is, or how to install it.
fn binary() -> anyhow::Result<PathBuf> {
    ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| anyhow::anyhow!("redis-server not found: install it with 'apt-get install -y --no-install-recommends redis-server'"))
}

impl Throwaway {
    /// Starts a server (`appendfsync everysec`) and waits (at most 10 s) until it answers `PING`.
    ///
    /// Errors: no `redis-server`, or it did not answer.
    pub fn start() -> anyhow::Result<Throwaway> {
        Self::start_with("everysec")
    }

    /// [`Throwaway::start`] with `appendfsync always`: every write on disk before Redis answers, what `check`
    /// asks of a store that holds the guarantee (the soak's).
    ///
    /// Errors: as for [`Throwaway::start`].
    pub fn start_durable() -> anyhow::Result<Throwaway> {
        Self::start_with("always")
    }

    fn start_with(fsync: &'static str) -> anyhow::Result<Throwaway> {
        let dir = tempfile::Builder::new().prefix("idemflow-redis-").tempdir()?;
        let port = super::host::free_port()?;
        let mut t = Throwaway { child: None, dir, port, fsync };
        t.start_again()?;
        Ok(t)
    }

    /// Starts the server (again) on its directory and port (the append-only file replayed) and waits (at most
    /// 10 s) until it answers `PING`.
    ///
    /// Errors: no `redis-server`, or it did not answer.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        let child = Command::new(binary()?)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"])
            .args(["--appendfsync", self.fsync, "--daemonize", "no", "--dir"])
            .arg(self.dir.path())
            .args(["--logfile", "redis.log"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answered = redis::Client::open(self.url().as_str())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok();
            if answered {
                return Ok(());
            }
            let exited = self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if Instant::now() > deadline || exited {
                anyhow::bail!("redis-server did not answer within 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&mut self, signal: i32) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, signal) };
            let _ = c.wait();
        }
    }

    /// Stops the server as an operator would (SIGTERM: the append-only file flushed, then exit).
    pub fn stop(&mut self) {
        self.signal(libc::SIGTERM);
    }

    /// Stops the server as a crash would (SIGKILL).
    pub fn crash(&mut self) {
        self.signal(libc::SIGKILL);
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Its version.
    pub fn version(&self) -> String {
        redis::Client::open(self.url().as_str())
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("INFO").arg("server").query::<String>(&mut c))
            .ok()
            .and_then(|i| i.lines().find_map(|l| l.strip_prefix("redis_version:").map(str::trim).map(str::to_owned)))
            .unwrap_or_else(|| "unknown".to_owned())
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        self.crash();
    }
}
