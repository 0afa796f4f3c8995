#!/usr/bin/env bash
# Issue 45's device figures (CUDA, H200): ortserve against llama.cpp's CUDA llama-server at the sizes people run, on the
# same files, through HTTP with `ortserve bench` (the openai client, /v1/completions streamed). docs/perf/sizes.md has
# the exact calls (which carry, which order, how many device minutes each takes); in short, after the CUDA staging
# calls (perf/gpu/stage_cuda.sh) and, for the real 1.5B, perf/gpu/stage_model.sh's parts; carry [".device/whl",
# ".device/setup-cuda.sh", ".peer"]:
#   source .device/setup-cuda.sh; bash perf/gpu/issue45.sh start                     (detached jobs: build, model-8b)
#   source .device/setup-cuda.sh; bash perf/gpu/issue45.sh wait peer-8b summarize    -> $OUT/issue45.json
#   source .device/setup-cuda.sh; bash perf/gpu/issue45.sh clean-8b start-32b        (disk: 64 GiB holds one size)
#   source .device/setup-cuda.sh; bash perf/gpu/issue45.sh wait peer-32b summarize
#   source .device/setup-cuda.sh; bash perf/gpu/issue45.sh coder summarize           (the real Qwen2.5-Coder-1.5B)
# Steps:
#   build               llama-server's CUDA build alone, detached (the coder session's first call)
#   start / start-32b   detached jobs (setsid; they outlive the call): llama-server's CUDA build (llama_server.sh
#                       build) and the bench GGUF of that size (perf/gpu/bench_gguf.py, Q4_K_M, the family's real
#                       vocabulary from .peer) converted by `ortserve convert` (float16; perf/gpu/timed.py: wall and
#                       peak RSS); `wait` waits for them (at most WAIT_S, default 540 s)
#   peer-8b / peer-32b  both servers on that file, one at a time: 1, 8 and 64 streams (ours with drafts off,
#                       --speculative-tokens 0, and on, the default); TTFT of a 2,000-token prompt idle and beside 7
#                       streams (the largest inter-token gap of the 7 while the prompt arrives); GPU memory used
#                       (nvidia-smi) and the KV budget ortserve chose (its start-up line)
#                       (SKIP_PEER=1 / SKIP_OURS=1: one server only; MODES also no1row, nogemm: drafts off
#                       and --no-one-row-session or --no-cuda-int4-gemm)
#   coder               the real Qwen2.5-Coder-1.5B Q4_K_M (staged by stage_model.sh): `ortserve serve --model
#                       qwen2.5-coder-1.5b` with no dtype flag must say float16; code-editing prompts (bench --scenario
#                       copy: real code, so prompt-lookup drafts hit) drafts off/on against llama-server; teacher-forced
#                       top-1 agreement with llama-server on the same file (perf/gpu/top1.py, target >= 95%);
#                       CODER_TOP1_ONLY=1: the no-flag float16 start and the top-1 alone
#   summarize           every r-*.json into $OUT/issue45.json (merged with what it held), the servers' logs into
#                       $OUT/servers.log
set -o pipefail
steps=${*:-start wait peer-8b summarize}
OUT=${OUT:-/tmp/issue45_out}; mkdir -p "$OUT"
LOG=$OUT/run_log.txt
P=${PEER_DIR:-/root/peer}
mkdir -p "$P"
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
has() { [[ " $steps " == *" $1 "* ]]; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }  # seconds since $1 (no bc there)
if [ -d .device/whl2 ] && [ -d /tmp/site ] && ! [ -d /tmp/site/sqlalchemy ]; then
  # the server's own dependencies that prepare.sh's .device/whl lacks (the state store's SQLAlchemy, the Files API's
  # python-multipart): perf/gpu/extra_wheels.sh fills .device/whl2 here; call 1 carries it (a warm machine keeps it)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/whl2/*.whl 2>&1 | grep -v WARNING
fi
LS=$P/build/bin/llama-server
CTX=${CTX:-4096}          # tokens per stream on both servers (a 2,000-token prompt and its answer fit)
STREAMS=${STREAMS:-64}

