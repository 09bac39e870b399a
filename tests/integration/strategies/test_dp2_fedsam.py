"""DP2-FedSAM family: φ/h split, SAM step, client-level DP client (clip, noise, budget), persistent heads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.common import Context, RecordDict
from torch import nn

from fedapp.clients.common import setup_client
from fedapp.clients.dp2_fedsam import DP2FedSAMClient, shared_weights
from fedapp.clients.training import SAM, LocalTraining, local_train
from fedapp.config import ConfigError, resolve_config
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import DigitsCNN, LogisticRegression
from fedapp.privacy.profiles import client_level_mechanism
from strategies.base import RejectedUpdate
from strategies.dp2_fedsam import VARIANTS, DP2FedSAMStrategy, head_parameter_names, sam_gradient, shared_mask
from strategies.privacy.accountants import DPAccountingRDP

N_CLIENTS = 4
BASE = {"partitioner": "pathological", "classes-per-client": 2, "batch-size": 16, "clients-per-round": 2,
        "num-server-rounds": 3, "noise-multiplier": 1.0, "clip-norm": 0.5, "local-test-fraction": 0.1,
        "dp2-tau-h": 1, "dp2-tau-phi": 1, "max-samples": 400}


def make_client(strategy: str, cid: int, node: dict | None = None, **extra) -> tuple[DP2FedSAMClient, Context]:
    """A client on its own Flower Context (state persists across calls, as in a simulation), sending continuous
    Gaussian shares (the discrete Gaussian's wire format: tests/integration/fedapp/privacy/test_ddg_secure_sum.py)."""
    ov = {**BASE, "strategy": strategy, "secagg-mechanism": "gaussian", **extra}
    node_config = {"partition-id": cid, "num-partitions": N_CLIENTS, **(node or {})}
    ctx = Context(run_id=0, node_id=cid, node_config=node_config, state=RecordDict(), run_config={})
    cfg = resolve_config(None, ov)
    return DP2FedSAMClient(setup_client(ctx, ov), cfg.client_dp, cfg.dp2_fedsam, ctx, VARIANTS[strategy]), ctx


def initial_shared(client: DP2FedSAMClient) -> list[np.ndarray]:
    return client.get_parameters({})


# ---------------------------------------------------------------- φ / h split
def test_head_auto_is_last_linear_and_prefixes_work():
    model = DigitsCNN(1, 10)
    assert head_parameter_names(model) == ["fc.weight", "fc.bias"]
    assert head_parameter_names(model, "body.0, fc") == ["body.0.weight", "body.0.bias", "fc.weight", "fc.bias"]
    mask = shared_mask(model, "auto", personalized=True)
    assert mask == [True] * (len(mask) - 2) + [False, False]
    assert all(shared_mask(model, "auto", personalized=False))


def test_head_spec_errors_name_the_value():
    with pytest.raises(ValueError, match="'nope'"):
        head_parameter_names(DigitsCNN(1, 10), "nope")
    with pytest.raises(ValueError, match="every parameter"):  # logistic regression is all head
        head_parameter_names(LogisticRegression(64, 10), "auto")
    cfg = resolve_config(None, {"strategy": "dp2-fedsam", "dp2-head": "features.9"})
    with pytest.raises(ConfigError, match="dp2-head"):
        shared_weights(cfg.dp2_fedsam.dp2_head, cfg.data, cfg.model_spec, [np.zeros(1)] * 8, personalized=True)


# ---------------------------------------------------------------- SAM (Eq. 11–12)
def _quadratic_setup():
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, dtype=torch.float64)
    w0 = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
    return x, y, w0


