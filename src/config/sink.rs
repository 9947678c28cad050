//! `[sink]`: the side effect's grammar (the table, sql, batch_sql and redis forms, their `[sink.columns]` and
//! `[sink.params]` bindings) and, beside it, the outbox's requests (`[[sink.http]]`, `[[sink.kafka]]`, `[outbox]`),
//! validated into a [`SinkSpec`] and an [`OutboxSpec`]. Problems are reported through [`Problems`], each naming its
//! field (`sink.columns.amount.type`).

use crate::field::FieldPath;
use crate::outbox::spec::{OutboxSpec, RawOutbox};
use crate::store::redis_command::RedisCommand;
use crate::store::spec::{Binding, DeclaredType, Meta, NaiveTimestamps, OnConflict, RedisEffect, SinkSpec, SqlEffect, ValueSource};
use crate::store::template::{self, Dialect, Statement};
use crate::validate::Problems;
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSink {
    pub(super) table: Option<String>,
    pub(super) columns: Option<BTreeMap<String, toml::Value>>,
    pub(super) on_conflict: Option<OnConflict>,
    pub(super) conflict_columns: Option<Vec<String>>,
    pub(super) sql: Option<RawSql>,
    pub(super) batch_sql: Option<RawSql>,
    pub(super) redis: Option<Vec<Vec<String>>>,
    pub(super) params: Option<BTreeMap<String, toml::Value>>,
    pub(super) allow_procedures: Option<bool>,
    pub(super) time_zone: Option<String>,
    pub(super) naive_timestamps: Option<NaiveTimestamps>,
    pub(super) http: Option<crate::outbox::spec::OneOrMany<crate::outbox::spec::RawHttp>>,
    pub(super) kafka: Option<crate::outbox::spec::OneOrMany<crate::outbox::spec::RawKafka>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawSql {
    One(String),
    Many(Vec<String>),
}

pub(super) fn path_or_error(text: &str, field: &str, e: &mut impl Problems) -> Option<FieldPath> {
    FieldPath::parse(text).map_err(|err| e.push(field, format!("{text:?} {err}"))).ok()
}

/// `[sink]` (and `[outbox]`, for `[[sink.http]]`): the side effect in its store, and the outbox's requests beside it
/// or instead of it.
pub(super) fn validate_sink(mut raw: RawSink, outbox: RawOutbox, dialect: Dialect, e: &mut impl Problems) -> Option<(SinkSpec, Option<OutboxSpec>)> {
    let kafka = raw.kafka.take().map(crate::outbox::spec::OneOrMany::into_vec);
    let http = match (raw.http.take().map(crate::outbox::spec::OneOrMany::into_vec), &kafka) {
        (None, None) => None,
        (http, _) => Some(http.unwrap_or_default()),
    };
    if http.is_none() && outbox.is_set() {
        e.push("outbox", "applies to the requests of [[sink.http]] and [[sink.kafka]], which this pipeline has none of");
    }
    let forms =
        [raw.table.is_some(), raw.sql.is_some(), raw.batch_sql.is_some(), raw.redis.is_some()].iter().filter(|set| **set).count();
    if forms > 1 || (forms == 0 && http.is_none()) {
        e.push(
            "sink",
            "set exactly one of table (with [sink.columns]), sql, batch_sql or redis (each with [sink.params]), or [[sink.http]] or [[sink.kafka]] alone",
        );
        return None;
    }
    let Some(http) = http else { return validate_effect(raw, &[], dialect, e).map(|(sink, _)| (sink, None)) };
    let kafka = kafka.unwrap_or_default();
    if raw.redis.is_some() {
        e.push(if http.is_empty() { "sink.kafka" } else { "sink.http" }, "runs through an outbox in the database: the table, sql and batch_sql forms (PostgreSQL, MySQL/MariaDB), or alone; not with redis");
        return None;
    }
    if raw.allow_procedures == Some(true) {
        e.push(
            "sink.allow_procedures",
            "cannot be combined with [[sink.http]] or [[sink.kafka]]: a procedure that commits would commit the claims \
             without their outbox rows, and those requests would never be sent",
        );
    }
    let used = crate::outbox::spec::used_params(&http, &kafka);
    let (sink, params) = if forms == 0 {
        for (set, field) in [
            (raw.columns.is_some(), "sink.columns"),
            (raw.on_conflict.is_some(), "sink.on_conflict"),
            (raw.conflict_columns.is_some(), "sink.conflict_columns"),
            (raw.allow_procedures.is_some(), "sink.allow_procedures"),
        ] {
            if set {
                e.push(field, "belongs to the table or sql form; [[sink.http]] alone uses [sink.params]");
            }
        }
        let raw_params = raw.params.take().unwrap_or_default();
        match_params(used.iter().map(String::as_str).collect(), &raw_params, "sink.http", |n| format!("{{{n}}}"), e);
        let params = bindings(raw_params, "sink.params", false, e)?;
        (SinkSpec::Sql(SqlEffect::PerRecord { statements: Vec::new(), params: Vec::new(), allow_procedures: false }), params)
    } else {
        validate_effect(raw, &used, dialect, e)?
    };
    if !kafka.is_empty() && !cfg!(feature = "kafka") {
        e.push("sink.kafka", crate::store::not_built("Kafka", "kafka"));
    }
    let outbox = crate::outbox::spec::parse(http, kafka, &params, outbox, e)?;
    Some((sink, Some(outbox)))
}

/// The side effect of `[sink]`, and every `[sink.params]` entry; `outbox_params` are the placeholders of
/// `[[sink.http]]` (which read `[sink.params]`, the table form's too).
fn validate_effect(raw: RawSink, outbox_params: &[String], dialect: Dialect, e: &mut impl Problems) -> Option<(SinkSpec, Vec<Binding>)> {
    let http = !outbox_params.is_empty();
    if raw.allow_procedures.is_some() && raw.sql.is_none() {
        e.push("sink.allow_procedures", "belongs to the sql form (CALL statements in sink.sql)");
    }
    if let Some(commands) = raw.redis {
        for (set, field) in [
            (raw.columns.is_some(), "sink.columns"),
            (raw.on_conflict.is_some(), "sink.on_conflict"),
            (raw.conflict_columns.is_some(), "sink.conflict_columns"),
        ] {
            if set {
                e.push(field, "belongs to the table form; the redis form uses [sink.params]");
            }
        }
        let mut parsed = Vec::new();
        for (i, words) in commands.iter().enumerate() {
            let field = format!("sink.redis[{i}]");
            match RedisCommand::parse(field.clone(), words) {
                Ok(c) => parsed.push(c),
                Err(why) => e.push(&field, why),
            }
        }
        if commands.is_empty() {
            e.push("sink.redis", "holds no command: write [[\"HSET\", \"payment:{id}\", \"amount\", \"{amount}\"], ...]");
        }
        let raw_params = raw.params.unwrap_or_default();
        match_params(parsed.iter().flat_map(RedisCommand::params).collect(), &raw_params, "sink.redis", |n| format!("{{{n}}}"), e);
        let params = bindings(raw_params, "sink.params", false, e)?;
        return Some((SinkSpec::Redis(RedisEffect { commands: parsed, params }), Vec::new()));
    }
    if let Some(table) = raw.table {
        let params = match raw.params {
            Some(_) if !http => {
                e.push("sink.params", "belongs to the sql form; the table form uses [sink.columns] ([sink.params] are for [[sink.http]] beside it)");
                Vec::new()
            }
            Some(raw_params) => {
                match_params(outbox_params.iter().map(String::as_str).collect(), &raw_params, "sink.http", |n| format!("{{{n}}}"), e);
                bindings(raw_params, "sink.params", false, e)?
            }
            None => Vec::new(),
        };
        if table.split('.').count() > 2 || table.split('.').any(str::is_empty) {
            e.push("sink.table", format!("{table:?} must be `table` or `schema.table`"));
        }
        let on_conflict = raw.on_conflict.unwrap_or_default();
        if raw.conflict_columns.is_some() && on_conflict != OnConflict::Update {
            e.push("sink.conflict_columns", "only applies with on_conflict = \"update\"");
        }
        let columns = raw.columns.unwrap_or_default();
        if columns.is_empty() {
            e.push("sink.columns", "map at least one column to a value");
        }
        let columns = bindings(columns, "sink.columns", false, e);
        return Some((SinkSpec::Sql(SqlEffect::Table { table, columns: columns?, on_conflict, conflict_columns: raw.conflict_columns }), params));
    }
    for (set, field) in [
        (raw.columns.is_some(), "sink.columns"),
        (raw.on_conflict.is_some(), "sink.on_conflict"),
        (raw.conflict_columns.is_some(), "sink.conflict_columns"),
    ] {
        if set {
            e.push(field, "belongs to the table form; the sql and batch_sql forms use [sink.params]");
        }
    }
    if let Some(texts) = raw.batch_sql {
        let sink = validate_batch_sql(texts, raw.params.unwrap_or_default(), dialect, e)?;
        let SinkSpec::Sql(SqlEffect::BatchSql { columns, .. }) = &sink else { unreachable!("validate_batch_sql gives the batch_sql form") };
        let columns = columns.clone();
        for name in outbox_params.iter().filter(|n| !columns.iter().any(|c| c.name == **n)) {
            e.push("sink.params", format!("{{{name}}} is used in sink.http but has no entry in [sink.params]"));
        }
        return Some((sink, columns));
    }
    let statements = parse_statements(raw.sql.expect("checked above"), "sink.sql", dialect, e);
    if statements.is_empty() && e.count() == 0 {
        e.push("sink.sql", "holds no statement");
    }
    let raw_params = raw.params.unwrap_or_default();
    let in_sql: Vec<&str> = statements.iter().flat_map(|s| s.params.iter().map(String::as_str)).collect();
    let form = if http { "sink.sql or sink.http" } else { "sink.sql" };
    let used: Vec<&str> = in_sql.iter().copied().chain(outbox_params.iter().map(String::as_str)).collect();
    match_params(used, &raw_params, form, |n| if in_sql.contains(&n) || !http { format!(":{n}") } else { format!("{{{n}}}") }, e);
    let params = bindings(raw_params, "sink.params", false, e)?;
    // The statements bind only what they name; [[sink.http]] takes its own.
    let sql_params = params.iter().filter(|b| in_sql.contains(&b.name.as_str())).cloned().collect();
    let allow_procedures = raw.allow_procedures.unwrap_or(false);
    Some((SinkSpec::Sql(SqlEffect::PerRecord { statements, params: sql_params, allow_procedures }), params))
}



/// Checks that every placeholder `used` in `form` (`sink.sql`, `sink.redis`; written as `written(name)`) has its
/// `[sink.params]` entry and every entry is used, with a "did you mean" where a misspelling is likely.
fn match_params(mut used: Vec<&str>, params: &BTreeMap<String, toml::Value>, form: &str, written: impl Fn(&str) -> String, e: &mut impl Problems) {
    used.sort_unstable();
    used.dedup();
    let unused: Vec<&str> = params.keys().map(String::as_str).filter(|n| used.binary_search(n).is_err()).collect();
    for name in &used {
        if !params.contains_key(*name) {
            let hint = crate::secret::closest(name, unused.iter().copied())
                .map(|c| format!(" (did you mean sink.params.{c}?)"))
                .unwrap_or_default();
            e.push("sink.params", format!("{} is used in {form} but has no entry in [sink.params]{hint}", written(name)));
        }
    }
    for name in &unused {
        let hint = crate::secret::closest(name, used.iter().copied().filter(|u| !params.contains_key(*u)))
            .map(|c| format!(" (did you mean {}?)", written(c)))
            .unwrap_or_default();
        e.push(&format!("sink.params.{name}"), format!("is not used in {form} (no {} there){hint}", written(name)));
    }
}

/// The statements of `texts` (`key` in the file: `sink.sql` or `sink.batch_sql`), each named by its place for
/// error messages: `key`, `key[i]`, or `key[i] (statement n)` when one string holds several.
fn parse_statements(texts: RawSql, key: &str, dialect: Dialect, e: &mut impl Problems) -> Vec<Statement> {
    let texts = match texts {
        RawSql::One(s) => vec![s],
        RawSql::Many(v) => v,
    };
    let mut statements = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let field = if texts.len() == 1 { key.to_owned() } else { format!("{key}[{i}]") };
        match template::parse_in(text, dialect) {
            Ok(parsed) => {
                let several = parsed.len() > 1;
                statements.extend(parsed.into_iter().enumerate().map(|(n, mut s)| {
                    s.origin = if several { format!("{field} (statement {})", n + 1) } else { field.clone() };
                    s
                }))
            }
            Err(err) => e.push(&field, err.to_string()),
        }
    }
    statements
}

