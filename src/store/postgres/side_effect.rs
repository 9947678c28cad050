//! The side effect: what a new record does to the business tables.
//!
//! Values arrive as text and are cast by Postgres to the type of their target, read from the catalog (the table
//! form) or from the statement's inferred parameter types (the SQL form), without type modifiers: an explicit
//! cast to `varchar(5)` or `char(5)` would silently truncate, while the assignment to the column checks the length
//! and fails instead. Text input is exact for every type: `numeric` keeps every digit, `timestamptz` keeps the
//! offset's meaning, `jsonb` takes nested objects, arrays take PostgreSQL array literals built from JSON arrays.
//! Payload values are only ever bound as parameters, never spliced into SQL.
//!
//! - Table form: `INSERT INTO t (c1, c2) SELECT CAST(u.c0 AS type1), ... FROM unnest($1::text[], ...)`, one
//!   statement for all new records of a batch.
//! - SQL form: the configured statements with each `:name` replaced by `CAST($n::text AS type)`, run for each new
//!   record in batch order. The fast path runs them for the whole batch in one round trip: a PL/pgSQL function
//!   in the session's temporary schema ([`SqlLoop`]) loops over the records, one text array holding every value,
//!   and runs the statements for each record in order, so later records see earlier ones' effects exactly as
//!   with one round trip per statement. The slow path (a record failed) runs them per record, as prepared
//!   statements (sqlx caches them per connection), each record in its savepoint.
//! - Batch SQL form (`batch_sql`): the configured statements, each run once per batch with the relation
//!   `new_records` (the batch's new records, one text array per column cast to the column's declared type) put
//!   first in its `WITH` list; the slow path runs them once per record, `new_records` holding that record.
//!
//! # Never through a stale type
//!
//! The types are read when the pipeline starts, and the schema may change while it runs (`ALTER TABLE ... ALTER
//! COLUMN ... TYPE`). Each batch transaction therefore starts with [`SideEffect::begin`], one round trip that
//! first takes the locks the side effect's statements take anyway (`LOCK TABLE ... IN ROW EXCLUSIVE MODE` for the
//! table form; for the SQL forms, `PREPARE` of each statement, whose parse analysis takes the same locks as its
//! execution), so no schema change can commit until the batch does, and then reads the schema again: the table's
//! identity, columns, types, NOT NULL, defaults and primary key, or each statement's inferred parameter types.
//! When that differs from what the statements were built from, the batch rolls back with
//! `SinkError::SchemaChanged` (the sink) and the worker rebuilds the statements and prepares the records again,
//! before anything was written (PostgreSQL docs, "Explicit Locking": locks are held until the transaction ends).
//!
//! # Time zones
//!
//! The same round trip sets `SET LOCAL TIME ZONE` to the pipeline's `time_zone` (default `UTC`): a value without a
//! UTC offset for a `timestamptz` target is read in that zone (or dead-lettered, with `naive_timestamps =
//! "dead_letter"`), and a value with an offset for a `timestamp` (without time zone) target is converted to that
//! zone's local time instead of having its offset dropped, which is what PostgreSQL's own cast does.

use super::quote::{quote_ident, quote_literal};
use super::sql_loop::SqlLoop;
use super::types::{target_types, TargetType, NUMERIC, TIME, TIMESTAMP, TIMESTAMPTZ, TIMETZ};
use crate::store::template::Statement;
use crate::store::contract::PrepareError;
use crate::store::spec::{
    Binding, MetaSample, OnConflict, SqlEffect, TimeSettings, ValueSource, IDLE_IN_TRANSACTION_TIMEOUT, TCP_KEEPALIVE_COUNT, TCP_KEEPALIVE_IDLE_SECS,
    TCP_KEEPALIVE_INTERVAL_SECS,
};
use crate::field::Render;
use crate::store::rows::Apply;
use crate::rounding::Limit;
use sqlx::{Connection, Executor, PgConnection, Row};
use std::sync::atomic::{AtomicU64, Ordering};

/// The side effect of one pipeline, checked against the database.
#[derive(Clone, Debug)]
pub struct SideEffect {
    form: Form,
    /// Run first in every batch transaction: constraints immediate and the time zone.
    settings: String,
    /// Then this, which takes the locks and reads the schema.
    probe: Probe,
    /// What the probe returned when the statements were built.
    schema: String,
}

/// How a batch reads the schema its statements depend on.
#[derive(Clone, Debug)]
enum Probe {
    /// `LOCK TABLE` and the catalog query (the table form).
    Table(String),
    /// A `PREPARE` of each statement as written, with untyped parameters (the SQL form).
    Statements(Vec<String>),
}

impl Probe {
    /// The probe's SQL; server-side statement names are new at each call.
    fn sql(&self) -> String {
        match self {
            Probe::Table(sql) => sql.clone(),
            Probe::Statements(plain) => plain.iter().map(|s| prepare_probe(s)).collect(),
        }
    }
}

#[derive(Clone, Debug)]
enum Form {
    /// One set-based `INSERT` per batch: the generated statement, whose parameter `n` is the text array of
    /// column `n`, the number of columns, and the same `INSERT` folded into the claim ([`claim_and_insert_statement`],
    /// the fast path's one statement), where PostgreSQL takes it (not for a table with rules).
    Table { sql: String, columns: usize, claim_and_insert: Option<String> },
    /// Statements run per record; with the server-side loop when the statements allow one.
    Sql { statements: Vec<PreparedStatement>, server_loop: Option<SqlLoop> },
    /// `batch_sql`: each statement once per batch, `new_records` built from one text array per column (parameter
    /// `n` is column `n`'s), and the number of columns.
    Batch { statements: Vec<String>, columns: usize },
}

