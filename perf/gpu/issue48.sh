#!/usr/bin/env bash
# Issue 48 on the GPU machine (CUDA, H100/H200): bench/speculative.sh's four servers (ortserve --draft-model, ortserve
# drafts off, llama-server -md, llama-server alone) on the planted pair of perf/gpu/draft_pair.py, written there in
# seconds: Qwen2.5-1.5B and 0.5B shapes, Q4_K_M layers, the Qwen2 vocabulary, a draft that agrees after a known
# fraction of token ids (0.7, and 0: drafts that never pay). The real pair's acceptance is measured on the CPU
# (docs/perf/speculative.md); this measures the machinery at a known one.
#
# Here, once (no device time): bash ../shared/device/prepare.sh --cuda; bash perf/gpu/peer_sources.sh;
# bash perf/gpu/extra_wheels.sh; in .device-cuda: split -b 30000000 -d onnxruntime-gpu-sm90.tar.xz part- and
# sha256sum of the whole into .device-cuda/sha256. There, three calls back to back (a machine stays warm 30 s):
#   1. carry [".device-cuda/part-00", ".device-cuda/sha256", ".peer"]:
#        bash perf/gpu/stage_cuda.sh; bash perf/gpu/issue48.sh start        (llama-server's build and the pair, detached)
#   2. carry [".device-cuda/part-01", ".device-cuda/sha256", ".device/whl2"]:
#        bash perf/gpu/stage_cuda.sh; bash perf/gpu/issue48.sh extra
#   3. carry [".device/whl", ".device/setup-cuda.sh"]:
#        source .device/setup-cuda.sh; bash perf/gpu/issue48.sh smoke wait   (ortserve alone while llama-server builds)
#   4. the same carry: source .device/setup-cuda.sh; AGREE=70 bash perf/gpu/issue48.sh bench  -> $OUT
#   5. the same carry: source .device/setup-cuda.sh; AGREE=0 bash perf/gpu/issue48.sh bench
# NO_LLAMA=1 (start): no llama-server build; the bench then runs ortserve's two servers alone.
# Steps: start, extra (the server's wheels beyond .device/whl, kept in /root/peer/whl2), smoke (ortserve alone on the
# pair: three greedy answers, its draft counters), wait (WAIT_S, default 420), bench (AGREE, default "70 0": one
# bench/speculative.sh per draft; CELLS_<agree> overrides its cells).
set -o pipefail
steps=${*:-wait bench}
OUT=${OUT:-/tmp/issue48_out}; mkdir -p "$OUT"
P=${PEER_DIR:-/root/peer}; mkdir -p "$P"
LOG=$OUT/run_log.txt
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
has() { [[ " $steps " == *" $1 "* ]]; }

if has start; then
  if [ -n "${NO_LLAMA:-}" ]; then echo 0 > "$P/build.done"; echo "(not built: NO_LLAMA)" > "$P/build.log"
  else bash perf/gpu/issue45.sh build > /dev/null; fi  # llama-server's CUDA build, detached ($P/build.{log,done})
  rm -rf "$P/tree-pair" && mkdir -p "$P/tree-pair" && cp -a perf engine .peer "$P/tree-pair/" && rm -f "$P/pair.done"
  (cd "$P/tree-pair" && setsid bash -c "{ xz -dc .peer/ggml-vocab-qwen2.gguf.xz > $P/vocab-qwen2.gguf && \
    PYTHONPATH=\$PWD/.peer/gguf-py:\$PWD python3 -m perf.gpu.draft_pair --vocab $P/vocab-qwen2.gguf \
      --out-dir $P/pair --agree ${AGREE_FRACTIONS:-0.7 0}; } > $P/pair.log 2>&1; echo \$? > $P/pair.done" \
    < /dev/null > /dev/null 2>&1 &)
  log "started: llama-server's build ($P/build.log), the planted pair ($P/pair.log)"
