//! Field paths into a decoded JSON payload, and how a JSON value becomes the text bound into SQL.
//!
//! A path is written either as a JSON Pointer (RFC 6901: `/order/id`, with `~1` for `/` and `~0` for `~` inside a
//! member name) or in the dotted form `order.id`. Both name the same value. An array element is addressed by its
//! decimal index (`/items/0`).

use serde_json::Value;
use std::fmt;

/// A parsed field path: the reference tokens of an RFC 6901 JSON Pointer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldPath {
    tokens: Vec<String>,
}

/// Why a field path was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FieldPathError {
    /// The path is the empty string.
    #[error("is empty")]
    Empty,
    /// A JSON Pointer with `~` not followed by `0` or `1` (RFC 6901 section 3).
    #[error("is not a valid JSON Pointer (RFC 6901): `~` must be followed by `0` or `1`")]
    BadEscape,
    /// A dotted path with a `/` in it, such as `order/id`: a JSON Pointer missing its leading `/`.
    #[error("looks like a JSON Pointer without its leading `/`; write \"/{0}\" (or the dotted form)")]
    MissingSlash(String),
    /// A path with an empty member name, such as `/order//id` or `order..id`: almost always a typo.
    #[error("has an empty segment; write a member name between each pair of separators")]
    EmptySegment,
}

impl FieldPath {
    /// Parses a JSON Pointer (starts with `/`) or a dotted path (`order.id`).
    pub fn parse(text: &str) -> Result<Self, FieldPathError> {
        if text.is_empty() {
            return Err(FieldPathError::Empty);
        }
        let tokens: Vec<String> = if let Some(rest) = text.strip_prefix('/') {
            rest.split('/')
                .map(|raw| unescape(raw).ok_or(FieldPathError::BadEscape))
                .collect::<Result<_, _>>()?
        } else if text.contains('/') {
            return Err(FieldPathError::MissingSlash(text.to_owned()));
        } else {
            text.split('.').map(str::to_owned).collect()
        };
        if tokens.iter().any(String::is_empty) {
            return Err(FieldPathError::EmptySegment);
        }
        Ok(FieldPath { tokens })
    }

    /// The path's member names (array indexes as their decimal text), in order from the root.
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// The value at this path, or `None` when any step is missing (a missing member, an index out of range, or a
    /// step into a scalar).
    pub fn lookup<'v>(&self, root: &'v Value) -> Option<&'v Value> {
        self.tokens.iter().try_fold(root, |node, token| step(node, token))
    }
}

/// One step of a path: the member `token` of an object, the item at index `token` of an array (RFC 6901 section 4,
/// see [`array_index`]); `None` when there is none, or `node` is a scalar.
pub(crate) fn step<'v>(node: &'v Value, token: &str) -> Option<&'v Value> {
    match node {
        Value::Object(map) => map.get(token),
        Value::Array(items) => array_index(token).and_then(|i| items.get(i)),
        _ => None,
    }
}

/// RFC 6901 section 4: an array index is `0` or a decimal number without leading zeros.
pub(crate) fn array_index(token: &str) -> Option<usize> {
    if token.len() > 1 && token.starts_with('0') {
        return None;
    }
    if !token.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    token.parse().ok()
}

fn unescape(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return None,
            }
        } else {
            out.push(c);
        }
    }
    Some(out)
}

