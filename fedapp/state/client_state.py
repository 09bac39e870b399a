"""Client-side privacy state that must survive a restart, committed in step with the server.

A client's privacy state (Opacus accountant history, SoteriaFL shifts, DP2-FedSAM personal
heads) lives in Flower ``Context.state``, which a *new* run starts empty. :class:`ClientStateStore`
journals it under ``<dir>/<run-lineage>/client-<id>/`` (``client-state-dir`` or node-config
``state-dir``; by default ``<output-dir>/.client-state``): the state of the last round the server
*committed* (its checkpoint is durable, announced by the fit-config key ``committed-round``) plus
one pending entry per later round (state, released reply, request digest). A resumed run replays
the released replies of the same requests and otherwise trains afresh from the committed training
state while keeping the newest privacy spend — see the class docstring and ``docs/deployment.md``. A
client keeps at most ``checkpoint-every`` + 1 pending entries per run; when a run ends, the server commits
every journal on its own disk (:func:`compact_lineage`), so a finished run keeps no released update.

Without a journal, a client that lost its accountant must not restart its ε at zero:
:func:`lost_accountant_reason` compares the ε it reports with the server's ledger
(``dp-ledger``, read by :func:`ledger_epsilon`), and :class:`fedapp.clients.guard.GuardedClient` then
withholds the update, replies ``status="refused"`` and refuses every later round of that run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.config import GeneralConfig
from fedapp.state.checkpoint import COMMITTED_ROUND_KEY, fsync_dir, load_checkpoint, save_checkpoint

#: fit-config key carrying the run lineage (the original results folder name) to the clients
LINEAGE_CONFIG_KEY = "run-lineage"
#: the journal's folder under ``output-dir`` when neither ``client-state-dir`` nor node-config ``state-dir`` is set
DEFAULT_STATE_SUBDIR = ".client-state"


def default_state_dir(general: GeneralConfig) -> str:
    """Where clients journal their state when neither ``client-state-dir`` nor ``state-dir`` is set."""
    return str(Path(general.output_dir) / DEFAULT_STATE_SUBDIR)


def lineage_folder(root: Path, lineage: str) -> Path:
    """``<root>/<lineage>`` with the lineage reduced to a safe folder name."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in lineage) or "default"
    return root / safe


def _record_to_dict(record: Any) -> tuple[str, Any]:
    from flwr.common import ArrayRecord, ConfigRecord, MetricRecord

    if isinstance(record, ArrayRecord):
        return "arrays", {k: record[k].numpy() for k in record}
    if isinstance(record, ConfigRecord):
        values = {k: (list(v) if isinstance(v, list) else v) for k, v in record.items()}
        if any(isinstance(x, bytes) for v in values.values() for x in (v if isinstance(v, list) else [v])):
            raise TypeError("a config record with bytes is not persisted (JSON document)")
        return "config", values
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


#: ``Context.state`` records that are *training* state and roll back to the committed round on resume;
#: every other record (accountants, the lost-state taint, unknown records) keeps its newest value, so a
#: privacy spend is never rolled back
TRAINING_RECORDS = frozenset({"soteriafl-arrays", "dp2-head"})
#: fit-config keys left out of a round's digest (they legitimately differ between a run and its resume)
_VOLATILE_KEYS = frozenset({"dp-ledger", COMMITTED_ROUND_KEY})  # "dp-ledger" = strategies.base.LEDGER_CONFIG_KEY


def fit_digest(ins: Any) -> str:
    """SHA-256 of what a fit depends on: the global parameters and the fit config (minus volatile keys)."""
    h = hashlib.sha256(str(ins.parameters.tensor_type).encode())
    for tensor in ins.parameters.tensors:
        h.update(len(tensor).to_bytes(8, "little"))
        h.update(tensor)
    config = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in ins.config.items() if k not in _VOLATILE_KEYS}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()


