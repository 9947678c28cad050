//! `idemflow soak` on a pair other than Kafka x PostgreSQL, as a user runs it: the binary, a short run under
//! faults, the report and its checks. (The hour-long runs' figures are in docs/development.md.)

use crate::support::*;

/// NATS JetStream x MariaDB for 30 s, a fault every 4 to 6 s (the worker killed, MariaDB restarted or crashed, the
/// NATS server killed, packets dropped): every check of the report passes, and the report names the pair.
#[test]
fn soak_on_another_pair_passes_its_checks_under_faults() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("soak.md");
    let (status, stdout, stderr) = idemflow(
        &["soak", "--minutes", "0.5", "--source", "nats", "--store", "mariadb", "--fault-gap-min", "4", "--fault-gap-max", "6",
          "--seed", "7", "--report", report.to_str().unwrap()],
        &project_root(),
    );
    assert!(status.success(), "{stdout}\n{stderr}");
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(text.contains("| NATS JetStream x MariaDB | ok |"), "{text}");
    assert!(text.contains("## NATS JetStream x MariaDB"), "{text}");
    assert!(!text.contains("FAILED"), "{text}");
    let faults: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("- faults (")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no faults line: {text}"));
    assert!(faults >= 2, "a fault every 4 to 6 s (a packet drop may last 45 s): {text}");
    for check in ["business rows", "total deducted", "dead-lettered payloads", "dedup rows", "duplicates counted in the dedup rows"] {
        assert!(text.lines().any(|l| l.starts_with("- ok: ") && l.contains(check)), "no passed {check:?} check: {text}");
    }
    assert!(dir.path().join("soak-worker/nats-mariadb/worker.log").is_file());
}
