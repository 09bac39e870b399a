"""Turn a sweep (``index.json`` of :mod:`fedapp.sweep`) into a markdown report with intervals and verdicts.

``python -m fedapp.report results/sweeps/<name>/index.json`` writes ``report.md``, ``accuracy_rounds.png``
(mean and 95 % interval per group over rounds) and, when the grid varies a privacy key,
``accuracy_epsilon.png`` next to the index.

* Groups are cells that differ only in ``seed``; each metric is reported as mean ± the 95 % confidence
  half-width of the mean (Student t, n − 1 degrees of freedom) with n stated.
* Keys listed under ``tune`` (e.g. ``lr``) are chosen per group on the clients' *validation split*
  (``validation-fraction`` of each client's training part; ``tune-metric``, default
  ``final_client_val_accuracy``), never on the local or central test sets the tables report.
* A claim compares two groups on one metric (``lower-is-better`` for losses): **holds** when the better
  group's interval lies entirely on the better side of the worse one's, **does not hold** when entirely on
  the other side, **inconclusive** when they overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS = ("final_accuracy", "best_accuracy", "final_client_accuracy", "final_loss", "max_epsilon",
           "total_uplink_bytes", "wall_seconds")
TUNING_METRICS = {"final_client_val_accuracy": "higher", "final_client_val_loss": "lower"}
DEFAULT_TUNING_METRIC = "final_client_val_accuracy"
PRIVACY_KEYS = ("epsilon", "target-epsilon", "privacy-dist", "noise-multiplier")


class ReportError(ValueError):
    """A sweep the report cannot be written for (e.g. a tuned key without a validation metric)."""


def tuning_metric(doc: Mapping[str, Any]) -> str:
    metric = str(doc.get("meta", {}).get("tune-metric", DEFAULT_TUNING_METRIC))
    if metric not in TUNING_METRICS:
        raise ReportError(f"tune-metric must be one of {sorted(TUNING_METRICS)}, got {metric!r}")
    return metric


def interval(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, 95 % half-width of the mean, n); the half-width is nan for n < 2."""
    from scipy import stats

    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, 1
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n), n


def _key(assignments: Mapping[str, Any], drop: Iterable[str]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in assignments.items() if k not in set(drop))


def finished_cells(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["cells"].values() if c.get("status") == "finished" and c.get("summary")]


