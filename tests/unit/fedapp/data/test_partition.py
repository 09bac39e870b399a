"""Partitioners: deterministic by seed, disjoint, covering, with the promised label structure."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.data.partition import partition, train_test_split_local

LABELS = np.repeat(np.arange(10), 300)  # balanced, 3000 samples


@pytest.mark.parametrize("method", ["iid", "shards", "pathological", "dirichlet"])
def test_deterministic_disjoint_nonempty(method):
    a = partition(LABELS, 20, method, seed=7)
    b = partition(LABELS, 20, method, seed=7)
    c = partition(LABELS, 20, method, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))
    allidx = np.concatenate(a)
    assert len(allidx) == len(np.unique(allidx))  # disjoint
    assert all(len(p) > 0 for p in a)
    if method in ("iid", "shards", "pathological", "dirichlet"):
        assert len(allidx) == len(LABELS)  # every sample assigned


def test_shards_match_robust_hdp_appendix_b1():
    """16 shards per class, 20 clients x 8 shards: equal sizes and at most 8 classes each."""
    labels = np.repeat(np.arange(10), 320)  # 320 per class = 16 shards of 20 (MNIST: 16 x 375)
    parts = partition(labels, 20, "shards", seed=0, shards_per_client=8)
    assert {len(p) for p in parts} == {len(labels) // 20}
    assert max(len(np.unique(labels[p])) for p in parts) <= 8
    assert all(len(np.unique(labels[np.sort(p)[:20]])) == 1 for p in parts)  # shards never straddle classes


def test_pathological_gives_exactly_s_classes():
    parts = partition(LABELS, 50, "pathological", seed=0, classes_per_client=2)
    assert {len(np.unique(LABELS[p])) for p in parts} == {2}


def test_dirichlet_small_alpha_is_skewed():
    skewed = partition(LABELS, 10, "dirichlet", seed=0, alpha=0.05)
    flat = partition(LABELS, 10, "dirichlet", seed=0, alpha=100.0)
    top = lambda parts: np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])  # noqa: E731
    assert top(skewed) > top(flat) + 0.3


def test_local_split_is_deterministic_and_disjoint():
    idx = np.arange(100, 200)
    tr, te = train_test_split_local(idx, 0.2, seed=1, client_id=3)
    tr2, te2 = train_test_split_local(idx, 0.2, seed=1, client_id=3)
    assert np.array_equal(tr, tr2) and np.array_equal(te, te2)
    assert len(te) == 20 and len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == 100


def test_invalid_requests_name_the_problem():
    with pytest.raises(ConfigError, match="at least 2 clients"):
        partition(LABELS, 1, "iid", seed=0)
    with pytest.raises(ConfigError, match="unknown partitioner"):
        partition(LABELS, 4, "bogus", seed=0)
    with pytest.raises(ConfigError, match="classes-per-client"):
        partition(LABELS, 4, "pathological", seed=0, classes_per_client=11)


def _shares(parts, labels=LABELS):
    return np.array([np.bincount(labels[p], minlength=10) / len(p) for p in parts])


def test_iid_is_near_uniform_with_equal_sizes():
    parts = partition(LABELS, 10, "iid", seed=3)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    assert np.abs(_shares(parts) - 0.1).max() < 0.1  # 300 per client: each class 30 ± a few


@pytest.mark.parametrize("s", [1, 3])
def test_pathological_classes_are_balanced_across_holders(s):
    parts = partition(LABELS, 20, "pathological", seed=5, classes_per_client=s)
    assert {len(np.unique(LABELS[p])) for p in parts} == {s}
    holders = np.bincount(np.concatenate([np.unique(LABELS[p]) for p in parts]), minlength=10)
    assert set(holders.tolist()) == {20 * s // 10}  # each class held by N·S/C clients
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= s  # a class's samples split equally
    other = partition(LABELS, 20, "pathological", seed=6, classes_per_client=s)
    assert [set(np.unique(LABELS[p])) for p in parts] != [set(np.unique(LABELS[p])) for p in other]


def test_pathological_too_few_samples_of_a_class_is_a_config_error():
    labels = np.concatenate([np.repeat(np.arange(9), 50), [9]])  # class 9: one sample, four holders
    with pytest.raises(ConfigError, match="pathological"):
        partition(labels, 20, "pathological", seed=0, classes_per_client=2)


def test_dirichlet_label_skew_decreases_with_alpha():
    top = [_shares(partition(LABELS, 10, "dirichlet", seed=1, alpha=a)).max(axis=1).mean() for a in (0.1, 1.0, 10.0)]
    assert top[0] > top[1] > top[2] and top[2] < 0.25
    assert min(len(p) for p in partition(LABELS, 10, "dirichlet", seed=1, alpha=0.1)) >= 2


def test_dirichlet_impossible_request_is_a_config_error():
    with pytest.raises(ConfigError, match="dirichlet: could not"):
        partition(np.repeat(np.arange(2), 10), 10, "dirichlet", seed=0, alpha=0.001)


def test_shards_match_flwr_datasets_shard_partitioner_when_divisible():
    """Same label structure as flwr-datasets' ShardPartitioner when n·s divides N; it drops the rest otherwise."""
    from datasets import Dataset
    from flwr_datasets.partitioner import ShardPartitioner

    def reference(labels):
        ref = ShardPartitioner(num_partitions=20, partition_by="label", num_shards_per_partition=8, seed=0)
        ref.dataset = Dataset.from_dict({"label": labels})
        return [np.asarray(ref.load_partition(i)["label"]) for i in range(20)]

    labels = np.repeat(np.arange(10), 320)
    ours = [labels[p] for p in partition(labels, 20, "shards", seed=0)]
    for parts in (reference(labels), ours):
        counts = [np.bincount(y, minlength=10) for y in parts]
        assert {int(c.sum()) for c in counts} == {160}
        assert all((c % 20 == 0).all() for c in counts)  # whole 20-sample shards, each of one class
        assert max(int((c > 0).sum()) for c in counts) <= 8
    uneven = LABELS[:2990]
    assert sum(len(y) for y in reference(uneven)) < len(uneven)  # flwr-datasets drops N mod (n·s) samples
    assert len(np.concatenate(partition(uneven, 20, "shards", seed=0))) == len(uneven)  # ours covers the pool