/// One statement of the SQL form, ready to bind.
#[derive(Clone, Debug)]
pub struct PreparedStatement {
    /// SQL text with `CAST($n::text AS type)` parameters.
    pub sql: String,
    /// For each positional parameter, the index of its binding (and of its value in [`Apply::values`]).
    pub slots: Vec<usize>,
}

fn prepare_error(field: impl Into<String>, message: impl Into<String>) -> PrepareError {
    PrepareError { field: field.into(), message: message.into(), unavailable: false }
}

/// A database error met while preparing: a configuration error unless the database itself was unavailable.
fn db_error(field: impl Into<String>, e: sqlx::Error, context: &str) -> PrepareError {
    let unavailable = super::error::classify_error(&e).is_retry();
    let hint = super::error::pooler_hint(&e);
    let message = if context.is_empty() { format!("{e}{hint}") } else { format!("{e}{hint}\n  in: {context}") };
    PrepareError { field: field.into(), message, unavailable }
}

/// Names of the server-side statements `PREPARE`d to probe parameter types: unique per process and call, so one
/// left behind by a failed probe on a session (PgBouncer may hand that session to another client) never collides.
fn probe_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("idemflow_probe_{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Runs `sql` (statements separated by `;`, simple query protocol, one round trip) and returns the text of the
/// first column of every row it returned, one line each.
async fn probe(conn: &mut PgConnection, sql: &str) -> Result<String, sqlx::Error> {
    // Through `Executor` (a boxed future): `RawSql::fetch_all`'s own async signature makes callers' futures
    // fail the `Send` check.
    let rows = conn.fetch_all(sqlx::raw_sql(sql)).await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        out.push(row.try_get::<Option<String>, _>(0)?.unwrap_or_default());
    }
    Ok(out.join("\n"))
}

/// With a `statement_timeout`, a `lock_timeout` at 90% of it for the batch (unless a shorter one is set): a wait
/// for a lock held elsewhere then ends as 55P03, retried, and not as a cancelled statement, which the sink takes for
/// a batch or a record too slow for the timeout ([`crate::store::error::time_limit`]).
/// `SET CONSTRAINTS ALL IMMEDIATE` (deferred constraints are checked at each statement, not at `COMMIT`, so a
/// record violating one is isolated by the slow path like any other constraint error), the time zone, and, on
/// PostgreSQL 14 and later, `client_connection_check_interval` for the batch: a worker killed while its batch waits
/// for a lock would otherwise leave its server session holding the batch's locks until that wait ends (PostgreSQL
/// notices a closed client connection only when it next reads from it; "Connection Settings" in its manual).
/// A worker that vanishes without closing its connection (no FIN: a power loss, a network cut) is bounded by
/// `idle_in_transaction_session_timeout` ([`IDLE_IN_TRANSACTION_TIMEOUT`]) and the server's TCP keepalives
/// ([`TCP_KEEPALIVE_IDLE_SECS`] and after), each for the batch only and only where the server's own is longer or
/// off.
fn settings_sql(time: &TimeSettings) -> String {
    format!(
        "SET CONSTRAINTS ALL IMMEDIATE; SET LOCAL TIME ZONE {}; \
         DO $idemflow$ BEGIN IF current_setting('server_version_num')::int >= 140000 THEN \
         PERFORM set_config('client_connection_check_interval', '1000', true); END IF; \
         IF current_setting('statement_timeout')::interval > '0'::interval \
            AND (current_setting('lock_timeout')::interval = '0'::interval \
                 OR current_setting('lock_timeout')::interval >= current_setting('statement_timeout')::interval) THEN \
         PERFORM set_config('lock_timeout', \
             greatest(1, floor(extract(epoch FROM current_setting('statement_timeout')::interval) * 900))::bigint::text || 'ms', true); \
         END IF; {}END $idemflow$; ",
        quote_literal(&time.zone),
        vanished_client_bounds(),
    )
}

/// PL/pgSQL statements that bound, for the transaction, how long a client that vanished without closing its
/// connection holds it: `idle_in_transaction_session_timeout` ([`IDLE_IN_TRANSACTION_TIMEOUT`]) and the TCP
/// keepalives, each only where the server's own is longer or off. The batch's transactions run them
/// ([`settings_sql`]), and so do the outbox relay's ([`crate::store::postgres::outbox`]), whose leased rows a
/// vanished relay would otherwise hold until the server's TCP timeout.
pub(super) fn vanished_client_bounds() -> String {
    // Sets `name` to `to` for the transaction where it is 0 ("off" for the timeout, "the system's default" for the
    // keepalives: both longer than ours) or longer; `cast` is how its current value compares (`interval`, `int`).
    let lower = |name: &str, to: String, cast: &str| {
        format!(
            "IF current_setting('{name}')::{cast} = '0'::{cast} OR current_setting('{name}')::{cast} > '{to}'::{cast} THEN \
             PERFORM set_config('{name}', '{to}', true); END IF; "
        )
    };
    [
        lower("idle_in_transaction_session_timeout", format!("{}ms", IDLE_IN_TRANSACTION_TIMEOUT.as_millis()), "interval"),
        lower("tcp_keepalives_idle", format!("{TCP_KEEPALIVE_IDLE_SECS}s"), "interval"),
        lower("tcp_keepalives_interval", format!("{TCP_KEEPALIVE_INTERVAL_SECS}s"), "interval"),
        lower("tcp_keepalives_count", TCP_KEEPALIVE_COUNT.to_string(), "int"),
    ]
    .concat()
}

/// No limit of its own on a record's values, nothing to say in `check`.
impl crate::store::contract::PreparedEffect for SideEffect {}

