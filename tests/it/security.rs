//! Credentials are never printed: a distinctive password, given in every form the settings accept, appears nowhere
//! in any command's output, even with logging at trace level.

use crate::support::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "Hunter2-Xq9zV";

const PIPELINE: &str = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";

/// Runs `idemflow args...` in `dir` with `env`, at trace level; SIGTERM after `after` if it is still running (a
/// worker waiting for its database). Returns stdout and stderr together.
fn output(dir: &std::path::Path, args: &[&str], env: &[(&str, String)], after: Duration) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemflow"));
    cmd.args(args).current_dir(dir).env("RUST_LOG", "trace").stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    let started = Instant::now();
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    while !waiter.is_finished() && started.elapsed() < after {
        std::thread::sleep(Duration::from_millis(100));
    }
    if !waiter.is_finished() {
        Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    }
    let out = waiter.join().unwrap();
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn settings(url: &str, bootstrap: &str, properties: &str) -> String {
    format!(
        "[database]\nurl = \"{url}\"\nacquire_timeout = \"1s\"\n[kafka]\nbootstrap_servers = \"{bootstrap}\"\n\
         [kafka.properties]\n{properties}\n[metrics]\nlisten = \"127.0.0.1:0\"\n[log]\nlevel = \"trace\"\n"
    )
}

fn assert_hidden(what: &str, text: &str) {
    assert!(!text.contains(SECRET), "{what} printed the password:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_are_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("pipelines")).unwrap();
    std::fs::write(dir.path().join("pipelines/t.toml"), PIPELINE).unwrap();
    let config = dir.path().join("idemflow.toml");
    let closed = free_port();
    let kafka = Kafka::new();
    kafka.create_topic("t", 1);
    let commands: [&[&str]; 6] = [
        &["check", "--config", "idemflow.toml"],
        &["migrate", "--config", "idemflow.toml"],
        &["explain", "--config", "idemflow.toml", "--pipeline", "t", "--key", "k"],
        &["purge", "--config", "idemflow.toml"],
        &["dead-letters", "list", "--config", "idemflow.toml"],
        &["run", "--config", "idemflow.toml"],
    ];

    // An unreachable database whose URL carries the password in each form: user information, `password=` and
    // `sslpassword=` query parameters; every command, `run` while it waits for the database.
    for url in [
        format!("postgres://u:{SECRET}@127.0.0.1:{closed}/db"),
        format!("postgres://u@127.0.0.1:{closed}/db?password={SECRET}"),
        format!("postgresql://u@127.0.0.1:{closed}/db?sslmode=prefer&sslpassword={SECRET}"),
    ] {
        std::fs::write(&config, settings(&url, kafka.bootstrap(), "")).unwrap();
        for args in commands {
            let after = Duration::from_secs(if args[0] == "run" { 4 } else { 15 });
            let out = output(dir.path(), args, &[], after);
            assert_hidden(&format!("{args:?} with {}", url.replace(SECRET, "SECRET")), &out);
            assert!(out.contains("cannot connect to postgres"), "{args:?} says why it cannot connect: {out}");
        }
    }

    // A reachable database, with a role whose password is the secret, given as a query parameter.
    let db = TestDb::new("CREATE TABLE t (id text PRIMARY KEY);").await;
    let role = format!("secret_user_{}", unique());
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{SECRET}'")).execute(&db.pool).await.unwrap();
    let (rest, database) = db.url.rsplit_once('/').unwrap();
    let host = rest.rsplit_once('@').map_or(rest.trim_start_matches("postgres://"), |(_, h)| h);
    let url = format!("postgres://{role}@{host}/{database}?password={SECRET}");
    std::fs::write(&config, settings(&url, kafka.bootstrap(), "")).unwrap();
    for args in commands {
        let out = output(dir.path(), args, &[], Duration::from_secs(4));
        assert_hidden(&format!("{args:?} against a reachable database"), &out);
    }

    // A misspelled and a bad Kafka property holding the password: named, with a hint, never echoed.
    std::fs::write(&config, settings(&url, kafka.bootstrap(), &format!("\"sasl.pasword\" = \"{SECRET}\""))).unwrap();
    let out = output(dir.path(), &["check", "--config", "idemflow.toml"], &[], Duration::from_secs(10));
    assert_hidden("check with a misspelled property", &out);
    assert!(out.contains("kafka.properties.\"sasl.pasword\": No such configuration property") && out.contains("did you mean \"sasl.password\"?"), "{out}");
    let out = output(dir.path(), &["run", "--config", "idemflow.toml"], &[], Duration::from_secs(4));
    assert_hidden("run with a misspelled property", &out);
    std::fs::write(&config, settings(&url, kafka.bootstrap(), &format!("\"session.timeout.ms\" = \"{SECRET}\""))).unwrap();
    let out = output(dir.path(), &["check", "--config", "idemflow.toml"], &[], Duration::from_secs(10));
    assert_hidden("check with a bad property value", &out);
    assert!(out.contains("kafka.properties.\"session.timeout.ms\": Invalid value"), "{out}");

    // A whole section from the environment (a type error quoting the value).
    std::fs::write(&config, format!("[kafka]\nbootstrap_servers = \"{}\"\n", kafka.bootstrap())).unwrap();
    let env = [("IDEMFLOW_DATABASE", format!("postgres://u:{SECRET}@h/db"))];
    let out = output(dir.path(), &["check", "--config", "idemflow.toml"], &env, Duration::from_secs(10));
    assert_hidden("a [database] section from the environment", &out);
    assert!(out.contains("database (from environment variable IDEMFLOW_DATABASE): invalid type: found a string (not shown)"), "{out}");
    drop(db);
}
