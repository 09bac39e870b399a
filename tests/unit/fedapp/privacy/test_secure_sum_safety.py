"""What keeps a client-level secure sum correct: clipping that refuses non-finite vectors, diverged clients that
restart from the global model, and a modular field wide enough for every cohort."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.clients.common import restart_if_diverged
from fedapp.privacy.secure_aggregation import MAX_MODULUS, modulus_for
from strategies.privacy.mechanisms import ClientLevelDP, NonFiniteUpdate, clip_by_l2


@pytest.mark.parametrize("bad", [[np.nan, 1000.0, -500.0], [np.inf, 0.0, 0.0], [1e308, 1e308, 0.0]])
def test_clip_refuses_what_it_cannot_clip(bad: list[float]) -> None:
    """min(1, C/nan) is 1: a NaN vector used to leave unclipped with its finite coordinates intact."""
    with pytest.raises(NonFiniteUpdate):
        clip_by_l2(np.asarray(bad), 3.0)


def test_clip_bounds_every_finite_vector() -> None:
    rng = np.random.default_rng(0)
    for scale in (1e-6, 1.0, 1e6, 1e150):
        clipped, norm = clip_by_l2(rng.normal(scale=scale, size=50), 3.0)
        assert np.linalg.norm(clipped) <= 3.0 * (1 + 1e-12)


def test_a_diverged_client_sends_the_clipped_zero_update_plus_its_noise() -> None:
    delta = np.array([np.nan, 1.0, 2.0])
    restarted, diverged = restart_if_diverged(delta, client_id=3, server_round=2)
    assert diverged and not np.any(restarted)
    dp = ClientLevelDP(noise_multiplier=1.0, clip=1.0, clients_per_round=4, num_clients=8, rounds=3, delta=1e-3)
    noisy, _ = dp.privatize(restarted, np.random.default_rng(1), 4)
    assert np.all(np.isfinite(noisy)) and np.std(noisy) > 0  # the noise share is still added
    same, diverged = restart_if_diverged(np.ones(3), 3, 2)
    assert not diverged and np.array_equal(same, np.ones(3))


def test_the_field_is_wide_enough_for_every_cohort() -> None:
    q = 2**22  # Flower's quantization range
    assert modulus_for(1, q) == 2**32 and modulus_for(1023, q) == 2**32
    assert modulus_for(1024, q) == 2**33  # Flower's default 2^32 wraps here (the mean came back as 0 or negated)
    for cohort in (1, 10, 1024, 1500, 100_000):
        m = modulus_for(cohort, q)
        assert m > cohort * q and m & (m - 1) == 0 and m <= MAX_MODULUS
    with pytest.raises(ValueError, match="int64"):
        modulus_for(2**41, q)


def test_a_wide_field_sums_exactly() -> None:
    """1,500 clients at the top quantization level: the modular sum with the chosen field is the true sum."""
    q, cohort = 2**22, 1500
    m = modulus_for(cohort, q)
    values = np.full(cohort, q, dtype=np.int64)
    masks = np.random.default_rng(0).integers(0, m, size=cohort, dtype=np.int64)
    masked = [(v + k) % m for v, k in zip(values, masks)]
    total = 0
    for x in masked:
        total = (total + int(x)) % m
    assert (total - int(masks.sum()) % m) % m == cohort * q
