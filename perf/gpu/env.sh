# Sourced by the GPU-machine scripts here: the WebGPU set-up (.device/setup.sh once, then what a warm machine
# keeps), or nothing but PYTHONPATH for a dry run on this machine (LOCAL=1). Sets OUT (made) as well.
if [ -n "${LOCAL:-}" ]; then
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
elif [ "${PROVIDER:-webgpu}" = cuda ]; then
  [ -d /root/ort-cuda/onnxruntime ] || { echo "PROVIDER=cuda: source .device/setup-cuda.sh first" >&2; exit 3; }
elif [ -d /tmp/site/onnxruntime_ep_webgpu ]; then  # a warm machine keeps what setup.sh installed
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
else
  source .device/setup.sh
fi
OUT=${OUT:-/tmp/ortserve_gpu_out}
mkdir -p "$OUT"
