"""Checkpoint format, strategy state round trip and an interrupted + resumed run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedapp.config import ConfigError, resolve_config
from fedapp.state.checkpoint import (
    CHECKPOINT_FILE,
    attach,
    check_resumable,
    load_checkpoint,
    save_checkpoint,
    temp_path,
)
from strategies.base import DPFLStrategy


class ShiftStrategy(DPFLStrategy):
    """A family with server state (like SoteriaFL's shift) and its own RNG."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.shift = np.zeros(4)
        self.rng = np.random.default_rng(5)

    def random_generators(self) -> dict[str, np.random.Generator]:
        return {"rng": self.rng}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"shift": self.shift.copy(), "nested": {"ids": [1, 2], "arr": [np.arange(3)]}}

    def load_checkpoint_state(self, state) -> None:
        self.shift = np.asarray(state["shift"])
        self.nested = state["nested"]


def _strategy() -> ShiftStrategy:
    return ShiftStrategy(initial_weights=[np.zeros((2, 2), np.float32)], num_rounds=5)


def test_save_load_round_trip_is_atomic_and_pickle_free(tmp_path) -> None:
    payload = {"state": {"w": [np.arange(6, dtype=np.float32).reshape(2, 3)], "x": 1.5, "s": "a"}, "rounds": [{"r": 1}]}
    path = save_checkpoint(tmp_path / CHECKPOINT_FILE, payload)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]  # no temporary file left
    out = load_checkpoint(tmp_path)  # a run folder works too
    np.testing.assert_array_equal(out["state"]["w"][0], payload["state"]["w"][0])
    assert out["state"]["w"][0].dtype == np.float32 and out["state"]["x"] == 1.5 and out["rounds"] == [{"r": 1}]
    with np.load(path, allow_pickle=False) as npz:  # loads without pickle: no code in a checkpoint
        assert "__json__" in npz.files


def test_stale_temporary_file_is_removed_before_writing_and_on_resume(tmp_path, monkeypatch) -> None:
    import fedapp.state.checkpoint as ckpt
    from fedapp.state.client_state import ClientStateStore

    target = tmp_path / CHECKPOINT_FILE
    stale = temp_path(target)
    assert stale.name == f".{CHECKPOINT_FILE}.tmp"
    stale.write_bytes(b"")  # the 0-byte leftover of a write killed mid-way
    opened: list[str] = []
    real_open = open

    def spy_open(file, mode="r", *args, **kwargs):
        if Path(file) == stale:
            opened.append(f"{mode}:{stale.exists()}")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(ckpt, "open", spy_open, raising=False)  # only the checkpoint module's open is observed
    save_checkpoint(target, {"state": {"round": 1}})
    monkeypatch.delattr(ckpt, "open")
    assert opened == ["wb:False"]  # the stale file was gone before the new one was written
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]

    stale.write_bytes(b"")  # on start of a resume the interrupted run's leftover goes too
    cfg = resolve_config(overrides={"resume-from": str(tmp_path), "num-server-rounds": 3})
    state = _strategy().state_dict()
    state["round"] = 1
    save_checkpoint(target, {"config": dict(cfg), "state": state, "rounds": [], "lineage": "x"})
    stale.write_bytes(b"")
    remaining = attach(_strategy(), None, run_values=cfg, general=cfg.general, deployment=cfg.deployment)
    assert remaining == 2 and not stale.exists()

    store = ClientStateStore(tmp_path / "clients", 4)  # client-side state: its own leftover on start
    leftover = temp_path(store.path("runA") / "pending-3.npz")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"")
    other = temp_path(ClientStateStore(tmp_path / "clients", 5).path("runA") / "committed.npz")
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x")  # another client's file in flight is not touched
    assert store.restore({}, "runA") is False
    assert not leftover.exists() and other.exists()


def test_directory_is_fsynced_after_the_rename(tmp_path, monkeypatch) -> None:
    import os
    import stat

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(tmp_path / CHECKPOINT_FILE, {"state": {"round": 1}})
    assert events == ["fsync-file", "replace", "fsync-dir"]


