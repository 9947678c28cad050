//! A request's JSON body (a Kafka record's value) as the pipeline file writes it: a template whose strings hold
//! placeholders, a placeholder alone keeping its value's JSON type (`"{amount}"`), or declaring the type it must
//! have (`"{amount:number}"`: a value of another type makes the record a `param_invalid` dead letter), and secret
//! references (`{ env = "NAME" }`) read when the request is sent ([`super::secret`]).

use super::secret::{is_reference, RawSecret, SecretRef};
use crate::store::redis_command::{Arg, Piece};

/// A JSON body template: the TOML value of `body`, where a string that is one placeholder alone (`"{amount}"`)
/// becomes that value as JSON (a number stays a number), and other strings are text with the values' text in them.
#[derive(Clone, Debug)]
pub enum Body {
    /// No `body`: the record's payload, byte for byte.
    Payload,
    /// `body = { ... }`.
    Json(JsonTemplate),
}

/// One node of a JSON body template.
#[derive(Clone, Debug)]
pub enum JsonTemplate {
    /// A number, boolean or string without placeholders.
    Literal(serde_json::Value),
    /// `"{name}"`: the value itself, whatever its JSON type.
    Value(String),
    /// `"{name:type}"`: the value, which must be of that type.
    Typed(String, JsonType),
    /// Text with placeholders.
    Text(Arg),
    /// `{ env = "NAME" }` or `{ file = "/path" }`: a string read when the request is sent, never stored.
    Secret(SecretRef),
    /// An array.
    Array(Vec<JsonTemplate>),
    /// An object, its keys in order.
    Object(Vec<(String, JsonTemplate)>),
}

/// The JSON type a body placeholder declares (`"{amount:number}"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonType {
    /// A number, or a string that is one (`"12.50"` becomes `12.50`).
    Number,
    /// A whole number, or a string of one.
    Integer,
    /// A string; a number or a boolean as its text.
    String,
    /// `true` or `false`.
    Boolean,
    /// An object.
    Object,
    /// An array.
    Array,
}

impl JsonType {
    fn parse(word: &str) -> Option<JsonType> {
        Some(match word {
            "number" => JsonType::Number,
            "integer" => JsonType::Integer,
            "string" => JsonType::String,
            "boolean" => JsonType::Boolean,
            "object" => JsonType::Object,
            "array" => JsonType::Array,
            _ => return None,
        })
    }

    /// Its name as written.
    pub fn name(self) -> &'static str {
        match self {
            JsonType::Number => "number",
            JsonType::Integer => "integer",
            JsonType::String => "string",
            JsonType::Boolean => "boolean",
            JsonType::Object => "object",
            JsonType::Array => "array",
        }
    }

    /// `value` as this type.
    ///
    /// Errors: the value is of another type (or null), said without the value.
    pub fn convert(self, value: serde_json::Value) -> Result<serde_json::Value, String> {
        use serde_json::Value;
        let refused = |v: &Value| format!("is {}, not {} {}", crate::field::kind(v), if self == JsonType::Integer || self == JsonType::Array || self == JsonType::Object { "an" } else { "a" }, self.name());
        let number = |text: &str| serde_json::from_str::<serde_json::Number>(text.trim()).ok();
        match (self, value) {
            (JsonType::Number, Value::Number(n)) => Ok(Value::Number(n)),
            (JsonType::Number, Value::String(s)) if number(&s).is_some() => Ok(Value::Number(number(&s).expect("checked"))),
            (JsonType::Integer, Value::Number(n)) if whole(&n.to_string()) => Ok(Value::Number(n)),
            (JsonType::Integer, Value::String(s)) if whole(s.trim()) => Ok(Value::Number(number(&s).expect("a whole number parses"))),
            (JsonType::String, Value::String(s)) => Ok(Value::String(s)),
            (JsonType::String, v @ (Value::Number(_) | Value::Bool(_))) => Ok(Value::String(v.to_string())),
            (JsonType::Boolean, v @ Value::Bool(_)) | (JsonType::Object, v @ Value::Object(_)) | (JsonType::Array, v @ Value::Array(_)) => Ok(v),
            (_, v) => Err(refused(&v)),
        }
    }
}

/// Whether `text` is a whole number as JSON writes one (`-12`, not `12.0` or `1e3`).
fn whole(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (digits == "0" || !digits.starts_with('0'))
}

/// `"{name:type}"`: the placeholder's name and its declared type, when `text` is exactly that.
pub fn typed_placeholder(text: &str) -> Option<(&str, JsonType)> {
    let inner = text.strip_prefix('{')?.strip_suffix('}')?;
    let (name, ty) = inner.split_once(':')?;
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    valid.then_some(())?;
    Some((name, JsonType::parse(ty)?))
}

