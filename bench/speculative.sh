#!/usr/bin/env bash
# Issue 48's bench: speculative decoding with a draft model on the CPU, side by side with llama.cpp's llama-server on
# the same two GGUF files (qwen2.5-coder-1.5b, drafted by qwen2.5-coder-0.5b). Four servers, one measured at a time,
# cells interleaved round by round (bench/speculative.py): ortserve --draft-model, ortserve with drafts off,
# llama-server -md, llama-server alone. Holds the shared CPU-bench lock while it runs.
#
# llama-server: built from llama-cpp-python's sdist as perf/compare_llama_server.sh says (-DLLAMA_BUILD_TESTS=OFF
# -DLLAMA_BUILD_EXAMPLES=OFF, target llama-server).
# Usage: LLAMA_SERVER=/path/to/llama-server bench/speculative.sh   (env overrides below)
# On the GPU machine: perf/gpu/issue48.sh (PROVIDER=cuda, a CUDA llama-server with LLAMA_ARGS="-ngl 99 -ngld 99",
# TARGET_GGUF/DRAFT_GGUF the planted pair of perf/gpu/draft_pair.py).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/speculative-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}
PROVIDER=${PROVIDER:-cpu}
SLOTS=${SLOTS:-4}
CTX=${CTX:-2048}
ROUNDS=${ROUNDS:-2}
REQUESTS=${REQUESTS:-1}            # per stream and cell
MAX_TOKENS=${MAX_TOKENS:-128}
STREAMS=${STREAMS:-1,4}
TEMPERATURES=${TEMPERATURES:-0,0.7}
WORKLOADS=${WORKLOADS:-code_edit,chat,json}
TARGET=${TARGET:-qwen2.5-coder-1.5b}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
OURS_ARGS=${OURS_ARGS:-}
LLAMA_ARGS=${LLAMA_ARGS:-}
LLAMA_DRAFT_ARGS=${LLAMA_DRAFT_ARGS:-}
BASE_PORT=${BASE_PORT:-8061}
LOCK=${LOCK:-/work/locks/cpu-bench.lock}
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary (see the header), or none}"
export ORTSERVE_CACHE_DIR=${ORTSERVE_CACHE_DIR:-$ROOT/.cache}
# NOTE(bench): this checkout's code, not the editable install's (a worktree sharing another checkout's .venv: its
# console script would import the other checkout's engine)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[speculative] $(date +%H:%M:%S) $*" >&2; }
mkdir -p "$OUT"

gguf() { "$PY" -c "from engine.builder.pull import fetch_gguf, model_cache_dir
print(fetch_gguf('$1', model_cache_dir() / 'gguf', progress=False))"; }
# TARGET_GGUF / DRAFT_GGUF: files of one's own (perf/gpu/issue48.sh's planted pair); ortserve then loads the same
# files (converted into its cache once) instead of the known names
if [ -n "${TARGET_GGUF:-}" ]; then TARGET=$TARGET_GGUF; else TARGET_GGUF=$(gguf "$TARGET"); fi
if [ -n "${DRAFT_GGUF:-}" ]; then DRAFT=$DRAFT_GGUF; else DRAFT_GGUF=$(gguf "$DRAFT"); fi
# ORTSERVE: how to start ortserve (the GPU machine has no venv: ORTSERVE="python3 -m server")
read -ra ORTSERVE <<< "${ORTSERVE:-$ROOT/.venv/bin/ortserve}"
log "target $TARGET_GGUF, draft $DRAFT_GGUF, results $OUT"

source "$ROOT/perf/servers.sh"  # PIDS, stop_servers (on exit), wait_ready
P1=$BASE_PORT; P2=$((BASE_PORT + 1)); P3=$((BASE_PORT + 2)); P4=$((BASE_PORT + 3))
common=(serve --model "$TARGET" --host 127.0.0.1 --provider "$PROVIDER" --intra-op-threads "$THREADS"
        --max-batch "$SLOTS" --max-model-len "$CTX" --log-level warning)
# shellcheck disable=SC2086
"${ORTSERVE[@]}" "${common[@]}" --port "$P1" --draft-model "$DRAFT" $OURS_ARGS > "$OUT/ortserve-draft.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$P1/v1" $!
# shellcheck disable=SC2086
"${ORTSERVE[@]}" "${common[@]}" --port "$P2" --speculative-tokens 0 $OURS_ARGS > "$OUT/ortserve-off.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$P2/v1" $!
peers=(--peer-url "http://127.0.0.1:$P2/v1" --peer-label ortserve-off)
if [ "$LLAMA_SERVER" != none ]; then  # (LLAMA_SERVER=none: ortserve's two servers alone)
  llama=("$LLAMA_SERVER" -m "$TARGET_GGUF" -np "$SLOTS" -c $((SLOTS * CTX)) -t "$THREADS" -tb "$THREADS"
         --host 127.0.0.1 --alias "$(basename "$TARGET")")
  # shellcheck disable=SC2086
  "${llama[@]}" --port "$P3" -md "$DRAFT_GGUF" $LLAMA_ARGS $LLAMA_DRAFT_ARGS > "$OUT/llama-server-draft.log" 2>&1 &
  PIDS+=($!); wait_ready "http://127.0.0.1:$P3/v1" $!
  # shellcheck disable=SC2086
  "${llama[@]}" --port "$P4" $LLAMA_ARGS > "$OUT/llama-server.log" 2>&1 &
  PIDS+=($!); wait_ready "http://127.0.0.1:$P4/v1" $!
  "$LLAMA_SERVER" --version > "$OUT/llama-server-version.txt" 2>&1 || true
  peers+=(--peer-url "http://127.0.0.1:$P3/v1" --peer-label llama-server-draft
          --peer-url "http://127.0.0.1:$P4/v1" --peer-label llama-server)
fi

log "waiting for $LOCK; load average $(cut -d' ' -f1-3 /proc/loadavg)"
flock "$LOCK" "${ORTSERVE[@]}" bench --scenario speculative \
  --url "http://127.0.0.1:$P1/v1" --label ortserve-draft "${peers[@]}" \
  --workloads "$WORKLOADS" --temperatures "$TEMPERATURES" --concurrency "$STREAMS" --rounds "$ROUNDS" \
  --num-requests "$REQUESTS" --output-tokens "$MAX_TOKENS" --out "$OUT/report.json" --plot "$OUT/speculative.png" \
  | tee "$OUT/summary.txt"
log "done: $OUT"
