//! The MySQL and MariaDB side effect.
//!
//! Values are bound as text and converted by the server on assignment to their column, in strict mode (see
//! [`super`]): a value that does not fit is an error that dead-letters its record (`'abc'` into `DECIMAL` is
//! error 1366, 300 characters into `VARCHAR(255)` is 1406), never a silent 0 or a truncation. Text input is
//! exact: `DECIMAL` keeps every digit and `BIGINT` every digit beyond 2^53. The worker renders what the server
//! cannot read ([`crate::field::Render`]): JSON text for `JSON` columns, UTC wall-clock time for `TIMESTAMP` and the
//! pipeline's zone for `DATETIME` (neither server parses a UTC offset), `1`/`0` for a boolean into a number.
//! Payload values are only ever bound as parameters, never spliced into SQL. `IGNORE` is never used.
//!
//! - Table form: `INSERT INTO t (c1, c2) VALUES (?, ?), (?, ?), ...`, as few statements per batch as the
//!   placeholder limit (65,535) and about 4 MiB of values allow. `on_conflict = "nothing"` is
//!   `ON DUPLICATE KEY UPDATE pk = pk` (a no-op update; a unique key conflict on any unique key is skipped),
//!   `"update"` is `ON DUPLICATE KEY UPDATE c = VALUES(c)` for the columns outside the conflict key.
//! - SQL form: the configured statements with each `:name` occurrence replaced by `?`, run for each new record in
//!   batch order as prepared statements (sqlx caches them per connection). MySQL does not infer parameter types,
//!   so values are bound as text ([`Render::Text`]; a JSON object or array as its JSON text) unless the parameter
//!   declares its target (`type = "timestamp" | "datetime" | "json"` in `[sink.params]`).
//!
//! # Never through a stale schema
//!
//! Each batch transaction starts with [`SideEffect::begin`]: a `SELECT ... LIMIT 0` from each table of the table
//! form takes its shared metadata lock, which an `ALTER TABLE` must wait for until the batch commits (MySQL
//! Reference Manual, "Metadata Locking"), and then the table's columns are read again; when they differ from what
//! the statement was built from, the batch rolls back with `SinkError::SchemaChanged` (the sink) and the worker
//! rebuilds it. A dropped table is error 1146, fatal.

use super::marks;
use crate::store::spec::{Binding, DeclaredType, MetaSample, OnConflict, SqlEffect, TimeSettings, ValueSource};
use crate::field::Render;
use crate::store::rows::Apply;
use crate::store::template::{Part, Statement};
use crate::store::contract::PrepareError;
use sqlx::{Executor as _, MySqlConnection};

/// The side effect of one pipeline, checked against the database.
#[derive(Clone, Debug)]
pub struct SideEffect {
    form: Form,
    /// The server's `max_allowed_packet` (bytes) when the side effect was prepared.
    packet: u64,
    /// Run first in every batch transaction: the schema the form depends on.
    probe: Option<Probe>,
    /// What the probe returned when the statements were built.
    schema: String,
}

#[derive(Clone, Debug)]
enum Form {
    /// `INSERT INTO t (...) VALUES` + rows + the conflict clause.
    Table { head: String, tail: String, columns: usize },
    /// Statements with `?` placeholders, and for each the index of its value in [`Apply::values`].
    Sql(Vec<(String, Vec<usize>)>),
}

fn prepare_error(field: impl Into<String>, message: impl Into<String>) -> PrepareError {
    PrepareError { field: field.into(), message: message.into(), unavailable: false }
}

fn db_error(field: impl Into<String>, e: sqlx::Error, context: &str) -> PrepareError {
    let unavailable = super::error::classify_error(&e).is_retry();
    let e = super::error::describe_error(&e);
    let message = if context.is_empty() { e } else { format!("{e}\n  in: {context}") };
    PrepareError { field: field.into(), message, unavailable }
}

/// Backtick-quotes an identifier (MySQL Reference Manual, "Schema Object Names").
pub fn quote_ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// One column, as `information_schema.COLUMNS` describes it.
struct Column {
    name: String,
    data_type: String,
    required: bool,
    charset: Option<String>,
    key: String,
    /// `COLUMN_TYPE`: `decimal(10,2)`, `datetime(3)`.
    column_type: String,
    /// `NUMERIC_SCALE` (exact numbers) or `DATETIME_PRECISION` (time types).
    scale: Option<i64>,
}

impl Column {
    /// What the column keeps of a value where it would round the rest ([`crate::rounding`]): `DECIMAL(p, s)` rounds
    /// to `s` decimals (a `DECIMAL` without a scale is `DECIMAL(10, 0)`), `DATETIME(p)`, `TIMESTAMP(p)` and `TIME(p)`
    /// with a declared precision round fractional seconds to `p` digits (MySQL Reference Manual, "Fixed-Point
    /// Types" and "Fractional Seconds in Time Values").
    fn limit(&self) -> Option<crate::rounding::Limit> {
        let type_name = self.column_type.clone();
        match (self.data_type.as_str(), self.scale) {
            ("decimal", Some(scale)) => Some(crate::rounding::Limit::Scale { type_name, scale: scale as i32 }),
            // Only a declared precision (`DATETIME(3)`): `DATETIME` alone keeps whole seconds, and refusing every
            // timestamp with milliseconds for that would be a worse surprise than the rounding.
            ("datetime" | "timestamp" | "time", Some(digits)) if self.column_type.contains('(') => {
                Some(crate::rounding::Limit::Fraction { type_name, digits: digits as u32 })
            }
            _ => None,
        }
    }
}

