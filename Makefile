# Fresh machine: `make run` (set up + train the default job) or `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test lint

setup: $(VENV)/.installed

# torch is pinned and installed first, explicitly: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/rlinfluence train --env FrozenLake-v1

lint: setup
	$(VENV)/bin/ruff check

test: setup lint
	$(VENV)/bin/pytest -q
