"""Under SecAgg+, a Poisson sample smaller than the fewest survivors a secure sum is unmasked for
(:data:`strategies.server.secure_sum.MIN_SECURE_SURVIVORS`) could release nothing: the strategy contacts nobody, says
why in the round's metrics, and the run's summary counts the round as unsampled, not failed."""

from __future__ import annotations

import numpy as np
from conftest import client_manager
from flwr.common import ndarrays_to_parameters

from fedapp.state.results import summarize
from strategies.fed_smp import FedSMPStrategy
from strategies.privacy.mechanisms import ClientLevelDP
from strategies.server.secure_sum import MIN_SECURE_SURVIVORS

N = 10


def strategy(secure: bool) -> FedSMPStrategy:
    weights = [np.zeros((3, 2), dtype=np.float32)]
    return FedSMPStrategy(
        initial_weights=weights, num_rounds=3, seed=0, clients_per_round=4, sparsifier="none", compression_ratio=1.0,
        clip=1.0, sampling="poisson", secure_aggregation=secure,
        mechanism_factory=lambda n: ClientLevelDP(1.0, 1.0, 4, n, 3, 1e-3, secure_aggregation=secure,
                                                  adversary="server"))


def _configure(s: FedSMPStrategy, drawn: int) -> tuple[list, dict]:
    s.sampler.sample = lambda server_round, candidates: list(candidates)[:drawn]  # this round's Poisson draw
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(N))
    return ins, dict(s.round_log.metrics())


def test_a_secure_round_drawn_below_the_minimum_contacts_nobody_and_says_so() -> None:
    ins, metrics = _configure(strategy(secure=True), MIN_SECURE_SURVIVORS - 1)
    assert ins == [] and metrics["clients_sampled"] == MIN_SECURE_SURVIVORS - 1 and metrics["below_secure_minimum"]
    record = {"round": 1, "metrics": {**metrics, "clients_ok": 0}, "clients": []}
    summary = summarize([record, {"round": 2, "metrics": {"clients_ok": 3}, "clients": []}], 1.0, done=True)
    assert summary["finished"] and summary["rounds_unsampled"] == [1]


def test_at_the_minimum_or_without_secagg_the_drawn_clients_are_contacted() -> None:
    ins, metrics = _configure(strategy(secure=True), MIN_SECURE_SURVIVORS)
    assert len(ins) == MIN_SECURE_SURVIVORS and "below_secure_minimum" not in metrics
    ins, metrics = _configure(strategy(secure=False), MIN_SECURE_SURVIVORS - 1)
    assert len(ins) == MIN_SECURE_SURVIVORS - 1 and "below_secure_minimum" not in metrics
