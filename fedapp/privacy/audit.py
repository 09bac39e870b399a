"""The client-level privacy audit of a simulated run: run-config ``audit-canaries = k`` for the client-level families
(``strategies/privacy/audit.py`` has the estimators; :mod:`fedapp.privacy.record_audit` audits the record-level ones).

Clients ``n − k`` … ``n − 1`` of the federation are canaries. Canary j holds a fixed random unit direction u_j and a
fair coin (both from the stream ``audit-seed``, which only the auditor knows); in every round it is sampled it sends,
instead of training, C·u_j when its coin is heads and the zero update when it is tails, through the run's mechanism
exactly as a client sends its update (the same sampling, clipping, noise share, sparsification and SecAgg+); it
evaluates nothing. A tails canary adds its noise share and nothing else, so each coin is the add/remove of one
client's contribution, the neighbouring relation of the accountant's ε.

:class:`AuditRecorder` wraps the run's recorder: it marks the canaries in the round records (so that the summary's
ε per client and utility leave them out), keeps the global model after every round, and, when the run ends, adds the
``audit`` block to summary.json, for an observer of the final model and for one of every round's model (statistic:
the cosine of u_j with the model's change, or its largest over the rounds' changes), next to the accountant's ε for
that observer (the release's):

* Andrew et al.'s one-shot ε estimate with its bootstrap interval: heads canaries against the tails ones and
  ``NULL_DIRECTIONS`` never-drawn directions. It holds under the paper's Gaussian fit; it is not a bound.
* Steinke et al.'s one-run lower bound at 95 % from guessing the coins of the most confident canaries: valid, and far
  from tight with k of a few hundred (all of 20 guesses right bounds ε by about 1.4).

Canaries take part as clients of the same federation (n counts them: the audited run is the run with n clients, k of
them canaries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.state.results import write_json_atomic
from strategies.aggregate import flatten
from strategies.privacy.audit import audit_scores, canary_directions, cosines, one_shot_estimate

#: the raw canary statistics of an audited run, next to its summary.json
STATISTICS_FILE = "audit_statistics.json"
#: never-inserted directions drawn for the null distribution of the statistics
NULL_DIRECTIONS = 500
_CHUNK = 100  # directions drawn at a time (memory: _CHUNK × d floats)


def canary_index(client_id: int, num_clients: int, canaries: int) -> int | None:
    """Which canary client ``client_id`` is (0 … k−1), or None for a client that trains."""
    first = num_clients - canaries
    return client_id - first if canaries > 0 and client_id >= first else None


def canary_direction(seed: int, index: int, dim: int) -> np.ndarray:
    """Canary ``index``'s unit direction in R^dim (the same for the canary client and the auditor)."""
    return canary_directions(seed, 1, dim, first=index)[0]


