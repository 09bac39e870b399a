"""This project's strategies and DP clients as a library for a user's own Flower app (docs/library.md).

Server side (a ``ServerApp``), from :class:`Rounds` and the family's settings or mechanism: record-level DP-SGD
(:class:`DPSGDSettings`) :func:`robust_hdp`, :func:`dpsgd_fedavg`, :func:`weiavg`, :func:`pfa`, :func:`min_eps`,
:func:`fedavg`; client-level (:func:`client_level_mechanism`) :func:`dp_fedavg`, :func:`fed_smp` (with
:func:`public_update` for top-k), :func:`sparse_fedavg`; :func:`dp_ftrl` (:func:`ftrl_mechanism`);
:func:`soteriafl` (:class:`SoteriaFLSettings`); :func:`dp2_fedsam` (:class:`DP2FedSAMSettings`);
:func:`central_evaluation` and :class:`JsonRecorder`. A builder's strategy runs under ``start_grid`` (Flower's
legacy API) or, wrapped in :class:`MessageStrategy`, with ``strategy.start(grid, ...)`` (the Message API). Client side (a ``ClientApp``), around the user's
``nn.Module``, data and loss: :func:`dpsgd_client`, :func:`client_level_client`, :func:`ftrl_client`,
:func:`soteriafl_client`, :func:`dp2_fedsam_client`.

Client-level DP under SecAgg+ (:class:`SecAggSettings`): :func:`client_level_mechanism` with
``secure_aggregation=True``, :func:`dp_fedavg` / :func:`fed_smp` with ``secagg=``, run by
:func:`run_secure_aggregation` in the ServerApp; :func:`client_level_client` with ``secagg=`` in a ClientApp whose
mods include :func:`secagg_mod`; :func:`secure_sum` gives the distributed discrete Gaussian both sides derive.
"""

from fedapp.library.clients import (
    client_level_client,
    dp2_fedsam_client,
    dpsgd_client,
    ftrl_client,
    soteriafl_client,
)
from fedapp.library.data import DataProblem
from fedapp.library.evaluation import ModelProblem
from fedapp.library.message_api import MessageStrategy
from fedapp.library.server import (
    JsonRecorder,
    SecureClientLevelStrategy,
    central_evaluation,
    client_level_mechanism,
    dp2_fedsam,
    dp_fedavg,
    dp_ftrl,
    dpsgd_fedavg,
    fed_smp,
    fedavg,
    ftrl_mechanism,
    min_eps,
    pfa,
    public_update,
    robust_hdp,
    run_secure_aggregation,
    secure_sum,
    soteriafl,
    sparse_fedavg,
    weiavg,
)
from fedapp.library.settings import DP2FedSAMSettings, DPSGDSettings, Rounds, SecAggSettings, SoteriaFLSettings
from fedapp.privacy.secure_aggregation import secagg_mod

__all__ = ["DP2FedSAMSettings", "DPSGDSettings", "DataProblem", "JsonRecorder", "MessageStrategy", "ModelProblem", "Rounds",
           "SecAggSettings", "SecureClientLevelStrategy", "SoteriaFLSettings", "central_evaluation",
           "client_level_client", "client_level_mechanism", "dp2_fedsam", "dp2_fedsam_client", "dp_fedavg", "dp_ftrl",
           "dpsgd_client", "dpsgd_fedavg", "fed_smp", "fedavg", "ftrl_client", "ftrl_mechanism", "min_eps", "pfa",
           "public_update", "robust_hdp", "run_secure_aggregation", "secagg_mod", "secure_sum", "soteriafl",
           "soteriafl_client", "sparse_fedavg", "weiavg"]
