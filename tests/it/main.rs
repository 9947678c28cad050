//! Integration tests against a real PostgreSQL server and librdkafka's mock cluster.

mod support;

mod bench;
mod e2e;
mod failures;
mod hardening;
mod mariadb;
mod monitoring;
mod cases;
mod cli;
mod demo;
mod deploy;
mod offsets;
mod operator;
mod pgbouncer;
mod rabbitmq;
mod redis;
mod retention;
mod scaleout;
mod security;
mod semantics;
mod visibility;
