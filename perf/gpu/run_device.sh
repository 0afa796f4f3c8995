#!/usr/bin/env bash
# One call on the GPU machine (the device tool runs it in the repo root; results go to $OUT):
#   bash perf/gpu/run_device.sh [tests] [bench] [probe] [steps] [readback] [torch]   (default: tests bench)
# tests: the WebGPU device and engine tests; bench: engine decode tokens/s (bench_gpu); probe: step-time and
# correctness diagnostics (probe_step); steps: the 1B step breakdown only; readback: the logits readback
# variants (probe_readback); torch: the PyTorch reference.
# Needs .device/ (../shared/device/prepare.sh) carried along.
set -o pipefail
steps=${*:-tests bench}
source perf/gpu/env.sh  # the GPU set-up (LOCAL=1: a dry run here), OUT
if [[ " $steps " == *" tests "* ]]; then
  ORTSERVE_DEVICE_TESTS=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/integration/ep/test_webgpu_engine.py tests/integration/ep/test_webgpu_device.py 2>&1 | tee "$OUT/pytest_log.txt"
fi
if [[ " $steps " == *" bench "* ]]; then
  timeout 420 python3 -m perf.gpu.bench_gpu --out "$OUT" --deadline-s "${BENCH_DEADLINE_S:-300}" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_log.txt"
fi
if [[ " $steps " == *" probe "* ]]; then
  timeout 300 python3 -m perf.gpu.probe_step --out "$OUT" 2>&1 | tee "$OUT/probe_log.txt"
fi
if [[ " $steps " == *" steps "* ]]; then
  timeout 200 python3 -m perf.gpu.probe_step --out "$OUT" --only-steps 2>&1 | tee "$OUT/probe_log.txt"
fi
if [[ " $steps " == *" readback "* ]]; then
  timeout 240 python3 -m perf.gpu.probe_readback --out "$OUT" 2>&1 | tee "$OUT/readback_log.txt"
fi
if [[ " $steps " == *" torch "* ]]; then
  timeout "${TORCH_TIMEOUT_S:-400}" python3 -m perf.gpu.torch_ref --out "$OUT/torch_ref.json" \
    --deadline-s "${TORCH_DEADLINE_S:-360}" 2>&1 | tee "$OUT/torch_log.txt"
fi
