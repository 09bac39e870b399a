"""Paired claim verdicts of fedapp.experiments.report: t interval of per-seed differences, sign-flip p-value, power line."""

from __future__ import annotations

import math
from typing import Any

import pytest

from fedapp.experiments import report
from fedapp.experiments.report import (
    claim_rows,
    interval,
    pair_by_seed,
    paired_verdict,
    seeds_to_resolve,
    sign_flip_p,
    tuned_groups,
)

T_975_4 = 2.776445105  # t_{0.975} with 4 degrees of freedom (tables)


def test_t_interval_of_the_differences_by_hand():
    p = paired_verdict([1, 2, 3, 4, 5])
    # mean 3, s = sqrt(10 / 4), half-width t_{0.975, 4} * s / sqrt(5)
    assert p.n == 5 and p.mean == pytest.approx(3.0)
    assert p.half == pytest.approx(T_975_4 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert p.verdict == "holds"
    assert paired_verdict([-1, -2, -3, -4, -5]).verdict == "does not hold"
    assert paired_verdict([-1, -2, -3, -4, -5], lower_is_better=True).verdict == "holds"  # a loss went down


def test_sign_flip_p_exact_by_hand():
    # only the observed pattern and its mirror reach |mean| >= 3 among the 2^5 sign patterns
    assert sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    assert sign_flip_p([1, 1, 1]) == pytest.approx(2 / 8)  # three pairs can never give p < 0.25
    assert sign_flip_p([3, 1]) == pytest.approx(2 / 4)  # sums 4, 2, -2, -4: two reach |4|
    assert sign_flip_p([1, -1]) == 1.0 and sign_flip_p([0, 0, 0]) == 1.0
    assert math.isnan(sign_flip_p([]))


def test_sign_flip_p_monte_carlo_is_seeded_and_close_to_exact(monkeypatch: pytest.MonkeyPatch):
    diffs = [0.5, -0.2, 0.9, 0.1, -0.4, 0.7, 0.3, 0.8, -0.1, 0.6, 0.2, -0.3, 0.4, 0.05, 0.35, -0.15, 0.25]  # n = 17
    mc = sign_flip_p(diffs)
    assert mc == sign_flip_p(diffs)  # fixed seed: the report is reproducible
    monkeypatch.setattr(report, "EXACT_UP_TO", 17)
    exact = sign_flip_p(diffs)
    assert exact * 2**17 == pytest.approx(round(exact * 2**17))  # a count of patterns
    assert mc == pytest.approx(exact, abs=0.005)
    monkeypatch.undo()
    assert sign_flip_p([1.0] * 20) <= 3 / (1 + report.MONTE_CARLO_DRAWS)  # exact would be 2 / 2^20


def test_seeds_to_resolve():
    from scipy import stats

    def half(n: int, sd: float) -> float:
        return float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)

    # mean 1, sd 2: 17 seeds give a half-width of 1.028, 18 seeds 0.995 < 1
    assert half(17, 2.0) > 1 > half(18, 2.0) and seeds_to_resolve(1.0, 2.0) == 18
    assert seeds_to_resolve(-1.0, 2.0) == 18  # either side
    assert seeds_to_resolve(0.5, 0.0) == 2  # no spread: two seeds suffice
    assert seeds_to_resolve(0.0, 1.0) is None  # a zero mean is never resolved
    assert seeds_to_resolve(1.0, math.nan) is None  # one pair: no spread to plan with
    assert seeds_to_resolve(3.0, math.sqrt(2.5)) <= 5  # the resolved [1..5] case needs no more than it has
    n = seeds_to_resolve(0.001, 1.0)
    assert half(n, 1.0) < 0.001 <= half(n - 1, 1.0)  # large n found by doubling and bisection


# ----------------------------------------------------------------------------- claims on a sweep's cells
BASE = [0.30, 0.55, 0.80, 0.45, 0.70]  # per-seed accuracy: a large between-seed spread that pairing cancels


def _cell(strategy: str, seed: int, acc: float, lr: float = 0.1, val: float | None = None) -> dict[str, Any]:
    return {"assignments": {"strategy": strategy, "lr": lr, "seed": seed}, "status": "finished",
            "summary": {"final_accuracy": acc, "final_loss": 1.0 - acc, "final_client_val_accuracy": val}}


def _doc(cells: list[dict[str, Any]], tune: list[str] | None = None, **claim: Any) -> dict[str, Any]:
    claim = {"text": "a beats b", "metric": "final_accuracy", "better": {"strategy": "a"},
             "worse": {"strategy": "b"}, **claim}
    return {"tune": tune or [], "claims": [claim], "cells": {str(i): c for i, c in enumerate(cells)}}


def _row(doc: dict[str, Any]) -> list[str]:
    (row,) = claim_rows(doc, tuned_groups(doc)[0])
    return [col.strip() for col in row.strip("|").split("|")]


