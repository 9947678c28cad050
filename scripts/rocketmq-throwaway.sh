#!/usr/bin/env bash
# A throwaway RocketMQ name server and broker: the Rust implementation from crates.io (rocketmq-namesrv-rust and
# rocketmq-broker-rust 1.0). Debian has no RocketMQ package.
#   source scripts/rocketmq-throwaway.sh
#   rocketmq_install                 # cargo install rocketmq-namesrv rocketmq-broker, only when missing
#                                    # (about 20 minutes on 2 cores; the binaries go to ~/.cargo/bin)
#   rocketmq_throwaway_start         # exports ROCKETMQ_NAME_SERVER (127.0.0.1:port), ROCKETMQ_THROWAWAY_DIR
#   rocketmq_throwaway_stop
# Topics are created on first use (autoCreateTopicEnable; the producer asks for 4 queues). The same steps, in Rust, start a pair of
# its own for the tests that restart the broker (tests/it/support/rocketmq.rs).

ROCKETMQ_VERSION=1.0.0

# Whether both binaries are in ~/.cargo/bin already.
rocketmq_installed() {
  local bin="${CARGO_HOME:-$HOME/.cargo}/bin"
  [ -x "$bin/rocketmq-namesrv-rust" ] && [ -x "$bin/rocketmq-broker-rust" ]
}

rocketmq_install() {
  if rocketmq_installed; then
    return 0
  fi
  echo "installing the RocketMQ name server and broker $ROCKETMQ_VERSION from crates.io (cargo install, about 20 minutes on 2 cores; once)..." >&2
  # One target directory for both, so their shared dependencies are built once; removed afterwards.
  local target="${XDG_CACHE_HOME:-$HOME/.cache}/idemflow/rocketmq-target"
  # A cheaper release profile than the crates' own (a test broker needs no LTO nor full optimisation): opt-level 1,
  # 16 codegen units, no LTO, no debug info, niced so that it yields to other builds.
  CARGO_TARGET_DIR="$target" CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_INCREMENTAL=false \
    nice -n 10 cargo install --locked "rocketmq-namesrv@$ROCKETMQ_VERSION" "rocketmq-broker@$ROCKETMQ_VERSION" >&2 \
    || return 1
  rm -rf "$target"
}

rocketmq_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

rocketmq_wait_port() {
  local port=$1 pid=$2 log=$3 waited=0
  until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    if [ $waited -ge 600 ] || ! kill -0 "$pid" 2>/dev/null; then
      echo "RocketMQ did not start listening on $port; its errors, then the end of its log:" >&2
      grep -E "ERROR|panicked|[Ee]rror:" "$log" | head -10 >&2
      tail -20 "$log" >&2
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

# The Rust broker stops taking writes (`broker.operation.failed` on every send) once its disk is 90% full by its
# own measure, (size - available) / size, a ceiling its configuration cannot raise (rocketmq-store 1.0 clamps
# diskSpaceWarningLevelRatio to 0.90). Said here, before it fails a test with nothing in the test's output.
rocketmq_disk_check() {
  local dir=$1 size avail
  read -r size avail < <(df -P -k "$dir" | awk 'NR == 2 { print $2, $4 }')
  local used=$(( (size - avail) * 100 / size ))
  if [ "$used" -ge 88 ]; then
    echo "the disk of $dir is $used% full by the RocketMQ broker's measure ((size - available) / size): above 90% it \
refuses every write. Free some space (a few GB: target/ of other checkouts, say) and start again" >&2
    return 1
  fi
}

# Starts a name server and a broker, trying three times: the broker's three ports are found free before it starts,
# and another process can take one of them in between (an outgoing connection's ephemeral port), which fails its
# start ("Broker lifecycle ... failed", reason "startup").
rocketmq_throwaway_start() {
  rocketmq_install || return 1
  local try
  for try in 1 2 3; do
    rocketmq_throwaway_start_once && return 0
    rocketmq_throwaway_stop
    unset ROCKETMQ_THROWAWAY_DIR ROCKETMQ_NAMESRV_PID ROCKETMQ_BROKER_PID
    [ "$try" -lt 3 ] && echo "RocketMQ did not start (try $try of 3); starting it again on other ports" >&2
  done
  return 1
}

rocketmq_throwaway_start_once() {
  local bin="${CARGO_HOME:-$HOME/.cargo}/bin"
  ROCKETMQ_THROWAWAY_DIR=$(mktemp -d /tmp/idemflow-rocketmq.XXXXXX)
  rocketmq_disk_check "$ROCKETMQ_THROWAWAY_DIR" || return 1
  local d=$ROCKETMQ_THROWAWAY_DIR ns broker
  ns=$(rocketmq_free_port)
  # The broker also listens on its port - 2 and (HA, set below; its default 10912 would clash with any other
  # broker of the machine) + 1: all three must be free.
  broker=$(python3 -c '
import socket
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        s.close()
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if 20000 < p < 65000 and free(p - 2) and free(p + 1):
        print(p)
        break')
  ROCKETMQ_HOME=$d "$bin/rocketmq-namesrv-rust" --listenPort "$ns" --bindAddress 127.0.0.1 --rocketmqHome "$d" \
    >"$d/namesrv.log" 2>&1 &
  ROCKETMQ_NAMESRV_PID=$!
  rocketmq_wait_port "$ns" "$ROCKETMQ_NAMESRV_PID" "$d/namesrv.log" || return 1
  cat >"$d/broker.properties" <<PROPS
brokerClusterName=idemflow
brokerName=broker-a
brokerId=0
brokerIP1=127.0.0.1
listenPort=$broker
haListenPort=$((broker + 1))
namesrvAddr=127.0.0.1:$ns
storePathRootDir=$d/store
storePathCommitLog=$d/store/commitlog
autoCreateTopicEnable=true
autoCreateSubscriptionGroup=true
mappedFileSizeCommitLog=67108864
mappedFileSizeConsumeQueue=600000
PROPS
  ROCKETMQ_HOME=$d "$bin/rocketmq-broker-rust" -c "$d/broker.properties" -n "127.0.0.1:$ns" >"$d/broker.log" 2>&1 &
  ROCKETMQ_BROKER_PID=$!
  rocketmq_wait_port "$broker" "$ROCKETMQ_BROKER_PID" "$d/broker.log" || return 1
  sleep 2 # its first registration with the name server
  export ROCKETMQ_THROWAWAY_DIR ROCKETMQ_NAMESRV_PID ROCKETMQ_BROKER_PID
  export ROCKETMQ_NAME_SERVER="127.0.0.1:$ns"
  echo "throwaway RocketMQ: name server 127.0.0.1:$ns, broker 127.0.0.1:$broker ($d)" >&2
}

rocketmq_throwaway_stop() {
  [ -n "${ROCKETMQ_THROWAWAY_DIR:-}" ] || return 0
  # A start that failed early (the disk check, the name server) has set only some of them.
  local pids=(${ROCKETMQ_BROKER_PID:-} ${ROCKETMQ_NAMESRV_PID:-})
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
  rm -rf "$ROCKETMQ_THROWAWAY_DIR"
}
