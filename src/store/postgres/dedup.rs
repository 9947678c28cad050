//! The Postgres dedup store: the claim is one multi-row `INSERT ... ON CONFLICT DO NOTHING RETURNING` over the
//! primary key `(pipeline, key_id)` ([`crate::key::BusinessKey::key_id`]); the ids it returns, gathered into one array
//! (one row to read instead of one per new key), are the keys that were new. A key already present is
//! never an error (a unique violation would abort the Postgres transaction). When another transaction holds an
//! uncommitted row for the same key, Postgres makes this `INSERT` wait for it (PostgreSQL docs, "INSERT ... ON
//! CONFLICT").
//!
//! The row (migration 12): the position, `applied_at`, the pipeline and topic, the key id, the payload's fingerprint
//! (the first [`FINGERPRINT_BYTES`] of its SHA-256) and, for keys whose id is not their text (over 64 bytes), the
//! key's text. Duplicate counts live in `idemflow.dedup_duplicates`, written only for keys that had duplicates.

use crate::record::Position;
use crate::key::BusinessKey;
use crate::store::rows::{floors_to_lower, Apply, Claim, Existing, Explained, Forget, Forgotten, KeyIds};
use crate::store::rows::FINGERPRINT_BYTES;
use sqlx::PgConnection;

/// The claim's `INSERT`, parameters `$1` to `$7` (see [`ClaimArrays`]); its `RETURNING key_id` are the keys that
/// were new. A short key's text is read back from its id, except in a database whose encoding is not UTF8: there
/// every key keeps its text (converted once, here, where a character the encoding cannot hold fails the record with
/// SQLSTATE 22P05 as the text itself did before migration 12), so that reading it back never has to convert.
macro_rules! claim_insert {
    () => {
        r#"INSERT INTO idemflow.dedup (pipeline, key_id, key_text, topic, partition, "offset", fingerprint)
SELECT $1, u.key_id,
       CASE WHEN u.key_text IS NULL AND (SELECT current_setting('server_encoding') <> 'UTF8')
            THEN convert_from(u.key_id, 'UTF8') ELSE u.key_text END,
       u.topic, u.partition, u."offset", u.fingerprint
FROM unnest($2::bytea[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::bytea[])
     AS u(key_id, key_text, topic, partition, "offset", fingerprint)
ON CONFLICT (pipeline, key_id) DO NOTHING
RETURNING key_id"#
    };
}

/// The claim alone, its new keys gathered into one array.
const CLAIM: &str = concat!("WITH new AS (\n", claim_insert!(), ")\nSELECT array_agg(key_id) FROM new");

/// The claim's `INSERT`, for a statement that does more with the keys it returns (the table form's
/// [`super::side_effect`] claim-and-insert): a CTE named `new` of it.
pub(super) const CLAIM_INSERT: &str = claim_insert!();

const EXISTING: &str = r#"
SELECT key_id, topic, partition, "offset", fingerprint
FROM idemflow.dedup
WHERE pipeline = $1 AND key_id = ANY($2::bytea[])"#;

/// The claim's parameters `$2` to `$7`, one array each, in the claims' order.
struct ClaimArrays<'a> {
    ids: KeyIds<'a>,
    /// The key's text where its id is not the text (keys over 64 bytes), else NULL.
    keys: Vec<Option<&'a str>>,
    topics: Vec<&'a str>,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
    prints: Vec<&'a [u8]>,
}

