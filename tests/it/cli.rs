//! The command line as a user meets it: `migrate`, `check`, bad configuration, and every shipped pipeline.

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_then_check_every_shipped_pipeline() {
    let db = TestDb::new(&std::fs::read_to_string(project_root().join("pipelines/payments.sql")).unwrap()).await;
    sqlx::raw_sql("DROP SCHEMA idemflow CASCADE; DROP TABLE _sqlx_migrations;").execute(&db.pool).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idemflow.toml");
    let shipped = project_root().join("pipelines");
    let kafka = Kafka::new();
    kafka.create_topic("payments", 1);
    std::fs::write(
        &config,
        format!(
            "pipelines = \"{}\"\n[database]\nurl = \"{}\"\n[kafka]\nbootstrap_servers = \"{}\"\n",
            shipped.display(),
            db.url,
            kafka.bootstrap()
        ),
    )
    .unwrap();
    let cfg = config.to_str().unwrap();

    let (status, out, err) = idemflow(&["check", "--config", cfg], dir.path());
    assert!(!status.success());
    assert!(err.contains("idemflow migrate"), "check must say how to fix a missing schema: {out}{err}");

    let (status, out, err) = idemflow(&["migrate", "--config", cfg], dir.path());
    assert!(status.success(), "{out}{err}");
    let (status, out, err) = idemflow(&["migrate", "--config", cfg], dir.path());
    assert!(status.success(), "migrate is idempotent: {out}{err}");
    assert!(!err.contains("already exists"), "the migrator's own NOTICE is not shown: {err}");

    let (status, out, err) = idemflow(&["check", "--config", cfg], dir.path());
    assert!(status.success(), "{out}{err}");
    let files = std::fs::read_dir(&shipped).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "toml")).count();
    assert!(files >= 1);
    assert_eq!(out.matches(": ok,").count(), files, "every shipped pipeline checks: {out}");

    // The same for a CI job: one JSON object on stdout, ok, every pipeline with what it reads.
    let (status, out, err) = idemflow(&["check", "--config", cfg, "--format", "json"], dir.path());
    assert!(status.success(), "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["problems"].as_array().unwrap().len(), 0, "{report}");
    assert_eq!(report["pipelines"].as_array().unwrap().len(), files, "{report}");
    // What each pipeline reads, as fields.
    let source = &report["pipelines"][0]["source"];
    assert_eq!(source["kind"], "kafka", "{report}");
    assert!(source["group_id"].is_string() && source["topics"].is_array(), "{report}");
    // And a failing one: the problems in the object, the exit status non-zero.
    sqlx::raw_sql("DROP TABLE payments CASCADE").execute(&db.pool).await.unwrap();
    let (status, out, _) = idemflow(&["check", "--config", cfg, "--format", "json"], dir.path());
    assert!(!status.success());
    let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(report["ok"], false, "{report}");
    let problems = report["problems"].as_array().unwrap();
    assert!(!problems.is_empty() && problems.iter().all(|p| p["text"].as_str().unwrap().contains("pipeline \"payments\"")), "{report}");
    // Each problem also as its parts, on one line each.
    assert!(problems.iter().all(|p| p["pipeline"] == "payments" && p["file"].is_string() && p["field"].as_str().unwrap().starts_with("sink")), "{report}");
    assert!(problems.iter().all(|p| !p["message"].as_str().unwrap().contains("pipeline \"payments\"")), "{report}");
}

