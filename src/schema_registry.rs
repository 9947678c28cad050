//! The schema registry client: the REST API of Confluent's Schema Registry (also served by Apicurio's and
//! Karapace's compatibility layers, and by Redpanda), as the Confluent serializers use it. Payloads in the Confluent
//! wire format carry a schema id; [`SchemaRegistry::schema`] fetches the schema of an id (`GET /schemas/ids/{id}`),
//! [`SchemaRegistry::latest`] a subject's current version (`GET /subjects/{subject}/versions/latest`, for `check`),
//! and [`SchemaRegistry::version`] a referenced schema. Ids never change meaning, so callers cache what they get by
//! id ([`crate::decode::schemas::Schemas`]); this module keeps nothing.
//!
//! Every request is bounded by `[schema_registry] timeout` (the whole exchange) and `connect_timeout`; it follows
//! redirects only within the registry's origin, at most [`MAX_REDIRECTS`], and reads at most 16 MiB of an answer. A registry
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
    /// How long a schema id the registry does not know (or a schema it references) is waited on, the pipeline
    /// paused and the registry asked again, before its records go to the dead letters (default 60 s; `"0s"`: at
    /// once). A registry follower that has not caught up with a new schema yet, or one being restored, is waited
    /// out; a payload naming an id no registry has costs this wait once.
    #[serde(default = "default_missing_schema_wait", with = "humantime_serde")]
    pub missing_schema_wait: Duration,
}

fn default_missing_schema_wait() -> Duration {
    Duration::from_secs(60)
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
    /// The registry does not know a schema id (or a schema it refers to) yet: waited on for
    /// `missing_schema_wait` ([`crate::decode::schemas`]).
    #[error("{why}: waiting for it up to [schema_registry] missing_schema_wait = {} before dead-lettering its records", humantime::format_duration(*wait))]
    Missing {
        /// What is missing, and where.
        why: String,
        /// `missing_schema_wait`.
        wait: Duration,
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SchemaType {
    /// Apache Avro (JSON schema text).
    Avro,
    /// Protocol Buffers (`.proto` text).
    Protobuf,
    /// JSON Schema.
    Json,
    /// A type this client does not know (a registry's extension): its schemas are not read.
    Other(String),
}

impl<'de> Deserialize<'de> for SchemaType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match String::deserialize(d)?.as_str() {
            "AVRO" => SchemaType::Avro,
            "PROTOBUF" => SchemaType::Protobuf,
            "JSON" => SchemaType::Json,
            other => SchemaType::Other(other.to_owned()),
        })
    }
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

/// The largest answer read (a schema with its text): a URL that serves something else is not read whole.
const MAX_BODY_BYTES: usize = 16 << 20;

/// What is escaped in a path segment (a subject): all but RFC 3986's unreserved characters.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

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
        // Without the query (which may carry a token) in messages.
        let mut without_query = base.clone();
        without_query.set_query(None);
        let shown = without_query.as_str().trim_end_matches('/').to_owned();
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
            .redirect(same_origin_redirects())
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
        // A referenced version is read even when soft-deleted since (as Confluent's clients read it): the schemas
        // referring to it still need it.
        let v = version.map_or_else(|| "latest".to_owned(), |v| format!("{v}?deleted=true"));
        let path = format!("subjects/{}/versions/{v}", percent_encoding::utf8_percent_encode(subject, SEGMENT));
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
        let mut response = request.send().await.map_err(|e| unavailable(describe(&e)))?;
        let status = response.status();
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| unavailable(describe(&e)))? {
            if body.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(unavailable(format!("GET {path}: an answer of more than {MAX_BODY_BYTES} bytes (is url the registry's?)")));
            }
            body.extend_from_slice(&chunk);
        }
        match status.as_u16() {
            200..=299 => serde_json::from_slice(&body).map(Some).map_err(|e| unavailable(format!("GET {path}: the answer is not a schema: {e}"))),
            401 | 403 => Err(RegistryError::Refused { url: self.shown.clone(), status: status.as_u16() }),
            404 => match serde_json::from_slice::<ErrorBody>(&body) {
                Ok(ErrorBody { error_code: Some(code) }) if NOT_FOUND_CODES.contains(&code) => Ok(None),
                // A 404 without the registry's error code: a wrong URL (a proxy's page), not an answer.
                _ => Err(unavailable(format!("GET {path}: 404 without a registry error code (is url the registry's?)"))),
            },
            code @ 300..=399 => Err(unavailable(format!(
                "GET {path}: HTTP {code}: a redirect to another origin (or a fourth one) is not followed; set url to the registry's own"
            ))),
            code => Err(unavailable(format!("GET {path}: HTTP {code}"))),
        }
    }
}

/// The most redirects one request follows.
pub const MAX_REDIRECTS: usize = 3;

/// Redirects followed only within the registry's origin (the same scheme, host and port: a load balancer's path
/// rewrite), at most [`MAX_REDIRECTS`]: a registry that is compromised or spoofed cannot send the worker's requests,
/// and its credentials, elsewhere (https to http included). Any other redirect is the answer, and the registry is
/// unavailable until `url` is corrected.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let first = attempt.previous().first().map(reqwest::Url::origin);
        if attempt.previous().len() > MAX_REDIRECTS || first.is_none_or(|o| o != attempt.url().origin()) {
            attempt.stop()
        } else {
            attempt.follow()
        }
    })
}

/// A reqwest error without its URL (which may carry credentials), with its causes (the outbox's deliveries say
/// theirs so too).
pub fn describe(e: &reqwest::Error) -> String {
    let mut text = if e.is_timeout() { "timed out".to_owned() } else if e.is_connect() { "cannot connect".to_owned() } else { "request failed".to_owned() };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A URL's user or password as written (`%2B` is `+`, and `+` stays `+`).
fn percent_decoded(s: &str) -> String {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
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
            missing_schema_wait: default_missing_schema_wait(),
        }
    }

    #[test]
    fn credentials_in_the_url_are_basic_authentication_and_never_shown() {
        let r = SchemaRegistry::new(&settings("https://key:s%3Ac+ret@registry.example:8081/prefix?token=x")).unwrap();
        assert_eq!(r.url(), "https://registry.example:8081/prefix");
        assert!(matches!(&*r.auth, Auth::Basic(u, Some(p)) if u == "key" && p == "s:c+ret"));
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
