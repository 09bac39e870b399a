"""The client-level audit block: heads-or-tails canaries, and a run whose few canaries drew fewer than 2 heads still
ends with its bound (no estimate, and the reason)."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.audit import audit_block, canary_coins, canary_update


def _models(dim: int, rounds: int = 3) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(1)
    initial = rng.standard_normal(dim)
    return initial, [initial + rng.standard_normal(dim) * (t + 1) for t in range(rounds)]


def test_a_tails_canary_sends_nothing_and_a_heads_one_its_direction() -> None:
    coins = canary_coins(0, 7)
    for j in range(7):
        update = canary_update(0, 7, j, 50)
        assert (np.linalg.norm(update) == pytest.approx(1.0)) if coins[j] else not update.any()


def test_fewer_than_two_heads_gives_the_bound_and_says_why_there_is_no_estimate() -> None:
    assert int(canary_coins(0, 3).sum()) == 1  # audit-seed 0: one head among 3 canaries
    initial, models = _models(200)
    block = audit_block(0, 3, initial, models, 1e-5, {"epsilon_accountant": 1.0})
    for name in ("final_model", "all_iterates"):
        assert block[name]["epsilon_estimate"] is None and "1 heads canaries" in block[name]["estimate_error"]
        assert block[name]["epsilon_lower_bound"] >= 0.0 and block[name]["guesses"] >= 2
    full = audit_block(0, 7, initial, models, 1e-5, {"epsilon_accountant": 1.0})
    assert full["final_model"]["epsilon_estimate"] is not None and full["canaries_heads"] == 4


def test_one_canary_is_refused_before_the_run() -> None:
    with pytest.raises(ConfigError, match=r"'audit-canaries' = 1: the audit guesses the coins of at least 2"):
        resolve_config({"strategy": "dp-fedavg", "audit-canaries": 1})
