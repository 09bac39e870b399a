"""benchmarks/peer_pfl.py splits each side's steady round into local training, messages, aggregation, evaluation and
the rest, from the round records each side writes."""

from __future__ import annotations

import pytest

from benchmarks.peer_pfl import lanes_makespan, pfl_round_parts, report, round_parts, steady_parts


def _ours(wall: float, fit: float, aggregate: float, evaluate: float, train: list[float]) -> dict:
    """A ``rounds.jsonl`` record as the strategy writes it (only the fields the split reads)."""
    return {"round": 1, "wall_seconds": wall, "seconds": {"fit": fit, "aggregate": aggregate, "evaluate": evaluate},
            "clients": [{"client_id": i, "train_seconds": t} for i, t in enumerate(train)] + [
                {"client_id": 99, "train_seconds": None, "status": "failed"}]}


def test_trainings_are_packed_longest_first_on_the_lanes() -> None:
    assert lanes_makespan([0.6] * 5, 2) == pytest.approx(1.8)  # an odd cohort: one lane trains a third client alone
    assert lanes_makespan([0.6] * 4, 2) == pytest.approx(1.2)
    assert lanes_makespan([1.0, 0.4, 0.4, 0.3], 2) == pytest.approx(1.1)  # 1.0 | 0.4 + 0.4 + 0.3 = 1.1
    assert lanes_makespan([0.5, 0.2], 1) == pytest.approx(0.7)
    assert lanes_makespan([0.5, 0.2], 0) == pytest.approx(0.7)  # no lanes given: one


def test_our_round_is_split_into_parts_that_add_up_to_it() -> None:
    parts = round_parts(_ours(5.0, 3.6, 0.3, 0.7, [0.6] * 5), lanes=2)
    assert parts is not None
    assert parts["training"] == pytest.approx(1.8) and parts["train_work"] == pytest.approx(3.0)
    assert parts["messaging"] == pytest.approx(3.6 - 1.8)
    assert (parts["aggregation"], parts["evaluation"]) == (0.3, 0.7)
    assert parts["rest"] == pytest.approx(5.0 - 3.6 - 0.3 - 0.7)
    first_five = ("training", "messaging", "aggregation", "evaluation", "rest")
    assert sum(parts[k] for k in first_five) == pytest.approx(parts["round"]) == pytest.approx(5.0)
    assert round_parts({"round": 1, "wall_seconds": 5.0, "clients": []}, 2) is None  # a record without timings


def test_a_pfl_round_has_no_messages_and_its_aggregation_is_in_the_rest() -> None:
    parts = pfl_round_parts({"round": 2, "wall_seconds": 6.0, "train_seconds": [0.4] * 10, "evaluate_seconds": 0.9})
    assert parts is not None
    assert parts["training"] == pytest.approx(4.0) == pytest.approx(parts["train_work"])
    assert parts["messaging"] is None and parts["aggregation"] is None
    assert parts["rest"] == pytest.approx(6.0 - 4.0 - 0.9)
    assert pfl_round_parts({"round": 1, "wall_seconds": 6.0}) is None  # pfl_plain.py's records carry no timings


def test_steady_parts_average_rounds_two_on_and_need_every_round() -> None:
    rounds = [round_parts(_ours(9.0, 8.0, 0.3, 0.7, [2.0] * 4), 2),  # round 1: start-up in it, left out
              round_parts(_ours(4.0, 3.0, 0.3, 0.7, [0.6] * 4), 2),
              round_parts(_ours(5.0, 3.8, 0.4, 0.8, [0.6] * 5), 2)]
    steady = steady_parts(rounds)
    assert steady is not None
    assert steady["round"] == pytest.approx(4.5) and steady["training"] == pytest.approx((1.2 + 1.8) / 2)
    assert steady["evaluation"] == pytest.approx(0.75)
    assert steady_parts(rounds[:1]) == rounds[0]  # a 1-round run: its only round
    assert steady_parts([*rounds, None]) is None
    pfl = steady_parts([pfl_round_parts({"wall_seconds": 6.0, "train_seconds": [0.5], "evaluate_seconds": 1.0})] * 2)
    assert pfl is not None and pfl["messaging"] is None and pfl["rest"] == pytest.approx(4.5)


def _run(side: str, tag: str, parts: dict | None, lanes: int) -> dict:
    return {"side": side, "tag": tag, "wall": 50.0, "rounds_sum": 40.0, "round1": 8.0, "steady_median": 4.5,
            "peak_bytes": 1.4e9, "cpu_seconds": 90.0, "mean_clients": 10.0, "final_accuracy": 0.5, "parts": parts,
            "lanes": lanes, "peak_split": [], "processes": 1, "cohort_sizes": [10, 10]}


def test_the_report_tables_each_sides_parts() -> None:
    ours = steady_parts([round_parts(_ours(4.0, 3.0, 0.3, 0.7, [0.6] * 4), 2)])
    pfl = steady_parts([pfl_round_parts({"wall_seconds": 6.0, "train_seconds": [0.5], "evaluate_seconds": 1.0})])
    runs = [_run("ours/secagg", "1", ours, 2), _run("pfl", "1", pfl, 1), _run("pfl/plain", "1", None, 1)]
    settings = {"num_clients": 20, "partitioner": "iid", "client_sizes": [3000], "num_parameters": 28938,
                "clients_per_round": 10, "noise_multiplier": 1.0, "clip_norm": 1.0, "batch_size": 32,
                "local_epochs": 1, "lr": 0.05, "rounds": 2, "cohort_sizes": [10, 10]}
    text = "\n".join(report(runs, settings, show_split=False))
    assert "| part | ours/secagg (2 lanes) | pfl (1 lane) |" in text  # pfl/plain has no split: no column
    assert "| local training, on the side's lanes | 1.20 s | 0.50 s |" in text
    assert "| messages, SecAgg+ stages, client work outside the loop | 1.80 s | – |" in text
    assert "| round | 4.00 s | 6.00 s |" in text
