//! `idemflow check`: the settings and every pipeline validated, each broker asked for its topics or queues, each
//! side effect prepared against its store; every problem reported at once, as text for people or as one JSON
//! object for a CI job (`--format json`).

use super::workspace::{durability, lifetimes, load, open_stores, prepare_all, unsent};
use idemflow::config;
use idemflow::source;
use idemflow::telemetry;
use std::path::PathBuf;

/// `idemflow check`'s arguments.
#[derive(clap::Args)]
pub struct CheckArgs {
    /// The settings file.
    #[arg(long, short, default_value = "idemflow.toml")]
    config: PathBuf,
    /// `text` (problems on stderr, the rest on stdout) or `json` (one object on stdout: `ok`, `problems`,
    /// `pipelines`, `warnings`, `notes`; the exit status is the same).
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

/// How `check` prints what it found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Text,
    Json,
}

/// What `check` found: problems (each naming its file, pipeline and field), the pipelines that passed with what
/// they read, and the other lines (`warning: ...` first where they are warnings).
#[derive(Default, serde::Serialize)]
struct Findings {
    ok: bool,
    problems: Vec<Problem>,
    pipelines: Vec<PipelineOk>,
    warnings: Vec<String>,
    notes: Vec<String>,
    /// Whether the stores were reached and every pipeline's side effect prepared against them (the problems are
    /// then the brokers' only).
    #[serde(skip)]
    stores_ok: bool,
}

/// One problem: the line the text format prints (`text`), and its parts for a program (`--format json`): the file
/// it is in (the settings file or a pipeline file), the pipeline and the field (a dotted path such as
/// `sink.columns.amount`) where it has them, and what is wrong.
#[derive(serde::Serialize)]
struct Problem {
    text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pipeline: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<String>,
    message: String,
}

impl Problem {
    /// A problem of `file` as a whole (the settings file, a store that cannot be reached).
    /// `message` may already begin with the file's name (as the settings' own errors do): it is said once.
    fn of_file(file: &std::path::Path, message: String) -> Problem {
        let file = file.display().to_string();
        let message = message.strip_prefix(&format!("{file}: ")).map(str::to_owned).unwrap_or(message);
        Problem { text: format!("{file}: {message}"), file: Some(file), pipeline: None, field: None, message }
    }
}

impl From<config::PipelineError> for Problem {
    fn from(e: config::PipelineError) -> Problem {
        let text = e.to_string();
        let some = |s: String| Some(s).filter(|s| !s.is_empty());
        Problem { text, file: some(e.file), pipeline: some(e.pipeline), field: some(e.field), message: e.message }
    }
}

/// A pipeline that passed.
#[derive(serde::Serialize)]
struct PipelineOk {
    name: String,
    file: String,
    source: source::contract::Reads,
}

impl Findings {
    fn problems(problems: impl IntoIterator<Item = Problem>) -> Findings {
        Findings { problems: problems.into_iter().collect(), ..Findings::default() }
    }

    /// A line of the report: a warning or a note.
    fn line(&mut self, line: String) {
        match line.strip_prefix("warning: ") {
            Some(w) => self.warnings.push(w.to_owned()),
            None => self.notes.push(line),
        }
    }
}

/// Runs `check`.
///
/// Errors: a problem with the settings, a pipeline, a broker or a store (all of them printed first), counted.
pub async fn run(a: CheckArgs) -> anyhow::Result<()> {
    // The client libraries' own log lines (librdkafka's connection errors, with the TLS reason) come after check's.
    telemetry::defer_library_logs();
    let mut findings = find(&a).await;
    findings.ok = findings.problems.is_empty();
    match a.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&findings)?),
        Format::Text => {
            for problem in &findings.problems {
                eprintln!("{}", problem.text);
            }
            for p in &findings.pipelines {
                println!("pipeline {:?} ({}): ok, {} {}", p.name, p.file, p.source.kind, p.source);
            }
            for note in &findings.notes {
                println!("{note}");
            }
            for w in &findings.warnings {
                println!("warning: {w}");
            }
        }
    }
    // The client libraries' lines below warnings (NATS's "connected", say) only where something went wrong.
    let held = telemetry::take_deferred(if findings.ok { tracing::Level::WARN } else { tracing::Level::TRACE });
    if !held.is_empty() {
        eprintln!("what the client libraries logged meanwhile:");
        eprint!("{held}");
    }
    match findings.problems.len() {
        0 => Ok(()),
        n if findings.stores_ok => {
            anyhow::bail!("{n} problem(s) with the brokers (the database, its schema and every pipeline's statements are right)")
        }
        n => anyhow::bail!("{n} problem(s) in the pipelines, their settings, brokers and stores"),
    }
}

