"""DP-FTRL (dp-ftrl): ε recomputed independently, the correlated noise the server adds, SecAgg+ streams and the
present-client accounting, checkpoint/resume of the noise, config errors, real Flower simulations."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import analytic_gaussian_epsilon, client_manager
from flwr.common import Code, Context, FitRes, RecordDict, Status, ndarrays_to_parameters

from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.profiles import ftrl_mechanism
from fedapp.state.checkpoint import load_checkpoint, save_checkpoint
from strategies.dp_ftrl import DPFTRLStrategy, advance_to
from strategies.privacy import matrix_mechanism as mm
from strategies.privacy.ftrl_accounting import FTRLMechanism, run_factorization

SHAPES = [(3, 4), (4,)]  # d = 16
D = 16
DELTA = 1e-3


# ---------------------------------------------------------------------------- independent recomputation


def released_sensitivity(encoder: np.ndarray, row_round: np.ndarray, t: int) -> float:
    """‖C_t u‖ maximised by brute force over every 0/1 participation vector u of the first t rounds (C_t: the rows
    released within t rounds); for C >= 0 the all-ones u wins, which is what the mechanism assumes."""
    c = encoder[row_round < t][:, :t]
    return max(float(np.linalg.norm(c @ np.array(u, dtype=float))) for u in itertools.product((0, 1), repeat=t))


@pytest.mark.parametrize(("kind", "rounds", "bands", "restart"),
                         [("tree", 8, 1, 0), ("tree", 9, 1, 4), ("banded", 10, 3, 0), ("banded", 6, 1, 0)])
def test_epsilon_is_recomputed_independently_within_one_percent(kind, rounds, bands, restart):
    m = FTRLMechanism(kind, rounds, noise_multiplier=7.0, clip=2.0, num_clients=5, delta=DELTA, bands=bands,
                      restart_every=restart)
    f = run_factorization(kind, rounds, bands, restart)
    for t in range(1, rounds + 1):
        sens = released_sensitivity(f.encoder, f.row_round, t)
        assert m.sensitivity(t) == pytest.approx(sens, rel=1e-12)
        assert m.epsilon(t) == pytest.approx(analytic_gaussian_epsilon(7.0 / sens, DELTA), rel=0.01)
    # with SecAgg+ and 3 of 5 streams present, z_eff = z √(3/5)
    secure = FTRLMechanism(kind, rounds, 7.0, 2.0, 5, DELTA, bands=bands, restart_every=restart,
                           secure_aggregation=True)
    assert secure.epsilon(rounds, present=3) == pytest.approx(
        analytic_gaussian_epsilon(7.0 * math.sqrt(3 / 5) / released_sensitivity(f.encoder, f.row_round, rounds),
                                  DELTA), rel=0.01)


def test_calibration_spends_the_target_over_the_run():
    m = FTRLMechanism.calibrated(1.5, kind="tree", rounds=16, clip=1.0, num_clients=10, delta=1e-4)
    tree = mm.tree_aggregation(16)
    sens = float(np.linalg.norm(tree.encoder @ np.ones(16)))  # every round: ‖C 1‖, T(2T − 1) for the tree
    assert sens**2 == pytest.approx(16 * 31)
    assert 1.5 * (1 - 2e-3) <= analytic_gaussian_epsilon(m.noise_multiplier / sens, 1e-4) <= 1.5 * (1 + 1e-3)
    assert m.epsilon() <= 1.5


def test_under_full_participation_no_factorization_beats_independent_noise_by_more_than_sqrt_1_5():
    """‖B‖_F² sens² >= ‖A 1‖² = Σ t² (sens >= ‖C 1‖, A 1 = B C 1); C = I reaches T²(T+1)/2."""
    t = 64
    bound = math.sqrt(sum(s * s for s in range(1, t + 1)) / t)
    rmse = {}
    for name, f in [("identity", mm.identity_factorization(t)), ("tree", run_factorization("tree", t)),
                    *((f"banded-{b}", run_factorization("banded", t, b)) for b in (2, 4, 8))]:
        sens = FTRLMechanism(f.name.split("-")[0] if name != "identity" else "banded", t, 1.0, 1.0, 2, DELTA,
                             bands=int(name.split("-")[1]) if name.startswith("banded") else 1).sensitivity()
        rmse[name] = mm.prefix_sum_rmse(f, sens)
        assert rmse[name] >= bound * (1 - 1e-9), name
    assert rmse["identity"] <= bound * math.sqrt(1.5)
    assert rmse["identity"] < rmse["banded-2"] < rmse["banded-4"] < rmse["banded-8"] < rmse["tree"]


# ---------------------------------------------------------------------------- the server strategy
def strategy(mech: FTRLMechanism, secagg: bool = False, noise_seed: int | None = 5) -> DPFTRLStrategy:
    return DPFTRLStrategy(ftrl_factory=lambda n: mech, noise_seed=noise_seed, clip=mech.clip, secure_aggregation=secagg,
                          initial_weights=[np.zeros(s, np.float32) for s in SHAPES], num_rounds=mech.rounds, seed=0,
                          sampling="fixed")


def reply(arrays: list[np.ndarray], cid: int, z: float) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1,
                  {"client_id": cid, "status": "ok", "noise_multiplier": z})


def run_round(s: DPFTRLStrategy, rnd: int, n: int, updates: dict[int, np.ndarray], secure: bool = False) -> dict:
    ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(n))
    results = [(p, reply([u.reshape(sh) for u, sh in zip(np.split(updates[int(p.node_id) - 1], [12]), SHAPES)],
                         int(p.node_id) - 1, s.ftrl.noise_multiplier))
               for p, _ in ins if int(p.node_id) - 1 in updates]
    if secure:  # what SecAgg+ hands over: every survivor carries the mean of the survivors' vectors
        mean = np.mean([updates[int(p.node_id) - 1] for p, _ in results], axis=0)
        for _, res in results:
            res.parameters = ndarrays_to_parameters([x.reshape(sh) for x, sh in zip(np.split(mean, [12]), SHAPES)])
        reason = s.unmask_refusal(rnd, results)
        if reason is not None:
            s.record_unreconstructed(rnd, results, [], reason)
            metrics = dict(s.round_log.metrics())
            s.flush_round()
            return {**metrics, "refused": reason}
    s.aggregate_fit(rnd, results, [])
    metrics, clients = dict(s.round_log.metrics()), [dict(c) for c in s.round_log.clients()]
    s.flush_round()
    return {**metrics, "clients": clients}


def flat(s: DPFTRLStrategy) -> np.ndarray:
    return np.concatenate([w.ravel() for w in s.current_weights]).astype(np.float64)


@pytest.mark.parametrize("kind", ["tree", "banded"])
def test_the_server_adds_the_correlated_noise_and_charges_one_gaussian(kind):
    n, t = 4, 6
    mech = FTRLMechanism(kind, t, 3.0, 1.0, n, DELTA, bands=3, restart_every=4)
    s = strategy(mech)
    reference = mech.noise_stream(D, np.random.default_rng([5, 601]))
    models = []
    for rnd in range(1, t + 1):
        updates = {i: np.full(D, 0.01 * (i + 1)) for i in range(n)}  # clipped already (norm 0.16 at most)
        before = flat(s)
        metrics = run_round(s, rnd, n, updates)
        moved = (flat(s) - before) * n - sum(updates.values())  # what the server added to the sum
        assert np.allclose(moved, reference.next(), atol=1e-4)  # float32 weights
        models.append(flat(s))
        assert metrics["epsilon"] == pytest.approx(analytic_gaussian_epsilon(
            3.0 / mech.sensitivity(rnd), DELTA), rel=0.01)
        assert "max_epsilon_vs_server" not in metrics and "mean_update_norm" not in metrics
        assert "no epsilon holds against it" in metrics["epsilon_guarantee"]
        assert len(metrics["clients"]) == n and all("epsilon_vs_server" not in r for r in metrics["clients"])
    assert s.configure_fit(t + 1, ndarrays_to_parameters(s.current_weights), client_manager(n)) == []  # past T


def test_a_nan_or_misshaped_reply_is_never_averaged():
    mech = FTRLMechanism("tree", 4, 2.0, 1.0, 3, DELTA)
    s = strategy(mech)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(3))
    nan = [np.full(sh, np.nan, np.float32) for sh in SHAPES]
    extra = [np.zeros(sh, np.float32) for sh in SHAPES] + [np.zeros(2, np.float32)]
    big = [np.ones(sh, np.float32) for sh in SHAPES]  # norm 4 > C = 1: the server declared clipped updates
    s.aggregate_fit(1, [(ins[0][0], reply(nan, 0, 2.0)), (ins[1][0], reply(extra, 1, 2.0)),
                        (ins[2][0], reply(big, 2, 2.0))], [])
    assert [r["status"] for r in s.round_log.clients()] == ["rejected"] * 3
    assert np.all(flat(s) == 0) and s.released_round == 0  # nothing released, nothing charged


def test_the_plan_says_whom_epsilon_holds_against():
    from fedapp.apps.privacy_plan import privacy_plan

    base = {"strategy": "dp-ftrl", "num-server-rounds": 5, "target-epsilon": 2.0}
    central = privacy_plan(resolve_config({}, {**base, "secure-aggregation": False,
                                               "client-dp-adversary": "release"}), 4)
    assert central["every_client"]["epsilon_vs_server"] is None
    assert central["every_client"]["epsilon_vs_release"] == pytest.approx(2.0, rel=2e-3)
    assert central["mechanism"]["noise_added_by"] == "the server"
    secure = privacy_plan(resolve_config({}, {**base, "secagg-mechanism": "gaussian"}), 4)
    assert secure["every_client"]["epsilon_vs_server"] == pytest.approx(2.0, rel=2e-3)


def test_a_resumed_stream_equals_the_uninterrupted_one_through_the_checkpoint_file(tmp_path: Path):
    """The same generator seeded twice: the interrupted-and-resumed server adds exactly the uninterrupted noise."""
    n, t, k = 3, 8, 5
    zero = {i: np.zeros(D) for i in range(n)}
    for kind in ("tree", "banded"):
        mech = FTRLMechanism(kind, t, 2.0, 1.0, n, DELTA, bands=4, restart_every=4)
        straight, first = strategy(mech, noise_seed=11), strategy(mech, noise_seed=11)
        for rnd in range(1, t + 1):
            run_round(straight, rnd, n, zero)
        for rnd in range(1, k + 1):
            run_round(first, rnd, n, zero)
        path = save_checkpoint(tmp_path / f"{kind}.npz", {"state": first.state_dict()})
        resumed = strategy(mech, noise_seed=999)  # a different seed: the noise must come from the checkpoint
        resumed.load_state_dict(load_checkpoint(path)["state"])
        for rnd in range(1, t - k + 1):
            run_round(resumed, rnd, n, zero)
        np.testing.assert_array_equal(flat(resumed), flat(straight))


def test_under_secure_aggregation_the_ledger_counts_only_streams_present_in_every_sum():
    n, t = 6, 5
    mech = FTRLMechanism("banded", t, 4.0, 1.0, n, DELTA, bands=2, secure_aggregation=True)
    s = strategy(mech, secagg=True)
    ones = {i: np.full(D, 0.01) for i in range(n)}
    m1 = run_round(s, 1, n, ones, secure=True)
    assert m1["epsilon"] == pytest.approx(mech.epsilon(1), rel=1e-9) and s.present_count() == 6
    assert m1["max_epsilon_vs_server"] == m1["epsilon"]
    # client 5 drops out of round 2: its stream is broken, the ledger keeps 5 of 6 (z √(5/6)) from now on
    m2 = run_round(s, 2, n, {i: ones[i] for i in range(5)}, secure=True)
    assert s.present_count() == 5 and m2["clients_present"] == 5
    expected = analytic_gaussian_epsilon(4.0 * math.sqrt(5 / 6) / mech.sensitivity(2), DELTA)
    assert m2["epsilon"] == pytest.approx(expected, rel=0.01) and m2["epsilon"] > mech.epsilon(2)
    # three survivors: their streams alone would spend more than the run's budget, so the sum is never
    # reconstructed and nothing is charged (the present set and the ledger stay as they were)
    assert mech.epsilon(3, present=3) > mech.epsilon()
    m3 = run_round(s, 3, n, {i: ones[i] for i in range(3)}, secure=True)
    assert "budget" in m3["refused"] and s.present_count() == 5
    assert s.ledger.population_epsilon() == pytest.approx(mech.epsilon(2, present=5), rel=1e-9)
    # fewer than 3 survivors are never unmasked, whatever the budget
    m3b = run_round(s, 3, n, {0: ones[0], 1: ones[1]}, secure=True)
    assert "fewer than 3" in m3b["refused"] and s.present_count() == 5
    # client 5 is back, but its stream missed a released sum: it never counts again, and with 5 streams the last
    # round no longer fits the budget planned for 6, so nobody is sampled then
    m4 = run_round(s, 4, n, ones, secure=True)
    assert m4["clients_present"] == 5
    assert mech.epsilon(5, present=5) > mech.epsilon() >= mech.epsilon(5)
    assert s.configure_fit(5, ndarrays_to_parameters(s.current_weights), client_manager(n)) == [] and s.budget_exhausted


# ---------------------------------------------------------------------------- the client's stream
def test_client_streams_persist_in_their_context_and_sum_to_the_planned_noise():
    from fedapp.clients.client_dp import FTRLClient
    from fedapp.clients.common import noise_seed, setup_client

    n, t = 3, 6
    ov = {"strategy": "dp-ftrl", "secagg-mechanism": "gaussian", "num-server-rounds": t, "ftrl-bands": 3,
          "noise-multiplier": 2.0, "clip-norm": 1.0, "seeded-noise": True, "privacy-dist": "fixed", "batch-size": 8}
    clients = []
    for cid in range(n):
        ctx = Context(run_id=0, node_id=cid, node_config={"partition-id": cid, "num-partitions": n},
                      state=RecordDict(), run_config={})
        clients.append(FTRLClient(setup_client(ctx, ov), resolve_config(None, ov).client_dp, ctx))
    dp = clients[0].mechanism()
    assert dp.secure_aggregation and dp.noise_std == pytest.approx(2.0 / math.sqrt(n))
    zero = np.zeros(D)
    shares = np.zeros((n, t, D))
    for rnd in range(1, t + 1):
        for cid, c in enumerate(clients):
            fresh = FTRLClient(c.s, c.client_dp, c.context)  # a new client object each round: the stream lives in Context.state
            arrays, _ = fresh.privatize(zero, [(D,)], {"server-round": rnd}, dp, np.random.default_rng(0))
            shares[cid, rnd - 1] = arrays[0]
    # each client's shares are its uninterrupted stream C⁻¹ Z_i, from the generator it started with
    for cid, c in enumerate(clients):
        replay = dp.noise_stream(D, np.random.default_rng(noise_seed(c.s.general, cid, 0)))
        np.testing.assert_allclose(shares[cid], np.stack([replay.next() for _ in range(t)]), rtol=1e-6)  # float32 wire
    assert not np.allclose(shares[0], shares[1])  # independent streams
    # a round already drawn is refused (its noise is never reused)
    _, reason = clients[0].budget_check(dp, 3)
    assert reason is not None and "never reused" in reason
    _, reason = clients[0].budget_check(dp, t + 1)
    assert reason is not None and "past dp-rounds" in reason
    # C Σ_i w_i = Σ_i Z_i: n streams of std zC/√n sum to entries of std zC = 2 (n·t·D = 288 draws)
    z = run_factorization("banded", t, 3).encoder @ shares.sum(axis=0)
    assert abs(float(np.std(z)) - 2.0) < 0.3


def test_advance_to_never_rewinds_a_stream():
    stream = mm.TreeNoise(2, 1.0, np.random.default_rng(0))
    advance_to(stream, 2)
    assert stream.round == 3
    with pytest.raises(ValueError, match="round 1 was already drawn"):
        advance_to(stream, 1)


# ---------------------------------------------------------------------------- config
def test_unsupported_settings_are_refused_naming_the_value():
    base = {"strategy": "dp-ftrl", "num-server-rounds": 6}
    assert resolve_config({}, base).client_dp.secagg_mechanism == "gaussian"  # the default follows the strategy
    with pytest.raises(ConfigError, match="'secagg-mechanism' = 'ddg'"):
        resolve_config({}, {**base, "secagg-mechanism": "ddg"})  # set by the user: refused
    with pytest.raises(ConfigError, match="'client-dp-adversary' = 'server'.*no epsilon holds against it"):
        resolve_config({}, {**base, "secure-aggregation": False})
    with pytest.raises(ConfigError, match="'clients-per-round' = 2"):
        resolve_config({}, {**base, "secagg-mechanism": "gaussian", "clients-per-round": 2})
    with pytest.raises(ConfigError, match="'ftrl-bands' = 7 exceeds the 6 rounds"):
        resolve_config({}, {**base, "secagg-mechanism": "gaussian", "ftrl-bands": 7})
    with pytest.raises(ConfigError, match="'ftrl-restart-every' = 2 would have no effect"):
        resolve_config({}, {**base, "secagg-mechanism": "gaussian", "ftrl-restart-every": 2})
    with pytest.raises(ConfigError, match="'ftrl-mechanism' = 'tree' would have no effect"):
        resolve_config({}, {"strategy": "dp-fedavg", "ftrl-mechanism": "tree"})
    central = resolve_config({}, {**base, "secure-aggregation": False, "client-dp-adversary": "release",
                                  "clients-per-round": 2, "ftrl-mechanism": "tree", "target-epsilon": 2.0})
    m = ftrl_mechanism(central.general, central.training, central.client_dp, 4)
    assert m.kind == "tree" and not m.secure_aggregation and m.epsilon() == pytest.approx(2.0, rel=2e-3)


# ---------------------------------------------------------------------------- real Flower simulations
BASE = {"strategy": "dp-ftrl", "num-server-rounds": 3, "privacy-dist": "fixed", "batch-size": 16, "local-steps": 2,
        "clip-norm": 1.0, "target-epsilon": 4.0, "fraction-evaluate": 0.0, "max-samples": 400, "ftrl-bands": 2}


def simulate(tmp: Path, overrides: dict, num_supernodes: int = 3) -> Path:
    from conftest import run_small_simulation

    return run_small_simulation({**BASE, **overrides, "output-dir": str(tmp)}, num_supernodes)


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def recomputed(cfg_overrides: dict, n: int, t: int, present: int | None = None) -> float:
    """ε after t rounds from scratch: the factorization's encoder, its all-ones participation, Balle–Wang."""
    cfg = resolve_config({}, {**BASE, **cfg_overrides})
    m = ftrl_mechanism(cfg.general, cfg.training, cfg.client_dp, n)
    f = run_factorization(m.kind, m.rounds, m.bands, m.restart_every)
    c = f.encoder[f.row_round < t][:, :t]
    z = m.noise_multiplier * math.sqrt((present or n) / n)
    return analytic_gaussian_epsilon(z / float(np.linalg.norm(c @ np.ones(t))), m.delta)