job() {  # job NAME COMMAND...: detached (setsid) in a copy of the tree (a later call's files never replace a running
  # job's), its log and exit code in $P/NAME.{log,done}
  local name=$1; shift
  rm -rf "$P/tree-$name" && mkdir -p "$P/tree-$name" && cp -a perf engine ep server bench .peer pyproject.toml "$P/tree-$name/"
  rm -f "$P/$name.done"
  (cd "$P/tree-$name" && setsid bash -c "{ $*; } > $P/$name.log 2>&1; echo \$? > $P/$name.done" < /dev/null > /dev/null 2>&1 &)
  log "started $name: $P/$name.log"
}
model_job() {  # model_job SHAPE VOCAB: the bench GGUF and its float16 conversion, timed
  local shape=$1 vocab=$2
  echo "export PYTHONPATH=\$PWD/.peer/gguf-py:\$PWD:\$PYTHONPATH; xz -dc .peer/ggml-vocab-$vocab.gguf.xz > $P/vocab-$vocab.gguf && \
    python3 -m perf.gpu.timed -- python3 -m perf.gpu.bench_gguf --vocab $P/vocab-$vocab.gguf --shape $shape \
      --mix Q4_K_M --out $P/$shape.gguf && \
    python3 -m perf.gpu.timed -- python3 -c 'import sys; from engine.builder import convert_gguf; \
      convert_gguf(sys.argv[1], sys.argv[2], accuracy_level=4, dtype=\"float16\", overwrite=True, progress=False)' \
      $P/$shape.gguf $P/$shape${EXACT_TOO:+ && python3 -m perf.gpu.timed -- python3 -c 'import sys; \
      from engine.builder import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2], accuracy_level=4, \
      dtype=\"float16\", overwrite=True, progress=False, exact_scales=True)' $P/$shape.gguf $P/$shape-exact}"
  # ortserve convert's own call: it runs before the project's wheels are installed. EXACT_TOO=1: also the
  # --exact-scales folder (K-quant linears in float32), served by MODES' "exact"
}
build_once() {  # llama-server's build, unless it is built or building (start and start-32b in one call start it once)
  [ -n "${NO_BUILD:-}" ] && return 0
  [ -x "$LS" ] || { [ -f "$P/build.log" ] && [ ! -f "$P/build.done" ]; } || job build bash perf/gpu/llama_server.sh build
}
has build && build_once
if has start; then
  build_once
  job model-8b "$(model_job llama-3.1-8b llama-bpe)"
fi
if has start-32b; then  # (with start in the same call: both sizes on disk at once, ~51 GB of 64 GiB)
  build_once
  job model-32b "$(model_job qwen2.5-32b qwen2)"
fi
if has wait; then  # WAIT_JOBS: the jobs waited for (default all three; the others go on, detached)
  df -h "$P" | tail -n 1 | tee -a "$LOG"
  for _ in $(seq "${WAIT_S:-540}"); do
    running=0
    for j in ${WAIT_JOBS:-build model-8b model-32b}; do [ -f "$P/$j.log" ] && [ ! -f "$P/$j.done" ] && running=1; done
    [ $running = 0 ] && break; sleep 1
  done
  for j in build model-8b model-32b; do
    [ -f "$P/$j.log" ] && log "$j: rc $(cat "$P/$j.done" 2>/dev/null || echo running); $(grep -E \
      "timed:|wrote|built" "$P/$j.log" | tr '\n' ';' | cut -c1-300)"
  done
fi
if has clean-8b; then rm -rf "$P/llama-3.1-8b" "$P/llama-3.1-8b.gguf"; log "removed the 8B files"; fi

