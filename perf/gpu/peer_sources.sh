#!/usr/bin/env bash
# Here (no device time): fills .peer/ (git-ignored) with what the GPU machine needs for issue 38's peer comparison,
# from the llama.cpp sources vendored in llama-cpp-python's sdist:
#   .peer/llama.cpp-src.tar.xz   llama.cpp pruned to what a CUDA llama-server build reads (~4 MB: no models, docs,
#                                tests, examples, other backends, web UI sources)
#   .peer/ggml-vocab-llama-bpe.gguf.xz   the Llama 3 vocabulary (tokenizer fields only), for perf/gpu/bench_gguf.py
#   .peer/ggml-vocab-qwen2.gguf.xz       the Qwen2 vocabulary (issue 45's Qwen2.5-7B/32B shapes)
#   .peer/gguf-py/               gguf-py from the same tree (writes the bench GGUF)
# Then carry [".peer", ...] in the device call: perf/gpu/llama_server.sh builds and serves from it.
# Usage, from the project root: bash perf/gpu/peer_sources.sh [LLAMA_CPP_PYTHON_VERSION]
set -euo pipefail
version=${1:-0.3.36}
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx "/.peer/" .git/info/exclude 2>/dev/null || echo "/.peer/" >> .git/info/exclude
w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: -d "$w" "llama-cpp-python==$version"
tar -xzf "$w"/llama_cpp_python-*.tar.gz -C "$w" --wildcards '*/vendor/llama.cpp/*'
src=$(echo "$w"/llama_cpp_python-*/vendor/llama.cpp)
mkdir -p .peer && rm -rf .peer/gguf-py
xz -9 -c "$src/models/ggml-vocab-llama-bpe.gguf" > .peer/ggml-vocab-llama-bpe.gguf.xz
xz -9 -c "$src/models/ggml-vocab-qwen2.gguf" > .peer/ggml-vocab-qwen2.gguf.xz
cp -a "$src/gguf-py" .peer/gguf-py
cd "$src"
rm -rf docs models media benches tests examples pocs conversion gguf-py app ci skills requirements ./*.py flake.nix
(cd ggml/src && rm -rf ggml-cann ggml-et ggml-hexagon ggml-metal ggml-opencl ggml-openvino ggml-sycl ggml-virtgpu \
   ggml-vulkan ggml-webgpu ggml-zdnn ggml-zendnn)
(cd tools/ui && rm -rf src tests static package-lock.json scripts)  # the server embeds no UI (LLAMA_BUILD_UI=OFF)
(cd scripts && find . -type f ! -name "*.cmake" -delete)
find . -name "*.md" -delete
cd .. && tar -cf - llama.cpp | xz -9 -T2 > "$root/.peer/llama.cpp-src.tar.xz"
du -sh "$root/.peer"/*