/// Everything `check` finds, nothing printed. A broker problem does not hide the database's: every pipeline's
/// statements are still checked, and all problems are reported together.
async fn find(a: &CheckArgs) -> Findings {
    let settings = match load(&a.config) {
        Ok(s) => s,
        Err(e) => return Findings::problems([Problem::of_file(&a.config, format!("{e:#}"))]),
    };
    let lines = |errors: Vec<config::PipelineError>| errors.into_iter().flat_map(config::PipelineError::split).map(Problem::from);
    // A file that does not load does not hide the others' problems: those that load are checked on.
    let (pipelines, unloaded) = config::load_some_pipelines_for(&settings);
    let mut findings = Findings::problems(lines(unloaded));
    let all_loaded = findings.problems.is_empty();
    if pipelines.is_empty() {
        return findings;
    }
    if let Err(e) = config::check_sources(&settings, &pipelines) {
        findings.problems.extend(lines(e));
        return findings;
    }
    let mut current = std::collections::HashMap::new();
    for p in &pipelines {
        current.insert(p.name.clone(), schema_paths(p, &mut findings).await);
        record_key_path(p, &mut findings).await;
    }
    let brokers = settings.brokers();
    for p in &pipelines {
        match source::check(&brokers, &p.source_context()).await {
            Ok(found) => found.into_iter().for_each(|l| findings.line(l)),
            Err(source::contract::CheckError::Settings(e)) => {
                findings.problems.push(Problem::of_file(&a.config, e));
                return findings;
            }
            Err(source::contract::CheckError::Broker(e)) => findings.problems.push(Problem {
                text: format!("{}: pipeline {:?}: {}: {e}", p.file.display(), p.name, p.source.kind()),
                file: Some(p.file.display().to_string()),
                pipeline: Some(p.name.clone()),
                field: Some("source".to_owned()),
                message: format!("{}: {e}", p.source.kind()),
            }),
        }
    }
    for p in &pipelines {
        outbox_targets(p, &brokers.kafka, &mut findings).await;
    }
    let stores = match open_stores(&settings, &pipelines).await {
        Ok(s) => s,
        Err(e) => {
            let text = format!("{}: {e}", a.config.display());
            findings.problems.push(Problem { text: text.clone(), file: None, pipeline: None, field: None, message: text });
            return findings;
        }
    };
    durability(&stores, &pipelines).await.into_iter().for_each(|l| findings.line(l));
    lifetimes(&stores, &pipelines).await.into_iter().for_each(|l| findings.line(l));
    unsent(&stores, &pipelines).await.into_iter().for_each(|l| findings.line(l));
    let ready = match prepare_all(&stores, &pipelines).await {
        Ok(ready) => ready,
        Err(e) => {
            findings.problems.extend(lines(e.problems));
            return findings;
        }
    };
    findings.stores_ok = all_loaded;
    if !findings.problems.is_empty() {
        return findings;
    }
    for r in &ready {
        schema_types(r, current.get(&r.pipeline.name).map_or(&[][..], Vec::as_slice), &mut findings);
    }
    if !findings.problems.is_empty() {
        return findings;
    }
    for r in &ready {
        let p = &r.pipeline;
        findings.pipelines.push(PipelineOk {
            name: p.name.clone(),
            file: p.file.display().to_string(),
            source: source::summary(&p.source_context()),
        });
        for note in &r.notes {
            findings.line(format!("pipeline {:?}: {note}", r.pipeline.name));
        }
    }
    let mut timing: Vec<String> = pipelines.iter().flat_map(|p| source::timing_warnings(&brokers, &p.source_context())).collect();
    timing.dedup();
    timing.into_iter().for_each(|w| findings.warnings.push(w));
    for p in &pipelines {
        for line in source::retention_report(&brokers, &p.source_context()).await {
            findings.line(line);
        }
    }
    findings
}

