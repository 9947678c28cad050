//! The PostgreSQL outbox: `idemflow.outbox` (migration 13; [`crate::outbox`] has the protocol). Rows are written in
//! the batch's transaction, leased by the relay in a short transaction of their own, and settled in another.

use crate::record::Record;
use crate::store::rows::{Apply, Leased, OutboxDepth, OutboxRequest, Settled};
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

/// Writes the requests of `rows` in one statement, in order (the ids the relay follows).
pub async fn write(conn: &mut PgConnection, pipeline: &str, rows: &[(&Record, &Apply)]) -> Result<(), sqlx::Error> {
    let mut cols = Columns::default();
    for (record, apply) in rows {
        for request in &apply.requests {
            cols.push(record, &apply.key.digest, request);
        }
    }
    sqlx::query(
        r#"INSERT INTO idemflow.outbox (pipeline, key_digest, target, method, url, header_names, header_values, body, record_key, topic, partition, "offset")
           SELECT $1, u.key_digest, u.target, u.method, u.url,
                  ARRAY(SELECT jsonb_array_elements_text(u.names::jsonb)), ARRAY(SELECT jsonb_array_elements_text(u.vals::jsonb)),
                  u.body, u.record_key, u.topic, u.partition, u."offset"
           FROM unnest($2::bytea[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::bytea[], $9::bytea[], $10::text[], $11::int4[], $12::int8[])
                WITH ORDINALITY AS u(key_digest, target, method, url, names, vals, body, record_key, topic, partition, "offset", n)
           ORDER BY u.n"#,
    )
    .bind(pipeline)
    .bind(&cols.digests)
    .bind(&cols.targets)
    .bind(&cols.methods)
    .bind(&cols.urls)
    .bind(&cols.names)
    .bind(&cols.values)
    .bind(&cols.bodies)
    .bind(&cols.keys)
    .bind(&cols.topics)
    .bind(&cols.partitions)
    .bind(&cols.offsets)
    .persistent(super::persistent())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The outbox columns of a batch, one array each.
#[derive(Default)]
struct Columns<'a> {
    digests: Vec<&'a [u8]>,
    targets: Vec<&'a str>,
    methods: Vec<&'a str>,
    urls: Vec<&'a str>,
    names: Vec<String>,
    values: Vec<String>,
    bodies: Vec<&'a [u8]>,
    keys: Vec<Option<&'a [u8]>>,
    topics: Vec<&'a str>,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
}

impl<'a> Columns<'a> {
    fn push(&mut self, record: &'a Record, digest: &'a [u8; 32], r: &'a OutboxRequest) {
        self.digests.push(digest);
        self.targets.push(&r.target);
        self.methods.push(&r.method);
        self.urls.push(&r.url);
        // Arrays of arrays cannot be unnested row by row: each row's headers travel as a JSON array.
        self.names.push(serde_json::Value::from(r.headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>()).to_string());
        self.values.push(serde_json::Value::from(r.headers.iter().map(|(_, v)| v.as_str()).collect::<Vec<_>>()).to_string());
        self.bodies.push(&r.body);
        self.keys.push(r.key.as_deref());
        self.topics.push(&record.position.topic);
        self.partitions.push(record.position.partition);
        self.offsets.push(record.position.offset);
    }
}

/// A leased row as read: id, target, method, url, header names, header values, body, record key, attempts, age in
/// seconds.
type LeasedRow = (i64, String, String, String, Vec<String>, Vec<String>, Vec<u8>, Option<Vec<u8>>, i32, f64);

fn leased((id, target, method, url, names, values, body, key, attempts, age_seconds): LeasedRow) -> Leased {
    Leased { id, request: OutboxRequest { target, method, url, headers: names.into_iter().zip(values).collect(), body, key }, attempts, age_seconds }
}

/// A relay's transaction, bounded as a batch's is against a relay that vanishes without closing its connection
/// (`idle_in_transaction_session_timeout` and TCP keepalives, [`super::side_effect::vanished_client_bounds`]): its
/// locks and leases are not held until the server's TCP timeout.
async fn begin(pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let bounds = format!("DO $idemflow$ BEGIN {}END $idemflow$", super::side_effect::vanished_client_bounds());
    sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&bounds)).await?;
    Ok(tx)
}

