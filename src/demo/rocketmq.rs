//! A throwaway RocketMQ for `idemflow bench --source rocketmq` and the tests: the Rust name server and broker from
//! crates.io (`rocketmq-namesrv-rust`, `rocketmq-broker-rust`; `scripts/rocketmq-throwaway.sh` installs them into
//! `~/.cargo/bin`), run in a temporary directory on free loopback ports, killed and removed on drop; and a producer
//! that publishes a stream in batches, as a user's producer would.

use anyhow::{bail, Context as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where `name` is installed: `$CARGO_HOME/bin` (`~/.cargo/bin`), else the `PATH`.
///
/// Errors: not installed (the message says how to install it).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let in_cargo = home.map(|h| h.join("bin").join(name)).filter(|p| p.exists());
    let on_path = || std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|f| f.exists()));
    in_cargo.or_else(on_path).with_context(|| {
        format!(
            "{name} is not installed: `source scripts/rocketmq-throwaway.sh && rocketmq_install` (cargo install \
             rocketmq-namesrv rocketmq-broker, about 20 minutes on 2 cores, once)"
        )
    })
}

/// The broker's settings: one broker of cluster `idemflow`, advertising 127.0.0.1, its HA port beside its port
/// (the default, 10912, would be shared by every broker of the machine), topics created on first use with 4 queues,
/// small store files (the default commit log file is 1 GiB).
pub fn broker_properties(dir: &Path, port: u16, ns_port: u16) -> String {
    format!(
        "brokerClusterName=idemflow\nbrokerName=broker-a\nbrokerId=0\nbrokerIP1=127.0.0.1\nlistenPort={port}\n\
         haListenPort={}\nnamesrvAddr=127.0.0.1:{ns_port}\nstorePathRootDir={}\nstorePathCommitLog={}\nautoCreateTopicEnable=true\n\
         autoCreateSubscriptionGroup=true\nmappedFileSizeCommitLog=67108864\n\
         mappedFileSizeConsumeQueue=600000\n",
        port + 1,
        dir.join("store").display(),
        dir.join("store/commitlog").display()
    )
}

/// A free loopback port for a broker: it also listens on `port - 2`, `port - 9` and `port + 1` (HA), so those are
/// free too.
pub fn free_broker_port() -> anyhow::Result<u16> {
    let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
    for _ in 0..1000 {
        let p = super::host::free_port()?;
        if p > 20_010 && free(p - 2) && free(p - 9) && free(p + 1) {
            return Ok(p);
        }
    }
    bail!("no free port with its neighbours free for a RocketMQ broker")
}

/// A name server and one broker of this process.
pub struct Throwaway {
    dir: tempfile::TempDir,
    ns_port: u16,
    broker_port: u16,
    /// The name server, then the broker (absent between [`Throwaway::broker_down`] and [`Throwaway::broker_up`]).
    children: Vec<Child>,
}

impl Throwaway {
    /// Starts both on free loopback ports and waits (at most 60 s each) until they listen, then 2 s for the
    /// broker's first registration with the name server.
    ///
    /// Errors: the binaries are not installed (the message says how), or one did not start (its log is included).
    pub fn start() -> anyhow::Result<Throwaway> {
        let namesrv = binary("rocketmq-namesrv-rust")?;
        binary("rocketmq-broker-rust")?;
        let dir = tempfile::Builder::new().prefix("idemflow-rocketmq.").tempdir()?;
        let ns_port = super::host::free_port()?;
        let broker_port = free_broker_port()?;
        let mut node = Throwaway { dir, ns_port, broker_port, children: Vec::new() };
        let d = node.dir.path().to_owned();
        let mut ns = Command::new(namesrv);
        ns.args(["--listenPort", &ns_port.to_string(), "--bindAddress", "127.0.0.1", "--rocketmqHome"]).arg(&d);
        node.spawn(ns, "namesrv.log", ns_port)?;
        std::fs::write(d.join("broker.properties"), broker_properties(&d, broker_port, ns_port))?;
        node.broker_up()?;
        Ok(node)
    }

