"""A user's own model (``model = "module:factory"``) and own data (``dataset = "module:loader"``), from a folder outside
the project, train in real Flower simulations with DP-SGD clients, grad-sample-mode auto timing the modes that run on
the model."""

from __future__ import annotations

import textwrap

import pytest
from conftest import install_user_module, read_rounds, run_small_simulation

USER_MODULE = textwrap.dedent('''
    import math
    import numpy as np
    from torch import nn

    def make(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU(),
                             nn.Linear(32, num_classes))

    def blobs():
        rng = np.random.default_rng(0)
        y = rng.integers(0, 3, 600)
        x = (rng.normal(size=(600, 16)) + 2.0 * np.eye(3, 16)[y]).astype(np.float32)
        return (x[:480], y[:480]), (x[480:], y[480:])
''')


@pytest.mark.slow
def test_robust_hdp_trains_a_users_model_from_outside_the_project(tmp_path, monkeypatch):
    module = install_user_module(tmp_path, monkeypatch, "my_lab_models", USER_MODULE)
    run_dir = run_small_simulation({"strategy": "robust-hdp", "num-server-rounds": 2, "model": f"{module}:make",
                                    "output-dir": str(tmp_path / "results"), "grad-sample-mode": "auto",
                                    "privacy-dist": "dist2", "fraction-evaluate": 0.0}, num_supernodes=3)
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert [c["status"] for c in r["clients"]] == ["ok"] * 3
        assert all(c["epsilon_spent"] <= c["epsilon_budget"] * (1 + 1e-9) for c in r["clients"])
        assert r["metrics"]["accuracy"] is not None


@pytest.mark.slow
def test_a_users_loader_feeds_the_partitioned_clients(tmp_path, monkeypatch):
    module = install_user_module(tmp_path, monkeypatch, "my_lab_data", USER_MODULE)
    run_dir = run_small_simulation({"strategy": "dpsgd-fedavg", "num-server-rounds": 2, "dataset": f"{module}:blobs",
                                    "model": f"{module}:make", "partitioner": "dirichlet", "lr": 0.3,
                                    "output-dir": str(tmp_path / "results"), "privacy-dist": "fixed",
                                    "epsilon": 5.0, "fraction-evaluate": 0.0}, num_supernodes=3)
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(c["status"] == "ok" for r in rounds for c in r["clients"])
    assert sum(c["num_examples"] for c in rounds[0]["clients"]) <= 480  # the user's training pool, partitioned
    assert rounds[-1]["metrics"]["accuracy"] > 1 / 3  # central test on the user's 120 test rows: above chance
