#!/bin/sh
# N ortserve replicas on one host (one device each) behind vllm-router (`pip install vllm-router`).
#
#   deploy/router/ortserve-router.sh                      # 2 replicas, the router on 127.0.0.1:8000
#   REPLICAS=4 DEVICES="0 1 2 3" deploy/router/ortserve-router.sh --provider amdgpu
#
# Arguments are passed to every `ortserve serve` (model, provider, limits, ...). Replica i listens on
# 127.0.0.1:$((BASE_PORT + i)); with DEVICES set it gets `--device` from that list, one entry per replica.
# The router waits until every replica answers /health, then routes by POLICY: cache_aware (default: a
# conversation's turns go to the replica that holds its prefix) or consistent_hash (by the X-Session-ID
# header), round_robin, power_of_two, random. Ctrl-C or SIGTERM stops the router, then drains the replicas.
# With cache_aware, vllm-router (0.1.17) sends every new prefix to one replica until that replica has more than
# BALANCE_ABS_THRESHOLD requests in flight above the least busy one (and 1.5 times as many); then the least busy
# gets it. Its own default, 64, suits replicas that each run hundreds of requests; ortserve runs --max-batch.
#
# Environment (defaults in brackets):
#   REPLICAS [2, or the number of DEVICES]  BASE_PORT [8001]  DEVICES [unset: no --device]
#   ROUTER_HOST [127.0.0.1]  ROUTER_PORT [8000]  ROUTER_METRICS_PORT [29000]  POLICY [cache_aware]
#   BALANCE_ABS_THRESHOLD [4]
#   ORTSERVE [ortserve]: the command that serves (a venv's bin/ortserve, or `python -m server`)
#   VLLM_ROUTER [vllm-router]  RUN_DIR [./ortserve-router-run]: logs and pid files
set -eu

DEVICES=${DEVICES:-}
if [ -n "$DEVICES" ]; then
    # shellcheck disable=SC2086  # DEVICES is a list of words
    num_devices=$(printf '%s\n' $DEVICES | wc -l)
else
    num_devices=0
fi
REPLICAS=${REPLICAS:-$([ "$num_devices" -gt 0 ] && echo "$num_devices" || echo 2)}
BASE_PORT=${BASE_PORT:-8001}
ROUTER_HOST=${ROUTER_HOST:-127.0.0.1}
ROUTER_PORT=${ROUTER_PORT:-8000}
ROUTER_METRICS_PORT=${ROUTER_METRICS_PORT:-29000}
POLICY=${POLICY:-cache_aware}
BALANCE_ABS_THRESHOLD=${BALANCE_ABS_THRESHOLD:-4}
ORTSERVE=${ORTSERVE:-ortserve}
VLLM_ROUTER=${VLLM_ROUTER:-vllm-router}
RUN_DIR=${RUN_DIR:-./ortserve-router-run}

if [ "$num_devices" -gt 0 ] && [ "$num_devices" -ne "$REPLICAS" ]; then
    echo "ortserve-router: DEVICES lists $num_devices devices for $REPLICAS replicas" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"

pids=""
router_pid=""
stop() {
    # The router first (no new requests), then every replica with SIGTERM: each drains its streams.
    [ -n "$router_pid" ] && kill "$router_pid" 2>/dev/null || true
    for pid in $pids; do kill "$pid" 2>/dev/null || true; done
    for pid in $pids $router_pid; do wait "$pid" 2>/dev/null || true; done
}
trap 'stop; exit 143' TERM INT
trap 'stop' EXIT

urls=""
i=0
while [ "$i" -lt "$REPLICAS" ]; do
    port=$((BASE_PORT + i))
    device_args=""
    if [ "$num_devices" -gt 0 ]; then
        # shellcheck disable=SC2086
        device_args="--device $(printf '%s\n' $DEVICES | sed -n "$((i + 1))p")"
    fi
    # shellcheck disable=SC2086  # ORTSERVE and device_args are words
    $ORTSERVE serve --host 127.0.0.1 --port "$port" $device_args "$@" >"$RUN_DIR/replica-$i.log" 2>&1 &
    echo $! >"$RUN_DIR/replica-$i.pid"
    pids="$pids $!"
    urls="$urls http://127.0.0.1:$port"
    i=$((i + 1))
done

# NOTE(deploy): with cache_aware a conversation keeps going to the replica that has its prefix, so the router's
# retries of a request to a dead replica all go there; a breaker that opens after 3 failed attempts (below the 5
# retries) sends the rest to a live replica, so clients only see the requests that were running on it fail.
# shellcheck disable=SC2086  # urls is a list of words
"$VLLM_ROUTER" --host "$ROUTER_HOST" --port "$ROUTER_PORT" --policy "$POLICY" --worker-urls $urls \
    --worker-startup-check-interval 1 --health-check-interval-secs 5 --health-failure-threshold 2 \
    --cb-failure-threshold 3 --retry-max-retries 5 --balance-abs-threshold "$BALANCE_ABS_THRESHOLD" \
    --prometheus-host 127.0.0.1 --prometheus-port "$ROUTER_METRICS_PORT" >"$RUN_DIR/router.log" 2>&1 &
router_pid=$!
echo "$router_pid" >"$RUN_DIR/router.pid"
echo "ortserve-router: $REPLICAS replicas ($urls ) behind http://$ROUTER_HOST:$ROUTER_PORT, policy $POLICY;" \
    "logs in $RUN_DIR" >&2
wait "$router_pid"
