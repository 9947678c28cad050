//! One record's outbox requests, rendered when the record is prepared ([`crate::prepare`]): a value that cannot go
//! where its template puts it (a null in a URL, a line break in a header) makes the record a `param_invalid` dead
//! letter before any transaction, as a value its column refuses does.

use super::guard::{check_literal, dot_segment};
use super::spec::{Body, HttpTarget, JsonTemplate, KafkaTarget, OutboxSpec, SecretRef};
use crate::key::BusinessKey;
use crate::store::redis_command::{Arg, Piece};
use crate::store::rows::OutboxRequest;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::Value;

/// What a URL placeholder's value keeps as it is: RFC 3986's unreserved characters; everything else is
/// percent-encoded, so a value is one path segment or query value whatever it holds.
const URL_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The idempotency key of a business key's request to `target`: `<prefix>:<business key>`, or
/// `<prefix>:<business key>:<target>` in a pipeline with several targets (`prefix`: `[outbox] key_prefix`, by
/// default the pipeline's name) (two requests of one operation to the same
/// service must not share a key: the second would be answered from the first's record). The same on every attempt and
/// in every worker (IETF httpapi draft "The Idempotency-Key HTTP Header Field", section 2: a unique key per
/// operation, chosen by the client).
///
/// The business key goes in as [`key_in_header`] writes it, so that two keys are two idempotency keys whatever a
/// header does to its value on the way.
pub fn idempotency_key(prefix: &str, key: &BusinessKey, target: Option<&str>) -> String {
    let key = key_in_header(&key.text);
    match target {
        Some(t) => format!("{prefix}:{key}:{t}"),
        None => format!("{prefix}:{key}"),
    }
}

/// What is percent-encoded of a business key in an idempotency key: every byte outside visible ASCII, and `%`.
const KEY_IN_HEADER: &AsciiSet = &percent_encoding::CONTROLS.add(b' ').add(b'%').add(0x7f);

/// A business key as an idempotency key carries it: space, tab, control characters, non-ASCII letters (UTF-8) and
/// `%` percent-encoded, every other character as it is (a key of visible ASCII without `%` is unchanged). HTTP
/// servers strip blanks at a field value's edges (RFC 9110, section 5.5) and may refuse or mangle bytes outside
/// ASCII: written verbatim, `A-1` and `A-1 ` reached a target as one key, and the second charge was answered from the
/// first's record. Encoded, every key reaches the target as itself, and no key is refused for its characters.
pub fn key_in_header(key: &str) -> std::borrow::Cow<'_, str> {
    utf8_percent_encode(key, KEY_IN_HEADER).into()
}

impl OutboxSpec {
    /// The requests of one record: `values` holds one JSON text per [`OutboxSpec::params`] entry (`None`: null),
    /// `payload` is the record's value (the body where a request has none of its own).
    ///
    /// Errors: which value cannot be used, and where.
    pub fn render(&self, pipeline: &str, key: &BusinessKey, payload: &[u8], values: &[Option<String>]) -> Result<Vec<OutboxRequest>, String> {
        let lookup = |name: &str| -> Option<&Option<String>> { self.params.iter().position(|b| b.name == name).and_then(|i| values.get(i)) };
        let several = self.http.len() + self.kafka.len() > 1;
        let prefix = self.key_prefix.as_deref().unwrap_or(pipeline);
        let requests = self.http.iter().map(|t| render_one(t, prefix, key, several, payload, &lookup));
        requests.chain(self.kafka.iter().map(|t| render_record(t, prefix, key, several, payload, &lookup))).collect()
    }
}

/// A Kafka record of `[[sink.kafka]]`: method [`crate::store::rows::PRODUCE`], the topic as its URL.
fn render_record<'v>(
    t: &KafkaTarget,
    prefix: &str,
    key: &BusinessKey,
    several: bool,
    payload: &[u8],
    lookup: &dyn Fn(&str) -> Option<&'v Option<String>>,
) -> Result<OutboxRequest, String> {
    let topic = text(&t.topic, lookup, &str::to_owned).map_err(|e| format!("sink.kafka {} topic: {e}", t.name))?;
    if !super::spec::kafka_topic(&topic) {
        return Err(format!("sink.kafka {} topic: {topic:?} is not a Kafka topic name", t.name));
    }
    if t.topics.as_ref().is_some_and(|rule| !rule.allows(&topic)) {
        return Err(format!("sink.kafka {} topic: {topic:?} is not one of allow_topics", t.name));
    }
    let record_key = match &t.key {
        Some(template) => text(template, lookup, &str::to_owned).map_err(|e| format!("sink.kafka {} key: {e}", t.name))?,
        None => key.text.clone(),
    };
    let what = format!("sink.kafka {}", t.name);
    let mut headers = vec![(t.idempotency_header.clone(), idempotency_key(prefix, key, several.then_some(t.name.as_str())))];
    headers.extend(templated_headers(&t.headers, lookup, &what)?);
    let value = body(&t.value, payload, lookup, &format!("{what} value"))?;
    check_secret_markers(&t.value, &value, &what)?;
    Ok(OutboxRequest { target: t.name.clone(), method: crate::store::rows::PRODUCE.to_owned(), url: topic, headers, body: value, key: Some(record_key.into_bytes()) })
}

