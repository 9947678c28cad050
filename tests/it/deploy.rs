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

/// deploy/kubernetes/: every resource valid against the Kubernetes schemas (kubernetes-validate, strict: no
/// unknown field), the ConfigMap's settings and pipeline loaded by idemflow's own parser (the pipeline the
/// shipped pipelines/payments.toml, comments aside), the probes on the endpoints the worker serves, a grace period
/// longer than the worker's shutdown timeout, and the ServiceMonitor pointing at the Service's port.
#[test]
fn kubernetes_manifests_are_valid_and_consistent() {
    let root = project_root();
    let manifests = root.join("deploy/kubernetes/idemflow.yaml");
    let validate = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict"])
        .arg(&manifests)
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("kubernetes-validate is needed (scripts/preflight.sh installs it): {e}"));
    let said = format!("{}{}", String::from_utf8_lossy(&validate.stdout), String::from_utf8_lossy(&validate.stderr));
    assert!(validate.status.success(), "(kubernetes-validate: `python3 -m pip install kubernetes-validate`)\n{said}");
    for kind in ["secret", "configmap", "deployment", "poddisruptionbudget", "service"] {
        assert!(said.contains(&format!("passed for resource {kind}/")), "{kind} validated:\n{said}");
    }
    // The ConfigMap's files, as the pod mounts them, through idemflow's parser.
    let dir = tempfile::tempdir().unwrap();
    let extract = Command::new("python3")
        .args([
            "-c",
            "import sys, yaml, os\n\
             docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d['kind'] == 'ConfigMap']\n\
             data = docs[0]['data']\n\
             os.makedirs(os.path.join(sys.argv[2], 'pipelines'))\n\
             open(os.path.join(sys.argv[2], 'idemflow.toml'), 'w').write(data['idemflow.toml'])\n\
             open(os.path.join(sys.argv[2], 'pipelines', 'payments.toml'), 'w').write(data['payments.toml'])\n",
        ])
        .arg(&manifests)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(extract.status.success(), "{}", String::from_utf8_lossy(&extract.stderr));
    let env = [("IDEMFLOW_DATABASE__URL".to_owned(), "postgres://idemflow:x@postgres:5432/idemflow".to_owned())];
    let loaded = idemflow::config::load_settings_from(&dir.path().join("idemflow.toml"), env).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(loaded.settings.metrics.listen.to_string(), "0.0.0.0:9464", "the probes and Prometheus reach the worker");
    let pipelines = idemflow::config::load_pipelines(&loaded.settings.pipelines).unwrap();
    assert_eq!(pipelines.len(), 1);
    let value = |text: &str| text.parse::<toml::Table>().unwrap();
    let shipped = std::fs::read_to_string(root.join("pipelines/payments.toml")).unwrap();
    let mounted = std::fs::read_to_string(dir.path().join("pipelines/payments.toml")).unwrap();
    assert_eq!(value(&mounted), value(&shipped), "the ConfigMap's pipeline is the shipped one");
    let text = std::fs::read_to_string(&manifests).unwrap();
    for probe in ["path: /healthz", "path: /readyz", "containerPort: 9464", "name: metrics"] {
        assert!(text.contains(probe), "{probe}");
    }
    let grace: u64 = text.split("terminationGracePeriodSeconds: ").nth(1).unwrap().lines().next().unwrap().trim().parse().unwrap();
    assert!(grace > loaded.settings.shutdown.timeout.as_secs(), "SIGKILL comes after the worker's own shutdown timeout");
    let monitor = std::fs::read_to_string(root.join("deploy/kubernetes/servicemonitor.yaml")).unwrap();
    assert!(monitor.contains("kind: ServiceMonitor") && monitor.contains("- port: metrics") && monitor.contains("app.kubernetes.io/name: idemflow"));
}
