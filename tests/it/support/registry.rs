//! The suite's schema registry (tests/schema-registry/server.py: the documented REST endpoints of Confluent's
//! Schema Registry), and payloads encoded by confluent-kafka's own serializers (tests/schema-registry/serialize.py),
//! both run with the test virtual environment's python3 (scripts/preflight.sh installs confluent-kafka there).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running registry on a free port, stopped on drop.
pub struct Registry {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// `USER:PASSWORD` when it requires basic authentication.
    user: Option<String>,
}

impl Registry {
    /// Starts it (with more arguments: `--user u:p`, `--bearer t`) and waits until it listens.
    pub fn start(args: &[&str]) -> Registry {
        let (child, port) = super::start_python_server("tests/schema-registry/server.py", args, "the registry");
        let user = args.iter().position(|a| *a == "--user").map(|i| args[i + 1].to_owned());
        Registry { child, port, user }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The values `docs` (JSON, one each) encoded in the wire format by confluent-kafka's serializer for `format`
    /// (`avro`, `json_schema`), which registers `schema_file`'s schema under `<topic>-value`.
    pub fn serialize(&self, format: &str, topic: &str, schema_file: &Path, docs: &[String]) -> Vec<Vec<u8>> {
        self.serialize_as(format, topic, schema_file, "", docs)
    }

    /// [`Registry::serialize`] for Protobuf: `message` of the `.proto` file `schema_file` (docs in protobuf's
    /// JSON mapping), by confluent-kafka's `ProtobufSerializer`.
    pub fn serialize_protobuf(&self, topic: &str, schema_file: &Path, message: &str, docs: &[String]) -> Vec<Vec<u8>> {
        self.serialize_as("protobuf", topic, schema_file, message, docs)
    }

    fn serialize_as(&self, format: &str, topic: &str, schema_file: &Path, message: &str, docs: &[String]) -> Vec<Vec<u8>> {
        let mut cmd = Command::new("python3");
        cmd.arg(super::project_root().join("tests/schema-registry/serialize.py"))
            .args([&self.url(), format, topic])
            .arg(schema_file)
            .arg(self.user.as_deref().unwrap_or(""))
            .arg(message)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        child.stdin.take().unwrap().write_all(docs.join("\n").as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "serialize.py failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().lines().map(|l| hex::decode(l).unwrap()).collect()
    }

    /// Registers `schema` (Avro) under `subject` over HTTPS (the registry started with `--tls`), trusting `ca`,
    /// with a bearer `token`: with curl, as an operator would.
    pub fn register_over_tls(&self, subject: &str, schema: &str, ca: &Path, token: &str) {
        let body = serde_json::json!({ "schema": schema }).to_string();
        let out = Command::new("curl")
            .args(["-sS", "--fail", "--cacert"])
            .arg(ca)
            .args(["-H", &format!("Authorization: Bearer {token}"), "-H", "Content-Type: application/json", "--data", &body])
            .arg(format!("https://localhost:{}/subjects/{subject}/versions", self.port))
            .output()
            .unwrap();
        assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Registers `schema` (Avro JSON) under `subject` as a producer's serializer would (a registry started without
    /// `--user`), and returns its id.
    pub fn register(&self, subject: &str, schema: &str) -> u32 {
        let body = serde_json::json!({ "schema": schema }).to_string();
        let answer = self.post(&format!("/subjects/{subject}/versions"), &body);
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
        v["id"].as_u64().unwrap_or_else(|| panic!("no id in {answer}")) as u32
    }

    /// Every request after this answers 307 to `location` (a base URL) with its own path; `""` stops it.
    pub fn redirect_to(&self, location: &str) {
        self.post("/_test/redirect", &serde_json::json!({ "location": location }).to_string());
    }

    /// The next `count` requests (-1: all until cleared) answer `status` (0 clears).
    pub fn fail(&self, status: u16, count: i64) {
        self.post("/_test/fail", &format!(r#"{{"status":{status},"count":{count}}}"#));
    }

    /// How many requests `path` had.
    pub fn requests(&self, path: &str) -> u64 {
        let (_, body) = super::http_get(([127, 0, 0, 1], self.port).into(), "/_test/requests").unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v.get(path).and_then(serde_json::Value::as_u64).unwrap_or(0)
    }

    /// POSTs `body` (to a registry started without `--user`) and returns the answer's body, asserted 200.
    fn post(&self, path: &str, body: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(s, "POST {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"), "{text}");
        text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
