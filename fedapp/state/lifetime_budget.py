"""A client's privacy budget across runs: ε spent per run lineage, kept on the client's own disk.

Within a run the client's accountant composes exactly. Across runs — other lineages, possibly other
mechanisms — this store uses basic composition: the ε and δ of the runs add up (Dwork et al. 2006), a valid
(if loose) bound for any sequence of (ε_l, δ_l)-DP releases about the same data. The client is the party
that protects its data, so the store lives with it: ``<state-dir>/lifetime/client-<id>.json``, keyed by the
client's identity (its partition id on its node), written atomically.

On for SuperNodes given a node-config ``state-dir`` (deployment) and wherever ``lifetime-budget = true``;
the lifetime budget is node-config ``lifetime-epsilon``, else the client's per-run budget.

δ is checked too: Σ δ of the earlier runs plus this run's δ may not exceed the lifetime δ budget, node-config
``lifetime-delta``, else — for record-level clients (DP-SGD, SoteriaFL) — 1/(10·N_i), the bound a single run's
δ_i must meet. That default is the per-run bound on purpose: under basic composition the δ of all runs is the
probability that the combined releases about a record escape the ε bound, and 1/(10·N_i) is the largest such
probability the project accepts for a record at all (a δ near 1/N_i permits publishing one record outright);
it holds whether the client runs once at δ = 1/(10·N_i) or ten times at a tenth of it. Run-config
``allow-large-delta = true`` waives that default as it waives the per-run bound; a node-config ``lifetime-delta``
always applies. Client-level replies have no default lifetime δ (only node-config ``lifetime-delta``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from strategies.privacy.budget import exceeds_budget


@dataclass
class LifetimeBudget:
    """ε and δ this client spent in each run (lineage), and the check against its lifetime budget."""

    path: Path

    @classmethod
    def for_client(cls, state_dir: str | os.PathLike, client_id: int) -> LifetimeBudget:
        return cls(Path(state_dir) / "lifetime" / f"client-{int(client_id)}.json")

    def runs(self) -> dict[str, dict[str, float]]:
        if not self.path.is_file():
            return {}
        return {k: {"epsilon": float(v["epsilon"]), "delta": float(v["delta"])}
                for k, v in json.loads(self.path.read_text(encoding="utf-8")).items()}

    def spent_elsewhere(self, lineage: str) -> tuple[float, float]:
        """(Σ ε, Σ δ) of every other run."""
        others = [v for k, v in self.runs().items() if k != lineage]
        return sum(v["epsilon"] for v in others), sum(v["delta"] for v in others)

    def refusal(self, lineage: str, epsilon: float, budget: float, delta: float | None = None,
                delta_budget: float | None = None, delta_source: str = "") -> str | None:
        """Why this run may not spend ``epsilon`` (its cumulative ε after the round) under ``budget``, or its
        ``delta`` under ``delta_budget`` (Σ δ of the other runs plus ``delta``; unchecked when either is None).
        ``delta_source`` says where the δ budget comes from (in the reason)."""
        eps_before, delta_before = self.spent_elsewhere(lineage)
        if exceeds_budget(eps_before + epsilon, budget):
            return (f"lifetime budget: earlier runs spent epsilon={eps_before:.4f} (delta={delta_before:.3g}); this "
                    f"round would bring the total to {eps_before + epsilon:.4f} > lifetime budget {budget:.4f}")
        if delta is not None and delta_budget is not None and exceeds_budget(delta_before + delta, delta_budget):
            return (f"lifetime delta budget: earlier runs spent delta={delta_before:.3g}; this run's delta={delta:.3g} "
                    f"would bring the total to {delta_before + delta:.3g} > lifetime delta budget {delta_budget:.3g}"
                    + (f" ({delta_source})" if delta_source else ""))
        return None

    def record(self, lineage: str, epsilon: float, delta: float) -> None:
        runs = self.runs()
        runs[lineage] = {"epsilon": max(float(epsilon), runs.get(lineage, {}).get("epsilon", 0.0)), "delta": float(delta)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(runs, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
