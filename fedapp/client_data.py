"""A client's data: its partition of the training pool, split into local train and test."""

from __future__ import annotations

import functools

import numpy as np

from fedapp.config import RunConfig
from fedapp.data import ArrayDataset, load_dataset
from fedapp.partition import partition, train_test_split_local


def training_pool(cfg: RunConfig) -> ArrayDataset:
    """The training split, optionally capped to ``max-samples`` (deterministic subsample)."""
    train, _ = load_dataset(cfg["dataset"], cfg["data-dir"])
    cap = int(cfg["max-samples"])
    if 0 < cap < len(train):
        idx = np.sort(np.random.default_rng([int(cfg["seed"]), 106]).permutation(len(train))[:cap])
        train = train.subset(idx)
    return train


@functools.lru_cache(maxsize=8)
def _partitions(dataset: str, data_dir: str, max_samples: int, method: str, num_clients: int, seed: int,
                shards_per_client: int, classes_per_client: int, alpha: float) -> tuple[np.ndarray, ...]:
    cfg = {"dataset": dataset, "data-dir": data_dir, "max-samples": max_samples, "seed": seed}
    pool = training_pool(cfg)  # type: ignore[arg-type]
    return tuple(partition(pool.y, num_clients, method, seed, shards_per_client=shards_per_client,
                           classes_per_client=classes_per_client, alpha=alpha))


def client_partition_indices(cfg: RunConfig, num_clients: int) -> tuple[np.ndarray, ...]:
    return _partitions(cfg["dataset"], cfg["data-dir"], int(cfg["max-samples"]), cfg["partitioner"], num_clients,
                       int(cfg["seed"]), int(cfg["shards-per-client"]), int(cfg["classes-per-client"]),
                       float(cfg["dirichlet-alpha"]))


def load_client_data(cfg: RunConfig, client_id: int, num_clients: int) -> tuple[ArrayDataset, ArrayDataset]:
    """(local train, local test) of client ``client_id`` of ``num_clients``."""
    pool = training_pool(cfg)
    indices = client_partition_indices(cfg, num_clients)[client_id]
    tr, te = train_test_split_local(indices, float(cfg["local-test-fraction"]), int(cfg["seed"]), client_id)
    return pool.subset(tr), pool.subset(te)


def client_train_sizes(cfg: RunConfig, num_clients: int) -> list[int]:
    """N_i of every client (for server-side validation before round 1)."""
    parts = client_partition_indices(cfg, num_clients)
    return [len(train_test_split_local(p, float(cfg["local-test-fraction"]), int(cfg["seed"]), i)[0])
            for i, p in enumerate(parts)]
