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

    /// A server that accepts TLS only, on its port, with `certs`' `server.crt`/`server.key` (no client
    /// certificates asked). [`RedisServer::conn`] cannot reach it: check through the worker.
    pub fn start_tls(certs: &std::path::Path) -> RedisServer {
        let port = super::free_port();
        let file = |name: &str| certs.join(name).display().to_string();
        let extra = vec![
            "--port".to_owned(), "0".to_owned(), "--tls-port".to_owned(), port.to_string(),
            "--tls-cert-file".to_owned(), file("server.crt"), "--tls-key-file".to_owned(), file("server.key"),
            "--tls-ca-cert-file".to_owned(), file("ca.crt"), "--tls-auth-clients".to_owned(), "no".to_owned(),
        ];
        let mut s = RedisServer {
            dir: tempfile::tempdir().unwrap(),
            port,
            fsync: "everysec".to_owned(),
            extra,
            child: None,
            url: format!("rediss://localhost:{port}/0"),
        };
        s.spawn();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server (TLS) did not listen within 30 s:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(binary());
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--dir"])
            .arg(self.dir.path())
            .args(["--save", "", "--appendonly", "yes", "--appendfsync", &self.fsync, "--daemonize", "no"])
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().unwrap());
    }

    /// Starts the server (again) on its directory and port: after a SIGKILL it loads its append-only file.
    pub fn start_again(&mut self) {
        self.spawn();
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
        // appendonly.aof.<sequence>.incr.aof: the highest sequence is the file Redis was writing.
        let sequence = |p: &std::path::Path| -> Option<u64> {
            let name = p.file_name()?.to_str()?.strip_suffix(".incr.aof")?;
            name.rsplit('.').next()?.parse().ok()
        };
        let newest = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter_map(|p| Some((sequence(&p)?, p)))
            .max_by_key(|(n, _)| *n)
            .map(|(_, p)| p)
            .expect("an incremental AOF file");
        let len = std::fs::metadata(&newest).unwrap().len();
        let cut = (len as f64 * fraction) as u64;
        std::fs::OpenOptions::new().write(true).open(&newest).unwrap().set_len(len - cut).unwrap();
        cut
    }

    /// SIGKILLs the server and removes its append-only files: it starts again empty, as a server without
    /// persistence, or a failover to a replica that never had the data, would.
    pub fn kill_losing_everything(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(self.dir.path().join("appendonlydir"));
    }

    /// Rewrites the append-only file (`BGREWRITEAOF`) and waits until the rewrite is done: what was written so far
    /// sits in the new base file, later writes in a new incremental file ([`RedisServer::kill_losing_last_writes`]
    /// cuts only those).
    pub fn rewrite_aof(&self) {
        let mut c = self.conn();
        let _: String = redis::cmd("BGREWRITEAOF").query(&mut c).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let info: String = redis::cmd("INFO").arg("persistence").query(&mut c).unwrap();
            if info.contains("aof_rewrite_in_progress:0") && info.contains("aof_rewrite_scheduled:0") {
                assert!(info.contains("aof_last_bgrewrite_status:ok"), "BGREWRITEAOF failed:\n{info}\n{}", self.log());
                return;
            }
            assert!(Instant::now() < deadline, "BGREWRITEAOF did not finish within 30 s:\n{info}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
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

/// A Redis Sentinel (`redis-server sentinel.conf --sentinel`) monitoring a primary as `mymaster`, with a quorum of 1
/// (it alone decides a failover).
pub struct Sentinel {
    _dir: tempfile::TempDir,
    child: Child,
    /// Its port.
    pub port: u16,
}

impl Sentinel {
    /// Starts a sentinel monitoring the primary on `primary_port`, and waits until it knows it.
    pub fn start(primary_port: u16) -> Sentinel {
        let dir = tempfile::tempdir().unwrap();
        let port = super::free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nlogfile sentinel.log\nsentinel monitor mymaster 127.0.0.1 {primary_port} 1\n\
                 sentinel down-after-milliseconds mymaster 2000\nsentinel failover-timeout mymaster 10000\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let child = Command::new(binary()).arg(&conf).arg("--sentinel").stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let s = Sentinel { _dir: dir, child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let known = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg("mymaster").query::<Option<(String, String)>>(&mut c));
            if let Ok(Some(_)) = known {
                return s;
            }
            assert!(Instant::now() < deadline, "the sentinel did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `SENTINEL FAILOVER mymaster`: promotes a replica without waiting for the primary to fail.
    pub fn failover(&self) {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{}/", self.port)).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("SENTINEL").arg("FAILOVER").arg("mymaster").query(&mut c).unwrap();
    }

    /// The port of the primary it names now.
    pub fn primary_port(&self) -> u16 {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{}/", self.port)).unwrap().get_connection().unwrap();
        let (_, port): (String, String) = redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg("mymaster").query(&mut c).unwrap();
        port.parse().unwrap()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
