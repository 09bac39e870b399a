"""Shamir secret sharing for Flower's SecAgg+, share-compatible with Flower's and fast enough for large cohorts.

Flower's SecAgg+ shares each client's two 32-byte secrets (its mask seed and its key-agreement secret) with
``flwr.common.secure_aggregation.crypto.shamir``: the secret is padded to whole 16-byte chunks, each chunk is
shared with pycryptodome's ``Shamir`` over GF(2^128) (polynomial x^128 + x^7 + x^2 + x + 1, an element encoded
big-endian), and a share is a 4-byte little-endian index followed by one 16-byte share per chunk. pycryptodome's
field arithmetic is pure Python (a 128-step loop of string operations per product) and its ``combine`` recomputes
the Lagrange basis with one field inversion per share, for every chunk of every client: with 50 clients a round
and every client a neighbour of every other, the server's unmask stage spends ~0.5 s per client (~25 s a round)
there, and each client ~0.15 s creating its shares.

This module computes the same field and the same share format with plain integer carry-less products, and
reconstructs with Lagrange coefficients at 0 that depend only on the share indices, so they are computed once per
index set (in a round without dropouts every client's shares carry the same indices) and each reconstruction is
one product per share and chunk. Shares made here combine with Flower's ``combine_shares`` and Flower's shares
combine here (``tests/unit/fedapp/privacy/test_shamir.py``).

Secret-dependent values (the secret, the random coefficients, the shares) are only ever multiplied by public
values (share indices, Lagrange coefficients), and the loops and branches run over the bits of the public
factor; the reduction is branch-free. Python integers are not constant-time, and neither is the pure-Python
arithmetic this replaces. The random coefficients come from ``secrets`` (the OS CSPRNG), as pycryptodome's do.
"""

from __future__ import annotations

import secrets
from functools import lru_cache

from Crypto.Util.Padding import pad, unpad

_MASK = (1 << 128) - 1
_BLOCK = 16
_INDEX_BYTES = 4


def _reduce(p: int) -> int:
    """p (a carry-less product, < 2^255) modulo the field polynomial, without branches on p: x^128 ≡ x^7 + x^2 + x + 1,
    so the bits above 128 fold back shifted by 0, 1, 2 and 7."""
    for _ in range(2):  # the first fold leaves at most 7 bits above 2^128, the second none
        high = p >> 128
        p = (p & _MASK) ^ high ^ (high << 1) ^ (high << 2) ^ (high << 7)
    return p


def gf_mul(secret: int, public: int) -> int:
    """The product in GF(2^128); the loop runs over the bits of ``public`` only."""
    p = 0
    shift = 0
    while public:
        if public & 1:
            p ^= secret << shift
        public >>= 1
        shift += 1
    return _reduce(p)


def _inverse(a: int) -> int:
    """a^(2^128 - 2) = a^-1 for a public a ≠ 0 (square-and-multiply)."""
    if a == 0:
        raise ValueError("Inversion of zero in GF(2^128)")
    result, base, e = 1, a, (1 << 128) - 2
    while e:
        if e & 1:
            result = gf_mul(result, base)
        base = gf_mul(base, base)
        e >>= 1
    return result


@lru_cache(maxsize=256)
def lagrange_at_zero(indices: tuple[int, ...]) -> tuple[int, ...]:
    """c_j = Π_{m≠j} x_m / (x_j + x_m): the secret is Σ_j c_j y_j (subtraction is addition in GF(2^k))."""
    if len(set(indices)) != len(indices) or 0 in indices:
        raise ValueError(f"share indices must be distinct and nonzero, got {list(indices)}")
    nums, dens = [], []
    for j, x_j in enumerate(indices):
        num, den = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                num = gf_mul(num, x_m)
                den = gf_mul(den, x_j ^ x_m)
        nums.append(num)
        dens.append(den)
    # one inversion for all denominators: prefix products, the inverse of their product, then back again
    prefix = [1]
    for den in dens:
        prefix.append(gf_mul(prefix[-1], den))
    inv = _inverse(prefix[-1])
    coefficients = [0] * len(indices)
    for j in range(len(indices) - 1, -1, -1):
        coefficients[j] = gf_mul(nums[j], gf_mul(inv, prefix[j]))  # 1/den_j = prefix_j / prefix_{j+1}
        inv = gf_mul(inv, dens[j])
    return tuple(coefficients)


def split_chunk(chunk: bytes, threshold: int, num: int) -> list[bytes]:
    """The ``num`` shares p(1), ..., p(num) of one 16-byte chunk, p of degree threshold − 1 with p(0) = chunk."""
    if not 1 <= threshold <= num:
        raise ValueError(f"need 1 <= threshold <= num, got threshold = {threshold}, num = {num}")
    coefficients = [int.from_bytes(secrets.token_bytes(_BLOCK), "big") for _ in range(threshold - 1)]
    coefficients.append(int.from_bytes(chunk, "big"))  # Horner's order: highest degree first, p(0) last
    shares = []
    for x in range(1, num + 1):
        y = 0
        for c in coefficients:
            y = gf_mul(y, x) ^ c
        shares.append(y.to_bytes(_BLOCK, "big"))
    return shares


def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """Flower's ``create_shares``: PKCS#7-padded secret, each share ``index (4 B, LE) || chunk shares``."""
    padded = pad(secret, _BLOCK)
    per_chunk = [split_chunk(padded[i:i + _BLOCK], threshold, num) for i in range(0, len(padded), _BLOCK)]
    return [(x + 1).to_bytes(_INDEX_BYTES, "little") + b"".join(chunk[x] for chunk in per_chunk)
            for x in range(num)]


def combine_shares(share_list: list[bytes]) -> bytes:
    """Flower's ``combine_shares``: the secret from at least ``threshold`` shares (ValueError if they disagree
    on their size, repeat an index, or do not unpad)."""
    if not share_list:
        raise ValueError("Failed to combine shares: no shares")
    size = len(share_list[0])
    if size < _INDEX_BYTES + _BLOCK or (size - _INDEX_BYTES) % _BLOCK or any(len(s) != size for s in share_list):
        raise ValueError("Failed to combine shares: malformed shares")
    indices = tuple(int.from_bytes(s[:_INDEX_BYTES], "little") for s in share_list)
    coefficients = lagrange_at_zero(indices)
    padded = bytearray()
    for start in range(_INDEX_BYTES, size, _BLOCK):
        value = 0
        for c, share in zip(coefficients, share_list, strict=True):
            value ^= gf_mul(int.from_bytes(share[start:start + _BLOCK], "big"), c)
        padded += value.to_bytes(_BLOCK, "big")
    try:
        return unpad(bytes(padded), _BLOCK)
    except ValueError:
        raise ValueError("Failed to combine shares") from None
