//! A throwaway PostgreSQL cluster from the local server binaries (Debian's `postgresql` package): initdb into a
//! temporary directory, start on a free loopback port, stop and remove on drop. As root, initdb refuses to run,
//! so the server runs as the `postgres` user. A watcher process stops and removes the cluster if this process dies
//! without dropping it.
//!
//! It is private to whoever started it: the superuser `postgres` gets a random password (16 bytes from the
//! operating system's generator), kept in `<dir>/password` (mode 0600) and never printed; the directory is 0700 and
//! the Unix socket 0700 (`unix_socket_permissions`), so another local user can neither read the password nor
//! connect through the socket. Paths are quoted in every shell command, so a `TMPDIR` with spaces works.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a throwaway cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ThrowawayError {
    /// No server binaries.
    #[error(
        "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin: install them with \
         `apt-get update && apt-get install -y postgresql`, or pass --database-url to use a server you run"
    )]
    NoBinaries,
    /// A command failed.
    #[error("{command} failed: {output}")]
    Command {
        /// The command.
        command: String,
        /// What it printed.
        output: String,
    },
    /// A file-system step failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A running throwaway cluster. Stopped and deleted on drop.
pub struct Throwaway {
    bin: PathBuf,
    dir: PathBuf,
    root: bool,
    port: u16,
    durable: bool,
    password: String,
}

/// 16 random bytes from the operating system's generator, as hex.
fn random_password() -> Result<String, ThrowawayError> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(crate::terminal::hex(&bytes))
}

/// `text` quoted for a POSIX shell.
fn quoted(text: &str) -> Result<String, ThrowawayError> {
    shlex::try_quote(text)
        .map(|q| q.into_owned())
        .map_err(|e| ThrowawayError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{text:?}: {e}"))))
}

fn pg_bin() -> Result<PathBuf, ThrowawayError> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let version = e.file_name().to_str()?.parse().ok()?;
                    let bin = e.path().join("bin");
                    bin.join("initdb").exists().then_some((version, bin))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().map(|(_, bin)| bin).ok_or(ThrowawayError::NoBinaries)
}

fn run(mut command: Command) -> Result<(), ThrowawayError> {
    // The server started here must not keep an embedded broker's sockets open ([`super::kafka`]).
    super::kafka::without_inherited_descriptors(&mut command);
    let out = command.stdin(Stdio::null()).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ThrowawayError::Command {
            command: format!("{command:?}"),
            output: format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        })
    }
}

impl Throwaway {
    /// initdb and start. User `postgres`, password `postgres`, scram-sha-256, UTF8, fsync off (throwaway).
    pub fn start() -> Result<Throwaway, ThrowawayError> {
        Self::start_with(false)
    }

    /// [`Throwaway::start`] with durability on (fsync, synchronous_commit, full_page_writes: the server's
    /// defaults), 1 GB of shared buffers and room for WAL between checkpoints, for benchmarks.
    pub fn start_durable() -> Result<Throwaway, ThrowawayError> {
        Self::start_with(true)
    }

    fn start_with(durable: bool) -> Result<Throwaway, ThrowawayError> {
        let bin = pg_bin()?;
        let root = super::host::as_root();
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let dir = tempfile::Builder::new().prefix("idemflow-pg-").tempdir()?.keep();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let port = super::host::free_port()?;
        let password = random_password()?;
        let pw = dir.join("password");
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&pw)?;
        std::io::Write::write_all(&mut file, format!("{password}\n").as_bytes())?;
        drop(file);
        if root {
            let mut c = Command::new("chown");
            c.args(["-R", "postgres:postgres"]).arg(&dir);
            run(c)?;
        }
        let cluster = Throwaway { bin, dir, root, port, durable, password };
        let mut initdb = cluster.as_owner("initdb");
        initdb.arg("-D").arg(cluster.dir.join("data"));
        initdb.args(["-U", "postgres", "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]);
        initdb.arg(format!("--pwfile={}", pw.display()));
        run(initdb)?;
        cluster.pg_ctl("start")?;
        let owner = if root { "runuser -u postgres -- " } else { "" };
        let watcher = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {owner}{pg_ctl} -D {data} -m immediate stop >/dev/null 2>&1; rm -rf -- {dir}",
            pid = std::process::id(),
            pg_ctl = quoted(&cluster.bin.join("pg_ctl").to_string_lossy())?,
            data = quoted(&cluster.dir.join("data").to_string_lossy())?,
            dir = quoted(&cluster.dir.to_string_lossy())?,
        );
        Command::new("sh")
            .arg("-c")
            .arg(watcher)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(cluster)
    }

    fn as_owner(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn pg_ctl(&self, action: &str) -> Result<(), ThrowawayError> {
        let mut c = self.as_owner("pg_ctl");
        c.arg("-D").arg(self.dir.join("data")).arg("-l").arg(self.dir.join("server.log")).arg("-w");
        let action = if action == "crash" {
            c.args(["-m", "immediate"]);
            "stop"
        } else if action == "stop" {
            c.args(["-m", "fast"]);
            "stop"
        } else {
            let durability = if self.durable {
                "-c fsync=on -c synchronous_commit=on -c shared_buffers=1GB -c max_wal_size=8GB"
            } else {
                "-c fsync=off"
            };
            // pg_ctl runs the server through a shell: the socket directory is quoted.
            c.arg("-o").arg(format!(
                "-c listen_addresses=127.0.0.1 -p {} -k {} -c unix_socket_permissions=0700 {durability} -c max_connections=300",
                self.port,
                quoted(&self.dir.to_string_lossy())?
            ));
            action
        };
        c.arg(action);
        run(c)
    }

    /// The admin URL (database `postgres`), with the cluster's random password: do not print it.
    pub fn url(&self) -> String {
        format!("postgres://postgres:{}@127.0.0.1:{}/postgres", self.password, self.port)
    }

    /// The file holding the superuser's password (mode 0600).
    pub fn password_file(&self) -> PathBuf {
        self.dir.join("password")
    }

    /// The cluster's directory (data and server.log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the server (fast shutdown: sessions are terminated). For outage tests.
    pub fn stop(&self) -> Result<(), ThrowawayError> {
        self.pg_ctl("stop")
    }

    /// Stops the server as a crash would (immediate shutdown: no checkpoint, crash recovery at the next start).
    pub fn crash(&self) -> Result<(), ThrowawayError> {
        self.pg_ctl("crash")
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts it again on the same port.
    pub fn start_again(&self) -> Result<(), ThrowawayError> {
        self.pg_ctl("start")
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        let mut c = self.as_owner("pg_ctl");
        c.arg("-D").arg(self.dir.join("data")).args(["-m", "immediate", "stop"]);
        let _ = c.stdin(Stdio::null()).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
