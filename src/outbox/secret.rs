//! Secrets named, not written: a target's URL, header values and body values may be `{ env = "NAME" }` or
//! `{ file = "/run/secrets/name" }` (with an optional `prefix`, such as `"Bearer "`), read when a request is sent and
//! never written into an outbox row, a dead letter, a log line or `check`'s output. Literal values that look like
//! credentials are warned about ([`warnings`]).

use serde::Deserialize;
use std::path::PathBuf;

/// A value of the pipeline file that is a string, or a secret reference (`{ env = ... }`, `{ file = ... }`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum RawValue {
    /// Text (a template).
    Text(String),
    /// A secret reference.
    Secret(RawSecret),
}

impl RawValue {
    /// Its text, when it is text.
    pub fn text(&self) -> Option<&str> {
        match self {
            RawValue::Text(t) => Some(t),
            RawValue::Secret(_) => None,
        }
    }
}

/// `{ env = "NAME" }` or `{ file = "/path" }`, with an optional `prefix`, as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSecret {
    env: Option<String>,
    file: Option<PathBuf>,
    prefix: Option<String>,
}

/// Where a secret is read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretSource {
    /// An environment variable of the worker's process.
    Env(String),
    /// A file (a mounted Kubernetes or Docker secret): its text, without a final line break. Read at each request,
    /// so a rotated secret is used from the next request on.
    File(PathBuf),
}

/// A secret reference, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRef {
    /// Where it is read from.
    pub source: SecretSource,
    /// Text before the secret (`"Bearer "`).
    pub prefix: String,
}

impl SecretRef {
    /// The reference as written, checked.
    ///
    /// Errors: neither or both of `env` and `file`, an empty name, a relative path.
    pub fn parse(raw: &RawSecret) -> Result<SecretRef, String> {
        let source = match (&raw.env, &raw.file) {
            (Some(name), None) if !name.is_empty() && !name.contains('=') && !name.contains('\0') => SecretSource::Env(name.clone()),
            (None, Some(path)) if path.is_absolute() => SecretSource::File(path.clone()),
            (None, Some(_)) => return Err("file: must be an absolute path (where the secret is mounted)".to_owned()),
            _ => return Err("a secret is { env = \"NAME\" } or { file = \"/run/secrets/name\" } (one of them), with an optional prefix".to_owned()),
        };
        Ok(SecretRef { source, prefix: raw.prefix.clone().unwrap_or_default() })
    }

    /// Where it comes from, for messages: `env PAYMENT_TOKEN`, `file /run/secrets/token` (never its value).
    pub fn describe(&self) -> String {
        match &self.source {
            SecretSource::Env(name) => format!("env {name}"),
            SecretSource::File(path) => format!("file {}", path.display()),
        }
    }

    /// The value now, with its prefix.
    ///
    /// Errors: the variable is not set (or not UTF-8), the file cannot be read, or the value is empty; the message
    /// names the reference, never a value.
    pub fn resolve(&self) -> Result<String, String> {
        let value = match &self.source {
            SecretSource::Env(name) => std::env::var(name)
                .map_err(|_| format!("the secret of env {name} is not set in the worker's environment"))?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
            SecretSource::File(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("the secret of file {} cannot be read: {}", path.display(), e.kind()))?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
        };
        if value.is_empty() {
            return Err(format!("the secret of {} is empty", self.describe()));
        }
        Ok(format!("{}{value}", self.prefix))
    }
}

/// Whether a TOML table is a secret reference (only `env` or `file`, and `prefix`): in a body, such a table is read
/// as one (write another key beside it for a literal object).
pub fn is_reference(table: &toml::Table) -> bool {
    (table.contains_key("env") || table.contains_key("file")) && table.keys().all(|k| matches!(k.as_str(), "env" | "file" | "prefix"))
}

/// The words of names (headers, query parameters, body keys) whose literal values are credentials.
const CREDENTIAL_WORDS: [&str; 9] = ["auth", "token", "secret", "password", "passwd", "apikey", "api-key", "api_key", "signature"];

