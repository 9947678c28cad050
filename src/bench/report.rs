//! What `idemflow bench` reports: each run's result, the ratios against the baselines (medians of `--repeat`),
//! and the report as Markdown and JSON.

use serde::Serialize;
use std::path::Path;

/// One run's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunResult {
    /// `(1)`..`(15)`.
    pub id: String,
    /// Which repetition of the selected runs this is, from 1 (`--repeat`).
    pub repetition: u32,
    /// What ran.
    pub name: String,
    /// Records processed in the timed window.
    pub records: u64,
    /// Seconds of the timed window.
    pub seconds: f64,
    /// Records per second.
    pub records_per_second: f64,
    /// Worker CPU (user + system) per record received, microseconds; `None` when no worker process ran.
    pub cpu_us_per_record: Option<f64>,
    /// Peak resident set of the worker process, MiB.
    pub peak_rss_mib: Option<f64>,
    /// The PostgreSQL cluster's CPU (user + system of the postmaster and every process it started, the ones that
    /// ended included) over the run, per record received, microseconds; `None` when the store is not a local
    /// PostgreSQL whose processes can be read.
    pub db_cpu_us_per_record: Option<f64>,
    /// Bytes of write-ahead log the PostgreSQL server wrote over the run (`pg_current_wal_lsn()` before and after,
    /// the whole server's: checkpoints' full-page images and autovacuum included), per record received. Unlike CPU
    /// time it does not move with the host's load (it is what a run makes the server write and flush), but a
    /// checkpoint inside the run adds the full-page images written after it. `None` on MySQL/MariaDB and Redis.
    pub wal_bytes_per_record: Option<f64>,
    /// Batch duration p50 / p99, milliseconds.
    pub batch_p50_ms: Option<f64>,
    /// Batch duration p99, milliseconds.
    pub batch_p99_ms: Option<f64>,
    /// End-to-end latency p50, milliseconds, from the run's own start (its first record received, as if the whole
    /// stream had been produced then) until half of its records were applied: dominated by the time records wait
    /// in the backlog. Scraped every 25 ms.
    pub e2e_p50_ms: Option<f64>,
    /// End-to-end latency p99, milliseconds.
    pub e2e_p99_ms: Option<f64>,
    /// Notes (duplicates counted, preload time...).
    pub note: String,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Machine and settings.
    pub environment: Vec<(String, String)>,
    /// Each run.
    pub runs: Vec<RunResult>,
    /// Named ratios with their targets.
    pub ratios: Vec<Ratio>,
}

/// One ratio of the report: two runs' figures divided, in each repetition.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// Which runs and figures, e.g. `(1) / (10), against a batched consumer written by hand`.
    pub name: String,
    /// The median over the repetitions (the mean of the middle two for an even count).
    pub value: f64,
    /// The lowest of the repetitions.
    pub low: f64,
    /// The highest of the repetitions.
    pub high: f64,
    /// How many repetitions had both runs.
    pub repetitions: usize,
    /// The target (`>= 1.0`, `<= 3.0`: issue 44's, or earlier ones kept as no-regression bounds), or `(measured)`.
    pub target: String,
    /// Whether the median meets the target: `true` or `false` for a `>= x` or `<= x` target, `None` for
    /// `(measured)`.
    pub met: Option<bool>,
}

/// Whether `value` meets `target` (`>= x`, `<= x`); `None` for any other target.
fn meets(value: f64, target: &str) -> Option<bool> {
    let (op, bound) = target.split_once(' ')?;
    let bound: f64 = bound.parse().ok()?;
    match op {
        ">=" => Some(value >= bound),
        "<=" => Some(value <= bound),
        _ => None,
    }
}