/// Whether each `[[sink.http]]` target of `p` answers: its host resolves (a problem if not) and accepts a TCP
/// connection (a warning if not: the worker retries, and pauses at the outbox's bounds), without a request sent; and
/// whether each `[[sink.kafka]]` topic exists (a problem if not), without a record produced.
async fn outbox_targets(p: &config::Pipeline, kafka: &idemflow::source::kafka::KafkaSettings, findings: &mut Findings) {
    use idemflow::outbox::deliver::{reachable, Unreachable};
    let Some(outbox) = &p.outbox else { return };
    // Secrets are named, never shown: whether each can be read now, and go where it is used.
    let unusable = outbox.unreadable_secrets();
    for (field, secret) in outbox.secrets() {
        match unusable.iter().find(|(f, _)| *f == field) {
            None => findings.line(format!("pipeline {:?}: {field}: the secret of {} is readable", p.name, secret.describe())),
            Some((_, why)) => findings.problems.push(pipeline_problem(p, &field, why.clone())),
        }
    }
    for (field, warning) in outbox.warnings() {
        findings.line(format!("warning: pipeline {:?}: {field}: {warning}", p.name));
    }
    for t in &outbox.http {
        // A secret URL's host is not shown (its whole URL is the secret).
        if t.secret_url.is_some() {
            findings.line(format!("pipeline {:?}: sink.http {}: its URL is a secret, read when each request is sent (not shown)", p.name, t.name));
            continue;
        }
        match reachable(t, std::time::Duration::from_secs(5)).await {
            Ok(Some(what)) => findings.line(format!("pipeline {:?}: sink.http {}: {what}", p.name, t.name)),
            Ok(None) => findings.line(format!(
                "pipeline {:?}: sink.http {}: its host comes from the record's values, checked against allow_hosts{} when each request is prepared and sent",
                p.name,
                t.name,
                if t.private_addresses { "" } else { " and resolved to public addresses only" }
            )),
            Err(Unreachable::Refused(why)) => findings.line(format!(
                "warning: pipeline {:?}: sink.http {}: does not accept connections now ({why}); the relay retries, and consumption pauses at the outbox's bounds",
                p.name, t.name
            )),
            Err(Unreachable::Unresolved(why)) => findings.problems.push(pipeline_problem(p, "sink.http", format!("{}: the host does not resolve: {why}", t.name))),
        }
    }
    #[cfg(feature = "kafka")]
    for t in &outbox.kafka {
        let Some(topic) = t.topic.literal() else {
            findings.line(format!("pipeline {:?}: sink.kafka {}: its topic comes from the record's values, checked against allow_topics", p.name, t.name));
            continue;
        };
        let exists = idemflow::source::kafka::outbox::OutboxProducer::new(kafka, &p.name, &t.name, t.timeout)
            .map_err(|e| e.to_string())
            .and_then(|producer| producer.topic_exists(&topic, std::time::Duration::from_secs(10)));
        match exists {
            Ok(true) => findings.line(format!("pipeline {:?}: sink.kafka {}: topic {topic:?} exists", p.name, t.name)),
            Ok(false) => findings.problems.push(pipeline_problem(p, "sink.kafka", format!("{}: topic {topic:?} does not exist on [kafka] bootstrap_servers", t.name))),
            Err(e) => findings.problems.push(pipeline_problem(p, "sink.kafka", format!("{}: cannot ask the brokers about topic {topic:?}: {e}", t.name))),
        }
    }
    #[cfg(not(feature = "kafka"))]
    let _ = kafka;
}

