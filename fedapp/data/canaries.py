"""Canary records of a record-level privacy audit (run-config ``audit-canaries``; :mod:`fedapp.privacy.record_audit`
explains the design and scores them): slot j of m belongs to client j mod n and holds one of two random candidate
records, by a coin only the auditor's seed (``audit-seed``) knows. A client's N_i grows by its slot count whichever
candidate it holds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedapp.data.datasets import ArrayDataset


def candidates(seed: int, slots: int, input_shape: Sequence[int], num_classes: int) -> ArrayDataset:
    """The 2·``slots`` candidate records: rows 2j and 2j+1 are a_j and b_j (the same for clients and the auditor), two
    N(0, 1) inputs with one random label: what the model learns of the label alone moves both alike."""
    rng = np.random.default_rng([int(seed), 917])
    x = rng.standard_normal((2 * int(slots), *map(int, input_shape))).astype(np.float32)
    y = np.repeat(rng.integers(0, int(num_classes), size=int(slots)), 2).astype(np.int64)  # a pair shares its label
    return ArrayDataset(x, y, int(num_classes))


def coins(seed: int, slots: int) -> np.ndarray:
    """The auditor's secret: True where slot j's client holds a_j, False where it holds b_j."""
    return np.random.default_rng([int(seed), 919]).random(int(slots)) < 0.5


def client_slots(client_id: int, num_clients: int, slots: int) -> np.ndarray:
    """The slots of client ``client_id``: j ≡ client_id (mod n), j < m."""
    return np.arange(int(client_id), int(slots), max(int(num_clients), 1), dtype=np.int64)


def slot_count(client_id: int, num_clients: int, slots: int) -> int:
    """How many canary records client ``client_id`` holds (its N_i grows by this many): len(:func:`client_slots`)."""
    n = max(int(num_clients), 1)
    return int(slots) // n + (1 if int(client_id) < int(slots) % n else 0)


def with_canaries(train: ArrayDataset, seed: int, slots: int, client_id: int, num_clients: int) -> ArrayDataset:
    """``train`` followed by the records client ``client_id`` holds (one candidate of each of its slots)."""
    mine = client_slots(client_id, num_clients, slots)
    if len(mine) == 0:
        return train
    pool = candidates(seed, slots, train.input_shape, train.num_classes)
    rows = 2 * mine + np.where(coins(seed, slots)[mine], 0, 1)
    return ArrayDataset(np.concatenate([np.asarray(train.x), pool.x[rows]]),
                        np.concatenate([np.asarray(train.y), pool.y[rows]]), train.num_classes)
