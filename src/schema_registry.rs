//! The schema registry client: the REST API of Confluent's Schema Registry (also served by Apicurio's and
//! Karapace's compatibility layers, and by Redpanda), as the Confluent serializers use it. Payloads in the Confluent
//! wire format carry a schema id; [`SchemaRegistry::schema`] fetches the schema of an id (`GET /schemas/ids/{id}`),
//! [`SchemaRegistry::latest`] a subject's current version (`GET /subjects/{subject}/versions/latest`, for `check`),
//! and [`SchemaRegistry::version`] a referenced schema. Ids never change meaning, so callers cache what they get by
//! id ([`crate::decode::Schemas`]); this module keeps nothing.
//!
//! Every request is bounded by `[schema_registry] timeout` (the whole exchange) and `connect_timeout`. A registry
//! that cannot be reached, answers 5xx, 408 or 429, or with a body that is not its JSON is [`RegistryError::Unavailable`]:
//! the caller pauses and retries. 401 and 403 are [`RegistryError::Refused`]: retried too (an outage of credentials
//! is fixed outside the worker), each warned. A 404 whose `error_code` is 40403 (schema not found), 40401 (subject
//! not found) or 40402 (version not found) is an answer: `None`. The rules are the registry's documented error codes
//! (<https://docs.confluent.io/platform/current/schema-registry/develop/api.html#errors>), never its message texts.
//!
//! Credentials (`password`, `bearer_token`, a password in `url`) are never printed: the settings' `Debug` hides
//! them, and errors name the registry by its URL without them.

use crate::secret::{Secret, SecretUrl};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// `[schema_registry]`: where the schemas of wire-format payloads (`format = "avro"`, `"json_schema"`,
/// `"protobuf"` without `schema_file`) are fetched.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrySettings {
    /// The registry's base URL (`http://registry:8081`, `https://...`; a path prefix is kept). Credentials in it
    /// (`https://user:password@host`) are basic authentication, as `username` and `password` are.
    pub url: SecretUrl,
    /// Basic authentication: the user (Confluent Cloud: the API key).
    pub username: Option<String>,
    /// Basic authentication: the password (Confluent Cloud: the API secret).
    pub password: Option<Secret>,
    /// Bearer authentication (an OAuth access token): `Authorization: Bearer <token>`. Not with `username`.
    pub bearer_token: Option<Secret>,
    /// A PEM file of certificate authorities trusted besides the system's (a private CA).
    pub ca_file: Option<PathBuf>,
    /// The most one request may take, from connecting to the body's last byte (default 10 s).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// The most connecting (TCP and TLS) may take (default 5 s).
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}

/// Why the registry gave no answer. Never a record's fault: nothing is dead-lettered for it.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    /// Not reachable, timed out, a 5xx, 408 or 429, or a body that is not the registry's JSON.
    #[error("schema registry {url} unavailable: {why}")]
    Unavailable {
        /// The registry, without credentials.
        url: String,
        /// What happened.
        why: String,
    },
    /// 401 or 403: the credentials are wrong or lack the permission to read schemas.
    #[error("schema registry {url} refused the request ({status}): check [schema_registry] username, password or bearer_token")]
    Refused {
        /// The registry, without credentials.
        url: String,
        /// The HTTP status.
        status: u16,
    },
}

/// The kind of a registered schema (`schemaType`; absent means Avro).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum SchemaType {
    /// Apache Avro (JSON schema text).
    Avro,
    /// Protocol Buffers (`.proto` text).
    Protobuf,
    /// JSON Schema.
    Json,
}

/// A reference from a schema to another registered schema (`references`): Avro named types defined in another
/// subject, Protobuf imports.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Reference {
    /// The name the referring schema uses (an Avro full name, a `.proto` import path).
    pub name: String,
    /// The subject holding the referenced schema.
    pub subject: String,
    /// Its version.
    pub version: i64,
}

/// A schema as the registry serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredSchema {
    /// Its id (what wire-format payloads carry).
    pub id: u32,
    /// Avro, Protobuf or JSON Schema.
    pub schema_type: SchemaType,
    /// The schema's text.
    pub text: String,
    /// The schemas it refers to.
    pub references: Vec<Reference>,
    /// For a subject's version: the subject and the version (`None` for a schema fetched by id).
    pub subject_version: Option<(String, i64)>,
}

