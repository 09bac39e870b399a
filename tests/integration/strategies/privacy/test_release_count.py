"""What a release reveals about the cohort, and the fewest survivors a secure sum is unmasked with.

* The released mean divides by the fixed expected cohort r under sampling (McMahan et al. 2018), so its noise std
  σC/r does not tell an observer how many clients were sampled; a mean over the realised count would (σC/r_t).
* Where the release's noise does reveal the count (no SecAgg+: per-update noise; dropouts: σ·√(r'/r_t)), the release
  is charged unamplified, and the release adversary without SecAgg+ is refused before a run.
* A secure sum of fewer than 3 survivors is never unmasked: withheld before the unmask stage, nothing charged.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import client_manager
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from fedapp.config import ConfigError, resolve_config
from strategies.fed_smp import FedSMPStrategy
from strategies.privacy.accountants import epsilon_of
from strategies.privacy.mechanisms import ClientLevelDP

SHAPES = [(40, 25)]  # d = 1,000 coordinates: enough for the noise std to pin the count
D = 1000
SIGMA, CLIP, DELTA = 1.0, 1.0, 1e-3


def secure_strategy(r: int, n: int, sampling: str = "poisson", adversary: str = "release") -> FedSMPStrategy:
    """DP-FedAvg (dense) fed replies as Flower's SecAgg+ hands them over: each carries the survivors' mean."""
    dp = ClientLevelDP(SIGMA, CLIP, r, n, 50, DELTA, secure_aggregation=True, adversary=adversary)
    return FedSMPStrategy(initial_weights=[np.zeros(s, np.float32) for s in SHAPES], num_rounds=50, seed=3,
                               clients_per_round=r, sparsifier="none", clip=CLIP, mechanism_factory=lambda _n: dp,
                               secure_aggregation=True, sampling=sampling)


def mean_reply(mean: np.ndarray, cid: int) -> FitRes:
    metrics = {"client_id": cid, "status": "ok", "noise_multiplier": SIGMA}
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([mean.reshape(SHAPES[0]).astype(np.float32)]), 1,
                  metrics)


def run_secure_round(s: FedSMPStrategy, rnd: int, n: int, rng: np.random.Generator,
                     survivors: int | None = None) -> tuple[int, np.ndarray | None, str | None]:
    """One round of zero updates: r_t sampled clients each add N(0, C²σ²/r_t), the server reconstructs the sum and
    Flower divides it by the r' survivors. Returns (r_t, the released model change or None, the refusal)."""
    ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(n))
    r_t = len(ins)
    alive = ins[: r_t if survivors is None else survivors]
    total = sum(rng.normal(0.0, CLIP * SIGMA / np.sqrt(max(r_t, 1)), D) for _ in alive)
    results = [(p, mean_reply(total / len(alive), int(p.node_id) - 1)) for p, _ in alive] if alive else []
    before = np.concatenate([w.ravel() for w in s.current_weights]).astype(np.float64)
    refusal = s.unmask_refusal(rnd, results) if results else "nobody sampled"
    if refusal is None:
        s.aggregate_fit(rnd, results, [])
    elif results:
        s.record_unreconstructed(rnd, results, [], refusal)
    after = np.concatenate([w.ravel() for w in s.current_weights]).astype(np.float64)
    s.flush_round()
    return r_t, (after - before if refusal is None else None), refusal


def test_the_released_noise_std_is_sigma_c_over_r_whatever_the_realised_cohort():
    """Poisson sampling at q = 8/16: r_t varies from round to round, the release's noise std does not. A mean over the
    realised survivors would have std σC/r_t, which d = 1,000 coordinates measure to ~2 %: the count would show."""
    r, n = 8, 16
    s = secure_strategy(r, n)
    rng = np.random.default_rng(0)
    seen: dict[int, float] = {}
    for rnd in range(1, 25):
        r_t, change, _ = run_secure_round(s, rnd, n, rng)
        if change is not None:
            seen[r_t] = float(np.std(change))
    assert len(seen) >= 3, seen  # several distinct cohort sizes were released
    for r_t, std in seen.items():
        assert std == pytest.approx(CLIP * SIGMA / r, rel=0.1), (r_t, std)  # σC/r, not σC/r_t
    smallest, largest = min(seen), max(seen)
    assert CLIP * SIGMA / smallest > 1.2 * CLIP * SIGMA / largest  # what a realised-count mean would have shown


def test_full_participation_divides_by_the_clients_of_the_round():
    """q = 1: nothing is amplified, and the mean is over the round's r_t = n clients (behaviour of the papers)."""
    s = secure_strategy(4, 4, sampling="fixed", adversary="server")
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(4))
    u = np.full(D, 0.01)
    s.aggregate_fit(1, [(p, mean_reply(u, int(p.node_id) - 1)) for p, _ in ins], [])
    np.testing.assert_allclose(s.current_weights[0].ravel(), u, rtol=1e-6)


