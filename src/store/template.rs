//! SQL with named parameters (`:order_id`), as written in `sink.sql`.
//!
//! The scanner follows PostgreSQL's lexical rules closely enough to find parameters only where they are
//! parameters: not inside `'string'`, `E'escaped\' string'`, `"identifier"`, `$tag$dollar quoted$tag$` text,
//! `-- comments` or `/* nested */ comments`, and not in a `::type` cast. A `;` outside those ends a statement, so one
//! string may hold several statements. Positional parameters (`$1`) are refused: values are named.
//!
//! With [`Dialect::MySql`] the scanner follows MySQL's rules instead (MySQL Reference Manual, "String Literals",
//! "Schema Object Names", "Comments"): `'...'` and `"..."` are strings in which a backslash escapes the next
//! character (idemflow's sessions do not set `NO_BACKSLASH_ESCAPES`), `` `identifiers` `` are quoted with
//! backticks, `#` and `-- ` start a comment to the end of the line, block comments do not nest, there are no
//! dollar quotes, and `?` placeholders are refused as `$1` is.
//!
//! Each statement becomes a list of SQL text pieces and parameter slots that the store's side effect later renders
//! with its own positional parameters.

/// Whose lexical rules a `sink.sql` text follows: the store's, from `[database] url`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL.
    #[default]
    Postgres,
    /// MySQL and MariaDB.
    MySql,
}

impl Dialect {
    /// The dialect of a database URL: `mysql://` and `mariadb://` are MySQL's; anything else is PostgreSQL's.
    pub fn of_url(url: &str) -> Dialect {
        if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Dialect::MySql
        } else {
            Dialect::Postgres
        }
    }

    /// Whether the store runs `[sink] batch_sql` (statements once per batch over the relation `new_records`, built
    /// from arrays with `unnest`), and why not when it does not.
    pub fn batch_sql(self) -> Result<(), &'static str> {
        match self {
            Dialect::Postgres => Ok(()),
            Dialect::MySql => Err("runs on PostgreSQL only: on MySQL/MariaDB write per-record statements in sink.sql"),
        }
    }
}

/// A piece of a statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// SQL text, copied as written.
    Sql(String),
    /// A parameter: index into [`Statement::params`].
    Param(usize),
}

/// One statement with its named parameters located.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Statement {
    /// Text and parameter slots in order.
    pub parts: Vec<Part>,
    /// Distinct parameter names in order of first use.
    pub params: Vec<String>,
    /// Where it was written, for error messages, such as `sink.sql[1]` or `sink.sql (statement 2)`.
    pub origin: String,
    /// Whether it holds anything but white space and comments.
    has_code: bool,
}

impl Statement {
    fn new() -> Self {
        Statement { parts: Vec::new(), params: Vec::new(), origin: String::new(), has_code: false }
    }

    /// The statement with every parameter slot replaced by `placeholder(n)`.
    pub fn render(&self, placeholder: impl Fn(usize) -> String) -> String {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Sql(s) => s.clone(),
                Part::Param(n) => placeholder(*n),
            })
            .collect()
    }

    fn push_sql(&mut self, text: &str) {
        if !text.is_empty() {
            self.parts.push(Part::Sql(text.to_owned()));
        }
    }
}

/// Why a `sink.sql` text was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TemplateError {
    /// A quote, identifier, dollar-quoted string or block comment is not closed.
    #[error("unterminated {what} starting at byte {at}")]
    Unterminated {
        /// What was left open.
        what: &'static str,
        /// Byte offset where it starts.
        at: usize,
    },
    /// `$1`-style parameters are not supported.
    #[error("positional parameter at byte {at} ({found}): name every value instead (such as `:amount`) and map it in [sink.params]")]
    Positional {
        /// Byte offset.
        at: usize,
        /// What was found: `$1` (PostgreSQL) or `?` (MySQL).
        found: &'static str,
    },
}

