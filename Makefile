# make serve: set up and run the engine (embedded ledger, built-in model, CPU).
# make test:  set up and run the whole test suite (ruff, mypy, pytest, end-to-end included).
# make e2e-node: only the one-node cluster's tests (root: a kubelet, containerd and pods here).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= engine,operator,bench,dev
PORT ?= 8000
PYTEST_ARGS ?=
# Reinstall when the dependency list changes; otherwise reuse the virtual environment.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: serve test e2e-node lint format venv clean
venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-*; touch $@

serve: venv
	$(BIN)/kvbank serve --port $(PORT)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

e2e-node: venv
	$(BIN)/python -m pytest tests/e2e/node -m e2e $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