impl fmt::Display for FieldPath {
    /// Writes the path as a JSON Pointer.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for token in &self.tokens {
            write!(f, "/{}", token.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

/// How a JSON value is rendered into the text that Postgres then casts to the target type. Chosen per target
/// from the catalog (see [`crate::store::postgres::side_effect`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Render {
    /// For scalar types but `json`/`jsonb`: a string gives its contents, a number its exact decimal value
    /// ([`plain_decimal`]: never through a float, exponent notation written out), a boolean `true`/`false`, and an
    /// object or array its JSON text.
    Text,
    /// For `json` and `jsonb` targets: the JSON text of the value, whatever its kind (a string stays quoted).
    Json,
    /// For `timestamptz` targets: as [`Render::Text`]; in addition a string without a UTC offset is refused when
    /// the pipeline says `naive_timestamps = "dead_letter"` (see [`has_utc_offset`]).
    Zoned,
    /// For array targets (`text[]`, `int[]`, `jsonb[]`, ...): a JSON array becomes a PostgreSQL array literal
    /// (`{"a","b"}`, nested arrays as more dimensions, `null` as `NULL`); a string is taken as an array literal
    /// already written. `json` says whether elements are `json`/`jsonb` (rendered as JSON text).
    Array {
        /// Elements are `json` or `jsonb`.
        json: bool,
    },
    /// For MySQL and MariaDB `TIMESTAMP` targets (an instant; neither server parses a UTC offset): converted in the
    /// worker to UTC wall-clock time, which idemflow's sessions (`time_zone = '+00:00'`) store as that instant. A
    /// value without an offset is read in the pipeline's `time_zone` (or refused, `naive_timestamps =
    /// "dead_letter"`). See [`wall_clock`].
    UtcWallClock,
    /// For MySQL and MariaDB `DATETIME` targets (wall-clock time, no zone): a value with a UTC offset is converted to
    /// the pipeline's `time_zone`, as PostgreSQL's `timestamp` targets are; one without is kept as it is.
    LocalWallClock,
    /// For MySQL and MariaDB numeric targets: as [`Render::Text`], and a boolean as `1` or `0` (`BOOLEAN` is
    /// `TINYINT(1)` there, and `'true'` is not a number).
    Numeric,
}

/// Why a value cannot be bound.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ValueError {
    /// Postgres `text` cannot hold U+0000, and `jsonb` rejects the `\u0000` escape.
    #[error("contains the NUL character U+0000, which idemflow refuses for every store (PostgreSQL text and jsonb cannot store it)")]
    Nul,
    /// A value for an array column that is neither a JSON array nor a string.
    #[error("is {0}, not an array (the target column is an array)")]
    NotAnArray(&'static str),
    /// A timestamp with a UTC offset that cannot be read, for a MySQL or MariaDB time target.
    #[error("is not a timestamp: {0}")]
    Timestamp(String),
    /// A value without a UTC offset for a `timestamptz` target, under `naive_timestamps = "dead_letter"`.
    #[error("{0:?} has no UTC offset (naive_timestamps = \"dead_letter\"): write it with Z or +hh:mm")]
    Naive(String),
}

/// Renders a present, non-null JSON value as text for binding. JSON `null` is SQL NULL and never reaches here.
/// `refuse_naive`: a [`Render::Zoned`] value must carry a UTC offset.
///
/// Errors: [`ValueError::Nul`] when the value, or any string inside it, contains U+0000 (the same rule applies to
/// business keys, see [`crate::key`]); [`ValueError::NotAnArray`] for an array target given an object, number or
/// boolean; [`ValueError::Naive`].
pub fn render(value: &Value, render: Render, refuse_naive: bool) -> Result<String, ValueError> {
    render_cow(std::borrow::Cow::Borrowed(value), render, refuse_naive)
}

/// [`render`], taking the value borrowed or owned: an owned string rendered as text is moved, not copied (the
/// worker's values, each taken from its slot of the decoded payload by the last binding that reads it).
///
/// Errors: as [`render`]'s.
pub fn render_cow(value: std::borrow::Cow<'_, Value>, render: Render, refuse_naive: bool) -> Result<String, ValueError> {
    if contains_nul(&value) {
        return Err(ValueError::Nul);
    }
    Ok(match (&*value, render) {
        (Value::String(s), Render::Zoned | Render::UtcWallClock) if refuse_naive && !has_utc_offset(s) => {
            return Err(ValueError::Naive(s.chars().take(64).collect()))
        }
        (
            Value::String(_),
            Render::Text | Render::Zoned | Render::Array { .. } | Render::UtcWallClock | Render::LocalWallClock | Render::Numeric,
        ) => match value {
            std::borrow::Cow::Owned(Value::String(s)) => s,
            std::borrow::Cow::Borrowed(Value::String(s)) => s.clone(),
            _ => unreachable!("matched as a string above"),
        },
        (Value::Bool(b), Render::Numeric) => u8::from(*b).to_string(),
        (Value::Array(items), Render::Array { json }) => {
            let mut out = String::new();
            array_literal(items, json, &mut out);
            out
        }
        (other, Render::Array { .. }) => return Err(ValueError::NotAnArray(kind(other))),
        (Value::Number(n), _) => plain_decimal(&n.to_string()),
        (Value::Bool(b), _) => b.to_string(),
        (other, _) => other.to_string(),
    })
}

/// A timestamp text for a [`Render::UtcWallClock`] or [`Render::LocalWallClock`] target, as MySQL and MariaDB read
/// it: `2026-11-30T08:00:00.123` (ISO 8601 without an offset). A text with a UTC offset (RFC 3339, `Z` or `+hh:mm`)
/// is the instant it names, shown in UTC or in `zone`; a naive text for a `TIMESTAMP` target is read in `zone`
/// (a wall-clock time that a daylight-saving change skips or repeats resolves as RFC 9557's "compatible"
/// disambiguation does). Any other render, and a naive text for a `DATETIME` target, is returned as it is. A zone
/// name after the time (`... UTC`, which PostgreSQL reads) is not read here.
///
/// Errors: [`ValueError::Timestamp`] when a text with an offset, or a naive text for a `TIMESTAMP` target, is not a
/// timestamp jiff can read (ISO 8601 / RFC 3339, `T` or a space between date and time).
pub fn wall_clock(text: String, render: Render, zone: &jiff::tz::TimeZone) -> Result<String, ValueError> {
    use jiff::tz::TimeZone;
    let target = match render {
        Render::UtcWallClock => TimeZone::UTC,
        Render::LocalWallClock => zone.clone(),
        _ => return Ok(text),
    };
    if has_utc_offset(&text) {
        let instant: jiff::Timestamp = text.trim().parse().map_err(|e: jiff::Error| ValueError::Timestamp(format!("{text:?}: {e}")))?;
        return Ok(instant.to_zoned(target).datetime().to_string());
    }
    if render == Render::LocalWallClock {
        return Ok(text);
    }
    let trimmed = text.trim();
    let naive = trimmed.parse::<jiff::civil::DateTime>().or_else(|_| trimmed.parse::<jiff::civil::Date>().map(|d| d.to_datetime(jiff::civil::Time::midnight())));
    // A text jiff cannot read would be read by the server in the sessions' zone (UTC), not in `zone`: refused.
    naive
        .and_then(|dt| zone.to_zoned(dt))
        .map(|zoned| zoned.timestamp().to_zoned(TimeZone::UTC).datetime().to_string())
        .map_err(|e| ValueError::Timestamp(format!("{text:?}: {e}")))
}

/// The kind of a JSON value, for messages: `"an object"`, `"a number"`, ...
pub fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A PostgreSQL array literal (PostgreSQL docs, "Arrays", 8.15.6 "Array Input and Output Syntax"): every element
/// double-quoted with `\` and `"` escaped, so no element text can change the structure; `null` unquoted as `NULL`;
/// nested JSON arrays as nested braces (PostgreSQL refuses ragged ones, and the record is dead-lettered).
fn array_literal(items: &[Value], json: bool, out: &mut String) {
    out.push('{');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match item {
            Value::Null => out.push_str("NULL"),
            Value::Array(inner) if !json => array_literal(inner, json, out),
            other => {
                let text = match other {
                    Value::String(s) if !json => s.clone(),
                    Value::Number(n) if !json => plain_decimal(&n.to_string()),
                    _ => other.to_string(),
                };
                out.push('"');
                for c in text.chars() {
                    if c == '"' || c == '\\' {
                        out.push('\\');
                    }
                    out.push(c);
                }
                out.push('"');
            }
        }
    }
    out.push('}');
}