/// Leases up to `limit` due rows of `pipeline` to `owner` ([`crate::store::Connector::outbox_lease`]): one
/// statement, its own transaction. A row is due when its next attempt has come, no lease on it holds, and no older
/// row of its business key is left (leased, waiting for a retry, or due: a key's rows go in order).
pub async fn lease(pool: &PgPool, pipeline: &str, owner: &str, limit: i64, lease: Duration) -> Result<Vec<Leased>, sqlx::Error> {
    let mut tx = begin(pool).await?;
    let rows: Vec<LeasedRow> = sqlx::query_as(
        r#"WITH due AS (
               SELECT o.id FROM idemflow.outbox o
               WHERE o.pipeline = $1 AND o.next_attempt_at <= now() AND (o.leased_until IS NULL OR o.leased_until < now())
                 AND NOT EXISTS (SELECT 1 FROM idemflow.outbox e WHERE e.pipeline = o.pipeline AND e.key_digest = o.key_digest AND e.id < o.id)
               ORDER BY o.id LIMIT $2
               FOR UPDATE SKIP LOCKED)
           UPDATE idemflow.outbox o SET leased_until = now() + make_interval(secs => $3), lease_owner = $4, attempts = o.attempts + 1
           FROM due WHERE o.id = due.id
           RETURNING o.id, o.target, o.method, o.url, o.header_names, o.header_values, o.body, o.record_key, o.attempts,
                     extract(epoch FROM now() - o.created_at)::float8"#,
    )
    .bind(pipeline)
    .bind(limit)
    .bind(lease.as_secs_f64())
    .bind(owner)
    .persistent(super::persistent())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let mut rows: Vec<Leased> = rows.into_iter().map(leased).collect();
    rows.sort_by_key(|r| r.id);
    Ok(rows)
}

