# Two commands do everything: `make run` (main job, offline) and `make test`.
# Both create or reuse .venv idempotently; the install step reruns only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NUM_SUPERNODES ?= 20
RUN_CONFIG ?= configs/main.toml
ENGINE ?= superlink
VERBOSE ?=
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FLWR_HOME := $(CURDIR)/.flwr
export MPLBACKEND := Agg

.PHONY: run test lint bench-quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: `pip install torch==2.13.0` takes the local CPU wheel; an unpinned
# torch would pull GBs of CUDA packages.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m fedapp.run.launch --num-supernodes $(NUM_SUPERNODES) --run-config "$(RUN_CONFIG)" --engine $(ENGINE) $(if $(VERBOSE),--verbose)

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -ra --durations=15

lint: $(STAMP)
	$(PY) -m ruff check fedapp strategies tests benchmarks
	$(PY) -m mypy

bench-quick: $(STAMP)
	$(PY) -m benchmarks.foundation --quick

clean:
	rm -rf results .flwr .pytest_cache
