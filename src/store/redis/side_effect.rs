//! The side effect of a Redis pipeline: its commands checked against the server and rendered for each record.

use crate::store::redis_command::{Piece, RedisCommand};
use super::numbers::{self, Number};
use super::RedisStore;
use crate::store::spec::{Binding, DeclaredType, RedisEffect};
use crate::field::Render;
use crate::store::rows::Apply;
use crate::store::contract::PrepareError;
use redis::Value;

/// One argument, pieces resolved to binding indexes.
#[derive(Clone, Debug)]
enum Part {
    Text(String),
    Value(usize),
}

#[derive(Clone, Debug)]
struct Compiled {
    origin: String,
    name: String,
    args: Vec<(Vec<Part>, Option<Number>)>,
}

/// The commands of one pipeline, ready to render for each record.
#[derive(Clone, Debug)]
pub struct SideEffect {
    commands: Vec<Compiled>,
    names: Vec<String>,
    /// Per binding, the number its `type` says it is (`decimal`, `integer`).
    numbers: Vec<Option<Number>>,
}

/// No limit of its own on a record's values, nothing to say in `check`.
impl crate::store::contract::PreparedEffect for SideEffect {}

impl SideEffect {
    /// Checks `spec`'s commands against the server (`COMMAND INFO`: the command exists, may run in a script, and
    /// takes this many arguments) and returns the side effect with its bindings, each rendered as text (or as its
    /// declared `type`).
    ///
    /// Errors: a [`PrepareError`] naming `sink.redis[i]`, or `unavailable` when Redis could not be asked.
    pub async fn prepare(store: &RedisStore, spec: &RedisEffect) -> Result<(SideEffect, Vec<(Binding, Render)>), PrepareError> {
        let RedisEffect { commands, params } = spec;
        let mut conn = store.conn().await.map_err(|e| PrepareError { field: "redis".into(), message: format!("cannot connect: {e}"), unavailable: true })?;
        let mut compiled = Vec::new();
        for c in commands {
            let refuse = |message: String| PrepareError { field: c.origin.clone(), message, unavailable: false };
            let info: Value = redis::cmd("COMMAND").arg("INFO").arg(&c.name).query_async(&mut conn).await.map_err(|e| PrepareError {
                field: "redis".into(),
                message: format!("cannot ask Redis about {}: {e}", c.name),
                unavailable: e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal(),
            })?;
            check_info(c, &info).map_err(refuse)?;
            let numbers = numbers::schema(&c.name, &c.args).map_err(refuse)?;
            let mut args = Vec::new();
            for (i, (a, number)) in c.args.iter().zip(numbers).enumerate() {
                let parts: Vec<Part> = a
                    .0
                    .iter()
                    .map(|p| match p {
                        Piece::Text(t) => Part::Text(t.clone()),
                        Piece::Param(n) => Part::Value(params.iter().position(|b| b.name == *n).expect("placeholders checked by the configuration")),
                    })
                    .collect();
                if let (Some(kind), Some(literal)) = (number, a.literal()) {
                    if !kind.accepts(&literal) {
                        return Err(refuse(format!("argument {} of {} must be {}: {literal:?}", i + 1, c.name, kind.describe())));
                    }
                }
                args.push((parts, number));
            }
            compiled.push(Compiled { origin: c.origin.clone(), name: c.name.clone(), args });
        }
        let bindings = params.iter().map(|b| (b.clone(), b.declared.map_or(Render::Text, DeclaredType::render))).collect();
        let numbers = params
            .iter()
            .map(|b| match b.declared {
                Some(DeclaredType::Integer) => Some(Number::Integer),
                Some(DeclaredType::Decimal) => Some(Number::Float),
                _ => None,
            })
            .collect();
        Ok((SideEffect { commands: compiled, names: params.iter().map(|b| b.name.clone()).collect(), numbers }, bindings))
    }