impl<'a> ClaimArrays<'a> {
    fn new(claims: &'a [Claim<'a>]) -> Self {
        let n = claims.len();
        let mut a = ClaimArrays {
            ids: KeyIds::new(claims.iter().map(|c| c.key)),
            keys: Vec::with_capacity(n),
            topics: Vec::with_capacity(n),
            partitions: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n),
            prints: Vec::with_capacity(n),
        };
        for c in claims {
            a.keys.push((!c.key.id_is_text()).then_some(c.key.text.as_str()));
            a.topics.push(&c.position.topic);
            a.partitions.push(c.position.partition);
            a.offsets.push(c.position.offset);
            a.prints.push(&c.fingerprint[..FINGERPRINT_BYTES]);
        }
        a
    }

    /// Binds `$1` (the pipeline) and the arrays to `query`.
    fn bind<'q, O>(
        &'q self,
        query: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
        pipeline: &'q str,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        query
            .bind(pipeline)
            .bind(self.ids.ids())
            .bind(&self.keys)
            .bind(&self.topics)
            .bind(&self.partitions)
            .bind(&self.offsets)
            .bind(&self.prints)
    }

    /// The digests of the ids a statement returned (NULL when no key was new).
    fn new_keys(&self, returned: Option<Vec<Vec<u8>>>) -> Result<crate::store::rows::Digests, sqlx::Error> {
        let digests = self.ids.digests();
        returned.unwrap_or_default().iter().map(|id| digests.get(id)).collect()
    }
}

