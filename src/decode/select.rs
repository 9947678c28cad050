//! The members of a document a pipeline reads ([`Selection`]), and what a decode found at each ([`Selected`]):
//! shared by every format's decode.

use serde_json::Value;
use std::collections::BTreeMap;

/// The members of a document a pipeline reads: a tree of member names (array indexes as decimal text) whose leaves
/// are kept whole, each path with its slot. Built from the pipeline's field paths ([`Selection::add`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Keep this value whole, in this slot (a path ends here).
    pub(super) whole: Option<usize>,
    /// The members to descend into.
    pub(super) members: BTreeMap<String, Selection>,
    /// Every slot of this part of the tree (its own and its members'): emptied before a member named twice is read
    /// again, since the whole document keeps the last value of such a member.
    pub(super) below: Vec<usize>,
    /// How many slots the tree has (the root's count; 0 in the other nodes).
    pub(super) slots: usize,
}

impl Selection {
    /// Adds the path `tokens` (as [`crate::field::FieldPath::tokens`] gives them; an empty path selects the whole
    /// document) and returns its slot in what [`super::Decoder::decode_selected`] returns: a new one, or the slot of the
    /// same path added before.
    pub fn add(&mut self, tokens: &[String]) -> usize {
        let fresh = self.slots;
        let slot = self.add_at(tokens, fresh);
        if slot == fresh {
            self.slots += 1;
        }
        slot
    }

    fn add_at(&mut self, tokens: &[String], fresh: usize) -> usize {
        let slot = match tokens.split_first() {
            None => *self.whole.get_or_insert(fresh),
            Some((first, rest)) => self.members.entry(first.clone()).or_default().add_at(rest, fresh),
        };
        if slot == fresh {
            self.below.push(slot);
        }
        slot
    }

    /// Empties every slot of this part of the tree.
    pub(super) fn clear(&self, slots: &mut [Option<Value>]) {
        for s in &self.below {
            slots[*s] = None;
        }
    }

    /// Fills the slots below this node from `value`, the whole value at this node (paths selected inside a path
    /// selected whole), as looking them up in it would.
    pub(super) fn fill(&self, value: &Value, slots: &mut [Option<Value>]) {
        for (name, child) in &self.members {
            if let Some(found) = crate::field::step(value, name) {
                if let Some(s) = child.whole {
                    slots[s] = Some(found.clone());
                }
                child.fill(found, slots);
            }
        }
    }
}

/// What [`super::Decoder::decode_selected`] found: the value at each selected path, by the slot [`Selection::add`] gave
/// it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selected {
    pub(super) slots: Vec<Option<Value>>,
}

impl Selected {
    /// The values at `selection`'s paths in `value`, a whole document.
    pub(super) fn from_value(selection: &Selection, value: Value) -> Selected {
        let mut slots = vec![None; selection.slots];
        selection.fill(&value, &mut slots);
        if let Some(s) = selection.whole {
            slots[s] = Some(value);
        }
        Selected { slots }
    }

    /// The value at the path of `slot`; `None` when the document has nothing there (a missing member, an index out
    /// of range, a step into a scalar) or `slot` is not the selection's.
    pub fn get(&self, slot: usize) -> Option<&Value> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    /// The value at the path of `slot`, taken out: [`Selected::get`] finds nothing there afterwards.
    pub fn take(&mut self, slot: usize) -> Option<Value> {
        self.slots.get_mut(slot).and_then(Option::take)
    }
}

