#!/usr/bin/env bash
# Issue 38 on the GPU machine: llama.cpp's llama-server built with CUDA for sm_90 from .peer/ (perf/gpu/peer_sources.sh)
# and the bench model both servers load, kept under /root/peer while the machine stays warm:
#   bash perf/gpu/llama_server.sh build    llama-server only (ninja, all cores; ~5 min) -> /root/peer/build/bin
#   bash perf/gpu/llama_server.sh model    the bench GGUF (perf/gpu/bench_gguf.py) -> /root/peer/bench-1b.gguf, and
#                                          its conversion (ortserve convert, float16) -> /root/peer/bench-1b
#   bash perf/gpu/llama_server.sh synthetic  build_synthetic's 1B shape (serving.sh's) -> /tmp/ortserve-1b
#   bash perf/gpu/llama_server.sh start    all three (JOBS= picks), detached; never copy a new script over a running job's (setsid), so they go on into the next calls; logs and a
#                                          'done' file per job in /root/peer
# carry [".peer"] (and the CUDA staging part, perf/gpu/stage_cuda.sh, in the same call).
set -uo pipefail
P=/root/peer
mkdir -p $P
job=${1:-start}
case $job in
build)
  rm -rf $P/src && mkdir -p $P/src && tar -C $P/src -xJf .peer/llama.cpp-src.tar.xz
  nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -n 1)
  [ -n "$nvcc" ] || { echo "no nvcc" ; exit 2; }
  t0=$(date +%s)
  cmake -S $P/src/llama.cpp -B $P/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF && cmake --build $P/build --target llama-server -j "$(nproc)" || exit 1
  echo "built llama-server in $(( $(date +%s) - t0 )) s"; $P/build/bin/llama-server --version 2>&1 | tail -n 2
  ;;
model)  # the bench GGUF, its untied variant and its offset-code variant (drafts hit), each converted
  t0=$(date +%s)
  xz -dc .peer/ggml-vocab-llama-bpe.gguf.xz > $P/vocab.gguf
  for v in "" "-untied" "-offset"; do  # (see bench_gguf.py: -offset's drafts always hit, the others' miss)
    PYTHONPATH=$PWD/.peer/gguf-py:$PWD python3 -m perf.gpu.bench_gguf --vocab $P/vocab.gguf \
      --out $P/bench-1b$v.gguf $([ "$v" = -untied ] && echo --untied) $([ "$v" = -offset ] && echo --offset-codes) \
      || exit 1
    # `ortserve convert` (server/__main__.py) needs the project's wheels (setup-cuda.sh); before them, its function
    if python3 -c "import pydantic" 2>/dev/null; then
      python3 -m server convert $P/bench-1b$v.gguf $P/bench-1b$v --dtype float16 --overwrite --quiet || exit 1
    else
      PYTHONPATH=$PWD/.peer/gguf-py:$PWD python3 -c "import sys; from engine.builder import convert_gguf
convert_gguf(sys.argv[1], sys.argv[2], accuracy_level=4, dtype='float16', overwrite=True, progress=False)" \
        $P/bench-1b$v.gguf $P/bench-1b$v || exit 1
    fi
  done
  echo "bench models in $(( $(date +%s) - t0 )) s"
  ;;
synthetic)  # build_synthetic's 1B shape as serving.sh makes it (non-finite fp16 logits), for the speculation A/B
  PYTHONPATH=$PWD/.peer/gguf-py:$PWD python3 - <<'PY' || exit 1
from pathlib import Path
from perf.gpu.shapes import SHAPES
from engine.builder import SyntheticSpec, build_synthetic
spec = SyntheticSpec(**SHAPES["llama-3.2-1b"], max_length=1024, quant="int4", dtype="float16", seed=0)
build_synthetic(Path("/tmp/ortserve-1b"), spec, accuracy_level=4)
PY
  ;;
start)
  rm -rf $P/tree && mkdir -p $P/tree && cp -a perf engine ep server bench .peer pyproject.toml $P/tree/
  for j in ${JOBS:-model build synthetic}; do
    rm -f $P/$j.done
    (cd $P/tree && setsid bash -c "bash perf/gpu/llama_server.sh $j > $P/$j.log 2>&1; echo \$? > $P/$j.done" \
      < /dev/null > /dev/null 2>&1 &)
  done
  echo "started model and build in the background: $P/{model,build}.log"
  ;;
wait)  # wait for the jobs (at most ${2:-420} s), then show how they ended
  for _ in $(seq "${2:-420}"); do [ -f $P/model.done ] && [ -f $P/build.done ] && break; sleep 1; done  # (a job not started counts as running)
  for j in model build synthetic; do echo "== $j: rc $(cat $P/$j.done 2>/dev/null || echo running)"; tail -n 4 $P/$j.log; done
  ;;
esac
