//! The baselines the worker is compared with: `COPY` ceilings, hand-written consumers (batched, and one
//! transaction per message as the design guides write it) and consume-only passes for each broker.

use crate::demo::kafka::EmbeddedKafka;
use crate::key::BusinessKey;
use anyhow::{bail, Context as _};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection};
use std::time::{Duration, Instant};
use super::report::*;
use super::workload::*;
use super::harness::*;

/// Run (3): the same dedup rows and business rows, loaded with `COPY` into the same indexed tables in one
/// transaction.
pub(super) async fn copy_ceiling(url: &str, s: &Stream, total: usize) -> anyhow::Result<RunResult> {
    let mut dedup = String::with_capacity(s.firsts.len() * 200);
    let mut orders = String::with_capacity(s.firsts.len() * 120);
    let hex = crate::terminal::hex;
    for &i in &s.firsts {
        let (partition, payload) = &s.records[i];
        let doc: serde_json::Value = serde_json::from_slice(payload)?;
        let o = &doc["order"];
        let id = o["id"].as_str().unwrap_or_default();
        let key = BusinessKey::new(id.to_owned());
        let fingerprint: [u8; 32] = Sha256::digest(payload).into();
        dedup.push_str(&format!(
            "{PIPELINE}\t\\\\x{}\t{TOPIC}\t{partition}\t{i}\t\\\\x{}\n",
            hex(&key.key_id()),
            hex(&fingerprint[..crate::store::rows::FINGERPRINT_BYTES])
        ));
        orders.push_str(&format!(
            "{id}\t{}\t{}\t{}\t{}\n",
            o["account"].as_str().unwrap_or_default(),
            o["amount"].as_str().unwrap_or_default(),
            o["currency"].as_str().unwrap_or_default(),
            doc["created_at"].as_str().unwrap_or_default()
        ));
    }
    let copy_dedup = r#"COPY idemflow.dedup (pipeline, key_id, topic, partition, "offset", fingerprint) FROM STDIN"#;
    let secs = copy_with_orders(url, copy_dedup, &dedup, &orders).await?;
    Ok(RunResult {
        id: "(3)".into(),
        name: "ceiling: COPY of the same dedup and business rows, no Kafka".into(),
        records: total as u64,
        seconds: secs,
        records_per_second: total as f64 / secs,
        note: format!("{} dedup rows and {} business rows for {total} records", s.firsts.len(), s.firsts.len()),
        ..RunResult::default()
    })
}

/// Loads `rows` with `copy` (a `COPY ... FROM STDIN` in text format) and `orders` into the business table, in one
/// transaction on a new connection to `url`; returns the seconds from `BEGIN` to the end of `COMMIT`.
pub(super) async fn copy_with_orders(url: &str, copy: &str, rows: &str, orders: &str) -> anyhow::Result<f64> {
    let mut conn = PgConnection::connect(url).await?;
    let started = Instant::now();
    let mut tx = conn.begin().await?;
    for (sql, data) in [(copy, rows), ("COPY orders (order_id, account_id, amount, currency, created_at) FROM STDIN", orders)] {
        let mut copy = tx.copy_in_raw(sql).await?;
        copy.send(data.as_bytes()).await?;
        copy.finish().await?;
    }
    tx.commit().await?;
    Ok(started.elapsed().as_secs_f64())
}

/// Run (9): the business rows and one key row per distinct key, loaded with `COPY` into fresh tables (the key text
/// as the primary key) in one transaction.
pub(super) async fn minimal_copy_ceiling(url: &str, s: &Stream, total: usize) -> anyhow::Result<RunResult> {
    let mut keys = String::with_capacity(s.firsts.len() * 20);
    let mut orders = String::with_capacity(s.firsts.len() * 120);
    for &i in &s.firsts {
        let row = order_row(&s.records[i].1).context("(9): an order without its fields")?;
        keys.push_str(&row[0]);
        keys.push('\n');
        orders.push_str(&row.join("\t"));
        orders.push('\n');
    }
    let secs = copy_with_orders(url, "COPY processed_keys (business_key) FROM STDIN", &keys, &orders).await?;
    Ok(RunResult {
        id: "(9)".into(),
        name: "ceiling: COPY of the minimal rows (business rows, one key-text primary key row per key), no Kafka".into(),
        records: total as u64,
        seconds: secs,
        records_per_second: total as f64 / secs,
        note: format!("{} key rows and {} business rows for {total} records", s.firsts.len(), s.firsts.len()),
        ..RunResult::default()
    })
}

/// A consumer of the bench topic for runs (10) and (11), with the worker's fetch settings.
pub(super) fn hand_written_consumer(kafka: &EmbeddedKafka, group: &str) -> anyhow::Result<BaseConsumer> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap_servers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("queued.min.messages", "8000")
        .set("queued.max.messages.kbytes", "16384")
        .set("fetch.max.bytes", "8388608")
        .set("fetch.queue.backoff.ms", "20")
        .create()?;
    consumer.subscribe(&[TOPIC])?;
    Ok(consumer)
}

