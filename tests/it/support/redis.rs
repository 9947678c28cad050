//! A real Redis for tests (Debian's `redis-server`): each test starts its own server (about 0.2 s), on its own port
//! and directory, with the append-only file on, so it can SIGKILL it and start it again from that file.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A redis-server of the test's own.
pub struct RedisServer {
    dir: tempfile::TempDir,
    port: u16,
    fsync: String,
    extra: Vec<String>,
    child: Option<Child>,
    /// `redis://127.0.0.1:PORT/0`.
    pub url: String,
}

fn binary() -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin"] {
        let p = PathBuf::from(dir).join("redis-server");
        if p.exists() {
            return p;
        }
    }
    panic!("redis-server not found: install it with 'apt-get install -y --no-install-recommends redis-server' (scripts/test does)")
}

impl RedisServer {
    /// Starts a server with `appendonly yes` and `appendfsync everysec` (Redis's default for AOF).
    pub fn start() -> RedisServer {
        Self::start_with("everysec", &[])
    }

    /// [`RedisServer::start`] with another `appendfsync` and more options (`--cluster-enabled yes`, say).
    pub fn start_with(fsync: &str, extra: &[&str]) -> RedisServer {
        let port = super::free_port();
        let mut s = RedisServer {
            dir: tempfile::tempdir().unwrap(),
            port,
            fsync: fsync.to_owned(),
            extra: extra.iter().map(|e| (*e).to_owned()).collect(),
            child: None,
            url: format!("redis://127.0.0.1:{port}/0"),
        };
        s.start_again();
        s
    }

    /// Starts the server (again) on its directory and port: after a SIGKILL it loads its append-only file.
    pub fn start_again(&mut self) {
        let mut cmd = Command::new(binary());
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--dir"])
            .arg(self.dir.path())
            .args(["--save", "", "--appendonly", "yes", "--appendfsync", &self.fsync, "--daemonize", "no"])
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection()) {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not answer within 30 s:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILLs the server, as a crash would: what `appendfsync everysec` had not written yet is lost.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILLs the server and cuts the last `fraction` of its newest append-only file: what a machine crash does to
    /// writes `appendfsync everysec` had not synced yet. (A killed process alone loses nothing the kernel already has:
    /// Redis writes the file before it answers, it only syncs it later.) Redis loads the rest at its next start
    /// (`aof-load-truncated yes`, its default), reverting a `MULTI`/`EXEC` block cut in the middle.
    pub fn kill_losing_last_writes(&mut self, fraction: f64) -> u64 {
        self.kill();
        let dir = self.dir.path().join("appendonlydir");
        let newest = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(".incr.aof"))
            .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .expect("an incremental AOF file");
        let len = std::fs::metadata(&newest).unwrap().len();
        let cut = (len as f64 * fraction) as u64;
        std::fs::OpenOptions::new().write(true).open(&newest).unwrap().set_len(len - cut).unwrap();
        cut
    }

    /// Its log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// A connection for assertions and setup.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url.as_str()).unwrap().get_connection().unwrap()
    }

    /// The settings section for it.
    pub fn section(&self) -> String {
        format!("[redis]\nurl = \"{}\"\nconnect_timeout = \"2s\"\nresponse_timeout = \"5s\"\n", self.url)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