/// `idemflow completions <shell>`: clap's completion script, naming the commands and their options.
#[test]
fn completions_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let (status, out, err) = idemflow(&["completions", shell], &project_root());
        assert!(status.success(), "{shell}: {err}");
        // fish writes an option as `-l config`, the others as `--config`.
        for word in ["idemflow", "check", "dead-letters", "config", "format"] {
            assert!(out.contains(word), "{shell} completions name {word}:\n{out}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_names_file_pipeline_and_field() {
    let db = TestDb::new("CREATE TABLE payments (order_id text, amount numeric, due date NOT NULL);").await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("pipelines")).unwrap();
    std::fs::write(
        dir.path().join("idemflow.toml"),
        format!("[database]\nurl = \"{}\"\n[kafka]\nbootstrap_servers = \"{}\"\n", db.url, kafka.bootstrap()),
    )
    .unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.path().join("pipelines").join(name), text).unwrap();
    write("a.toml", "topics = [\"orders\"]\n[key]\nfield = \"/order//id\"\n[sink]\ntable = \"payments\"\n[sink.columns]\norder_id = \"/order/id\"\n");
    write("b.toml", "topics = [\"orders\"]\n[key]\nfield = \"/id\"\nheader = \"h\"\n[sink]\nsql = \"SELECT :x\"\n");
    let (status, out, err) = idemflow(&["check", "--config", "idemflow.toml"], dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("a.toml: pipeline \"a\": key.field: \"/order//id\""), "{err}");
    assert!(err.contains("b.toml: pipeline \"b\": key: set exactly one of"), "{err}");
    assert!(err.contains("b.toml: pipeline \"b\": sink.params: :x is used in sink.sql"), "{err}");

    // Valid TOML, but the database disagrees: a missing column and a wrong statement.
    write("a.toml", "topics = [\"orders\"]\n[key]\nfield = \"/order/id\"\n[sink]\ntable = \"payments\"\n[sink.columns]\nnope = \"/order/id\"\n");
    write("b.toml", "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"UPDATE nowhere SET x = :x\"\n[sink.params]\nx = \"/x\"\n");
    let (status, out, err) = idemflow(&["check", "--config", "idemflow.toml"], dir.path());
    assert!(!status.success(), "{out}{err}");
    // The misspelled column is named even though a NOT NULL column is unmapped too; both files in one pass.
    // Each on its own line, each counted (three problems, not two).
    assert!(err.contains("a.toml: pipeline \"a\": sink.columns.nope: table payments has no column \"nope\""), "{err}");
    assert!(err.contains("a.toml: pipeline \"a\": sink.columns: table payments's column \"due\" is NOT NULL without a default"), "{err}");
    assert!(err.contains("3 problem(s) in the pipelines"), "{err}");
    assert!(err.contains("b.toml: pipeline \"b\": sink.sql: ") && err.contains("nowhere"), "{err}");
    assert!(!err.contains(&db.url), "the database URL (with its password) is never printed: {err}");

    // One file that does not even load does not hide the other's problem with the database: both in one run.
    write("a.toml", "topics = [\"orders\"]\nbogus = 1\n[key]\nfield = \"/order/id\"\n[sink]\ntable = \"payments\"\n[sink.columns]\norder_id = \"/order/id\"\n");
    let (status, out, err) = idemflow(&["check", "--config", "idemflow.toml"], dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("a.toml") && err.contains("bogus"), "{err}");
    assert!(err.contains("b.toml: pipeline \"b\": sink.sql: ") && err.contains("nowhere"), "the other file's problem too: {err}");

    // An unknown key in the settings file.
    std::fs::write(dir.path().join("idemflow.toml"), "[database]\nurl = \"x\"\nmax_conections = 3\n[kafka]\nbootstrap_servers = \"k\"\n").unwrap();
    let (status, _, err) = idemflow(&["check", "--config", "idemflow.toml"], dir.path());
    assert!(!status.success());
    assert!(
        err.contains("idemflow.toml: line 3, column 1: database.max_conections: unknown key (expected one of url, max_connections"),
        "{err}"
    );

    // A bad value in the file is located by line and column; the same value from the environment names the variable.
    std::fs::write(dir.path().join("idemflow.toml"), "[database]\nurl = \"x\"\nacquire_timeout = \"ten\"\n[kafka]\nbootstrap_servers = \"k\"\n").unwrap();
    let (status, _, err) = idemflow(&["check", "--config", "idemflow.toml"], dir.path());
    assert!(!status.success());
    assert!(err.contains("idemflow.toml: line 3, column 19: database.acquire_timeout: invalid value string \"ten\", expected a duration"), "{err}");
    std::fs::write(dir.path().join("idemflow.toml"), "[database]\nurl = \"x\"\n[kafka]\nbootstrap_servers = \"k\"\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["check", "--config", "idemflow.toml"])
        .env("IDEMFLOW_DATABASE__MAX_CONNECTIONS", "many")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("database.max_connections (from environment variable IDEMFLOW_DATABASE__MAX_CONNECTIONS): invalid type: found string \"many\""),
        "{err}"
    );
    // A missing required key points at its section.
    std::fs::write(dir.path().join("idemflow.toml"), "[database]\nmax_connections = 2\n[kafka]\nbootstrap_servers = \"k\"\n").unwrap();
    let (status, _, err) = idemflow(&["check", "--config", "idemflow.toml"], dir.path());
    assert!(!status.success());
    assert!(err.contains("idemflow.toml: line 1, column 1: database.url: missing (it has no default)"), "{err}");
}