    /// Starts the broker (again) on its store and port, waits (at most 60 s) until it listens, then 2 s for its
    /// registration with the name server.
    ///
    /// Errors: it did not start (its log is included).
    pub fn broker_up(&mut self) -> anyhow::Result<()> {
        let d = self.dir.path().to_owned();
        let mut b = Command::new(binary("rocketmq-broker-rust")?);
        b.arg("-c").arg(d.join("broker.properties")).args(["-n", &self.name_server()]);
        self.spawn(b, "broker.log", self.broker_port)?;
        std::thread::sleep(Duration::from_secs(2));
        Ok(())
    }

    /// Stops the broker as a crash would (SIGKILL); the name server stays up.
    pub fn broker_down(&mut self) {
        if self.children.len() > 1 {
            if let Some(mut c) = self.children.pop() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// The broker's port on 127.0.0.1 (where consumers and producers send and fetch).
    pub fn broker_port(&self) -> u16 {
        self.broker_port
    }

    fn spawn(&mut self, mut command: Command, log: &str, port: u16) -> anyhow::Result<()> {
        let path = self.dir.path().join(log);
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
        let child = command
            .env("ROCKETMQ_HOME", self.dir.path())
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .with_context(|| format!("starting {:?}", command.get_program()))?;
        self.children.push(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            let exited = self.children.last_mut().and_then(|c| c.try_wait().ok().flatten()).is_some();
            if exited || Instant::now() > deadline {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                bail!("{:?} did not start listening on {port}; the end of its log:\n{}", command.get_program(), tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// `host:port` of the name server, as `[rocketmq] name_server` takes it.
    pub fn name_server(&self) -> String {
        format!("127.0.0.1:{}", self.ns_port)
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        for c in self.children.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A started producer of group `group` on `name_server`, with the client runtime it runs on (shut both down when
/// done: `producer.shutdown()`, then `runtime.shutdown()`).
///
/// Errors: the runtime or the producer could not start.
pub async fn start_producer(
    name_server: &str,
    group: &str,
) -> anyhow::Result<(crate::source::rocketmq::Runtime, rocketmq_client_rust::DefaultMQProducer)> {
    let runtime = crate::source::rocketmq::Runtime::new(group).map_err(anyhow::Error::msg)?;
    let mut producer = rocketmq_client_rust::DefaultMQProducer::builder(runtime.client())
        .producer_group(group)
        .name_server_addr(name_server.to_owned())
        .build();
    producer.start().await.map_err(|e| anyhow::anyhow!("starting a RocketMQ producer on {name_server}: {e}"))?;
    Ok((runtime, producer))
}

/// Publishes `bodies` to `topic` in order, in batches of 500 spread over the topic's 4 queues in turn (one
/// synchronous batch send each: every message stored by the broker before the next batch), retrying the first
/// while the topic is being created (at most 30 s).
///
/// Errors: a send failed (after the topic exists), or the producer could not start.
pub async fn publish(name_server: &str, topic: &str, bodies: &[Vec<u8>]) -> anyhow::Result<()> {
    use rocketmq_model::common::message::message_queue::MessageQueue;
    use rocketmq_model::common::message::message_single::Message;
    let (runtime, mut producer) = start_producer(name_server, &format!("idemflow-bench-{}", std::process::id())).await?;
    let messages = |chunk: &[Vec<u8>]| -> anyhow::Result<Vec<Message>> {
        chunk.iter().map(|b| Message::builder().topic(topic).body_slice(b).build().map_err(|e| anyhow::anyhow!("{e}"))).collect()
    };
    let mut broker: Option<String> = None;
    let result: anyhow::Result<()> = async {
        for (i, chunk) in bodies.chunks(500).enumerate() {
            let started = Instant::now();
            loop {
                let sent = match &broker {
                    None => producer.send_batch(messages(chunk)?).await,
                    Some(b) => producer.send_batch_to_queue(messages(chunk)?, MessageQueue::from_parts(topic, b.as_str(), (i % 4) as i32)).await,
                };
                match sent {
                    Ok(r) => {
                        if broker.is_none() {
                            let mq = r.message_queue.context("a send result names its queue")?;
                            broker = Some(mq.broker_name().to_string());
                        }
                        break;
                    }
                    Err(e) if broker.is_none() && started.elapsed() < Duration::from_secs(30) => {
                        tracing::debug!(error = %e, "the topic is not routable yet");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => bail!("publishing to RocketMQ topic {topic}: {e}"),
                }
            }
        }
        Ok(())
    }
    .await;
    producer.shutdown().await;
    runtime.shutdown().await;
    result
}