/// Run (10): a batched consumer as one would write it by hand (see the module documentation), over `total` records.
pub(super) async fn hand_written_batched(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str) -> anyhow::Result<RunResult> {
    use rdkafka::consumer::CommitMode;
    use rdkafka::Message as _;
    let consumer = hand_written_consumer(kafka, group)?;
    let mut conn = PgConnection::connect(url).await?;
    let (mut n, mut applied, mut t0) = (0usize, 0u64, None);
    let deadline = Instant::now() + Duration::from_secs(900);
    let probe = Probe::of(url).await;
    let db0 = probe.read().await;
    let cpu0 = process_cpu_seconds();
    while n < total {
        if Instant::now() > deadline {
            bail!("(10): consumed {n} of {total} records in 15 minutes");
        }
        let mut columns: [Vec<String>; 5] = Default::default();
        let mut seen = std::collections::HashSet::new();
        let mut taken = 0;
        let batch_started = Instant::now();
        while taken < 2000 && n + taken < total && batch_started.elapsed() < Duration::from_millis(20) {
            match consumer.poll(Duration::from_millis(5)) {
                Some(Ok(m)) => {
                    t0.get_or_insert_with(Instant::now);
                    taken += 1;
                    if let Some(row) = m.payload().and_then(order_row) {
                        if seen.insert(row[0].clone()) {
                            for (c, v) in columns.iter_mut().zip(row) {
                                c.push(v);
                            }
                        }
                    }
                }
                Some(Err(e)) => tracing::debug!(error = %e, "consume error"),
                None => {}
            }
        }
        if taken == 0 {
            continue;
        }
        let mut tx = conn.begin().await?;
        let done = sqlx::query(
            "WITH new AS (INSERT INTO processed_keys (business_key) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING \
             RETURNING business_key) \
             INSERT INTO orders (order_id, account_id, amount, currency, created_at) \
             SELECT u.id, u.account, u.amount::numeric, u.currency, u.created_at::timestamptz \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS u(id, account, amount, currency, created_at) \
             JOIN new ON new.business_key = u.id",
        )
        .bind(&columns[0])
        .bind(&columns[1])
        .bind(&columns[2])
        .bind(&columns[3])
        .bind(&columns[4])
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        applied += done.rows_affected();
        consumer.commit_consumer_state(CommitMode::Async)?;
        n += taken;
    }
    let mut r = ceiling_result("a batched consumer written by hand (unnest + ON CONFLICT, 2,000 per transaction)", n, t0, format!("{applied} applied; CPU is the bench process's, the embedded broker's included"));
    r.id = "(10)".into();
    r.cpu_us_per_record = Some((process_cpu_seconds() - cpu0) * 1e6 / n.max(1) as f64);
    (r.db_cpu_us_per_record, r.wal_bytes_per_record) = probe.since(db0, n as f64).await;
    Ok(r)
}

/// Run (11): the design guides' consumer, one transaction per message, over `total` records.
pub(super) async fn per_message(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str) -> anyhow::Result<RunResult> {
    use rdkafka::consumer::CommitMode;
    use rdkafka::Message as _;
    let consumer = hand_written_consumer(kafka, group)?;
    let mut conn = PgConnection::connect(url).await?;
    let (mut n, mut applied, mut t0) = (0usize, 0u64, None);
    let deadline = Instant::now() + Duration::from_secs(900);
    let cpu0 = process_cpu_seconds();
    while n < total {
        if Instant::now() > deadline {
            bail!("(11): consumed {n} of {total} records in 15 minutes");
        }
        let m = match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "consume error");
                continue;
            }
            None => continue,
        };
        t0.get_or_insert_with(Instant::now);
        if let Some(row) = m.payload().and_then(order_row) {
            let mut tx = conn.begin().await?;
            let new = sqlx::query("INSERT INTO processed_keys (business_key) VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(&row[0])
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if new == 1 {
                sqlx::query("INSERT INTO orders (order_id, account_id, amount, currency, created_at) VALUES ($1, $2, $3::numeric, $4, $5::timestamptz)")
                    .bind(&row[0])
                    .bind(&row[1])
                    .bind(&row[2])
                    .bind(&row[3])
                    .bind(&row[4])
                    .execute(&mut *tx)
                    .await?;
                applied += 1;
            }
            tx.commit().await?;
        }
        consumer.commit_message(&m, CommitMode::Sync)?;
        n += 1;
    }
    let mut r = ceiling_result("the guides' consumer: one transaction and one synchronous offset commit per message", n, t0, format!("{applied} applied; CPU is the bench process's, the embedded broker's included"));
    r.id = "(11)".into();
    r.cpu_us_per_record = Some((process_cpu_seconds() - cpu0) * 1e6 / n.max(1) as f64);
    Ok(r)
}

