# The two set-up commands of the README: `make serve` and `make test`. Everything they need is installed here:
# `make serve` only what serving needs (`make install`), `make test` the test extras too (`make venv`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=

# The agents the tests drive (tests/integration/agents), pinned, each installed under .cache/: NAME@VERSION, NAME one
# of the AGENT_NPM_* / AGENT_PIP_* below. `make test` installs and runs AGENT_CLIS_TEST (the newest pin of each);
# `make test-agents` every agent (AGENT_CLIS_NEWEST, AGENT_PIPS) and the older releases people still run
# (AGENT_CLIS_OLDER). CLAUDE_CODE_NEWEST and
# CODEX_NEWEST track the newest release on npm (`make agents-newest` says when npm has a newer one).
CLAUDE_CODE_NEWEST := 2.1.332
CODEX_NEWEST := 0.171.0
AGENT_CLIS_NEWEST := claude-code@$(CLAUDE_CODE_NEWEST) codex@$(CODEX_NEWEST) opencode@1.18.33 qwen-code@0.24.4 \
	continue-cli@1.5.47
# What `make test` installs and runs: one release of every agent (tests/integration/agents: test_agent_clis.py for
# Claude Code and Codex, test_agents_in_the_wild.py for the others; their whole run measured in docs/agents.md);
# `make test-agents` adds the older releases.
AGENT_CLIS_TEST := $(AGENT_CLIS_NEWEST)
AGENT_CLIS_OLDER := claude-code@2.1.332 claude-code@2.1.197 codex@0.169.0
AGENT_CLIS := $(sort $(AGENT_CLIS_NEWEST) $(AGENT_CLIS_OLDER))
AGENT_PIPS := aider@0.86.2 mini-swe-agent@2.4.6 smolagents@1.26.0
AGENT_NPM_claude-code := @anthropic-ai/claude-code
AGENT_NPM_codex := @openai/codex
AGENT_NPM_opencode := opencode-ai
AGENT_NPM_qwen-code := @qwen-code/qwen-code
AGENT_NPM_continue-cli := @continuedev/cli
AGENT_PIP_aider := aider-chat
AGENT_PIP_mini-swe-agent := mini-swe-agent
AGENT_PIP_smolagents := smolagents[openai]
AGENT_DIR := .cache/agent-clis
AGENT_VENVS := .cache/agent-venvs
agent_name = $(firstword $(subst @, ,$1))
agent_version = $(lastword $(subst @, ,$1))

.PHONY: serve test install venv browser postgres pull lint clean bench-cpu agent-clis agent-clis-all agents-newest test-agents

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

# One npm prefix per release (several releases of one CLI side by side). NOTE: the packages bring their native
# binaries as optional dependencies (about 400 MB each, from npm like the rest); their install scripts are not
# needed (the tests run the platform package's binary), so none runs: nothing is downloaded from elsewhere.
$(AGENT_DIR)/%/.installed:
	@command -v npm >/dev/null || { echo "make test needs Node.js and npm (for the agent CLI tests)"; exit 1; }
	mkdir -p $(@D)
	npm install --prefix $(@D) --no-audit --no-fund --no-save --ignore-scripts \
		$(AGENT_NPM_$(call agent_name,$*))@$(call agent_version,$*)
	touch $@

# The Python agents, each in a venv of its own (their pins would fight the test extras' and each other's).
$(AGENT_VENVS)/%/.installed:
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q '$(AGENT_PIP_$(call agent_name,$*))==$(call agent_version,$*)'
	touch $@

# The tests read which releases to run from the manifests (written on every run: cheap). agent-clis: what `make test`
# runs (AGENT_CLIS_TEST); agent-clis-all: every agent and release (`make test-agents`).
agent-clis: $(foreach a,$(sort $(AGENT_CLIS_TEST)),$(AGENT_DIR)/$(a)/.installed) \
		$(foreach a,$(AGENT_PIPS),$(AGENT_VENVS)/$(a)/.installed)
	@printf '%s\n' $(sort $(AGENT_CLIS_TEST)) > $(AGENT_DIR)/manifest.txt
	@printf '%s\n' $(AGENT_PIPS) > $(AGENT_VENVS)/manifest.txt

agent-clis-all: $(foreach a,$(AGENT_CLIS),$(AGENT_DIR)/$(a)/.installed) \
		$(foreach a,$(AGENT_PIPS),$(AGENT_VENVS)/$(a)/.installed)
	@printf '%s\n' $(AGENT_CLIS) > $(AGENT_DIR)/manifest.txt
	@printf '%s\n' $(AGENT_PIPS) > $(AGENT_VENVS)/manifest.txt

# Whether npm has a newer Claude Code or Codex than the pins (a look-up of two versions; installs nothing).
agents-newest:
	@for p in "$(AGENT_NPM_claude-code) $(CLAUDE_CODE_NEWEST)" "$(AGENT_NPM_codex) $(CODEX_NEWEST)"; do \
		set -- $$p; newest=$$(npm view "$$1" version); \
		if [ "$$newest" = "$$2" ]; then echo "$$1: $$2 is the newest"; \
		else echo "$$1: npm has $$newest, the Makefile pins $$2 (bump it)"; fi; \
	done

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

# Every release of every agent (make test runs the newest of each): one warm server, tens of minutes on 2 cores.
test-agents: venv agent-clis-all
	AGENT_RELEASES=all $(BIN)/python -m pytest -m agents tests/integration/agents $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
