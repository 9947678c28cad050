//! `idemflow rewind` for a RocketMQ pipeline: the group's consume offsets (or the stored positions) moved back
//! with acknowledged `UPDATE_CONSUMER_OFFSET` requests, refused while members are online.

use super::client::*;
use super::spec::{spec, RocketMqContext, RocketMqSettings};
use rocketmq_model::common::message::message_queue::MessageQueue;
use std::time::Duration;
use crate::source::rewind::{Move, Target};

/// One queue of a rewind plan: its master broker's address beside the move.
struct Planned {
    broker_addr: String,
    queue: MessageQueue,
    step: Move,
}

/// A RocketMQ pipeline's rewind (`idemflow rewind`): per queue of the topic's route, where the group is (its
/// consume offset, or the stored position when `stored` is given), where it goes (`earliest`: the queue's min
/// offset; a time: the broker's `SEARCH_OFFSET_BY_TIMESTAMP` answer), never forward; and, unless `dry_run`, the
/// group's consume offsets set with acknowledged `UPDATE_CONSUMER_OFFSET` requests to each queue's master broker.
/// Returns the moves (queue named `topic/broker`), warnings, and how many members the group has online.
///
/// Errors: no route, a broker request failed, or (unless `dry_run`) the group has members online: RocketMQ
/// consumers keep their offsets in memory and write them back every 5 s, so a running worker would undo the
/// rewind; stop every worker of the pipeline first.
pub async fn rewind(
    settings: &RocketMqSettings,
    pipeline: &RocketMqContext,
    target: Target,
    stored: Option<&[(String, i32, Option<i64>)]>,
    dry_run: bool,
    timeout: Duration,
) -> Result<(Vec<Move>, Vec<String>, usize), String> {
    let runtime = Runtime::new("rewind")?;
    let result = async {
        let mut admin = admin(&runtime, settings).await?;
        let out = rewind_with(&admin, settings, pipeline, target, stored, dry_run, timeout).await;
        admin.shutdown().await;
        out
    }
    .await;
    runtime.shutdown().await;
    result
}

/// How many members of consumer `group` are connected (0 for RocketMQ's CONSUMER_NOT_ONLINE, 206). Bounded by
/// `timeout`.
///
/// Errors: any other answer, or none in time: the question stays open, and a rewind with a worker running would be
/// undone by its next offset flush.
async fn members_online(admin: &rocketmq_client_rust::DefaultMQAdminExt, group: &str, timeout: Duration) -> Result<usize, String> {
    use rocketmq_client_rust::ConsumerAdmin;
    const CONSUMER_NOT_ONLINE: i32 = 206;
    match tokio::time::timeout(timeout, admin.examine_consumer_connection_info(group.into(), None)).await {
        Ok(Ok(c)) => Ok(c.get_connection_set().len()),
        Ok(Err(e)) if e.broker_response_code() == Some(CONSUMER_NOT_ONLINE) => Ok(0),
        Ok(Err(e)) => Err(format!("cannot tell whether consumer group {group:?} has members online: {e}")),
        Err(_) => Err(format!("the group's members: no answer within {timeout:?}")),
    }
}

