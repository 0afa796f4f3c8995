#!/usr/bin/env bash
# Issue 13's and 22's figures on the GPU machine: the synthetic Llama-3.2-1B shape (INT4, float16, KV length 1,024) served
# over HTTP on the WebGPU plugin EP and measured with `ortserve bench` (the official openai client's wire format,
# /v1/completions, streaming), beside engine-direct runs of the same harness. One call of the device tool:
#   bash perf/gpu/serving.sh [tests] [probe] [http] [ttft7] [engine]     (default: http engine)
# PROVIDER=cuda (after `source .device/setup-cuda.sh`) serves on the CUDA EP instead of WebGPU; tests then runs
# tests/integration/ep/test_cuda_engine.py (TESTS= picks others). SERVE_ARGS adds server flags (--no-graph-capture).
# TRACE=1: the --max-batch 8 server writes a --step-trace, and the largest token gaps of its runs are shown beside
# the engine's steps (perf/gpu/gaps.py; $OUT/gaps-*.json).
# EXTRA_BODY replaces the requests' extra fields (default {"logprobs": 0}: a chunk of a random-weight model's tokens
# may hold no text, and its logprobs still count it; '{}' measures requests as most clients send them).
# C8_PROCS / C64_PROCS: client processes of the 8- and 64-stream runs (default 4 each: one process streams ~4,000
# chunks/s before it is the limit; perf/gpu/c64_client.sh). probe: the time of each device piece (perf/gpu/probe_buckets.py).
# Results: $OUT/serving-*.json (one `ortserve bench` report per run) and $OUT/serving_log.txt.
set -o pipefail
steps=${*:-http engine}
source perf/gpu/env.sh  # the GPU set-up (LOCAL=1: a dry run here), OUT
LOG="$OUT/serving_log.txt"
# NOTE(bench): the finite-logit bench GGUF (perf/gpu/llama_server.sh model) when this machine has it, else
# build_synthetic's 1B shape (its float16 logits turn non-finite ~49 tokens into an answer)
BENCH_GGUF_DIR=/root/peer/bench-1b
MODEL=${MODEL_DIR:-$([ -f $BENCH_GGUF_DIR/genai_config.json ] && echo $BENCH_GGUF_DIR || echo /tmp/ortserve-1b)}
PROVIDER=${PROVIDER:-webgpu}
LEN=${MAX_MODEL_LEN:-1024}
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }

if [[ " $steps " == *" tests "* ]]; then
  TESTS=${TESTS:-tests/integration/ep/test_${PROVIDER:-webgpu}_engine.py}
  ORTSERVE_DEVICE_TESTS=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -rs $TESTS \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/pytest_log.txt"
fi

if [ ! -f "$MODEL/genai_config.json" ]; then
  log "building the synthetic llama-3.2-1b shape into $MODEL"
  python3 - "$MODEL" <<'EOF' 2>&1 | tee -a "$LOG"
import sys
from pathlib import Path
from perf.gpu.shapes import SHAPES
from engine.builder import SyntheticSpec, build_synthetic
spec = SyntheticSpec(**SHAPES["llama-3.2-1b"], max_length=1024, quant="int4", dtype="float16", seed=0)
build_synthetic(Path(sys.argv[1]), spec, accuracy_level=4)
EOF
fi

if [[ " $steps " == *" probe "* ]]; then
  for b in 8 64; do timeout 200 python3 -m perf.gpu.probe_buckets --model "$MODEL" --provider "$PROVIDER" \
    --max-batch $b --out "$OUT/probe-b$b.json" 2>&1 | tail -n 40 | tee -a "$LOG"; done
fi

bench() {  # bench NAME ARGS...: one ortserve bench report
  local name=$1; shift
  timeout 240 python3 -m server bench --url "http://127.0.0.1:$PORT/v1" --endpoint completions --no-progress \
    --extra-body "${EXTRA_BODY:-{\"logprobs\": 0\}}" --out "$OUT/serving-$name.json" "$@" 2>&1 | tail -n 25 | tee -a "$LOG"
}

serve() {  # serve MAX_BATCH: start a server on $PORT and wait until it answers
  PORT=$((8100 + $1)); SLOTS=$1
  local trace=
  [ -n "${TRACE:-}" ] && [ "$1" = 8 ] && trace="--step-trace $OUT/trace-b8.jsonl"
  setsid python3 -m server serve --model "$MODEL" --provider "$PROVIDER" --max-model-len $LEN --max-batch "$1" \
    --port "$PORT" --log-level warning --shutdown-grace-s 2 ${SERVE_ARGS:-} $trace >"$OUT/server-b$1.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 $SERVER 2>/dev/null || { log "server --max-batch $1 died"; tail -n 30 "$OUT/server-b$1.log" | tee -a "$LOG"; return 1; }
    sleep 0.5
  done
  return 1
}

stop() {  # SIGTERM, then SIGKILL after 15 s
  kill $SERVER 2>/dev/null
  for _ in $(seq 30); do kill -0 $SERVER 2>/dev/null || break; sleep 0.5; done
  kill -9 $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
  grep -E "WARNING|ERROR|Traceback" "$OUT/server-b$SLOTS.log" | head -n 5 | tee -a "$LOG"
}

