//! The Kafka connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that names
//! Kafka is read and refused with the reason by a build without it), and, with the `kafka` feature, its rooms: the
//! consumer's client settings ([`client`]), which partitions it owns and what a rebalance does ([`ownership`]), the
//! source that hands out batches and commits offsets ([`consumer`]), messages as records ([`record`]), what `check`
//! asks of the cluster ([`check`]), rewind and the dead-letter publisher.

mod spec;
pub use spec::{KafkaRaw, KafkaSettings, KafkaSpec, PropertyValue};

#[cfg(feature = "kafka")]
mod check;
#[cfg(feature = "kafka")]
pub use check::*;
#[cfg(feature = "kafka")]
mod client;
#[cfg(feature = "kafka")]
pub use client::*;
#[cfg(feature = "kafka")]
mod consumer;
#[cfg(feature = "kafka")]
pub use consumer::*;
#[cfg(feature = "kafka")]
mod ownership;
#[cfg(feature = "kafka")]
mod record;
#[cfg(feature = "kafka")]
mod topic_ids;
#[cfg(feature = "kafka")]
pub use record::to_record;
#[cfg(feature = "kafka")]
pub mod dead_letters;
#[cfg(feature = "kafka")]
pub mod outbox;
#[cfg(feature = "kafka")]
pub mod rewind;
