//! The business key of a record: where it comes from, its canonical text, and the digest the dedup store indexes.
//!
//! # Canonical text
//!
//! - A JSON string gives its contents, exactly. A JSON number gives its canonical decimal text
//!   ([`crate::field::canonical_decimal`]): numbers equal in value give the same key, so `100`, `100.0`, `1e2` and
//!   `1.00E+2` are all the key `100`, and the string `"100"` is that key too. The form is exact (no float on the
//!   way: `9007199254740993` stays itself, `0.1` stays `0.1`). Strings are never normalised: `"100.0"` and `"1e2"`
//!   as strings are keys of their own. A number needing more than 1000 digits written out is `key_invalid`.
//! - Booleans, objects and arrays are not keys (`key_invalid`). Missing, `null` and (unless `allow_empty`) empty
//!   keys are `key_missing`: a NULL key would give no protection at all, since Postgres treats NULLs as distinct.
//! - A composite key (`fields = [...]`) is the JSON array of its parts' canonical texts, e.g. `["o-1","3"]`.
//! - The Kafka record key and a header value must be UTF-8.
//! - U+0000 is rejected everywhere (`key_invalid`), as it is for bound values: Postgres text cannot store it.
//!
//! # Identity in the dedup stores
//!
//! Comparison is exact, byte for byte, with no Unicode normalisation. Two forms of the canonical text serve as the
//! key's identity, each where it is cheaper:
//!
//! - The SHA-256 digest (32 bytes, [`BusinessKey::digest`]): the worker's own sets and maps, and Redis's dedup keys
//!   (a hash table has no order to keep).
//! - The key id ([`BusinessKey::key_id`]): the primary key of the SQL dedup stores (PostgreSQL, MySQL/MariaDB).
//!   A key of at most [`KEY_ID_MAX_BYTES`] bytes is its own id, so the B-tree keeps the keys' order: business keys
//!   that grow (order numbers, time-ordered ids) land on the same few leaf pages batch after batch, where a digest
//!   would scatter each batch's inserts over the whole index (a random leaf, and after a checkpoint a full page
//!   image in the WAL, per key). A longer key is its first [`KEY_ID_PREFIX_BYTES`] bytes, a zero byte and its
//!   SHA-256: at most 64 bytes, so keys of any length fit a B-tree entry, and still ordered by their start. The zero
//!   byte keeps the two forms apart (no key contains U+0000, see above), and two long keys with the same id have the
//!   same start and the same digest.

use crate::field::FieldPath;
use crate::record::Record;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::borrow::Cow;

/// Where a pipeline takes its business key from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// One field of the payload.
    Field(FieldPath),
    /// Several fields of the payload, together (a composite key).
    Fields(Vec<FieldPath>),
    /// The Kafka record key.
    RecordKey,
    /// A field of the record key, decoded with the pipeline's `record_key_format` (a Debezium key struct: `/id`).
    RecordKeyField(FieldPath),
    /// The value of a Kafka header (the last one with this name), or of a RabbitMQ message header.
    Header(String),
    /// A message property ([`crate::record::PROPERTIES`]): RabbitMQ's `message_id` above all.
    Property(String),
}

/// Where the key comes from plus the rules it must satisfy.
#[derive(Clone, Debug)]
pub struct KeySpec {
    /// The source of the key.
    pub source: KeySource,
    /// Whether the empty string is a valid key (default: no, `key_missing`).
    pub allow_empty: bool,
    /// Longest key accepted, in bytes of canonical text; longer keys are `key_invalid`. `None`: no limit.
    pub max_bytes: Option<usize>,
}

/// A record's business key: canonical text and its SHA-256 digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusinessKey {
    /// The canonical text (see the module documentation).
    pub text: String,
    /// SHA-256 of `text`'s UTF-8 bytes.
    pub digest: [u8; 32],
}

/// The longest key, in bytes of canonical text, that is its own [`BusinessKey::key_id`]; also the longest key id.
pub const KEY_ID_MAX_BYTES: usize = 64;

/// How many bytes of a longer key's text start its key id (then a zero byte and the 32-byte digest: 64 in all).
pub const KEY_ID_PREFIX_BYTES: usize = KEY_ID_MAX_BYTES - 1 - 32;

impl BusinessKey {
    /// A key from its canonical text.
    pub fn new(text: String) -> Self {
        let digest = Sha256::digest(text.as_bytes()).into();
        BusinessKey { text, digest }
    }

