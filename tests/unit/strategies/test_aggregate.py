"""The blocked weighted sum with unit weights gives exactly what numpy's sum of the stack gives (the
client-level families sum their updates with it; runs stay reproducible)."""
from __future__ import annotations

import numpy as np
import pytest

from strategies.aggregate import _SUM_BLOCK, weighted_sum


@pytest.mark.parametrize("d", [1, 7, _SUM_BLOCK, 3 * _SUM_BLOCK + 5])
def test_unit_weighted_sum_is_bit_identical_to_numpy_sum_of_the_stack(d: int) -> None:
    rng = np.random.default_rng(d)
    updates = [rng.standard_normal(d) * 10.0 ** rng.integers(-8, 8) for _ in range(13)]
    ours = weighted_sum(updates, np.ones(len(updates)))
    assert ours.dtype == np.float64 and ours.shape == (d,)
    assert np.array_equal(ours, np.sum(updates, axis=0))
    assert not np.shares_memory(ours, updates[0])  # the inputs are untouched
    assert np.array_equal(weighted_sum(updates[:1], [1.0]), updates[0])
    with pytest.raises(ValueError, match="no updates"):
        weighted_sum([], [])

