//! The brokers' walkthroughs "on your own server" run as their pages show them: the shell block is taken from the
//! page and run by bash in a directory of its own, after step 1 of the README's walkthrough (a database with
//! `pipelines/payments.sql` and the account `ACC-WALK`, in `$IDEMFLOW_DATABASE__URL`). What a test run must change
//! is changed in the text, each change named here: the `apt-get install` lines are left out (the suite's preflight
//! installed the packages), and the fixed ports a user's machine has free (the broker's, the metrics') become free
//! ones, since tests run side by side. `target/release/idemflow` is the binary under test, and `examples/`,
//! `pipelines/` and `scripts/` are the repository's.

use crate::support::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The first ```sh block after the line of `page` (under docs/) that contains `marker`.
fn block_after(page: &str, marker: &str) -> String {
    let text = std::fs::read_to_string(project_root().join("docs").join(page)).unwrap();
    let at = text.find(marker).unwrap_or_else(|| panic!("{page} has no {marker:?}"));
    let rest = &text[at..];
    let start = rest.find("```sh\n").unwrap_or_else(|| panic!("{page}: no sh block after {marker:?}")) + "```sh\n".len();
    let end = rest[start..].find("\n```").expect("the block ends");
    rest[start..end + start].to_owned()
}

/// What bash printed, and how it ended.
struct Ran {
    ok: bool,
    out: String,
    err: String,
}

/// Runs `script` with bash (`-e`, `-o pipefail`) in a new directory laid out like the repository's root, with
/// `env` set, and waits at most `limit`; whatever it left running (its own process group) is killed at the end.
fn run_script(script: &str, env: &[(&str, &str)], limit: Duration) -> Ran {
    let dir = tempfile::tempdir().unwrap();
    let root = project_root();
    for linked in ["examples", "pipelines", "scripts"] {
        std::os::unix::fs::symlink(root.join(linked), dir.path().join(linked)).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("target/release")).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_idemflow"), dir.path().join("target/release/idemflow")).unwrap();
    let file = dir.path().join("walkthrough.sh");
    std::fs::write(&file, format!("set -euo pipefail\n{script}")).unwrap();
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = {
        use std::os::unix::process::CommandExt;
        Command::new("bash")
            .arg(&file)
            .current_dir(dir.path())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // SAFETY: kill has no memory preconditions; the group is the script's own.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let (out, mut err) = (read(&out_path), read(&err_path));
    if status.is_none() {
        err.push_str(&format!("\n(killed after {limit:?})"));
    }
    if let Ok(log) = std::fs::read_to_string(dir.path().join("idemflow.log")) {
        err.push_str(&format!("\n--- idemflow.log:\n{}", log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")));
    }
    Ran { ok: status.is_some_and(|s| s.success()), out, err }
}

/// The block with its `apt-get install` lines left out and each `(from, to)` replaced.
fn adapted(block: &str, replace: &[(&str, String)]) -> String {
    let mut text: String = block.lines().filter(|l| !l.trim_start().starts_with("apt-get ")).map(|l| format!("{l}\n")).collect();
    for (from, to) in replace {
        assert!(text.contains(from), "the walkthrough no longer says {from:?}:\n{block}");
        text = text.replace(from, to);
    }
    text
}

/// The README's step 1: the business tables and the account `ACC-WALK` with 1000.00.
async fn step_one() -> TestDb {
    let tables = std::fs::read_to_string(project_root().join("pipelines/payments.sql")).unwrap();
    TestDb::new(&format!("{tables}\nINSERT INTO accounts VALUES ('ACC-WALK', 1000.00);")).await
}

/// The amounts psql printed (a number with a decimal point, alone or last in a row), in order.
fn amounts(out: &str) -> Vec<String> {
    // psql's aligned output: a number alone on a line, or `count | sum`.
    let numbers: Vec<String> = out
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let last = l.rsplit('|').next()?.trim();
            (!last.is_empty() && last.chars().all(|c| c.is_ascii_digit() || c == '.' || c == '-') && last.contains('.')).then(|| last.to_owned())
        })
        .collect();
    numbers
}

/// docs/nats.md, "On your own server": a nats-server with JetStream started by the walkthrough, the stream created
/// and fed by `idemflow demo-producer`, the worker, then the whole stream again through a new durable consumer:
/// every payment deducted once, the replay counted as `redelivered`, nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_walkthrough_on_ones_own_server() {
    let db = step_one().await;
    let (nats, metrics) = (free_port(), free_port());
    let script = adapted(
        &block_after("nats.md", "**On your own server**"),
        &[("127.0.0.1:4222", format!("127.0.0.1:{nats}")), ("-p 4222", format!("-p {nats}")), ("127.0.0.1:9464", format!("127.0.0.1:{metrics}"))],
    );
    let listen = format!("127.0.0.1:{metrics}");
    // In the README's shell, where step 2 exported the Kafka servers: `--nats-url` takes their place.
    let env = [("IDEMFLOW_DATABASE__URL", db.url.as_str()), ("IDEMFLOW_METRICS__LISTEN", &listen), ("IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9092")];
    let ran = run_script(&script, &env, Duration::from_secs(180));
    assert!(ran.ok, "the walkthrough failed:\n{}\n{}", ran.out, ran.err);
    // Two runs, each printing (count | sum) and the accounts' loss: the same sum four times, and not zero.
    let sums = amounts(&ran.out);
    assert_eq!(sums.len(), 4, "{}", ran.out);
    assert!(sums.iter().all(|s| *s == sums[0]) && sums[0] != "0.00", "each payment deducted once, nothing again on the replay:\n{}", ran.out);
    let applied: i64 = db.scalar("SELECT count(*) FROM payments WHERE account_id <> 'ACC-WALK'").await;
    assert!(applied > 0, "{}", ran.out);
    let redelivered: f64 = ran
        .out
        .lines()
        .find(|l| l.contains("reason=\"redelivered\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no redelivered count:\n{}", ran.out));
    assert!(redelivered >= applied as f64, "the replay's messages skipped: {redelivered} < {applied}\n{}", ran.out);
    assert!(ran.out.contains("business key \"ORDERID_100\"") && ran.out.contains("applied at"), "{}", ran.out);
    assert!(ran.err.contains("created stream PAYMENTS on payments.>"), "{}", ran.err);
}

/// docs/rabbitmq.md, "On your own broker": a throwaway node with the management plugin started by the walkthrough
/// itself, a quorum queue declared and a payment published twice with rabbitmqadmin, the worker: deducted once, the
/// retry counted as `republished`, `explain` finds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rabbitmq_walkthrough_on_ones_own_broker() {
    let db = step_one().await;
    let metrics = free_port();
    let script = adapted(&block_after("rabbitmq.md", "**On your own broker**"), &[("127.0.0.1:9464", format!("127.0.0.1:{metrics}"))]);
    let listen = format!("127.0.0.1:{metrics}");
    let ran = tokio::task::spawn_blocking(move || {
        run_script(&script, &[("IDEMFLOW_DATABASE__URL", &db.url), ("IDEMFLOW_METRICS__LISTEN", &listen)], Duration::from_secs(180))
    })
    .await
    .unwrap();
    assert!(ran.ok, "the walkthrough failed:\n{}\n{}", ran.out, ran.err);
    assert!(ran.out.contains("900.00"), "ACC-WALK's balance dropped by 100.00 once:\n{}", ran.out);
    assert!(ran.out.contains("reason=\"republished\"} 1"), "the retry counted:\n{}", ran.out);
    assert!(ran.out.contains("business key \"WALK-2\"") && ran.out.contains("applied at"), "{}", ran.out);
}
