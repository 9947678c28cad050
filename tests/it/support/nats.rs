//! A real NATS server with JetStream for tests (Debian's `nats-server`, 2.9): each test starts its own (well under a
//! second, about 12 MiB), on its own port and store directory, so it can stop and start it again from that
//! directory. Streams are created and messages published with the official client (async-nats), as a user's
//! producer would: every publish waits for the server's acknowledgement.

use async_nats::jetstream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A nats-server of the test's own.
pub struct NatsServer {
    dir: tempfile::TempDir,
    port: u16,
    extra: Vec<String>,
    child: Option<Child>,
    /// `nats://127.0.0.1:PORT`.
    pub url: String,
}

fn binary() -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/usr/local/bin"] {
        let p = PathBuf::from(dir).join("nats-server");
        if p.exists() {
            return p;
        }
    }
    panic!("nats-server not found: install it with 'apt-get install -y --no-install-recommends nats-server' (scripts/test does)")
}

impl NatsServer {
    /// Starts a server with JetStream on, its store in a directory of its own.
    pub fn start() -> NatsServer {
        Self::start_with(&[])
    }

    /// [`NatsServer::start`] with more command-line options (`--user`, `--tls`, ...).
    pub fn start_with(extra: &[&str]) -> NatsServer {
        let port = super::free_port();
        let mut s = NatsServer {
            dir: tempfile::tempdir().unwrap(),
            port,
            extra: extra.iter().map(|e| (*e).to_owned()).collect(),
            child: None,
            url: format!("nats://127.0.0.1:{port}"),
        };
        s.start_again();
        s
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts the server (again, after [`NatsServer::stop`]) on the same port and store, and waits until it listens.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("server.log")).unwrap();
        let child = Command::new(binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(self.dir.path().join("store"))
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen within 30 s:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (SIGKILL: what it acknowledged is in its store) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// The settings' `[nats]` section.
    pub fn settings(&self) -> String {
        format!("[nats]\nurl = \"{}\"\nconnect_timeout = \"5s\"\nrequest_timeout = \"5s\"\n", self.url)
    }

    /// A JetStream context of a new client.
    pub async fn jetstream(&self) -> jetstream::Context {
        let client = async_nats::connect(&self.url).await.expect("connects to the test's nats-server");
        jetstream::new(client)
    }

    /// Creates stream `name` on subjects `<name>.>` (file storage, the server's defaults otherwise).
    pub async fn create_stream(&self, name: &str) {
        let js = self.jetstream().await;
        js.create_stream(jetstream::stream::Config { name: name.to_owned(), subjects: vec![format!("{name}.>")], ..Default::default() })
            .await
            .expect("creates the stream");
    }

    /// Publishes `bodies` to `subject`, each with its `Nats-Msg-Id` when given, waiting for every acknowledgement.
    pub async fn publish(&self, subject: &str, messages: &[(Option<String>, Vec<u8>)]) {
        let js = self.jetstream().await;
        let mut acks = Vec::with_capacity(messages.len());
        for (id, body) in messages {
            let mut headers = async_nats::HeaderMap::new();
            if let Some(id) = id {
                headers.insert("Nats-Msg-Id", id.as_str());
            }
            acks.push(js.publish_with_headers(subject.to_owned(), headers, body.clone().into()).await.expect("publishes"));
        }
        for ack in acks {
            ack.await.expect("the server acknowledges the publish");
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}
