"""What a zero update does to a client-level DP round: nothing.

The release divides the sum of the accepted updates by the round's sampled count (or the expected cohort), never by
the number accepted, so a zero update moves the model exactly as a dropout does. A mean over the accepted updates
would shrink the honest clients' aggregate by a factor (r − 1)/r instead (3.38 in ℓ2 in this test's round).
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from test_hostile_payloads import proxy

from strategies.aggregate import flatten
from strategies.client_level import ClientLevelDPStrategy
from strategies.dp2_fedsam import DP2FedSAMStrategy
from strategies.fed_smp import FedSMPStrategy
from strategies.privacy.mechanisms import ClientLevelDP

P, N, CLIP, SIGMA = 3000, 10, 3.0, 2.0


def _strategy(name: str) -> ClientLevelDPStrategy:
    mechanism = ClientLevelDP(SIGMA, CLIP, clients_per_round=N, num_clients=N, rounds=5, delta=1e-3,
                              secure_aggregation=False)
    kwargs = dict(name=name, initial_weights=[np.zeros(P, np.float32)], num_rounds=5, clip=CLIP,
                  mechanism_factory=lambda n: mechanism)
    s = FedSMPStrategy(sparsifier="none", **kwargs) if name == "dp-fedavg" else DP2FedSAMStrategy(**kwargs)
    s.prepare_round(N)
    return s


def _released(name: str, honest: list[np.ndarray], zero: bool) -> np.ndarray:
    """The model after one round of every client sampled: ``honest`` replies, plus client N−1's zero update or
    nothing from it (a dropout)."""
    s = _strategy(name)
    nodes = [1000 + i for i in range(N)]
    s.connected_nodes = set(nodes)
    s.round_log.start(1)
    assert s.sample_clients(1, nodes) == nodes  # q = 1: the round's r_t is N
    updates = honest + ([np.zeros(P)] if zero else [])
    replies = [(proxy(i), FitRes(Status(Code.OK, ""), ndarrays_to_parameters([u.astype(np.float32)]), 10,
                                 {"client_id": i, "status": "ok", "noise_multiplier": SIGMA}))
               for i, u in enumerate(updates)]
    s.aggregate_fit(1, replies, [])
    assert s.round_log.metrics()["clients_ok"] == len(updates)  # the zero update is accepted: it is within C
    return flatten(s.current_weights)


@pytest.mark.parametrize("name", ["dp2-fedsam", "dp-fedsam", "dp-fedavg"])
def test_a_zero_update_moves_the_release_as_a_dropout_does(name: str) -> None:
    rng = np.random.default_rng(0)
    std = CLIP * SIGMA / np.sqrt(N)  # without SecAgg+ each update carries N(0, C²σ²/r)
    honest = [np.full(P, 0.5 * CLIP / np.sqrt(P)) + rng.normal(scale=std, size=P) for _ in range(N - 1)]
    dropout, with_zero = _released(name, honest, zero=False), _released(name, honest, zero=True)
    distance = float(np.linalg.norm(with_zero - dropout))
    assert np.linalg.norm(dropout) > 10  # the noisy release the zero update could shrink
    assert distance < 1e-9 * np.linalg.norm(dropout), distance
