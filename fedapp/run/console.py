"""What the launcher shows in the terminal: one progress line a round while the run goes on, and a one-screen
summary of the results folder at its end.

Flower's whole log (the ServerApp's, :mod:`fedapp.compat.server_log`; under ``--engine run-simulation`` everything
the engine's process prints) goes to ``flower.log`` in the run's results folder (:data:`FLOWER_LOG`); the
terminal gets only the lines :func:`progress_line` keeps: the round headlines (``strategies.server.records.headline``)
and Flower's warnings and errors. ``--verbose`` (or ``DPFL_VERBOSE=1``, :data:`VERBOSE_ENV`) prints every line as
it is logged instead. :func:`summary_lines` reads ``summary.json``, ``config.json`` and ``rounds.jsonl``
(:mod:`fedapp.state.results`).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: the file in the results folder that holds Flower's whole log of the run
FLOWER_LOG = "flower.log"
#: environment variable that makes the launcher print Flower's whole log (as ``--verbose``)
VERBOSE_ENV = "DPFL_VERBOSE"
#: the prefix of every line the launcher prints itself
PREFIX = "[dpfl]"
#: clients listed one by one in the summary (more: min / median / max)
CLIENT_TABLE_MAX = 20
#: an ε within this relative slack of its budget counts as within it (the accountants' own rounding)
BUDGET_SLACK = 1e-6

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ROUND = re.compile(r"\[round \d+/\d+\]")
_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
#: Flower's levels whose lines the terminal keeps in quiet mode
_SHOWN_LEVELS = ("WARNING", "ERROR", "CRITICAL")


def verbose_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`VERBOSE_ENV` asks for Flower's whole log (``1``, ``true``, ``yes``, ``on``)."""
    value = (os.environ if environ is None else environ).get(VERBOSE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def plain(line: str) -> str:
    """``line`` without terminal colour codes (Flower colours its console log)."""
    return _ANSI.sub("", line)


def progress_line(line: str) -> str | None:
    """What the terminal shows of one line of Flower's log in quiet mode: a round headline (from its ``[round i/n]``
    on), a warning or an error (as logged); None for every other line (it stays in :data:`FLOWER_LOG`)."""
    text = plain(line).rstrip()
    found = _ROUND.search(text)
    if found:
        return f"{PREFIX} {text[found.start():]}"
    level = _LEVEL.match(text)
    if level and level.group(1) in _SHOWN_LEVELS:
        return text
    return None


def echo_all(line: str) -> None:
    """Verbose mode: every line of Flower's log, as logged."""
    print(line, flush=True)


def echo_progress(line: str) -> None:
    """Quiet mode: only the lines :func:`progress_line` keeps."""
    shown = progress_line(line)
    if shown is not None:
        print(shown, flush=True)


def echo(verbose: bool) -> Callable[[str], None]:
    """The terminal's handler of Flower's log lines: :func:`echo_all` or :func:`echo_progress`."""
    return echo_all if verbose else echo_progress


# ------------------------------------------------------------------------------------------------- the summary
def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _client_budgets(run_dir: Path) -> dict[int, tuple[float | None, float | None]]:
    """Each client's (ε budget, δ) from its last record in ``rounds.jsonl`` that names them."""
    out: dict[int, tuple[float | None, float | None]] = {}
    try:
        lines = (run_dir / "rounds.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for client in record.get("clients") or []:
            cid = client.get("client_id")
            if cid is None:
                continue
            budget, delta = out.get(int(cid), (None, None))
            out[int(cid)] = (_number(client.get("epsilon_budget"), budget), _number(client.get("delta"), delta))
    return out


def _number(value: Any, default: float | None) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else default


def _pct(value: Any) -> str:
    return f"{100 * value:.1f} %" if isinstance(value, (int, float)) else "n/a"


def _within(spent: float, budget: float | None) -> bool:
    return budget is None or spent <= budget * (1 + BUDGET_SLACK)


def _privacy_lines(run_dir: Path, summary: Mapping[str, Any], neighbours: str = "") -> list[str]:
    spent = {int(k): float(v) for k, v in (summary.get("max_epsilon_per_client") or {}).items() if v is not None}
    if not spent:
        return [f"{PREFIX} privacy: no ε was accounted (a non-private run)"]
    budgets = _client_budgets(run_dir)
    within = sum(_within(eps, budgets.get(cid, (None, None))[0]) for cid, eps in spent.items())
    with_budget = sum(budgets.get(cid, (None, None))[0] is not None for cid in spent)
    deltas = {d for _, d in budgets.values() if d is not None}
    delta = f", δ = {deltas.pop():.0e} each" if len(deltas) == 1 else ""
    delta += f", {neighbours} neighbours" if neighbours else ""
    head = (f"{PREFIX} privacy: ε spent / budget per client{delta}: {within} of {len(spent)} within budget"
            if with_budget else f"{PREFIX} privacy: ε spent per client{delta} (no per-client budget recorded)")
    lines = [head]
    if len(spent) <= CLIENT_TABLE_MAX:
        cells = []
        for cid, eps in sorted(spent.items()):
            budget = budgets.get(cid, (None, None))[0]
            mark = "" if _within(eps, budget) else "!"
            cells.append(f"c{cid:<2} {eps:4.2f}" + (f"/{budget:<4.2f}{mark}" if budget is not None else ""))
        for start in range(0, len(cells), 5):
            lines.append("       " + "  ".join(f"{c:<16}" for c in cells[start:start + 5]).rstrip())
    else:
        values = sorted(spent.values())
        lines.append(f"       ε spent: min {values[0]:.2f}, median {statistics.median(values):.2f}, "
                     f"max {values[-1]:.2f}")
        ratios = sorted(eps / b for cid, eps in spent.items() if (b := budgets.get(cid, (None, None))[0]))
        if ratios:
            lines.append(f"       spent / budget: min {ratios[0]:.2f}, median {statistics.median(ratios):.2f}, "
                         f"max {ratios[-1]:.2f}")
    for key, label in (("max_epsilon_vs_server", "against the server"),
                       ("max_epsilon_vs_release", "against observers of the released models")):
        if summary.get(key) is not None:
            lines.append(f"       max ε {label}: {float(summary[key]):.2f}")
    for key, label in (("delta_total", "the budget's ε"), ("delta_vs_release", "the ε against the released models")):
        if summary.get(key) is not None:  # the accountant's δ plus SecAgg+'s minimum cohort's share
            lines.append(f"       δ of {label}, with SecAgg+'s minimum cohort: {float(summary[key]):.3g}")
    return lines


def _audit_lines(audit: Any) -> list[str]:
    """The privacy audit's final-model estimate and lower bound beside the accountant's ε (run-config audit-canaries)."""
    if not isinstance(audit, dict) or not isinstance(audit.get("final_model"), dict):
        return []
    final, accountant = audit["final_model"], audit.get("epsilon_accountant")
    estimate = "n/a"
    if isinstance(final.get("epsilon_estimate"), (int, float)) and final.get("epsilon_interval"):
        low, high = final["epsilon_interval"]
        estimate = f"{final['epsilon_estimate']:.2f} [{low:.2f}, {high:.2f}]"
    bound = final.get("epsilon_lower_bound")
    return [f"{PREFIX} audit ({audit.get('canaries')} {audit.get('level', '')}-level canaries, final model): estimate "
            f"{estimate}, lower bound " + (f"{float(bound):.2f}" if isinstance(bound, (int, float)) else "n/a")
            + " (95 %); accountant ε " + (f"{float(accountant):.2f}" if isinstance(accountant, (int, float)) else "n/a")]


def summary_lines(run_dir: Path, display_dir: Path | None = None) -> list[str]:
    """The launcher's closing screen for the results folder ``run_dir`` (shown as ``display_dir``, e.g. relative to
    the working folder): accuracy, every client's ε against its budget, the threat model and where the files are."""
    summary = _read_json(run_dir / "summary.json")
    meta = _read_json(run_dir / "config.json")
    config = meta.get("config") or {}
    privacy = meta.get("privacy") or {}
    clients = len(summary.get("max_epsilon_per_client") or {}) or config.get("num-clients") or "?"
    rounds = summary.get("rounds_completed")
    wall = summary.get("wall_seconds")
    lines = [f"{PREFIX} ---- {config.get('strategy', '?')} on {config.get('dataset', '?')}, {clients} clients, "
             f"{rounds} rounds, seed {config.get('seed', '?')}"
             + (f", {wall:.0f} s" if isinstance(wall, (int, float)) else "") + " ----"]
    best = (f", best {_pct(summary.get('best_accuracy'))} (round {summary.get('best_round')})"
            if summary.get("best_round") != rounds else "")
    lines.append(f"{PREFIX} test accuracy of the global model: {_pct(summary.get('final_accuracy'))} after the last "
                 f"round{best}")
    if summary.get("final_client_accuracy") is not None:
        lines.append(f"{PREFIX} mean client local test accuracy: {_pct(summary.get('final_client_accuracy'))}")
    trained = f"{PREFIX} {summary.get('rounds_trained')} of {rounds} rounds trained"
    if summary.get("rounds_refused_by_budget"):
        trained += f", {len(summary['rounds_refused_by_budget'])} refused by the privacy budget"
    if summary.get("stopped_reason"):
        trained += f" ({summary['stopped_reason']})"
    lines.append(trained)
    record_level = str(privacy.get("threat_model", "")).startswith("record-level")
    lines += _privacy_lines(run_dir, summary, str(config.get("record-neighbours") or "") if record_level else "")
    lines += _audit_lines(summary.get("audit"))
    if privacy.get("threat_model"):
        lines.append(f"{PREFIX} threat model: {privacy['threat_model']}")
    if str(privacy.get("guarantee", "")).startswith("NONE"):
        lines.append(f"{PREFIX} guarantee: {privacy['guarantee']}")
    shown = display_dir or run_dir
    files = [name for name in ("summary.json", "rounds.jsonl", "config.json") if (run_dir / name).exists()]
    plots = [name for name in ("accuracy.png", "privacy.png") if (run_dir / name).exists()]
    lines.append(f"{PREFIX} results: {shown}{os.sep}")
    lines.append(f"{PREFIX}   {', '.join(files)}" + (f"; plots {', '.join(plots)}" if plots else "")
                 + (f"; Flower's log {FLOWER_LOG}" if (run_dir / FLOWER_LOG).exists() else ""))
    return lines


def display_path(path: Path, cwd: Path | None = None) -> Path:
    """``path`` relative to ``cwd`` (default: the working folder) when it lies below it, else as given."""
    try:
        return path.resolve().relative_to((cwd or Path.cwd()).resolve())
    except ValueError:
        return path
