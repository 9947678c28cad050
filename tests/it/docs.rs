//! The README and the user guide under `docs/`, held to what they show: every link leads to a file and a heading
//! that exist, every `idemflow` command line names a command and options the binary takes, every script named
//! exists, and every TOML block is TOML. (The walkthroughs themselves run as tests of their own: the demos in
//! `demo::*`, the brokers' and stores' in theirs.)

use crate::support::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// README.md and every page under docs/, as (path relative to the root, text).
fn pages() -> Vec<(PathBuf, String)> {
    let root = project_root();
    let mut files = vec![PathBuf::from("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(Path::new("docs").join(path.file_name().unwrap()));
        }
    }
    files.sort();
    files.into_iter().map(|f| { let text = std::fs::read_to_string(root.join(&f)).unwrap(); (f, text) }).collect()
}

/// The lines outside fenced code blocks, and the fenced blocks as (info string, body).
fn split_fences(text: &str) -> (Vec<&str>, Vec<(String, String)>) {
    let (mut prose, mut blocks) = (Vec::new(), Vec::new());
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(rest) = line.trim_start().strip_prefix("```") {
            match open.take() {
                Some(block) => blocks.push(block),
                None => open = Some((rest.trim().to_owned(), String::new())),
            }
        } else if let Some((_, body)) = open.as_mut() {
            body.push_str(line);
            body.push('\n');
        } else {
            prose.push(line);
        }
    }
    assert!(open.is_none(), "a code block is never closed");
    (prose, blocks)
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped, spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let (prose, _) = split_fences(text);
    prose.iter().filter_map(|l| l.trim_start_matches('#').strip_prefix(' ').filter(|_| l.starts_with('#'))).map(slug).collect()
}

