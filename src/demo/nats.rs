//! A throwaway NATS server with JetStream for `idemflow demo --source nats`: Debian's `nats-server`, run with its
//! own store directory and a free loopback port, killed and removed on drop; and the demo's stream, created and
//! published to with the official client, as a user's producer would.

use anyhow::{bail, Context as _};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's package puts the server (not on a regular user's PATH).
const BINARIES: [&str; 3] = ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"];

/// A nats-server of this process, with JetStream on.
pub struct Throwaway {
    dir: tempfile::TempDir,
    binary: &'static str,
    port: u16,
    child: Option<Child>,
}

impl Throwaway {
    /// Starts a server on a free loopback port and waits (at most 30 s) until it accepts connections.
    ///
    /// Errors: `nats-server` is not installed (the message says how to install it), or it did not start (its output
    /// is included).
    pub fn start() -> anyhow::Result<Throwaway> {
        let Some(binary) = BINARIES.iter().find(|b| std::path::Path::new(b).exists()) else {
            bail!("nats-server is not installed: apt-get update && apt-get install -y --no-install-recommends nats-server");
        };
        let dir = tempfile::Builder::new().prefix("idemflow-nats.").tempdir()?;
        let port = super::host::free_port()?;
        let mut server = Throwaway { dir, binary, child: None, port };
        server.start_again()?;
        Ok(server)
    }

    /// Starts the server (again) on its store directory and port, and waits (at most 30 s) until it accepts
    /// connections (JetStream recovers its streams and consumers from the store directory).
    ///
    /// Errors: it did not start (its output is included).
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        let out = self.dir.path().join("server.log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&out)?;
        let child = Command::new(self.binary)
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(self.dir.path().join("store"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            let exited = self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if Instant::now() > deadline || exited {
                bail!("nats-server did not start; its output:\n{}", std::fs::read_to_string(&out).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Stops the server as a crash would (SIGKILL); [`Throwaway::start_again`] brings it back.
    pub fn crash(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What the server says of its version (`nats-server: v2.9.10`), empty if it says nothing.
    pub fn version(&self) -> String {
        let out = Command::new(self.binary).arg("--version").output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        self.crash();
    }
}

/// Creates stream `name` on subjects `<subject prefix>.>` (file storage, the server's default 2-minute duplicate
/// window).
///
/// Errors: the server refused it or cannot be reached.
pub async fn create_stream(url: &str, name: &str, subjects: &str) -> anyhow::Result<()> {
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    js.create_stream(async_nats::jetstream::stream::Config { name: name.to_owned(), subjects: vec![format!("{subjects}.>")], ..Default::default() })
        .await
        .map_err(|e| anyhow::anyhow!("creating stream {name}: {e}"))?;
    Ok(())
}

/// Makes sure stream `name` exists: left as it is when it does (whatever its subjects), created on
/// `<subject's first token>.>` otherwise (`payments.created` gives `payments.>`), as [`create_stream`] does.
///
/// Errors: the server refused, has no JetStream, or did not answer.
pub async fn ensure_stream(js: &async_nats::jetstream::Context, name: &str, subject: &str) -> anyhow::Result<()> {
    let prefix = subject.split('.').next().unwrap_or(subject);
    match js.get_stream(name).await {
        Ok(_) => {
            eprintln!("demo-producer: stream {name} exists; publishing to {subject}");
            Ok(())
        }
        Err(e)
            if matches!(e.kind(), async_nats::jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            js.create_stream(async_nats::jetstream::stream::Config { name: name.to_owned(), subjects: vec![format!("{prefix}.>")], ..Default::default() })
                .await
                .map_err(|e| anyhow::anyhow!("creating stream {name}: {e}"))?;
            eprintln!("demo-producer: created stream {name} on {prefix}.>");
            Ok(())
        }
        Err(e) => Err(anyhow::anyhow!("looking up stream {name}: {e}")),
    }
}

/// Publishes `records` (Nats-Msg-Id, body) to `subject` and waits for the stream's acknowledgements; returns how
/// many the stream dropped as duplicates (a `Nats-Msg-Id` it had seen within its duplicate window).
///
/// Errors: a publish was not acknowledged (no stream covers the subject, say), or the server cannot be reached.
pub async fn publish_to(js: &async_nats::jetstream::Context, subject: &str, records: &[(String, &[u8])]) -> anyhow::Result<u64> {
    let mut acks = Vec::with_capacity(records.len());
    for (id, body) in records {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(crate::source::nats::MSG_ID_HEADER, id.as_str());
        acks.push(js.publish_with_headers(subject.to_owned(), headers, bytes::Bytes::copy_from_slice(body)).await?);
    }
    let mut dropped = 0;
    for ack in acks {
        if ack.await.map_err(|e| anyhow::anyhow!("a publish to {subject} was not acknowledged: {e}"))?.duplicate {
            dropped += 1;
        }
    }
    Ok(dropped)
}

/// Publishes `messages` (Nats-Msg-Id, body) to `subject`, each acknowledged by the stream (a JetStream publish),
/// with its id as `Nats-Msg-Id` when `with_ids` (else without: the stream keeps every copy): returns how many the
/// stream dropped as duplicates of an id it had seen within its duplicate window.
///
/// Errors: a publish was not acknowledged, or the server cannot be reached.
pub async fn publish(url: &str, subject: &str, messages: &[(String, Vec<u8>)], with_ids: bool) -> anyhow::Result<u64> {
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    let mut dropped = 0;
    for chunk in messages.chunks(1000) {
        let mut acks = Vec::with_capacity(chunk.len());
        for (id, body) in chunk {
            let mut headers = async_nats::HeaderMap::new();
            if with_ids {
                headers.insert(crate::source::nats::MSG_ID_HEADER, id.as_str());
            }
            acks.push(js.publish_with_headers(subject.to_owned(), headers, body.clone().into()).await?);
        }
        for ack in acks {
            if ack.await.map_err(|e| anyhow::anyhow!("a publish was not acknowledged: {e}"))?.duplicate {
                dropped += 1;
            }
        }
    }
    Ok(dropped)
}