    /// Whether the key's id is its text's own bytes (at most [`KEY_ID_MAX_BYTES`] of them): the text can then be
    /// read back from the id, and PostgreSQL's dedup row does not store it twice (migration 12).
    pub fn id_is_text(&self) -> bool {
        self.text.len() <= KEY_ID_MAX_BYTES
    }

    /// The key's id in the SQL dedup stores (column `key_id`, see the module documentation): the text's bytes when
    /// there are at most [`KEY_ID_MAX_BYTES`] of them (borrowed), otherwise the first [`KEY_ID_PREFIX_BYTES`], a
    /// zero byte and the digest. The migrations that moved stored rows to it compute the same in SQL
    /// (`migrations/postgres/0007_ordered_key_ids.sql`, `migrations/mysql/0002_ordered_key_ids.sql`).
    pub fn key_id(&self) -> Cow<'_, [u8]> {
        if self.id_is_text() {
            return Cow::Borrowed(self.text.as_bytes());
        }
        let text = self.text.as_bytes();
        let mut id = Vec::with_capacity(KEY_ID_MAX_BYTES);
        id.extend_from_slice(&text[..KEY_ID_PREFIX_BYTES]);
        id.push(0);
        id.extend_from_slice(&self.digest);
        Cow::Owned(id)
    }
}

/// Why no key could be taken from a record. Each sends the record to the dead letters.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    /// The key is absent, null, or empty (when empty keys are not allowed).
    #[error("business key {what}")]
    Missing {
        /// What was found, e.g. `/order/id is null`.
        what: String,
    },
    /// The key is present but cannot be used.
    #[error("business key {why}")]
    Invalid {
        /// Why, e.g. `/order/id is an object`.
        why: String,
    },
}

impl KeySpec {
    /// Takes the business key from a record and its decoded payload.
    pub fn extract(&self, record: &Record, doc: &Value) -> Result<BusinessKey, KeyError> {
        self.extract_found(record, |i| self.paths().get(i).and_then(|p| p.lookup(doc)))
    }

    /// The payload paths the key is made of, in order (none for a key from the record key, a header or a property).
    pub fn paths(&self) -> &[FieldPath] {
        match &self.source {
            KeySource::Field(path) => std::slice::from_ref(path),
            KeySource::Fields(paths) => paths,
            KeySource::RecordKey | KeySource::RecordKeyField(_) | KeySource::Header(_) | KeySource::Property(_) => &[],
        }
    }