@pytest.mark.slow
def test_central_dp_ftrl_flower_simulation(tmp_path: Path):
    ov = {"secure-aggregation": False, "client-dp-adversary": "release"}
    run = simulate(tmp_path, ov)
    rounds = rounds_of(run)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["metrics"]["clients_ok"] == 3 and r["metrics"]["accuracy"] is not None
        assert r["metrics"]["epsilon"] == pytest.approx(recomputed(ov, 3, r["round"]), rel=0.01)
        assert all("epsilon_vs_server" not in c or c["epsilon_vs_server"] is None for c in r["clients"])
        assert all(c["epsilon_spent"] == pytest.approx(r["metrics"]["epsilon"], rel=1e-9) for c in r["clients"])
        assert not any(c.get("epsilon_mismatch") for c in r["clients"])
    assert rounds[-1]["metrics"]["epsilon"] <= 4.0
    meta = json.loads((run / "config.json").read_text())
    assert "observers of the released models only" in meta["privacy"]["budget_holds_against"]


@pytest.mark.slow
def test_dp_ftrl_under_secagg_flower_simulation(tmp_path: Path):
    ov = {"secure-aggregation": True, "secagg-mechanism": "gaussian", "seeded-noise": True}
    run = simulate(tmp_path, ov)
    rounds = rounds_of(run)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["metrics"]["secure_aggregation"] is True and r["metrics"]["clients_present"] == 3
        eps = recomputed(ov, 3, r["round"])
        assert r["metrics"]["epsilon"] == pytest.approx(eps, rel=0.01)
        ok = [c for c in r["clients"] if c["status"] == "ok"]
        assert len(ok) == 3 and all(c["epsilon_vs_server"] == pytest.approx(eps, rel=0.01) for c in ok)
    assert rounds[-1]["metrics"]["max_epsilon_vs_server"] <= 4.0
    state = load_checkpoint(run)["state"]
    assert state["family"]["ftrl"]["stream"] is None  # the noise lives with the clients, not the server
