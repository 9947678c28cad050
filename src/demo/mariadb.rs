//! A throwaway MariaDB server for `idemflow soak --store mariadb`: Debian's `mariadbd` on its own data directory,
//! socket and loopback port, durable (`innodb_flush_log_at_trx_commit = 1`), stopped, crashed and started again on
//! the same data, killed and removed on drop. The same server `scripts/mariadb-throwaway.sh` starts for the tests:
//! as root it runs as the `mysql` user (mariadbd refuses root), `--no-defaults` keeps `/etc/mysql` out of it, and
//! `root` gets the password `root` over TCP from 127.0.0.1.

use anyhow::{bail, Context as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's `mariadb-server` package puts the server.
const SERVER: &str = "/usr/sbin/mariadbd";

/// A running (or stopped, between [`Throwaway::stop`] and [`Throwaway::start_again`]) server of this process.
pub struct Throwaway {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

/// `program`, run as the `mysql` user when we are root.
fn command(program: &str) -> Command {
    if super::host::as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "mysql", "--", program]);
        c
    } else {
        Command::new(program)
    }
}

impl Throwaway {
    /// Initialises a data directory, starts the server on a free loopback port, and waits (at most 60 s) until it
    /// answers; `root`'s password is then `root`.
    ///
    /// Errors: MariaDB is not installed (the message says how to install it), or it did not start (the end of its
    /// error log is included).
    pub fn start() -> anyhow::Result<Throwaway> {
        if !Path::new(SERVER).exists() {
            bail!("MariaDB is not installed: apt-get update && apt-get install -y --no-install-recommends mariadb-server mariadb-client");
        }
        let dir = tempfile::Builder::new().prefix("idemflow-mariadb.").tempdir()?;
        std::fs::create_dir(dir.path().join("tmp"))?;
        if super::host::as_root() {
            let status = Command::new("chown").arg("mysql:mysql").arg(dir.path()).arg(dir.path().join("tmp")).status()?;
            if !status.success() {
                bail!("chown mysql:mysql {} failed", dir.path().display());
            }
        }
        let install = command("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            .arg(format!("--tmpdir={}", dir.path().join("tmp").display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .output()
            .context("running mariadb-install-db")?;
        if !install.status.success() {
            bail!("mariadb-install-db failed: {}{}", String::from_utf8_lossy(&install.stdout), String::from_utf8_lossy(&install.stderr));
        }
        let port = super::host::free_port()?;
        let mut server = Throwaway { dir, port, child: None };
        server.start_again()?;
        // root over TCP from 127.0.0.1, with a password, as the tests' server has it.
        server.client(
            "CREATE USER IF NOT EXISTS root@'127.0.0.1'; GRANT ALL ON *.* TO root@'127.0.0.1' WITH GRANT OPTION; \
             ALTER USER root@'127.0.0.1' IDENTIFIED BY 'root'; ALTER USER root@localhost IDENTIFIED BY 'root';",
            false,
        )?;
        Ok(server)
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    /// Runs `sql` with the `mariadb` client on the socket, as root (with the password once it has one).
    fn client(&self, sql: &str, password: bool) -> anyhow::Result<()> {
        let mut c = Command::new("mariadb");
        c.arg("--no-defaults").arg("-S").arg(self.socket()).arg("-uroot");
        if password {
            c.arg("-proot");
        }
        let out = c.args(["-e", sql]).stdin(Stdio::null()).output().context("running the mariadb client")?;
        if !out.status.success() {
            bail!("mariadb -e {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// Starts the server (again) on its data directory and port, and waits (at most 60 s) until it accepts a
    /// connection; after a [`Throwaway::crash`] that includes InnoDB's crash recovery.
    ///
    /// Errors: it did not start (the end of its error log is included).
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        let d = self.dir.path();
        let child = command(SERVER)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", d.join("data").display()))
            .arg(format!("--tmpdir={}", d.join("tmp").display()))
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--pid-file={}", d.join("pid").display()))
            .arg(format!("--log-error={}", d.join("error.log").display()))
            .args(["--max-connections=200", "--innodb-buffer-pool-size=128M", "--innodb-flush-log-at-trx-commit=1"])
            .args(["--character-set-server=utf8mb4", "--collation-server=utf8mb4_bin"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting mariadbd")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            let exited = self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if exited || Instant::now() > deadline {
                let log = std::fs::read_to_string(d.join("error.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                bail!("MariaDB did not start; the end of its error log:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The server's pid (from its pid file: as root the child is `runuser`).
    fn pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.path().join("pid")).ok()?.trim().parse().ok()
    }

    fn signal(&mut self, signal: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the server this value started.
            unsafe { libc::kill(pid, signal) };
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(self.dir.path().join("pid"));
    }

    /// Stops the server cleanly (SIGTERM: a normal shutdown) and waits for it to end.
    pub fn stop(&mut self) {
        self.signal(libc::SIGTERM);
    }

    /// Stops the server as a crash would (SIGKILL): InnoDB recovers at the next start.
    pub fn crash(&mut self) {
        self.signal(libc::SIGKILL);
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `mysql://root:root@127.0.0.1:PORT/` (no database).
    pub fn url(&self) -> String {
        format!("mysql://root:root@127.0.0.1:{}/", self.port)
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        self.crash();
    }
}