def test_claim_holds_paired_where_the_unpaired_intervals_overlap():
    gains = [0.020, 0.025, 0.018, 0.022, 0.030]  # small, consistent
    cells = [_cell("a", s, b + g) for s, (b, g) in enumerate(zip(BASE, gains), 1)]
    cells += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    (mb, hb, _), (mw, hw, _) = (interval([c["summary"]["final_accuracy"] for c in cells if c["assignments"]["strategy"] == k])
                                for k in ("a", "b"))
    assert mb - hb <= mw + hw  # the independent intervals overlap: the old rule said "inconclusive"
    claim, _, _, better, worse, paired, p, verdict, needed = _row(_doc(cells))
    assert verdict == "**holds**"
    assert paired.startswith("+2.3 ± ") and paired.endswith("(n=5)")  # percentage points
    assert better.endswith("(n=5)") and worse.endswith("(n=5)")  # the per-method intervals are kept
    assert float(p) == pytest.approx(2 / 32)
    # mean 0.023, s = sqrt(88e-6 / 4) = 0.00469: two seeds give 12.706 * s / sqrt(2) = 0.042 > 0.023,
    # three give 4.303 * s / sqrt(3) = 0.0117 < 0.023
    assert needed == "3 (have 5)"


def test_claim_does_not_hold_and_lower_is_better():
    cells = [_cell("a", s, b - 0.03 + 0.002 * s) for s, b in enumerate(BASE, 1)]
    cells += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    assert _row(_doc(cells))[7] == "**does not hold**"
    # on the loss (1 - accuracy) a's higher loss is the worse side of a lower-is-better claim as well
    assert _row(_doc(cells, metric="final_loss", **{"lower-is-better": True}))[7] == "**does not hold**"
    flipped = _doc(cells, metric="final_loss", better={"strategy": "b"}, worse={"strategy": "a"},
                   **{"lower-is-better": True})
    assert _row(flipped)[7] == "**holds**"


def test_claim_inconclusive_with_its_power_line():
    diffs = [0.02, -0.01, 0.01, -0.02, 0.03]  # mean 0.006, s = 0.020736
    cells = [_cell("a", s, b + d) for s, (b, d) in enumerate(zip(BASE, diffs), 1)]
    cells += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    row = _row(_doc(cells))
    assert row[7] == "**inconclusive (interval contains 0)**"
    mean = sum(diffs) / 5
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)
    assert sd == pytest.approx(math.sqrt(17.2e-4 / 4))
    assert row[8] == f"{seeds_to_resolve(mean, sd)} (have 5)"
    needed = seeds_to_resolve(mean, sd)
    assert 40 < needed < 60  # (1.96 * s / mean)^2 = 46, a little more for t
    even = [_cell("a", s, b + d) for s, (b, d) in enumerate(zip(BASE, [0.01, -0.01, 0.02, -0.02, 0.0]), 1)]
    even += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    assert _row(_doc(even))[8] == "never (mean difference 0)"


def test_fewer_than_two_pairs_give_no_verdict():
    cells = [_cell("a", 1, 0.5), _cell("a", 2, 0.6), _cell("b", 2, 0.4), _cell("b", 3, 0.3)]
    assert pair_by_seed(cells[:2], cells[2:], "final_accuracy") == [(2, pytest.approx(0.2))]
    row = _row(_doc(cells))
    assert row[5] == "+20.0 (n=1)" and row[7] == "**fewer than 2 pairs: no verdict**" and row[8] == "– (no spread)"
    row = _row(_doc([_cell("a", 1, 0.5), _cell("b", 2, 0.4)]))
    assert row[5] == "–" and row[7] == "**no paired seeds**"


def test_each_method_is_compared_at_its_tuned_setting():
    # lr 0.1 wins a's validation; at lr 1.0 a would lose the claim on test, at lr 0.1 it wins it
    cells = [_cell("a", s, b + 0.02, lr=0.1, val=0.9) for s, b in enumerate(BASE, 1)]
    cells += [_cell("a", s, b - 0.2, lr=1.0, val=0.1) for s, b in enumerate(BASE, 1)]
    cells += [_cell("b", s, b, lr=0.1, val=0.5) for s, b in enumerate(BASE, 1)]
    assert _row(_doc(cells, tune=["lr"]))[7] == "**holds**"


def test_a_claim_is_judged_per_setting_of_the_keys_it_does_not_name():
    cells = []
    for eps, gain in ((1.0, 0.02), (2.0, -0.02)):
        for s, b in enumerate(BASE, 1):
            for strategy, acc in (("a", b + gain + 0.001 * s), ("b", b)):
                cell = _cell(strategy, s, acc)
                cell["assignments"]["target-epsilon"] = eps
                cells.append(cell)
    doc = _doc(cells)
    rows = claim_rows(doc, tuned_groups(doc)[0])
    assert len(rows) == 2
    assert "target-epsilon=1.0" in rows[0] and "**holds**" in rows[0]
    assert "target-epsilon=2.0" in rows[1] and "**does not hold**" in rows[1]
