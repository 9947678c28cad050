#!/usr/bin/env bash
# A throwaway PostgreSQL cluster from the local server binaries (Debian's `postgresql` package).
#   source scripts/pg-throwaway.sh && pg_throwaway_start   # exports DATABASE_URL, PG_THROWAWAY_DIR
#   pg_throwaway_stop
# As root, initdb refuses to run, so the cluster is run as the `postgres` user.

pg_throwaway_start() {
  local bin
  bin=$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -1)
  if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
    echo "PostgreSQL server binaries not found: install them with 'apt-get update && apt-get install -y postgresql'" >&2
    return 1
  fi
  PG_THROWAWAY_DIR=$(mktemp -d /tmp/idemflow-pg.XXXXXX)
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 55432)
  local run=()
  if [ "$(id -u)" = 0 ]; then
    chown postgres:postgres "$PG_THROWAWAY_DIR"
    run=(runuser -u postgres --)
  fi
  echo postgres > "$PG_THROWAWAY_DIR/pw"
  "${run[@]}" "$bin/initdb" -D "$PG_THROWAWAY_DIR/data" -U postgres --pwfile="$PG_THROWAWAY_DIR/pw" \
    --auth=scram-sha-256 -E UTF8 --locale=C.UTF-8 --no-sync >/dev/null
  "${run[@]}" "$bin/pg_ctl" -D "$PG_THROWAWAY_DIR/data" -l "$PG_THROWAWAY_DIR/server.log" -w \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $PG_THROWAWAY_DIR -c max_connections=300" start >/dev/null
  PG_THROWAWAY_BIN=$bin
  export PG_THROWAWAY_DIR PG_THROWAWAY_BIN
  export DATABASE_URL="postgres://postgres:postgres@127.0.0.1:$port/postgres"
  echo "throwaway PostgreSQL on 127.0.0.1:$port ($PG_THROWAWAY_DIR)" >&2
}

pg_throwaway_stop() {
  [ -n "${PG_THROWAWAY_DIR:-}" ] || return 0
  local run=()
  [ "$(id -u)" = 0 ] && run=(runuser -u postgres --)
  "${run[@]}" "$PG_THROWAWAY_BIN/pg_ctl" -D "$PG_THROWAWAY_DIR/data" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$PG_THROWAWAY_DIR"
}
