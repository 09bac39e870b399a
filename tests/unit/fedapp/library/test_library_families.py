"""fedapp.library beyond Robust-HDP and dense DP-FedAvg: WeiAvg, PFA, min-eps, Fed-SMP rand-k/top-k, FedAvg-randk/topk,
DP-FTRL, SoteriaFL and DP2-FedSAM, each built from typed arguments around a user's own model, data and loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import client_context, one_round
from flwr.common import Code, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedapp.library import (
    DP2FedSAMSettings,
    DPSGDSettings,
    JsonRecorder,
    ModelProblem,
    Rounds,
    SoteriaFLSettings,
    central_evaluation,
    client_level_client,
    client_level_mechanism,
    dp2_fedsam,
    dp2_fedsam_client,
    dp_ftrl,
    dpsgd_client,
    fed_smp,
    ftrl_client,
    ftrl_mechanism,
    min_eps,
    pfa,
    public_update,
    soteriafl,
    soteriafl_client,
    sparse_fedavg,
    weiavg,
)
from strategies.client_level import CFG_SIGMA
from strategies.compression import num_kept, top_k_indices
from strategies.fed_smp import CFG_MASK, CFG_SPARSIFIER
from strategies.privacy.accountants import epsilon_of, record_accountant
from strategies.privacy.mechanisms import cached_epsilon
from strategies.robust_hdp import PFA, MinEpsilon, WeiAvg
from strategies.soteriafl import fit_seed, noise_history


def _data(n: int = 120, features: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _mlp(features: int = 6, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))


def _weights(model: nn.Module) -> list[np.ndarray]:
    return [w.detach().numpy().copy() for w in model.state_dict().values()]


def _fit(client, weights: list[np.ndarray], config: dict):
    res = client.fit(FitIns(ndarrays_to_parameters(weights), config))
    assert res.status.code == Code.OK
    return parameters_to_ndarrays(res.parameters), dict(res.metrics)


# ----------------------------------------------------------------------------- Robust-HDP family baselines
def _dpsgd_clients(settings: DPSGDSettings, eps: list[float]) -> list:
    return [dpsgd_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), context=client_context(i, len(eps)),
                         settings=settings, epsilon=e, delta=1e-4) for i, e in enumerate(eps)]


def test_weiavg_weighs_each_dpsgd_client_by_its_reported_epsilon_and_charges_its_declared_dpsgd(tmp_path):
    settings = DPSGDSettings(rounds=2, clip_norm=1.0, lr=0.1)
    eps = [1.0, 2.0, 4.0]
    strategy = weiavg(_mlp(), Rounds(num_rounds=2, min_available_clients=3), settings, recorder=JsonRecorder(tmp_path))
    assert isinstance(strategy, WeiAvg) and strategy.clip_norm == 1.0
    record = one_round(strategy, _dpsgd_clients(settings, eps), tmp_path)
    by_id = {c["client_id"]: c for c in record["clients"]}
    assert {c["status"] for c in by_id.values()} == {"ok"}, record["clients"]
    shares = np.array([by_id[i]["aggregation_weight"] for i in range(3)])
    assert shares / shares.sum() == pytest.approx(np.array(eps) / sum(eps), rel=1e-6)
    kind = record_accountant("rdp", "replace-one")
    for i in range(3):  # the server's ledger: one round of the declared (z, q, steps), under the budget
        c = by_id[i]
        assert c["epsilon_spent"] == pytest.approx(
            epsilon_of([(c["noise_multiplier"], c["sample_rate"], c["steps"])], 1e-4, kind), rel=1e-6)
        assert 0 < c["epsilon_spent"] < eps[i]


def test_pfa_and_min_eps_build_from_the_settings_and_refuse_bad_arguments(tmp_path):
    settings = DPSGDSettings(rounds=2, clip_norm=0.5, lr=0.1)
    strategy = pfa(_mlp(), Rounds(num_rounds=2, min_available_clients=3), settings, components=1,
                   recorder=JsonRecorder(tmp_path))
    assert isinstance(strategy, PFA) and strategy.components == 1 and strategy.clip_norm == 0.5
    record = one_round(strategy, _dpsgd_clients(settings, [1.0, 1.0, 4.0]), tmp_path)
    public = {c["client_id"]: c["pfa_public"] for c in record["clients"]}
    assert public[2] and not public[0]  # the split is by reported ε: the ε = 4 client is public
    with pytest.raises(ValueError, match="pfa-components must be >= 1"):
        pfa(_mlp(), Rounds(num_rounds=2), settings, components=0)
    assert isinstance(min_eps(_mlp(), Rounds(num_rounds=2), settings), MinEpsilon)


def test_min_eps_clients_train_at_the_federation_minimum_and_the_server_charges_it(tmp_path):
    settings = DPSGDSettings(rounds=1, clip_norm=1.0, lr=0.1)
    budgets = [1.0, 3.0]
    eps_min = min(budgets)  # what a user's ClientApp passes to every client (docs/library.md, min-eps)
    strategy = min_eps(_mlp(), Rounds(num_rounds=1), settings, recorder=JsonRecorder(tmp_path))
    record = one_round(strategy, _dpsgd_clients(settings, [eps_min] * len(budgets)), tmp_path)
    for c in record["clients"]:  # T = 1 round spends exactly ε_min, never a client's own larger budget
        assert c["status"] == "ok" and c["epsilon_budget"] == eps_min
        assert c["epsilon_spent"] == pytest.approx(eps_min, rel=2e-3) and c["epsilon_spent"] <= eps_min * (1 + 1e-3)


# ----------------------------------------------------------------------------- Fed-SMP and its baselines
def test_fed_smp_randk_clients_send_the_k_noised_values_of_the_servers_mask(tmp_path):
    mech = client_level_mechanism(num_clients=2, rounds=2, clip=0.5, target_epsilon=4.0)
    clients = [client_level_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), context=client_context(i, 2),
                                   mechanism=mech, lr=0.1) for i in range(2)]
    strategy = fed_smp(_mlp(), Rounds(num_rounds=2), mech, sparsifier="randk", compression_ratio=0.1,
                       recorder=JsonRecorder(tmp_path))
    assert strategy.name == "fed-smp-randk" and strategy.private and strategy.k == num_kept(strategy.num_params, 0.1)
    cfg = strategy.fit_config(1)
    update, m = _fit(clients[0], _weights(_mlp()), {"server-round": 1, **cfg, CFG_SIGMA: mech.noise_multiplier})
    assert m["status"] == "ok" and m["k"] == strategy.k and [u.shape for u in update] == [(strategy.k,)]
    assert m["epsilon_spent"] == pytest.approx(cached_epsilon(mech, 1))
    strategy = fed_smp(_mlp(), Rounds(num_rounds=2), mech, sparsifier="randk", compression_ratio=0.1,
                       recorder=JsonRecorder(tmp_path))
    record = one_round(strategy, clients, tmp_path)
    assert [c["status"] for c in record["clients"]] == ["ok", "ok"], record["clients"]
    assert record["metrics"]["epsilon"] == pytest.approx(cached_epsilon(mech, 1), rel=1e-3)


def test_fed_smp_topk_mask_is_the_top_k_of_the_users_public_update_and_needs_one():
    mech = client_level_mechanism(num_clients=2, rounds=2, clip=0.5, noise_multiplier=1.0)
    update_fn = public_update(_mlp(), _data(60, seed=7), lr=0.1, steps=3, batch_size=10)
    strategy = fed_smp(_mlp(), Rounds(num_rounds=2), mech, sparsifier="topk", compression_ratio=0.2,
                       public_update=update_fn)
    cfg = strategy.fit_config(1)
    expected = top_k_indices(update_fn(_weights(_mlp()), 1), strategy.k)
    assert cfg[CFG_SPARSIFIER] == "topk" and np.array_equal(np.frombuffer(cfg[CFG_MASK], dtype="<i4"), expected)
    with pytest.raises(ValueError, match="'topk' needs public_update"):
        fed_smp(_mlp(), Rounds(num_rounds=2), mech, sparsifier="topk")
    with pytest.raises(ValueError, match="planned for r = 2 of n = 2"):
        fed_smp(_mlp(), Rounds(num_rounds=2, clients_per_round=1), mech)


def test_sparse_fedavg_clients_clip_without_noise_and_a_private_client_needs_its_mechanism():
    strategy = sparse_fedavg(_mlp(), Rounds(num_rounds=1), clip=0.05, sparsifier="randk", compression_ratio=0.5)
    assert not strategy.private and strategy.name == "fedavg-randk"
    client = client_level_client(_mlp(), DataLoader(_data(), batch_size=20), context=client_context(0, 2),
                                 mechanism=None, clip=0.05, lr=0.5)
    update, m = _fit(client, _weights(_mlp()), {"server-round": 1, **strategy.fit_config(1)})
    assert m["status"] == "ok" and update[0].shape == (strategy.k,) and "train_loss" in m
    assert np.linalg.norm(update[0]) == pytest.approx(0.05, rel=1e-5)  # clipped (the update is far above 0.05)
    with pytest.raises(ValueError, match="needs clip"):
        client_level_client(_mlp(), DataLoader(_data(), batch_size=20), context=client_context(0, 2), mechanism=None,
                            lr=0.1)


# ----------------------------------------------------------------------------- DP-FTRL
def test_dp_ftrl_clients_clip_and_the_server_charges_the_matrix_mechanism(tmp_path):
    mech = ftrl_mechanism(num_clients=2, rounds=2, clip=0.5, target_epsilon=4.0)
    assert mech.epsilon() == pytest.approx(4.0, rel=2e-3) and mech.epsilon() <= 4.0 * (1 + 1e-3)
    clients = [ftrl_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), context=client_context(i, 2),
                           mechanism=mech, lr=0.1) for i in range(2)]
    update, m = _fit(clients[0], _weights(_mlp()), {"server-round": 1, CFG_SIGMA: mech.noise_multiplier})
    assert m["status"] == "ok" and np.linalg.norm(np.concatenate([u.ravel() for u in update])) <= 0.5 * (1 + 1e-6)
    clients[0] = ftrl_client(_mlp(), DataLoader(_data(seed=0), batch_size=20), context=client_context(0, 2),
                             mechanism=mech, lr=0.1)
    strategy = dp_ftrl(_mlp(), Rounds(num_rounds=2), mech, recorder=JsonRecorder(tmp_path))
    record = one_round(strategy, clients, tmp_path)
    assert [c["status"] for c in record["clients"]] == ["ok", "ok"], record["clients"]
    assert record["metrics"]["epsilon"] == pytest.approx(mech.epsilon(1), rel=1e-6)
    with pytest.raises(ValueError, match="every client every round"):
        dp_ftrl(_mlp(), Rounds(num_rounds=2, clients_per_round=1), mech)


# ----------------------------------------------------------------------------- SoteriaFL
def test_soteriafl_client_spends_exactly_its_budget_as_the_accountant_composes_then_refuses():
    settings = SoteriaFLSettings(rounds=2, method="soteriafl-sgd", clip_norm=1.0, batch_size=12, k=20)
    model = _mlp()
    client = soteriafl_client(model, DataLoader(_data(), batch_size=20), _data(40, seed=1),
                              context=client_context(0, 2), settings=settings, epsilon=2.0, delta=1e-4)
    weights = _weights(model)
    kind = record_accountant("rdp", "replace-one")
    for rnd in (1, 2):
        update, m = _fit(client, weights, {"server-round": rnd, "soteriafl-method": settings.method,
                                           "round-seed": fit_seed(0, rnd)})
        assert m["status"] == "ok" and update[0].shape == (20,) and m["batch_size"] == 12 and m["num_train"] == 120
        history = noise_history("sgd", m["sigma_p"], 1.0, 12, 120, rnd, m["noise_split"])
        assert m["epsilon_spent"] == pytest.approx(epsilon_of(history, 1e-4, kind), rel=1e-9)
    # σ_p is calibrated to 1 % (strategies.soteriafl.calibrate_sigma), never above the budget
    assert m["epsilon_spent"] == pytest.approx(2.0, rel=1e-2) and m["epsilon_spent"] <= 2.0 * (1 + 1e-9)
    update, m = _fit(client, weights, {"server-round": 3, "soteriafl-method": settings.method,
                                       "round-seed": fit_seed(0, 3)})
    assert m["status"] == "refused" and update == [] and "budget" in str(m["reason"]).lower()


def test_soteriafl_strategy_aggregates_the_clients_and_charges_their_declared_noise(tmp_path):
    settings = SoteriaFLSettings(rounds=2, clip_norm=1.0, batch_size=12, eta=0.5)
    clients = [soteriafl_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), context=client_context(i, 2),
                                settings=settings, epsilon=2.0, delta=1e-4) for i in range(2)]
    strategy = soteriafl(_mlp(), Rounds(num_rounds=2), settings, recorder=JsonRecorder(tmp_path))
    assert strategy.k == max(1, strategy.num_params // 20)  # the same k as the clients' (settings.k = 0: d/20)
    record = one_round(strategy, clients, tmp_path)
    assert [c["status"] for c in record["clients"]] == ["ok", "ok"], record["clients"]
    for c in record["clients"]:
        assert 0 < c["epsilon_spent"] < 2.0 and c["epsilon_budget"] == 2.0


@pytest.mark.parametrize(("model", "loss", "needle"), [
    (nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), None, "without buffers"),
    (nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)), None, "no Dropout"),
    (_mlp(), nn.MSELoss(), "loss must be None or nn.CrossEntropyLoss()"),
    (_mlp(classes=2), None, "class scores with k > 2"),
])
def test_a_model_or_loss_soteriafl_cannot_take_is_refused_naming_the_problem(model, loss, needle):
    with pytest.raises(ModelProblem) as err:
        soteriafl_client(model, DataLoader(_data(), batch_size=20), context=client_context(0, 2),
                         settings=SoteriaFLSettings(rounds=1, batch_size=10), epsilon=1.0, delta=1e-4, loss=loss)
    assert needle in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- DP2-FedSAM
def test_dp2_fedsam_sends_only_the_noised_body_keeps_the_head_and_the_server_charges_the_mechanism(tmp_path):
    from fedapp.clients.dp2_fedsam import HEAD_KEY

    mech = client_level_mechanism(num_clients=2, rounds=2, clip=0.5, target_epsilon=4.0)
    settings = DP2FedSAMSettings(variant="dp2-fedsam", head="2", tau_h=1, tau_phi=1)
    contexts = [client_context(i, 2) for i in range(2)]
    clients = [dp2_fedsam_client(_mlp(), DataLoader(_data(seed=i), batch_size=20), _data(30, seed=5 + i),
                                 context=contexts[i], mechanism=mech, settings=settings, lr=0.1) for i in range(2)]
    strategy = dp2_fedsam(_mlp(), Rounds(num_rounds=2), mech, settings, recorder=JsonRecorder(tmp_path))
    body = [w for name, w in zip(_mlp().state_dict(), _weights(_mlp())) if not name.startswith("2.")]
    assert [w.shape for w in strategy.current_weights] == [w.shape for w in body]  # the server holds φ only
    record = one_round(strategy, clients, tmp_path)
    assert [c["status"] for c in record["clients"]] == ["ok", "ok"], record["clients"]
    assert record["metrics"]["epsilon"] == pytest.approx(cached_epsilon(mech, 1), rel=1e-3)
    head = contexts[0].state.array_records[HEAD_KEY].to_numpy_ndarrays()
    initial_head = [w for name, w in zip(_mlp().state_dict(), _weights(_mlp())) if name.startswith("2.")]
    assert [h.shape for h in head] == [w.shape for w in initial_head]
    assert any(np.abs(h - w).max() > 0 for h, w in zip(head, initial_head))  # trained, and kept on the client


def test_dp2_fedsam_refuses_an_unknown_head_a_server_evaluation_without_a_head_and_another_loss():
    mech = client_level_mechanism(num_clients=2, rounds=2, clip=0.5, noise_multiplier=1.0)
    with pytest.raises(ModelProblem, match="head prefix 'fc' matches no parameter"):
        dp2_fedsam(_mlp(), Rounds(num_rounds=2), mech, DP2FedSAMSettings(head="fc"))
    with pytest.raises(ValueError, match="pass evaluate_fn=None"):
        dp2_fedsam(_mlp(), Rounds(num_rounds=2), mech, DP2FedSAMSettings(head="2"),
                   evaluate_fn=central_evaluation(_mlp(), _data(20)))
    with pytest.raises(ModelProblem, match="loss must be None"):
        dp2_fedsam_client(_mlp(), DataLoader(_data(), batch_size=20), context=client_context(0, 2), mechanism=mech,
                          settings=DP2FedSAMSettings(head="2"), lr=0.1, loss=nn.MSELoss())
    full = dp2_fedsam(_mlp(), Rounds(num_rounds=2), mech, DP2FedSAMSettings(variant="dp-fedsam"),
                      evaluate_fn=central_evaluation(_mlp(), _data(20)))
    assert len(full.current_weights) == len(_weights(_mlp()))
