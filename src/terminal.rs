//! Text for a person's terminal: control characters from payloads, keys, headers and error texts are shown as
//! escapes (`\u{1b}`), so data can never move the cursor, clear the screen or rewrite the title of an operator's
//! terminal (ECMA-48 control sequences start with ESC or the C1 control CSI).

use std::borrow::Cow;

/// `text` with every control character (C0 including newline and tab, DEL, C1) written as `\u{XX}`; anything else
/// as it is. Borrowed when there is nothing to escape.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Bytes as lowercase hexadecimal digits, two a byte (digests, random tokens).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes for a terminal: valid UTF-8 escaped as [`escape`] does, anything else as `0x` and hex digits.
pub fn printable(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => escape(s).into_owned(),
        Err(_) => format!("0x{}", hex(bytes)),
    }
}

/// A duration as a settings file writes it: `7d`, `1d 12h`, `30s`, `1s 500ms` (whole units from days down to
/// milliseconds, the parts that are not zero; `0s` for nothing). `humantime::parse_duration`, which reads the
/// settings, takes it back; humantime's own format would say `7days` where the file says `7d`.
pub fn duration(d: std::time::Duration) -> String {
    let mut ms = d.as_millis();
    let mut parts = Vec::new();
    for (unit, size) in [("d", 86_400_000u128), ("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
        if ms >= size {
            parts.push(format!("{}{unit}", ms / size));
            ms %= size;
        }
    }
    if parts.is_empty() {
        "0s".to_owned()
    } else {
        parts.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(escape("o-1 ✓ ü"), "o-1 ✓ ü");
        assert_eq!(escape("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(escape("\u{9b}31m\u{7}\n\t\u{7f}"), "\\u{9b}31m\\u{7}\\u{a}\\u{9}\\u{7f}");
        assert_eq!(printable(b"\x1b]0;owned\x07"), "\\u{1b}]0;owned\\u{7}");
        assert_eq!(printable(&[0xff, 0x1b]), "0xff1b");
    }

    #[test]
    fn durations_read_as_settings_write_them() {
        use std::time::Duration;
        for (d, text) in [(7 * 86_400, "7d"), (36 * 3600, "1d 12h"), (30, "30s"), (0, "0s"), (3_600 + 60 + 1, "1h 1m 1s")] {
            assert_eq!(super::duration(Duration::from_secs(d)), text);
            assert_eq!(humantime::parse_duration(text).unwrap(), Duration::from_secs(d));
        }
        assert_eq!(super::duration(Duration::from_millis(1_500)), "1s 500ms");
    }
}