impl JsonTemplate {
    /// The parameter names it uses.
    pub fn params(&self) -> Vec<&str> {
        match self {
            JsonTemplate::Literal(_) | JsonTemplate::Secret(_) => Vec::new(),
            JsonTemplate::Value(n) | JsonTemplate::Typed(n, _) => vec![n.as_str()],
            JsonTemplate::Text(a) => a.params().collect(),
            JsonTemplate::Array(items) => items.iter().flat_map(JsonTemplate::params).collect(),
            JsonTemplate::Object(members) => members.iter().flat_map(|(_, t)| t.params()).collect(),
        }
    }

    /// The secrets it holds, in the order [`super::render`] numbers them.
    pub fn secrets(&self) -> Vec<&SecretRef> {
        match self {
            JsonTemplate::Secret(s) => vec![s],
            JsonTemplate::Array(items) => items.iter().flat_map(JsonTemplate::secrets).collect(),
            JsonTemplate::Object(members) => members.iter().flat_map(|(_, t)| t.secrets()).collect(),
            _ => Vec::new(),
        }
    }

    /// The keys (dotted paths) of literal strings under a key named like a credential ([`super::secret::credential_name`]).
    pub fn literal_credentials(&self, at: &str) -> Vec<String> {
        match self {
            JsonTemplate::Object(members) => members
                .iter()
                .flat_map(|(k, t)| {
                    let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
                    match t {
                        JsonTemplate::Literal(serde_json::Value::String(_)) if super::secret::credential_name(k) => vec![path],
                        other => other.literal_credentials(&path),
                    }
                })
                .collect(),
            JsonTemplate::Array(items) => items.iter().flat_map(|t| t.literal_credentials(at)).collect(),
            _ => Vec::new(),
        }
    }
}

/// The template of a TOML value (`body`, a Kafka record's `value`): each problem to `e` (without the values);
/// placeholders must each name a `[sink.params]` entry (`known`). `None` after a problem.
pub fn json_template(v: toml::Value, e: &mut dyn FnMut(String), known: &dyn Fn(&str) -> bool) -> Option<JsonTemplate> {
    Some(match v {
        toml::Value::String(s) => {
            if let Some((name, ty)) = typed_placeholder(&s) {
                if !known(name) {
                    e(format!("{{{name}}} is used but has no entry in [sink.params]"));
                }
                return Some(JsonTemplate::Typed(name.to_owned(), ty));
            }
            let arg = super::placeholders::template(&s, known, e)?;
            match (arg.literal(), arg.0.as_slice()) {
                (Some(text), _) => JsonTemplate::Literal(serde_json::Value::String(text)),
                (None, [Piece::Param(name)]) => JsonTemplate::Value(name.clone()),
                _ => JsonTemplate::Text(arg),
            }
        }
        toml::Value::Integer(i) => JsonTemplate::Literal(i.into()),
        toml::Value::Float(f) => JsonTemplate::Literal(serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, Into::into)),
        toml::Value::Boolean(b) => JsonTemplate::Literal(b.into()),
        toml::Value::Datetime(d) => JsonTemplate::Literal(d.to_string().into()),
        toml::Value::Array(items) => JsonTemplate::Array(items.into_iter().map(|v| json_template(v, e, known)).collect::<Option<_>>()?),
        toml::Value::Table(t) if is_reference(&t) => {
            let raw: RawSecret = toml::Value::Table(t).try_into().map_err(|why| e(format!("not a secret reference: {why}"))).ok()?;
            JsonTemplate::Secret(SecretRef::parse(&raw).map_err(|why| e(why)).ok()?)
        }
        toml::Value::Table(t) => JsonTemplate::Object(t.into_iter().map(|(k, v)| json_template(v, e, known).map(|t| (k, t))).collect::<Option<_>>()?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn declared_types_convert_or_refuse() {
        assert_eq!(typed_placeholder("{amount:number}"), Some(("amount", JsonType::Number)));
        assert_eq!(typed_placeholder("{amount}"), None);
        assert_eq!(typed_placeholder("{a:float}"), None);
        assert_eq!(JsonType::Number.convert(json!("12.50")).unwrap().to_string(), "12.50");
        assert_eq!(JsonType::Number.convert(json!(7)).unwrap(), json!(7));
        assert!(JsonType::Number.convert(json!({"a": 1})).unwrap_err().contains("an object, not a number"));
        assert!(JsonType::Number.convert(json!("12 USD")).is_err());
        assert_eq!(JsonType::Integer.convert(json!("-42")).unwrap(), json!(-42));
        assert!(JsonType::Integer.convert(json!(1.5)).is_err() && JsonType::Integer.convert(json!("007")).is_err());
        assert_eq!(JsonType::String.convert(json!(5)).unwrap(), json!("5"));
        assert!(JsonType::String.convert(json!([1])).is_err() && JsonType::Boolean.convert(json!("true")).is_err());
        assert!(JsonType::Object.convert(serde_json::Value::Null).unwrap_err().contains("null"));
    }
}
