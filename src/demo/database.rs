//! The demo's database: a new database on PostgreSQL (a throwaway cluster, or `--database-url postgres://...`) or
//! on MySQL/MariaDB (`--database-url mysql://...`), with idemflow's tables, the pipeline's business tables and the
//! accounts; or Redis (`--redis`: a throwaway `redis-server`, or `--database-url redis://...`), where the example
//! keeps payments as hashes and each account's running total; and the figures the demo reads back from it.

use crate::store::Store;
use anyhow::Context as _;
use sqlx::{Connection as _, Executor as _};

/// A database the demo created.
pub enum DemoDb {
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// MySQL or MariaDB.
    MySql(sqlx::MySqlPool),
    /// Redis: the store, a client for reading back, the throwaway server if the demo started one.
    Redis(crate::store::redis::RedisStore, redis::Client, Option<super::redis::Throwaway>),
}

/// What the business tables say at the end.
pub struct Totals {
    /// Rows in `payments`.
    pub rows: i64,
    /// Distinct order ids in `payments`.
    pub distinct_rows: i64,
    /// Opening balances minus current balances, in cents.
    pub deducted_cents: i128,
    /// The sum of `payments.amount`, in cents.
    pub applied_cents: i128,
}

/// What idemflow's own tables say of pipeline `payments` at the end (the soak's checks).
pub struct Ledger {
    /// Dedup rows (Redis: dedup keys).
    pub dedup_rows: i64,
    /// The duplicates counted in them.
    pub duplicates: i64,
    /// Dead letters.
    pub dead_letters: i64,
    /// Distinct payloads among the dead letters.
    pub dead_payloads: i64,
    /// The dead letters' reasons, each once, sorted.
    pub dead_reasons: Vec<String>,
}

/// `"123.45"` (or `-0.5`, `7`) in cents; `None` when it has more than two decimals or is not a number.
fn cents(text: &str) -> Option<i128> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let fraction = fraction.trim_end_matches('0');
    if fraction.len() > 2 {
        return None;
    }
    let value = whole.parse::<i128>().ok()? * 100 + format!("{fraction:0<2}").parse::<i128>().ok()?;
    Some(if negative { -value } else { value })
}

impl DemoDb {
    /// Creates database `name` on the server at `admin_url`; returns it and its URL.
    ///
    /// Errors: the server cannot be reached or refuses.
    pub async fn create(admin_url: &str, name: &str) -> anyhow::Result<(DemoDb, String)> {
        let base = admin_url.rsplit_once('/').map_or(admin_url, |(b, _)| b);
        let url = format!("{base}/{name}");
        let settings = crate::store::spec::DatabaseSettings {
            url: url.clone().into(),
            max_connections: 4,
            acquire_timeout: std::time::Duration::from_secs(10),
            prepared_statements: true,
            batch_timeout: crate::store::spec::DEFAULT_BATCH_TIMEOUT,
        };
        let db = match crate::store::template::Dialect::of_url(admin_url) {
            crate::store::template::Dialect::Postgres => {
                let mut admin = sqlx::PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
                admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
                let _ = admin.close().await;
                DemoDb::Postgres(crate::store::postgres::pool(&settings)?)
            }
            crate::store::template::Dialect::MySql => {
                let admin_settings = crate::store::spec::DatabaseSettings { url: format!("{base}/").into(), ..settings.clone() };
                let options = crate::store::mysql::connect_options(&admin_settings)?;
                let mut admin = sqlx::MySqlConnection::connect_with(&options).await.context("connecting to MySQL/MariaDB")?;
                admin.execute(format!("CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin").as_str()).await?;
                let _ = admin.close().await;
                DemoDb::MySql(crate::store::mysql::pool(&settings)?)
            }
        };
        Ok((db, url))
    }

