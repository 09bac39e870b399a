"""A client's data: its partition of the training pool, split into local train and test."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from fedapp.config import DataConfig
from fedapp.data.canaries import slot_count
from fedapp.data.datasets import ArrayDataset, load_dataset
from fedapp.data.partition import partition, train_test_split_local, train_validation_split_local
from fedapp.state.cache import cached_arrays, library_versions, read_rows, release_mapped_pages

_PARTITION_FORMAT = 1  # bump when a partitioner's output changes, so cached partitions are rebuilt


@functools.lru_cache(maxsize=8)
def _pool_rows(dataset: str, data_dir: str, max_samples: int, seed: int, public: int) -> np.ndarray | None:
    """The training pool as rows of the dataset's training split (None: every row, in order): the ``max-samples``
    cap (a deterministic subsample by ``seed``), then without the server's ``public-samples``. Indices only, so a
    client gathers its own rows straight from the split (:func:`load_client_data`) instead of copying the capped
    pool first (12,000 MNIST images, 38 MB, for every client a round)."""
    size = len(load_dataset(dataset, data_dir)[0])
    rows = None
    if 0 < max_samples < size:
        rows = np.sort(np.random.default_rng([seed, 106]).permutation(size)[:max_samples])
        size = max_samples
    if public > 0:
        rest = _public_split(size, public, seed)[1]
        rows = rest if rows is None else rows[rest]
    return rows


def _gather(dataset: str, data_dir: str, rows: np.ndarray | None, local: np.ndarray | None = None) -> ArrayDataset:
    """Rows ``local`` of the pool that ``rows`` selects (the whole pool when ``local`` is None), copied out of the
    training split; the split itself when both are None."""
    train, _ = load_dataset(dataset, data_dir)
    if rows is not None and local is not None:
        return train.subset(rows[local])
    picked = rows if local is None else local
    return train if picked is None else train.subset(picked)


def _public_split(size: int, public: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(public indices, remaining indices) of a pool of ``size``: ``public`` drawn uniformly by seed."""
    if not 0 <= public < size:
        raise ValueError(f"run-config 'public-samples' = {public} must be in [0, {size}) for a pool of {size}")
    perm = np.random.default_rng([seed, 107]).permutation(size)
    return np.sort(perm[:public]), np.sort(perm[public:])


def training_pool(data: DataConfig, seed: int) -> ArrayDataset:
    """The training split, optionally capped to ``max-samples`` (deterministic subsample by ``seed``),
    minus the server's public set when ``public-samples`` > 0 (Fed-SMP Sec. 6.1: D_p is held
    out of every client's data)."""
    return _gather(data.dataset, data.data_dir, _pool_rows(data.dataset, data.data_dir, data.max_samples, seed,
                                                           data.public_samples))


def public_dataset(data: DataConfig, seed: int) -> ArrayDataset:
    """The server's public set D_p (``public-samples`` examples, disjoint from every client's data)."""
    capped = _pool_rows(data.dataset, data.data_dir, data.max_samples, seed, 0)
    size = len(load_dataset(data.dataset, data.data_dir)[0]) if capped is None else len(capped)
    return _gather(data.dataset, data.data_dir, capped, _public_split(size, data.public_samples, seed)[0])


def _pool_labels(dataset: str, data_dir: str, max_samples: int, seed: int, public: int) -> np.ndarray:
    """The pool's labels (what the partitioners read), without copying its images."""
    train, _ = load_dataset(dataset, data_dir)
    rows = _pool_rows(dataset, data_dir, max_samples, seed, public)
    return train.y if rows is None else read_rows(train.y, rows)


