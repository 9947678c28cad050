#!/usr/bin/env python3
"""Static checks of docker-compose.yml beyond its JSON schema (there is no Docker engine to run it here).

- every image is pinned to a version (no tag or `latest` is refused), except the one built from the Dockerfile;
- every bind-mounted file or directory exists;
- depends_on names existing services;
- the worker's environment agrees with the other services: database host and port, Kafka bootstrap host and its
  advertised listener, the metrics port with Prometheus's scrape target and the published port;
- Grafana's provisioned data source points at the Prometheus service; the Dockerfile runs as a non-root user, has a
  HEALTHCHECK and exposes the metrics port.
Exit status 1 with one line per problem.
"""
import pathlib
import re
import sys

from ruamel.yaml import YAML

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
yaml = YAML(typ="safe")
compose = yaml.load((root / "docker-compose.yml").read_text())
services = compose["services"]
problems = []


def problem(text):
    problems.append(text)


for name, svc in services.items():
    image = svc.get("image", "")
    if "build" not in svc:
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        if not tag or tag == "latest" or not re.search(r"\d", tag):
            problem(f"service {name}: image {image!r} is not pinned to a version")
    for volume in svc.get("volumes", []):
        source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
        if source.startswith(".") and not (root / source).exists():
            problem(f"service {name}: mounted {source} does not exist")
    for dep in svc.get("depends_on", []):
        if dep not in services:
            problem(f"service {name}: depends_on {dep!r} is not a service")

worker = services.get("idemflow")
if worker is None:
    problem("no idemflow service")
else:
    env = worker.get("environment", {})
    db = re.match(r"postgres://[^@]+@([^:/]+):(\d+)/(\w+)", env.get("IDEMFLOW_DATABASE__URL", ""))
    if not db or db.group(1) not in services or db.group(2) != "5432":
        problem(f"idemflow: IDEMFLOW_DATABASE__URL does not point at a service on 5432: {env.get('IDEMFLOW_DATABASE__URL')}")
    elif services[db.group(1)].get("environment", {}).get("POSTGRES_DB") != db.group(3):
        problem(f"idemflow: database {db.group(3)!r} is not the postgres service's POSTGRES_DB")
    kafka_host, _, kafka_port = env.get("IDEMFLOW_KAFKA__BOOTSTRAP_SERVERS", "").partition(":")
    advertised = services.get(kafka_host, {}).get("environment", {}).get("KAFKA_ADVERTISED_LISTENERS", "")
    if f"//{kafka_host}:{kafka_port}" not in advertised:
        problem(f"idemflow: Kafka bootstrap {kafka_host}:{kafka_port} is not an advertised listener ({advertised!r})")
    metrics_port = env.get("IDEMFLOW_METRICS__LISTEN", "").rpartition(":")[2]
    prometheus = yaml.load((root / "dashboards/prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    if f"idemflow:{metrics_port}" not in targets:
        problem(f"prometheus.yml scrapes {targets}, not idemflow:{metrics_port}")
    if not any(str(p).endswith(f":{metrics_port}") for p in worker.get("ports", [])):
        problem(f"idemflow: metrics port {metrics_port} is not published")
    rules = prometheus.get("rule_files", [])
    mounted = [v.split(":")[1] for v in services["prometheus"].get("volumes", [])]
    for rule in rules:
        if rule not in mounted:
            problem(f"prometheus.yml loads {rule}, which is not mounted")

datasources = yaml.load((root / "dashboards/provisioning/datasources/prometheus.yml").read_text())
for ds in datasources["datasources"]:
    host = re.match(r"https?://([^:/]+):(\d+)", ds["url"])
    if not host or host.group(1) not in services or host.group(2) != "9090":
        problem(f"Grafana data source {ds['url']} is not the prometheus service")

dockerfile = (root / "Dockerfile").read_text()
for needle, why in [("USER ", "a non-root USER"), ("HEALTHCHECK", "a HEALTHCHECK"), ("EXPOSE 9464", "EXPOSE 9464")]:
    if needle not in dockerfile:
        problem(f"Dockerfile has no {why}")
if re.search(r"^USER\s+root", dockerfile, re.M):
    problem("Dockerfile runs as root")
# The build stage must copy every file the crate embeds (include_str!/include_bytes!), or `docker build` fails.
build_stage = dockerfile.split("\nFROM ", 2)[1] if dockerfile.count("\nFROM ") else dockerfile
copied = [c for line in re.findall(r"^COPY\s+(?!--from)(.+)$", build_stage, re.M) for c in line.split()[:-1]]
for source in (root / "src").rglob("*.rs"):
    for embedded in re.findall(r'include_(?:str|bytes)!\(\s*"([^"]+)"', source.read_text()):
        path = (source.parent / embedded).resolve().relative_to(root.resolve())
        if not any(path == pathlib.Path(c) or pathlib.Path(c) in path.parents for c in copied):
            problem(f"Dockerfile's build stage does not copy {path} ({source.relative_to(root)} embeds it)")

for p in problems:
    print(p)
sys.exit(1 if problems else 0)
