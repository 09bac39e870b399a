"""The server's adaptive clip norm C_t (Andrew et al., NeurIPS 2021, Alg. 1) for a client-level DP strategy.

:class:`ServerClip` holds C_t and z_Δ, checks what each reply says about them, and steps C_{t+1} from the round's
noisy count shares: the clients' metrics without SecAgg+, the secure sum's count coordinate under it
(:meth:`strategies.server.secure_sum.SecureSumAdapter.split_count`). The arithmetic is
:mod:`strategies.privacy.adaptive_clipping`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.common import Scalar

from strategies.errors import ConfigError
from strategies.privacy.adaptive_clipping import (
    AdaptiveClipConfig,
    fraction_from_noisy_sum,
    geometric_clip_update,
    round_mechanism,
    update_noise_multiplier,
)
from strategies.privacy.mechanisms import ClientLevelDP
from strategies.server.admission import ClientUpdate
from strategies.server.validation import RejectedUpdate

#: client metric under adaptive clipping without SecAgg+: its share of the noisy count, b_i − ½ + N(0, σ_b²/r)
#: (under SecAgg+ the share is coordinate d+1 of the secure sum instead, never a metric)
METRIC_UNCLIPPED_SHARE = "unclipped_share"


def checked_clip(value: Any) -> float:
    """A checkpoint's C_t: a finite number > 0 (``ValueError`` otherwise)."""
    clip = float(value)
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"checkpoint clip_norm {clip} is not a finite number > 0")
    return clip


class ServerClip:
    """C_t of a run with adaptive clipping: ``config`` (γ, η_C, σ_b, C_0) for the run's mechanism ``dp`` (z), from
    ``clip`` (a resumed run's checkpointed C_t) or C_0."""

    def __init__(self, config: AdaptiveClipConfig, dp: ClientLevelDP, clip: float | None = None) -> None:
        self.config = config
        self.dp = dp
        #: z_Δ, the update's share of the round's multiplier z: z⁻² = z_Δ⁻² + (2σ_b)⁻² (Thm 1)
        self.update_multiplier = update_noise_multiplier(dp.noise_multiplier, config.count_noise_std)
        self.clip = config.initial_clip if clip is None else float(clip)  #: C_t, the clip of the next round

    def mechanism(self) -> ClientLevelDP:
        """What each update carries this round: C_t with the update multiplier z_Δ (the budget is still charged
        for the run's z)."""
        return round_mechanism(self.dp, self.clip, self.update_multiplier)

    def count_share_std(self, round_clients: int) -> float:
        """Std of one client's noise on its centred bit, σ_b/√r (r as for the update noise): one update carries
        the multiplier z/√r of a fixed-clip round, the sum of r shares N(0, σ_b²) (Andrew et al. 2021, Thm 1)."""
        r = round_clients if self.dp.secure_aggregation else self.dp.clients_per_round
        return self.config.count_noise_std / math.sqrt(max(int(r), 1))

    def check_clip_used(self, metrics: Mapping[str, Scalar]) -> None:
        """Reject a reply clipped at another clip than this round's C_t."""
        used = metrics.get("clip_norm")
        if (isinstance(used, bool) or not isinstance(used, (int, float))
                or not math.isclose(float(used), self.clip, rel_tol=1e-9)):
            raise RejectedUpdate(f"client clip norm {used!r} != this round's adaptive clip C_t = {self.clip}")

    def check_reply(self, metrics: Mapping[str, Scalar], round_clients: int, *, share_in_sum: bool) -> None:
        """Reject a reply clipped at another C_t or, when its count share is a metric (no SecAgg+), whose share lies
        outside ½ + 12 stds of its noise (a legitimate one does so with probability < e⁻⁷²; it would steer the
        clip). Under SecAgg+ the share is inside the sum and any metric of that name is ignored."""
        self.check_clip_used(metrics)
        if share_in_sum:
            return
        share = metrics.get(METRIC_UNCLIPPED_SHARE)
        bound = 0.5 + 12.0 * self.count_share_std(round_clients)
        if (isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(float(share))
                or abs(float(share)) > bound):
            raise RejectedUpdate(f"{METRIC_UNCLIPPED_SHARE} {share!r} is not a number within ±{bound:.4g}")

    def adapt(self, accepted: Sequence[ClientUpdate], *, count_sum: float | None, share_in_sum: bool,
              contributors: int) -> dict[str, Any]:
        """C_{t+1} = C_t · exp(−η_C (b̄_t − γ)) from the noisy count shares (Andrew et al. 2021, Alg. 1): without
        SecAgg+ the accepted replies' metrics, b̄_t = (Σ shares) / r + ½, r the expected clients per round; under
        SecAgg+ the sum's count coordinate ``count_sum`` over its r' = ``contributors`` survivors. A round with
        nothing accepted keeps C_t. Post-processing of privatized shares: it costs nothing beyond the round's
        charge."""
        cfg = self.config
        out: dict[str, Any] = {"clip_norm": self.clip, "adaptive_clip_quantile": cfg.target_quantile,
                               "count_noise_std": cfg.count_noise_std, "update_noise_multiplier": self.update_multiplier}
        if accepted:
            if share_in_sum:
                if count_sum is None:  # the sum's shapes were checked when it was split: nothing is accepted
                    raise RuntimeError("an accepted secure sum without its count coordinate")
                # the fixed expected cohort under sampling (as the update's mean), so C_{t+1} does not reveal r'
                noisy_sum, count = count_sum, self.dp.clients_per_round if self.dp.sample_rate < 1 else contributors
            else:
                noisy_sum = sum(float(u.metrics[METRIC_UNCLIPPED_SHARE]) for u in accepted)
                count = self.dp.clients_per_round
            out["unclipped_fraction"] = fraction = fraction_from_noisy_sum(noisy_sum, count)
            self.clip = geometric_clip_update(self.clip, fraction, cfg.target_quantile, cfg.learning_rate)
            if share_in_sum:
                out["count_sum_clients"] = contributors
        out["next_clip_norm"] = self.clip
        return out


def server_clip(config: AdaptiveClipConfig | None, dp: ClientLevelDP, clip: float | None, *, discrete: bool,
                sized_for_count: bool) -> ServerClip | None:
    """The run's adaptive clip (None: a fixed clip), refused where the secure sum cannot carry its count: with the
    distributed discrete Gaussian (``discrete``), or off where the secure sum was ``sized_for_count``."""
    if config is not None and discrete:
        raise ConfigError("adaptive clipping with secagg-mechanism = 'ddg' is not supported: the distributed "
                          "discrete Gaussian's privacy bound covers the rotated update alone, not a count "
                          "coordinate inside it; use secagg-mechanism = 'gaussian'")
    if sized_for_count and config is None:
        raise ConfigError("this server sized the secure sum for adaptive clipping's count coordinate, but "
                          "its adaptive clipping is off (adaptive-clip-quantile = 0)")
    return None if config is None else ServerClip(config, dp, clip)  # a resumed run keeps its checkpointed C_t
