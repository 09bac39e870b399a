"""secaggmodel: a Flower ClientApp whose client is dpfl-flower's client-level DP client, sending its share of the
secure sum through SecAgg+ (the project's ``secagg_mod``)."""

from __future__ import annotations

from flwr.client import Client
from flwr.clientapp import ClientApp
from flwr.common import Context
from torch import nn

from fedapp.library import client_level_client, secagg_mod
from secaggmodel.settings import mechanism, secagg_settings
from secaggmodel.task import Net, load_data


def client_fn(context: Context) -> Client:
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    cfg = context.run_config
    if num_partitions != int(cfg["num-clients"]):
        raise ValueError(f"{num_partitions} SuperNodes but run-config num-clients = {cfg['num-clients']}: the "
                         "mechanism is planned for exactly num-clients clients")
    trainloader, testloader = load_data(partition_id, num_partitions, int(cfg["batch-size"]))
    return client_level_client(Net(), trainloader, testloader, context=context, mechanism=mechanism(cfg),
                               secagg=secagg_settings(cfg), lr=float(cfg["lr"]),
                               local_epochs=int(cfg["local-epochs"]), loss=nn.CrossEntropyLoss())


# secagg_mod: Flower's SecAgg+ client protocol for the fit rounds (evaluation passes through)
app = ClientApp(client_fn=client_fn, mods=[secagg_mod])
