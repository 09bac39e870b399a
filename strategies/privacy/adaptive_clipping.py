"""Adaptive clipping: the clip norm follows a target quantile of the update norms (Andrew et al., NeurIPS 2021,
"Differentially Private Learning with Adaptive Clipping", Alg. 1 and Sec. 3).

Round t: each of the clients clips its update to C_t and reports the bit b_i = 1[‖Δ_i‖ ≤ C_t]. The server forms
the noisy fraction b̄ = (Σ (b_i − ½) + N(0, σ_b²)) / r + ½, r the *expected* number of clients (Sec. 3; centring
the bits gives the sum sensitivity ½, the source of the 2 in Thm 1), and updates geometrically
C_{t+1} = C_t · exp(−η_C (b̄ − γ)). Here each client adds its share N(0, σ_b²/r) to its own b_i − ½ (as it adds
N(0, (z_Δ C_t)²/r) to its update), so no bit leaves a client un-noised and the shares' sum carries N(0, σ_b²)
(wired for dp-fedavg: ``strategies.client_level``). By Thm 1 the pair (noisy update sum with
multiplier z_Δ, noisy count with σ_b) is one Gaussian mechanism with multiplier z, z⁻² = z_Δ⁻² + (2σ_b)⁻²:
:func:`update_noise_multiplier` gives z_Δ for a target z.

Under SecAgg+ (continuous Gaussian shares) the share is not a metric: it rides as one extra coordinate of the vector
each client masks, scaled by :func:`count_share_scale` so that SecAgg+'s quantizer treats it with the same relative
precision as the update coordinates, and the server learns only the sum of the r' survivors' shares
(:func:`split_count_coordinate`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from strategies.privacy.mechanisms import ClientLevelDP

FloatArray = npt.NDArray[np.float64]

#: σ_b per expected client of a round when none is given: σ_b = r/20 (Andrew et al. 2021, Sec. 3), so the noise on
#: the unclipped fraction b̄ has std 1/20 whatever r
DEFAULT_COUNT_NOISE_PER_CLIENT = 1.0 / 20.0


@dataclass(frozen=True)
class AdaptiveClipConfig:
    """γ = ``target_quantile`` ∈ (0, 1), η_C = ``learning_rate`` > 0, σ_b = ``count_noise_std`` > 0 (std of the
    noise on the centred bit sum), C_0 = ``initial_clip`` > 0."""

    target_quantile: float
    learning_rate: float
    count_noise_std: float
    initial_clip: float

    def __post_init__(self) -> None:
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile}")
        for name in ("learning_rate", "count_noise_std", "initial_clip"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")


def unclipped_bits(norms: FloatArray, clip: float) -> FloatArray:
    """b_i = 1[‖Δ_i‖ ≤ C] as floats."""
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip must be a finite number > 0, got {clip}")
    values = np.asarray(norms, dtype=np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"norms must be a 1-D array of finite numbers >= 0, got {norms}")
    return (values <= clip).astype(np.float64)


def noisy_unclipped_fraction(bits: FloatArray, expected_clients: float, count_noise: float) -> float:
    """b̄ = (Σ (b_i − ½) + ``count_noise``) / r + ½, with r = ``expected_clients`` and ``count_noise`` the drawn
    N(0, σ_b²) sample (0 for the non-private estimate)."""
    if not (expected_clients > 0 and math.isfinite(expected_clients)):
        raise ValueError(f"expected_clients must be a finite number > 0, got {expected_clients}")
    if not math.isfinite(count_noise):
        raise ValueError(f"count_noise must be finite, got {count_noise}")
    b = np.asarray(bits, dtype=np.float64)
    if b.ndim != 1 or not np.all((b == 0) | (b == 1)):
        raise ValueError(f"bits must be a 1-D array of zeros and ones, got {bits}")
    return float(np.sum(b - 0.5) + count_noise) / expected_clients + 0.5


def geometric_clip_update(clip: float, fraction: float, target_quantile: float, learning_rate: float) -> float:
    """C_{t+1} = C_t · exp(−η_C (b̄ − γ)) (Andrew et al. 2021, Alg. 1, geometric update)."""
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip must be a finite number > 0, got {clip}")
    if not math.isfinite(fraction):
        raise ValueError(f"fraction must be finite, got {fraction}")
    if not 0 < target_quantile < 1:
        raise ValueError(f"target_quantile must be in (0, 1), got {target_quantile}")
    if not (learning_rate > 0 and math.isfinite(learning_rate)):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate}")
    return clip * math.exp(-learning_rate * (fraction - target_quantile))


def update_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−½): the update-sum multiplier that, with count noise σ_b, spends what one Gaussian
    mechanism with multiplier z spends (Andrew et al. 2021, Thm 1). Needs σ_b > z/2."""
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
    if not (count_noise_std > 0 and math.isfinite(count_noise_std)):
        raise ValueError(f"count_noise_std must be a finite number > 0, got {count_noise_std}")
    if count_noise_std <= noise_multiplier / 2:
        raise ValueError(f"count_noise_std {count_noise_std} must exceed noise_multiplier/2 = "
                         f"{noise_multiplier / 2}: the count alone would spend the whole budget of z = "
                         f"{noise_multiplier}")
    return float((noise_multiplier**-2 - (2.0 * count_noise_std) ** -2) ** -0.5)


