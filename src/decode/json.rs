//! JSON documents decoded keeping only a [`Selection`]'s members (see the module documentation of
//! [`crate::decode`]): serde_json's own parser and checks, with no value built for a member outside the selection.

use super::select::{Selected, Selection};
use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;

/// A JSON document, keeping `selection`'s members.
pub(super) fn json_selected(payload: &[u8], selection: &Selection) -> Result<Selected, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(payload);
    let mut slots = vec![None; selection.slots];
    Select { selection, slots: &mut slots }.deserialize(&mut de)?;
    de.end()?;
    Ok(Selected { slots })
}

/// Deserializes a value into `slots`, keeping only `selection`'s members. The caller empties the slots below
/// `selection` first.
struct Select<'s, 'v> {
    selection: &'s Selection,
    slots: &'v mut [Option<Value>],
}

impl<'de> DeserializeSeed<'de> for Select<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        if let Some(slot) = self.selection.whole {
            let value = Value::deserialize(deserializer)?;
            self.selection.fill(&value, self.slots);
            self.slots[slot] = Some(value);
            return Ok(());
        }
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Select<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    // A scalar where the selection goes deeper: no selected path goes through it, whatever it is.
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // Items up to the last selected index are read into their slots, the others checked and dropped.
        let last = self.selection.members.keys().filter_map(|k| crate::field::array_index(k)).max();
        let mut index = 0;
        while last.is_some_and(|l| index <= l) {
            let more = match self.selection.members.get(index.to_string().as_str()) {
                Some(child) => seq.next_element_seed(Select { selection: child, slots: &mut *self.slots })?.is_some(),
                None => seq.next_element::<Skip>()?.is_some(),
            };
            if !more {
                return Ok(());
            }
            index += 1;
        }
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut first = true;
        while let Some(picked) = map.next_key_seed(Pick { selection: self.selection, first })? {
            first = false;
            match picked {
                // A number (no selected path goes through it), or an object posing as one or as a raw value.
                Picked::Number | Picked::Raw => {
                    return private_member(&mut map, &picked, Select { selection: self.selection, slots: self.slots }, ());
                }
                // A member named twice keeps its last value, as the whole document's map does.
                Picked::Member(child) => {
                    child.clear(self.slots);
                    map.next_value_seed(Select { selection: child, slots: &mut *self.slots })?;
                }
                Picked::Other => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        Ok(())
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
    let is_number = matches!(picked, Picked::Number);
    let text = map.next_value_seed(PrivateText { number: is_number })?;
    if is_number {
        return Ok(number);
    }
    let mut de = serde_json::Deserializer::from_str(&text);
    let inner = seed.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    inner.map_err(serde::de::Error::custom)
}

/// The text of a private member's value, read as serde_json's `Value` reads it (its `NumberFromString` and
/// `BoxedFromString`): a string, refused with serde_json's own words when it is not one, and for [`NUMBER`] checked
/// as a number's text while it is read.
struct PrivateText {
    number: bool,
}

impl<'de> DeserializeSeed<'de> for PrivateText {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for PrivateText {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.number { "string containing a number" } else { "raw value" })
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<String, E> {
        if self.number {
            text.parse::<serde_json::Number>().map_err(E::custom)?;
        }
        Ok(text.to_owned())
    }
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
    Member(&'s Selection),
    /// Not selected.
    Other,
    /// [`NUMBER`] as the first member.
    Number,
    /// [`RAW`] as the first member.
    Raw,
}

/// A member name, with its part of the selection when it is selected (never allocated); `first` for an object's
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
            _ => self.selection.members.get(name).map_or(Picked::Other, Picked::Member),
        })
    }
}

/// The empty selection, for [`Skip`]'s member names.
static NOTHING: Selection = Selection { whole: None, members: BTreeMap::new(), below: Vec::new(), slots: 0 };

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