@functools.lru_cache(maxsize=8)
def _partitions(dataset: str, data_dir: str, max_samples: int, method: str, num_clients: int, seed: int,
                shards_per_client: int, classes_per_client: int, alpha: float,
                public_samples: int = 0) -> tuple[np.ndarray, ...]:
    labels = _pool_labels(dataset, data_dir, max_samples, seed, public_samples)
    args = (method, num_clients, seed, shards_per_client, classes_per_client, alpha, _PARTITION_FORMAT,
            library_versions("flwr-datasets", "numpy"))  # the partitioners' code and RNG
    key = hashlib.sha256(np.ascontiguousarray(labels).tobytes() + repr(args).encode()).hexdigest()[:24]

    def build() -> dict[str, np.ndarray]:  # flwr-datasets (and its ~90 MB of imports) only on a cache miss
        parts = partition(labels, num_clients, method, seed, shards_per_client=shards_per_client,
                          classes_per_client=classes_per_client, alpha=alpha)
        return {"indices": np.concatenate(parts).astype(np.int64),
                "offsets": np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)}

    arrays = cached_arrays(f"partition-{key}", build)
    idx, off = np.asarray(arrays["indices"]), np.asarray(arrays["offsets"])
    return tuple(idx[off[i]:off[i + 1]].copy() for i in range(num_clients))


def _partition_key(data: DataConfig, seed: int, num_clients: int) -> tuple:
    """The arguments of :func:`_partitions` (hashable: the in-process memo's key)."""
    return (data.dataset, data.data_dir, data.max_samples, data.partitioner, num_clients, seed,
            data.shards_per_client, data.classes_per_client, data.dirichlet_alpha, data.public_samples)


def client_partition_indices(data: DataConfig, seed: int, num_clients: int) -> tuple[np.ndarray, ...]:
    """Each client's indices into :func:`training_pool`, for a federation of ``num_clients``."""
    return _partitions(*_partition_key(data, seed, num_clients))


def split_client_indices(indices: np.ndarray, local_test_fraction: float, validation_fraction: float, seed: int,
                         client_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, validation, local test) indices of one client: the local test split first, then the
    validation split out of what remains (``local-test-fraction``, ``validation-fraction``)."""
    rest, test = train_test_split_local(indices, local_test_fraction, seed, client_id)
    train, val = train_validation_split_local(rest, validation_fraction, seed, client_id)
    return train, val, test


def _split_args(data: DataConfig, seed: int) -> tuple[float, float, int]:
    """(local-test-fraction, validation-fraction, seed): what :func:`split_client_indices` reads."""
    return data.local_test_fraction, data.validation_fraction, seed


def load_client_data(data: DataConfig, seed: int, client_id: int,
                     num_clients: int) -> tuple[ArrayDataset, ArrayDataset, ArrayDataset]:
    """(local train, local validation, local test) of client ``client_id`` of ``num_clients``."""
    rows = _pool_rows(data.dataset, data.data_dir, data.max_samples, seed, data.public_samples)
    indices = client_partition_indices(data, seed, num_clients)[client_id]
    tr, val, te = split_client_indices(indices, *_split_args(data, seed), client_id)
    local = tuple(_gather(data.dataset, data.data_dir, rows, part) for part in (tr, val, te))  # copies
    train, _ = load_dataset(data.dataset, data.data_dir)
    release_mapped_pages(train.x, train.y)  # the split's pages are not needed after
    return local[0], local[1], local[2]


def client_train_sizes(data: DataConfig, seed: int, num_clients: int, canaries: int = 0) -> list[int]:
    """N_i of every client (for server-side validation before round 1), with its share of ``canaries`` audit records
    (:mod:`fedapp.data.canaries`). Memoized per process: every client's profile asks for its own N_i, which made
    building n profiles O(n²) (53 s of dry run at n = 1,000)."""
    sizes = _train_sizes(_partition_key(data, seed, num_clients), _split_args(data, seed))
    if not canaries:
        return list(sizes)
    return [size + slot_count(i, num_clients, canaries) for i, size in enumerate(sizes)]


@functools.lru_cache(maxsize=8)
def _train_sizes(partition_key: tuple, split_args: tuple[float, float, int]) -> tuple[int, ...]:
    parts = _partitions(*partition_key)
    return tuple(len(split_client_indices(p, *split_args, i)[0]) for i, p in enumerate(parts))
