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

/// Runs `openssl args...` in `dir`.
pub(crate) fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl (Debian package openssl)");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, a server certificate for `localhost` only signed by it, and an unrelated CA, in `dir`.
pub(crate) fn certificates(dir: &std::path::Path) {
    let days = ["-days", "2"];
    for ca in ["ca", "other-ca"] {
        let (key, crt, subj) = (format!("{ca}.key"), format!("{ca}.crt"), format!("/CN=idemflow test {ca}"));
        let mut args = vec!["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &crt, "-subj", &subj];
        args.extend(days);
        openssl(dir, &args);
    }
    openssl(dir, &["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=DNS:localhost\n").unwrap();
    let mut args = vec!["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"];
    args.extend(["-out", "server.crt", "-extfile", "san.ext"]);
    args.extend(days);
    openssl(dir, &args);
}

/// Postgres with `ssl = on` and a certificate from a test CA: `sslmode=verify-full` with that CA and the
/// certificate's host name connects over TLS (the server says so in `pg_stat_ssl`) for `idemflow migrate` and the
/// worker's pool; a wrong CA or a host name the certificate does not name is refused with the reason;
/// `verify-ca` accepts the other host name, `require` encrypts without verifying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_verifies_the_server_certificate() {
    use idemflow::store::spec::DatabaseSettings;
    use std::os::unix::fs::PermissionsExt;
    let cluster = postgres::Cluster::start().unwrap();
    let tls = tempfile::tempdir().unwrap();
    certificates(tls.path());
    // The server's copies: owned by the server's user, the key readable by it alone (Postgres refuses it otherwise).
    let server = cluster.dir().join("tls");
    std::fs::create_dir(&server).unwrap();
    for f in ["server.crt", "server.key"] {
        std::fs::copy(tls.path().join(f), server.join(f)).unwrap();
    }
    std::fs::set_permissions(server.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    if unsafe { libc::geteuid() } == 0 {
        Command::new("chown").args(["-R", "postgres:postgres"]).arg(&server).status().unwrap();
    }
    let admin = sqlx::PgPool::connect(&cluster.url()).await.unwrap();
    for setting in [
        format!("ALTER SYSTEM SET ssl_cert_file = '{}'", server.join("server.crt").display()),
        format!("ALTER SYSTEM SET ssl_key_file = '{}'", server.join("server.key").display()),
        "ALTER SYSTEM SET ssl = on".to_owned(),
        "SELECT pg_reload_conf()".to_owned(),
    ] {
        sqlx::raw_sql(&setting).execute(&admin).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let admin_url = cluster.url();
    let url = |host: &str, params: &str| format!("{}?{params}", admin_url.replace("@127.0.0.1:", &format!("@{host}:")));
    let root = |ca: &str| tls.path().join(ca).display().to_string();
    let settings = |url: String| DatabaseSettings {
        url: url.into(),
        max_connections: 2,
        acquire_timeout: Duration::from_secs(5),
        prepared_statements: true,
        batch_timeout: idemflow::store::spec::DEFAULT_BATCH_TIMEOUT,
    };

    // Accepted: the right CA and host name; the worker's pool is on TLS.
    let good = url("localhost", &format!("sslmode=verify-full&sslrootcert={}", root("ca.crt")));
    idemflow::store::postgres::ping(&settings(good.clone())).await.unwrap();
    let pool = idemflow::store::postgres::pool(&settings(good.clone())).unwrap();
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetch_one(&pool).await.unwrap();
    assert!(ssl, "the worker's connection is encrypted");
    pool.close().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("idemflow.toml"), format!("[database]\nurl = \"{good}\"\n[kafka]\nbootstrap_servers = \"k:9092\"\n")).unwrap();
    let (status, out, err) = idemflow(&["migrate", "--config", "idemflow.toml"], dir.path());
    assert!(status.success(), "migrate over verify-full TLS: {out}{err}");

    // Refused: another CA; a host name the certificate does not name.
    let wrong_ca = url("localhost", &format!("sslmode=verify-full&sslrootcert={}", root("other-ca.crt")));
    let e = idemflow::store::postgres::ping(&settings(wrong_ca)).await.unwrap_err().to_string();
    assert!(e.contains("certificate") || e.contains("UnknownIssuer"), "{e}");
    let wrong_host = url("127.0.0.1", &format!("sslmode=verify-full&sslrootcert={}", root("ca.crt")));
    let e = idemflow::store::postgres::ping(&settings(wrong_host)).await.unwrap_err().to_string();
    assert!(e.contains("certificate") || e.contains("NotValidForName"), "{e}");

    // verify-ca checks the chain (with this build's TLS stack, rustls through sqlx, the host name too: never weaker
    // than asked); require encrypts without checking.
    idemflow::store::postgres::ping(&settings(url("localhost", &format!("sslmode=verify-ca&sslrootcert={}", root("ca.crt"))))).await.unwrap();
    let e = idemflow::store::postgres::ping(&settings(url("localhost", &format!("sslmode=verify-ca&sslrootcert={}", root("other-ca.crt"))))).await.unwrap_err().to_string();
    assert!(e.contains("certificate"), "{e}");
    let required = idemflow::store::postgres::pool(&settings(url("127.0.0.1", "sslmode=require"))).unwrap();
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetch_one(&required).await.unwrap();
    assert!(ssl);
}

/// Control characters in data (an ESC sequence in a payload, a business key, a value quoted in a database error)
/// never reach an operator's terminal: not through the human-readable log, not through `dead-letters list` or
/// `show`; they are shown as `\u{1b}` escapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_never_reach_the_terminal() {
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\nn = \"/n\"\n";
    let (db, kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY, n integer NOT NULL);", "t", 1, &[("t.toml", pipeline)]).await;
    let raw = |bytes: &[u8]| Out { partition: 0, value: Some(bytes.to_vec()), ..Out::default() };
    kafka.produce(
        "t",
        &[
            raw(b"\x1b]0;owned\x07{not json"),
            Out::json(0, r#"{"id":"k\u001b[2J","n":1}"#),
            Out::json(0, r#"{"id":"k\u001b[2J","n":2}"#),
            Out::json(0, r#"{"id":"x","n":"\u001b[31mred"}"#),
        ],
    );
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(30), "all four records processed", || async {
        metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "t")]) == 4.0
    })
    .await;
    assert!(w.sigterm().success());
    let log = w.log_text();
    assert!(log.contains("payload_mismatch") && log.contains("record dead-lettered"), "{log}");
    assert!(!log.contains('\u{1b}') && !log.contains('\u{7}'), "a control character reached the log:\n{log}");
    assert!(log.contains("\\u{1b}[2J"), "the key is shown escaped:\n{log}");

    let config = setup.config.to_str().unwrap().to_owned();
    let (status, list, err) = idemflow(&["dead-letters", "list", "--config", &config], setup.dir.path());
    assert!(status.success(), "{list}{err}");
    assert!(list.contains("2 dead letter(s)"), "{list}");
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM idemflow.dead_letters ORDER BY id").fetch_all(&db.pool).await.unwrap();
    let mut shown = list.clone();
    for id in ids {
        let (status, out, err) = idemflow(&["dead-letters", "show", &id.to_string(), "--config", &config], setup.dir.path());
        assert!(status.success(), "{out}{err}");
        shown.push_str(&out);
    }
    assert!(!shown.contains('\u{1b}') && !shown.contains('\u{7}'), "a control character reached the terminal:\n{shown}");
    assert!(shown.contains("\\u{1b}]0;owned\\u{7}{not json"), "the payload is shown escaped:\n{shown}");
    assert!(shown.contains("\\u{1b}[31mred"), "the database's error text is shown escaped:\n{shown}");
}

