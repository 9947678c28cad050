//! Deployment files, checked statically (there is no Docker engine here): docker-compose.yml against the Compose
//! specification's JSON schema and against the rest of the repository, and the dashboard files.

use crate::support::*;
use std::process::Command;

#[test]
fn compose_file_is_valid_and_consistent() {
    let root = project_root();
    let schema = Command::new("python3")
        .args(["-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"])
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("check-jsonschema is needed (`pip install check-jsonschema`): {e}"));
    assert!(schema.status.success(), "(check-jsonschema is needed: `python3 -m pip install check-jsonschema`)\n{}{}", String::from_utf8_lossy(&schema.stdout), String::from_utf8_lossy(&schema.stderr));
    let own = Command::new("python3").arg("scripts/check-compose.py").arg(".").current_dir(&root).output().unwrap();
    assert!(own.status.success(), "{}{}", String::from_utf8_lossy(&own.stdout), String::from_utf8_lossy(&own.stderr));
}

#[test]
fn the_worker_settings_used_by_compose_load() {
    // docker-compose.yml mounts idemflow.toml and pipelines/ and overrides settings from the environment.
    let root = project_root();
    let env = [
        ("IDEMFLOW_DATABASE__URL", "postgres://postgres:postgres@postgres:5432/idemflow"),
        ("IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS", "kafka:9092"),
        ("IDEMFLOW_METRICS__LISTEN", "0.0.0.0:9464"),
        ("IDEMFLOW_LOG__FORMAT", "json"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let loaded = idemflow::config::load_settings_from(&root.join("idemflow.toml"), env).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(loaded.settings.kafka.bootstrap_servers, "kafka:9092");
    assert_eq!(loaded.settings.metrics.listen.port(), 9464);
    let pipelines = idemflow::config::load_pipelines(&loaded.settings.pipelines).unwrap();
    assert!(pipelines.iter().any(|p| p.name == "payments"));
}

#[test]
fn every_dashboard_file_is_valid() {
    let dir = project_root().join("dashboards");
    let mut dashboards = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|x| x == "json") {
            let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            assert!(d["uid"].is_string() && d["title"].is_string(), "{}", path.display());
            let vars: Vec<&str> = d["templating"]["list"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
            assert!(vars.contains(&"datasource") && vars.contains(&"pipeline"), "{}: {vars:?}", path.display());
            for panel in d["panels"].as_array().unwrap() {
                assert_eq!(panel["datasource"]["uid"], "${datasource}", "{}: panel {}", path.display(), panel["title"]);
                assert!(!panel["targets"].as_array().unwrap().is_empty());
            }
            dashboards += 1;
        }
    }
    assert!(dashboards >= 1);
}
