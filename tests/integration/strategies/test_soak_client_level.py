"""Soak: every client-level strategy trains every planned round under SecAgg+ in the default configuration.

Secure aggregation is on by default for these strategies; a client whose local training diverges restarts the
round from the global model (zero update plus its noise), a non-finite vector is never quantized, and a sum
that fails validation strikes nobody — so no honest client is excluded and no planned round goes untrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import read_rounds, run_small_simulation

CLIENT_LEVEL = ("dp-fedavg", "fed-smp-randk", "fed-smp-topk", "dp2-fedsam", "centaur", "dp-fedsam", "dp-fedavg-ft",
                "dp-fedsam-ft")
ROUNDS = 15
#: the one key a strategy cannot run without (top-k masks come from the server's public set D_p)
REQUIRED = {"fed-smp-topk": {"public-samples": 100}}


@pytest.mark.parametrize("strategy", CLIENT_LEVEL)
def test_every_planned_round_trains_under_secagg(strategy: str, tmp_path: Path) -> None:
    run = run_small_simulation({"strategy": strategy, "num-server-rounds": ROUNDS, "partitioner": "pathological",
                                "output-dir": str(tmp_path), **REQUIRED.get(strategy, {})}, num_supernodes=6)
    rounds = read_rounds(run)
    assert len(rounds) == ROUNDS
    assert all(r["metrics"].get("secure_aggregation") for r in rounds)
    untrained = [(r["round"], [c.get("reason") for c in r["clients"] if c["status"] != "ok"][:2])
                 for r in rounds if (r["metrics"].get("clients_ok") or 0) == 0]
    assert not untrained, untrained
    excluded = [c for r in rounds for c in r["clients"] if c.get("excluded")]
    assert not excluded, excluded
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_trained"] == ROUNDS and summary["rounds_untrained"] == []
