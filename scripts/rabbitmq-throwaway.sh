#!/usr/bin/env bash
# A throwaway RabbitMQ node from Debian's `rabbitmq-server` package, with its own directories and ports.
#   source scripts/rabbitmq-throwaway.sh && rabbitmq_throwaway_start   # exports RABBITMQ_URL, RABBITMQ_NODE,
#                                                                      # RABBITMQ_THROWAWAY_DIR (HOME for rabbitmqctl)
#   RABBITMQ_THROWAWAY_MANAGEMENT=1 rabbitmq_throwaway_start   # also the management plugin (rabbitmqadmin's HTTP
#                                                              # API) on a loopback port: RABBITMQ_MANAGEMENT_PORT
#   rabbitmq_throwaway_stop
# The node runs as the `rabbitmq` user when we are root (the package's files belong to it). The scripts under
# /usr/lib/rabbitmq/bin are called directly: the /usr/sbin wrappers cd to /var/lib/rabbitmq and take its cookie.
# `/usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODE"` needs HOME=$RABBITMQ_THROWAWAY_DIR (the Erlang cookie).
# The same steps, in Rust, start a node of its own for the tests that restart the broker (tests/it/support/rabbitmq.rs).

rabbitmq_throwaway_start() {
  if [ ! -x /usr/sbin/rabbitmq-server ] && ! command -v rabbitmq-server >/dev/null 2>&1; then
    echo "rabbitmq-server not found: install it with 'apt-get update && apt-get install -y --no-install-recommends rabbitmq-server'" >&2
    return 1
  fi
  RABBITMQ_THROWAWAY_DIR=$(mktemp -d /tmp/idemflow-rabbitmq.XXXXXX)
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 45672)
  RABBITMQ_NODE="idem$port@localhost"
  # The Erlang distribution port: one the kernel found free too (the AMQP port + 20000 was never checked).
  dist_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 45673)
  local run=() management=() management_port=""
  if [ "${RABBITMQ_THROWAWAY_MANAGEMENT:-}" = 1 ]; then
    management_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    printf '[rabbitmq_management].\n' >"$RABBITMQ_THROWAWAY_DIR/enabled_plugins"
    printf 'management.tcp.port = %s\nmanagement.tcp.ip = 127.0.0.1\n' "$management_port" >"$RABBITMQ_THROWAWAY_DIR/rabbitmq.conf"
    management=(RABBITMQ_CONFIG_FILE="$RABBITMQ_THROWAWAY_DIR/rabbitmq.conf")
  fi
  if [ "$(id -u)" = 0 ]; then
    chown -R rabbitmq:rabbitmq "$RABBITMQ_THROWAWAY_DIR"
    run=(runuser -u rabbitmq --)
  fi
  "${run[@]}" env "${management[@]}" HOME="$RABBITMQ_THROWAWAY_DIR" RABBITMQ_NODENAME="$RABBITMQ_NODE" RABBITMQ_NODE_PORT="$port" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_DIST_PORT="$dist_port" \
    RABBITMQ_MNESIA_BASE="$RABBITMQ_THROWAWAY_DIR/mnesia" RABBITMQ_LOG_BASE="$RABBITMQ_THROWAWAY_DIR/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$RABBITMQ_THROWAWAY_DIR/enabled_plugins" \
    /usr/lib/rabbitmq/bin/rabbitmq-server >"$RABBITMQ_THROWAWAY_DIR/server.out" 2>&1 &
  RABBITMQ_THROWAWAY_PID=$!
  # Counted across both waits (rabbitmq_throwaway_wait), in tenths of a second.
  local waited=0
  rabbitmq_throwaway_wait "$port" 600 "RabbitMQ did not start" || return 1
  if [ -n "$management_port" ]; then
    # The management listener comes up after the AMQP one.
    rabbitmq_throwaway_wait "$management_port" 1200 "RabbitMQ's management plugin did not listen" || return 1
    export RABBITMQ_MANAGEMENT_PORT=$management_port
  fi
  export RABBITMQ_THROWAWAY_DIR RABBITMQ_NODE RABBITMQ_THROWAWAY_PID
  export RABBITMQ_URL="amqp://guest:guest@127.0.0.1:$port/%2f"
  echo "throwaway RabbitMQ on 127.0.0.1:$port ($RABBITMQ_THROWAWAY_DIR, node $RABBITMQ_NODE)" >&2
}

# Waits until 127.0.0.1:$1 accepts connections, while the node runs and the caller's `waited` (tenths of a second)
# is below $2; otherwise says $3 with the end of the node's output and returns 1.
rabbitmq_throwaway_wait() {
  until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
    if [ "$waited" -ge "$2" ] || ! kill -0 "$RABBITMQ_THROWAWAY_PID" 2>/dev/null; then
      echo "$3; its output:" >&2
      tail -20 "$RABBITMQ_THROWAWAY_DIR/server.out" >&2
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

rabbitmq_throwaway_stop() {
  [ -n "${RABBITMQ_THROWAWAY_DIR:-}" ] || return 0
  local run=()
  [ "$(id -u)" = 0 ] && run=(runuser -u rabbitmq --)
  "${run[@]}" env HOME="$RABBITMQ_THROWAWAY_DIR" /usr/lib/rabbitmq/bin/rabbitmqctl -q -n "$RABBITMQ_NODE" stop >/dev/null 2>&1 \
    || kill "$RABBITMQ_THROWAWAY_PID" 2>/dev/null || true
  wait "$RABBITMQ_THROWAWAY_PID" 2>/dev/null || true
  rm -rf "$RABBITMQ_THROWAWAY_DIR"
}