/// Whether a timestamp text ends with a UTC offset or zone: `Z`, `+hh`, `+hh:mm`, `+hhmm` (ISO 8601, RFC 3339)
/// after a time of day, or a zone name or abbreviation after a space (`... 10:00 America/New_York`, `... UTC`),
/// as PostgreSQL's timestamptz input accepts. A date alone or a time without any of these is naive.
pub fn has_utc_offset(text: &str) -> bool {
    let t = text.trim();
    let b = t.as_bytes();
    // The last time-of-day colon: everything after its minutes is the zone, if any.
    let Some(colon) = t.find(':') else { return false };
    let mut i = colon + 1;
    // minutes, seconds, fraction
    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b':' || b[i] == b'.') {
        i += 1;
    }
    let zone = t[i..].trim_start();
    if zone.is_empty() {
        return false;
    }
    if zone.eq_ignore_ascii_case("z") {
        return true;
    }
    if let Some(rest) = zone.strip_prefix(['+', '-']) {
        let digits: String = rest.chars().filter(|c| *c != ':').collect();
        return matches!(digits.len(), 2 | 4 | 6) && digits.bytes().all(|c| c.is_ascii_digit());
    }
    // A zone name (`UTC`, `EST`, `America/New_York`), optionally followed by more (PostgreSQL checks it).
    zone.starts_with(|c: char| c.is_ascii_alphabetic())
}

