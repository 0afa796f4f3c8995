#!/usr/bin/env bash
# Issue 38's device figures (CUDA, H200), through HTTP with `ortserve bench` (the openai client, /v1/completions
# streamed). After the CUDA staging calls (perf/gpu/stage_cuda.sh) and perf/gpu/llama_server.sh start (llama-server
# and the bench GGUF under /root/peer); carry [".device/whl", ".device/setup-cuda.sh", ".peer"]:
#   source .device/setup-cuda.sh; bash perf/gpu/issue38.sh [steps]        -> $OUT/issue38.json, $OUT/run_log.txt
# model: the bench GGUF and its conversion if the background job has not made them; tests: the CUDA engine tests on
# the converted untied bench GGUF (finite logits, varied greedy output) against the CPU EP (TESTS_K picks some); spec:
# one stream, default settings against --speculative-tokens 0, greedy, on build_synthetic's 1B shape (non-finite
# logits), the bench GGUF (drafts miss) and its offset-code variant (its output repeats: drafts hit; SPEC_T1=1 adds
# the bench GGUF at temperature 1);
# peer: llama-server (CUDA) and ortserve (--max-batch 64) on the same GGUF: 1, 8 and 64 streams, a ~900-token TTFT
# idle and beside 7 streams; arrivals: 64 requests at once, three times, on both (OURS_ARGS="--api-server-count 4":
# also on a second ortserve with those args, interleaved: ours-args-arrivals*).
set -o pipefail
steps=${*:-model tests spec peer arrivals}  # 'summarize' alone: only the summary of what $OUT holds
OUT=${OUT:-/tmp/issue38_out}; mkdir -p "$OUT"
LOG=$OUT/run_log.txt
P=/root/peer
GGUF_DIR=$P/bench-1b
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
has() { [[ " $steps " == *" $1 "* ]]; }

if has model; then  # the background job's (llama_server.sh start), at most 3 minutes more
  for _ in $(seq 180); do [ -f $P/model.done ] || [ ! -f $P/model.log ] && break; sleep 1; done
fi
if has model && [ ! -f $GGUF_DIR/genai_config.json ]; then
  log "model: not made by the background job ($(cat $P/model.done 2>/dev/null || echo none)); making it now"
  bash perf/gpu/llama_server.sh model 2>&1 | tail -n 5 | tee -a "$LOG"
fi

if has tests; then
  log "tests: CUDA engine tests on $GGUF_DIR-untied (varied greedy output)"
  ORTSERVE_CUDA_TEST_MODEL=$GGUF_DIR-untied ORTSERVE_DEVICE_TESTS=1 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q \
    -p no:cacheprovider -rs tests/integration/ep/test_cuda_engine.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tail -n 30 > "$OUT/pytest_log.txt"
  tail -n 3 "$OUT/pytest_log.txt" | tee -a "$LOG"
fi

bench() {  # bench NAME PORT ARGS...: one ortserve bench report in $OUT/r-NAME.json
  local name=$1 port=$2; shift 2
  timeout ${BENCH_TIMEOUT:-120} python3 -m server bench --url "http://127.0.0.1:$port/v1" --endpoint completions \
    --no-progress --out "$OUT/r-$name.json" "$@" 2>&1 | tail -n 2 | cut -c1-200 | tee -a "$LOG"
}
wait_up() {  # wait_up PORT PID
  for _ in $(seq 480); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { log "server on $1 died"; return 1; }
    sleep 0.25
  done
  return 1
}
ours() {  # ours PORT MODEL_DIR MAX_BATCH ARGS...: start ortserve on CUDA (SERVER)
  local port=$1 model=$2 b=$3; shift 3
  setsid python3 -m server serve --model "$model" --provider cuda --max-model-len 1024 --max-batch "$b" --port "$port" \
    --log-level warning --shutdown-grace-s 2 "$@" > "$OUT/server-$port.log" 2>&1 &
  SERVER=$!
  wait_up "$port" $SERVER
}
stop() { kill "$1" 2>/dev/null; for _ in $(seq 40); do kill -0 "$1" 2>/dev/null || break; sleep 0.25; done; kill -9 "$1" 2>/dev/null; }
spec_counts() {  # the server's draft counters (/metrics)
  curl -sf "http://127.0.0.1:$1/metrics" | grep -E "^ortserve_[a-z_]*(spec|phase|steps)" | tr '\n' ' ' | cut -c1-1500 \
    | tee -a "$LOG"; echo | tee -a "$LOG"
}
SHORT="--prompt-tokens 25 --output-tokens 128"

