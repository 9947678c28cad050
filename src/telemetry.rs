//! Logging: tracing to stderr, human-readable or JSON lines.

use crate::config::{LogFormat, LogSettings};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::MakeWriter;
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
        .with_writer(Stderr)
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

/// Whether other libraries' log lines are held back ([`defer_library_logs`]).
static DEFER: AtomicBool = AtomicBool::new(false);

/// The library log lines held back since [`defer_library_logs`], each event with its level.
static DEFERRED: Mutex<Vec<(tracing::Level, Vec<u8>)>> = Mutex::new(Vec::new());

/// From now on, log lines of other libraries (the Kafka client's connection errors, say) are kept in memory instead
/// of written, until [`take_deferred`]: for a command that prints its own findings first (`check`), the libraries'
/// lines then come below them instead of before. idemflow's own lines are written as they come.
pub fn defer_library_logs() {
    DEFER.store(true, Ordering::SeqCst);
}

/// The library log lines held back since [`defer_library_logs`] (as they would have been written) whose level is
/// `least` or more severe (`Level::WARN`: warnings and errors; `Level::TRACE`: all), and stops holding them back; the
/// others are dropped.
pub fn take_deferred(least: tracing::Level) -> String {
    DEFER.store(false, Ordering::SeqCst);
    let held = std::mem::take(&mut *DEFERRED.lock().unwrap_or_else(|e| e.into_inner()));
    // tracing orders levels by verbosity: ERROR < WARN < ... < TRACE.
    let kept: Vec<u8> = held.into_iter().filter(|(level, _)| *level <= least).flat_map(|(_, line)| line).collect();
    String::from_utf8_lossy(&kept).into_owned()
}

/// Standard error, or the memory of [`DEFERRED`] for another library's event while [`DEFER`] is set.
struct Stderr;

/// One event's writer: see [`Stderr`]. A held event is gathered whole, and kept with its level when written.
enum EventWriter {
    Stderr(std::io::Stderr),
    Held(tracing::Level, Vec<u8>),
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        if let EventWriter::Held(level, line) = self {
            if !line.is_empty() {
                DEFERRED.lock().unwrap_or_else(|e| e.into_inner()).push((*level, std::mem::take(line)));
            }
        }
    }
}

impl std::io::Write for EventWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            EventWriter::Stderr(w) => w.write(buf),
            EventWriter::Held(_, line) => {
                line.extend_from_slice(buf);
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            EventWriter::Stderr(w) => w.flush(),
            EventWriter::Held(..) => Ok(()),
        }
    }
}

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter::Stderr(std::io::stderr())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> EventWriter {
        let ours = meta.target() == "idemflow" || meta.target().starts_with("idemflow::");
        if DEFER.load(Ordering::SeqCst) && !ours {
            EventWriter::Held(*meta.level(), Vec::new())
        } else {
            self.make_writer()
        }
    }
}
