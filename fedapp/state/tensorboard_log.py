"""Optional TensorBoard output of a run (run-config ``tensorboard = true``), written with tensorboardX.

Scalars, one step per round, in ``<run>/tensorboard/`` (``tensorboard --logdir results`` compares runs):

    accuracy/global, accuracy/clients_mean   global model on the held-out test set; mean client local test
    loss/global                              global model's test loss
    uplink_bytes/total                       bytes of every client reply in the round
    epsilon_spent/client_<id>                the server's cumulative ε of each client (3-digit ids)
    uplink_bytes/client_<id>                 each client's reply size in the round

Values that are missing or not finite are skipped. Events are flushed after every round, so a
crashed run keeps what it wrote.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SUBDIR = "tensorboard"
_ROUND_METRICS = (("accuracy", "accuracy/global"), ("client_accuracy", "accuracy/clients_mean"), ("loss", "loss/global"))
_CLIENT_FIELDS = (("epsilon_spent", "epsilon_spent"), ("uplink_bytes", "uplink_bytes"))


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The tag → value scalars of one ``rounds.jsonl`` record."""
    out: dict[str, float] = {}
    metrics = record.get("metrics") or {}
    for key, tag in _ROUND_METRICS:
        if (value := _finite(metrics.get(key))) is not None:
            out[tag] = value
    clients = record.get("clients") or []
    sizes = [v for c in clients if (v := _finite(c.get("uplink_bytes"))) is not None]
    if sizes:
        out["uplink_bytes/total"] = sum(sizes)
    for c in clients:
        if c.get("client_id") is None:
            continue
        for key, prefix in _CLIENT_FIELDS:
            if (value := _finite(c.get(key))) is not None:
                out[f"{prefix}/client_{int(c['client_id']):03d}"] = value
    return out


class TensorBoardWriter:
    """Writes each round record's scalars at step = round."""

    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = run_dir / SUBDIR
        self._writer = SummaryWriter(logdir=str(self.logdir))

    def write_round(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        for tag, value in round_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
