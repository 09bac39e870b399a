"""Round records: federated-evaluation metrics do not depend on the order in which clients reply; where a round's
seconds went."""
from __future__ import annotations

import itertools
import time

import numpy as np

from strategies.server.records import RoundLog, client_evaluation


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


class _Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def open(self) -> None:
        pass

    def write_round(self, record: dict) -> None:
        self.records.append(record)

    def finish(self) -> None:
        pass


def test_round_seconds_mark_the_first_time_and_sum_timed_blocks() -> None:
    rec = _Recorder()
    log = RoundLog(rec)
    with log.timed("evaluate"):  # before any round: the initial model's evaluation is not a round's
        pass
    t0 = time.perf_counter()
    log.start(1)
    time.sleep(0.05)
    log.mark("fit")
    first_mark = time.perf_counter() - t0
    time.sleep(0.02)
    log.mark("fit")  # a second mark (a withheld round's re-entry) keeps the first
    blocks = []
    for _ in range(2):
        b0 = time.perf_counter()
        with log.timed("aggregate"):
            time.sleep(0.03)
        blocks.append(time.perf_counter() - b0)
    e0 = time.perf_counter()
    try:
        with log.timed("evaluate"):
            time.sleep(0.01)
            raise ValueError("an evaluation that fails still took its time")
    except ValueError:
        pass
    evaluate = time.perf_counter() - e0
    record = log.flush(num_rounds=1)
    assert record is rec.records[0]
    seconds = record["seconds"]
    assert set(seconds) == {"fit", "aggregate", "evaluate"}
    assert 0.05 <= seconds["fit"] <= first_mark  # the second mark came ≥ 0.02 s later and did not replace it
    assert 0.06 <= seconds["aggregate"] <= sum(blocks)
    assert 0.01 <= seconds["evaluate"] <= evaluate
    assert seconds["fit"] + seconds["aggregate"] + seconds["evaluate"] <= record["wall_seconds"]
    log.start(2)
    assert "seconds" not in log.flush(num_rounds=2)  # a round that marked nothing has no seconds
