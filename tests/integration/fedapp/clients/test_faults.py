"""Fault injection, the lost-accountant guard and a 20 %-failing federation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import read_rounds, run_small_simulation
from flwr.client import Client
from flwr.common import Code, Context, FitIns, FitRes, RecordDict, Status, ndarrays_to_parameters

from fedapp.clients.guard import TAINT_KEY, InjectedFault, failing_clients, guard_client
from fedapp.config import ConfigError, check_fault_config, resolve_config
from strategies.base import LEDGER_CONFIG_KEY
from strategies.privacy.accountants import epsilon_of


def test_failing_clients_exact_fraction_deterministic_and_varying() -> None:
    sets = [failing_clients(7, r, 10, 0.2) for r in range(1, 6)]
    assert all(len(s) == 2 and s <= set(range(10)) for s in sets)
    assert sets == [failing_clients(7, r, 10, 0.2) for r in range(1, 6)]
    assert len({frozenset(s) for s in sets}) > 1  # not the same clients every round
    assert failing_clients(7, 1, 10, 0.0) == set()
    with pytest.raises(ValueError, match="fault fraction"):
        failing_clients(7, 1, 10, 1.0)


class FakeClient(Client):
    """Reports cumulative ε = eps_per_round × rounds trained, kept in Context.state (like DP-SGD)."""

    def __init__(self, context: Context, eps_per_round: float = 0.25) -> None:
        self.context = context
        self.eps = eps_per_round
        self.calls = 0

    def fit(self, ins: FitIns) -> FitRes:
        from flwr.common import ConfigRecord

        self.calls += 1
        done = int(self.context.state["acct"]["rounds"]) if "acct" in self.context.state else 0
        self.context.state["acct"] = ConfigRecord({"rounds": done + 1})
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.ones(2, np.float32)]), 5,
                      {"client_id": 2, "status": "ok", "epsilon_spent": self.eps * (done + 1)})


def _ctx(**node) -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 2, "num-partitions": 5, **node},
                   state=RecordDict(), run_config={})


def _ins(rnd: int, ledger: dict[int, float] | None = None, lineage: str = "") -> FitIns:
    config = {"server-round": rnd}
    if ledger:
        config[LEDGER_CONFIG_KEY] = json.dumps({str(k): v for k, v in ledger.items()})
    if lineage:
        config["run-lineage"] = lineage
    return FitIns(ndarrays_to_parameters([np.zeros(2, np.float32)]), config)


def test_raise_fault_happens_before_training_and_names_the_client() -> None:
    cfg = resolve_config(overrides={"fault-fraction": 0.2, "seed": 3})
    rnd = next(r for r in range(1, 50) if 2 in failing_clients(3, r, 5, 0.2))
    ctx = _ctx()
    inner = FakeClient(ctx)
    client = guard_client(inner, ctx, cfg.general, cfg.data, cfg.training, cfg.deployment)
    with pytest.raises(InjectedFault, match=f"client_id=2 round={rnd}"):
        client.fit(_ins(rnd))
    assert inner.calls == 0 and "acct" not in ctx.state  # no training, no ε spent


def test_timeout_fault_sleeps_then_trains(monkeypatch) -> None:
    cfg = resolve_config(overrides={"fault-fraction": 0.2, "fault-mode": "timeout", "round-timeout": 5.0,
                                    "fault-delay": 9.0, "seed": 3})
    rnd = next(r for r in range(1, 50) if 2 in failing_clients(3, r, 5, 0.2))
    slept: list[float] = []
    monkeypatch.setattr("fedapp.clients.guard.time.sleep", slept.append)
    ctx = _ctx()
    res = guard_client(FakeClient(ctx), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment).fit(_ins(rnd))
    assert slept == [9.0] and res.metrics["status"] == "ok" and res.metrics["epsilon_spent"] == 0.25


def test_client_that_lost_its_accountant_refuses_and_stays_refused() -> None:
    cfg = resolve_config()
    ctx = _ctx()  # fresh Context.state: the accountant of 3 earlier rounds (ε = 0.75) is gone
    client = guard_client(FakeClient(ctx), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment)
    res = client.fit(_ins(4, ledger={2: 0.75}))
    assert res.metrics["status"] == "refused" and "privacy state lost" in res.metrics["reason"]
    assert res.parameters.tensors == [] and res.num_examples == 0  # the update is withheld
    assert res.metrics["epsilon_spent"] == 0.75  # reports the ledger's value, never the restarted one
    assert TAINT_KEY in ctx.state
    for rnd in (5, 6, 7):  # a restarted accountant would catch up with the ledger; the taint prevents it
        later = client.fit(_ins(rnd, ledger={2: 0.75}))
        assert later.metrics["status"] == "refused"


def test_intact_accountant_passes_the_guard() -> None:
    ctx = _ctx()
    cfg = resolve_config()
    client = guard_client(FakeClient(ctx), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment)
    eps = [client.fit(_ins(r, ledger={2: 0.25 * (r - 1)} if r > 1 else None)).metrics for r in (1, 2, 3)]
    assert [m["status"] for m in eps] == ["ok"] * 3 and eps[-1]["epsilon_spent"] == 0.75


def test_client_state_dir_restores_the_accountant(tmp_path) -> None:
    cfg = resolve_config(overrides={"client-state-dir": str(tmp_path)})
    ctx = _ctx()
    client = guard_client(FakeClient(ctx), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment)
    for r in (1, 2):
        client.fit(_ins(r, ledger={2: 0.25 * (r - 1)} if r > 1 else None, lineage="runA"))
    fresh = _ctx()  # a restarted process / resumed run: empty Context.state, same lineage
    res = guard_client(FakeClient(fresh), fresh, cfg.general, cfg.data, cfg.training, cfg.deployment).fit(
        _ins(3, ledger={2: 0.5}, lineage="runA"))
    assert res.metrics["status"] == "ok" and res.metrics["epsilon_spent"] == 0.75
    other = _ctx()  # another run (lineage) never inherits this state
    res = guard_client(FakeClient(other), other, cfg.general, cfg.data, cfg.training, cfg.deployment).fit(
        _ins(1, lineage="runB"))
    assert res.metrics["epsilon_spent"] == 0.25


def test_fault_config_cross_checks() -> None:
    with pytest.raises(ConfigError, match="'round-timeout' > 0"):
        check_fault_config(resolve_config(overrides={"fault-fraction": 0.2, "fault-mode": "timeout"}).deployment)
    with pytest.raises(ConfigError, match="'fault-delay' = 3.0 must exceed 'round-timeout' = 5.0"):
        check_fault_config(resolve_config(overrides={"fault-fraction": 0.2, "fault-mode": "timeout",
                                                     "round-timeout": 5.0, "fault-delay": 3.0}).deployment)
    with pytest.raises(ConfigError, match="'fault-fraction' = 1.0"):
        resolve_config(overrides={"fault-fraction": 1.0})


@pytest.mark.slow
def test_twenty_percent_failing_run_completes_with_exact_accounting(tmp_path) -> None:
    n, rounds, seed = 5, 2, 11
    ov = {"strategy": "dpsgd-fedavg", "num-server-rounds": rounds, "dp-rounds": 3, "seed": seed,
          "fault-fraction": 0.2, "max-samples": 500, "batch-size": 16, "privacy-dist": "fixed", "epsilon": 2.0,
          "fraction-evaluate": 0.0, "output-dir": str(tmp_path), "min-fit-clients": 3}
    run_dir = run_small_simulation(ov, num_supernodes=n)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_completed"] == rounds
    journal = tmp_path / ".client-state" / run_dir.name  # the ended run's journal: committed, no update left
    assert len(list(journal.glob("client-*/committed.npz"))) == n and not list(journal.glob("client-*/pending-*"))
    per_round_steps: dict[int, int] = {}
    for rec in read_rounds(run_dir):
        expected_failed = failing_clients(seed, rec["round"], n, 0.2)
        failed = [c for c in rec["clients"] if c["status"] == "failed"]
        assert {c["client_id"] for c in failed} == expected_failed, failed
        assert all("injected fault" in c["reason"] for c in failed)
        ok = [c for c in rec["clients"] if c["status"] == "ok"]
        assert {c["client_id"] for c in ok} == set(range(n)) - expected_failed
        assert rec["metrics"]["clients_failed"] == 1 and rec["metrics"]["clients_ok"] == n - 1
        for c in ok:  # ε = accountant(σ, q, steps of the rounds this client really trained) — exactly
            cid = c["client_id"]
            trained = sum(1 for r in range(1, rec["round"] + 1) if cid not in failing_clients(seed, r, n, 0.2))
            per_round_steps.setdefault(cid, c["steps"] // trained)
            assert c["steps"] == trained * per_round_steps[cid]
            eps = epsilon_of([(c["noise_multiplier"], c["sample_rate"], c["steps"])], c["delta"],
                             "dpa-pld-replace-one")  # record-neighbours = replace-one (the default)
            assert math.isclose(c["epsilon_spent"], eps, rel_tol=1e-9), (cid, c["epsilon_spent"], eps)
            assert c["epsilon_spent"] <= c["epsilon_budget"] * (1 + 1e-9)


@pytest.mark.parametrize("name", ["robust-hdp", "weiavg", "dpsgd-fedavg"])
def test_family_strategies_aggregate_the_returned_subset(name: str) -> None:
    """With one client failed, the rest is aggregated (Robust-HDP: RPCA on the 3 returned updates)."""
    from types import SimpleNamespace

    from flwr.common import Code, FitRes, Status

    from fedapp.apps.factories import build_strategy
    from fedapp.clients.common import make_model
    from fedapp.clients.training import get_weights
    from fedapp.data.datasets import load_dataset
    from strategies.base import StrategyContext

    cfg = resolve_config(overrides={"strategy": name})
    _, test = load_dataset("digits", "")
    weights = get_weights(make_model(cfg.model_spec, test))
    strat = build_strategy(cfg, StrategyContext(initial_weights=weights))
    strat.round_log.start(1)
    rng = np.random.default_rng(0)
    results = []
    for cid in (0, 1, 3):
        update = [rng.normal(0, 0.01 * (cid + 1), w.shape).astype(np.float32) for w in weights]
        # the DP-SGD mechanism that update declares (Robust-HDP checks its noise against it): one step at
        # η = lr, c = clip-norm, b̄ = ⌊N q⌋ = 1, so the per-coordinate std is η·c·z
        z = 0.01 * (cid + 1) / (float(cfg["lr"]) * float(cfg["clip-norm"]))
        metrics = {"client_id": cid, "status": "ok", "reported_epsilon": 1.0 + cid, "epsilon_spent": 0.5,
                   "epsilon_budget": 1.0 + cid, "noise_multiplier": z, "sample_rate": 0.02, "steps_round": 1,
                   "delta": 1e-5}
        results.append((SimpleNamespace(node_id=cid), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update),
                                                             50, metrics)))
    failure = ValueError("Message contains an Error (reason: InjectedFault:<injected fault: client_id=2 round=1>)")
    strat.aggregate_fit(1, results, [failure])
    recs = strat.round_log.clients()
    assert sorted((r["client_id"], r["status"]) for r in recs) == [(0, "ok"), (1, "ok"), (2, "failed"), (3, "ok")]
    assert strat.round_log.metrics()["clients_ok"] == 3 and strat.round_log.metrics()["clients_failed"] == 1
    assert math.isclose(sum(r["aggregation_weight"] for r in recs if r["status"] == "ok"), 1.0, rel_tol=1e-9)
    assert any(np.any(a != b) for a, b in zip(weights, strat.current_weights))


# ----------------------------------------------------------------------------- crash-consistent client journal
def _journal_ins(rnd: int, weights: float, committed: int | None) -> FitIns:
    config = {"server-round": rnd, "run-lineage": "runJ"}
    if committed is not None:
        config["committed-round"] = committed
    return FitIns(ndarrays_to_parameters([np.full(2, weights, np.float32)]), config)


def _journal_client(tmp_path, ctx: Context | None = None):
    from flwr.common import ConfigRecord

    ctx = ctx or _ctx()
    cfg = resolve_config(overrides={"client-state-dir": str(tmp_path)})
    inner = FakeClient(ctx)
    ctx.state["dp2-head"] = ctx.state["dp2-head"] if "dp2-head" in ctx.state else ConfigRecord({"r": 0})
    real_fit = inner.fit

    def fit(ins: FitIns) -> FitRes:  # training state moves with every round it trains
        ctx.state["dp2-head"] = ConfigRecord({"r": int(ins.config["server-round"])})
        return real_fit(ins)

    inner.fit = fit
    return guard_client(inner, ctx, cfg.general, cfg.data, cfg.training, cfg.deployment), inner, ctx


def test_journal_replays_released_rounds_and_keeps_the_spend_of_discarded_ones(tmp_path) -> None:
    """Rounds 1-3 trained, the server committed round 1 only (then crashed): a resume that asks round 2
    with the same model gets the very same reply (no new ε); one that asks with another model trains
    afresh from the committed training state, but its accountant keeps the released rounds' spend."""
    from fedapp.state.client_state import TRAINING_RECORDS

    client, inner, ctx = _journal_client(tmp_path)
    replies = [client.fit(_journal_ins(r, float(r), committed=r - 1 if r < 3 else 1)) for r in (1, 2, 3)]
    folder = tmp_path / "runJ" / "client-2"
    assert sorted(p.name for p in folder.iterdir()) == ["committed.npz", "pending-2.npz", "pending-3.npz"]

    same, inner2, fresh = _journal_client(tmp_path, Context(run_id=2, node_id=9, node_config=ctx.node_config,
                                                              state=RecordDict(), run_config={}))
    again = same.fit(_journal_ins(2, 2.0, committed=1))  # resumed from the round-1 checkpoint
    assert inner2.calls == 0 and again.metrics == replies[1].metrics
    assert again.parameters.tensors == replies[1].parameters.tensors
    assert fresh.state["acct"]["rounds"] == 2 and fresh.state["dp2-head"]["r"] == 2  # state of round 2
    third = same.fit(_journal_ins(3, 3.0, committed=2))
    assert inner2.calls == 0 and third.metrics["epsilon_spent"] == replies[2].metrics["epsilon_spent"]

    other, inner3, ctx3 = _journal_client(tmp_path / "x")
    for r in (1, 2, 3):
        other.fit(_journal_ins(r, float(r), committed=r - 1 if r < 3 else 1))
    diverged, inner4, ctx4 = _journal_client(tmp_path / "x", Context(run_id=3, node_id=9, node_config=ctx.node_config,
                                                                      state=RecordDict(), run_config={}))
    res = diverged.fit(_journal_ins(2, 7.0, committed=1))  # a different model: the old round 2 is void
    assert inner4.calls == 1 and res.metrics["status"] == "ok"
    assert res.metrics["epsilon_spent"] == 0.25 * 4  # rounds 1, 2, 3 released + this one: never rolled back
    assert ctx4.state["dp2-head"]["r"] == 2 and "dp2-head" in TRAINING_RECORDS  # training state: committed + 1
    names = sorted(p.name for p in (tmp_path / "x" / "runJ" / "client-2").iterdir())
    assert names == ["committed.npz", "pending-2.npz"]  # round 3's entry is void; its spend lives in round 2's