/// The demo's throwaway PostgreSQL is private to whoever started it: a random superuser password in a 0600 file,
/// a 0700 directory, a socket no other user can use; it starts under a `TMPDIR` with spaces; and a demo stopped
/// with SIGTERM leaves no temporary files behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_database_is_private_and_cleaned_up() {
    use std::os::unix::fs::PermissionsExt;
    let cluster = postgres::Cluster::start().unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(cluster.dir()), 0o700);
    assert_eq!(mode(&cluster.password_file()), 0o600);
    let url = url::Url::parse(&cluster.url()).unwrap();
    let password = url.password().unwrap().to_owned();
    assert!(password.len() >= 32 && password != "postgres", "a random password");
    assert_eq!(std::fs::read_to_string(cluster.password_file()).unwrap().trim(), password);
    let well_known = cluster.url().replace(&format!(":{password}@"), ":postgres@");
    assert!(sqlx::PgPool::connect(&well_known).await.is_err(), "the well-known password is refused");
    sqlx::PgPool::connect(&cluster.url()).await.unwrap();
    let socket = std::fs::read_dir(cluster.dir()).unwrap().filter_map(|e| e.ok()).find(|e| e.file_name().to_string_lossy().starts_with(".s.PGSQL."));
    let socket = socket.expect("the server's Unix socket").path();
    assert_eq!(mode(&socket) & 0o077, 0, "the socket is not usable by other users: {:o}", mode(&socket));
    drop(cluster);

    // The demo under a TMPDIR with spaces, stopped with SIGTERM while it runs: nothing is left in TMPDIR.
    let parent = tempfile::tempdir().unwrap();
    let tmp = parent.path().join("a dir with spaces");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["demo", "--records", "300000", "--metrics-listen", "127.0.0.1:0"])
        .env("TMPDIR", &tmp)
        .env_remove("DATABASE_URL")
        .current_dir(project_root())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() == 0 {
            panic!("the demo ended before producing its records:\n{seen}");
        }
        seen.push_str(&line);
        if line.starts_with("produced ") {
            break;
        }
    }
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = child.wait().unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    assert_eq!(status.code(), Some(130), "{seen}{rest}");
    assert!(rest.contains("interrupted: the demo's temporary files are removed"), "{seen}{rest}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left behind in TMPDIR: {left:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Kafka over TLS, for real: a TLS-terminating proxy (socat) in front of the mock cluster, which advertises the
/// proxy's address, so every connection goes through TLS. `check` and `run` with `security.protocol = "ssl"` and the
/// right CA connect and apply the records; a wrong CA is refused (certificate verification); a SASL/SCRAM
/// configuration is accepted by the client (the client is built with SCRAM) and `check` creates the client, so
/// what cannot work is refused there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_certificate_verification() {
    let tls = tempfile::tempdir().unwrap();
    certificates(tls.path());
    let pipeline = "topics = [\"t\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"t\"\n[sink.columns]\nid = \"/id\"\n";
    let (db, kafka, _) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 2, &[("t.toml", pipeline)]).await;
    let records: Vec<Out> = (0..50).map(|i| Out::json(i % 2, format!(r#"{{"id":"tls-{i}"}}"#))).collect();
    kafka.produce("t", &records);
    let broker_port = kafka.bootstrap().rsplit_once(':').unwrap().1.to_owned();
    let proxy_port = free_port();
    let path = |f: &str| tls.path().join(f).display().to_string();
    let mut proxy = Command::new("socat")
        .arg(format!("OPENSSL-LISTEN:{proxy_port},reuseaddr,fork,cert={},key={},verify=0", path("server.crt"), path("server.key")))
        .arg(format!("TCP:127.0.0.1:{broker_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("socat (Debian package socat)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", proxy_port)).is_err() {
        assert!(Instant::now() < deadline, "socat did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    kafka.advertise("localhost", proxy_port);
    let bootstrap = format!("localhost:{proxy_port}");
    let properties = |ca: &str| format!("\"security.protocol\" = \"ssl\"\n\"ssl.ca.location\" = \"{}\"", path(ca));

    // The right CA: check and run go through TLS and apply every record.
    let setup = Setup::with_bootstrap(&db, &bootstrap, &[("t.toml", pipeline)], &properties("ca.crt"), "");
    let config = setup.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["check", "--config", &config], setup.dir.path());
    assert!(status.success(), "check over TLS: {out}{err}");
    let mut w = BinWorker::start(&setup);
    wait_until(Duration::from_secs(60), "the records applied over TLS", || async {
        db.scalar::<i64>("SELECT count(*) FROM t").await == 50
    })
    .await;
    assert!(w.sigterm().success(), "{}", w.log_text());

    // Another CA: refused, and the log says why.
    let wrong = Setup::with_bootstrap(&db, &bootstrap, &[("t.toml", pipeline)], &properties("other-ca.crt"), "");
    let config = wrong.config.to_str().unwrap().to_owned();
    // librdkafka reports the TLS failure itself only when the handshake fails before check's metadata request times
    // out; on a busy machine the first attempt can end with a bare "Broker transport failure": every attempt is
    // refused, and one of at most three says why.
    let mut errors = Vec::new();
    for _ in 0..3 {
        let (status, out, err) = idemflow(&["check", "--config", &config], wrong.dir.path());
        assert!(!status.success(), "{out}{err}");
        let said = err.contains("certificate verify failed");
        errors.push(err);
        if said {
            break;
        }
    }
    assert!(errors.last().unwrap().contains("certificate verify failed"), "the certificate is refused:\n{errors:#?}");

    // SASL/SCRAM over TLS: the client has the mechanism (no "No provider for SASL mechanism"); this broker does not
    // speak SASL, so check fails at the connection, not at the configuration.
    let scram = format!(
        "{}\n\"sasl.mechanisms\" = \"SCRAM-SHA-512\"\n\"sasl.username\" = \"idemflow\"\n\"sasl.password\" = \"{SECRET}\"",
        properties("ca.crt").replace("\"ssl\"", "\"sasl_ssl\"")
    );
    let sasl = Setup::with_bootstrap(&db, &bootstrap, &[("t.toml", pipeline)], &scram, "");
    let config = sasl.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["check", "--config", &config], sasl.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(!err.contains("No provider for SASL mechanism") && !err.contains("OpenSSL not available"), "{err}");
    assert!(err.contains("cannot reach Kafka"), "{err}");
    assert_hidden("a SCRAM configuration", &format!("{out}{err}"));
    // OAUTHBEARER (here librdkafka's unsecured-JWT builder, for development): the same.
    let oauth = format!(
        "{}\n\"sasl.mechanisms\" = \"OAUTHBEARER\"\n\"sasl.oauthbearer.config\" = \"principal=idemflow\"\n\"enable.sasl.oauthbearer.unsecure.jwt\" = \"true\"",
        properties("ca.crt").replace("\"ssl\"", "\"sasl_ssl\"")
    );
    let oauth = Setup::with_bootstrap(&db, &bootstrap, &[("t.toml", pipeline)], &oauth, "");
    let config = oauth.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["check", "--config", &config], oauth.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(!err.contains("No provider for SASL mechanism") && err.contains("cannot reach Kafka"), "{err}");
    let _ = proxy.kill();
    let _ = proxy.wait();
}

/// `(VmRSS, VmHWM)` of a process, in bytes.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// `GET /healthz` answers 200 within `within`, retrying.
fn healthz_within(addr: std::net::SocketAddr, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if matches!(http_get(addr, "/healthz"), Ok((200, _))) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// The metrics endpoint keeps answering `/healthz` through what stopped it before: a flood of idle connections
/// past the worker's file descriptor limit (accept fails with EMFILE), a client that pipelines requests and never
/// reads the responses, and a 100 MB request header, which costs the worker no more than a few MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_endpoint_keeps_answering_under_abuse() {
    use std::io::Write;
    let (_db, _kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", 1, &[("t.toml", PIPELINE)]).await;
    let w = BinWorker::start_with_fd_limit(&setup, 128);
    let addr = setup.metrics;
    assert!(healthz_within(addr, Duration::from_secs(30)), "the worker serves /healthz");

    // 300 idle connections, more than the worker may have open files.
    let idle: Vec<std::net::TcpStream> =
        (0..300).filter_map(|_| std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()).collect();
    assert!(idle.len() >= 200, "{} connections opened", idle.len());
    assert!(healthz_within(addr, Duration::from_secs(20)), "/healthz answers while idle connections are open");
    drop(idle);
    assert!(healthz_within(addr, Duration::from_secs(5)), "/healthz answers after the flood");
    assert!(w.log_text().contains("accepting a connection failed"), "the flood exhausted the worker's descriptors");

    // A client that sends many requests and never reads the answers.
    let mut greedy = std::net::TcpStream::connect(addr).unwrap();
    greedy.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    for _ in 0..2_000 {
        if greedy.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").is_err() {
            break;
        }
    }
    assert!(healthz_within(addr, Duration::from_secs(5)), "/healthz answers while a client does not read");

    // A 100 MB header.
    let (_, peak_before) = memory(w.pid());
    let mut big = std::net::TcpStream::connect(addr).unwrap();
    big.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = big.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ");
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    while sent < 100 << 20 {
        if big.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    let (_, peak_after) = memory(w.pid());
    println!("a {sent}-byte header was cut off; the worker's peak memory went from {peak_before} to {peak_after} bytes");
    assert!(sent < 100 << 20, "the server stopped reading the header");
    assert!(peak_after < peak_before + (16 << 20), "peak memory grew from {peak_before} to {peak_after} bytes");
    assert!(healthz_within(addr, Duration::from_secs(5)), "/healthz answers after the huge header");
    drop((greedy, big));
}

/// 2,000 records just over `max_payload_bytes` (64 KiB + 1) in one batch: none is kept whole in memory (the
/// worker's peak memory stays far below the 128 MB they add up to, and is printed beside a run of 2,000 small
/// records), and each dead letter keeps its first 1 KiB, its size and the SHA-256 of the whole payload, which
/// `dead-letters show` prints and `replay` asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_records_are_not_kept_whole() {
    use sha2::Digest;
    const PARTITIONS: i32 = 32;
    const LIMIT: usize = 64 * 1024;
    let pipeline = format!("max_payload_bytes = {LIMIT}\n{PIPELINE}[batch]\nmax_records = 2000\nmax_wait = \"2s\"\n[dead_letters]\nmax_ratio = 1.0\n");
    let peak = |records: Vec<Out>| {
        let pipeline = pipeline.clone();
        async move {
            let (db, kafka, setup) = fixture("CREATE TABLE t (id text PRIMARY KEY);", "t", PARTITIONS, &[("t.toml", &pipeline)]).await;
            kafka.produce("t", &records);
            let total = records.len() as f64;
            drop(records);
            let mut w = BinWorker::start(&setup);
            let deadline = Instant::now() + Duration::from_secs(120);
            while metric(&w.scrape(), "idemflow_records_received_total", &[("pipeline", "t")]) < total {
                if Instant::now() > deadline {
                    let log = w.log_text();
                    let tail: Vec<&str> = log.lines().rev().take(30).collect();
                    panic!("not every record processed in 120 s:\n{}\n{}", w.scrape().lines().filter(|l| l.contains("received") || l.contains("dead_letters_total")).collect::<Vec<_>>().join("\n"), tail.join("\n"));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let (_, peak) = memory(w.pid());
            assert!(w.sigterm().success(), "{}", w.log_text());
            (peak, db, setup)
        }
    };
    let small: Vec<Out> = (0..2000).map(|i| Out::json(i % PARTITIONS, format!(r#"{{"id":"s-{i}"}}"#))).collect();
    let (baseline, _, _) = peak(small).await;
    let big = |i: i32| {
        let head = format!(r#"{{"id":"o-{i}","pad":""#);
        let mut v = head.into_bytes();
        v.resize(LIMIT - 1, b'x');
        v.extend_from_slice(b"\"}");
        assert_eq!(v.len(), LIMIT + 1);
        Out { partition: i % PARTITIONS, value: Some(v), ..Out::default() }
    };
    let first = big(0).value.unwrap();
    let (oversized, db, setup) = peak((0..2000).map(big).collect()).await;
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "peak worker memory: {:.1} MiB for 2,000 oversized records ({:.0} MiB of payloads) vs {:.1} MiB for 2,000 small \
         ones (ratio {:.2})",
        mb(oversized),
        mb(2000 * (LIMIT as u64 + 1)),
        mb(baseline),
        oversized as f64 / baseline as f64
    );
    assert!(oversized < baseline + (64 << 20), "oversized payloads were kept in memory: {oversized} vs {baseline} bytes");

    let (count, longest, sizes): (i64, i32, i64) = sqlx::query_as(
        "SELECT count(*), max(length(payload)), count(*) FILTER (WHERE payload_bytes = 65537) \
         FROM idemflow.dead_letters WHERE reason = 'payload_too_large'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((count, longest, sizes), (2000, 1024, 2000));
    let (id, digest): (i64, Vec<u8>) = sqlx::query_as(
        "SELECT id, payload_sha256 FROM idemflow.dead_letters WHERE partition = 0 AND \"offset\" = 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(digest, sha2::Sha256::digest(&first).to_vec());
    let config = setup.config.to_str().unwrap().to_owned();
    let (status, out, err) = idemflow(&["dead-letters", "show", &id.to_string(), "--config", &config], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("(the first 1024 of 65537 bytes; sha256 of the whole payload "), "{out}");
    let (status, out, err) = idemflow(&["dead-letters", "replay", &id.to_string(), "--config", &config], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("kept only the first 1024 of its 65537 payload bytes: replay it with --payload FILE"), "{err}");
}
