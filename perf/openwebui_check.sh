#!/usr/bin/env bash
# The real Open WebUI against ortserve's Ollama API (issue 37: "Open WebUI's Ollama connection lists the models").
# One ortserve hub (several models on one port) and one Open WebUI whose only connection is an Ollama connection to
# it (OLLAMA_BASE_URL, the OpenAI connection off, no login, offline); then, through Open WebUI's own HTTP API:
#   /ollama/api/version and /ollama/api/tags  (its proxy of our /api/version and /api/tags),
#   /api/models                               (the model picker's list: every ortserve model, owned_by "ollama"),
#   /ollama/api/show                          (CHAT_MODEL's and EMBED_MODEL's capabilities),
#   /api/chat/completions, not streamed and streamed, to CHAT_MODEL (Open WebUI -> our /api/chat, NDJSON),
#   /ollama/api/ps                            (the model it loaded), /ollama/api/embed to EMBED_MODEL,
#   /ollama/api/unload                        (Open WebUI's unload: our /api/generate with keep_alive 0).
# Each check prints one line (ok / FAIL); the script exits non-zero when one fails. SCREENSHOT=FILE also saves a
# picture of the chat page's model picker (Debian's chromium and chromedriver: `make browser`; selenium from the
# test extras).
#
# TOOLS=1: Open WebUI's native tool calling instead (issue 46). One Open WebUI with both an OpenAI connection
# (OPENAI_API_BASE_URL=ortserve's /v1) and an Ollama connection to the same ortserve (qwen2.5-coder-1.5b, served at
# --log-level debug); a workspace Tool made through its API (read_file, which knows hello.py); the chat model of
# each connection set to `function_calling: native`; one chat each with `tool_ids`. Asserted from ortserve's log
# and Open WebUI's saved chat: the requests carried `tools`, the model's call was parsed, Open WebUI ran the tool
# and sent its result back in a second request, every request 2xx; the answer is printed (perf/openwebui_check.py).
#
# RECORD=FILE (with TOOLS=1) puts perf.agent_replay's recording proxy (port ORT_PORT+1) in front of the OpenAI
# connection: each request and answer, for `perf.agent_replay replay FILE`.
#
# Usage: perf/openwebui_check.sh            (env overrides below)
#        TOOLS=1 NICE=10 perf/openwebui_check.sh
# Open WebUI is a dev-only tool, installed once into $OWUI_VENV (a venv under /tmp, never the project's .venv;
# a few minutes and about 7 GiB: it brings torch). The servers run under `flock /tmp/heavy.lock nice -n $NICE` (5).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OWUI_VENV=${OWUI_VENV:-/tmp/owui}
OPEN_WEBUI_VERSION=${OPEN_WEBUI_VERSION:-0.12.4}
OWUI_PYTHON=${OWUI_PYTHON:-python3.11}          # Open WebUI wants Python 3.11 or 3.12
WORK=${WORK:-/tmp/owui-check}                    # Open WebUI's DATA_DIR and both servers' logs
ORT_PORT=${ORT_PORT:-18434}
OWUI_PORT=${OWUI_PORT:-18080}
TOOLS=${TOOLS:-}
if [ -n "$TOOLS" ]; then  # a real instruct model that calls tools; its log says what each request carried
  MODELS=${MODELS:-qwen2.5-coder-1.5b all-minilm-l6-v2}
  CHAT_MODEL=${CHAT_MODEL:-qwen2.5-coder-1.5b}
  ORT_FLAGS=${ORT_FLAGS:---log-level debug --max-batch 2}
else
  MODELS=${MODELS:-smollm2-135m-instruct gemma3-270m all-minilm-l6-v2}
  CHAT_MODEL=${CHAT_MODEL:-smollm2-135m-instruct}  # gemma3-270m is a base model: no chat template, so no /api/chat
  ORT_FLAGS=${ORT_FLAGS:-}
fi
EMBED_MODEL=${EMBED_MODEL:-all-minilm-l6-v2}
SCREENSHOT=${SCREENSHOT:-}
NICE=${NICE:-5}
log() { echo "[openwebui_check] $(date +%H:%M:%S) $*" >&2; }

