"""DP2-FedSAM (Zhang et al., "Differentially Private and Personalized FL with SAM", Algorithm 2) and baselines.

What it protects: **client-level DP** — the participation and whole dataset of one client — for the
*shared* part of the model that leaves the client. Each sampled client clips its update Δφ to
‖Δ‖ ≤ C and adds Gaussian noise itself (local noising, honest-but-curious server, Sec. 3.1), via the
shared :class:`strategies.client_dp.ClientLevelDP`. The personal head h_i never leaves the client
and is not protected by DP (it is only ever used locally). The FT variants fine-tune the downloaded
global model locally for evaluation only; nothing of the fine-tuned model is sent.

Noise convention (the issue writes N(0, C²σ²/(rN))). In the paper r is the sampling *ratio* and
rN the number of clients sampled per round (Alg. 2 line 2); each of them adds N(0, C²σ²/(rN)·I)
(line 19) and the server averages φ ← φ + (1/(rN)) Σ Δ̂_i (line 25). Hence the *sum* of the rN
noisy updates carries N(0, C²σ²·I) — the Gaussian mechanism with multiplier σ on a sum of
sensitivity C (Lemma 4, Theorem 2). That is exactly ``ClientLevelDP`` with
``clients_per_round`` = rN (our r is a count, q = r/n): per-client std C·σ/√(rN) — note the paper
writes the *variance* C²σ²/(rN), i.e. std Cσ/√(rN), not Cσ/(rN). ε comes from the Opacus RDP/PRV
accountant with q = rN/N over T rounds (Theorem 2's closed form is only a sufficient bound), and
like ``client_dp.py`` it is the guarantee of the aggregate (secure aggregation assumed); a server
seeing single updates gets multiplier σ/√(rN) (reported as ``epsilon_individual``).

Framework-free math (numpy/torch only): φ/h split by parameter-name prefix
(:func:`head_parameter_names`), the SAM/ASAM step of Eq. 11–12 (:func:`sam_gradient`) and the local
training loops (:func:`train_local`). The Flower server strategy aggregates only φ (personalized
variants) or the whole model (DP-FedSAM, FT variants) with uniform weights 1/r.

Variants (Sec. 5): ``dp2-fedsam`` (head SGD τ_h epochs then SAM on φ τ_φ epochs), ``centaur``
(same with SGD instead of SAM), ``dp-fedsam`` (full model, SAM), ``dp-fedsam-ft`` and
``dp-fedavg-ft`` (full model, SAM / SGD, plus local fine-tuning before evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.common import Scalar
from flwr.server.client_manager import ClientManager
from torch import nn

from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate, StrategyContext, common_kwargs
from strategies.client_dp import ClientLevelDP, cached_epsilon, mechanism_from_config

NORM_SLACK_SIGMAS = 10.0  # ‖noise‖ ≤ s(√d + t) fails with probability ≤ exp(−t²/2)


@dataclass(frozen=True)
class Variant:
    """Which algorithm of the family a strategy name denotes."""

    personalized: bool  # share φ only, keep a personal head h_i on the client
    sam: bool  # SAM (Eq. 11–12) instead of plain SGD for the shared part
    finetune: bool  # fine-tune the global model locally before evaluation (FT baselines)


VARIANTS: dict[str, Variant] = {
    "dp2-fedsam": Variant(personalized=True, sam=True, finetune=False),
    "centaur": Variant(personalized=True, sam=False, finetune=False),
    "dp-fedsam": Variant(personalized=False, sam=True, finetune=False),
    "dp-fedsam-ft": Variant(personalized=False, sam=True, finetune=True),
    "dp-fedavg-ft": Variant(personalized=False, sam=False, finetune=True),
}


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"strategy {name!r} is not of the DP2-FedSAM family; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]


# ---------------------------------------------------------------------------------- φ / h split
def head_parameter_names(model: nn.Module, spec: str = "auto") -> list[str]:
    """``state_dict`` names of the personal head h (Sec. 3.3); everything else is φ.

    ``spec = "auto"``: the last ``nn.Linear`` module (the paper's "last fully connected layer",
    Sec. 5.1). Otherwise a comma-separated list of name prefixes (e.g. ``"fc"`` or
    ``"body.2,fc"``); a parameter belongs to h when its name equals a prefix or starts with
    ``prefix + "."``. Raises ``ValueError`` naming the spec when a prefix matches nothing or when
    h or φ would be empty.
    """
    names = list(model.state_dict().keys())
    if spec.strip() == "auto":
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linear:
            raise ValueError("head 'auto' needs an nn.Linear layer; the model has none")
        prefixes = [linear[-1]]
    else:
        prefixes = [p.strip() for p in spec.split(",") if p.strip()]
        if not prefixes:
            raise ValueError(f"head spec {spec!r} names no parameter prefix")
    head: list[str] = []
    for prefix in prefixes:
        match = [n for n in names if n == prefix or n.startswith(prefix + ".")]
        if not match:
            raise ValueError(f"head prefix {prefix!r} matches no parameter; parameters are {names}")
        head.extend(m for m in match if m not in head)
    if len(head) == len(names):
        raise ValueError(f"head spec {spec!r} covers every parameter: nothing would be shared (φ empty)")
    return [n for n in names if n in head]  # state_dict order


def shared_mask(model: nn.Module, head_spec: str, personalized: bool) -> list[bool]:
    """Per ``state_dict`` entry: True when it is shared with the server (φ, or everything)."""
    names = list(model.state_dict().keys())
    if not personalized:
        return [True] * len(names)
    head = set(head_parameter_names(model, head_spec))
    return [n not in head for n in names]


# ---------------------------------------------------------------------------------- SAM (Eq. 11–12)
def sam_gradient(params: Sequence[torch.Tensor], closure: Callable[[], torch.Tensor], rho: float,
                 adaptive: bool = False, eta: float = 0.01) -> torch.Tensor:
    """Leave ∇F(w + p(w)) in ``p.grad`` of every parameter; the parameters end at w again.

    Eq. 11: p = q·g/‖g‖ with g the minibatch gradient at w (SAM, Foret et al.). ASAM (Kwon et al.
    2021): p = q·T²g/‖Tg‖ with T = |w| + η elementwise. ``closure`` must zero the gradients, run the
    forward pass on the *same* minibatch and call ``backward``; it is called twice. The caller then
    steps the optimizer (Eq. 12: w ← w − η_φ ∇F(w + p)). Returns the loss at w.
    """
    if rho < 0:
        raise ValueError(f"SAM radius must be >= 0, got {rho}")
    loss = closure()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    with torch.no_grad():
        if adaptive:
            scale = [p.abs() + eta for p in params]
            norm = torch.sqrt(sum(((s * g) ** 2).sum() for s, g in zip(scale, grads)))
            eps = [rho * s * s * g / (norm + 1e-12) for s, g in zip(scale, grads)]
        else:
            norm = torch.sqrt(sum((g**2).sum() for g in grads))
            eps = [rho * g / (norm + 1e-12) for g in grads]
        for p, e in zip(params, eps):
            p.add_(e)
    closure()
    with torch.no_grad():
        for p, e in zip(params, eps):
            p.sub_(e)
    return loss


@dataclass
class LocalResult:
    steps: int
    loss: float


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, train_names: Sequence[str], epochs: int,
                batch_size: int, lr: float, momentum: float = 0.0, sam_rho: float | None = None,
                adaptive: bool = False, sam_eta: float = 0.01, seed: int = 0) -> LocalResult:
    """``epochs`` epochs of shuffled minibatch SGD (or SAM when ``sam_rho`` is set) on the parameters
    ``train_names`` only, the others held fixed (Alg. 2 lines 6–9 for h, 11–15 for φ)."""
    named = dict(model.named_parameters())
    missing = [n for n in train_names if n not in named]
    if missing:
        raise ValueError(f"no trainable parameters named {missing}")
    params = [named[n] for n in train_names]
    if epochs <= 0 or not params:
        return LocalResult(0, float("nan"))
    saved = {n: p.requires_grad for n, p in named.items()}
    for n, p in named.items():
        p.requires_grad_(n in set(train_names))
    model.train()
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    steps, total = 0, 0.0
    try:
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=gen)
            for start in range(0, len(y), batch_size):
                idx = perm[start:start + batch_size]
                xb, yb = x[idx], y[idx]

                def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
                    opt.zero_grad(set_to_none=False)
                    loss = loss_fn(model(xb), yb)
                    loss.backward()
                    return loss.detach()

                loss = closure() if sam_rho is None else sam_gradient(params, closure, sam_rho, adaptive, sam_eta)
                opt.step()
                steps += 1
                total += float(loss)
    finally:
        for n, p in named.items():
            p.requires_grad_(saved[n])
    return LocalResult(steps, total / max(steps, 1))


# ---------------------------------------------------------------------------------- privacy
def client_level_mechanism(cfg: Mapping[str, Any], num_clients: int) -> ClientLevelDP:
    """The run's mechanism from the shared client-level keys (one implementation for the whole project:
    :func:`strategies.client_dp.mechanism_from_config`): r = clients-per-round (0 → all N),
    T = dp-rounds (0 → num-server-rounds), δ = client-delta (0 → N^-1.1, stricter than the paper's
    1/N; the benchmark passes 1/N), σ = noise-multiplier or, when 0, calibrated by the accountant so
    that T rounds at q = r/N spend target-epsilon. Server and clients derive the same σ."""
    from fedapp.config import ConfigError

    n = int(num_clients)
    if n < 2:
        raise ConfigError(f"client-level DP needs at least 2 clients, got {n}")
    try:
        return mechanism_from_config(cfg, n)
    except ValueError as exc:
        raise ConfigError(f"client-level DP: cannot set up σ for target-epsilon={cfg['target-epsilon']}, "
                          f"noise-multiplier={cfg['noise-multiplier']}, client-delta={cfg['client-delta']}, "
                          f"clients-per-round={cfg['clients-per-round']} of {n}: {exc}") from None


epsilon_after = cached_epsilon  # ε of the aggregate after t rounds (memoized; the mechanism is frozen)


def noisy_norm_bound(dp: ClientLevelDP, dim: int) -> float:
    """A norm no honest clipped + noised update exceeds (except with probability ≤ e⁻⁵⁰)."""
    return dp.clip + dp.per_client_std * (math.sqrt(dim) + NORM_SLACK_SIGMAS)


# ---------------------------------------------------------------------------------- server
class DP2FedSAMStrategy(DPFLStrategy):
    """Server of the family: holds the shared part only, φ ← φ + (1/r) Σ Δ̂_i (Alg. 2 line 25)."""

    privacy = ("client-level DP (clip C + Gaussian noise added by each client, σ on the sum of r updates, "
               "q = r/N, Opacus accountant); honest-but-curious server; personal heads never leave the client")

    def __init__(self, *, name: str, cfg: Mapping[str, Any], eval_every: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.variant = get_variant(name)
        self.cfg = dict(cfg)
        self.eval_every = max(1, int(eval_every))
        self.dp: ClientLevelDP | None = None

    def configure_fit(self, server_round: int, parameters, client_manager: ClientManager):
        if self.dp is None:  # before round 1: calibration errors stop the run before any training
            client_manager.wait_for(self.min_available_clients)
            self.dp = client_level_mechanism(self.cfg, client_manager.num_available())
        return super().configure_fit(server_round, parameters, client_manager)

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        super().validate_update(update, metrics)
        if self.dp is not None:
            bound = noisy_norm_bound(self.dp, update.size)
            norm = float(np.linalg.norm(update))
            if norm > bound:
                raise RejectedUpdate(f"update norm {norm:.4g} exceeds {bound:.4g} = C + noise bound "
                                     f"(C={self.dp.clip}, per-client noise std {self.dp.per_client_std:.4g})")

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        extra: dict[str, Any] = {}
        if self.dp is not None:
            extra.update(noise_multiplier=self.dp.noise_multiplier, clip_norm=self.dp.clip,
                         epsilon=epsilon_after(self.dp, server_round), epsilon_individual=self.dp.epsilon_individual(server_round),
                         delta=self.dp.delta, sample_rate=self.dp.sample_rate)
        norms = [float(u.metrics["local_update_norm"]) for u in updates if "local_update_norm" in u.metrics]
        if norms:  # Figure 5 diagnostic, only present when clients opt in (dp2-report-norms)
            extra.update(mean_local_update_norm=float(np.mean(norms)), std_local_update_norm=float(np.std(norms)),
                         clipped_fraction=float(np.mean([n > (self.dp.clip if self.dp else math.inf) for n in norms])))
        return np.ones(len(updates)), extra  # uniform 1/r (Alg. 1 line 13, Alg. 2 line 25)

    def configure_evaluate(self, server_round: int, parameters, client_manager: ClientManager):
        actual = self._actual_round(server_round)  # run-wide round (continues after a resume)
        if actual % self.eval_every and actual != self.num_rounds:
            self._flush_pending()
            return []
        return super().configure_evaluate(server_round, parameters, client_manager)


def build_variant(name: str, cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    from fedapp.clients.dp2_fedsam import shared_weights

    variant = get_variant(name)
    kwargs = common_kwargs(cfg, ctx)
    kwargs["initial_weights"] = shared_weights(cfg, ctx.initial_weights, variant.personalized)
    if variant.personalized:
        kwargs["evaluate_fn"] = None  # no global head: accuracy is the personalized client_accuracy
    return DP2FedSAMStrategy(name=name, cfg=cfg, eval_every=int(cfg["dp2-eval-every"]), **kwargs)


def build_dp2_fedsam(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_variant("dp2-fedsam", cfg, ctx)


def build_centaur(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_variant("centaur", cfg, ctx)


def build_dp_fedsam(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_variant("dp-fedsam", cfg, ctx)


def build_dp_fedsam_ft(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_variant("dp-fedsam-ft", cfg, ctx)


def build_dp_fedavg_ft(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_variant("dp-fedavg-ft", cfg, ctx)