SHORT="--prompt-tokens 25 --output-tokens 128"
# NOTE(bench): the synthetic vocabulary spells the harness's words in ~2 tokens each: 440 words ~ 900 tokens
# (the reports hold each prompt's token count)
# (the Llama 3 vocabulary of the bench GGUF: about one token a word)
LONG=${LONG_PROMPT_WORDS:-$([ "$MODEL" = $BENCH_GGUF_DIR ] && echo 900 || echo 440)}

long_prompt_runs() {  # long_prompt_runs PREFIX: the ~900-token TTFT idle, then 7 streams' inter-token latency idle and
  # while those prompts arrive one after another (reports PREFIX-prompt1000, -c7-idle, -prompt1000-beside7, -c7-busy)
  bench $1-prompt1000 --prompt-tokens $LONG --output-tokens 8 --concurrency 1 --num-requests 4 --warmup 1
  bench $1-c7-idle --prompt-tokens 25 --output-tokens 256 --concurrency 7 --num-requests 14 --warmup 0
  (sleep 1; bench $1-prompt1000-beside7 --prompt-tokens $LONG --output-tokens 8 --concurrency 1 --num-requests 6 \
    --warmup 0) &
  local beside=$!
  bench $1-c7-busy --prompt-tokens 25 --output-tokens 256 --concurrency 7 --num-requests 14 --warmup 0
  wait $beside
}
if [[ " $steps " == *" http "* ]]; then
  log "http: --max-batch 8 (the default)"
  if serve 8; then
    bench b8-c1 $SHORT --concurrency 1 --num-requests ${C1_REQUESTS:-24} --warmup 1
    bench b8-c8 $SHORT --concurrency 8 --num-requests ${C8_REQUESTS:-128} --warmup 1 --client-processes ${C8_PROCS:-4}
    long_prompt_runs b8
    stop
    if [ -n "${TRACE:-}" ]; then  # the largest token gaps beside the engine's steps (perf/gpu/gaps.py)
      for name in b8-c7-busy b8-c7-idle b8-c8; do
        log "gaps: $name"
        python3 -m perf.gpu.gaps "$OUT/serving-$name.json" "$OUT/trace-b8.jsonl" --top 4 \
          --out "$OUT/gaps-$name.json" 2>&1 | cut -c1-220 | head -n 60 | tee -a "$LOG"
      done
      gzip -f "$OUT/trace-b8.jsonl"
    fi
  fi
  log "http: --max-batch 1"
  serve 1 && { bench b1-c1 $SHORT --concurrency 1 --num-requests ${C1_REQUESTS:-24} --warmup 1; stop; }
  log "http: --max-batch 64"
  serve 64 && { bench b64-c64 $SHORT --concurrency 64 --num-requests ${C64_REQUESTS:-512} --warmup 1 --client-processes ${C64_PROCS:-4}; stop; }
fi

# ttft7: only the ~900-token TTFT at idle and beside 7 streams (with their ITL), once per token budget in
# PREFILL_CHUNKS (default: the engine's own), each on a fresh --max-batch 8 server: which budget the profile should
# have. Reports serving-ttft7-<budget>-*.json.
if [[ " $steps " == *" ttft7 "* ]]; then
  for budget in ${PREFILL_CHUNKS:-default}; do
    log "ttft7: --max-batch 8, prefill budget $budget"
    extra=$SERVE_ARGS; [ "$budget" != default ] && SERVE_ARGS="$SERVE_ARGS --prefill-chunk $budget"
    if serve 8; then
      long_prompt_runs ttft7-$budget
      stop
    fi
    SERVE_ARGS=$extra
  done
fi

if [[ " $steps " == *" engine "* ]]; then
  for spec in "1 1" "8 1" "8 8"; do
    set -- $spec
    log "engine-direct: --engine-max-batch $1, concurrency $2"
    timeout 240 python3 -m server bench --engine "$MODEL" --engine-provider "$PROVIDER" --engine-max-batch "$1" \
      --endpoint completions --no-progress $SHORT --concurrency "$2" --num-requests $(( $2 * 4 > 6 ? $2 * 4 : 6 )) \
      --warmup 1 --out "$OUT/serving-engine-b$1-c$2.json" 2>&1 | tail -n 25 | tee -a "$LOG"
  done
fi
log "done"
# The device tool returns at most 8 files: every report into serving.json, every server log into servers.log.
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
reports = {p.stem.removeprefix("serving-"): json.loads(p.read_text()) for p in sorted(out.glob("serving-*.json"))}
(out / "serving.json").write_text(json.dumps(reports))
for p in out.glob("serving-*.json"):
    p.unlink()
with open(out / "servers.log", "w") as f:
    for p in sorted(out.glob("server-b*.log")):
        f.write(f"==> {p.name}\n{p.read_text()[-20000:]}\n")
        p.unlink()
EOF
