"""Record-level audit canaries: slots spread over the clients, one of two candidates held by a secret coin, the same
records for a client and the auditor, N_i the same whichever candidate is held, and the settings checked."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import client_context

from fedapp.clients.common import setup_client
from fedapp.compat.runtime import SUPERNODE_CLIENTAPP_MODULE
from fedapp.config import ConfigError, resolve_config
from fedapp.config.run_config import record_canaries
from fedapp.data.canaries import candidates, client_slots, coins, slot_count, with_canaries
from fedapp.data.client_data import client_train_sizes
from fedapp.data.datasets import ArrayDataset
from fedapp.data.node_data import NodeDataError
from fedapp.privacy.record_audit import accountant_epsilon, record_audit_block, slot_scores


def test_slots_cover_every_canary_once_and_spread_over_the_clients() -> None:
    slots = np.concatenate([client_slots(c, 7, 30) for c in range(7)])
    assert sorted(slots.tolist()) == list(range(30))
    assert [slot_count(c, 7, 30) for c in range(7)] == [5, 5, 4, 4, 4, 4, 4]


def test_a_client_holds_one_candidate_of_each_of_its_slots_by_the_auditors_coin() -> None:
    train = ArrayDataset(np.zeros((10, 1, 8, 8), np.float32), np.zeros(10, np.int64), 10)
    out = with_canaries(train, 3, 40, client_id=2, num_clients=4)
    pool, coin = candidates(3, 40, (1, 8, 8), 10), coins(3, 40)
    mine = client_slots(2, 4, 40)
    assert len(out) == 10 + len(mine) and np.array_equal(out.x[:10], train.x)
    for row, j in zip(out.x[10:], mine):
        held, other = (2 * j, 2 * j + 1) if coin[j] else (2 * j + 1, 2 * j)
        assert np.array_equal(row, pool.x[held]) and not np.array_equal(row, pool.x[other])
    assert np.array_equal(pool.y[0::2], pool.y[1::2])  # a pair shares its label
    assert 0.3 < coin.mean() < 0.7 and np.array_equal(coin, coins(3, 40))  # fair, and the same for whoever draws
    assert not np.array_equal(coin, coins(4, 40))


def test_scores_favour_the_candidate_whose_loss_dropped_more() -> None:
    before = np.array([2.0, 2.0, 1.0, 3.0])
    after = np.array([0.5, 1.9, 1.0, 1.0])
    assert slot_scores(before, after).tolist() == pytest.approx([1.4, -2.0])


def test_the_accountant_side_is_the_largest_epsilon_of_a_client_holding_canaries() -> None:
    rounds = [{"clients": [{"client_id": 0, "epsilon_spent": 0.5, "delta": 1e-4},
                           {"client_id": 1, "epsilon_spent": 0.9, "delta": 1e-3},
                           {"client_id": 2, "epsilon_spent": 7.0, "delta": 1e-2}]},  # holds no slot of 2
              {"clients": [{"client_id": 0, "epsilon_spent": 1.1, "delta": 1e-4}]}]
    assert accountant_epsilon(rounds, 3, 2) == (1.1, 1e-3)


def test_a_run_that_memorizes_the_held_candidates_gets_a_bound_above_a_small_epsilon() -> None:
    """The block from losses that reveal every coin: the bound is far above ε = 1 (and the estimate too); losses that
    ignore the coins give no bound."""
    m, seed = 400, 5
    truth = coins(seed, m)
    held = np.ravel(np.column_stack([truth, ~truth]))  # row 2j is a_j
    rounds = [{"clients": [{"client_id": c, "epsilon_spent": 1.0, "delta": 1e-5} for c in range(4)]}]

    def block(leak: float) -> dict:
        def losses(flat: np.ndarray) -> np.ndarray:
            return np.where(held, 2.0 - leak * flat[0], 2.0) + np.random.default_rng(int(flat[0])).normal(0, 0.1, 2 * m)
        return record_audit_block(seed, m, losses, np.zeros(1), np.ones(1), rounds, 4)

    leaky, blind = block(1.0), block(0.0)
    assert leaky["epsilon_accountant"] == 1.0 and leaky["level"] == "record"
    assert leaky["final_model"]["epsilon_lower_bound"] > 2.0 and leaky["final_model"]["epsilon_interval"][0] > 2.0
    assert blind["final_model"]["epsilon_lower_bound"] == 0.0


def test_client_and_server_agree_on_n_i_with_canaries(monkeypatch) -> None:
    run = {"strategy": "dpsgd-fedavg", "audit-canaries": 9, "dataset": "digits", "model": "logreg"}
    cfg = resolve_config(run)
    assert record_canaries(cfg.general) == 9
    sizes = client_train_sizes(cfg.data, cfg.general.seed, 4, record_canaries(cfg.general))
    plain = client_train_sizes(cfg.data, cfg.general.seed, 4)
    assert [a - b for a, b in zip(sizes, plain)] == [3, 2, 2, 2]
    for cid in range(4):
        assert len(setup_client(client_context(cid, 4, run_config=run)).train) == sizes[cid]
    assert record_canaries(resolve_config({"strategy": "dp-fedavg", "audit-canaries": 3}).general) == 0


def test_a_supernode_refuses_canary_records(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, SUPERNODE_CLIENTAPP_MODULE, sys)
    with pytest.raises(NodeDataError, match=r"'audit-canaries' = 9 adds canary records"):
        setup_client(client_context(0, 4, run_config={"strategy": "robust-hdp", "audit-canaries": 9}))


def test_the_record_level_settings_are_checked_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=r"record-neighbours = 'add-remove'"):
        resolve_config({"strategy": "robust-hdp", "audit-canaries": 10, "record-neighbours": "add-remove"})
    with pytest.raises(ConfigError, match=r"guesses the coins of at least 2 canaries"):
        resolve_config({"strategy": "soteriafl-gd", "audit-canaries": 1})
    with pytest.raises(ConfigError, match=r"'audit-canaries' = 3 with strategy 'fedavg'"):
        resolve_config({"strategy": "fedavg", "audit-canaries": 3})
    assert resolve_config({"strategy": "soteriafl-svrg", "audit-canaries": 50}).general.audit_canaries == 50