/// A `batch_sql` statement PostgreSQL refuses for a type names its place (`sink.batch_sql[1]`) and, when a column
/// of new_records it reads has no `type` (so it is text), says so and how to give one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sql_type_error_names_the_statement_and_the_untyped_column() {
    let db = TestDb::new("CREATE TABLE stock (sku text PRIMARY KEY, qty integer NOT NULL); CREATE TABLE moves (sku text);").await;
    let kafka = Kafka::new();
    kafka.create_topic("moves", 1);
    let pipeline = r#"topics = ["moves"]
[key]
field = "/id"
[sink]
batch_sql = [
  "INSERT INTO moves (sku) SELECT sku FROM new_records",
  "INSERT INTO stock (sku, qty) SELECT sku, qty FROM new_records",
]
[sink.params]
sku = "/sku"
qty = "/qty"
"#;
    let setup = Setup::new(&db, &kafka, &[("moves.toml", pipeline)]);
    let (status, out, err) = idemflow(&["migrate", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let (status, out, err) = idemflow(&["check", "--config", setup.config.to_str().unwrap()], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("moves.toml: pipeline \"moves\": sink.batch_sql[1]: ") && err.contains("is of type integer"), "{err}");
    assert!(err.contains("hint: new_records.qty is text: [sink.params] qty has no `type`"), "{err}");
    assert!(!err.contains("new_records.sku is text"), "sku is text into a text column: not named: {err}");
}

/// `check` refuses a table-form column fed by record metadata that its type cannot take (`meta = "timestamp"` into
/// `integer`, `"topic"` into `bigint`): at run time every record would be dead-lettered. What fits passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_metadata_a_column_cannot_take() {
    let db = TestDb::new(
        "CREATE TABLE audit (id text PRIMARY KEY, seen integer, source bigint, at timestamptz, part integer, pos bigint, name text);",
    )
    .await;
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let pipeline = |columns: &str| {
        format!("topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"audit\"\n[sink.columns]\nid = \"/id\"\n{columns}")
    };
    let bad = pipeline("seen = { meta = \"timestamp\" }\nsource = { meta = \"topic\" }\n");
    let setup = Setup::new(&db, &kafka, &[("audit.toml", &bad)]);
    let cfg = setup.config.to_str().unwrap();
    let (status, out, err) = idemflow(&["migrate", "--config", cfg], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    let (status, out, err) = idemflow(&["check", "--config", cfg], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("sink.columns.seen: column \"seen\" is integer: meta = \"timestamp\" gives the record's timestamp"), "{err}");
    assert!(err.contains("sink.columns.source: column \"source\" is bigint: meta = \"topic\""), "{err}");
    let good = pipeline("at = { meta = \"timestamp\" }\npart = { meta = \"partition\" }\npos = { meta = \"offset\" }\nname = { meta = \"topic\" }\n");
    std::fs::write(setup.dir.path().join("pipelines/audit.toml"), good).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", cfg], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    // The SQL form: a parameter whose type the statement gives (the column it is written to).
    let sql = |seen: &str| {
        format!(
            "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\nsql = \"INSERT INTO audit (id, seen, at) VALUES (:id, :seen, :at)\"\n\
             [sink.params]\nid = \"/id\"\nseen = {seen}\nat = {{ meta = \"timestamp\" }}\n"
        )
    };
    std::fs::write(setup.dir.path().join("pipelines/audit.toml"), sql("{ meta = \"timestamp\" }")).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", cfg], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("sink.params.seen: parameter :seen (in sink.sql) is integer: meta = \"timestamp\""), "{err}");
    assert!(!err.contains("sink.params.at"), "a timestamp fits timestamptz: {err}");
    std::fs::write(setup.dir.path().join("pipelines/audit.toml"), sql("{ meta = \"partition\" }")).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", cfg], setup.dir.path());
    assert!(status.success(), "{out}{err}");
    // batch_sql: a new_records column of the type written in [sink.params].
    let batch = |seen: &str| {
        format!(
            "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\nbatch_sql = \"INSERT INTO audit (id, seen) SELECT id, seen FROM new_records\"\n\
             [sink.params]\nid = \"/id\"\nseen = {seen}\n"
        )
    };
    std::fs::write(setup.dir.path().join("pipelines/audit.toml"), batch("{ meta = \"topic\", type = \"integer\" }")).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", cfg], setup.dir.path());
    assert!(!status.success(), "{out}{err}");
    assert!(err.contains("sink.params.seen: new_records column \"seen\" is integer: meta = \"topic\""), "{err}");
    std::fs::write(setup.dir.path().join("pipelines/audit.toml"), batch("{ meta = \"offset\", type = \"integer\" }")).unwrap();
    let (status, out, err) = idemflow(&["check", "--config", cfg], setup.dir.path());
    assert!(status.success(), "{out}{err}");
}

