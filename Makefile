# The two commands of the README: `make train` and `make test`. Each creates the virtual
# environment on first use (and again whenever pyproject.toml changes), then reuses it.
# `make format` formats and fixes lint; `make bench` is the engine's decode benchmark
# (benchmarks/engine_decode.py; the rollout paradigms' is `dora-jax bench`).
PYTHON ?= python3
VENV ?= .venv
WORKDIR ?= runs/default
STAMP := $(VENV)/.installed
BIN := $(VENV)/bin

.PHONY: train test lint format bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test,jetstream]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/dora-jax train --config=configs/default.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -n 2 --dist loadgroup --durations=15 tests

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)  # the engine's decode benchmark
	$(BIN)/python benchmarks/engine_decode.py
