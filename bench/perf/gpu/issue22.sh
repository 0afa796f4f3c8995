#!/usr/bin/env bash
# Issue 22's device figures in one call (after the CUDA staging call, .device-cuda/stage.sh), CUDA and WebGPU on
# the same machine. carry: .device/whl .device/setup-cuda.sh .device/gl .device/webgpu/onnxruntime_ep_webgpu-*.whl
#   bash bench/perf/gpu/issue22.sh          -> $OUT/issue22.tgz (cuda/, cuda-rows/, webgpu/: serving.sh's results)
# cuda: tests + HTTP with the default placement (captured decode steps); cuda-rows: HTTP with --no-graph-capture
# (decode over the running rows); probe: the engine runner's step pieces on CUDA; webgpu: tests + HTTP.
set -o pipefail
source .device/setup-cuda.sh || exit 3
for f in .device/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/webgpu/onnxruntime_ep_webgpu-*.whl
ROOT=${OUT:-/tmp/ortserve_gpu_out}
steps=${*:-cuda cuda-rows probe webgpu}
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
cd "$ROOT" && tar czf issue22.tgz $(ls -d cuda cuda-rows webgpu 2>/dev/null) && rm -rf cuda cuda-rows webgpu
