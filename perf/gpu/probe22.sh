#!/usr/bin/env bash
# Issue 22's device probes in one call, CUDA and WebGPU on the same machine (run after the CUDA staging call):
#   source .device/setup-cuda.sh; bash perf/gpu/probe22.sh [cuda] [copy] [split] [buckets]  (default: the first three)
# carry: .device/whl .device/setup-cuda.sh .device/gl .device/webgpu/onnxruntime_ep_webgpu-*.whl
# cuda: bare CUDA EP steps with KV rows bound by address (probe_cuda); copy: WebGPU row-copy graphs (probe_copy);
# split: WebGPU decode per bucket with and without the MatMulNBits row split (probe_buckets --row-groups); buckets: the
# CUDA runner at 64 slots with and without a busy Python thread beside it (--gil-load), and WebGPU's first runs of a
# chunk length with fixed chunk shapes off and on.
set -o pipefail
steps=${*:-cuda copy split}
OUT=${OUT:-/tmp/ortserve_gpu_out}; mkdir -p "$OUT"
LOG="$OUT/probe22_log.txt"
MODEL=${MODEL_DIR:-/tmp/ortserve-1b}
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
if compgen -G ".device/webgpu/onnxruntime_ep_webgpu-*.whl" >/dev/null; then  # the WebGPU plugin beside onnxruntime-gpu
  for f in .device/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .device/webgpu/onnxruntime_ep_webgpu-*.whl 2>&1 | tail -n 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee -a "$LOG"
if [ ! -f "$MODEL/genai_config.json" ]; then
  log "building the synthetic llama-3.2-1b shape into $MODEL"
  python3 - "$MODEL" <<'PY' 2>&1 | tail -n 3 | tee -a "$LOG"
import sys
from pathlib import Path
from perf.gpu.shapes import SHAPES
from engine.builder import SyntheticSpec, build_synthetic
spec = SyntheticSpec(**SHAPES["llama-3.2-1b"], max_length=1024, quant="int4", dtype="float16", seed=0)
build_synthetic(Path(sys.argv[1]), spec, accuracy_level=4)
PY
fi
python3 -m server devices 2>&1 | head -n 30 | tee -a "$LOG"
if [[ " $steps " == *" cuda "* ]]; then
  log "probe_cuda"
  timeout 240 python3 -m perf.gpu.probe_cuda --model "$MODEL" --out "$OUT/probe_cuda.json" 2>&1 \
    | grep -v '^ \|^[{}]$' | tail -n 40 | tee -a "$LOG"
fi
if [[ " $steps " == *" copy "* ]]; then
  log "probe_copy"
  timeout 180 python3 -m perf.gpu.probe_copy --provider webgpu --out "$OUT/probe_copy.json" 2>&1 \
    | grep -v '^ \|^[{}]$' | tail -n 20 | tee -a "$LOG"
fi
if [[ " $steps " == *" split "* ]]; then
  for spec in "8 0" "8 2" "64 2"; do
    set -- $spec
    log "probe_buckets --max-batch $1 --row-groups $2"
    timeout 200 python3 -m perf.gpu.probe_buckets --model "$MODEL" --provider webgpu --max-batch "$1" \
      --row-groups "$2" --repeat 3 --out "$OUT/probe_b$1_g$2.json" 2>&1 | grep -A12 decode_step_ms | tee -a "$LOG"
  done
fi
if [[ " $steps " == *" buckets "* ]]; then
  log "probe_buckets cuda --max-batch 64 --gil-load"
  timeout 240 python3 -m perf.gpu.probe_buckets --model "$MODEL" --provider cuda --max-batch 64 --repeat 5 \
    --gil-load --out "$OUT/probe_cuda_b64.json" 2>&1 | grep -v '^ *"[0-9]*": [0-9.]*,\?$' | tail -n 40 | tee -a "$LOG"
  for fixed in off on; do
    log "probe_buckets webgpu --max-batch 8 --fixed-chunk-shapes $fixed"
    timeout 240 python3 -m perf.gpu.probe_buckets --model "$MODEL" --provider webgpu --max-batch 8 --repeat 3 \
      --fixed-chunk-shapes $fixed --out "$OUT/probe_webgpu_b8_fixed_$fixed.json" 2>&1 | tail -n 60 | tee -a "$LOG"
  done
fi
log "done"
