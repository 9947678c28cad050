//! The NATS JetStream connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that
//! names NATS is read and refused with the reason by a build without it), and, with the `nats` feature, its
//! durable pull consumer and `check`.

mod spec;
pub use spec::{parse, NatsSettings, NatsSpec, CAPABILITIES};

#[cfg(feature = "nats")]
mod consumer;
#[cfg(feature = "nats")]
pub use consumer::*;
