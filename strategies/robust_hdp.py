"""Robust-HDP (Malekmohammadi et al., ICML 2024) and its baselines WeiAvg, PFA, minimum-ε.

Privacy (all five strategies of this family, DPFedAvg included): every client runs
record-level DP-SGD with its own (ε_i, δ_i) *before* anything leaves it (local DP against
an untrusted server, Robust-HDP Sec. 2, Theorem 3.1). The server only post-processes noisy
updates, so no aggregation rule here changes any client's guarantee; they change *utility*.

* ``robust-hdp`` (Algorithm 1): stack the round's updates as M (p × n), Robust PCA
  M = L + S (:mod:`strategies.rpca`), σ̂_i² = ‖S[:, i]‖², w_i ∝ 1/σ̂_i² (Eq. 8 with estimated
  variances). Never reads the reported ε. ``freeze_weights`` reproduces the published code
  (weights from the first round, reused in every later round).
* ``weiavg`` (Liu et al. 2021, Robust-HDP Alg. 2): w_i ∝ reported ε_i.
* ``pfa`` (Liu et al. 2021, "Projected federated averaging with heterogeneous DP"): clients
  are split by *reported* ε into public (larger ε) and private (:func:`split_public_private`);
  private updates are projected on the top-k principal subspace of the public updates
  (:func:`project_onto_public_subspace`); the aggregate uses w_i ∝ reported ε_i.
* ``min-eps``: every client trains with the federation's minimum ε (the client factory sets it);
  w_i ∝ N_i.

Oracle diagnostics (:func:`with_oracle_diagnostics`, also logged by ``dpsgd-fedavg``): from each
client's reported training parameters (z_i, q_i, N_i, steps, η) and the run's c and p the
server computes σ_i² of Eq. 7, the optimum weights w*_i ∝ 1/σ_i² and the normalized
aggregate noise variance Σ w_i² σ_i² / (p η²) of Table 3 for the strategy's weights and for
w*. They are logged only; no strategy except an explicit oracle would use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strategies.aggregate import FloatVector, aggregate_noise_variance, cap_shares, normalize_weights, weighted_sum
from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate
from strategies.privacy import threat_models
from strategies.rpca import column_noise_variances, inverse_variance_weights, thin_right_svd


# ----------------------------------------------------------------------------- math
def oracle_sigma2(*, noise_multiplier: float, clip: float, num_train: int, sample_rate: float, steps: int,
                  lr: float, num_params: int) -> float:
    """σ_i² = Var(Δθ_i | θ) of Eq. 7 with the clipping-effective approximation of Eq. 3.

    Each of the ``steps`` DP-SGD steps adds N(0, (z c / b̄)²) per coordinate times η, where
    b̄ = ⌊q N⌋ is the batch size Opacus divides by (Poisson sampling, mean loss), so
    σ_i² = steps · η² · p · c² z² / b̄²  (= K_i ⌈N_i/b_i⌉ η² p c² z² / b_i² when b̄ = b_i).
    """
    expected_batch = int(num_train * sample_rate)
    if expected_batch <= 0:
        raise ValueError(f"expected batch size ⌊qN⌋ = {expected_batch} must be > 0 (q={sample_rate}, N={num_train})")
    return float(steps * lr**2 * num_params * (clip * noise_multiplier / expected_batch) ** 2)


def momentum_noise_factor(momentum: float, steps: int) -> float:
    """Var of the noise in Δ with heavy-ball momentum μ over T steps, relative to plain SGD's.

    Δ = −η Σ_t v_t with v_t = μ v_{t−1} + g_t (reset each round), so the noise of step k enters Δ with
    factor (1 − μ^{T−k+1})/(1 − μ); the ratio is (1/T) Σ_{j=1..T} ((1 − μ^j)/(1 − μ))² (1 for μ = 0).
    """
    if momentum == 0.0 or steps <= 0:
        return 1.0
    j = np.arange(1, steps + 1, dtype=np.float64)
    return float(np.mean(((1.0 - momentum**j) / (1.0 - momentum)) ** 2))


@dataclass(frozen=True)
class DeclaredNoiseCheck:
    """Robust-HDP's weights 1/σ̂_i² are earned only within what the client's declared DP-SGD allows.

    The server knows each client's declared mechanism (z_i, q_i fixed at first contact, N_i checked against
    its dataset size, steps K_i/q_i) and the run's c, η and μ, so it knows the noise variance σ_i² (Eq. 7) an
    honest update carries. An update whose Robust-PCA estimate σ̂_i² is below ``floor``·σ_i² left out noise
    (a zero or half-noise update would seize the aggregate); one above ``ceiling``·σ_i² added noise it does
    not declare (it spends less ε than it is charged for, or lies about its mechanism). Either is rejected.

    False rejections of honest clients: the exact noise part ‖N_i‖²/σ_i² is χ²_p/p (below 0.5 or above 2
    with probability < 1e-100 at p ≥ 1,000); what remains is the estimator's error. Measured over 20 rounds
    of the main job's 20 clients at dist2 and at dist6: σ̂²/σ² between 0.80 and 1.04, so the band [0.5, 2]
    leaves a margin of ~1.6× below and ~1.9× above (docs/privacy.md).
    """

    floor: float = 0.5
    ceiling: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.floor < 1 < self.ceiling:
            raise ValueError(f"need 0 <= floor < 1 < ceiling, got {self.floor}, {self.ceiling}")

    def problem(self, estimated: float, declared: float) -> str | None:
        """Why an estimate is outside the declared band (None when inside)."""
        ratio = estimated / declared
        if ratio < self.floor:
            return (f"estimated noise variance {estimated:.4g} is {ratio:.3f} x the declared mechanism's {declared:.4g}: "
                    f"below the floor {self.floor:g} (the update leaves out noise it declares)")
        if ratio > self.ceiling:
            return (f"estimated noise variance {estimated:.4g} is {ratio:.3f} x the declared mechanism's {declared:.4g}: "
                    f"above the ceiling {self.ceiling:g} (the update carries noise it does not declare)")
        return None


def split_public_private(epsilons: FloatVector) -> np.ndarray:
    """PFA's public/private split of clients by reported ε: a boolean mask of *public* clients.

    Exact one-dimensional 2-means: sort the ε, try every threshold between two distinct
    consecutive values, keep the one minimizing the within-cluster sum of squares; the
    cluster with the larger mean ε is public. Ties (all ε equal) make everyone public. The
    published Robust-HDP code clusters with a 2-component GMM on min-max scaled ε (k-means
    and hierarchical as options); for well separated ε all three agree with this rule.
    """
    eps = np.asarray(epsilons, dtype=np.float64)
    if eps.ndim != 1 or len(eps) == 0 or not np.all(np.isfinite(eps)):
        raise ValueError(f"need a non-empty vector of finite epsilons, got {eps}")
    values = np.sort(eps)
    best, threshold = math.inf, None
    for k in range(1, len(values)):
        if values[k] == values[k - 1]:
            continue
        lo, hi = values[:k], values[k:]
        sse = float(np.sum((lo - lo.mean()) ** 2) + np.sum((hi - hi.mean()) ** 2))
        if sse < best:
            best, threshold = sse, values[k]
    if threshold is None:
        return np.ones(len(eps), dtype=bool)
    public: np.ndarray = eps >= threshold
    return public


def project_onto_public_subspace(public: Sequence[np.ndarray], private: Sequence[np.ndarray],
                                 k: int = 1) -> list[np.ndarray]:
    """PFA projection: each private update Δ ↦ μ + U_k U_kᵀ (Δ − μ).

    μ is the mean public update and U_k the top-k left singular vectors of the centered
    public updates [Δ_j − μ] (PCA of the public updates, as ``sklearn.PCA`` in the published
    code, without its per-coordinate standardization). Computed through the n_pub × n_pub
    Gram matrix, never a p × p object. With a single public client the subspace is the line
    spanned by its update (μ = 0).
    """
    if k < 1:
        raise ValueError(f"PFA needs k >= 1 components, got {k}")
    if not public:
        raise ValueError("PFA needs at least one public client")
    pub = np.stack([np.asarray(u, dtype=np.float64) for u in public], axis=1)
    if len(public) >= 2:
        mean = pub.mean(axis=1)
        centered = pub - mean[:, None]
    else:
        mean = np.zeros(pub.shape[0])
        centered = pub
    s, v = thin_right_svd(centered)
    keep = s > s.max() * 1e-10 if len(s) and s.max() > 0 else np.zeros(len(s), dtype=bool)
    keep[min(k, len(s)):] = False
    if not np.any(keep):
        return [mean.copy() for _ in private]
    basis = centered @ (v[:, keep] / s[keep])  # p × k, orthonormal columns
    out = []
    for u in private:
        d = np.asarray(u, dtype=np.float64) - mean
        out.append(mean + basis @ (basis.T @ d))
    return out


# ----------------------------------------------------------------------------- Flower strategies
def _metric(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def with_oracle_diagnostics(weighted: tuple[np.ndarray, dict[str, Any]], updates: list[ClientUpdate], *,
                            clip_norm: float, num_params: int, exact: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """A strategy's (raw weights, extra) with the oracle diagnostics added to extra: σ_i² (Eq. 7) of each client from
    its reported training parameters and the run's c (``clip_norm``) and p, the optimum weights w*_i ∝ 1/σ_i², and
    the Table-3 noise variance of the normalized weights and of w*: logged, never used to weight. Each update's
    ``record`` gets ``sigma2_oracle`` and ``oracle_weight``. ``exact = False`` where the aggregate is not Σ w_i Δ_i of
    the raw updates (PFA projects), so Σ w_i² σ_i² is not its noise variance: it is then logged as
    ``noise_variance_unprojected``."""
    raw, extra = weighted
    return raw, {**extra, **_oracle_diagnostics(updates, normalize_weights(raw), clip_norm, num_params, exact)}


def _oracle_diagnostics(updates: list[ClientUpdate], weights: np.ndarray, clip_norm: float, num_params: int,
                        exact: bool) -> dict[str, Any]:
    sigma2: list[float | None] = []
    lrs: list[float | None] = []
    for cu in updates:
        m = cu.metrics
        fields = {k: _metric(m, k) for k in ("noise_multiplier", "num_train", "sample_rate", "steps_round", "lr")}
        positive = {k: v for k, v in fields.items() if v is not None and v > 0}
        value = None
        if clip_norm > 0 and len(positive) == len(fields):
            try:
                value = oracle_sigma2(noise_multiplier=positive["noise_multiplier"], clip=clip_norm,
                                      num_train=int(positive["num_train"]), sample_rate=positive["sample_rate"],
                                      steps=int(positive["steps_round"]), lr=positive["lr"], num_params=num_params)
            except ValueError:
                value = None
        sigma2.append(value)
        lrs.append(fields["lr"])
        cu.record["sigma2_oracle"] = value
        cu.record.setdefault("sigma2_estimated", None)
        cu.record["oracle_weight"] = None
    out: dict[str, Any] = {"noise_variance": None, "noise_variance_oracle": None}
    known_lrs = [lr for lr in lrs if lr is not None]
    if any(s is None for s in sigma2) or len(known_lrs) != len(lrs):
        return out
    s2 = np.asarray(sigma2, dtype=np.float64)
    w_star = inverse_variance_weights(s2)
    for cu, w in zip(updates, w_star):
        cu.record["oracle_weight"] = float(w)
    lr = float(np.mean(known_lrs))
    out["noise_variance" if exact else "noise_variance_unprojected"] = aggregate_noise_variance(weights, s2, num_params,
                                                                                               lr)
    out["noise_variance_oracle"] = aggregate_noise_variance(w_star, s2, num_params, lr)
    return out


def check_reported_epsilon(metrics: Mapping[str, Any]) -> None:
    """Reject an update whose reported ε is missing, non-finite or ≤ 0 (ε-weighted aggregation reads it)."""
    eps = metrics.get("reported_epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise RejectedUpdate(f"reported_epsilon = {eps!r} must be a finite number > 0 for ε-weighted aggregation")


class RobustHDP(DPFLStrategy):
    """Robust-HDP (Algorithm 1): w_i ∝ 1/‖S[:, i]‖² from Robust PCA of the round's updates.

    Record-level local DP (DP-SGD on each client); untrusted server. The weights never use
    the reported ε, so a client that lies about ε cannot change them. A client cannot seize the
    aggregate by leaving out its noise either: σ̂_i² must lie within :class:`DeclaredNoiseCheck`'s band
    around the σ_i² its declared mechanism implies (else the update is rejected and struck), and no
    client's weight exceeds ``max_weight_share`` of the round (:func:`~strategies.aggregate.cap_shares`).
    """

    name = "robust-hdp"
    privacy = threat_models.RECORD_LOCAL_DPSGD

    def __init__(self, *, rpca_options: Mapping[str, Any] | None = None, chunk_rows: int = 0, num_chunks: int = 0,
                 freeze_weights: bool = False, clip_norm: float = 0.0, noise_check: DeclaredNoiseCheck | None = None,
                 max_weight_share: float = 0.5, lr_schedule: Callable[[int], float] | None = None,
                 momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rpca_options = dict(rpca_options or {})
        self.chunk_rows = int(chunk_rows)
        self.num_chunks = int(num_chunks)
        self.freeze_weights = bool(freeze_weights)
        self.clip_norm = float(clip_norm)
        self.frozen_sigma2: dict[int, float] = {}
        self.noise_check = noise_check if noise_check is not None else DeclaredNoiseCheck()
        if not 0 < max_weight_share <= 1:
            raise ValueError(f"max_weight_share must be in (0, 1], got {max_weight_share}")
        self.max_weight_share = float(max_weight_share)
        self.lr_schedule = lr_schedule
        self.momentum = float(momentum)
        self._estimate: tuple[list[int], Any] | None = None  # this round's RPCA, reused by the weights

    def declared_sigma2(self, server_round: int, update: ClientUpdate) -> float | None:
        """σ_i² (Eq. 7) of the client's declared DP-SGD with the run's c, η_t and μ (None when not computable).

        z_i and q_i are the ones fixed at first contact; the learning rate is the server's, never the client's.
        """
        declared = self.declared.get(update.client_id)
        steps = _metric(update.metrics, "steps_round")
        lr = self.lr_schedule(server_round) if self.lr_schedule is not None else _metric(update.metrics, "lr")
        if declared is None or steps is None or lr is None or self.clip_norm <= 0:
            return None
        z, q = declared
        try:
            base = oracle_sigma2(noise_multiplier=z, clip=self.clip_norm, num_train=int(update.num_examples),
                                 sample_rate=q, steps=int(steps), lr=lr, num_params=int(self.num_params))
        except ValueError:
            return None
        return base * momentum_noise_factor(self.momentum, int(steps))

    def screen(self, server_round: int, updates: list[ClientUpdate]) -> list[tuple[ClientUpdate, str]]:
        """Reject updates whose estimated noise is outside what their declared mechanism allows."""
        self._estimate = None
        ids = [u.client_id for u in updates]
        if self.clip_norm <= 0 or not updates or (self.freeze_weights and all(i in self.frozen_sigma2 for i in ids)):
            return []  # without the run's clip norm no declared variance exists (the factories always pass it)
        est = column_noise_variances([u.update for u in updates], chunk_rows=self.chunk_rows,
                                     num_chunks=self.num_chunks, **self.rpca_options)
        out = []
        for u, s2 in zip(updates, est.sigma2):
            declared = self.declared_sigma2(server_round, u)
            if declared is None or declared <= 0:
                out.append((u, "the declared mechanism (noise_multiplier, sample_rate, num_examples, steps_round) "
                               "does not determine a noise variance"))
                continue
            u.record["noise_ratio"] = float(s2) / declared
            reason = self.noise_check.problem(float(s2), declared)
            if reason is not None:
                out.append((u, reason))
        if not out:
            self._estimate = (ids, est)
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """Frozen σ̂² per client (published-code mode) so a resumed run keeps the round-1 weights."""
        return {"frozen_sigma2": {str(k): float(v) for k, v in self.frozen_sigma2.items()}}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self.frozen_sigma2 = {int(k): float(v) for k, v in dict(state.get("frozen_sigma2", {})).items()}

    def raw_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        extra: dict[str, Any] = {"rpca_seconds": 0.0, "rpca_iterations": 0, "rpca_converged": None,
                                 "rpca_blocks": 0, "weights_frozen": False}
        ids = [u.client_id for u in updates]
        if self.freeze_weights and all(i in self.frozen_sigma2 for i in ids):
            sigma2 = np.asarray([self.frozen_sigma2[i] for i in ids])
            extra["weights_frozen"] = True
        else:
            if self._estimate is not None and self._estimate[0] == ids:
                est = self._estimate[1]
            else:
                est = column_noise_variances([u.update for u in updates], chunk_rows=self.chunk_rows,
                                             num_chunks=self.num_chunks, **self.rpca_options)
            sigma2 = est.sigma2
            extra.update(rpca_seconds=est.seconds, rpca_iterations=est.iterations, rpca_converged=est.converged,
                         rpca_blocks=est.blocks)
            if self.freeze_weights:
                for i, s in zip(ids, sigma2):
                    self.frozen_sigma2.setdefault(i, float(s))
                sigma2 = np.asarray([self.frozen_sigma2[i] for i in ids])
        for cu, s in zip(updates, sigma2):
            cu.record["sigma2_estimated"] = float(s)
        weights = inverse_variance_weights(sigma2)
        capped = cap_shares(weights, self.max_weight_share)
        extra["weights_capped"] = int(np.sum(weights > capped * (1 + 1e-9)))
        return capped, extra

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        return with_oracle_diagnostics(self.raw_weights(server_round, updates), updates, clip_norm=self.clip_norm,
                                       num_params=self.num_params)


class WeiAvg(DPFLStrategy):
    """WeiAvg (Liu et al. 2021; Robust-HDP Alg. 2): w_i ∝ reported ε_i. Record-level local DP; untrusted server."""

    name = "weiavg"
    privacy = threat_models.RECORD_LOCAL_DPSGD
    #: whether the aggregate is Σ w_i Δ_i of the raw updates (:func:`with_oracle_diagnostics`)
    aggregate_is_weighted_sum = True

    def __init__(self, *, clip_norm: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Any]) -> None:
        super().validate_update(update, metrics)
        check_reported_epsilon(metrics)

    def raw_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        return np.asarray([float(u.metrics["reported_epsilon"]) for u in updates]), {}

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        return with_oracle_diagnostics(self.raw_weights(server_round, updates), updates, clip_norm=self.clip_norm,
                                       num_params=self.num_params, exact=self.aggregate_is_weighted_sum)


class PFA(WeiAvg):
    """PFA (Liu et al. 2021): project private updates on the public top-k subspace, w_i ∝ reported ε_i.

    Record-level local DP (DP-SGD on each client); untrusted server. The split is by reported
    ε (:func:`split_public_private`), recomputed each round among the participants.
    """

    name = "pfa"
    aggregate_is_weighted_sum = False  # private updates are projected first

    def __init__(self, *, components: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if components < 1:
            raise ValueError(f"pfa-components must be >= 1, got {components}")
        self.components = int(components)

    def raw_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        raw, extra = super().raw_weights(server_round, updates)
        public = split_public_private(raw)
        for cu, is_pub in zip(updates, public):
            cu.record["pfa_public"] = bool(is_pub)
        threshold = float(raw[public].min())
        return raw, {**extra, "pfa_public_clients": int(public.sum()), "pfa_epsilon_threshold": threshold}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        public = [u.update for u in updates if u.record.get("pfa_public")]
        private_idx = [i for i, u in enumerate(updates) if not u.record.get("pfa_public")]
        vectors = [u.update for u in updates]
        if private_idx:
            projected = project_onto_public_subspace(public, [vectors[i] for i in private_idx], self.components)
            for i, v in zip(private_idx, projected):
                vectors[i] = v
        return weighted_sum(vectors, weights)


class MinEpsilon(DPFLStrategy):
    """Minimum-ε baseline: clients train with min_j ε_j (client side), w_i ∝ N_i.

    Record-level local DP at the federation's smallest ε for everyone; untrusted server.
    """

    name = "min-eps"
    privacy = threat_models.RECORD_LOCAL_MIN_EPS

    def __init__(self, *, clip_norm: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        return with_oracle_diagnostics(super().aggregation_weights(server_round, updates), updates,
                                       clip_norm=self.clip_norm, num_params=self.num_params)
