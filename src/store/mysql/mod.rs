//! The MySQL and MariaDB store: `mysql://` or `mariadb://` URLs. idemflow's tables (`idemflow_dedup`,
//! `idemflow_dead_letters`, `idemflow_offsets`, `idemflow_processed`, from `migrations/mysql/`) live in the URL's
//! database beside the business tables, so one InnoDB transaction spans both.
//!
//! Every session idemflow opens runs with:
//! - `sql_mode = 'STRICT_ALL_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION,
//!   PIPES_AS_CONCAT'`, whatever the server's default: a value that does not fit its column is an error (the record
//!   is dead-lettered with it), never a silent 0, a truncation or a zero date (MySQL Reference Manual, "Server SQL
//!   Modes": strict mode); `||` concatenates, as in PostgreSQL (and as sqlx sets it by default);
//! - `group_concat_max_len = 1048576`: the schema probe of a wide table is never cut at MySQL's default 1024 bytes;
//! - `time_zone = '+00:00'` (sqlx's default): `TIMESTAMP` values are written and read as UTC;
//! - `NAMES utf8mb4`: 4-byte UTF-8 reaches the server intact;
//! - `TRANSACTION ISOLATION LEVEL READ COMMITTED`, as PostgreSQL's default: a read after a claim that waited for
//!   another worker's row sees that worker's committed row, and InnoDB takes no gap locks for the claim.
//!
//! - [`dedup`]: the claim (`INSERT IGNORE ... RETURNING` on MariaDB, a claim token on MySQL), existing rows,
//!   duplicate counts, `explain`.
//! - [`side_effect`]: the table form (multi-row `INSERT`s) and the SQL form (`:name` parameters).
//! - [`dead_letter`], [`offsets`], [`retention`] (`GET_LOCK` and `DELETE ... ORDER BY ... LIMIT`), [`error`].

pub mod dead_letter;
pub mod dedup;
pub mod error;
pub use error::savepoint_gone;
pub mod offsets;
pub mod rename;
pub mod outbox;
pub mod retention;
pub mod side_effect;
pub mod connector;

use crate::store::contract::NotReady;
use crate::store::spec::DatabaseSettings;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{ConnectOptions as _, Executor as _};
use std::sync::Arc;

/// The migrations in `migrations/mysql/`, embedded in the binary. sqlx records applied versions in
/// `_sqlx_migrations` and serialises concurrent runs with `GET_LOCK`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/mysql");

/// The session settings run on every new connection (see the module documentation). On MariaDB (its executable
/// comment `/*M! ... */`, which MySQL reads past) also `idle_transaction_timeout` (a transaction left idle by a
/// vanished worker is ended, [`crate::store::spec::IDLE_IN_TRANSACTION_TIMEOUT`]) and `innodb_lock_wait_timeout`
/// below `max_statement_time` when that is set (a lock wait then ends as error 1205, retried, and not as a statement
/// past its time limit, which the sink takes for a record too slow: whole seconds, so not below 1).
pub const SESSION: &str = "SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION,PIPES_AS_CONCAT', \
     SESSION group_concat_max_len = 1048576, SESSION autocommit = 1, SESSION completion_type = 0 \
     /*M!100300 , SESSION idle_transaction_timeout = 15, SESSION innodb_lock_wait_timeout = CAST(IF(@@max_statement_time > 0 \
       AND @@innodb_lock_wait_timeout >= @@max_statement_time, GREATEST(1, FLOOR(@@max_statement_time * 0.9)), \
       @@innodb_lock_wait_timeout) AS UNSIGNED) */; \
     SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// How the claim learns which keys were new (see [`dedup`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimForm {
    /// MariaDB 10.5 and later: `INSERT IGNORE ... RETURNING key_id` returns only the rows it inserted.
    Returning,
    /// MySQL (no `RETURNING`): the rows are inserted with a token unique to the claim, then the rows carrying it
    /// are read back.
    Token,
}

/// A MySQL or MariaDB store: the pool, and the claim form its server supports (read at the first claim).
#[derive(Clone, Debug)]
pub struct MySqlStore {
    /// The pool.
    pub pool: MySqlPool,
    claim: Arc<tokio::sync::OnceCell<ClaimForm>>,
}

