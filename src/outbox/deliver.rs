//! One attempt at one outbox request over HTTP, and what its answer means: confirmed, worth another attempt (with
//! the target's `Retry-After` when it gave one), or never going to succeed.

use super::spec::{HttpTarget, MAX_RETRY_AFTER};
pub use crate::metrics::AttemptResult;
use crate::store::rows::OutboxRequest;
use crate::schema_registry::describe;
use std::time::Duration;

/// How much of an answer's body a dead letter or a log line keeps.
pub const RESPONSE_HEAD_BYTES: usize = 512;

/// What one attempt came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The target answered one of `success`.
    Confirmed,
    /// Worth another attempt: a `retry` status, a connection error, a time-out.
    Retry {
        /// The target's `Retry-After`, when it answered one (bounded by [`MAX_RETRY_AFTER`]).
        after: Option<Duration>,
        /// What happened, for the row's last error and the dead letter should the attempts run out.
        error: String,
        /// The `result` label of `idemflow_outbox_attempts_total`.
        result: AttemptResult,
    },
    /// Any other status: the request can never succeed as it is.
    Rejected {
        /// The status and the head of the answer.
        error: String,
    },
}

impl Outcome {
    /// Its `result` label.
    pub fn result(&self) -> AttemptResult {
        match self {
            Outcome::Confirmed => AttemptResult::Confirmed,
            Outcome::Retry { result, .. } => *result,
            Outcome::Rejected { .. } => AttemptResult::Rejected,
        }
    }
}

/// The client of one target: its time-out, no redirects followed (a 3xx is an answer like any other: a charge
/// redirected elsewhere is not confirmed), no proxy from the environment.
///
/// Errors: the client cannot be built (no TLS provider).
pub fn client(target: &HttpTarget) -> Result<reqwest::Client, String> {
    crate::install_tls_provider();
    let mut builder = reqwest::Client::builder();
    // A host from a record's values is connected to at public addresses only (unless the target allows private
    // ones): the name is resolved, then checked.
    if target.hosts.is_some() && !target.private_addresses {
        builder = builder.dns_resolver(super::guard::PublicOnly);
    }
    builder
        .timeout(target.timeout)
        .connect_timeout(target.timeout.min(Duration::from_secs(10)))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!("idemflow/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot build the HTTP client of {}: {e}", target.name))
}