/// `schema.table` or `table` (each part optionally in backticks) as `(schema, table)`.
fn split_table(table: &str) -> (Option<String>, String) {
    let unquote = |s: &str| {
        let s = s.trim();
        match s.strip_prefix('`').and_then(|s| s.strip_suffix('`')) {
            Some(quoted) => quoted.replace("``", "`"),
            None => s.to_owned(),
        }
    };
    let mut in_quote = false;
    for (i, c) in table.char_indices() {
        match c {
            '`' => in_quote = !in_quote,
            '.' if !in_quote => return (Some(unquote(&table[..i])), unquote(&table[i + 1..])),
            _ => {}
        }
    }
    (None, unquote(table))
}

/// The probe of a table: its metadata lock, then a description of its columns in one text (schema and table
/// name are bound: `?` twice). Names compare byte for byte (information_schema's own collation ignores case).
#[derive(Clone, Debug)]
struct Probe {
    sql: String,
    schema: String,
    table: String,
}

impl Probe {
    fn new(qualified: &str, schema: &str, table: &str) -> Probe {
        let sql = format!(
            "SELECT (SELECT COUNT(*) FROM (SELECT 1 FROM {qualified} LIMIT 0) AS locked) AS n, \
             (SELECT CAST(GROUP_CONCAT(CONCAT_WS(' ', COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, IFNULL(COLUMN_DEFAULT, '-'), EXTRA, \
             IFNULL(CHARACTER_SET_NAME, '-'), COLUMN_KEY) ORDER BY ORDINAL_POSITION SEPARATOR ',') AS CHAR) \
             FROM information_schema.COLUMNS WHERE BINARY TABLE_SCHEMA = ? AND BINARY TABLE_NAME = ?) AS s"
        );
        Probe { sql, schema: schema.to_owned(), table: table.to_owned() }
    }

    /// Runs the probe and returns its text.
    async fn run(&self, conn: &mut MySqlConnection) -> Result<String, sqlx::Error> {
        let (_, schema): (i64, Option<String>) =
            sqlx::query_as(&self.sql).bind(&self.schema).bind(&self.table).fetch_one(&mut *conn).await?;
        Ok(schema.unwrap_or_default())
    }
}

impl crate::store::contract::PreparedEffect for SideEffect {
    /// `max_allowed_packet` bounds a statement ([`SideEffect::max_record_bytes`]).
    fn max_record_bytes(&self) -> Option<u64> {
        Some(SideEffect::max_record_bytes(self))
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "the server's max_allowed_packet is {} bytes: a record whose values take more than {} bytes goes to the dead \
             letters (param_invalid), and a dead letter keeps the first {} bytes of a payload over that with its size and \
             SHA-256; raise max_allowed_packet for larger records",
            self.max_allowed_packet(),
            SideEffect::max_record_bytes(self),
            crate::record::OVERSIZED_PREFIX_BYTES
        )]
    }
}