/// The `batch_sql` form: statements over `new_records`, whose columns are `[sink.params]`.
fn validate_batch_sql(
    texts: RawSql,
    raw_params: BTreeMap<String, toml::Value>,
    dialect: Dialect,
    e: &mut impl Problems,
) -> Option<SinkSpec> {
    if let Err(why) = dialect.batch_sql() {
        e.push("sink.batch_sql", why);
        return None;
    }
    let statements = parse_statements(texts, "sink.batch_sql", dialect, e);
    for s in &statements {
        if let Some(name) = s.params.first() {
            e.push(&s.origin, format!("reads the batch as the relation new_records: write new_records.{name} (a column), not :{name}"));
        }
    }
    if statements.is_empty() && e.count() == 0 {
        e.push("sink.batch_sql", "holds no statement");
    }
    if raw_params.is_empty() {
        e.push("sink.params", "name at least one column of new_records and where its value comes from");
    }
    let columns = bindings(raw_params, "sink.params", true, e)?;
    Some(SinkSpec::Sql(SqlEffect::BatchSql { statements, columns }))
}

/// The bindings of one table of the file; `free_types`: `type` names a PostgreSQL type (a `batch_sql` column),
/// otherwise one of [`DeclaredType`].
fn bindings(raw: BTreeMap<String, toml::Value>, table: &str, free_types: bool, e: &mut impl Problems) -> Option<Vec<Binding>> {
    let list: Vec<_> =
        raw.into_iter().map(|(name, v)| binding(&name, v, &format!("{table}.{name}"), free_types, e)).collect();
    list.into_iter().collect()
}