    /// [`KeySpec::extract`], with the payload's values already looked up: `found(i)` is the value at
    /// `self.paths()[i]`, `None` when the payload has nothing there (the worker's selected decode,
    /// [`crate::decode::Selected`]).
    pub fn extract_found<'v>(&self, record: &Record, found: impl Fn(usize) -> Option<&'v Value>) -> Result<BusinessKey, KeyError> {
        let text = match &self.source {
            KeySource::Field(path) => self.part(path, found(0))?,
            KeySource::Fields(paths) => {
                let parts = paths.iter().enumerate().map(|(i, p)| self.part(p, found(i))).collect::<Result<Vec<_>, _>>()?;
                serde_json::to_string(&parts).expect("a list of strings serialises")
            }
            KeySource::RecordKey => self.bytes(&"(the record key)", record.key.as_deref())?,
            // The decoded record key's value at the path, which the caller gives as `found(0)`.
            KeySource::RecordKeyField(path) => self.part(path, found(0))?,
            KeySource::Header(name) => self.bytes(&format_args!("(header {name:?})"), record.header(name).flatten())?,
            // Each broker's users know the message id by its own name.
            KeySource::Property(name) if name == crate::record::MESSAGE_ID => self.bytes(
                &"(message_id: RabbitMQ's message-id property, JetStream's Nats-Msg-Id header, RocketMQ's UNIQ_KEY)",
                record.property(name).map(str::as_bytes),
            )?,
            KeySource::Property(name) => self.bytes(&format_args!("(property {name})"), record.property(name).map(str::as_bytes))?,
        };
        if let Some(max) = self.max_bytes {
            if text.len() > max {
                return Err(KeyError::Invalid { why: format!("is {} bytes, over max_bytes = {max}", text.len()) });
            }
        }
        Ok(BusinessKey::new(text))
    }

    /// The canonical text of a key an operator typed (`idemflow explain --key`, `dedup forget --key`): for a
    /// composite key, a JSON array whose parts are strings or numbers becomes the array of their canonical texts, as
    /// records' keys are made (`["O-1",1]` is the key `["O-1","1"]`); anything else is taken as it is.
    pub fn canonical_text(&self, typed: &str) -> String {
        if !matches!(self.source, KeySource::Fields(_)) {
            return typed.to_owned();
        }
        let Ok(Value::Array(parts)) = serde_json::from_str::<Value>(typed) else { return typed.to_owned() };
        let texts: Option<Vec<String>> = parts
            .iter()
            .map(|v| match v {
                Value::String(s) => Some(s.clone()),
                Value::Number(n) => crate::field::canonical_decimal(&n.to_string()),
                _ => None,
            })
            .collect();
        match texts {
            Some(texts) => serde_json::to_string(&texts).expect("a list of strings serialises"),
            None => typed.to_owned(),
        }
    }

    fn part(&self, path: &FieldPath, found: Option<&Value>) -> Result<String, KeyError> {
        let text = match found {
            None => return Err(KeyError::Missing { what: format!("{path} is missing") }),
            Some(Value::Null) => return Err(KeyError::Missing { what: format!("{path} is null") }),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => crate::field::canonical_decimal(&n.to_string()).ok_or_else(|| KeyError::Invalid {
                why: format!("{path} is a number with more than {} digits written out", crate::field::MAX_DECIMAL_DIGITS),
            })?,
            Some(other) => {
                let kind = match other {
                    Value::Bool(_) => "a boolean",
                    Value::Array(_) => "an array",
                    _ => "an object",
                };
                return Err(KeyError::Invalid { why: format!("{path} is {kind}, not a string or number") });
            }
        };
        self.check_text(path, text)
    }

    fn bytes(&self, what: &dyn std::fmt::Display, bytes: Option<&[u8]>) -> Result<String, KeyError> {
        let bytes = bytes.ok_or_else(|| KeyError::Missing { what: format!("{what} is missing") })?;
        let text = std::str::from_utf8(bytes)
            .map_err(|e| KeyError::Invalid { why: format!("{what} is not UTF-8: {e}") })?;
        self.check_text(what, text.to_owned())
    }

    /// `what` names the key's source in an error; it is formatted only then.
    fn check_text(&self, what: &dyn std::fmt::Display, text: String) -> Result<String, KeyError> {
        if text.is_empty() && !self.allow_empty {
            return Err(KeyError::Missing { what: format!("{what} is empty") });
        }
        if text.contains('\0') {
            return Err(KeyError::Invalid { why: format!("{what} contains U+0000, which idemflow refuses for every store (PostgreSQL text cannot store it)") });
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Position;
    use serde_json::json;

    fn record() -> Record {
        Record {
            position: Position { topic: "t".into(), partition: 0, offset: 0 },
            timestamp_ms: None,
            key: Some(b"rk-1".to_vec()),
            headers: vec![("message-id".into(), Some(b"m-1".to_vec())), ("message-id".into(), Some(b"m-2".to_vec()))],
            payload: None,
            oversized: None,
            properties: Vec::new(),
            delivered_before: None,
            receipt: crate::record::Receipt::NONE,
        }
    }

    fn spec(source: KeySource) -> KeySpec {
        KeySpec { source, allow_empty: false, max_bytes: None }
    }

    fn field(p: &str) -> KeySource {
        KeySource::Field(FieldPath::parse(p).unwrap())
    }

    #[test]
    fn number_keys_keep_their_digits_and_equal_their_string_form() {
        let doc: Value = serde_json::from_str(r#"{"id": 9007199254740993, "s": "9007199254740993"}"#).unwrap();
        let n = spec(field("/id")).extract(&record(), &doc).unwrap();
        let s = spec(field("/s")).extract(&record(), &doc).unwrap();
        assert_eq!(n.text, "9007199254740993");
        assert_eq!(n, s);
    }

    /// A composite key typed as JSON with number parts is looked up as a record's key would be made (issue 47,
    /// item 6); a single key, or text that is not such an array, is taken as typed.
    #[test]
    fn a_typed_composite_key_is_canonical_like_a_records() {
        let composite = spec(KeySource::Fields(vec![FieldPath::parse("/a").unwrap(), FieldPath::parse("/b").unwrap()]));
        let doc: Value = serde_json::from_str(r#"{"a": "O-1", "b": 1.0}"#).unwrap();
        let made = composite.extract(&record(), &doc).unwrap();
        assert_eq!(composite.canonical_text(r#"["O-1",1]"#), made.text);
        assert_eq!(composite.canonical_text(r#"[ "O-1", 1e0 ]"#), made.text);
        assert_eq!(composite.canonical_text(r#"["O-1","1"]"#), made.text);
        assert_eq!(composite.canonical_text("not json"), "not json");
        assert_eq!(composite.canonical_text(r#"["O-1",true]"#), r#"["O-1",true]"#);
        assert_eq!(spec(field("/id")).canonical_text(r#"["O-1",1]"#), r#"["O-1",1]"#, "a single key is its text");
    }

    #[test]
    fn equal_numbers_are_one_key() {
        let doc: Value =
            serde_json::from_str(r#"{"a": 100, "b": "100", "c": 100.0, "d": 1e2, "e": 1.00E+2, "f": "1e2", "g": 1e999999}"#)
                .unwrap();
        let key = |p: &str| spec(field(p)).extract(&record(), &doc);
        for p in ["/b", "/c", "/d", "/e"] {
            assert_eq!(key(p).unwrap(), key("/a").unwrap(), "{p}");
        }
        assert_eq!(key("/a").unwrap().text, "100");
        assert_ne!(key("/f").unwrap(), key("/a").unwrap(), "strings are taken as written");
        assert!(matches!(key("/g"), Err(KeyError::Invalid { .. })));
    }

    #[test]
    fn missing_null_empty_and_invalid() {
        let doc = json!({"order": {"id": null, "e": "", "o": {}, "z": "a\u{0}b"}});
        let r = record();
        assert!(matches!(spec(field("/order/x")).extract(&r, &doc), Err(KeyError::Missing { .. })));
        assert!(matches!(spec(field("/order/id")).extract(&r, &doc), Err(KeyError::Missing { .. })));
        assert!(matches!(spec(field("/order/e")).extract(&r, &doc), Err(KeyError::Missing { .. })));
        let allow = KeySpec { allow_empty: true, ..spec(field("/order/e")) };
        assert_eq!(allow.extract(&r, &doc).unwrap().text, "");
        assert!(matches!(spec(field("/order/o")).extract(&r, &doc), Err(KeyError::Invalid { .. })));
        assert!(matches!(spec(field("/order/z")).extract(&r, &doc), Err(KeyError::Invalid { .. })));
    }

    #[test]
    fn composite_record_key_and_header() {
        let doc = json!({"a": "x", "b": 2});
        let paths = vec![FieldPath::parse("/a").unwrap(), FieldPath::parse("b").unwrap()];
        assert_eq!(spec(KeySource::Fields(paths)).extract(&record(), &doc).unwrap().text, r#"["x","2"]"#);
        assert_eq!(spec(KeySource::RecordKey).extract(&record(), &doc).unwrap().text, "rk-1");
        let h = spec(KeySource::Header("message-id".into())).extract(&record(), &doc).unwrap();
        assert_eq!(h.text, "m-2");
        let mut no_key = record();
        no_key.key = None;
        assert!(matches!(spec(KeySource::RecordKey).extract(&no_key, &doc), Err(KeyError::Missing { .. })));
    }

    #[test]
    fn short_keys_are_their_own_ids_and_long_ones_a_prefix_and_digest() {
        let short = BusinessKey::new("o-1".into());
        assert_eq!(&*short.key_id(), b"o-1");
        let at_limit = BusinessKey::new("é".repeat(32));
        assert_eq!(at_limit.key_id().len(), 64);
        assert_eq!(&*at_limit.key_id(), at_limit.text.as_bytes());
        let long = BusinessKey::new(format!("{}x", "é".repeat(32)));
        let id = long.key_id();
        assert_eq!(id.len(), 64);
        assert_eq!(&id[..31], &long.text.as_bytes()[..31], "the start of the text, cut at a byte, not a character");
        assert_eq!(id[31], 0);
        assert_eq!(&id[32..], &long.digest[..]);
        let other = BusinessKey::new(format!("{}y", "é".repeat(32)));
        assert_ne!(other.key_id(), id, "same start, another digest");
        assert!(short.key_id() < BusinessKey::new("o-2".into()).key_id(), "ids keep the keys' order");
        assert_eq!(&*BusinessKey::new(String::new()).key_id(), b"");
    }

    #[test]
    fn max_bytes_limit() {
        let doc = json!({"id": "x".repeat(10)});
        let s = KeySpec { max_bytes: Some(9), ..spec(field("/id")) };
        assert!(matches!(s.extract(&record(), &doc), Err(KeyError::Invalid { .. })));
    }
}