if ! "$OWUI_VENV/bin/python" -c 'import open_webui' 2>/dev/null; then
  log "installing open-webui==$OPEN_WEBUI_VERSION into $OWUI_VENV (dev-only)"
  "$OWUI_PYTHON" -m venv "$OWUI_VENV"
  nice -n 10 "$OWUI_VENV/bin/pip" install -q "open-webui==$OPEN_WEBUI_VERSION"
fi
if [ -z "${OWUI_CHECK_LOCKED:-}" ]; then  # the servers' part, one heavy run at a time
  OWUI_CHECK_LOCKED=1 exec flock /tmp/heavy.lock nice -n "$NICE" bash "${BASH_SOURCE[0]}" "$@"
fi

# shellcheck source=perf/servers.sh
source "$ROOT/perf/servers.sh"
rm -rf "$WORK" && mkdir -p "$WORK/data"
wait_http() {  # wait_http URL PID SECONDS: until GET URL answers 2xx
  local i
  for ((i = 0; i < $3 * 2; i++)); do
    curl -sf "$1" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { log "the server for $1 exited (logs in $WORK)"; return 1; }
    sleep 0.5
  done
  log "$1 not answering after $3 s (logs in $WORK)"; return 1
}

model_flags=()
for m in $MODELS; do model_flags+=(--model "$m"); done
log "ortserve $("$PY" -c 'import server; print(server.__version__)') ($(git rev-parse --short HEAD)) on :$ORT_PORT: $MODELS"
# `python -m server` from $ROOT: this tree's server, whichever tree $PY's venv has an editable install of
# shellcheck disable=SC2086  # ORT_FLAGS: words
"$PY" -m server serve --host 127.0.0.1 --port "$ORT_PORT" "${model_flags[@]}" $ORT_FLAGS > "$WORK/ortserve.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ORT_PORT/api/tags" "${PIDS[-1]}" 600

if [ -n "$TOOLS" ]; then  # both connections to the same ortserve
  openai_base=http://127.0.0.1:$ORT_PORT
  if [ -n "${RECORD:-}" ]; then  # the OpenAI connection's requests and answers, for perf.agent_replay replay
    "$PY" -m perf.agent_replay proxy --base "$openai_base" --port $((ORT_PORT + 1)) --out "$RECORD" &
    PIDS+=($!)
    openai_base=http://127.0.0.1:$((ORT_PORT + 1))
  fi
  openai=(ENABLE_OPENAI_API=true OPENAI_API_BASE_URL="$openai_base/v1" OPENAI_API_KEY=sk-local)
else
  openai=(ENABLE_OPENAI_API=false)
fi
log "Open WebUI $OPEN_WEBUI_VERSION on :$OWUI_PORT, its Ollama connection http://127.0.0.1:$ORT_PORT ${openai[*]}"
# Offline and quiet: no model download at start (its RAG embeddings go to our EMBED_MODEL instead of a local
# sentence-transformers model), no update check, no telemetry.
(cd "$WORK" && exec env DATA_DIR="$WORK/data" WEBUI_AUTH=false WEBUI_SECRET_KEY=ortserve-openwebui-check-not-secret \
  ENABLE_OLLAMA_API=true OLLAMA_BASE_URL="http://127.0.0.1:$ORT_PORT" "${openai[@]}" \
  OFFLINE_MODE=true HF_HUB_OFFLINE=1 ENABLE_VERSION_UPDATE_CHECK=false \
  RAG_EMBEDDING_ENGINE=ollama RAG_EMBEDDING_MODEL="$EMBED_MODEL" \
  ANONYMIZED_TELEMETRY=false DO_NOT_TRACK=true SCARF_NO_ANALYTICS=true \
  "$OWUI_VENV/bin/open-webui" serve --host 127.0.0.1 --port "$OWUI_PORT") > "$WORK/openwebui.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$OWUI_PORT/health" "${PIDS[-1]}" 600

rc=0
ORT="http://127.0.0.1:$ORT_PORT" OWUI="http://127.0.0.1:$OWUI_PORT" MODELS="$MODELS" CHAT_MODEL="$CHAT_MODEL" \
  EMBED_MODEL="$EMBED_MODEL" ORT_LOG="$WORK/ortserve.log" \
  "$PY" -m perf.openwebui_check ${TOOLS:+--tools} ${SCREENSHOT:+--screenshot "$SCREENSHOT"} || rc=$?
log "logs: $WORK/ortserve.log, $WORK/openwebui.log"
exit $rc
