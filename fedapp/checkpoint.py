"""Server checkpoints, resume, and client-side state persistence.

Server side. After every ``checkpoint-every`` rounds (and the last) the results folder gets
``checkpoint.npz``, written atomically (temporary file + fsync + ``os.replace``): global
parameters, the strategy's :meth:`~strategies.base.DPFLStrategy.state_dict` (family state such
as SoteriaFL's shift or Robust-HDP's frozen weights via ``checkpoint_state``; the server's ε
ledger; every ``numpy.random.Generator`` attribute), the round number, the round records so far
and the run-config. No pickle: arrays are ``.npz`` members, everything else one JSON document,
so loading a hostile checkpoint cannot run code.

``resume-from=<checkpoint.npz or its run folder>`` continues the run: the strategy is restored,
Flower runs the remaining ``num-server-rounds − round`` rounds (numbered ``round+1 …``) and the
new results folder holds the *full* ledger (old rounds copied first); ``config.json`` says
where it resumed from. Keys that change the experiment must match the checkpoint
(:data:`RESUME_MAY_DIFFER` lists those that may differ).

Client side. A client's privacy state (Opacus accountant history, SoteriaFL shifts, DP2-FedSAM
personal heads) lives in Flower ``Context.state``, which a *new* run starts empty. With
``client-state-dir`` set, :class:`ClientStateStore` saves ``Context.state`` after every fit under
``<dir>/<run-lineage>/client-<id>.npz`` and restores it in a resumed run of the same lineage,
so ε keeps counting exactly. Without it, a client that lost its accountant must not restart
its ε at zero: :func:`lost_accountant_reason` compares the ε it reports with the server's
ledger (``dp-ledger``), and :class:`fedapp.faults.GuardedClient` then withholds the update,
replies ``status="refused"`` and refuses every later round of that run (privacy: nothing
computed on the un-accounted state ever leaves the client).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.config import ConfigError, RunConfig

CHECKPOINT_FILE = "checkpoint.npz"
FORMAT = "dpfl-checkpoint-v1"
LINEAGE_CONFIG_KEY = "run-lineage"
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


def save_checkpoint(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Atomically write ``payload`` (nested dicts/lists of JSON values and numpy arrays)."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    doc = _split({"format": FORMAT, **payload}, arrays)
    blob = np.frombuffer(json.dumps(doc).encode("utf-8"), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, __json__=blob, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
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


def check_resumable(cfg: RunConfig, ckpt: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` unless ``cfg`` may continue ``ckpt`` (same experiment, rounds left)."""
    saved = dict(ckpt.get("config") or {})
    for key, value in sorted(saved.items()):
        if key in RESUME_MAY_DIFFER or key not in cfg:
            continue
        if cfg[key] != value:
            raise ConfigError(f"run-config {key!r} = {cfg[key]!r} differs from the checkpoint's {value!r} "
                              f"({ckpt['path']}); a resumed run must be the same experiment")
    done = int(ckpt["state"]["round"])
    if done >= cfg.rounds:
        raise ConfigError(f"run-config 'num-server-rounds' = {cfg.rounds}: the checkpoint {ckpt['path']} already "
                          f"completed round {done}; nothing left to resume")


# ----------------------------------------------------------------------------- server glue
class CheckpointingRecorder:
    """A ``RoundRecorder`` that forwards to the results writer and checkpoints the strategy.

    On resume it first replays the checkpoint's round records into the new results folder, so
    ``rounds.jsonl`` of the resumed run is the complete ledger.
    """

    def __init__(self, inner: Any, cfg: RunConfig, strategy: Any = None,
                 resumed: Mapping[str, Any] | None = None) -> None:
        self.inner = inner
        self.cfg = cfg
        self.strategy = strategy
        self.resumed = resumed
        self.every = int(cfg["checkpoint-every"])
        self.lineage = str(resumed["lineage"]) if resumed else ""

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
        if not self.lineage:
            self.lineage = Path(self.inner.run_dir).name
        if self.strategy is not None:
            self.strategy.run_fit_config["run-lineage"] = self.lineage
        for record in (self.resumed or {}).get("rounds", []):
            self.inner.write_round(record)

    def write_round(self, record: dict[str, Any]) -> None:
        if self.run_dir is None:
            self.open()
        self.inner.write_round(record)
        rnd = int(record["round"])
        if self.strategy is not None and self.every > 0 and (rnd % self.every == 0 or rnd >= self.cfg.rounds):
            self.save()

    def save(self) -> Path:
        assert self.run_dir is not None and self.strategy is not None
        return save_checkpoint(Path(self.run_dir) / CHECKPOINT_FILE, {
            "lineage": self.lineage, "config": dict(self.cfg), "state": self.strategy.state_dict(),
            "rounds": list(self.rounds),
        })

    def finish(self) -> None:
        self.inner.finish()


