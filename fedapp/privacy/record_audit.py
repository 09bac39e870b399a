"""The record-level privacy audit of a simulated run: run-config ``audit-canaries = m`` for the DP-SGD (Robust-HDP
family, DPFedAvg) and SoteriaFL families; Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run",
NeurIPS 2023 (``strategies/privacy/audit.py`` has the bound).

Canary slot j (0 … m−1) belongs to client j mod n and has two candidate records a_j and b_j: inputs of the run's
shape with i.i.d. N(0, 1) coordinates (far from the data: a standardized image or a binary a9a row is not a Gaussian
vector) and uniformly random labels, drawn from the stream ``audit-seed``. An independent fair coin (the same stream)
puts exactly one of the two into the client's training data. The slot's inclusion is therefore a *replacement* of one
record by another, which is the neighbouring relation the clients' accountants use (``record-neighbours =
'replace-one'``): every client's N_i is the same whichever candidate it holds, so the coins change nothing outside the
mechanism's input, and the run is (ε_i, δ_i)-DP in each coin of client i's slots.

After the run the auditor (the server, which knows the candidates but not the coins) scores slot j by how much more
the run lowered the loss of a_j than of b_j from the initial to the final model, guesses the coin for the most
confident slots and turns the number of right guesses into an ε lower bound at 95 % confidence for whoever sees the
final model. Against an honest mechanism it stays below every accountant ε of the clients holding canaries (it is a
valid bound); above it, the mechanism gives more away than its accountant says.

Canaries are records of the audited run: they count in N_i, in the sampling rate and in the calibration of the noise
of their client, and in its utility like any record of its training split (never in its test split).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fedapp.data.canaries import coins, slot_count
from strategies.privacy.audit import audit_scores, one_shot_estimate


def slot_scores(initial_losses: np.ndarray, final_losses: np.ndarray) -> np.ndarray:
    """Score of each slot (higher: a_j more likely held): the drop of a_j's loss minus the drop of b_j's."""
    drop = np.asarray(initial_losses, dtype=np.float64) - np.asarray(final_losses, dtype=np.float64)
    return drop[0::2] - drop[1::2]


def accountant_epsilon(rounds: list[dict[str, Any]], num_clients: int, slots: int) -> tuple[float | None, float]:
    """(the largest ε any canary-holding client spent, the largest δ of those clients) from the round records: the
    run is (that ε, that δ)-DP in every coin, so a valid lower bound never exceeds it."""
    holders = {c for c in range(num_clients) if slot_count(c, num_clients, slots)}
    eps: float | None = None
    delta = 0.0
    for record in rounds:
        for client in record.get("clients", []):
            if client.get("client_id") not in holders:
                continue
            spent, d = client.get("epsilon_spent"), client.get("delta")
            if isinstance(spent, (int, float)) and math.isfinite(spent):
                eps = max(eps or 0.0, float(spent))
            if isinstance(d, (int, float)):
                delta = max(delta, float(d))
    return eps, delta


def record_audit_block(seed: int, slots: int, losses: Callable[[np.ndarray], np.ndarray],
                       initial: np.ndarray, final: np.ndarray, rounds: list[dict[str, Any]],
                       num_clients: int, statistics: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``audit`` block of summary.json; ``losses(weights)`` is each candidate's loss under a model given as one flat
    vector (the rows of :func:`fedapp.data.canaries.candidates`). The scores and coins go into ``statistics`` when
    given (``audit_statistics.json``)."""
    eps, delta = accountant_epsilon(rounds, num_clients, slots)
    delta = delta or 1e-5
    before, after = losses(initial), losses(final)
    scores = slot_scores(before, after)
    truth = coins(seed, slots)
    drop = (before - after).reshape(-1, 2)  # columns: a_j, b_j
    held, other = drop[np.arange(slots), np.where(truth, 0, 1)], drop[np.arange(slots), np.where(truth, 1, 0)]
    if statistics is not None:
        statistics.update({"delta": delta, "scores": scores.tolist(), "coins": truth.tolist(),
                           "held_loss_drop": held.tolist(), "other_loss_drop": other.tolist()})
    bound = audit_scores(scores, truth, delta)
    estimate = one_shot_estimate(held, other, delta)
    return {
        "method": "one-run lower bound (Steinke, Nasr, Jagielski, NeurIPS 2023): canary slots of two random records, "
                  "a fair coin puts one in a client's data; score = drop of a's loss minus drop of b's from the "
                  "initial to the final model; guesses for the most confident slots, 95 % confidence",
        "level": "record", "canaries": int(slots), "delta": delta, "rounds": len(rounds),
        "adversary": "whoever sees the final model (the server sees more: each client's updates)",
        "epsilon_accountant": eps,
        "final_model": {**bound, "epsilon_lower_bound": float(bound["epsilon_lower_bound"]), **estimate.as_dict(),
                        "estimate_statistic": "loss drop of the held candidates vs the other ones, fitted as in "
                                              "the one-shot estimate (Andrew et al. 2024): an estimate, not a bound"},
    }
