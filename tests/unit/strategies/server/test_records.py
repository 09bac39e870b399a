"""Round records: federated-evaluation metrics do not depend on the order in which clients reply."""
from __future__ import annotations

import itertools

import numpy as np

from strategies.server.records import client_evaluation


def test_client_evaluation_is_the_same_in_every_reply_order() -> None:
    # 0.1 + 0.2 + 0.3 differs from 0.3 + 0.2 + 0.1 in float64: a plain running mean gives either value
    results = [(1.1, 10, {"accuracy": 0.1, "val_accuracy": 0.7, "val_loss": 0.3}),
               (2.2, 10, {"accuracy": 0.2, "val_accuracy": 0.1, "val_loss": 0.2}),
               (3.3, 10, {"accuracy": 0.3, "val_accuracy": 0.2, "val_loss": 0.1})]
    assert 0.1 + 0.2 + 0.3 != 0.3 + 0.2 + 0.1
    outcomes = {repr(client_evaluation(list(p))) for p in itertools.permutations(results)}
    assert len(outcomes) == 1
    loss, metrics = client_evaluation(results)
    assert np.isclose(loss, 2.2)
    assert np.isclose(metrics["client_accuracy"], 0.2)
    assert np.isclose(metrics["client_accuracy_std"], np.std([0.1, 0.2, 0.3]))


def test_clients_without_a_test_split_or_with_invalid_metrics_are_left_out() -> None:
    loss, metrics = client_evaluation([(0.0, 0, {"accuracy": 1.5}), (float("nan"), 5, {"accuracy": 0.5}),
                                       (0.4, 5, {"accuracy": 0.25})])
    assert loss == 0.4
    assert metrics["client_accuracy"] == 0.375
    assert "client_val_accuracy" not in metrics
