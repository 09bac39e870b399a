# Two commands do everything: `make run` (main job, offline) and `make test`.
# Both create or reuse .venv idempotently; the install step reruns only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NUM_SUPERNODES ?= 20
RUN_CONFIG ?= configs/main.toml
ENGINE ?= superlink
CLIENT_BACKEND ?= auto
VERBOSE ?=
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FLWR_HOME := $(CURDIR)/.flwr
export MPLBACKEND := Agg

.PHONY: run test test-flwr-next lint bench-quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: `pip install torch==2.13.0` takes the local CPU wheel; an unpinned
# torch would pull GBs of CUDA packages.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]" -c constraints.txt
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m fedapp.run.launch --num-supernodes $(NUM_SUPERNODES) --run-config "$(RUN_CONFIG)" --engine $(ENGINE) \
		--client-backend $(CLIENT_BACKEND) $(if $(VERBOSE),--verbose)

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -ra --durations=15

# Flower's next release beside the pinned one: an overlay venv holding only flwr 1.42 (and the uv it requires) over
# .venv's packages and the repository, running the compat surface (every patched symbol's signature), the SecAgg+ and
# distributed discrete Gaussian transport, and one TLS deployment of three SuperNodes.
NEXT_VENV := .venv-flwr142
NEXT_FLWR := flwr==1.42.0
$(NEXT_VENV)/.installed: $(STAMP)
	$(PYTHON) -m venv --clear $(NEXT_VENV)
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"]); print("$(CURDIR)")' \
		> "$$($(NEXT_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dpfl-main-venv.pth"
	$(NEXT_VENV)/bin/python -m pip install -q --no-deps "$(NEXT_FLWR)" "uv>=0.13.5,<0.14"
	touch $@

test-flwr-next: $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -c 'import flwr; assert flwr.__version__.startswith("1.42."), flwr.__version__'
	$(NEXT_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider tests/unit/fedapp/compat \
		tests/unit/fedapp/privacy/test_secure_sum_safety.py tests/unit/fedapp/privacy/test_masks.py tests/unit/fedapp/library/test_message_api.py \
		tests/integration/fedapp/privacy/test_ddg_secure_sum.py tests/integration/fedapp/privacy/test_secure_aggregation.py \
		"tests/integration/fedapp/run/test_deploy.py::test_tls_authenticated_federation_of_three_supernodes"

lint: $(STAMP)
	$(PY) -m ruff check fedapp strategies tests benchmarks
	$(PY) -m mypy

bench-quick: $(STAMP)
	$(PY) -m benchmarks.foundation --quick

clean:
	rm -rf results .flwr .pytest_cache $(NEXT_VENV)
