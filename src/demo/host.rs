//! Small things the throwaway servers and the workspaces need of this machine.

/// Whether this process runs as root: the servers that refuse root (PostgreSQL, MariaDB, RabbitMQ) then run as
/// their package's user.
pub(crate) fn as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Writes `text` to `path`, readable by this user only (settings hold passwords).
///
/// Errors: the file could not be written.
pub(crate) fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    std::io::Write::write_all(&mut f, text.as_bytes())
}

/// `text` as a TOML basic string (JSON's escapes are TOML's).
pub(crate) fn toml_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}
