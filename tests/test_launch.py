"""`flwr run` through the launcher (the `make run` path): real SuperLink, stopped by PID afterwards."""

from __future__ import annotations

import json

import psutil
import pytest

from fedapp.config import ConfigError
from fedapp.launch import free_port, run


def _flower_processes(marker: str = "") -> set[int]:
    """Flower server-side processes (optionally only those whose command line mentions ``marker``)."""
    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(n in cmd for n in ("flower-superlink", "flower-superexec", "flwr-simulation")) and marker in cmd:
            out.add(p.info["pid"])
    return out


@pytest.mark.slow
def test_flwr_run_end_to_end_and_nothing_left_running(tmp_path):
    port = free_port()
    run_dir = run(num_supernodes=3, run_config=f"num-server-rounds=1 output-dir='{tmp_path}' strategy='fedavg'",
                  flwr_home=tmp_path / "flwr-home", timeout=300, port=port)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 1 and summary["finished"]
    assert run_dir.parent == tmp_path
    leftovers = _flower_processes(f"127.0.0.1:{port}") | _flower_processes(f"--port {port}")
    assert not leftovers, f"processes left running: {leftovers}"


def test_bad_config_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="'delta' = 2.0"):
        run(num_supernodes=3, run_config=f"delta=2.0 output-dir='{tmp_path}/out'", flwr_home=tmp_path / "h")
    with pytest.raises(ConfigError, match="batch-size 400 > its dataset size"):
        run(num_supernodes=3, run_config=f"batch-size=400 output-dir='{tmp_path}/out'", flwr_home=tmp_path / "h")
    assert not (tmp_path / "out").exists() and not (tmp_path / "h").exists()
    assert _flower_processes(str(tmp_path)) == set()
