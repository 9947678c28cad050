//! One record's outbox requests, rendered when the record is prepared ([`crate::prepare`]): a value that cannot go
//! where its template puts it (a null in a URL, a line break in a header) makes the record a `param_invalid` dead
//! letter before any transaction, as a value its column refuses does.

use super::spec::{Body, HttpTarget, JsonTemplate, KafkaTarget, OutboxSpec};
use crate::key::BusinessKey;
use crate::store::redis_command::{Arg, Piece};
use crate::store::rows::OutboxRequest;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::Value;

/// What a URL placeholder's value keeps as it is: RFC 3986's unreserved characters; everything else is
/// percent-encoded, so a value is one path segment or query value whatever it holds.
const URL_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The idempotency key of a business key's request to `target`: `<pipeline>:<business key>`, or
/// `<pipeline>:<business key>:<target>` in a pipeline with several targets (two requests of one operation to the same
/// service must not share a key: the second would be answered from the first's record). The same on every attempt and
/// in every worker (IETF httpapi draft "The Idempotency-Key HTTP Header Field", section 2: a unique key per
/// operation, chosen by the client).
pub fn idempotency_key(pipeline: &str, key: &BusinessKey, target: Option<&str>) -> String {
    match target {
        Some(t) => format!("{pipeline}:{}:{t}", key.text),
        None => format!("{pipeline}:{}", key.text),
    }
}

impl OutboxSpec {
    /// The requests of one record: `values` holds one JSON text per [`OutboxSpec::params`] entry (`None`: null),
    /// `payload` is the record's value (the body where a request has none of its own).
    ///
    /// Errors: which value cannot be used, and where.
    pub fn render(&self, pipeline: &str, key: &BusinessKey, payload: &[u8], values: &[Option<String>]) -> Result<Vec<OutboxRequest>, String> {
        let lookup = |name: &str| -> Option<&Option<String>> { self.params.iter().position(|b| b.name == name).and_then(|i| values.get(i)) };
        let several = self.http.len() + self.kafka.len() > 1;
        let requests = self.http.iter().map(|t| render_one(t, pipeline, key, several, payload, &lookup));
        requests.chain(self.kafka.iter().map(|t| render_record(t, pipeline, key, several, payload, &lookup))).collect()
    }
}

/// A Kafka record of `[[sink.kafka]]`: method [`crate::store::rows::PRODUCE`], the topic as its URL.
fn render_record<'v>(
    t: &KafkaTarget,
    pipeline: &str,
    key: &BusinessKey,
    several: bool,
    payload: &[u8],
    lookup: &dyn Fn(&str) -> Option<&'v Option<String>>,
) -> Result<OutboxRequest, String> {
    let topic = text(&t.topic, lookup, &str::to_owned).map_err(|e| format!("sink.kafka {} topic: {e}", t.name))?;
    if !super::spec::kafka_topic(&topic) {
        return Err(format!("sink.kafka {} topic: {topic:?} is not a Kafka topic name", t.name));
    }
    let record_key = match &t.key {
        Some(template) => text(template, lookup, &str::to_owned).map_err(|e| format!("sink.kafka {} key: {e}", t.name))?,
        None => key.text.clone(),
    };
    let what = format!("sink.kafka {}", t.name);
    let mut headers = vec![(t.idempotency_header.clone(), idempotency_key(pipeline, key, several.then_some(t.name.as_str())))];
    headers.extend(templated_headers(&t.headers, lookup, &what)?);
    let value = body(&t.value, payload, lookup, &format!("{what} value"))?;
    Ok(OutboxRequest { target: t.name.clone(), method: crate::store::rows::PRODUCE.to_owned(), url: topic, headers, body: value, key: Some(record_key.into_bytes()) })
}

fn render_one<'v>(
    t: &HttpTarget,
    pipeline: &str,
    key: &BusinessKey,
    several: bool,
    payload: &[u8],
    lookup: &dyn Fn(&str) -> Option<&'v Option<String>>,
) -> Result<OutboxRequest, String> {
    let url = text(&t.url, lookup, &|v| utf8_percent_encode(v, URL_VALUE).to_string()).map_err(|e| format!("sink.http {} url: {e}", t.name))?;
    url::Url::parse(&url).map_err(|e| format!("sink.http {} url: the values make it no URL: {e}", t.name))?;
    let mut headers = Vec::with_capacity(t.headers.len() + 2);
    let idempotency = idempotency_key(pipeline, key, several.then_some(t.name.as_str()));
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
    Ok(OutboxRequest { target: t.name.clone(), method: t.method.clone(), url, headers, body, key: None })
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
    Ok(match t {
        JsonTemplate::Literal(v) => v.clone(),
        JsonTemplate::Value(name) => match lookup(name) {
            // A value not written as JSON (a default, meta text) goes as a string.
            Some(Some(v)) => serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.clone())),
            _ => Value::Null,
        },
        JsonTemplate::Text(arg) => Value::String(text(arg, lookup, &str::to_owned)?),
        JsonTemplate::Array(items) => Value::Array(items.iter().map(|i| json(i, lookup)).collect::<Result<_, _>>()?),
        JsonTemplate::Object(members) => Value::Object(members.iter().map(|(k, v)| json(v, lookup).map(|v| (k.clone(), v))).collect::<Result<_, _>>()?),
    })
}

/// Whether `value` can be a header value: no control characters but tab (RFC 9110 `field-value`).
fn header_value(value: &str) -> bool {
    !value.chars().any(|c| c.is_control() && c != '\t')
}

#[cfg(test)]
mod tests {
    use super::*;
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
    }
}
