//! Payload bytes to a JSON document.
//!
//! The size limit is checked before parsing, so an oversized payload costs no memory beyond its bytes. Nesting is
//! bounded by serde_json's recursion limit (128 levels): a deeper document is an error, never a stack overflow.
//! Numbers are kept as their exact text (serde_json's `arbitrary_precision`), so `9007199254740993` and
//! `100.000000000000000001` are never rounded through a float.
//!
//! A pipeline reads a few members of each document (its key and its values: a [`Selection`]), so
//! [`Decoder::decode_selected`] keeps only those: the whole document is parsed and checked exactly as
//! [`Decoder::decode`] checks it (the same parser, the same errors: UTF-8, escapes, lone surrogates, nesting,
//! trailing characters), but members outside the selection are never built into values, so they cost no
//! allocation. Looking a selected path up in the result gives what it gives in the whole document.

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;

/// How a pipeline's payloads are encoded. One format today; the enum is closed on purpose.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// UTF-8 JSON (RFC 8259), one document per record.
    #[default]
    Json,
}

/// Why a payload could not be decoded. Each sends the record to the dead letters.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The payload is larger than the pipeline's `max_payload_bytes`.
    #[error("payload of {size} bytes exceeds max_payload_bytes = {limit}")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },
    /// Not a JSON document (including an empty payload, invalid UTF-8, a lone surrogate escape, or nesting deeper
    /// than 128 levels).
    #[error("payload is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Decodes payloads of one pipeline.
#[derive(Clone, Debug)]
pub struct Decoder {
    format: Format,
    max_payload_bytes: usize,
}

impl Decoder {
    /// A decoder for `format` that rejects payloads over `max_payload_bytes` bytes before parsing.
    pub fn new(format: Format, max_payload_bytes: usize) -> Self {
        Decoder { format, max_payload_bytes }
    }

    /// The largest payload decoded, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Decodes one non-null payload.
    pub fn decode(&self, payload: &[u8]) -> Result<Value, DecodeError> {
        if payload.len() > self.max_payload_bytes {
            return Err(DecodeError::TooLarge { size: payload.len(), limit: self.max_payload_bytes });
        }
        match self.format {
            Format::Json => Ok(serde_json::from_slice(payload)?),
        }
    }

    /// Decodes one non-null payload as [`Decoder::decode`] does, keeping only the members in `selection` (see the
    /// module documentation): the same payloads are refused with the same errors, and every selected path looks up
    /// the same value.
    pub fn decode_selected(&self, payload: &[u8], selection: &Selection) -> Result<Value, DecodeError> {
        if payload.len() > self.max_payload_bytes {
            return Err(DecodeError::TooLarge { size: payload.len(), limit: self.max_payload_bytes });
        }
        match self.format {
            Format::Json => {
                let mut de = serde_json::Deserializer::from_slice(payload);
                let doc = Select(selection).deserialize(&mut de)?;
                de.end()?;
                Ok(doc)
            }
        }
    }
}

/// The members of a document a pipeline reads: a tree of member names (array indexes as decimal text) whose leaves
/// are kept whole. Built from the pipeline's field paths ([`Selection::add`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Keep this value whole (a path ends here).
    whole: bool,
    /// The members to descend into.
    members: BTreeMap<String, Selection>,
}

impl Selection {
    /// Adds the path `tokens` (as [`crate::field::FieldPath::tokens`] gives them); an empty path selects the whole
    /// document.
    pub fn add(&mut self, tokens: &[String]) {
        match tokens.split_first() {
            None => self.whole = true,
            Some((first, rest)) => self.members.entry(first.clone()).or_default().add(rest),
        }
    }
}

/// Deserializes a value keeping only `self.0`'s members.
struct Select<'s>(&'s Selection);

impl<'de> DeserializeSeed<'de> for Select<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        if self.0.whole {
            return Value::deserialize(deserializer);
        }
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Select<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    // A scalar where the selection goes deeper: no selected path goes through it, whatever it is.
    fn visit_bool<E>(self, _: bool) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_str<E>(self, _: &str) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        // Items up to the last selected index are kept in place (the unselected ones as nulls, never looked up);
        // the rest are checked and dropped.
        let last = self.0.members.keys().filter_map(|k| crate::field::array_index(k)).max();
        let mut items = Vec::new();
        while last.is_some_and(|l| items.len() <= l) {
            let item = match self.0.members.get(items.len().to_string().as_str()) {
                Some(child) => seq.next_element_seed(Select(child))?,
                None => seq.next_element::<Skip>()?.map(|_| Value::Null),
            };
            match item {
                Some(item) => items.push(item),
                None => return Ok(Value::Array(items)),
            }
        }
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        let mut first = true;
        while let Some(picked) = map.next_key_seed(Pick { selection: self.0, first })? {
            first = false;
            match picked {
                // A number (no selected path goes through it), or an object posing as one or as a raw value.
                Picked::Number | Picked::Raw => return private_member(&mut map, &picked, Select(self.0), Value::Null),
                // A member named twice keeps its last value, in its first place, as the whole document's map does.
                Picked::Member(name, child) => {
                    let value = map.next_value_seed(Select(child))?;
                    members.insert(name, value);
                }
                Picked::Other => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        Ok(Value::Object(members))
    }
}