def _grad(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """∇ of mean((Xw − y)²) = 2/n Xᵀ(Xw − y), by hand."""
    return 2.0 / len(y) * x.T @ (x @ w - y)


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_step_equals_hand_computed_two_pass_update(adaptive):
    x, y, w0 = _quadratic_setup()
    w = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        return loss.detach()

    rho, eta = 0.05, 0.01
    sam_gradient([w], closure, rho, adaptive=adaptive, eta=eta)
    assert torch.allclose(w.detach(), w0)  # parameters restored to w before the step
    opt.step()
    xn, yn, wn = x.numpy(), y.numpy(), w0.numpy()
    g1 = _grad(xn, yn, wn)
    if adaptive:
        t = np.abs(wn) + eta
        p = rho * t * t * g1 / np.linalg.norm(t * g1)
    else:
        p = rho * g1 / np.linalg.norm(g1)
    expected = wn - 0.1 * _grad(xn, yn, wn + p)
    np.testing.assert_allclose(w.detach().numpy(), expected, rtol=1e-12)
    # and it differs from a plain SGD step (the test can fail)
    assert not np.allclose(expected, wn - 0.1 * g1)


def test_local_train_moves_only_the_named_parameters():
    model = DigitsCNN(1, 10)
    data = ArrayDataset(np.random.default_rng(0).normal(size=(32, 1, 8, 8)).astype(np.float32),
                        np.random.default_rng(1).integers(0, 10, 32).astype(np.int64), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    local_train(model, data, LocalTraining(batch_size=8, steps=4, lr=0.1, momentum=0.5, trainable=("fc.weight", "fc.bias")))
    after = model.state_dict()
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    assert all(torch.equal(after[k], before[k]) for k in before if not k.startswith("fc."))
    assert all(p.requires_grad for p in model.parameters())  # requires_grad restored
    names = [k for k in before if not k.startswith("fc.")]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    local_train(model, data, LocalTraining(batch_size=8, steps=4, lr=0.1, trainable=tuple(names), sam=SAM(0.1)))
    after = model.state_dict()
    assert torch.equal(after["fc.weight"], before["fc.weight"])
    assert not torch.equal(after["features.0.weight"], before["features.0.weight"])


# ---------------------------------------------------------------- client: payload, heads, clipping, budget
def test_head_never_leaves_the_client_and_persists_per_client():
    c0, ctx0 = make_client("dp2-fedsam", 0)
    c1, ctx1 = make_client("dp2-fedsam", 1)
    phi = initial_shared(c0)
    n_phi = sum(a.size for a in phi)
    n_all = sum(p.numel() for p in c0.s.new_model().parameters())
    assert n_phi == n_all - (64 * 10 + 10)  # DigitsCNN head = fc (64→10)
    head0 = c0.head()
    out, n, metrics = c0.fit(phi, {"server-round": 1})
    assert metrics["status"] == "ok" and n == 1  # weight 1 in the secure sum (secure-aggregation defaults on)
    assert [a.shape for a in out] == [a.shape for a in phi]  # payload = |φ|, no head arrays
    assert sum(a.size for a in out) == n_phi
    h0_r1 = c0.head()
    assert any(not np.array_equal(a, b) for a, b in zip(head0, h0_r1))  # trained and stored in Context.state
    assert "dp2-head" in ctx0.state
    c1.fit(phi, {"server-round": 1})
    assert any(not np.allclose(a, b) for a, b in zip(h0_r1, c1.head()))  # heads differ between clients
    # a fresh client object on the same Context (next round in Flower) sees the stored head
    c0b = DP2FedSAMClient(c0.s, c0.client_dp, c0.dp2, ctx0, VARIANTS["dp2-fedsam"])
    assert all(np.array_equal(a, b) for a, b in zip(c0b.head(), h0_r1))
    c0b.fit(phi, {"server-round": 2})
    assert any(not np.array_equal(a, b) for a, b in zip(h0_r1, c0b.head()))  # keeps training the same head
    # evaluation uses (φ, h_i): personalized accuracy differs from the same φ with the initial head
    _, _, m_pers = c0b.evaluate(phi, {"server-round": 2})
    assert 0.0 <= m_pers["accuracy"] <= 1.0


def test_full_model_variants_share_everything():
    c, _ = make_client("dp-fedsam", 0)
    params = initial_shared(c)
    assert sum(a.size for a in params) == sum(p.numel() for p in c.s.new_model().parameters())
    out, _, metrics = c.fit(params, {"server-round": 1})
    assert metrics["status"] == "ok" and len(out) == len(params)


def test_clipping_bound_holds():
    # σ tiny → the sent update is the clipped one; C small so that clipping is active
    c, _ = make_client("centaur", 0, **{"noise-multiplier": 1e-9, "clip-norm": 0.01, "dp2-report-norms": True})
    phi = initial_shared(c)
    out, _, metrics = c.fit(phi, {"server-round": 1})
    norm = float(np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in out)))
    assert metrics["local_update_norm"] > 0.01  # clipping was needed
    assert norm <= 0.01 * (1 + 1e-5)
    assert norm >= 0.01 * (1 - 1e-5)


