//! Targets that would change a value rather than refuse it, and the check that refuses such a value instead.
//!
//! PostgreSQL's `numeric(p, s)` and MySQL's `DECIMAL(p, s)` round a value to `s` decimals on assignment (half away
//! from zero), and `timestamp(p)`, `timestamptz(p)`, `time(p)` (PostgreSQL) and `DATETIME(p)`, `TIMESTAMP(p)`,
//! `TIME(p)` (MySQL) round fractional seconds to `p` digits, without an error or, on MySQL, more than a note. Time
//! columns are checked only where their precision is declared: an unconstrained PostgreSQL one keeps microseconds,
//! a MySQL `DATETIME` whole seconds, and refusing every nanosecond or millisecond timestamp for that would hurt
//! more than the rounding (documented in docs/guarantee.md). A payment of `"10.555"` into `numeric(12, 2)` would be stored as 10.56
//! while the record says 10.555. The table form knows each column's type, so such a value is refused before the
//! transaction: the record is dead-lettered (`param_invalid`) saying which column and what it would have become,
//! unless the column says `round = true` (the rounding is then the user's explicit choice).
//!
//! Sources: PostgreSQL documentation, "Numeric Types" (8.1.2: values with more fractional digits than the scale are
//! rounded) and "Date/Time Types" (8.5: `p` fractional digits, 0 to 6); MySQL Reference Manual, "Fixed-Point Types"
//! and "Fractional Seconds in Time Values" (rounded unless `TIME_TRUNCATE_FRACTIONAL`).

use std::fmt;

/// What a column keeps of a value, where it would round the rest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Limit {
    /// A decimal with `scale` fractional digits (negative: rounded to tens, hundreds, ...).
    Scale {
        /// The column's type as the database writes it, for messages: `numeric(12,2)`.
        type_name: String,
        /// Decimal digits kept after the point.
        scale: i32,
    },
    /// A time with `digits` fractional digits of seconds.
    Fraction {
        /// The column's type as the database writes it: `timestamp(0) with time zone`.
        type_name: String,
        /// Fractional digits of seconds kept (0 to 6).
        digits: u32,
    },
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::Scale { type_name, .. } | Limit::Fraction { type_name, .. } => f.write_str(type_name),
        }
    }
}

impl Limit {
    /// Checks `text` (a value rendered for binding) against the limit.
    ///
    /// Errors: what the column would have stored instead, for the dead letter. Text that does not read as a
    /// number or a time is left to the server, which refuses it with its own error.
    pub fn check(&self, text: &str) -> Result<(), String> {
        match self {
            Limit::Scale { type_name, scale } => match round_decimal(text, *scale) {
                Some(rounded) => Err(format!(
                    "its column is {type_name}, which would store {text:?} as {rounded}: refused rather than changed (set \
                     round = true on the column to accept the rounding)"
                )),
                None => Ok(()),
            },
            Limit::Fraction { type_name, digits } => match excess_fraction(text, *digits) {
                Some(fraction) => Err(format!(
                    "its column is {type_name}, which keeps {digits} fractional digit(s) of seconds and would round \
                     {text:?} (fraction .{fraction}): refused rather than changed (set round = true on the column to accept \
                     the rounding)"
                )),
                None => Ok(()),
            },
        }
    }
}

