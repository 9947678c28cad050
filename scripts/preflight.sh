#!/usr/bin/env bash
# What the scripts need beyond the Rust toolchain, checked before anything is built (sourced by scripts/test and
# scripts/demo):
#   source scripts/preflight.sh
#   idemflow_test_preflight        # everything the test suite needs; puts the Python virtual environment on PATH
#   idemflow_test_path             # only the PATH (the environment when complete, and /usr/sbin)
#   idemflow_apt_install PKG...    # Debian packages: installs them as root, otherwise prints the command, returns 1
# As root, missing Debian packages are installed (apt-get update once, then apt-get install); otherwise the command
# to run is printed and the function returns 1, before any build starts.

# The virtual environment holding check-jsonschema (PyPI): Debian's python3 refuses system-wide pip installs
# (PEP 668), so it lives here, outside the work tree, and is reused by later runs.
IDEMFLOW_VENV=${IDEMFLOW_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/idemflow/venv}

idemflow_apt_install() {
  [ $# -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages: $*" >&2
    echo "install them with: sudo apt-get update && sudo apt-get install -y --no-install-recommends $*" >&2
    return 1
  fi
  local started=$SECONDS
  echo "installing Debian packages: $* (apt-get update && apt-get install -y --no-install-recommends $*)" >&2
  if [ -z "${IDEMFLOW_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq || return 1
    IDEMFLOW_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null || return 1
  echo "installed in $((SECONDS - started))s" >&2
}

# Debian's pgbouncer is /usr/sbin/pgbouncer, which is not on a regular user's PATH.
idemflow_has_pgbouncer() {
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]
}

# What building idemflow needs besides the Rust toolchain and a C compiler: OpenSSL's headers and pkg-config (the
# Kafka client is built with TLS and SASL/SCRAM against the system OpenSSL). Appends missing packages to the array
# named by $1.
idemflow_build_packages_missing() {
  local -n into=$1
  command -v pkg-config >/dev/null 2>&1 || into+=(pkg-config)
  { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists openssl; } || into+=(libssl-dev)
}

idemflow_venv_ready() {
  "$IDEMFLOW_VENV/bin/python3" -c 'import check_jsonschema, ruamel.yaml, kubernetes_validate, yaml, fastavro, jsonschema, grpc_tools, confluent_kafka.schema_registry.avro, confluent_kafka.schema_registry.protobuf' >/dev/null 2>&1 && [ -x "$IDEMFLOW_VENV/bin/noida-db" ]
}

# Everything the test suite needs:
#   postgresql         server binaries under /usr/lib/postgresql/*/bin (throwaway clusters, outage tests)
#   prometheus         promtool and the server (alert rules, dashboard queries against a real scrape)
#   pgbouncer          transaction pooling tests
#   rabbitmq-server    RabbitMQ pipelines against a real broker (a throwaway node per test run, see
#                      scripts/rabbitmq-throwaway.sh)
#   mariadb-server, mariadb-client  the MySQL/MariaDB store against a real server (a throwaway server per test run,
#                      see scripts/mariadb-throwaway.sh)
#   redis-server       the Redis store against a real server (each Redis test starts its own, in about 0.2 s)
#   nats-server        NATS JetStream pipelines against a real server (each NATS test starts its own, with
#                      JetStream on, in well under a second)
#   make, gcc          building librdkafka (rdkafka-sys)
#   pkg-config, libssl-dev  the Kafka client's TLS and SASL/SCRAM (librdkafka against the system OpenSSL)
#   socat              a TLS-terminating proxy for the Kafka TLS test
#   iptables           packets dropped on loopback ports for the network fault tests (tests/it/network.rs)
#   openssl            certificates for the TLS tests
#   locales            the de_DE.UTF-8 locale, generated here, for PostgreSQL with its messages in German (a time
#                      limit told by its SQLSTATE, not its words: tests/it/semantics.rs)
#   curl               the walkthroughs as the docs show them (tests/it/walkthroughs.rs; psql comes with postgresql)
#   python3-venv       the virtual environment with check-jsonschema and ruamel.yaml (docker-compose.yml checks),
#                      kubernetes-validate (deploy/kubernetes/ against the Kubernetes schemas)
#                      noida-db (a second Kafka implementation: DescribeGroups, which the mock cluster lacks)
#                      and confluent-kafka with its Avro, JSON Schema and Protobuf serializers (payloads in the
#                      schema registry's wire format, tests/it/formats.rs), grpcio-tools (protoc, for the Protobuf
#                      producer's generated message class)
idemflow_test_preflight() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found: install the Rust toolchain (https://rustup.rs) first" >&2
    return 1
  fi
  local missing=()
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
  { command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing+=(prometheus)
  idemflow_has_pgbouncer || missing+=(pgbouncer)
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server)
  [ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server)
  { command -v mariadb && command -v mariadb-install-db; } >/dev/null 2>&1 || missing+=(mariadb-client)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  [ -x /usr/sbin/nats-server ] || command -v nats-server >/dev/null 2>&1 || missing+=(nats-server)
  command -v make >/dev/null 2>&1 || missing+=(make)
  idemflow_build_packages_missing missing
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  command -v socat >/dev/null 2>&1 || missing+=(socat)
  command -v curl >/dev/null 2>&1 || missing+=(curl)
  { command -v iptables || [ -x /usr/sbin/iptables ]; } >/dev/null 2>&1 || missing+=(iptables)
  command -v cc >/dev/null 2>&1 || missing+=(gcc)
  [ -d /usr/share/i18n/locales ] && command -v localedef >/dev/null 2>&1 || missing+=(locales)
  if ! idemflow_venv_ready; then
    [ -x /usr/bin/python3 ] || missing+=(python3)
    /usr/bin/python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  fi
  idemflow_apt_install "${missing[@]}" || return 1
  if ! locale -a 2>/dev/null | grep -qix 'de_DE.utf8'; then
    if [ "$(id -u)" -eq 0 ]; then
      echo "generating the locale de_DE.UTF-8 (localedef)" >&2
      localedef -i de_DE -f UTF-8 de_DE.UTF-8 || return 1
    else
      echo "missing the locale de_DE.UTF-8: generate it with: sudo localedef -i de_DE -f UTF-8 de_DE.UTF-8" >&2
      return 1
    fi
  fi

  if ! idemflow_venv_ready; then
    echo "creating $IDEMFLOW_VENV with check-jsonschema, noida-db, kubernetes-validate and confluent-kafka from PyPI" >&2
    /usr/bin/python3 -m venv --clear "$IDEMFLOW_VENV" || return 1
    "$IDEMFLOW_VENV/bin/python3" -m pip install --quiet --disable-pip-version-check check-jsonschema noida-db==0.2.3 kubernetes-validate==1.37.0 \
      'confluent-kafka[avro,json,protobuf,schemaregistry]==2.16.2' grpcio-tools==1.85.4 || return 1
    idemflow_venv_ready || { echo "$IDEMFLOW_VENV: check-jsonschema, noida-db, kubernetes-validate or confluent-kafka did not install" >&2; return 1; }
  fi
  idemflow_test_path
}

# Puts the Python environment first on PATH when it is complete (the tests run `python3 -m check_jsonschema`,
# kubernetes-validate and scripts/check-compose.py with the environment's python3) and /usr/sbin last (pgbouncer,
# nats-server). Also when IDEMFLOW_SKIP_PREFLIGHT=1 skips the installs.
idemflow_test_path() {
  if idemflow_venv_ready; then PATH="$IDEMFLOW_VENV/bin:$PATH"; fi
  case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin" ;; esac
  export PATH
}
