//! Logging: tracing to stderr, human-readable or JSON lines.

use crate::config::{LogFormat, LogSettings};
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::EnvFilter;

/// Log targets of other libraries that quote configuration values, which can be credentials: shown from `error`
/// only, whatever the level asked for. (sqlx's URL parser warns about an unknown connection parameter with its
/// value.)
const QUOTES_VALUES: [&str; 1] = ["sqlx_postgres::options::parse=error"];

/// The RabbitMQ client (lapin) logs every channel the broker closes at `error`, also the ones the caller expects
/// (`check`'s equivalence declares), and returns every error to its caller, which logs it with context: off.
const SAID_BY_THE_CALLER: [&str; 1] = ["lapin=off"];

/// Installs the global subscriber. `RUST_LOG`, when set, overrides `log.level`.
pub fn init(settings: &LogSettings) {
    let mut filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    for directive in QUOTES_VALUES.into_iter().chain(SAID_BY_THE_CALLER) {
        filter = filter.add_directive(directive.parse().expect("a valid directive"));
    }
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // Field values and messages can carry data (a business key, a database's error text quoting a value): escape
    // their control characters in the human-readable format (the JSON format escapes them already).
    let fields = tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        let text = format!("{value:?}");
        let text = crate::terminal::escape(&text);
        if field.name() == "message" {
            write!(w, "{text}")
        } else {
            write!(w, "{field}={text}")
        }
    })
    .delimited(" ");
    let _ = match settings.format {
        LogFormat::Pretty => builder.fmt_fields(fields).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).try_init(),
    };
}
