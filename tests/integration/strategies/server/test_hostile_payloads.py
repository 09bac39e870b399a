"""Hostile or broken client results are rejected, recorded in rounds.jsonl and never averaged."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters

from fedapp.state.results import ResultsWriter
from strategies.base import DPFLStrategy

SHAPES = [(3, 2), (2,)]
HONEST = [np.full((3, 2), 0.5, np.float32), np.full((2,), -1.0, np.float32)]


def fit_res(arrays=None, metrics=None, num_examples: int = 10, params: Parameters | None = None) -> FitRes:
    if params is None:
        params = ndarrays_to_parameters(HONEST if arrays is None else arrays)
    base = {"client_id": 0, "status": "ok", "epsilon_spent": 0.5, "epsilon_budget": 1.0}
    return FitRes(Status(Code.OK, ""), params, num_examples, base if metrics is None else metrics)


def garbage_params() -> Parameters:
    return Parameters(tensors=[b"\x93NUMPY garbage" * 3, b"\x00\x01"], tensor_type="numpy.ndarray")


CASES = {
    "nan": (lambda: fit_res([np.full((3, 2), np.nan, np.float32), HONEST[1]]), "NaN or Inf"),
    "inf": (lambda: fit_res([HONEST[0], np.array([np.inf, 0], np.float32)]), "NaN or Inf"),
    "too-few-arrays": (lambda: fit_res(HONEST[:1]), "expected 2 arrays, got 1"),
    "too-many-arrays": (lambda: fit_res(HONEST + [np.zeros(1, np.float32)]), "expected 2 arrays, got 3"),
    "wrong-shape": (lambda: fit_res([np.zeros((2, 3), np.float32), HONEST[1]]), "has shape (2, 3), expected (3, 2)"),
    "int-dtype": (lambda: fit_res([np.zeros((3, 2), np.int32), HONEST[1]]), "dtype int32"),
    "float16-dtype": (lambda: fit_res([np.zeros((3, 2), np.float16), HONEST[1]]), "dtype float16"),
    "complex-dtype": (lambda: fit_res([np.zeros((3, 2), np.complex64), HONEST[1]]), "dtype complex64"),
    "undecodable": (lambda: fit_res(params=garbage_params()), "undecodable payload"),
    "norm-above-bound": (lambda: fit_res([np.full((3, 2), 100.0, np.float32), HONEST[1]]), "exceeds the declared bound"),
    "missing-client-id": (lambda: fit_res(metrics={"status": "ok"}), "lack 'client_id'"),
    "string-client-id": (lambda: fit_res(metrics={"client_id": "zero", "status": "ok"}), "malformed metric 'client_id'"),
    "negative-client-id": (lambda: fit_res(metrics={"client_id": -3, "status": "ok"}), "malformed metric 'client_id'"),
    "string-epsilon": (lambda: fit_res(metrics={"client_id": 0, "epsilon_spent": "tiny"}), "malformed metric 'epsilon_spent'"),
    "nan-epsilon": (lambda: fit_res(metrics={"client_id": 0, "epsilon_spent": float("nan")}), "not finite"),
    "negative-noise": (lambda: fit_res(metrics={"client_id": 0, "noise_multiplier": -1.0}), "negative"),
    "bytes-status": (lambda: fit_res(metrics={"client_id": 0, "status": b"ok"}), "unknown status b'ok'"),
    "unknown-status": (lambda: fit_res(metrics={"client_id": 0, "status": "great"}), "unknown status 'great'"),
    "over-budget": (lambda: fit_res(metrics={"client_id": 0, "epsilon_spent": 3.0, "epsilon_budget": 1.0}),
                    "exceeds the client's epsilon_budget"),
    "zero-examples": (lambda: fit_res(num_examples=0), "num_examples = 0"),
}


def make_strategy(tmp_path=None, **kwargs) -> DPFLStrategy:
    recorder = ResultsWriter(tmp_path, {"strategy": "base", "dataset": "none", "seed": 0}) if tmp_path else None
    s = DPFLStrategy(initial_weights=[np.zeros(sh, np.float32) for sh in SHAPES], num_rounds=5, recorder=recorder,
                     **kwargs)
    s.max_update_norm = 10.0  # declared clip bound of a client-level mode
    s.round_log.start(1)
    return s


def proxy(i: int) -> SimpleNamespace:
    return SimpleNamespace(node_id=1000 + i)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_hostile_payload_is_rejected_and_not_averaged(case: str) -> None:
    build, expected = CASES[case]
    s = make_strategy()
    bad = build()
    if isinstance(bad.metrics.get("client_id"), int) and bad.metrics["client_id"] == 0:
        bad.metrics["client_id"] = 7
    honest = fit_res(metrics={"client_id": 1, "status": "ok", "epsilon_spent": 0.5, "epsilon_budget": 1.0})
    s.aggregate_fit(1, [(proxy(0), bad), (proxy(1), honest)], [])
    recs = {r["node_id"]: r for r in s.round_log.clients()}
    assert recs[1000]["status"] == "rejected", recs[1000]
    assert expected in recs[1000]["reason"], recs[1000]["reason"]
    assert recs[1001]["status"] == "ok"
    # only the honest update moved the model: θ = 0 + 1.0 · Δ_honest
    for w, h in zip(s.current_weights, HONEST):
        np.testing.assert_allclose(w, h)
    assert s.round_log.metrics()["clients_rejected"] == 1


def test_unbound_client_id_claimed_twice_rejects_every_claim() -> None:
    s = make_strategy()
    a = fit_res(metrics={"client_id": 4, "status": "ok"})
    b = fit_res([np.full((3, 2), 9.0, np.float32), HONEST[1]], metrics={"client_id": 4, "status": "ok"})
    s.aggregate_fit(1, [(proxy(0), a), (proxy(1), b)], [])
    assert [r["status"] for r in s.round_log.clients()] == ["rejected", "rejected"]
    assert all("claimed by several unbound nodes" in r["reason"] for r in s.round_log.clients())
    assert all(not np.any(w) for w in s.current_weights)
    assert s.strikes.strikes == {} and s.node_strikes.strikes == {}  # the server cannot tell who is honest


def test_all_rejected_leaves_model_unchanged_and_rejections_reach_rounds_jsonl(tmp_path) -> None:
    s = make_strategy(tmp_path)
    s.recorder.open()
    results = [(proxy(i), CASES[name][0]()) for i, name in enumerate(["nan", "wrong-shape", "int-dtype", "undecodable"])]
    for i, (_, res) in enumerate(results):
        res.metrics["client_id"] = i
    s.aggregate_fit(1, results, [])
    for w in s.current_weights:
        assert not np.any(w)
    s.flush_round()
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    record = json.loads((run_dir / "rounds.jsonl").read_text().splitlines()[0])
    assert [c["status"] for c in record["clients"]] == ["rejected"] * 4
    assert all(c["reason"] for c in record["clients"])
    assert record["metrics"]["clients_rejected"] == 4 and record["metrics"]["clients_ok"] == 0


def test_failures_are_recorded_with_their_client_id() -> None:
    s = make_strategy()
    err = ValueError("Message contains an Error (reason: fedapp.clients.guard.InjectedFault:<injected fault: client_id=3 "
                     "round=1 (fault-fraction=0.2)>)")
    s.aggregate_fit(1, [(proxy(0), fit_res())], [err])
    failed = [r for r in s.round_log.clients() if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["client_id"] == 3 and "injected fault" in failed[0]["reason"]
    assert s.round_log.metrics()["clients_failed"] == 1


def test_min_fit_clients_aborts_with_clear_message() -> None:
    s = make_strategy(min_fit_clients=2)
    with pytest.raises(RuntimeError, match=r"only 1 acceptable client update.*1 rejected.*min-fit-clients = 2"):
        bad = CASES["nan"][0]()
        bad.metrics["client_id"] = 1
        s.aggregate_fit(1, [(proxy(0), fit_res()), (proxy(1), bad)], [])


@pytest.mark.slow
def test_every_registered_strategy_rejects_nan_and_wrong_arrays() -> None:
    """Family strategies (custom decoders included) never average a NaN or mis-shaped payload."""
    from fedapp.apps.factories import build_strategy
    from fedapp.clients.common import make_model
    from fedapp.clients.training import get_weights
    from fedapp.config import resolve_config
    from fedapp.data.datasets import load_dataset
    from fedapp.registry import REGISTRY
    from strategies.base import StrategyContext

    _, test = load_dataset("digits", "")
    checked = []
    families = {}
    for spec in REGISTRY.values():  # one strategy per family keeps this under a few seconds
        families.setdefault(spec.family.name, spec)
    for name in (s.name for s in families.values()):
        cfg = resolve_config(overrides={"strategy": name, "dataset": "digits"})
        weights = get_weights(make_model(cfg.model_spec, test))
        strat = build_strategy(cfg, StrategyContext(initial_weights=weights))
        if not isinstance(strat, DPFLStrategy):
            continue
        before = [w.copy() for w in strat.current_weights]
        strat.round_log.start(1)
        nan = [np.full(w.shape, np.nan, np.float32) for w in before]
        extra = [np.zeros(w.shape, np.float32) for w in before] + [np.zeros(3, np.float32)]
        results = [(proxy(0), fit_res(nan, {"client_id": 0, "status": "ok"})),
                   (proxy(1), fit_res(extra, {"client_id": 1, "status": "ok"}))]
        try:
            strat.aggregate_fit(1, results, [])
        except RuntimeError as exc:  # a family that needs min clients may abort: still nothing averaged
            assert "acceptable" in str(exc) or "update" in str(exc), (name, exc)
        assert [r["status"] for r in strat.round_log.clients()] == ["rejected", "rejected"], name
        for a, b in zip(before, strat.current_weights):
            np.testing.assert_array_equal(a, b, err_msg=name)
        checked.append(name)
    assert len(checked) == len(families), (checked, sorted(families))


# ---------------------------------------------------------------- the hostile-client battery
def _ok(cid: int, arrays=None, num_examples: int = 10, **metrics) -> FitRes:
    return fit_res(arrays, {"client_id": cid, "status": "ok", **metrics}, num_examples=num_examples)


def _dpsgd_metrics(**extra) -> dict:
    return {"noise_multiplier": 1.2, "sample_rate": 0.1, "steps_round": 10, "delta": 1e-5, **extra}


def test_a_refusal_cannot_poison_another_clients_ledger_entry() -> None:
    s = make_strategy()
    s.aggregate_fit(1, [(proxy(1), _ok(1, **_dpsgd_metrics()))], [])
    honest = s.ledger.epsilon(1)
    assert honest > 0  # charged by the server from the declared mechanism
    forged = fit_res([], {"client_id": 1, "status": "refused", "epsilon_spent": 1e6}, num_examples=0)
    s.connected_nodes = {1001, 1009}  # as configure_fit records them from the client manager
    s.aggregate_fit(2, [(proxy(9), forged)], [])  # another node speaks for client 1
    assert s.ledger.epsilon(1) == pytest.approx(honest)  # nothing a client says reaches the ledger
    assert s.round_log.clients()[0]["status"] == "rejected" and "bound to" in s.round_log.clients()[0]["reason"]


def test_ledger_takes_the_servers_accounting_and_flags_a_false_report() -> None:
    from strategies.privacy.accountants import epsilon_of

    s = make_strategy()
    s.aggregate_fit(1, [(proxy(1), _ok(1, **_dpsgd_metrics(epsilon_spent=0.01, epsilon_budget=5.0)))], [])
    rec = s.round_log.clients()[0]
    # the server's number: the declared mechanism under replace-one neighbours (declared by none: the default)
    assert rec["epsilon_spent"] == pytest.approx(epsilon_of([(1.2, 0.1, 10)], 1e-5, "dpa-pld-replace-one"))
    assert rec["client_epsilon_spent"] == 0.01 and "server's ledger" in rec["epsilon_mismatch"]


def test_a_client_cannot_lower_its_declared_noise_later() -> None:
    s = make_strategy()
    s.aggregate_fit(1, [(proxy(1), _ok(1, **_dpsgd_metrics()))], [])
    s.aggregate_fit(2, [(proxy(1), _ok(1, **_dpsgd_metrics(noise_multiplier=0.1)))], [])
    assert "differs from" in s.round_log.clients()[0]["reason"]


def test_a_spoofer_cannot_take_a_bound_clients_place() -> None:
    s = make_strategy()
    s.aggregate_fit(1, [(proxy(1), _ok(1)), (proxy(2), _ok(2))], [])
    spoof = _ok(1, [np.full((3, 2), 0.9, np.float32), HONEST[1]])
    before = [w.copy() for w in s.current_weights]
    s.aggregate_fit(2, [(proxy(0), spoof), (proxy(1), _ok(1)), (proxy(2), _ok(2))], [])
    recs = {r["node_id"]: r for r in s.round_log.clients()}
    assert recs[1000]["status"] == "rejected" and recs[1001]["status"] == "ok" == recs[1002]["status"]
    np.testing.assert_allclose(s.current_weights[0], before[0] + 0.5)  # only the two honest updates moved it
    assert s.strikes.strikes.get(1, 0) == 0  # the impersonated client is not punished


def test_finite_float64_beyond_float32_and_huge_num_examples_are_rejected() -> None:
    s = make_strategy()
    s.validator.max_examples = {0: 40, 1: 40}
    huge = _ok(0, [np.full((3, 2), 1e39, np.float64), HONEST[1].astype(np.float64)])
    s.aggregate_fit(1, [(proxy(0), huge), (proxy(1), _ok(1, num_examples=10**9))], [])
    reasons = [r["reason"] for r in s.round_log.clients()]
    assert "float32" in reasons[0] and "dataset size 40" in reasons[1]
    assert all(np.all(np.isfinite(w)) and not np.any(w) for w in s.current_weights)


def test_an_update_far_above_the_rounds_median_is_rejected_without_a_declared_bound() -> None:
    s = make_strategy()
    s.max_update_norm = None  # fedavg / Robust-HDP / SoteriaFL: no mechanism bound
    big = _ok(3, [np.full((3, 2), 1e12, np.float32), HONEST[1]])
    s.aggregate_fit(1, [(proxy(i), _ok(i)) for i in range(3)] + [(proxy(3), big)], [])
    recs = s.round_log.clients()
    assert [r["status"] for r in recs] == ["ok", "ok", "ok", "rejected"] and "median" in recs[3]["reason"]
    np.testing.assert_allclose(s.current_weights[0], 0.5)


def test_repeated_rejections_exclude_a_client_and_the_run_says_so() -> None:
    s = make_strategy()
    s.strikes.limit = 2
    nan = [np.full((3, 2), np.nan, np.float32), HONEST[1]]
    for rnd in (1, 2):
        s.aggregate_fit(rnd, [(proxy(5), _ok(5, nan)), (proxy(1), _ok(1))], [])
    rec5 = next(r for r in s.round_log.clients() if r["client_id"] == 5)
    assert s.strikes.excluded(5) and rec5.get("excluded")
    s.aggregate_fit(3, [(proxy(5), _ok(5)), (proxy(1), _ok(1))], [])
    assert "excluded" in next(r for r in s.round_log.clients() if r["client_id"] == 5)["reason"]


def test_robust_hdp_survives_a_payload_that_breaks_robust_pca() -> None:
    from strategies.robust_hdp import RobustHDP

    s = RobustHDP(initial_weights=[np.zeros(sh, np.float32) for sh in SHAPES], num_rounds=3, robust_norm_factor=0)
    s.round_log.start(1)
    updates = [(proxy(i), _ok(i, [np.full((3, 2), 0.1 * (i + 1), np.float32), HONEST[1]])) for i in range(3)]
    updates.append((proxy(3), _ok(3, [np.full((3, 2), 3e38, np.float32), HONEST[1]])))  # overflows in RPCA
    s.aggregate_fit(1, updates, [])  # must not raise out of aggregate_fit
    assert all(np.all(np.isfinite(w)) for w in s.current_weights)