/// Where a `WITH` list may be extended, when `sql` (PostgreSQL) starts with one: the byte offset just after its
/// leading `WITH` (or `WITH RECURSIVE`), white space and comments before it skipped. `None` when the statement
/// starts otherwise. A common table expression put there comes first in the statement's list, and a
/// non-recursive one may stand in a `WITH RECURSIVE` list (PostgreSQL docs, "WITH Queries").
pub fn after_leading_with(sql: &str) -> Option<usize> {
    let word = |at: usize, w: &str| {
        let end = at + w.len();
        sql.get(at..end).is_some_and(|s| s.eq_ignore_ascii_case(w))
            && sql.as_bytes().get(end).is_none_or(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'$' || *c >= 0x80))
    };
    let at = skip_space_and_comments(sql, 0);
    if !word(at, "with") {
        return None;
    }
    let after = at + "with".len();
    let next = skip_space_and_comments(sql, after);
    Some(if word(next, "recursive") { next + "recursive".len() } else { after })
}

/// The offset of the first byte at or after `i` that is neither white space nor in a comment (PostgreSQL's
/// `--` to the end of the line and nested `/* */`); an unterminated comment runs to the end.
fn skip_space_and_comments(sql: &str, mut i: usize) -> usize {
    let b = sql.as_bytes();
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b[i..].starts_with(b"--") {
            i = sql[i..].find('\n').map_or(b.len(), |n| i + n + 1);
        } else if b[i..].starts_with(b"/*") {
            i = skip_nested_comment(b, i).unwrap_or(b.len());
        } else {
            return i;
        }
    }
}

/// The offset just after the PostgreSQL block comment starting at `i` (`/*`), whose comments nest; `None` when it
/// is not closed.
fn skip_nested_comment(b: &[u8], mut i: usize) -> Option<usize> {
    let mut depth = 0usize;
    loop {
        if i + 1 >= b.len() {
            return None;
        }
        if b[i] == b'/' && b[i + 1] == b'*' {
            depth += 1;
            i += 2;
        } else if b[i] == b'*' && b[i + 1] == b'/' {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return Some(i);
            }
        } else {
            i += 1;
        }
    }
}

/// Splits `sql` into statements and locates their named parameters, by PostgreSQL's rules.
pub fn parse(sql: &str) -> Result<Vec<Statement>, TemplateError> {
    parse_in(sql, Dialect::Postgres)
}

