//! The RocketMQ connector: its settings and `[source]` spec ([`spec`], always built, so a pipeline file that names
//! RocketMQ is read and refused with the reason by a build without it), and, with the `rocketmq` feature, its rooms:
//! the pull consumer ([`consumer`], with its rewind), the client's runtime and admin client ([`client`]) and what
//! `check` asks of the name server and brokers ([`check`]).

mod spec;
pub use spec::{RocketMqContext, RocketMqRaw, RocketMqSettings, RocketMqSpec};

#[cfg(feature = "rocketmq")]
mod check;
#[cfg(feature = "rocketmq")]
mod client;
#[cfg(feature = "rocketmq")]
pub use client::{acl_hook, admin, position_topic, Runtime};
#[cfg(feature = "rocketmq")]
mod consumer;
#[cfg(feature = "rocketmq")]
mod rewind;
#[cfg(feature = "rocketmq")]
pub use rewind::rewind;
#[cfg(feature = "rocketmq")]
pub use consumer::*;