def test_ended_run_compaction_keeps_the_newest_spend_and_drops_the_released_updates(tmp_path) -> None:
    """A client that is never asked again keeps its released updates until the server, at the end of the run,
    commits its journal: the newest privacy records survive (a later run of the lineage restores them), the
    replies do not."""
    from fedapp.state.checkpoint import load_checkpoint
    from fedapp.state.client_state import ClientStateStore, compact_lineage

    client, _, _ = _journal_client(tmp_path)
    for r in (1, 2, 3):
        client.fit(_journal_ins(r, float(r), committed=r - 1 if r < 3 else 1))
    folder = tmp_path / "runJ" / "client-2"
    assert sorted(p.name for p in folder.iterdir()) == ["committed.npz", "pending-2.npz", "pending-3.npz"]
    assert load_checkpoint(folder / "pending-3.npz")["reply"] is not None
    (tmp_path / "runJ" / "client-x").mkdir()  # not a client folder: left alone
    assert compact_lineage(tmp_path, "runJ", 3) == 2 and compact_lineage(tmp_path, "runJ", 3) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["committed.npz"]
    doc = load_checkpoint(folder / "committed.npz")
    assert doc["round"] == 3 and "reply" not in doc
    assert compact_lineage(tmp_path, "no-such-run", 3) == 0
    state = RecordDict()  # a later process of this lineage restores the newest spend
    assert ClientStateStore(tmp_path, 2).restore(state, "runJ") and state["acct"]["rounds"] == 3


