//! How a value meets the PostgreSQL type of its target (a column, a statement's parameter): read from the catalog
//! ([`target_types`]), rendered in the worker and cast in SQL ([`Target`]).

use crate::field::Render;
use sqlx::PgConnection;

/// How a value meets its target type: how it is rendered in the worker and how SQL casts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// Cast from text as is.
    Plain(Render),
    /// `timestamp` (without time zone): a value with a UTC offset is converted to the pipeline's time zone.
    LocalTimestamp,
}

impl Target {
    pub(super) fn render(self) -> Render {
        match self {
            Target::Plain(r) => r,
            Target::LocalTimestamp => Render::Text,
        }
    }

    /// The SQL that turns text `x` into the target type named `type_name`.
    pub(super) fn cast(self, x: &str, type_name: &str) -> String {
        match self {
            Target::Plain(_) => format!("CAST({x} AS {type_name})"),
            // A time of day followed by Z, an offset or a zone name: see crate::field::has_utc_offset.
            Target::LocalTimestamp => format!(
                "CAST(CASE WHEN {x} ~ ':[0-9]{{2}}(:[0-9]{{2}}([.][0-9]+)?)?\\s*([zZ]|[+-][0-9]{{2}}(:?[0-9]{{2}}){{0,2}}|[A-Za-z][A-Za-z0-9_/+-]*)\\s*$' \
                 THEN CAST(CAST({x} AS timestamptz) AS timestamp) ELSE CAST({x} AS timestamp) END AS {type_name})"
            ),
        }
    }
}

/// The type of a target, as the catalog describes it.
pub(super) struct TargetType {
    /// `format_type` with the type modifier -1, that is without one: `numeric`, `text[]`, `timestamp with time
    /// zone`, `bpchar`, `"bit"`. (With `NULL` instead of -1, `format_type` names `bpchar` `character` and `bit`
    /// `bit`, which SQL reads as `character(1)` and `bit(1)`: a cast to those truncates silently. PostgreSQL's
    /// `format_type` source says so.)
    pub(super) name: String,
    /// How its values are bound, or why they cannot be.
    pub(super) target: Result<Target, String>,
}

pub(super) const JSON: i64 = 114;
pub(super) const JSONB: i64 = 3802;
pub(super) const TIMESTAMP: i64 = 1114;
pub(super) const TIMESTAMPTZ: i64 = 1184;
pub(super) const NUMERIC: i64 = 1700;
pub(super) const TIME: i64 = 1083;
pub(super) const TIMETZ: i64 = 1266;

/// Reads how each type OID is bound: domains are looked through to their base type; composites, arrays of
/// composites and pseudo-types are refused with a reason.
pub(super) async fn target_types(conn: &mut PgConnection, oids: &[i64]) -> Result<Vec<TargetType>, sqlx::Error> {
    type Row = (i64, String, i64, String, String, i64, String);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT u.oid::int8, format_type(u.oid::oid, -1), b.oid::int8, b.typtype::text, b.typcategory::text,
                coalesce(eb.oid::int8, 0), coalesce(eb.typtype::text, '')
         FROM unnest($1::int8[]) AS u(oid)
         JOIN pg_type t ON t.oid = u.oid::oid
         JOIN pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
         LEFT JOIN pg_type e ON e.oid = b.typelem AND b.typcategory = 'A'
         LEFT JOIN pg_type eb ON eb.oid = CASE WHEN e.typtype = 'd' THEN e.typbasetype ELSE e.oid END",
    )
    .bind(oids)
    .persistent(super::persistent())
    .fetch_all(&mut *conn)
    .await?;
    Ok(oids
        .iter()
        .map(|oid| {
            let Some((_, name, base, typtype, category, elem, elem_typtype)) = rows.iter().find(|r| r.0 == *oid) else {
                return TargetType { name: format!("type {oid}"), target: Err(format!("type {oid} does not exist")) };
            };
            let target = match (*base, typtype.as_str(), category.as_str()) {
                (JSON | JSONB, _, _) => Ok(Target::Plain(Render::Json)),
                (TIMESTAMPTZ, _, _) => Ok(Target::Plain(Render::Zoned)),
                (TIMESTAMP, _, _) => Ok(Target::LocalTimestamp),
                (_, _, "A") if elem_typtype == "c" => Err(format!(
                    "{name} is an array of a composite type, which idemflow cannot bind: use a jsonb column"
                )),
                (_, _, "A") => Ok(Target::Plain(Render::Array { json: matches!(*elem, JSON | JSONB) })),
                (_, "c", _) => Err(format!(
                    "{name} is a composite type, which idemflow cannot bind: map its fields to columns, or use jsonb"
                )),
                (_, "p", _) => Err(format!("{name} is a pseudo-type: cast the parameter to a real type in the SQL")),
                // Ranges and multiranges take their text form (`[1,5)`), as do enums and every base type.
                _ => Ok(Target::Plain(Render::Text)),
            };
            TargetType { name: name.clone(), target }
        })
        .collect())
}
