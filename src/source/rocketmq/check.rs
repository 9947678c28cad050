//! What `idemflow check` asks of a RocketMQ name server and its brokers for a pipeline, and the admin client it
//! asks with.

use super::client::{admin, Runtime};
use super::spec::{RocketMqContext, RocketMqSettings};

/// What `idemflow check` reports about a RocketMQ pipeline: the name server answers, the topic has a route (its
/// brokers and read queues), and the consumer group's consume offsets and members, if any. Returns lines to print.
///
/// Errors: the first problem that stops the pipeline from running (no name server, no such topic, a queue with no
/// readable broker), as a sentence.
pub async fn check(settings: &RocketMqSettings, pipeline: &RocketMqContext) -> Result<Vec<String>, String> {
    use rocketmq_client_rust::{ConsumerAdmin, TopicAdmin};
    let spec = &pipeline.source;
    let runtime = Runtime::new("check")?;
    let result = async {
        let mut admin = admin(&runtime, settings).await?;
        let timeout = settings.timeout;
        let route = tokio::time::timeout(timeout, admin.examine_topic_route_info(spec.topic.as_str().into()))
            .await
            .map_err(|_| format!("the name server {} did not answer within {timeout:?}", settings.name_server))?
            .map_err(|e| format!("cannot read the route of topic {:?} from the name server {}: {e}", spec.topic, settings.name_server))?;
        let Some(route) = route else {
            return Err(format!(
                "topic {:?} has no route on the name server {}: create it (mqadmin updateTopic -t {} -c <cluster>), or \
                 let the broker create it (autoCreateTopicEnable = true) by producing to it",
                spec.topic, settings.name_server, spec.topic
            ));
        };
        let queues: u32 = route.queue_datas.iter().map(|q| q.read_queue_nums).sum();
        if queues == 0 {
            return Err(format!("topic {:?} has no readable queue (readQueueNums = 0 on every broker)", spec.topic));
        }
        let brokers: Vec<String> = route.queue_datas.iter().map(|q| format!("{} ({} queues)", q.broker_name, q.read_queue_nums)).collect();
        let mut lines = vec![format!(
            "pipeline {:?}: topic {:?}: {} read queue(s) on {}; consumer group {:?}, tags {:?}",
            pipeline.name, spec.topic, queues, brokers.join(", "), spec.consumer_group, spec.tag_expression
        )];
        let group = spec.consumer_group.as_str();
        match tokio::time::timeout(timeout, admin.examine_consume_stats(group.into(), Some(spec.topic.as_str().into()), None, None, None)).await {
            Ok(Ok(stats)) if !stats.offset_table.is_empty() => {
                let lag: i64 = stats.offset_table.values().map(|o| (o.get_broker_offset() - o.get_consumer_offset()).max(0)).sum();
                lines.push(format!(
                    "pipeline {:?}: consumer group {group:?} has consume offsets for {} queue(s), {lag} message(s) behind",
                    pipeline.name,
                    stats.offset_table.len()
                ));
            }
            Ok(Ok(_)) => lines.push(format!(
                "pipeline {:?}: consumer group {group:?} has no consume offsets yet: it starts from each queue's first offset",
                pipeline.name
            )),
            Ok(Err(e)) => lines.push(format!(
                "pipeline {:?}: consumer group {group:?}: no consume offsets read (a new group starts from each queue's \
                 first offset): {e}",
                pipeline.name
            )),
            Err(_) => lines.push(format!("warning: pipeline {:?}: consumer group {group:?}: the broker did not answer within {timeout:?}", pipeline.name)),
        }
        if let Ok(Ok(connection)) = tokio::time::timeout(timeout, admin.examine_consumer_connection_info(group.into(), None)).await {
            let members = connection.get_connection_set().len();
            lines.push(format!("pipeline {:?}: consumer group {group:?} has {members} member(s) online", pipeline.name));
            let mut others: Vec<String> = connection
                .get_subscription_table()
                .keys()
                .map(|t| t.to_string())
                .filter(|t| *t != spec.topic && !t.starts_with("%RETRY%") && !t.starts_with("%DLQ%"))
                .collect();
            others.sort();
            if members > 0 && !others.is_empty() {
                return Err(format!(
                    "consumer group {group:?} is also used for topic(s) {others:?} by its members online: RocketMQ shares a \
                     group's queues among all its members as if they subscribed alike, so some queues of {:?} would \
                     never be consumed; give the pipeline a consumer group of its own",
                    spec.topic
                ));
            }
            if let Some(sub) = connection.get_subscription_table().get(spec.topic.as_str()) {
                let theirs = sub.sub_string.to_string();
                if members > 0 && theirs != spec.tag_expression {
                    return Err(format!(
                        "consumer group {group:?} is subscribed to topic {:?} with tags {theirs:?} by its members online, \
                         not {:?}: members of one group must subscribe alike (RocketMQ rebalances the queues as if they did)",
                        spec.topic, spec.tag_expression
                    ));
                }
            }
        }
        admin.shutdown().await;
        Ok(lines)
    }
    .await;
    runtime.shutdown().await;
    result
}