def test_strategy_state_round_trip_restores_weights_ledger_rng_and_family_state(tmp_path) -> None:
    a = _strategy()
    a.current_weights = [np.full((2, 2), 3.0, np.float32)]
    a.ledger.charge(0, [(1.5, 0.1, 20)], 1e-5)
    a.ledger.charge(3, [(1.0, 0.2, 30)], 1e-5)
    a.identity.bind(11, 0)
    a.identity.bind(17, 3)
    a.strikes.add(3, "bad payload")
    a.shift[:] = [1, 2, 3, 4]
    a.rng.normal(size=7)  # advance
    a.round_log.last_round = 2
    save_checkpoint(tmp_path / "c.npz", {"state": a.state_dict()})
    b = _strategy()
    b.load_state_dict(load_checkpoint(tmp_path / "c.npz")["state"])
    np.testing.assert_array_equal(b.current_weights[0], a.current_weights[0])
    assert b.ledger.epsilons() == a.ledger.epsilons() and b.round_offset == 2 and b.ledger.epsilon(3) > 0
    assert b.identity.client_of == {11: 0, 17: 3} and b.strikes.strikes == {3: 1}
    np.testing.assert_array_equal(b.shift, [1, 2, 3, 4])
    np.testing.assert_array_equal(b.nested["arr"][0], np.arange(3))
    assert b.rng.normal() == a.rng.normal()  # the generator continues where it stopped
    assert b.actual_round(1) == 3 and b.actual_round(0) == 0


class _Node:
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


def test_ledger_entry_is_per_node_once_the_node_is_known() -> None:
    """A known node gets only its own ε (the message does not grow with n); an unknown node gets all."""
    from strategies.base import LEDGER_CONFIG_KEY

    a = _strategy()
    assert LEDGER_CONFIG_KEY not in a.node_fit_config({"server-round": 1}, 11)  # empty ledger: no key
    for node, cid, steps in ((11, 0, 10), (17, 3, 20), (19, 4, 30)):
        a.identity.bind(node, cid)
        a.ledger.charge(cid, [(1.0, 0.1, steps)], 1e-5)
    eps = {str(k): v for k, v in a.ledger.epsilons().items()}
    assert json.loads(a.node_fit_config({}, 17)[LEDGER_CONFIG_KEY]) == {"3": eps["3"]}
    assert json.loads(a.node_fit_config({}, 99)[LEDGER_CONFIG_KEY]) == eps
    a.identity.bind(23, 7)  # known node, client without a ledger entry yet
    assert LEDGER_CONFIG_KEY not in a.node_fit_config({LEDGER_CONFIG_KEY: "{}"}, 23)


def test_configure_fit_sends_each_known_node_only_its_own_ledger_entry() -> None:
    from flwr.common import ndarrays_to_parameters

    from strategies.base import LEDGER_CONFIG_KEY

    class Manager:
        def __init__(self, nodes):
            self.nodes = nodes

        def wait_for(self, k, timeout=None):
            return True

        def num_available(self):
            return len(self.nodes)

        def sample(self, num_clients, min_num_clients=None, criterion=None):
            return self.nodes[:num_clients]

        def all(self):
            return {str(n.node_id): n for n in self.nodes}

    a = _strategy()
    for node, cid in ((11, 0), (17, 3)):
        a.identity.bind(node, cid)
        a.ledger.charge(cid, [(1.0, 0.1, 10 + cid)], 1e-5)
    e0, e3 = a.ledger.epsilon(0), a.ledger.epsilon(3)
    nodes = [_Node(11), _Node(17), _Node(99)]
    ins = a.configure_fit(1, ndarrays_to_parameters(a.current_weights), Manager(nodes))
    sent = {c.node_id: json.loads(fi.config[LEDGER_CONFIG_KEY]) for c, fi in ins}
    assert sent == {11: {"0": e0}, 17: {"3": e3}, 99: {"0": e0, "3": e3}}