pub(super) async fn consume_only(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str) -> anyhow::Result<RunResult> {
    let name = "ceiling: consume-only pass (decode and key extraction, no database)";
    consume_only_of(kafka, url, total, group, (TOPIC, &table_pipeline(None), name)).await
}

/// [`consume_only`] of `topic` through `pipeline` (runs (18) and (19): the Avro and Protobuf topics), named `name`.
pub(super) async fn consume_only_of(kafka: &EmbeddedKafka, url: &str, total: usize, group: &str, (topic, pipeline, name): (&str, &str, &'static str)) -> anyhow::Result<RunResult> {
    let (pipeline, preparer) = preparer(url, pipeline).await?;
    let topic_name = topic.to_owned();
    let max_payload_bytes = pipeline.decoder.max_payload_bytes();
    let bootstrap = kafka.bootstrap_servers().to_owned();
    let group = group.to_owned();
    tokio::task::spawn_blocking(move || -> anyhow::Result<RunResult> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()?;
        consumer.subscribe(&[&topic_name])?;
        let topic: std::sync::Arc<str> = std::sync::Arc::from(topic_name.as_str());
        let mut n = 0usize;
        let mut applied = 0usize;
        let mut t0 = None;
        let deadline = Instant::now() + Duration::from_secs(600);
        while n < total {
            if Instant::now() > deadline {
                bail!("(5): consumed {n} of {total} records in 10 minutes");
            }
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    t0.get_or_insert_with(Instant::now);
                    let record = crate::source::kafka::to_record(&m, topic.clone(), max_payload_bytes);
                    if matches!(preparer.prepare(&record), crate::prepare::Prepared::Apply(_)) {
                        applied += 1;
                    }
                    n += 1;
                }
                Some(Err(e)) => tracing::debug!(error = %e, "consume error"),
                None => {}
            }
        }
        Ok(ceiling_result(name, n, t0, format!("{applied} records prepared for applying")))
    })
    .await?
}

/// Run (5) on NATS JetStream: consume `total` messages from `stream` through a durable pull consumer with the
/// worker's settings (explicit acks, max_ack_pending twice a batch), decode each and take its key as the worker
/// would, and double-ack each batch of 2,000 (every message, confirmed, as the worker acknowledges).
pub(super) async fn consume_only_nats(url: &str, stream: &str, db_url: &str, pipeline_text: &str, total: usize) -> anyhow::Result<RunResult> {
    use futures_util::StreamExt;
    let (pipeline, preparer) = preparer(db_url, pipeline_text).await?;
    let crate::source::spec::SourceSpec::Nats(spec) = &pipeline.source else { bail!("(5): not a NATS pipeline") };
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    let consumer = js.get_stream(stream).await?.create_consumer(crate::source::nats::consumer_config(spec)).await?;
    let mut messages = consumer.stream().max_messages_per_batch(2000).messages().await?;
    let stream_name: std::sync::Arc<str> = std::sync::Arc::from(stream);
    let (mut n, mut applied, mut t0) = (0usize, 0usize, None);
    let max_payload_bytes = pipeline.decoder.max_payload_bytes();
    let mut ackers = Vec::with_capacity(2000);
    while n < total {
        let next = tokio::time::timeout(Duration::from_secs(60), messages.next()).await;
        let message = match next {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => bail!("(5): consuming failed: {e}"),
            Ok(None) | Err(_) => bail!("(5): consumed {n} of {total} messages, then nothing for 60 s"),
        };
        t0.get_or_insert_with(Instant::now);
        let (seq, published, delivered) = {
            let info = message.info().map_err(|e| anyhow::anyhow!("(5): {e}"))?;
            (info.stream_sequence, info.published.unix_timestamp_nanos(), info.delivered)
        };
        let (message, acker) = message.split();
        ackers.push(acker);
        let record = crate::source::nats::to_record(stream_name.clone(), seq, published, delivered, message, max_payload_bytes);
        if matches!(preparer.prepare(&record), crate::prepare::Prepared::Apply(_)) {
            applied += 1;
        }
        n += 1;
        if n % 2000 == 0 || n == total {
            for r in futures_util::future::join_all(ackers.iter().map(|a| a.double_ack())).await {
                r.map_err(|e| anyhow::anyhow!("(5): a double ack failed: {e}"))?;
            }
            ackers.clear();
        }
    }
    Ok(ceiling_result(
        "ceiling: consume-only pass from a NATS JetStream stream (decode and key extraction, a double ack per message, no database)",
        n,
        t0,
        format!("{applied} records prepared for applying; max_ack_pending {}", spec.max_ack_pending),
    ))
}

