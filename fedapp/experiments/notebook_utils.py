"""Helpers for the notebooks in ``notebooks/``: run a federation in this process, read a results folder.

:func:`run_federation` builds the *same* server components as ``fedapp.apps.server_app`` (registered
strategy, :class:`~fedapp.state.results.ResultsWriter`, pre-validation, checkpointing) and the same
per-node clients as ``fedapp.apps.client_app`` (family client wrapped by :func:`fedapp.clients.guard.guard_client`,
one persistent ``Context`` per node), and drives them with Flower's in-process ``Server`` loop.
It skips only the transport (Ray actors / gRPC), which on a 2-core machine costs more than a
small digits run itself; ``flwr run`` / ``run_simulation`` give the same results folder.
Privacy is unchanged: every client runs its family's mechanism and accountant as in a deployment.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.client import Client
from flwr.common import Context, RecordDict
from flwr.server import Server, SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedapp.apps.server_app import build_components
from fedapp.clients.guard import guard_client
from fedapp.config import resolve_config
from fedapp.registry import get_spec
from strategies.privacy.threat_models import Level


class _NodeProxy(ClientProxy):
    """One simulated node: builds its client from the persistent ``Context`` on every call (as Flower does)."""

    def __init__(self, node_id: int, num_nodes: int, overrides: dict[str, Any]) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id
        self.overrides = overrides
        self.context = Context(run_id=0, node_id=node_id, state=RecordDict(), run_config={},
                               node_config={"partition-id": node_id, "num-partitions": num_nodes})

    def _client(self) -> Client:
        cfg = resolve_config(self.context.run_config, self.overrides)
        inner = get_spec(cfg.general.strategy).client(self.context, self.overrides)
        return guard_client(inner, self.context, cfg.general, cfg.data, cfg.training, cfg.deployment)

    def fit(self, ins, timeout, group_id):
        return self._client().fit(ins)

    def evaluate(self, ins, timeout, group_id):
        return self._client().evaluate(ins)

    def get_parameters(self, ins, timeout, group_id):
        return self._client().get_parameters(ins)

    def get_properties(self, ins, timeout, group_id):
        return self._client().get_properties(ins)

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover - not used in-process
        raise NotImplementedError


def run_federation(overrides: dict[str, Any], num_clients: int = 4) -> Path:
    """Run one federation of ``num_clients`` nodes with run-config ``overrides``; return its results folder.

    The config is validated (``ConfigError`` naming the value) before anything trains or is written.
    """
    if num_clients < 2:
        raise ValueError(f"num_clients = {num_clients}: a federation needs at least 2 clients")
    overrides = dict(overrides)
    if get_spec(str(overrides.get("strategy", resolve_config()["strategy"]))).level is Level.CLIENT:
        # no transport, so no SecAgg+: client-level DP then plans its budget for what the server sees (one update)
        overrides.setdefault("secure-aggregation", False)
    cfg = resolve_config(None, overrides)
    components = build_components(cfg, transport=False)  # in-process: no SecAgg+
    strategy = components.strategy
    manager = SimpleClientManager()
    for node in range(num_clients):
        manager.register(_NodeProxy(node, num_clients, overrides))
    server = Server(client_manager=manager, strategy=strategy)
    server.set_max_workers(1)
    server.fit(num_rounds=components.config.num_rounds, timeout=None)
    run_dir = getattr(strategy.recorder, "run_dir", None)
    if run_dir is None:
        raise RuntimeError("the run wrote no results folder (no round completed)")
    return Path(run_dir)


def latest_run(output_dir: str | Path, strategy: str | None = None) -> Path:
    """Newest run folder under ``output_dir`` (optionally of one strategy), e.g. after ``flwr run``."""
    runs = [p for p in Path(output_dir).iterdir() if (p / "rounds.jsonl").exists()]
    if strategy is not None:
        runs = [p for p in runs if load_config(p).get("strategy") == strategy]
    if not runs:
        raise FileNotFoundError(f"no run folder with rounds.jsonl under {output_dir!s}"
                                + (f" for strategy {strategy!r}" if strategy else ""))
    return max(runs, key=lambda p: (p / "config.json").stat().st_mtime)


def load_rounds(run_dir: str | Path) -> list[dict[str, Any]]:
    """The round records of ``rounds.jsonl`` (one dict per round)."""
    with open(Path(run_dir) / "rounds.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))


def load_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved run-config saved in ``config.json``."""
    return json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))["config"]


def series(rounds: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(round, value) of round metric ``key`` for the rounds that have it."""
    xs, ys = [], []
    for r in rounds:
        v = r["metrics"].get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["round"]))
            ys.append(float(v))
    return xs, ys


def cumulative_uplink(rounds: Iterable[dict[str, Any]]) -> list[int]:
    """Cumulative uplink bytes (all clients, serialized payloads) after each round."""
    total, out = 0, []
    for r in rounds:
        total += int(sum(c.get("uplink_bytes") or 0 for c in r["clients"]))
        out.append(total)
    return out


def show(fig: Any) -> None:
    """Display ``fig`` inline and close it. Explicit, because ``fedapp.state.results`` switches pyplot to Agg
    when a run writes its own plots, after which ``plt.show()`` displays nothing in a notebook."""
    import matplotlib.pyplot as plt

    try:
        from IPython.display import display
    except ImportError:  # plain Python: nothing to display on
        plt.close(fig)
        return
    display(fig)
    plt.close(fig)


def client_field(rounds: Iterable[dict[str, Any]], field: str) -> dict[int, list[tuple[int, float]]]:
    """Per client id: (round, value) of a client-record field, e.g. ``aggregation_weight``."""
    out: dict[int, list[tuple[int, float]]] = {}
    for r in rounds:
        for c in r["clients"]:
            v = c.get(field)
            if c.get("client_id") is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(int(c["client_id"]), []).append((int(r["round"]), float(v)))
    return out
