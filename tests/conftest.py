"""Shared fixtures: real data locations and a helper to run small real Flower simulations."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "MNIST" / "raw").is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA


def run_small_simulation(overrides: dict[str, Any], num_supernodes: int = 4) -> Path:
    """Run a real in-process Flower simulation (Ray backend) and return its results folder."""
    from flwr.simulation import run_simulation

    from fedapp.client_app import build_client_app
    from fedapp.server_app import build_server_app

    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    out = Path(overrides["output-dir"])
    before = set(out.iterdir()) if out.exists() else set()
    run_simulation(
        build_server_app(overrides), build_client_app(overrides), num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False}},
    )
    runs = sorted(p for p in set(out.iterdir()) - before if not p.name.startswith(".")) if out.exists() else []
    assert len(runs) == 1, f"expected one new results folder under {out}, found {runs}"
    return runs[0]


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]
