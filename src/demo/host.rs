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

/// A loopback port that was free a moment ago, for a server about to be started (a throwaway broker or store, a
/// worker's `/metrics`).
///
/// Drawn from 20000-31999, below Linux's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by default):
/// a port the kernel hands out for `bind(:0)` may be handed out again, and to outgoing connections, between the
/// moment it was found free and the moment the server binds it ("Address already in use" at the server's start, seen
/// with tests running side by side). A port below that range is taken only by another draw of the same port, which
/// the spread of the draw (process id, a counter and the clock) makes rare, and the bind below catches a port that
/// was taken already.
///
/// Errors: no free port found in 1,000 draws.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    for _ in 0..1000 {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let mix = u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ DRAWS.fetch_add(1, Ordering::Relaxed).wrapping_mul(0xBF58_476D_1CE4_E5B9)
            ^ u64::from(nanos);
        let port = 20_000 + (mix % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free loopback port in 20000-31999 after 1,000 draws"))
}