def test_a_round_with_dropouts_is_released_unamplified():
    """3 of 4 sampled updates summed: the sum carries σ·√(3/4), which reveals the count, so the release view and the
    budget (release adversary) charge that round at q = 1; a full round is amplified at q = r/n."""
    r, n = 4, 8
    s = secure_strategy(r, n, sampling="fixed")
    rng = np.random.default_rng(1)
    _, change, refusal = run_secure_round(s, 1, n, rng)  # every sampled client survives
    assert refusal is None and change is not None
    _, change, refusal = run_secure_round(s, 2, n, rng, survivors=3)
    assert refusal is None and change is not None
    z_drop = SIGMA * np.sqrt(3 / 4)
    expected = epsilon_of([(SIGMA, r / n, 1), (z_drop, 1.0, 1)], DELTA)
    assert s.accounting.release_view.population_epsilon() == pytest.approx(expected)
    assert s.ledger.population_epsilon() == pytest.approx(expected)  # the budget is the release's here
    assert expected > epsilon_of([(SIGMA, r / n, 1), (z_drop, r / n, 1)], DELTA)


def test_without_secure_aggregation_the_release_is_unamplified_and_the_release_adversary_refused():
    dp = ClientLevelDP(SIGMA, CLIP, 5, 20, 10, DELTA, secure_aggregation=False, adversary="release")
    assert dp.release_sample_rate == 1.0 and dp.accounted_sample_rate == 1.0
    assert dp.epsilon_vs_release() == pytest.approx(epsilon_of([(SIGMA, 1.0, 10)], DELTA))
    secure = ClientLevelDP(SIGMA, CLIP, 5, 20, 10, DELTA, secure_aggregation=True, adversary="release")
    assert secure.accounted_sample_rate == 0.25
    with pytest.raises(ConfigError, match="client-dp-adversary.*secure-aggregation = false"):
        resolve_config(None, {"strategy": "dp-fedavg", "secure-aggregation": False,
                              "client-dp-adversary": "release", "clients-per-round": 5})


def test_a_two_survivor_secure_sum_is_withheld_before_unmasking_and_charged_nothing():
    r, n = 4, 8
    s = secure_strategy(r, n, sampling="fixed", adversary="server")
    rng = np.random.default_rng(2)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(n))
    results = [(p, mean_reply(rng.normal(size=D), int(p.node_id) - 1)) for p, _ in ins[:2]]
    refusal = s.unmask_refusal(1, results)  # what the SecAgg+ workflow asks before its unmask stage
    assert refusal is not None and "fewer than 3" in refusal
    s.record_unreconstructed(1, results, [], refusal)
    assert [c["status"] for c in s.round_log.clients()] == ["withheld", "withheld"]
    assert s.round_log.metrics()["sum_reconstructed"] is False
    s.flush_round()
    assert not np.any(s.current_weights[0]) and s.ledger.population_epsilon() == 0.0 and not s.accounting.server_view.histories
    _, change, refusal = run_secure_round(s, 2, n, rng, survivors=3)  # three survivors are unmasked
    assert refusal is None and change is not None and s.ledger.population_epsilon() > 0


def test_secure_aggregation_with_fewer_than_three_clients_a_round_is_refused_before_the_run():
    dp = ClientLevelDP(SIGMA, CLIP, 2, 2, 5, 0.01, secure_aggregation=True, adversary="server")
    s = FedSMPStrategy(initial_weights=[np.zeros(s, np.float32) for s in SHAPES], num_rounds=5, seed=0,
                            clients_per_round=2, sparsifier="none", clip=CLIP, mechanism_factory=lambda _n: dp,
                            secure_aggregation=True)
    with pytest.raises(ConfigError, match="fewer than 3"):
        s.setup_privacy(2)


def test_a_rounded_continuous_gaussian_sum_labels_its_epsilon_vs_server_not_proven():
    """Item 7: under SecAgg+ with continuous Gaussian shares the ε against the server is the continuous Gaussian's,
    but the server sees Flower's rounded modular sum; every record, the summary and the plan say it is not proven."""
    from fedapp.run.launch import plan
    from fedapp.state.results import summarize

    s = secure_strategy(4, 8, sampling="fixed", adversary="server")
    rng = np.random.default_rng(4)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(8))
    results = [(p, mean_reply(rng.normal(scale=0.01, size=D), int(p.node_id) - 1)) for p, _ in ins]
    _, metrics = s.aggregate_fit(1, results, [])
    assert metrics["epsilon_vs_server_proven"] is False and "not proven" in metrics["epsilon_vs_server_caveat"]
    record = {"round": 1, "metrics": metrics, "clients": s.round_log.clients()}
    assert summarize([record], 1.0, done=True)["epsilon_vs_server_proven"] is False
    gaussian = plan(6, "strategy='dp-fedavg' secagg-mechanism='gaussian'")
    assert gaussian["mechanism"]["epsilon_vs_server_proven"] is False
    ddg = plan(6, "strategy='dp-fedavg'")
    assert "epsilon_vs_server_proven" not in ddg["mechanism"]  # the discrete Gaussian's sum is the analysed one
    ftrl = plan(4, "strategy='dp-ftrl' secagg-mechanism='gaussian'")
    assert ftrl["mechanism"]["epsilon_vs_server_proven"] is False
