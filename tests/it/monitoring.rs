//! Watching it: the alert rules under promtool, and every dashboard and alert query against a real Prometheus
//! (Debian's `prometheus` package) scraping a worker that processes a stream with duplicates and dead letters.

use crate::failures::{payments, payments_db, shipped};
use crate::support::*;
use std::process::{Command, Stdio};
use std::time::Duration;

fn tool(name: &str) -> String {
    let found = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().unwrap();
    assert!(
        found.status.success(),
        "{name} is not installed: `apt-get update && apt-get install -y prometheus` (Debian's package brings prometheus and promtool)"
    );
    String::from_utf8(found.stdout).unwrap().trim().to_owned()
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let promtool = tool("promtool");
    let dir = project_root().join("dashboards");
    for args in [vec!["check", "rules", "alerts.yml"], vec!["test", "rules", "alerts.test.yml"]] {
        let out = Command::new(&promtool).args(&args).current_dir(&dir).output().unwrap();
        assert!(out.status.success(), "promtool {args:?}:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

fn query(prom: std::net::SocketAddr, q: &str) -> serde_json::Value {
    let (status, body) = http_get(prom, &format!("/api/v1/query?query={}", encode(q))).unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{q}: {e}: {body}"));
    assert_eq!(status, 200, "{q}: {body}");
    assert_eq!(v["status"], "success", "{q}: {body}");
    v
}

fn has_data(v: &serde_json::Value) -> bool {
    v["data"]["result"].as_array().is_some_and(|r| !r.is_empty())
}

/// Every metric name a query uses.
fn metric_names(q: &str) -> Vec<String> {
    let mut names: Vec<String> = q
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("idemflow_") || *w == "up")
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_query_returns_data_from_a_real_prometheus() {
    let prometheus = tool("prometheus");
    let promtool = tool("promtool");
    let db = payments_db(None).await;
    let kafka = Kafka::new();
    kafka.create_topic("payments", 2);
    // The retention sweep on a short interval, so that its pass gauge has a value while Prometheus scrapes.
    let pipeline = format!("{}\n[dedup]\npurge_interval = \"1s\"\n", shipped());
    // Beside it, the same stream charged through the outbox (examples/outbox/charges.toml), so the outbox's series
    // have values too.
    let provider = provider::Provider::start(&[]);
    let charges = std::fs::read_to_string(project_root().join("examples/outbox/charges.toml")).unwrap().replace("http://127.0.0.1:8085", &provider.url());
    let setup = Setup::new(&db, &kafka, &[("payments.toml", &pipeline), ("charges.toml", &charges)]);
    let s = payments(3_000, 2, false);
    let worker = BinWorker::start(&setup);

    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: idemflow\n    static_configs:\n      - targets: ['{}']\n",
            project_root().join("dashboards/alerts.yml").display(),
            worker.metrics
        ),
    )
    .unwrap();
    let mut prom = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));

    // The stream in waves, so rates are non-zero while Prometheus scrapes.
    for wave in s.records.chunks(s.records.len() / 4 + 1) {
        kafka.produce("payments", wave);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    wait_until(Duration::from_secs(60), "the worker to process the stream", || async {
        metric(&worker.scrape(), "idemflow_records_received_total", &[("pipeline", "payments")]) >= s.records.len() as f64
    })
    .await;
    wait_until(Duration::from_secs(30), "Prometheus to have scraped the worker", || async {
        http_get(addr, "/api/v1/query?query=idemflow_records_received_total").is_ok_and(|(_, b)| b.contains("payments"))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // promtool check metrics on a real scrape.
    let mut check = Command::new(promtool).args(["check", "metrics"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(check.stdin.as_mut().unwrap(), worker.scrape().as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(out.status.success(), "promtool check metrics: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    // Every dashboard query returns data.
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(project_root().join("dashboards/idemflow.json")).unwrap()).unwrap();
    let mut exprs: Vec<String> = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    exprs.push(dashboard["templating"]["list"][1]["definition"].as_str().unwrap().replace("label_values(", "group by (pipeline) (").replace(", pipeline)", ")"));
    assert!(exprs.len() >= 12);
    for e in &exprs {
        let q = e.replace("$pipeline", ".*").replace("$__rate_interval", "30s");
        assert!(has_data(&query(addr, &q)), "no data for dashboard query {q}");
        for name in metric_names(&q) {
            assert!(has_data(&query(addr, &format!("count({{__name__=\"{name}\"}})"))), "metric {name} (in {q}) does not exist");
        }
    }

    // Every alert rule loads, evaluates, and uses only metrics that exist; the two this stream must trigger fire.
    let (_, rules) = http_get(addr, "/api/v1/rules").unwrap();
    let rules: serde_json::Value = serde_json::from_str(&rules).unwrap();
    let rules: Vec<(String, String)> = rules["data"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_owned(), r["query"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(rules.len(), 12, "{rules:?}");
    for (name, q) in &rules {
        let v = query(addr, q);
        for metric in metric_names(q) {
            assert!(has_data(&query(addr, &format!("count({{__name__=\"{metric}\"}})"))), "alert {name}: metric {metric} does not exist");
        }
        if name == "IdemflowPayloadMismatch" || name == "IdemflowDeadLettersRising" {
            assert!(has_data(&v), "alert {name} must fire for this stream: {q}");
        }
    }
    let _ = prom.kill();
    let _ = prom.wait();
    drop(worker);
}
