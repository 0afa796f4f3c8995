#!/usr/bin/env bash
# Issue 22's device figures in one call (after the CUDA staging call, .device-cuda/stage.sh), CUDA and WebGPU on
# the same machine. carry: .device/whl .device/setup-cuda.sh .device/gl .device/webgpu/onnxruntime_ep_webgpu-*.whl
#   bash perf/gpu/issue22.sh [steps]  -> $OUT/issue22.tgz (one folder per step: serving.sh's results)
# cuda: tests + HTTP with the default placement (captured decode steps); cuda-rows: HTTP with --no-graph-capture
# (decode over the running rows); cuda-spec0: HTTP with --speculative-tokens 0; c64: 64 streams with the thread
# switch interval at 0.5 and 5 ms, and a py-spy profile of the server (py-spy's wheel in .device/whl); probe: the
# engine runner's step pieces on CUDA; cuda-plain: --speculative-tokens 0 and no logprobs in the requests; webgpu:
# tests + HTTP; fpa: the runner's decode steps with --cuda-int4-gemm off and on (the CUDA EP's fused INT4
# GEMV/GEMM for MatMulNBits); phases: the engine thread's time per step phase (/metrics). C64_BODY replaces c64's request fields ('{}': no logprobs). Default: cuda cuda-spec0
# cuda-plain webgpu.
set -o pipefail
source .device/setup-cuda.sh || exit 3
for f in .device/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/webgpu/onnxruntime_ep_webgpu-*.whl
ROOT=${OUT:-/tmp/ortserve_gpu_out}
steps=${*:-cuda cuda-spec0 cuda-plain webgpu}
if [[ " $steps " == *" probe "* || " $steps " == *" fpa "* || " $steps " == *" c64 "* || " $steps " == *" phases "* ]] \
    && [ ! -f /tmp/ortserve-1b/genai_config.json ]; then  # the other steps build it through serving.sh
  OUT=$ROOT/build PROVIDER=cuda bash perf/gpu/serving.sh build > /dev/null 2>&1; rm -rf "$ROOT/build"
fi
summary() { grep -E "passed|failed" "$1/pytest_log.txt" 2>/dev/null | tail -n 2; grep -E "^\[|c=" "$1/run_log.txt" | head -n 20; }
if [[ " $steps " == *" cuda "* ]]; then
  mkdir -p "$ROOT/cuda"; OUT=$ROOT/cuda PROVIDER=cuda bash perf/gpu/serving.sh tests http > "$ROOT/cuda/run_log.txt" 2>&1
  echo "== cuda"; summary "$ROOT/cuda"
fi
if [[ " $steps " == *" cuda-rows "* ]]; then
  mkdir -p "$ROOT/cuda-rows"
  OUT=$ROOT/cuda-rows PROVIDER=cuda SERVE_ARGS=--no-graph-capture bash perf/gpu/serving.sh http \
    > "$ROOT/cuda-rows/run_log.txt" 2>&1
  echo "== cuda-rows"; summary "$ROOT/cuda-rows"
fi
if [[ " $steps " == *" cuda-spec0 "* ]]; then  # speculation off: every stream decodes one token per step
  mkdir -p "$ROOT/cuda-spec0"
  OUT=$ROOT/cuda-spec0 PROVIDER=cuda SERVE_ARGS="--speculative-tokens 0" bash perf/gpu/serving.sh http \
    > "$ROOT/cuda-spec0/run_log.txt" 2>&1
  echo "== cuda-spec0"; summary "$ROOT/cuda-spec0"; grep -A4 "gaps:" "$ROOT/cuda-spec0/run_log.txt" | cut -c1-200 | head -n 30
fi
if [[ " $steps " == *" cuda-plain "* ]]; then  # speculation off and no logprobs: requests as most clients send them
  mkdir -p "$ROOT/cuda-plain"
  OUT=$ROOT/cuda-plain PROVIDER=cuda SERVE_ARGS="--speculative-tokens 0" EXTRA_BODY='{}' \
    bash perf/gpu/serving.sh http > "$ROOT/cuda-plain/run_log.txt" 2>&1
  echo "== cuda-plain"; summary "$ROOT/cuda-plain"
