"""Notebooks in notebooks/: committed with the outputs of their `demo` setting (small, plots included), and each
executes without error in its `smoke` setting (DPFL_NOTEBOOK_SETTING=smoke), so CI stays fast."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO as ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart", "robust_hdp", "fed_smp", "soteriafl", "dp2_fedsam", "dp_ftrl", "own_data"}
MAX_TEXT_OUTPUT = 4_000  # characters of text a committed code cell may show: no Flower logs in the outputs


def test_every_family_has_a_notebook():
    assert {p.stem for p in NOTEBOOKS} >= EXPECTED


def _text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    return "".join(output.get("data", {}).get("text/plain", ""))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_with_demo_outputs(path: Path):
    """Executed top to bottom in the demo setting, without errors or stderr, with at least one plot, small outputs,
    a SETTING switch the test below can set, and results read from the run folder."""
    book = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in book["cells"] if c["cell_type"] == "code"]
    source = "\n".join("".join(c["source"]) for c in code)
    assert 'SETTING = os.environ.get("DPFL_NOTEBOOK_SETTING", "demo")' in source
    assert "nbu.load_rounds(" in source and "plt." in source
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not executed once top to bottom: {counts}"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert "setting: demo" in "".join(_text(o) for o in outputs), f"{path.name}: outputs not from the demo setting"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} shows no plot"
    assert not [o for o in outputs if o.get("output_type") == "error" or o.get("name") == "stderr"], \
        f"{path.name}: an error or stderr in the committed outputs"
    for i, c in enumerate(code):
        size = sum(len(_text(o)) for o in c.get("outputs", []))
        assert size <= MAX_TEXT_OUTPUT, f"{path.name}, code cell {i}: {size} characters of text output"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, tmp_path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:  # the committed outputs are the demo setting's; this run writes its own
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = {"MPLBACKEND": "Agg", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DPFL_NOTEBOOK_OUT": str(tmp_path), "PYTHONHASHSEED": "0", "DPFL_NOTEBOOK_SETTING": "smoke"}
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
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert "setting: smoke" in "".join(_text(o) for o in outputs)
    runs = [p for p in tmp_path.rglob("rounds.jsonl")]
    assert runs, f"{path.name} wrote no results folder under {tmp_path}"
    assert all(p.read_text().strip() for p in runs), "a run folder has an empty rounds.jsonl"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} showed no plot"