def reply_to_dict(res: Any) -> dict[str, Any] | None:
    """A ``FitRes`` as checkpoint payload (None when its metrics are not JSON values, e.g. bytes)."""
    metrics = dict(res.metrics)
    if any(not isinstance(v, (int, float, str, bool)) for v in metrics.values()):
        return None
    return {"code": int(res.status.code.value), "message": str(res.status.message),
            "tensors": [np.frombuffer(t, dtype=np.uint8).copy() for t in res.parameters.tensors],
            "tensor_type": str(res.parameters.tensor_type), "num_examples": int(res.num_examples),
            "metrics": metrics}


def dict_to_reply(doc: Mapping[str, Any]) -> Any:
    from flwr.common import Code, FitRes, Parameters, Status

    params = Parameters(tensors=[np.asarray(t, dtype=np.uint8).tobytes() for t in doc["tensors"]],
                        tensor_type=str(doc["tensor_type"]))
    return FitRes(status=Status(Code(int(doc["code"])), str(doc["message"])), parameters=params,
                  num_examples=int(doc["num_examples"]), metrics=dict(doc["metrics"]))


#: Context.state records that must never reach the disk: SecAgg+'s per-round protocol state holds the
#: client's secret keys and mask seeds (and is rebuilt every round), and its byte counter is per round
EPHEMERAL_RECORDS = frozenset({"secaggplus_state", "dpfl-secagg-bytes"})


