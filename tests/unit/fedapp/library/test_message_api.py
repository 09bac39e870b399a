"""MessageStrategy: a library strategy as a Flower Message-API strategy. Its train messages carry the legacy fit
instructions the library's clients answer, the replies come back through the engine, a sampled node that does not
answer is a failure of the round, and what it cannot run (a SecAgg+ strategy, a config passed to start) is refused.
(examples/own-model-app runs it under `flwr run`: tests/integration/examples/test_own_model_app.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import client_context
from flwr.app import ConfigRecord, Message
from flwr.app.message_type import MessageType
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.task_identity import TaskIdentity
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedapp.library import (
    DPSGDSettings,
    JsonRecorder,
    MessageStrategy,
    Rounds,
    SecAggSettings,
    client_level_mechanism,
    dp_fedavg,
    dpsgd_client,
    robust_hdp,
)


class _Grid:
    """The part of a ``Grid`` the strategy reads: the run and its nodes."""

    def __init__(self, nodes: list[int]) -> None:
        self.run = SimpleNamespace(run_id=7)
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(120, 6, generator=g), torch.randint(0, 3, (120,), generator=g)),
                      batch_size=20)


@pytest.fixture
def in_a_serverapp(monkeypatch) -> None:
    """Flower stamps every Message with the running task's identity, which a ServerApp process has."""
    for name, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def test_a_round_through_messages_trains_the_clients_and_counts_a_silent_node_as_failed(tmp_path, in_a_serverapp,
                                                                                         monkeypatch) -> None:
    import random

    monkeypatch.setattr("fedapp.clients.common.secrets.randbits", random.Random(5).getrandbits)
    settings = DPSGDSettings(rounds=2, clip_norm=1.0, lr=0.1)
    clients = {node: dpsgd_client(_mlp(), _loader(i), context=client_context(i, 4), settings=settings, epsilon=2.0,
                                  delta=1e-4) for i, node in enumerate((11, 12, 13, 14))}
    strategy = MessageStrategy(robust_hdp(_mlp(), Rounds(num_rounds=2, min_available_clients=4), settings,
                                          recorder=JsonRecorder(tmp_path)))
    grid = _Grid(sorted(clients))
    before = strategy.initial_arrays().to_numpy_ndarrays()
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [11, 12, 13, 14]
    assert {m.metadata.message_type for m in messages} == {MessageType.TRAIN}
    replies = []
    for m in messages:
        if m.metadata.dst_node_id == 14:
            continue  # node 14 never answers
        res = clients[m.metadata.dst_node_id].fit(compat.recorddict_to_fitins(m.content, keep_input=True))
        replies.append(Message(content=compat.fitres_to_recorddict(res, keep_input=False), reply_to=m))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    after = arrays.to_numpy_ndarrays()
    assert any(np.abs(a - b).max() > 0 for a, b in zip(after, before))
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))  # no federated evaluation: the round is written
    strategy.strategy.flush_round()
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    statuses = {c.get("client_id"): c["status"] for c in record["clients"]}
    assert [statuses[i] for i in range(3)] == ["ok"] * 3, record["clients"]
    assert record["metrics"]["clients_failed"] == 1, record["metrics"]


def test_what_the_message_api_cannot_run_is_refused(in_a_serverapp) -> None:
    mech = client_level_mechanism(num_clients=4, rounds=2, clip=1.0, noise_multiplier=1.0, clients_per_round=4,
                                  secure_aggregation=True)
    with pytest.raises(ValueError, match="built for SecAgg\\+"):
        MessageStrategy(dp_fedavg(_mlp(), Rounds(num_rounds=2, clients_per_round=4), mech, secagg=SecAggSettings()))
    strategy = MessageStrategy(robust_hdp(_mlp(), Rounds(num_rounds=2), DPSGDSettings(rounds=2)))
    with pytest.raises(ValueError, match="train_config=.*'lr'.*refused"):
        strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord({"lr": 0.5}), _Grid([1, 2]))
