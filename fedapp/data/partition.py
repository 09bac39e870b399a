"""Partitioners, deterministic by seed: IID, shards (McMahan), pathological, Dirichlet.

Each returns one index array per client over the training pool; partitions are disjoint.
IID, pathological and Dirichlet come from flwr-datasets: the pool's labels go into an
in-memory ``datasets.Dataset`` (rows in a seeded random order, with an ``index`` column
carrying each row's position in the pool) and the partitioner's rows map back through it.
McMahan's shards stay hand-written (see :func:`shards`). :func:`train_test_split_local`
then keeps a fraction of each client's indices as its local test split.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from fedapp.config import ConfigError

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner import Partitioner

PARTITION_ATTEMPTS = 10  # Dirichlet: fresh partitioner seeds tried (each redraws up to 11 times itself)


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _seed(seed: int, stream: int) -> int:
    """A 32-bit seed for a flwr-datasets partitioner, derived from the run seed and a stream id."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def label_dataset(labels: np.ndarray, seed: int, stream: int, rank: np.ndarray | None = None) -> datasets.Dataset:
    """The pool's labels as an in-memory ``datasets.Dataset`` in a seeded random row order.

    Columns: ``label``, ``index`` (the row's position in the pool) and, when given, ``rank``
    (a per-row key to partition by instead of the label). The random order makes the
    within-class splits of flwr-datasets' partitioners (contiguous in row order) random.
    """
    from datasets import Dataset

    perm = _rng(seed, stream).permutation(len(labels))
    columns = {"label": np.asarray(labels)[perm], "index": perm}
    if rank is not None:
        columns["rank"] = np.asarray(rank)[perm]
    return Dataset.from_dict(columns)


def _indices(partitioner: Partitioner, num_clients: int) -> list[np.ndarray]:
    """Pool indices of every partition of an (already assigned) flwr-datasets partitioner."""
    return [np.sort(np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64)) for i in range(num_clients)]


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """flwr-datasets ``IidPartitioner`` over the seeded row order: ``num_clients`` near-equal random parts."""
    from flwr_datasets.partitioner import IidPartitioner

    part = IidPartitioner(num_partitions=num_clients)
    part.dataset = label_dataset(labels, seed, 101)
    return _indices(part, num_clients)


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """McMahan et al. (2017) sharding, as in Robust-HDP App. B.1 (hand-written).

    Sort by label (ties in random order), cut into ``num_clients · shards_per_client``
    near-equal contiguous shards, give each client ``shards_per_client`` random shards. With
    balanced classes and 16 shards per class × 10 classes for 20 clients × 8 shards this is
    exactly the paper's split: no client sees more than 8 classes, all get equal sizes.

    Not flwr-datasets' ``ShardPartitioner`` (checked in 0.6.1): given ``num_shards_per_partition``
    it uses shards of ``floor(N / (n·s))`` samples and drops the remaining ``N mod (n·s)``, so the
    partitions would not cover the pool; here shard sizes differ by at most one and every sample
    is assigned. When ``n·s`` divides ``N`` both give the same label structure (tests check this).
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
    """N clients with exactly S classes each (DP2-FedSAM / FedRep style), disjoint samples.

    flwr-datasets ``PathologicalPartitioner`` in its ``deterministic`` mode, applied to the
    classes in a seeded random order π: client i holds classes π((i + j) mod C), j < S, so each
    class is held by about ``N·S / C`` clients and its samples are split equally (at random)
    among its holders. Classes no client holds (when N + S − 1 < C) stay unused.
    """
    from flwr_datasets.partitioner import PathologicalPartitioner

    classes = np.unique(labels)
    num_classes = len(classes)
    if not 1 <= classes_per_client <= num_classes:
        raise ConfigError(f"pathological: classes-per-client = {classes_per_client} must be in 1..{num_classes}")
    class_order = _rng(seed, 103).permutation(num_classes)  # rank of each class (sorted) in π
    rank = class_order[np.searchsorted(classes, labels)]
    part = PathologicalPartitioner(num_partitions=num_clients, partition_by="rank",
                                   num_classes_per_partition=classes_per_client,
                                   class_assignment_mode="deterministic", shuffle=False, seed=_seed(seed, 103))
    part.dataset = label_dataset(labels, seed, 103, rank=rank)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "classes will NOT be used": documented above
            return _indices(part, num_clients)
    except ValueError as exc:
        raise ConfigError(f"pathological: {num_clients} clients × {classes_per_client} classes: {exc}") from None


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 2) -> list[np.ndarray]:
    """Label proportions per client ~ Dirichlet(α) (Hsu et al. 2019), flwr-datasets ``DirichletPartitioner``.

    Each class is split among the clients in proportions drawn from Dirichlet(α·1); draws are
    repeated until every client has ``min_size`` samples.
    """
    from flwr_datasets.partitioner import DirichletPartitioner

    dataset = label_dataset(labels, seed, 104)
    for attempt in range(PARTITION_ATTEMPTS):
        part = DirichletPartitioner(num_partitions=num_clients, partition_by="label", alpha=float(alpha),
                                    min_partition_size=min_size, self_balancing=False, shuffle=False,
                                    seed=_seed(seed, 1040 + attempt))
        part.dataset = dataset
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # its per-redraw "min_partition_size not met"
                return _indices(part, num_clients)
        except ValueError:
            continue
    raise ConfigError(f"dirichlet: could not give each of {num_clients} clients {min_size} samples with alpha={alpha}")


def partition(labels: np.ndarray, num_clients: int, method: str, seed: int, *, shards_per_client: int = 8,
              classes_per_client: int = 2, alpha: float = 0.5) -> list[np.ndarray]:
    """Dispatch on ``method``; validates that every client gets data."""
    if num_clients < 2:
        raise ConfigError(f"a federation needs at least 2 clients, got num-partitions = {num_clients}")
    if num_clients > len(labels):
        raise ConfigError(f"{num_clients} clients but only {len(labels)} training samples")
    labels = np.asarray(labels, dtype=np.int64)
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


def train_validation_split_local(train: np.ndarray, validation_fraction: float, seed: int,
                                 client_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's training indices into (train, validation), deterministic per (seed, client).

    The validation split is for choosing hyper-parameters (``fedapp.experiments.report``'s ``tune``): it is never
    trained on, and it is disjoint from the local test split the reports show.
    """
    if validation_fraction <= 0 or len(train) < 2:
        return train, train[:0]
    perm = np.random.default_rng([seed, 106, client_id]).permutation(train)
    n_val = min(max(1, int(round(len(perm) * validation_fraction))), len(perm) - 1)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])
