//! The HTTP endpoint: `/metrics` (Prometheus text format), `/healthz` (the process is alive) and `/readyz` (the
//! database answered the last attempt and no pipeline has stopped on a fatal error).

use crate::metrics::Metrics;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Readiness, shared by the pipelines and the endpoint.
#[derive(Clone, Debug, Default)]
pub struct Health {
    inner: Arc<HealthInner>,
}

#[derive(Debug, Default)]
struct HealthInner {
    database_down: AtomicBool,
    fatal_pipelines: AtomicUsize,
}

impl Health {
    /// Records whether the last database attempt succeeded.
    pub fn database(&self, up: bool) {
        self.inner.database_down.store(!up, Ordering::Relaxed);
    }

    /// Records that a pipeline stopped on a fatal error.
    pub fn pipeline_fatal(&self) {
        self.inner.fatal_pipelines.fetch_add(1, Ordering::Relaxed);
    }

    /// `Ok` when ready, otherwise why not.
    pub fn ready(&self) -> Result<(), String> {
        let fatal = self.inner.fatal_pipelines.load(Ordering::Relaxed);
        if fatal > 0 {
            return Err(format!("{fatal} pipeline(s) stopped on a fatal error"));
        }
        if self.inner.database_down.load(Ordering::Relaxed) {
            return Err("the database is unreachable; batches are being retried".to_owned());
        }
        Ok(())
    }
}

/// The running endpoint; dropping it stops the server thread.
pub struct Server {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
}

impl Server {
    /// The address actually bound (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.server.unblock();
    }
}

/// Binds `addr` and serves on a background thread.
///
/// Errors: the address cannot be bound (in use, not local, no permission).
pub fn serve(addr: SocketAddr, metrics: Metrics, health: Health) -> std::io::Result<Server> {
    let server = tiny_http::Server::http(addr).map_err(std::io::Error::other)?;
    let bound = server.server_addr().to_ip().unwrap_or(addr);
    let server = Arc::new(server);
    let worker = server.clone();
    std::thread::Builder::new().name("idemflow-http".into()).spawn(move || {
        for request in worker.incoming_requests() {
            let path = request.url().split('?').next().unwrap_or_default().to_owned();
            let (status, content_type, body) = match path.as_str() {
                "/metrics" => (200, "text/plain; version=0.0.4; charset=utf-8", metrics.render()),
                "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
                "/readyz" => match health.ready() {
                    Ok(()) => (200, "text/plain", b"ready\n".to_vec()),
                    Err(why) => (503, "text/plain", format!("not ready: {why}\n").into_bytes()),
                },
                _ => (404, "text/plain", b"not found: try /metrics, /healthz or /readyz\n".to_vec()),
            };
            let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
                .expect("a valid header");
            let response = tiny_http::Response::from_data(body).with_status_code(status).with_header(header);
            let _ = request.respond(response);
        }
    })?;
    Ok(Server { server, addr: bound })
}