def _statistics(seed: int, first: int, count: int, final: np.ndarray, steps: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """(cos with the final change, max over rounds of cos with the round's change) of directions first … first+count−1."""
    out_final, out_iter = [], []
    for start in range(first, first + count, _CHUNK):
        u = canary_directions(seed, min(_CHUNK, first + count - start), final.size, first=start)
        out_final.append(cosines(u, final))
        out_iter.append(np.max(np.stack([cosines(u, s) for s in steps]), axis=0) if steps else np.zeros(len(u)))
    return np.concatenate(out_final), np.concatenate(out_iter)


def canary_coins(seed: int, canaries: int) -> np.ndarray:
    """The canaries' fair coins (True: canary j sends C·u_j; False: the zero update), the auditor's secret."""
    return np.random.default_rng([int(seed), 921]).random(int(canaries)) < 0.5


def canary_update(seed: int, canaries: int, index: int, dim: int) -> np.ndarray:
    """What canary ``index`` sends, over C: u_index on heads, the zero vector on tails."""
    if canary_coins(seed, canaries)[index]:
        return canary_direction(seed, index, dim)
    return np.zeros(dim)


def audit_block(seed: int, canaries: int, initial: np.ndarray, models: list[np.ndarray], delta: float,
                accountant: dict[str, Any], statistics: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The ``audit`` block of summary.json from the global model before round 1 and after each round; the raw
    statistics go into ``statistics`` when given (``audit_statistics.json``: recompute at another confidence)."""
    final = models[-1] - initial
    steps = [b - a for a, b in zip([initial, *models[:-1]], models)]
    heads = canary_coins(seed, canaries)
    can_final, can_iter = _statistics(seed, 0, canaries, final, steps)
    null_final, null_iter = _statistics(seed, canaries, NULL_DIRECTIONS, final, steps)
    block: dict[str, Any] = {
        "method": "canary clients sending C·u_j or nothing by a secret coin; statistic: cosine of u_j with the "
                  "model's change. One-shot estimate (Andrew et al., ICLR 2024): heads vs tails and never-drawn "
                  "directions, Gaussians of one variance, ε at δ of telling them apart, 95 % bootstrap interval. "
                  "One-run lower bound (Steinke et al., NeurIPS 2023): coins guessed for the most confident canaries, "
                  "95 % confidence",
        "canaries": canaries, "canaries_heads": int(heads.sum()), "null_directions": NULL_DIRECTIONS, "delta": delta,
        "rounds": len(models),
        "adversary": "whoever sees the released models (final: the last one; all_iterates: every round's)",
        **accountant,
    }
    if statistics is not None:
        statistics["coins"] = heads.tolist()
    for name, can, fresh in (("final_model", can_final, null_final), ("all_iterates", can_iter, null_iter)):
        ins, null = can[heads], np.concatenate([can[~heads], fresh])
        if statistics is not None:
            statistics[f"{name}_canaries"] = can.tolist()
            statistics[f"{name}_inserted"], statistics[f"{name}_null"] = ins.tolist(), null.tolist()
        bound = audit_scores(can, heads, delta)
        block[name] = {**_estimate(ins, null, delta), "epsilon_lower_bound": float(bound["epsilon_lower_bound"]),
                       "guesses": bound["guesses"], "correct": bound["correct"], "confidence": bound["confidence"]}
    return block


def _estimate(inserted: np.ndarray, null: np.ndarray, delta: float) -> dict[str, Any]:
    """The one-shot estimate's entries; without 2 heads canaries (the coins of a few canaries can all be tails) there
    is no estimate, only the reason, and the run still ends with its bound."""
    if len(inserted) < 2:
        return {"epsilon_estimate": None, "epsilon_interval": None, "canaries_inserted": len(inserted),
                "canaries_null": len(null), "estimate_error": f"{len(inserted)} heads canaries: the estimate needs "
                                                              "at least 2 (more audit-canaries, or another audit-seed)"}
    return {**one_shot_estimate(inserted, null, delta).as_dict(), "mean_cosine_inserted": float(np.mean(inserted)),
            "mean_cosine_null": float(np.mean(null))}


#: what an audit computes when the run ends: (global model before round 1, after each round, the round records, a
#: dict for the raw statistics) -> the ``audit`` block of summary.json
AuditFn = Callable[[np.ndarray, list[np.ndarray], list[dict[str, Any]], dict[str, Any]], dict[str, Any]]


def client_audit(seed: int, canaries: int) -> AuditFn:
    """The client-level audit: :func:`audit_block` of canary clients, beside the release's accountant ε."""

    def audit(initial: np.ndarray, models: list[np.ndarray], rounds: list[dict[str, Any]],
              statistics: dict[str, Any]) -> dict[str, Any]:
        metrics = rounds[-1].get("metrics", {})
        delta = float(metrics.get("delta") or 0.0) or 1e-5
        accountant = {"epsilon_accountant": _number(metrics.get("epsilon_vs_release", metrics.get("epsilon"))),
                      "epsilon_accountant_vs_server": _number(metrics.get("max_epsilon_vs_server",
                                                                          metrics.get("epsilon")))}
        statistics["delta"] = delta
        return {"level": "client", **audit_block(seed, canaries, initial, models, delta, accountant, statistics)}

    return audit


class AuditRecorder:
    """A round recorder around ``inner`` that keeps the global model after every round (the latest only when
    ``every_round`` is False; ``strategy`` is read for it) and adds ``audit``'s block to summary.json when the run
    ends; a client ``canary_client(client_id, n)`` names is marked ``audit_canary`` in the round records (so that the
    summary's ε per client and utility leave it out)."""

    def __init__(self, inner: Any, strategy: Any, audit: AuditFn, num_clients: int,
                 canary_client: Callable[[int, int], bool] | None = None, every_round: bool = True) -> None:
        self.inner, self.strategy, self.audit = inner, strategy, audit
        self.num_clients, self.canary_client = int(num_clients), canary_client
        self.every_round = every_round  # False: keep only the latest model (an audit of the final model alone)
        self.initial = flatten(strategy.current_weights).astype(np.float64)
        self.models: list[np.ndarray] = []
        self.rounds: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:  # the writer's own attributes (run_dir, meta, …)
        return getattr(self.inner, name)

    def _n(self) -> int:
        return self.num_clients or int(getattr(self.strategy, "num_available", 0))

    def open(self) -> None:
        self.inner.open()

    def write_round(self, record: dict[str, Any]) -> None:
        if self.canary_client is not None:
            n = self._n()
            for client in record.get("clients", []):
                cid = client.get("client_id")
                if isinstance(cid, int) and self.canary_client(cid, n):
                    client["audit_canary"] = True
        model = flatten(self.strategy.current_weights).astype(np.float64)
        if self.every_round:
            self.models.append(model)
        else:
            self.models = [model]
        self.rounds.append(record)
        self.inner.write_round(record)

    def finish(self, amend: dict[str, Any] | None = None) -> None:
        block: dict[str, Any] = {"error": "no round was recorded"}
        if self.models:
            statistics: dict[str, Any] = {}
            block = self.audit(self.initial, self.models, self.rounds, statistics)
            run_dir = getattr(self.inner, "run_dir", None)
            if run_dir is not None:
                write_json_atomic(Path(run_dir) / STATISTICS_FILE, statistics)
        self.inner.finish(amend={**(amend or {}), "audit": block})


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(float(value)) else None
