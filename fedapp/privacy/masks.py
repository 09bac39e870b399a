"""The masks of Flower's SecAgg+ from a keyed AES-256-CTR stream instead of a Mersenne Twister seeded with 32 bits.

Flower's ``pseudo_rand_gen(seed, num_range, dimensions_list)`` folds the 32-byte secret it is given (a client's
private mask seed, or the key two clients agree for their pairwise mask) into a 32-bit integer by XOR of its 4-byte
words and seeds ``numpy.random.RandomState`` (MT19937) with it. Each mask therefore takes one of only 2^32 values,
and two secrets with the same fold give the same mask: whoever knows a client's masked vector and all of its masks but
one (e.g. the server with neighbours that collude, fewer than the reconstruction threshold, which SecAgg+ is meant to
withstand) finds the last by trying 2^32 seeds. The key agreement and the encryption of the shares are at ~128 bits.

:func:`pseudo_rand_gen` keeps Flower's signature and output shapes and dtype (int64, one array per shape) and draws
the values from AES-256 in counter mode keyed by SHA-256 of a domain label and the whole secret (every bit of it
counts; a secret is used for one mask a round, since SecAgg+ draws fresh keys and seeds every round), 8 bytes a
value reduced modulo ``num_range``: uniform on [0, num_range) up to num_range / 2^64 per value (exact for a power of
two, the moduli SecAgg+ uses). AES-CTR with AES-NI also costs less than MT19937's ``randint``: a client draws r + 1
masks a round with r neighbours, at r = 100 and the Table-5 CNN's 28,938 values 12 ms instead of 69 ms (5.5×); at
the Fed-SMP CNN's 1.66 M values, where memory bandwidth bounds both, 1.2× (``benchmarks/secagg_masks.py``).

Both ends must draw the same masks: the client mod masks its vector, and the server workflow removes the private
masks of surviving clients and the pairwise masks of dropped ones. :func:`fedapp.compat.secagg.use_masks` switches
both on, on the SecAgg+ code paths that switch on the project's Shamir sharing and key agreement.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import NDArray

DOMAIN = b"fedapp secagg+ mask v1"
_ZERO_NONCE = bytes(16)


def keystream_words(seed: bytes, count: int) -> NDArray[np.uint64]:
    """``count`` 64-bit words of AES-256-CTR keyed by SHA-256(DOMAIN || seed), counter from zero."""
    key = hashlib.sha256(DOMAIN + bytes(seed)).digest()
    encryptor = Cipher(algorithms.AES(key), modes.CTR(_ZERO_NONCE)).encryptor()
    out = np.empty(count + 2, dtype="<u8")  # update_into wants block size − 1 bytes of room beyond the input
    encryptor.update_into(np.zeros(count, dtype="<u8").data.cast("B"), out.data.cast("B"))
    return out[:count]


def pseudo_rand_gen(seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]) -> list[NDArray[np.int64]]:
    """One int64 array per shape of ``dimensions_list`` with values uniform on [0, num_range), from ``seed``."""
    if not 1 < num_range <= 2**62:
        raise ValueError(f"num_range must be in (1, 2^62], got {num_range}")
    sizes = [math.prod(shape) for shape in dimensions_list]
    words = keystream_words(seed, sum(sizes))
    if num_range & (num_range - 1) == 0:
        words &= np.uint64(num_range - 1)
    else:
        words %= np.uint64(num_range)
    values = words.view(np.int64)  # every value is below 2^62: the same numbers as int64
    out, start = [], 0
    for shape, size in zip(dimensions_list, sizes):
        out.append(values[start:start + size].reshape(shape))
        start += size
    return out