impl SideEffect {
    /// Checks the sink against the database and builds its statements, inside a transaction that is rolled back.
    /// Returns the side effect and its bindings in value order, each with how its values are rendered.
    ///
    /// Errors: a [`PrepareError`] naming the field at fault (a missing table or column, a type idemflow cannot
    /// bind, SQL that does not parse, an unknown time zone), or with `unavailable` set when the database could
    /// not be asked.
    pub async fn prepare(
        conn: &mut PgConnection,
        spec: &SqlEffect,
        time: &TimeSettings,
    ) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
        let mut tx = conn.begin().await.map_err(|e| db_error("database", e, ""))?;
        let zone = format!("SET LOCAL TIME ZONE {}", quote_literal(&time.zone));
        (&mut *tx).execute(sqlx::raw_sql(&zone)).await.map_err(|e| db_error("sink.time_zone", e, ""))?;
        let prepared = match spec {
            SqlEffect::Table { table, columns, on_conflict, conflict_columns } => {
                prepare_table(&mut tx, table, columns, *on_conflict, conflict_columns.as_deref()).await
            }
            SqlEffect::PerRecord { statements, params, .. } => prepare_sql(&mut tx, statements, params).await,
            SqlEffect::BatchSql { statements, columns } => prepare_batch(&mut tx, statements, columns).await,
        };
        let (form, schema_probe, bindings) = prepared?;
        let probe_sql = schema_probe.sql();
        let schema = probe(&mut tx, &probe_sql).await.map_err(|e| db_error("sink", e, &probe_sql))?;
        let _ = tx.rollback().await;
        Ok((SideEffect { form, settings: settings_sql(time), probe: schema_probe, schema }, bindings))
    }

    /// Starts a batch in the open transaction `conn`: sets constraints immediate and the time zone, locks the
    /// side effect's tables against schema changes and checks that the schema is still the one the statements
    /// were built from. Returns `false` when it changed: roll back and prepare again.
    ///
    /// Errors: the database's (a dropped table is SQLSTATE 42P01, fatal).
    pub async fn begin(&self, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        // The SQL form's loop is created after the probe's `PREPARE`s have taken the statements' locks.
        let ensure = match &self.form {
            Form::Sql { server_loop: Some(l), .. } => l.ensure(),
            _ => "",
        };
        let schema = probe(conn, &format!("{}{}{ensure}", self.settings, self.probe.sql())).await?;
        if schema != self.schema {
            tracing::info!(built_for = %self.schema, now = %schema, "the side effect's schema changed");
        }
        Ok(schema == self.schema)
    }

    /// Applies the side effect for all `rows` (the fast path).
    pub async fn apply_all(&self, conn: &mut PgConnection, rows: &[&Apply]) -> Result<(), sqlx::Error> {
        match &self.form {
            Form::Table { sql, columns, .. } => run_over_columns(conn, sql, *columns, rows).await,
            Form::Batch { statements, columns } => {
                for sql in statements {
                    run_over_columns(conn, sql, *columns, rows).await?;
                }
                Ok(())
            }
            Form::Sql { server_loop: Some(l), .. } if !rows.is_empty() => l.run(conn, rows).await,
            Form::Sql { statements, .. } => {
                for row in rows {
                    run_statements(conn, statements, row).await?;
                }
                Ok(())
            }
        }
    }

    /// The table form's claim-and-insert statement and its number of columns (see
    /// [`super::dedup::claim_and_insert`]); `None` for the other forms, which claim and apply in two steps.
    pub fn claim_and_insert(&self) -> Option<(&str, usize)> {
        match &self.form {
            Form::Table { claim_and_insert: Some(sql), columns, .. } => Some((sql, *columns)),
            _ => None,
        }
    }

    /// Applies the side effect for one record (the slow path).
    pub async fn apply_one(&self, conn: &mut PgConnection, row: &Apply) -> Result<(), sqlx::Error> {
        match &self.form {
            Form::Table { sql, columns, .. } => run_over_columns(conn, sql, *columns, &[row]).await,
            Form::Batch { statements, columns } => {
                for sql in statements {
                    run_over_columns(conn, sql, *columns, &[row]).await?;
                }
                Ok(())
            }
            Form::Sql { statements, .. } => run_statements(conn, statements, row).await,
        }
    }
}

/// The table form's statement or one of the `batch_sql` form's: one text array per column, all `rows` at once.
async fn run_over_columns(conn: &mut PgConnection, sql: &str, columns: usize, rows: &[&Apply]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut query = sqlx::query(sql).persistent(super::persistent());
    for c in 0..columns {
        let column: Vec<Option<&str>> = rows.iter().map(|r| r.values[c].as_deref()).collect();
        query = query.bind(column);
    }
    query.execute(&mut *conn).await?;
    Ok(())
}

