"""A client's budget across runs (fedapp.state.lifetime_budget): basic composition over run lineages, refusal."""

from __future__ import annotations

import numpy as np
from flwr.client import Client
from flwr.common import Code, Context, FitIns, FitRes, RecordDict, Status, ndarrays_to_parameters

from fedapp.clients.guard import guard_client
from fedapp.config import resolve_config
from fedapp.state.lifetime_budget import LifetimeBudget


class Spender(Client):
    """A client whose accountant reports 0.3 more ε every round of a run (per lineage)."""

    def __init__(self) -> None:
        self.rounds: dict[str, int] = {}

    def fit(self, ins: FitIns) -> FitRes:
        lineage = str(ins.config["run-lineage"])
        self.rounds[lineage] = self.rounds.get(lineage, 0) + 1
        metrics = {"client_id": 0, "status": "ok", "epsilon_spent": 0.3 * self.rounds[lineage], "delta": 1e-5,
                   "epsilon_budget": 1.0}
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(2, np.float32)]), 10, metrics)


def _fit(client: Client, lineage: str, rnd: int) -> FitRes:
    return client.fit(FitIns(ndarrays_to_parameters([np.zeros(2, np.float32)]),
                             {"server-round": rnd, "run-lineage": lineage}))


def test_a_second_run_cannot_spend_what_the_first_one_spent(tmp_path):
    cfg = resolve_config(None, {"output-dir": str(tmp_path / "out")})
    node = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "node0")}  # a deployed SuperNode
    inner = Spender()
    ctx_a = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    run_a = guard_client(inner, ctx_a, cfg.general, cfg.data, cfg.training, cfg.deployment)
    for rnd in (1, 2):
        assert _fit(run_a, "run-a", rnd).metrics["status"] == "ok"
    store = LifetimeBudget.for_client(tmp_path / "node0", 0)
    assert store.runs() == {"run-a": {"epsilon": 0.6, "delta": 1e-5}}
    ctx_b = Context(run_id=2, node_id=1, node_config=node, state=RecordDict(), run_config={})
    run_b = guard_client(inner, ctx_b, cfg.general, cfg.data, cfg.training, cfg.deployment)
    assert _fit(run_b, "run-b", 1).metrics["status"] == "ok"  # 0.6 + 0.3 <= 1.0
    refused = _fit(run_b, "run-b", 2)  # 0.6 + 0.6 > 1.0: withheld
    assert refused.metrics["status"] == "refused" and "lifetime budget" in refused.metrics["reason"]
    assert refused.parameters.tensors == []
    assert store.spent_elsewhere("run-c") == (0.6 + 0.3, 2e-5)  # basic composition: ε and δ add up


def test_off_in_simulation_unless_asked(tmp_path):
    cfg = resolve_config(None, {"output-dir": str(tmp_path / "out")})
    node = {"partition-id": 0, "num-partitions": 2}
    client = guard_client(Spender(), Context(run_id=1, node_id=1, node_config=node, state=RecordDict(),
                                             run_config={}), cfg.general, cfg.data, cfg.training,
                          cfg.deployment)
    for lineage in ("a", "b", "c", "d"):  # every run may spend its whole budget
        assert _fit(client, lineage, 1).metrics["status"] == "ok"
    cfg_on = resolve_config(None, {"output-dir": str(tmp_path / "out2"), "lifetime-budget": True})
    client = guard_client(Spender(), Context(run_id=1, node_id=1, node_config=node, state=RecordDict(),
                                             run_config={}), cfg_on.general, cfg_on.data, cfg_on.training,
                          cfg_on.deployment)
    statuses = [_fit(client, lineage, 1).metrics["status"] for lineage in ("a", "b", "c", "d")]
    assert statuses == ["ok", "ok", "ok", "refused"]  # 0.3 per run: the fourth would make 1.2
