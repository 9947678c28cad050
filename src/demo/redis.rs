//! A throwaway Redis server for the demo and the bench: Debian's `redis-server` on a free port, in a temporary
//! directory, with the append-only file on (`appendfsync everysec`, Redis's default for it), stopped on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running throwaway server.
pub struct Throwaway {
    child: Child,
    _dir: tempfile::TempDir,
    port: u16,
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
    /// Starts a server and waits (at most 10 s) until it answers `PING`.
    ///
    /// Errors: no `redis-server`, or it did not answer.
    pub fn start() -> anyhow::Result<Throwaway> {
        let dir = tempfile::Builder::new().prefix("idemflow-redis-").tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(binary()?)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"])
            .args(["--appendfsync", "everysec", "--daemonize", "no", "--dir"])
            .arg(dir.path())
            .args(["--logfile", "redis.log"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let mut t = Throwaway { child, _dir: dir, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answered = redis::Client::open(t.url().as_str())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok();
            if answered {
                return Ok(t);
            }
            if Instant::now() > deadline || t.child.try_wait()?.is_some() {
                anyhow::bail!("redis-server did not answer within 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
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
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