/// The SQL form: every statement, in order, for one record.
async fn run_statements(
    conn: &mut PgConnection,
    statements: &[PreparedStatement],
    row: &Apply,
) -> Result<(), sqlx::Error> {
    for statement in statements {
        let mut query = sqlx::query(&statement.sql).persistent(super::persistent());
        for &slot in &statement.slots {
            query = query.bind(row.values[slot].as_deref());
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

/// SQL that checks `sql` parses (a server-side `PREPARE`, then `DEALLOCATE`) and returns its parameter types as
/// an OID array text (`{23,1184}`); inside a transaction its parse analysis keeps the statement's locks. The `;`
/// after `sql` is on a line of its own: a statement may end in a `--` comment.
fn prepare_probe(sql: &str) -> String {
    let name = probe_name();
    format!(
        "PREPARE {name} AS {sql}\n; \
         SELECT parameter_types::oid[]::text FROM pg_prepared_statements WHERE name = {}; DEALLOCATE {name}; ",
        quote_literal(&name)
    )
}

/// Parses [`prepare_probe`]'s `{23,1184}`.
fn oid_list(text: &str) -> Vec<i64> {
    text.trim_matches(['{', '}']).split(',').filter_map(|o| o.trim().parse().ok()).collect()
}

/// Checks that the statement `sql` parses, for a configuration error at start rather than a fatal batch.
async fn check_parses(conn: &mut PgConnection, sql: &str) -> Result<Vec<i64>, sqlx::Error> {
    Ok(oid_list(&probe(conn, &prepare_probe(sql)).await?))
}

/// The table form's one statement: every column's values as a text array, unnested and cast to the column's type
/// (`types`, all bindable), then `conflict` (`ON CONFLICT ...`, or empty).
fn insert_statement(qualified: &str, columns: &[Binding], types: &[TargetType], conflict: &str) -> String {
    let (names, casts) = insert_columns(columns, types);
    let arrays = (1..=columns.len()).map(|n| format!("${n}::text[]")).collect::<Vec<_>>().join(", ");
    let aliases = (0..columns.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(", ");
    format!("INSERT INTO {qualified} ({names}) SELECT {casts} FROM unnest({arrays}) AS u({aliases}){conflict}")
}

/// The table form's fast path as one statement: the claim ([`super::dedup::CLAIM_INSERT`], parameters `$1` to
/// `$7`) as the CTE `new`, then the table's `INSERT` of the rows whose key id the claim returned, in the order they
/// are given: `$8` the rows' key ids, `$9` on one text array per column. It returns the new keys' ids as one array,
/// as the claim alone does. The `INSERT` reads only what `new` returned, so a business row is written exactly for a
/// key this statement inserted (PostgreSQL docs, "Data-Modifying Statements in WITH": the sub-statements run on one
/// snapshot, and a `RETURNING` list is the way to pass rows between them).
fn claim_and_insert_statement(qualified: &str, columns: &[Binding], types: &[TargetType], conflict: &str) -> String {
    let (names, casts) = insert_columns(columns, types);
    let arrays = (0..columns.len()).map(|n| format!(", ${}::text[]", n + 9)).collect::<String>();
    let aliases = (0..columns.len()).map(|i| format!(", c{i}")).collect::<String>();
    format!(
        "WITH new AS (\n{claim}),\ninserted AS (\nINSERT INTO {qualified} ({names}) SELECT {casts} \
         FROM unnest($8::bytea[]{arrays}) WITH ORDINALITY AS u(key_id{aliases}, ord) \
         WHERE u.key_id IN (SELECT key_id FROM new) ORDER BY u.ord{conflict})\nSELECT array_agg(key_id) FROM new",
        claim = super::dedup::CLAIM_INSERT
    )
}

/// The claim-and-insert statement `sql` where PostgreSQL takes it for the table of `oid`: an `INSERT` inside `WITH`
/// is refused for a table with `INSERT` rules (`DO ALSO`, conditional or multi-statement `DO INSTEAD`: SQLSTATE
/// 0A000, PostgreSQL's "Data-Modifying Statements in WITH"), and such a table is claimed and inserted into in two
/// statements (`None`), as before the fold. The statement is not `PREPARE`d here, as the table's `INSERT` is: that
/// would lock `idemflow.dedup` at start-up, waiting on whoever holds it, where a batch is what should wait (and say
/// so in the stall signal). Its parts are the claim, the same text as the claim alone, and the `INSERT` checked
/// just before, over arrays of the same types.
///
/// Errors: the catalog could not be read (`sink.table`).
async fn fold_if_taken(conn: &mut PgConnection, sql: String, oid: i64, qualified: &str) -> Result<Option<String>, PrepareError> {
    let rules: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_rewrite WHERE ev_class = $1::int8::oid AND ev_type = '3')")
        .bind(oid)
        .persistent(super::persistent())
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| db_error("sink.table", e, ""))?;
    if rules {
        tracing::info!(table = %qualified, "the table has INSERT rules, which PostgreSQL refuses in WITH: the table form claims and inserts in two statements");
        return Ok(None);
    }
    Ok(Some(sql))
}

/// The table form's quoted column names and their values' casts from `u.c0`, `u.c1`, ...
fn insert_columns(columns: &[Binding], types: &[TargetType]) -> (String, String) {
    let names = columns.iter().map(|b| quote_ident(&b.name)).collect::<Vec<_>>().join(", ");
    let casts = types
        .iter()
        .enumerate()
        .map(|(i, t)| t.target.as_ref().expect("checked by the caller").cast(&format!("u.c{i}"), &t.name))
        .collect::<Vec<_>>()
        .join(", ");
    (names, casts)
}

/// A table's column, as the catalog describes it: name, type OID, whether it is in the primary key, whether it is
/// required (NOT NULL without a default, identity or generation), type modifier.
type CatalogColumn = (String, i64, bool, bool, i32);

/// The table `table` names (on the search path): its OID, its name as PostgreSQL qualifies it, and its columns in
/// order.
///
/// Errors: the table does not exist, or the catalog could not be read (`sink.table`).
async fn read_table(conn: &mut PgConnection, table: &str) -> Result<(i64, String, Vec<CatalogColumn>), PrepareError> {
    let found: Option<(i64, String)> =
        sqlx::query_as("SELECT c.oid::int8, c.oid::regclass::text FROM pg_class c WHERE c.oid = to_regclass($1)")
            .bind(table)
            .persistent(super::persistent())
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| db_error("sink.table", e, ""))?;
    let Some((oid, qualified)) = found else {
        return Err(prepare_error("sink.table", format!("table {table:?} does not exist (or is not visible on the search_path)")));
    };
    let catalog: Vec<CatalogColumn> = sqlx::query_as(
        "SELECT a.attname::text, a.atttypid::int8, coalesce(a.attnum = ANY(i.indkey), false),
                a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = '', a.atttypmod
         FROM pg_attribute a
         LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
         WHERE a.attrelid = $1::int8::oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
    )
    .bind(oid)
    .persistent(super::persistent())
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| db_error("sink.table", e, ""))?;
    Ok((oid, qualified, catalog))
}