fn render_one<'v>(
    t: &HttpTarget,
    prefix: &str,
    key: &BusinessKey,
    several: bool,
    payload: &[u8],
    lookup: &dyn Fn(&str) -> Option<&'v Option<String>>,
) -> Result<OutboxRequest, String> {
    let url = rendered_url(t, lookup).map_err(|e| format!("sink.http {} url: {e}", t.name))?;
    let mut headers = Vec::with_capacity(t.headers.len() + 2);
    let idempotency = idempotency_key(prefix, key, several.then_some(t.name.as_str()));
    if !header_value(&idempotency) {
        return Err(format!(
            "the business key cannot be sent as the {} header: it holds a control character (a line break, NUL)",
            t.idempotency_header
        ));
    }
    headers.push((t.idempotency_header.clone(), idempotency));
    headers.push(("Content-Type".to_owned(), t.content_type.clone()));
    let what = format!("sink.http {}", t.name);
    headers.extend(templated_headers(&t.headers, lookup, &what)?);
    let body = body(&t.body, payload, lookup, &format!("{what} body"))?;
    check_secret_markers(&t.body, &body, &what)?;
    Ok(OutboxRequest { target: t.name.clone(), method: t.method.clone(), url, headers, body, key: None })
}

/// The URL of `t` with a record's values, checked: a value that is a whole path segment is one segment (not empty,
/// not a dot segment), the path keeps the template's segments, and a host from the values is one of `allow_hosts`
/// (and, as an IP literal, public unless `allow_private_addresses`). A secret URL renders as its marker.
///
/// Errors: what the values would change, without them.
fn rendered_url<'v>(t: &HttpTarget, lookup: &dyn Fn(&str) -> Option<&'v Option<String>>) -> Result<String, String> {
    let mut url = String::new();
    let mut in_path = true;
    for piece in &t.url.0 {
        match piece {
            Piece::Text(text) => {
                url.push_str(text);
                in_path &= !text.contains(['?', '#']);
            }
            Piece::Param(name) => {
                let Some(Some(v)) = lookup(name) else { return Err(format!("{{{name}}} is null, and text cannot hold a null")) };
                let value = as_text(v);
                // A value in the path never names a dot segment, not even one a server finds after decoding %2F or
                // a backslash (`../../admin` is one segment to the URL parser, three to such a server).
                if in_path && dotty(&value) {
                    return Err(format!("{{{name}}} is not one path segment: it is '.' or '..', or holds one between slashes"));
                }
                url.push_str(&utf8_percent_encode(&value, URL_VALUE).to_string());
            }
        }
    }
    if t.secret_url.is_some() {
        return Ok(url);
    }
    let parsed = url::Url::parse(&url).map_err(|e| format!("the values make it no URL: {e}"))?;
    if let Some(shape) = &t.path {
        shape.check(&parsed)?;
    }
    if let Some(hosts) = &t.hosts {
        check_host(&parsed, hosts, t.private_addresses)?;
    }
    Ok(url)
}

/// Whether a value in a URL's path is, or holds between slashes or backslashes, a dot segment (`.`, `..`, or their
/// percent-encoded forms: [`dot_segment`]). An empty value is left to the path's shape ([`super::guard::PathShape`]):
/// glued to text it is harmless.
fn dotty(value: &str) -> bool {
    value.split(['/', '\\']).any(|piece| !piece.is_empty() && dot_segment(piece))
}

/// A host a record's values chose: one of `hosts`, and an IP literal public unless `private_ok`.
///
/// Errors: why it is refused.
pub fn check_host(url: &url::Url, hosts: &super::guard::HostRule, private_ok: bool) -> Result<(), String> {
    let host = url.host().ok_or("the values leave the URL without a host")?;
    let name = url.host_str().unwrap_or_default();
    if !hosts.allows(name) {
        return Err(format!("the host {name:?} is not one of allow_hosts"));
    }
    check_literal(&host, private_ok)
}