impl SideEffect {
    /// Checks the sink against the database and builds its statements. Returns the side effect and its bindings
    /// in value order, each with how its values are rendered.
    ///
    /// Errors: a [`PrepareError`] naming the field at fault (a missing table or column, a `utf8mb3` column that
    /// cannot hold 4-byte UTF-8, SQL the server refuses, an unknown time zone), or with `unavailable` set when the
    /// database could not be asked.
    pub async fn prepare(
        conn: &mut MySqlConnection,
        spec: &SqlEffect,
        time: &TimeSettings,
    ) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
        if jiff::tz::TimeZone::get(&time.zone).is_err() {
            return Err(prepare_error("sink.time_zone", format!("{:?} is not a time zone idemflow knows (IANA names such as \"Europe/Paris\", or \"UTC\")", time.zone)));
        }
        let packet = super::max_allowed_packet(conn).await.map_err(|e| db_error("database", e, ""))?;
        let prepared = match spec {
            SqlEffect::Table { table, columns, on_conflict, conflict_columns } => {
                prepare_table(conn, table, columns, *on_conflict, conflict_columns.as_deref()).await
            }
            SqlEffect::PerRecord { statements, params, allow_procedures } => prepare_sql(conn, statements, params, *allow_procedures).await,
            SqlEffect::BatchSql { .. } => Err(prepare_error(
                "sink.batch_sql",
                "runs on PostgreSQL only: on MySQL/MariaDB write per-record statements in sink.sql".to_owned(),
            )),
        };
        prepared.map(|(side_effect, bindings)| (SideEffect { packet, ..side_effect }, bindings))
    }

    /// The most bytes one record's values may take: what one statement carries to the server is at most its
    /// `max_allowed_packet`, less [`super::PACKET_MARGIN`]. A record over it is dead-lettered before the batch
    /// ([`crate::prepare::Preparer::with_max_record_bytes`]) instead of breaking the connection at every retry.
    pub fn max_record_bytes(&self) -> u64 {
        self.packet.saturating_sub(super::PACKET_MARGIN)
    }

    /// The server's `max_allowed_packet` in bytes, for `check`.
    pub fn max_allowed_packet(&self) -> u64 {
        self.packet
    }

    /// Starts a batch in the open transaction `conn`: takes the tables' metadata locks and checks that the schema
    /// is still the one the statements were built from. Returns `false` when it changed: roll back and prepare
    /// again.
    ///
    /// Errors: the database's (a dropped table is error 1146, fatal).
    pub async fn begin(&self, conn: &mut MySqlConnection) -> Result<bool, sqlx::Error> {
        let Some(probe) = &self.probe else { return Ok(true) };
        let schema = probe.run(conn).await?;
        if schema != self.schema {
            tracing::info!(built_for = %self.schema, now = %schema, "the side effect's schema changed");
        }
        Ok(schema == self.schema)
    }

    /// Applies the side effect for all `rows` (the fast path).
    pub async fn apply_all(&self, conn: &mut MySqlConnection, rows: &[&Apply]) -> Result<(), sqlx::Error> {
        match &self.form {
            Form::Table { head, tail, columns } => {
                let bytes = |r: &&Apply| r.values.iter().map(|v| v.as_ref().map_or(4, String::len)).sum::<usize>();
                for part in super::chunks(rows, *columns, bytes) {
                    insert_rows(conn, head, tail, *columns, part).await?;
                }
                Ok(())
            }
            Form::Sql(statements) => {
                for row in rows {
                    run_statements(conn, statements, row).await?;
                }
                Ok(())
            }
        }
    }

    /// Applies the side effect for one record (the slow path).
    pub async fn apply_one(&self, conn: &mut MySqlConnection, row: &Apply) -> Result<(), sqlx::Error> {
        match &self.form {
            Form::Table { head, tail, columns } => insert_rows(conn, head, tail, *columns, &[row]).await,
            Form::Sql(statements) => run_statements(conn, statements, row).await,
        }
    }
}

async fn insert_rows(conn: &mut MySqlConnection, head: &str, tail: &str, columns: usize, rows: &[&Apply]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let sql = format!("{head} {}{tail}", super::rows(&format!("({})", marks(columns)), rows.len()));
    let mut query = sqlx::query(&sql);
    for r in rows {
        for v in &r.values[..columns] {
            query = query.bind(v.as_deref());
        }
    }
    query.execute(&mut *conn).await?;
    Ok(())
}

