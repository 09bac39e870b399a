"""A client's data: its partition of the training pool, split into local train and test."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from fedapp.config import RunConfig
from fedapp.data.datasets import ArrayDataset, load_dataset
from fedapp.data.partition import partition, train_test_split_local, train_validation_split_local
from fedapp.state.cache import cached_arrays, library_versions, release_mapped_pages

_PARTITION_FORMAT = 1  # bump when a partitioner's output changes, so cached partitions are rebuilt


def _capped_pool(cfg: RunConfig) -> ArrayDataset:
    train, _ = load_dataset(cfg["dataset"], cfg["data-dir"])
    cap = int(cfg["max-samples"])
    if 0 < cap < len(train):
        idx = np.sort(np.random.default_rng([int(cfg["seed"]), 106]).permutation(len(train))[:cap])
        train = train.subset(idx)
    return train


def _public_split(size: int, public: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(public indices, remaining indices) of a pool of ``size``: ``public`` drawn uniformly by seed."""
    if not 0 <= public < size:
        raise ValueError(f"run-config 'public-samples' = {public} must be in [0, {size}) for a pool of {size}")
    perm = np.random.default_rng([seed, 107]).permutation(size)
    return np.sort(perm[:public]), np.sort(perm[public:])


def training_pool(cfg: RunConfig) -> ArrayDataset:
    """The training split, optionally capped to ``max-samples`` (deterministic subsample),
    minus the server's public set when ``public-samples`` > 0 (Fed-SMP Sec. 6.1: D_p is held
    out of every client's data)."""
    public = int(cfg.get("public-samples", 0))
    if public <= 0:
        return _capped_pool(cfg)
    return _held_out_pool(cfg["dataset"], cfg["data-dir"], int(cfg["max-samples"]), public, int(cfg["seed"]))


@functools.lru_cache(maxsize=4)
def _held_out_pool(dataset: str, data_dir: str, max_samples: int, public: int, seed: int) -> ArrayDataset:
    cfg = {"dataset": dataset, "data-dir": data_dir, "max-samples": max_samples, "seed": seed}
    train = _capped_pool(cfg)  # type: ignore[arg-type]
    return train.subset(_public_split(len(train), public, seed)[1])


def public_dataset(cfg: RunConfig) -> ArrayDataset:
    """The server's public set D_p (``public-samples`` examples, disjoint from every client's data)."""
    pool = _capped_pool(cfg)
    return pool.subset(_public_split(len(pool), int(cfg.get("public-samples", 0)), int(cfg["seed"]))[0])


@functools.lru_cache(maxsize=8)
def _partitions(dataset: str, data_dir: str, max_samples: int, method: str, num_clients: int, seed: int,
                shards_per_client: int, classes_per_client: int, alpha: float,
                public_samples: int = 0) -> tuple[np.ndarray, ...]:
    cfg = {"dataset": dataset, "data-dir": data_dir, "max-samples": max_samples, "seed": seed,
           "public-samples": public_samples}
    pool = training_pool(cfg)  # type: ignore[arg-type]
    args = (method, num_clients, seed, shards_per_client, classes_per_client, alpha, _PARTITION_FORMAT,
            library_versions("flwr-datasets", "numpy"))  # the partitioners' code and RNG
    key = hashlib.sha256(np.ascontiguousarray(pool.y).tobytes() + repr(args).encode()).hexdigest()[:24]

    def build() -> dict[str, np.ndarray]:  # flwr-datasets (and its ~90 MB of imports) only on a cache miss
        parts = partition(pool.y, num_clients, method, seed, shards_per_client=shards_per_client,
                          classes_per_client=classes_per_client, alpha=alpha)
        return {"indices": np.concatenate(parts).astype(np.int64),
                "offsets": np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)}

    arrays = cached_arrays(f"partition-{key}", build)
    idx, off = np.asarray(arrays["indices"]), np.asarray(arrays["offsets"])
    return tuple(idx[off[i]:off[i + 1]].copy() for i in range(num_clients))


def _partition_key(cfg: RunConfig, num_clients: int) -> tuple:
    """The arguments of :func:`_partitions` for ``cfg`` (hashable: the in-process memo's key)."""
    return (cfg["dataset"], cfg["data-dir"], int(cfg["max-samples"]), cfg["partitioner"], num_clients,
            int(cfg["seed"]), int(cfg["shards-per-client"]), int(cfg["classes-per-client"]),
            float(cfg["dirichlet-alpha"]), int(cfg.get("public-samples", 0)))


def client_partition_indices(cfg: RunConfig, num_clients: int) -> tuple[np.ndarray, ...]:
    return _partitions(*_partition_key(cfg, num_clients))


def split_client_indices(indices: np.ndarray, local_test_fraction: float, validation_fraction: float, seed: int,
                         client_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, validation, local test) indices of one client: the local test split first, then the
    validation split out of what remains (``local-test-fraction``, ``validation-fraction``)."""
    rest, test = train_test_split_local(indices, local_test_fraction, seed, client_id)
    train, val = train_validation_split_local(rest, validation_fraction, seed, client_id)
    return train, val, test


def _split_args(cfg: RunConfig) -> tuple[float, float, int]:
    """(local-test-fraction, validation-fraction, seed): what :func:`split_client_indices` reads from ``cfg``."""
    return float(cfg["local-test-fraction"]), float(cfg.get("validation-fraction", 0.0)), int(cfg["seed"])


def load_client_data(cfg: RunConfig, client_id: int,
                     num_clients: int) -> tuple[ArrayDataset, ArrayDataset, ArrayDataset]:
    """(local train, local validation, local test) of client ``client_id`` of ``num_clients``."""
    pool = training_pool(cfg)
    indices = client_partition_indices(cfg, num_clients)[client_id]
    tr, val, te = split_client_indices(indices, *_split_args(cfg), client_id)
    local = pool.subset(tr), pool.subset(val), pool.subset(te)  # copies: the pool's pages are not needed after
    release_mapped_pages(pool.x, pool.y)
    return local


def client_train_sizes(cfg: RunConfig, num_clients: int) -> list[int]:
    """N_i of every client (for server-side validation before round 1). Memoized per process: every client's
    profile asks for its own N_i, which made building n profiles O(n²) (53 s of dry run at n = 1,000)."""
    return list(_train_sizes(_partition_key(cfg, num_clients), _split_args(cfg)))


@functools.lru_cache(maxsize=8)
def _train_sizes(partition_key: tuple, split_args: tuple[float, float, int]) -> tuple[int, ...]:
    parts = _partitions(*partition_key)
    return tuple(len(split_client_indices(p, *split_args, i)[0]) for i, p in enumerate(parts))
