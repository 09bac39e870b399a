"""A Ray actor's BLAS pools follow the OMP_NUM_THREADS Ray sets after numpy has started them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_CHILD = """
import json, os
import numpy  # starts OpenBLAS sized to the cores, as a prestarted Ray worker does
from threadpoolctl import threadpool_info
before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
os.environ["OMP_NUM_THREADS"] = "1"  # what Ray sets when the actor starts
from fedapp.compat.blas_threads import limit_to_allotment
limit = limit_to_allotment()
after = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
print(json.dumps([before, limit, after]))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: numpy's BLAS pool already has one thread")
def test_the_pools_numpy_started_shrink_to_the_actors_allotment() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    root = Path(__file__).resolve().parents[4]  # the repository: the child imports fedapp from it
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True, cwd=root)
    before, limit, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(before) >= 2 and limit == 1 and after and set(after) == {1}


def test_a_process_without_an_allotment_is_left_alone(monkeypatch) -> None:
    from fedapp.compat import blas_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    blas_threads.limit_to_allotment.cache_clear()
    try:
        assert blas_threads.limit_to_allotment() is None
        monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
        blas_threads.limit_to_allotment.cache_clear()
        assert blas_threads.limit_to_allotment() is None
    finally:
        blas_threads.limit_to_allotment.cache_clear()


def test_every_node_client_applies_the_allotment_first(monkeypatch) -> None:
    from fedapp.apps import client_app

    calls: list[str] = []
    monkeypatch.setattr(client_app, "limit_to_allotment", lambda: calls.append("limit"))

    def stop(*_args: object) -> None:
        calls.append("config")
        raise RuntimeError("stop here")

    monkeypatch.setattr(client_app, "resolve_config", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        client_app.node_client(SimpleNamespace(run_config={}, node_config={}))
    assert calls == ["limit", "config"]