    /// Redis at `url`, or a throwaway server when `None`; returns it and its URL.
    ///
    /// Errors: no `redis-server` to start, or the URL does not parse.
    pub fn redis(url: Option<&str>) -> anyhow::Result<(DemoDb, String)> {
        let (server, url) = match url {
            Some(u) => (None, u.to_owned()),
            None => {
                let t = super::redis::Throwaway::start()?;
                let u = t.url();
                (Some(t), u)
            }
        };
        let settings = Self::redis_settings(&url);
        let store = crate::store::redis::RedisStore::new(&settings).map_err(anyhow::Error::msg)?;
        Ok((DemoDb::Redis(store, redis::Client::open(url.as_str())?, server), url))
    }

    /// The `[redis]` settings of a demo on `url`.
    pub fn redis_settings(url: &str) -> crate::store::spec::RedisSettings {
        crate::store::spec::RedisSettings {
            url: url.to_owned().into(),
            key_prefix: "idemflow:".into(),
            connect_timeout: std::time::Duration::from_secs(5),
            response_timeout: std::time::Duration::from_secs(30),
            sentinels: Vec::new(),
            sentinel_master: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }

    /// Whether this is Redis.
    pub fn is_redis(&self) -> bool {
        matches!(self, DemoDb::Redis(..))
    }

    /// Whether this is MySQL or MariaDB.
    pub fn is_mysql(&self) -> bool {
        matches!(self, DemoDb::MySql(_))
    }

    /// Migrates idemflow's tables, creates the business tables (`tables_sql`) and `accounts` accounts
    /// `ACC-0`.. with `opening_cents` each.
    pub async fn setup(&self, tables_sql: &str, accounts: usize, opening_cents: i64) -> anyhow::Result<()> {
        let opening = format!("{}.{:02}", opening_cents / 100, opening_cents % 100);
        let values: Vec<String> = (0..accounts).map(|i| format!("('ACC-{i}', {opening})")).collect();
        let insert = format!("INSERT INTO accounts (account_id, balance) VALUES {}", values.join(", "));
        match self {
            DemoDb::Postgres(pool) => {
                crate::store::postgres::MIGRATOR.run(pool).await?;
                sqlx::raw_sql(tables_sql).execute(pool).await.context("creating the business tables")?;
                sqlx::raw_sql(&insert).execute(pool).await?;
            }
            DemoDb::MySql(pool) => {
                crate::store::mysql::MIGRATOR.run(pool).await?;
                sqlx::raw_sql(tables_sql).execute(pool).await.context("creating the business tables")?;
                sqlx::raw_sql(&insert).execute(pool).await?;
            }
            // Redis needs no schema; the example's accounts are running totals that start at nothing.
            DemoDb::Redis(..) => {}
        }
        Ok(())
    }

    /// The store for the worker.
    pub fn store(&self) -> Store {
        match self {
            DemoDb::Postgres(pool) => Store::Postgres(pool.clone()),
            DemoDb::MySql(pool) => Store::MySql(crate::store::mysql::MySqlStore::new(pool.clone())),
            DemoDb::Redis(store, ..) => Store::Redis(store.clone()),
        }
    }

    /// `(dedup rows, distinct dead-lettered payloads)` of pipeline `payments` (Redis: entries of the example's
    /// `payments-applied` stream, one per applied payment, and the dead-letter stream's distinct payloads).
    pub async fn progress(&self) -> anyhow::Result<(i64, i64)> {
        Ok(match self {
            DemoDb::Redis(_, client, _) => {
                let mut c = client.get_multiplexed_async_connection().await?;
                let applied: i64 = redis::cmd("XLEN").arg("payments-applied").query_async(&mut c).await?;
                (applied, redis_dead_letters(&mut c).await?.1)
            }
            DemoDb::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'payments'), \
                            (SELECT count(DISTINCT payload) FROM idemflow.dead_letters WHERE pipeline = 'payments')",
                )
                .fetch_one(pool)
                .await?
            }
            DemoDb::MySql(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT COUNT(*) FROM idemflow_dedup WHERE pipeline = 'payments'), \
                            (SELECT COUNT(DISTINCT payload) FROM idemflow_dead_letters WHERE pipeline = 'payments')",
                )
                .fetch_one(pool)
                .await?
            }
        })
    }

    /// What idemflow's tables say of pipeline `payments`.
    ///
    /// Errors: the store cannot be read.
    pub async fn ledger(&self) -> anyhow::Result<Ledger> {
        let (dedup_rows, duplicates, dead_letters, dead_payloads, reasons): (i64, i64, i64, i64, String) = match self {
            DemoDb::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT count(*) FROM idemflow.dedup WHERE pipeline = 'payments'), \
                            (SELECT coalesce(sum(duplicates), 0)::bigint FROM idemflow.dedup_duplicates WHERE pipeline = 'payments'), \
                            (SELECT count(*) FROM idemflow.dead_letters WHERE pipeline = 'payments'), \
                            (SELECT count(DISTINCT payload) FROM idemflow.dead_letters WHERE pipeline = 'payments'), \
                            (SELECT coalesce(string_agg(DISTINCT reason, ',' ORDER BY reason), '') FROM idemflow.dead_letters WHERE pipeline = 'payments')",
                )
                .fetch_one(pool)
                .await?
            }
            DemoDb::MySql(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT COUNT(*) FROM idemflow_dedup WHERE pipeline = 'payments'), \
                            (SELECT CAST(COALESCE(SUM(duplicates), 0) AS SIGNED) FROM idemflow_dedup WHERE pipeline = 'payments'), \
                            (SELECT COUNT(*) FROM idemflow_dead_letters WHERE pipeline = 'payments'), \
                            (SELECT COUNT(DISTINCT payload) FROM idemflow_dead_letters WHERE pipeline = 'payments'), \
                            (SELECT CAST(COALESCE(GROUP_CONCAT(DISTINCT reason ORDER BY reason), '') AS CHAR) FROM idemflow_dead_letters WHERE pipeline = 'payments')",
                )
                .fetch_one(pool)
                .await?
            }
            DemoDb::Redis(_, client, _) => return redis_ledger(client).await,
        };
        let dead_reasons = reasons.split(',').filter(|r| !r.is_empty()).map(str::to_owned).collect();
        Ok(Ledger { dedup_rows, duplicates, dead_letters, dead_payloads, dead_reasons })
    }

    /// What the business tables say, against `accounts` opening balances of `opening_cents`.
    pub async fn totals(&self, accounts: usize, opening_cents: i64) -> anyhow::Result<Totals> {
        if let DemoDb::Redis(_, client, _) = self {
            return redis_totals(client).await;
        }
        let (rows, distinct_rows, balance, applied): (i64, i64, String, String) = match self {
            DemoDb::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT count(*) FROM payments), (SELECT count(DISTINCT order_id) FROM payments), \
                            (SELECT coalesce(sum(balance), 0)::text FROM accounts), (SELECT coalesce(sum(amount), 0)::text FROM payments)",
                )
                .fetch_one(pool)
                .await?
            }
            DemoDb::MySql(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT COUNT(*) FROM payments), (SELECT COUNT(DISTINCT order_id) FROM payments), \
                            (SELECT CAST(COALESCE(SUM(balance), 0) AS CHAR) FROM accounts), \
                            (SELECT CAST(COALESCE(SUM(amount), 0) AS CHAR) FROM payments)",
                )
                .fetch_one(pool)
                .await?
            }
            DemoDb::Redis(..) => unreachable!("answered above"),
        };
        let parse = |t: &str| cents(t).with_context(|| format!("{t:?} is not an amount in cents"));
        Ok(Totals {
            rows,
            distinct_rows,
            deducted_cents: i128::from(opening_cents) * accounts as i128 - parse(&balance)?,
            applied_cents: parse(&applied)?,
        })
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            DemoDb::Postgres(pool) => pool.close().await,
            DemoDb::MySql(pool) => pool.close().await,
            DemoDb::Redis(..) => {}
        }
    }
}

