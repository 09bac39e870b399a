"""SoteriaFL (Li, Zhao, Chi et al., NeurIPS 2022): local-DP federated learning with shifted compression.

What it protects: every *record* of every client's local dataset, against anyone who sees that
client's messages — the server included (record-level **local** DP, untrusted server). Each
client clips per-sample gradients to G, adds Gaussian noise N(0, σ_p² I) to its gradient
estimator itself (Alg. 2 line 4 / Alg. 3 line 12) and only then compresses; compression and the
shift are post-processing (paper App. A, Lemma 5). σ_p is calibrated with the standard
subsampled-Gaussian accountant (``strategies.privacy``) for ``dp-rounds``
rounds; :func:`theorem2_sigma` gives the paper's Eq. (4) value for comparison only. See
``docs/privacy_soteriafl.md`` for the sensitivity analysis of each estimator.

One communication round = one step of Algorithm 2/3:

* client i: estimator g̃_i (SGD / GD / SVRG / SAGA, :func:`client_step`), g_i = g̃_i + ξ_i,
  message v_i = C(g_i − s_i) with random-k (k values + mask seed on the wire), s_i += γ v_i;
* server: v = s + (1/n) Σ v_i, x ← x − η v, s ← s + γ (1/n) Σ v_i (:class:`ServerState`).

Baselines (Sec. 6): ``cdp-sgd`` = direct compression C(g_i) (Algorithm 1), ``ldp-sgd`` /
``ldp-svrg`` = no compression (dense g_i). The math here is framework-free (numpy + torch);
:class:`SoteriaFLStrategy` is the thin Flower glue on the server side.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.common import Scalar
from torch import nn
from torch.func import functional_call, grad, vmap

from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate, Reply
from strategies.compression import rand_k_compress, rand_k_decompress
from strategies.errors import ConfigError
from strategies.privacy import threat_models
from strategies.privacy.accountants import History, epsilon_of
from strategies.privacy.calibration import calibrate, noise_floor
from strategies.privacy.mechanisms import NORM_ALLOWANCE_SIGMAS
from strategies.server.validation import number_metrics, parse_client_id

# ---------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """An algorithm of the family: local gradient estimator × compression mode."""

    name: str
    estimator: str  # sgd | gd | svrg | saga
    compression: str  # shifted (Alg. 2/3) | direct (Alg. 1) | none


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("soteriafl-sgd", "sgd", "shifted"),
    Method("soteriafl-gd", "gd", "shifted"),
    Method("soteriafl-svrg", "svrg", "shifted"),
    Method("soteriafl-saga", "saga", "shifted"),
    Method("cdp-sgd", "sgd", "direct"),
    Method("ldp-sgd", "sgd", "none"),
    Method("ldp-svrg", "svrg", "none"),
)}

#: a SAGA gradient table larger than this (bytes, float32) is refused before training
SAGA_TABLE_LIMIT_BYTES = 512 * 2**20


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"strategy {name!r} is not a SoteriaFL-family method; valid: {sorted(METHODS)}")
    return METHODS[name]


# ---------------------------------------------------------------------------------- compression


def default_k(d: int) -> int:
    """k = ⌊d/20⌋ (Sec. 6: 5% of the coordinates), at least 1."""
    return max(1, d // 20)


def shift_stepsize(omega: float) -> float:
    """γ = sqrt((1 + 2ω) / (2(1 + ω)³)) (Theorem 3 / Corollaries 1-3); γ = 1/2 for ω = 0."""
    return math.sqrt((1.0 + 2.0 * omega) / (2.0 * (1.0 + omega) ** 3))


def mask_seed(round_seed: int, client_id: int) -> int:
    """Seed of client ``client_id``'s random-k mask in a round (independent masks across clients, Def. 1)."""
    return int(np.random.SeedSequence([int(round_seed), 503, int(client_id)]).generate_state(1)[0] >> 1)


