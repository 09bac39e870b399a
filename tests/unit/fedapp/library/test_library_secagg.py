"""fedapp.library under SecAgg+: the secure-sum mechanism, the strategy built for the project's SecAgg+ workflow, the
run loop's settings, and the client's distributed discrete Gaussian share (tests/integration/examples/
test_own_model_secagg_app.py runs all of it under `flwr run`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import client_context, client_manager, in_secagg_collect
from flwr.common import Code, parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fedapp.library.server as library_server
from fedapp.config import ClientDPConfig, GeneralConfig, TrainingConfig
from fedapp.library import (
    Rounds,
    SecAggSettings,
    SecureClientLevelStrategy,
    client_level_client,
    client_level_mechanism,
    dp_fedavg,
    fed_smp,
    run_secure_aggregation,
    secagg_mod,
    secure_sum,
)
from fedapp.privacy import profiles
from fedapp.privacy.secure_aggregation import MAX_WEIGHT, OUTSIDE_SECAGG
from fedapp.privacy.secure_aggregation import secagg_mod as project_secagg_mod
from strategies.client_level import CFG_ROTATION_SEED, CFG_ROUND_CLIENTS, CFG_SIGMA
from strategies.compression import num_kept
from strategies.fed_smp import FedSMPStrategy
from strategies.privacy.mechanisms import cached_epsilon

N = 5


def _data(n: int = 100, features: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _mlp(features: int = 6, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))


def _dim(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _secure(rounds: int = 3, **kwargs) -> object:
    return client_level_mechanism(num_clients=N, rounds=rounds, clip=1.0, target_epsilon=4.0,
                                  secure_aggregation=True, **kwargs)


@pytest.mark.parametrize("clients_per_round", [0, 3])
def test_the_secure_mechanism_is_the_run_configs_for_the_same_settings(clients_per_round):
    mech = _secure(clients_per_round=clients_per_round)
    project = profiles.client_level_mechanism(
        GeneralConfig(num_server_rounds=3, clients_per_round=clients_per_round), TrainingConfig(clip_norm=1.0),
        ClientDPConfig(target_epsilon=4.0, secure_aggregation=True, client_dp_adversary="server"), N)
    assert mech == project and mech.secure_aggregation and mech.adversary == "server"
    assert cached_epsilon(mech, None) == pytest.approx(4.0, rel=2e-3)  # T rounds, unamplified, spend the budget
    # calibrated for the sum: σ of the sum equals the σ/√r an update alone would need (one update: the same ε)
    alone = client_level_mechanism(num_clients=N, rounds=3, clip=1.0, target_epsilon=4.0,
                                   clients_per_round=clients_per_round)
    r = clients_per_round or N
    assert mech.noise_multiplier == pytest.approx(alone.noise_multiplier / math.sqrt(r), rel=1e-6)


def test_secure_sum_is_the_projects_discrete_gaussian_for_the_payload():
    mech, d = _secure(), _dim(_mlp())
    ddg = secure_sum(mech, SecAggSettings(bits=20), d)
    project = profiles.secure_sum_mechanism(ClientDPConfig(secure_aggregation=True, secagg_mechanism="ddg",
                                                           secagg_bits=20), mech, d)
    assert ddg is not None and ddg == project and ddg.dim == d and ddg.bits == 20
    assert ddg.gaussian_equivalent(N, N) >= mech.noise_multiplier * (1 - 1e-9)  # the plan's ε bounds the sum's
    assert secure_sum(mech, SecAggSettings(mechanism="gaussian"), d) is None
    with pytest.raises(ValueError, match="SecAggSettings.bits = 8"):
        secure_sum(mech, SecAggSettings(bits=8), 50_000)
    with pytest.raises(ValueError, match="secure_aggregation = False"):
        secure_sum(client_level_mechanism(num_clients=N, rounds=3, clip=1.0, target_epsilon=4.0),
                   SecAggSettings(), d)


def test_secagg_settings_refuse_bad_values_by_name():
    with pytest.raises(ValueError, match="mechanism = 'x'.*bits = 40.*num_shares = 2.0.*round_timeout = 0.5"):
        SecAggSettings(mechanism="x", bits=40, num_shares=2.0, round_timeout=0.5)
    assert SecAggSettings(num_shares=3).num_shares == 3


def test_dp_fedavg_with_secagg_builds_the_projects_secure_strategy_and_refuses_mismatches():
    mech, secagg, model = _secure(), SecAggSettings(bits=20), _mlp()
    strategy = dp_fedavg(model, Rounds(num_rounds=3), mech, secagg=secagg)
    assert isinstance(strategy, SecureClientLevelStrategy) and strategy.secure_aggregation
    strategy.setup_privacy(N)
    assert strategy.dp == mech and strategy.ddg == secure_sum(mech, secagg, _dim(model))
    assert strategy.ddg is not None and strategy.ddg.bits == 20
    # outside run_secure_aggregation it never configures a round (start_grid would receive each share alone)
    cm = client_manager(N)
    with pytest.raises(RuntimeError, match="run_secure_aggregation"):
        strategy.configure_fit(1, strategy.initialize_parameters(cm), cm)
    gaussian = dp_fedavg(model, Rounds(num_rounds=3), mech, secagg=SecAggSettings(mechanism="gaussian"))
    gaussian.setup_privacy(N)
    assert gaussian.ddg is None and gaussian.secure_aggregation
    sparse = fed_smp(model, Rounds(num_rounds=3), mech, compression_ratio=0.1, secagg=secagg)
    sparse.setup_privacy(N)
    assert sparse.ddg is not None and sparse.ddg.dim == num_kept(_dim(model), 0.1) == sparse.payload_dim()
    with pytest.raises(ValueError, match="pass secagg=SecAggSettings"):
        dp_fedavg(model, Rounds(num_rounds=3), mech)
    plain = client_level_mechanism(num_clients=N, rounds=3, clip=1.0, target_epsilon=4.0)
    with pytest.raises(ValueError, match="secagg given but mechanism.secure_aggregation = False"):
        dp_fedavg(model, Rounds(num_rounds=3), plain, secagg=secagg)
    assert type(dp_fedavg(model, Rounds(num_rounds=3), plain)) is FedSMPStrategy  # unchanged without SecAgg+
    two = client_level_mechanism(num_clients=N, rounds=3, clip=1.0, target_epsilon=4.0, clients_per_round=2,
                                 secure_aggregation=True)
    with pytest.raises(ValueError, match="fewer than 3 survivors"):
        dp_fedavg(model, Rounds(num_rounds=3, clients_per_round=2), two, secagg=secagg)
    prv = _secure(accountant="prv")
    with pytest.raises(ValueError, match="'ddg' needs accountant = 'rdp'"):
        dp_fedavg(model, Rounds(num_rounds=3), prv, secagg=secagg)
    assert dp_fedavg(model, Rounds(num_rounds=3), prv, secagg=SecAggSettings(mechanism="gaussian")).private


def test_run_secure_aggregation_runs_the_projects_workflow_with_the_typed_settings(monkeypatch):
    secagg = SecAggSettings(num_shares=3, reconstruction_threshold=0.8, round_timeout=30.0)
    strategy = dp_fedavg(_mlp(), Rounds(num_rounds=3), _secure(), secagg=secagg)
    calls = []

    def fake(grid, context, strat, config, client_dp, deployment):
        calls.append((strat.under_secure_aggregation, config, client_dp, deployment))

    monkeypatch.setattr(library_server, "run_with_secure_aggregation", fake)
    run_secure_aggregation(object(), object(), strategy)  # type: ignore[arg-type]
    (inside, config, client_dp, deployment), = calls
    assert inside and not strategy.under_secure_aggregation  # the guard is lifted only while the workflow runs
    assert config.num_rounds == 3 and config.round_timeout == 30.0
    assert client_dp.secagg_num_shares == 3 and client_dp.secagg_threshold == 0.8 and client_dp.secure_aggregation
    assert deployment.round_timeout == 30.0
    with pytest.raises(ValueError, match="differs from the strategy's"):
        run_secure_aggregation(object(), object(), strategy, secagg=SecAggSettings())  # type: ignore[arg-type]
    plain = dp_fedavg(_mlp(), Rounds(num_rounds=3),
                      client_level_mechanism(num_clients=N, rounds=3, clip=1.0, target_epsilon=4.0))
    with pytest.raises(ValueError, match="was not built for SecAgg"):
        run_secure_aggregation(object(), object(), plain)  # type: ignore[arg-type]
    assert secagg_mod is project_secagg_mod


def _round_one(strategy) -> tuple[list[np.ndarray], dict]:
    cm = client_manager(N)
    params = strategy.initialize_parameters(cm)
    strategy.under_secure_aggregation = True
    (_, ins), *_ = strategy.configure_fit(1, params, cm)
    return parameters_to_ndarrays(ins.parameters), dict(ins.config)


@pytest.mark.secagg_guard
@pytest.mark.parametrize("mechanism", ["ddg", "gaussian"])
def test_the_client_sends_its_secure_sum_share_only_inside_secagg(mechanism):
    mech, secagg, model = _secure(), SecAggSettings(mechanism=mechanism, bits=20), _mlp()
    strategy = dp_fedavg(model, Rounds(num_rounds=3), mech, secagg=secagg)
    weights, config = _round_one(strategy)
    assert config[CFG_ROUND_CLIENTS] == N and config[CFG_SIGMA] == mech.noise_multiplier
    assert (CFG_ROTATION_SEED in config) == (mechanism == "ddg")
    context = client_context(0, N)
    client = client_level_client(model, DataLoader(_data(), batch_size=20), context=context, mechanism=mech,
                                 secagg=secagg, lr=0.1)
    from flwr.common import FitIns, ndarrays_to_parameters

    ins = FitIns(ndarrays_to_parameters(weights), config)
    outside = client.fit(ins)  # no SecAgg+ state: a plain fit (start_grid, or no secagg_mod) gets nothing
    assert outside.status.code == Code.OK and outside.metrics["status"] == "refused"
    assert not outside.parameters.tensors and outside.metrics["reason"] == OUTSIDE_SECAGG
    in_secagg_collect(context)
    res = client.fit(ins)
    m = dict(res.metrics)
    assert m["status"] == "ok" and res.num_examples == int(MAX_WEIGHT)  # weight 1: the secure sum is Σ Δ_i
    assert m["epsilon_spent"] == pytest.approx(cached_epsilon(mech, 1))
    share = parameters_to_ndarrays(res.parameters)
    if mechanism == "ddg":  # one array of residues modulo 2^b over the rotated payload
        assert m["secagg_bits"] == 20 and [a.shape for a in share] == [(_dim(model),)]
        assert strategy.ddg is not None and share[0].shape == (strategy.ddg.rotated_dim,)
        assert np.all((share[0] >= 0) & (share[0] < 2**20) & (share[0] == np.floor(share[0])))
    else:  # the clipped update plus N(0, C²σ²/r_t), in the model's shapes
        assert "secagg_bits" not in m and [a.shape for a in share] == [w.shape for w in weights]


def test_the_client_refuses_a_mechanism_that_disagrees_with_secagg():
    kwargs = {"context": client_context(0, N), "lr": 0.1}
    with pytest.raises(ValueError, match="pass secagg=SecAggSettings"):
        client_level_client(_mlp(), DataLoader(_data(), batch_size=20), mechanism=_secure(), **kwargs)
    plain = client_level_mechanism(num_clients=N, rounds=3, clip=1.0, target_epsilon=4.0)
    with pytest.raises(ValueError, match="secagg given but mechanism.secure_aggregation = False"):
        client_level_client(_mlp(), DataLoader(_data(), batch_size=20), mechanism=plain, secagg=SecAggSettings(),
                            **kwargs)