async fn run_statements(conn: &mut MySqlConnection, statements: &[(String, Vec<usize>)], row: &Apply) -> Result<(), sqlx::Error> {
    for (sql, slots) in statements {
        let mut query = sqlx::query(sql);
        for &slot in slots {
            query = query.bind(row.values[slot].as_deref());
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

/// How a column's values are rendered, by its `DATA_TYPE`; `json` also for MariaDB's JSON alias (a `LONGTEXT`
/// with a `json_valid` check).
fn render_for(c: &Column, json: bool) -> Render {
    match c.data_type.as_str() {
        "json" => Render::Json,
        _ if json => Render::Json,
        "timestamp" => Render::UtcWallClock,
        "datetime" => Render::LocalWallClock,
        "tinyint" | "smallint" | "mediumint" | "int" | "bigint" | "decimal" | "float" | "double" => Render::Numeric,
        _ => Render::Text,
    }
}

/// The clause after the table form's `VALUES` for `on_conflict` (empty for `error`), against the table's unique keys
/// (`unique`, the primary key included): MySQL's `ON DUPLICATE KEY UPDATE` takes no conflict target and fires on a
/// conflict on any unique key, so the key is the primary key or `conflict_columns`, which must be exactly one unique
/// key's, and a table with several unique keys takes only `error`.
///
/// Errors: a conflict rule the table's keys cannot honour (`sink.on_conflict`, `sink.conflict_columns`).
fn conflict_tail(
    on_conflict: OnConflict,
    conflict_columns: Option<&[String]>,
    unique: &[Vec<String>],
    catalog: &[Column],
    columns: &[Binding],
    qualified: &str,
) -> Result<String, PrepareError> {
    if on_conflict != OnConflict::Error && unique.len() > 1 {
        return Err(prepare_error(
            "sink.on_conflict",
            format!(
                "table {qualified} has {} unique keys (the primary key included): MySQL's ON DUPLICATE KEY UPDATE takes no \
                 conflict target and fires on a conflict on any of them, so a record colliding on another unique key \
                 would {} another row; use on_conflict = \"error\" (such a record is dead-lettered), or the SQL form",
                unique.len(),
                if on_conflict == OnConflict::Update { "overwrite" } else { "be skipped against" }
            ),
        ));
    }
    let key: Vec<String> = match conflict_columns {
        Some(cols) => {
            let mut wanted: Vec<&String> = cols.iter().collect();
            wanted.sort();
            if !unique.iter().any(|k| {
                let mut k: Vec<&String> = k.iter().collect();
                k.sort();
                k == wanted
            }) {
                return Err(prepare_error(
                    "sink.conflict_columns",
                    format!(
                        "{cols:?} is not the primary key or a unique key of {qualified}: MySQL's ON DUPLICATE KEY UPDATE takes no \
                         conflict target, so the columns must be exactly one unique key's"
                    ),
                ));
            }
            cols.to_vec()
        }
        None => catalog.iter().filter(|c| c.key == "PRI").map(|c| c.name.clone()).collect(),
    };
    Ok(match on_conflict {
        OnConflict::Error => String::new(),
        OnConflict::Nothing | OnConflict::Update if key.is_empty() => {
            return Err(prepare_error("sink.conflict_columns", format!("table {qualified} has no primary key: list the conflict columns (a unique key's)")));
        }
        OnConflict::Nothing => format!(" ON DUPLICATE KEY UPDATE {0} = {0}", quote_ident(&key[0])),
        OnConflict::Update => {
            let sets: Vec<String> =
                columns.iter().filter(|b| !key.contains(&b.name)).map(|b| format!("{0} = VALUES({0})", quote_ident(&b.name))).collect();
            if sets.is_empty() {
                format!(" ON DUPLICATE KEY UPDATE {0} = {0}", quote_ident(&key[0]))
            } else {
                format!(" ON DUPLICATE KEY UPDATE {}", sets.join(", "))
            }
        }
    })
}

async fn prepare_table(
    conn: &mut MySqlConnection,
    table: &str,
    columns: &[Binding],
    on_conflict: OnConflict,
    conflict_columns: Option<&[String]>,
) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
    let (schema, name) = split_table(table);
    let schema: String = match schema {
        Some(s) => s,
        None => sqlx::query_scalar::<_, Option<String>>("SELECT DATABASE()")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| db_error("sink.table", e, ""))?
            .ok_or_else(|| prepare_error("sink.table", "no database is selected: name it in [database] url, or write the table as database.table"))?,
    };
    let qualified = format!("{}.{}", quote_ident(&schema), quote_ident(&name));
    let catalog = read_columns(conn, &schema, &name, &qualified).await?;
    // MariaDB's JSON is LONGTEXT with a CHECK (json_valid(`c`)) named after the column.
    let json_columns: Vec<String> = sqlx::query_scalar(
        "SELECT CONSTRAINT_NAME FROM information_schema.CHECK_CONSTRAINTS \
         WHERE BINARY CONSTRAINT_SCHEMA = ? AND BINARY TABLE_NAME = ? AND CHECK_CLAUSE LIKE 'json_valid(%'",
    )
    .bind(&schema)
    .bind(&name)
    .fetch_all(&mut *conn)
    .await
    .unwrap_or_default(); // MySQL has no TABLE_NAME there, and a real JSON type.
    let found = check_columns(columns, &catalog, conflict_columns, &qualified)?;
    let unique = unique_keys(conn, &schema, &name).await.map_err(|e| db_error("sink.table", e, ""))?;
    let tail = conflict_tail(on_conflict, conflict_columns, &unique, &catalog, columns, &qualified)?;
    let slots: Vec<Slot<'_>> = columns
        .iter()
        .zip(&found)
        .map(|(b, c)| Slot {
            field: format!("sink.columns.{}", b.name),
            what: format!("column {:?}", b.name),
            binding: b,
            column_type: c.column_type.clone(),
            expr: "?",
            render: render_for(c, json_columns.contains(&c.name)),
        })
        .collect();
    let problems = meta_mismatches(conn, &slots).await?;
    if !problems.is_empty() {
        return Err(PrepareError::all(problems));
    }
    let names = columns.iter().map(|b| quote_ident(&b.name)).collect::<Vec<_>>().join(", ");
    let head = format!("INSERT INTO {qualified} ({names}) VALUES");
    let one = format!("{head} ({}){tail}", marks(columns.len()));
    (&mut *conn).prepare(one.as_str()).await.map_err(|e| db_error("sink", e, &one))?;
    let probe = Probe::new(&qualified, &schema, &name);
    let schema_now = probe.run(conn).await.map_err(|e| db_error("sink.table", e, ""))?;
    let bindings = columns
        .iter()
        .cloned()
        .zip(found.iter().map(|c| (c.limit(), render_for(c, json_columns.contains(&c.name)), c.data_type.clone())))
        .map(|(b, (limit, render, data_type))| (Binding { limit, target_type: Some(data_type), ..b }, render))
        .collect();
    Ok((SideEffect { form: Form::Table { head, tail, columns: columns.len() }, probe: Some(probe), schema: schema_now, packet: 0 }, bindings))
}

/// The columns of table `schema.name` (`qualified`, for messages), in order.
///
/// Errors: the catalog cannot be read, or the table does not exist.
async fn read_columns(conn: &mut MySqlConnection, schema: &str, name: &str, qualified: &str) -> Result<Vec<Column>, PrepareError> {
    type Row = (String, String, String, bool, Option<String>, String, String, Option<i64>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_KEY, \
                IS_NULLABLE = 'NO' AND COLUMN_DEFAULT IS NULL AND EXTRA NOT LIKE '%auto_increment%' \
                AND EXTRA NOT LIKE '%GENERATED%' AND EXTRA NOT LIKE '%VIRTUAL%' AND EXTRA NOT LIKE '%PERSISTENT%' AND EXTRA NOT LIKE '%STORED%', \
                CHARACTER_SET_NAME, EXTRA, CAST(COLUMN_TYPE AS CHAR), \
                CAST(COALESCE(NUMERIC_SCALE, DATETIME_PRECISION) AS SIGNED) \
         FROM information_schema.COLUMNS WHERE BINARY TABLE_SCHEMA = ? AND BINARY TABLE_NAME = ? ORDER BY ORDINAL_POSITION",
    )
    .bind(schema)
    .bind(name)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| db_error("sink.table", e, ""))?;
    if rows.is_empty() {
        return Err(prepare_error("sink.table", format!("table {qualified} does not exist (or is not visible to this user)")));
    }
    Ok(rows
        .into_iter()
        .map(|(name, data_type, key, required, charset, _, column_type, scale)| Column {
            name,
            data_type: data_type.to_lowercase(),
            required,
            charset,
            key,
            column_type,
            scale,
        })
        .collect())
}

