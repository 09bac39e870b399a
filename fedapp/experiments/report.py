"""Turn a sweep (``index.json`` of :mod:`fedapp.experiments.sweep`) into a markdown report with intervals and verdicts.

``python -m fedapp.experiments.report results/sweeps/<name>/index.json [--out DIR]`` writes ``report.md``,
``accuracy_rounds.png`` (mean and 95 % interval per group over rounds), when the grid varies a privacy key
``accuracy_epsilon.png``, and a self-contained ``index.json`` into DIR (default: next to the index).

* Groups are cells that differ only in ``seed``; each metric is reported as mean ± the 95 % confidence
  half-width of the mean (Student t, n − 1 degrees of freedom) with n stated.
* Keys listed under ``tune`` (e.g. ``lr``) are chosen per group on the clients' *validation split*
  (``validation-fraction`` of each client's training part; ``tune-metric``, default
  ``final_client_val_accuracy``), never on the local or central test sets the tables report.
* A claim compares two groups on one metric (``lower-is-better`` for losses) within every setting of the
  grid keys it does not name, each group at its tuned setting. The cells are *paired by seed* (a seed gives
  both the same partition, privacy profiles and initial model): per seed d = better − worse. One test, stated
  before any run and the same for every claim: the one-sided paired t-test of "mean d lies on the claimed side
  of 0" (> 0, or < 0 with ``lower-is-better``), its p-values Holm-corrected across every claim × setting of the
  report (one report is one paper's claims at one scale). The verdict is read from that test alone: **holds**
  when the Holm-adjusted p is below 0.05, else **not shown**; a claim with fewer pairs than the sweep file
  planned (its seeds, fixed before the runs) gets no verdict, and so does a claim with a side whose tuned choice sits
  on the edge of the values its grid offers (the better setting may lie beyond: the grid is extended first). The
  mean of d ± its 95 % t half-width is shown as the effect's size, not as a second test.
* The ``index.json`` written beside the report holds, per cell, its assignments, resolved run-config,
  ``summary.json`` and the per-round metrics the plots read (``ROUND_METRICS``; no per-client records), so
  ``python -m fedapp.experiments.report <that index.json>`` rewrites the same tables with no results folders present.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ``max_epsilon`` is what the run's budget is for; ``max_epsilon_vs_release`` (client-level runs) is the ε of the
#: released model, the one equal across methods that add the same noise to the sum, shown where the cells have it
METRICS = ("final_accuracy", "best_accuracy", "final_client_accuracy", "final_loss", "final_train_loss",
           "final_utility", "max_epsilon", "max_epsilon_vs_release", "total_uplink_bytes", "wall_seconds")
OPTIONAL_METRICS = ("max_epsilon_vs_release", "final_train_loss", "final_utility")
TUNING_METRICS = {"final_client_val_accuracy": "higher", "final_client_val_loss": "lower"}
DEFAULT_TUNING_METRIC = "final_client_val_accuracy"
#: the accuracies a figure may plot (:func:`accuracy_metric`)
ACCURACY_METRICS = ("final_accuracy", "best_accuracy", "final_client_accuracy")
PRIVACY_KEYS = ("epsilon", "target-epsilon", "privacy-dist", "noise-multiplier")
ROUND_METRICS = ("accuracy", "client_accuracy", "loss", "epsilon", "client_val_accuracy", "client_val_loss",
                 "train_loss", "grad_norm_sq", "grad_norm_sq_avg", "payload_bits_total", "uplink_bytes")
#: keys other than the privacy keys that a figure puts on its x axis when the cells vary them: Fed-SMP's compression
#: ratio p = k/d (its Fig. 3)
FIGURE_KEYS = ("compression-ratio",)
#: SoteriaFL's figures (Sec. 6): utility (running mean of ‖∇f(x_t)‖²) and training loss against rounds and bits
PAPER_AXES = (("grad_norm_sq_avg", "utility: mean of ‖∇f(x_t)‖² over rounds"), ("train_loss", "training loss f(x_t)"))
ALPHA = 0.05  # the claims' family-wise error rate (Holm)


class ReportError(ValueError):
    """A sweep the report cannot be written for (e.g. a tuned key without a validation metric)."""


def tuning_metric(doc: Mapping[str, Any]) -> str:
    metric = str(doc.get("meta", {}).get("tune-metric", DEFAULT_TUNING_METRIC))
    if metric not in TUNING_METRICS:
        raise ReportError(f"tune-metric must be one of {sorted(TUNING_METRICS)}, got {metric!r}")
    return metric


def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _sd(xs: Sequence[float], mean: float) -> float:
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def interval(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, 95 % half-width of the mean, n); the half-width is nan for n < 2."""
    from scipy import stats

    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, 1
    return mean, float(stats.t.ppf(0.975, n - 1)) * _sd(xs, mean) / math.sqrt(n), n


# ----------------------------------------------------------------------------- paired comparisons
@dataclass(frozen=True)
class Paired:
    """What the per-seed differences d = better − worse of one claim in one setting say."""

    n: int  # pairs
    mean: float  # mean of d (nan without pairs)
    half: float  # 95 % t half-width of that mean (nan for n < 2)
    p: float  # one-sided paired-t p-value of "mean d is on the claimed side of 0" (nan for n < 2)
    claimed_side: bool  # whether the mean lies on the claimed side of 0


