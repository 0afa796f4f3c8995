#!/bin/sh
# Container entry point for ortserve images: pull the model into ORTSERVE_CACHE_DIR before `serve`
# (unless ORTSERVE_MODEL is a path or ORTSERVE_PULL_ON_START=0), then exec ortserve, which replaces this
# shell so SIGTERM reaches the server directly and it drains its streams.
#
#   docker run IMAGE                  -> ortserve serve
#   docker run IMAGE --port 9000      -> ortserve serve --port 9000 (flags alone mean `serve`)
#   docker run IMAGE devices          -> ortserve devices (any other subcommand runs as given)
set -eu

# Flags with no subcommand mean `serve`.
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    set -- serve "$@"
fi

if [ "$1" = "serve" ] && [ "${ORTSERVE_PULL_ON_START:-1}" = "1" ]; then
    model="${ORTSERVE_MODEL:-}"
    case "$model" in
        */* | *.gguf)
            # A mounted model folder or GGUF file: nothing to pull; `serve` reports a bad path itself.
            ;;
        "")
            ortserve pull
            ;;
        *)
            ortserve pull "$model"
            ;;
    esac
fi

exec ortserve "$@"