/// The catalog's column of each of `columns`, in their order, once every column exists, can hold every UTF-8
/// character and can be bound from text, every NOT NULL column without a default is mapped, and the conflict columns
/// exist.
///
/// Errors: every problem at once (one problem names its field).
fn check_columns<'c>(
    columns: &[Binding],
    catalog: &'c [Column],
    conflict_columns: Option<&[String]>,
    qualified: &str,
) -> Result<Vec<&'c Column>, PrepareError> {
    let mut problems = Vec::new();
    let names: Vec<&str> = catalog.iter().map(|c| c.name.as_str()).collect();
    let mut found = Vec::new();
    for b in columns {
        match catalog.iter().find(|c| c.name == b.name) {
            Some(c) => {
                if matches!(c.charset.as_deref(), Some("utf8mb3" | "utf8" | "ucs2")) {
                    problems.push(prepare_error(
                        format!("sink.columns.{}", b.name),
                        format!(
                            "column {:?} of {qualified} is CHARACTER SET {}, which cannot hold every UTF-8 character (emoji and \
                             other 4-byte characters would be refused or mangled): convert it to utf8mb4 (ALTER TABLE ... \
                             MODIFY {} ... CHARACTER SET utf8mb4)",
                            b.name,
                            c.charset.as_deref().unwrap_or_default(),
                            quote_ident(&b.name)
                        ),
                    ));
                }
                if c.data_type == "bit" {
                    problems.push(prepare_error(
                        format!("sink.columns.{}", b.name),
                        format!("column {:?} of {qualified} is a BIT column, which idemflow cannot bind from text: use TINYINT, BOOLEAN or BIGINT", b.name),
                    ));
                }
                found.push(c);
            }
            None => problems.push(prepare_error(
                format!("sink.columns.{}", b.name),
                format!("table {qualified} has no column {:?} (its columns: {})", b.name, names.join(", ")),
            )),
        }
    }
    for c in catalog.iter().filter(|c| c.required) {
        if !columns.iter().any(|b| b.name == c.name) {
            problems.push(prepare_error("sink.columns", format!("table {qualified}'s column {:?} is NOT NULL without a default: map it to a value", c.name)));
        }
    }
    for c in conflict_columns.unwrap_or_default() {
        if !catalog.iter().any(|k| &k.name == c) {
            problems.push(prepare_error("sink.conflict_columns", format!("table {qualified} has no column {c:?}")));
        }
    }
    if !problems.is_empty() {
        return Err(PrepareError::all(problems));
    }
    Ok(found)
}

/// The column lists of the primary key and every unique key of a table.
async fn unique_keys(conn: &mut MySqlConnection, schema: &str, table: &str) -> Result<Vec<Vec<String>>, sqlx::Error> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS WHERE BINARY TABLE_SCHEMA = ? AND BINARY TABLE_NAME = ? \
         AND NON_UNIQUE = 0 ORDER BY INDEX_NAME, SEQ_IN_INDEX",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    let mut keys: Vec<(String, Vec<String>)> = Vec::new();
    for (index, column) in rows {
        match keys.last_mut() {
            Some((i, cols)) if *i == index => cols.push(column),
            _ => keys.push((index, vec![column])),
        }
    }
    Ok(keys.into_iter().map(|(_, cols)| cols).collect())
}