def shifted_message(g: np.ndarray, shift: np.ndarray, k: int, seed: int, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 2 lines 5-6: wire values of v_i = C(g_i − s_i) and the new shift s_i + γ v_i.

    The shift is updated with the *float32 wire values* so client and server shifts stay equal.
    """
    values = rand_k_compress(g - shift, k, seed)
    return values, shift + gamma * rand_k_decompress(values, g.shape[0], seed)


# ---------------------------------------------------------------------------------- privacy


def sensitivities(estimator: str, clip: float) -> tuple[float, float]:
    """(G_A, G_B) of Lemma 1: SGD/GD (G, 0); SVRG/SAGA (2G, G) with each per-sample gradient clipped to G."""
    if estimator in ("sgd", "gd"):
        return clip, 0.0
    if estimator in ("svrg", "saga"):
        return 2.0 * clip, clip
    raise ValueError(f"unknown estimator {estimator!r}")


def noise_history(estimator: str, sigma_p: float, clip: float, batch_size: int, m: int, rounds: int,
                  split: float = 1.0) -> History:
    """Subsampled-Gaussian history ``[(z, q, T), ...]`` of T rounds with per-coordinate noise std σ_p.

    * SGD: A = (1/b) Σ_{j∈I} clip(∇f_j), I Poisson with q = b/m; sensitivity G/b → z = σ_p b / G.
    * GD: A over all m records (q = 1); sensitivity G/m → z = σ_p m / G.
    * SVRG/SAGA: g̃ = A + B with A = (1/b) Σ_{j∈I} φ_j (‖φ_j‖ ≤ G_A = 2G, q = b/m) and
      B = (1/m) Σ_j ψ_j (‖ψ_j‖ ≤ G_B = G, all records, q = 1). As in App. A.2 (Eq. 11) the noise
      is split ξ = ξ_1 + ξ_2 with variances split·σ_p², (1 − split)·σ_p²; the output is
      post-processing of (A + ξ_1, B + ξ_2), so the two Gaussian mechanisms compose.
    * SAGA's A term is charged at q = 1, without amplification: its table holds, for the differing record, the
      gradient from the last round that sampled it, so the batch coins leave a hidden state whose posterior differs
      between neighbours. Conditioned on every coin (data-independent, the same law under both neighbours) each
      round is the pair of Gaussian mechanisms above; the release is a mixture over the coins with equal weights
      under both neighbours, and joint convexity bounds it by the conditional, unamplified composition
      (docs/privacy_soteriafl.md). SVRG's snapshot is shared by all records, so its batch coins are fresh each round
      and amplify as usual.
    """
    q = batch_size / m
    if estimator == "sgd":
        return [(sigma_p * batch_size / clip, q, rounds)]
    if estimator == "gd":
        return [(sigma_p * m / clip, 1.0, rounds)]
    if not 0 < split < 1:
        raise ValueError(f"noise split must be in (0, 1) for {estimator}, got {split}")
    ga, gb = sensitivities(estimator, clip)
    q_a = 1.0 if estimator == "saga" else q
    return [(math.sqrt(split) * sigma_p * batch_size / ga, q_a, rounds),
            (math.sqrt(1.0 - split) * sigma_p * m / gb, 1.0, rounds)]


_SPLITS = (2 / 3, 0.9, 0.97)


@functools.lru_cache(maxsize=64)
def calibrate_sigma(estimator: str, epsilon: float, delta: float, clip: float, batch_size: int, m: int,
                    rounds: int, accountant: str = "rdp", rtol: float = 1e-2) -> tuple[float, float]:
    """Smallest σ_p (to ``rtol``) whose :func:`noise_history` over ``rounds`` spends ≤ ε; returns (σ_p, split).

    Always ε(σ_p) ≤ target (the bisection keeps the upper end); ``rtol`` only bounds the slack.

    For SVRG/SAGA the split of σ_p² between the two terms is chosen from a small grid (the one
    with the smallest σ_p); the paper's proof uses 2/3.

    The search starts at, and never probes below, :func:`~strategies.privacy.calibration.noise_floor`: a
    closed-form σ_p under which ε certainly exceeds the target. Starting at σ_p = G/m instead (z = b/m ≈ 0.007
    for SVRG's subsampled term at m = 2930, b = m^{2/3}/4 of Corollary 2) made dp_accounting's PLD allocate
    more than 6 GB in one accountant call.
    """
    if not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"need epsilon > 0 and delta in (0, 1), got {epsilon}, {delta}")
    if not 1 <= batch_size <= m:
        raise ValueError(f"batch size b={batch_size} must be in 1..m={m}")
    splits = (1.0,) if estimator in ("sgd", "gd") else _SPLITS
    best: tuple[float, float] | None = None
    for split in splits:
        def epsilon_at(s: float, split: float = split) -> float:
            return epsilon_of(noise_history(estimator, s, clip, batch_size, m, rounds, split), delta, accountant)

        floor = noise_floor(noise_history(estimator, 1.0, clip, batch_size, m, rounds, split), epsilon, delta)
        if not math.isfinite(floor):
            raise ValueError(f"cannot reach epsilon {epsilon} at delta {delta} with any noise std sigma_p")
        sigma = calibrate(epsilon_at, epsilon, start=max(floor, clip / m), rtol=rtol, what="noise std sigma_p",
                          lower=floor)
        if best is None or sigma < best[0]:
            best = (sigma, split)
    assert best is not None
    return best


def theorem2_sigma(estimator: str, epsilon: float, delta: float, clip: float, m: int, rounds: int,
                   c: float = 1.0) -> float:
    """Paper Eq. (4): σ_p = sqrt(c (G_A²/4 + G_B²) T log(1/δ) / (m² ε²)); c is an unspecified constant.

    Comparison only: never used to train (the reference code uses c ∈ {8, 12, 96}).
    """
    ga, gb = sensitivities(estimator, clip)
    return math.sqrt(c * (ga**2 / 4 + gb**2) * rounds * math.log(1 / delta) / (m**2 * epsilon**2))


def default_batch_size(estimator: str, m: int, *, epsilon: float, delta: float, clip: float, d: int, omega: float,
                       n: int) -> int:
    """Minibatch b: SGD Corollary 1 (b = m ε G √β / √((1+ω) d log(1/δ)), β = τ/(2(1+ω)), τ = (1+ω)^{3/2}/√n,
    with L = 1 as in the reference code); SVRG Corollary 2 (m^{2/3}/4); SAGA Corollary 3 (3 m^{2/3}); GD b = m."""
    if estimator == "gd":
        return m
    if estimator == "svrg":
        b = int(m ** (2 / 3) / 4)
    elif estimator == "saga":
        b = int(3 * m ** (2 / 3))
    else:
        tau = (1 + omega) ** 1.5 / math.sqrt(n)
        beta = tau / (2 * (1 + omega))
        b = int(m * epsilon * clip * math.sqrt(beta) / math.sqrt((1 + omega) * d * math.log(1 / delta)))
    return int(min(max(b, 1), m))


# ---------------------------------------------------------------------------------- gradients


CHUNK_BYTES = 16 << 20  # GradientOracle.clipped_sum: float64 per-sample rows a chunk, under glibc's 32 MiB mmap limit


class GradientOracle:
    """Per-sample gradients of f_j(x) = CE(model_x(a_j), b_j) + reg(x) on one dataset (torch.func).

    ``reg`` is SoteriaFL's nonconvex regularizer λ Σ x_l²/(1 + x_l²) when the model carries
    ``nonconvex_lambda`` (Sec. 6.1); it is part of every f_j, as in the paper.
    Vectors are flat numpy arrays in ``state_dict`` order (the Flower wire order).
    """

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device | str = "cpu",
                 chunk: int = 512) -> None:
        if dict(model.named_buffers()):
            raise ValueError("GradientOracle supports models without buffers only")
        self.model = model.to(device)
        self.device = torch.device(device)
        self.names = [n for n, _ in model.named_parameters()]
        if self.names != list(model.state_dict().keys()):
            raise ValueError("model parameters and state_dict differ in order")
        self.shapes = [tuple(p.shape) for p in model.parameters()]
        self.sizes = [int(np.prod(s)) if s else 1 for s in self.shapes]
        self.dim = int(sum(self.sizes))
        self.x = torch.tensor(np.asarray(x, dtype=np.float32), device=self.device)
        self.y = torch.tensor(np.asarray(y, dtype=np.int64), device=self.device)
        self.m = len(self.y)
        self.lam = float(getattr(model, "nonconvex_lambda", 0.0))
        self.chunk = chunk

        def loss_one(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, params, (xb.unsqueeze(0),))
            return F.cross_entropy(out, yb.unsqueeze(0))

        self._per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def _params(self, flat: np.ndarray) -> dict[str, torch.Tensor]:
        t = torch.as_tensor(np.asarray(flat, dtype=np.float32), device=self.device)
        out, off = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out[name] = t[off:off + size].reshape(shape)
            off += size
        return out

    def reg_value_grad(self, flat: np.ndarray) -> tuple[float, np.ndarray]:
        """λ Σ w²/(1+w²) and its gradient 2λ w/(1+w²)²."""
        if self.lam == 0.0:
            return 0.0, np.zeros(self.dim)
        w = np.asarray(flat, dtype=np.float64)
        return float(self.lam * np.sum(w**2 / (1 + w**2))), 2 * self.lam * w / (1 + w**2) ** 2

    def per_sample(self, flat: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Unclipped ∇f_j(x) for j ∈ idx, shape (len(idx), d), float64."""
        params = self._params(flat)
        _, reg_g = self.reg_value_grad(flat)
        rows = []
        for start in range(0, len(idx), self.chunk):
            sel = torch.as_tensor(idx[start:start + self.chunk], device=self.device)
            with torch.no_grad():
                g = self._per_sample(params, self.x[sel], self.y[sel])
            rows.append(torch.cat([g[n].reshape(len(sel), -1) for n in self.names], 1).double().cpu().numpy())
        out = np.concatenate(rows, 0) if rows else np.zeros((0, self.dim))
        grads: np.ndarray = out + reg_g[None, :]
        return grads

    def _clipped_chunks(self, flat: np.ndarray, idx: np.ndarray, clip: float) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        """Per chunk of ``idx``: each layer's per-sample rows (float64; one row of all of them with the regularizer)
        and the clip factors min(1, G/‖∇f_j‖), a row with a NaN or ±inf coordinate zeroed with factor 0. A chunk
        holds at most ``CHUNK_BYTES`` of rows, so its buffers are reused from the heap, not mapped afresh."""
        params = self._params(flat)
        _, reg_g = self.reg_value_grad(flat)
        reg = torch.as_tensor(reg_g, device=self.device) if self.lam else None
        rows = max(1, min(self.chunk, CHUNK_BYTES // (8 * self.dim)))
        for start in range(0, len(idx), rows):
            sel = torch.as_tensor(idx[start:start + rows], device=self.device)
            with torch.no_grad():
                g = self._per_sample(params, self.x[sel], self.y[sel])
                layers = [g[n].reshape(len(sel), -1).double() for n in self.names]
                if reg is not None:  # the regularizer's gradient is part of every f_j, hence of its norm
                    layers = [torch.cat(layers, 1) + reg]
                norms = torch.sqrt(sum(torch.linalg.vector_norm(w, dim=1) ** 2 for w in layers))
                bad = ~torch.isfinite(norms)
                if bool(bad.any()):
                    layers = [torch.where(bad[:, None], 0.0, w) for w in layers]
                    norms = torch.where(bad, 0.0, norms)
                yield layers, torch.clamp(clip / torch.clamp(norms, min=1e-12), max=1.0)

    def clipped(self, flat: np.ndarray, idx: np.ndarray, clip: float) -> np.ndarray:
        """clip_G(∇f_j(x)) = min(1, G/‖∇f_j‖) ∇f_j for j ∈ idx (Sec. 6), shape (len(idx), d), float64; a ∇f_j with a
        NaN or ±inf coordinate counts as 0 (min(1, G/∞)·∞ is NaN), so every term has norm ≤ G whatever the model and
        the record."""
        parts = [torch.cat(layers, 1) * factor[:, None] for layers, factor in self._clipped_chunks(flat, idx, clip)]
        clipped: np.ndarray = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, self.dim))
        return clipped

    def clipped_sum(self, flat: np.ndarray, idx: np.ndarray, clip: float) -> np.ndarray:
        """Σ_{j ∈ idx} clip_G(∇f_j(x)), the terms as :meth:`clipped`'s, without keeping a clipped row: per chunk,
        each layer's rows times the clip factors (one matrix-vector product); the 784-64-10 network's 5,400 records
        take ~1.1 s instead of 8-10 s as 512-row numpy chunks."""
        out = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        for layers, factor in self._clipped_chunks(flat, idx, clip):
            out += torch.cat([factor @ w for w in layers])
        total: np.ndarray = out.cpu().numpy()
        return total

    def loss_and_grad(self, flat: np.ndarray) -> tuple[float, np.ndarray]:
        """f(x) = (1/m) Σ_j f_j(x) and the exact (unclipped) ∇f(x) — the utility metric's gradient."""
        params = {k: v.clone().requires_grad_(True) for k, v in self._params(flat).items()}
        total = 0.0
        grads = [torch.zeros_like(p) for p in params.values()]
        for start in range(0, self.m, 4096):
            xb, yb = self.x[start:start + 4096], self.y[start:start + 4096]
            loss = F.cross_entropy(functional_call(self.model, params, (xb,)), yb, reduction="sum")
            gs = torch.autograd.grad(loss, list(params.values()))
            grads = [a + b for a, b in zip(grads, gs)]
            total += float(loss.detach())
        g = torch.cat([t.reshape(-1) for t in grads]).double().cpu().numpy() / self.m
        reg_v, reg_g = self.reg_value_grad(flat)
        return total / self.m + reg_v, g + reg_g


# ---------------------------------------------------------------------------------- client


@dataclass
class ClientState:
    """What a client keeps across rounds (Flower ``Context.state``): shift, SVRG snapshot, SAGA table."""

    shift: np.ndarray | None = None  # s_i
    snapshot: np.ndarray | None = None  # SVRG w
    snapshot_grad: np.ndarray | None = None  # (1/m) Σ_j clip(∇f_j(w))
    table: np.ndarray | None = None  # SAGA clip(∇f_j(w_j)), (m, d) float32
    table_mean: np.ndarray | None = None
    rounds: int = 0

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in (("shift", self.shift), ("snapshot", self.snapshot),
                                  ("snapshot_grad", self.snapshot_grad), ("table", self.table),
                                  ("table_mean", self.table_mean)) if v is not None}


@dataclass
class StepResult:
    """One client round: the wire values, the dense message the server will decode, diagnostics."""

    values: np.ndarray  # float32: k values (compressed) or d values (none)
    message: np.ndarray  # dense decoded message (what the server reconstructs)
    batch: int  # realized Poisson batch size |I|
    grads_computed: int  # per-sample gradients evaluated this round
    info: dict[str, Any] = field(default_factory=dict)


def client_step(method: Method, oracle: GradientOracle, x: np.ndarray, state: ClientState, *, clip: float,
                batch_size: int, sigma_p: float, k: int, gamma: float, rng: np.random.Generator, seed: int,
                refresh_snapshot: bool) -> StepResult:
    """Alg. 3 lines 3-14 for one client: estimator at x_t, noise, (shifted) compression; mutates ``state``."""
    d, m = oracle.dim, oracle.m
    if x.shape != (d,):
        raise ValueError(f"model vector has {x.shape} entries, the model has {d}")
    est = method.estimator
    all_idx = np.arange(m)
    grads = 0
    if est == "gd":
        idx = all_idx
        g = oracle.clipped_sum(x, idx, clip) / m
        grads += m
    else:
        idx = np.flatnonzero(rng.random(m) < batch_size / m)  # Poisson sampling, q = b/m
        if est == "sgd":
            g = oracle.clipped_sum(x, idx, clip) / batch_size
            grads += len(idx)
        elif est == "svrg":
            if state.snapshot is None:  # w^0 = x^0
                state.snapshot = x.copy()
                state.snapshot_grad = oracle.clipped_sum(x, all_idx, clip) / m
                grads += m
            a = oracle.clipped_sum(x, idx, clip) - oracle.clipped_sum(state.snapshot, idx, clip)
            g = a / batch_size + state.snapshot_grad
            grads += 2 * len(idx)
            if refresh_snapshot:  # line 7: w^{t+1} = x^t with probability p
                state.snapshot = x.copy()
                state.snapshot_grad = oracle.clipped_sum(x, all_idx, clip) / m
                grads += m
        elif est == "saga":
            if state.table is None:  # w_{i,j}^0 = x^0
                state.table = oracle.clipped(x, all_idx, clip).astype(np.float32)
                state.table_mean = state.table.astype(np.float64).mean(0)
                grads += m
            new = oracle.clipped(x, idx, clip)
            old = state.table[idx].astype(np.float64)
            g = (new - old).sum(0) / batch_size + state.table_mean
            grads += len(idx)
            state.table[idx] = new.astype(np.float32)  # line 10
            state.table_mean = state.table.astype(np.float64).mean(0)
        else:  # pragma: no cover
            raise ValueError(f"unknown estimator {est!r}")
    if not np.all(np.isfinite(g)):  # clipped terms are finite; a non-finite state sends the noise alone
        g = np.zeros(d)
    g = g + rng.normal(0.0, sigma_p, size=d)  # privacy: g_i = g̃_i + ξ_i
    if method.compression == "shifted":
        if state.shift is None:
            state.shift = np.zeros(d)  # s_i^0 = 0
        values, state.shift = shifted_message(g, state.shift, k, seed, gamma)
        message = rand_k_decompress(values, d, seed)
    elif method.compression == "direct":
        values = rand_k_compress(g, k, seed)
        message = rand_k_decompress(values, d, seed)
    else:
        values = g.astype(np.float32)
        message = values.astype(np.float64)
    state.rounds += 1
    return StepResult(values, message, len(idx), grads)


def payload_bits(method: Method, num_values: int) -> int:
    """Information on the wire: 32 bits per float32 value, plus a 64-bit mask seed when compressed."""
    return 32 * num_values + (64 if method.compression != "none" else 0)


# ---------------------------------------------------------------------------------- server


def message_norm_bound(method: Method, *, clip: float, sigma_p: float, sample_rate: float, dim: int, k: int,
                       gamma: float, rounds: int) -> float | None:
    """An ℓ2 norm no honest client message v_i (dense, as decoded) exceeds except with probability ≤ e⁻⁷² (None
    when the shift step admits no bound).

    The estimator g̃ (per-sample terms clipped to G, a Poisson batch |I| ≤ m of expected size b = q m) has
    ‖g̃‖ ≤ G_est: G/q for SGD, G for GD, 2G/q + G for SVRG and SAGA; the message carries g = g̃ + N(0, σ_p² I_d).
    Uncompressed: ‖v‖ ≤ G_est + σ_p(√d + t). Direct random-k, v = (d/k) g on k coordinates: (d/k)(G_est + σ_p(√k + t)).
    Shifted (Alg. 2 line 5), v = C(g − s_i): each selected shift coordinate moves s ← (1 − a)s + a g with
    a = γ d/k, so |s_j| ≤ ρ M, ρ = 1 for a ≤ 1 and a/(2 − a) for a < 2, M = G_est + σ_p(√(2 ln(2 d T)) + t) the
    largest |g_j| over the d coordinates of T rounds; hence (d/k)(G_est + σ_p(√k + t) + ρ √k M). t = 12.
    """
    t = NORM_ALLOWANCE_SIGMAS
    q = 1.0 if method.estimator == "gd" else sample_rate
    g_est = clip / q if method.estimator in ("sgd", "gd") else 2.0 * clip / q + clip
    if method.compression == "none":
        return g_est + sigma_p * (math.sqrt(dim) + t)
    kept = g_est + sigma_p * (math.sqrt(k) + t)
    if method.compression == "direct":
        return dim / k * kept
    a = gamma * dim / k
    if a >= 2:
        return None
    rho = 1.0 if a <= 1 else a / (2.0 - a)
    largest = g_est + sigma_p * (math.sqrt(2.0 * math.log(2.0 * dim * max(rounds, 1))) + t)
    return dim / k * (kept + rho * math.sqrt(k) * largest)


@dataclass
class ServerState:
    """The server's x-update and shift s = (1/n) Σ s_i (Alg. 2 lines 8-10)."""

    method: Method
    dim: int
    eta: float
    gamma: float
    # None is only the constructor's default: __post_init__ replaces it by zeros(dim), so the attribute is
    # never None after construction (a dataclass cannot type the argument and the attribute apart).
    shift: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.shift is None:
            self.shift = np.zeros(self.dim)

    def direction(self, messages: Sequence[np.ndarray], num_clients: int) -> tuple[np.ndarray, np.ndarray]:
        """(v, mean message). Shifted: v = s + (1/n) Σ v_i over the n clients of the round (a missing
        client contributes v_i = 0, i.e. its unchanged shift); direct/none: v = mean of received."""
        if not messages:
            raise ValueError("no client message")
        total = np.sum(np.asarray(messages, dtype=np.float64), axis=0)
        if self.method.compression == "shifted":
            mean = total / max(num_clients, len(messages))
            return self.shift + mean, mean
        mean = total / len(messages)
        return mean, mean

    def step(self, x: np.ndarray, messages: Sequence[np.ndarray], num_clients: int) -> np.ndarray:
        v, mean = self.direction(messages, num_clients)
        self.update_shift(mean)
        return x - self.eta * v

    def update_shift(self, mean: np.ndarray) -> None:
        if self.method.compression == "shifted":
            self.shift = self.shift + self.gamma * mean


# ---------------------------------------------------------------------------------- Flower strategy


def fit_seed(seed: int, server_round: int) -> int:
    """The round's public seed sent with x_t (mask seeds and SVRG snapshot coin derive from it)."""
    return int(np.random.SeedSequence([int(seed), 502, int(server_round)]).generate_state(1)[0] >> 1)


def snapshot_coin(round_seed: int, client_id: int, p: float) -> bool:
    """Client i's SVRG refresh coin of a round, P = p (Alg. 3 line 7); data-independent."""
    return bool(np.random.default_rng([int(round_seed), 504, int(client_id)]).random() < p)


class SoteriaFLStrategy(DPFLStrategy):
    """Server of SoteriaFL and its baselines: decodes random-k payloads, steps x ← x − η v, keeps the shift.

    ``server-lr`` must be 1: the aggregate returned to the base class is −η·v.
    """

    name = "soteriafl"
    privacy = threat_models.RECORD_LOCAL_SOTERIAFL

    def __init__(self, *, method: Method, eta: float, k: int, gamma: float, clip: float = 1.0,
                 metrics_oracle: GradientOracle | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.server_lr != 1.0:
            raise ConfigError(f"run-config 'server-lr' = {self.server_lr} must be 1 for {method.name} "
                              "(the step size is 'soteriafl-eta')")
        self.method = method
        self.name = method.name
        self.clip = float(clip)
        self.k = k if method.compression != "none" else self.num_params
        self.server = ServerState(method, self.num_params, eta, gamma)
        self.metrics_oracle = metrics_oracle
        self.payload_bits_total = 0
        self.uplink_bits_total = 0
        self.grad_norm_sq_sum = 0.0
        self.grad_norm_count = 0
        self._pending_mean: np.ndarray | None = None

    # ---- checkpoint ---------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """Server state to checkpoint: x, the shift s and the bit counters."""
        return {"weights": [w.copy() for w in self.current_weights], "shift": self.server.shift.copy(),
                "payload_bits_total": self.payload_bits_total, "uplink_bits_total": self.uplink_bits_total}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        shift = np.asarray(state["shift"], dtype=np.float64)
        if shift.shape != (self.num_params,):
            raise ValueError(f"checkpoint shift has shape {shift.shape}, expected ({self.num_params},)")
        self.current_weights = [np.asarray(w, dtype=np.float32) for w in state["weights"]]
        self.server.shift = shift
        self.payload_bits_total = int(state["payload_bits_total"])
        self.uplink_bits_total = int(state["uplink_bits_total"])

    # ---- hooks --------------------------------------------------------------------
    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        return {"soteriafl-method": self.method.name, "round-seed": fit_seed(self.seed, server_round)}

    def decode_update(self, server_round: int, reply: Reply, metrics: Mapping[str, Scalar]) -> np.ndarray:
        arrays = reply.arrays()
        if len(arrays) != 1:
            raise RejectedUpdate(f"expected 1 array of {self.k} values, got {len(arrays)} arrays")
        values = arrays[0]
        if values.dtype.kind != "f" or values.shape != (self.k,):
            raise RejectedUpdate(f"expected {self.k} float values, got shape {values.shape} dtype {values.dtype}")
        if not np.all(np.isfinite(values)):
            raise RejectedUpdate("payload contains NaN or Inf")
        if self.method.compression == "none":
            return values.astype(np.float64)
        expected = mask_seed(fit_seed(self.seed, server_round), int(metrics["client_id"]))
        if int(metrics.get("mask_seed", -1)) != expected:
            raise RejectedUpdate(f"mask_seed {metrics.get('mask_seed')!r} is not the round's seed {expected}")
        return rand_k_decompress(values, self.num_params, expected)

    def privacy_charge(self, server_round: int, record: Mapping[str, Any],
                       metrics: Mapping[str, Scalar]) -> tuple[History, float, str] | None:
        """One round of :func:`noise_history` from the declared (σ_p, b, m, split), fixed at first contact, under
        the declared record-level relation (``record_neighbours``; replace-one when absent), fixed likewise."""
        values = number_metrics(metrics, "sigma_p", "batch_size", "num_train", "delta")
        if values is None:
            return None
        sigma_p, b, m, delta = float(values[0]), int(values[1]), int(values[2]), float(values[3])
        split = float(metrics.get("noise_split", 1.0))
        try:
            history = noise_history(self.method.estimator, sigma_p, self.clip, b, m, 1, split)
        except (ValueError, ZeroDivisionError) as exc:
            raise RejectedUpdate(f"declared mechanism (sigma_p={sigma_p}, batch_size={b}, num_train={m}, "
                                 f"split={split}) is invalid: {exc}") from None
        if not (sigma_p > 0 and 1 <= b <= m and 0 < delta < 1):
            raise RejectedUpdate(f"declared mechanism (sigma_p={sigma_p}, batch_size={b}, num_train={m}, "
                                 f"delta={delta}) is not a valid subsampled Gaussian")
        return history, delta, self.fix_record_level(record, metrics, (sigma_p, b / m), "(sigma_p, b/m)")

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        """Reject a message above :func:`message_norm_bound` of the run's G, k, γ and the client's declared
        (σ_p, b/m), fixed at first contact: a bound whatever the round's size (none without a declaration)."""
        super().validate_update(update, metrics)
        cid = parse_client_id(metrics.get("client_id"))
        declared = self.declared.get(cid) if cid is not None else None
        if declared is None:
            return
        bound = message_norm_bound(self.method, clip=self.clip, sigma_p=declared[0], sample_rate=declared[1],
                                   dim=self.num_params, k=self.k, gamma=self.server.gamma,
                                   rounds=self.round_log.round or 1)
        norm = float(np.linalg.norm(update))
        if bound is not None and norm > bound * (1 + 1e-6):
            raise RejectedUpdate(f"message norm {norm:.6g} exceeds {bound:.6g}, the most a SoteriaFL client with the "
                                 f"declared sigma_p = {declared[0]:.6g} and b/m = {declared[1]:.6g} sends")

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        bits = [int(u.metrics.get("payload_bits", payload_bits(self.method, self.k))) for u in updates]
        for u, b in zip(updates, bits):
            u.record["payload_bits"] = b
        round_payload = int(sum(bits))
        round_uplink = 8 * int(sum(u.uplink_bytes for u in updates))
        self.payload_bits_total += round_payload
        self.uplink_bits_total += round_uplink
        return np.ones(len(updates)), {
            "payload_bits": round_payload, "payload_bits_total": self.payload_bits_total,
            "uplink_bits": round_uplink, "uplink_bits_total": self.uplink_bits_total,
            "k": self.k, "eta": self.server.eta, "gamma": self.server.gamma,
        }

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        n = self.clients_per_round if 0 < self.clients_per_round < self.num_available else self.num_available
        v, mean = self.server.direction([u.update for u in updates], n)
        self._pending_mean = mean
        return -self.server.eta * v

    def after_aggregate(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> None:
        if self._pending_mean is not None:
            self.server.update_shift(self._pending_mean)
            self._pending_mean = None

    def model_metrics(self, weights: list[np.ndarray]) -> dict[str, Any]:
        return {} if self.metrics_oracle is None else self.utility_metrics(weights)

    def utility_metrics(self, weights: list[np.ndarray]) -> dict[str, float]:
        """‖∇f(x_t)‖² and f(x_t) on the full training data; running mean of ‖∇f‖² (Theorem 3's quantity)."""
        assert self.metrics_oracle is not None
        flat = np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in weights])
        loss, g = self.metrics_oracle.loss_and_grad(flat)
        gn = float(g @ g)
        self.grad_norm_sq_sum += gn
        self.grad_norm_count += 1
        return {"train_loss": loss, "grad_norm_sq": gn, "grad_norm_sq_avg": self.grad_norm_sq_sum / self.grad_norm_count}