impl MySqlStore {
    /// A store on `pool` whose claim form is read from the server's version.
    pub fn new(pool: MySqlPool) -> Self {
        MySqlStore { pool, claim: Arc::default() }
    }

    /// A store on `pool` that claims with `form` whatever the server (the tests run [`ClaimForm::Token`], MySQL's
    /// path, on MariaDB).
    pub fn with_claim_form(pool: MySqlPool, form: ClaimForm) -> Self {
        MySqlStore { pool, claim: Arc::new(tokio::sync::OnceCell::new_with(Some(form))) }
    }

    /// The claim form: [`ClaimForm::Returning`] on MariaDB 10.5 and later, [`ClaimForm::Token`] otherwise.
    ///
    /// Errors: the version cannot be read.
    pub async fn claim_form(&self) -> Result<ClaimForm, sqlx::Error> {
        let pool = self.pool.clone();
        self.claim
            .get_or_try_init(|| async move {
                let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(&pool).await?;
                Ok(claim_form_of(&version))
            })
            .await
            .copied()
    }
}

/// The claim form for a server `VERSION()`: `10.11.6-MariaDB-0+deb12u1` supports `RETURNING` (10.5 and later),
/// `8.0.36` (MySQL) does not.
pub fn claim_form_of(version: &str) -> ClaimForm {
    if !version.contains("MariaDB") {
        return ClaimForm::Token;
    }
    let mut parts = version.split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) >= (10, 5) {
        ClaimForm::Returning
    } else {
        ClaimForm::Token
    }
}

/// The connect options for `settings`: a `mariadb://` URL is read as `mysql://`; `prepared_statements = false`
/// turns the statement cache off.
///
/// Errors: the URL does not parse.
pub fn connect_options(settings: &DatabaseSettings) -> Result<MySqlConnectOptions, sqlx::Error> {
    crate::install_tls_provider();
    let url = settings.url.expose();
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_owned(),
    };
    let options: MySqlConnectOptions = url.parse()?;
    let options = if settings.prepared_statements { options } else { options.statement_cache_capacity(0) };
    Ok(options
        .charset("utf8mb4")
        .timezone(Some("+00:00".to_owned()))
        .log_slow_statements(log::LevelFilter::Debug, std::time::Duration::from_secs(1)))
}

/// Errors unless the URL names a database (`mysql://user:password@host:3306/DATABASE`): idemflow's tables go
/// there, beside the business tables.
fn require_database(settings: &DatabaseSettings) -> Result<(), sqlx::Error> {
    let named = url::Url::parse(settings.url.expose()).is_ok_and(|u| !u.path().trim_matches('/').is_empty());
    if named {
        Ok(())
    } else {
        Err(sqlx::Error::Configuration(
            format!("{} names no database: write mysql://user:password@host:3306/DATABASE", settings.url).into(),
        ))
    }
}

/// The server's `max_allowed_packet` in bytes: the largest statement (values included) it accepts. A larger one is
/// not refused with an error but makes the server close the connection.
pub async fn max_allowed_packet(conn: &mut sqlx::MySqlConnection) -> Result<u64, sqlx::Error> {
    sqlx::query_scalar::<_, u64>("SELECT CAST(@@max_allowed_packet AS UNSIGNED)").fetch_one(&mut *conn).await
}

/// What a statement carries besides one record's values (the SQL text, the dedup row, the dead letter's other
/// columns), kept free under `max_allowed_packet`.
pub const PACKET_MARGIN: u64 = 64 << 10;

/// The savepoint set right after `BEGIN` of every batch transaction ([`mark_transaction`]).
const BATCH_SAVEPOINT: &str = "idemflow_batch";

/// Marks the batch transaction just opened: a savepoint that any end of the transaction deletes (`COMMIT`,
/// `ROLLBACK`, an implicit commit), even when a new transaction was started after it (a procedure's `COMMIT; START
/// TRANSACTION`, `completion_type = CHAIN`).
pub async fn mark_transaction(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
    conn.execute(sqlx::raw_sql(&format!("SAVEPOINT {BATCH_SAVEPOINT}"))).await.map(drop)
}