/// What goes out for one row now: its URL (a secret URL read), the target's headers as configured now (literal
/// ones and secrets read) then the row's, and its body with its secrets read.
pub struct Outgoing {
    /// Where the request goes.
    pub url: String,
    /// Every header, the target's first.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// The request of `row` for `target` as configured now, checked before anything is sent: the row's origin is the
/// target's (a row written for another origin, under an older configuration, never gets today's headers), a host
/// from a record's values is still one of `allow_hosts`, a secret URL is the secret the row was written for.
///
/// Errors: the outcome instead of an attempt: rejected (a dead letter saying why, replay re-homes it) for a row that
/// may not go there; retried for a secret that cannot be read now (nothing sent).
pub fn outgoing(target: &HttpTarget, row: &OutboxRequest) -> Result<Outgoing, Outcome> {
    let rejected = |why: String| Outcome::Rejected { error: format!("{} {}: {why}", row.method, shown_url(&row.url)) };
    let unreadable = |error: String| Outcome::Retry { after: None, error, result: AttemptResult::Connection };
    let url = match (&target.secret_url, &target.origin, &target.hosts) {
        (Some(secret), ..) => {
            let marker = target.url.literal().unwrap_or_default();
            if row.url != marker {
                return Err(rejected(format!(
                    "written for another URL than the target's now ({}): not sent with its headers; `idemflow dead-letters replay` re-homes it",
                    secret.describe()
                )));
            }
            secret.resolve().map_err(unreadable)?
        }
        (None, Some(origin), _) => {
            let at = super::guard::Origin::of(&row.url);
            if at.as_ref() != Some(origin) {
                let was = at.map_or_else(|| "no origin".to_owned(), |o| o.0);
                return Err(rejected(format!(
                    "written for {was}, and the target now sends to {}: not sent with today's headers; `idemflow dead-letters replay` re-homes it",
                    origin.0
                )));
            }
            row.url.clone()
        }
        (None, None, Some(hosts)) => {
            let parsed = url::Url::parse(&row.url).map_err(|e| rejected(format!("not a URL: {e}")))?;
            super::render::check_host(&parsed, hosts, target.private_addresses).map_err(rejected)?;
            row.url.clone()
        }
        (None, None, None) => row.url.clone(),
    };
    let mut headers: Vec<(String, String)> = target.headers.iter().filter_map(|(n, a)| a.literal().map(|v| (n.clone(), v))).collect();
    for (name, secret) in &target.secret_headers {
        headers.push((name.clone(), secret.resolve().map_err(|why| unreadable(format!("header {name}: {why}")))?));
    }
    headers.extend(row.headers.iter().cloned());
    super::render::fits(&target.body, &row.body).map_err(rejected)?;
    let body = super::render::with_secrets(&target.body, &row.body).map_err(unreadable)?;
    Ok(Outgoing { url, headers, body })
}

/// Sends `request` once and classifies the answer by `target`'s `success` and `retry` statuses.
pub async fn send(client: &reqwest::Client, target: &HttpTarget, request: &OutboxRequest) -> Outcome {
    // A secret URL is shown as its row keeps it (naming the secret), never as read.
    let shown = if target.secret_url.is_some() { request.url.clone() } else { shown_url(&request.url) };
    let method = match reqwest::Method::from_bytes(request.method.as_bytes()) {
        Ok(m) => m,
        Err(_) => return Outcome::Rejected { error: format!("{} is not an HTTP method", request.method) },
    };
    let out = match outgoing(target, request) {
        Ok(out) => out,
        Err(outcome) => return outcome,
    };
    let mut builder = client.request(method, &out.url).body(out.body);
    for (name, value) in &out.headers {
        builder = builder.header(name, value);
    }
    let response = match builder.send().await {
        Ok(r) => r,
        // A request reqwest cannot build (a header it refuses) never will be.
        Err(e) if e.is_builder() => return Outcome::Rejected { error: format!("{} {shown}: {}", request.method, describe(&e)) },
        Err(e) => {
            let result = if e.is_timeout() { AttemptResult::Timeout } else { AttemptResult::Connection };
            return Outcome::Retry { after: None, error: format!("{} {shown}: {}", request.method, describe(&e)), result };
        }
    };
    let status = response.status().as_u16();
    if target.success.iter().any(|s| s.contains(status)) {
        return Outcome::Confirmed;
    }
    let after = response.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(retry_after);
    let head = head(response).await;
    let error = format!("{} {shown}: HTTP {status}: {head}", request.method);
    if target.retry.iter().any(|s| s.contains(status)) {
        Outcome::Retry { after, error, result: AttemptResult::RetryStatus }
    } else {
        Outcome::Rejected { error }
    }
}

/// How `check` finds a target: its host resolved and a TCP connection accepted within `within`, no request sent.
/// `Ok` with what was reached; `Err(Unreachable::Unresolved)` for a host that does not resolve, `Refused` for one
/// that does not accept a connection. A URL whose host comes from the record's values is not asked.
pub async fn reachable(target: &HttpTarget, within: Duration) -> Result<Option<String>, Unreachable> {
    let Some((host, port)) = target.fixed_host() else { return Ok(None) };
    let addrs: Vec<std::net::SocketAddr> = match tokio::time::timeout(within, tokio::net::lookup_host((host.as_str(), port))).await {
        Ok(Ok(a)) => a.collect(),
        Ok(Err(e)) => return Err(Unreachable::Unresolved(format!("{host}: {e}"))),
        Err(_) => return Err(Unreachable::Unresolved(format!("{host}: no answer from the resolver within {within:?}"))),
    };
    let mut last = format!("{host}:{port}: no address");
    for addr in addrs {
        match tokio::time::timeout(within, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => return Ok(Some(format!("{host}:{port} ({addr}) accepts connections"))),
            Ok(Err(e)) => last = format!("{host}:{port} ({addr}): {e}"),
            Err(_) => last = format!("{host}:{port} ({addr}): no connection within {within:?}"),
        }
    }
    Err(Unreachable::Refused(last))
}

/// Why `check` could not reach a target ([`reachable`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unreachable {
    /// The host name does not resolve: a mistake in the URL, most likely.
    Unresolved(String),
    /// It resolves, and nothing accepts a connection there (now).
    Refused(String),
}

/// The first [`RESPONSE_HEAD_BYTES`] of an answer's body, as text; what could not be read is said.
async fn head(mut response: reqwest::Response) -> String {
    let mut bytes = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                bytes.extend_from_slice(&chunk);
                if bytes.len() >= RESPONSE_HEAD_BYTES {
                    bytes.truncate(RESPONSE_HEAD_BYTES);
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                return format!("{} (then the body could not be read: {})", String::from_utf8_lossy(&bytes), describe(&e));
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `Retry-After` (RFC 9110, section 10.2.3): seconds, or an HTTP date; bounded by [`MAX_RETRY_AFTER`].
pub fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    let wait = match value.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => {
            let at = httpdate::parse_http_date(value).ok()?;
            at.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO)
        }
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// A URL as logs and dead letters show it: without its user, password and query (which may carry credentials).
pub fn shown_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            let query = u.query().is_some();
            u.set_query(None);
            format!("{u}{}", if query { "?..." } else { "" })
        }
        Err(_) => "(a URL that does not parse)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_in_seconds_or_as_a_date_within_bounds() {
        assert_eq!(retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(retry_after(" 120 "), Some(Duration::from_secs(120)));
        assert_eq!(retry_after("999999"), Some(MAX_RETRY_AFTER));
        assert_eq!(retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO), "a date past");
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
        assert!(retry_after(&later).is_some_and(|d| d > Duration::from_secs(25) && d <= Duration::from_secs(30)));
        assert_eq!(retry_after("soon"), None);
    }

    #[test]
    fn urls_are_shown_without_credentials_or_query() {
        assert_eq!(shown_url("https://u:p@pay.example/charges?api_key=s3cret"), "https://pay.example/charges?...");
        assert_eq!(shown_url("http://h:8080/a/b"), "http://h:8080/a/b");
    }
}
