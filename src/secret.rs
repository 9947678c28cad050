//! Keeping credentials out of everything idemflow prints: URLs with their passwords masked, and configuration
//! errors that name a key without echoing its value.

use serde::Deserialize;
use std::fmt;

/// Query parameters of a connection URL whose value is a credential (libpq's `password` and `sslpassword`, and the
/// forms other drivers accept: `pass`, `secret`, `token`, `auth`...): any name containing one of these.
const SECRET_PARAMETERS: [&str; 5] = ["pass", "secret", "token", "auth", "credential"];

/// `url` with every credential replaced by `***`: the password of the user information (`scheme://user:***@host`,
/// also `redis://:***@host`), and the value of every query parameter named like a credential
/// (`?password=***`, `sslpassword=***`). Works for every scheme idemflow connects with (postgres, postgresql,
/// mysql, mariadb, amqp, amqps, redis, rediss). A string that is not a URL is masked as a libpq keyword/value
/// connection string (`password=***`). A comma-separated list of URLs (NATS's several servers) is masked URL by
/// URL.
pub fn mask_url(url: &str) -> String {
    if url.contains(',') && url.matches("://").count() > 1 {
        return url.split(',').map(|u| mask_url(u.trim())).collect::<Vec<_>>().join(",");
    }
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.has_host() || parsed.password().is_some() => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            if parsed.query().is_some() {
                let pairs: Vec<(String, String)> = parsed
                    .query_pairs()
                    .map(|(k, v)| {
                        let secret = is_secret_name(&k);
                        (k.into_owned(), if secret { "***".to_owned() } else { v.into_owned() })
                    })
                    .collect();
                parsed.query_pairs_mut().clear().extend_pairs(pairs);
            }
            parsed.to_string()
        }
        _ => mask_keywords(url),
    }
}

/// Whether a parameter or property name names a credential.
pub fn is_secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    SECRET_PARAMETERS.iter().any(|s| name.contains(s))
}

/// `key=value` pairs separated by whitespace (libpq's keyword/value form), with credential values masked.
fn mask_keywords(text: &str) -> String {
    text.split(' ')
        .map(|word| match word.split_once('=') {
            Some((k, _)) if is_secret_name(k) => format!("{k}=***"),
            _ => word.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every occurrence of `secret` in `text` replaced by `***` (for error texts of other libraries that may quote a
/// value). An empty `secret` changes nothing.
pub fn scrub(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        text.to_owned()
    } else {
        text.replace(secret, "***")
    }
}

/// The closest of `candidates` to `name` (Jaro-Winkler similarity at least 0.8), for "did you mean" hints.
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(name, c), c))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_credential_form_is_masked() {
        let cases = [
            ("postgres://u:s3cret@h:5432/db", "postgres://u:***@h:5432/db"),
            ("postgres://u@h/db?password=s3cret", "postgres://u@h/db?password=***"),
            ("postgresql://u@h/db?sslmode=require&sslpassword=s3cret", "postgresql://u@h/db?sslmode=require&sslpassword=***"),
            ("mysql://root:s3cret@db:3306/app", "mysql://root:***@db:3306/app"),
            ("amqps://guest:s3cret@mq/%2f", "amqps://guest:***@mq/%2f"),
            ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
            ("host=h user=u password=s3cret dbname=d", "host=h user=u password=*** dbname=d"),
            ("postgres://h/db", "postgres://h/db"),
            ("nats://u:s3cret@a:4222,nats://u:s3cret@b:4222", "nats://u:***@a:4222,nats://u:***@b:4222"),
        ];
        for (url, masked) in cases {
            assert_eq!(mask_url(url), masked, "{url}");
            assert!(!mask_url(url).contains("s3cret"));
        }
    }

    #[test]
    fn a_secret_given_as_a_number_or_a_boolean_is_its_text() {
        #[derive(Deserialize)]
        struct S {
            token: Secret,
        }
        for (toml, text) in [("token = 123456", "123456"), ("token = true", "true"), ("token = \"s3cret\"", "s3cret")] {
            let s: S = toml::from_str(toml).unwrap();
            assert_eq!(s.token.expose(), text);
        }
    }

    #[test]
    fn closest_suggests_a_near_name_only() {
        let names = ["sasl.password", "sasl.username", "session.timeout.ms"];
        assert_eq!(closest("sasl.pasword", names), Some("sasl.password"));
        assert_eq!(closest("zzz", names), None);
    }
}

/// A database URL whose `Debug` and `Display` hide the password.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL itself, to connect with. Do not log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for SecretUrl {
    fn from(url: String) -> Self {
        SecretUrl(url)
    }
}

impl SecretUrl {
    /// `text` (an error of another library, say) with this URL's credentials replaced by `***` (every URL's, for a
    /// comma-separated list).
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        let whole = std::iter::once(self.0.as_str());
        let parts = self.0.split(',').filter(|_| self.0.matches("://").count() > 1);
        for url in whole.chain(parts).filter_map(|u| url::Url::parse(u.trim()).ok()) {
            if let Some(password) = url.password() {
                out = scrub(&out, password);
                let decoded = url::form_urlencoded::parse(format!("p={password}").as_bytes()).next().map(|(_, v)| v.into_owned());
                out = scrub(&out, decoded.as_deref().unwrap_or_default());
            }
            for (k, v) in url.query_pairs() {
                if is_secret_name(&k) {
                    out = scrub(&out, &v);
                }
            }
        }
        out
    }
}

impl fmt::Display for SecretUrl {
    /// The URL with its credentials masked ([`mask_url`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&mask_url(&self.0))
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({self})")
    }
}

/// A credential read from the settings: `Debug` and `Display` print `***`. A value the environment gives as a
/// number or a boolean (`IDEMFLOW_NATS__TOKEN=123456`: figment reads such a variable as a number) is taken as its
/// text.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = String;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
                Ok(v.to_owned())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<String, E> {
                Ok(v.to_string())
            }
        }
        d.deserialize_any(Text).map(Secret)
    }
}

impl Secret {
    /// The credential itself, for the client that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}