/// Claims distinct keys in one statement. Returns the digests of the keys that were new.
pub async fn claim(
    conn: &mut PgConnection,
    pipeline: &str,
    claims: &[Claim<'_>],
) -> Result<crate::store::rows::Digests, sqlx::Error> {
    let arrays = ClaimArrays::new(claims);
    // A row per new key cost the worker about 7% of its CPU in the driver's row handling (`idemflow bench` run (1)
    // under `perf`); the array is one row. NULL when no key was new.
    let returned: Option<Vec<Vec<u8>>> =
        arrays.bind(sqlx::query_scalar(CLAIM), pipeline).persistent(super::persistent()).fetch_one(&mut *conn).await?;
    arrays.new_keys(returned)
}

/// Claims distinct keys and inserts the table form's rows of those that were new, in one statement: `sql` is the
/// side effect's claim-and-insert ([`CLAIM_INSERT`] as `new`, then the table's `INSERT` of the rows whose key id is
/// in `new`); `rows` are the records of the claims, one each, in the order their rows are inserted, with `columns`
/// values each. Returns the digests of the keys that were new.
pub async fn claim_and_insert(
    conn: &mut PgConnection,
    sql: &str,
    columns: usize,
    pipeline: &str,
    claims: &[Claim<'_>],
    rows: &[&Apply],
) -> Result<crate::store::rows::Digests, sqlx::Error> {
    let arrays = ClaimArrays::new(claims);
    let row_ids = KeyIds::new(rows.iter().map(|r| &r.key));
    let mut query = arrays.bind(sqlx::query_scalar(sql), pipeline).bind(row_ids.ids());
    for c in 0..columns {
        let column: Vec<Option<&str>> = rows.iter().map(|r| r.values[c].as_deref()).collect();
        query = query.bind(column);
    }
    let returned: Option<Vec<Vec<u8>>> = query.persistent(super::persistent()).fetch_one(&mut *conn).await?;
    arrays.new_keys(returned)
}

/// Reads the dedup rows of keys that the claim did not return, by their keys' digests.
pub async fn existing(
    conn: &mut PgConnection,
    pipeline: &str,
    keys: &[&BusinessKey],
) -> Result<Vec<([u8; 32], Existing)>, sqlx::Error> {
    type Row = (Vec<u8>, String, i32, i64, Vec<u8>);
    let ids = KeyIds::new(keys.iter().copied());
    let rows: Vec<Row> =
        sqlx::query_as(EXISTING).bind(pipeline).bind(ids.ids()).persistent(super::persistent()).fetch_all(&mut *conn).await?;
    let digests = ids.digests();
    rows.into_iter()
        .map(|(id, topic, partition, offset, fingerprint)| {
            Ok((digests.get(&id)?, Existing { position: Position { topic: topic.into(), partition, offset }, fingerprint }))
        })
        .collect()
}

/// Adds `$3` duplicates to the count of each key id in `$2` (in key id order), for the dedup row it counts for: a
/// count left by an earlier row of the key (purged, then claimed again) starts over; a count of a later row is never
/// overwritten by one of an earlier. The dedup rows counted for are share-locked (`FOR KEY SHARE`) until the batch
/// ends, so the retention sweep (which skips locked rows) cannot delete a row while its count is being written and
/// leave the count behind; a row the sweep deleted first is not counted.
const COUNT_DUPLICATES: &str = r#"
INSERT INTO idemflow.dedup_duplicates AS c (pipeline, key_id, applied_at, duplicates, last_duplicate_at)
SELECT d.pipeline, d.key_id, d.applied_at, u.n, now()
FROM unnest($2::bytea[], $3::int8[]) WITH ORDINALITY AS u(key_id, n, i)
JOIN idemflow.dedup d ON d.pipeline = $1 AND d.key_id = u.key_id
ORDER BY u.i
FOR KEY SHARE OF d
ON CONFLICT (pipeline, key_id) DO UPDATE
SET duplicates = CASE WHEN c.applied_at = EXCLUDED.applied_at THEN c.duplicates + EXCLUDED.duplicates ELSE EXCLUDED.duplicates END,
    applied_at = EXCLUDED.applied_at,
    last_duplicate_at = EXCLUDED.last_duplicate_at
WHERE c.applied_at <= EXCLUDED.applied_at"#;

/// Adds skipped duplicates to their keys' counts (`idemflow.dedup_duplicates`: `duplicates`,
/// `last_duplicate_at`), one statement for a batch. Keys whose dedup row is not there (a duplicate of a
/// dead-lettered record) are left alone.
pub async fn count_duplicates(
    conn: &mut PgConnection,
    pipeline: &str,
    counts: &[(&BusinessKey, i64)],
) -> Result<(), sqlx::Error> {
    if counts.is_empty() {
        return Ok(());
    }
    // Rows are written in key id order, so two workers counting the same keys cannot deadlock.
    let mut sorted: Vec<(std::borrow::Cow<'_, [u8]>, i64)> = counts.iter().map(|(k, n)| (k.key_id(), *n)).collect();
    sorted.sort_unstable();
    let ids: Vec<&[u8]> = sorted.iter().map(|(id, _)| &id[..]).collect();
    let ns: Vec<i64> = sorted.iter().map(|(_, n)| *n).collect();
    sqlx::query(COUNT_DUPLICATES).bind(pipeline).bind(&ids).bind(&ns).persistent(super::persistent()).execute(&mut *conn).await?;
    Ok(())
}

/// What `explain` and `dedup forget` show of a dedup row `d` and its duplicate count `c` (which may be missing):
/// [`crate::store::rows::ExplainedRow`]'s columns. A key whose id is its text has no `key_text`.
const SHOWN: &str = r#"coalesce(d.key_text, convert_from(d.key_id, 'UTF8')), d.applied_at::text, d.topic, d.partition, d."offset",
       encode(d.fingerprint, 'hex'), coalesce(c.duplicates, 0), c.last_duplicate_at::text"#;

/// The dedup row `d` with its count `c`, when the count is this row's.
const WITH_COUNT: &str =
    "idemflow.dedup d LEFT JOIN idemflow.dedup_duplicates c ON c.pipeline = d.pipeline AND c.key_id = d.key_id AND c.applied_at = d.applied_at";

/// Looks a business key up by its canonical text.
pub async fn explain(conn: &mut PgConnection, pipeline: &str, key: &BusinessKey) -> Result<Option<Explained>, sqlx::Error> {
    let row: Option<crate::store::rows::ExplainedRow> =
        sqlx::query_as(&format!("SELECT {SHOWN} FROM {WITH_COUNT} WHERE d.pipeline = $1 AND d.key_id = $2"))
            .bind(pipeline)
            .bind(&key.key_id()[..])
            .persistent(super::persistent())
            .fetch_optional(&mut *conn)
            .await?;
    Ok(row.map(Explained::from))
}

/// `idemflow dedup forget`: the dedup rows of `pipeline` that `what` names, deleted (or only read, with `dry_run`)
/// in one transaction with their duplicate counts, and the processed floors of their partitions lowered to the
/// lowest offset forgotten on each (else a record below the floor would be skipped as processed: see
/// [`crate::offsets::Mark::floor`]). Returns the rows as they were.
///
/// Errors: the database's.
pub async fn forget(pool: &sqlx::PgPool, pipeline: &str, what: &Forget, dry_run: bool) -> Result<Forgotten, sqlx::Error> {
    // `{which}`: the rows' condition on `d`.
    let statement = |which: &str| {
        if dry_run {
            format!("SELECT {SHOWN} FROM {WITH_COUNT} WHERE d.pipeline = $1 AND {which}")
        } else {
            format!(
                "WITH gone AS (DELETE FROM idemflow.dedup d WHERE d.pipeline = $1 AND {which} RETURNING d.*), \
                 counts AS (DELETE FROM idemflow.dedup_duplicates c USING gone WHERE c.pipeline = gone.pipeline AND c.key_id = gone.key_id RETURNING c.*) \
                 SELECT {SHOWN} FROM gone d LEFT JOIN counts c ON c.key_id = d.key_id AND c.applied_at = d.applied_at"
            )
        }
    };
    let mut tx = pool.begin().await?;
    let rows: Vec<crate::store::rows::ExplainedRow> = match what {
        Forget::Keys(keys) => {
            let ids: Vec<Vec<u8>> = keys.iter().map(|k| k.key_id().to_vec()).collect();
            sqlx::query_as(&statement("d.key_id = ANY($2)"))
                .bind(pipeline)
                .bind(&ids)
                .persistent(super::persistent())
                .fetch_all(&mut *tx)
                .await?
        }
        Forget::Positions { topic, partition, from, to } => {
            sqlx::query_as(&statement(r#"d.topic = $2 AND d.partition = $3 AND d."offset" BETWEEN $4 AND $5"#))
                .bind(pipeline)
                .bind(topic)
                .bind(partition)
                .bind(from)
                .bind(to)
                .persistent(super::persistent())
                .fetch_all(&mut *tx)
                .await?
        }
    };
    let rows: Vec<Explained> = rows.into_iter().map(Explained::from).collect();
    let mut floors = Vec::new();
    for ((topic, partition), lowest) in floors_to_lower(what, &rows) {
        let floor: Option<i64> = sqlx::query_scalar(
            "SELECT coalesce(resume_from, next_offset) FROM idemflow.processed WHERE pipeline = $1 AND topic = $2 AND partition = $3 FOR UPDATE",
        )
        .bind(pipeline)
        .bind(topic)
        .bind(partition)
        .persistent(super::persistent())
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(floor) = floor.filter(|f| *f > lowest) {
            floors.push((topic.to_owned(), partition, floor, lowest));
            if !dry_run {
                super::offsets::lower_floor(&mut tx, pipeline, topic, partition, lowest).await?;
            }
        }
    }
    tx.commit().await?;
    Ok(Forgotten { rows, floors, running: Vec::new() })
}

/// The lanes of `pipeline` that recorded a batch attempt within `within` (a worker running), with when.
///
/// Errors: the database's.
pub async fn recent_attempts(pool: &sqlx::PgPool, pipeline: &str, within: std::time::Duration) -> Result<Vec<(String, String)>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let lanes = sqlx::query_as("SELECT owner, updated_at::text FROM idemflow.attempts WHERE pipeline = $1 AND updated_at > now() - make_interval(secs => $2) ORDER BY updated_at DESC")
        .bind(pipeline)
        .bind(within.as_secs_f64())
        .persistent(super::persistent())
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(lanes)
}
