//! `[sink] redis`: the commands a Redis pipeline runs for each new business key, as templates.
//!
//! Each command is a list of arguments, the first the command's name. An argument is text with `{name}`
//! placeholders, each filled with the value of `[sink.params] name` (rendered as text, as for the SQL form):
//! `"payment:{order_id}"`. Braces read well beside Redis keys, which are full of colons (a `:name` placeholder, as in
//! `sink.sql`, would not). `{{` and `}}` are literal braces. A placeholder never spans arguments, so a value with
//! spaces stays one argument: there is no quoting to get wrong and nothing to inject.

use std::fmt;

/// One part of an argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Literal text.
    Text(String),
    /// The value of the parameter with this name.
    Param(String),
}

/// One argument: its pieces in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arg(pub Vec<Piece>);

impl Arg {
    /// The argument when it holds no placeholder.
    pub fn literal(&self) -> Option<String> {
        self.0.iter().map(|p| match p {
            Piece::Text(t) => Some(t.as_str()),
            Piece::Param(_) => None,
        }).collect()
    }

    /// The parameter names it uses, in order.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.0.iter().filter_map(|p| match p {
            Piece::Param(n) => Some(n.as_str()),
            Piece::Text(_) => None,
        })
    }
}

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in &self.0 {
            match p {
                Piece::Text(t) => f.write_str(&t.replace('{', "{{").replace('}', "}}"))?,
                Piece::Param(n) => write!(f, "{{{n}}}")?,
            }
        }
        Ok(())
    }
}

/// One command of `[sink] redis`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisCommand {
    /// Where it was written: `sink.redis[0]`.
    pub origin: String,
    /// The command's name, upper case (`HSET`).
    pub name: String,
    /// Its arguments after the name.
    pub args: Vec<Arg>,
}

impl RedisCommand {
    /// Parses one command as written in `[sink] redis`.
    ///
    /// Errors: an empty command, a placeholder in the command's name, or an argument that does not parse (see
    /// [`parse_arg`]).
    pub fn parse(origin: String, words: &[String]) -> Result<RedisCommand, String> {
        let Some((name, rest)) = words.split_first() else {
            return Err("an empty command: write [\"HSET\", \"key\", ...]".to_owned());
        };
        if name.contains('{') || name.trim().is_empty() || name.contains(char::is_whitespace) {
            return Err(format!("{name:?} is not a command name (the first element names the command, without placeholders)"));
        }
        let args = rest.iter().enumerate().map(|(i, a)| parse_arg(a).map_err(|e| format!("argument {}: {e}", i + 1))).collect::<Result<_, _>>()?;
        Ok(RedisCommand { origin, name: name.to_ascii_uppercase(), args })
    }

    /// The parameter names it uses.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.args.iter().flat_map(Arg::params)
    }
}

/// Parses one argument: text with `{name}` placeholders (`name` of ASCII letters, digits and `_`, not starting
/// with a digit), `{{` and `}}` for literal braces.
///
/// Errors: an unclosed or empty placeholder, a name with other characters, or a lone `}`.
pub fn parse_arg(text: &str) -> Result<Arg, String> {
    let mut pieces = Vec::new();
    let mut literal = String::new();
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|(_, c)| *c) == Some('{') => {
                chars.next();
                literal.push('{');
            }
            '}' if chars.peek().map(|(_, c)| *c) == Some('}') => {
                chars.next();
                literal.push('}');
            }
            '{' => {
                let rest = &text[at + 1..];
                let Some(end) = rest.find('}') else {
                    return Err(format!("{text:?}: a '{{' without its '}}' (write {{{{ for a literal brace)"));
                };
                let name = &rest[..end];
                let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !valid {
                    return Err(format!(
                        "{text:?}: {{{name}}} is not a placeholder (a [sink.params] name: letters, digits, _); write {{{{ and }}}} for literal braces"
                    ));
                }
                if !literal.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut literal)));
                }
                pieces.push(Piece::Param(name.to_owned()));
                for _ in 0..=name.chars().count() {
                    chars.next();
                }
            }
            '}' => return Err(format!("{text:?}: a '}}' without its '{{' (write }}}} for a literal brace)")),
            c => literal.push(c),
        }
    }
    if !literal.is_empty() || pieces.is_empty() {
        pieces.push(Piece::Text(literal));
    }
    Ok(Arg(pieces))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_literals_and_braces() {
        let a = parse_arg("payment:{order_id}:x").unwrap();
        assert_eq!(a.0, vec![Piece::Text("payment:".into()), Piece::Param("order_id".into()), Piece::Text(":x".into())]);
        assert_eq!(parse_arg("{{literal}}").unwrap().literal().as_deref(), Some("{literal}"));
        assert_eq!(parse_arg("").unwrap().literal().as_deref(), Some(""));
        assert_eq!(parse_arg("{a}{b}").unwrap().params().collect::<Vec<_>>(), vec!["a", "b"]);
        assert!(parse_arg("{unclosed").unwrap_err().contains("without its"));
        assert!(parse_arg("{a-b}").unwrap_err().contains("is not a placeholder"));
        assert!(parse_arg("{}").unwrap_err().contains("is not a placeholder"));
        assert!(parse_arg("x}").unwrap_err().contains("without its"));
        assert_eq!(parse_arg("é{a}").unwrap().to_string(), "é{a}");
        let c = RedisCommand::parse("sink.redis[0]".into(), &["hset".into(), "p:{id}".into(), "amount".into()]).unwrap();
        assert_eq!(c.name, "HSET");
        assert!(RedisCommand::parse("x".into(), &["{cmd}".into()]).is_err());
        assert!(RedisCommand::parse("x".into(), &[]).is_err());
    }
}