async fn prepare_table(
    conn: &mut PgConnection,
    table: &str,
    columns: &[Binding],
    on_conflict: OnConflict,
    conflict_columns: Option<&[String]>,
) -> Result<(Form, Probe, Vec<(Binding, Render)>), PrepareError> {
    let (oid, qualified, catalog) = read_table(conn, table).await?;
    // Every problem at once: misspelled columns first (a NOT NULL column left unmapped is often the same typo).
    let mut problems = Vec::new();
    let names: Vec<&str> = catalog.iter().map(|(n, ..)| n.as_str()).collect();
    let mut oids = Vec::new();
    let mut oid_mods = Vec::new();
    for b in columns {
        match catalog.iter().find(|(name, ..)| *name == b.name) {
            Some((_, oid, _, _, typmod)) => {
                oids.push(*oid);
                oid_mods.push((*oid, *typmod));
            }
            None => problems.push(prepare_error(
                format!("sink.columns.{}", b.name),
                format!("table {qualified} has no column {:?} (its columns: {})", b.name, names.join(", ")),
            )),
        }
    }
    for (name, ..) in catalog.iter().filter(|(_, _, _, required, _)| *required) {
        if !columns.iter().any(|b| &b.name == name) {
            problems.push(prepare_error(
                "sink.columns",
                format!("table {qualified}'s column {name:?} is NOT NULL without a default: map it to a value"),
            ));
        }
    }
    for c in conflict_columns.unwrap_or_default() {
        if !catalog.iter().any(|(name, ..)| name == c) {
            problems.push(prepare_error("sink.conflict_columns", format!("table {qualified} has no column {c:?}")));
        }
    }
    let types = target_types(conn, &oids).await.map_err(|e| db_error("sink.table", e, ""))?;
    for (b, t) in columns.iter().zip(&types) {
        if let Err(why) = &t.target {
            problems.push(prepare_error(format!("sink.columns.{}", b.name), format!("column {:?}: {why}", b.name)));
        }
    }
    if problems.is_empty() {
        let slots: Vec<Slot<'_>> = columns
            .iter()
            .zip(&types)
            .map(|(b, t)| Slot { field: format!("sink.columns.{}", b.name), what: format!("column {:?}", b.name), binding: b, target: t })
            .collect();
        problems.extend(meta_mismatches(conn, &slots).await?);
    }
    if !problems.is_empty() {
        return Err(PrepareError::all(problems));
    }
    let target: Vec<String> = match conflict_columns {
        Some(cols) => cols.to_vec(),
        None => catalog.iter().filter(|(_, _, pk, ..)| *pk).map(|(n, ..)| n.clone()).collect(),
    };
    let conflict = conflict_clause(on_conflict, &target, columns, &qualified)?;
    let sql = insert_statement(&qualified, columns, &types, &conflict);
    check_parses(conn, &sql)
        .await
        .map_err(|e| prepare_error("sink", format!("the generated statement is refused: {e}\n  {sql}")))?;
    let claim_and_insert = fold_if_taken(conn, claim_and_insert_statement(&qualified, columns, &types, &conflict), oid, &qualified).await?;
    // The probe of every batch: the table's lock, then its identity, columns (name, type, modifier, NOT NULL,
    // default, identity, generated) and primary key.
    let probe_sql = format!(
        "LOCK TABLE {qualified} IN ROW EXCLUSIVE MODE; \
         SELECT (SELECT c.oid::text || ' ' || string_agg(concat_ws(' ', a.attname, a.atttypid, a.atttypmod, \
                 a.attnotnull, a.atthasdef, a.attidentity, a.attgenerated), ',' ORDER BY a.attnum) || ' ' || \
                 coalesce((SELECT i.indkey::text FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), '') \
                 FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped \
                 WHERE c.oid = {oid} GROUP BY c.oid); "
    );
    let limits = limits(conn, &oid_mods).await.map_err(|e| db_error("sink.table", e, ""))?;
    let bindings = columns
        .iter()
        .cloned()
        .zip(limits)
        .zip(&types)
        .map(|((b, limit), t)| (Binding { limit, target_type: Some(t.name.clone()), ..b }, t.target.as_ref().expect("checked").render()))
        .collect();
    Ok((Form::Table { sql, columns: columns.len(), claim_and_insert }, Probe::Table(probe_sql), bindings))
}

/// Where a value is bound, for [`meta_mismatches`]: the pipeline-file field (`sink.columns.at`,
/// `sink.params.at`), what it is in words (`column "at"`, `parameter :at`), its binding and its type.
struct Slot<'a> {
    field: String,
    what: String,
    binding: &'a Binding,
    target: &'a TargetType,
}