    /// The commands as the batch script receives them once per batch: per command, its name then its arguments,
    /// `None` for an argument with a placeholder (filled for each record by [`SideEffect::render`]).
    pub fn template(&self) -> Vec<Vec<Option<String>>> {
        self.commands
            .iter()
            .map(|c| {
                let args = c.args.iter().map(|(parts, _)| match parts.as_slice() {
                    [] => Some(String::new()),
                    [Part::Text(t)] => Some(t.clone()),
                    _ => None,
                });
                std::iter::once(Some(c.name.clone())).chain(args).collect()
            })
            .collect()
    }

    /// The record's values for the arguments with placeholders, command after command, in the order of
    /// [`SideEffect::template`]'s `None`s. An optional parameter without a value is empty text.
    ///
    /// Errors: a value that a command needs as a number (or whose `type` says it is one) is not one: the record is
    /// dead-lettered (`param_invalid`) before any of its commands runs.
    pub fn render(&self, apply: &Apply) -> Result<Vec<String>, String> {
        for ((value, number), name) in apply.values.iter().zip(&self.numbers).zip(&self.names) {
            if let (Some(v), Some(kind)) = (value, number) {
                if !kind.accepts(v) {
                    return Err(format!("sink.params.{name}: its type says {}, got {v:?}", kind.describe()));
                }
            }
        }
        let mut out = Vec::new();
        for c in &self.commands {
            for (i, (parts, number)) in c.args.iter().enumerate() {
                if !parts.iter().any(|p| matches!(p, Part::Value(_))) {
                    continue;
                }
                let mut arg = String::new();
                for p in parts {
                    match p {
                        Part::Text(t) => arg.push_str(t),
                        Part::Value(v) => arg.push_str(apply.values[*v].as_deref().unwrap_or_default()),
                    }
                }
                if let Some(kind) = number {
                    if !kind.accepts(&arg) {
                        let from: Vec<&str> = parts.iter().filter_map(|p| if let Part::Value(v) = p { Some(self.names[*v].as_str()) } else { None }).collect();
                        return Err(format!(
                            "{}: argument {} of {} must be {}, got {arg:?} (from {})",
                            c.origin, i + 1, c.name, kind.describe(), from.join(", ")
                        ));
                    }
                }
                out.push(arg);
            }
        }
        Ok(out)
    }
}

/// Checks one command against its `COMMAND INFO` reply: `[name, arity, flags, ...]`, arity counting the name and
/// negative for "at least" (Redis documentation, COMMAND).
fn check_info(c: &RedisCommand, info: &Value) -> Result<(), String> {
    let entry = match info {
        Value::Array(v) => v.first(),
        _ => None,
    };
    let Some(Value::Array(entry)) = entry else {
        return Err(format!("Redis does not know the command {}", c.name));
    };
    let arity = match entry.get(1) {
        Some(Value::Int(a)) => *a,
        _ => return Err(format!("Redis answered COMMAND INFO {} in an unknown form", c.name)),
    };
    let flags: Vec<String> = match entry.get(2) {
        Some(Value::Array(f)) | Some(Value::Set(f)) => f
            .iter()
            .filter_map(|v| match v {
                Value::SimpleString(s) => Some(s.clone()),
                Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    for refused in ["noscript", "blocking", "pubsub"] {
        if flags.iter().any(|f| f == refused) && !(refused == "pubsub" && c.name == "PUBLISH") {
            return Err(format!("{} cannot run in idemflow's batch script (Redis flags it {refused})", c.name));
        }
    }
    let given = c.args.len() as i64 + 1;
    let fits = if arity >= 0 { given == arity } else { given >= -arity };
    if !fits {
        let wanted = if arity >= 0 { format!("exactly {}", arity - 1) } else { format!("at least {}", -arity - 1) };
        return Err(format!("{} takes {wanted} argument(s) after its name; {} given", c.name, given - 1));
    }
    Ok(())
}
