//! The HTTP endpoint: `/metrics` (Prometheus text format), `/healthz` (the process is alive) and `/readyz` (the
//! stores answered, each pipeline's last batch attempt reached its store, no pipeline has stopped on a fatal error,
//! no partition is stalled).
//!
//! It must keep answering whatever clients do, or an orchestrator restarts a healthy worker: connections are
//! bounded in number, in how long they may take to send a request head and in its size, and in how long they
//! live; each is served in its own task, so a client that never reads cannot hold up another.

use crate::metrics::Metrics;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::time::Duration;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Readiness, shared by the pipelines and the endpoint.
#[derive(Clone, Debug, Default)]
pub struct Health {
    inner: Arc<HealthInner>,
}

#[derive(Debug, Default)]
struct HealthInner {
    database_down: AtomicBool,
    /// The lanes, as (pipeline, lane), whose last batch attempt failed against their store and is being retried:
    /// one lane's commit does not make another's failing store look reachable.
    failing: Mutex<BTreeSet<(String, Arc<str>)>>,
    /// The pipelines stopped on a fatal error, with why (the first line of their error).
    fatal_pipelines: Mutex<std::collections::BTreeMap<String, String>>,
    /// The pipelines not consuming because their outbox is over its bounds, with why.
    outbox_paused: Mutex<std::collections::BTreeMap<String, String>>,
}

impl Health {
    /// Records whether the stores answered at start (before any pipeline runs).
    pub fn database(&self, up: bool) {
        self.inner.database_down.store(!up, Ordering::Relaxed);
    }

    /// Records whether the last batch attempt of one lane (`lane`, a name unique among the pipeline's lanes) of
    /// `pipeline` reached its store: `false` while its batch is retried (an outage, a lock held elsewhere), `true`
    /// once one commits. Not ready while any lane is failing.
    pub fn pipeline_store(&self, lane: &Arc<str>, pipeline: &str, up: bool) {
        let mut failing = self.inner.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = (pipeline.to_owned(), lane.clone());
        if up {
            failing.remove(&entry);
        } else {
            failing.insert(entry);
        }
    }

    /// Records whether `pipeline` is paused by its outbox's back-pressure (`Some(why)`); not ready while any is.
    pub fn outbox_paused(&self, pipeline: &str, why: Option<String>) {
        let mut paused = self.inner.outbox_paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match why {
            Some(why) => paused.insert(pipeline.to_owned(), why),
            None => paused.remove(pipeline),
        };
    }

    /// Records that `pipeline` stopped on a fatal error, and why (a panic's message included): `/readyz` says so.
    pub fn pipeline_fatal(&self, pipeline: &str, why: &str) {
        let mut fatal = self.inner.fatal_pipelines.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        fatal.insert(pipeline.to_owned(), why.lines().next().unwrap_or_default().to_owned());
    }

    /// `Ok` when ready, otherwise why not.
    pub fn ready(&self) -> Result<(), String> {
        {
            let fatal = self.inner.fatal_pipelines.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some((pipeline, why)) = fatal.iter().next() {
                let more = if fatal.len() > 1 { format!(" (and {} more)", fatal.len() - 1) } else { String::new() };
                return Err(format!("pipeline {pipeline:?} stopped on a fatal error: {why}{more}"));
            }
        }
        if self.inner.database_down.load(Ordering::Relaxed) {
            return Err("the database is unreachable; batches are being retried".to_owned());
        }
        let paused = self.inner.outbox_paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((pipeline, why)) = paused.iter().next() {
            return Err(format!("pipeline {pipeline:?} is paused: {why}"));
        }
        drop(paused);
        let failing = self.inner.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !failing.is_empty() {
            let mut names: Vec<&str> = failing.iter().map(|(pipeline, _)| pipeline.as_str()).collect();
            names.dedup();
            return Err(format!(
                "the store of pipeline(s) {} is unreachable or failing; their batches are being retried",
                names.join(", ")
            ));
        }
        Ok(())
    }
}

/// At most this many connections are served at once; a connection beyond it is closed at once. Idle connections
/// do not hold their place for long ([`HEADER_READ_TIMEOUT`]), so a flood of them cannot keep `/healthz` out.
pub const MAX_CONNECTIONS: usize = 256;

/// A connection must send a whole request head within this time, the first one and each next one on a kept-alive
/// connection; otherwise it is closed (slowloris, idle sockets).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// The most a request head may take in bytes; a larger one gets `431 Request Header Fields Too Large` and the
/// connection is closed, without buffering the rest.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// The longest a connection lives, whatever it does (a client that never reads its responses, say).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// The running endpoint; dropping it stops the server.
pub struct Server {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// The address actually bound (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The response to one request.
fn respond(path: &str, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => (StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", metrics.render()),
        "/healthz" => (StatusCode::OK, "text/plain", b"ok\n".to_vec()),
        "/readyz" => {
            // Every reason at once: a failing store does not hide which partitions it stalls.
            let mut why: Vec<String> = health.ready().err().into_iter().collect();
            let stalled = metrics.stalls();
            if !stalled.is_empty() {
                why.push(format!("stalled (no progress while records wait): {}", stalled.join("; ")));
            }
            if why.is_empty() {
                (StatusCode::OK, "text/plain", b"ready\n".to_vec())
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("not ready: {}\n", why.join("; ")).into_bytes())
            }
        }
        _ => (StatusCode::NOT_FOUND, "text/plain", b"not found: try /metrics, /healthz or /readyz\n".to_vec()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    response
}

/// Binds `addr` and serves on the tokio runtime (HTTP/1.1 with hyper), each connection in its own task, within the
/// limits above. A failing `accept` (out of file descriptors, say) is logged and retried with backoff: the server
/// never stops serving while the worker runs. Must be called inside a tokio runtime.
///
/// Errors: the address cannot be bound (in use, not local, no permission).
pub fn serve(addr: SocketAddr, metrics: Metrics, health: Health) -> std::io::Result<Server> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let bound = listener.local_addr()?;
    let open = Arc::new(AtomicUsize::new(0));
    let task = tokio::spawn(async move {
        let mut failures = 0u32;
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => {
                    failures = 0;
                    stream
                }
                Err(e) => {
                    failures += 1;
                    let delay = Duration::from_millis(10 << failures.min(7)).min(Duration::from_secs(1));
                    tracing::warn!(error = %e, retry_in = ?delay, "metrics endpoint: accepting a connection failed");
                    tokio::time::sleep(delay).await;
                    continue;
                }
            };
            if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                open.fetch_sub(1, Ordering::SeqCst);
                drop(stream);
                continue;
            }
            let (metrics, health, open) = (metrics.clone(), health.clone(), open.clone());
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let response = respond(request.uri().path(), &metrics, &health);
                    async move { Ok::<_, std::convert::Infallible>(response) }
                });
                let mut builder = http1::Builder::new();
                builder.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT).max_buf_size(MAX_HEADER_BYTES);
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Ok(Server { addr: bound, task })
}
