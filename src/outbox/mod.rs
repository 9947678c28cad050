//! The outbox: effects outside the database (HTTP calls to a payment provider, a webhook) made once per business
//! key. A record whose key is new writes its requests into the outbox table in its batch's transaction, beside its
//! dedup row (a duplicate writes nothing); after the commit the relay delivers them with `<pipeline>:<business key>`
//! as their idempotency key (IETF httpapi draft "The Idempotency-Key HTTP Header Field"), so a request sent again
//! after any crash is recognised by the target. docs/outbox.md tells users how; `src/lib.rs`, "The outbox", argues
//! the crash points.
//!
//! - [`spec`]: `[[sink.http]]` and `[outbox]`, checked; [`body`]: a body's JSON template; [`secret`]: values
//!   named instead of written; [`guard`]: what a record may steer (hosts, paths, topics, origins); [`placeholders`]:
//!   `{name}` in a target's text.
//! - [`render`]: one record's requests, when it is prepared.
//! - [`deliver`]: one attempt over HTTP, and what its answer means.
//! - [`relay`]: leases, deliveries, outcomes recorded, back-pressure.

pub mod body;
pub mod deliver;
pub mod guard;
pub mod placeholders;
pub mod relay;
pub mod render;
pub mod secret;
pub mod spec;
