"""Fed-SMP (Hu, Guo & Gong, "Federated Learning with Sparsified Model Perturbation") and DP-FedAvg.

What it protects: *client-level* DP — the participation and whole dataset of one client — with
the noise added *locally* by each client (N(0, C²σ²/r_t) per coordinate, Alg. 1 line 22 /
Alg. 2 line 51) so that the **sum** of the r_t sampled updates carries N(0, C²σ²) on every
transmitted coordinate. Sampling, accounting and the two ε (aggregate, individual update) are
those of :mod:`strategies.client_level`; the aggregate ε assumes secure aggregation (Alg. 1 line 23).

Registry strategies (all share :class:`FedSMPStrategy`):

* ``dp-fedavg``      Alg. 1: clip the dense update to C, add N(0, C²σ²/r), server averages with 1/r.
* ``fed-smp-randk``  Alg. 2 with rand_k: the server draws k = p·d coordinates from a seed and sends
                     the *seed*; clients scale by d/k, clip, add noise on the k coordinates only.
* ``fed-smp-topk``   Alg. 2 with top_k: the server runs τ_p SGD steps on a public set D_p held out of
                     every client's data and sends the k largest |Δ_p| coordinates; no d/k scaling.
* ``fedavg-randk`` / ``fedavg-topk``  the same sparsify + clip without noise (σ = 0): non-private
                     baselines that differ from Fed-SMP only in the DP noise (paper Sec. 6.3.2).

Adaptive clipping (``adaptive-clip-quantile`` > 0, dp-fedavg and both private Fed-SMP variants; Andrew et al.,
NeurIPS 2021, Alg. 1 / Thm 1; :mod:`strategies.client_level` holds C_t, the noise split and the count): DP-spar
sparsifies *first* and clips the k transmitted values (rand_k: after the d/k scaling), so that is the vector clipped
at C_t and noised with z_Δ·C_t/√r, and each client's bit is b_i = 1[‖Δ'‖ ≤ C_t] of that sparsified Δ', not of the
full Δ (whose norm may lie on the other side of C_t): the count then estimates the quantile of the norms the clip
actually acts on, and its sensitivity stays ½ per client whatever Δ is. Under SecAgg+ (continuous Gaussian shares)
the payload is the k mask values plus the count coordinate (:meth:`FedSMPStrategy.payload_dim`).

Wire format of a sparse update: a single float32 array of the k kept values in mask order
(ascending coordinate index) — no zeros and no index list; the server knows the mask.
Sign convention: this library's Δ is θ_local − θ (the paper's is θ − θ_local), so the server
step θ ← θ + (1/r) Σ Δ_i is the paper's θ ← θ − (1/r) Σ y_i.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import Scalar, log

from strategies.base import ClientUpdate, Reply
from strategies.client_level import ClientLevelDPStrategy, uplink_metrics
from strategies.compression import (
    check_indices,
    decode_sparse,
    encode_sparse,
    num_kept,
    rand_k_indices,
    top_k_indices,
)
from strategies.privacy import threat_models
from strategies.privacy.mechanisms import ClientLevelDP, clip_by_l2
from strategies.server.validation import RejectedUpdate

SPARSIFIERS = ("none", "randk", "topk")
#: fit-config keys of the round's mask (sent with the global model)
CFG_SPARSIFIER, CFG_K, CFG_SEED, CFG_MASK = "smp-sparsifier", "smp-k", "smp-mask-seed", "smp-mask"


# ---------------------------------------------------------------------------- masks
def mask_seed(run_seed: int, server_round: int, stream: int = 501) -> int:
    """The rand-k seed of a round (server side; sent to clients instead of the mask)."""
    return int(np.random.SeedSequence([int(run_seed), stream, int(server_round)]).generate_state(1)[0] & 0x7FFFFFFF)


# ---------------------------------------------------------------------------- client math (Alg. 2 DP-spar)
def dp_spar(update: np.ndarray, indices: np.ndarray, sparsifier: str, *, clip: float | None,
            dp: ClientLevelDP | None, rng: np.random.Generator,
            round_clients: int | None = None) -> tuple[np.ndarray, float]:
    """DP-spar (Alg. 2 lines 44–51) returning only the k transmitted values (mask order) and the pre-clip norm.

    rand_k: Δ' = (d/k) Δ⊙m (unbiased); top_k: Δ' = Δ⊙m. Then Δ̂ = Δ'·min(1, C/‖Δ'‖) and, if ``dp``
    is given, N(0, C²σ²/r_t) on the k masked coordinates only (the others are never sent).
    ``dp=None`` (FedAvg-randk/topk) clips to ``clip`` (if not None) and adds no noise. The returned norm is ‖Δ'‖,
    the norm of the vector that is clipped: adaptive clipping's bit 1[‖Δ'‖ ≤ C_t] is taken on it (Andrew et al.
    2021, Alg. 1 applied to what the mechanism clips).
    """
    if sparsifier not in ("randk", "topk"):
        raise ValueError(f"sparsifier must be 'randk' or 'topk', got {sparsifier!r}")
    flat = np.asarray(update, dtype=np.float64).ravel()
    values = flat[indices]
    if sparsifier == "randk":
        values = values * (flat.size / len(indices))
    if dp is not None:
        return dp.privatize(values, rng, round_clients)
    if clip is None:
        return values, float(np.linalg.norm(values))
    return clip_by_l2(values, clip)


def dp_dense(update: np.ndarray, *, clip: float | None, dp: ClientLevelDP | None,
             rng: np.random.Generator, round_clients: int | None = None) -> tuple[np.ndarray, float]:
    """Alg. 1 lines 21–22: clip the whole update to C and add N(0, C²σ²/r_t) on all d coordinates."""
    flat = np.asarray(update, dtype=np.float64).ravel()
    if dp is not None:
        return dp.privatize(flat, rng, round_clients)
    if clip is None:
        return flat, float(np.linalg.norm(flat))
    return clip_by_l2(flat, clip)


def mask_from_config(config: Mapping[str, Scalar], num_params: int) -> tuple[str, np.ndarray | None]:
    """Client side: (sparsifier, mask indices) from the round's fit config; ('none', None) for dense."""
    sparsifier = str(config.get(CFG_SPARSIFIER, "none"))
    if sparsifier == "none":
        return sparsifier, None
    if sparsifier == "randk":
        k = int(config[CFG_K])
        return sparsifier, rand_k_indices(num_params, k, int(config[CFG_SEED]))
    if sparsifier == "topk":
        raw = config[CFG_MASK]
        if not isinstance(raw, bytes):
            raise ValueError(f"fit config {CFG_MASK!r} must be bytes, got {type(raw).__name__}")
        idx = check_indices(np.frombuffer(raw, dtype="<i4"), num_params)
        if CFG_K in config and int(config[CFG_K]) != len(idx):
            raise ValueError(f"mask has {len(idx)} indices but {CFG_K} = {config[CFG_K]!s}")
        return sparsifier, idx
    raise ValueError(f"unknown sparsifier {sparsifier!r} in fit config; valid: {SPARSIFIERS}")




