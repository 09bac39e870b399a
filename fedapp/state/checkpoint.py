"""Server checkpoints and resume.

After every ``checkpoint-every`` rounds (and the last) the results folder gets ``checkpoint.npz``,
written atomically (stale temporary removed, temporary file + fsync + ``os.replace`` + fsync of the
directory): global parameters, the strategy's :meth:`~strategies.base.DPFLStrategy.state_dict`
(family state such as SoteriaFL's shift or Robust-HDP's frozen weights via ``checkpoint_state``;
the server's ε ledger; every ``numpy.random.Generator`` attribute), the round number, the round
records so far and the run-config. No pickle: arrays are ``.npz`` members, everything else one
JSON document, so loading a hostile checkpoint cannot run code.

``resume-from=<checkpoint.npz or its run folder>`` continues the run: the strategy is restored,
Flower runs the remaining ``num-server-rounds − round`` rounds (numbered ``round+1 …``) and the
new results folder holds the *full* ledger (old rounds copied first); ``config.json`` says
where it resumed from. Keys that change the experiment must match the checkpoint
(:data:`RESUME_MAY_DIFFER` lists those that may differ).

Commit order: checkpoint first, then ``rounds.jsonl``/``summary.json``, then ``committed-round`` to
the clients (:class:`CheckpointingRecorder`); the client journal (same file format) is
:mod:`fedapp.state.client_state`.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.config import ConfigError, DeploymentConfig, GeneralConfig

CHECKPOINT_FILE = "checkpoint.npz"
FORMAT = "dpfl-checkpoint-v1"
#: fit-config key: the last round whose checkpoint is durable (clients commit their state up to it)
COMMITTED_ROUND_KEY = "committed-round"
#: run-config keys that may differ between the interrupted and the resumed run
RESUME_MAY_DIFFER = frozenset({
    "num-server-rounds", "output-dir", "run-name", "resume-from", "checkpoint-every", "device", "data-dir",
    "eval-batch-size", "fault-fraction", "fault-mode", "fault-delay", "round-timeout", "min-fit-clients",
    "client-state-dir", "fraction-evaluate",
})


# ----------------------------------------------------------------------------- file format
def _split(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Replace numpy arrays in a nested structure by references into ``arrays``."""
    if isinstance(value, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {"__ndarray__": key}
    if isinstance(value, Mapping):
        return {str(k): _split(v, arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, arrays) for v in value]
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    return value


def _join(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"}:
            return np.array(arrays[value["__ndarray__"]])
        return {k: _join(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, arrays) for v in value]
    return value


def temp_path(path: str | os.PathLike) -> Path:
    """The temporary file :func:`save_checkpoint` writes before renaming it to ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def remove_stale_temp(path: str | os.PathLike) -> bool:
    """Delete the temporary file an interrupted :func:`save_checkpoint` of ``path`` left; True if one was there."""
    tmp = temp_path(path)
    try:
        tmp.unlink()
    except FileNotFoundError:
        return False
    return True


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Atomically and durably write ``payload`` (nested dicts/lists of JSON values and numpy arrays)."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    doc = _split({"format": FORMAT, **payload}, arrays)
    blob = np.frombuffer(json.dumps(doc).encode("utf-8"), dtype=np.uint8)
    tmp = temp_path(path)
    remove_stale_temp(path)
    with open(tmp, "wb") as fh:
        members: dict[str, Any] = {"__json__": blob, **arrays}
        np.savez(fh, **members)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (``ConfigError`` naming the problem)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError(f"run-config 'resume-from' = {str(path)!r}: no checkpoint file there")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        doc = json.loads(arrays.pop("__json__").tobytes().decode("utf-8"))
    except (OSError, ValueError, KeyError, UnicodeDecodeError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"run-config 'resume-from' = {str(path)!r} is not a readable checkpoint: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"run-config 'resume-from' = {str(path)!r} is not a {FORMAT} checkpoint")
    try:
        out = _join(doc, arrays)
    except KeyError as exc:
        raise ConfigError(f"run-config 'resume-from' = {str(path)!r}: checkpoint misses array {exc}") from None
    out["path"] = str(path)
    return out


def check_resumable(run_values: Mapping[str, Any], rounds: int, ckpt: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` unless a run with these run-config values (by key, the form a checkpoint stores) and
    ``rounds`` server rounds may continue ``ckpt`` (same experiment, rounds left)."""
    saved = dict(ckpt.get("config") or {})
    for key, value in sorted(saved.items()):
        if key in RESUME_MAY_DIFFER or key not in run_values:
            continue
        if run_values[key] != value:
            raise ConfigError(f"run-config {key!r} = {run_values[key]!r} differs from the checkpoint's {value!r} "
                              f"({ckpt['path']}); a resumed run must be the same experiment")
    done = int(ckpt["state"]["round"])
    if done >= rounds:
        raise ConfigError(f"run-config 'num-server-rounds' = {rounds}: the checkpoint {ckpt['path']} already "
                          f"completed round {done}; nothing left to resume")


# ----------------------------------------------------------------------------- server glue
class CheckpointingRecorder:
    """A ``RoundRecorder`` that checkpoints the strategy and then forwards to the results writer.

    Commit order of a checkpointed round r (``checkpoint-every`` > 0): (1) ``checkpoint.npz`` with
    the model, ledger and every round record up to r is written durably; (2) only then are the
    records of the rounds since the previous checkpoint appended to ``rounds.jsonl`` and
    ``summary.json`` rewritten; (3) the next fit config tells the clients ``committed-round = r``,
    and they commit their journaled state up to r (:mod:`fedapp.state.client_state`). So ``rounds.jsonl``
    never holds a round the checkpoint lacks, and a client never commits past the checkpoint.

    On resume it first replays the checkpoint's round records into the new results folder, so
    ``rounds.jsonl`` of the resumed run is the complete ledger. :meth:`fit_config` is what the strategy
    sends every client with each round (the lineage and the committed round).
    """

    def __init__(self, inner: Any, run_values: Mapping[str, Any], rounds: int, every: int, strategy: Any = None,
                 resumed: Mapping[str, Any] | None = None,
                 on_end: Callable[[str, int], object] | None = None) -> None:
        self.inner = inner
        self.on_end = on_end  # called with (lineage, last round) once the run has ended: see attach
        self.run_values = dict(run_values)  # what the checkpoint stores and a resume compares
        self.num_rounds = rounds
        self.strategy = strategy
        self.resumed = resumed
        self.every = every  # checkpoint-every
        self.lineage = str(resumed["lineage"]) if resumed else ""
        self.uncommitted: list[dict[str, Any]] = []  # records of rounds after the last checkpoint
        #: the round clients may commit up to (None: no checkpoints, clients are not told)
        self.committed: int | None = None
        if strategy is not None and self.every > 0:
            self.committed = int(resumed["state"]["round"]) if resumed else 0
        self.announce_lineage = False  # the lineage goes into the fit config once the results folder is open

    @property
    def run_dir(self) -> Path | None:
        return getattr(self.inner, "run_dir", None)

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return getattr(self.inner, "rounds", [])

    def open(self) -> None:
        if self.run_dir is not None:
            return
        if self.resumed:
            self.inner.meta["resumed_from"] = {"checkpoint": self.resumed["path"],
                                               "round": int(self.resumed["state"]["round"]), "lineage": self.lineage}
        self.inner.open()
        remove_stale_temp(Path(self.inner.run_dir) / CHECKPOINT_FILE)
        if not self.lineage:
            self.lineage = Path(self.inner.run_dir).name
        self.announce_lineage = self.strategy is not None
        for record in (self.resumed or {}).get("rounds", []):
            self.inner.write_round(record)

    def write_round(self, record: dict[str, Any]) -> None:
        if self.run_dir is None:
            self.open()
        if self.strategy is None or self.every <= 0:
            self.inner.write_round(record)
            return
        rnd = int(record["round"])
        self.uncommitted.append(record)
        if rnd % self.every and rnd < self.num_rounds and not record["metrics"].get("aborted"):
            return  # not a checkpoint round: its record waits for the next checkpoint
        self.save()  # (1) the commit point
        for pending in self.uncommitted:  # (2) the results files follow the checkpoint
            self.inner.write_round(pending)
        self.uncommitted.clear()
        self.committed = rnd  # (3) sent with the next round's fit config

    def fit_config(self) -> dict[str, Any]:
        """Run-wide fit-config keys: ``committed-round`` (checkpointed runs) and ``run-lineage``."""
        out: dict[str, Any] = {} if self.committed is None else {COMMITTED_ROUND_KEY: self.committed}
        if self.announce_lineage:
            out["run-lineage"] = self.lineage  # client_state.LINEAGE_CONFIG_KEY
        return out

    def save(self) -> Path:
        assert self.run_dir is not None and self.strategy is not None
        return save_checkpoint(Path(self.run_dir) / CHECKPOINT_FILE, {
            "lineage": self.lineage, "config": self.run_values, "state": self.strategy.state_dict(),
            "rounds": list(self.rounds) + list(self.uncommitted),
        })

    def finish(self) -> None:
        done = int(self.resumed["state"]["round"]) if self.resumed else 0
        new = [r for r in self.rounds if int(r["round"]) > done]
        if self.resumed and self.run_dir is not None and not any((r["metrics"].get("clients_ok") or 0) > 0 for r in new):
            # the copied rounds trained, this process did not: a resume that cannot train has not finished (said in
            # the one final summary: the launcher ends a run on it)
            self.inner.finish(amend={"finished": False, "stopped_reason": (
                f"the resumed run aggregated no client update in rounds {done + 1}..{self.num_rounds} (every client "
                "refused or failed, e.g. privacy state lost)")})
        else:
            self.inner.finish()
        if self.on_end is not None and self.lineage:
            try:
                self.on_end(self.lineage, self.num_rounds)
            except OSError as exc:  # housekeeping after the results are complete: never a failed run
                from flwr.common.logger import log

                log(WARNING, "after the run: %s", exc)


def attach(strategy: Any, recorder: Any, *, run_values: Mapping[str, Any], general: GeneralConfig,
           deployment: DeploymentConfig, on_end: Callable[[str, int], object] | None = None) -> int:
    """Wire checkpointing and resume into a built strategy; returns the number of rounds Flower must
    still run. ``run_values``: the run-config by key (what a checkpoint stores). Raises ``ConfigError`` before
    anything is written. (The fault keys are checked by :func:`fedapp.config.check_fault_config`, called
    by the caller.) ``on_end(lineage, last_round)`` runs once the run has ended (the server app commits the
    clients' journals there: :func:`fedapp.state.client_state.compact_lineage`)."""
    from strategies.base import DPFLStrategy

    rounds = general.num_server_rounds
    resumed = None
    if deployment.resume_from:
        resumed = load_checkpoint(deployment.resume_from)
        check_resumable(run_values, rounds, resumed)
        remove_stale_temp(resumed["path"])  # left by a write the crash interrupted
    if not isinstance(strategy, DPFLStrategy):
        if resumed is not None:
            raise ConfigError(f"strategy {general.strategy!r} does not support resume-from (not a DPFLStrategy)")
        return rounds
    strategy.require_fit_clients(deployment.min_fit_clients)
    if resumed is not None:
        try:
            strategy.load_state_dict(resumed["state"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"run-config 'resume-from' = {resumed['path']!r}: cannot restore the strategy: "
                              f"{exc}") from None
    if recorder is not None:
        checkpointer = CheckpointingRecorder(recorder, run_values, rounds, deployment.checkpoint_every, strategy,
                                             resumed, on_end=on_end)
        strategy.record_with(checkpointer, checkpointer.fit_config)
    return rounds - strategy.round_offset
