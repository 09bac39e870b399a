"""ownmodel: a Flower ClientApp whose client is dpfl-flower's DP-SGD client around your model and data."""

from __future__ import annotations

from flwr.client import Client
from flwr.clientapp import ClientApp
from flwr.common import Context
from torch import nn

from fedapp.library import dpsgd_client
from ownmodel.settings import dpsgd_settings
from ownmodel.task import Net, load_data


def client_fn(context: Context) -> Client:
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    cfg = context.run_config
    trainloader, testloader = load_data(partition_id, num_partitions, int(cfg["batch-size"]))
    # heterogeneous budgets: ε_i spread evenly over [epsilon-min, epsilon-max] by partition id
    lo, hi = float(cfg["epsilon-min"]), float(cfg["epsilon-max"])
    epsilon = lo + (hi - lo) * partition_id / max(num_partitions - 1, 1)
    return dpsgd_client(Net(), trainloader, testloader, context=context, settings=dpsgd_settings(cfg),
                        epsilon=epsilon, delta=float(cfg["delta"]), loss=nn.CrossEntropyLoss())


app = ClientApp(client_fn=client_fn)