def theorem1_noise_multiplier(epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """Fed-SMP Theorem 1 (Eq. 10): σ = sqrt(7 q² T (ε + 2 log(1/δ)) / ε²) suffices for (ε, δ) after T rounds.

    A closed-form *upper* bound (valid for ε < 2 log(1/δ) and σ² ≥ 0.7); used only to check
    that the accountant is at least as tight (it must need no more noise for the same ε).
    """
    if not 0 < epsilon < 2 * math.log(1 / delta):
        raise ValueError(f"Theorem 1 needs 0 < ε < 2 log(1/δ) = {2 * math.log(1 / delta):.3f}, got {epsilon}")
    return math.sqrt(7 * sample_rate**2 * rounds * (epsilon + 2 * math.log(1 / delta)) / epsilon**2)


# ---------------------------------------------------------------------------- server strategy
PublicUpdateFn = Callable[[list[np.ndarray], int], np.ndarray]


class FedSMPStrategy(ClientLevelDPStrategy):
    """DP-FedAvg / Fed-SMP / FedAvg-randk/topk server: the round mask and (1/r_t) Σ Δ_i aggregation."""

    name = "dp-fedavg"

    def __init__(self, *, sparsifier: str = "none", compression_ratio: float = 1.0,
                 public_update_fn: PublicUpdateFn | None = None, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if name is not None:
            self.name = name  # the registry name this configuration runs as (fed-smp-randk, fedavg-topk, ...)
        if sparsifier not in SPARSIFIERS:
            raise ValueError(f"sparsifier must be one of {SPARSIFIERS}, got {sparsifier!r}")
        if sparsifier == "topk" and public_update_fn is None:
            raise ValueError("top-k needs a public update function (server-side SGD on D_p)")
        self.sparsifier = sparsifier
        self.k = self.num_params if sparsifier == "none" else num_kept(self.num_params, compression_ratio)
        self.public_update_fn = public_update_fn
        self.masks: dict[int, np.ndarray] = {}
        self.uplink_total = 0
        if not self.private:
            self.privacy = threat_models.NONE_SPARSIFIED

    def round_mask(self, server_round: int) -> np.ndarray | None:
        """m_t of the round (cached): rand-k from the round seed, top-k from Δ_p on the public set."""
        if self.sparsifier == "none":
            return None
        if server_round not in self.masks:
            if self.sparsifier == "randk":
                idx = rand_k_indices(self.num_params, self.k, mask_seed(self.seed, server_round))
            else:
                if self.public_update_fn is None:  # __init__ refuses top-k without one
                    raise RuntimeError("top-k needs a public update function (server-side SGD on D_p)")
                delta_p = np.asarray(self.public_update_fn(self.current_weights, server_round)).ravel()
                if delta_p.shape != (self.num_params,):
                    raise RuntimeError(f"round {server_round}: public update has {delta_p.size} entries, the model "
                                       f"has {self.num_params}")
                if np.all(np.isfinite(delta_p)):
                    idx = top_k_indices(delta_p, self.k)
                else:  # training on D_p diverged from θ_t: this round's mask is rand-k (data-independent)
                    log(WARNING, "round %d: the server's public update on D_p is not finite; this round uses a "
                        "rand-k mask", server_round)
                    self.round_log.add_metrics({"mask_fallback": "randk"})
                    idx = rand_k_indices(self.num_params, self.k, mask_seed(self.seed, server_round))
            self.masks = {server_round: idx}  # keep only the current round's mask
        return self.masks[server_round]

    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        cfg = super().fit_config(server_round)
        cfg[CFG_SPARSIFIER] = self.sparsifier
        if self.sparsifier == "randk":
            cfg.update({CFG_K: self.k, CFG_SEED: mask_seed(self.seed, server_round)})
            self.round_mask(server_round)
        elif self.sparsifier == "topk":
            idx = self.round_mask(server_round)
            cfg.update({CFG_K: self.k, CFG_MASK: np.asarray(idx, dtype="<i4").tobytes()})
        return cfg

    def payload_dim(self) -> int:
        """The k values of the round's mask (all d without sparsification), plus the count coordinate of adaptive
        clipping under SecAgg+ (:attr:`count_in_secure_sum`)."""
        return self.k + int(self.count_in_secure_sum)

    def payload_arrays(self, values: np.ndarray) -> list[np.ndarray]:
        return super().payload_arrays(values) if self.sparsifier == "none" else encode_sparse(values)

    def decode_update(self, server_round: int, reply: Reply, metrics: Mapping[str, Scalar]) -> np.ndarray:
        if self.sparsifier == "none":
            return super().decode_update(server_round, reply, metrics)
        try:
            mask = self.round_mask(server_round)
            if mask is None:  # only without sparsification, handled above
                raise RuntimeError(f"round {server_round}: sparsifier {self.sparsifier!r} has no mask")
            return decode_sparse(reply.arrays(), mask, self.num_params)
        except ValueError as exc:
            raise RejectedUpdate(str(exc)) from None

    def declared_norm_bound(self, dim: int) -> float | None:
        """The bound on the k transmitted coordinates (zeros elsewhere add nothing to the norm)."""
        return super().declared_norm_bound(self.k)

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        self.uplink_total, metrics = uplink_metrics(updates, self.uplink_total, self.k, self.num_params)
        return np.ones(len(updates)), metrics