/// Splits `sql` into statements and locates their named parameters, by `dialect`'s rules.
pub fn parse_in(sql: &str, dialect: Dialect) -> Result<Vec<Statement>, TemplateError> {
    let mysql = dialect == Dialect::MySql;
    let b = sql.as_bytes();
    let mut statements = Vec::new();
    let mut current = Statement::new();
    let mut i = 0;
    // `copied` is the start of the source text not yet copied into `current`.
    let mut copied = 0;
    let is_ident_start = |c: u8| c.is_ascii_alphabetic() || c == b'_' || c >= 0x80;
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80;
    while i < b.len() {
        let comment = matches!((b[i], b.get(i + 1)), (b'-', Some(b'-')) | (b'/', Some(b'*'))) || (mysql && b[i] == b'#');
        if !comment && b[i] != b';' && !b[i].is_ascii_whitespace() {
            current.has_code = true;
        }
        match b[i] {
            b'\'' | b'"' if mysql => {
                i = skip_quoted(b, i, b[i], true).ok_or(TemplateError::Unterminated { what: "string", at: i })?;
            }
            b'`' if mysql => {
                i = skip_quoted(b, i, b'`', false)
                    .ok_or(TemplateError::Unterminated { what: "quoted identifier", at: i })?;
            }
            b'#' if mysql => {
                i = sql[i..].find('\n').map_or(b.len(), |n| i + n + 1);
            }
            b'-' if mysql && b.get(i + 1) == Some(&b'-') && !b.get(i + 2).is_none_or(|c| c.is_ascii_whitespace()) => i += 2,
            b'/' if mysql && b.get(i + 1) == Some(&b'*') => {
                let close = sql[i + 2..].find("*/").ok_or(TemplateError::Unterminated { what: "comment", at: i })?;
                i += 2 + close + 2;
            }
            b'?' if mysql => return Err(TemplateError::Positional { at: i, found: "?" }),
            b'$' if mysql => i += 1,
            b'\'' => {
                let escapes = i > 0 && (b[i - 1] == b'e' || b[i - 1] == b'E') && (i < 2 || !is_ident(b[i - 2]));
                i = skip_quoted(b, i, b'\'', escapes).ok_or(TemplateError::Unterminated { what: "string", at: i })?;
            }
            b'"' => {
                i = skip_quoted(b, i, b'"', false)
                    .ok_or(TemplateError::Unterminated { what: "quoted identifier", at: i })?;
            }
            b'-' if b.get(i + 1) == Some(&b'-') => {
                i = sql[i..].find('\n').map_or(b.len(), |n| i + n + 1);
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i = skip_nested_comment(b, i).ok_or(TemplateError::Unterminated { what: "comment", at: i })?;
            }
            b'$' => {
                if b.get(i + 1).is_some_and(u8::is_ascii_digit) && (i == 0 || !is_ident(b[i - 1])) {
                    return Err(TemplateError::Positional { at: i, found: "$1" });
                }
                // A dollar quote: $$ or $tag$, where a tag is an identifier without `$`.
                let tag_end = (i + 1..b.len()).find(|&j| !is_ident(b[j])).unwrap_or(b.len());
                let starts_quote = b.get(tag_end) == Some(&b'$')
                    && (tag_end == i + 1 || is_ident_start(b[i + 1]))
                    && (i == 0 || !is_ident(b[i - 1]));
                if starts_quote {
                    let tag = &sql[i..=tag_end];
                    let body = tag_end + 1;
                    let close = sql[body..]
                        .find(tag)
                        .ok_or(TemplateError::Unterminated { what: "dollar-quoted string", at: i })?;
                    i = body + close + tag.len();
                } else {
                    i += 1;
                }
            }
            b':' if b.get(i + 1) == Some(&b':') => i += 2,
            // After an identifier or a number, `:` is an array slice bound (`a[lo:hi]`), not a parameter.
            b':' if b.get(i + 1).is_some_and(|&c| is_ident_start(c)) && (i == 0 || !is_ident(b[i - 1])) => {
                let end = (i + 1..b.len()).find(|&j| !is_ident(b[j])).unwrap_or(b.len());
                let name = &sql[i + 1..end];
                let n = match current.params.iter().position(|p| p == name) {
                    Some(n) => n,
                    None => {
                        current.params.push(name.to_owned());
                        current.params.len() - 1
                    }
                };
                current.push_sql(&sql[copied..i]);
                current.parts.push(Part::Param(n));
                copied = end;
                i = end;
            }
            b';' => {
                current.push_sql(&sql[copied..i]);
                copied = i + 1;
                i += 1;
                push_statement(&mut statements, std::mem::replace(&mut current, Statement::new()));
            }
            _ => i += 1,
        }
    }
    current.push_sql(&sql[copied..]);
    push_statement(&mut statements, current);
    Ok(statements)
}

/// Keeps a statement unless it is only white space, trimming white space at both ends.
fn push_statement(statements: &mut Vec<Statement>, mut statement: Statement) {
    if !statement.has_code {
        return;
    }
    if let Some(Part::Sql(first)) = statement.parts.first_mut() {
        *first = first.trim_start().to_owned();
    }
    if let Some(Part::Sql(last)) = statement.parts.last_mut() {
        *last = last.trim_end().to_owned();
    }
    statement.parts.retain(|p| !matches!(p, Part::Sql(s) if s.is_empty()));
    if !statement.parts.is_empty() {
        statements.push(statement);
    }
}

