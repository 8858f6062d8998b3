#!/usr/bin/env bash
# The deploy/docker-compose.yml cluster as local processes, without Docker: the kvserver daemon
# (DRAM + SSD tier), two tensor-parallel CPU workers and the scheduler, on loopback.
#
#   deploy/run-local.sh                   # start, print the addresses, Ctrl-C stops everything
#   deploy/run-local.sh --print-commands  # print the commands (one per line) and exit
#
# The commands are the compose file's, with service hostnames -> 127.0.0.1, each listen port
# mapped to the local port below (both workers listen on :9500 in their containers, here on
# 9500 and 9501), volumes and ready files -> one temporary directory. The compose file's `keys`
# script runs first and makes the keys (CURVE, TLS, token) in DIR/keys, as in the containers;
# its TLS certificates need the `cryptography` package (the `tls` extra), checked before it.
# tests/deploy/test_compose.py checks this correspondence, so edit both together.
#
# Environment: KVSERVER_LOCAL_DIR (default: a new temporary directory, removed on exit unless
# given; --print-commands creates none), KVSERVER_CMD (default: `kvserver` when on PATH, else
# `python3 -m kvserver.cli`). Local ports, each overridable by a variable of the same name:
# KVSERVER_GRPC (9470), KVSERVER_ZMQ (9471), KVSERVER_PUB (9472), KVSERVER_METRICS (9473),
# WORKER0_LISTEN (9500), WORKER1_LISTEN (9501), DIST_INIT (29500), SCHEDULER_GRPC (9480),
# SCHEDULER_METRICS (9481); e.g. KVSERVER_GRPC=19470 deploy/run-local.sh.
set -euo pipefail

KVSERVER_GRPC=${KVSERVER_GRPC:-9470} KVSERVER_ZMQ=${KVSERVER_ZMQ:-9471}
KVSERVER_PUB=${KVSERVER_PUB:-9472} KVSERVER_METRICS=${KVSERVER_METRICS:-9473}
WORKER0_LISTEN=${WORKER0_LISTEN:-9500} WORKER1_LISTEN=${WORKER1_LISTEN:-9501}
DIST_INIT=${DIST_INIT:-29500}
SCHEDULER_GRPC=${SCHEDULER_GRPC:-9480} SCHEDULER_METRICS=${SCHEDULER_METRICS:-9481}

MODE=run
if [[ "${1:-}" == "--print-commands" ]]; then
  MODE=print
