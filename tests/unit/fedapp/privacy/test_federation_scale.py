"""Building the profiles of an n-client federation is linear in n: every client's
profile used to re-derive all n train sizes and all n ε draws — 53 s of the launcher's dry run at n = 1,000."""

from __future__ import annotations

import pytest

import fedapp.data.client_data as client_data
from fedapp.config import resolve_config
from fedapp.privacy.profiles import _epsilon_draws, federation_profiles, sample_epsilons


def test_federation_profiles_split_each_partition_once(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 200
    cfg = resolve_config({"dataset": "digits", "batch-size": 0, "privacy-dist": "dist2", "seed": 5})
    calls = {"split": 0}
    real = client_data.train_test_split_local

    def counting(*args, **kwargs):
        calls["split"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(client_data, "train_test_split_local", counting)
    client_data._train_sizes.cache_clear()
    _epsilon_draws.cache_clear()
    profiles = federation_profiles(cfg.general, cfg.training, cfg.data, n)
    assert len(profiles) == n and calls["split"] == n  # was n * n
    sizes = client_data.client_train_sizes(cfg.data, cfg.general.seed, n)
    assert all(p.batch_size <= sizes[p.client_id] for p in profiles)
    assert [p.epsilon for p in profiles] == list(sample_epsilons("dist2", n, 5, float(cfg["epsilon-floor"])))


def test_memoized_epsilon_draws_are_fresh_arrays() -> None:
    a = sample_epsilons("dist2", 10, 1)
    a[:] = -1.0  # a caller mutating its copy changes nobody else's draws
    assert (sample_epsilons("dist2", 10, 1) > 0).all()
