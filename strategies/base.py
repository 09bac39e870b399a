"""The Flower adapter of the round engine: ``DPFLStrategy`` converts Flower's messages, nothing else.

Protocol shared by every strategy of this library:

* the server sends the global model θ (``FitIns.parameters``) and a config dict that always
  carries ``server-round``; family strategies add their own keys (``fit_config``);
* a client returns its *update* Δ_i = θ_i − θ (or a family-specific encoding of it, decoded by
  ``decode_update``) and flat scalar metrics including ``client_id`` and ``status``;
* the server validates each update, computes aggregation weights, combines the updates and steps
  θ ← θ + server_lr · aggregate. A rejected or refused update is recorded, never averaged.

The round itself is :class:`~strategies.engine.RoundEngine`'s; families override its *hook* methods.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from strategies.engine import EvaluateFn, RoundEngine
from strategies.errors import ClientFailure
from strategies.hooks import CLIENT_STATUSES
from strategies.server.admission import ClientUpdate, Failure, Reply
from strategies.server.records import AGGREGATE_PHASE, CLIENT_FIELDS, FIT_PHASE, RoundRecorder
from strategies.server.validation import RejectedUpdate

__all__ = ["CLIENT_FIELDS", "CLIENT_STATUSES", "LEDGER_CONFIG_KEY", "ClientUpdate", "DPFLStrategy", "EvaluateFn",
           "RejectedUpdate", "Reply", "RoundRecorder", "StrategyContext", "fit_reply", "fit_failure"]

LEDGER_CONFIG_KEY = "dp-ledger"  # fit-config key: JSON {client_id: ε spent so far} from the server's ledger
#: how long configure_fit waits for ``min_available_clients`` (seconds): Flower's SimpleClientManager default
WAIT_FOR_CLIENTS_S = 86400


def wait_for_clients(client_manager: ClientManager, num_clients: int, timeout: float = WAIT_FOR_CLIENTS_S) -> bool:
    """Wait until ``num_clients`` are available (at most ``timeout`` seconds). Asks ``num_available()`` between
    waits of a second: the client manager of Flower's Grid compatibility layer (``start_grid``) registers SuperNodes
    when ``num_available``/``all``/``sample`` is called and otherwise only every 5 s, so ``wait_for`` alone held
    round 1 of every run for up to 5 s (3.3 s measured, docs/benchmarks.md)."""
    deadline = time.monotonic() + timeout
    while client_manager.num_available() < num_clients:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        client_manager.wait_for(num_clients, timeout=1)  # Flower's wait_for takes whole seconds
    return True


@dataclass
class StrategyContext:
    """What the Flower glue hands to a strategy factory."""

    initial_weights: list[np.ndarray]
    evaluate_fn: EvaluateFn | None = None
    recorder: RoundRecorder | None = None
    prevalidate: Callable[[int], None] | None = None  # called with the number of clients before round 1
    secure_aggregation: bool = False  # the server runs the fit step through SecAgg+ (client-level DP)
    extras: dict[str, Any] = field(default_factory=dict)


def fit_reply(proxy: ClientProxy, res: FitRes) -> Reply:
    """A Flower fit result as the engine reads it (the payload is decoded only when the engine asks)."""
    return Reply(int(proxy.node_id), res.num_examples, dict(res.metrics), res.parameters.tensors,
                 lambda: parameters_to_ndarrays(res.parameters))


def fit_failure(failure: tuple[ClientProxy, FitRes] | BaseException) -> Failure:
    """A Flower fit failure: a reply with an error status, or an exception. A ClientApp's exception reaches the
    server as text only (``Message contains an Error (reason: <type>:<message>)``), so the client id it names
    is read back by :meth:`~strategies.errors.ClientFailure.client_id_in`, the one parser of that text."""
    if isinstance(failure, BaseException):
        return Failure(None, ClientFailure.client_id_in(failure), repr(failure))
    return Failure(int(failure[0].node_id), None, f"status {failure[1].status.code}")


class DPFLStrategy(RoundEngine, Strategy):
    """A Flower ``Strategy`` running :class:`RoundEngine`'s rounds."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    @staticmethod
    def sorted_clients(client_manager: ClientManager) -> list[ClientProxy]:
        clients = client_manager.all()
        return [clients[k] for k in sorted(clients, key=str)]

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.current_weights)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        server_round = self.actual_round(server_round)
        wait_for_clients(client_manager, self.min_available_clients)
        self.prepare_round(client_manager.num_available())
        self.flush_round()
        self.current_weights = [np.asarray(a, dtype=np.float32) for a in parameters_to_ndarrays(parameters)]
        proxies = self.sorted_clients(client_manager)
        self.open_round(server_round, client_manager.num_available(), {int(c.node_id) for c in proxies})
        by_node = {int(c.node_id): c for c in proxies}
        chosen = [by_node[n] for n in self.sample_clients(server_round, list(by_node))]
        config = self.round_fit_config(server_round)
        ledger = self.ledger_snapshot()  # once per round, not once per sampled node
        return [(c, FitIns(parameters, self.node_fit_config(config, int(c.node_id), ledger))) for c in chosen]

    def node_fit_config(self, config: Mapping[str, Scalar], node_id: int,
                        ledger: Mapping[int, float] | None = None) -> dict[str, Scalar]:
        """The fit config for one node, with the ε the server's ledger holds for it (``dp-ledger``).

        A node whose client the server already knows gets only its own entry, so the message does not
        grow with the federation; an unknown node (first contact, or a client restarted under a different
        node id) gets the whole ledger, so a client that lost its accountant is still caught.
        """
        out = {k: v for k, v in config.items() if k != LEDGER_CONFIG_KEY}
        ledger = self.ledger_snapshot() if ledger is None else ledger
        if not ledger:
            return out
        cid = self.identity.client_of.get(int(node_id))
        if cid is not None and cid not in ledger:
            return out
        entries = {cid: ledger[cid]} if cid is not None else ledger
        out[LEDGER_CONFIG_KEY] = json.dumps({str(k): v for k, v in sorted(entries.items())})
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> tuple[Parameters | None, dict[str, Scalar]]:
        self.round_log.mark(FIT_PHASE)
        with self.round_log.timed(AGGREGATE_PHASE):
            metrics = self.run_round(self.actual_round(server_round), [fit_reply(p, r) for p, r in results],
                                     [fit_failure(f) for f in failures])
        return ndarrays_to_parameters(self.current_weights), {k: v for k, v in metrics.items()
                                                              if isinstance(v, (int, float, str, bool))}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.evaluate_model(self.actual_round(server_round), parameters_to_ndarrays(parameters))

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        server_round = self.actual_round(server_round)
        if not self.evaluates(server_round):
            self.flush_round()
            return []
        nodes = self.sorted_clients(client_manager)
        config: dict[str, Scalar] = {"server-round": server_round, **self.evaluate_config(server_round)}
        return [(nodes[i], EvaluateIns(parameters, dict(config))) for i in self.evaluation_sample(server_round, len(nodes))]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[tuple[ClientProxy, EvaluateRes] | BaseException]) -> tuple[float | None, dict[str, Scalar]]:
        return self.record_client_evaluation([(r.loss, r.num_examples, r.metrics) for _, r in results])