/// Whether a header, query parameter or body key named `name` carries a credential (`Authorization`, `X-Api-Key`,
/// `access_token`, `client_secret`, `Cookie`): its literal value is warned about, and `dead-letters show` hides it.
/// Not the idempotency key's header.
pub fn credential_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower != "idempotency-key" && (lower == "cookie" || lower == "x-api-key" || CREDENTIAL_WORDS.iter().any(|w| lower.contains(w)))
}

/// Hosts whose URLs hold their secret in the path (incoming webhooks).
const WEBHOOK_HOSTS: [&str; 5] = ["hooks.slack.com", "discord.com", "discordapp.com", "webhook.office.com", "hooks.zapier.com"];

/// What looks like a credential written in clear in a target: a literal URL of a webhook service (its path is its
/// secret), a query parameter or a header named like a credential with a literal value, a body key of that kind
/// with a literal string. As `(field, warning)`, the field under the target's own.
pub fn warnings(url: Option<&str>, literal_headers: &[(&str, bool)], body_keys: &[String]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let hint = "name it instead ({ env = \"NAME\" } or { file = \"/run/secrets/name\" }): written here it is in the pipeline file";
    if let Some(u) = url.and_then(|u| url::Url::parse(u).ok()) {
        let host = u.host_str().unwrap_or_default().to_ascii_lowercase();
        if WEBHOOK_HOSTS.iter().any(|w| host == *w || host.ends_with(&format!(".{w}"))) {
            out.push(("url".to_owned(), format!("a webhook URL's path is its secret, and a literal URL is kept in every outbox row and dead letter: {hint}")));
        }
        if u.query_pairs().any(|(k, _)| credential_name(&k)) {
            out.push(("url".to_owned(), format!("its query holds a credential, kept in every outbox row and dead letter: {hint}")));
        }
    }
    for (name, literal) in literal_headers {
        if *literal && credential_name(name) {
            out.push((format!("headers.{name}"), format!("a credential written in clear: {hint}")));
        }
    }
    for key in body_keys {
        out.push((format!("body.{key}"), format!("a literal credential in the body is kept in every outbox row and dead letter: {hint}")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_resolve_with_their_prefix_and_never_show_a_value() {
        let raw: RawSecret = toml::from_str("env = \"IDEMFLOW_TEST_SECRET_A\"\nprefix = \"Bearer \"").unwrap();
        let secret = SecretRef::parse(&raw).unwrap();
        assert_eq!(secret.describe(), "env IDEMFLOW_TEST_SECRET_A");
        let missing = secret.resolve().unwrap_err();
        assert!(missing.contains("IDEMFLOW_TEST_SECRET_A") && missing.contains("not set"), "{missing}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cr3t\n").unwrap();
        let file = SecretRef { source: SecretSource::File(path), prefix: String::new() };
        assert_eq!(file.resolve().unwrap(), "s3cr3t");
        for bad in ["", "env = \"A\"\nfile = \"/x\"", "file = \"relative\""] {
            let raw: RawSecret = toml::from_str(bad).unwrap();
            assert!(SecretRef::parse(&raw).is_err(), "{bad}");
        }
    }

    #[test]
    fn credentials_in_clear_are_warned_about() {
        assert!(credential_name("Authorization") && credential_name("X-Api-Key") && credential_name("client_secret"));
        assert!(!credential_name("Idempotency-Key") && !credential_name("X-Order"));
        let w = warnings(Some("https://hooks.slack.com/services/T0/B0/XYZ"), &[("Authorization", true), ("X-Order", false)], &[]);
        assert_eq!(w.len(), 2, "{w:?}");
        let w = warnings(Some("https://api.example.com/v1?access_token=abc"), &[("Authorization", false)], &["api_key".to_owned()]);
        assert_eq!(w.len(), 2, "{w:?}");
    }
}