elif [[ $# -gt 0 ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2
  exit 2
fi
if [[ -n "${KVSERVER_LOCAL_DIR:-}" ]]; then
  DIR="$KVSERVER_LOCAL_DIR" KEEP_DIR=1
elif [[ $MODE == print ]]; then # printing starts nothing and creates nothing
  DIR="${TMPDIR:-/tmp}/kvserver-local.XXXXXX" KEEP_DIR=1
else
  DIR="$(mktemp -d -t kvserver-local.XXXXXX)" KEEP_DIR=0
fi
if [[ -n "${KVSERVER_CMD:-}" ]]; then
  read -r -a KV <<<"$KVSERVER_CMD"
elif command -v kvserver >/dev/null; then
  KV=(kvserver)
else
  KV=(python3 -m kvserver.cli)
fi

K=$DIR/keys
KEYS="set -e; test -f $K/server.key_secret || kvserver keys curve $K --name server; \
test -f $K/engine.key_secret || kvserver keys curve $K --name engine; \
test -f $K/server.pem || kvserver keys tls $K --name server --host kvserver --host 127.0.0.1 \
--host localhost; test -f $K/auth.token || kvserver keys token $K --name auth; \
test -f $K/engine.token || kvserver keys token $K --name engine; \
test -f $K/workers.key_secret || kvserver keys curve $K --name workers; \
test -f $K/scheduler.pem || kvserver keys tls $K --name scheduler --host scheduler \
--host 127.0.0.1 --host localhost; mkdir -p $K/clients $K/step-clients; \
cp $K/engine.key $K/clients/; cp $K/engine.key $K/step-clients/"
CLIENT_KEYS="--curve-server-key-file $K/server.key --curve-secret-key-file $K/engine.key_secret \
--auth-token-file $K/auth.token"

SERVICES=(kvserver worker-0 worker-1 scheduler)
declare -A CMD
CMD[kvserver]="start --host 127.0.0.1 --curve-secret-key-file $K/server.key_secret \
--curve-clients-dir $K/clients --tls-cert-file $K/server.crt --tls-key-file $K/server.pem \
--auth-token-file $K/auth.token --grpc-port $KVSERVER_GRPC \
--zmq-port $KVSERVER_ZMQ --pub-port $KVSERVER_PUB --metrics-port $KVSERVER_METRICS --dram 1GiB \
--ssd-dir $DIR/kvdata/ssd --ssd 8GiB \
--ready-file $DIR/kvserver.ready"
for rank in 0 1; do
  listen=$WORKER0_LISTEN
  [[ $rank == 1 ]] && listen=$WORKER1_LISTEN
  CMD[worker-$rank]="worker --rank $rank --world-size 2 --listen tcp://127.0.0.1:$listen \
--dist-init tcp://127.0.0.1:$DIST_INIT --model-file $DIR/models/tiny.safetensors \
--write-random-model-seed 7 --device cpu --kvserver tcp://127.0.0.1:$KVSERVER_ZMQ \
$CLIENT_KEYS --step-curve-secret-key-file $K/workers.key_secret \
--step-curve-clients-dir $K/step-clients --chunk-blocks 1 --ready-file $DIR/worker-$rank.ready"
done
CMD[scheduler]="scheduler --host 127.0.0.1 --tls-cert-file $K/scheduler.crt \
--tls-key-file $K/scheduler.pem --engine-auth-token-file $K/engine.token --grpc-port $SCHEDULER_GRPC --metrics-port $SCHEDULER_METRICS \
--workers tcp://127.0.0.1:$WORKER0_LISTEN,tcp://127.0.0.1:$WORKER1_LISTEN \
--step-curve-server-key-file $K/workers.key --step-curve-secret-key-file $K/engine.key_secret \
--kvserver tcp://127.0.0.1:$KVSERVER_ZMQ $CLIENT_KEYS --model tiny --num-gpu-blocks 256 --block-size 16 \
--chunk-blocks 1 --ready-file $DIR/scheduler.ready"

if [[ $MODE == print ]]; then
  echo "keys: $KEYS"
  for s in "${SERVICES[@]}"; do echo "$s: ${CMD[$s]}"; done
  exit 0
fi

# The keys script's `kvserver keys tls` needs the cryptography package (the tls extra). Ask the
# kvserver command itself (its own interpreter, whatever KV is) to make a throwaway certificate,
# before anything is made or started: without the package (its refusal says "needs the
# 'cryptography' package", kvserver/cli_keys.py) that is one line here, not a failure in the
# middle of the keys step. Any other failure is left to the keys step, which shows its log.
CHECK=$(mktemp -d -t kvserver-tls-check.XXXXXX)
TLS_CHECK=$("${KV[@]}" keys tls "$CHECK" --host localhost 2>&1) || true
rm -rf "$CHECK"
if [[ $TLS_CHECK == *"'cryptography' package"* ]]; then
  [[ $KEEP_DIR == 0 ]] && rm -rf "$DIR"
  echo "run-local.sh: error: '${KV[*]}' cannot import the 'cryptography' package, which the" \
    "keys step (kvserver keys tls) needs: install the tls extra, e.g." \
    "python3 -m pip install -e '.[torch,tls]' (docs/deploy.md)" >&2
  exit 2
fi

# Job control: every service gets its own process group, so a terminal's Ctrl-C reaches only
# this script, which then stops the services in order with SIGTERM.
set -m
PIDS=()
stop() { # [exit status: the script's own, kept unless a service exits with another]
  trap - INT TERM EXIT
  local rc=${1:-0} pid status deadline=$((SECONDS + 60))
  echo "stopping the cluster" >&2
  # reverse start order: scheduler first, daemon last; to each service's process group, so that
  # a program started by a wrapper (a pyenv shim runs it as its child) gets the TERM too (was:
  # the wrapper alone, the program left running on its ports and its files removed under it)
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM -- "-${PIDS[i]}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    wait "$pid" || { status=$?; ((rc || status == 143)) || rc=$status; } # 143: by that TERM
    while kill -0 -- "-$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  done
  if [[ $KEEP_DIR == 0 ]]; then rm -rf "$DIR"; else echo "logs kept in $DIR"; fi
  exit "$rc"
}
trap 'stop 0' INT TERM
trap 'stop $?' EXIT # a failed step's `exit 1` stays 1

mkdir -p "$DIR/kvdata" "$DIR/models"
# the keys script calls `kvserver keys ...`; `command`: where KV is (kvserver), run the program
# on PATH, not this function again (was: endless recursion, bash crashed, no keys)
kvserver() { command "${KV[@]}" "$@"; }
# not tested by `if`: inside a tested command bash ignores the script's own `set -e`, and
# its steps after a failed one ran anyway
set +e
(eval "$KEYS") >"$DIR/keys.log" 2>&1
KEYS_RC=$?
set -e
if ((KEYS_RC != 0)); then
  echo "making the keys failed; its log ($DIR/keys.log):" >&2
  cat "$DIR/keys.log" >&2
  KEEP_DIR=1
  exit 1
fi
wait_ready() { # service pid
  local deadline=$((SECONDS + 60))
  until [[ -f "$DIR/$1.ready" ]]; do
    if ! kill -0 "$2" 2>/dev/null || ((SECONDS > deadline)); then
      echo "$1 did not start; its log ($DIR/$1.log):" >&2
      cat "$DIR/$1.log" >&2
      KEEP_DIR=1
      exit 1
    fi
    sleep 0.1
  done
}
start() { # service
  # shellcheck disable=SC2086  # the commands hold no spaces inside arguments
  "${KV[@]}" ${CMD[$1]} >"$DIR/$1.log" 2>&1 &
  PIDS+=($!)
  echo "started $1 (pid $!, log $DIR/$1.log)"
}

start kvserver
wait_ready kvserver "${PIDS[0]}"
start worker-0
start worker-1
wait_ready worker-0 "${PIDS[1]}"
wait_ready worker-1 "${PIDS[2]}"
start scheduler
wait_ready scheduler "${PIDS[3]}"

cat <<MSG

kvserver cluster up (files in $DIR; keys in $K):
  daemon     gRPC 127.0.0.1:$KVSERVER_GRPC  ZMQ tcp://127.0.0.1:$KVSERVER_ZMQ  events tcp://127.0.0.1:$KVSERVER_PUB
  workers    tcp://127.0.0.1:$WORKER0_LISTEN (rank 0)  tcp://127.0.0.1:$WORKER1_LISTEN (rank 1)
  scheduler  gRPC kvserver.v1.Engine 127.0.0.1:$SCHEDULER_GRPC (TLS, CA $K/scheduler.crt, token $K/engine.token)
  metrics    http://127.0.0.1:$KVSERVER_METRICS/metrics (daemon)  http://127.0.0.1:$SCHEDULER_METRICS/metrics (scheduler)
Try: ${KV[*]} status --server 127.0.0.1:$KVSERVER_GRPC --tls-ca-file $K/server.crt --auth-token-file $K/auth.token
Ctrl-C stops everything.
MSG
wait -n "${PIDS[@]}" || true
echo "a process exited" >&2
KEEP_DIR=1
stop
