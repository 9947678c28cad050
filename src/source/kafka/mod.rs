//! The Kafka connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that names
//! Kafka is read and refused with the reason by a build without it), and, with the `kafka` feature, its consumer,
//! `check`, rewind and dead-letter publisher.

mod spec;
pub use spec::{parse, CAPABILITIES, KafkaSettings, KafkaSpec, PropertyValue};

#[cfg(feature = "kafka")]
mod consumer;
#[cfg(feature = "kafka")]
pub use consumer::*;
#[cfg(feature = "kafka")]
pub mod dead_letters;
#[cfg(feature = "kafka")]
pub mod rewind;
