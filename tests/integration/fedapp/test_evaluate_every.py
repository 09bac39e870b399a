"""``evaluate-every``: the global model is evaluated (server test set and federated evaluation) every k rounds
and after the last, and the run's summary still reads its final figures from the last round."""
from __future__ import annotations

import json


def test_the_model_is_evaluated_every_k_rounds_and_after_the_last(tmp_path):
    from fedapp.experiments import notebook_utils as nbu

    run = nbu.run_federation({"strategy": "dpsgd-fedavg", "num-server-rounds": 5, "evaluate-every": 2,
                              "output-dir": str(tmp_path / "out"), "max-samples": 300, "validation-fraction": 0.2,
                              "seeded-noise": True}, num_clients=3)
    rounds = nbu.load_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    evaluated = [r["round"] for r in rounds if "accuracy" in r["metrics"]]
    assert evaluated == [2, 4, 5]
    assert [r["round"] for r in rounds if "client_val_accuracy" in r["metrics"]] == [2, 4, 5]
    assert all(r["metrics"].get("clients_ok") == 3 for r in rounds)  # every round still trains
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_accuracy"] == rounds[-1]["metrics"]["accuracy"]
    assert summary["best_round"] in evaluated