def test_training_records_name_the_families_state_keys() -> None:
    from fedapp.clients.dp2_fedsam import HEAD_KEY
    from fedapp.clients.soteriafl import ARRAYS_KEY
    from fedapp.state.client_state import _VOLATILE_KEYS, TRAINING_RECORDS

    assert TRAINING_RECORDS == {HEAD_KEY, ARRAYS_KEY} and LEDGER_CONFIG_KEY in _VOLATILE_KEYS


def test_default_state_dir_lives_under_the_output_dir(tmp_path) -> None:
    cfg = resolve_config(overrides={"output-dir": str(tmp_path / "out")})
    ctx = _ctx()
    client = guard_client(FakeClient(ctx), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment)
    client.fit(_ins(1, lineage="runD"))
    assert (tmp_path / "out" / ".client-state" / "runD" / "client-2" / "pending-1.npz").is_file()
    blocked = tmp_path / "file"
    blocked.write_text("")  # not a folder: the default journal is best effort, an explicit one is not
    ctx = _ctx()
    cfg = resolve_config(overrides={"output-dir": str(blocked / "o")})
    res = guard_client(FakeClient(ctx), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment).fit(
        _ins(1, lineage="runD"))
    assert res.metrics["status"] == "ok"


def test_ended_run_compaction_leaves_an_unreadable_entry_and_commits_the_rest(tmp_path) -> None:
    from fedapp.state.client_state import ClientStateStore, compact_lineage

    client, _, _ = _journal_client(tmp_path)
    for r in (1, 2):
        client.fit(_journal_ins(r, float(r), committed=r - 1))
    broken = tmp_path / "runJ" / "client-7"
    broken.mkdir()
    (broken / "pending-2.npz").write_bytes(b"not a checkpoint")
    assert compact_lineage(tmp_path, "runJ", 2) == 1  # client 2's entry; client 7's stays, the run is not failed
    assert (broken / "pending-2.npz").is_file() and not list((tmp_path / "runJ" / "client-2").glob("pending-*"))
    assert ClientStateStore(tmp_path, 2).restore(RecordDict(), "runJ")
