//! What the demo ships and runs on: the example pipelines and their tables, built in for when the demo runs outside
//! the source tree, the topic, and the accounts the payments are deducted from.

/// The shipped pipeline and its tables, built in for when the demo runs outside the source tree.
pub(crate) const SHIPPED_PIPELINE: &str = include_str!("../../pipelines/payments.toml");
pub(crate) const SHIPPED_TABLES: &str = include_str!("../../pipelines/payments.sql");
pub(crate) const SHIPPED_RABBITMQ_PIPELINE: &str = include_str!("../../examples/rabbitmq/payments.toml");
pub(crate) const SHIPPED_NATS_PIPELINE: &str = include_str!("../../examples/nats/payments.toml");
pub(crate) const SHIPPED_MYSQL_PIPELINE: &str = include_str!("../../examples/mysql/payments.toml");
pub(crate) const SHIPPED_MYSQL_TABLES: &str = include_str!("../../examples/mysql/payments.sql");
pub(crate) const SHIPPED_REDIS_PIPELINE: &str = include_str!("../../examples/redis/payments.toml");
/// The topic (Kafka, RocketMQ), queue (RabbitMQ) or subject prefix (NATS) of the demo's stream.
pub(crate) const TOPIC: &str = "payments";
/// The accounts `ACC-0` to `ACC-99`.
pub(crate) const ACCOUNTS: usize = 100;
/// Each account starts with this balance, in cents.
pub(crate) const OPENING_BALANCE_CENTS: i64 = 100_000_000;