/// Records what became of leased rows, in one transaction ([`crate::store::Connector::outbox_settle`]).
pub async fn settle(pool: &PgPool, pipeline: &str, owner: &str, settled: &[Settled]) -> Result<Vec<i64>, sqlx::Error> {
    let mut confirmed = Vec::new();
    let (mut retry_ids, mut retry_after, mut retry_errors) = (Vec::new(), Vec::new(), Vec::new());
    let (mut failed_ids, mut failed_errors) = (Vec::new(), Vec::new());
    for s in settled {
        match s {
            Settled::Confirmed(id) => confirmed.push(*id),
            Settled::Retry { id, after, error } => {
                retry_ids.push(*id);
                retry_after.push(after.as_secs_f64());
                retry_errors.push(error.replace('\0', "\\u0000"));
            }
            Settled::Failed { id, error } => {
                failed_ids.push(*id);
                failed_errors.push(error.replace('\0', "\\u0000"));
            }
        }
    }
    let mut tx = begin(pool).await?;
    // A key's next request waited behind the one settled here: it is due from now, so back-pressure's `max_age`
    // counts its wait from here, not from when it was written (a key that waited out an hour's back-off never pauses
    // the pipeline while it drains). In the statement that deletes the row, with what it returns.
    const BUMP: &str = "UPDATE idemflow.outbox n SET next_attempt_at = now() FROM gone g
                        WHERE n.pipeline = $1 AND n.key_digest = g.key_digest AND n.id > g.id AND n.attempts = 0 AND n.next_attempt_at < now()";
    if !confirmed.is_empty() {
        // Whoever holds the lease now: the target confirmed the request, another send would only be recognised.
        sqlx::query(&format!("WITH gone AS (DELETE FROM idemflow.outbox WHERE pipeline = $1 AND id = ANY($2) RETURNING id, key_digest) {BUMP}"))
            .bind(pipeline)
            .bind(&confirmed)
            .persistent(super::persistent())
            .execute(&mut *tx)
            .await?;
    }
    if !retry_ids.is_empty() {
        sqlx::query(
            "UPDATE idemflow.outbox o SET next_attempt_at = now() + make_interval(secs => r.after), leased_until = NULL, lease_owner = NULL, last_error = r.error
             FROM unnest($3::int8[], $4::float8[], $5::text[]) AS r(id, after, error)
             WHERE o.pipeline = $1 AND o.id = r.id AND o.lease_owner = $2",
        )
        .bind(pipeline)
        .bind(owner)
        .bind(&retry_ids)
        .bind(&retry_after)
        .bind(&retry_errors)
        .persistent(super::persistent())
        .execute(&mut *tx)
        .await?;
    }
    let mut moved = Vec::new();
    if !failed_ids.is_empty() {
        // The request moves whole: its headers and body, and what `dead-letters replay` needs to send it again. The
        // digest makes each failed row a dead letter of its own (two targets of one record fail apart). One
        // statement: a row is deleted and written as a dead letter together, only while this relay holds it.
        moved = sqlx::query_scalar(&format!(
            r#"WITH gone AS (
                   DELETE FROM idemflow.outbox o USING unnest($3::int8[], $4::text[]) AS f(id, error)
                   WHERE o.pipeline = $1 AND o.id = f.id AND o.lease_owner = $2
                   RETURNING o.*, f.error),
               moved AS (INSERT INTO idemflow.dead_letters
                   (pipeline, topic, partition, "offset", record_key, header_names, header_values, payload, reason, error,
                    property_names, property_values, payload_digest, request)
               SELECT g.pipeline, g.topic, g.partition,
                      CASE WHEN g.partition < 0 THEN nextval('idemflow.queue_dead_letter_seq') ELSE g."offset" END,
                      g.record_key, g.header_names, ARRAY(SELECT convert_to(v, 'UTF8') FROM unnest(g.header_values) v), g.body,
                      'delivery_failed', g.error, '{{}}', '{{}}', sha256(convert_to('outbox:' || g.id, 'UTF8')),
                      jsonb_build_object('target', g.target, 'method', g.method, 'url', g.url, 'key_digest', encode(g.key_digest, 'hex'))
               FROM gone g
               ON CONFLICT (pipeline, topic, partition, "offset", payload_digest) DO NOTHING
               RETURNING 0),
               bumped AS ({BUMP} RETURNING 0)
           SELECT id FROM gone"#,
        ))
        .bind(pipeline)
        .bind(owner)
        .bind(&failed_ids)
        .bind(&failed_errors)
        .persistent(super::persistent())
        .fetch_all(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(moved)
}

/// Rows of `pipeline` waiting (up to `up_to`), the age of the oldest, and the longest a row the relay could send
/// (due, and first of its key) has waited since it was due ([`crate::store::Connector::outbox_depth`]).
pub async fn depth(pool: &PgPool, pipeline: &str, up_to: i64) -> Result<OutboxDepth, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let (rows, oldest_seconds, due_seconds): (i64, f64, f64) = sqlx::query_as(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8,
                coalesce(extract(epoch FROM now() - min(due_since)), 0)::float8
         FROM (SELECT o.created_at,
                      CASE WHEN o.next_attempt_at <= now() AND NOT EXISTS (SELECT 1 FROM idemflow.outbox e
                                WHERE e.pipeline = o.pipeline AND e.key_digest = o.key_digest AND e.id < o.id)
                           THEN greatest(o.created_at, o.next_attempt_at) END AS due_since
               FROM idemflow.outbox o WHERE o.pipeline = $1 ORDER BY o.id LIMIT $2) s",
    )
    .bind(pipeline)
    .bind(up_to)
    .persistent(super::persistent())
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(OutboxDepth { rows, oldest_seconds: oldest_seconds.max(0.0), due_seconds: due_seconds.max(0.0) })
}

/// Gives up `owner`'s leases ([`crate::store::Connector::outbox_release`]).
pub async fn release(pool: &PgPool, pipeline: &str, owner: &str) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let done = sqlx::query("UPDATE idemflow.outbox SET leased_until = NULL, lease_owner = NULL WHERE pipeline = $1 AND lease_owner = $2")
        .bind(pipeline)
        .bind(owner)
        .persistent(super::persistent())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}

/// Puts dead letter `id`'s request back in the outbox, re-homed by `rehome` ([`crate::store::Connector::outbox_requeue`]).
pub async fn requeue(pool: &PgPool, id: i64, rehome: &str) -> Result<Option<i64>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let new: Option<i64> = sqlx::query_scalar(
        r#"WITH d AS (
               DELETE FROM idemflow.dead_letters WHERE id = $1 AND reason = 'delivery_failed' AND request IS NOT NULL RETURNING *),
           r AS (SELECT d.*, $2::jsonb ->> (d.request->>'target') AS home FROM d)
           INSERT INTO idemflow.outbox (pipeline, key_digest, target, method, url, header_names, header_values, body, record_key, topic, partition, "offset")
           SELECT r.pipeline, decode(r.request->>'key_digest', 'hex'), r.request->>'target', r.request->>'method',
                  CASE WHEN r.home IS NULL THEN r.request->>'url'
                       WHEN r.home LIKE '=%' THEN substr(r.home, 2)
                       ELSE regexp_replace(r.request->>'url', '^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*', r.home) END,
                  r.header_names, ARRAY(SELECT convert_from(v, 'UTF8') FROM unnest(r.header_values) v), coalesce(r.payload, ''::bytea),
                  r.record_key, r.topic, r.partition, r."offset"
           FROM r
           RETURNING id"#,
    )
    .bind(id)
    .bind(rehome)
    .persistent(super::persistent())
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(new)
}

