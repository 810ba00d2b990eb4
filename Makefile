# make serve: set up and run the engine (embedded ledger, built-in model, CPU).
# make test:  set up and run the whole test suite (ruff, mypy, pytest, end-to-end included).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= engine,operator,bench,dev
PORT ?= 8000
PYTEST_ARGS ?=
# Reinstall when the dependency list changes; otherwise reuse the virtual environment.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: serve test lint format venv clean bench-tools
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

# guidellm in an environment of its own (its pins are its own), reusing the engine's torch and
# transformers through a .pth file instead of downloading CUDA torch again.
BENCH_VENV ?= .venv-bench
bench-tools: venv
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > \
	  "$$($(BENCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-engine.pth"
	$(BENCH_VENV)/bin/python -m pip install -q 'guidellm==0.8.1'

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
