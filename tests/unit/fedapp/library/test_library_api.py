"""fedapp.library: the project's DP clients around a user's own model, data and loss, and the strategy builders."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import client_context, one_round
from flwr.common import Code, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fedapp.library import (
    DataProblem,
    DPSGDSettings,
    ModelProblem,
    Rounds,
    client_level_client,
    client_level_mechanism,
    dp_fedavg,
    dpsgd_client,
    robust_hdp,
)
from strategies.client_level import CFG_SIGMA
from strategies.privacy.accountants import epsilon_of, record_accountant
from strategies.privacy.mechanisms import cached_epsilon
from strategies.robust_hdp import RobustHDP


def _data(n: int = 120, features: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long() * (classes - 2))


def _mlp(features: int = 6, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))


def _fit(client, weights: list[np.ndarray], config: dict):
    res = client.fit(FitIns(ndarrays_to_parameters(weights), config))
    assert res.status.code == Code.OK
    return parameters_to_ndarrays(res.parameters), dict(res.metrics)


class CountingCE(nn.Module):
    """Cross-entropy (batch mean) that counts its calls."""

    reduction = "mean"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return nn.functional.cross_entropy(out, y)


def test_dpsgd_client_spends_exactly_its_budget_as_the_accountant_composes_then_refuses():
    settings = DPSGDSettings(rounds=2, clip_norm=1.0, lr=0.1)
    loss = CountingCE()
    model = _mlp()
    client = dpsgd_client(model, DataLoader(_data(), batch_size=20), _data(40, seed=1), context=client_context(0, 3),
                          settings=settings, epsilon=2.0, delta=1e-4, loss=loss)
    weights = [w.detach().numpy().copy() for w in model.state_dict().values()]
    kind = record_accountant("rdp", "replace-one")
    history = []
    for rnd in (1, 2):
        update, m = _fit(client, weights, {"server-round": rnd})
        assert m["status"] == "ok" and m["client_id"] == 0 and m["record_neighbours"] == "replace-one"
        assert m["sample_rate"] == pytest.approx(1 / math.ceil(120 / 20)) and m["steps_round"] == 6
        history.append((m["noise_multiplier"], m["sample_rate"], m["steps_round"]))
        assert m["epsilon_spent"] == pytest.approx(epsilon_of(history, 1e-4, kind), rel=1e-9)
        assert any(np.abs(u).max() > 0 for u in update)
    assert m["epsilon_spent"] == pytest.approx(2.0, rel=2e-3) and m["epsilon_spent"] <= 2.0 * (1 + 1e-3)
    assert loss.calls >= 12  # the user's loss is what DP-SGD minimized (some Poisson batches may be empty)
    update, m = _fit(client, weights, {"server-round": 3})
    assert m["status"] == "refused" and update == [] and "budget" in str(m["reason"]).lower()


def test_dpsgd_client_evaluates_with_the_users_loss_on_its_own_test_data():
    model = _mlp()
    client = dpsgd_client(model, (_data().tensors[0].numpy(), _data().tensors[1].numpy()), _data(40, seed=1),
                          context=client_context(1, 3), settings=DPSGDSettings(rounds=1), epsilon=1.0, delta=1e-4,
                          batch_size=10)
    from flwr.common import EvaluateIns

    weights = [w.detach().numpy().copy() for w in model.state_dict().values()]
    res = client.evaluate(EvaluateIns(ndarrays_to_parameters(weights), {"server-round": 1}))
    x, y = _data(40, seed=1).tensors
    with torch.no_grad():
        out = model(x)
    assert res.num_examples == 40 and res.metrics["client_id"] == 1
    assert res.loss == pytest.approx(float(nn.functional.cross_entropy(out, y)), rel=1e-5)
    assert res.metrics["accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()))


@pytest.mark.parametrize(("model", "loss", "needle"), [
    (nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), None, "BatchNorm1d -> GroupNorm"),
    (_mlp(), nn.CrossEntropyLoss(reduction="sum"), "reduction = 'sum'"),
    (_mlp(classes=2), None, "class scores with k > 2"),
    (_mlp(features=5), None, "inputs of shape (2, 6)"),
    ("not a model", None, "not a torch.nn.Module"),
])
def test_a_model_or_loss_dpsgd_cannot_train_is_refused_naming_the_problem(model, loss, needle):
    with pytest.raises(ModelProblem) as err:
        dpsgd_client(model, DataLoader(_data(), batch_size=20), context=client_context(0, 3),
                     settings=DPSGDSettings(rounds=1), epsilon=1.0, delta=1e-4, loss=loss)
    assert needle in str(err.value), str(err.value)


class _InPlaceMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.relu(self.hidden(x), inplace=True))


def test_dpsgd_client_trains_with_the_chosen_grad_sample_mode_and_checks_bk_on_the_model_first(monkeypatch):
    from fedapp.clients import book_keeping

    calls = []
    real = book_keeping.BookKeeping.clipped_sum
    monkeypatch.setattr(book_keeping.BookKeeping, "clipped_sum", lambda self, *a: calls.append(1) or real(self, *a))
    kwargs = dict(context=client_context(0, 3), settings=DPSGDSettings(rounds=1), epsilon=1.0, delta=1e-4)
    model = _mlp()
    client = dpsgd_client(model, DataLoader(_data(), batch_size=20), grad_sample_mode="bk", **kwargs)
    update, m = _fit(client, [w.detach().numpy().copy() for w in model.state_dict().values()], {"server-round": 1})
    assert m["status"] == "ok" and any(np.abs(u).max() > 0 for u in update)
    assert len(calls) >= 1 + 3  # the check on the model, then the round's non-empty Poisson batches (6 expected)
    with pytest.raises(ModelProblem, match="'hidden' was changed in place"):
        dpsgd_client(_InPlaceMLP(), DataLoader(_data(), batch_size=20), grad_sample_mode="bk", **kwargs)
    dpsgd_client(_InPlaceMLP(), DataLoader(_data(), batch_size=20), grad_sample_mode="hooks", **kwargs)  # Opacus' hooks
    with pytest.raises(ValueError, match="grad_sample_mode = 'ghost'"):
        dpsgd_client(_mlp(), DataLoader(_data(), batch_size=20), grad_sample_mode="ghost", **kwargs)


def test_unreadable_data_and_missing_batch_size_are_refused():
    class Dicts(Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.zeros(6), "y": 0}

    kwargs = {"context": client_context(0, 3), "settings": DPSGDSettings(rounds=1), "epsilon": 1.0, "delta": 1e-4}
    with pytest.raises(DataProblem, match="item 0 of the train data is a dict, not an \\(x, y\\) pair"):
        dpsgd_client(_mlp(), Dicts(), batch_size=2, **kwargs)
    with pytest.raises(ValueError, match="pass batch_size >= 1"):
        dpsgd_client(_mlp(), _data(), **kwargs)


def test_settings_refuse_bad_values_by_name():
    with pytest.raises(ValueError, match="clip_norm = 0.0 must be a finite number > 0; accountant = 'x'"):
        DPSGDSettings(rounds=2, clip_norm=0.0, accountant="x")
    with pytest.raises(ValueError, match="min_available_clients = 1 must be >= 2"):
        Rounds(num_rounds=2, min_available_clients=1)


def test_client_level_client_clips_and_noises_with_the_servers_mechanism():
    mech = client_level_mechanism(num_clients=2, rounds=2, clip=0.5, target_epsilon=4.0)
    assert not mech.secure_aggregation and math.isclose(cached_epsilon(mech, None), 4.0, rel_tol=2e-3)
    model = _mlp()
    client = client_level_client(model, DataLoader(_data(), batch_size=20), context=client_context(0, 2),
                                 mechanism=mech, lr=0.1)
    weights = [w.detach().numpy().copy() for w in model.state_dict().values()]
    update, m = _fit(client, weights, {"server-round": 1, CFG_SIGMA: mech.noise_multiplier})
    assert m["status"] == "ok" and m["epsilon_spent"] == pytest.approx(cached_epsilon(mech, 1))
    assert "update_norm" not in m and "train_loss" not in m  # nothing about the data leaves unprotected
    assert [u.shape for u in update] == [w.shape for w in weights]
    _, m = _fit(client, weights, {"server-round": 2, CFG_SIGMA: mech.noise_multiplier * 0.5})
    assert m["status"] == "refused" and "noise multiplier" in str(m["reason"])


def test_strategy_builders_pass_the_shared_settings_and_refuse_what_they_cannot_run():
    settings = DPSGDSettings(rounds=3, clip_norm=0.7, lr=0.2, lr_decay=0.5, momentum=0.1)
    strategy = robust_hdp(_mlp(), Rounds(num_rounds=3), settings)
    assert isinstance(strategy, RobustHDP) and strategy.clip_norm == 0.7 and strategy.momentum == 0.1
    assert strategy.lr_schedule is not None and strategy.lr_schedule(3) == pytest.approx(0.05)
    assert strategy.num_params == sum(p.numel() for p in _mlp().parameters())
    mech = client_level_mechanism(num_clients=4, rounds=2, clip=1.0, noise_multiplier=2.0, clients_per_round=2)
    assert dp_fedavg(_mlp(), Rounds(num_rounds=2, clients_per_round=2), mech).private
    with pytest.raises(ValueError, match="planned for r = 2 of n = 4"):
        dp_fedavg(_mlp(), Rounds(num_rounds=2), mech)
    with pytest.raises(ValueError, match="exactly one of target_epsilon and noise_multiplier"):
        client_level_mechanism(num_clients=4, rounds=2, clip=1.0)


def test_robust_hdp_aggregates_the_dpsgd_clients_and_charges_each_its_declared_epsilon(tmp_path, monkeypatch):
    """With 3 clients Robust PCA's noise estimates vary from draw to draw (one update in four was estimated above the
    2× band of its declared noise and rejected), so the clients' secret noise seeds are fixed here."""
    import random

    from fedapp.library import JsonRecorder

    draws = random.Random(5)
    monkeypatch.setattr("fedapp.clients.common.secrets.randbits", draws.getrandbits)

    settings = DPSGDSettings(rounds=2, clip_norm=1.0, lr=0.1)
    eps = [1.0, 2.0, 4.0]
    clients = [dpsgd_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), context=client_context(i, 3),
                            settings=settings, epsilon=eps[i], delta=1e-4) for i in range(3)]
    strategy = robust_hdp(_mlp(), Rounds(num_rounds=2, min_available_clients=3), settings,
                          recorder=JsonRecorder(tmp_path))
    record = one_round(strategy, clients, tmp_path)
    by_id = {c["client_id"]: c for c in record["clients"]}
    assert {c["status"] for c in by_id.values()} == {"ok"}, record["clients"]
    for i in range(3):  # the server's ledger: one of two planned rounds, from the declared (z, q, steps)
        assert 0 < by_id[i]["epsilon_spent"] < eps[i] and by_id[i]["epsilon_budget"] == eps[i]
    assert by_id[0]["aggregation_weight"] < by_id[2]["aggregation_weight"]


def test_dp_fedavg_aggregates_the_client_level_clients_and_charges_the_mechanism(tmp_path):
    from fedapp.library import JsonRecorder

    mech = client_level_mechanism(num_clients=2, rounds=2, clip=0.5, target_epsilon=4.0)
    clients = [client_level_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), context=client_context(i, 2),
                                   mechanism=mech, lr=0.1) for i in range(2)]
    strategy = dp_fedavg(_mlp(), Rounds(num_rounds=2), mech, recorder=JsonRecorder(tmp_path))
    record = one_round(strategy, clients, tmp_path)
    assert [c["status"] for c in record["clients"]] == ["ok", "ok"], record["clients"]
    assert record["metrics"]["epsilon"] == pytest.approx(cached_epsilon(mech, 1), rel=1e-3)
    with pytest.raises(ValueError, match="above 1/\\(10 n\\)"):
        client_level_mechanism(num_clients=2, rounds=2, clip=0.5, target_epsilon=4.0, delta=0.2)