def state_to_payload(state: Any, skipped: list[str] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    for name in list(state.keys()):
        if name in EPHEMERAL_RECORDS:
            continue
        try:
            kind, values = _record_to_dict(state[name])
        except TypeError:
            if skipped is not None:
                skipped.append(name)
            continue
        payload[name] = {"kind": kind, "values": values}
    return payload


def load_payload(state: Any, payload: Mapping[str, Any]) -> None:
    """Replace ``state``'s records by ``payload``'s."""
    for name in list(state.keys()):
        del state[name]
    for name, rec in payload.items():
        state[name] = _dict_to_record(rec["kind"], rec["values"])


@dataclass
class ClientStateStore:
    """One client's ``Context.state`` journal under ``<root>/<lineage>/client-<id>/``.

    ``committed.npz`` holds the state after the last round the server confirmed (its checkpoint is
    durable: ``committed-round``); ``pending-<r>.npz`` holds, for every later round r this client
    answered, the state after r, the reply it released and the digest of the request. On resume the
    server re-asks those rounds: a request with the same digest gets the *same* reply again (a repeat
    of a released output costs no privacy) and the state moves to that round's; a different request
    means the released rounds were discarded by the crash: the client trains afresh from the
    committed training state, but keeps the newest privacy records (the spend of a released update
    is never rolled back). All files are written atomically (:func:`save_checkpoint`).
    """

    root: Path
    client_id: int
    skipped: list[str] = field(default_factory=list)

    def path(self, lineage: str) -> Path:
        """This client's folder for ``lineage``."""
        return lineage_folder(self.root, lineage) / f"client-{self.client_id}"

    def _committed(self, lineage: str) -> Path:
        return self.path(lineage) / "committed.npz"

    def _pending(self, lineage: str) -> dict[int, Path]:
        folder = self.path(lineage)
        out = {}
        for p in folder.glob("pending-*.npz") if folder.is_dir() else []:
            try:
                out[int(p.stem.split("-", 1)[1])] = p
            except ValueError:
                continue
        return dict(sorted(out.items()))

    def _load(self, path: Path) -> dict[str, Any]:
        doc = load_checkpoint(path)
        if int(doc.get("client_id", -1)) != self.client_id:
            raise ValueError(f"{path} holds the state of client {doc.get('client_id')}, not {self.client_id}")
        return doc

    def restore(self, state: Any, lineage: str) -> bool:
        """Fill an *empty* ``state`` with the committed state; True when there was a journal to restore."""
        folder = self.path(lineage)
        for stale in folder.glob(".*.tmp") if folder.is_dir() else []:
            stale.unlink(missing_ok=True)  # left by a save a crash interrupted
        if len(list(state.keys())):
            return False
        committed = self._committed(lineage)
        if committed.is_file():
            load_payload(state, self._load(committed)["records"])
        return committed.is_file() or bool(self._pending(lineage))

    def commit(self, lineage: str, committed_round: int) -> int:
        """Promote the newest pending round ≤ ``committed_round`` to ``committed.npz`` (its records, not its
        reply); drop it and older ones. Returns how many pending entries were dropped."""
        done = [r for r in self._pending(lineage) if r <= committed_round]
        if not done:
            return 0
        pending = self._pending(lineage)
        doc = self._load(pending[done[-1]])
        save_checkpoint(self._committed(lineage), {"client_id": self.client_id, "round": done[-1],
                                                   "records": doc["records"]})
        for r in done:
            pending[r].unlink(missing_ok=True)
        fsync_dir(self.path(lineage))
        return len(done)

    def replay(self, state: Any, lineage: str, rnd: int, digest: str) -> Any:
        """The reply released for the same request ``(rnd, digest)`` before a crash, with ``state`` moved to
        that round's; None when there is none. Otherwise rounds ≥ ``rnd`` that were released for other
        requests are discarded, their newest non-training records kept in ``state`` (see class doc)."""
        later = {r: p for r, p in self._pending(lineage).items() if r >= rnd}
        if not later:
            return None
        doc = self._load(later[rnd]) if rnd in later else None
        if doc is not None and doc.get("digest") == digest and doc.get("reply") is not None:
            load_payload(state, doc["records"])
            return dict_to_reply(doc["reply"])
        newest = self._load(later[max(later)])["records"]
        keep = {name: rec for name, rec in state_to_payload(state).items() if name in TRAINING_RECORDS}
        merged = {**state_to_payload(state), **{k: v for k, v in newest.items() if k not in TRAINING_RECORDS},
                  **keep}
        load_payload(state, merged)
        return None

    def record(self, state: Any, lineage: str, rnd: int, digest: str, reply: Any) -> Path:
        """Journal round ``rnd``: the state after it, the released reply and the request digest; later
        pending rounds (released for requests that no longer exist) are dropped — their spend is in ``state``."""
        folder = self.path(lineage)
        folder.mkdir(parents=True, exist_ok=True)
        path = save_checkpoint(folder / f"pending-{rnd}.npz", {
            "client_id": self.client_id, "round": rnd, "digest": digest, "reply": reply_to_dict(reply),
            "records": state_to_payload(state, self.skipped)})
        for r, p in self._pending(lineage).items():
            if r > rnd:
                p.unlink(missing_ok=True)
        return path


def compact_lineage(root: Path, lineage: str, final_round: int) -> int:
    """Commit every client journal of a run that ended at ``final_round``; returns the pending files removed.

    A pending entry holds the client's released reply (a model-sized update) until the client is asked
    again and learns the committed round; a client not sampled again would keep it for good, so a run over
    N clients would leave N updates on disk. Once the run has ended no round can be re-asked (a resume of an
    ended run is refused), so the server, when the journal is on its disk (simulation, or a shared
    ``client-state-dir``), promotes each client's newest pending state — its newest privacy records — to
    ``committed.npz`` without the reply, exactly as the client itself would on ``committed-round``.
    """
    folder = lineage_folder(root, lineage)
    removed = 0
    for client in sorted(folder.glob("client-*")) if folder.is_dir() else []:
        try:
            store = ClientStateStore(root, int(client.name.split("-", 1)[1]))
        except ValueError:
            continue
        try:
            removed += store.commit(lineage, final_round)
        except (OSError, ValueError) as exc:  # ConfigError is a ValueError: an unreadable entry stays as it is
            from flwr.common.logger import log

            log(WARNING, "client journal %s left uncommitted: %s", client, exc)
    return removed


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
