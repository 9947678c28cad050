//! The sink: one Postgres transaction per batch that claims business keys, applies the side effect for the new
//! ones, writes the dead letters and commits.
//!
//! - [`dedup`]: the claim (`INSERT ... ON CONFLICT DO NOTHING RETURNING`) and duplicate classification.
//! - [`side_effect`]: the table form (one set-based `INSERT`) and the SQL form (statements per record).
//! - [`dead_letter`]: the dead-letter rows.
//! - [`error`]: how every database failure is classified: retry, dead-letter the record, or fatal.
//! - [`template`]: named parameters in `sink.sql`.
//! - [`transaction`]: the batch transaction that ties them together.

pub mod dead_letter;
pub mod dedup;
pub mod error;
pub mod side_effect;
pub mod template;
pub mod transaction;

pub use error::{Disposition, SinkError};
pub use transaction::{BatchOutcome, DeadLettered, Sink};
