"""fedapp.privacy.shamir against Flower's and pycryptodome's Shamir sharing: same field, same share format."""

from __future__ import annotations

import os
import random

import pytest
from Crypto.Protocol.SecretSharing import _Element
from flwr.common.secure_aggregation.crypto import shamir as flower

from fedapp.compat import surface
from fedapp.compat.secagg import SHAMIR_CALLERS, use_shamir
from fedapp.privacy import shamir


def test_the_field_product_is_pycryptodomes():
    rng = random.Random(0)
    values = [0, 1, 2, (1 << 128) - 1, 1 << 127] + [rng.getrandbits(128) for _ in range(200)]
    for a in values:
        for b in rng.sample(values, 8):
            assert shamir.gf_mul(a, b) == int(_Element(a) * _Element(b)), (a, b)


@pytest.mark.parametrize(("degree", "num", "polys"), [(0, 1, 1), (1, 3, 2), (6, 130, 3), (30, 1000, 1)])
def test_the_vectorized_evaluation_is_pycryptodomes_horner(degree, num, polys):
    """evaluate(), every point and polynomial at once in 64-bit words, against Horner's rule in pycryptodome's field,
    with elements that set the top bits (the fold above 2^128) and indices past 2^8 (more shifted words)."""
    import numpy as np

    rng = random.Random(degree * 7 + num)
    coefficients = [[rng.choice([(1 << 128) - 1, 1 << 127, rng.getrandbits(128)]) for _ in range(polys)]
                    for _ in range(degree + 1)]
    hi = np.array([[c >> 64 for c in row] for row in coefficients], dtype=np.uint64)
    lo = np.array([[c & ((1 << 64) - 1) for c in row] for row in coefficients], dtype=np.uint64)
    values = shamir.evaluate(hi, lo, num)
    for x in sorted({1, min(2, num), num, *rng.sample(range(1, num + 1), min(num, 20))}):
        for k in range(polys):
            expected = _Element(0)
            for row in coefficients:
                expected = expected * _Element(x) + _Element(row[k])
            assert (int(values[x - 1, k, 0]) << 64) | int(values[x - 1, k, 1]) == int(expected), (x, k)


@pytest.mark.parametrize(("threshold", "num"), [(1, 1), (2, 2), (2, 3), (3, 7), (25, 50)])
@pytest.mark.parametrize("size", [0, 15, 16, 32, 41])
def test_shares_combine_across_both_implementations(threshold, num, size):
    rng = random.Random(threshold * 1000 + num * 10 + size)
    secret = os.urandom(size)
    ours, flowers = shamir.create_shares(secret, threshold, num), flower.create_shares(secret, threshold, num)
    assert [len(s) for s in ours] == [len(s) for s in flowers]  # the same format: 4-byte index + 16 B per chunk
    assert [s[:4] for s in ours] == [s[:4] for s in flowers]
    for k in {threshold, num}:  # any k >= threshold shares, in any order
        assert flower.combine_shares(rng.sample(ours, k)) == secret
        assert shamir.combine_shares(rng.sample(flowers, k)) == secret
        assert shamir.combine_shares(rng.sample(ours, k)) == secret


def test_fewer_shares_than_the_threshold_do_not_give_the_secret():
    secret = os.urandom(32)
    shares = shamir.create_shares(secret, 5, 9)
    for _ in range(5):
        try:
            assert shamir.combine_shares(random.sample(shares, 4)) != secret
        except ValueError:  # a random-looking chunk rarely unpads
            pass


def test_each_sharing_draws_fresh_coefficients():
    secret = os.urandom(32)
    first, second = shamir.create_shares(secret, 3, 5), shamir.create_shares(secret, 3, 5)
    assert all(a != b for a, b in zip(first, second, strict=True))
    assert shamir.combine_shares(first[:3]) == shamir.combine_shares(second[2:]) == secret


def test_bad_shares_are_refused():
    shares = shamir.create_shares(os.urandom(32), 2, 4)
    with pytest.raises(ValueError, match="distinct"):
        shamir.combine_shares([shares[0], shares[0]])
    with pytest.raises(ValueError, match="malformed"):
        shamir.combine_shares([shares[0], shares[1][:-1]])
    with pytest.raises(ValueError, match="no shares"):
        shamir.combine_shares([])
    with pytest.raises(ValueError, match="threshold"):
        shamir.create_shares(b"x", 3, 2)
    with pytest.raises(ValueError, match="Failed to combine"):  # a chunk that does not unpad
        shamir.combine_shares([(1).to_bytes(4, "little") + bytes(16)])  # share 1 of p = 0: a zero pad byte


def test_a_tampered_share_never_yields_the_secret():
    secret = os.urandom(32)
    shares = shamir.create_shares(secret, 2, 3)
    for position in (4, 20, 51):
        tampered = bytearray(shares[1])
        tampered[position] ^= 1
        try:
            assert shamir.combine_shares([shares[0], bytes(tampered)]) != secret
        except ValueError:  # the changed chunk no longer unpads
            pass


def test_flowers_secagg_plus_calls_these_functions_once_installed():
    use_shamir(shamir.create_shares, shamir.combine_shares)
    use_shamir(shamir.create_shares, shamir.combine_shares)  # idempotent
    for path in SHAMIR_CALLERS:
        assert surface.resolve(path) is getattr(shamir, path.rpartition(".")[2])
