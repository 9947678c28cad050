//! The demo's throwaway payment provider (`idemflow demo --effect http`, and the HTTP run of `idemflow bench`): an
//! HTTP API on a loopback port that charges each request once per `Idempotency-Key`, as the IETF httpapi draft "The
//! Idempotency-Key HTTP Header Field" describes: a request with a key it already answered gets the same answer again
//! (`Idempotent-Replayed: true`), one that reuses a key with another body gets 422, one without a key 400 (a charge is
//! made under a lock, so no request ever finds its key in flight: the draft's 409 is the suite's provider's,
//! `tests/payment-provider/server.py`). Like a real provider's sandbox it can lose answers: with `lose_every = n`,
//! every nth charge is made and its connection then dropped without an answer, so the relay sends it again and the
//! provider recognises it. It counts what it did.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// What the provider did, so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests with a key.
    pub requests: u64,
    /// Charges made: one per key.
    pub charges: u64,
    /// Repeated requests answered from the record of their key (no charge).
    pub replays: u64,
    /// Requests that reused a key with another body (422).
    pub mismatches: u64,
    /// Answers dropped on purpose after the charge (`lose_every`).
    pub lost_answers: u64,
    /// The sum of the charges' `amount` fields, in cents.
    pub charged_cents: i128,
}

#[derive(Default)]
struct State {
    /// Per key: the fingerprint of its request, and its answer.
    keys: HashMap<String, ([u8; 32], Bytes)>,
    counts: Counts,
}

/// A running provider; stops when dropped.
pub struct Provider {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Provider {
    /// Starts it on a free loopback port; with `lose_every = Some(n)`, every nth charge's answer is lost.
    ///
    /// Errors: no port could be bound.
    pub async fn start(lose_every: Option<u64>) -> std::io::Result<Provider> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(req, state.clone(), lose_every));
                    let _ = http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        Ok(Provider { addr, state, task })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What it did so far.
    pub fn counts(&self) -> Counts {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).counts
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why a connection ends without an answer (`lose_every`).
#[derive(Debug)]
struct LostAnswer;

impl std::fmt::Display for LostAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the answer is lost on purpose")
    }
}

impl std::error::Error for LostAnswer {}

fn problem(status: StatusCode, title: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "type": "about:blank", "title": title, "status": status.as_u16() }).to_string();
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/problem+json"));
    r
}

async fn answer(req: Request<hyper::body::Incoming>, state: Arc<Mutex<State>>, lose_every: Option<u64>) -> Result<Response<Full<Bytes>>, LostAnswer> {
    let key = req.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(problem(StatusCode::BAD_REQUEST, "the body could not be read")),
    };
    let Some(key) = key else { return Ok(problem(StatusCode::BAD_REQUEST, "Idempotency-Key is missing")) };
    let mut h = Sha256::new();
    for part in [method.as_bytes(), b" ", path.as_bytes(), b" ", &body] {
        h.update(part);
    }
    let fingerprint: [u8; 32] = h.finalize().into();
    let mut s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    s.counts.requests += 1;
    match s.keys.get(&key) {
        Some((f, _)) if *f != fingerprint => {
            s.counts.mismatches += 1;
            return Ok(problem(StatusCode::UNPROCESSABLE_ENTITY, "the Idempotency-Key was used with another request"));
        }
        Some((_, stored)) => {
            let stored = stored.clone();
            s.counts.replays += 1;
            let mut r = Response::new(Full::new(stored));
            *r.status_mut() = StatusCode::CREATED;
            r.headers_mut().insert("idempotent-replayed", hyper::header::HeaderValue::from_static("true"));
            return Ok(r);
        }
        None => {}
    }
    // The charge: made once for the key, its answer kept for repeats.
    s.counts.charges += 1;
    let id = s.counts.charges;
    let amount = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| cents(&v["amount"]));
    s.counts.charged_cents += amount.unwrap_or(0);
    let answer = Bytes::from(serde_json::json!({ "charge_id": id, "idempotency_key": key }).to_string());
    s.keys.insert(key, (fingerprint, answer.clone()));
    if lose_every.is_some_and(|n| n > 0 && id % n == 0) {
        s.counts.lost_answers += 1;
        return Err(LostAnswer);
    }
    let mut r = Response::new(Full::new(answer));
    *r.status_mut() = StatusCode::CREATED;
    Ok(r)
}

/// An amount (`"12.34"` or `12.34`) in cents.
fn cents(v: &serde_json::Value) -> Option<i128> {
    let text = match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => return None,
    };
    let (whole, frac) = text.split_once('.').unwrap_or((&text, "0"));
    let frac = format!("{frac:0<2}");
    Some(whole.parse::<i128>().ok()? * 100 + frac[..2].parse::<i128>().ok()?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn amounts_in_cents() {
        assert_eq!(super::cents(&serde_json::json!("12.34")), Some(1234));
        assert_eq!(super::cents(&serde_json::json!("7")), Some(700));
        assert_eq!(super::cents(&serde_json::json!("0.5")), Some(50));
    }
}
