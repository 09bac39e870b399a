"""Notebooks in notebooks/: committed without outputs, and each executes without error (default, small setting)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO as ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart", "robust_hdp", "fed_smp", "soteriafl", "dp2_fedsam", "dp_ftrl"}


def test_every_family_has_a_notebook():
    assert {p.stem for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_clean(path: Path):
    """No outputs, no execution counts, a FULL switch, and results read from the run folder."""
    book = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in book["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{path.name} has outputs"
    source = "\n".join("".join(c["source"]) for c in code)
    assert "FULL = False" in source
    assert "nbu.load_rounds(" in source and "plt." in source


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, tmp_path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    book = nbformat.read(path, as_version=4)
    env = {"MPLBACKEND": "Agg", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DPFL_NOTEBOOK_OUT": str(tmp_path), "PYTHONHASHSEED": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client = nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(ROOT)}})
        start = time.perf_counter()
        client.execute()  # raises CellExecutionError naming the failing cell
        seconds = time.perf_counter() - start
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(f"{path.name}: executed in {seconds:.1f} s (python {sys.version.split()[0]})")
    runs = [p for p in tmp_path.rglob("rounds.jsonl")]
    assert runs, f"{path.name} wrote no results folder under {tmp_path}"
    assert all(p.read_text().strip() for p in runs), "a run folder has an empty rounds.jsonl"
    images = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} showed no plot"
