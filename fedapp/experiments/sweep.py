"""Seeded sweeps: one command runs a grid of run-configs through the same path as ``flwr run``.

A sweep file (TOML, e.g. ``configs/papers/*.toml``)::

    [sweep]
    name = "robust-hdp-table12"
    paper = "Robust-HDP Table 12"           # what is reproduced
    paper-scale = "20 clients x 2400 samples, 200 rounds"
    num-supernodes = 20
    num-gpus = 0.25                         # optional: resources per simulated client (also --num-gpus)
    base = "configs/main.toml"              # optional run-config file the cells start from
    tune = ["lr"]                           # keys chosen per group on the clients' validation split
    tune-metric = "final_client_val_accuracy"  # or final_client_val_loss (needs validation-fraction > 0)
    tune-seeds = [101]                      # optional: seeds that only choose the tune keys (never evaluated)
    tune-extend = 2                         # optional, with tune-seeds: extend a grid whose choice is on its edge
    common-random-numbers = false           # true: seeded-noise = true in every cell (no privacy guarantee)

    [sweep.config]                          # run-config shared by every cell
    num-server-rounds = 40

    [sweep.grid]                            # the cartesian product of these lists is the set of cells
    strategy = ["robust-hdp", "weiavg"]
    seed = [1, 2, 3]

    [[sweep.variants]]                      # optional: each cell of the grid runs once per variant (settings
    secagg-mechanism = "gaussian"           # that only make sense together, e.g. a mechanism and its options)
    [[sweep.variants]]
    secagg-mechanism = "ddg"
    secagg-bits = 12

    [[sweep.claims]]                        # verdicts for fedapp.experiments.report
    text = "Robust-HDP beats WeiAvg"
    metric = "final_accuracy"
    better = { strategy = "robust-hdp" }
    worse = { strategy = "weiavg" }

    [scales.quick]                          # named overrides of [sweep.config] / [sweep.grid] / [sweep]
    config = { max-samples = 6000 }
    sweep = { num-supernodes = 10 }

    [scales.paired]                         # a scale's variants replace the file's and the grid stops varying
    variants = [{ strategy = "robust-hdp", lr = 0.05 }, { strategy = "weiavg", lr = 0.01 }]  # their keys: each
    # method at its own lr, paired by seed (lr stays a tune key: the report pairs the methods across it)

``python -m fedapp.experiments.sweep FILE [--scale quick] [--parallel 2] [--out DIR] [--only seed=1]`` runs every
cell (or those with the ``--only`` grid values) with :func:`fedapp.run.launch.run` (its own SuperLink, stopped by
PID), one results folder per cell under ``DIR/cells/<cell-id>/``, and keeps ``DIR/index.json`` up to date after
every cell (atomic writes; a finished cell's entry holds its resolved run-config, ``summary.json`` and round
metrics, so the index alone rebuilds the report's tables). A finished cell is skipped when the sweep runs again, so an
interrupted sweep resumes; a finished cell's entry alone also counts, so a sweep resumes from an ``index.json`` copied
into a fresh ``--out``. A cell interrupted mid-run (its process killed) continues from its newest checkpoint
(``resume-from``, :mod:`fedapp.state.checkpoint`) instead of starting again at round 1. ``--reuse INDEX`` takes the
finished cells of another sweep's ``index.json`` (e.g. another scale of the same file) whose assignments equal a cell
of this one, whatever their order; that sweep must share this scale's config and federation, or its cells are another
experiment and the option is refused before anything runs.

With ``tune-seeds`` a sweep runs in stages: every candidate of the ``tune`` keys on the tuning seeds; then, up to
``tune-extend`` times, one value beyond each edge a setting's choice sits on (the grid's step continued,
:func:`fedapp.experiments.report.extension`) on those seeds again; then each setting at its choice on the grid's
``seed`` list alone, the evaluation seeds. The report chooses on the tuning seeds and judges on the others.

``common-random-numbers = true`` sets ``seeded-noise = true`` in every cell: DP noise, Poisson batch sampling
and client sampling then derive from the run seed, so two methods compared on one seed also draw from the same
noise and sampling seeds (common random numbers), which narrows the paired differences :mod:`fedapp.experiments.report` judges claims
on. A server that knows the seed can remove the noise: such runs carry no privacy guarantee, and the report
says so.

``--engine inprocess`` drives the same server and client components in this process (no transport; faster, for
notebooks and tests); it cannot run SecAgg+. With ``--parallel N`` > 1 each in-process cell runs in a spawned
process of its own with ``cores // N`` torch threads: cells then share neither torch's global random state nor its
thread pool, and one cell that crashes its process fails alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from fedapp.config import SCHEMA, ConfigError, resolve_config
from fedapp.experiments.report import (
    TUNING_METRICS,
    compact_summary,
    grid_cells,
    run_record,
    tune_values,
    tuning_metric,
    write_index,
)

ENGINES = ("flwr", "inprocess")


@dataclass
class Sweep:
    """A parsed sweep file at one scale."""

    name: str
    path: Path
    num_supernodes: int
    config: dict[str, Any]
    grid: dict[str, list[Any]]
    tune: list[str] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    variants: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tune_seeds(self) -> list[Any]:
        return list(self.meta.get("tune-seeds", []))

    def tuning_cells(self) -> list[dict[str, Any]]:
        """With ``tune-seeds``: every candidate of the tune keys on each tuning seed (else none)."""
        if not self.tune_seeds:
            return []
        return grid_cells({**self.grid, "seed": self.tune_seeds}, self.variants)

    def cells(self) -> list[dict[str, Any]]:
        """Every combination of the grid, each once per variant (when there are variants), in file order; with
        ``tune-seeds`` also the tuning cells (the evaluation stage then runs only each setting's choice)."""
        return grid_cells(self.grid, self.variants) + self.tuning_cells()


def cell_id(assignments: Mapping[str, Any]) -> str:
    """A short stable id of a cell's assignments (its results folder name)."""
    blob = json.dumps(dict(sorted(assignments.items())), sort_keys=True, default=str).encode()
    readable = "_".join(f"{k}={v}" for k, v in assignments.items() if k in ("strategy", "seed"))
    return f"{readable}_{hashlib.sha1(blob).hexdigest()[:8]}".replace("/", "-")


def load_sweep(path: str | Path, scale: str | None = None) -> Sweep:
    """Parse and validate a sweep file; every cell's run-config is resolved before anything runs."""
    path = Path(path)
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    if "sweep" not in doc:
        raise ConfigError(f"{path}: no [sweep] table")
    sw = dict(doc["sweep"])
    config, grid = dict(sw.pop("config", {})), dict(sw.pop("grid", {}))
    claims = list(sw.pop("claims", []))
    variants = [dict(v) for v in sw.pop("variants", [])]
    if scale is not None:
        scales = dict(doc.get("scales", {}))
        if scale not in scales:
            raise ConfigError(f"{path}: no scale {scale!r}; scales: {sorted(scales)}")
        over = dict(scales[scale])
        config.update(over.pop("config", {}))
        grid.update(over.pop("grid", {}))
        sw.update(over.pop("sweep", {}))  # [scales.x] sweep = {...} overrides [sweep] keys
        if "claims" in over:  # the scale's own claims replace the file's (a scale that tests another claim)
            claims = [dict(c) for c in over.pop("claims")]
        if "variants" in over:  # the scale's own variants replace the file's; the grid stops varying their keys
            variants = [dict(v) for v in over.pop("variants")]
            grid = {k: v for k, v in grid.items() if not any(k in variant for variant in variants)}
        unknown = sorted(over)
        if unknown:
            raise ConfigError(f"{path}: [scales.{scale}] takes config, grid, sweep, variants and claims, not {unknown}")
    base = sw.pop("base", "")
    if base:
        base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        if not base_path.is_file():
            base_path = Path(base)
        config = {**tomllib.loads(base_path.read_text(encoding="utf-8")), **config}
    config = _common_random_numbers(path, sw.get("common-random-numbers", False), config, grid)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: [sweep.grid] {key!r} must be a non-empty list, got {values!r}")
    for variant in variants:
        both = sorted(set(variant) & set(grid))
        if not variant or both:
            raise ConfigError(f"{path}: [[sweep.variants]] {variant!r} must set keys the grid does not vary "
                              f"(both set {both})" if both else f"{path}: an empty [[sweep.variants]] table")
    sweep = Sweep(name=str(sw.pop("name", path.stem)), path=path, num_supernodes=int(sw.pop("num-supernodes", 10)),
                  config=config, grid=grid, tune=list(sw.pop("tune", [])), claims=claims,
                  meta={**sw, "scale": scale or "default"}, variants=variants)
    for t in sweep.tune:
        if t not in grid and not any(t in v for v in variants):
            raise ConfigError(f"{path}: tune key {t!r} must be a [sweep.grid] or variant key")
    _check_tune_stages(path, sweep)
    try:
        tuning_metric({"meta": sweep.meta})
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    choosing = any(len(values) > 1 for values in tune_values(sweep.cells(), sweep.tune).values())
    for cell in sweep.cells():
        resolved = resolve_config(None, {**config, **cell})  # ConfigError names the key before anything runs
        if choosing and not (resolved["validation-fraction"] > 0 and resolved["fraction-evaluate"] > 0):
            raise ConfigError(
                f"{path}: tune {sweep.tune} chooses among several values on the clients' validation split "
                f"({sorted(TUNING_METRICS)}), so every cell needs validation-fraction > 0 and fraction-evaluate > 0; "
                f"cell {cell} has validation-fraction = {resolved['validation-fraction']}, "
                f"fraction-evaluate = {resolved['fraction-evaluate']}")
    return sweep


def _check_tune_stages(path: Path, sweep: Sweep) -> None:
    """``tune-seeds`` and ``tune-extend``: lists and counts that make sense together, before anything runs."""
    seeds, extend = sweep.meta.get("tune-seeds", []), sweep.meta.get("tune-extend", 0)
    if not isinstance(seeds, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
        raise ConfigError(f"{path}: [sweep] tune-seeds must be a list of integer seeds, got {seeds!r}")
    if not isinstance(extend, int) or isinstance(extend, bool) or extend < 0:
        raise ConfigError(f"{path}: [sweep] tune-extend must be an integer >= 0, got {extend!r}")
    if seeds and not sweep.tune:
        raise ConfigError(f"{path}: [sweep] tune-seeds = {seeds} but no tune keys to choose with them")
    if seeds and "seed" not in sweep.grid:
        raise ConfigError(f"{path}: [sweep] tune-seeds needs a [sweep.grid] seed list (the evaluation seeds)")
    both = sorted(set(seeds) & set(sweep.grid.get("seed", [])))
    if both:
        raise ConfigError(f"{path}: seeds {both} are both tune-seeds and evaluation seeds ([sweep.grid] seed); "
                          "tuning seeds are never evaluation seeds")
    if extend and not seeds:
        raise ConfigError(f"{path}: [sweep] tune-extend = {extend} needs tune-seeds (the extension runs on them)")


def _common_random_numbers(path: Path, crn: Any, config: dict[str, Any], grid: dict[str, list[Any]]) -> dict[str, Any]:
    """``config`` with ``seeded-noise = true`` when the sweep asks for common random numbers."""
    if not isinstance(crn, bool):
        raise ConfigError(f"{path}: [sweep] common-random-numbers must be true or false, got {crn!r}")
    if not crn:
        return config
    if "seeded-noise" in grid or config.get("seeded-noise", True) is not True:
        raise ConfigError(f"{path}: common-random-numbers = true sets seeded-noise = true in every cell; "
                          "remove seeded-noise from [sweep.config] / [sweep.grid]")
    return {**config, "seeded-noise": True}


# ----------------------------------------------------------------------------- running
class Index:
    """``index.json``: the sweep, and per cell its assignments, status, results folder and summary (finished
    cells also their resolved run-config and round metrics: :func:`fedapp.experiments.report.run_record`)."""

    def __init__(self, out: Path, sweep: Sweep) -> None:
        self.path = out / "index.json"
        self.lock = threading.Lock()
        old = json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        changed = _differing_experiment(old, sweep) if old.get("cells") else []
        if changed:  # a cell's id names only its grid assignments: resuming would mix two experiments
            raise ConfigError(f"{self.path}: the sweep's {' and '.join(changed)} changed since its cells ran; "
                              "use another --out (or remove the folder) to run the changed sweep")
        self.doc: dict[str, Any] = {"sweep": sweep.name, "file": str(sweep.path), "meta": sweep.meta, "num_supernodes":
                    sweep.num_supernodes, "config": sweep.config, "grid": sweep.grid, "tune": sweep.tune,
                    "claims": sweep.claims, "cells": dict(old.get("cells", {}))}
        if sweep.variants:
            self.doc["variants"] = sweep.variants
        write_index(self.path, self.doc)  # the file's current claims and meta, also when no cell is left to run

    def done(self, cid: str) -> bool:
        """A finished cell whose results folder is still there, or whose entry alone holds its results (summary,
        resolved run-config and rounds: an index committed beside a report resumes in a fresh checkout)."""
        cell = self.doc["cells"].get(cid, {})
        if cell.get("status") != "finished":
            return False
        return (Path(cell.get("run_dir", "")).joinpath("summary.json").is_file()
                or {"summary", "config", "rounds"} <= set(cell))

    def record(self, cid: str, entry: dict[str, Any]) -> None:
        with self.lock:
            self.doc["cells"][cid] = entry
            write_index(self.path, self.doc)


def _differing_experiment(doc: Mapping[str, Any], sweep: Sweep) -> list[str]:
    """The keys of an ``index.json`` document (``config``, ``num_supernodes``) that differ from ``sweep``'s: a cell's
    id names only its grid assignments, so cells run under other values are another experiment."""
    now = json.loads(json.dumps({"config": sweep.config, "num_supernodes": sweep.num_supernodes}, default=str))
    return [k for k, v in now.items() if doc.get(k) != v]


def reusable_cells(paths: Sequence[Path], sweep: Sweep) -> dict[str, dict[str, Any]]:
    """The finished cells of other sweeps' ``index.json`` files, keyed by their assignments (key order aside), each
    entry whole (summary, resolved run-config, rounds). Every file must hold this sweep's config and number of
    SuperNodes: a cell's id names only its grid assignments, so a cell run with other settings would pass for one of
    this sweep's."""
    pool: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--reuse {path}: not a readable index.json ({exc})") from None
        differ = _differing_experiment(doc, sweep) if isinstance(doc, dict) else ["config"]
        if differ:
            raise ConfigError(f"--reuse {path}: its {' and '.join(differ)} {'differ' if len(differ) > 1 else 'differs'} "
                              "from this scale's, so its cells are another experiment")
        for entry in doc.get("cells", {}).values():
            if entry.get("status") == "finished" and {"assignments", "summary", "config", "rounds"} <= set(entry):
                pool.setdefault(_assignment_key(entry["assignments"]), {**entry, "reused_from": str(path)})
    return pool


def _assignment_key(assignments: Mapping[str, Any]) -> str:
    return json.dumps(dict(assignments), sort_keys=True, default=str)


def interrupted_run(cell_dir: Path, rounds: int) -> Path | None:
    """The newest run folder of a cell that stopped without a reason (its process was killed: ``summary.json``
    missing or ``finished`` false with no ``stopped_reason``) and whose checkpoint has rounds of ``rounds`` left;
    ``None`` if there is none."""
    from fedapp.state.checkpoint import CHECKPOINT_FILE, load_checkpoint
    from fedapp.state.results import run_ended

    found = []
    for checkpoint in cell_dir.glob(f"*/{CHECKPOINT_FILE}"):
        summary_path = checkpoint.parent / "summary.json"
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
        except (OSError, ValueError):
            summary = {}  # half-written by the killed process: the checkpoint (written atomically) still holds
        if run_ended(summary):
            continue
        try:
            done = int(load_checkpoint(checkpoint)["state"]["round"])
        except (ConfigError, KeyError, TypeError, ValueError):
            continue  # unreadable: this folder cannot be continued
        if done < rounds:
            found.append(checkpoint)
    return max(found, key=lambda c: c.stat().st_mtime).parent if found else None


def _run_cell(sweep: Sweep, cell: dict[str, Any], out: Path, engine: str) -> Path:
    cid = cell_id(cell)
    overrides = {**sweep.config, **cell, "output-dir": str(out / "cells" / cid), "run-name": cid}
    previous = interrupted_run(out / "cells" / cid, int(overrides.get("num-server-rounds",
                                                                       SCHEMA["num-server-rounds"].default)))
    if previous is not None and not overrides.get("resume-from"):
        overrides["resume-from"] = str(previous)
        print(f"[sweep] {cid}: continues {previous.name} from its checkpoint", flush=True)
    if engine == "inprocess":
        from fedapp.experiments.notebook_utils import run_federation

        return run_federation(overrides, num_clients=sweep.num_supernodes)
    from fedapp.run.launch import run
    from fedapp.run.processes import to_toml_assignments

    return run(sweep.num_supernodes, to_toml_assignments(overrides), flwr_home=out / ".flwr" / cid,
               num_cpus=float(sweep.meta.get("num-cpus", 1.0)), num_gpus=float(sweep.meta.get("num-gpus", 0.0)))


def _limit_threads(threads: int) -> None:
    """A cell process's share of the cores: ``threads`` torch threads, and as many in every BLAS and OpenMP pool.

    numpy's OpenBLAS otherwise sizes its pool to every core. Beside another busy cell a pooled call (a float64
    ``np.linalg.norm`` of a model-sized update, three on the server's path per client update) then waits for a helper
    thread the other cell has descheduled: 0.78 ms instead of 6.6 µs for 28,938 values on the 2-core machine
    (docs/benchmarks/launch_and_memory.md), as in a Ray actor (:mod:`fedapp.compat.blas_threads`)."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(limits=threads)


def _child(threads: int, initializer: Callable[[int], None] = _limit_threads) -> ProcessPoolExecutor:
    """One freshly spawned process for a cell, started by ``initializer(threads)`` (:func:`_limit_threads`)."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=initializer, initargs=(threads,))


def _run_cell_in_child(sweep: Sweep, cell: dict[str, Any], out: Path, engine: str, threads: int) -> Path:
    """:func:`_run_cell` in a freshly spawned process limited to ``threads`` threads."""
    with _child(threads) as child:
        return child.submit(_run_cell, sweep, cell, out, engine).result()


def run_sweep(sweep: Sweep, out: Path, *, parallel: int = 1, engine: str = "flwr",
              only: Mapping[str, Any] | None = None, reuse: Sequence[Path] = ()) -> Path:
    """Run every unfinished cell (``only``: those matching these assignments) that no ``reuse`` index holds
    finished (:func:`reusable_cells`; those are recorded as they are); returns ``index.json``."""
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
    reusable = reusable_cells(reuse, sweep)
    out.mkdir(parents=True, exist_ok=True)
    index = Index(out, sweep)

    def pending(cells: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        todo, reused = [], 0
        for cell in cells:
            cid = cell_id(cell)
            if index.done(cid) or any(cell.get(k) != v for k, v in (only or {}).items()):
                continue
            if (found := reusable.get(_assignment_key(cell))) is not None:
                index.record(cid, {**found, "assignments": cell})
                reused += 1
            else:
                todo.append(cell)
        return todo, reused

    def run_all(cells: list[dict[str, Any]], stage: str) -> None:
        todo, reused = pending(cells)
        print(f"[sweep] {sweep.name}{stage}: {len(cells)} cells, {len(todo)} to run, {parallel} at a time"
              + (f" ({reused} taken from --reuse)" if reused else ""), flush=True)
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            list(pool.map(one, todo))

    def one(cell: dict[str, Any]) -> None:
        cid, start = cell_id(cell), time.time()
        index.record(cid, {"assignments": cell, "status": "running"})
        try:
            if engine == "inprocess" and parallel > 1:
                run_dir = _run_cell_in_child(sweep, cell, out, engine, max(1, (os.cpu_count() or 1) // parallel))
            else:
                run_dir = _run_cell(sweep, cell, out, engine)
        except Exception as exc:  # noqa: BLE001 — one failing cell is recorded; the others still run
            index.record(cid, {"assignments": cell, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                               "seconds": time.time() - start})
            print(f"[sweep] {cid}: FAILED {exc}", file=sys.stderr, flush=True)
            return
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        index.record(cid, {"assignments": cell, "status": "finished" if summary.get("finished") else "stopped",
                           "run_dir": str(run_dir), "summary": compact_summary(summary), "seconds": time.time() - start,
                           **run_record(run_dir)})
        print(f"[sweep] {cid}: final accuracy {summary.get('final_accuracy')} ({time.time() - start:.0f}s)", flush=True)

    if not sweep.tune_seeds:
        run_all(sweep.cells(), "")
        return index.path
    run_all(sweep.tuning_cells(), " (tuning seeds)")
    for step in range(int(sweep.meta.get("tune-extend", 0))):
        beyond = _extensions(sweep, index.doc)
        if not beyond:
            break
        run_all(beyond, f" (tuning seeds, grid extension {step + 1})")
    run_all(_evaluation_cells(sweep, index.doc), " (evaluation seeds, each setting at its choice)")
    return index.path


def _choices(doc: Mapping[str, Any]) -> dict[tuple, dict[str, Any]]:
    from fedapp.experiments.report import ReportError, tuned_groups

    try:
        return tuned_groups(doc)[1]
    except ReportError as exc:
        raise ConfigError(f"the tuning cells cannot choose: {exc}") from None


def _extensions(sweep: Sweep, doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Tuning cells one grid step beyond every setting whose choice sits on its grid's edge, while that setting has
    run fewer than ``tune-extend`` values beyond the scale's own for that setting (a variant's grid, not another
    variant's; a resumed sweep counts what it ran before)."""
    from fedapp.experiments.report import _offered, extension, grid_cells

    limit = int(sweep.meta.get("tune-extend", 0))
    declared = grid_cells(sweep.grid, sweep.variants)

    def own(setting: tuple, key: str) -> set[float]:
        return {float(c[key]) for c in declared if all(c.get(k) == v for k, v in setting)
                and isinstance(c.get(key), (int, float)) and not isinstance(c.get(key), bool)}

    out = []
    for setting, choice in _choices(doc).items():
        beyond = extension(choice)
        ran_beyond = {k: sum(v not in own(setting, k) for v in values) for k, values in _offered(choice).items()}
        if beyond and all(ran_beyond.get(k, 0) < limit for k in beyond):
            chosen = {t: choice[t] for t in sweep.tune if t in choice}
            out += [{**dict(setting), **chosen, **beyond, "seed": s} for s in sweep.tune_seeds]
    return out


def _evaluation_cells(sweep: Sweep, doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each setting of the grid at its chosen tune values, on the evaluation seeds (the grid's ``seed`` list), seed by
    seed: a sweep stopped part-way leaves whole seeds, each with every setting's cell, so its pairs are complete."""
    from fedapp.experiments.report import evaluation_plan

    seeds = [json.dumps(s) for s in sweep.grid.get("seed", [])]

    def seed_rank(cell: Mapping[str, Any]) -> int:
        seed = json.dumps(cell.get("seed"))
        return seeds.index(seed) if seed in seeds else len(seeds)

    return sorted(evaluation_plan(doc, _choices(doc)), key=seed_rank)  # stable: the grid's order within a seed


def parse_only(sweep: Sweep, items: list[str]) -> dict[str, Any]:
    """``--only KEY=VALUE`` items as assignments; a key or value no cell of the sweep has is an error."""
    only: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--only {item!r}: expected KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare string
        values = {json.dumps(c[key], sort_keys=True) for c in sweep.cells() if key in c}
        if not values:
            raise ConfigError(f"--only {item!r}: {key!r} is not a grid or variant key of this sweep")
        if json.dumps(value, sort_keys=True) not in values:
            raise ConfigError(f"--only {item!r}: no cell has {key} = {value!r} (it has {', '.join(sorted(values))})")
        only[key] = value
    return only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a sweep file's grid of run-configs (resumable).")
    parser.add_argument("file", type=Path)
    parser.add_argument("--scale", default=None, help="a [scales.<name>] table of the file, e.g. quick or paper")
    parser.add_argument("--out", type=Path, default=None, help="sweep folder (default results/sweeps/<name>-<scale>)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="cells at a time (each with its own SuperLink; in-process: each in its own process)")
    parser.add_argument("--engine", choices=ENGINES, default="flwr")
    parser.add_argument("--num-cpus", type=float, default=None, help="CPUs per simulated client (launcher)")
    parser.add_argument("--num-gpus", type=float, default=None, help="GPUs per simulated client, fractional ok")
    parser.add_argument("--report", action="store_true", help="write the report when the sweep is done")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                        help="run only the cells with this grid value (repeatable; TOML values, e.g. seed=1)")
    parser.add_argument("--reuse", action="append", default=[], type=Path, metavar="INDEX",
                        help="take finished cells of another sweep's index.json with this scale's config (repeatable)")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.file, args.scale)
        only = parse_only(sweep, args.only)
    except ConfigError as exc:
        print(f"[sweep] configuration error: {exc}", file=sys.stderr)
        return 2
    for key, value in (("num-cpus", args.num_cpus), ("num-gpus", args.num_gpus)):
        if value is not None:
            sweep.meta[key] = value  # [sweep] num-cpus / num-gpus in the file, overridden here
    out = args.out or Path("results") / "sweeps" / f"{sweep.name}-{sweep.meta['scale']}"
    try:  # run_sweep refuses a --reuse index before it makes --out
        index = run_sweep(sweep, out, parallel=args.parallel, engine=args.engine, only=only, reuse=args.reuse)
    except ConfigError as exc:
        print(f"[sweep] configuration error: {exc}", file=sys.stderr)
        return 2
    if args.report:
        from fedapp.experiments.report import ReportError, write_report

        try:
            print(f"[sweep] report: {write_report(index)}")
        except ReportError as exc:
            print(f"[sweep] no report: {exc}", file=sys.stderr)
    doc = json.loads(index.read_text(encoding="utf-8"))
    failed = [cid for cid, c in doc["cells"].items() if c.get("status") != "finished"]
    print(f"[sweep] index: {index}; {len(doc['cells']) - len(failed)} finished, {len(failed)} not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
