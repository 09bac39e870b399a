"""Node-local data in a real deployment: each SuperNode trains a user's model (a module outside the project) on its own
.npz named by its node-config ``data-path``; the server builds the model from run-config ``input-shape`` and
``num-classes`` and never reads the data; a node whose file does not fit the schema refuses and the others go on."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from conftest import install_user_module

from fedapp.config import resolve_config
from fedapp.data.node_data import node_splits
from fedapp.run.processes import to_toml_assignments

MODEL = textwrap.dedent("""
    import torch.nn as nn

    def make(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(int(input_shape[0]), 24), nn.ReLU(), nn.Linear(24, num_classes))
""")
SIZES = (60, 90, 120)


def _write_nodes(folder, features=(16, 16, 16, 16)) -> list[str]:
    paths = []
    for cid, n in enumerate(SIZES + ((40,) if len(features) > 3 else ())):
        rng = np.random.default_rng(cid)
        y = rng.integers(0, 3, n)
        x = rng.normal(size=(n, features[cid])).astype(np.float32) + y[:, None]
        np.savez(folder / f"node{cid}.npz", x=x, y=y)
        paths.append(str(folder / f"node{cid}.npz"))
    return paths


def _rounds(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_robust_hdp_trains_each_supernode_on_its_own_file_and_a_bad_node_refuses(tmp_path, monkeypatch) -> None:
    """Three SuperNodes with their own .npz (60, 90, 120 examples) and a fourth whose file has 4 features against the
    schema's 16: the launcher's look at the files is skipped, so the fourth node's own check is what is observed."""
    from fedapp.run.deploy import deploy

    module = install_user_module(tmp_path, monkeypatch, "clinic_net", MODEL)
    paths = _write_nodes(tmp_path, features=(16, 16, 16, 4))
    run = {"strategy": "robust-hdp", "num-server-rounds": 3, "dataset": "node-local", "model": f"{module}:make",
           "input-shape": "[16]", "num-classes": 3, "output-dir": str(tmp_path / "results")}
    res = deploy(4, to_toml_assignments(run), node_overrides=[f"{i}:data-path={p}" for i, p in enumerate(paths)],
                 work_dir=tmp_path / "work", timeout=480, log=lambda *_: None, check_data=False)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_trained"] == 3 and res.leftover_pids == []
    assert summary["final_accuracy"] is None and summary["evaluation"].startswith("federated only")
    cfg = resolve_config({**run, "num-clients": 4})
    train_sizes = {cid: len(node_splits({"data-path": paths[cid]}, cfg.data, cfg.general.seed, cid)[0])
                   for cid in range(3)}
    for rec in _rounds(res.run_dir):
        by_id = {c["client_id"]: c for c in rec["clients"]}
        assert {cid: by_id[cid]["num_examples"] for cid in range(3)} == train_sizes  # each its own file's N_i
        assert all(by_id[cid]["status"] == "ok" for cid in range(3))
        assert by_id[3]["status"] == "refused"
        assert "node-config 'data-path'" in by_id[3]["reason"] and "run-config 'input-shape' is [16]" in by_id[3]["reason"]
    assert len(set(train_sizes.values())) == 3  # the three files differ, so each N_i names its file


@pytest.mark.slow
def test_dp_fedavg_under_secagg_trains_each_supernode_on_its_own_file(tmp_path, monkeypatch) -> None:
    """DP-FedAvg with SecAgg+ and its default mechanism (the distributed discrete Gaussian): a client-level reply
    carries num_examples = 1 whatever N_i (the sum must not reveal data sizes), so what each node read is checked in
    its own SuperNode log, which stays on the node."""
    from fedapp.run.deploy import deploy

    module = install_user_module(tmp_path, monkeypatch, "clinic_net", MODEL)
    paths = _write_nodes(tmp_path, features=(16, 16, 16))
    run = {"strategy": "dp-fedavg", "num-server-rounds": 3, "dataset": "node-local", "model": f"{module}:make",
           "input-shape": "[16]", "num-classes": 3, "output-dir": str(tmp_path / "results")}
    res = deploy(3, to_toml_assignments(run), node_overrides=[f"{i}:data-path={p}" for i, p in enumerate(paths)],
                 work_dir=tmp_path / "work", timeout=480, log=lambda *_: None)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_trained"] == 3 and res.leftover_pids == []
    assert summary["evaluation"].startswith("federated only") and summary["epsilon_vs_server_proven"] is True
    for rec in _rounds(res.run_dir):
        assert rec["metrics"]["secure_aggregation"] is True
        assert rec["metrics"]["secure_sum"] == "distributed discrete Gaussian"
        assert [c["status"] for c in rec["clients"]] == ["ok"] * 3
    cfg = resolve_config({**run, "num-clients": 3})
    for cid, path in enumerate(paths):
        train, val, test = node_splits({"data-path": path}, cfg.data, cfg.general.seed, cid)
        log = (res.work_dir / f"supernode-{cid}.log").read_text()
        assert (f"client {cid} trains on its own data-path {path}: {len(train)} train, {len(val)} validation, "
                f"{len(test)} local test examples") in log
        assert len(train) + len(val) + len(test) == SIZES[cid]
