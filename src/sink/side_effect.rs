//! The side effect: what a new record does to the business tables.
//!
//! Values arrive as text and are cast by Postgres to the type of their target (looked up once, at start-up, from
//! the catalog or from the statement's inferred parameter types, without type modifiers: an explicit cast to
//! `varchar(5)` or `char(5)` would silently truncate, while the assignment to the column checks the length and
//! fails instead). Text input is exact for every type: `numeric`
//! keeps every digit, `timestamptz` keeps the offset's meaning, `jsonb` takes nested objects. Payload values are
//! only ever bound as parameters, never spliced into SQL.
//!
//! - Table form: `INSERT INTO t (c1, c2) SELECT CAST(u.c0 AS type1), ... FROM unnest($1::text[], ...)`, one
//!   statement for all new records of a batch.
//! - SQL form: the configured statements with each `:name` replaced by `CAST($n::text AS type)`, run for each new
//!   record in batch order, as prepared statements (sqlx caches them per connection).

use super::template::Statement;
use crate::config::{Binding, OnConflict, SinkSpec};
use crate::field::Render;
use crate::prepare::Apply;
use sqlx::{Either, Executor, PgConnection, Statement as _};

/// The side effect of one pipeline, checked against the database.
#[derive(Clone, Debug)]
pub enum SideEffect {
    /// One set-based `INSERT` per batch.
    Table {
        /// The generated statement; parameter `n` is the text array of column `n`.
        sql: String,
        /// Number of columns.
        columns: usize,
    },
    /// Statements run per record.
    Sql(Vec<PreparedStatement>),
}

/// One statement of the SQL form, ready to bind.
#[derive(Clone, Debug)]
pub struct PreparedStatement {
    /// SQL text with `CAST($n::text AS type)` parameters.
    pub sql: String,
    /// For each positional parameter, the index of its binding (and of its value in [`Apply::values`]).
    pub slots: Vec<usize>,
}

/// Why a side effect does not fit the database. Each is a configuration error naming the field.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PrepareError {
    /// The pipeline field at fault, such as `sink.table` or `sink.sql[1]`.
    pub field: String,
    /// What is wrong, with Postgres's own message where it gave one.
    pub message: String,
}

fn prepare_error(field: impl Into<String>, message: impl Into<String>) -> PrepareError {
    PrepareError { field: field.into(), message: message.into() }
}

/// Double-quotes an identifier (PostgreSQL docs, "Identifiers and Key Words").
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl SideEffect {
    /// Checks the sink against the database and builds its statements. Returns the side effect and its bindings
    /// in value order, each with how its values are rendered.
    pub async fn prepare(
        conn: &mut PgConnection,
        spec: &SinkSpec,
    ) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
        match spec {
            SinkSpec::Table { table, columns, on_conflict, conflict_columns } => {
                prepare_table(conn, table, columns, *on_conflict, conflict_columns.as_deref()).await
            }
            SinkSpec::Sql { statements, params } => prepare_sql(conn, statements, params).await,
        }
    }

    /// Applies the side effect for all `rows` (the fast path).
    pub async fn apply_all(&self, conn: &mut PgConnection, rows: &[&Apply]) -> Result<(), sqlx::Error> {
        match self {
            SideEffect::Table { sql, columns } => insert_rows(conn, sql, *columns, rows).await,
            SideEffect::Sql(statements) => {
                for row in rows {
                    run_statements(conn, statements, row).await?;
                }
                Ok(())
            }
        }
    }

    /// Applies the side effect for one record (the slow path).
    pub async fn apply_one(&self, conn: &mut PgConnection, row: &Apply) -> Result<(), sqlx::Error> {
        match self {
            SideEffect::Table { sql, columns } => insert_rows(conn, sql, *columns, &[row]).await,
            SideEffect::Sql(statements) => run_statements(conn, statements, row).await,
        }
    }
}