fn binding(name: &str, value: toml::Value, field: &str, free_types: bool, e: &mut impl Problems) -> Option<Binding> {
    let plain =
        |source| Binding { name: name.to_owned(), source, default: None, optional: false, declared: None, type_name: None, round: false, limit: None, target_type: None };
    let table = match value {
        toml::Value::String(path) => return path_or_error(&path, field, e).map(|p| plain(ValueSource::Field(p))),
        toml::Value::Table(table) => table,
        other => {
            e.push(field, format!("expected a field path or a table, found {}", other.type_str()));
            return None;
        }
    };
    let mut source = None;
    let mut count = 0;
    let mut default = None;
    let mut optional = false;
    let mut declared = None;
    let mut type_name = None;
    let mut round = false;
    for (k, v) in table {
        let sub = format!("{field}.{k}");
        match (k.as_str(), v) {
            ("field", toml::Value::String(p)) => {
                count += 1;
                source = path_or_error(&p, &sub, e).map(ValueSource::Field);
            }
            ("record_key", toml::Value::Boolean(true)) => {
                count += 1;
                source = Some(ValueSource::RecordKey);
            }
            ("header", toml::Value::String(h)) if !h.is_empty() => {
                count += 1;
                source = Some(ValueSource::Header(h));
            }
            ("property", toml::Value::String(p)) => {
                count += 1;
                if !crate::record::PROPERTIES.contains(&p.as_str()) {
                    e.push(&sub, format!("{p:?} is not a message property: one of {}", crate::record::PROPERTIES.join(", ")));
                }
                source = Some(ValueSource::Property(p));
            }
            ("meta", toml::Value::String(m)) => {
                count += 1;
                match Meta::deserialize(toml::Value::String(m.clone())) {
                    Ok(meta) => source = Some(ValueSource::Meta(meta)),
                    Err(_) => e.push(
                        &sub,
                        format!("{m:?} is not one of topic, partition, offset, timestamp, business_key"),
                    ),
                }
            }
            ("default", v) => match v {
                toml::Value::String(s) => default = Some(s),
                toml::Value::Integer(i) => default = Some(i.to_string()),
                toml::Value::Float(f) => default = Some(f.to_string()),
                toml::Value::Boolean(b) => default = Some(b.to_string()),
                other => e.push(&sub, format!("expected a string, number or boolean, found {}", other.type_str())),
            },
            ("optional", toml::Value::Boolean(b)) => optional = b,
            ("round", toml::Value::Boolean(b)) if table_form(field) => round = b,
            ("round", _) if !table_form(field) => e.push(&sub, "applies to the table form's columns ([sink.columns]) only"),
            ("type", toml::Value::String(t)) if free_types => {
                if t.trim().is_empty() {
                    e.push(&sub, "must name a PostgreSQL type (such as numeric, timestamptz, jsonb, text[])");
                }
                type_name = Some(t);
            }
            ("type", toml::Value::String(t)) => match DeclaredType::deserialize(toml::Value::String(t.clone())) {
                Ok(t) => declared = Some(t),
                Err(_) => e.push(&sub, format!("{t:?} is not one of decimal, integer, timestamp, datetime, json")),
            },
            (k @ ("field" | "record_key" | "header" | "property" | "meta" | "optional" | "type" | "round"), v) => {
                e.push(&sub, format!("unexpected value {v} for {k}"));
            }
            (k, _) => e.push(
                &sub,
                format!("unknown key {k:?}; expected field, record_key, header, property or meta, with default, optional or type"),
            ),
        }
    }
    if count != 1 {
        e.push(field, "set exactly one of field, record_key = true, header, property, meta");
        return None;
    }
    if default.is_some() && optional {
        e.push(field, "set default or optional = true, not both (a default already makes the value optional)");
    }
    Some(Binding { default, optional, declared, type_name, round, ..plain(source?) })
}

/// Whether `field` is a column of the table form (`sink.columns.x`), where `round` applies.
fn table_form(field: &str) -> bool {
    field.starts_with("sink.columns.")
}
