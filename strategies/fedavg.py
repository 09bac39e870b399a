"""FedAvg (McMahan et al. 2017) and DPFedAvg of Noble et al. (2022): w_i ∝ N_i.

``fedavg``: non-private clients (plain SGD) — no formal privacy.
``dpsgd-fedavg``: every client runs record-level DP-SGD with its own (ε_i, δ_i) (local DP
against an untrusted server, Robust-HDP Sec. 2); the server averages updates with weights
proportional to dataset sizes N_i. The server adds no noise, so its output is post-processing
of already-private updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate
from strategies.privacy import threat_models
from strategies.privacy.mechanisms import NORM_ALLOWANCE_SIGMAS
from strategies.robust_hdp import momentum_noise_factor, oracle_sigma2, with_oracle_diagnostics
from strategies.server.validation import number_metrics, parse_client_id


def dpsgd_update_bound(*, noise_multiplier: float, sample_rate: float, steps: int, num_train: int, clip: float,
                       lr: float, momentum: float, num_params: int) -> float:
    """An ℓ2 norm no honest DP-SGD update Δ = −η Σ_t v_t (v_t = μ v_{t−1} + g_t, reset each round) exceeds except
    with probability ≤ e⁻⁷².

    Each step's g_t = (Σ_{j∈B_t} clip_c(∇f_j) + N(0, c²z² I))/b̄ with b̄ = ⌊N q⌋ (Opacus' expected batch), and g_k
    enters Δ with factor η(1 − μ^{T−k+1})/(1 − μ) ≤ η/(1 − μ). The clipped sums (|B_t| ≤ N) contribute at most
    η T N c / (b̄ (1 − μ)); the noise is Gaussian with per-coordinate variance σ²/p, σ² of Eq. 7 times
    :func:`~strategies.robust_hdp.momentum_noise_factor`, whose norm stays below √(σ²/p)(√p + 12).
    """
    expected_batch = int(num_train * sample_rate)
    if expected_batch <= 0:
        raise ValueError(f"expected batch size ⌊qN⌋ = {expected_batch} must be > 0 (q={sample_rate}, N={num_train})")
    clipped = lr * steps * num_train * clip / (expected_batch * (1.0 - momentum))
    sigma2 = oracle_sigma2(noise_multiplier=noise_multiplier, clip=clip, num_train=num_train, sample_rate=sample_rate,
                           steps=steps, lr=lr, num_params=num_params) * momentum_noise_factor(momentum, steps)
    return clipped + math.sqrt(sigma2 / num_params) * (math.sqrt(num_params) + NORM_ALLOWANCE_SIGMAS)


class FedAvg(DPFLStrategy):
    """w_i ∝ N_i over non-private updates."""

    name = "fedavg"
    privacy = threat_models.NONE


class DPSGDFedAvg(DPFLStrategy):
    """w_i ∝ N_i over DP-SGD updates (DPFedAvg, Noble et al. 2022; Robust-HDP baseline).

    Logs Robust-HDP's oracle diagnostics (σ_i² of Eq. 7, w*, Table-3 noise variance). With the run's learning-rate
    schedule η_t (``lr_schedule``) and momentum μ, an update above :func:`dpsgd_update_bound` of the client's
    declared (z, q), fixed at first contact, and declared steps is rejected, whatever the round's size.
    """

    name = "dpsgd-fedavg"
    privacy = threat_models.RECORD_LOCAL_DPSGD

    def __init__(self, *, clip_norm: float = 0.0, lr_schedule: Callable[[int], float] | None = None,
                 momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)
        self.lr_schedule = lr_schedule
        self.momentum = float(momentum)

    def mechanism_bound(self, metrics: Mapping[str, Any]) -> float | None:
        """:func:`dpsgd_update_bound` for this reply (None without the run's c and η_t or a declared mechanism): z, q
        fixed at first contact, the declared ``steps_round``, N the client's known dataset size (else its
        ``num_train``)."""
        cid = parse_client_id(metrics.get("client_id"))
        rnd = self.round_log.round
        declared = self.declared.get(cid) if cid is not None else None
        steps = number_metrics(metrics, "steps_round")
        if self.lr_schedule is None or self.clip_norm <= 0 or rnd is None or declared is None or steps is None:
            return None
        known = self.validator.max_examples.get(cid) if cid is not None else None
        claimed = number_metrics(metrics, "num_train")
        num_train = known if known is not None else int(claimed[0]) if claimed is not None else None
        if num_train is None:
            return None
        z, q = declared
        try:
            return dpsgd_update_bound(noise_multiplier=z, sample_rate=q, steps=int(steps[0]), num_train=num_train,
                                      clip=self.clip_norm, lr=self.lr_schedule(rnd), momentum=self.momentum,
                                      num_params=self.num_params)
        except ValueError as exc:
            raise RejectedUpdate(f"the declared DP-SGD mechanism bounds no update: {exc}") from None

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        return with_oracle_diagnostics(super().aggregation_weights(server_round, updates), updates,
                                       clip_norm=self.clip_norm, num_params=self.num_params)

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Any]) -> None:
        super().validate_update(update, metrics)
        bound = self.mechanism_bound(metrics)
        norm = float(np.linalg.norm(update))
        if bound is not None and norm > bound * (1 + 1e-6):
            raise RejectedUpdate(f"update norm {norm:.6g} exceeds {bound:.6g}, the most DP-SGD produces with the "
                                 "declared (noise_multiplier, sample_rate, steps_round) and the run's clip norm, "
                                 "learning rate and momentum")
