//! Where the commands idemflow accepts in `[sink] redis` take numbers, and how Redis parses each of them.
//!
//! Redis checks a number only when the command runs, and by then the record's earlier commands have run too (a
//! script has no rollback). So every numeric argument is checked before the script, exactly as the server would
//! parse it, and a record whose value would be refused is dead-lettered (`param_invalid`) with nothing run.
//! A command whose numeric arguments idemflow does not know is refused by `check` (see [`schema`]).
//!
//! The rules are Redis 7.0's (`src/util.c` `string2ll`, `string2ld`, `string2d`; `t_string.c` `parseExtendedStringArgumentsOrReply`
//! and `getExpireCommand`; `t_zset.c` `zaddGenericCommand`; `t_stream.c` `streamParseAddOrTrimArgsOrReply` and
//! `streamParseStrictIDOrReply`; `bitops.c` `getBitOffsetFromArgument`).

use crate::store::redis_command::Arg;

/// A number an argument must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Number {
    /// A signed 64-bit integer as `string2ll` reads it: an optional `-`, no `+`, no leading zero (but `0` itself),
    /// no `-0`, no spaces.
    Integer,
    /// A whole number of seconds for an expiry (`SET ... EX`, `SETEX`, `EXPIRE`): an [`Number::Integer`] that
    /// converts to milliseconds without overflow, and above 0 where `positive`.
    Seconds {
        /// Redis refuses 0 and negative values here (`SET EX`, `SETEX`, `GETEX EX`), not for `EXPIRE`.
        positive: bool,
    },
    /// Milliseconds for an expiry (`SET ... PX`, `PSETEX`, `PEXPIRE`): an [`Number::Integer`], above 0 where
    /// `positive`, leaving room for the current time to be added.
    Millis {
        /// As for [`Number::Seconds`].
        positive: bool,
    },
    /// An increment for `INCRBYFLOAT` and `HINCRBYFLOAT` (`string2ld`): a finite number, no leading space.
    Float,
    /// A sorted-set score (`string2d`): a number or `inf`/`-inf`, not NaN, no leading space.
    Score,
    /// A non-negative integer (`MAXLEN`, `LIMIT`, `SETRANGE` offsets).
    NonNegative,
    /// A bit offset for `SETBIT`: 0 to 2^32 - 1.
    BitOffset,
    /// A bit for `SETBIT`: `0` or `1`.
    Bit,
    /// A stream entry id for `XADD`: `*`, `<ms>`, `<ms>-<seq>` or `<ms>-*`, not `0-0`.
    StreamId,
    /// A stream id threshold for `XADD ... MINID`: `<ms>` or `<ms>-<seq>`.
    MinId,
}

impl Number {
    /// Whether Redis would take `text` here.
    pub fn accepts(self, text: &str) -> bool {
        match self {
            Number::Integer => integer(text).is_some(),
            Number::Seconds { positive } => integer(text).is_some_and(|n| (!positive || n > 0) && n.checked_mul(1000).is_some_and(fits_from_now)),
            Number::Millis { positive } => integer(text).is_some_and(|n| (!positive || n > 0) && fits_from_now(n)),
            Number::Float => float(text).is_some_and(f64::is_finite),
            Number::Score => float(text).is_some_and(|f| score_in_range(text, f)),
            Number::NonNegative => integer(text).is_some_and(|n| n >= 0),
            Number::BitOffset => integer(text).is_some_and(|n| (0..1 << 32).contains(&n)),
            Number::Bit => text == "0" || text == "1",
            Number::StreamId => text == "*" || stream_id(text, true).is_some_and(|id| id != (0, Some(0))),
            Number::MinId => stream_id(text, false).is_some(),
        }
    }

    /// What it must be, for messages: "an integer", "a number".
    pub fn describe(self) -> &'static str {
        match self {
            Number::Integer => "an integer",
            Number::Seconds { positive: true } | Number::Millis { positive: true } => "a whole number above 0",
            Number::Seconds { positive: false } | Number::Millis { positive: false } => "an integer",
            Number::Float => "a number",
            Number::Score => "a number (or inf, -inf)",
            Number::NonNegative => "an integer of 0 or more",
            Number::BitOffset => "a bit offset (0 to 4294967295)",
            Number::Bit => "0 or 1",
            Number::StreamId => "a stream id (*, <ms> or <ms>-<seq>, not 0-0)",
            Number::MinId => "a stream id (<ms> or <ms>-<seq>)",
        }
    }
}

