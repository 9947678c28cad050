//! What `idemflow check` asks of a JetStream server for a pipeline.

use super::spec::{NatsSettings, NatsSpec};
use super::client::*;
use crate::source::contract::Context;
type NatsContext = Context<NatsSpec>;

/// What `idemflow check` reports about a JetStream pipeline: it connects, finds the stream and the consumer, and
/// verifies the consumer's settings ([`verify_consumer`], as `run` does); a missing consumer is reported as the one
/// `run` will create, or refused as `run` would refuse to create it ([`creation_refusal`]). Returns lines to print
/// (`warning: ...` for what could not keep the guarantee by itself).
///
/// Errors: the first problem that stops the pipeline from running, as a sentence.
pub async fn check(settings: &NatsSettings, pipeline: &NatsContext) -> Result<Vec<String>, String> {
    let spec = &pipeline.source;
    let scrub = |e: &str| settings.url.scrub(e);
    let client = connect(settings, "idemflow check").await?;
    let version = client.server_info().version;
    let js = context(settings, client.clone());
    let name = &pipeline.name;
    let batch = (pipeline.batch.max_records, pipeline.batch.max_wait);
    let result = async {
        let mut lines = Vec::new();
        let mut stream = js.get_stream(&spec.stream).await.map_err(|e| stream_error(&spec.stream, &e, scrub))?;
        let info = stream.info().await.map_err(|e| format!("reading stream {:?}: {}", spec.stream, scrub(&e.to_string())))?.clone();
        let config = &info.config;
        lines.push(format!(
            "pipeline {name:?}: stream {:?} on nats-server {version}: {} message(s), subjects {:?}",
            spec.stream, info.state.messages, config.subjects
        ));
        let retention = pipeline.dedup_retention;
        if config.max_age.is_zero() || config.max_age > retention {
            let kept = if config.max_age.is_zero() {
                "until its limits on messages or bytes are reached (no max_age)".to_owned()
            } else {
                format!("for {} (max_age)", crate::terminal::duration(config.max_age))
            };
            lines.push(format!(
                "warning: pipeline {name:?}: stream {:?} keeps messages {kept}, longer than [dedup] retention = {}: a message \
                 redelivered or replayed (a consumer created again from an early start) after its dedup row was purged would \
                 be applied again",
                spec.stream,
                crate::terminal::duration(retention)
            ));
        }
        lines.push(format!(
            "pipeline {name:?}: stream {:?}: the server drops a publisher's retries with the same Nats-Msg-Id within {} \
             (duplicate_window); copies published later, and every redelivery, are skipped by idemflow's dedup rows for {}",
            spec.stream,
            crate::terminal::duration(config.duplicate_window),
            crate::terminal::duration(retention)
        ));
        match stream.consumer_info(&spec.consumer).await {
            Ok(c) => {
                verify_consumer(&c.config, spec, batch)?;
                lines.push(format!(
                    "pipeline {name:?}: consumer {:?}: pull, explicit acks, ack_wait {}, max_ack_pending {}; {} pending, {} awaiting ack",
                    spec.consumer,
                    crate::terminal::duration(c.config.ack_wait),
                    c.config.max_ack_pending,
                    c.num_pending,
                    c.num_ack_pending
                ));
                if c.config.ack_wait != spec.ack_wait {
                    lines.push(format!(
                        "warning: pipeline {name:?}: consumer {:?} has ack_wait {}, not [source] ack_wait = {}: the pipeline's \
                         applies only to a consumer idemflow creates; in-progress acks follow the consumer's",
                        spec.consumer,
                        crate::terminal::duration(c.config.ack_wait),
                        crate::terminal::duration(spec.ack_wait)
                    ));
                }
            }
            Err(e) if not_found(&e) => {
                if let Some(why) = creation_refusal(&info, spec, batch, retention, &version) {
                    return Err(why);
                }
                lines.push(format!(
                    "pipeline {name:?}: consumer {:?} does not exist yet: `idemflow run` creates it (durable, pull, explicit \
                     acks, no delivery limit, ack_wait {}, max_ack_pending {}, from the stream's first message)",
                    spec.consumer,
                    crate::terminal::duration(spec.ack_wait),
                    spec.max_ack_pending
                ));
            }
            Err(e) => return Err(format!("reading consumer {:?}: {}", spec.consumer, scrub(&e.to_string()))),
        }
        Ok(lines)
    };
    let result = match tokio::time::timeout(settings.connect_timeout, result).await {
        Ok(r) => r,
        Err(_) => Err(format!("{}: no answer within {:?} while checking the stream and consumer", settings.url, settings.connect_timeout)),
    };
    drop(client);
    result
}
