//! A throwaway RabbitMQ node for `idemflow demo --source rabbitmq` and the tests: Debian's `rabbitmq-server`, run
//! with its own data directory, node name and ports (as the `rabbitmq` user when we are root, since the package's
//! files belong to it), stopped and removed on drop. The scripts under `/usr/lib/rabbitmq/bin` are called
//! directly: the `/usr/sbin` wrappers change to `/var/lib/rabbitmq` and use its Erlang cookie.

use anyhow::{bail, Context as _};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/rabbitmq/bin";

/// A RabbitMQ node of this process: startable again on the same data directory, stoppable, its `rabbitmqctl` at
/// hand. Killed (its whole process group) and its directory removed on drop.
pub struct Throwaway {
    dir: tempfile::TempDir,
    port: u16,
    /// The Erlang distribution port, drawn like the AMQP one ([`super::host::free_port`]: below the kernel's
    /// ephemeral range). It was the AMQP port + 20000, inside that range, and an outgoing connection holding it made
    /// the node fail to boot (`dist_port_already_used`; `rabbitmq::broker_restart_and_closed_connections` once).
    dist: u16,
    child: Option<Child>,
}

impl Throwaway {
    /// Starts a node on a free loopback port and waits (at most 60 s) until it accepts connections.
    ///
    /// Errors: `rabbitmq-server` is not installed (the message says how to install it), or the node did not start
    /// (its output is included).
    pub fn start() -> anyhow::Result<Throwaway> {
        Self::start_with_config("")
    }

    /// [`Throwaway::start`] with `rabbitmq.conf` lines (RabbitMQ's new-style configuration), e.g. a TLS listener.
    /// Files the configuration names must be readable by the `rabbitmq` user.
    ///
    /// Errors: as for [`Throwaway::start`].
    pub fn start_with_config(conf: &str) -> anyhow::Result<Throwaway> {
        if !std::path::Path::new(BIN).join("rabbitmq-server").exists() {
            bail!(
                "rabbitmq-server is not installed: apt-get update && apt-get install -y --no-install-recommends \
                 rabbitmq-server"
            );
        }
        let dir = tempfile::Builder::new().prefix("idemflow-rabbitmq.").tempdir()?;
        if super::host::as_root() {
            let owned = Command::new("chown").args(["-R", "rabbitmq:rabbitmq"]).arg(dir.path()).status()?;
            if !owned.success() {
                bail!("chown rabbitmq:rabbitmq {} failed", dir.path().display());
            }
        }
        let port = super::host::free_port()?;
        std::fs::write(dir.path().join("rabbitmq.conf"), conf)?;
        let mut node = Throwaway { dir, port, dist: super::host::free_port()?, child: None };
        node.start_again()?;
        Ok(node)
    }

    fn name(&self) -> String {
        format!("idem{}@localhost", self.port)
    }

    fn command(&self, program: &str) -> Command {
        let d = self.dir.path();
        let mut c = if super::host::as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "rabbitmq", "--", "env"]);
            c
        } else {
            Command::new("env")
        };
        let dist = self.dist;
        c.arg(format!("HOME={}", d.display()))
            .arg(format!("RABBITMQ_NODENAME={}", self.name()))
            .arg(format!("RABBITMQ_NODE_PORT={}", self.port))
            .arg("RABBITMQ_NODE_IP_ADDRESS=127.0.0.1")
            .arg(format!("RABBITMQ_DIST_PORT={dist}"))
            .arg(format!("RABBITMQ_MNESIA_BASE={}", d.join("mnesia").display()))
            .arg(format!("RABBITMQ_LOG_BASE={}", d.join("log").display()))
            .arg(format!("RABBITMQ_ENABLED_PLUGINS_FILE={}", d.join("enabled_plugins").display()))
            .arg(format!("RABBITMQ_CONFIG_FILE={}", d.join("rabbitmq.conf").display()))
            .arg(std::path::Path::new(BIN).join(program));
        c
    }

    /// Starts the node (again, on the same data directory) and waits for its port.
    ///
    /// Errors: it did not listen within 60 s (its output is included).
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        // A distribution port taken between its draw and the node's bind: drawn again (the node's name, and so its
        // data, stay the same).
        for _ in 0..2 {
            match self.start_once() {
                Err(e) if e.to_string().contains("dist_port_already_used") => self.dist = super::host::free_port()?,
                other => return other,
            }
        }
        self.start_once()
    }

    fn start_once(&mut self) -> anyhow::Result<()> {
        let out = self.dir.path().join("server.out");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&out)?;
        // Only this start's output is said on a failure (the file keeps every start's).
        let from = usize::try_from(log.metadata()?.len()).unwrap_or(0);
        let child = self.command("rabbitmq-server").stdout(log.try_clone()?).stderr(log).process_group(0).spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline || self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some()) {
                let text = std::fs::read(&out).unwrap_or_default();
                bail!("RabbitMQ did not start; its output:\n{}", String::from_utf8_lossy(text.get(from..).unwrap_or_default()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Runs `rabbitmqctl -n <node> args...` and returns its output.
    ///
    /// Errors: it failed (its output is included).
    pub fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.command("rabbitmqctl").arg("-n").arg(self.name()).args(args).stdin(Stdio::null()).output().context("running rabbitmqctl")?;
        if !out.status.success() {
            bail!("rabbitmqctl {args:?}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Stops the node cleanly (`rabbitmqctl stop`) and waits for it to end.
    ///
    /// Errors: `rabbitmqctl stop` failed.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.ctl(&["stop"])?;
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        Ok(())
    }

    /// Its data directory (where files a configuration names can go).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Its AMQP URL: the default vhost, user `guest` (which RabbitMQ admits from localhost only).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // The whole process group: runuser, the start script and the Erlang VM.
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// Declares a durable quorum queue (the type the RabbitMQ documentation recommends for data safety).
///
/// Errors: the broker refused it or cannot be reached.
pub async fn declare_quorum_queue(url: &str, queue: &str) -> anyhow::Result<()> {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable};
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    channel.queue_declare(queue.into(), QueueDeclareOptions { durable: true, ..Default::default() }, args).await?;
    connection.close(200, "declared".into()).await?;
    Ok(())
}

/// Publishes `messages` (message-id, body) to `queue` through the default exchange, persistent, with publisher
/// confirms (RabbitMQ documentation, "Consumer Acknowledgements and Publisher Confirms"): returns once the broker
/// has confirmed every one.
///
/// Errors: a message was not confirmed, or the broker cannot be reached.
pub async fn publish(url: &str, queue: &str, messages: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    for chunk in messages.chunks(1000) {
        for (id, body) in chunk {
            let props = lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(id.as_str().into());
            channel.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body, props).await?;
        }
        let returned = channel.wait_for_confirms().await?;
        if !returned.is_empty() {
            bail!("{} message(s) were returned by the broker", returned.len());
        }
    }
    connection.close(200, "published".into()).await?;
    Ok(())
}
