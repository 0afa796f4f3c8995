#!/usr/bin/env bash
# Issue 25's CPU comparison: ortserve against llama.cpp's C++ llama-server, both with 8 slots and the default model's
# weights (its GGUF for llama-server, ortserve's conversion of the same file), through HTTP, the idle server paused
# while the other is measured (perf/compare_llama_server.py: temperature 0 with one shared prompt and
# temperature 1 with distinct prompts; one stream and 8 streams; ratios within each round).
#
# llama-server is a dev-only tool, built once outside the repo from the llama.cpp sources vendored in
# llama-cpp-python's sdist (pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36, unpacked:
# vendor/llama.cpp):
#   cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON \
#     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF && cmake --build build --target llama-server -j2
# (about 40 minutes on 2 cores; on a CPU without AVX-512 leave -DGGML_AVX512=ON out.)
# Usage: LLAMA_SERVER=/path/to/build/bin/llama-server perf/compare_llama_server.sh   (env overrides below)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/llama-server-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}
SLOTS=${SLOTS:-8}
CTX=${CTX:-2048}                       # per slot
ROUNDS=${ROUNDS:-3}
OURS_PORT=${OURS_PORT:-8041}
PEER_PORT=${PEER_PORT:-8042}
OURS_ARGS=${OURS_ARGS:-}
OURS_CMD=${OURS_CMD:-$ROOT/.venv/bin/ortserve}  # e.g. "$PY -m server" to serve this tree's code from another venv
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary (see the header)}"
export ORTSERVE_CACHE_DIR=${ORTSERVE_CACHE_DIR:-$ROOT/.cache}
log() { echo "[compare_llama_server] $(date +%H:%M:%S) $*" >&2; }
mkdir -p "$OUT"

MODEL_DIR=$("$PY" -c 'from engine.builder.pull import pull_model; print(pull_model(progress=False))')
GGUF=$("$PY" -c 'from engine.builder.pull import DEFAULT_MODEL, fetch_gguf, model_cache_dir
print(fetch_gguf(DEFAULT_MODEL, model_cache_dir() / "gguf", progress=False))')
log "model folder $MODEL_DIR, gguf $GGUF, results $OUT"

source "$ROOT/perf/servers.sh"  # PIDS, stop_servers (on exit), wait_ready

# shellcheck disable=SC2086
$OURS_CMD serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$OURS_PORT" --provider cpu \
  --intra-op-threads "$THREADS" --max-batch "$SLOTS" --max-model-len "$CTX" --log-level warning $OURS_ARGS \
  > "$OUT/ortserve.log" 2>&1 &
PIDS+=($!); OURS_PID=$!
wait_ready "http://127.0.0.1:$OURS_PORT/v1" "$OURS_PID"
"$LLAMA_SERVER" -m "$GGUF" -np "$SLOTS" -c $((SLOTS * CTX)) -t "$THREADS" -tb "$THREADS" --host 127.0.0.1 \
  --port "$PEER_PORT" --alias smollm2-135m-instruct > "$OUT/llama-server.log" 2>&1 &
PIDS+=($!); PEER_PID=$!
wait_ready "http://127.0.0.1:$PEER_PORT/v1" "$PEER_PID"
"$LLAMA_SERVER" --version > "$OUT/llama-server-version.txt" 2>&1 || true

log "interleaved rounds ($ROUNDS); load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" -m perf.compare_llama_server --ours "http://127.0.0.1:$OURS_PORT/v1" --ours-pid "$OURS_PID" \
  --peer "http://127.0.0.1:$PEER_PORT/v1" --peer-pid "$PEER_PID" --rounds "$ROUNDS" --streams "$SLOTS" \
  --out "$OUT" | tee "$OUT/run.txt"
log "done: $OUT/summary.md, $OUT/compare.png"