#[derive(Deserialize)]
struct Body {
    schema: String,
    #[serde(rename = "schemaType")]
    schema_type: Option<SchemaType>,
    #[serde(default)]
    references: Vec<Reference>,
    id: Option<u32>,
    subject: Option<String>,
    version: Option<i64>,
}

#[derive(Deserialize)]
struct ErrorBody {
    error_code: Option<i64>,
}

/// Error codes of a 404 that mean "no such schema, subject or version".
const NOT_FOUND_CODES: [i64; 3] = [40401, 40402, 40403];

enum Auth {
    None,
    Basic(String, Option<String>),
    Bearer(String),
}

/// A client of one registry. Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct SchemaRegistry {
    client: reqwest::Client,
    base: reqwest::Url,
    /// The URL without credentials, for messages.
    shown: String,
    auth: std::sync::Arc<Auth>,
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaRegistry").field("url", &self.shown).finish()
    }
}

impl SchemaRegistry {
    /// A client for `settings`.
    ///
    /// Errors: a URL that does not parse or is not http(s), `bearer_token` with basic credentials, a `ca_file` that
    /// cannot be read or holds no certificate.
    pub fn new(settings: &RegistrySettings) -> Result<SchemaRegistry, String> {
        crate::install_tls_provider();
        let mut base = reqwest::Url::parse(settings.url.expose()).map_err(|e| format!("url: not a URL: {e}"))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(format!("url: {:?} is not http or https", base.scheme()));
        }
        let in_url = (!base.username().is_empty()).then(|| {
            let user = percent_decoded(base.username());
            (user, base.password().map(percent_decoded))
        });
        let _ = base.set_username("");
        let _ = base.set_password(None);
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let shown = base.as_str().trim_end_matches('/').to_owned();
        let auth = match (in_url, &settings.username, &settings.bearer_token) {
            (Some(_), Some(_), _) => return Err("url holds credentials and username is set too: give them once".to_owned()),
            (Some(_), _, Some(_)) | (None, Some(_), Some(_)) => {
                return Err("bearer_token and basic credentials (username, or a user in url) are both set: choose one".to_owned())
            }
            (Some((user, password)), None, None) => Auth::Basic(user, password.or_else(|| settings.password.as_ref().map(|p| p.expose().to_owned()))),
            (None, Some(user), None) => Auth::Basic(user.clone(), settings.password.as_ref().map(|p| p.expose().to_owned())),
            (None, None, Some(token)) => Auth::Bearer(token.expose().to_owned()),
            (None, None, None) if settings.password.is_some() => return Err("password is set without username".to_owned()),
            (None, None, None) => Auth::None,
        };
        let mut builder = reqwest::Client::builder()
            .timeout(settings.timeout)
            .connect_timeout(settings.connect_timeout)
            .no_proxy()
            .user_agent(concat!("idemflow/", env!("CARGO_PKG_VERSION")));
        if let Some(path) = &settings.ca_file {
            let pem = std::fs::read(path).map_err(|e| format!("ca_file: cannot read {}: {e}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| format!("ca_file: {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!("ca_file: {} holds no PEM certificate", path.display()));
            }
            builder = builder.tls_certs_merge(certs);
        }
        let client = builder.build().map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(SchemaRegistry { client, base, shown, auth: std::sync::Arc::new(auth) })
    }

    /// The registry's URL, without credentials.
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// The schema registered with `id` (`GET /schemas/ids/{id}`), `None` when the registry has no such id.
    ///
    /// Errors: see the module documentation.
    pub async fn schema(&self, id: u32) -> Result<Option<RegisteredSchema>, RegistryError> {
        let got = self.get(&format!("schemas/ids/{id}")).await?;
        Ok(got.map(|b| RegisteredSchema {
            id,
            schema_type: b.schema_type.unwrap_or(SchemaType::Avro),
            text: b.schema,
            references: b.references,
            subject_version: None,
        }))
    }

    /// The latest version registered under `subject`, `None` when there is no such subject.
    ///
    /// Errors: see the module documentation.
    pub async fn latest(&self, subject: &str) -> Result<Option<RegisteredSchema>, RegistryError> {
        self.version(subject, None).await
    }

