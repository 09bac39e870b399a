#!/usr/bin/env bash
# Prepare what the GPU device machine's check (scripts/device/check.sh) carries: Python 3.12 wheels of the packages
# its image lacks, at the versions this checkout runs, and the offline datasets as gzip files. Run here, in the
# repository root, with network to the package registry; writes .device/ (ignored by .gitignore).
# Then: run(command="bash scripts/device/check.sh", carry=[".device"], timeout_s=600).
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-../shared/data}
PY=${PY:-.venv/bin/python}
rm -rf .device && mkdir -p .device/whl .device/data/MNIST/raw .device/data/a9a
# the device image holds torch, numpy, scipy, scikit-learn, matplotlib, pandas, pyarrow and rich; these it lacks, or
# holds at versions Flower 1.41 refuses (typer >= 0.21)
pkgs=(flwr flwr-datasets datasets dill multiprocess cryptography cffi grpcio grpcio-health-checking protobuf iterators
      pycryptodome dp-accounting opacus randomgen tensorboardX tomli-w typer click)
pins=()
for p in "${pkgs[@]}"; do
  v=$("$PY" -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "prepare: $p is not installed in $PY" >&2; exit 1; }
  pins+=("$p==$v")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
  -d .device/whl "${pins[@]}"
cp "$DATA"/MNIST/raw/*.gz .device/data/MNIST/raw/
cp -r "$DATA"/a9a/. .device/data/a9a/
du -sh .device/whl .device/data
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb .device | cut -f1)
echo "prepare: working tree $((tracked / 1048576)) MiB + .device $((carried / 1048576)) MiB (limit 64 MiB)"
[ $((tracked + carried)) -lt $((64 * 1048576)) ] || { echo "prepare: over the 64 MiB the device call carries" >&2; exit 1; }