def one_sided_p(diffs: Sequence[float], lower_is_better: bool = False) -> float:
    """The paired t-test's one-sided p-value of H1 "mean d > 0" (< 0 with ``lower_is_better``) against H0 "mean d
    is 0 or on the other side": P(T_{n−1} ≥ t) with t = ±mean(d) / (s/√n). Without spread (s = 0) it is 0 for a
    mean on the claimed side and 1 otherwise; nan for fewer than 2 pairs."""
    from scipy import stats

    d = _finite(diffs)
    n = len(d)
    if n < 2:
        return math.nan
    sign = -1.0 if lower_is_better else 1.0
    mean = sum(d) / n
    sd = _sd(d, mean)
    if sd == 0:
        return 0.0 if sign * mean > 0 else 1.0
    return float(stats.t.sf(sign * mean / (sd / math.sqrt(n)), n - 1))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values of a family (Holm 1979): the k-th smallest of m becomes
    max over j ≤ k of min(1, (m − j + 1)·p_(j)). A nan (no test) stays nan and does not count in m."""
    tested = sorted((i for i, p in enumerate(p_values) if not math.isnan(p)), key=lambda i: p_values[i])
    m, running = len(tested), 0.0
    out = [math.nan] * len(p_values)
    for rank, i in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def seeds_for(sd: float, effect: float, alpha: float = ALPHA, power: float = 0.8, most: int = 1000) -> int:
    """The fewest pairs n at which the one-sided paired t-test at level ``alpha`` detects a true mean difference of
    ``effect`` with probability ``power``, when the differences spread with standard deviation ``sd`` (a pilot's):
    P(T'_{n−1}(δ) > t_{1−α, n−1}) ≥ power with noncentrality δ = √n·effect/sd (noncentral t). Declared before
    the runs, from the pilot's spread and the effect the claim is about (e.g. the paper's), never from the runs it
    plans. ``most`` when no n up to it suffices."""
    from scipy import stats

    if not (sd > 0 and effect > 0 and 0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"seeds_for needs sd > 0, effect > 0, alpha and power in (0, 1); got {sd}, {effect}, "
                         f"{alpha}, {power}")
    for n in range(2, most + 1):
        critical = float(stats.t.ppf(1 - alpha, n - 1))
        if float(stats.nct.sf(critical, n - 1, math.sqrt(n) * effect / sd)) >= power:
            return n
    return most


def paired_test(diffs: Sequence[float], lower_is_better: bool = False) -> Paired:
    """The paired summary and one-sided test of a claim from its per-seed differences better − worse."""
    d = _finite(diffs)
    mean, half, n = interval(d)
    sign = -1.0 if lower_is_better else 1.0
    return Paired(n, mean, half, one_sided_p(d, lower_is_better), n > 0 and sign * mean > 0)


def verdict(paired: Paired, adjusted: float, planned: int, edge: str = "") -> str:
    """The claim's verdict from its Holm-adjusted p-value; none with fewer pairs than the ``planned`` ones (0: the
    sweep planned none, a report of cells without a grid), and none while a side's tuned choice sits on its grid's
    ``edge`` (the better setting may lie beyond it: the grid is extended first)."""
    if paired.n == 0:
        return "no paired seeds"
    if paired.n < 2:
        return "fewer than 2 pairs: no test"
    if paired.n < planned:
        return f"incomplete: {paired.n} of {planned} planned pairs, no verdict"
    if edge:
        return f"no verdict: {edge}; extend the grid"
    if adjusted < ALPHA:
        return "holds"
    return "not shown" if paired.claimed_side else "not shown (mean on the other side)"


def pair_by_seed(better: Sequence[Mapping[str, Any]], worse: Sequence[Mapping[str, Any]],
                 metric: str) -> list[tuple[Any, float]]:
    """(seed, better − worse) for every seed both groups have ``metric`` for, in seed order."""

    def by_seed(cells: Sequence[Mapping[str, Any]]) -> dict[Any, float]:
        out = {}
        for c in cells:
            v = c["summary"].get(metric)
            if v is not None and math.isfinite(float(v)):
                out[c["assignments"].get("seed")] = float(v)
        return out

    b, w = by_seed(better), by_seed(worse)
    return [(s, b[s] - w[s]) for s in sorted(set(b) & set(w), key=str)]


# ----------------------------------------------------------------------------- groups and tuning
def _key(assignments: Mapping[str, Any], drop: Iterable[str]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in assignments.items() if k not in set(drop))


def grid_cells(grid: Mapping[str, Sequence[Any]], variants: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every combination of ``grid``, each once per variant (when there are variants), in file order."""
    keys = list(grid)
    return [{**dict(zip(keys, values)), **variant}
            for values in itertools.product(*(grid[k] for k in keys)) for variant in variants or [{}]]


