#!/usr/bin/env bash
# OpenResponses' compliance suite (the open Responses spec's own tests, run with bun) against an ortserve this
# script starts (issue 47: "OpenResponses' compliance suite passes, except the tests that need image or file input").
# A dev check, not part of `make test`: the suite's repository is not packaged, so bring its tree yourself (a clone
# of openresponses/openresponses, or a folder with bin/compliance-test.ts, src/lib/compliance-tests.ts,
# src/lib/sse-parser.ts and the schemas they import) and pass it as SUITE_DIR. Nothing of it is copied here.
#
# Usage: perf/openresponses_check.sh SUITE_DIR          (env overrides below)
#   MODEL=qwen2.5-coder-1.5b perf/openresponses_check.sh /tmp/openresponses
# bun comes from npm into SUITE_DIR/node_modules (the `bun` package; its platform binary is an optional
# dependency), with the suite's own dependencies when SUITE_DIR has a package.json. Exit status: the suite's.
# Expect image-input and file-input to fail with a 400 (text models only); file-search and offline-web-search are
# skipped unless their flags are passed through SUITE_ARGS.
set -euo pipefail

SUITE_DIR=$(cd "${1:?usage: $0 SUITE_DIR}" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
PORT=${PORT:-18091}
MODEL=${MODEL:-qwen2.5-coder-1.5b}   # a model that calls tools: the 135M default answers tool-calling in prose
CACHE=${ORTSERVE_CACHE_DIR:-$ROOT/.cache}
SUITE_ARGS=${SUITE_ARGS:-}
LOG=${LOG:-/tmp/openresponses_check.server.log}
log() { echo "[openresponses_check] $(date +%H:%M:%S) $*" >&2; }

BUN=$(find "$SUITE_DIR/node_modules/bun/bin" "$SUITE_DIR/node_modules/@oven" -name 'bun' -o -name 'bun.exe' \
      2>/dev/null | head -1 || true)
if [ -z "$BUN" ] || ! "$BUN" --version > /dev/null 2>&1; then
  log "installing bun from npm into $SUITE_DIR"
  (cd "$SUITE_DIR" && { [ -f package.json ] || npm init -y > /dev/null; } && npm install --no-audit --no-fund bun > /dev/null)
  BUN=$SUITE_DIR/node_modules/bun/bin/bun.exe
fi
if [ -f "$SUITE_DIR/package.json" ] && [ ! -d "$SUITE_DIR/node_modules/zod" ] && grep -q '"zod"' "$SUITE_DIR/package.json"; then
  log "installing the suite's dependencies"
  (cd "$SUITE_DIR" && "$BUN" install > /dev/null)
fi
log "bun $("$BUN" --version); ortserve $(git rev-parse --short HEAD) on :$PORT serving $MODEL"

# `python -m server` from $ROOT: this tree's server, whichever tree the venv has an editable install of
ORTSERVE_CACHE_DIR=$CACHE nice -n 10 "$PY" -m server serve --port "$PORT" --model "$MODEL" > "$LOG" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true' EXIT
for ((i = 0; i < 1200; i++)); do
  # /v1/models answers while the model still loads; its entry says "loaded": true once requests are served
  curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -q '"loaded":true' && break
  kill -0 "$SERVER_PID" 2>/dev/null || { log "the server exited; its log: $LOG"; tail -20 "$LOG" >&2; exit 1; }
  sleep 0.5
done
SERVED=$(curl -s "http://127.0.0.1:$PORT/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
cd "$SUITE_DIR"
# shellcheck disable=SC2086
"$BUN" bin/compliance-test.ts --base-url "http://127.0.0.1:$PORT/v1" --api-key unused --model "$SERVED" $SUITE_ARGS
