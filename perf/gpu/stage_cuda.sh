#!/usr/bin/env bash
# The CUDA staging call in parts, for a working tree that no longer leaves room for the whole onnxruntime-gpu
# bundle beside it (64 MiB a call). Here: `split -b 30000000 -d onnxruntime-gpu-sm90.tar.xz part-` in
# .device-cuda/ and `sha256sum` of the whole into .device-cuda/sha256. There, one call per part, back to back
# (a warm machine keeps /root between calls), carry [".device-cuda/part-NN", ".device-cuda/sha256"]:
#   bash perf/gpu/stage_cuda.sh
# The call whose part completes the bundle unpacks it into /root/ort-cuda, as .device-cuda/stage.sh does.
set -euo pipefail
mkdir -p /root/ort-cuda-parts
cp .device-cuda/part-* /root/ort-cuda-parts/
cat /root/ort-cuda-parts/part-* > /root/ort-cuda.tar.xz
if [ "$(sha256sum /root/ort-cuda.tar.xz | cut -c1-64)" != "$(cat .device-cuda/sha256)" ]; then
  echo "staged parts: $(ls /root/ort-cuda-parts | tr '\n' ' ')(incomplete; make the next part's call now)"
  exit 0
fi
rm -rf /root/ort-cuda && mkdir -p /root/ort-cuda
tar -C /root/ort-cuda -xJf /root/ort-cuda.tar.xz && rm -rf /root/ort-cuda.tar.xz /root/ort-cuda-parts
echo "staged onnxruntime-gpu in /root/ort-cuda ($(du -sh /root/ort-cuda | cut -f1)); make the run call now"