/// Holds the pipeline's key and value paths to the schemas its payloads are written with now (its `schema_file`, or
/// its subjects' latest versions in the schema registry): a path the schema cannot have is a problem naming the
/// pipeline, the field, the path and the schema; a registry that cannot be asked, too. A subject not registered
/// yet, and a JSON Schema, are noted (their paths are not checked). Returns the schemas read, for
/// [`schema_types`].
async fn schema_paths(p: &config::Pipeline, findings: &mut Findings) -> Vec<idemflow::decode::CurrentSchema> {
    let problem = |field: &str, message: String| pipeline_problem(p, field, message);
    let current = match p.decoder.current_schemas(p.source.streams()).await {
        Ok(current) => current,
        Err(e) => {
            findings.problems.push(problem("format", format!("cannot read the schema its payloads are written with: {e}")));
            return Vec::new();
        }
    };
    let (table, bindings) = p.sink.bindings();
    // (field, path, whether a missing value is allowed: an optional value or one with a default)
    let mut paths: Vec<(String, &idemflow::field::FieldPath, bool)> = p.key.paths().iter().map(|path| ("key".to_owned(), path, false)).collect();
    for b in bindings {
        if let idemflow::store::spec::ValueSource::Field(path) = &b.source {
            paths.push((format!("{table}.{}", b.name), path, b.optional || b.default.is_some()));
        }
    }
    for c in &current {
        let Some(schema) = &c.schema else {
            findings.line(format!("pipeline {:?}: {}: its paths are not checked", p.name, c.label));
            continue;
        };
        let mut missing = 0;
        for (field, path, may_miss) in &paths {
            if let idemflow::decode::paths::Lookup::Missing { at } = schema.lookup(path.tokens()) {
                missing += 1;
                if *may_miss {
                    findings.line(format!(
                        "warning: pipeline {:?}: {field}: {path} is not in {} (it has no {at}): its value is always missing there, so it binds its default or NULL",
                        p.name, c.label
                    ));
                } else {
                    findings.problems.push(problem(field, format!("{path} is not in {}: it has no {at}", c.label)));
                }
            }
        }
        if missing == 0 {
            findings.line(format!("pipeline {:?}: {}: all {} paths found", p.name, c.label, paths.len()));
        }
    }
    current
}

/// For a business key from a field of the record key (`[key] record_key = "/id"`): the path looked up in the record
/// keys' current schema (`<topic>-key`), as [`schema_paths`] does for the payload's.
async fn record_key_path(p: &config::Pipeline, findings: &mut Findings) {
    let (idemflow::key::KeySource::RecordKeyField(path), Some(decoder)) = (&p.key.source, &p.key_decoder) else { return };
    let current = match decoder.current_schemas(p.source.streams()).await {
        Ok(current) => current,
        Err(e) => {
            findings.problems.push(pipeline_problem(p, "key.record_key_format", format!("cannot read the schema its record keys are written with: {e}")));
            return;
        }
    };
    for c in current {
        match c.schema.as_ref().map(|s| s.lookup(path.tokens())) {
            Some(idemflow::decode::paths::Lookup::Missing { at }) => {
                findings.problems.push(pipeline_problem(p, "key.record_key", format!("{path} is not in {}: it has no {at}", c.label)));
            }
            Some(_) => findings.line(format!("pipeline {:?}: record keys: {}: {path} found", p.name, c.label)),
            None => findings.line(format!("pipeline {:?}: record keys: {}: its path is not checked", p.name, c.label)),
        }
    }
}

/// A problem of pipeline `p`'s `field`.
fn pipeline_problem(p: &config::Pipeline, field: &str, message: String) -> Problem {
    Problem {
        text: format!("{}: pipeline {:?}: {field}: {message}", p.file.display(), p.name),
        file: Some(p.file.display().to_string()),
        pipeline: Some(p.name.clone()),
        field: Some(field.to_owned()),
        message,
    }
}

/// Holds each value the pipeline binds from the payload to its target's type, as the store prepared it: a path
/// whose every kind of value (each branch of a union, null aside) is one the target cannot take (a record into a
/// `numeric` column, a timestamp into a `boolean`) is a problem naming the pipeline, the field, the path, the
/// schema and the type.
fn schema_types(r: &idemflow::worker::Ready, current: &[idemflow::decode::CurrentSchema], findings: &mut Findings) {
    use idemflow::decode::paths::{binds, describe, Leaf, Lookup};
    let (table, _) = r.pipeline.sink.bindings();
    for b in r.preparer.bindings() {
        let (idemflow::store::spec::ValueSource::Field(path), Some(target)) = (&b.source, &b.target_type) else { continue };
        let kind = idemflow::store::spec::TargetKind::of(target);
        for c in current {
            let Some(Lookup::Found(leaves)) = c.schema.as_ref().map(|s| s.lookup(path.tokens())) else { continue };
            let values: Vec<Leaf> = leaves.into_iter().filter(|l| *l != Leaf::Null).collect();
            if !values.is_empty() && values.iter().all(|l| !binds(*l, kind)) {
                let message = format!("{path} is {} in {}, which its target's type {target} cannot take", describe(values[0]), c.label);
                findings.problems.push(pipeline_problem(&r.pipeline, &format!("{table}.{}", b.name), message));
            }
        }
    }
}