/// An expiry in milliseconds to which Redis adds the current time (about 2^41 ms since 1970) without overflow.
fn fits_from_now(ms: i64) -> bool {
    ms <= i64::MAX - (1 << 45)
}

/// Redis's `string2ll`: at most 20 characters, an optional `-`, then `0` alone or a digit 1-9 and digits, within
/// i64.
pub fn integer(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.is_empty() || b.len() > 20 {
        return None;
    }
    if b == b"0" {
        return Some(0);
    }
    let digits = b.strip_prefix(b"-").unwrap_or(b);
    match digits.first() {
        Some(b'1'..=b'9') if digits.iter().all(u8::is_ascii_digit) => text.parse().ok(),
        _ => None,
    }
}

/// Redis's `string2ld` / `string2d` as far as Rust's parser agrees with `strtod`: no leading or trailing space, not
/// NaN. (`strtod` also reads hexadecimal floats, which this refuses: such a record is dead-lettered rather than run.)
pub fn float(text: &str) -> Option<f64> {
    if text.is_empty() || text.len() > 5 * 1024 || text.starts_with(|c: char| c.is_ascii_whitespace()) {
        return None;
    }
    text.parse::<f64>().ok().filter(|f| !f.is_nan())
}

/// Redis's `string2d` refuses what `strtod` reads out of range (`ERANGE`): an overflow to infinity (`1e400`, where
/// `inf` written out is taken) and an underflow to zero (`1e-400`).
fn score_in_range(text: &str, f: f64) -> bool {
    let spelled_infinite = text.trim_start_matches(['+', '-']).to_ascii_lowercase().starts_with("inf");
    let nonzero_digit = text.split(['e', 'E']).next().is_some_and(|m| m.bytes().any(|b| (b'1'..=b'9').contains(&b)));
    (f.is_finite() || spelled_infinite) && !(f == 0.0 && nonzero_digit)
}

/// `<ms>`, `<ms>-<seq>` (and `<ms>-*` where `auto_seq`), each part an unsigned 64-bit decimal.
fn stream_id(text: &str, auto_seq: bool) -> Option<(u64, Option<u64>)> {
    let part = |p: &str| (!p.is_empty() && p.bytes().all(|c| c.is_ascii_digit())).then(|| p.parse::<u64>().ok()).flatten();
    match text.split_once('-') {
        None => Some((part(text)?, None)),
        Some((ms, "*")) if auto_seq => Some((part(ms)?, None)),
        Some((ms, seq)) => Some((part(ms)?, Some(part(seq)?))),
    }
}

/// Commands idemflow accepts whose arguments hold no number (keys, fields, members and values are any text).
const PLAIN: &[&str] = &[
    "APPEND", "DECR", "DEL", "EXISTS", "GET", "GETDEL", "GETSET", "HDEL", "HGET", "HMSET", "HSET", "HSETNX", "INCR",
    "LPUSH", "LPUSHX", "MSET", "MSETNX", "PERSIST", "PFADD", "PFMERGE", "PUBLISH", "RENAME", "RENAMENX", "RPUSH",
    "RPUSHX", "SADD", "SDIFFSTORE", "SETNX", "SINTERSTORE", "SMOVE", "SREM", "SUNIONSTORE", "UNLINK", "ZREM",
];

/// Commands with numbers at fixed places: (command, the argument index after the name, what it must be).
const FIXED: &[(&str, &[(usize, Number)])] = &[
    ("INCRBY", &[(1, Number::Integer)]),
    ("DECRBY", &[(1, Number::Integer)]),
    ("INCRBYFLOAT", &[(1, Number::Float)]),
    ("HINCRBY", &[(2, Number::Integer)]),
    ("HINCRBYFLOAT", &[(2, Number::Float)]),
    ("ZINCRBY", &[(1, Number::Score)]),
    ("EXPIRE", &[(1, Number::Seconds { positive: false })]),
    ("EXPIREAT", &[(1, Number::Seconds { positive: false })]),
    ("PEXPIRE", &[(1, Number::Millis { positive: false })]),
    ("PEXPIREAT", &[(1, Number::Millis { positive: false })]),
    ("SETEX", &[(1, Number::Seconds { positive: true })]),
    ("PSETEX", &[(1, Number::Millis { positive: true })]),
    ("LREM", &[(1, Number::Integer)]),
    ("LSET", &[(1, Number::Integer)]),
    ("LTRIM", &[(1, Number::Integer), (2, Number::Integer)]),
    ("SETRANGE", &[(1, Number::NonNegative)]),
    ("SETBIT", &[(1, Number::BitOffset), (2, Number::Bit)]),
    ("LPOP", &[(1, Number::NonNegative)]),
    ("RPOP", &[(1, Number::NonNegative)]),
    ("SPOP", &[(1, Number::NonNegative)]),
    ("ZREMRANGEBYRANK", &[(1, Number::Integer), (2, Number::Integer)]),
];

