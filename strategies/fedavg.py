"""FedAvg (McMahan et al. 2017) and DPFedAvg of Noble et al. (2022): w_i ∝ N_i.

``fedavg``: non-private clients (plain SGD) — no formal privacy.
``dpsgd-fedavg``: every client runs record-level DP-SGD with its own (ε_i, δ_i) (local DP
against an untrusted server, Robust-HDP Sec. 2); the server averages updates with weights
proportional to dataset sizes N_i. The server adds no noise, so its output is post-processing
of already-private updates.
"""

from __future__ import annotations

from typing import Any

from strategies.base import DPFLStrategy
from strategies.privacy import threat_models
from strategies.robust_hdp import OracleDiagnostics


class FedAvg(DPFLStrategy):
    """w_i ∝ N_i over non-private updates."""

    name = "fedavg"
    privacy = threat_models.NONE


class DPSGDFedAvg(OracleDiagnostics, DPFLStrategy):
    """w_i ∝ N_i over DP-SGD updates (DPFedAvg, Noble et al. 2022; Robust-HDP baseline).

    Logs Robust-HDP's oracle diagnostics (σ_i² of Eq. 7, w*, Table-3 noise variance).
    """

    name = "dpsgd-fedavg"
    privacy = threat_models.RECORD_LOCAL_DPSGD

    def __init__(self, *, clip_norm: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)
