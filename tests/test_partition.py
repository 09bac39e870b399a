"""Partitioners: deterministic by seed, disjoint, covering, with the promised label structure."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.partition import partition, train_test_split_local

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