/// The value `text` would become at `scale`, when that is not the value itself; `None` when it fits or is not a
/// plain decimal (`NaN`, `Infinity`, anything the server will judge itself).
pub fn round_decimal(text: &str, scale: i32) -> Option<String> {
    // PostgreSQL 16 reads `1_000.555` as 1000.555 (underscores between digits, "Numeric Constants"): read it so
    // too. An underscore anywhere else is an input error the server reports itself.
    let unscored;
    let text = if text.contains('_') {
        let b = text.as_bytes();
        let between_digits = |i: usize| i > 0 && i + 1 < b.len() && b[i - 1].is_ascii_digit() && b[i + 1].is_ascii_digit();
        if !text.match_indices('_').all(|(i, _)| between_digits(i)) {
            return None;
        }
        unscored = text.replace('_', "");
        unscored.as_str()
    } else {
        text
    };
    let t = text.trim();
    let (negative, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (mantissa, exponent) = match t.find(['e', 'E']) {
        Some(at) => (&t[..at], t[at + 1..].parse::<i64>().ok()?),
        None => (t, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() && fraction.is_empty() || !whole.bytes().chain(fraction.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    // The value is digits x 10^exp, digits without leading or trailing zeros.
    let mut digits: Vec<u8> = whole.bytes().chain(fraction.bytes()).map(|b| b - b'0').collect();
    let mut exp = exponent.checked_sub(fraction.len() as i64)?;
    while digits.last() == Some(&0) {
        digits.pop();
        exp += 1;
    }
    let first = digits.iter().position(|d| *d != 0)?; // all zeros: 0 fits every scale
    digits.drain(..first);
    let drop = -(scale as i64) - exp; // digits below the last one the column keeps
    if drop <= 0 {
        return None;
    }
    if drop > digits.len() as i64 + 1 {
        return Some(format_scaled(false, &[0], scale));
    }
    let keep = digits.len() as i64 - drop; // may be -1: the first dropped digit is then 0
    let (mut kept, next) = if keep < 0 { (vec![0], 0) } else { (digits[..keep as usize].to_vec(), digits[keep as usize]) };
    if kept.is_empty() {
        kept.push(0);
    }
    if next >= 5 {
        let mut i = kept.len();
        loop {
            if i == 0 {
                kept.insert(0, 1);
                break;
            }
            i -= 1;
            if kept[i] == 9 {
                kept[i] = 0;
            } else {
                kept[i] += 1;
                break;
            }
        }
    }
    Some(format_scaled(negative, &kept, scale))
}

/// `digits` x 10^-scale as decimal text with exactly `scale` fractional digits (none when `scale` <= 0).
fn format_scaled(negative: bool, digits: &[u8], scale: i32) -> String {
    let mut text: String = digits.iter().map(|d| char::from(b'0' + d)).collect();
    if scale <= 0 {
        text.extend(std::iter::repeat_n('0', (-scale) as usize));
    } else {
        let scale = scale as usize;
        if text.len() <= scale {
            text = format!("{}{text}", "0".repeat(scale + 1 - text.len()));
        }
        text.insert(text.len() - scale, '.');
    }
    let text = text.trim_start_matches('0');
    let text = if text.is_empty() || text.starts_with('.') { format!("0{text}") } else { text.to_owned() };
    let zero = text.bytes().all(|b| b == b'0' || b == b'.');
    if negative && !zero {
        format!("-{text}")
    } else {
        text
    }
}

/// Whether `before` ends in the clock part of a time whose seconds a fraction follows: `hh:mm:ss`, `h:mm:ss`, or
/// `mm:ss` (PostgreSQL reads `04:05.6` as 4 minutes 5.6 seconds: "Date/Time Input"), each part one or two digits.
fn ends_in_a_time(before: &[u8]) -> bool {
    let start = before.iter().rposition(|c| !(c.is_ascii_digit() || *c == b':')).map_or(0, |p| p + 1);
    let parts: Vec<&[u8]> = before[start..].split(|c| *c == b':').collect();
    (2..=3).contains(&parts.len()) && parts.iter().all(|p| (1..=2).contains(&p.len()))
}

/// The fractional seconds of `text` (after `hh:mm:ss.` or `mm:ss.`) beyond `digits`, trailing zeros aside; `None` when they fit
/// or there are none.
pub fn excess_fraction(text: &str, digits: u32) -> Option<String> {
    let b = text.as_bytes();
    for (at, _) in text.match_indices('.') {
        if !ends_in_a_time(&b[..at]) {
            continue;
        }
        let fraction: &str = &text[at + 1..];
        let end = fraction.bytes().position(|c| !c.is_ascii_digit()).unwrap_or(fraction.len());
        let significant = fraction[..end].trim_end_matches('0');
        return (significant.len() > digits as usize).then(|| significant.to_owned());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_rounded_as_the_column_would() {
        assert_eq!(round_decimal("10.555", 2).as_deref(), Some("10.56"));
        assert_eq!(round_decimal("10.554", 2).as_deref(), Some("10.55"));
        assert_eq!(round_decimal("-10.555", 2).as_deref(), Some("-10.56"));
        assert_eq!(round_decimal("9.995", 2).as_deref(), Some("10.00"));
        assert_eq!(round_decimal("0.004", 2).as_deref(), Some("0.00"));
        assert_eq!(round_decimal("-0.004", 2).as_deref(), Some("0.00"));
        assert_eq!(round_decimal("0.005", 2).as_deref(), Some("0.01"));
        assert_eq!(round_decimal("0.0000001", 2).as_deref(), Some("0.00"));
        assert_eq!(round_decimal("1.5", 0).as_deref(), Some("2"));
        assert_eq!(round_decimal("1.25e-1", 2).as_deref(), Some("0.13"));
        assert_eq!(round_decimal("155", -1).as_deref(), Some("160"));
        // Values that fit.
        for fits in ["10.55", "10.550", "10.5", "10", "0", "-0.00", "1e2", "1.5E+1", "000.10", "NaN", "Infinity", "abc", "", "1.2.3"] {
            assert_eq!(round_decimal(fits, 2), None, "{fits}");
        }
        assert_eq!(round_decimal("150", -1), None);
        // PostgreSQL 16's underscores between digits (issue 42, item 11).
        assert_eq!(round_decimal("1_000.555", 2).as_deref(), Some("1000.56"));
        assert_eq!(round_decimal("1_000.55", 2), None);
        assert_eq!(round_decimal("1__0.555", 2), None, "not a number PostgreSQL reads: its own error");
        assert_eq!(round_decimal("_1.555", 2), None);
    }

    #[test]
    fn fractional_seconds_beyond_the_column() {
        assert_eq!(excess_fraction("2026-11-30T10:00:00.6Z", 0).as_deref(), Some("6"));
        assert_eq!(excess_fraction("2026-11-30 10:00:00.600+01:00", 1), None);
        assert_eq!(excess_fraction("2026-11-30T10:00:00.1234567Z", 6).as_deref(), Some("1234567"));
        assert_eq!(excess_fraction("2026-11-30T10:00:00Z", 0), None);
        assert_eq!(excess_fraction("10:00:00.000", 0), None);
        assert_eq!(excess_fraction("v1.5 at 10:00", 0), None);
        // mm:ss.f and h:mm:ss.f (issue 42, item 11).
        assert_eq!(excess_fraction("04:05.6", 0).as_deref(), Some("6"));
        assert_eq!(excess_fraction("2026-11-30 1:00:00.25", 1).as_deref(), Some("25"));
        assert_eq!(excess_fraction("2026-11-30 10:00.5", 1), None);
        assert_eq!(excess_fraction("2026-11-30 100:00.5", 0), None, "three digits are no clock part");
        let l = Limit::Fraction { type_name: "timestamp(0) with time zone".into(), digits: 0 };
        assert!(l.check("2026-11-30T10:00:00.6Z").unwrap_err().contains("fraction .6"));
        let l = Limit::Scale { type_name: "numeric(12,2)".into(), scale: 2 };
        assert!(l.check("10.555").unwrap_err().contains("as 10.56"));
        assert!(l.check("10.55").is_ok());
    }
}