def test_load_state_dict_rejects_a_different_model() -> None:
    state = _strategy().state_dict()
    state["weights"] = [np.zeros((3, 3), np.float32)]
    with pytest.raises(ValueError, match=r"shapes \[\(3, 3\)\], the model has \[\(2, 2\)\]"):
        _strategy().load_state_dict(state)


def test_bad_checkpoints_give_clear_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint file there"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ConfigError, match="is not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.npz")
    np.savez(tmp_path / "foreign.npz", x=np.zeros(2))
    with pytest.raises(ConfigError, match="is not a readable checkpoint"):
        load_checkpoint(tmp_path / "foreign.npz")


def test_check_resumable_names_the_differing_key() -> None:
    cfg = resolve_config(overrides={"num-server-rounds": 4})
    ckpt = {"path": "x/checkpoint.npz", "config": dict(cfg), "state": {"round": 2}}
    check_resumable(cfg, cfg.rounds, ckpt)  # same experiment, rounds left: fine
    check_resumable(resolve_config(overrides={"num-server-rounds": 6, "output-dir": "elsewhere"}), 6, ckpt)
    with pytest.raises(ConfigError, match="'seed' = 7 differs from the checkpoint's 42"):
        check_resumable(resolve_config(overrides={"num-server-rounds": 4, "seed": 7}), 4, ckpt)
    with pytest.raises(ConfigError, match="already completed round 2"):
        check_resumable(resolve_config(overrides={"num-server-rounds": 2}), 2, ckpt)


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path) -> None:
    """Seeded DP-SGD run: 3 rounds straight vs. 2 rounds, stop, resume for round 3."""
    from conftest import ledger_rows, read_rounds, run_small_simulation

    # one fixed Opacus mode: "auto" picks the fastest by timing, in each actor until the cache has a pick, and two
    # modes agree only to the last float bit, which this bitwise comparison would see (a fresh-clone CI run did)
    base = {"strategy": "dpsgd-fedavg", "seed": 5, "seeded-noise": True, "max-samples": 450, "batch-size": 16, "dp-rounds": 3,
            "privacy-dist": "fixed", "epsilon": 2.0, "fraction-evaluate": 0.0, "grad-sample-mode": "hooks"}
    full = run_small_simulation({**base, "num-server-rounds": 3, "output-dir": str(tmp_path / "full"),
                                 "client-state-dir": str(tmp_path / "cs-full")}, num_supernodes=3)
    first = run_small_simulation({**base, "num-server-rounds": 2, "output-dir": str(tmp_path / "part"),
                                  "client-state-dir": str(tmp_path / "cs")}, num_supernodes=3)
    assert json.loads((first / "summary.json").read_text())["rounds_completed"] == 2
    resumed = run_small_simulation({**base, "num-server-rounds": 3, "output-dir": str(tmp_path / "resumed"),
                                    "client-state-dir": str(tmp_path / "cs"), "resume-from": str(first)},
                                   num_supernodes=3)
    a, b = load_checkpoint(full), load_checkpoint(resumed)
    assert a["state"]["round"] == b["state"]["round"] == 3
    for wa, wb in zip(a["state"]["weights"], b["state"]["weights"]):
        np.testing.assert_array_equal(wa, wb)
    assert a["state"]["ledger"] == b["state"]["ledger"]
    ra, rb = read_rounds(full), read_rounds(resumed)
    fields = ("status", "epsilon_spent", "steps", "noise_multiplier")
    assert ledger_rows(ra, *fields) == ledger_rows(rb, *fields)  # the same ε per client per round, the full ledger in the new folder
    assert [r["metrics"]["accuracy"] for r in ra] == [r["metrics"]["accuracy"] for r in rb]
    meta = json.loads((resumed / "config.json").read_text())
    assert meta["resumed_from"]["round"] == 2
    eps = {c["client_id"]: c["epsilon_spent"] for c in rb[-1]["clients"]}
    assert all(0 < e <= 2.0 * (1 + 1e-9) for e in eps.values())  # budget planned for 3 rounds, spent exactly