async fn rewind_with(
    admin: &rocketmq_client_rust::DefaultMQAdminExt,
    settings: &RocketMqSettings,
    pipeline: &RocketMqContext,
    target: Target,
    stored: Option<&[(String, i32, Option<i64>)]>,
    dry_run: bool,
    timeout: Duration,
) -> Result<(Vec<Move>, Vec<String>, usize), String> {
    use rocketmq_client_rust::{ConsumerAdmin, OffsetAdmin, TopicAdmin};
    let spec = spec(pipeline);
    let ms = timeout.as_millis() as u64;
    let bounded = |what: &str| format!("{what}: no answer within {timeout:?}");
    let route = tokio::time::timeout(timeout, admin.examine_topic_route_info(spec.topic.as_str().into()))
        .await
        .map_err(|_| bounded("the topic's route"))?
        .map_err(|e| format!("cannot read the route of topic {:?}: {e}", spec.topic))?
        .ok_or_else(|| format!("topic {:?} has no route on the name server {}", spec.topic, settings.name_server))?;
    let group = spec.consumer_group.as_str();
    let members = members_online(admin, group, timeout).await?;
    let offsets = tokio::time::timeout(timeout, admin.examine_consume_stats(group.into(), Some(spec.topic.as_str().into()), None, None, None))
        .await
        .map_err(|_| bounded("the group's consume offsets"))?
        .ok();
    let mut plan = Vec::new();
    let mut warnings = Vec::new();
    for qd in &route.queue_datas {
        let Some(addr) = route.broker_datas.iter().find(|b| b.broker_name() == &qd.broker_name).and_then(|b| b.broker_addrs().get(&0).cloned()) else {
            warnings.push(format!("broker {} has no master in the route: its queues are left as they are", qd.broker_name));
            continue;
        };
        for id in 0..qd.read_queue_nums as i32 {
            let queue = MessageQueue::from_parts(spec.topic.as_str(), qd.broker_name.as_str(), id);
            let name = position_topic(&spec.topic, qd.broker_name.as_str());
            let end = admin.max_offset(addr.clone(), queue.clone(), ms).await.map_err(|e| format!("{name}/{id}: max offset: {e}"))?;
            let consume_offset = || {
                offsets
                    .as_ref()
                    .and_then(|s| s.offset_table.iter().find(|(mq, _)| **mq == queue).map(|(_, o)| o.get_consumer_offset()))
                    .filter(|o| *o >= 0)
            };
            // Where the worker would start the queue: with stored positions, a queue without one starts from the
            // group's consume offset (`RocketMqSource::start_from`), as without them.
            let from = match stored {
                Some(stored) => stored.iter().find(|(t, p, _)| *t == name && *p == id).and_then(|s| s.2).or_else(consume_offset),
                None => consume_offset(),
            };
            let wanted = match target {
                Target::Earliest => admin.min_offset(addr.clone(), queue.clone(), ms).await.map_err(|e| format!("{name}/{id}: min offset: {e}"))?,
                Target::Time(t) => {
                    let at = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
                    admin.search_offset(addr.clone(), spec.topic.as_str().into(), id, at, ms).await.map_err(|e| format!("{name}/{id}: search by time: {e}"))? as i64
                }
            };
            let to = match from {
                Some(f) if wanted > f => f, // never forward: that would skip what was never processed
                Some(_) => wanted.min(end),
                // No consume offset: the group starts the queue at its first offset (the consumer's
                // ConsumeFromFirstOffset; `seek_to_begin` with stored positions), so it is never moved past that.
                None => {
                    let wanted = wanted.min(end);
                    let first = match target {
                        Target::Earliest => wanted,
                        Target::Time(_) => {
                            admin.min_offset(addr.clone(), queue.clone(), ms).await.map_err(|e| format!("{name}/{id}: min offset: {e}"))?
                        }
                    };
                    if wanted > first {
                        warnings.push(format!(
                            "{name}/{id}: the group has no consume offset here, and it starts such a queue at its first \
                             offset {first}: moving it there, not to {wanted}, which would skip {} message(s) never \
                             consumed (a queue is never moved forward)",
                            wanted - first
                        ));
                        first
                    } else {
                        wanted
                    }
                }
            };
            plan.push(Planned { broker_addr: addr.to_string(), queue, step: Move { topic: name, partition: id, from, to, end } });
        }
    }
    if !dry_run {
        if members > 0 {
            return Err(format!(
                "consumer group {group:?} has {members} member(s) online: stop every worker of pipeline {:?} first (a \
                 running RocketMQ consumer writes its offsets back every 5 s and would undo the rewind)",
                pipeline.name
            ));
        }
        for p in &plan {
            admin
                .update_consume_offset(p.broker_addr.as_str().into(), group.into(), p.queue.clone(), p.step.to as u64)
                .await
                .map_err(|e| format!("{}/{}: cannot set the consume offset: {e}", p.step.topic, p.step.partition))?;
        }
    }
    Ok((plan.into_iter().map(|p| p.step).collect(), warnings, members))
}

/// `idemflow rewind` for a RocketMQ pipeline: the plan from the group's consume offsets (or the stored positions in
/// `store`), printed; unless `dry_run`, the group's offsets set (refused while members are online) and the stored
/// positions rewound too.
///
/// Errors: `[rocketmq]` is missing, a broker or store request failed, the group has members online.
pub async fn run(
    settings: Option<&RocketMqSettings>,
    pipeline: &RocketMqContext,
    file: &std::path::Path,
    request: crate::source::rewind::Request,
    side: Option<crate::source::rewind::StoreSide<'_>>,
) -> anyhow::Result<()> {
    let settings = settings.ok_or_else(|| anyhow::anyhow!("a RocketMQ source needs [rocketmq] name_server"))?;
    let store = side.and_then(|s| s.positions());
    let positions = match store {
        Some(store) => Some(store.stored_offsets(&pipeline.name).await?),
        None => None,
    };
    let (moves, warnings, members) = rewind(settings, pipeline, request.to, positions.as_deref(), request.dry_run, request.timeout)
        .await
        .map_err(|e| anyhow::anyhow!("{}: pipeline {:?}: rocketmq: {e}", file.display(), pipeline.name))?;
    let total = crate::source::rewind::print_plan(&pipeline.name, &spec(pipeline).consumer_group, store.is_some(), "queue", 40, &moves, &warnings);
    if request.dry_run {
        match members {
            0 => println!("the group has no members online: a real run would go ahead"),
            n => println!("a real run would be refused: the group has {n} member(s) online; stop every worker of the pipeline first"),
        }
        println!("dry run: nothing changed; {total} record(s) would be consumed again");
        return Ok(());
    }
    if let Some(side) = side {
        side.rewind(&pipeline.name, &moves).await?;
    }
    crate::source::rewind::print_rewound(total);
    Ok(())
}
