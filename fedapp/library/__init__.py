"""This project's strategies and DP clients as a library for a user's own Flower app (docs/library.md).

Server side (a ``ServerApp``): :func:`robust_hdp`, :func:`dpsgd_fedavg`, :func:`fedavg`, :func:`dp_fedavg` with
:func:`client_level_mechanism`, from :class:`Rounds` and :class:`DPSGDSettings`; :func:`central_evaluation` and
:class:`JsonRecorder` for evaluation and round records. Client side (a ``ClientApp``): :func:`dpsgd_client`
(record-level DP-SGD through Opacus, per-client (ε, δ)) and :func:`client_level_client` (client-level clip and noise),
around the user's ``nn.Module``, data and loss.
"""

from fedapp.library.clients import client_level_client, dpsgd_client
from fedapp.library.data import DataProblem
from fedapp.library.evaluation import ModelProblem
from fedapp.library.server import (
    JsonRecorder,
    central_evaluation,
    client_level_mechanism,
    dp_fedavg,
    dpsgd_fedavg,
    fedavg,
    robust_hdp,
)
from fedapp.library.settings import DPSGDSettings, Rounds

__all__ = ["DPSGDSettings", "DataProblem", "JsonRecorder", "ModelProblem", "Rounds", "central_evaluation",
           "client_level_client", "client_level_mechanism", "dp_fedavg", "dpsgd_client", "dpsgd_fedavg", "fedavg",
           "robust_hdp"]