/// Every command [`schema`] knows, for messages.
pub fn known() -> Vec<&'static str> {
    let mut all: Vec<&str> = PLAIN.iter().copied().chain(FIXED.iter().map(|(n, _)| *n)).chain(["SET", "GETEX", "ZADD", "XADD"]).collect();
    all.sort_unstable();
    all
}

/// For each argument of command `name` (upper case) after its name, the number it must be, if any.
///
/// Errors: a command idemflow does not know the arguments of, or an option of `SET`, `GETEX`, `ZADD` or `XADD`
/// written with a placeholder (which arguments are numbers depends on it) or not one Redis knows.
pub fn schema(name: &str, args: &[Arg]) -> Result<Vec<Option<Number>>, String> {
    let mut slots = vec![None; args.len()];
    if PLAIN.contains(&name) {
        return Ok(slots);
    }
    if let Some((_, fixed)) = FIXED.iter().find(|(n, _)| *n == name) {
        for &(at, kind) in *fixed {
            if let Some(slot) = slots.get_mut(at) {
                *slot = Some(kind);
            }
        }
        return Ok(slots);
    }
    let literal = |i: usize| -> Result<String, String> {
        args[i].literal().map(|t| t.to_ascii_uppercase()).ok_or_else(|| {
            format!("argument {} of {name} is an option, which must be written literally (which arguments are numbers depends on it)", i + 1)
        })
    };
    match name {
        // SET key value [NX | XX] [GET] [EX s | PX ms | EXAT s | PXAT ms | KEEPTTL]; GETEX key [EX ... | PERSIST].
        "SET" | "GETEX" => {
            let mut i = if name == "SET" { 2 } else { 1 };
            while i < args.len() {
                let word = literal(i)?;
                let number = match word.as_str() {
                    "EX" | "EXAT" => Some(Number::Seconds { positive: true }),
                    "PX" | "PXAT" => Some(Number::Millis { positive: true }),
                    "NX" | "XX" | "GET" | "KEEPTTL" if name == "SET" => None,
                    "PERSIST" if name == "GETEX" => None,
                    other => return Err(format!("argument {} of {name}: {other:?} is not an option of {name}", i + 1)),
                };
                match number {
                    Some(_) if i + 1 >= args.len() => return Err(format!("argument {} of {name}: {word} takes a value after it", i + 1)),
                    Some(n) => {
                        slots[i + 1] = Some(n);
                        i += 2;
                    }
                    None => i += 1,
                }
            }
            Ok(slots)
        }
        // ZADD key [NX | XX] [GT | LT] [CH] [INCR] score member [score member ...]
        "ZADD" => {
            let mut i = 1;
            while i < args.len() && matches!(args[i].literal().map(|t| t.to_ascii_uppercase()).as_deref(), Some("NX" | "XX" | "GT" | "LT" | "CH" | "INCR")) {
                i += 1;
            }
            while i < args.len() {
                slots[i] = Some(Number::Score);
                i += 2;
            }
            Ok(slots)
        }
        // XADD key [NOMKSTREAM] [MAXLEN | MINID [= | ~] threshold [LIMIT count]] <* | id> field value [...]
        "XADD" => {
            let mut i = 1;
            loop {
                let word = args.get(i).and_then(Arg::literal).map(|t| t.to_ascii_uppercase());
                match word.as_deref() {
                    Some("NOMKSTREAM") => i += 1,
                    Some(trim @ ("MAXLEN" | "MINID")) => {
                        i += 1;
                        if matches!(args.get(i).and_then(Arg::literal).as_deref(), Some("=" | "~")) {
                            i += 1;
                        }
                        if let Some(slot) = slots.get_mut(i) {
                            *slot = Some(if trim == "MAXLEN" { Number::NonNegative } else { Number::MinId });
                        }
                        i += 1;
                        if args.get(i).and_then(Arg::literal).is_some_and(|t| t.eq_ignore_ascii_case("LIMIT")) {
                            if let Some(slot) = slots.get_mut(i + 1) {
                                *slot = Some(Number::NonNegative);
                            }
                            i += 2;
                        }
                    }
                    _ => break,
                }
            }
            if let Some(slot) = slots.get_mut(i) {
                *slot = Some(Number::StreamId);
            }
            Ok(slots)
        }
        _ => Err(format!(
            "idemflow does not know where {name} takes numbers, so it could not check a record's values before the \
             script runs its commands (a value Redis refuses would leave the record half applied); commands it knows: {}",
            known().join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis_command::parse_arg;

    #[test]
    fn integers_as_string2ll_reads_them() {
        for ok in ["0", "1", "-1", "42", "9223372036854775807", "-9223372036854775808"] {
            assert!(Number::Integer.accepts(ok), "{ok}");
        }
        for bad in ["", "007", "-0", "+1", " 1", "1 ", "1.0", "9223372036854775808", "-", "0x10", "١"] {
            assert!(!Number::Integer.accepts(bad), "{bad}");
        }
    }

    #[test]
    fn floats_scores_expiries_and_ids() {
        assert!(Number::Float.accepts("10.5") && Number::Float.accepts("-1e3") && Number::Float.accepts("+2"));
        for bad in ["abc", " 1", "1 ", "nan", "inf", "-inf", "", "1e400"] {
            assert!(!Number::Float.accepts(bad), "{bad}");
        }
        assert!(Number::Score.accepts("inf") && Number::Score.accepts("-inf") && Number::Score.accepts("1.5"));
        assert!(!Number::Score.accepts("abc") && !Number::Score.accepts("nan"));
        assert!(!Number::Score.accepts("1e400") && !Number::Score.accepts("1e-400"), "out of range for strtod");
        assert!(Number::Score.accepts("+inf") && Number::Score.accepts("0.0") && Number::Score.accepts("0e5"));
        let ex = Number::Seconds { positive: true };
        assert!(ex.accepts("60") && !ex.accepts("0") && !ex.accepts("-5") && !ex.accepts("abc") && !ex.accepts("9223372036854775807"));
        assert!(Number::Seconds { positive: false }.accepts("-5"));
        assert!(Number::StreamId.accepts("*") && Number::StreamId.accepts("5-1") && Number::StreamId.accepts("5-*") && Number::StreamId.accepts("7"));
        assert!(!Number::StreamId.accepts("0-0") && !Number::StreamId.accepts("a-1") && !Number::StreamId.accepts("1-"));
        assert!(Number::Bit.accepts("1") && !Number::Bit.accepts("2"));
        assert!(Number::BitOffset.accepts("4294967295") && !Number::BitOffset.accepts("4294967296"));
    }

    fn args(words: &[&str]) -> Vec<Arg> {
        words.iter().map(|w| parse_arg(w).unwrap()).collect()
    }

    #[test]
    fn schemas_of_commands_with_options() {
        let s = schema("SET", &args(&["k", "{v}", "NX", "EX", "{ttl}"])).unwrap();
        assert_eq!(s, vec![None, None, None, None, Some(Number::Seconds { positive: true })]);
        assert!(schema("SET", &args(&["k", "v", "{opt}", "5"])).unwrap_err().contains("must be written literally"));
        assert!(schema("SET", &args(&["k", "v", "EXX", "5"])).unwrap_err().contains("not an option of SET"));
        let z = schema("ZADD", &args(&["z", "NX", "CH", "{score}", "m", "2", "n"])).unwrap();
        assert_eq!(z, vec![None, None, None, Some(Number::Score), None, Some(Number::Score), None]);
        let x = schema("XADD", &args(&["s", "MAXLEN", "~", "{n}", "*", "f", "{v}"])).unwrap();
        assert_eq!(x, vec![None, None, None, Some(Number::NonNegative), Some(Number::StreamId), None, None]);
        let x = schema("XADD", &args(&["payments-applied", "*", "order", "{id}"])).unwrap();
        assert_eq!(x[1], Some(Number::StreamId));
        assert_eq!(schema("HINCRBY", &args(&["h", "f", "{n}"])).unwrap()[2], Some(Number::Integer));
        assert!(schema("HSET", &args(&["h", "f", "{v}"])).unwrap().iter().all(Option::is_none));
        assert!(schema("BITFIELD", &args(&["k", "INCRBY", "u8", "0", "1"])).unwrap_err().contains("does not know where BITFIELD takes numbers"));
    }
}
