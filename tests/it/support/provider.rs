//! The suite's payment provider (tests/payment-provider/server.py: an HTTP API honouring the `Idempotency-Key`
//! header as draft-ietf-httpapi-idempotency-key-header describes, with injected faults and a record of every
//! charge), run with the test environment's python3.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::Duration;

/// A running payment provider on a free port, stopped on drop.
pub struct Provider {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl Provider {
    /// Starts it (with more arguments: `--header NAME` for another key header) and waits until it listens.
    pub fn start(args: &[&str]) -> Provider {
        let (child, port) = super::start_python_server("tests/payment-provider/server.py", args, "the payment provider");
        Provider { child, port }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Queues a fault rule (or a JSON array of rules) for the next requests that carry a key, e.g.
    /// `{"status": 503, "count": 3, "retry_after": 1}`, `{"delay": 5.0}`, `{"reset": true, "after_charge": true}`
    /// (`count` defaults to 1, -1 applies until cleared).
    pub fn fault(&self, rule: serde_json::Value) {
        self.call("POST", "/_test/faults", &rule.to_string());
    }

    /// Clears every queued fault rule.
    pub fn clear_faults(&self) {
        self.call("DELETE", "/_test/faults", "");
    }

    /// What it saw: `{"requests", "charges", "distinct_keys", "replays", "conflicts", "mismatches", "keys": {KEY:
    /// {"charges", "replays", "requests", "path", "headers", "body"}}}` (see the server's docstring).
    pub fn state(&self) -> serde_json::Value {
        let body = self.call("GET", "/_test/state", "");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("the payment provider's state is not JSON ({e}): {body}"))
    }

    /// A test endpoint's answer body, asserted 200: one HTTP/1.1 request on its own connection (`Connection: close`).
    fn call(&self, method: &str, path: &str, body: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            self.port,
            body.len()
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap_or_else(|e| panic!("{method} {path} on the payment provider: {e}"));
        let status = text.split_whitespace().nth(1).unwrap_or_default();
        assert_eq!(status, "200", "{method} {path} on the payment provider: {text}");
        text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()
    }
}

impl Drop for Provider {
    /// Kills the server and waits for it.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
