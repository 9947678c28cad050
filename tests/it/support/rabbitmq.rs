//! A real RabbitMQ for tests: `RABBITMQ_URL` when set (scripts/test starts one node for the whole suite), otherwise
//! a node of this test process, started once. Tests that restart the broker or close its connections start a
//! [`Node`] of their own. Debian's rabbitmq-server, run as the `rabbitmq` user with its own directories and ports
//! (the same steps as scripts/rabbitmq-throwaway.sh).

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::sync::OnceLock;

static SHARED: OnceLock<String> = OnceLock::new();

/// The URL of the suite's broker.
pub fn shared_url() -> &'static str {
    SHARED.get_or_init(|| match std::env::var("RABBITMQ_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let node = Node::start().unwrap_or_else(|e| panic!("{e}"));
            let url = node.url();
            std::mem::forget(node); // lives as long as the test process
            url
        }
    })
}

/// A RabbitMQ node of one test: stoppable, restartable (same data directory), its connections closable (the same
/// throwaway node `idemflow demo --source rabbitmq` starts).
pub use idemflow::demo::rabbitmq::Throwaway as Node;

/// A message to publish.
#[derive(Clone, Debug)]
pub struct Msg {
    /// The AMQP message-id property.
    pub message_id: Option<String>,
    /// The body.
    pub body: Vec<u8>,
}

impl Msg {
    /// A message with this message-id and JSON text body.
    pub fn json(message_id: &str, body: impl Into<String>) -> Msg {
        Msg { message_id: Some(message_id.to_owned()), body: body.into().into_bytes() }
    }
}

/// A client connection for setting queues up and publishing.
pub struct Client {
    connection: Connection,
}

impl Client {
    /// Connects to `url`.
    pub async fn connect(url: &str) -> Client {
        Client { connection: Connection::connect(url, ConnectionProperties::default()).await.expect("connecting to RabbitMQ") }
    }

    /// Declares a durable queue of `kind` ("quorum" or "classic") with more arguments (`x-single-active-consumer`).
    pub async fn declare(&self, queue: &str, kind: &str, single_active_consumer: bool) {
        let ch = self.connection.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
        if single_active_consumer {
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        ch.queue_declare(queue.into(), QueueDeclareOptions { durable: true, ..Default::default() }, args).await.unwrap();
        let _ = ch.close(200, "done".into()).await;
    }

    /// Publishes persistent messages to `queue` through the default exchange, with publisher confirms; returns
    /// once the broker confirmed them all.
    pub async fn publish(&self, queue: &str, messages: &[Msg]) {
        let ch = self.connection.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        for chunk in messages.chunks(500) {
            for m in chunk {
                let mut props = BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
                if let Some(id) = &m.message_id {
                    props = props.with_message_id(id.as_str().into());
                }
                ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &m.body, props).await.unwrap();
            }
            let returned = ch.wait_for_confirms().await.unwrap();
            assert!(returned.is_empty(), "messages returned by the broker: {}", returned.len());
        }
        let _ = ch.close(200, "done".into()).await;
    }

    /// Publishes one persistent message with these headers (long-string values), with a publisher confirm.
    pub async fn publish_with_headers(&self, queue: &str, message: &Msg, headers: &[(&str, &str)]) {
        let values: Vec<(&str, AMQPValue)> = headers.iter().map(|(k, v)| (*k, AMQPValue::LongString((*v).into()))).collect();
        self.publish_with_values(queue, message, values).await
    }

    /// [`Client::publish_with_headers`] with header values of any AMQP type.
    pub async fn publish_with_values(&self, queue: &str, message: &Msg, headers: Vec<(&str, AMQPValue)>) {
        let ch = self.connection.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert(k.into(), v);
        }
        let mut props = BasicProperties::default().with_delivery_mode(2).with_headers(table);
        if let Some(id) = &message.message_id {
            props = props.with_message_id(id.as_str().into());
        }
        ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &message.body, props).await.unwrap();
        assert!(ch.wait_for_confirms().await.unwrap().is_empty());
        let _ = ch.close(200, "done".into()).await;
    }

    /// Declares a direct exchange and a durable classic queue bound to it with `routing_key`.
    pub async fn declare_exchange_with_queue(&self, exchange: &str, queue: &str, routing_key: &str) {
        use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
        let ch = self.connection.create_channel().await.unwrap();
        let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
        ch.exchange_declare(exchange.into(), lapin::ExchangeKind::Direct, durable, FieldTable::default()).await.unwrap();
        ch.queue_declare(queue.into(), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await.unwrap();
        ch.queue_bind(queue.into(), exchange.into(), routing_key.into(), QueueBindOptions::default(), FieldTable::default()).await.unwrap();
        let _ = ch.close(200, "done".into()).await;
    }

    /// Binds `queue` (declared, durable, classic) to `exchange` with `routing_key`.
    pub async fn bind(&self, exchange: &str, queue: &str, routing_key: &str) {
        use lapin::options::QueueBindOptions;
        let ch = self.connection.create_channel().await.unwrap();
        ch.queue_declare(queue.into(), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await.unwrap();
        ch.queue_bind(queue.into(), exchange.into(), routing_key.into(), QueueBindOptions::default(), FieldTable::default()).await.unwrap();
        let _ = ch.close(200, "done".into()).await;
    }

    /// Takes one message from `queue` (`basic.get`, acknowledged): its body, headers and message-id.
    pub async fn get(&self, queue: &str) -> Option<(Vec<u8>, FieldTable, Option<String>)> {
        use lapin::options::BasicGetOptions;
        let ch = self.connection.create_channel().await.unwrap();
        let got = ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }).await.unwrap();
        let _ = ch.close(200, "done".into()).await;
        got.map(|m| {
            let d = m.delivery;
            let id = d.properties.message_id().as_ref().map(|s| s.as_str().to_owned());
            (d.data, d.properties.headers().clone().unwrap_or_default(), id)
        })
    }

    /// Messages ready in `queue` (not counting those delivered and unacknowledged).
    pub async fn ready(&self, queue: &str) -> u32 {
        let ch = self.connection.create_channel().await.unwrap();
        let q = ch
            .queue_declare(queue.into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
            .await
            .unwrap();
        let _ = ch.close(200, "done".into()).await;
        q.message_count()
    }
}

/// `[rabbitmq]` settings for `url`, to append to a test's `idemflow.toml`.
pub fn settings(url: &str) -> String {
    format!("[rabbitmq]\nurl = \"{url}\"\nheartbeat = \"5s\"\nconnect_timeout = \"3s\"\n")
}