/// The README's walkthrough as a fresh Debian cluster runs it: the database belongs to a role named `idemflow`, like
/// idemflow's schema, and PostgreSQL's default `search_path` is `"$user", public`. The first `migrate` records its
/// versions in `public._sqlx_migrations` (the `idemflow` schema did not exist yet); once it does, `"$user"` names it.
/// A second `migrate` must find the record where it is, not start an empty one in the `idemflow` schema and run
/// migration 1 again (`relation "dedup" already exists`), and `check` must read it there too. Found by a user's try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_twice_and_check_as_a_role_named_like_the_schema() {
    let admin = postgres::server_url();
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(admin).await.unwrap();
    sqlx::raw_sql(
        "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idemflow') THEN \
         CREATE ROLE idemflow LOGIN PASSWORD 'idemflow' CREATEDB; END IF; END $$",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let name = format!("role_{}", unique());
    sqlx::raw_sql(&format!("CREATE DATABASE {name} OWNER idemflow")).execute(&mut conn).await.unwrap();
    let mut url = url::Url::parse(admin).unwrap();
    url.set_username("idemflow").unwrap();
    url.set_password(Some("idemflow")).unwrap();
    url.set_path(&name);
    let url = url.to_string();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&url).await.unwrap();
    sqlx::raw_sql("CREATE TABLE paid (id text PRIMARY KEY)").execute(&pool).await.unwrap();
    let kafka = Kafka::new();
    kafka.create_topic("orders", 1);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("pipelines")).unwrap();
    std::fs::write(
        dir.path().join("pipelines/paid.toml"),
        "topics = [\"orders\"]\n[key]\nfield = \"/id\"\n[sink]\ntable = \"paid\"\n[sink.columns]\nid = \"/id\"\n",
    )
    .unwrap();
    let config = dir.path().join("idemflow.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{url}\"\n[kafka]\nbootstrap_servers = \"{}\"\n", kafka.bootstrap())).unwrap();
    let cfg = config.to_str().unwrap();
    for round in 1..=3 {
        let (status, out, err) = idemflow(&["migrate", "--config", cfg], dir.path());
        assert!(status.success(), "migrate {round}: {out}{err}");
    }
    let (status, out, err) = idemflow(&["check", "--config", cfg], dir.path());
    assert!(status.success(), "{out}{err}");
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relname = '_sqlx_migrations'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(records, 1, "one migration record");
    assert_eq!(sqlx::query_scalar::<_, String>("SELECT current_schema()").fetch_one(&pool).await.unwrap(), "idemflow", "the trap is set");
    // Another application's migration record in a schema this role may not read (another sqlx-migrated service
    // sharing the database) is not idemflow's, and `check` and `migrate` pass over it: its schema check runs in a
    // transaction, which a refused read would have aborted.
    let mut admin_here = url::Url::parse(admin).unwrap();
    admin_here.set_path(&name);
    let mut other: sqlx::PgConnection = sqlx::Connection::connect(admin_here.as_str()).await.unwrap();
    sqlx::raw_sql(
        "CREATE SCHEMA other_app; CREATE TABLE other_app._sqlx_migrations (version bigint PRIMARY KEY, success boolean NOT NULL);          INSERT INTO other_app._sqlx_migrations VALUES (99, true)",
    )
    .execute(&mut other)
    .await
    .unwrap();
    for command in ["check", "migrate", "check"] {
        let (status, out, err) = idemflow(&[command, "--config", cfg], dir.path());
        assert!(status.success(), "{command} beside a record it may not read: {out}{err}");
    }
    pool.close().await;
}