def tuned_groups(doc: Mapping[str, Any]) -> tuple[dict[tuple, list[dict]], dict[tuple, dict[str, Any]]]:
    """Seed groups after choosing each ``tune`` key per group on the validation metric; (groups, choices).

    A choice among several candidates needs the validation metric in every candidate's cells; a
    candidate without it is never chosen, and a group where no candidate has it is a :class:`ReportError`
    (falling back to a test metric would tune on the test set)."""
    tune = list(doc.get("tune", []))
    metric = tuning_metric(doc)
    sign = 1.0 if TUNING_METRICS[metric] == "higher" else -1.0
    by_setting: dict[tuple, dict[tuple, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for cell in finished_cells(doc):
        a = cell["assignments"]
        by_setting[_key(a, ["seed", *tune])][_key({k: a[k] for k in tune if k in a}, [])].append(cell)
    groups: dict[tuple, list[dict]] = {}
    choices: dict[tuple, dict[str, Any]] = {}
    for setting, candidates in by_setting.items():
        scores = {t: interval([c["summary"].get(metric) for c in cells])[0] for t, cells in candidates.items()}
        if len(candidates) > 1 and all(math.isnan(v) for v in scores.values()):
            raise ReportError(f"{_label(setting)}: {len(candidates)} candidates of {tune} but no cell has "
                              f"{metric!r} (run with validation-fraction > 0 and fraction-evaluate > 0)")
        best = max(candidates, key=lambda t: _nan_low(sign * scores[t]))
        groups[setting] = candidates[best]
        if tune:
            choices[setting] = {**dict(best), "candidates": len(candidates),
                                "scores": {_label(t): scores[t] for t in sorted(candidates, key=_value_order)}}
    return groups, choices


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


def verdict(better: tuple[float, float, int], worse: tuple[float, float, int]) -> str:
    (mb, hb, nb), (mw, hw, nw) = better, worse
    if nb == 0 or nw == 0:
        return "no data"
    if nb < 2 or nw < 2:
        return "inconclusive (one seed: no interval)"
    if mb - hb > mw + hw:
        return "holds"
    if mb + hb < mw - hw:
        return "does not hold"
    return "inconclusive (intervals overlap)"


def _matches(setting: tuple, where: Mapping[str, Any]) -> bool:
    d = dict(setting)
    return all(d.get(k) == v for k, v in where.items())


def claim_rows(doc: Mapping[str, Any], groups: Mapping[tuple, list[dict]]) -> list[str]:
    rows = []
    for claim in doc.get("claims", []):
        metric = claim.get("metric", "final_accuracy")
        better, worse = dict(claim["better"]), dict(claim["worse"])
        # compare within every setting of the keys the claim does not name (e.g. per privacy distribution)
        named = set(better) | set(worse)
        contexts = sorted({tuple((k, v) for k, v in s if k not in named) for s in groups}, key=str)
        for ctx in contexts:
            gb = [g for s, g in groups.items() if _matches(s, {**dict(ctx), **better})]
            gw = [g for s, g in groups.items() if _matches(s, {**dict(ctx), **worse})]
            if not gb or not gw:
                continue
            ib = interval([c["summary"].get(metric) for c in gb[0]])
            iw = interval([c["summary"].get(metric) for c in gw[0]])
            sign = -1.0 if claim.get("lower-is-better") else 1.0  # compare -loss when lower is better
            decided = verdict((sign * ib[0], ib[1], ib[2]), (sign * iw[0], iw[1], iw[2]))
            rows.append(f"| {claim.get('text', '')} | {_label(ctx)} | {metric} | {_fmt(*ib, metric)} (n={ib[2]}) | "
                        f"{_fmt(*iw, metric)} (n={iw[2]}) | **{decided}** |")
    return rows


def _rounds(cell: Mapping[str, Any]) -> list[dict[str, Any]]:
    path = Path(cell["run_dir"]) / "rounds.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _axes() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rounds(groups: Mapping[tuple, list[dict]], path: Path) -> None:
    fig, ax = _axes()
    for setting, cells in sorted(groups.items(), key=lambda kv: str(kv[0])):
        per_round: dict[int, list[float]] = defaultdict(list)
        for cell in cells:
            for r in _rounds(cell):
                acc = r["metrics"].get("accuracy", r["metrics"].get("client_accuracy"))
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


def plot_epsilon(groups: Mapping[tuple, list[dict]], key: str, path: Path) -> None:
    lines: dict[tuple, list[tuple[Any, tuple[float, float, int]]]] = defaultdict(list)
    for setting, cells in groups.items():
        d = dict(setting)
        lines[tuple((k, v) for k, v in setting if k != key)].append(
            (d.get(key), interval([c["summary"].get("final_accuracy") for c in cells])))
    fig, ax = _axes()
    for rest, pts in sorted(lines.items(), key=lambda kv: str(kv[0])):
        pts.sort(key=lambda p: str(p[0]) if not isinstance(p[0], (int, float)) else f"{p[0]:020.6f}")
        xs = [str(p[0]) for p in pts]
        ax.errorbar(xs, [p[1][0] for p in pts], yerr=[0 if math.isnan(p[1][1]) else p[1][1] for p in pts],
                    marker="o", capsize=3, label=_label(rest))
    _save(fig, ax, key, "final test accuracy (mean, 95 % interval)", path)


def write_report(index: str | Path) -> Path:
    """Write ``report.md`` (and plots) next to ``index``; returns its path."""
    index = Path(index)
    if index.is_dir():
        index = index / "index.json"
    doc = json.loads(index.read_text(encoding="utf-8"))
    out = index.parent
    groups, choices = tuned_groups(doc)
    cfg, meta = doc.get("config", {}), doc.get("meta", {})
    lines = [f"# {doc['sweep']} ({meta.get('scale', 'default')} scale)", ""]
    if meta.get("paper"):
        lines.append(f"Reproduces: {meta['paper']}.")
    lines.append(f"Scale here: {doc.get('num_supernodes')} clients, {cfg.get('num-server-rounds', '?')} rounds, "
                 f"max-samples {cfg.get('max-samples', 0) or 'all'} on {cfg.get('dataset', 'digits')}"
                 + (f"; the paper: {meta['paper-scale']}." if meta.get("paper-scale") else "."))
    cells = doc["cells"].values()
    lines.append(f"Cells: {sum(c.get('status') == 'finished' for c in cells)} finished of {len(doc['cells'])}; "
                 f"sweep file `{doc.get('file')}`; intervals are 95 % confidence intervals of the mean over seeds.")
    lines += ["", "## Results", "", "| group | n | " + " | ".join(METRICS) + " |",
              "|---|---|" + "---|" * len(METRICS)]
    for setting, group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        cols = [_fmt(*interval([c["summary"].get(m) for c in group]), m) for m in METRICS]
        lines.append(f"| {_label(setting)} | {len(group)} | " + " | ".join(cols) + " |")
    if choices:
        metric = tuning_metric(doc)
        lines += ["", f"## Tuned on the clients' validation split ({metric}, mean over seeds)", "",
                  "| group | chosen | candidates |", "|---|---|---|"]
        for setting, choice in sorted(choices.items(), key=lambda kv: str(kv[0])):
            chosen = {k: v for k, v in choice.items() if k not in ("candidates", "scores")}
            scores = "; ".join(f"{t}: {_fmt(v, math.nan, 1, metric)}" for t, v in choice["scores"].items())
            lines.append(f"| {_label(setting)} | {_label(tuple(chosen.items()))} | {scores} |")
    rows = claim_rows(doc, groups)
    if rows:
        lines += ["", "## Claims", "", "| claim | setting | metric | better | worse | verdict |",
                  "|---|---|---|---|---|---|", *rows]
    plot_rounds(groups, out / "accuracy_rounds.png")
    lines += ["", "![accuracy over rounds](accuracy_rounds.png)"]
    varied = [k for k in PRIVACY_KEYS if len(doc.get("grid", {}).get(k, [])) > 1]
    if varied:
        plot_epsilon(groups, varied[0], out / "accuracy_epsilon.png")
        lines += ["", f"![accuracy vs {varied[0]}](accuracy_epsilon.png)"]
    failed = [(cid, c.get("error", c.get("status"))) for cid, c in doc["cells"].items() if c.get("status") != "finished"]
    if failed:
        lines += ["", "## Cells that did not finish", ""] + [f"* `{cid}`: {why}" for cid, why in failed]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the markdown report of a sweep.")
    parser.add_argument("index", type=Path, help="index.json of a sweep (or its folder)")
    args = parser.parse_args(argv)
    try:
        print(write_report(args.index))
    except ReportError as exc:
        print(f"[report] {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