/// Every pipeline's and target's rows waiting (due, in back-off, leased) and `delivery_failed` dead letters
/// ([`crate::store::Connector::unsent`]).
pub async fn unsent(pool: &PgPool) -> Result<Vec<crate::store::rows::Unsent>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows: Vec<crate::store::rows::UnsentRow> = sqlx::query_as(
        "SELECT pipeline, target, sum(waiting)::int8, max(oldest)::float8, sum(failed)::int8, sum(due)::int8, sum(backing)::int8,
                sum(leased)::int8, min(next_at), max(last_error) FROM (
             SELECT pipeline, target, count(*) AS waiting, extract(epoch FROM now() - min(created_at))::float8 AS oldest, 0::int8 AS failed,
                    count(*) FILTER (WHERE next_attempt_at <= now() AND (leased_until IS NULL OR leased_until < now())) AS due,
                    count(*) FILTER (WHERE next_attempt_at > now() AND (leased_until IS NULL OR leased_until < now())) AS backing,
                    count(*) FILTER (WHERE leased_until >= now()) AS leased,
                    min(next_attempt_at) FILTER (WHERE next_attempt_at > now())::text AS next_at,
                    (array_agg(last_error ORDER BY id DESC) FILTER (WHERE last_error IS NOT NULL))[1] AS last_error
             FROM idemflow.outbox GROUP BY pipeline, target
             UNION ALL
             SELECT pipeline, request->>'target', 0::int8, 0::float8, count(*), 0::int8, 0::int8, 0::int8, NULL, NULL
             FROM idemflow.dead_letters WHERE reason = 'delivery_failed' AND request IS NOT NULL GROUP BY 1, 2
         ) u GROUP BY pipeline, target ORDER BY pipeline, target",
    )
    .persistent(super::persistent())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows.into_iter().map(crate::store::rows::Unsent::from).collect())
}

/// Moves the next attempt of `pipeline`'s rows in back-off (of `target`, of the key whose digest is `digest`, where
/// given) to now; rows a relay holds are left. Returns how many ([`crate::store::Connector::outbox_retry_now`]).
pub async fn retry_now(pool: &PgPool, pipeline: &str, target: Option<&str>, digest: Option<&[u8]>) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let done = sqlx::query(
        "UPDATE idemflow.outbox SET next_attempt_at = now()
         WHERE pipeline = $1 AND ($2::text IS NULL OR target = $2) AND ($3::bytea IS NULL OR key_digest = $3)
           AND next_attempt_at > now() AND (leased_until IS NULL OR leased_until < now())",
    )
    .bind(pipeline)
    .bind(target)
    .bind(digest)
    .persistent(super::persistent())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}

/// A business key's requests not yet confirmed ([`crate::store::Connector::key_requests`]).
pub async fn key_requests(pool: &PgPool, pipeline: &str, digest: &[u8]) -> Result<Vec<crate::store::rows::KeyRequest>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows: Vec<(String, Option<i64>, i64, String, bool, Option<String>)> = sqlx::query_as(
        "SELECT target, NULL::int8, attempts::int8, next_attempt_at::text, coalesce(leased_until > now(), false), last_error
         FROM idemflow.outbox WHERE pipeline = $1 AND key_digest = $2
         UNION ALL
         SELECT request->>'target', id, 0::int8, '', false, error
         FROM idemflow.dead_letters WHERE pipeline = $1 AND reason = 'delivery_failed' AND request->>'key_digest' = encode($2, 'hex')
         ORDER BY 1, 2 NULLS FIRST",
    )
    .bind(pipeline)
    .bind(digest)
    .persistent(super::persistent())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows
        .into_iter()
        .map(|(target, dead_letter, attempts, next_attempt, leased, error)| crate::store::rows::KeyRequest { target, dead_letter, attempts, next_attempt, leased, error })
        .collect())
}