def attach(strategy: Any, cfg: RunConfig, recorder: Any) -> int:
    """Wire checkpointing, resume and fault settings into a built strategy; returns the number of
    rounds Flower must still run. Raises ``ConfigError`` before anything is written."""
    from fedapp.faults import check_fault_config
    from strategies.base import DPFLStrategy

    check_fault_config(cfg)
    resumed = None
    if cfg["resume-from"]:
        resumed = load_checkpoint(cfg["resume-from"])
        check_resumable(cfg, resumed)
    if not isinstance(strategy, DPFLStrategy):
        if resumed is not None:
            raise ConfigError(f"strategy {cfg['strategy']!r} does not support resume-from (not a DPFLStrategy)")
        return cfg.rounds
    strategy.min_fit_clients = int(cfg["min-fit-clients"])
    if resumed is not None:
        try:
            strategy.load_state_dict(resumed["state"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"run-config 'resume-from' = {resumed['path']!r}: cannot restore the strategy: "
                              f"{exc}") from None
    if recorder is not None:
        strategy.recorder = CheckpointingRecorder(recorder, cfg, strategy, resumed)
    return cfg.rounds - strategy.round_offset


# ----------------------------------------------------------------------------- client side
def _record_to_dict(record: Any) -> tuple[str, Any]:
    from flwr.common import ArrayRecord, ConfigRecord, MetricRecord

    if isinstance(record, ArrayRecord):
        return "arrays", {k: record[k].numpy() for k in record}
    if isinstance(record, ConfigRecord):
        return "config", {k: (list(v) if isinstance(v, list) else v) for k, v in record.items()}
    if isinstance(record, MetricRecord):
        return "metrics", {k: (list(v) if isinstance(v, list) else v) for k, v in record.items()}
    raise TypeError(f"cannot persist a {type(record).__name__}")


def _dict_to_record(kind: str, values: Mapping[str, Any]) -> Any:
    from flwr.common import Array, ArrayRecord, ConfigRecord, MetricRecord

    if kind == "arrays":
        return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in values.items()})
    if kind == "config":
        return ConfigRecord(dict(values))
    if kind == "metrics":
        return MetricRecord(dict(values))
    raise ValueError(f"unknown record kind {kind!r}")


@dataclass
class ClientStateStore:
    """Persists one client's ``Context.state`` under ``<root>/<lineage>/client-<id>.npz``."""

    root: Path
    client_id: int
    skipped: list[str] = field(default_factory=list)

    def path(self, lineage: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in lineage) or "default"
        return self.root / safe / f"client-{self.client_id}.npz"

    def save(self, state: Any, lineage: str) -> Path:
        payload: dict[str, Any] = {}
        for name in list(state.keys()):
            try:
                kind, values = _record_to_dict(state[name])
            except TypeError:
                self.skipped.append(name)
                continue
            payload[name] = {"kind": kind, "values": values}
        path = self.path(lineage)
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_checkpoint(path, {"client_id": self.client_id, "records": payload})

    def restore(self, state: Any, lineage: str) -> bool:
        """Fill an *empty* ``state`` from disk; True when something was restored."""
        path = self.path(lineage)
        if len(list(state.keys())) or not path.is_file():
            return False
        doc = load_checkpoint(path)
        if int(doc.get("client_id", -1)) != self.client_id:
            raise ValueError(f"{path} holds the state of client {doc.get('client_id')}, not {self.client_id}")
        for name, rec in doc["records"].items():
            state[name] = _dict_to_record(rec["kind"], rec["values"])
        return True


def ledger_epsilon(config: Mapping[str, Any], client_id: int) -> float | None:
    """ε this client reported in earlier rounds, from the server's ``dp-ledger`` fit-config entry."""
    from strategies.base import LEDGER_CONFIG_KEY

    raw = config.get(LEDGER_CONFIG_KEY)
    if not raw:
        return None
    try:
        value = json.loads(raw).get(str(client_id))
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def lost_accountant_reason(reported: Any, ledger: float | None, rel_tol: float = 1e-9) -> str | None:
    """Refusal reason when a client that trained reports ε not above what it had already spent.

    Every DP round adds privacy loss, so after training the cumulative ε must exceed the ledger's
    value; a value at or below it means the accountant restarted (state lost).
    """
    if ledger is None or ledger <= 0 or reported is None:
        return None
    try:
        eps = float(reported)
    except (TypeError, ValueError):
        return None
    if eps <= ledger * (1 + rel_tol):
        return (f"privacy state lost: after training this client's accountant reports epsilon={eps:.6g}, but the "
                f"server ledger records epsilon={ledger:.6g} already spent; refusing (update withheld) rather than "
                "restarting the spent epsilon at zero")
    return None