/// The ratios of several repetitions, each a list of `(name, value, target)`, combined by name in the order they
/// first appear: the median, lowest and highest of each.
pub(super) fn combine(repetitions: &[Vec<(String, f64, String)>]) -> Vec<Ratio> {
    let mut names: Vec<(&str, &str)> = Vec::new();
    for (name, _, target) in repetitions.iter().flatten() {
        if !names.iter().any(|(n, _)| n == name) {
            names.push((name, target));
        }
    }
    names
        .into_iter()
        .map(|(name, target)| {
            let mut values: Vec<f64> =
                repetitions.iter().flatten().filter(|(n, _, _)| n == name).map(|(_, v, _)| *v).collect();
            values.sort_by(f64::total_cmp);
            let mid = values.len() / 2;
            let value = if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 };
            Ratio {
                name: name.to_owned(),
                value,
                low: values[0],
                high: values[values.len() - 1],
                repetitions: values.len(),
                target: target.to_owned(),
                met: meets(value, target),
            }
        })
        .collect()
}

/// The ratios of one repetition's runs, `(name, value, target)`, each where both of its runs ran.
pub(super) fn ratios(runs: &[RunResult], mysql: bool) -> Vec<(String, f64, String)> {
    let rate = |id: &str| runs.iter().find(|r| r.id == id).map(|r| r.records_per_second);
    let mut ratios = Vec::new();
    let mut ratio = |name: &str, a: Option<f64>, b: Option<f64>, target: &str| {
        if let (Some(a), Some(b)) = (a, b) {
            ratios.push((name.to_owned(), a / b, target.to_owned()));
        }
    };
    if mysql {
        ratio("(1) / (5)", rate("(1)"), rate("(5)"), "(measured)");
        ratio("(1) / (2)", rate("(1)"), rate("(2)"), "(measured)");
        ratio("(6) / (1)", rate("(6)"), rate("(1)"), "(measured)");
        return ratios;
    }
    let floor = rate("(3)").zip(rate("(5)")).map(|(c, k)| c.min(k));
    ratio("(1) / min((3), (5))", rate("(1)"), floor, ">= 0.60");
    ratio("(1) / (2)", rate("(1)"), rate("(2)"), ">= 50");
    ratio("(4) / (1), with the dedup keys preloaded", rate("(4)"), rate("(1)"), ">= 0.9");
    ratio("(6) / (1)", rate("(6)"), rate("(1)"), "(measured)");
    ratio("(7) / (1), Redis against the Postgres table form", rate("(7)"), rate("(1)"), ">= 2");
    ratio("(7) / (5), Redis against consume-only", rate("(7)"), rate("(5)"), ">= 0.60");
    ratio("(8) / (1), the shipped example (batch SQL form) against the table form", rate("(8)"), rate("(1)"), ">= 0.7");
    ratio("(8) / (13), the shipped example against its per-record SQL form", rate("(8)"), rate("(13)"), "(measured)");
    ratio("(13) / (12), the per-record SQL form: server-side loop against per-record round trips", rate("(13)"), rate("(12)"), "(measured)");
    ratio("(14) / (1), two batch transactions at once against one", rate("(14)"), rate("(1)"), "(measured)");
    ratio("(15) / (1), four batch transactions at once against one", rate("(15)"), rate("(1)"), "(measured)");
    ratio("(1) / (9), the table form against COPY of the minimal rows", rate("(1)"), rate("(9)"), ">= 0.50");
    ratio("(1) / (10), against a batched consumer written by hand", rate("(1)"), rate("(10)"), ">= 1.0");
    ratio("(14) / (10), two batch transactions at once against the hand-written consumer", rate("(14)"), rate("(10)"), ">= 1.6");
    let db_cpu = |id: &str| runs.iter().find(|r| r.id == id).and_then(|r| r.db_cpu_us_per_record);
    ratio("PostgreSQL CPU per record, (1) / (10)", db_cpu("(1)"), db_cpu("(10)"), "<= 1.15");
    let wal = |id: &str| runs.iter().find(|r| r.id == id).and_then(|r| r.wal_bytes_per_record);
    ratio("PostgreSQL WAL bytes per record, (1) / (10)", wal("(1)"), wal("(10)"), "<= 1.2");
    // Figures of one run against their bound (divided by 1).
    let one = Some(1.0);
    let cpu = |id: &str| runs.iter().find(|r| r.id == id).and_then(|r| r.cpu_us_per_record);
    ratio("worker CPU µs per record of (1) (a figure, not a ratio)", cpu("(1)"), one, "<= 3.0");
    let rss = |id: &str| runs.iter().find(|r| r.id == id).and_then(|r| r.peak_rss_mib);
    ratio("peak RSS MiB of (1), the default configuration (a figure)", rss("(1)"), one, "<= 64");
    ratio("(1) / (11), against the guides' per-message consumer", rate("(1)"), rate("(11)"), "(measured)");
    ratio("(16) / (1), Avro payloads against JSON", rate("(16)"), rate("(1)"), "(measured)");
    ratio("(17) / (1), Protobuf payloads against JSON", rate("(17)"), rate("(1)"), "(measured)");
    ratio("(18) / (5), consume-only: Avro decode against JSON", rate("(18)"), rate("(5)"), "(measured)");
    ratio("(19) / (5), consume-only: Protobuf decode against JSON", rate("(19)"), rate("(5)"), "(measured)");
    ratio("(20) / (1), an HTTP request per new key through the outbox against the table form alone", rate("(20)"), rate("(1)"), "(measured)");
    let more = |a: &str, b: &str| cpu(a).zip(cpu(b)).map(|(a, b)| a - b);
    ratio("worker CPU µs per record, (16) - (1): Avro's decode against JSON's (a figure)", more("(16)", "(1)"), one, "(measured)");
    ratio("worker CPU µs per record, (17) - (1): Protobuf's decode against JSON's (a figure)", more("(17)", "(1)"), one, "(measured)");
    ratios
}