/// The values fed by record metadata whose target cannot take what the metadata gives (`meta = "timestamp"` into an
/// `integer` column or parameter, `"topic"` into `bigint`): every record would be dead-lettered at run time. Each
/// such target's cast is tried by the server on a value of the metadata's shape (the cast every batch makes); a
/// data exception (SQLSTATE class 22) is a problem naming the target, its type and the metadata. The business key
/// is not tried: its shape is the payload's.
///
/// Errors: the database's, other than a data exception.
async fn meta_mismatches(conn: &mut PgConnection, slots: &[Slot<'_>]) -> Result<Vec<PrepareError>, PrepareError> {
    let mut problems = Vec::new();
    for slot in slots {
        let (ValueSource::Meta(meta), Ok(target)) = (&slot.binding.source, &slot.target.target) else { continue };
        let Some(MetaSample { name, text: sample, what }) = meta.sample() else { continue };
        let type_name = &slot.target.name;
        let sql = format!("SELECT CAST({} AS text) FROM (SELECT CAST($1 AS text) AS c0) AS u", target.cast("u.c0", type_name));
        // In a savepoint: the preparation's transaction goes on after a refused cast.
        let mut savepoint = conn.begin().await.map_err(|e| db_error("database", e, ""))?;
        let tried = sqlx::query_scalar::<_, Option<String>>(&sql).bind(sample).persistent(false).fetch_one(&mut *savepoint).await;
        savepoint.rollback().await.map_err(|e| db_error("database", e, ""))?;
        match tried {
            Ok(_) => {}
            Err(e) if e.as_database_error().and_then(|d| d.code()).is_some_and(|c| c.starts_with("22")) => {
                let said = e.as_database_error().map(|d| d.message().to_owned()).unwrap_or_default();
                problems.push(prepare_error(
                    &slot.field,
                    format!("{} is {type_name}: meta = {name:?} gives {what} (such as {sample:?}), which it cannot take ({said})", slot.what),
                ));
            }
            Err(e) => return Err(db_error(&slot.field, e, &sql)),
        }
    }
    Ok(problems)
}

/// The `ON CONFLICT` clause of the table form's statement: none for `on_conflict = "error"`, `DO NOTHING`, or
/// `DO UPDATE SET` every column but the conflict `target`'s.
///
/// Errors: an update without a conflict target (no primary key and no `conflict_columns`).
fn conflict_clause(on_conflict: OnConflict, target: &[String], columns: &[Binding], qualified: &str) -> Result<String, PrepareError> {
    Ok(match on_conflict {
        OnConflict::Error => String::new(),
        OnConflict::Nothing => " ON CONFLICT DO NOTHING".to_owned(),
        OnConflict::Update => {
            if target.is_empty() {
                return Err(prepare_error(
                    "sink.conflict_columns",
                    format!("table {qualified} has no primary key: list the conflict columns (a unique index's)"),
                ));
            }
            let sets: Vec<String> = columns
                .iter()
                .filter(|b| !target.contains(&b.name))
                .map(|b| format!("{0} = EXCLUDED.{0}", quote_ident(&b.name)))
                .collect();
            let target = target.iter().map(|c| quote_ident(c)).collect::<Vec<_>>().join(", ");
            if sets.is_empty() {
                format!(" ON CONFLICT ({target}) DO NOTHING")
            } else {
                format!(" ON CONFLICT ({target}) DO UPDATE SET {}", sets.join(", "))
            }
        }
    })
}

/// What each column (type oid, type modifier) keeps of a value where it would round the rest (see
/// [`crate::rounding`]): `numeric(p, s)` its scale; `timestamp(p)`, `timestamptz(p)`, `time(p)` and `timetz(p)`
/// their declared fractional digits of seconds (unconstrained ones keep microseconds and are not checked). Domains
/// over these are read through their base type.
async fn limits(conn: &mut PgConnection, columns: &[(i64, i32)]) -> Result<Vec<Option<Limit>>, sqlx::Error> {
    let mut out = Vec::with_capacity(columns.len());
    for &(oid, typmod) in columns {
        // A domain's own modifier (`CREATE DOMAIN money2 AS numeric(12, 2)`) is on the domain's type.
        let (base, typmod, name): (i64, i32, String) = sqlx::query_as(
            "SELECT CASE WHEN t.typtype = 'd' THEN t.typbasetype::int8 ELSE t.oid::int8 END,
                    CASE WHEN t.typtype = 'd' THEN t.typtypmod ELSE $2 END,
                    format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END,
                                CASE WHEN t.typtype = 'd' THEN t.typtypmod ELSE $2 END)
             FROM pg_type t WHERE t.oid = $1::int8::oid",
        )
        .bind(oid)
        .bind(typmod)
        .persistent(super::persistent())
        .fetch_one(&mut *conn)
        .await?;
        out.push(match base {
            // typmod = ((precision << 16) | (scale & 0x7ff)) + 4; the scale is an 11-bit signed number (PostgreSQL 15
            // allows negative scales): src/backend/utils/adt/numeric.c.
            NUMERIC if typmod >= 4 => Some(Limit::Scale { type_name: name, scale: ((((typmod - 4) & 0x7ff) ^ 1024) - 1024) }),
            // Only a declared precision: an unconstrained one keeps microseconds, and refusing every nanosecond
            // timestamp (Go's RFC3339Nano, .NET) for that would be a worse surprise than the rounding.
            TIMESTAMP | TIMESTAMPTZ | TIME | TIMETZ if typmod >= 0 => Some(Limit::Fraction { type_name: name, digits: typmod as u32 }),
            _ => None,
        });
    }
    Ok(out)
}