async fn prepare_sql(
    conn: &mut MySqlConnection,
    statements: &[Statement],
    params: &[Binding],
    allow_procedures: bool,
) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
    let mut prepared = Vec::new();
    for statement in statements {
        let field = statement.origin.clone();
        let written = statement.render(|n| format!(":{}", statement.params[n]));
        // Each occurrence of a parameter is its own `?`: the slot of every occurrence, in order.
        let slots: Vec<usize> = statement
            .parts
            .iter()
            .filter_map(|p| match p {
                Part::Param(n) => Some(params.iter().position(|b| b.name == statement.params[*n]).expect("validated: every parameter is mapped")),
                Part::Sql(_) => None,
            })
            .collect();
        if let Some(why) = refused_statement(&written, allow_procedures) {
            return Err(prepare_error(&field, format!("{why}\n  in: {written}")));
        }
        let sql = statement.render(|n| {
            let declared = params.iter().find(|b| b.name == statement.params[n]).and_then(|b| b.declared);
            match declared {
                Some(DeclaredType::Decimal) => "CAST(? AS DECIMAL(65, 30))".to_owned(),
                Some(DeclaredType::Integer) => "CAST(? AS SIGNED)".to_owned(),
                _ => "?".to_owned(),
            }
        });
        (&mut *conn).prepare(sql.as_str()).await.map_err(|e| db_error(&field, e, &written))?;
        prepared.push((sql, slots));
    }
    // A parameter without a type is text that the statement converts where it uses it, which only a run shows.
    let slots: Vec<Slot<'_>> = params
        .iter()
        .filter_map(|b| {
            let declared = b.declared?;
            let (column_type, expr) = match declared {
                DeclaredType::Integer => ("BIGINT", "CAST(? AS SIGNED)"),
                DeclaredType::Decimal => ("DECIMAL(65, 30)", "CAST(? AS DECIMAL(65, 30))"),
                DeclaredType::Timestamp => ("TIMESTAMP(6) NULL", "?"),
                DeclaredType::Datetime => ("DATETIME(6)", "?"),
                DeclaredType::Json => ("JSON", "?"),
            };
            Some(Slot {
                field: format!("sink.params.{}", b.name),
                what: format!("parameter :{}", b.name),
                binding: b,
                column_type: column_type.to_owned(),
                expr,
                render: declared.render(),
            })
        })
        .collect();
    let problems = meta_mismatches(conn, &slots).await?;
    if !problems.is_empty() {
        return Err(PrepareError::all(problems));
    }
    let bindings = params.iter().cloned().map(|b| {
        let render = b.declared.map_or(Render::Text, |t| t.render());
        (b, render)
    }).collect();
    Ok((SideEffect { form: Form::Sql(prepared), probe: None, schema: String::new(), packet: 0 }, bindings))
}

/// Where a value is bound, for [`meta_mismatches`]: the pipeline-file field (`sink.columns.at`, `sink.params.at`),
/// what it is in words, its binding, the type that takes it (a column's `COLUMN_TYPE`, or what a declared `type`
/// casts to), the expression that binds it (`?`, `CAST(? AS SIGNED)`) and how its values are rendered.
struct Slot<'a> {
    field: String,
    what: String,
    binding: &'a Binding,
    column_type: String,
    expr: &'static str,
    render: Render,
}

/// The values fed by record metadata that their target cannot take (`meta = "topic"` into an `INT` column or an
/// `integer` parameter, `"timestamp"` into `BIGINT`): every record would be dead-lettered at run time. Each is tried
/// by the server as a batch binds it, rendered as a batch renders it, in a temporary table of one column of the
/// target's type under the session's strict `sql_mode`; an error the store dead-letters a record for
/// ([`super::error::classify_number`]: 1366, 1292, 1264, ...) is a problem naming the target, its type and the
/// metadata. The business key is not tried: its shape is the payload's. A user without the `CREATE TEMPORARY
/// TABLES` privilege (1044, 1142) is not checked so, which the log says.
///
/// Errors: the database's, other than those.
async fn meta_mismatches(conn: &mut MySqlConnection, slots: &[Slot<'_>]) -> Result<Vec<PrepareError>, PrepareError> {
    const PROBE: &str = "idemflow_meta_probe";
    let mut problems = Vec::new();
    for slot in slots {
        let ValueSource::Meta(meta) = &slot.binding.source else { continue };
        let Some(MetaSample { name, text, what }) = meta.sample() else { continue };
        let cannot = |why: String| {
            prepare_error(
                &slot.field,
                format!("{} is {}: meta = {name:?} gives {what} (such as {text:?}), which it cannot take ({why})", slot.what, slot.column_type),
            )
        };
        let value = match crate::field::wall_clock(text.to_owned(), slot.render, &jiff::tz::TimeZone::UTC) {
            Ok(v) if slot.render == Render::Json => serde_json::Value::String(v).to_string(),
            Ok(v) => v,
            Err(e) => {
                problems.push(cannot(e.to_string()));
                continue;
            }
        };
        let number = |e: &sqlx::Error| e.as_database_error().and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()).map(|m| m.number());
        let create = format!("CREATE TEMPORARY TABLE {PROBE} (v {})", slot.column_type);
        (&mut *conn).execute(format!("DROP TEMPORARY TABLE IF EXISTS {PROBE}").as_str()).await.map_err(|e| db_error("database", e, ""))?;
        if let Err(e) = (&mut *conn).execute(create.as_str()).await {
            if matches!(number(&e), Some(1044 | 1142)) {
                tracing::info!(error = %e, "no CREATE TEMPORARY TABLES privilege: the values of record metadata are not tried against their columns");
                return Ok(problems);
            }
            return Err(db_error(&slot.field, e, &create));
        }
        let insert = format!("INSERT INTO {PROBE} (v) VALUES ({})", slot.expr);
        let tried = sqlx::query(&insert).bind(&value).execute(&mut *conn).await;
        (&mut *conn).execute(format!("DROP TEMPORARY TABLE {PROBE}").as_str()).await.map_err(|e| db_error("database", e, ""))?;
        match tried {
            Ok(_) => {}
            Err(e) if number(&e).is_some_and(|n| super::error::classify_number(n) == crate::store::disposition::Disposition::Record) => {
                let said = e.as_database_error().map(|d| d.message().to_owned()).unwrap_or_default();
                problems.push(cannot(said));
            }
            Err(e) => return Err(db_error(&slot.field, e, &insert)),
        }
    }
    Ok(problems)
}