/// Run (5) on RocketMQ: the worker's own pull consumer ([`crate::source::Source`], the consumer group's offsets
/// kept by the broker) reads `total` messages in the worker's batches, each decoded and keyed as the worker would,
/// each batch's consume offsets committed after it, as the worker commits them; no database.
pub(super) async fn consume_only_rocketmq(name_server: &str, db_url: &str, pipeline_text: &str, total: usize) -> anyhow::Result<RunResult> {
    let (pipeline, preparer) = preparer(db_url, pipeline_text).await?;
    let rocketmq = crate::source::rocketmq::RocketMqSettings {
        name_server: name_server.to_owned(),
        access_key: None,
        secret_key: None,
        timeout: Duration::from_secs(10),
    };
    let brokers = crate::source::spec::Brokers {
        kafka: crate::source::kafka::KafkaSettings::default(),
        rabbitmq: None,
        rocketmq: Some(rocketmq),
        nats: None,
        shutdown_timeout: Duration::from_secs(10),
    };
    let metrics = crate::metrics::Metrics::new().pipeline(&pipeline.name);
    let mut source = crate::source::Source::new(&brokers, &pipeline.source_context(), metrics, None).map_err(anyhow::Error::msg)?;
    let (_stop, mut shutdown) = crate::shutdown::channel();
    let (mut n, mut applied, mut t0) = (0usize, 0usize, None);
    let mut progressed = Instant::now();
    while n < total {
        let Some(batch) = source.next_batch(pipeline.batch, &mut shutdown).await else {
            bail!("(5): the RocketMQ consumer stopped after {n} of {total} messages: {}", source.fatal().unwrap_or_default());
        };
        if batch.is_empty() {
            anyhow::ensure!(progressed.elapsed() < Duration::from_secs(60), "(5): consumed {n} of {total} messages, then nothing for 60 s");
            continue;
        }
        progressed = Instant::now();
        t0.get_or_insert_with(Instant::now);
        let batch = crate::batch::Batch::new(batch, |r| preparer.prepare(r));
        applied += batch.prepared().iter().filter(|p| matches!(p, crate::prepare::Prepared::Apply(_))).count();
        n += batch.len();
        source.commit(&batch).await;
    }
    let result = ceiling_result(
        "ceiling: consume-only pass from a RocketMQ topic (the worker's pull consumer, decode and key extraction, consume offsets committed per batch, no database)",
        n,
        t0,
        format!("{applied} records prepared for applying"),
    );
    source.close().await;
    Ok(result)
}

/// Run (5) on RabbitMQ: consume `total` messages from `queue` with the worker's default prefetch, decode each and
/// take its key as the worker would, acknowledging each batch of 2,000 with one `basic.ack` (`multiple`).
pub(super) async fn consume_only_rabbitmq(amqp: &str, queue: &str, url: &str, pipeline_text: &str, total: usize) -> anyhow::Result<RunResult> {
    use futures_util::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    let (pipeline, preparer) = preparer(url, pipeline_text).await?;
    let prefetch = match &pipeline.source {
        crate::source::spec::SourceSpec::RabbitMq(r) => r.prefetch,
        _ => bail!("(5): not a RabbitMQ pipeline"),
    };
    let connection = lapin::Connection::connect(amqp, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let mut consumer = channel.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), lapin::types::FieldTable::default()).await?;
    let queue_name: std::sync::Arc<str> = std::sync::Arc::from(queue);
    let (mut n, mut applied, mut t0) = (0usize, 0usize, None);
    let max_payload_bytes = pipeline.decoder.max_payload_bytes();
    while n < total {
        let next = tokio::time::timeout(Duration::from_secs(60), consumer.next()).await;
        let delivery = match next {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => bail!("(5): consuming failed: {e}"),
            Ok(None) | Err(_) => bail!("(5): consumed {n} of {total} messages, then nothing for 60 s"),
        };
        t0.get_or_insert_with(Instant::now);
        let tag = delivery.delivery_tag;
        let record = crate::source::rabbitmq::to_record(queue_name.clone(), delivery, max_payload_bytes);
        if matches!(preparer.prepare(&record), crate::prepare::Prepared::Apply(_)) {
            applied += 1;
        }
        n += 1;
        if n % 2000 == 0 || n == total {
            channel.basic_ack(tag, BasicAckOptions { multiple: true }).await?;
        }
    }
    let result = ceiling_result(
        "ceiling: consume-only pass from a RabbitMQ quorum queue (decode and key extraction, acks, no database)",
        n,
        t0,
        format!("{applied} records prepared for applying; prefetch {prefetch}"),
    );
    let _ = connection.close(200, "done".into()).await;
    Ok(result)
}
