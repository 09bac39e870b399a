"""fedapp.privacy.masks: SecAgg+ masks from AES-256-CTR keyed by the whole secret."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen as flowers

from fedapp.privacy.masks import pseudo_rand_gen

SHAPES = [(3, 4), (5,), (), (2, 1, 3)]


def _fold_twin(seed: bytes) -> bytes:
    """Another 32-byte secret with the same XOR of its 4-byte words: flip one bit in word 0 and the same in word 1."""
    flipped = bytearray(seed)
    flipped[0] ^= 1
    flipped[4] ^= 1
    return bytes(flipped)


def test_flowers_masks_hang_on_32_bits_of_the_secret_and_these_on_all_of_it():
    """The defect: Flower seeds MT19937 with the XOR of the secret's eight 4-byte words, so two different 256-bit
    secrets give one mask and a mask has 2^32 possible values. Here every bit of the secret changes the mask."""
    seed = os.urandom(32)
    twin = _fold_twin(seed)
    assert twin != seed
    assert all(np.array_equal(a, b) for a, b in zip(flowers(seed, 2**32, SHAPES), flowers(twin, 2**32, SHAPES)))
    ours, ours_twin = pseudo_rand_gen(seed, 2**32, SHAPES), pseudo_rand_gen(twin, 2**32, SHAPES)
    assert not all(np.array_equal(a, b) for a, b in zip(ours, ours_twin))
    for bit in range(256):  # any single bit of the secret changes the mask
        flipped = bytearray(seed)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert not np.array_equal(pseudo_rand_gen(bytes(flipped), 2**32, [(8,)])[0], ours[0].ravel()[:8])


def test_same_shapes_dtype_and_determinism_as_flowers():
    seed = os.urandom(32)
    out = pseudo_rand_gen(seed, 2**20, SHAPES)
    assert [a.shape for a in out] == [tuple(s) for s in SHAPES] == [a.shape for a in flowers(seed, 2**20, SHAPES)]
    assert all(a.dtype == np.int64 for a in out)
    again = pseudo_rand_gen(seed, 2**20, SHAPES)  # both ends draw the same mask from the same secret
    assert all(np.array_equal(a, b) for a, b in zip(out, again))
    assert all(((a >= 0) & (a < 2**20)).all() for a in out)
    with pytest.raises(ValueError, match="num_range"):
        pseudo_rand_gen(seed, 1, SHAPES)


@pytest.mark.parametrize("num_range", [2**12, 2**32, 3 * 2**20 + 7])
def test_values_are_uniform_on_the_whole_range(num_range: int):
    """A chi-square test over 16 equal bins of [0, num_range) (also a range that is not a power of two), and the
    top value is reachable (Flower's randint(0, num_range − 1) never draws num_range − 1)."""
    from scipy import stats

    (values,) = pseudo_rand_gen(b"\x07" * 32, num_range, [(200_000,)])
    counts = np.bincount((values * 16 // num_range).astype(np.int64), minlength=16)
    assert stats.chisquare(counts).pvalue > 1e-4
    assert values.min() >= 0 and values.max() < num_range and values.max() >= num_range - num_range // 1000
