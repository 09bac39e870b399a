"""secaggmodel: a Flower ServerApp running dpfl-flower's DP-FedAvg (client-level DP) under SecAgg+."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import torch
from flwr.common import Context, log
from flwr.serverapp import Grid, ServerApp

from fedapp.library import JsonRecorder, Rounds, central_evaluation, dp_fedavg, run_secure_aggregation
from secaggmodel.settings import mechanism, secagg_settings
from secaggmodel.task import Net, load_centralized_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    num_rounds = int(cfg["num-server-rounds"])
    folder = Path(str(cfg["output-dir"])).expanduser().resolve() / f"run-{context.run_id}"
    torch.manual_seed(0)
    mech = mechanism(cfg)
    rounds = Rounds(num_rounds=num_rounds, min_available_clients=mech.num_clients,
                    clients_per_round=int(cfg["clients-per-round"]))
    strategy = dp_fedavg(Net(), rounds, mech, secagg=secagg_settings(cfg),
                         evaluate_fn=central_evaluation(Net(), load_centralized_test()), recorder=JsonRecorder(folder))
    log(INFO, "secaggmodel: %s under SecAgg+ (sigma = %.4f for the sum of r = %d); results in %s", strategy.name,
        mech.noise_multiplier, mech.clients_per_round, folder)
    run_secure_aggregation(grid, context, strategy)