if has spec; then
  for _ in $(seq 120); do [ -f $P/synthetic.done ] || [ ! -f $P/synthetic.log ] && break; sleep 1; done
  if [ ! -f /tmp/ortserve-1b/genai_config.json ]; then
    log "spec: building build_synthetic's 1B shape"
    OUT=$OUT/build PROVIDER=cuda bash perf/gpu/serving.sh build > /dev/null 2>&1; rm -rf "$OUT/build"
  fi
  for m in ${SPEC_MODELS:-synthetic gguf gguf-offset}; do
    dir=/tmp/ortserve-1b; [ $m != synthetic ] && dir=$GGUF_DIR${m#gguf}
    for mode in default spec0; do
      args=(); [ $mode = spec0 ] && args=(--speculative-tokens 0)
      log "spec: $m, $mode (--max-batch 8)"
      ours 8200 "$dir" 8 "${args[@]}" || continue
      bench "spec-$m-$mode-greedy" 8200 $SHORT --concurrency 1 --num-requests ${C1_REQUESTS:-24} --warmup 1 \
        --extra-body '{"logprobs": 0}'
      spec_counts 8200
      if [ -n "${SPEC_T1:-}" ] && [ $m = gguf ]; then
        bench "spec-$m-$mode-t1" 8200 $SHORT --concurrency 1 --num-requests ${C1_REQUESTS:-24} --warmup 1 \
          --temperature 1.0 --extra-body '{"logprobs": 0}'
        spec_counts 8200
      fi
      grep -iE "not finite|error|traceback" "$OUT/server-8200.log" | head -n 3 | tee -a "$LOG"
      stop $SERVER
    done
  done
fi

LONG_WORDS=${LONG_PROMPT_WORDS:-700}  # ~900 Llama 3 tokens (each report holds its prompts' token counts)
peer_runs() {  # peer_runs NAME PORT: the same client against one server
  local n=$1 port=$2
  bench "$n-c1" $port $SHORT --concurrency 1 --num-requests 16 --warmup 1
  bench "$n-c8" $port $SHORT --concurrency 8 --num-requests 64 --warmup 1 --client-processes 4
  bench "$n-c64" $port $SHORT --concurrency 64 --num-requests ${C64_REQUESTS:-192} --warmup 1 --client-processes 4
  bench "$n-ttft-idle" $port --prompt-tokens $LONG_WORDS --output-tokens 8 --concurrency 1 --num-requests 4 --warmup 1
  (sleep 1; bench "$n-ttft-busy" $port --prompt-tokens $LONG_WORDS --output-tokens 8 --concurrency 1 --num-requests 5 \
    --warmup 0 --seed 7) &
  local beside=$!
  bench "$n-c7-busy" $port --prompt-tokens 25 --output-tokens 256 --concurrency 7 --num-requests 14 --warmup 0
  wait $beside
}
arrivals() {  # arrivals NAME PORT [NAME2 PORT2]: 64 requests sent at once, three times (distinct prompts each time);
  # with a second server, its runs interleave with the first's (the same prompts)
  for i in 1 2 3; do
    bench "$1-arrivals$i" $2 --prompt-tokens 25 --output-tokens 32 --concurrency 64 --num-requests 64 --warmup 0 \
      --client-processes ${ARRIVAL_PROCS:-4} --seed $((100 + i))
    [ -n "$3" ] && bench "$3-arrivals$i" $4 --prompt-tokens 25 --output-tokens 32 --concurrency 64 --num-requests 64 \
      --warmup 0 --client-processes ${ARRIVAL_PROCS:-4} --seed $((100 + i))
  done
}
if has peer || has arrivals; then
  LS=$P/build/bin/llama-server
  if [ -x $LS ]; then
    log "llama-server: $($LS --version 2>&1 | grep -i version | head -n 1)"
    setsid $LS -m $P/bench-1b.gguf -ngl 99 -np 64 -c 65536 -b 2048 -ub 512 --host 127.0.0.1 --port 8301 \
      --alias bench-1b > "$OUT/llama-server.log" 2>&1 &
    PEER=$!
    if wait_up 8301 $PEER; then
      has peer && peer_runs peer 8301
      has arrivals && arrivals peer 8301
    fi
    stop $PEER
  else
    log "llama-server not built: $(cat $P/build.done 2>/dev/null || echo running); $(tail -n 3 $P/build.log 2>/dev/null)"
  fi
  if ours 8300 $GGUF_DIR 64; then
    OURS=$SERVER
    has peer && peer_runs ours 8300
    # OURS_ARGS (e.g. "--api-server-count 4"): the arrivals also run on a second ortserve started with these args,
    # interleaved with the first's (reports ours-args-arrivals*)
    if has arrivals && [ -n "$OURS_ARGS" ] && ours 8302 $GGUF_DIR 64 $OURS_ARGS; then
      log "arrivals: ours (8300) interleaved with ours $OURS_ARGS (8302, reports ours-args-arrivals*)"
      arrivals ours 8300 ours-args 8302
      stop $SERVER
    elif has arrivals; then
      [ -n "$OURS_ARGS" ] && log "arrivals: ours with $OURS_ARGS did not start (server-8302.log); ours alone"
      arrivals ours 8300
    fi
    stop $OURS
  fi
fi

if has arrivals-trace; then  # where 64 arrivals' first tokens wait: the engine's steps beside the client's times
  # three bursts onto an idle server ("cold"), then three while one other stream keeps the GPU busy ("warm": is a
  # burst's first steps slow because the GPU idled?); OURS_ARGS (e.g. --api-server-count 4) apply to the server
  if ours 8300 $GGUF_DIR 64 --step-trace "$OUT/trace-arrivals.jsonl" $OURS_ARGS; then
    for phase in cold warm; do
      if [ $phase = warm ]; then
        bench "keepwarm" 8300 --prompt-tokens 25 --output-tokens 960 --concurrency 1 --num-requests 40 --warmup 0 \
          > /dev/null 2>&1 &
        KEEP=$!
        sleep 1
      fi
      for i in 1 2 3; do
        sleep 2
        bench "trace-$phase-arrivals$i" 8300 --prompt-tokens 25 --output-tokens 32 --concurrency 64 --num-requests 64 \
          --warmup 0 --client-processes ${ARRIVAL_PROCS:-4} --seed $((300 + i))
      done
      [ $phase = warm ] && { kill $KEEP 2>/dev/null; wait $KEEP 2>/dev/null; }
    done
    stop $SERVER
    python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = [json.loads(line) for line in open(out / "trace-arrivals.jsonl") if '"decode"' in line]
for phase in ("cold", "warm"):
    for i in (1, 2, 3):
        r = json.loads((out / f"r-trace-{phase}-arrivals{i}.json").read_text())["runs"][0]
        t0 = r["started_at_s"]
        recs = r.get("records") or []
        starts = sorted(x["start_ms"] for x in recs)
        firsts = sorted(x["start_ms"] + x["ttft_ms"] for x in recs if x.get("ttft_ms") is not None)
        ttfts = sorted(x["ttft_ms"] for x in recs if x.get("ttft_ms") is not None)
        print(f"{phase} run {i}: sends {starts[0]:.1f}..{starts[-1]:.1f} ms, first tokens {firsts[0]:.1f}..{firsts[-1]:.1f}"
              f" ms, TTFT p50 {ttfts[len(ttfts) // 2]:.1f} ms")
        for st in steps:
            at = (st["t"] - t0) * 1e3
            if starts[0] - 5 <= at <= firsts[-1] + 5:
                runs = ",".join(f"{n[:6]}:{ms:.1f}" for n, ms in st["runs"])
                print(f"  {at:7.1f} +{st['ms']:5.1f} idle {st.get('idle_ms') or 0:5.1f} decode {st['decode']:2d} "
                      f"joined {st['joined']:2d} prefill {st['prefill']} | {runs}"[:230])
PY
    gzip -f "$OUT/trace-arrivals.jsonl"
  fi
fi

if has arrivals-spy; then  # who holds the engine process's and the server's interpreter during 64-request bursts
  # needs py-spy (prepare.sh --cuda py-spy==0.4.1 puts its wheel in .device/whl); SPY_BURSTS bursts of 64
  if ours 8300 $GGUF_DIR 64; then
    bench "spy-warm" 8300 --prompt-tokens 25 --output-tokens 32 --concurrency 64 --num-requests 64 --warmup 0 \
      --client-processes 4 --seed 400
    ENGINE=$(pgrep -P $SERVER -f "spawn_main" | head -n 1)
    log "spy: server $SERVER, engine process $ENGINE"
    dur=$(( ${SPY_BURSTS:-8} * 2 + 4 ))
    ${PYSPY:-/tmp/site/bin/py-spy} record --pid "$ENGINE" --rate 2000 --duration $dur --nonblocking --gil --threads --format raw \
      --output "$OUT/spy-engine-gil.txt" > "$OUT/spy-engine-gil.log" 2>&1 &
    S1=$!
    ${PYSPY:-/tmp/site/bin/py-spy} record --pid "$ENGINE" --rate 2000 --duration $dur --nonblocking --idle --threads --format raw \
      --output "$OUT/spy-engine-all.txt" > "$OUT/spy-engine-all.log" 2>&1 &
    S2=$!
    ${PYSPY:-/tmp/site/bin/py-spy} record --pid "$SERVER" --rate 2000 --duration $dur --nonblocking --gil --threads --format raw \
      --output "$OUT/spy-server-gil.txt" > "$OUT/spy-server-gil.log" 2>&1 &
    S3=$!
    sleep 2
    for i in $(seq ${SPY_BURSTS:-8}); do
      bench "spy-arrivals$i" 8300 --prompt-tokens 25 --output-tokens 32 --concurrency 64 --num-requests 64 \
        --warmup 0 --client-processes 4 --seed $((400 + i))
      sleep 0.5
    done
    wait $S1 $S2 $S3
    tail -n 2 "$OUT"/spy-*.log | tee -a "$LOG"
    stop $SERVER
    gzip -f "$OUT"/spy-*.txt
  fi
fi

log "done"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# NOTE(perf): merged into what an earlier summary of this $OUT kept (a second `summarize` must not empty it)
reports = json.loads((out / "issue38.json").read_text()) if (out / "issue38.json").exists() else {}
for p in sorted(out.glob("r-*.json")):
    r = json.loads(p.read_text())
    runs = r.get("runs", [])
    reports[p.stem[2:]] = {"runs": runs, "settings": r.get("settings")}
    for run in runs:
        s = run["summary"]
        t = s.get("ttft") or {}
        print(f"{p.stem[2:]:28s} {s.get('output_tokens_per_s', 0):9.0f} tok/s  TTFT p50 {t.get('p50_ms')} p99 "
              f"{t.get('p99_ms')} ms  prompt tokens {s.get('num_prompt_tokens', s.get('prompt_tokens_mean'))}")
    p.unlink()
(out / "issue38.json").write_text(json.dumps(reports))
with open(out / "servers.log", "a") as f:
    for p in sorted(out.glob("*server*.log")):
        f.write(f"==> {p.name}\n{p.read_text()[-15000:]}\n")
        p.unlink()
PY