/// The targets of the Markdown links `[text](target)` of these lines, inline code left out.
fn link_targets(prose: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose {
        // Drop inline code spans first: `a](b)` inside backticks is not a link.
        let mut text = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                text.push_str(part);
            }
        }
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_link_in_the_readme_and_the_docs_resolves() {
    let root = project_root();
    let pages = pages();
    let by_path: BTreeMap<PathBuf, BTreeSet<String>> = pages.iter().map(|(p, t)| (p.clone(), anchors(t))).collect();
    let mut broken = Vec::new();
    let mut checked = 0;
    for (page, text) in &pages {
        let (prose, _) = split_fences(text);
        for target in link_targets(&prose) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = target.split_once('#').map_or((target.as_str(), None), |(p, a)| (p, Some(a)));
            let file = if path.is_empty() {
                page.clone()
            } else {
                // Relative to the page's folder, normalised (docs/../README.md is README.md).
                let mut joined = PathBuf::new();
                for part in page.parent().unwrap().join(path).components() {
                    match part {
                        std::path::Component::ParentDir => assert!(joined.pop(), "{page:?}: {target} leaves the repository"),
                        std::path::Component::CurDir => {}
                        other => joined.push(other),
                    }
                }
                joined
            };
            if !root.join(&file).exists() {
                broken.push(format!("{}: ({target}): no file {}", page.display(), file.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                match by_path.get(&file) {
                    Some(known) if known.contains(anchor) => {}
                    Some(known) => broken.push(format!("{}: ({target}): no heading #{anchor} in {} (it has {known:?})", page.display(), file.display())),
                    None => broken.push(format!("{}: ({target}): an anchor into a file that is not a page", page.display())),
                }
            }
        }
    }
    assert!(broken.is_empty(), "{} broken link(s):\n{}", broken.len(), broken.join("\n"));
    assert!(checked > 60, "only {checked} links found: is the link scanner still right?");
}

/// The `idemflow` command lines of the shell blocks and of inline code: `idemflow ...`, `target/release/idemflow
/// ...`, `cargo run --release -- ...`, as (page, subcommand, its `--options`).
fn command_lines(pages: &[(PathBuf, String)]) -> Vec<(PathBuf, String, Vec<String>)> {
    let mut lines: Vec<(PathBuf, String)> = Vec::new();
    for (page, text) in pages {
        let (prose, blocks) = split_fences(text);
        for (info, body) in blocks {
            if info == "sh" || info == "bash" || info == "console" {
                lines.extend(
                    body.lines()
                        .filter(|l| !l.trim_start().starts_with('#'))
                        .map(|l| (page.clone(), l.split(" #").next().unwrap_or("").to_owned())),
                );
            }
        }
        // Paragraph by paragraph: a code span may go on over a line break.
        for paragraph in prose.split(|line| line.trim().is_empty()) {
            let paragraph = paragraph.join(" ");
            lines.extend(paragraph.split('`').skip(1).step_by(2).map(|code| (page.clone(), code.to_owned())));
        }
    }
    let mut out = Vec::new();
    for (page, line) in lines {
        for start in ["target/release/idemflow ", "cargo run --release -- ", "idemflow "] {
            let Some(at) = line.find(start) else { continue };
            // A command starts its line or code span, or follows a prompt, a pipe, `&&`, `;`, `(`, `exec` or an
            // environment variable's assignment: not `idemflow` inside a path (/etc/idemflow), a sentence ("point
            // idemflow at Kafka") or another command's arguments (`mariadb -p idemflow -e ...`).
            let whole_word = at == 0 || line[..at].ends_with([' ', '(', '$', '|', '&', ';']);
            let before = line[..at].trim_end();
            let last_word = before.rsplit([' ', '(']).next().unwrap_or("");
            let starts_command = before.is_empty()
                || before.ends_with(['$', '|', '&', ';', '('])
                || last_word == "exec"
                || (last_word.contains('=') && !last_word.starts_with('-'));
            if !(whole_word && starts_command) {
                continue;
            }
            let words: Vec<&str> = line[at + start.len()..].split_whitespace().collect();
            let Some(sub) = words.first() else { continue };
            if !sub.chars().all(|c| c.is_ascii_lowercase() || c == '-') || sub.is_empty() {
                continue;
            }
            let mut sub = (*sub).to_owned();
            let mut options_from = 1;
            // dead-letters and dedup have subcommands of their own.
            let nested: &[&str] = match sub.as_str() {
                "dead-letters" => &["list", "show", "replay"],
                "dedup" => &["forget"],
                "pipeline" => &["rename"],
                "outbox" => &["list", "retry-now"],
                _ => &[],
            };
            if let Some(next) = words.get(1).filter(|w| nested.contains(w)) {
                sub = format!("{sub} {next}");
                options_from = 2;
            }
            let options = words[options_from..]
                .iter()
                .take_while(|w| !["|", "&&", ";", "2>", ">", "&"].iter().any(|s| w.starts_with(s)))
                .filter_map(|w| w.strip_prefix("--"))
                .map(|w| w.split(['=', ')', ',', '`']).next().unwrap().to_owned())
                .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                .collect();
            out.push((page.clone(), sub, options));
            break;
        }
    }
    out
}

#[test]
fn every_idemflow_command_in_the_readme_and_the_docs_is_one_the_binary_takes() {
    let pages = pages();
    let commands = command_lines(&pages);
    assert!(commands.len() > 40, "only {} idemflow command lines found", commands.len());
    let mut help: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (page, sub, options) in &commands {
        let text = help.entry(sub.clone()).or_insert_with(|| {
            let mut args: Vec<&str> = sub.split(' ').collect();
            args.push("--help");
            let out = Command::new(env!("CARGO_BIN_EXE_idemflow")).args(&args).output().unwrap();
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        });
        let Some(text) = text else {
            wrong.push(format!("{}: idemflow {sub}: no such command", page.display()));
            continue;
        };
        for option in options {
            if option != "help" && !text.contains(&format!("--{option}")) {
                wrong.push(format!("{}: idemflow {sub} --{option}: no such option", page.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Every command the binary has is shown somewhere.
    for sub in ["run", "check", "migrate", "explain", "dead-letters list", "dedup forget", "rewind", "purge", "demo", "bench", "soak", "completions", "schema"] {
        assert!(help.contains_key(sub), "no page shows `idemflow {sub}`");
    }
}

#[test]
fn every_script_the_readme_and_the_docs_name_exists() {
    let root = project_root();
    let mut missing = BTreeSet::new();
    let mut seen = 0;
    for (page, text) in pages() {
        for (at, _) in text.match_indices("scripts/") {
            if at > 0 && !text[..at].ends_with([' ', '(', '`', '[', '"', '\n']) {
                continue;
            }
            let name: String = text[at..].chars().take_while(|c| c.is_alphanumeric() || "/._-".contains(*c)).collect();
            let name = name.trim_end_matches(['.', '/']);
            if name == "scripts" {
                continue;
            }
            seen += 1;
            if !root.join(name).exists() {
                missing.insert(format!("{}: {name}", page.display()));
            }
        }
    }
    assert!(missing.is_empty(), "named but missing: {missing:?}");
    assert!(seen > 10);
}

#[test]
fn every_toml_block_in_the_readme_and_the_docs_is_toml() {
    let mut bad = Vec::new();
    let mut count = 0;
    for (page, text) in pages() {
        for (info, body) in split_fences(&text).1 {
            if info == "toml" {
                count += 1;
                if let Err(e) = body.parse::<toml::Table>() {
                    bad.push(format!("{}: {e}\n{body}", page.display()));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
    assert!(count > 10, "only {count} TOML blocks");
}

/// The schema file `name` under schemas/, parsed.
fn schema(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(project_root().join("schemas").join(name)).unwrap()).unwrap()
}

/// The keys the schema allows in the table at `path` (`["sink"]`), or None when it is not a closed table.
fn schema_keys(schema: &serde_json::Value, path: &[&str]) -> BTreeSet<String> {
    let mut node = schema;
    for key in path {
        node = &node["properties"][*key];
    }
    assert_eq!(node["additionalProperties"], serde_json::json!(false), "{path:?} is not a closed table in the schema");
    node["properties"].as_object().unwrap().keys().cloned().collect()
}

/// The keys of "expected one of `a`, `b`" (serde) or "expected one of a, b" (the settings' own wording).
fn expected_keys(message: &str) -> BTreeSet<String> {
    let list = message.split("expected one of ").nth(1).or_else(|| message.split("expected ").nth(1)).unwrap_or_else(|| panic!("no key list in {message:?}"));
    let list = list.split(')').next().unwrap().split('\n').next().unwrap();
    list.split(", ").map(|k| k.trim_matches(['`', '[', ']', ' ']).to_owned()).collect()
}

/// What the pipeline parser says of `text`, one message per problem.
fn pipeline_problems(text: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.toml");
    std::fs::write(&file, text).unwrap();
    match idemflow::config::pipeline::load_file(&file) {
        Ok(_) => Vec::new(),
        Err(errors) => errors.iter().map(|e| e.to_string()).collect(),
    }
}

/// What the settings parser says of `text`, or None when it takes it.
fn settings_problem(text: &str) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemflow.toml");
    std::fs::write(&file, text).unwrap();
    idemflow::config::load_settings_from(&file, Vec::new()).err().map(|e| e.to_string())
}

#[test]
fn the_json_schemas_have_the_keys_the_parsers_take() {
    // Each table: an unknown key makes the parser list the keys it takes; the schema must allow exactly those.
    let pipeline = schema("pipeline.schema.json");
    for table in ["", "source", "key", "sink", "batch", "dead_letters", "dedup", "offsets", "outbox"] {
        let text = if table.is_empty() {
            "zzz_unknown = 1\n".to_owned()
        } else {
            format!("[{table}]\nzzz_unknown = 1\n")
        };
        let problems = pipeline_problems(&text);
        let message = problems.iter().find(|p| p.contains("zzz_unknown")).unwrap_or_else(|| panic!("[{table}]: {problems:?}"));
        let path: Vec<&str> = if table.is_empty() { vec![] } else { vec![table] };
        assert_eq!(schema_keys(&pipeline, &path), expected_keys(message), "pipeline [{table}]: the schema's keys and the parser's differ");
    }
    // [source]: the keys of each kind are the broker's own (its capabilities), and kind.
    let all_of = pipeline["properties"]["source"]["allOf"].as_array().unwrap();
    for capabilities in idemflow::source::spec::ALL {
        let rule = all_of
            .iter()
            .find(|r| r["if"]["properties"]["kind"]["const"] == serde_json::json!(capabilities.kind))
            .unwrap_or_else(|| panic!("no [source] rule for kind {}", capabilities.kind));
        let allowed: BTreeSet<String> = rule["then"]["propertyNames"]["enum"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
        let mut expected: BTreeSet<String> = capabilities.fields.iter().map(|f| f.to_string()).collect();
        expected.insert("kind".into());
        assert_eq!(allowed, expected, "[source] kind = {:?}", capabilities.kind);
    }
    let settings = schema("idemflow.schema.json");
    let message = settings_problem("zzz_unknown = 1\n").expect("an unknown section is refused");
    let mut sections = expected_keys(&message);
    sections.insert("pipelines".into());
    assert_eq!(schema_keys(&settings, &[]), sections, "idemflow.toml: the schema's sections and the parser's differ");
    for section in ["database", "redis", "kafka", "rabbitmq", "rocketmq", "nats", "schema_registry", "metrics", "log", "shutdown"] {
        let message = settings_problem(&format!("[{section}]\nzzz_unknown = 1\n")).expect("an unknown key is refused");
        assert_eq!(schema_keys(&settings, &[section]), expected_keys(&message), "idemflow.toml [{section}]: the schema's keys and the parser's differ");
    }
}

/// check-jsonschema (PyPI, in the test environment) on `files` against `schema`: (passed, its output).
fn check_jsonschema(schema: &str, files: &[PathBuf]) -> (bool, String) {
    let out = Command::new("python3")
        .args(["-m", "check_jsonschema", "--schemafile"])
        .arg(project_root().join("schemas").join(schema))
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("check-jsonschema is needed (`pip install check-jsonschema`): {e}"));
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_json_schemas_take_every_shipped_file_and_refuse_what_the_parsers_refuse() {
    let root = project_root();
    let mut pipelines: Vec<PathBuf> = Vec::new();
    for dir in ["pipelines", "examples/per-record-sql", "examples/mysql", "examples/nats", "examples/rabbitmq", "examples/redis", "examples/rocketmq", "examples/formats", "examples/outbox", "fuzz/corpus/pipeline"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                pipelines.push(path);
            }
        }
    }
    assert!(pipelines.len() >= 12, "{pipelines:?}");
    let (ok, out) = check_jsonschema("pipeline.schema.json", &pipelines);
    assert!(ok, "{out}");
    let (ok, out) = check_jsonschema("idemflow.schema.json", &[root.join("idemflow.toml")]);
    assert!(ok, "{out}");

    // Mistakes: the schema refuses them, and so does the parser.
    let dir = tempfile::tempdir().unwrap();
    let base = "[key]\nfield = \"/order/id\"\n\n[sink]\ntable = \"orders\"\n\n[sink.columns]\norder_id = \"/order/id\"\n";
    let mistakes = [
        ("a misspelled key", base.replace("field =", "feild =")),
        ("an unknown conflict policy", base.replace("table = \"orders\"\n", "table = \"orders\"\non_conflict = \"ignore\"\n")),
        ("a RabbitMQ key on a Kafka source", format!("[source]\ntopics = [\"payments\"]\nqueue = \"payments\"\n\n{base}")),
        ("a duration without its unit", format!("{base}\n[dedup]\nretention = \"7\"\n")),
        ("a column from two sources", base.replace("order_id = \"/order/id\"\n", "order_id = { field = \"/order/id\", meta = \"topic\" }\n")),
        ("no sink", "[key]\nfield = \"/order/id\"\n".to_owned()),
    ];
    for (what, text) in mistakes {
        let file = dir.path().join("mistake.toml");
        std::fs::write(&file, &text).unwrap();
        let (ok, out) = check_jsonschema("pipeline.schema.json", std::slice::from_ref(&file));
        assert!(!ok, "the schema takes {what}:\n{text}\n{out}");
        assert!(!pipeline_problems(&text).is_empty(), "the parser takes {what}:\n{text}");
    }
    let file = dir.path().join("idemflow.toml");
    std::fs::write(&file, "[database]\nurl = \"postgres://localhost/db\"\nmax_conections = 4\n").unwrap();
    let (ok, out) = check_jsonschema("idemflow.schema.json", std::slice::from_ref(&file));
    assert!(!ok, "{out}");
    assert!(out.contains("max_conections"), "{out}");
}

#[test]
fn idemflow_schema_prints_the_schemas_of_the_repository() {
    for (file, name) in [("settings", "idemflow.schema.json"), ("pipeline", "pipeline.schema.json")] {
        let out = Command::new(env!("CARGO_BIN_EXE_idemflow")).args(["schema", file]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let printed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("idemflow schema prints JSON");
        assert_eq!(printed, schema(name), "idemflow schema {file} is not schemas/{name}");
        assert_eq!(printed["$schema"], "http://json-schema.org/draft-07/schema#");
    }
}
