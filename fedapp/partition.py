"""Partitioners, deterministic by seed: IID, shards (McMahan), pathological, Dirichlet.

Each returns one index array per client over the training pool; partitions are disjoint.
:func:`train_test_split_local` then keeps a fraction of each client's indices as its
local test split. Written here (not flwr-datasets) because flwr-datasets partitioners
operate on Hugging Face ``Dataset`` objects, not on in-memory arrays, offline.
"""

from __future__ import annotations

import numpy as np

from fedapp.config import ConfigError


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle and cut into ``num_clients`` near-equal parts."""
    perm = _rng(seed, 101).permutation(len(labels))
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """McMahan et al. (2017) sharding, as in Robust-HDP App. B.1.

    Sort by label (ties in random order), cut into ``num_clients · shards_per_client``
    equal contiguous shards, give each client ``shards_per_client`` random shards. With
    balanced classes and 16 shards per class × 10 classes for 20 clients × 8 shards this is
    exactly the paper's split: no client sees more than 8 classes, all get equal sizes.
    """
    rng = _rng(seed, 102)
    n_shards = num_clients * shards_per_client
    if n_shards > len(labels):
        raise ConfigError(f"shards: {num_clients} clients × {shards_per_client} shards exceeds {len(labels)} samples")
    order = np.lexsort((rng.random(len(labels)), labels))
    pieces = np.array_split(order, n_shards)
    assignment = rng.permutation(n_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])) for row in assignment]


def pathological(labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int) -> list[np.ndarray]:
    """N clients with S classes each (DP2-FedSAM / FedRep style), disjoint samples.

    Client i gets classes ``(i + j) mod C`` for a random class offset ordering, so each
    class is held by about ``N·S / C`` clients; each class's samples are split equally
    among its holders.
    """
    classes = np.unique(labels)
    num_classes = len(classes)
    if not 1 <= classes_per_client <= num_classes:
        raise ConfigError(f"pathological: classes-per-client = {classes_per_client} must be in 1..{num_classes}")
    rng = _rng(seed, 103)
    class_order = rng.permutation(classes)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    client_classes = []
    for i in range(num_clients):
        mine = [int(class_order[(i * classes_per_client + j) % num_classes]) for j in range(classes_per_client)]
        client_classes.append(mine)
        for c in mine:
            holders[c].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, owners in holders.items():
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for owner, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 2) -> list[np.ndarray]:
    """Label proportions per client ~ Dirichlet(α) (Hsu et al. 2019); redraws until every client has ``min_size``."""
    rng = _rng(seed, 104)
    classes = np.unique(labels)
    for _attempt in range(100):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ConfigError(f"dirichlet: could not give each of {num_clients} clients {min_size} samples with alpha={alpha}")


def partition(labels: np.ndarray, num_clients: int, method: str, seed: int, *, shards_per_client: int = 8,
              classes_per_client: int = 2, alpha: float = 0.5) -> list[np.ndarray]:
    """Dispatch on ``method``; validates that every client gets data."""
    if num_clients < 2:
        raise ConfigError(f"a federation needs at least 2 clients, got num-partitions = {num_clients}")
    if num_clients > len(labels):
        raise ConfigError(f"{num_clients} clients but only {len(labels)} training samples")
    if method == "iid":
        parts = iid(labels, num_clients, seed)
    elif method == "shards":
        parts = shards(labels, num_clients, shards_per_client, seed)
    elif method == "pathological":
        parts = pathological(labels, num_clients, classes_per_client, seed)
    elif method == "dirichlet":
        parts = dirichlet(labels, num_clients, alpha, seed)
    else:
        raise ConfigError(f"unknown partitioner {method!r}; valid: iid, shards, pathological, dirichlet")
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(f"partitioner {method!r} left clients {empty} without data")
    return parts


def train_test_split_local(indices: np.ndarray, test_fraction: float, seed: int, client_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into (train, local test), deterministic per (seed, client)."""
    perm = np.random.default_rng([seed, 105, client_id]).permutation(indices)
    n_test = int(round(len(perm) * test_fraction))
    if test_fraction > 0 and len(perm) > 1:
        n_test = max(1, n_test)
    n_test = min(n_test, len(perm) - 1)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])