/// Every key matching `pattern` (SCAN).
async fn scan(c: &mut redis::aio::MultiplexedConnection, pattern: &str) -> redis::RedisResult<Vec<String>> {
    let mut cursor = 0u64;
    let mut all: Vec<String> = Vec::new();
    loop {
        let (next, page): (u64, Vec<String>) =
            redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(10_000).query_async(c).await?;
        all.extend(page);
        if next == 0 {
            return Ok(all);
        }
        cursor = next;
    }
}

/// An entry of a Redis stream: its id and its fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// [`DemoDb::ledger`] on Redis: the dedup keys `idemflow:payments:k:*`, whose value is
/// `state|applied at|duplicates|last seen|...` (`src/store/redis/batch.lua`), and the dead-letter stream.
async fn redis_ledger(client: &redis::Client) -> anyhow::Result<Ledger> {
    let mut c = client.get_multiplexed_async_connection().await?;
    let keys = scan(&mut c, "idemflow:payments:k:*").await?;
    let mut duplicates = 0i64;
    for chunk in keys.chunks(1000) {
        let values: Vec<Option<String>> = redis::cmd("MGET").arg(chunk).query_async(&mut c).await?;
        for v in values.into_iter().flatten() {
            duplicates += v.split('|').nth(2).and_then(|d| d.parse::<i64>().ok()).with_context(|| format!("a dedup value {v:?}"))?;
        }
    }
    let (dead_letters, dead_payloads, dead_reasons) = redis_dead_letters(&mut c).await?;
    Ok(Ledger { dedup_rows: keys.len() as i64, duplicates, dead_letters, dead_payloads, dead_reasons })
}

