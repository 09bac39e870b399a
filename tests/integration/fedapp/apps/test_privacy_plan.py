"""`python -m fedapp.run.launch --plan`: every check, then the privacy plan; nothing starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from fedapp.apps.privacy_plan import privacy_plan
from fedapp.config import resolve_config
from strategies.privacy.accountants import epsilon_of


def launch_plan(tmp_path: Path, run_config: str, n: int = 20) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr")}
    return subprocess.run([sys.executable, "-m", "fedapp.run.launch", "--plan", "--num-supernodes", str(n),
                           "--run-config", f"{run_config} output-dir='{tmp_path / 'results'}'"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_the_plan_states_each_adversary_and_starts_nothing(tmp_path: Path) -> None:
    out = launch_plan(tmp_path, "strategy='dp-fedavg' clients-per-round=5 num-server-rounds=10 target-epsilon=2.0 "
                                "secagg-mechanism='gaussian'")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    m, every = plan["mechanism"], plan["every_client"]
    assert m["budget_holds_against"] == "server" and m["sample_rate"] == 0.25 and m["field_bits"] == 32
    # against the server: T unamplified rounds at σ; that is what the budget (2.0) was calibrated for
    assert every["epsilon_vs_server"] == pytest.approx(epsilon_of([(m["noise_multiplier"], 1.0, 10)], m["delta"]))
    assert every["epsilon_vs_server"] <= 2.0 * (1 + 1e-3) and every["epsilon_vs_release"] < every["epsilon_vs_server"]
    assert not (tmp_path / "results").exists() and not (tmp_path / "flwr").exists()


def test_the_plan_refuses_an_epsilon_the_run_would_ignore(tmp_path: Path) -> None:
    out = launch_plan(tmp_path, "strategy='robust-hdp' epsilon=0.01")
    assert out.returncode == 2 and "'epsilon'" in out.stderr and "privacy-dist" in out.stderr


def test_record_level_plan_lists_every_client() -> None:
    cfg = resolve_config(overrides={"strategy": "dpsgd-fedavg", "privacy-dist": "dist3", "num-clients": 6})
    plan = privacy_plan(cfg, 6)
    rows = plan["per_client"]
    assert [r["client_id"] for r in rows] == list(range(6))
    assert all(r["epsilon_vs_server"] == r["epsilon_vs_release"] > 0 for r in rows)  # local DP: one ε for both
    assert all(0 < r["sample_rate"] <= 1 and r["steps_per_round"] >= 1 for r in rows)


def test_a_cohort_beyond_the_widest_field_is_refused() -> None:
    from fedapp.config import ConfigError

    cfg = resolve_config(overrides={"strategy": "dp-fedavg", "secagg-mechanism": "gaussian"})
    with pytest.raises(ConfigError, match="secure-aggregation"):
        privacy_plan(cfg, 2**41)
    cfg = resolve_config(overrides={"strategy": "dp-fedavg", "secagg-bits": 16})  # the discrete Gaussian's field
    with pytest.raises(ConfigError, match="'secagg-bits' = 16: .*cannot count a cohort of 65536"):
        privacy_plan(cfg, 2**16)
