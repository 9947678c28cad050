//! Field paths into a decoded JSON payload, and how a JSON value becomes the text bound into SQL.
//!
//! A path is written either as a JSON Pointer (RFC 6901: `/order/id`, with `~1` for `/` and `~0` for `~` inside a
//! member name) or in the dotted form `order.id`. Both name the same value. An array element is addressed by its
//! decimal index (`/items/0`).

use serde_json::Value;
use std::fmt;

/// A parsed field path: the reference tokens of an RFC 6901 JSON Pointer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldPath {
    tokens: Vec<String>,
}

/// Why a field path was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FieldPathError {
    /// The path is the empty string.
    #[error("is empty")]
    Empty,
    /// A JSON Pointer with `~` not followed by `0` or `1` (RFC 6901 section 3).
    #[error("is not a valid JSON Pointer (RFC 6901): `~` must be followed by `0` or `1`")]
    BadEscape,
    /// A dotted path with a `/` in it, such as `order/id`: a JSON Pointer missing its leading `/`.
    #[error("looks like a JSON Pointer without its leading `/`; write \"/{0}\" (or the dotted form)")]
    MissingSlash(String),
    /// A path with an empty member name, such as `/order//id` or `order..id`: almost always a typo.
    #[error("has an empty segment; write a member name between each pair of separators")]
    EmptySegment,
}

impl FieldPath {
    /// Parses a JSON Pointer (starts with `/`) or a dotted path (`order.id`).
    pub fn parse(text: &str) -> Result<Self, FieldPathError> {
        if text.is_empty() {
            return Err(FieldPathError::Empty);
        }
        let tokens: Vec<String> = if let Some(rest) = text.strip_prefix('/') {
            rest.split('/')
                .map(|raw| unescape(raw).ok_or(FieldPathError::BadEscape))
                .collect::<Result<_, _>>()?
        } else if text.contains('/') {
            return Err(FieldPathError::MissingSlash(text.to_owned()));
        } else {
            text.split('.').map(str::to_owned).collect()
        };
        if tokens.iter().any(String::is_empty) {
            return Err(FieldPathError::EmptySegment);
        }
        Ok(FieldPath { tokens })
    }

    /// The value at this path, or `None` when any step is missing (a missing member, an index out of range, or a
    /// step into a scalar).
    pub fn lookup<'v>(&self, root: &'v Value) -> Option<&'v Value> {
        self.tokens.iter().try_fold(root, |node, token| match node {
            Value::Object(map) => map.get(token.as_str()),
            Value::Array(items) => array_index(token).and_then(|i| items.get(i)),
            _ => None,
        })
    }
}

/// RFC 6901 section 4: an array index is `0` or a decimal number without leading zeros.
fn array_index(token: &str) -> Option<usize> {
    if token.len() > 1 && token.starts_with('0') {
        return None;
    }
    if !token.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    token.parse().ok()
}

fn unescape(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return None,
            }
        } else {
            out.push(c);
        }
    }
    Some(out)
}

impl fmt::Display for FieldPath {
    /// Writes the path as a JSON Pointer.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for token in &self.tokens {
            write!(f, "/{}", token.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

/// How a JSON value is rendered into the text that Postgres then casts to the target type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Render {
    /// For every type but `json`/`jsonb`: a string gives its contents, a number its digits exactly as written
    /// (never through a float), a boolean `true`/`false`, and an object or array its JSON text.
    Text,
    /// For `json` and `jsonb` targets: the JSON text of the value, whatever its kind (a string stays quoted).
    Json,
}

/// Why a value cannot be bound.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ValueError {
    /// Postgres `text` cannot hold U+0000, and `jsonb` rejects the `\u0000` escape.
    #[error("contains the NUL character U+0000, which Postgres text and jsonb cannot store")]
    Nul,
}

/// Renders a present, non-null JSON value as text for binding. JSON `null` is SQL NULL and never reaches here.
///
/// Errors: [`ValueError::Nul`] when the value, or any string inside it, contains U+0000; the same rule applies to
/// business keys (see [`crate::key`]).
pub fn render(value: &Value, render: Render) -> Result<String, ValueError> {
    if contains_nul(value) {
        return Err(ValueError::Nul);
    }
    Ok(match (value, render) {
        (Value::String(s), Render::Text) => s.clone(),
        (Value::Number(n), _) => n.to_string(),
        (Value::Bool(b), _) => b.to_string(),
        _ => value.to_string(),
    })
}

fn contains_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pointer_and_dotted_forms_address_the_same_value() {
        let doc = json!({"order": {"id": "o-1", "items": [{"sku": "a"}]}});
        for p in ["/order/id", "order.id"] {
            assert_eq!(FieldPath::parse(p).unwrap().lookup(&doc), Some(&json!("o-1")));
        }
        assert_eq!(FieldPath::parse("/order/items/0/sku").unwrap().lookup(&doc), Some(&json!("a")));
        assert_eq!(FieldPath::parse("order.items.0.sku").unwrap().lookup(&doc), Some(&json!("a")));
        assert_eq!(FieldPath::parse("/order/items/00").unwrap().lookup(&doc), None);
        assert_eq!(FieldPath::parse("/order/missing").unwrap().lookup(&doc), None);
        assert_eq!(FieldPath::parse("/order/id/deeper").unwrap().lookup(&doc), None);
    }

    #[test]
    fn rfc6901_escapes() {
        let doc = json!({"a/b": {"m~n": 1}});
        let p = FieldPath::parse("/a~1b/m~0n").unwrap();
        assert_eq!(p.lookup(&doc), Some(&json!(1)));
        assert_eq!(p.to_string(), "/a~1b/m~0n");
        assert_eq!(FieldPath::parse("/a~2"), Err(FieldPathError::BadEscape));
        assert_eq!(FieldPath::parse("/order//id"), Err(FieldPathError::EmptySegment));
        assert_eq!(FieldPath::parse("order..id"), Err(FieldPathError::EmptySegment));
        assert_eq!(FieldPath::parse(""), Err(FieldPathError::Empty));
        assert_eq!(FieldPath::parse("order/id"), Err(FieldPathError::MissingSlash("order/id".into())));
    }

    #[test]
    fn numbers_keep_their_digits() {
        let doc: Value = serde_json::from_str(r#"{"n": 9007199254740993, "d": 100.000000000000000001}"#).unwrap();
        assert_eq!(render(&doc["n"], Render::Text).unwrap(), "9007199254740993");
        assert_eq!(render(&doc["d"], Render::Text).unwrap(), "100.000000000000000001");
    }

    #[test]
    fn json_targets_get_json_text() {
        let doc = json!({"s": "x", "o": {"a": [1, "b"]}});
        assert_eq!(render(&doc["s"], Render::Json).unwrap(), "\"x\"");
        assert_eq!(render(&doc["s"], Render::Text).unwrap(), "x");
        assert_eq!(render(&doc["o"], Render::Text).unwrap(), r#"{"a":[1,"b"]}"#);
        assert_eq!(render(&json!({"a": "x\u{0}"}), Render::Json), Err(ValueError::Nul));
    }
}