/// The largest number of digits a number is written out to by [`plain_decimal`] and [`canonical_decimal`]: a
/// number with a larger exponent (`1e1000000`) is left as written by the former and refused by the latter.
pub const MAX_DECIMAL_DIGITS: usize = 1000;

/// Splits a JSON number (RFC 8259 section 6: `-? int frac? exp?`) into sign, all its digits, and where the decimal
/// point falls among them. `None` for text that is not a JSON number or whose exponent does not fit.
fn decompose(text: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || !int.bytes().all(|c| c.is_ascii_digit()) || !frac.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let point = (int.len() as i64).checked_add(exponent)?;
    Some((negative, format!("{int}{frac}"), point))
}

/// Writes digits with the decimal point at `point` (which may lie outside them) as a plain decimal.
fn place_point(negative: bool, digits: &str, point: i64) -> Option<String> {
    let len = digits.len() as i64;
    let width = point.max(len).max(1) - point.min(0);
    if width > MAX_DECIMAL_DIGITS as i64 {
        return None;
    }
    let mut out = String::with_capacity(width as usize + 2);
    if negative {
        out.push('-');
    }
    if point <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-point) as usize));
        out.push_str(digits);
    } else if point >= len {
        out.push_str(digits);
        out.extend(std::iter::repeat_n('0', (point - len) as usize));
    } else {
        out.push_str(&digits[..point as usize]);
        out.push('.');
        out.push_str(&digits[point as usize..]);
    }
    Some(out)
}

/// A JSON number's text as a plain decimal with the same value, digit for digit, for binding: exponent notation
/// is written out (`1e2` gives `100`, `1.5E-3` gives `0.0015`, `2.50e1` gives `25.0`); a number without an
/// exponent is returned exactly as written (`2.50` stays `2.50`, so `numeric` keeps its scale). No float is
/// involved. A number that would take more than [`MAX_DECIMAL_DIGITS`] digits is returned as written.
pub fn plain_decimal(text: &str) -> String {
    if !text.contains(['e', 'E']) {
        return text.to_owned();
    }
    decompose(text).and_then(|(neg, digits, point)| place_point(neg, &digits, point)).unwrap_or_else(|| text.to_owned())
}

/// The canonical decimal text of a JSON number, so that numbers equal in value are equal texts: written out
/// without exponent, without leading zeros, without trailing zeros after the point (and without the point when
/// nothing follows it), and `0` for every zero (`-0`, `0.00`). `100`, `100.0`, `1e2` and `1.00E+2` all give
/// `100`; `-0.50` gives `-0.5`. `None` when it would take more than [`MAX_DECIMAL_DIGITS`] digits or the text is
/// not a JSON number.
pub fn canonical_decimal(text: &str) -> Option<String> {
    let (negative, digits, point) = decompose(text)?;
    // Drop leading zeros (moving the point with them) and trailing zeros (which never change the value).
    let lead = digits.len() - digits.trim_start_matches('0').len();
    let digits = digits[lead..].trim_end_matches('0');
    if digits.is_empty() {
        return Some("0".to_owned());
    }
    let point = point - lead as i64;
    place_point(negative, digits, point)
}