def scale_cells(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The assignments of every cell of the index's scale."""
    return grid_cells(doc.get("grid") or {}, doc.get("variants") or [])


def evaluation_plan(doc: Mapping[str, Any], choices: Mapping[tuple, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """With ``tune-seeds``: each setting of the grid at its chosen tune values (which may lie beyond the file's grid,
    an extension), on the grid's seeds: the evaluation cells, in grid order."""
    tune = list(doc.get("tune", []))
    out: list[dict[str, Any]] = []
    for cell in scale_cells(doc):
        setting = _key(cell, ["seed", *tune])
        if setting in choices:
            chosen = {**dict(setting), **{t: choices[setting][t] for t in tune if t in choices[setting]},
                      "seed": cell.get("seed")}
            if chosen not in out:
                out.append(chosen)
    return out


def _setting_id(assignments: Mapping[str, Any], tune: Sequence[str]) -> str:
    return json.dumps({k: v for k, v in assignments.items() if k not in ("seed", *tune)}, sort_keys=True)


def tune_values(cells: Iterable[Mapping[str, Any]], tune: Sequence[str]) -> dict[str, set[str]]:
    """Per setting (a cell's assignments less the seed and the ``tune`` keys), the tune values its cells offer."""
    out: dict[str, set[str]] = defaultdict(set)
    for cell in cells:
        out[_setting_id(cell, tune)].add(json.dumps([cell.get(t) for t in tune], sort_keys=True))
    return out


def finished_cells(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["cells"].values() if c.get("status") == "finished" and c.get("summary")]


def tune_seeds(doc: Mapping[str, Any]) -> list[Any]:
    """The seeds a sweep spends on choosing its ``tune`` keys only (``[sweep] tune-seeds``; none: every seed both
    chooses and evaluates)."""
    return list(doc.get("meta", {}).get("tune-seeds", []) or [])


def _tune_key(assignments: Mapping[str, Any], tune: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    return _key({k: assignments[k] for k in tune if k in assignments}, [])


def tuned_groups(doc: Mapping[str, Any]) -> tuple[dict[tuple, list[dict]], dict[tuple, dict[str, Any]]]:
    """Seed groups after choosing each ``tune`` key per group on the validation metric; (groups, choices).

    With ``tune-seeds`` the choice is made on those seeds' cells alone and a group holds the other seeds' cells
    at the chosen values (tuning seeds are never evaluation seeds); without, every seed does both. A choice
    among several candidates needs the validation metric in every candidate's cells; a candidate without it is
    never chosen, and a group where no candidate has it is a :class:`ReportError` (falling back to a test metric
    would tune on the test set)."""
    tune = list(doc.get("tune", []))
    metric = tuning_metric(doc)
    sign = 1.0 if TUNING_METRICS[metric] == "higher" else -1.0
    held = {json.dumps(s) for s in tune_seeds(doc)}
    by_setting: dict[tuple, dict[tuple, list[dict]]] = defaultdict(lambda: defaultdict(list))
    evaluation: dict[tuple, dict[tuple, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for cell in finished_cells(doc):
        a = cell["assignments"]
        tuning = not held or json.dumps(a.get("seed")) in held
        (by_setting if tuning else evaluation)[_key(a, ["seed", *tune])][_tune_key(a, tune)].append(cell)
    groups: dict[tuple, list[dict]] = {}
    choices: dict[tuple, dict[str, Any]] = {}
    for setting, candidates in by_setting.items():
        scores = {t: interval([c["summary"].get(metric) for c in cells])[0] for t, cells in candidates.items()}
        if len(candidates) > 1 and all(math.isnan(v) for v in scores.values()):
            raise ReportError(f"{_label(setting)}: {len(candidates)} candidates of {tune} but no cell has "
                              f"{metric!r} (run with validation-fraction > 0 and fraction-evaluate > 0)")
        best = max(candidates, key=lambda t: _nan_low(sign * scores[t]))
        chosen = evaluation[setting][best] if held else candidates[best]
        if chosen:
            groups[setting] = chosen
        if tune:
            choices[setting] = {**dict(best), "candidates": len(candidates),
                                "scores": {_label(t): scores[t] for t in sorted(candidates, key=_value_order)}}
    return groups, choices


def _offered(choice: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per tune key, the numeric values the choice's candidates offered."""
    offered: dict[str, list[float]] = defaultdict(list)
    for label in choice.get("scores", {}):
        for part in label.split(", "):
            key, _, value = part.partition("=")
            try:
                offered[key].append(float(value))
            except ValueError:
                continue
    return {k: sorted(set(v)) for k, v in offered.items()}


def _edges(choice: Mapping[str, Any]) -> dict[str, tuple[str, list[float]]]:
    """Per numeric tune key whose chosen value is the lowest or highest of several offered: (side, values)."""
    if choice.get("candidates", 1) < 2:
        return {}
    out = {}
    for key, values in _offered(choice).items():
        chosen = choice.get(key)
        if isinstance(chosen, (int, float)) and not isinstance(chosen, bool) and len(values) > 1:
            where = "bottom" if chosen == values[0] else "top" if chosen == values[-1] else ""
            if where:
                out[key] = (where, values)
    return out


def edge_of(choice: Mapping[str, Any]) -> str:
    """Where a tuned choice sits on the edge of the values its candidates offer ('' when inside for every numeric
    key, or with one candidate): e.g. ``lr=0.25 at the top of 0.0625-0.25``."""
    return ", ".join(f"{key}={choice[key]:g} at the {where} of {values[0]:g}-{values[-1]:g}"
                     for key, (where, values) in _edges(choice).items())


def extension(choice: Mapping[str, Any]) -> dict[str, float | int]:
    """The next value beyond each edge the choice sits on, one grid step further: the ratio of the two outermost
    values when they are positive (a geometric grid such as 0.01, 0.03, 0.1 goes on to 0.333), else their difference;
    3 significant digits (integers stay integers). Empty when the choice is inside its grid."""
    out: dict[str, float | int] = {}
    for key, (where, values) in _edges(choice).items():
        edge, inner = (values[-1], values[-2]) if where == "top" else (values[0], values[1])
        nxt = edge * (edge / inner) if edge > 0 and inner > 0 else edge + (edge - inner)
        value: float | int = round(nxt) if isinstance(choice[key], int) else float(f"{nxt:.3g}")
        if value not in values:
            out[key] = value
    return out


def _value_order(assignments: tuple) -> tuple:
    """Sort key of a candidate's assignments: numbers by value, anything else by text after them."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for _, v in assignments)


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


def _label(setting: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting) or "(all)"


def _fmt(mean: float, half: float, n: int, metric: str) -> str:
    if n == 0:
        return "–"
    scale = 100.0 if "accuracy" in metric else 1.0
    digits = 1 if "accuracy" in metric else 3
    if metric == "total_uplink_bytes":
        return f"{mean / 1e6:.2f} MB" + ("" if math.isnan(half) else f" ± {half / 1e6:.2f}")
    text = f"{mean * scale:.{digits}f}"
    return text + ("" if math.isnan(half) else f" ± {half * scale:.{digits}f}")


def _fmt_paired(p: Paired, metric: str) -> str:
    if p.n == 0:
        return "–"
    text = _fmt(p.mean, p.half, p.n, metric)
    return ("+" if p.mean > 0 else "") + text + f" (n={p.n})"


def _matches(setting: tuple, where: Mapping[str, Any]) -> bool:
    d = dict(setting)
    return all(d.get(k) == v for k, v in where.items())


def planned_pairs(doc: Mapping[str, Any], setting: Mapping[str, Any], better: Mapping[str, Any],
                  worse: Mapping[str, Any]) -> int:
    """The seeds the sweep file planned for both sides of a claim in ``setting``: the pairs its test was declared
    with, before any run (0 for a document without a grid)."""
    planned = scale_cells(doc)

    def seeds(side: Mapping[str, Any]) -> set[str]:
        where = {**setting, **side}
        return {json.dumps(c.get("seed")) for c in planned if all(c.get(k) == v for k, v in where.items())}

    return len(seeds(better) & seeds(worse))


def claim_settings(doc: Mapping[str, Any], groups: Mapping[tuple, list[dict]]
                   ) -> list[tuple[Mapping[str, Any], list[tuple[tuple, tuple, tuple]]]]:
    """Per claim of ``doc``: the settings of the keys it does not name (e.g. per privacy distribution) where both
    sides have a group, as (setting, better group's key, worse group's key)."""
    out = []
    for claim in doc.get("claims", []):
        better, worse = dict(claim["better"]), dict(claim["worse"])
        named = set(better) | set(worse)
        found = []
        for ctx in sorted({tuple((k, v) for k, v in s if k not in named) for s in groups}, key=str):
            sb = [s for s in groups if _matches(s, {**dict(ctx), **better})]
            sw = [s for s in groups if _matches(s, {**dict(ctx), **worse})]
            if sb and sw:
                found.append((ctx, sb[0], sw[0]))
        out.append((claim, found))
    return out


def seed_plan(doc: Mapping[str, Any], effect: float, power: float = 0.8) -> list[str]:
    """Markdown rows planning a sweep's seeds from a pilot's index: per claim and setting, the pilot's pairs, the sd of
    its paired differences, and :func:`seeds_for` at ``effect`` with level ALPHA / (the rows), Holm's first step,
    the strictest any row of the planned report can meet."""
    groups = tuned_groups(doc)[0]
    rows = [(claim, ctx, [d for _, d in pair_by_seed(groups[sb], groups[sw], claim.get("metric", "final_accuracy"))])
            for claim, found in claim_settings(doc, groups) for ctx, sb, sw in found]
    alpha = ALPHA / max(1, len(rows))
    out = [f"| claim | setting | metric | pilot pairs | sd of d | seeds for {effect:g} at α = {alpha:.3g}, "
           f"power {power:g} |", "|---|---|---|---|---|---|"]
    for claim, ctx, diffs in rows:
        d = _finite(diffs)
        sd = _sd(d, sum(d) / len(d)) if len(d) > 1 else math.nan
        need = seeds_for(sd, effect, alpha, power) if sd > 0 else "–"
        out.append(f"| {claim.get('text', '')} | {_label(ctx)} | {claim.get('metric', 'final_accuracy')} | {len(d)} | "
                   f"{sd:.4g} | {need} |")
    return out


def claim_rows(doc: Mapping[str, Any], groups: Mapping[tuple, list[dict]],
               choices: Mapping[tuple, Mapping[str, Any]] | None = None) -> list[str]:
    """One table row per claim and setting (:func:`claim_table`)."""
    return claim_table(doc, groups, choices)[0]


def claim_table(doc: Mapping[str, Any], groups: Mapping[tuple, list[dict]],
                choices: Mapping[tuple, Mapping[str, Any]] | None = None) -> tuple[list[str], int]:
    """(one table row per claim and setting, the number of tests Holm's correction counts); the verdicts from the
    one-sided tests, Holm-corrected over the rows; none for a side whose tuned choice (``choices``, from
    :func:`tuned_groups`) sits on its grid's edge."""
    edges = {s: e for s, c in (choices or {}).items() if (e := edge_of(c))}
    tests: list[tuple[Paired, int, str] | None] = []
    cols: list[list[str]] = []
    for claim, found in claim_settings(doc, groups):
        metric = claim.get("metric", "final_accuracy")
        better, worse = dict(claim["better"]), dict(claim["worse"])
        for ctx, sb, sw in found:
            edge = "; ".join(f"{side} tuned at {edges[s]}" for side, s in (("better", sb), ("worse", sw)) if s in edges)
            ib = interval([c["summary"].get(metric) for c in groups[sb]])
            iw = interval([c["summary"].get(metric) for c in groups[sw]])
            paired = paired_test([d for _, d in pair_by_seed(groups[sb], groups[sw], metric)],
                                 bool(claim.get("lower-is-better")))
            tests.append((paired, planned_pairs(doc, dict(ctx), better, worse), edge))
            cols.append([claim.get("text", ""), _label(ctx), metric, f"{_fmt(*ib, metric)} (n={ib[2]})",
                         f"{_fmt(*iw, metric)} (n={iw[2]})", _fmt_paired(paired, metric)])
        if not found:  # never drop a claim silently: a side was not run, or the sides differ elsewhere
            missing = [name for name, side in (("better", better), ("worse", worse))
                       if not any(_matches(s, side) for s in groups)]
            why = (f"not run: no cell matches its {' and '.join(missing)} side" if missing else
                   "no setting has cells on both sides: the two groups differ in a key the claim does not name")
            tests.append(None)
            cols.append([claim.get("text", ""), "–", metric, "–", "–", "–", "–", "–", "–", f"**{why}**"])
    adjusted = holm([t[0].p if t is not None else math.nan for t in tests])
    rows = []
    for test, col, adj in zip(tests, cols, adjusted):
        if test is not None:
            paired, planned, edge = test
            col = [*col, f"{paired.n} of {planned}" if planned else str(paired.n),
                   "–" if math.isnan(paired.p) else f"{paired.p:.3g}", "–" if math.isnan(adj) else f"{adj:.3g}",
                   f"**{verdict(paired, adj, planned, edge)}**"]
        rows.append("| " + " | ".join(col) + " |")
    return rows, sum(1 for a in adjusted if not math.isnan(a))


CLAIMS_NOTE = (
    "Each claim is judged on its cells *paired by seed* (a seed gives both methods the same partition, privacy "
    "profiles and initial model{crn}), each method at its tuned setting: per seed d = better − worse, shown as its "
    "mean ± the 95 % t half-width (the effect's size). The test, the same for every claim and fixed before the "
    "runs: a one-sided paired t-test of \"mean d lies on the claimed side of 0\" (above 0; below 0 for a "
    "lower-is-better metric), with the pairs the sweep file planned; its p-values Holm-corrected across the "
    "{tests} claim × setting rows of this report. **holds** when the Holm-adjusted p is below {alpha}, else **not "
    "shown**; fewer pairs than planned: no verdict. Accuracy differences are in percentage points.")


EDGE_NOTE = (" A side whose tuned choice sits on the edge of the values its grid offers gets no verdict: the better "
             "setting may lie beyond the grid, which is extended until the choice is inside.")


def compact_rounds(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per round of ``rounds.jsonl``: its number and the ``ROUND_METRICS`` it has (no per-client records)."""
    path = Path(run_dir) / "rounds.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{"round": r["round"], **{k: r["metrics"][k] for k in ROUND_METRICS if k in r["metrics"]}}
            for r in records]


def run_record(run_dir: str | Path) -> dict[str, Any]:
    """What a cell's index entry keeps of its results folder: the resolved run-config and the round metrics."""
    run_dir = Path(run_dir)
    out: dict[str, Any] = {}
    if (run_dir / "config.json").is_file():
        out["config"] = json.loads((run_dir / "config.json").read_text(encoding="utf-8")).get("config")
    if (run_dir / "rounds.jsonl").is_file():
        out["rounds"] = compact_rounds(run_dir)
    return out


def compact_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A cell's ``summary.json`` for the index: without the per-client ε map (one entry per client, 130 KB a cell
    at 5,900 clients; the cell's own summary.json keeps it, the index keeps ``max_epsilon``)."""
    return {k: v for k, v in summary.items() if k != "max_epsilon_per_client"}


def self_contained(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with every cell's missing ``config`` / ``rounds`` read from its results folder where it exists,
    and its summary compact."""
    cells = {}
    for cid, cell in doc["cells"].items():
        if cell.get("run_dir") and not {"config", "rounds"} <= set(cell):
            cell = {**cell, **{k: v for k, v in run_record(cell["run_dir"]).items() if k not in cell}}
        if isinstance(cell.get("summary"), Mapping):
            cell = {**cell, "summary": compact_summary(cell["summary"])}
        cells[cid] = cell
    return {**doc, "cells": cells}


def dumps_index(doc: Mapping[str, Any]) -> str:
    """``index.json`` text: indented, one line per round record (small enough to commit, readable in a diff)."""
    from fedapp.state.results import json_safe

    doc = json_safe(dict(doc))
    rounds: dict[str, list[dict[str, Any]]] = {}
    cells = {}
    for cid, cell in doc.get("cells", {}).items():
        if isinstance(cell.get("rounds"), list):
            token = f"\x00rounds {len(rounds)}\x00"
            rounds[token] = cell["rounds"]
            cell = {**cell, "rounds": token}
        cells[cid] = cell
    text = json.dumps({**doc, "cells": cells}, indent=2)
    for token, records in rounds.items():
        body = ",\n".join(" " * 8 + json.dumps(r) for r in records)
        text = text.replace(json.dumps(token), f"[\n{body}\n      ]" if records else "[]", 1)
    return text + "\n"


def write_index(path: Path, doc: Mapping[str, Any]) -> None:
    """Write ``index.json`` atomically (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(dumps_index(doc))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def ran_seeded(doc: Mapping[str, Any], cell: Mapping[str, Any]) -> bool:
    """Whether a cell ran with ``seeded-noise = true`` (its resolved run-config, else its assignments over the
    sweep's config)."""
    config = cell.get("config")
    if isinstance(config, Mapping) and "seeded-noise" in config:
        return bool(config["seeded-noise"])
    return bool(cell.get("assignments", {}).get("seeded-noise", doc.get("config", {}).get("seeded-noise", False)))


# ----------------------------------------------------------------------------- plots
def _rounds(cell: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "rounds" in cell:
        return list(cell["rounds"])
    run_dir = cell.get("run_dir")
    return compact_rounds(run_dir) if run_dir and (Path(run_dir) / "rounds.jsonl").is_file() else []


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes() -> tuple[Any, Any]:
    return _pyplot().subplots(figsize=(7, 4.5))


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, path: Path) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def plot_rounds(groups: Mapping[tuple, list[dict]], path: Path) -> None:
    fig, ax = _axes()
    for setting, cells in sorted(groups.items(), key=lambda kv: str(kv[0])):
        per_round: dict[int, list[float]] = defaultdict(list)
        for cell in cells:
            for r in _rounds(cell):
                acc = _accuracy(r)
                if acc is not None:
                    per_round[int(r["round"])].append(float(acc))
        xs = sorted(per_round)
        stats = [interval(per_round[x]) for x in xs]
        means = [s[0] for s in stats]
        (line,) = ax.plot(xs, means, label=f"{_label(setting)} (n={len(cells)})")
        halves = [0.0 if math.isnan(s[1]) else s[1] for s in stats]
        ax.fill_between(xs, [m - h for m, h in zip(means, halves)], [m + h for m, h in zip(means, halves)],
                        color=line.get_color(), alpha=0.2)
    _save(fig, ax, "round", "accuracy (mean, 95 % interval over seeds)", path)


def accuracy_metric(groups: Mapping[tuple, list[dict]], claims: Sequence[Mapping[str, Any]] = ()) -> str:
    """The accuracy a figure plots, one every cell records: the accuracy the sweep's claims all judge (the paper's
    metric, e.g. Robust-HDP's mean client test accuracy, Table 12), else the server's test accuracy of the global
    model, else the mean of the clients' local test accuracies (personalized and record-level runs evaluate on the
    clients only, so a sweep that compares them with a global method plots what both have)."""
    cells = [c for g in groups.values() for c in g]
    judged = {claim.get("metric") for claim in claims}
    claimed = [m for m in ACCURACY_METRICS if judged == {m}]
    for metric in (*claimed, "final_accuracy", "final_client_accuracy"):
        if cells and all(c["summary"].get(metric) is not None for c in cells):
            return metric
    return "final_accuracy"


def tick(key: str, value: Any) -> str:
    """A figure's x tick for ``value`` of ``key``: a Table-7 privacy distribution with its mean ε_i (its name, e.g.
    dist2, says nothing of the budgets' size), any other value as it is."""
    if key == "privacy-dist" and isinstance(value, str) and value != "fixed":
        from fedapp.privacy.profiles import DISTRIBUTIONS, distribution_mean

        if value in DISTRIBUTIONS:
            return f"{value}\nmean ε {distribution_mean(value):.2f}"
    return str(value)


def plot_epsilon(groups: Mapping[tuple, list[dict]], key: str, path: Path, metric: str = "final_accuracy") -> None:
    """``metric`` (mean and 95 % interval over seeds) against the privacy ``key``, one line per method."""
    lines: dict[tuple, list[tuple[Any, tuple[float, float, int]]]] = defaultdict(list)
    for setting, cells in groups.items():
        d = dict(setting)
        lines[tuple((k, v) for k, v in setting if k != key)].append(
            (d.get(key), interval([c["summary"].get(metric) for c in cells])))
    fig, ax = _axes()
    for rest, pts in sorted(lines.items(), key=lambda kv: str(kv[0])):
        pts.sort(key=lambda p: str(p[0]) if not isinstance(p[0], (int, float)) else f"{p[0]:020.6f}")
        xs = [tick(key, p[0]) for p in pts]
        ax.errorbar(xs, [p[1][0] for p in pts], yerr=[0 if math.isnan(p[1][1]) else p[1][1] for p in pts],
                    marker="o", capsize=3, label=_label(rest))
    what = {"final_accuracy": "final test accuracy", "best_accuracy": "best test accuracy over rounds",
            "final_client_accuracy": "final mean client test accuracy",
            "final_train_loss": "final training loss f(x_T)",
            "final_utility": "utility: mean ‖∇f(x_t)‖²"}.get(metric, metric)
    _save(fig, ax, key, f"{what} (mean, 95 % interval)", path)


def _curve(cells: Sequence[Mapping[str, Any]], metric: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """(rounds, mean cumulative uplink bits, mean, 95 % half-width) of a per-round ``metric`` over ``cells``."""
    values: dict[int, list[float]] = defaultdict(list)
    bits: dict[int, list[float]] = defaultdict(list)
    for cell in cells:
        for r in _rounds(cell):
            if r.get(metric) is not None:
                values[int(r["round"])].append(float(r[metric]))
                bits[int(r["round"])].append(float(r.get("payload_bits_total") or math.nan))
    xs = sorted(values)
    stats = [interval(values[x]) for x in xs]
    return ([float(x) for x in xs], [interval(bits[x])[0] for x in xs], [s[0] for s in stats],
            [0.0 if math.isnan(s[1]) else s[1] for s in stats])


def _uplink_curve(cells: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """(mean cumulative uplink bits, mean accuracy, 95 % half-width) at the rounds where ``cells`` were evaluated
    (:func:`_accuracy`)."""
    acc: dict[int, list[float]] = defaultdict(list)
    bits: dict[int, list[float]] = defaultdict(list)
    for cell in cells:
        for rnd, accuracy, sent in _evaluations(cell):
            acc[rnd].append(accuracy)
            bits[rnd].append(sent)
    xs = sorted(acc)
    stats = [interval(acc[x]) for x in xs]
    return [interval(bits[x])[0] for x in xs], [s[0] for s in stats], [0.0 if math.isnan(s[1]) else s[1] for s in stats]


def _accuracy(record: Mapping[str, Any]) -> Any:
    """A round's test accuracy: the global model's, else the clients' mean (personalized methods)."""
    return record.get("accuracy", record.get("client_accuracy"))


def _evaluations(cell: Mapping[str, Any]) -> Iterator[tuple[int, float, float]]:
    """(round, accuracy, uplink bits all clients sent up to and including it) of each evaluated round of ``cell``."""
    sent = 0.0
    for r in _rounds(cell):
        sent += 8.0 * float(r.get("uplink_bytes") or 0)
        if _accuracy(r) is not None:
            yield int(r["round"]), float(_accuracy(r)), sent


def has_uplink(groups: Mapping[tuple, list[dict]]) -> bool:
    """Whether some cell sent uplink bytes before a round it was evaluated in (a curve to draw)."""
    return any(bits > 0 for cells in groups.values() for bits in _uplink_curve(cells)[0])


def plot_uplink(groups: Mapping[tuple, list[dict]], path: Path) -> None:
    """Fed-SMP's Fig. 2 (right): test accuracy against the uplink bits all clients sent so far, one line per group
    with its 95 % band over seeds."""
    fig, ax = _axes()
    for setting, cells in sorted(groups.items(), key=lambda kv: str(kv[0])):
        xs, mean, half = _uplink_curve(cells)
        if not any(x > 0 for x in xs):
            continue
        (line,) = ax.plot(xs, mean, label=f"{_label(setting)} (n={len(cells)})")
        ax.fill_between(xs, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xscale("log")
    _save(fig, ax, "uplink bits (all clients, cumulative)", "accuracy (mean, 95 % interval over seeds)", path)


def to_target(cell: Mapping[str, Any], target: float) -> tuple[int, float] | None:
    """(round, cumulative uplink bits) when ``cell``'s test accuracy first reached ``target``; None if it never did."""
    return next(((rnd, sent) for rnd, accuracy, sent in _evaluations(cell) if accuracy >= target), None)


def target_table(groups: Mapping[tuple, list[dict]], target: float) -> list[str]:
    """Rows of the uplink-to-target table (Fed-SMP Sec. 6.2: the uplink a method spends to reach a test accuracy)."""
    rows = []
    for setting, cells in sorted(groups.items(), key=lambda kv: str(kv[0])):
        hits = [h for h in (to_target(c, target) for c in cells) if h is not None]
        r = interval([float(h[0]) for h in hits]) if hits else (math.nan, math.nan, 0)
        rounds = "–" if not hits else f"{r[0]:.1f}" + ("" if math.isnan(r[1]) else f" ± {r[1]:.1f}")
        bits = interval([h[1] for h in hits]) if hits else (math.nan, math.nan, 0)
        shown = f"{bits[0]:.3g} ± {bits[1]:.2g}" if len(hits) > 1 else (f"{bits[0]:.3g}" if hits else "–")
        rows.append(f"| {_label(setting)} | {len(hits)} of {len(cells)} | {rounds} | {shown} |")
    return rows


def plot_paper_axes(groups: Mapping[tuple, list[dict]], key: str | None, out: Path) -> list[tuple[str, str]]:
    """SoteriaFL's figure layout (Figures 1-3): utility (top) and training loss (bottom) against rounds (left) and
    uplink bits (right), one line per method with its 95 % band over seeds, one figure per value of the privacy
    ``key``; [(file name, title)] of the figures written (none when no cell records the training loss)."""
    plt = _pyplot()
    panels: dict[Any, dict[tuple, list[dict]]] = defaultdict(dict)
    for setting, cells in groups.items():
        if any(r.get("train_loss") is not None for c in cells for r in _rounds(c)):
            value = dict(setting).get(key) if key else None
            panels[value][tuple((k, v) for k, v in setting if k != key)] = cells
    written = []
    for value, lines in sorted(panels.items(), key=lambda kv: str(kv[0])):
        fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharey="row")
        for (metric, ylabel), row in zip(PAPER_AXES, axes):
            for rest, cells in sorted(lines.items(), key=lambda kv: str(kv[0])):
                rounds, bits, mean, half = _curve(cells, metric)
                for ax, xs in zip(row, (rounds, bits)):
                    (line,) = ax.plot(xs, mean, label=f"{_label(rest)} (n={len(cells)})")
                    ax.fill_between(xs, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                                    color=line.get_color(), alpha=0.2)
            row[0].set_ylabel(ylabel)
            row[0].set_yscale("log" if metric.startswith("grad_norm") else "linear")
        for ax, xlabel in zip(axes[1], ("round", "uplink bits (all clients, cumulative)")):
            ax.set_xlabel(xlabel)
        axes[1][1].set_xscale("log")
        axes[0][1].set_xscale("log")
        for ax in axes.flat:
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        title = f"{key} = {value}" if key else "all cells"
        fig.suptitle(f"{title}: mean and 95 % interval over seeds")
        fig.tight_layout()
        name = f"paper_axes_{key}_{value}.png" if key else "paper_axes.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append((name, title))
    return written


# ----------------------------------------------------------------------------- the report
def write_report(index: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.md``, its plots and a self-contained ``index.json`` into ``out`` (default: the index's
    folder, whose ``index.json`` then gains the cells' run-configs and round metrics); returns the report's path."""
    index = Path(index)
    if index.is_dir():
        index = index / "index.json"
    doc = self_contained(json.loads(index.read_text(encoding="utf-8")))
    out = Path(out) if out is not None else index.parent
    out.mkdir(parents=True, exist_ok=True)
    groups, choices = tuned_groups(doc)
    cfg, meta = doc.get("config", {}), doc.get("meta", {})
    lines = [f"# {doc['sweep']} ({meta.get('scale', 'default')} scale)", ""]
    seeded = sum(ran_seeded(doc, c) for c in finished_cells(doc))
    if seeded:
        lines += [f"> **No privacy guarantee:** {seeded} of {len(finished_cells(doc))} finished cells ran with "
                  "`seeded-noise = true` (common random numbers, so that methods compared on one seed draw from the "
                  "same noise and sampling seeds): their DP noise, Poisson batch sampling and client sampling derive from the run "
                  "seed, which the server knows, so it can remove the noise. Their ε are what the same mechanism "
                  "would spend with secret noise; these runs are for comparing methods, not private.", ""]
    if meta.get("paper"):
        lines.append(f"Reproduces: {meta['paper']}.")
    lines.append(f"Scale here: {doc.get('num_supernodes')} clients, {cfg.get('num-server-rounds', '?')} rounds, "
                 f"max-samples {cfg.get('max-samples', 0) or 'all'} on {cfg.get('dataset', 'digits')}"
                 + (f"; the paper: {meta['paper-scale']}." if meta.get("paper-scale") else "."))
    planned = scale_cells(doc)
    held = tune_seeds(doc)
    if held:  # the evaluation cells are each setting's grid seeds at its choice; the tuning cells choose only
        tune = list(doc.get("tune", []))
        planned_eval = evaluation_plan(doc, choices)
        held_ids = {json.dumps(x) for x in held}
        tuning = [c for c in finished_cells(doc) if json.dumps(c["assignments"].get("seed")) in held_ids]
        done = sum(c.get("assignments") in planned_eval for c in finished_cells(doc))
        lines.append(f"Cells: {done} evaluation cells finished of the {len(planned_eval)} planned (the grid's seeds at "
                     f"each setting's chosen {', '.join(tune)}); {len(tuning)} tuning cells on seeds "
                     f"{', '.join(map(str, held))} chose them and are not evaluated (tuning seeds are not evaluation "
                     f"seeds); sweep file `{doc.get('file')}`; intervals are 95 % confidence intervals of the mean "
                     "over seeds.")
    else:
        finished = [c.get("assignments") in planned for c in doc["cells"].values() if c.get("status") == "finished"]
        extra = f" (and {finished.count(False)} outside its grid, reported too)" if False in finished else ""
        lines.append(f"Cells: {finished.count(True)} finished of the scale's {len(planned)}{extra}; "
                     f"sweep file `{doc.get('file')}`; intervals are 95 % confidence intervals of the mean over seeds.")
    sources = Counter(c["reused_from"] for c in finished_cells(doc) if c.get("reused_from"))
    if sources:
        lines.append("Taken from another sweep's index (`--reuse`, the same config and federation, not run again): "
                     + "; ".join(f"{n} cells from `{src}`" for src, n in sorted(sources.items())) + ".")
    metrics = [m for m in METRICS if m not in OPTIONAL_METRICS
               or any(c["summary"].get(m) is not None for g in groups.values() for c in g)]
    lines += ["", "## Results", "", "| group | n | " + " | ".join(metrics) + " |",
              "|---|---|" + "---|" * len(metrics)]
    for setting, group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        cols = [_fmt(*interval([c["summary"].get(m) for c in group]), m) for m in metrics]
        lines.append(f"| {_label(setting)} | {len(group)} | " + " | ".join(cols) + " |")
    tune = list(doc.get("tune", []))
    offered = tune_values(planned, tune)  # the scale's own values of the tune keys, per setting
    fixed = {s: c for s, c in choices.items()
             if len(offered.get(_setting_id(dict(s), tune), set())) <= 1 and c["candidates"] == 1}
    chosen_here = {s: c for s, c in choices.items() if s not in fixed}
    if fixed:
        given = "; ".join(f"{_label(s)}: {_label(tuple((k, v) for k, v in c.items() if k not in ('candidates', 'scores')))}"
                          for s, c in sorted(fixed.items(), key=lambda kv: str(kv[0])))
        lines += ["", f"Set by the sweep file, one value a group (no choice made here): {given}."]
    if chosen_here:
        metric = tuning_metric(doc)
        over = f"on tuning seed(s) {', '.join(map(str, held))} only" if held else "mean over seeds"
        lines += ["", f"## Tuned on the clients' validation split ({metric}, {over})", "",
                  "| group | chosen | candidates |", "|---|---|---|"]
        for setting, choice in sorted(chosen_here.items(), key=lambda kv: str(kv[0])):
            chosen = {k: v for k, v in choice.items() if k not in ("candidates", "scores")}
            scores = "; ".join(f"{t}: {_fmt(v, math.nan, 1, metric)}" for t, v in choice["scores"].items())
            edge = edge_of(choice)
            lines.append(f"| {_label(setting)} | {_label(tuple(chosen.items()))}"
                         f"{f' (**edge**: {edge})' if edge else ''} | {scores} |")
    rows, tests = claim_table(doc, groups, choices)
    if rows:
        crn = ", and with `seeded-noise` the same noise and sampling seeds" if seeded else ""
        edge_note = EDGE_NOTE if any("tuned at" in row for row in rows) else ""
        lines += ["", "## Claims", "", CLAIMS_NOTE.format(crn=crn, tests=tests, alpha=ALPHA) + edge_note, "",
                  "| claim | setting | metric | better | worse | better − worse (paired) | pairs (of planned) "
                  "| p (one-sided t) | p (Holm) | verdict |", "|---|---|---|---|---|---|---|---|---|---|", *rows]
    plot_rounds(groups, out / "accuracy_rounds.png")
    lines += ["", "![accuracy over rounds](accuracy_rounds.png)"]
    varied = [k for k in PRIVACY_KEYS if len(doc.get("grid", {}).get(k, [])) > 1]
    accuracy = accuracy_metric(groups, doc.get("claims", []))
    has = {accuracy} | {m for g in groups.values() for c in g for m in ("final_train_loss",)
                        if c["summary"].get(m) is not None}
    if varied:
        for metric, what, name in ((accuracy, "accuracy", "accuracy_epsilon.png"),
                                   ("final_train_loss", "training loss", "train_loss_epsilon.png")):
            if metric in has:
                plot_epsilon(groups, varied[0], out / name, metric)
                lines += ["", f"![{what} vs {varied[0]}]({name})"]
    for key in (k for k in FIGURE_KEYS if len({dict(g).get(k) for g in groups}) > 1):
        name = f"accuracy_{key}.png"
        plot_epsilon(groups, key, out / name, accuracy)
        lines += ["", f"![accuracy vs {key}]({name})"]
    if has_uplink(groups):
        plot_uplink(groups, out / "accuracy_uplink.png")
        lines += ["", "![accuracy against uplink bits](accuracy_uplink.png)"]
        target = meta.get("target-accuracy")
        if target is not None:
            lines += ["", f"Uplink to reach {float(target):.0%} test accuracy (the first evaluated round at or above it; "
                      "means over the seeds that reached it, 95 % intervals):", "",
                      "| group | reached | rounds | uplink bits (all clients) |", "|---|---|---|---|",
                      *target_table(groups, float(target))]
    for name, title in plot_paper_axes(groups, varied[0] if varied else None, out):
        lines += ["", f"![utility and training loss against rounds and uplink bits, {title}]({name})"]
    failed = [(cid, c.get("error", c.get("status"))) for cid, c in doc["cells"].items() if c.get("status") != "finished"]
    if failed:
        lines += ["", "## Cells that did not finish", ""] + [f"* `{cid}`: {why}" for cid, why in failed]
    lines += ["", "Every cell's run-config, summary and round metrics: [index.json](index.json) "
              "(`python -m fedapp.experiments.report index.json` rewrites this report from it alone)."]
    write_index(out / "index.json", doc)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the markdown report of a sweep.")
    parser.add_argument("index", type=Path, help="index.json of a sweep, or one written beside a report (or its folder)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for report.md, its plots and a self-contained index.json (default: the index's)")
    parser.add_argument("--seeds-for", type=float, default=None, metavar="EFFECT",
                        help="instead of a report: plan the seeds a sweep needs, from this index as a pilot, to detect "
                             "a paired difference of EFFECT (in the claim's metric) with --power")
    parser.add_argument("--power", type=float, default=0.8)
    args = parser.parse_args(argv)
    try:
        if args.seeds_for is not None:
            index = args.index / "index.json" if args.index.is_dir() else args.index
            print("\n".join(seed_plan(json.loads(index.read_text(encoding="utf-8")), args.seeds_for, args.power)))
            return 0
        print(write_report(args.index, args.out))
    except ReportError as exc:
        print(f"[report] {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
