//! The SQL form's server-side loop: the statements of a batch's new records run in one round trip, by a PL/pgSQL
//! function in the session's temporary schema (see [`SqlLoop`]).

use super::quote::quote_literal;
use crate::store::rows::Apply;
use sqlx::PgConnection;

/// The SQL form's statements as one PL/pgSQL function over a batch, so a batch of new records costs one round trip
/// instead of one per statement and record.
///
/// The function is created in `pg_temp` (the session's temporary schema: no privilege but `TEMP`, which PostgreSQL
/// grants to PUBLIC, and nothing left behind) by [`SqlLoop::ensure`], which every batch transaction runs in its
/// first round trip: it creates the function only when the session does not have it yet, so it works through a
/// transaction pooler that hands each batch another server session, and a batch that rolls back takes the
/// function's creation with it. The name carries a hash of the definition, so statements rebuilt after a schema
/// change get a function of their own. Functions in `pg_temp` are never found by an unqualified name (PostgreSQL
/// docs, "search_path"), so the call names the schema.
///
/// Its only argument is a text array of `records x width` values, record after record, each record's values in
/// binding order (`NULL` for SQL NULL). Each statement reads its parameters as `$1[base + slot]` with the same cast
/// as the per-record statement, runs as a PL/pgSQL SQL statement (planned once per session and kept, PostgreSQL
/// docs, "PL/pgSQL Under the Hood: Plan Caching"), and an error aborts the call with the statement's own SQLSTATE,
/// so the sink's slow path takes over exactly as after a per-statement error. A `statement_timeout` times the whole
/// call: a call it cancels fails with [`CANCELLED_LOOP`], a record's error, so the slow path redoes the batch one
/// statement at a time. What differs from one round trip per statement: `current_query()` and
/// `statement_timestamp()` are the call's for the whole batch, and `pg_stat_statements` and statement logs show the
/// call (`track = all` shows the statements inside it).
#[derive(Clone, Debug)]
pub struct SqlLoop {
    /// `DO` block that creates the function unless the session has it.
    ensure: String,
    /// `SELECT pg_temp.<name>($1::text[])`.
    call: String,
    /// Values per record.
    width: usize,
}

/// The SQLSTATE of a server-side loop cancelled as a whole (`statement_timeout`): class P0, a record's error, so the
/// batch is redone record by record.
pub const CANCELLED_LOOP: &str = "P0I01";

/// Dollar-quote tags of the function's body and of the `DO` block that creates it.
const LOOP_TAG: &str = "$idemflow_loop$";
const ENSURE_TAG: &str = "$idemflow_ensure$";

impl SqlLoop {
    /// The loop over `bodies` (each statement rendered with `render(n)` for parameter `n` as an expression over
    /// `$1` and `idemflow_base`), `width` values per record. `None` when a statement's text contains one of the
    /// dollar-quote tags used here (it could not be quoted).
    pub(super) fn new(bodies: &[String], width: usize) -> Option<SqlLoop> {
        if bodies.iter().any(|b| b.contains(LOOP_TAG) || b.contains(ENSURE_TAG)) {
            return None;
        }
        if width == 0 {
            // Nothing to loop over: the array would be empty whatever the batch.
            return None;
        }
        // `;` on a line of its own: a statement may end in a `--` comment.
        let statements: String = bodies.iter().map(|b| format!("    {b}\n    ;\n")).collect();
        // A `statement_timeout` now times the whole batch, not each statement: a batch cancelled that way is redone
        // one statement at a time, each timed on its own (SQLSTATE class P0 is a record's error: the sink's slow
        // path), instead of being retried as it was, forever. (QUERY_CANCELED is caught only by name, PostgreSQL
        // docs, "Trapping Errors".)
        let body = format!(
            "\n-- idemflow {}\n#variable_conflict use_column\nBEGIN\n  \
             FOR idemflow_base IN 0 .. coalesce(array_length($1, 1), 0) - 1 BY {width} LOOP\n{statements}  END LOOP;\n\
             EXCEPTION WHEN query_canceled THEN\n  \
             RAISE EXCEPTION 'the batch''s statements, run as one call, were cancelled (statement_timeout?): redone one at a time' \
             USING ERRCODE = '{CANCELLED_LOOP}', DETAIL = SQLERRM;\nEND\n",
            env!("CARGO_PKG_VERSION")
        );
        use sha2::Digest as _;
        let hash = hex::encode(&sha2::Sha256::digest(body.as_bytes())[..8]);
        let name = format!("idemflow_sql_form_{hash}");
        let create = format!(
            "CREATE FUNCTION pg_temp.{name}(text[]) RETURNS void LANGUAGE plpgsql VOLATILE AS {LOOP_TAG}{body}{LOOP_TAG}"
        );
        let ensure = format!(
            "DO {ENSURE_TAG} BEGIN IF to_regprocedure({}) IS NULL THEN EXECUTE {}; END IF; END {ENSURE_TAG}; ",
            quote_literal(&format!("pg_temp.{name}(text[])")),
            quote_literal(&create)
        );
        Some(SqlLoop { ensure, call: format!("SELECT pg_temp.{name}($1::text[])"), width })
    }

    /// The `DO` block that creates the function unless the session has it: run first in every batch
    /// transaction.
    pub(super) fn ensure(&self) -> &str {
        &self.ensure
    }

    /// Runs the statements for every record of `rows`, in order, in one round trip.
    pub(super) async fn run(&self, conn: &mut PgConnection, rows: &[&Apply]) -> Result<(), sqlx::Error> {
        let mut values: Vec<Option<&str>> = Vec::with_capacity(rows.len() * self.width);
        for row in rows {
            debug_assert_eq!(row.values.len(), self.width);
            values.extend(row.values.iter().map(Option::as_deref));
        }
        sqlx::query(&self.call).persistent(super::persistent()).bind(values).execute(&mut *conn).await?;
        Ok(())
    }
}