async fn prepare_sql(
    conn: &mut PgConnection,
    statements: &[Statement],
    params: &[Binding],
) -> Result<(Form, Probe, Vec<(Binding, Render)>), PrepareError> {
    let mut renders: Vec<Option<Render>> = vec![None; params.len()];
    let mut type_names: Vec<Option<String>> = vec![None; params.len()];
    let mut prepared = Vec::new();
    let mut plains = Vec::new();
    // The statements as the server-side loop runs them; `None` once one of them cannot be looped.
    let mut bodies = Some(Vec::new());
    for statement in statements {
        let field = statement.origin.clone();
        let plain = statement.render(|n| format!("${}", n + 1));
        let written = statement.render(|n| format!(":{}", statement.params[n]));
        let oids = check_parses(conn, &plain).await.map_err(|e| db_error(&field, e, &written))?;
        let types = target_types(conn, &oids).await.map_err(|e| db_error(&field, e, &written))?;
        let slots: Vec<usize> = statement
            .params
            .iter()
            .map(|name| params.iter().position(|b| b.name == *name).expect("validated: every parameter is mapped"))
            .collect();
        let fed: Vec<Slot<'_>> = slots
            .iter()
            .zip(&types)
            .enumerate()
            .map(|(n, (slot, t))| Slot {
                field: format!("sink.params.{}", statement.params[n]),
                what: format!("parameter :{} (in {field})", statement.params[n]),
                binding: &params[*slot],
                target: t,
            })
            .collect();
        let problems = meta_mismatches(conn, &fed).await?;
        if !problems.is_empty() {
            return Err(PrepareError::all(problems));
        }
        let mut casts = Vec::with_capacity(types.len());
        let mut looped = Vec::with_capacity(types.len());
        for (n, (slot, t)) in slots.iter().zip(&types).enumerate() {
            let target = t.target.clone().map_err(|why| {
                prepare_error(&field, format!("parameter :{}: {why}\n  in: {written}", statement.params[n]))
            })?;
            // A parameter used in several statements as json in one and text in another is rendered as JSON.
            let render = target.render();
            renders[*slot] = match renders[*slot] {
                Some(Render::Json) => Some(Render::Json),
                _ => Some(render),
            };
            type_names[*slot].get_or_insert_with(|| t.name.clone());
            casts.push(target.cast(&format!("${}::text", n + 1), &t.name));
            looped.push(target.cast(&format!("$1[idemflow_base + {}]", slot + 1), &t.name));
        }
        let sql = statement.render(|n| casts[n].clone());
        check_parses(conn, &sql).await.map_err(|e| db_error(&field, e, &written))?;
        if let Some(b) = bodies.as_mut() {
            b.push(statement.render(|n| looped[n].clone()));
        }
        // The probe of every batch: the same PREPARE of the statement as written, whose parameter types follow
        // the schema, and which takes the statement's locks.
        plains.push(plain);
        prepared.push(PreparedStatement { sql, slots });
    }
    let bindings = params
        .iter()
        .cloned()
        .zip(type_names)
        .map(|(b, target_type)| Binding { target_type, ..b })
        .zip(renders.into_iter().map(|r| r.unwrap_or(Render::Text)))
        .collect();
    let mut server_loop = bodies.and_then(|b| SqlLoop::new(&b, params.len()));
    if let Some(l) = &server_loop {
        // Checked and created once here, in a savepoint of the transaction that is rolled back: statements that
        // return rows (a SELECT, a RETURNING) would need a destination in PL/pgSQL, and a loop PostgreSQL refuses
        // leaves the per-record round trips, which work wherever the statements do.
        probe(conn, "SAVEPOINT idemflow_loop").await.map_err(|e| db_error("sink", e, ""))?;
        let mut refused = None;
        for (plain, statement) in plains.iter().zip(statements) {
            match returns_rows(conn, plain, statement.params.len()).await {
                Ok(false) => {}
                Ok(true) => refused = Some(format!("{} returns rows", statement.origin)),
                Err(e) => refused = Some(e.to_string()),
            }
            if refused.is_some() {
                break;
            }
        }
        if refused.is_none() {
            refused = probe(conn, l.ensure()).await.err().map(|e| e.to_string());
        }
        if let Some(why) = refused {
            tracing::info!(reason = %why, "the SQL form runs one round trip per statement and record, not as a server-side loop");
            probe(conn, "ROLLBACK TO SAVEPOINT idemflow_loop").await.map_err(|e| db_error("sink", e, ""))?;
            server_loop = None;
        }
    }
    Ok((Form::Sql { statements: prepared, server_loop }, Probe::Statements(plains), bindings))
}

