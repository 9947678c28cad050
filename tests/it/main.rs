//! Integration tests against a real PostgreSQL server and librdkafka's mock cluster.

// The RocketMQ client's futures are deeply nested (its own crates set the same limit).
#![recursion_limit = "256"]

mod support;

mod bench;
mod e2e;
mod failures;
mod formats;
mod fuzz_corpus;
mod hardening;
mod mariadb;
mod matrix;
mod nats;
mod monitoring;
mod network;
mod cases;
mod cli;
mod demo;
mod deploy;
mod docs;
mod offsets;
mod outbox;
mod outbox_security;
mod operator;
mod pgbouncer;
mod rabbitmq;
mod rocketmq;
mod redis;
mod retention;
mod scaleout;
mod security;
mod semantics;
mod soak;
mod upgrade;
mod visibility;
mod walkthroughs;