fi
if has extra; then
  mkdir -p "$P/whl2" && cp .device/whl2/*.whl "$P/whl2/" && log "kept $(ls "$P/whl2" | wc -l) wheels in $P/whl2"
fi
if has wait; then
  for _ in $(seq "${WAIT_S:-420}"); do [ -f "$P/build.done" ] && [ -f "$P/pair.done" ] && break; sleep 1; done
  for j in build pair; do log "$j: rc $(cat "$P/$j.done" 2>/dev/null || echo running)"; tail -n 3 "$P/$j.log" | tee -a "$LOG"; done
  [ "$(cat "$P/build.done" 2>/dev/null)" = 0 ] && [ "$(cat "$P/pair.done" 2>/dev/null)" = 0 ] || exit 1
fi
if has smoke || has bench; then
  [ -d /root/ort-cuda/onnxruntime ] || { log "source .device/setup-cuda.sh first"; exit 3; }
  if [ -d "$P/whl2" ] && ! [ -d /tmp/site/sqlalchemy ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$P"/whl2/*.whl 2>&1 | grep -v WARNING
  fi
fi
if has smoke; then  # ortserve alone on the pair (converts both files into the bench's cache): one greedy answer
  for _ in $(seq "${WAIT_S:-420}"); do [ -f "$P/pair.done" ] && break; sleep 1; done
  ORTSERVE_CACHE_DIR="$P/cache" setsid python3 -m server serve --model "$P/pair/target.gguf" --provider cuda \
    --draft-model "$P/pair/draft-a${SMOKE_AGREE:-70}.gguf" --max-model-len 2048 --max-batch 4 --port 8090 \
    > "$P/smoke.log" 2>&1 < /dev/null &
  pid=$!
  for _ in $(seq 600); do curl -sf localhost:8090/v1/models > /dev/null && break; kill -0 $pid || break; sleep 0.5; done
  for i in 1 2 3; do
    curl -s localhost:8090/v1/completions -H 'content-type: application/json' -d '{"prompt": "def f(x):\n",
      "max_tokens": 128, "temperature": 0, "stream": false}' -o "$P/smoke-$i.json" -w "answer $i: %{time_total} s\n" \
      | tee -a "$LOG"
  done
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('text', repr(d['choices'][0]['text'][:80]), d['usage'])" \
    "$P/smoke-3.json" 2>&1 | tee -a "$LOG"
  curl -s localhost:8090/metrics | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' | tee -a "$LOG"
  grep -E "model dtype|draft|memory:" "$P/smoke.log" | cut -c1-300 | tail -n 8 | tee -a "$LOG"
  kill $pid; wait $pid 2>/dev/null
fi
if has bench; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
  for a in ${AGREE:-70 0}; do
    cells_var=CELLS_$a
    # default cells: every workload, temperature and stream count with 0.7; the floor (0) at temperature 0 only
    cells=${!cells_var:-$([ "$a" = 0 ] && echo "TEMPERATURES=0 ROUNDS=1" || echo "ROUNDS=2")}
    log "pair a$a: $cells"
    # shellcheck disable=SC2086
    env $cells OUT="$P/r-a$a" PROVIDER=cuda THREADS=8 LOCK=/tmp/bench.lock ORTSERVE="python3 -m server" PY=python3 \
      ORTSERVE_CACHE_DIR="$P/cache" LLAMA_SERVER="$([ -x "$P/build/bin/llama-server" ] && echo "$P/build/bin/llama-server" || echo none)" LLAMA_ARGS="-ngl 99" \
      LLAMA_DRAFT_ARGS="-ngld 99" TARGET_GGUF="$P/pair/target.gguf" DRAFT_GGUF="$P/pair/draft-a$a.gguf" \
      timeout "${BENCH_S:-420}" bash bench/speculative.sh 2>&1 | tail -n 40 | tee -a "$LOG"
    for f in report.json speculative.png; do cp "$P/r-a$a/$f" "$OUT/a$a-$f" 2>/dev/null; done  # (8 files come back)
  done
  tar -czf "$OUT/logs.tar.gz" -C "$P" $(cd "$P" && ls -d r-a* 2>/dev/null) pair.log build.log 2>/dev/null
fi
