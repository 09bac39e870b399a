"""ownmodel: a Flower ServerApp (Message API) running dpfl-flower's Robust-HDP (or DPFedAvg) strategy."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import torch
from flwr.common import Context, log
from flwr.serverapp import Grid, ServerApp

from fedapp.library import JsonRecorder, MessageStrategy, Rounds, central_evaluation, dpsgd_fedavg, robust_hdp
from ownmodel.settings import dpsgd_settings
from ownmodel.task import Net, load_centralized_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    num_rounds = int(cfg["num-server-rounds"])
    folder = Path(str(cfg["output-dir"])).expanduser().resolve() / f"run-{context.run_id}"
    torch.manual_seed(0)
    rounds = Rounds(num_rounds=num_rounds, min_available_clients=int(cfg["min-clients"]))
    build = {"robust-hdp": robust_hdp, "dpsgd-fedavg": dpsgd_fedavg}[str(cfg["strategy"])]
    strategy = build(Net(), rounds, dpsgd_settings(cfg), evaluate_fn=central_evaluation(Net(), load_centralized_test()),
                     recorder=JsonRecorder(folder))
    log(INFO, "ownmodel: %s (%s); results in %s", strategy.name, strategy.privacy, folder)
    message_strategy = MessageStrategy(strategy)  # Flower's Message API: strategy.start(grid, ...)
    message_strategy.start(grid=grid, initial_arrays=message_strategy.initial_arrays(), num_rounds=num_rounds)