/// The table form: one statement, one text array per column.
async fn insert_rows(conn: &mut PgConnection, sql: &str, columns: usize, rows: &[&Apply]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut query = sqlx::query(sql);
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
        let mut query = sqlx::query(&statement.sql);
        for &slot in &statement.slots {
            query = query.bind(row.values[slot].as_deref());
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

fn render_for(type_name: &str) -> Render {
    if matches!(type_name, "json" | "jsonb") {
        Render::Json
    } else {
        Render::Text
    }
}

async fn prepare_table(
    conn: &mut PgConnection,
    table: &str,
    columns: &[Binding],
    on_conflict: OnConflict,
    conflict_columns: Option<&[String]>,
) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
    let found: Option<(i64, String)> =
        sqlx::query_as("SELECT c.oid::int8, c.oid::regclass::text FROM pg_class c WHERE c.oid = to_regclass($1)")
            .bind(table)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| prepare_error("sink.table", e.to_string()))?;
    let Some((oid, qualified)) = found else {
        return Err(prepare_error("sink.table", format!("table {table:?} does not exist (or is not visible on the search_path)")));
    };
    let required: Vec<String> = sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute WHERE attrelid = $1::int8::oid AND attnum > 0 AND NOT attisdropped \
         AND attnotnull AND NOT atthasdef AND attidentity = '' AND attgenerated = ''",
    )
    .bind(oid)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| prepare_error("sink.table", e.to_string()))?;
    if let Some(missing) = required.iter().find(|c| !columns.iter().any(|b| &b.name == *c)) {
        return Err(prepare_error(
            "sink.columns",
            format!("table {qualified}'s column {missing:?} is NOT NULL without a default: map it to a value"),
        ));
    }
    let catalog: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT a.attname::text, format_type(a.atttypid, -1), coalesce(a.attnum = ANY(i.indkey), false)
         FROM pg_attribute a
         LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
         WHERE a.attrelid = $1::int8::oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
    )
    .bind(oid)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| prepare_error("sink.table", e.to_string()))?;
    let mut types = Vec::new();
    for b in columns {
        match catalog.iter().find(|(name, _, _)| *name == b.name) {
            Some((_, ty, _)) => types.push(ty.clone()),
            None => {
                let names: Vec<&str> = catalog.iter().map(|(n, _, _)| n.as_str()).collect();
                return Err(prepare_error(
                    format!("sink.columns.{}", b.name),
                    format!("table {qualified} has no column {:?} (its columns: {})", b.name, names.join(", ")),
                ));
            }
        }
    }
    if let Some(cols) = conflict_columns {
        for c in cols {
            if !catalog.iter().any(|(name, _, _)| name == c) {
                return Err(prepare_error("sink.conflict_columns", format!("table {qualified} has no column {c:?}")));
            }
        }
    }
    let target: Vec<String> = match conflict_columns {
        Some(cols) => cols.to_vec(),
        None => catalog.iter().filter(|(_, _, pk)| *pk).map(|(n, _, _)| n.clone()).collect(),
    };
    let conflict = match on_conflict {
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
    };
    let names = columns.iter().map(|b| quote_ident(&b.name)).collect::<Vec<_>>().join(", ");
    let casts = types.iter().enumerate().map(|(i, t)| format!("CAST(u.c{i} AS {t})")).collect::<Vec<_>>().join(", ");
    let arrays = (1..=columns.len()).map(|n| format!("${n}::text[]")).collect::<Vec<_>>().join(", ");
    let aliases = (0..columns.len()).map(|i| format!("c{i}")).collect::<Vec<_>>().join(", ");
    let sql = format!("INSERT INTO {qualified} ({names}) SELECT {casts} FROM unnest({arrays}) AS u({aliases}){conflict}");
    conn.prepare(&sql).await.map_err(|e| prepare_error("sink", format!("the generated statement is refused: {e}\n  {sql}")))?;
    let bindings = columns.iter().cloned().zip(types.iter().map(|t| render_for(t))).collect();
    Ok((SideEffect::Table { sql, columns: columns.len() }, bindings))
}

async fn prepare_sql(
    conn: &mut PgConnection,
    statements: &[Statement],
    params: &[Binding],
) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
    let mut renders = vec![Render::Text; params.len()];
    let mut prepared = Vec::new();
    for statement in statements {
        let field = statement.origin.clone();
        let plain = statement.render(|n| format!("${}", n + 1));
        let written = statement.render(|n| format!(":{}", statement.params[n]));
        let described = conn.prepare(&plain).await.map_err(|e| prepare_error(&field, format!("{e}\n  in: {written}")))?;
        let oids: Vec<i64> = match described.parameters() {
            Some(Either::Left(types)) => types.iter().map(|t| t.oid().map_or(25, |o| i64::from(o.0))).collect(),
            _ => vec![25; statement.params.len()],
        };
        let mut type_names = Vec::with_capacity(oids.len());
        for oid in oids {
            let name: String = sqlx::query_scalar("SELECT format_type($1::int8::oid, -1)")
                .bind(oid)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| prepare_error(&field, e.to_string()))?;
            type_names.push(name);
        }
        let slots: Vec<usize> = statement
            .params
            .iter()
            .map(|name| params.iter().position(|b| b.name == *name).expect("validated: every parameter is mapped"))
            .collect();
        for (n, slot) in slots.iter().enumerate() {
            if render_for(&type_names[n]) == Render::Json {
                renders[*slot] = Render::Json;
            }
        }
        let sql = statement.render(|n| format!("CAST(${}::text AS {})", n + 1, type_names[n]));
        conn.prepare(&sql).await.map_err(|e| prepare_error(&field, format!("{e}\n  in: {written}")))?;
        prepared.push(PreparedStatement { sql, slots });
    }
    Ok((SideEffect::Sql(prepared), params.iter().cloned().zip(renders).collect()))
}
