//! `idemflow demo`, as a newcomer runs it: the binary, a small stream, the summary and its checks.

use crate::support::*;

#[test]
fn demo_summary_checks_exactly_once() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"));
    cmd.args(["demo", "--records", "6000", "--metrics-listen", "127.0.0.1:0"]).current_dir(project_root());
    if std::env::var("DATABASE_URL").is_err() {
        cmd.env("DATABASE_URL", postgres::server_url());
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("through pipelines/payments.toml"), "the shipped pipeline is used: {stderr}");
    assert!(stderr.contains("worker A stopped abruptly") && stderr.contains("worker B joined") && stderr.contains("worker B left"), "{stderr}");
    let number = |label: &str| -> u64 {
        let line = stdout.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no {label:?} in:\n{stdout}"));
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert_eq!(number("records produced"), 6000);
    assert_eq!(number("applied (business effects)"), number("distinct operations"));
    assert!(number("republished (producer retries)") > 0);
    assert!(number("redelivered (crash, rebalance)") > 0, "the crash must cause redeliveries:\n{stdout}");
    assert!(number("payload_mismatch (order id reused)") > 0);
    assert!(number("decode_failed") > 0);
    assert!(stdout.contains("check: business rows") && stdout.matches(": ok").count() == 2, "{stdout}");
}
