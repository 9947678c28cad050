//! The demo's database: a new database on PostgreSQL (a throwaway cluster, or `--database-url postgres://...`) or
//! on MySQL/MariaDB (`--database-url mysql://...`), with idemflow's tables, the pipeline's business tables and the
//! accounts; and the figures the demo reads back from it.

use crate::store::Store;
use anyhow::Context as _;
use sqlx::{Connection as _, Executor as _};

/// A database the demo created.
pub enum DemoDb {
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// MySQL or MariaDB.
    MySql(sqlx::MySqlPool),
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
        let settings = crate::config::DatabaseSettings {
            url: url.clone().into(),
            max_connections: 4,
            acquire_timeout: std::time::Duration::from_secs(10),
            prepared_statements: true,
        };
        let db = match crate::config::Dialect::of_url(admin_url) {
            crate::config::Dialect::Postgres => {
                let mut admin = sqlx::PgConnection::connect(admin_url).await.context("connecting to PostgreSQL")?;
                admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
                let _ = admin.close().await;
                DemoDb::Postgres(crate::store::postgres::pool(&settings)?)
            }
            crate::config::Dialect::MySql => {
                let admin_settings = crate::config::DatabaseSettings { url: format!("{base}/").into(), ..settings.clone() };
                let options = crate::store::mysql::connect_options(&admin_settings)?;
                let mut admin = sqlx::MySqlConnection::connect_with(&options).await.context("connecting to MySQL/MariaDB")?;
                admin.execute(format!("CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin").as_str()).await?;
                let _ = admin.close().await;
                DemoDb::MySql(crate::store::mysql::pool(&settings)?)
            }
        };
        Ok((db, url))
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
        }
        Ok(())
    }

    /// The store for the worker.
    pub fn store(&self) -> Store {
        match self {
            DemoDb::Postgres(pool) => Store::Postgres(pool.clone()),
            DemoDb::MySql(pool) => Store::MySql(crate::store::mysql::MySqlStore::new(pool.clone())),
        }
    }

    /// `(dedup rows, distinct dead-lettered payloads)` of pipeline `payments`.
    pub async fn progress(&self) -> anyhow::Result<(i64, i64)> {
        Ok(match self {
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

    /// What the business tables say, against `accounts` opening balances of `opening_cents`.
    pub async fn totals(&self, accounts: usize, opening_cents: i64) -> anyhow::Result<Totals> {
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
        }
    }
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