/// Returns the index just past the closing quote of a quoted run starting at `start`, where a doubled quote is an
/// escaped quote and, with `backslash`, `\x` escapes any character.
fn skip_quoted(b: &[u8], start: usize, quote: u8, backslash: bool) -> Option<usize> {
    let mut i = start + 1;
    while i < b.len() {
        if backslash && b[i] == b'\\' {
            i += 2;
            continue;
        }
        if b[i] == quote {
            if b.get(i + 1) == Some(&quote) {
                i += 2;
                continue;
            }
            return Some(i + 1);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(sql: &str) -> Vec<(String, Vec<String>)> {
        parse(sql)
            .unwrap()
            .into_iter()
            .map(|s| (s.render(|n| format!("${}", n + 1)), s.params))
            .collect()
    }

    #[test]
    fn finds_parameters_only_where_they_are_parameters() {
        let got = rendered(
            "UPDATE a SET b = b - :amount, note = ':not' || E'\\':no' || \"c:x\" || $$ :no $$ || $t$ :no $t$ \
             -- :comment\n /* :c /* nested */ */ WHERE id = :id::text AND x = :amount; SELECT '{json}'::jsonb, :id",
        );
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].1, vec!["amount", "id"]);
        assert!(got[0].0.starts_with("UPDATE a SET b = b - $1, note = ':not'"), "{}", got[0].0);
        assert!(got[0].0.ends_with("WHERE id = $2::text AND x = $1"), "{}", got[0].0);
        assert_eq!(got[1], ("SELECT '{json}'::jsonb, $1".to_owned(), vec!["id".to_owned()]));
    }

    #[test]
    fn refuses_positional_and_unterminated() {
        assert_eq!(parse("SELECT $1"), Err(TemplateError::Positional { at: 7, found: "$1" }));
        assert!(matches!(parse("SELECT 'x"), Err(TemplateError::Unterminated { what: "string", .. })));
        assert!(matches!(parse("SELECT $a$ x"), Err(TemplateError::Unterminated { .. })));
        assert!(matches!(parse("SELECT /* x"), Err(TemplateError::Unterminated { what: "comment", .. })));
        assert_eq!(parse(" ; ;").unwrap(), vec![]);
        assert_eq!(parse("SELECT 1; -- trailing note\n /* and this */").unwrap().len(), 1);
    }

    #[test]
    fn mysql_strings_identifiers_and_comments() {
        let got: Vec<(String, Vec<String>)> = parse_in(
            "UPDATE `a:b` SET n = n + :amount, s = 'it\\'s :no', d = \"x\\\":no\" # :comment\n\
             , e = 1 -- :comment\n, f = 2--:amount\n /* :c */ WHERE id = :id; SELECT $x, :id",
            Dialect::MySql,
        )
        .unwrap()
        .into_iter()
        .map(|s| (s.render(|_| "?".to_owned()), s.params))
        .collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].1, vec!["amount", "id"], "{got:?}");
        assert!(got[0].0.ends_with("WHERE id = ?"), "{}", got[0].0);
        assert_eq!(got[1].1, vec!["id"]);
        assert_eq!(parse_in("SELECT ?", Dialect::MySql), Err(TemplateError::Positional { at: 7, found: "?" }));
        assert!(parse_in("SELECT 'x\\'", Dialect::MySql).is_err());
        assert_eq!(Dialect::of_url("mariadb://h/d"), Dialect::MySql);
        assert_eq!(Dialect::of_url("postgres://h/d"), Dialect::Postgres);
    }

    #[test]
    fn array_slices_are_not_parameters() {
        let got = rendered("SELECT a[lo:hi], a[1:2], b[:n] FROM t WHERE c = :c");
        assert_eq!(got[0].1, vec!["n", "c"]);
    }

    #[test]
    fn a_leading_with_is_found_after_comments_and_recursive_is_kept() {
        fn at(sql: &str) -> Option<&str> {
            after_leading_with(sql).map(|i| &sql[..i])
        }
        assert_eq!(at("WITH t AS (SELECT 1) SELECT * FROM t"), Some("WITH"));
        assert_eq!(at("  -- lead\n /* a /* nested */ comment */ with recursive t AS (SELECT 1) SELECT 1"), Some("  -- lead\n /* a /* nested */ comment */ with recursive"));
        assert_eq!(at("With\n-- c\nRECURSIVE\tt AS (SELECT 1) SELECT 1"), Some("With\n-- c\nRECURSIVE"));
        assert_eq!(at("WITH recursive_t AS (SELECT 1) SELECT 1"), Some("WITH"));
        assert_eq!(at("INSERT INTO t WITH x AS (SELECT 1) SELECT * FROM x"), None);
        assert_eq!(at("WITHOUT"), None);
        assert_eq!(at("-- only a comment"), None);
        assert_eq!(at(""), None);
    }
}
