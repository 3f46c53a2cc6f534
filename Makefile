# Fresh machine: `make run` (set up + the built-in comparison) or `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test lint docs

setup: $(VENV)/.installed

# torch is pinned and installed first, explicitly: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# The main job, on FrozenLake, 3 seeds (a few minutes on 2 cores): PPO and IIF at the paper's learning
# rate, and PPO and iif-robust at the learning rates tuned for them on separate seeds
# (benchmarks/studies/FrozenLake-v1.json), every figure against the tuned PPO.
run: setup
	$(VENV)/bin/rlinfluence compare --env FrozenLake-v1 --seeds 3 --rounds 20 --eval-episodes 100 --out runs/demo \
	  --methods ppo-paper-lr=ppo iif-paper-lr=iif ppo=ppo@learning_rate=0.32 \
	  iif-robust=iif@drop_pct=auto,learning_rate=0.16 --reference ppo

lint: setup
	$(VENV)/bin/ruff check

# The user guide and API reference (docs/, mkdocs.yml) -> site/; --strict fails on any warning
# (a broken link or anchor, a page missing from the nav, a docstring mkdocstrings cannot parse).
# Browse it while editing: $(VENV)/bin/mkdocs serve
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# the suite on every core (pytest-xdist): about 4 minutes on 2 idle cores (docs/development.md)
test: setup lint docs
	$(VENV)/bin/pytest -q -n auto