/// The `batch_sql` form: each statement with `new_records` put first in its `WITH` list, `new_records` being
/// `SELECT CAST(u.c0 AS type0) AS "name0", ... FROM unnest($1::text[], ...) AS u(c0, ...)`, the types those of
/// `[sink.params]` (`text` unless given) resolved by the server and cast as the table form casts to a column.
/// Its rows are the batch's new records; like any relation it has no order. Type modifiers in `type`
/// (`numeric(12, 2)`) are not applied (`to_regtype` drops them): the target column applies its own on assignment.
async fn prepare_batch(
    conn: &mut PgConnection,
    statements: &[Statement],
    columns: &[Binding],
) -> Result<(Form, Probe, Vec<(Binding, Render)>), PrepareError> {
    let mut oids = Vec::with_capacity(columns.len());
    for b in columns {
        let field = format!("sink.params.{}", b.name);
        let written = b.type_name.as_deref().unwrap_or("text");
        // Bound, never spliced: the SQL below names the type by the catalog's own spelling.
        let oid: Option<i64> = sqlx::query_scalar("SELECT to_regtype($1)::oid::int8")
            .bind(written)
            .persistent(super::persistent())
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| db_error(&field, e, &format!("type = {written:?}")))?;
        let oid = oid.ok_or_else(|| prepare_error(&field, format!("type {written:?} does not exist (or is not visible on the search_path)")))?;
        oids.push(oid);
    }
    let types = target_types(conn, &oids).await.map_err(|e| db_error("sink.params", e, ""))?;
    let slots: Vec<Slot<'_>> = columns
        .iter()
        .zip(&types)
        .map(|(b, t)| Slot { field: format!("sink.params.{}", b.name), what: format!("new_records column {:?}", b.name), binding: b, target: t })
        .collect();
    let problems = meta_mismatches(conn, &slots).await?;
    if !problems.is_empty() {
        return Err(PrepareError::all(problems));
    }
    let mut casts = Vec::with_capacity(columns.len());
    for (i, (b, t)) in columns.iter().zip(&types).enumerate() {
        let target = t.target.as_ref().map_err(|why| prepare_error(format!("sink.params.{}", b.name), why.clone()))?;
        casts.push(format!("{} AS {}", target.cast(&format!("u.c{i}"), &t.name), quote_ident(&b.name)));
    }
    let arrays = (1..=columns.len()).map(|n| format!("${n}::text[]")).collect::<Vec<_>>().join(", ");
    let aliases = (0..columns.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(", ");
    let relation = format!("new_records AS (SELECT {} FROM unnest({arrays}) AS u({aliases}))", casts.join(", "));
    let mut prepared = Vec::with_capacity(statements.len());
    for statement in statements {
        let written = statement.render(|_| unreachable!("batch_sql statements have no parameters (validated)"));
        let sql = match crate::store::template::after_leading_with(&written) {
            Some(at) => format!("{} {relation},{}", &written[..at], &written[at..]),
            None => format!("WITH {relation}\n{written}"),
        };
        // The statement as sent: PostgreSQL's error positions count from its start.
        check_parses(conn, &sql).await.map_err(|e| {
            let hint = untyped_hint(&e, &written, columns);
            let mut error = db_error(&statement.origin, e, &sql);
            error.message.push_str(&hint);
            error
        })?;
        prepared.push(sql);
    }
    let bindings = columns
        .iter()
        .cloned()
        .zip(&types)
        .map(|(b, t)| (Binding { target_type: Some(t.name.clone()), ..b }, t.target.as_ref().expect("checked").render()))
        .collect();
    // The probe of every batch: a PREPARE of each statement, which takes its locks. Its parameter types are the
    // text arrays whatever the schema; a change that breaks a statement fails the PREPARE.
    Ok((Form::Batch { columns: columns.len(), statements: prepared.clone() }, Probe::Statements(prepared), bindings))
}

/// For a `batch_sql` statement PostgreSQL refused for a type (SQLSTATE 42804, datatype_mismatch: `column "qty" is
/// of type integer but expression is of type text`): the `new_records` columns the statement reads that have no
/// `type` in `[sink.params]`, which are text, with what to write instead. Empty otherwise.
fn untyped_hint(e: &sqlx::Error, statement: &str, columns: &[Binding]) -> String {
    let mismatch = e.as_database_error().and_then(|d| d.code()).is_some_and(|c| c == "42804");
    if !mismatch {
        return String::new();
    }
    let mut untyped: Vec<&str> = columns
        .iter()
        .filter(|b| b.type_name.is_none() && mentions(statement, &b.name))
        .map(|b| b.name.as_str())
        .collect();
    // The message names the column assigned to (`column "qty" is of type ...`, in any language): a column of
    // new_records with that name is the likely one. Only for the hint; nothing is decided on the text.
    let message = e.as_database_error().map(|d| d.message().to_owned()).unwrap_or_default();
    let named: Vec<&str> = untyped.iter().copied().filter(|n| message.contains(&format!("\"{n}\""))).collect();
    if !named.is_empty() {
        untyped = named;
    }
    match untyped.first() {
        None => String::new(),
        Some(first) => format!(
            "\n  hint: new_records.{} {} text: [sink.params] {} no `type` (give one: {first} = {{ field = \"...\", type = \"integer\" }})",
            untyped.join(", new_records."),
            if untyped.len() == 1 { "is" } else { "are" },
            if untyped.len() == 1 { format!("{first} has") } else { format!("{} have", untyped.join(", ")) },
        ),
    }
}

/// Whether `sql` has `name` as a word of its own (case aside, as PostgreSQL folds unquoted names): a rough test,
/// for a hint only.
fn mentions(sql: &str, name: &str) -> bool {
    let (sql, name) = (sql.to_lowercase(), name.to_lowercase());
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$');
    sql.match_indices(&name).any(|(at, _)| !word(sql[..at].chars().next_back()) && !word(sql[at + name.len()..].chars().next()))
}

/// Whether `sql`, with `params` parameters, returns rows: the top node of its plan (`EXPLAIN (VERBOSE, FORMAT
/// JSON)` of the prepared statement with every parameter NULL; nothing is executed) is not a `ModifyTable`, or it is
/// one with an output list (`RETURNING`). PostgreSQL 16's `pg_prepared_statements.result_types` would say it
/// directly; this works on every version.
async fn returns_rows(conn: &mut PgConnection, sql: &str, params: usize) -> Result<bool, sqlx::Error> {
    let name = probe_name();
    let nulls = vec!["NULL"; params].join(", ");
    let args = if params == 0 { String::new() } else { format!("({nulls})") };
    let sql = format!("PREPARE {name} AS {sql}\n; EXPLAIN (VERBOSE, FORMAT JSON) EXECUTE {name}{args}; DEALLOCATE {name}; ");
    let rows = conn.fetch_all(sqlx::raw_sql(&sql)).await?;
    // The simple query protocol answers in text; the plan's column is of type json.
    let text: String = rows.first().map(|r| r.try_get_unchecked(0)).transpose()?.unwrap_or_default();
    let plan: serde_json::Value = serde_json::from_str(&text).map_err(|e| sqlx::Error::Protocol(format!("EXPLAIN: {e}")))?;
    let top = &plan[0]["Plan"];
    Ok(top["Node Type"] != "ModifyTable" || top.get("Output").is_some())
}