    /// Version `version` of `subject` (the latest for `None`), `None` when there is no such subject or version.
    ///
    /// Errors: see the module documentation.
    pub async fn version(&self, subject: &str, version: Option<i64>) -> Result<Option<RegisteredSchema>, RegistryError> {
        let v = version.map_or_else(|| "latest".to_owned(), |v| v.to_string());
        let path = format!("subjects/{}/versions/{v}", url::form_urlencoded::byte_serialize(subject.as_bytes()).collect::<String>());
        let got = self.get(&path).await?;
        Ok(got.map(|b| RegisteredSchema {
            id: b.id.unwrap_or_default(),
            schema_type: b.schema_type.unwrap_or(SchemaType::Avro),
            text: b.schema,
            references: b.references,
            subject_version: Some((b.subject.unwrap_or_else(|| subject.to_owned()), b.version.unwrap_or_default())),
        }))
    }

    async fn get(&self, path: &str) -> Result<Option<Body>, RegistryError> {
        let unavailable = |why: String| RegistryError::Unavailable { url: self.shown.clone(), why };
        let url = self.base.join(path).map_err(|e| unavailable(format!("{path}: {e}")))?;
        let mut request = self.client.get(url).header(reqwest::header::ACCEPT, "application/vnd.schemaregistry.v1+json, application/json");
        request = match &*self.auth {
            Auth::None => request,
            Auth::Basic(user, password) => request.basic_auth(user, password.as_deref()),
            Auth::Bearer(token) => request.bearer_auth(token),
        };
        let response = request.send().await.map_err(|e| unavailable(describe(&e)))?;
        let status = response.status();
        let body = response.bytes().await.map_err(|e| unavailable(describe(&e)))?;
        match status.as_u16() {
            200..=299 => serde_json::from_slice(&body).map(Some).map_err(|e| unavailable(format!("GET {path}: the answer is not a schema: {e}"))),
            401 | 403 => Err(RegistryError::Refused { url: self.shown.clone(), status: status.as_u16() }),
            404 => match serde_json::from_slice::<ErrorBody>(&body) {
                Ok(ErrorBody { error_code: Some(code) }) if NOT_FOUND_CODES.contains(&code) => Ok(None),
                // A 404 without the registry's error code: a wrong URL (a proxy's page), not an answer.
                _ => Err(unavailable(format!("GET {path}: 404 without a registry error code (is url the registry's?)"))),
            },
            code => Err(unavailable(format!("GET {path}: HTTP {code}"))),
        }
    }
}

/// A reqwest error without its URL (which may carry credentials), with its causes.
fn describe(e: &reqwest::Error) -> String {
    let mut text = if e.is_timeout() { "timed out".to_owned() } else if e.is_connect() { "cannot connect".to_owned() } else { "request failed".to_owned() };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn percent_decoded(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes()).next().map(|(_, v)| v.into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str) -> RegistrySettings {
        RegistrySettings {
            url: SecretUrl::from(url.to_owned()),
            username: None,
            password: None,
            bearer_token: None,
            ca_file: None,
            timeout: default_timeout(),
            connect_timeout: default_connect_timeout(),
        }
    }

    #[test]
    fn credentials_in_the_url_are_basic_authentication_and_never_shown() {
        let r = SchemaRegistry::new(&settings("https://key:s%3Acret@registry.example:8081/prefix")).unwrap();
        assert_eq!(r.url(), "https://registry.example:8081/prefix");
        assert!(matches!(&*r.auth, Auth::Basic(u, Some(p)) if u == "key" && p == "s:cret"));
        assert!(!format!("{r:?}").contains("cret"));
    }

    #[test]
    fn conflicting_credentials_and_bad_urls_are_refused() {
        let mut s = settings("http://u:p@localhost:8081");
        s.bearer_token = Some(serde_json::from_str("\"t\"").unwrap());
        assert!(SchemaRegistry::new(&s).unwrap_err().contains("choose one"));
        assert!(SchemaRegistry::new(&settings("ftp://x")).unwrap_err().contains("not http"));
        let mut s = settings("http://localhost:8081");
        s.password = Some(serde_json::from_str("\"p\"").unwrap());
        assert!(SchemaRegistry::new(&s).unwrap_err().contains("without username"));
    }
}
