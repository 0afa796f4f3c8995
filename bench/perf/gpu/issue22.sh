#!/usr/bin/env bash
# Issue 22's device figures in one call (after the CUDA staging call, .device-cuda/stage.sh), CUDA and WebGPU on
# the same machine. carry: .device/whl .device/setup-cuda.sh .device/gl .device/webgpu/onnxruntime_ep_webgpu-*.whl
#   bash bench/perf/gpu/issue22.sh [steps]  -> $OUT/issue22.tgz (one folder per step: serving.sh's results)
# cuda: tests + HTTP with the default placement (captured decode steps); cuda-rows: HTTP with --no-graph-capture
# (decode over the running rows); cuda-spec0: HTTP with --speculative-tokens 0; c64: 64 streams with the thread
# switch interval at 0.5 and 5 ms, and a py-spy profile of the server (py-spy's wheel in .device/whl); probe: the
# engine runner's step pieces on CUDA; cuda-plain: --speculative-tokens 0 and no logprobs in the requests; webgpu:
# tests + HTTP. Default: cuda cuda-spec0 cuda-plain webgpu.
set -o pipefail
source .device/setup-cuda.sh || exit 3
for f in .device/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/webgpu/onnxruntime_ep_webgpu-*.whl
ROOT=${OUT:-/tmp/ortserve_gpu_out}
steps=${*:-cuda cuda-spec0 cuda-plain webgpu}
summary() { grep -E "passed|failed" "$1/pytest_log.txt" 2>/dev/null | tail -n 2; grep -E "^\[|c=" "$1/run_log.txt" | head -n 20; }
if [[ " $steps " == *" cuda "* ]]; then
  mkdir -p "$ROOT/cuda"; OUT=$ROOT/cuda PROVIDER=cuda bash bench/perf/gpu/serving.sh tests http > "$ROOT/cuda/run_log.txt" 2>&1
  echo "== cuda"; summary "$ROOT/cuda"
fi
if [[ " $steps " == *" cuda-rows "* ]]; then
  mkdir -p "$ROOT/cuda-rows"
  OUT=$ROOT/cuda-rows PROVIDER=cuda SERVE_ARGS=--no-graph-capture bash bench/perf/gpu/serving.sh http \
    > "$ROOT/cuda-rows/run_log.txt" 2>&1
  echo "== cuda-rows"; summary "$ROOT/cuda-rows"
fi
if [[ " $steps " == *" cuda-spec0 "* ]]; then  # speculation off: every stream decodes one token per step
  mkdir -p "$ROOT/cuda-spec0"
  OUT=$ROOT/cuda-spec0 PROVIDER=cuda SERVE_ARGS="--speculative-tokens 0" bash bench/perf/gpu/serving.sh http \
    > "$ROOT/cuda-spec0/run_log.txt" 2>&1
  echo "== cuda-spec0"; summary "$ROOT/cuda-spec0"
fi
if [[ " $steps " == *" cuda-plain "* ]]; then  # speculation off and no logprobs: requests as most clients send them
  mkdir -p "$ROOT/cuda-plain"
  OUT=$ROOT/cuda-plain PROVIDER=cuda SERVE_ARGS="--speculative-tokens 0" EXTRA_BODY='{}' \
    bash bench/perf/gpu/serving.sh http > "$ROOT/cuda-plain/run_log.txt" 2>&1
  echo "== cuda-plain"; summary "$ROOT/cuda-plain"
fi
if [[ " $steps " == *" c64 "* ]]; then  # 64 streams: the switch interval A/B and a py-spy profile of the server
  mkdir -p "$ROOT/c64"
  c64() {  # c64 NAME REQUESTS WARMUP: one bench of 64 streams against the server on port 8199
    timeout 90 python3 -m server bench --url http://127.0.0.1:8199/v1 --endpoint completions --no-progress \
      --extra-body '{"logprobs": 0}' --prompt-tokens 25 --output-tokens 128 --concurrency 64 --num-requests "$2" \
      --warmup "$3" --out "$ROOT/c64/$1.json" 2>&1 | tail -n 1
  }
  for ms in 0.5 5; do
    setsid python3 -m server serve --model /tmp/ortserve-1b --provider cuda --max-model-len 1024 --max-batch 64 \
      --port 8199 --log-level warning --gil-switch-interval-ms $ms > "$ROOT/c64/server-$ms.log" 2>&1 &
    for _ in $(seq 240); do curl -sf http://127.0.0.1:8199/health >/dev/null && break; sleep 0.5; done
    pid=$(pgrep -f "port 8199" | head -n 1)
    c64 "warm-$ms" 64 1 > /dev/null
    spy=
    if [ "$ms" = 0.5 ]; then
      /tmp/site/bin/py-spy record -p "$pid" -d 6 -r 400 -f raw -o "$ROOT/c64/pyspy.txt" --nonblocking \
        > "$ROOT/c64/pyspy.log" 2>&1 &
      spy=$!
    fi
    echo "switch interval $ms ms: $(c64 "c64-$ms" 128 0)"
    [ -n "$spy" ] && wait "$spy"
    kill "$pid"; sleep 2; kill -9 "$pid" 2>/dev/null
  done
fi
if [[ " $steps " == *" probe "* ]]; then
  for b in 8 64; do
    timeout 120 python3 -m bench.perf.gpu.probe_buckets --model /tmp/ortserve-1b --provider cuda --max-batch $b \
      --repeat 5 --out "$ROOT/cuda/probe_buckets_b$b.json" 2>&1 | grep -A12 "prefill_ms\|decode_step_ms" | head -n 30
  done
fi
if [[ " $steps " == *" webgpu "* ]]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  mkdir -p "$ROOT/webgpu"; OUT=$ROOT/webgpu PROVIDER=webgpu bash bench/perf/gpu/serving.sh tests http \
    > "$ROOT/webgpu/run_log.txt" 2>&1
  echo "== webgpu"; summary "$ROOT/webgpu"
fi
cd "$ROOT" && tar czf issue22.tgz $(ls -d cuda cuda-rows cuda-spec0 cuda-plain c64 webgpu 2>/dev/null) \
  && rm -rf cuda cuda-rows cuda-spec0 cuda-plain c64 webgpu
