#!/usr/bin/env bash
# The GPU device machine's check, one call within its limits (10 min a command, 15 min of device time a session,
# 64 MiB carried): run(command="bash scripts/device/check.sh", carry=[".device"], timeout_s=600) after
# scripts/device/prepare.sh. Installs the carried wheels beside the image's torch (never torch itself), then, each
# step bounded so the whole ends in about 8 minutes:
#   1. the CUDA unit tests of docs/benchmarks/gpu.md;
#   2. the first rounds of one cell of each paper scale the offline data allows, in-process (Ray's wheel does not fit
#      the carry), so that per-round times plan the full tables: Robust-HDP paper-dist2 (Robust-HDP and DPFedAvg),
#      SoteriaFL paper (a9a), Fed-SMP mid-paper-cnn (the paper's 1.66 M-parameter CNN over 5,900 clients);
#   3. the DP-SGD loader comparison of benchmarks/gpu.py (host loader, batches on the GPU, CUDA graphs);
#   4. a summary, $OUT/cells.md, with each cell's round 1, median round, rounds run and projected time.
# CELL_SECONDS (default 75) bounds each cell. A rehearsal on a machine without the GPU: SKIP_INSTALL=1 PY=.venv/bin/python
# TEST_DEVICE=cpu CELL_SECONDS=20 bash scripts/device/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
CELL_SECONDS=${CELL_SECONDS:-75}
PY=${PY:-python3}
TEST_DEVICE=${TEST_DEVICE:-cuda}
[ -n "${SKIP_INSTALL:-}" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/whl/*.whl \
  || { echo "check: the carried wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 MPLBACKEND=Agg
[ -e ../shared/data ] || { mkdir -p ../shared && ln -s "$PWD/.device/data" ../shared/data; }  # the sweep files' data-dir
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  "$PY" -c "import sys, torch, flwr, opacus; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'flwr', flwr.__version__, 'opacus', opacus.__version__)"
} | tee "$OUT/env.txt"
"$PY" -c "import fedapp.experiments.sweep, fedapp.apps.client_app" || { echo "check: fedapp does not import"; exit 1; }

echo "== 1. CUDA unit tests"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider --device "$TEST_DEVICE" tests/unit/fedapp/clients/test_device.py \
  tests/unit/fedapp/clients/test_poisson_batches.py tests/unit/fedapp/clients/test_batched_dpsgd.py \
  tests/unit/fedapp/models/test_dp_models.py 2>&1 | tail -15

echo "== 2. paper-scale cells, ${CELL_SECONDS} s each"
rm -rf /tmp/cells
cell() {  # cell NAME FILE SCALE KEY=VALUE...: the cell's first rounds, stopped at CELL_SECONDS
  local name=$1 file=$2 scale=$3; shift 3
  local only=(); for kv in "$@"; do only+=(--only "$kv"); done
  setsid "$PY" -m fedapp.experiments.sweep "$file" --scale "$scale" --engine inprocess "${only[@]}" \
    --out "/tmp/cells/$name" > "/tmp/cells-$name.log" 2>&1 &
  local pid=$! t=0
  while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$CELL_SECONDS" ]; do sleep 1; t=$((t + 1)); done
  kill -TERM -- "-$pid" 2>/dev/null; sleep 2; kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "$name: stopped after ${t} s; $(grep -c '"round"' /tmp/cells/"$name"/cells/*/*/rounds.jsonl 2>/dev/null | tail -1)"
  grep -h -m3 -i "error\|Traceback" "/tmp/cells-$name.log" | head -3
}
cell robust-hdp-paper-dist2 configs/papers/robust_hdp_table12.toml paper-dist2 strategy=robust-hdp
cell dpfedavg-paper-dist2 configs/papers/robust_hdp_table12.toml paper-dist2 strategy=dpsgd-fedavg
cell soteriafl-paper configs/papers/soteriafl_fig1.toml paper strategy=soteriafl-sgd seed=11
cell fed-smp-paper-cnn configs/papers/fed_smp_table1.toml mid-paper-cnn strategy=fed-smp-randk seed=1

echo "== 3. DP-SGD batches: Opacus' host loader against batches drawn on the GPU (benchmarks/gpu.py loader)"
timeout 90 "$PY" -m benchmarks.gpu loader --device "$TEST_DEVICE" --repeats 1 2>&1 | grep -v "^\[\|INFO" | tail -8

echo "== 4. summary"
"$PY" scripts/device/summarize.py /tmp/cells "$OUT/cells.json" | tee "$OUT/cells.md"
