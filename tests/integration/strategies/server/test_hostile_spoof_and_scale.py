"""A malformed spoof costs the honest owner of the id nothing; a ×1e12 update is rejected whatever the cohort size.

A reply with malformed metrics that claims an unbound client id must not strike that id
(it strikes the node that sent it) nor contest it; an update far above anything honest is rejected in a round of
two updates, and, where a mechanism bounds the update, in a round of one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from test_hostile_payloads import proxy

from strategies.aggregate import flatten, unflatten
from strategies.base import DPFLStrategy
from strategies.dp2_fedsam import DP2FedSAMStrategy
from strategies.fed_smp import FedSMPStrategy
from strategies.fedavg import DPSGDFedAvg, FedAvg
from strategies.privacy.mechanisms import ClientLevelDP
from strategies.robust_hdp import RobustHDP

P = 2000  # one flat layer: enough coordinates for Robust-HDP's noise estimates
HONEST_IDS = (1, 2, 3, 4)
SIGMA = 1.0  # client-level noise multiplier σ
CLIP = 3.0


def _client_level(cls: type[FedSMPStrategy] | type[DP2FedSAMStrategy], name: str) -> DPFLStrategy:
    mechanism = ClientLevelDP(SIGMA, CLIP, clients_per_round=4, num_clients=5, rounds=10, delta=1e-3,
                              secure_aggregation=False)
    extra = {"sparsifier": "none"} if cls is FedSMPStrategy else {}
    s = cls(name=name, initial_weights=[np.zeros(P, np.float32)], num_rounds=10, clip=CLIP,
            mechanism_factory=lambda n: mechanism, **extra)
    s.prepare_round(5)
    return s


BUILDERS: dict[str, Callable[[], DPFLStrategy]] = {
    "robust-hdp": lambda: RobustHDP(initial_weights=[np.zeros(P, np.float32)], num_rounds=10, clip_norm=1.0,
                                    lr_schedule=lambda rnd: 1.0),
    "fedavg": lambda: FedAvg(initial_weights=[np.zeros(P, np.float32)], num_rounds=10),
    "dp2-fedsam": lambda: _client_level(DP2FedSAMStrategy, "dp2-fedsam"),
    "dp-fedavg": lambda: _client_level(FedSMPStrategy, "dp-fedavg"),
}


def honest_reply(name: str, cid: int, rng: np.random.Generator, **override) -> FitRes:
    """What an honest client of ``name`` sends: for Robust-HDP, DP-SGD noise of its declared z (Eq. 7 with one step,
    η = c = 1 and b̄ = ⌊N q⌋ = 1: σ_i² = p z²); for client-level DP, a clipped update plus N(0, C²σ²/r)."""
    metrics: dict = {"client_id": cid, "status": "ok", "epsilon_spent": 0.5, "epsilon_budget": 1.0}
    if name == "robust-hdp":
        z = 0.2 + 0.1 * cid
        update = 0.01 + rng.normal(scale=z, size=P)
        metrics.update(noise_multiplier=z, sample_rate=0.1, steps_round=1, delta=1e-5)
    elif name in ("dp2-fedsam", "dp-fedavg"):
        update = np.full(P, 0.5 * CLIP / np.sqrt(P)) + rng.normal(scale=CLIP * SIGMA / 2, size=P)
        metrics.update(noise_multiplier=SIGMA)
    else:
        update = rng.normal(scale=0.01, size=P)
    metrics.update(override)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([update.astype(np.float32)]), 10, metrics)


MALFORMED = {
    "over-budget": {"epsilon_spent": 5.0, "epsilon_budget": 1.0},
    "string-metric": {"noise_multiplier": "lots"},
    "unknown-status": {"status": "great"},
}


@pytest.mark.parametrize("spoofer_node", [-1, 9], ids=["spoofer-first", "spoofer-last"])
@pytest.mark.parametrize("malformed", sorted(MALFORMED))
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_malformed_spoof_strikes_nobody_and_the_owner_trains_every_round(name: str, malformed: str,
                                                                           spoofer_node: int) -> None:
    """An outsider node claims client 1 with malformed metrics in every round, from the first on (id 1 unbound)."""
    s = BUILDERS[name]()
    rng = np.random.default_rng(0)
    spoofer = 1000 + spoofer_node
    s.connected_nodes = {1000 + c for c in HONEST_IDS} | {spoofer}
    for rnd in range(1, 6):
        s.round_log.start(rnd)
        replies = [(proxy(c), honest_reply(name, c, rng)) for c in HONEST_IDS]
        replies.append((proxy(spoofer_node), honest_reply(name, 1, rng, **MALFORMED[malformed])))
        s.aggregate_fit(rnd, replies, [])
        recs = {r["node_id"]: r for r in s.round_log.clients()}
        assert recs[spoofer]["status"] == "rejected", recs[spoofer]
        assert recs[1001]["status"] == "ok", (rnd, recs[1001])  # client 1 trains every round
        assert s.strikes.strikes.get(1, 0) == 0 and not s.strikes.excluded(1), (rnd, s.strikes.reasons)
        s.flush_round()
    assert set(s.strikes.strikes) == set(), s.strikes.reasons  # no client id is struck
    assert set(s.node_strikes.strikes) <= {spoofer}  # at most the spoofer's own node
    assert s.node_strikes.excluded(spoofer)
    assert s.identity.node_of[1] == 1001 and not s.node_strikes.excluded(1001)


# ---------------------------------------------------------------- an update scaled ×1e12
SCALE = 1e12


def _digits_strategy(name: str) -> DPFLStrategy:
    from fedapp.apps.factories import build_strategy
    from fedapp.clients.common import make_model
    from fedapp.clients.training import get_weights
    from fedapp.config import resolve_config
    from fedapp.data.datasets import load_dataset
    from strategies.base import StrategyContext

    _, test = load_dataset("digits", "")
    cfg = resolve_config(overrides={"strategy": name, "dataset": "digits", "soteriafl-utility": False})
    s = build_strategy(cfg, StrategyContext(initial_weights=get_weights(make_model(cfg.model_spec, test))))
    assert isinstance(s, DPFLStrategy)
    return s


def _dpsgd_metrics(cid: int) -> dict:
    return {"client_id": cid, "status": "ok", "noise_multiplier": 1.0, "sample_rate": 0.1, "steps_round": 10,
            "delta": 1e-5, "num_train": 50, "lr": 0.05, "epsilon_spent": 0.5, "epsilon_budget": 5.0}


def scaled_reply(s: DPFLStrategy, name: str, cid: int, rnd: int, rng: np.random.Generator, scale: float = 1.0) -> FitRes:
    """An honest reply of ``name`` for round ``rnd`` (its payload times ``scale``)."""
    if name.startswith("soteriafl"):
        from strategies.soteriafl import SoteriaFLStrategy, fit_seed, mask_seed

        assert isinstance(s, SoteriaFLStrategy)
        sigma_p, b, m = 0.05, 5, 50
        seed = mask_seed(fit_seed(s.seed, rnd), cid)
        values = (s.num_params / s.k) * rng.normal(scale=sigma_p, size=s.k)  # C(g) of a noise-dominated g, s = 0
        metrics = {"client_id": cid, "status": "ok", "sigma_p": sigma_p, "batch_size": b, "num_train": m,
                   "delta": 1e-5, "noise_split": 1.0, "mask_seed": seed, "epsilon_spent": 0.5, "epsilon_budget": 5.0}
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([(scale * values).astype(np.float32)]), m, metrics)
    if name == "dpsgd-fedavg":  # DP-SGD noise: η c z / b̄ · √steps per coordinate (Eq. 7)
        update = rng.normal(scale=0.05 * 3.0 * 1.0 / 5 * np.sqrt(10), size=s.num_params)
        metrics = _dpsgd_metrics(cid)
    else:
        update = rng.normal(scale=1e-3, size=s.num_params)
        metrics = {"client_id": cid, "status": "ok"}
    arrays = unflatten(scale * update, s.shapes)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([a.astype(np.float32) for a in arrays]), 50, metrics)


def _round(s: DPFLStrategy, rnd: int, replies: list) -> dict[int, dict]:
    s.connected_nodes = {int(p.node_id) for p, _ in replies}
    s.round_log.start(rnd)
    s.aggregate_fit(rnd, replies, [])
    recs = {r["node_id"]: r for r in s.round_log.clients()}
    s.flush_round()
    return recs


@pytest.mark.parametrize("name", ["fedavg", "soteriafl-sgd", "dpsgd-fedavg"])
def test_an_update_scaled_1e12_is_rejected_in_a_round_of_two(name: str) -> None:
    s = _digits_strategy(name)
    rng = np.random.default_rng(1)
    recs = _round(s, 1, [(proxy(0), scaled_reply(s, name, 0, 1, rng)),
                         (proxy(1), scaled_reply(s, name, 1, 1, rng, SCALE))])
    assert recs[1000]["status"] == "ok", recs[1000]
    assert recs[1001]["status"] == "rejected" and recs[1001]["reason"], recs[1001]
    assert float(np.max(np.abs(flatten(s.current_weights)))) < 1e3


def test_dpsgd_fedavg_bounds_an_update_by_its_declared_mechanism_alone() -> None:
    """A round of one: the ×1e12 update exceeds what DP-SGD with the run's c, η, μ and the declared z, q, steps can
    produce; an honest update of the same declaration does not."""
    s = DPSGDFedAvg(initial_weights=[np.zeros(P, np.float32)], num_rounds=3, clip_norm=3.0,
                    lr_schedule=lambda rnd: 0.05, momentum=0.5)
    rng = np.random.default_rng(2)
    honest = rng.normal(scale=0.05 * 3.0 / 5 * np.sqrt(10), size=P)
    for rnd, scale, expected in ((1, 1.0, "ok"), (2, SCALE, "rejected")):
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([(scale * honest).astype(np.float32)]), 50,
                     _dpsgd_metrics(0))
        rec = _round(s, rnd, [(proxy(0), res)])[1000]
        assert rec["status"] == expected, rec
    assert "DP-SGD" in rec["reason"]
    assert float(np.max(np.abs(s.current_weights[0]))) < 1e3


def test_soteriafl_bounds_a_message_by_its_declared_mechanism_alone() -> None:
    s = _digits_strategy("soteriafl-sgd")
    rng = np.random.default_rng(3)
    assert _round(s, 1, [(proxy(0), scaled_reply(s, "soteriafl-sgd", 0, 1, rng))])[1000]["status"] == "ok"
    rec = _round(s, 2, [(proxy(0), scaled_reply(s, "soteriafl-sgd", 0, 2, rng, SCALE))])[1000]
    assert rec["status"] == "rejected" and "SoteriaFL" in rec["reason"], rec
    assert float(np.max(np.abs(flatten(s.current_weights)))) < 1e3


def test_fedavg_bounds_a_lone_update_by_earlier_rounds() -> None:
    """No mechanism bounds FedAvg: after rounds in which updates were compared, a round's only update is held to
    robust-norm-factor × the median norm of the earlier accepted ones (and struck)."""
    s = FedAvg(initial_weights=[np.zeros(P, np.float32)], num_rounds=4)
    rng = np.random.default_rng(4)

    def reply(cid: int, scale: float = 1.0) -> FitRes:
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([(scale * rng.normal(scale=1e-3, size=P))
                                                                   .astype(np.float32)]), 10,
                      {"client_id": cid, "status": "ok"})

    assert {r["status"] for r in _round(s, 1, [(proxy(0), reply(0)), (proxy(1), reply(1))]).values()} == {"ok"}
    rec = _round(s, 2, [(proxy(1), reply(1, SCALE))])[1001]
    assert rec["status"] == "rejected" and "earlier rounds" in rec["reason"], rec
    assert s.strikes.strikes == {1: 1}
    assert float(np.max(np.abs(s.current_weights[0]))) < 1


def test_a_pair_without_history_strikes_nobody() -> None:
    """Two updates and no earlier norms: the larger, above robust-norm-factor × the smaller, is rejected, but either
    may be the hostile one (a tiny update would make an honest one look large), so nobody is struck and neither
    norm becomes a reference."""
    s = FedAvg(initial_weights=[np.zeros(P, np.float32)], num_rounds=4)
    tiny = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.full(P, 1e-9, np.float32)]), 10,
                  {"client_id": 0, "status": "ok"})
    honest = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.full(P, 1e-3, np.float32)]), 10,
                    {"client_id": 1, "status": "ok"})
    recs = _round(s, 1, [(proxy(0), tiny), (proxy(1), honest)])
    assert recs[1000]["status"] == "ok" and recs[1001]["status"] == "rejected"
    assert recs[1001]["attributable"] is False
    assert s.strikes.strikes == {} and s.node_strikes.strikes == {}
    assert len(s.validator.norm_history) == 0