/// Whether `conn` is still inside the batch transaction [`mark_transaction`] marked: its savepoint is still there
/// (`RELEASE SAVEPOINT` fails with error 1305, ER_SP_DOES_NOT_EXIST, once anything ended that transaction). It
/// releases the mark, so it is asked once, before `COMMIT` or before the batch is rolled back to be redone.
pub async fn transaction_open(conn: &mut sqlx::MySqlConnection) -> Result<bool, sqlx::Error> {
    match conn.execute(sqlx::raw_sql(&format!("RELEASE SAVEPOINT {BATCH_SAVEPOINT}"))).await {
        Ok(_) => Ok(true),
        Err(e) if savepoint_gone(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// A pool that connects on first use; every connection gets the [`SESSION`] settings.
///
/// Errors: the URL does not parse or names no database.
pub fn pool(settings: &DatabaseSettings) -> Result<MySqlPool, sqlx::Error> {
    require_database(settings)?;
    Ok(MySqlPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .after_connect(|conn, _| Box::pin(async move { conn.execute(sqlx::raw_sql(SESSION)).await.map(drop) }))
        .connect_lazy_with(connect_options(settings)?))
}

/// Connects once, directly, to tell whether the database is reachable, with the server's or the network's own
/// reason when it is not. The error never contains the password.
pub async fn ping(settings: &DatabaseSettings) -> Result<(), NotReady> {
    use sqlx::Connection as _;
    let url = &settings.url;
    require_database(settings).map_err(|e| NotReady::Refused(url.scrub(&e.to_string())))?;
    let options = connect_options(settings).map_err(|e| NotReady::Refused(format!("cannot connect to {url}: {}", url.scrub(&e.to_string()))))?;
    match tokio::time::timeout(settings.acquire_timeout, sqlx::MySqlConnection::connect_with(&options)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        // Waited for where a batch would retry; refused where it never would (access denied 1045, unknown database 1049).
        Ok(Err(e)) => Err(NotReady::after(error::classify_error(&e), format!("cannot connect to {url}: {}", url.scrub(&e.to_string())))),
        Err(_) => Err(NotReady::Unavailable(format!("cannot connect to {url}: no answer within {:?}", settings.acquire_timeout))),
    }
}

/// Whether the binary log, when it is on, takes row-based events: with `binlog_format = STATEMENT` InnoDB refuses
/// every write in `READ COMMITTED` (error 1665), which idemflow's sessions use.
///
/// Errors: [`NotReady::Refused`] with the format to change; the server's error, [`NotReady::Unavailable`] where
/// a batch would retry it.
pub async fn check_binlog(pool: &MySqlPool) -> Result<(), NotReady> {
    let (log_bin, format): (i64, Option<String>) = sqlx::query_as("SELECT @@log_bin, CAST(@@binlog_format AS CHAR)")
        .fetch_one(pool)
        .await
        .map_err(|e| asked("cannot read the binary log's settings", e))?;
    match format.as_deref() {
        Some(f) if log_bin != 0 && f.eq_ignore_ascii_case("STATEMENT") => Err(NotReady::Refused(
            "the binary log is on with binlog_format = STATEMENT, with which InnoDB refuses writes in READ COMMITTED \
             (error 1665), the isolation idemflow's sessions use: set binlog_format to ROW (MySQL 8's default) or MIXED"
                .to_owned(),
        )),
        _ => Ok(()),
    }
}

/// Whether idemflow's tables are migrated to the latest version this binary knows, and `idemflow_dedup` still has
/// its primary key `(pipeline, key_id)`, which the claim depends on (and the binary log's format suits it,
/// [`check_binlog`]).
///
/// `what` failed with `e`: [`NotReady::Unavailable`] where a batch would retry it ([`error::classify_error`]).
fn asked(what: &str, e: sqlx::Error) -> NotReady {
    NotReady::after(error::classify_error(&e), format!("{what}: {}", error::describe_error(&e)))
}

/// Errors: [`NotReady::Refused`] with what is missing and what to run; [`NotReady::Unavailable`] when the server
/// could not be asked.
pub async fn check_schema(pool: &MySqlPool) -> Result<(), NotReady> {
    check_binlog(pool).await?;
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default();
    let applied: Option<i64> = sqlx::query_scalar(
        "SELECT MAX(version) FROM _sqlx_migrations WHERE success AND EXISTS (SELECT 1 FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idemflow_dedup')",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|m| m.number() == 1146) => {
            NotReady::Refused("the idemflow tables are missing: run `idemflow migrate --config ...` first".to_owned())
        }
        _ => asked("cannot read the schema version", e),
    })?;
    match applied {
        Some(v) if v >= latest => {}
        Some(v) => return Err(NotReady::Refused(format!("the idemflow schema is at version {v}, this binary needs {latest}: run `idemflow migrate`"))),
        None => return Err(NotReady::Refused("the idemflow tables are missing: run `idemflow migrate --config ...` first".to_owned())),
    }
    let key: Vec<String> = sqlx::query_scalar(
        "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() \
         AND TABLE_NAME = 'idemflow_dedup' AND INDEX_NAME = 'PRIMARY' ORDER BY SEQ_IN_INDEX",
    )
    .fetch_all(pool)
    .await
    .map_err(|e| asked("cannot read the dedup store's indexes", e))?;
    if key == ["pipeline", "key_id"] {
        Ok(())
    } else {
        Err(NotReady::Refused(
            "idemflow_dedup has no primary key on (pipeline, key_id), which the claim needs to apply each key \
             once: restore it (ALTER TABLE idemflow_dedup ADD PRIMARY KEY (pipeline, key_id))"
                .to_owned(),
        ))
    }
}

/// `?, ?, ?` for `n` parameters.
pub(crate) fn marks(n: usize) -> String {
    let mut s = String::with_capacity(n * 3);
    for i in 0..n {
        if i > 0 {
            s.push_str(", ");
        }
        s.push('?');
    }
    s
}

/// `row` repeated `n` times, comma-separated: the `VALUES` list of a multi-row statement, such as
/// `(?, ?), (?, ?)`.
pub(crate) fn rows(row: &str, n: usize) -> String {
    vec![row; n].join(", ")
}

/// The most placeholders one statement may carry (the protocol counts them in 16 bits).
pub(crate) const MAX_PARAMS: usize = 65_535;

/// Splits `rows` into runs that fit in one statement: at most [`MAX_PARAMS`] placeholders of `per_row` each, and
/// about `max_bytes` of bound data (`bytes` of a row), so no statement approaches `max_allowed_packet` (16 MiB
/// by default on MariaDB, 64 MiB on MySQL 8).
pub(crate) fn chunks<T>(rows: &[T], per_row: usize, bytes: impl Fn(&T) -> usize) -> Vec<&[T]> {
    // Well inside the smallest max_allowed_packet in common use (1 MiB): a statement over the server's limit is not
    // an error the server answers but a connection it closes, which would be retried forever.
    const MAX_BYTES: usize = 512 << 10;
    let per_row = per_row.max(1);
    // A few placeholders of every statement are not per row (the pipeline name).
    const MAX_PARAMS_PER_STATEMENT: usize = MAX_PARAMS - 16;
    let mut out = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, row) in rows.iter().enumerate() {
        let b = bytes(row);
        if i > start && ((i - start + 1) * per_row > MAX_PARAMS_PER_STATEMENT || size + b > MAX_BYTES) {
            out.push(&rows[start..i]);
            (start, size) = (i, 0);
        }
        size += b;
    }
    if start < rows.len() {
        out.push(&rows[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_form_by_server_version() {
        assert_eq!(claim_form_of("10.11.6-MariaDB-0+deb12u1"), ClaimForm::Returning);
        assert_eq!(claim_form_of("10.5.2-MariaDB"), ClaimForm::Returning);
        assert_eq!(claim_form_of("10.4.30-MariaDB"), ClaimForm::Token);
        assert_eq!(claim_form_of("8.0.36"), ClaimForm::Token);
    }

    #[test]
    fn statements_stay_within_placeholders_and_bytes() {
        let rows = vec![10usize; 30_000];
        let c = chunks(&rows, 7, |b| *b);
        assert!(c.iter().all(|c| c.len() * 7 <= MAX_PARAMS));
        assert_eq!(c.iter().map(|c| c.len()).sum::<usize>(), 30_000);
        let big = vec![3 << 20; 3];
        assert_eq!(chunks(&big, 1, |b| *b).len(), 3);
    }

    /// MariaDB's idle-transaction bound is the one the docs give for every store.
    #[test]
    fn the_session_bounds_an_idle_transaction_as_documented() {
        let secs = crate::store::spec::IDLE_IN_TRANSACTION_TIMEOUT.as_secs();
        assert!(SESSION.contains(&format!("SESSION idle_transaction_timeout = {secs},")), "{SESSION}");
    }
}