class AdaptiveClip:
    """The clip-norm state of Alg. 1: :meth:`step` takes a round's update norms (before clipping), draws the count
    noise from ``rng`` and returns C_{t+1}; :attr:`clip` is the norm to use for the round."""

    def __init__(self, config: AdaptiveClipConfig) -> None:
        self.config = config
        self.clip = config.initial_clip

    def step(self, norms: FloatArray, expected_clients: float, rng: np.random.Generator) -> float:
        cfg = self.config
        noise = float(rng.normal(0.0, cfg.count_noise_std))
        fraction = noisy_unclipped_fraction(unclipped_bits(norms, self.clip), expected_clients, noise)
        self.clip = geometric_clip_update(self.clip, fraction, cfg.target_quantile, cfg.learning_rate)
        return self.clip


def default_count_noise(expected_clients: float) -> float:
    """σ_b = r/20 (Andrew et al. 2021, Sec. 3): the unclipped fraction's noise std is 0.05."""
    return DEFAULT_COUNT_NOISE_PER_CLIENT * float(expected_clients)


def round_mechanism(dp: ClientLevelDP, clip: float, update_multiplier: float) -> ClientLevelDP:
    """The mechanism the *update* of an adaptive round carries: clip C_t, multiplier z_Δ in place of z (each client
    then adds N(0, (z_Δ C_t)²/r_t)). The budget is still charged for ``dp`` (z): with the count noise, the pair is
    one Gaussian with multiplier z (:func:`update_noise_multiplier`)."""
    return dataclasses.replace(dp, clip=float(clip), noise_multiplier=float(update_multiplier))


def noisy_centred_bit(norm: float, clip: float, noise_std: float, rng: np.random.Generator) -> float:
    """One client's share of the noisy count: b_i − ½ + N(0, ``noise_std``²), b_i = 1[``norm`` ≤ C]. With
    ``noise_std`` = σ_b/√r each of the r shares is itself a Gaussian mechanism with multiplier 2σ_b/√r (sensitivity
    ½), and their sum carries N(0, σ_b²)."""
    bit = float(unclipped_bits(np.array([norm], dtype=np.float64), clip)[0])
    return bit - 0.5 + float(rng.normal(0.0, noise_std))


def fraction_from_noisy_sum(noisy_sum: float, expected_clients: float) -> float:
    """b̄ = (Σ (b_i − ½) + N(0, σ_b²)) / r + ½ from the already noised sum of centred bits (Sec. 3)."""
    return noisy_unclipped_fraction(np.zeros(0), expected_clients, float(noisy_sum))


#: SecAgg+'s quantizer clips every coordinate to ±(range); the range is the coordinate's bound plus this many stds of
#: its noise, so the quantizer clips a legitimate value with probability < e⁻⁷²
SECAGG_RANGE_STDS = 12.0


def secagg_update_range(clip: float, noise_std: float) -> float:
    """SecAgg+'s per-coordinate clipping range for an update clipped to C with per-client noise std s: C + 12 s."""
    return float(clip) + SECAGG_RANGE_STDS * float(noise_std)


def count_share_scale(update_range: float, count_share_std: float) -> float:
    """The factor the centred noisy bit is multiplied by before it enters SecAgg+'s sum as the extra coordinate.

    The share b_i − ½ + N(0, s_b²) lies within ½ + 12 s_b (s_b = σ_b/√r_t) as the update coordinates lie within
    ``update_range`` = C_t + 12·z_Δ C_t/√r_t; the scale maps the first range onto the second, so the quantizer
    (2^22 levels over ±``update_range``) rounds the share with step 2(½ + 12 s_b)/2^22, the same fraction of its
    range as an update coordinate, and clips it with the same negligible probability. Server and clients compute
    it from the round's public C_t, r_t and the run-config's z_Δ, σ_b; it is post-processing of the noised share."""
    if not (update_range > 0 and math.isfinite(update_range)):
        raise ValueError(f"update_range must be a finite number > 0, got {update_range}")
    if not (count_share_std >= 0 and math.isfinite(count_share_std)):
        raise ValueError(f"count_share_std must be a finite number >= 0, got {count_share_std}")
    return float(update_range) / (0.5 + SECAGG_RANGE_STDS * float(count_share_std))


def split_count_coordinate(total: FloatArray, update_dim: int, scale: float) -> tuple[FloatArray, float]:
    """(the update part, Σ_i (b_i − ½ + noise)) of a secure sum of ``update_dim`` + 1 coordinates whose last one is
    the clients' shares times ``scale`` (:func:`count_share_scale`); ``ValueError`` for any other length."""
    values = np.asarray(total, dtype=np.float64)
    if values.ndim != 1 or values.shape[0] != int(update_dim) + 1:
        raise ValueError(f"the secure sum has shape {values.shape}, expected ({int(update_dim) + 1},): the update's "
                         f"{int(update_dim)} coordinates and one count coordinate")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    return values[:-1], float(values[-1]) / float(scale)
