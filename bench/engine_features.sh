#!/usr/bin/env bash
# Prefix reuse and speculative decoding over HTTP on the default model (issue 16), each ratio against the same
# server with the feature off, interleaved request by request:
#   multiturn: ortserve (defaults) vs ortserve --no-prefix-caching
#   copy:      ortserve (defaults) vs ortserve --speculative-tokens 0
# Three servers run side by side (only one computes at a time: the bench waits for each answer and pauses
# between requests so spinning threads go idle). Writes $OUT/{multiturn,copy}.json, their plots and
# $OUT/engine-features.png (both scenarios in one figure).
#
# Usage: bench/engine_features.sh          (env overrides below)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/features-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}
CONVERSATIONS=${CONVERSATIONS:-8}        # multiturn: conversations (6 turns each)
COPY_REQUESTS=${COPY_REQUESTS:-8}        # copy: copy + free-text requests each
PORT=${PORT:-8021}                       # ours; the two peers take the next two ports
SERVE_ARGS=${SERVE_ARGS:-}               # extra `ortserve serve` flags for all three
log() { echo "[engine_features] $(date +%H:%M:%S) $*" >&2; }
mkdir -p "$OUT"

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

serve() {  # serve PORT LOG [flags...]
  local port=$1 logfile=$2
  shift 2
  # shellcheck disable=SC2086
  "$PY" -m server serve --port "$port" --provider cpu --intra-op-threads "$THREADS" --log-level warning \
    $SERVE_ARGS "$@" >"$logfile" 2>&1 &
  PIDS+=($!)
}
wait_ready() {
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then return 0; fi
    sleep 1
  done
  log "server on port $1 did not become ready"; return 1
}

serve "$PORT" "$OUT/ortserve.log"
serve $((PORT + 1)) "$OUT/no-prefix-caching.log" --no-prefix-caching
serve $((PORT + 2)) "$OUT/speculative-0.log" --speculative-tokens 0
for p in "$PORT" $((PORT + 1)) $((PORT + 2)); do wait_ready "$p"; done
log "servers ready; load average: $(cut -d' ' -f1-3 /proc/loadavg)"

url() { echo "http://127.0.0.1:$1/v1"; }
log "multiturn: $CONVERSATIONS conversations x 6 turns"
"$PY" -m bench --scenario multiturn --url "$(url "$PORT")" --peer-url "$(url $((PORT + 1)))" \
  --peer-label no-prefix-caching --num-requests "$CONVERSATIONS" --progress \
  --out "$OUT/multiturn.json" --plot "$OUT/multiturn.png" | tee "$OUT/multiturn.txt"
log "copy: $COPY_REQUESTS copy + $COPY_REQUESTS free-text requests"
"$PY" -m bench --scenario copy --url "$(url "$PORT")" --peer-url "$(url $((PORT + 2)))" \
  --peer-label speculative-tokens-0 --num-requests "$COPY_REQUESTS" --progress \
  --out "$OUT/copy.json" --plot "$OUT/copy.png" | tee "$OUT/copy.txt"
"$PY" -c "
import json, sys
from bench.plots import plot_features
print('plot:', plot_features([json.load(open(p)) for p in sys.argv[1:]], '$OUT/engine-features.png'))
" "$OUT/multiturn.json" "$OUT/copy.json"
log "done; load average: $(cut -d' ' -f1-3 /proc/loadavg); results in $OUT"
