//! What `idemflow check` (and `run` at start) asks of a Kafka cluster for a pipeline: its topics exist, and how long
//! they keep records against the pipeline's dedup retention.

use super::spec::KafkaSettings;
use super::client::{consumer_config, hide_config_value, spec};

use super::client::KafkaContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, KafkaResult};
use std::time::Duration;

/// Why `check` refuses a pipeline's Kafka side.
#[derive(Debug, thiserror::Error)]
pub enum TopicCheckError {
    /// No broker answered a metadata request within the timeout.
    #[error("cannot reach Kafka at {servers}: {source}")]
    Unreachable {
        /// `bootstrap.servers`.
        servers: String,
        /// The client's error.
        source: KafkaError,
    },
    /// A topic the pipeline consumes is not in the cluster's metadata.
    #[error("topic {0:?} does not exist")]
    Missing(String),
}

/// Asks the cluster for the pipeline's topics with the consumer's own configuration (TLS, SASL included) and
/// waits at most `timeout` (the client's metadata request: Kafka protocol, Metadata). Blocking: call it from a
/// blocking context.
///
/// Errors: [`TopicCheckError`] for an unreachable cluster (or one that refuses the configuration) and for each
/// missing topic, the first found.
pub fn check_topics(kafka: &KafkaSettings, pipeline: &KafkaContext, timeout: Duration) -> Result<(), TopicCheckError> {
    let unreachable = |source| TopicCheckError::Unreachable { servers: kafka.bootstrap_servers.clone(), source: hide_config_value(source) };
    let consumer: BaseConsumer = consumer_config(kafka, pipeline).create().map_err(unreachable)?;
    let metadata = consumer.fetch_metadata(None, timeout).map_err(unreachable)?;
    for topic in &spec(pipeline).topics {
        let found = metadata.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty());
        if !found {
            return Err(TopicCheckError::Missing(topic.clone()));
        }
    }
    Ok(())
}

/// Each topic's `retention.ms`, `segment.ms` and `cleanup.policy` (Kafka topic configs), read with the admin API's
/// DescribeConfigs; a value the broker did not return is `None`.
///
/// Errors: the broker is unreachable or does not support DescribeConfigs (librdkafka's mock cluster does not).
pub async fn topic_retention(kafka: &KafkaSettings, topics: &[String]) -> KafkaResult<Vec<(String, crate::retention::TopicRetention)>> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.bootstrap_servers);
    for (k, v) in &kafka.properties {
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") {
            config.set(k, v.to_string());
        }
    }
    let admin: AdminClient<DefaultClientContext> = config.create().map_err(hide_config_value)?;
    let specs: Vec<ResourceSpecifier<'_>> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(5)));
    let results = admin.describe_configs(&specs, &options).await?;
    let mut out = Vec::new();
    for (topic, result) in topics.iter().zip(results) {
        let r = result.ok();
        let value = |name: &str| r.as_ref().and_then(|r| r.get(name).and_then(|e| e.value.clone()));
        let number = |name: &str| value(name).and_then(|v| v.parse::<i64>().ok());
        let kept = crate::retention::TopicRetention {
            retention_ms: number("retention.ms"),
            segment_ms: number("segment.ms"),
            cleanup_policy: value("cleanup.policy"),
        };
        out.push((topic.clone(), kept));
    }
    Ok(out)
}


/// Compares `dedup_retention` with what each of `topics` can keep (`retention.ms` + `segment.ms`, and whether it is
/// compacted; read within 8 s): one line per topic, or `warning: ...` lines where the dedup rows could be purged
/// before the broker drops the records they guard, or where the broker did not say.
pub async fn retention_report(kafka: &KafkaSettings, pipeline: &str, topics: &[String], dedup_retention: Duration) -> Vec<String> {
    let read = tokio::time::timeout(Duration::from_secs(8), topic_retention(kafka, topics)).await;
    match read {
        Ok(Ok(topics)) => topics
            .into_iter()
            .flat_map(|(topic, kept)| {
                if kept.retention_ms.is_none() {
                    return vec![format!("warning: pipeline {pipeline:?}: topic {topic:?}: the broker did not return retention.ms")];
                }
                let warnings = crate::retention::window_warnings(pipeline, &topic, &kept, dedup_retention);
                if warnings.is_empty() {
                    vec![format!(
                        "pipeline {pipeline:?}: topic {topic:?}: dedup retention covers what the topic can keep (retention.ms + segment.ms)"
                    )]
                } else {
                    warnings.into_iter().map(|w| format!("warning: {w}")).collect()
                }
            })
            .collect(),
        Ok(Err(e)) => vec![format!(
            "warning: pipeline {pipeline:?}: could not read the topics' retention.ms to compare with [dedup] retention: {e}"
        )],
        Err(_) => vec![format!("warning: pipeline {pipeline:?}: could not read the topics' retention.ms (no answer from Kafka in 8 s)")],
    }
}