fi
if [[ " $steps " == *" c64 "* ]]; then  # 64 streams: the switch interval A/B and a py-spy profile of the server
  mkdir -p "$ROOT/c64"
  c64() {  # c64 NAME REQUESTS WARMUP: one bench of 64 streams against the server on port 8199
    timeout 90 python3 -m server bench --url http://127.0.0.1:8199/v1 --endpoint completions --no-progress \
      --extra-body "${C64_BODY:-{\"logprobs\": 0\}}" --prompt-tokens 25 --output-tokens 128 --concurrency 64 --num-requests "$2" \
      --warmup "$3" --out "$ROOT/c64/$1.json" 2>&1 | tail -n 1
  }
  for ms in ${C64_MS:-0.5 5}; do
    setsid python3 -m server serve --model /tmp/ortserve-1b --provider cuda --max-model-len 1024 --max-batch 64 \
      --port 8199 --log-level warning --gil-switch-interval-ms $ms ${C64_ARGS:-} > "$ROOT/c64/server-$ms.log" 2>&1 &
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
    timeout 120 python3 -m perf.gpu.probe_buckets --model /tmp/ortserve-1b --provider cuda --max-batch $b \
      --repeat 5 --out "$ROOT/cuda/probe_buckets_b$b.json" 2>&1 | grep -A12 "prefill_ms\|decode_step_ms" | head -n 30
  done
fi
if [[ " $steps " == *" fpa "* ]]; then  # MatMulNBits' fused INT4 kernels (read when a session is made)
  mkdir -p "$ROOT/fpa"
  for v in off on; do for b in ${FPA_BATCHES:-8 64}; do
    echo "== --cuda-int4-gemm $v --max-batch $b ${FPA_ENV:-}"
    env ${FPA_ENV:-} timeout 150 python3 -m perf.gpu.probe_buckets --model /tmp/ortserve-1b --provider cuda \
      --max-batch $b --repeat 5 --cuda-int4-gemm $v --out "$ROOT/fpa/probe_b${b}_$v.json" 2>&1 \
      | grep -A12 "unseen_chunk\|decode_step_ms" | grep -v prefill | head -n 40
  done; done
fi
if [[ " $steps " == *" phases "* ]]; then  # the engine thread's time per step phase (/metrics), c streams on b slots
  mkdir -p "$ROOT/phases"
  for spec in ${PHASE_SPECS:-1x1 8x1 8x8 64x64}; do  # slots x streams
    set -- ${spec/x/ }; port=$((8300 + $1)); tag=b$1-c$2; streams=$2
    setsid python3 -m server serve --model /tmp/ortserve-1b --provider cuda --max-model-len 1024 --max-batch $1 \
      --port $port --log-level warning --speculative-tokens 0 ${PHASE_ARGS:-} > "$ROOT/phases/server-$tag.log" 2>&1 &
    spid=$!
    for _ in $(seq 240); do
      curl -sf http://127.0.0.1:$port/health >/dev/null && break
      kill -0 $spid 2>/dev/null || { echo "$tag: server died"; tail -n 3 "$ROOT/phases/server-$tag.log"; break; }
      sleep 0.5
    done
    pb() {  # pb N: N requests of $streams streams
      timeout 120 python3 -m server bench --url http://127.0.0.1:$port/v1 --endpoint completions --no-progress \
        --extra-body "${C64_BODY:-{\"logprobs\": 0\}}" --prompt-tokens 25 --output-tokens 128 \
        --concurrency $streams --num-requests "$1" --warmup 0 --out "$ROOT/phases/$tag.json" 2>&1 | tail -n 1
    }
    pb $streams > /dev/null
    curl -s http://127.0.0.1:$port/metrics > "$ROOT/phases/before.txt"
    echo "$tag: $(pb $(( streams * 4 > 8 ? streams * 4 : 8 )))"
    curl -s http://127.0.0.1:$port/metrics > "$ROOT/phases/after.txt"
    python3 -m perf.gpu.phases "$ROOT/phases/before.txt" "$ROOT/phases/after.txt" --out "$ROOT/phases/$tag-phases.json"
    pkill -f "port $port" ; sleep 2; pkill -9 -f "port $port"
  done
  rm -f "$ROOT/phases/before.txt" "$ROOT/phases/after.txt"
fi
for step in webgpu webgpu-http; do  # webgpu: tests + HTTP; webgpu-http: HTTP only
  [[ " $steps " == *" $step "* ]] || continue
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  parts="tests http"; [ $step = webgpu-http ] && parts=http
  mkdir -p "$ROOT/webgpu"; OUT=$ROOT/webgpu PROVIDER=webgpu bash perf/gpu/serving.sh $parts \
    > "$ROOT/webgpu/run_log.txt" 2>&1
  echo "== $step"; summary "$ROOT/webgpu"; grep -A4 "gaps:" "$ROOT/webgpu/run_log.txt" | cut -c1-200 | head -n 40
done
cd "$ROOT" && tar czf issue22.tgz $(ls -d cuda cuda-rows cuda-spec0 cuda-plain c64 fpa phases webgpu 2>/dev/null) \
  && rm -rf cuda cuda-rows cuda-spec0 cuda-plain c64 fpa phases webgpu
