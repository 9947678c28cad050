//! The RocketMQ connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that names
//! RocketMQ is read and refused with the reason by a build without it), and, with the `rocketmq` feature, its consumer,
//! `check`, rewind.

mod spec;
pub use spec::{parse, CAPABILITIES, RocketMqSettings, RocketMqSpec};

#[cfg(feature = "rocketmq")]
mod consumer;
#[cfg(feature = "rocketmq")]
pub use consumer::*;
