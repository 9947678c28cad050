//! The optional dead-letter exchange of a RabbitMQ pipeline (`[dead_letters] exchange`): every dead letter of a
//! committed batch is also published to a RabbitMQ exchange, persistent and mandatory, with publisher confirms, and
//! the batch is acknowledged only after the broker confirmed all of them (RabbitMQ documentation, "Consumer
//! Acknowledgements and Publisher Confirms"). A crash in between redelivers the batch; its dead letters are
//! published again (at least once). A message the exchange cannot route (no binding) counts as a failure: the
//! worker retries with backoff and says why, rather than ack a dead letter that went nowhere.
//!
//! The body is the original message's; its headers are the original ones plus `x-idemflow-pipeline`,
//! `x-idemflow-queue`, `x-idemflow-reason` and `x-idemflow-error` (and `x-idemflow-payload-bytes` and
//! `x-idemflow-payload-sha256` for an oversized payload, of which only the first 1 KiB is kept); `message_id`,
//! `correlation_id`, `content_type` and `type` are carried over.

use super::spec::RabbitMqSettings;
use crate::record::Record;
use crate::dead_letter::DeadLettered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

/// A publisher to one pipeline's dead-letter exchange, connected on first use and again after a failure.
pub struct DeadLetterExchange {
    settings: RabbitMqSettings,
    exchange: String,
    routing_key: String,
    pipeline: String,
    open: Mutex<Option<(Connection, Channel)>>,
}

impl DeadLetterExchange {
    /// A publisher to `exchange` with `routing_key`, over its own connection (apart from the consumers').
    pub fn new(settings: &RabbitMqSettings, pipeline: &str, exchange: &str, routing_key: &str) -> Self {
        DeadLetterExchange {
            settings: settings.clone(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            pipeline: pipeline.to_owned(),
            open: Mutex::new(None),
        }
    }

    /// Publishes the dead letters of a committed batch and waits for the broker's confirms.
    ///
    /// Errors: the first failure (connection, a negative confirm, an unroutable message), as text with the URL's
    /// credentials masked; the caller retries the whole call (duplicates at the exchange are possible, losses not).
    pub async fn publish(&self, batch: &[Record], dead: &[DeadLettered]) -> Result<(), String> {
        let mut open = self.open.lock().await;
        let result = self.publish_on(&mut open, batch, dead).await;
        if result.is_err() {
            *open = None; // a fresh connection and channel next time
        }
        result.map_err(|e| self.settings.url.scrub(&e))
    }

    async fn publish_on(&self, open: &mut Option<(Connection, Channel)>, batch: &[Record], dead: &[DeadLettered]) -> Result<(), String> {
        if open.is_none() {
            let props = ConnectionProperties::default().with_connection_name(format!("idemflow {} dead letters", self.pipeline).into());
            let connection = super::consumer::connect(&self.settings, props).await?;
            let channel = connection.create_channel().await.map_err(|e| e.to_string())?;
            channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| e.to_string())?;
            *open = Some((connection, channel));
        }
        let (_, channel) = open.as_ref().expect("opened above");
        let mut pending = Vec::with_capacity(dead.len());
        for d in dead {
            let r = &batch[d.index];
            let mut headers = FieldTable::default();
            for (k, v) in &r.headers {
                let value = v.as_ref().map_or(AMQPValue::Void, |v| AMQPValue::LongString(v.clone().into()));
                headers.insert(k.as_str().into(), value);
            }
            let text = |s: &str| AMQPValue::LongString(s.into());
            headers.insert("x-idemflow-pipeline".into(), text(&self.pipeline));
            headers.insert("x-idemflow-queue".into(), text(&r.position.topic));
            headers.insert("x-idemflow-reason".into(), text(d.reason.as_str()));
            headers.insert("x-idemflow-error".into(), text(&d.error));
            if let Some(o) = &r.oversized {
                headers.insert("x-idemflow-payload-bytes".into(), AMQPValue::LongLongInt(o.size as i64));
                headers.insert("x-idemflow-payload-sha256".into(), text(&crate::terminal::hex(&o.sha256)));
            }
            let mut props = BasicProperties::default().with_delivery_mode(2).with_headers(headers);
            if let Some(v) = r.property(crate::record::MESSAGE_ID) {
                props = props.with_message_id(v.into());
            }
            if let Some(v) = r.property("correlation_id") {
                props = props.with_correlation_id(v.into());
            }
            if let Some(v) = r.property("content_type") {
                props = props.with_content_type(v.into());
            }
            if let Some(v) = r.property("type") {
                props = props.with_type(v.into());
            }
            let body = r.payload.as_deref().unwrap_or_default();
            let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
            let confirm = channel
                .basic_publish(self.exchange.as_str().into(), self.routing_key.as_str().into(), options, body, props)
                .await
                .map_err(|e| format!("publishing to exchange {:?}: {e}", self.exchange))?;
            pending.push(confirm);
        }
        for p in pending {
            let confirmation = p.await.map_err(|e| format!("waiting for the broker's confirm: {e}"))?;
            match confirmation {
                lapin::Confirmation::Ack(None) => {}
                lapin::Confirmation::Ack(Some(_)) => {
                    return Err(format!(
                        "exchange {:?} routed no queue for routing key {:?}: bind a queue to it",
                        self.exchange, self.routing_key
                    ))
                }
                other => return Err(format!("the broker did not confirm a dead letter ({other:?})")),
            }
        }
        Ok(())
    }
}
