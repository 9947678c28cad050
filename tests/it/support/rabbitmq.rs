//! A real RabbitMQ for tests: `RABBITMQ_URL` when set (scripts/test starts one node for the whole suite), otherwise
//! a node of this test process, started once. Tests that restart the broker or close its connections start a
//! [`Node`] of their own. Debian's rabbitmq-server, run as the `rabbitmq` user with its own directories and ports
//! (the same steps as scripts/rabbitmq-throwaway.sh).

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

static SHARED: OnceLock<String> = OnceLock::new();

/// The URL of the suite's broker.
pub fn shared_url() -> &'static str {
    SHARED.get_or_init(|| match std::env::var("RABBITMQ_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let node = Node::start();
            let url = node.url();
            std::mem::forget(node); // lives as long as the test process
            url
        }
    })
}

/// A RabbitMQ node of one test: stoppable, restartable (same data directory), its connections closable.
pub struct Node {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

const BIN: &str = "/usr/lib/rabbitmq/bin";

fn as_rabbitmq() -> bool {
    unsafe { libc::geteuid() == 0 }
}

impl Node {
    /// Starts a node on a free port and waits until it accepts AMQP connections.
    pub fn start() -> Node {
        assert!(
            std::path::Path::new(BIN).join("rabbitmq-server").exists(),
            "rabbitmq-server is not installed: run scripts/test (it installs it), or apt-get install rabbitmq-server"
        );
        let dir = tempfile::Builder::new().prefix("idemflow-rabbitmq.").tempdir().unwrap();
        if as_rabbitmq() {
            Command::new("chown").args(["-R", "rabbitmq:rabbitmq"]).arg(dir.path()).status().unwrap();
        }
        let mut node = Node { dir, port: super::free_port(), child: None };
        node.start_again();
        node
    }

    fn name(&self) -> String {
        format!("idem{}@localhost", self.port)
    }

    fn command(&self, program: &str) -> Command {
        let d = self.dir.path();
        let mut c = if as_rabbitmq() {
            let mut c = Command::new("runuser");
            c.args(["-u", "rabbitmq", "--", "env"]);
            c
        } else {
            Command::new("env")
        };
        let dist = if self.port > 40000 { self.port - 20000 } else { self.port + 20000 };
        c.arg(format!("HOME={}", d.display()))
            .arg(format!("RABBITMQ_NODENAME={}", self.name()))
            .arg(format!("RABBITMQ_NODE_PORT={}", self.port))
            .arg("RABBITMQ_NODE_IP_ADDRESS=127.0.0.1")
            .arg(format!("RABBITMQ_DIST_PORT={dist}"))
            .arg(format!("RABBITMQ_MNESIA_BASE={}", d.join("mnesia").display()))
            .arg(format!("RABBITMQ_LOG_BASE={}", d.join("log").display()))
            .arg(format!("RABBITMQ_ENABLED_PLUGINS_FILE={}", d.join("enabled_plugins").display()))
            .arg(PathBuf::from(BIN).join(program));
        c
    }

    /// Starts the node (again, on the same data directory) and waits for its port.
    pub fn start_again(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("server.out")).unwrap();
        let child = self.command("rabbitmq-server").stdout(log.try_clone().unwrap()).stderr(log).process_group(0).spawn().unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "RabbitMQ did not start: {}", std::fs::read_to_string(self.dir.path().join("server.out")).unwrap_or_default());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `rabbitmqctl -n <node> args...`; panics unless it succeeds.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out = self.command("rabbitmqctl").arg("-n").arg(self.name()).args(args).stdin(Stdio::null()).output().unwrap();
        assert!(out.status.success(), "rabbitmqctl {args:?}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Stops the node (`rabbitmqctl stop`) and waits for the process to end.
    pub fn stop(&mut self) {
        self.ctl(&["stop"]);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// Its AMQP URL (default vhost, guest user: RabbitMQ lets guest in from localhost).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // The whole process group (runuser, the start script, the Erlang VM).
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// A message to publish.
#[derive(Clone, Debug)]
pub struct Msg {
    /// The AMQP message-id property.
    pub message_id: Option<String>,
    /// The body.
    pub body: Vec<u8>,
}

impl Msg {
    /// A message with this message-id and JSON text body.
    pub fn json(message_id: &str, body: impl Into<String>) -> Msg {
        Msg { message_id: Some(message_id.to_owned()), body: body.into().into_bytes() }
    }
}

/// A client connection for setting queues up and publishing.
pub struct Client {
    connection: Connection,
}

impl Client {
    /// Connects to `url`.
    pub async fn connect(url: &str) -> Client {
        Client { connection: Connection::connect(url, ConnectionProperties::default()).await.expect("connecting to RabbitMQ") }
    }

    /// Declares a durable queue of `kind` ("quorum" or "classic") with more arguments (`x-single-active-consumer`).
    pub async fn declare(&self, queue: &str, kind: &str, single_active_consumer: bool) {
        let ch = self.connection.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
        if single_active_consumer {
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        ch.queue_declare(queue.into(), QueueDeclareOptions { durable: true, ..Default::default() }, args).await.unwrap();
        let _ = ch.close(200, "done".into()).await;
    }

    /// Publishes persistent messages to `queue` through the default exchange, with publisher confirms; returns
    /// once the broker confirmed them all.
    pub async fn publish(&self, queue: &str, messages: &[Msg]) {
        let ch = self.connection.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        for chunk in messages.chunks(500) {
            for m in chunk {
                let mut props = BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
                if let Some(id) = &m.message_id {
                    props = props.with_message_id(id.as_str().into());
                }
                ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &m.body, props).await.unwrap();
            }
            let returned = ch.wait_for_confirms().await.unwrap();
            assert!(returned.is_empty(), "messages returned by the broker: {}", returned.len());
        }
        let _ = ch.close(200, "done".into()).await;
    }

    /// Messages ready in `queue` (not counting those delivered and unacknowledged).
    pub async fn ready(&self, queue: &str) -> u32 {
        let ch = self.connection.create_channel().await.unwrap();
        let q = ch
            .queue_declare(queue.into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
            .await
            .unwrap();
        let _ = ch.close(200, "done".into()).await;
        q.message_count()
    }
}

/// `[rabbitmq]` settings for `url`, to append to a test's `idemflow.toml`.
pub fn settings(url: &str) -> String {
    format!("[rabbitmq]\nurl = \"{url}\"\nheartbeat = \"5s\"\nconnect_timeout = \"3s\"\n")
}