/// The text that stands in a stored body for its `n`th secret ([`JsonTemplate::Secret`]), put back with the value
/// when the request is sent ([`with_secrets`]).
fn secret_marker(n: usize) -> String {
    format!("\u{0}idemflow-secret-{n}\u{0}")
}

/// A rendered body (or a payload) holds each of its template's secret markers once, and no other: a record's value
/// that holds a marker's text (it would be replaced by a secret when sent, under this template or a later one) is
/// refused, whether JSON-escaped or raw.
fn check_secret_markers(template: &Body, rendered: &[u8], what: &str) -> Result<(), String> {
    let wanted = match template {
        Body::Json(t) => t.secrets().len(),
        Body::Payload => 0,
    };
    if markers(rendered) != wanted {
        return Err(format!("{what}: a value holds the text idemflow marks a secret's place with (a NUL, then idemflow-secret-)"));
    }
    Ok(())
}

/// How many secret markers `body` holds, JSON-escaped or raw.
fn markers(body: &[u8]) -> usize {
    let count = |needle: &[u8]| body.windows(needle.len()).filter(|w| *w == needle).count();
    count(b"\\u0000idemflow-secret-") + count(b"\0idemflow-secret-")
}

/// Whether a stored body (a Kafka record's value) fits the target's body as configured now: it holds exactly the
/// secret markers the template has (none for a template without secrets). A body written under another template is
/// rejected, never filled with today's secrets.
///
/// Errors: why it does not fit (permanent: the row is dead-lettered).
pub fn fits(template: &Body, stored: &[u8]) -> Result<(), String> {
    let wanted = match template {
        Body::Json(t) => t.secrets().len(),
        Body::Payload => 0,
    };
    let found = markers(stored);
    if found != wanted {
        return Err(format!(
            "its body was written for another configuration ({found} secret place(s), the target's body has {wanted}): not sent with today's secrets"
        ));
    }
    Ok(())
}

/// A stored body (a Kafka record's value) with its secrets' markers replaced by their values, read now
/// (`template` is the target's body as configured now; [`fits`] first).
///
/// Errors: a secret cannot be read (named, never a value), or a marker is missing.
pub fn with_secrets(template: &Body, stored: &[u8]) -> Result<Vec<u8>, String> {
    let Body::Json(t) = template else { return Ok(stored.to_vec()) };
    let secrets: Vec<&SecretRef> = t.secrets();
    if secrets.is_empty() {
        return Ok(stored.to_vec());
    }
    let mut text = String::from_utf8(stored.to_vec()).map_err(|_| "the stored body is not UTF-8 (written for another configuration)".to_owned())?;
    for (n, secret) in secrets.iter().enumerate() {
        let marker = serde_json::to_string(&secret_marker(n)).expect("a string serializes");
        if !text.contains(&marker) {
            return Err(format!("the stored body has no place for the secret of {} (written under another configuration)", secret.describe()));
        }
        let value = serde_json::to_string(&secret.resolve()?).expect("a string serializes");
        text = text.replacen(&marker, &value, 1);
    }
    Ok(text.into_bytes())
}

/// The headers of `headers` with placeholders, rendered; those without (a credential) are the target's, added when
/// sent: a rotated credential reaches the rows already waiting, and no row or dead letter keeps it. `what` names the
/// target in errors.
fn templated_headers<'v>(headers: &[(String, Arg)], lookup: &dyn Fn(&str) -> Option<&'v Option<String>>, what: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (name, template) in headers.iter().filter(|(_, a)| a.literal().is_none()) {
        let value = text(template, lookup, &str::to_owned).map_err(|e| format!("{what} header {name}: {e}"))?;
        if !header_value(&value) {
            return Err(format!("{what} header {name}: the value holds a control character (a line break, NUL)"));
        }
        out.push((name.clone(), value));
    }
    Ok(out)
}

/// A body (a Kafka record's value): the record's payload, or the JSON template rendered.
fn body<'v>(body: &Body, payload: &[u8], lookup: &dyn Fn(&str) -> Option<&'v Option<String>>, what: &str) -> Result<Vec<u8>, String> {
    Ok(match body {
        Body::Payload => payload.to_vec(),
        Body::Json(template) => json(template, lookup).map_err(|e| format!("{what}: {e}"))?.to_string().into_bytes(),
    })
}

/// A value as text: a JSON string's contents, any other JSON as written.
fn as_text(json: &str) -> String {
    match serde_json::from_str::<Value>(json) {
        Ok(Value::String(s)) => s,
        _ => json.to_owned(),
    }
}

