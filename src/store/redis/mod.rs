//! The Redis store: the numbers of the `[sink] redis` commands ([`numbers`]: always built, as the commands
//! themselves, [`crate::store::redis_command`], so a pipeline file naming Redis is read and refused with the reason by
//! a build without it), and, with the
//! `redis` feature, the client: a batch as one script, dedup keys with a TTL, stored positions, the dead-letter
//! stream.

pub mod numbers;

#[cfg(feature = "redis")]
mod client;
#[cfg(feature = "redis")]
pub use client::*;
#[cfg(feature = "redis")]
pub mod batch;
#[cfg(feature = "redis")]
pub mod dead_letter;
#[cfg(feature = "redis")]
pub mod error;
#[cfg(feature = "redis")]
pub mod offsets;
#[cfg(feature = "redis")]
pub mod side_effect;
#[cfg(feature = "redis")]
mod connector;
