"""This project's strategies in Flower's Message API (since Flower 1.21): :class:`MessageStrategy` is a
``flwr.serverapp.strategy.Strategy``, so a ServerApp written the way ``flwr new`` writes one starts any of them with
``strategy.start(grid, initial_arrays, num_rounds)``.

It adapts the round engine's legacy face (``configure_fit`` / ``aggregate_fit`` on a ``ClientManager``, which
:func:`flwr.server.compat.start_grid` drives) and keeps the legacy server's order within a round: sample and train,
aggregate, evaluate the global model centrally, then federated evaluation. Messages carry Flower's legacy record layout
(``flwr.compat.common.recorddict_compat``), so the clients are the library's ClientApps unchanged. A sampled node that
does not reply, or replies with an error, is a failure of that round (what the legacy server reports for a timeout):
the engine strikes and accounts it as it does under ``start_grid``.

Not for SecAgg+: Flower's SecAgg+ exists only as a legacy workflow (1.41-1.42), so a strategy built with ``secagg=``
still runs with :func:`fedapp.library.run_secure_aggregation`; wrapping one is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.app.message_type import MessageType
from flwr.common import log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedapp.compat import surface
from strategies.base import DPFLStrategy


class MessageStrategy(Strategy):
    """``strategy`` (one of :mod:`fedapp.library`'s builders, not built for SecAgg+) as a Message-API strategy."""

    def __init__(self, strategy: DPFLStrategy) -> None:
        if getattr(strategy, "secure_aggregation", False):
            raise ValueError(f"strategy {strategy.name!r} was built for SecAgg+ (secagg=...), which Flower runs only as "
                             "a legacy workflow: run it with fedapp.library.run_secure_aggregation, not "
                             "MessageStrategy")
        surface.require("message-api")  # the legacy records and proxies it builds (fedapp.compat.surface)
        self.strategy = strategy
        self._manager = SimpleClientManager()
        self._proxies: dict[int, GridClientProxy] = {}
        self._sampled: list[int] = []
        self._started = False

    def initial_arrays(self) -> ArrayRecord:
        """The strategy's initial model, for ``start(grid, initial_arrays=...)``."""
        return ArrayRecord([np.asarray(w) for w in self.strategy.current_weights])

    # ------------------------------------------------------------------ nodes
    def _nodes(self, grid: Grid) -> SimpleClientManager:
        """The grid's nodes as the ``ClientManager`` the engine samples from (the registration ``start_grid`` does)."""
        live = set(grid.get_node_ids())
        for node_id in set(self._proxies) - live:
            self._manager.unregister(self._proxies.pop(node_id))
        for node_id in sorted(live - set(self._proxies)):
            proxy = GridClientProxy(node_id=node_id, grid=grid, run_id=grid.run.run_id)
            self._manager.register(proxy)
            self._proxies[node_id] = proxy
        return self._manager

    @staticmethod
    def _refuse_config(config: ConfigRecord, step: str) -> None:
        if len(config):
            raise ValueError(f"start(..., {step}_config={dict(config)!r}): the strategy sends its own round config "
                             "(its Rounds and settings); a config passed to start would be ignored, so it is refused")

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._refuse_config(config, "train")
        parameters = ndarrays_to_parameters(arrays.to_numpy_ndarrays())
        if not self._started:  # the legacy server evaluates the initial model before round 1
            self._started = True
            self.strategy.evaluate(0, parameters)
        chosen = self.strategy.configure_fit(server_round, parameters, self._nodes(grid))
        self._sampled = [int(proxy.node_id) for proxy, _ in chosen]
        return [Message(content=compat.fitins_to_recorddict(ins, keep_input=True), message_type=MessageType.TRAIN,
                        dst_node_id=int(proxy.node_id)) for proxy, ins in chosen]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        results: list[Any] = []
        failures: list[Any] = []
        answered: set[int] = set()
        for reply in replies:
            node_id = int(reply.metadata.src_node_id)
            answered.add(node_id)
            if reply.has_error():
                failures.append(RuntimeError(f"node {node_id}: {reply.error.reason}"))
            else:
                results.append((self._proxies[node_id], compat.recorddict_to_fitres(reply.content, keep_input=False)))
        failures += [TimeoutError(f"node {n} sent no reply") for n in self._sampled if n not in answered]
        parameters, metrics = self.strategy.aggregate_fit(server_round, results, failures)
        if parameters is None:
            return None, None
        self.strategy.evaluate(server_round, parameters)  # central evaluation: the legacy server's order
        return ArrayRecord(parameters_to_ndarrays(parameters)), _metric_record(metrics)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self._refuse_config(config, "evaluate")
        parameters = ndarrays_to_parameters(arrays.to_numpy_ndarrays())
        chosen = self.strategy.configure_evaluate(server_round, parameters, self._nodes(grid))
        return [Message(content=compat.evaluateins_to_recorddict(ins, keep_input=True),
                        message_type=MessageType.EVALUATE, dst_node_id=int(proxy.node_id)) for proxy, ins in chosen]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        results: list[tuple[Any, Any]] = [(self._proxies[int(r.metadata.src_node_id)],
                                            compat.recorddict_to_evaluateres(r.content))
                                           for r in replies if not r.has_error()]
        loss, metrics = self.strategy.aggregate_evaluate(server_round, results, [])
        return _metric_record({**({"loss": loss} if loss is not None else {}), **metrics})

    def summary(self) -> None:
        log(INFO, "\t└──> %s (%s): this project's round engine through Flower's Message API",
            self.strategy.name, getattr(self.strategy, "privacy", ""))


def _metric_record(metrics: dict[str, Any]) -> MetricRecord | None:
    """The numeric entries of ``metrics`` (a MetricRecord holds numbers only; the round record keeps the rest)."""
    numbers: dict[str, int | float | list[int] | list[float]] = {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return MetricRecord(numbers) if numbers else None