fn text<'v>(arg: &Arg, lookup: &dyn Fn(&str) -> Option<&'v Option<String>>, encode: &dyn Fn(&str) -> String) -> Result<String, String> {
    let mut out = String::new();
    for piece in &arg.0 {
        match piece {
            Piece::Text(t) => out.push_str(t),
            Piece::Param(name) => match lookup(name) {
                Some(Some(v)) => out.push_str(&encode(&as_text(v))),
                _ => return Err(format!("{{{name}}} is null, and text cannot hold a null")),
            },
        }
    }
    Ok(out)
}

fn json<'v>(t: &JsonTemplate, lookup: &dyn Fn(&str) -> Option<&'v Option<String>>) -> Result<Value, String> {
    let mut secrets = 0;
    json_numbered(t, lookup, &mut secrets)
}

/// [`json`], numbering the secrets' markers in order from `*secrets`.
fn json_numbered<'v>(t: &JsonTemplate, lookup: &dyn Fn(&str) -> Option<&'v Option<String>>, secrets: &mut usize) -> Result<Value, String> {
    Ok(match t {
        JsonTemplate::Literal(v) => v.clone(),
        JsonTemplate::Typed(name, ty) => {
            let value = match lookup(name) {
                Some(Some(v)) => serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.clone())),
                _ => Value::Null,
            };
            ty.convert(value).map_err(|why| format!("{{{name}:{}}} {why}", ty.name()))?
        }
        JsonTemplate::Secret(_) => {
            *secrets += 1;
            Value::String(secret_marker(*secrets - 1))
        }
        JsonTemplate::Value(name) => match lookup(name) {
            // A value not written as JSON (a default, meta text) goes as a string.
            Some(Some(v)) => serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.clone())),
            _ => Value::Null,
        },
        JsonTemplate::Text(arg) => Value::String(text(arg, lookup, &str::to_owned)?),
        JsonTemplate::Array(items) => Value::Array(items.iter().map(|i| json_numbered(i, lookup, secrets)).collect::<Result<_, _>>()?),
        JsonTemplate::Object(members) => {
            Value::Object(members.iter().map(|(k, v)| json_numbered(v, lookup, secrets).map(|v| (k.clone(), v))).collect::<Result<_, _>>()?)
        }
    })
}

