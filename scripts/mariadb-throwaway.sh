#!/usr/bin/env bash
# A throwaway MariaDB server from Debian's `mariadb-server` package, with its own data directory, socket and port.
#   source scripts/mariadb-throwaway.sh && mariadb_throwaway_start   # exports MARIADB_URL (database `idemflow`),
#                                                                    # MARIADB_THROWAWAY_DIR, MARIADB_PORT, MARIADB_SOCKET
#   mariadb_throwaway_stop
#   mariadb_throwaway_serve   # (re)starts the server on the existing MARIADB_THROWAWAY_DIR and MARIADB_PORT (after
#                             # a crash the tests cause with kill -9 "$(cat "$MARIADB_THROWAWAY_DIR/pid")")
# As root, mariadbd refuses to run, so the server runs as the `mysql` user. --no-defaults keeps /etc/mysql (the
# package's own server's pid file, socket and collation) out of it. root has the password `root`, over TCP from
# 127.0.0.1 as well as on the socket: `mariadb --no-defaults -h127.0.0.1 -P"$MARIADB_PORT" -uroot -proot`.

mariadb_throwaway_start() {
  local bin=/usr/sbin
  if [ ! -x "$bin/mariadbd" ] || ! command -v mariadb-install-db >/dev/null 2>&1 || ! command -v mariadb >/dev/null 2>&1; then
    echo "MariaDB not found: install it with 'apt-get update && apt-get install -y --no-install-recommends mariadb-server mariadb-client'" >&2
    return 1
  fi
  MARIADB_THROWAWAY_DIR=$(mktemp -d /tmp/idemflow-mariadb.XXXXXX)
  MARIADB_SOCKET=$MARIADB_THROWAWAY_DIR/sock
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 53306)
  local run=()
  # Temporary files of its own: servers sharing /tmp name theirs by process id, and a bootstrap whose id another
  # server had used failed deleting one ("Error on delete of '/tmp/#sql-temptable-...'", seen once in CI).
  mkdir "$MARIADB_THROWAWAY_DIR/tmp"
  if [ "$(id -u)" = 0 ]; then
    chown mysql:mysql "$MARIADB_THROWAWAY_DIR" "$MARIADB_THROWAWAY_DIR/tmp"
    run=(runuser -u mysql --)
  fi
  # No --user: it is for root, and makes mariadb-install-db chown the package's PAM plugin files as well.
  "${run[@]}" mariadb-install-db --no-defaults --datadir="$MARIADB_THROWAWAY_DIR/data" --tmpdir="$MARIADB_THROWAWAY_DIR/tmp" \
    --auth-root-authentication-method=normal --skip-test-db >"$MARIADB_THROWAWAY_DIR/install.log" 2>&1 || {
    echo "mariadb-install-db failed; its output:" >&2
    tail -20 "$MARIADB_THROWAWAY_DIR/install.log" >&2
    return 1
  }
  MARIADB_PORT=$port
  export MARIADB_THROWAWAY_DIR MARIADB_PORT MARIADB_SOCKET
  mariadb_throwaway_serve || return 1
  # mariadb-install-db makes root@localhost (the socket) and password-less root@127.0.0.1, root@::1 and root@<host>:
  # all of them get the password, and root@127.0.0.1 (the tests' TCP connections) is created should it be missing.
  mariadb --no-defaults -S "$MARIADB_SOCKET" -uroot -e "
    CREATE USER IF NOT EXISTS root@'127.0.0.1';
    GRANT ALL ON *.* TO root@'127.0.0.1' WITH GRANT OPTION;
    SET @alter = (SELECT GROUP_CONCAT(CONCAT(QUOTE(User), '@', QUOTE(Host), ' IDENTIFIED BY ''root''') SEPARATOR ', ')
                  FROM mysql.user WHERE User = 'root');
    EXECUTE IMMEDIATE CONCAT('ALTER USER ', @alter);
    CREATE DATABASE idemflow;" || {
    echo "could not set MariaDB's root password; the end of $MARIADB_THROWAWAY_DIR/error.log:" >&2
    tail -20 "$MARIADB_THROWAWAY_DIR/error.log" >&2
    return 1
  }
  export MARIADB_URL="mysql://root:root@127.0.0.1:$port/idemflow"
  echo "throwaway MariaDB on 127.0.0.1:$port ($MARIADB_THROWAWAY_DIR)" >&2
}

# Starts mariadbd on $MARIADB_THROWAWAY_DIR/data and $MARIADB_PORT, and waits until it accepts connections.
# MARIADB_EXTRA_ARGS, when set, is appended to the server's options (e.g. "--log-bin --binlog-format=STATEMENT").
mariadb_throwaway_serve() {
  local run=()
  [ "$(id -u)" = 0 ] && run=(runuser -u mysql --)
  MARIADB_SOCKET=$MARIADB_THROWAWAY_DIR/sock
  "${run[@]}" /usr/sbin/mariadbd --no-defaults --datadir="$MARIADB_THROWAWAY_DIR/data" --tmpdir="$MARIADB_THROWAWAY_DIR/tmp" --socket="$MARIADB_SOCKET" \
    --port="$MARIADB_PORT" --bind-address=127.0.0.1 --pid-file="$MARIADB_THROWAWAY_DIR/pid" \
    --log-error="$MARIADB_THROWAWAY_DIR/error.log" --max-connections=500 --innodb-buffer-pool-size=256M \
    --innodb-flush-log-at-trx-commit=1 --character-set-server=utf8mb4 --collation-server=utf8mb4_bin \
    ${MARIADB_EXTRA_ARGS:-} >/dev/null 2>&1 &
  local server=$!
  local waited=0
  until mariadb --no-defaults -S "$MARIADB_SOCKET" -uroot -e 'SELECT 1' >/dev/null 2>&1 \
    || mariadb --no-defaults -S "$MARIADB_SOCKET" -uroot -proot -e 'SELECT 1' >/dev/null 2>&1; do
    if [ $waited -ge 300 ] || ! kill -0 "$server" 2>/dev/null; then
      echo "MariaDB did not start within 30s; the end of $MARIADB_THROWAWAY_DIR/error.log:" >&2
      tail -20 "$MARIADB_THROWAWAY_DIR/error.log" >&2
      kill "$server" 2>/dev/null
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

mariadb_throwaway_stop() {
  [ -n "${MARIADB_THROWAWAY_DIR:-}" ] || return 0
  local pid
  pid=$(cat "$MARIADB_THROWAWAY_DIR/pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
    local waited=0
    while kill -0 "$pid" 2>/dev/null && [ $waited -lt 300 ]; do
      sleep 0.1
      waited=$((waited + 1))
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -rf "$MARIADB_THROWAWAY_DIR"
}
