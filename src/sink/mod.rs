//! The sink: the batch protocol, written once for every store ([`crate::store`]): one transaction per batch that
//! claims business keys, applies the side effect for the new ones, writes the dead letters and commits.
//!
//! - [`dedup`]: what a claim returns and how duplicates are classified.
//! - [`dead_letter`] (a leaf the stores and the dead-letter publishers share): what a dead letter keeps.
//! - [`error`]: how every database failure is classified: retry, dead-letter the record, or fatal.
//! - [`template`]: named parameters in `sink.sql`.
//! - [`transaction`]: the batch transaction that ties them together.

pub use crate::dead_letter;
pub mod dedup;
pub mod error;
pub use crate::store::template;
#[cfg(feature = "redis")]
mod script;
pub mod transaction;

pub use error::{Disposition, SinkError};
pub use crate::dead_letter::DeadLettered;
pub use transaction::{BatchOutcome, Sink};