/// Whether `value` can be a header value: no control characters but tab (RFC 9110 `field-value`).
fn header_value(value: &str) -> bool {
    !value.chars().any(|c| c.is_control() && c != '\t')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that differ only in blanks at their edges, or in letters outside ASCII, stay distinct idempotency keys,
    /// each a valid header value; plain keys are unchanged.
    #[test]
    fn idempotency_keys_survive_a_header_verbatim() {
        assert_eq!(key_in_header("ORD-1_a.b:c"), "ORD-1_a.b:c");
        assert_eq!(key_in_header("A-1 "), "A-1%20");
        assert_eq!(key_in_header(" A-1"), "%20A-1");
        assert_eq!(key_in_header("A%20-1"), "A%2520-1");
        assert_eq!(key_in_header("张三"), "%E5%BC%A0%E4%B8%89");
        assert_eq!(key_in_header("a\tb\nc"), "a%09b%0Ac");
        for k in ["A-1", "A-1 ", " A-1", "A-1\t", "张三"] {
            assert!(reqwest::header::HeaderValue::from_str(&key_in_header(k)).is_ok(), "{k:?}");
        }
    }
    use crate::outbox::spec::{parse, OneOrMany, RawHttp, RawOutbox};
    use crate::store::spec::{Binding, ValueSource};

    fn spec(toml_text: &str, names: &[&str]) -> OutboxSpec {
        #[derive(serde::Deserialize)]
        struct Doc {
            http: OneOrMany<RawHttp>,
        }
        struct Panic;
        impl crate::validate::Problems for Panic {
            fn push(&mut self, field: &str, message: impl Into<String>) {
                panic!("{field}: {}", message.into());
            }
            fn count(&self) -> usize {
                0
            }
        }
        let params: Vec<Binding> = names
            .iter()
            .map(|n| Binding {
                name: (*n).into(),
                source: ValueSource::Field(crate::field::FieldPath::parse(&format!("/{n}")).unwrap()),
                default: None,
                optional: true,
                declared: None,
                type_name: None,
                round: false,
                limit: None,
                target_type: None,
            })
            .collect();
        parse(toml::from_str::<Doc>(toml_text).unwrap().http.into_vec(), Vec::new(), &params, RawOutbox::default(), &mut Panic).unwrap()
    }

    /// A value alone in a body string keeps its JSON type; in text it is its text; in a URL it is percent-encoded;
    /// the idempotency key is `<pipeline>:<business key>`; a null where text goes, or a line break in a header,
    /// is refused.
    #[test]
    fn values_go_where_their_templates_put_them() {
        let s = spec(
            "[http]\nurl = \"http://h/a/{account}?n={n}\"\nheaders = { X-Note = \"n={n}\" }\nbody = { amount = \"{amount}\", who = \"acct {account}\", list = [\"{n}\", 1] }\n",
            &["account", "amount", "n"],
        );
        let key = BusinessKey::new("order-1".into());
        let values = [Some("\"a/b c\"".to_owned()), Some("12.50".to_owned()), Some("7".to_owned())];
        let r = &s.render("payments", &key, b"{}", &values).unwrap()[0];
        assert_eq!(r.url, "http://h/a/a%2Fb%20c?n=7");
        assert_eq!(r.headers[0], ("Idempotency-Key".to_owned(), "payments:order-1".to_owned()));
        assert!(r.headers.contains(&("X-Note".to_owned(), "n=7".to_owned())));
        assert_eq!(String::from_utf8_lossy(&r.body), r#"{"amount":12.50,"list":[7,1],"who":"acct a/b c"}"#, "the number exactly as sent");
        let e = s.render("payments", &key, b"{}", &[None, Some("1".into()), Some("1".into())]).unwrap_err();
        assert!(e.contains("{account} is null"), "{e}");
        let e = s.render("payments", &key, b"{}", &[Some("\"x\"".into()), Some("1".into()), Some("\"a\\nb\"".into())]).unwrap_err();
        assert!(e.contains("header X-Note") && e.contains("control character"), "{e}");
        let payload = spec("[http]\nurl = \"http://h/\"\n", &[]);
        assert_eq!(payload.render("p", &key, b"raw bytes", &[]).unwrap()[0].body, b"raw bytes");
        // `[outbox] key_prefix` takes the pipeline's place in the key.
        let kept = OutboxSpec { key_prefix: Some("refunds".into()), ..payload };
        assert_eq!(kept.render("refunds-v2", &key, b"{}", &[]).unwrap()[0].headers[0].1, "refunds:order-1");
    }

    /// A record's value never plants a secret's marker: not in a templated body, not in a payload sent as it is; a
    /// stored body must hold exactly the markers of the target's body now, or it is rejected, never filled with a
    /// secret; a path value holding a dot segment between slashes is refused, a plain one with a slash is encoded.
    #[test]
    fn a_record_plants_no_secret_marker_and_moves_no_path_segment() {
        std::env::set_var("IDEMFLOW_RENDER_TEST_KEY", "k-123");
        let s = spec("[http]\nurl = \"http://h/a/{account}\"\nbody = { note = \"{note}\", key = { env = \"IDEMFLOW_RENDER_TEST_KEY\" } }\n", &["account", "note"]);
        let key = BusinessKey::new("order-1".into());
        let render = |account: &str, note: &str| s.render("p", &key, b"{}", &[Some(serde_json::to_string(account).unwrap()), Some(serde_json::to_string(note).unwrap())]);
        let ok = &render("acct-1", "hello").unwrap()[0];
        assert!(fits(&s.http[0].body, &ok.body).is_ok());
        let sent = String::from_utf8(with_secrets(&s.http[0].body, &ok.body).unwrap()).unwrap();
        assert!(sent.contains("\"key\":\"k-123\"") && !String::from_utf8_lossy(&ok.body).contains("k-123"), "{sent}");
        let planted = render("acct-1", "\u{0}idemflow-secret-0\u{0}").unwrap_err();
        assert!(planted.contains("marks a secret's place"), "{planted}");
        let payload = spec("[http]\nurl = \"http://h/\"\n", &[]);
        assert!(payload.render("p", &key, b"{\"x\":\"\\u0000idemflow-secret-0\\u0000\"}", &[]).is_err());
        // A body stored under a template without secrets does not fit one with a secret.
        assert!(fits(&s.http[0].body, b"{\"note\":\"hi\"}").unwrap_err().contains("another configuration"));
        for bad in ["..", ".", "../../admin", "a/../b", "..\\x", "%2e%2E"] {
            assert!(render(bad, "n").is_err(), "{bad}");
        }
        assert!(render("a/b", "n").unwrap()[0].url.ends_with("/a/a%2Fb"));
    }
}