/// Why a statement of the SQL form cannot run inside the batch transaction, or `None`. Only statements that
/// change rows or read are let through (`INSERT`, `UPDATE`, `DELETE`, `REPLACE`, `SELECT`, `WITH`, `VALUES`,
/// `TABLE`), read past leading comments: anything else may commit the transaction implicitly or change the session
/// (MySQL Reference Manual, "Statements That Cause an Implicit Commit"). `CALL` only with `allow_procedures`: a
/// procedure may run `START TRANSACTION`, `COMMIT` or a statement that commits implicitly, which would commit the
/// batch's dedup rows without the effects of the records after it (a stored function or trigger cannot: error
/// 1422). Executable comments (`/*! ... */`, `/*M! ... */`) run their content, so they are refused. `IGNORE` is
/// refused: it turns data errors into warnings and stores 0s and truncations (strict mode is the point).
fn refused_statement(sql: &str, allow_procedures: bool) -> Option<String> {
    if sql.contains("/*!") || sql.contains("/*M!") {
        return Some(
            "an executable comment (/*! ... */ or /*M! ... */) runs its content as SQL, which idemflow cannot check: \
             write the statement itself"
                .to_owned(),
        );
    }
    let words: Vec<String> = past_comments(sql)
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .take(6)
        .map(str::to_ascii_uppercase)
        .collect();
    let first = words.first().map(String::as_str).unwrap_or_default();
    match first {
        "INSERT" | "UPDATE" | "DELETE" | "REPLACE" | "SELECT" | "WITH" | "VALUES" | "TABLE" => {}
        "CALL" if allow_procedures => {}
        "CALL" => {
            return Some(
                "CALL runs a procedure, which may end the batch transaction (START TRANSACTION, COMMIT, ROLLBACK, or \
                 a statement that commits implicitly): the batch's dedup rows would be committed without the effects \
                 of the records after it, and those records lost as duplicates. Write the procedure's statements in \
                 sink.sql, or set allow_procedures = true in [sink] once you are sure the procedure never controls \
                 transactions (idemflow then checks before every COMMIT that the batch transaction is still open, and \
                 stops the pipeline if it is not)"
                    .to_owned(),
            );
        }
        _ => {
            let first = if first.is_empty() { "an empty statement" } else { first };
            return Some(format!(
                "{first} cannot run in the batch transaction (it commits it, or changes the session): the side effect \
                 must be INSERT, UPDATE, DELETE, REPLACE, SELECT or WITH (CALL with allow_procedures = true)"
            ));
        }
    }
    if matches!(first, "INSERT" | "UPDATE" | "DELETE") && ignores(sql) {
        return Some(format!(
            "{first} IGNORE turns data errors into warnings (a 0, a truncated value, a zero date stored instead of the \
             record going to the dead letters): remove IGNORE; a conflict on a unique key is handled by the dedup row \
             (the same business key) or dead-letters the record"
        ));
    }
    None
}

/// Whether an `INSERT`, `UPDATE` or `DELETE` has the `IGNORE` modifier: among the words after the verb that the
/// grammar allows before the table (`LOW_PRIORITY`, `DELAYED`, `HIGH_PRIORITY`, `QUICK`, `IGNORE`; MySQL Reference
/// Manual, "INSERT Statement", "UPDATE Statement", "DELETE Statement"), with every comment and optimizer hint
/// (`/*+ ... */`) anywhere in between read past.
fn ignores(sql: &str) -> bool {
    without_comments(sql)
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_uppercase)
        .skip(1)
        // The first other word (INTO, the table) ends the modifiers: an IGNORE after it is a name.
        .take_while(|w| matches!(w.as_str(), "IGNORE" | "LOW_PRIORITY" | "DELAYED" | "HIGH_PRIORITY" | "QUICK"))
        .any(|w| w == "IGNORE")
}