/// serde_json's private member names: with `arbitrary_precision` every number reaches a visitor as an object whose
/// only member is named [`NUMBER`], and with `raw_value` an object whose first member is named [`RAW`] is read as
/// the document in that member's text. serde_json's `Value` treats them so as the **first** member of any object,
/// a payload's own included; the selected decode does the same, so that it refuses and finds what the whole one
/// does.
const NUMBER: &str = "$serde_json::private::Number";
/// See [`NUMBER`].
const RAW: &str = "$serde_json::private::RawValue";

/// The value of a first member named [`NUMBER`] or [`RAW`], read as serde_json's `Value` reads it: a number's text
/// is checked (and `number` stands for it), a raw value's text is decoded with `seed` as a document of its own.
fn private_member<'de, A, S, V>(map: &mut A, picked: &Picked<'_>, seed: S, number: V) -> Result<V, A::Error>
where
    A: MapAccess<'de>,
    S: for<'t> DeserializeSeed<'t, Value = V>,
{
    let text: String = map.next_value()?;
    if let Picked::Number = picked {
        text.parse::<serde_json::Number>().map_err(serde::de::Error::custom)?;
        return Ok(number);
    }
    let mut de = serde_json::Deserializer::from_str(&text);
    let inner = seed.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    inner.map_err(serde::de::Error::custom)
}

/// [`Skip`] as a seed.
struct PhantomSkip;

impl<'de> DeserializeSeed<'de> for PhantomSkip {
    type Value = Skip;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Skip, D::Error> {
        Skip::deserialize(deserializer)
    }
}

/// What a member name is to the selected decode.
enum Picked<'s> {
    /// Selected, with its part of the selection.
    Member(String, &'s Selection),
    /// Not selected.
    Other,
    /// [`NUMBER`] as the first member.
    Number,
    /// [`RAW`] as the first member.
    Raw,
}

/// A member name, with its part of the selection when it is selected (owned only then); `first` for an object's
/// first member (see [`NUMBER`]).
struct Pick<'s> {
    selection: &'s Selection,
    first: bool,
}

impl<'de, 's> DeserializeSeed<'de> for Pick<'s> {
    type Value = Picked<'s>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de, 's> Visitor<'de> for Pick<'s> {
    type Value = Picked<'s>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E>(self, name: &str) -> Result<Self::Value, E> {
        Ok(match name {
            NUMBER if self.first => Picked::Number,
            RAW if self.first => Picked::Raw,
            _ => self.selection.members.get_key_value(name).map_or(Picked::Other, |(k, child)| Picked::Member(k.clone(), child)),
        })
    }
}

/// The empty selection, for [`Skip`]'s member names.
static NOTHING: Selection = Selection { whole: false, members: BTreeMap::new() };

/// A value parsed and checked as any other (strings decoded and validated, numbers read), then dropped. Unlike
/// [`serde::de::IgnoredAny`], which serde_json skips without decoding its escapes (a lone surrogate passes), this
/// refuses what a whole decode refuses.
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Skip, D::Error> {
        deserializer.deserialize_any(SkipVisitor)
    }
}

struct SkipVisitor;

