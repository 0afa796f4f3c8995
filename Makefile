# The two set-up commands of the README: `make serve` and `make test`. Everything they need is installed here:
# `make serve` only what serving needs (`make install`), `make test` the test extras too (`make venv`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=

# The agent CLIs the tests drive (tests/integration/agents), from npm, pinned; installed under .cache/ (ignored).
AGENT_CLIS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0
AGENT_DIR := .cache/agent-clis

.PHONY: serve test install venv browser postgres pull lint clean bench-cpu agent-clis

$(BIN)/activate:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ortserve needs Python 3.11+, found " + sys.version.split()[0] + " (set PYTHON=python3.12 or similar)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Re-install whenever pyproject.toml changes. The runtime only: no test, lint or load-test tool.
$(VENV)/.installed-runtime: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install -e .
	touch $@

# The runtime plus the test extras (which include the `bench` extra: the load-test harness).
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install -e '.[test]'
	touch $@ $(VENV)/.installed-runtime

install: $(VENV)/.installed-runtime

venv: $(VENV)/.installed

# Download and convert a known model into the cache (`serve` does this itself on first use).
pull: install
	$(BIN)/ortserve pull $(MODEL)

# `ortserve serve` resolves the model first: a known name is pulled and converted once, a GGUF converted.
serve: install
	$(BIN)/ortserve serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

# NOTE: the packages bring their native binaries as optional dependencies (about 400 MB each); their install
# scripts are not needed (the tests run the platform package's binary).
$(AGENT_DIR)/.installed-$(subst /,_,$(subst @,,$(subst $() ,+,$(AGENT_CLIS)))):
	@command -v npm >/dev/null || { echo "make test needs Node.js and npm (for the agent CLI tests)"; exit 1; }
	mkdir -p $(AGENT_DIR)
	npm install --prefix $(AGENT_DIR) --no-audit --no-fund --no-save --ignore-scripts $(AGENT_CLIS)
	rm -f $(AGENT_DIR)/.installed-*
	touch $@

agent-clis: $(AGENT_DIR)/.installed-$(subst /,_,$(subst @,,$(subst $() ,+,$(AGENT_CLIS))))

# The browser tests (tests/integration/ui) drive Debian's chromium through its chromedriver: installed once
# from Debian's packages when missing (never a browser download by a test tool).
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y --no-install-recommends \
			chromium chromium-driver; \
	fi

# The state store's tests run on SQLite and on a PostgreSQL cluster that their fixture makes in a temporary folder
# (tests/postgres.py): Debian's postgresql package, installed once when missing (the server is not started here).
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y --no-install-recommends \
			postgresql; \
	fi

test: venv browser agent-clis postgres
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
