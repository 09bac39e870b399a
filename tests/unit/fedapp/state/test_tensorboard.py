"""TensorBoard output: ResultsWriter with ``tensorboard = true`` writes event files TensorBoard reads back."""

from __future__ import annotations

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedapp.state.results import ResultsWriter
from fedapp.state.tensorboard_log import SUBDIR, round_scalars


def _record(rnd: int, accuracy: float | None) -> dict:
    clients = [{"client_id": cid, "status": "ok", "epsilon_spent": 0.5 * rnd + cid, "uplink_bytes": 1000 + cid}
               for cid in (0, 1)]
    clients.append({"client_id": 2, "status": "refused", "epsilon_spent": math.inf, "uplink_bytes": None})
    return {"round": rnd, "wall_seconds": 0.1, "elapsed_seconds": 0.1 * rnd, "clients": clients,
            "metrics": {"accuracy": accuracy, "loss": 2.0 / rnd, "client_accuracy": 0.1 * rnd, "clients_ok": 2}}


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_round_scalars_are_read_back_by_tensorboard(tmp_path):
    writer = ResultsWriter(tmp_path, {"strategy": "fedavg", "dataset": "digits", "seed": 1, "tensorboard": True})
    writer.open()
    for rnd, acc in ((1, 0.5), (2, None), (3, 0.75)):  # round 2: no centralized accuracy
        writer.write_round(_record(rnd, acc))
    writer.finish()
    events = list((writer.run_dir / SUBDIR).glob("events.out.tfevents.*"))
    assert len(events) == 1
    got = _scalars(writer.run_dir / SUBDIR)
    assert set(got) == {"accuracy/global", "accuracy/clients_mean", "loss/global", "uplink_bytes/total",
                        "epsilon_spent/client_000", "epsilon_spent/client_001",
                        "uplink_bytes/client_000", "uplink_bytes/client_001"}  # client 2: inf ε, no bytes
    assert got["accuracy/global"] == [(1, 0.5), (3, 0.75)]
    assert got["loss/global"] == [(1, 2.0), (2, 1.0), (3, pytest.approx(2 / 3))]
    assert got["accuracy/clients_mean"] == [(r, pytest.approx(0.1 * r)) for r in (1, 2, 3)]
    assert got["epsilon_spent/client_001"] == [(r, 0.5 * r + 1) for r in (1, 2, 3)]
    assert got["uplink_bytes/client_001"] == [(r, 1001.0) for r in (1, 2, 3)]
    assert got["uplink_bytes/total"] == [(r, 2001.0) for r in (1, 2, 3)]


def test_off_by_default_writes_no_events(tmp_path):
    writer = ResultsWriter(tmp_path, {"strategy": "fedavg", "dataset": "digits", "seed": 1})
    writer.write_round(_record(1, 0.5))
    writer.finish()
    assert not (writer.run_dir / SUBDIR).exists() and writer.tensorboard is None


def test_round_scalars_skip_missing_and_non_finite_values():
    record = {"round": 1, "metrics": {"accuracy": math.nan, "loss": None}, "clients": [{"client_id": 7}]}
    assert round_scalars(record) == {}


def test_hf_dataset_name_makes_one_results_folder(tmp_path):
    writer = ResultsWriter(tmp_path, {"strategy": "fedavg", "dataset": "hf:org/name?label=y", "seed": 1})
    writer.open()
    assert writer.run_dir.parent == tmp_path and writer.run_dir.name.endswith("_fedavg_hf-org-name-label-y_s1")
