#!/usr/bin/env bash
# Scaling out through vllm-router (issue 26), each figure a ratio against a peer in the same run:
#   aggregate: closed-loop throughput through the router over REPLICAS replicas vs one replica alone (replica 0
#              addressed directly), rounds alternating router / single so load that comes and goes hits both;
#   multiturn: TTFT of turns 2..N through the cache_aware router vs a round_robin router over the same
#              replicas, interleaved request by request, each router with its own conversations.
# Runs deploy/router/ortserve-router.sh as a user would, plus the round_robin router beside it. Writes
# $OUT/aggregate-{router,single}-N.json, $OUT/aggregate.json (ratios), $OUT/aggregate.png, $OUT/multiturn.json
# and $OUT/multiturn.png.
#
# Usage: bench/router_bench.sh                    (env overrides below)
#   on one GPU per replica: PROVIDER=cuda DEVICES="0 1" THREADS=4 bench/router_bench.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/router-$(date +%Y%m%d-%H%M%S)}
REPLICAS=${REPLICAS:-2}
PROVIDER=${PROVIDER:-cpu}
DEVICES=${DEVICES:-}
THREADS=${THREADS:-1}                    # ONNX Runtime intra-op threads per replica
MAX_BATCH=${MAX_BATCH:-8}
CONCURRENCY=${CONCURRENCY:-8}            # aggregate: closed-loop users
REQUESTS=${REQUESTS:-32}                 # aggregate: requests per round
ROUNDS=${ROUNDS:-3}                      # aggregate: router/single rounds
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
CONVERSATIONS=${CONVERSATIONS:-6}        # multiturn: conversations (6 turns each) per router
SYSTEM_TOKENS=${SYSTEM_TOKENS:-1000}
PORT=${PORT:-8040}                       # the cache_aware router; replicas on PORT+1..; round_robin on PORT+20
SERVE_ARGS=${SERVE_ARGS:-}               # extra `ortserve serve` flags for every replica
log() { echo "[router_bench] $(date +%H:%M:%S) $*" >&2; }
mkdir -p "$OUT"

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
REPLICAS=$REPLICAS DEVICES=$DEVICES BASE_PORT=$((PORT + 1)) ROUTER_PORT=$PORT ROUTER_METRICS_PORT=$((PORT + 19)) \
  RUN_DIR="$OUT/run" ORTSERVE="$PY -m server" VLLM_ROUTER="$(dirname "$PY")/vllm-router" \
  sh deploy/router/ortserve-router.sh --provider "$PROVIDER" --intra-op-threads "$THREADS" \
  --max-batch "$MAX_BATCH" --log-level warning $SERVE_ARGS >"$OUT/ortserve-router.log" 2>&1 &
PIDS+=($!)
replicas=()
for i in $(seq 0 $((REPLICAS - 1))); do replicas+=("http://127.0.0.1:$((PORT + 1 + i))"); done
"$(dirname "$PY")/vllm-router" --host 127.0.0.1 --port $((PORT + 20)) --policy round_robin \
  --worker-urls "${replicas[@]}" --worker-startup-check-interval 1 --prometheus-port $((PORT + 21)) \
  >"$OUT/round-robin-router.log" 2>&1 &
PIDS+=($!)

all_healthy() {  # all_healthy ROUTER_URL: the router itself sees every replica healthy
  "$PY" -c "
import sys, httpx
try:
    workers = httpx.get(sys.argv[1] + '/workers', timeout=5).json()['workers']
except Exception:
    sys.exit(1)
sys.exit(0 if len(workers) == int(sys.argv[2]) and all(w['is_healthy'] for w in workers) else 1)" "$1" "$REPLICAS"
}
for router in "http://127.0.0.1:$PORT" "http://127.0.0.1:$((PORT + 20))"; do
  for _ in $(seq 900); do all_healthy "$router" && break; sleep 1; done
  all_healthy "$router" || { log "$router never saw $REPLICAS healthy replicas"; exit 1; }
done
log "$REPLICAS replicas ready behind both routers; load average: $(cut -d' ' -f1-3 /proc/loadavg)"

bench() {  # bench URL OUT_JSON LABEL
  "$PY" -m bench --url "$1/v1" --concurrency "$CONCURRENCY" --num-requests "$REQUESTS" \
    --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --label "$3" --out "$2" >>"$OUT/aggregate.txt"
}
for round in $(seq 1 "$ROUNDS"); do
  log "aggregate round $round/$ROUNDS: router ($REPLICAS replicas), then replica 0 alone, c=$CONCURRENCY"
  bench "http://127.0.0.1:$PORT" "$OUT/aggregate-router-$round.json" "router-$REPLICAS-replicas"
  bench "${replicas[0]}" "$OUT/aggregate-single-$round.json" "one-replica"
done
"$PY" - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
from pathlib import Path
from bench.plots import plot_compare
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
load = lambda name: [json.loads((out / f"aggregate-{name}-{r}.json").read_text()) for r in range(1, rounds + 1)]
router, single = load("router"), load("single")
tput = lambda rep: rep["runs"][0]["summary"]["output_tokens_per_s"]
ratios = [tput(a) / tput(b) for a, b in zip(router, single)]
summary = {"router_output_tok_s": [tput(r) for r in router], "single_output_tok_s": [tput(r) for r in single],
           "router_over_single": ratios, "router_over_single_median": statistics.median(ratios)}
(out / "aggregate.json").write_text(json.dumps(summary, indent=2))
print(f"aggregate output tok/s through the router over one replica: median {summary['router_over_single_median']:.2f}x"
      f" (rounds {', '.join(f'{r:.2f}x' for r in ratios)})")
print("plot:", plot_compare([router[-1], single[-1]], str(out / "aggregate.png")))
EOF

log "multiturn: $CONVERSATIONS conversations x 6 turns per router, cache_aware vs round_robin"
"$PY" -m bench --scenario multiturn --url "http://127.0.0.1:$PORT/v1" --label cache-aware \
  --peer-url "http://127.0.0.1:$((PORT + 20))/v1" --peer-label round-robin --distinct-prompts \
  --num-requests "$CONVERSATIONS" --system-tokens "$SYSTEM_TOKENS" --progress \
  --out "$OUT/multiturn.json" --plot "$OUT/multiturn.png" | tee "$OUT/multiturn.txt"
log "done; load average: $(cut -d' ' -f1-3 /proc/loadavg); results in $OUT"
