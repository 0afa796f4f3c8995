# The two set-up commands of the README: `make serve` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: serve test venv pull lint clean bench-cpu

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Re-install whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

venv: $(VENV)/.installed

pull: venv
	$(BIN)/ortserve pull

serve: pull
	$(BIN)/ortserve serve --host $(HOST) --port $(PORT) $(ARGS)

test: venv
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