/// The dead-letter stream `idemflow:dead-letters`: its entries, its distinct payloads, its reasons (sorted).
async fn redis_dead_letters(c: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<(i64, i64, Vec<String>)> {
    let entries: Vec<StreamEntry> = redis::cmd("XRANGE").arg("idemflow:dead-letters").arg("-").arg("+").query_async(c).await?;
    let field = |name: &str| -> Vec<Vec<u8>> {
        entries.iter().filter_map(|(_, fields)| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())).collect()
    };
    let payloads: std::collections::BTreeSet<Vec<u8>> = field("payload").into_iter().collect();
    let reasons: std::collections::BTreeSet<String> = field("reason").into_iter().map(|r| String::from_utf8_lossy(&r).into_owned()).collect();
    Ok((entries.len() as i64, payloads.len() as i64, reasons.into_iter().collect()))
}

/// The example's Redis keys, read back: a `payment:<order>` hash per applied payment (its `amount`) and a
/// `balance:<account>` hash per account (its running `total`, a float Redis keeps to 17 significant digits).
async fn redis_totals(client: &redis::Client) -> anyhow::Result<Totals> {
    let mut c = client.get_multiplexed_async_connection().await?;
    let payments = scan(&mut c, "payment:*").await?;
    let mut applied_cents = 0i128;
    for chunk in payments.chunks(1000) {
        let mut pipe = redis::pipe();
        for k in chunk {
            pipe.cmd("HGET").arg(k).arg("amount");
        }
        let amounts: Vec<String> = pipe.query_async(&mut c).await?;
        for a in amounts {
            applied_cents += cents(&a).with_context(|| format!("{a:?} is not an amount in cents"))?;
        }
    }
    let mut deducted_cents = 0i128;
    for k in scan(&mut c, "balance:*").await? {
        let total: String = redis::cmd("HGET").arg(&k).arg("total").query_async(&mut c).await?;
        let value: f64 = total.parse().with_context(|| format!("{k}: {total:?} is not a number"))?;
        deducted_cents += (value * 100.0).round() as i128;
    }
    let rows = payments.len() as i64;
    Ok(Totals { rows, distinct_rows: rows, deducted_cents, applied_cents })
}

#[cfg(test)]
mod tests {
    #[test]
    fn amounts_in_cents() {
        assert_eq!(super::cents("123.45"), Some(12345));
        assert_eq!(super::cents("7"), Some(700));
        assert_eq!(super::cents("-0.5"), Some(-50));
        assert_eq!(super::cents("1.230000"), Some(123));
        assert_eq!(super::cents("1.234"), None);
    }
}