pub(super) fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The report as Markdown: settings, the runs table and the ratios.
pub fn markdown(r: &Report) -> String {
    let mut md = String::from("| setting | value |\n|---|---|\n");
    for (k, v) in &r.environment {
        md.push_str(&format!("| {k} | {v} |\n"));
    }
    md.push_str(
        "\n| run | what | records | seconds | records/s | worker CPU µs/record | PostgreSQL CPU µs/record | PostgreSQL WAL bytes/record | peak RSS MiB | batch p50 / p99 ms | end-to-end p50 / p99 ms | notes |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    let repeated = r.runs.iter().any(|x| x.repetition > 1);
    for x in &r.runs {
        let id = if repeated { format!("{} #{}", x.id, x.repetition) } else { x.id.clone() };
        md.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.0} | {} | {} | {} | {} | {} / {} | {} / {} | {} |\n",
            id,
            x.name,
            x.records,
            x.seconds,
            x.records_per_second,
            opt(x.cpu_us_per_record, 2),
            opt(x.db_cpu_us_per_record, 2),
            opt(x.wal_bytes_per_record, 0),
            opt(x.peak_rss_mib, 1),
            opt(x.batch_p50_ms, 1),
            opt(x.batch_p99_ms, 1),
            opt(x.e2e_p50_ms, 0),
            opt(x.e2e_p99_ms, 0),
            x.note
        ));
    }
    md.push_str("\n| ratio | measured | target | met |\n|---|---:|---|---|\n");
    for x in &r.ratios {
        let measured = if x.repetitions > 1 {
            format!("{:.2} (median of {}; {:.2} to {:.2})", x.value, x.repetitions, x.low, x.high)
        } else {
            format!("{:.2}", x.value)
        };
        let met = match x.met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "-",
        };
        md.push_str(&format!("| {} | {measured} | {} | {met} |\n", x.name, x.target));
    }
    md
}

pub(super) fn write_outputs(r: &Report, md_path: &Path, json_path: &Path) -> anyhow::Result<()> {
    for p in [md_path, json_path] {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
    }
    std::fs::write(md_path, markdown(r))?;
    std::fs::write(json_path, serde_json::to_string_pretty(r)?)?;
    Ok(())
}