/// `sql` with its comments taken out (`/* ... */` and optimizer hints, `-- ` and `#` to the end of the line), each
/// replaced by a space; quoted strings and identifiers (`'...'`, `"..."`, `` `...` ``) kept as they are.
fn without_comments(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '\'' | '"' | '`' => {
                out.push(c);
                for (_, d) in chars.by_ref() {
                    out.push(d);
                    if d == c {
                        break;
                    }
                }
            }
            '/' if sql[i..].starts_with("/*") => {
                let end = sql[i + 2..].find("*/").map_or(sql.len(), |e| i + 2 + e + 2);
                while chars.peek().is_some_and(|(j, _)| *j < end) {
                    chars.next();
                }
                out.push(' ');
            }
            '#' => {
                while chars.peek().is_some_and(|(_, d)| *d != '\n') {
                    chars.next();
                }
                out.push(' ');
            }
            '-' if sql[i..].starts_with("--") && sql[i + 2..].chars().next().is_none_or(|d| d.is_whitespace() || d.is_control()) => {
                while chars.peek().is_some_and(|(_, d)| *d != '\n') {
                    chars.next();
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

/// `sql` after its leading white space and comments (`-- ` to the end of the line, `#` likewise, `/* ... */`).
fn past_comments(mut sql: &str) -> &str {
    loop {
        sql = sql.trim_start();
        let rest = if let Some(r) = sql.strip_prefix("/*") {
            r.find("*/").map_or("", |end| &r[end + 2..])
        } else if sql.starts_with('#') || (sql.starts_with("--") && sql[2..].chars().next().is_none_or(|c| c.is_whitespace() || c.is_control())) {
            sql.find('\n').map_or("", |end| &sql[end + 1..])
        } else {
            return sql;
        };
        sql = rest;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names() {
        assert_eq!(split_table("payments"), (None, "payments".to_owned()));
        assert_eq!(split_table("shop.payments"), (Some("shop".to_owned()), "payments".to_owned()));
        assert_eq!(split_table("`my.db`.`pay``s`"), (Some("my.db".to_owned()), "pay`s".to_owned()));
        assert_eq!(quote_ident("a`b"), "`a``b`");
        assert_eq!(split_table("`a```"), (None, "a`".to_owned()));
    }

    #[test]
    fn statements_that_cannot_run_in_the_batch() {
        let refused = |sql: &str| refused_statement(sql, false);
        assert!(refused("INSERT IGNORE INTO t VALUES (:a)").is_some());
        assert!(refused("update low_priority ignore t set a = :a").is_some());
        // Comments and optimizer hints between the verb and IGNORE (issue 42, item 11).
        assert!(refused("INSERT /*+ SET_VAR(sort_buffer_size = 16M) */ IGNORE INTO t VALUES (:a)").is_some());
        assert!(refused("INSERT LOW_PRIORITY /* a */ -- b\n # c\n IGNORE INTO t VALUES (:a)").is_some());
        assert!(refused("DELETE /* x y z w */ QUICK IGNORE FROM t WHERE a = :a").is_some());
        assert!(refused("INSERT INTO t (ignore_me) VALUES (:a)").is_none());
        assert!(refused("UPDATE t SET note = '/* IGNORE */' WHERE a = :a").is_none());
        assert!(refused("INSERT INTO `ignore` VALUES (:a)").is_none(), "a table named ignore comes after INTO");
        assert!(refused("CREATE TEMPORARY TABLE x (a int)").is_some());
        assert!(refused("COMMIT").is_some());
        assert!(refused("INSERT INTO ignore_list VALUES (:a)").is_none());
        assert!(refused("UPDATE accounts SET balance = balance - :amount").is_none());
        // Past comments, whatever their form; executable comments never.
        assert!(refused("-- note\nTRUNCATE accounts").unwrap().starts_with("TRUNCATE"));
        assert!(refused("/* x */ COMMIT").unwrap().starts_with("COMMIT"));
        assert!(refused("# c\n /* a */ -- b\nDROP TABLE t").unwrap().starts_with("DROP"));
        assert!(refused("/*!50000 COMMIT */").unwrap().contains("executable comment"));
        assert!(refused("INSERT INTO t VALUES (:a) /*M! ; COMMIT */").is_some());
        assert!(refused("/* unterminated COMMIT").is_some());
        assert!(refused("-- x").is_some());
        assert!(refused("--1\nUPDATE t SET a = 1").is_some(), "--1 is not a comment in MySQL");
        assert!(refused("/* why */ UPDATE t SET a = :a").is_none());
        assert!(refused("WITH x AS (SELECT 1) UPDATE t SET a = 1").is_none());
        // Procedures only when allowed.
        assert!(refused("CALL apply_payment(:a)").unwrap().contains("allow_procedures"));
        assert!(refused_statement("CALL apply_payment(:a)", true).is_none());
        assert!(refused_statement("-- c\nSTART TRANSACTION", true).is_some());
    }
}
