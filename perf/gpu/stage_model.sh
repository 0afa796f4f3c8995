#!/usr/bin/env bash
# The real Qwen2.5-Coder-1.5B Q4_K_M GGUF (1.1 GB) onto the GPU machine, which reaches nothing outside it, in parts
# that fit the 64 MiB a call carries (as stage_cuda.sh stages onnxruntime-gpu):
#   here:   bash perf/gpu/stage_model.sh split      the cached GGUF (ortserve's own fetch, sha256-checked) cut into
#                                                   .device-model/part-NN (git-ignored) and its sha256
#   there:  bash perf/gpu/stage_model.sh            one call per part, back to back on a warm machine, carry
#                                                   [".device-model/part-NN", ".device-model/sha256"]: each call adds
#                                                   its part under /root/peer/model-parts
#   there:  bash perf/gpu/stage_model.sh assemble   the parts joined into /root/peer/<file>.gguf once all are there
#                                                   (issue45.sh coder calls it)
set -euo pipefail
P=${PEER_DIR:-/root/peer}
NAME=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
case ${1:-add} in
split)
  root=$(git rev-parse --show-toplevel); cd "$root"
  grep -qx "/.device-model/" .git/info/exclude 2>/dev/null || echo "/.device-model/" >> .git/info/exclude
  gguf=$(.venv/bin/python -c 'from engine.builder.pull import fetch_gguf, model_cache_dir
print(fetch_gguf("qwen2.5-coder-1.5b", model_cache_dir() / "gguf", progress=False))')
  rm -rf .device-model && mkdir -p .device-model
  split -b 44000000 -d "$gguf" .device-model/part-  # (a call carries 64 MiB with the ~20 MB tree)
  sha256sum "$gguf" | cut -c1-64 > .device-model/sha256
  echo "$(ls .device-model | grep -c part-) parts of $gguf in .device-model: one device call each"
  ;;
add)
  mkdir -p $P/model-parts
  cp .device-model/part-* .device-model/sha256 $P/model-parts/
  echo "staged parts: $(ls $P/model-parts | tr '\n' ' ')"
  ;;
assemble)
  cat $P/model-parts/part-* > $P/$NAME.tmp
  if [ "$(sha256sum $P/$NAME.tmp | cut -c1-64)" != "$(cat $P/model-parts/sha256)" ]; then
    echo "the staged parts do not make the whole file yet ($(ls $P/model-parts | wc -l) parts)"; rm -f $P/$NAME.tmp; exit 1
  fi
  mv $P/$NAME.tmp $P/$NAME && rm -rf $P/model-parts && echo "assembled $P/$NAME"
  ;;
esac
