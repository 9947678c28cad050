//! The RabbitMQ connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that names
//! RabbitMQ is read and refused with the reason by a build without it), and, with the `rabbitmq` feature, its consumer,
//! `check` and dead-letter publisher.

mod spec;
pub use spec::{QueueType, RabbitMqRaw, RabbitMqSettings, RabbitMqSpec};

#[cfg(feature = "rabbitmq")]
mod consumer;
#[cfg(feature = "rabbitmq")]
pub use consumer::*;
#[cfg(feature = "rabbitmq")]
pub mod dead_letters;
