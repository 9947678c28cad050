//! Quoting for SQL text idemflow writes itself: identifiers from the settings and the catalog, and constants.
//! Payload values are never quoted: they are bound as parameters.

/// Double-quotes an identifier (PostgreSQL docs, "Identifiers and Key Words").
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Single-quotes a string constant (PostgreSQL docs, "String Constants"; `standard_conforming_strings` is on,
/// the default since PostgreSQL 9.1, so a backslash is an ordinary character).
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}