impl<'de> Visitor<'de> for SkipVisitor {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_str<E>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_unit<E>(self) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Skip, A::Error> {
        let mut first = true;
        while let Some(picked) = map.next_key_seed(Pick { selection: &NOTHING, first })? {
            first = false;
            match picked {
                Picked::Number | Picked::Raw => return private_member(&mut map, &picked, PhantomSkip, Skip),
                Picked::Member(..) | Picked::Other => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        Ok(Skip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_oversized_before_parsing_and_deep_nesting_without_crashing() {
        let d = Decoder::new(Format::Json, 16);
        assert!(matches!(d.decode(&[b' '; 17]), Err(DecodeError::TooLarge { size: 17, limit: 16 })));
        let d = Decoder::new(Format::Json, 1 << 20);
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(matches!(d.decode(deep.as_bytes()), Err(DecodeError::Json(_))));
        assert!(matches!(d.decode(b""), Err(DecodeError::Json(_))));
        assert!(matches!(d.decode(br#"{"a":"\ud800"}"#), Err(DecodeError::Json(_))));
        assert!(d.decode(br#"{"a":1}"#).is_ok());
    }

    fn selection(paths: &[&str]) -> Selection {
        let mut s = Selection::default();
        for p in paths {
            s.add(crate::field::FieldPath::parse(p).unwrap().tokens());
        }
        s
    }

    /// Every selected path looks up the same value in the selected decode as in the whole one, and a document is
    /// refused by both or by neither, with the same message.
    fn same(doc: &[u8], paths: &[&str]) {
        let d = Decoder::new(Format::Json, 1 << 20);
        let sel = selection(paths);
        match (d.decode(doc), d.decode_selected(doc, &sel)) {
            (Ok(whole), Ok(part)) => {
                for p in paths {
                    let path = crate::field::FieldPath::parse(p).unwrap();
                    assert_eq!(path.lookup(&whole), path.lookup(&part), "{p} in {}", String::from_utf8_lossy(doc));
                }
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{}", String::from_utf8_lossy(doc)),
            (a, b) => panic!("{}: whole {a:?}, selected {b:?}", String::from_utf8_lossy(doc)),
        }
    }

    #[test]
    fn a_selected_decode_finds_what_the_whole_one_finds_and_refuses_what_it_refuses() {
        let paths = ["/order/id", "/order/amount", "/items/1/sku", "/n", "/deep/a/b", "/0", "/list/0"];
        let docs: &[&[u8]] = &[
            br#"{"order":{"id":"A-1","amount":12.50,"note":"x"},"items":[{"sku":"a"},{"sku":"b"},{"sku":"c"}],"n":9007199254740993}"#,
            br#"{"order":{"id":1e400,"amount":"100.000000000000000001"},"n":null,"deep":{"a":5}}"#,
            br#"{"order":{"id":"first"},"order":{"id":"second"}}"#,
            br#"{"items":[{"sku":"a"}],"0":"zero","list":[[1,2],3]}"#,
            br#"{"order":"scalar","items":"no","deep":{"a":{"b":{"c":[1,{"d":true}]}}}}"#,
            br#"[{"order":1},2]"#,
            br#"{"skipped":"\ud800","order":{"id":"x"}}"#,
            br#"{"skipped":"\u00e9\n","order":{"id":"x"}}"#,
            b"{\"skipped\":\"\xff\",\"order\":{\"id\":\"x\"}}",
            br#"{"order":{"id":"x"}} trailing"#,
            br#"{"order":{"id":"x"},}"#,
            br#"{"skipped":[1,2,}"#,
            br#"{"skipped":01}"#,
            br#""#,
            br#"null"#,
            br#""just a string""#,
        ];
        for doc in docs {
            same(doc, &paths);
        }
        let deep = format!(r#"{{"order":{{"id":"x"}},"skipped":{}{}}}"#, "[".repeat(200), "]".repeat(200));
        same(deep.as_bytes(), &paths);
        // serde_json's private names as a payload's own members (see NUMBER).
        let private: &[&[u8]] = &[
            br#"{"$serde_json::private::RawValue":"{\"order\":{\"id\":\"A\"}}"}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::Number":"zz"}}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::Number":"12.5"}}"#,
            br#"{"$serde_json::private::RawValue":"nope","order":{"id":"A"}}"#,
            br#"{"order":{"$serde_json::private::RawValue":"{\"id\":7}"}}"#,
            br#"{"order":{"id":"A"},"x":{"$serde_json::private::RawValue":"[1,"}}"#,
            br#"{"order":{"id":"A","$serde_json::private::Number":"zz"}}"#,
            br#"{"$serde_json::private::Number":"1","order":{"id":"A"}}"#,
        ];
        for doc in private {
            same(doc, &paths);
        }
    }

    #[test]
    fn members_outside_the_selection_are_not_kept() {
        let d = Decoder::new(Format::Json, 1 << 20);
        let doc = d.decode_selected(br#"{"order":{"id":"A","note":"long text"},"other":[1,2,3]}"#, &selection(&["/order/id"])).unwrap();
        assert_eq!(doc, serde_json::json!({"order": {"id": "A"}}));
        let doc = d.decode_selected(br#"{"order":{"id":"A"}}"#, &Selection::default()).unwrap();
        assert_eq!(doc, serde_json::json!({}));
    }
}