def test_noise_is_calibrated_on_the_sum_of_r_updates():
    n = 40  # q = 2/40 = 0.05 (the paper's sampling ratio); cheap for the RDP accountant
    cfg = resolve_config(None, {**BASE, "strategy": "dp2-fedsam", "noise-multiplier": 0.0, "target-epsilon": 2.0})
    dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, n)  # σ calibrated by the accountant
    assert dp.clients_per_round == 2 and dp.sample_rate == 0.05 and dp.rounds == 3
    assert dp.delta == pytest.approx(1 / (10 * n))
    assert dp.per_client_std == pytest.approx(0.5 * dp.noise_multiplier / np.sqrt(2))  # Cσ/√r each, σC on the sum
    assert 2.0 * 0.999 <= dp.epsilon() <= 2.0
    given = resolve_config(None, {**BASE, "strategy": "dp2-fedsam", "noise-multiplier": 3.0})
    fixed = client_level_mechanism(given.general, given.training, given.client_dp, n)
    assert fixed.noise_multiplier == 3.0 and fixed.epsilon() < dp.epsilon()


def test_client_refuses_beyond_planned_rounds_and_node_budget():
    c, _ = make_client("dp2-fedsam", 0, **{"dp-rounds": 2})
    phi = initial_shared(c)
    out, n, metrics = c.fit(phi, {"server-round": 3})
    assert metrics["status"] == "refused" and out == [] and n == 0
    assert "budget" in metrics["reason"] and metrics["epsilon_spent"] <= metrics["epsilon_budget"]
    c2, _ = make_client("dp2-fedsam", 1, node={"epsilon": 0.01})
    _, _, m2 = c2.fit(phi, {"server-round": 1})
    assert m2["status"] == "refused" and "budget 0.0100" in m2["reason"]


def test_server_rejects_update_beyond_clip_plus_noise_bound():
    cfg = resolve_config(None, {**BASE, "strategy": "dp2-fedsam"})
    dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, N_CLIENTS)
    strat = DP2FedSAMStrategy(name="dp2-fedsam", mechanism_factory=lambda n: dp,
                              initial_weights=[np.zeros(100, np.float32)], num_rounds=3, clients_per_round=2)
    strat.setup_privacy(N_CLIENTS)
    strat.sampled[1] = dp.clients_per_round
    strat.round_log.start(1)
    rng = np.random.default_rng(0)
    honest = np.full(100, 0.5 / 10) + rng.normal(0, dp.per_client_std, 100)
    strat.validator.check_values(honest)
    with pytest.raises(RejectedUpdate, match="exceeds"):
        strat.validator.check_values(np.full(100, dp.norm_bound(100) / 10 * 1.01))


# ---------------------------------------------------------------- one real simulation
@pytest.mark.slow
def test_simulation_dp2_fedsam_shares_phi_only(tmp_path: Path):
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app

    ov = {**BASE, "strategy": "dp2-fedsam", "num-server-rounds": 2, "output-dir": str(tmp_path), "max-samples": 0,
          "secure-aggregation": False,  # the plain wire format (SecAgg+: tests/integration/fedapp/privacy/test_secure_aggregation.py)
          "client-dp-adversary": "server",  # unamplified (release without SecAgg+ is refused), as recomputed below
          "seeded-noise": True}  # sampling from the seed: with OS entropy both rounds could draw nobody (no release)
    run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=N_CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
    run = next(p for p in tmp_path.iterdir() if not p.name.startswith("."))  # not .client-state
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    n_phi = json.loads((run / "config.json").read_text())["num_parameters"] - (64 * 10 + 10)
    for rec in rounds:
        ok = [c for c in rec["clients"] if c["status"] == "ok"]
        assert len(ok) == rec["metrics"].get("clients_sampled", 0)  # Poisson sampling, q = 2/4
        for c in ok:  # float32 φ plus a small per-array header, far below the full model
            assert 4 * n_phi <= c["uplink_bytes"] < 4 * n_phi + 1000
        assert rec["metrics"]["client_accuracy"] is not None
        assert "accuracy" not in rec["metrics"]  # no global head → no centralized accuracy
    eps = [r["metrics"].get("epsilon", 0.0) for r in rounds]
    assert 0 < eps[1] and eps[0] <= eps[1] and all(c["epsilon_spent"] == eps[1] for c in rounds[1]["clients"])
    # recomputed with Google's dp_accounting against the server that drew the Poisson sample (q = 2/4, charged at
    # q = 1): without secure aggregation each released round charges one update's multiplier σ/√r (σ = 1, r = 2)
    released = sum(1 for r in rounds if r["metrics"].get("clients_ok"))
    expected = DPAccountingRDP().epsilon([(1.0 / np.sqrt(2), 1.0, released)], rounds[-1]["metrics"]["delta"])
    assert eps[1] == pytest.approx(expected, rel=0.01)
