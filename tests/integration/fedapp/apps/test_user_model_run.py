"""A user's own model (``model = "module:factory"`` from a folder outside the project) trains in a real Flower
simulation with DP-SGD clients, grad-sample-mode auto timing the modes that run on it (issue 56, item 2)."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from conftest import read_rounds, run_small_simulation

USER_MODULE = textwrap.dedent('''
    import math
    from torch import nn

    def make(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU(),
                             nn.Linear(32, num_classes))
''')


@pytest.mark.slow
def test_robust_hdp_trains_a_users_model_from_outside_the_project(tmp_path, monkeypatch):
    user = tmp_path / "user_code"
    user.mkdir()
    (user / "my_lab_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(user))
    monkeypatch.setenv("PYTHONPATH", str(user) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # the Ray actors
    try:
        run_dir = run_small_simulation({"strategy": "robust-hdp", "num-server-rounds": 2, "model": "my_lab_models:make",
                                        "output-dir": str(tmp_path / "results"), "grad-sample-mode": "auto",
                                        "privacy-dist": "dist2", "fraction-evaluate": 0.0}, num_supernodes=3)
    finally:
        sys.modules.pop("my_lab_models", None)
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert [c["status"] for c in r["clients"]] == ["ok"] * 3
        assert all(c["epsilon_spent"] <= c["epsilon_budget"] * (1 + 1e-9) for c in r["clients"])
        assert r["metrics"]["accuracy"] is not None
