//! The NATS JetStream connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that
//! names NATS is read and refused with the reason by a build without it), and, with the `nats` feature, its rooms:
//! the durable pull consumer ([`consumer`]), the client and the consumer's settings ([`client`]), messages as records
//! ([`record`]) and what `check` asks of the server ([`check`]).

mod spec;
pub use spec::{add_command, NatsRaw, NatsSettings, NatsSpec};

#[cfg(feature = "nats")]
mod check;
#[cfg(feature = "nats")]
mod client;
#[cfg(feature = "nats")]
pub use client::{connect, consumer_config, creation_refusal, verify_consumer};
#[cfg(feature = "nats")]
mod consumer;
#[cfg(feature = "nats")]
pub use consumer::*;
#[cfg(feature = "nats")]
mod record;
#[cfg(feature = "nats")]
pub use record::{to_record, MSG_ID_HEADER};