fn contains_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pointer_and_dotted_forms_address_the_same_value() {
        let doc = json!({"order": {"id": "o-1", "items": [{"sku": "a"}]}});
        for p in ["/order/id", "order.id"] {
            assert_eq!(FieldPath::parse(p).unwrap().lookup(&doc), Some(&json!("o-1")));
        }
        assert_eq!(FieldPath::parse("/order/items/0/sku").unwrap().lookup(&doc), Some(&json!("a")));
        assert_eq!(FieldPath::parse("order.items.0.sku").unwrap().lookup(&doc), Some(&json!("a")));
        assert_eq!(FieldPath::parse("/order/items/00").unwrap().lookup(&doc), None);
        assert_eq!(FieldPath::parse("/order/missing").unwrap().lookup(&doc), None);
        assert_eq!(FieldPath::parse("/order/id/deeper").unwrap().lookup(&doc), None);
    }

    #[test]
    fn rfc6901_escapes() {
        let doc = json!({"a/b": {"m~n": 1}});
        let p = FieldPath::parse("/a~1b/m~0n").unwrap();
        assert_eq!(p.lookup(&doc), Some(&json!(1)));
        assert_eq!(p.to_string(), "/a~1b/m~0n");
        assert_eq!(FieldPath::parse("/a~2"), Err(FieldPathError::BadEscape));
        assert_eq!(FieldPath::parse("/order//id"), Err(FieldPathError::EmptySegment));
        assert_eq!(FieldPath::parse("order..id"), Err(FieldPathError::EmptySegment));
        assert_eq!(FieldPath::parse(""), Err(FieldPathError::Empty));
        assert_eq!(FieldPath::parse("order/id"), Err(FieldPathError::MissingSlash("order/id".into())));
    }

    #[test]
    fn numbers_keep_their_digits() {
        let doc: Value = serde_json::from_str(r#"{"n": 9007199254740993, "d": 100.000000000000000001}"#).unwrap();
        assert_eq!(render(&doc["n"], Render::Text, false).unwrap(), "9007199254740993");
        assert_eq!(render(&doc["d"], Render::Text, false).unwrap(), "100.000000000000000001");
    }

    #[test]
    fn json_targets_get_json_text() {
        let doc = json!({"s": "x", "o": {"a": [1, "b"]}});
        assert_eq!(render(&doc["s"], Render::Json, false).unwrap(), "\"x\"");
        assert_eq!(render(&doc["s"], Render::Text, false).unwrap(), "x");
        assert_eq!(render(&doc["o"], Render::Text, false).unwrap(), r#"{"a":[1,"b"]}"#);
        assert_eq!(render(&json!({"a": "x\u{0}"}), Render::Json, false), Err(ValueError::Nul));
    }

    #[test]
    fn exponent_numbers_are_written_out_exactly() {
        for (written, plain) in [
            ("1e2", "100"), ("1E+2", "100"), ("1.5e-3", "0.0015"), ("2.50e1", "25.0"), ("-1e0", "-1"),
            ("2.50", "2.50"), ("100", "100"), ("9007199254740993e0", "9007199254740993"), ("1e1000000", "1e1000000"),
        ] {
            assert_eq!(plain_decimal(written), plain, "{written}");
        }
        let doc: Value = serde_json::from_str(r#"{"a": 1e2, "b": 12.5E-1}"#).unwrap();
        assert_eq!(render(&doc["a"], Render::Text, false).unwrap(), "100");
        assert_eq!(render(&doc["b"], Render::Text, false).unwrap(), "1.25");
    }

    #[test]
    fn canonical_decimals_are_equal_for_equal_numbers() {
        for same in ["100", "100.0", "1e2", "1.00E+2", "0100", "10000e-2", "0.1e3"] {
            assert_eq!(canonical_decimal(same).as_deref(), Some("100"), "{same}");
        }
        assert_eq!(canonical_decimal("-0.50").as_deref(), Some("-0.5"));
        assert_eq!(canonical_decimal("-0").as_deref(), Some("0"));
        assert_eq!(canonical_decimal("0.000e5").as_deref(), Some("0"));
        assert_eq!(canonical_decimal("1e-3").as_deref(), Some("0.001"));
        assert_eq!(canonical_decimal("9007199254740993").as_deref(), Some("9007199254740993"));
        assert_eq!(canonical_decimal("1e1000000"), None);
        assert_eq!(canonical_decimal("1e99999999999999999999"), None);
    }

    #[test]
    fn arrays_become_postgres_array_literals() {
        let mut doc = json!({"tags": ["a", "b,c", "q\"uote", "back\\slash", null, "NULL", ""],
                         "grid": [[1, 2], [3, 4]], "docs": [{"a": 1}, "s", null], "o": {"a": 1}});
        doc["qty"] = serde_json::from_str("[1, 2.5, 1e2]").unwrap();
        let text = Render::Array { json: false };
        assert_eq!(
            render(&doc["tags"], text, false).unwrap(),
            r#"{"a","b,c","q\"uote","back\\slash",NULL,"NULL",""}"#
        );
        assert_eq!(render(&doc["qty"], text, false).unwrap(), r#"{"1","2.5","100"}"#);
        assert_eq!(render(&doc["grid"], text, false).unwrap(), r#"{{"1","2"},{"3","4"}}"#);
        assert_eq!(render(&doc["docs"], Render::Array { json: true }, false).unwrap(), r#"{"{\"a\":1}","\"s\"",NULL}"#);
        assert_eq!(render(&json!("{x,y}"), text, false).unwrap(), "{x,y}");
        assert_eq!(render(&doc["o"], text, false), Err(ValueError::NotAnArray("an object")));
    }

    #[test]
    fn utc_offsets() {
        for zoned in ["2026-11-29T10:00:00+01:00", "2026-11-29T10:00:00Z", "2026-11-29 10:00:00.5-0500",
                      "2026-11-29T10:00:00+01", "2026-11-29 10:00 America/New_York", "2026-11-29 10:00:00 UTC"] {
            assert!(has_utc_offset(zoned), "{zoned}");
        }
        for naive in ["2024-03-10T02:30:00", "2024-03-10", "2024-03-10 02:30:00.123", "2024-03-10T02:30:00+1"] {
            assert!(!has_utc_offset(naive), "{naive}");
        }
        assert!(matches!(render(&json!("2024-03-10T02:30:00"), Render::Zoned, true), Err(ValueError::Naive(_))));
        assert_eq!(render(&json!("2024-03-10T02:30:00"), Render::Zoned, false).unwrap(), "2024-03-10T02:30:00");
    }

    #[test]
    fn wall_clock_for_mysql_time_targets() {
        let paris = jiff::tz::TimeZone::get("Europe/Paris").unwrap();
        let utc = |t: &str| wall_clock(t.to_owned(), Render::UtcWallClock, &paris).unwrap();
        let local = |t: &str| wall_clock(t.to_owned(), Render::LocalWallClock, &paris).unwrap();
        assert_eq!(utc("2026-11-30T10:00:00+02:00"), "2026-11-30T08:00:00");
        assert_eq!(utc("2026-11-30 10:00:00.123456Z"), "2026-11-30T10:00:00.123456");
        assert_eq!(utc("2026-11-30T10:00:00"), "2026-11-30T09:00:00"); // naive: read in Paris (UTC+1 in winter)
        assert_eq!(utc("2026-07-01"), "2026-06-30T22:00:00");
        assert_eq!(local("2026-11-30T10:00:00+02:00"), "2026-11-30T09:00:00");
        assert_eq!(local("2026-11-30 10:00:00"), "2026-11-30 10:00:00");
        assert_eq!(utc("2026-12-31T23:30:00-01:00"), "2027-01-01T00:30:00");
        assert!(wall_clock("2026-13-45T10:00:00Z".into(), Render::UtcWallClock, &paris).is_err());
        assert_eq!(render(&json!(true), Render::Numeric, false).unwrap(), "1");
    }
}