bench() {  # bench NAME PORT ARGS...: one ortserve bench report in $OUT/r-NAME.json
  local name=$1 port=$2; shift 2
  timeout "${BENCH_TIMEOUT:-240}" python3 -m server bench --url "http://127.0.0.1:$port/v1" --endpoint completions \
    --no-progress --out "$OUT/r-$name.json" "$@" 2>&1 | tail -n 2 | cut -c1-200 | tee -a "$LOG"
}
wait_up() {  # wait_up PORT PID: at most WAIT_UP_S (default 600) seconds
  for _ in $(seq $((4 * ${WAIT_UP_S:-600}))); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { log "server on $1 died"; return 1; }
    sleep 0.25
  done
  return 1
}
stop() { kill "$1" 2>/dev/null; for _ in $(seq 40); do kill -0 "$1" 2>/dev/null || break; sleep 0.25; done; kill -9 "$1" 2>/dev/null; }
gpu_mem() {  # gpu_mem NAME: the GPU memory in use now, in MiB, into the log and $OUT/gpu-mem.txt
  local used; used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  echo "$1 $used" >> "$OUT/gpu-mem.txt"; log "GPU memory, $1: ${used:-?} MiB"
}
ours() {  # ours PORT MODEL ARGS...: ortserve on CUDA (SERVER), its load time logged
  local port=$1 model=$2; shift 2
  local t0; t0=$(date +%s.%N)
  setsid python3 -m server serve --model "$model" --provider cuda --max-model-len "$CTX" --max-batch "$STREAMS" \
    --port "$port" --log-level info --shutdown-grace-s 2 "$@" > "$OUT/server-$port.log" 2>&1 &
  SERVER=$!
  wait_up "$port" $SERVER || { tail -n 5 "$OUT/server-$port.log" | tee -a "$LOG"; stop $SERVER; return 1; }
  log "ortserve up in $(since "$t0") s; $(grep -E "model dtype|max_model_len|KV cache:|memory:|shared|in place" \
    "$OUT/server-$port.log" | cut -d' ' -f4- | tr '\n' ';' | cut -c1-900)"
}
peer() {  # peer PORT GGUF: llama-server CUDA (PEER), all layers on the GPU, STREAMS slots of CTX tokens
  local t0; t0=$(date +%s.%N)
  setsid "$LS" -m "$2" -ngl 99 -np "$STREAMS" -c $((STREAMS * CTX)) -b 2048 -ub 512 --host 127.0.0.1 --port "$1" \
    > "$OUT/llama-server-$1.log" 2>&1 &
  PEER=$!
  wait_up "$1" $PEER || { tail -n 5 "$OUT/llama-server-$1.log" | tee -a "$LOG"; stop $PEER; return 1; }
  log "llama-server up in $(since "$t0") s; $(grep -iE "KV self size|kv_cache|model buffer size" \
    "$OUT/llama-server-$1.log" | tr '\n' ';' | cut -c1-400)"
}
SHORT="--prompt-tokens 25 --output-tokens 128"
LONG=${LONG_PROMPT_TOKENS:-2000}
runs() {  # runs NAME PORT [WHICH]: the same client against one server; WHICH (default $RUNS, all four) picks
  local n=$1 port=$2 which=" ${3:-${RUNS:-c1 c8 c64 ttft}} "
  [[ $which == *" c1 "* ]] && bench "$n-c1" "$port" $SHORT --concurrency 1 --num-requests 8 --warmup 1
  [[ $which == *" c8 "* ]] && bench "$n-c8" "$port" $SHORT --concurrency 8 --num-requests 32 --warmup 1 \
    --client-processes 4 && gpu_mem "$n-c8"
  [[ $which == *" c64 "* ]] && bench "$n-c64" "$port" $SHORT --concurrency 64 --num-requests 128 --warmup 1 \
    --client-processes 4 && gpu_mem "$n-c64"
  [[ $which == *" ttft "* ]] || return 0
  bench "$n-ttft-idle" "$port" --prompt-tokens "$LONG" --output-tokens 8 --concurrency 1 --num-requests 3 --warmup 1
  (sleep 2; bench "$n-ttft-busy" "$port" --prompt-tokens "$LONG" --output-tokens 8 --concurrency 1 --num-requests 3 \
    --warmup 0 --seed 7) &
  local beside=$!
  # the largest inter-token gap of these 7 streams is theirs while the long prompts arrive (itl max_ms)
  bench "$n-c7-busy" "$port" --prompt-tokens 25 --output-tokens 512 --concurrency 7 --num-requests 7 --warmup 0
  wait $beside
}
compare() {  # compare SIZE: both servers on $P/SIZE.gguf (llama-server) and $P/SIZE (ortserve, float16)
  local size=$1
  [ -f "$P/$size/genai_config.json" ] || { log "$size: no converted folder ($(tail -n 3 "$P/model-${size##*-}.log" 2>/dev/null))"; return 1; }
  gpu_mem "$size-idle"
  if [ -z "${SKIP_PEER:-}" ] && [ -x "$LS" ] && peer 8401 "$P/$size.gguf"; then
    gpu_mem "$size-peer-loaded"; runs "$size-peer" 8401; stop $PEER
  else
    log "llama-server: not built ($(cat "$P/build.done" 2>/dev/null || echo running))"
  fi
  [ -n "${SKIP_OURS:-}" ] && return 0
  for mode in ${MODES:-spec0 default}; do  # drafts off, then on (the default: prompt lookup); MODES picks
    args=(); [ $mode != default ] && args=(--speculative-tokens 0)
    [ $mode = no1row ] && args+=(--no-one-row-session)  # one-row steps on the fused INT4 kernels too
    [ $mode = nogemm ] && args+=(--no-cuda-int4-gemm)  # ORT's own MatMulNBits kernels everywhere
    folder=$P/$size; [ $mode = exact ] && folder=$P/$size-exact  # exact: the --exact-scales folder, drafts off
    ours 8400 "$folder" "${args[@]}" || continue
    which=; [ $mode = exact ] && which=${RUNS_EXACT:-c1 c8}  # the A/B of the scales' layout: decode alone
    gpu_mem "$size-ours-$mode-loaded"; runs "$size-ours-$mode" 8400 "$which"; stop $SERVER
  done
}
has peer-8b && compare llama-3.1-8b
# NOTE(perf): 64 slots of 4,096 tokens of the 32B are 64 GiB of KV (256 KiB a token): beside 19-20 GiB of weights
# they fit neither server on an 80 GB H100, so the 32B gets STREAMS_32B (default 16; 64 on an H200 with room)
has peer-32b && STREAMS=${STREAMS_32B:-16} compare qwen2.5-32b

if has coder; then
  CODER=$P/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
  [ -f "$CODER" ] || bash perf/gpu/stage_model.sh assemble 2>&1 | tail -n 2 | tee -a "$LOG"
  export ORTSERVE_CACHE_DIR=$P/cache
  # 1. The known name, pulled from the staged file into the cache in the device's dtype, then served with no flag.
  # NOTE(perf): bounded, its output under $OUT: on 5 Dec this step's call hung for the whole 590 s with nothing
  # back but run_log.txt (the session's last device minutes; the cause is not known)
  log "coder: pulling into $ORTSERVE_CACHE_DIR"
  timeout 300 python3 - "$CODER" <<'PY' > "$OUT/coder-pull.log" 2>&1; tail -n 2 "$OUT/coder-pull.log" | tee -a "$LOG"
import sys
from engine.builder import pull_model
from ep.model_dtype import choose_model_dtype
choice = choose_model_dtype("auto")
print(choice.describe()); print(pull_model("qwen2.5-coder-1.5b", gguf_file=sys.argv[1], progress=False, dtype=choice.dtype))
PY
  if ours 8402 qwen2.5-coder-1.5b; then
    OURS=$SERVER
    grep -q "model dtype float16" "$OUT/server-8402.log" && log "coder: served in float16 with no dtype flag" \
      || log "coder: NOT float16: $(grep 'model dtype' "$OUT/server-8402.log")"
    FOLDER=$(grep -oE "serving [^ ]+" "$OUT/server-8402.log" | head -n 1 | cut -d' ' -f2)
    [ -z "${CODER_TOP1_ONLY:-}" ] && ours 8403 "$FOLDER" --speculative-tokens 0 && OURS0=$SERVER
    [ -x "$LS" ] && peer 8401 "$CODER"
  fi
  if [ -n "${OURS:-}" ] && [ -z "${CODER_TOP1_ONLY:-}" ]; then
    # 1. Answers that repeat their input (real text: prompt-lookup drafts hit, as for an agent's edits), each request
    # interleaved over ours with drafts, ours without, and llama-server (bench.features' copy scenario).
    timeout 400 python3 -m server bench --scenario copy --url http://127.0.0.1:8402/v1 --label ours-drafts \
      --peer-url http://127.0.0.1:8403/v1 --peer-label ours-no-drafts --peer-url http://127.0.0.1:8401/v1 \
      --peer-label llama-server --no-progress --out "$OUT/r-coder-copy.json" 2>&1 | tail -n 8 | tee -a "$LOG"
    # 2. Streams, one server at a time busy (the others idle).
    runs coder-ours-default 8402
    runs coder-ours-spec0 8403
    [ -n "${PEER:-}" ] && runs coder-peer 8401
  fi
  if [ -n "${OURS:-}" ]; then
    # 3. Teacher-forced top-1: our float16 graph on CUDA against llama-server's next token at every position.
    [ -n "${PEER:-}" ] && timeout 400 python3 -m perf.gpu.top1 --model-dir "$FOLDER" --peer http://127.0.0.1:8401 \
      --provider cuda --out "$OUT/top1-coder.json" 2>&1 | tail -n 3 | tee -a "$LOG"
    stop $OURS; stop "${OURS0:-0}"; [ -n "${PEER:-}" ] && stop $PEER
  fi
fi

if has summarize; then
  log "summarize"
  python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# NOTE(perf): merged into what an earlier summary of this $OUT kept (a second `summarize` must not empty it)
reports = json.loads((out / "issue45.json").read_text()) if (out / "issue45.json").exists() else {}
for p in sorted(out.glob("r-*.json")):
    r = json.loads(p.read_text())
    runs = r.get("runs") or [r]
    reports[p.stem[2:]] = {"runs": runs, "settings": r.get("settings")}
    for run in runs:
        s = run.get("summary", {})
        t, itl = s.get("ttft") or {}, s.get("itl") or {}
        print(f"{p.stem[2:]:32s} {s.get('output_tokens_per_s') or 0:9.0f} tok/s  TTFT p50 {t.get('p50_ms')} ms  "
              f"ITL max {itl.get('max_ms')} ms")
    p.unlink()
for name in ("gpu-mem.txt", "top1-coder.json"):
    if (out / name).exists():
        reports[name] = (out / name).read_text()
(out / "issue45.json").write_text(json.dumps(reports))
with open(out / "servers.log", "a") as f:
    for p in sorted(out.glob("*server*.log")):
        f.write(f"==> {p.name}\n{p.read_text()[-20000:]}\n")
        p.unlink()
PY
fi
log "done: $steps"
