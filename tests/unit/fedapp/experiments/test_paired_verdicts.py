"""Paired claim verdicts of fedapp.experiments.report: one one-sided paired t-test per claim, Holm-corrected."""

from __future__ import annotations

import math
from typing import Any

import pytest
from scipy import stats

from fedapp.experiments.report import (
    claim_rows,
    holm,
    interval,
    one_sided_p,
    pair_by_seed,
    paired_test,
    tuned_groups,
    verdict,
)

T_975_4 = 2.776445105  # t_{0.975} with 4 degrees of freedom (tables)


def test_t_interval_and_one_sided_p_by_hand():
    p = paired_test([1, 2, 3, 4, 5])
    # mean 3, s = sqrt(10 / 4), half-width t_{0.975, 4} * s / sqrt(5); t = 3 / (s / sqrt(5)) = 4.243
    assert p.n == 5 and p.mean == pytest.approx(3.0) and p.claimed_side
    assert p.half == pytest.approx(T_975_4 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    t = 3 / (math.sqrt(2.5) / math.sqrt(5))
    assert p.p == pytest.approx(float(stats.t.sf(t, 4))) and 0.006 < p.p < 0.007  # t-table: P(T_4 > 4.243) ≈ 0.0066
    assert one_sided_p([-1, -2, -3, -4, -5]) == pytest.approx(1 - p.p)  # the other side
    assert one_sided_p([-1, -2, -3, -4, -5], lower_is_better=True) == pytest.approx(p.p)  # a loss went down
    assert one_sided_p([2, 2, 2]) == 0.0 and one_sided_p([-2, -2]) == 1.0 and one_sided_p([0, 0]) == 1.0
    assert math.isnan(one_sided_p([1.0]))


def test_holm_by_hand():
    # m = 3: 0.01·3 = 0.03; 0.02·2 = 0.04; 0.04·1 = 0.04 (monotone); nan is no test and does not count
    assert holm([0.04, 0.01, math.nan, 0.02]) == pytest.approx([0.04, 0.03, math.nan, 0.04], nan_ok=True)
    assert holm([0.3, 0.6]) == pytest.approx([0.6, 0.6])  # step-down keeps the order
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_verdict_from_the_adjusted_p_and_the_planned_pairs():
    p = paired_test([1, 2, 3, 4, 5])
    assert verdict(p, 0.04, 5) == "holds" and verdict(p, 0.06, 5) == "not shown"
    assert verdict(paired_test([-1, -2, -3]), 0.9, 0) == "not shown (mean on the other side)"
    assert verdict(p, 0.001, 8) == "incomplete: 5 of 8 planned pairs, no verdict"
    assert verdict(paired_test([1.0]), math.nan, 0) == "fewer than 2 pairs: no test"


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
    assert mb - hb <= mw + hw  # the independent intervals overlap
    claim, _, _, better, worse, paired, pairs, p, p_holm, verdict_ = _row(_doc(cells))
    assert verdict_ == "**holds**" and pairs == "5"  # no grid in this document: nothing planned to compare with
    assert paired.startswith("+2.3 ± ") and paired.endswith("(n=5)")  # percentage points
    assert better.endswith("(n=5)") and worse.endswith("(n=5)")  # the per-method intervals are kept
    assert float(p) == pytest.approx(one_sided_p(gains), rel=5e-3) and float(p) < 1e-3
    assert p_holm == p  # one test in the family


def test_claim_on_the_other_side_and_lower_is_better():
    cells = [_cell("a", s, b - 0.03 + 0.002 * s) for s, b in enumerate(BASE, 1)]
    cells += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    assert _row(_doc(cells))[9] == "**not shown (mean on the other side)**"
    # on the loss (1 - accuracy) a's higher loss is the worse side of a lower-is-better claim as well
    assert _row(_doc(cells, metric="final_loss", **{"lower-is-better": True}))[9] == \
        "**not shown (mean on the other side)**"
    flipped = _doc(cells, metric="final_loss", better={"strategy": "b"}, worse={"strategy": "a"},
                   **{"lower-is-better": True})
    assert _row(flipped)[9] == "**holds**"


def test_a_noisy_claim_is_not_shown():
    diffs = [0.02, -0.01, 0.01, -0.02, 0.03]  # mean 0.006, s = 0.020736: t = 0.647, p = 0.28
    cells = [_cell("a", s, b + d) for s, (b, d) in enumerate(zip(BASE, diffs), 1)]
    cells += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    row = _row(_doc(cells))
    assert row[9] == "**not shown**" and float(row[7]) == pytest.approx(0.277, abs=0.002)


def test_fewer_than_two_pairs_give_no_test():
    cells = [_cell("a", 1, 0.5), _cell("a", 2, 0.6), _cell("b", 2, 0.4), _cell("b", 3, 0.3)]
    assert pair_by_seed(cells[:2], cells[2:], "final_accuracy") == [(2, pytest.approx(0.2))]
    row = _row(_doc(cells))
    assert row[5] == "+20.0 (n=1)" and row[7] == "–" and row[9] == "**fewer than 2 pairs: no test**"
    row = _row(_doc([_cell("a", 1, 0.5), _cell("b", 2, 0.4)]))
    assert row[5] == "–" and row[9] == "**no paired seeds**"


def test_holm_corrects_across_the_claims_and_the_planned_pairs_gate_the_verdict():
    """Two claims with one-sided p = 0.03 and 0.02: Holm gives 2·0.02 = 0.04 and max(0.04, 1·0.03) = 0.04, both
    hold; a third claim at p = 0.4 makes the smallest 3·0.02 = 0.06, and none holds. A grid that planned 6 seeds
    leaves 5 pairs without a verdict."""
    def cells_with(diffs: list[float], strategy: str) -> list[dict[str, Any]]:
        return [_cell(strategy, s, b + d) for s, (b, d) in enumerate(zip(BASE, diffs), 1)]

    def shifted(target: float) -> list[float]:  # differences whose one-sided p is ``target``
        base = [0.0, 0.01, -0.01, 0.02, -0.02]
        mean_for = float(stats.t.isf(target, 4)) * math.sqrt(sum(d * d for d in base) / 4) / math.sqrt(5)
        return [d + mean_for for d in base]

    cells = cells_with(shifted(0.03), "a") + cells_with(shifted(0.02), "c") + cells_with(shifted(0.4), "e")
    cells += [_cell("b", s, b) for s, b in enumerate(BASE, 1)]
    claims = [{"text": f"{x} beats b", "metric": "final_accuracy", "better": {"strategy": x},
               "worse": {"strategy": "b"}} for x in ("a", "c")]
    doc = {"tune": [], "claims": claims, "cells": {str(i): c for i, c in enumerate(cells)}}
    rows = [[col.strip() for col in r.strip("|").split("|")] for r in claim_rows(doc, tuned_groups(doc)[0])]
    assert [float(r[7]) for r in rows] == pytest.approx([0.03, 0.02], rel=1e-6)
    assert [float(r[8]) for r in rows] == pytest.approx([0.04, 0.04], rel=1e-6)
    assert [r[9] for r in rows] == ["**holds**", "**holds**"]
    doc["claims"].append({"text": "e beats b", "metric": "final_accuracy", "better": {"strategy": "e"},
                          "worse": {"strategy": "b"}})
    rows = [[col.strip() for col in r.strip("|").split("|")] for r in claim_rows(doc, tuned_groups(doc)[0])]
    assert [float(r[8]) for r in rows] == pytest.approx([0.06, 0.06, 0.4], rel=1e-6)
    assert [r[9] for r in rows] == ["**not shown**"] * 3
    doc["grid"] = {"strategy": ["a", "b", "c", "e"], "lr": [0.1], "seed": [1, 2, 3, 4, 5, 6]}  # planned 6: one never ran
    rows = [[col.strip() for col in r.strip("|").split("|")] for r in claim_rows(doc, tuned_groups(doc)[0])]
    assert rows[0][6] == "5 of 6" and rows[0][9] == "**incomplete: 5 of 6 planned pairs, no verdict**"


def test_each_method_is_compared_at_its_tuned_setting():
    # lr 0.1 wins a's validation; at lr 1.0 a would lose the claim on test, at lr 0.1 it wins it
    cells = [_cell("a", s, b + 0.02, lr=0.1, val=0.9) for s, b in enumerate(BASE, 1)]
    cells += [_cell("a", s, b - 0.2, lr=1.0, val=0.1) for s, b in enumerate(BASE, 1)]
    cells += [_cell("b", s, b, lr=0.1, val=0.5) for s, b in enumerate(BASE, 1)]
    assert _row(_doc(cells, tune=["lr"]))[9] == "**holds**"


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
    assert "target-epsilon=2.0" in rows[1] and "**not shown (mean on the other side)**" in rows[1]


def test_a_side_tuned_at_its_grids_edge_gets_no_verdict():
    """lr 0.1 wins a's validation among 0.01, 0.1 and 1.0 (inside the grid): the claim holds. Without the 0.01
    cells 0.1 is the grid's bottom: a better lr may lie below it, so the claim waits for the grid to be extended."""
    from fedapp.experiments.report import edge_of

    cells = [_cell("a", s, b + 0.02, lr=0.1, val=0.9) for s, b in enumerate(BASE, 1)]
    cells += [_cell("a", s, b - 0.2, lr=lr, val=0.1) for s, b in enumerate(BASE, 1) for lr in (0.01, 1.0)]
    cells += [_cell("b", s, b, lr=0.1, val=0.5) for s, b in enumerate(BASE, 1)]
    doc = _doc(cells, tune=["lr"])
    groups, choices = tuned_groups(doc)
    (row,) = claim_rows(doc, groups, choices)
    assert "**holds**" in row and not any(edge_of(c) for c in choices.values())
    doc = _doc([c for c in cells if c["assignments"]["lr"] != 0.01], tune=["lr"])
    groups, choices = tuned_groups(doc)
    (row,) = claim_rows(doc, groups, choices)
    assert "**no verdict: better tuned at lr=0.1 at the bottom of 0.1-1; extend the grid**" in row
    assert edge_of({"lr": 0.25, "candidates": 3, "scores": {"lr=0.0625": 0.9, "lr=0.125": 0.91, "lr=0.25": 0.95}}) \
        == "lr=0.25 at the top of 0.0625-0.25"
    assert edge_of({"lr": 0.25, "candidates": 1, "scores": {"lr=0.25": 0.95}}) == ""  # set by the sweep file


def test_tuning_seeds_choose_and_the_other_seeds_are_judged():
    """With tune-seeds, seed 9 alone chooses a's lr (0.1 wins its validation there) and the groups hold seeds 1-5 at
    that lr only: the evaluation cells at the lr the tuning seed lost are never compared, whatever their scores."""
    cells = [_cell("a", 9, 0.9, lr=0.1, val=0.9), _cell("a", 9, 0.2, lr=1.0, val=0.1)]
    cells += [_cell("a", s, b + 0.02, lr=0.1, val=0.1) for s, b in enumerate(BASE, 1)]  # val on eval seeds: unused
    cells += [_cell("a", s, b + 0.30, lr=1.0, val=0.9) for s, b in enumerate(BASE, 1)]
    cells += [_cell("b", s, b, lr=0.1, val=0.5) for s, b in enumerate(BASE + [0.5], 1) if s != 6]
    cells += [_cell("b", 9, 0.5, lr=0.1, val=0.5)]
    doc = {**_doc(cells, tune=["lr"]), "meta": {"tune-seeds": [9]}}
    groups, choices = tuned_groups(doc)
    a = next(g for s, g in groups.items() if ("strategy", "a") in s)
    assert choices[(("strategy", "a"),)]["lr"] == 0.1
    assert sorted(c["assignments"]["seed"] for c in a) == [1, 2, 3, 4, 5]
    assert {c["assignments"]["lr"] for c in a} == {0.1}
    plain = tuned_groups(_doc(cells, tune=["lr"]))[1]  # without tune-seeds every seed votes: lr 1.0 wins
    assert plain[(("strategy", "a"),)]["lr"] == 1.0


def test_a_grid_is_extended_one_step_beyond_the_edge_its_choice_sits_on():
    from fedapp.experiments.report import extension

    def choice(chosen: float, *offered: float, key: str = "lr") -> dict[str, Any]:
        return {key: chosen, "candidates": len(offered), "scores": {f"{key}={v}": 0.0 for v in offered}}

    assert extension(choice(0.1, 0.01, 0.03, 0.1)) == {"lr": pytest.approx(0.333)}  # geometric step ×10/3
    assert extension(choice(0.01, 0.01, 0.03, 0.1)) == {"lr": pytest.approx(0.00333)}
    assert extension(choice(0.03, 0.01, 0.03, 0.1)) == {}  # inside
    assert extension(choice(0.0, 0.0, 0.5, 1.0)) == {"lr": -0.5}  # not positive: the arithmetic step
    assert extension({"local-steps": 8, "candidates": 2, "scores": {"local-steps=4": 0, "local-steps=8": 0}}) \
        == {"local-steps": 16}
    assert extension(choice(0.1, 0.1)) == {}  # one candidate: set by the file, nothing to extend


def test_seeds_are_planned_from_a_pilots_spread_by_the_power_of_the_one_sided_t_test():
    """Effect = sd (Cohen's d = 1), one-sided α = 0.05, power 0.8: 8 pairs (the paired t-test's textbook n; the
    normal approximation (1.645 + 0.842)² = 6.2 is too few). Halving the effect or α only raises n."""
    from fedapp.experiments.report import seed_plan, seeds_for

    assert seeds_for(1.0, 1.0) == 8
    assert seeds_for(1.0, 0.5) > seeds_for(1.0, 1.0) < seeds_for(1.0, 1.0, alpha=0.01)
    n = seeds_for(0.2, 0.3, alpha=0.05 / 3)
    crit = stats.t.ppf(1 - 0.05 / 3, n - 1)
    assert stats.nct.sf(crit, n - 1, math.sqrt(n) * 1.5) >= 0.8 > stats.nct.sf(
        stats.t.ppf(1 - 0.05 / 3, n - 2), n - 2, math.sqrt(n - 1) * 1.5)
    with pytest.raises(ValueError, match="sd > 0"):
        seeds_for(0.0, 1.0)
    cells = [_cell("a", s, b + d, val=0.5) for s, (b, d) in enumerate(zip(BASE, [0.01, 0.03, 0.02, 0.04, 0.0]), 1)]
    cells += [_cell("b", s, b, val=0.5) for s, b in enumerate(BASE, 1)]
    (_, _, row) = seed_plan(_doc(cells), effect=0.02)
    sd = float(stats.tstd([0.01, 0.03, 0.02, 0.04, 0.0]))
    assert f"| 5 | {sd:.4g} | {seeds_for(sd, 0.02)} |" in row


def test_a_resumed_sweep_extends_an_edge_no_further_than_tune_extend(monkeypatch) -> None:
    """After one extension (lr 0.005 beyond 0.05-0.5) won again, a resumed sweep with tune-extend = 1 runs nothing
    more; with tune-extend = 2 it runs the next step (0.0005). Before, every resume extended once more."""
    from types import SimpleNamespace

    from fedapp.experiments import sweep as sweep_module

    choice = {"lr": 0.005, "candidates": 3, "scores": {"lr=0.005": 0.9, "lr=0.05": 0.8, "lr=0.5": 0.7}}
    monkeypatch.setattr(sweep_module, "_choices", lambda doc: {(("strategy", "a"),): choice})
    for limit, expected in ((1, []), (2, [{"strategy": "a", "lr": 0.0005, "seed": 9}])):
        fake = SimpleNamespace(meta={"tune-extend": limit}, grid={"strategy": ["a"], "lr": [0.05, 0.5]}, variants=[],
                               tune=["lr"], tune_seeds=[9])
        assert sweep_module._extensions(fake, {}) == expected


def test_an_extension_counts_against_its_own_settings_grid_not_another_variants(monkeypatch) -> None:
    """Variants with their own lr grids (robust-hdp 0.01-0.05, dpsgd-fedavg 0.002-0.01): robust-hdp at its bottom
    edge extends to 0.005, which only dpsgd-fedavg's grid offers. That value is beyond robust-hdp's own grid, so with
    tune-extend = 1 nothing more runs; counted against every variant's values it was not, and a third value ran."""
    from types import SimpleNamespace

    from fedapp.experiments import sweep as sweep_module

    choice = {"lr": 0.005, "candidates": 4,
              "scores": {"lr=0.005": 0.9, "lr=0.01": 0.8, "lr=0.02": 0.7, "lr=0.05": 0.6}}
    monkeypatch.setattr(sweep_module, "_choices", lambda doc: {(("strategy", "robust-hdp"),): choice})
    variants = [{"strategy": "robust-hdp", "lr": lr} for lr in (0.01, 0.02, 0.05)]
    variants += [{"strategy": "dpsgd-fedavg", "lr": lr} for lr in (0.002, 0.005, 0.01)]
    for limit, expected in ((1, []), (2, [{"strategy": "robust-hdp", "lr": 0.0025, "seed": 9}])):
        fake = SimpleNamespace(meta={"tune-extend": limit}, grid={}, variants=variants, tune=["lr"], tune_seeds=[9])
        assert sweep_module._extensions(fake, {}) == expected
