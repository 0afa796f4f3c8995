#!/usr/bin/env bash
# Issue 24's embedding comparison on this machine, all-MiniLM-L6-v2 in float32 everywhere, through HTTP:
#   ortserve               `ortserve serve --embedding-model all-minilm-l6-v2` (the default chat model beside it, idle);
#   llama.cpp              `llama-server --embeddings --pooling mean` on a GGUF made by llama.cpp's own
#                          convert_hf_to_gguf.py from the same sentence-transformers folder;
#   sentence-transformers  perf/st_server.py (SentenceTransformer.encode behind a minimal /v1/embeddings).
# `ortserve bench --scenario embeddings` sends the same requests to each in turn (order rotating), ROUNDS times, at
# concurrency 1, 8 and 32 and 1 and 32 texts per request; ratios are taken within each round. Then
# perf/embed_itl.py: the ITL of 4 chat streams while 64 texts are embedded, --embedding-nice 10 and 0.
#
# Dev-only tools, built once outside the repo (none is committed, none is a dependency):
#   ST_VENV       a venv with torch (this machine's CPU file) and sentence-transformers:
#                 python3 -m venv $ST_VENV && $ST_VENV/bin/pip install torch==2.13.0 sentence-transformers
#   LLAMA_SRC     llama.cpp as vendored in llama-cpp-python's sdist (pip download --no-binary :all: --no-deps
#                 llama-cpp-python==0.3.36, unpacked: vendor/llama.cpp), llama-server built in $LLAMA_SRC/build
#                 (cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON
#                  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF && cmake --build build --target llama-server)
# Usage: ST_VENV=/tmp/st-venv LLAMA_SRC=/tmp/llama/vendor/llama.cpp perf/compare_embeddings.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/embeddings-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-1,8,32}
BATCH_SIZES=${BATCH_SIZES:-1,32}
ITL_ROUNDS=${ITL_ROUNDS:-3}
OURS_PORT=${OURS_PORT:-8031}
LLAMA_PORT=${LLAMA_PORT:-8032}
ST_PORT=${ST_PORT:-8033}
NICE0_PORT=${NICE0_PORT:-8034}
: "${ST_VENV:?set ST_VENV (see the header)}" "${LLAMA_SRC:?set LLAMA_SRC (see the header)}"
export ORTSERVE_CACHE_DIR=${ORTSERVE_CACHE_DIR:-$ROOT/.cache}
log() { echo "[compare_embeddings] $(date +%H:%M:%S) $*" >&2; }
mkdir -p "$OUT"

# 1. The sentence-transformers folder (from the pulled package) and llama.cpp's GGUF of it.
ST_FOLDER=$OUT/all-MiniLM-L6-v2
"$PY" -m tests.integration.embeddings.make_reference --unpack "$ST_FOLDER" > /dev/null
GGUF=$OUT/all-MiniLM-L6-v2-f32.gguf
PYTHONPATH=$LLAMA_SRC/gguf-py "$ST_VENV/bin/python" "$LLAMA_SRC/convert_hf_to_gguf.py" "$ST_FOLDER" \
  --outfile "$GGUF" --outtype f32 > "$OUT/convert.log" 2>&1
"$PY" -c 'from engine.builder import pull_model; pull_model("all-minilm-l6-v2", progress=False); pull_model(progress=False)'

source "$ROOT/perf/servers.sh"  # PIDS, stop_servers (on exit), wait_ready

# 2. The servers, side by side (idle ones cost nothing).
"$ROOT/.venv/bin/ortserve" serve --port "$OURS_PORT" --embedding-model all-minilm-l6-v2 --intra-op-threads "$THREADS" \
  --log-level warning > "$OUT/ortserve.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$OURS_PORT/v1" "${PIDS[-1]}"
# NOTE(bench): 32 slots of 256 tokens (the model's window) and a ubatch that holds a whole request's texts.
"$LLAMA_SRC/build/bin/llama-server" -m "$GGUF" --embeddings --pooling mean -t "$THREADS" -tb "$THREADS" \
  -c 8192 -np 32 -b 8192 -ub 8192 --port "$LLAMA_PORT" --host 127.0.0.1 > "$OUT/llamacpp.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$LLAMA_PORT/v1" "${PIDS[-1]}"
"$ST_VENV/bin/python" perf/st_server.py --model "$ST_FOLDER" --port "$ST_PORT" --threads "$THREADS" \
  > "$OUT/st.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$ST_PORT/v1" "${PIDS[-1]}"

# 3. Throughput, interleaved rounds.
log "throughput: $ROUNDS rounds, concurrency $CONCURRENCY, batch sizes $BATCH_SIZES"
"$ROOT/.venv/bin/ortserve" bench --scenario embeddings --url "http://127.0.0.1:$OURS_PORT/v1" --model all-minilm-l6-v2 \
  --peer-url "http://127.0.0.1:$LLAMA_PORT/v1" --peer-label llama.cpp \
  --peer-url "http://127.0.0.1:$ST_PORT/v1" --peer-label sentence-transformers \
  --rounds "$ROUNDS" --concurrency "$CONCURRENCY" --batch-sizes "$BATCH_SIZES" \
  --out "$OUT/embeddings.json" --plot "$OUT/embeddings.png" | tee "$OUT/embeddings.txt"
stop_servers; PIDS=()

# 4. Chat ITL while 64 texts are embedded: the default priority (nice 10) against the same priority as chat (0).
if [[ -n "${SKIP_ITL:-}" ]]; then log "results in $OUT (no ITL run: SKIP_ITL)"; exit 0; fi
"$ROOT/.venv/bin/ortserve" serve --port "$OURS_PORT" --embedding-model all-minilm-l6-v2 --intra-op-threads "$THREADS" \
  --log-level warning > "$OUT/ortserve.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$OURS_PORT/v1" "${PIDS[-1]}"
"$ROOT/.venv/bin/ortserve" serve --port "$NICE0_PORT" --embedding-model all-minilm-l6-v2 --intra-op-threads "$THREADS" \
  --embedding-nice 0 --log-level warning > "$OUT/ortserve-nice0.log" 2>&1 &
PIDS+=($!); wait_ready "http://127.0.0.1:$NICE0_PORT/v1" "${PIDS[-1]}"
"$PY" -m perf.embed_itl --url "nice10=http://127.0.0.1:$OURS_PORT/v1" --url "nice0=http://127.0.0.1:$NICE0_PORT/v1" \
  --rounds "$ITL_ROUNDS" --out "$OUT/embed_itl.json" --plot "$OUT/embed_itl.png" | tee "$OUT/embed_itl.txt"
log "results in $OUT"
